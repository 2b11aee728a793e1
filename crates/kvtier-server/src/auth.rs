//! API keys and tenants (`--api-key`, `--api-keys-file`).
//!
//! With keys configured, every endpoint but `/health` asks for
//! `Authorization: Bearer KEY`; a missing or unknown key is a 401 in
//! OpenAI's error shape (`invalid_api_key`). Each key belongs to a tenant:
//! the name after it in the keys file, else the key itself (every key its
//! own tenant). A request's block keys are salted by its tenant and by its
//! `cache_salt` field (as vLLM's), so no tenant finds another's prefixes,
//! in G1 or in any store tier ([`request_salt`]). Without keys the server
//! is open and every request is the one default tenant (as before); see
//! docs/guides/serve.md for the model and docs/guides/operations.md for the
//! timing side channel left.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use kvtier_engine::model_dir::model_files::read_bounded_text;

use crate::api_error::ApiError;
use crate::serve_error::ServeError;

/// Most bytes of a keys file read.
const KEYS_FILE_MAX_BYTES: u64 = 16 << 20;

/// The tenant a request runs as (an empty name: the default tenant).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Tenant(pub String);

/// The accepted keys and their tenants.
#[derive(Debug, Clone, Default)]
pub struct ApiKeys {
    tenants: HashMap<String, String>,
}

impl ApiKeys {
    /// `keys` (each its own tenant) and the lines of `file` (`KEY` or `KEY
    /// TENANT`; blank lines and `#` comments skipped); `None` when there are
    /// none (an open server).
    pub fn load(keys: &[String], file: Option<&Path>) -> Result<Option<Self>, ServeError> {
        let mut tenants = HashMap::new();
        for k in keys {
            let k = k.trim();
            if k.is_empty() {
                return Err(ServeError::Invalid("an --api-key is empty".into()));
            }
            tenants.insert(k.to_string(), k.to_string());
        }
        if let Some(path) = file {
            let text = read_bounded_text(path, KEYS_FILE_MAX_BYTES)
                .map_err(|e| ServeError::Invalid(format!("cannot read the API keys file: {e}")))?;
            for (n, line) in text.lines().enumerate() {
                let line = line.trim();
                if line.is_empty() || line.starts_with('#') {
                    continue;
                }
                let mut words = line.split_whitespace();
                let (Some(key), tenant, None) = (words.next(), words.next(), words.next()) else {
                    return Err(ServeError::Invalid(format!(
                        "{}:{}: expected `KEY` or `KEY TENANT`",
                        path.display(),
                        n + 1
                    )));
                };
                tenants.insert(key.to_string(), tenant.unwrap_or(key).to_string());
            }
        }
        Ok((!tenants.is_empty()).then_some(Self { tenants }))
    }

    /// The tenant of a bearer `key`, if it is one of ours.
    pub fn tenant(&self, key: &str) -> Option<&str> {
        self.tenants.get(key).map(String::as_str)
    }

    /// Keys accepted.
    pub fn len(&self) -> usize {
        self.tenants.len()
    }

    /// True when no key is accepted (never for a loaded set).
    pub fn is_empty(&self) -> bool {
        self.tenants.is_empty()
    }
}

/// The salt of a request's block keys: its tenant and its `cache_salt`,
/// each length-prefixed (so no two pairs give the same bytes); empty for
/// the default tenant without a `cache_salt` (the server's own keys).
pub fn request_salt(tenant: &Tenant, cache_salt: Option<&str>) -> Vec<u8> {
    let cache_salt = cache_salt.unwrap_or("");
    if tenant.0.is_empty() && cache_salt.is_empty() {
        return Vec::new();
    }
    let mut out = Vec::with_capacity(16 + tenant.0.len() + cache_salt.len());
    for field in [tenant.0.as_bytes(), cache_salt.as_bytes()] {
        out.extend_from_slice(&(field.len() as u64).to_le_bytes());
        out.extend_from_slice(field);
    }
    out
}

/// The middleware: checks the bearer key (but on `/health`) and puts the
/// request's [`Tenant`] in its extensions.
pub async fn require_key(
    State(keys): State<Option<Arc<ApiKeys>>>,
    mut req: Request,
    next: Next,
) -> Response {
    let tenant = match &keys {
        None => Tenant::default(),
        Some(_) if req.uri().path() == "/health" => Tenant::default(),
        Some(keys) => {
            let bearer = req
                .headers()
                .get(header::AUTHORIZATION)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.strip_prefix("Bearer "))
                .map(str::trim);
            match bearer.map(|k| keys.tenant(k)) {
                Some(Some(t)) => Tenant(t.to_string()),
                found => {
                    let message = if found.is_none() {
                        "Missing API key: send it as `Authorization: Bearer KEY`"
                    } else {
                        "Incorrect API key provided"
                    };
                    return unauthorized(message);
                }
            }
        }
    };
    req.extensions_mut().insert(tenant);
    next.run(req).await
}

fn unauthorized(message: &str) -> Response {
    let mut e = ApiError::invalid(message, None).with_code("invalid_api_key");
    e.status = StatusCode::UNAUTHORIZED;
    let mut resp = e.into_response();
    resp.headers_mut().insert(
        header::WWW_AUTHENTICATE,
        header::HeaderValue::from_static("Bearer"),
    );
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_and_files_give_tenants_and_bad_lines_are_errors() {
        let tmp = tempfile::tempdir().unwrap();
        let file = tmp.path().join("keys");
        std::fs::write(&file, "# ops\nk1 team-a\nk2 team-a\n\nk3\n").unwrap();
        let keys = ApiKeys::load(&["solo".into()], Some(&file))
            .unwrap()
            .unwrap();
        assert_eq!(keys.len(), 4);
        assert_eq!(keys.tenant("k1"), Some("team-a"));
        assert_eq!(keys.tenant("k2"), Some("team-a"));
        assert_eq!(keys.tenant("k3"), Some("k3"));
        assert_eq!(keys.tenant("solo"), Some("solo"));
        assert_eq!(keys.tenant("nope"), None);
        assert!(ApiKeys::load(&[], None).unwrap().is_none());
        std::fs::write(&file, "k1 a b\n").unwrap();
        let e = ApiKeys::load(&[], Some(&file)).unwrap_err().to_string();
        assert!(e.contains(":1:"), "{e}");
        assert!(ApiKeys::load(&[" ".into()], None).is_err());
    }

    #[test]
    fn salts_keep_tenants_and_cache_salts_apart() {
        let none = Tenant::default();
        let a = Tenant("a".into());
        assert!(request_salt(&none, None).is_empty());
        assert!(request_salt(&none, Some("")).is_empty());
        let all = [
            request_salt(&a, None),
            request_salt(&a, Some("x")),
            request_salt(&none, Some("x")),
            request_salt(&Tenant("ax".into()), None),
            request_salt(&Tenant("a".into()), Some("")),
        ];
        assert_eq!(all[0], all[4]);
        for i in 0..4 {
            for j in i + 1..4 {
                assert_ne!(all[i], all[j], "{i} {j}");
            }
        }
    }
}
