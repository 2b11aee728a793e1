//! What a replay reports: per server its latency, throughput, hit rate
//! over time (windows, the restart marked), energy and the simulator's
//! prediction; the product brief's gates of kvtier against the baseline;
//! whether the outputs were identical. JSON (a contract: `trace`, `runs`,
//! `gates`, `identical_outputs`), a text table, one line per request and
//! plots, written to a results directory.

use std::path::{Path, PathBuf};

use kvtier_trace::Trace;
use serde::Serialize;

use crate::bench_error::BenchError;
use crate::reporting::run_summary::{Mode, TierTokens};
use crate::reporting::stats::{Percentiles, fraction};
use crate::reporting::text_report::TextReport;

use super::metrics::Hits;
use super::schedule::{Arrivals, Sent};
use super::{Prepared, ReplayOptions, Server};

/// The product brief's gates: TTFT p50 at least 25 % lower, output
/// throughput at least 29 % higher than the baseline's.
const GATES: [(&str, f64); 2] = [
    ("TTFT p50 -25 % against the baseline", 0.25),
    ("throughput +29 % against the baseline", 0.29),
];

/// Windows per side of the restart when no size is given.
const WINDOWS: usize = 5;

/// How the replay ran.
#[derive(Debug, Clone, Serialize)]
pub struct ReplaySettings {
    /// Requests in the cut.
    pub requests: usize,
    /// The share of the trace's conversations kept.
    pub sample: f64,
    /// Tokens per full block.
    pub block_tokens: u32,
    /// Output lengths are the trace's x this.
    pub output_scale: f64,
    /// Generated tokens at most.
    pub max_output_tokens: usize,
    /// "open" or "closed".
    pub arrivals: String,
    /// Multiplies the trace's gaps.
    pub time_scale: f64,
    /// Open loop: at most this many in flight (0: no limit).
    pub max_concurrency: usize,
    /// Closed loop: sessions at once.
    pub sessions_parallel: usize,
    /// The restart command's place (requests sent before it), if any.
    pub restart_after_requests: Option<usize>,
}

impl ReplaySettings {
    pub(super) fn of(opts: &ReplayOptions, requests: usize, split: Option<usize>) -> Self {
        let (arrivals, time_scale, max_concurrency, sessions_parallel) = match opts.arrivals {
            Arrivals::Open {
                time_scale,
                max_concurrency,
            } => ("open", time_scale, max_concurrency, 0),
            Arrivals::Closed {
                sessions,
                time_scale,
            } => ("closed", time_scale, 0, sessions),
        };
        Self {
            requests,
            sample: opts.sample,
            block_tokens: opts.block_tokens,
            output_scale: opts.output_scale,
            max_output_tokens: opts.max_output_tokens,
            arrivals: arrivals.into(),
            time_scale,
            max_concurrency,
            sessions_parallel,
            restart_after_requests: split,
        }
    }
}

/// A stretch of consecutive requests (in cut order).
#[derive(Debug, Clone, Serialize)]
pub struct Window {
    /// Its first request.
    pub first_request: usize,
    /// Requests in it.
    pub requests: usize,
    /// Of which failed.
    pub failed: usize,
    /// True for the windows after the restart.
    pub after_restart: bool,
    /// Hit tokens over prompt tokens of its answered requests.
    pub hit_rate: f64,
    /// Hit tokens per tier.
    pub hit_tokens: TierTokens,
    /// TTFT p50 of its answered requests.
    pub ttft_p50_s: f64,
    /// What any cache could have served of its answered requests' prompt
    /// tokens (see `reuse_bound` of the report).
    pub reuse_bound: f64,
}

