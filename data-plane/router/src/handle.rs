//! One request from arrival to answer: admission, the body, the plan (for KV_AWARE, the
//! prompt's token ids and the ranking by the KV index; on a disaggregated endpoint, the same
//! token ids for a KV_AWARE prefill pool and the UNCACHED_TOKENS decision), forwarding. Every
//! refusal is answered in the shape of the API the request came in on.

use std::sync::Arc;
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use axum::extract::Request;
use axum::response::Response;

use crate::admission::Admission;
use crate::body::{OFFLOAD_BYTES, read_body};
use crate::errors::{ApiError, ErrorKind};
use crate::forward::{ForwardSettings, Forwarder, UpstreamClients, ensure_request_id};
use crate::kv::tokenize::{PromptTokens, Tokenizer};
use crate::kv::{self, KvIndex};
use crate::metrics::RouterMetrics;
use crate::plan::{DpdKv, KvInput, Operation, Plan, PoolIndexes, make_plan, settle_disaggregation};
use crate::table::{LoadRegistry, RouteLabel, RoutingTable, VariantRoute};
use crate::tokenizer::Tokenizers;
use crate::trace::{RequestTrace, TracedBody, request_id};
use opentelemetry::KeyValue;
use switchyard_policy::rank::Route;
use switchyard_shared::{PrefillRoutingStrategy, ThresholdBasis};

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
    /// Starts the requests' spans when tracing is on.
    pub tracer: Option<switchyard_telemetry::SpanSink>,
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
            tracer: self.tracer.clone(),
            kv_index: Arc::clone(&self.kv_index),
            tokenizer: self.tokenizer.like(),
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
    let trace = worker.tracer.as_ref().map(|tracer| {
        RequestTrace::start(tracer, request.method(), request.uri(), request.headers())
    });
    let result = route(&worker, operation, endpoint, request, trace.as_ref()).await;
    unanswered.0 = None;
    let response = result.unwrap_or_else(|err| {
        worker.metrics.error(err.kind);
        err.into_response_for(operation.api())
    });
    match trace {
        None => response,
        Some(trace) => {
            // The server span ends with the body (a stream ends long after its head).
            let span = trace.finish(response.status());
            response.map(|inner| axum::body::Body::new(TracedBody { inner, span }))
        }
    }
}

async fn route(
    worker: &Worker,
    operation: Operation,
    endpoint_name: Option<String>,
    request: Request,
    trace: Option<&RequestTrace>,
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
    let (uri, mut headers) = (parts.uri, parts.headers);
    ensure_request_id(&mut headers);
    if let Some(trace) = trace.filter(|trace| trace.is_recording()) {
        trace.set_attribute(KeyValue::new(
            "switchyard.request_id",
            crate::trace::bounded(request_id(&headers)),
        ));
    }
    let decision = trace.map(RequestTrace::decision);
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
    let mut plan = plan.inspect_err(|err| {
        if let Some(decision) = &decision {
            decision.fail(&err.message);
        }
    })?;
    // The body now held is the plan's (the original is gone if `model` was rewritten).
    reservation.resize_to(plan.body.len() as u64);
    if let Some(input) = plan.kv.take() {
        rank_by_kv(worker, &mut plan, input).await;
    }
    if let Some(dpd) = plan.dpd.take() {
        plan = settle_dpd(worker, plan, dpd).await?;
    }
    drop(decision);
    if let Some(trace) = trace {
        trace.record_plan(&plan);
    }
    worker
        .metrics
        .decision_seconds
        .observe(arrived.elapsed().as_secs_f64());
    Forwarder {
        clients: &worker.clients,
        settings: worker.forwarding,
        metrics: &worker.metrics,
        trace,
    }
    .forward(operation, plan, headers, permit, reservation)
    .await
}

