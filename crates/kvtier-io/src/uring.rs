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

use crate::engine::{IoDone, IoKind, IoOp, MAX_IN_FLIGHT, finish};

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
    op: IoOp<'f>,
    done: usize,
    err: Option<io::Error>,
    finished: bool,
}

/// Runs a batch on this thread's ring (created on first use).
pub(crate) fn run_batch(ops: Vec<IoOp<'_>>, in_flight: usize) -> Vec<IoDone> {
    RING.with(|cell| {
        let mut slot = match cell.try_borrow_mut() {
            Ok(s) => s,
            // Re-entrancy cannot happen (no callbacks run inside a batch),
            // but fall back to the thread pool rather than panic if it did.
            Err(_) => return crate::threads::run_batch(ops, in_flight),
        };
        if slot.is_none() {
            match IoUring::new(MAX_IN_FLIGHT as u32) {
                Ok(r) => *slot = Some(r),
                Err(e) => {
                    tracing::warn!("cannot create io_uring ({e}); running batch on threads");
                    drop(slot);
                    return crate::threads::run_batch(ops, in_flight);
                }
            }
        }
        match slot.as_mut() {
            Some(ring) => drive(ring, ops, in_flight),
            None => crate::threads::run_batch(ops, in_flight),
        }
    })
}

fn drive(ring: &mut IoUring, ops: Vec<IoOp<'_>>, in_flight: usize) -> Vec<IoDone> {
    let n = ops.len();
    let mut ps: Vec<Pending<'_>> = ops
        .into_iter()
        .map(|op| Pending {
            op,
            done: 0,
            err: None,
            finished: false,
        })
        .collect();
    let mut queue: VecDeque<usize> = (0..n).collect();
    let mut outstanding = 0usize;
    let mut finished = 0usize;
    let mut ring_err: Option<io::Error> = None;

    while finished < n {
        // Fill the ring up to the in-flight limit.
        while ring_err.is_none() && outstanding < in_flight {
            let Some(i) = queue.pop_front() else { break };
            let p = &mut ps[i];
            let remaining = p.op.buf.len() - p.done;
            if remaining == 0 {
                p.finished = true;
                finished += 1;
                continue;
            }
            let len = remaining.min(MAX_CHUNK) as u32;
            let fd = types::Fd(p.op.file.as_raw_fd());
            let off = p.op.offset + p.done as u64;
            let sqe = match p.op.kind {
                // SAFETY (both arms): the buffer is owned by `ps`, which
                // outlives every in-flight op (we only return after all
                // completions), and `done + len <= buf.len()`.
                IoKind::Read => {
                    let Some(b) = p.op.buf.owned_mut() else {
                        // A shared buffer cannot be read into; `finish` reports it.
                        p.finished = true;
                        finished += 1;
                        continue;
                    };
                    let ptr = unsafe { b.as_mut_ptr().add(p.done) };
                    opcode::Read::new(fd, ptr, len).offset(off).build()
                }
                IoKind::Write => {
                    let ptr = unsafe { p.op.buf.as_ptr().add(p.done) };
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
        if outstanding == 0 {
            // Nothing in the kernel: either all done, or the ring failed and
            // the rest must be failed without submission.
            if let Some(e) = &ring_err {
                while let Some(i) = queue.pop_front() {
                    let p = &mut ps[i];
                    p.err = Some(io::Error::new(e.kind(), e.to_string()));
                    p.finished = true;
                    finished += 1;
                }
            }
            if finished < n && queue.is_empty() {
                break; // cannot happen; guards against an endless loop
            }
            continue;
        }
        if let Err(e) = ring.submit_and_wait(1) {
            if e.kind() == io::ErrorKind::Interrupted || e.raw_os_error() == Some(libc::EBUSY) {
                continue;
            }
            if ring_err.is_none() {
                ring_err = Some(e);
                continue;
            }
            // Waiting itself keeps failing with ops still in the kernel: the
            // buffers cannot be freed safely. Leak them and fail the batch.
            tracing::error!(
                "io_uring wait failed with {outstanding} ops in flight; leaking their buffers"
            );
            let err = io::Error::other("io_uring failed with ops in flight");
            let out = (0..n)
                .map(|_| IoDone {
                    buf: crate::engine::IoBuf::Owned(crate::buffer::AlignedBuf::empty()),
                    result: Err(io::Error::new(err.kind(), err.to_string())),
                })
                .collect();
            std::mem::forget(ps);
            return out;
        }
        let cqes: Vec<(u64, i32)> = ring
            .completion()
            .map(|c| (c.user_data(), c.result()))
            .collect();
        for (ud, res) in cqes {
            let i = ud as usize;
            let Some(p) = ps.get_mut(i) else { continue };
            outstanding -= 1;
            if res < 0 {
                let errno = -res;
                if errno == libc::EINTR || errno == libc::EAGAIN {
                    queue.push_back(i);
                } else {
                    p.err = Some(io::Error::from_raw_os_error(errno));
                    p.finished = true;
                    finished += 1;
                }
            } else if res == 0 {
                // End of file for reads; a zero-byte write is reported by `finish`.
                p.finished = true;
                finished += 1;
            } else {
                p.done += res as usize;
                if p.done >= p.op.buf.len() {
                    p.finished = true;
                    finished += 1;
                } else {
                    queue.push_back(i);
                }
            }
        }
    }
    ps.into_iter()
        .map(|p| finish(p.op.kind, p.op.buf, p.done, p.err))
        .collect()
}
