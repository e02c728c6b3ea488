//! The HTTP API: vLLM's OpenAI-compatible routes, the SageMaker container contract
//! (`/ping`, `/invocations`), Prometheus `/metrics`, and `/sim/*` controls for tests, over
//! the state every handler reaches ([`Shared`]). The Responses API (with its store) is in
//! `responses`, the pooling APIs and `/detokenize` in `pooling`.

mod common;
mod pooling;
pub(crate) mod responses;
mod store;

pub(crate) use common::Shared;
use common::{
    SseStream, check_fits, check_model, draw_fault, event_stream, output_budget, request_id,
    sse_data, usage, wait_finished, with_request_id,
};
pub(crate) use store::ResponseStore;

use std::sync::Arc;
use std::time::Instant;

use axum::Json;
use axum::Router;
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, State};
use axum::response::{IntoResponse, Response};
use axum::routing::{MethodRouter, get, post};
use http::header::CONTENT_TYPE;
use http::{HeaderMap, StatusCode};
use serde_json::{Value, json};
use switchyard_shared::InstanceRole;
use tokio::sync::mpsc::UnboundedReceiver;

use crate::config::{KvLoadFailurePolicy, SimConfig, lora_of};
use crate::driver::EngineEvent;
use crate::engine::{FinishedSeq, SeqSpec};
use crate::faults::{Faults, TokenizeFault};
use crate::handoff::{IssuedHandoff, Push};
use crate::kv_events::KvEventsState;
use crate::metrics::{Metrics, SimStats};
use crate::nixl::{Handoff, PullError, internal_request_id, prefill_response_params};
use crate::openai::{
    ApiError, ApiKind, Echo, InferenceBody, KvTransfer, ParsedRequest, Reading, ResponseMeta,
    parse_json, parse_request,
};
use crate::records::ReceivedRequest;

/// Bodies up to this size are parsed and tokenized on the async thread; larger ones on a
/// blocking thread (tokenizing 64 KiB takes a few hundred microseconds).
const PARSE_INLINE_LIMIT: usize = 64 * 1024;
/// vLLM has no small body limit; the router's is 6 MiB.
const MAX_BODY_BYTES: usize = 64 * 1024 * 1024;
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
        .route("/sim/kv-push", post(sim_kv_push))
        .route("/sim/kv-events", get(sim_kv_events).post(set_sim_kv_events))
        .route("/reset_prefix_cache", post(reset_prefix_cache))
        .merge(responses::routes())
        .merge(pooling::routes())
        .fallback(unknown_path)
        .method_not_allowed_fallback(unknown_method)
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(shared)
}

/// A path vLLM's server does not serve: FastAPI's answer.
async fn unknown_path() -> Response {
    (
        http::StatusCode::NOT_FOUND,
        Json(serde_json::json!({"detail": "Not Found"})),
    )
        .into_response()
}

/// A known path with a method it does not take (`DELETE /v1/responses/{id}`): FastAPI's
/// answer.
async fn unknown_method() -> Response {
    (
        http::StatusCode::METHOD_NOT_ALLOWED,
        Json(serde_json::json!({"detail": "Method Not Allowed"})),
    )
        .into_response()
}

