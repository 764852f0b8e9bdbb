use std::fmt;

use super::{escape_html, Bundle, Render};

/// How a column's cells line up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Align {
    Left,
    Right,
}

/// A table with a header, rows, an optional totals row, and a title.
///
/// Renders as HTML for notebooks and as aligned plain text for terminals.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Table {
    title: Option<String>,
    columns: Vec<(String, Align)>,
    rows: Vec<Vec<String>>,
    footer: Option<Vec<String>>,
    notes: Vec<String>,
}

impl Table {
    /// A table with the given column headers; text columns align left.
    pub fn new<S: Into<String>>(columns: impl IntoIterator<Item = S>) -> Self {
        Table { columns: columns.into_iter().map(|c| (c.into(), Align::Left)).collect(), ..Table::default() }
    }

    pub fn title(mut self, title: impl Into<String>) -> Self {
        self.title = Some(title.into());
        self
    }

    /// Aligns the given columns (by index) to the right, as numbers should be.
    pub fn right_align(mut self, columns: &[usize]) -> Self {
        for &i in columns {
            if let Some(col) = self.columns.get_mut(i) {
                col.1 = Align::Right;
            }
        }
        self
    }

    /// Appends a row; missing cells are left empty, extra cells are dropped.
    pub fn row<S: ToString>(mut self, cells: impl IntoIterator<Item = S>) -> Self {
        self.push_row(cells);
        self
    }

    pub fn push_row<S: ToString>(&mut self, cells: impl IntoIterator<Item = S>) {
        let row = self.one_per_column(cells);
        self.rows.push(row);
    }

    /// Sets the totals row, shown under a rule.
    pub fn footer<S: ToString>(mut self, cells: impl IntoIterator<Item = S>) -> Self {
        self.footer = Some(self.one_per_column(cells));
        self
    }

    /// Adds a line of prose under the table.
    pub fn note(mut self, note: impl Into<String>) -> Self {
        self.notes.push(note.into());
        self
    }

    pub fn columns(&self) -> impl Iterator<Item = &str> {
        self.columns.iter().map(|(name, _)| name.as_str())
    }

    pub fn rows(&self) -> &[Vec<String>] {
        &self.rows
    }

    fn one_per_column<S: ToString>(&self, cells: impl IntoIterator<Item = S>) -> Vec<String> {
        let mut row: Vec<String> = cells.into_iter().map(|c| c.to_string()).take(self.columns.len()).collect();
        row.resize(self.columns.len(), String::new());
        row
    }

    pub fn to_html(&self) -> String {
        let mut html = String::from("<div class=\"vramlab-table\">");
        if let Some(title) = &self.title {
            html.push_str(&format!("<p><b>{}</b></p>", escape_html(title)));
        }
        html.push_str("<table><thead><tr>");
        for (name, align) in &self.columns {
            html.push_str(&format!("<th style=\"text-align:{}\">{}</th>", css(*align), escape_html(name)));
        }
        html.push_str("</tr></thead><tbody>");
        let cell_row = |html: &mut String, row: &[String], tag: &str| {
            html.push_str("<tr>");
            for (cell, (_, align)) in row.iter().zip(&self.columns) {
                html.push_str(&format!("<{tag} style=\"text-align:{}\">{}</{tag}>", css(*align), escape_html(cell)));
            }
            html.push_str("</tr>");
        };
        for row in &self.rows {
            cell_row(&mut html, row, "td");
        }
        html.push_str("</tbody>");
        if let Some(footer) = &self.footer {
            html.push_str("<tfoot style=\"border-top:2px solid\">");
            cell_row(&mut html, footer, "th");
            html.push_str("</tfoot>");
        }
        html.push_str("</table>");
        for note in &self.notes {
            html.push_str(&format!("<p>{}</p>", escape_html(note)));
        }
        html.push_str("</div>");
        html
    }

    /// Shows the table in a notebook cell's result.
    pub fn evcxr_display(&self) {
        self.bundle().print_as_cell_result();
    }
}

