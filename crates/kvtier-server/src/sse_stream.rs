//! Streaming responses: server-sent events carrying OpenAI chunk objects
//! (`text_completion` or `chat.completion.chunk`), a last chunk with the
//! finish reason, an optional usage chunk, then `data: [DONE]`.
//!
//! A task drives the [`Generation`] and sends events into a small channel
//! that the response body reads; when the client goes away the channel
//! closes, the task drops the generation, and the scheduler ends the
//! sequence.

use std::convert::Infallible;
use std::sync::Arc;

use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use tokio::sync::mpsc::Sender;
use tokio_stream::wrappers::ReceiverStream;

use crate::app_state::AppState;
use crate::generate::{Generation, Piece};
use crate::logprobs::{ChatLogprobs, CompletionLogprobs, TokenNames};
use crate::openai::{
    ChatChunk, ChatChunkChoice, CompletionChoice, CompletionResponse, Delta, KvtierExtras, Usage,
};
use crate::validate::Api;

/// Identity of a stream's chunks, and what they carry besides text.
#[derive(Debug, Clone)]
pub struct StreamMeta {
    /// Which API's chunk objects to send.
    pub api: Api,
    /// The response id (the same in every chunk).
    pub id: String,
    /// Unix seconds.
    pub created: u64,
    /// Served model name.
    pub model: String,
    /// Send a usage chunk before `[DONE]`.
    pub include_usage: bool,
    /// Log probabilities with each chunk, tokens named so (`None`: none).
    pub names: Option<TokenNames>,
    /// Completions' `echo`: the prompt's text, sent as the first chunk.
    pub echo: Option<String>,
}

/// A chunk's content: text and the log probabilities of its tokens.
struct ChunkText {
    text: Option<String>,
    completion: Option<CompletionLogprobs>,
    chat: Option<ChatLogprobs>,
}

impl ChunkText {
    fn plain(text: Option<String>) -> Self {
        Self {
            text,
            completion: None,
            chat: None,
        }
    }
}

impl StreamMeta {
    fn text_chunk(&self, c: ChunkText, finish: Option<&'static str>, first: bool) -> Event {
        let ChunkText {
            text,
            completion,
            chat,
        } = c;
        match self.api {
            Api::Completions => json_event(&CompletionResponse {
                id: self.id.clone(),
                object: "text_completion",
                created: self.created,
                model: self.model.clone(),
                choices: vec![CompletionChoice {
                    text: text.unwrap_or_default(),
                    index: 0,
                    logprobs: completion,
                    finish_reason: finish,
                }],
                usage: None,
                kvtier: None,
            }),
            Api::Chat => json_event(&ChatChunk {
                id: self.id.clone(),
                object: "chat.completion.chunk",
                created: self.created,
                model: self.model.clone(),
                choices: vec![ChatChunkChoice {
                    index: 0,
                    delta: Delta {
                        role: first.then_some("assistant"),
                        content: text,
                    },
                    logprobs: chat,
                    finish_reason: finish,
                }],
                usage: None,
                kvtier: None,
            }),
        }
    }

    fn usage_chunk(&self, usage: Usage, extras: KvtierExtras) -> Event {
        match self.api {
            Api::Completions => json_event(&CompletionResponse {
                id: self.id.clone(),
                object: "text_completion",
                created: self.created,
                model: self.model.clone(),
                choices: Vec::new(),
                usage: Some(usage),
                kvtier: Some(extras),
            }),
            Api::Chat => json_event(&ChatChunk {
                id: self.id.clone(),
                object: "chat.completion.chunk",
                created: self.created,
                model: self.model.clone(),
                choices: Vec::new(),
                usage: Some(usage),
                kvtier: Some(extras),
            }),
        }
    }
}

fn json_event<T: Serialize>(v: &T) -> Event {
    match serde_json::to_string(v) {
        Ok(s) => Event::default().data(s),
        Err(e) => error_event(&format!("cannot encode a chunk: {e}")),
    }
}

fn error_event(message: &str) -> Event {
    let body = serde_json::json!({
        "error": {"message": message, "type": "server_error", "param": null, "code": null}
    });
    Event::default().data(body.to_string())
}

/// The streaming response for a started generation.
pub fn stream_response(state: Arc<AppState>, gen_: Generation, meta: StreamMeta) -> Response {
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Event, Infallible>>(64);
    tokio::spawn(drive(state, gen_, meta, tx));
    Sse::new(ReceiverStream::new(rx)).into_response()
}

async fn drive(
    state: Arc<AppState>,
    mut gen_: Generation,
    meta: StreamMeta,
    tx: Sender<Result<Event, Infallible>>,
) {
    let send = |ev: Event| {
        let tx = tx.clone();
        async move { tx.send(Ok(ev)).await.is_ok() }
    };
    let first = match (meta.api, &meta.echo) {
        (Api::Chat, _) => Some(String::new()),
        (Api::Completions, Some(echo)) => Some(echo.clone()),
        (Api::Completions, None) => None,
    };
    // Completions' text offsets run on from the echoed prompt.
    let mut offset = meta.echo.as_deref().map_or(0, |e| e.chars().count());
    if let Some(text) = first
        && !send(meta.text_chunk(ChunkText::plain(Some(text)), None, true)).await
    {
        return;
    }
    loop {
        match gen_.next().await {
            Ok(Some(Piece::Text(t, lp))) => {
                let mut chunk = ChunkText::plain(Some(t));
                match (meta.names, meta.api) {
                    (Some(names), Api::Completions) => {
                        let (built, next) = CompletionLogprobs::build(&state, names, &lp, offset);
                        offset = next;
                        chunk.completion = Some(built);
                    }
                    (Some(names), Api::Chat) => {
                        chunk.chat = Some(ChatLogprobs::build(&state, names, &lp));
                    }
                    (None, _) => {}
                }
                if !send(meta.text_chunk(chunk, None, false)).await {
                    return;
                }
            }
            Ok(Some(Piece::Finished(f))) => {
                if !send(meta.text_chunk(ChunkText::plain(None), Some(f.reason), false)).await {
                    return;
                }
                if meta.include_usage && !send(meta.usage_chunk(gen_.usage(f), gen_.extras())).await
                {
                    return;
                }
                break;
            }
            Ok(None) => break,
            Err(e) => {
                tracing::warn!("stream {} failed: {e}", meta.id);
                if !send(error_event(&e.message)).await {
                    return;
                }
                break;
            }
        }
    }
    let _ = send(Event::default().data("[DONE]")).await;
}
