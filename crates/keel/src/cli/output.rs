//! Rendering for `-o table|json|yaml`. YAML uses `serde_yaml_ng`, the
//! maintained fork of the archived `serde_yaml` (`serde_yml` carries an
//! unsoundness advisory and is unmaintained).

use std::fmt::Write as _;

use anyhow::Context;
use serde::Serialize;

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
            let mut s = serde_json::to_string_pretty(value).context("encoding JSON")?;
            s.push('\n');
            s
        }
        OutputFormat::Yaml => serde_yaml_ng::to_string(value).context("encoding YAML")?,
    })
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
        self.rows.push(cells);
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
        if i == last {
            out.push_str(cell);
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
        .map(|(k, v)| format!("{:<width$} {v}\n", format!("{k}:")))
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
