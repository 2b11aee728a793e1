//! A model of what `kvtier serve` itself caches, token by token, exact for
//! a client that sends one request at a time: [`ServerSim`] says, for each
//! request, how many prompt tokens the server serves from G1, G2 and G3
//! (its usage's `kvtier.cached_tokens`), from the server's own shape
//! ([`ServerShape`], read from its `/metrics`).
//!
//! [`crate::sim`] asks what a policy does with a trace's blocks at one
//! capacity; this asks what one server does with the very token ids it is
//! sent, so it follows the server's code, not a simplification of it:
//!
//! * **G1** (kvtier-engine's `engine.rs`, `prefix_cache.rs`,
//!   `prefix_restore.rs`, `kv_pool.rs`, and the scheduler's calls at
//!   concurrency 1): pages taken lowest-first (the page after a sequence's
//!   last when free), idle pages reclaimed least recently released first;
//!   a prompt's full blocks found by key, then the store asked for the rest
//!   and for its tail (layer-wise restores take their pages before the
//!   store is read), then a G1 page below the last block found copied token
//!   by token ("best child"); the last prompt token always computed; pages
//!   registered as they fill (the prompt's, then the generated tokens'),
//!   the prompt's tail offered under its partial key, a finished sequence's
//!   part-filled last page kept below its last full block.
//! * **The store** (kvtier-store's `store/mod.rs`, `tier_reads.rs`,
//!   `memory.rs`, `disk/slots.rs`, `write_back.rs`): what each scheduler
//!   step registered is offered as one batch (each block's parent the one
//!   before it in the batch); G2 counts every block, a tail's short block
//!   too, as one slot's buffer ([`ServerShape::block_bytes`]) under the
//!   store's own eviction policy ([`EvictionKind::build`]); a lookup touches
//!   every G2 hit, reads G3 up to the first block no tier holds and
//!   promotes G3 hits into G2; blocks G2 evicts that G3 lacks are written
//!   to G3's slots (weight 1 each, the same policy, no parents), 64 to a
//!   batch; the admission filter and the write-back queue's bound as the
//!   store applies them.
//! * **A clean restart** ([`ServerSim::restart`]): G1 and G2 start empty;
//!   the blocks only G2 held are written to G3 (oldest first); G3 comes
//!   back from its saved index, its policy refilled in slot order.
//!
//! # When it is exact
//!
//! One request at a time, each sent after the last one's answer, and:
//!
//! * `--g3-sync-ms 0`: the bounded write-back copies G2's blocks to G3 on a
//!   timer, so G3's contents would depend on when requests come;
//!   [`ServerSim::new`] refuses a shape with it on.
//! * The store's G3 writer is idle when the next request is looked up. It
//!   writes G2's evictions in the background: a lookup that comes first
//!   finds a block still queued (a G2 hit, not promoted) where it would
//!   otherwise find it in G3 (a G3 hit, promoted into G2). A client makes
//!   sure by waiting, after each answer, until `/metrics` shows
//!   `kvtier_server_sequences` at 0 in every state (the scheduler
//!   publishes them just after its last offer to the store; this holds
//!   for requests of two tokens or more, which published themselves
//!   running before their last step) and
//!   `kvtier_store_writeback_pending_blocks` at 0.
//! * G3 does not evict while requests run (it may when a restart writes
//!   G2's blocks to it: [`SimStats::g3_evicted_at_restart`]). What G3
//!   evicts for the blocks G2 evicts depends on the writer thread's
//!   timing: the writer merges the jobs queued while it was busy into one
//!   batch, whose blocks all take their slots before any enters G3's
//!   policy (kvtier's policy then adapts, CLOCK's hand sweeps, otherwise
//!   than for separate batches), and an offer reads G3's index (is the
//!   block in G3, so that G2 need not write it back later?) while a queued
//!   write may still evict that block. The simulator writes each job as
//!   its own batch, at once: it agrees with a server whose writer kept up.
//! * No G4 (shared with other servers), one tenant, and no stop strings
//!   (a stop string ends a sequence when the scheduler next notices).

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

use kvtier_store::admission::SecondSighting;
use kvtier_store::eviction::{Eviction, EvictionKind};

/// The series `kvtier serve` renders on `/metrics` with its cache's shape
/// in its labels.
pub const KV_CACHE_INFO: &str = "kvtier_server_kv_cache_info";

/// Blocks the store's G3 writer hands the disk at once (its
/// `WRITE_BATCH`): the blocks of one batch cannot evict each other.
const WRITE_BATCH: usize = 64;

/// What a `kvtier serve` instance's cache is: everything [`ServerSim`]
/// needs. [`from_metrics`](Self::from_metrics) reads it from the server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerShape {
    /// Tokens per G1 page and per store block.
    pub block_tokens: usize,
    /// G1 pages.
    pub g1_pages: usize,
    /// G2's capacity in bytes.
    pub g2_bytes: u64,
    /// G3's usable capacity in bytes.
    pub g3_bytes: u64,
    /// Bytes a stored block takes in G2, whatever its rows: the store keeps
    /// each block, a prompt tail's short one too, in a buffer of one G3
    /// slot.
    pub block_bytes: u64,
    /// G3's slots, one block each (0: no G3).
    pub g3_slots: u64,
    /// Bytes of one G3 slot.
    pub g3_slot_bytes: u64,
    /// G2's and G3's eviction policy.
    pub eviction: EvictionKind,
    /// The G3 admission filter's window (`None`: off).
    pub admission_window: Option<usize>,
    /// Cached KV is reused at all.
    pub prefix_reuse: bool,
    /// Prefixes are restored layer by layer (their G1 pages are taken
    /// before the store is read, so G1 reclaims earlier).
    pub layerwise_restore: bool,
    /// A store (G2, G3) sits below G1.
    pub store: bool,
    /// How often G2's blocks are copied to G3, in ms (0: never on a timer).
    pub g3_sync_ms: u64,
    /// Bytes the write-back queue takes before it drops blocks.
    pub writeback_max_bytes: u64,
    /// A G4 pool is attached.
    pub g4: bool,
}

