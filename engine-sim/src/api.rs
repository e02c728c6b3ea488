//! The HTTP API: vLLM's OpenAI-compatible routes, the SageMaker container contract
//! (`/ping`, `/invocations`), Prometheus `/metrics`, and `/sim/*` controls for tests, over
//! the state every handler reaches ([`Shared`]). The Responses API (with its store) is in
//! `responses`, the pooling APIs and `/detokenize` in `pooling`.

mod pooling;
pub(crate) mod responses;

use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use axum::Json;
use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{DefaultBodyLimit, State};
use axum::response::{IntoResponse, Response};
use axum::routing::{MethodRouter, get, post};
use http::header::CONTENT_TYPE;
use http::{HeaderMap, HeaderValue, StatusCode};
use serde_json::{Value, json};
use switchyard_shared::InstanceRole;
use tokio::sync::mpsc::UnboundedReceiver;

use self::responses::ResponseStore;
use crate::config::SimConfig;
use crate::driver::{EngineClient, EngineEvent};
use crate::engine::{FinishedSeq, SeqSpec};
use crate::faults::{Fault, FaultInjector, Faults, TokenizeFault};
use crate::handoff::{HttpClient, IssuedHandoff, Push};
use crate::kv_events::{KvEventsControl, KvEventsInfo, KvEventsState};
use crate::metrics::{Metrics, SimStats};
use crate::nixl::{Handoff, Handoffs, prefill_response_params};
use crate::openai::{
    ApiError, ApiKind, InferenceBody, KvTransfer, ParsedRequest, ResponseMeta, Usage, output_text,
    output_token_text, parse_json, parse_request,
};
use crate::records::{ReceivedRequest, Recorder};

/// Bodies up to this size are parsed and tokenized on the async thread; larger ones on a
/// blocking thread (tokenizing 64 KiB takes a few hundred microseconds).
const PARSE_INLINE_LIMIT: usize = 64 * 1024;
/// vLLM has no small body limit; the router's is 6 MiB.
const MAX_BODY_BYTES: usize = 64 * 1024 * 1024;
/// A die- or stall-mid-stream fault strikes after this many streamed tokens.
const CUT_AFTER_TOKENS: u32 = 2;

/// A fault that strikes a streamed answer after some tokens.
#[derive(Debug, Clone, Copy)]
struct Interruption {
    after_tokens: u32,
    /// Close the connection (die), or keep it open and send nothing more (stall).
    close: bool,
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
    /// The listening address, known once serving starts.
    pub local_addr: OnceLock<SocketAddr>,
    /// The KV-event sockets as bound (with `--kv-events`), known once bound.
    pub kv_events: OnceLock<KvEventsInfo>,
    pub kv_control: Arc<KvEventsControl>,
    /// For KV hand-offs with other engines (checking a pull, pushing to a partner).
    pub http: HttpClient,
    /// Stored Responses API responses (`previous_response_id`, GET, DELETE).
    pub responses: ResponseStore,
}

pub(crate) fn router(shared: Arc<Shared>) -> Router {
    Route::ALL
        .into_iter()
        .fold(Router::new(), |router, route| {
            router.route(route.path(), inference(route))
        })
        .route("/v1/models", get(models))
        .route("/health", get(ok))
        .route("/ping", get(ok))
        .route("/metrics", get(metrics))
        .route("/tokenize", post(tokenize))
        .route("/sim/requests", get(sim_requests))
        .route("/sim/faults", get(sim_faults).post(set_sim_faults))
        .route("/sim/stats", get(sim_stats))
        .route("/sim/handoffs", get(sim_handoffs))
        .route("/sim/handoffs/{request_id}", get(sim_handoff))
        .route("/sim/kv-push", post(sim_kv_push))
        .route("/sim/kv-events", get(sim_kv_events).post(set_sim_kv_events))
        .route("/reset_prefix_cache", post(reset_prefix_cache))
        .merge(responses::routes())
        .merge(pooling::routes())
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(shared)
}

