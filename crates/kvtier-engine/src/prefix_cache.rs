//! The G1 prefix index: which full pages hold which block keys, and which
//! unreferenced pages may be reclaimed (least recently released first).

use std::collections::{BTreeMap, HashMap};

use kvtier_store::BlockKey;

use crate::kv_pool::PageId;

/// Maps block keys to full G1 pages; tracks idle (unreferenced) cached pages.
#[derive(Debug, Default)]
pub struct PrefixCache {
    by_key: HashMap<BlockKey, PageId>,
    key_of: HashMap<PageId, BlockKey>,
    idle: BTreeMap<u64, PageId>,
    idle_since: HashMap<PageId, u64>,
    tick: u64,
}

impl PrefixCache {
    /// The page holding `key`, if any.
    pub fn get(&self, key: &BlockKey) -> Option<PageId> {
        self.by_key.get(key).copied()
    }

    /// True when `page` is registered under a key.
    pub fn holds(&self, page: PageId) -> bool {
        self.key_of.contains_key(&page)
    }

    /// Registers a full page under `key` (no-op when the key is present).
    pub fn insert(&mut self, key: BlockKey, page: PageId) -> bool {
        if self.by_key.contains_key(&key) || self.key_of.contains_key(&page) {
            return false;
        }
        self.by_key.insert(key, page);
        self.key_of.insert(page, key);
        true
    }

    /// The page is referenced again: it is no longer reclaimable.
    pub fn mark_busy(&mut self, page: PageId) {
        if let Some(t) = self.idle_since.remove(&page) {
            self.idle.remove(&t);
        }
    }

    /// The page lost its last reference: it may be reclaimed.
    pub fn mark_idle(&mut self, page: PageId) {
        self.mark_busy(page);
        self.tick += 1;
        self.idle.insert(self.tick, page);
        self.idle_since.insert(page, self.tick);
    }

    /// Unregisters and returns the least recently idle page.
    pub fn reclaim(&mut self) -> Option<PageId> {
        let (&t, &page) = self.idle.iter().next()?;
        self.idle.remove(&t);
        self.idle_since.remove(&page);
        if let Some(key) = self.key_of.remove(&page) {
            self.by_key.remove(&key);
        }
        Some(page)
    }

    /// Idle pages.
    pub fn idle_pages(&self) -> usize {
        self.idle.len()
    }

    /// Registered pages.
    pub fn len(&self) -> usize {
        self.by_key.len()
    }

    /// True when nothing is registered.
    pub fn is_empty(&self) -> bool {
        self.by_key.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reclaims_least_recently_idle_and_unregisters() {
        let mut c = PrefixCache::default();
        let k = |i: u8| BlockKey([i; 16]);
        assert!(c.insert(k(1), 10));
        assert!(c.insert(k(2), 11));
        assert!(!c.insert(k(1), 12), "a key maps to one page");
        c.mark_idle(11);
        c.mark_idle(10);
        c.mark_busy(11);
        assert_eq!(c.reclaim(), Some(10));
        assert_eq!(c.get(&k(1)), None);
        assert_eq!(c.get(&k(2)), Some(11));
        assert_eq!(c.reclaim(), None, "busy pages are never reclaimed");
    }
}