impl ServerShape {
    /// The shape a server states in the labels of its
    /// [`KV_CACHE_INFO`] series, from the Prometheus (or OpenMetrics) text
    /// of its `GET /metrics`.
    pub fn from_metrics(text: &str) -> Result<Self, String> {
        let labels = info_labels(text)?;
        let get = |name: &str| {
            labels
                .get(name)
                .map(String::as_str)
                .ok_or_else(|| format!("{KV_CACHE_INFO} has no `{name}` label"))
        };
        let num = |name: &str| -> Result<u64, String> {
            let v = get(name)?;
            v.parse()
                .map_err(|_| format!("{KV_CACHE_INFO}: `{name}` is {v:?}, not a count"))
        };
        let size = |name: &str| -> Result<usize, String> {
            usize::try_from(num(name)?)
                .map_err(|_| format!("{KV_CACHE_INFO}: `{name}` does not fit this machine"))
        };
        let flag = |name: &str| match get(name)? {
            "true" => Ok(true),
            "false" => Ok(false),
            v => Err(format!(
                "{KV_CACHE_INFO}: `{name}` is {v:?}, not true or false"
            )),
        };
        Ok(Self {
            block_tokens: size("block_tokens")?,
            g1_pages: size("g1_pages")?,
            g2_bytes: num("g2_bytes")?,
            g3_bytes: num("g3_bytes")?,
            block_bytes: num("block_bytes")?,
            g3_slots: num("g3_slots")?,
            g3_slot_bytes: num("g3_slot_bytes")?,
            eviction: get("eviction")?
                .parse()
                .map_err(|e| format!("{KV_CACHE_INFO}: {e}"))?,
            admission_window: match get("admission")? {
                "off" => None,
                "second-sighting" => Some(size("admission_window")?),
                v => {
                    return Err(format!(
                        "{KV_CACHE_INFO}: admission {v:?} is not one this simulator knows"
                    ));
                }
            },
            prefix_reuse: flag("prefix_reuse")?,
            layerwise_restore: flag("layerwise_restore")?,
            store: flag("store")?,
            g3_sync_ms: num("g3_sync_ms")?,
            writeback_max_bytes: num("writeback_max_bytes")?,
            g4: get("g4")? != "none",
        })
    }
}

/// The labels of the one [`KV_CACHE_INFO`] series in `text`.
fn info_labels(text: &str) -> Result<HashMap<String, String>, String> {
    let mut found = None;
    for line in text.lines() {
        let Some(rest) = line.strip_prefix(KV_CACHE_INFO) else {
            continue;
        };
        let Some(rest) = rest.strip_prefix('{') else {
            continue;
        };
        if found.is_some() {
            return Err(format!("{KV_CACHE_INFO} appears more than once"));
        }
        found = Some(parse_labels(rest)?);
    }
    found.ok_or_else(|| {
        format!("no {KV_CACHE_INFO} series: the server predates it, or this is not its /metrics")
    })
}

/// `name="value",...}` (the text after a series' `{`) as a map, with the
/// exposition format's escapes (`\\`, `\"`, `\n`) undone.
fn parse_labels(s: &str) -> Result<HashMap<String, String>, String> {
    let bad = || format!("{KV_CACHE_INFO}: malformed labels in {s:?}");
    let mut out = HashMap::new();
    let mut chars = s.chars();
    loop {
        let mut name = String::new();
        loop {
            match chars.next().ok_or_else(bad)? {
                '=' => break,
                '}' if name.is_empty() => return Ok(out),
                ',' if name.is_empty() => {}
                c if c.is_ascii_alphanumeric() || c == '_' => name.push(c),
                _ => return Err(bad()),
            }
        }
        if chars.next() != Some('"') {
            return Err(bad());
        }
        let mut value = String::new();
        loop {
            match chars.next().ok_or_else(bad)? {
                '"' => break,
                '\\' => match chars.next().ok_or_else(bad)? {
                    'n' => value.push('\n'),
                    c => value.push(c),
                },
                c => value.push(c),
            }
        }
        out.insert(name, value);
    }
}

/// Prompt tokens served from cache, by tier (the server's usage
/// `kvtier.cached_tokens`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct TierHits {
    /// From G1 pages.
    pub g1: usize,
    /// From G2 (host memory).
    pub g2: usize,
    /// From G3 (disk).
    pub g3: usize,
}

impl TierHits {
    /// All cached prompt tokens.
    pub fn total(&self) -> usize {
        self.g1 + self.g2 + self.g3
    }
}

/// Where the store holds one block ([`ServerSim::store_places`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BlockPlace {
    /// G2 holds it.
    pub g2: bool,
    /// G3 holds it.
    pub g3: bool,
}

/// How a request's generation ended, which decides how many generated
/// tokens the server computed (and cached) for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ending {
    /// It reached `max_tokens` (`finish_reason` "length"): the last token
    /// was sent, never computed.
    Length,
    /// The model produced a stop token (`finish_reason` "stop"), which is
    /// not in the output: every output token was computed.
    StopToken,
}

/// Why the server would not answer a request.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    /// The prompt holds no token.
    #[error("the prompt is empty")]
    EmptyPrompt,
    /// G1 ran out of pages for the sequence (all held by it): the server
    /// answers with an error; what it found cached is in `hits`.
    #[error("G1 has no page left for the sequence")]
    PoolExhausted {
        /// What its prefix restore found.
        hits: TierHits,
    },
}

/// What the simulated server did so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SimStats {
    /// Requests simulated.
    pub requests: u64,
    /// Requests the server would have failed.
    pub failed: u64,
    /// Cached G1 pages reclaimed for other use.
    pub g1_reclaimed: u64,
    /// G1 pages cached now (idle, reclaimable: the scheduler's
    /// `g1_cached`).
    pub g1_cached_pages: usize,
    /// Blocks in G2 now.
    pub g2_blocks: usize,
    /// Blocks G2 evicted to make room (the store's `evictions` of G2).
    pub g2_evicted: u64,
    /// Blocks in G3 now.
    pub g3_blocks: usize,
    /// Blocks written to G3.
    pub g3_written: u64,
    /// Blocks G3 evicted to free a slot.
    pub g3_evicted: u64,
    /// Of those, the ones evicted while a restart wrote G2's blocks to G3
    /// (the rest were evicted while requests ran, where a server whose G3
    /// writer falls behind may evict others: see the module docs).
    pub g3_evicted_at_restart: u64,
    /// Blocks the write-back queue dropped (over its bound).
    pub writeback_dropped: u64,
    /// Blocks the admission filter kept out of G3.
    pub admission_rejected: u64,
}

/// Names a block (a key of the store): its parent's key and its tokens,
/// full or a prompt's partial tail. Numbered as first seen; the seed (the
/// first block's parent) is 0.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct Key(u64);

/// The parent of a chain's first block.
const SEED: Key = Key(0);

/// The keys handed out so far: equal (parent, kind, tokens), equal key, as
/// the store's key chain gives (without its hashing, so without its
/// collisions either).
#[derive(Debug, Default)]
struct KeyNames {
    names: HashMap<(Key, bool, Vec<u32>), Key>,
}

impl KeyNames {
    /// The key of `tokens` after `parent`, if it was ever named.
    fn get(&self, parent: Key, partial: bool, tokens: &[u32]) -> Option<Key> {
        self.names.get(&(parent, partial, tokens.to_vec())).copied()
    }

    /// The key of `tokens` after `parent`; `partial` for a prompt's tail.
    fn name(&mut self, parent: Key, partial: bool, tokens: &[u32]) -> Key {
        let next = Key(self.names.len() as u64 + 1);
        *self
            .names
            .entry((parent, partial, tokens.to_vec()))
            .or_insert(next)
    }
}

