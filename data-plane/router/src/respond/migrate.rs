//! Request migration (a variant's `MigrationLimit`): a streamed chat or completions answer
//! whose engine dies midway (its connection fails, it ends before `data: [DONE]`, or it
//! stalls past the idle deadline, the stalled connection dropped first) continues on another
//! instance of the plan's ranking. The continuation asks for the rest: chat with the text so
//! far as a final assistant message and vLLM's `continue_final_message: true`,
//! `add_generation_prompt: false`; completions with the prompt plus the text so far; the
//! token budget (and `min_tokens`) less the tokens sent, as the engine counted them (the
//! router asks for vLLM's `continuous_usage_stats`; without it, one token per chunk that
//! carries text). Its events are spliced into
//! the client's stream: the first answer's `id`, `created` and `model`, no second role chunk,
//! usage counted for the client's own request, an SSE comment line at the splice, `[DONE]`
//! once. Only whole events reach the client, so a break never leaves half an event behind.
//!
//! Not migrated (the stream ends with an error event, as without a limit): `n` > 1, guided
//! decoding or `response_format`, logprobs, `echo`, `truncate_prompt_tokens` (the engine kept
//! only part of the prompt: the text so far appended to it would be cut otherwise), a prompt
//! that is not one string, an answer
//! that has begun a tool call or reasoning, an engine's own error event (vLLM reports a dead
//! engine core so), an event longer than [`MAX_EVENT_BYTES`].

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::{Bytes, BytesMut};
use http::HeaderMap;
use http_body::Frame;
use opentelemetry::KeyValue;
use serde_json::{Map, Value, json};
use switchyard_policy::rank::Ranking;

use super::stream::{BoxError, STREAM_BROKEN_EVENT, TrackedBody, is_event_stream};
use crate::errors::ApiError;
use crate::forward::{Answered, Forwarder};
use crate::observe::labels::RouteLabel;
use crate::observe::trace::{RequestTrace, ShowTraceId, request_id};
use crate::operation::Operation;
use crate::plan::Plan;
use crate::plan::flow::FlowKey;
use crate::request::worker::Worker;
use crate::routing::table::EndpointRoute;
use crate::server::admission::RequestPermit;

/// What a migrating stream needs to send a continuation: taken from the plan before it is
/// forwarded.
pub(crate) struct Migration {
    operation: Operation,
    client_usage: bool,
    client_continuous: bool,
    chat: bool,
    /// The engine's request body (as planned), parsed.
    body: Map<String, Value>,
    endpoint: Arc<EndpointRoute>,
    variant_index: usize,
    ranking: Ranking,
    path: Option<String>,
    label: RouteLabel,
    flow: FlowKey,
    limit: u32,
}

impl Migration {
    /// A migration for `plan`'s answer, when its variant allows one and the request is a
    /// streamed chat or completions request that a continuation can finish.
    pub(crate) fn prepare(operation: Operation, plan: &mut Plan) -> Option<Self> {
        let chat = match operation {
            Operation::ChatCompletions => true,
            Operation::Completions => false,
            _ => return None,
        };
        let limit = plan.variant().migration_limit;
        // A pinned request (a stored response's follow-up, a session) has nowhere to move; an
        // LMCACHE_PD hand-off's answer is re-shaped by the router (its decode is over ids).
        let lmcache_pd =
            plan.prefill_hop.is_some()
                && plan.endpoint.disaggregation.as_ref().is_some_and(|pd| {
                    pd.protocol == switchyard_shared::KvTransferProtocol::LmcachePd
                });
        if limit == 0 || plan.pinned || lmcache_pd {
            return None;
        }
        let Ok(Value::Object(mut body)) = serde_json::from_slice::<Value>(&plan.body) else {
            return None;
        };
        if !continuable(&body, chat) {
            return None;
        }
        // The engine counts the tokens sent in every chunk; the client sees what it asked for.
        if body.get("stream_options").is_some_and(Value::is_null) {
            body.remove("stream_options");
        }
        let options = body.get("stream_options");
        let asked = |key: &str| options.is_some_and(|options| options[key] == Value::Bool(true));
        let (client_usage, client_continuous) = (
            asked("include_usage"),
            asked("include_usage") && asked("continuous_usage_stats"),
        );
        let options = body
            .entry("stream_options")
            .or_insert_with(|| Value::Object(Map::new()));
        if !options.is_object() {
            return None;
        }
        options["include_usage"] = Value::Bool(true);
        options["continuous_usage_stats"] = Value::Bool(true);
        plan.body = Bytes::from(serde_json::to_vec(&body).ok()?);
        Some(Self {
            client_usage,
            client_continuous,
            operation,
            chat,
            body,
            endpoint: Arc::clone(&plan.endpoint),
            variant_index: plan.variant_index,
            ranking: plan.ranking.clone(),
            path: plan.path.clone(),
            label: plan.label,
            flow: plan.flow,
            limit,
        })
    }

