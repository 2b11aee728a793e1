//! Server metrics, registered into the store's registry so that `/metrics`
//! renders store and server series with one function.
//!
//! Series (prefix `kvtier_server_`): `ttft_seconds` and
//! `inter_token_seconds` histograms, `requests_total{endpoint,status}`,
//! `prompt_tokens_total`, `cached_prompt_tokens_total{tier}` (g1/g2/g3),
//! `restored_bytes_total`, `generated_tokens_total`, `requests_in_flight`,
//! and `kv_cache_info{...} 1`, what the KV cache tiers are ([`KvCacheInfo`]).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvtier_engine::serving::scheduler::SchedulerSnapshot;
use kvtier_engine::{Engine, TierTokens};
use kvtier_store::eviction::EvictionKind;
use kvtier_store::{MetricsFormat, StoreConfig, StoreMetrics, TieredStore};
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

type Labels = Vec<(&'static str, String)>;

/// Where the metrics live: the store's registry, or the server's own when
/// the engine runs without a store.
#[derive(Debug)]
enum Sink {
    Store(Arc<StoreMetrics>),
    Own(Mutex<Registry>),
}

/// The server's metrics and the registry that renders them with the store's.
#[derive(Debug)]
pub struct ServerMetrics {
    sink: Sink,
    /// Seconds from a request's arrival to its first token.
    pub ttft: Histogram,
    /// Seconds between consecutive tokens of one request.
    pub inter_token: Histogram,
    /// Requests by endpoint and HTTP status.
    pub requests: Family<Labels, Counter>,
    /// Prompt tokens of admitted requests.
    pub prompt_tokens: Counter,
    /// Prompt tokens served from cache, by tier.
    pub cached_prompt_tokens: Family<Labels, Counter>,
    /// KV bytes restored from the store.
    pub restored_bytes: Counter,
    /// Tokens generated.
    pub generated_tokens: Counter,
    /// Generations running now.
    pub in_flight: Gauge,
    /// Requests to the generating endpoints inside the in-flight cap (a
    /// stream until its last event; [`crate::conn_limits`]).
    pub http_in_flight: Gauge,
    /// Seconds from a request's arrival to its last token.
    pub request_seconds: Histogram,
    /// The scheduler's queues, by state (`queued`, `restoring`, `running`).
    pub sequences: Family<Labels, Gauge>,
    /// G1 pages by use (`in_use`, `cached`, `free`).
    pub g1_pages: Family<Labels, Gauge>,
    /// One series at 1 whose labels say what the KV cache tiers are
    /// ([`KvCacheInfo`]).
    pub kv_cache_info: Family<Labels, Gauge>,
}

/// What a running server's KV cache is, tier by tier: everything a model
/// of its caching needs (`kvtier_trace::server_sim::ServerShape` reads it
/// back from `/metrics`), taken from the engine and store as they run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvCacheInfo {
    /// Tokens per G1 page and per store block.
    pub block_tokens: usize,
    /// G1 pages.
    pub g1_pages: usize,
    /// Cached KV is reused (off: every prompt recomputed, no store).
    pub prefix_reuse: bool,
    /// Prefixes are restored layer by layer (which takes their G1 pages
    /// before the store is read).
    pub layerwise_restore: bool,
    /// A store (G2, G3 or G4) sits below G1.
    pub store: bool,
    /// G2's capacity in bytes.
    pub g2_bytes: u64,
    /// Bytes one stored block takes in G2: a whole slot's buffer, a prompt
    /// tail's short block too.
    pub block_bytes: u64,
    /// G3's usable capacity in bytes (its slots).
    pub g3_bytes: u64,
    /// G3's slots (one block each).
    pub g3_slots: u64,
    /// Bytes of one G3 slot.
    pub g3_slot_bytes: u64,
    /// How often blocks only in G2 are written to G3, in milliseconds (0:
    /// only when G2 evicts them and at a clean stop).
    pub g3_sync_ms: u64,
    /// G2's and G3's eviction policy.
    pub eviction: EvictionKind,
    /// The G3 admission filter's window in keys (`None`: off, every block
    /// G2 evicts is written).
    pub admission_window: Option<usize>,
    /// Bytes the write-back queue holds before blocks are dropped.
    pub writeback_max_bytes: u64,
    /// How the store codes KV (`none`, `bf16`, ...).
    pub codec: String,
    /// A G4 pool is attached.
    pub g4: bool,
}

