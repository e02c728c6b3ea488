//! vLLM's Responses API (`/v1/responses`), with the response store vLLM keeps when started
//! with `VLLM_ENABLE_RESPONSES_API_STORE=1`: a stored response's conversation (its input and
//! its output) is the start of a follow-up's prompt (`previous_response_id`), so the
//! follow-up's `usage.input_tokens` counts the stored turns, and only the instance that
//! stored a response knows it.
//!
//! - `POST /v1/responses`: `input` (a string, or message items whose `content` is a string or
//!   `input_text` / `output_text` parts), `instructions` (a system message, not carried into
//!   follow-ups, as OpenAI), `previous_response_id`, `store` (default true), `stream`,
//!   `background`, `max_output_tokens`. The prompt is the chat template over
//!   [system(instructions)] + the previous response's conversation + the input. Streams
//!   vLLM's events (`response.created` … `response.completed`, which ends an incomplete
//!   response too; `event:` and `data:` lines, no `[DONE]`). Refused as vLLM 0.32 refuses it:
//!   the request model's checks and field types (`param: "body.FIELD"`), then the model, the
//!   previous response (404), an empty conversation, a prompt that fills the context
//!   (`param: "input"`), and the sampling ranges (`param: "max_tokens"` for a
//!   `max_output_tokens` below 1).
//! - `background: true` (only with `store`): answered at once with the response `queued` (or,
//!   with `stream`, its events as they come); it runs on a task of its own, which a client
//!   that leaves does not stop, and `GET` shows it `queued` until it is done.
//!   `POST /v1/responses/{id}/cancel` cancels it while it runs (the answer: the response,
//!   `cancelled`; its task is aborted, so the engine drops the request); a finished response
//!   cannot be cancelled (400, vLLM's "Cannot cancel a synchronous response.").
//! - `GET /v1/responses/{id}`: the stored response. vLLM has no `DELETE` here: 405, as for
//!   any known path with another method (`{"detail": "Method Not Allowed"}`).
//!
//! The store is bounded (`--max-stored-responses`): the oldest finished response is forgotten
//! first; one still running is kept.

use std::sync::Arc;
use std::time::Instant;

use axum::Json;
use axum::Router;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use http::HeaderMap;
use serde_json::{Value, json};
use tokio::sync::mpsc::UnboundedReceiver;

use super::common::{
    Interruption, Shared, Strike, check_model, draw_fault, event_stream, interrupt, random_id,
    request_id,
};
use super::store::Stored;
use crate::cache::block_hashes_under;
use crate::driver::EngineEvent;
use crate::engine::{FinishedSeq, SeqSpec};
use crate::metrics::Metrics;
use crate::openai::{ApiError, ApiKind, output_text, output_token_text, parse_json};
use crate::records::ReceivedRequest;
use crate::sampling::Generation;
use crate::tokenizer::{chat_prompt_text, tokenize};
use switchyard_tokenize::reuse;

pub(super) fn routes() -> Router<Arc<Shared>> {
    Router::new()
        .route("/v1/responses", post(create))
        .route("/v1/responses/{id}", get(retrieve))
        .route("/v1/responses/{id}/cancel", post(cancel))
}

/// The request fields the simulator reads (others are ignored, as vLLM ignores unknown ones),
/// from a body [`crate::sampling::check_responses_request`] passed.
#[derive(Debug, Default)]
struct CreateBody {
    model: Option<String>,
    input: Value,
    instructions: Option<String>,
    previous_response_id: Option<String>,
    store: bool,
    stream: bool,
    background: bool,
    max_output_tokens: Option<i64>,
    metadata: Value,
    /// The tool choice a response shows: `none` when no tools were given (vLLM's rule).
    tool_choice: Value,
    temperature: f64,
    top_p: f64,
    /// What the response object echoes of the request (vLLM's `from_request`).
    echoed: Echoed,
    /// The sampling fields, checked once the output budget is known.
    sampling: Generation,
}

