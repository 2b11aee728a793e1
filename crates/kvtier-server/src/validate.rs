//! Checks a request and turns it into what the scheduler needs: every bad
//! field is a 4xx naming it, before any work is queued.

use kvtier_engine::serving::sampling::{MAX_LOGPROBS, SamplingParams};
use kvtier_engine::text::tokenizer::ChatMessage;
use serde_json::Value;

use crate::api_error::ApiError;
use crate::app_state::AppState;
use crate::logprobs::TokenNames;
use crate::openai::{ChatMessageIn, CommonParams};

/// Most stop strings per request (OpenAI's limit).
pub const MAX_STOP_STRINGS: usize = 4;

/// A checked request, ready to be generated.
#[derive(Debug, Clone)]
pub struct Plan {
    /// Prompt token ids.
    pub prompt: Vec<u32>,
    /// Most tokens to generate.
    pub max_tokens: usize,
    /// How to pick tokens.
    pub sampling: SamplingParams,
    /// Strings that end generation (not included in the output).
    pub stop_strings: Vec<String>,
    /// Token ids that end generation.
    pub stop_tokens: Vec<u32>,
    /// Stream server-sent events.
    pub stream: bool,
    /// Send a usage chunk at the end of the stream.
    pub include_usage: bool,
    /// The salt of its block keys (tenant and `cache_salt`,
    /// [`crate::auth::request_salt`]).
    pub salt: Vec<u8>,
    /// Report log probabilities (their count is
    /// `sampling.logprobs`), naming tokens so.
    pub logprobs: Option<TokenNames>,
    /// Completions' `echo`: the prompt's text, output before the generated
    /// text.
    pub echo: Option<String>,
}

impl Plan {
    /// The plan with its block keys salted by `salt`.
    pub fn salted(mut self, salt: Vec<u8>) -> Self {
        self.salt = salt;
        self
    }
}

/// Which API the request came through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    /// `/v1/completions`.
    Completions,
    /// `/v1/chat/completions`.
    Chat,
}

impl Api {
    /// The prefix of its response ids (`cmpl-...`, `chatcmpl-...`).
    pub fn id_prefix(self) -> &'static str {
        match self {
            Api::Completions => "cmpl",
            Api::Chat => "chatcmpl",
        }
    }
}

/// Checks the model name against the served one.
pub fn check_model(state: &AppState, model: Option<&str>) -> Result<(), ApiError> {
    match model {
        Some(m) if m != state.model_name => Err(ApiError::model_not_found(m, &state.model_name)),
        _ => Ok(()),
    }
}

/// The prompt of a completion request as token ids.
pub fn completion_prompt(state: &AppState, prompt: Option<&Value>) -> Result<Vec<u32>, ApiError> {
    let bad = |m: &str| ApiError::invalid(m, Some("prompt"));
    let text = match prompt {
        None | Some(Value::Null) => return Err(bad("`prompt` is required")),
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(items)) if items.iter().all(Value::is_string) => match items.as_slice() {
            [Value::String(s)] => s.clone(),
            [] => return Err(bad("`prompt` must not be empty")),
            _ => {
                return Err(bad(
                    "a list of several prompts is not supported: send one prompt per request",
                ));
            }
        },
        Some(Value::Array(items)) if items.iter().all(Value::is_number) => {
            return items
                .iter()
                .map(|v| {
                    v.as_u64()
                        .filter(|&id| (id as usize) < state.tokenizer.vocab_size())
                        .map(|id| id as u32)
                        .ok_or_else(|| {
                            bad(&format!(
                                "token id {v} is not in the vocabulary (0 to {})",
                                state.tokenizer.vocab_size().saturating_sub(1)
                            ))
                        })
                })
                .collect();
        }
        Some(_) => {
            return Err(bad(
                "`prompt` must be a string, a list of one string, or a list of token ids",
            ));
        }
    };
    encode(state, &text, "prompt", Encoding::Text)
}

