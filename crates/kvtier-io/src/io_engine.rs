//! The batch I/O engine: many (file, offset, buffer) reads or writes
//! ([`IoOp`]), with up to N in flight at once.
//!
//! A batch owns its buffers while it runs and hands every one back on
//! completion, in submission order, filled (reads) or drained (writes). That
//! ownership is what makes io_uring safe here: the kernel may write into a
//! buffer until its completion arrives, and nothing else can touch it before.
//!
//! Backends:
//! * [`Backend::IoUring`]: one ring per calling thread, created on first use;
//!   the caller's thread submits and reaps, so a batch costs no thread hops.
//! * [`Backend::ThreadPool`]: `pread`/`pwrite` on up to N scoped threads, for
//!   kernels or sandboxes without io_uring.
//!
//! The backend is chosen by probing io_uring at start (a NOP round trip);
//! `KVTIER_IO_BACKEND=threads|uring` overrides. Either way the choice and the
//! reason for a fallback are reported by [`IoEngine::describe`].

use std::fmt;
use std::sync::OnceLock;

use crate::io_op::{IoDone, IoOp, MAX_IN_FLIGHT};

/// Which backend runs the batches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// Linux io_uring.
    IoUring,
    /// `pread`/`pwrite` on a pool of threads.
    ThreadPool,
}

impl Backend {
    /// "io_uring" or "threads".
    pub fn name(self) -> &'static str {
        match self {
            Backend::IoUring => "io_uring",
            Backend::ThreadPool => "threads",
        }
    }
}

/// How to build an [`IoEngine`].
#[derive(Debug, Clone, Default)]
pub struct EngineConfig {
    /// Force a backend; `None` probes (and honours `KVTIER_IO_BACKEND`).
    pub backend: Option<Backend>,
}

/// The parallel I/O engine. Cheap to share: it holds no per-batch state.
#[derive(Debug, Clone)]
pub struct IoEngine {
    backend: Backend,
    fallback_reason: Option<String>,
}

impl IoEngine {
    /// Builds an engine, probing io_uring unless a backend is forced.
    pub fn new(config: EngineConfig) -> Self {
        if let Some(backend) = config.backend {
            return Self {
                backend,
                fallback_reason: None,
            };
        }
        match std::env::var("KVTIER_IO_BACKEND").as_deref() {
            Ok("threads") => {
                return Self {
                    backend: Backend::ThreadPool,
                    fallback_reason: Some("KVTIER_IO_BACKEND=threads".into()),
                };
            }
            Ok("uring") | Ok("io_uring") => {
                return Self {
                    backend: Backend::IoUring,
                    fallback_reason: None,
                };
            }
            _ => {}
        }
        match probe_uring() {
            Ok(()) => Self {
                backend: Backend::IoUring,
                fallback_reason: None,
            },
            Err(reason) => {
                tracing::warn!("io_uring unavailable ({reason}); using the thread-pool backend");
                Self {
                    backend: Backend::ThreadPool,
                    fallback_reason: Some(reason),
                }
            }
        }
    }

