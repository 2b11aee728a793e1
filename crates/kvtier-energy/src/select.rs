//! Picking the best meter this machine allows, and saying why.
//!
//! Host: RAPL when a package/dram counter is readable, else the stated model.
//! Accelerator: NVML when a GPU with an energy counter is found; it is then
//! added to the host meter ([`CombinedMeter`]) and the model's own
//! accelerator constants are set to 0 so the GPU is not counted twice.

use std::path::PathBuf;

use crate::EnergyError;
use crate::meter::{EnergyReading, MeterKind, PowerMeter, Probe};
use crate::nvml::NvmlMeter;
use crate::power_model::{DEFAULT_PROC_STAT, ModelConstants, ModelMeter};
use crate::rapl::{DEFAULT_POWERCAP_ROOT, RaplMeter};

/// What [`best_meter`] may use.
#[derive(Debug, Clone)]
pub struct MeterOptions {
    /// Powercap root (default `/sys/class/powercap`).
    pub powercap_root: PathBuf,
    /// CPU statistics file for the model (default `/proc/stat`).
    pub proc_stat: PathBuf,
    /// Constants for the model meter.
    pub constants: ModelConstants,
    /// Try RAPL (default true; false forces the model for the host).
    pub use_rapl: bool,
    /// Try NVML for GPUs (default true).
    pub use_nvml: bool,
}

impl Default for MeterOptions {
    fn default() -> Self {
        MeterOptions {
            powercap_root: PathBuf::from(DEFAULT_POWERCAP_ROOT),
            proc_stat: PathBuf::from(DEFAULT_PROC_STAT),
            constants: ModelConstants::default(),
            use_rapl: true,
            use_nvml: true,
        }
    }
}

/// The chosen meter and why it was chosen.
pub struct MeterChoice {
    /// The meter, ready for `start()`.
    pub meter: Box<dyn PowerMeter>,
    /// Which sources were used and why the others were not, for reports.
    pub reason: String,
}

impl std::fmt::Debug for MeterChoice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MeterChoice")
            .field("meter", &self.meter.name())
            .field("kind", &self.meter.kind())
            .field("reason", &self.reason)
            .finish()
    }
}

/// The best meter available: RAPL if readable, else the model; plus NVML
/// for GPUs when present. Unavailable sources are reasons, not errors; the
/// only error is invalid model constants.
pub fn best_meter(opts: &MeterOptions) -> Result<MeterChoice, EnergyError> {
    opts.constants.validate()?;
    let nvml = if opts.use_nvml {
        NvmlMeter::discover()
    } else {
        Probe::Unavailable("NVML not tried (disabled)".into())
    };
    let rapl = if opts.use_rapl {
        RaplMeter::with_root(&opts.powercap_root)
    } else {
        Probe::Unavailable("RAPL not tried (disabled)".into())
    };
    choose(opts, rapl, nvml)
}

fn choose(
    opts: &MeterOptions,
    rapl: Probe<RaplMeter>,
    nvml: Probe<NvmlMeter>,
) -> Result<MeterChoice, EnergyError> {
    let mut reasons = Vec::new();
    let has_nvml = nvml.is_available();
    let host: Box<dyn PowerMeter> = match rapl {
        Probe::Available(m) => {
            reasons.push(format!("host measured: {}", m.describe()));
            Box::new(m)
        }
        Probe::Unavailable(why) => {
            let mut c = opts.constants.clone();
            if has_nvml && c.has_accelerator() {
                c.accel_idle_watts = 0.0;
                c.accel_busy_watts = 0.0;
                reasons.push("model accelerator constants ignored: NVML measures the GPU".into());
            }
            reasons.push(format!("host {} (RAPL unavailable: {why})", c.describe()));
            Box::new(ModelMeter::new(c)?.with_proc_stat(&opts.proc_stat))
        }
    };
    let meter: Box<dyn PowerMeter> = match nvml {
        Probe::Available(g) => {
            reasons.push(format!("accelerator measured: {}", g.describe()));
            Box::new(CombinedMeter::new(vec![host, Box::new(g)]))
        }
        Probe::Unavailable(why) => {
            reasons.push(format!("no accelerator meter ({why})"));
            host
        }
    };
    let reason = format!(
        "{} [{}]: {}",
        meter.name(),
        meter.kind(),
        reasons.join("; ")
    );
    tracing::info!(meter = meter.name(), %reason, "energy meter chosen");
    Ok(MeterChoice { meter, reason })
}

/// Several meters over the same interval, their domains side by side
/// (e.g. RAPL for the host and NVML for the GPUs). Modelled if any part is.
pub struct CombinedMeter {
    name: String,
    parts: Vec<Box<dyn PowerMeter>>,
}

impl CombinedMeter {
    /// Combine meters; the name joins theirs with `+`.
    pub fn new(parts: Vec<Box<dyn PowerMeter>>) -> Self {
        let name = parts.iter().map(|p| p.name()).collect::<Vec<_>>().join("+");
        CombinedMeter { name, parts }
    }
}

impl PowerMeter for CombinedMeter {
    fn name(&self) -> &str {
        &self.name
    }