/// The NIXL side channel, a listener apart from the HTTP port (as vLLM's handshake is): a
/// decoder pulls a hand-off here (`GET /handoffs/{remote_request_id}`), once.
pub(crate) fn side_channel(shared: Arc<Shared>) -> Router {
    Router::new()
        .route("/handoffs/{request_id}", get(pull_handoff))
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
    let parsed = parse_off_thread(&shared, body, route.kind().into()).await;

    let request_id = request_id(&headers);
    let mut record = ReceivedRequest {
        path: route.path().to_owned(),
        headers: ReceivedRequest::select_headers(&headers),
        http_version: format!("{version:?}"),
        body_bytes,
        ..ReceivedRequest::default()
    };
    // A decode request's hand-off is checked with the prefill engine it names before the
    // pull; a hand-off that does not check out fails the request or is recomputed here, as
    // `--kv-load-failure-policy` says (vLLM's `kv_load_failure_policy`).
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
            let verified = match crate::handoff::verify(&shared.http, &kv).await {
                Ok(()) if shared.faults.draw_kv_pull_failure() => {
                    Err("the KV transfer failed (fault injection)".to_owned())
                }
                verified => verified.map_err(|error| error.to_string()),
            };
            match verified {
                Ok(()) => {
                    record.handoff = Some("accepted".into());
                    pull = Pull::Accepted;
                }
                Err(why) => {
                    Metrics::increment(&shared.metrics.kv_pull_failures);
                    let policy = shared.config.kv_load_failure_policy;
                    tracing::warn!(request_id, why, ?policy, "KV pull failed");
                    record.handoff = Some(format!("rejected: {why}"));
                    pull = Pull::Rejected;
                }
            }
        } else if !shared.config.lmcache_receiver_alloc_ports.is_empty()
            && matches!(&parsed.body.prompt, Some(serde_json::Value::Array(ids)) if ids.first().is_some_and(serde_json::Value::is_u64))
            && shared.faults.draw_kv_pull_failure()
        {
            // An LMCache PD receiver loading what a prefiller pushed for a prompt of token ids
            // (LMCache's decode hop): the load fails as `kv_pull_fail_rate` says.
            Metrics::increment(&shared.metrics.kv_pull_failures);
            let policy = shared.config.kv_load_failure_policy;
            tracing::warn!(
                request_id,
                ?policy,
                "LMCache KV load failed (fault injection)"
            );
            record.handoff = Some("rejected: the LMCache KV load failed (fault injection)".into());
            pull = Pull::Rejected;
        }
    }
    shared.records.record(record);

    let response = match parsed.and_then(|parsed| {
        check_data_parallel_rank(&headers, shared.config.data_parallel_size)?;
        Ok(parsed)
    }) {
        Ok(parsed) => run_request(&shared, parsed, &request_id, arrival, pull)
            .await
            .unwrap_or_else(IntoResponse::into_response),
        Err(error) => error.into_response(),
    };
    with_request_id(response, &request_id)
}

