//! Reads what routing needs from an OpenAI-style request body, in one borrowed pass, without
//! re-serialising it: the `model` (and where it sits, to splice in a new name), `stream`,
//! `prompt_cache_key`, `previous_response_id` (Responses API), and the text the prefix is
//! taken from (`text`: the rule below). `edit` splices new values into the original bytes
//! (`model`, `previous_response_id`) and removes a field, every other byte kept.
//!
//! ## The prefix text rule
//! Each API takes its text from its own fields ([`TextRule`]); the prefix is the first
//! `PrefixLength` characters (Unicode scalar values) of that text.
//!
//! - **Chat** (chat completions, completions, `/tokenize`): with `messages`, for each message
//!   in order, its text followed by `"\n"`. A message's text is its `content` when that is a
//!   string; when it is an array of parts, the `text` of each `text`, `input_text` or
//!   `output_text` part and the `url` of each `image_url` part (the string `image_url` of an
//!   `input_image` part), concatenated (other part types add nothing). The role is not part
//!   of the text. Without `messages`, `prompt`: a string as is; an array of strings joined
//!   with `"\n"`; an array of token ids written in decimal, separated by single spaces.
//! - **Responses** (`/v1/responses`): `instructions` followed by `"\n"` (when present), then
//!   `input` by the value rule below (an array of input items: each item's `content` as a
//!   message's text above, items separated by `"\n"`).
//! - **Input** (embeddings, `/pooling`, `/classify`): `input` by the value rule; without
//!   `input`, `messages` as for Chat.
//! - **Score** (`/score`, `/v1/score`): the first side (`queries`, `text_1` or `data_1`), `"\n"`,
//!   then the second (`documents`, `items`, `text_2` or `data_2`), each by the value rule.
//! - **Rerank** (`/rerank`, `/v1/rerank`, `/v2/rerank`): `query`, `"\n"`, then `documents`, each
//!   by the value rule.
//! - **Tokens** (`/detokenize`): `tokens` by the value rule (token ids in decimal).
//!
//! The value rule: a string as is; a number (a token id) in decimal; an object by its
//! `content` (as a message's text), else its `text` string; an array by its elements in
//! order, separated by `" "` when the array holds numbers and by `"\n"` otherwise (so an
//! array of strings is its strings in order, joined with `"\n"`; an array of arrays of token
//! ids is each array's ids, the arrays joined with `"\n"`).

pub mod edit;
mod text;

use std::borrow::Cow;
use std::ops::Range;

use serde::Deserialize;
use serde_json::value::RawValue;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    #[error("the body is not valid JSON: {0}")]
    Json(String),
    #[error("'{field}' {message}")]
    Field {
        field: &'static str,
        message: &'static str,
    },
}

/// A present field as its raw text, `null` included (plain `Option` would read null as absent).
fn present<'de, D>(deserializer: D) -> Result<Option<&'de RawValue>, D::Error>
where
    D: serde::Deserializer<'de>,
{
    <&RawValue as Deserialize>::deserialize(deserializer).map(Some)
}

/// Which fields of a body its prefix text comes from (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TextRule {
    /// Chat completions, completions, `/tokenize`: `messages`, else `prompt`.
    Chat,
    /// The Responses API: `instructions`, then `input`.
    Responses,
    /// Embeddings, pooling, classification: `input`, else `messages`.
    Input,
    /// Score: the first side, then the second.
    Score,
    /// Rerank: `query`, then `documents`.
    Rerank,
    /// Detokenize: `tokens`.
    Tokens,
}

