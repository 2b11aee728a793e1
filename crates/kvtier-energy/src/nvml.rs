//! NVIDIA GPU energy through NVML, loaded at run time.
//!
//! `libnvidia-ml.so.1` ships with the driver, so it is opened with `dlopen`
//! when the meter is probed, never linked. No library, no driver, no device,
//! or no device with an energy counter: the probe answers
//! [`Probe::Unavailable`] with the reason; nothing here panics.
//!
//! The meter reads `nvmlDeviceGetTotalEnergyConsumption`, a 64-bit
//! millijoule counter since the driver was loaded (Volta and newer), so it
//! does not wrap in practice. Devices without the counter (older parts) are
//! skipped and listed in [`NvmlMeter::skipped`]; power sampling for them is
//! not implemented.

use std::ffi::{CStr, c_char, c_int, c_uint, c_ulonglong, c_void};
use std::path::Path;
use std::time::Instant;

use libloading::Library;

use crate::EnergyError;
use crate::meter::{Domain, DomainEnergy, EnergyReading, MeterKind, PowerMeter, Probe};

/// Library names tried by [`NvmlMeter::discover`], in order.
pub const NVML_LIBRARY_NAMES: [&str; 2] = ["libnvidia-ml.so.1", "libnvidia-ml.so"];

type NvmlReturn = c_int;
type NvmlDevice = *mut c_void;
type InitFn = unsafe extern "C" fn() -> NvmlReturn;
type ShutdownFn = unsafe extern "C" fn() -> NvmlReturn;
type CountFn = unsafe extern "C" fn(*mut c_uint) -> NvmlReturn;
type HandleFn = unsafe extern "C" fn(c_uint, *mut NvmlDevice) -> NvmlReturn;
type EnergyFn = unsafe extern "C" fn(NvmlDevice, *mut c_ulonglong) -> NvmlReturn;
type NameFn = unsafe extern "C" fn(NvmlDevice, *mut c_char, c_uint) -> NvmlReturn;
type ErrorStringFn = unsafe extern "C" fn(NvmlReturn) -> *const c_char;

const NVML_SUCCESS: NvmlReturn = 0;

/// An initialised NVML; shut down when dropped.
struct Api {
    shutdown: ShutdownFn,
    total_energy: EnergyFn,
    error_string: Option<ErrorStringFn>,
    // Declared last so it is unloaded after `Drop::drop` has called shutdown.
    _lib: Library,
}

impl Drop for Api {
    fn drop(&mut self) {
        // SAFETY: NVML was initialised when this Api was built, and the
        // library that `shutdown` points into is still loaded.
        unsafe {
            (self.shutdown)();
        }
    }
}

impl Api {
    fn describe(&self, code: NvmlReturn) -> String {
        describe_code(self.error_string, code)
    }

    fn energy_mj(&self, dev: NvmlDevice) -> Result<u64, NvmlReturn> {
        let mut mj: c_ulonglong = 0;
        // SAFETY: `dev` is a handle NVML returned while initialised, and `mj`
        // is a valid out-pointer for the duration of the call.
        let rc = unsafe { (self.total_energy)(dev, &mut mj) };
        if rc == NVML_SUCCESS { Ok(mj) } else { Err(rc) }
    }
}

fn describe_code(error_string: Option<ErrorStringFn>, code: NvmlReturn) -> String {
    let text = error_string.and_then(|f| {
        // SAFETY: nvmlErrorString returns a pointer to a static NUL-terminated
        // string (or null) for any code.
        let p = unsafe { f(code) };
        // SAFETY: checked non-null; NVML's strings are static and NUL-terminated.
        (!p.is_null()).then(|| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
    });
    match text {
        Some(t) => format!("{t} (code {code})"),
        None => format!("code {code}"),
    }
}

/// Copy a function pointer out of the library.
///
/// # Safety
/// `T` must be the symbol's true C signature.
unsafe fn symbol<T: Copy>(lib: &Library, name: &CStr) -> Result<T, String> {
    // SAFETY: forwarded to the caller.
    unsafe { lib.get::<T>(name) }
        .map(|s| *s)
        .map_err(|e| format!("NVML symbol {} missing: {e}", name.to_string_lossy()))
}

#[derive(Debug)]
struct Gpu {
    index: u32,
    name: String,
    handle: NvmlDevice,
    start_mj: u64,
}

/// Energy of NVIDIA GPUs from NVML's counters. Measured.
pub struct NvmlMeter {
    api: Api,
    gpus: Vec<Gpu>,
    skipped: Vec<String>,
    started: Option<Instant>,
}

// SAFETY: NVML is thread-safe (its documentation guarantees all calls may be
// made from any thread), and device handles stay valid until nvmlShutdown,
// which only `Api::drop` calls; the meter is moved, never shared.
unsafe impl Send for NvmlMeter {}

impl std::fmt::Debug for NvmlMeter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NvmlMeter")
            .field("gpus", &self.gpus)
            .field("skipped", &self.skipped)
            .finish_non_exhaustive()
    }
}

