//! Reads through the tiers in one pass: every key is looked up once (one
//! lock per tier for the whole batch), G3 reads and G4 GETs run at the same
//! time, every block is verified where it lands, and hits from below G2 are
//! promoted into G2.
//!
//! Each key's outcome is kept ([`BlockRead`]): a hit, a miss, a block
//! that failed verification (deleted from its tier) or a read that failed.
//! One read is a [`TierRead`] run in steps: G2 first, then the plan of
//! what G3 and G4 are asked for, both tiers' reads at once, and the settling
//! of what landed (checked, promoted into G2, counted).
//! [`TieredStore::get_many`] and [`TieredStore::read_prefix`] see only hits
//! (the rest is counted and logged); the transfers of outside engines
//! (`transfer`) report every outcome per block.
//!
//! [`TieredStore::read_prefix`] wants the leading run of cached blocks: it
//! reads G3 only up to the first key no local tier holds when there is no
//! G4, asks G4 with GETs alone (no EXISTS first) and sends no GET batch
//! after one that missed, and cuts the result at the first miss.

use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use kvtier_io::AlignedBuf;

use super::layer_reads::{LayerSink, LayerSpans, Paced, pause};
use super::{StoredBlock, TieredStore};
use crate::block::{BlockError, BlockHeader, HEADER_BYTES};
use crate::disk::{ReadCuts, ReadOutcome};
use crate::key::BlockKey;
use crate::kv_layout::KvLayout;
use crate::memory::Evicted;
use crate::metrics::Tier;
use crate::outcome::{BlockRead, Refused};

impl TieredStore {
    /// Reads `keys`: G2 hits from memory, every G3 hit in one batch with
    /// all reads in flight and every G4 hit in GET batches, at the same
    /// time, each verified. `None` for a miss (a block that failed
    /// verification is a miss, and is deleted from its tier).
    pub fn get_many(&self, keys: &[BlockKey]) -> Vec<Option<StoredBlock>> {
        self.fetch(keys, false)
            .into_iter()
            .map(BlockRead::hit)
            .collect()
    }

    /// The longest run of leading `keys` cached in any tier, read and
    /// verified in one pass (see the module docs); the blocks of that run,
    /// in order.
    pub fn read_prefix(&self, keys: &[BlockKey]) -> Vec<StoredBlock> {
        self.fetch(keys, true)
            .into_iter()
            .map_while(BlockRead::hit)
            .collect()
    }

    /// Reads `keys` through every tier (see the module docs); with
    /// `leading`, only as far as the leading run of cached blocks can go
    /// (the outcomes past it are misses).
    pub(crate) fn fetch(&self, keys: &[BlockKey], leading: bool) -> Vec<BlockRead<StoredBlock>> {
        self.fetch_to(keys, leading, None, None)
    }

    /// [`fetch`](Self::fetch), handing each block's layers to `sink` as
    /// they land (`layer_reads`); with `tail_rows`, the last key is a short
    /// block of that many token rows.
    ///
    /// Every tier takes short blocks ([`crate::verify::BlockSpec`]); here
    /// each hit must hold the rows its key was asked with (a whole block's,
    /// or `tail_rows` for the last), or it is corrupt and deleted from its
    /// tier: a short block never stands in for a whole one, and a tail
    /// block an older kvtier stored whole is replaced by a short one.
    pub(crate) fn fetch_to(
        &self,
        keys: &[BlockKey],
        leading: bool,
        sink: Option<&dyn LayerSink>,
        tail_rows: Option<u32>,
    ) -> Vec<BlockRead<StoredBlock>> {
        let paced = sink.map(Paced);
        let sink = paced.as_ref().map(|p| p as &dyn LayerSink);
        TierRead::new(self, keys, leading, sink, tail_rows).run()
    }
}