#[derive(Deserialize)]
struct Body<'a> {
    #[serde(borrow, default, deserialize_with = "present")]
    model: Option<&'a RawValue>,
    stream: Option<serde_json::Value>,
    #[serde(borrow, default)]
    prompt_cache_key: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    messages: Option<Vec<Message<'a>>>,
    #[serde(borrow, default)]
    prompt: Option<&'a RawValue>,
    #[serde(borrow, default, deserialize_with = "present")]
    previous_response_id: Option<&'a RawValue>,
    #[serde(borrow, default)]
    instructions: Option<&'a RawValue>,
    #[serde(borrow, default)]
    input: Option<&'a RawValue>,
    #[serde(borrow, default)]
    query: Option<&'a RawValue>,
    #[serde(borrow, default)]
    documents: Option<&'a RawValue>,
    #[serde(borrow, default)]
    queries: Option<&'a RawValue>,
    #[serde(borrow, default)]
    items: Option<&'a RawValue>,
    #[serde(borrow, default)]
    text_1: Option<&'a RawValue>,
    #[serde(borrow, default)]
    text_2: Option<&'a RawValue>,
    #[serde(borrow, default)]
    data_1: Option<&'a RawValue>,
    #[serde(borrow, default)]
    data_2: Option<&'a RawValue>,
    #[serde(borrow, default)]
    tokens: Option<&'a RawValue>,
    #[serde(borrow, default)]
    priority: Option<&'a RawValue>,
    #[serde(borrow, default)]
    safety_identifier: Option<&'a RawValue>,
    #[serde(borrow, default)]
    user: Option<&'a RawValue>,
    #[serde(borrow, default)]
    cache_salt: Option<&'a RawValue>,
}

/// The fields other APIs than chat and completions take their text from.
#[derive(Default)]
struct OtherText<'a> {
    instructions: Option<&'a RawValue>,
    input: Option<&'a RawValue>,
    query: Option<&'a RawValue>,
    first_side: Option<&'a RawValue>,
    second_side: Option<&'a RawValue>,
    tokens: Option<&'a RawValue>,
}

#[derive(Deserialize)]
struct Message<'a> {
    #[serde(borrow, default)]
    content: Option<&'a RawValue>,
}

#[derive(Deserialize)]
struct Part<'a> {
    #[serde(borrow, rename = "type", default)]
    kind: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    text: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    image_url: Option<ImageUrl<'a>>,
}

/// `{"url": ...}` in chat parts; a plain string in the Responses API's `input_image` parts.
#[derive(Deserialize)]
#[serde(untagged)]
enum ImageUrl<'a> {
    Url(#[serde(borrow)] Cow<'a, str>),
    Object {
        #[serde(borrow, default)]
        url: Option<Cow<'a, str>>,
    },
}

impl ImageUrl<'_> {
    fn url(&self) -> Option<&str> {
        match self {
            ImageUrl::Url(url) => Some(url),
            ImageUrl::Object { url } => url.as_deref(),
        }
    }
}

/// An object in a value: a message or input item (`content`), or a document (`text`).
#[derive(Deserialize)]
struct Item<'a> {
    #[serde(borrow, default)]
    content: Option<&'a RawValue>,
    #[serde(borrow, default)]
    text: Option<Cow<'a, str>>,
}

/// An OpenAI request body, parsed just enough to route it.
pub struct OpenAiRequest<'a> {
    body: &'a [u8],
    /// The model name, if the body has a string `model`.
    pub model: Option<Cow<'a, str>>,
    /// Byte range of the `model` value (including its quotes) in the body.
    model_span: Option<Range<usize>>,
    pub stream: bool,
    pub prompt_cache_key: Option<Cow<'a, str>>,
    /// The Responses API's `previous_response_id`, if the body has a string one.
    pub previous_response_id: Option<Cow<'a, str>>,
    /// Byte range of the `previous_response_id` value (including its quotes) in the body.
    previous_response_id_span: Option<Range<usize>>,
    messages: Option<Vec<Message<'a>>>,
    prompt: Option<&'a RawValue>,
    other: OtherText<'a>,
    /// vLLM's `priority`, when it is an integer (lower is served first).
    pub priority: Option<i64>,
    /// Whom the request is for, for fair queueing: `safety_identifier`, else `user`, when a
    /// non-empty string.
    pub end_user: Option<Cow<'a, str>>,
    /// vLLM's `cache_salt` (a salted request reuses only blocks cached under the same salt),
    /// when a non-empty string (vLLM ignores an empty one; an engine refuses a malformed one).
    pub cache_salt: Option<Cow<'a, str>>,
}

/// Whether a body's bytes name `truncate_prompt_tokens` (written plainly: a key spelled with
/// escapes is not seen, by this and every reader of the truncation fields alike).
pub fn names_truncation(body: &[u8]) -> bool {
    memchr::memmem::find(body, b"\"truncate_prompt_tokens\"").is_some()
}

