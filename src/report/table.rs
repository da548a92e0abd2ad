//! A small table type that renders as a Markdown table and as CSV (every table in the report
//! is written both ways).

use anyhow::{Context, Result};
use std::path::{Path, PathBuf};

/// One cell of a [`Table`].
#[derive(Clone, Debug, PartialEq)]
pub enum Cell {
    Text(String),
    Int(i64),
    /// A number and the decimals shown in Markdown (CSV keeps the full value).
    Num(f64, usize),
    /// No value (written as an empty CSV field and `–` in Markdown).
    Empty,
}

impl Cell {
    /// A text cell.
    pub fn text(s: impl Into<String>) -> Cell {
        Cell::Text(s.into())
    }

    /// A number with `decimals` decimals in Markdown, or [`Cell::Empty`] when not finite.
    pub fn num(v: f64, decimals: usize) -> Cell {
        if v.is_finite() {
            Cell::Num(v, decimals)
        } else {
            Cell::Empty
        }
    }

    /// [`Cell::num`] of `v`, or [`Cell::Empty`] for `None`.
    pub fn opt(v: Option<f64>, decimals: usize) -> Cell {
        v.map_or(Cell::Empty, |v| Cell::num(v, decimals))
    }

    /// An integer cell.
    pub fn int(v: impl TryInto<i64>) -> Cell {
        v.try_into().map_or(Cell::Empty, Cell::Int)
    }

    fn is_numeric(&self) -> bool {
        matches!(self, Cell::Int(_) | Cell::Num(..))
    }

    /// The Markdown rendering (`|`, `<` and `>` escaped).
    pub fn markdown(&self) -> String {
        match self {
            Cell::Text(s) => md_escape(s),
            Cell::Int(v) => v.to_string(),
            Cell::Num(v, d) => format!("{v:.d$}"),
            Cell::Empty => "–".to_owned(),
        }
    }

    /// The CSV field (quoted when needed, numbers in full precision).
    pub fn csv(&self) -> String {
        match self {
            Cell::Text(s) => csv_quote(s),
            Cell::Int(v) => v.to_string(),
            Cell::Num(v, _) => v.to_string(),
            Cell::Empty => String::new(),
        }
    }
}

/// Escapes text for a Markdown table cell: `|` would end the cell, `<` could start HTML.
fn md_escape(s: &str) -> String {
    s.replace('|', "\\|")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace(['\n', '\r'], " ")
}

fn csv_quote(s: &str) -> String {
    if s.contains([',', '"', '\n', '\r']) || s.starts_with(' ') || s.ends_with(' ') {
        format!("\"{}\"", s.replace('"', "\"\""))
    } else {
        s.to_owned()
    }
}

/// A table with a file stem (for its CSV), a header row and data rows.
#[derive(Clone, Debug, PartialEq)]
pub struct Table {
    /// File stem of the CSV (`runs` → `runs.csv`).
    pub name: String,
    pub columns: Vec<String>,
    pub rows: Vec<Vec<Cell>>,
}

impl Table {
    /// An empty table with these columns.
    pub fn new(name: &str, columns: &[&str]) -> Table {
        Table {
            name: name.to_owned(),
            columns: columns.iter().map(|c| (*c).to_owned()).collect(),
            rows: Vec::new(),
        }
    }

    /// Appends a row (shorter rows are padded with [`Cell::Empty`]).
    pub fn push(&mut self, mut row: Vec<Cell>) {
        row.resize(self.columns.len().max(row.len()), Cell::Empty);
        self.rows.push(row);
    }

    /// The CSV file name.
    pub fn csv_name(&self) -> String {
        format!("{}.csv", self.name)
    }

    /// RFC 4180 CSV: the header, then one line per row.
    pub fn to_csv(&self) -> String {
        let mut s = self
            .columns
            .iter()
            .map(|c| csv_quote(c))
            .collect::<Vec<_>>()
            .join(",");
        s.push('\n');
        for r in &self.rows {
            s.push_str(&r.iter().map(Cell::csv).collect::<Vec<_>>().join(","));
            s.push('\n');
        }
        s
    }

    /// A GitHub-flavoured Markdown table; numeric columns are right-aligned.
    pub fn to_markdown(&self) -> String {
        let numeric: Vec<bool> = (0..self.columns.len())
            .map(|i| {
                let mut cells = self.rows.iter().filter_map(|r| r.get(i));
                let mut any = false;
                let all = cells.all(|c| {
                    any |= c.is_numeric();
                    c.is_numeric() || *c == Cell::Empty
                });
                all && any
            })
            .collect();
        let mut s = format!(
            "| {} |\n|{}|\n",
            self.columns
                .iter()
                .map(|c| md_escape(c))
                .collect::<Vec<_>>()
                .join(" | "),
            numeric
                .iter()
                .map(|&n| if n { "---:" } else { "---" })
                .collect::<Vec<_>>()
                .join("|")
        );
        for r in &self.rows {
            s.push_str("| ");
            s.push_str(&r.iter().map(Cell::markdown).collect::<Vec<_>>().join(" | "));
            s.push_str(" |\n");
        }
        s
    }

    /// Writes `DIR/NAME.csv` and returns its path.
    pub fn write_csv(&self, dir: &Path) -> Result<PathBuf> {
        let p = dir.join(self.csv_name());
        std::fs::write(&p, self.to_csv()).with_context(|| format!("writing {}", p.display()))?;
        Ok(p)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Table {
        let mut t = Table::new("t", &["run", "ranks", "ms"]);
        t.push(vec![
            Cell::text("a,b \"x\""),
            Cell::int(2),
            Cell::num(1.23456, 2),
        ]);
        t.push(vec![
            Cell::text("c|d<e>"),
            Cell::Empty,
            Cell::num(f64::NAN, 1),
        ]);
        t.push(vec![Cell::text("short")]);
        t
    }

    #[test]
    fn csv_quotes_and_keeps_precision() {
        let csv = sample().to_csv();
        let lines: Vec<&str> = csv.lines().collect();
        assert_eq!(lines[0], "run,ranks,ms");
        assert_eq!(lines[1], "\"a,b \"\"x\"\"\",2,1.23456");
        assert_eq!(lines[2], "c|d<e>,,");
        assert_eq!(lines[3], "short,,");
        assert_eq!(lines.len(), 4);
    }

    #[test]
    fn markdown_aligns_numbers_and_escapes_pipes() {
        let md = sample().to_markdown();
        let lines: Vec<&str> = md.lines().collect();
        assert_eq!(lines[0], "| run | ranks | ms |");
        assert_eq!(lines[1], "|---|---:|---:|");
        assert_eq!(lines[2], "| a,b \"x\" | 2 | 1.23 |");
        assert_eq!(lines[3], "| c\\|d&lt;e&gt; | – | – |");
    }
}
