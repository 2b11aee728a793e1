//! G3 reads in parts, for a layer-wise restore: each slot is read as
//! several aligned parts, issued part-major across the batch (every block's
//! first part, then every block's second, ...), so the first layers of a
//! whole prefix land before its last ones; the first parts go alone, as a
//! first wave, so they land at the device's full speed, and the rest a few
//! megabytes at a time, so they land layer by layer. Each time a block's
//! leading run of landed parts grows, the caller sees those bytes at once,
//! unverified, while the rest is still in flight; the payload's checksum is
//! summed part by part right after each hand-over, and the block is
//! verified as a whole (header, key, layout, model, that sum) once all of it
//! is in. A block that fails is a miss, dropped and wiped as in
//! [`DiskTier::read_many`]: a caller that used its early bytes must drop
//! what it made of them.

use std::io;
use std::ops::Range;
use std::ptr::NonNull;
use std::time::Instant;

use kvtier_io::{AlignedBuf, DIRECT_IO_ALIGN, IoDone, IoOp};
use parking_lot::Mutex;

use super::{DiskRead, DiskTier, ReadOutcome, failed, refused};
use crate::block::{BlockError, HEADER_BYTES};
use crate::key::BlockKey;

/// Bytes in flight after the first wave of a read in parts: little enough
/// that a disk moves them in a small part of one layer's forward pass, so
/// the next layer's parts land before the pass needs them, and enough
/// large reads for an NVMe device to keep its queue busy.
const READ_WINDOW_BYTES: usize = 4 << 20;

/// Reads in flight after the first wave of a read of `n` blocks in parts,
/// the largest `largest` bytes: about [`READ_WINDOW_BYTES`] of parts or a
/// part of every block, whichever is more, and at most `configured`. The
/// parts are issued layer-major, so a window makes them land
/// layer by layer. With every part of a large prefix in flight the device
/// shared its bandwidth among them all, and layer 1 landed with the last
/// layer, long after the forward pass wanted it. With the window an
/// uncoded prefix of the `small` preset reaches its first token sooner
/// (docs/decisions.md); int8's smaller parts all fit in it, as before.
fn in_flight_after_the_first_wave(configured: usize, largest: usize, n: usize) -> usize {
    let window = (READ_WINDOW_BYTES / largest.max(1)).max(n);
    configured.min(window).max(1)
}

/// How much of one block has landed.
struct Landed {
    /// Which parts are in.
    parts: Vec<bool>,
    /// The leading parts that are all in.
    run: usize,
    /// The leading parts whose payload bytes are in `crc`.
    summed: usize,
    /// CRC32C of the payload bytes of the leading `summed` parts.
    crc: u32,
    /// A part's read failed (the error) or came back short (`None` error).
    failed: Option<Option<io::Error>>,
}

impl Landed {
    /// Adds the payload bytes of the parts before `end` (all landed) not
    /// summed yet to `crc`, in order (`payload(p)`: part `p`'s payload
    /// bytes). Called after each hand-over with its run's end: a thread
    /// whose run came after another's, and was handed over first, sums
    /// both; the other then finds its parts summed.
    fn sum_to<'a>(&mut self, end: usize, payload: impl Fn(usize) -> &'a [u8]) {
        while self.summed < end.min(self.parts.len()) {
            self.crc = crc32c::crc32c_append(self.crc, payload(self.summed));
            self.summed += 1;
        }
    }
}

/// Where [`DiskTier::read_in_parts`] cuts one slot's read.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReadCuts {
    /// Slot offsets to cut at; those not a multiple of 4 KiB, not
    /// increasing, or not before the end are ignored.
    pub at: Vec<usize>,
    /// The block's stored payload bytes: a slot's layout's, or fewer for a
    /// short block ([`crate::KvLayout::with_tokens`]). The read ends with
    /// the block ([`end`](Self::end)), at most a slot.
    pub payload_len: usize,
}

impl ReadCuts {
    /// Where the read ends: header and payload, rounded up to 4 KiB.
    pub fn end(&self) -> usize {
        (HEADER_BYTES + self.payload_len).next_multiple_of(DIRECT_IO_ALIGN)
    }

