//! What the control plane tells operators: Prometheus metrics on `--metrics-listen`, and
//! OpenTelemetry spans for admin RPCs (continuing the caller's trace from gRPC metadata) and
//! store operations.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use switchyard_process::metrics::{CONTENT_TYPE, Histogram, TextEncoder};
use tokio::net::TcpListener;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::Instrument as _;
use tracing_opentelemetry::OpenTelemetrySpanExt as _;

use crate::metrics::{ControlMetrics, STORE_OPERATIONS};
use crate::state::StateCache;
use crate::store::{Kv, LeaseId, Listing, Revision, Store, StoreError, Txn};
use crate::sync::SyncStats;

/// What a scrape reads besides [`ControlMetrics`].
#[derive(Debug, Clone)]
pub struct Sources {
    pub metrics: Arc<ControlMetrics>,
    pub cache: Arc<StateCache>,
    pub sync: Arc<SyncStats>,
    pub leading: tokio::sync::watch::Receiver<Option<Revision>>,
}

impl Sources {
    /// The Prometheus text exposition.
    pub fn render(&self) -> String {
        let mut out = TextEncoder::new();
        let metrics = &self.metrics;
        let load = |counter: &AtomicU64| counter.load(Ordering::Relaxed) as f64;
        out.family(
            "switchyard_control_admin_rpcs_total",
            "counter",
            "Admin gRPC calls answered, by method and gRPC status code.",
        );
        {
            let rpcs = metrics
                .admin_rpcs
                .lock()
                .unwrap_or_else(|poison| poison.into_inner());
            for ((method, code), count) in rpcs.iter() {
                out.sample(
                    "switchyard_control_admin_rpcs_total",
                    &[("method", method), ("code", code)],
                    *count as f64,
                );
            }
        }
        histogram(
            &mut out,
            "switchyard_control_admin_rpc_seconds",
            "Time to answer an admin gRPC call.",
            &metrics.admin_rpc_seconds,
        );
        out.family(
            "switchyard_control_store_operation_seconds",
            "histogram",
            "Time of one store operation (etcd or embedded), by operation.",
        );
        for (operation, seconds) in STORE_OPERATIONS.iter().zip(&metrics.store_seconds) {
            out.histogram(
                "switchyard_control_store_operation_seconds",
                &[("operation", operation)],
                seconds,
            );
        }
        by_label(
            &mut out,
            "switchyard_control_store_errors_total",
            "counter",
            "Store operations that failed, by operation.",
            "operation",
            STORE_OPERATIONS
                .into_iter()
                .zip(metrics.store_errors.iter().map(load)),
        );
        single(
            &mut out,
            "switchyard_control_leader",
            "gauge",
            "1 while this replica leads (runs health checks), else 0.",
            f64::from(u8::from(self.leading.borrow().is_some())),
        );
        single(
            &mut out,
            "switchyard_control_ready",
            "gauge",
            "1 while this replica's view of the store is current (it serves routers), else 0.",
            f64::from(u8::from(self.cache.is_ready())),
        );
        single(
            &mut out,
            "switchyard_control_connected_routers",
            "gauge",
            "Router sync streams open on this replica.",
            load(&self.sync.open_streams),
        );
        let (configs, endpoints, instances) = self.cache.sizes();
        by_label(
            &mut out,
            "switchyard_control_membership",
            "gauge",
            "Objects in this replica's view of the store, by kind.",
            "kind",
            [
                ("endpoint_config", configs as f64),
                ("endpoint", endpoints as f64),
                ("instance", instances as f64),
            ],
        );
        by_label(
            &mut out,
            "switchyard_control_health_probes_total",
            "counter",
            "Health probes of instances, by outcome (success, failure).",
            "outcome",
            ["success", "failure"]
                .into_iter()
                .zip(metrics.probes.iter().map(load)),
        );
        single(
            &mut out,
            "switchyard_control_sync_snapshots_total",
            "counter",
            "Full snapshots sent to routers (first ones, and fresh ones after falling behind).",
            load(&self.sync.snapshots),
        );
        single(
            &mut out,
            "switchyard_control_sync_fell_behind_total",
            "counter",
            "Router streams that fell behind the change broadcast and got a fresh snapshot.",
            load(&self.sync.fell_behind),
        );
        single(
            &mut out,
            "switchyard_control_sync_changes_total",
            "counter",
            "Membership changes pushed to routers (summed over streams).",
            load(&self.sync.changes),
        );
        histogram(
            &mut out,
            "switchyard_control_sync_push_lag_seconds",
            "From a change reaching this replica's view to its push on a router stream.",
            &metrics.sync_push_lag_seconds,
        );
        switchyard_telemetry::write_metrics(&mut out);
        out.finish()
    }
}

