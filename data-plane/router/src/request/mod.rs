//! One request from arrival to answer, as a sequence of named phases over one context; this
//! module owns their order:
//!
//! 1. **read** (`read`): a `--max-in-flight` slot, the endpoint named by the path known, the
//!    body read within its limits, a request id made when the client sent none;
//! 2. **plan** (`crate::plan`, CPU only, large bodies and disaggregated endpoints on a
//!    blocking thread): where it goes, ranked, the body the engine gets;
//! 3. **settle** (`settle`): what needs the prompt's token ids (a KV index's ranking, the
//!    UNCACHED_TOKENS decision) gets them and is finished;
//! 4. **queue** (`queue`): a variant with MaxInFlightPerInstance lets a request go only
//!    with a slot at an instance below the cap, and holds it in a fair, prioritised queue
//!    meanwhile. It comes after settle so that the ranking a slot is taken from is final
//!    (a KV_AWARE ranking changes once the token ids are known), and a queued request holds
//!    its instance's slot only from the moment it is sent on;
//! 5. **forward** (`crate::forward`): attempts under the retry rule, one hop or prefill then
//!    decode, until an instance answers;
//! 6. **respond** (`crate::respond`): the client's answer. Every refusal on the way is
//!    answered in the shape of the API the request came in on.

pub(crate) mod local_tokens;
pub(crate) mod queue;
pub(crate) mod read;
mod settle;
pub(crate) mod tokenize;
pub(crate) mod worker;

pub use worker::Worker;

use std::sync::Arc;
use std::time::Instant;

use axum::extract::Request;
use axum::response::Response;
use bytes::Bytes;
use http::HeaderMap;
use opentelemetry::KeyValue;

use crate::errors::{ApiError, ErrorKind};
use crate::forward::Forwarder;
use crate::observe::metrics::RouterMetrics;
use crate::observe::trace::{RequestTrace, TracedBody, request_id};
use crate::operation::Operation;
use crate::plan::Planned;
use crate::plan::count::TokenCounters;
use crate::respond::Responder;
use crate::respond::migrate::Migration;
use crate::routing::table::{EndpointRoute, RoutingTable};
use crate::server::admission::{BufferReservation, RequestPermit};
use read::{OFFLOAD_BYTES, read_body};

/// Counts `client_gone` if the request is dropped before it was answered (hyper drops the
/// handler when the client's connection closes).
struct Unanswered<'a>(Option<&'a RouterMetrics>);

impl Drop for Unanswered<'_> {
    fn drop(&mut self) {
        if let Some(metrics) = self.0 {
            metrics.error(ErrorKind::ClientGone);
        }
    }
}

/// Handles one request on `operation`. `endpoint` is the path's endpoint name (`None` on the
/// plain `/v1/...` paths, where the body's `model` names it).
pub async fn handle(
    worker: Arc<Worker>,
    operation: Operation,
    endpoint: Option<String>,
    request: Request,
) -> Response {
    let mut unanswered = Unanswered(Some(&worker.metrics));
    let trace = worker.tracer.as_ref().map(|tracer| {
        RequestTrace::start(tracer, request.method(), request.uri(), request.headers())
    });
    let result = phases(&worker, operation, endpoint, request, trace.as_ref()).await;
    unanswered.0 = None;
    let response = result.unwrap_or_else(|err| {
        worker.metrics.error(err.kind);
        err.into_response_for(operation.api())
    });
    match trace {
        None => response,
        Some(trace) => {
            // The server span ends with the body (a stream ends long after its head).
            let span = trace.finish(response.status());
            response.map(|inner| axum::body::Body::new(TracedBody { inner, span }))
        }
    }
}

/// A request once read: what planning reads, and what it holds meanwhile.
struct Read {
    endpoint: Option<Arc<EndpointRoute>>,
    uri: http::Uri,
    headers: HeaderMap,
    body: Bytes,
    permit: RequestPermit,
    reservation: BufferReservation,
    table: Arc<RoutingTable>,
}

