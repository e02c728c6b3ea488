//! Forwarding a plan: try the ranked candidates in order, under the retry rule and the
//! deadlines, and stream the answer back.
//!
//! The retry rule: a request moves on to the next candidate only when it provably never
//! reached an engine: the connection was refused or not made in time, an HTTP/2 stream was
//! refused, or a pooled connection was found closed before a byte was written. A failure
//! after the request was written (a reset, a connection closed before the response head) or
//! no response head within `--upstream-header-timeout-seconds` is answered to the client
//! (502 / 504) and not retried, since the engine may have done the work; `--retry-after-send`
//! allows one such retry.
//!
//! Architecture invariant: nothing here awaits the control plane, and no lock is held across
//! an `.await` (the table is an `ArcSwap` snapshot, load is atomics).

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http_body::Frame;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use switchyard_shared::InstanceProtocol;
use tokio::time::{Instant, Sleep};

use crate::admission::{BufferReservation, RequestPermit};
use crate::errors::{Api, ApiError, ErrorKind};
use crate::metrics::RouterMetrics;
use crate::plan::{Operation, Plan};
use crate::table::{
    EndpointRoute, InstanceCell, InstanceRoute, RouteLabel, UpstreamError, VariantRoute,
};
use crate::trace::{RequestTrace, ShowTraceId, SpanGuard, request_id};
use opentelemetry::KeyValue;

pub type HttpClient = Client<HttpConnector, Full<Bytes>>;

pub const INVOKED_VARIANT: HeaderName =
    HeaderName::from_static("x-amzn-invoked-production-variant");
pub const SWITCHYARD_INSTANCE: HeaderName = HeaderName::from_static("x-switchyard-instance");
pub const SWITCHYARD_ROUTE: HeaderName = HeaderName::from_static("x-switchyard-route");
/// KV_AWARE: leading prompt tokens the KV index says the serving instance holds.
pub const SWITCHYARD_CACHED_TOKENS: HeaderName =
    HeaderName::from_static("x-switchyard-cached-tokens");
pub const REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

/// How requests are forwarded (from the router's flags).
#[derive(Debug, Clone, Copy)]
pub struct ForwardSettings {
    /// Candidates tried per request (first choice included).
    pub max_attempts: usize,
    /// One retry on another instance after a failure that may have reached the engine.
    pub retry_after_send: bool,
    /// Consecutive connection failures before an instance is ejected locally.
    pub eject_after_failures: u32,
    pub eject_for: Duration,
    /// Longest wait for an instance's response head.
    pub upstream_header: Duration,
    /// Longest gap between two frames of an answer.
    pub stream_idle: Duration,
}

/// Who answered, and what the client is told about it.
struct Answer<'a> {
    variant: &'a VariantRoute,
    instance: &'a InstanceRoute,
    label: RouteLabel,
    explain: &'a [(HeaderName, HeaderValue)],
    time_first_frame: bool,
    /// The client's request (its id goes on the answer's log lines).
    client_headers: &'a HeaderMap,
    /// KV_AWARE: the leading prompt tokens the index says the instance holds.
    cached_tokens: Option<u32>,
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

/// What forwarding needs from the serving thread.
pub struct Forwarder<'a> {
    pub clients: &'a UpstreamClients,
    pub settings: ForwardSettings,
    pub metrics: &'a Arc<RouterMetrics>,
    /// The request's spans, when tracing is on.
    pub trace: Option<&'a RequestTrace>,
}

/// How one attempt failed.
#[derive(Debug)]
pub(crate) enum Failure {
    /// The request never reached an engine: safe to send elsewhere.
    NotSent(String),
    /// The connection failed after the request was (perhaps) written.
    AfterSend(String),
    /// No response head within the deadline.
    TimedOut,
}

/// Sorts a client error by whether the request can have reached the engine.
fn classify(err: &hyper_util::client::legacy::Error) -> Failure {
    let description = describe(err);
    if err.is_connect() {
        return Failure::NotSent(description);
    }
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(err);
    while let Some(current) = source {
        // hyper hands an unsent request back as "canceled" (a connection closed before
        // the request was written to it).
        if let Some(hyper_error) = current.downcast_ref::<hyper::Error>()
            && hyper_error.is_canceled()
        {
            return Failure::NotSent(description);
        }
        if let Some(h2_error) = current.downcast_ref::<h2::Error>()
            && h2_error.reason() == Some(h2::Reason::REFUSED_STREAM)
        {
            return Failure::NotSent(description);
        }
        source = current.source();
    }
    Failure::AfterSend(description)
}

