//! OpenTelemetry spans of one request: the server span (continuing the client's W3C trace
//! context when it sent one), the routing decision under it, and a client span per upstream
//! attempt whose context goes to the engine in `traceparent`/`tracestate`.
//!
//! The spans are made here, not through the SDK's tracer: each is one `SpanData` filled in
//! place (ids from a thread-local generator, static names and keys, shared values) and handed
//! to the export queue when it ends. Through the SDK (a builder, a sampler call, a context and
//! a locked span object each) the three spans of a request cost the router 11-20% more CPU per
//! request even with nothing exported. Sampling is the SDK's decision for the configured
//! sampler (`SamplerSetting::samples`). While the collector cannot be reached, spans are not
//! made at all (only counted as dropped); the trace context still goes to the engine.
//!
//! Tracing off, no [`RequestTrace`] exists and nothing here runs: the request path pays one
//! `Option` check per step.

use std::borrow::Cow;
use std::fmt;
use std::pin::Pin;
use std::sync::Mutex;
use std::task::{Context as TaskContext, Poll};
use std::time::SystemTime;

use bytes::Bytes;
use http::HeaderMap;
use http_body::Frame;
use opentelemetry::KeyValue;
use opentelemetry::trace::{
    SpanContext, SpanId, SpanKind, Status, TraceContextExt as _, TraceFlags, TraceId,
};
use opentelemetry_sdk::trace::{SpanData, SpanEvents, SpanLinks};
use switchyard_policy::rank::Strategy;
use switchyard_telemetry::{SpanSink, propagation};

use crate::headers::REQUEST_ID;
use crate::plan::Plan;
use crate::routing::table::InstanceRoute;

/// The spans of one traced request.
#[derive(Debug)]
pub struct RequestTrace {
    sink: SpanSink,
    /// The server span's context: its children's parent, and what logs show.
    context: SpanContext,
    /// Spans are made (sampled, and the collector reachable).
    recording: bool,
    /// The server span, until [`RequestTrace::finish`] hands it on.
    server: SpanGuard,
}

fn random_trace_id() -> TraceId {
    TraceId::from(fastrand::u128(1..))
}

fn random_span_id() -> SpanId {
    SpanId::from(fastrand::u64(1..))
}

impl RequestTrace {
    /// Starts the server span, as a child of the client's span when the headers carry one.
    pub fn start(
        sink: &SpanSink,
        method: &http::Method,
        uri: &http::Uri,
        headers: &HeaderMap,
    ) -> Self {
        let parent_cx = propagation::extract(headers);
        let parent = parent_cx.span().span_context().clone();
        let parent = parent.is_valid().then_some(parent);
        let trace_id = parent
            .as_ref()
            .map_or_else(random_trace_id, SpanContext::trace_id);
        let sampled = sink.samples(parent.as_ref(), trace_id);
        let context = SpanContext::new(
            trace_id,
            random_span_id(),
            if sampled {
                TraceFlags::SAMPLED
            } else {
                TraceFlags::default()
            },
            false,
            parent
                .as_ref()
                .map(|parent| parent.trace_state().clone())
                .unwrap_or_default(),
        );
        let recording = sampled && !sink.resting();
        let mut trace = Self {
            sink: sink.clone(),
            context,
            recording,
            server: SpanGuard::default(),
        };
        // Names and most values are static or shared text: a span costs no formatting.
        // OpenTelemetry's HTTP convention names a server span by its method alone when it
        // has no route template (a path would make every endpoint's name a span name).
        let method = method_name(method);
        let mut attributes = Vec::new();
        if recording {
            attributes.reserve(14);
            attributes.extend([
                KeyValue::new("http.request.method", method),
                KeyValue::new("url.path", bounded(uri.path())),
            ]);
        }
        trace.server = trace.span(
            trace.context.clone(),
            parent.as_ref().map(SpanContext::span_id),
            parent.as_ref().is_some_and(SpanContext::is_remote),
            SpanKind::Server,
            method,
            attributes,
        );
        trace
    }

    /// A span not made: counted as dropped when it would have been sampled (the collector
    /// cannot be reached).
    fn unrecorded(&self) -> SpanGuard {
        if self.context.is_sampled() {
            self.sink.dropped(1);
        }
        SpanGuard::default()
    }

