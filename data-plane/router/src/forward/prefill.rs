//! The second forwarding flow: a long prompt prefilled on one instance and decoded on another.
//!
//! With `NIXL` (vLLM's NixlConnector): the prefill copy of the request (`max_tokens: 1`,
//! `stream: false`, `kv_transfer_params.do_remote_decode: true`) goes to a prefill instance;
//! its answer's `kv_transfer_params` (engine, block ids, host, port) are copied into the
//! original request, which goes to a decoder, and the decoder's answer is relayed; the decoder
//! pulls the KV blocks itself, so any decoder may take it (a side channel reported as loopback
//! is named by the prefill instance's host instead). A decoder that refuses the hand-off
//! before any token (vLLM's `kv_load_failure_policy` "fail") gets the request again without
//! it (`super::refusal`). With `LMCACHE` (LMCache's PD
//! backend): the prefill copy carries no `kv_transfer_params`, the prefill instance pushes
//! the KV cache to the decoder its own LMCache config names, and the original request goes to
//! that decoder (the instance's registered decode partner).
//!
//! If the prefill cannot be done (no prefill instance reachable, an error status, no answer
//! within the config's `PrefillTimeoutSeconds`, no usable hand-off in the answer, no usable
//! partner, no room under `--max-buffered-bytes`), the decoder serves the whole request
//! (`x-switchyard-route: fallback`, counted by reason). The retry rule holds on both hops: a
//! prefill instance that provably never got the request is replaced by the next (and the
//! failure counts toward its ejection); one whose connection failed after the request was
//! sent gets the direct path's answer, 502 `upstream_reset`, and nothing is resent, not even
//! to a decoder (a prompt that crashes engines takes down one, not two) unless
//! `--retry-after-send`, where the decoder serves it whole; the decode hop is `forward`'s,
//! with its retries, deadlines and streaming. Dropping the request (the client left) cancels
//! whichever hop is running.
//!
//! Planning (on a blocking thread) removes any `kv_transfer_params` a client sent, on every
//! path, and makes the prefill copy (`plan::body`); this module sends it, reads the hand-off
//! from the prefill's answer and has it spliced into the decoder's request. A NIXL chat's
//! prefill answers with its prompt's ids (`return_token_ids`), which go into the hand-off as
//! `prompt_token_ids`: vLLM 0.32's decoder then serves those ids without rendering and
//! tokenizing the conversation again (an engine without that feature ignores them), and the
//! decoder's prompt is the one whose KV it pulls. An answer without them hands off as before.

use bytes::Bytes;
use http::HeaderMap;
use http::header::ACCEPT_ENCODING;
use http_body_util::BodyExt;
use serde_json::Value;
use serde_json::value::RawValue;
use switchyard_shared::KvTransferProtocol;
use tokio::time::Instant;

use super::upstream::{Failure, upstream_request, upstream_uri, with_rank};
use super::{Answered, Forwarder, Hop};
use crate::errors::ApiError;
use crate::headers::{DECODE_QUEUE_MS, PREFILL_CACHED_TOKENS, PREFILL_INSTANCE};
use crate::observe::labels::{RouteLabel, UpstreamError};
use crate::observe::trace::request_id;
use crate::operation::Operation;
use crate::plan::engine_body::with_kv_transfer_params;
use crate::plan::{Plan, PrefillHop};
use crate::routing::cells::SlotClaim;
use crate::routing::table::{Disaggregation, EndpointRoute, InstanceRoute, VariantRoute};
use crate::server::admission::BufferReservation;

/// The most of a prefill answer read (a one-token answer and its hand-off are small), and,
/// per byte of the prefill copy, what a chat's prompt ids may add (a token per byte at worst,
/// up to 11 bytes an id).
const MOST_PREFILL_ANSWER_BYTES: usize = 1 << 20;
const PROMPT_ID_BYTES_PER_BODY_BYTE: usize = 12;

/// Why a prefill was not used (the `reason` label of the fallback counter).
type FallbackReason = &'static str;

