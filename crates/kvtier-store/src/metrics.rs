//! Store metrics, per tier, in one Prometheus registry.
//!
//! Every figure a user sees about the store (hits, misses, bytes moved,
//! latency, occupancy, evictions, corrupt blocks, failed puts, I/O mode) is
//! here. [`StoreMetrics::render`] is the one function that turns them into
//! Prometheus text; the server exposes it on `/metrics` and may register its
//! own metrics into the same registry with [`StoreMetrics::with_registry`].

use parking_lot::Mutex;
use prometheus_client::encoding::text::encode;
use prometheus_client::encoding::{EncodeMetric, MetricEncoder};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::metrics::{MetricType, TypedMetric};
use prometheus_client::registry::Registry;

/// A tier's name as used in metrics, logs and docs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Tier {
    /// Host DRAM.
    G2,
    /// Local disk or any mounted path.
    G3,
    /// A pool shared by nodes (Redis/Valkey, S3).
    G4,
}

impl Tier {
    /// "g2", "g3" or "g4".
    pub fn name(self) -> &'static str {
        match self {
            Tier::G2 => "g2",
            Tier::G3 => "g3",
            Tier::G4 => "g4",
        }
    }
}

type Labels = Vec<(&'static str, String)>;

/// One metric per tier (G2, G3, G4 in that order), encoded as one family
/// with a `tier` label.
#[derive(Debug, Clone)]
struct PerTier<M>([M; 3]);

impl<M: EncodeMetric + TypedMetric> EncodeMetric for PerTier<M> {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        for (tier, m) in [Tier::G2, Tier::G3, Tier::G4].iter().zip(&self.0) {
            let labels = [("tier", tier.name())];
            m.encode(encoder.encode_family(&labels)?)?;
        }
        Ok(())
    }

    fn metric_type(&self) -> MetricType {
        M::TYPE
    }
}

/// The metrics of one tier. Cloning shares the underlying counters.
#[derive(Debug, Clone)]
pub struct TierMetrics {
    /// Blocks found.
    pub hits: Counter,
    /// Blocks asked for and not found.
    pub misses: Counter,
    /// Bytes read out of the tier.
    pub read_bytes: Counter,
    /// Bytes written into the tier.
    pub written_bytes: Counter,
    /// Blocks written into the tier (whole or short: bytes over a whole
    /// block's size do not count them).
    pub written_blocks: Counter,
    /// Blocks evicted to make room.
    pub evictions: Counter,
    /// Blocks that failed verification (served as misses and deleted).
    pub corrupt_blocks: Counter,
    /// Puts that failed (full device, I/O error).
    pub put_errors: Counter,
    /// Bytes held now.
    pub occupancy_bytes: Gauge,
    /// Bytes the tier may hold.
    pub capacity_bytes: Gauge,
    /// Latency of one batched read, seconds.
    pub read_seconds: Histogram,
    /// Latency of one batched write, seconds.
    pub write_seconds: Histogram,
}

fn latency_histogram() -> Histogram {
    // 10 us .. ~42 s
    Histogram::new(exponential_buckets(1e-5, 2.0, 23))
}

impl Default for TierMetrics {
    fn default() -> Self {
        Self {
            hits: Counter::default(),
            misses: Counter::default(),
            read_bytes: Counter::default(),
            written_bytes: Counter::default(),
            written_blocks: Counter::default(),
            evictions: Counter::default(),
            corrupt_blocks: Counter::default(),
            put_errors: Counter::default(),
            occupancy_bytes: Gauge::default(),
            capacity_bytes: Gauge::default(),
            read_seconds: latency_histogram(),
            write_seconds: latency_histogram(),
        }
    }
}

/// Health of the G4 pool. Cloning shares the underlying counters.
#[derive(Debug, Clone, Default)]
pub struct RemoteMetrics {
    /// 1 while the circuit breaker is open or probing, else 0.
    pub breaker_open: Gauge,
    /// Operations that failed (connection or server error).
    pub errors: Counter,
    /// Operations that ran past their time limit.
    pub timeouts: Counter,
    /// Blocks not written through because the queue was full or the
    /// breaker open.
    pub dropped_puts: Counter,
    /// Bytes of blocks waiting to be written through.
    pub queue_bytes: Gauge,
}