/// The request fields a response object shows as they came (or their defaults).
#[derive(Debug, Clone, Default)]
struct Echoed {
    tools: Value,
    parallel_tool_calls: bool,
    service_tier: Value,
    truncation: Value,
    user: Value,
    text: Value,
    presence_penalty: f64,
    frequency_penalty: f64,
}

/// The tools as vLLM's request model shows them again: a function tool with every field of
/// its model, null where not given.
fn function_tools(mut tools: Value) -> Value {
    const FUNCTION_TOOL_FIELDS: [&str; 6] = [
        "allowed_callers",
        "async",
        "defer_loading",
        "description",
        "output_schema",
        "strict",
    ];
    for tool in tools.as_array_mut().into_iter().flatten() {
        if let Some(fields) = tool.as_object_mut()
            && fields.get("type").and_then(Value::as_str) == Some("function")
        {
            for name in FUNCTION_TOOL_FIELDS {
                fields.entry(name).or_insert(Value::Null);
            }
        }
    }
    tools
}

impl CreateBody {
    /// Reads a body as vLLM's request model does.
    fn read(bytes: &[u8]) -> Result<Self, ApiError> {
        let body: Value = parse_json(bytes, "invalid JSON body")?;
        let Value::Object(fields) = body else {
            return Err(ApiError::bad_request(
                "Input should be a valid dictionary or object to extract fields from".to_owned(),
            )
            .param("body"));
        };
        crate::sampling::check_responses_request(&fields)?;
        let text = |name: &str| fields.get(name).and_then(Value::as_str).map(str::to_owned);
        let flag = |name: &str, default: bool| {
            fields
                .get(name)
                .and_then(reuse::lax_bool)
                .unwrap_or(default)
        };
        // A number as the request model read it (a string of one too), or `default`.
        let number = |name: &str, default: f64| {
            fields
                .get(name)
                .and_then(|value| value.as_f64().or_else(|| value.as_str()?.parse().ok()))
                .unwrap_or(default)
        };
        let has_tools = fields
            .get("tools")
            .and_then(Value::as_array)
            .is_some_and(|tools| !tools.is_empty());
        let tool_choice = match fields.get("tool_choice") {
            None | Some(Value::Null) if !has_tools => json!("none"),
            Some(Value::String(choice)) if !has_tools && choice == "auto" => json!("none"),
            None | Some(Value::Null) => json!("auto"),
            Some(choice) => choice.clone(),
        };
        let given = |name: &str, default: Value| {
            fields
                .get(name)
                .filter(|value| !value.is_null())
                .cloned()
                .unwrap_or(default)
        };
        let echoed = Echoed {
            tools: function_tools(given("tools", json!([]))),
            parallel_tool_calls: flag("parallel_tool_calls", true),
            service_tier: given("service_tier", json!("auto")),
            truncation: given("truncation", json!("disabled")),
            user: given("user", Value::Null),
            text: given("text", Value::Null),
            presence_penalty: number("presence_penalty", 0.0),
            frequency_penalty: number("frequency_penalty", 0.0),
        };
        Ok(Self {
            model: text("model"),
            input: fields.get("input").cloned().unwrap_or(Value::Null),
            instructions: text("instructions"),
            previous_response_id: text("previous_response_id"),
            // A null `store` is false there (`if request.store`).
            store: !fields.get("store").is_some_and(Value::is_null) && flag("store", true),
            stream: flag("stream", false),
            background: flag("background", false),
            max_output_tokens: fields.get("max_output_tokens").and_then(reuse::lax_integer),
            metadata: fields.get("metadata").cloned().unwrap_or(Value::Null),
            tool_choice,
            temperature: number("temperature", 1.0),
            top_p: number("top_p", 1.0),
            echoed,
            sampling: Generation::of_responses(&fields),
        })
    }
}

/// The text of a message item's `content`: a string, or its text parts concatenated.
fn content_text(content: &Value) -> String {
    match content {
        Value::String(text) => text.clone(),
        Value::Array(parts) => parts
            .iter()
            .filter(|part| {
                matches!(
                    part.get("type").and_then(Value::as_str),
                    Some("input_text" | "output_text" | "text")
                )
            })
            .filter_map(|part| part.get("text").and_then(Value::as_str))
            .collect(),
        _ => String::new(),
    }
}