/// The inference routes.
#[derive(Debug, Clone, Copy)]
enum Route {
    ChatCompletions,
    Completions,
    Invocations,
}

impl Route {
    const ALL: [Route; 3] = [
        Route::ChatCompletions,
        Route::Completions,
        Route::Invocations,
    ];

    fn path(self) -> &'static str {
        match self {
            Route::ChatCompletions => "/v1/chat/completions",
            Route::Completions => "/v1/completions",
            Route::Invocations => "/invocations",
        }
    }

    /// None: decided by the body (`messages` means chat), the SageMaker rule.
    fn kind(self) -> Option<ApiKind> {
        match self {
            Route::ChatCompletions => Some(ApiKind::Chat),
            Route::Completions => Some(ApiKind::Completion),
            Route::Invocations => None,
        }
    }
}

/// The `POST` route of one inference path.
fn inference(route: Route) -> MethodRouter<Arc<Shared>> {
    post(
        move |State(shared): State<Arc<Shared>>,
              version: http::Version,
              headers: HeaderMap,
              body: Bytes| infer(shared, route, version, headers, body),
    )
}

/// Serves one inference request: record it, validate it, inject faults, run it on the engine.
async fn infer(
    shared: Arc<Shared>,
    route: Route,
    version: http::Version,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let arrival = Instant::now();
    Metrics::increment(&shared.metrics.requests_received);
    let body_bytes = body.len();
    let parsed = parse_off_thread(&shared, body, route.kind()).await;

    let request_id = request_id(&headers);
    let mut record = ReceivedRequest {
        path: route.path().to_owned(),
        headers: ReceivedRequest::select_headers(&headers),
        http_version: format!("{version:?}"),
        body_bytes,
        ..ReceivedRequest::default()
    };
    // A decode request's hand-off is checked with the prefill engine it names before the
    // pull; a hand-off that does not check out is recomputed here, as vLLM does.
    let mut pull = Pull::None;
    if let Ok(parsed) = &parsed {
        let kv = parsed.body.kv_transfer();
        record.model = parsed.body.model.clone();
        record.stream = parsed.body.stream();
        record.kv_transfer_params = parsed.body.kv_transfer_params.is_some();
        record.kv_transfer = parsed.body.kv_transfer_params.clone();
        record.do_remote_decode = kv.do_remote_decode;
        record.do_remote_prefill = kv.do_remote_prefill;
        if kv.do_remote_prefill {
            match crate::handoff::verify(&shared.http, &kv, &request_id).await {
                Ok(()) => {
                    record.handoff = Some("accepted".into());
                    pull = Pull::Accepted;
                }
                Err(error) => {
                    let why = error.to_string();
                    Metrics::increment(&shared.metrics.kv_pull_failures);
                    tracing::warn!(request_id, why, "KV pull failed; recomputing the prompt");
                    record.handoff = Some(format!("rejected: {why}"));
                    pull = Pull::Rejected;
                }
            }
        }
    }
    shared.records.record(record);

    let response = match parsed {
        Ok(parsed) => run_request(&shared, parsed, &request_id, arrival, pull)
            .await
            .unwrap_or_else(IntoResponse::into_response),
        Err(error) => error.into_response(),
    };
    with_request_id(response, &request_id)
}

/// A decode request's remote prefill, as checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pull {
    /// Not a disaggregated decode request.
    None,
    /// The hand-off checked out: the prompt's KV is pulled.
    Accepted,
    /// It did not: the prompt is recomputed here.
    Rejected,
}

async fn parse_off_thread(
    shared: &Shared,
    body: Bytes,
    kind: Option<ApiKind>,
) -> Result<ParsedRequest, ApiError> {
    let block_size = shared.config.block_size;
    if body.len() <= PARSE_INLINE_LIMIT {
        return parse_request(&body, kind, block_size);
    }
    tokio::task::spawn_blocking(move || parse_request(&body, kind, block_size))
        .await
        .unwrap_or_else(|err| Err(ApiError::internal(format!("tokenizer task failed: {err}"))))
}