impl NvmlMeter {
    /// Probe the system's NVML ([`NVML_LIBRARY_NAMES`]).
    pub fn discover() -> Probe<Self> {
        let mut reasons = Vec::new();
        for name in NVML_LIBRARY_NAMES {
            match Self::with_library(name) {
                Probe::Available(m) => return Probe::Available(m),
                Probe::Unavailable(r) => {
                    // The library loaded but NVML said no: the other name is the
                    // same library, so stop here with its answer.
                    if !r.starts_with("cannot load") {
                        return Probe::Unavailable(r);
                    }
                    reasons.push(r);
                }
            }
        }
        let why = format!("no NVIDIA driver library: {}", reasons.join("; "));
        tracing::debug!(reason = %why, "NVML unavailable");
        Probe::Unavailable(why)
    }

    /// Probe NVML from a given library file or name (tests, odd installs).
    pub fn with_library(library: impl AsRef<Path>) -> Probe<Self> {
        let path = library.as_ref();
        // SAFETY: loading a library runs its initialisers; the caller names the
        // NVIDIA management library (or a path it chose), which has no unsound
        // initialisers.
        let lib = match unsafe { Library::new(path) } {
            Ok(l) => l,
            Err(e) => return Probe::Unavailable(format!("cannot load {}: {e}", path.display())),
        };
        match Self::init(lib) {
            Ok(m) => m,
            Err(r) => Probe::Unavailable(r),
        }
    }

    fn init(lib: Library) -> Result<Probe<Self>, String> {
        // SAFETY (all `symbol` calls): the types are the documented NVML
        // signatures of these functions (nvml.h).
        let init: InitFn = unsafe { symbol(&lib, c"nvmlInit_v2") }?;
        let shutdown: ShutdownFn = unsafe { symbol(&lib, c"nvmlShutdown") }?;
        let count: CountFn = unsafe { symbol(&lib, c"nvmlDeviceGetCount_v2") }?;
        let handle: HandleFn = unsafe { symbol(&lib, c"nvmlDeviceGetHandleByIndex_v2") }?;
        let total_energy: EnergyFn =
            unsafe { symbol(&lib, c"nvmlDeviceGetTotalEnergyConsumption") }?;
        let name_fn: Option<NameFn> = unsafe { symbol(&lib, c"nvmlDeviceGetName") }.ok();
        let error_string: Option<ErrorStringFn> = unsafe { symbol(&lib, c"nvmlErrorString") }.ok();

        // SAFETY: nvmlInit_v2 takes no arguments and may be called at any time.
        let rc = unsafe { init() };
        if rc != NVML_SUCCESS {
            return Err(format!(
                "NVML present but nvmlInit_v2 failed: {} (no driver loaded or no GPU)",
                describe_code(error_string, rc)
            ));
        }
        let api = Api {
            shutdown,
            total_energy,
            error_string,
            _lib: lib,
        };

        let mut n: c_uint = 0;
        // SAFETY: NVML is initialised; `n` is a valid out-pointer.
        let rc = unsafe { count(&mut n) };
        if rc != NVML_SUCCESS {
            return Err(format!(
                "nvmlDeviceGetCount_v2 failed: {}",
                api.describe(rc)
            ));
        }
        let mut gpus = Vec::new();
        let mut skipped = Vec::new();
        for index in 0..n {
            let mut dev: NvmlDevice = std::ptr::null_mut();
            // SAFETY: NVML is initialised, index < count, `dev` is a valid out-pointer.
            let rc = unsafe { handle(index, &mut dev) };
            if rc != NVML_SUCCESS {
                skipped.push(format!("gpu{index}: no handle: {}", api.describe(rc)));
                continue;
            }
            let name = name_fn
                .and_then(|f| device_name(f, dev))
                .unwrap_or_else(|| "NVIDIA GPU".into());
            match api.energy_mj(dev) {
                Ok(mj) => gpus.push(Gpu {
                    index,
                    name,
                    handle: dev,
                    start_mj: mj,
                }),
                Err(rc) => skipped.push(format!(
                    "gpu{index} ({name}): no energy counter: {}",
                    api.describe(rc)
                )),
            }
        }
        if gpus.is_empty() {
            let why = if n == 0 {
                "NVML loaded but reports no NVIDIA device".to_string()
            } else {
                format!("no GPU with an energy counter: {}", skipped.join("; "))
            };
            return Err(why);
        }
        Ok(Probe::Available(NvmlMeter {
            api,
            gpus,
            skipped,
            started: None,
        }))
    }

