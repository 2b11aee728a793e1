//! Runs the cold-recovery workload against a target and builds the report.
//!
//! 1. **Pass 1** computes every session's prompt once (kvtier mode, one at a
//!    time, one output token) so its KV lands in the store; its prefill rate
//!    gives the compute part of the TTFT floor.
//! 2. **Pass 2**, for each concurrency: a baseline run (prefix reuse off:
//!    recompute) and a kvtier run (G1 dropped, and G2 too by default, so the
//!    prefix is restored from G3), interleaved, with the device's raw read
//!    limit measured between runs. Energy is read around each run.
//! 3. **Pairs**, after the kvtier run at concurrency 1 (kvtier's engine in
//!    process, which can drop a prefix again): each session restored, then
//!    at once with its prefix in G1, for the TTFT against its two parts
//!    ([`crate::cold_recovery::overlap`]).

use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use indicatif::ProgressBar;
use kvtier_energy::{CostModel, MeterOptions, PowerMeter, best_meter};

use crate::bench_error::BenchError;
use crate::cold_recovery::accuracy;
use crate::cold_recovery::workload::{ColdRecoveryConfig, Session, sessions};
use crate::common::progress::request_bar;
use crate::reporting::gates::Gates;
use crate::reporting::report::{
    BenchReport, MachineInfo, Mode, Overlap, RequestRecord, RunSummary, TierTokens, ratios,
};
use crate::reporting::stats::{Percentiles, percentile};
use crate::targets::target::Target;

/// Measurements the caller provides (they live with the I/O tools).
pub struct Hooks<'a> {
    /// Measures the device's raw read limit once, in GB/s.
    pub device_limit: &'a mut dyn FnMut() -> Result<f64, String>,
    /// Drops the page cache (best effort): false when it could not.
    pub drop_page_cache: &'a mut dyn FnMut() -> bool,
}

/// Options of a run.
pub struct RunOptions {
    /// The workload.
    pub workload: ColdRecoveryConfig,
    /// The gates.
    pub gates: Gates,
    /// The cost model.
    pub cost: CostModel,
    /// How to pick the power meter.
    pub meter: MeterOptions,
    /// Show progress bars (stderr).
    pub progress: bool,
}

/// Runs every session once with `concurrency` clients.
fn run_clients(
    target: &dyn Target,
    sessions: &[Session],
    concurrency: u32,
    max_tokens: usize,
    pb: &ProgressBar,
) -> (Vec<RequestRecord>, f64) {
    let next = AtomicUsize::new(0);
    let records = Mutex::new(Vec::with_capacity(sessions.len()));
    let t0 = Instant::now();
    std::thread::scope(|s| {
        for _ in 0..concurrency.max(1) {
            s.spawn(|| {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(session) = sessions.get(i) else {
                        break;
                    };
                    let rec = target.request(session, max_tokens);
                    pb.inc(1);
                    records.lock().unwrap_or_else(|p| p.into_inner()).push(rec);
                }
            });
        }
    });
    let wall = t0.elapsed().as_secs_f64();
    let mut recs = records.into_inner().unwrap_or_else(|p| p.into_inner());
    recs.sort_by_key(|r| r.session);
    (recs, wall)
}

struct Context {
    device_limit_gbps: f64,
    prefill_tok_s: f64,
    /// One decode step (a forward pass of one token) at the workload's
    /// context: the least any uncached suffix costs.
    decode_step_s: f64,
    /// The engine's KV bytes per stored byte (the codec's ratio).
    logical_per_stored: f64,
}

