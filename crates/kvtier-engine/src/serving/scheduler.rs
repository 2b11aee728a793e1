//! The scheduler: one thread owns the [`Engine`] and serves many requests.
//!
//! * **Arrivals join at the next step**: a request is admitted the moment it
//!   comes (up to `max_batch` running); requests that come while others run
//!   join them at the next step. So no batching window is needed, and by
//!   default there is none (`max_wait` 0, as in vLLM and llama.cpp's server): a
//!   window would only add its length to an idle server's first TTFT, a large
//!   share of a restore's at concurrency 1. `max_wait` > 0 holds an idle
//!   scheduler's first request up to that long for companions (the "8 requests
//!   or 50 ms" of servers that prefill a batch at once).
//! * **Continuous batching of decode**: every step runs one decode token of
//!   every active sequence in one forward pass; finished sequences leave and
//!   queued requests join between steps.
//! * **Fairness**: requests are admitted first come, first served, at most
//!   `max_batch` run at once, and each decode step serves every active
//!   sequence once, so 16 concurrent clients each get a token per step.
//! * **Restores never stall decode**: an admitted request whose prefix is
//!   being read from the store (G2, G3, G4) waits in its own state while the
//!   store's reader threads read it ([`Engine::begin`]); the scheduler keeps
//!   stepping the other sequences, takes the blocks into G1
//!   ([`Engine::attach`]) at the first step after the read is done, and
//!   computes the rest of the prompt in the decode steps. When nothing else
//!   runs it sleeps until the read wakes it.
//! * **Chunked prefill**: prompt tokens are computed a page at a time in the
//!   same forward passes as the decode tokens (up to
//!   `PREFILL_TOKENS_PER_STEP` per step), so a long prompt delays the
//!   sequences decoding beside it by a chunk per step, not by the whole
//!   prompt, and a restored prompt's last token costs one more row, not a
//!   step of its own.
//!
//! A request whose receiver is dropped (client gone, stop string matched) is
//! finished at the next step.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender, TryRecvError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::kv::prefix_restore::Attached;
use crate::serving::engine::{Engine, SeqId};
use crate::serving::sampling::{Sampled, Sampler, SamplingParams};
use kvtier_store::TierTokens;

/// Batching limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchConfig {
    /// Most sequences decoded together (and admitted per window).
    pub max_batch: usize,
    /// Longest wait for more arrivals once the first one came, when idle
    /// (default: none; see the module docs).
    pub max_wait: Duration,
}

impl Default for BatchConfig {
    fn default() -> Self {
        Self {
            max_batch: 8,
            max_wait: Duration::ZERO,
        }
    }
}

/// One generation request.
#[derive(Debug)]
pub struct GenerateRequest {
    /// Prompt token ids.
    pub prompt: Vec<u32>,
    /// Most tokens to generate (at least 1).
    pub max_tokens: usize,
    /// How to pick tokens.
    pub sampling: SamplingParams,
    /// Token ids that end generation (not emitted).
    pub stop_tokens: Vec<u32>,
    /// The request's salt in its block keys (a tenant, a `cache_salt`):
    /// only requests with the same salt share its cached prefix. Empty: the
    /// engine's keys ([`Engine::begin_salted`]).
    pub salt: Vec<u8>,
    /// Where events go.
    pub events: EventSink,
}

/// Where a request's events go: a function that delivers one event and
/// says whether anyone still listens (false ends the request at the next
/// step). Made from a std channel sender (`tx.into()`) or, with
/// [`EventSink::new`], from any other channel: the HTTP server hands in its
/// tokio sender, so no thread sits between the scheduler and the response.
pub struct EventSink(Box<dyn FnMut(GenerateEvent) -> bool + Send>);

impl EventSink {
    /// A sink calling `deliver` for each event.
    pub fn new(deliver: impl FnMut(GenerateEvent) -> bool + Send + 'static) -> Self {
        Self(Box::new(deliver))
    }

    /// Delivers `event`; false once nobody listens.
    pub fn send(&mut self, event: GenerateEvent) -> bool {
        (self.0)(event)
    }
}

impl From<Sender<GenerateEvent>> for EventSink {
    fn from(tx: Sender<GenerateEvent>) -> Self {
        Self::new(move |event| tx.send(event).is_ok())
    }
}

impl std::fmt::Debug for EventSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("EventSink")
    }
}

/// Why generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// A stop token was produced.
    Stop,
    /// `max_tokens` reached (or the context is full).
    Length,
}

impl FinishReason {
    /// OpenAI's name for it.
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        }
    }
}

