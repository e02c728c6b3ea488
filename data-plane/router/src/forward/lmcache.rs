//! LMCACHE_PD: current LMCache's PD protocol, as its `disagg_proxy_server.py` speaks it.
//!
//! Per request: the decoder is chosen first (the first of the decode ranking with an LMCache
//! receiver, available here, and room in its PD buffer for this router's hand-offs in flight
//! if it registered `BufferTokens`); the prefiller gets the prompt's token ids with
//! `kv_transfer_params.disagg_spec` naming that receiver and a request id naming this router
//! (`notices`); its answer carries the first token (`kv_transfer_params.first_tok`). If that
//! token ends the answer (`finish_reason` "stop", or a budget of one token) the prefiller's
//! answer is the answer. Otherwise the router waits, within what is left of
//! `PrefillTimeoutSeconds`, for one "KV ready" notice per receiver rank, then sends the chosen
//! decoder the ids plus the first token with one token less of budget, and relays its answer
//! with the prefill's first token in front, turned back into chat for a chat client
//! ([`Answer`]): one id, `created` and `model` throughout, usage counted for the client's own
//! prompt, one aggregated body for a client that did not stream.
//!
//! Fallbacks (the decoder serves the whole request as the client sent it, counted by reason):
//! no token ids (`/tokenize` failed), no notice socket (`--lmcache-notice-bind` unset), no
//! decoder with a receiver (`no_receiver`) or with room (`handoff_cap`), a prefill that failed,
//! timed out or answered without `first_tok` (`bad_handoff`). Notices that do not come in time
//! (`notice_timeout`): the decoder is sent the ids anyway and computes what it lacks (the
//! answer is the same; the route says `fallback`). A decoder that fails is answered as any
//! decode hop.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use bytes::{Bytes, BytesMut};
use http::HeaderMap;
use http::header::{CONTENT_LENGTH, CONTENT_TYPE};
use serde_json::{Map, Value, json};
use tokio::time::Instant;

use super::notices::NoticeBoard;
use super::refusal::{Convert, UpstreamBody};
use super::{Answered, Forwarder, Hop, InFlight};
use crate::errors::ApiError;
use crate::headers::PREFILL_INSTANCE;
use crate::observe::labels::RouteLabel;
use crate::observe::trace::request_id;
use crate::operation::Operation;
use crate::plan::lmcache::{DisaggSpec, decode_body, prefill_body};
use crate::plan::{Plan, PrefillHop};
use crate::routing::cells::{InstanceCell, SlotClaim};
use crate::routing::table::VariantRoute;
use crate::server::admission::BufferReservation;

/// The most of a decoder's non-streamed answer held to aggregate it.
const MOST_ANSWER_BYTES: usize = 64 << 20;
/// The most of a streamed event held while it is not whole; past it the bytes pass as they
/// came.
const MOST_EVENT_BYTES: usize = 1 << 20;
/// LMCache's default `chunk_size`: its receiver reserves a hand-off's buffer in whole chunks,
/// so `BufferTokens` is counted in them.
const LMCACHE_CHUNK_TOKENS: u64 = 256;

/// What the prefill's answer says the request starts with.
#[derive(Debug, Clone)]
pub(super) struct FirstToken {
    pub id: String,
    pub created: Value,
    pub text: String,
    pub token: u32,
    pub finish_reason: Value,
    pub stop_reason: Value,
}

/// The first token of an LMCache prefill answer: its `kv_transfer_params.first_tok` and the
/// first choice's text.
pub(super) fn first_token_in(answer: &[u8]) -> Result<FirstToken, &'static str> {
    let value: Value = serde_json::from_slice(answer).map_err(|_| "the answer is not JSON")?;
    let token = value
        .pointer("/kv_transfer_params/first_tok")
        .and_then(Value::as_u64)
        .and_then(|token| u32::try_from(token).ok())
        .ok_or("the answer has no kv_transfer_params.first_tok (is the prefill engine started with LMCacheConnectorV1 as kv_producer, LMCache's pd_role sender?)")?;
    let choice = value
        .pointer("/choices/0")
        .ok_or("the answer has no choice")?;
    Ok(FirstToken {
        id: value
            .get("id")
            .and_then(Value::as_str)
            .unwrap_or("cmpl-switchyard")
            .to_owned(),
        created: value.get("created").cloned().unwrap_or(json!(0)),
        text: choice
            .get("text")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_owned(),
        token,
        finish_reason: choice.get("finish_reason").cloned().unwrap_or(Value::Null),
        stop_reason: choice.get("stop_reason").cloned().unwrap_or(Value::Null),
    })
}

