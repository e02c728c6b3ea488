//! The request's token ids, exactly as the engine sees them (chat template included), from the
//! engine itself: vLLM's `POST /tokenize`, as vLLM's own router does.
//!
//! The request path asks the least loaded available instance of the variant
//! ([`least_loaded`]) with a short deadline ([`DEFAULT_TIMEOUT`], 250 ms: a tokenization takes
//! about a millisecond on a vLLM server that is not saturated). On any failure (no instance,
//! refused connection, timeout, an error status, an unreadable answer) the caller routes that
//! request as LEAST_OUTSTANDING_REQUESTS; nothing is retried, so a slow engine costs at most
//! the deadline. An instance whose `/tokenize` failed twice in a row on its side (no
//! connection, no answer in time, a 5xx, 408 or 429 status, an unreadable answer; not another
//! 4xx, which is the request's own fault) is not asked again for a while ([`TokenizeBackoff`]:
//! `--kv-tokenize-pause-ms`, 1 s, doubling with each further failure up to 30 s), then by one
//! request before the others, so a hung tokenizer costs the deadline about once per pause
//! instead of on every request; the others are asked meanwhile.
//!
//! Body sent: completions `{"model", "prompt"}` (a string prompt; a token-id prompt needs no
//! round trip: [`prompt_token_ids`]); chat `{"model", "messages", …}` with the fields that
//! change the templated prompt copied over (`add_generation_prompt`,
//! `continue_final_message`, `add_special_tokens`, `chat_template`, `chat_template_kwargs`,
//! `tools`, `documents`). The answer's `tokens` are the ids.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde::Deserialize;
use serde_json::value::RawValue;

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use crate::table::{InstanceCell, VariantRoute};

/// How long the engine may take to answer `/tokenize`.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_millis(250);
/// The first pause of an instance whose `/tokenize` keeps failing (`--kv-tokenize-pause-ms`).
pub const DEFAULT_PAUSE: Duration = Duration::from_millis(1_000);
/// Largest `/tokenize` answer read (a 128 K-token prompt is about 1 MB of JSON).
const MAX_ANSWER_BYTES: usize = 16 * 1024 * 1024;
/// Answers above this are parsed on a blocking thread (about 40 K tokens, ~0.5 ms of parsing).
const OFFLOAD_ANSWER_BYTES: usize = 256 * 1024;

/// Chat fields that change the prompt the template renders.
const CHAT_TEMPLATE_FIELDS: &[&str] = &[
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "chat_template",
    "chat_template_kwargs",
    "tools",
    "documents",
];

/// Failures in a row on an instance's side before it is paused: one failure may be the
/// request's own (a huge prompt that takes longer than the deadline), two in a row are the
/// instance's.
pub const PAUSE_AFTER_FAILURES: u32 = 2;
/// Longest pause (`--kv-tokenize-pause-ms` doubles up to it, or stays if it is longer).
pub const PAUSE_MAX_MS: u64 = 30_000;

/// Whether an instance may be asked to tokenize, after failures on its side; kept in its
/// [`crate::table::InstanceCell`], so table rebuilds keep it. Times are
/// [`switchyard_process::clock::monotonic_ms`].
///
/// After [`PAUSE_AFTER_FAILURES`] failures in a row the instance is paused for the first
/// pause, doubling with each further failure up to [`PAUSE_MAX_MS`]. Requests that were
/// already asking when a failure was recorded (one incident seen by many) do not count
/// again. When a pause ends, one request claims the probe ([`TokenizeBackoff::claim`]); the
/// others keep away until it answers or its deadline passes.
#[derive(Debug, Default)]
pub struct TokenizeBackoff {
    /// Before this the instance is not asked (0: it may be).
    until_ms: AtomicU64,
    /// When the last failure was recorded.
    failed_at_ms: AtomicU64,
    /// Failures in a row.
    failures: AtomicU32,
}

impl TokenizeBackoff {
    /// Whether the instance may be asked at `now_ms`.
    pub fn ready(&self, now_ms: u64) -> bool {
        self.until_ms.load(Ordering::Relaxed) <= now_ms
    }

    /// Takes the right to ask the instance at `now_ms`, for `deadline_ms`: always granted to
    /// an instance that is not failing; after a pause, to one request only.
    pub fn claim(&self, now_ms: u64, deadline_ms: u64) -> bool {
        if self.failures.load(Ordering::Relaxed) < PAUSE_AFTER_FAILURES {
            return true;
        }
        let until = self.until_ms.load(Ordering::Relaxed);
        until <= now_ms
            && self
                .until_ms
                .compare_exchange(
                    until,
                    now_ms.saturating_add(deadline_ms),
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                )
                .is_ok()
    }

