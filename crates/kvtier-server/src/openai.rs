//! OpenAI API request and response bodies (the subset kvtier serves).
//!
//! Fields whose type varies (`prompt`, `stop`, message `content`,
//! `logprobs`) are taken as raw JSON and checked by [`crate::validate`], so
//! a wrong one gets an error naming it. Every other field lands in
//! [`CommonParams::other`]; one that asks for something kvtier does not do
//! (`tools`, `response_format`, ...) is a 400 naming it, never silently
//! dropped ([`crate::validate::check_unsupported`]). Responses carry OpenAI's fields plus an additive `kvtier`
//! object (cached tokens per tier, TTFT).

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::logprobs::{ChatLogprobs, CompletionLogprobs};

/// `stream_options`.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct StreamOptions {
    /// Send a final chunk with `usage`.
    #[serde(default)]
    pub include_usage: bool,
}

/// Fields shared by completions and chat completions.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct CommonParams {
    /// Served model name (optional here: missing means the served one).
    pub model: Option<String>,
    /// Most tokens to generate.
    pub max_tokens: Option<i64>,
    /// Sampling temperature, 0 to 2 (0: greedy). OpenAI's default is 1.
    pub temperature: Option<f64>,
    /// Nucleus mass, 0 to 1.
    pub top_p: Option<f64>,
    /// Seed for reproducible sampling.
    pub seed: Option<i64>,
    /// A stop string or a list of up to 4.
    pub stop: Option<Value>,
    /// Stream server-sent events.
    #[serde(default)]
    pub stream: Option<bool>,
    /// Streaming options.
    pub stream_options: Option<StreamOptions>,
    /// Choices to generate (only 1 is served).
    pub n: Option<i64>,
    /// vLLM's prefix-cache salt: requests share cached KV only with the
    /// same `cache_salt` (within their tenant).
    pub cache_salt: Option<String>,
    /// Completions: how many alternatives to report with each token's log
    /// probability (0 to 20); chat: whether to report log probabilities.
    pub logprobs: Option<Value>,
    /// Chat: alternatives per token (0 to 20; needs `logprobs: true`).
    pub top_logprobs: Option<i64>,
    /// Completions: the prompt's text before the generated text.
    pub echo: Option<bool>,
    /// Keep only the `top_k` most likely tokens (-1 or 0: all).
    pub top_k: Option<i64>,
    /// Drop tokens less likely than `min_p` times the most likely (0 to 1).
    pub min_p: Option<f64>,
    /// Penalise tokens seen in the prompt or output (> 0; 1: none).
    pub repetition_penalty: Option<f64>,
    /// Penalise tokens already generated (-2 to 2).
    pub presence_penalty: Option<f64>,
    /// Penalise tokens by how often they were generated (-2 to 2).
    pub frequency_penalty: Option<f64>,
    /// Bias added to the logits of token ids (`{"id": -100..100}`).
    pub logit_bias: Option<serde_json::Map<String, Value>>,
    /// Generate past end-of-sequence tokens (vLLM's extension).
    pub ignore_eos: Option<bool>,
    /// Name tokens `token_id:<id>` in log probabilities (vLLM's extension).
    pub return_tokens_as_token_ids: Option<bool>,
    /// Every other field of the request.
    #[serde(flatten)]
    pub other: serde_json::Map<String, Value>,
}

/// `POST /v1/completions`.
#[derive(Debug, Clone, Deserialize)]
pub struct CompletionRequest {
    /// A string, a list with one string, or a list of token ids.
    pub prompt: Option<Value>,
    /// The rest.
    #[serde(flatten)]
    pub common: CommonParams,
}

/// One incoming chat message.
#[derive(Debug, Clone, Deserialize)]
pub struct ChatMessageIn {
    /// "system", "user", "assistant", ...
    pub role: String,
    /// A string, null, or a list of `{"type": "text", "text": ...}` parts.
    #[serde(default)]
    pub content: Value,
}

/// `POST /v1/chat/completions`.
#[derive(Debug, Clone, Deserialize)]
pub struct ChatRequest {
    /// The conversation.
    pub messages: Option<Vec<ChatMessageIn>>,
    /// Newer name of `max_tokens`.
    pub max_completion_tokens: Option<i64>,
    /// End the rendered prompt with the assistant's turn (vLLM's
    /// extension; default true).
    pub add_generation_prompt: Option<bool>,
    /// Further variables for the chat template (vLLM's extension, e.g.
    /// `{"enable_thinking": false}`).
    pub chat_template_kwargs: Option<serde_json::Map<String, Value>>,
    /// The rest.
    #[serde(flatten)]
    pub common: CommonParams,
}

/// `usage.prompt_tokens_details`.
#[derive(Debug, Clone, Copy, Serialize, PartialEq, Eq)]
pub struct PromptTokensDetails {
    /// Prompt tokens served from the KV cache (any tier).
    pub cached_tokens: usize,
}

