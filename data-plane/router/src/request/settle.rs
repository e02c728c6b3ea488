//! The settle phase: a plan that needs the prompt's token ids ([`Planned::NeedsTokens`]) gets
//! them, one `/tokenize` round trip at most (`tokenize`), and is finished by the plan's own
//! rules (`plan::NeedsTokens::finish`: a KV index's ranking, the UNCACHED_TOKENS decision).
//! Nothing is asked before an engine of a pool the plan reads has published; without token ids
//! the plan is finished without them (ranked by load; UNCACHED_TOKENS counts every prompt token
//! as uncached). Finishing a long prompt, or an UNCACHED_TOKENS decision (which may make the
//! prefill copy), runs on a blocking thread.

use std::sync::Arc;
use std::time::Instant;

use super::local_tokens::{CheckTicket, Local};
use super::worker::Worker;
use crate::errors::ApiError;
use crate::plan::tokens::{KvInput, Prompt, PromptTokens};
use crate::plan::{KvOrNot, NeedsTokens, Plan, Planned, kv};
use crate::routing::table::EndpointRoute;
use switchyard_kv::ChainKey;
use switchyard_tokenize::Within;
use switchyard_tokenize::truncation::Cut;

/// The plan to forward.
pub(super) async fn settle(worker: &Worker, planned: Planned) -> Result<Plan, ApiError> {
    let (needs, input) = match planned {
        Planned::Ready(plan) => return Ok(plan),
        Planned::NeedsTokens { needs, input } => (needs, input),
    };
    let endpoint = Arc::clone(&needs.plan.endpoint);
    let indexes = needs.indexes(|position| {
        worker
            .kv_index
            .variant(&endpoint.name, &endpoint.variants[position].name)
            .filter(|index| index.block_size().is_some())
    });
    let tokens = if NeedsTokens::worth_asking(&indexes) {
        let kept = match &input {
            KvInput::Tokens(PromptTokens::Ask(prompt)) => prompt.kept(),
            _ => None,
        };
        let local = needs.local_tokenizer();
        let ids = token_ids(worker, needs.tokenizer(), local, input).await;
        match (ids, kept) {
            // The engine keeps part of the prompt: its tokenizer's side, and whether it
            // added special tokens, come from the router's copy of it when there is one.
            (Some(ids), Some(kept)) => {
                let cut = local.and_then(|name| {
                    worker
                        .local_tokens
                        .truncation_cut(name, kept.specials_added())
                });
                match cut {
                    Some(cut) => Some(kept.apply(ids, cut)),
                    None if !kept.needs_tokenizer() => Some(kept.apply(ids, Cut::LEFT)),
                    // Which of the engine's ids its tokenizer added (a BOS the cut keeps) is
                    // not known here: routed by load rather than on shifted blocks.
                    None => {
                        tracing::debug!(endpoint = %endpoint.name, "a truncated prompt whose added special tokens the router cannot place; routing it by load");
                        None
                    }
                }
            }
            (ids, _) => ids,
        }
    } else {
        None
    };
    let random = fastrand::u64(..);
    let now_ms = switchyard_process::clock::unix_ms;
    if !needs.heavy(tokens.as_deref()) {
        return Ok(needs.finish(tokens.as_deref(), &indexes, now_ms(), random));
    }
    match needs.into_kv(&indexes) {
        // KV_AWARE: only the walk over the index leaves this thread; if that task fails, the
        // plan here is ranked by load.
        KvOrNot::Kv(plan, index, chain) => {
            let (endpoint, position) = (Arc::clone(&plan.endpoint), plan.variant_index);
            let decided = tokio::task::spawn_blocking(move || {
                let variant = &endpoint.variants[position];
                let tokens = tokens.as_deref();
                kv::decide(variant, Some(&index), tokens, chain.key(), now_ms(), random)
            })
            .await;
            let decision = decided.unwrap_or_else(|_| {
                kv::decide(
                    plan.variant(),
                    None,
                    None,
                    ChainKey::default(),
                    now_ms(),
                    random,
                )
            });
            Ok(kv::apply(plan, decision))
        }
        // A disaggregated endpoint's decision (it may make the prefill copy).
        KvOrNot::Not(needs) => tokio::task::spawn_blocking(move || {
            needs.finish(tokens.as_deref(), &indexes, now_ms(), random)
        })
        .await
        .map_err(|err| ApiError::unavailable(format!("routing task failed: {err}"))),
    }
}