/// A G1 page.
type Page = u32;

/// G1's pages as kvtier-engine's `KvPool` keeps them: reference counts and
/// the free set, lowest page first.
#[derive(Debug)]
struct Pool {
    free: BTreeSet<Page>,
    refs: Vec<u32>,
}

impl Pool {
    fn new(pages: Page) -> Self {
        Self {
            free: (0..pages).collect(),
            refs: vec![0; pages as usize],
        }
    }

    /// The page after `after` when free, else the lowest free one.
    fn alloc(&mut self, after: Option<Page>) -> Option<Page> {
        let next = after.and_then(|p| p.checked_add(1));
        let p = match next {
            Some(n) if self.free.remove(&n) => n,
            _ => self.free.pop_first()?,
        };
        self.set_refs(p, 1);
        Some(p)
    }

    fn refs(&self, page: Page) -> u32 {
        self.refs.get(page as usize).copied().unwrap_or(0)
    }

    fn set_refs(&mut self, page: Page, n: u32) {
        if let Some(r) = self.refs.get_mut(page as usize) {
            *r = n;
        }
    }

    fn retain(&mut self, page: Page) {
        self.set_refs(page, self.refs(page) + 1);
    }

    /// Drops a reference; true when none is left.
    fn release(&mut self, page: Page) -> bool {
        let r = self.refs(page).saturating_sub(1);
        self.set_refs(page, r);
        r == 0
    }

    fn free(&mut self, page: Page) {
        if self.refs(page) == 0 {
            self.free.insert(page);
        }
    }
}

/// A registered G1 page.
#[derive(Debug, Clone)]
struct G1Entry {
    parent: Key,
    key: Option<Key>,
    tokens: Vec<u32>,
}

/// G1's prefix index as kvtier-engine's `PrefixCache` keeps it: full pages
/// by key, every page below its parent (in registration order: ties of
/// the best child go to the last registered), idle pages in the order
/// they became idle.
#[derive(Debug, Default)]
struct PrefixIndex {
    by_key: HashMap<Key, Page>,
    entries: HashMap<Page, G1Entry>,
    children: HashMap<Key, Vec<Page>>,
    idle: BTreeMap<u64, Page>,
    idle_since: HashMap<Page, u64>,
    tick: u64,
}

impl PrefixIndex {
    fn get(&self, key: &Key) -> Option<Page> {
        self.by_key.get(key).copied()
    }

    fn holds(&self, page: Page) -> bool {
        self.entries.contains_key(&page)
    }

    fn insert(&mut self, key: Key, page: Page, parent: Key, tokens: &[u32]) -> bool {
        if self.by_key.contains_key(&key) || self.entries.contains_key(&page) {
            return false;
        }
        self.by_key.insert(key, page);
        self.add(page, parent, Some(key), tokens);
        true
    }

