//! Response-id affinity without router state (the Responses API).
//!
//! An engine that stores a response (vLLM with `store: true`) can only answer about it
//! itself: a follow-up (`previous_response_id`), a retrieval, a deletion or a cancellation
//! must reach that instance. Routers keep no table of responses; instead, the id a client
//! sees names where the response lives. Every response id in an answer on the Responses
//! paths is wrapped:
//!
//! ```text
//! resp_sy1 + base64url_without_padding(
//!     len(endpoint) endpoint  len(variant) variant  len(instance) instance  engine_id)
//! ```
//!
//! each length one byte (names and instance ids are ASCII of at most 128 bytes), the
//! engine's own id the remaining bytes, as it sent them. The wrapping is URL-safe (letters,
//! digits, `-`, `_`), keeps OpenAI's `resp_` prefix, and round-trips exactly: unwrapping a
//! wrapped id gives back the engine's id byte for byte, and wrapping is canonical (one id,
//! one wrapping). It is opaque to clients but not secret: anyone can decode it, and a forged
//! id can only name an instance the client could reach anyway.
//!
//! On the way in, `plan` unwraps `previous_response_id` and the `{id}` of
//! `/v1/responses/{id}[/cancel]` and sends the request to the named instance only. On the way
//! out, [`adapt`] rewrites the answer as it streams: in a whole JSON answer (the response
//! object, or `{"id", "object": "response", "deleted": true}`) and in the `response` object
//! of every streamed event (`response.created`, `response.completed`, ...), the string
//! values of `id` and `previous_response_id` of an object whose `object` is `"response"` are
//! wrapped with the answering instance's names; every other byte passes unchanged. A streamed
//! answer is rewritten as it passes, line by line (an event's `data:` line is held only until
//! its end arrives, usually in the same frame); a JSON answer is held whole, up to [`HOLD_LIMIT`] bytes (beyond that it passes through
//! unrewritten, with a warning).

use std::borrow::Cow;
use std::pin::Pin;
use std::task::{Context, Poll};

use axum::body::Body;
use axum::response::Response;
use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use bytes::{Bytes, BytesMut};
use http::header;
use http_body::{Frame, SizeHint};
use serde::Deserialize;
use serde_json::value::RawValue;

/// What every wrapped id starts with: OpenAI's prefix, then Switchyard's mark and version.
pub const PREFIX: &str = "resp_sy1";

/// The longest JSON answer, or streamed line, held for rewriting.
pub const HOLD_LIMIT: usize = 8 * 1024 * 1024;

/// Where a stored response lives: the names a wrapped id carries, and the engine's own id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredResponse {
    pub endpoint: String,
    pub variant: String,
    pub instance: String,
    pub engine_id: String,
}

/// Wraps `engine_id` (see the module docs).
pub fn wrap(endpoint: &str, variant: &str, instance: &str, engine_id: &str) -> String {
    let mut payload =
        Vec::with_capacity(3 + endpoint.len() + variant.len() + instance.len() + engine_id.len());
    for name in [endpoint, variant, instance] {
        // Names and instance ids are validated to at most 128 bytes; a longer one would not
        // come back out, so it is cut (never happens with validated names).
        let name = &name.as_bytes()[..name.len().min(u8::MAX as usize)];
        payload.push(name.len() as u8);
        payload.extend_from_slice(name);
    }
    payload.extend_from_slice(engine_id.as_bytes());
    let mut wrapped = String::with_capacity(PREFIX.len() + payload.len().div_ceil(3) * 4);
    wrapped.push_str(PREFIX);
    URL_SAFE_NO_PAD.encode_string(&payload, &mut wrapped);
    wrapped
}