    /// `gpu0 (NVIDIA H200)`, ... for each metered device.
    pub fn device_names(&self) -> Vec<String> {
        self.gpus
            .iter()
            .map(|g| format!("gpu{} ({})", g.index, g.name))
            .collect()
    }

    /// Devices found but not metered, with why.
    pub fn skipped(&self) -> &[String] {
        &self.skipped
    }

    /// One line for reports.
    pub fn describe(&self) -> String {
        format!("NVML energy counters: {}", self.device_names().join(", "))
    }
}

fn device_name(f: NameFn, dev: NvmlDevice) -> Option<String> {
    let mut buf = [0 as c_char; 96];
    // SAFETY: `dev` is a valid handle; the buffer and its length match.
    let rc = unsafe { f(dev, buf.as_mut_ptr(), buf.len() as c_uint) };
    if rc != NVML_SUCCESS {
        return None;
    }
    // SAFETY: on success NVML wrote a NUL-terminated string into `buf`;
    // the last byte is forced to NUL in case it did not.
    buf[buf.len() - 1] = 0;
    Some(
        unsafe { CStr::from_ptr(buf.as_ptr()) }
            .to_string_lossy()
            .into_owned(),
    )
}

impl PowerMeter for NvmlMeter {
    fn name(&self) -> &str {
        "nvml"
    }

    fn kind(&self) -> MeterKind {
        MeterKind::Measured
    }

    fn start(&mut self) -> Result<(), EnergyError> {
        for g in &mut self.gpus {
            g.start_mj = self
                .api
                .energy_mj(g.handle)
                .map_err(|code| EnergyError::Nvml {
                    call: "nvmlDeviceGetTotalEnergyConsumption",
                    code: code as u32,
                })?;
        }
        self.started = Some(Instant::now());
        Ok(())
    }

    fn read(&mut self) -> Result<EnergyReading, EnergyError> {
        let t0 = self
            .started
            .ok_or_else(|| EnergyError::NotStarted("nvml".into()))?;
        let mut domains = Vec::with_capacity(self.gpus.len());
        for g in &self.gpus {
            let now = self
                .api
                .energy_mj(g.handle)
                .map_err(|code| EnergyError::Nvml {
                    call: "nvmlDeviceGetTotalEnergyConsumption",
                    code: code as u32,
                })?;
            domains.push(DomainEnergy {
                name: format!("gpu{}", g.index),
                domain: Domain::Accelerator,
                source: MeterKind::Measured,
                joules: now.saturating_sub(g.start_mj) as f64 / 1e3,
                counted: true,
            });
        }
        Ok(EnergyReading {
            meter: "nvml".into(),
            kind: MeterKind::Measured,
            elapsed_s: t0.elapsed().as_secs_f64(),
            domains,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_library_is_unavailable_not_error() {
        let p = NvmlMeter::with_library("/nonexistent/libnvidia-ml.so.1");
        let r = p.reason().expect("must be unavailable");
        assert!(r.starts_with("cannot load"), "{r}");
    }

    #[test]
    fn library_without_nvml_symbols_is_unavailable() {
        // libc loads fine but has no nvmlInit_v2.
        let p = NvmlMeter::with_library("libc.so.6");
        let r = p.reason().expect("must be unavailable");
        assert!(r.contains("nvmlInit_v2"), "{r}");
    }

    #[test]
    fn discover_here_answers_without_panicking() {
        match NvmlMeter::discover() {
            Probe::Unavailable(r) => assert!(!r.is_empty()),
            Probe::Available(mut m) => {
                // A machine with a GPU: the counter must work end to end.
                m.start().unwrap();
                let r = m.read().unwrap();
                assert!(r.accel_joules() >= 0.0);
                assert_eq!(r.kind, MeterKind::Measured);
            }
        }
        // Without the driver's control device there can be no NVML meter.
        if !Path::new("/dev/nvidiactl").exists() {
            assert!(!NvmlMeter::discover().is_available());
        }
    }
}