    /// The engine every part of a process shares unless told otherwise.
    pub fn shared() -> &'static IoEngine {
        static ENGINE: OnceLock<IoEngine> = OnceLock::new();
        ENGINE.get_or_init(|| IoEngine::new(EngineConfig::default()))
    }

    /// The active backend.
    pub fn backend(&self) -> Backend {
        self.backend
    }

    /// Why the thread pool is used instead of io_uring, when it is.
    pub fn fallback_reason(&self) -> Option<&str> {
        self.fallback_reason.as_deref()
    }

    /// One line for `kvtier info` and logs.
    pub fn describe(&self) -> String {
        match &self.fallback_reason {
            None => self.backend.name().to_string(),
            Some(r) => format!("{} ({r})", self.backend.name()),
        }
    }

    /// Runs every op with at most `in_flight` outstanding (clamped to
    /// 1..=[`MAX_IN_FLIGHT`]) and returns one [`IoDone`] per op, in order.
    ///
    /// Never returns before the kernel is done with every buffer.
    pub fn run_batch<'f>(&self, ops: Vec<IoOp<'f>>, in_flight: usize) -> Vec<IoDone<'f>> {
        self.run_batch_map(ops, in_flight, |_, _| ())
            .into_iter()
            .map(|(d, ())| d)
            .collect()
    }

    /// Like [`run_batch`](Self::run_batch), but calls `f(index, &done)` on
    /// each op as soon as it completes, while the rest are still in flight,
    /// and returns its result beside each op. This is how readers verify
    /// checksums without draining the device queue: the work overlaps I/O.
    /// `f` runs on the calling thread (io_uring) or on the worker that ran
    /// the op (thread pool).
    pub fn run_batch_map<'f, T, F>(
        &self,
        ops: Vec<IoOp<'f>>,
        in_flight: usize,
        f: F,
    ) -> Vec<(IoDone<'f>, T)>
    where
        T: Send,
        F: Fn(usize, &IoDone<'f>) -> T + Sync,
    {
        self.run_waves_map(ops, 0, in_flight, &mut || {}, f)
    }

    /// [`run_batch_map`](Self::run_batch_map) in two waves: the first
    /// `first` ops have the device to themselves, and the rest start once
    /// all of those are done (0, or at least the whole batch: one wave).
    /// For reads whose first ops a caller waits on before it can do
    /// anything (a layer-wise restore's first layer): alone, they land at
    /// the device's full speed instead of sharing it with the whole batch.
    /// On io_uring, once the first wave is done, at most `first` more ops
    /// go into the kernel before each finished op is handed to `f`: the
    /// device has the next wave's worth while `f` gets the op it waits
    /// on without a whole window's submission ahead of it.
    ///
    /// `submitted` runs once on the calling thread as soon as the first ops
    /// are in the kernel (the thread pool: just before they start), not at
    /// all for no ops: a caller about to wait for the device can wake other
    /// work then, when this thread no longer needs its core.
    pub fn run_waves_map<'f, T, F>(
        &self,
        ops: Vec<IoOp<'f>>,
        first: usize,
        in_flight: usize,
        submitted: &mut dyn FnMut(),
        f: F,
    ) -> Vec<(IoDone<'f>, T)>
    where
        T: Send,
        F: Fn(usize, &IoDone<'f>) -> T + Sync,
    {
        let in_flight = in_flight.clamp(1, MAX_IN_FLIGHT);
        if ops.is_empty() {
            return Vec::new();
        }
        let first = if first >= ops.len() { 0 } else { first };
        match self.backend {
            Backend::IoUring => crate::uring::run_batch_map(ops, first, in_flight, submitted, &f),
            Backend::ThreadPool => {
                crate::threads::run_batch_map(ops, first, in_flight, submitted, &f)
            }
        }
    }

    /// Streams ops through the engine: pulls the next op from `next`
    /// whenever fewer than `in_flight` (clamped to 1..=[`MAX_IN_FLIGHT`])
    /// are outstanding, and hands each finished op to `on_done` with its
    /// position in the stream, as soon as it completes. Returns once `next`
    /// gives `None` and every op pulled has been handed back.
    ///
    /// Unlike a batch, the ops need not exist up front: a writer fills the
    /// next buffer while the device works on the others, and gets each
    /// buffer back to refill as soon as its write is done, so the device
    /// queue never drains between groups. `next` and `on_done` run on the
    /// calling thread (io_uring) or, one at a time, on pool threads.
    pub fn run_stream<'f>(
        &self,
        in_flight: usize,
        mut next: impl FnMut() -> Option<IoOp<'f>> + Send,
        mut on_done: impl FnMut(usize, IoDone<'f>) + Send,
    ) {
        let in_flight = in_flight.clamp(1, MAX_IN_FLIGHT);
        match self.backend {
            Backend::IoUring => crate::uring::run_stream(in_flight, &mut next, &mut on_done),
            Backend::ThreadPool => crate::threads::run_stream(in_flight, &mut next, &mut on_done),
        }
    }
}

impl fmt::Display for IoEngine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.describe())
    }
}

/// Checks that io_uring works here: builds a ring and completes a NOP.
pub fn probe_uring() -> Result<(), String> {
    crate::uring::probe().map_err(|e| format!("io_uring probe failed: {e}"))
}

#[cfg(test)]
mod tests {
    use std::fs::File;
    use std::io;
    use std::sync::Arc;

    use super::*;
    use crate::buffer::{AlignedBuf, DIRECT_IO_ALIGN};
    use crate::direct::{open_direct, probe_direct};
    use crate::io_op::{IoBuf, IoKind};