fn summarize(
    mode: Mode,
    concurrency: u32,
    records: Vec<RequestRecord>,
    wall: f64,
    joules: f64,
    cost: &CostModel,
    ctx: &Context,
) -> RunSummary {
    let ok: Vec<&RequestRecord> = records.iter().filter(|r| r.error.is_none()).collect();
    let ttft: Vec<f64> = ok.iter().map(|r| r.ttft_s).collect();
    let e2e: Vec<f64> = ok.iter().map(|r| r.e2e_s).collect();
    let out_tokens: usize = ok.iter().map(|r| r.output_tokens).sum();
    let mut hits = TierTokens::default();
    for r in &ok {
        hits += r.hit_tokens;
    }
    let restored: u64 = ok.iter().map(|r| r.restored_bytes).sum();
    let restore_s: f64 = ok.iter().map(|r| r.restore_s).sum();
    let floors: Vec<f64> = ok
        .iter()
        .map(|r| {
            let cached = r.hit_tokens.total();
            let bytes_s = if ctx.device_limit_gbps > 0.0 {
                r.restored_bytes as f64 / (ctx.device_limit_gbps * 1e9)
            } else {
                0.0
            };
            let uncached = r.prompt_tokens.saturating_sub(cached);
            let compute_s = if ctx.prefill_tok_s > 0.0 && uncached > 0 {
                // A forward pass reads every weight however few tokens it
                // computes: a one-token suffix costs a decode step, not
                // 1/prefill rate.
                (uncached as f64 / ctx.prefill_tok_s).max(ctx.decode_step_s)
            } else {
                0.0
            };
            bytes_s + compute_s
        })
        .collect();
    let tps = if wall > 0.0 {
        out_tokens as f64 / wall
    } else {
        0.0
    };
    let avg_watts = if wall > 0.0 { joules / wall } else { 0.0 };
    let t = Percentiles::of(&ttft);
    let e = Percentiles::of(&e2e);
    RunSummary {
        concurrency,
        mode,
        ttft_p50_s: t.p50,
        ttft_p90_s: t.p90,
        ttft_p99_s: t.p99,
        e2e_p50_s: e.p50,
        e2e_p99_s: e.p99,
        throughput_tok_s: tps,
        joules_per_token: if out_tokens > 0 {
            joules / out_tokens as f64
        } else {
            0.0
        },
        avg_watts,
        cost_per_mtok_usd: cost.cost_per_million_tokens(avg_watts, tps).unwrap_or(0.0),
        restore_gbps: if restore_s > 0.0 {
            restored as f64 / restore_s / 1e9
        } else {
            0.0
        },
        restore_gbps_logical: if restore_s > 0.0 {
            restored as f64 * ctx.logical_per_stored / restore_s / 1e9
        } else {
            0.0
        },
        restored_bytes: restored,
        floor_ttft_s: percentile(&floors, 50.0).unwrap_or(0.0),
        hit_tokens: hits,
        requests: ok.len(),
        failed: records.len() - ok.len(),
        wall_s: wall,
        samples: records,
    }
}

/// One decode step, seconds: the median gap between a request's output
/// tokens in the baseline run at the lowest concurrency (one sequence at a
/// time where the workload has concurrency 1), at the workload's own
/// context. 0 when no request there made two tokens.
fn decode_step(raw: &[(Mode, u32, Vec<RequestRecord>, f64, f64)]) -> f64 {
    let Some((.., recs, _, _)) = raw
        .iter()
        .filter(|(m, ..)| *m == Mode::Baseline)
        .min_by_key(|(_, c, ..)| *c)
    else {
        return 0.0;
    };
    let steps: Vec<f64> = recs
        .iter()
        .filter(|r| r.error.is_none() && r.output_tokens > 1 && r.e2e_s > r.ttft_s)
        .map(|r| (r.e2e_s - r.ttft_s) / (r.output_tokens - 1) as f64)
        .collect();
    percentile(&steps, 50.0).unwrap_or(0.0)
}

