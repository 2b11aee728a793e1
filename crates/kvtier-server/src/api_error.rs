//! OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}`
//! with a 4xx status for bad input and 5xx only when the engine fails.
//!
//! Every way a request can go wrong comes back in this shape, including the
//! rejections of axum's extractors (malformed JSON, wrong content type, a
//! body over the size limit), unknown routes and wrong methods.

use std::borrow::Cow;

use axum::Json;
use axum::extract::rejection::JsonRejection;
use axum::extract::{FromRequest, Request};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::de::DeserializeOwned;
use serde_json::json;

/// One API error, rendered as OpenAI renders its errors.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    /// HTTP status.
    pub status: StatusCode,
    /// What went wrong, for a person.
    pub message: String,
    /// OpenAI's error type (`invalid_request_error`, `server_error`, ...).
    pub kind: &'static str,
    /// The request field at fault, if one is.
    pub param: Option<Cow<'static, str>>,
    /// A machine-readable code (`model_not_found`, ...), if any.
    pub code: Option<&'static str>,
}

impl ApiError {
    /// 400 `invalid_request_error` about `param`.
    pub fn invalid(message: impl Into<String>, param: Option<&'static str>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: param.map(Cow::Borrowed),
            code: None,
        }
    }

    /// 400 `invalid_request_error`, code `unsupported_field`, about the
    /// request field `field` (a name the client sent).
    pub fn invalid_field(message: impl Into<String>, field: &str) -> Self {
        let mut e = Self::invalid(message, None).with_code("unsupported_field");
        e.param = Some(Cow::Owned(field.to_string()));
        e
    }

    /// The same error with a machine-readable code.
    pub fn with_code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }

    /// 404 for a model this server does not serve.
    pub fn model_not_found(name: &str, served: &str) -> Self {
        Self {
            status: StatusCode::NOT_FOUND,
            message: format!("The model `{name}` does not exist; this server serves `{served}`"),
            kind: "invalid_request_error",
            param: Some(Cow::Borrowed("model")),
            code: Some("model_not_found"),
        }
    }

    /// 500: the engine failed.
    pub fn internal(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message: message.into(),
            kind: "server_error",
            param: None,
            code: None,
        }
    }

    /// 503: the server cannot take the request now (shutting down, KV pool
    /// full).
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::SERVICE_UNAVAILABLE,
            message: message.into(),
            kind: "server_error",
            param: None,
            code: Some("overloaded"),
        }
    }

    /// Maps a failure reported by the scheduler: a full KV pool is 503,
    /// anything else the engine reports is 500.
    pub fn from_engine(message: String) -> Self {
        if message.contains("KV pool exhausted") {
            Self::unavailable(message)
        } else {
            Self::internal(message)
        }
    }

    /// Maps an axum JSON extractor rejection (the status axum chose, except
    /// that a body that does not fit the schema is 400 as in OpenAI's API).
    pub fn from_json_rejection(r: JsonRejection) -> Self {
        if body_timed_out(&r) {
            return Self {
                status: StatusCode::REQUEST_TIMEOUT,
                message: "the request body paused longer than the server waits \
                          (--header-timeout-ms); send it whole"
                    .into(),
                kind: "invalid_request_error",
                param: None,
                code: Some("request_timeout"),
            };
        }
        let (status, code) = match &r {
            JsonRejection::JsonDataError(_) => (StatusCode::BAD_REQUEST, "invalid_request_body"),
            JsonRejection::JsonSyntaxError(_) => (StatusCode::BAD_REQUEST, "invalid_json"),
            JsonRejection::MissingJsonContentType(_) => (
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "unsupported_content_type",
            ),
            _ if r.status() == StatusCode::PAYLOAD_TOO_LARGE => {
                (StatusCode::PAYLOAD_TOO_LARGE, "request_too_large")
            }
            _ => (r.status(), "invalid_request_body"),
        };
        let message = match &r {
            JsonRejection::MissingJsonContentType(_) => {
                "Expected request with `Content-Type: application/json`".to_string()
            }
            _ if status == StatusCode::PAYLOAD_TOO_LARGE => {
                format!("{}: the request body is over the size limit", r.body_text())
            }
            _ => r.body_text(),
        };
        Self {
            status,
            message,
            kind: "invalid_request_error",
            param: None,
            code: Some(code),
        }
    }

    /// The JSON body.
    pub fn body(&self) -> serde_json::Value {
        json!({
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        })
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}", self.status.as_u16(), self.message)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, Json(self.body())).into_response()
    }
}

/// A JSON body whose rejections are OpenAI-style errors.
#[derive(Debug)]
pub struct ApiJson<T>(pub T);

impl<T, S> FromRequest<S> for ApiJson<T>
where
    T: DeserializeOwned,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        match Json::<T>::from_request(req, state).await {
            Ok(Json(v)) => Ok(ApiJson(v)),
            Err(r) => Err(ApiError::from_json_rejection(r)),
        }
    }
}

/// Fallback for unknown routes: 404 in the same shape.
pub async fn not_found(req: Request) -> ApiError {
    ApiError {
        status: StatusCode::NOT_FOUND,
        message: format!("No route {} {}", req.method(), req.uri().path()),
        kind: "invalid_request_error",
        param: None,
        code: Some("unknown_url"),
    }
}

/// Fallback for a known route asked with the wrong method: 405.
pub async fn method_not_allowed(req: Request) -> ApiError {
    ApiError {
        status: StatusCode::METHOD_NOT_ALLOWED,
        message: format!(
            "Method {} is not allowed on {}",
            req.method(),
            req.uri().path()
        ),
        kind: "invalid_request_error",
        param: None,
        code: Some("method_not_allowed"),
    }
}

/// True when reading the body failed because tower-http's body timeout
/// ([`crate::conn_limits::ConnLimits::header_timeout`]) fired.
fn body_timed_out(r: &JsonRejection) -> bool {
    let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(r);
    while let Some(e) = cause {
        if e.is::<tower_http::timeout::TimeoutError>() {
            return true;
        }
        cause = e.source();
    }
    false
}