/// The client's `X-Request-Id` (vLLM uses it as the request id), else a random one.
fn request_id(headers: &HeaderMap) -> String {
    headers
        .get("x-request-id")
        .and_then(|value| value.to_str().ok())
        .filter(|id| !id.is_empty())
        .map_or_else(|| random_id(""), str::to_owned)
}

/// `prefix` and 32 random hex digits.
fn random_id(prefix: &str) -> String {
    format!("{prefix}{:032x}", fastrand::u128(..))
}

fn with_request_id(mut response: Response, request_id: &str) -> Response {
    if let Ok(value) = HeaderValue::from_str(request_id) {
        response.headers_mut().insert("x-request-id", value);
    }
    response
}

/// Validates a parsed request, applies fault injection, and runs it on the engine.
async fn run_request(
    shared: &Shared,
    parsed: ParsedRequest,
    request_id: &str,
    arrival: Instant,
    pull: Pull,
) -> Result<Response, ApiError> {
    let config = &shared.config;
    let ParsedRequest { body, kind, prompt } = parsed;
    check_model(config, body.model.as_deref())?;
    let prompt = prompt?;
    let kv = body.kv_transfer();
    let prompt_len = u32::try_from(prompt.tokens.len()).unwrap_or(u32::MAX);
    let max_tokens = output_budget(config, &body, &kv, prompt_len)?;
    check_fits(config, prompt_len, max_tokens)?;
    let streaming = body.stream() && !kv.do_remote_decode;
    let interruption = match draw_fault(shared, request_id, streaming, max_tokens).await {
        Ok(interruption) => interruption,
        Err(response) => return Ok(response),
    };

    if config.role == InstanceRole::Prefill && !kv.do_remote_decode {
        tracing::debug!(request_id, "prefill instance serving a whole request");
    }
    if config.role == InstanceRole::Decode && !kv.do_remote_prefill {
        tracing::debug!(request_id, "decode instance prefilling a request itself");
    }
    // LMCache's PD backend on a prefill engine: the prompt's blocks go to the decode partner
    // once computed (a request that is not itself a NixlConnector prefill, not streamed).
    let push = config
        .kv_push_to
        .as_ref()
        .filter(|_| config.role == InstanceRole::Prefill && !kv.do_remote_decode && !streaming)
        .map(|partner| {
            let full = prompt.block_hashes.len() * config.block_size;
            (
                partner.clone(),
                Push {
                    block_hashes: prompt.block_hashes.clone(),
                    token_ids: prompt.tokens[..full.min(prompt.tokens.len())].to_vec(),
                },
            )
        });
    let spec = SeqSpec {
        prompt_len,
        block_hashes: prompt.block_hashes,
        prompt_tokens: if config.kv_events.is_some() {
            prompt.tokens
        } else {
            Vec::new()
        },
        max_tokens,
        remote_prompt_tokens: if pull == Pull::Rejected {
            0
        } else {
            remote_prompt_tokens(config, &kv, prompt_len)
        },
    };
    let events = shared
        .engine
        .submit(spec, arrival)
        .map_err(|stopped| ApiError::unavailable(stopped.to_string()))?;
    let meta = ResponseMeta {
        id: match kind {
            ApiKind::Chat => format!("chatcmpl-{request_id}"),
            ApiKind::Completion => format!("cmpl-{request_id}"),
        },
        created: switchyard_process::clock::unix_seconds(),
        model: config.served_model_name.clone(),
        kind,
    };
    if kv.do_remote_decode {
        return prefill_only_response(shared, &meta, events, request_id, prompt_len).await;
    }
    if let Some((partner, blocks)) = push {
        let mut events = events;
        let finished = wait_finished(&mut events).await?;
        let note = match crate::handoff::push(&shared.http, &partner, &blocks).await {
            Ok(stored) => format!(
                "pushed {} blocks ({stored} new) to {partner}",
                blocks.block_hashes.len()
            ),
            Err(error) => {
                let why = error.to_string();
                tracing::warn!(request_id, why, "LMCache push to the decode partner failed");
                format!("push failed: {why}")
            }
        };
        shared
            .records
            .update(request_id, |record| record.kv_push = Some(note));
        return Ok(finished_response(&meta, &finished, prompt_len));
    }
    if streaming {
        let stream = SseStream {
            meta,
            prompt_len,
            max_tokens,
            include_usage: body.include_usage(),
            interruption,
        };
        return Ok(stream.into_response(events));
    }
    whole_response(&meta, events, prompt_len).await
}

