//! A cell that does not parse as Rust fails before evcxr sees it. evcxr
//! splits a cell into statements with rust-analyzer's parser and silently
//! drops what it cannot parse (`}}}`, `let = ;`), so such a cell would "run"
//! and succeed with nothing done. The cell is parsed here the way evcxr parses
//! it, as the body of a function, after its leading `:command` and `!shell`
//! lines.

use ra_ap_syntax::{Edition, SourceFile};

use crate::outcome::CellError;

/// The edition evcxr parses and compiles cells with.
const EDITION: Edition = Edition::Edition2024;
const PRELUDE: &str = "fn cell() {\n";

pub fn check(code: &str) -> Result<(), CellError> {
    let rust = without_commands(code);
    let wrapped = format!("{PRELUDE}{rust}\n}}");
    let errors = SourceFile::parse(&wrapped, EDITION).errors();
    let Some(first) = errors.first() else { return Ok(()) };
    let lines: Vec<&str> = code.lines().collect();
    let mut traceback = Vec::new();
    for error in &errors {
        let offset = usize::from(error.range().start()).saturating_sub(PRELUDE.len()).min(rust.len());
        let (line, column) = position(&rust, offset);
        traceback.push(format!("\x1b[1;31merror\x1b[0m: {error}"));
        traceback.push(format!("  --> cell:{line}:{column}"));
        if let Some(source) = lines.get(line - 1) {
            traceback.push(format!("   | {source}"));
            traceback.push(format!("   | {}\x1b[1;31m^\x1b[0m", " ".repeat(column - 1)));
        }
    }
    let evalue = match errors.len() {
        1 => first.to_string(),
        n => format!("{first} (and {} more)", n - 1),
    };
    Err(CellError::new("SyntaxError", evalue, traceback))
}

/// The cell with the lines evcxr reads as commands blanked, so that offsets
/// keep their lines: blank and `//` lines, `!shell` and `:command` lines, up
/// to the first line of Rust (evcxr reads no commands after it).
fn without_commands(code: &str) -> String {
    let mut rust = String::with_capacity(code.len());
    let mut in_commands = true;
    for line in code.split_inclusive('\n') {
        let text = line.trim_end_matches(['\n', '\r']);
        let command = text.starts_with('!') || text.trim_start_matches(' ').starts_with(':');
        in_commands &= command || text.starts_with("//") || text.trim().is_empty();
        if in_commands && command {
            rust.push_str(&line[text.len()..]);
        } else {
            rust.push_str(line);
        }
    }
    rust
}

/// 1-based line and column (in characters) of a byte offset.
fn position(text: &str, offset: usize) -> (usize, usize) {
    let before = &text[..text.floor_char_boundary(offset)];
    let line = before.matches('\n').count() + 1;
    let column = before.rsplit('\n').next().unwrap_or("").chars().count() + 1;
    (line, column)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cells_that_are_not_rust_fail_with_where() {
        for code in ["}}}", "let = ;", "let x = (1, 2];", "fn f( {"] {
            let error = check(code).expect_err(code);
            assert_eq!(error.ename, "SyntaxError");
            assert!(error.traceback.iter().any(|l| l.starts_with("  --> cell:1:")), "{code}: {:?}", error.traceback);
        }
        let error = check("let a = 1;\nlet b = ;\n").unwrap_err();
        assert!(error.traceback.iter().any(|l| l == "  --> cell:2:8" || l == "  --> cell:2:9"), "{:?}", error.traceback);
    }

    #[test]
    fn what_evcxr_accepts_passes() {
        for code in [
            "1 + 1",
            "let v = vec![1, 2];\nv.len()",
            ":dep rand = \"0.8\"\nuse rand::Rng;",
            "// a comment\n:timing\n\n!ls\nlet x = 1;",
            "#[derive(Debug)]\npub struct P { x: i32 }\nimpl P { pub fn new() -> Self { P { x: 1 } } }\nP::new()",
            "let text = std::fs::read_to_string(\"/nonexistent\")?;",
            "macro_rules! twice { ($e:expr) => { $e * 2 } }\ntwice!(3)",
            "mod m { pub fn f() {} }\nextern crate core;\nasync fn g() {}",
            "let s = \"é and ß\";\ns",
        ] {
            assert_eq!(check(code), Ok(()), "{code}");
        }
    }

    #[test]
    fn every_rust_cell_of_the_notebooks_parses() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../notebooks");
        let mut checked = 0;
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_none_or(|e| e != "ipynb") {
                continue;
            }
            let notebook: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
            for cell in notebook["cells"].as_array().unwrap().iter().filter(|c| c["cell_type"] == "code") {
                let source = match &cell["source"] {
                    serde_json::Value::Array(lines) => lines.iter().filter_map(|l| l.as_str()).collect::<String>(),
                    other => other.as_str().unwrap_or_default().to_owned(),
                };
                for segment in crate::cell::split(&source).unwrap() {
                    if let crate::cell::Segment::Rust(code) = segment {
                        assert_eq!(check(&code), Ok(()), "{}: {code}", path.display());
                        checked += 1;
                    }
                }
            }
        }
        assert!(checked > 20, "only {checked} Rust cells found");
    }
}