/// Why a request is not prefilled: the decoder serves it whole, or it ends with an error.
pub(super) enum NoPrefill {
    /// The decoder serves the whole request (`fallback`, counted by this reason).
    Fallback(FallbackReason),
    /// The answer to the client: a prefill engine failed after it may have read the request,
    /// which the retry rule does not resend (not to a decoder either).
    Fail(ApiError),
}

/// How reading a prefill answer's body went wrong.
enum ReadError {
    /// The connection failed mid-answer.
    Cut(String),
    TooLarge,
    /// Holding it would pass `--max-buffered-bytes`.
    BufferFull,
}

/// A prefill that succeeded: which instance, and the hand-off its answer carried (NIXL).
struct Prefilled {
    instance: usize,
    handoff: Option<Handoff>,
}

impl Forwarder<'_> {
    /// Prefill on the plan's prefill candidates, then decode on its decoders; or, if the
    /// prefill cannot be done, the decoders alone (`fallback`).
    pub(crate) async fn disaggregate(
        &self,
        operation: Operation,
        plan: Plan,
        mut disaggregated: PrefillHop,
        client_headers: &HeaderMap,
        mut reservation: BufferReservation,
        prefill_claim: Option<SlotClaim>,
    ) -> Result<Answered, ApiError> {
        let endpoint = std::sync::Arc::clone(&plan.endpoint);
        let Some(pd) = endpoint.disaggregation.as_ref() else {
            return self
                .send(operation, plan.into(), client_headers, reservation)
                .await;
        };
        if pd.protocol == KvTransferProtocol::LmcachePd {
            return self
                .disaggregate_lmcache(
                    operation,
                    plan,
                    disaggregated,
                    client_headers,
                    reservation,
                    prefill_claim,
                    self.notices,
                )
                .await;
        }
        let prefill_variant = &endpoint.variants[pd.prefill];
        let started = Instant::now();
        // A fallback frees the prefill slot the queue phase took at once (not at the answer).
        let prefilled = match disaggregated.prefill_body.take() {
            None => {
                drop(prefill_claim);
                Err(NoPrefill::Fallback("prefill_failed"))
            }
            // The prefill copy is held beside the body: both count against the bound.
            Some(copy) if !reservation.grow_within((plan.body.len() + copy.len()) as u64) => {
                drop((copy, prefill_claim));
                Err(NoPrefill::Fallback("buffer_full"))
            }
            Some(copy) => {
                let order = prefill_order(pd, &endpoint.variants[pd.decode], &disaggregated);
                if order.is_empty() {
                    drop(prefill_claim);
                    Err(NoPrefill::Fallback("no_decode_partner"))
                } else {
                    self.prefill(
                        operation,
                        &endpoint,
                        pd,
                        (&order, &disaggregated.prefill_ranks),
                        client_headers,
                        copy,
                        &mut reservation,
                        prefill_claim,
                    )
                    .await
                }
            }
        };
        let tokens = disaggregated.count.header_text();
        let flow = plan.flow;
        let mut hop = Hop::from(plan);
        let decided = match prefilled {
            Ok(prefilled) => {
                self.metrics
                    .disaggregation_prefill_seconds
                    .observe(started.elapsed().as_secs_f64());
                let handoff = Instant::now();
                let prefill_instance = &prefill_variant.instances[prefilled.instance];
                let decode_variant = &hop.endpoint.variants[pd.decode];
                let partner = usable_partner(pd, decode_variant, prefilled.instance);
                hand_off(&mut hop, pd, &prefilled, prefill_instance, partner).map(|()| {
                    hop.explain
                        .push((PREFILL_INSTANCE, prefill_instance.id_header.clone()));
                    if let Some(&cached) =
                        disaggregated.prefill_cached_tokens.get(prefilled.instance)
                    {
                        hop.explain
                            .push((PREFILL_CACHED_TOKENS, http::HeaderValue::from(cached)));
                    }
                    hop.label = RouteLabel::Disaggregated;
                    hop.time_first_frame = true;
                    self.metrics
                        .disaggregation_handoff_seconds
                        .observe(handoff.elapsed().as_secs_f64());
                    prefill_instance.id.to_string()
                })
            }
            Err(NoPrefill::Fallback(reason)) => Err(reason),
            Err(NoPrefill::Fail(error)) => return Err(error),
        };
        let refused = decided == Err(REFUSED);
        match decided {
            Ok(prefill_instance) => {
                self.metrics.count_disaggregation(RouteLabel::Disaggregated);
                tracing::info!(request_id = request_id(client_headers), trace_id = %self.trace_id(), endpoint = %hop.endpoint.name, prompt_tokens = %tokens, basis = pd.basis.as_str(), prefill_instance, protocol = pd.protocol.as_str(), "disaggregate=True: prefilled, decoding");
            }
            // A prefill that refused the request is counted once its decoder answered.
            Err(reason) if reason == REFUSED => hop.label = RouteLabel::Fallback,
            Err(reason) => {
                self.metrics.count_fallback(reason);
                hop.label = RouteLabel::Fallback;
                tracing::info!(request_id = request_id(client_headers), trace_id = %self.trace_id(), endpoint = %hop.endpoint.name, prompt_tokens = %tokens, basis = pd.basis.as_str(), reason, "disaggregate=False: the prefill could not be used; the decoder serves the whole request");
            }
        }
        // The request without the hand-off is held too, for a decoder that refuses it.
        let plain = hop.plain_body.as_ref().map_or(0, Bytes::len);
        reservation.resize_to((hop.body.len() + plain) as u64);
        // The decoders' own cap: the request waits for a decode slot now (for its partner
        // alone after an LMCACHE prefill, which pushed the KV cache there).
        let pinned =
            hop.label == RouteLabel::Disaggregated && pd.protocol == KvTransferProtocol::Lmcache;
        let endpoint_name = hop.endpoint.name.clone();
        let answered = self
            .decode(operation, hop, client_headers, reservation, flow, pinned)
            .await;
        if refused {
            // The request itself was refused only if the decoder refuses it too. A prefill
            // that refuses what its decoder serves failed: the pools differ (context length,
            // logprobs, KV cache) or the body made for the prefill is wrong.
            let status = match &answered {
                Ok(answered) => answered.response.status(),
                Err(error) => error.status,
            };
            if refused_as_invalid(status) {
                self.metrics.count_fallback(REFUSED);
            } else {
                tracing::warn!(request_id = request_id(client_headers), endpoint = %endpoint_name, %status, "the prefill refused a request its decoder served: the two pools differ, or the prefill's copy of the request is wrong");
                self.metrics.count_fallback("prefill_failed");
            }
        }
        answered
    }

    /// The decode hop: it waits for its decoders' cap (for the first decoder alone when
    /// `pinned`), then is sent.
    pub(super) async fn decode(
        &self,
        operation: Operation,
        mut hop: Hop,
        client_headers: &HeaderMap,
        reservation: BufferReservation,
        flow: crate::plan::flow::FlowKey,
        pinned: bool,
    ) -> Result<Answered, ApiError> {
        let endpoint = std::sync::Arc::clone(&hop.endpoint);
        let decode_variant = &endpoint.variants[hop.variant_index];
        if let Some((claim, waited)) = self
            .flow
            .slot(
                decode_variant,
                &endpoint,
                &mut hop.ranking.order,
                pinned,
                flow,
            )
            .await?
        {
            hop.claim = Some(claim);
            hop.explain.push((
                DECODE_QUEUE_MS,
                http::HeaderValue::from(waited.as_millis() as u64),
            ));
        }
        self.send(operation, hop, client_headers, reservation).await
    }

    /// Sends the prefill copy to the prefill candidates in `order`: the next one only when
    /// the previous one provably never got it. The answer's bytes are counted in
    /// `reservation` as they arrive.
    #[allow(clippy::too_many_arguments)] // the two hops' shared state, passed through once
    async fn prefill(
        &self,
        operation: Operation,
        endpoint: &EndpointRoute,
        pd: &Disaggregation,
        candidates: (&[usize], &[Option<u32>]),
        client_headers: &HeaderMap,
        body: Bytes,
        reservation: &mut BufferReservation,
        claim: Option<SlotClaim>,
    ) -> Result<Prefilled, NoPrefill> {
        let (index, answer, in_flight) = self
            .prefill_answer(
                operation,
                endpoint,
                pd,
                candidates,
                client_headers,
                body,
                reservation,
                claim,
            )
            .await?;
        drop(in_flight);
        let instance = &endpoint.variants[pd.prefill].instances[index];
        let handoff = match pd.protocol {
            KvTransferProtocol::Lmcache | KvTransferProtocol::LmcachePd => None,
            KvTransferProtocol::Nixl => {
                let params = if answer.len() > crate::request::read::OFFLOAD_BYTES {
                    tokio::task::spawn_blocking(move || handoff_in(&answer))
                        .await
                        .unwrap_or(Err("the answer could not be read"))
                } else {
                    handoff_in(&answer)
                };
                match params {
                    Ok(handoff) => Some(handoff),
                    Err(why) => {
                        tracing::warn!(instance = %instance.id, why, "the prefill answer has no usable kv_transfer_params (is the engine started with a NixlConnector kv-transfer-config?)");
                        return Err(NoPrefill::Fallback("bad_handoff"));
                    }
                }
            }
        };
        Ok(Prefilled {
            instance: index,
            handoff,
        })
    }

    /// Sends the prefill copy to the prefill candidates in `order` (the next one only when
    /// the previous one provably never got it) and reads the successful answer: which
    /// instance, its body (counted in `reservation` as it arrives) and its in-flight count.
    #[allow(clippy::too_many_arguments)] // the two hops' shared state, passed through once
    pub(super) async fn prefill_answer(
        &self,
        operation: Operation,
        endpoint: &EndpointRoute,
        pd: &Disaggregation,
        (order, ranks): (&[usize], &[Option<u32>]),
        client_headers: &HeaderMap,
        body: Bytes,
        reservation: &mut BufferReservation,
        mut claim: Option<SlotClaim>,
    ) -> Result<(usize, Bytes, super::InFlight), NoPrefill> {
        let headers = prefill_headers(client_headers);
        let variant = &endpoint.variants[pd.prefill];
        let held = reservation.bytes();
        let attempts = self.settings.max_attempts.max(1);
        for &index in order.iter().take(attempts) {
            let instance = &variant.instances[index];
            let failed_after_send =
                |error| self.failed_after_send(endpoint, variant, instance, error, client_headers);
            instance.cell.requests[RouteLabel::Disaggregated as usize]
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let Some(uri) = upstream_uri(operation, None, instance) else {
                continue;
            };
            let deadline = pd.prefill_timeout;
            let claim = claim.take();
            let answer = tokio::time::timeout(deadline, async {
                let mut request = upstream_request(operation.method(), uri, &headers, body.clone());
                with_rank(&mut request, ranks, index);
                let (response, in_flight) = self
                    .attempt(instance, request, deadline, "prefill", claim)
                    .await?;
                let status = response.status();
                let most = most_answer_bytes(&body);
                let read = read_answer(response.into_body(), reservation, held, most).await;
                Ok::<_, Failure>((status, read, in_flight))
            })
            .await;
            let (status, answer, in_flight) = match answer {
                Ok(Ok(answer)) => answer,
                Ok(Err(Failure::NotSent(error))) => {
                    instance.cell.count_upstream(UpstreamError::Refused);
                    self.note_failure(endpoint, instance, &error, client_headers);
                    tracing::info!(request_id = request_id(client_headers), trace_id = %self.trace_id(), instance = %instance.id, error, "prefill instance unreachable; trying the next");
                    continue;
                }
                Ok(Err(Failure::AfterSend(error))) => {
                    return Err(failed_after_send(error));
                }
                Ok(Err(Failure::TimedOut)) | Err(_) => {
                    instance.cell.count_upstream(UpstreamError::Timeout);
                    tracing::warn!(instance = %instance.id, ?deadline, "prefill took longer than PrefillTimeoutSeconds");
                    return Err(NoPrefill::Fallback("prefill_timeout"));
                }
            };
            if refused_as_invalid(status) {
                // Likely the request itself (a client's field out of range, a prompt past the
                // context): the decoder serves it, and which it was is told by its answer.
                tracing::debug!(instance = %instance.id, %status, "prefill refused the request");
                return Err(NoPrefill::Fallback(REFUSED));
            }
            if !status.is_success() {
                tracing::warn!(instance = %instance.id, %status, "prefill answered an error");
                return Err(NoPrefill::Fallback("prefill_failed"));
            }
            let answer = match answer {
                Ok(answer) => answer,
                Err(ReadError::Cut(error)) => {
                    return Err(failed_after_send(error));
                }
                Err(ReadError::TooLarge) => {
                    tracing::warn!(instance = %instance.id, most = most_answer_bytes(&body), "the prefill answer is too large");
                    return Err(NoPrefill::Fallback("prefill_failed"));
                }
                Err(ReadError::BufferFull) => return Err(NoPrefill::Fallback("buffer_full")),
            };
            return Ok((index, answer, in_flight));
        }
        Err(NoPrefill::Fallback("prefill_unreachable"))
    }

    /// A prefill instance failed after it may have read the request: counted toward its
    /// ejection, and, by the retry rule, the request is not sent again (the decoder would
    /// redo the same work) unless `--retry-after-send`, where the decoder serves it whole.
    fn failed_after_send(
        &self,
        endpoint: &EndpointRoute,
        variant: &VariantRoute,
        instance: &InstanceRoute,
        error: String,
        client_headers: &HeaderMap,
    ) -> NoPrefill {
        instance.cell.count_upstream(UpstreamError::Reset);
        self.note_failure(endpoint, instance, &error, client_headers);
        let retry = self.settings.retry_after_send;
        tracing::warn!(request_id = request_id(client_headers), trace_id = %self.trace_id(), variant = %variant.name, instance = %instance.id, error, retry, "prefill failed after the request was sent");
        if retry {
            return NoPrefill::Fallback("prefill_failed");
        }
        NoPrefill::Fail(ApiError::upstream_reset(format!(
            "prefill instance {} (variant {} of endpoint {}) failed after receiving the \
             request ({error}); not retried, since it may have done the work",
            instance.id, variant.name, endpoint.name
        )))
    }
}
/// The client's headers for the prefill copy: all but `Accept-Encoding` (the router reads
/// the answer, so it must not come encoded). `X-Request-Id` stays: both hops carry it.
fn prefill_headers(client_headers: &HeaderMap) -> HeaderMap {
    let mut headers = client_headers.clone();
    headers.remove(ACCEPT_ENCODING);
    headers
}

