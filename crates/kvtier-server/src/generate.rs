//! One generation, seen from async code: submits a [`Plan`] to the
//! scheduler, waits for the prefill, then yields text pieces (decoded
//! incrementally, stop strings applied) and the finish.
//!
//! The scheduler sends the request's events straight into a tokio channel
//! (an [`EventSink`] over its sender; no thread in between). Dropping a
//! [`Generation`] (client gone, stop string matched) closes the channel, and
//! the scheduler ends the sequence at its next token.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Instant;

use kvtier_engine::TierTokens;
use kvtier_engine::serving::sampling::Sampled;
use kvtier_engine::serving::scheduler::{EventSink, GenerateEvent, GenerateRequest};
use tokio::sync::mpsc::UnboundedReceiver;

use crate::api_error::ApiError;
use crate::app_state::AppState;
use crate::openai::{KvtierExtras, PromptTokensDetails, Usage};
use crate::server_metrics::ServerMetrics;
use crate::text_stream::{Detokenizer, StopMatcher, StopOutcome};
use crate::validate::Plan;

/// What the prefill reported.
#[derive(Debug, Clone, Copy)]
pub struct Started {
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Prompt tokens served from cache, by tier.
    pub cached: TierTokens,
    /// Seconds from the HTTP request's arrival to the first token.
    pub ttft_seconds: f64,
    /// Seconds from the scheduler's receipt to the first token.
    pub engine_ttft_seconds: f64,
    /// KV bytes restored from the store.
    pub restored_bytes: u64,
}

/// How a generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Finish {
    /// "stop" or "length".
    pub reason: &'static str,
    /// Tokens generated (those whose text was produced).
    pub completion_tokens: usize,
}

/// One piece of output.
#[derive(Debug, Clone, PartialEq)]
pub enum Piece {
    /// New text, and the log probabilities of the tokens it came from (when
    /// asked for; may be empty when the text came from earlier tokens, or
    /// the text empty when a token's text is still held back).
    Text(String, Vec<Sampled>),
    /// The end.
    Finished(Finish),
}

/// A running generation.
#[derive(Debug)]
pub struct Generation {
    rx: Option<UnboundedReceiver<GenerateEvent>>,
    detok: Detokenizer,
    stop: StopMatcher,
    metrics: Arc<ServerMetrics>,
    /// What the prefill reported.
    pub started: Started,
    pending: VecDeque<Piece>,
    /// Tokens with log probabilities whose text was not emitted yet.
    unsent: Vec<Sampled>,
    last_token: Instant,
    /// When the HTTP request arrived (for the end-to-end latency).
    arrived: Instant,
    tokens: usize,
    done: bool,
}

impl Generation {
    /// Submits `plan` and waits until its prompt is prefilled (so a failed
    /// prefill is still an HTTP error). `arrived` is when the HTTP request
    /// came in.
    pub async fn start(state: &AppState, plan: Plan, arrived: Instant) -> Result<Self, ApiError> {
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let detok = Detokenizer::after(state.tokenizer.clone(), &plan.prompt);
        let Plan {
            prompt,
            max_tokens,
            sampling,
            stop_strings,
            stop_tokens,
            salt,
            ..
        } = plan;
        let submitted = state.scheduler.submit(GenerateRequest {
            prompt,
            max_tokens,
            sampling,
            stop_tokens,
            salt,
            events: EventSink::new(move |event| tx.send(event).is_ok()),
        });
        if !submitted {
            return Err(ApiError::unavailable(
                "the scheduler is not running (the server is shutting down)",
            ));
        }
        let started = match rx.recv().await {
            Some(GenerateEvent::Started {
                prompt_tokens,
                cached,
                ttft_seconds,
                restored_bytes,
                ..
            }) => Started {
                prompt_tokens,
                cached,
                ttft_seconds: arrived.elapsed().as_secs_f64(),
                engine_ttft_seconds: ttft_seconds,
                restored_bytes,
            },
            Some(GenerateEvent::Failed(msg)) => return Err(ApiError::from_engine(msg)),
            Some(other) => {
                return Err(ApiError::internal(format!(
                    "the scheduler reported {other:?} before starting the request"
                )));
            }
            None => return Err(ApiError::internal("the scheduler stopped")),
        };
        let metrics = state.metrics.clone();
        metrics.ttft.observe(started.ttft_seconds);
        metrics.record_prompt(
            started.prompt_tokens,
            started.cached,
            started.restored_bytes,
        );
        metrics.in_flight.inc();
        Ok(Self {
            rx: Some(rx),
            detok,
            stop: StopMatcher::new(stop_strings),
            metrics,
            started,
            pending: VecDeque::new(),
            unsent: Vec::new(),
            last_token: Instant::now(),
            arrived,
            tokens: 0,
            done: false,
        })
    }

