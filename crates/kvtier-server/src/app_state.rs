//! What every handler shares: the model's name and limits, the tokenizer,
//! the scheduler, the metrics.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use kvtier_engine::serving::scheduler::Scheduler;
use kvtier_engine::text::chat_template::ChatTemplate;
use kvtier_engine::text::tokenizer::TextTokenizer;
use tokio::sync::Semaphore;

use crate::auth::ApiKeys;
use crate::conn_limits::{ConnLimits, InFlight};
use crate::server_metrics::ServerMetrics;

/// Request limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Longest sequence (prompt + generated) the engine serves.
    pub context_tokens: usize,
    /// Longest prompt accepted (below the context).
    pub max_prompt_tokens: usize,
}

/// State shared by the handlers.
#[derive(Debug)]
pub struct AppState {
    /// The name clients use in `model`.
    pub model_name: String,
    /// Unix seconds the server started.
    pub created: u64,
    /// The model's tokenizer.
    pub tokenizer: Arc<TextTokenizer>,
    /// The model's chat template.
    pub chat_template: Arc<ChatTemplate>,
    /// The engine's scheduler.
    pub scheduler: Arc<Scheduler>,
    /// Request limits.
    pub limits: Limits,
    /// Tokens that end a completion (the model's end-of-sequence ids).
    pub stop_tokens: Vec<u32>,
    /// Tokens that end a chat reply (the above plus the end-of-turn token).
    pub chat_stop_tokens: Vec<u32>,
    /// Metrics.
    pub metrics: Arc<ServerMetrics>,
    /// The accepted API keys (`None`: an open server, one default tenant).
    pub api_keys: Option<Arc<ApiKeys>>,
    /// Requests in flight and their cap.
    pub in_flight: Arc<InFlight>,
    /// Longest pause between two pieces of a request body.
    pub body_timeout: Duration,
    /// Turns to check and tokenize a request, one per core
    /// ([`crate::routes`]).
    pub checks: Arc<Semaphore>,
    next_id: AtomicU64,
}

impl AppState {
    /// Builds the state.
    pub fn new(
        model_name: String,
        tokenizer: Arc<TextTokenizer>,
        chat_template: Arc<ChatTemplate>,
        scheduler: Arc<Scheduler>,
        limits: Limits,
        stop_tokens: Vec<u32>,
        metrics: Arc<ServerMetrics>,
    ) -> Self {
        let mut chat_stop_tokens = stop_tokens.clone();
        for end_of_turn in ["<|im_end|>", "<|eot_id|>", "<|end|>"] {
            if let Some(id) = tokenizer.token_id(end_of_turn)
                && !chat_stop_tokens.contains(&id)
            {
                chat_stop_tokens.push(id);
            }
        }
        Self {
            model_name,
            created: unix_now(),
            tokenizer,
            chat_template,
            scheduler,
            limits,
            stop_tokens,
            chat_stop_tokens,
            metrics: metrics.clone(),
            api_keys: None,
            in_flight: Arc::new(InFlight::new(
                ConnLimits::default().max_in_flight,
                metrics.http_in_flight.clone(),
            )),
            body_timeout: ConnLimits::default().header_timeout,
            checks: Arc::new(Semaphore::new(
                std::thread::available_parallelism().map_or(1, usize::from),
            )),
            next_id: AtomicU64::new(1),
        }
    }

    /// The state with `limits`' cap on requests in flight and its pause
    /// limit on request bodies.
    pub fn with_conn_limits(mut self, limits: ConnLimits) -> Self {
        self.in_flight = Arc::new(InFlight::new(
            limits.max_in_flight,
            self.metrics.http_in_flight.clone(),
        ));
        self.body_timeout = limits.header_timeout;
        self
    }

    /// The state with `keys` required on every endpoint but `/health`.
    pub fn with_api_keys(mut self, keys: Option<ApiKeys>) -> Self {
        self.api_keys = keys.map(Arc::new);
        self
    }

    /// A fresh response id with `prefix` (`cmpl`, `chatcmpl`).
    pub fn response_id(&self, prefix: &str) -> String {
        let n = self.next_id.fetch_add(1, Ordering::Relaxed);
        format!("{prefix}-{:x}{n:08x}", self.created)
    }
}

/// Seconds since the Unix epoch.
pub fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}