/// Runs the cold-recovery workload and returns the report (gates evaluated,
/// not enforced: the caller decides what a FAIL does).
pub fn run_cold_recovery(
    target: &mut dyn Target,
    opts: &RunOptions,
    hooks: Hooks<'_>,
    machine: MachineInfo,
) -> Result<BenchReport, BenchError> {
    let cfg = &opts.workload;
    cfg.validate().map_err(BenchError::Config)?;
    opts.cost
        .validate()
        .map_err(|e| BenchError::Config(e.to_string()))?;
    let choice = best_meter(&opts.meter)?;
    let mut meter: Box<dyn PowerMeter> = choice.meter;
    let started_at = humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string();
    let list = sessions(cfg, &|t| target.count_tokens(t));
    let n = list.len() as u64;

    // Pass 1: compute and store.
    let pb = request_bar(n, "pass 1: compute + store".into(), opts.progress);
    target.begin(Mode::Kvtier, false)?;
    let (recs, pass1_s) = run_clients(&*target, &list, 1, 1, &pb);
    target.end()?;
    pb.finish_and_clear();
    if let Some(e) = recs.iter().find_map(|r| r.error.clone()) {
        return Err(BenchError::Target(format!("pass 1 failed: {e}")));
    }
    let computed: usize = recs
        .iter()
        .map(|r| r.prompt_tokens - r.hit_tokens.total())
        .sum();
    let compute_s: f64 = recs.iter().map(|r| r.ttft_s).sum();
    let prefill_tok_s = if compute_s > 0.0 {
        computed as f64 / compute_s
    } else {
        0.0
    };

    let mut limit_samples = Vec::new();
    let mut sample_limit = |samples: &mut Vec<f64>| match (hooks.device_limit)() {
        Ok(g) => samples.push(g),
        Err(e) => tracing::warn!("device limit not measured: {e}"),
    };
    sample_limit(&mut limit_samples);

    let mut raw: Vec<(Mode, u32, Vec<RequestRecord>, f64, f64)> = Vec::new();
    let mut pairs = Vec::new();
    let mut pairs_dropped_cache = false;
    for &c in &cfg.concurrency {
        for mode in [Mode::Baseline, Mode::Kvtier] {
            target.begin(mode, cfg.evict_g2)?;
            if mode == Mode::Kvtier {
                (hooks.drop_page_cache)();
            }
            let pb = request_bar(
                n,
                format!("{} at concurrency {c}", mode.as_str()),
                opts.progress,
            );
            meter.start()?;
            let (recs, wall) = run_clients(&*target, &list, c, cfg.max_tokens, &pb);
            let joules = meter.read()?.joules_total();
            pb.finish_and_clear();
            target.end()?;
            // Only a target that says what it restored and can drop it
            // again (kvtier's engine in process) has a restore to put
            // against the hot TTFT.
            let restored = target.drops_prefixes() && recs.iter().any(|r| r.restored_bytes > 0);
            raw.push((mode, c, recs, wall, joules));
            sample_limit(&mut limit_samples);
            if mode == Mode::Kvtier && c == 1 && restored {
                (pairs, pairs_dropped_cache) = overlap_pairs(
                    &mut *target,
                    &list,
                    cfg,
                    hooks.drop_page_cache,
                    opts.progress,
                )?;
            }
        }
    }
    let device_limit_gbps = percentile(&limit_samples, 50.0).unwrap_or(0.0);
    let decode_step_s = decode_step(&raw);
    let (kv_offload_codec, logical_per_stored) = target.kv_form();
    let ctx = Context {
        device_limit_gbps,
        prefill_tok_s,
        decode_step_s,
        logical_per_stored,
    };
    // Restored answers against recomputed ones, one sequence at a time.
    let at_one = |mode: Mode| {
        raw.iter()
            .find(|(m, c, ..)| *m == mode && *c == 1)
            .map(|(_, _, recs, ..)| recs.as_slice())
    };
    let accuracy = match (at_one(Mode::Baseline), at_one(Mode::Kvtier)) {
        (Some(reference), Some(restored)) => accuracy::compare(reference, restored),
        _ => None,
    };
    let overlap = Overlap::of(&pairs, device_limit_gbps, pairs_dropped_cache);
    if overlap.is_none() && !pairs.is_empty() {
        tracing::warn!(
            "TTFT with the prefix in G1 not measured: not every request was restored and then hit G1"
        );
    }
    let results: Vec<RunSummary> = raw
        .into_iter()
        .map(|(mode, c, recs, wall, joules)| {
            summarize(mode, c, recs, wall, joules, &opts.cost, &ctx)
        })
        .collect();
    let gates = opts.gates.evaluate(&results);
    let machine = MachineInfo {
        device_limit_gbps,
        device_limit_samples_gbps: limit_samples,
        io_mode: target.io_mode(),
        ..machine
    };
    Ok(BenchReport {
        workload: "cold-recovery".into(),
        target: target.describe(),
        ratios: ratios(&results),
        results,
        gates,
        energy_meter: meter.name().to_string(),
        energy_modelled: matches!(meter.kind(), kvtier_energy::MeterKind::Modelled),
        energy_meter_reason: choice.reason,
        cost_model: serde_json::to_value(&opts.cost).unwrap_or_default(),
        machine,
        config: serde_json::to_value(cfg).unwrap_or_default(),
        prefill_tok_s,
        decode_step_s,
        pass1_s,
        started_at,
        kv_offload_codec,
        accuracy,
        overlap,
    })
}

