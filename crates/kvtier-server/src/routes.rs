//! The endpoints: `POST /v1/completions`, `POST /v1/chat/completions`,
//! `POST /tokenize`, `POST /detokenize`, `GET /v1/models`, `GET /health`,
//! `GET /metrics`, and the router that ties them together with the body
//! limit, the error fallbacks and the request counter.

use std::sync::Arc;
use std::time::Instant;

use axum::Router;
use axum::extract::{DefaultBodyLimit, MatchedPath, Path, Request, State};
use axum::http::{HeaderMap, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json};
use kvtier_engine::serving::sampling::Sampled;
use kvtier_store::MetricsFormat;
use serde_json::json;
use tower_http::timeout::RequestBodyTimeoutLayer;

use crate::api_error::{self, ApiError, ApiJson};
use crate::app_state::{AppState, unix_now};
use crate::auth::{self, Tenant, request_salt};
use crate::conn_limits;
use crate::generate::{Finish, Generation};
use crate::logprobs::{ChatLogprobs, CompletionLogprobs, TokenNames};
use crate::openai::{
    ChatChoice, ChatMessageOut, ChatRequest, ChatResponse, CompletionChoice, CompletionRequest,
    CompletionResponse, KvtierExtras, ModelCard, ModelList, Usage,
};
use crate::sse_stream::{StreamMeta, stream_response};
use crate::tokenize::{self, DetokenizeRequest, TokenizeRequest};
use crate::validate::{self, Api, Plan};

/// `max_tokens` of a completion when the request has none (OpenAI's).
pub const DEFAULT_COMPLETION_MAX_TOKENS: usize = 16;

type Shared = Arc<AppState>;

/// The router with every endpoint; bodies over `max_body_bytes` get 413.
pub fn router(state: Shared, max_body_bytes: usize) -> Router {
    // Only the generating endpoints count against the in-flight cap: a
    // health check or a scrape must answer while the server is full.
    let generating = Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route_layer(middleware::from_fn_with_state(
            state.in_flight.clone(),
            conn_limits::limit_in_flight,
        ));
    Router::new()
        .merge(generating)
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .route("/v1/models", get(models))
        .route("/v1/models/{model}", get(model))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .fallback(api_error::not_found)
        .method_not_allowed_fallback(api_error::method_not_allowed)
        .layer(DefaultBodyLimit::max(max_body_bytes))
        .layer(RequestBodyTimeoutLayer::new(state.body_timeout))
        .layer(middleware::from_fn_with_state(
            state.api_keys.clone(),
            auth::require_key,
        ))
        .layer(middleware::from_fn_with_state(
            state.clone(),
            count_requests,
        ))
        .with_state(state)
}

/// Counts every request by endpoint (the route, or `other`) and status.
async fn count_requests(State(state): State<Shared>, req: Request, next: Next) -> Response {
    let endpoint = req
        .extensions()
        .get::<MatchedPath>()
        .map_or_else(|| "other".to_string(), |p| p.as_str().to_string());
    let resp = next.run(req).await;
    state
        .metrics
        .count_request(&endpoint, resp.status().as_u16());
    resp
}

async fn completions(
    State(state): State<Shared>,
    Extension(tenant): Extension<Tenant>,
    ApiJson(req): ApiJson<CompletionRequest>,
) -> Response {
    let arrived = Instant::now();
    let checked = state.clone();
    let plan = off_workers(&state, move || {
        let state = checked;
        validate::check_model(&state, req.common.model.as_deref())?;
        let prompt = validate::completion_prompt(&state, req.prompt.as_ref())?;
        let mut plan = validate::plan(
            &state,
            Api::Completions,
            prompt,
            &req.common,
            req.common.max_tokens,
            Some(DEFAULT_COMPLETION_MAX_TOKENS),
        )?;
        if req.common.echo == Some(true) {
            plan.echo = Some(validate::prompt_text(
                &state,
                req.prompt.as_ref(),
                &plan.prompt,
            )?);
        }
        Ok(plan.salted(request_salt(&tenant, req.common.cache_salt.as_deref())))
    })
    .await;
    answer(&state, Api::Completions, plan, arrived, |state, r| {
        let logprobs = r
            .names
            .map(|names| CompletionLogprobs::build(state, names, &r.logprobs, 0).0);
        Json(CompletionResponse {
            id: r.id,
            object: "text_completion",
            created: unix_now(),
            model: state.model_name.clone(),
            choices: vec![CompletionChoice {
                text: r.echo.unwrap_or_default() + &r.text,
                index: 0,
                logprobs,
                finish_reason: Some(r.finish.reason),
            }],
            usage: Some(r.usage),
            kvtier: Some(r.extras),
        })
        .into_response()
    })
    .await
}

