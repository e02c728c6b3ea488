//! Serving: the listening socket, the serving threads (one single-threaded runtime each,
//! with its own upstream pools), connection admission and client deadlines, the HTTP routes,
//! the control-plane sync task, the KV-event thread (KV_AWARE), and the handle that stops it
//! all.

pub(crate) mod admission;
pub(crate) mod connection;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use arc_swap::ArcSwap;
use axum::Router as AxumRouter;
use axum::extract::{Path, Request, State};
use axum::response::{IntoResponse, Response};
use axum::routing::{MethodFilter, MethodRouter, get, on, post};
use http::StatusCode;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::config::{Deadlines, Settings, Source, UpstreamProtocol};
use crate::errors::{Api, ApiError};
use crate::forward::ForwardSettings;
use crate::forward::upstream::{HttpClient, UpstreamClients};
use crate::kv::KvThread;
use crate::observe::metrics;
use crate::operation::Operation;
use crate::plan::count::TokenCounters;
use crate::request::local_tokens::LocalTokenizers;
use crate::request::queue::FlowControl;
use crate::request::tokenize::TokenizeClient;
use crate::request::{Worker, handle};
use crate::routing::cells::LoadRegistry;
use crate::routing::membership::Membership;
use crate::routing::sync_client;
use crate::routing::table::RoutingTable;
use crate::server::admission::Admission;
use switchyard_telemetry::Telemetry;

