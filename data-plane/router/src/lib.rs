//! Switchyard's data-plane router: a stateless HTTP server that routes OpenAI-compatible and
//! SageMaker-style requests to inference instances with the policy of `switchyard-policy`.
//!
//! Code map: `table` (the immutable routing snapshot and per-instance load cells),
//! `membership` (sync messages or a static file -> table), `sync_client` (the control-plane
//! stream, load reports), `proxy` (the request path), `errors` (API-shaped errors),
//! `metrics` (Prometheus).

pub mod errors;
pub mod membership;
pub mod metrics;
pub mod proxy;
pub mod sync_client;
pub mod table;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use arc_swap::ArcSwap;
use axum::Router as AxumRouter;
use axum::extract::{Path, Request, State};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::serve::ListenerExt;
use http::StatusCode;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::membership::{Membership, StaticConfig};
use crate::proxy::{Operation, ProxySettings, Shared};
use crate::table::{LoadRegistry, RoutingTable};

pub fn now_unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|elapsed| elapsed.as_millis() as u64)
        .unwrap_or(0)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum UpstreamProtocol {
    Http1,
    H2c,
}

/// Command-line configuration of `switchyard-router`.
#[derive(Debug, Clone, clap::Args)]
pub struct RouterConfig {
    /// Address the HTTP server listens on.
    #[arg(long, default_value = "127.0.0.1:8080")]
    pub listen: SocketAddr,
    /// Control-plane gRPC URLs, comma-separated; the router fails over between them.
    /// Default: $SWITCHYARD_CONTROL_PLANE (ignored with --config), then
    /// http://127.0.0.1:50051.
    #[arg(long, value_delimiter = ',', conflicts_with = "config")]
    pub control_plane: Vec<String>,
    /// Route from a static file instead of a control plane (JSON, or YAML by extension).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// PEM CA certificate to trust for an https:// control plane.
    #[arg(long)]
    pub tls_ca: Option<PathBuf>,
    /// File holding the bearer token the control plane asks routers for (its
    /// --router-token-file).
    #[arg(long)]
    pub control_plane_token_file: Option<PathBuf>,
    /// Name of this router in load reports. Default: random.
    #[arg(long)]
    pub router_id: Option<String>,
    /// How often in-flight counts are reported to the control plane (ms).
    #[arg(long, default_value_t = 100)]
    pub load_report_interval_ms: u64,
    /// Instances tried per request before answering 503 (connection failures only).
    #[arg(long, default_value_t = 3)]
    pub max_attempts: usize,
    /// Consecutive connection failures before this router stops sending to an instance.
    #[arg(long, default_value_t = 3)]
    pub eject_after_failures: u32,
    /// How long an ejected instance is left alone (seconds).
    #[arg(long, default_value_t = 5)]
    pub eject_seconds: u64,
    /// Connection timeout to instances (ms).
    #[arg(long, default_value_t = 2000)]
    pub connect_timeout_ms: u64,
    /// Protocol to instances that do not name one (an instance's own `protocol`, set at
    /// registration or in the static file, wins): pooled HTTP/1.1 keep-alive connections
    /// (what vLLM's server speaks), or h2c (HTTP/2 without TLS, prior knowledge: requests
    /// multiplexed on one connection per instance and serving thread) for engines that serve
    /// it. The control plane probes instances without a protocol over HTTP/1.1: register
    /// h2c-only engines with `--protocol h2c`.
    #[arg(long, value_enum, default_value_t = UpstreamProtocol::Http1)]
    pub upstream_protocol: UpstreamProtocol,
    /// Seconds to finish in-flight requests (streams included) after SIGTERM.
    #[arg(long, default_value_t = 30)]
    pub shutdown_grace_seconds: u64,
    /// Threads serving HTTP. Each runs its own single-threaded runtime and upstream
    /// connection pool, so a request never moves between threads (cross-thread wake-ups
    /// cost more than the routing decision). Default: one per CPU.
    #[arg(long, value_name = "N")]
    pub worker_threads: Option<usize>,
}

