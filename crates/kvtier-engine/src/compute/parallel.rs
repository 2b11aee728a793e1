//! Splitting the decode step's work over the CPU threads.
//!
//! A decode step has about five parallel parts per layer, each a few hundred
//! microseconds. Handed to rayon, each one woke a sleeping worker (and on a VM
//! a halted virtual CPU) and waited for it, and kvtier decoded well below
//! llama.cpp's speed through its server, where llama.cpp keeps its workers
//! spinning between operations. So the parts run on a pool whose workers spin
//! for a while after each part before they park, where the calling thread works
//! too and every thread takes pieces from a shared cursor.
//!
//! Why kvtier's own pool and not candle's barrier pool, which works that way
//! too: candle's caller waits at a barrier for every worker, including one that
//! has not started yet. On a busy machine a worker woken onto a core that
//! another thread holds (the store's reader during a layer-wise restore, or an
//! HTTP connection's task) is queued there until the next timer tick, and the
//! caller, having done every piece itself, spins until that tick for it
//! (docs/decisions.md, "kvtier's own pool for the decode step's parts"). Here a
//! worker must *join* a part before it takes a piece, and the caller, once
//! every piece is taken, closes the part: a worker that joined is waited for
//! (it holds a piece), one that had not is not, and finds the part closed when
//! it runs.
//!
//! The protocol, on one atomic word (`state`): the part's number in the
//! high 32 bits, a closed bit, and in the low 31 bits how many workers
//! joined. The caller writes the part's description while the word says
//! closed, then opens the next number; a worker joins with a
//! compare-and-swap that fails once the part is closed or replaced; the
//! caller closes with `fetch_or`, which returns the count it must wait for.

use std::any::Any;
use std::cell::{Cell, UnsafeCell};
use std::hint::spin_loop;
use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock, TryLockError};
use std::thread::Thread;

/// Runs `f(i, chunk)` for every `chunk`-sized piece `i` of `out` (the last
/// may be shorter), spread over the CPU threads; inline with one thread.
pub fn for_each_chunk<F>(out: &mut [f32], chunk: usize, f: F)
where
    F: Fn(usize, &mut [f32]) + Sync,
{
    let chunk = chunk.max(1);
    let pieces = out.len().div_ceil(chunk);
    let len = out.len();
    let base = Shared(out.as_mut_ptr());
    pool().run(pieces, &|i| {
        let base = &base;
        let start = i * chunk;
        let end = len.min(start + chunk);
        // SAFETY: the pieces `start..end` of distinct `i` are disjoint
        // parts of `out`, which outlives this call (`run` returns only
        // when every piece is done and every thread that took one has
        // left), and each `i` is handed to exactly one thread by the
        // part's cursor.
        let piece = unsafe { std::slice::from_raw_parts_mut(base.0.add(start), end - start) };
        f(i, piece);
    });
}

/// The output's base pointer, shared with the pool's threads (each writes
/// only its own pieces).
struct Shared(*mut f32);

// SAFETY: see `for_each_chunk`: threads write disjoint pieces only.
unsafe impl Sync for Shared {}

/// Rounds a worker spins on `state` after a part before it parks: the
/// default of candle's barrier pool, which the decode step ran on before
/// this pool (`kvtier-lab idle_ttft` measures what a limit does to an idle
/// server's next first token).
const SPIN_LIMIT: u32 = 25_000;

/// The closed bit of `state`.
const CLOSED: u64 = 1 << 31;

/// The joined count's bits of `state`.
const JOINED: u64 = CLOSED - 1;

/// A part's number, from `state`.
fn part_of(state: u64) -> u64 {
    state >> 32
}

thread_local! {
    /// Set on the pool's workers, and on a caller while it runs a part: a
    /// nested call runs inline (the pool runs one part at a time).
    static IN_POOL: Cell<bool> = const { Cell::new(false) };
}

/// What the current part runs: `call(data, i)` for piece `i`.
#[derive(Clone, Copy)]
struct Part {
    call: unsafe fn(*const (), usize),
    data: *const (),
    pieces: usize,
}

