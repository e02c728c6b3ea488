//! The second forwarding flow: a long prompt prefilled on one instance and decoded on another.
//!
//! With `NIXL` (vLLM's NixlConnector): the prefill copy of the request (`max_tokens: 1`,
//! `stream: false`, `kv_transfer_params.do_remote_decode: true`) goes to a prefill instance;
//! its answer's `kv_transfer_params` (engine, block ids, host, port) are copied into the
//! original request, which goes to a decoder, and the decoder's answer is relayed; the decoder
//! pulls the KV blocks itself, so any decoder may take it. With `LMCACHE` (LMCache's PD
//! backend): the prefill copy carries no `kv_transfer_params`, the prefill instance pushes
//! the KV cache to the decoder its own LMCache config names, and the original request goes to
//! that decoder (the instance's registered decode partner).
//!
//! If the prefill cannot be done (no prefill instance reachable, an error, no answer within
//! the config's `PrefillTimeoutSeconds`, no hand-off in the answer, no partner), the decoder
//! serves the whole request (`x-switchyard-route: fallback`). The retry rule holds on both
//! hops: a prefill instance that provably never got the request is replaced by the next; one
//! that may have got it is not retried (the decoder does the work instead); the decode hop is
//! `forward`'s, with its retries, deadlines and streaming. Dropping the request (the client
//! left) cancels whichever hop is running.

use axum::response::Response;
use bytes::Bytes;
use http::HeaderMap;
use http::header::HeaderName;
use http_body_util::BodyExt;
use serde_json::{Value, json};
use switchyard_shared::KvTransferProtocol;
use tokio::time::Instant;

use crate::admission::{BufferReservation, RequestPermit};
use crate::errors::ApiError;
use crate::forward::{Failure, Forwarder, Hop};
use crate::plan::{Disaggregated, Operation, Plan};
use crate::table::{Disaggregation, RouteLabel, UpstreamError, VariantRoute};

pub const PREFILL_INSTANCE: HeaderName = HeaderName::from_static("x-switchyard-prefill-instance");
/// KV_AWARE prefill: leading prompt tokens the prefill pool's KV index says the prefill
/// instance held.
pub const PREFILL_CACHED_TOKENS: HeaderName =
    HeaderName::from_static("x-switchyard-prefill-cached-tokens");

/// The most of a prefill answer read (a one-token answer and its hand-off are small).
const MOST_PREFILL_ANSWER_BYTES: usize = 1 << 20;

/// Why a prefill was not used (the `reason` label of the fallback counter).
type FallbackReason = &'static str;

/// A prefill that succeeded: which instance, and the hand-off its answer carried (NIXL).
struct Prefilled {
    instance: usize,
    kv_transfer_params: Option<Value>,
}

