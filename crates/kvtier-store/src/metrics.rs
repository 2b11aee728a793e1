//! Store metrics, per tier, in one Prometheus registry.
//!
//! Every figure a user sees about the store (hits, misses, bytes moved,
//! latency, occupancy, evictions, corrupt blocks, failed puts, I/O mode) is
//! here. [`StoreMetrics::render`] is the one function that turns them into
//! Prometheus text; the server exposes it on `/metrics` and may register its
//! own metrics into the same registry with [`StoreMetrics::with_registry`].

use parking_lot::Mutex;
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
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
            for (tier, m) in [(Tier::G2, &g2), (Tier::G3, &g3), (Tier::G4, &g4)] {
                let r = store.sub_registry_with_label(("tier".into(), tier.name().into()));
                r.register("hits", "Blocks found in the tier", m.hits.clone());
                r.register("misses", "Blocks looked up and not found", m.misses.clone());
                r.register(
                    "read_bytes",
                    "Bytes read from the tier",
                    m.read_bytes.clone(),
                );
                r.register(
                    "written_bytes",
                    "Bytes written to the tier",
                    m.written_bytes.clone(),
                );
                r.register(
                    "evictions",
                    "Blocks evicted to make room",
                    m.evictions.clone(),
                );
                r.register(
                    "corrupt_blocks",
                    "Blocks that failed their checksum; served as misses and deleted",
                    m.corrupt_blocks.clone(),
                );
                r.register(
                    "put_errors",
                    "Failed puts (device full, I/O error)",
                    m.put_errors.clone(),
                );
                r.register("occupancy_bytes", "Bytes held", m.occupancy_bytes.clone());
                r.register(
                    "capacity_bytes",
                    "Bytes the tier may hold",
                    m.capacity_bytes.clone(),
                );
                r.register(
                    "read_seconds",
                    "Latency of one batched read",
                    m.read_seconds.clone(),
                );
                r.register(
                    "write_seconds",
                    "Latency of one batched write",
                    m.write_seconds.clone(),
                );
            }
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

    /// All metrics in Prometheus text exposition format.
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
    }
}