/// The text of a completion's prompt, for `echo`: the string as sent, or
/// the text of the token ids.
pub fn prompt_text(
    state: &AppState,
    prompt: Option<&Value>,
    ids: &[u32],
) -> Result<String, ApiError> {
    match prompt {
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(items)) => match items.as_slice() {
            [Value::String(s)] => Ok(s.clone()),
            _ => state
                .tokenizer
                .decode(ids)
                .map_err(|e| ApiError::internal(format!("cannot decode the prompt: {e}"))),
        },
        _ => Ok(String::new()),
    }
}

/// The messages of a chat request as chat messages: content is a string,
/// null, or a list of text parts (joined with newlines, as vLLM does).
pub fn chat_messages(messages: Option<&[ChatMessageIn]>) -> Result<Vec<ChatMessage>, ApiError> {
    let bad = |m: String| ApiError::invalid(m, Some("messages"));
    let messages = messages.ok_or_else(|| bad("`messages` is required".into()))?;
    if messages.is_empty() {
        return Err(bad("`messages` must not be empty".into()));
    }
    let mut out = Vec::with_capacity(messages.len());
    for (i, m) in messages.iter().enumerate() {
        if m.role.is_empty() {
            return Err(bad(format!("messages[{i}].role must not be empty")));
        }
        let content = match &m.content {
            Value::Null => String::new(),
            Value::String(s) => s.clone(),
            Value::Array(parts) => {
                let mut texts = Vec::with_capacity(parts.len());
                for part in parts {
                    match (part.get("type").and_then(Value::as_str), part.get("text")) {
                        (Some("text"), Some(Value::String(t))) => texts.push(t.as_str()),
                        _ => {
                            return Err(bad(format!(
                                "messages[{i}].content: only text parts are supported"
                            )));
                        }
                    }
                }
                texts.join("\n")
            }
            _ => {
                return Err(bad(format!(
                    "messages[{i}].content must be a string or a list of text parts"
                )));
            }
        };
        out.push(ChatMessage {
            role: m.role.clone(),
            content,
        });
    }
    Ok(out)
}

/// The messages of a chat request rendered with the model's chat template
/// and tokenized as `apply_chat_template(..., tokenize=True)` does (the
/// template spells its own special tokens). A template error (for example
/// its `raise_exception` on roles that do not alternate) is a 400 with the
/// template's message.
pub fn chat_prompt(
    state: &AppState,
    messages: Option<&[ChatMessageIn]>,
    add_generation_prompt: bool,
    kwargs: Option<&serde_json::Map<String, Value>>,
) -> Result<Vec<u32>, ApiError> {
    let messages = chat_messages(messages)?;
    let text = state
        .chat_template
        .render(&messages, add_generation_prompt, kwargs)
        .map_err(|e| {
            ApiError::invalid(
                format!("the chat template refused the messages: {e}"),
                Some("messages"),
            )
        })?;
    encode(state, &text, "messages", Encoding::Rendered)
}

/// How a text becomes token ids.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Encoding {
    /// A text prompt: with the special tokens the model adds to every input.
    Text,
    /// A rendered chat prompt: it spells its special tokens; none added.
    Rendered,
}

/// Tokenizes `text`, first refusing one too long to fit without tokenizing
/// it: `n` bytes are at least `n / longest_token_bytes` tokens, so past
/// `max_prompt_tokens x longest_token_bytes` bytes the prompt is over the
/// limit whatever it says (a prompt of megabytes used to take long and
/// much memory to tokenize before its 400). Decision: a tokenizer whose normalizer deletes
/// text could have fitted such a prompt; it is refused all the same. Call
/// it off the async workers ([`crate::routes`] does).
pub fn encode(
    state: &AppState,
    text: &str,
    param: &'static str,
    how: Encoding,
) -> Result<Vec<u32>, ApiError> {
    let max_prompt_tokens = state.limits.max_prompt_tokens;
    let max_bytes = max_prompt_tokens.saturating_mul(state.tokenizer.longest_token_bytes());
    if text.len() > max_bytes {
        return Err(ApiError::invalid(
            format!(
                "the {param} is {} bytes, more than {max_prompt_tokens} tokens can hold \
                 ({max_bytes} bytes at most with this tokenizer); this server accepts at \
                 most {max_prompt_tokens} prompt tokens",
                text.len()
            ),
            Some(param),
        )
        .with_code("context_length_exceeded"));
    }
    match how {
        Encoding::Text => state.tokenizer.encode(text),
        Encoding::Rendered => state.tokenizer.encode_rendered(text),
    }
    .map_err(|e| ApiError::invalid(format!("cannot tokenize the {param}: {e}"), Some(param)))
}

