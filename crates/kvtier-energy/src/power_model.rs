//! A stated power model, for machines without energy counters.
//!
//! ```text
//! host watts  = idle_watts + watts_per_busy_core * busy_cores
//! accel watts = accel_idle_watts * (1 - f) + accel_busy_watts * f
//! ```
//!
//! `busy_cores` comes from `/proc/stat`: the change in busy time
//! (`user + nice + system + irq + softirq + steal`, i.e. total minus `idle`
//! and `iowait`; `guest` is already inside `user` and is not added again)
//! between `start()` and `read()`, in core-seconds. `f` is the accelerator's
//! busy fraction, which only the caller knows: it sets it
//! ([`ModelMeter::set_accel_busy_fraction`]) or reports busy time
//! ([`ModelMeter::add_accel_busy`]).
//!
//! **The constants are assumptions, not measurements.** The defaults describe
//! a small single-socket server with no accelerator: about 40 W at idle
//! (typical of published SPECpower_ssj2008 results for 1-socket servers at
//! active idle, which mostly fall between 30 and 60 W) and about 10 W per
//! busy core (a 150 W-TDP, 16-core part spread over its cores, rounded up).
//! Override them with figures for the machine at hand ([`ModelConstants`]
//! deserialises from the config file). Every reading from this meter is
//! labelled [`MeterKind::Modelled`].

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::EnergyError;
use crate::meter::{Domain, DomainEnergy, EnergyReading, MeterKind, PowerMeter};

/// Where Linux publishes CPU time counters.
pub const DEFAULT_PROC_STAT: &str = "/proc/stat";

/// The model's constants. All watts; all assumptions unless you measured them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ModelConstants {
    /// Whole-machine draw at idle (default 40 W: a small 1-socket server).
    pub idle_watts: f64,
    /// Extra draw per fully busy core (default 10 W).
    pub watts_per_busy_core: f64,
    /// Accelerator draw when idle (default 0 W: no accelerator).
    pub accel_idle_watts: f64,
    /// Accelerator draw when fully busy (default 0 W: no accelerator).
    pub accel_busy_watts: f64,
}

impl Default for ModelConstants {
    fn default() -> Self {
        ModelConstants {
            idle_watts: 40.0,
            watts_per_busy_core: 10.0,
            accel_idle_watts: 0.0,
            accel_busy_watts: 0.0,
        }
    }
}

impl ModelConstants {
    /// Check every constant is finite and not negative.
    pub fn validate(&self) -> Result<(), EnergyError> {
        for (name, v) in [
            ("idle_watts", self.idle_watts),
            ("watts_per_busy_core", self.watts_per_busy_core),
            ("accel_idle_watts", self.accel_idle_watts),
            ("accel_busy_watts", self.accel_busy_watts),
        ] {
            if !v.is_finite() || v < 0.0 {
                return Err(EnergyError::InvalidConfig(format!(
                    "model constant {name} must be a finite number >= 0, got {v}"
                )));
            }
        }
        Ok(())
    }

    /// Whether an accelerator is modelled (either accelerator constant > 0).
    pub fn has_accelerator(&self) -> bool {
        self.accel_idle_watts > 0.0 || self.accel_busy_watts > 0.0
    }

    /// Host watts with `busy_cores` cores busy on average.
    pub fn host_watts(&self, busy_cores: f64) -> f64 {
        self.idle_watts + self.watts_per_busy_core * busy_cores
    }

    /// Accelerator watts at busy fraction `f` (clamped to 0..=1).
    pub fn accel_watts(&self, f: f64) -> f64 {
        let f = clamp_fraction(f);
        self.accel_idle_watts * (1.0 - f) + self.accel_busy_watts * f
    }

    /// The model in one line, for reports.
    pub fn describe(&self) -> String {
        let mut s = format!(
            "modelled: {} W idle + {} W per busy core (from /proc/stat)",
            self.idle_watts, self.watts_per_busy_core
        );
        if self.has_accelerator() {
            s.push_str(&format!(
                " + accelerator {} W idle / {} W busy",
                self.accel_idle_watts, self.accel_busy_watts
            ));
        }
        s.push_str("; assumed constants, not measured");
        s
    }
}

fn clamp_fraction(f: f64) -> f64 {
    if f.is_nan() { 0.0 } else { f.clamp(0.0, 1.0) }
}