/// What the scheduler reports for a request, in order: `Started`, any number
/// of `Token`, then `Finished` (or `Failed` at any point).
#[derive(Debug, Clone, PartialEq)]
pub enum GenerateEvent {
    /// The prompt was prefilled.
    Started {
        /// Prompt tokens.
        prompt_tokens: usize,
        /// Prompt tokens served from cache, by tier.
        cached: TierTokens,
        /// Seconds from arrival to the first token being known (TTFT).
        ttft_seconds: f64,
        /// KV bytes restored from the store.
        restored_bytes: u64,
        /// Seconds the engine spent restoring them.
        restore_seconds: f64,
        /// Seconds the prompt's forward pass waited for restored layers
        /// to land ([`crate::Attached::layer_wait_seconds`]).
        layer_wait_seconds: f64,
    },
    /// One generated token (with its log probabilities when the request
    /// asked for them).
    Token(Sampled),
    /// Generation ended.
    Finished {
        /// Why.
        reason: FinishReason,
        /// Tokens generated.
        completion_tokens: usize,
    },
    /// The request failed (bad prompt, pool exhausted, ...).
    Failed(String),
}

/// An admitted request whose prefix is restored: computing the rest of its
/// prompt, or generating.
struct Active {
    seq: SeqId,
    sampler: Sampler,
    phase: Phase,
    generated: usize,
    max_tokens: usize,
    stop: Vec<u32>,
    events: EventSink,
}

enum Phase {
    /// Computing the rest of its prompt, a chunk per step.
    Prefilling {
        prompt_tokens: usize,
        arrived: Instant,
        attached: Attached,
    },
    /// Generating; `next` is the token to feed.
    Decoding { next: u32 },
}

struct Queued {
    req: GenerateRequest,
    arrived: Instant,
}

/// A request whose prefix is being read from the store.
struct Restoring {
    seq: SeqId,
    req: GenerateRequest,
    arrived: Instant,
}

/// What reaches the scheduler thread.
enum Msg {
    /// A request and when it was submitted.
    Request(GenerateRequest, Instant),
    /// A store read finished: look at the restoring sequences.
    Wake,
    /// Stop taking requests; finish the ones running.
    Shutdown,
}

/// A handle to the scheduler thread. Dropping it stops the thread after the
/// active requests finish.
#[derive(Debug)]
pub struct Scheduler {
    tx: Sender<Msg>,
    handle: Option<JoinHandle<Engine>>,
    stats: Arc<SchedulerStats>,
}

/// What the scheduler thread holds, as it last published it (at the top of
/// each round, so at most one step old), for metrics.
#[derive(Debug, Default)]
pub struct SchedulerStats {
    queued: AtomicUsize,
    restoring: AtomicUsize,
    running: AtomicUsize,
    g1_in_use: AtomicUsize,
    g1_cached: AtomicUsize,
    g1_free: AtomicUsize,
}

/// A copy of [`SchedulerStats`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SchedulerSnapshot {
    /// Requests waiting to be admitted.
    pub queued: usize,
    /// Admitted sequences waiting for their store reads.
    pub restoring: usize,
    /// Sequences computing (prefill chunks or decoding).
    pub running: usize,
    /// G1 pages held by running sequences.
    pub g1_in_use: usize,
    /// G1 pages holding cached prefixes no sequence uses.
    pub g1_cached: usize,
    /// G1 pages holding nothing.
    pub g1_free: usize,
}

impl SchedulerStats {
    fn publish(&self, q: &Queues, engine: &Engine) {
        let r = Ordering::Relaxed;
        self.queued.store(q.queue.len(), r);
        self.restoring.store(q.restoring.len(), r);
        self.running.store(q.active.len(), r);
        // free_pages counts the cached ones too (they can be reclaimed).
        let (reclaimable, cached) = (engine.free_pages(), engine.cached_pages());
        self.g1_in_use
            .store(engine.total_pages().saturating_sub(reclaimable), r);
        self.g1_cached.store(cached, r);
        self.g1_free.store(reclaimable.saturating_sub(cached), r);
    }

    /// The values now.
    pub fn snapshot(&self) -> SchedulerSnapshot {
        let r = Ordering::Relaxed;
        SchedulerSnapshot {
            queued: self.queued.load(r),
            restoring: self.restoring.load(r),
            running: self.running.load(r),
            g1_in_use: self.g1_in_use.load(r),
            g1_cached: self.g1_cached.load(r),
            g1_free: self.g1_free.load(r),
        }
    }
}

