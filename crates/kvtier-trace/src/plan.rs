//! `kvtier plan`: for a trace, a model and a machine, what each tier
//! configuration buys: hit tokens per tier, restore bandwidth, SSD wear,
//! accelerator time, TTFT, energy and cost, and the smallest configuration
//! within a point of an infinite cache.
//!
//! # The model, and what it leaves out
//!
//! * **Hits per tier.** kvtier's policy runs at the cumulative capacities
//!   G1, G1+G2, G1+G2+G3 and G1+...+G4 (in blocks of the model's KV); a
//!   request's prefix tokens that hit at level k but not at level k-1 are
//!   served by tier k. That split is exact for a policy with LRU's
//!   inclusion property and an estimate for kvtier's.
//! * **The baseline** is G1 alone under LRU: an engine's own prefix cache
//!   (vLLM's, SGLang's radix cache) in accelerator memory.
//! * **Time.** A missed token costs `2 x parameters` FLOPs of prefill at the
//!   hardware's `prefill_flops_per_s`; a restored one costs its bytes over
//!   its tier's read bandwidth, not overlapped with compute. TTFT is that
//!   sum per request, without queueing or decode: the p50 compares
//!   configurations, it does not predict a loaded server. With a datasheet
//!   peak as the prefill rate, the accelerator time saved is a lower bound.
//! * **Energy and cost** per million prompt tokens: accelerator-seconds per
//!   token times `busy_watts`, and [`CostModel`] (capex over its service
//!   years, energy, cooling through the PUE).
//! * **SSD wear.** kvtier writes every stored block to G3 within its sync
//!   bound, so G3's writes are the blocks the hierarchy stores: bytes per
//!   day over the trace's span, and drive writes per day of the G3 size.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use kvtier_energy::CostModel;
use kvtier_store::eviction::EvictionKind;
use serde::{Deserialize, Serialize};

use crate::prefix::PrefixTree;
use crate::sim::{self, Outcome, SimPolicy};

/// A machine's figures, from a TOML file: every figure with its source.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Hardware {
    /// What machine this is.
    pub name: String,
    /// Prefill compute, FLOP/s (effective, or a datasheet peak).
    pub prefill_flops_per_s: f64,
    /// Power while prefilling, watts (the accelerator, or the machine).
    pub busy_watts: f64,
    /// Accelerator memory for KV (G1), bytes; `--g1` overrides.
    pub g1_kv_bytes: u64,
    /// Read bandwidth from host memory into G1, bytes/s.
    pub g2_read_bytes_per_s: f64,
    /// Read bandwidth from the local disk tier, bytes/s.
    pub g3_read_bytes_per_s: f64,
    /// Read bandwidth from the shared pool, bytes/s.
    pub g4_read_bytes_per_s: f64,
    /// The capex, energy price and PUE.
    pub cost: CostModel,
    /// Where every figure above comes from, by its key (`cost.capex_usd`
    /// for the cost table's).
    pub sources: BTreeMap<String, String>,
}

/// The keys a hardware file must give a source for.
pub const SOURCED: [&str; 11] = [
    "prefill_flops_per_s",
    "busy_watts",
    "g1_kv_bytes",
    "g2_read_bytes_per_s",
    "g3_read_bytes_per_s",
    "g4_read_bytes_per_s",
    "cost.capex_usd",
    "cost.service_years",
    "cost.electricity_usd_per_kwh",
    "cost.pue",
    "cost.other_usd_per_hour",
];

impl Hardware {
    /// Reads and checks a hardware file: every figure positive and finite
    /// and with a source.
    pub fn load(path: &Path) -> Result<Hardware, String> {
        let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
        let hw: Hardware = toml::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
        hw.check().map_err(|e| format!("{}: {e}", path.display()))?;
        Ok(hw)
    }

    /// Checks the figures and their sources.
    pub fn check(&self) -> Result<(), String> {
        for (k, v) in [
            ("prefill_flops_per_s", self.prefill_flops_per_s),
            ("busy_watts", self.busy_watts),
            ("g2_read_bytes_per_s", self.g2_read_bytes_per_s),
            ("g3_read_bytes_per_s", self.g3_read_bytes_per_s),
            ("g4_read_bytes_per_s", self.g4_read_bytes_per_s),
        ] {
            if !(v.is_finite() && v > 0.0) {
                return Err(format!("{k} must be a positive number, not {v}"));
            }
        }
        self.cost.validate().map_err(|e| e.to_string())?;
        let missing: Vec<_> = SOURCED
            .iter()
            .filter(|k| self.sources.get(**k).is_none_or(|s| s.trim().is_empty()))
            .collect();
        if !missing.is_empty() {
            return Err(format!(
                "no source for {missing:?} (in [sources]): every figure names where it comes from"
            ));
        }
        Ok(())
    }
}