/// `input` as chat messages.
fn input_messages(input: &Value) -> Result<Vec<Value>, ApiError> {
    match input {
        Value::String(text) => Ok(vec![json!({"role": "user", "content": text})]),
        Value::Array(items) => Ok(items.iter().filter_map(input_message).collect()),
        _ => Err(
            ApiError::bad_request("input must be a string or an array of items".to_owned())
                .param("input"),
        ),
    }
}

/// One input item as a chat message: a message; a function call (the assistant's turn, its
/// name and arguments); a function call's output (a tool turn); other items (reasoning, ...)
/// add no text here.
fn input_message(item: &Value) -> Option<Value> {
    let text = |name: &str| item.get(name).and_then(Value::as_str).unwrap_or_default();
    match item.get("type").and_then(Value::as_str) {
        Some("function_call") => Some(json!({
            "role": "assistant",
            "content": format!("{}({})", text("name"), text("arguments")),
        })),
        Some("function_call_output") => Some(json!({
            "role": "tool",
            "content": item.get("output").map(content_text).unwrap_or_default(),
        })),
        None | Some("message") => {
            let role = item.get("role").and_then(Value::as_str).unwrap_or("user");
            let content = item.get("content").map(content_text).unwrap_or_default();
            Some(json!({"role": role, "content": content}))
        }
        Some(_) => None,
    }
}

/// What one response shares between its events and its final object.
#[derive(Debug, Clone)]
struct Meta {
    id: String,
    message_id: String,
    created_at: u64,
    model: String,
    instructions: Option<String>,
    previous_response_id: Option<String>,
    store: bool,
    background: bool,
    /// vLLM's budget: `max_output_tokens` within the context left, else the context left
    /// (what the response shows as `max_output_tokens`, and what makes it `incomplete`).
    budget: i64,
    metadata: Value,
    tool_choice: Value,
    temperature: f64,
    top_p: f64,
    echoed: Echoed,
}

impl Meta {
    /// The response object, with vLLM 0.32's fields: `output` and `usage` once done,
    /// `status` as given.
    fn response(&self, status: &str, output: Option<(&str, &FinishedSeq, u32)>) -> Value {
        let (output, usage, incomplete) = match output {
            Some((text, finished, prompt_len)) => {
                let cached = finished.cached_tokens + finished.transferred_tokens;
                (
                    json!([self.message(text, "completed")]),
                    json!({
                        "input_tokens": prompt_len,
                        "input_tokens_details": {
                            "cached_tokens": cached,
                            "cache_write_tokens": 0,
                            "input_tokens_per_turn": [],
                            "cached_tokens_per_turn": [],
                        },
                        "output_tokens": finished.completion_tokens,
                        "output_tokens_details": {
                            "reasoning_tokens": 0,
                            "tool_output_tokens": 0,
                            "output_tokens_per_turn": [],
                            "tool_output_tokens_per_turn": [],
                        },
                        "total_tokens": prompt_len + finished.completion_tokens,
                    }),
                    (status == "incomplete").then(|| json!({"reason": "max_output_tokens"})),
                )
            }
            None => (json!([]), Value::Null, None),
        };
        json!({
            "id": self.id,
            "created_at": self.created_at,
            "incomplete_details": incomplete,
            "instructions": self.instructions,
            "metadata": self.metadata,
            "model": self.model,
            "object": "response",
            "output": output,
            "parallel_tool_calls": self.echoed.parallel_tool_calls,
            "temperature": self.temperature,
            "tool_choice": self.tool_choice,
            "tools": self.echoed.tools,
            "top_p": self.top_p,
            "background": self.background,
            "max_output_tokens": self.budget,
            "max_tool_calls": null,
            "previous_response_id": self.previous_response_id,
            "prompt": null,
            "reasoning": null,
            "service_tier": self.echoed.service_tier,
            "status": status,
            "text": self.echoed.text,
            "top_logprobs": null,
            "truncation": self.echoed.truncation,
            "usage": usage,
            "user": self.echoed.user,
            "presence_penalty": self.echoed.presence_penalty,
            "frequency_penalty": self.echoed.frequency_penalty,
            "kv_transfer_params": null,
            "ec_transfer_params": null,
            "input_messages": null,
            "output_messages": null,
        })
    }