impl KvCacheInfo {
    /// The cache `engine` runs with; `eviction` and `g3_sync` are what its
    /// store was opened with (the store does not say).
    pub fn of(engine: &Engine, eviction: EvictionKind, g3_sync: Duration) -> Self {
        let opts = engine.options();
        let store = engine.store();
        let disk = store.and_then(TieredStore::disk);
        // `Engine::load` leaves these at the store's defaults.
        let defaults = store.map(|s| StoreConfig::new(s.layout(), s.fingerprint()));
        let g3_slots = disk.map_or(0, |d| d.capacity_slots() as u64);
        let g3_slot_bytes = disk.map_or(0, |d| d.slot_bytes() as u64);
        Self {
            block_tokens: opts.block_tokens,
            g1_pages: engine.total_pages(),
            prefix_reuse: opts.prefix_reuse,
            layerwise_restore: opts.layerwise_restore,
            store: store.is_some(),
            g2_bytes: store.map_or(0, |s| s.memory().capacity_bytes()),
            block_bytes: store.map_or(0, |s| s.layout().encoded_bytes()),
            g3_bytes: g3_slots * g3_slot_bytes,
            g3_slots,
            g3_slot_bytes,
            g3_sync_ms: u64::try_from(g3_sync.as_millis()).unwrap_or(u64::MAX),
            eviction,
            admission_window: defaults
                .as_ref()
                .filter(|d| d.admit_on_second_sighting)
                .map(|d| d.admission_window),
            writeback_max_bytes: defaults.map_or(0, |d| d.writeback_max_bytes),
            codec: store
                .map_or("none", |s| s.layout().codec.name())
                .to_string(),
            g4: store.is_some_and(|s| s.remote().is_some()),
        }
    }

    /// The series' labels, in this order.
    pub fn labels(&self) -> Labels {
        let admission = match self.admission_window {
            Some(_) => "second-sighting",
            None => "off",
        };
        vec![
            ("block_tokens", self.block_tokens.to_string()),
            ("g1_pages", self.g1_pages.to_string()),
            ("prefix_reuse", self.prefix_reuse.to_string()),
            ("layerwise_restore", self.layerwise_restore.to_string()),
            ("store", self.store.to_string()),
            ("g2_bytes", self.g2_bytes.to_string()),
            ("block_bytes", self.block_bytes.to_string()),
            ("g3_bytes", self.g3_bytes.to_string()),
            ("g3_slots", self.g3_slots.to_string()),
            ("g3_slot_bytes", self.g3_slot_bytes.to_string()),
            ("g3_sync_ms", self.g3_sync_ms.to_string()),
            ("eviction", self.eviction.to_string()),
            ("admission", admission.to_string()),
            (
                "admission_window",
                self.admission_window.unwrap_or(0).to_string(),
            ),
            ("writeback_max_bytes", self.writeback_max_bytes.to_string()),
            ("codec", self.codec.clone()),
            ("g4", if self.g4 { "on" } else { "none" }.to_string()),
        ]
    }
}

