//! G1 as kvtier-engine keeps it: the keys that name blocks, the page pool
//! (`KvPool`) and the prefix index (`PrefixCache`).

use std::collections::{BTreeMap, BTreeSet, HashMap};

/// Names a block (a key of the store): its parent's key and its tokens,
/// full or a prompt's partial tail. Numbered as first seen; the seed (the
/// first block's parent) is 0.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) struct Key(u64);

/// The parent of a chain's first block.
pub(super) const SEED: Key = Key(0);

/// The keys handed out so far: equal (parent, kind, tokens), equal key, as
/// the store's key chain gives (without its hashing, so without its
/// collisions either).
#[derive(Debug, Default)]
pub(super) struct KeyNames {
    pub(super) names: HashMap<(Key, bool, Vec<u32>), Key>,
}

impl KeyNames {
    /// The key of `tokens` after `parent`, if it was ever named.
    pub(super) fn get(&self, parent: Key, partial: bool, tokens: &[u32]) -> Option<Key> {
        self.names.get(&(parent, partial, tokens.to_vec())).copied()
    }

    /// The key of `tokens` after `parent`; `partial` for a prompt's tail.
    pub(super) fn name(&mut self, parent: Key, partial: bool, tokens: &[u32]) -> Key {
        let next = Key(self.names.len() as u64 + 1);
        *self
            .names
            .entry((parent, partial, tokens.to_vec()))
            .or_insert(next)
    }
}

/// A G1 page.
pub(super) type Page = u32;

/// G1's pages as kvtier-engine's `KvPool` keeps them: reference counts and
/// the free set, lowest page first.
#[derive(Debug)]
pub(super) struct Pool {
    pub(super) free: BTreeSet<Page>,
    pub(super) refs: Vec<u32>,
}

impl Pool {
    pub(super) fn new(pages: Page) -> Self {
        Self {
            free: (0..pages).collect(),
            refs: vec![0; pages as usize],
        }
    }

    /// The page after `after` when free, else the lowest free one.
    pub(super) fn alloc(&mut self, after: Option<Page>) -> Option<Page> {
        let next = after.and_then(|p| p.checked_add(1));
        let p = match next {
            Some(n) if self.free.remove(&n) => n,
            _ => self.free.pop_first()?,
        };
        self.set_refs(p, 1);
        Some(p)
    }

    pub(super) fn refs(&self, page: Page) -> u32 {
        self.refs.get(page as usize).copied().unwrap_or(0)
    }

    pub(super) fn set_refs(&mut self, page: Page, n: u32) {
        if let Some(r) = self.refs.get_mut(page as usize) {
            *r = n;
        }
    }

    pub(super) fn retain(&mut self, page: Page) {
        self.set_refs(page, self.refs(page) + 1);
    }

    /// Drops a reference; true when none is left.
    pub(super) fn release(&mut self, page: Page) -> bool {
        let r = self.refs(page).saturating_sub(1);
        self.set_refs(page, r);
        r == 0
    }

    pub(super) fn free(&mut self, page: Page) {
        if self.refs(page) == 0 {
            self.free.insert(page);
        }
    }
}

/// A registered G1 page.
#[derive(Debug, Clone)]
pub(super) struct G1Entry {
    pub(super) parent: Key,
    pub(super) key: Option<Key>,
    pub(super) tokens: Vec<u32>,
}

/// G1's prefix index as kvtier-engine's `PrefixCache` keeps it: full pages
/// by key, every page below its parent (in registration order: ties of
/// the best child go to the last registered), idle pages in the order
/// they became idle.
#[derive(Debug, Default)]
pub(super) struct PrefixIndex {
    pub(super) by_key: HashMap<Key, Page>,
    pub(super) entries: HashMap<Page, G1Entry>,
    pub(super) children: HashMap<Key, Vec<Page>>,
    pub(super) idle: BTreeMap<u64, Page>,
    pub(super) idle_since: HashMap<Page, u64>,
    pub(super) tick: u64,
}

impl PrefixIndex {
    pub(super) fn get(&self, key: &Key) -> Option<Page> {
        self.by_key.get(key).copied()
    }

    pub(super) fn holds(&self, page: Page) -> bool {
        self.entries.contains_key(&page)
    }

    pub(super) fn insert(&mut self, key: Key, page: Page, parent: Key, tokens: &[u32]) -> bool {
        if self.by_key.contains_key(&key) || self.entries.contains_key(&page) {
            return false;
        }
        self.by_key.insert(key, page);
        self.add(page, parent, Some(key), tokens);
        true
    }

    pub(super) fn insert_partial(&mut self, page: Page, parent: Key, tokens: &[u32]) {
        if tokens.is_empty() || self.entries.contains_key(&page) {
            return;
        }
        let covered = self.children.get(&parent).is_some_and(|kids| {
            kids.iter()
                .filter_map(|p| self.entries.get(p))
                .any(|e| e.tokens.starts_with(tokens))
        });
        if !covered {
            self.add(page, parent, None, tokens);
        }
    }

    pub(super) fn add(&mut self, page: Page, parent: Key, key: Option<Key>, tokens: &[u32]) {
        self.entries.insert(
            page,
            G1Entry {
                parent,
                key,
                tokens: tokens.to_vec(),
            },
        );
        self.children.entry(parent).or_default().push(page);
    }

    /// The child of `parent` sharing the longest run of leading tokens with
    /// `want` (the last registered among equals), and that run's length.
    pub(super) fn best_child(&self, parent: &Key, want: &[u32]) -> Option<(Page, usize)> {
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

    pub(super) fn mark_busy(&mut self, page: Page) {
        if let Some(t) = self.idle_since.remove(&page) {
            self.idle.remove(&t);
        }
    }

    pub(super) fn mark_idle(&mut self, page: Page) {
        self.mark_busy(page);
        self.tick += 1;
        self.idle.insert(self.tick, page);
        self.idle_since.insert(page, self.tick);
    }

    /// Unregisters and returns the least recently idle page.
    pub(super) fn reclaim(&mut self) -> Option<Page> {
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
}
