//! The machine's physical memory, for the checks that refuse work that
//! could never fit (a model config implying more weights than RAM).

/// Physical memory of the machine in bytes (0 if unknown).
pub fn memory_bytes() -> u64 {
    // SAFETY: sysconf only reads configuration values.
    let (pages, page) = unsafe {
        (
            libc::sysconf(libc::_SC_PHYS_PAGES),
            libc::sysconf(libc::_SC_PAGESIZE),
        )
    };
    if pages <= 0 || page <= 0 {
        return 0;
    }
    (pages as u64).saturating_mul(page as u64)
}
