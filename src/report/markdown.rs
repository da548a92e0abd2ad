//! Writing the report: `REPORT.md` from the [`Section`]s, one SVG per chart and one CSV per
//! table, all in the output directory.

use super::sections::{Item, Section};
use anyhow::{Context, Result};
use std::path::{Path, PathBuf};

/// Renders the Markdown document (title, preamble, then each section).
pub fn render(title: &str, preamble: &str, sections: &[Section]) -> String {
    let mut md = format!("# {title}\n\n{preamble}\n");
    if sections.len() > 1 {
        md.push_str("\nContents: ");
        md.push_str(
            &sections
                .iter()
                .map(|s| format!("[{}](#{})", s.title, anchor(&s.title)))
                .collect::<Vec<_>>()
                .join(" · "),
        );
        md.push('\n');
    }
    for s in sections {
        md.push_str(&format!("\n## {}\n", s.title));
        for item in &s.items {
            md.push('\n');
            match item {
                Item::Text(t) => {
                    md.push_str(t);
                    md.push('\n');
                }
                Item::Chart {
                    file,
                    alt,
                    how_to_read,
                    ..
                } => {
                    md.push_str(&format!(
                        "![{alt}]({file})\n\n*How to read:* {how_to_read} ([{file}]({file}))\n"
                    ));
                }
                Item::Table {
                    table,
                    caption,
                    markdown,
                } => {
                    let csv = table.csv_name();
                    md.push_str(&format!("{caption} CSV: [{csv}]({csv}).\n\n"));
                    md.push_str(markdown.as_deref().unwrap_or(&table.to_markdown()));
                }
            }
        }
    }
    md
}

/// GitHub's heading anchor: lower case, spaces to `-`, punctuation dropped.
fn anchor(title: &str) -> String {
    title
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

/// Writes REPORT.md, the charts and the CSVs into `dir` (created if missing); returns the
/// paths written, REPORT.md first.
pub fn write(
    dir: &Path,
    title: &str,
    preamble: &str,
    sections: &[Section],
) -> Result<Vec<PathBuf>> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let report = dir.join("REPORT.md");
    let mut written = vec![report.clone()];
    for s in sections {
        for item in &s.items {
            match item {
                Item::Chart { file, svg, .. } => {
                    let p = dir.join(file);
                    std::fs::write(&p, svg).with_context(|| format!("writing {}", p.display()))?;
                    written.push(p);
                }
                Item::Table { table, .. } => written.push(table.write_csv(dir)?),
                Item::Text(_) => {}
            }
        }
    }
    std::fs::write(&report, render(title, preamble, sections))
        .with_context(|| format!("writing {}", report.display()))?;
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::table::{Cell, Table};

    #[test]
    fn renders_sections_with_links() {
        let mut t = Table::new("runs", &["run", "ms"]);
        t.push(vec![Cell::text("a"), Cell::num(1.0, 1)]);
        let s = vec![
            Section {
                title: "Runs".into(),
                items: vec![Item::Table {
                    table: t,
                    caption: "The runs.".into(),
                    markdown: None,
                }],
            },
            Section {
                title: "Per-op breakdown".into(),
                items: vec![Item::Chart {
                    file: "b.svg".into(),
                    svg: "<svg/>".into(),
                    alt: "B".into(),
                    how_to_read: "bars.".into(),
                }],
            },
        ];
        let md = render("fugu report", "Intro.", &s);
        assert!(md.starts_with("# fugu report\n\nIntro.\n"));
        assert!(md.contains("[Per-op breakdown](#per-op-breakdown)"));
        assert!(md.contains("The runs. CSV: [runs.csv](runs.csv).\n\n| run | ms |"));
        assert!(md.contains("![B](b.svg)"));
        assert!(md.contains("*How to read:* bars."));
    }
}