/// This router's hand-off tokens in flight to one decoder, given back when dropped.
struct HandoffHold {
    cell: Arc<InstanceCell>,
    tokens: u64,
}

impl Drop for HandoffHold {
    fn drop(&mut self) {
        self.cell
            .handoff_tokens
            .fetch_sub(self.tokens, Ordering::Relaxed);
    }
}

/// The decoder for a hand-off of `tokens` prompt tokens: the first in `order` with an LMCache
/// receiver, available, and room in its buffer (taken here).
fn pick_decoder(
    decode: &VariantRoute,
    order: &[usize],
    tokens: u64,
) -> Result<(usize, Option<HandoffHold>), &'static str> {
    let now_ms = switchyard_process::clock::unix_ms();
    let mut full = false;
    for &index in order {
        let instance = &decode.instances[index];
        let Some(receiver) = &instance.lmcache_receiver else {
            continue;
        };
        if !instance.cell.available(now_ms) {
            continue;
        }
        let Some(cap) = receiver.buffer_tokens else {
            return Ok((index, None));
        };
        let cell = &instance.cell.handoff_tokens;
        let mut current = cell.load(Ordering::Relaxed);
        loop {
            if current + tokens > u64::from(cap) {
                full = true;
                break;
            }
            match cell.compare_exchange_weak(
                current,
                current + tokens,
                Ordering::AcqRel,
                Ordering::Relaxed,
            ) {
                Ok(_) => {
                    let hold = HandoffHold {
                        cell: Arc::clone(&instance.cell),
                        tokens,
                    };
                    return Ok((index, Some(hold)));
                }
                Err(now) => current = now,
            }
        }
    }
    Err(if full { "handoff_cap" } else { "no_receiver" })
}