/// Aggregate CPU time from the `cpu` line of `/proc/stat`, in clock ticks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CpuTimes {
    /// `user + nice + system + irq + softirq + steal`.
    pub busy_ticks: u64,
    /// `busy_ticks + idle + iowait`.
    pub total_ticks: u64,
}

impl CpuTimes {
    /// Parse the aggregate `cpu` line of `/proc/stat` text.
    pub fn parse(text: &str) -> Result<CpuTimes, String> {
        let line = text
            .lines()
            .find(|l| l.split_whitespace().next() == Some("cpu"))
            .ok_or("no aggregate `cpu` line")?;
        let fields: Vec<u64> = line
            .split_whitespace()
            .skip(1)
            .map(|f| f.parse::<u64>().map_err(|e| format!("field {f:?}: {e}")))
            .collect::<Result<_, _>>()?;
        if fields.len() < 4 {
            return Err(format!(
                "`cpu` line has {} fields, need at least 4",
                fields.len()
            ));
        }
        let get = |i: usize| fields.get(i).copied().unwrap_or(0);
        // user nice system idle iowait irq softirq steal [guest guest_nice]
        let idle = get(3) + get(4);
        let busy = get(0) + get(1) + get(2) + get(5) + get(6) + get(7);
        Ok(CpuTimes {
            busy_ticks: busy,
            total_ticks: busy + idle,
        })
    }

    /// Read and parse a `/proc/stat` file.
    pub fn read(path: &Path) -> Result<CpuTimes, EnergyError> {
        let text = std::fs::read_to_string(path).map_err(|e| EnergyError::io(path, e))?;
        CpuTimes::parse(&text).map_err(|d| EnergyError::parse(path, d))
    }
}

/// Clock ticks per second of `/proc/stat` (`USER_HZ`).
fn clock_ticks() -> f64 {
    // SAFETY: sysconf has no preconditions; it only reads a constant.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if hz > 0 { hz as f64 } else { 100.0 }
}

/// Energy from [`ModelConstants`] and `/proc/stat`. Always modelled.
#[derive(Debug)]
pub struct ModelMeter {
    constants: ModelConstants,
    proc_stat: PathBuf,
    ticks_per_s: f64,
    started: Option<(Instant, CpuTimes)>,
    accel_fraction: Option<f64>,
    accel_busy_s: f64,
}

impl ModelMeter {
    /// A model meter reading `/proc/stat`; fails only on invalid constants.
    pub fn new(constants: ModelConstants) -> Result<Self, EnergyError> {
        constants.validate()?;
        Ok(ModelMeter {
            constants,
            proc_stat: PathBuf::from(DEFAULT_PROC_STAT),
            ticks_per_s: clock_ticks(),
            started: None,
            accel_fraction: None,
            accel_busy_s: 0.0,
        })
    }

    /// Read CPU times from `path` instead of `/proc/stat` (tests).
    pub fn with_proc_stat(mut self, path: impl Into<PathBuf>) -> Self {
        self.proc_stat = path.into();
        self
    }

    /// Override the clock-tick rate of the stat file (tests; default `USER_HZ`).
    pub fn with_clock_ticks(mut self, ticks_per_s: f64) -> Self {
        if ticks_per_s > 0.0 && ticks_per_s.is_finite() {
            self.ticks_per_s = ticks_per_s;
        }
        self
    }

    /// The constants in use.
    pub fn constants(&self) -> &ModelConstants {
        &self.constants
    }

    /// Fix the accelerator's busy fraction (0..=1) for the interval. It wins
    /// over busy time reported with [`ModelMeter::add_accel_busy`] and is kept
    /// across `start()`.
    pub fn set_accel_busy_fraction(&mut self, f: f64) {
        self.accel_fraction = Some(clamp_fraction(f));
    }

    /// Report that the accelerator was busy for `d` during this interval.
    /// The sum is reset by `start()`; the fraction is busy time / elapsed.
    pub fn add_accel_busy(&mut self, d: Duration) {
        self.accel_busy_s += d.as_secs_f64();
    }

    /// The CPU counters now.
    pub fn sample(&self) -> Result<CpuTimes, EnergyError> {
        CpuTimes::read(&self.proc_stat)
    }