    fn message(&self, text: &str, status: &str) -> Value {
        let content = if status == "completed" {
            json!([{"type": "output_text", "text": text, "annotations": [], "logprobs": null}])
        } else {
            json!([])
        };
        json!({
            "id": self.message_id,
            "content": content,
            "role": "assistant",
            "status": status,
            "type": "message",
            "phase": null,
        })
    }

    /// `completed`, or `incomplete` when the output reached vLLM's budget (the client's
    /// `max_output_tokens` within the context; without one the simulated model stops by
    /// itself, short of the context).
    fn final_status(&self, finished: &FinishedSeq) -> &'static str {
        if i64::from(finished.completion_tokens) >= self.budget {
            "incomplete"
        } else {
            "completed"
        }
    }
}

async fn create(State(shared): State<Arc<Shared>>, headers: HeaderMap, body: Bytes) -> Response {
    let arrival = Instant::now();
    Metrics::increment(&shared.metrics.requests_received);
    let request_id = request_id(&headers);
    let parsed = CreateBody::read(&body);
    shared.records.record(ReceivedRequest {
        path: "/v1/responses".to_owned(),
        headers: ReceivedRequest::select_headers(&headers),
        body_bytes: body.len(),
        model: parsed.as_ref().ok().and_then(|body| body.model.clone()),
        stream: parsed.as_ref().is_ok_and(|body| body.stream),
        ..ReceivedRequest::default()
    });
    let response = match parsed {
        Ok(body) => run(&shared, body, &request_id, arrival)
            .await
            .unwrap_or_else(IntoResponse::into_response),
        Err(error) => error.into_response(),
    };
    super::common::with_request_id(response, &request_id)
}

/// vLLM's 400 for an error of the request as a whole (its `invalid_request_error` type).
fn invalid_request(mut error: ApiError) -> ApiError {
    error.error_type = "invalid_request_error";
    error
}

