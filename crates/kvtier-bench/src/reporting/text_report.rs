//! The human-readable form every benchmark report has (the JSON form is
//! its `serde::Serialize`).

/// A report that prints as a table for people.
pub trait TextReport {
    /// The human-readable report: lines ending in a newline.
    fn table(&self) -> String;
}