fn describe(err: &hyper_util::client::legacy::Error) -> String {
    let mut innermost: &dyn std::error::Error = err;
    while let Some(inner) = innermost.source() {
        innermost = inner;
    }
    innermost.to_string()
}

/// Decrements the instance's in-flight count exactly once, when dropped; ends the
/// attempt's span (when traced) with it.
#[derive(Debug)]
pub(crate) struct InFlight(Arc<InstanceCell>, SpanGuard, Instant);

impl InFlight {
    /// Counts the attempt, sent now.
    fn start(cell: &Arc<InstanceCell>, span: SpanGuard) -> Self {
        cell.local.fetch_add(1, Ordering::Relaxed);
        Self(Arc::clone(cell), span, Instant::now())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.local.fetch_sub(1, Ordering::Relaxed);
    }
}

/// One hop of a request: where it may go, in order, what to send, and how to label it.
#[derive(Debug)]
pub struct Hop {
    pub endpoint: Arc<EndpointRoute>,
    pub variant_index: usize,
    pub ranking: switchyard_policy::rank::Ranking,
    pub body: Bytes,
    /// The first candidate's `x-switchyard-route`.
    pub label: RouteLabel,
    /// Headers for the client that explain the decision.
    pub explain: Vec<(HeaderName, HeaderValue)>,
    /// Time the answer's first frame (a disaggregated decode's TTFT).
    pub time_first_frame: bool,
    /// The path on the instance, for operations without a prepared URL.
    pub path: Option<String>,
    /// KV_AWARE: the leading prompt tokens each instance holds, by position in the variant.
    pub cached_tokens: Vec<u32>,
}

impl From<Plan> for Hop {
    fn from(plan: Plan) -> Self {
        Hop {
            endpoint: plan.endpoint,
            variant_index: plan.variant_index,
            ranking: plan.ranking,
            body: plan.body,
            label: plan.label,
            explain: plan.explain,
            time_first_frame: false,
            path: plan.path,
            cached_tokens: plan.cached_tokens,
        }
    }
}

