//! The bodies of LMCACHE_PD (current LMCache's PD protocol, as its `disagg_proxy_server.py`
//! speaks it): both hops are `/v1/completions` requests over the prompt's token ids (the
//! engine's `/tokenize`, chat template applied), so the decoder starts from exactly the tokens
//! the prefiller computed.
//!
//! - The prefill: `prompt` the ids, `max_tokens: 1`, not streamed, no `stream_options`, a
//!   client's `min_tokens` as 1, the prefill variant's ModelName, and `kv_transfer_params`
//!   `{"ret_first_tok": true, "disagg_spec": {req_id, receiver_host, receiver_init_port,
//!   receiver_alloc_port}}` (the ports are lists, one per decoder tensor-parallel rank).
//! - The decode: `prompt` the ids plus the prefill's first token (its
//!   `kv_transfer_params.first_tok`), the budget (`max_tokens`, `min_tokens`) one token less,
//!   streamed as the client asked.
//!
//! A chat request goes this way only when completions carry it losslessly ([`carriable`]):
//! the fields that only shape the templated prompt go to `/tokenize`, sampling fields mean the
//! same in both APIs, and anything else (tools, response formats, logprobs, several choices,
//! fields this module does not know) goes `direct` to a decoder, whole. The answer is turned
//! back into chat by `forward::lmcache`.

use bytes::Bytes;
use serde_json::{Map, Value, json};

use super::engine_body::KV_TRANSFER_PARAMS;
use crate::routing::table::VariantRoute;

/// Chat fields that only shape the prompt the template renders: sent to `/tokenize`
/// (`plan::tokens`), not to the engines.
const TEMPLATE_ONLY: &[&str] = &[
    "messages",
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "chat_template",
    "chat_template_kwargs",
    "documents",
];

/// Fields that mean the same in chat and completions (vLLM's sampling parameters and
/// request options), carried over as they are.
const SAMPLING: &[&str] = &[
    "model",
    "max_tokens",
    "max_completion_tokens",
    "min_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "include_stop_str_in_output",
    "ignore_eos",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "length_penalty",
    "logit_bias",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "stream",
    "stream_options",
    "user",
    "safety_identifier",
    "priority",
    "cache_salt",
    "request_id",
    "n",
    "metadata",
    "store",
];

/// Completions fields the decode hop carries besides [`SAMPLING`]: `prompt` (the ids replace
/// it).
const COMPLETIONS: &[&str] = &["prompt"];

/// A field left at its default (absent, null, false) asks nothing.
fn asks(value: &Value) -> bool {
    !value.is_null() && value != &Value::Bool(false)
}

/// Why a request does not go this way (it is then `direct`), or None if it can: fields
/// outside the allow-lists (tools, response formats, guided decoding, logprobs, `echo`,
/// `suffix`, prompt truncation, …: the decoder would restart or miss them after the first
/// token), several choices, a budget of at most one token (the prefill alone would answer it,
/// leaving the KV it pushed unclaimed in the decoder's buffer), a chat request without a budget
/// (chat runs until the end of sequence; the decode over completions would stop at vLLM's
/// completions default, [`COMPLETIONS_DEFAULT_MAX_TOKENS`]), or chat content that is not text
/// (images and audio do not survive the token ids).
pub(crate) fn carriable(body: &Map<String, Value>, chat: bool) -> Option<&'static str> {
    if body
        .get("n")
        .is_some_and(|n| asks(n) && n.as_u64() != Some(1))
    {
        return Some("n is not 1");
    }
    match budget(body) {
        Some(budget) if budget <= 1 => return Some("a budget of at most one token"),
        None if chat => return Some("a chat request without a token budget"),
        // `null` asks for no limit (up to the context), which a count cannot say.
        None if body.contains_key("max_tokens") || body.contains_key("max_completion_tokens") => {
            return Some("a budget that is not a count");
        }
        _ => {}
    }
    let allowed = |key: &str| {
        SAMPLING.contains(&key)
            || if chat {
                TEMPLATE_ONLY.contains(&key)
            } else {
                COMPLETIONS.contains(&key)
            }
    };
    if body.iter().any(|(key, value)| asks(value) && !allowed(key)) {
        return Some("a field completions over token ids do not carry the same way");
    }
    if chat && !text_only(body.get("messages")) {
        return Some("chat content that is not text");
    }
    None
}

/// Whether every message's content is a string, or parts of type `text`.
fn text_only(messages: Option<&Value>) -> bool {
    let Some(Value::Array(messages)) = messages else {
        return false;
    };
    messages.iter().all(|message| match message.get("content") {
        None | Some(Value::Null | Value::String(_)) => true,
        Some(Value::Array(parts)) => parts
            .iter()
            .all(|part| part.get("type").and_then(Value::as_str) == Some("text")),
        Some(_) => false,
    })
}