/// A running router.
#[derive(Debug)]
pub struct RouterHandle {
    pub addr: SocketAddr,
    pub router_id: String,
    worker: Arc<Worker>,
    shutdown: CancellationToken,
    server: JoinHandle<()>,
    /// Set when a serving thread panicked (and stopped the router).
    failed: Arc<AtomicBool>,
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
    #[error(transparent)]
    Telemetry(#[from] switchyard_telemetry::TelemetryError),
    #[error("cannot start the KV-event thread: {0}")]
    KvThread(std::io::Error),
    #[error("LMCache notice socket: {0}")]
    Notices(std::io::Error),
}

/// A serving thread's connection pools (HTTP/1.1 and h2c; no connection is made before use).
fn upstream_clients(settings: &Settings) -> UpstreamClients {
    let deadlines = &settings.deadlines;
    UpstreamClients {
        http1: upstream_client(deadlines, UpstreamProtocol::Http1),
        h2c: upstream_client(deadlines, UpstreamProtocol::H2c),
        default_h2c: settings.config.upstream_protocol == UpstreamProtocol::H2c,
    }
}

fn upstream_client(deadlines: &Deadlines, protocol: UpstreamProtocol) -> HttpClient {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    connector.set_connect_timeout(Some(deadlines.connect));
    connector.set_keepalive(Some(Duration::from_secs(30)));
    let mut builder = Client::builder(TokioExecutor::new());
    builder
        .timer(TokioTimer::new())
        .pool_timer(TokioTimer::new())
        .pool_idle_timeout(deadlines.upstream_idle)
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
        let open_files = switchyard_process::open_file_limit();
        let limits = settings.limits;
        if let Some(open_files) = open_files
            && (limits.max_connections + limits.max_in_flight) as u64 + 256 > open_files
        {
            tracing::warn!(
                open_files,
                max_connections = limits.max_connections,
                max_in_flight = limits.max_in_flight,
                "--max-connections plus --max-in-flight (one upstream connection each) exceed \
                 the open-file limit; raise `ulimit -n` or lower them"
            );
        }
        let telemetry = match &settings.telemetry {
            Some(telemetry) => Some(Telemetry::start(telemetry, "switchyard-router")?),
            None => None,
        };
        let shutdown = CancellationToken::new();
        let registry = Arc::new(LoadRegistry::default());
        let table = Arc::new(ArcSwap::from_pointee(RoutingTable::default()));
        let connected = Arc::new(metrics::SyncMetrics::default());
        // KV_AWARE: the engines' KV events, followed on a thread of their own for the
        // table's KV_AWARE variants (idle while there are none).
        let kv_events = KvThread::spawn(Arc::clone(&table), settings.kv, &shutdown)
            .map_err(StartError::KvThread)?;
        let metrics = Arc::new(metrics::RouterMetrics::new(Arc::clone(&connected)));
        // The notice socket outlives the drain: a request past its prefill waits for its notices
        // within the grace period, and other routers' notices are still relayed. It stops
        // once every serving thread is done, or when start fails (the guard is dropped).
        let notices_stop = CancellationToken::new();
        let notices_stopped = notices_stop.clone().drop_guard();
        let notices = match &config.lmcache_notice_bind {
            None => None,
            Some(bind) => Some(
                crate::forward::notices::start(
                    bind,
                    config.lmcache_notice_advertise.clone(),
                    Arc::clone(&metrics),
                    notices_stop,
                )
                .map_err(StartError::Notices)?,
            ),
        };
        let worker = Arc::new(Worker {
            table: Arc::clone(&table),
            registry: Arc::clone(&registry),
            clients: upstream_clients(&settings),
            forwarding: ForwardSettings {
                max_attempts: config.max_attempts,
                retry_after_send: config.retry_after_send,
                eject_after_failures: config.eject_after_failures,
                eject_for: Duration::from_secs(config.eject_seconds),
                upstream_header: settings.deadlines.upstream_header,
                stream_idle: settings.deadlines.stream_idle,
                decision_header: config.decision_time_header,
            },
            client_body_deadline: settings.deadlines.client_body,
            metrics,
            admission: Arc::new(Admission::new(limits)),
            counters: Arc::new(TokenCounters::new(config.tokenizer_dir.clone())),
            tracer: telemetry.as_ref().map(|telemetry| telemetry.sink.clone()),
            kv_index: Arc::clone(kv_events.index()),
            tokenize: TokenizeClient::with_pause(
                settings.kv_tokenize_timeout,
                settings.kv_tokenize_pause,
            ),
            local_tokens: Arc::new(LocalTokenizers::new(
                config.tokenizer_dir.clone(),
                usize::try_from(config.tokenize_cache_bytes).unwrap_or(usize::MAX),
                config.tokenize_check_fraction,
            )),
            flow: Arc::new(FlowControl::new(settings.queue, shutdown.clone())),
            notices,
        });
        // The default tokenizer takes about 0.1 s to load: not on a request's time.
        let tokenizers = Arc::clone(&worker.counters);
        std::thread::Builder::new()
            .name("switchyard-tokenizer".into())
            .spawn(move || tokenizers.warm_up())
            .map_err(|err| StartError::Thread(0, err))?;
        let grace = Duration::from_secs(config.shutdown_grace_seconds);
        let deadlines = settings.deadlines;
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
            let thread_worker = Arc::new(worker.with_clients(upstream_clients(&settings)));
            prepared.push((index, listener, runtime, thread_worker));
        }
        let failed = Arc::new(AtomicBool::new(false));
        let mut others = Vec::with_capacity(prepared.len());
        for (index, listener, runtime, thread_worker) in prepared {
            let stop = shutdown.clone();
            let failed = Arc::clone(&failed);
            let (done, finished) = tokio::sync::oneshot::channel::<()>();
            let spawned = std::thread::Builder::new()
                .name(format!("switchyard-http-{index}"))
                .spawn(move || {
                    let served = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        runtime.block_on(serve(
                            listener,
                            thread_worker,
                            deadlines,
                            stop.clone(),
                            grace,
                        ));
                    }));
                    // Whatever the grace period left running ends here, before `done`.
                    runtime.shutdown_timeout(Duration::from_secs(1));
                    if served.is_err() {
                        tracing::error!(
                            thread = index,
                            "serving thread panicked; stopping the router"
                        );
                        failed.store(true, Ordering::SeqCst);
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
        let mut membership = Membership::new(Arc::clone(&registry), Arc::clone(&table))
            .with_tokenizers(Arc::clone(&worker.counters))
            .with_local_tokenizers(Arc::clone(&worker.local_tokens));
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
                // The sync stream and the table updates run on a thread of their own, off
                // the serving threads (which only load the current table).
                let sync = sync_client::SyncSettings {
                    urls: urls.clone(),
                    router_id: settings.router_id.clone(),
                    report_interval: Duration::from_millis(config.load_report_interval_ms),
                    tls_ca: settings.tls_ca.clone(),
                    token: settings.control_plane_token.clone(),
                };
                match sync_client::spawn(
                    sync,
                    membership,
                    Arc::clone(&registry),
                    connected,
                    shutdown.clone(),
                ) {
                    Ok(task) => Some(task),
                    Err(err) => {
                        shutdown.cancel();
                        return Err(StartError::SyncThread(err));
                    }
                }
            }
        };
        let stop = shutdown.clone();
        let thread_zero = Arc::clone(&worker);
        let server = tokio::spawn(async move {
            serve(listener, thread_zero, deadlines, stop, grace).await;
            for finished in others {
                let _ = finished.await;
            }
            drop(notices_stopped);
            if let Some(task) = sync_task {
                task.abort();
            }
            // The last spans go out (within about two seconds).
            if let Some(telemetry) = telemetry {
                let _ = tokio::task::spawn_blocking(move || telemetry.shutdown()).await;
            }
            // Subscribers close their sockets; the thread's runtime ends within a second.
            let _ = tokio::task::spawn_blocking(move || kv_events.join()).await;
        });
        tracing::info!(%addr, router = %settings.router_id, threads = settings.worker_threads, "router listening");
        Ok(Self {
            addr,
            router_id: settings.router_id,
            worker,
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
        self.worker.table.load_full()
    }

    /// Requests waiting now in this router's flow-control queue of `endpoint`'s `variant`.
    pub fn queued(&self, endpoint: &str, variant: &str) -> usize {
        self.worker.flow.queued(endpoint, variant)
    }

    /// Requests this router has in flight, summed over instances.
    pub fn in_flight(&self) -> u32 {
        let mut total = 0;
        self.worker.registry.for_each(|_, cell| {
            total += cell.local.load(Ordering::Relaxed);
        });
        total
    }

    /// Admission counters: connections open, requests in flight, body bytes held.
    pub fn admission(&self) -> &Admission {
        &self.worker.admission
    }

    pub fn metrics(&self) -> &metrics::RouterMetrics {
        &self.worker.metrics
    }

    /// What the engines' KV events say each instance holds (KV_AWARE variants).
    pub fn kv_index(&self) -> &Arc<crate::kv::KvIndex> {
        &self.worker.kv_index
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
        joined.is_ok() && !self.failed.load(Ordering::SeqCst)
    }
}