    fn continuation(&self, sent: &Splice) -> Next {
        if sent.text.is_empty() {
            let mut body = self.body.clone();
            body.remove("kv_transfer_params");
            return serde_json::to_vec(&body).map_or(Next::Impossible, Next::Body);
        }
        if sent.budget_spent(&self.body) {
            return Next::Spent;
        }
        continuation(&self.body, self.chat, sent).map_or(Next::Impossible, Next::Body)
    }
}

/// What to do about a broken answer.
enum Next {
    /// Send this continuation.
    Body(Vec<u8>),
    /// Nothing is left to ask for: the token budget was spent.
    Spent,
    /// No continuation can be made (e.g. a final message that is not one string).
    Impossible,
}

/// The request that asks for the rest of an answer of which `sent` (some text) has reached
/// the client; `None` when it cannot be made.
fn continuation(body: &Map<String, Value>, chat: bool, sent: &Splice) -> Option<Vec<u8>> {
    let mut body = body.clone();
    body.remove("kv_transfer_params");
    let done = u64::from(sent.tokens);
    for key in ["max_tokens", "max_completion_tokens"] {
        if let Some(budget) = body.get(key).and_then(Value::as_u64) {
            body.insert(
                key.to_owned(),
                Value::from(budget.saturating_sub(done).max(1)),
            );
        }
    }
    // vLLM refuses a min_tokens above max_tokens.
    if let Some(least) = body.get("min_tokens").and_then(Value::as_u64) {
        body.insert(
            "min_tokens".to_owned(),
            Value::from(least.saturating_sub(done)),
        );
    }
    if chat {
        let continuing = body.get("continue_final_message") == Some(&Value::Bool(true));
        let messages = body.get_mut("messages")?.as_array_mut()?;
        match messages.last_mut() {
            // The client's own request continued its last message: it grows.
            Some(last) if continuing => {
                let content = format!("{}{}", last["content"].as_str()?, sent.text);
                last["content"] = Value::String(content);
            }
            _ => messages.push(json!({"role": "assistant", "content": sent.text})),
        }
        body.insert("continue_final_message".to_owned(), Value::Bool(true));
        body.insert("add_generation_prompt".to_owned(), Value::Bool(false));
    } else {
        let prompt = format!("{}{}", body.get("prompt")?.as_str()?, sent.text);
        body.insert("prompt".to_owned(), Value::String(prompt));
    }
    serde_json::to_vec(&body).ok()
}

impl Migration {
    /// The plan of a continuation: the same ranking without the instances that died.
    fn plan(&self, body: Vec<u8>, dead: &[usize]) -> Plan {
        Plan {
            endpoint: Arc::clone(&self.endpoint),
            variant_index: self.variant_index,
            ranking: Ranking {
                order: (self.ranking.order.iter().copied())
                    .filter(|index| !dead.contains(index))
                    .collect(),
                route: self.ranking.route,
            },
            body: Bytes::from(body),
            path: self.path.clone(),
            label: self.label,
            explain: Vec::new(),
            prefill_hop: None,
            cached_tokens: Vec::new(),
            data_parallel_ranks: Vec::new(),
            routing_key: None,
            flow: self.flow,
            // A pinned request has one instance; it cannot move.
            pinned: false,
        }
    }
}

/// Whether a continuation can finish this request (see the module's list of exceptions).
fn continuable(body: &Map<String, Value>, chat: bool) -> bool {
    let set = |key: &str| body.get(key).is_some_and(|value| !value.is_null());
    let truthy = |key: &str| {
        body.get(key)
            .is_some_and(|value| !matches!(value, Value::Null | Value::Bool(false)))
    };
    body.get("stream") == Some(&Value::Bool(true))
        && body
            .get("n")
            .is_none_or(|n| n.is_null() || n.as_u64() == Some(1))
        && ![
            "response_format",
            "structured_outputs",
            "guided_json",
            "guided_regex",
        ]
        .into_iter()
        .chain(["guided_choice", "guided_grammar"])
        .any(set)
        && !truthy("logprobs")
        && !set("top_logprobs")
        && !truthy("echo")
        && !set("truncate_prompt_tokens")
        && (chat || body.get("prompt").is_some_and(Value::is_string))
}