async fn chat_completions(
    State(state): State<Shared>,
    Extension(tenant): Extension<Tenant>,
    ApiJson(req): ApiJson<ChatRequest>,
) -> Response {
    let arrived = Instant::now();
    let checked = state.clone();
    let plan = off_workers(&state, move || {
        let state = checked;
        validate::check_model(&state, req.common.model.as_deref())?;
        let prompt = validate::chat_prompt(
            &state,
            req.messages.as_deref(),
            req.add_generation_prompt.unwrap_or(true),
            req.chat_template_kwargs.as_ref(),
        )?;
        let plan = validate::plan(
            &state,
            Api::Chat,
            prompt,
            &req.common,
            req.max_completion_tokens.or(req.common.max_tokens),
            None,
        )?;
        Ok(plan.salted(request_salt(&tenant, req.common.cache_salt.as_deref())))
    })
    .await;
    answer(&state, Api::Chat, plan, arrived, |state, r| {
        let logprobs = r
            .names
            .map(|names| ChatLogprobs::build(state, names, &r.logprobs));
        Json(ChatResponse {
            id: r.id,
            object: "chat.completion",
            created: unix_now(),
            model: state.model_name.clone(),
            choices: vec![ChatChoice {
                index: 0,
                message: ChatMessageOut {
                    role: "assistant",
                    content: r.text,
                },
                logprobs,
                finish_reason: r.finish.reason,
            }],
            usage: r.usage,
            kvtier: r.extras,
        })
        .into_response()
    })
    .await
}

/// Runs a request's checks, its chat template and its tokenizing on a
/// blocking thread: a long prompt must not hold an async worker (a burst
/// of prompts of megabytes stalled `/health` when they ran on them).
/// At most one per core at a time ([`AppState::checks`]): tokenizing takes
/// many times a prompt's bytes in memory, so the peak stays bounded
/// however many long prompts arrive together.
async fn off_workers<T: Send + 'static>(
    state: &AppState,
    check: impl FnOnce() -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    let failed =
        |e: &dyn std::fmt::Display| ApiError::internal(format!("checking the request failed: {e}"));
    let _turn = state.checks.acquire().await.map_err(|e| failed(&e))?;
    tokio::task::spawn_blocking(check)
        .await
        .unwrap_or_else(|e| Err(failed(&e)))
}

/// The whole answer to a request that is not streamed.
struct Reply {
    id: String,
    text: String,
    finish: Finish,
    usage: Usage,
    extras: KvtierExtras,
    /// How to name tokens in log probabilities (`None`: none asked for).
    names: Option<TokenNames>,
    /// The generated tokens with their log probabilities.
    logprobs: Vec<Sampled>,
    /// The prompt's text, for `echo`.
    echo: Option<String>,
}

/// The skeleton both generating endpoints share: a checked request
/// (`plan`, or the error to answer with) is started; a streamed one becomes
/// server-sent events of `api`'s chunks, any other is collected and shaped
/// by `whole`.
async fn answer(
    state: &Shared,
    api: Api,
    plan: Result<Plan, ApiError>,
    arrived: Instant,
    whole: impl FnOnce(&AppState, Reply) -> Response,
) -> Response {
    let run = async {
        let plan = plan?;
        let (stream, include_usage) = (plan.stream, plan.include_usage);
        let (names, echo) = (plan.logprobs, plan.echo.clone());
        let mut gen_ = Generation::start(state, plan, arrived).await?;
        let id = state.response_id(api.id_prefix());
        if stream {
            let meta = StreamMeta {
                api,
                id,
                created: unix_now(),
                model: state.model_name.clone(),
                include_usage,
                names,
                echo,
            };
            return Ok(stream_response(state.clone(), gen_, meta));
        }
        let (text, finish, logprobs) = gen_.collect().await?;
        let reply = Reply {
            id,
            text,
            finish,
            usage: gen_.usage(finish),
            extras: gen_.extras(),
            names,
            logprobs,
            echo,
        };
        Ok::<_, ApiError>(whole(state, reply))
    };
    run.await.unwrap_or_else(IntoResponse::into_response)
}

async fn tokenize(State(state): State<Shared>, ApiJson(req): ApiJson<TokenizeRequest>) -> Response {
    let checked = state.clone();
    off_workers(&state, move || tokenize::tokenize(&checked, &req))
        .await
        .map(Json)
        .into_response()
}

async fn detokenize(
    State(state): State<Shared>,
    ApiJson(req): ApiJson<DetokenizeRequest>,
) -> Response {
    let checked = state.clone();
    off_workers(&state, move || tokenize::detokenize(&checked, &req))
        .await
        .map(Json)
        .into_response()
}

fn card(state: &AppState) -> ModelCard {
    ModelCard {
        id: state.model_name.clone(),
        object: "model",
        created: state.created,
        owned_by: "kvtier",
        max_model_len: state.limits.context_tokens,
        warnings: state.chat_template.warning().into_iter().collect(),
    }
}

async fn models(State(state): State<Shared>) -> Json<ModelList> {
    Json(ModelList {
        object: "list",
        data: vec![card(&state)],
    })
}

async fn model(State(state): State<Shared>, Path(name): Path<String>) -> Response {
    if name == state.model_name {
        Json(card(&state)).into_response()
    } else {
        ApiError::model_not_found(&name, &state.model_name).into_response()
    }
}

async fn health(State(state): State<Shared>) -> Json<serde_json::Value> {
    Json(json!({"status": "ok", "model": state.model_name}))
}

/// Prometheus text by default, OpenMetrics when the `Accept` header asks.
async fn metrics(State(state): State<Shared>, headers: HeaderMap) -> Response {
    let accept = headers.get(header::ACCEPT).and_then(|v| v.to_str().ok());
    let format = MetricsFormat::from_accept(accept);
    state
        .metrics
        .observe_scheduler(state.scheduler.stats().snapshot());
    (
        [(header::CONTENT_TYPE, format.content_type())],
        state.metrics.render(format),
    )
        .into_response()
}