/// All store metrics and the registry that renders them.
#[derive(Debug)]
pub struct StoreMetrics {
    registry: Mutex<Registry>,
    io_mode: Family<Labels, Gauge>,
    /// G2 (host memory) metrics.
    pub g2: TierMetrics,
    /// G3 (disk) metrics.
    pub g3: TierMetrics,
    /// G4 (shared pool) metrics.
    pub g4: TierMetrics,
    /// G4 pool health.
    pub remote: RemoteMetrics,
    /// Blocks waiting to be written back from G2 to G3.
    pub writeback_pending: Gauge,
    /// Blocks evicted from G2 that never reached G3: the write-back queue
    /// was full when a caller that must not wait put them (the engine's
    /// offload, [`TieredStore::offer`](crate::TieredStore::offer)).
    pub writeback_dropped: Counter,
    /// Blocks not written to G3 because the admission filter had seen them
    /// only once.
    pub admission_rejected: Counter,
}

impl Default for StoreMetrics {
    fn default() -> Self {
        Self::new()
    }
}

impl StoreMetrics {
    /// Creates the metrics and registers them under the `kvtier_store` prefix.
    pub fn new() -> Self {
        Self::with_g2(TierMetrics::default())
    }

    /// [`new`](Self::new) with G2 counters shared with other stores (the
    /// stores of one shared G2 budget show the same G2 series).
    pub fn with_g2(g2: TierMetrics) -> Self {
        let mut registry = Registry::default();
        let g3 = TierMetrics::default();
        let g4 = TierMetrics::default();
        let remote = RemoteMetrics::default();
        let io_mode = Family::<Labels, Gauge>::default();
        let writeback_pending = Gauge::default();
        let writeback_dropped = Counter::default();
        let admission_rejected = Counter::default();
        {
            let store = registry.sub_registry_with_prefix("kvtier_store");
            // One family per metric, the tier a label (a strict parser
            // refuses a family name that appears more than once).
            let tiers = [&g2, &g3, &g4];
            let per_tier =
                |get: fn(&TierMetrics) -> &Counter| PerTier(tiers.map(|m| get(m).clone()));
            store.register("hits", "Blocks found in the tier", per_tier(|m| &m.hits));
            store.register(
                "misses",
                "Blocks looked up and not found",
                per_tier(|m| &m.misses),
            );
            store.register(
                "read_bytes",
                "Bytes read from the tier",
                per_tier(|m| &m.read_bytes),
            );
            store.register(
                "written_bytes",
                "Bytes written to the tier",
                per_tier(|m| &m.written_bytes),
            );
            store.register(
                "written_blocks",
                "Blocks written to the tier",
                per_tier(|m| &m.written_blocks),
            );
            store.register(
                "evictions",
                "Blocks evicted to make room",
                per_tier(|m| &m.evictions),
            );
            store.register(
                "corrupt_blocks",
                "Blocks that failed their checksum; served as misses and deleted",
                per_tier(|m| &m.corrupt_blocks),
            );
            store.register(
                "put_errors",
                "Failed puts (device full, I/O error)",
                per_tier(|m| &m.put_errors),
            );
            store.register(
                "occupancy_bytes",
                "Bytes held",
                PerTier(tiers.map(|m| m.occupancy_bytes.clone())),
            );
            store.register(
                "capacity_bytes",
                "Bytes the tier may hold",
                PerTier(tiers.map(|m| m.capacity_bytes.clone())),
            );
            store.register(
                "read_seconds",
                "Latency of one batched read",
                PerTier(tiers.map(|m| m.read_seconds.clone())),
            );
            store.register(
                "write_seconds",
                "Latency of one batched write",
                PerTier(tiers.map(|m| m.write_seconds.clone())),
            );
            store.register(
                "io_mode",
                "I/O mode of a tier: backend (io_uring|threads) and direct (direct|buffered)",
                io_mode.clone(),
            );
            store.register(
                "writeback_pending_blocks",
                "Blocks evicted from G2 and waiting to be written to G3",
                writeback_pending.clone(),
            );
            store.register(
                "writeback_dropped",
                "Blocks evicted from G2 and dropped, not written to G3: the write-back \
                 queue was full when a caller that must not wait put them",
                writeback_dropped.clone(),
            );
            store.register(
                "remote_breaker_open",
                "1 while the G4 circuit breaker is open (G4 skipped: misses, dropped writes)",
                remote.breaker_open.clone(),
            );
            store.register(
                "remote_errors",
                "G4 operations that failed",
                remote.errors.clone(),
            );
            store.register(
                "remote_timeouts",
                "G4 operations that ran past their time limit",
                remote.timeouts.clone(),
            );
            store.register(
                "remote_dropped_puts",
                "Blocks not written through to G4 (queue full or breaker open)",
                remote.dropped_puts.clone(),
            );
            store.register(
                "remote_queue_bytes",
                "Bytes of blocks waiting to be written through to G4",
                remote.queue_bytes.clone(),
            );
            store.register(
                "admission_rejected",
                "Blocks kept out of G3 because they were seen only once",
                admission_rejected.clone(),
            );
        }
        Self {
            registry: Mutex::new(registry),
            io_mode,
            g2,
            g3,
            g4,
            remote,
            writeback_pending,
            writeback_dropped,
            admission_rejected,
        }
    }

