//! Bad input over real HTTP: each case gets a 4xx with an OpenAI-style JSON
//! error body, and the server keeps serving afterwards.

mod server_support;

use serde_json::json;
use server_support::{Server, long_prompt, request};

const COMPLETIONS: &str = "/v1/completions";
const CHAT: &str = "/v1/chat/completions";

#[test]
fn malformed_json_is_400() {
    let s = Server::start(|_| ());
    for body in [
        &b"{\"model\": \"tiny\", \"prompt\": "[..],
        b"not json at all",
        b"",
    ] {
        let r = request(
            &s.addr,
            "POST",
            COMPLETIONS,
            &[("Content-Type", "application/json")],
            body,
        );
        r.assert_error(400, None);
        assert_eq!(r.json()["error"]["code"], "invalid_json", "{}", r.text());
        s.assert_serves();
    }
    let r = request(
        &s.addr,
        "POST",
        CHAT,
        &[("Content-Type", "application/json")],
        b"[1, 2",
    );
    r.assert_error(400, None);
    s.assert_serves();
}

#[test]
fn wrong_content_type_is_415() {
    let s = Server::start(|_| ());
    let body = json!({"model": "tiny", "prompt": "hi"}).to_string();
    for headers in [&[("Content-Type", "text/plain")][..], &[]] {
        let r = request(&s.addr, "POST", COMPLETIONS, headers, body.as_bytes());
        r.assert_error(415, None);
        s.assert_serves();
    }
}