/// The phases, in order.
async fn phases(
    worker: &Arc<Worker>,
    operation: Operation,
    endpoint: Option<String>,
    request: Request,
    trace: Option<&RequestTrace>,
) -> Result<Response, ApiError> {
    let arrived = Instant::now();
    let read = read(worker, endpoint, request, trace).await?;
    let decision = trace.map(RequestTrace::decision);
    let Held {
        planned,
        headers,
        mut reservation,
        permit,
    } = plan(worker, operation, read).await?;
    let planned = planned.inspect_err(|err| {
        if let Some(decision) = &decision {
            decision.fail(&err.message);
        }
    })?;
    // The body now held is the plan's (the original is gone if `model` was rewritten).
    reservation.resize_to(planned.plan().body.len() as u64);
    let plan = settle::settle(worker, planned).await?;
    drop(decision);
    let decided = arrived.elapsed();
    worker
        .metrics
        .decision_seconds
        .observe(decided.as_secs_f64());
    // A queued request keeps its `--max-in-flight` slot and its body's reservation.
    let queue::Admitted {
        mut plan,
        claim,
        waited,
    } = worker.flow.admit(operation, plan).await?;
    let migration = Migration::prepare(operation, &mut plan);
    if let Some(trace) = trace {
        trace.record_plan(&plan);
        if let Some(waited) = waited.filter(|_| trace.is_recording()) {
            trace.set_attribute(KeyValue::new(
                "switchyard.queue_ms",
                waited.as_millis() as i64,
            ));
        }
    }
    let forwarder = Forwarder {
        clients: &worker.clients,
        settings: worker.forwarding,
        metrics: &worker.metrics,
        trace,
        flow: &worker.flow,
        notices: worker.notices.as_ref(),
    };
    let mut answered = forwarder
        .forward(operation, plan, &headers, reservation, claim)
        .await?;
    if worker.forwarding.decision_header {
        answered.explain.push((
            crate::headers::DECISION_US,
            http::HeaderValue::from(u64::try_from(decided.as_micros()).unwrap_or(u64::MAX)),
        ));
    }
    if let Some(waited) = waited {
        answered.explain.push((
            crate::headers::QUEUE_MS,
            http::HeaderValue::from(waited.as_millis() as u64),
        ));
    }
    let responder = Responder {
        stream_idle: worker.forwarding.stream_idle,
        metrics: &worker.metrics,
        trace,
        worker,
    };
    Ok(responder
        .respond(operation, answered, permit, &headers, migration)
        .await)
}

/// The read phase: a `--max-in-flight` slot (else 503), a routing state, the path's endpoint
/// (unknown endpoints are refused before the body is read), the body (`read_body`), and a
/// request id.
async fn read(
    worker: &Worker,
    endpoint_name: Option<String>,
    request: Request,
    trace: Option<&RequestTrace>,
) -> Result<Read, ApiError> {
    let (parts, body) = request.into_parts();
    let Some(permit) = worker.admission.request() else {
        read::refuse_unread(body, &parts.headers).await;
        return Err(ApiError::overloaded(format!(
            "the router has {} requests in flight (--max-in-flight); retry shortly",
            worker.admission.limits().max_in_flight
        )));
    };
    let table = worker.table.load_full();
    if table.version == 0 {
        return Err(ApiError::unavailable(
            "the router has no routing state yet (control plane not reached)",
        ));
    }
    let endpoint =
        match &endpoint_name {
            Some(name) => {
                Some(table.endpoints.get(name.as_str()).cloned().ok_or_else(|| {
                    ApiError::unknown_endpoint(format!("Endpoint {name} not found"))
                })?)
            }
            None => None,
        };
    let mut reservation = worker.admission.buffer();
    let body = read_body(
        body,
        &parts.headers,
        worker.client_body_deadline,
        &mut reservation,
    )
    .await?;
    let (uri, mut headers) = (parts.uri, parts.headers);
    read::ensure_request_id(&mut headers);
    if !worker.flow.trusts_headers() {
        headers.remove(crate::headers::PRIORITY);
        headers.remove(crate::headers::FAIRNESS_ID);
    }
    if let Some(trace) = trace.filter(|trace| trace.is_recording()) {
        trace.set_attribute(KeyValue::new(
            "switchyard.request_id",
            crate::observe::trace::bounded(request_id(&headers)),
        ));
    }
    Ok(Read {
        endpoint,
        uri,
        headers,
        body,
        permit,
        reservation,
        table,
    })
}

/// The plan phase, CPU only. Parsing a large JSON body takes long enough to hold up the
/// thread's other requests, and a disaggregated endpoint counts prompt tokens (milliseconds of
/// CPU, and maybe a tokenizer file to load): those are planned on a blocking thread, which
/// owns the body's reservation and the request's slot while it holds the body, so they are
/// released with it even if this request is dropped meanwhile. Hands back what it held, with
/// planning's own answer (an error there is the request's; the outer one, a failed task).
async fn plan(worker: &Worker, operation: Operation, read: Read) -> Result<Held, ApiError> {
    let counts_tokens = match &read.endpoint {
        Some(endpoint) => endpoint.disaggregation.is_some(),
        None => read
            .table
            .endpoints
            .values()
            .any(|endpoint| endpoint.disaggregation.is_some()),
    };
    let plan_it = move |read: Read, counters: &TokenCounters| {
        let request = crate::plan::Request {
            table: &read.table,
            operation,
            endpoint: read.endpoint.as_ref(),
            uri: &read.uri,
            headers: &read.headers,
        };
        let planned = crate::plan::plan(request, read.body, counters, &mut fastrand::Rng::new());
        Held {
            planned,
            headers: read.headers,
            reservation: read.reservation,
            permit: read.permit,
        }
    };
    if read.body.len() > OFFLOAD_BYTES || counts_tokens {
        let counters = Arc::clone(&worker.counters);
        tokio::task::spawn_blocking(move || plan_it(read, &counters))
            .await
            .map_err(|err| ApiError::unavailable(format!("routing task failed: {err}")))
    } else {
        Ok(plan_it(read, &worker.counters))
    }
}

/// What the plan phase hands back: its answer, and what the request holds meanwhile.
struct Held {
    planned: Result<Planned, ApiError>,
    headers: HeaderMap,
    reservation: BufferReservation,
    permit: RequestPermit,
}
