//! Rendering for `-o table|json|yaml`. YAML uses `serde_yaml_ng`, the
//! maintained fork of the archived `serde_yaml` (`serde_yml` carries an
//! unsoundness advisory and is unmaintained).
//!
//! Much of what is printed came from guests (host names, interfaces,
//! reasons quoting an agent) or from records older Keels stored unchecked,
//! so every form escapes what could drive a terminal
//! ([`keel_api::untrusted`]): tables and fields cell by cell, JSON as
//! `\uXXXX` (the same JSON to a parser), YAML as its emitter's escapes.

use std::fmt::Write as _;

use anyhow::Context;
use serde::Serialize;

use keel_api::untrusted;

use crate::args::OutputFormat;

/// Prints `value` as JSON or YAML, or calls `table` for the human form.
pub fn print<T: Serialize>(
    format: OutputFormat,
    value: &T,
    table: impl FnOnce() -> String,
) -> anyhow::Result<()> {
    print!("{}", render(format, value, table)?);
    Ok(())
}

pub fn render<T: Serialize>(
    format: OutputFormat,
    value: &T,
    table: impl FnOnce() -> String,
) -> anyhow::Result<String> {
    Ok(match format {
        OutputFormat::Table => table(),
        OutputFormat::Json => {
            let mut s =
                json_terminal_safe(serde_json::to_string_pretty(value).context("encoding JSON")?);
            s.push('\n');
            s
        }
        OutputFormat::Yaml => {
            let yaml = serde_yaml_ng::to_string(value).context("encoding YAML")?;
            if !yaml
                .chars()
                .any(|c| c != '\n' && untrusted::is_unsafe_char(c))
            {
                return Ok(yaml);
            }
            // The emitter escapes controls but keeps bidi overrides and
            // line separators as they are, and YAML has no escape that
            // means the same in every scalar style: those show as text.
            let mut v = serde_json::to_value(value).context("encoding YAML")?;
            escape_marks(&mut v);
            serde_yaml_ng::to_string(&v).context("encoding YAML")?
        }
    })
}

/// Every string in `v` with the unsafe characters that are not controls
/// replaced by their visible escape.
fn escape_marks(v: &mut serde_json::Value) {
    use serde_json::Value;
    let escape = |s: &str| -> String {
        s.chars()
            .map(|c| {
                if untrusted::is_unsafe_char(c) && !c.is_control() {
                    untrusted::terminal_safe(c.encode_utf8(&mut [0; 4])).into_owned()
                } else {
                    c.to_string()
                }
            })
            .collect()
    };
    match v {
        Value::String(s) => *s = escape(s),
        Value::Array(items) => items.iter_mut().for_each(escape_marks),
        Value::Object(map) => {
            let old = std::mem::take(map);
            for (k, mut item) in old {
                escape_marks(&mut item);
                map.insert(escape(&k), item);
            }
        }
        _ => {}
    }
}

/// `json` with the characters serde_json leaves as they are (DEL, C1
/// controls, bidi overrides; it escapes C0 itself, and C0 outside strings
/// is JSON's own whitespace) written as `\uXXXX`. They can only occur
/// inside strings, where the escape means the same.
pub fn json_terminal_safe(json: String) -> String {
    use std::fmt::Write as _;
    let escaped = |c: char| c >= '\x7f' && untrusted::is_unsafe_char(c);
    if !json.chars().any(escaped) {
        return json;
    }
    let mut out = String::with_capacity(json.len() + 16);
    for c in json.chars() {
        if escaped(c) {
            // Every such character is in the BMP: one \u escape each.
            let _ = write!(out, "\\u{:04x}", c as u32);
        } else {
            out.push(c);
        }
    }
    out
}

/// Columns padded to their widest cell; the last column is not padded.
pub struct Table {
    header: Vec<String>,
    rows: Vec<Vec<String>>,
}

impl Table {
    pub fn new(header: &[&str]) -> Self {
        Self {
            header: header.iter().map(|h| h.to_string()).collect(),
            rows: Vec::new(),
        }
    }

    pub fn row(&mut self, cells: Vec<String>) {
        self.rows.push(
            cells
                .into_iter()
                .map(|c| untrusted::terminal_safe(&c).into_owned())
                .collect(),
        );
    }

    pub fn widths(&self) -> Vec<usize> {
        let mut widths: Vec<usize> = self.header.iter().map(|h| h.chars().count()).collect();
        for row in &self.rows {
            for (w, cell) in widths.iter_mut().zip(row) {
                *w = (*w).max(cell.chars().count());
            }
        }
        widths
    }

    pub fn render(&self) -> String {
        let widths = self.widths();
        let mut out = line(&self.header, &widths);
        for row in &self.rows {
            out.push_str(&line(row, &widths));
        }
        out
    }
}

/// One table line with the given column widths.
pub fn line(cells: &[String], widths: &[usize]) -> String {
    let mut out = String::new();
    let last = cells.len().saturating_sub(1);
    for (i, cell) in cells.iter().enumerate() {
        let cell = untrusted::terminal_safe(cell);
        if i == last {
            out.push_str(&cell);
        } else {
            let width = widths.get(i).copied().unwrap_or(0);
            let _ = write!(out, "{cell:<width$}   ");
        }
    }
    out.truncate(out.trim_end().len());
    out.push('\n');
    out
}

/// `key: value` lines, keys aligned.
pub fn fields(pairs: &[(&str, String)]) -> String {
    let width = pairs.iter().map(|(k, _)| k.len() + 1).max().unwrap_or(0);
    pairs
        .iter()
        .map(|(k, v)| {
            format!(
                "{:<width$} {}\n",
                format!("{k}:"),
                untrusted::terminal_safe(v)
            )
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligns_columns() {
        let mut t = Table::new(&["NAME", "PHASE"]);
        t.row(vec!["web-long".into(), "Running".into()]);
        assert_eq!(t.render(), "NAME       PHASE\nweb-long   Running\n");
        assert_eq!(
            fields(&[("name", "a".into()), ("phase", "b".into())]),
            "name:  a\nphase: b\n"
        );
    }

    /// Whatever a guest put in a record, no form prints a character that
    /// drives a terminal, and JSON still decodes to the same value.
    #[test]
    fn every_form_escapes_what_drives_a_terminal() {
        let hostile = "web\x1b]0;pwned\x07\x1b[2J\u{9b}1m\u{202e}\x7f";
        let v = serde_json::json!({"hostname": hostile});
        let clean = |s: &str| {
            s.chars()
                .all(|c| c == '\n' || !untrusted::is_unsafe_char(c))
        };
        for format in [OutputFormat::Json, OutputFormat::Yaml] {
            let s = render(format, &v, String::new).unwrap();
            assert!(clean(&s), "{format:?}: {s:?}");
        }
        let json = render(OutputFormat::Json, &v, String::new).unwrap();
        let back: serde_json::Value = serde_json::from_str(&json).unwrap();
        assert_eq!(back, v);
        let mut t = Table::new(&["NAME", "HOST"]);
        t.row(vec![hostile.into(), "x".into()]);
        let table = t.render() + &fields(&[("hostname", hostile.into())]);
        assert!(clean(&table), "{table:?}");
        assert!(table.contains("web\\x1b]0;pwned\\x07"), "{table}");
    }

    #[test]
    fn yaml_and_json() {
        let v = serde_json::json!({"a": 1});
        assert_eq!(
            render(OutputFormat::Yaml, &v, String::new).unwrap(),
            "a: 1\n"
        );
        assert_eq!(
            render(OutputFormat::Json, &v, String::new).unwrap(),
            "{\n  \"a\": 1\n}\n"
        );
    }
}
