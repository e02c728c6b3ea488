//! A decoder that refuses a NIXL hand-off. vLLM's `kv_load_failure_policy` is `"fail"` by
//! default: a decoder whose KV pull fails ends the request with its generation error before
//! any token, as a 5xx answer, or, for a stream (whose 200 head went out at once), as an SSE
//! error event after the role chunk. Nothing was generated, so the decode can be sent again
//! without `kv_transfer_params` (the decoder prefills it itself).
//!
//! [`UpstreamBody`] is an instance's answer body with the bytes read ahead of the client put
//! back in front: the start of a stream read to see whether it opens with that error.

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use serde_json::Value;
use tokio::time::Instant;

/// The most of a stream's opening read to look for a refusal.
const MOST_OPENING_BYTES: usize = 64 * 1024;
/// The most read before the stream's first whole event: a chat's role chunk carries the whole
/// prompt's ids when the client asked `return_token_ids` (about 7 bytes a token).
const MOST_FIRST_EVENT_BYTES: usize = 8 * 1024 * 1024;

/// An instance's answer body: what was read ahead of the client, then the rest (none for an
/// answer made by the router of what an engine said), each frame of the rest through
/// `convert` when the router re-shapes the answer (LMCACHE_PD).
pub struct UpstreamBody {
    read_ahead: Option<Bytes>,
    rest: Option<Incoming>,
    convert: Option<Box<dyn Convert>>,
}

/// Re-shapes an answer's bytes as they pass: `data` for each frame (what to pass on; empty
/// holds it back), `end` once at the end (what is left to pass on).
pub trait Convert: Send + Sync {
    fn data(&mut self, data: Bytes) -> Bytes;
    fn end(&mut self) -> Bytes;
}

impl std::fmt::Debug for UpstreamBody {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UpstreamBody")
            .field("read_ahead", &self.read_ahead)
            .field("rest", &self.rest)
            .field("converted", &self.convert.is_some())
            .finish()
    }
}

impl From<Incoming> for UpstreamBody {
    fn from(rest: Incoming) -> Self {
        Self {
            read_ahead: None,
            rest: Some(rest),
            convert: None,
        }
    }
}

impl UpstreamBody {
    /// A whole answer the router made.
    pub fn made(bytes: Bytes) -> Self {
        Self {
            read_ahead: Some(bytes),
            rest: None,
            convert: None,
        }
    }

    /// This answer with `head` sent first and the rest through `convert`.
    pub fn converted(self, head: Option<Bytes>, mut convert: Box<dyn Convert>) -> Self {
        let ahead = self.read_ahead.map(|ahead| convert.data(ahead));
        let mut joined = BytesMut::new();
        for part in [head, ahead].into_iter().flatten() {
            joined.extend_from_slice(&part);
        }
        let read_ahead = (!joined.is_empty()).then(|| joined.freeze());
        Self {
            read_ahead,
            rest: self.rest,
            convert: Some(convert),
        }
    }
}

impl Body for UpstreamBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let this = self.get_mut();
        if let Some(read_ahead) = this.read_ahead.take() {
            return Poll::Ready(Some(Ok(Frame::data(read_ahead))));
        }
        loop {
            let Some(rest) = this.rest.as_mut() else {
                return Poll::Ready(this.convert.take().and_then(|mut convert| {
                    let tail = convert.end();
                    (!tail.is_empty()).then(|| Ok(Frame::data(tail)))
                }));
            };
            let frame = std::task::ready!(Pin::new(rest).poll_frame(cx));
            let Some(convert) = this.convert.as_mut() else {
                return Poll::Ready(frame);
            };
            match frame {
                None => this.rest = None,
                Some(Ok(frame)) => match frame.into_data() {
                    Ok(data) => {
                        let out = convert.data(data);
                        if !out.is_empty() {
                            return Poll::Ready(Some(Ok(Frame::data(out))));
                        }
                    }
                    Err(frame) => return Poll::Ready(Some(Ok(frame))),
                },
                Some(Err(err)) => return Poll::Ready(Some(Err(err))),
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.read_ahead.is_none()
            && self.convert.is_none()
            && self.rest.as_ref().is_none_or(Body::is_end_stream)
    }

    fn size_hint(&self) -> SizeHint {
        let ahead = self
            .read_ahead
            .as_ref()
            .map_or(0, |bytes| bytes.len() as u64);
        let rest = match (&self.rest, &self.convert) {
            (Some(rest), None) => rest.size_hint(),
            (None, None) => SizeHint::with_exact(0),
            _ => SizeHint::new(),
        };
        let mut hint = SizeHint::new();
        hint.set_lower(rest.lower() + ahead);
        if let Some(upper) = rest.upper() {
            hint.set_upper(upper + ahead);
        }
        hint
    }
}

/// What a decoder did with a hand-off, as far as the start of its answer tells.
#[derive(Debug)]
pub enum Decoded {
    /// Its answer, to relay (any bytes read ahead put back), and when its last frame read
    /// ahead arrived (the head's time if none was): the stream's idle clock runs from there.
    Answer(http::Response<UpstreamBody>, Instant),
    /// It refused the hand-off before generating anything: why, for the log.
    Refused(String),
}

