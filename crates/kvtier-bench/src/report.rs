//! Results of a cold-recovery run and their renderings: JSON (the contract
//! other tools read), Markdown and a terminal table.

use serde::Serialize;

use crate::gates::GateResult;
use crate::report_table::{Cell, Column, Table};
use crate::stats::Percentiles;

/// `2026-11-30T17-25-00Z`: an RFC 3339 UTC time usable as a directory name.
pub fn timestamp_for_path(t: std::time::SystemTime) -> String {
    humantime::format_rfc3339_seconds(t)
        .to_string()
        .replace(':', "-")
}

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
    /// Why it failed, if it did.
    pub error: Option<String>,
}

/// Tokens per tier.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct TierTokens {
    /// Accelerator pages (G1).
    pub g1: usize,
    /// Host memory (G2).
    pub g2: usize,
    /// Disk (G3).
    pub g3: usize,
    /// Shared pool (G4).
    #[serde(default)]
    pub g4: usize,
}

impl TierTokens {
    /// Adds another count.
    pub fn add(&mut self, o: TierTokens) {
        self.g1 += o.g1;
        self.g2 += o.g2;
        self.g3 += o.g3;
        self.g4 += o.g4;
    }

    /// Tokens from every tier.
    pub fn total(&self) -> usize {
        self.g1 + self.g2 + self.g3 + self.g4
    }
}

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
    /// Restored KV bytes / engine restore time, GB/s (0 for baseline).
    pub restore_gbps: f64,
    /// The byte-moving floor of TTFT p50: restored bytes at the device limit
    /// plus the uncached suffix at the measured prefill rate (baseline: the
    /// whole prompt at that rate).
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

/// The machine the run was measured on.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct MachineInfo {
    /// CPU model name.
    pub cpu: String,
    /// Logical CPUs.
    pub cores: usize,
    /// Total memory, bytes.
    pub memory_bytes: u64,
    /// Raw O_DIRECT sequential read limit of the cache device, GB/s,
    /// measured in this run.
    pub device_limit_gbps: f64,
    /// Every device-limit sample, GB/s.
    pub device_limit_samples_gbps: Vec<f64>,
    /// I/O mode of the G3 tier.
    pub io_mode: String,
}

/// The whole report.
#[derive(Debug, Clone, Default, Serialize)]
pub struct BenchReport {
    /// Workload name ("cold-recovery").
    pub workload: String,
    /// What was driven ("in-process engine", or an endpoint URL).
    pub target: String,
    /// Every run.
    pub results: Vec<RunSummary>,
    /// kvtier / baseline per concurrency.
    pub ratios: Vec<Ratio>,
    /// Gate verdicts.
    pub gates: Vec<GateResult>,
    /// The power meter used (e.g. "model (modelled)").
    pub energy_meter: String,
    /// True when energy is modelled, not measured.
    pub energy_modelled: bool,
    /// Why that meter was chosen.
    pub energy_meter_reason: String,
    /// The cost model's assumptions.
    pub cost_model: serde_json::Value,
    /// The machine.
    pub machine: MachineInfo,
    /// The workload configuration.
    pub config: serde_json::Value,
    /// Prefill tokens per second measured in pass 1 (used for floors).
    pub prefill_tok_s: f64,
    /// Seconds pass 1 took (computing and storing every session's KV).
    pub pass1_s: f64,
    /// When it ran (RFC 3339, UTC).
    pub started_at: String,
}

/// The columns of the runs table, in the terminal and in Markdown.
const RUN_COLUMNS: &[Column] = &[
    Column::new("conc", "concurrency", 4, 0),
    Column::new("mode", "mode", 9, 0),
    Column::new("TTFT p50", "TTFT p50 (s)", 9, 3)
        .text_decimals(2)
        .suffixed(8, "s"),
    Column::new("TTFT p90", "TTFT p90 (s)", 9, 3)
        .text_decimals(2)
        .suffixed(8, "s"),
    Column::new("TTFT p99", "TTFT p99 (s)", 9, 3)
        .text_decimals(2)
        .suffixed(8, "s"),
    Column::new("out tok/s", "output tok/s", 10, 1),
    Column::new("J/token", "J/token", 9, 3),
    Column::new("$/Mtok", "$/M tokens", 10, 2),
    Column::new("restore", "restore GB/s", 9, 2).suffixed(6, "GB/s"),
    Column::new("floor", "TTFT floor (s)", 9, 3)
        .text_decimals(2)
        .suffixed(8, "s"),
    Column::new("failed", "failed", 6, 0),
];

impl BenchReport {
    /// Every run, one row each.
    fn runs_table(&self) -> Table {
        let rows = self
            .results
            .iter()
            .map(|r| {
                vec![
                    Cell::Int(u64::from(r.concurrency)),
                    Cell::Text(r.mode.as_str().into()),
                    Cell::Num(r.ttft_p50_s),
                    Cell::Num(r.ttft_p90_s),
                    Cell::Num(r.ttft_p99_s),
                    Cell::Num(r.throughput_tok_s),
                    Cell::Num(r.joules_per_token),
                    Cell::Num(r.cost_per_mtok_usd),
                    Cell::Num(r.restore_gbps),
                    Cell::Num(r.floor_ttft_s),
                    Cell::Int(r.failed as u64),
                ]
            })
            .collect();
        Table {
            columns: RUN_COLUMNS,
            rows,
        }
    }

