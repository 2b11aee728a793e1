//! `kvtier trace replay`: a public trace replayed against live
//! OpenAI-compatible servers (kvtier serve, vLLM with or without kvtier's
//! connector, anything serving `/v1/completions`), the baseline beside it,
//! optionally across a restart, with the simulator's prediction beside the
//! measured hit rate.
//!
//! # What is sent
//!
//! Each request's prompt is made from its block ids
//! ([`kvtier_trace::prompts::PromptBuilder`]): equal ids give equal token
//! runs, so the servers see exactly the trace's sharing, scaled to
//! `block_tokens` per block. Prompts go out as token-id arrays with
//! `ignore_eos`, greedy, streamed, asking for the generated ids
//! ([`Endpoint::complete_ids`]); output lengths are the trace's, scaled like
//! the prompts and capped.
//!
//! # When
//!
//! Open loop: each request at its trace time x `time_scale` from the start
//! of the replay (0 sends as fast as `max_concurrency` lets). Closed loop
//! (`sessions_parallel`): that many sessions at a time, each sending its
//! requests in order, one after the other's answer, waiting the trace's gap
//! x `time_scale` between them (a request without a session is a session of
//! its own).
//!
//! # Restart
//!
//! With a restart command, the requests before `restart_at` of the replay
//! run first; when all have answered, the command runs (`sh -c`, with
//! `KVTIER_REPLAY_SERVER` set to `kvtier` or `baseline` and
//! `KVTIER_REPLAY_ENDPOINT` to the server's URL), the replay waits for the
//! server to serve the model again and sends the rest, their schedule
//! shifted so the first goes out at once. A server that does not come back
//! is reported, and its remaining requests fail and are counted.
//!
//! # The servers in turn
//!
//! The kvtier server runs the whole replay first, then the baseline server
//! (never both at once: they would share the machine). Each run is timed and
//! metered on its own.

mod bound;
mod metrics;
mod plot;
mod report;
mod schedule;

use std::ops::Range;
use std::process::Command;
use std::time::{Duration, Instant};

use kvtier_energy::{MeterOptions, best_meter};
use kvtier_trace::Trace;
use kvtier_trace::prompts::PromptBuilder;
use kvtier_trace::server_sim::{ServerShape, ServerSim, TierTokens};

use crate::bench_error::BenchError;
use crate::reporting::run_summary::Mode;
use crate::targets::endpoint::Endpoint;

pub use self::report::{
    GateVerdict, ReplayReport, ReplaySettings, RequestLine, RunReport, Window, write_results,
};
pub use self::schedule::Arrivals;

/// How a trace is replayed.
#[derive(Debug, Clone)]
pub struct ReplayOptions {
    /// Tokens a full block of the trace becomes.
    pub block_tokens: u32,
    /// Prompt token ids are drawn from this range.
    pub token_ids: Range<u32>,
    /// Output lengths are the trace's x this, at least 1.
    pub output_scale: f64,
    /// At most this many tokens generated per request.
    pub max_output_tokens: usize,
    /// Open or closed loop.
    pub arrivals: Arrivals,
    /// Keep this share (0..=1) of the trace's conversations, each whole
    /// ([`kvtier_trace::sample`]), before cutting.
    pub sample: f64,
    /// At most this many requests (after `start_at`).
    pub max_requests: Option<usize>,
    /// Where the cut starts (in the sampled trace).
    pub start_at: StartAt,
    /// A restart in the middle.
    pub restart: Option<Restart>,
    /// Requests per report window (0: a fifth of each side of the restart).
    pub window: usize,
    /// Predict the kvtier server's hits with the simulator of its own tiers
    /// when its `/metrics` describes them.
    pub predict: bool,
    /// Show progress bars on stderr.
    pub progress: bool,
}

/// Where a cut of the trace starts.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum StartAt {
    /// At this request (0-based, in trace order).
    Request(usize),
    /// At the first request at or after this many seconds of the trace.
    Seconds(f64),
}

impl std::str::FromStr for StartAt {
    type Err = String;

    /// `120` (a request index) or `600s` (seconds of the trace).
    fn from_str(s: &str) -> Result<Self, String> {
        let s = s.trim();
        if let Some(secs) = s.strip_suffix('s') {
            let v: f64 = secs.trim().parse().map_err(|_| {
                format!("--start-at {s:?}: expected a request index or seconds like 600s")
            })?;
            if !v.is_finite() || v < 0.0 {
                return Err(format!("--start-at {s:?}: seconds must be 0 or more"));
            }
            return Ok(StartAt::Seconds(v));
        }
        s.parse()
            .map(StartAt::Request)
            .map_err(|_| format!("--start-at {s:?}: expected a request index or seconds like 600s"))
    }
}