/// What a plan needs of the model.
#[derive(Debug, Clone, Copy)]
pub struct PlanModel {
    /// Stored KV bytes per token.
    pub bytes_per_token: u64,
    /// Parameters (prefill FLOPs are 2 per parameter per token).
    pub parameters: u64,
}

/// One tier configuration (bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Tiers {
    /// Accelerator memory for KV.
    pub g1_bytes: u64,
    /// Host memory.
    pub g2_bytes: u64,
    /// Local disk.
    pub g3_bytes: u64,
    /// Shared pool.
    pub g4_bytes: u64,
}

/// Four numbers, one per tier.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct PerTier {
    /// G1.
    pub g1: f64,
    /// G2.
    pub g2: f64,
    /// G3.
    pub g3: f64,
    /// G4.
    pub g4: f64,
}

impl PerTier {
    fn from_array(a: [f64; 4]) -> Self {
        Self {
            g1: a[0],
            g2: a[1],
            g3: a[2],
            g4: a[3],
        }
    }
}

/// What one configuration buys.
#[derive(Debug, Clone, Serialize)]
pub struct PlanRow {
    /// The tier sizes.
    pub tiers: Tiers,
    /// Hit tokens over measured tokens, all tiers.
    pub hit_rate: f64,
    /// The same per tier.
    pub hit_rate_by_tier: PerTier,
    /// Bytes per second each tier must restore at the trace's rate.
    pub restore_bytes_per_s: PerTier,
    /// Bytes written to G3 per day (0 without G3).
    pub g3_write_bytes_per_day: f64,
    /// Drive writes per day of the G3 size (`None` without G3).
    pub g3_drive_writes_per_day: Option<f64>,
    /// Prompt tokens per second not recomputed, beyond the baseline's.
    pub prefill_tokens_avoided_per_s: f64,
    /// Accelerator-seconds saved per hour of this traffic, against the
    /// baseline (restore time counted against it).
    pub accelerator_s_saved_per_hour: f64,
    /// TTFT p50 estimate (prefill and restore, no queueing).
    pub ttft_p50_s: f64,
    /// Joules of accelerator energy per million prompt tokens.
    pub joules_per_million_tokens: f64,
    /// USD per million prompt tokens.
    pub usd_per_million_tokens: f64,
}

/// The baseline: G1 alone under LRU.
#[derive(Debug, Clone, Serialize)]
pub struct Baseline {
    /// Its hit rate.
    pub hit_rate: f64,
    /// TTFT p50 estimate.
    pub ttft_p50_s: f64,
    /// Joules per million prompt tokens.
    pub joules_per_million_tokens: f64,
    /// USD per million prompt tokens.
    pub usd_per_million_tokens: f64,
}

/// A whole plan.
#[derive(Debug, Clone, Serialize)]
pub struct Plan {
    /// Stored KV bytes per token.
    pub bytes_per_token: u64,
    /// Bytes of one block.
    pub bytes_per_block: u64,
    /// The hit rate of an infinite cache over the measured requests.
    pub infinite_hit_rate: f64,
    /// G1 alone, under LRU.
    pub baseline: Baseline,
    /// One row per configuration.
    pub rows: Vec<PlanRow>,
    /// The index in `rows` of the configuration with the fewest G2+G3+G4
    /// bytes whose hit rate is within one point of the infinite cache's.
    pub smallest_within_1_point: Option<usize>,
}

