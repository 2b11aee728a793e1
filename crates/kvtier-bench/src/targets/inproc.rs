//! The in-process target: kvtier's own engine and scheduler, with its
//! tiered store, in this process. Baseline and kvtier runs share one engine
//! (same weights, same pool); only prefix reuse is switched.

use std::sync::mpsc;
use std::time::{Duration, Instant};

use kvtier_engine::Engine;
use kvtier_engine::serving::sampling::SamplingParams;
use kvtier_engine::serving::scheduler::{BatchConfig, GenerateEvent, GenerateRequest, Scheduler};
use kvtier_engine::text::tokenizer::TextTokenizer;

use crate::bench_error::BenchError;
use crate::cold_recovery::accuracy::TOP_LOGPROBS;
use crate::cold_recovery::workload::Session;
use crate::reporting::report::{Mode, RequestRecord, TierTokens};
use crate::targets::target::Target;

/// Longest a request may take before the client gives up on it.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(600);

/// kvtier's engine in this process.
pub struct InProcess {
    tokenizer: TextTokenizer,
    engine: Option<Engine>,
    scheduler: Option<Scheduler>,
    batch: BatchConfig,
    stop_tokens: Vec<u32>,
    description: String,
}

impl InProcess {
    /// Wraps a loaded engine and its tokenizer.
    pub fn new(
        engine: Engine,
        tokenizer: TextTokenizer,
        batch: BatchConfig,
        description: String,
    ) -> Self {
        let stop_tokens = engine.config().eos_ids();
        Self {
            tokenizer,
            engine: Some(engine),
            scheduler: None,
            batch,
            stop_tokens,
            description,
        }
    }

    fn take_engine(&mut self) -> Result<Engine, BenchError> {
        if let Some(s) = self.scheduler.take() {
            return s
                .shutdown()
                .ok_or_else(|| BenchError::Target("the scheduler thread died".into()));
        }
        self.engine
            .take()
            .ok_or_else(|| BenchError::Target("engine unavailable".into()))
    }
}

impl Target for InProcess {
    fn describe(&self) -> String {
        self.description.clone()
    }

    fn count_tokens(&self, text: &str) -> usize {
        self.tokenizer.encode(text).map_or(text.len(), |t| t.len())
    }

    fn begin(&mut self, mode: Mode, evict_g2: bool) -> Result<(), BenchError> {
        let mut engine = self.take_engine()?;
        engine.set_prefix_reuse(mode == Mode::Kvtier);
        engine.evict_g1();
        if mode == Mode::Kvtier
            && evict_g2
            && let Some(store) = engine.store()
        {
            store.evict_memory()?;
        }
        let s =
            Scheduler::start(engine, self.batch).map_err(|e| BenchError::Target(e.to_string()))?;
        self.scheduler = Some(s);
        Ok(())
    }

    fn request(&self, session: &Session, max_tokens: usize) -> RequestRecord {
        let mut rec = RequestRecord {
            session: session.id,
            ..Default::default()
        };
        let fail = |mut rec: RequestRecord, e: String| {
            rec.error = Some(e);
            rec
        };
        let prompt = match self.tokenizer.encode(&session.text) {
            Ok(p) => p,
            Err(e) => return fail(rec, e.to_string()),
        };
        rec.prompt_tokens = prompt.len();
        let Some(s) = &self.scheduler else {
            return fail(rec, "no run in progress".into());
        };
        let (tx, rx) = mpsc::channel();
        let t0 = Instant::now();
        let submitted = s.submit(GenerateRequest {
            salt: Vec::new(),
            prompt,
            max_tokens,
            // Greedy, with the top log probabilities for the accuracy
            // comparison (a log-softmax over the vocabulary per token).
            sampling: SamplingParams {
                logprobs: Some(TOP_LOGPROBS),
                ..SamplingParams::default()
            },
            stop_tokens: self.stop_tokens.clone(),
            events: tx.into(),
        });
        if !submitted {
            return fail(rec, "scheduler stopped".into());
        }
        loop {
            match rx.recv_timeout(REQUEST_TIMEOUT) {
                Ok(GenerateEvent::Started {
                    cached,
                    ttft_seconds,
                    restored_bytes,
                    restore_seconds,
                    layer_wait_seconds,
                    ..
                }) => {
                    rec.server_ttft_s = ttft_seconds;
                    rec.hit_tokens = TierTokens {
                        g1: cached.g1,
                        g2: cached.g2,
                        g3: cached.g3,
                        g4: cached.g4,
                    };
                    rec.restored_bytes = restored_bytes;
                    rec.restore_s = restore_seconds;
                    rec.layer_wait_s = layer_wait_seconds;
                }
                Ok(GenerateEvent::Token(sampled)) => {
                    if rec.output_tokens == 0 {
                        rec.ttft_s = t0.elapsed().as_secs_f64();
                    }
                    rec.output_tokens += 1;
                    rec.tokens.push(sampled.token);
                    rec.top_logprobs.push(
                        sampled
                            .logprobs
                            .map(|l| l.top.iter().map(|&(_, lp)| lp).collect())
                            .unwrap_or_default(),
                    );
                }
                Ok(GenerateEvent::Finished { .. }) => {
                    rec.e2e_s = t0.elapsed().as_secs_f64();
                    if rec.output_tokens == 0 {
                        rec.ttft_s = rec.e2e_s;
                    }
                    return rec;
                }
                Ok(GenerateEvent::Failed(e)) => return fail(rec, e),
                Err(_) => return fail(rec, "timed out or scheduler gone".into()),
            }
        }
    }

    fn end(&mut self) -> Result<(), BenchError> {
        let mut engine = self.take_engine()?;
        engine.flush_offload()?;
        self.engine = Some(engine);
        Ok(())
    }

    fn drops_prefixes(&self) -> bool {
        true
    }

    fn kv_form(&self) -> (String, f64) {
        match self.engine.as_ref().and_then(|e| e.store()) {
            Some(s) => {
                let l = s.layout();
                let ratio = l.payload_bytes() as f64 / l.stored_payload_bytes().max(1) as f64;
                (l.codec.name().into(), ratio)
            }
            None => ("none".into(), 1.0),
        }
    }

    fn io_mode(&self) -> String {
        self.engine
            .as_ref()
            .and_then(|e| e.store())
            .and_then(|s| s.disk())
            .map_or_else(|| "no G3".into(), |d| d.describe_io())
    }
}