    /// The metrics of `tier`.
    pub fn tier(&self, tier: Tier) -> &TierMetrics {
        match tier {
            Tier::G2 => &self.g2,
            Tier::G3 => &self.g3,
            Tier::G4 => &self.g4,
        }
    }

    /// Records the I/O mode a tier runs in (one series set to 1).
    pub fn set_io_mode(&self, tier: Tier, backend: &str, direct: bool) {
        let labels = vec![
            ("tier", tier.name().to_string()),
            ("backend", backend.to_string()),
            (
                "direct",
                if direct { "direct" } else { "buffered" }.to_string(),
            ),
        ];
        self.io_mode.get_or_create(&labels).set(1);
    }

    /// Lets the caller register more metrics (the server's TTFT histograms)
    /// so that one [`render`](Self::render) shows everything.
    pub fn with_registry<R>(&self, f: impl FnOnce(&mut Registry) -> R) -> R {
        f(&mut self.registry.lock())
    }

    /// All metrics in OpenMetrics text (what `prometheus-client` encodes).
    pub fn render(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail; an encoder error would only
        // come from a broken metric, and we would rather show the rest.
        if let Err(e) = encode(&mut out, &self.registry.lock()) {
            out.push_str(&format!("# metrics encoding error: {e}\n"));
        }
        out
    }
}

/// The two text formats `/metrics` speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MetricsFormat {
    /// Prometheus text exposition 0.0.4 (what a scraper gets by default).
    Prometheus,
    /// OpenMetrics 1.0 text (asked for with `Accept: application/openmetrics-text`).
    OpenMetrics,
}

impl MetricsFormat {
    /// The format an HTTP `Accept` header asks for: OpenMetrics when it
    /// names `application/openmetrics-text`, else Prometheus text.
    pub fn from_accept(accept: Option<&str>) -> Self {
        match accept {
            Some(a) if a.contains("application/openmetrics-text") => Self::OpenMetrics,
            _ => Self::Prometheus,
        }
    }

    /// OpenMetrics text (what [`StoreMetrics::render`] gives) in this format.
    pub fn from_openmetrics(self, text: String) -> String {
        match self {
            Self::OpenMetrics => text,
            Self::Prometheus => openmetrics_to_prometheus(&text),
        }
    }

    /// The `Content-Type` of a reply in this format.
    pub fn content_type(self) -> &'static str {
        match self {
            Self::Prometheus => "text/plain; version=0.0.4; charset=utf-8",
            Self::OpenMetrics => "application/openmetrics-text; version=1.0.0; charset=utf-8",
        }
    }
}

