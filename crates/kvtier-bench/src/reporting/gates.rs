//! Gates: pass/fail criteria checked against a run before it is reported.
//!
//! A gates file is TOML:
//!
//! ```toml
//! [[gate]]
//! name = "G3: TTFT p50 -25% at concurrency 8"
//! metric = "ttft_p50_reduction"   # or "throughput_gain", "joules_per_token_reduction"
//! concurrency = 8
//! min = 0.25
//! ```
//!
//! Reductions are `1 - kvtier / baseline`; gains are `kvtier / baseline - 1`.
//! The default is the brief's main gate "G3": TTFT p50 down at least 25 %
//! and throughput up at least 29 % at concurrency 8 and 16.

use serde::{Deserialize, Serialize};

use crate::reporting::run_summary::{Mode, RunSummary};

/// What a gate measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum GateMetric {
    /// `1 - kvtier TTFT p50 / baseline TTFT p50`.
    TtftP50Reduction,
    /// `kvtier throughput / baseline throughput - 1`.
    ThroughputGain,
    /// `1 - kvtier J/token / baseline J/token`.
    JoulesPerTokenReduction,
}

/// One gate.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Gate {
    /// Shown in reports.
    pub name: String,
    /// What is measured.
    pub metric: GateMetric,
    /// At which concurrency.
    pub concurrency: u32,
    /// Lowest passing value.
    pub min: f64,
}

/// A gates file.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Gates {
    /// The gates, checked in order.
    pub gate: Vec<Gate>,
}

/// A gate's verdict.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct GateResult {
    /// The gate's name.
    pub name: String,
    /// True when `value >= min`.
    pub passed: bool,
    /// The measured value (NaN-free; 0 when it could not be measured).
    pub value: f64,
    /// The threshold.
    pub min: f64,
    /// The metric.
    pub metric: GateMetric,
    /// The concurrency.
    pub concurrency: u32,
    /// Why it could not be evaluated, if so (then `passed` is false).
    pub missing: Option<String>,
}

impl Default for Gates {
    fn default() -> Self {
        let g = |name: &str, metric, concurrency, min| Gate {
            name: name.into(),
            metric,
            concurrency,
            min,
        };
        Self {
            gate: vec![
                g("G3 TTFT p50 -25% @8", GateMetric::TtftP50Reduction, 8, 0.25),
                g(
                    "G3 TTFT p50 -25% @16",
                    GateMetric::TtftP50Reduction,
                    16,
                    0.25,
                ),
                g("G3 throughput +29% @8", GateMetric::ThroughputGain, 8, 0.29),
                g(
                    "G3 throughput +29% @16",
                    GateMetric::ThroughputGain,
                    16,
                    0.29,
                ),
            ],
        }
    }
}

impl Gates {
    /// Parses a gates file; unknown keys are errors.
    pub fn from_toml(text: &str) -> Result<Self, String> {
        let g: Gates = toml::from_str(text).map_err(|e| e.to_string())?;
        if g.gate.is_empty() {
            return Err("a gates file needs at least one [[gate]]".into());
        }
        Ok(g)
    }

    /// Concurrency levels the gates need measured.
    pub fn concurrencies(&self) -> Vec<u32> {
        let mut c: Vec<u32> = self.gate.iter().map(|g| g.concurrency).collect();
        c.sort_unstable();
        c.dedup();
        c
    }

    /// Evaluates every gate against the run summaries.
    pub fn evaluate(&self, runs: &[RunSummary]) -> Vec<GateResult> {
        self.gate
            .iter()
            .map(|g| {
                let find = |mode| {
                    runs.iter()
                        .find(|r| r.mode == mode && r.concurrency == g.concurrency)
                };
                let value = match (find(Mode::Baseline), find(Mode::Kvtier)) {
                    (Some(b), Some(k)) => metric_value(g.metric, b, k),
                    _ => Err(format!(
                        "no baseline and kvtier runs at concurrency {}",
                        g.concurrency
                    )),
                };
                match value {
                    Ok(v) => GateResult {
                        name: g.name.clone(),
                        passed: v >= g.min,
                        value: v,
                        min: g.min,
                        metric: g.metric,
                        concurrency: g.concurrency,
                        missing: None,
                    },
                    Err(why) => GateResult {
                        name: g.name.clone(),
                        passed: false,
                        value: 0.0,
                        min: g.min,
                        metric: g.metric,
                        concurrency: g.concurrency,
                        missing: Some(why),
                    },
                }
            })
            .collect()
    }
}

fn metric_value(m: GateMetric, b: &RunSummary, k: &RunSummary) -> Result<f64, String> {
    let ratio = |num: f64, den: f64, what: &str| {
        if den > 0.0 && num.is_finite() {
            Ok(num / den)
        } else {
            Err(format!("baseline {what} is zero"))
        }
    };
    match m {
        GateMetric::TtftP50Reduction => ratio(k.ttft_p50_s, b.ttft_p50_s, "TTFT").map(|r| 1.0 - r),
        GateMetric::ThroughputGain => {
            ratio(k.throughput_tok_s, b.throughput_tok_s, "throughput").map(|r| r - 1.0)
        }
        GateMetric::JoulesPerTokenReduction => {
            ratio(k.joules_per_token, b.joules_per_token, "joules per token").map(|r| 1.0 - r)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(mode: Mode, c: u32, ttft: f64, tps: f64) -> RunSummary {
        RunSummary {
            mode,
            concurrency: c,
            ttft_p50_s: ttft,
            throughput_tok_s: tps,
            joules_per_token: 1.0,
            ..Default::default()
        }
    }

    #[test]
    fn default_gates_pass_and_fail_on_the_numbers() {
        let runs = vec![
            run(Mode::Baseline, 8, 10.0, 100.0),
            run(Mode::Kvtier, 8, 7.0, 140.0), // -30 %, +40 %: pass
            run(Mode::Baseline, 16, 10.0, 100.0),
            run(Mode::Kvtier, 16, 8.0, 120.0), // -20 %, +20 %: fail
        ];
        let r = Gates::default().evaluate(&runs);
        assert_eq!(r.len(), 4);
        assert!(r[0].passed && (r[0].value - 0.3).abs() < 1e-9);
        assert!(!r[1].passed && (r[1].value - 0.2).abs() < 1e-9);
        assert!(r[2].passed && (r[2].value - 0.4).abs() < 1e-9);
        assert!(!r[3].passed);
    }

    #[test]
    fn missing_runs_fail_with_a_reason() {
        let r = Gates::default().evaluate(&[run(Mode::Baseline, 8, 1.0, 1.0)]);
        assert!(r.iter().all(|g| !g.passed && g.missing.is_some()));
    }

    #[test]
    fn toml_parses_and_rejects_unknown_keys() {
        let ok = "[[gate]]\nname='x'\nmetric='throughput_gain'\nconcurrency=4\nmin=0.1\n";
        let g = Gates::from_toml(ok).unwrap();
        assert_eq!(g.concurrencies(), vec![4]);
        let bad = "[[gate]]\nname='x'\nmetric='throughput_gain'\nconcurrency=4\nmin=0.1\nmax=2\n";
        assert!(Gates::from_toml(bad).unwrap_err().contains("max"));
        assert!(
            Gates::from_toml("[[gate]]\nname='x'\nmetric='speed'\nconcurrency=1\nmin=0\n").is_err()
        );
        assert!(Gates::from_toml("").is_err());
    }
}
