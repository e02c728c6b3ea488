//! One request from arrival to answer: admission, the body, the plan (for KV_AWARE, the
//! prompt's token ids and the ranking by the KV index), forwarding. Every refusal is answered
//! in the shape of the API the request came in on.

use std::sync::Arc;
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use axum::extract::Request;
use axum::response::Response;

use crate::admission::Admission;
use crate::body::{OFFLOAD_BYTES, read_body};
use crate::errors::{ApiError, ErrorKind};
use crate::forward::{ForwardSettings, Forwarder, UpstreamClients};
use crate::kv::tokenize::{PromptTokens, Tokenizer};
use crate::kv::{self, KvIndex};
use crate::metrics::RouterMetrics;
use crate::plan::{KvInput, Operation, Plan, make_plan};
use crate::table::{LoadRegistry, RouteLabel, RoutingTable};
use crate::tokenizer::Tokenizers;
use switchyard_policy::rank::Route;

/// What one serving thread works with: the routing state, limits and metrics every thread
/// shares, and this thread's own upstream connection pools (so that a request and the
/// upstream connection it uses are driven by the same thread).
#[derive(Debug)]
pub struct Worker {
    pub table: Arc<ArcSwap<RoutingTable>>,
    pub registry: Arc<LoadRegistry>,
    pub clients: UpstreamClients,
    pub forwarding: ForwardSettings,
    pub client_body_deadline: Duration,
    pub metrics: Arc<RouterMetrics>,
    pub admission: Arc<Admission>,
    /// Prompt tokenizers for disaggregated endpoints.
    pub tokenizers: Arc<Tokenizers>,
    /// KV_AWARE: what the engines' KV events say each instance holds.
    pub kv_index: Arc<KvIndex>,
    /// KV_AWARE: this thread's `/tokenize` client.
    pub tokenizer: Tokenizer,
}

impl Worker {
    /// The same shared state with other connection pools (another serving thread's, its
    /// `/tokenize` client included).
    pub fn with_clients(&self, clients: UpstreamClients) -> Self {
        Self {
            table: Arc::clone(&self.table),
            registry: Arc::clone(&self.registry),
            clients,
            forwarding: self.forwarding,
            client_body_deadline: self.client_body_deadline,
            metrics: Arc::clone(&self.metrics),
            admission: Arc::clone(&self.admission),
            tokenizers: Arc::clone(&self.tokenizers),
            kv_index: Arc::clone(&self.kv_index),
            tokenizer: Tokenizer::new(self.tokenizer.timeout()),
        }
    }
}

/// Counts `client_gone` if the request is dropped before it was answered (hyper drops the
/// handler when the client's connection closes).
struct Unanswered<'a>(Option<&'a RouterMetrics>);

impl Drop for Unanswered<'_> {
    fn drop(&mut self) {
        if let Some(metrics) = self.0 {
            metrics.error(ErrorKind::ClientGone);
        }
    }
}

/// Handles one request on `operation`. `endpoint` is the path's endpoint name (`None` on the
/// plain `/v1/...` paths, where the body's `model` names it).
pub async fn handle(
    worker: Arc<Worker>,
    operation: Operation,
    endpoint: Option<String>,
    request: Request,
) -> Response {
    let mut unanswered = Unanswered(Some(&worker.metrics));
    let result = route(&worker, operation, endpoint, request).await;
    unanswered.0 = None;
    result.unwrap_or_else(|err| {
        worker.metrics.error(err.kind);
        err.into_response_for(operation.api())
    })
}