/// The prefill candidates to try, in the plan's order. With LMCACHE only those whose decode
/// partner is routable and not ejected here: the KV cache is pushed to the partner, so a
/// prefill without one is work for nothing.
fn prefill_order(
    pd: &Disaggregation,
    decode: &VariantRoute,
    disaggregated: &PrefillHop,
) -> Vec<usize> {
    let order = disaggregated.prefill.order.iter().copied();
    match pd.protocol {
        KvTransferProtocol::Nixl | KvTransferProtocol::LmcachePd => order.collect(),
        KvTransferProtocol::Lmcache => order
            .filter(|&index| usable_partner(pd, decode, index).is_some())
            .collect(),
    }
}

/// The decode partner of prefill instance `prefill` (an index into the decode variant), if
/// it is routable and not ejected here.
fn usable_partner(pd: &Disaggregation, decode: &VariantRoute, prefill: usize) -> Option<usize> {
    let partner = pd.partners.get(prefill).copied().flatten()?;
    decode
        .instances
        .get(partner)?
        .cell
        .available(switchyard_process::clock::unix_ms())
        .then_some(partner)
}

/// The most of an answer to the prefill copy `body` read: [`MOST_PREFILL_ANSWER_BYTES`], and
/// room for the prompt's ids when the copy asks for them (`return_token_ids`, which only the
/// router sets: a client's text holding those bytes would have its quotes escaped).
fn most_answer_bytes(body: &[u8]) -> usize {
    const ASKED: &[u8] = br#""return_token_ids":true"#;
    let asked = body.windows(ASKED.len()).any(|window| window == ASKED);
    MOST_PREFILL_ANSWER_BYTES
        + if asked {
            body.len().saturating_mul(PROMPT_ID_BYTES_PER_BODY_BYTE)
        } else {
            0
        }
}