/// Dropping the handle stops the router: its serving threads would otherwise outlive it.
impl Drop for RouterHandle {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

/// Serves `listener` in the current runtime until `stop` is cancelled, then lets in-flight
/// requests finish for up to `grace`. Each connection holds a `--max-connections` slot;
/// HTTP/1 clients get `--client-header-timeout-seconds` to send each request head (an idle
/// keep-alive connection is closed after it too).
async fn serve(
    listener: std::net::TcpListener,
    worker: Arc<Worker>,
    deadlines: Deadlines,
    stop: CancellationToken,
    grace: Duration,
) {
    let listener = match tokio::net::TcpListener::from_std(listener) {
        Ok(listener) => listener,
        Err(err) => {
            tracing::error!(error = %err, "cannot serve the listening socket");
            return;
        }
    };
    let app = app(Arc::clone(&worker));
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(deadlines.client_header)
        .keep_alive(true)
        // A request head must fit; bodies stream through in chunks of at most this.
        .max_buf_size(64 * 1024);
    builder
        .http2()
        .timer(TokioTimer::new())
        .keep_alive_interval(Duration::from_secs(20));
    // Every connection task is owned here: after the grace period, those still running are
    // aborted with the set.
    let mut connections = tokio::task::JoinSet::new();
    loop {
        let tcp = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((tcp, _peer)) => tcp,
                Err(err) => {
                    // Out of file descriptors, or a connection reset while queued: wait a
                    // little (connections closing free descriptors) rather than spin.
                    tracing::warn!(error = %err, "accept failed");
                    tokio::select! {
                        () = tokio::time::sleep(Duration::from_millis(50)) => continue,
                        () = stop.cancelled() => break,
                    }
                }
            },
            Some(_) = connections.join_next(), if !connections.is_empty() => continue,
            () = stop.cancelled() => break,
        };
        let _ = tcp.set_nodelay(true);
        match worker.admission.connection() {
            Some(permit) => {
                let (socket, service, watch) = crate::server::connection::watch(tcp, app.clone());
                let connection = builder
                    .serve_connection(TokioIo::new(socket), service)
                    .into_owned();
                let stop = stop.clone();
                let metrics = Arc::clone(&worker.metrics);
                connections.spawn(async move {
                    crate::server::connection::drive(connection, watch, deadlines, stop, metrics)
                        .await;
                    drop(permit);
                });
            }
            None => refuse_connection(TokioIo::new(tcp), &worker),
        }
    }
    // New connections are refused from here on.
    drop(listener);
    let drained = tokio::time::timeout(grace, async {
        while connections.join_next().await.is_some() {}
    })
    .await;
    if drained.is_err() {
        tracing::warn!(
            ?grace,
            "in-flight requests outlived the grace period; closing them"
        );
        connections.abort_all();
    }
}