    /// Records a failure on the instance's side of a request asked at `asked_ms`, at `now_ms`;
    /// returns the pause it starts, if it starts one.
    pub fn failed(&self, asked_ms: u64, now_ms: u64, first_pause_ms: u64) -> Option<u64> {
        let last = self.failed_at_ms.load(Ordering::Relaxed);
        let in_row = self.failures.load(Ordering::Relaxed);
        if in_row > 0 && asked_ms < last {
            // Asked before the last failure was recorded: the same incident.
            return None;
        }
        self.failed_at_ms.fetch_max(now_ms, Ordering::Relaxed);
        let failures = self
            .failures
            .fetch_add(1, Ordering::Relaxed)
            .saturating_add(1);
        if failures < PAUSE_AFTER_FAILURES {
            return None;
        }
        let doublings = (failures - PAUSE_AFTER_FAILURES).min(16);
        let pause = (first_pause_ms << doublings).min(PAUSE_MAX_MS.max(first_pause_ms));
        self.until_ms
            .fetch_max(now_ms.saturating_add(pause), Ordering::Relaxed);
        Some(pause)
    }

    /// Records an answer; true if the instance had been failing.
    pub fn answered(&self) -> bool {
        if self.failures.load(Ordering::Relaxed) == 0 {
            return false;
        }
        self.until_ms.store(0, Ordering::Relaxed);
        self.failures.swap(0, Ordering::Relaxed) > 0
    }
}

#[derive(Debug, thiserror::Error)]
pub enum TokenizeError {
    #[error("no available instance to ask")]
    NoInstance,
    #[error("every available instance's /tokenize is failing; asking again once its pause ends")]
    BackingOff,
    #[error("the request has nothing to tokenize: {0}")]
    Input(String),
    #[error("POST {url}: {message}")]
    Request { url: String, message: String },
    #[error("POST {url}: no answer within {timeout:?}")]
    Timeout { url: String, timeout: Duration },
    #[error("POST {url}: status {status}")]
    Status { url: String, status: u16 },
    #[error("POST {url}: unreadable answer: {message}")]
    Answer { url: String, message: String },
}

impl TokenizeError {
    /// The `reason` label of `switchyard_router_kv_tokenize_failures_total`.
    pub fn reason(&self) -> &'static str {
        match self {
            TokenizeError::NoInstance => "no_instance",
            TokenizeError::BackingOff => "backoff",
            TokenizeError::Input(_) => "input",
            TokenizeError::Request { .. } => "request",
            TokenizeError::Timeout { .. } => "timeout",
            TokenizeError::Status { .. } => "status",
            TokenizeError::Answer { .. } => "answer",
        }
    }

    /// Whether the instance may be at fault (not only the request): counted towards a pause
    /// ([`TokenizeBackoff`]).
    pub fn instance_at_fault(&self) -> bool {
        match self {
            TokenizeError::Request { .. }
            | TokenizeError::Timeout { .. }
            | TokenizeError::Answer { .. } => true,
            // 408 and 429: the engine is too busy to answer; 5xx: it failed.
            TokenizeError::Status { status, .. } => *status >= 500 || matches!(status, 408 | 429),
            TokenizeError::NoInstance | TokenizeError::BackingOff | TokenizeError::Input(_) => {
                false
            }
        }
    }

    pub const REASONS: [&'static str; 7] = [
        "no_instance",
        "backoff",
        "input",
        "request",
        "timeout",
        "status",
        "answer",
    ];
}

/// Which OpenAI API the request body belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PromptKind {
    Chat,
    Completion,
}

/// The top-level fields of a request body, values unparsed.
type Fields<'a> = std::collections::BTreeMap<String, &'a RawValue>;

fn fields(request: &[u8]) -> Result<Fields<'_>, TokenizeError> {
    serde_json::from_slice(request)
        .map_err(|err| TokenizeError::Input(format!("invalid JSON: {err}")))
}

/// A completions prompt given as token ids (`[1, 2, 3]`): no need to ask the engine.
pub fn prompt_token_ids(request: &[u8]) -> Option<Vec<u32>> {
    token_ids_of(&fields(request).ok()?)
}

fn token_ids_of(fields: &Fields<'_>) -> Option<Vec<u32>> {
    serde_json::from_str(fields.get("prompt")?.get()).ok()
}

/// vLLM's `/tokenize` body for an OpenAI request body.
pub fn tokenize_body(kind: PromptKind, request: &[u8]) -> Result<Bytes, TokenizeError> {
    body_of(kind, &fields(request)?, request.len())
}