/// Reads a prefill answer's body, at most `most` bytes, counting what it holds in
/// `reservation` on top of the `held` bytes.
async fn read_answer(
    mut body: hyper::body::Incoming,
    reservation: &mut BufferReservation,
    held: u64,
    most: usize,
) -> Result<Bytes, ReadError> {
    let mut answer = Vec::new();
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|err| ReadError::Cut(err.to_string()))?;
        let Ok(data) = frame.into_data() else {
            continue;
        };
        let total = answer.len() + data.len();
        if total > most {
            return Err(ReadError::TooLarge);
        }
        if !reservation.grow_within(held + total as u64) {
            return Err(ReadError::BufferFull);
        }
        answer.extend_from_slice(&data);
    }
    Ok(Bytes::from(answer))
}

/// A NIXL prefill's hand-off: its `kv_transfer_params`, and a chat's prompt ids as the answer
/// wrote them (spliced into the decoder's `kv_transfer_params` as they are, not held as
/// parsed values).
#[derive(Debug)]
struct Handoff {
    params: Value,
    prompt_token_ids: Option<Box<RawValue>>,
}

/// The hand-off in a NIXL prefill answer: its `kv_transfer_params`, which must say
/// `do_remote_prefill: true` and name the engine (`remote_engine_id`) and the blocks
/// (`remote_block_ids`) a decoder is to pull, and the answer's `prompt_token_ids` (a chat's,
/// asked for with `return_token_ids`) when it is what vLLM's decoder takes: a non-empty list
/// of non-negative integers (anything else is left out, and the decoder renders the prompt).
fn handoff_in(answer: &[u8]) -> Result<Handoff, &'static str> {
    #[derive(serde::Deserialize)]
    struct Answer<'a> {
        kv_transfer_params: Option<Value>,
        #[serde(default, borrow)]
        prompt_token_ids: Option<&'a RawValue>,
    }
    let answer =
        serde_json::from_slice::<Answer>(answer).map_err(|_| "the answer is not a JSON object")?;
    let params = answer
        .kv_transfer_params
        .ok_or("the answer has no kv_transfer_params")?;
    if params.get("do_remote_prefill") != Some(&Value::Bool(true)) {
        return Err("kv_transfer_params.do_remote_prefill is not true");
    }
    if !params.get("remote_engine_id").is_some_and(Value::is_string) {
        return Err("kv_transfer_params.remote_engine_id is not a string");
    }
    if !params.get("remote_block_ids").is_some_and(Value::is_array) {
        return Err("kv_transfer_params.remote_block_ids is not an array");
    }
    let prompt_token_ids = answer
        .prompt_token_ids
        .filter(|ids| serde_json::from_str::<Vec<u32>>(ids.get()).is_ok_and(|ids| !ids.is_empty()))
        .map(ToOwned::to_owned);
    Ok(Handoff {
        params,
        prompt_token_ids,
    })
}

