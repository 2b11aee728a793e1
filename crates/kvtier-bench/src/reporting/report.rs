//! Results of a cold-recovery run and their renderings: JSON (the contract
//! other tools read), Markdown and a terminal table.

use serde::Serialize;

use crate::cold_recovery::accuracy::Accuracy;
pub use crate::cold_recovery::overlap::Overlap;
use crate::reporting::gates::GateResult;
use crate::reporting::report_table::{Cell, Column, Table};
pub use crate::reporting::run_summary::{
    Mode, Ratio, RequestRecord, RunSummary, TierTokens, ratios,
};

/// `2026-11-30T17-25-00Z`: an RFC 3339 UTC time usable as a directory name.
pub fn timestamp_for_path(t: std::time::SystemTime) -> String {
    humantime::format_rfc3339_seconds(t)
        .to_string()
        .replace(':', "-")
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
    /// One decode step, seconds: the median gap between output tokens in
    /// the baseline run at the lowest concurrency. A floor's uncached
    /// suffix costs at least this (a forward pass reads every weight,
    /// however few tokens it computes).
    pub decode_step_s: f64,
    /// Seconds pass 1 took (computing and storing every session's KV).
    pub pass1_s: f64,
    /// When it ran (RFC 3339, UTC).
    pub started_at: String,
    /// How the store kept the KV (`--kv-offload-codec`; "unknown" for an
    /// endpoint).
    pub kv_offload_codec: String,
    /// Restored answers against recomputed ones at concurrency 1 (in
    /// process only; [`crate::cold_recovery::accuracy`]).
    pub accuracy: Option<Accuracy>,
    /// The restored TTFT at concurrency 1 against the larger of the restore and
    /// the suffix's compute ([`crate::cold_recovery::overlap`]; measured in
    /// process only, where the bench can drop a session's prefix again: an
    /// endpoint's server is run as it is).
    pub overlap: Option<Overlap>,
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
            "device limit: {:.2} GB/s ({}); prefill {:.0} tok/s; decode step {:.1} ms\n",
            self.machine.device_limit_gbps,
            self.machine.io_mode,
            self.prefill_tok_s,
            self.decode_step_s * 1e3
        ));
        s.push_str(&self.overlap_line());
        s.push_str(&self.accuracy_line());
        s
    }

    /// The restored TTFT at concurrency 1 against its two parts, one line;
    /// a second with the scheduler's own timing where it gave one.
    fn overlap_line(&self) -> String {
        match &self.overlap {
            Some(o) => {
                let mut s = format!(
                    "TTFT p50 at concurrency 1, {} sessions restored{} and then sent again: restored {:.1} ms (its forward pass waited {:.2} ms for restored layers), prefix in G1 {:.1} ms, read at the device limit {:.1} ms; restored / the larger {:.3}\n",
                    o.pairs,
                    if o.page_cache_dropped {
                        ""
                    } else {
                        " (page cache not dropped first)"
                    },
                    o.restored_ttft_p50_s * 1e3,
                    o.layer_wait_p50_s * 1e3,
                    o.hot_ttft_p50_s * 1e3,
                    o.read_floor_s * 1e3,
                    o.ratio
                );
                if o.server_ratio > 0.0 {
                    s.push_str(&format!(
                        "  as the scheduler timed them (to the first token sampled): restored {:.1} ms, prefix in G1 {:.1} ms; restored / the larger {:.3}\n",
                        o.restored_server_ttft_p50_s * 1e3,
                        o.hot_server_ttft_p50_s * 1e3,
                        o.server_ratio
                    ));
                }
                s
            }
            None => String::new(),
        }
    }

    /// The KV codec, the logical restore rate and the accuracy, one line
    /// each.
    fn accuracy_line(&self) -> String {
        let mut s = format!("KV offload codec: {}", self.kv_offload_codec);
        if let Some(r) = self
            .results
            .iter()
            .find(|r| r.mode == Mode::Kvtier && r.restored_bytes > 0)
        {
            s.push_str(&format!(
                "; restore at concurrency {}: {:.2} GB/s stored, {:.2} GB/s of f32 KV",
                r.concurrency, r.restore_gbps, r.restore_gbps_logical
            ));
        }
        s.push('\n');
        match &self.accuracy {
            Some(a) => s.push_str(&format!(
                "restored vs recomputed (concurrency 1, {} requests, {} tokens): greedy agreement min {:.3} (worst {}), mean {:.3}, {} identical; max |delta logprob| top-5 {:.4}; the reference's top-2 gap p50 {:.4}, at a divergence at most {:.4}\n",
                a.requests,
                a.tokens,
                a.greedy_agreement_min,
                a.worst,
                a.greedy_agreement_mean,
                a.identical_requests,
                a.max_abs_delta_logprob_top5,
                a.reference_margin_p50,
                a.max_margin_at_divergence
            )),
            None => s.push_str("restored vs recomputed: not measured (needs concurrency 1 in process)\n"),
        }
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
        s.push('\n');
        for line in self
            .overlap_line()
            .lines()
            .chain(self.accuracy_line().lines())
        {
            s.push_str(&format!("- {line}\n"));
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
            "restore_gbps_logical",
            "floor_ttft_s",
        ] {
            assert!(r[key].is_f64(), "{key} missing or not a number: {r}");
        }
        assert!(r["restored_bytes"].is_u64());
        assert!(v["kv_offload_codec"].is_string());
        assert!(v["accuracy"].is_null(), "not measured: null");
        assert!(v["overlap"].is_null(), "not measured: null");
        assert!(v["gates"].is_array());
        assert_eq!(v["energy_meter"], "model (modelled)");
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
