//! `kvtier info`: the machine, the I/O backend, and O_DIRECT on the cache
//! directory ([`kvtier_bench::machine::host_info`]).

use anyhow::Result;
use kvtier_bench::machine::host_info::gather;

use crate::cli::InfoArgs;
use crate::print_report::print_report;

/// Runs `kvtier info`.
pub fn run(args: &InfoArgs) -> Result<()> {
    print_report(
        &gather(&args.cache_dir, env!("CARGO_PKG_VERSION")),
        args.json,
    )
}
