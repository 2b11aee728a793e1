//! An OpenAI-compatible endpoint as a benchmark target: `kvtier serve`,
//! vLLM, llama.cpp's server, or anything else that serves
//! `GET /v1/models` and streamed `POST /v1/completions`.
//!
//! # What is measured
//!
//! Each request POSTs `/v1/completions` with the session text as `prompt`,
//! `max_tokens`, `temperature: 0`, `stream: true` and
//! `stream_options: {include_usage: true}`, and reads the server-sent
//! events as they arrive:
//!
//! * **TTFT** is the time from sending the request to the first chunk whose
//!   text is not empty; **end-to-end** is the time to `data: [DONE]` (or to
//!   the end of the stream when a chunk already carried a `finish_reason`
//!   and the server sends no `[DONE]`).
//! * **Output tokens** come from `usage.completion_tokens` when the server
//!   honours `include_usage`, else they are the count of non-empty text
//!   chunks (one token per chunk, which is what most servers stream).
//! * **Prompt tokens** come from `usage.prompt_tokens`, else the estimate of
//!   [`Target::count_tokens`].
//! * **Hit tokens**: kvtier's additive `kvtier` usage object gives cached
//!   tokens per tier (`kvtier.cached_tokens.{g1,g2,g3}`) and
//!   `kvtier.restored_bytes`. Other servers only report
//!   `usage.prompt_tokens_details.cached_tokens`, whose tier is unknown:
//!   those are all counted in **G1**, the "unknown tier" here. Restore time
//!   is not reported by any server, so `restore_s` stays 0 (and the report's
//!   restore GB/s with it).
//!
//! A failed request (connection refused, HTTP error status, an error event,
//! a stream cut before it finished, a timeout) becomes a [`RequestRecord`]
//! with `error` set: it is counted as failed and the run goes on.
//!
//! # Modes
//!
//! An endpoint cannot switch its prefix cache on and off, nor evict its
//! tiers, from here. [`Target::begin`] accepts both modes and changes
//! nothing: the "baseline" and "kvtier" rows of one run both measure the
//! server as it was started, and the report's target line says so. For
//! side-by-side numbers run the benchmark twice against two servers, for
//! example `kvtier serve --no-prefix-reuse` (recompute) and `kvtier serve`
//! (restore), and compare the two reports.
//!
//! # Tokens
//!
//! There is no tokenizer for a remote model here: [`Target::count_tokens`]
//! estimates one token per 4 bytes of text (rounded up), which is close for
//! English text and BPE vocabularies; the workload's lengths are therefore
//! approximate, while the report's prompt token counts come from the server.
//!
//! # Transport
//!
//! Plain HTTP only (the client is built without a TLS stack): an `https://`
//! URL is refused up front. Proxies from the environment (`HTTP_PROXY`,
//! `NO_PROXY`) are honoured, except for loopback hosts, which are always
//! reached directly.

mod sse;
mod stream;
mod url;

use std::io::{BufReader, Read};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use ureq::Agent;

use crate::bench_error::BenchError;
use crate::cold_recovery::workload::Session;
use crate::reporting::report::{Mode, RequestRecord};
use crate::targets::target::Target;

use self::sse::SseReader;
use self::stream::{StreamState, error_message};
use self::url::normalize_base;

/// Timeouts of an [`Endpoint`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EndpointOptions {
    /// Longest wait to open a connection.
    pub connect_timeout: Duration,
    /// Longest the up-front `GET /v1/models` may take.
    pub probe_timeout: Duration,
    /// Longest one completion may take, from sending it to its last byte.
    pub request_timeout: Duration,
}

impl Default for EndpointOptions {
    fn default() -> Self {
        Self {
            connect_timeout: Duration::from_secs(5),
            probe_timeout: Duration::from_secs(5),
            request_timeout: Duration::from_secs(600),
        }
    }
}

/// Largest error body read back from a server.
const ERROR_BODY_LIMIT: u64 = 64 << 10;
/// Largest model list read back from a server.
const MODELS_BODY_LIMIT: u64 = 4 << 20;
/// Largest metrics page read back from a server.
const METRICS_BODY_LIMIT: u64 = 16 << 20;

/// An OpenAI-compatible server, driven over HTTP (see the module docs for
/// what is measured and how modes are handled).
pub struct Endpoint {
    base: String,
    model: String,
    agent: Agent,
    options: EndpointOptions,
}

impl std::fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Endpoint")
            .field("base", &self.base)
            .field("model", &self.model)
            .field("options", &self.options)
            .finish_non_exhaustive()
    }
}

/// Reads at most `limit` bytes of a response body as text.
fn read_body(body: ureq::Body, limit: u64) -> String {
    let mut bytes = Vec::new();
    // A body that cannot be read is reported as what was read of it.
    let _ = body.into_reader().take(limit).read_to_end(&mut bytes);
    String::from_utf8_lossy(&bytes).into_owned()
}