impl Forwarder<'_> {
    /// Forwards a plan: straight to its candidates, or prefill → decode when the plan says so.
    pub async fn forward(
        &self,
        operation: Operation,
        mut plan: Plan,
        client_headers: HeaderMap,
        permit: RequestPermit,
        reservation: BufferReservation,
    ) -> Result<Response, ApiError> {
        match plan.disaggregated.take() {
            Some(disaggregated) => {
                self.disaggregate(
                    operation,
                    plan,
                    disaggregated,
                    client_headers,
                    permit,
                    reservation,
                )
                .await
            }
            None => {
                if plan.endpoint.disaggregation.is_some() {
                    match plan.label {
                        // Planned so: the prefill variant had no routable instance.
                        RouteLabel::Fallback => self.metrics.count_fallback("no_prefill_instance"),
                        label => self.metrics.count_disaggregation(label),
                    }
                }
                self.send(operation, plan.into(), &client_headers, permit, reservation)
                    .await
            }
        }
    }

    /// One attempt at one instance (`hop`: `forward`, `prefill` or `decode`, as its span
    /// says) with a request made by [`upstream_request`], within the response-head deadline
    /// `deadline`: its response head (with the instance's in-flight count held), or how it
    /// failed.
    pub(crate) async fn attempt(
        &self,
        instance: &InstanceRoute,
        mut request: http::Request<Full<Bytes>>,
        deadline: Duration,
        hop: &'static str,
    ) -> Result<(http::Response<hyper::body::Incoming>, InFlight), Failure> {
        // Traced, the engine's parent is this attempt's span (not the client's).
        let span = match self.trace {
            Some(trace) => {
                let uri = request.uri().clone();
                trace.upstream(instance, &uri, hop, request.headers_mut())
            }
            None => SpanGuard::default(),
        };
        let in_flight = InFlight::start(&instance.cell, span);
        let sent = in_flight.2;
        let client = self.clients.for_instance(instance.protocol);
        match tokio::time::timeout(deadline, client.request(request)).await {
            Ok(Ok(response)) => {
                self.metrics
                    .upstream_header_seconds
                    .observe(sent.elapsed().as_secs_f64());
                instance.cell.failures.store(0, Ordering::Relaxed);
                in_flight.1.set_attribute(KeyValue::new(
                    "http.response.status_code",
                    i64::from(response.status().as_u16()),
                ));
                if response.status().is_server_error() {
                    in_flight.1.fail(response.status());
                }
                Ok((response, in_flight))
            }
            Ok(Err(err)) => {
                let failure = classify(&err);
                if let Failure::NotSent(error) | Failure::AfterSend(error) = &failure {
                    in_flight.1.fail(error);
                }
                Err(failure)
            }
            Err(_elapsed) => {
                in_flight.1.fail("no response head in time");
                Err(Failure::TimedOut)
            }
        }
    }

    /// The trace id for log lines (empty when the request is not traced).
    pub(crate) fn trace_id(&self) -> ShowTraceId {
        ShowTraceId(self.trace.map(RequestTrace::trace_id))
    }

    /// Tries a hop's candidates in order until one answers, under the retry rule.
    pub(crate) async fn send(
        &self,
        operation: Operation,
        hop: Hop,
        client_headers: &HeaderMap,
        permit: RequestPermit,
        reservation: BufferReservation,
    ) -> Result<Response, ApiError> {
        let Hop {
            endpoint,
            variant_index,
            ranking,
            body,
            mut label,
            explain,
            time_first_frame,
            path,
            cached_tokens,
        } = hop;
        let variant = &endpoint.variants[variant_index];
        // The body and its reservation are held until a response head arrives (a retry may
        // need them), then released at once: a non-streaming answer can take minutes.
        let mut held = Some((body, reservation));
        // True once an attempt may have reached an engine: the final answer then says so,
        // not that nothing was sent.
        let mut maybe_delivered = false;
        let mut retry_after_send = self.settings.retry_after_send;
        // What to tell the client if no attempt succeeds: nothing was sent anywhere, or the
        // last attempt may have reached an engine.
        let mut outcome =
            ApiError::upstream_failed(format!("endpoint {} has no instance to try", endpoint.name));
        let attempts = self.settings.max_attempts.max(1);
        let hop = if endpoint.disaggregation.is_some() {
            "decode"
        } else {
            "forward"
        };
        for &index in ranking.order.iter().take(attempts) {
            let instance = &variant.instances[index];
            let Some((body, _)) = &held else {
                break;
            };
            let Some(uri) = upstream_uri(operation, path.as_deref(), instance) else {
                continue;
            };
            instance.cell.requests[label as usize].fetch_add(1, Ordering::Relaxed);
            let request = upstream_request(operation.method(), uri, client_headers, body.clone());
            let attempt = self
                .attempt(instance, request, self.settings.upstream_header, hop)
                .await;
            let failure = match attempt {
                Ok((response, in_flight)) => {
                    drop(held.take());
                    let answer = Answer {
                        variant,
                        instance,
                        label,
                        explain: &explain,
                        time_first_frame,
                        client_headers,
                        cached_tokens: cached_tokens.get(index).copied(),
                    };
                    let response = self
                        .respond(operation, response, in_flight, permit, answer)
                        .await?;
                    // Responses API: the ids in the answer name this instance.
                    if operation.answers_with_response_ids() && response.status().is_success() {
                        let issuer = crate::response_ids::Issuer {
                            endpoint: endpoint.name.to_string(),
                            variant: variant.name.to_string(),
                            instance: instance.id.to_string(),
                        };
                        return Ok(crate::response_ids::adapt(response, issuer));
                    }
                    return Ok(response);
                }
                Err(failure) => failure,
            };
            match failure {
                Failure::NotSent(error) => {
                    instance.cell.count_upstream(UpstreamError::Refused);
                    self.note_failure(&endpoint, instance, &error, client_headers);
                    if !maybe_delivered {
                        outcome = ApiError::upstream_failed(format!(
                            "no instance of endpoint {} could be reached (last error: {error})",
                            endpoint.name
                        ));
                    }
                    label = RouteLabel::Retry;
                }
                Failure::AfterSend(error) => {
                    instance.cell.count_upstream(UpstreamError::Reset);
                    self.note_failure(&endpoint, instance, &error, client_headers);
                    maybe_delivered = true;
                    tracing::warn!(request_id = request_id(client_headers), trace_id = %self.trace_id(), endpoint = %endpoint.name, instance = %instance.id, error, retry = retry_after_send, "connection failed after the request was sent");
                    outcome = ApiError::upstream_reset(format!(
                        "instance {} of endpoint {} failed after receiving the request ({error}); \
                         not retried, since it may have done the work",
                        instance.id, endpoint.name
                    ));
                    if !std::mem::take(&mut retry_after_send) {
                        return Err(outcome);
                    }
                    label = RouteLabel::RetryAfterSend;
                }
                Failure::TimedOut => {
                    instance.cell.count_upstream(UpstreamError::Timeout);
                    maybe_delivered = true;
                    let seconds = self.settings.upstream_header.as_secs();
                    tracing::warn!(request_id = request_id(client_headers), trace_id = %self.trace_id(), endpoint = %endpoint.name, instance = %instance.id, seconds, retry = retry_after_send, "no response head in time");
                    outcome = ApiError::upstream_timeout(format!(
                        "instance {} of endpoint {} sent no response within {seconds} s \
                         (--upstream-header-timeout-seconds)",
                        instance.id, endpoint.name
                    ));
                    if !std::mem::take(&mut retry_after_send) {
                        return Err(outcome);
                    }
                    label = RouteLabel::RetryAfterSend;
                }
            }
        }
        Err(outcome)
    }

    /// Counts a connection failure toward the instance's local ejection.
    pub(crate) fn note_failure(
        &self,
        endpoint: &EndpointRoute,
        instance: &InstanceRoute,
        error: &str,
        client_headers: &HeaderMap,
    ) {
        let (request_id, trace_id) = (request_id(client_headers), self.trace_id());
        let failures = instance.cell.failures.fetch_add(1, Ordering::Relaxed) + 1;
        if failures >= self.settings.eject_after_failures {
            let now = switchyard_process::clock::unix_ms();
            let until = now + self.settings.eject_for.as_millis() as u64;
            let previous = instance
                .cell
                .ejected_until_ms
                .swap(until, Ordering::Relaxed);
            if previous <= now {
                tracing::warn!(request_id, trace_id = %trace_id, endpoint = %endpoint.name, instance = %instance.id, failures, error, eject_for = ?self.settings.eject_for, "instance ejected locally after repeated failures");
            }
        } else {
            tracing::info!(request_id, trace_id = %trace_id, endpoint = %endpoint.name, instance = %instance.id, error, "instance connection failed");
        }
    }

    async fn respond(
        &self,
        operation: Operation,
        response: http::Response<hyper::body::Incoming>,
        in_flight: InFlight,
        permit: RequestPermit,
        answer: Answer<'_>,
    ) -> Result<Response, ApiError> {
        let Answer {
            variant,
            instance,
            label,
            explain,
            time_first_frame,
            client_headers,
            cached_tokens,
        } = answer;
        let (mut parts, incoming) = response.into_parts();
        if operation.api() == Api::Native && !parts.status.is_success() {
            let mut response = self.model_error(parts, incoming, in_flight).await;
            add_routing_headers(
                response.headers_mut(),
                variant,
                instance,
                label,
                explain,
                cached_tokens,
            );
            return Ok(response);
        }
        strip_hop_by_hop(&mut parts.headers);
        add_routing_headers(
            &mut parts.headers,
            variant,
            instance,
            label,
            explain,
            cached_tokens,
        );
        // SageMaker's streaming invoke re-frames the answer as event-stream `PayloadPart`s;
        // a stall there ends with its own exception event, not an OpenAI error event.
        let sagemaker_stream = operation == Operation::InvocationsStream;
        let stall = if is_event_stream(&parts.headers) && !sagemaker_stream {
            Stall::SseErrorEvent
        } else {
            Stall::Cut
        };
        let in_flight_sent = in_flight.2;
        let ids = LogIds {
            request_id: client_headers.get(&REQUEST_ID).cloned(),
            trace_id: self.trace.map(RequestTrace::trace_id),
        };
        let tracked = TrackedBody {
            ids,
            inner: Some(incoming),
            held: Some((in_flight, permit)),
            idle: self.settings.stream_idle,
            last_frame: Instant::now(),
            timer: None,
            stall,
            metrics: Arc::clone(self.metrics),
            first_frame: Some(FirstFrame {
                sent: in_flight_sent,
                answered: Instant::now(),
                disaggregated_decode: time_first_frame,
            }),
        };
        let body = if sagemaker_stream {
            crate::eventstream::set_headers(&mut parts.headers);
            Body::new(crate::eventstream::PayloadParts::new(tracked))
        } else {
            Body::new(tracked)
        };
        Ok(Response::from_parts(parts, body))
    }

    /// SageMaker reports a container's error status as 424 ModelError, with the original
    /// status, its message, and its `Retry-After` if it sent one.
    #[allow(clippy::too_many_arguments)]
    async fn model_error(
        &self,
        parts: http::response::Parts,
        incoming: hyper::body::Incoming,
        in_flight: InFlight,
    ) -> Response {
        // The container's message, its first 64 KiB at most, read within the idle deadline.
        const MOST: usize = 64 * 1024;
        let mut message = Vec::new();
        let mut incoming = incoming;
        let _ = tokio::time::timeout(self.settings.stream_idle, async {
            while message.len() < MOST {
                match incoming.frame().await {
                    Some(Ok(frame)) => {
                        if let Some(data) = frame.data_ref() {
                            message
                                .extend_from_slice(&data[..data.len().min(MOST - message.len())]);
                        }
                    }
                    _ => break,
                }
            }
        })
        .await;
        drop(incoming);
        drop(in_flight);
        // SageMaker's words: a 4xx is a client error of the container, a 5xx a server error.
        let side = if parts.status.is_client_error() {
            "client"
        } else {
            "server"
        };
        let mut error = ApiError::model_error(
            parts.status,
            format!(
                "Received {side} error ({}) from model with message \"{}\"",
                parts.status.as_u16(),
                String::from_utf8_lossy(&message)
            ),
        );
        error.retry_after = parts
            .headers
            .get(header::RETRY_AFTER)
            .cloned()
            .map(Box::new);
        self.metrics.error(ErrorKind::ModelError);
        error.into_response_for(Api::Native)
    }
}

