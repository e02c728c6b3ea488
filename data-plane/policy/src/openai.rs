//! Reads what routing needs from an OpenAI-style request body, in one borrowed pass, without
//! re-serialising it: the `model` (and where it sits, to splice in a new name), `stream`,
//! `prompt_cache_key`, and the message text the prefix is taken from.
//!
//! ## The prefix text rule
//! - Chat (`messages`): for each message in order, its text followed by `"\n"`. A message's
//!   text is its `content` when that is a string; when it is an array of parts, the `text` of
//!   each `{"type":"text"}` part and the `url` of each `{"type":"image_url"}` part, concatenated
//!   (other part types add nothing). The role is not part of the text.
//! - Completions (`prompt`): a string as is; an array of strings joined with `"\n"`; an array
//!   of token ids written in decimal, separated by single spaces.
//! - The prefix is the first `PrefixLength` characters (Unicode scalar values) of that text.

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

#[derive(Deserialize)]
struct Body<'a> {
    #[serde(borrow, default, deserialize_with = "present")]
    model: Option<&'a RawValue>,
    #[serde(default)]
    stream: Option<serde_json::Value>,
    #[serde(borrow, default)]
    prompt_cache_key: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    messages: Option<Vec<Message<'a>>>,
    #[serde(borrow, default)]
    prompt: Option<&'a RawValue>,
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

#[derive(Deserialize)]
struct ImageUrl<'a> {
    #[serde(borrow, default)]
    url: Option<Cow<'a, str>>,
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
    messages: Option<Vec<Message<'a>>>,
    prompt: Option<&'a RawValue>,
}

impl std::fmt::Debug for OpenAiRequest<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OpenAiRequest")
            .field("model", &self.model)
            .field("stream", &self.stream)
            .finish_non_exhaustive()
    }
}

fn span_in(body: &[u8], raw: &RawValue) -> Range<usize> {
    let start = raw.get().as_ptr() as usize - body.as_ptr() as usize;
    start..start + raw.get().len()
}

impl<'a> OpenAiRequest<'a> {
    /// Parses a chat or completions body. The whole body must be valid JSON (an object).
    pub fn parse(body: &'a [u8]) -> Result<Self, RequestError> {
        // serde would also read a struct from an array; OpenAI bodies are objects.
        if body.iter().find(|byte| !byte.is_ascii_whitespace()) != Some(&b'{') {
            return Err(RequestError::Json("expected a JSON object".into()));
        }
        let parsed: Body<'a> =
            serde_json::from_slice(body).map_err(|err| RequestError::Json(err.to_string()))?;
        let (model, model_span) = match parsed.model {
            None => (None, None),
            // A null model names nothing, but its place is kept: a new name replaces it
            // rather than adding a second `model` key.
            Some(raw) if raw.get() == "null" => (None, Some(span_in(body, raw))),
            Some(raw) => {
                let name: Cow<'a, str> =
                    serde_json::from_str(raw.get()).map_err(|_| RequestError::Field {
                        field: "model",
                        message: "must be a string",
                    })?;
                (Some(name), Some(span_in(body, raw)))
            }
        };
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
        Ok(Self {
            body,
            model,
            model_span,
            stream,
            prompt_cache_key: parsed.prompt_cache_key,
            messages: parsed.messages,
            prompt: parsed.prompt,
        })
    }

    /// The first `max_chars` characters of the prefix text (see the module docs).
    pub fn prefix_text(&self, max_chars: usize) -> String {
        let mut out = PrefixBuilder::new(max_chars);
        if let Some(messages) = &self.messages {
            for message in messages {
                if out.full() {
                    break;
                }
                if let Some(content) = message.content {
                    content_text(content, &mut out);
                }
                out.push("\n");
            }
        } else if let Some(prompt) = self.prompt {
            prompt_text(prompt, &mut out);
        }
        out.text
    }