    fn engines() -> Vec<IoEngine> {
        let mut v = vec![IoEngine::new(EngineConfig {
            backend: Some(Backend::ThreadPool),
        })];
        // io_uring must work on the machines kvtier is developed and tested on;
        // a missing ring is a failure here, not a silent skip.
        probe_uring().expect("io_uring available on the test machine");
        v.push(IoEngine::new(EngineConfig {
            backend: Some(Backend::IoUring),
        }));
        v
    }

    fn pattern(i: usize, len: usize) -> AlignedBuf {
        let mut b = AlignedBuf::zeroed(len, DIRECT_IO_ALIGN).unwrap();
        for (j, x) in b.iter_mut().enumerate() {
            *x = ((i * 31 + j * 7) % 253) as u8;
        }
        b
    }

    #[test]
    fn write_then_read_back_many_in_flight_both_backends() {
        let dir = tempfile::tempdir().unwrap();
        let direct = probe_direct(dir.path()).direct;
        for engine in engines() {
            let path = dir.path().join(format!("f-{}", engine.backend().name()));
            let file = open_direct(&path, true, direct).unwrap();
            let len = 64 * 1024;
            let n = 40;
            for qd in [1, 4, 32] {
                let ops = (0..n)
                    .map(|i| IoOp::write(&file, (i * len) as u64, pattern(i + qd, len)))
                    .collect();
                for d in engine.run_batch(ops, qd) {
                    assert_eq!(d.result.unwrap(), len);
                }
                let ops = (0..n)
                    .map(|i| {
                        IoOp::read(
                            &file,
                            (i * len) as u64,
                            AlignedBuf::zeroed(len, DIRECT_IO_ALIGN).unwrap(),
                        )
                    })
                    .collect();
                for (i, d) in engine.run_batch(ops, qd).into_iter().enumerate() {
                    assert_eq!(d.result.unwrap(), len, "{}", engine.describe());
                    assert_eq!(&d.buf[..], &pattern(i + qd, len)[..], "op {i} qd {qd}");
                }
            }
        }
    }

    #[test]
    fn shared_writes_and_owned_only_reads() {
        let dir = tempfile::tempdir().unwrap();
        for engine in engines() {
            let path = dir.path().join(format!("s-{}", engine.backend().name()));
            let file = open_direct(&path, true, false).unwrap();
            let shared = Arc::new(pattern(3, 8192));
            let ops = vec![
                IoOp::write_shared(&file, 0, shared.clone()),
                IoOp::write_shared(&file, 8192, shared.clone()),
            ];
            for d in engine.run_batch(ops, 2) {
                assert_eq!(d.result.unwrap(), 8192);
            }
            let bytes = std::fs::read(&path).unwrap();
            assert_eq!(&bytes[..8192], &shared[..]);
            assert_eq!(&bytes[8192..], &shared[..]);
            let bad = IoOp {
                kind: IoKind::Read,
                file: &file,
                offset: 0,
                buf: IoBuf::Shared(shared.clone()),
            };
            let done = engine.run_batch(vec![bad], 1);
            assert_eq!(
                done[0].result.as_ref().unwrap_err().kind(),
                io::ErrorKind::InvalidInput
            );
            assert_eq!(&bytes[..8192], &shared[..], "shared buffer left untouched");
        }
    }

