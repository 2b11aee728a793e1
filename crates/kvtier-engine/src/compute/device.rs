//! Where the engine's tensors live: `cpu` (the default), or `cuda` /
//! `cuda:N` in a build with the `cuda` cargo feature (candle's CUDA
//! backend; building it needs the CUDA toolkit, see the README). The CPU
//! path is the one the tests run; the CUDA path is the same code on a CUDA
//! device.

use std::sync::atomic::{AtomicBool, Ordering};

use candle_core::Device;

use crate::EngineError;

/// The CUDA stream candle queues `device`'s work on, for loading weights
/// into its memory with `kvtier_io::loader::staged::CudaSink::on_stream`
/// (copies then come before any kernel that reads them); `None` on CPU.
#[cfg(feature = "cuda")]
pub fn cuda_stream(
    device: &Device,
) -> Option<std::sync::Arc<candle_core::cuda_backend::cudarc::driver::CudaStream>> {
    match device {
        Device::Cuda(d) => Some(d.cuda_stream()),
        _ => None,
    }
}

/// Makes `device`'s CUDA context current on the calling thread; nothing to
/// do elsewhere. The CUDA driver keeps one current context per thread, and
/// the engine's tensors are used on threads other than the one that opened
/// the device (the scheduler's; the store's, which decode restored layers
/// into pages): an operation there without it fails with
/// `CUDA_ERROR_INVALID_CONTEXT` (seen on an H200). Cheap when already
/// bound.
pub(crate) fn bind_to_thread(device: &Device) -> Result<(), EngineError> {
    match device {
        #[cfg(feature = "cuda")]
        Device::Cuda(d) => {
            d.cuda_stream()
                .context()
                .bind_to_thread()
                .map_err(|e| EngineError::Device {
                    name: format!("{:?}", device.location()),
                    msg: format!("cannot bind its CUDA context to this thread: {e}"),
                })
        }
        _ => Ok(()),
    }
}

/// Set by [`take_device_paths_on_cpu`].
static DEVICE_PATHS_ON_CPU: AtomicBool = AtomicBool::new(false);

/// Makes the engine take, on the CPU, the code paths it takes on an
/// accelerator (from now on, process-wide; `false` undoes it): the general
/// forward pass for decode steps instead of the host one, additive causal
/// masks and candle's softmax instead of the in-place one, and pages
/// copied, imported and exported through tensor operations instead of
/// straight through host memory.
///
/// A test aid: CI has no GPU, and this is how the code only a GPU runs is
/// checked there, against the CPU's own paths (`tests/device_paths.rs`,
/// a test binary of its own since the switch is global). It does not
/// exercise what only a GPU does (its kernels, streams, contexts).
#[doc(hidden)]
pub fn take_device_paths_on_cpu(on: bool) {
    DEVICE_PATHS_ON_CPU.store(on, Ordering::Relaxed);
}

/// True where the engine uses its host-memory fast paths: on the CPU,
/// unless [`take_device_paths_on_cpu`] said otherwise.
pub(crate) fn host_paths(device: &Device) -> bool {
    device.is_cpu() && !DEVICE_PATHS_ON_CPU.load(Ordering::Relaxed)
}

/// Fixes the engine's CPU thread count for the rest of the process:
/// `threads` when given (`kvtier serve --threads`), else
/// `RAYON_NUM_THREADS` when set, else the count candle picks (the physical
/// cores).
///
/// Both candle's matmuls and the rayon pool read `RAYON_NUM_THREADS`, and
/// candle asks for its thread count at every matmul; unless the variable is
/// set, that counts the physical cores from `/proc/cpuinfo` each time,
/// thousands of reads in one prefill, and the kernel's formatting of that file
/// showed up in a decode step's profile. So the count is written to the
/// variable once, here.
///
/// # Safety
///
/// It changes the process environment, so no other thread may read or
/// write the environment meanwhile: call it first thing in `main`, before
/// any thread starts.
pub unsafe fn fix_cpu_threads(threads: Option<usize>) {
    let n = match threads {
        Some(n) => n.max(1),
        None if std::env::var_os("RAYON_NUM_THREADS").is_some() => return,
        None => candle_core::utils::get_num_threads(),
    };
    // SAFETY: the caller guarantees no other thread touches the
    // environment now.
    unsafe { std::env::set_var("RAYON_NUM_THREADS", n.to_string()) };
}

/// Keeps the memory of freed tensors in the process (glibc's allocator),
/// so the next step reuses it instead of faulting fresh pages in.
///
/// candle allocates every intermediate tensor anew. By default glibc serves
/// blocks of 128 KiB and up (a prefill chunk's activations, its attention
/// scores) with their own `mmap` and gives them back at `free`, and trims the
/// top of its heaps, so each step faults its scratch memory in again: page
/// faults were a good part of a prefill's profile on a VM where first touch is
/// slow. With blocks up to 32 MiB (glibc's most) taken from the heap and the
/// heap never trimmed, prefill ran clearly faster (`kvtier-lab speed` shows
/// it). The cost: memory a step once used stays with the process (a server's
/// steady state). Larger blocks are still mapped per use. A no-op on other C
/// libraries.
pub fn tune_host_allocator() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: mallopt only changes the allocator's parameters; it is
        // thread-safe in glibc, and an out-of-range value is refused (its
        // return value), never undefined behaviour.
        unsafe {
            libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
            libc::mallopt(libc::M_TRIM_THRESHOLD, i32::MAX);
        }
    }
}

/// Opens the device named `cpu`, `cuda` (ordinal 0) or `cuda:N`.
pub fn open_device(name: &str) -> Result<Device, EngineError> {
    let bad = |msg: String| EngineError::Device {
        name: name.to_string(),
        msg,
    };
    if name == "cpu" {
        return Ok(Device::Cpu);
    }
    let ordinal = match name.strip_prefix("cuda") {
        Some("") => 0,
        Some(rest) => rest
            .strip_prefix(':')
            .and_then(|n| n.parse::<usize>().ok())
            .ok_or_else(|| bad("expected cpu, cuda or cuda:N".into()))?,
        None => return Err(bad("expected cpu, cuda or cuda:N".into())),
    };
    if !cfg!(feature = "cuda") {
        return Err(bad(
            "this kvtier was built without the `cuda` cargo feature (cargo build --release --features cuda)"
                .into(),
        ));
    }
    Device::new_cuda(ordinal).map_err(|e| bad(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_and_cpu_opens() {
        assert!(matches!(open_device("cpu"), Ok(Device::Cpu)));
        for bad in ["gpu", "cuda:", "cuda:x", "cuda0", ""] {
            let e = open_device(bad).map(|_| ()).expect_err(bad).to_string();
            assert!(e.contains("expected cpu, cuda or cuda:N"), "{e}");
        }
    }

    #[cfg(not(feature = "cuda"))]
    #[test]
    fn a_cpu_build_says_how_to_get_cuda() {
        let e = open_device("cuda:0")
            .map(|_| ())
            .expect_err("cpu build")
            .to_string();
        assert!(e.contains("--features cuda"), "{e}");
    }
}
