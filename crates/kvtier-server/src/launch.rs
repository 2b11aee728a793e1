//! Starting and stopping a server: check the model directory (config,
//! tokenizer), bind the port (fail fast when taken), load the weights and
//! open the store on a blocking thread, start the scheduler, serve. On
//! shutdown: stop accepting, finish the requests in flight, stop the
//! scheduler, and drop the engine, which hands its pending KV blocks to the
//! store and writes the store's dirty blocks to G3.
//!
//! [`start`] does all of it in the background and hands back a
//! [`RunningServer`] (its address, a shutdown trigger); [`run`], what
//! `kvtier serve` calls, is `start`, the `listening on http://ADDR` line,
//! then a wait for SIGINT/SIGTERM.

use std::fmt;
use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Router;
use kvtier_engine::serving::scheduler::{BatchConfig, Scheduler};
use kvtier_engine::text::chat_template::ChatTemplate;
use kvtier_engine::text::tokenizer::TextTokenizer;
use kvtier_engine::{Engine, EngineOptions, ModelConfig, StoreOptions, open_device};
use kvtier_store::Recovery;
use tokio::net::TcpListener;
use tokio::runtime::Runtime;
use tokio::sync::Notify;
use tokio::task::JoinHandle;

use crate::app_state::{AppState, Limits};
use crate::auth::ApiKeys;
use crate::conn_limits::{self, ConnLimits};
use crate::routes;
use crate::serve_error::ServeError;
use crate::serve_options::{ServeOptions, default_pool_pages};
use crate::server_metrics::{KvCacheInfo, ServerMetrics};

/// How long the runtime waits for its last tasks once the server stopped.
const RUNTIME_SHUTDOWN: Duration = Duration::from_secs(10);

/// What a started server loaded and how it is set up; `Display` is the
/// line `kvtier serve` prints once the model is loaded.
#[derive(Debug, Clone, PartialEq)]
pub struct ServerSummary {
    /// The name clients pass as `model`.
    pub model_name: String,
    /// Seconds the weights and the store took to load.
    pub load_seconds: f64,
    /// Longest sequence served, in tokens.
    pub context_tokens: usize,
    /// G1 pages.
    pub pool_pages: usize,
    /// Tokens per page (and per store block).
    pub block_tokens: usize,
    /// G2 bytes.
    pub g2_bytes: u64,
    /// G3 bytes (0 without a store).
    pub g3_bytes: u64,
    /// The G3 directory.
    pub cache_dir: PathBuf,
    /// The G4 pool's URL, password redacted, or `none`.
    pub g4: String,
    /// Whether cached KV is reused.
    pub prefix_reuse: bool,
    /// How G3's index came back at open (`None` without G3).
    pub g3_recovery: Option<Recovery>,
}

impl fmt::Display for ServerSummary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "loaded in {:.2} s: context {} tokens, {} G1 pages of {} tokens, G2 {} B, G3 {} B \
             under {}, G4 {}, prefix reuse {}",
            self.load_seconds,
            self.context_tokens,
            self.pool_pages,
            self.block_tokens,
            self.g2_bytes,
            self.g3_bytes,
            self.cache_dir.display(),
            self.g4,
            if self.prefix_reuse { "on" } else { "off" },
        )?;
        match &self.g3_recovery {
            Some(Recovery::Saved { blocks, replayed }) => write!(
                f,
                "; G3 index: {blocks} blocks from its checkpoint and {replayed} journal records"
            ),
            Some(Recovery::Scanned { why }) => {
                write!(f, "; G3 index: every slot scanned ({why})")
            }
            None => Ok(()),
        }
    }
}

/// Stops a [`RunningServer`] from any thread: it stops accepting, finishes
/// the requests in flight and flushes the cache.
#[derive(Debug, Clone)]
pub struct ShutdownTrigger(Arc<Notify>);

impl ShutdownTrigger {
    /// Asks the server to shut down (once is enough; more are harmless).
    pub fn trigger(&self) {
        self.0.notify_one();
    }
}

/// A server serving in the background (its own async runtime). Dropping it
/// shuts it down as [`RunningServer::shutdown`] does. Start, use and drop it
/// from synchronous code, not from inside an async runtime.
#[derive(Debug)]
pub struct RunningServer {
    addr: SocketAddr,
    summary: ServerSummary,
    stop: ShutdownTrigger,
    task: Option<JoinHandle<Result<(), ServeError>>>,
    runtime: Option<Runtime>,
}