/// The request's URL on `instance` (`path`: the plan's, for operations without a prepared
/// URL); `None`, logged, if the instance's URL cannot make one.
pub(crate) fn upstream_uri(
    operation: Operation,
    path: Option<&str>,
    instance: &InstanceRoute,
) -> Option<http::Uri> {
    let uri = match path {
        Some(path) => instance.uri_for(path),
        None => operation.upstream(instance).cloned(),
    };
    if uri.is_none() {
        tracing::warn!(instance = %instance.id, url = %instance.url, ?path, "cannot make the request's URL on this instance; skipping it");
    }
    uri
}

fn is_event_stream(headers: &HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|value| value.to_str().ok())
        .is_some_and(|value| value.trim_start().starts_with("text/event-stream"))
}

/// Headers that belong to one connection (RFC 9110 §7.6.1), plus those the router sets itself.
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
    )
}

/// The header names a `Connection:` header lists (they are hop-by-hop too).
fn connection_listed(headers: &HeaderMap) -> Vec<HeaderName> {
    headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|value| value.to_str().ok())
        .flat_map(|value| value.split(','))
        .filter_map(|name| HeaderName::from_bytes(name.trim().as_bytes()).ok())
        .collect()
}

/// Removes hop-by-hop headers from an upstream response, in place.
fn strip_hop_by_hop(headers: &mut HeaderMap) {
    for name in connection_listed(headers) {
        headers.remove(name);
    }
    for name in HOP_BY_HOP {
        headers.remove(name);
    }
}