/// The request's token ids for `variant`'s engines: as given, or one `/tokenize` round trip to
/// its least loaded instance not paused for failing to tokenize within `--kv-tokenize-timeout-ms` (timed in
/// `switchyard_router_kv_tokenize_seconds`). A failure is counted in
/// `switchyard_router_kv_tokenize_failures_total` and logged; the caller routes by load.
async fn token_ids(worker: &Worker, variant: &VariantRoute, input: KvInput) -> Option<Vec<u32>> {
    let fetched = match input {
        KvInput::Unusable(err) => Err(err),
        KvInput::Tokens(tokens) => {
            let asked = Instant::now();
            let round_trip = matches!(tokens, PromptTokens::Ask(_));
            let fetched = tokens
                .fetch(
                    &worker.tokenizer,
                    variant,
                    switchyard_process::clock::unix_ms(),
                )
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

/// KV_AWARE: gets the request's token ids ([`token_ids`]) and ranks the variant's instances by
/// what the KV index says they hold (`kv::decide`; long prompts on a blocking thread). Before
/// any engine of the variant has published, the plan's LEAST_OUTSTANDING_REQUESTS ranking
/// stands and nothing is asked; without token ids (no prompt in the body, or the engine did
/// not answer) the request is ranked by load.
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
    let tokens = token_ids(worker, variant, input).await;
    let random = fastrand::u64(..);
    let decision = match tokens {
        None => kv::decide(
            variant,
            None,
            None,
            switchyard_process::clock::unix_ms(),
            random,
        ),
        Some(tokens) if tokens.len() > kv::OFFLOAD_TOKENS => {
            let endpoint = Arc::clone(&endpoint);
            let decided = tokio::task::spawn_blocking(move || {
                let variant = &endpoint.variants[variant_index];
                kv::decide(
                    variant,
                    Some(&index),
                    Some(&tokens),
                    switchyard_process::clock::unix_ms(),
                    random,
                )
            })
            .await;
            decided.unwrap_or_else(|_| {
                kv::decide(
                    variant,
                    None,
                    None,
                    switchyard_process::clock::unix_ms(),
                    random,
                )
            })
        }
        Some(tokens) => kv::decide(
            variant,
            Some(&index),
            Some(&tokens),
            switchyard_process::clock::unix_ms(),
            random,
        ),
    };
    plan.ranking = decision.ranking;
    plan.label = RouteLabel::from(plan.ranking.route.unwrap_or(Route::LeastOutstanding));
    plan.cached_tokens = decision.cached_tokens_by_instance;
}

/// A disaggregated endpoint's plan that needs the prompt's token ids (KV_AWARE prefill,
/// UNCACHED_TOKENS): gets them once ([`token_ids`], asked of the decode pool) if an index that
/// needs them has data (the decode pool's for UNCACHED_TOKENS, the prefill pool's for a
/// KV_AWARE prefill), then finishes the plan (`plan::settle_disaggregation`, on a blocking
/// thread for UNCACHED_TOKENS, which may make the prefill copy, and for long prompts). With no
/// index ready, nothing is asked: UNCACHED_TOKENS counts every
/// prompt token as uncached, and the prefill pool is ranked by load.
async fn settle_dpd(worker: &Worker, plan: Plan, dpd: DpdKv) -> Result<Plan, ApiError> {
    let endpoint = Arc::clone(&plan.endpoint);
    let Some(pd) = endpoint.disaggregation.as_ref() else {
        return Ok(plan);
    };
    let ready = |position: usize| {
        worker
            .kv_index
            .variant(&endpoint.name, &endpoint.variants[position].name)
            .filter(|index| index.block_size().is_some())
    };
    let decode_index = (pd.basis == ThresholdBasis::UncachedTokens)
        .then(|| ready(pd.decode))
        .flatten();
    let prefill_index = (pd.prefill_strategy == PrefillRoutingStrategy::KvAware
        && (dpd.undecided.is_some() || plan.disaggregated.is_some()))
    .then(|| ready(pd.prefill))
    .flatten();
    let DpdKv {
        input,
        undecided,
        prefill_key,
    } = dpd;
    let tokens = if decode_index.is_some() || prefill_index.is_some() {
        token_ids(worker, &endpoint.variants[pd.decode], input).await
    } else {
        None
    };
    // UNCACHED_TOKENS may make the prefill copy (a parse of the body): off the serving thread.
    let offload = undecided.is_some()
        || tokens
            .as_ref()
            .is_some_and(|tokens| tokens.len() > kv::OFFLOAD_TOKENS);
    let settle = move |mut plan: Plan| {
        let indexes = PoolIndexes {
            decode: decode_index.as_deref(),
            prefill: prefill_index.as_deref(),
        };
        settle_disaggregation(
            &mut plan,
            undecided,
            &prefill_key,
            tokens.as_deref(),
            indexes,
            switchyard_process::clock::unix_ms(),
            fastrand::u64(..),
        );
        plan
    };
    if offload {
        return tokio::task::spawn_blocking(move || settle(plan))
            .await
            .map_err(|err| ApiError::unavailable(format!("routing task failed: {err}")));
    }
    Ok(settle(plan))
}