/// Fields kvtier accepts without acting on them only at these values (the
/// ones that ask for nothing: OpenAI's defaults, as clients often send
/// them explicitly). `null` is accepted for every field.
fn neutral(field: &str, v: &Value) -> Option<bool> {
    let zero = || v.as_f64() == Some(0.0);
    Some(match field {
        // Metadata: an end user's id (OpenAI), no effect by design.
        "user" => v.is_string(),
        "parallel_tool_calls" | "store" => v.as_bool() == Some(false),
        "min_tokens" => zero(),
        "best_of" => v.as_f64() == Some(1.0),
        "metadata" => v.as_object().is_some_and(serde_json::Map::is_empty),
        "tools" | "functions" => v.as_array().is_some_and(Vec::is_empty),
        "tool_choice" | "function_call" => v.as_str() == Some("none"),
        "response_format" => v.get("type").and_then(Value::as_str) == Some("text"),
        "suffix" => v.as_str() == Some(""),
        _ => return None,
    })
}

/// A 400 naming the first field of `p.other` that asks for something this
/// server does not do (an unknown field, or a known one at a value other
/// than its neutral one).
pub fn check_unsupported(p: &CommonParams) -> Result<(), ApiError> {
    for (field, v) in &p.other {
        if v.is_null() {
            continue;
        }
        let message = match neutral(field, v) {
            Some(true) => continue,
            Some(false) => format!(
                "`{field}` = {v} is not supported by this server; leave it out (or at its \
                 default) and see docs/architecture.md for what is served"
            ),
            None => format!("unknown field `{field}`: this server does not support it"),
        };
        return Err(ApiError::invalid_field(message, field));
    }
    Ok(())
}