/// Turns the decode hop into the hand-off's: NIXL puts the prefill's `kv_transfer_params`
/// into the request (any decoder may pull); LMCACHE sends it to the prefill instance's decode
/// partner first (where the KV cache was pushed), if that is still usable.
fn hand_off(
    hop: &mut Hop,
    pd: &Disaggregation,
    prefilled: &Prefilled,
    prefill_instance: &InstanceRoute,
    partner: Option<usize>,
) -> Result<(), FallbackReason> {
    match pd.protocol {
        KvTransferProtocol::Nixl => {
            let handoff = prefilled.handoff.as_ref().ok_or("bad_handoff")?;
            let mut params = handoff.params.clone();
            reachable_side_channel(&mut params, &prefill_instance.url);
            let ids = handoff.prompt_token_ids.as_deref();
            let handed = with_kv_transfer_params(&hop.body, &params, ids).ok_or("bad_handoff")?;
            hop.plain_body = Some(std::mem::replace(&mut hop.body, handed));
            Ok(())
        }
        KvTransferProtocol::Lmcache => {
            let partner = partner.ok_or("no_decode_partner")?;
            let order = &mut hop.ranking.order;
            order.retain(|&index| index != partner);
            order.insert(0, partner);
            // LMCache pushed the KV to the decoder it chose, not to the rank the decode
            // pool's index would name: the engine picks the rank.
            hop.data_parallel_ranks.clear();
            Ok(())
        }
        // Its own flow (`super::lmcache`).
        KvTransferProtocol::LmcachePd => Err("bad_handoff"),
    }
}