/// The client's stream as it is spliced: whole events only, what they said so far, and the
/// first answer's identity for the events of the ones after it.
#[derive(Default)]
struct Splice {
    /// Bytes of an event not yet complete.
    partial: BytesMut,
    /// The answer's text so far.
    text: String,
    /// Streamed chunks that carried text (the tokens sent, as vLLM streams them).
    tokens: u32,
    /// The first answer's `id`, `created` and `model`.
    identity: Option<(Value, Value, Value)>,
    /// The tokens sent before the current answer began.
    tokens_before: u32,
    /// Which answer this is (0: the first).
    leg: u32,
    finished: bool,
    done: bool,
    /// A tool call has begun, or the engine sent an error of the request's own: no
    /// continuation.
    final_answer: bool,
    /// Another move is allowed (set before each feed).
    can_move: bool,
    /// The engine reported a failure of its own (an error event with a 5xx code) before the
    /// answer finished: the event is held back and the answer continues elsewhere.
    engine_failed: bool,
    /// The first answer's prompt tokens (from the engine's usage).
    prompt_tokens: Option<u64>,
    /// What the client asked for: a final usage chunk, usage in every chunk.
    client_usage: bool,
    client_continuous: bool,
    /// The first answer's `object` (for the chunks the router writes itself).
    object: Value,
    /// A usage-only chunk has reached the client.
    usage_sent: bool,
    /// A chunk naming the assistant's role has reached the client (chat: once per stream).
    role_sent: bool,
    /// The current answer's engine failure event, held back: the client's if no move works.
    held_failure: Option<Bytes>,
}

impl Splice {
    /// The complete events in `data`, as the client gets them.
    fn feed(&mut self, data: &[u8], out: &mut VecDeque<Bytes>) {
        self.partial.extend_from_slice(data);
        while let Some((end, gap)) = event_end(&self.partial) {
            if self.engine_failed {
                // What follows the engine's failure (its `[DONE]`) is not the client's.
                self.partial.clear();
                return;
            }
            let event = self.partial.split_to(end + gap).freeze();
            if let Some(event) = self.event(event) {
                out.push_back(event);
            }
        }
        if self.partial.len() > MAX_EVENT_BYTES {
            // Not an event stream the router can hold: it passes through and cannot move.
            self.final_answer = true;
            out.push_back(self.partial.split().freeze());
        }
    }

    /// Whether the tokens sent have used up the request's budget.
    fn budget_spent(&self, body: &Map<String, Value>) -> bool {
        ["max_tokens", "max_completion_tokens"].iter().any(|key| {
            body.get(*key)
                .and_then(Value::as_u64)
                .is_some_and(|budget| u64::from(self.tokens) >= budget)
        })
    }

    /// What ends an answer whose engine was lost after its last token: a chunk with its
    /// finish reason when none came, the usage the client asked for, `[DONE]`.
    fn ending(&self, out: &mut VecDeque<Bytes>) {
        let Some((id, created, model)) = &self.identity else {
            out.push_back(Bytes::from_static(b"data: [DONE]\n\n"));
            return;
        };
        let envelope = |choices: Value| {
            json!({"id": id, "object": self.object, "created": created, "model": model,
                   "choices": choices})
        };
        let mut events = Vec::new();
        if !self.finished {
            let choice = if self.object == "text_completion" {
                json!({"index": 0, "text": "", "logprobs": null, "finish_reason": "length"})
            } else {
                json!({"index": 0, "delta": {}, "logprobs": null, "finish_reason": "length"})
            };
            events.push(envelope(json!([choice])));
        }
        if self.client_usage && !self.usage_sent {
            let prompt = self.prompt_tokens.unwrap_or(0);
            let completion = u64::from(self.tokens);
            let mut chunk = envelope(json!([]));
            chunk["usage"] = json!({"prompt_tokens": prompt, "completion_tokens": completion,
                                    "total_tokens": prompt + completion});
            events.push(chunk);
        }
        for event in events {
            out.push_back(Bytes::from(format!("data: {event}\n\n")));
        }
        out.push_back(Bytes::from_static(b"data: [DONE]\n\n"));
    }

