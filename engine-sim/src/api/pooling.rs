//! vLLM's pooling APIs and `/detokenize`, in vLLM's shapes: `POST /v1/embeddings`,
//! `/pooling`, `/classify`, `/score` and `/v1/score`, `/rerank`, `/v1/rerank` and
//! `/v2/rerank`.
//!
//! A pooling model runs a prefill only; the simulator runs each input (each pair for score
//! and rerank) on the engine as a request of one output token, so pooling requests take
//! their share of the engine and warm and hit its prefix cache like any other. The numbers
//! they answer are made up but deterministic (the same text gives the same vector and
//! scores): an embedding is a unit vector of [`EMBEDDING_DIMENSIONS`] floats derived from the
//! input's token ids (`dimensions` keeps its first ones, renormalised: a Matryoshka model),
//! sent as floats or, with `encoding_format: "base64"` (the `openai` SDK's default), as
//! base64 of little-endian `f32`s.
//!
//! `/detokenize` gives back the simulator's output words; its other token ids are hashes of
//! text it cannot recover, rendered `<|ID|>`.

use std::sync::Arc;
use std::time::Instant;

use axum::Json;
use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::routing::{MethodRouter, post};
use base64::Engine as _;
use http::{HeaderMap, Uri};
use serde::Deserialize;
use serde_json::{Value, json};
use xxhash_rust::xxh3::xxh3_64_with_seed;

use super::common::{
    Shared, check_fits, check_model, draw_fault, random_id, request_id, wait_finished,
    with_request_id,
};
use crate::cache::block_hashes;
use crate::engine::SeqSpec;
use crate::metrics::Metrics;
use crate::openai::{ApiError, parse_json};
use crate::records::ReceivedRequest;
use crate::tokenizer::{chat_prompt_text, tokenize};

/// Length of the simulator's embeddings.
pub const EMBEDDING_DIMENSIONS: usize = 64;

pub(super) fn routes() -> Router<Arc<Shared>> {
    Router::new()
        .route("/v1/embeddings", api(embeddings))
        .route("/pooling", api(pooling))
        .route("/classify", api(classify))
        .route("/score", api(score))
        .route("/v1/score", api(score))
        .route("/rerank", api(rerank))
        .route("/v1/rerank", api(rerank))
        .route("/v2/rerank", api(rerank))
        .route("/detokenize", api(detokenize))
}

/// What one pooling API answers: its JSON, or a response to send instead (an error, a fault).
type Answer = Result<Value, Response>;

/// The `POST` route of one pooling API: [`serve`] with `respond`.
fn api<F, Fut>(respond: F) -> MethodRouter<Arc<Shared>>
where
    F: FnOnce(Arc<Shared>, PoolingBody, String) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = Answer> + Send + 'static,
{
    post(
        move |State(shared): State<Arc<Shared>>, uri: Uri, headers: HeaderMap, body: Bytes| async move {
            serve(shared, uri.path(), headers, body, respond).await
        },
    )
}

/// The request fields the pooling APIs read (each API uses its own).
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct PoolingBody {
    model: Option<String>,
    input: Option<Value>,
    messages: Option<Vec<Value>>,
    encoding_format: Option<String>,
    dimensions: Option<i64>,
    query: Option<Value>,
    documents: Option<Value>,
    top_n: Option<i64>,
    queries: Option<Value>,
    items: Option<Value>,
    text_1: Option<Value>,
    text_2: Option<Value>,
    data_1: Option<Value>,
    data_2: Option<Value>,
    tokens: Option<Vec<Value>>,
}

