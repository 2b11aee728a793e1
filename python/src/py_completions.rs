//! `Completions`: a completion queue with an eventfd, for engines that poll
//! a file descriptor for finished batches (LMCache's `native_plugin` L2
//! adapters, `kvtier/lmcache.py`).
//!
//! A batch is one or more groups of keys, each group in one `Namespace`
//! (LMCache's objects of one size live in one namespace). Its loads and
//! saves run on the store's threads; the last group to finish pushes
//! `(future_id, ok, err, per-key)` into the queue and writes the eventfd,
//! from the store's thread, without the GIL. Lookups run at submit with
//! the GIL released. Every loaded block is verified by the store: a block
//! whose result is not a hit (missing, corrupt, unreadable) is `false` in
//! the per-key list, and its bytes are not to be used.
//!
//! The caller keeps the memory it hands in alive until the batch's
//! completion is drained (`kvtier/lmcache.py` holds the buffers by future
//! id).

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use kvtier_store::{BlockKey, BlockRegions, BlockResult as StoreResult, TieredStore};
use parking_lot::Mutex;
use pyo3::exceptions::{PyOSError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::py_store::Namespace;

/// One finished batch: `(future_id, ok, err, per-key results)`.
type Done = (u64, bool, Option<String>, Option<Vec<bool>>);

struct Queue {
    event: OwnedFd,
    done: Mutex<Vec<Done>>,
}

impl Queue {
    fn push(&self, done: Done) {
        self.done.lock().push(done);
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from `one` to the eventfd this queue owns.
        // A full counter (EAGAIN) already wakes the reader, so the result
        // is not needed.
        let _ = unsafe {
            libc::write(
                self.event.as_raw_fd(),
                (&raw const one).cast::<libc::c_void>(),
                8,
            )
        };
    }
}

/// What a batch's groups need once the last of them is done.
struct Batch {
    id: u64,
    queue: Arc<Queue>,
    keys: usize,
    load: bool,
    /// Groups not finished, plus one held by the submitter until every
    /// group is started.
    left: AtomicUsize,
    /// Per group: the batch indices of its keys and its transfer.
    started: Mutex<Vec<(Vec<usize>, kvtier_store::Transfer)>>,
    errors: Mutex<Vec<String>>,
}

impl Batch {
    fn finish_one(self: &Arc<Self>) {
        if self.left.fetch_sub(1, Ordering::AcqRel) != 1 {
            return;
        }
        let started = std::mem::take(&mut *self.started.lock());
        let mut per_key = vec![false; self.keys];
        let mut errors = std::mem::take(&mut *self.errors.lock());
        for (indices, transfer) in started {
            // Every group is done: `wait` returns at once.
            for (i, r) in indices.into_iter().zip(transfer.wait()) {
                per_key[i] = match &r {
                    StoreResult::Hit(_) => true,
                    StoreResult::Stored | StoreResult::Present => !self.load,
                    // A corrupt block is a miss for the engine (the store
                    // has dropped it).
                    StoreResult::Miss | StoreResult::Cancelled | StoreResult::Corrupt(_) => false,
                    StoreResult::Error(why) => {
                        if !self.load {
                            errors.push(why.to_string());
                        }
                        false
                    }
                };
            }
        }
        let ok = errors.is_empty() && (self.load || per_key.iter().all(|&b| b));
        let err = (!errors.is_empty()).then(|| errors.join("; "));
        self.queue.push((self.id, ok, err, Some(per_key)));
    }
}

/// A completion queue whose eventfd becomes readable when a batch is done.
#[pyclass(frozen, module = "kvtier._kvtier")]
pub struct Completions {
    queue: Arc<Queue>,
}

/// A group of a batch: the namespace, the batch indices of its keys, their
/// hashes, and per key its memory `(address, length)`.
type Group<'py> = (
    Bound<'py, Namespace>,
    Vec<usize>,
    Vec<Bound<'py, PyBytes>>,
    Vec<(usize, usize)>,
);

/// A group of a lookup: the namespace, the batch indices of its keys and
/// their hashes.
type LookupGroup<'py> = (Bound<'py, Namespace>, Vec<usize>, Vec<Bound<'py, PyBytes>>);

impl Completions {
    fn submit(&self, future_id: u64, keys: usize, groups: Vec<Group<'_>>, load: bool) {
        let batch = Arc::new(Batch {
            id: future_id,
            queue: self.queue.clone(),
            keys,
            load,
            left: AtomicUsize::new(groups.len() + 1),
            started: Mutex::new(Vec::with_capacity(groups.len())),
            errors: Mutex::new(Vec::new()),
        });
        for (ns, indices, hashes, memory) in groups {
            let ns = ns.get();
            let started = start(ns, &hashes, &memory, load, &batch);
            match started {
                Ok(t) => batch.started.lock().push((indices, t)),
                Err(e) => {
                    batch.errors.lock().push(e);
                    batch.finish_one();
                }
            }
        }
        batch.finish_one();
    }
}