    fn event(&mut self, event: Bytes) -> Option<Bytes> {
        let Some(data) = std::str::from_utf8(&event)
            .ok()
            .and_then(|text| text.lines().find_map(|line| line.strip_prefix("data: ")))
        else {
            return Some(event);
        };
        if data.trim() == "[DONE]" {
            self.done = true;
            return Some(event);
        }
        let Ok(Value::Object(mut chunk)) = serde_json::from_str::<Value>(data) else {
            return Some(event);
        };
        if let Some(error) = chunk.get("error") {
            if self.can_move && !self.final_answer && !self.finished && is_engine_failure(error) {
                self.engine_failed = true;
                self.held_failure = Some(event);
                return None;
            }
            self.final_answer = true;
            return Some(event);
        }
        let choice = chunk
            .get("choices")
            .and_then(|choices| choices.get(0))
            .cloned()
            .unwrap_or(Value::Null);
        let delta = &choice["delta"];
        let text = delta["content"]
            .as_str()
            .or_else(|| choice["text"].as_str())
            .unwrap_or("");
        // A tool call or reasoning under way cannot be continued as text.
        if ["tool_calls", "reasoning_content", "reasoning"]
            .iter()
            .any(|key| !delta[*key].is_null())
        {
            self.final_answer = true;
        }
        if !choice["finish_reason"].is_null() {
            self.finished = true;
        }
        self.text.push_str(text);
        // The engine's own count when it sends one (`continuous_usage_stats`, asked for by
        // `Migration::prepare`), else one token per chunk with text.
        let usage = chunk
            .get("usage")
            .filter(|usage| usage.is_object())
            .cloned();
        match usage
            .as_ref()
            .and_then(|usage| usage["completion_tokens"].as_u64())
        {
            Some(completion) => {
                let completion = u32::try_from(completion).unwrap_or(u32::MAX);
                self.tokens = self.tokens_before.saturating_add(completion);
            }
            None if !text.is_empty() => self.tokens += 1,
            None => {}
        }
        // The stream's identity is that of the first chunk the client gets: the first
        // answer's, or a later one's when the first failed before sending any (an engine's
        // own error event first of all).
        let first_chunk = self.identity.is_none();
        if first_chunk {
            self.object = chunk.get("object").cloned().unwrap_or(Value::Null);
            self.identity = Some((
                chunk.get("id").cloned().unwrap_or(Value::Null),
                chunk.get("created").cloned().unwrap_or(Value::Null),
                chunk.get("model").cloned().unwrap_or(Value::Null),
            ));
        }
        if self.leg == 0 || self.tokens_before == 0 {
            // The request as the client sent it (a move before any token re-sends it whole).
            if let Some(prompt) = usage
                .as_ref()
                .and_then(|usage| usage["prompt_tokens"].as_u64())
            {
                self.prompt_tokens.get_or_insert(prompt);
            }
        }
        if self.leg > 0 && !first_chunk {
            if !delta["role"].is_null() && text.is_empty() && self.role_sent {
                // The client has had its role chunk.
                return None;
            }
            if let Some((id, created, model)) = &self.identity {
                chunk.insert("id".to_owned(), id.clone());
                chunk.insert("created".to_owned(), created.clone());
                chunk.insert("model".to_owned(), model.clone());
            }
        }
        if !delta["role"].is_null() {
            self.role_sent = true;
        }
        if usage.is_some() || self.leg > 0 {
            let usage_only = choice.is_null();
            if usage_only && !self.client_usage {
                return None;
            }
            self.usage_sent |= usage_only;
            match usage {
                Some(Value::Object(mut usage)) if usage_only || self.client_continuous => {
                    // The client's own request: its prompt, everything it was sent.
                    let completion = u64::from(self.tokens);
                    let prompt = match self.prompt_tokens {
                        Some(prompt) => prompt,
                        None => usage["prompt_tokens"].as_u64().unwrap_or(0),
                    };
                    usage.insert("prompt_tokens".to_owned(), prompt.into());
                    usage.insert("completion_tokens".to_owned(), completion.into());
                    usage.insert("total_tokens".to_owned(), (prompt + completion).into());
                    chunk.insert("usage".to_owned(), Value::Object(usage));
                }
                // Asked by the router only (`continuous_usage_stats`): the chunk as the engine
                // would have sent it, without a usage (vLLM 0.32 leaves the key out, with
                // `include_usage` too).
                Some(_) => {
                    chunk.remove("usage");
                }
                None => {}
            }
            let mut out = b"data: ".to_vec();
            serde_json::to_writer(&mut out, &chunk).ok()?;
            out.extend_from_slice(b"\n\n");
            return Some(Bytes::from(out));
        }
        Some(event)
    }

    /// A new answer begins: what is partial of the old one is dropped.
    fn next_leg(&mut self) {
        self.partial.clear();
        self.held_failure = None;
        self.tokens_before = self.tokens;
        self.leg += 1;
    }
}