fn body_of(
    kind: PromptKind,
    fields: &Fields<'_>,
    size_hint: usize,
) -> Result<Bytes, TokenizeError> {
    let mut out: Vec<(&str, &RawValue)> = Vec::new();
    if let Some(model) = fields.get("model") {
        out.push(("model", model));
    }
    match kind {
        PromptKind::Completion => {
            let prompt = fields
                .get("prompt")
                .filter(|prompt| prompt.get().trim_start().starts_with('"'))
                .ok_or_else(|| TokenizeError::Input("prompt is not a string".into()))?;
            out.push(("prompt", prompt));
        }
        PromptKind::Chat => {
            let messages = fields
                .get("messages")
                .ok_or_else(|| TokenizeError::Input("no messages".into()))?;
            out.push(("messages", messages));
            for name in CHAT_TEMPLATE_FIELDS {
                if let Some(value) = fields.get(*name) {
                    out.push((name, value));
                }
            }
        }
    }
    let mut body = Vec::with_capacity(size_hint + 16);
    body.push(b'{');
    for (position, (name, value)) in out.iter().enumerate() {
        if position > 0 {
            body.push(b',');
        }
        // Field names are the constants above: plain ASCII, no escaping needed.
        body.push(b'"');
        body.extend_from_slice(name.as_bytes());
        body.extend_from_slice(b"\":");
        body.extend_from_slice(value.get().as_bytes());
    }
    body.push(b'}');
    Ok(Bytes::from(body))
}

/// A request's token ids, known from its body or to be asked of an engine. Made on the CPU
/// side of the request path ([`PromptTokens::of`], one parse of the body), fetched on the async
/// side ([`PromptTokens::fetch`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PromptTokens {
    /// A completions prompt given as token ids.
    Known(Vec<u32>),
    /// The `/tokenize` body to send (see [`tokenize_body`]).
    Ask(Bytes),
}

impl PromptTokens {
    /// For an OpenAI body of `kind`.
    pub fn of(kind: PromptKind, request: &[u8]) -> Result<Self, TokenizeError> {
        let fields = fields(request)?;
        if kind == PromptKind::Completion
            && let Some(ids) = token_ids_of(&fields)
        {
            return Ok(Self::Known(ids));
        }
        body_of(kind, &fields, request.len()).map(Self::Ask)
    }

    /// For a native (`/invocations`) body: a JSON object with `messages` is read as a chat
    /// request, else one with `prompt` as a completions request (the rule the simulator's
    /// `/invocations` follows); anything else has no prompt to tokenize.
    pub fn of_native(request: &[u8]) -> Result<Self, TokenizeError> {
        let fields = fields(request)?;
        let kind = if fields.contains_key("messages") {
            PromptKind::Chat
        } else if fields.contains_key("prompt") {
            PromptKind::Completion
        } else {
            return Err(TokenizeError::Input(
                "the body has neither `messages` nor `prompt`".into(),
            ));
        };
        if kind == PromptKind::Completion
            && let Some(ids) = token_ids_of(&fields)
        {
            return Ok(Self::Known(ids));
        }
        body_of(kind, &fields, request.len()).map(Self::Ask)
    }

    /// The token ids: as given, or from the least loaded available instance of `variant`
    /// that is not paused ([`TokenizeBackoff`]).
    pub async fn fetch(
        self,
        tokenizer: &Tokenizer,
        variant: &VariantRoute,
        now_ms: u64,
    ) -> Result<Vec<u32>, TokenizeError> {
        match self {
            Self::Known(ids) => Ok(ids),
            Self::Ask(body) => {
                let clock = switchyard_process::clock::monotonic_ms;
                let asked = clock();
                let deadline = u64::try_from(tokenizer.timeout.as_millis()).unwrap_or(u64::MAX);
                let instance = claim_instance(variant, now_ms, asked, deadline)?;
                let route = &variant.instances[instance];
                let backoff = &route.cell.tokenize_backoff;
                let result = tokenizer.tokenize(&route.url, body).await;
                match &result {
                    Ok(_) => {
                        if backoff.answered() {
                            tracing::info!(instance = %route.id, "the instance's /tokenize answers again");
                        }
                    }
                    Err(err) if err.instance_at_fault() => {
                        if let Some(pause) = backoff.failed(asked, clock(), tokenizer.pause_ms) {
                            tracing::warn!(instance = %route.id, error = %err, pause_ms = pause, "/tokenize keeps failing on the instance; asking the others meanwhile");
                        }
                    }
                    Err(_) => {}
                }
                result
            }
        }
    }
}

