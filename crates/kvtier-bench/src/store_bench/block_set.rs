//! The store bench's block set: deterministic keys and payloads, writing
//! them into the disk tier, and reading every block back through it.

use std::sync::Arc;
use std::sync::mpsc::sync_channel;
use std::time::Instant;

use crate::bench_error::{BenchError, Result, StepContext, fail};
use indicatif::ProgressBar;
use kvtier_io::{AlignedBuf, DIRECT_IO_ALIGN, HostAllocator};
use kvtier_store::block::encode_block;
use kvtier_store::disk::{PutOutcome, ReadOutcome};
use kvtier_store::{BlockKey, DiskTier, KvLayout, ModelFingerprint, StoreMetrics};

use crate::common::fill::stamp_pages;
use crate::machine::device_limit::gbps;
use kvtier_io::recycle::RecyclingAllocator;

/// Bytes of encoded blocks handed to one `put_many` call (at most 64 blocks).
const WRITE_BATCH_BYTES: u64 = 128 << 20;
/// Most blocks in one `put_many` call.
const WRITE_BATCH_BLOCKS: u64 = 64;

/// The key of bench block `i`: `b"kvbench1"` then `i` (little-endian).
pub fn bench_key(i: u64) -> BlockKey {
    let mut k = [0u8; 16];
    k[..8].copy_from_slice(b"kvbench1");
    k[8..].copy_from_slice(&i.to_le_bytes());
    BlockKey(k)
}

/// The fingerprint written into every bench block header.
pub fn bench_fingerprint() -> ModelFingerprint {
    ModelFingerprint::of_bytes(b"kvtier store bench")
}

/// Blocks per `put_many` call for `block_bytes` blocks.
pub fn write_batch_blocks(block_bytes: u64) -> u64 {
    (WRITE_BATCH_BYTES / block_bytes).clamp(1, WRITE_BATCH_BLOCKS)
}

/// Writes blocks `0..n` into `disk` and makes them durable. Blocks are
/// encoded on a helper thread while the previous batch is being written.
/// Returns GB/s over the whole phase (encode, write, final fdatasync).
pub fn write_set(disk: &DiskTier, layout: KvLayout, n: u64, progress: &ProgressBar) -> Result<f64> {
    let block_bytes = layout.encoded_bytes();
    let batch = write_batch_blocks(block_bytes);
    let alloc: Arc<dyn HostAllocator> = Arc::new(RecyclingAllocator::new(3 * batch as usize + 2));
    let fingerprint = bench_fingerprint();
    let t = Instant::now();
    std::thread::scope(|s| -> Result<()> {
        let (tx, rx) = sync_channel::<Result<Vec<(BlockKey, Arc<AlignedBuf>)>>>(1);
        let encoder_alloc = alloc.clone();
        s.spawn(move || {
            let mut payload: Vec<u8> = (0..layout.payload_bytes())
                .map(|j| (j % 251) as u8)
                .collect();
            let mut start = 0;
            while start < n {
                let end = (start + batch).min(n);
                let blocks: Result<Vec<_>> = (start..end)
                    .map(|i| {
                        stamp_pages(&mut payload, i);
                        encode_block(
                            bench_key(i),
                            fingerprint,
                            layout,
                            1,
                            &payload,
                            &encoder_alloc,
                        )
                        .map(|b| (bench_key(i), Arc::new(b)))
                        .with_step(|| format!("encoding bench block {i}"))
                    })
                    .collect();
                let failed = blocks.is_err();
                if tx.send(blocks).is_err() || failed {
                    return;
                }
                start = end;
            }
        });
        let result = (|| -> Result<()> {
            for blocks in rx.iter() {
                let blocks = blocks?;
                for (r, (key, _)) in disk.put_many(&blocks).into_iter().zip(&blocks) {
                    match r {
                        Ok(PutOutcome::Written) => {}
                        Ok(PutOutcome::Present) => {
                            fail!("bench block {key} was already present in a fresh directory")
                        }
                        Err(e) => {
                            return Err(e).with_step(|| format!("writing bench block {key}"));
                        }
                    }
                }
                progress.inc(blocks.len() as u64 * block_bytes);
            }
            Ok(())
        })();
        drop(rx);
        result
    })?;
    if disk.len() as u64 != n {
        fail!(
            "the disk tier holds {} blocks after writing {n}",
            disk.len()
        );
    }
    disk.sync().step("syncing the block set")?;
    Ok(gbps(n * block_bytes, t.elapsed().as_secs_f64()))
}