/// One server's replay.
#[derive(Debug, Clone, Serialize)]
pub struct RunReport {
    /// Its base URL.
    pub server: String,
    /// "kvtier" or "baseline".
    pub mode: Mode,
    /// Requests sent.
    pub requests: usize,
    /// Of which failed.
    pub failed: usize,
    /// TTFT percentiles of the answered requests (s).
    pub ttft_p50_s: f64,
    /// 90th percentile.
    pub ttft_p90_s: f64,
    /// 99th percentile.
    pub ttft_p99_s: f64,
    /// Inter-token latency p50 (s).
    pub itl_p50_s: f64,
    /// End-to-end latency p50 (s).
    pub e2e_p50_s: f64,
    /// Generated tokens over the run's time (the restart's pause left out).
    pub throughput_tok_s: f64,
    /// Seconds the run took, the restart's pause left out.
    pub wall_s: f64,
    /// Share of `wall_s` with at least one request in flight: how busy
    /// the arrivals kept the server.
    pub busy_fraction: f64,
    /// Prompt tokens of the answered requests.
    pub prompt_tokens: usize,
    /// Generated tokens.
    pub output_tokens: usize,
    /// Hit tokens per tier (from the server's usage; a server that does not
    /// name tiers has them all in `g1`).
    pub hit_tokens: TierTokens,
    /// Hit tokens over prompt tokens.
    pub hit_rate: f64,
    /// The simulator's hit rate for the same requests and the server's
    /// capacities (kvtier serve only; exact at concurrency 1).
    pub predicted_hit_rate: Option<f64>,
    /// Why there is no prediction for a server asked for one.
    pub prediction_note: Option<String>,
    /// The last window before the restart.
    pub hit_rate_before_restart: Option<f64>,
    /// The first window after it.
    pub hit_rate_first_window_after_restart: Option<f64>,
    /// Joules per generated token over the run (the machine's meter or
    /// model: see `energy_meter`).
    pub joules_per_token: Option<f64>,
    /// vLLM's own and external hit tokens, from its counters.
    pub vllm_counters: Option<Hits>,
    /// What went wrong with the restart, if anything.
    pub restart_error: Option<String>,
    /// The first few errors.
    pub errors: Vec<String>,
    /// Hit rate and TTFT over time.
    pub windows: Vec<Window>,
}

fn total(t: TierTokens) -> usize {
    t.g1 + t.g2 + t.g3 + t.g4
}

/// `bounds` summed over `requests`, over their prompt tokens.
pub(super) fn fraction_of(bounds: &[usize], requests: &[Prepared]) -> f64 {
    fraction(
        bounds.iter().sum::<usize>() as f64,
        requests.iter().map(|r| r.prompt.len()).sum::<usize>() as f64,
    )
}

/// The windows of `sent` (in cut order) over `range`, `size` requests each
/// (0: a [`WINDOWS`]th of the range).
fn windows(
    sent: &[Sent],
    bounds: &[usize],
    range: std::ops::Range<usize>,
    size: usize,
    after: bool,
) -> Vec<Window> {
    let size = if size == 0 {
        range.len().div_ceil(WINDOWS).max(1)
    } else {
        size
    };
    let mut out = Vec::new();
    let mut start = range.start;
    while start < range.end {
        let end = (start + size).min(range.end);
        let part = &sent[start..end];
        let ok: Vec<&Sent> = part
            .iter()
            .filter(|s| s.completion.record.error.is_none())
            .collect();
        let mut hits = TierTokens::default();
        for s in &ok {
            hits += s.completion.record.hit_tokens;
        }
        let prompt: usize = ok.iter().map(|s| s.completion.record.prompt_tokens).sum();
        let bound: usize = ok.iter().filter_map(|s| bounds.get(s.index)).sum();
        let ttft: Vec<f64> = ok.iter().map(|s| s.completion.record.ttft_s).collect();
        out.push(Window {
            first_request: start,
            requests: part.len(),
            failed: part.len() - ok.len(),
            after_restart: after,
            hit_rate: fraction(total(hits) as f64, prompt as f64),
            hit_tokens: hits,
            ttft_p50_s: Percentiles::of(&ttft).p50,
            reuse_bound: fraction(bound as f64, prompt as f64),
        });
        start = end;
    }
    out
}

/// Seconds with at least one of `sent` in flight (the union of their
/// intervals).
fn busy_seconds(sent: &[Sent]) -> f64 {
    let mut spans: Vec<(f64, f64)> = sent
        .iter()
        .map(|s| (s.sent_at_s, s.sent_at_s + s.completion.record.e2e_s))
        .collect();
    spans.sort_by(|a, b| a.0.total_cmp(&b.0));
    let mut busy = 0.0;
    let mut open: Option<(f64, f64)> = None;
    for (a, b) in spans {
        open = match open {
            Some((x, y)) if a <= y => Some((x, y.max(b))),
            Some((x, y)) => {
                busy += y - x;
                Some((a, b))
            }
            None => Some((a, b)),
        };
    }
    busy + open.map_or(0.0, |(x, y)| y - x)
}