impl Endpoint {
    /// Connects to the server at `base_url` (`http://host:port`, with or
    /// without a trailing `/v1`) serving `model`, with default timeouts.
    /// See [`Endpoint::with_options`].
    pub fn new(base_url: &str, model: &str) -> Result<Self, BenchError> {
        Self::with_options(base_url, model, EndpointOptions::default())
    }

    /// Connects to the server at `base_url` serving `model`: checks up front,
    /// with `GET /v1/models` and a short timeout, that the server answers and
    /// serves `model` (an empty `model` takes the first one it lists), so a
    /// wrong URL or model is an error before any work starts.
    pub fn with_options(
        base_url: &str,
        model: &str,
        options: EndpointOptions,
    ) -> Result<Self, BenchError> {
        let (base, loopback) = normalize_base(base_url)?;
        let mut config = Agent::config_builder()
            .http_status_as_error(false)
            .timeout_connect(Some(options.connect_timeout))
            .timeout_global(Some(options.request_timeout))
            .max_idle_connections(64)
            .max_idle_connections_per_host(64);
        if loopback {
            config = config.proxy(None);
        }
        let agent: Agent = config.build().into();
        let mut endpoint = Self {
            base,
            model: model.trim().to_string(),
            agent,
            options,
        };
        let served = endpoint.served_models()?;
        if endpoint.model.is_empty() {
            endpoint.model = served.first().cloned().ok_or_else(|| {
                BenchError::Target(format!("{}/v1/models lists no model", endpoint.base))
            })?;
        } else if !served.contains(&endpoint.model) {
            return Err(BenchError::Config(format!(
                "{} does not serve model {:?}; it serves: {}",
                endpoint.base,
                endpoint.model,
                served.join(", ")
            )));
        }
        Ok(endpoint)
    }

    /// The base URL requests go to (without `/v1`).
    pub fn base_url(&self) -> &str {
        &self.base
    }

    /// The model name sent with every request.
    pub fn model(&self) -> &str {
        &self.model
    }

    /// The ids `GET /v1/models` lists.
    fn served_models(&self) -> Result<Vec<String>, BenchError> {
        let url = format!("{}/v1/models", self.base);
        let unreachable = |why: String| {
            BenchError::Target(format!("endpoint {} is not reachable: {why}", self.base))
        };
        let (status, body) = self
            .probe(&url, MODELS_BODY_LIMIT)
            .map_err(|e| unreachable(format!("GET {url}: {e}")))?;
        if !(200..300).contains(&status) {
            return Err(unreachable(format!(
                "GET {url}: HTTP {status}: {}",
                error_message(&body)
            )));
        }
        let list: Value = serde_json::from_str(&body).map_err(|e| {
            BenchError::Target(format!(
                "{url} did not return JSON ({e}): is this an OpenAI-compatible server?"
            ))
        })?;
        let ids = list
            .get("data")
            .and_then(Value::as_array)
            .ok_or_else(|| {
                BenchError::Target(format!(
                    "{url} returned no `data` list: is this an OpenAI-compatible server?"
                ))
            })?
            .iter()
            .filter_map(|m| m.get("id").and_then(Value::as_str).map(str::to_string))
            .collect();
        Ok(ids)
    }

    /// Sends one completion and reads its stream into `rec`.
    fn complete(
        &self,
        session: &Session,
        max_tokens: usize,
        rec: &mut RequestRecord,
    ) -> Result<(), String> {
        let body = json!({
            "model": self.model,
            "prompt": session.text,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": true,
            "stream_options": {"include_usage": true},
        });
        let (state, e2e) = self.stream(&body)?;
        state.fill(rec, e2e);
        Ok(())
    }

    /// A greedy completion of a token-id prompt (`kvtier trace replay`):
    /// exactly `max_tokens` tokens when `ignore_eos` (vLLM's extension,
    /// which kvtier serve honours too), with the generated token ids asked
    /// for as `token_id:N` log-probability names (vLLM's
    /// `return_tokens_as_token_ids`), so outputs compare exactly. A failure
    /// is in the record's `error`, never an `Err`.
    pub fn complete_ids(&self, prompt: &[u32], max_tokens: usize, ignore_eos: bool) -> Completion {
        let body = json!({
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": ignore_eos,
            "logprobs": 0,
            "return_tokens_as_token_ids": true,
            "stream": true,
            "stream_options": {"include_usage": true},
        });
        let mut out = Completion {
            record: RequestRecord {
                prompt_tokens: prompt.len(),
                ..Default::default()
            },
            ..Default::default()
        };
        match self.stream(&body) {
            Ok((state, e2e)) => {
                state.fill(&mut out.record, e2e);
                out.text = state.text;
                out.record.tokens = state.token_ids;
                out.itl_s = state.token_times.windows(2).map(|w| w[1] - w[0]).collect();
            }
            Err(e) => out.record.error = Some(e),
        }
        out
    }

