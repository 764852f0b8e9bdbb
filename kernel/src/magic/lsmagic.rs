use vramlab::render::{Render, Table};

use super::{Invocation, Kind, Magic, MAGICS};

pub const MAGIC: Magic = Magic {
    name: "lsmagic",
    kind: Kind::Line,
    summary: "list the kernel's magics",
    usage: "%lsmagic",
    run: |_, args| {
        if let Some(extra) = args.first() {
            return Err(format!("%lsmagic takes no arguments (got `{extra}`)"));
        }
        Ok(Invocation::Show(table().bundle()))
    },
};

fn table() -> Table {
    let mut table = Table::new(["magic", "kind", "what it does"]).title("Magics of the vramlab kernel");
    for magic in MAGICS {
        let kind = match magic.kind {
            Kind::Line => "line",
        };
        table.push_row([format!("%{}", magic.name), kind.to_owned(), magic.summary.to_owned()]);
    }
    table.note("Lines starting with `:` are evcxr commands (`:dep`, `:vars`, `:help`).").note("%help NAME shows how to call a magic.")
}

#[cfg(test)]
mod tests {
    use crate::magic::Context;

    #[test]
    fn lists_every_magic() {
        let super::Invocation::Show(bundle) = (super::MAGIC.run)(&Context::default(), &[]).unwrap() else { panic!("expected a bundle") };
        for magic in super::MAGICS {
            assert!(bundle.text().contains(&format!("%{}", magic.name)));
        }
        assert!((super::MAGIC.run)(&Context::default(), &["x".into()]).is_err());
    }
}
