//! The progress bars every benchmark and long command uses: one counting
//! bytes, one counting requests, both on stderr.

use std::time::Duration;

use indicatif::{ProgressBar, ProgressStyle};

/// A bar counting `total` bytes on stderr, hidden when `hidden` (e.g. for
/// `--json`, whose stdout is one JSON object and stderr stays quiet).
pub fn progress_bar(total: u64, hidden: bool) -> ProgressBar {
    if hidden {
        return ProgressBar::hidden();
    }
    let pb = ProgressBar::new(total);
    if let Ok(style) = ProgressStyle::with_template(
        "{msg:<26} [{bar:30}] {binary_bytes:>10}/{binary_total_bytes:<10} {elapsed_precise}",
    ) {
        pb.set_style(style.progress_chars("=> "));
    }
    pb.enable_steady_tick(Duration::from_millis(200));
    pb
}

/// A bar counting `len` requests on stderr, labelled `msg`; hidden unless
/// `show`.
pub fn request_bar(len: u64, msg: String, show: bool) -> ProgressBar {
    if !show {
        return ProgressBar::hidden();
    }
    let pb = ProgressBar::new(len);
    if let Ok(style) =
        ProgressStyle::with_template("{msg:<28} [{bar:30}] {pos}/{len} requests {elapsed_precise}")
    {
        pb.set_style(style.progress_chars("=> "));
    }
    pb.set_message(msg);
    pb.enable_steady_tick(Duration::from_millis(250));
    pb
}