    /// Waits until the server answers `GET /v1/models` with this model, or
    /// `timeout` passes (a restarted server coming back).
    pub fn wait_ready(&self, timeout: Duration) -> Result<(), BenchError> {
        let until = Instant::now() + timeout;
        loop {
            match self.served_models() {
                Ok(m) if m.contains(&self.model) => return Ok(()),
                Ok(m) => {
                    return Err(BenchError::Target(format!(
                        "{} came back serving {} instead of {:?}",
                        self.base,
                        m.join(", "),
                        self.model
                    )));
                }
                Err(e) if Instant::now() >= until => {
                    return Err(BenchError::Target(format!(
                        "{} not ready after {:.0} s: {e}",
                        self.base,
                        timeout.as_secs_f64()
                    )));
                }
                Err(_) => std::thread::sleep(Duration::from_millis(200)),
            }
        }
    }

    /// The server's Prometheus text (`GET /metrics`), or `None` when it
    /// serves none.
    pub fn metrics_text(&self) -> Option<String> {
        let (status, body) = self
            .probe(&format!("{}/metrics", self.base), METRICS_BODY_LIMIT)
            .ok()?;
        (200..300).contains(&status).then_some(body)
    }

    /// A GET within the probe timeout: the status and at most `limit`
    /// bytes of the body.
    fn probe(&self, url: &str, limit: u64) -> Result<(u16, String), ureq::Error> {
        let resp = self
            .agent
            .get(url)
            .config()
            .timeout_global(Some(self.options.probe_timeout))
            .build()
            .call()?;
        let status = resp.status().as_u16();
        Ok((status, read_body(resp.into_body(), limit)))
    }

    /// POSTs `body` to `/v1/completions` and reads its event stream;
    /// returns what it told and the seconds to its end.
    fn stream(&self, body: &Value) -> Result<(StreamState, f64), String> {
        let url = format!("{}/v1/completions", self.base);
        let t0 = Instant::now();
        let resp = self
            .agent
            .post(&url)
            .content_type("application/json")
            .send(body.to_string())
            .map_err(|e| format!("POST {url}: {e}"))?;
        let status = resp.status().as_u16();
        if !(200..300).contains(&status) {
            let text = read_body(resp.into_body(), ERROR_BODY_LIMIT);
            return Err(format!("HTTP {status}: {}", error_message(&text)));
        }
        let mut events = SseReader::new(BufReader::new(resp.into_body().into_reader()));
        let mut state = StreamState::default();
        loop {
            let event = events.next_event().map_err(|e| {
                format!("stream broken after {} text chunks: {e}", state.text_chunks)
            })?;
            let at = t0.elapsed().as_secs_f64();
            let Some(data) = event else {
                if state.finished {
                    break;
                }
                return Err(format!(
                    "stream ended after {} text chunks, before it finished or sent [DONE]",
                    state.text_chunks
                ));
            };
            let data = data.trim();
            if data == "[DONE]" {
                break;
            }
            if data.is_empty() {
                continue;
            }
            let chunk: Value = serde_json::from_str(data)
                .map_err(|e| format!("unreadable stream chunk ({e}): {data:.200}"))?;
            state.absorb(&chunk, at)?;
        }
        Ok((state, t0.elapsed().as_secs_f64()))
    }
}

/// One completion of [`Endpoint::complete_ids`].
#[derive(Debug, Clone, Default)]
pub struct Completion {
    /// Timing, token counts, hits per tier and the error, if any; `tokens`
    /// holds the generated ids when the server named them.
    pub record: RequestRecord,
    /// The generated text.
    pub text: String,
    /// Seconds between consecutive generated tokens.
    pub itl_s: Vec<f64>,
}

impl Target for Endpoint {
    fn describe(&self) -> String {
        format!(
            "OpenAI-compatible endpoint {} (model {}; served as-is: baseline and kvtier runs send the same requests to this one server)",
            self.base, self.model
        )
    }

    /// Estimated: one token per 4 bytes, rounded up (no tokenizer for a
    /// remote model).
    fn count_tokens(&self, text: &str) -> usize {
        text.len().div_ceil(4)
    }

    /// Accepts either mode and changes nothing: an endpoint's prefix cache
    /// and tiers cannot be switched or evicted from here (see the module
    /// docs).
    fn begin(&mut self, mode: Mode, evict_g2: bool) -> Result<(), BenchError> {
        tracing::debug!(
            "endpoint {}: {} run against the server as-is (evict_g2={evict_g2} not applicable)",
            self.base,
            mode.as_str()
        );
        Ok(())
    }

    fn request(&self, session: &Session, max_tokens: usize) -> RequestRecord {
        let mut rec = RequestRecord {
            session: session.id,
            prompt_tokens: self.count_tokens(&session.text),
            ..Default::default()
        };
        if let Err(e) = self.complete(session, max_tokens, &mut rec) {
            rec.error = Some(e);
        }
        rec
    }

    fn end(&mut self) -> Result<(), BenchError> {
        Ok(())
    }

    fn io_mode(&self) -> String {
        "remote endpoint (not reported)".into()
    }
}