impl RouterConfig {
    /// A router following the given control planes, listening on `listen`.
    pub fn with_control_plane(listen: SocketAddr, urls: Vec<String>) -> Self {
        Self {
            listen,
            control_plane: urls,
            config: None,
            tls_ca: None,
            control_plane_token_file: None,
            router_id: None,
            load_report_interval_ms: 100,
            max_attempts: 3,
            eject_after_failures: 3,
            eject_seconds: 5,
            connect_timeout_ms: 2000,
            upstream_protocol: UpstreamProtocol::Http1,
            shutdown_grace_seconds: 30,
            worker_threads: Some(1),
        }
    }

    /// Checks the flags and reads the files they name.
    pub fn validate(&self) -> Result<Settings, String> {
        let source = match &self.config {
            Some(path) => Source::Static(membership::read_static_config(path)?),
            None => {
                let from_env = std::env::var("SWITCHYARD_CONTROL_PLANE")
                    .ok()
                    .filter(|value| !value.trim().is_empty());
                let (urls, origin) = if !self.control_plane.is_empty() {
                    (self.control_plane.clone(), "--control-plane")
                } else if let Some(value) = from_env {
                    (
                        value.split(',').map(|url| url.trim().to_owned()).collect(),
                        "$SWITCHYARD_CONTROL_PLANE",
                    )
                } else {
                    (vec!["http://127.0.0.1:50051".to_owned()], "--control-plane")
                };
                for url in &urls {
                    if !(url.starts_with("http://") || url.starts_with("https://")) {
                        return Err(format!(
                            "{origin}: {url:?} must start with http:// or https://"
                        ));
                    }
                    url.parse::<http::Uri>()
                        .map_err(|err| format!("{origin}: {url:?}: {err}"))?;
                }
                Source::ControlPlane(urls)
            }
        };
        if !(10..=10_000).contains(&self.load_report_interval_ms) {
            return Err(format!(
                "--load-report-interval-ms: {} is outside 10..=10000",
                self.load_report_interval_ms
            ));
        }
        if !(1..=10).contains(&self.max_attempts) {
            return Err(format!(
                "--max-attempts: {} is outside 1..=10",
                self.max_attempts
            ));
        }
        if let Some(threads) = self.worker_threads
            && !(1..=1024).contains(&threads)
        {
            return Err(format!("--worker-threads: {threads} is outside 1..=1024"));
        }
        if self.eject_after_failures == 0 {
            return Err("--eject-after-failures must be at least 1".into());
        }
        let tls_ca = match &self.tls_ca {
            Some(path) => Some(
                std::fs::read(path).map_err(|err| format!("--tls-ca {}: {err}", path.display()))?,
            ),
            None => None,
        };
        let control_plane_token = self
            .control_plane_token_file
            .as_deref()
            .map(|path| {
                switchyard_shared::process::read_token_file(path, "--control-plane-token-file")
            })
            .transpose()?;
        let router_id = self
            .router_id
            .clone()
            .unwrap_or_else(|| format!("router-{}-{:08x}", std::process::id(), fastrand::u32(..)));
        Ok(Settings {
            config: self.clone(),
            source,
            tls_ca,
            control_plane_token,
            router_id,
            worker_threads: self.worker_threads.unwrap_or_else(|| {
                std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get)
            }),
        })
    }
}

#[derive(Debug, Clone)]
pub enum Source {
    ControlPlane(Vec<String>),
    Static(StaticConfig),
}

/// A validated router configuration.
#[derive(Debug, Clone)]
pub struct Settings {
    pub config: RouterConfig,
    pub source: Source,
    pub tls_ca: Option<Vec<u8>>,
    pub control_plane_token: Option<String>,
    pub router_id: String,
    /// Serving threads (`--worker-threads`, resolved).
    pub worker_threads: usize,
}

