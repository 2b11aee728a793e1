//! The OpenAI-compatible HTTP server (axum on tokio) in front of the
//! engine's scheduler.
//!
//! * [`routes`]: the endpoints and the router.
//! * [`openai`]: request and response bodies.
//! * [`validate`]: request checks, 4xx for every bad field.
//! * [`generate`]: one generation from async code; [`text`]: incremental
//!   decoding and stop strings; [`sse`]: streaming.
//! * [`errors`]: OpenAI-style error bodies, also for extractor rejections.
//! * [`metrics`]: server series in the store's registry.
//! * [`state`]: what the handlers share.

pub mod errors;
pub mod generate;
pub mod metrics;
pub mod openai;
pub mod routes;
pub mod sse;
pub mod state;
pub mod text;
pub mod validate;

use std::future::Future;

use axum::Router;
use tokio::net::TcpListener;

/// Serves `router` on `listener` until `shutdown` resolves, then stops
/// accepting and waits for the requests in flight (streams included).
pub async fn serve(
    listener: TcpListener,
    router: Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, router)
        .with_graceful_shutdown(shutdown)
        .await
}

/// Resolves on SIGINT (Ctrl-C) or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        if let Err(e) = tokio::signal::ctrl_c().await {
            tracing::warn!("cannot listen for Ctrl-C: {e}");
            std::future::pending::<()>().await;
        }
    };
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(e) => {
                tracing::warn!("cannot listen for SIGTERM: {e}");
                std::future::pending::<()>().await;
            }
        }
    };
    tokio::select! {
        () = ctrl_c => {},
        () = term => {},
    }
}
