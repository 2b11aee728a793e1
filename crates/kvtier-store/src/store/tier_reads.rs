//! Reads through the tiers in one pass: every key is looked up once (one
//! lock per tier for the whole batch), G3 reads and G4 GETs run at the same
//! time, every block is verified where it lands, and hits from below G2 are
//! promoted into G2.
//!
//! Each key's outcome is kept ([`Found`]): a hit, a miss, a block that
//! failed verification (deleted from its tier) or a read that failed.
//! [`TieredStore::get_many`] and [`TieredStore::read_prefix`] see only hits
//! (the rest is counted and logged); the transfers of outside engines
//! (`transfer`) report every outcome per block.
//!
//! [`TieredStore::read_prefix`] wants the leading run of cached blocks: it
//! reads G3 only up to the first key no local tier holds when there is no
//! G4, asks G4 with GETs alone (no EXISTS first) and sends no GET batch
//! after one that missed, and cuts the result at the first miss.

use std::sync::Arc;

use kvtier_io::AlignedBuf;

use super::layer_reads::{LayerSink, LayerSpans, Paced, pause};
use super::{StoredBlock, TieredStore};
use crate::block::{BlockHeader, HEADER_BYTES};
use crate::disk::{ReadCuts, ReadOutcome};
use crate::key::BlockKey;
use crate::metrics::Tier;
use crate::remote::Fetched;

/// What one key's read found.
#[derive(Debug)]
pub(crate) enum Found {
    /// Found, verified, and (from below G2) promoted into G2.
    Hit(StoredBlock),
    /// No tier holds it.
    Miss,
    /// A tier held it but it failed verification; deleted there.
    Corrupt(String),
    /// Reading it failed (I/O error, G4 unreachable): no tier answered.
    Failed(String),
}

impl Found {
    /// The block, for a hit.
    pub(crate) fn into_hit(self) -> Option<StoredBlock> {
        match self {
            Found::Hit(b) => Some(b),
            _ => None,
        }
    }
}

impl TieredStore {
    /// Reads `keys`: G2 hits from memory, every G3 hit in one batch with
    /// all reads in flight and every G4 hit in GET batches, at the same
    /// time, each verified. `None` for a miss (a block that failed
    /// verification is a miss, and is deleted from its tier).
    pub fn get_many(&self, keys: &[BlockKey]) -> Vec<Option<StoredBlock>> {
        self.fetch(keys, false)
            .into_iter()
            .map(Found::into_hit)
            .collect()
    }

    /// The longest run of leading `keys` cached in any tier, read and
    /// verified in one pass (see the module docs); the blocks of that run,
    /// in order.
    pub fn read_prefix(&self, keys: &[BlockKey]) -> Vec<StoredBlock> {
        self.fetch(keys, true)
            .into_iter()
            .map_while(Found::into_hit)
            .collect()
    }

