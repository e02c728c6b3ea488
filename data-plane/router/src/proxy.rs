//! The request path: resolve the endpoint, read and check the body, choose a variant and rank
//! its instances with the policy, then forward to the first candidate, falling back to the
//! next on a connection failure. The response streams back chunk by chunk; the instance's
//! in-flight count drops when the last byte is sent, the client goes away, or an error ends it.
//!
//! Architecture invariant: nothing here awaits the control plane, and no lock is held across
//! an `.await` (the table is an `ArcSwap` snapshot, load is atomics).

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use axum::body::Body;
use axum::extract::Request;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use http::StatusCode;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http_body::Frame;
use http_body_util::{BodyExt, Full, Limited};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use switchyard_policy::hash::{routing_key, session_key};
use switchyard_policy::openai::OpenAiRequest;
use switchyard_policy::prefix::{native, valid_prefix_aware_id};
use switchyard_policy::rank::{self, Route, Strategy};

use crate::errors::{Api, ApiError};
use crate::metrics::RouterMetrics;
use crate::table::{
    EndpointRoute, InstanceCell, InstanceRoute, LoadRegistry, RETRY_INDEX, RoutingTable,
    VariantRoute, route_index,
};
use switchyard_shared::InstanceProtocol;

/// SageMaker's payload limit.
pub const MAX_BODY_BYTES: usize = 6_291_456;

pub type HttpClient = Client<HttpConnector, Full<Bytes>>;

pub const PREFIX_AWARE_ID: HeaderName = HeaderName::from_static("x-amzn-sagemaker-prefix-aware-id");
pub const TARGET_VARIANT: HeaderName = HeaderName::from_static("x-amzn-sagemaker-target-variant");
pub const SESSION_ID: HeaderName = HeaderName::from_static("x-amzn-sagemaker-session-id");
pub const INVOKED_VARIANT: HeaderName =
    HeaderName::from_static("x-amzn-invoked-production-variant");
pub const SWITCHYARD_INSTANCE: HeaderName = HeaderName::from_static("x-switchyard-instance");
pub const SWITCHYARD_ROUTE: HeaderName = HeaderName::from_static("x-switchyard-route");
pub const REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

#[derive(Debug, Clone, Copy)]
pub struct ProxySettings {
    /// Candidates tried per request (first choice included).
    pub max_attempts: usize,
    /// Consecutive connection failures before an instance is ejected locally.
    pub eject_after_failures: u32,
    pub eject_for: Duration,
}

/// One serving thread's upstream connection pools: HTTP/1.1 keep-alive and h2c, and the one
/// used for instances that do not name a protocol.
#[derive(Debug, Clone)]
pub struct UpstreamClients {
    pub http1: HttpClient,
    pub h2c: HttpClient,
    pub default_h2c: bool,
}

impl UpstreamClients {
    pub fn for_instance(&self, protocol: InstanceProtocol) -> &HttpClient {
        match protocol {
            InstanceProtocol::Http1 => &self.http1,
            InstanceProtocol::H2c => &self.h2c,
            InstanceProtocol::Unspecified if self.default_h2c => &self.h2c,
            InstanceProtocol::Unspecified => &self.http1,
        }
    }
}

/// What one serving thread works with: the routing state and metrics every thread shares,
/// and this thread's own upstream connection pools (so that a request and the upstream
/// connection it uses are driven by the same thread).
#[derive(Debug)]
pub struct Shared {
    pub table: Arc<ArcSwap<RoutingTable>>,
    pub registry: Arc<LoadRegistry>,
    pub clients: UpstreamClients,
    pub settings: ProxySettings,
    pub metrics: Arc<RouterMetrics>,
}

impl Shared {
    /// The same routing state and metrics with other connection pools.
    pub fn with_clients(&self, clients: UpstreamClients) -> Self {
        Self {
            table: Arc::clone(&self.table),
            registry: Arc::clone(&self.registry),
            clients,
            settings: self.settings,
            metrics: Arc::clone(&self.metrics),
        }
    }
}

/// Which API a request came in on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Operation {
    Invocations,
    InvocationsStream,
    ChatCompletions,
    Completions,
}

impl Operation {
    fn api(self) -> Api {
        match self {
            Operation::Invocations | Operation::InvocationsStream => Api::Native,
            Operation::ChatCompletions | Operation::Completions => Api::OpenAi,
        }
    }

    fn upstream(self, instance: &InstanceRoute) -> &http::Uri {
        match self {
            Operation::Invocations | Operation::InvocationsStream => &instance.invocations,
            Operation::ChatCompletions => &instance.chat_completions,
            Operation::Completions => &instance.completions,
        }
    }
}