/// A running router.
#[derive(Debug)]
pub struct RouterHandle {
    pub addr: SocketAddr,
    pub router_id: String,
    shared: Arc<Shared>,
    shutdown: CancellationToken,
    server: JoinHandle<()>,
    /// Set when a serving thread panicked (and stopped the router).
    failed: Arc<AtomicBool>,
}

/// A serving thread's connection pools (HTTP/1.1 and h2c; no connection is made before use).
fn upstream_clients(config: &RouterConfig) -> proxy::UpstreamClients {
    let connect_timeout = Duration::from_millis(config.connect_timeout_ms);
    proxy::UpstreamClients {
        http1: upstream_client(connect_timeout, UpstreamProtocol::Http1),
        h2c: upstream_client(connect_timeout, UpstreamProtocol::H2c),
        default_h2c: config.upstream_protocol == UpstreamProtocol::H2c,
    }
}

fn upstream_client(connect_timeout: Duration, protocol: UpstreamProtocol) -> proxy::HttpClient {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    connector.set_connect_timeout(Some(connect_timeout));
    connector.set_keepalive(Some(Duration::from_secs(30)));
    let mut builder = Client::builder(TokioExecutor::new());
    builder
        .timer(hyper_util::rt::TokioTimer::new())
        .pool_idle_timeout(Duration::from_secs(90))
        .pool_max_idle_per_host(1024);
    if protocol == UpstreamProtocol::H2c {
        builder
            .http2_only(true)
            .http2_keep_alive_interval(Duration::from_secs(10))
            .http2_keep_alive_while_idle(true);
    }
    builder.build(connector)
}