/// Checks the shared fields and the prompt's length; builds the plan.
/// `max_tokens` falls back to `default_max` (the rest of the context when
/// `None`).
pub fn plan(
    state: &AppState,
    api: Api,
    prompt: Vec<u32>,
    p: &CommonParams,
    max_tokens: Option<i64>,
    default_max: Option<usize>,
) -> Result<Plan, ApiError> {
    check_unsupported(p)?;
    let (prompt_param, prompt_name) = match api {
        Api::Completions => ("prompt", "prompt"),
        Api::Chat => ("messages", "chat prompt (rendered messages)"),
    };
    if let Some(n) = p.n
        && n != 1
    {
        return Err(ApiError::invalid(
            format!("n = {n} is not supported: only one choice (n = 1) is generated"),
            Some("n"),
        ));
    }
    let temperature = p.temperature.unwrap_or(1.0);
    if !(0.0..=2.0).contains(&temperature) {
        return Err(ApiError::invalid(
            format!("temperature {temperature} is out of range: it must be between 0 and 2"),
            Some("temperature"),
        ));
    }
    let top_p = p.top_p.unwrap_or(1.0);
    if !(0.0..=1.0).contains(&top_p) {
        return Err(ApiError::invalid(
            format!("top_p {top_p} is out of range: it must be between 0 and 1"),
            Some("top_p"),
        ));
    }
    let stop_strings = stop_strings(p.stop.as_ref())?;
    if prompt.is_empty() {
        return Err(ApiError::invalid(
            format!("the {prompt_name} is empty: it must hold at least one token"),
            Some(prompt_param),
        ));
    }
    let limits = state.limits;
    if prompt.len() > limits.max_prompt_tokens {
        return Err(ApiError::invalid(
            format!(
                "the {prompt_name} has {} tokens; this server accepts at most {} \
                 (context length {})",
                prompt.len(),
                limits.max_prompt_tokens,
                limits.context_tokens
            ),
            Some(prompt_param),
        )
        .with_code("context_length_exceeded"));
    }
    let room = limits.context_tokens - prompt.len();
    let max_tokens = match max_tokens {
        None => default_max.unwrap_or(room).min(room),
        Some(n) if n < 1 => {
            return Err(ApiError::invalid(
                format!("max_tokens {n} is out of range: it must be at least 1"),
                Some("max_tokens"),
            ));
        }
        Some(n) if n as u64 > limits.context_tokens as u64 => {
            return Err(ApiError::invalid(
                format!(
                    "max_tokens {n} is above the context length ({} tokens)",
                    limits.context_tokens
                ),
                Some("max_tokens"),
            ));
        }
        Some(n) if n as usize > room => {
            return Err(ApiError::invalid(
                format!(
                    "max_tokens {n} does not fit: the context length is {} tokens and the \
                     {prompt_name} takes {}, leaving {room}",
                    limits.context_tokens,
                    prompt.len()
                ),
                Some("max_tokens"),
            )
            .with_code("context_length_exceeded"));
        }
        Some(n) => n as usize,
    };
    let stop_tokens = match (api, p.ignore_eos.unwrap_or(false)) {
        // vLLM's ignore_eos: generate max_tokens whatever the model says.
        (_, true) => Vec::new(),
        (Api::Completions, false) => state.stop_tokens.clone(),
        (Api::Chat, false) => state.chat_stop_tokens.clone(),
    };
    let logprobs = logprobs_count(api, p)?;
    if p.echo == Some(true) {
        if api == Api::Chat {
            return Err(ApiError::invalid(
                "echo is the completions API's; the chat API does not echo",
                Some("echo"),
            ));
        }
        if logprobs.is_some() {
            return Err(ApiError::invalid(
                "echo with logprobs would need the prompt's log probabilities, which this \
                 server does not compute: ask for one or the other",
                Some("echo"),
            ));
        }
    }
    let stream = p.stream.unwrap_or(false);
    Ok(Plan {
        prompt,
        max_tokens,
        sampling: SamplingParams {
            temperature: temperature as f32,
            top_p: top_p as f32,
            top_k: top_k(p.top_k)?,
            min_p: in_range(p.min_p, "min_p", 0.0, 1.0)?.unwrap_or(0.0) as f32,
            repetition_penalty: repetition_penalty(p.repetition_penalty)?,
            presence_penalty: in_range(p.presence_penalty, "presence_penalty", -2.0, 2.0)?
                .unwrap_or(0.0) as f32,
            frequency_penalty: in_range(p.frequency_penalty, "frequency_penalty", -2.0, 2.0)?
                .unwrap_or(0.0) as f32,
            logit_bias: logit_bias(state, p.logit_bias.as_ref())?,
            seed: p.seed.map(|s| s as u64),
            logprobs,
        },
        stop_strings,
        stop_tokens,
        stream,
        include_usage: stream && p.stream_options.as_ref().is_some_and(|o| o.include_usage),
        salt: Vec::new(),
        logprobs: logprobs.map(|_| TokenNames {
            as_ids: p.return_tokens_as_token_ids.unwrap_or(false),
        }),
        echo: None,
    })
}

/// `value` when it lies in `lo..=hi`, else a 400 naming `field`.
fn in_range(
    value: Option<f64>,
    field: &'static str,
    lo: f64,
    hi: f64,
) -> Result<Option<f64>, ApiError> {
    match value {
        Some(v) if !(lo..=hi).contains(&v) => Err(ApiError::invalid(
            format!("{field} {v} is out of range: it must be between {lo} and {hi}"),
            Some(field),
        )),
        v => Ok(v),
    }
}

fn top_k(value: Option<i64>) -> Result<usize, ApiError> {
    match value {
        None | Some(-1 | 0) => Ok(0),
        Some(k) if k > 0 => Ok(usize::try_from(k).unwrap_or(usize::MAX)),
        Some(k) => Err(ApiError::invalid(
            format!("top_k {k} is out of range: -1 or 0 (all tokens), or at least 1"),
            Some("top_k"),
        )),
    }
}

fn repetition_penalty(value: Option<f64>) -> Result<f32, ApiError> {
    match value {
        None => Ok(1.0),
        Some(r) if r > 0.0 && r <= 10.0 => Ok(r as f32),
        Some(r) => Err(ApiError::invalid(
            format!("repetition_penalty {r} is out of range: it must be above 0 and at most 10"),
            Some("repetition_penalty"),
        )),
    }
}