/// vLLM's `max_tokens` for a completions request that gives none (OpenAI's legacy default).
pub(crate) const COMPLETIONS_DEFAULT_MAX_TOKENS: u64 = 16;

/// The client's token budget (`max_completion_tokens`, else `max_tokens`), if it set one.
pub(crate) fn budget(body: &Map<String, Value>) -> Option<u64> {
    body.get("max_completion_tokens")
        .or_else(|| body.get("max_tokens"))
        .and_then(Value::as_u64)
}

/// Where the prefiller sends the KV cache: one decoder's LMCache receiver, for one request.
#[derive(Debug, Clone)]
pub(crate) struct DisaggSpec<'a> {
    pub req_id: &'a str,
    pub receiver: &'a switchyard_shared::LmcacheReceiver,
}

/// The completions object both hops start from: the engine's body with the template-only
/// fields gone, `max_completion_tokens` folded into `max_tokens`, and `prompt` the ids. A null
/// `n` is left out: a chat's null asks for the default, which vLLM's completions model refuses
/// as null (other nulls are carried: where both models refuse them, both hops refuse them).
fn completions(body: &Map<String, Value>, ids: &[u32]) -> Map<String, Value> {
    let mut out: Map<String, Value> = body
        .iter()
        .filter(|(key, value)| {
            !TEMPLATE_ONLY.contains(&key.as_str())
                && key.as_str() != "prompt"
                && !(key.as_str() == "n" && value.is_null())
        })
        .map(|(key, value)| (key.clone(), value.clone()))
        .collect();
    if let Some(budget) = out.remove("max_completion_tokens") {
        out.insert("max_tokens".into(), budget);
    }
    out.remove(KV_TRANSFER_PARAMS);
    out.insert("prompt".into(), json!(ids));
    out
}

/// The prefill request (see the module docs).
pub(crate) fn prefill_body(
    body: &Map<String, Value>,
    ids: &[u32],
    spec: &DisaggSpec<'_>,
    prefill: &VariantRoute,
) -> Option<Bytes> {
    let mut out = completions(body, ids);
    out.insert("max_tokens".into(), json!(1));
    out.insert("stream".into(), json!(false));
    out.remove("stream_options");
    // A client's minimum holds for the one token too: no end of sequence, and no stop string
    // while the minimum is not reached.
    let min = out
        .remove("min_tokens")
        .and_then(|min| min.as_u64())
        .unwrap_or(0);
    if min > 0 {
        out.insert("min_tokens".into(), json!(1));
    }
    if min > 1 {
        out.remove("stop");
        out.remove("stop_token_ids");
    }
    super::engine_body::with_prefill_model(&mut out, prefill);
    out.insert(
        KV_TRANSFER_PARAMS.into(),
        json!({
            "ret_first_tok": true,
            "disagg_spec": {
                "req_id": spec.req_id,
                "receiver_host": spec.receiver.host,
                "receiver_init_port": spec.receiver.init_ports,
                "receiver_alloc_port": spec.receiver.alloc_ports,
            },
        }),
    );
    serde_json::to_vec(&out).ok().map(Bytes::from)
}