/// Decrements the instance's in-flight count exactly once, when dropped.
#[derive(Debug)]
struct InFlight(Arc<InstanceCell>);

impl InFlight {
    fn start(cell: &Arc<InstanceCell>) -> Self {
        cell.local.fetch_add(1, Ordering::Relaxed);
        Self(Arc::clone(cell))
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.local.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The upstream response body, passed through frame by frame, holding the in-flight count
/// until it ends or is dropped (client disconnect).
struct TrackedBody {
    inner: hyper::body::Incoming,
    in_flight: Option<InFlight>,
}

impl http_body::Body for TrackedBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        if matches!(polled, Poll::Ready(None) | Poll::Ready(Some(Err(_)))) {
            self.in_flight = None;
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// What the request asked for, once read and checked.
struct Parsed {
    body: Bytes,
    /// Routing key for PREFIX_AWARE (computed lazily per variant strategy).
    prefix_aware_id: Option<String>,
    session: Option<u64>,
    target_variant: Option<String>,
}

fn now_ms() -> u64 {
    crate::now_unix_ms()
}

fn header_str<'a>(headers: &'a HeaderMap, name: &HeaderName) -> Result<Option<&'a str>, ApiError> {
    match headers.get(name) {
        None => Ok(None),
        Some(value) => value
            .to_str()
            .map(Some)
            .map_err(|_| ApiError::validation(format!("header {name} must be printable ASCII"))),
    }
}

async fn read_body(mut body: Body, headers: &HeaderMap) -> Result<Bytes, ApiError> {
    if let Some(length) = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.parse::<usize>().ok())
        && length > MAX_BODY_BYTES
    {
        // A client that asked `Expect: 100-continue` has sent nothing yet and will send
        // nothing once it sees the 413: reading would make hyper invite the upload.
        let waits_for_continue = headers
            .get(header::EXPECT)
            .is_some_and(|value| value.as_bytes().eq_ignore_ascii_case(b"100-continue"));
        if !waits_for_continue {
            discard(body).await;
        }
        return Err(ApiError::too_large(MAX_BODY_BYTES));
    }
    // Most bodies arrive in one frame: keep it without copying.
    let mut first: Option<Bytes> = None;
    let mut more: Vec<u8> = Vec::new();
    let mut total = 0usize;
    while let Some(frame) = body.frame().await {
        let frame = frame
            .map_err(|err| ApiError::validation(format!("cannot read the request body: {err}")))?;
        let Ok(data) = frame.into_data() else {
            continue;
        };
        total += data.len();
        if total > MAX_BODY_BYTES {
            discard(body).await;
            return Err(ApiError::too_large(MAX_BODY_BYTES));
        }
        match &first {
            None => first = Some(data),
            Some(head) => {
                if more.is_empty() {
                    more.reserve(total);
                    more.extend_from_slice(head);
                }
                more.extend_from_slice(&data);
            }
        }
    }
    Ok(if more.is_empty() {
        first.unwrap_or_default()
    } else {
        Bytes::from(more)
    })
}

/// Reads and drops the rest of a request body that is refused (too large), so that the client
/// can finish sending and read the answer: closing a connection with unread data makes the
/// kernel reset it, and the client would see a reset instead of the 413. Bounded: at most
/// 64 MiB or 5 seconds, then the connection is closed anyway.
async fn discard(mut body: Body) {
    const MOST_BYTES: usize = 64 << 20;
    const MOST_TIME: Duration = Duration::from_secs(5);
    let _ = tokio::time::timeout(MOST_TIME, async {
        let mut seen = 0usize;
        while let Some(Ok(frame)) = body.frame().await {
            seen += frame.data_ref().map_or(0, Bytes::len);
            if seen > MOST_BYTES {
                break;
            }
        }
    })
    .await;
}

/// Handles one request on `operation`. `endpoint` is the path's endpoint name (`None` on the
/// plain `/v1/...` paths, where the body's `model` names it).
pub async fn handle(
    shared: Arc<Shared>,
    operation: Operation,
    endpoint: Option<String>,
    request: Request,
) -> Response {
    let api = operation.api();
    match route(&shared, operation, endpoint, request).await {
        Ok(response) => response,
        Err(err) => {
            shared.metrics.error(err.kind);
            err.into_response_for(api)
        }
    }
}

/// Bodies above this size are parsed and routed on a blocking thread: parsing 256 KiB of
/// JSON takes about a millisecond, too long to hold a runtime thread.
const OFFLOAD_BYTES: usize = 256 * 1024;

