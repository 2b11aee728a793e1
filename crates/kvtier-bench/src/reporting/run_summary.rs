//! One run of the cold-recovery workload and its requests: the mode
//! (baseline or kvtier), the per-request records, the run's summary (a
//! JSON contract), and the kvtier / baseline ratios.

use serde::Serialize;

use crate::reporting::stats::Percentiles;

/// Baseline (recompute) or kvtier (restore).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// Prefix reuse off: every prompt is recomputed.
    #[default]
    Baseline,
    /// Prefix reuse on: cached prefixes are restored from the tiers.
    Kvtier,
}

impl Mode {
    /// "baseline" or "kvtier".
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Baseline => "baseline",
            Mode::Kvtier => "kvtier",
        }
    }
}

/// One request as the client saw it.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct RequestRecord {
    /// Session index.
    pub session: usize,
    /// Seconds from submission to the first token.
    pub ttft_s: f64,
    /// Seconds from submission to the first token being sampled, as the
    /// engine's scheduler timed it (in-process target; 0 where the target
    /// does not say). Unlike `ttft_s` it leaves out the client thread's
    /// wake-up for the token.
    pub server_ttft_s: f64,
    /// Seconds from submission to the last token.
    pub e2e_s: f64,
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Generated tokens.
    pub output_tokens: usize,
    /// Prompt tokens served from G1 / G2 / G3.
    pub hit_tokens: TierTokens,
    /// KV bytes restored from the store.
    pub restored_bytes: u64,
    /// Seconds the engine spent restoring.
    pub restore_s: f64,
    /// Seconds the prompt's forward pass waited for restored layers to
    /// land (in-process target; 0 when nothing was restored layer by
    /// layer).
    pub layer_wait_s: f64,
    /// Why it failed, if it did.
    pub error: Option<String>,
    /// The generated tokens (in-process target; for
    /// [`crate::cold_recovery::accuracy`]).
    #[serde(skip)]
    pub tokens: Vec<u32>,
    /// Per generated token, the top-5 log probabilities, most likely first
    /// (in-process target; for [`crate::cold_recovery::accuracy`]).
    #[serde(skip)]
    pub top_logprobs: Vec<Vec<f32>>,
}

pub use kvtier_store::TierTokens;

/// Summary of one (mode, concurrency) run. Field names are a contract.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct RunSummary {
    /// Concurrent clients.
    pub concurrency: u32,
    /// "baseline" or "kvtier".
    pub mode: Mode,
    /// TTFT median, seconds.
    pub ttft_p50_s: f64,
    /// TTFT 90th percentile, seconds.
    pub ttft_p90_s: f64,
    /// TTFT 99th percentile, seconds.
    pub ttft_p99_s: f64,
    /// End-to-end latency median, seconds.
    pub e2e_p50_s: f64,
    /// End-to-end latency 99th percentile, seconds.
    pub e2e_p99_s: f64,
    /// Output tokens per second over the run's wall time.
    pub throughput_tok_s: f64,
    /// Joules per output token (see `energy_meter` for how they were had).
    pub joules_per_token: f64,
    /// Average power over the run, watts.
    pub avg_watts: f64,
    /// Cost per million output tokens, USD (cost model in the report).
    pub cost_per_mtok_usd: f64,
    /// Restored KV bytes as stored (coded, `kv_offload_codec`) / engine
    /// restore time, GB/s (0 for baseline): the physical rate.
    pub restore_gbps: f64,
    /// The same restores counted in the engine's own bytes (f32 KV), GB/s:
    /// the logical rate (`restore_gbps` times the codec's ratio).
    pub restore_gbps_logical: f64,
    /// KV bytes restored, as stored, summed over requests.
    pub restored_bytes: u64,
    /// The byte-moving floor of TTFT p50: restored bytes at the device limit
    /// plus the uncached suffix at the measured prefill rate, and never less
    /// than one decode step for it (`decode_step_s`; baseline: the whole
    /// prompt at that rate).
    pub floor_ttft_s: f64,
    /// Prompt tokens served per tier, summed over requests.
    pub hit_tokens: TierTokens,
    /// Requests completed.
    pub requests: usize,
    /// Requests failed.
    pub failed: usize,
    /// Wall time of the run, seconds.
    pub wall_s: f64,
    /// Every request.
    pub samples: Vec<RequestRecord>,
}

impl RunSummary {
    /// TTFT percentiles of the completed requests.
    pub fn ttft(&self) -> Percentiles {
        let s: Vec<f64> = self
            .samples
            .iter()
            .filter(|r| r.error.is_none())
            .map(|r| r.ttft_s)
            .collect();
        Percentiles::of(&s)
    }
}

/// kvtier / baseline at one concurrency.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Ratio {
    /// Concurrency.
    pub concurrency: u32,
    /// kvtier TTFT p50 / baseline TTFT p50.
    pub ttft_p50: f64,
    /// kvtier TTFT p99 / baseline TTFT p99.
    pub ttft_p99: f64,
    /// kvtier throughput / baseline throughput.
    pub throughput: f64,
    /// kvtier J/token / baseline J/token.
    pub joules_per_token: f64,
    /// kvtier e2e p50 / baseline e2e p50.
    pub e2e_p50: f64,
}

/// Pairs baseline and kvtier runs by concurrency.
pub fn ratios(runs: &[RunSummary]) -> Vec<Ratio> {
    let div = |a: f64, b: f64| if b > 0.0 { a / b } else { 0.0 };
    let mut out = Vec::new();
    for k in runs.iter().filter(|r| r.mode == Mode::Kvtier) {
        if let Some(b) = runs
            .iter()
            .find(|r| r.mode == Mode::Baseline && r.concurrency == k.concurrency)
        {
            out.push(Ratio {
                concurrency: k.concurrency,
                ttft_p50: div(k.ttft_p50_s, b.ttft_p50_s),
                ttft_p99: div(k.ttft_p99_s, b.ttft_p99_s),
                throughput: div(k.throughput_tok_s, b.throughput_tok_s),
                joules_per_token: div(k.joules_per_token, b.joules_per_token),
                e2e_p50: div(k.e2e_p50_s, b.e2e_p50_s),
            });
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ratios_pair_by_concurrency() {
        let mk = |mode, c, t, tps| RunSummary {
            mode,
            concurrency: c,
            ttft_p50_s: t,
            throughput_tok_s: tps,
            ..Default::default()
        };
        let r = ratios(&[
            mk(Mode::Baseline, 1, 4.0, 10.0),
            mk(Mode::Kvtier, 1, 1.0, 20.0),
            mk(Mode::Kvtier, 8, 1.0, 20.0),
        ]);
        assert_eq!(r.len(), 1, "no baseline at 8: no ratio");
        assert_eq!(r[0].ttft_p50, 0.25);
        assert_eq!(r[0].throughput, 2.0);
    }
}