/// Calls the closure behind `data` with piece `i`.
///
/// # Safety
///
/// `data` points to a live `F`.
unsafe fn call<F: Fn(usize) + Sync>(data: *const (), i: usize) {
    // SAFETY: the caller guarantees `data` is a live `F`.
    unsafe { (*(data as *const F))(i) }
}

/// What the caller and the workers share. It lives as long as the process
/// (the pool is a `static`).
struct Inner {
    /// Part number, closed bit, joined count (see the module docs).
    state: AtomicU64,
    /// The current part; written only while `state` is closed and every
    /// worker that joined the last part has left.
    part: UnsafeCell<Part>,
    /// The next piece to take.
    cursor: AtomicUsize,
    /// Workers that have left the current part.
    left: AtomicU32,
    /// The first panic of a worker in the current part.
    panic: Mutex<Option<Box<dyn Any + Send>>>,
}

impl Inner {
    /// No part yet: closed, part 0.
    fn new() -> Self {
        Inner {
            state: AtomicU64::new(CLOSED),
            part: UnsafeCell::new(Part {
                call: call::<fn(usize)>,
                data: std::ptr::null(),
                pieces: 0,
            }),
            cursor: AtomicUsize::new(0),
            left: AtomicU32::new(0),
            panic: Mutex::new(None),
        }
    }
}

// SAFETY: `part` is written only by the caller holding `Pool::call`, while
// no worker can join (state closed, the last part's workers gone), and read
// by workers only after a successful join; the rest are atomics or a Mutex.
unsafe impl Sync for Inner {}

/// The decode step's pool: workers beside the calling thread.
struct Pool {
    inner: &'static Inner,
    workers: Vec<Thread>,
    /// One caller at a time; a second one meanwhile runs its part inline.
    call: Mutex<()>,
}

/// The process's pool, with one worker fewer than the engine's CPU threads
/// (`RAYON_NUM_THREADS`, which `device::fix_cpu_threads` sets): the caller
/// is the last.
fn pool() -> &'static Pool {
    static POOL: OnceLock<Pool> = OnceLock::new();
    POOL.get_or_init(|| Pool::new(candle_core::utils::get_num_threads().saturating_sub(1)))
}

impl Pool {
    /// Starts `n` workers (fewer if a thread cannot be started: the caller
    /// does the pieces nobody else takes).
    fn new(n: usize) -> Self {
        let inner: &'static Inner = Box::leak(Box::new(Inner::new()));
        let workers = (0..n)
            .filter_map(|k| {
                std::thread::Builder::new()
                    .name(format!("kvtier-pool-{k}"))
                    .spawn(move || work(inner))
                    .ok()
                    .map(|h| h.thread().clone())
            })
            .collect();
        Pool {
            inner,
            workers,
            call: Mutex::new(()),
        }
    }

    /// Runs `f(i)` for every `i` in `0..pieces`, each exactly once, on the
    /// calling thread and whichever workers join in time. Returns when
    /// every piece is done; a panic in a piece is raised here after that.
    fn run<F: Fn(usize) + Sync>(&self, pieces: usize, f: &F) {
        if pieces <= 1 || self.workers.is_empty() || IN_POOL.with(Cell::get) {
            (0..pieces).for_each(f);
            return;
        }
        // A caller that panicked in its own piece poisons the lock; it
        // guards nothing but the turn, so the poison is ignored.
        let guard = match self.call.try_lock() {
            Ok(g) => Some(g),
            Err(TryLockError::Poisoned(p)) => Some(p.into_inner()),
            Err(TryLockError::WouldBlock) => None,
        };
        let Some(_guard) = guard else {
            (0..pieces).for_each(f);
            return;
        };
        let inner = self.inner;
        let state = inner.state.load(Ordering::Relaxed);
        // SAFETY: `state` is closed and every worker that joined the last
        // part has left (the last call waited for them), so no thread reads
        // `part`; `f` outlives the part, as `Open` waits on drop.
        unsafe {
            *inner.part.get() = Part {
                call: call::<F>,
                data: f as *const F as *const (),
                pieces,
            };
        }
        inner.cursor.store(0, Ordering::Relaxed);
        inner.left.store(0, Ordering::Relaxed);
        // Publishes the part: a worker's successful join (Acquire) sees it.
        inner
            .state
            .store((part_of(state) + 1) << 32, Ordering::Release);
        let open = Open(inner);
        for w in &self.workers {
            w.unpark();
        }
        IN_POOL.with(|c| c.set(true));
        take_pieces(inner, pieces, f);
        drop(open);
    }
}