/// A request ready to forward.
struct Plan {
    endpoint: Arc<EndpointRoute>,
    variant_index: usize,
    ranking: rank::Ranking,
    body: Bytes,
}

async fn route(
    shared: &Shared,
    operation: Operation,
    endpoint_name: Option<String>,
    request: Request,
) -> Result<Response, ApiError> {
    let arrived = Instant::now();
    let (parts, body) = request.into_parts();
    let table = shared.table.load_full();
    if table.version == 0 {
        return Err(ApiError::unavailable(
            "the router has no routing state yet (control plane not reached)",
        ));
    }
    // Unknown endpoints are refused before the body is read.
    let endpoint =
        match &endpoint_name {
            Some(name) => {
                Some(table.endpoints.get(name.as_str()).cloned().ok_or_else(|| {
                    ApiError::unknown_endpoint(format!("Endpoint {name} not found"))
                })?)
            }
            None => None,
        };
    let body = read_body(body, &parts.headers).await?;
    let headers = parts.headers;
    let (plan, headers) = if body.len() > OFFLOAD_BYTES {
        tokio::task::spawn_blocking(move || {
            let plan = make_plan(&table, operation, endpoint, &headers, body);
            (plan, headers)
        })
        .await
        .map_err(|err| ApiError::unavailable(format!("routing task failed: {err}")))?
    } else {
        (
            make_plan(&table, operation, endpoint, &headers, body),
            headers,
        )
    };
    let plan = plan?;
    shared
        .metrics
        .decision_seconds
        .observe(arrived.elapsed().as_secs_f64());
    forward(
        shared,
        operation,
        &plan.endpoint,
        plan.variant_index,
        plan.ranking,
        headers,
        plan.body,
    )
    .await
}

/// Reads what routing needs from the headers and body, resolves the endpoint and variant,
/// ranks the instances, and rewrites `model` for the engine. CPU only.
fn make_plan(
    table: &RoutingTable,
    operation: Operation,
    mut endpoint: Option<Arc<EndpointRoute>>,
    headers: &HeaderMap,
    body: Bytes,
) -> Result<Plan, ApiError> {
    let mut prefix_aware_id = header_str(headers, &PREFIX_AWARE_ID)?.map(str::to_owned);
    if let Some(id) = &prefix_aware_id
        && !valid_prefix_aware_id(id.as_bytes())
    {
        return Err(ApiError::validation(format!(
            "header {PREFIX_AWARE_ID} must be 1-64 printable ASCII characters"
        )));
    }
    let mut target_variant = header_str(headers, &TARGET_VARIANT)?.map(str::to_owned);
    let session = header_str(headers, &SESSION_ID)?.map(|id| session_key(id.as_bytes()));

    // OpenAI bodies are parsed once: model, stream, prompt_cache_key, prefix text.
    let openai = match operation.api() {
        Api::OpenAi => Some(OpenAiRequest::parse(&body).map_err(|err| match err {
            switchyard_policy::openai::RequestError::Json(message) => {
                ApiError::validation(format!("the body is not valid JSON: {message}"))
            }
            switchyard_policy::openai::RequestError::Field { field, message } => {
                ApiError::validation(format!("'{field}' {message}")).with_param(field)
            }
        })?),
        Api::Native => None,
    };
    if let Some(openai) = &openai {
        if endpoint.is_none() {
            let model = openai.model.as_deref().ok_or_else(|| {
                ApiError::validation("'model' is required to choose an endpoint on /v1 paths")
                    .with_param("model")
            })?;
            let (found, variant) = table.resolve_model(model).ok_or_else(|| {
                ApiError::unknown_endpoint(format!(
                    "The model `{model}` does not exist (no endpoint or ModelName of that name)"
                ))
                .with_param("model")
            })?;
            if target_variant.is_none()
                && let Some(index) = variant
            {
                target_variant = Some(found.variants[index].name.to_string());
            }
            endpoint = Some(found);
        }
        if prefix_aware_id.is_none()
            && let Some(key) = &openai.prompt_cache_key
        {
            if !valid_prefix_aware_id(key.as_bytes()) {
                return Err(ApiError::validation(
                    "'prompt_cache_key' must be 1-64 printable ASCII characters",
                )
                .with_param("prompt_cache_key"));
            }
            prefix_aware_id = Some(key.to_string());
        }
    }
    let endpoint = endpoint.ok_or_else(|| ApiError::unknown_endpoint("no endpoint named"))?;
    let parsed = Parsed {
        body: body.clone(),
        prefix_aware_id,
        session,
        target_variant,
    };
    let (variant_index, ranking) = decide(&endpoint, &parsed, openai.as_ref())?;
    let variant = &endpoint.variants[variant_index];
    // The engine sees the variant's ModelName, whatever name the client used.
    let rewritten = match (&openai, &variant.model_name) {
        (Some(request), Some(model)) if request.model.as_deref() != Some(model.as_str()) => {
            Some(request.with_model(model))
        }
        _ => None,
    };
    drop(openai);
    Ok(Plan {
        body: rewritten.map(Bytes::from).unwrap_or(body),
        endpoint,
        variant_index,
        ranking,
    })
}