const HOP_BY_HOP: [HeaderName; 7] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
];

pub(crate) fn upstream_request(
    method: http::Method,
    uri: http::Uri,
    client_headers: &HeaderMap,
    body: Bytes,
) -> http::Request<Full<Bytes>> {
    let has_body = !body.is_empty();
    let mut request = http::Request::new(Full::new(body));
    *request.method_mut() = method;
    *request.uri_mut() = uri;
    let listed = connection_listed(client_headers);
    let headers = request.headers_mut();
    for (name, value) in client_headers {
        let routers_own = name == header::HOST || name == header::CONTENT_LENGTH;
        if !routers_own && !is_hop_by_hop(name) && !listed.contains(name) {
            headers.append(name.clone(), value.clone());
        }
    }
    if has_body {
        headers
            .entry(header::CONTENT_TYPE)
            .or_insert(HeaderValue::from_static("application/json"));
    }
    request
}

pub(crate) fn ensure_request_id(headers: &mut HeaderMap) {
    if !headers.contains_key(&REQUEST_ID) {
        let id = format!("{:016x}{:016x}", fastrand::u64(..), fastrand::u64(..));
        if let Ok(value) = HeaderValue::from_str(&id) {
            headers.insert(REQUEST_ID, value);
        }
    }
}

/// Which variant and instance answered, and why; for a request ranked by the KV index, how
/// many leading prompt tokens that instance holds.
fn add_routing_headers(
    headers: &mut HeaderMap,
    variant: &VariantRoute,
    instance: &InstanceRoute,
    label: RouteLabel,
    explain: &[(HeaderName, HeaderValue)],
    cached_tokens: Option<u32>,
) {
    headers.insert(INVOKED_VARIANT, variant.name_header.clone());
    headers.insert(SWITCHYARD_INSTANCE, instance.id_header.clone());
    headers.insert(SWITCHYARD_ROUTE, HeaderValue::from_static(label.as_str()));
    for (name, value) in explain {
        headers.insert(name.clone(), value.clone());
    }
    if let Some(tokens) = cached_tokens {
        headers.insert(SWITCHYARD_CACHED_TOKENS, HeaderValue::from(tokens));
    }
}