/// Records the request, parses it, checks the model, answers with `respond`'s result.
async fn serve<F, Fut>(
    shared: Arc<Shared>,
    path: &str,
    headers: HeaderMap,
    body: Bytes,
    respond: F,
) -> Response
where
    F: FnOnce(Arc<Shared>, PoolingBody, String) -> Fut,
    Fut: Future<Output = Answer>,
{
    Metrics::increment(&shared.metrics.requests_received);
    let request_id = request_id(&headers);
    let parsed = parse_json::<PoolingBody>(&body, "invalid JSON body");
    shared.records.record(ReceivedRequest {
        path: path.to_owned(),
        headers: ReceivedRequest::select_headers(&headers),
        body_bytes: body.len(),
        model: parsed.as_ref().ok().and_then(|body| body.model.clone()),
        ..ReceivedRequest::default()
    });
    let checked = parsed.and_then(|body| {
        check_model(&shared.config, body.model.as_deref())?;
        Ok(body)
    });
    let response = match checked {
        Err(error) => error.into_response(),
        Ok(body) => match respond(Arc::clone(&shared), body, request_id.clone()).await {
            Ok(answer) => Json(answer).into_response(),
            Err(response) => response,
        },
    };
    with_request_id(response, &request_id)
}

/// The token ids of one text-like value: a string, token ids, or an object with `text` or
/// `content` (multimodal score inputs: their text parts).
fn value_tokens(value: &Value, field: &'static str) -> Result<Vec<u32>, ApiError> {
    match value {
        Value::String(text) => Ok(tokenize(text)),
        Value::Array(ids) if ids.iter().all(Value::is_number) => ids
            .iter()
            .map(|id| {
                id.as_u64()
                    .and_then(|id| u32::try_from(id).ok())
                    .ok_or_else(|| {
                        ApiError::bad_request(format!(
                            "{field} token ids must be non-negative integers"
                        ))
                        .param(field)
                    })
            })
            .collect(),
        Value::Object(object) => {
            if let Some(Value::String(text)) = object.get("text") {
                return Ok(tokenize(text));
            }
            let text: String = object
                .get("content")
                .and_then(Value::as_array)
                .map(|parts| {
                    parts
                        .iter()
                        .filter_map(|part| part.get("text").and_then(Value::as_str))
                        .collect()
                })
                .unwrap_or_default();
            Ok(tokenize(&text))
        }
        _ => Err(ApiError::bad_request(format!(
            "{field} must be a string, token ids, or an array of them"
        ))
        .param(field)),
    }
}

/// A value that is one input or a list of them, as a list.
fn value_list(value: &Value, field: &'static str) -> Result<Vec<Vec<u32>>, ApiError> {
    let list = match value {
        Value::Array(items) if !items.is_empty() && !items.iter().all(Value::is_number) => items
            .iter()
            .map(|item| value_tokens(item, field))
            .collect::<Result<Vec<_>, _>>()?,
        single => vec![value_tokens(single, field)?],
    };
    if list.is_empty() || list.iter().any(Vec::is_empty) {
        return Err(ApiError::bad_request(format!("{field} must not be empty")).param(field));
    }
    Ok(list)
}

/// `input` (or chat-style `messages`) as one token list per input.
fn inputs(body: &PoolingBody) -> Result<Vec<Vec<u32>>, ApiError> {
    match (&body.input, &body.messages) {
        (Some(input), _) => value_list(input, "input"),
        (None, Some(messages)) => Ok(vec![tokenize(&chat_prompt_text(messages))]),
        (None, None) => {
            Err(ApiError::bad_request("input: field required".to_owned()).param("input"))
        }
    }
}

/// Runs each token list on the engine as a one-token request (a pooling model's prefill),
/// with fault injection as for a non-streaming request. The prompt tokens in all.
async fn run_prefills(
    shared: &Shared,
    request_id: &str,
    prompts: &[Vec<u32>],
) -> Result<u32, Response> {
    let arrival = Instant::now();
    let config = &shared.config;
    for prompt in prompts {
        let prompt_len = u32::try_from(prompt.len()).unwrap_or(u32::MAX);
        check_fits(config, prompt_len, 0, "max_tokens")?;
    }
    // Non-streaming: a fault answers now or never (no interruption to come).
    draw_fault(shared, request_id, false, 1).await?;
    let mut running = Vec::with_capacity(prompts.len());
    for prompt in prompts {
        let spec = SeqSpec {
            prompt_len: u32::try_from(prompt.len()).unwrap_or(u32::MAX),
            block_hashes: block_hashes(prompt, config.block_size),
            prompt_tokens: if config.kv_events.is_some() {
                prompt.clone()
            } else {
                Vec::new()
            },
            max_tokens: 1,
            remote_prompt_tokens: 0,
            report_reuse: false,
            // Pooling runs the base model (vLLM serves adapters for generation).
            lora: None,
            skip_prefix_cache: false,
        };
        let events = shared
            .engine
            .submit(spec, arrival)
            .map_err(|stopped| ApiError::unavailable(stopped.to_string()))?;
        running.push(events);
    }
    let mut prompt_tokens = 0u32;
    for mut events in running {
        let finished = wait_finished(&mut events).await?;
        prompt_tokens = prompt_tokens.saturating_add(finished.prompt_tokens);
    }
    Ok(prompt_tokens)
}