/// A family of one unlabelled sample.
fn single(out: &mut TextEncoder, name: &str, kind: &str, help: &str, value: f64) {
    out.family(name, kind, help).sample(name, &[], value);
}

/// A family of one sample per value of `label`.
fn by_label<'a>(
    out: &mut TextEncoder,
    name: &str,
    kind: &str,
    help: &str,
    label: &str,
    samples: impl IntoIterator<Item = (&'a str, f64)>,
) {
    out.family(name, kind, help);
    for (label_value, value) in samples {
        out.sample(name, &[(label, label_value)], value);
    }
}

/// A family of one unlabelled histogram.
fn histogram(out: &mut TextEncoder, name: &str, help: &str, histogram: &Histogram) {
    out.family(name, "histogram", help)
        .histogram(name, &[], histogram);
}

/// Serves `GET /metrics` (anything else: 404) until `shutdown`.
pub async fn serve_metrics(listener: TcpListener, sources: Sources, shutdown: CancellationToken) {
    let mut connections = JoinSet::new();
    loop {
        tokio::select! {
            () = shutdown.cancelled() => break,
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
            accepted = listener.accept() => {
                let Ok((stream, _)) = accepted else {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                };
                let _ = stream.set_nodelay(true);
                let sources = sources.clone();
                let stop = shutdown.clone();
                connections.spawn(async move {
                    let service = hyper::service::service_fn(move |request: http::Request<Incoming>| {
                        let sources = sources.clone();
                        async move { Ok::<_, Infallible>(answer(&sources, &request)) }
                    });
                    let connection = hyper::server::conn::http1::Builder::new()
                        .timer(TokioTimer::new())
                        .header_read_timeout(Duration::from_secs(10))
                        .serve_connection(TokioIo::new(stream), service);
                    tokio::pin!(connection);
                    tokio::select! {
                        _ = connection.as_mut() => {}
                        () = stop.cancelled() => {
                            connection.as_mut().graceful_shutdown();
                            let _ = tokio::time::timeout(Duration::from_secs(1), connection).await;
                        }
                    }
                });
            }
        }
    }
    connections.shutdown().await;
}

fn answer(sources: &Sources, request: &http::Request<Incoming>) -> http::Response<Full<Bytes>> {
    let mut response = if request.uri().path() == "/metrics" {
        let mut response = http::Response::new(Full::new(Bytes::from(sources.render())));
        response.headers_mut().insert(
            http::header::CONTENT_TYPE,
            http::HeaderValue::from_static(CONTENT_TYPE),
        );
        response
    } else {
        http::Response::new(Full::new(Bytes::from_static(b"not found; try /metrics\n")))
    };
    if request.uri().path() != "/metrics" {
        *response.status_mut() = http::StatusCode::NOT_FOUND;
    }
    response
}

/// A tower layer over the gRPC server: every admin call gets a server span (a child of the
/// caller's `traceparent` when its metadata carries one) and is counted by method and code.
#[derive(Debug, Clone)]
pub struct AdminRpcLayer {
    pub metrics: Arc<ControlMetrics>,
}

impl<S> tower::Layer<S> for AdminRpcLayer {
    type Service = AdminRpcService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        AdminRpcService {
            inner,
            metrics: Arc::clone(&self.metrics),
        }
    }
}

#[derive(Debug, Clone)]
pub struct AdminRpcService<S> {
    inner: S,
    metrics: Arc<ControlMetrics>,
}

/// The admin service's path prefix in gRPC.
const ADMIN_PATH: &str = "/switchyard.v1.Admin/";