/// The fields that say what part of its prompt an engine keeps, unparsed (null is absent).
#[derive(Debug, Default, Clone, Copy)]
pub struct Truncation<'a> {
    pub truncate_prompt_tokens: Option<&'a RawValue>,
    pub truncation_side: Option<&'a RawValue>,
    pub add_special_tokens: Option<&'a RawValue>,
}

impl std::fmt::Debug for OpenAiRequest<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OpenAiRequest")
            .field("model", &self.model)
            .field("stream", &self.stream)
            .finish_non_exhaustive()
    }
}

pub(super) fn span_in(body: &[u8], raw: &RawValue) -> Range<usize> {
    let start = raw.get().as_ptr() as usize - body.as_ptr() as usize;
    start..start + raw.get().len()
}

/// A string field's value (`None` when absent or null) and where its value sits in the body
/// (`None` when absent).
type StringField<'a> = (Option<Cow<'a, str>>, Option<Range<usize>>);

/// Reads a field that must be a string (or null).
fn string_field<'a>(
    body: &'a [u8],
    raw: Option<&'a RawValue>,
    field: &'static str,
) -> Result<StringField<'a>, RequestError> {
    match raw {
        None => Ok((None, None)),
        Some(raw) if raw.get() == "null" => Ok((None, Some(span_in(body, raw)))),
        Some(raw) => {
            let value: Cow<'a, str> =
                serde_json::from_str(raw.get()).map_err(|_| RequestError::Field {
                    field,
                    message: "must be a string",
                })?;
            Ok((Some(value), Some(span_in(body, raw))))
        }
    }
}

impl<'a> OpenAiRequest<'a> {
    /// Parses an OpenAI-style body. The whole body must be valid JSON (an object).
    pub fn parse(body: &'a [u8]) -> Result<Self, RequestError> {
        // serde would also read a struct from an array; OpenAI bodies are objects.
        if body.iter().find(|byte| !byte.is_ascii_whitespace()) != Some(&b'{') {
            return Err(RequestError::Json("expected a JSON object".into()));
        }
        let parsed: Body<'a> =
            serde_json::from_slice(body).map_err(|err| RequestError::Json(err.to_string()))?;
        // A null model names nothing, but its place is kept: a new name replaces it rather
        // than adding a second `model` key.
        let (model, model_span) = string_field(body, parsed.model, "model")?;
        let (previous_response_id, previous_response_id_span) =
            string_field(body, parsed.previous_response_id, "previous_response_id")?;
        let stream = match parsed.stream {
            None | Some(serde_json::Value::Null) => false,
            Some(serde_json::Value::Bool(stream)) => stream,
            Some(_) => {
                return Err(RequestError::Field {
                    field: "stream",
                    message: "must be true or false",
                });
            }
        };
        let text = |raw: Option<&'a RawValue>| {
            raw.and_then(|raw| serde_json::from_str::<Cow<'a, str>>(raw.get()).ok())
                .filter(|text| !text.is_empty())
        };
        let end_user = text(parsed.safety_identifier).or_else(|| text(parsed.user));
        let cache_salt = text(parsed.cache_salt);
        let priority = parsed
            .priority
            .and_then(|raw| serde_json::from_str::<i64>(raw.get()).ok());
        Ok(Self {
            priority,
            end_user,
            cache_salt,
            body,
            model,
            model_span,
            stream,
            prompt_cache_key: parsed.prompt_cache_key,
            previous_response_id,
            previous_response_id_span,
            messages: parsed.messages,
            prompt: parsed.prompt,
            other: OtherText {
                instructions: parsed.instructions,
                input: parsed.input,
                query: parsed.query,
                first_side: parsed.queries.or(parsed.text_1).or(parsed.data_1),
                second_side: parsed
                    .documents
                    .or(parsed.items)
                    .or(parsed.text_2)
                    .or(parsed.data_2),
                tokens: parsed.tokens,
            },
        })
    }