/// A deterministic number in [0, 1) from token ids and a seed.
fn unit(tokens: &[u32], seed: u64) -> f64 {
    let bytes: Vec<u8> = tokens.iter().flat_map(|id| id.to_le_bytes()).collect();
    (xxh3_64_with_seed(&bytes, seed) >> 11) as f64 / (1u64 << 53) as f64
}

/// The unit vector of `dimensions` floats for `tokens`.
fn embedding(tokens: &[u32], dimensions: usize) -> Vec<f32> {
    let raw: Vec<f64> = (0..dimensions)
        .map(|index| unit(tokens, index as u64) * 2.0 - 1.0)
        .collect();
    let norm = raw
        .iter()
        .map(|x| x * x)
        .sum::<f64>()
        .sqrt()
        .max(f64::MIN_POSITIVE);
    raw.into_iter().map(|x| (x / norm) as f32).collect()
}

fn dimensions(body: &PoolingBody) -> Result<usize, ApiError> {
    match body.dimensions {
        None => Ok(EMBEDDING_DIMENSIONS),
        Some(wanted) if (1..=EMBEDDING_DIMENSIONS as i64).contains(&wanted) => Ok(wanted as usize),
        Some(wanted) => Err(ApiError::bad_request(format!(
            "dimensions must be between 1 and {EMBEDDING_DIMENSIONS}, got {wanted}"
        ))
        .param("dimensions")),
    }
}

/// A vector as `encoding_format` asks: floats, or base64 of little-endian f32s.
fn encode(vector: &[f32], format: Option<&str>) -> Result<Value, ApiError> {
    match format.unwrap_or("float") {
        "float" => Ok(json!(vector)),
        "base64" => {
            let bytes: Vec<u8> = vector.iter().flat_map(|x| x.to_le_bytes()).collect();
            Ok(json!(
                base64::engine::general_purpose::STANDARD.encode(bytes)
            ))
        }
        other => Err(ApiError::bad_request(format!(
            "encoding_format must be float or base64, got {other}"
        ))
        .param("encoding_format")),
    }
}

fn usage(prompt_tokens: u32) -> Value {
    json!({
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens,
        "completion_tokens": 0,
        "prompt_tokens_details": null,
    })
}

/// Runs the prompts on the engine (see [`run_prefills`]), then answers `data` in the list
/// envelope of embeddings, pooling, classification and score answers.
async fn run_and_list(
    shared: &Shared,
    request_id: &str,
    prompts: &[Vec<u32>],
    prefix: &str,
    data: Vec<Value>,
) -> Answer {
    let prompt_tokens = run_prefills(shared, request_id, prompts).await?;
    Ok(json!({
        "id": random_id(prefix),
        "object": "list",
        "created": switchyard_process::clock::unix_seconds(),
        "model": shared.config.served_model_name,
        "data": data,
        "usage": usage(prompt_tokens),
    }))
}

/// Each prompt's vector as `encoding_format` asks, as `{"index", "object", key: vector}`.
fn vectors(
    prompts: &[Vec<u32>],
    dimensions: usize,
    format: Option<&str>,
    object: &str,
    key: &str,
) -> Result<Vec<Value>, ApiError> {
    prompts
        .iter()
        .enumerate()
        .map(|(index, prompt)| {
            let mut item = json!({"index": index, "object": object});
            item[key] = encode(&embedding(prompt, dimensions), format)?;
            Ok(item)
        })
        .collect()
}