impl RouterHandle {
    /// Binds the listener and starts serving and syncing. Returns once the port accepts.
    pub async fn start(settings: Settings) -> Result<Self, StartError> {
        let config = &settings.config;
        let listen_error = |err| StartError::Listen(config.listen, err);
        let listener = std::net::TcpListener::bind(config.listen).map_err(listen_error)?;
        listener.set_nonblocking(true).map_err(listen_error)?;
        let addr = listener.local_addr().map_err(listen_error)?;
        let shutdown = CancellationToken::new();
        let registry = Arc::new(LoadRegistry::default());
        let table = Arc::new(ArcSwap::from_pointee(RoutingTable::default()));
        let connected = Arc::new(metrics::SyncMetrics::default());
        let shared = Arc::new(Shared {
            table: Arc::clone(&table),
            registry: Arc::clone(&registry),
            clients: upstream_clients(config),
            settings: ProxySettings {
                max_attempts: config.max_attempts,
                eject_after_failures: config.eject_after_failures,
                eject_for: Duration::from_secs(config.eject_seconds),
            },
            metrics: Arc::new(metrics::RouterMetrics::new(Arc::clone(&connected))),
        });
        let grace = Duration::from_secs(config.shutdown_grace_seconds);
        // Threads 1.. each serve the same listening socket on a runtime of their own; the
        // calling runtime serves it too (thread 0) and runs the control-plane stream. All
        // that can fail is prepared before anything starts.
        let mut prepared = Vec::with_capacity(settings.worker_threads.saturating_sub(1));
        for index in 1..settings.worker_threads {
            let thread_error = |err| StartError::Thread(index, err);
            let listener = listener.try_clone().map_err(thread_error)?;
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(thread_error)?;
            let worker = Arc::new(shared.with_clients(upstream_clients(config)));
            prepared.push((index, listener, runtime, worker));
        }
        let failed = Arc::new(AtomicBool::new(false));
        let mut others = Vec::with_capacity(prepared.len());
        for (index, listener, runtime, worker) in prepared {
            let stop = shutdown.clone();
            let failed = Arc::clone(&failed);
            let (done, finished) = tokio::sync::oneshot::channel::<()>();
            let spawned = std::thread::Builder::new()
                .name(format!("switchyard-http-{index}"))
                .spawn(move || {
                    let served = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        runtime.block_on(serve(listener, app(worker), stop.clone(), grace));
                    }));
                    // Whatever the grace period left running ends here, before `done`.
                    runtime.shutdown_timeout(Duration::from_secs(1));
                    if served.is_err() {
                        tracing::error!(
                            thread = index,
                            "serving thread panicked; stopping the router"
                        );
                        failed.store(true, std::sync::atomic::Ordering::SeqCst);
                        stop.cancel();
                    }
                    let _ = done.send(());
                });
            match spawned {
                Ok(_) => others.push(finished),
                Err(err) => {
                    // Threads already started see this and stop.
                    shutdown.cancel();
                    return Err(StartError::Thread(index, err));
                }
            }
        }
        let mut membership = Membership::new(Arc::clone(&registry), Arc::clone(&table));
        let sync_task = match &settings.source {
            Source::Static(file) => {
                membership.load_static(file.clone());
                tracing::info!(
                    endpoints = file.endpoints.len(),
                    instances = file.instances.len(),
                    "routing from a static config"
                );
                None
            }
            Source::ControlPlane(urls) => {
                let settings = sync_client::SyncSettings {
                    urls: urls.clone(),
                    router_id: settings.router_id.clone(),
                    report_interval: Duration::from_millis(config.load_report_interval_ms),
                    tls_ca: settings.tls_ca.clone(),
                    token: settings.control_plane_token.clone(),
                };
                let task = sync_client::spawn(
                    settings,
                    membership,
                    Arc::clone(&registry),
                    connected,
                    shutdown.clone(),
                );
                match task {
                    Ok(task) => Some(task),
                    Err(err) => {
                        shutdown.cancel();
                        return Err(StartError::SyncThread(err));
                    }
                }
            }
        };
        let stop = shutdown.clone();
        let app = app(Arc::clone(&shared));
        let server = tokio::spawn(async move {
            serve(listener, app, stop, grace).await;
            for finished in others {
                let _ = finished.await;
            }
            if let Some(task) = sync_task {
                task.abort();
            }
        });
        tracing::info!(%addr, router = %settings.router_id, threads = settings.worker_threads, "router listening");
        Ok(Self {
            addr,
            router_id: settings.router_id,
            shared,
            shutdown,
            server,
            failed,
        })
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The routing table in use now.
    pub fn table(&self) -> Arc<RoutingTable> {
        self.shared.table.load_full()
    }

    /// Requests this router has in flight, summed over instances.
    pub fn in_flight(&self) -> u32 {
        let mut total = 0;
        self.shared.registry.for_each(|_, cell| {
            total += cell.local.load(std::sync::atomic::Ordering::Relaxed);
        });
        total
    }

    pub fn shutdown_token(&self) -> CancellationToken {
        self.shutdown.clone()
    }

    /// Stops accepting, finishes in-flight requests (within the grace period), and waits.
    pub async fn shutdown(mut self) {
        self.shutdown.cancel();
        let _ = (&mut self.server).await;
    }

    /// Waits until the server stops (after its shutdown token is cancelled). False when it
    /// stopped because a serving thread failed.
    pub async fn wait(mut self) -> bool {
        let joined = (&mut self.server).await;
        joined.is_ok() && !self.failed.load(std::sync::atomic::Ordering::SeqCst)
    }
}

/// Dropping the handle stops the router: its serving threads would otherwise outlive it.
impl Drop for RouterHandle {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

/// Why a router did not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("--listen {0}: {1}")]
    Listen(SocketAddr, std::io::Error),
    #[error("cannot start serving thread {0} (see --worker-threads): {1}")]
    Thread(usize, std::io::Error),
    #[error("cannot start the control-plane sync thread: {0}")]
    SyncThread(std::io::Error),
}

use std::future::IntoFuture as _;