async fn route(
    worker: &Worker,
    operation: Operation,
    endpoint_name: Option<String>,
    request: Request,
) -> Result<Response, ApiError> {
    let arrived = Instant::now();
    let (parts, body) = request.into_parts();
    let Some(permit) = worker.admission.request() else {
        crate::body::refuse_unread(body, &parts.headers).await;
        return Err(ApiError::overloaded(format!(
            "the router has {} requests in flight (--max-in-flight); retry shortly",
            worker.admission.limits().max_in_flight
        )));
    };
    let table = worker.table.load_full();
    if table.version == 0 {
        return Err(ApiError::unavailable(
            "the router has no routing state yet (control plane not reached)",
        ));
    }
    // Unknown endpoints are refused before the body is read.
    let endpoint =
        match &endpoint_name {
            Some(name) => {
                Some(table.endpoints.get(name.as_str()).cloned().ok_or_else(|| {
                    ApiError::unknown_endpoint(format!("Endpoint {name} not found"))
                })?)
            }
            None => None,
        };
    let mut reservation = worker.admission.buffer();
    let body = read_body(
        body,
        &parts.headers,
        worker.client_body_deadline,
        &mut reservation,
    )
    .await?;
    let (uri, headers) = (parts.uri, parts.headers);
    // Parsing a large JSON body takes long enough to hold up the thread's other requests. The
    // blocking task owns the body's reservation and the request's slot while it holds the
    // body, so they are released with it even if this request is dropped meanwhile.
    // A disaggregated endpoint counts prompt tokens (milliseconds of CPU, and maybe a
    // tokenizer file to load): always off the serving thread.
    let counts_tokens = match &endpoint {
        Some(endpoint) => endpoint.disaggregation.is_some(),
        None => table
            .endpoints
            .values()
            .any(|endpoint| endpoint.disaggregation.is_some()),
    };
    let (plan, headers, mut reservation, permit) = if body.len() > OFFLOAD_BYTES || counts_tokens {
        let tokenizers = Arc::clone(&worker.tokenizers);
        tokio::task::spawn_blocking(move || {
            let plan = make_plan(
                &table,
                operation,
                endpoint,
                &uri,
                &headers,
                body,
                &tokenizers,
                &mut fastrand::Rng::new(),
            );
            (plan, headers, reservation, permit)
        })
        .await
        .map_err(|err| ApiError::unavailable(format!("routing task failed: {err}")))?
    } else {
        let plan = make_plan(
            &table,
            operation,
            endpoint,
            &uri,
            &headers,
            body,
            &worker.tokenizers,
            &mut fastrand::Rng::new(),
        );
        (plan, headers, reservation, permit)
    };
    let mut plan = plan?;
    // The body now held is the plan's (the original is gone if `model` was rewritten).
    reservation.resize_to(plan.body.len() as u64);
    if let Some(input) = plan.kv.take() {
        rank_by_kv(worker, &mut plan, input).await;
    }
    worker
        .metrics
        .decision_seconds
        .observe(arrived.elapsed().as_secs_f64());
    Forwarder {
        clients: &worker.clients,
        settings: worker.forwarding,
        metrics: &worker.metrics,
    }
    .forward(operation, plan, headers, permit, reservation)
    .await
}

/// KV_AWARE: gets the request's token ids (one `/tokenize` round trip to the least loaded
/// instance, within `--kv-tokenize-timeout-ms`, unless the prompt is token ids) and ranks the
/// variant's instances by what the KV index says they hold (`kv::decide`; long prompts on a
/// blocking thread). Before any engine of the variant has published, the plan's
/// LEAST_OUTSTANDING_REQUESTS ranking stands and nothing is asked; without token ids (no
/// prompt in the body, or the engine did not answer) the request is ranked by load, counted
/// in `switchyard_router_kv_tokenize_failures_total`.
async fn rank_by_kv(worker: &Worker, plan: &mut Plan, input: KvInput) {
    let endpoint = Arc::clone(&plan.endpoint);
    let variant_index = plan.variant_index;
    let variant = &endpoint.variants[variant_index];
    let Some(index) = worker
        .kv_index
        .variant(&endpoint.name, &variant.name)
        .filter(|index| index.block_size().is_some())
    else {
        return;
    };
    let tokens = match input {
        KvInput::Unusable(err) => Err(err),
        KvInput::Tokens(tokens) => {
            let asked = Instant::now();
            let round_trip = matches!(tokens, PromptTokens::Ask(_));
            let fetched = tokens
                .fetch(&worker.tokenizer, variant, crate::now_unix_ms())
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
    let random = fastrand::u64(..);
    let decision = match tokens {
        Err(err) => {
            worker.metrics.kv_tokenize_failed(&err);
            tracing::debug!(endpoint = %endpoint.name, variant = %variant.name, error = %err, "no token ids for a KV_AWARE request; routing it by load");
            kv::decide(variant, None, None, crate::now_unix_ms(), random)
        }
        Ok(tokens) if tokens.len() > kv::OFFLOAD_TOKENS => {
            let endpoint = Arc::clone(&endpoint);
            let decided = tokio::task::spawn_blocking(move || {
                let variant = &endpoint.variants[variant_index];
                kv::decide(
                    variant,
                    Some(&index),
                    Some(&tokens),
                    crate::now_unix_ms(),
                    random,
                )
            })
            .await;
            decided
                .unwrap_or_else(|_| kv::decide(variant, None, None, crate::now_unix_ms(), random))
        }
        Ok(tokens) => kv::decide(
            variant,
            Some(&index),
            Some(&tokens),
            crate::now_unix_ms(),
            random,
        ),
    };
    plan.ranking = decision.ranking;
    plan.label = RouteLabel::from(plan.ranking.route.unwrap_or(Route::LeastOutstanding));
    plan.cached_tokens = decision.cached_tokens_by_instance;
}