impl RunReport {
    /// Summarises one server's run; `sent` is in cut order.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn build(
        server: &Server,
        requests: &[Prepared],
        bounds: &[usize],
        sent: &[Sent],
        split: Option<usize>,
        window: usize,
        wall_s: f64,
        joules: f64,
        predicted: Option<&[TierTokens]>,
        vllm_counters: Option<Hits>,
        restart_error: Option<String>,
        prediction_note: Option<String>,
    ) -> Self {
        let ok: Vec<&Sent> = sent
            .iter()
            .filter(|s| s.completion.record.error.is_none())
            .collect();
        let pick = |f: &dyn Fn(&Sent) -> f64| ok.iter().map(|s| f(s)).collect::<Vec<f64>>();
        let ttft = Percentiles::of(&pick(&|s| s.completion.record.ttft_s));
        let itl: Vec<f64> = ok
            .iter()
            .flat_map(|s| s.completion.itl_s.iter().copied())
            .collect();
        let mut hits = TierTokens::default();
        for s in &ok {
            hits += s.completion.record.hit_tokens;
        }
        let prompt_tokens: usize = ok.iter().map(|s| s.completion.record.prompt_tokens).sum();
        let output_tokens: usize = ok.iter().map(|s| s.completion.record.output_tokens).sum();
        let predicted_hit_rate = predicted.filter(|p| p.len() == requests.len()).map(|p| {
            let hit: usize = ok
                .iter()
                .map(|s| {
                    let h = p[s.index];
                    h.g1 + h.g2 + h.g3
                })
                .sum();
            fraction(hit as f64, prompt_tokens as f64)
        });
        let n = sent.len();
        let mut wins = windows(sent, bounds, 0..split.unwrap_or(n), window, false);
        let before = split.and_then(|_| wins.last().map(|w| w.hit_rate));
        let after_wins = split.map(|k| windows(sent, bounds, k..n, window, true));
        let after = after_wins
            .as_ref()
            .and_then(|w| w.first().map(|w| w.hit_rate));
        wins.extend(after_wins.into_iter().flatten());
        Self {
            server: server.endpoint.base_url().to_string(),
            mode: server.mode,
            requests: n,
            failed: n - ok.len(),
            ttft_p50_s: ttft.p50,
            ttft_p90_s: ttft.p90,
            ttft_p99_s: ttft.p99,
            itl_p50_s: Percentiles::of(&itl).p50,
            e2e_p50_s: Percentiles::of(&pick(&|s| s.completion.record.e2e_s)).p50,
            throughput_tok_s: fraction(output_tokens as f64, wall_s),
            wall_s,
            busy_fraction: fraction(busy_seconds(sent), wall_s).min(1.0),
            prompt_tokens,
            output_tokens,
            hit_tokens: hits,
            hit_rate: fraction(total(hits) as f64, prompt_tokens as f64),
            predicted_hit_rate,
            prediction_note,
            hit_rate_before_restart: before,
            hit_rate_first_window_after_restart: after,
            joules_per_token: (output_tokens > 0 && joules > 0.0)
                .then(|| joules / output_tokens as f64),
            vllm_counters,
            restart_error,
            errors: sent
                .iter()
                .filter_map(|s| {
                    let e = s.completion.record.error.as_ref()?;
                    Some(format!("request {}: {e}", s.index))
                })
                .take(5)
                .collect(),
            windows: wins,
        }
    }
}

/// One request of one run, for `requests.jsonl`.
#[derive(Debug, Clone, Serialize)]
pub struct RequestLine {
    /// "kvtier" or "baseline".
    pub mode: Mode,
    /// Its place in the cut.
    pub index: usize,
    /// Its session, if the trace names one.
    pub session: Option<u64>,
    /// Seconds from the run's start to sending it.
    pub sent_at_s: f64,
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Generated tokens.
    pub output_tokens: usize,
    /// Time to first token (s).
    pub ttft_s: f64,
    /// End to end (s).
    pub e2e_s: f64,
    /// Hit tokens per tier, as the server reported them.
    pub hit_tokens: TierTokens,
    /// The simulator's hit tokens per tier.
    pub predicted: Option<TierTokens>,
    /// Why it failed.
    pub error: Option<String>,
}