impl Forwarder<'_> {
    /// Prefill on the plan's prefill candidates, then decode on its decoders; or, if the
    /// prefill cannot be done, the decoders alone (`fallback`).
    pub(crate) async fn disaggregate(
        &self,
        operation: Operation,
        plan: Plan,
        disaggregated: Disaggregated,
        client_headers: HeaderMap,
        permit: RequestPermit,
        mut reservation: BufferReservation,
    ) -> Result<Response, ApiError> {
        let endpoint = std::sync::Arc::clone(&plan.endpoint);
        let Some(pd) = endpoint.disaggregation.as_ref() else {
            return self
                .send(operation, plan.into(), &client_headers, permit, reservation)
                .await;
        };
        let prefill_variant = &endpoint.variants[pd.prefill];
        let started = Instant::now();
        let prefilled = match prefill_body(&plan.body, pd.protocol, prefill_variant) {
            Some(body) => {
                reservation.resize_to((plan.body.len() + body.len()) as u64);
                self.prefill(
                    operation,
                    prefill_variant,
                    pd,
                    &disaggregated,
                    &client_headers,
                    body,
                )
                .await
            }
            None => Err("prefill_failed"),
        };
        let tokens = disaggregated.count.header_text();
        let mut hop = Hop::from(plan);
        let decided = match prefilled {
            Ok(prefilled) => {
                self.metrics
                    .disaggregation_prefill_seconds
                    .observe(started.elapsed().as_secs_f64());
                let handoff = Instant::now();
                let prefill_instance = &prefill_variant.instances[prefilled.instance];
                hand_off(&mut hop, pd, &prefilled).map(|()| {
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
            Err(reason) => Err(reason),
        };
        match decided {
            Ok(prefill_instance) => {
                self.metrics.count_disaggregation(RouteLabel::Disaggregated);
                tracing::info!(endpoint = %hop.endpoint.name, prompt_tokens = %tokens, basis = pd.basis.as_str(), prefill_instance, protocol = pd.protocol.as_str(), "disaggregate=True: prefilled, decoding");
            }
            Err(reason) => {
                self.metrics.count_fallback(reason);
                hop.label = RouteLabel::Fallback;
                tracing::info!(endpoint = %hop.endpoint.name, prompt_tokens = %tokens, basis = pd.basis.as_str(), reason, "disaggregate=False: the prefill could not be used; the decoder serves the whole request");
            }
        }
        reservation.resize_to(hop.body.len() as u64);
        self.send(operation, hop, &client_headers, permit, reservation)
            .await
    }

    /// Sends the prefill copy to the prefill candidates in order: the next one only when the
    /// previous one provably never got it.
    async fn prefill(
        &self,
        operation: Operation,
        variant: &VariantRoute,
        pd: &Disaggregation,
        disaggregated: &Disaggregated,
        client_headers: &HeaderMap,
        body: Bytes,
    ) -> Result<Prefilled, FallbackReason> {
        let attempts = self.settings.max_attempts.max(1);
        for &index in disaggregated.prefill.order.iter().take(attempts) {
            let instance = &variant.instances[index];
            instance.cell.requests[RouteLabel::Disaggregated as usize]
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let Some(uri) = crate::forward::upstream_uri(operation, None, instance) else {
                continue;
            };
            let deadline = pd.prefill_timeout;
            let answer = tokio::time::timeout(deadline, async {
                let (response, in_flight) = self
                    .attempt(
                        instance,
                        operation.method(),
                        uri,
                        client_headers,
                        body.clone(),
                        deadline,
                    )
                    .await?;
                let status = response.status();
                let read =
                    http_body_util::Limited::new(response.into_body(), MOST_PREFILL_ANSWER_BYTES)
                        .collect()
                        .await;
                drop(in_flight);
                Ok::<_, Failure>((status, read.map(|body| body.to_bytes()).ok()))
            })
            .await;
            let (status, answer) = match answer {
                Ok(Ok(answer)) => answer,
                Ok(Err(Failure::NotSent(error))) => {
                    instance.cell.count_upstream(UpstreamError::Refused);
                    tracing::info!(instance = %instance.id, error, "prefill instance unreachable; trying the next");
                    continue;
                }
                Ok(Err(Failure::AfterSend(error))) => {
                    instance.cell.count_upstream(UpstreamError::Reset);
                    tracing::warn!(instance = %instance.id, error, "prefill failed after the request was sent");
                    return Err("prefill_failed");
                }
                Ok(Err(Failure::TimedOut)) | Err(_) => {
                    instance.cell.count_upstream(UpstreamError::Timeout);
                    tracing::warn!(instance = %instance.id, ?deadline, "prefill took longer than PrefillTimeoutSeconds");
                    return Err("prefill_timeout");
                }
            };
            if !status.is_success() {
                tracing::warn!(instance = %instance.id, %status, "prefill answered an error");
                return Err("prefill_failed");
            }
            let kv_transfer_params = match pd.protocol {
                KvTransferProtocol::Lmcache => None,
                KvTransferProtocol::Nixl => {
                    let params = answer
                        .and_then(|answer| serde_json::from_slice::<Value>(&answer).ok())
                        .and_then(|mut answer| {
                            answer.get_mut("kv_transfer_params").map(Value::take)
                        })
                        .filter(Value::is_object);
                    if params.is_none() {
                        tracing::warn!(instance = %instance.id, "the prefill answer has no kv_transfer_params (is the engine started with a NixlConnector kv-transfer-config?)");
                        return Err("prefill_failed");
                    }
                    params
                }
            };
            return Ok(Prefilled {
                instance: index,
                kv_transfer_params,
            });
        }
        Err("prefill_unreachable")
    }
}

/// Turns the decode hop into the hand-off's: NIXL puts the prefill's `kv_transfer_params`
/// into the request (any decoder may pull); LMCACHE sends it to the prefill instance's decode
/// partner first (where the KV cache was pushed).
fn hand_off(
    hop: &mut Hop,
    pd: &Disaggregation,
    prefilled: &Prefilled,
) -> Result<(), FallbackReason> {
    match pd.protocol {
        KvTransferProtocol::Nixl => {
            let params = prefilled
                .kv_transfer_params
                .as_ref()
                .ok_or("prefill_failed")?;
            hop.body = with_kv_transfer_params(&hop.body, params).ok_or("prefill_failed")?;
            Ok(())
        }
        KvTransferProtocol::Lmcache => {
            let partner = pd
                .partners
                .get(prefilled.instance)
                .copied()
                .flatten()
                .ok_or("no_decode_partner")?;
            let order = &mut hop.ranking.order;
            order.retain(|&index| index != partner);
            order.insert(0, partner);
            Ok(())
        }
    }
}

/// The prefill copy of an OpenAI request, as vLLM's disaggregation proxy makes it: one token
/// (`max_tokens`, and `max_completion_tokens` if present), not streamed, no `stream_options` or
/// `min_tokens`, the prefill variant's ModelName, and for NIXL the request for a remote decode.
/// `None` if the body is not a JSON object (planning already refused that).
fn prefill_body(
    body: &[u8],
    protocol: KvTransferProtocol,
    variant: &VariantRoute,
) -> Option<Bytes> {
    let mut value: Value = serde_json::from_slice(body).ok()?;
    let object = value.as_object_mut()?;
    object.insert("max_tokens".into(), json!(1));
    if object.contains_key("max_completion_tokens") {
        object.insert("max_completion_tokens".into(), json!(1));
    }
    object.insert("stream".into(), json!(false));
    object.remove("stream_options");
    object.remove("min_tokens");
    if let Some(model) = &variant.model_name {
        object.insert("model".into(), json!(model));
    }
    match protocol {
        KvTransferProtocol::Nixl => {
            object.insert(
                "kv_transfer_params".into(),
                json!({
                    "do_remote_decode": true,
                    "do_remote_prefill": false,
                    "remote_engine_id": null,
                    "remote_block_ids": null,
                    "remote_host": null,
                    "remote_port": null,
                }),
            );
        }
        KvTransferProtocol::Lmcache => {
            object.remove("kv_transfer_params");
        }
    }
    serde_json::to_vec(&value).ok().map(Bytes::from)
}

/// The request with `kv_transfer_params` set to `params`: spliced in after the opening brace
/// when the client sent none (every other byte kept), else replaced.
fn with_kv_transfer_params(body: &[u8], params: &Value) -> Option<Bytes> {
    let params = serde_json::to_vec(params).ok()?;
    let has_field = body
        .windows(b"\"kv_transfer_params\"".len())
        .any(|window| window == b"\"kv_transfer_params\"");
    if has_field {
        let mut value: Value = serde_json::from_slice(body).ok()?;
        value.as_object_mut()?.insert(
            "kv_transfer_params".into(),
            serde_json::from_slice(&params).ok()?,
        );
        return serde_json::to_vec(&value).ok().map(Bytes::from);
    }
    let brace = body.iter().position(|byte| *byte == b'{')?;
    let rest = &body[brace + 1..];
    let empty = rest
        .iter()
        .all(|byte| byte.is_ascii_whitespace() || *byte == b'}');
    let mut out = Vec::with_capacity(body.len() + params.len() + 24);
    out.extend_from_slice(&body[..=brace]);
    out.extend_from_slice(b"\"kv_transfer_params\":");
    out.extend_from_slice(&params);
    if !empty {
        out.push(b',');
    }
    out.extend_from_slice(rest);
    Some(Bytes::from(out))
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn variant(model: Option<&str>) -> VariantRoute {
        VariantRoute {
            name: switchyard_shared::VariantName::new("prefill").unwrap(),
            name_header: HeaderValue::from_static("prefill"),
            model_name: model.map(str::to_owned),
            strategy: switchyard_policy::rank::Strategy::Random,
            prefix_length: 0,
            instances: Vec::new(),
            views: Vec::new(),
        }
    }

    #[test]
    fn the_prefill_copy_is_what_vllms_proxy_sends() {
        let body = br#"{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true,"stream_options":{"include_usage":true},"max_tokens":200,"max_completion_tokens":200,"min_tokens":5,"temperature":0.5}"#;
        let copy = prefill_body(body, KvTransferProtocol::Nixl, &variant(Some("p-model"))).unwrap();
        let copy: Value = serde_json::from_slice(&copy).unwrap();
        assert_eq!(copy["max_tokens"], 1);
        assert_eq!(copy["max_completion_tokens"], 1);
        assert_eq!(copy["stream"], false);
        assert_eq!(copy["model"], "p-model");
        assert_eq!(copy["temperature"], 0.5);
        assert!(copy.get("stream_options").is_none());
        assert!(copy.get("min_tokens").is_none());
        assert_eq!(
            copy["kv_transfer_params"],
            json!({"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null,
                   "remote_block_ids": null, "remote_host": null, "remote_port": null})
        );
        // No max_completion_tokens is added where there was none; LMCACHE sends no params.
        let copy = prefill_body(
            br#"{"prompt":"x"}"#,
            KvTransferProtocol::Lmcache,
            &variant(None),
        )
        .unwrap();
        let copy: Value = serde_json::from_slice(&copy).unwrap();
        assert!(copy.get("max_completion_tokens").is_none());
        assert!(copy.get("kv_transfer_params").is_none());
        assert!(copy.get("model").is_none());
        assert!(prefill_body(b"[1]", KvTransferProtocol::Nixl, &variant(None)).is_none());
    }

    #[test]
    fn the_hand_off_is_spliced_into_the_original_bytes() {
        let params = json!({"do_remote_prefill": true, "remote_block_ids": [1, 2]});
        let spliced =
            with_kv_transfer_params(br#"{ "prompt": "x",  "stream": true }"#, &params).unwrap();
        assert_eq!(
            std::str::from_utf8(&spliced).unwrap(),
            r#"{"kv_transfer_params":{"do_remote_prefill":true,"remote_block_ids":[1,2]}, "prompt": "x",  "stream": true }"#
        );
        let empty = with_kv_transfer_params(b"{}", &params).unwrap();
        let value: Value = serde_json::from_slice(&empty).unwrap();
        assert_eq!(value["kv_transfer_params"], params);
        // A client's own kv_transfer_params are replaced, never duplicated.
        let replaced =
            with_kv_transfer_params(br#"{"kv_transfer_params":{"x":1},"prompt":"p"}"#, &params)
                .unwrap();
        let value: Value = serde_json::from_slice(&replaced).unwrap();
        assert_eq!(value["kv_transfer_params"], params);
        assert_eq!(value["prompt"], "p");
    }
}