/// Serves `app` on `listener` in the current runtime until `stop` is cancelled, then lets
/// in-flight requests finish for up to `grace`.
async fn serve(
    listener: std::net::TcpListener,
    app: AxumRouter,
    stop: CancellationToken,
    grace: Duration,
) {
    let listener = match tokio::net::TcpListener::from_std(listener) {
        Ok(listener) => listener.tap_io(|tcp| {
            let _ = tcp.set_nodelay(true);
        }),
        Err(err) => {
            tracing::error!(error = %err, "cannot serve the listening socket");
            return;
        }
    };
    let serve = axum::serve(listener, app)
        .with_graceful_shutdown(stop.clone().cancelled_owned())
        .into_future();
    tokio::pin!(serve);
    tokio::select! {
        result = &mut serve => {
            if let Err(err) = result {
                tracing::error!(error = %err, "router server failed");
            }
        }
        () = async {
            stop.cancelled().await;
            tokio::time::sleep(grace).await;
        } => tracing::warn!(?grace, "in-flight requests outlived the grace period; closing them"),
    }
}

fn app(shared: Arc<Shared>) -> AxumRouter {
    async fn native(
        State(shared): State<Arc<Shared>>,
        Path(endpoint): Path<String>,
        request: Request,
    ) -> Response {
        proxy::handle(shared, Operation::Invocations, Some(endpoint), request).await
    }
    async fn native_stream(
        State(shared): State<Arc<Shared>>,
        Path(endpoint): Path<String>,
        request: Request,
    ) -> Response {
        proxy::handle(
            shared,
            Operation::InvocationsStream,
            Some(endpoint),
            request,
        )
        .await
    }
    async fn chat(
        State(shared): State<Arc<Shared>>,
        Path(endpoint): Path<String>,
        request: Request,
    ) -> Response {
        proxy::handle(shared, Operation::ChatCompletions, Some(endpoint), request).await
    }
    async fn completions(
        State(shared): State<Arc<Shared>>,
        Path(endpoint): Path<String>,
        request: Request,
    ) -> Response {
        proxy::handle(shared, Operation::Completions, Some(endpoint), request).await
    }
    async fn plain_chat(State(shared): State<Arc<Shared>>, request: Request) -> Response {
        proxy::handle(shared, Operation::ChatCompletions, None, request).await
    }
    async fn plain_completions(State(shared): State<Arc<Shared>>, request: Request) -> Response {
        proxy::handle(shared, Operation::Completions, None, request).await
    }
    async fn models(State(shared): State<Arc<Shared>>) -> Response {
        proxy::list_models(&shared.table.load())
    }
    async fn ready(State(shared): State<Arc<Shared>>) -> Response {
        if shared.table.load().version > 0 {
            (StatusCode::OK, "ready\n").into_response()
        } else {
            (
                StatusCode::SERVICE_UNAVAILABLE,
                "not ready: no routing state yet\n",
            )
                .into_response()
        }
    }
    async fn metrics(State(shared): State<Arc<Shared>>) -> Response {
        let text = shared
            .metrics
            .render(&shared.table.load(), &shared.registry);
        (
            [(
                http::header::CONTENT_TYPE,
                switchyard_shared::metrics::CONTENT_TYPE,
            )],
            text,
        )
            .into_response()
    }
    async fn not_found() -> Response {
        errors::ApiError::unknown_endpoint("no such path; see the Switchyard README for the API")
            .into_response_for(errors::Api::Native)
    }
    AxumRouter::new()
        .route("/endpoints/{endpoint}/invocations", post(native))
        .route(
            "/endpoints/{endpoint}/invocations-response-stream",
            post(native_stream),
        )
        .route(
            "/endpoints/{endpoint}/openai/v1/chat/completions",
            post(chat),
        )
        .route(
            "/endpoints/{endpoint}/openai/v1/completions",
            post(completions),
        )
        .route("/v1/chat/completions", post(plain_chat))
        .route("/v1/completions", post(plain_completions))
        .route("/v1/models", get(models))
        .route("/ping", get(|| async { "ok\n" }))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(ready))
        .route("/metrics", get(metrics))
        .fallback(not_found)
        .with_state(shared)
}