    /// Names of the gates that failed, comma-separated.
    pub fn failed_gates(&self) -> String {
        self.gates
            .iter()
            .filter(|g| !g.passed)
            .map(|g| g.name.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// True when every gate passed.
    pub fn gates_passed(&self) -> bool {
        self.gates.iter().all(|g| g.passed)
    }

    /// The terminal table.
    pub fn table(&self) -> String {
        let mut s = self.runs_table().text();
        s.push_str("\nkvtier / baseline\n");
        for q in &self.ratios {
            s.push_str(&format!(
                "  concurrency {:>2}: TTFT p50 x{:.3} ({:+.1} %), throughput x{:.2} ({:+.1} %), J/token x{:.3}\n",
                q.concurrency,
                q.ttft_p50,
                (q.ttft_p50 - 1.0) * 100.0,
                q.throughput,
                (q.throughput - 1.0) * 100.0,
                q.joules_per_token
            ));
        }
        s.push_str("\ngates\n");
        for g in &self.gates {
            let verdict = if g.passed { "PASS" } else { "FAIL" };
            match &g.missing {
                None => s.push_str(&format!(
                    "  {verdict}  {}: {:.3} (min {:.3})\n",
                    g.name, g.value, g.min
                )),
                Some(why) => {
                    s.push_str(&format!("  {verdict}  {}: not measured ({why})\n", g.name))
                }
            }
        }
        s.push_str(&format!(
            "\nenergy: {} ({}){}\n",
            self.energy_meter,
            self.energy_meter_reason,
            if self.energy_modelled {
                " -- modelled, not measured"
            } else {
                ""
            }
        ));
        s.push_str(&format!(
            "device limit: {:.2} GB/s ({}); prefill {:.0} tok/s\n",
            self.machine.device_limit_gbps, self.machine.io_mode, self.prefill_tok_s
        ));
        s
    }

    /// The Markdown report.
    pub fn markdown(&self) -> String {
        let mut s = format!(
            "# kvtier {} benchmark\n\n- started: {}\n- target: {}\n- machine: {} ({} CPUs, {:.1} GiB), device limit {:.2} GB/s ({})\n- energy: {}{}\n\n",
            self.workload,
            self.started_at,
            self.target,
            self.machine.cpu,
            self.machine.cores,
            self.machine.memory_bytes as f64 / (1u64 << 30) as f64,
            self.machine.device_limit_gbps,
            self.machine.io_mode,
            self.energy_meter,
            if self.energy_modelled {
                " (modelled, not measured)"
            } else {
                ""
            }
        );
        s.push_str(&self.runs_table().markdown());
        s.push_str("\n| concurrency | TTFT p50 kvtier/baseline | throughput kvtier/baseline | J/token kvtier/baseline |\n|---|---|---|---|\n");
        for q in &self.ratios {
            s.push_str(&format!(
                "| {} | {:.3} | {:.2} | {:.3} |\n",
                q.concurrency, q.ttft_p50, q.throughput, q.joules_per_token
            ));
        }
        s.push_str("\n| gate | value | min | verdict |\n|---|---|---|---|\n");
        for g in &self.gates {
            s.push_str(&format!(
                "| {} | {:.3} | {:.3} | {} |\n",
                g.name,
                g.value,
                g.min,
                if g.passed { "PASS" } else { "FAIL" }
            ));
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_has_the_contract_fields() {
        let report = BenchReport {
            results: vec![RunSummary {
                concurrency: 8,
                mode: Mode::Kvtier,
                ttft_p50_s: 1.5,
                ..Default::default()
            }],
            energy_meter: "model (modelled)".into(),
            ..Default::default()
        };
        let v = serde_json::to_value(&report).unwrap();
        let r = &v["results"][0];
        assert_eq!(r["concurrency"], 8);
        assert_eq!(r["mode"], "kvtier");
        for key in [
            "ttft_p50_s",
            "ttft_p99_s",
            "throughput_tok_s",
            "joules_per_token",
            "restore_gbps",
            "floor_ttft_s",
        ] {
            assert!(r[key].is_f64(), "{key} missing or not a number: {r}");
        }
        assert!(v["gates"].is_array());
        assert_eq!(v["energy_meter"], "model (modelled)");
    }

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

    #[test]
    fn the_runs_table_renders_as_text_and_markdown() {
        let mk = |c, m, x: f64| RunSummary {
            concurrency: c,
            mode: m,
            ttft_p50_s: x,
            ttft_p90_s: x * 2.0,
            ttft_p99_s: x * 3.0,
            throughput_tok_s: 1234.56,
            joules_per_token: 0.1234,
            cost_per_mtok_usd: 12.345,
            restore_gbps: 1.5,
            floor_ttft_s: 0.01,
            failed: 2,
            ..Default::default()
        };
        let report = BenchReport {
            results: vec![mk(1, Mode::Baseline, 0.5), mk(16, Mode::Kvtier, 123.456)],
            ..Default::default()
        };
        let text = report.table();
        assert!(text.starts_with(
            "conc      mode  TTFT p50  TTFT p90  TTFT p99  out tok/s   J/token     $/Mtok   restore     floor failed\n\
             \x20  1  baseline     0.50s     1.00s     1.50s     1234.6     0.123      12.35   1.50GB/s     0.01s      2\n\
             \x20 16    kvtier   123.46s   246.91s   370.37s     1234.6     0.123      12.35   1.50GB/s     0.01s      2\n"
        ), "{text}");
        let md = report.markdown();
        assert!(md.contains(
            "| concurrency | mode | TTFT p50 (s) | TTFT p90 (s) | TTFT p99 (s) | output tok/s | J/token | $/M tokens | restore GB/s | TTFT floor (s) | failed |\n\
             |---|---|---|---|---|---|---|---|---|---|---|\n\
             | 1 | baseline | 0.500 | 1.000 | 1.500 | 1234.6 | 0.123 | 12.35 | 1.50 | 0.010 | 2 |\n\
             | 16 | kvtier | 123.456 | 246.912 | 370.368 | 1234.6 | 0.123 | 12.35 | 1.50 | 0.010 | 2 |\n"
        ), "{md}");
    }
}