    /// A span of this trace (`context` its own), or nothing when spans are not made.
    fn span(
        &self,
        context: SpanContext,
        parent: Option<SpanId>,
        parent_is_remote: bool,
        kind: SpanKind,
        name: &'static str,
        attributes: Vec<KeyValue>,
    ) -> SpanGuard {
        if !self.recording {
            return self.unrecorded();
        }
        let now = SystemTime::now();
        SpanGuard(Some(Box::new(Recording {
            sink: self.sink.clone(),
            span: Mutex::new(SpanData {
                span_context: context,
                parent_span_id: parent.unwrap_or(SpanId::INVALID),
                parent_span_is_remote: parent_is_remote,
                span_kind: kind,
                name: Cow::Borrowed(name),
                start_time: now,
                end_time: now,
                attributes,
                dropped_attributes_count: 0,
                events: SpanEvents::default(),
                links: SpanLinks::default(),
                status: Status::Unset,
                instrumentation_scope: self.sink.scope().clone(),
            }),
        })))
    }

    /// A child of the server span: its context, with the trace's flags and state.
    fn child_context(&self) -> SpanContext {
        SpanContext::new(
            self.context.trace_id(),
            random_span_id(),
            self.context.trace_flags(),
            false,
            self.context.trace_state().clone(),
        )
    }

    pub fn trace_id(&self) -> TraceId {
        self.context.trace_id()
    }

    /// A handle that makes more children of this request's server span after the request
    /// itself has been answered (a migrating stream's continuations, each an attempt span of
    /// its own); it holds no span of its own.
    pub fn for_continuations(&self) -> Self {
        Self {
            sink: self.sink.clone(),
            context: self.context.clone(),
            recording: self.recording,
            server: SpanGuard::default(),
        }
    }

    /// Whether this request's spans are made (attributes for them are worth building).
    pub fn is_recording(&self) -> bool {
        self.recording
    }

    /// The routing decision's span (ended when the guard is dropped).
    pub fn decision(&self) -> SpanGuard {
        if !self.recording {
            return self.unrecorded();
        }
        self.span(
            self.child_context(),
            Some(self.context.span_id()),
            false,
            SpanKind::Internal,
            "route",
            Vec::new(),
        )
    }

    /// Records what the plan decided on the server span.
    pub fn record_plan(&self, plan: &Plan) {
        if !self.server.is_recording() {
            return;
        }
        let variant = plan.variant();
        let mut attributes = Vec::with_capacity(10);
        attributes.extend([
            KeyValue::new("switchyard.endpoint", plan.endpoint.name.shared()),
            KeyValue::new("switchyard.variant", variant.name.shared()),
            KeyValue::new("switchyard.strategy", strategy_name(&variant.strategy)),
            KeyValue::new("switchyard.route", plan.label.as_str()),
            KeyValue::new(
                "switchyard.overflow",
                plan.label == crate::observe::labels::RouteLabel::Overflow,
            ),
        ]);
        if let Some(key) = plan.routing_key {
            // The first 32 bits of the routing key: enough to group requests that share a
            // prefix, short enough to read (never a metric label).
            attributes.push(KeyValue::new(
                "switchyard.routing_key",
                format!("{:08x}", key >> 32),
            ));
        }
        if let Some(model) = &variant.model_name {
            attributes.push(KeyValue::new("gen_ai.request.model", model.clone()));
        }
        if let Some(index) = plan.ranking.first() {
            attributes.push(KeyValue::new(
                "switchyard.instance",
                variant.instances[index].id.shared(),
            ));
        }
        if let Some(disaggregated) = &plan.prefill_hop {
            attributes.push(KeyValue::new(
                "gen_ai.usage.input_tokens",
                disaggregated.count.tokens as i64,
            ));
        }
        self.server.set_attributes(attributes);
    }

    pub fn set_attribute(&self, attribute: KeyValue) {
        self.server.set_attribute(attribute);
    }

    /// A client span for one upstream attempt (`hop`: `prefill`, `decode` or `forward`),
    /// and its context written into `headers` for the engine.
    pub fn upstream(
        &self,
        instance: &InstanceRoute,
        uri: &http::Uri,
        hop: &'static str,
        headers: &mut HeaderMap,
    ) -> SpanGuard {
        let context = self.child_context();
        propagation::inject_span_context(&context, headers);
        if !self.recording {
            return self.unrecorded();
        }
        let mut attributes = Vec::with_capacity(5);
        attributes.extend([
            KeyValue::new("switchyard.hop", hop),
            KeyValue::new("switchyard.instance", instance.id.shared()),
            KeyValue::new("server.address", uri.host().unwrap_or_default().to_owned()),
        ]);
        if let Some(port) = uri.port_u16() {
            attributes.push(KeyValue::new("server.port", i64::from(port)));
        }
        self.span(
            context,
            Some(self.context.span_id()),
            false,
            SpanKind::Client,
            hop,
            attributes,
        )
    }