/// OpenAI's `logit_bias`: token ids (as strings) to biases in -100..=100.
fn logit_bias(
    state: &AppState,
    bias: Option<&serde_json::Map<String, Value>>,
) -> Result<Vec<(u32, f32)>, ApiError> {
    let vocab = state.tokenizer.vocab_size();
    let bad = |m: String| ApiError::invalid(m, Some("logit_bias"));
    let mut out = Vec::new();
    for (k, v) in bias.into_iter().flatten() {
        let id = k
            .parse::<u32>()
            .ok()
            .filter(|&id| (id as usize) < vocab)
            .ok_or_else(|| {
                bad(format!(
                    "logit_bias key {k:?} is not a token id of the vocabulary (0 to {})",
                    vocab.saturating_sub(1)
                ))
            })?;
        let b = v
            .as_f64()
            .filter(|b| (-100.0..=100.0).contains(b))
            .ok_or_else(|| {
                bad(format!(
                    "logit_bias[{k}] = {v} must be a number from -100 to 100"
                ))
            })?;
        out.push((id, b as f32));
    }
    Ok(out)
}

/// How many alternatives to report with each token's log probability
/// (`None`: no log probabilities): completions' `logprobs: N`, chat's
/// `logprobs: true` with `top_logprobs: N`.
fn logprobs_count(api: Api, p: &CommonParams) -> Result<Option<usize>, ApiError> {
    let too_many = |field: &'static str, n: &dyn std::fmt::Display| {
        ApiError::invalid(
            format!("{field} {n} is out of range: it must be between 0 and {MAX_LOGPROBS}"),
            Some(field),
        )
    };
    let count = |n: i64, field| {
        usize::try_from(n)
            .ok()
            .filter(|&n| n <= MAX_LOGPROBS)
            .ok_or_else(|| too_many(field, &n))
    };
    match api {
        Api::Completions => {
            if p.top_logprobs.is_some_and(|n| n != 0) {
                return Err(ApiError::invalid(
                    "top_logprobs is the chat API's: completions take `logprobs: N`",
                    Some("top_logprobs"),
                ));
            }
            match &p.logprobs {
                None | Some(Value::Null) | Some(Value::Bool(false)) => Ok(None),
                Some(v) => match v.as_i64() {
                    Some(n) => count(n, "logprobs").map(Some),
                    None => Err(ApiError::invalid(
                        format!("logprobs {v} must be an integer from 0 to {MAX_LOGPROBS}"),
                        Some("logprobs"),
                    )),
                },
            }
        }
        Api::Chat => {
            let on = match &p.logprobs {
                None | Some(Value::Null) => false,
                Some(Value::Bool(b)) => *b,
                Some(v) => {
                    return Err(ApiError::invalid(
                        format!("logprobs {v} must be true or false (and top_logprobs a number)"),
                        Some("logprobs"),
                    ));
                }
            };
            match (on, p.top_logprobs) {
                (false, None | Some(0)) => Ok(None),
                (false, Some(_)) => Err(ApiError::invalid(
                    "top_logprobs needs logprobs: true",
                    Some("top_logprobs"),
                )),
                (true, n) => count(n.unwrap_or(0), "top_logprobs").map(Some),
            }
        }
    }
}

fn stop_strings(stop: Option<&Value>) -> Result<Vec<String>, ApiError> {
    let bad = |m: String| ApiError::invalid(m, Some("stop"));
    let list = match stop {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(items)) => items
            .iter()
            .map(|v| {
                v.as_str()
                    .map(str::to_string)
                    .ok_or_else(|| bad("`stop` must be a string or a list of strings".into()))
            })
            .collect::<Result<_, _>>()?,
        Some(_) => return Err(bad("`stop` must be a string or a list of strings".into())),
    };
    if list.len() > MAX_STOP_STRINGS {
        return Err(bad(format!(
            "`stop` has {} strings; at most {MAX_STOP_STRINGS} are allowed",
            list.len()
        )));
    }
    Ok(list.into_iter().filter(|s| !s.is_empty()).collect())
}
