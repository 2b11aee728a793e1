//! kvtier-energy: how many joules a workload used, and what it cost.
//!
//! - [`PowerMeter`]: `start()`, run the workload, `read()` an
//!   [`EnergyReading`] (joules per domain since start, elapsed seconds).
//! - [`RaplMeter`]: CPU package and DRAM counters from Linux powercap
//!   (measured, wrap-around handled).
//! - [`NvmlMeter`]: NVIDIA GPU energy counters through NVML loaded at run
//!   time (measured; no driver = unavailable, not an error).
//! - [`ModelMeter`]: a stated model from `/proc/stat` and documented,
//!   overridable [`ModelConstants`] (modelled, and labelled so).
//! - [`best_meter`]: the best of these this machine allows, with the reason.
//! - [`CostModel`]: capex over service life + energy x PUE -> USD per hour
//!   and per million tokens.
//!
//! Every reading names its meter and says whether it is measured or
//! modelled ([`MeterKind`]); reports must carry both.

pub mod cost;
pub mod energy_error;
pub mod meter;
pub mod nvml;
pub mod power_model;
pub mod rapl;
pub mod select;

pub use cost::{CostBreakdown, CostModel};
pub use energy_error::EnergyError;
pub use meter::{Domain, DomainEnergy, EnergyReading, MeterKind, PowerMeter, Probe};
pub use nvml::NvmlMeter;
pub use power_model::{CpuTimes, ModelConstants, ModelMeter};
pub use rapl::RaplMeter;
pub use select::{CombinedMeter, MeterChoice, MeterOptions, best_meter};