impl RequestLine {
    pub(super) fn of_run(
        run: &RunReport,
        requests: &[Prepared],
        sent: &[Sent],
        predicted: Option<&[TierTokens]>,
    ) -> Vec<Self> {
        sent.iter()
            .map(|s| {
                let r = &s.completion.record;
                Self {
                    mode: run.mode,
                    index: s.index,
                    session: requests.get(s.index).and_then(|q| q.session),
                    sent_at_s: s.sent_at_s,
                    prompt_tokens: r.prompt_tokens,
                    output_tokens: r.output_tokens,
                    ttft_s: r.ttft_s,
                    e2e_s: r.e2e_s,
                    hit_tokens: r.hit_tokens,
                    predicted: predicted.and_then(|p| p.get(s.index).copied()),
                    error: r.error.clone(),
                }
            })
            .collect()
    }
}

/// One gate's verdict.
#[derive(Debug, Clone, Serialize)]
pub struct GateVerdict {
    /// What it asks.
    pub name: String,
    /// Whether kvtier met it.
    pub passed: bool,
    /// The measured reduction or gain.
    pub value: f64,
    /// The least that passes.
    pub min: f64,
}

/// The whole replay.
#[derive(Debug, Clone, Serialize)]
pub struct ReplayReport {
    /// The trace's name.
    pub trace: String,
    /// When the replay started (RFC 3339).
    pub started_at: String,
    /// How it ran.
    pub settings: ReplaySettings,
    /// What any cache could save on this cut: per request the longest
    /// prefix an earlier prompt of the cut began with, less its last token
    /// (every server computes that one), over all prompt tokens.
    pub reuse_bound: f64,
    /// The kvtier server's run, then the baseline's.
    pub runs: Vec<RunReport>,
    /// kvtier against the baseline (empty without one).
    pub gates: Vec<GateVerdict>,
    /// Every request answered by both servers generated the same tokens
    /// (`null` without a baseline).
    pub identical_outputs: Option<bool>,
    /// Requests whose outputs were compared.
    pub compared_outputs: usize,
    /// The energy meter and why.
    pub energy_meter: String,
    /// One line per request and run (written to `requests.jsonl`, not to
    /// the JSON report).
    #[serde(skip)]
    pub lines: Vec<RequestLine>,
    /// The answered requests' TTFTs, per run (for the CDF plot).
    #[serde(skip)]
    pub(super) ttfts: Vec<Vec<f64>>,
}

impl ReplayReport {
    pub(super) fn build(
        trace: &Trace,
        settings: ReplaySettings,
        reuse_bound: f64,
        runs: Vec<(RunReport, Vec<Sent>)>,
        lines: Vec<RequestLine>,
        started_at: String,
        energy_meter: String,
    ) -> Self {
        let kvtier = runs.iter().find(|(r, _)| r.mode == Mode::Kvtier);
        let baseline = runs.iter().find(|(r, _)| r.mode == Mode::Baseline);
        let mut gates = Vec::new();
        let mut identical = None;
        let mut compared = 0;
        if let (Some((k, ks)), Some((b, bs))) = (kvtier, baseline) {
            let values = [
                1.0 - fraction(k.ttft_p50_s, b.ttft_p50_s),
                fraction(k.throughput_tok_s, b.throughput_tok_s) - 1.0,
            ];
            for ((name, min), value) in GATES.iter().zip(values) {
                gates.push(GateVerdict {
                    name: (*name).into(),
                    passed: b.ttft_p50_s > 0.0 && value >= *min,
                    value,
                    min: *min,
                });
            }
            let mut same = true;
            for (x, y) in ks.iter().zip(bs) {
                let (x, y) = (&x.completion, &y.completion);
                if x.record.error.is_some() || y.record.error.is_some() {
                    continue;
                }
                compared += 1;
                same &= if x.record.tokens.is_empty() && y.record.tokens.is_empty() {
                    x.text == y.text
                } else {
                    x.record.tokens == y.record.tokens
                };
            }
            identical = Some(same && compared > 0);
        }
        let ttfts = runs
            .iter()
            .map(|(_, sent)| {
                sent.iter()
                    .filter(|s| s.completion.record.error.is_none())
                    .map(|s| s.completion.record.ttft_s)
                    .collect()
            })
            .collect();
        Self {
            trace: trace.name.clone(),
            started_at,
            settings,
            reuse_bound,
            runs: runs.into_iter().map(|(r, _)| r).collect(),
            gates,
            identical_outputs: identical,
            compared_outputs: compared,
            energy_meter,
            lines,
            ttfts,
        }
    }
}