/// Why the hand-off is not made: the decoder serves the whole request, or it ends.
enum NoHandoff {
    Fallback(&'static str),
    Fail(ApiError),
}

/// A prefill that gave the first token.
struct Prefilled {
    instance: usize,
    first: FirstToken,
    /// The prefill instance's in-flight count, for an answer that is the prefill's own.
    in_flight: Option<InFlight>,
    decoder: usize,
    hold: Option<HandoffHold>,
    expected: super::notices::Expected,
}

impl Forwarder<'_> {
    /// LMCACHE_PD's prefill → decode (see the module docs).
    #[allow(clippy::too_many_arguments)] // the two hops' shared state, passed through once
    pub(super) async fn disaggregate_lmcache(
        &self,
        operation: Operation,
        plan: Plan,
        mut disaggregated: PrefillHop,
        client_headers: &HeaderMap,
        mut reservation: BufferReservation,
        prefill_claim: Option<SlotClaim>,
        notices: Option<&Arc<NoticeBoard>>,
    ) -> Result<Answered, ApiError> {
        let endpoint = Arc::clone(&plan.endpoint);
        let Some(pd) = endpoint.disaggregation.as_ref() else {
            return self
                .send(operation, plan.into(), client_headers, reservation)
                .await;
        };
        let chat = operation == Operation::ChatCompletions;
        let object = serde_json::from_slice::<Map<String, Value>>(&plan.body).unwrap_or_default();
        let streamed = object.get("stream") == Some(&Value::Bool(true));
        let tokens = disaggregated.count.header_text();
        let flow = plan.flow;
        let started = Instant::now();
        let mut hop = Hop::from(plan);
        let prefilled = self
            .lmcache_prefill(
                &endpoint,
                &object,
                &mut disaggregated,
                &hop,
                client_headers,
                &mut reservation,
                prefill_claim,
                notices,
            )
            .await;
        let prefilled = match prefilled {
            Ok(prefilled) => prefilled,
            Err(NoHandoff::Fail(error)) => return Err(error),
            Err(NoHandoff::Fallback(reason)) => {
                self.metrics.count_fallback(reason);
                hop.label = RouteLabel::Fallback;
                tracing::info!(request_id = request_id(client_headers), trace_id = %self.trace_id(), endpoint = %endpoint.name, prompt_tokens = %tokens, reason, "disaggregate=False: no LMCache hand-off; the decoder serves the whole request");
                reservation.resize_to(hop.body.len() as u64);
                return self
                    .decode(operation, hop, client_headers, reservation, flow, false)
                    .await;
            }
        };
        self.metrics
            .disaggregation_prefill_seconds
            .observe(started.elapsed().as_secs_f64());
        let Prefilled {
            instance: prefill_index,
            first,
            in_flight,
            decoder,
            hold,
            mut expected,
        } = prefilled;
        let prefill_variant = &endpoint.variants[pd.prefill];
        let prefill_instance = &prefill_variant.instances[prefill_index];
        let model = object.get("model").cloned().unwrap_or(Value::Null);
        let answer = Answer {
            chat,
            streamed,
            usage: streamed_usage(&object),
            first: first.clone(),
            model,
        };
        hop.explain
            .push((PREFILL_INSTANCE, prefill_instance.id_header.clone()));
        // The first token ends it: the prefill's answer is the answer.
        // The first token ends it (a budget of one token went direct at planning).
        let stops = first.finish_reason == json!("stop");
        let in_flight = if stops {
            in_flight
        } else {
            drop(in_flight);
            None
        };
        let left = pd.prefill_timeout.saturating_sub(started.elapsed());
        let ready = expected.ready(left).await;
        drop(expected);
        let ids = disaggregated.token_ids.take().unwrap_or_default();
        let prompt_tokens = ids.len();
        let made = decode_body(&object, &ids, first.token, stops);
        let Some(body) = made else {
            return Err(ApiError::unavailable(
                "the decode request could not be made",
            ));
        };
        if let Some(in_flight) = in_flight {
            let explain = hop.explain.clone();
            hop.body = body;
            hop.order_first(decoder);
            hop.data_parallel_ranks.clear();
            hop.cached_tokens.clear();
            hop.plain_body = None;
            reservation.resize_to(hop.body.len() as u64);
            self.claim(hop, client_headers, reservation, flow).await;
            drop(hold);
            self.metrics.count_disaggregation(RouteLabel::Disaggregated);
            let now = Instant::now();
            let (content_type, body) = answer.whole(prompt_tokens);
            let response = http::Response::builder()
                .header(CONTENT_TYPE, content_type)
                .body(UpstreamBody::made(body))
                .map_err(|err| ApiError::unavailable(err.to_string()))?;
            return Ok(Answered {
                response,
                in_flight,
                endpoint: Arc::clone(&endpoint),
                variant_index: pd.prefill,
                instance_index: prefill_index,
                label: RouteLabel::Disaggregated,
                explain,
                time_first_frame: false,
                head_at: now,
                last_frame_at: now,
                cached_tokens: None,
                plain: false,
            });
        }
        drop(ids);
        // A decoder that refuses the hand-off before any token (vLLM's
        // kv_load_failure_policy "fail") gets the client's own request instead, as NIXL's do.
        let client_body = std::mem::replace(&mut hop.body, body);
        hop.order_first(decoder);
        hop.data_parallel_ranks.clear();
        hop.cached_tokens.clear();
        hop.plain_body = Some(client_body);
        hop.plain_operation = Some(operation);
        if ready {
            hop.label = RouteLabel::Disaggregated;
            hop.time_first_frame = true;
            self.metrics.count_disaggregation(RouteLabel::Disaggregated);
            tracing::info!(request_id = request_id(client_headers), trace_id = %self.trace_id(), endpoint = %endpoint.name, prompt_tokens = %tokens, prefill_instance = %prefill_instance.id, protocol = pd.protocol.as_str(), "disaggregate=True: prefilled, KV ready, decoding");
        } else {
            hop.label = RouteLabel::Fallback;
            self.metrics.count_fallback("notice_timeout");
            tracing::warn!(request_id = request_id(client_headers), trace_id = %self.trace_id(), endpoint = %endpoint.name, prefill_instance = %prefill_instance.id, "no LMCache \"KV ready\" notice in time (is the prefiller's pd_proxy_host/pd_proxy_port this router's --lmcache-notice-bind?); the decoder computes what it lacks");
        }
        let plain = hop.plain_body.as_ref().map_or(0, Bytes::len);
        reservation.resize_to((hop.body.len() + plain) as u64);
        let answered = self
            .decode_pushed(hop, client_headers, reservation, flow)
            .await;
        // The hand-off's share of the decoder's buffer is held until the decoder answered
        // (it has then taken the KV cache out).
        drop(hold);
        let mut answered = answered?;
        // After a refusal the decoder answered the client's own request: nothing to convert.
        if answered.response.status().is_success() && !answered.plain {
            let head = streamed.then(|| answer.head());
            let response = std::mem::replace(
                &mut answered.response,
                http::Response::new(UpstreamBody::made(Bytes::new())),
            );
            let (mut parts, body) = response.into_parts();
            parts.headers.remove(CONTENT_LENGTH);
            let convert = Box::new(Converting {
                answer,
                prompt_tokens,
                partial: BytesMut::new(),
                whole: BytesMut::new(),
                overflowed: false,
            });
            answered.response = http::Response::from_parts(parts, body.converted(head, convert));
        }
        Ok(answered)
    }