/// vLLM's rule for `X-data-parallel-rank`: a header that is not an integer is ignored (the
/// engine's balancer picks); an integer outside `0..size` is refused with a 400.
fn check_data_parallel_rank(headers: &HeaderMap, size: u32) -> Result<(), ApiError> {
    let Some(rank) = headers
        .get("x-data-parallel-rank")
        .and_then(|value| value.to_str().ok())
        .and_then(|text| text.trim().parse::<i64>().ok())
    else {
        return Ok(());
    };
    if (0..i64::from(size)).contains(&rank) {
        Ok(())
    } else {
        Err(ApiError::bad_request(format!(
            "data_parallel_rank {rank} is out of range [0, {size})."
        )))
    }
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
    reading: Reading,
) -> Result<ParsedRequest, ApiError> {
    let limits = (shared.config.block_size, shared.config.max_model_len);
    let tokenizer = shared.tokenizer.clone();
    if body.len() <= PARSE_INLINE_LIMIT {
        return parse_request(&body, reading, limits, tokenizer.as_deref(), |model| {
            shared.config.lora(model)
        });
    }
    let modules = shared.config.lora_modules.clone();
    tokio::task::spawn_blocking(move || {
        parse_request(&body, reading, limits, tokenizer.as_deref(), |model| {
            lora_of(&modules, model)
        })
    })
    .await
    .unwrap_or_else(|err| Err(ApiError::internal(format!("tokenizer task failed: {err}"))))
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
    let ParsedRequest {
        body,
        generation,
        kind,
        prompt,
    } = parsed;
    check_model(config, body.model.as_deref())?;
    generation.check_rendering(kind)?;
    crate::openai::check_conversation(&body, kind)?;
    let prompt = prompt?;
    let kv = body.kv_transfer();
    let prompt_len = u32::try_from(prompt.tokens.len()).unwrap_or(u32::MAX);
    let vocabulary = shared.vocabulary();
    // A budget asked below 1 is refused among the other sampling parameters, in their order.
    if let Some(asked) = body
        .asked_max_tokens(kind)
        .filter(|&asked| asked < 1 && !body.echo_alone(kind))
    {
        generation.check_sampling(kind, asked, vocabulary)?;
    }
    let asked = output_budget(config, (&body, kind), &kv, prompt_len)?;
    // Without a budget the simulator's default is raised to `min_tokens` (vLLM would generate
    // up to the context, and never fewer than the minimum).
    let room = config.max_model_len.saturating_sub(prompt_len);
    let asked = if body.asked_max_tokens(kind).is_none() && !kv.do_remote_decode {
        asked.max(generation.min_tokens().min(room))
    } else {
        asked
    };
    let resume_at = body.resume_at(kind);
    let budget_field = if kind == ApiKind::Chat && body.max_completion_tokens.is_some() {
        "max_completion_tokens"
    } else {
        "max_tokens"
    };
    let max_tokens = check_fits(config, prompt_len, asked, budget_field)?;
    // The sampling parameters are checked against vLLM's budget: what was asked, within the
    // context; else a chat's whole context left and a completion's 16 (the simulator's own
    // default and a prefill's one token do not count here).
    let context_left = i64::from(room);
    let budget = match body.asked_max_tokens(kind) {
        _ if body.echo_alone(kind) => 1,
        Some(asked) => asked.min(context_left),
        None if kind == ApiKind::Chat => context_left,
        None => context_left.min(16),
    };
    generation.check_sampling(kind, budget, vocabulary)?;
    let report_reuse = body.reports_reuse()?;
    let streaming = body.stream() && !kv.do_remote_decode;
    let meta = ResponseMeta {
        id: match kind {
            ApiKind::Chat => format!("chatcmpl-{request_id}"),
            ApiKind::Completion => format!("cmpl-{request_id}"),
        },
        created: switchyard_process::clock::unix_seconds(),
        // An adapter's answer names the adapter, as vLLM's does.
        model: prompt.lora.as_ref().map_or_else(
            || config.served_model_name.clone(),
            |lora| lora.name.to_string(),
        ),
        kind,
        resume_at,
        prompt_token_ids: (body
            .return_token_ids
            .as_ref()
            .and_then(switchyard_tokenize::reuse::lax_bool)
            == Some(true))
        .then(|| std::sync::Arc::from(prompt.tokens.as_slice())),
        echo: echo(shared, &body, kind, &prompt.tokens),
        role: answer_role(&body),
        choices: generation.n(),
    };
    if pull == Pull::Rejected && config.kv_load_failure_policy == KvLoadFailurePolicy::Fail {
        return Ok(kv_load_failed(&meta, streaming));
    }
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
    // Current LMCache's PD backend on a prefill engine: every request names its receiver.
    let lmcache_pd = match &config.lmcache_pd_proxy {
        None => None,
        Some(proxy) => match crate::lmcache_pd::DisaggSpec::of(body.kv_transfer_params.as_ref()) {
            None => {
                return Err(ApiError::internal(
                    "LMCache PD sender: the request has no kv_transfer_params.disagg_spec (LMCache's \
                     async PD backend cannot save its KV cache without one)"
                        .to_owned(),
                ));
            }
            Some(Err(why)) => return Err(ApiError::bad_request(why)),
            Some(Ok(spec)) => {
                let full = prompt.block_hashes.len() * config.block_size;
                Some((
                    spec,
                    proxy.clone(),
                    prompt.block_hashes.clone(),
                    prompt.tokens[..full.min(prompt.tokens.len())].to_vec(),
                ))
            }
        },
    };
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
        report_reuse,
        lora: prompt.lora,
        skip_prefix_cache: generation.skips_prefix_cache(kind),
    };
    let events = shared
        .engine
        .submit(spec, arrival)
        .map_err(|stopped| ApiError::unavailable(stopped.to_string()))?;
    if kv.do_remote_decode {
        return prefill_only_response(shared, &meta, events, request_id, prompt_len).await;
    }
    if let Some((spec, proxy, hashes, tokens)) = lmcache_pd {
        let mut events = events;
        let finished = wait_finished(&mut events).await?;
        let first = crate::openai::output_token_id(meta.resume_at);
        let text = meta.text(finished.completion_tokens);
        let finish = if config.lmcache_first_token_stops {
            "stop"
        } else {
            "length"
        };
        // LMCache returns the first token only when asked (`ret_first_tok`).
        let asked = body
            .kv_transfer_params
            .as_ref()
            .is_some_and(|params| params.get("ret_first_tok").is_some());
        let answer = meta.response(
            text,
            finish,
            usage(prompt_len, &finished),
            asked.then(|| serde_json::json!({"first_tok": first})),
        );
        shared.records.update(request_id, |record| {
            record.kv_push = Some(format!(
                "LMCache PD: {} blocks to {}",
                hashes.len(),
                spec.receiver_host
            ));
        });
        let drop_notices = config.lmcache_drop_notices;
        tokio::spawn(crate::lmcache_pd::send(
            drop_notices,
            spec,
            proxy,
            hashes,
            tokens,
        ));
        return Ok(Json(answer).into_response());
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
            continuous_usage: body.continuous_usage(),
            interruption,
        };
        return Ok(stream.into_response(events));
    }
    whole_response(&meta, events, prompt_len).await
}

