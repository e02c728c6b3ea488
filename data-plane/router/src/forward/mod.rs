//! The forward phase: try a plan's ranked candidates in order, under the retry rule and the
//! deadlines, until one answers with a response head (the respond phase makes the client's
//! answer of it); a disaggregated plan prefills first (`prefill`).
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

mod lmcache;
pub(crate) mod notices;
pub(crate) mod prefill;
pub(crate) mod refusal;
pub(crate) mod upstream;

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use bytes::Bytes;
use http::header::{HeaderMap, HeaderName, HeaderValue};
use http_body_util::Full;
use opentelemetry::KeyValue;
use tokio::time::Instant;

use crate::errors::ApiError;
use crate::headers::SERVING_RANK;
use crate::observe::labels::{RouteLabel, UpstreamError};
use crate::observe::metrics::RouterMetrics;
use crate::observe::trace::{RequestTrace, ShowTraceId, SpanGuard, request_id};
use crate::operation::Operation;
use crate::plan::Plan;
use crate::request::queue::FlowControl;
use crate::routing::cells::{InstanceCell, SlotClaim};
use crate::routing::table::{EndpointRoute, InstanceRoute};
use crate::server::admission::BufferReservation;
use upstream::{Failure, UpstreamClients, classify, upstream_request, upstream_uri, with_rank};

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
    /// `--decision-time-header`.
    pub decision_header: bool,
}

/// An instance's answer head, with what the client is told about who answered and why.
#[derive(Debug)]
pub struct Answered {
    pub response: http::Response<refusal::UpstreamBody>,
    /// The instance's in-flight count, held until the answer's body ends.
    pub in_flight: InFlight,
    pub endpoint: Arc<EndpointRoute>,
    pub variant_index: usize,
    pub instance_index: usize,
    /// `x-switchyard-route`.
    pub label: RouteLabel,
    /// Headers that explain the decision.
    pub explain: Vec<(HeaderName, HeaderValue)>,
    /// Time the answer's first frame (a disaggregated decode's TTFT).
    pub time_first_frame: bool,
    /// When the response head arrived (TTFT is timed from it), and the last frame forwarding
    /// read ahead of the client (the head's time if none): the stream's idle clock starts there.
    pub head_at: Instant,
    pub last_frame_at: Instant,
    /// KV_AWARE: the leading prompt tokens the index says the instance holds.
    pub cached_tokens: Option<u32>,
    /// The hop's plain body went instead of its hand-off (a decoder refused it): the answer
    /// is to the client's own request.
    pub plain: bool,
}

/// What forwarding needs from the serving thread.
pub struct Forwarder<'a> {
    pub clients: &'a UpstreamClients,
    pub settings: ForwardSettings,
    pub metrics: &'a Arc<RouterMetrics>,
    /// The request's spans, when tracing is on.
    pub trace: Option<&'a RequestTrace>,
    /// Flow control: a disaggregated request's decode hop waits here for its decoders' cap.
    pub flow: &'a FlowControl,
    /// LMCACHE_PD: where this router's "KV ready" notices arrive (`--lmcache-notice-bind`).
    pub notices: Option<&'a Arc<notices::NoticeBoard>>,
}

/// Decrements the instance's in-flight count exactly once, when dropped; ends the
/// attempt's span (when traced) with it.
#[derive(Debug)]
pub struct InFlight(
    Arc<InstanceCell>,
    SpanGuard,
    Instant,
    Option<u32>,
    // Held for its drop (the flow-control queue's count of the request's fairness id).
    Option<crate::routing::cells::Ticket>,
);

impl InFlight {
    /// Adds `attribute` to the attempt's span (nothing when it is not traced).
    pub fn annotate(&self, attribute: KeyValue) {
        self.1.set_attribute(attribute);
    }

    /// Counts the attempt, sent now: with the slot `claim` took for it when the claim is on
    /// this instance (else the claim's slot is freed).
    /// `rank`: the data-parallel rank it was sent to, counted in the cell's `rank_load`.
    fn start(
        cell: &Arc<InstanceCell>,
        span: SpanGuard,
        mut claim: Option<SlotClaim>,
        rank: Option<u32>,
    ) -> Self {
        // Held to the end even if the claim was another instance's: the request runs here.
        let ticket = claim.as_mut().and_then(SlotClaim::take_ticket);
        if !claim.is_some_and(|claim| claim.adopt(cell)) {
            cell.local.fetch_add(1, Ordering::Relaxed);
        }
        if let Some(rank) = rank {
            cell.rank_load.add(rank);
        }
        Self(Arc::clone(cell), span, Instant::now(), rank, ticket)
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        // The fairness id's count first: the queue woken below judges shares from it.
        drop(self.4.take());
        self.0.local.fetch_sub(1, Ordering::Relaxed);
        if let Some(rank) = self.3 {
            self.0.rank_load.sub(rank);
        }
        self.0.slot_freed();
    }
}

impl InFlight {
    /// When the attempt was sent.
    pub fn sent(&self) -> Instant {
        self.2
    }

    /// The instance's cell (its counters).
    pub fn cell(&self) -> &InstanceCell {
        &self.0
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
    /// KV_AWARE: the data-parallel rank to send to, by position in the variant.
    pub data_parallel_ranks: Vec<Option<u32>>,
    /// Flow control: the slot the queue took for the first candidate.
    pub claim: Option<SlotClaim>,
    /// A NIXL decode: the request without the hand-off, sent instead if a decoder refuses
    /// the hand-off before generating anything (`refusal`).
    pub plain_body: Option<Bytes>,
    /// The operation `plain_body` is for, when it is not the hop's own (an LMCACHE_PD decode
    /// goes over completions; the client's request may be chat).
    pub plain_operation: Option<Operation>,
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
            data_parallel_ranks: plan.data_parallel_ranks,
            claim: None,
            plain_body: None,
            plain_operation: None,
        }
    }
}