    /// The reading the model gives for CPU counters `from` -> `to` over
    /// `elapsed_s` seconds, with the accelerator busy fraction `accel_f`.
    pub fn reading_between(
        &self,
        from: CpuTimes,
        to: CpuTimes,
        elapsed_s: f64,
        accel_f: f64,
    ) -> EnergyReading {
        let c = &self.constants;
        let busy_core_s = to.busy_ticks.saturating_sub(from.busy_ticks) as f64 / self.ticks_per_s;
        let mut domains = vec![
            DomainEnergy {
                name: "host-idle".into(),
                domain: Domain::Platform,
                source: MeterKind::Modelled,
                joules: c.idle_watts * elapsed_s,
                counted: true,
            },
            DomainEnergy {
                name: "cpu-busy".into(),
                domain: Domain::Cpu,
                source: MeterKind::Modelled,
                joules: c.watts_per_busy_core * busy_core_s,
                counted: true,
            },
        ];
        if c.has_accelerator() {
            domains.push(DomainEnergy {
                name: "accelerator".into(),
                domain: Domain::Accelerator,
                source: MeterKind::Modelled,
                joules: c.accel_watts(accel_f) * elapsed_s,
                counted: true,
            });
        }
        EnergyReading {
            meter: "model".into(),
            kind: MeterKind::Modelled,
            elapsed_s,
            domains,
        }
    }
}

impl PowerMeter for ModelMeter {
    fn name(&self) -> &str {
        "model"
    }

    fn kind(&self) -> MeterKind {
        MeterKind::Modelled
    }

    fn start(&mut self) -> Result<(), EnergyError> {
        let t = self.sample()?;
        self.started = Some((Instant::now(), t));
        self.accel_busy_s = 0.0;
        Ok(())
    }

    fn read(&mut self) -> Result<EnergyReading, EnergyError> {
        let (t0, from) = self
            .started
            .ok_or_else(|| EnergyError::NotStarted("model".into()))?;
        let to = self.sample()?;
        let elapsed_s = t0.elapsed().as_secs_f64();
        let f = match self.accel_fraction {
            Some(f) => f,
            None if elapsed_s > 0.0 => self.accel_busy_s / elapsed_s,
            None => 0.0,
        };
        Ok(self.reading_between(from, to, elapsed_s, f))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stat(user: u64, system: u64, idle: u64, iowait: u64, steal: u64, guest: u64) -> String {
        format!(
            "cpu  {user} 0 {system} {idle} {iowait} 0 0 {steal} {guest} 0\n\
             cpu0 1 2 3 4 5 6 7 8 9 10\nintr 12345\nctxt 99\n"
        )
    }

    #[test]
    fn parses_aggregate_cpu_line() {
        let t = CpuTimes::parse(&stat(100, 50, 1000, 20, 5, 30)).unwrap();
        // guest (30) is inside user and not added again.
        assert_eq!(t.busy_ticks, 155);
        assert_eq!(t.total_ticks, 1175);
        assert!(CpuTimes::parse("intr 1\n").is_err());
        assert!(CpuTimes::parse("cpu 1 x 3 4\n").is_err());
        assert!(CpuTimes::parse("cpu 1 2\n").is_err());
        // Old kernels with only four fields.
        assert_eq!(CpuTimes::parse("cpu 1 2 3 4\n").unwrap().busy_ticks, 6);
    }

    #[test]
    fn reading_between_known_deltas() {
        let m = ModelMeter::new(ModelConstants {
            accel_idle_watts: 50.0,
            accel_busy_watts: 300.0,
            ..ModelConstants::default()
        })
        .unwrap()
        .with_clock_ticks(100.0);
        let a = CpuTimes {
            busy_ticks: 1_000,
            total_ticks: 5_000,
        };
        let b = CpuTimes {
            busy_ticks: 1_300,
            total_ticks: 7_000,
        };
        // 10 s, 300 ticks busy = 3 core-seconds:
        // host idle 40 W * 10 s = 400 J; busy 10 W * 3 core-s = 30 J;
        // accel (50 * 0.5 + 300 * 0.5) = 175 W * 10 s = 1750 J. Total 2180 J.
        let r = m.reading_between(a, b, 10.0, 0.5);
        assert_eq!(r.kind, MeterKind::Modelled);
        assert!(r.is_modelled());
        assert!((r.joules(Domain::Platform) - 400.0).abs() < 1e-9);
        assert!((r.cpu_joules() - 30.0).abs() < 1e-9);
        assert!((r.accel_joules() - 1750.0).abs() < 1e-9);
        assert!((r.joules_total() - 2180.0).abs() < 1e-9);
        assert!((r.avg_watts() - 218.0).abs() < 1e-9);
        assert!(r.domains.iter().all(|d| d.source == MeterKind::Modelled));
    }

    #[test]
    fn meter_on_fake_proc_stat_snapshots() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("stat");
        std::fs::write(&path, stat(100, 50, 1000, 20, 0, 0)).unwrap();
        let mut m = ModelMeter::new(ModelConstants::default())
            .unwrap()
            .with_proc_stat(&path)
            .with_clock_ticks(100.0);
        m.start().unwrap();
        // +200 user, +100 system = 300 ticks = 3 busy core-seconds; idle and
        // iowait move too but are not busy. Steal +50 counts as busy: +0.5.
        std::fs::write(&path, stat(300, 150, 1900, 90, 50, 0)).unwrap();
        let r = m.read().unwrap();
        assert_eq!(r.meter, "model");
        assert!((r.cpu_joules() - 35.0).abs() < 1e-9, "{r:?}");
        assert!((r.joules(Domain::Platform) - 40.0 * r.elapsed_s).abs() < 1e-9);
        assert_eq!(r.accel_joules(), 0.0);
        assert!(r.domains.iter().all(|d| d.domain != Domain::Accelerator));
    }