/// Whether a stream's error event reports the engine's own failure (vLLM: an engine core that
/// died or a generation error, `code` 500 or 503), not something wrong with the request (4xx).
fn is_engine_failure(error: &Value) -> bool {
    crate::forward::refusal::error_code(error).is_some_and(|code| (500..600).contains(&code))
}

/// Where the first whole event of `bytes` ends: the index of its blank line and that line's
/// length (`\n\n`, or `\r\n\r\n` as some servers write them).
fn event_end(bytes: &[u8]) -> Option<(usize, usize)> {
    let find = |needle: &[u8]| {
        bytes
            .windows(needle.len())
            .position(|window| window == needle)
            .map(|at| (at, needle.len()))
    };
    match (find(b"\n\n"), find(b"\r\n\r\n")) {
        (Some(lf), Some(crlf)) => Some(if crlf.0 < lf.0 { crlf } else { lf }),
        (lf, crlf) => lf.or(crlf),
    }
}

/// The longest SSE event held whole; past it the stream passes through and cannot move.
const MAX_EVENT_BYTES: usize = 1 << 20;

type Continuing = Pin<Box<dyn Future<Output = Result<Answered, ApiError>> + Send>>;

/// The client's body for a migrating stream.
pub(super) struct Migrating {
    leg: Option<TrackedBody>,
    continuing: Option<Continuing>,
    splice: Splice,
    ready: VecDeque<Bytes>,
    migration: Arc<Migration>,
    worker: Arc<Worker>,
    headers: Arc<HeaderMap>,
    /// The instances (by index in the variant) whose answers broke, the current one last.
    dead: Vec<usize>,
    moves: u32,
    /// Makes each continuation's attempt span under the request's server span (traced).
    trace: Option<Arc<RequestTrace>>,
    /// The request's admission, held for the whole stream.
    _permit: RequestPermit,
    ended: bool,
}

impl Migrating {
    pub(super) fn new(
        leg: TrackedBody,
        instance_index: usize,
        migration: Migration,
        worker: Arc<Worker>,
        headers: HeaderMap,
        permit: RequestPermit,
        trace: Option<RequestTrace>,
    ) -> Self {
        Self {
            leg: Some(leg),
            continuing: None,
            splice: Splice {
                client_usage: migration.client_usage,
                client_continuous: migration.client_continuous,
                ..Splice::default()
            },
            ready: VecDeque::new(),
            migration: Arc::new(migration),
            worker,
            headers: Arc::new(headers),
            dead: vec![instance_index],
            moves: 0,
            trace: trace.map(Arc::new),
            _permit: permit,
            ended: false,
        }
    }

    /// The current answer broke: a continuation is under way, or the stream ends with an
    /// error event.
    fn broke(&mut self) {
        self.leg = None;
        if self.splice.done {
            self.ended = true;
            return;
        }
        let next = if self.splice.finished {
            // Only the end was lost: the answer is whole.
            Next::Spent
        } else if self.moves < self.migration.limit && !self.splice.final_answer {
            self.migration.continuation(&self.splice)
        } else {
            Next::Impossible
        };
        let body = match next {
            Next::Body(body) => body,
            Next::Spent => {
                self.count("whole");
                self.splice.ending(&mut self.ready);
                self.ended = true;
                return;
            }
            Next::Impossible => {
                self.count("limit");
                self.give_up();
                self.ended = true;
                return;
            }
        };
        self.moves += 1;
        let plan = self.migration.plan(body, &self.dead);
        let (worker, headers, operation, trace) = (
            Arc::clone(&self.worker),
            Arc::clone(&self.headers),
            self.migration.operation,
            self.trace.clone(),
        );
        self.continuing = Some(Box::pin(async move {
            let mut reservation = worker.admission.buffer();
            reservation.resize_to(plan.body.len() as u64);
            let forwarder = Forwarder {
                clients: &worker.clients,
                settings: worker.forwarding,
                metrics: &worker.metrics,
                trace: trace.as_deref(),
                flow: &worker.flow,
                notices: worker.notices.as_ref(),
            };
            // A continuation does not queue again: the request has waited its turn (the
            // instance it goes to may go over its MaxInFlightPerInstance by this one).
            forwarder
                .forward(operation, plan, &headers, reservation, None)
                .await
        }));
    }

    /// Counts what became of the broken answer (router-wide and on the instance it broke on,
    /// the last of `dead`).
    fn count(&self, outcome: &str) {
        let variant = &self.migration.endpoint.variants[self.migration.variant_index];
        let broken = (self.dead.last()).and_then(|&index| variant.instances.get(index));
        self.worker
            .metrics
            .count_migration(outcome, broken.map(|instance| &*instance.cell));
    }