impl<S, B, R> tower::Service<http::Request<B>> for AdminRpcService<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<R>> + Send,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        let Some(method) = request.uri().path().strip_prefix(ADMIN_PATH) else {
            return Box::pin(self.inner.call(request));
        };
        let method = method.to_owned();
        let span = tracing::info_span!(
            "admin rpc",
            otel.name = format!("switchyard.v1.Admin/{method}"),
            otel.kind = "server",
            rpc.system = "grpc",
            rpc.service = "switchyard.v1.Admin",
            rpc.method = %method,
            rpc.grpc.status_code = tracing::field::Empty,
        );
        let parent = switchyard_telemetry::propagation::extract(request.headers());
        let _ = span.set_parent(parent);
        let metrics = Arc::clone(&self.metrics);
        let started = Instant::now();
        let call = self.inner.call(request);
        Box::pin(
            async move {
                let result = call.await;
                let code = match &result {
                    Ok(response) => grpc_code(response.headers()),
                    Err(_) => "UNKNOWN",
                };
                tracing::Span::current().record("rpc.grpc.status_code", code);
                metrics.count_admin_rpc(&method, code, started.elapsed().as_secs_f64());
                result
            }
            .instrument(span),
        )
    }
}

/// The gRPC status of a unary answer: in the head when it failed (trailers-only), else OK.
fn grpc_code(headers: &http::HeaderMap) -> &'static str {
    let code = headers
        .get("grpc-status")
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.parse::<i32>().ok())
        .unwrap_or(0);
    match tonic::Code::from_i32(code) {
        tonic::Code::Ok => "OK",
        tonic::Code::Cancelled => "CANCELLED",
        tonic::Code::Unknown => "UNKNOWN",
        tonic::Code::InvalidArgument => "INVALID_ARGUMENT",
        tonic::Code::DeadlineExceeded => "DEADLINE_EXCEEDED",
        tonic::Code::NotFound => "NOT_FOUND",
        tonic::Code::AlreadyExists => "ALREADY_EXISTS",
        tonic::Code::PermissionDenied => "PERMISSION_DENIED",
        tonic::Code::ResourceExhausted => "RESOURCE_EXHAUSTED",
        tonic::Code::FailedPrecondition => "FAILED_PRECONDITION",
        tonic::Code::Aborted => "ABORTED",
        tonic::Code::OutOfRange => "OUT_OF_RANGE",
        tonic::Code::Unimplemented => "UNIMPLEMENTED",
        tonic::Code::Internal => "INTERNAL",
        tonic::Code::Unavailable => "UNAVAILABLE",
        tonic::Code::DataLoss => "DATA_LOSS",
        tonic::Code::Unauthenticated => "UNAUTHENTICATED",
    }
}

/// A store that times and counts every operation and gives each a span.
pub struct ObservedStore {
    pub inner: Arc<dyn Store>,
    pub metrics: Arc<ControlMetrics>,
}

impl std::fmt::Debug for ObservedStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ObservedStore")
            .field("kind", &self.inner.kind())
            .finish()
    }
}

impl ObservedStore {
    async fn observe<T>(
        &self,
        index: usize,
        operation: impl Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        let span = tracing::info_span!(
            "store",
            otel.name = format!("store {}", STORE_OPERATIONS[index]),
            otel.kind = "client",
            db.system = self.inner.kind(),
            db.operation.name = STORE_OPERATIONS[index],
        );
        let started = Instant::now();
        let result = operation.instrument(span).await;
        self.metrics.store_seconds[index].observe(started.elapsed().as_secs_f64());
        if result.is_err() {
            self.metrics.store_errors[index].fetch_add(1, Ordering::Relaxed);
        }
        result
    }
}

#[async_trait::async_trait]
impl Store for ObservedStore {
    fn kind(&self) -> &'static str {
        self.inner.kind()
    }
    async fn get(&self, key: &str) -> Result<Option<Kv>, StoreError> {
        self.observe(0, self.inner.get(key)).await
    }
    async fn list(&self, prefix: &str) -> Result<Vec<Kv>, StoreError> {
        self.observe(1, self.inner.list(prefix)).await
    }
    async fn commit(&self, txn: Txn) -> Result<Option<Revision>, StoreError> {
        self.observe(2, self.inner.commit(txn)).await
    }
    async fn grant_lease(&self, ttl_seconds: u32) -> Result<LeaseId, StoreError> {
        self.observe(3, self.inner.grant_lease(ttl_seconds)).await
    }
    async fn keep_alive(&self, lease: LeaseId) -> Result<bool, StoreError> {
        self.observe(4, self.inner.keep_alive(lease)).await
    }
    async fn revoke_lease(&self, lease: LeaseId) -> Result<(), StoreError> {
        self.observe(5, self.inner.revoke_lease(lease)).await
    }
    async fn list_and_watch(&self, prefix: &str) -> Result<Listing, StoreError> {
        self.observe(6, self.inner.list_and_watch(prefix)).await
    }
    fn close(&self) {
        self.inner.close();
    }
}
