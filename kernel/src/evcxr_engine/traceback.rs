//! What went wrong in a cell, as Jupyter shows it: compile errors with the
//! cell's own lines, panics with the cell's frames, `?` errors, interrupts and
//! a dead cell process with the variables lost.

use std::collections::BTreeSet;

use evcxr::CompilationError;
use serde::Deserialize;

use crate::outcome::CellError;

fn list(names: &BTreeSet<String>) -> String {
    if names.is_empty() {
        "none".to_owned()
    } else {
        names.iter().cloned().collect::<Vec<_>>().join(", ")
    }
}

const KEPT: &str = "Kept: functions, types, `use` statements and :dep crates defined so far.";

pub(super) fn interrupted_error(lost: &BTreeSet<String>) -> CellError {
    CellError::new(
        "Interrupted",
        "the cell was interrupted; its process was stopped and started again",
        vec![
            "\x1b[1;31mInterrupted\x1b[0m: the cell process was stopped and started again.".into(),
            format!("Variables lost: {}.", list(lost)),
            KEPT.into(),
        ],
    )
}

pub(super) fn process_died(lost: &BTreeSet<String>, detail: &str) -> CellError {
    let status = detail.lines().last().unwrap_or(detail).trim().to_owned();
    let mut traceback = vec![format!("\x1b[1;31mThe cell process died\x1b[0m: {status}")];
    traceback.extend(detail.lines().rev().skip(1).collect::<Vec<_>>().into_iter().rev().map(str::to_owned));
    traceback.push(format!("Variables lost: {}.", list(lost)));
    traceback.push(KEPT.into());
    traceback.push("A new cell process has started: the next cell runs normally.".into());
    CellError::new("CellProcessDied", format!("the cell process died ({status}); its variables were lost"), traceback)
}

/// A cell that returned early through `?`.
pub(super) fn returned_error(error: evcxr::UserError) -> CellError {
    let traceback = vec![
        format!("\x1b[1;31m{}\x1b[0m: {}", error.type_name, error.message),
        "returned by `?` in this cell.".into(),
        "Variables from earlier cells are kept; those this cell was defining are not.".into(),
    ];
    CellError::new(&error.type_name, error.message, traceback)
}

pub(super) fn compilation_error(errors: &[CompilationError], code: &str) -> CellError {
    let lines: Vec<&str> = code.lines().collect();
    let mut traceback = Vec::new();
    for error in errors {
        let code_tag = error.code().map(|c| format!("[{c}]")).unwrap_or_default();
        traceback.push(format!("\x1b[1;31merror{code_tag}\x1b[0m: {}", error.message()));
        for spanned in error.spanned_messages() {
            let Some(span) = spanned.span else { continue };
            traceback.push(format!("  --> cell:{}:{}", span.start_line, span.start_column));
            if let Some(source) = lines.get(span.start_line.saturating_sub(1)) {
                let width = if span.end_line == span.start_line {
                    span.end_column.saturating_sub(span.start_column).max(1)
                } else {
                    source.chars().count().saturating_sub(span.start_column.saturating_sub(1)).max(1)
                };
                traceback.push(format!("   | {source}"));
                traceback.push(format!(
                    "   | {}\x1b[1;31m{}\x1b[0m {}",
                    " ".repeat(span.start_column.saturating_sub(1)),
                    "^".repeat(width),
                    spanned.label
                ));
            }
        }
        for help in error.help() {
            traceback.push(format!("   = help: {help}"));
        }
        if let Some(hint) = error.evcxr_extra_hint() {
            traceback.push(format!("   = hint: {hint}"));
        }
    }
    let first = errors.first().map(|e| e.message()).unwrap_or_else(|| "the cell did not compile".into());
    let evalue = match errors.len() {
        0 | 1 => first,
        n => format!("{first} (and {} more)", n - 1),
    };
    CellError::new("CompilationError", evalue, traceback)
}

/// A panic reported by the hook installed in the cell process.
#[derive(Debug, Deserialize)]
pub(super) struct PanicReport {
    thread: String,
    pub(super) cell_thread: bool,
    message: String,
    location: String,
    backtrace: String,
}

impl PanicReport {
    /// Where the panic happened, in the user's terms: evcxr compiles a cell
    /// into a generated `src/lib.rs`, whose line numbers are not the cell's.
    fn place(&self) -> String {
        if self.location.starts_with("src/lib.rs:") {
            "in this cell".to_owned()
        } else {
            format!("at {}", self.location)
        }
    }

    pub(super) fn into_error(self) -> CellError {
        let mut traceback = vec![format!("\x1b[1;31mpanic\x1b[0m {}: {}", self.place(), self.message)];
        let frames = user_frames(&self.backtrace);
        if !frames.is_empty() {
            traceback.push("backtrace (cell code):".into());
            traceback.extend(frames);
        }
        traceback.push("Variables from earlier cells are kept; those this cell was defining are not.".into());
        CellError::new("panic", self.message, traceback)
    }

    pub(super) fn as_stderr(&self) -> String {
        format!("thread '{}' panicked {}:\n{}\n", self.thread, self.place(), self.message)
    }
}

/// The frames of a backtrace that belong to cell code, not to the standard
/// library or evcxr's machinery.
fn user_frames(backtrace: &str) -> Vec<String> {
    let machinery = [
        "std::",
        "core::",
        "alloc::",
        "evcxr",
        "__rust",
        "rust_begin_unwind",
        "<alloc::",
        "<core::",
        "<std::",
        "_start",
        "__libc",
        "vramlab_kernel::",
        "main",
        "run_user_code",
        "ctx::run_user_code",
    ];
    backtrace
        .lines()
        .map(str::trim)
        .filter_map(|line| line.split_once(": ").filter(|(n, _)| n.chars().all(|c| c.is_ascii_digit())).map(|(_, f)| f))
        .filter(|frame| !machinery.iter().any(|m| frame.starts_with(m)))
        .take(12)
        // Cells compile into a crate named `ctx`.
        .map(|frame| format!("  {}", frame.strip_prefix("ctx::").unwrap_or(frame)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backtraces_keep_only_cell_frames() {
        let bt = "   0: std::backtrace::Backtrace::force_capture\n             at /rustc/x/library/std/src/backtrace.rs:1\n   \
                  1: run_user_code_3::{{closure}}\n   2: user_code_3::divide\n   3: core::ops::function::FnOnce::call_once\n   \
                  4: vramlab_kernel::main\n   5: main\n   6: ctx::run_user_code_1::{{closure}}\n   7: ctx::area\n";
        assert_eq!(user_frames(bt), vec!["  user_code_3::divide", "  area"]);
    }
}
