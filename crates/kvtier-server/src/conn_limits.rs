//! Bounded connections: the HTTP accept loop with a cap on open
//! connections and a time limit on request headers (which is also the
//! limit on an idle keep-alive connection), and a cap on requests in
//! flight.
//!
//! `axum::serve` has none of these: idle connections stayed open forever,
//! and under a 1,024-descriptor limit 1,100 idle sockets starved `/health`.
//! Here each connection holds a permit of [`ConnLimits::max_connections`];
//! one past the cap gets a `503` in OpenAI's error shape and is closed at
//! once, so the descriptors of served clients stay free. A connection that
//! sends no complete request head within [`ConnLimits::header_timeout`]
//! (a new one, or one idle between keep-alive requests) is closed by
//! hyper; a body that pauses longer than that gets a `408`
//! ([`crate::routes`] puts tower-http's body timeout in front of the
//! handlers). Requests to the generating endpoints past
//! [`ConnLimits::max_in_flight`] get a `503` from [`limit_in_flight`];
//! `/health`, `/metrics` and `/v1/models` are never refused by it. Shutdown stops accepting and waits for the
//! connections in flight (streams included), as before.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::header;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use prometheus_client::metrics::gauge::Gauge;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio_stream::StreamExt;

use crate::api_error::ApiError;

/// The bounds of one server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnLimits {
    /// Connections open at once; past it a new one gets 503 and is closed.
    pub max_connections: usize,
    /// Longest wait for a request's headers, and so for the next request on
    /// an idle keep-alive connection; also the longest pause between two
    /// pieces of a request body (408 past it).
    pub header_timeout: Duration,
    /// Requests handled at once; past it a request gets 503.
    pub max_in_flight: usize,
}

impl Default for ConnLimits {
    /// 512 connections (half of the usual 1,024-descriptor limit: the rest
    /// is for the store's files and the engine), 10 s for headers, 256
    /// requests in flight.
    fn default() -> Self {
        Self {
            max_connections: 512,
            header_timeout: Duration::from_secs(10),
            max_in_flight: 256,
        }
    }
}

/// Serves `router` on `listener` within `limits` until `shutdown`
/// resolves, then waits for the open connections to finish.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    limits: ConnLimits,
    shutdown: impl Future<Output = ()> + Send + 'static,
) {
    let graceful = GracefulShutdown::new();
    let open = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    tokio::pin!(shutdown);
    loop {
        let stream = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    // Out of descriptors (EMFILE) or a connection reset
                    // before accept: wait a little rather than spin.
                    tracing::warn!("accepting a connection failed: {e}");
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let Ok(permit) = open.clone().try_acquire_owned() else {
            tokio::spawn(refuse(stream));
            continue;
        };
        let mut http = hyper::server::conn::http1::Builder::new();
        http.timer(TokioTimer::new())
            .header_read_timeout(limits.header_timeout)
            .keep_alive(true);
        let conn = http.serve_connection(
            TokioIo::new(stream),
            TowerToHyperService::new(router.clone()),
        );
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!("connection ended: {e}");
            }
            drop(permit);
        });
    }
    drop(listener);
    graceful.shutdown().await;
}

/// Answers a connection past the cap with 503 and closes it.
async fn refuse(mut stream: TcpStream) {
    let body = ApiError::unavailable("too many open connections; retry later")
        .body()
        .to_string();
    let head = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n\
         content-length: {}\r\nretry-after: 1\r\nconnection: close\r\n\r\n",
        body.len()
    );
    let answer = async {
        stream.write_all(head.as_bytes()).await?;
        stream.write_all(body.as_bytes()).await?;
        stream.shutdown().await?;
        // Read what the client sent (up to 64 KiB) before closing: a close
        // with unread bytes is a reset, which can throw away the 503 before
        // the client reads it.
        let mut sink = [0u8; 4096];
        let mut left = 64usize << 10;
        while left > 0 {
            match stream.read(&mut sink).await? {
                0 => break,
                n => left = left.saturating_sub(n),
            }
        }
        Ok::<_, std::io::Error>(())
    };
    let _ = tokio::time::timeout(Duration::from_secs(1), answer).await;
}

/// Requests in flight and their cap, for [`limit_in_flight`]; the count is
/// the `kvtier_server_http_in_flight` gauge.
#[derive(Debug)]
pub struct InFlight {
    now: Gauge,
    max: i64,
}

impl InFlight {
    /// A counter on `gauge` capped at `max` requests.
    pub fn new(max: usize, gauge: Gauge) -> Self {
        Self {
            now: gauge,
            max: i64::try_from(max.max(1)).unwrap_or(i64::MAX),
        }
    }
}

/// One request's place in [`InFlight`], given back when dropped.
struct Slot(Arc<InFlight>);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.now.dec();
    }
}

/// The middleware: 503 past the cap, else counts the request until its
/// response is done (a server-sent-events stream until its last event).
pub async fn limit_in_flight(State(c): State<Arc<InFlight>>, req: Request, next: Next) -> Response {
    // `inc` returns the count before this request.
    if c.now.inc() >= c.max {
        c.now.dec();
        return ApiError::unavailable(format!(
            "{} requests are in flight, the most this server takes; retry later",
            c.max
        ))
        .into_response();
    }
    let slot = Slot(c.clone());
    let resp = next.run(req).await;
    let streamed = resp
        .headers()
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"text/event-stream"));
    if !streamed {
        return resp;
    }
    // The stream holds the slot (other bodies keep their length header).
    let (parts, body) = resp.into_parts();
    let events = body.into_data_stream().map(move |chunk| {
        let _held = &slot;
        chunk
    });
    Response::from_parts(parts, Body::from_stream(events))
}