/// Chooses the variant and ranks its instances.
fn decide(
    endpoint: &EndpointRoute,
    parsed: &Parsed,
    openai: Option<&OpenAiRequest<'_>>,
) -> Result<(usize, rank::Ranking), ApiError> {
    let variant_index = match &parsed.target_variant {
        Some(name) => endpoint.variant(name).ok_or_else(|| {
            ApiError::validation(format!(
                "header {TARGET_VARIANT}: endpoint {} has no variant {name}",
                endpoint.name
            ))
        })?,
        None => {
            let servable: Vec<bool> = endpoint
                .variants
                .iter()
                .map(|variant| !variant.instances.is_empty())
                .collect();
            rank::choose_variant(&endpoint.weights, &servable, fastrand::u64(..)).ok_or_else(
                || {
                    ApiError::unavailable(format!(
                        "endpoint {} has no healthy instance",
                        endpoint.name
                    ))
                },
            )?
        }
    };
    let variant = &endpoint.variants[variant_index];
    if variant.instances.is_empty() {
        return Err(ApiError::unavailable(format!(
            "variant {} of endpoint {} has no healthy instance",
            variant.name, endpoint.name
        )));
    }
    let views = variant.current_views(now_ms());
    let load = |index: usize| variant.instances[index].cell.fleet_load();
    let ranking = match (parsed.session, variant.strategy) {
        (Some(session), _) => rank::session(&views, session),
        (None, Strategy::PrefixAware { .. }) => {
            let id = parsed.prefix_aware_id.as_deref().unwrap_or("").as_bytes();
            let key = match openai {
                Some(request) => {
                    routing_key(id, request.prefix_text(variant.prefix_length).as_bytes())
                }
                None => routing_key(id, native(&parsed.body, variant.prefix_length)),
            };
            rank::rank(variant.strategy, &views, load, key, 0)
        }
        (None, strategy) => rank::rank(strategy, &views, load, 0, fastrand::u64(..)),
    };
    Ok((variant_index, ranking))
}

fn is_hop_by_hop(name: &HeaderName) -> bool {
    matches!(
        name.as_str(),
        "connection"
            | "keep-alive"
            | "proxy-authenticate"
            | "proxy-authorization"
            | "proxy-connection"
            | "te"
            | "trailer"
            | "transfer-encoding"
            | "upgrade"
            | "host"
            | "content-length"
    )
}

fn upstream_request(
    uri: &http::Uri,
    client_headers: &HeaderMap,
    body: Bytes,
) -> http::Request<Full<Bytes>> {
    let mut request = http::Request::new(Full::new(body));
    *request.method_mut() = http::Method::POST;
    *request.uri_mut() = uri.clone();
    let headers = request.headers_mut();
    for (name, value) in client_headers {
        if !is_hop_by_hop(name) {
            headers.append(name.clone(), value.clone());
        }
    }
    headers
        .entry(header::CONTENT_TYPE)
        .or_insert(HeaderValue::from_static("application/json"));
    request
}

fn request_id(headers: &mut HeaderMap) {
    if !headers.contains_key(&REQUEST_ID) {
        let id = format!("{:016x}{:016x}", fastrand::u64(..), fastrand::u64(..));
        if let Ok(value) = HeaderValue::from_str(&id) {
            headers.insert(REQUEST_ID, value);
        }
    }
}