impl ServerMetrics {
    /// Registers the server metrics into `store`'s registry, or into a
    /// registry of their own when there is no store.
    pub fn new(store: Option<Arc<StoreMetrics>>) -> Self {
        let m = Self {
            sink: match store {
                Some(s) => Sink::Store(s),
                None => Sink::Own(Mutex::new(Registry::default())),
            },
            // 1 ms .. ~131 s
            ttft: Histogram::new(exponential_buckets(1e-3, 2.0, 18)),
            // 100 us .. ~52 s
            inter_token: Histogram::new(exponential_buckets(1e-4, 2.0, 19)),
            requests: Family::default(),
            prompt_tokens: Counter::default(),
            cached_prompt_tokens: Family::default(),
            restored_bytes: Counter::default(),
            generated_tokens: Counter::default(),
            in_flight: Gauge::default(),
            http_in_flight: Gauge::default(),
            // 10 ms .. ~328 s
            request_seconds: Histogram::new(exponential_buckets(1e-2, 2.0, 16)),
            sequences: Family::default(),
            g1_pages: Family::default(),
            kv_cache_info: Family::default(),
        };
        let register = |r: &mut Registry| {
            let s = r.sub_registry_with_prefix("kvtier_server");
            s.register(
                "ttft_seconds",
                "Time to first token: request arrival to the first generated token",
                m.ttft.clone(),
            );
            s.register(
                "inter_token_seconds",
                "Time between consecutive generated tokens of one request",
                m.inter_token.clone(),
            );
            s.register(
                "requests",
                "HTTP requests by endpoint and status",
                m.requests.clone(),
            );
            s.register(
                "prompt_tokens",
                "Prompt tokens of admitted requests",
                m.prompt_tokens.clone(),
            );
            s.register(
                "cached_prompt_tokens",
                "Prompt tokens served from the KV cache instead of recomputed, by tier",
                m.cached_prompt_tokens.clone(),
            );
            s.register(
                "restored_bytes",
                "KV bytes restored from the store (G2/G3) into G1",
                m.restored_bytes.clone(),
            );
            s.register(
                "generated_tokens",
                "Tokens generated",
                m.generated_tokens.clone(),
            );
            s.register(
                "requests_in_flight",
                "Generations running now",
                m.in_flight.clone(),
            );
            s.register(
                "http_in_flight",
                "Requests to the generating endpoints being handled now (streams until their \
                 last event), against --max-in-flight",
                m.http_in_flight.clone(),
            );
            s.register(
                "request_seconds",
                "End-to-end latency: request arrival to its last generated token",
                m.request_seconds.clone(),
            );
            s.register(
                "sequences",
                "Sequences in the scheduler by state: queued (not admitted), restoring \
                 (waiting for store reads), running (computing)",
                m.sequences.clone(),
            );
            s.register(
                "g1_pages",
                "G1 (engine KV pool) pages by use: in_use (running sequences), cached \
                 (idle prefixes kept for reuse), free",
                m.g1_pages.clone(),
            );
            s.register(
                "kv_cache_info",
                "The KV cache tiers as the server runs them (G1 pages, G2 and G3 capacities, \
                 block and slot bytes, eviction, admission, write-back): 1, the facts in its labels",
                m.kv_cache_info.clone(),
            );
        };
        match &m.sink {
            Sink::Store(s) => s.with_registry(register),
            Sink::Own(r) => match r.lock() {
                Ok(mut r) => register(&mut r),
                Err(p) => register(&mut p.into_inner()),
            },
        }
        // Every tier shows up from the start, at 0.
        for tier in ["g1", "g2", "g3", "g4"] {
            m.cached_prompt_tokens
                .get_or_create(&vec![("tier", tier.to_string())])
                .inc_by(0);
        }
        m
    }

    /// Counts one finished HTTP request.
    pub fn count_request(&self, endpoint: &str, status: u16) {
        self.requests
            .get_or_create(&vec![
                ("endpoint", endpoint.to_string()),
                ("status", status.to_string()),
            ])
            .inc();
    }

    /// Records an admitted prompt and where its cached part came from.
    pub fn record_prompt(&self, prompt_tokens: usize, cached: TierTokens, restored: u64) {
        self.prompt_tokens.inc_by(prompt_tokens as u64);
        for (tier, n) in [
            ("g1", cached.g1),
            ("g2", cached.g2),
            ("g3", cached.g3),
            ("g4", cached.g4),
        ] {
            self.cached_prompt_tokens
                .get_or_create(&vec![("tier", tier.to_string())])
                .inc_by(n as u64);
        }
        self.restored_bytes.inc_by(restored);
    }

    /// Sets the one `kv_cache_info` series (a server has one cache).
    pub fn set_kv_cache_info(&self, info: &KvCacheInfo) {
        self.kv_cache_info.clear();
        self.kv_cache_info.get_or_create(&info.labels()).set(1);
    }