/// Plans every configuration; `threads` simulations at once.
pub fn plan(
    tree: &PrefixTree,
    block_size: u32,
    model: PlanModel,
    hw: &Hardware,
    configs: &[Tiers],
    warmup: f64,
    threads: usize,
) -> Plan {
    let from = tree.measured_from(warmup);
    let bytes_per_block = model.bytes_per_token * u64::from(block_size);
    let blocks = |bytes: u64| bytes / bytes_per_block.max(1);
    // Every cumulative capacity any configuration needs, simulated once.
    let mut capacities: Vec<u64> = Vec::new();
    for t in configs {
        for c in levels(t) {
            let c = blocks(c);
            if c > 0 && !capacities.contains(&c) {
                capacities.push(c);
            }
        }
    }
    let kvtier = SimPolicy::Online(EvictionKind::Kvtier);
    let runs = run_all(tree, kvtier, &capacities, from, threads);
    let g1 = configs.first().map_or(hw.g1_kv_bytes, |t| t.g1_bytes);
    let lru = SimPolicy::Online(EvictionKind::Lru);
    let base_run = (blocks(g1) > 0).then(|| sim::run(tree, lru, blocks(g1), from));

    let measured: Vec<u64> = tree.requests[from..]
        .iter()
        .map(|r| r.clone().map(|e| u64::from(tree.tokens[e])).sum())
        .collect();
    let total_tokens: u64 = measured.iter().sum();
    let span = |a: usize| {
        let first = tree.time_s.get(a).copied().unwrap_or(0.0);
        let last = tree.time_s.last().copied().unwrap_or(0.0);
        (last - first).max(1e-9)
    };
    let measured_span = span(from);
    let trace_span = span(0);
    let flop_s = 2.0 * model.parameters as f64 / hw.prefill_flops_per_s;
    let bpt = model.bytes_per_token as f64;
    let restore_s = [
        0.0,
        bpt / hw.g2_read_bytes_per_s,
        bpt / hw.g3_read_bytes_per_s,
        bpt / hw.g4_read_bytes_per_s,
    ];
    let per_mtok = |seconds: f64| {
        let per_token = seconds / total_tokens.max(1) as f64;
        (
            hw.busy_watts * per_token * 1e6,
            hw.cost.cost_per_hour(hw.busy_watts) * per_token * 1e6 / 3600.0,
        )
    };

    let base_hits: Vec<u64> = match &base_run {
        Some(o) => o.request_hits.iter().map(|&h| u64::from(h)).collect(),
        None => vec![0; measured.len()],
    };
    let base_times: Vec<f64> = measured
        .iter()
        .zip(&base_hits)
        .map(|(&t, &h)| (t - h) as f64 * flop_s)
        .collect();
    let base_seconds: f64 = base_times.iter().sum();
    let (bj, busd) = per_mtok(base_seconds);
    let base_hit_tokens: u64 = base_hits.iter().sum();
    let baseline = Baseline {
        hit_rate: share(base_hit_tokens, total_tokens),
        ttft_p50_s: median(base_times),
        joules_per_million_tokens: bj,
        usd_per_million_tokens: busd,
    };

    let mut rows = Vec::new();
    for t in configs {
        let lv = levels(t).map(blocks);
        // Hits per request at each cumulative level.
        let at = |c: u64| runs.get(&c);
        let mut tier_tokens = [0u64; 4];
        let mut times = Vec::with_capacity(measured.len());
        let mut seconds = 0.0;
        for (i, &tokens) in measured.iter().enumerate() {
            let mut below = 0u64;
            let mut time = 0.0;
            for k in 0..4 {
                let h = at(lv[k]).map_or(0, |o| u64::from(o.request_hits[i]));
                let here = h.saturating_sub(below);
                tier_tokens[k] += here;
                time += here as f64 * restore_s[k];
                below = below.max(h);
            }
            time += (tokens - below.min(tokens)) as f64 * flop_s;
            seconds += time;
            times.push(time);
        }
        let hit: u64 = tier_tokens.iter().sum();
        let (j, usd) = per_mtok(seconds);
        let writes = if t.g3_bytes > 0 {
            at(lv[2]).map_or(0, |o| o.writes)
        } else {
            0
        };
        let write_bytes_per_day = (writes * bytes_per_block) as f64 / trace_span * 86_400.0;
        rows.push(PlanRow {
            tiers: *t,
            hit_rate: share(hit, total_tokens),
            hit_rate_by_tier: PerTier::from_array(tier_tokens.map(|x| share(x, total_tokens))),
            restore_bytes_per_s: PerTier::from_array([
                0.0,
                tier_tokens[1] as f64 * bpt / measured_span,
                tier_tokens[2] as f64 * bpt / measured_span,
                tier_tokens[3] as f64 * bpt / measured_span,
            ]),
            g3_write_bytes_per_day: write_bytes_per_day,
            g3_drive_writes_per_day: (t.g3_bytes > 0)
                .then(|| write_bytes_per_day / t.g3_bytes as f64),
            prefill_tokens_avoided_per_s: hit.saturating_sub(base_hit_tokens) as f64
                / measured_span,
            accelerator_s_saved_per_hour: (base_seconds - seconds) / measured_span * 3600.0,
            ttft_p50_s: median(times),
            joules_per_million_tokens: j,
            usd_per_million_tokens: usd,
        });
    }
    let infinite_hit_rate = tree.infinite_hits(from).token_rate();
    let smallest_within_1_point = rows
        .iter()
        .enumerate()
        .filter(|(_, r)| r.hit_rate >= infinite_hit_rate - 0.01)
        .min_by_key(|(_, r)| r.tiers.g2_bytes + r.tiers.g3_bytes + r.tiers.g4_bytes)
        .map(|(i, _)| i);
    Plan {
        bytes_per_token: model.bytes_per_token,
        bytes_per_block,
        infinite_hit_rate,
        baseline,
        rows,
        smallest_within_1_point,
    }
}

