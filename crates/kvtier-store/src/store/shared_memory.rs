//! One G2 budget shared by several stores: the namespaces of one process
//! (a store per model, layout or tensor-parallel rank), each with its own
//! G3 and G4, so a busy model can use the memory an idle one does not.
//!
//! The stores insert into one [`MemoryTier`] under one eviction policy;
//! each block carries its store's [`Owner`] id, and a block evicted by
//! another store's insert is handed to its own store's write-back (its own
//! G3 layout and slots). A store that closes takes its blocks out of the
//! shared tier after writing them back.

use std::collections::HashMap;
use std::sync::{Arc, Weak};

use parking_lot::Mutex;

use super::{Inner, TieredStore};
use crate::eviction::EvictionKind;
use crate::memory::{Evicted, MemoryTier, Owner};
use crate::metrics::TierMetrics;

/// A G2 budget for several [`TieredStore`]s
/// ([`StoreConfig::shared_memory`](super::StoreConfig::shared_memory)).
/// Cheap to clone (shared handle).
#[derive(Clone)]
pub struct SharedMemory {
    shared: Arc<Shared>,
}

struct Shared {
    memory: Arc<MemoryTier>,
    metrics: TierMetrics,
    owners: Mutex<Owners>,
}

#[derive(Default)]
struct Owners {
    next: Owner,
    stores: HashMap<Owner, Weak<Inner>>,
}

impl std::fmt::Debug for SharedMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedMemory")
            .field("used_bytes", &self.shared.memory.used_bytes())
            .field("stores", &self.shared.owners.lock().stores.len())
            .finish()
    }
}

impl SharedMemory {
    /// A budget of `capacity_bytes` of block buffers under kvtier's
    /// eviction policy.
    pub fn new(capacity_bytes: u64) -> Self {
        Self::with_eviction(capacity_bytes, EvictionKind::default())
    }

    /// A budget of `capacity_bytes` under the `eviction` policy.
    pub fn with_eviction(capacity_bytes: u64, eviction: EvictionKind) -> Self {
        let metrics = TierMetrics::default();
        Self {
            shared: Arc::new(Shared {
                memory: Arc::new(MemoryTier::new(capacity_bytes, eviction, metrics.clone())),
                metrics,
                owners: Mutex::new(Owners {
                    // 0 is the owner of stores that share nothing.
                    next: 1,
                    stores: HashMap::new(),
                }),
            }),
        }
    }

    /// The shared tier (its `len` and `used_bytes` count every store's
    /// blocks).
    pub fn memory(&self) -> &MemoryTier {
        &self.shared.memory
    }

    pub(super) fn tier(&self) -> Arc<MemoryTier> {
        self.shared.memory.clone()
    }

    pub(super) fn metrics(&self) -> TierMetrics {
        self.shared.metrics.clone()
    }

    /// A new owner id, for a store about to open.
    pub(super) fn next_owner(&self) -> Owner {
        let mut o = self.shared.owners.lock();
        let id = o.next;
        o.next = o.next.wrapping_add(1).max(1);
        id
    }

    pub(super) fn register(&self, owner: Owner, store: &Arc<Inner>) {
        self.shared
            .owners
            .lock()
            .stores
            .insert(owner, Arc::downgrade(store));
    }

    pub(super) fn unregister(&self, owner: Owner) {
        self.shared.owners.lock().stores.remove(&owner);
    }

    /// Hands `evicted` blocks of other stores to their stores' write-back
    /// (a closed store's blocks were written back when it closed: dropped).
    pub(super) fn demote_others(&self, evicted: Vec<Evicted>, drop_over: bool) {
        let mut by_owner: HashMap<Owner, Vec<Evicted>> = HashMap::new();
        for e in evicted {
            by_owner.entry(e.owner).or_default().push(e);
        }
        for (owner, blocks) in by_owner {
            let store = self.shared.owners.lock().stores.get(&owner).cloned();
            if let Some(inner) = store.and_then(|w| w.upgrade()) {
                TieredStore { inner }.demote(blocks, drop_over);
            }
        }
    }
}