/// What a stalled answer ends with.
#[derive(Debug, Clone, Copy)]
enum Stall {
    /// A streamed (SSE) answer gets a final error event, then ends without `[DONE]`.
    SseErrorEvent,
    /// Any other body is cut (the client sees an incomplete answer).
    Cut,
}

const STREAM_IDLE_EVENT: &str = "data: {\"error\":{\"message\":\"the instance sent nothing for longer than --stream-idle-timeout-seconds; the answer is incomplete\",\"type\":\"timeout\",\"param\":null,\"code\":\"stream_idle_timeout\"}}\n\n";

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The upstream response body, passed through frame by frame. It holds the instance's
/// in-flight count and the request's admission until the body ends, fails, stalls for the
/// idle deadline, or is dropped (the client went away; dropping the upstream body closes
/// the engine's connection, which cancels its work).
struct TrackedBody {
    /// `None` once the body ended, failed or stalled.
    inner: Option<hyper::body::Incoming>,
    held: Option<(InFlight, RequestPermit)>,
    idle: Duration,
    last_frame: Instant,
    /// Armed on the first wait; reset only when it fires early (frames arrived meanwhile).
    timer: Option<Pin<Box<Sleep>>>,
    stall: Stall,
    metrics: Arc<RouterMetrics>,
    /// When set, the time to the first data frame is observed (a disaggregated decode's TTFT).
    first_frame: Option<FirstFrame>,
    ids: LogIds,
}

/// A request's ids for the log lines of its answer.
struct LogIds {
    request_id: Option<HeaderValue>,
    trace_id: Option<opentelemetry::trace::TraceId>,
}

impl LogIds {
    fn request_id(&self) -> &str {
        self.request_id
            .as_ref()
            .and_then(|value| value.to_str().ok())
            .unwrap_or("")
    }
}

/// Timing the answer's first data frame (TTFT).
struct FirstFrame {
    /// The request sent upstream.
    sent: Instant,
    /// Its response head received.
    answered: Instant,
    /// Also a disaggregated decode's TTFT (from the head).
    disaggregated_decode: bool,
}

impl TrackedBody {
    fn end(&mut self) {
        self.inner = None;
        self.held = None;
        self.timer = None;
    }

    fn count_upstream(&self, kind: UpstreamError) {
        if let Some((in_flight, _)) = &self.held {
            in_flight.0.count_upstream(kind);
        }
    }

    /// True once the idle deadline passed with no frame.
    fn stalled(&mut self, cx: &mut Context<'_>) -> bool {
        let (idle, last_frame) = (self.idle, self.last_frame);
        let timer = self
            .timer
            .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(last_frame + idle)));
        loop {
            if timer.as_mut().poll(cx).is_pending() {
                return false;
            }
            let due = self.last_frame + idle;
            if Instant::now() >= due {
                return true;
            }
            timer.as_mut().reset(due);
        }
    }
}