/// The cumulative capacities of a configuration, in bytes.
fn levels(t: &Tiers) -> [u64; 4] {
    let a = t.g1_bytes;
    let b = a.saturating_add(t.g2_bytes);
    let c = b.saturating_add(t.g3_bytes);
    [a, b, c, c.saturating_add(t.g4_bytes)]
}

fn run_all(
    tree: &PrefixTree,
    policy: SimPolicy,
    capacities: &[u64],
    from: usize,
    threads: usize,
) -> HashMap<u64, Outcome> {
    let next = std::sync::atomic::AtomicUsize::new(0);
    std::thread::scope(|s| {
        let workers: Vec<_> = (0..threads.max(1))
            .map(|_| {
                s.spawn(|| {
                    let mut mine = Vec::new();
                    while let Some(&c) =
                        capacities.get(next.fetch_add(1, std::sync::atomic::Ordering::Relaxed))
                    {
                        mine.push((c, sim::run(tree, policy, c, from)));
                    }
                    mine
                })
            })
            .collect();
        workers
            .into_iter()
            .flat_map(|w| w.join().unwrap_or_default())
            .collect()
    })
}

fn share(a: u64, b: u64) -> f64 {
    if b == 0 { 0.0 } else { a as f64 / b as f64 }
}

fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    let m = v.len() / 2;
    if v.len() % 2 == 1 {
        v[m]
    } else {
        (v[m - 1] + v[m]) / 2.0
    }
}

/// The plan as the text `kvtier plan` prints.
pub fn text(p: &Plan, hardware: &str) -> String {
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    let mut out = format!(
        "machine: {hardware}\nKV: {} bytes/token, {:.1} MiB/block; infinite-cache hit {:.2} %\n\
         baseline (G1 alone, LRU): hit {:.2} %, TTFT p50 {:.3} s, {:.0} J and {:.4} USD per million prompt tokens\n\n",
        p.bytes_per_token,
        p.bytes_per_block as f64 / (1u64 << 20) as f64,
        p.infinite_hit_rate * 100.0,
        p.baseline.hit_rate * 100.0,
        p.baseline.ttft_p50_s,
        p.baseline.joules_per_million_tokens,
        p.baseline.usd_per_million_tokens,
    );
    out += &format!(
        "{:>8} {:>8} {:>8} {:>7} | {:>6} {:>6} {:>6} {:>6} | {:>9} {:>9} {:>9} | {:>8} {:>6} | {:>9} {:>8} {:>8} {:>9}\n",
        "G2 GiB",
        "G3 GiB",
        "G4 GiB",
        "hit %",
        "G1 %",
        "G2 %",
        "G3 %",
        "G4 %",
        "G2 MB/s",
        "G3 MB/s",
        "G4 MB/s",
        "G3 GB/d",
        "DWPD",
        "acc-s/h",
        "TTFT p50",
        "J/Mtok",
        "USD/Mtok"
    );
    for (i, r) in p.rows.iter().enumerate() {
        let t = &r.tiers;
        let h = &r.hit_rate_by_tier;
        let b = &r.restore_bytes_per_s;
        out += &format!(
            "{:>8.0} {:>8.0} {:>8.0} {:>7.2} | {:>6.2} {:>6.2} {:>6.2} {:>6.2} | {:>9.1} {:>9.1} {:>9.1} | {:>8.1} {:>6} | {:>9.1} {:>8.3} {:>8.0} {:>9.4}{}\n",
            gib(t.g2_bytes),
            gib(t.g3_bytes),
            gib(t.g4_bytes),
            r.hit_rate * 100.0,
            h.g1 * 100.0,
            h.g2 * 100.0,
            h.g3 * 100.0,
            h.g4 * 100.0,
            b.g2 / 1e6,
            b.g3 / 1e6,
            b.g4 / 1e6,
            r.g3_write_bytes_per_day / 1e9,
            r.g3_drive_writes_per_day
                .map_or("-".into(), |d| format!("{d:.2}")),
            r.accelerator_s_saved_per_hour,
            r.ttft_p50_s,
            r.joules_per_million_tokens,
            r.usd_per_million_tokens,
            if p.smallest_within_1_point == Some(i) {
                "  <- smallest within 1 point of infinite"
            } else {
                ""
            },
        );
    }
    if p.smallest_within_1_point.is_none() {
        out += "no configuration comes within 1 point of the infinite cache\n";
    }
    out
}