impl RunningServer {
    /// The address bound (the real port when port 0 was asked for).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// What was loaded, and how the server is set up.
    pub fn summary(&self) -> &ServerSummary {
        &self.summary
    }

    /// A trigger that shuts the server down from anywhere.
    pub fn shutdown_trigger(&self) -> ShutdownTrigger {
        self.stop.clone()
    }

    /// Shuts down: stops accepting, finishes the requests in flight (streams
    /// included), stops the scheduler and writes the KV cache to G3.
    pub fn shutdown(mut self) -> Result<(), ServeError> {
        self.stop.trigger();
        self.wait()
    }

    /// Waits until the server has stopped (after a trigger).
    fn wait(&mut self) -> Result<(), ServeError> {
        match (self.task.take(), self.runtime.take()) {
            (Some(task), Some(rt)) => join(rt, task),
            _ => Ok(()),
        }
    }
}

/// Waits for the server task, then for the runtime's last tasks.
fn join(rt: Runtime, task: JoinHandle<Result<(), ServeError>>) -> Result<(), ServeError> {
    let res = rt.block_on(task);
    rt.shutdown_timeout(RUNTIME_SHUTDOWN);
    res.map_err(|source| ServeError::Thread {
        what: "the HTTP server task failed",
        source,
    })?
}

impl Drop for RunningServer {
    fn drop(&mut self) {
        self.stop.trigger();
        if let Err(e) = self.wait() {
            tracing::warn!("the server stopped with an error: {e}");
        }
    }
}

/// The multi-threaded runtime every server runs on.
fn runtime() -> Result<Runtime, ServeError> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("kvtier-http")
        .build()
        .map_err(|e| ServeError::io("cannot start the async runtime", e))
}

/// Starts serving `opts` in the background; returns once the port is bound,
/// the model loaded and the scheduler running. Status lines go to stderr.
pub fn start(opts: ServeOptions) -> Result<RunningServer, ServeError> {
    let rt = runtime()?;
    let ready = match rt.block_on(prepare(opts)) {
        Ok(r) => r,
        Err(e) => {
            rt.shutdown_timeout(RUNTIME_SHUTDOWN);
            return Err(e);
        }
    };
    let stop = ShutdownTrigger(Arc::new(Notify::new()));
    let notify = stop.0.clone();
    let Ready {
        listener,
        addr,
        router,
        limits,
        scheduler,
        summary,
    } = ready;
    let task = rt.spawn(serve_until(
        listener,
        router,
        limits,
        scheduler,
        async move {
            notify.notified().await;
        },
    ));
    Ok(RunningServer {
        addr,
        summary,
        stop,
        task: Some(task),
        runtime: Some(rt),
    })
}

/// Serves `opts` until SIGINT/SIGTERM: [`start`], then `listening on
/// http://ADDR` as the first line on stdout, then the wait; on the signal,
/// the requests in flight finish and the cache is flushed.
pub fn run(opts: ServeOptions) -> Result<(), ServeError> {
    let mut server = start(opts)?;
    let (Some(rt), Some(mut task)) = (server.runtime.take(), server.task.take()) else {
        return Ok(());
    };
    let signals = {
        let _guard = rt.enter();
        Signals::install()
    };
    let listening = {
        let mut out = std::io::stdout().lock();
        writeln!(out, "listening on http://{}", server.addr).and_then(|()| out.flush())
    };
    if let Err(e) = listening {
        server.stop.trigger();
        join(rt, task)?;
        return Err(ServeError::io("cannot write to stdout", e));
    }
    // A server that fails on its own ends the wait too.
    let ended = rt.block_on(async {
        tokio::select! {
            () = signals.recv() => None,
            res = &mut task => Some(res),
        }
    });
    match ended {
        None => {
            server.stop.trigger();
            join(rt, task)
        }
        Some(res) => {
            rt.shutdown_timeout(RUNTIME_SHUTDOWN);
            res.map_err(|source| ServeError::Thread {
                what: "the HTTP server task failed",
                source,
            })?
        }
    }
}

/// SIGINT and SIGTERM, listened for from the moment they are installed.
#[derive(Debug, Default)]
struct Signals {
    interrupt: Option<tokio::signal::unix::Signal>,
    terminate: Option<tokio::signal::unix::Signal>,
}

impl Signals {
    /// Listens for both (inside a runtime); one that cannot be listened for
    /// is logged and never fires.
    fn install() -> Self {
        use tokio::signal::unix::{SignalKind, signal};
        let listen = |kind: SignalKind, name: &str| match signal(kind) {
            Ok(s) => Some(s),
            Err(e) => {
                tracing::warn!("cannot listen for {name}: {e}");
                None
            }
        };
        Self {
            interrupt: listen(SignalKind::interrupt(), "Ctrl-C"),
            terminate: listen(SignalKind::terminate(), "SIGTERM"),
        }
    }