/// One read of `keys` through the tiers, in steps ([`run`](Self::run)):
/// [`g2`](Self::g2) takes what memory holds, [`plan`](Self::plan) splits
/// the rest between G3 and G4, [`read_g3`](Self::read_g3) and
/// [`read_g4`](Self::read_g4) run at the same time, and
/// [`settle_g3`](Self::settle_g3) / [`settle_g4`](Self::settle_g4) check
/// what landed, promote the hits into G2 and record each key's outcome.
struct TierRead<'a> {
    store: &'a TieredStore,
    keys: &'a [BlockKey],
    /// Only the leading run of cached blocks is wanted.
    leading: bool,
    /// The sink the layers are handed to (paced), if any.
    sink: Option<&'a dyn LayerSink>,
    /// Token rows of the last key, a short block.
    tail_rows: Option<u32>,
    /// Each key's outcome so far.
    out: Vec<BlockRead<StoredBlock>>,
    /// Indexes of the keys G3 holds.
    from_g3: Vec<usize>,
    /// Indexes of the keys asked of G4.
    from_g4: Vec<usize>,
    /// The sink has been told the plan.
    told: AtomicBool,
}

impl<'a> TierRead<'a> {
    fn new(
        store: &'a TieredStore,
        keys: &'a [BlockKey],
        leading: bool,
        sink: Option<&'a dyn LayerSink>,
        tail_rows: Option<u32>,
    ) -> Self {
        Self {
            store,
            keys,
            leading,
            sink,
            tail_rows,
            out: Vec::new(),
            from_g3: Vec::new(),
            from_g4: Vec::new(),
            told: AtomicBool::new(false),
        }
    }

    /// The steps, in order.
    fn run(mut self) -> Vec<BlockRead<StoredBlock>> {
        self.g2();
        self.plan();
        // Both tiers' reads in flight at once: G4 on a second thread (it
        // mostly waits on the network), G3 here.
        let (got_g3, got_g4) = if self.from_g3.is_empty() || self.from_g4.is_empty() {
            (self.read_g3(), self.read_g4())
        } else {
            let this = &self;
            std::thread::scope(|s| {
                let g4 = s.spawn(|| this.read_g4());
                let g3 = this.read_g3();
                (g3, g4.join().unwrap_or_default())
            })
        };
        // Nothing went into the kernel (no G3 reads, or no slot to read).
        self.tell_plan();
        let mut evicted = self.settle_g3(got_g3);
        evicted.extend(self.settle_g4(got_g4));
        self.store.demote(evicted, false);
        self.out
    }

    /// Token rows key `i` was asked with.
    fn rows_of(&self, i: usize) -> u32 {
        match self.tail_rows {
            Some(rows) if i + 1 == self.keys.len() => rows,
            _ => self.store.inner.layout.block_tokens,
        }
    }

    /// The layout of key `i`'s block (a short one for a short tail).
    fn layout_of(&self, i: usize) -> KvLayout {
        self.store.inner.layout.with_tokens(self.rows_of(i))
    }

    /// Every layer of the store's layout.
    fn all_layers(&self) -> Range<u32> {
        0..self.store.inner.layout.layers
    }

    /// The block `buf` holds for key `i`, read from `tier`, if it holds the
    /// rows asked for.
    fn hold(&self, i: usize, tier: Tier, buf: Arc<AlignedBuf>) -> Result<StoredBlock, BlockError> {
        holding(self.keys[i], tier, buf, self.rows_of(i))
    }

    /// A G4 value, read whole: all its layers to the sink at once, if it
    /// holds the rows asked for (checked again, with the rest, where it
    /// lands).
    fn hand_whole(&self, i: usize, buf: &AlignedBuf) {
        let Some(sink) = self.sink else { return };
        let len = self.layout_of(i).stored_payload_bytes() as usize;
        if BlockHeader::decode(buf).is_ok_and(|h| h.layout.block_tokens == self.rows_of(i))
            && let Some(p) = buf.get(HEADER_BYTES..HEADER_BYTES + len)
        {
            sink.layers(i, self.all_layers(), p);
        }
    }