/// `usage`.
#[derive(Debug, Clone, Copy, Serialize, PartialEq, Eq)]
pub struct Usage {
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Generated tokens.
    pub completion_tokens: usize,
    /// Both.
    pub total_tokens: usize,
    /// Cached prompt tokens.
    pub prompt_tokens_details: PromptTokensDetails,
}

pub use kvtier_store::TierTokens;

/// kvtier's additions to a response (the `kvtier` field).
#[derive(Debug, Clone, Copy, Serialize, PartialEq)]
pub struct KvtierExtras {
    /// Cached prompt tokens by tier.
    pub cached_tokens: TierTokens,
    /// Seconds from the request's arrival at the server to its first token.
    pub ttft_seconds: f64,
    /// Seconds from the scheduler's receipt of the request to its first
    /// token (queueing, prefix restore, suffix prefill).
    pub engine_ttft_seconds: f64,
    /// KV bytes restored from the store (G2/G3).
    pub restored_bytes: u64,
}

/// One choice of a completion.
#[derive(Debug, Clone, Serialize)]
pub struct CompletionChoice {
    /// Generated text.
    pub text: String,
    /// Always 0.
    pub index: u32,
    /// Log probabilities of its tokens, when asked for.
    pub logprobs: Option<CompletionLogprobs>,
    /// "stop" or "length" (null in a streamed chunk before the last).
    pub finish_reason: Option<&'static str>,
}

/// A completion, or one streamed chunk of it (same object type).
#[derive(Debug, Clone, Serialize)]
pub struct CompletionResponse {
    /// `cmpl-...`.
    pub id: String,
    /// "text_completion".
    pub object: &'static str,
    /// Unix seconds.
    pub created: u64,
    /// Served model name.
    pub model: String,
    /// One choice (none in a usage-only chunk).
    pub choices: Vec<CompletionChoice>,
    /// Token counts (absent in streamed chunks but the usage one).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
    /// kvtier's additions.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kvtier: Option<KvtierExtras>,
}

/// The assistant's message.
#[derive(Debug, Clone, Serialize)]
pub struct ChatMessageOut {
    /// "assistant".
    pub role: &'static str,
    /// Its text.
    pub content: String,
}

/// One choice of a chat completion.
#[derive(Debug, Clone, Serialize)]
pub struct ChatChoice {
    /// Always 0.
    pub index: u32,
    /// The reply.
    pub message: ChatMessageOut,
    /// Log probabilities of its tokens, when asked for.
    pub logprobs: Option<ChatLogprobs>,
    /// "stop" or "length".
    pub finish_reason: &'static str,
}

/// A chat completion.
#[derive(Debug, Clone, Serialize)]
pub struct ChatResponse {
    /// `chatcmpl-...`.
    pub id: String,
    /// "chat.completion".
    pub object: &'static str,
    /// Unix seconds.
    pub created: u64,
    /// Served model name.
    pub model: String,
    /// One choice.
    pub choices: Vec<ChatChoice>,
    /// Token counts.
    pub usage: Usage,
    /// kvtier's additions.
    pub kvtier: KvtierExtras,
}

/// The change a streamed chat chunk carries.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Delta {
    /// "assistant" in the first chunk.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    /// New text.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
}

/// One choice of a streamed chat chunk.
#[derive(Debug, Clone, Serialize)]
pub struct ChatChunkChoice {
    /// Always 0.
    pub index: u32,
    /// The change.
    pub delta: Delta,
    /// Log probabilities of the chunk's tokens, when asked for.
    pub logprobs: Option<ChatLogprobs>,
    /// Set in the last chunk.
    pub finish_reason: Option<&'static str>,
}

/// One streamed chat chunk.
#[derive(Debug, Clone, Serialize)]
pub struct ChatChunk {
    /// `chatcmpl-...` (the same in every chunk of a stream).
    pub id: String,
    /// "chat.completion.chunk".
    pub object: &'static str,
    /// Unix seconds.
    pub created: u64,
    /// Served model name.
    pub model: String,
    /// One choice (none in the usage chunk).
    pub choices: Vec<ChatChunkChoice>,
    /// Token counts (only in the usage chunk).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
    /// kvtier's additions (only in the usage chunk).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kvtier: Option<KvtierExtras>,
}

/// One entry of `GET /v1/models`.
#[derive(Debug, Clone, Serialize)]
pub struct ModelCard {
    /// The served name.
    pub id: String,
    /// "model".
    pub object: &'static str,
    /// Unix seconds the server started.
    pub created: u64,
    /// "kvtier".
    pub owned_by: &'static str,
    /// Longest sequence (prompt + generated) served.
    pub max_model_len: usize,
    /// What a client should know about how the model is served (e.g. no
    /// chat template of its own); absent when nothing.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub warnings: Vec<String>,
}

/// `GET /v1/models`.
#[derive(Debug, Clone, Serialize)]
pub struct ModelList {
    /// "list".
    pub object: &'static str,
    /// The one served model.
    pub data: Vec<ModelCard>,
}