/// Unwraps an id made by [`wrap`]; `None` for anything else (an engine's own id, a damaged
/// or non-canonical wrapping).
pub fn unwrap(id: &str) -> Option<StoredResponse> {
    let encoded = id.strip_prefix(PREFIX)?;
    let payload = URL_SAFE_NO_PAD.decode(encoded).ok()?;
    let mut rest = payload.as_slice();
    let mut names = Vec::with_capacity(3);
    for _ in 0..3 {
        let (&length, after) = rest.split_first()?;
        let length = length as usize;
        if after.len() < length || length == 0 {
            return None;
        }
        names.push(String::from_utf8(after[..length].to_vec()).ok()?);
        rest = &after[length..];
    }
    let engine_id = String::from_utf8(rest.to_vec()).ok()?;
    if engine_id.is_empty() {
        return None;
    }
    let instance = names.pop()?;
    let variant = names.pop()?;
    let endpoint = names.pop()?;
    Some(StoredResponse {
        endpoint,
        variant,
        instance,
        engine_id,
    })
}

/// The instance that answered: the names its response ids are wrapped with.
#[derive(Debug, Clone)]
pub struct Issuer {
    pub endpoint: String,
    pub variant: String,
    pub instance: String,
}

impl Issuer {
    fn wrap(&self, engine_id: &str) -> String {
        wrap(&self.endpoint, &self.variant, &self.instance, engine_id)
    }
}

/// How an answer is framed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Framing {
    /// One JSON document.
    Json,
    /// Server-sent events, each `data:` line a JSON document.
    EventStream,
}

/// Rewrites the response ids of an answer from `issuer` (see the module docs). Answers that
/// are neither JSON nor an event stream pass unchanged.
pub fn adapt(response: Response, issuer: Issuer) -> Response {
    let content_type = response
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|value| value.to_str().ok())
        .map(|value| value.trim_start().to_ascii_lowercase())
        .unwrap_or_default();
    let framing = if content_type.starts_with("text/event-stream") {
        Framing::EventStream
    } else if content_type.starts_with("application/json") {
        Framing::Json
    } else {
        return response;
    };
    let (mut parts, body) = response.into_parts();
    // The length changes.
    parts.headers.remove(header::CONTENT_LENGTH);
    Response::from_parts(
        parts,
        Body::new(ResponseIds {
            inner: body,
            issuer,
            framing,
            held: BytesMut::new(),
            passthrough: false,
            queued: None,
            ended: false,
        }),
    )
}

/// The fields of a JSON document that may hold response ids.
#[derive(Deserialize)]
struct Document<'a> {
    #[serde(borrow, default)]
    object: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    id: Option<&'a RawValue>,
    #[serde(borrow, default)]
    previous_response_id: Option<&'a RawValue>,
    #[serde(borrow, default)]
    response: Option<&'a RawValue>,
}

/// Byte range of `raw` inside `within` (both borrowed from the same buffer).
fn span(within: &[u8], raw: &RawValue) -> std::ops::Range<usize> {
    let start = raw.get().as_ptr() as usize - within.as_ptr() as usize;
    start..start + raw.get().len()
}

/// Collects the edits for the ids of `document` (and of its `response`, for events).
fn collect_edits(
    whole: &[u8],
    document: &RawValue,
    issuer: &Issuer,
    depth: usize,
    edits: &mut Vec<(std::ops::Range<usize>, String)>,
) {
    let Ok(parsed) = serde_json::from_str::<Document<'_>>(document.get()) else {
        return;
    };
    if parsed.object.as_deref() == Some("response") {
        for raw in [parsed.id, parsed.previous_response_id]
            .into_iter()
            .flatten()
        {
            if let Ok(engine_id) = serde_json::from_str::<Cow<'_, str>>(raw.get()) {
                let wrapped = serde_json::to_string(&issuer.wrap(&engine_id))
                    .unwrap_or_else(|_| raw.get().to_owned());
                edits.push((span(whole, raw), wrapped));
            }
        }
    }
    if depth == 0
        && let Some(response) = parsed.response
    {
        collect_edits(whole, response, issuer, depth + 1, edits);
    }
}