/// vLLM's status (and SSE error `code`) for a request its engine failed to generate, a failed
/// KV load among them. Other 5xx (a proxy's 502 or 504, an overloaded 503) are not refusals:
/// the engine may still be generating, or would refuse again at once.
const GENERATION_ERROR: u64 = 500;

/// An OpenAI error object's `code`, a number or a numeric string (servers write both).
pub(crate) fn error_code(error: &Value) -> Option<u64> {
    let code = error.get("code")?;
    code.as_u64()
        .or_else(|| code.as_str().and_then(|code| code.trim().parse().ok()))
}

/// Reads as much of a decoder's answer to a hand-off as tells whether it refused it: status
/// 500; or, for an SSE stream, events up to the first that is not a bare role chunk, read
/// within `idle` in all (comments do not extend it) and [`MOST_OPENING_BYTES`] after the first
/// event (which may take up to [`MOST_FIRST_EVENT_BYTES`]); that event an
/// error with code 500. Anything else (tokens, another status, a stall, a cut) is the answer,
/// relayed as it came.
pub async fn decoded(response: http::Response<Incoming>, idle: Duration) -> Decoded {
    let status = response.status();
    let mut last_frame = Instant::now();
    if u64::from(status.as_u16()) == GENERATION_ERROR {
        return Decoded::Refused(format!("the decoder answered {status}"));
    }
    let (parts, mut rest) = response.into_parts();
    let is_stream = parts
        .headers
        .get(http::header::CONTENT_TYPE)
        .and_then(|value| value.to_str().ok())
        .is_some_and(|value| value.trim_start().starts_with("text/event-stream"));
    if !status.is_success() || !is_stream {
        return Decoded::Answer(http::Response::from_parts(parts, rest.into()), last_frame);
    }
    let deadline = last_frame + idle;
    let mut opening = BytesMut::new();
    // Whether a line ended since the verdict was last taken (an event ends with a blank line):
    // a long first event is not scanned again for every frame of it.
    let mut ended_line = true;
    // Where the first whole event ends: the opening's budget counts from there.
    let mut first_event_end: Option<usize> = None;
    let verdict = loop {
        let verdict = if ended_line {
            first_event_end = first_event_end.or_else(|| {
                let end = |pattern: &[u8]| {
                    opening
                        .windows(pattern.len())
                        .position(|window| window == pattern)
                        .map(|at| at + pattern.len())
                };
                end(b"\n\n").into_iter().chain(end(b"\r\n\r\n")).min()
            });
            opening_verdict(&opening)
        } else {
            Verdict::Undecided
        };
        let budget = match first_event_end {
            Some(end) => end + MOST_OPENING_BYTES,
            None => MOST_FIRST_EVENT_BYTES,
        };
        match verdict {
            Verdict::Undecided if opening.len() < budget.max(MOST_OPENING_BYTES) => {}
            Verdict::Refused(why) => break Some(why),
            _ => break None,
        }
        match tokio::time::timeout_at(deadline, rest.frame()).await {
            Ok(Some(Ok(frame))) => {
                last_frame = Instant::now();
                if let Ok(data) = frame.into_data() {
                    ended_line = data.contains(&b'\n');
                    opening.extend_from_slice(&data);
                }
            }
            // Ended, cut or stalled: relayed as it is, the client's answer says what happened.
            _ => break None,
        }
    };
    match verdict {
        Some(why) => Decoded::Refused(why),
        None => Decoded::Answer(
            http::Response::from_parts(
                parts,
                UpstreamBody {
                    read_ahead: (!opening.is_empty()).then(|| opening.freeze()),
                    rest: Some(rest),
                    convert: None,
                },
            ),
            last_frame,
        ),
    }
}

/// An engine's 400 to a request sent to a data-parallel rank it does not have (vLLM:
/// `data_parallel_rank R is out of range [0, N).`: a registered size larger than the
/// engine's, or an engine restarted with fewer ranks): why, to send it again without the
/// rank. Any other answer is relayed as it came (the body read so far put back), read for at
/// most `within` and [`MOST_OPENING_BYTES`].
pub async fn rank_refused(
    response: http::Response<Incoming>,
    within: Duration,
) -> Result<http::Response<UpstreamBody>, String> {
    if response.status() != http::StatusCode::BAD_REQUEST {
        return Ok(response.map(UpstreamBody::from));
    }
    let (parts, mut rest) = response.into_parts();
    let deadline = Instant::now() + within;
    let mut read = BytesMut::new();
    while read.len() < MOST_OPENING_BYTES && !rest.is_end_stream() {
        match tokio::time::timeout_at(deadline, rest.frame()).await {
            Ok(Some(Ok(frame))) => {
                if let Ok(data) = frame.into_data() {
                    read.extend_from_slice(&data);
                }
            }
            _ => break,
        }
    }
    let text = String::from_utf8_lossy(&read);
    if text.contains("data_parallel_rank") && text.contains("out of range") {
        let message = serde_json::from_slice::<Value>(&read)
            .ok()
            .and_then(|body| {
                let error = body.get("error")?;
                Some(error.get("message")?.as_str()?.to_owned())
            })
            .unwrap_or_else(|| text.chars().take(200).collect());
        return Err(message);
    }
    Ok(http::Response::from_parts(
        parts,
        UpstreamBody {
            read_ahead: (!read.is_empty()).then(|| read.freeze()),
            rest: Some(rest),
            convert: None,
        },
    ))
}

