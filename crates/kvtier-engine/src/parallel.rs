//! Splitting the decode step's work over the CPU threads.
//!
//! A decode step has about five parallel parts per layer, each a few
//! hundred microseconds. Handed to rayon, each one woke a sleeping worker
//! (and on a VM a halted virtual CPU) and waited for it: kvtier decoded at
//! 0.78 of llama.cpp's speed at 2 threads through its server, where llama.cpp
//! keeps its workers spinning between operations. candle's barrier pool
//! (`candle_core::utils::barrier_pool`) is that kind of pool: its workers
//! spin for a while after each job before parking, the calling thread works
//! too, and chunks are taken from a shared cursor. This module runs the
//! decode step's parts on it.

use candle_core::utils::barrier_pool;

/// Runs `f(i, chunk)` for every `chunk`-sized piece `i` of `out` (the last
/// may be shorter), spread over the CPU threads; inline with one thread.
pub fn for_each_chunk<F>(out: &mut [f32], chunk: usize, f: F)
where
    F: Fn(usize, &mut [f32]) + Sync,
{
    let chunk = chunk.max(1);
    let pieces = out.len().div_ceil(chunk);
    let pool = barrier_pool();
    if pool.n_workers() == 0 || pieces <= 1 {
        for (i, piece) in out.chunks_mut(chunk).enumerate() {
            f(i, piece);
        }
        return;
    }
    let len = out.len();
    let base = Shared(out.as_mut_ptr());
    pool.execute_chunked(pieces, |range| {
        let base = &base;
        for i in range {
            let start = i * chunk;
            let end = len.min(start + chunk);
            // SAFETY: the pieces `start..end` of distinct `i` are disjoint
            // parts of `out`, which outlives this call (execute_chunked
            // returns only when every piece is done), and each `i` is handed
            // to exactly one thread by the pool's cursor.
            let piece = unsafe { std::slice::from_raw_parts_mut(base.0.add(start), end - start) };
            f(i, piece);
        }
    });
}

/// The output's base pointer, shared with the pool's threads (each writes
/// only its own pieces).
struct Shared(*mut f32);

// SAFETY: see `for_each_chunk`: threads write disjoint pieces only.
unsafe impl Sync for Shared {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_piece_is_visited_once_with_its_index() {
        for (len, chunk) in [(0, 4), (1, 4), (10, 3), (1000, 7), (64, 64)] {
            let mut out = vec![0f32; len];
            for_each_chunk(&mut out, chunk, |i, piece| {
                for (j, v) in piece.iter_mut().enumerate() {
                    *v += (i * chunk + j) as f32 + 1.0;
                }
            });
            for (k, v) in out.iter().enumerate() {
                assert_eq!(*v, k as f32 + 1.0, "{len}/{chunk} at {k}");
            }
        }
    }
}
