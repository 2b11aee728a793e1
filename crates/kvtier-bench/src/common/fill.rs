//! Benchmark data that nothing below can compress or dedup away:
//! pseudo-random fills (xorshift64*) and per-page stamps.

use kvtier_io::DIRECT_IO_ALIGN;

/// The xorshift64* state a fill seeded with `seed` starts from (never 0).
pub fn random_state(seed: u64) -> u64 {
    seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1
}

/// Fills `buf` with xorshift64* output (every byte written), continuing
/// from `state` and leaving it where the next fill goes on.
pub fn fill_random(buf: &mut [u8], state: &mut u64) {
    let mut x = *state;
    for w in buf.chunks_mut(8) {
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        let v = x.wrapping_mul(0x2545_f491_4f6c_dd1d).to_le_bytes();
        w.copy_from_slice(&v[..w.len()]);
    }
    *state = x;
}

/// Stamps block `i`'s index into the first 8 bytes of every 4 KiB page of
/// `payload`, so every page of every block differs (nothing below can dedup
/// or compress it away) at the cost of one store per page.
pub fn stamp_pages(payload: &mut [u8], i: u64) {
    let tag = i.to_le_bytes();
    for page in payload.chunks_mut(DIRECT_IO_ALIGN) {
        let n = page.len().min(8);
        page[..n].copy_from_slice(&tag[..n]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stamp_marks_every_page() {
        let mut p = vec![0u8; 3 * 4096 + 5];
        stamp_pages(&mut p, 0x0102);
        for at in [0, 4096, 8192] {
            assert_eq!(&p[at..at + 2], &[2, 1]);
        }
        assert_eq!(&p[12288..], &[2, 1, 0, 0, 0]);
    }

    #[test]
    fn fills_continue_where_they_stopped() {
        let mut whole = vec![0u8; 64];
        let mut s = random_state(7);
        fill_random(&mut whole, &mut s);
        let mut parts = vec![0u8; 64];
        let mut s2 = random_state(7);
        let (a, b) = parts.split_at_mut(24);
        fill_random(a, &mut s2);
        fill_random(b, &mut s2);
        assert_eq!(whole, parts);
        assert_eq!(s, s2);
        assert!(whole.iter().filter(|&&b| b == 0).count() < 8);
    }
}