/// `document` with its response ids wrapped; `None` when it has none (or is not JSON).
fn rewrite_document(document: &[u8], issuer: &Issuer) -> Option<Vec<u8>> {
    let text = std::str::from_utf8(document).ok()?;
    let raw: &RawValue = serde_json::from_str(text).ok()?;
    let mut edits = Vec::new();
    collect_edits(document, raw, issuer, 0, &mut edits);
    if edits.is_empty() {
        return None;
    }
    edits.sort_by_key(|(range, _)| range.start);
    let mut out = Vec::with_capacity(document.len() + edits.len() * 64);
    let mut at = 0;
    for (range, replacement) in edits {
        out.extend_from_slice(&document[at..range.start]);
        out.extend_from_slice(replacement.as_bytes());
        at = range.end;
    }
    out.extend_from_slice(&document[at..]);
    Some(out)
}

/// Event-stream lines, each `data:` line (a JSON document) rewritten.
fn rewrite_lines(event: &[u8], issuer: &Issuer, out: &mut BytesMut) {
    for line in event.split_inclusive(|byte| *byte == b'\n') {
        let Some(data) = line.strip_prefix(b"data:") else {
            out.extend_from_slice(line);
            continue;
        };
        let content = data.strip_prefix(b" ").unwrap_or(data);
        let body_end = content.len()
            - content
                .iter()
                .rev()
                .take_while(|byte| **byte == b'\n' || **byte == b'\r')
                .count();
        match rewrite_document(&content[..body_end], issuer) {
            Some(rewritten) => {
                out.extend_from_slice(&line[..line.len() - content.len()]);
                out.extend_from_slice(&rewritten);
                out.extend_from_slice(&content[body_end..]);
            }
            None => out.extend_from_slice(line),
        }
    }
}

/// The answer body with its response ids rewritten, frame by frame (see the module docs).
struct ResponseIds {
    inner: Body,
    issuer: Issuer,
    framing: Framing,
    /// Bytes of the JSON answer, or of the event-stream line not complete yet.
    held: BytesMut,
    /// Set once a document outgrew [`HOLD_LIMIT`]: the rest passes unchanged.
    passthrough: bool,
    /// A frame to send after the held bytes (trailers, or an error after a flush).
    queued: Option<Result<Frame<Bytes>, axum::Error>>,
    ended: bool,
}

impl ResponseIds {
    /// The held lines that are complete, rewritten; the incomplete rest stays held.
    fn complete_lines(&mut self) -> Option<Bytes> {
        let end = self.held.iter().rposition(|byte| *byte == b'\n')? + 1;
        let lines = self.held.split_to(end);
        let mut out = BytesMut::with_capacity(lines.len() + 128);
        rewrite_lines(&lines, &self.issuer, &mut out);
        Some(out.freeze())
    }

    /// Everything held, rewritten as a whole (the answer ended).
    fn flush(&mut self) -> Option<Bytes> {
        if self.held.is_empty() {
            return None;
        }
        let held = self.held.split();
        if self.passthrough {
            return Some(held.freeze());
        }
        match self.framing {
            Framing::Json => Some(
                rewrite_document(&held, &self.issuer)
                    .map(Bytes::from)
                    .unwrap_or_else(|| held.freeze()),
            ),
            Framing::EventStream => {
                let mut out = BytesMut::with_capacity(held.len() + 128);
                rewrite_lines(&held, &self.issuer, &mut out);
                Some(out.freeze())
            }
        }
    }
}