fn opt_pct(v: Option<f64>) -> String {
    v.map_or("-".into(), |v| format!("{:.1} %", v * 100.0))
}

impl TextReport for ReplayReport {
    fn table(&self) -> String {
        let s = &self.settings;
        let mut out = format!(
            "trace replay: {} ({} requests{}, {} loop, time scale {}, {} tokens per block{})\n\
             reuse bound of the cut (an infinite prefix cache): {:.1} % of prompt tokens\n\n",
            self.trace,
            s.requests,
            if s.sample < 1.0 {
                format!(" of {:.1} % of its conversations", s.sample * 100.0)
            } else {
                String::new()
            },
            s.arrivals,
            s.time_scale,
            s.block_tokens,
            s.restart_after_requests
                .map_or(String::new(), |k| format!(", restart after request {k}")),
            self.reuse_bound * 100.0
        );
        out.push_str(&format!(
            "{:<9} {:<28} {:>5} {:>6} {:>5} {:>9} {:>9} {:>9} {:>9} {:>8} {:>9} {:>9} {:>9} {:>9}\n",
            "mode",
            "server",
            "reqs",
            "failed",
            "busy",
            "TTFT p50",
            "TTFT p99",
            "ITL p50",
            "tok/s",
            "J/token",
            "hit rate",
            "predicted",
            "pre-rst",
            "post-rst"
        ));
        for r in &self.runs {
            out.push_str(&format!(
                "{:<9} {:<28} {:>5} {:>6} {:>4.0}% {:>8.3}s {:>8.3}s {:>8.4}s {:>9.1} {:>8} {:>9} {:>9} {:>9} {:>9}\n",
                r.mode.as_str(),
                r.server,
                r.requests,
                r.failed,
                r.busy_fraction * 100.0,
                r.ttft_p50_s,
                r.ttft_p99_s,
                r.itl_p50_s,
                r.throughput_tok_s,
                r.joules_per_token
                    .map_or("-".into(), |j| format!("{j:.3}")),
                opt_pct(Some(r.hit_rate)),
                opt_pct(r.predicted_hit_rate),
                opt_pct(r.hit_rate_before_restart),
                opt_pct(r.hit_rate_first_window_after_restart),
            ));
            if let Some(c) = r.vllm_counters {
                out.push_str(&format!(
                    "          vLLM counters: {} own prefix-cache hit tokens, {} external (connector)\n",
                    c.local_hit_tokens, c.external_hit_tokens
                ));
            }
            if let Some(k) = self.settings.restart_after_requests {
                let last = r.windows.iter().rfind(|w| w.first_request < k);
                let next = r.windows.iter().find(|w| w.first_request >= k);
                if let (Some(a), Some(b)) = (last, next) {
                    out.push_str(&format!(
                        "          around the restart: {:.1} % hit of {:.1} % possible in the last window before, {:.1} % of {:.1} % in the first after\n",
                        a.hit_rate * 100.0,
                        a.reuse_bound * 100.0,
                        b.hit_rate * 100.0,
                        b.reuse_bound * 100.0
                    ));
                }
            }
            if let Some(why) = &r.prediction_note {
                out.push_str(&format!("          no prediction: {why}\n"));
            }
            if let Some(e) = &r.restart_error {
                out.push_str(&format!("          restart: {e}\n"));
            }
            for e in &r.errors {
                out.push_str(&format!("          {e}\n"));
            }
        }
        if !self.gates.is_empty() {
            out.push_str(&format!(
                "\ngates (kvtier against the baseline; the cut's reuse bound is {:.1} %):\n",
                self.reuse_bound * 100.0
            ));
            for g in &self.gates {
                out.push_str(&format!(
                    "  {:<40} {:>+7.1} % (at least {:+.0} %): {}\n",
                    g.name,
                    g.value * 100.0,
                    g.min * 100.0,
                    if g.passed { "PASS" } else { "FAIL" }
                ));
            }
        }
        if let Some(same) = self.identical_outputs {
            out.push_str(&format!(
                "outputs: {} of {} requests compared, {}\n",
                self.compared_outputs,
                self.settings.requests,
                if same { "identical" } else { "DIFFERENT" }
            ));
        }
        out.push_str(&format!("energy: {}\n", self.energy_meter));
        out
    }
}

