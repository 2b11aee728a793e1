//! The G1 prefix index: which pages hold which prefixes, and which
//! unreferenced pages may be reclaimed (least recently released first).
//!
//! A page is registered under its **parent**, the key of the block before
//! it (the chain's seed for the first), with the tokens it holds:
//!
//! * a **full** page also under its own block key, found by exact key
//!   ([`PrefixCache::get`]);
//! * a **partial** page (a finished sequence's last page, fewer tokens
//!   than a block) only under its parent.
//!
//! Below the last full page a prompt shares with the cache, any child of
//! that page's key (full or partial) whose tokens start like the prompt's
//! next ones serves those tokens ([`PrefixCache::best_child`]): the engine
//! copies their rows into a page of its own. That makes reuse token-granular
//! (a repeated prompt recomputes only its last token) while pages stay
//! block-sized for the store.

use std::collections::{BTreeMap, HashMap};

use kvtier_store::BlockKey;

use crate::kv::kv_pool::PageId;

#[derive(Debug, Clone)]
struct Entry {
    parent: BlockKey,
    /// The block key of a full page.
    key: Option<BlockKey>,
    /// The tokens whose KV the page holds, from its first row.
    tokens: Vec<u32>,
}

/// Maps block keys to full G1 pages and parents to every registered page;
/// tracks idle (unreferenced) registered pages.
#[derive(Debug, Default)]
pub struct PrefixCache {
    by_key: HashMap<BlockKey, PageId>,
    entries: HashMap<PageId, Entry>,
    children: HashMap<BlockKey, Vec<PageId>>,
    idle: BTreeMap<u64, PageId>,
    idle_since: HashMap<PageId, u64>,
    tick: u64,
}

impl PrefixCache {
    /// The full page holding `key`, if any.
    pub fn get(&self, key: &BlockKey) -> Option<PageId> {
        self.by_key.get(key).copied()
    }

    /// True when `page` is registered (full or partial).
    pub fn holds(&self, page: PageId) -> bool {
        self.entries.contains_key(&page)
    }

    /// Registers a full page holding `tokens` under `key`, below `parent`
    /// (no-op, false, when the key or the page is registered already).
    pub fn insert(
        &mut self,
        key: BlockKey,
        page: PageId,
        parent: BlockKey,
        tokens: &[u32],
    ) -> bool {
        if self.by_key.contains_key(&key) || self.entries.contains_key(&page) {
            return false;
        }
        self.by_key.insert(key, page);
        self.add(page, parent, Some(key), tokens);
        true
    }

    /// Registers a partial page holding `tokens` below `parent`; false (not
    /// registered) when the page is registered already or another child of
    /// `parent` holds these tokens and more (it serves them as well).
    pub fn insert_partial(&mut self, page: PageId, parent: BlockKey, tokens: &[u32]) -> bool {
        if tokens.is_empty() || self.entries.contains_key(&page) {
            return false;
        }
        let covered = self.children.get(&parent).is_some_and(|kids| {
            kids.iter()
                .filter_map(|p| self.entries.get(p))
                .any(|e| e.tokens.starts_with(tokens))
        });
        if covered {
            return false;
        }
        self.add(page, parent, None, tokens);
        true
    }

    fn add(&mut self, page: PageId, parent: BlockKey, key: Option<BlockKey>, tokens: &[u32]) {
        self.entries.insert(
            page,
            Entry {
                parent,
                key,
                tokens: tokens.to_vec(),
            },
        );
        self.children.entry(parent).or_default().push(page);
    }

    /// The child of `parent` that shares the longest run of leading tokens
    /// with `want`, and that run's length (at least 1).
    pub fn best_child(&self, parent: &BlockKey, want: &[u32]) -> Option<(PageId, usize)> {
        self.children
            .get(parent)?
            .iter()
            .filter_map(|&p| {
                let e = self.entries.get(&p)?;
                let n = e
                    .tokens
                    .iter()
                    .zip(want)
                    .take_while(|(a, b)| a == b)
                    .count();
                (n > 0).then_some((p, n))
            })
            .max_by_key(|&(_, n)| n)
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
        if let Some(e) = self.entries.remove(&page) {
            if let Some(key) = e.key {
                self.by_key.remove(&key);
            }
            if let Some(kids) = self.children.get_mut(&e.parent) {
                kids.retain(|&p| p != page);
                if kids.is_empty() {
                    self.children.remove(&e.parent);
                }
            }
        }
        Some(page)
    }

    /// Idle pages.
    pub fn idle_pages(&self) -> usize {
        self.idle.len()
    }

    /// Registered pages (full and partial).
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// True when nothing is registered.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn k(i: u8) -> BlockKey {
        BlockKey([i; 16])
    }

    #[test]
    fn reclaims_least_recently_idle_and_unregisters() {
        let mut c = PrefixCache::default();
        assert!(c.insert(k(1), 10, k(0), &[1, 2]));
        assert!(c.insert(k(2), 11, k(1), &[3, 4]));
        assert!(!c.insert(k(1), 12, k(0), &[1, 2]), "a key maps to one page");
        c.mark_idle(11);
        c.mark_idle(10);
        c.mark_busy(11);
        assert_eq!(c.reclaim(), Some(10));
        assert_eq!(c.get(&k(1)), None);
        assert_eq!(
            c.best_child(&k(0), &[1, 2]),
            None,
            "gone from its parent too"
        );
        assert_eq!(c.get(&k(2)), Some(11));
        assert_eq!(c.reclaim(), None, "busy pages are never reclaimed");
    }

    #[test]
    fn the_longest_shared_run_of_any_child_wins() {
        let mut c = PrefixCache::default();
        assert!(c.insert(k(1), 1, k(0), &[5, 6, 7, 8]));
        assert!(c.insert_partial(2, k(0), &[5, 9]));
        assert!(
            !c.insert_partial(3, k(0), &[5, 6]),
            "covered by the full page"
        );
        assert!(c.insert_partial(4, k(0), &[7]));
        assert_eq!(c.best_child(&k(0), &[5, 6, 7, 1]), Some((1, 3)));
        assert_eq!(c.best_child(&k(0), &[5, 9, 9]), Some((2, 2)));
        assert_eq!(c.best_child(&k(0), &[7, 7]), Some((4, 1)));
        assert_eq!(c.best_child(&k(0), &[8]), None);
        assert_eq!(c.best_child(&k(1), &[5]), None, "another parent");
        assert_eq!(c.get(&k(9)), None);
        assert!(c.holds(2) && c.holds(1) && !c.holds(3));
        assert_eq!(c.len(), 3);
    }
}
