//! io_uring backend: one ring per calling thread.
//!
//! The caller submits up to `in_flight` ops, waits for at least one
//! completion, refills, and returns once every op has completed. Partial
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
use crate::engine::{IoBuf, IoDone, IoKind, IoOp, MAX_IN_FLIGHT, finish};

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
    /// `None` once completed and handed to the callback.
    op: Option<IoOp<'f>>,
    done: usize,
    err: Option<io::Error>,
}

/// Runs a batch on this thread's ring (created on first use), calling `f`
/// on each op as it completes, while the others are still in flight.
pub(crate) fn run_batch_map<T, F>(ops: Vec<IoOp<'_>>, in_flight: usize, f: &F) -> Vec<(IoDone, T)>
where
    T: Send,
    F: Fn(usize, &IoDone) -> T + Sync,
{
    RING.with(|cell| {
        let mut slot = match cell.try_borrow_mut() {
            Ok(s) => s,
            // Re-entrancy (a callback running a batch of its own) gets the
            // thread pool rather than a second borrow of this ring.
            Err(_) => return crate::threads::run_batch_map(ops, in_flight, f),
        };
        if slot.is_none() {
            match IoUring::new(MAX_IN_FLIGHT as u32) {
                Ok(r) => *slot = Some(r),
                Err(e) => {
                    tracing::warn!("cannot create io_uring ({e}); running batch on threads");
                    drop(slot);
                    return crate::threads::run_batch_map(ops, in_flight, f);
                }
            }
        }
        match slot.as_mut() {
            Some(ring) => drive(ring, ops, in_flight, f),
            None => crate::threads::run_batch_map(ops, in_flight, f),
        }
    })
}

fn drive<T, F>(ring: &mut IoUring, ops: Vec<IoOp<'_>>, in_flight: usize, f: &F) -> Vec<(IoDone, T)>
where
    F: Fn(usize, &IoDone) -> T,
{
    let n = ops.len();
    let mut ps: Vec<Pending<'_>> = ops
        .into_iter()
        .map(|op| Pending {
            op: Some(op),
            done: 0,
            err: None,
        })
        .collect();
    let mut results: Vec<Option<(IoDone, T)>> = (0..n).map(|_| None).collect();
    let mut queue: VecDeque<usize> = (0..n).collect();
    let mut ready: Vec<usize> = Vec::new();
    let mut outstanding = 0usize;
    let mut finished = 0usize;
    let mut ring_err: Option<io::Error> = None;

    while finished < n {
        // Fill the ring up to the in-flight limit.
        while ring_err.is_none() && outstanding < in_flight {
            let Some(i) = queue.pop_front() else { break };
            let p = &mut ps[i];
            let Some(op) = p.op.as_mut() else { continue };
            let remaining = op.buf.len() - p.done;
            if remaining == 0 {
                ready.push(i);
                continue;
            }
            let len = remaining.min(MAX_CHUNK) as u32;
            let fd = types::Fd(op.file.as_raw_fd());
            let off = op.offset + p.done as u64;
            let sqe = match op.kind {
                // SAFETY (both arms): the buffer is owned by `ps`, which
                // outlives every in-flight op (an op leaves `ps` only after
                // its completion), and `done + len <= buf.len()`.
                IoKind::Read => {
                    let Some(b) = op.buf.owned_mut() else {
                        // A shared buffer cannot be read into; `finish` reports it.
                        ready.push(i);
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
            .user_data(i as u64);
            // SAFETY: see above; the entry's memory stays valid until its
            // completion is reaped.
            if unsafe { ring.submission().push(&sqe) }.is_err() {
                queue.push_front(i);
                break;
            }
            outstanding += 1;
        }
        if outstanding == 0 && ready.is_empty() {
            // Nothing in the kernel and nothing to hand back: the ring
            // failed, so the rest fail without submission.
            let Some(e) = &ring_err else { break };
            while let Some(i) = queue.pop_front() {
                ps[i].err = Some(io::Error::new(e.kind(), e.to_string()));
                ready.push(i);
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
                std::mem::forget(ps);
                return (0..n)
                    .map(|i| {
                        let done = IoDone {
                            buf: IoBuf::Owned(AlignedBuf::empty()),
                            result: Err(io::Error::other("io_uring failed with ops in flight")),
                        };
                        let t = f(i, &done);
                        (done, t)
                    })
                    .collect();
            }
            let cqes: Vec<(u64, i32)> = ring
                .completion()
                .map(|c| (c.user_data(), c.result()))
                .collect();
            for (ud, res) in cqes {
                let i = ud as usize;
                let Some(p) = ps.get_mut(i) else { continue };
                let Some(op) = p.op.as_ref() else { continue };
                outstanding -= 1;
                if res < 0 {
                    let errno = -res;
                    if errno == libc::EINTR || errno == libc::EAGAIN {
                        queue.push_back(i);
                    } else {
                        p.err = Some(io::Error::from_raw_os_error(errno));
                        ready.push(i);
                    }
                } else if res == 0 {
                    // End of file for reads; a zero-byte write is reported by `finish`.
                    ready.push(i);
                } else {
                    p.done += res as usize;
                    if p.done >= op.buf.len() {
                        ready.push(i);
                    } else {
                        queue.push_back(i);
                    }
                }
            }
        }
        // Hand completed ops to the callback while the rest stay in flight.
        for i in ready.drain(..) {
            let p = &mut ps[i];
            let Some(op) = p.op.take() else { continue };
            let done = finish(op.kind, op.buf, p.done, p.err.take());
            let t = f(i, &done);
            results[i] = Some((done, t));
            finished += 1;
        }
    }
    results.into_iter().flatten().collect()
}
