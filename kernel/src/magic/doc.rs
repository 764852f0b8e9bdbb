use super::{Invocation, Kind, Magic};

pub const MAGIC: Magic = Magic {
    name: "doc",
    kind: Kind::Line,
    summary: "show the documentation of a Rust item in the pager: %doc std::vec::Vec",
    usage: "%doc PATH   (a type, function, method or variable, e.g. %doc Vec::with_capacity)",
    run: |_, args| match args {
        [path] if !path.is_empty() => Ok(Invocation::PageDocs(path.clone())),
        _ => Err("%doc takes one item path, e.g. %doc std::vec::Vec".into()),
    },
};

#[cfg(test)]
mod tests {
    use super::*;
    use crate::magic::Context;

    #[test]
    fn takes_exactly_one_path() {
        assert_eq!((MAGIC.run)(&Context::default(), &["Vec::new".into()]).unwrap(), Invocation::PageDocs("Vec::new".into()));
        assert!((MAGIC.run)(&Context::default(), &[]).is_err());
        assert!((MAGIC.run)(&Context::default(), &["a".into(), "b".into()]).is_err());
    }
}
