//! Whether a cell is ready to run: an unclosed bracket, string or block
//! comment means the user is still typing; a bracket closed by the wrong
//! kind can never compile.

use jupyter_protocol::IsCompleteReplyStatus;

pub struct Verdict {
    pub status: IsCompleteReplyStatus,
    /// Indentation for the next line when incomplete.
    pub indent: String,
}

pub fn check(code: &str) -> Verdict {
    let verdict = |status, depth: usize| Verdict { status, indent: "    ".repeat(depth) };
    let chars: Vec<char> = code.chars().collect();
    let mut open: Vec<char> = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        let next = chars.get(i + 1).copied();
        match c {
            '/' if next == Some('/') => {
                while i < chars.len() && chars[i] != '\n' {
                    i += 1;
                }
            }
            '/' if next == Some('*') => {
                let mut depth = 1;
                i += 2;
                while depth > 0 {
                    match (chars.get(i), chars.get(i + 1)) {
                        (None, _) => return verdict(IsCompleteReplyStatus::Incomplete, open.len()),
                        (Some('/'), Some('*')) => {
                            depth += 1;
                            i += 1;
                        }
                        (Some('*'), Some('/')) => {
                            depth -= 1;
                            i += 1;
                        }
                        _ => {}
                    }
                    i += 1;
                }
                continue;
            }
            'r' | 'b' | 'c' if starts_raw_string(&chars, i) => {
                let (start, hashes) = raw_string_start(&chars, i);
                match find_raw_end(&chars, start, hashes) {
                    Some(end) => {
                        i = end;
                        continue;
                    }
                    None => return verdict(IsCompleteReplyStatus::Incomplete, open.len()),
                }
            }
            '"' => {
                i += 1;
                loop {
                    match chars.get(i) {
                        None => return verdict(IsCompleteReplyStatus::Incomplete, open.len()),
                        Some('\\') => i += 2,
                        Some('"') => break,
                        Some(_) => i += 1,
                    }
                }
            }
            '\'' => {
                // A char literal ('a', '\n', '\u{1F600}') rather than a lifetime ('a).
                if next == Some('\\') {
                    if let Some(close) = chars[i + 2..].iter().position(|&c| c == '\'') {
                        i += close + 2;
                    }
                } else if chars.get(i + 2) == Some(&'\'') {
                    i += 2;
                }
            }
            '(' | '[' | '{' => open.push(c),
            ')' | ']' | '}' => {
                let expected = match c {
                    ')' => '(',
                    ']' => '[',
                    _ => '{',
                };
                if open.pop() != Some(expected) {
                    return verdict(IsCompleteReplyStatus::Invalid, 0);
                }
            }
            _ => {}
        }
        i += 1;
    }
    if open.is_empty() {
        verdict(IsCompleteReplyStatus::Complete, 0)
    } else {
        verdict(IsCompleteReplyStatus::Incomplete, open.len())
    }
}

fn starts_raw_string(chars: &[char], i: usize) -> bool {
    let word_start = i == 0 || !(chars[i - 1].is_alphanumeric() || chars[i - 1] == '_');
    let mut j = i;
    if matches!(chars[j], 'b' | 'c') {
        j += 1;
    }
    word_start && chars.get(j) == Some(&'r') && {
        let mut k = j + 1;
        while chars.get(k) == Some(&'#') {
            k += 1;
        }
        chars.get(k) == Some(&'"')
    }
}

/// The index after the opening quote and the number of `#`s.
fn raw_string_start(chars: &[char], i: usize) -> (usize, usize) {
    let mut j = i;
    while chars[j] != 'r' {
        j += 1;
    }
    let mut hashes = 0;
    j += 1;
    while chars[j] == '#' {
        hashes += 1;
        j += 1;
    }
    (j + 1, hashes)
}

fn find_raw_end(chars: &[char], start: usize, hashes: usize) -> Option<usize> {
    (start..chars.len()).find_map(|k| {
        let closes = chars[k] == '"' && (1..=hashes).all(|h| chars.get(k + h) == Some(&'#'));
        closes.then_some(k + hashes + 1)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(code: &str) -> IsCompleteReplyStatus {
        check(code).status
    }

    #[test]
    fn balanced_code_is_complete() {
        assert_eq!(status("let x = vec![1, 2];\nx.len()"), IsCompleteReplyStatus::Complete);
        assert_eq!(status("fn f<'a>(s: &'a str) -> char { '}' }"), IsCompleteReplyStatus::Complete);
        assert_eq!(status("let s = \"{ not a brace\";"), IsCompleteReplyStatus::Complete);
        assert_eq!(status("let s = r#\"a \" { b\"#;"), IsCompleteReplyStatus::Complete);
        assert_eq!(status("// {\n/* { /* nested */ */ 1"), IsCompleteReplyStatus::Complete);
        assert_eq!(status("let c = '\\u{7b}';"), IsCompleteReplyStatus::Complete);
    }

    #[test]
    fn open_brackets_strings_and_comments_are_incomplete() {
        let v = check("fn main() {\n    if true {");
        assert_eq!(v.status, IsCompleteReplyStatus::Incomplete);
        assert_eq!(v.indent, "        ");
        assert_eq!(status("let v = vec![1,"), IsCompleteReplyStatus::Incomplete);
        assert_eq!(status("let s = \"abc"), IsCompleteReplyStatus::Incomplete);
        assert_eq!(status("/* comment"), IsCompleteReplyStatus::Incomplete);
        assert_eq!(status("let s = r##\"abc\"#"), IsCompleteReplyStatus::Incomplete);
    }

    #[test]
    fn mismatched_brackets_are_invalid() {
        assert_eq!(status("let x = (1, 2];"), IsCompleteReplyStatus::Invalid);
        assert_eq!(status("fn f() { }}"), IsCompleteReplyStatus::Invalid);
    }
}
