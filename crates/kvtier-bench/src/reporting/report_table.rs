//! One table, two renderings: aligned text for the terminal and Markdown
//! for `report.md`. A column says how its header and its values look in
//! each; rows hold the values.

use std::fmt::Write as _;

/// One value of a row.
#[derive(Debug, Clone, PartialEq)]
pub enum Cell {
    /// Text, as is.
    Text(String),
    /// A whole number.
    Int(u64),
    /// A number printed with the column's decimals.
    Num(f64),
}

/// How one column looks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Column {
    /// Header in the text table (right-aligned to `width`).
    pub text_header: &'static str,
    /// Header in the Markdown table.
    pub markdown_header: &'static str,
    /// Width of the text header.
    pub width: usize,
    /// Width of a text value, before its suffix.
    pub value_width: usize,
    /// Decimals of a number in the text table.
    pub text_decimals: usize,
    /// What follows a number in the text table (`s`, `GB/s`).
    pub suffix: &'static str,
    /// Decimals of a number in the Markdown table.
    pub markdown_decimals: usize,
}

impl Column {
    /// A column whose text header and values are right-aligned to `width`
    /// and whose numbers have `decimals` in both renderings.
    pub const fn new(
        text_header: &'static str,
        markdown_header: &'static str,
        width: usize,
        decimals: usize,
    ) -> Self {
        Self {
            text_header,
            markdown_header,
            width,
            value_width: width,
            text_decimals: decimals,
            suffix: "",
            markdown_decimals: decimals,
        }
    }

    /// The same column with text values `value_width` wide, followed by
    /// `suffix`.
    pub const fn suffixed(mut self, value_width: usize, suffix: &'static str) -> Self {
        self.value_width = value_width;
        self.suffix = suffix;
        self
    }

    /// The same column with `decimals` in the text table (the Markdown ones
    /// stay).
    pub const fn text_decimals(mut self, decimals: usize) -> Self {
        self.text_decimals = decimals;
        self
    }

    fn text(&self, cell: &Cell) -> String {
        let w = self.value_width;
        match cell {
            Cell::Text(t) => format!("{t:>w$}"),
            Cell::Int(n) => format!("{n:>w$}"),
            Cell::Num(x) => format!("{x:>w$.p$}{}", self.suffix, p = self.text_decimals),
        }
    }

    fn markdown(&self, cell: &Cell) -> String {
        match cell {
            Cell::Text(t) => t.clone(),
            Cell::Int(n) => n.to_string(),
            Cell::Num(x) => format!("{x:.p$}", p = self.markdown_decimals),
        }
    }
}

/// Columns and rows of values.
#[derive(Debug, Clone, PartialEq)]
pub struct Table {
    /// The columns, left to right.
    pub columns: &'static [Column],
    /// One value per column in each row.
    pub rows: Vec<Vec<Cell>>,
}

impl Table {
    /// The aligned text table: a header line, then one line per row,
    /// columns separated by one space.
    pub fn text(&self) -> String {
        let mut s = String::new();
        let header: Vec<String> = self
            .columns
            .iter()
            .map(|c| format!("{:>w$}", c.text_header, w = c.width))
            .collect();
        let _ = writeln!(s, "{}", header.join(" "));
        for row in &self.rows {
            let cells: Vec<String> = self
                .columns
                .iter()
                .zip(row)
                .map(|(c, v)| c.text(v))
                .collect();
            let _ = writeln!(s, "{}", cells.join(" "));
        }
        s
    }

    /// The Markdown table: header, separator, one line per row.
    pub fn markdown(&self) -> String {
        let mut s = String::new();
        let header: Vec<&str> = self.columns.iter().map(|c| c.markdown_header).collect();
        let _ = writeln!(s, "| {} |", header.join(" | "));
        let _ = writeln!(s, "|{}", "---|".repeat(self.columns.len()));
        for row in &self.rows {
            let cells: Vec<String> = self
                .columns
                .iter()
                .zip(row)
                .map(|(c, v)| c.markdown(v))
                .collect();
            let _ = writeln!(s, "| {} |", cells.join(" | "));
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const COLUMNS: &[Column] = &[
        Column::new("n", "count", 3, 0),
        Column::new("time", "time (s)", 7, 3)
            .text_decimals(2)
            .suffixed(6, "s"),
    ];

    #[test]
    fn one_table_two_renderings() {
        let t = Table {
            columns: COLUMNS,
            rows: vec![vec![Cell::Int(8), Cell::Num(1.5)]],
        };
        assert_eq!(t.text(), "  n    time\n  8   1.50s\n");
        assert_eq!(
            t.markdown(),
            "| count | time (s) |\n|---|---|\n| 8 | 1.500 |\n"
        );
    }
}
