//! A short scheduler slice for the threads a computation waits on.
//!
//! A layer-wise restore hands each layer to the forward pass as it lands
//! (`store/layer_reads.rs`), on the store's reader threads. The forward
//! pass keeps every core busy meanwhile (its threads spin between parts of
//! a step). Linux's EEVDF scheduler runs a woken thread at once only if
//! its virtual deadline is earlier than the running thread's, and with
//! the default slice it usually is not. So a reader woken by a finished
//! read waited until the forward pass blocked on that very layer, and
//! every layer's hand-over (its decode into G1) was added to the time to
//! first token instead of overlapping it: measured on the 2-vCPU
//! reference VM, the forward pass waited 1.0-3.5 ms per restore for layers
//! that had long been read (docs/benchmarks.md, "Readers that run when
//! their read lands").
//!
//! Since Linux 6.12 a thread may ask for a shorter slice (`sched_setattr`'s
//! `sched_runtime` for `SCHED_OTHER`, 0.1 to 100 ms, no privilege needed).
//! A short slice gives the thread an earlier deadline each time it wakes,
//! so it runs as soon as its read lands, for the short while a hand-over
//! takes. Its share of the CPU is unchanged (that is its weight, its nice
//! value, which this keeps). Older kernels ignore the request.
//!
//! Hand-written against the raw system call: the `libc` crate has the
//! struct and the call's number but no wrapper, and nothing else here
//! needs a scheduling crate.

use std::time::Duration;

/// The slice the store's reader threads ask for: the kernel's least.
pub(crate) const READER_SLICE: Duration = Duration::from_micros(100);

/// Asks the kernel to give the calling thread `slice` as its scheduler
/// slice, keeping its policy and nice value. Returns whether the kernel
/// took the request: false for a thread that is not `SCHED_OTHER` (a
/// real-time or idle thread is left as it is), and off Linux.
pub(crate) fn ask_for_slice(slice: Duration) -> std::io::Result<bool> {
    #[cfg(target_os = "linux")]
    {
        let size = std::mem::size_of::<libc::sched_attr>();
        let mut attr = libc::sched_attr {
            size: size as u32,
            sched_policy: 0,
            sched_flags: 0,
            sched_nice: 0,
            sched_priority: 0,
            sched_runtime: 0,
            sched_deadline: 0,
            sched_period: 0,
        };
        // SAFETY: `attr` is a valid, writable `sched_attr` of `size`
        // bytes; pid 0 is the calling thread.
        let r = unsafe {
            libc::syscall(
                libc::SYS_sched_getattr,
                0,
                &mut attr as *mut libc::sched_attr,
                size as libc::c_uint,
                0,
            )
        };
        if r != 0 {
            return Err(std::io::Error::last_os_error());
        }
        if attr.sched_policy != libc::SCHED_OTHER as u32 {
            return Ok(false);
        }
        attr.size = size as u32;
        attr.sched_flags = 0;
        attr.sched_runtime = u64::try_from(slice.as_nanos()).unwrap_or(u64::MAX);
        // SAFETY: as above; the kernel only reads `attr`.
        let r = unsafe {
            libc::syscall(
                libc::SYS_sched_setattr,
                0,
                &attr as *const libc::sched_attr,
                0,
            )
        };
        if r != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(true)
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = slice;
        Ok(false)
    }
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;

    fn attr() -> libc::sched_attr {
        let size = std::mem::size_of::<libc::sched_attr>();
        let mut a = libc::sched_attr {
            size: size as u32,
            sched_policy: 0,
            sched_flags: 0,
            sched_nice: 0,
            sched_priority: 0,
            sched_runtime: 0,
            sched_deadline: 0,
            sched_period: 0,
        };
        // SAFETY: as in `ask_for_slice`.
        let r = unsafe {
            libc::syscall(
                libc::SYS_sched_getattr,
                0,
                &mut a as *mut libc::sched_attr,
                size as libc::c_uint,
                0,
            )
        };
        assert_eq!(r, 0, "{}", std::io::Error::last_os_error());
        a
    }

    /// The kernel's release as (major, minor), e.g. (6, 18).
    fn kernel() -> (u32, u32) {
        let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
        let mut parts = release.trim().split(['.', '-']);
        let mut next = || parts.next().and_then(|p| p.parse().ok()).unwrap_or(0);
        (next(), next())
    }

    #[test]
    fn a_thread_gets_the_slice_and_keeps_its_nice_value() {
        std::thread::spawn(|| {
            // A thread may always lower its own priority.
            // SAFETY: plain system calls on the calling thread.
            let tid = unsafe { libc::syscall(libc::SYS_gettid) } as libc::id_t;
            let r = unsafe { libc::setpriority(libc::PRIO_PROCESS, tid, 3) };
            assert_eq!(r, 0, "{}", std::io::Error::last_os_error());
            let took = ask_for_slice(READER_SLICE).expect("sched_setattr");
            assert!(took, "a SCHED_OTHER thread");
            let a = attr();
            assert_eq!(a.sched_policy, libc::SCHED_OTHER as u32);
            assert_eq!(a.sched_nice, 3, "the nice value is kept");
            if kernel() >= (6, 12) {
                assert_eq!(a.sched_runtime, 100_000, "the slice reads back");
            }
        })
        .join()
        .expect("the thread");
    }
}