/// The role a chat is answered in: the assistant's, or the last message's when the request
/// asks for no generation prompt (vLLM 0.32 answers in it).
fn answer_role(body: &InferenceBody) -> String {
    let last = body
        .messages
        .as_deref()
        .and_then(<[Value]>::last)
        .and_then(|message| message.get("role"))
        .and_then(Value::as_str)
        .filter(|_| body.add_generation_prompt == Some(false));
    last.unwrap_or("assistant").to_owned()
}

/// What `echo` puts before the answer ([`Echo`]): a completion's prompt text (none with
/// `return_token_ids`, as vLLM 0.32 answers; a prompt of ids decoded as given, special tokens
/// kept), a chat's last message if its role is the answer's (the assistant's, or any with
/// `add_generation_prompt: false`, where vLLM answers in the last message's role), its text
/// parts joined by new lines.
fn echo(shared: &Shared, body: &InferenceBody, kind: ApiKind, tokens: &[u32]) -> Option<Echo> {
    if body
        .echo
        .as_ref()
        .and_then(switchyard_tokenize::reuse::lax_bool)
        != Some(true)
    {
        return None;
    }
    let text = match kind {
        ApiKind::Completion => {
            if body
                .return_token_ids
                .as_ref()
                .and_then(switchyard_tokenize::reuse::lax_bool)
                == Some(true)
            {
                String::new()
            } else {
                match &body.prompt {
                    Some(Value::String(text)) => text.clone(),
                    Some(Value::Array(items)) if items.iter().all(Value::is_string) => {
                        items.iter().filter_map(Value::as_str).collect::<String>()
                    }
                    prompt => {
                        // The ids as given (before any truncation), else those served.
                        let given: Option<Vec<u32>> =
                            prompt.as_ref().and_then(Value::as_array).and_then(|ids| {
                                ids.iter()
                                    .map(|id| id.as_u64().and_then(|id| u32::try_from(id).ok()))
                                    .collect()
                            });
                        let ids = given.as_deref().unwrap_or(tokens);
                        shared
                            .tokenizer
                            .as_deref()
                            .and_then(|tokenizer| tokenizer.decode(ids))
                            .unwrap_or_else(|| crate::openai::detokenize(ids))
                    }
                }
            }
        }
        ApiKind::Chat => {
            let last = body.messages.as_deref().and_then(<[Value]>::last)?;
            if last.get("role").and_then(Value::as_str) != Some(answer_role(body).as_str()) {
                return None;
            }
            match last.get("content") {
                Some(Value::String(text)) => text.clone(),
                Some(Value::Array(parts)) => parts
                    .iter()
                    .filter_map(|part| part.get("text").and_then(Value::as_str))
                    .collect::<Vec<_>>()
                    .join("\n"),
                _ => String::new(),
            }
        }
    };
    Some(Echo {
        text: text.into(),
        alone: body.echo_alone(kind),
        prompt_ids: (kind == ApiKind::Completion).then(|| std::sync::Arc::from(tokens)),
    })
}