/// Each session once more as (restored, hot) twins, at concurrency 1: its
/// prefix dropped as for a kvtier run (G1, G2 where the run drops it, and the
/// page cache unless `cfg.pair_cache_drop` is off), then its request twice in a
/// row, the second with the prefix in G1 ([`crate::cold_recovery::overlap`]).
/// Also says whether the page cache was dropped before every restored twin.
fn overlap_pairs(
    target: &mut dyn Target,
    list: &[Session],
    cfg: &ColdRecoveryConfig,
    drop_page_cache: &mut dyn FnMut() -> bool,
    progress: bool,
) -> Result<(Vec<(RequestRecord, RequestRecord)>, bool), BenchError> {
    let pb = request_bar(
        list.len() as u64,
        "restored, then prefix in G1".into(),
        progress,
    );
    let mut pairs = Vec::with_capacity(list.len());
    let mut dropped = cfg.pair_cache_drop;
    for session in list {
        target.begin(Mode::Kvtier, cfg.evict_g2)?;
        if cfg.pair_cache_drop {
            dropped &= drop_page_cache();
        }
        let restored = target.request(session, cfg.max_tokens);
        let hot = target.request(session, cfg.max_tokens);
        target.end()?;
        pb.inc(1);
        pairs.push((restored, hot));
    }
    pb.finish_and_clear();
    Ok((pairs, dropped))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(prompt: usize, cached: usize, out: usize, ttft: f64, e2e: f64) -> RequestRecord {
        RequestRecord {
            prompt_tokens: prompt,
            hit_tokens: TierTokens {
                g3: cached,
                ..Default::default()
            },
            output_tokens: out,
            ttft_s: ttft,
            e2e_s: e2e,
            restored_bytes: 1_000_000_000,
            ..Default::default()
        }
    }

    #[test]
    fn the_decode_step_is_the_median_token_gap_of_the_least_concurrent_baseline() {
        let raw = vec![
            // Concurrency 8 runs slower steps; it must not be the one used.
            (Mode::Baseline, 8, vec![rec(100, 0, 5, 1.0, 1.8)], 1.0, 0.0),
            (
                Mode::Baseline,
                1,
                vec![
                    rec(100, 0, 5, 1.0, 1.4),  // 0.1 s a step
                    rec(100, 0, 3, 1.0, 1.6),  // 0.3 s a step
                    rec(100, 0, 9, 1.0, 1.16), // 0.02 s a step
                    rec(100, 0, 1, 1.0, 1.0),  // one token: no step
                ],
                1.0,
                0.0,
            ),
            (Mode::Kvtier, 1, vec![rec(100, 99, 5, 0.1, 0.2)], 1.0, 0.0),
        ];
        assert!(
            (decode_step(&raw) - 0.1).abs() < 1e-9,
            "{}",
            decode_step(&raw)
        );
        assert_eq!(decode_step(&raw[2..]), 0.0, "no baseline: no step");
    }

    #[test]
    fn a_one_token_suffix_costs_at_least_a_decode_step_in_the_floor() {
        let ctx = Context {
            device_limit_gbps: 2.0,
            prefill_tok_s: 1000.0,
            decode_step_s: 0.05,
            logical_per_stored: 1.0,
        };
        let floor = |r: RequestRecord| {
            summarize(
                Mode::Kvtier,
                1,
                vec![r],
                1.0,
                0.0,
                &CostModel::default(),
                &ctx,
            )
            .floor_ttft_s
        };
        // 1 GB at 2 GB/s, plus one token: a decode step, not 1 ms.
        assert!((floor(rec(100, 99, 2, 0.6, 0.7)) - 0.55).abs() < 1e-9);
        // 400 tokens at 1000 tok/s cost more than a step: the prefill rate.
        assert!((floor(rec(500, 100, 2, 0.9, 1.0)) - 0.9).abs() < 1e-9);
        // Nothing to compute (every token cached): the bytes alone.
        assert!((floor(rec(100, 100, 2, 0.6, 0.7)) - 0.5).abs() < 1e-9);
    }
}