    /// Sends a completions hop to the decoder the hand-off pushed its KV cache to (the
    /// hop's first decoder, waited for alone).
    async fn decode_pushed(
        &self,
        hop: Hop,
        client_headers: &HeaderMap,
        reservation: BufferReservation,
        flow: crate::plan::flow::FlowKey,
    ) -> Result<Answered, ApiError> {
        self.decode(
            Operation::Completions,
            hop,
            client_headers,
            reservation,
            flow,
            true,
        )
        .await
    }

    /// Sends the decoder the one-token claim of a hand-off whose answer is the prefill's, and
    /// drops what it answers (within the stream idle deadline).
    async fn claim(
        &self,
        hop: Hop,
        client_headers: &HeaderMap,
        reservation: BufferReservation,
        flow: crate::plan::flow::FlowKey,
    ) {
        let decoder = hop.endpoint.variants[hop.variant_index].instances
            [hop.ranking.order.first().copied().unwrap_or(0)]
        .id
        .clone();
        let claimed = self
            .decode_pushed(hop, client_headers, reservation, flow)
            .await;
        let outcome = match claimed {
            Ok(answered) => {
                let status = answered.response.status();
                let body = answered.response.into_body();
                let read = tokio::time::timeout(
                    self.settings.stream_idle,
                    http_body_util::BodyExt::collect(body),
                )
                .await;
                drop(answered.in_flight);
                match read {
                    Ok(Ok(_)) if status.is_success() => return,
                    _ => format!("status {status}, or its answer did not end in time"),
                }
            }
            Err(error) => error.message,
        };
        tracing::warn!(request_id = request_id(client_headers), %decoder, outcome, "the decoder did not take an LMCache hand-off whose answer was the prefill's; its PD buffer may hold those chunks until LMCache frees them");
    }

