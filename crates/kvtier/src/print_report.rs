//! How every command with `--json` ends: exactly one JSON object on
//! stdout, else the report's table.

use anyhow::Result;
use kvtier_bench::TextReport;
use serde::Serialize;

/// Prints `report` as pretty JSON (`json`) or as its table.
pub fn print_report<R: Serialize + TextReport>(report: &R, json: bool) -> Result<()> {
    if json {
        println!("{}", serde_json::to_string_pretty(report)?);
    } else {
        print!("{}", report.table());
    }
    Ok(())
}