/// Tries the ranked candidates in order until one answers.
async fn forward(
    shared: &Shared,
    operation: Operation,
    endpoint: &EndpointRoute,
    variant_index: usize,
    ranking: rank::Ranking,
    mut client_headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let variant = &endpoint.variants[variant_index];
    request_id(&mut client_headers);
    let attempts = shared.settings.max_attempts.max(1);
    let mut last_error = String::new();
    for (attempt, &index) in ranking.order.iter().take(attempts).enumerate() {
        let instance = &variant.instances[index];
        let route_label = if attempt == 0 {
            ranking.route.unwrap_or(Route::Random).as_str()
        } else {
            "retry"
        };
        instance.cell.requests[if attempt == 0 {
            route_index(ranking.route.unwrap_or(Route::Random))
        } else {
            RETRY_INDEX
        }]
        .fetch_add(1, Ordering::Relaxed);
        let in_flight = InFlight::start(&instance.cell);
        let request = upstream_request(operation.upstream(instance), &client_headers, body.clone());
        let sent = Instant::now();
        let client = shared.clients.for_instance(instance.protocol);
        match client.request(request).await {
            Ok(response) => {
                shared
                    .metrics
                    .upstream_header_seconds
                    .observe(sent.elapsed().as_secs_f64());
                instance.cell.failures.store(0, Ordering::Relaxed);
                return respond(
                    operation,
                    response,
                    in_flight,
                    variant,
                    instance,
                    route_label,
                )
                .await;
            }
            Err(err) => {
                drop(in_flight);
                last_error = describe(&err);
                note_failure(shared, endpoint, instance, &last_error);
            }
        }
    }
    Err(ApiError {
        kind: "upstream_failed",
        ..ApiError::unavailable(format!(
            "no instance of endpoint {} could be reached (last error: {last_error})",
            endpoint.name
        ))
    })
}

fn describe(err: &hyper_util::client::legacy::Error) -> String {
    let mut innermost: &dyn std::error::Error = err;
    while let Some(inner) = innermost.source() {
        innermost = inner;
    }
    innermost.to_string()
}

fn note_failure(shared: &Shared, endpoint: &EndpointRoute, instance: &InstanceRoute, error: &str) {
    let failures = instance.cell.failures.fetch_add(1, Ordering::Relaxed) + 1;
    if failures >= shared.settings.eject_after_failures {
        let until = now_ms() + shared.settings.eject_for.as_millis() as u64;
        let previous = instance
            .cell
            .ejected_until_ms
            .swap(until, Ordering::Relaxed);
        if previous <= now_ms() {
            tracing::warn!(endpoint = %endpoint.name, instance = %instance.id, failures, error, eject_for = ?shared.settings.eject_for, "instance ejected locally after repeated failures");
        }
    } else {
        tracing::info!(endpoint = %endpoint.name, instance = %instance.id, error, "instance unreachable; trying the next candidate");
    }
}

async fn respond(
    operation: Operation,
    response: http::Response<hyper::body::Incoming>,
    in_flight: InFlight,
    variant: &VariantRoute,
    instance: &InstanceRoute,
    route_label: &'static str,
) -> Result<Response, ApiError> {
    let (mut parts, incoming) = response.into_parts();
    if operation.api() == Api::Native && !parts.status.is_success() {
        // SageMaker reports container errors as 424 ModelError with the original status.
        let status = parts.status;
        let collected = Limited::new(incoming, 64 * 1024).collect().await;
        drop(in_flight);
        let original = collected
            .map(|body| String::from_utf8_lossy(&body.to_bytes()).into_owned())
            .unwrap_or_default();
        let mut response = ApiError::model_error(format!(
            "Received server error ({}) from model with message \"{}\"",
            status.as_u16(),
            original
        ))
        .into_response_for(Api::Native);
        add_routing_headers(response.headers_mut(), variant, instance, route_label);
        return Ok(response);
    }
    for name in HOP_BY_HOP_RESPONSE {
        parts.headers.remove(name);
    }
    add_routing_headers(&mut parts.headers, variant, instance, route_label);
    let tracked = TrackedBody {
        inner: incoming,
        in_flight: Some(in_flight),
    };
    let body = if operation == Operation::InvocationsStream {
        // SageMaker's streaming invoke: each frame re-framed as a PayloadPart event.
        crate::eventstream::set_headers(&mut parts.headers);
        Body::new(crate::eventstream::PayloadParts::new(tracked))
    } else {
        Body::new(tracked)
    };
    Ok(Response::from_parts(parts, body))
}

/// Connection-level headers of an upstream response that must not be passed on (hyper frames
/// the body to the client itself).
const HOP_BY_HOP_RESPONSE: [HeaderName; 7] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
];

fn add_routing_headers(
    headers: &mut HeaderMap,
    variant: &VariantRoute,
    instance: &InstanceRoute,
    route_label: &'static str,
) {
    headers.insert(INVOKED_VARIANT, variant.name_header.clone());
    headers.insert(SWITCHYARD_INSTANCE, instance.id_header.clone());
    headers.insert(SWITCHYARD_ROUTE, HeaderValue::from_static(route_label));
}

/// `GET /v1/models`: every endpoint and every variant ModelName, for OpenAI clients.
pub fn list_models(table: &RoutingTable) -> Response {
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
        StatusCode::OK,
        axum::Json(serde_json::json!({"object": "list", "data": data})),
    )
        .into_response()
}