/// The request's token ids for the engines of the plan's variant (`endpoint`'s at
/// `position`): as given; computed here by the tokenizer folder `local` names
/// (`super::local_tokens`; a sampled share also asked of an engine apart from the request,
/// [`check_later`]); or one `/tokenize` round trip to the variant's least loaded instance not
/// paused for failing to tokenize within `--kv-tokenize-timeout-ms` (timed in
/// `switchyard_router_kv_tokenize_seconds`). A failure is counted in
/// `switchyard_router_kv_tokenize_failures_total` and logged; the caller routes by load.
async fn token_ids(
    worker: &Worker,
    (endpoint, position): (&Arc<EndpointRoute>, usize),
    local: Option<&Arc<str>>,
    input: KvInput,
) -> Option<Vec<u32>> {
    let variant = &endpoint.variants[position];
    let read = match (local, &input) {
        (Some(_), KvInput::Tokens(PromptTokens::Ask(prompt))) => match prompt.direct_body() {
            Some(body) => Some(body),
            None => super::tokenize::tokenize_body(prompt).await.ok(),
        },
        _ => None,
    };
    if let (Some(name), Some(body), KvInput::Tokens(PromptTokens::Ask(prompt))) =
        (local, read, &input)
    {
        match local_ids(worker, name, &body).await {
            Local::Ids { ids, check: None } => return Some(ids),
            Local::Ids {
                ids,
                check: Some(ticket),
            } => {
                let check = Check {
                    endpoint: Arc::clone(endpoint),
                    position,
                    tokenizer: Arc::clone(name),
                    prompt: prompt.clone(),
                    ids: ids.clone(),
                    ticket,
                };
                check_later(worker, check);
                return Some(ids);
            }
            Local::Refused(reason) => {
                tracing::debug!(variant = %variant.name, tokenizer = %name, reason = %reason, "the request's chat template or fields are refused as vLLM refuses them; routing it by load");
                return None;
            }
            Local::Engine | Local::Costly => {}
        }
    }
    let fetched = match input {
        KvInput::Unusable(err) => Err(err),
        KvInput::Tokens(tokens) => {
            let asked = Instant::now();
            let round_trip = matches!(tokens, PromptTokens::Ask(_));
            let fetched = worker
                .tokenize
                .token_ids(tokens, variant, switchyard_process::clock::unix_ms())
                .await;
            if round_trip && fetched.is_ok() {
                worker
                    .metrics
                    .kv_tokenize_seconds
                    .observe(asked.elapsed().as_secs_f64());
            }
            fetched
        }
    };
    fetched
        .inspect_err(|err| {
            worker.metrics.kv_tokenize_failed(err);
            tracing::debug!(variant = %variant.name, error = %err, "no token ids for the request; routing it by load");
        })
        .ok()
}

/// A request's ids computed here, to compare with an engine's `/tokenize` of its body.
struct Check {
    endpoint: Arc<EndpointRoute>,
    position: usize,
    tokenizer: Arc<str>,
    prompt: Prompt,
    ids: Vec<u32>,
    ticket: CheckTicket,
}

/// Asks an engine of the check's variant for the body's ids on a task of its own and reports
/// the comparison ([`super::local_tokens::LocalTokenizers::checked`]), so the request it was
/// sampled from is routed on the router's ids without waiting for the engine. A failed ask is
/// counted among the checks (`failed`), not as a request routed by load; it still counts
/// towards pausing the instance's `/tokenize`.
fn check_later(worker: &Worker, check: Check) {
    let (client, tokenizers) = (worker.tokenize.clone(), Arc::clone(&worker.local_tokens));
    tokio::spawn(async move {
        let variant = &check.endpoint.variants[check.position];
        let fetched = client
            .token_ids(
                PromptTokens::Ask(check.prompt),
                variant,
                switchyard_process::clock::unix_ms(),
            )
            .await;
        tokenizers.checked(&check.tokenizer, fetched.as_deref().ok(), &check.ids);
        drop(check.ticket);
    });
}

/// The tokenizing a serving thread does at most (STYLE habit 9: under half a millisecond):
/// 4 KiB of new text (not in the tokenizer's piece cache), of which at most 128 words of 8
/// bytes (1 KiB) not in its word cache (about a microsecond or more of BPE each; a known word
/// costs a lookup, so 4 KiB of them about 0.1 ms). A prompt seen before (a shared system prompt, earlier turns,
/// a new turn in common words) is tokenized here without a thread hop, which on a busy
/// machine costs more than the work; a colder one goes to a blocking thread (what was done
/// before giving up stays in the caches). Without the word cache (a tokenizer not of Llama
/// 3's shape), 8 bytes of new text count as one new word: 1 KiB.
const INLINE: Within = Within {
    fresh_bytes: 4096,
    new_words: 128,
};
/// Bodies above this always go to a blocking thread (parsing and rendering them alone would
/// take too long here).
const INLINE_BODY_BYTES: usize = 256 * 1024;

/// `body` tokenized by the router's tokenizer `name`.
async fn local_ids(worker: &Worker, name: &Arc<str>, body: &bytes::Bytes) -> Local {
    if body.len() <= INLINE_BODY_BYTES {
        match worker.local_tokens.tokenize_within(name, body, INLINE) {
            Local::Costly => {}
            done => return done,
        }
    }
    let (tokenizers, name, body) = (
        Arc::clone(&worker.local_tokens),
        Arc::clone(name),
        body.clone(),
    );
    // Within the `/tokenize` deadline, as the engine would be (the renderer's fuel bounds the
    // work itself); past it the engine is asked.
    let task = tokio::task::spawn_blocking(move || tokenizers.tokenize(&name, &body));
    match tokio::time::timeout(worker.tokenize.timeout(), task).await {
        Ok(Ok(outcome)) => outcome,
        Ok(Err(_)) | Err(_) => Local::Engine,
    }
}