async fn embeddings(shared: Arc<Shared>, body: PoolingBody, request_id: String) -> Answer {
    let prompts = inputs(&body)?;
    let dimensions = dimensions(&body)?;
    let format = body.encoding_format.as_deref();
    let data = vectors(&prompts, dimensions, format, "embedding", "embedding")?;
    run_and_list(&shared, &request_id, &prompts, "embd-", data).await
}

async fn pooling(shared: Arc<Shared>, body: PoolingBody, request_id: String) -> Answer {
    let prompts = inputs(&body)?;
    let format = body.encoding_format.as_deref();
    let data = vectors(&prompts, EMBEDDING_DIMENSIONS, format, "pooling", "data")?;
    run_and_list(&shared, &request_id, &prompts, "pool-", data).await
}

async fn classify(shared: Arc<Shared>, body: PoolingBody, request_id: String) -> Answer {
    let prompts = inputs(&body)?;
    let data = prompts
        .iter()
        .enumerate()
        .map(|(index, prompt)| {
            let positive = unit(prompt, 0);
            let label = if positive >= 0.5 {
                "LABEL_1"
            } else {
                "LABEL_0"
            };
            json!({
                "index": index,
                "label": label,
                "probs": [1.0 - positive, positive],
                "num_classes": 2,
            })
        })
        .collect();
    run_and_list(&shared, &request_id, &prompts, "classify-", data).await
}

/// One query against N documents, or N against N: the concatenated pairs.
fn pairs(
    first: &[Vec<u32>],
    second: &[Vec<u32>],
    field: &'static str,
) -> Result<Vec<Vec<u32>>, ApiError> {
    let joined = |a: &Vec<u32>, b: &Vec<u32>| a.iter().chain(b).copied().collect::<Vec<u32>>();
    match first {
        [single] => Ok(second.iter().map(|other| joined(single, other)).collect()),
        _ if first.len() == second.len() => Ok(first
            .iter()
            .zip(second)
            .map(|(a, b)| joined(a, b))
            .collect()),
        _ => Err(ApiError::bad_request(format!(
            "the two sides must be as long, or the first one input (got {} and {})",
            first.len(),
            second.len()
        ))
        .param(field)),
    }
}

async fn score(shared: Arc<Shared>, body: PoolingBody, request_id: String) -> Answer {
    let first = body
        .queries
        .as_ref()
        .or(body.text_1.as_ref())
        .or(body.data_1.as_ref());
    let second = body
        .documents
        .as_ref()
        .or(body.items.as_ref())
        .or(body.text_2.as_ref())
        .or(body.data_2.as_ref());
    let (Some(first), Some(second)) = (first, second) else {
        return Err(ApiError::bad_request(
            "score takes queries and documents (or text_1 and text_2)".to_owned(),
        )
        .param("queries")
        .into());
    };
    let first = value_list(first, "queries")?;
    let second = value_list(second, "documents")?;
    let prompts = pairs(&first, &second, "documents")?;
    let data = prompts
        .iter()
        .enumerate()
        .map(|(index, pair)| json!({"index": index, "object": "score", "score": unit(pair, 1)}))
        .collect();
    run_and_list(&shared, &request_id, &prompts, "score-", data).await
}