    fn insert_partial(&mut self, page: Page, parent: Key, tokens: &[u32]) {
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

    fn add(&mut self, page: Page, parent: Key, key: Option<Key>, tokens: &[u32]) {
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
    fn best_child(&self, parent: &Key, want: &[u32]) -> Option<(Page, usize)> {
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

    fn mark_busy(&mut self, page: Page) {
        if let Some(t) = self.idle_since.remove(&page) {
            self.idle.remove(&t);
        }
    }

    fn mark_idle(&mut self, page: Page) {
        self.mark_busy(page);
        self.tick += 1;
        self.idle.insert(self.tick, page);
        self.idle_since.insert(page, self.tick);
    }

    /// Unregisters and returns the least recently idle page.
    fn reclaim(&mut self) -> Option<Page> {
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

/// A block in G2.
#[derive(Debug, Clone, Copy)]
struct G2Entry {
    /// G3 holds it (it came from there, or was written there).
    persisted: bool,
    /// Its insert's number: a clean stop writes G2's blocks oldest first.
    stamp: u64,
}

/// Where a restored block came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Tier {
    G2,
    G3,
}

/// G3's slots as kvtier-store's `SlotTable` keeps them.
#[derive(Debug)]
struct G3 {
    index: HashMap<Key, u32>,
    held: Vec<Option<Key>>,
    /// Free slots, the next one last.
    free: Vec<u32>,
    policy: Box<dyn Eviction<Key>>,
    eviction: EvictionKind,
}

impl G3 {
    /// A tier of `slots` free slots, as a fresh directory opens (lowest
    /// slot first).
    fn new(slots: u32, eviction: EvictionKind) -> Self {
        Self {
            index: HashMap::new(),
            held: vec![None; slots as usize],
            free: (0..slots).rev().collect(),
            policy: eviction.build(u64::from(slots)),
            eviction,
        }
    }

    /// The tier opened again from its saved index: its blocks as they
    /// were, its policy refilled in slot order (no history), its free
    /// slots lowest first.
    fn reopen(&mut self) {
        self.policy = self.eviction.build(self.held.len() as u64);
        self.free.clear();
        for (slot, key) in self.held.iter().enumerate() {
            match key {
                Some(k) => {
                    self.policy.insert(*k, 1, None);
                }
                None => self.free.push(slot as u32),
            }
        }
        self.free.reverse();
    }

    /// A free slot, or one the policy gives up.
    fn alloc(&mut self, stats: &mut SimStats) -> Option<u32> {
        if let Some(s) = self.free.pop() {
            return Some(s);
        }
        let index = &self.index;
        let key = self.policy.evict_where(&mut |k| index.contains_key(k))?;
        let slot = self.index.remove(&key)?;
        if let Some(h) = self.held.get_mut(slot as usize) {
            *h = None;
        }
        stats.g3_evicted += 1;
        Some(slot)
    }

    /// One batch of writes (`DiskTier::put_many`): every slot reserved
    /// first, then every block indexed. Returns the blocks G3 holds after
    /// it (written now or before).
    fn put_many(&mut self, blocks: &[Key], stats: &mut SimStats) -> Vec<Key> {
        let mut held = Vec::with_capacity(blocks.len());
        let mut writing = HashSet::new();
        let mut planned = Vec::with_capacity(blocks.len());
        for &k in blocks {
            if self.index.contains_key(&k) || writing.contains(&k) {
                held.push(k);
                continue;
            }
            // No slot: every one is being written by this batch; the block
            // is lost, as the store's is.
            if let Some(slot) = self.alloc(stats) {
                writing.insert(k);
                planned.push((k, slot));
            }
        }
        for (k, slot) in planned {
            self.index.insert(k, slot);
            if let Some(h) = self.held.get_mut(slot as usize) {
                *h = Some(k);
            }
            self.policy.insert(k, 1, None);
            stats.g3_written += 1;
            held.push(k);
        }
        held
    }
}

/// The store below G1: G2, G3, the admission filter, the write-back.
#[derive(Debug)]
struct Store {
    g2: HashMap<Key, G2Entry>,
    g2_policy: Box<dyn Eviction<Key>>,
    g2_bytes: u64,
    stamp: u64,
    eviction: EvictionKind,
    block_bytes: u64,
    g3: Option<G3>,
    admission: Option<SecondSighting<Key>>,
    admission_window: Option<usize>,
    writeback_max_bytes: u64,
}

impl Store {
    fn new(shape: &ServerShape) -> Result<Self, String> {
        let slots = u32::try_from(shape.g3_slots)
            .map_err(|_| format!("{} G3 slots are more than a store has", shape.g3_slots))?;
        Ok(Self {
            g2: HashMap::new(),
            g2_policy: shape.eviction.build(shape.g2_bytes),
            g2_bytes: shape.g2_bytes,
            stamp: 0,
            eviction: shape.eviction,
            block_bytes: shape.block_bytes,
            g3: (slots > 0).then(|| G3::new(slots, shape.eviction)),
            admission: shape.admission_window.map(SecondSighting::new),
            admission_window: shape.admission_window,
            writeback_max_bytes: shape.writeback_max_bytes.max(1),
        })
    }

    fn in_g3(&self, key: &Key) -> bool {
        self.g3.as_ref().is_some_and(|g| g.index.contains_key(key))
    }

    fn record(&mut self, key: &Key) {
        if let Some(a) = &mut self.admission {
            a.record(key);
        }
    }

    /// `MemoryTier::insert`: the blocks it evicted (the key itself when it
    /// cannot be admitted), each with whether G3 holds it.
    fn g2_insert(
        &mut self,
        key: Key,
        persisted: bool,
        parent: Option<Key>,
        stats: &mut SimStats,
    ) -> Vec<(Key, bool)> {
        let persisted = persisted || self.g2.get(&key).is_some_and(|e| e.persisted);
        self.stamp += 1;
        self.g2.insert(
            key,
            G2Entry {
                persisted,
                stamp: self.stamp,
            },
        );
        let evicted = self
            .g2_policy
            .insert(key, self.block_bytes, parent.as_ref());
        let mut out = Vec::with_capacity(evicted.len());
        for k in evicted {
            if let Some(e) = self.g2.remove(&k) {
                if k != key {
                    stats.g2_evicted += 1;
                }
                out.push((k, e.persisted));
            }
        }
        out
    }

    /// `TieredStore::offer` of one scheduler step's blocks.
    fn offer(&mut self, blocks: &[Key], stats: &mut SimStats) {
        for k in blocks {
            self.record(k);
        }
        let mut kept = Vec::with_capacity(blocks.len());
        for (i, &k) in blocks.iter().enumerate() {
            // Each block's parent is the one before it in the batch,
            // whether or not that one is stored again.
            let parent = i.checked_sub(1).and_then(|p| blocks.get(p).copied());
            if !self.g2.contains_key(&k) {
                kept.push((k, parent));
            }
        }
        let persisted: Vec<bool> = kept.iter().map(|(k, _)| self.in_g3(k)).collect();
        let mut evicted = Vec::new();
        for ((k, parent), p) in kept.into_iter().zip(persisted) {
            evicted.extend(self.g2_insert(k, p, parent, stats));
        }
        self.demote(evicted, true, stats);
    }

    /// One prefix read (`fetch_to`, leading run, no G4): the tier of each
    /// leading key found.
    fn fetch(&mut self, keys: &[Key], stats: &mut SimStats) -> Vec<Tier> {
        // G2 first: every hit is touched, past a gap too.
        let mut in_g2 = Vec::with_capacity(keys.len());
        for k in keys {
            let hit = self.g2.contains_key(k);
            if hit {
                self.g2_policy.touch(k);
            }
            in_g2.push(hit);
        }
        for (k, hit) in keys.iter().zip(&in_g2) {
            if *hit {
                self.record(k);
            }
        }
        // G3 up to the first block no tier holds.
        let mut from_g3 = Vec::new();
        for (i, k) in keys.iter().enumerate() {
            if in_g2[i] {
                continue;
            }
            if !self.in_g3(k) {
                break;
            }
            from_g3.push(i);
        }
        if let Some(g3) = &mut self.g3 {
            for &i in &from_g3 {
                g3.policy.touch(&keys[i]);
            }
        }
        // G3 hits into G2, each under the key before it in the read.
        let mut evicted = Vec::new();
        for &i in &from_g3 {
            let parent = i.checked_sub(1).and_then(|p| keys.get(p).copied());
            evicted.extend(self.g2_insert(keys[i], true, parent, stats));
        }
        self.demote(evicted, false, stats);
        (0..keys.len())
            .map_while(|i| {
                if in_g2[i] {
                    Some(Tier::G2)
                } else if from_g3.contains(&i) {
                    Some(Tier::G3)
                } else {
                    None
                }
            })
            .collect()
    }

    /// Blocks G2 evicted that G3 lacks, through the admission filter and
    /// the write-back queue (empty when they come: the writer kept up;
    /// `drop_over`, an offer's, drops what passes its bound) to G3.
    fn demote(&mut self, evicted: Vec<(Key, bool)>, drop_over: bool, stats: &mut SimStats) {
        if self.g3.is_none() {
            return;
        }
        let mut queued = HashSet::new();
        let mut bytes = 0u64;
        let mut batch = Vec::with_capacity(evicted.len());
        for (k, persisted) in evicted {
            if persisted {
                continue;
            }
            if self.admission.as_ref().is_some_and(|a| !a.admits(&k)) {
                stats.admission_rejected += 1;
                continue;
            }
            if drop_over && bytes + self.block_bytes > self.writeback_max_bytes {
                stats.writeback_dropped += 1;
                continue;
            }
            if queued.insert(k) {
                bytes += self.block_bytes;
            }
            batch.push(k);
        }
        self.write_g3(&batch, stats);
    }

    /// The G3 writer's work on `blocks`: batches of [`WRITE_BATCH`], each
    /// block G3 then holds marked so in G2.
    fn write_g3(&mut self, blocks: &[Key], stats: &mut SimStats) {
        for chunk in blocks.chunks(WRITE_BATCH) {
            let Some(g3) = &mut self.g3 else { return };
            for k in g3.put_many(chunk, stats) {
                if let Some(e) = self.g2.get_mut(&k) {
                    e.persisted = true;
                }
            }
        }
    }

    /// A clean stop (G2's blocks G3 lacks written to it, oldest first, in
    /// one flush) and a start on the same directory.
    fn restart(&mut self, stats: &mut SimStats) {
        let mut dirty: Vec<(u64, Key)> = self
            .g2
            .iter()
            .filter(|(_, e)| !e.persisted)
            .map(|(k, e)| (e.stamp, *k))
            .collect();
        dirty.sort_unstable_by_key(|&(stamp, _)| stamp);
        let dirty: Vec<Key> = dirty.into_iter().map(|(_, k)| k).collect();
        let before = stats.g3_evicted;
        self.write_g3(&dirty, stats);
        stats.g3_evicted_at_restart += stats.g3_evicted - before;
        self.g2.clear();
        self.g2_policy = self.eviction.build(self.g2_bytes);
        self.admission = self.admission_window.map(SecondSighting::new);
        if let Some(g3) = &mut self.g3 {
            g3.reopen();
        }
    }
}

/// One sequence while it runs.
#[derive(Debug)]
struct Seq {
    tokens: Vec<u32>,
    table: Vec<Page>,
    /// Tokens whose KV its pages hold.
    computed: usize,
    /// Keys of its full pages so far.
    keys: Vec<Key>,
    /// Its prompt's tail came from the store: not offered again.
    tail_stored: bool,
}

/// A store read begun for a prompt.
#[derive(Debug)]
struct Restore {
    /// The keys asked for: full blocks, then maybe the tail's.
    keys: Vec<Key>,
    /// The tail's key and length, when `keys` ends with it.
    tail: Option<(Key, usize)>,
    /// Where each of the leading keys found is.
    tiers: Vec<Tier>,
    /// A layer-wise read's pages, one per key, taken before the read.
    layered: Option<Vec<Page>>,
}

/// A layer-wise restore attached and not yet put in G1's index (the
/// engine does that after the first step's forward pass).
#[derive(Debug)]
struct Settle {
    first: usize,
    keys: Vec<Key>,
    tail: Option<Key>,
}

/// `kvtier serve`'s cache tiers at concurrency 1, token-exact (see the
/// module docs for what it follows and when it is exact).
#[derive(Debug)]
pub struct ServerSim {
    shape: ServerShape,
    keys: KeyNames,
    pool: Pool,
    g1: PrefixIndex,
    store: Option<Store>,
    /// Registered pages not offered to the store yet, with their keys.
    pending: Vec<(Key, Page)>,
    stats: SimStats,
}

impl ServerSim {
    /// A server of `shape`, just started on an empty cache directory.
    /// Refuses a shape it cannot follow exactly: G3 synced on a timer, or
    /// a G4 pool.
    pub fn new(shape: ServerShape) -> Result<Self, String> {
        if shape.block_tokens == 0 || shape.g1_pages == 0 {
            return Err("a server has at least one G1 page of at least one token".into());
        }
        let pages = Page::try_from(shape.g1_pages)
            .map_err(|_| format!("{} G1 pages are more than an engine has", shape.g1_pages))?;
        let store = match shape.store && shape.prefix_reuse {
            true => {
                if shape.g4 {
                    return Err("the server shares a G4 pool with others: what it holds is \
                         not this server's doing alone"
                        .into());
                }
                if shape.g3_slots > 0 && shape.g3_sync_ms != 0 {
                    return Err(format!(
                        "the server copies G2 to G3 every {} ms, so G3 depends on when \
                         requests come: run it with --g3-sync-ms 0",
                        shape.g3_sync_ms
                    ));
                }
                if shape.block_bytes == 0 {
                    return Err("a stored block takes some bytes: block_bytes is 0".into());
                }
                Some(Store::new(&shape)?)
            }
            false => None,
        };
        Ok(Self {
            keys: KeyNames::default(),
            pool: Pool::new(pages),
            g1: PrefixIndex::default(),
            store,
            pending: Vec::new(),
            stats: SimStats::default(),
            shape,
        })
    }

    /// The shape simulated.
    pub fn shape(&self) -> &ServerShape {
        &self.shape
    }

    /// What it did so far, and what each tier holds now.
    pub fn stats(&self) -> SimStats {
        let mut s = self.stats;
        s.g1_cached_pages = self.g1.idle.len();
        if let Some(store) = &self.store {
            s.g2_blocks = store.g2.len();
            s.g3_blocks = store.g3.as_ref().map_or(0, |g| g.index.len());
        }
        s
    }

    /// Where the store holds each block of `tokens`: its full blocks, then
    /// (when it does not end on a block boundary) the rest under its
    /// partial key, as a prompt of `tokens` and one more token stores its
    /// tail. For checking the simulated store against a server's, block by
    /// block.
    pub fn store_places(&self, tokens: &[u32]) -> Vec<BlockPlace> {
        let bt = self.shape.block_tokens;
        let mut out = Vec::with_capacity(tokens.len().div_ceil(bt));
        let mut prev = Some(SEED);
        let place = |key: Option<Key>| {
            let (Some(store), Some(k)) = (&self.store, key) else {
                return BlockPlace::default();
            };
            BlockPlace {
                g2: store.g2.contains_key(&k),
                g3: store.in_g3(&k),
            }
        };
        let mut blocks = tokens.chunks(bt);
        for block in blocks.by_ref() {
            let partial = block.len() < bt;
            let key = prev.and_then(|p| self.keys.get(p, partial, block));
            out.push(place(key));
            prev = key;
        }
        out
    }

    /// One request at concurrency 1: its prompt token ids and the token ids
    /// the server generated for it, ended by `max_tokens` (or sent with
    /// `ignore_eos`); the prompt tokens the server serves from each tier.
    /// Only for requests the server took (one refused by its checks, a
    /// prompt too long say, never reaches the cache). A request the server
    /// would fail ([`try_request`](Self::try_request)) reports what its
    /// prefix restore found.
    pub fn request(&mut self, prompt: &[u32], output: &[u32]) -> TierHits {
        match self.try_request(prompt, output, Ending::Length) {
            Ok(hits) | Err(RequestError::PoolExhausted { hits }) => hits,
            Err(RequestError::EmptyPrompt) => TierHits::default(),
        }
    }

    /// [`request`](Self::request) for any [`Ending`], telling apart the
    /// requests the server fails.
    pub fn try_request(
        &mut self,
        prompt: &[u32],
        output: &[u32],
        ending: Ending,
    ) -> Result<TierHits, RequestError> {
        if prompt.is_empty() {
            return Err(RequestError::EmptyPrompt);
        }
        self.stats.requests += 1;
        let mut seq = Seq {
            tokens: prompt.to_vec(),
            table: Vec::new(),
            computed: 0,
            keys: Vec::new(),
            tail_stored: false,
        };
        let reusable = prompt.len() - 1;
        let mut hits = TierHits::default();
        let restore = match self.shape.prefix_reuse {
            true => self.find_cached(&mut seq, &mut hits),
            false => None,
        };
        let mut settle = None;
        match restore {
            Some(Restore {
                keys,
                tail,
                tiers,
                layered: Some(pages),
            }) => {
                settle = Some(self.attach_layered(&mut seq, (keys, tail, tiers), pages, &mut hits));
            }
            other => {
                if let Some(r) = other {
                    self.attach_blocks(&mut seq, r, &mut hits);
                }
                // What the store lacked of the tail, a G1 page may hold.
                hits.g1 += self.attach_g1_tail(&mut seq, reusable);
            }
        }
        let done = self.compute(&mut seq, &mut settle, output, ending);
        self.finish(seq, settle);
        self.offload();
        if done.is_err() {
            self.stats.failed += 1;
            return Err(RequestError::PoolExhausted { hits });
        }
        Ok(hits)
    }

    /// The server stopped cleanly (SIGTERM, ctrl-c) and started again on
    /// the same cache directory: G1 and G2 empty, G3 as the stop left it.
    pub fn restart(&mut self) {
        self.offload();
        if let Some(store) = &mut self.store {
            store.restart(&mut self.stats);
        }
        self.pool = Pool::new(self.pool.refs.len() as Page);
        self.g1 = PrefixIndex::default();
    }

    /// Keys of the full blocks of `tokens`.
    fn chain_keys(&mut self, tokens: &[u32]) -> Vec<Key> {
        let mut prev = SEED;
        tokens
            .chunks_exact(self.shape.block_tokens)
            .map(|b| {
                prev = self.keys.name(prev, false, b);
                prev
            })
            .collect()
    }

    /// A page, reclaiming the least recently idle cached one when none is
    /// free (`Engine::alloc_page`).
    fn alloc_page(&mut self, after: Option<Page>) -> Option<Page> {
        if let Some(p) = self.pool.alloc(after) {
            return Some(p);
        }
        let p = self.g1.reclaim()?;
        self.stats.g1_reclaimed += 1;
        self.pool.free(p);
        self.pool.alloc(after)
    }

    fn release_page(&mut self, page: Page) {
        if self.pool.release(page) {
            if self.g1.holds(page) {
                self.g1.mark_idle(page);
            } else {
                self.pool.free(page);
            }
        }
    }

    /// `Engine::begin`'s look for the prompt's prefix: G1's pages by key,
    /// then one store read of the rest with the tail, or the tail from a
    /// G1 page when G1 holds all of it.
    fn find_cached(&mut self, seq: &mut Seq, hits: &mut TierHits) -> Option<Restore> {
        let bt = self.shape.block_tokens;
        let reusable = seq.tokens.len() - 1;
        let full = reusable / bt;
        let keys = self.chain_keys(&seq.tokens[..full * bt]);
        let tail_len = reusable - full * bt;
        let tail = (tail_len > 0).then(|| {
            let prev = keys.last().copied().unwrap_or(SEED);
            let key = self.keys.name(prev, true, &seq.tokens[full * bt..reusable]);
            (key, tail_len)
        });
        for key in &keys {
            let Some(page) = self.g1.get(key) else { break };
            self.pool.retain(page);
            self.g1.mark_busy(page);
            seq.table.push(page);
        }
        let h = seq.table.len();
        seq.keys = keys[..h].to_vec();
        seq.computed = h * bt;
        hits.g1 = h * bt;
        let mut rest = keys[h..].to_vec();
        let g1_covers =
            rest.is_empty() && self.g1_tail(seq, reusable).map_or(0, |(_, n)| n) == tail_len;
        if self.store.is_some() && !g1_covers && (!rest.is_empty() || tail.is_some()) {
            if let Some((k, _)) = tail {
                rest.push(k);
            }
            let layered = self.layer_pages(seq, rest.len());
            let store = self.store.as_mut()?;
            let tiers = store.fetch(&rest, &mut self.stats);
            return Some(Restore {
                keys: rest,
                tail,
                tiers,
                layered,
            });
        }
        hits.g1 += self.attach_g1_tail(seq, reusable);
        None
    }

    /// Pages for a layer-wise read of `n` blocks, or `None` (the read is
    /// whole-block, its blocks copied in as pages allow).
    fn layer_pages(&mut self, seq: &Seq, n: usize) -> Option<Vec<Page>> {
        if !self.shape.layerwise_restore || n == 0 {
            return None;
        }
        let mut last = seq.table.last().copied();
        let mut pages = Vec::with_capacity(n);
        for _ in 0..n {
            match self.alloc_page(last) {
                Some(p) => {
                    pages.push(p);
                    last = Some(p);
                }
                None => {
                    for p in pages {
                        self.pool.release(p);
                        self.pool.free(p);
                    }
                    return None;
                }
            }
        }
        Some(pages)
    }

    /// The G1 page below `seq`'s last full block that shares the most of
    /// its next tokens (up to `upto`), and how many.
    fn g1_tail(&self, seq: &Seq, upto: usize) -> Option<(Page, usize)> {
        let bt = self.shape.block_tokens;
        if seq.computed >= upto || !seq.computed.is_multiple_of(bt) {
            return None;
        }
        let parent = seq.keys.last().copied().unwrap_or(SEED);
        self.g1.best_child(&parent, &seq.tokens[seq.computed..upto])
    }

    /// Copies those tokens into a fresh page of `seq`; how many (0 also
    /// when no page is free for the copy).
    fn attach_g1_tail(&mut self, seq: &mut Seq, upto: usize) -> usize {
        let Some((src, n)) = self.g1_tail(seq, upto) else {
            return 0;
        };
        self.pool.retain(src);
        self.g1.mark_busy(src);
        let copied = match self.alloc_page(seq.table.last().copied()) {
            Some(dst) => {
                seq.table.push(dst);
                seq.computed += n;
                n
            }
            None => 0,
        };
        self.release_page(src);
        copied
    }

    /// `Engine::attach_layered`: the found blocks' pages into the table,
    /// the rest handed back, then a G1 page for what the store lacked of
    /// the tail; the blocks go into G1's index at the first step.
    fn attach_layered(
        &mut self,
        seq: &mut Seq,
        (keys, tail, tiers): (Vec<Key>, Option<(Key, usize)>, Vec<Tier>),
        pages: Vec<Page>,
        hits: &mut TierHits,
    ) -> Settle {
        let bt = self.shape.block_tokens;
        let first = seq.table.len();
        let n = tiers.len().min(keys.len()).min(pages.len());
        for i in 0..n {
            let key = keys[i];
            let tail_len = tail.filter(|(k, _)| *k == key).map(|(_, n)| n);
            seq.table.push(pages[i]);
            match tail_len {
                None => seq.keys.push(key),
                Some(_) => seq.tail_stored = true,
            }
            let tokens = tail_len.unwrap_or(bt);
            seq.computed += tokens;
            count(hits, tiers[i], tokens);
        }
        for &p in &pages[n..] {
            self.pool.release(p);
            self.pool.free(p);
        }
        let reusable = seq.tokens.len() - 1;
        hits.g1 += self.attach_g1_tail(seq, reusable);
        Settle {
            first,
            keys: keys[..n].to_vec(),
            tail: tail.map(|(k, _)| k),
        }
    }

    /// `Engine::settle_layered` once the read checked out: the restored
    /// full blocks into G1's index.
    fn settle(&mut self, seq: &Seq, s: Settle) {
        let bt = self.shape.block_tokens;
        for (i, &key) in s.keys.iter().enumerate() {
            if s.tail == Some(key) {
                continue;
            }
            let at = s.first + i;
            let parent = match at.checked_sub(1) {
                Some(p) => seq.keys.get(p).copied().unwrap_or(SEED),
                None => SEED,
            };
            let (Some(&page), Some(tokens)) =
                (seq.table.get(at), seq.tokens.get(at * bt..(at + 1) * bt))
            else {
                continue;
            };
            self.g1.insert(key, page, parent, tokens);
        }
    }

    /// `Engine::attach_some` of a whole-block read: each block found into
    /// a fresh page (and G1's index), until a page is not to be had.
    fn attach_blocks(&mut self, seq: &mut Seq, r: Restore, hits: &mut TierHits) {
        let bt = self.shape.block_tokens;
        for (&key, &tier) in r.keys.iter().zip(&r.tiers) {
            let tail_len = r.tail.filter(|(k, _)| *k == key).map(|(_, n)| n);
            let full_at = tail_len.is_none().then(|| {
                let parent = seq.keys.last().copied().unwrap_or(SEED);
                (parent, seq.table.len() * bt)
            });
            let Some(page) = self.alloc_page(seq.table.last().copied()) else {
                return;
            };
            if let Some((parent, start)) = full_at
                && let Some(tokens) = seq.tokens.get(start..start + bt)
            {
                self.g1.insert(key, page, parent, tokens);
            }
            match tail_len {
                None => seq.keys.push(key),
                Some(_) => seq.tail_stored = true,
            }
            seq.table.push(page);
            let tokens = tail_len.unwrap_or(bt);
            seq.computed += tokens;
            count(hits, tier, tokens);
        }
    }

    /// Pages for `seq`'s first `upto` tokens (`Engine::ensure_pages`); Err
    /// when G1 has none left (the pages taken stay in the table).
    fn ensure_pages(&mut self, seq: &mut Seq, upto: usize) -> Result<(), ()> {
        let need = upto.div_ceil(self.shape.block_tokens);
        while seq.table.len() < need {
            let page = self.alloc_page(seq.table.last().copied()).ok_or(())?;
            seq.table.push(page);
        }
        Ok(())
    }

    /// The scheduler's steps for one sequence alone: its prompt a page at a
    /// time, then each generated token fed back but the last sent (or
    /// every one, when a stop token ended it); the store offered each
    /// step's new pages before the next step. Err when G1 runs out.
    fn compute(
        &mut self,
        seq: &mut Seq,
        settle: &mut Option<Settle>,
        output: &[u32],
        ending: Ending,
    ) -> Result<(), ()> {
        let bt = self.shape.block_tokens;
        let fed = match ending {
            Ending::Length => output.len().saturating_sub(1),
            Ending::StopToken => output.len(),
        };
        let n = seq.tokens.len();
        while seq.computed < n {
            let end = n.min((seq.computed / bt + 1) * bt);
            self.ensure_pages(seq, end)?;
            if let Some(s) = settle.take() {
                self.settle(seq, s);
            }
            seq.computed = end;
            self.register_full_pages(seq);
            if end == n {
                self.offer_prompt_tail(seq);
            }
            // The last step of a finished request is offered after it ends.
            if end < n || fed > 0 {
                self.offload();
            }
        }
        for (i, &t) in output.iter().take(fed).enumerate() {
            seq.tokens.push(t);
            let len = seq.tokens.len();
            if self.ensure_pages(seq, len).is_err() {
                seq.tokens.pop();
                return Err(());
            }
            seq.computed = len;
            self.register_full_pages(seq);
            if i + 1 < fed {
                self.offload();
            }
        }
        Ok(())
    }

    /// `Engine::register_full_pages`: newly full pages into G1's index and,
    /// when new there, queued for the store.
    fn register_full_pages(&mut self, seq: &mut Seq) {
        if !self.shape.prefix_reuse {
            return;
        }
        let bt = self.shape.block_tokens;
        let full = seq.computed / bt;
        while seq.keys.len() < full {
            let i = seq.keys.len();
            let prev = seq.keys.last().copied().unwrap_or(SEED);
            let (Some(tokens), Some(&page)) =
                (seq.tokens.get(i * bt..(i + 1) * bt), seq.table.get(i))
            else {
                return;
            };
            let key = self.keys.name(prev, false, tokens);
            seq.keys.push(key);
            if self.g1.insert(key, page, prev, tokens) && self.store.is_some() {
                self.pool.retain(page);
                self.pending.push((key, page));
            }
        }
    }

    /// `Engine::offer_prompt_tail`: the page holding the prompt's tail,
    /// queued for the store under the tail's partial key.
    fn offer_prompt_tail(&mut self, seq: &Seq) {
        let bt = self.shape.block_tokens;
        if !self.shape.prefix_reuse || self.store.is_none() {
            return;
        }
        let reusable = seq.tokens.len().saturating_sub(1);
        let full = reusable / bt;
        if seq.tail_stored || reusable == full * bt || seq.keys.len() < full {
            return;
        }
        let Some(&page) = seq.table.get(full) else {
            return;
        };
        let prev = match full {
            0 => SEED,
            _ => seq.keys.get(full - 1).copied().unwrap_or(SEED),
        };
        let key = self.keys.name(prev, true, &seq.tokens[full * bt..reusable]);
        self.pool.retain(page);
        self.pending.push((key, page));
    }

    /// `Engine::offload_pending`: the queued pages offered to the store as
    /// one batch, then let go.
    fn offload(&mut self) {
        let pending = std::mem::take(&mut self.pending);
        if pending.is_empty() {
            return;
        }
        if let Some(store) = &mut self.store {
            let keys: Vec<Key> = pending.iter().map(|&(k, _)| k).collect();
            store.offer(&keys, &mut self.stats);
        }
        for (_, page) in pending {
            self.release_page(page);
        }
    }

    /// `Engine::finish`: a layer-wise restore still unsettled goes into
    /// G1's index, the part-filled last page stays below the last full
    /// one, and every page is let go.
    fn finish(&mut self, seq: Seq, settle: Option<Settle>) {
        if let Some(s) = settle {
            self.settle(&seq, s);
        }
        let bt = self.shape.block_tokens;
        let full = seq.computed / bt;
        if self.shape.prefix_reuse
            && seq.keys.len() == full
            && seq.computed > full * bt
            && let Some(&page) = seq.table.get(full)
        {
            let parent = seq.keys.last().copied().unwrap_or(SEED);
            self.g1
                .insert_partial(page, parent, &seq.tokens[full * bt..seq.computed]);
        }
        for page in seq.table {
            self.release_page(page);
        }
    }
}

/// Counts `tokens` restored from `tier`.
fn count(hits: &mut TierHits, tier: Tier, tokens: usize) {
    match tier {
        Tier::G2 => hits.g2 += tokens,
        Tier::G3 => hits.g3 += tokens,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The tiny preset's shape at 4-token blocks: pages of 2 x 2 x 2 x 4
    /// x 16 f32, a 4 KiB slot each.
    fn shape() -> ServerShape {
        ServerShape {
            block_tokens: 4,
            g1_pages: 8,
            g2_bytes: 4 * 4096,
            g3_bytes: 8 * 4096,
            block_bytes: 4096,
            g3_slots: 8,
            g3_slot_bytes: 4096,
            eviction: EvictionKind::Kvtier,
            admission_window: None,
            prefix_reuse: true,
            layerwise_restore: true,
            store: true,
            g3_sync_ms: 0,
            writeback_max_bytes: 256 << 20,
            g4: false,
        }
    }

    const LINE: &str = "kvtier_server_kv_cache_info{block_tokens=\"4\",g1_pages=\"8\",\
        prefix_reuse=\"true\",layerwise_restore=\"true\",store=\"true\",g2_bytes=\"16384\",\
        block_bytes=\"4096\",g3_bytes=\"32768\",g3_slots=\"8\",g3_slot_bytes=\"4096\",\
        g3_sync_ms=\"0\",eviction=\"kvtier\",admission=\"off\",admission_window=\"0\",\
        writeback_max_bytes=\"268435456\",codec=\"none\",g4=\"none\"} 1";

    #[test]
    fn the_shape_comes_back_from_the_servers_metrics_text() {
        let text = format!(
            "# HELP kvtier_server_kv_cache_info The KV cache tiers.\n\
             # TYPE kvtier_server_kv_cache_info gauge\n{LINE}\n\
             kvtier_server_kv_cache_infos{{a=\"b\"}} 1\nkvtier_store_hits_total{{tier=\"g2\"}} 3\n"
        );
        assert_eq!(ServerShape::from_metrics(&text), Ok(shape()));
        let sighting = LINE
            .replace("admission=\"off\"", "admission=\"second-sighting\"")
            .replace("admission_window=\"0\"", "admission_window=\"9\"");
        assert_eq!(
            ServerShape::from_metrics(&sighting).map(|s| s.admission_window),
            Ok(Some(9))
        );
        for (bad, why) in [
            (
                "kvtier_store_hits_total 1\n".to_string(),
                "no kvtier_server",
            ),
            (format!("{LINE}\n{LINE}\n"), "more than once"),
            (LINE.replace("g1_pages=\"8\",", ""), "`g1_pages`"),
            (LINE.replace("\"8\"", "\"eight\""), "not a count"),
            (LINE.replace("\"kvtier\"", "\"mru\""), "unknown eviction"),
            (LINE.replace("\"true\"", "\"yes\""), "not true or false"),
            (LINE.replace("} 1", " 1"), "malformed"),
        ] {
            let got = ServerShape::from_metrics(&bad);
            assert!(
                got.as_ref().is_err_and(|e| e.contains(why)),
                "{bad}: {got:?}"
            );
        }
        // Escapes are undone.
        let labels = parse_labels(r#"a="x\"y\\z",b="1\n"}"#).expect("labels");
        assert_eq!(labels["a"], "x\"y\\z");
        assert_eq!(labels["b"], "1\n");
    }

    #[test]
    fn shapes_it_cannot_follow_exactly_are_refused() {
        let mut s = shape();
        s.g3_sync_ms = 1000;
        assert!(ServerSim::new(s.clone()).is_err_and(|e| e.contains("--g3-sync-ms 0")));
        s.g3_slots = 0;
        assert!(ServerSim::new(s).is_ok(), "no G3: nothing to sync");
        let mut s = shape();
        s.g4 = true;
        assert!(ServerSim::new(s).is_err());
        let mut s = shape();
        s.g1_pages = 0;
        assert!(ServerSim::new(s).is_err());
    }

    #[test]
    fn reuse_is_token_granular_and_the_last_prompt_token_always_computed() {
        let mut sim = ServerSim::new(shape()).expect("sim");
        let p: Vec<u32> = (10..20).collect();
        assert_eq!(sim.request(&p, &[1, 2]), TierHits::default());
        // The same prompt: all but its last token from G1 (2 full pages,
        // then its tail's one token from the finished sequence's last
        // page, which holds 3).
        let again = sim.request(&p, &[1, 2]);
        assert_eq!(
            again,
            TierHits {
                g1: 9,
                g2: 0,
                g3: 0
            }
        );
        // A prompt sharing 5 tokens: one block by key, one token copied.
        let mut q = p[..5].to_vec();
        q.extend([99, 98, 97]);
        assert_eq!(sim.request(&q, &[3, 4]).g1, 5);
        // Generated tokens are cached: the prompt and its answer, asked
        // again, come back but for the last token.
        let mut turn = p.clone();
        turn.extend([1, 2, 50]);
        assert_eq!(sim.request(&turn, &[7, 8]).total(), 11);
        assert_eq!(sim.request(&[5], &[1]), TierHits::default());
        assert_eq!(
            sim.try_request(&[], &[1], Ending::Length),
            Err(RequestError::EmptyPrompt)
        );
    }

    #[test]
    fn blocks_come_back_from_g3_once_g1_and_g2_let_go_and_g3_survives_a_restart() {
        let mut sim = ServerSim::new(shape()).expect("sim");
        // Prompts of 3 blocks and a token, answered with 2 tokens, take 4
        // of the 8 G1 pages each (3 more while their store read runs): the
        // third takes the first one's; G2 holds 4 blocks of the 9 offered.
        let prompts: Vec<Vec<u32>> = (0..3u32)
            .map(|s| (0..13).map(|i| 100 * (s + 1) + i).collect())
            .collect();
        for p in &prompts {
            assert_eq!(sim.request(p, &[1, 2]).total(), 0);
        }
        let st = sim.stats();
        assert!(st.g1_reclaimed > 0 && st.g2_evicted > 0, "{st:?}");
        assert_eq!(st.g2_blocks, 4, "{st:?}");
        assert_eq!(st.g3_blocks, 5, "{st:?}");
        let first = sim.request(&prompts[0], &[1, 2]);
        assert_eq!(
            first,
            TierHits {
                g1: 0,
                g2: 0,
                g3: 12
            }
        );
        sim.restart();
        let st = sim.stats();
        assert_eq!((st.g1_cached_pages, st.g2_blocks), (0, 0));
        assert!(st.g3_blocks > 0, "{st:?}");
        let after = sim.request(&prompts[0], &[1, 2]);
        assert_eq!((after.g1, after.g2), (0, 0), "{after:?}");
        assert!(after.g3 > 0, "{after:?}");
    }
}
