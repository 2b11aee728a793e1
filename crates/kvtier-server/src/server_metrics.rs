//! Server metrics, registered into the store's registry so that `/metrics`
//! renders store and server series with one function.
//!
//! Series (prefix `kvtier_server_`): `ttft_seconds` and
//! `inter_token_seconds` histograms, `requests_total{endpoint,status}`,
//! `prompt_tokens_total`, `cached_prompt_tokens_total{tier}` (g1/g2/g3),
//! `restored_bytes_total`, `generated_tokens_total`, `requests_in_flight`.

use std::sync::{Arc, Mutex};

use kvtier_engine::CachedTokens;
use kvtier_engine::scheduler::SchedulerSnapshot;
use kvtier_store::{MetricsFormat, StoreMetrics};
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
    pub fn record_prompt(&self, prompt_tokens: usize, cached: CachedTokens, restored: u64) {
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
            CachedTokens {
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

        let own = ServerMetrics::new(None);
        own.generated_tokens.inc();
        assert!(
            own.render(MetricsFormat::Prometheus)
                .contains("kvtier_server_generated_tokens_total 1")
        );
    }
}