/// A restart in the middle of the replay.
#[derive(Debug, Clone)]
pub struct Restart {
    /// Run with `sh -c`; stops and starts the server under test.
    pub command: String,
    /// Share of the cut's requests sent before it (0 < at < 1).
    pub at: f64,
    /// Longest wait for the server to serve again.
    pub ready_timeout: Duration,
}

/// A server under test.
#[derive(Debug)]
pub struct Server {
    /// Its endpoint, checked reachable.
    pub endpoint: Endpoint,
    /// Whose side it is on.
    pub mode: Mode,
}

/// One request of the cut, ready to send.
#[derive(Debug, Clone)]
pub(crate) struct Prepared {
    /// Its place in the cut.
    pub index: usize,
    /// Its session, if the trace names one.
    pub session: Option<u64>,
    /// Trace seconds from the cut's first request.
    pub time_s: f64,
    /// Token ids.
    pub prompt: Vec<u32>,
    /// Tokens to generate.
    pub max_tokens: usize,
}

/// The requests of the cut (`sample`, then `start_at` and
/// `max_requests`), as prompts.
fn cut(trace: &Trace, opts: &ReplayOptions) -> Result<Vec<Prepared>, BenchError> {
    let builder = PromptBuilder::new(trace.block_size, opts.block_tokens, opts.token_ids.clone())
        .map_err(BenchError::Config)?;
    let sampled;
    let source = if opts.sample < 1.0 {
        sampled = kvtier_trace::sample::conversations(trace, opts.sample);
        &sampled
    } else {
        trace
    };
    let first = first_request(source, opts.start_at);
    let taken: Vec<&kvtier_trace::Request> = source
        .requests
        .iter()
        .skip(first)
        .take(opts.max_requests.unwrap_or(usize::MAX))
        .collect();
    let Some(t0) = taken.first().map(|r| r.time_s) else {
        return Err(BenchError::Config(format!(
            "the cut is empty: {} requests (after sampling) and the cut starts at request {first}",
            source.requests.len()
        )));
    };
    Ok(taken
        .into_iter()
        .enumerate()
        .map(|(index, r)| Prepared {
            index,
            session: r.session,
            time_s: (r.time_s - t0).max(0.0),
            prompt: builder.prompt(r),
            max_tokens: output_tokens(r.output_tokens, opts),
        })
        .collect())
}

/// The index of the cut's first request.
fn first_request(trace: &Trace, start: StartAt) -> usize {
    match start {
        StartAt::Request(i) => i,
        StartAt::Seconds(s) => trace
            .requests
            .iter()
            .position(|r| r.time_s >= s)
            .unwrap_or(trace.requests.len()),
    }
}

/// Fewest tokens a request generates: kvtier serve publishes a sequence
/// as running only before a step that is not its first, so a sequential
/// replay knows a one-token request done too early (see
/// [`metrics::wait_idle`]).
const MIN_OUTPUT_TOKENS: usize = 2;

/// A request's output length: the trace's, scaled, capped, at least
/// [`MIN_OUTPUT_TOKENS`].
fn output_tokens(trace_tokens: u64, opts: &ReplayOptions) -> usize {
    let scaled = (trace_tokens as f64 * opts.output_scale).round() as usize;
    scaled.min(opts.max_output_tokens).max(MIN_OUTPUT_TOKENS)
}