/// Answers a connection over `--max-connections` with one 503 and closes it; when even the
/// refusals are too many, closes it at once.
fn refuse_connection(io: TokioIo<tokio::net::TcpStream>, worker: &Worker) {
    worker.metrics.error(crate::errors::ErrorKind::Overloaded);
    let Some(slot) = worker.admission.refusal() else {
        return;
    };
    let max_connections = worker.admission.limits().max_connections;
    tokio::spawn(async move {
        let service = hyper::service::service_fn(move |request: http::Request<_>| {
            let api = api_of_path(request.uri().path());
            let response = ApiError::overloaded(format!(
                "the router has {max_connections} connections open (--max-connections); retry shortly"
            ))
            .into_response_for(api);
            async move { Ok::<_, Infallible>(response) }
        });
        let mut http1 = hyper::server::conn::http1::Builder::new();
        http1
            .timer(TokioTimer::new())
            .header_read_timeout(Duration::from_secs(2))
            .keep_alive(false);
        let _ =
            tokio::time::timeout(Duration::from_secs(5), http1.serve_connection(io, service)).await;
        drop(slot);
    });
}

/// The API a path belongs to, for errors answered before routing (and unknown paths): the
/// native API under `/endpoints/{e}/` outside `openai/`, the OpenAI API everywhere else.
fn api_of_path(path: &str) -> Api {
    if path.starts_with("/endpoints/") && !path.contains("/openai/") {
        Api::Native
    } else {
        Api::OpenAi
    }
}

/// The OpenAI-compatible paths the router serves (vLLM's), each at its plain path and under
/// `/endpoints/{endpoint}/openai`, with the method and operation.
const OPENAI_ROUTES: &[(&str, MethodFilter, Operation)] = &[
    (
        "/v1/chat/completions",
        MethodFilter::POST,
        Operation::ChatCompletions,
    ),
    (
        "/v1/completions",
        MethodFilter::POST,
        Operation::Completions,
    ),
    ("/v1/responses", MethodFilter::POST, Operation::Responses),
    (
        "/v1/responses/{response_id}",
        MethodFilter::GET,
        Operation::ResponseRetrieve,
    ),
    (
        "/v1/responses/{response_id}",
        MethodFilter::DELETE,
        Operation::ResponseDelete,
    ),
    (
        "/v1/responses/{response_id}/cancel",
        MethodFilter::POST,
        Operation::ResponseCancel,
    ),
    ("/v1/embeddings", MethodFilter::POST, Operation::Embeddings),
    ("/pooling", MethodFilter::POST, Operation::Pooling),
    ("/classify", MethodFilter::POST, Operation::Classify),
    ("/score", MethodFilter::POST, Operation::Score),
    ("/v1/score", MethodFilter::POST, Operation::ScoreV1),
    ("/rerank", MethodFilter::POST, Operation::Rerank),
    ("/v1/rerank", MethodFilter::POST, Operation::RerankV1),
    ("/v2/rerank", MethodFilter::POST, Operation::RerankV2),
    ("/tokenize", MethodFilter::POST, Operation::Tokenize),
    ("/detokenize", MethodFilter::POST, Operation::Detokenize),
];

/// The endpoint named in `/endpoints/{endpoint}/...` (other path parameters are the plan's).
#[derive(serde::Deserialize)]
struct EndpointParam {
    endpoint: String,
}

/// `operation` on a plain path: the body's `model`, or the response id, names the endpoint.
fn plain(filter: MethodFilter, operation: Operation) -> MethodRouter<Arc<Worker>> {
    on(
        filter,
        move |State(worker): State<Arc<Worker>>, request: Request| {
            handle(worker, operation, None, request)
        },
    )
}

/// `operation` under `/endpoints/{endpoint}/...`.
fn under_endpoint(filter: MethodFilter, operation: Operation) -> MethodRouter<Arc<Worker>> {
    on(
        filter,
        move |State(worker): State<Arc<Worker>>,
              Path(path): Path<EndpointParam>,
              request: Request| { handle(worker, operation, Some(path.endpoint), request) },
    )
}