    /// Part boundaries within a slot of `slot` bytes: 0, the cuts, the end.
    fn bounds(&self, slot: usize) -> Vec<usize> {
        let end = self.end().min(slot);
        let mut bounds = vec![0usize];
        for &c in &self.at {
            if c.is_multiple_of(DIRECT_IO_ALIGN) && c < end && bounds.last().is_some_and(|&b| c > b)
            {
                bounds.push(c);
            }
        }
        bounds.push(end);
        bounds
    }
}

/// What the caller of [`DiskTier::read_in_parts`] is told as a block
/// lands: its index in the keys, the slot bytes new this time, and the
/// slot's first bytes (up to the end of those), all landed.
pub type OnLanded<'a> = dyn Fn(usize, Range<usize>, &[u8]) + Sync + 'a;

impl DiskTier {
    /// Reads `keys` into fresh buffers (from the allocation hook), key
    /// `i`'s slot in parts cut at `cuts[i]` (a whole slot in one part when
    /// absent), part-major across the keys with the configured reads in
    /// flight. `landed(i,
    /// from..to, bytes)` runs (on an I/O thread) each time the run of key
    /// `i`'s leading landed parts grows: `bytes` is the slot's first `to`
    /// bytes, `from..to` what is new; they are not verified yet. Outcomes
    /// and buffers as [`read_outcomes`](Self::read_outcomes) gives them.
    /// `submitted` runs once, as soon as the first reads are in the kernel
    /// (`IoEngine::run_waves_map`), not at all when nothing is read.
    pub fn read_in_parts(
        &self,
        keys: &[BlockKey],
        cuts: &[ReadCuts],
        landed: &OnLanded<'_>,
        submitted: &mut dyn FnMut(),
    ) -> Vec<(ReadOutcome, AlignedBuf)> {
        let reqs = keys.iter().map(|key| (*key, self.slot_buffer())).collect();
        let (mut out, plan, mut bufs) = self.pin_reads(reqs);
        if plan.is_empty() {
            return Self::in_key_order(keys, out.into_iter().flatten().collect());
        }
        let whole = ReadCuts {
            at: Vec::new(),
            payload_len: self.spec.layout.stored_payload_bytes() as usize,
        };
        let cuts: Vec<&ReadCuts> = plan
            .iter()
            .map(|&(i, _, _)| cuts.get(i).unwrap_or(&whole))
            .collect();
        // Part boundaries of each planned read.
        let bounds: Vec<Vec<usize>> = cuts.iter().map(|c| c.bounds(self.slot_bytes)).collect();
        // Where each planned buffer (a slot long, set by `pin_reads`)
        // starts, as addresses: the callback that reads landed parts runs
        // on I/O threads.
        let bases: Vec<usize> = bufs
            .iter_mut()
            .map(|b| b.as_mut_ptr().expose_provenance())
            .collect();
        let at = |base: usize, offset: usize| -> NonNull<u8> {
            NonNull::new(std::ptr::with_exposed_provenance_mut::<u8>(base).wrapping_add(offset))
                .unwrap_or(NonNull::dangling())
        };
        let progress: Vec<Mutex<Landed>> = bounds
            .iter()
            .map(|b| {
                Mutex::new(Landed {
                    parts: vec![false; b.len() - 1],
                    run: 0,
                    summed: 0,
                    crc: 0,
                    failed: None,
                })
            })
            .collect();
        // Each read's payload bytes (the rest is header and padding).
        let payload = |j: usize| HEADER_BYTES..HEADER_BYTES + cuts[j].payload_len;
        let n = plan.len();
        // Part-major: every read's first part, then every second, ...;
        // `who[k]`: op `k`'s (read, part).
        let most = bounds.iter().map(|b| b.len() - 1).max().unwrap_or(0);
        let mut ops = Vec::new();
        let mut who = Vec::new();
        for p in 0..most {
            for (j, (&(_, _, slot), base)) in plan.iter().zip(&bases).enumerate() {
                let Some(part) = bounds[j].get(p..p + 2) else {
                    continue;
                };
                let (file, off) = self.locate(slot);
                // SAFETY: parts are disjoint ranges inside a buffer of at
                // least a slot (checked by `pin_reads`), aligned as O_DIRECT
                // asks (a 4 KiB-aligned buffer, 4 KiB-multiple cuts). `bufs`
                // outlives the batch, and nothing touches a part until its
                // read completed: the callback reads only landed parts.
                let op = unsafe {
                    IoOp::read_raw(
                        file,
                        off + part[0] as u64,
                        at(*base, part[0]),
                        part[1] - part[0],
                    )
                };
                ops.push(op);
                who.push((j, p));
            }
        }
        let on_done = |k: usize, d: &IoDone| {
            let Some(&(j, p)) = who.get(k) else { return };
            let (Some(state), Some(base), Some(&(i, _, _)), Some(bounds)) =
                (progress.get(j), bases.get(j), plan.get(j), bounds.get(j))
            else {
                return;
            };
            let parts = bounds.len() - 1;
            let want = bounds[p + 1] - bounds[p];
            let mut st = state.lock();
            match &d.result {
                Ok(got) if *got == want => st.parts[p] = true,
                Ok(_) => {
                    st.failed.get_or_insert(None);
                    return;
                }
                Err(e) => {
                    st.failed = Some(Some(io::Error::new(e.kind(), e.to_string())));
                    return;
                }
            }
            let mut run = st.run;
            while run < parts && st.parts[run] {
                run += 1;
            }
            if run == st.run {
                return;
            }
            let (from, to) = (bounds[st.run], bounds[run]);
            // SAFETY: parts 0..run of this block have landed; no read
            // writes them any more, and the buffer outlives the batch.
            let bytes = unsafe { std::slice::from_raw_parts(at(*base, 0).as_ptr(), to) };
            st.run = run;
            drop(st);
            landed(i, from..to, bytes);
            // Summed after the hand-over, so the forward pass waits for no
            // checksum and the bytes are summed while the hand-over left
            // them in cache, which brings an uncoded prefix's
            // concurrency-1 TTFT forward (docs/decisions.md).
            let payload = payload(j);
            state.lock().sum_to(run, |p| {
                let range = bounds[p].max(payload.start)..bounds[p + 1].min(payload.end);
                if range.start >= range.end {
                    return &[];
                }
                // SAFETY: part `p` has landed (it is before a run's end);
                // no read writes it any more, and the buffer outlives the
                // batch.
                unsafe { std::slice::from_raw_parts(at(*base, range.start).as_ptr(), range.len()) }
            });
        };
        let t = Instant::now();
        // The callback saw every part it needed; the ops' buffers are raw
        // targets inside `bufs`, which come back below.
        // Every block's first part alone, as a first wave, then the rest a
        // window at a time (`in_flight_after_the_first_wave`). With all of
        // them in flight at once the device shares its bandwidth among
        // them, and the first parts, the ones a layer-wise restore waits on
        // before it can compute anything, landed with the last, several
        // times later than alone. Each first part is handed over after at
        // most a wave's worth of the rest (the next layer's parts) went
        // into the kernel, and the window's other reads follow: the
        // hand-over wakes the forward pass, which may take this thread's
        // CPU until its next layer is due, so that layer's reads are in
        // already; the whole window first made the first layer wait for
        // its submission (`kvtier-io`'s `Order::SubmitFirst`).
        let largest = bounds
            .iter()
            .flat_map(|b| b.windows(2).map(|w| w[1] - w[0]))
            .max()
            .unwrap_or(1);
        let in_flight = in_flight_after_the_first_wave(self.in_flight, largest, n);
        drop(
            self.engine
                .run_waves_map(ops, n, in_flight, submitted, on_done),
        );
        self.metrics.read_seconds.observe(t.elapsed().as_secs_f64());
        let outcomes = plan
            .iter()
            .zip(progress)
            .zip(bufs.iter().zip(&bounds))
            .map(|((&(_, key, _), state), (buf, bounds))| {
                let st = state.into_inner();
                let end = bounds.last().copied().unwrap_or(0);
                match st.failed {
                    Some(Some(e)) => failed(&e),
                    Some(None) => refused(BlockError::TooShort {
                        needed: end,
                        got: bounds[st.run],
                    }),
                    None if st.summed < bounds.len() - 1 => {
                        failed(&io::Error::other("a part of the read did not complete"))
                    }
                    // Only what was read: a block longer than asked for
                    // (a whole one where a short one was) is too short.
                    None => match self.spec.verify_summed(
                        buf.get(..end).unwrap_or(buf),
                        &key,
                        Some(st.crc),
                    ) {
                        Ok(_) => ReadOutcome::Hit(()),
                        Err(e) => refused(e),
                    },
                }
            })
            .collect();
        // A short block's read ends with it, short of its slot.
        self.settle_reads(
            &plan,
            outcomes,
            |j| bounds.get(j).and_then(|b| b.last().copied()).unwrap_or(0),
            bufs.into_iter().map(Some).collect(),
            &mut out,
        );
        let reads: Vec<DiskRead> = out.into_iter().flatten().collect();
        Self::in_key_order(keys, reads)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_handed_over_out_of_order_are_summed_in_order() {
        let payload: Vec<u8> = (0..40_000u32).map(|i| (i * 7 + i / 251) as u8).collect();
        let bounds = [0, 4096, 12_288, 20_000, 40_000];
        let part = |p: usize| &payload[bounds[p]..bounds[p + 1]];
        let mut st = Landed {
            parts: vec![true; 4],
            run: 4,
            summed: 0,
            crc: 0,
            failed: None,
        };
        // The run 2..3 handed over (on another thread) before 0..2: its
        // thread sums 0..3.
        st.sum_to(3, part);
        assert_eq!(st.summed, 3);
        assert_eq!(st.crc, crc32c::crc32c(&payload[..20_000]));
        st.sum_to(2, part);
        assert_eq!(st.summed, 3, "already summed: nothing again");
        st.sum_to(4, part);
        assert_eq!(st.crc, crc32c::crc32c(&payload));
        st.sum_to(9, part);
        assert_eq!(st.summed, 4, "never past the last part");
    }

    #[test]
    fn the_window_holds_a_few_megabytes_of_parts_and_at_least_a_layer() {
        // int8 layers of the `small` preset: all 21 fit.
        assert_eq!(in_flight_after_the_first_wave(64, 136 << 10, 3), 30);
        // Uncoded: 8 parts of 512 KiB, under the configured 64.
        assert_eq!(in_flight_after_the_first_wave(64, 512 << 10, 3), 8);
        // Never more than configured.
        assert_eq!(in_flight_after_the_first_wave(4, 136 << 10, 3), 4);
        // Huge parts: still a part of every block.
        assert_eq!(in_flight_after_the_first_wave(64, 16 << 20, 5), 5);
        assert_eq!(in_flight_after_the_first_wave(0, 0, 0), 1);
    }

    #[test]
    fn a_read_ends_with_its_block_and_keeps_only_cuts_before_that() {
        let slot = 64 << 10;
        let short = ReadCuts {
            at: vec![8192, 12_000, 4096, 16_384, 40_960],
            payload_len: 20_000,
        };
        // 128 + 20,000 bytes end at 20,480; 12,000 is not aligned and 4,096
        // comes after 8,192: both ignored, as is 40,960, past the end.
        assert_eq!(short.end(), 20_480);
        assert_eq!(short.bounds(slot), vec![0, 8192, 16_384, 20_480]);
        let whole = ReadCuts {
            at: vec![32_768],
            payload_len: slot - HEADER_BYTES,
        };
        assert_eq!(whole.bounds(slot), vec![0, 32_768, slot]);
        // Never past a slot.
        let over = ReadCuts {
            at: Vec::new(),
            payload_len: slot,
        };
        assert_eq!(over.bounds(slot), vec![0, slot]);
    }
}
