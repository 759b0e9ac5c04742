//! Untrusted text (from a policy or a caller) made safe to print or log:
//! bounded, on one line, with nothing a terminal or a log reader would act on.

use std::borrow::Cow;
use std::fmt::Write;

/// `s` cut to at most `max_bytes` bytes of its own text (on a character
/// boundary, with a note of what was cut), with control characters (C0, C1,
/// DEL, so newlines and ANSI escapes too) and Unicode bidirectional and
/// invisible formatting marks written as `\u{..}` escapes. Borrowed when
/// nothing needed changing.
pub fn printable(s: &str, max_bytes: usize) -> Cow<'_, str> {
    if s.len() <= max_bytes && !s.chars().any(needs_escape) {
        return Cow::Borrowed(s);
    }
    let mut cut = max_bytes.min(s.len());
    while !s.is_char_boundary(cut) {
        cut -= 1;
    }
    let mut out = String::with_capacity(cut + 16);
    for c in s[..cut].chars() {
        match c {
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if needs_escape(c) => {
                let _ = write!(out, "\\u{{{:x}}}", c as u32);
            }
            c => out.push(c),
        }
    }
    if cut < s.len() {
        let _ = write!(out, "... ({} more bytes)", s.len() - cut);
    }
    Cow::Owned(out)
}

/// Parses TOML into `T`. An error says where (line and column) and what,
/// escaped and bounded: toml's own message quotes the whole offending line,
/// however long, and may quote a key of any length.
pub fn parse_toml<T: serde::de::DeserializeOwned>(text: &str) -> anyhow::Result<T> {
    toml::from_str(text).map_err(|e| {
        let at = e.span().map_or(String::new(), |span| {
            let before = &text.as_bytes()[..span.start.min(text.len())];
            let line = before.iter().filter(|&&b| b == b'\n').count() + 1;
            let column = before.len() - before.iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1) + 1;
            format!(" at line {line}, column {column}")
        });
        anyhow::anyhow!("TOML parse error{at}: {}", printable(e.message().trim(), 512))
    })
}

/// Control characters, and formatting marks that reorder or hide text
/// (Trojan Source: bidi embeddings, overrides and isolates; zero-width
/// characters; the byte-order mark).
fn needs_escape(c: char) -> bool {
    c.is_control()
        || matches!(c, '\u{061c}' | '\u{200b}'..='\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2060}'..='\u{2069}' | '\u{feff}')
}

/// An error message from untrusted text: printable and at most `max_bytes`.
pub fn bounded(s: String, max_bytes: usize) -> String {
    let changed = match printable(&s, max_bytes) {
        Cow::Borrowed(_) => None,
        Cow::Owned(o) => Some(o),
    };
    changed.unwrap_or(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escapes_controls_and_bidi_and_cuts() {
        assert!(matches!(printable("binpack 1.2.0", 64), Cow::Borrowed(_)));
        assert_eq!(printable("a\nINFO forged", 64), "a\\nINFO forged");
        assert_eq!(printable("\x1b[31mred", 64), "\\u{1b}[31mred");
        assert_eq!(printable("x\u{202e}y\u{2066}", 64), "x\\u{202e}y\\u{2066}");
        assert_eq!(printable("héllo", 2), "h... (5 more bytes)");
        let long = "x".repeat(1 << 20);
        assert!(printable(&long, 100).len() < 130);
    }

    proptest::proptest! {
        #[test]
        fn output_is_one_bounded_printable_line(s in "\\PC*|[\\x00-\\x1f\\u{202a}-\\u{202e}\\u{2066}-\\u{2069}a-z]{0,300}", max in 0usize..200) {
            let out = printable(&s, max);
            proptest::prop_assert!(!out.chars().any(needs_escape), "{out:?}");
            // Every kept byte becomes at most 10 (an escape), plus the note.
            proptest::prop_assert!(out.len() <= max * 10 + 32, "{} bytes for max {max}", out.len());
            if s.len() <= max && !s.chars().any(needs_escape) {
                proptest::prop_assert_eq!(out.as_ref(), s.as_str());
            }
        }
    }
}
