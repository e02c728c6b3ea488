//! The load generator's HTTP client: pooled keep-alive connections with `TCP_NODELAY`, one
//! streaming (SSE) request at a time per caller, timed on the wall clock.
//!
//! - **TTFT**: from just before the request is sent to the arrival of the first SSE event
//!   that carries text (a chat `delta.content` or a completion `text`, non-empty);
//! - **ITL**: the gaps between consecutive text-carrying events;
//! - **e2e**: to the end of the body (`data: [DONE]`).
//!
//! The usage event (`stream_options.include_usage`) gives prompt, completion and cached
//! tokens; without it, completion tokens are the text events counted.

use std::time::{Duration, Instant};

use bytes::{Buf, Bytes, BytesMut};
use http_body_util::{BodyExt, Full};
use serde::Deserialize;
use switchyard_testkit::http::header_text;

pub use switchyard_cluster::http::{HttpClient, http_client};

/// What one request measured.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Outcome {
    pub status: u16,
    /// `x-switchyard-instance` (routers only).
    pub instance: Option<String>,
    /// `x-switchyard-route` (routers only).
    pub route: Option<String>,
    /// `x-switchyard-prompt-tokens`: the prompt's tokens as a disaggregating router counted
    /// them (`N`, or `N+` when it stopped counting past its threshold).
    pub router_prompt_tokens: Option<String>,
    /// `Retry-After`, on a refusal.
    pub retry_after: Option<String>,
    /// `x-switchyard-queue-ms`: how long the request waited in the router's flow-control
    /// queue (routers with MaxInFlightPerInstance only).
    pub queue_ms: Option<f64>,
    /// `x-switchyard-decision-us`: the router's time from the request's arrival to its
    /// routing decision (routers only).
    pub decision_us: Option<u64>,
    pub ttft: Option<Duration>,
    /// Gaps between consecutive text events.
    pub itl: Vec<Duration>,
    pub e2e: Duration,
    /// Text events received.
    pub text_events: u32,
    pub prompt_tokens: Option<u32>,
    pub completion_tokens: Option<u32>,
    pub cached_tokens: Option<u32>,
    /// Set when the request failed (status, transport, or an error event in the stream).
    pub error: Option<String>,
}

impl Outcome {
    pub fn ok(&self) -> bool {
        self.error.is_none()
    }

    /// Completion tokens from usage, else the text events counted.
    pub fn output_tokens(&self) -> u32 {
        self.completion_tokens.unwrap_or(self.text_events)
    }
}

/// POSTs `body` to `url` and reads the SSE answer to its end, or until `timeout`.
pub async fn stream_request(
    client: &HttpClient,
    url: &http::Uri,
    body: Bytes,
    timeout: Duration,
) -> Outcome {
    let started = Instant::now();
    match tokio::time::timeout(timeout, exchange(client, url, body, started)).await {
        Ok(outcome) => outcome,
        Err(_) => Outcome {
            e2e: started.elapsed(),
            error: Some(format!("no complete answer within {timeout:?}")),
            ..Outcome::default()
        },
    }
}

async fn exchange(client: &HttpClient, url: &http::Uri, body: Bytes, started: Instant) -> Outcome {
    let mut outcome = Outcome::default();
    let request = http::Request::post(url.clone())
        .header(http::header::CONTENT_TYPE, "application/json")
        .header(http::header::ACCEPT, "text/event-stream")
        .body(Full::new(body));
    let request = match request {
        Ok(request) => request,
        Err(err) => {
            outcome.error = Some(format!("bad request: {err}"));
            return outcome;
        }
    };
    let response = match client.request(request).await {
        Ok(response) => response,
        Err(err) => {
            outcome.e2e = started.elapsed();
            outcome.error = Some(describe(&err));
            return outcome;
        }
    };
    outcome.status = response.status().as_u16();
    let header = |name: &str| header_text(response.headers(), name).map(str::to_owned);
    outcome.instance = header("x-switchyard-instance");
    outcome.route = header("x-switchyard-route");
    outcome.router_prompt_tokens = header("x-switchyard-prompt-tokens");
    outcome.retry_after = header("retry-after");
    outcome.queue_ms = header("x-switchyard-queue-ms").and_then(|ms| ms.parse().ok());
    outcome.decision_us = header("x-switchyard-decision-us").and_then(|us| us.parse().ok());
    let mut body = response.into_body();
    let success = (200..300).contains(&outcome.status);
    let mut events = SseBuffer::default();
    let mut last_text: Option<Instant> = None;
    let mut error_text = Vec::new();
    while let Some(frame) = body.frame().await {
        let frame = match frame {
            Ok(frame) => frame,
            Err(err) => {
                outcome.error = Some(format!("the answer broke off: {err}"));
                break;
            }
        };
        let Ok(data) = frame.into_data() else {
            continue;
        };
        let now = Instant::now();
        if !success {
            error_text.extend_from_slice(&data);
            continue;
        }
        events.push(&data);
        while let Some(event) = events.next_event() {
            match parse_event(&event) {
                Event::Text => {
                    match last_text {
                        None => outcome.ttft = Some(now - started),
                        Some(previous) => outcome.itl.push(now - previous),
                    }
                    last_text = Some(now);
                    outcome.text_events += 1;
                }
                Event::Usage(usage) => {
                    outcome.prompt_tokens = Some(usage.prompt_tokens);
                    outcome.completion_tokens = Some(usage.completion_tokens);
                    outcome.cached_tokens = usage
                        .prompt_tokens_details
                        .map(|details| details.cached_tokens);
                }
                Event::Error(message) => outcome.error = Some(message),
                Event::Other => {}
            }
        }
    }
    outcome.e2e = started.elapsed();
    if !success {
        let text = String::from_utf8_lossy(&error_text);
        outcome.error = Some(format!(
            "status {}: {}",
            outcome.status,
            text.chars().take(300).collect::<String>()
        ));
    } else if outcome.error.is_none() && outcome.text_events == 0 {
        outcome.error = Some("the stream carried no text".into());
    }
    outcome
}

