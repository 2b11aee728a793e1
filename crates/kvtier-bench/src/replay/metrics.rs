//! What the replay reads from a server's `/metrics`: vLLM's own hit
//! counters around a run (vLLM reports a request's cached tokens as one
//! number, with `--enable-prompt-tokens-details`, and only its counters
//! split them into its own prefix cache and a connector's, external,
//! hits), and whether kvtier serve is idle.

use std::time::{Duration, Instant};

use serde::Serialize;

use crate::targets::endpoint::Endpoint;

/// Prompt tokens vLLM found in its own prefix cache and through its KV
/// connector.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Hits {
    /// `vllm:prefix_cache_hits_total`.
    pub local_hit_tokens: f64,
    /// `vllm:external_prefix_cache_hits_total`.
    pub external_hit_tokens: f64,
}

/// The sum over label sets of the samples of `name` in Prometheus text,
/// `None` when the page has none.
fn sample_sum(text: &str, name: &str) -> Option<f64> {
    let mut found = None;
    for line in text.lines() {
        let Some(rest) = line.strip_prefix(name) else {
            continue;
        };
        let value = match rest.chars().next() {
            Some('{') => rest.rsplit_once('}').map(|(_, v)| v),
            Some(' ') => Some(rest),
            _ => None,
        };
        if let Some(v) = value.and_then(|v| v.split_whitespace().next()?.parse::<f64>().ok()) {
            *found.get_or_insert(0.0) += v;
        }
    }
    found
}

/// Longest wait for a server to go idle after an answer.
const IDLE_TIMEOUT: Duration = Duration::from_secs(60);

/// Waits until `kvtier serve` behind `endpoint` runs no sequence and has
/// no block waiting to be written back (`kvtier_server_sequences` and
/// `kvtier_store_writeback_pending_blocks` at 0), so the next request
/// finds the tiers as a sequential replay means it to (what
/// [`kvtier_trace::server_sim`] assumes). Returns at once for a server
/// without those gauges, and after [`IDLE_TIMEOUT`] in any case.
pub fn wait_idle(endpoint: &Endpoint) {
    let until = Instant::now() + IDLE_TIMEOUT;
    while Instant::now() < until {
        let Some(text) = endpoint.metrics_text() else {
            return;
        };
        let running = sample_sum(&text, "kvtier_server_sequences");
        let pending = sample_sum(&text, "kvtier_store_writeback_pending_blocks");
        if running.is_none() && pending.is_none() {
            return;
        }
        if running.unwrap_or(0.0) == 0.0 && pending.unwrap_or(0.0) == 0.0 {
            return;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

impl Hits {
    /// The counters in `text`, `None` when it has neither (not a vLLM).
    pub fn parse(text: &str) -> Option<Self> {
        let local = sample_sum(text, "vllm:prefix_cache_hits_total");
        let external = sample_sum(text, "vllm:external_prefix_cache_hits_total");
        if local.is_none() && external.is_none() {
            return None;
        }
        Some(Self {
            local_hit_tokens: local.unwrap_or(0.0),
            external_hit_tokens: external.unwrap_or(0.0),
        })
    }

    /// The counters of the server behind `endpoint` now.
    pub fn scrape(endpoint: &Endpoint) -> Option<Self> {
        Self::parse(&endpoint.metrics_text()?)
    }

    fn minus(self, o: Self) -> Self {
        Self {
            local_hit_tokens: (self.local_hit_tokens - o.local_hit_tokens).max(0.0),
            external_hit_tokens: (self.external_hit_tokens - o.external_hit_tokens).max(0.0),
        }
    }

    fn plus(self, o: Self) -> Self {
        Self {
            local_hit_tokens: self.local_hit_tokens + o.local_hit_tokens,
            external_hit_tokens: self.external_hit_tokens + o.external_hit_tokens,
        }
    }

    /// What a run added, before and after its restart, if any (a restart
    /// starts the counters again from zero).
    pub fn run_delta(
        before: Option<Self>,
        at_restart: Option<Self>,
        after_restart: Option<Self>,
        end: Option<Self>,
    ) -> Option<Self> {
        let (before, end) = (before?, end?);
        match (at_restart, after_restart) {
            (Some(a), Some(b)) => Some(a.minus(before).plus(end.minus(b))),
            _ => Some(end.minus(before)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_sum_over_labels_and_runs_add_across_a_restart() {
        let page = "# HELP vllm:prefix_cache_hits_total x\n\
                    vllm:prefix_cache_hits_total{engine=\"0\",model_name=\"m\"} 48.0\n\
                    vllm:prefix_cache_hits_total{engine=\"1\",model_name=\"m\"} 2\n\
                    vllm:prefix_cache_hits_created{engine=\"0\"} 1.7e9\n\
                    vllm:external_prefix_cache_hits_total 16\n";
        let h = Hits::parse(page).expect("vLLM counters");
        assert_eq!((h.local_hit_tokens, h.external_hit_tokens), (50.0, 16.0));
        assert_eq!(Hits::parse("kvtier_server_requests_total 3\n"), None);
        let at = |l, e| {
            Some(Hits {
                local_hit_tokens: l,
                external_hit_tokens: e,
            })
        };
        let d = Hits::run_delta(at(10.0, 0.0), at(30.0, 5.0), at(0.0, 0.0), at(4.0, 20.0))
            .expect("delta");
        assert_eq!((d.local_hit_tokens, d.external_hit_tokens), (24.0, 25.0));
        assert_eq!(Hits::run_delta(None, None, None, at(1.0, 1.0)), None);
    }
}