async fn run(
    shared: &Arc<Shared>,
    body: CreateBody,
    request_id: &str,
    arrival: Instant,
) -> Result<Response, ApiError> {
    let config = &shared.config;
    check_model(config, body.model.as_deref())?;
    let mut conversation = Vec::new();
    if let Some(instructions) = &body.instructions {
        conversation.push(json!({"role": "system", "content": instructions}));
    }
    if let Some(previous) = &body.previous_response_id {
        let stored = shared
            .responses
            .get(previous)
            .ok_or_else(|| not_found(previous))?;
        conversation.extend(stored.conversation);
    }
    let context = config.max_model_len;
    // Checked with the rendering's tokenization parameters.
    if let Some(asked) = body.max_output_tokens
        && asked > i64::from(context)
    {
        return Err(crate::sampling::refused(
            format!(
                "max_output_tokens={asked} cannot be greater than max_model_len={context}. \
                 Please request fewer output tokens."
            ),
            Some("max_output_tokens"),
            Some(asked.to_string()),
        ));
    }
    conversation.extend(input_messages(&body.input)?);
    if conversation.is_empty() {
        return Err(ApiError::bad_request(
            "Cannot apply chat template to an empty conversation. Provide at least one message."
                .to_owned(),
        ));
    }
    let tokens = tokenize(&chat_prompt_text(&conversation));
    let prompt_len = u32::try_from(tokens.len()).unwrap_or(u32::MAX);
    if prompt_len > context {
        // The tokenizer stops one token past the context, and that is refused.
        let over = context + 1;
        return Err(crate::sampling::refused(
            format!(
                "This model's maximum context length is {context} tokens. However, your prompt \
                 contains at least {over} input tokens, which exceeds this limit even without \
                 any output tokens. Please reduce the length of the input prompt."
            ),
            Some("input_tokens"),
            Some(over.to_string()),
        ));
    }
    if prompt_len == context {
        return Err(invalid_request(
            ApiError::bad_request(format!(
                "The engine prompt length {prompt_len} exceeds the max_model_len {context}. \
                 Please reduce prompt."
            ))
            .param("input"),
        ));
    }
    // vLLM's budget: the context left, or less if asked; then its sampling checks.
    let room = i64::from(context - prompt_len);
    let budget = body.max_output_tokens.map_or(room, |asked| asked.min(room));
    body.sampling
        .check_sampling(ApiKind::Chat, budget, shared.vocabulary())?;
    // Without a limit asked, the simulated model stops by itself (`--default-max-tokens`).
    let max_tokens = match body.max_output_tokens {
        Some(_) => u32::try_from(budget).unwrap_or(u32::MAX),
        None => config.default_max_tokens.min(context - prompt_len),
    };
    let streaming = body.stream;
    let interruption = match draw_fault(shared, request_id, streaming, max_tokens).await {
        Ok(interruption) => interruption,
        Err(response) => return Ok(response),
    };
    let lora = config.lora(body.model.as_deref());
    let answering_model = lora.as_ref().map_or_else(
        || config.served_model_name.clone(),
        |lora| lora.name.to_string(),
    );
    let spec = SeqSpec {
        prompt_len,
        block_hashes: block_hashes_under(lora.as_ref(), &tokens, config.block_size),
        prompt_tokens: if config.kv_events.is_some() {
            tokens
        } else {
            Vec::new()
        },
        max_tokens,
        remote_prompt_tokens: 0,
        report_reuse: false,
        lora,
        skip_prefix_cache: false,
    };
    let events = shared
        .engine
        .submit(spec, arrival)
        .map_err(|stopped| ApiError::unavailable(stopped.to_string()))?;
    let meta = Meta {
        id: random_id("resp_"),
        message_id: random_id("msg_"),
        created_at: switchyard_process::clock::unix_seconds(),
        model: answering_model,
        instructions: body.instructions,
        previous_response_id: body.previous_response_id,
        store: body.store,
        background: body.background,
        budget,
        metadata: body.metadata,
        tool_choice: body.tool_choice,
        temperature: body.temperature,
        top_p: body.top_p,
        echoed: body.echoed,
    };
    let done = Done {
        shared: Arc::clone(shared),
        meta,
        conversation,
        prompt_len,
    };
    if body.background {
        // Stored queued at once; it runs on, and is stored again when done.
        let queued = done.meta.response("queued", None);
        shared.responses.insert(
            done.meta.id.clone(),
            Stored {
                response: queued.clone(),
                conversation: done.conversation.clone(),
            },
        );
        if streaming {
            return Ok(done.stream_in_background(events, interruption));
        }
        done.run_in_background(events);
        return Ok(Json(queued).into_response());
    }
    if streaming {
        return Ok(done.stream(events, interruption));
    }
    let mut events = events;
    let finished = super::common::wait_finished(&mut events).await?;
    Ok(Json(done.finish(&finished)).into_response())
}

/// A response being made: what storing it and its last event need.
struct Done {
    shared: Arc<Shared>,
    meta: Meta,
    conversation: Vec<Value>,
    prompt_len: u32,
}

impl Done {
    /// The final response object, stored unless `store: false`.
    fn finish(&self, finished: &FinishedSeq) -> Value {
        let text = output_text(finished.completion_tokens);
        let status = self.meta.final_status(finished);
        let response = self
            .meta
            .response(status, Some((&text, finished, self.prompt_len)));
        if self.meta.store {
            let mut conversation = self.conversation.clone();
            conversation.push(json!({"role": "assistant", "content": text}));
            self.shared.responses.finish(
                self.meta.id.clone(),
                Stored {
                    response: response.clone(),
                    conversation,
                },
            );
        }
        response
    }