#[test]
fn unknown_model_is_404() {
    let s = Server::start(|_| ());
    let r = s.post(
        COMPLETIONS,
        &json!({"model": "gpt-9", "prompt": "hi", "max_tokens": 2}),
    );
    r.assert_error(404, Some("model"));
    assert_eq!(r.json()["error"]["code"], "model_not_found");
    s.assert_serves();
    let r = s.post(
        CHAT,
        &json!({"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]}),
    );
    r.assert_error(404, Some("model"));
    s.get("/v1/models/gpt-9").assert_error(404, Some("model"));
    s.assert_serves();
}

#[test]
fn empty_prompt_is_400() {
    let s = Server::start(|_| ());
    for prompt in [json!(""), json!([]), json!([""]), json!(null)] {
        let r = s.post(COMPLETIONS, &json!({"model": "tiny", "prompt": prompt}));
        r.assert_error(400, Some("prompt"));
        s.assert_serves();
    }
    let r = s.post(COMPLETIONS, &json!({"model": "tiny"}));
    r.assert_error(400, Some("prompt"));
    for messages in [json!([]), json!(null)] {
        let r = s.post(CHAT, &json!({"model": "tiny", "messages": messages}));
        r.assert_error(400, Some("messages"));
        s.assert_serves();
    }
}

#[test]
fn prompt_over_the_limit_is_400() {
    // The context is 512 tokens (see base_options); the limit here is 64.
    let s = Server::start(|o| o.max_prompt_tokens = Some(64));
    let r = s.post(
        COMPLETIONS,
        &json!({"model": "tiny", "prompt": long_prompt(65), "max_tokens": 1}),
    );
    r.assert_error(400, Some("prompt"));
    assert_eq!(r.json()["error"]["code"], "context_length_exceeded");
    s.assert_serves();
    let r = s.post(
        CHAT,
        &json!({"model": "tiny", "messages": [{"role": "user", "content": long_prompt(100)}]}),
    );
    r.assert_error(400, Some("messages"));
    s.assert_serves();
    // Exactly at the limit is fine.
    let r = s.post(
        COMPLETIONS,
        &json!({"model": "tiny", "prompt": long_prompt(64), "max_tokens": 1}),
    );
    assert_eq!(r.status, 200, "{}", r.text());

    // Without the flag the limit is the context.
    let s = Server::start(|_| ());
    let r = s.post(
        COMPLETIONS,
        &json!({"model": "tiny", "prompt": long_prompt(600), "max_tokens": 1}),
    );
    r.assert_error(400, Some("prompt"));
    s.assert_serves();
}

#[test]
fn max_tokens_out_of_range_is_400() {
    let s = Server::start(|_| ());
    for max_tokens in [json!(0), json!(-1), json!(513), json!(1_000_000_000_000i64)] {
        let r = s.post(
            COMPLETIONS,
            &json!({"model": "tiny", "prompt": "hi", "max_tokens": max_tokens}),
        );
        r.assert_error(400, Some("max_tokens"));
        s.assert_serves();
    }
    // Fits the context alone, not after the prompt.
    let r = s.post(
        COMPLETIONS,
        &json!({"model": "tiny", "prompt": long_prompt(100), "max_tokens": 500}),
    );
    r.assert_error(400, Some("max_tokens"));
    let r = s.post(
        CHAT,
        &json!({"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                "max_completion_tokens": 0}),
    );
    r.assert_error(400, Some("max_tokens"));
    // A float is not a token count.
    let r = s.post(
        COMPLETIONS,
        &json!({"model": "tiny", "prompt": "hi", "max_tokens": 2.5}),
    );
    r.assert_error(400, None);
    s.assert_serves();
}

#[test]
fn temperature_and_top_p_out_of_range_are_400() {
    let s = Server::start(|_| ());
    for (field, value) in [
        ("temperature", json!(-0.1)),
        ("temperature", json!(2.5)),
        ("top_p", json!(-0.5)),
        ("top_p", json!(1.5)),
    ] {
        let mut body = json!({"model": "tiny", "prompt": "hi", "max_tokens": 2});
        body[field] = value;
        let r = s.post(COMPLETIONS, &body);
        r.assert_error(400, Some(field));
        s.assert_serves();
        let mut body = json!({"model": "tiny", "messages": [{"role": "user", "content": "hi"}]});
        body[field] = json!(9);
        s.post(CHAT, &body).assert_error(400, Some(field));
    }
    s.assert_serves();
}

#[test]
fn body_over_the_size_limit_is_413() {
    let s = Server::start(|o| o.max_body_bytes = 64 << 10);
    let body = json!({"model": "tiny", "prompt": "x".repeat(100 << 10), "max_tokens": 1});
    let r = s.post(COMPLETIONS, &body);
    r.assert_error(413, None);
    s.assert_serves();
    let r = s.post(
        CHAT,
        &json!({"model": "tiny", "messages": [{"role": "user", "content": "y".repeat(200 << 10)}]}),
    );
    r.assert_error(413, None);
    s.assert_serves();
}

#[test]
fn wrong_field_types_are_400() {
    let s = Server::start(|_| ());
    for body in [
        json!({"model": "tiny", "prompt": 5}),
        json!({"model": "tiny", "prompt": ["a", "b"]}),
        json!({"model": "tiny", "prompt": [1, 99999]}),
        json!({"model": "tiny", "prompt": "hi", "stop": 3}),
        json!({"model": "tiny", "prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}),
        json!({"model": "tiny", "prompt": "hi", "n": 2}),
        json!({"model": "tiny", "prompt": "hi", "temperature": "hot"}),
        json!({"model": 7, "prompt": "hi"}),
    ] {
        let r = s.post(COMPLETIONS, &body);
        r.assert_error(400, None);
        s.assert_serves();
    }
    for messages in [
        json!([{"role": "user", "content": 5}]),
        json!([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]),
        json!([{"content": "no role"}]),
        json!("not a list"),
    ] {
        let r = s.post(CHAT, &json!({"model": "tiny", "messages": messages}));
        r.assert_error(400, None);
        s.assert_serves();
    }
}

#[test]
fn unknown_routes_and_methods_are_json_errors() {
    let s = Server::start(|_| ());
    s.get("/v1/nothing").assert_error(404, None);
    request(&s.addr, "POST", "/v1/models", &[], b"").assert_error(405, None);
    request(&s.addr, "GET", COMPLETIONS, &[], b"").assert_error(405, None);
    s.assert_serves();
}

#[test]
fn fields_the_server_does_not_implement_are_400_naming_them() {
    let s = Server::start(|_| ());
    for (path, extra, field) in [
        (COMPLETIONS, json!({"best_of": 3}), "best_of"),
        (COMPLETIONS, json!({"suffix": "x"}), "suffix"),
        (COMPLETIONS, json!({"frobnicate": 1}), "frobnicate"),
        (CHAT, json!({"tools": [{"type": "function"}]}), "tools"),
        (
            CHAT,
            json!({"response_format": {"type": "json_object"}}),
            "response_format",
        ),
        (
            CHAT,
            json!({"continue_final_message": true}),
            "continue_final_message",
        ),
    ] {
        let mut body = if path == CHAT {
            json!({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
        } else {
            json!({"model": "tiny", "prompt": "hi", "max_tokens": 1})
        };
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        let r = s.post(path, &body);
        r.assert_error(400, Some(field));
        assert_eq!(
            r.json()["error"]["code"],
            "unsupported_field",
            "{}",
            r.text()
        );
    }
    // The same fields at the values that ask for nothing are served, as
    // clients often send OpenAI's defaults explicitly.
    let r = s.post(
        COMPLETIONS,
        &json!({"model": "tiny", "prompt": "hi", "max_tokens": 1, "logprobs": null,
                "echo": false, "presence_penalty": 0, "frequency_penalty": 0.0,
                "logit_bias": {}, "user": "someone", "top_k": -1, "best_of": 1,
                "suffix": ""}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let r = s.post(
        CHAT,
        &json!({"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 1, "tools": [], "tool_choice": "none", "logprobs": false,
                "response_format": {"type": "text"}}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
}

#[test]
fn sampling_and_logprobs_fields_out_of_range_are_400_naming_them() {
    let s = Server::start(|_| ());
    for (path, extra, field) in [
        (COMPLETIONS, json!({"logprobs": 21}), "logprobs"),
        (COMPLETIONS, json!({"logprobs": "x"}), "logprobs"),
        (COMPLETIONS, json!({"top_logprobs": 2}), "top_logprobs"),
        (COMPLETIONS, json!({"echo": true, "logprobs": 1}), "echo"),
        (
            COMPLETIONS,
            json!({"presence_penalty": 2.5}),
            "presence_penalty",
        ),
        (
            COMPLETIONS,
            json!({"frequency_penalty": -3}),
            "frequency_penalty",
        ),
        (
            COMPLETIONS,
            json!({"repetition_penalty": 0}),
            "repetition_penalty",
        ),
        (COMPLETIONS, json!({"min_p": 1.5}), "min_p"),
        (COMPLETIONS, json!({"top_k": -2}), "top_k"),
        (
            COMPLETIONS,
            json!({"logit_bias": {"99999": 1}}),
            "logit_bias",
        ),
        (COMPLETIONS, json!({"logit_bias": {"5": 101}}), "logit_bias"),
        (COMPLETIONS, json!({"logit_bias": {"x": 1}}), "logit_bias"),
        (CHAT, json!({"top_logprobs": 3}), "top_logprobs"),
        (
            CHAT,
            json!({"logprobs": true, "top_logprobs": 50}),
            "top_logprobs",
        ),
        (CHAT, json!({"logprobs": 3}), "logprobs"),
        (CHAT, json!({"echo": true}), "echo"),
    ] {
        let mut body = if path == CHAT {
            json!({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
        } else {
            json!({"model": "tiny", "prompt": "hi", "max_tokens": 1})
        };
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        s.post(path, &body).assert_error(400, Some(field));
    }
}