/// OpenMetrics text as Prometheus text 0.0.4: no `# EOF` or `# UNIT`
/// lines, a counter's `HELP`/`TYPE` named as its `_total` samples are, and
/// `unknown` spelled `untyped`. Samples are the same lines in both formats
/// (no exemplars or `_created` series are written here).
fn openmetrics_to_prometheus(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut counters = std::collections::HashSet::new();
    for line in text.lines() {
        if line.starts_with("# TYPE ") {
            let mut parts = line.splitn(4, ' ').skip(2);
            if let (Some(name), Some("counter")) = (parts.next(), parts.next()) {
                counters.insert(name.to_string());
            }
        }
    }
    for line in text.lines() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        let meta = ["# HELP ", "# TYPE "]
            .into_iter()
            .find(|p| line.starts_with(p));
        match meta {
            Some(prefix) => {
                let rest = &line[prefix.len()..];
                let (name, tail) = rest.split_once(' ').unwrap_or((rest, ""));
                let total = counters.contains(name) && !name.ends_with("_total");
                out.push_str(prefix);
                out.push_str(name);
                if total {
                    out.push_str("_total");
                }
                out.push(' ');
                out.push_str(if tail == "unknown" { "untyped" } else { tail });
            }
            None => out.push_str(line),
        }
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_per_tier_series_and_io_mode() {
        let m = StoreMetrics::new();
        m.g2.hits.inc_by(3);
        m.g3.read_bytes.inc_by(4096);
        m.g3.read_seconds.observe(0.002);
        m.set_io_mode(Tier::G3, "io_uring", true);
        let text = m.render();
        assert!(
            text.contains("kvtier_store_hits_total{tier=\"g2\"} 3"),
            "{text}"
        );
        assert!(
            text.contains("kvtier_store_read_bytes_total{tier=\"g3\"} 4096"),
            "{text}"
        );
        assert!(
            text.contains("kvtier_store_read_seconds_count{tier=\"g3\"} 1"),
            "{text}"
        );
        assert!(
            text.contains(
                "kvtier_store_io_mode{tier=\"g3\",backend=\"io_uring\",direct=\"direct\"} 1"
            ),
            "{text}"
        );
        assert!(text.ends_with("# EOF\n"));
        // Every family is declared once, its tiers as label values.
        let mut types: Vec<&str> = text.lines().filter(|l| l.starts_with("# TYPE ")).collect();
        let all = types.len();
        types.sort_unstable();
        types.dedup();
        assert_eq!(types.len(), all, "a family declared twice:\n{text}");
        for tier in ["g2", "g3", "g4"] {
            assert!(
                text.contains(&format!("kvtier_store_misses_total{{tier=\"{tier}\"}} 0")),
                "{text}"
            );
        }
    }

    #[test]
    fn prometheus_text_names_counters_by_their_samples_and_has_no_eof() {
        let m = StoreMetrics::new();
        m.g3.hits.inc_by(2);
        let text = MetricsFormat::Prometheus.from_openmetrics(m.render());
        assert!(!text.contains("# EOF"), "{text}");
        assert!(
            text.contains("# TYPE kvtier_store_hits_total counter\n"),
            "{text}"
        );
        assert!(
            text.contains("kvtier_store_hits_total{tier=\"g3\"} 2\n"),
            "{text}"
        );
        assert!(
            text.contains("# TYPE kvtier_store_read_seconds histogram\n"),
            "{text}"
        );
        assert!(
            text.contains("# TYPE kvtier_store_writeback_pending_blocks gauge\n"),
            "{text}"
        );
        assert_eq!(
            MetricsFormat::from_accept(Some("application/openmetrics-text; version=1.0.0")),
            MetricsFormat::OpenMetrics
        );
        assert_eq!(
            MetricsFormat::from_accept(Some("text/plain")),
            MetricsFormat::Prometheus
        );
        assert_eq!(MetricsFormat::from_accept(None), MetricsFormat::Prometheus);
    }
}