    /// Runs a background response to its end on a task of its own, which a cancel aborts;
    /// a request the engine fails is stored `failed`, as vLLM stores it.
    fn run_in_background(self, mut events: UnboundedReceiver<EngineEvent>) {
        let id = self.meta.id.clone();
        let shared = Arc::clone(&self.shared);
        let (registered, wait_registered) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            let _ = wait_registered.await;
            // Cancelled before its task was known: its work ends here (the engine drops a
            // request whose events nobody reads).
            if self.shared.responses.cancelled(&self.meta.id) {
                self.shared.responses.stopped(&self.meta.id);
                return;
            }
            match super::common::wait_finished(&mut events).await {
                Ok(finished) => {
                    self.finish(&finished);
                }
                Err(_) => {
                    let failed = self.meta.response("failed", None);
                    self.shared.responses.finish(
                        self.meta.id.clone(),
                        Stored {
                            response: failed,
                            conversation: self.conversation.clone(),
                        },
                    );
                }
            }
            self.shared.responses.stopped(&self.meta.id);
        });
        shared.responses.running(id, task.abort_handle());
        let _ = registered.send(());
    }

    /// A background response streamed (`background` and `stream`): its events are made on a
    /// task of its own, as vLLM makes them, so a client that leaves does not stop the work,
    /// and a cancel does (the stream then ends). Ended early (a fault, the engine gone), it is
    /// stored `failed`.
    fn stream_in_background(
        self,
        events: UnboundedReceiver<EngineEvent>,
        interruption: Option<Interruption>,
    ) -> Response {
        let id = self.meta.id.clone();
        let shared = Arc::clone(&self.shared);
        let failed = Stored {
            response: self.meta.response("failed", None),
            conversation: self.conversation.clone(),
        };
        let (sender, mut receiver) = tokio::sync::mpsc::unbounded_channel();
        let (registered, wait_registered) = tokio::sync::oneshot::channel::<()>();
        let task_shared = Arc::clone(&shared);
        let task_id = id.clone();
        let task = tokio::spawn(async move {
            let _ = wait_registered.await;
            if !task_shared.responses.cancelled(&task_id) {
                let made = self.events(events, interruption);
                futures::pin_mut!(made);
                while let Some(item) = futures::StreamExt::next(&mut made).await {
                    // The client may have left; the work goes on.
                    let _ = sender.send(item);
                }
                // Not stored as done (cut short): failed, unless cancelled.
                if task_shared
                    .responses
                    .get(&task_id)
                    .is_some_and(|kept| kept.response["status"] == "queued")
                {
                    task_shared.responses.finish(task_id.clone(), failed);
                }
            }
            task_shared.responses.stopped(&task_id);
        });
        shared.responses.running(id, task.abort_handle());
        let _ = registered.send(());
        event_stream(async_stream::stream! {
            while let Some(item) = receiver.recv().await {
                yield item;
            }
        })
    }

    /// vLLM's streamed events, one per engine token in between.
    fn stream(
        self,
        events: UnboundedReceiver<EngineEvent>,
        interruption: Option<Interruption>,
    ) -> Response {
        event_stream(self.events(events, interruption))
    }

    /// The events of [`Self::stream`], the response stored when done.
    fn events(
        self,
        mut events: UnboundedReceiver<EngineEvent>,
        interruption: Option<Interruption>,
    ) -> impl futures::Stream<Item = Result<Bytes, std::io::Error>> + Send + 'static {
        async_stream::stream! {
            let meta = self.meta.clone();
            let mut sequence = 0u64;
            let mut event = |kind: &str, mut data: Value| {
                data["type"] = json!(kind);
                data["sequence_number"] = json!(sequence);
                sequence += 1;
                sse_event(kind, &data)
            };
            yield Ok(event("response.created", json!({"response": meta.response("in_progress", None)})));
            yield Ok(event("response.in_progress", json!({"response": meta.response("in_progress", None)})));
            yield Ok(event("response.output_item.added", json!({
                "output_index": 0,
                "item": meta.message("", "in_progress"),
            })));
            yield Ok(event("response.content_part.added", json!({
                "item_id": meta.message_id,
                "output_index": 0,
                "content_index": 0,
                "part": {"type": "output_text", "text": "", "annotations": [], "logprobs": []},
            })));
            let mut sent = 0u32;
            loop {
                let Some(engine_event) = events.recv().await else {
                    yield Ok(event("error", json!({
                        "code": "engine_stopped",
                        "message": "the engine stopped before the request finished",
                        "param": null,
                    })));
                    break;
                };
                match engine_event {
                    EngineEvent::Token => {
                        match interrupt(interruption, sent).await {
                            Some(Strike::Cut(error)) => {
                                yield Err(error);
                                break;
                            }
                            Some(Strike::ErrorEvent) => {
                                yield Ok(event("error", json!({
                                    "code": "engine_error",
                                    "message": "simulated engine failure under the request (fault injection)",
                                    "param": null,
                                })));
                                break;
                            }
                            None => {}
                        }
                        yield Ok(event("response.output_text.delta", json!({
                            "item_id": meta.message_id,
                            "output_index": 0,
                            "content_index": 0,
                            "delta": output_token_text(sent),
                            "logprobs": [],
                        })));
                        sent += 1;
                    }
                    EngineEvent::Finished(finished) => {
                        let text = output_text(finished.completion_tokens);
                        yield Ok(event("response.output_text.done", json!({
                            "item_id": meta.message_id,
                            "output_index": 0,
                            "content_index": 0,
                            "text": text,
                            "logprobs": [],
                        })));
                        yield Ok(event("response.content_part.done", json!({
                            "item_id": meta.message_id,
                            "output_index": 0,
                            "content_index": 0,
                            "part": {"type": "output_text", "text": text, "annotations": [], "logprobs": []},
                        })));
                        yield Ok(event("response.output_item.done", json!({
                            "output_index": 0,
                            "item": meta.message(&text, "completed"),
                        })));
                        // vLLM ends an incomplete response with `response.completed` too.
                        let response = self.finish(&finished);
                        yield Ok(event("response.completed", json!({"response": response})));
                        break;
                    }
                    EngineEvent::Rejected(rejected) => {
                        yield Ok(event("error", json!({
                            "code": "rejected",
                            "message": rejected.to_string(),
                            "param": null,
                        })));
                        break;
                    }
                }
            }
        }
    }
}