    /// G2: the blocks memory holds, including those waiting for write-back
    /// (still G2 hits); a block G2 refuses is dropped there and looked for
    /// below, where a copy is refused too.
    fn g2(&mut self) {
        let inner = &self.store.inner;
        let keys = self.keys;
        let mut in_g2 = match &inner.write_back {
            Some(w) => w.pending.get_many(keys),
            None => vec![None; keys.len()],
        };
        let queued = in_g2.iter().filter(|b| b.is_some()).count();
        if queued > 0 {
            let g2 = &inner.metrics.g2;
            g2.hits.inc_by(queued as u64);
            let bytes: usize = in_g2.iter().flatten().map(|b| b.len()).sum();
            g2.read_bytes.inc_by(bytes as u64);
        }
        inner.memory.get_many(keys, &mut in_g2);
        self.out = in_g2
            .into_iter()
            .enumerate()
            .map(|(i, b)| match b.map(|b| self.hold(i, Tier::G2, b)) {
                None => BlockRead::Miss,
                Some(Ok(b)) => BlockRead::Hit(b),
                Some(Err(why)) => {
                    tracing::warn!("G2 block {} refused ({why}); dropping it", keys[i]);
                    inner.memory.remove(&keys[i]);
                    BlockRead::Miss
                }
            })
            .collect();
        if let Some(sink) = self.sink {
            for (i, found) in self.out.iter().enumerate() {
                if let BlockRead::Hit(b) = found {
                    sink.layers(i, self.all_layers(), b.payload());
                }
            }
        }
        self.store.record_sightings(
            keys.iter()
                .zip(&self.out)
                .filter(|(_, b)| b.is_hit())
                .map(|(k, _)| k),
        );
    }

    /// Below G2: which keys G3 holds (one lock), the rest asked of G4;
    /// for a leading read without G4, nothing past the first key no tier
    /// holds.
    fn plan(&mut self) {
        let store = self.store;
        let missing: Vec<usize> = (0..self.keys.len())
            .filter(|&i| !self.out[i].is_hit())
            .collect();
        let missing_keys: Vec<BlockKey> = missing.iter().map(|&i| self.keys[i]).collect();
        let in_g3 = match store.disk() {
            Some(d) => d.contains_many(&missing_keys),
            None => vec![false; missing.len()],
        };
        let has_g4 = store.remote().is_some();
        for (&i, held) in missing.iter().zip(in_g3) {
            if held {
                self.from_g3.push(i);
                continue;
            }
            if store.disk().is_some() {
                store.inner.metrics.g3.misses.inc();
            }
            if has_g4 {
                self.from_g4.push(i);
            } else if self.leading {
                // No tier holds it: the prefix ends here.
                break;
            }
        }
    }

    /// The leading run of keys some tier holds, `in_g4(j)` telling whether
    /// `from_g4[j]` was found there.
    fn planned(&self, in_g4: &dyn Fn(usize) -> bool) -> Vec<Tier> {
        let tier = |i: usize| {
            if self.out[i].is_hit() {
                Some(Tier::G2)
            } else if self.from_g3.contains(&i) {
                Some(Tier::G3)
            } else {
                self.from_g4
                    .iter()
                    .position(|&j| j == i)
                    .is_some_and(in_g4)
                    .then_some(Tier::G4)
            }
        };
        (0..self.keys.len()).map_while(tier).collect()
    }

    /// Tells the sink the plan, once, when it is known without G4 (with G4,
    /// [`read_g4`](Self::read_g4) tells it once the GETs are answered).
    ///
    /// The sink hears it once the first G3 reads are in the kernel (or
    /// after the reads, when there were none): it wakes the engine's
    /// forward pass, which would otherwise start (and wake its pool's
    /// threads) while this thread still holds a core to issue them. Telling
    /// it after the reads are issued gave a lower concurrency-1 TTFT of
    /// restored requests than telling it first on a machine with few cores
    /// (docs/decisions.md).
    fn tell_plan(&self) {
        let Some(sink) = self.sink else { return };
        if self.from_g4.is_empty() && !self.told.swap(true, Ordering::Relaxed) {
            sink.planned(&self.planned(&|_| false));
        }
    }