impl Forwarder<'_> {
    /// Forwards a plan: straight to its candidates, or prefill → decode when the plan says so.
    /// `claim`: the slot the queue phase took for the plan's first candidate (the first
    /// prefill candidate's, for a request that goes prefill → decode).
    pub async fn forward(
        &self,
        operation: Operation,
        mut plan: Plan,
        client_headers: &HeaderMap,
        reservation: BufferReservation,
        claim: Option<SlotClaim>,
    ) -> Result<Answered, ApiError> {
        match plan.prefill_hop.take() {
            Some(disaggregated) => {
                self.disaggregate(
                    operation,
                    plan,
                    disaggregated,
                    client_headers,
                    reservation,
                    claim,
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
                let hop = Hop {
                    claim,
                    ..plan.into()
                };
                self.send(operation, hop, client_headers, reservation).await
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
        claim: Option<SlotClaim>,
    ) -> Result<(http::Response<hyper::body::Incoming>, InFlight), Failure> {
        // Traced, the engine's parent is this attempt's span (not the client's).
        let span = match self.trace {
            Some(trace) => {
                let uri = request.uri().clone();
                trace.upstream(instance, &uri, hop, request.headers_mut())
            }
            None => SpanGuard::default(),
        };
        // The rank `with_rank` set, if any.
        let rank = request
            .headers()
            .get(crate::headers::DATA_PARALLEL_RANK)
            .and_then(|value| value.to_str().ok()?.parse().ok());
        let in_flight = InFlight::start(&instance.cell, span, claim, rank);
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
        reservation: BufferReservation,
    ) -> Result<Answered, ApiError> {
        let Hop {
            endpoint,
            variant_index,
            ranking,
            body,
            mut label,
            mut explain,
            mut time_first_frame,
            path,
            cached_tokens,
            data_parallel_ranks,
            mut claim,
            mut plain_body,
            mut plain_operation,
        } = hop;
        let mut operation = operation;
        let mut sent_plain = false;
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
        let mut order = ranking.order.iter().take(attempts).copied();
        // The same decoder once more, after it refused a hand-off.
        let mut again = None;
        // Set once an engine refused the data-parallel rank it was sent: no rank from then on.
        let mut rankless = false;
        while let Some(index) = again.take().or_else(|| order.next()) {
            let instance = &variant.instances[index];
            let Some((body, _)) = &held else {
                break;
            };
            let Some(uri) = upstream_uri(operation, path.as_deref(), instance) else {
                continue;
            };
            instance.cell.requests[label as usize].fetch_add(1, Ordering::Relaxed);
            let mut request =
                upstream_request(operation.method(), uri, client_headers, body.clone());
            let rank = if rankless {
                None
            } else {
                with_rank(&mut request, &data_parallel_ranks, index)
            };
            let attempt = self
                .attempt(
                    instance,
                    request,
                    self.settings.upstream_header,
                    hop,
                    claim.take(),
                )
                .await;
            let failure = match attempt {
                Ok((response, in_flight)) => {
                    let head_at = Instant::now();
                    let (response, last_frame_at) = if plain_body.is_some() {
                        match refusal::decoded(response, self.settings.stream_idle).await {
                            refusal::Decoded::Answer(response, last_frame) => {
                                (response, last_frame)
                            }
                            refusal::Decoded::Refused(why) => {
                                drop(in_flight);
                                // Recomputed by the decoder: no disaggregated decode to time.
                                time_first_frame = false;
                                if let (Some(plain), Some((body, _))) =
                                    (plain_body.take(), held.as_mut())
                                {
                                    *body = plain;
                                }
                                if let Some(plain) = plain_operation.take() {
                                    operation = plain;
                                }
                                sent_plain = true;
                                self.metrics.count_fallback("decode_refused_handoff");
                                tracing::warn!(request_id = request_id(client_headers), trace_id = %self.trace_id(), endpoint = %endpoint.name, instance = %instance.id, why, "the decoder refused the hand-off before any token (vLLM's kv_load_failure_policy \"fail\"); sending it the request without the hand-off");
                                label = RouteLabel::Fallback;
                                again = Some(index);
                                continue;
                            }
                        }
                    } else if rank.is_some() {
                        match refusal::rank_refused(response, self.settings.upstream_header).await {
                            Ok(response) => (response, head_at),
                            Err(why) => {
                                drop(in_flight);
                                rankless = true;
                                tracing::warn!(request_id = request_id(client_headers), trace_id = %self.trace_id(), endpoint = %endpoint.name, instance = %instance.id, why, "the engine refused the data-parallel rank it was sent (is KvEventsDataParallelSize larger than its --data-parallel-size?); sending the request again without X-data-parallel-rank");
                                again = Some(index);
                                continue;
                            }
                        }
                    } else {
                        (response.map(refusal::UpstreamBody::from), head_at)
                    };
                    drop(held.take());
                    if let Some(rank) = rank {
                        explain.push((SERVING_RANK, HeaderValue::from(rank)));
                    }
                    return Ok(Answered {
                        response,
                        in_flight,
                        cached_tokens: cached_tokens.get(index).copied(),
                        endpoint: Arc::clone(&endpoint),
                        variant_index,
                        instance_index: index,
                        label,
                        explain,
                        time_first_frame,
                        head_at,
                        last_frame_at,
                        plain: sent_plain,
                    });
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
}
