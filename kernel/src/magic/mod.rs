//! The kernel's `%` magics. Each runs natively in the kernel process and
//! answers with a MIME bundle; bad arguments are a short usage error.

mod doc;
mod help;
mod lsmagic;
pub mod mem;
mod oomcheck;
mod summary;

use vramlab::memory::CellProbe;
use vramlab::render::Bundle;

use crate::outcome::CellError;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Line,
}

/// What a magic asks for: a bundle it made itself, documentation that only
/// the engine (rust-analyzer) can look up, shown in the pager, or Rust code
/// that must run where the cells' variables live, its value the result.
#[derive(Debug, Clone, PartialEq)]
pub enum Invocation {
    Show(Bundle),
    PageDocs(String),
    Evaluate(String),
}

/// What a magic may read besides its arguments, handed in by whoever runs it.
#[derive(Clone, Copy, Default)]
pub struct Context<'a> {
    /// The cell process's memory counters; `None` where they could not be set up.
    pub probe: Option<&'a CellProbe>,
    /// The variables the cells keep.
    pub variables: &'a [String],
}

pub struct Magic {
    pub name: &'static str,
    pub kind: Kind,
    pub summary: &'static str,
    pub usage: &'static str,
    run: fn(&Context<'_>, &[String]) -> Result<Invocation, String>,
}

pub const MAGICS: &[Magic] = &[lsmagic::MAGIC, help::MAGIC, doc::MAGIC, summary::MAGIC, oomcheck::MAGIC, mem::MAGIC];

pub fn find(name: &str) -> Result<&'static Magic, CellError> {
    MAGICS.iter().find(|m| m.name == name).ok_or_else(|| unknown(name))
}

/// Runs a line magic.
pub fn run(context: &Context<'_>, name: &str, args: &[String]) -> Result<Invocation, CellError> {
    let magic = find(name)?;
    (magic.run)(context, args).map_err(|message| usage_error(magic, &message))
}

/// A `%%` cell magic other than `%%mem` (which `cell::split` expands into
/// its cell and a `%mem --last-cell`): none takes a cell body.
pub fn run_cell(name: &str) -> Result<Invocation, CellError> {
    let magic = find(name)?;
    Err(usage_error(magic, &format!("%{name} is a line magic; write it as `%{name} ...`, not `%%{name}`")))
}

/// Whether a variable's magic asks for the measured report (`--input SHAPE`).
fn asks_for_input(args: &[String]) -> bool {
    args.iter().any(|a| a == "--input" || a.starts_with("--input="))
}

/// The cell that runs `method` (`vramlab_summary`, `vramlab_oomcheck`) on a
/// cell's variable: the method of the first of `BySpec`, `ByModule` and
/// `ByNothing` that its type meets (`vramlab::cli::Target`), so that a value
/// that is not a model is a one-line usage error, not a compiler error.
fn of_variable(variable: &str, method: &str, args: &[String]) -> String {
    let words: Vec<String> = args.iter().map(|a| format!("{a:?}")).collect();
    format!(
        "({{ use vramlab::cli::{{ByModule as _, ByNothing as _, BySpec as _}}; (&&vramlab::cli::Target(&{variable}, {variable:?})).{method}(&[{}]) }})?",
        words.join(", ")
    )
}

pub fn usage_error(magic: &Magic, message: &str) -> CellError {
    CellError::new("UsageError", message, vec![format!("\x1b[1;31mUsageError\x1b[0m: {message}"), format!("usage: {}", magic.usage)])
}

/// Whether a model magic's first word means a cell's variable: one the cells
/// keep, unless its name is a zoo model's and the arguments are the zoo's
/// (`--input` with flags only the zoo takes, or no `--input`), so that a
/// learner's `resnet18` is theirs with `--input`, and the zoo's stays one
/// `--batch` or `--depth` away; otherwise any identifier that is not a zoo
/// model's name nor a near miss of one. `variable_parses`: the arguments are
/// a variable's; `zoo_takes_input`: the zoo's form takes `--input` too. Where
/// it does not, a zoo name with `--input` and no such variable is an error
/// that says both.
fn means_a_variable(
    context: &Context<'_>,
    word: &str,
    args: &[String],
    variable_parses: bool,
    zoo_takes_input: bool,
) -> Result<bool, String> {
    let kept = context.variables.iter().any(|v| v == word);
    let zoo = names_a_zoo_model(word);
    if kept && (!zoo || (asks_for_input(args) && (variable_parses || !zoo_takes_input))) {
        return Ok(true);
    }
    if zoo && asks_for_input(args) && !zoo_takes_input {
        return Err(format!(
            "no variable of the cells is named `{word}`, and the zoo's models take --batch and --res, not --input: \
             --input SHAPE measures a model built in a cell"
        ));
    }
    Ok(!zoo && is_identifier(word))
}

fn is_identifier(word: &str) -> bool {
    let mut chars = word.chars();
    chars.next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_') && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// Whether `word` names a zoo model or is a near miss of one (within two
/// edits, its first letter kept): such a word gets the model parser's
/// message with the valid names; any other identifier is a cell's variable.
/// The first letter keeps a short variable name such as `net` (one edit
/// from `unet`) a variable.
pub(super) fn names_a_zoo_model(word: &str) -> bool {
    let word = word.to_lowercase();
    vramlab::models::ModelName::ALL
        .iter()
        .any(|m| m.as_str().chars().next() == word.chars().next() && strsim::levenshtein(&word, m.as_str()) <= 2)
}

fn unknown(name: &str) -> CellError {
    let closest = MAGICS
        .iter()
        .map(|m| (strsim::levenshtein(name, m.name), m.name))
        .filter(|(d, _)| *d <= (name.len() / 3).max(1))
        .min()
        .map(|(_, n)| format!(" (did you mean %{n}?)"))
        .unwrap_or_default();
    let message = format!("unknown magic %{name}{closest}; %lsmagic lists the magics");
    CellError::new("UsageError", message.clone(), vec![format!("\x1b[1;31mUsageError\x1b[0m: {message}")])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_magics_suggest_the_closest() {
        let err = run(&Context::default(), "lsmagik", &[]).unwrap_err();
        assert_eq!(err.ename, "UsageError");
        assert_eq!(err.evalue, "unknown magic %lsmagik (did you mean %lsmagic?); %lsmagic lists the magics");
        assert_eq!(run(&Context::default(), "zzzzzzzz", &[]).unwrap_err().evalue, "unknown magic %zzzzzzzz; %lsmagic lists the magics");
    }

    #[test]
    fn every_magic_has_help() {
        for magic in MAGICS {
            assert!(magic.usage.starts_with(&format!("%{}", magic.name)), "{}", magic.name);
            assert!(!magic.summary.is_empty());
        }
    }
}
