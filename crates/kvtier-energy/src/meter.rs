//! The [`PowerMeter`] trait and the [`EnergyReading`] every meter returns.
//!
//! A bench uses any meter the same way:
//!
//! ```no_run
//! # use kvtier_energy::{best_meter, MeterOptions};
//! # fn run_workload() {}
//! let mut meter = best_meter(&MeterOptions::default())?.meter;
//! meter.start()?;
//! run_workload(); // call meter.poll() now and then if it runs for minutes
//! let r = meter.read()?;
//! println!("{:.1} J over {:.2} s ({})", r.joules_total(), r.elapsed_s, r.label());
//! # Ok::<(), kvtier_energy::EnergyError>(())
//! ```

use serde::Serialize;

use crate::EnergyError;

/// Whether a meter's joules come from hardware counters or from a model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum MeterKind {
    /// Read from hardware energy counters (RAPL, NVML).
    Measured,
    /// Computed from a stated power model; every report must say so.
    Modelled,
}

impl MeterKind {
    /// `"measured"` or `"modelled"`.
    pub fn as_str(self) -> &'static str {
        match self {
            MeterKind::Measured => "measured",
            MeterKind::Modelled => "modelled",
        }
    }
}

impl std::fmt::Display for MeterKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The part of the machine a domain's energy belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Domain {
    /// CPU package(s), or the busy-core share of the model.
    Cpu,
    /// DRAM.
    Dram,
    /// An accelerator (GPU, NPU).
    Accelerator,
    /// The rest of the platform: RAPL `psys`, or the model's idle draw.
    Platform,
}

/// Energy of one domain over the interval.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DomainEnergy {
    /// Domain name as the source calls it (`package-0`, `dram`, `gpu0`, `host-idle`).
    pub name: String,
    /// Which part of the machine it is.
    pub domain: Domain,
    /// Measured or modelled.
    pub source: MeterKind,
    /// Joules since `start()`.
    pub joules: f64,
    /// Whether it counts towards the totals. Sub-domains that are already
    /// inside another domain (RAPL `core`/`uncore` inside `package`; `psys`,
    /// which contains the packages) are listed but not counted, so nothing is
    /// counted twice.
    pub counted: bool,
}

/// Energy used between `start()` and `read()`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct EnergyReading {
    /// The meter's name (`rapl`, `nvml`, `model`, `rapl+nvml`, ...).
    pub meter: String,
    /// Measured or modelled. A reading with any modelled domain is modelled.
    pub kind: MeterKind,
    /// Wall-clock seconds since `start()`.
    pub elapsed_s: f64,
    /// Per-domain joules.
    pub domains: Vec<DomainEnergy>,
}

impl EnergyReading {
    /// Joules of all counted domains.
    pub fn joules_total(&self) -> f64 {
        self.domains
            .iter()
            .filter(|d| d.counted)
            .map(|d| d.joules)
            .sum()
    }

    /// Joules of the counted domains of one kind.
    pub fn joules(&self, domain: Domain) -> f64 {
        self.domains
            .iter()
            .filter(|d| d.counted && d.domain == domain)
            .map(|d| d.joules)
            .sum()
    }

    /// CPU package joules (summed over sockets).
    pub fn cpu_joules(&self) -> f64 {
        self.joules(Domain::Cpu)
    }

    /// DRAM joules.
    pub fn dram_joules(&self) -> f64 {
        self.joules(Domain::Dram)
    }

    /// Accelerator joules (summed over devices).
    pub fn accel_joules(&self) -> f64 {
        self.joules(Domain::Accelerator)
    }

    /// Average watts over the interval, or 0 when no time has passed.
    pub fn avg_watts(&self) -> f64 {
        if self.elapsed_s > 0.0 {
            self.joules_total() / self.elapsed_s
        } else {
            0.0
        }
    }

    /// Joules per token, or `None` when `tokens` is 0.
    pub fn joules_per_token(&self, tokens: u64) -> Option<f64> {
        (tokens > 0).then(|| self.joules_total() / tokens as f64)
    }

    /// Whether any of it is modelled.
    pub fn is_modelled(&self) -> bool {
        self.kind == MeterKind::Modelled
    }

    /// A label for reports, e.g. `"rapl (measured)"` or `"model (modelled)"`.
    pub fn label(&self) -> String {
        format!("{} ({})", self.meter, self.kind)
    }
}

/// A source of energy figures.
///
/// `start()` sets the zero; `read()` returns the energy used since then and
/// may be called more than once (each call covers the interval since the last
/// `start()`). Long runs should call [`PowerMeter::poll`] every few seconds so
/// hardware counters that wrap (RAPL) are never missed.
pub trait PowerMeter: Send {
    /// Short name used in reports (`rapl`, `nvml`, `model`).
    fn name(&self) -> &str;
    /// Measured or modelled.
    fn kind(&self) -> MeterKind;
    /// Start (or restart) the interval.
    fn start(&mut self) -> Result<(), EnergyError>;
    /// Energy since `start()`.
    fn read(&mut self) -> Result<EnergyReading, EnergyError>;
    /// Sample the counters without producing a reading, so that wrap-around
    /// is seen. Meters without wrapping counters do nothing.
    fn poll(&mut self) -> Result<(), EnergyError> {
        Ok(())
    }
}

/// Result of probing for a meter: either it works here, or why not.
/// Unavailability is an answer, not an error.
#[derive(Debug)]
pub enum Probe<M> {
    /// The meter can be used.
    Available(M),
    /// The meter cannot be used on this machine; the reason says why.
    Unavailable(String),
}

impl<M> Probe<M> {
    /// The meter, if available.
    pub fn ok(self) -> Option<M> {
        match self {
            Probe::Available(m) => Some(m),
            Probe::Unavailable(_) => None,
        }
    }

    /// The reason, if unavailable.
    pub fn reason(&self) -> Option<&str> {
        match self {
            Probe::Available(_) => None,
            Probe::Unavailable(r) => Some(r),
        }
    }

    /// Whether the meter is available.
    pub fn is_available(&self) -> bool {
        matches!(self, Probe::Available(_))
    }
}