/// vLLM's 404 for a request that names a model other than the one served.
fn check_model(config: &SimConfig, model: Option<&str>) -> Result<(), ApiError> {
    match model {
        Some(model) if model != config.served_model_name => Err(ApiError::model_not_found(model)),
        _ => Ok(()),
    }
}

/// Output tokens to generate: 1 for a disaggregated prefill, else what the request asks,
/// else `--default-max-tokens` (within the context).
fn output_budget(
    config: &SimConfig,
    body: &InferenceBody,
    kv: &KvTransfer,
    prompt_len: u32,
) -> Result<u32, ApiError> {
    if kv.do_remote_decode {
        return Ok(1);
    }
    Ok(match body.requested_max_tokens()? {
        Some(max_tokens) => max_tokens,
        None => config
            .default_max_tokens
            .min(config.max_model_len.saturating_sub(prompt_len))
            .max(1),
    })
}

/// Leading prompt tokens a disaggregated decode request pulls from its prefill engine: those
/// covered by `remote_block_ids` (all of them if the ids are missing).
fn remote_prompt_tokens(config: &SimConfig, kv: &KvTransfer, prompt_len: u32) -> u32 {
    if !kv.do_remote_prefill {
        return 0;
    }
    kv.remote_blocks
        .map_or(prompt_len, |blocks| {
            u32::try_from(blocks.saturating_mul(config.block_size)).unwrap_or(u32::MAX)
        })
        .min(prompt_len)
}

/// Draws this request's fault. `Ok(interruption)` to serve it (a stream to be cut or stalled
/// after some tokens, if any); `Err(response)` to answer now. A hang never returns.
async fn draw_fault(
    shared: &Shared,
    request_id: &str,
    streaming: bool,
    max_tokens: u32,
) -> Result<Option<Interruption>, Response> {
    match shared.faults.draw() {
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
            if streaming {
                Ok(Some(Interruption {
                    after_tokens: CUT_AFTER_TOKENS.min(max_tokens - 1),
                    close: true,
                }))
            } else {
                Err(cut_response())
            }
        }
        Fault::StallMidStream => {
            Metrics::increment(&shared.metrics.responses_stalled);
            tracing::debug!(request_id, "fault injection: stalling the answer");
            if streaming {
                Ok(Some(Interruption {
                    after_tokens: CUT_AFTER_TOKENS.min(max_tokens - 1),
                    close: false,
                }))
            } else {
                Err(stalled_response())
            }
        }
    }
}

/// Refuses requests longer than the context or the whole KV cache, like vLLM.
fn check_fits(config: &SimConfig, prompt_len: u32, max_tokens: u32) -> Result<(), ApiError> {
    let total = u64::from(prompt_len) + u64::from(max_tokens);
    if total > u64::from(config.max_model_len) {
        return Err(ApiError::bad_request(format!(
            "This model's maximum context length is {} tokens. However, you requested {total} \
             tokens ({prompt_len} in the messages, {max_tokens} in the completion). Please \
             reduce the length of the messages or completion.",
            config.max_model_len
        )));
    }
    let blocks = total.div_ceil(config.block_size as u64);
    if blocks > config.kv_cache_blocks as u64 {
        return Err(ApiError::bad_request(format!(
            "The request needs {blocks} KV-cache blocks but the engine has only {} \
             (--kv-cache-blocks).",
            config.kv_cache_blocks
        )));
    }
    Ok(())
}

