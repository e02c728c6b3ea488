//! vLLM 0.32's decode-side token reuse: a chat whose `kv_transfer_params.prompt_token_ids`
//! carry its prompt's ids (a disaggregated prefill's, asked for with `return_token_ids`) is
//! served those ids without its template being rendered and its text tokenized. vLLM does not
//! use them when the request has `echo` or a content part that is not text
//! ([`non_text_content`], its `has_non_text_content`): those need the messages rendered.

use serde_json::Value;

/// Content part types that carry text only.
const TEXT_PARTS: &[&str] = &[
    "text",
    "input_text",
    "output_text",
    "refusal",
    "thinking",
    "tool_reference",
];

/// Keys that make a part multimodal whatever its `type`.
const MEDIA_KEYS: &[&str] = &[
    "input_image",
    "image_url",
    "image_embeds",
    "audio_embeds",
    "video_embeds",
    "prompt_embeds",
    "image_pil",
    "audio_url",
    "input_audio",
    "video_url",
];

/// Whether a message of `messages` has a content part that is not text: a part whose `type`
/// (text when absent) is not one of the text types, or that carries a media key.
pub fn non_text_content(messages: &[Value]) -> bool {
    messages
        .iter()
        .filter_map(|message| message.get("content")?.as_array())
        .flatten()
        .filter_map(Value::as_object)
        .any(|part| {
            MEDIA_KEYS.iter().any(|key| part.contains_key(*key))
                || match part.get("type") {
                    None => false,
                    Some(Value::String(kind)) => !TEXT_PARTS.contains(&kind.as_str()),
                    Some(_) => true,
                }
        })
}

/// A boolean field as pydantic reads it (`true`, `1`, `1.0`, and `"true"`, `"yes"`, `"on"`,
/// `"t"`, `"y"`, `"1"` in any case, and their opposites); None for anything else, which vLLM
/// refuses.
pub fn lax_bool(value: &Value) -> Option<bool> {
    match value {
        Value::Bool(value) => Some(*value),
        Value::Number(number) => number_bool(number),
        Value::String(text) => text_bool(text),
        Value::Null | Value::Array(_) | Value::Object(_) => None,
    }
}

/// A number as pydantic's lax boolean: 1 or 0.
pub(crate) fn number_bool(number: &serde_json::Number) -> Option<bool> {
    match number.as_f64() {
        Some(1.0) => Some(true),
        Some(0.0) => Some(false),
        _ => None,
    }
}

/// A string as pydantic's lax boolean.
pub(crate) fn text_bool(text: &str) -> Option<bool> {
    match text.to_ascii_lowercase().as_str() {
        "1" | "on" | "t" | "true" | "y" | "yes" => Some(true),
        "0" | "off" | "f" | "false" | "n" | "no" => Some(false),
        _ => None,
    }
}

/// An integer as pydantic's lax mode reads one: an integer, a float without a fraction, a
/// boolean, or a string of one (spaces around, a sign, `_` between digits, `.0`).
pub fn lax_integer(value: &Value) -> Option<i64> {
    match value {
        Value::Bool(value) => Some(i64::from(*value)),
        Value::Number(number) => number.as_i64().or_else(|| {
            let float = number.as_f64()?;
            (float.fract() == 0.0 && float.abs() < 9.2e18).then_some(float as i64)
        }),
        Value::String(text) => {
            let text = text.trim();
            let (digits, fraction) = match text.split_once('.') {
                // `5.` is refused, `5.0` read as 5.
                Some((_, "")) => return None,
                Some((digits, fraction)) => (digits, fraction),
                None => (text, ""),
            };
            if !fraction.bytes().all(|byte| byte == b'0') {
                return None;
            }
            python_int(digits).and_then(|value| i64::try_from(value).ok())
        }
        Value::Null | Value::Array(_) | Value::Object(_) => None,
    }
}

/// Python's `int(text)`: spaces around, a sign, digits with single `_` between them.
pub fn python_int(text: &str) -> Option<i128> {
    let text = text.trim();
    let unsigned = text.strip_prefix(['+', '-']).unwrap_or(text);
    let well_formed = !unsigned.is_empty()
        && !unsigned.starts_with('_')
        && !unsigned.ends_with('_')
        && !unsigned.contains("__")
        && unsigned
            .bytes()
            .all(|byte| byte.is_ascii_digit() || byte == b'_');
    well_formed
        .then(|| text.replace('_', "").parse().ok())
        .flatten()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn text_parts_are_text_and_media_are_not() {
        let with =
            |content: Value| non_text_content(&[json!({"role": "user", "content": content})]);
        assert!(!with(json!("plain")));
        assert!(!with(
            json!([{"type": "text", "text": "a"}, {"text": "no type is text"}])
        ));
        assert!(!with(
            json!([{"type": "thinking", "thinking": "t"}, {"type": "refusal"}])
        ));
        assert!(with(
            json!([{"type": "image_url", "image_url": {"url": "x"}}])
        ));
        assert!(with(json!([{"type": "text", "image_url": {"url": "x"}}])));
        assert!(with(json!([{"type": "file"}])));
        assert!(with(json!([{"type": 1}])));
        assert!(!non_text_content(&[json!("not an object")]));
    }

    #[test]
    fn booleans_are_read_as_pydantic_reads_them() {
        for (value, read) in [
            (json!(true), Some(true)),
            (json!(0), Some(false)),
            (json!(1.0), Some(true)),
            (json!("Yes"), Some(true)),
            (json!("off"), Some(false)),
            (json!(2), None),
            (json!("maybe"), None),
            (Value::Null, None),
        ] {
            assert_eq!(lax_bool(&value), read, "{value}");
        }
    }
}
