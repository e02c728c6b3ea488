//! The respond phase: the client's answer from an instance's answer head. Who answered and
//! why (`x-amzn-invoked-production-variant`, `x-switchyard-*`), the hop-by-hop headers
//! removed, the body passed through as it streams (`stream`: the instance's in-flight count and
//! the request's admission held to its end, the idle deadline), re-framed as SageMaker's event
//! stream for a streaming invoke (`eventstream`), its response ids wrapped on the Responses
//! paths (`response_ids`); a native request's error status becomes SageMaker's 424
//! ModelError. Refusals and failures are `errors::ApiError`s, answered in the API's shape.

pub(crate) mod eventstream;
pub(crate) mod migrate;
pub(crate) mod response_ids;
mod stream;

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::response::Response;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http_body_util::BodyExt as _;

use crate::errors::{Api, ApiError, ErrorKind};
use crate::forward::upstream::strip_hop_by_hop;
use crate::forward::{Answered, InFlight};
use crate::headers;
use crate::observe::labels::RouteLabel;
use crate::observe::metrics::RouterMetrics;
use crate::observe::trace::RequestTrace;
use crate::operation::Operation;
use crate::request::worker::Worker;
use crate::routing::table::{InstanceRoute, VariantRoute};
use crate::server::admission::RequestPermit;
use migrate::{Migrating, Migration};
use stream::{DoneWatch, FirstFrame, LogIds, Stall, TrackedBody, is_event_stream};

/// What answering needs from the serving thread.
pub struct Responder<'a> {
    /// Longest gap between two frames of an answer.
    pub stream_idle: Duration,
    pub metrics: &'a Arc<RouterMetrics>,
    /// The request's spans, when tracing is on.
    pub trace: Option<&'a RequestTrace>,
    /// For a migrating answer's continuations.
    pub worker: &'a Arc<Worker>,
}

impl Responder<'_> {
    /// The client's answer from `answered`, for a request on `operation` whose headers were
    /// `client_headers`; the answer's body holds `permit` until it ends. With a `migration`,
    /// a streamed answer that breaks continues on another instance.
    pub async fn respond(
        &self,
        operation: Operation,
        answered: Answered,
        permit: RequestPermit,
        client_headers: &HeaderMap,
        migration: Option<Migration>,
    ) -> Response {
        let Answered {
            response,
            in_flight,
            endpoint,
            variant_index,
            instance_index,
            label,
            explain,
            time_first_frame,
            head_at,
            last_frame_at,
            cached_tokens,
            plain: _,
        } = answered;
        let variant = &endpoint.variants[variant_index];
        let instance = &variant.instances[instance_index];
        let (mut parts, incoming) = response.into_parts();
        let response = if operation.api() == Api::Native && !parts.status.is_success() {
            let mut response = self.model_error(parts, incoming, in_flight).await;
            add_routing_headers(
                response.headers_mut(),
                variant,
                instance,
                label,
                &explain,
                cached_tokens,
            );
            response
        } else {
            strip_hop_by_hop(&mut parts.headers);
            add_routing_headers(
                &mut parts.headers,
                variant,
                instance,
                label,
                &explain,
                cached_tokens,
            );
            // SageMaker's streaming invoke re-frames the answer as event-stream `PayloadPart`s;
            // a stall there ends with its own exception event, not an OpenAI error event.
            let sagemaker_stream = operation == Operation::InvocationsStream;
            let event_stream = is_event_stream(&parts.headers);
            let migration = migration.filter(|_| event_stream && parts.status.is_success());
            let stall = if event_stream && !sagemaker_stream && migration.is_none() {
                Stall::SseErrorEvent
            } else {
                Stall::Cut
            };
            // OpenAI's chat and completions streams end with `data: [DONE]`. Not read into:
            // SageMaker's paths (a container's own stream may end otherwise) and the Responses
            // API (its streams end with their own completed event).
            let ends_with_done = event_stream
                && matches!(
                    operation,
                    Operation::ChatCompletions | Operation::Completions
                );
            let sent = in_flight.sent();
            let mut tracked = TrackedBody {
                ids: LogIds {
                    request_id: client_headers.get(&headers::REQUEST_ID).cloned(),
                    trace_id: self.trace.map(RequestTrace::trace_id),
                },
                inner: Some(incoming),
                in_flight: Some(in_flight),
                permit: None,
                idle: self.stream_idle,
                last_frame: last_frame_at,
                timer: None,
                stall,
                metrics: Arc::clone(self.metrics),
                first_frame: Some(FirstFrame {
                    sent,
                    answered: head_at,
                    disaggregated_decode: time_first_frame,
                }),
                done: ends_with_done.then(DoneWatch::default),
                partial: bytes::BytesMut::new(),
            };
            let body = if let Some(migration) = migration {
                Body::new(Migrating::new(
                    tracked,
                    instance_index,
                    migration,
                    Arc::clone(self.worker),
                    client_headers.clone(),
                    permit,
                    self.trace.map(RequestTrace::for_continuations),
                ))
            } else {
                tracked.permit = Some(permit);
                if sagemaker_stream {
                    eventstream::set_headers(&mut parts.headers);
                    Body::new(eventstream::PayloadParts::new(tracked))
                } else {
                    Body::new(tracked)
                }
            };
            Response::from_parts(parts, body)
        };
        // Responses API: the ids in the answer name this instance.
        if operation.answers_with_response_ids() && response.status().is_success() {
            let issuer = response_ids::Issuer {
                endpoint: endpoint.name.to_string(),
                variant: variant.name.to_string(),
                instance: instance.id.to_string(),
            };
            return response_ids::adapt(response, issuer);
        }
        response
    }

    /// SageMaker reports a container's error status as 424 ModelError, with the original
    /// status, its message, and its `Retry-After` if it sent one.
    async fn model_error(
        &self,
        parts: http::response::Parts,
        incoming: crate::forward::refusal::UpstreamBody,
        in_flight: InFlight,
    ) -> Response {
        // The container's message, its first 64 KiB at most, read within the idle deadline.
        const MOST: usize = 64 * 1024;
        let mut message = Vec::new();
        let mut incoming = incoming;
        let _ = tokio::time::timeout(self.stream_idle, async {
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

/// Which variant and instance answered, and why; for a request ranked by the KV index, how
/// many leading prompt tokens that instance holds.
fn add_routing_headers(
    out: &mut HeaderMap,
    variant: &VariantRoute,
    instance: &InstanceRoute,
    label: RouteLabel,
    explain: &[(HeaderName, HeaderValue)],
    cached_tokens: Option<u32>,
) {
    out.insert(headers::INVOKED_VARIANT, variant.name_header.clone());
    out.insert(headers::INSTANCE, instance.id_header.clone());
    out.insert(headers::ROUTE, HeaderValue::from_static(label.as_str()));
    for (name, value) in explain {
        out.insert(name.clone(), value.clone());
    }
    if let Some(tokens) = cached_tokens {
        out.insert(headers::CACHED_TOKENS, HeaderValue::from(tokens));
    }
}
