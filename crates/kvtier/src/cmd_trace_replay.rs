//! `kvtier trace replay`: a trace replayed against live OpenAI-compatible
//! servers ([`kvtier_bench::replay`]).

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Args;
use kvtier_bench::TextReport;
use kvtier_bench::replay::{self, Arrivals, ReplayOptions, Restart, Server, StartAt};
use kvtier_bench::reporting::run_summary::Mode;
use kvtier_bench::targets::endpoint::{Endpoint, EndpointOptions};
use kvtier_trace::prompts::DEFAULT_IDS;

use crate::cmd_trace::{TraceInput, read};

/// `kvtier trace replay`.
#[derive(Debug, Args)]
pub struct ReplayArgs {
    #[command(flatten)]
    input: TraceInput,

    /// The server under test (`http://host:port`): kvtier serve, vLLM with
    /// kvtier's connector, any OpenAI-compatible server taking token-id
    /// prompts on /v1/completions.
    #[arg(long, value_name = "URL")]
    endpoint: String,

    /// The model name to send [default: the first the server lists].
    #[arg(long, value_name = "NAME", default_value = "")]
    model_name: String,

    /// A baseline server, replayed after the first (say `kvtier serve
    /// --no-prefix-reuse`, or vLLM alone); gates and output comparison are
    /// against it.
    #[arg(long, value_name = "URL")]
    baseline_endpoint: Option<String>,

    /// The baseline's model name [default: --model-name].
    #[arg(long, value_name = "NAME", requires = "baseline_endpoint")]
    baseline_model_name: Option<String>,

    /// Tokens a full block of the trace becomes [default: the trace's block
    /// size x --token-scale].
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    block_tokens: Option<u32>,

    /// Scales the trace's token counts, prompts and outputs alike (0.0625
    /// or 1/16).
    #[arg(long, value_name = "F", default_value = "1/16", value_parser = scale_arg)]
    token_scale: f64,

    /// Generated tokens per request at most (after scaling).
    #[arg(long, value_name = "N", default_value_t = 64)]
    max_output_tokens: usize,

    /// Multiplies the trace's time gaps (open loop: arrivals; closed loop:
    /// think times); 0 sends as soon as allowed.
    #[arg(long, value_name = "F", default_value_t = 1.0, value_parser = nonneg_arg)]
    time_scale: f64,

    /// Closed loop: this many sessions at a time, each request after the
    /// previous one's answer [default: open loop at the trace's times].
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    sessions_parallel: Option<u32>,

    /// Open loop: at most this many requests in flight (a request due
    /// meanwhile waits) [default: no limit]. With --time-scale 0 and 1 the
    /// replay is sequential, in trace order.
    #[arg(long, value_name = "N", conflicts_with = "sessions_parallel")]
    max_concurrency: Option<usize>,

    /// Keep this share of the trace's conversations, each whole (a session,
    /// or the requests sharing their first block after the prefix all
    /// share): a lighter load that keeps the trace's reuse, unlike a cut of
    /// its first minutes. Applied before --start-at and --max-requests.
    #[arg(long, value_name = "FRACTION", default_value = "1", value_parser = share_arg)]
    sample: f64,

    /// Replay at most this many requests.
    #[arg(long, value_name = "N")]
    max_requests: Option<usize>,

    /// Where the cut starts: a request index (120) or trace seconds (600s).
    #[arg(long, value_name = "N|SECONDS", default_value = "0")]
    start_at: StartAt,

    /// Longest one request may take (humantime: 90s, 10m).
    #[arg(long, value_name = "DURATION", default_value = "10m", value_parser = humantime::parse_duration)]
    request_timeout: Duration,

    /// Run this (`sh -c`) at --restart-at to stop and start the server under
    /// test, and the baseline's in its run; it gets KVTIER_REPLAY_SERVER
    /// (kvtier or baseline) and KVTIER_REPLAY_ENDPOINT (the URL). The replay
    /// then waits for the server to serve the model again.
    #[arg(long, value_name = "CMD", requires = "restart_at")]
    restart_cmd: Option<String>,

    /// Share of the requests sent before the restart (0.5: halfway).
    #[arg(long, value_name = "FRACTION", requires = "restart_cmd")]
    restart_at: Option<f64>,

    /// Longest wait for a restarted server to serve again.
    #[arg(long, value_name = "DURATION", default_value = "10m", value_parser = humantime::parse_duration)]
    restart_timeout: Duration,

    /// Requests per report window [default: a fifth of each side of the
    /// restart].
    #[arg(long, value_name = "N", default_value_t = 0)]
    window: usize,

    /// Prompt token ids are drawn from LO..HI (kept clear of special
    /// tokens; see docs/guides/traces.md).
    #[arg(long, value_name = "LO..HI", default_value = "3..256", value_parser = ids_arg)]
    token_ids: std::ops::Range<u32>,