    /// Picks the decoder, prefills with its `disagg_spec`, and reads the first token.
    #[allow(clippy::too_many_arguments)]
    async fn lmcache_prefill(
        &self,
        endpoint: &crate::routing::table::EndpointRoute,
        object: &Map<String, Value>,
        disaggregated: &mut PrefillHop,
        hop: &Hop,
        client_headers: &HeaderMap,
        reservation: &mut BufferReservation,
        claim: Option<SlotClaim>,
        notices: Option<&Arc<NoticeBoard>>,
    ) -> Result<Prefilled, NoHandoff> {
        let Some(pd) = endpoint.disaggregation.as_ref() else {
            return Err(NoHandoff::Fallback("prefill_failed"));
        };
        let ids = disaggregated
            .token_ids
            .as_deref()
            .ok_or(NoHandoff::Fallback("no_token_ids"))?;
        let board = notices.ok_or_else(|| {
            static WARNED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
            if !WARNED.swap(true, Ordering::Relaxed) {
                tracing::warn!("an LMCACHE_PD endpoint, but this router has no --lmcache-notice-bind: its requests are served by a decoder alone (logged once)");
            }
            NoHandoff::Fallback("no_notice_socket")
        })?;
        let decode = &endpoint.variants[pd.decode];
        let tokens = (ids.len() as u64).div_ceil(LMCACHE_CHUNK_TOKENS) * LMCACHE_CHUNK_TOKENS;
        let (decoder, hold) =
            pick_decoder(decode, &hop.ranking.order, tokens).map_err(NoHandoff::Fallback)?;
        let Some(receiver) = decode.instances[decoder].lmcache_receiver.as_deref() else {
            return Err(NoHandoff::Fallback("no_receiver"));
        };
        let expected = board.expect(receiver.init_ports.len());
        let spec = DisaggSpec {
            req_id: &expected.req_id,
            receiver,
        };
        let prefill = &endpoint.variants[pd.prefill];
        let body = prefill_body(object, ids, &spec, prefill)
            .ok_or(NoHandoff::Fallback("prefill_failed"))?;
        if !reservation.grow_within((hop.body.len() + body.len()) as u64) {
            return Err(NoHandoff::Fallback("buffer_full"));
        }
        let order = disaggregated.prefill.order.clone();
        let (instance, answer, in_flight) = self
            .prefill_answer(
                Operation::Completions,
                endpoint,
                pd,
                (&order, &disaggregated.prefill_ranks),
                client_headers,
                body,
                reservation,
                claim,
            )
            .await
            .map_err(|failure| match failure {
                super::prefill::NoPrefill::Fallback(reason) => NoHandoff::Fallback(reason),
                super::prefill::NoPrefill::Fail(error) => NoHandoff::Fail(error),
            })?;
        let first = first_token_in(&answer).map_err(|why| {
            tracing::warn!(instance = %prefill.instances[instance].id, why, "the LMCache prefill answer has no usable first token");
            NoHandoff::Fallback("bad_handoff")
        })?;
        Ok(Prefilled {
            instance,
            first,
            in_flight: Some(in_flight),
            decoder,
            hold,
            expected,
        })
    }
}

impl Hop {
    /// `index` first in the order (the decoder holding the hand-off), the others after it.
    fn order_first(&mut self, index: usize) {
        let order = &mut self.ranking.order;
        order.retain(|&other| other != index);
        order.insert(0, index);
    }
}

/// Whether the client asked for usage in its stream (`stream_options.include_usage`).
fn streamed_usage(object: &Map<String, Value>) -> bool {
    object
        .get("stream_options")
        .and_then(|options| options.get("include_usage"))
        == Some(&Value::Bool(true))
}

/// How the client's answer is made of the prefill's first token and the decoder's answer.
struct Answer {
    chat: bool,
    streamed: bool,
    /// The client asked for usage in its stream.
    usage: bool,
    first: FirstToken,
    /// The decode request's `model`, named throughout.
    model: Value,
}

impl Answer {
    fn id(&self) -> String {
        match (self.chat, self.first.id.strip_prefix("cmpl-")) {
            (true, Some(rest)) => format!("chatcmpl-{rest}"),
            (true, None) => format!("chatcmpl-{}", self.first.id),
            (false, _) => self.first.id.clone(),
        }
    }

    fn chunk(&self, choices: Value, usage: Option<Value>) -> Value {
        let object = if self.chat {
            "chat.completion.chunk"
        } else {
            "text_completion"
        };
        let mut chunk = json!({
            "id": self.id(), "object": object, "created": self.first.created,
            "model": self.model, "choices": choices,
        });
        if let Some(usage) = usage {
            chunk["usage"] = usage;
        }
        chunk
    }

    /// One streamed choice with `text`.
    fn choice(&self, text: &str, finish_reason: &Value, stop_reason: &Value) -> Value {
        if self.chat {
            json!({"index": 0, "delta": {"content": text}, "logprobs": null,
                   "finish_reason": finish_reason, "stop_reason": stop_reason})
        } else {
            json!({"index": 0, "text": text, "logprobs": null,
                   "finish_reason": finish_reason, "stop_reason": stop_reason})
        }
    }