impl std::fmt::Debug for Msg {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Msg::Request(..) => "Request",
            Msg::Wake => "Wake",
            Msg::Shutdown => "Shutdown",
        })
    }
}

impl Scheduler {
    /// Starts the scheduler thread around `engine`.
    pub fn start(engine: Engine, cfg: BatchConfig) -> std::io::Result<Self> {
        let (tx, rx) = mpsc::channel();
        let wake = tx.clone();
        let stats = Arc::new(SchedulerStats::default());
        stats.publish(&Queues::default(), &engine);
        let published = stats.clone();
        let handle = std::thread::Builder::new()
            .name("kvtier-scheduler".into())
            .spawn(move || run(engine, cfg, &rx, &wake, &published))?;
        Ok(Self {
            tx,
            handle: Some(handle),
            stats,
        })
    }

    /// The queue depths and G1 use the scheduler thread publishes.
    pub fn stats(&self) -> &Arc<SchedulerStats> {
        &self.stats
    }

    /// Queues a request; its events go to its [`EventSink`]. False if
    /// stopped.
    pub fn submit(&self, req: GenerateRequest) -> bool {
        self.tx.send(Msg::Request(req, Instant::now())).is_ok()
    }

    /// Stops accepting requests, lets active ones finish, and returns the
    /// engine (whose drop flushes its store).
    pub fn shutdown(mut self) -> Option<Engine> {
        let _ = self.tx.send(Msg::Shutdown);
        self.handle.take().and_then(|h| h.join().ok())
    }
}