    /// Resolves on the first of them.
    async fn recv(mut self) {
        async fn one(s: Option<&mut tokio::signal::unix::Signal>) {
            match s {
                Some(s) => {
                    s.recv().await;
                }
                None => std::future::pending::<()>().await,
            }
        }
        tokio::select! {
            () = one(self.interrupt.as_mut()) => {},
            () = one(self.terminate.as_mut()) => {},
        }
    }
}

/// A server ready to serve: bound, loaded, scheduling.
struct Ready {
    listener: TcpListener,
    addr: SocketAddr,
    router: Router,
    limits: ConnLimits,
    scheduler: Arc<Scheduler>,
    summary: ServerSummary,
}

/// How the start-up line names G4 (no password).
fn engine_g4(store: bool, opts: &ServeOptions) -> String {
    match (&opts.remote, store) {
        (Some(remote), true) => kvtier_store::remote::redact_url(&remote.url),
        _ => "none".into(),
    }
}

/// The store below G1 that `opts` ask for (`None`: G1 only), creating the
/// cache directory when G3 is on.
fn store_options(opts: &ServeOptions) -> Result<Option<StoreOptions>, ServeError> {
    let remote = opts.remote.clone();
    if !opts.prefix_reuse || (opts.g2_bytes == 0 && opts.g3_bytes == 0 && remote.is_none()) {
        return Ok(None);
    }
    let mut disk_dirs = Vec::new();
    if opts.g3_bytes > 0 {
        std::fs::create_dir_all(&opts.cache_dir).map_err(|e| {
            ServeError::io(
                format!(
                    "cannot create the cache directory {}",
                    opts.cache_dir.display()
                ),
                e,
            )
        })?;
        disk_dirs.push(opts.cache_dir.clone());
    }
    Ok(Some(StoreOptions {
        memory_bytes: opts.g2_bytes,
        disk_dirs,
        disk_bytes: opts.g3_bytes,
        remote,
        g3_sync: Some(opts.g3_sync),
        codec: opts.kv_offload_codec,
        eviction: opts.eviction,
    }))
}