impl http_body::Body for ResponseIds {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let this = self.get_mut();
        if let Some(queued) = this.queued.take() {
            return Poll::Ready(Some(queued));
        }
        loop {
            if this.ended {
                return Poll::Ready(None);
            }
            match Pin::new(&mut this.inner).poll_frame(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(None) => {
                    this.ended = true;
                    if let Some(rest) = this.flush() {
                        return Poll::Ready(Some(Ok(Frame::data(rest))));
                    }
                    return Poll::Ready(None);
                }
                Poll::Ready(Some(Err(error))) => {
                    // The answer is broken: what is held was incomplete, and goes with it.
                    this.held.clear();
                    this.ended = true;
                    return Poll::Ready(Some(Err(error)));
                }
                Poll::Ready(Some(Ok(frame))) => {
                    let frame = match frame.into_data() {
                        Ok(data) if this.passthrough => {
                            return Poll::Ready(Some(Ok(Frame::data(data))));
                        }
                        Ok(data) => data,
                        Err(other) => {
                            // Trailers: after whatever is held.
                            return Poll::Ready(Some(Ok(match this.flush() {
                                Some(rest) => {
                                    this.queued = Some(Ok(other));
                                    Frame::data(rest)
                                }
                                None => other,
                            })));
                        }
                    };
                    this.held.extend_from_slice(&frame);
                    if this.framing == Framing::EventStream
                        && let Some(lines) = this.complete_lines()
                    {
                        return Poll::Ready(Some(Ok(Frame::data(lines))));
                    }
                    if this.held.len() > HOLD_LIMIT {
                        tracing::warn!(
                            instance = %this.issuer.instance,
                            limit = HOLD_LIMIT,
                            "an answer on a Responses path is too large to rewrite its ids; \
                             passing it through unchanged"
                        );
                        this.passthrough = true;
                        if let Some(held) = this.flush() {
                            return Poll::Ready(Some(Ok(Frame::data(held))));
                        }
                    }
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.queued.is_none() && self.held.is_empty() && (self.ended || self.inner.is_end_stream())
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;

    fn issuer() -> Issuer {
        Issuer {
            endpoint: "chat".into(),
            variant: "AllTraffic".into(),
            instance: "engine-2".into(),
        }
    }

    #[test]
    fn wrapped_ids_round_trip_exactly_and_are_url_safe() {
        for engine_id in [
            "resp_0123456789abcdef0123456789abcdef",
            "x",
            "ünïcode/with?query&chars",
        ] {
            let wrapped = wrap("chat", "AllTraffic", "i-7.b:c", engine_id);
            assert!(wrapped.starts_with("resp_sy1"), "{wrapped}");
            assert!(
                wrapped
                    .bytes()
                    .all(|byte| byte.is_ascii_alphanumeric() || byte == b'-' || byte == b'_'),
                "{wrapped}"
            );
            let stored = unwrap(&wrapped).unwrap();
            assert_eq!(stored.endpoint, "chat");
            assert_eq!(stored.variant, "AllTraffic");
            assert_eq!(stored.instance, "i-7.b:c");
            assert_eq!(stored.engine_id, engine_id);
            assert_eq!(
                wrap(
                    &stored.endpoint,
                    &stored.variant,
                    &stored.instance,
                    &stored.engine_id
                ),
                wrapped
            );
        }
    }

    #[test]
    fn ids_not_made_by_a_router_do_not_unwrap() {
        let no_engine_id = wrap("chat", "AllTraffic", "i", "");
        let too_short = format!("{PREFIX}{}", URL_SAFE_NO_PAD.encode([200u8, b'a']));
        for id in [
            "resp_0123456789abcdef",
            "resp_sy1",
            "resp_sy1!!!!",
            "resp_sy1A",
            no_engine_id.as_str(),
            too_short.as_str(),
            "",
        ] {
            assert_eq!(unwrap(id), None, "{id}");
        }
        // A wrapped id cut short may still decode (no checksum): it reaches the instance it
        // names, whose engine answers that it has no such response.
    }

    #[test]
    fn a_response_document_gets_its_ids_wrapped_and_nothing_else_changes() {
        let body = br#"{"id":"resp_a","object":"response","created_at":1,"output":[{"id":"msg_1","type":"message"}],"previous_response_id":"resp_p","usage":{"input_tokens":3}}"#;
        let rewritten = String::from_utf8(rewrite_document(body, &issuer()).unwrap()).unwrap();
        let expected = String::from_utf8(body.to_vec())
            .unwrap()
            .replace(
                "\"resp_a\"",
                &format!("\"{}\"", wrap("chat", "AllTraffic", "engine-2", "resp_a")),
            )
            .replace(
                "\"resp_p\"",
                &format!("\"{}\"", wrap("chat", "AllTraffic", "engine-2", "resp_p")),
            );
        assert_eq!(rewritten, expected);
        // Not a response: untouched (an error, an embedding list).
        assert_eq!(
            rewrite_document(br#"{"error":{"message":"x","code":404}}"#, &issuer()),
            None
        );
        assert_eq!(
            rewrite_document(br#"{"id":"embd-1","object":"list"}"#, &issuer()),
            None
        );
        // A null previous id stays null.
        let rewritten = rewrite_document(
            br#"{"id":"r","object":"response","previous_response_id":null}"#,
            &issuer(),
        )
        .unwrap();
        assert!(
            String::from_utf8(rewritten)
                .unwrap()
                .ends_with(r#""previous_response_id":null}"#)
        );
    }

    async fn collect(framing_type: &str, frames: Vec<&'static str>) -> String {
        let stream = futures::stream::iter(
            frames
                .into_iter()
                .map(|frame| Ok::<_, std::io::Error>(Bytes::from_static(frame.as_bytes()))),
        );
        let response = http::Response::builder()
            .header(header::CONTENT_TYPE, framing_type)
            .header(header::CONTENT_LENGTH, "999")
            .body(Body::from_stream(stream))
            .unwrap();
        let adapted = adapt(response, issuer());
        assert!(adapted.headers().get(header::CONTENT_LENGTH).is_none());
        let bytes = adapted.into_body().collect().await.unwrap().to_bytes();
        String::from_utf8(bytes.to_vec()).unwrap()
    }

    #[tokio::test]
    async fn events_split_anywhere_are_rewritten_as_they_pass() {
        let wrapped = wrap("chat", "AllTraffic", "engine-2", "resp_a");
        let events = "event: response.created\ndata: {\"type\":\"response.created\",\"response\":{\"id\":\"resp_a\",\"object\":\"response\",\"status\":\"in_progress\"},\"sequence_number\":0}\n\nevent: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\",\"item_id\":\"msg_1\",\"delta\":\"hi\"}\n\n";
        let expected = events.replace("\"resp_a\"", &format!("\"{wrapped}\""));
        // Every split point of the stream into two frames.
        for split in 0..=events.len() {
            let (first, second) = events.split_at(split);
            let first: &'static str = Box::leak(first.to_owned().into_boxed_str());
            let second: &'static str = Box::leak(second.to_owned().into_boxed_str());
            assert_eq!(
                collect("text/event-stream; charset=utf-8", vec![first, second]).await,
                expected,
                "split at {split}"
            );
        }
    }

    #[tokio::test]
    async fn a_json_answer_in_pieces_is_rewritten_whole() {
        let wrapped = wrap("chat", "AllTraffic", "engine-2", "resp_a");
        let answer = collect(
            "application/json",
            vec!["{\"id\":\"re", "sp_a\",\"object\":\"resp", "onse\"}"],
        )
        .await;
        assert_eq!(
            answer,
            format!("{{\"id\":\"{wrapped}\",\"object\":\"response\"}}")
        );
        // Other content types pass as they are.
        let response = http::Response::builder()
            .header(header::CONTENT_TYPE, "text/plain")
            .header(header::CONTENT_LENGTH, "2")
            .body(Body::from("ok"))
            .unwrap();
        assert_eq!(
            adapt(response, issuer()).headers()[header::CONTENT_LENGTH],
            "2"
        );
    }
}