/// One server-sent event: `event: KIND` and one `data:` line.
fn sse_event(kind: &str, data: &Value) -> Bytes {
    let mut bytes = Vec::with_capacity(256);
    bytes.extend_from_slice(b"event: ");
    bytes.extend_from_slice(kind.as_bytes());
    bytes.extend_from_slice(b"\ndata: ");
    // Serializing a serde_json::Value cannot fail.
    let _ = serde_json::to_writer(&mut bytes, data);
    bytes.extend_from_slice(b"\n\n");
    Bytes::from(bytes)
}

fn not_found(id: &str) -> ApiError {
    invalid_request(
        ApiError::not_found(format!("Response with id '{id}' not found.")).param("response_id"),
    )
}

async fn retrieve(
    State(shared): State<Arc<Shared>>,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let stored = shared.responses.get(&id).ok_or_else(|| not_found(&id))?;
    Ok(Json(stored.response))
}

async fn cancel(
    State(shared): State<Arc<Shared>>,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    match shared.responses.cancel(&id) {
        Ok(Some(cancelled)) => {
            if let Some(task) = shared.responses.stopped(&id) {
                task.abort();
            }
            Ok(Json(cancelled))
        }
        Ok(None) => Err(invalid_request(
            ApiError::bad_request("Cannot cancel a synchronous response.".to_owned())
                .param("response_id"),
        )),
        Err(()) => Err(not_found(&id)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::StatusCode;

    #[test]
    fn input_items_become_chat_messages() {
        let messages = input_messages(&json!([
            {"role": "user", "content": "hi"},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "hello"}]},
            {"type": "function_call_output", "call_id": "c", "output": "42"},
        ]))
        .unwrap();
        assert_eq!(
            messages,
            vec![
                json!({"role": "user", "content": "hi"}),
                json!({"role": "assistant", "content": "hello"}),
                json!({"role": "tool", "content": "42"}),
            ]
        );
        assert_eq!(
            input_messages(&json!(7)).unwrap_err().status,
            StatusCode::BAD_REQUEST
        );
    }
}
