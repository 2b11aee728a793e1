//! Intel/AMD RAPL energy counters through the Linux powercap interface.
//!
//! Each zone `/sys/class/powercap/intel-rapl:N` (a CPU package) and its
//! sub-zones `intel-rapl:N:M` (`core`, `uncore`, `dram`) expose `name`,
//! `energy_uj` (a monotonically increasing counter in microjoules) and
//! `max_energy_range_uj` (the value at which `energy_uj` wraps to 0).
//!
//! **Wrap-around.** A counter that is lower than at the previous sample has
//! wrapped, and the delta is `now + max_energy_range_uj - last`. Only one wrap
//! per sampling interval can be detected, so samples must come more often
//! than the wrap period, which is `max_energy_range_uj / power`: minutes on
//! most parts (262 kJ at 200 W is about 22 minutes) but as short as about
//! 60 s on some parts at high power. [`RaplMeter::poll`] samples without
//! producing a reading; long runs should call it every few seconds.
//!
//! **Permissions.** Since Linux 5.10 (CVE-2020-8694) `energy_uj` is readable
//! by root only on most distributions; a zone that cannot be read is skipped
//! and, if none is left, discovery answers unavailable with the reason.
//!
//! **What is counted.** `package-*` and `dram` zones are summed.
//! `core`/`uncore` are inside their package, and `psys` (client platforms)
//! contains the packages, so they are listed but not counted; `psys` is
//! counted only when no package zone is readable.
//! `intel-rapl-mmio:*` zones duplicate the package zones and are ignored.

use std::path::{Path, PathBuf};
use std::time::Instant;

use crate::EnergyError;
use crate::meter::{Domain, DomainEnergy, EnergyReading, MeterKind, PowerMeter, Probe};

/// Where the kernel publishes powercap zones.
pub const DEFAULT_POWERCAP_ROOT: &str = "/sys/class/powercap";

const ZONE_PREFIX: &str = "intel-rapl:";

/// One readable RAPL zone and its running total.
#[derive(Debug)]
struct Zone {
    /// Directory name, e.g. `intel-rapl:0:1`.
    id: String,
    /// Contents of `name`, e.g. `package-0`, `dram`.
    name: String,
    energy_path: PathBuf,
    max_range_uj: u64,
    domain: Domain,
    counted: bool,
    last_uj: u64,
    total_uj: u128,
}

/// Energy from RAPL powercap zones. Measured.
#[derive(Debug)]
pub struct RaplMeter {
    root: PathBuf,
    zones: Vec<Zone>,
    skipped: Vec<String>,
    started: Option<Instant>,
}

impl RaplMeter {
    /// Probe the system's powercap tree ([`DEFAULT_POWERCAP_ROOT`]).
    pub fn discover() -> Probe<Self> {
        Self::with_root(DEFAULT_POWERCAP_ROOT)
    }

    /// Probe a powercap tree rooted at `root` (a fake tree in tests).
    pub fn with_root(root: impl AsRef<Path>) -> Probe<Self> {
        let root = root.as_ref().to_path_buf();
        let entries = match std::fs::read_dir(&root) {
            Ok(e) => e,
            Err(e) => {
                return Probe::Unavailable(format!(
                    "no RAPL powercap tree: cannot list {}: {e}",
                    root.display()
                ));
            }
        };
        let mut ids: Vec<(Vec<u32>, String)> = entries
            .filter_map(|e| e.ok())
            .filter_map(|e| e.file_name().into_string().ok())
            .filter_map(|name| zone_index(&name).map(|idx| (idx, name)))
            .collect();
        ids.sort();

        let mut zones = Vec::new();
        let mut skipped = Vec::new();
        for (_, id) in ids {
            match open_zone(&root, &id) {
                Ok(z) => zones.push(z),
                Err(why) => skipped.push(format!("{id}: {why}")),
            }
        }
        if !zones
            .iter()
            .any(|z| z.domain == Domain::Cpu && z.name.starts_with("package"))
        {
            for z in zones.iter_mut().filter(|z| z.name.starts_with("psys")) {
                z.counted = true;
            }
        }
        if !zones.iter().any(|z| z.counted) {
            let why = if zones.is_empty() && skipped.is_empty() {
                format!("no {ZONE_PREFIX}* zones under {}", root.display())
            } else {
                format!(
                    "no readable RAPL package/dram zone under {} (energy_uj is root-only on Linux >= 5.10){}{}",
                    root.display(),
                    if skipped.is_empty() {
                        ""
                    } else {
                        "; skipped: "
                    },
                    skipped.join("; ")
                )
            };
            tracing::debug!(reason = %why, "RAPL unavailable");
            return Probe::Unavailable(why);
        }
        tracing::debug!(
            zones = zones.len(),
            skipped = skipped.len(),
            "RAPL available"
        );
        Probe::Available(RaplMeter {
            root,
            zones,
            skipped,
            started: None,
        })
    }