fn describe(err: &hyper_util::client::legacy::Error) -> String {
    let mut message = err.to_string();
    let mut source = std::error::Error::source(err);
    while let Some(inner) = source {
        message.push_str(": ");
        message.push_str(&inner.to_string());
        source = inner.source();
    }
    message
}

/// Accumulates body bytes and yields complete SSE events (their `data:` payloads joined).
#[derive(Debug, Default)]
pub struct SseBuffer {
    buffer: BytesMut,
}

impl SseBuffer {
    pub fn push(&mut self, data: &[u8]) {
        self.buffer.extend_from_slice(data);
    }

    /// The next complete event's data, if one is buffered.
    pub fn next_event(&mut self) -> Option<Vec<u8>> {
        loop {
            let end = find_event_end(&self.buffer)?;
            let (event_len, separator) = end;
            let event = self.buffer.split_to(event_len);
            self.buffer.advance(separator);
            let mut data = Vec::new();
            for line in event[..].split(|&byte| byte == b'\n') {
                let line = line.strip_suffix(b"\r").unwrap_or(line);
                if let Some(payload) = line.strip_prefix(b"data:") {
                    if !data.is_empty() {
                        data.push(b'\n');
                    }
                    data.extend_from_slice(payload.strip_prefix(b" ").unwrap_or(payload));
                }
            }
            if !data.is_empty() {
                return Some(data);
            }
        }
    }
}

/// (length of the event, length of the blank-line separator after it).
fn find_event_end(buffer: &[u8]) -> Option<(usize, usize)> {
    let mut index = 0;
    while index + 1 < buffer.len() {
        if buffer[index] == b'\n' {
            if buffer[index + 1] == b'\n' {
                return Some((index, 2));
            }
            if buffer[index + 1] == b'\r' && buffer.get(index + 2) == Some(&b'\n') {
                return Some((index, 3));
            }
        }
        index += 1;
    }
    None
}

#[derive(Debug, PartialEq)]
enum Event {
    Text,
    Usage(Usage),
    Error(String),
    Other,
}

#[derive(Debug, Deserialize, PartialEq)]
struct Usage {
    #[serde(default)]
    prompt_tokens: u32,
    #[serde(default)]
    completion_tokens: u32,
    prompt_tokens_details: Option<PromptDetails>,
}

#[derive(Debug, Deserialize, PartialEq)]
struct PromptDetails {
    #[serde(default)]
    cached_tokens: u32,
}

#[derive(Deserialize)]
struct Chunk {
    #[serde(default)]
    choices: Vec<Choice>,
    usage: Option<Usage>,
    error: Option<serde_json::Value>,
}

#[derive(Deserialize)]
struct Choice {
    delta: Option<Delta>,
    text: Option<String>,
}

#[derive(Deserialize)]
struct Delta {
    content: Option<String>,
}

fn parse_event(data: &[u8]) -> Event {
    if data == b"[DONE]" {
        return Event::Other;
    }
    let Ok(chunk) = serde_json::from_slice::<Chunk>(data) else {
        return Event::Other;
    };
    if let Some(error) = chunk.error {
        let message = error
            .get("message")
            .and_then(serde_json::Value::as_str)
            .map_or_else(|| error.to_string(), str::to_owned);
        return Event::Error(format!("error event: {message}"));
    }
    let has_text = chunk.choices.iter().any(|choice| {
        let delta = choice
            .delta
            .as_ref()
            .and_then(|delta| delta.content.as_deref());
        delta
            .or(choice.text.as_deref())
            .is_some_and(|text| !text.is_empty())
    });
    if has_text {
        return Event::Text;
    }
    match chunk.usage {
        Some(usage) => Event::Usage(usage),
        None => Event::Other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sse_events_split_across_frames() {
        let mut buffer = SseBuffer::default();
        buffer.push(b"data: {\"a\":1}\n\nda");
        assert_eq!(buffer.next_event().as_deref(), Some(&b"{\"a\":1}"[..]));
        assert_eq!(buffer.next_event(), None);
        buffer.push(b"ta: [DONE]\r\n\r\n: comment\n\n");
        assert_eq!(buffer.next_event().as_deref(), Some(&b"[DONE]"[..]));
        assert_eq!(buffer.next_event(), None);
    }

    #[test]
    fn events_are_classified() {
        let role = br#"{"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}"#;
        assert_eq!(parse_event(role), Event::Other);
        let text = br#"{"choices":[{"index":0,"delta":{"content":" word"}}],"usage":null}"#;
        assert_eq!(parse_event(text), Event::Text);
        let completion = br#"{"choices":[{"index":0,"text":" word"}]}"#;
        assert_eq!(parse_event(completion), Event::Text);
        let usage = br#"{"choices":[],"usage":{"prompt_tokens":20,"completion_tokens":4,"prompt_tokens_details":{"cached_tokens":16}}}"#;
        assert_eq!(
            parse_event(usage),
            Event::Usage(Usage {
                prompt_tokens: 20,
                completion_tokens: 4,
                prompt_tokens_details: Some(PromptDetails { cached_tokens: 16 }),
            })
        );
        let error = br#"{"error":{"message":"boom","type":"x"}}"#;
        assert_eq!(parse_event(error), Event::Error("error event: boom".into()));
        assert_eq!(parse_event(b"[DONE]"), Event::Other);
    }
}
