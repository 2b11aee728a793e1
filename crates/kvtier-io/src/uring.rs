//! io_uring backend: one ring per calling thread.
//!
//! The caller submits up to `in_flight` ops (taken from a batch, or pulled
//! from a stream as slots free up), waits for at least one completion,
//! refills, and returns once every op has completed. Partial
//! transfers are resubmitted for the remainder; `EINTR`/`EAGAIN` completions
//! are retried. If the ring itself fails mid-batch, the remaining ops fail
//! with that error, but the function still waits for every op the kernel
//! holds before handing buffers back (and leaks them rather than free memory
//! the kernel could still write, should even waiting fail).

use std::cell::RefCell;
use std::collections::VecDeque;
use std::io;
use std::os::fd::AsRawFd;

use io_uring::{IoUring, opcode, types};

use crate::buffer::AlignedBuf;
use crate::io_op::{IoBuf, IoDone, IoKind, IoOp, MAX_IN_FLIGHT, finish};

thread_local! {
    static RING: RefCell<Option<IoUring>> = const { RefCell::new(None) };
}

/// Largest single transfer submitted at once (the kernel caps one read at
/// just under 2 GiB anyway); longer ops continue as partial transfers.
const MAX_CHUNK: usize = 1 << 30;

/// Builds a small ring and completes a NOP through it.
pub(crate) fn probe() -> io::Result<()> {
    let mut ring = IoUring::new(4)?;
    let nop = opcode::Nop::new().build().user_data(7);
    // SAFETY: a NOP references no memory.
    unsafe { ring.submission().push(&nop) }
        .map_err(|_| io::Error::other("submission queue full"))?;
    ring.submit_and_wait(1)?;
    let cqe = ring
        .completion()
        .next()
        .ok_or_else(|| io::Error::other("no completion for NOP"))?;
    if cqe.user_data() != 7 || cqe.result() < 0 {
        return Err(io::Error::other(format!(
            "bad NOP completion {}",
            cqe.result()
        )));
    }
    Ok(())
}

struct Pending<'f> {
    /// Position of the op in the stream (submission order).
    seq: usize,
    op: IoOp<'f>,
    done: usize,
    err: Option<io::Error>,
}

/// Runs `f` on this thread's ring (created on first use). `None` when the
/// ring is unavailable: already borrowed (a callback running I/O of its
/// own) or impossible to create; the caller then uses the thread pool.
fn with_ring<R>(f: impl FnOnce(&mut IoUring) -> R) -> Option<R> {
    RING.with(|cell| {
        let mut slot = cell.try_borrow_mut().ok()?;
        if slot.is_none() {
            match IoUring::new(MAX_IN_FLIGHT as u32) {
                Ok(r) => *slot = Some(r),
                Err(e) => {
                    tracing::warn!("cannot create io_uring ({e}); running I/O on threads");
                    return None;
                }
            }
        }
        slot.as_mut().map(f)
    })
}

