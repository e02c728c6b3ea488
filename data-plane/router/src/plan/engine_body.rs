//! The body each engine gets: every byte as the client sent it but what must change. The
//! serving variant's ModelName in `model` (whatever name the client used) and the engine's own
//! id of a previous response (`policy::openai` splices them into the original bytes); on a
//! disaggregated endpoint, no `kv_transfer_params` a client sent (only the router tells its
//! engines what to do with KV blocks), the prefill copy of a request prefilled elsewhere, and,
//! once the prefill answered, its hand-off spliced into the decoder's request (the forward
//! phase calls [`with_kv_transfer_params`]).

use bytes::Bytes;
use serde_json::value::RawValue;
use serde_json::{Value, json};
use switchyard_policy::openai::OpenAiRequest;
use switchyard_policy::openai::edit::without_field;
use switchyard_shared::KvTransferProtocol;

use crate::routing::table::VariantRoute;

/// The field vLLM's KV connectors read; on a disaggregated endpoint only the router sets it.
pub(crate) const KV_TRANSFER_PARAMS: &str = "kv_transfer_params";

/// The body for the engine: `model` rewritten to the variant's ModelName (when it differs and
/// does not name one of the variant's LoRA adapters), the previous response's id to
/// `previous_id` (a follow-up), and, on a disaggregated endpoint (`disaggregated_endpoint`),
/// any `kv_transfer_params` the client sent removed. Native bodies (`openai` None) are sent as
/// they came, but for that removal.
pub(super) fn for_engine(
    body: Bytes,
    openai: Option<&OpenAiRequest<'_>>,
    variant: &VariantRoute,
    previous_id: Option<&str>,
    disaggregated_endpoint: bool,
) -> Bytes {
    let rewritten = openai.and_then(|request| {
        let model = rewritten_model(request.model.as_deref(), variant);
        (model.is_some() || previous_id.is_some()).then(|| request.rewrite(model, previous_id))
    });
    let body = rewritten.map_or(body, Bytes::from);
    if disaggregated_endpoint {
        without_client_kv_transfer_params(body)
    } else {
        body
    }
}

/// The `model` the engine gets instead of `asked`: the variant's ModelName, when `asked` is
/// another name and none of the variant's LoRA adapters.
pub(super) fn rewritten_model<'a>(
    asked: Option<&str>,
    variant: &'a VariantRoute,
) -> Option<&'a str> {
    variant
        .model_name
        .as_deref()
        .filter(|model| asked != Some(*model) && variant.adapter(asked).is_none())
}

/// A disaggregated endpoint's request without the `kv_transfer_params` a client sent (however
/// the key is written, every copy): only the router tells its engines what to do with KV
/// blocks, on every path. CPU work over the whole body: planning calls it, off the serving
/// thread.
fn without_client_kv_transfer_params(body: Bytes) -> Bytes {
    match without_field(&body, KV_TRANSFER_PARAMS) {
        Some(stripped) => Bytes::from(stripped),
        None => body,
    }
}