    /// Writes `n` patterned pieces of `len` bytes to `file` and returns
    /// the reads of them, in order.
    fn patterned_reads<'f>(
        engine: &IoEngine,
        file: &'f File,
        n: usize,
        len: usize,
    ) -> Vec<IoOp<'f>> {
        let ops = (0..n)
            .map(|i| IoOp::write(file, (i * len) as u64, pattern(i, len)))
            .collect();
        for d in engine.run_batch(ops, 8) {
            assert_eq!(d.result.unwrap(), len);
        }
        (0..n)
            .map(|i| {
                IoOp::read(
                    file,
                    (i * len) as u64,
                    AlignedBuf::zeroed(len, 4096).unwrap(),
                )
            })
            .collect()
    }

    #[test]
    fn map_callback_sees_every_op_once_with_its_bytes() {
        let dir = tempfile::tempdir().unwrap();
        for engine in engines() {
            let path = dir.path().join(format!("m-{}", engine.backend().name()));
            let file = open_direct(&path, true, false).unwrap();
            let len = 8192;
            let ops = patterned_reads(&engine, &file, 20, len);
            let out = engine.run_batch_map(ops, 8, |i, d| (i, d.buf[..] == pattern(i, len)[..]));
            assert_eq!(out.len(), 20);
            for (k, (done, (i, matched))) in out.into_iter().enumerate() {
                assert_eq!(k, i, "results in submission order");
                assert!(matched, "callback saw op {i}'s bytes");
                assert_eq!(done.result.unwrap(), len);
            }
        }
    }

    #[test]
    fn a_first_wave_is_done_before_any_later_op_is_seen() {
        let dir = tempfile::tempdir().unwrap();
        for engine in engines() {
            let path = dir.path().join(format!("w-{}", engine.backend().name()));
            let file = open_direct(&path, true, false).unwrap();
            let len = 8192;
            for first in [0, 1, 5, 23, 24, 40] {
                let ops = patterned_reads(&engine, &file, 24, len);
                let seen = std::sync::Mutex::new(Vec::new());
                let mut told = 0;
                let out = engine.run_waves_map(ops, first, 8, &mut || told += 1, |i, d| {
                    seen.lock().unwrap().push(i);
                    d.buf[..] == pattern(i, len)[..]
                });
                assert_eq!(out.len(), 24);
                assert_eq!(
                    told, 1,
                    "first {first}: told once that the first ops are in"
                );
                for (i, (done, matched)) in out.into_iter().enumerate() {
                    assert!(matched, "first {first}: op {i}'s bytes");
                    assert_eq!(done.result.unwrap(), len);
                }
                let seen = seen.into_inner().unwrap();
                let mut sorted = seen.clone();
                sorted.sort_unstable();
                assert_eq!(sorted, (0..24).collect::<Vec<_>>(), "each op once");
                if first < 24 {
                    let last_early = seen.iter().rposition(|&i| i < first);
                    let first_late = seen.iter().position(|&i| i >= first);
                    assert!(
                        last_early < first_late,
                        "{}: first {first}: a later op was seen before the wave was done: {seen:?}",
                        engine.backend().name()
                    );
                }
            }
        }
    }

    #[test]
    fn raw_reads_fill_disjoint_parts_of_one_buffer_each_usable_when_done() {
        let dir = tempfile::tempdir().unwrap();
        let direct = probe_direct(dir.path()).direct;
        for engine in engines() {
            let path = dir.path().join(format!("r-{}", engine.backend().name()));
            let file = open_direct(&path, true, direct).unwrap();
            let part = 16 * 1024;
            let parts = 12;
            let whole = pattern(5, part * parts);
            let ops = vec![IoOp::write(&file, 0, whole)];
            assert_eq!(
                engine.run_batch(ops, 1)[0].result.as_ref().unwrap(),
                &(part * parts)
            );
            let mut dst = AlignedBuf::zeroed(part * parts, DIRECT_IO_ALIGN).unwrap();
            let base = std::ptr::NonNull::new(dst.as_mut_ptr()).unwrap();
            // Parts in a scrambled order; each read fills only its own part.
            let order: Vec<usize> = (0..parts).map(|i| (i * 5) % parts).collect();
            let ops = order
                .iter()
                .map(|&p| {
                    // SAFETY: the parts are disjoint, inside `dst`, which
                    // outlives the batch and is not touched until it returns.
                    unsafe { IoOp::read_raw(&file, (p * part) as u64, base.add(p * part), part) }
                })
                .collect();
            let expect = pattern(5, part * parts);
            let out = engine.run_batch_map(ops, 4, |i, d| {
                let p = order[i];
                d.buf[..] == expect[p * part..(p + 1) * part]
            });
            for (done, seen) in out {
                assert_eq!(done.result.unwrap(), part);
                assert!(seen, "the callback sees its part's bytes");
                assert!(done.buf.into_owned().is_none());
            }
            assert_eq!(&dst[..], &expect[..], "{}", engine.describe());
        }
    }

    #[test]
    fn stream_refills_from_returned_buffers_and_writes_every_op() {
        let dir = tempfile::tempdir().unwrap();
        let direct = probe_direct(dir.path()).direct;
        for engine in engines() {
            let path = dir.path().join(format!("st-{}", engine.backend().name()));
            let file = open_direct(&path, true, direct).unwrap();
            let len = 16 * 1024;
            let n = 50;
            let in_flight = 4;
            // A pool refilled only by completions: at most `in_flight`
            // buffers can ever exist if the stream keeps its bound.
            let pool = std::sync::Mutex::new(Vec::<AlignedBuf>::new());
            let allocated = std::sync::atomic::AtomicUsize::new(0);
            let mut i = 0;
            let mut seen = vec![false; n];
            engine.run_stream(
                in_flight,
                || {
                    if i == n {
                        return None;
                    }
                    let mut buf = pool.lock().unwrap().pop().unwrap_or_else(|| {
                        allocated.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        AlignedBuf::zeroed(len, DIRECT_IO_ALIGN).unwrap()
                    });
                    buf.copy_from_slice(&pattern(i, len));
                    i += 1;
                    Some(IoOp::write(&file, ((i - 1) * len) as u64, buf))
                },
                |k, done| {
                    assert_eq!(done.result.unwrap(), len);
                    assert!(!seen[k], "op {k} handed back twice");
                    seen[k] = true;
                    pool.lock().unwrap().push(done.buf.into_owned().unwrap());
                },
            );
            assert!(seen.iter().all(|&s| s), "every op handed back");
            let made = allocated.into_inner();
            assert!(
                made <= in_flight,
                "{made} buffers for {in_flight} in flight"
            );
            let bytes = std::fs::read(&path).unwrap();
            for k in 0..n {
                assert_eq!(
                    &bytes[k * len..(k + 1) * len],
                    &pattern(k, len)[..],
                    "op {k}"
                );
            }
            // A write error reaches `on_done` and the stream stops pulling.
            let ro = File::open(&path).unwrap();
            let mut pulled = 0;
            let mut failed = 0;
            let stop = std::sync::atomic::AtomicBool::new(false);
            engine.run_stream(
                2,
                || {
                    if stop.load(std::sync::atomic::Ordering::Relaxed) || pulled == 100 {
                        return None;
                    }
                    pulled += 1;
                    Some(IoOp::write(&ro, 0, pattern(0, 4096)))
                },
                |_, done| {
                    if done.result.is_err() {
                        failed += 1;
                        stop.store(true, std::sync::atomic::Ordering::Relaxed);
                    }
                },
            );
            assert!(
                failed >= 1 && pulled < 100,
                "pulled {pulled}, failed {failed}"
            );
            assert_eq!(failed, pulled, "every pulled op failed and came back");
        }
    }

    #[test]
    fn read_past_end_is_short_not_an_error() {
        let dir = tempfile::tempdir().unwrap();
        for engine in engines() {
            let path = dir.path().join(format!("g-{}", engine.backend().name()));
            std::fs::write(&path, vec![9u8; 5000]).unwrap();
            let file = open_direct(&path, false, false).unwrap();
            let ops = vec![
                IoOp::read(&file, 4096, AlignedBuf::zeroed(8192, 4096).unwrap()),
                IoOp::read(&file, 1 << 20, AlignedBuf::zeroed(4096, 4096).unwrap()),
            ];
            let done = engine.run_batch(ops, 2);
            assert_eq!(done[0].result.as_ref().unwrap(), &904);
            assert_eq!(done[0].buf.len(), 904);
            assert!(done[0].buf.iter().all(|&b| b == 9));
            assert_eq!(done[1].result.as_ref().unwrap(), &0);
        }
    }

    #[test]
    fn errors_are_per_op_and_buffers_come_back() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ro");
        std::fs::write(&path, vec![1u8; 4096]).unwrap();
        for engine in engines() {
            let ro = File::open(&path).unwrap();
            let ops = vec![
                IoOp::write(&ro, 0, AlignedBuf::zeroed(4096, 4096).unwrap()),
                IoOp::read(&ro, 0, AlignedBuf::zeroed(4096, 4096).unwrap()),
            ];
            let done = engine.run_batch(ops, 8);
            assert_eq!(done.len(), 2);
            assert!(done[0].result.is_err(), "write to a read-only fd must fail");
            assert_eq!(done[0].buf.len(), 4096);
            assert_eq!(*done[1].result.as_ref().unwrap(), 4096);
            assert!(done[1].buf.iter().all(|&b| b == 1));
        }
    }
}