    fn kind(&self) -> MeterKind {
        if self.parts.iter().any(|p| p.kind() == MeterKind::Modelled) {
            MeterKind::Modelled
        } else {
            MeterKind::Measured
        }
    }

    fn start(&mut self) -> Result<(), EnergyError> {
        self.parts.iter_mut().try_for_each(|p| p.start())
    }

    fn read(&mut self) -> Result<EnergyReading, EnergyError> {
        let kind = self.kind();
        let mut out = EnergyReading {
            meter: self.name.clone(),
            kind,
            elapsed_s: 0.0,
            domains: Vec::new(),
        };
        for p in &mut self.parts {
            let r = p.read()?;
            out.elapsed_s = out.elapsed_s.max(r.elapsed_s);
            out.domains.extend(r.domains);
        }
        Ok(out)
    }

    fn poll(&mut self) -> Result<(), EnergyError> {
        self.parts.iter_mut().try_for_each(|p| p.poll())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::meter::Domain;

    fn fake_rapl(root: &std::path::Path) {
        let d = root.join("intel-rapl:0");
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(d.join("name"), "package-0\n").unwrap();
        std::fs::write(d.join("energy_uj"), "0\n").unwrap();
        std::fs::write(d.join("max_energy_range_uj"), "1000000000\n").unwrap();
    }

    fn opts(root: &std::path::Path) -> MeterOptions {
        MeterOptions {
            powercap_root: root.to_path_buf(),
            use_nvml: false,
            ..MeterOptions::default()
        }
    }

    #[test]
    fn picks_rapl_when_readable() {
        let tmp = tempfile::tempdir().unwrap();
        fake_rapl(tmp.path());
        let mut c = best_meter(&opts(tmp.path())).unwrap();
        assert_eq!(c.meter.name(), "rapl");
        assert_eq!(c.meter.kind(), MeterKind::Measured);
        assert!(c.reason.contains("package-0"), "{}", c.reason);
        c.meter.start().unwrap();
        std::fs::write(tmp.path().join("intel-rapl:0/energy_uj"), "2500000\n").unwrap();
        let r = c.meter.read().unwrap();
        assert!((r.joules_total() - 2.5).abs() < 1e-9);
    }

    #[test]
    fn falls_back_to_model_with_reason() {
        let tmp = tempfile::tempdir().unwrap();
        let mut c = best_meter(&opts(tmp.path())).unwrap();
        assert_eq!(c.meter.name(), "model");
        assert_eq!(c.meter.kind(), MeterKind::Modelled);
        assert!(c.reason.contains("RAPL unavailable"), "{}", c.reason);
        assert!(c.reason.contains("modelled"), "{}", c.reason);
        c.meter.start().unwrap();
        let r = c.meter.read().unwrap();
        assert!(r.is_modelled());
        assert_eq!(r.label(), "model (modelled)");
    }

    #[test]
    fn rapl_can_be_disabled() {
        let tmp = tempfile::tempdir().unwrap();
        fake_rapl(tmp.path());
        let o = MeterOptions {
            use_rapl: false,
            ..opts(tmp.path())
        };
        let c = best_meter(&o).unwrap();
        assert_eq!(c.meter.name(), "model");
        assert!(c.reason.contains("disabled"), "{}", c.reason);
    }

    #[test]
    fn invalid_constants_are_an_error() {
        let tmp = tempfile::tempdir().unwrap();
        let mut o = opts(tmp.path());
        o.constants.idle_watts = f64::INFINITY;
        assert!(matches!(best_meter(&o), Err(EnergyError::InvalidConfig(_))));
    }

    #[test]
    fn combined_meter_is_modelled_if_any_part_is() {
        let tmp = tempfile::tempdir().unwrap();
        fake_rapl(tmp.path());
        let rapl = RaplMeter::with_root(tmp.path()).ok().unwrap();
        let model = ModelMeter::new(ModelConstants {
            accel_idle_watts: 10.0,
            ..ModelConstants::default()
        })
        .unwrap();
        let mut m = CombinedMeter::new(vec![Box::new(rapl), Box::new(model)]);
        assert_eq!(m.name(), "rapl+model");
        assert_eq!(m.kind(), MeterKind::Modelled);
        m.start().unwrap();
        std::fs::write(tmp.path().join("intel-rapl:0/energy_uj"), "1000000\n").unwrap();
        PowerMeter::poll(&mut m).unwrap();
        let r = m.read().unwrap();
        assert_eq!(r.meter, "rapl+model");
        let measured: f64 = r
            .domains
            .iter()
            .filter(|d| d.source == MeterKind::Measured)
            .map(|d| d.joules)
            .sum();
        assert!((measured - 1.0).abs() < 1e-9);
        assert!(r.accel_joules() > 0.0 || r.elapsed_s == 0.0);
        assert!(r.joules(Domain::Platform) >= 0.0);
    }

    #[test]
    fn default_options_work_on_this_machine() {
        // Whatever this machine has, a meter comes back and can be read.
        let mut c = best_meter(&MeterOptions::default()).unwrap();
        assert!(!c.reason.is_empty());
        c.meter.start().unwrap();
        assert!(c.meter.read().unwrap().joules_total() >= 0.0);
    }
}