    /// The stream's first events: chat's role chunk, then the first token.
    fn head(&self) -> Bytes {
        let mut out = BytesMut::new();
        if self.chat {
            let role = json!([{"index": 0, "delta": {"role": "assistant", "content": ""},
                               "logprobs": null, "finish_reason": null}]);
            push_event(&mut out, &self.chunk(role, None));
        }
        let first = self.choice(&self.first.text, &Value::Null, &Value::Null);
        push_event(&mut out, &self.chunk(json!([first]), None));
        out.freeze()
    }

    /// The whole answer when the first token ends it (the prefill's own): its content type
    /// and body.
    fn whole(&self, prompt_tokens: usize) -> (&'static str, Bytes) {
        let usage = json!({"prompt_tokens": prompt_tokens, "completion_tokens": 1,
                           "total_tokens": prompt_tokens + 1});
        if !self.streamed {
            return (
                "application/json",
                self.aggregated(
                    &self.first.text,
                    &self.first.finish_reason,
                    &self.first.stop_reason,
                    usage,
                ),
            );
        }
        let mut out = BytesMut::from(&self.head()[..]);
        let last = self.choice("", &self.first.finish_reason, &self.first.stop_reason);
        push_event(&mut out, &self.chunk(json!([last]), None));
        if self.usage {
            push_event(&mut out, &self.chunk(json!([]), Some(usage)));
        }
        out.extend_from_slice(b"data: [DONE]\n\n");
        ("text/event-stream", out.freeze())
    }

    /// A non-streamed answer with `text`.
    fn aggregated(
        &self,
        text: &str,
        finish_reason: &Value,
        stop_reason: &Value,
        usage: Value,
    ) -> Bytes {
        let choice = if self.chat {
            json!({"index": 0, "message": {"role": "assistant", "content": text, "refusal": null,
                                            "tool_calls": []},
                   "logprobs": null, "finish_reason": finish_reason, "stop_reason": stop_reason})
        } else {
            json!({"index": 0, "text": text, "logprobs": null, "finish_reason": finish_reason,
                   "stop_reason": stop_reason})
        };
        let object = if self.chat {
            "chat.completion"
        } else {
            "text_completion"
        };
        let answer = json!({"id": self.id(), "object": object, "created": self.first.created,
                            "model": self.model, "choices": [choice], "usage": usage});
        Bytes::from(serde_json::to_vec(&answer).unwrap_or_default())
    }

    /// The decoder's usage, for the client's own request: its prompt was the client's plus
    /// the first token, which is the client's first completion token.
    fn usage(&self, usage: &Value) -> Value {
        let mut usage = usage.clone();
        if let Some(prompt) = usage.get("prompt_tokens").and_then(Value::as_u64) {
            usage["prompt_tokens"] = json!(prompt.saturating_sub(1));
        }
        if let Some(completion) = usage.get("completion_tokens").and_then(Value::as_u64) {
            usage["completion_tokens"] = json!(completion + 1);
        }
        usage
    }

    /// One decoder event's data, for the client (None: passed on as it came).
    fn event(&self, data: &[u8]) -> Option<Value> {
        let value: Value = serde_json::from_slice(data).ok()?;
        let choices = value.get("choices")?.as_array()?;
        let usage = value
            .get("usage")
            .filter(|usage| !usage.is_null())
            .map(|usage| self.usage(usage));
        let choices: Vec<Value> = choices
            .iter()
            .map(|choice| {
                let text = choice.get("text").and_then(Value::as_str).unwrap_or("");
                let finish = choice.get("finish_reason").cloned().unwrap_or(Value::Null);
                let stop = choice.get("stop_reason").cloned().unwrap_or(Value::Null);
                self.choice(text, &finish, &stop)
            })
            .collect();
        Some(self.chunk(Value::Array(choices), usage))
    }
}

fn push_event(out: &mut BytesMut, value: &Value) {
    out.extend_from_slice(b"data: ");
    out.extend_from_slice(&serde_json::to_vec(value).unwrap_or_default());
    out.extend_from_slice(b"\n\n");
}

