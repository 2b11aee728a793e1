//! Blocks evicted from G2 and queued for the G3 writer: still readable
//! (they are G2 hits until written) and bounded in bytes. A caller that may
//! wait ([`TieredStore::put_many`](super::TieredStore::put_many)) waits for
//! room; one that may not ([`TieredStore::offer`](super::TieredStore::offer))
//! has the blocks over the bound dropped and counted.

use std::collections::HashMap;
use std::sync::Arc;

use kvtier_io::AlignedBuf;
use parking_lot::{Condvar, Mutex};

use crate::key::BlockKey;
use crate::metrics::StoreMetrics;

#[derive(Debug, Default)]
struct PendingSet {
    blocks: HashMap<BlockKey, Arc<AlignedBuf>>,
    bytes: u64,
}

/// The write-back queue's contents.
#[derive(Debug)]
pub(super) struct Pending {
    set: Mutex<PendingSet>,
    drained: Condvar,
    max_bytes: u64,
}

impl Pending {
    /// An empty set holding at most about `max_bytes`.
    pub(super) fn new(max_bytes: u64) -> Self {
        Self {
            set: Mutex::new(PendingSet::default()),
            drained: Condvar::new(),
            max_bytes: max_bytes.max(1),
        }
    }

    /// Blocks queued.
    pub(super) fn len(&self) -> usize {
        self.set.lock().blocks.len()
    }

    /// The queued block of each key, if any, under one lock.
    pub(super) fn get_many(&self, keys: &[BlockKey]) -> Vec<Option<Arc<AlignedBuf>>> {
        let set = self.set.lock();
        keys.iter().map(|k| set.blocks.get(k).cloned()).collect()
    }

    /// Waits while the queue is over its bound.
    pub(super) fn wait_for_room(&self) {
        let mut set = self.set.lock();
        while set.bytes > self.max_bytes {
            self.drained.wait(&mut set);
        }
    }

    /// Adds `batch`; with `drop_over`, the blocks that would take the queue
    /// past its bound are left out (counted) and the rest returned. Returns
    /// what was added.
    pub(super) fn add(
        &self,
        batch: Vec<(BlockKey, Arc<AlignedBuf>)>,
        drop_over: bool,
        metrics: &StoreMetrics,
    ) -> Vec<(BlockKey, Arc<AlignedBuf>)> {
        let mut set = self.set.lock();
        let mut added = Vec::with_capacity(batch.len());
        for (k, b) in batch {
            if drop_over && set.bytes + b.len() as u64 > self.max_bytes {
                metrics.writeback_dropped.inc();
                continue;
            }
            if let Some(old) = set.blocks.insert(k, b.clone()) {
                set.bytes -= old.len() as u64;
            }
            set.bytes += b.len() as u64;
            added.push((k, b));
        }
        metrics.writeback_pending.set(set.blocks.len() as i64);
        added
    }

    /// `key`'s write of `buf` finished (or failed): it leaves the queue
    /// unless a newer buffer was queued under the key meanwhile. Wakes
    /// waiters once a whole batch is done ([`Pending::drained`]).
    pub(super) fn done(&self, written: &[(BlockKey, Arc<AlignedBuf>)], metrics: &StoreMetrics) {
        let mut set = self.set.lock();
        for (key, buf) in written {
            if set.blocks.get(key).is_some_and(|b| Arc::ptr_eq(b, buf)) {
                set.blocks.remove(key);
                set.bytes -= buf.len() as u64;
            }
        }
        metrics.writeback_pending.set(set.blocks.len() as i64);
        drop(set);
        self.drained.notify_all();
    }
}
