//! API keys and tenants: without a valid bearer key every endpoint but
//! `/health` is a 401 in OpenAI's shape; tenants never share cached
//! prefixes, keys of one tenant do, and `cache_salt` separates requests
//! within a tenant.

// Test helpers may unwrap: a failure there is a test failure.
#![allow(clippy::unwrap_used)]

mod server_support;

use serde_json::{Value, json};
use server_support::{Server, long_prompt, request};

fn call(
    s: &Server,
    method: &str,
    path: &str,
    key: Option<&str>,
    body: &Value,
) -> server_support::Resp {
    let auth = key.map(|k| format!("Bearer {k}"));
    let mut headers = vec![("Content-Type", "application/json")];
    if let Some(a) = &auth {
        headers.push(("Authorization", a.as_str()));
    }
    let body = if method == "GET" {
        String::new()
    } else {
        body.to_string()
    };
    request(&s.addr, method, path, &headers, body.as_bytes())
}

/// Prompt tokens served from cache for `prompt` asked with `key`.
fn cached(s: &Server, key: &str, prompt: &str, cache_salt: Option<&str>) -> u64 {
    let mut body = json!({"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0});
    if let Some(c) = cache_salt {
        body["cache_salt"] = json!(c);
    }
    let r = call(s, "POST", "/v1/completions", Some(key), &body);
    assert_eq!(r.status, 200, "{}", r.text());
    r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap()
}

#[test]
fn requests_without_a_valid_key_are_401_but_health() {
    let s = Server::start(|o| o.api_keys = vec!["k-a".into()]);
    let body = json!({"model": "tiny", "prompt": "hi", "max_tokens": 1});
    for (method, path) in [
        ("POST", "/v1/completions"),
        ("POST", "/v1/chat/completions"),
        ("GET", "/v1/models"),
        ("GET", "/metrics"),
    ] {
        for key in [None, Some("wrong")] {
            let r = call(&s, method, path, key, &body);
            assert_eq!(r.status, 401, "{method} {path} {key:?}: {}", r.text());
            let e = &r.json()["error"];
            assert_eq!(e["code"], "invalid_api_key", "{e}");
            assert_eq!(e["type"], "invalid_request_error", "{e}");
            assert_eq!(r.header("www-authenticate"), Some("Bearer"));
        }
    }
    assert_eq!(call(&s, "GET", "/health", None, &body).status, 200);
    assert_eq!(
        call(&s, "GET", "/v1/models", Some("k-a"), &body).status,
        200
    );
}

#[test]
fn tenants_never_share_prefixes_keys_of_one_tenant_do_and_cache_salt_separates() {
    let tmp = tempfile::tempdir().unwrap();
    let keys = tmp.path().join("keys");
    std::fs::write(
        &keys,
        "# team a has two keys\na-1 team-a\na-2 team-a\nb-1 team-b\n",
    )
    .unwrap();
    let s = Server::start(|o| o.api_keys_file = Some(keys.clone()));
    let p = long_prompt(300);
    assert_eq!(cached(&s, "a-1", &p, None), 0, "first sight");
    assert!(cached(&s, "a-1", &p, None) > 0, "the same key hits");
    assert!(
        cached(&s, "a-2", &p, None) > 0,
        "a key of the same tenant hits"
    );
    assert_eq!(cached(&s, "b-1", &p, None), 0, "another tenant never hits");
    assert_eq!(
        cached(&s, "a-1", &p, Some("s1")),
        0,
        "another cache_salt never hits"
    );
    assert!(
        cached(&s, "a-2", &p, Some("s1")) > 0,
        "the same cache_salt in the tenant hits"
    );
    assert_eq!(
        cached(&s, "b-1", &p, Some("s1")),
        0,
        "but not across tenants"
    );
}

#[test]
fn a_bad_keys_file_stops_the_server_before_it_starts() {
    let tmp = tempfile::tempdir().unwrap();
    let keys = tmp.path().join("keys");
    std::fs::write(&keys, "k1 team extra\n").unwrap();
    let model = tmp.path().join("no-model");
    let mut o = server_support::base_options(&model, &tmp.path().join("cache"));
    o.api_keys_file = Some(keys);
    let e = kvtier_server::start(o).map(|_| ()).unwrap_err();
    let msg = server_support::error_chain(&e);
    assert!(msg.contains("KEY TENANT") && msg.contains(":1:"), "{msg}");
}
