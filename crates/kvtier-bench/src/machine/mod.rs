//! The machine under test.
//!
//! * [`host`]: CPUs, memory, free disk space, dropping the page cache.
//! * [`host_info`]: what `kvtier info` shows.
//! * [`device_limit`]: the raw O_DIRECT limits, from kvtier-io (the Python
//!   package measures them too).
//! * [`run_dirs`]: the benchmarks' scratch directories, checked for space
//!   and removed at the end.

pub mod host;
pub mod host_info;

/// The raw O_DIRECT limits, from kvtier-io (the Python package measures
/// them too).
pub use kvtier_io::device_limit;

pub mod run_dirs;