    /// The next piece; `None` after the finish.
    pub async fn next(&mut self) -> Result<Option<Piece>, ApiError> {
        loop {
            if let Some(p) = self.pending.pop_front() {
                return Ok(Some(p));
            }
            if self.done {
                return Ok(None);
            }
            let Some(rx) = self.rx.as_mut() else {
                return Ok(None);
            };
            match rx.recv().await {
                Some(GenerateEvent::Token(sampled)) => self.on_token(sampled)?,
                Some(GenerateEvent::Finished { reason, .. }) => {
                    let rest = self.decode_err(|d| d.flush())?;
                    if !self.on_text(&rest) {
                        let tail = self.stop.finish();
                        self.push_text(tail);
                        // Tokens whose text was empty still have their
                        // log probabilities.
                        if !self.unsent.is_empty() {
                            let lp = std::mem::take(&mut self.unsent);
                            self.pending.push_back(Piece::Text(String::new(), lp));
                        }
                        self.end(reason.as_str());
                    }
                }
                Some(GenerateEvent::Failed(msg)) => {
                    self.end_quietly();
                    return Err(ApiError::from_engine(msg));
                }
                Some(GenerateEvent::Started { .. }) => {}
                None => {
                    self.end_quietly();
                    return Err(ApiError::internal(
                        "the scheduler stopped before the generation finished",
                    ));
                }
            }
        }
    }

    /// Collects the whole output: its text, how it ended, and the log
    /// probabilities of its tokens (when asked for).
    pub async fn collect(&mut self) -> Result<(String, Finish, Vec<Sampled>), ApiError> {
        let mut text = String::new();
        let mut logprobs = Vec::new();
        let mut finish = Finish {
            reason: "length",
            completion_tokens: 0,
        };
        while let Some(piece) = self.next().await? {
            match piece {
                Piece::Text(t, lp) => {
                    text.push_str(&t);
                    logprobs.extend(lp);
                }
                Piece::Finished(f) => finish = f,
            }
        }
        Ok((text, finish, logprobs))
    }

    /// Token counts for `finish`.
    pub fn usage(&self, finish: Finish) -> Usage {
        Usage {
            prompt_tokens: self.started.prompt_tokens,
            completion_tokens: finish.completion_tokens,
            total_tokens: self.started.prompt_tokens + finish.completion_tokens,
            prompt_tokens_details: PromptTokensDetails {
                cached_tokens: self.started.cached.total(),
            },
        }
    }

    /// kvtier's additions to the response.
    pub fn extras(&self) -> KvtierExtras {
        KvtierExtras {
            cached_tokens: self.started.cached,
            ttft_seconds: self.started.ttft_seconds,
            engine_ttft_seconds: self.started.engine_ttft_seconds,
            restored_bytes: self.started.restored_bytes,
        }
    }

    fn on_token(&mut self, sampled: Sampled) -> Result<(), ApiError> {
        let id = sampled.token;
        if sampled.logprobs.is_some() {
            self.unsent.push(sampled);
        }
        let now = Instant::now();
        if self.tokens > 0 {
            self.metrics
                .inter_token
                .observe(now.duration_since(self.last_token).as_secs_f64());
        }
        self.last_token = now;
        self.tokens += 1;
        self.metrics.generated_tokens.inc();
        let text = self.decode_err(|d| d.push(id))?;
        self.on_text(&text);
        Ok(())
    }

    /// Runs `text` through the stop matcher; true when a stop string ended
    /// the generation.
    fn on_text(&mut self, text: &str) -> bool {
        match self.stop.push(text) {
            StopOutcome::Emit(t) => {
                self.push_text(t);
                false
            }
            StopOutcome::Stopped(t) => {
                // The text before the stop string carries the log
                // probabilities of every token up to the one that ended it
                // (as vLLM's do).
                let lp = std::mem::take(&mut self.unsent);
                if !t.is_empty() || !lp.is_empty() {
                    self.pending.push_back(Piece::Text(t, lp));
                }
                // Dropping the receiver tells the scheduler to end the
                // sequence.
                self.rx = None;
                self.end("stop");
                true
            }
        }
    }

    /// Queues `t` with the log probabilities of the tokens seen since the
    /// last piece.
    fn push_text(&mut self, t: String) {
        if !t.is_empty() {
            let lp = std::mem::take(&mut self.unsent);
            self.pending.push_back(Piece::Text(t, lp));
        }
    }

    fn end(&mut self, reason: &'static str) {
        if !self.done {
            self.metrics
                .request_seconds
                .observe(self.arrived.elapsed().as_secs_f64());
        }
        self.pending.push_back(Piece::Finished(Finish {
            reason,
            completion_tokens: self.tokens,
        }));
        self.end_quietly();
    }

    fn end_quietly(&mut self) {
        if !self.done {
            self.done = true;
            self.rx = None;
            self.metrics.in_flight.dec();
        }
    }

    fn decode_err(
        &mut self,
        f: impl FnOnce(&mut Detokenizer) -> Result<String, kvtier_engine::EngineError>,
    ) -> Result<String, ApiError> {
        f(&mut self.detok).map_err(|e| {
            self.end_quietly();
            ApiError::internal(format!("cannot decode generated tokens: {e}"))
        })
    }
}

impl Drop for Generation {
    fn drop(&mut self) {
        self.end_quietly();
    }
}