/// vLLM's prefiller listens for NIXL handshakes on `VLLM_NIXL_SIDE_CHANNEL_HOST` and reports
/// that same host in its hand-off (`localhost` unless set). An unspecified address (`0.0.0.0`,
/// `::`: it listens on every interface) is no address to dial, so the prefill instance URL's
/// host takes its place (the port is kept). A loopback host is kept: the listener is bound to
/// loopback, so only a decoder on the same host can reach it, and dialling the instance's
/// outside address would find nothing there; when the instance URL is not loopback, that is
/// logged once, since decoders on other hosts will fail the pull.
fn reachable_side_channel(params: &mut Value, instance_url: &str) {
    static WARNED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    let Some(reported) = params.get("remote_host").and_then(Value::as_str) else {
        return;
    };
    let Some(instance_host) = instance_url.parse::<http::Uri>().ok().and_then(|uri| {
        uri.host()
            .map(|host| host.trim_matches(['[', ']']).to_owned())
    }) else {
        return;
    };
    let reported = host_kind(reported);
    if reported == HostKind::Unspecified {
        params["remote_host"] = Value::String(instance_host);
    } else if reported == HostKind::Loopback
        && host_kind(&instance_host) != HostKind::Loopback
        && !WARNED.swap(true, std::sync::atomic::Ordering::Relaxed)
    {
        tracing::warn!(
            instance_url,
            "a NIXL prefiller reports a loopback side channel (vLLM's VLLM_NIXL_SIDE_CHANNEL_HOST \
             is unset or loopback): only decoders on its own host can pull its hand-offs; set it \
             to an address the decoders reach, or 0.0.0.0 (logged once)"
        );
    }
}