/// Replays `trace` against the kvtier server, then the baseline server if
/// any; returns the report (not yet written anywhere).
pub fn replay(
    trace: &Trace,
    kvtier: Server,
    baseline: Option<Server>,
    opts: &ReplayOptions,
) -> Result<ReplayReport, BenchError> {
    if let Some(r) = &opts.restart
        && !(r.at > 0.0 && r.at < 1.0)
    {
        return Err(BenchError::Config(format!(
            "--restart-at {} must be between 0 and 1 (a share of the requests)",
            r.at
        )));
    }
    let requests = cut(trace, opts)?;
    let split = opts
        .restart
        .as_ref()
        .map(|r| ((requests.len() as f64 * r.at).round() as usize).clamp(1, requests.len()));
    let bounds = bound::per_request(&requests);
    let started_at = humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string();
    let choice = best_meter(&MeterOptions::default())?;
    let mut meter = choice.meter;
    let modelled = matches!(meter.kind(), kvtier_energy::MeterKind::Modelled);
    let mut runs = Vec::new();
    let mut lines = Vec::new();
    for server in std::iter::once(kvtier).chain(baseline) {
        // Read before the run: the shape the server started with.
        let shape = (opts.predict && server.mode == Mode::Kvtier).then(|| {
            let text = server.endpoint.metrics_text().ok_or_else(|| {
                "the server serves no /metrics to read its cache's shape from".to_string()
            })?;
            ServerShape::from_metrics(&text)
        });
        let before = metrics::Hits::scrape(&server.endpoint);
        meter.start()?;
        let mut joules = 0.0;
        let t0 = Instant::now();
        let mut sent = Vec::new();
        let mut pause = Duration::ZERO;
        let mut after_restart_hits = None;
        let phases: Vec<&[Prepared]> = match split {
            Some(s) => vec![&requests[..s], &requests[s..]],
            None => vec![&requests[..]],
        };
        let mut restart_note = None;
        let mut at_restart = None;
        for (i, phase) in phases.iter().enumerate() {
            if i == 1
                && let Some(r) = &opts.restart
            {
                at_restart = metrics::Hits::scrape(&server.endpoint);
                // The restart's time and energy are not the run's.
                joules += meter.read()?.joules_total();
                let t = Instant::now();
                restart_note = restart(&server, r).err();
                pause = t.elapsed();
                meter.start()?;
                after_restart_hits = metrics::Hits::scrape(&server.endpoint);
            }
            let label = format!("{} {}", server.mode.as_str(), server.endpoint.base_url());
            let offset = t0.elapsed().as_secs_f64();
            sent.extend(
                schedule::run_phase(
                    &server.endpoint,
                    phase,
                    &opts.arrivals,
                    &label,
                    opts.progress,
                )
                .into_iter()
                .map(|mut s| {
                    s.sent_at_s += offset;
                    s
                }),
            );
        }
        let wall = t0.elapsed().saturating_sub(pause).as_secs_f64();
        joules += meter.read()?.joules_total();
        let after = metrics::Hits::scrape(&server.endpoint);
        sent.sort_by_key(|s| s.index);
        let prediction = shape.map(|shape| predict(shape?, &requests, &sent, split));
        let (predicted, prediction_note) = match prediction {
            Some(Ok(p)) => (Some(p), None),
            Some(Err(why)) => (None, Some(why)),
            None => (None, None),
        };
        let counters = metrics::Hits::run_delta(before, at_restart, after_restart_hits, after);
        let run = RunReport::build(
            &server,
            &requests,
            &bounds,
            &sent,
            split,
            opts.window,
            wall,
            joules,
            predicted.as_deref(),
            counters,
            restart_note,
            prediction_note,
        );
        lines.extend(RequestLine::of_run(
            &run,
            &requests,
            &sent,
            predicted.as_deref(),
        ));
        runs.push((run, sent));
    }
    Ok(ReplayReport::build(
        trace,
        ReplaySettings::of(opts, requests.len(), split),
        report::fraction_of(&bounds, &requests),
        runs,
        lines,
        started_at,
        format!(
            "{} ({})",
            choice.reason,
            if modelled { "modelled" } else { "measured" }
        ),
    ))
}

/// Stops and starts `server` with the restart command and waits for it.
fn restart(server: &Server, r: &Restart) -> Result<(), String> {
    let status = Command::new("sh")
        .arg("-c")
        .arg(&r.command)
        .env("KVTIER_REPLAY_SERVER", server.mode.as_str())
        .env("KVTIER_REPLAY_ENDPOINT", server.endpoint.base_url())
        .status()
        .map_err(|e| format!("cannot run the restart command: {e}"))?;
    let waited = server.endpoint.wait_ready(r.ready_timeout);
    match (status.success(), waited) {
        (true, Ok(())) => Ok(()),
        (ok, Err(e)) => Err(format!(
            "restart command {}; the server did not come back: {e}",
            if ok { "succeeded" } else { "failed" }
        )),
        (false, Ok(())) => Err(format!(
            "restart command exited with {status}; the server serves again"
        )),
    }
}

/// The simulator of the kvtier server's own tiers, fed the requests in the
/// order they were sent and what the server generated for each: per
/// request of the cut, the predicted hit tokens (exact at concurrency 1);
/// why not, for a server the simulator cannot follow.
fn predict(
    shape: ServerShape,
    requests: &[Prepared],
    sent: &[schedule::Sent],
    split: Option<usize>,
) -> Result<Vec<TierTokens>, String> {
    let mut sim = ServerSim::new(shape)?;
    let mut order: Vec<&schedule::Sent> = sent.iter().collect();
    order.sort_by(|a, b| {
        a.sent_at_s
            .total_cmp(&b.sent_at_s)
            .then(a.index.cmp(&b.index))
    });
    let mut out = vec![TierTokens::default(); requests.len()];
    let mut restarted = split.is_none();
    for s in order {
        if !restarted && split.is_some_and(|k| s.index >= k) {
            sim.restart();
            restarted = true;
        }
        if s.completion.record.error.is_some() {
            continue;
        }
        out[s.index] = sim.request(&requests[s.index].prompt, &s.completion.record.tokens);
    }
    Ok(out)
}
