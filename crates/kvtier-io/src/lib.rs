//! kvtier-io: bytes on devices.
//!
//! * [`buffer`]: owned, aligned buffers and the one allocation hook.
//! * [`io_engine`]: a batch I/O engine that keeps N reads or writes
//!   ([`io_op`]) in flight, on io_uring where the kernel allows it and on a
//!   thread pool otherwise.
//! * [`direct`]: opening files with `O_DIRECT` and probing whether a
//!   directory accepts it; the active mode is always reported, never silent.
//! * [`recycle`]: an allocator that reuses freed buffers (no page faults);
//!   [`host_memory`]: the machine's physical memory, for refusing work
//!   that could never fit.
//! * [`device_limit`]: the device's own O_DIRECT read and write limits,
//!   measured beside what is benchmarked against them.
//! * [`safetensors`], [`loader`], [`checkpoint`]: validated safetensors
//!   reading, the parallel weight loader, crash-safe checkpoints.

pub mod buffer;
pub mod checkpoint;
pub mod device_limit;
pub mod direct;
pub mod host_memory;
pub mod io_engine;
pub mod io_op;
pub mod loader;
pub mod recycle;
pub mod safetensors;
mod threads;
mod uring;

pub use buffer::{AlignedBuf, DIRECT_IO_ALIGN, HostAllocator, align_up, system_allocator};
pub use direct::{DirectProbe, open_direct, probe_direct};
pub use io_engine::{Backend, EngineConfig, IoEngine};
pub use io_op::{IoBuf, IoDone, IoKind, IoOp, MAX_IN_FLIGHT, RawTarget};