    #[test]
    fn accelerator_busy_time_reported_by_caller() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("stat");
        std::fs::write(&path, stat(0, 0, 0, 0, 0, 0)).unwrap();
        let c = ModelConstants {
            idle_watts: 0.0,
            watts_per_busy_core: 0.0,
            accel_idle_watts: 100.0,
            accel_busy_watts: 400.0,
        };
        let mut m = ModelMeter::new(c).unwrap().with_proc_stat(&path);
        m.start().unwrap();
        std::thread::sleep(Duration::from_millis(20));
        // More busy time than elapsed is clamped to fully busy: 400 W.
        m.add_accel_busy(Duration::from_secs(3600));
        let r = m.read().unwrap();
        assert!(
            (r.accel_joules() - 400.0 * r.elapsed_s).abs() < 1e-9,
            "{r:?}"
        );
        // A fixed fraction wins over reported time: 0.25 -> 175 W.
        m.set_accel_busy_fraction(0.25);
        let r = m.read().unwrap();
        assert!(
            (r.accel_joules() - 175.0 * r.elapsed_s).abs() < 1e-9,
            "{r:?}"
        );
    }

    #[test]
    fn constants_override_from_json() {
        // What a `[energy.model]` TOML table deserialises to; missing keys keep defaults.
        let c: ModelConstants =
            serde_json::from_str(r#"{"idle_watts": 95.5, "accel_busy_watts": 700}"#).unwrap();
        assert_eq!(c.idle_watts, 95.5);
        assert_eq!(c.accel_busy_watts, 700.0);
        assert_eq!(c.watts_per_busy_core, 10.0);
        assert_eq!(c.accel_idle_watts, 0.0);
        assert!(c.has_accelerator());
        assert!(c.describe().contains("assumed"));
        let unknown = serde_json::from_str::<ModelConstants>(r#"{"idle_wats": 1}"#);
        assert!(unknown.is_err(), "unknown keys must be rejected");
    }

    #[test]
    fn invalid_constants_are_rejected() {
        let bad = ModelConstants {
            idle_watts: -1.0,
            ..ModelConstants::default()
        };
        assert!(matches!(
            ModelMeter::new(bad),
            Err(EnergyError::InvalidConfig(_))
        ));
        let nan = ModelConstants {
            watts_per_busy_core: f64::NAN,
            ..ModelConstants::default()
        };
        assert!(nan.validate().is_err());
    }

    #[test]
    fn unreadable_stat_is_an_error_and_read_needs_start() {
        let tmp = tempfile::tempdir().unwrap();
        let mut m = ModelMeter::new(ModelConstants::default())
            .unwrap()
            .with_proc_stat(tmp.path().join("nope"));
        assert!(matches!(m.read(), Err(EnergyError::NotStarted(_))));
        assert!(matches!(m.start(), Err(EnergyError::Io { .. })));
    }

    #[test]
    fn real_proc_stat_works_here() {
        let mut m = ModelMeter::new(ModelConstants::default()).unwrap();
        m.start().unwrap();
        let r = m.read().unwrap();
        assert!(r.joules_total() >= 0.0);
        assert!(r.elapsed_s >= 0.0);
    }
}