fn usage(prompt_len: u32, finished: &FinishedSeq) -> Usage {
    Usage {
        prompt_tokens: prompt_len,
        completion_tokens: finished.completion_tokens,
        // vLLM counts KV pulled from a remote prefill engine as cached.
        cached_tokens: finished.cached_tokens + finished.transferred_tokens,
    }
}

/// Waits for the engine to finish the request.
async fn wait_finished(
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

async fn whole_response(
    meta: &ResponseMeta,
    mut events: UnboundedReceiver<EngineEvent>,
    prompt_len: u32,
) -> Result<Response, ApiError> {
    let finished = wait_finished(&mut events).await?;
    Ok(finished_response(meta, &finished, prompt_len))
}

fn finished_response(meta: &ResponseMeta, finished: &FinishedSeq, prompt_len: u32) -> Response {
    let text = output_text(finished.completion_tokens);
    let body = meta.response(text, "length", usage(prompt_len, finished), None);
    Json(body).into_response()
}

/// A NixlConnector prefill (`do_remote_decode`): one token, plus the `kv_transfer_params` a
/// decoder needs to pull the KV cache.
async fn prefill_only_response(
    shared: &Shared,
    meta: &ResponseMeta,
    mut events: UnboundedReceiver<EngineEvent>,
    request_id: &str,
    prompt_len: u32,
) -> Result<Response, ApiError> {
    let finished = wait_finished(&mut events).await?;
    let block_ids = shared
        .handoffs
        .record(request_id, prompt_len, shared.config.block_size);
    Metrics::increment(&shared.metrics.kv_handoffs);
    let params = prefill_response_params(
        &shared.engine_id,
        request_id,
        &block_ids,
        shared.local_addr.get().copied(),
    );
    let text = output_text(finished.completion_tokens);
    let body = meta.response(text, "length", usage(prompt_len, &finished), Some(params));
    Ok(Json(body).into_response())
}

/// A response whose body fails at once: the connection is closed before a complete answer.
fn cut_response() -> Response {
    let failure = futures::stream::iter([Err::<Bytes, std::io::Error>(std::io::Error::other(
        "simulated crash (fault injection)",
    ))]);
    Response::new(Body::from_stream(failure))
}

/// A response whose head is sent and whose body never comes (the connection stays open).
fn stalled_response() -> Response {
    let never = futures::stream::pending::<Result<Bytes, std::io::Error>>();
    (
        [(CONTENT_TYPE, HeaderValue::from_static("application/json"))],
        Body::from_stream(never),
    )
        .into_response()
}

/// A streamed (SSE) answer: one `data:` chunk per token, then usage if asked, then `[DONE]`.
struct SseStream {
    meta: ResponseMeta,
    prompt_len: u32,
    max_tokens: u32,
    include_usage: bool,
    /// Fault injection: close or stall the stream after some tokens.
    interruption: Option<Interruption>,
}

impl SseStream {
    fn into_response(self, mut events: UnboundedReceiver<EngineEvent>) -> Response {
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
                        if let Some(error) = interrupt(self.interruption, sent).await {
                            yield Err(error);
                            break;
                        }
                        if sent == 0 && self.meta.kind == ApiKind::Chat {
                            yield Ok(sse_data(&self.meta.role_chunk(self.include_usage)));
                        }
                        let finish_reason = (sent + 1 >= self.max_tokens).then_some("length");
                        let chunk = self.meta.token_chunk(
                            output_token_text(sent),
                            finish_reason,
                            self.include_usage,
                        );
                        yield Ok(sse_data(&chunk));
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

/// Strikes a streamed answer before its token number `sent`, if `interruption` waits for that
/// one. A stall never returns: the connection stays open and nothing more is sent (the
/// request's engine work is dropped with its events when the client leaves). A cut returns
/// the error that breaks the stream. None: stream on.
async fn interrupt(interruption: Option<Interruption>, sent: u32) -> Option<std::io::Error> {
    let fault = interruption.filter(|fault| fault.after_tokens == sent)?;
    if fault.close {
        return Some(std::io::Error::other("simulated crash (fault injection)"));
    }
    std::future::pending().await
}

/// A `text/event-stream` response that sends `stream`'s chunks as they come.
fn event_stream(
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

fn sse_data(value: &Value) -> Bytes {
    let mut line = Vec::with_capacity(256);
    line.extend_from_slice(b"data: ");
    // Serializing a serde_json::Value cannot fail.
    let _ = serde_json::to_writer(&mut line, value);
    line.extend_from_slice(b"\n\n");
    Bytes::from(line)
}

async fn ok() -> StatusCode {
    StatusCode::OK
}

async fn models(State(shared): State<Arc<Shared>>) -> Json<Value> {
    let name = &shared.config.served_model_name;
    Json(json!({
        "object": "list",
        "data": [{
            "id": name,
            "object": "model",
            "created": switchyard_process::clock::unix_seconds(),
            "owned_by": "vllm",
            "root": name,
            "parent": null,
            "max_model_len": shared.config.max_model_len,
            "permission": [],
        }],
    }))
}

async fn metrics(State(shared): State<Arc<Shared>>) -> Response {
    let text = shared.metrics.render(&shared.config.served_model_name);
    (
        [(CONTENT_TYPE, switchyard_process::metrics::CONTENT_TYPE)],
        text,
    )
        .into_response()
}

/// vLLM's `/tokenize`: `{"prompt": ...}` or `{"messages": [...]}` → the token count and ids.
async fn tokenize(State(shared): State<Arc<Shared>>, body: Bytes) -> Result<Json<Value>, ApiError> {
    match shared.faults.draw_tokenize() {
        TokenizeFault::None => {}
        TokenizeFault::Fail => {
            return Err(ApiError::internal(
                "simulated tokenizer failure (fault injection)".to_owned(),
            ));
        }
        TokenizeFault::Hang => {
            tracing::debug!("fault injection: never answering /tokenize");
            std::future::pending::<()>().await;
        }
    }
    let parsed = parse_off_thread(&shared, body, None).await?;
    check_model(&shared.config, parsed.body.model.as_deref())?;
    let prompt = parsed.prompt?;
    Ok(Json(json!({
        "count": prompt.tokens.len(),
        "max_model_len": shared.config.max_model_len,
        "tokens": prompt.tokens,
        "token_strs": null,
    })))
}

async fn sim_requests(State(shared): State<Arc<Shared>>) -> Json<Vec<ReceivedRequest>> {
    Json(shared.records.snapshot())
}

async fn sim_stats(State(shared): State<Arc<Shared>>) -> Json<SimStats> {
    Json(shared.metrics.stats())
}

async fn sim_handoffs(State(shared): State<Arc<Shared>>) -> Json<Vec<Handoff>> {
    Json(shared.handoffs.snapshot())
}

/// What this (prefill) engine handed off for one request: what a decoder checks before it
/// pulls. 404 if it issued nothing for that request id.
async fn sim_handoff(
    State(shared): State<Arc<Shared>>,
    axum::extract::Path(request_id): axum::extract::Path<String>,
) -> Result<Json<IssuedHandoff>, ApiError> {
    let handoff = shared
        .handoffs
        .snapshot()
        .into_iter()
        .rev()
        .find(|handoff| handoff.request_id == request_id)
        .ok_or_else(|| {
            ApiError::not_found(format!("no hand-off issued for request {request_id}"))
        })?;
    Ok(Json(IssuedHandoff {
        engine_id: shared.engine_id.clone(),
        request_id: handoff.request_id,
        block_ids: handoff.block_ids,
        prompt_tokens: handoff.prompt_tokens,
    }))
}

/// Blocks a prefill engine pushes here (LMCache): cached as if computed here.
async fn sim_kv_push(
    State(shared): State<Arc<Shared>>,
    body: Bytes,
) -> Result<Json<Value>, ApiError> {
    let push: Push = parse_json(&body, "invalid push")?;
    let stored = shared
        .engine
        .store_pushed(push.block_hashes, push.token_ids)
        .await
        .map_err(|stopped| ApiError::unavailable(stopped.to_string()))?;
    Metrics::increment(&shared.metrics.kv_pushes_received);
    Ok(Json(json!({"stored": stored})))
}

/// The 404 of the KV-event routes without `--kv-events`.
fn kv_events_off() -> ApiError {
    ApiError::not_found("KV-cache events are off (start with --kv-events)".to_owned())
}

/// Where the KV-event sockets are (ports resolved) and the test controls' state; 404 without
/// `--kv-events`.
async fn sim_kv_events(State(shared): State<Arc<Shared>>) -> Result<Json<Value>, ApiError> {
    let info = shared.kv_events.get().ok_or_else(kv_events_off)?;
    Ok(Json(json!({
        "endpoint": info.endpoint,
        "replay_endpoint": info.replay_endpoint,
        "topic": info.topic,
        "format": info.format,
        "replay_buffer": info.replay_buffer,
        "state": shared.kv_control.state(),
    })))
}

/// Test controls: `{"drop_next": N}` keeps the next N batches off the wire (replay still has
/// them); `{"stalled": true|false}` stops or resumes publishing and replay.
async fn set_sim_kv_events(
    State(shared): State<Arc<Shared>>,
    body: Bytes,
) -> Result<Json<KvEventsState>, ApiError> {
    #[derive(serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Controls {
        stalled: Option<bool>,
        drop_next: Option<u64>,
    }
    if shared.kv_events.get().is_none() {
        return Err(kv_events_off());
    }
    let controls: Controls = parse_json(&body, "invalid KV-event controls")?;
    shared.kv_control.set(controls.stalled, controls.drop_next);
    tracing::info!(stalled = ?controls.stalled, drop_next = ?controls.drop_next, "KV-event controls changed");
    Ok(Json(shared.kv_control.state()))
}

/// vLLM's `POST /reset_prefix_cache`: empties the prefix cache (an `AllBlocksCleared` event)
/// unless running requests hold blocks. `{"reset": bool}` says which.
async fn reset_prefix_cache(State(shared): State<Arc<Shared>>) -> Result<Json<Value>, ApiError> {
    let reset = shared
        .engine
        .reset_prefix_cache()
        .await
        .map_err(|stopped| ApiError::unavailable(stopped.to_string()))?;
    if !reset {
        tracing::warn!("prefix cache not reset: running requests hold blocks");
    }
    Ok(Json(json!({ "reset": reset })))
}

async fn sim_faults(State(shared): State<Arc<Shared>>) -> Json<Faults> {
    Json(shared.faults.get())
}

/// Sets the fault knobs from a JSON [`Faults`] (missing fields are 0).
async fn set_sim_faults(
    State(shared): State<Arc<Shared>>,
    body: Bytes,
) -> Result<Json<Faults>, ApiError> {
    let faults: Faults = parse_json(&body, "invalid faults")?;
    faults
        .validate()
        .map_err(|error| ApiError::bad_request(error.to_string()))?;
    shared.faults.set(faults);
    tracing::info!(?faults, "fault knobs changed");
    Ok(Json(faults))
}
