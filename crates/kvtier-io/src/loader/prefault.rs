//! Faulting a load's fresh destination memory in while the reads run.
//!
//! A cold load reads into newly allocated memory. With `O_DIRECT` the kernel
//! pins each read's destination pages when the read is submitted, faulting
//! in any that are missing on the submitting thread: faulting and reading
//! then take turns instead of overlapping. On the reference VM (1.2-1.9 GB/s
//! reads, about 2.4 GB/s first touch) a 4 GiB cold load with the destination
//! faulted in here, on a second thread, ahead of the reads, reached 0.92 of
//! the device limit (docs/benchmarks.md, "Model load").
//!
//! `madvise(MADV_POPULATE_WRITE)` (Linux 5.14+) faults pages in as a write
//! would, without writing: it never changes bytes, so it is safe while
//! reads land in the same memory. Pages already present (a warm buffer,
//! pinned host memory) cost a page-table walk. A kernel without it (EINVAL)
//! turns this into a no-op, logged at debug level.

use std::sync::atomic::{AtomicBool, Ordering};

/// Bytes populated per `madvise` call: the granularity at which the helper
/// notices that the reads are done.
const STEP: usize = 4 << 20;

/// A memory range to fault in: start address and length.
pub(crate) type Range = (usize, usize);

/// Faults `ranges` in, in order, `STEP` bytes at a time, until done or
/// `stop` is set, starting `skip` bytes in: the reads submitted first fault
/// their own pages, and two threads faulting the same pages only contend.
///
/// The caller keeps every range mapped until this returns; this only issues
/// `madvise` on the addresses and creates no reference to the memory.
pub(crate) fn populate(ranges: &[Range], skip: usize, stop: &AtomicBool) {
    let mut skip = skip;
    for &(addr, len) in ranges {
        let mut off = skip.min(len);
        skip -= off;
        while off < len {
            if stop.load(Ordering::Relaxed) {
                return;
            }
            let n = STEP.min(len - off);
            // SAFETY: `[addr + off, addr + off + n)` lies inside a live
            // allocation of the caller's (see above). MADV_POPULATE_WRITE
            // faults pages in without changing their contents.
            let rc = unsafe {
                libc::madvise(
                    (addr + off) as *mut libc::c_void,
                    n,
                    libc::MADV_POPULATE_WRITE,
                )
            };
            if rc != 0 {
                let e = std::io::Error::last_os_error();
                tracing::debug!("prefault stopped: madvise(MADV_POPULATE_WRITE): {e}");
                return;
            }
            off += n;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::buffer::AlignedBuf;

    #[test]
    fn populating_keeps_the_bytes_and_stops_when_told() {
        let mut buf = AlignedBuf::zeroed(3 * STEP + 4096, 4096).unwrap();
        buf[..4096].fill(7);
        let range = (buf.as_ptr() as usize, buf.capacity());
        let half = (range.0 + range.1 / 2, range.1 / 2);
        for skip in [0, STEP, range.1 + 4096] {
            populate(&[range, half], skip, &AtomicBool::new(false));
        }
        assert!(buf[..4096].iter().all(|&b| b == 7));
        assert!(buf[4096..].iter().all(|&b| b == 0));
        // Stopped before the first step: returns at once, touches nothing.
        populate(&[range], 0, &AtomicBool::new(true));
        assert!(buf[..4096].iter().all(|&b| b == 7));
    }
}