/// A disaggregated decode whose KV cache could not be pulled, under vLLM's default
/// `kv_load_failure_policy` "fail": the request ends with vLLM's generation error (500
/// `InternalServerError`, "Internal server error"), before any token. A stream has already
/// begun: the error is an event after the role chunk (chat), then `[DONE]`.
fn kv_load_failed(meta: &ResponseMeta, streaming: bool) -> Response {
    let error = ApiError::internal("Internal server error".to_owned());
    if !streaming {
        return error.into_response();
    }
    let mut events = Vec::with_capacity(3);
    if meta.kind == ApiKind::Chat {
        events.extend(meta.for_each_choice(meta.role_chunk()).iter().map(sse_data));
    }
    events.push(sse_data(&error.to_json()));
    events.push(Bytes::from_static(b"data: [DONE]\n\n"));
    event_stream(futures::stream::iter(
        events.into_iter().map(Ok::<_, std::io::Error>),
    ))
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

async fn whole_response(
    meta: &ResponseMeta,
    mut events: UnboundedReceiver<EngineEvent>,
    prompt_len: u32,
) -> Result<Response, ApiError> {
    let finished = wait_finished(&mut events).await?;
    Ok(finished_response(meta, &finished, prompt_len))
}

fn finished_response(meta: &ResponseMeta, finished: &FinishedSeq, prompt_len: u32) -> Response {
    let text = meta.text(finished.completion_tokens);
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
    // The engine's own id of the request (what a decoder names in its pull), as vLLM makes it.
    let internal_id = internal_request_id(&meta.id);
    let block_ids = shared.handoffs.record(
        &internal_id,
        request_id,
        prompt_len,
        shared.config.block_size,
    );
    Metrics::increment(&shared.metrics.kv_handoffs);
    let params = prefill_response_params(
        &shared.engine_id,
        &internal_id,
        &block_ids,
        prompt_len,
        shared.side_channel.get(),
    );
    let text = meta.text(finished.completion_tokens);
    let body = meta.response(text, "length", usage(prompt_len, &finished), Some(params));
    Ok(Json(body).into_response())
}

async fn ok() -> StatusCode {
    StatusCode::OK
}

/// `GET /v1/models`: the served model, then each LoRA adapter as vLLM lists them (the path
/// as `root`, the base model as `parent`).
async fn models(State(shared): State<Arc<Shared>>) -> Json<Value> {
    let name = &shared.config.served_model_name;
    let created = switchyard_process::clock::unix_seconds();
    let mut data = vec![json!({
        "id": name,
        "object": "model",
        "created": created,
        "owned_by": "vllm",
        "root": name,
        "parent": null,
        "max_model_len": shared.config.max_model_len,
        "permission": [],
    })];
    for module in &shared.config.lora_modules {
        let (adapter, path) = module.split_once('=').unwrap_or((module, module));
        data.push(json!({
            "id": adapter,
            "object": "model",
            "created": created,
            "owned_by": "vllm",
            "root": path,
            "parent": name,
            "max_model_len": null,
            "permission": [],
        }));
    }
    Json(json!({"object": "list", "data": data}))
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
    // vLLM's `/tokenize` takes a chat's body (with `messages`) or a completion's.
    let kind = if has_messages(&body) {
        ApiKind::Chat
    } else {
        ApiKind::Completion
    };
    let parsed = parse_off_thread(
        &shared,
        without_served_fields(body),
        Reading::Tokenize(kind),
    )
    .await?;
    check_model(&shared.config, parsed.body.model.as_deref())?;
    let prompt = parsed.prompt?;
    Ok(Json(json!({
        "count": prompt.tokens.len(),
        "max_model_len": shared.config.max_model_len,
        "tokens": prompt.tokens,
        "token_strs": null,
    })))
}

/// Whether a body is a JSON object whose `messages` is a list (a chat's tokenize request;
/// anything else is read as a completion's, which ignores `messages`).
fn has_messages(body: &[u8]) -> bool {
    #[derive(serde::Deserialize)]
    struct Probe {
        #[serde(default)]
        messages: Option<Value>,
    }
    serde_json::from_slice::<Probe>(body)
        .is_ok_and(|probe| probe.messages.is_some_and(|m| m.is_array()))
}

/// A `/tokenize` body without the chat completion's own `documents` and `reasoning_effort`,
/// which vLLM's `/tokenize` passes over and the model's tokenizer would render (as vLLM's chat
/// completion does).
fn without_served_fields(body: Bytes) -> Bytes {
    let mentions = |name: &[u8]| body.windows(name.len()).any(|window| window == name);
    if !mentions(b"\"documents\"") && !mentions(b"\"reasoning_effort\"") {
        return body;
    }
    // The other values stay as written (nested keys in their order).
    type Fields<'a> = std::collections::BTreeMap<String, &'a serde_json::value::RawValue>;
    match serde_json::from_slice::<Fields<'_>>(&body) {
        Ok(mut fields)
            if fields.contains_key("documents") || fields.contains_key("reasoning_effort") =>
        {
            fields.remove("documents");
            fields.remove("reasoning_effort");
            serde_json::to_vec(&fields).map_or(body, Bytes::from)
        }
        _ => body,
    }
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

/// A decoder's pull of what this (prefill) engine handed off under its internal request id
/// (the side channel's one route): 404 if nothing was issued under that id or it was pulled
/// already (vLLM frees the blocks once they are read).
async fn pull_handoff(
    State(shared): State<Arc<Shared>>,
    axum::extract::Path(request_id): axum::extract::Path<String>,
) -> Result<Json<IssuedHandoff>, ApiError> {
    let handoff = shared.handoffs.pull(&request_id).map_err(|why| {
        ApiError::not_found(match why {
            PullError::Unknown => format!(
                "no hand-off to pull for request {request_id} (never issued, or pulled already)"
            ),
            PullError::Lapsed => format!(
                "the hand-off of request {request_id} lapsed: not pulled within --kv-lease-s"
            ),
        })
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tokenize_body_loses_only_the_chat_completions_own_fields() {
        let plain = Bytes::from_static(br#"{"messages":[{"role":"user","content":"documents"}]}"#);
        assert_eq!(without_served_fields(plain.clone()), plain);
        let served = Bytes::from_static(
            br#"{"messages":[],"documents":[{"text":"x"}],"reasoning_effort":"low","chat_template_kwargs":{"documents":[]}}"#,
        );
        let kept: Value = serde_json::from_slice(&without_served_fields(served)).unwrap();
        assert_eq!(
            kept,
            json!({"messages": [], "chat_template_kwargs": {"documents": []}})
        );
        let broken = Bytes::from_static(br#"{"documents": "#);
        assert_eq!(without_served_fields(broken.clone()), broken);
    }
}