    /// Skip the simulator's prediction of the kvtier server's hits.
    #[arg(long)]
    no_predict: bool,

    /// Where the report goes [default: bench-results/trace-replay-<timestamp>].
    #[arg(long, value_name = "DIR")]
    out: Option<PathBuf>,

    /// Print the JSON report on stdout (the table goes to stderr).
    #[arg(long)]
    json: bool,
}

fn scale_arg(s: &str) -> Result<f64, String> {
    let v = match s.split_once('/') {
        Some((a, b)) => {
            let (a, b): (f64, f64) = (
                a.trim()
                    .parse()
                    .map_err(|_| format!("{s:?}: not a number"))?,
                b.trim()
                    .parse()
                    .map_err(|_| format!("{s:?}: not a number"))?,
            );
            a / b
        }
        None => s
            .trim()
            .parse()
            .map_err(|_| format!("{s:?}: not a number"))?,
    };
    if v.is_finite() && v > 0.0 {
        Ok(v)
    } else {
        Err(format!("{s:?}: must be above 0"))
    }
}

fn share_arg(s: &str) -> Result<f64, String> {
    let v = scale_arg(s)?;
    if v <= 1.0 {
        Ok(v)
    } else {
        Err(format!("{s:?}: a share from above 0 up to 1"))
    }
}

fn nonneg_arg(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(v) if v.is_finite() && v >= 0.0 => Ok(v),
        _ => Err(format!("{s:?}: a number, 0 or more")),
    }
}

fn ids_arg(s: &str) -> Result<std::ops::Range<u32>, String> {
    let bad = || {
        format!(
            "{s:?}: expected LO..HI, e.g. {}..{}",
            DEFAULT_IDS.start, DEFAULT_IDS.end
        )
    };
    let (lo, hi) = s.split_once("..").ok_or_else(bad)?;
    let (lo, hi): (u32, u32) = (
        lo.trim().parse().map_err(|_| bad())?,
        hi.trim().parse().map_err(|_| bad())?,
    );
    if hi < lo.saturating_add(2) {
        return Err(format!("{s:?}: at least two ids are needed"));
    }
    Ok(lo..hi)
}

/// Runs `kvtier trace replay`.
pub fn run(a: &ReplayArgs) -> Result<()> {
    let trace = read(&a.input)?;
    let endpoint_options = EndpointOptions {
        request_timeout: a.request_timeout,
        ..EndpointOptions::default()
    };
    let kvtier = Server {
        endpoint: Endpoint::with_options(&a.endpoint, &a.model_name, endpoint_options)?,
        mode: Mode::Kvtier,
    };
    let baseline = a
        .baseline_endpoint
        .as_deref()
        .map(|url| {
            let model = a.baseline_model_name.as_deref().unwrap_or(&a.model_name);
            Endpoint::with_options(url, model, endpoint_options).map(|endpoint| Server {
                endpoint,
                mode: Mode::Baseline,
            })
        })
        .transpose()?;
    let restart = match (&a.restart_cmd, a.restart_at) {
        (Some(command), Some(at)) => Some(Restart {
            command: command.clone(),
            at,
            ready_timeout: a.restart_timeout,
        }),
        _ => None,
    };
    let block_tokens = a
        .block_tokens
        .unwrap_or_else(|| ((f64::from(trace.block_size) * a.token_scale).round() as u32).max(1));
    let opts = ReplayOptions {
        block_tokens,
        token_ids: a.token_ids.clone(),
        output_scale: f64::from(block_tokens) / f64::from(trace.block_size.max(1)),
        max_output_tokens: a.max_output_tokens,
        arrivals: match a.sessions_parallel {
            Some(n) => Arrivals::Closed {
                sessions: n as usize,
                time_scale: a.time_scale,
            },
            None => Arrivals::Open {
                time_scale: a.time_scale,
                max_concurrency: a.max_concurrency.unwrap_or(0),
            },
        },
        sample: a.sample,
        max_requests: a.max_requests,
        start_at: a.start_at,
        restart,
        window: a.window,
        predict: !a.no_predict,
        progress: !a.json,
    };
    let report = replay::replay(&trace, kvtier, baseline, &opts)?;
    let dir = a.out.clone().unwrap_or_else(|| {
        PathBuf::from("bench-results").join(format!(
            "trace-replay-{}",
            kvtier_bench::reporting::report::timestamp_for_path(std::time::SystemTime::now())
        ))
    });
    let files = replay::write_results(&report, &dir)
        .with_context(|| format!("writing the report to {}", dir.display()))?;
    if a.json {
        eprint!("{}", report.table());
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", report.table());
        println!("\nreport: {} ({} files)", dir.display(), files.len());
    }
    Ok(())
}