#[derive(Debug, PartialEq, Eq)]
enum Verdict {
    /// Only whole bare role chunks so far, or no whole event.
    Undecided,
    /// The first other event is not an engine error.
    Relay,
    Refused(String),
}

/// What the whole SSE events at the start of a stream say.
fn opening_verdict(opening: &[u8]) -> Verdict {
    let text = String::from_utf8_lossy(opening).replace("\r\n", "\n");
    let mut events: Vec<&str> = text.split("\n\n").collect();
    // The last piece is not a whole event (yet).
    events.pop();
    for event in events {
        let data: String = event
            .lines()
            .filter_map(|line| line.strip_prefix("data:"))
            .map(|data| data.strip_prefix(' ').unwrap_or(data))
            .collect::<Vec<_>>()
            .join("\n");
        if data.is_empty() {
            // A comment or an event without data.
            continue;
        }
        let Ok(value) = serde_json::from_str::<Value>(&data) else {
            return Verdict::Relay;
        };
        if let Some(error) = value.get("error") {
            let code = error_code(error).unwrap_or(0);
            if code == GENERATION_ERROR {
                let message = error.get("message").and_then(Value::as_str).unwrap_or("");
                return Verdict::Refused(format!(
                    "the decoder's stream opened with error {code} ({message})"
                ));
            }
            return Verdict::Relay;
        }
        if !is_bare_role_chunk(&value) {
            return Verdict::Relay;
        }
    }
    Verdict::Undecided
}

/// A chat chunk that only opens the assistant's message: a role, no content, no finish.
fn is_bare_role_chunk(chunk: &Value) -> bool {
    let Some(choices) = chunk.get("choices").and_then(Value::as_array) else {
        return false;
    };
    !choices.is_empty()
        && choices.iter().all(|choice| {
            choice.get("finish_reason").is_none_or(Value::is_null)
                && choice.get("delta").is_some_and(|delta| {
                    delta.get("role").is_some()
                        && delta
                            .get("content")
                            .is_none_or(|content| content.as_str().is_some_and(str::is_empty))
                        && delta.get("tool_calls").is_none()
                        && delta.get("reasoning_content").is_none()
                })
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    const ROLE: &str = r#"data: {"id":"c","choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}"#;
    const ERROR: &str = r#"data: {"error":{"message":"Internal server error","type":"InternalServerError","param":null,"code":500}}"#;

    #[test]
    fn an_engine_error_before_any_token_is_a_refusal() {
        let refused = |text: &str| matches!(opening_verdict(text.as_bytes()), Verdict::Refused(_));
        assert!(refused(&format!("{ROLE}\n\n{ERROR}\n\ndata: [DONE]\n\n")));
        assert!(refused(&format!("{ERROR}\n\n")));
        assert!(refused(&format!("{ROLE}\r\n\r\n{ERROR}\r\n\r\n")));
        assert!(refused(&format!(": ping\n\n{ROLE}\n\n{ERROR}\n\n")));
        assert!(refused(&format!("{}\n\n", ERROR.replace("500", "\"500\""))));
    }

    #[test]
    fn only_a_generation_error_refuses_other_server_errors_are_the_answer() {
        for code in ["502", "503", "504", "\"503\"", "null", "\"x\""] {
            let event = format!("{}\n\n", ERROR.replace("500", code));
            assert_eq!(opening_verdict(event.as_bytes()), Verdict::Relay, "{code}");
        }
        assert_eq!(error_code(&serde_json::json!({"code": " 500 "})), Some(500));
        assert_eq!(error_code(&serde_json::json!({"message": "m"})), None);
    }

    #[test]
    fn tokens_client_errors_and_half_events_are_not() {
        let token = r#"data: {"id":"c","choices":[{"index":0,"delta":{"content":"Hi"},"finish_reason":null}]}"#;
        let client_error =
            r#"data: {"error":{"message":"bad","type":"BadRequestError","param":null,"code":400}}"#;
        let verdict = |text: String| opening_verdict(text.as_bytes());
        assert_eq!(
            verdict(format!("{ROLE}\n\n{token}\n\n{ERROR}\n\n")),
            Verdict::Relay
        );
        assert_eq!(verdict(format!("{client_error}\n\n")), Verdict::Relay);
        assert_eq!(verdict("data: [DONE]\n\n".into()), Verdict::Relay);
        assert_eq!(verdict(format!("{ROLE}\n\n")), Verdict::Undecided);
        assert_eq!(verdict(ERROR[..40].to_owned()), Verdict::Undecided);
        let completion =
            r#"data: {"id":"c","choices":[{"index":0,"text":"Hi","finish_reason":null}]}"#;
        assert_eq!(verdict(format!("{completion}\n\n")), Verdict::Relay);
    }
}