/// The decoder's answer turned into the client's ([`Answer`]): event by event when streamed,
/// whole at the end otherwise.
struct Converting {
    answer: Answer,
    prompt_tokens: usize,
    /// A streamed event not yet whole.
    partial: BytesMut,
    /// A non-streamed answer so far.
    whole: BytesMut,
    /// It passed [`MOST_ANSWER_BYTES`].
    overflowed: bool,
}

impl Convert for Converting {
    fn data(&mut self, data: Bytes) -> Bytes {
        if !self.answer.streamed {
            if self.whole.len() + data.len() <= MOST_ANSWER_BYTES {
                self.whole.extend_from_slice(&data);
            } else {
                self.overflowed = true;
            }
            return Bytes::new();
        }
        self.partial.extend_from_slice(&data);
        if self.partial.len() > MOST_EVENT_BYTES && find_event_end(&self.partial).is_none() {
            return std::mem::take(&mut self.partial).freeze();
        }
        let mut out = BytesMut::new();
        while let Some(end) = find_event_end(&self.partial) {
            let event = self.partial.split_to(end.0 + end.1);
            let text = &event[..end.0];
            match text
                .strip_prefix(b"data: ")
                .filter(|data| *data != b"[DONE]")
            {
                Some(data) => match self.answer.event(data) {
                    Some(value) => push_event(&mut out, &value),
                    None => out.extend_from_slice(&event),
                },
                None => out.extend_from_slice(&event),
            }
        }
        out.freeze()
    }

    fn end(&mut self) -> Bytes {
        if self.answer.streamed {
            return std::mem::take(&mut self.partial).freeze();
        }
        let whole = std::mem::take(&mut self.whole);
        if self.overflowed {
            let error = json!({"error": {"message": format!("the decoder's answer passed {MOST_ANSWER_BYTES} bytes, more than the router re-shapes; ask for a stream"), "type": "server_error", "param": null, "code": "answer_too_large"}});
            return Bytes::from(serde_json::to_vec(&error).unwrap_or_default());
        }
        let Ok(value) = serde_json::from_slice::<Value>(&whole) else {
            return whole.freeze();
        };
        let Some(choice) = value.pointer("/choices/0") else {
            return whole.freeze();
        };
        let text = format!(
            "{}{}",
            self.answer.first.text,
            choice.get("text").and_then(Value::as_str).unwrap_or("")
        );
        let finish = choice.get("finish_reason").cloned().unwrap_or(Value::Null);
        let stop = choice.get("stop_reason").cloned().unwrap_or(Value::Null);
        let usage = value
            .get("usage")
            .map(|usage| self.answer.usage(usage))
            .unwrap_or_else(|| json!({"prompt_tokens": self.prompt_tokens}));
        self.answer.aggregated(&text, &finish, &stop, usage)
    }
}