    /// vLLM's `truncate_prompt_tokens`, `truncation_side` and `add_special_tokens`, unparsed
    /// (what the engine keeps of the prompt): none unless the body names
    /// `truncate_prompt_tokens`, which is looked for in its bytes; only then are its top-level
    /// fields read again (a key given twice keeps its last value, as Python reads it, where
    /// the fields routing reads refuse a second one).
    pub fn truncation(&self) -> Truncation<'a> {
        if !names_truncation(self.body) {
            return Truncation::default();
        }
        let Ok(fields) = serde_json::from_slice::<
            std::collections::BTreeMap<Cow<'a, str>, &'a RawValue>,
        >(self.body) else {
            return Truncation::default();
        };
        let field = |name: &str| {
            fields
                .get(name)
                .copied()
                .filter(|raw| raw.get().trim() != "null")
        };
        Truncation {
            truncate_prompt_tokens: field("truncate_prompt_tokens"),
            truncation_side: field("truncation_side"),
            add_special_tokens: field("add_special_tokens"),
        }
    }

    /// Whether the body has a `messages` array (a null one is none).
    pub fn has_messages(&self) -> bool {
        self.messages.is_some()
    }

    /// The body's `prompt`, unparsed.
    pub fn prompt(&self) -> Option<&'a RawValue> {
        self.prompt
    }

    /// How many messages a chat request has (0 for completions).
    pub fn message_count(&self) -> usize {
        self.messages.as_ref().map_or(0, Vec::len)
    }

    /// A completions `prompt` that is a batch of several prompts (an array of two or more
    /// strings or token-id arrays). An engine answers such a request with one hand-off for
    /// its first prompt only (vLLM returns `final_res_batch[0].kv_transfer_params`).
    pub fn is_prompt_batch(&self) -> bool {
        let Some(raw) = self.prompt.map(RawValue::get) else {
            return false;
        };
        if !raw.starts_with('[') {
            return false;
        }
        serde_json::from_str::<Vec<&RawValue>>(raw).is_ok_and(|items| {
            items.len() > 1 && items.iter().all(|item| item.get().starts_with(['"', '[']))
        })
    }

    /// A completions `prompt` given as token ids (an array of integers): how many.
    pub fn prompt_token_ids(&self) -> Option<usize> {
        let raw = self.prompt?.get();
        if !raw.starts_with('[') {
            return None;
        }
        serde_json::from_str::<Vec<u64>>(raw)
            .ok()
            .map(|ids| ids.len())
    }
}

#[cfg(test)]
mod tests {
    use super::edit::without_field;
    use super::*;