/// The narrowest a note is wrapped to, in characters.
const NOTE_WIDTH: usize = 100;

fn css(align: Align) -> &'static str {
    match align {
        Align::Left => "left",
        Align::Right => "right",
    }
}

impl fmt::Display for Table {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let all_rows = self.rows.iter().chain(self.footer.iter());
        let mut widths: Vec<usize> = self.columns.iter().map(|(n, _)| n.chars().count()).collect();
        for row in all_rows {
            for (w, cell) in widths.iter_mut().zip(row) {
                *w = (*w).max(cell.chars().count());
            }
        }
        let line = |f: &mut fmt::Formatter<'_>, cells: &mut dyn Iterator<Item = &str>| -> fmt::Result {
            let mut first = true;
            for ((cell, (_, align)), w) in cells.zip(&self.columns).zip(&widths) {
                if !first {
                    f.write_str("  ")?;
                }
                first = false;
                match align {
                    Align::Left => write!(f, "{cell:<w$}")?,
                    Align::Right => write!(f, "{cell:>w$}")?,
                }
            }
            writeln!(f)
        };
        if let Some(title) = &self.title {
            writeln!(f, "{title}")?;
        }
        line(f, &mut self.columns.iter().map(|(n, _)| n.as_str()))?;
        let total: usize = widths.iter().sum::<usize>() + 2 * widths.len().saturating_sub(1);
        writeln!(f, "{}", "-".repeat(total))?;
        for row in &self.rows {
            line(f, &mut row.iter().map(String::as_str))?;
        }
        if let Some(footer) = &self.footer {
            writeln!(f, "{}", "=".repeat(total))?;
            line(f, &mut footer.iter().map(String::as_str))?;
        }
        // A note reads as a paragraph under the table: as wide as the table, and no narrower than a page.
        let width = total.max(NOTE_WIDTH);
        for note in &self.notes {
            writeln!(f, "{}", textwrap::fill(note, width))?;
        }
        Ok(())
    }
}

impl Render for Table {
    fn bundle(&self) -> Bundle {
        Bundle::plain(self.to_string()).with("text/html", self.to_html())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Table {
        Table::new(["layer", "params"]).right_align(&[1]).row(["conv1", "9,408"]).row(["fc <out>", "513,000"]).footer(["total", "522,408"])
    }

    #[test]
    fn text_aligns_columns_and_rules_totals() {
        let text = sample().to_string();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines[0], "layer      params");
        assert_eq!(lines[2], "conv1       9,408");
        assert_eq!(lines[3], "fc <out>  513,000");
        assert!(lines[4].chars().all(|c| c == '='));
        assert_eq!(lines[5], "total     522,408");
    }

    #[test]
    fn html_escapes_cells_and_keeps_both_representations() {
        let bundle = sample().bundle();
        let html = bundle.get("text/html").unwrap().as_str().unwrap();
        assert!(html.contains("fc &lt;out&gt;"));
        assert!(html.contains("<tfoot"));
        assert!(bundle.text().contains("522,408"));
    }

    #[test]
    fn a_long_note_wraps_to_the_table_or_a_page_whichever_is_wider() {
        let note = "word ".repeat(60);
        let narrow = sample().note(note.clone()).to_string();
        let lines: Vec<&str> = narrow.lines().skip(6).collect();
        assert!(lines.len() == 3 && lines.iter().all(|l| l.chars().count() <= NOTE_WIDTH), "{narrow}");
        let wide = Table::new(["a".repeat(150)]).note(note).to_string();
        assert!(
            wide.lines().skip(2).all(|l| l.chars().count() <= 150) && wide.lines().nth(2).unwrap().chars().count() > NOTE_WIDTH,
            "{wide}"
        );
    }

    #[test]
    fn rows_are_padded_to_the_header() {
        let table = Table::new(["a", "b", "c"]).row(["1"]);
        assert_eq!(table.rows()[0], vec!["1", "", ""]);
    }
}