/// Everything up to serving (see the module docs for the order).
async fn prepare(opts: ServeOptions) -> Result<Ready, ServeError> {
    // Keys first: a bad keys file fails before the model is read.
    let api_keys = ApiKeys::load(&opts.api_keys, opts.api_keys_file.as_deref())?;
    let dir = opts.model.clone();
    if !dir.is_dir() {
        return Err(ServeError::Invalid(format!(
            "model directory {} does not exist",
            dir.display()
        )));
    }
    let cfg = ModelConfig::from_dir(&dir)?;
    let tokenizer = TextTokenizer::from_dir(&dir)?;
    let chat_template =
        ChatTemplate::load(&dir, opts.chat_template.as_deref(), tokenizer.config())?;
    if let Some(w) = chat_template.warning() {
        eprintln!("warning: {w}");
        tracing::warn!("{w}");
    }
    if tokenizer.vocab_size() > cfg.vocab_size {
        return Err(ServeError::Invalid(format!(
            "{} has {} tokens but {} says vocab_size is {}",
            dir.join("tokenizer.json").display(),
            tokenizer.vocab_size(),
            dir.join("config.json").display(),
            cfg.vocab_size
        )));
    }
    let model_name = match &opts.model_name {
        Some(n) => n.clone(),
        None => std::fs::canonicalize(&dir)
            .ok()
            .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
            .unwrap_or_else(|| "kvtier".to_string()),
    };
    let block_tokens = opts.block_tokens;
    let context = opts.max_seq_tokens.min(cfg.max_position_embeddings);
    if context < 2 {
        return Err(ServeError::Invalid(format!(
            "the context length ({context} tokens) is too short to serve"
        )));
    }
    let max_prompt_tokens = match opts.max_prompt_tokens {
        Some(n) if n >= context => {
            return Err(ServeError::Invalid(format!(
                "--max-prompt-tokens {n} must be below the context length ({context} tokens)"
            )));
        }
        Some(n) => n,
        None => context - 1,
    };
    let page_bytes = cfg.kv_layout(block_tokens).payload_bytes();
    let pool_pages = opts
        .pool_pages
        .unwrap_or_else(|| default_pool_pages(context, block_tokens, opts.max_batch, page_bytes));

    let addr = format!("{}:{}", opts.host, opts.port);
    let listener = TcpListener::bind(&addr)
        .await
        .map_err(|e| ServeError::io(format!("cannot listen on {addr}"), e))?;
    let bound = listener
        .local_addr()
        .map_err(|e| ServeError::io(format!("cannot read the address bound for {addr}"), e))?;

    let store = store_options(&opts)?;
    let engine_opts = EngineOptions {
        block_tokens,
        pool_pages,
        max_seq_tokens: context,
        prefix_reuse: opts.prefix_reuse,
        tenant_salt: opts.tenant_salt.clone().into_bytes(),
        device: open_device(&opts.device)?,
        layerwise_restore: opts.layerwise_restore,
        restore_yield: opts.restore_yield,
    };
    eprintln!(
        "loading {} ({} parameters, {} layers) from {}",
        model_name,
        cfg.parameter_count(),
        cfg.num_hidden_layers,
        dir.display()
    );
    let t0 = Instant::now();
    let load_dir = dir.clone();
    let engine = tokio::task::spawn_blocking(move || Engine::load(&load_dir, engine_opts, store))
        .await
        .map_err(|source| ServeError::Thread {
            what: "the model loading thread failed",
            source,
        })?
        .map_err(|e| {
            ServeError::engine(format!("cannot load the model in {}", dir.display()), e)
        })?;
    let store_metrics = engine.store().map(|s| s.metrics().clone());
    let stop_tokens = engine.config().eos_ids();
    let summary = ServerSummary {
        model_name: model_name.clone(),
        load_seconds: t0.elapsed().as_secs_f64(),
        context_tokens: context,
        pool_pages,
        block_tokens,
        g2_bytes: opts.g2_bytes,
        g3_bytes: if store_metrics.is_some() {
            opts.g3_bytes
        } else {
            0
        },
        cache_dir: opts.cache_dir.clone(),
        g4: engine_g4(store_metrics.is_some(), &opts),
        prefix_reuse: opts.prefix_reuse,
        g3_recovery: engine
            .store()
            .and_then(|s| s.disk())
            .map(|d| d.recovery().clone()),
    };
    eprintln!("{summary}");
    let cache_info = KvCacheInfo::of(&engine, opts.eviction, opts.g3_sync);
    let scheduler = Arc::new(
        Scheduler::start(
            engine,
            BatchConfig {
                max_batch: opts.max_batch,
                max_wait: opts.max_wait,
            },
        )
        .map_err(|e| ServeError::io("cannot start the scheduler thread", e))?,
    );
    let metrics = Arc::new(ServerMetrics::new(store_metrics));
    metrics.set_kv_cache_info(&cache_info);
    let state = Arc::new(
        AppState::new(
            model_name,
            Arc::new(tokenizer),
            Arc::new(chat_template),
            scheduler.clone(),
            Limits {
                context_tokens: context,
                max_prompt_tokens,
            },
            stop_tokens,
            metrics,
        )
        .with_api_keys(api_keys)
        .with_conn_limits(opts.conn_limits),
    );
    let max_body = usize::try_from(opts.max_body_bytes).unwrap_or(usize::MAX);
    let router = routes::router(state, max_body);
    Ok(Ready {
        listener,
        addr: bound,
        router,
        limits: opts.conn_limits,
        scheduler,
        summary,
    })
}

/// Serves until `shutdown` resolves, then stops accepting, waits for the
/// requests in flight (streams included), stops the scheduler and flushes
/// the engine's KV to the store.
async fn serve_until(
    listener: TcpListener,
    router: Router,
    limits: ConnLimits,
    scheduler: Arc<Scheduler>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError> {
    conn_limits::serve(listener, router, limits, shutdown).await;

    eprintln!("shutting down: requests finished, flushing the KV cache");
    let t0 = Instant::now();
    tokio::task::spawn_blocking(move || {
        match Arc::try_unwrap(scheduler) {
            Ok(s) => {
                if let Some(mut engine) = s.shutdown() {
                    if let Err(e) = engine.flush_offload() {
                        tracing::warn!("flushing KV blocks to the store failed: {e}");
                    }
                    drop(engine);
                }
            }
            // A handle still held elsewhere: its drop stops the scheduler
            // and drops the engine the same way.
            Err(s) => drop(s),
        }
    })
    .await
    .map_err(|source| ServeError::Thread {
        what: "the shutdown thread failed",
        source,
    })?;
    eprintln!("stopped in {:.2} s", t0.elapsed().as_secs_f64());
    Ok(())
}
