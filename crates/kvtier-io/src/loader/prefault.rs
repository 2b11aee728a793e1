//! Faulting a load's fresh destination memory in while the reads run.
//!
//! A cold load reads into newly allocated memory. With `O_DIRECT` the kernel
//! pins each read's destination pages when the read is submitted, faulting
//! in any that are missing on the submitting thread: faulting and reading
//! then take turns instead of overlapping. Here [`THREADS`] helper threads
//! fault the destination in ahead of the reads, while they run
//! (docs/decisions.md).
//!
//! `madvise(MADV_POPULATE_WRITE)` (Linux 5.14+) faults pages in as a write
//! would, without writing: it never changes bytes, so it is safe while
//! reads land in the same memory. Pages already present (a warm buffer,
//! pinned host memory) cost a page-table walk. A kernel without it (EINVAL)
//! turns this into a no-op, logged at debug level.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

/// Bytes populated per `madvise` call: the granularity at which the helpers
/// share the work and notice that the reads are done.
const STEP: usize = 4 << 20;

/// Helper threads per load. Each fault in fresh memory can wait on the
/// hypervisor for a page (the reference VM's balloon takes freed RAM back),
/// so several faults in flight get pages faster even on 2 vCPUs: four
/// threads populated a fresh mapping several times faster than one
/// (`kvtier-lab first_touch` measures it; docs/decisions.md). The threads
/// mostly wait, so more of them than cores is fine.
pub(crate) const THREADS: usize = 4;

/// A memory range to fault in: start address and length.
pub(crate) type Range = (usize, usize);

/// The work for the helpers: `ranges` cut into `STEP`-byte pieces, in
/// order, starting `skip` bytes in (the reads submitted first fault their
/// own pages, and two threads faulting the same pages only contend), and a
/// cursor the helpers take pieces from.
pub(crate) struct Work {
    steps: Vec<Range>,
    next: AtomicUsize,
}

impl Work {
    /// Plans the pieces of `ranges` past the first `skip` bytes.
    pub(crate) fn new(ranges: &[Range], skip: usize) -> Work {
        let mut steps = Vec::new();
        let mut skip = skip;
        for &(addr, len) in ranges {
            let mut off = skip.min(len);
            skip -= off;
            while off < len {
                let n = STEP.min(len - off);
                steps.push((addr + off, n));
                off += n;
            }
        }
        Work {
            steps,
            next: AtomicUsize::new(0),
        }
    }

    /// Faults pieces in, taking the next one not yet taken, until none is
    /// left or `stop` is set. Any number of threads may run this at once.
    ///
    /// The caller keeps every range mapped until this returns; this only
    /// issues `madvise` on the addresses and creates no reference to the
    /// memory.
    pub(crate) fn populate(&self, stop: &AtomicBool) {
        while !stop.load(Ordering::Relaxed) {
            let Some(&(addr, n)) = self.steps.get(self.next.fetch_add(1, Ordering::Relaxed)) else {
                return;
            };
            // SAFETY: `[addr, addr + n)` lies inside a live allocation of
            // the caller's (see above). MADV_POPULATE_WRITE faults pages in
            // without changing their contents.
            let rc =
                unsafe { libc::madvise(addr as *mut libc::c_void, n, libc::MADV_POPULATE_WRITE) };
            if rc != 0 {
                let e = std::io::Error::last_os_error();
                tracing::debug!("prefault stopped: madvise(MADV_POPULATE_WRITE): {e}");
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::buffer::AlignedBuf;

    #[test]
    fn the_work_is_every_byte_past_the_skip_in_order_in_steps() {
        let ranges = [(1 << 30, 2 * STEP + 4096), (3 << 30, STEP)];
        let steps = |skip| Work::new(&ranges, skip).steps;
        assert_eq!(
            steps(0),
            [
                (1 << 30, STEP),
                ((1 << 30) + STEP, STEP),
                ((1 << 30) + 2 * STEP, 4096),
                (3 << 30, STEP)
            ]
        );
        assert_eq!(
            steps(STEP + 8192),
            [((1 << 30) + STEP + 8192, STEP - 4096), (3 << 30, STEP)]
        );
        assert_eq!(steps(2 * STEP + 4096), [(3 << 30, STEP)]);
        assert!(steps(3 * STEP + 4096).is_empty());
        assert!(steps(usize::MAX).is_empty());
    }

    #[test]
    fn populating_keeps_the_bytes_and_stops_when_told() {
        let mut buf = AlignedBuf::zeroed(3 * STEP + 4096, 4096).unwrap();
        buf[..4096].fill(7);
        let range = (buf.as_ptr() as usize, buf.capacity());
        let half = (range.0 + range.1 / 2, range.1 / 2);
        for skip in [0, STEP, range.1 + 4096] {
            let work = Work::new(&[range, half], skip);
            std::thread::scope(|s| {
                for _ in 0..THREADS {
                    s.spawn(|| work.populate(&AtomicBool::new(false)));
                }
            });
            assert!(work.next.load(Ordering::Relaxed) >= work.steps.len());
        }
        assert!(buf[..4096].iter().all(|&b| b == 7));
        assert!(buf[4096..].iter().all(|&b| b == 0));
        // Stopped before the first step: returns at once, touches nothing.
        let work = Work::new(&[range], 0);
        work.populate(&AtomicBool::new(true));
        assert_eq!(work.next.load(Ordering::Relaxed), 0);
        assert!(buf[..4096].iter().all(|&b| b == 7));
    }
}