    /// The G3 reads, all in flight at once; with a sink, each block's
    /// layers handed over as their parts land.
    fn read_g3(&self) -> Vec<(ReadOutcome, AlignedBuf)> {
        let Some(d) = self.store.disk().filter(|_| !self.from_g3.is_empty()) else {
            return Vec::new();
        };
        let keys: Vec<BlockKey> = self.from_g3.iter().map(|&i| self.keys[i]).collect();
        let Some(sink) = self.sink else {
            return d.read_outcomes(&keys);
        };
        let spans: Vec<Option<LayerSpans>> = self
            .from_g3
            .iter()
            .map(|&i| LayerSpans::of(&self.layout_of(i)))
            .collect();
        let cuts: Vec<ReadCuts> = self
            .from_g3
            .iter()
            .zip(&spans)
            .map(|(&i, s)| ReadCuts {
                at: s.as_ref().map(LayerSpans::cuts).unwrap_or_default(),
                payload_len: self.layout_of(i).stored_payload_bytes() as usize,
            })
            .collect();
        let landed = |j: usize, new: Range<usize>, slot: &[u8]| {
            let (Some(&i), Some(spans), Some(cut)) =
                (self.from_g3.get(j), spans.get(j), cuts.get(j))
            else {
                return;
            };
            match spans {
                Some(spans) => spans.hand_over(sink, i, new, slot),
                None if new.end == cut.end() => {
                    let len = cut.payload_len;
                    if let Some(p) = slot.get(HEADER_BYTES..HEADER_BYTES + len) {
                        sink.layers(i, self.all_layers(), p);
                    }
                }
                None => {}
            }
        };
        d.read_in_parts(&keys, &cuts, &landed, &mut || self.tell_plan())
    }

    /// The G4 GETs (a prefix's stop after the first batch that missed);
    /// with a sink, each hit handed over whole and the plan told once they
    /// are answered.
    fn read_g4(&self) -> Vec<BlockRead<AlignedBuf>> {
        let Some(r) = self.store.remote().filter(|_| !self.from_g4.is_empty()) else {
            return Vec::new();
        };
        let keys: Vec<BlockKey> = self.from_g4.iter().map(|&i| self.keys[i]).collect();
        let pace = self.sink.map_or(0.0, |s| s.yield_factor());
        let paced = self.leading && pace > 0.0;
        let got = if paced {
            // One GET at a time, each block handed over as it lands, then
            // a pause (`LayerSink::yield_factor`).
            let mut got = Vec::with_capacity(keys.len());
            for (j, (&i, key)) in self.from_g4.iter().zip(&keys).enumerate() {
                let t = std::time::Instant::now();
                let one = r
                    .get_leading(std::slice::from_ref(key))
                    .pop()
                    .unwrap_or(BlockRead::Miss);
                if let BlockRead::Hit(buf) = &one {
                    self.hand_whole(i, buf);
                }
                let hit = one.is_hit();
                got.push(one);
                if !hit || j + 1 == keys.len() {
                    break;
                }
                pause(t.elapsed(), pace);
            }
            got.resize_with(keys.len(), || BlockRead::Miss);
            got
        } else if self.leading {
            r.get_leading(&keys)
        } else {
            r.get_many(&keys)
        };
        if let Some(sink) = self.sink {
            let found = |j: usize| got.get(j).is_some_and(BlockRead::is_hit);
            sink.planned(&self.planned(&found));
        }
        if !paced {
            for (&i, g) in self.from_g4.iter().zip(&got) {
                if let BlockRead::Hit(buf) = g {
                    self.hand_whole(i, buf);
                }
            }
        }
        got
    }

