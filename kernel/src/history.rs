//! The inputs (and plain-text outputs) of this kernel's cells, for
//! history_request: tail, range and glob search.

use jupyter_protocol::{HistoryEntry, HistoryRequest};

/// History sessions are per kernel process; this kernel's is number 1, and
/// 0 (or none) in a request means "the current session".
pub const SESSION: usize = 1;

#[derive(Default)]
pub struct History {
    cells: Vec<Cell>,
}

struct Cell {
    count: usize,
    input: String,
    output: String,
}

impl History {
    pub fn record(&mut self, count: usize, input: &str) {
        self.cells.push(Cell { count, input: input.to_owned(), output: String::new() });
    }

    pub fn set_output(&mut self, count: usize, output: &str) {
        if let Some(cell) = self.cells.iter_mut().rev().find(|c| c.count == count) {
            cell.output = output.to_owned();
        }
    }

    pub fn answer(&self, request: &HistoryRequest) -> Vec<HistoryEntry> {
        let (selected, output): (Vec<&Cell>, bool) = match request {
            HistoryRequest::Tail { n, output, .. } => {
                let n = usize::try_from(*n).unwrap_or(0);
                (self.cells[self.cells.len().saturating_sub(n)..].iter().collect(), *output)
            }
            HistoryRequest::Range { session, start, stop, output, .. } => {
                let ours = session.is_none_or(|s| s == 0 || s == SESSION as i32);
                let in_range = |c: &&Cell| c.count as i32 >= *start && (*stop <= 0 || (c.count as i32) < *stop);
                (if ours { self.cells.iter().filter(in_range).collect() } else { Vec::new() }, *output)
            }
            HistoryRequest::Search { pattern, unique, output, n, .. } => {
                let mut found: Vec<&Cell> = self.cells.iter().filter(|c| glob(pattern, &c.input)).collect();
                if *unique {
                    let mut seen = std::collections::HashSet::new();
                    found.reverse();
                    found.retain(|c| seen.insert(c.input.as_str()));
                    found.reverse();
                }
                let n = usize::try_from(*n).unwrap_or(0);
                if n > 0 {
                    found = found.split_off(found.len().saturating_sub(n));
                }
                (found, *output)
            }
        };
        selected
            .into_iter()
            .map(|c| {
                if output {
                    HistoryEntry::InputOutput(SESSION, c.count, (c.input.clone(), c.output.clone()))
                } else {
                    HistoryEntry::Input(SESSION, c.count, c.input.clone())
                }
            })
            .collect()
    }
}

/// Glob matching as sqlite's GLOB (used by IPython's history): `*` any run,
/// `?` any one character, over the whole input.
fn glob(pattern: &str, text: &str) -> bool {
    let p: Vec<char> = pattern.chars().collect();
    let t: Vec<char> = text.chars().collect();
    let (mut pi, mut ti) = (0, 0);
    let mut backtrack: Option<(usize, usize)> = None;
    while ti < t.len() {
        match p.get(pi) {
            Some('*') => {
                backtrack = Some((pi, ti));
                pi += 1;
            }
            Some(&c) if c == '?' || c == t[ti] => {
                pi += 1;
                ti += 1;
            }
            _ => match backtrack {
                Some((star, at)) => {
                    pi = star + 1;
                    ti = at + 1;
                    backtrack = Some((star, at + 1));
                }
                None => return false,
            },
        }
    }
    p[pi..].iter().all(|&c| c == '*')
}

#[cfg(test)]
mod tests {
    use super::*;

    fn history() -> History {
        let mut h = History::default();
        for (count, input) in [(1, "let a = 1;"), (2, "a + 2"), (3, "let a = 1;"), (4, "println!(\"{a}\")")] {
            h.record(count, input);
        }
        h.set_output(2, "3");
        h
    }

    fn counts(entries: &[HistoryEntry]) -> Vec<usize> {
        entries
            .iter()
            .map(|e| match e {
                HistoryEntry::Input(_, n, _) | HistoryEntry::InputOutput(_, n, _) => *n,
            })
            .collect()
    }

    #[test]
    fn tail_range_and_search() {
        let h = history();
        assert_eq!(counts(&h.answer(&HistoryRequest::Tail { n: 2, output: false, raw: true })), vec![3, 4]);
        let range = HistoryRequest::Range { session: Some(0), start: 2, stop: 4, output: true, raw: true };
        let entries = h.answer(&range);
        assert_eq!(counts(&entries), vec![2, 3]);
        assert!(matches!(&entries[0], HistoryEntry::InputOutput(_, 2, (i, o)) if i == "a + 2" && o == "3"));
        let search = |pattern: &str, unique| HistoryRequest::Search { pattern: pattern.into(), unique, output: false, raw: true, n: 0 };
        assert_eq!(counts(&h.answer(&search("let*", false))), vec![1, 3]);
        assert_eq!(counts(&h.answer(&search("let*", true))), vec![3]);
        assert_eq!(counts(&h.answer(&search("a ? 2", false))), vec![2]);
    }

    #[test]
    fn glob_matches_whole_inputs() {
        assert!(glob("1?2*", "1+2 == 3"));
        assert!(!glob("1?2", "1+2 == 3"));
        assert!(glob("*", ""));
        assert!(glob("*a*b", "xaxxb"));
        assert!(!glob("*a*b", "xaxxbc"));
    }
}