/// Runs a batch on this thread's ring, calling `f` on each op as it
/// completes, while the others are still in flight; the first `first` ops
/// go alone, the rest once all of those are done (see `drive`).
pub(crate) fn run_batch_map<'f, T, F>(
    ops: Vec<IoOp<'f>>,
    first: usize,
    in_flight: usize,
    submitted: &mut dyn FnMut(),
    f: &F,
) -> Vec<(IoDone<'f>, T)>
where
    T: Send,
    F: Fn(usize, &IoDone<'f>) -> T + Sync,
{
    let n = ops.len();
    let mut ops = Some(ops);
    let out = with_ring(|ring| {
        let mut it = ops.take().into_iter().flatten();
        let mut results: Vec<Option<(IoDone<'f>, T)>> = (0..n).map(|_| None).collect();
        let order = Order::SubmitFirst { first };
        drive(
            ring,
            in_flight,
            order,
            &mut *submitted,
            &mut || it.next(),
            &mut |i, d| {
                let t = f(i, &d);
                results[i] = Some((d, t));
            },
        );
        results.into_iter().flatten().collect()
    });
    match (out, ops) {
        (Some(out), _) => out,
        (None, Some(ops)) => crate::threads::run_batch_map(ops, first, in_flight, submitted, f),
        (None, None) => Vec::new(),
    }
}

/// Runs a stream on this thread's ring (see [`IoEngine::run_stream`]),
/// or on the thread pool when the ring is unavailable.
///
/// [`IoEngine::run_stream`]: crate::io_engine::IoEngine::run_stream
pub(crate) fn run_stream<'f>(
    in_flight: usize,
    next: &mut (dyn FnMut() -> Option<IoOp<'f>> + Send),
    on_done: &mut (dyn FnMut(usize, IoDone<'f>) + Send),
) {
    // The closures move into `with_ring` only by reference, so the
    // fallback below can still use them.
    let ran = with_ring(|ring| {
        drive(
            ring,
            in_flight,
            Order::HandBackFirst,
            &mut || {},
            &mut *next,
            &mut *on_done,
        )
    });
    if ran.is_none() {
        crate::threads::run_stream(in_flight, next, on_done);
    }
}

/// Which comes first once ops complete: their hand-back or the next
/// submissions.
#[derive(Clone, Copy)]
enum Order {
    /// A stream: the finished ops go back first, because the next op may
    /// be made of a buffer one of them returns (a writer refilling it).
    HandBackFirst,
    /// A batch (every op exists already): new ops are submitted before
    /// the finished ones are handed back, so the device works while
    /// `on_done` runs, and a caller whose `on_done` wakes a thread that
    /// takes this one's CPU has its next reads in the kernel already. The
    /// first `first` ops are a wave of their own: no later op is pulled
    /// before all of them are done, so they have the device to themselves.
    ///
    /// With a first wave, at most `first` new ops (a wave's worth) go in
    /// before each finished op is handed back, while any wait: submitting
    /// a read costs CPU (the kernel pins its buffer's pages), and the op
    /// that ended the first wave, the one a layer-wise restore's first
    /// layer waits on, would otherwise wait for a whole window of reads to
    /// be submitted, a sizeable share of the time to a restore's first
    /// layer. A restored request's TTFT came closer to its hot twin's
    /// this way than with the whole window first (docs/decisions.md).
    SubmitFirst { first: usize },
}

/// Slot `s`'s op is finished: ready to hand back, and one fewer of the
/// first wave left when it is of it (`in_first`).
fn finished(ready: &mut Vec<usize>, s: usize, first_left: &mut usize, in_first: bool) {
    *first_left = first_left.saturating_sub(usize::from(in_first));
    ready.push(s);
}

/// Hands the first `at_most` finished ops in `ready` to `on_done`, in the
/// order they finished, freeing their slots.
fn hand_back<'f>(
    ready: &mut Vec<usize>,
    at_most: usize,
    slots: &mut [Option<Pending<'f>>],
    free: &mut Vec<usize>,
    on_done: &mut dyn FnMut(usize, IoDone<'f>),
) {
    for s in ready.drain(..at_most.min(ready.len())) {
        let Some(p) = slots[s].take() else { continue };
        free.push(s);
        on_done(p.seq, finish(p.op.kind, p.op.buf, p.done, p.err));
    }
}

/// The submission loop: pulls ops from `next` whenever fewer than
/// `in_flight` are in the kernel, resubmits partial transfers, and hands
/// each finished op to `on_done` with its position in the stream, in
/// `order` with the next submissions. Returns once `next` is exhausted and
/// every op has been handed back. `submitted` runs once, right after the
/// first ops went into the kernel (not at all when there were none).
fn drive<'f>(
    ring: &mut IoUring,
    in_flight: usize,
    order: Order,
    submitted: &mut dyn FnMut(),
    next: &mut dyn FnMut() -> Option<IoOp<'f>>,
    on_done: &mut dyn FnMut(usize, IoDone<'f>),
) {
    let first = match order {
        Order::SubmitFirst { first } => first,
        Order::HandBackFirst => 0,
    };
    // Ops the kernel may hold, by slot; the slot index is the user data.
    let mut slots: Vec<Option<Pending<'f>>> = Vec::new();
    let mut free: Vec<usize> = Vec::new();
    // Slots waiting for (re)submission: partial transfers, EINTR/EAGAIN.
    let mut retry: VecDeque<usize> = VecDeque::new();
    let mut ready: Vec<usize> = Vec::new();
    let mut outstanding = 0usize;
    let mut seq = 0usize;
    let mut exhausted = false;
    let mut ring_err: Option<io::Error> = None;
    // Ops of the first wave not done yet.
    let mut first_left = first;
    let mut told = false;

    loop {
        if matches!(order, Order::HandBackFirst) {
            hand_back(&mut ready, usize::MAX, &mut slots, &mut free, on_done);
        }
        // Fill the ring up to the in-flight limit, or a wave's worth when
        // finished ops wait to be handed back.
        let mut pushed = 0usize;
        let mut capped = false;
        while ring_err.is_none() && outstanding < in_flight {
            // With a first wave, a wave's worth before each finished op
            // is handed back (see `Order::SubmitFirst`).
            if first > 0 && pushed >= first && !ready.is_empty() {
                capped = true;
                break;
            }
            let s = match retry.pop_front() {
                Some(s) => s,
                None if exhausted || (seq >= first && first_left > 0) => break,
                None => {
                    let Some(op) = next() else {
                        exhausted = true;
                        break;
                    };
                    let p = Pending {
                        seq,
                        op,
                        done: 0,
                        err: None,
                    };
                    seq += 1;
                    match free.pop() {
                        Some(s) => {
                            slots[s] = Some(p);
                            s
                        }
                        None => {
                            slots.push(Some(p));
                            slots.len() - 1
                        }
                    }
                }
            };
            let Some(p) = slots[s].as_mut() else { continue };
            let op = &mut p.op;
            let remaining = op.buf.len() - p.done;
            if remaining == 0 {
                finished(&mut ready, s, &mut first_left, p.seq < first);
                continue;
            }
            let len = remaining.min(MAX_CHUNK) as u32;
            let fd = types::Fd(op.file.as_raw_fd());
            let off = op.offset + p.done as u64;
            let sqe = match op.kind {
                // SAFETY (both arms): the buffer is owned by `slots`, which
                // outlives every in-flight op (an op leaves `slots` only
                // after its completion), and `done + len <= buf.len()`.
                IoKind::Read => {
                    let Some(b) = op.buf.read_target() else {
                        // A shared buffer cannot be read into; `finish` reports it.
                        finished(&mut ready, s, &mut first_left, p.seq < first);
                        continue;
                    };
                    let ptr = unsafe { b.as_mut_ptr().add(p.done) };
                    opcode::Read::new(fd, ptr, len).offset(off).build()
                }
                IoKind::Write => {
                    let ptr = unsafe { op.buf.as_ptr().add(p.done) };
                    opcode::Write::new(fd, ptr, len).offset(off).build()
                }
            }
            .user_data(s as u64);
            // SAFETY: see above; the entry's memory stays valid until its
            // completion is reaped.
            if unsafe { ring.submission().push(&sqe) }.is_err() {
                retry.push_front(s);
                break;
            }
            outstanding += 1;
            pushed += 1;
        }
        if pushed > 0 {
            // Into the kernel now, before the callbacks below; an error
            // here shows again at the wait, which submits too.
            let _ = ring.submit();
            if !told {
                told = true;
                submitted();
            }
        }
        // Hand completed ops back while the rest stay in flight: one, and
        // then the next wave's worth of submissions, when capped.
        if capped {
            hand_back(&mut ready, 1, &mut slots, &mut free, on_done);
            continue;
        }
        hand_back(&mut ready, usize::MAX, &mut slots, &mut free, on_done);
        if outstanding == 0 {
            if exhausted && retry.is_empty() {
                return;
            }
            let Some(e) = &ring_err else { continue };
            // Nothing in the kernel and the ring failed: the rest fail
            // without submission, including ops the stream still has.
            let e = io::Error::new(e.kind(), e.to_string());
            fail_rest(&mut slots, &mut retry, &mut ready, &e);
            if !exhausted {
                while let Some(op) = next() {
                    let err = io::Error::new(e.kind(), e.to_string());
                    on_done(seq, finish(op.kind, op.buf, 0, Some(err)));
                    seq += 1;
                }
                exhausted = true;
            }
        }
        if outstanding > 0 {
            if let Err(e) = ring.submit_and_wait(1) {
                if e.kind() == io::ErrorKind::Interrupted || e.raw_os_error() == Some(libc::EBUSY) {
                    continue;
                }
                if ring_err.is_none() {
                    ring_err = Some(e);
                    continue;
                }
                // Waiting itself keeps failing with ops still in the kernel:
                // the buffers cannot be freed safely. Leak them and fail.
                tracing::error!(
                    "io_uring wait failed with {outstanding} ops in flight; leaking their buffers"
                );
                let seqs: Vec<usize> = slots.iter().flatten().map(|p| p.seq).collect();
                std::mem::forget(slots);
                let fail = || IoDone {
                    buf: IoBuf::Owned(AlignedBuf::empty()),
                    result: Err(io::Error::other("io_uring failed with ops in flight")),
                };
                for s in seqs {
                    on_done(s, fail());
                }
                while !exhausted && let Some(_op) = next() {
                    on_done(seq, fail());
                    seq += 1;
                }
                return;
            }
            let cqes: Vec<(u64, i32)> = ring
                .completion()
                .map(|c| (c.user_data(), c.result()))
                .collect();
            for (ud, res) in cqes {
                let s = ud as usize;
                let Some(Some(p)) = slots.get_mut(s) else {
                    continue;
                };
                outstanding -= 1;
                let complete = if res < 0 {
                    let errno = -res;
                    if errno == libc::EINTR || errno == libc::EAGAIN {
                        false
                    } else {
                        p.err = Some(io::Error::from_raw_os_error(errno));
                        true
                    }
                } else if res == 0 {
                    // End of file for reads; a zero-byte write is reported by `finish`.
                    true
                } else {
                    p.done += res as usize;
                    p.done >= p.op.buf.len()
                };
                if complete {
                    finished(&mut ready, s, &mut first_left, p.seq < first);
                } else {
                    retry.push_back(s);
                }
            }
        }
    }
}

/// Marks every op waiting for resubmission as failed with `e`.
fn fail_rest(
    slots: &mut [Option<Pending<'_>>],
    retry: &mut VecDeque<usize>,
    ready: &mut Vec<usize>,
    e: &io::Error,
) {
    while let Some(s) = retry.pop_front() {
        if let Some(p) = slots[s].as_mut() {
            p.err = Some(io::Error::new(e.kind(), e.to_string()));
            ready.push(s);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;

    use super::*;

    /// With a first wave, the op that ends it goes back after at most a
    /// wave's worth of later ops per finished op went into the kernel,
    /// not after a whole window of them; every op still goes back once,
    /// with its bytes.
    #[test]
    fn a_wave_s_worth_goes_in_before_each_hand_back() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        let (len, n, in_flight) = (4096, 40, 16);
        let bytes: Vec<u8> = (0..len * n).map(|j| (j / len) as u8).collect();
        std::fs::write(&path, &bytes).unwrap();
        let file = std::fs::File::open(&path).unwrap();
        for first in [1usize, 2, 3] {
            let mut ops = (0..n).map(|i| {
                IoOp::read(
                    &file,
                    (i * len) as u64,
                    AlignedBuf::zeroed(len, 4096).unwrap(),
                )
            });
            let pulled = Cell::new(0usize);
            // (op, ops pulled when it was handed back)
            let mut log = Vec::new();
            let ran = with_ring(|ring| {
                drive(
                    ring,
                    in_flight,
                    Order::SubmitFirst { first },
                    &mut || {},
                    &mut || {
                        let op = ops.next();
                        pulled.set(pulled.get() + usize::from(op.is_some()));
                        op
                    },
                    &mut |i, d| {
                        assert_eq!(d.result.as_ref().ok(), Some(&len), "op {i}");
                        assert!(d.buf.iter().all(|&b| b == i as u8), "op {i}'s bytes");
                        log.push((i, pulled.get()));
                    },
                )
            });
            assert!(ran.is_some(), "io_uring available on the test machine");
            let mut seen: Vec<usize> = log.iter().map(|&(i, _)| i).collect();
            seen.sort_unstable();
            assert_eq!(seen, (0..n).collect::<Vec<_>>(), "each op once");
            let &(_, at_end) = log.iter().rev().find(|&&(i, _)| i < first).unwrap();
            // The whole window would be `first + in_flight` ops.
            assert!(
                at_end <= first + first * first,
                "first {first}: {at_end} ops pulled before the first wave was all back: {log:?}"
            );
        }
    }
}
