use vramlab::render::Bundle;

use super::{Invocation, Magic, MAGICS};

pub const MAGIC: Magic = Magic {
    name: "help",
    kind: super::Kind::Line,
    summary: "show how to call a magic: %help NAME",
    usage: "%help NAME",
    run: |_, args| {
        let [name] = args else {
            return Err(format!("%help takes one magic name; magics: {}", names()));
        };
        let name = name.trim_start_matches('%');
        let magic = MAGICS.iter().find(|m| m.name == name).ok_or_else(|| format!("no magic named %{name}; magics: {}", names()))?;
        let text = format!("%{}: {}\nusage: {}", magic.name, magic.summary, magic.usage);
        let html = format!(
            "<p><code>%{}</code>: {}</p><pre>{}</pre>",
            magic.name,
            vramlab::render::escape_html(magic.summary),
            vramlab::render::escape_html(magic.usage)
        );
        Ok(Invocation::Show(Bundle::plain(text).with("text/html", html)))
    },
};

fn names() -> String {
    MAGICS.iter().map(|m| format!("%{}", m.name)).collect::<Vec<_>>().join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::magic::Context;

    #[test]
    fn shows_usage_and_rejects_unknown_names() {
        let Invocation::Show(bundle) = (MAGIC.run)(&Context::default(), &["%lsmagic".into()]).unwrap() else { panic!("expected a bundle") };
        assert_eq!(bundle.text(), "%lsmagic: list the kernel's magics\nusage: %lsmagic");
        let err = (MAGIC.run)(&Context::default(), &["mem2".into()]).unwrap_err();
        assert!(err.starts_with("no magic named %mem2; magics: %lsmagic, %help"), "{err}");
        assert!((MAGIC.run)(&Context::default(), &[]).is_err());
    }
}