    /// The trace id for log lines (empty when the request is not traced).
    fn trace_id(&self) -> ShowTraceId {
        ShowTraceId(self.trace.as_deref().map(RequestTrace::trace_id))
    }

    /// The stream ends incomplete: with the engine's own failure event when it sent one (and,
    /// as vLLM follows it, `[DONE]`), else the router's broken-stream event.
    fn give_up(&mut self) {
        match self.splice.held_failure.take() {
            Some(event) => {
                self.ready.push_back(event);
                self.ready
                    .push_back(Bytes::from_static(b"data: [DONE]\n\n"));
            }
            None => self
                .ready
                .push_back(Bytes::from_static(STREAM_BROKEN_EVENT.as_bytes())),
        }
    }

    /// The continuation answered: its stream becomes the current answer.
    fn continued(&mut self, answered: Answered) {
        let from = self.dead.last().copied();
        let variant = &answered.endpoint.variants[answered.variant_index];
        let name = |index: usize| {
            variant
                .instances
                .get(index)
                .map_or_else(String::new, |instance| instance.id.to_string())
        };
        let is_stream = is_event_stream(answered.response.headers());
        answered
            .in_flight
            .annotate(KeyValue::new("switchyard.migration", i64::from(self.moves)));
        if !answered.response.status().is_success() || !is_stream {
            tracing::warn!(request_id = request_id(&self.headers), trace_id = %self.trace_id(), status = %answered.response.status(), "a continuation was refused; the answer is incomplete");
            self.count("failed");
            self.give_up();
            self.ended = true;
            return;
        }
        self.count("continued");
        tracing::info!(
            request_id = request_id(&self.headers),
            trace_id = %self.trace_id(),
            from = from.map(name).unwrap_or_default(),
            to = name(answered.instance_index),
            moves = self.moves,
            "a broken answer continues on another instance"
        );
        self.ready.push_back(Bytes::from(format!(
            ": switchyard migrated this answer from {} to {}\n\n",
            from.map(name).unwrap_or_default(),
            name(answered.instance_index)
        )));
        self.splice.next_leg();
        self.dead.push(answered.instance_index);
        let (parts, incoming) = answered.response.into_parts();
        drop(parts);
        let leg = TrackedBody::leg(
            incoming,
            answered.in_flight,
            self.worker.forwarding.stream_idle,
            Arc::clone(&self.worker.metrics),
        );
        self.leg = Some(leg);
    }
}

