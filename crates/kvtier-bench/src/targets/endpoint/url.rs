//! The endpoint's base URL: checked and normalized.

use crate::bench_error::BenchError;

/// `base_url` without a trailing `/` or `/v1`, checked to be plain HTTP;
/// also whether its host is a loopback one.
pub(super) fn normalize_base(base_url: &str) -> Result<(String, bool), BenchError> {
    let bad = |why: &str| BenchError::Config(format!("endpoint URL {base_url:?}: {why}"));
    let url = base_url.trim();
    if url
        .get(..8)
        .is_some_and(|s| s.eq_ignore_ascii_case("https://"))
    {
        return Err(bad(
            "https is not supported (this build's client speaks plain HTTP); use http:// or a local TLS-terminating proxy",
        ));
    }
    let rest = match url.get(..7) {
        Some(scheme) if scheme.eq_ignore_ascii_case("http://") => &url[7..],
        _ => return Err(bad("must start with http://")),
    };
    let mut base = url.trim_end_matches('/').to_string();
    if base.ends_with("/v1") {
        base.truncate(base.len() - 3);
        base = base.trim_end_matches('/').to_string();
    }
    let authority = rest.split(['/', '?', '#']).next().unwrap_or_default();
    if authority.is_empty() {
        return Err(bad("no host"));
    }
    let host = match authority.rsplit_once('@') {
        Some((_, h)) => h,
        None => authority,
    };
    let host = if host.starts_with('[') {
        host.split(']').next().map_or(host, |h| &h[1..])
    } else {
        host.split(':').next().unwrap_or(host)
    };
    let loopback = host.eq_ignore_ascii_case("localhost")
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback());
    Ok((base, loopback))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base_urls_are_normalized_and_checked() {
        let ok = |u: &str| normalize_base(u).unwrap();
        assert_eq!(
            ok("http://127.0.0.1:8000"),
            ("http://127.0.0.1:8000".into(), true)
        );
        assert_eq!(
            ok("http://localhost:8000/v1/"),
            ("http://localhost:8000".into(), true)
        );
        assert_eq!(ok("http://[::1]:80/"), ("http://[::1]:80".into(), true));
        assert_eq!(
            ok("http://gpu-box:8000/v1"),
            ("http://gpu-box:8000".into(), false)
        );
        assert!(
            normalize_base("https://x")
                .unwrap_err()
                .to_string()
                .contains("https")
        );
        assert!(normalize_base("x:8000").is_err());
        assert!(normalize_base("http://").is_err());
    }
}
