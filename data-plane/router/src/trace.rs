//! OpenTelemetry spans of one request: the server span (continuing the client's W3C trace
//! context when it sent one), the routing decision under it, and a client span per upstream
//! attempt whose context goes to the engine in `traceparent`/`tracestate`.
//!
//! Tracing off, no [`RequestTrace`] exists and nothing here runs: the request path pays one
//! `Option` check per step.

use std::borrow::Cow;
use std::fmt;
use std::pin::Pin;
use std::task::{Context as TaskContext, Poll};

use bytes::Bytes;
use http::HeaderMap;
use http_body::Frame;
use opentelemetry::trace::{SpanKind, Status, TraceContextExt as _, TraceId, Tracer as _};
use opentelemetry::{Context, KeyValue};
use opentelemetry_sdk::trace::SdkTracer;
use switchyard_policy::rank::Strategy;
use switchyard_shared::telemetry::propagation;

use crate::forward::REQUEST_ID;
use crate::plan::Plan;
use crate::table::InstanceRoute;

/// The spans of one traced request.
#[derive(Debug)]
pub struct RequestTrace {
    tracer: SdkTracer,
    /// Holds the server span.
    cx: Context,
}

impl RequestTrace {
    /// Starts the server span, as a child of the client's span when the headers carry one.
    pub fn start(
        tracer: &SdkTracer,
        method: &http::Method,
        uri: &http::Uri,
        headers: &HeaderMap,
    ) -> Self {
        let parent = propagation::extract(headers);
        // Names and most values are static or shared text: a span costs no formatting.
        // OpenTelemetry's HTTP convention names a server span by its method alone when it
        // has no route template (a path would make every endpoint's name a span name).
        let method = method_name(method);
        let mut attributes = Vec::with_capacity(12);
        attributes.extend([
            KeyValue::new("http.request.method", method),
            KeyValue::new("url.path", bounded(uri.path())),
        ]);
        let span = tracer
            .span_builder(method)
            .with_kind(SpanKind::Server)
            .with_attributes(attributes)
            .start_with_context(tracer, &parent);
        Self {
            tracer: tracer.clone(),
            cx: parent.with_span(span),
        }
    }

    pub fn trace_id(&self) -> TraceId {
        self.cx.span().span_context().trace_id()
    }

    /// The routing decision's span (ended when the guard is dropped).
    pub fn decision(&self) -> SpanGuard {
        let span = self
            .tracer
            .span_builder("route")
            .with_kind(SpanKind::Internal)
            .start_with_context(&self.tracer, &self.cx);
        SpanGuard(Some(self.cx.with_span(span)))
    }

    /// Records what the plan decided on the server span.
    pub fn record_plan(&self, plan: &Plan) {
        let span = self.cx.span();
        if !span.is_recording() {
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
                plan.label == crate::table::RouteLabel::Overflow,
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
        if let Some(disaggregated) = &plan.disaggregated {
            attributes.push(KeyValue::new(
                "gen_ai.usage.input_tokens",
                disaggregated.count.tokens as i64,
            ));
        }
        span.set_attributes(attributes);
    }

    pub fn set_attribute(&self, attribute: KeyValue) {
        self.cx.span().set_attribute(attribute);
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
        let mut attributes = Vec::with_capacity(5);
        attributes.extend([
            KeyValue::new("switchyard.hop", hop),
            KeyValue::new("switchyard.instance", instance.id.shared()),
            KeyValue::new("server.address", uri.host().unwrap_or_default().to_owned()),
        ]);
        if let Some(port) = uri.port_u16() {
            attributes.push(KeyValue::new("server.port", i64::from(port)));
        }
        let span = self
            .tracer
            .span_builder(hop)
            .with_kind(SpanKind::Client)
            .with_attributes(attributes)
            .start_with_context(&self.tracer, &self.cx);
        let cx = self.cx.with_span(span);
        propagation::inject(&cx, headers);
        SpanGuard(Some(cx))
    }

    /// Ends the server span with the response status (on the response head: a streamed
    /// body keeps it open until it ends, through [`TracedBody`]).
    pub fn finish(self, status: http::StatusCode) -> SpanGuard {
        let span = self.cx.span();
        span.set_attribute(KeyValue::new(
            "http.response.status_code",
            i64::from(status.as_u16()),
        ));
        if status.is_server_error() {
            span.set_status(Status::error(Cow::Owned(status.to_string())));
        }
        SpanGuard(Some(self.cx))
    }
}

/// Ends its span when dropped.
#[derive(Debug, Default)]
pub struct SpanGuard(Option<Context>);

impl SpanGuard {
    pub fn fail(&self, error: impl fmt::Display) {
        if let Some(cx) = &self.0 {
            let span = cx.span();
            if span.is_recording() {
                span.set_status(Status::error(error.to_string()));
            }
        }
    }

    pub fn set_attribute(&self, attribute: KeyValue) {
        if let Some(cx) = &self.0 {
            cx.span().set_attribute(attribute);
        }
    }
}

impl Drop for SpanGuard {
    fn drop(&mut self) {
        if let Some(cx) = self.0.take() {
            cx.span().end();
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