impl http_body::Body for Migrating {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        loop {
            if let Some(ready) = this.ready.pop_front() {
                return Poll::Ready(Some(Ok(Frame::data(ready))));
            }
            if this.ended {
                return Poll::Ready(None);
            }
            if let Some(continuing) = this.continuing.as_mut() {
                let answered = std::task::ready!(continuing.as_mut().poll(cx));
                this.continuing = None;
                match answered {
                    Ok(answered) => this.continued(answered),
                    Err(err) => {
                        tracing::warn!(request_id = request_id(&this.headers), trace_id = %this.trace_id(), error = %err.message, "no instance took the continuation; the answer is incomplete");
                        this.count("failed");
                        this.give_up();
                        this.ended = true;
                    }
                }
                continue;
            }
            let Some(leg) = this.leg.as_mut() else {
                this.ended = true;
                continue;
            };
            let polled = std::task::ready!(Pin::new(leg).poll_frame(cx));
            if this.splice.done {
                // After `[DONE]` the rest of the body is read to its end (nothing more goes
                // to the client), so the engine's connection is kept for the next request.
                if !matches!(polled, Some(Ok(_))) {
                    this.leg = None;
                    this.ended = true;
                }
                continue;
            }
            match polled {
                Some(Ok(frame)) => {
                    if let Some(data) = frame.data_ref() {
                        this.splice.can_move = this.moves < this.migration.limit;
                        this.splice.feed(data, &mut this.ready);
                        if std::mem::take(&mut this.splice.engine_failed) {
                            tracing::info!(request_id = request_id(&this.headers), trace_id = %this.trace_id(), "the engine reported its own failure in the stream; the answer continues elsewhere");
                            this.broke();
                        }
                    }
                }
                Some(Err(_)) | None => this.broke(),
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.ended && self.ready.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn events(splice: &mut Splice, text: &str) -> String {
        let mut out = VecDeque::new();
        splice.feed(text.as_bytes(), &mut out);
        out.iter()
            .map(|bytes| String::from_utf8_lossy(bytes).into_owned())
            .collect()
    }

    #[test]
    fn only_whole_events_pass_and_a_later_answer_takes_the_first_ones_identity() {
        let mut splice = Splice {
            client_usage: true,
            ..Splice::default()
        };
        let first = r#"data: {"id":"a","created":1,"model":"m","choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}

data: {"id":"a","created":1,"model":"m","choices":[{"index":0,"delta":{"content":"lorem"}}],"usage":{"prompt_tokens":7,"completion_tokens":1,"total_tokens":8}}

data: {"id":"a","created":1,"model":"m","choi"#;
        let out = events(&mut splice, first);
        assert_eq!(out.matches("data: ").count(), 2, "{out}");
        assert!(
            !out.contains(r#""usage""#),
            "no usage in a chunk before the last, as vLLM sends them: {out}"
        );
        assert_eq!((splice.text.as_str(), splice.tokens), ("lorem", 1));
        splice.next_leg();
        let second = r#"data: {"id":"b","created":2,"model":"m2","choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}

data: {"id":"b","created":2,"model":"m2","choices":[{"index":0,"delta":{"content":" ipsum"},"finish_reason":"length"}]}

data: {"id":"b","created":2,"model":"m2","choices":[],"usage":{"prompt_tokens":9,"completion_tokens":1,"total_tokens":10}}

data: [DONE]

"#;
        let out = events(&mut splice, second);
        assert!(!out.contains("\"b\""), "{out}");
        assert_eq!(
            out.matches("\"role\"").count(),
            0,
            "a second role chunk: {out}"
        );
        assert!(out.contains(r#""prompt_tokens":7"#), "{out}");
        assert!(out.contains(r#""completion_tokens":2"#), "{out}");
        assert!(splice.done && splice.finished);
        assert_eq!(splice.text, "lorem ipsum");
    }

    fn migration(body: Value) -> Option<Map<String, Value>> {
        let Value::Object(body) = body else {
            return None;
        };
        continuable(&body, body.contains_key("messages")).then_some(body)
    }

    #[test]
    fn what_a_continuation_can_finish() {
        let chat = json!({"messages": [{"role": "user", "content": "hi"}], "stream": true});
        assert!(migration(chat.clone()).is_some());
        for (key, value) in [
            ("n", json!(2)),
            ("response_format", json!({"type": "json_object"})),
            ("guided_json", json!({})),
            ("logprobs", json!(true)),
            ("top_logprobs", json!(2)),
            ("stream", json!(false)),
        ] {
            let mut body = chat.clone();
            body[key] = value;
            assert!(migration(body).is_none(), "{key}");
        }
        let completions = json!({"prompt": "hi", "stream": true, "logprobs": null});
        assert!(migration(completions).is_some());
        assert!(migration(json!({"prompt": ["a", "b"], "stream": true})).is_none());
        assert!(migration(json!({"prompt": "hi", "stream": true, "echo": true})).is_none());
    }

    #[test]
    fn a_continuation_asks_for_the_rest() {
        let chat = migration(json!({"messages": [{"role": "user", "content": "hi"}],
            "stream": true, "max_tokens": 5, "min_tokens": 4,
            "kv_transfer_params": {"do_remote_prefill": true}}))
        .unwrap();
        let sent = Splice {
            text: "lorem ipsum".into(),
            tokens: 2,
            ..Splice::default()
        };
        let body: Value =
            serde_json::from_slice(&continuation(&chat, true, &sent).unwrap()).unwrap();
        assert_eq!(body["max_tokens"], 3);
        assert_eq!(body["min_tokens"], 2);
        assert_eq!(
            body["messages"][1],
            json!({"role": "assistant", "content": "lorem ipsum"})
        );
        assert_eq!(body["continue_final_message"], true);
        assert_eq!(body["add_generation_prompt"], false);
        assert!(body.get("kv_transfer_params").is_none());
        let spent = Splice {
            text: "a b c d e".into(),
            tokens: 5,
            ..Splice::default()
        };
        assert!(spent.budget_spent(&chat) && !sent.budget_spent(&chat));
        let completions = migration(json!({"prompt": "say", "stream": true})).unwrap();
        let body: Value =
            serde_json::from_slice(&continuation(&completions, false, &sent).unwrap()).unwrap();
        assert_eq!(body["prompt"], "saylorem ipsum");
    }

    #[test]
    fn crlf_events_pass_whole_and_reasoning_or_tools_end_the_chance_to_move() {
        let mut splice = Splice::default();
        let out = events(
            &mut splice,
            "data: {\"id\":\"a\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"x\"}}]}\r\n\r\ndata: {\"id\"",
        );
        assert_eq!(out.matches("data: ").count(), 1, "{out}");
        assert_eq!(splice.text, "x");
        assert!(!splice.final_answer);
        events(
            &mut splice,
            ":\"a\",\"choices\":[{\"index\":0,\"delta\":{\"reasoning_content\":\"hm\"}}]}\n\n",
        );
        assert!(
            splice.final_answer,
            "a continuation would lose the reasoning"
        );
    }

    #[test]
    fn an_engines_own_failure_is_held_back_while_the_answer_can_move() {
        let token =
            "data: {\"id\":\"a\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"x\"}}]}\n\n";
        let failure = |code: &str| {
            format!(
                "data: {{\"error\":{{\"message\":\"boom\",\"type\":\"InternalServerError\",\"param\":null,\"code\":{code}}}}}\n\ndata: [DONE]\n\n"
            )
        };
        // vLLM's engine-core failure (500, or 503 as a number or text): held back, and what
        // follows it too; the answer continues elsewhere.
        for code in ["500", "503", "\"503\""] {
            let mut splice = Splice {
                can_move: true,
                ..Splice::default()
            };
            let out = events(&mut splice, &format!("{token}{}", failure(code)));
            assert_eq!(out, token, "{code}");
            assert!(splice.engine_failed && !splice.done && !splice.final_answer);
        }
        // A request's own error (4xx), or no move left: the client gets the engine's event.
        for (code, can_move) in [("400", true), ("500", false)] {
            let mut splice = Splice {
                can_move,
                ..Splice::default()
            };
            let out = events(&mut splice, &format!("{token}{}", failure(code)));
            assert!(out.contains("boom") && out.ends_with("[DONE]\n\n"), "{out}");
            assert!(!splice.engine_failed && splice.final_answer && splice.done);
        }
    }

    /// A streamed chat answer `id` of model `m`: its role chunk, then one chunk of `content`.
    fn role_then_content(id: &str, created: u32, content: &str) -> String {
        let chunk = |delta: &str| {
            format!(
                r#"data: {{"id":"{id}","created":{created},"model":"m","choices":[{{"index":0,"delta":{delta}}}]}}

"#
            )
        };
        chunk(r#"{"role":"assistant","content":""}"#)
            + &chunk(&format!(r#"{{"content":"{content}"}}"#))
    }

    #[test]
    fn an_engine_failure_before_any_chunk_leaves_the_role_and_identity_to_the_next_answer() {
        let mut splice = Splice {
            can_move: true,
            ..Splice::default()
        };
        let failure = "data: {\"error\":{\"message\":\"boom\",\"type\":\"InternalServerError\",\"param\":null,\"code\":500}}\n\ndata: [DONE]\n\n";
        assert_eq!(events(&mut splice, failure), "");
        assert!(std::mem::take(&mut splice.engine_failed));
        splice.next_leg();
        let out = events(&mut splice, &role_then_content("b", 2, "lorem"));
        assert_eq!(out.matches("data: ").count(), 2, "{out}");
        assert!(
            out.contains(r#""role":"assistant""#),
            "the role chunk: {out}"
        );
        assert_eq!(out.matches(r#""id":"b""#).count(), 2, "{out}");
        // A third answer's role chunk is the one the client already had.
        splice.next_leg();
        let out = events(&mut splice, &role_then_content("c", 3, " ipsum"));
        assert_eq!(out.matches("data: ").count(), 1, "{out}");
        assert!(
            out.contains(r#""id":"b""#) && out.contains("ipsum"),
            "{out}"
        );
    }

    #[test]
    fn a_spent_budget_ends_with_a_finish_reason_and_the_usage_asked_for() {
        let mut splice = Splice {
            client_usage: true,
            ..Splice::default()
        };
        events(
            &mut splice,
            r#"data: {"id":"a","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"content":"x"}}],"usage":{"prompt_tokens":7,"completion_tokens":1,"total_tokens":8}}

"#,
        );
        let mut out = VecDeque::new();
        splice.ending(&mut out);
        let out: Vec<String> = out
            .iter()
            .map(|bytes| String::from_utf8_lossy(bytes).into_owned())
            .collect();
        assert_eq!(out.len(), 3, "{out:?}");
        assert!(out[0].contains(r#""finish_reason":"length""#), "{}", out[0]);
        assert!(out[0].contains(r#""id":"a""#), "{}", out[0]);
        assert!(out[1].contains(r#""prompt_tokens":7"#), "{}", out[1]);
        assert_eq!(out[2], "data: [DONE]\n\n");
    }
}