/// Where the first whole SSE event ends: its length without the blank line, and the blank
/// line's length (`\n\n` or `\r\n\r\n`).
fn find_event_end(buffer: &[u8]) -> Option<(usize, usize)> {
    let lf = buffer
        .windows(2)
        .position(|pair| pair == b"\n\n")
        .map(|at| (at, 2));
    let crlf = buffer
        .windows(4)
        .position(|quad| quad == b"\r\n\r\n")
        .map(|at| (at, 4));
    match (lf, crlf) {
        (Some(a), Some(b)) => Some(if a.0 <= b.0 { a } else { b }),
        (a, b) => a.or(b),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(chat: bool, streamed: bool) -> Answer {
        Answer {
            chat,
            streamed,
            usage: true,
            first: FirstToken {
                id: "cmpl-abc".into(),
                created: json!(7),
                text: "Hel".into(),
                token: 9,
                finish_reason: Value::Null,
                stop_reason: Value::Null,
            },
            model: json!("m"),
        }
    }

    fn events(bytes: &[u8]) -> Vec<Value> {
        String::from_utf8_lossy(bytes)
            .split("\n\n")
            .filter_map(|event| event.strip_prefix("data: "))
            .filter(|data| *data != "[DONE]")
            .map(|data| serde_json::from_str(data).unwrap())
            .collect()
    }

    #[test]
    fn a_streamed_completion_becomes_the_chat_clients_stream_after_the_first_token() {
        let answer = answer(true, true);
        let head = events(&answer.head());
        assert_eq!(head[0]["choices"][0]["delta"]["role"], "assistant");
        assert_eq!(head[1]["choices"][0]["delta"]["content"], "Hel");
        assert_eq!(head[1]["id"], "chatcmpl-abc");
        let mut convert = Converting {
            answer,
            prompt_tokens: 5,
            partial: BytesMut::new(),
            whole: BytesMut::new(),
            overflowed: false,
        };
        let decoder = "data: {\"id\":\"cmpl-x\",\"object\":\"text_completion\",\"created\":9,\"model\":\"m\",\"choices\":[{\"index\":0,\"text\":\"lo\",\"logprobs\":null,\"finish_reason\":\"length\",\"stop_reason\":null}],\"usage\":null}\n\ndata: {\"id\":\"cmpl-x\",\"choices\":[],\"usage\":{\"prompt_tokens\":6,\"completion_tokens\":3,\"total_tokens\":9}}\n\ndata: [DONE]\n\n";
        // Split mid-event: only whole events pass.
        let (a, b) = decoder.split_at(40);
        let mut out = convert.data(Bytes::from(a)).to_vec();
        assert!(out.is_empty());
        out.extend_from_slice(&convert.data(Bytes::from(b)));
        out.extend_from_slice(&convert.end());
        let text = String::from_utf8(out.clone()).unwrap();
        assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
        let converted = events(&out);
        assert_eq!(converted[0]["object"], "chat.completion.chunk");
        assert_eq!(converted[0]["id"], "chatcmpl-abc");
        assert_eq!(converted[0]["choices"][0]["delta"]["content"], "lo");
        assert_eq!(converted[0]["choices"][0]["finish_reason"], "length");
        assert_eq!(
            converted[1]["usage"],
            json!({"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9})
        );
    }

    #[test]
    fn a_whole_answer_is_aggregated_with_the_first_token() {
        let mut convert = Converting {
            answer: answer(true, false),
            prompt_tokens: 5,
            partial: BytesMut::new(),
            whole: BytesMut::new(),
            overflowed: false,
        };
        assert!(convert.data(Bytes::from_static(br#"{"id":"cmpl-x","object":"text_completion","choices":[{"index":0,"text":"lo!","finish_reason":"stop","stop_reason":null}],"#)).is_empty());
        convert.data(Bytes::from_static(
            br#""usage":{"prompt_tokens":6,"completion_tokens":2,"total_tokens":8}}"#,
        ));
        let value: Value = serde_json::from_slice(&convert.end()).unwrap();
        assert_eq!(value["object"], "chat.completion");
        assert_eq!(value["choices"][0]["message"]["content"], "Hello!");
        assert_eq!(value["choices"][0]["finish_reason"], "stop");
        assert_eq!(value["usage"]["prompt_tokens"], 5);
        assert_eq!(value["usage"]["completion_tokens"], 3);
        // Completions keep their shape.
        let (kind, body) = answer(false, false).whole(5);
        assert_eq!(kind, "application/json");
        let value: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(value["choices"][0]["text"], "Hel");
        assert_eq!(value["usage"]["completion_tokens"], 1);
    }

    #[test]
    fn a_prefill_answer_needs_its_first_token() {
        let good = br#"{"id":"cmpl-1","created":3,"choices":[{"index":0,"text":" a","finish_reason":"length"}],"kv_transfer_params":{"first_tok":264}}"#;
        let first = first_token_in(good).unwrap();
        assert_eq!((first.token, first.text.as_str()), (264, " a"));
        assert!(
            first_token_in(br#"{"choices":[{"text":"a"}]}"#)
                .unwrap_err()
                .contains("first_tok")
        );
        assert!(
            first_token_in(br#"{"choices":[{"text":"a"}],"kv_transfer_params":{"first_tok":-1}}"#)
                .is_err()
        );
        assert!(first_token_in(b"x").is_err());
    }
}
