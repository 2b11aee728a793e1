//! Thread-pool backend: `pread`/`pwrite` on scoped threads.
//!
//! Used where io_uring is unavailable (old kernels, seccomp sandboxes). The
//! calling thread works too, so `in_flight = 1` runs without spawning.

use std::io;
use std::os::unix::fs::FileExt;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::io_op::{IoDone, IoKind, IoOp, finish};

/// Runs `ops` with up to `in_flight` threads, calling `f` on each op as it
/// completes (on the thread that ran it); results in submission order. The
/// first `first` ops run alone, the rest once all of those are done.
/// `submitted` runs once, just before the first ops start (when there are
/// any).
pub(crate) fn run_batch_map<'f, T, F>(
    mut ops: Vec<IoOp<'f>>,
    first: usize,
    in_flight: usize,
    submitted: &mut dyn FnMut(),
    f: &F,
) -> Vec<(IoDone<'f>, T)>
where
    T: Send,
    F: Fn(usize, &IoDone<'f>) -> T + Sync,
{
    if !ops.is_empty() {
        submitted();
    }
    if first == 0 || first >= ops.len() {
        return run_wave(ops, 0, in_flight, f);
    }
    let rest = ops.split_off(first);
    let mut out = run_wave(ops, 0, in_flight, f);
    out.extend(run_wave(rest, first, in_flight, f));
    out
}

/// [`run_batch_map`] of one wave, whose ops are `offset..` of the batch.
fn run_wave<'f, T, F>(
    ops: Vec<IoOp<'f>>,
    offset: usize,
    in_flight: usize,
    f: &F,
) -> Vec<(IoDone<'f>, T)>
where
    T: Send,
    F: Fn(usize, &IoDone<'f>) -> T + Sync,
{
    let n = ops.len();
    let slots: Vec<Mutex<Option<IoOp<'_>>>> =
        ops.into_iter().map(|op| Mutex::new(Some(op))).collect();
    let results: Vec<Mutex<Option<(IoDone<'f>, T)>>> = (0..n).map(|_| Mutex::new(None)).collect();
    let next = AtomicUsize::new(0);
    let work = || {
        loop {
            let i = next.fetch_add(1, Ordering::Relaxed);
            if i >= n {
                break;
            }
            let op = slots[i].lock().unwrap_or_else(|p| p.into_inner()).take();
            if let Some(op) = op {
                let done = run_one(op);
                let t = f(offset + i, &done);
                *results[i].lock().unwrap_or_else(|p| p.into_inner()) = Some((done, t));
            }
        }
    };
    let workers = in_flight.min(n);
    std::thread::scope(|s| {
        for _ in 1..workers {
            s.spawn(work);
        }
        work();
    });
    results
        .into_iter()
        .filter_map(|m| m.into_inner().unwrap_or_else(|p| p.into_inner()))
        .collect()
}

/// Runs a stream with up to `in_flight` threads: each takes the next op
/// from `next` (one at a time, under a lock), runs it, and hands it to
/// `on_done` (also under a lock) with its position in the stream.
pub(crate) fn run_stream<'f>(
    in_flight: usize,
    next: &mut (dyn FnMut() -> Option<IoOp<'f>> + Send),
    on_done: &mut (dyn FnMut(usize, IoDone<'f>) + Send),
) {
    let source = Mutex::new((0usize, next));
    let sink = Mutex::new(on_done);
    let work = || {
        loop {
            let pulled = {
                let mut g = source.lock().unwrap_or_else(|p| p.into_inner());
                let (seq, next) = &mut *g;
                next().map(|op| {
                    *seq += 1;
                    (*seq - 1, op)
                })
            };
            let Some((i, op)) = pulled else { break };
            let done = run_one(op);
            (sink.lock().unwrap_or_else(|p| p.into_inner()))(i, done);
        }
    };
    std::thread::scope(|s| {
        for _ in 1..in_flight {
            s.spawn(work);
        }
        work();
    });
}

fn run_one(op: IoOp<'_>) -> IoDone<'_> {
    let IoOp {
        kind,
        file,
        offset,
        mut buf,
    } = op;
    let want = buf.len();
    let mut done = 0usize;
    let mut err = None;
    while done < want {
        let at = offset + done as u64;
        let r = match (kind, buf.read_target()) {
            (IoKind::Read, Some(b)) => file.read_at(&mut b[done..], at),
            (IoKind::Read, None) => break, // reported by `finish`
            (IoKind::Write, _) => file.write_at(&buf[done..], at),
        };
        match r {
            Ok(0) => break,
            Ok(k) => done += k,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => {
                err = Some(e);
                break;
            }
        }
    }
    finish(kind, buf, done, err)
}