    /// Reads `keys` through every tier (see the module docs); with
    /// `leading`, only as far as the leading run of cached blocks can go
    /// (the outcomes past it are misses).
    pub(crate) fn fetch(&self, keys: &[BlockKey], leading: bool) -> Vec<Found> {
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
    ) -> Vec<Found> {
        let inner = &self.inner;
        let layers = inner.layout.layers;
        let rows_of = |i: usize| match tail_rows {
            Some(rows) if i + 1 == keys.len() => rows,
            _ => inner.layout.block_tokens,
        };
        let layout_of = |i: usize| inner.layout.with_tokens(rows_of(i));
        let spans_of = |i: usize| sink.and_then(|_| LayerSpans::of(&layout_of(i)));
        let paced = sink.map(Paced);
        let sink = paced.as_ref().map(|p| p as &dyn LayerSink);
        // A G4 value, read whole: all its layers at once, if it holds the
        // rows asked for (checked again, with the rest, where it lands).
        let whole = |i: usize, buf: &AlignedBuf| {
            let Some(sink) = sink else { return };
            let len = layout_of(i).stored_payload_bytes() as usize;
            if BlockHeader::decode(buf).is_ok_and(|h| h.layout.block_tokens == rows_of(i))
                && let Some(p) = buf.get(HEADER_BYTES..HEADER_BYTES + len)
            {
                sink.layers(i, 0..layers, p);
            }
        };
        let block =
            |i: usize, tier: Tier, buf: Arc<AlignedBuf>| holding(keys[i], tier, buf, rows_of(i));

        // G2: blocks waiting for write-back are still G2 hits.
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
        let mut out: Vec<Found> = in_g2
            .into_iter()
            .enumerate()
            .map(|(i, b)| match b.map(|b| block(i, Tier::G2, b)) {
                None => Found::Miss,
                Some(Ok(b)) => Found::Hit(b),
                Some(Err(why)) => {
                    tracing::warn!("G2 block {} refused ({why}); dropping it", keys[i]);
                    inner.memory.remove(&keys[i]);
                    // Looked for below, where a copy is refused too.
                    Found::Miss
                }
            })
            .collect();
        for (i, found) in out.iter().enumerate() {
            if let (Some(sink), Found::Hit(b)) = (sink, found) {
                sink.layers(i, 0..layers, b.payload());
            }
        }
        self.record_sightings(
            keys.iter()
                .zip(&out)
                .filter(|(_, b)| matches!(b, Found::Hit(_)))
                .map(|(k, _)| k),
        );

        // Below G2: which keys G3 holds (one lock), the rest from G4.
        let missing: Vec<usize> = (0..keys.len())
            .filter(|&i| !matches!(out[i], Found::Hit(_)))
            .collect();
        let missing_keys: Vec<BlockKey> = missing.iter().map(|&i| keys[i]).collect();
        let in_g3 = match self.disk() {
            Some(d) => d.contains_many(&missing_keys),
            None => vec![false; missing.len()],
        };
        let remote = self.remote();
        let (mut from_g3, mut from_g4) = (Vec::new(), Vec::new());
        let has_g3 = self.disk().is_some();
        for (&i, held) in missing.iter().zip(in_g3) {
            if held {
                from_g3.push(i);
                continue;
            }
            if has_g3 {
                inner.metrics.g3.misses.inc();
            }
            if remote.is_some() {
                from_g4.push(i);
            } else if leading {
                // No tier holds it: the prefix ends here.
                break;
            }
        }
        let g3_keys: Vec<BlockKey> = from_g3.iter().map(|&i| keys[i]).collect();
        let g4_keys: Vec<BlockKey> = from_g4.iter().map(|&i| keys[i]).collect();
        // The leading run of keys some tier holds, `in_g4` telling which
        // of `from_g4` were found there.
        let planned = |in_g4: &dyn Fn(usize) -> bool| -> Vec<Tier> {
            let tier = |i: usize| {
                if matches!(out[i], Found::Hit(_)) {
                    Some(Tier::G2)
                } else if from_g3.contains(&i) {
                    Some(Tier::G3)
                } else {
                    from_g4
                        .iter()
                        .position(|&j| j == i)
                        .is_some_and(in_g4)
                        .then_some(Tier::G4)
                }
            };
            (0..keys.len()).map_while(tier).collect()
        };
        // Known now unless G4 is asked: then once its GETs are answered.
        // The sink hears it once the first G3 reads are in the kernel (or
        // after the reads, when there were none): it wakes the engine's
        // forward pass, which would otherwise start (and wake its pool's
        // threads) while this thread still holds a core to issue them.
        // Telling it after the reads are issued gave a lower concurrency-1
        // TTFT of restored requests than telling it first, on a machine
        // with few cores (docs/decisions.md).
        let ask_g4 = remote.is_some() && !g4_keys.is_empty();
        let mut tell_plan = sink.filter(|_| !ask_g4).map(|sink| {
            let planned = &planned;
            move || sink.planned(&planned(&|_| false))
        });
        let mut read_g3 = || match (self.disk(), sink) {
            (Some(d), Some(sink)) if !g3_keys.is_empty() => {
                let spans: Vec<Option<LayerSpans>> = from_g3.iter().map(|&i| spans_of(i)).collect();
                let cuts: Vec<ReadCuts> = from_g3
                    .iter()
                    .zip(&spans)
                    .map(|(&i, s)| ReadCuts {
                        at: s.as_ref().map(LayerSpans::cuts).unwrap_or_default(),
                        payload_len: layout_of(i).stored_payload_bytes() as usize,
                    })
                    .collect();
                let landed = |j: usize, new: std::ops::Range<usize>, slot: &[u8]| {
                    let (Some(&i), Some(spans), Some(cut)) =
                        (from_g3.get(j), spans.get(j), cuts.get(j))
                    else {
                        return;
                    };
                    match spans {
                        Some(spans) => spans.hand_over(sink, i, new, slot),
                        None if new.end == cut.end() => {
                            let len = cut.payload_len;
                            if let Some(p) = slot.get(HEADER_BYTES..HEADER_BYTES + len) {
                                sink.layers(i, 0..layers, p);
                            }
                        }
                        None => {}
                    }
                };
                let mut submitted = || {
                    if let Some(tell) = tell_plan.take() {
                        tell();
                    }
                };
                d.read_in_parts(&g3_keys, &cuts, &landed, &mut submitted)
            }
            (Some(d), _) if !g3_keys.is_empty() => d.read_outcomes(&g3_keys),
            _ => Vec::new(),
        };
        let pace = sink.map_or(0.0, |s| s.yield_factor());
        let read_g4 = || {
            let got = match remote {
                Some(r) if !g4_keys.is_empty() && leading && pace > 0.0 => {
                    // One GET at a time, each block handed over as it
                    // lands, then a pause (`LayerSink::yield_factor`).
                    let mut got = Vec::with_capacity(g4_keys.len());
                    for (j, (&i, key)) in from_g4.iter().zip(&g4_keys).enumerate() {
                        let t = std::time::Instant::now();
                        let mut one = r.get_leading(std::slice::from_ref(key));
                        let fetched = one.pop().flatten();
                        let hit = matches!(fetched, Some(Ok(_)));
                        if let Some(Ok(buf)) = &fetched {
                            whole(i, buf);
                        }
                        got.push(fetched);
                        if !hit || j + 1 == g4_keys.len() {
                            break;
                        }
                        pause(t.elapsed(), pace);
                    }
                    got.resize_with(g4_keys.len(), || None);
                    if let Some(sink) = sink {
                        let found = |j: usize| matches!(got.get(j), Some(Some(Ok(_))));
                        sink.planned(&planned(&found));
                    }
                    return (got, None);
                }
                Some(r) if !g4_keys.is_empty() && leading => (r.get_leading(&g4_keys), None),
                Some(r) if !g4_keys.is_empty() => r.get_many_reporting(&g4_keys),
                _ => (Vec::new(), None),
            };
            if let Some(sink) = sink
                && ask_g4
            {
                let found = |j: usize| matches!(got.0.get(j), Some(Some(Ok(_))));
                sink.planned(&planned(&found));
                for (&i, g) in from_g4.iter().zip(&got.0) {
                    if let Some(Ok(buf)) = g {
                        whole(i, buf);
                    }
                }
            }
            got
        };
        // Both tiers' reads in flight at once: G4 on a second thread (it
        // mostly waits on the network), G3 here.
        let (got_g3, got_g4) = if g3_keys.is_empty() || g4_keys.is_empty() {
            (read_g3(), read_g4())
        } else {
            std::thread::scope(|s| {
                let g4 = s.spawn(read_g4);
                let g3 = read_g3();
                (g3, g4.join().unwrap_or_default())
            })
        };
        // Nothing went into the kernel (no G3 reads, or no slot to read).
        if let Some(tell) = tell_plan.take() {
            tell();
        }

        let (got_g4, g4_failed) = got_g4;
        let mut evicted = Vec::new();
        for (&i, (outcome, buf)) in from_g3.iter().zip(got_g3) {
            out[i] = match outcome {
                ReadOutcome::Hit => match block(i, Tier::G3, Arc::new(buf)) {
                    Ok(b) => {
                        evicted.extend(inner.memory.insert(
                            inner.owner,
                            keys[i],
                            b.buf.clone(),
                            true,
                            i.checked_sub(1).map(|p| &keys[p]),
                        ));
                        Found::Hit(b)
                    }
                    Err(why) => {
                        tracing::warn!("G3 block {} refused ({why}); deleting it", keys[i]);
                        if let Some(d) = self.disk() {
                            d.remove(&keys[i]);
                        }
                        Found::Corrupt(format!("G3: {why}"))
                    }
                },
                ReadOutcome::Miss => Found::Miss,
                ReadOutcome::Corrupt(e) => Found::Corrupt(format!("G3: {e}")),
                ReadOutcome::Io(e) => Found::Failed(format!("G3 read: {e}")),
            };
        }
        for (j, (&i, got)) in from_g4.iter().zip(got_g4).enumerate() {
            let unanswered = g4_failed.as_ref().filter(|(first, _)| j >= *first);
            let found = match (got, unanswered) {
                (None, Some((_, why))) => Found::Failed(why.clone()),
                (got, _) => self.landed_g4(&keys[i], got, rows_of(i)),
            };
            if let Found::Hit(b) = &found {
                // Not persisted locally: G3 gets it when G2 evicts it.
                evicted.extend(inner.memory.insert(
                    inner.owner,
                    keys[i],
                    b.buf.clone(),
                    false,
                    i.checked_sub(1).map(|p| &keys[p]),
                ));
            }
            out[i] = found;
        }
        self.demote(evicted, false);
        out
    }

    /// A G4 result as a hit (holding `rows` token rows) or a miss,
    /// counted; a value refused by the check is deleted from the pool so no
    /// node reads it again.
    fn landed_g4(&self, key: &BlockKey, got: Fetched, rows: u32) -> Found {
        let g4 = &self.inner.metrics.g4;
        let checked = got.map(|r| r.and_then(|buf| holding(*key, Tier::G4, Arc::new(buf), rows)));
        match checked {
            Some(Ok(b)) => {
                g4.hits.inc();
                Found::Hit(b)
            }
            Some(Err(why)) => {
                tracing::warn!("G4 block {key} failed verification ({why}); deleting it");
                g4.corrupt_blocks.inc();
                g4.misses.inc();
                if let Some(r) = self.remote() {
                    r.delete(key);
                }
                Found::Corrupt(format!("G4: {why}"))
            }
            None => {
                g4.misses.inc();
                Found::Miss
            }
        }
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
) -> Result<StoredBlock, String> {
    match StoredBlock::of(key, tier, buf) {
        Some(b) if b.rows() == rows => Ok(b),
        Some(b) => Err(format!(
            "holds {} token rows where {rows} were asked for",
            b.rows()
        )),
        None => Err("its header does not decode".into()),
    }
}
