//! What the simulator's handlers share: its state ([`Shared`]), request ids, the checks every
//! generation path makes (model, prompt fits, faults drawn), waiting for a sequence, and the
//! SSE stream with its injected interruptions.

use std::sync::{Arc, OnceLock};

use axum::body::{Body, Bytes};
use axum::response::{IntoResponse, Response};
use http::header::CONTENT_TYPE;
use http::{HeaderMap, HeaderValue};
use serde_json::Value;
use tokio::sync::mpsc::UnboundedReceiver;

use super::store::ResponseStore;
use crate::config::SimConfig;
use crate::driver::{EngineClient, EngineEvent};
use crate::engine::FinishedSeq;
use crate::faults::{Fault, FaultInjector};
use crate::handoff::HttpClient;
use crate::kv_events::{KvEventsControl, KvEventsInfo};
use crate::metrics::Metrics;
use crate::nixl::{Handoffs, SideChannel};
use crate::openai::{ApiError, ApiKind, InferenceBody, KvTransfer, ResponseMeta, Usage};
use crate::records::Recorder;

/// A fault that strikes a streamed answer after some tokens.
#[derive(Debug, Clone, Copy)]
pub(super) struct Interruption {
    after_tokens: u32,
    how: Interrupt,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Interrupt {
    /// Close the connection (die).
    Close,
    /// Keep it open and send nothing more (stall).
    Stall,
    /// End the stream with an error event (the engine failed under the request).
    ErrorEvent,
}

/// How a streamed answer is struck.
pub(super) enum Strike {
    /// The connection breaks with this error.
    Cut(std::io::Error),
    /// The answer ends with an error event and `[DONE]`.
    ErrorEvent,
}

/// The error a failing engine reports in its stream (vLLM's `InternalServerError`).
pub(super) fn engine_failure() -> ApiError {
    ApiError::internal("simulated engine failure under the request (fault injection)".to_owned())
}

/// What every handler can reach (built by the server).
#[derive(Debug)]
pub(crate) struct Shared {
    pub config: SimConfig,
    pub engine_id: String,
    pub engine: EngineClient,
    pub metrics: Arc<Metrics>,
    pub faults: FaultInjector,
    pub records: Recorder,
    pub handoffs: Handoffs,
    /// The NIXL side channel as bound, known before serving starts.
    pub side_channel: OnceLock<SideChannel>,
    /// The KV-event sockets as bound (with `--kv-events`), known once bound.
    pub kv_events: OnceLock<KvEventsInfo>,
    pub kv_control: Arc<KvEventsControl>,
    /// For KV hand-offs with other engines (checking a pull, pushing to a partner).
    pub http: HttpClient,
    /// Stored Responses API responses (`previous_response_id`, GET, DELETE).
    pub responses: ResponseStore,
    /// `--tokenizer`: the model's own tokenizer and chat template.
    pub tokenizer: Option<Arc<switchyard_tokenize::EngineTokenizer>>,
}

impl Shared {
    /// The served model's vocabulary size (a tokenizer's; without one, 2^32, no bound).
    pub(crate) fn vocabulary(&self) -> u64 {
        self.tokenizer
            .as_deref()
            .map_or(1 << 32, |tokenizer| tokenizer.vocab_size() as u64)
    }
}

/// The client's `X-Request-Id` (vLLM uses it as the request id), else a random one.
pub(super) fn request_id(headers: &HeaderMap) -> String {
    headers
        .get("x-request-id")
        .and_then(|value| value.to_str().ok())
        .filter(|id| !id.is_empty())
        .map_or_else(|| random_id(""), str::to_owned)
}

/// `prefix` and 32 random hex digits.
pub(super) fn random_id(prefix: &str) -> String {
    format!("{prefix}{:032x}", fastrand::u128(..))
}

pub(super) fn with_request_id(mut response: Response, request_id: &str) -> Response {
    if let Ok(value) = HeaderValue::from_str(request_id) {
        response.headers_mut().insert("x-request-id", value);
    }
    response
}

/// vLLM's 404 for a request that names a model other than the one served.
pub(super) fn check_model(config: &SimConfig, model: Option<&str>) -> Result<(), ApiError> {
    match model {
        Some(model) if model != config.served_model_name && config.lora(Some(model)).is_none() => {
            Err(ApiError::model_not_found(model))
        }
        _ => Ok(()),
    }
}

/// Output tokens to generate: 1 for a disaggregated prefill, else what the request asks,
/// else `--default-max-tokens` (within the context).
pub(super) fn output_budget(
    config: &SimConfig,
    (body, kind): (&InferenceBody, ApiKind),
    kv: &KvTransfer,
    prompt_len: u32,
) -> Result<u32, ApiError> {
    if kv.do_remote_decode {
        return Ok(1);
    }
    Ok(match body.requested_max_tokens(kind)? {
        Some(max_tokens) => max_tokens,
        None => config
            .default_max_tokens
            .min(config.max_model_len.saturating_sub(prompt_len))
            .max(1),
    })
}

/// Draws this request's fault. `Ok(interruption)` to serve it (a stream to be cut or stalled
/// after some tokens, if any); `Err(response)` to answer now. A hang never returns.
pub(super) async fn draw_fault(
    shared: &Shared,
    request_id: &str,
    streaming: bool,
    max_tokens: u32,
) -> Result<Option<Interruption>, Response> {
    // A streamed answer is interrupted after a few tokens; any other is answered now.
    let interrupted = |how: Interrupt| {
        streaming.then(|| {
            Some(Interruption {
                after_tokens: CUT_AFTER_TOKENS.min(max_tokens - 1),
                how,
            })
        })
    };
    match shared.faults.draw() {
        Fault::None if shared.faults.draw_error_mid_stream() => {
            Metrics::increment(&shared.metrics.responses_errored);
            interrupted(Interrupt::ErrorEvent).ok_or_else(|| engine_failure().into_response())
        }
        Fault::None => Ok(None),
        Fault::Fail => {
            Metrics::increment(&shared.metrics.requests_failed);
            Err(
                ApiError::internal("simulated engine failure (fault injection)".to_owned())
                    .into_response(),
            )
        }
        Fault::Hang => {
            Metrics::increment(&shared.metrics.requests_hung);
            tracing::debug!(request_id, "fault injection: never answering");
            std::future::pending().await
        }
        Fault::DieMidStream => {
            Metrics::increment(&shared.metrics.responses_cut);
            interrupted(Interrupt::Close).ok_or_else(cut_response)
        }
        Fault::StallMidStream => {
            Metrics::increment(&shared.metrics.responses_stalled);
            tracing::debug!(request_id, "fault injection: stalling the answer");
            interrupted(Interrupt::Stall).ok_or_else(stalled_response)
        }
    }
}

/// The output budget as vLLM 0.32 allows it: an ask for more than the whole context
/// (`param`, the field that asked) is refused, as is a prompt the context cannot hold (with one
/// output token, unless `max_tokens` is 0: pooling); otherwise the budget is cut to what the
/// context leaves (vLLM's `get_max_tokens`). A request the whole KV cache cannot hold is
/// refused too.
pub(super) fn check_fits(
    config: &SimConfig,
    prompt_len: u32,
    max_tokens: u32,
    param: &'static str,
) -> Result<u32, ApiError> {
    let context = config.max_model_len;
    if max_tokens > context {
        return Err(ApiError::bad_request(format!(
            "{param}={max_tokens} cannot be greater than max_model_len={context}. Please \
             request fewer output tokens. (parameter={param}, value={max_tokens})"
        ))
        .param(param));
    }
    if prompt_len == context && max_tokens > 0 {
        // vLLM leaves such a request no output token, then refuses that budget.
        return Err(crate::sampling::refused(
            "max_tokens must be at least 1, got 0.".to_owned(),
            Some("max_tokens"),
            Some("0".to_owned()),
        ));
    }
    if prompt_len > context {
        return Err(ApiError::bad_request(format!(
            "This model's maximum context length is {context} tokens. However, your prompt \
             contains {prompt_len} input tokens, which exceeds this limit even without any \
             output tokens. Please reduce the length of the input prompt. \
             (parameter=input_tokens, value={prompt_len})"
        ))
        .param("input_tokens"));
    }
    let max_tokens = max_tokens.min(context - prompt_len);
    let total = u64::from(prompt_len) + u64::from(max_tokens);
    let blocks = total.div_ceil(config.block_size as u64);
    if blocks > config.kv_cache_blocks as u64 {
        return Err(ApiError::bad_request(format!(
            "The request needs {blocks} KV-cache blocks but the engine has only {} \
             (--kv-cache-blocks).",
            config.kv_cache_blocks
        )));
    }
    Ok(max_tokens)
}

/// Waits for the engine to finish the request.
pub(super) async fn wait_finished(
    events: &mut UnboundedReceiver<EngineEvent>,
) -> Result<FinishedSeq, ApiError> {
    while let Some(event) = events.recv().await {
        match event {
            EngineEvent::Token => {}
            EngineEvent::Finished(finished) => return Ok(finished),
            EngineEvent::Rejected(rejected) => {
                return Err(ApiError::internal(rejected.to_string()));
            }
        }
    }
    Err(ApiError::unavailable(
        "the engine stopped before the request finished".to_owned(),
    ))
}

/// Strikes a streamed answer before its token number `sent`, if `interruption` waits for that
/// one. A stall never returns: the connection stays open and nothing more is sent (the
/// request's engine work is dropped with its events when the client leaves). A cut returns
/// the error that breaks the stream; an error event says so. None: stream on.
pub(super) async fn interrupt(interruption: Option<Interruption>, sent: u32) -> Option<Strike> {
    let fault = interruption.filter(|fault| fault.after_tokens == sent)?;
    match fault.how {
        Interrupt::Close => Some(Strike::Cut(std::io::Error::other(
            "simulated crash (fault injection)",
        ))),
        Interrupt::ErrorEvent => Some(Strike::ErrorEvent),
        Interrupt::Stall => std::future::pending().await,
    }
}

/// A `text/event-stream` response that sends `stream`'s chunks as they come.
pub(super) fn event_stream(
    stream: impl futures::Stream<Item = Result<Bytes, std::io::Error>> + Send + 'static,
) -> Response {
    (
        [(
            CONTENT_TYPE,
            HeaderValue::from_static("text/event-stream; charset=utf-8"),
        )],
        Body::from_stream(stream),
    )
        .into_response()
}

/// A die- or stall-mid-stream fault strikes after this many streamed tokens.
pub(super) const CUT_AFTER_TOKENS: u32 = 2;

/// A response whose body fails at once: the connection is closed before a complete answer.
pub(super) fn cut_response() -> Response {
    let failure = futures::stream::iter([Err::<Bytes, std::io::Error>(std::io::Error::other(
        "simulated crash (fault injection)",
    ))]);
    Response::new(Body::from_stream(failure))
}

/// A response whose head is sent and whose body never comes (the connection stays open).
pub(super) fn stalled_response() -> Response {
    let never = futures::stream::pending::<Result<Bytes, std::io::Error>>();
    (
        [(CONTENT_TYPE, HeaderValue::from_static("application/json"))],
        Body::from_stream(never),
    )
        .into_response()
}

/// A streamed (SSE) answer: one `data:` chunk per token, then usage if asked, then `[DONE]`.
pub(super) struct SseStream {
    pub(super) meta: ResponseMeta,
    pub(super) prompt_len: u32,
    pub(super) max_tokens: u32,
    pub(super) include_usage: bool,
    /// Every chunk carries the usage so far (`continuous_usage_stats`).
    pub(super) continuous_usage: bool,
    /// Fault injection: close or stall the stream after some tokens.
    pub(super) interruption: Option<Interruption>,
}

impl SseStream {
    /// `continuous_usage_stats`: the chunk's usage once `completion` tokens are sent.
    fn usage_so_far(&self, chunk: &mut serde_json::Value, completion: u32) {
        // Each choice's own count, as vLLM counts a chunk's (the last chunk sums them).
        if self.continuous_usage {
            chunk["usage"] = serde_json::json!({
                "prompt_tokens": self.prompt_len,
                "completion_tokens": completion,
                "total_tokens": self.prompt_len + completion,
            });
        }
    }