#[derive(Debug, PartialEq, Eq)]
enum HostKind {
    Loopback,
    Unspecified,
    Other,
}

fn host_kind(host: &str) -> HostKind {
    let host = host.trim_matches(['[', ']']);
    match host.parse::<std::net::IpAddr>() {
        Ok(ip) if ip.is_unspecified() => HostKind::Unspecified,
        Ok(ip) if ip.is_loopback() => HostKind::Loopback,
        Ok(_) => HostKind::Other,
        Err(_) if host.eq_ignore_ascii_case("localhost") => HostKind::Loopback,
        Err(_) => HostKind::Other,
    }
}

/// The fallback reason of a prefill that refused the request as invalid ([`refused_as_invalid`]),
/// when its decoder refuses it too.
const REFUSED: &str = "prefill_refused";

/// An engine's refusal of the request as invalid (vLLM answers 400 for what its request
/// model or sampling parameters refuse; 422 is FastAPI's for a body it cannot read), as opposed
/// to the engine failing.
fn refused_as_invalid(status: http::StatusCode) -> bool {
    matches!(
        status,
        http::StatusCode::BAD_REQUEST | http::StatusCode::UNPROCESSABLE_ENTITY
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    #[test]
    fn an_unspecified_side_channel_is_the_prefill_instance_host_and_loopback_is_kept() {
        let rewritten = |reported: Value, url: &str| {
            let mut params = serde_json::json!({"remote_host": reported, "remote_port": 5600});
            reachable_side_channel(&mut params, url);
            params
        };
        for (reported, url, expected) in [
            // (Documentation-range names: nothing is dialled.) Listening on every interface:
            // the instance's host.
            (
                "0.0.0.0",
                "http://prefill-0.example:8000",
                "prefill-0.example",
            ),
            ("0.0.0.0", "http://192.0.2.7:8000", "192.0.2.7"),
            ("::", "http://[2001:db8::7]:8000", "2001:db8::7"),
            ("[::]", "http://127.0.0.1:8000", "127.0.0.1"),
            // Bound to loopback: only its own host reaches it, at that address.
            ("localhost", "http://prefill-0.example:8000", "localhost"),
            ("127.0.0.1", "http://192.0.2.7:8000", "127.0.0.1"),
            ("::1", "http://[2001:db8::7]:8000", "::1"),
            ("localhost", "http://127.0.0.1:8000", "localhost"),
            // A host the engine was told: kept.
            ("192.0.2.9", "http://192.0.2.7:8000", "192.0.2.9"),
        ] {
            let params = rewritten(Value::from(reported), url);
            assert_eq!(params["remote_host"], expected, "{reported} at {url}");
            assert_eq!(params["remote_port"], 5600);
        }
        assert_eq!(
            rewritten(Value::Null, "http://192.0.2.7:8000")["remote_host"],
            Value::Null
        );
    }

    #[test]
    fn a_chats_prompt_ids_go_into_the_hand_off() {
        let answer = |ids: &str| {
            format!(
                r#"{{"prompt_token_ids":{ids},"kv_transfer_params":{{"do_remote_prefill":true,"remote_engine_id":"e","remote_block_ids":[1]}}}}"#
            )
        };
        let handoff = handoff_in(answer("[5, 0,4294967295]").as_bytes()).unwrap();
        assert_eq!(
            handoff.prompt_token_ids.as_deref().map(RawValue::get),
            Some("[5, 0,4294967295]"),
            "as the answer wrote them"
        );
        assert_eq!(handoff.params["remote_engine_id"], "e");
        assert!(handoff.params.get("prompt_token_ids").is_none());
        // What vLLM's decoder would refuse is left out: the decoder renders the prompt.
        for ids in [
            "null",
            "[]",
            "[-1]",
            "[1.5]",
            "[true]",
            "\"1\"",
            "[4294967296]",
            "[1.0]",
        ] {
            let handoff = handoff_in(answer(ids).as_bytes()).unwrap();
            assert!(handoff.prompt_token_ids.is_none(), "{ids}");
        }
    }

    #[test]
    fn a_hand_off_must_name_an_engine_and_blocks() {
        let good = br#"{"choices":[],"kv_transfer_params":{"do_remote_prefill":true,"do_remote_decode":false,"remote_engine_id":"e","remote_block_ids":[1],"remote_host":"h","remote_port":1}}"#;
        assert_eq!(handoff_in(good).unwrap().params["remote_engine_id"], "e");
        for (answer, why) in [
            (&b"not json"[..], "not a JSON object"),
            (br#"{"choices":[]}"#, "no kv_transfer_params"),
            (br#"{"kv_transfer_params":null}"#, "no kv_transfer_params"),
            (br#"{"kv_transfer_params":{"remote_engine_id":"e","remote_block_ids":[]}}"#, "do_remote_prefill"),
            (br#"{"kv_transfer_params":{"do_remote_prefill":true,"remote_block_ids":[]}}"#, "remote_engine_id"),
            (br#"{"kv_transfer_params":{"do_remote_prefill":true,"remote_engine_id":"e","remote_block_ids":"x"}}"#, "remote_block_ids"),
        ] {
            let err = handoff_in(answer).unwrap_err();
            assert!(err.contains(why), "{err}");
        }
    }

    #[test]
    fn the_prefill_copy_asks_for_no_encoding_and_keeps_the_request_id() {
        let mut client = HeaderMap::new();
        client.insert(ACCEPT_ENCODING, HeaderValue::from_static("gzip, br"));
        client.insert("x-request-id", HeaderValue::from_static("r-1"));
        let headers = prefill_headers(&client);
        assert!(headers.get(ACCEPT_ENCODING).is_none());
        assert_eq!(headers["x-request-id"], "r-1");
    }
}