    /// Copies the scheduler's published queue depths and G1 use into
    /// their gauges (called before each render).
    pub fn observe_scheduler(&self, s: SchedulerSnapshot) {
        let set = |f: &Family<Labels, Gauge>, name: &str, v: usize| {
            f.get_or_create(&vec![("state", name.to_string())])
                .set(i64::try_from(v).unwrap_or(i64::MAX));
        };
        set(&self.sequences, "queued", s.queued);
        set(&self.sequences, "restoring", s.restoring);
        set(&self.sequences, "running", s.running);
        for (name, v) in [
            ("in_use", s.g1_in_use),
            ("cached", s.g1_cached),
            ("free", s.g1_free),
        ] {
            self.g1_pages
                .get_or_create(&vec![("use", name.to_string())])
                .set(i64::try_from(v).unwrap_or(i64::MAX));
        }
    }

    /// Every metric (store and server) in `format`.
    pub fn render(&self, format: MetricsFormat) -> String {
        format.from_openmetrics(self.render_openmetrics())
    }

    /// Every metric (store and server) in OpenMetrics text.
    fn render_openmetrics(&self) -> String {
        match &self.sink {
            Sink::Store(s) => s.render(),
            Sink::Own(r) => {
                let mut out = String::new();
                let res = match r.lock() {
                    Ok(r) => encode(&mut out, &r),
                    Err(p) => encode(&mut out, &p.into_inner()),
                };
                if let Err(e) = res {
                    out.push_str(&format!("# metrics encoding error: {e}\n"));
                }
                out
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn server_series_render_with_the_store_ones() {
        let store = Arc::new(StoreMetrics::new());
        let m = ServerMetrics::new(Some(store.clone()));
        m.ttft.observe(0.01);
        m.count_request("/v1/completions", 200);
        m.record_prompt(
            100,
            TierTokens {
                g1: 16,
                g2: 32,
                g3: 0,
                g4: 8,
            },
            4096,
        );
        let text = m.render(MetricsFormat::OpenMetrics);
        for want in [
            "kvtier_server_ttft_seconds_count 1",
            "kvtier_server_requests_total{endpoint=\"/v1/completions\",status=\"200\"} 1",
            "kvtier_server_cached_prompt_tokens_total{tier=\"g2\"} 32",
            "kvtier_server_cached_prompt_tokens_total{tier=\"g3\"} 0",
            "kvtier_server_cached_prompt_tokens_total{tier=\"g4\"} 8",
            "kvtier_server_prompt_tokens_total 100",
            "kvtier_store_hits_total{tier=\"g2\"}",
        ] {
            assert!(text.contains(want), "{want} missing from\n{text}");
        }
        assert_eq!(text, store.render(), "one registry");

        let info = KvCacheInfo {
            block_tokens: 16,
            g1_pages: 12,
            prefix_reuse: true,
            layerwise_restore: true,
            store: true,
            g2_bytes: 8 * 12288,
            block_bytes: 12288,
            g3_bytes: 20 * 12288,
            g3_slots: 20,
            g3_slot_bytes: 12288,
            g3_sync_ms: 0,
            eviction: EvictionKind::Kvtier,
            admission_window: None,
            writeback_max_bytes: 256 << 20,
            codec: "none".into(),
            g4: false,
        };
        m.set_kv_cache_info(&info);
        m.set_kv_cache_info(&info);
        let text = m.render(MetricsFormat::Prometheus);
        let line = "kvtier_server_kv_cache_info{block_tokens=\"16\",g1_pages=\"12\",\
                    prefix_reuse=\"true\",layerwise_restore=\"true\",store=\"true\",\
                    g2_bytes=\"98304\",block_bytes=\"12288\",g3_bytes=\"245760\",\
                    g3_slots=\"20\",g3_slot_bytes=\"12288\",g3_sync_ms=\"0\",\
                    eviction=\"kvtier\",admission=\"off\",admission_window=\"0\",\
                    writeback_max_bytes=\"268435456\",codec=\"none\",g4=\"none\"} 1";
        assert!(text.contains(line), "{line} missing from\n{text}");
        assert_eq!(
            text.matches("kvtier_server_kv_cache_info{").count(),
            1,
            "one series"
        );

        let own = ServerMetrics::new(None);
        own.generated_tokens.inc();
        assert!(
            own.render(MetricsFormat::Prometheus)
                .contains("kvtier_server_generated_tokens_total 1")
        );
    }
}