    pub(super) fn into_response(self, mut events: UnboundedReceiver<EngineEvent>) -> Response {
        let stream = async_stream::stream! {
            let mut sent = 0u32;
            loop {
                let Some(event) = events.recv().await else {
                    let error = ApiError::unavailable(
                        "the engine stopped before the request finished".to_owned(),
                    );
                    yield Ok(sse_data(&error.to_json()));
                    yield Ok(Bytes::from_static(b"data: [DONE]\n\n"));
                    break;
                };
                match event {
                    EngineEvent::Token => {
                        match interrupt(self.interruption, sent).await {
                            Some(Strike::Cut(error)) => {
                                yield Err(error);
                                break;
                            }
                            Some(Strike::ErrorEvent) => {
                                yield Ok(sse_data(&engine_failure().to_json()));
                                yield Ok(Bytes::from_static(b"data: [DONE]\n\n"));
                                break;
                            }
                            None => {}
                        }
                        // One chunk for each choice in turn (`n`), as vLLM streams them.
                        if sent == 0 && self.meta.kind == ApiKind::Chat {
                            for mut chunk in self.meta.for_each_choice(self.meta.role_chunk()) {
                                self.usage_so_far(&mut chunk, 0);
                                yield Ok(sse_data(&chunk));
                            }
                            if let Some(chunk) = self.meta.echo_chunk() {
                                for mut chunk in self.meta.for_each_choice(chunk) {
                                    self.usage_so_far(&mut chunk, 0);
                                    yield Ok(sse_data(&chunk));
                                }
                            }
                        }
                        let finish_reason = (sent + 1 >= self.max_tokens).then_some("length");
                        let chunk = self.meta.token_chunk(sent, finish_reason);
                        for mut chunk in self.meta.for_each_choice(chunk) {
                            self.usage_so_far(&mut chunk, sent + 1);
                            yield Ok(sse_data(&chunk));
                        }
                        sent += 1;
                    }
                    EngineEvent::Finished(finished) => {
                        if self.include_usage {
                            let usage = usage(self.prompt_len, &finished);
                            yield Ok(sse_data(&self.meta.usage_chunk(usage)));
                        }
                        yield Ok(Bytes::from_static(b"data: [DONE]\n\n"));
                        break;
                    }
                    EngineEvent::Rejected(rejected) => {
                        yield Ok(sse_data(&ApiError::internal(rejected.to_string()).to_json()));
                        yield Ok(Bytes::from_static(b"data: [DONE]\n\n"));
                        break;
                    }
                }
            }
        };
        event_stream(stream)
    }
}

pub(super) fn usage(prompt_len: u32, finished: &FinishedSeq) -> Usage {
    Usage {
        prompt_tokens: prompt_len,
        completion_tokens: finished.completion_tokens,
        // vLLM counts KV pulled from a remote prefill engine as cached.
        cached_tokens: finished.cached_tokens + finished.transferred_tokens,
    }
}

pub(super) fn sse_data(value: &Value) -> Bytes {
    let mut line = Vec::with_capacity(256);
    line.extend_from_slice(b"data: ");
    // Serializing a serde_json::Value cannot fail.
    let _ = serde_json::to_writer(&mut line, value);
    line.extend_from_slice(b"\n\n");
    Bytes::from(line)
}