    /// The body with `model` set to `name` (added when absent); everything else byte for byte.
    pub fn with_model(&self, name: &str) -> Vec<u8> {
        let quoted = serde_json::to_string(name).unwrap_or_else(|_| "\"\"".into());
        match &self.model_span {
            Some(span) => {
                let mut out = Vec::with_capacity(self.body.len() + quoted.len());
                out.extend_from_slice(&self.body[..span.start]);
                out.extend_from_slice(quoted.as_bytes());
                out.extend_from_slice(&self.body[span.end..]);
                out
            }
            None => {
                // Insert right after the opening brace.
                let brace = self.body.iter().position(|byte| *byte == b'{').unwrap_or(0);
                let rest = &self.body[brace + 1..];
                let empty = rest
                    .iter()
                    .all(|byte| byte.is_ascii_whitespace() || *byte == b'}');
                let mut out = Vec::with_capacity(self.body.len() + quoted.len() + 10);
                out.extend_from_slice(&self.body[..=brace]);
                out.extend_from_slice(b"\"model\":");
                out.extend_from_slice(quoted.as_bytes());
                if !empty {
                    out.push(b',');
                }
                out.extend_from_slice(rest);
                out
            }
        }
    }
}

struct PrefixBuilder {
    text: String,
    remaining: usize,
}

impl PrefixBuilder {
    fn new(max_chars: usize) -> Self {
        Self {
            text: String::with_capacity(max_chars.min(1 << 16)),
            remaining: max_chars,
        }
    }

    fn full(&self) -> bool {
        self.remaining == 0
    }

    fn push(&mut self, piece: &str) {
        if self.remaining == 0 {
            return;
        }
        // Fast path: ASCII-only pieces count bytes.
        if piece.len() <= self.remaining && piece.is_ascii() {
            self.text.push_str(piece);
            self.remaining -= piece.len();
            return;
        }
        for c in piece.chars() {
            if self.remaining == 0 {
                return;
            }
            self.text.push(c);
            self.remaining -= 1;
        }
    }
}

fn content_text(content: &RawValue, out: &mut PrefixBuilder) {
    let raw = content.get();
    match raw.as_bytes().first() {
        Some(b'"') => {
            if let Ok(text) = serde_json::from_str::<Cow<'_, str>>(raw) {
                out.push(&text);
            }
        }
        Some(b'[') => {
            if let Ok(parts) = serde_json::from_str::<Vec<Part<'_>>>(raw) {
                for part in parts {
                    match part.kind.as_deref() {
                        Some("text") => {
                            if let Some(text) = &part.text {
                                out.push(text);
                            }
                        }
                        Some("image_url") => {
                            if let Some(url) = part.image_url.as_ref().and_then(|i| i.url.as_ref())
                            {
                                out.push(url);
                            }
                        }
                        _ => {}
                    }
                }
            }
        }
        _ => {}
    }
}

fn prompt_text(prompt: &RawValue, out: &mut PrefixBuilder) {
    let raw = prompt.get();
    match raw.as_bytes().first() {
        Some(b'"') => {
            if let Ok(text) = serde_json::from_str::<Cow<'_, str>>(raw) {
                out.push(&text);
            }
        }
        Some(b'[') => {
            if let Ok(texts) = serde_json::from_str::<Vec<Cow<'_, str>>>(raw) {
                for (index, text) in texts.iter().enumerate() {
                    if index > 0 {
                        out.push("\n");
                    }
                    out.push(text);
                }
            } else if let Ok(tokens) = serde_json::from_str::<Vec<u64>>(raw) {
                let mut buffer = String::with_capacity(20);
                for (index, token) in tokens.iter().enumerate() {
                    if out.full() {
                        break;
                    }
                    if index > 0 {
                        out.push(" ");
                    }
                    buffer.clear();
                    use std::fmt::Write as _;
                    let _ = write!(buffer, "{token}");
                    out.push(&buffer);
                }
            }
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