fn start(
    ns: &Namespace,
    hashes: &[Bound<'_, PyBytes>],
    memory: &[(usize, usize)],
    load: bool,
    batch: &Arc<Batch>,
) -> Result<kvtier_store::Transfer, String> {
    if hashes.len() != memory.len() {
        return Err(format!(
            "{} keys but {} buffers",
            hashes.len(),
            memory.len()
        ));
    }
    let layout = ns.layout;
    let keys: Vec<BlockKey> = hashes
        .iter()
        .map(|h| ns.chain.raw_key(h.as_bytes()))
        .collect();
    let mut regions = Vec::with_capacity(memory.len());
    for &(addr, len) in memory {
        // SAFETY: `kvtier/lmcache.py` took each address and length from a
        // buffer it holds (writable for a load) until this batch's
        // completion is drained, which is after the transfer is done.
        let r = unsafe { BlockRegions::from_raw(&layout, &[(0, addr as *mut u8, len)]) };
        regions.push(r.map_err(|e| e.to_string())?);
    }
    let notify_batch = batch.clone();
    let notify: Box<dyn FnOnce() + Send> = Box::new(move || notify_batch.finish_one());
    let run = if load {
        TieredStore::load
    } else {
        TieredStore::save
    };
    run(&ns.store, keys, regions, Some(notify)).map_err(|e| e.to_string())
}

#[pymethods]
impl Completions {
    #[new]
    fn new() -> PyResult<Self> {
        // SAFETY: eventfd takes no pointers; a fd >= 0 is ours to own.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(PyOSError::new_err(format!(
                "eventfd: {}",
                std::io::Error::last_os_error()
            )));
        }
        // SAFETY: `fd` was just opened and is owned by nobody else.
        let event = unsafe { OwnedFd::from_raw_fd(fd) };
        Ok(Self {
            queue: Arc::new(Queue {
                event,
                done: Mutex::new(Vec::new()),
            }),
        })
    }

    /// The eventfd: readable once a completion is queued.
    fn event_fd(&self) -> i32 {
        self.queue.event.as_raw_fd()
    }

    /// Starts loading a batch of `keys` blocks, given as groups
    /// `(namespace, batch indices, hashes, [(address, length)])`; its
    /// completion's per-key list says which blocks were loaded and passed
    /// their checks (a missing, corrupt or unreadable one is `False`).
    fn submit_load(&self, future_id: u64, keys: usize, groups: Vec<Group<'_>>) {
        self.submit(future_id, keys, groups, true);
    }

    /// Starts saving a batch (groups as `submit_load`); its completion is
    /// ok once every block is stored (or was already).
    fn submit_save(&self, future_id: u64, keys: usize, groups: Vec<Group<'_>>) {
        self.submit(future_id, keys, groups, false);
    }

    /// Looks up a batch of `keys` blocks, given as groups `(namespace,
    /// batch indices, hashes)`, with the GIL released; queues its
    /// completion with one bool per key (held in any tier).
    fn submit_exists(
        &self,
        py: Python<'_>,
        future_id: u64,
        keys: usize,
        groups: Vec<LookupGroup<'_>>,
    ) -> PyResult<()> {
        let mut work: Vec<(TieredStore, Vec<usize>, Vec<BlockKey>)> = Vec::new();
        for (ns, indices, hashes) in groups {
            let ns = ns.get();
            if indices.len() != hashes.len() {
                return Err(PyValueError::new_err("indices and hashes differ in length"));
            }
            if let Some(&i) = indices.iter().find(|&&i| i >= keys) {
                return Err(PyValueError::new_err(format!(
                    "index {i} outside a batch of {keys}"
                )));
            }
            let hs = hashes
                .iter()
                .map(|h| ns.chain.raw_key(h.as_bytes()))
                .collect();
            work.push((ns.store.clone(), indices, hs));
        }
        let queue = self.queue.clone();
        py.detach(move || {
            let mut per_key = vec![false; keys];
            for (store, indices, hs) in work {
                for (i, k) in indices.into_iter().zip(hs) {
                    // A key asked of several namespaces is held if any holds it.
                    per_key[i] |= store.lookup_prefix(std::slice::from_ref(&k)).hits() == 1;
                }
            }
            queue.push((future_id, true, None, Some(per_key)));
        });
        Ok(())
    }

    /// Queues a completion made by the caller (for batches it answers
    /// itself) and wakes the eventfd.
    #[pyo3(signature = (future_id, ok, err = None, per_key = None))]
    fn push(&self, future_id: u64, ok: bool, err: Option<String>, per_key: Option<Vec<bool>>) {
        self.queue.push((future_id, ok, err, per_key));
    }

    /// Takes every queued completion and clears the eventfd.
    fn drain(&self) -> Vec<Done> {
        let mut count: u64 = 0;
        // SAFETY: reads 8 bytes into `count` from the eventfd this queue
        // owns; EAGAIN (nothing queued) leaves it alone.
        let _ = unsafe {
            libc::read(
                self.queue.event.as_raw_fd(),
                (&raw mut count).cast::<libc::c_void>(),
                8,
            )
        };
        std::mem::take(&mut *self.queue.done.lock())
    }

    /// Completions queued and not drained yet.
    fn __len__(&self) -> usize {
        self.queue.done.lock().len()
    }
}