/// The least loaded available instance not paused whose turn a request asked at `asked_ms`
/// can claim for `deadline_ms` (after a pause only one request probes): each instance is
/// tried at most once.
fn claim_instance(
    variant: &VariantRoute,
    now_ms: u64,
    asked_ms: u64,
    deadline_ms: u64,
) -> Result<usize, TokenizeError> {
    let mut passed = Vec::new();
    loop {
        let candidate = least(variant, |index, cell| {
            cell.available(now_ms)
                && cell.tokenize_backoff.ready(asked_ms)
                && !passed.contains(&index)
        });
        match candidate {
            Some(index)
                if variant.instances[index]
                    .cell
                    .tokenize_backoff
                    .claim(asked_ms, deadline_ms) =>
            {
                return Ok(index);
            }
            Some(index) => passed.push(index),
            None if least(variant, |_, cell| cell.available(now_ms)).is_some() => {
                return Err(TokenizeError::BackingOff);
            }
            None => return Err(TokenizeError::NoInstance),
        }
    }
}

/// The instance to ask: the available one, not paused after failing to tokenize, with the
/// fewest fleet-wide requests in flight (the first such in table order on a tie: an idle fleet
/// sends every `/tokenize` to the same instance; spreading ties at random would send half of
/// them to an instance that has just died and is not yet ejected, as a test showed).
pub fn least_loaded(variant: &VariantRoute, now_ms: u64) -> Option<usize> {
    let clock = switchyard_process::clock::monotonic_ms();
    least(variant, |_, cell| {
        cell.available(now_ms) && cell.tokenize_backoff.ready(clock)
    })
}

fn least(variant: &VariantRoute, wanted: impl Fn(usize, &InstanceCell) -> bool) -> Option<usize> {
    variant
        .instances
        .iter()
        .enumerate()
        .filter(|(index, instance)| wanted(*index, &instance.cell))
        .min_by_key(|(position, instance)| (instance.cell.fleet_load(), *position))
        .map(|(position, _)| position)
}

#[derive(Deserialize)]
struct Answer {
    tokens: Vec<u32>,
}

/// A `/tokenize` client (HTTP/1.1 keep-alive, `TCP_NODELAY`).
#[derive(Debug, Clone)]
pub struct Tokenizer {
    client: Client<HttpConnector, Full<Bytes>>,
    timeout: Duration,
    /// The first pause of an instance that keeps failing ([`TokenizeBackoff`]).
    pause_ms: u64,
}

impl Tokenizer {
    /// With the default first pause ([`DEFAULT_PAUSE`]).
    pub fn new(timeout: Duration) -> Self {
        Self::with_pause(timeout, DEFAULT_PAUSE)
    }

    pub fn with_pause(timeout: Duration, pause: Duration) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(timeout));
        Self {
            client: Client::builder(TokioExecutor::new()).build(connector),
            timeout,
            pause_ms: u64::try_from(pause.as_millis()).unwrap_or(u64::MAX),
        }
    }

    /// A client of its own with the same settings.
    pub fn like(&self) -> Self {
        Self::with_pause(self.timeout, Duration::from_millis(self.pause_ms))
    }

    /// The deadline of one `/tokenize` exchange.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Asks the engine at `base_url` to tokenize `body` (see [`tokenize_body`]).
    pub async fn tokenize(&self, base_url: &str, body: Bytes) -> Result<Vec<u32>, TokenizeError> {
        let url = format!("{base_url}/tokenize");
        let request_error = |message: String| TokenizeError::Request {
            url: url.clone(),
            message,
        };
        let request = http::Request::post(&url)
            .header(http::header::CONTENT_TYPE, "application/json")
            .body(Full::new(body))
            .map_err(|err| request_error(err.to_string()))?;
        let exchange = async {
            let response = self
                .client
                .request(request)
                .await
                .map_err(|err| request_error(err.to_string()))?;
            let status = response.status().as_u16();
            if status != 200 {
                return Err(TokenizeError::Status {
                    url: url.clone(),
                    status,
                });
            }
            let body = http_body_util::Limited::new(response.into_body(), MAX_ANSWER_BYTES)
                .collect()
                .await
                .map_err(|err| TokenizeError::Answer {
                    url: url.clone(),
                    message: err.to_string(),
                })?
                .to_bytes();
            let large = body.len() > OFFLOAD_ANSWER_BYTES;
            let parse = move || {
                serde_json::from_slice::<Answer>(&body)
                    .map(|answer| answer.tokens)
                    .map_err(|err| err.to_string())
            };
            let parsed = if large {
                tokio::task::spawn_blocking(parse)
                    .await
                    .unwrap_or_else(|err| Err(err.to_string()))
            } else {
                parse()
            };
            parsed.map_err(|message| TokenizeError::Answer {
                url: url.clone(),
                message,
            })
        };
        tokio::time::timeout(self.timeout, exchange)
            .await
            .map_err(|_| TokenizeError::Timeout {
                url: url.clone(),
                timeout: self.timeout,
            })?
    }
}