    /// What the G3 reads found: each hit checked for its rows and promoted
    /// into G2 (as persisted); the blocks G2 evicts for them.
    fn settle_g3(&mut self, got: Vec<(ReadOutcome, AlignedBuf)>) -> Vec<Evicted> {
        let inner = &self.store.inner;
        let mut evicted = Vec::new();
        for (&i, (outcome, buf)) in self.from_g3.iter().zip(got) {
            let key = self.keys[i];
            self.out[i] = match outcome.try_hit() {
                Ok(()) => match self.hold(i, Tier::G3, Arc::new(buf)) {
                    Ok(b) => {
                        evicted.extend(inner.memory.insert(
                            inner.owner,
                            key,
                            b.buf.clone(),
                            true,
                            i.checked_sub(1).map(|p| &self.keys[p]),
                        ));
                        BlockRead::Hit(b)
                    }
                    Err(reason) => {
                        tracing::warn!("G3 block {key} refused ({reason}); deleting it");
                        if let Some(d) = self.store.disk() {
                            d.remove(&key);
                        }
                        BlockRead::Corrupt(Refused {
                            tier: Tier::G3,
                            reason,
                        })
                    }
                },
                Err(other) => other,
            };
        }
        evicted
    }

    /// What the G4 GETs found: each hit checked for its rows, counted and
    /// promoted into G2 (not persisted locally: G3 gets it when G2 evicts
    /// it); a refused value deleted from the pool so no node reads it
    /// again. The blocks G2 evicts for them.
    fn settle_g4(&mut self, got: Vec<BlockRead<AlignedBuf>>) -> Vec<Evicted> {
        let inner = &self.store.inner;
        let g4 = &inner.metrics.g4;
        let mut evicted = Vec::new();
        for (&i, got) in self.from_g4.iter().zip(got) {
            let key = self.keys[i];
            let checked = match got.try_hit() {
                Ok(buf) => match self.hold(i, Tier::G4, Arc::new(buf)) {
                    Ok(b) => BlockRead::Hit(b),
                    Err(reason) => BlockRead::Corrupt(Refused {
                        tier: Tier::G4,
                        reason,
                    }),
                },
                Err(other) => other,
            };
            self.out[i] = match checked {
                BlockRead::Hit(b) => {
                    g4.hits.inc();
                    evicted.extend(inner.memory.insert(
                        inner.owner,
                        key,
                        b.buf.clone(),
                        false,
                        i.checked_sub(1).map(|p| &self.keys[p]),
                    ));
                    BlockRead::Hit(b)
                }
                BlockRead::Corrupt(why) => {
                    tracing::warn!(
                        "G4 block {key} failed verification ({}); deleting it",
                        why.reason
                    );
                    g4.corrupt_blocks.inc();
                    g4.misses.inc();
                    if let Some(r) = self.store.remote() {
                        r.delete(&key);
                    }
                    BlockRead::Corrupt(why)
                }
                // Any read but a prefix's reports an unanswered key; a
                // prefix read counts it as a miss (its caller sees only the
                // hits).
                BlockRead::Failed(why) if !self.leading => BlockRead::Failed(why),
                BlockRead::Miss | BlockRead::Failed(_) => {
                    g4.misses.inc();
                    BlockRead::Miss
                }
            };
        }
        evicted
    }
}

/// The block `buf` holds, read from `tier` for `key`, if it holds `rows`
/// token rows: a short block (a prompt's tail) never stands in for a whole
/// one, nor a whole one for a short one (a tail an older kvtier stored
/// whole is refused, deleted and stored again short). Why not otherwise.
fn holding(
    key: BlockKey,
    tier: Tier,
    buf: Arc<AlignedBuf>,
    rows: u32,
) -> Result<StoredBlock, BlockError> {
    let b = StoredBlock::of(key, tier, buf)?;
    if b.rows() == rows {
        Ok(b)
    } else {
        Err(BlockError::WrongRows {
            held: b.rows(),
            asked: rows,
        })
    }
}