impl Drop for Scheduler {
    fn drop(&mut self) {
        let _ = self.tx.send(Msg::Shutdown);
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

/// The queues of the scheduler thread.
#[derive(Default)]
struct Queues {
    queue: VecDeque<Queued>,
    restoring: Vec<Restoring>,
    active: Vec<Active>,
    /// False once shutdown was asked for (or every sender is gone).
    open: bool,
}

impl Queues {
    /// Takes one message.
    fn on(&mut self, msg: Msg) {
        match msg {
            Msg::Request(req, arrived) if self.open => {
                self.queue.push_back(Queued { req, arrived })
            }
            Msg::Request(mut req, _) => {
                req.events.send(GenerateEvent::Failed(
                    "the scheduler is shutting down".into(),
                ));
            }
            Msg::Wake => {}
            Msg::Shutdown => self.open = false,
        }
    }

    /// Sequences admitted (decoding or restoring).
    fn running(&self) -> usize {
        self.active.len() + self.restoring.len()
    }
}

fn run(
    mut engine: Engine,
    cfg: BatchConfig,
    rx: &Receiver<Msg>,
    wake: &Sender<Msg>,
    stats: &SchedulerStats,
) -> Engine {
    let max_batch = cfg.max_batch.max(1);
    let mut q = Queues {
        open: true,
        ..Default::default()
    };
    // The engine's tensors are used on this thread from here on.
    if let Err(e) = crate::compute::device::bind_to_thread(&engine.options().device) {
        tracing::warn!("{e}");
    }
    loop {
        offload(&mut engine);
        stats.publish(&q, &engine);
        // Gather arrivals.
        if q.running() == 0 && q.queue.is_empty() {
            if !q.open {
                break;
            }
            match rx.recv() {
                Ok(msg) => q.on(msg),
                Err(_) => break,
            }
            if q.queue.is_empty() {
                continue;
            }
            // Idle, and a request came: a batching window for more.
            let deadline = Instant::now() + cfg.max_wait;
            while q.open && q.queue.len() < max_batch {
                let left = deadline.saturating_duration_since(Instant::now());
                match rx.recv_timeout(left) {
                    Ok(msg) => q.on(msg),
                    Err(RecvTimeoutError::Timeout) => break,
                    Err(RecvTimeoutError::Disconnected) => q.open = false,
                }
            }
        } else if q.active.is_empty()
            && q.queue.is_empty()
            && !q.restoring.iter().any(|r| ready(&engine, r.seq))
        {
            // Only restores in flight: sleep until one wakes us (or a
            // request comes).
            match rx.recv() {
                Ok(msg) => q.on(msg),
                Err(_) => q.open = false,
            }
        }
        loop {
            match rx.try_recv() {
                Ok(msg) => q.on(msg),
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => {
                    q.open = false;
                    break;
                }
            }
        }
        // Admit (first come, first served) up to the batch limit; their
        // store reads start now and run while the others decode.
        while q.running() < max_batch {
            let Some(queued) = q.queue.pop_front() else {
                break;
            };
            if let Some(r) = begin(&mut engine, queued, wake) {
                q.restoring.push(r);
            }
        }
        // Sequences whose reads are done take their blocks into G1 (up to
        // ATTACH_BYTES_PER_STEP per step) and join the batch, to compute the
        // rest of their prompts in its steps.
        let mut budget = ATTACH_BYTES_PER_STEP;
        let mut i = 0;
        while i < q.restoring.len() && budget > 0 {
            if !ready(&engine, q.restoring[i].seq) {
                i += 1;
                continue;
            }
            match engine.attach_some(q.restoring[i].seq, &mut budget) {
                Ok(None) => i += 1,
                Ok(Some(attached)) => {
                    let r = q.restoring.remove(i);
                    q.active.push(prefilling(r, attached));
                }
                Err(e) => {
                    let mut r = q.restoring.remove(i);
                    r.req.events.send(GenerateEvent::Failed(e.to_string()));
                }
            }
        }
        offload(&mut engine);
        if !q.active.is_empty() {
            step(&mut engine, &mut q.active);
            // The step's tokens woke their consumers (a client's thread, an
            // HTTP connection's task). Yield once so they get a core before
            // the next step's forward pass fills every core again: else the
            // kernel may leave them queued behind this thread until its next
            // tick. That happened most after a restore, whose reader had
            // taken CPU time from this thread, which the kernel then let run
            // on to make up for it: restored first tokens reached the bench's
            // client late, hot ones did not (docs/decisions.md, "The
            // scheduler yields once after each step"). Costs one system call
            // a step when no one waits.
            std::thread::yield_now();
        }
    }
    offload(&mut engine);
    engine
}

/// A restoring sequence can be attached: its read is done, or it is a
/// layer-wise restore whose forward pass can start (`Engine::begin` reads
/// layer by layer only when the engine runs nothing else).
fn ready(engine: &Engine, seq: SeqId) -> bool {
    engine.restore_done(seq) || engine.restore_started(seq)
}

/// New full blocks go to the store after the round's tokens were sent (and
/// before the scheduler waits for work), so the copy never delays a first
/// token.
fn offload(engine: &mut Engine) {
    if let Err(e) = engine.offload_pending() {
        tracing::warn!("copying KV blocks for the store failed: {e}");
    }
}

/// Starts a request's prefill; its store read wakes the scheduler when done.
fn begin(engine: &mut Engine, q: Queued, wake: &Sender<Msg>) -> Option<Restoring> {
    let Queued { mut req, arrived } = q;
    let wake = wake.clone();
    match engine.begin_salted(&req.prompt, &req.salt, move || {
        let _ = wake.send(Msg::Wake);
    }) {
        Ok(seq) => Some(Restoring { seq, req, arrived }),
        Err(e) => {
            req.events.send(GenerateEvent::Failed(e.to_string()));
            None
        }
    }
}

/// Bytes of restored blocks copied into G1 per scheduler step, for all
/// restoring sequences together: a short copy next to a decode step (into
/// the pool's committed memory), a 4,096-token prefix of the `small` preset
/// in one step; a longer prefix's copies are spread over the steps instead
/// of stalling the decoders for one long copy.
const ATTACH_BYTES_PER_STEP: u64 = 64 << 20;

/// A request whose restored blocks are all in G1, ready to compute the
/// rest of its prompt.
fn prefilling(r: Restoring, attached: Attached) -> Active {
    let Restoring { seq, req, arrived } = r;
    Active {
        seq,
        sampler: Sampler::new(req.sampling, &req.prompt),
        phase: Phase::Prefilling {
            prompt_tokens: req.prompt.len(),
            arrived,
            attached,
        },
        generated: 0,
        max_tokens: req.max_tokens.max(1),
        stop: req.stop_tokens,
        events: req.events,
    }
}

/// A sequence's whole prompt is computed: sends `Started`, samples the
/// first token and emits it. Returns true when the request is done.
/// `report` is the engine's final word on its restore, when it has one.
fn started(a: &mut Active, report: Option<Attached>, logits: &[f32]) -> bool {
    let Phase::Prefilling {
        prompt_tokens,
        arrived,
        attached,
    } = a.phase
    else {
        return false;
    };
    let attached = report.unwrap_or(attached);
    let next = a.sampler.sample(logits);
    a.phase = Phase::Decoding { next: next.token };
    let event = GenerateEvent::Started {
        prompt_tokens,
        cached: attached.cached,
        ttft_seconds: arrived.elapsed().as_secs_f64(),
        restored_bytes: attached.restored_bytes,
        restore_seconds: attached.restore_seconds,
        layer_wait_seconds: attached.layer_wait_seconds,
    };
    !a.events.send(event) || emit(a, next)
}

/// Emits `next`; returns true when the request is done (and was told so).
fn emit(a: &mut Active, next: Sampled) -> bool {
    if a.stop.contains(&next.token) {
        a.events.send(GenerateEvent::Finished {
            reason: FinishReason::Stop,
            completion_tokens: a.generated,
        });
        return true;
    }
    a.generated += 1;
    if !a.events.send(GenerateEvent::Token(next)) {
        return true;
    }
    if a.generated >= a.max_tokens {
        a.events.send(GenerateEvent::Finished {
            reason: FinishReason::Length,
            completion_tokens: a.generated,
        });
        return true;
    }
    false
}

/// Prompt tokens computed per step, in all, beside the decode tokens: the
/// prefilling sequences (first come, first served) get their next chunks
/// while they fit, and the first always gets one. A step with a full page
/// of prefill costs about what computing it alone would; decoders wait for
/// at most that, never for a whole long prompt.
const PREFILL_TOKENS_PER_STEP: usize = 256;

/// One batched step: the next token of every decoding sequence and the
/// next prompt chunk of the prefilling ones ([`Engine::step`]).
fn step(engine: &mut Engine, active: &mut Vec<Active>) {
    let mut decode = Vec::new();
    let mut prefill = Vec::new();
    let mut budget = 0;
    for (i, a) in active.iter().enumerate() {
        match a.phase {
            Phase::Decoding { next } => decode.push((i, (a.seq, next))),
            Phase::Prefilling { .. } => {
                let chunk = engine.prefill_chunk(a.seq);
                if prefill.is_empty() || budget + chunk <= PREFILL_TOKENS_PER_STEP {
                    budget += chunk;
                    prefill.push((i, a.seq));
                }
            }
        }
    }
    let decode_ids: Vec<(SeqId, u32)> = decode.iter().map(|&(_, d)| d).collect();
    let prefill_ids: Vec<SeqId> = prefill.iter().map(|&(_, id)| id).collect();
    let mut done = Vec::new();
    match engine.step(&decode_ids, &prefill_ids) {
        Ok(out) => {
            for (&(i, _), logits) in decode.iter().zip(&out.decoded) {
                let a = &mut active[i];
                let next = a.sampler.sample(logits);
                a.phase = Phase::Decoding { next: next.token };
                if emit(a, next) {
                    done.push(i);
                }
            }
            for (&(i, id), logits) in prefill.iter().zip(&out.prefilled) {
                if let Some(logits) = logits
                    && started(&mut active[i], engine.attached(id), logits)
                {
                    done.push(i);
                }
            }
        }
        Err(e) => {
            // A batch failure (context limit of one sequence, pool full):
            // retry each sequence alone so one bad apple ends only itself.
            let msg = e.to_string();
            let batch = decode
                .iter()
                .map(|&(i, _)| i)
                .chain(prefill.iter().map(|&(i, _)| i));
            for i in batch.collect::<Vec<_>>() {
                if retry_alone(engine, &mut active[i], &msg) {
                    done.push(i);
                }
            }
        }
    }
    done.sort_unstable();
    for i in done.into_iter().rev() {
        let a = active.remove(i);
        engine.finish(a.seq);
    }
}

/// Steps one sequence alone after its batch failed; returns true when the
/// request is done (finished, or failed and told so).
fn retry_alone(engine: &mut Engine, a: &mut Active, batch_error: &str) -> bool {
    let result = match a.phase {
        Phase::Decoding { next } => engine
            .step(&[(a.seq, next)], &[])
            .map(|mut s| s.decoded.pop()),
        Phase::Prefilling { .. } => engine
            .step(&[], &[a.seq])
            .map(|mut s| s.prefilled.pop().flatten()),
    };
    match (result, &a.phase) {
        (Ok(Some(logits)), Phase::Decoding { .. }) => {
            let next = a.sampler.sample(&logits);
            a.phase = Phase::Decoding { next: next.token };
            emit(a, next)
        }
        (Ok(Some(logits)), Phase::Prefilling { .. }) => {
            let report = engine.attached(a.seq);
            started(a, report, &logits)
        }
        (Ok(None), _) => false,
        (Err(e), phase) => {
            let event = if matches!(phase, Phase::Decoding { .. })
                && e.to_string().contains("context limit")
            {
                GenerateEvent::Finished {
                    reason: FinishReason::Length,
                    completion_tokens: a.generated,
                }
            } else {
                GenerateEvent::Failed(format!("{e} (batch: {batch_error})"))
            };
            a.events.send(event);
            true
        }
    }
}
