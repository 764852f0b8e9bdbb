//! Splitting a cell into Rust code and the kernel's magic lines.
//!
//! A line whose first non-blank characters are `%` and a letter is a line
//! magic (`%lsmagic`); a cell whose first line starts with `%%` is a cell
//! magic applied to the rest of the cell. Everything else is Rust for evcxr,
//! including its own `:dep`/`:vars` commands.

#[derive(Debug, Clone, PartialEq)]
pub enum Segment {
    Rust(String),
    Magic { name: String, args: Vec<String> },
    CellMagic { name: String, args: Vec<String>, body: String },
}

#[derive(Debug, thiserror::Error, PartialEq)]
#[error("cannot read the arguments of `{line}`: unbalanced quotes")]
pub struct SplitError {
    pub line: String,
}

pub fn split(code: &str) -> Result<Vec<Segment>, SplitError> {
    let trimmed = code.trim_start();
    if let Some(rest) = trimmed.strip_prefix("%%") {
        let (first, body) = rest.split_once('\n').unwrap_or((rest, ""));
        let (name, args) = words(first, trimmed)?;
        if name == "mem" {
            return Ok(measured(body, args));
        }
        return Ok(vec![Segment::CellMagic { name, args, body: body.to_owned() }]);
    }
    let mut segments = Vec::new();
    let mut rust = String::new();
    for line in code.split_inclusive('\n') {
        match magic_line(line) {
            Some(text) => {
                if !rust.trim().is_empty() {
                    segments.push(Segment::Rust(std::mem::take(&mut rust)));
                }
                rust.clear();
                let (name, args) = words(text, line.trim())?;
                segments.push(Segment::Magic { name, args });
            }
            None => rust.push_str(line),
        }
    }
    if !rust.trim().is_empty() {
        segments.push(Segment::Rust(rust));
    }
    Ok(segments)
}

/// `%%mem`: the cell's Rust, then `%mem --last-cell` to report what it
/// did (the engine measures every Rust cell). Arguments go to `%mem`, which
/// rejects them.
fn measured(body: &str, args: Vec<String>) -> Vec<Segment> {
    let mut segments = Vec::new();
    if !body.trim().is_empty() {
        segments.push(Segment::Rust(body.to_owned()));
    }
    let args = std::iter::once(crate::magic::mem::CELL_REPORT.to_owned()).chain(args).collect();
    segments.push(Segment::Magic { name: "mem".into(), args });
    segments
}

fn magic_line(line: &str) -> Option<&str> {
    let text = line.trim().strip_prefix('%')?;
    text.starts_with(|c: char| c.is_ascii_alphabetic()).then_some(text)
}

fn words(text: &str, line: &str) -> Result<(String, Vec<String>), SplitError> {
    let mut words = shlex::split(text).ok_or_else(|| SplitError { line: line.to_owned() })?.into_iter();
    let name = words.next().unwrap_or_default();
    Ok((name, words.collect()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn magic(name: &str, args: &[&str]) -> Segment {
        Segment::Magic { name: name.into(), args: args.iter().map(|s| s.to_string()).collect() }
    }

    #[test]
    fn magic_lines_split_the_rust_around_them() {
        let cell = "let x = 1;\n%help lsmagic\nlet y = x % 2;\n  %lsmagic\n";
        assert_eq!(
            split(cell).unwrap(),
            vec![
                Segment::Rust("let x = 1;\n".into()),
                magic("help", &["lsmagic"]),
                Segment::Rust("let y = x % 2;\n".into()),
                magic("lsmagic", &[]),
            ]
        );
    }

    #[test]
    fn arguments_follow_shell_quoting() {
        assert_eq!(split("%oomcheck resnet50 --gpu 'RTX 4090'").unwrap(), vec![magic("oomcheck", &["resnet50", "--gpu", "RTX 4090"])]);
        assert!(split("%oomcheck 'unclosed").is_err());
    }

    #[test]
    fn a_percent_that_is_not_a_magic_stays_rust() {
        assert_eq!(split("10\n% 3").unwrap(), vec![Segment::Rust("10\n% 3".into())]);
    }

    #[test]
    fn cell_magics_take_the_whole_body() {
        assert_eq!(
            split("%%time --plot\nlet v = vec![0u8; 10];\n").unwrap(),
            vec![Segment::CellMagic { name: "time".into(), args: vec!["--plot".into()], body: "let v = vec![0u8; 10];\n".into() }]
        );
    }

    #[test]
    fn a_mem_cell_runs_its_body_then_reports_on_it() {
        assert_eq!(
            split("%%mem\nlet v = vec![0u8; 10];\n").unwrap(),
            vec![Segment::Rust("let v = vec![0u8; 10];\n".into()), magic("mem", &["--last-cell"])]
        );
        assert_eq!(split("%%mem --plot").unwrap(), vec![magic("mem", &["--last-cell", "--plot"])]);
    }
}