/// The decode request (see the module docs): the ids and the first token, one token less of
/// budget. When the prefill's first token ended the answer (`ended`), the claim instead: one
/// token, not streamed, its answer dropped. It has the decoder take the pushed KV cache out of
/// its PD buffer (LMCache's receiver frees a chunk only once vLLM retrieves it).
pub(crate) fn decode_body(
    body: &Map<String, Value>,
    ids: &[u32],
    first_token: u32,
    ended: bool,
) -> Option<Bytes> {
    let mut prompt = Vec::with_capacity(ids.len() + 1);
    prompt.extend_from_slice(ids);
    prompt.push(first_token);
    let mut out = completions(body, &prompt);
    if ended {
        out.insert("max_tokens".into(), json!(1));
        out.insert("stream".into(), json!(false));
        for key in ["stream_options", "min_tokens"] {
            out.remove(key);
        }
    } else {
        // A completions client without a budget gets vLLM's default in all: the prefill's
        // token and one fewer from the decoder.
        if out.get("max_tokens").and_then(Value::as_u64).is_none() {
            out.insert("max_tokens".into(), json!(COMPLETIONS_DEFAULT_MAX_TOKENS));
        }
        for key in ["max_tokens", "min_tokens"] {
            if let Some(count) = out.get(key).and_then(Value::as_u64) {
                out.insert(key.into(), json!(count.saturating_sub(1)));
            }
        }
    }
    serde_json::to_vec(&out).ok().map(Bytes::from)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn object(text: &str) -> Map<String, Value> {
        serde_json::from_str(text).unwrap()
    }

    #[test]
    fn only_requests_completions_carry_losslessly_go_this_way() {
        let fine = object(
            r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":8,"temperature":0,"stream":true,"stream_options":{"include_usage":true},"chat_template_kwargs":{"x":1},"n":1}"#,
        );
        assert_eq!(carriable(&fine, true), None);
        for (body, chat) in [
            (r#"{"messages":[],"tools":[]}"#, true),
            (
                r#"{"messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"x"}}]}]}"#,
                true,
            ),
            (r#"{"messages":[],"max_tokens":1}"#, true),
            (r#"{"messages":[]}"#, true),
            (r#"{"messages":[],"max_tokens":null}"#, true),
            (r#"{"prompt":"p","max_tokens":null}"#, false),
            (
                r#"{"prompt":"p","max_tokens":9,"max_completion_tokens":null}"#,
                false,
            ),
            (r#"{"prompt":"p","structured_outputs":{"json":{}}}"#, false),
            (r#"{"prompt":"p","truncate_prompt_tokens":5}"#, false),
            (
                r#"{"messages":[],"response_format":{"type":"json_object"}}"#,
                true,
            ),
            (r#"{"messages":[],"logprobs":true}"#, true),
            (r#"{"messages":[],"n":2}"#, true),
            (r#"{"prompt":"p","echo":true}"#, false),
            (r#"{"prompt":"p","logprobs":2}"#, false),
            (r#"{"prompt":"p","suffix":"s"}"#, false),
        ] {
            assert!(carriable(&object(body), chat).is_some(), "{body}");
        }
        assert_eq!(
            carriable(
                &object(r#"{"prompt":"p","echo":false,"logprobs":null,"n":null}"#),
                false
            ),
            None
        );
    }

    #[test]
    fn the_hops_carry_the_ids_the_spec_and_the_first_token() {
        let body = object(
            r#"{"model":"d","messages":[{"role":"user","content":"hi"}],"max_completion_tokens":8,"min_tokens":2,"stream":true,"stream_options":{"include_usage":true},"add_generation_prompt":true,"kv_transfer_params":{"x":1}}"#,
        );
        let receiver = switchyard_shared::LmcacheReceiver {
            host: "10.0.0.2".into(),
            init_ports: vec![7300, 7301],
            alloc_ports: vec![7400, 7401],
            buffer_tokens: None,
        };
        let spec = DisaggSpec {
            req_id: "r1",
            receiver: &receiver,
        };
        let prefill = VariantRoute::bare("prefill", Some("p-model"), &[]);
        let sent: Value =
            serde_json::from_slice(&prefill_body(&body, &[1, 2, 3], &spec, &prefill).unwrap())
                .unwrap();
        assert_eq!(
            sent,
            json!({
                "model": "p-model", "prompt": [1, 2, 3], "max_tokens": 1, "min_tokens": 1, "stream": false,
                "kv_transfer_params": {"ret_first_tok": true, "disagg_spec": {
                    "req_id": "r1", "receiver_host": "10.0.0.2",
                    "receiver_init_port": [7300, 7301], "receiver_alloc_port": [7400, 7401]}},
            })
        );
        let decode: Value =
            serde_json::from_slice(&decode_body(&body, &[1, 2, 3], 9, false).unwrap()).unwrap();
        assert_eq!(
            decode,
            json!({
                "model": "d", "prompt": [1, 2, 3, 9], "max_tokens": 7, "min_tokens": 1,
                "stream": true, "stream_options": {"include_usage": true},
            })
        );
        assert_eq!(budget(&body), Some(8));
        // A chat's null `n` (its default) is not carried into the completions hops, whose
        // model refuses it.
        let mut with_null = body.clone();
        with_null.insert("n".into(), Value::Null);
        with_null.remove(KV_TRANSFER_PARAMS);
        assert_eq!(carriable(&with_null, true), None);
        let decode: Value =
            serde_json::from_slice(&decode_body(&with_null, &[1, 2, 3], 9, false).unwrap())
                .unwrap();
        assert!(decode.get("n").is_none(), "{decode}");
        let sent: Value =
            serde_json::from_slice(&prefill_body(&with_null, &[1, 2, 3], &spec, &prefill).unwrap())
                .unwrap();
        assert!(sent.get("n").is_none(), "{sent}");
    }

    #[test]
    fn a_completions_decode_without_a_budget_ends_where_vllms_default_would() {
        let body: Map<String, Value> =
            serde_json::from_str(r#"{"model":"m","prompt":"p","stream":true}"#).unwrap();
        assert_eq!(carriable(&body, false), None);
        let sent: Value =
            serde_json::from_slice(&decode_body(&body, &[1, 2], 3, false).unwrap()).unwrap();
        assert_eq!(
            sent["max_tokens"],
            json!(COMPLETIONS_DEFAULT_MAX_TOKENS - 1)
        );
        assert_eq!(sent["prompt"], json!([1, 2, 3]));
    }
}