/// Seconds the disk tier has spent inside the I/O engine on reads so far
/// (the `read_seconds` histogram's sum).
pub fn read_io_seconds(metrics: &StoreMetrics) -> f64 {
    let text = metrics.render();
    text.lines()
        .find_map(|l| l.strip_prefix("kvtier_store_read_seconds_sum{tier=\"g3\"} "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0.0)
}

/// One timed pass over the block set.
#[derive(Debug, Clone, Copy)]
pub struct ReadPass {
    /// GB/s of the whole pass.
    pub gbps: f64,
    /// Share of the pass spent inside the I/O engine.
    pub io_time_fraction: f64,
}

/// Reads every block back into a pool of buffers allocated (and touched)
/// once, so no pass pays for fresh memory.
#[derive(Debug)]
pub struct BlockReader {
    pool: Vec<AlignedBuf>,
    block_bytes: usize,
    first_touch_gbps: f64,
}

impl BlockReader {
    /// Allocates and touches `buffers` buffers of `block_bytes`.
    pub fn new(block_bytes: u64, buffers: usize) -> Result<Self> {
        let block_bytes = block_bytes as usize;
        let t = Instant::now();
        let mut pool = Vec::with_capacity(buffers);
        for _ in 0..buffers {
            let mut b = AlignedBuf::zeroed(block_bytes, DIRECT_IO_ALIGN)
                .step("allocating the read buffer pool")?;
            // Zeroing has faulted every page in already; write one byte per
            // page anyway so the pool is resident whatever the allocator.
            for page in b.spare_mut().chunks_mut(DIRECT_IO_ALIGN) {
                page[0] = 1;
            }
            pool.push(b);
        }
        let first_touch_gbps = gbps((buffers * block_bytes) as u64, t.elapsed().as_secs_f64());
        Ok(Self {
            pool,
            block_bytes,
            first_touch_gbps,
        })
    }

    /// GB/s of allocating and first touching the pool.
    pub fn first_touch_gbps(&self) -> f64 {
        self.first_touch_gbps
    }

    /// Reads blocks `0..n` in calls of `chunk` blocks with `in_flight` reads
    /// in flight, verifying each (the store checks both checksums and the
    /// key). Any block that is not a hit fails the pass.
    pub fn read_all(
        &mut self,
        disk: &DiskTier,
        metrics: &StoreMetrics,
        n: u64,
        in_flight: usize,
        chunk: usize,
        progress: &ProgressBar,
    ) -> Result<ReadPass> {
        let chunk = chunk.clamp(1, self.pool.len().max(1));
        let io_before = read_io_seconds(metrics);
        let t = Instant::now();
        let mut start = 0u64;
        let mut hits = 0u64;
        let mut first_error: Option<String> = None;
        while start < n {
            let end = (start + chunk as u64).min(n);
            let mut reqs = Vec::with_capacity((end - start) as usize);
            for i in start..end {
                let buf = self
                    .pool
                    .pop()
                    .ok_or_else(|| BenchError::Failed("read buffer pool exhausted".into()))?;
                reqs.push((bench_key(i), buf));
            }
            for r in disk.read_many_with(reqs, in_flight) {
                match r.outcome {
                    ReadOutcome::Hit(()) => hits += 1,
                    other => {
                        first_error.get_or_insert_with(|| format!("block {}: {other:?}", r.key));
                    }
                }
                let mut buf = r.buf;
                buf.set_len(self.block_bytes);
                self.pool.push(buf);
            }
            progress.inc((end - start) * self.block_bytes as u64);
            start = end;
        }
        let secs = t.elapsed().as_secs_f64();
        let io_secs = read_io_seconds(metrics) - io_before;
        if let Some(e) = first_error {
            fail!(
                "{} of {n} blocks were not read back intact; first: {e}",
                n - hits
            );
        }
        Ok(ReadPass {
            gbps: gbps(n * self.block_bytes as u64, secs),
            io_time_fraction: (io_secs / secs.max(1e-9)).min(1.0),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_distinct_and_stable() {
        assert_ne!(bench_key(0), bench_key(1));
        assert_eq!(bench_key(7), bench_key(7));
        assert_eq!(&bench_key(1).0[..8], b"kvbench1");
    }

    #[test]
    fn batches_stay_near_128_mib() {
        assert_eq!(write_batch_blocks(256 << 10), 64);
        assert_eq!(write_batch_blocks(2 << 20), 64);
        assert_eq!(write_batch_blocks(16 << 20), 8);
        assert_eq!(write_batch_blocks(1 << 30), 1);
    }
}
