//! `POST /tokenize` and `POST /detokenize`, in vLLM's shapes: what the
//! server would make of a prompt or a conversation (the chat template
//! rendered and tokenized as for `/v1/chat/completions`), and the text of
//! token ids. Clients use them to count tokens and to check a template;
//! the reference tests compare them with `transformers`.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::api_error::ApiError;
use crate::app_state::AppState;
use crate::openai::ChatMessageIn;
use crate::validate::{self, Encoding};

/// `POST /tokenize`: a `prompt`, or chat `messages`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokenizeRequest {
    /// Served model name (optional).
    pub model: Option<String>,
    /// A text prompt.
    pub prompt: Option<String>,
    /// A conversation, rendered with the chat template.
    pub messages: Option<Vec<ChatMessageIn>>,
    /// Add the special tokens the model adds to every input (default: true
    /// for a prompt, false for messages, whose template writes its own).
    pub add_special_tokens: Option<bool>,
    /// End the rendered conversation with the assistant's turn (default
    /// true).
    pub add_generation_prompt: Option<bool>,
    /// Further chat template variables.
    pub chat_template_kwargs: Option<Map<String, Value>>,
}

/// The answer of `POST /tokenize`.
#[derive(Debug, Clone, Serialize)]
pub struct TokenizeResponse {
    /// Tokens.
    pub count: usize,
    /// Longest sequence (prompt + generated) served.
    pub max_model_len: usize,
    /// The token ids.
    pub tokens: Vec<u32>,
}

/// `POST /detokenize`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DetokenizeRequest {
    /// Served model name (optional).
    pub model: Option<String>,
    /// Token ids.
    pub tokens: Vec<i64>,
}

/// The answer of `POST /detokenize`.
#[derive(Debug, Clone, Serialize)]
pub struct DetokenizeResponse {
    /// The text (special tokens skipped).
    pub prompt: String,
}

/// Tokenizes as the generating endpoints would.
pub fn tokenize(state: &AppState, req: &TokenizeRequest) -> Result<TokenizeResponse, ApiError> {
    validate::check_model(state, req.model.as_deref())?;
    let tokens = match (&req.prompt, &req.messages) {
        (Some(prompt), None) => {
            let how = if req.add_special_tokens.unwrap_or(true) {
                Encoding::Text
            } else {
                Encoding::Rendered
            };
            validate::encode(state, prompt, "prompt", how)?
        }
        (None, Some(_)) if req.add_special_tokens == Some(true) => {
            return Err(ApiError::invalid(
                "add_special_tokens with messages is not supported: the chat template \
                 writes the special tokens itself",
                Some("add_special_tokens"),
            ));
        }
        (None, Some(messages)) => validate::chat_prompt(
            state,
            Some(messages),
            req.add_generation_prompt.unwrap_or(true),
            req.chat_template_kwargs.as_ref(),
        )?,
        _ => {
            return Err(ApiError::invalid(
                "give exactly one of `prompt` and `messages`",
                Some("prompt"),
            ));
        }
    };
    Ok(TokenizeResponse {
        count: tokens.len(),
        max_model_len: state.limits.context_tokens,
        tokens,
    })
}

/// The text of token ids (each checked against the vocabulary).
pub fn detokenize(
    state: &AppState,
    req: &DetokenizeRequest,
) -> Result<DetokenizeResponse, ApiError> {
    validate::check_model(state, req.model.as_deref())?;
    let vocab = state.tokenizer.vocab_size();
    let ids = req
        .tokens
        .iter()
        .map(|&t| {
            u32::try_from(t)
                .ok()
                .filter(|&id| (id as usize) < vocab)
                .ok_or_else(|| {
                    ApiError::invalid(
                        format!(
                            "token id {t} is not in the vocabulary (0 to {})",
                            vocab.saturating_sub(1)
                        ),
                        Some("tokens"),
                    )
                })
        })
        .collect::<Result<Vec<u32>, _>>()?;
    let prompt = state
        .tokenizer
        .decode(&ids)
        .map_err(|e| ApiError::internal(format!("cannot decode the tokens: {e}")))?;
    Ok(DetokenizeResponse { prompt })
}
