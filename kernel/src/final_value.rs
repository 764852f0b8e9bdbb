//! A cell's final value shown after one compile instead of two.
//!
//! evcxr compiles a cell that ends in an expression as
//! `(value).evcxr_display()` first, and only when that fails (for every type
//! without such a method: integers, strings, vectors, ...) compiles it again
//! with the value formatted by `:fmt`'s format. Giving every `Debug` type an
//! `evcxr_display` that prints what that second compile would print makes the
//! first compile succeed. Types with their own `evcxr_display` keep it: an
//! inherent method wins over a trait's. Formats other than `{:?}` and `{:#?}`,
//! and `:types`, need evcxr's own path, so the trait then loses its method.

/// The display settings evcxr's `:fmt` and `:types` commands control.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct FinalValue {
    format: String,
    types: bool,
}

/// What a cell's leading `:` commands do to the settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct AfterCell {
    pub settings: FinalValue,
    /// `:clear` forgets every item, this trait too.
    pub cleared: bool,
}

const DEFAULT_FORMAT: &str = "{:?}";
const TRAIT: &str = "VramlabFinalValue";

impl Default for FinalValue {
    fn default() -> Self {
        FinalValue { format: DEFAULT_FORMAT.to_owned(), types: false }
    }
}

impl FinalValue {
    /// The settings once `code`'s commands have run. evcxr reads commands
    /// from the lines before the first line of Rust, skipping blank lines,
    /// `//` comments and `!` shell lines.
    pub fn after(&self, code: &str) -> AfterCell {
        let mut settings = self.clone();
        let mut cleared = false;
        for line in code.lines() {
            let command = line.trim_start_matches(' ');
            if line.starts_with('!') || line.starts_with("//") || line.trim().is_empty() {
                continue;
            }
            if !command.starts_with(':') {
                break;
            }
            let (name, args) = match command.split_once(' ') {
                Some((name, rest)) => (name, Some(rest.trim_start_matches(' ')).filter(|a| !a.is_empty())),
                None => (command, None),
            };
            match name {
                ":fmt" => settings.format = args.unwrap_or(DEFAULT_FORMAT).to_owned(),
                ":types" => settings.types = !settings.types,
                ":clear" => cleared = true,
                _ => {}
            }
        }
        AfterCell { settings, cleared }
    }

    /// Whether a `Debug` value can be shown without evcxr's second compile.
    fn one_compile(&self) -> bool {
        !self.types && (self.format == "{:?}" || self.format == "{:#?}")
    }

    /// The cell that defines the trait for these settings. Each definition
    /// replaces the last: evcxr keeps an item, and the impl after it in the
    /// same cell, under the item's name.
    pub fn definition(&self) -> String {
        if !self.one_compile() {
            return format!("trait {TRAIT} {{}}");
        }
        let format = &self.format;
        format!(
            r#"trait {TRAIT} {{
    fn evcxr_display(&self);
}}
impl<T: ?Sized + std::fmt::Debug> {TRAIT} for T {{
    fn evcxr_display(&self) {{
        use std::io::Write;
        let text = format!("{format}", self);
        let mut out = std::io::stdout().lock();
        if let Err(error) = write!(out, "EVCXR_BEGIN_CONTENT text/plain\n{{text}}\nEVCXR_END_CONTENT\n") {{
            eprintln!("Failed to send content to parent: {{error:?}}");
            std::process::exit(1);
        }}
    }}
}}"#
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn leading_commands_change_the_settings_in_order() {
        let start = FinalValue::default();
        let after = start.after(":fmt {:#?}\n:types\n\nvec![1]");
        assert_eq!(after.settings, FinalValue { format: "{:#?}".into(), types: true });
        assert!(!after.cleared);
        assert!(!after.settings.after(":types").settings.types);
        assert_eq!(after.settings.after(":fmt").settings.format, "{:?}");
        assert!(start.after("// note\n:clear").cleared);
    }

    #[test]
    fn commands_after_rust_code_are_not_commands() {
        let start = FinalValue::default();
        assert_eq!(start.after("let x = 1;\n:types").settings, start);
        assert_eq!(start.after("1 + 1").settings, start);
        assert_eq!(start.after("!ls\n  :fmt {}").settings.format, "{}");
    }

    #[test]
    fn only_debug_formats_without_types_take_one_compile() {
        let start = FinalValue::default();
        assert!(start.definition().contains("format!(\"{:?}\", self)"));
        assert!(start.after(":fmt {:#?}").settings.definition().contains("format!(\"{:#?}\", self)"));
        for other in [":fmt {}", ":fmt {:x}", ":types"] {
            assert_eq!(start.after(other).settings.definition(), format!("trait {TRAIT} {{}}"), "{other}");
        }
    }
}