/// The prefill copy of an OpenAI request, as vLLM's disaggregation proxy makes it: one token
/// (`max_tokens`, and `max_completion_tokens` if present), not streamed, no `stream_options` or
/// `min_tokens`, the prefill variant's ModelName, and for NIXL the request for a remote decode;
/// a NIXL chat also asks for its prompt's ids (`return_token_ids`), which the decoder is given
/// so that it does not render and tokenize the conversation again (vLLM 0.32's decode-side
/// token reuse, `kv_transfer_params.prompt_token_ids`), unless vLLM would not use them or the
/// client would miss what they leave out ([`asks_prompt_ids`]). `None` if the body is not a
/// JSON object (planning already refused that).
pub(crate) fn prefill_body(
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
    with_prefill_model(object, variant);
    match protocol {
        KvTransferProtocol::Nixl => {
            if asks_prompt_ids(object, body.len()) {
                object.insert("return_token_ids".into(), json!(true));
            }
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
        // Made from the token ids once they are known (`plan::lmcache`).
        KvTransferProtocol::LmcachePd => return None,
    }
    serde_json::to_vec(&value).ok().map(Bytes::from)
}

/// The largest chat body whose prefill is asked for its prompt's ids: about 64k tokens of
/// text, whose ids (up to 11 bytes each) stay within what a prefill answer may hold.
pub(crate) const MOST_REUSED_BODY_BYTES: usize = 256 * 1024;

/// Whether a NIXL prefill copy asks for its prompt's ids for the decoder: a chat (`messages`)
/// of at most [`MOST_REUSED_BODY_BYTES`], without `echo` or non-text content (vLLM renders
/// those whatever it is given) and without `return_prompt_text` (a decoder serving given ids
/// has no prompt text to return).
fn asks_prompt_ids(object: &serde_json::Map<String, Value>, body_bytes: usize) -> bool {
    let set = |name: &str| {
        object
            .get(name)
            .is_some_and(|value| !matches!(value, Value::Null | Value::Bool(false)))
    };
    let messages = object.get("messages").and_then(Value::as_array);
    messages.is_some_and(|messages| !switchyard_tokenize::reuse::non_text_content(messages))
        && body_bytes <= MOST_REUSED_BODY_BYTES
        && !set("echo")
        && !set("return_prompt_text")
}

/// `model` set to the prefill variant's ModelName, unless it names one of its LoRA adapters.
pub(crate) fn with_prefill_model(
    object: &mut serde_json::Map<String, Value>,
    variant: &VariantRoute,
) {
    let adapter = variant
        .adapter(object.get("model").and_then(Value::as_str))
        .is_some();
    if let Some(model) = &variant.model_name
        && !adapter
    {
        object.insert("model".into(), json!(model));
    }
}

/// The request with `kv_transfer_params` set to `params`, and `prompt_token_ids` in them when
/// given (a JSON array as the prefill answered it, copied as it is), spliced in after the
/// opening brace (every other byte kept). Planning removed any the client sent, so this is
/// the only one.
pub(crate) fn with_kv_transfer_params(
    body: &[u8],
    params: &Value,
    prompt_token_ids: Option<&RawValue>,
) -> Option<Bytes> {
    let mut params = serde_json::to_vec(params).ok()?;
    if let Some(ids) = prompt_token_ids {
        // `params` is an object: its closing brace gives way to the ids.
        let object = params.pop() == Some(b'}');
        if !object {
            return None;
        }
        if params.len() > 1 {
            params.push(b',');
        }
        params.extend_from_slice(br#""prompt_token_ids":"#);
        params.extend_from_slice(ids.get().as_bytes());
        params.push(b'}');
    }
    let brace = body.iter().position(|byte| *byte == b'{')?;
    let rest = &body[brace + 1..];
    let empty = rest
        .iter()
        .all(|byte| byte.is_ascii_whitespace() || *byte == b'}');
    let mut out = Vec::with_capacity(body.len() + params.len() + 24);
    out.extend_from_slice(&body[..=brace]);
    out.push(b'"');
    out.extend_from_slice(KV_TRANSFER_PARAMS.as_bytes());
    out.extend_from_slice(b"\":");
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

    fn variant(model: Option<&str>) -> VariantRoute {
        VariantRoute::bare("prefill", model, &["sql-lora"])
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
            copy["return_token_ids"], true,
            "a chat's ids go to the decoder"
        );
        assert_eq!(
            copy["kv_transfer_params"],
            json!({"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null,
                   "remote_block_ids": null, "remote_host": null, "remote_port": null})
        );
        // No max_completion_tokens is added where there was none; LMCACHE sends no params.
        let completion = |protocol| -> Value {
            let copy = prefill_body(br#"{"prompt":"x"}"#, protocol, &variant(None)).unwrap();
            serde_json::from_slice(&copy).unwrap()
        };
        let copy = completion(KvTransferProtocol::Lmcache);
        assert!(copy.get("max_completion_tokens").is_none());
        assert!(copy.get("kv_transfer_params").is_none());
        assert!(copy.get("return_token_ids").is_none());
        let copy = completion(KvTransferProtocol::Nixl);
        assert!(
            copy.get("return_token_ids").is_none(),
            "vLLM reuses a chat's ids only"
        );
        assert!(copy.get("model").is_none());
        assert!(prefill_body(b"[1]", KvTransferProtocol::Nixl, &variant(None)).is_none());
    }

    #[test]
    fn a_model_naming_one_of_the_variants_adapters_is_kept() {
        let variant = variant(Some("base"));
        for (asked, sent) in [
            ("sql-lora", "sql-lora"),
            ("other", "base"),
            ("base", "base"),
        ] {
            let body = format!(r#"{{"model":"{asked}","prompt":"x"}}"#);
            let request = OpenAiRequest::parse(body.as_bytes()).unwrap();
            let out = for_engine(
                Bytes::from(body.clone()),
                Some(&request),
                &variant,
                None,
                false,
            );
            let out: Value = serde_json::from_slice(&out).unwrap();
            assert_eq!(out["model"], sent, "{asked}");
            let copy = prefill_body(body.as_bytes(), KvTransferProtocol::Nixl, &variant).unwrap();
            let copy: Value = serde_json::from_slice(&copy).unwrap();
            assert_eq!(copy["model"], sent, "the prefill copy of {asked}");
        }
    }

    #[test]
    fn the_hand_off_is_spliced_into_the_original_bytes() {
        let params = json!({"do_remote_prefill": true, "remote_block_ids": [1, 2]});
        let spliced =
            with_kv_transfer_params(br#"{ "prompt": "x",  "stream": true }"#, &params, None)
                .unwrap();
        assert_eq!(
            std::str::from_utf8(&spliced).unwrap(),
            r#"{"kv_transfer_params":{"do_remote_prefill":true,"remote_block_ids":[1,2]}, "prompt": "x",  "stream": true }"#
        );
        let empty = with_kv_transfer_params(b"{}", &params, None).unwrap();
        let value: Value = serde_json::from_slice(&empty).unwrap();
        assert_eq!(value["kv_transfer_params"], params);
        // The prefill's prompt ids go in as they came.
        let ids: Box<RawValue> = serde_json::from_str("[1, 2,3]").unwrap();
        let with_ids = with_kv_transfer_params(b"{}", &params, Some(&ids)).unwrap();
        assert_eq!(
            std::str::from_utf8(&with_ids).unwrap(),
            r#"{"kv_transfer_params":{"do_remote_prefill":true,"remote_block_ids":[1,2],"prompt_token_ids":[1, 2,3]}}"#
        );
        let only_ids = with_kv_transfer_params(b"{}", &json!({}), Some(&ids)).unwrap();
        let value: Value = serde_json::from_slice(&only_ids).unwrap();
        assert_eq!(
            value["kv_transfer_params"],
            json!({"prompt_token_ids": [1, 2, 3]})
        );
    }

    #[test]
    fn a_chat_asks_for_its_prompt_ids_unless_vllm_would_not_use_them() {
        let asks = |body: Value| {
            let bytes = body.to_string();
            let copy = prefill_body(bytes.as_bytes(), KvTransferProtocol::Nixl, &variant(None));
            serde_json::from_slice::<Value>(&copy.unwrap()).unwrap()["return_token_ids"] == true
        };
        let text = json!([{"role": "user", "content": "hi"}]);
        assert!(asks(json!({"messages": text})));
        assert!(asks(
            json!({"messages": text, "echo": false, "return_prompt_text": null})
        ));
        assert!(!asks(json!({"messages": text, "echo": true})));
        assert!(!asks(json!({"messages": text, "return_prompt_text": true})));
        let image = json!([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]);
        assert!(!asks(json!({"messages": image})));
        let long = "x".repeat(MOST_REUSED_BODY_BYTES);
        assert!(!asks(
            json!({"messages": [{"role": "user", "content": long}]})
        ));
        assert!(!asks(json!({"prompt": "hi"})));
    }
}