/// Takes pieces from the cursor and runs them until none is left.
fn take_pieces<F: Fn(usize) + ?Sized>(inner: &Inner, pieces: usize, f: &F) {
    loop {
        let i = inner.cursor.fetch_add(1, Ordering::Relaxed);
        if i >= pieces {
            return;
        }
        f(i);
    }
}

/// An open part: dropping it (at the end of `run`, or while the caller
/// unwinds from a panic in its own piece) closes the part and waits for
/// the workers that joined it, so none touches the caller's closure after.
/// Then it takes a worker's panic, if any, and raises it unless the caller
/// is unwinding already.
struct Open(&'static Inner);

impl Drop for Open {
    fn drop(&mut self) {
        IN_POOL.with(|c| c.set(false));
        let joined = (self.0.state.fetch_or(CLOSED, Ordering::AcqRel) & JOINED) as u32;
        let mut spins = 0u32;
        while self.0.left.load(Ordering::Acquire) != joined {
            // A joined worker holds a piece; if the kernel took its core,
            // let it have this one.
            spins += 1;
            if spins < SPIN_LIMIT {
                spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
        let panic = self.0.panic.lock().ok().and_then(|mut p| p.take());
        if let Some(p) = panic
            && !std::thread::panicking()
        {
            resume_unwind(p);
        }
    }
}

/// A worker: waits for a part, joins it if it is still open, takes pieces
/// until none is left, leaves.
fn work(inner: &'static Inner) {
    IN_POOL.with(|c| c.set(true));
    let mut seen = part_of(inner.state.load(Ordering::Relaxed));
    loop {
        // Spin briefly, then park (an `unpark` before the `park` makes it
        // return at once, so a part opened in between is not missed).
        let mut spins = 0u32;
        let mut state = inner.state.load(Ordering::Acquire);
        while part_of(state) == seen {
            spins += 1;
            if spins < SPIN_LIMIT {
                spin_loop();
            } else {
                std::thread::park();
                spins = 0;
            }
            state = inner.state.load(Ordering::Acquire);
        }
        seen = part_of(state);
        if join(inner, state) {
            // SAFETY: joined, so the caller waits for this worker before it
            // returns or writes the next part: `part` and its closure live.
            let part = unsafe { *inner.part.get() };
            let piece = |i: usize| {
                // SAFETY: `part.data` is the live closure `part.call` takes.
                unsafe { (part.call)(part.data, i) }
            };
            if let Err(p) =
                catch_unwind(AssertUnwindSafe(|| take_pieces(inner, part.pieces, &piece)))
            {
                // Leaves the rest of the pieces to the caller (it takes
                // every piece left) and reports the panic there.
                if let Ok(mut slot) = inner.panic.lock() {
                    slot.get_or_insert(p);
                }
            }
            inner.left.fetch_add(1, Ordering::Release);
        }
    }
}

/// Joins the part `state` shows if it is still open and still that part.
fn join(inner: &Inner, mut state: u64) -> bool {
    let part = part_of(state);
    loop {
        if state & CLOSED != 0 || part_of(state) != part {
            return false;
        }
        match inner.state.compare_exchange_weak(
            state,
            state + 1,
            Ordering::AcqRel,
            Ordering::Acquire,
        ) {
            Ok(_) => return true,
            Err(now) => state = now,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_piece_is_visited_once_with_its_index() {
        for (len, chunk) in [(0, 4), (1, 4), (10, 3), (1000, 7), (64, 64)] {
            let mut out = vec![0f32; len];
            for_each_chunk(&mut out, chunk, |i, piece| {
                for (j, v) in piece.iter_mut().enumerate() {
                    *v += (i * chunk + j) as f32 + 1.0;
                }
            });
            for (k, v) in out.iter().enumerate() {
                assert_eq!(*v, k as f32 + 1.0, "{len}/{chunk} at {k}");
            }
        }
    }

    /// Many short parts in a row, on a pool of three workers, from several
    /// callers at once: each piece runs once per part, whichever thread
    /// takes it, and workers that join late never run a finished part's
    /// pieces again (the counts would exceed 1).
    #[test]
    fn many_parts_from_many_callers_run_each_piece_once() {
        let pool = Pool::new(3);
        assert_eq!(pool.workers.len(), 3);
        std::thread::scope(|s| {
            for caller in 0..3 {
                let pool = &pool;
                s.spawn(move || {
                    for round in 0..2000 {
                        let pieces = 1 + (round + caller) % 37;
                        let hits: Vec<AtomicU32> = (0..pieces).map(|_| AtomicU32::new(0)).collect();
                        pool.run(pieces, &|i| {
                            hits[i].fetch_add(1, Ordering::Relaxed);
                        });
                        for (i, h) in hits.iter().enumerate() {
                            assert_eq!(
                                h.load(Ordering::Relaxed),
                                1,
                                "caller {caller} round {round} piece {i}"
                            );
                        }
                    }
                });
            }
        });
    }

    /// A worker that has not joined is not waited for: with a listed
    /// worker that never runs (this test's own thread stands in for it),
    /// every part still finishes, its pieces all on the caller. Then a
    /// worker that starts late on the same parts joins the next ones and
    /// never runs a finished part's pieces.
    #[test]
    fn the_caller_does_not_wait_for_a_worker_that_has_not_joined() {
        let inner: &'static Inner = Box::leak(Box::new(Inner::new()));
        let absent = Pool {
            inner,
            workers: vec![std::thread::current()],
            call: Mutex::new(()),
        };
        let me = std::thread::current().id();
        for pieces in [2, 9, 64] {
            let hits: Vec<AtomicU32> = (0..pieces).map(|_| AtomicU32::new(0)).collect();
            absent.run(pieces, &|i| {
                assert_eq!(std::thread::current().id(), me);
                hits[i].fetch_add(1, Ordering::Relaxed);
            });
            assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
        }
        let late = std::thread::spawn(move || work(inner));
        let present = Pool {
            inner,
            workers: vec![late.thread().clone()],
            call: Mutex::new(()),
        };
        // Parts until the worker took a piece of one (it joins once the
        // kernel runs it: allow a loaded machine 10 s).
        let by_worker = AtomicU32::new(0);
        let since = std::time::Instant::now();
        while by_worker.load(Ordering::Relaxed) == 0 && since.elapsed().as_secs() < 10 {
            let hits: Vec<AtomicU32> = (0..16).map(|_| AtomicU32::new(0)).collect();
            present.run(16, &|i| {
                if std::thread::current().id() != me {
                    by_worker.fetch_add(1, Ordering::Relaxed);
                }
                hits[i].fetch_add(1, Ordering::Relaxed);
            });
            assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
        }
        assert!(
            by_worker.load(Ordering::Relaxed) > 0,
            "the late worker never joined"
        );
    }

    /// A panic in a piece reaches the caller, after every other piece
    /// taken is done, and the pool still runs parts after it.
    #[test]
    fn a_panic_in_a_piece_is_raised_in_the_caller_and_the_pool_goes_on() {
        let pool = Pool::new(2);
        for bad in [0usize, 5, 63] {
            let done = AtomicU32::new(0);
            let r = catch_unwind(AssertUnwindSafe(|| {
                pool.run(64, &|i| {
                    if i == bad {
                        panic!("piece {i}");
                    }
                    done.fetch_add(1, Ordering::Relaxed);
                })
            }));
            assert!(r.is_err(), "piece {bad}'s panic was lost");
            let hits: Vec<AtomicU32> = (0..64).map(|_| AtomicU32::new(0)).collect();
            pool.run(64, &|i| {
                hits[i].fetch_add(1, Ordering::Relaxed);
            });
            assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
        }
    }

    /// A part started from inside a piece runs inline instead of waiting
    /// on the pool it runs in.
    #[test]
    fn a_nested_part_runs_inline() {
        let pool = Pool::new(1);
        let total = AtomicU32::new(0);
        pool.run(8, &|_| {
            pool.run(4, &|_| {
                total.fetch_add(1, Ordering::Relaxed);
            });
        });
        assert_eq!(total.load(Ordering::Relaxed), 32);
    }
}