impl http_body::Body for TrackedBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let this = self.get_mut();
        let Some(inner) = this.inner.as_mut() else {
            return Poll::Ready(None);
        };
        match Pin::new(&mut *inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                if frame.is_data()
                    && let Some(first) = this.first_frame.take()
                {
                    this.metrics
                        .upstream_ttft_seconds
                        .observe(first.sent.elapsed().as_secs_f64());
                    if first.disaggregated_decode {
                        this.metrics
                            .disaggregation_decode_ttft_seconds
                            .observe(first.answered.elapsed().as_secs_f64());
                    }
                }
                if http_body::Body::is_end_stream(inner) {
                    // hyper drops a body as soon as it is complete, without a last poll.
                    this.end();
                } else {
                    this.last_frame = Instant::now();
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(err))) => {
                this.count_upstream(UpstreamError::Reset);
                this.end();
                this.metrics.error(ErrorKind::UpstreamReset);
                tracing::warn!(request_id = this.ids.request_id(), trace_id = %ShowTraceId(this.ids.trace_id), error = %err, "the instance's answer failed midway");
                Poll::Ready(Some(Err(err.into())))
            }
            Poll::Ready(None) => {
                this.end();
                Poll::Ready(None)
            }
            Poll::Pending => {
                if !this.stalled(cx) {
                    return Poll::Pending;
                }
                this.count_upstream(UpstreamError::StreamIdle);
                this.end();
                this.metrics.error(ErrorKind::StreamIdleTimeout);
                tracing::warn!(request_id = this.ids.request_id(), trace_id = %ShowTraceId(this.ids.trace_id), idle = ?this.idle, "the instance's answer stalled; closing it");
                match this.stall {
                    Stall::SseErrorEvent => Poll::Ready(Some(Ok(Frame::data(Bytes::from_static(
                        STREAM_IDLE_EVENT.as_bytes(),
                    ))))),
                    // A timed-out I/O error: SageMaker's stream says
                    // ModelInvocationTimeExceeded for it.
                    Stall::Cut => Poll::Ready(Some(Err(Box::new(std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        "the instance's answer stalled (--stream-idle-timeout-seconds)",
                    ))))),
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner
            .as_ref()
            .is_none_or(|inner| inner.is_end_stream())
    }

    fn size_hint(&self) -> http_body::SizeHint {
        match &self.inner {
            Some(inner) => inner.size_hint(),
            None => http_body::SizeHint::default(),
        }
    }
}

impl Drop for TrackedBody {
    fn drop(&mut self) {
        if self
            .inner
            .as_ref()
            .is_some_and(|inner| !http_body::Body::is_end_stream(inner))
        {
            self.metrics.error(ErrorKind::ClientGone);
        }
    }
}

/// `GET /v1/models`: every endpoint and every variant ModelName, for OpenAI clients.
pub fn list_models(table: &crate::table::RoutingTable) -> Response {
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
    fn headers_named_by_connection_are_not_forwarded() {
        let mut client = HeaderMap::new();
        client.insert(header::CONNECTION, "keep-alive, X-Secret".parse().unwrap());
        client.insert("x-secret", "token".parse().unwrap());
        client.insert("x-kept", "yes".parse().unwrap());
        client.insert(header::HOST, "router".parse().unwrap());
        client.insert(header::TE, "trailers".parse().unwrap());
        let uri: http::Uri = "http://127.0.0.1:1/v1/completions".parse().unwrap();
        let request = upstream_request(http::Method::POST, uri, &client, Bytes::from("{}"));
        let sent = request.headers();
        assert!(sent.get("x-secret").is_none());
        assert!(sent.get(header::CONNECTION).is_none());
        assert!(sent.get(header::HOST).is_none());
        assert!(sent.get(header::TE).is_none());
        assert_eq!(sent["x-kept"], "yes");
        assert_eq!(sent[header::CONTENT_TYPE], "application/json");

        let mut upstream = HeaderMap::new();
        upstream.insert(header::CONNECTION, "x-hop".parse().unwrap());
        upstream.insert("x-hop", "1".parse().unwrap());
        upstream.insert(header::RETRY_AFTER, "3".parse().unwrap());
        strip_hop_by_hop(&mut upstream);
        assert!(upstream.get("x-hop").is_none());
        assert_eq!(upstream[header::RETRY_AFTER], "3");
    }

    #[test]
    fn the_idle_event_is_one_openai_error_event() {
        let data = STREAM_IDLE_EVENT
            .strip_prefix("data: ")
            .and_then(|rest| rest.strip_suffix("\n\n"))
            .unwrap();
        let json: serde_json::Value = serde_json::from_str(data).unwrap();
        assert_eq!(json["error"]["code"], "stream_idle_timeout");
        assert_eq!(json["error"]["type"], "timeout");
    }
}