    #[test]
    fn a_field_goes_however_its_key_is_written() {
        let strip = |body: &str| {
            without_field(body.as_bytes(), "kv_transfer_params")
                .map(|out| String::from_utf8(out).unwrap())
        };
        assert_eq!(
            strip(r#"{"kv_transfer_params":{"a":1}, "model": "m" }"#).as_deref(),
            Some(r#"{ "model": "m" }"#)
        );
        assert_eq!(
            strip(r#"{"model":"m" , "kv_transfer_params":{"a":[1,2]}}"#).as_deref(),
            Some(r#"{"model":"m"}"#)
        );
        // Escaped and repeated keys: every copy goes (Python's json would take the last).
        assert_eq!(
            strip(
                r#"{"kv_transfer_para\u006ds":1,"model":"m","kv_transfer_params":2,"x":{"kv_transfer_params":3}}"#
            )
            .as_deref(),
            Some(r#"{"model":"m","x":{"kv_transfer_params":3}}"#)
        );
        assert_eq!(
            strip(r#" {"kv_transfer_params":null} "#).as_deref(),
            Some(" {} ")
        );
        // Nothing to remove, or not an object: None.
        assert_eq!(strip(r#"{"x":{"kv_transfer_params":3}}"#), None);
        assert_eq!(strip(r#"[{"kv_transfer_params":3}]"#), None);
        assert_eq!(strip(r#"{"kv_transfer_params":3"#), None);
        assert_eq!(strip("plain text"), None);
        // What remains is valid JSON with every other member.
        let out =
            strip(r#"{"a":1,"kv_transfer_params":{},"b":[2],"kv_transfer_params":0,"c":"}"}"#)
                .unwrap();
        let value: serde_json::Value = serde_json::from_str(&out).unwrap();
        assert_eq!(value, serde_json::json!({"a": 1, "b": [2], "c": "}"}));
    }

    fn prefix(body: &str, max: usize) -> String {
        OpenAiRequest::parse(body.as_bytes())
            .unwrap()
            .prefix_text(max)
    }

    #[test]
    fn chat_text_rule() {
        let body = r#"{"model":"m","messages":[
            {"role":"system","content":"You are helpful."},
            {"role":"user","content":[{"type":"text","text":"Hi "},{"type":"image_url","image_url":{"url":"http://x/a.png"}},{"type":"input_audio"}]},
            {"role":"assistant","content":null}]}"#;
        assert_eq!(
            prefix(body, 1000),
            "You are helpful.\nHi http://x/a.png\n\n"
        );
        assert_eq!(prefix(body, 7), "You are");
    }

    #[test]
    fn prefix_counts_characters_not_bytes() {
        let body = r#"{"messages":[{"role":"user","content":"héllo wörld"}]}"#;
        assert_eq!(prefix(body, 5), "héllo");
    }

    #[test]
    fn whom_a_request_is_for_is_its_safety_identifier_else_its_user() {
        let end_user = |body: &str| {
            OpenAiRequest::parse(body.as_bytes())
                .unwrap()
                .end_user
                .map(|user| user.into_owned())
        };
        let both = r#"{"prompt":"a","safety_identifier":"sid","user":"bob"}"#;
        assert_eq!(end_user(both).as_deref(), Some("sid"));
        let empty_id = r#"{"prompt":"a","safety_identifier":"","user":"bob"}"#;
        assert_eq!(end_user(empty_id).as_deref(), Some("bob"));
        assert_eq!(end_user(r#"{"prompt":"a","user":""}"#), None);
        assert_eq!(end_user(r#"{"prompt":"a","user":7}"#), None);
        assert_eq!(end_user(r#"{"prompt":"a"}"#), None);
    }

    #[test]
    fn completions_text_rule() {
        assert_eq!(prefix(r#"{"prompt":"abc"}"#, 10), "abc");
        assert_eq!(prefix(r#"{"prompt":["a","b"]}"#, 10), "a\nb");
        assert_eq!(prefix(r#"{"prompt":[1,22,333]}"#, 10), "1 22 333");
        assert_eq!(prefix(r#"{"prompt":[1,22,333]}"#, 4), "1 22");
    }

    #[test]
    fn escapes_are_decoded() {
        assert_eq!(
            prefix(
                r#"{"messages":[{"role":"user","content":"a\nb\u00e9"}]}"#,
                10
            ),
            "a\nbé\n"
        );
    }

    #[test]
    fn reads_stream_model_and_cache_key() {
        let request = OpenAiRequest::parse(
            br#"{"model":"x","stream":true,"prompt_cache_key":"tenant-1","messages":[]}"#,
        )
        .unwrap();
        assert!(request.stream);
        assert_eq!(request.model.as_deref(), Some("x"));
        assert_eq!(request.prompt_cache_key.as_deref(), Some("tenant-1"));
    }

    #[test]
    fn bad_bodies_are_refused() {
        assert!(matches!(
            OpenAiRequest::parse(b"{\"messages\":"),
            Err(RequestError::Json(_))
        ));
        assert!(matches!(
            OpenAiRequest::parse(b"[1,2]"),
            Err(RequestError::Json(_))
        ));
        assert_eq!(
            OpenAiRequest::parse(br#"{"stream":"yes"}"#).unwrap_err(),
            RequestError::Field {
                field: "stream",
                message: "must be true or false"
            }
        );
        assert!(OpenAiRequest::parse(br#"{"model":5}"#).is_err());
    }

    #[test]
    fn a_batch_is_two_or_more_prompts() {
        let batch = |body: &str| {
            OpenAiRequest::parse(body.as_bytes())
                .unwrap()
                .is_prompt_batch()
        };
        assert!(batch(r#"{"prompt":["a","b"]}"#));
        assert!(batch(r#"{"prompt":[[1,2],[3]]}"#));
        assert!(!batch(r#"{"prompt":["a"]}"#));
        assert!(!batch(r#"{"prompt":[1,2,3]}"#));
        assert!(!batch(r#"{"prompt":"a"}"#));
        assert!(!batch(r#"{"messages":[]}"#));
    }

    #[test]
    fn counts_messages_and_prompt_token_ids() {
        let chat =
            OpenAiRequest::parse(br#"{"messages":[{"content":"a"},{"content":"b"}]}"#).unwrap();
        assert_eq!(chat.message_count(), 2);
        assert_eq!(chat.prompt_token_ids(), None);
        let ids = OpenAiRequest::parse(br#"{"prompt":[1,2,3]}"#).unwrap();
        assert_eq!(ids.prompt_token_ids(), Some(3));
        assert_eq!(ids.message_count(), 0);
        let text = OpenAiRequest::parse(br#"{"prompt":["a","b"]}"#).unwrap();
        assert_eq!(text.prompt_token_ids(), None);
    }

    #[test]
    fn truncation_fields_are_read_only_when_named_and_a_repeated_key_keeps_its_last_value() {
        let read = |body: &str| {
            let request = OpenAiRequest::parse(body.as_bytes()).unwrap();
            let truncation = request.truncation();
            let text = |raw: Option<&RawValue>| raw.map(|raw| raw.get().to_owned());
            (
                text(truncation.truncate_prompt_tokens),
                text(truncation.truncation_side),
                text(truncation.add_special_tokens),
            )
        };
        assert_eq!(
            read(r#"{"prompt":"x","add_special_tokens":false}"#),
            (None, None, None)
        );
        assert_eq!(
            read(
                r#"{"prompt":"x","truncate_prompt_tokens":2,"truncation_side":"left","add_special_tokens":false}"#
            ),
            (
                Some("2".into()),
                Some(r#""left""#.into()),
                Some("false".into())
            )
        );
        // vLLM (Python's json) keeps a repeated key's last value; routing does not refuse it.
        assert_eq!(
            read(
                r#"{"prompt":"x","truncate_prompt_tokens":2,"truncate_prompt_tokens":3,"truncation_side":null}"#
            ),
            (Some("3".into()), None, None)
        );
        // Named only inside a value: nothing.
        assert_eq!(
            read(r#"{"prompt":"say \"truncate_prompt_tokens\": 4"}"#),
            (None, None, None)
        );
    }

    #[test]
    fn a_null_model_is_replaced_not_duplicated() {
        let body = br#"{"model": null, "prompt": "p"}"#;
        let request = OpenAiRequest::parse(body).unwrap();
        assert_eq!(request.model, None);
        let rewritten = request.with_model("m");
        assert_eq!(
            String::from_utf8(rewritten.clone()).unwrap(),
            r#"{"model": "m", "prompt": "p"}"#
        );
        let value: serde_json::Value = serde_json::from_slice(&rewritten).unwrap();
        assert_eq!(value["model"], "m");
    }

    #[test]
    fn debug_shows_what_routing_read() {
        let request =
            OpenAiRequest::parse(br#"{"model":"x","stream":true,"messages":[]}"#).unwrap();
        let shown = format!("{request:?}");
        assert!(
            shown.starts_with("OpenAiRequest") && shown.contains(r#"model: Some("x")"#),
            "{shown}"
        );
        assert!(shown.contains("stream: true"), "{shown}");
    }

    #[test]
    fn model_is_spliced_byte_for_byte() {
        let body = br#"{ "temperature": 0.70, "model" : "endpoint-a", "x": [1.0e3] }"#;
        let request = OpenAiRequest::parse(body).unwrap();
        assert_eq!(
            String::from_utf8(request.with_model("meta/llama")).unwrap(),
            r#"{ "temperature": 0.70, "model" : "meta/llama", "x": [1.0e3] }"#
        );
        let request = OpenAiRequest::parse(br#"{"prompt":"p"}"#).unwrap();
        assert_eq!(
            String::from_utf8(request.with_model("m")).unwrap(),
            r#"{"model":"m","prompt":"p"}"#
        );
        let request = OpenAiRequest::parse(b" { } ").unwrap();
        assert_eq!(
            String::from_utf8(request.with_model("m")).unwrap(),
            r#" {"model":"m" } "#
        );
    }

    fn text(rule: TextRule, body: &str, max: usize) -> String {
        OpenAiRequest::parse(body.as_bytes())
            .unwrap()
            .prefix_text_for(rule, max)
    }

    #[test]
    fn responses_text_is_instructions_then_input() {
        let body = r#"{"model":"m","instructions":"Be brief.","input":"Hello"}"#;
        assert_eq!(text(TextRule::Responses, body, 100), "Be brief.\nHello");
        assert_eq!(
            text(
                TextRule::Responses,
                r#"{"input":"Hello","instructions":null}"#,
                100
            ),
            "Hello"
        );
        let items = r#"{"input":[
            {"role":"user","content":"first"},
            {"type":"message","role":"user","content":[{"type":"input_text","text":"second "},{"type":"input_image","image_url":"http://x/i.png"}]},
            {"type":"function_call_output","call_id":"c","output":"42"}]}"#;
        assert_eq!(
            text(TextRule::Responses, items, 100),
            "first\nsecond http://x/i.png\n"
        );
        // The chat rule ignores `input`; the responses rule ignores `messages`.
        assert_eq!(text(TextRule::Chat, body, 100), "");
    }

    #[test]
    fn input_text_takes_strings_in_order_and_token_ids_in_decimal() {
        assert_eq!(text(TextRule::Input, r#"{"input":"abc"}"#, 100), "abc");
        assert_eq!(
            text(TextRule::Input, r#"{"input":["a","b","c"]}"#, 100),
            "a\nb\nc"
        );
        assert_eq!(
            text(TextRule::Input, r#"{"input":[1,22,333]}"#, 100),
            "1 22 333"
        );
        assert_eq!(
            text(TextRule::Input, r#"{"input":[[1,2],[3]]}"#, 100),
            "1 2\n3"
        );
        // vLLM's chat-style embeddings: `messages` when there is no `input`.
        assert_eq!(
            text(
                TextRule::Input,
                r#"{"messages":[{"role":"user","content":"hi"}]}"#,
                100
            ),
            "hi\n"
        );
        assert_eq!(
            text(TextRule::Input, r#"{"input":["abc","def"]}"#, 5),
            "abc\nd"
        );
    }

    #[test]
    fn score_rerank_and_tokens_text() {
        assert_eq!(
            text(
                TextRule::Rerank,
                r#"{"query":"q","documents":["d1",{"text":"d2"}],"top_n":1}"#,
                100
            ),
            "q\nd1\nd2"
        );
        assert_eq!(
            text(TextRule::Score, r#"{"text_1":"a","text_2":["b","c"]}"#, 100),
            "a\nb\nc"
        );
        assert_eq!(
            text(
                TextRule::Score,
                r#"{"queries":["a"],"documents":["b"]}"#,
                100
            ),
            "a\nb"
        );
        assert_eq!(
            text(
                TextRule::Score,
                r#"{"data_1":"a","data_2":{"content":[{"type":"text","text":"b"}]}}"#,
                100
            ),
            "a\nb"
        );
        assert_eq!(text(TextRule::Tokens, r#"{"tokens":[7,8]}"#, 100), "7 8");
        assert_eq!(
            text(TextRule::Chat, r#"{"prompt":"tokenize me"}"#, 100),
            "tokenize me"
        );
    }

    #[test]
    fn previous_response_id_is_read_and_spliced_with_the_model() {
        let body = br#"{"model": "chat", "input": "next", "previous_response_id": "resp_X"}"#;
        let request = OpenAiRequest::parse(body).unwrap();
        assert_eq!(request.previous_response_id.as_deref(), Some("resp_X"));
        assert_eq!(
            String::from_utf8(request.rewrite(Some("sim"), Some("resp_engine"))).unwrap(),
            r#"{"model": "sim", "input": "next", "previous_response_id": "resp_engine"}"#
        );
        assert_eq!(
            String::from_utf8(request.rewrite(None, Some("r"))).unwrap(),
            r#"{"model": "chat", "input": "next", "previous_response_id": "r"}"#
        );
        // The order of the two fields does not matter, nor does a missing model.
        let request = OpenAiRequest::parse(br#"{"previous_response_id":"a","input":"x"}"#).unwrap();
        assert_eq!(
            String::from_utf8(request.rewrite(Some("m"), Some("b"))).unwrap(),
            r#"{"model":"m","previous_response_id":"b","input":"x"}"#
        );
        assert_eq!(
            OpenAiRequest::parse(br#"{"previous_response_id":null}"#)
                .unwrap()
                .previous_response_id,
            None
        );
        assert_eq!(
            OpenAiRequest::parse(br#"{"previous_response_id":7}"#).unwrap_err(),
            RequestError::Field {
                field: "previous_response_id",
                message: "must be a string"
            }
        );
    }
}