/// Writes `report.json`, `report.txt`, `requests.jsonl` and the plots into
/// `dir` (created); returns the files written.
pub fn write_results(report: &ReplayReport, dir: &Path) -> Result<Vec<PathBuf>, BenchError> {
    std::fs::create_dir_all(dir)
        .map_err(|e| BenchError::Config(format!("cannot create {}: {e}", dir.display())))?;
    let put = |name: &str, text: String| -> Result<PathBuf, BenchError> {
        let p = dir.join(name);
        std::fs::write(&p, text)
            .map_err(|e| BenchError::Config(format!("cannot write {}: {e}", p.display())))?;
        Ok(p)
    };
    let json = serde_json::to_string_pretty(report)
        .map_err(|e| BenchError::Config(format!("cannot encode the report: {e}")))?;
    let mut lines = String::new();
    for l in &report.lines {
        if let Ok(s) = serde_json::to_string(l) {
            lines.push_str(&s);
            lines.push('\n');
        }
    }
    let mut files = vec![
        put("report.json", json)?,
        put("report.txt", report.table())?,
        put("requests.jsonl", lines)?,
    ];
    files.extend(super::plot::write_all(report, dir).map_err(BenchError::Config)?);
    Ok(files)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reporting::run_summary::RequestRecord;
    use crate::targets::endpoint::Completion;

    fn sent(index: usize, at: f64, e2e: f64, prompt: usize, g1: usize, failed: bool) -> Sent {
        Sent {
            index,
            sent_at_s: at,
            completion: Completion {
                record: RequestRecord {
                    ttft_s: e2e / 2.0,
                    e2e_s: e2e,
                    prompt_tokens: prompt,
                    hit_tokens: TierTokens {
                        g1,
                        ..Default::default()
                    },
                    error: failed.then(|| "refused".to_string()),
                    ..Default::default()
                },
                ..Default::default()
            },
        }
    }

    #[test]
    fn busy_time_is_the_union_of_the_requests_in_flight() {
        let s = [
            sent(0, 0.0, 2.0, 1, 0, false),
            sent(1, 1.0, 2.0, 1, 0, false),
            sent(2, 5.0, 1.0, 1, 0, false),
        ];
        assert!((busy_seconds(&s) - 4.0).abs() < 1e-9);
        assert_eq!(busy_seconds(&[]), 0.0);
    }

    #[test]
    fn windows_count_hits_over_answered_prompts_and_failures_apart() {
        let s: Vec<Sent> = (0..5)
            .map(|i| sent(i, i as f64, 1.0, 10, i, i == 3))
            .collect();
        let bounds = [0, 5, 5, 10, 10];
        let w = windows(&s, &bounds, 0..5, 2, true);
        assert_eq!(w.len(), 3);
        assert_eq!((w[0].requests, w[0].failed), (2, 0));
        assert!((w[0].hit_rate - 1.0 / 20.0).abs() < 1e-9);
        // Request 3 failed: only request 2's tokens count.
        assert_eq!((w[1].requests, w[1].failed), (2, 1));
        assert!((w[1].hit_rate - 0.2).abs() < 1e-9);
        assert!((w[1].reuse_bound - 0.5).abs() < 1e-9);
        assert!(w.iter().all(|w| w.after_restart));
        // 0: a fifth of the range per window.
        assert_eq!(windows(&s, &bounds, 0..5, 0, false).len(), 5);
    }
}
