//! Text that came from a guest (its agent's answers, its console) or from a
//! record an older Keel stored: shown on an operator's terminal, it must
//! not be able to drive that terminal. A guest that names itself
//! `\x1b]0;pwned\x07` would otherwise set the operator's window title, and
//! U+202E would make what follows read backwards.
//!
//! Such characters are replaced by a visible escape (`\x1b`, `\u{202e}`)
//! rather than dropped, so the operator sees that the guest sent them.

use std::borrow::Cow;

/// Whether `c` can change what a terminal does or how the text around it
/// reads: C0 and C1 controls, DEL, bidirectional overrides and isolates,
/// and the Unicode line and paragraph separators.
pub fn is_unsafe_char(c: char) -> bool {
    c.is_control()
        || matches!(
            c,
            '\u{061c}'
                | '\u{200e}'
                | '\u{200f}'
                | '\u{2028}'
                | '\u{2029}'
                | '\u{202a}'..='\u{202e}'
                | '\u{2066}'..='\u{2069}'
        )
}

fn push_escape(out: &mut String, c: char) {
    use std::fmt::Write as _;
    if (c as u32) < 0x80 {
        let _ = write!(out, "\\x{:02x}", c as u32);
    } else {
        let _ = write!(out, "\\u{{{:x}}}", c as u32);
    }
}

/// `text` with every [unsafe character](is_unsafe_char) escaped, newlines
/// and tabs included: for one-line values (a hostname, a table cell).
pub fn terminal_safe(text: &str) -> Cow<'_, str> {
    if !text.chars().any(is_unsafe_char) {
        return Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 8);
    for c in text.chars() {
        if is_unsafe_char(c) {
            push_escape(&mut out, c);
        } else {
            out.push(c);
        }
    }
    Cow::Owned(out)
}

/// A guest's console output made safe for a terminal: lines stay lines
/// (`\n`, `\t` and the `\r` of a CR-LF pass), every other control character
/// is escaped, and bytes that are not UTF-8 show as `\xNN`.
pub fn terminal_safe_log(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len());
    let mut rest = bytes;
    while !rest.is_empty() {
        let (valid, invalid) = match std::str::from_utf8(rest) {
            Ok(all) => (all, &[][..]),
            Err(e) => {
                let (good, bad) = rest.split_at(e.valid_up_to());
                let bad_len = e.error_len().unwrap_or(bad.len());
                (
                    std::str::from_utf8(good).expect("checked as UTF-8"),
                    &bad[..bad_len],
                )
            }
        };
        let mut chars = valid.chars().peekable();
        while let Some(c) = chars.next() {
            let keep = matches!(c, '\n' | '\t') || (c == '\r' && chars.peek() == Some(&'\n'));
            if keep || !is_unsafe_char(c) {
                out.push(c);
            } else {
                push_escape(&mut out, c);
            }
        }
        for b in invalid {
            use std::fmt::Write as _;
            let _ = write!(out, "\\x{b:02x}");
        }
        rest = &rest[valid.len() + invalid.len()..];
    }
    out
}

/// At most `max` bytes of `text`, cut at a character boundary and marked
/// with `…` when cut, so a guest's over-long answer costs a bounded part of
/// a record.
pub fn bounded(text: &str, max: usize) -> Cow<'_, str> {
    if text.len() <= max {
        return Cow::Borrowed(text);
    }
    const MARK: &str = "…";
    let mut end = max.saturating_sub(MARK.len());
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    Cow::Owned(format!("{}{MARK}", &text[..end]))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escapes_what_drives_a_terminal_and_keeps_the_rest() {
        let hostile = "web\x1b]0;pwned\x07\x1b[2J\u{202e}gpj.exe\u{9b}31m\x7f";
        let safe = terminal_safe(hostile);
        assert_eq!(
            safe,
            "web\\x1b]0;pwned\\x07\\x1b[2J\\u{202e}gpj.exe\\u{9b}31m\\x7f"
        );
        assert!(!safe.chars().any(is_unsafe_char));
        assert!(matches!(terminal_safe("web-1 é ü 名前"), Cow::Borrowed(_)));
        assert_eq!(terminal_safe("a\nb\tc"), "a\\x0ab\\x09c");
    }

    #[test]
    fn logs_keep_their_lines_and_lose_their_escapes() {
        let log = b"boot\r\nok\tfine\n\x1b[2Jtitle\x1b]0;x\x07 cr\roverwrite \xff\xfe end\n";
        assert_eq!(
            terminal_safe_log(log),
            "boot\r\nok\tfine\n\\x1b[2Jtitle\\x1b]0;x\\x07 cr\\x0doverwrite \\xff\\xfe end\n"
        );
        assert_eq!(terminal_safe_log("née\n".as_bytes()), "née\n");
        // A character split by the end of the buffer is shown, not lost.
        assert_eq!(terminal_safe_log(&"é".as_bytes()[..1]), "\\xc3");
    }

    #[test]
    fn bounded_cuts_at_a_character_boundary() {
        assert_eq!(bounded("short", 15), "short");
        let long = "é".repeat(100);
        let cut = bounded(&long, 16);
        assert!(cut.len() <= 16, "{cut}");
        assert!(cut.ends_with('…'));
        assert_eq!(bounded("abcdefghij", 6), "abc…");
    }
}