impl Default for Tokenizer {
    fn default() -> Self {
        Self::new(DEFAULT_TIMEOUT)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bodies_carry_the_prompt_or_the_messages_and_template_fields() {
        let body = tokenize_body(
            PromptKind::Completion,
            br#"{"model":"m","prompt":"hi there","max_tokens":3,"stream":true}"#,
        )
        .unwrap();
        assert_eq!(body, r#"{"model":"m","prompt":"hi there"}"#);
        let body = tokenize_body(
            PromptKind::Chat,
            br#"{"model":"m","messages":[{"role":"user","content":"x"}],"temperature":0,
            "chat_template_kwargs":{"enable_thinking":false},"add_generation_prompt":true}"#,
        )
        .unwrap();
        let value: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(value["messages"][0]["content"], "x");
        assert_eq!(value["chat_template_kwargs"]["enable_thinking"], false);
        assert_eq!(value["add_generation_prompt"], true);
        assert!(value.get("temperature").is_none());
        assert!(tokenize_body(PromptKind::Chat, br#"{"prompt":"x"}"#).is_err());
        assert!(tokenize_body(PromptKind::Completion, br#"{"prompt":[1,2]}"#).is_err());
        assert_eq!(prompt_token_ids(br#"{"prompt":[1,2]}"#), Some(vec![1, 2]));
        assert_eq!(prompt_token_ids(br#"{"prompt":"x"}"#), None);
    }

    #[test]
    fn an_instance_failing_to_tokenize_is_paused_longer_each_time_until_it_answers() {
        let backoff = TokenizeBackoff::default();
        let first = 1_000;
        // One failure may be the request's own: no pause yet.
        assert_eq!(backoff.failed(0, 10, first), None);
        assert!(backoff.ready(10) && backoff.claim(10, 250));
        // Requests asked before that failure was recorded are the same incident.
        assert_eq!(backoff.failed(5, 20, first), None);
        assert!(backoff.ready(20));
        // The second failure in a row pauses it: 1 s, then one request probes.
        assert_eq!(backoff.failed(30, 40, first), Some(1_000));
        assert!(!backoff.ready(1_039) && backoff.ready(1_040));
        assert!(backoff.claim(1_040, 250), "the probe");
        assert!(
            !backoff.ready(1_041) && !backoff.claim(1_041, 250),
            "one probe at a time"
        );
        // The probe fails: 2 s; then each failure doubles the pause up to 30 s.
        let mut now = 1_100;
        let mut pauses = vec![];
        for _ in 0..6 {
            let pause = backoff.failed(now, now + 10, first).unwrap();
            pauses.push(pause);
            now += 10 + pause;
        }
        assert_eq!(pauses, [2_000, 4_000, 8_000, 16_000, 30_000, 30_000]);
        // A probe's deadline passes unanswered (the request was dropped): another may probe.
        assert!(backoff.claim(now, 250));
        assert!(!backoff.claim(now + 249, 250) && backoff.claim(now + 250, 250));
        // An answer ends it, and the count starts over.
        assert!(backoff.answered());
        assert!(backoff.ready(0) && !backoff.answered());
        assert_eq!(backoff.failed(now + 300, now + 300, first), None);
        assert_eq!(backoff.failed(now + 400, now + 400, first), Some(1_000));
        // A first pause above the cap stays as given.
        let long = TokenizeBackoff::default();
        long.failed(0, 0, 60_000);
        assert_eq!(long.failed(1, 1, 60_000), Some(60_000));
        assert_eq!(long.failed(60_001, 60_001, 60_000), Some(60_000));
        // Only failures on the instance's side pause it; a 4xx is the request's fault.
        let status = |status| TokenizeError::Status {
            url: String::new(),
            status,
        };
        assert!(status(500).instance_at_fault() && status(503).instance_at_fault());
        assert!(status(429).instance_at_fault() && status(408).instance_at_fault());
        assert!(!status(404).instance_at_fault() && !status(400).instance_at_fault());
        assert!(!TokenizeError::Input(String::new()).instance_at_fault());
    }
}