    /// Ends the server span with the response status (on the response head: a streamed
    /// body keeps it open until it ends, through [`TracedBody`]).
    pub fn finish(self, status: http::StatusCode) -> SpanGuard {
        self.server.set_attribute(KeyValue::new(
            "http.response.status_code",
            i64::from(status.as_u16()),
        ));
        if status.is_server_error() {
            self.server.set_status(Status::error(status.to_string()));
        }
        self.server
    }
}

/// A span being recorded; handed to the export queue when it ends.
#[derive(Debug)]
struct Recording {
    sink: SpanSink,
    span: Mutex<SpanData>,
}

/// Ends its span when dropped (nothing when the span is not recorded).
#[derive(Debug, Default)]
pub struct SpanGuard(Option<Box<Recording>>);

impl SpanGuard {
    fn is_recording(&self) -> bool {
        self.0.is_some()
    }

    fn with_span(&self, change: impl FnOnce(&mut SpanData)) {
        if let Some(recording) = &self.0 {
            change(
                &mut recording
                    .span
                    .lock()
                    .unwrap_or_else(|poison| poison.into_inner()),
            );
        }
    }

    pub fn fail(&self, error: impl fmt::Display) {
        if self.is_recording() {
            self.set_status(Status::error(error.to_string()));
        }
    }

    /// Sets the status unless the span has a stronger one (Ok over Error over Unset, as the
    /// SDK orders them): a later body error does not replace a 5xx, nor anything replace Ok.
    fn set_status(&self, status: Status) {
        self.with_span(|span| {
            if status > span.status {
                span.status = status;
            }
        });
    }

    pub fn set_attribute(&self, attribute: KeyValue) {
        self.with_span(|span| span.attributes.push(attribute));
    }

    fn set_attributes(&self, attributes: Vec<KeyValue>) {
        self.with_span(|span| span.attributes.extend(attributes));
    }
}

impl Drop for SpanGuard {
    fn drop(&mut self) {
        if let Some(recording) = self.0.take() {
            let Recording { sink, span } = *recording;
            let mut span = span
                .into_inner()
                .unwrap_or_else(|poison| poison.into_inner());
            span.end_time = SystemTime::now();
            sink.push(span);
        }
    }
}

/// A response body that ends the server span with the body.
pub struct TracedBody {
    pub inner: axum::body::Body,
    pub span: SpanGuard,
}

impl http_body::Body for TracedBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut TaskContext<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        if let Poll::Ready(Some(Err(err))) = &polled {
            self.span.fail(err);
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

/// The request's `x-request-id` (for log lines; the router sets one when the client did not).
pub fn request_id(headers: &HeaderMap) -> &str {
    headers
        .get(&REQUEST_ID)
        .and_then(|value| value.to_str().ok())
        .unwrap_or("")
}

/// The trace id as logs show it (empty when the request is not traced).
pub struct ShowTraceId(pub Option<TraceId>);

impl fmt::Display for ShowTraceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Some(id) => write!(f, "{id}"),
            None => Ok(()),
        }
    }
}

/// At most [`MOST_VALUE_BYTES`] of a value the client chose (a path, a request id), cut at a
/// character boundary: a span stays small whatever the client sends, and a batch within
/// what collectors accept.
pub fn bounded(text: &str) -> String {
    let mut end = text.len().min(MOST_VALUE_BYTES);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text[..end].to_owned()
}

/// The longest attribute value taken from a request.
const MOST_VALUE_BYTES: usize = 256;

/// A method's name as static text (OpenTelemetry's `_OTHER` for one outside HTTP's set).
fn method_name(method: &http::Method) -> &'static str {
    match *method {
        http::Method::GET => "GET",
        http::Method::POST => "POST",
        http::Method::PUT => "PUT",
        http::Method::DELETE => "DELETE",
        http::Method::HEAD => "HEAD",
        http::Method::OPTIONS => "OPTIONS",
        http::Method::PATCH => "PATCH",
        http::Method::TRACE => "TRACE",
        http::Method::CONNECT => "CONNECT",
        _ => "_OTHER",
    }
}

fn strategy_name(strategy: &Strategy) -> &'static str {
    match strategy {
        Strategy::Random => "RANDOM",
        Strategy::LeastOutstandingRequests => "LEAST_OUTSTANDING_REQUESTS",
        Strategy::PrefixAware { .. } => "PREFIX_AWARE",
        Strategy::KvAware { .. } => "KV_AWARE",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_from_the_client_are_cut_at_a_character_boundary() {
        assert_eq!(bounded("/v1/chat/completions"), "/v1/chat/completions");
        let long = "é".repeat(200); // 400 bytes
        let cut = bounded(&long);
        assert!(cut.len() <= MOST_VALUE_BYTES && cut.len() >= MOST_VALUE_BYTES - 1);
        assert!(long.starts_with(&cut));
    }
}