    /// Names of the readable zones (`package-0`, `dram`, ...), counted or not.
    pub fn domain_names(&self) -> Vec<&str> {
        self.zones.iter().map(|z| z.name.as_str()).collect()
    }

    /// Zones that were found but could not be read, with why.
    pub fn skipped(&self) -> &[String] {
        &self.skipped
    }

    /// One line for reports: where the counters are and which are summed.
    pub fn describe(&self) -> String {
        let counted: Vec<String> = self
            .zones
            .iter()
            .filter(|z| z.counted)
            .map(|z| format!("{} ({})", z.name, z.id))
            .collect();
        format!(
            "RAPL powercap under {}: summing {}",
            self.root.display(),
            counted.join(", ")
        )
    }

    /// Sample every counter and add what it advanced since the last sample,
    /// allowing for one wrap. Call it more often than the wrap period.
    pub fn poll(&mut self) -> Result<(), EnergyError> {
        if self.started.is_none() {
            return Err(EnergyError::NotStarted("rapl".into()));
        }
        for z in &mut self.zones {
            let now = read_u64(&z.energy_path)?;
            z.total_uj += u128::from(counter_delta(z.last_uj, now, z.max_range_uj));
            z.last_uj = now;
        }
        Ok(())
    }
}

/// Microjoules a counter advanced from `last` to `now`, where a lower `now`
/// means it wrapped once at `max_range`.
pub fn counter_delta(last: u64, now: u64, max_range: u64) -> u64 {
    if now >= last {
        now - last
    } else {
        now.saturating_add(max_range.saturating_sub(last))
    }
}

impl PowerMeter for RaplMeter {
    fn name(&self) -> &str {
        "rapl"
    }

    fn kind(&self) -> MeterKind {
        MeterKind::Measured
    }

    fn start(&mut self) -> Result<(), EnergyError> {
        for z in &mut self.zones {
            z.last_uj = read_u64(&z.energy_path)?;
            z.total_uj = 0;
        }
        self.started = Some(Instant::now());
        Ok(())
    }

    fn read(&mut self) -> Result<EnergyReading, EnergyError> {
        RaplMeter::poll(self)?;
        let elapsed_s = self
            .started
            .map(|t| t.elapsed().as_secs_f64())
            .unwrap_or_default();
        Ok(EnergyReading {
            meter: "rapl".into(),
            kind: MeterKind::Measured,
            elapsed_s,
            domains: self
                .zones
                .iter()
                .map(|z| DomainEnergy {
                    name: z.name.clone(),
                    domain: z.domain,
                    source: MeterKind::Measured,
                    joules: z.total_uj as f64 / 1e6,
                    counted: z.counted,
                })
                .collect(),
        })
    }

    fn poll(&mut self) -> Result<(), EnergyError> {
        RaplMeter::poll(self)
    }
}

/// `intel-rapl:0` -> `[0]`, `intel-rapl:0:1` -> `[0, 1]`; anything else -> None.
fn zone_index(dir_name: &str) -> Option<Vec<u32>> {
    let rest = dir_name.strip_prefix(ZONE_PREFIX)?;
    let idx: Option<Vec<u32>> = rest.split(':').map(|p| p.parse().ok()).collect();
    idx.filter(|v| (1..=2).contains(&v.len()))
}

fn open_zone(root: &Path, id: &str) -> Result<Zone, String> {
    let dir = root.join(id);
    let name = std::fs::read_to_string(dir.join("name"))
        .map_err(|e| format!("name: {e}"))?
        .trim()
        .to_string();
    let energy_path = dir.join("energy_uj");
    let last_uj = read_u64(&energy_path).map_err(|e| format!("{name}: {e}"))?;
    let max_range_uj =
        read_u64(&dir.join("max_energy_range_uj")).map_err(|e| format!("{name}: {e}"))?;
    let (domain, counted) = if name.starts_with("package") {
        (Domain::Cpu, true)
    } else if name == "dram" {
        (Domain::Dram, true)
    } else if name == "core" || name == "uncore" {
        (Domain::Cpu, false)
    } else {
        // psys and anything unknown: listed, counted only as a last resort (psys).
        (Domain::Platform, false)
    };
    Ok(Zone {
        id: id.to_string(),
        name,
        energy_path,
        max_range_uj,
        domain,
        counted,
        last_uj,
        total_uj: 0,
    })
}