fn app(worker: Arc<Worker>) -> AxumRouter {
    async fn models(State(worker): State<Arc<Worker>>) -> Response {
        list_models(&worker.table.load())
    }
    async fn ready(State(worker): State<Arc<Worker>>) -> Response {
        if worker.table.load().version > 0 {
            (StatusCode::OK, "ready\n").into_response()
        } else {
            (
                StatusCode::SERVICE_UNAVAILABLE,
                "not ready: no routing state yet\n",
            )
                .into_response()
        }
    }
    async fn metrics(State(worker): State<Arc<Worker>>) -> Response {
        let mut text = worker.metrics.render(
            &worker.table.load(),
            &worker.registry,
            &worker.admission,
            worker.counters.fallbacks(),
        );
        text.push_str(&worker.kv_index.render_metrics());
        let mut flow = switchyard_process::metrics::TextEncoder::new();
        worker.flow.render(&mut flow);
        worker.local_tokens.render(&mut flow);
        text.push_str(&flow.finish());
        (
            [(
                http::header::CONTENT_TYPE,
                switchyard_process::metrics::CONTENT_TYPE,
            )],
            text,
        )
            .into_response()
    }
    async fn not_found(State(worker): State<Arc<Worker>>, request: Request) -> Response {
        let path = request.uri().path();
        let api = api_of_path(path);
        worker
            .metrics
            .error(crate::errors::ErrorKind::UnknownEndpoint);
        match api {
            Api::OpenAi => ApiError::unknown_path(request.method(), path),
            Api::Native => {
                ApiError::unknown_endpoint("no such path; see the Switchyard README for the API")
            }
        }
        .into_response_for(api)
    }
    async fn method_not_allowed(State(worker): State<Arc<Worker>>, request: Request) -> Response {
        let path = request.uri().path();
        let error = ApiError::method_not_allowed(request.method(), path);
        worker.metrics.error(error.kind);
        error.into_response_for(api_of_path(path))
    }
    let mut router = AxumRouter::new()
        .route(
            "/endpoints/{endpoint}/invocations",
            post(
                |State(worker): State<Arc<Worker>>,
                 Path(endpoint): Path<String>,
                 request: Request| {
                    handle(worker, Operation::Invocations, Some(endpoint), request)
                },
            ),
        )
        .route(
            "/endpoints/{endpoint}/invocations-response-stream",
            post(
                |State(worker): State<Arc<Worker>>,
                 Path(endpoint): Path<String>,
                 request: Request| {
                    handle(
                        worker,
                        Operation::InvocationsStream,
                        Some(endpoint),
                        request,
                    )
                },
            ),
        );
    for &(path, filter, operation) in OPENAI_ROUTES {
        router = router.route(path, plain(filter, operation)).route(
            &format!("/endpoints/{{endpoint}}/openai{path}"),
            under_endpoint(filter, operation),
        );
    }
    router
        .route("/v1/models", get(models))
        .route("/ping", get(|| async { "ok\n" }))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(ready))
        .route("/metrics", get(metrics))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .with_state(worker)
}

/// `GET /v1/models`: every endpoint and every variant ModelName, for OpenAI clients.
pub fn list_models(table: &crate::routing::table::RoutingTable) -> Response {
    let mut names: Vec<&str> = table
        .endpoints
        .keys()
        .map(|name| name.as_str())
        .chain(table.models.keys().map(String::as_str))
        .collect();
    names.sort_unstable();
    names.dedup();
    let data: Vec<serde_json::Value> = names
        .into_iter()
        .map(|name| serde_json::json!({"id": name, "object": "model", "owned_by": "switchyard"}))
        .collect();
    (
        http::StatusCode::OK,
        axum::Json(serde_json::json!({"object": "list", "data": data})),
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusals_before_routing_take_the_paths_api_shape() {
        assert_eq!(api_of_path("/endpoints/chat/invocations"), Api::Native);
        assert_eq!(
            api_of_path("/endpoints/chat/invocations-response-stream"),
            Api::Native
        );
        assert_eq!(
            api_of_path("/endpoints/chat/openai/v1/completions"),
            Api::OpenAi
        );
        assert_eq!(api_of_path("/v1/chat/completions"), Api::OpenAi);
        assert_eq!(api_of_path("/v1/foo"), Api::OpenAi);
        assert_eq!(api_of_path("/endpoints/chat/openai/v1/foo"), Api::OpenAi);
        assert_eq!(api_of_path("/endpoints/chat/foo"), Api::Native);
    }
}