async fn rerank(shared: Arc<Shared>, body: PoolingBody, request_id: String) -> Answer {
    let (Some(query), Some(documents)) = (&body.query, &body.documents) else {
        return Err(
            ApiError::bad_request("rerank takes a query and documents".to_owned())
                .param("query")
                .into(),
        );
    };
    let query = value_tokens(query, "query")?;
    let texts: Vec<Value> = match documents {
        Value::Array(items) => items.clone(),
        single => vec![single.clone()],
    };
    let documents = value_list(documents, "documents")?;
    let prompts = pairs(&[query], &documents, "documents")?;
    let mut results: Vec<(usize, f64)> = prompts
        .iter()
        .enumerate()
        .map(|(index, pair)| (index, unit(pair, 1)))
        .collect();
    results.sort_by(|a, b| b.1.total_cmp(&a.1));
    if let Some(top) = body.top_n.filter(|top| *top > 0) {
        results.truncate(usize::try_from(top).unwrap_or(usize::MAX));
    }
    let results: Vec<Value> = results
        .into_iter()
        .map(|(index, relevance)| {
            let text = match &texts[index] {
                Value::String(text) => Value::String(text.clone()),
                other => other.get("text").cloned().unwrap_or(Value::Null),
            };
            json!({
                "index": index,
                "document": {"text": text, "multi_modal": null},
                "relevance_score": relevance,
            })
        })
        .collect();
    let prompt_tokens = run_prefills(&shared, &request_id, &prompts).await?;
    Ok(json!({
        "id": random_id("rerank-"),
        "model": shared.config.served_model_name,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
        "results": results,
    }))
}

async fn detokenize(shared: Arc<Shared>, body: PoolingBody, _request_id: String) -> Answer {
    let tokens = body.tokens.ok_or_else(|| {
        ApiError::bad_request("tokens: Field required".to_owned()).param("body.tokens")
    })?;
    let mut ids = Vec::with_capacity(tokens.len());
    for (index, token) in tokens.iter().enumerate() {
        let id = token.as_u64().and_then(|id| u32::try_from(id).ok());
        ids.push(id.ok_or_else(|| {
            ApiError::bad_request(format!(
                "tokens.{index}: Input should be a non-negative integer"
            ))
            .param(if index == 0 {
                "body.tokens.0"
            } else {
                "body.tokens"
            })
        })?);
    }
    // The model's tokenizer (`--tokenizer`) decodes as vLLM does: special tokens kept, ids
    // outside the vocabulary left out; else the simulator's own words.
    let prompt = shared
        .tokenizer
        .as_deref()
        .and_then(|tokenizer| tokenizer.decode(&ids))
        .unwrap_or_else(|| crate::openai::detokenize(&ids));
    Ok(json!({"prompt": prompt}))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn embeddings_are_deterministic_unit_vectors() {
        let tokens = tokenize("the same text");
        let one = embedding(&tokens, EMBEDDING_DIMENSIONS);
        assert_eq!(one, embedding(&tokens, EMBEDDING_DIMENSIONS));
        let norm: f32 = one.iter().map(|x| x * x).sum();
        assert!((norm - 1.0).abs() < 1e-4, "{norm}");
        assert_ne!(
            one,
            embedding(&tokenize("other text"), EMBEDDING_DIMENSIONS)
        );
        assert_eq!(embedding(&tokens, 8).len(), 8);
        let encoded = encode(&[1.0, -2.5], Some("base64")).unwrap();
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(encoded.as_str().unwrap())
            .unwrap();
        assert_eq!(bytes.len(), 8);
        assert_eq!(f32::from_le_bytes(bytes[4..].try_into().unwrap()), -2.5);
    }

    #[test]
    fn inputs_are_strings_token_ids_or_lists_of_them() {
        let parse = |input: Value| {
            inputs(&PoolingBody {
                input: Some(input),
                ..PoolingBody::default()
            })
        };
        assert_eq!(parse(json!("a b")).unwrap().len(), 1);
        assert_eq!(parse(json!(["a", "b c"])).unwrap().len(), 2);
        assert_eq!(parse(json!([1, 2, 3])).unwrap(), vec![vec![1, 2, 3]]);
        assert_eq!(parse(json!([[1], [2, 3]])).unwrap().len(), 2);
        assert_eq!(parse(json!([])).unwrap_err().param, Some("input"));
        assert_eq!(parse(json!([-1])).unwrap_err().param, Some("input"));
        assert!(pairs(&[vec![1], vec![2]], &[vec![3]], "documents").is_err());
        assert_eq!(
            pairs(&[vec![1]], &[vec![2], vec![3]], "documents")
                .unwrap()
                .len(),
            2
        );
    }
}