fn read_u64(path: &Path) -> Result<u64, EnergyError> {
    let text = std::fs::read_to_string(path).map_err(|e| EnergyError::io(path, e))?;
    text.trim()
        .parse()
        .map_err(|e| EnergyError::parse(path, format!("{:?}: {e}", text.trim())))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn zone(root: &Path, id: &str, name: &str, energy: u64, max: u64) {
        let d = root.join(id);
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(d.join("name"), format!("{name}\n")).unwrap();
        std::fs::write(d.join("energy_uj"), format!("{energy}\n")).unwrap();
        std::fs::write(d.join("max_energy_range_uj"), format!("{max}\n")).unwrap();
    }

    fn set_energy(root: &Path, id: &str, energy: u64) {
        std::fs::write(root.join(id).join("energy_uj"), format!("{energy}\n")).unwrap();
    }

    fn available(p: Probe<RaplMeter>) -> RaplMeter {
        match p {
            Probe::Available(m) => m,
            Probe::Unavailable(r) => panic!("expected RAPL available, got: {r}"),
        }
    }

    #[test]
    fn counter_delta_handles_wrap() {
        assert_eq!(counter_delta(100, 150, 1000), 50);
        assert_eq!(counter_delta(100, 10, 1000), 910);
        assert_eq!(counter_delta(1000, 0, 1000), 0);
        assert_eq!(counter_delta(5, 5, 1000), 0);
    }

    #[test]
    fn zone_index_accepts_only_rapl_zones() {
        assert_eq!(zone_index("intel-rapl:0"), Some(vec![0]));
        assert_eq!(zone_index("intel-rapl:1:2"), Some(vec![1, 2]));
        assert_eq!(zone_index("intel-rapl"), None);
        assert_eq!(zone_index("intel-rapl-mmio:0"), None);
        assert_eq!(zone_index("intel-rapl:x"), None);
        assert_eq!(zone_index("intel-rapl:0:1:2"), None);
    }

    #[test]
    fn reads_fake_tree_and_handles_wrap_around() {
        let tmp = tempfile::tempdir().unwrap();
        zone(tmp.path(), "intel-rapl:0", "package-0", 100, 1000);
        let mut m = available(RaplMeter::with_root(tmp.path()));
        m.start().unwrap();
        set_energy(tmp.path(), "intel-rapl:0", 10); // wrapped: 900 + 10
        let r = m.read().unwrap();
        assert_eq!(r.kind, MeterKind::Measured);
        assert_eq!(r.meter, "rapl");
        assert!((r.joules_total() - 910e-6).abs() < 1e-12, "{r:?}");
        assert!((r.cpu_joules() - 910e-6).abs() < 1e-12);
        // A later read keeps accumulating from the wrapped value.
        set_energy(tmp.path(), "intel-rapl:0", 60);
        let r = m.read().unwrap();
        assert!((r.joules_total() - 960e-6).abs() < 1e-12, "{r:?}");
    }

    #[test]
    fn poll_catches_each_wrap_between_reads() {
        let tmp = tempfile::tempdir().unwrap();
        zone(tmp.path(), "intel-rapl:0", "package-0", 900, 1000);
        let mut m = available(RaplMeter::with_root(tmp.path()));
        m.start().unwrap();
        set_energy(tmp.path(), "intel-rapl:0", 800); // +900 (wrap)
        PowerMeter::poll(&mut m).unwrap();
        set_energy(tmp.path(), "intel-rapl:0", 700); // +900 (second wrap)
        let r = m.read().unwrap();
        assert!((r.joules_total() - 1800e-6).abs() < 1e-12, "{r:?}");
    }

    #[test]
    fn sums_packages_and_dram_but_not_subdomains() {
        let tmp = tempfile::tempdir().unwrap();
        let max = 262_143_328_850;
        zone(tmp.path(), "intel-rapl:0", "package-0", 1_000_000, max);
        zone(tmp.path(), "intel-rapl:0:0", "core", 0, max);
        zone(tmp.path(), "intel-rapl:0:1", "dram", 0, max);
        zone(tmp.path(), "intel-rapl:1", "package-1", 0, max);
        zone(tmp.path(), "intel-rapl-mmio:0", "package-0", 0, max); // ignored
        let mut m = available(RaplMeter::with_root(tmp.path()));
        assert_eq!(
            m.domain_names(),
            vec!["package-0", "core", "dram", "package-1"]
        );
        m.start().unwrap();
        set_energy(tmp.path(), "intel-rapl:0", 3_000_000); // +2 J
        set_energy(tmp.path(), "intel-rapl:0:0", 1_500_000); // +1.5 J, inside package-0
        set_energy(tmp.path(), "intel-rapl:0:1", 500_000); // +0.5 J
        set_energy(tmp.path(), "intel-rapl:1", 4_000_000); // +4 J
        set_energy(tmp.path(), "intel-rapl-mmio:0", 9_000_000); // ignored
        let r = m.read().unwrap();
        assert!((r.cpu_joules() - 6.0).abs() < 1e-9, "{r:?}");
        assert!((r.dram_joules() - 0.5).abs() < 1e-9);
        assert!((r.joules_total() - 6.5).abs() < 1e-9);
        let core = r.domains.iter().find(|d| d.name == "core").unwrap();
        assert!(!core.counted);
        assert!((core.joules - 1.5).abs() < 1e-9);
        assert!(m.describe().contains("package-1"));
    }

    #[test]
    fn psys_counts_only_without_a_package() {
        let tmp = tempfile::tempdir().unwrap();
        zone(tmp.path(), "intel-rapl:1", "psys", 0, 1_000_000);
        let mut m = available(RaplMeter::with_root(tmp.path()));
        m.start().unwrap();
        set_energy(tmp.path(), "intel-rapl:1", 250_000);
        let r = m.read().unwrap();
        assert!((r.joules_total() - 0.25).abs() < 1e-9);
        assert!((r.joules(Domain::Platform) - 0.25).abs() < 1e-9);
    }

    #[test]
    fn missing_tree_is_unavailable_with_reason() {
        let tmp = tempfile::tempdir().unwrap();
        let p = RaplMeter::with_root(tmp.path().join("absent"));
        assert!(!p.is_available());
        assert!(
            p.reason().unwrap().contains("cannot list"),
            "{:?}",
            p.reason()
        );

        let p = RaplMeter::with_root(tmp.path()); // exists but empty
        assert!(
            p.reason().unwrap().contains("no intel-rapl:* zones"),
            "{:?}",
            p.reason()
        );
    }

    #[test]
    fn unreadable_zones_are_unavailable_with_reason() {
        let tmp = tempfile::tempdir().unwrap();
        // energy_uj missing (as when the kernel hides it), and one that is a
        // directory (unreadable even for root, unlike a chmod 000 file).
        zone(tmp.path(), "intel-rapl:0", "package-0", 0, 1000);
        std::fs::remove_file(tmp.path().join("intel-rapl:0/energy_uj")).unwrap();
        zone(tmp.path(), "intel-rapl:1", "package-1", 0, 1000);
        let e1 = tmp.path().join("intel-rapl:1/energy_uj");
        std::fs::remove_file(&e1).unwrap();
        std::fs::create_dir(&e1).unwrap();
        let p = RaplMeter::with_root(tmp.path());
        let reason = p.reason().expect("unavailable").to_string();
        assert!(reason.contains("no readable RAPL"), "{reason}");
        assert!(
            reason.contains("intel-rapl:0") && reason.contains("intel-rapl:1"),
            "{reason}"
        );
    }

    #[test]
    fn garbage_counter_skips_zone_but_keeps_others() {
        let tmp = tempfile::tempdir().unwrap();
        zone(tmp.path(), "intel-rapl:0", "package-0", 0, 1000);
        zone(tmp.path(), "intel-rapl:1", "package-1", 0, 1000);
        std::fs::write(tmp.path().join("intel-rapl:1/energy_uj"), "n/a\n").unwrap();
        let m = available(RaplMeter::with_root(tmp.path()));
        assert_eq!(m.domain_names(), vec!["package-0"]);
        assert_eq!(m.skipped().len(), 1);
        assert!(m.skipped()[0].contains("intel-rapl:1"));
    }

    #[test]
    fn read_before_start_is_an_error() {
        let tmp = tempfile::tempdir().unwrap();
        zone(tmp.path(), "intel-rapl:0", "package-0", 0, 1000);
        let mut m = available(RaplMeter::with_root(tmp.path()));
        assert!(matches!(m.read(), Err(EnergyError::NotStarted(_))));
    }

    #[test]
    fn this_machine_answers_without_panicking() {
        // Either way is fine; it must not panic, and unavailability has a reason.
        if let Probe::Unavailable(r) = RaplMeter::discover() {
            assert!(!r.is_empty());
        }
    }
}
