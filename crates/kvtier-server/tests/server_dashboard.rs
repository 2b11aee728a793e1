//! The Grafana dashboard in docs/grafana/kvtier.json queries only series
//! the server exports: every `kvtier_*` name in every panel's expression is
//! in `/metrics` of a server that has answered a request.

// Test helpers may unwrap: a failure there is a test failure.
#![allow(clippy::unwrap_used)]

mod server_support;

use std::collections::BTreeSet;

use serde_json::{Value, json};
use server_support::Server;

/// Every `kvtier_...` identifier in `expr`.
fn series_names(expr: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = expr;
    while let Some(at) = rest.find("kvtier_") {
        let tail = &rest[at..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(tail.len());
        out.push(tail[..end].to_string());
        rest = &tail[end..];
    }
    out
}

#[test]
fn every_series_the_dashboard_queries_is_exported() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../docs/grafana/kvtier.json"
    );
    let dash: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let mut names = BTreeSet::new();
    for panel in dash["panels"].as_array().unwrap() {
        let targets = panel["targets"].as_array().unwrap();
        assert!(!targets.is_empty(), "panel {} has no query", panel["title"]);
        for t in targets {
            names.extend(series_names(t["expr"].as_str().unwrap()));
        }
    }
    assert!(names.len() >= 15, "{names:?}");

    let s = Server::start(|_| ());
    let r = s.post(
        "/v1/completions",
        &json!({"model": "tiny", "prompt": "measure me", "max_tokens": 3, "temperature": 0}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let text = s.get("/metrics").text();
    let exported: BTreeSet<&str> = text
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.split(['{', ' ']).next())
        .collect();
    let missing: Vec<&String> = names
        .iter()
        .filter(|n| !exported.contains(n.as_str()))
        .collect();
    assert!(
        missing.is_empty(),
        "the dashboard queries {missing:?}, not in\n{text}"
    );
}
