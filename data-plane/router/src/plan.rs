//! Planning a request: CPU only, no sockets. From the operation, the headers and the body,
//! resolve the endpoint and the variant, rank the variant's instances with the policy, and
//! rewrite `model` for the engine. A KV_AWARE variant's plan also says how to get the
//! prompt's token ids (`Plan::kv`); `handle` fetches them and ranks by the KV index.
//! Forwarding the plan is `forward`'s job.
//!
//! Response affinity (the Responses API): a request about a stored response (a follow-up
//! with `previous_response_id`, or `/v1/responses/{id}` and its `cancel`) goes to the
//! instance holding it, found from the wrapped id alone (`response_ids`): endpoint, variant
//! and instance come from the id, the instance is the only candidate (ahead of any
//! ConcurrencyThreshold), and if it is not routable now the answer is 404
//! `response_not_found`, never another instance.

use std::borrow::Cow;
use std::sync::Arc;

use bytes::Bytes;
use http::header::{HeaderMap, HeaderName};
use switchyard_policy::hash::{routing_key, session_key};
use switchyard_policy::openai::{OpenAiRequest, TextRule};
use switchyard_policy::prefix::{native, valid_prefix_aware_id};
use switchyard_policy::rank::{self, Route, Strategy};

use crate::disaggregated::{prefill_body, without_client_kv_transfer_params};
use crate::errors::{Api, ApiError};
use crate::kv::VariantIndex;
use crate::kv::tokenize::{PromptKind, PromptTokens, TokenizeError};
use crate::response_ids::{self, StoredResponse};
use crate::table::{
    Disaggregation, EndpointRoute, InstanceRoute, RouteLabel, RoutingTable, VariantRoute,
};
use crate::tokenizer::{Count, Tokenizer, Tokenizers};
use http::HeaderValue;
use switchyard_shared::{
    DecodeRoutingStrategy, InstanceId, PrefillRoutingStrategy, ThresholdBasis,
};

pub const PREFIX_AWARE_ID: HeaderName = HeaderName::from_static("x-amzn-sagemaker-prefix-aware-id");
pub const TARGET_VARIANT: HeaderName = HeaderName::from_static("x-amzn-sagemaker-target-variant");
pub const SESSION_ID: HeaderName = HeaderName::from_static("x-amzn-sagemaker-session-id");

/// What a request asks for: the API it came in on and the path it takes on the instance.
/// The OpenAI operations are served at vLLM's paths, plain (the body's `model`, or a response
/// id, names the endpoint) and under `/endpoints/{e}/openai/`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Operation {
    Invocations,
    InvocationsStream,
    ChatCompletions,
    Completions,
    /// `POST /v1/responses`.
    Responses,
    /// `GET /v1/responses/{id}`.
    ResponseRetrieve,
    /// `DELETE /v1/responses/{id}` (OpenAI's; vLLM does not serve it).
    ResponseDelete,
    /// `POST /v1/responses/{id}/cancel`.
    ResponseCancel,
    /// `POST /v1/embeddings`.
    Embeddings,
    /// `POST /pooling`.
    Pooling,
    /// `POST /classify`.
    Classify,
    /// `POST /score`.
    Score,
    /// `POST /v1/score`.
    ScoreV1,
    /// `POST /rerank`.
    Rerank,
    /// `POST /v1/rerank`.
    RerankV1,
    /// `POST /v2/rerank`.
    RerankV2,
    /// `POST /tokenize`.
    Tokenize,
    /// `POST /detokenize`.
    Detokenize,
}

impl Operation {
    pub fn api(self) -> Api {
        match self {
            Operation::Invocations | Operation::InvocationsStream => Api::Native,
            _ => Api::OpenAi,
        }
    }

    /// The HTTP method, here and on the instance.
    pub fn method(self) -> http::Method {
        match self {
            Operation::ResponseRetrieve => http::Method::GET,
            Operation::ResponseDelete => http::Method::DELETE,
            _ => http::Method::POST,
        }
    }

    /// The instance's URL for this operation, when it is made once per instance (the
    /// busiest paths); the others are made per request from [`Plan::path`].
    pub fn upstream(self, instance: &InstanceRoute) -> Option<&http::Uri> {
        match self {
            Operation::Invocations | Operation::InvocationsStream => Some(&instance.invocations),
            Operation::ChatCompletions => Some(&instance.chat_completions),
            Operation::Completions => Some(&instance.completions),
            _ => None,
        }
    }

    /// The path on the instance of an operation with a fixed one and no prepared URL.
    fn fixed_path(self) -> Option<&'static str> {
        Some(match self {
            Operation::Responses => "/v1/responses",
            Operation::Embeddings => "/v1/embeddings",
            Operation::Pooling => "/pooling",
            Operation::Classify => "/classify",
            Operation::Score => "/score",
            Operation::ScoreV1 => "/v1/score",
            Operation::Rerank => "/rerank",
            Operation::RerankV1 => "/v1/rerank",
            Operation::RerankV2 => "/v2/rerank",
            Operation::Tokenize => "/tokenize",
            Operation::Detokenize => "/detokenize",
            _ => return None,
        })
    }

    /// Where PREFIX_AWARE takes the prefix text from (`policy::openai`).
    pub fn text_rule(self) -> TextRule {
        match self {
            Operation::Responses => TextRule::Responses,
            Operation::Embeddings | Operation::Pooling | Operation::Classify => TextRule::Input,
            Operation::Score | Operation::ScoreV1 => TextRule::Score,
            Operation::Rerank | Operation::RerankV1 | Operation::RerankV2 => TextRule::Rerank,
            Operation::Detokenize => TextRule::Tokens,
            _ => TextRule::Chat,
        }
    }

    /// Chat and completions: generation whose prompt a disaggregated endpoint may prefill
    /// elsewhere.
    pub fn is_generation(self) -> bool {
        matches!(self, Operation::ChatCompletions | Operation::Completions)
    }

    /// A request about the stored response its path names (`/v1/responses/{id}[/cancel]`).
    pub fn names_stored_response(self) -> bool {
        matches!(
            self,
            Operation::ResponseRetrieve | Operation::ResponseDelete | Operation::ResponseCancel
        )
    }

    /// Answers carry response ids, which `response_ids::adapt` wraps.
    pub fn answers_with_response_ids(self) -> bool {
        self == Operation::Responses || self.names_stored_response()
    }
}

/// A request ready to forward: where it may go, in order, and the body to send.
#[derive(Debug)]
pub struct Plan {
    pub endpoint: Arc<EndpointRoute>,
    pub variant_index: usize,
    pub ranking: rank::Ranking,
    pub body: Bytes,
    /// The path (and query) on the instance, for operations without a prepared URL
    /// ([`Operation::upstream`]).
    pub path: Option<String>,
    /// Why the first candidate is chosen (`x-switchyard-route`).
    pub label: RouteLabel,
    /// Response headers that explain the decision (`x-switchyard-prompt-tokens`, …).
    pub explain: Vec<(HeaderName, HeaderValue)>,
    /// Set when the request goes prefill → decode (the ranking is then the decoders').
    pub disaggregated: Option<Disaggregated>,
    /// KV_AWARE (without a session): what ranking by the variant's KV index needs; until
    /// then `ranking` is LEAST_OUTSTANDING_REQUESTS', the fallback. None: `ranking` is final.
    pub kv: Option<KvInput>,
    /// Once ranked by the KV index: the leading prompt tokens each instance holds, by
    /// position in the variant (`x-switchyard-cached-tokens`); empty otherwise.
    pub cached_tokens: Vec<u32>,
    /// A disaggregated endpoint's request that needs the prompt's token ids before it is
    /// forwarded (see [`DpdKv`]). None: the plan is final.
    pub dpd: Option<DpdKv>,
    /// PREFIX_AWARE: the routing key the ranking hashed (for the trace; None otherwise).
    pub routing_key: Option<u64>,
}

/// A disaggregated endpoint's request whose plan needs the prompt's token ids: to rank the
/// prefill pool by its KV index (PrefillRoutingStrategy KV_AWARE), or to make the decision
/// itself (ThresholdBasis UNCACHED_TOKENS). `handle` gets them (one `/tokenize` round trip at
/// most, asked of the decode pool: the plan's body names its ModelName) and finishes the plan
/// with [`settle_disaggregation`].
#[derive(Debug)]
pub struct DpdKv {
    /// How to get the token ids.
    pub input: KvInput,
    /// UNCACHED_TOKENS: the prompt as counted by the router's tokenizer, for when the token
    /// ids cannot be had (then every token counts as uncached). Until the decision is made
    /// the plan reads `direct`.
    pub undecided: Option<Count>,
    /// What ranking the prefill pool needs besides the token ids.
    pub prefill_key: PrefillKey,
}

/// What the prefill strategies read from the request, kept for a decision made later.
#[derive(Debug, Clone, Copy, Default)]
pub struct PrefillKey {
    /// SESSION: the session's key.
    session: Option<u64>,
    /// PREFIX_AWARE: the routing key of the prefix (0 for the other strategies).
    prefix: u64,
}

/// A KV_AWARE request's way to its token ids, read from the body on the CPU side.
#[derive(Debug)]
pub enum KvInput {
    /// Token ids given, or the `/tokenize` body to ask an engine with.
    Tokens(PromptTokens),
    /// The body has no prompt to tokenize: the request is routed by load.
    Unusable(TokenizeError),
}

/// A long prompt's way through a disaggregated endpoint.
#[derive(Debug)]
pub struct Disaggregated {
    /// Prefill candidates (indices into the prefill variant), in preference order.
    pub prefill: rank::Ranking,
    /// The prompt's tokens as counted.
    pub count: Count,
    /// KV_AWARE prefill, once ranked by the prefill pool's KV index: the leading prompt
    /// tokens each prefill instance holds, by position (`x-switchyard-prefill-cached-tokens`);
    /// empty otherwise.
    pub prefill_cached_tokens: Vec<u32>,
    /// The request to send to the prefill instance (made here, off the serving thread).
    pub prefill_body: Option<Bytes>,
}

pub const PROMPT_TOKENS: HeaderName = HeaderName::from_static("x-switchyard-prompt-tokens");

impl Plan {
    pub fn variant(&self) -> &VariantRoute {
        &self.endpoint.variants[self.variant_index]
    }
}

/// What routing reads from the headers, once checked.
struct RoutingHeaders {
    prefix_aware_id: Option<String>,
    session: Option<u64>,
    target_variant: Option<String>,
}

fn header_str<'a>(headers: &'a HeaderMap, name: &HeaderName) -> Result<Option<&'a str>, ApiError> {
    match headers.get(name) {
        None => Ok(None),
        Some(value) => value
            .to_str()
            .map(Some)
            .map_err(|_| ApiError::validation(format!("header {name} must be printable ASCII"))),
    }
}

fn routing_headers(headers: &HeaderMap) -> Result<RoutingHeaders, ApiError> {
    let prefix_aware_id = header_str(headers, &PREFIX_AWARE_ID)?.map(str::to_owned);
    if let Some(id) = &prefix_aware_id
        && !valid_prefix_aware_id(id.as_bytes())
    {
        return Err(ApiError::validation(format!(
            "header {PREFIX_AWARE_ID} must be 1-64 printable ASCII characters"
        )));
    }
    Ok(RoutingHeaders {
        prefix_aware_id,
        session: header_str(headers, &SESSION_ID)?.map(|id| session_key(id.as_bytes())),
        target_variant: header_str(headers, &TARGET_VARIANT)?.map(str::to_owned),
    })
}

fn parse_openai(body: &[u8]) -> Result<OpenAiRequest<'_>, ApiError> {
    OpenAiRequest::parse(body).map_err(|err| match err {
        switchyard_policy::openai::RequestError::Json(message) => {
            ApiError::validation(format!("the body is not valid JSON: {message}"))
        }
        switchyard_policy::openai::RequestError::Field { field, message } => {
            ApiError::validation(format!("'{field}' {message}")).with_param(field)
        }
    })
}

/// Reads what routing needs from the headers and body, resolves the endpoint (`endpoint` is
/// the path's, `None` on the plain `/v1/...` paths where the body's `model` names it) and the
/// variant, ranks the instances, and rewrites `model` for the engine. `uri` is the request's
/// (the response id of `/v1/responses/{id}`, and its query, are read from it).
#[allow(clippy::too_many_arguments)] // one call site per thread kind; a struct would only rename them
pub fn make_plan(
    table: &RoutingTable,
    operation: Operation,
    mut endpoint: Option<Arc<EndpointRoute>>,
    uri: &http::Uri,
    headers: &HeaderMap,
    body: Bytes,
    tokenizers: &Tokenizers,
    rng: &mut fastrand::Rng,
) -> Result<Plan, ApiError> {
    if operation.names_stored_response() {
        return stored_response_plan(table, operation, endpoint, uri, body);
    }
    let mut routing = routing_headers(headers)?;
    let variant_named_by_header = routing.target_variant.is_some();
    // OpenAI bodies are parsed once: model, stream, prompt_cache_key, prefix text.
    let openai = match operation.api() {
        Api::OpenAi => Some(parse_openai(&body)?),
        Api::Native => None,
    };
    // A Responses follow-up names the response it continues, and so its instance.
    let previous = match openai
        .as_ref()
        .and_then(|request| request.previous_response_id.as_deref())
    {
        Some(id) => Some(stored_response(id, "previous_response_id")?),
        None => None,
    };
    if let Some(openai) = &openai {
        if endpoint.is_none()
            && openai.model.is_none()
            && let Some(previous) = &previous
        {
            endpoint = Some(stored_endpoint(table, previous, "previous_response_id")?);
        }
        if endpoint.is_none() {
            let model = openai.model.as_deref().ok_or_else(|| {
                ApiError::validation("'model' is required to choose an endpoint on /v1 paths")
                    .with_param("model")
            })?;
            let (found, variant) = table.resolve_model(model).ok_or_else(|| {
                ApiError::unknown_endpoint(format!(
                    "The model `{model}` does not exist (no endpoint or ModelName of that name)"
                ))
                .with_param("model")
            })?;
            if routing.target_variant.is_none()
                && let Some(index) = variant
            {
                routing.target_variant = Some(found.variants[index].name.to_string());
            }
            endpoint = Some(found);
        }
        if routing.prefix_aware_id.is_none()
            && let Some(key) = &openai.prompt_cache_key
        {
            if !valid_prefix_aware_id(key.as_bytes()) {
                return Err(ApiError::validation(
                    "'prompt_cache_key' must be 1-64 printable ASCII characters",
                )
                .with_param("prompt_cache_key"));
            }
            routing.prefix_aware_id = Some(key.to_string());
        }
    }
    let endpoint = endpoint.ok_or_else(|| ApiError::unknown_endpoint("no endpoint named"))?;
    if let Some(pd) = &endpoint.disaggregation
        && previous.is_none()
    {
        if variant_named_by_header {
            return Err(ApiError::validation(format!(
                "header {TARGET_VARIANT}: endpoint {} is disaggregated (prefill and decode \
                 variants), so a variant cannot be chosen",
                endpoint.name
            )));
        }
        // Chat and completions prompts are counted against the threshold; every other
        // operation (and native bodies, which are not parsed) goes straight to a decoder.
        let counted = openai
            .as_ref()
            .filter(|_| operation.is_generation())
            .map(|request| (request, operation.text_rule()));
        let decision =
            decide_disaggregation(&endpoint, pd, &routing, counted, &body, tokenizers, rng)?;
        let decode = &endpoint.variants[pd.decode];
        let rewritten = match &openai {
            Some(request) => decode
                .model_name
                .as_deref()
                .filter(|model| request.model.as_deref() != Some(*model))
                .map(|model| request.rewrite(Some(model), None)),
            None => None,
        };
        drop(openai);
        let body = without_client_kv_transfer_params(rewritten.map_or(body, Bytes::from));
        let mut disaggregated = decision.disaggregated;
        if let Some(disaggregated) = &mut disaggregated {
            let prefill = &endpoint.variants[pd.prefill];
            disaggregated.prefill_body = prefill_body(&body, pd.protocol, prefill);
        }
        let dpd = decision.needs_tokens.map(|(undecided, prefill_key)| DpdKv {
            input: kv_input(operation, &body),
            undecided,
            prefill_key,
        });
        return Ok(Plan {
            variant_index: pd.decode,
            ranking: decision.decoders,
            body,
            path: operation.fixed_path().map(str::to_owned),
            label: decision.label,
            explain: decision.explain,
            disaggregated,
            endpoint,
            kv: None,
            cached_tokens: Vec::new(),
            dpd,
            routing_key: None,
        });
    }
    // Affinity: the instance holding the previous response, whatever the strategy.
    let mut prefix_key = None;
    let (variant_index, ranking) = match &previous {
        Some(previous) => {
            let (variant, instance) = holder(&endpoint, previous, "previous_response_id")?;
            (variant, rank::affinity(instance))
        }
        None => {
            let index = choose_variant(&endpoint, routing.target_variant.as_deref(), rng.u64(..))?;
            let variant = &endpoint.variants[index];
            let (ranking, key) = rank_instances(
                variant,
                &routing,
                openai
                    .as_ref()
                    .map(|request| (request, operation.text_rule())),
                &body,
                rng.u64(..),
            );
            prefix_key = key;
            (index, ranking)
        }
    };
    let variant = &endpoint.variants[variant_index];
    // The engine sees the variant's ModelName, whatever name the client used, and its own
    // id of the previous response.
    let rewritten = match &openai {
        Some(request) => {
            let model = variant
                .model_name
                .as_deref()
                .filter(|model| request.model.as_deref() != Some(*model));
            let previous_id = previous
                .as_ref()
                .map(|previous| previous.engine_id.as_str());
            (model.is_some() || previous_id.is_some()).then(|| request.rewrite(model, previous_id))
        }
        None => None,
    };
    drop(openai);
    let body = rewritten.map(Bytes::from).unwrap_or(body);
    // A Responses follow-up on a disaggregated endpoint (to the instance holding it).
    let body = match &endpoint.disaggregation {
        Some(_) => without_client_kv_transfer_params(body),
        None => body,
    };
    // A session, or a stored response, sticks to its instance whatever the strategy.
    let kv = match (routing.session, variant.strategy) {
        _ if previous.is_some() => None,
        (None, Strategy::KvAware { .. }) => Some(kv_input(operation, &body)),
        _ => None,
    };
    Ok(Plan {
        body,
        label: RouteLabel::from(ranking.route.unwrap_or(Route::Random)),
        endpoint,
        variant_index,
        ranking,
        path: operation.fixed_path().map(str::to_owned),
        explain: Vec::new(),
        disaggregated: None,
        kv,
        cached_tokens: Vec::new(),
        dpd: None,
        routing_key: prefix_key,
    })
}

/// Unwraps a response id a client sent (`param` names where it came from).
fn stored_response(id: &str, param: &'static str) -> Result<StoredResponse, ApiError> {
    response_ids::unwrap(id).ok_or_else(|| {
        ApiError::response_not_found(
            format!(
                "Response with id '{id}' not found: it was not issued by a Switchyard router, \
                 so the instance holding it is unknown"
            ),
            param,
        )
    })
}

/// The endpoint a stored response belongs to.
fn stored_endpoint(
    table: &RoutingTable,
    stored: &StoredResponse,
    param: &'static str,
) -> Result<Arc<EndpointRoute>, ApiError> {
    table
        .endpoints
        .get(stored.endpoint.as_str())
        .cloned()
        .ok_or_else(|| {
            ApiError::response_not_found(
                format!(
                    "Response not found: it was stored by instance {} of endpoint {}, which no \
                     longer exists",
                    stored.instance, stored.endpoint
                ),
                param,
            )
        })
}

/// The (variant, instance) indices of the instance holding `stored` in `endpoint`; 404
/// `response_not_found` if it is not routable now (deregistered, failed its health checks)
/// or the response belongs to another endpoint.
fn holder(
    endpoint: &EndpointRoute,
    stored: &StoredResponse,
    param: &'static str,
) -> Result<(usize, usize), ApiError> {
    if endpoint.name.as_str() != stored.endpoint {
        return Err(ApiError::response_not_found(
            format!(
                "Response not found in endpoint {}: it belongs to endpoint {}",
                endpoint.name, stored.endpoint
            ),
            param,
        ));
    }
    let found = endpoint.variant(&stored.variant).and_then(|variant_index| {
        endpoint.variants[variant_index]
            .instances
            .iter()
            .position(|instance| instance.id.as_str() == stored.instance)
            .map(|instance_index| (variant_index, instance_index))
    });
    found.ok_or_else(|| {
        ApiError::response_not_found(
            format!(
                "Response not found: it was stored by instance {} (variant {} of endpoint {}), \
                 which has left or is not routable now (failed its health checks); a response \
                 lives only on the instance that made it",
                stored.instance, stored.variant, stored.endpoint
            ),
            param,
        )
    })
}

/// `GET`/`DELETE /v1/responses/{id}` and `POST /v1/responses/{id}/cancel`: the instance the
/// id names, the engine's id in the path, the query and body passed on as they are.
fn stored_response_plan(
    table: &RoutingTable,
    operation: Operation,
    endpoint: Option<Arc<EndpointRoute>>,
    uri: &http::Uri,
    body: Bytes,
) -> Result<Plan, ApiError> {
    let id = response_id_in_path(uri.path()).ok_or_else(|| {
        ApiError::validation("the path has no response id").with_param("response_id")
    })?;
    let stored = stored_response(id, "response_id")?;
    let endpoint = match endpoint {
        Some(endpoint) => endpoint,
        None => stored_endpoint(table, &stored, "response_id")?,
    };
    let (variant_index, instance) = holder(&endpoint, &stored, "response_id")?;
    let mut path = format!("/v1/responses/{}", percent_encode(&stored.engine_id));
    if operation == Operation::ResponseCancel {
        path.push_str("/cancel");
    }
    if let Some(query) = uri.query() {
        path.push('?');
        path.push_str(query);
    }
    Ok(Plan {
        endpoint,
        variant_index,
        ranking: rank::affinity(instance),
        body: match operation.method() {
            http::Method::POST => body,
            _ => Bytes::new(),
        },
        path: Some(path),
        label: RouteLabel::Response,
        explain: Vec::new(),
        disaggregated: None,
        kv: None,
        cached_tokens: Vec::new(),
        dpd: None,
        routing_key: None,
    })
}

/// The `{id}` of `.../v1/responses/{id}[/cancel]`.
fn response_id_in_path(path: &str) -> Option<&str> {
    let (_, rest) = path.rsplit_once("/v1/responses/")?;
    let id = rest.split('/').next()?;
    (!id.is_empty()).then_some(id)
}

/// `text` with everything but RFC 3986's unreserved characters (less `.`) percent-encoded (an engine's
/// response id in a path).
fn percent_encode(text: &str) -> Cow<'_, str> {
    // `.` is encoded too: an id of `.` or `..` must not become a path segment a proxy or
    // server would normalise away.
    let unreserved = |byte: u8| byte.is_ascii_alphanumeric() || b"-_~".contains(&byte);
    if text.bytes().all(unreserved) {
        return Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() * 3);
    for byte in text.bytes() {
        if unreserved(byte) {
            out.push(byte as char);
        } else {
            out.push_str(&format!("%{byte:02X}"));
        }
    }
    Cow::Owned(out)
}

/// What a disaggregated endpoint does with one request.
struct Decision {
    decoders: rank::Ranking,
    label: RouteLabel,
    explain: Vec<(HeaderName, HeaderValue)>,
    disaggregated: Option<Disaggregated>,
    /// The token ids are needed to finish the plan ([`DpdKv`]): the decision waits for them
    /// (UNCACHED_TOKENS, with the router's own count), and what the prefill ranking reads.
    needs_tokens: Option<(Option<Count>, PrefillKey)>,
}

/// Below the threshold (and for native bodies, which are not parsed) a decoder serves the
/// whole request (`direct`); at or above it, a prefill instance first (`disaggregated`); with
/// no prefill instance routable, the decoder serves it whole (`fallback`). PROMPT_TOKENS
/// decides here; UNCACHED_TOKENS, which needs the prompt's token ids and the decoders' KV
/// index, only counts and leaves the decision to [`settle_disaggregation`]; a KV_AWARE prefill
/// ranking is LEAST_OUTSTANDING_REQUESTS' until then.
fn decide_disaggregation(
    endpoint: &EndpointRoute,
    pd: &Disaggregation,
    routing: &RoutingHeaders,
    openai: Option<(&OpenAiRequest<'_>, TextRule)>,
    body: &[u8],
    tokenizers: &Tokenizers,
    rng: &mut fastrand::Rng,
) -> Result<Decision, ApiError> {
    let decode = &endpoint.variants[pd.decode];
    if decode.instances.is_empty() {
        return Err(ApiError::unavailable(format!(
            "the decode variant {} of endpoint {} has no healthy instance",
            decode.name, endpoint.name
        )));
    }
    let decoders = rank_decoders(
        decode,
        pd.decode_strategy,
        routing,
        openai,
        body,
        rng.u64(..),
    );
    let Some((request, _)) = openai else {
        return Ok(Decision {
            decoders,
            label: RouteLabel::Direct,
            explain: Vec::new(),
            disaggregated: None,
            needs_tokens: None,
        });
    };
    let count = count_prompt(request, &tokenizers.get(&pd.tokenizer), pd.threshold);
    let explain = vec![prompt_tokens_header(&count)];
    let prefill = &endpoint.variants[pd.prefill];
    if pd.basis == ThresholdBasis::UncachedTokens {
        return Ok(Decision {
            decoders,
            label: RouteLabel::Direct,
            explain,
            disaggregated: None,
            needs_tokens: Some((Some(count), prefill_key(prefill, pd, routing, request))),
        });
    }
    if count.tokens < pd.threshold {
        return Ok(Decision {
            decoders,
            label: RouteLabel::Direct,
            explain,
            disaggregated: None,
            needs_tokens: None,
        });
    }
    if prefill.instances.is_empty() {
        return Ok(Decision {
            decoders,
            label: RouteLabel::Fallback,
            explain,
            disaggregated: None,
            needs_tokens: None,
        });
    }
    let key = prefill_key(prefill, pd, routing, request);
    Ok(Decision {
        decoders,
        label: RouteLabel::Disaggregated,
        explain,
        disaggregated: Some(Disaggregated {
            prefill: rank_prefill(prefill, pd, &key, rng.u64(..)),
            count,
            prefill_cached_tokens: Vec::new(),
            prefill_body: None,
        }),
        needs_tokens: (pd.prefill_strategy == PrefillRoutingStrategy::KvAware)
            .then_some((None, key)),
    })
}

fn prompt_tokens_header(count: &Count) -> (HeaderName, HeaderValue) {
    (
        PROMPT_TOKENS,
        HeaderValue::from_str(&count.header_text()).unwrap_or(HeaderValue::from_static("0")),
    )
}

/// What the KV indexes of a disaggregated endpoint's pools say (None: not read, or no engine
/// of the pool has published yet).
#[derive(Debug, Default, Clone, Copy)]
pub struct PoolIndexes<'a> {
    /// The decode pool's (UNCACHED_TOKENS).
    pub decode: Option<&'a VariantIndex>,
    /// The prefill pool's (KV_AWARE prefill).
    pub prefill: Option<&'a VariantIndex>,
}

/// Finishes a disaggregated plan ([`DpdKv`]'s `undecided` and `prefill_key`) with the
/// prompt's token ids (`None`: they could not be had, or no index needed them). CPU only.
///
/// UNCACHED_TOKENS: the prompt's tokens (the token ids' count; without them the router's own
/// count) minus the leading tokens the decoder that would serve the request directly (the
/// first of the decode ranking) holds by the decode pool's index (none without token ids or
/// index) decide: below the threshold `direct`, else `disaggregated` (or `fallback` with no
/// prefill instance). `x-switchyard-cached-tokens` then says what the serving decoder holds
/// whenever the index was read. A KV_AWARE prefill ranking is then made by `kv::decide` over
/// the prefill pool's index; without ids or index it stays LEAST_OUTSTANDING_REQUESTS'.
pub fn settle_disaggregation(
    plan: &mut Plan,
    undecided: Option<Count>,
    prefill_key: &PrefillKey,
    tokens: Option<&[u32]>,
    indexes: PoolIndexes<'_>,
    now_ms: u64,
    random: u64,
) {
    let endpoint = Arc::clone(&plan.endpoint);
    let Some(pd) = endpoint.disaggregation.as_ref() else {
        return;
    };
    let prefill = &endpoint.variants[pd.prefill];
    if let Some(local_count) = undecided {
        let decode = &endpoint.variants[pd.decode];
        let count = match tokens {
            Some(ids) => Count {
                tokens: ids.len(),
                complete: true,
            },
            None => local_count,
        };
        if let (Some(ids), Some(index)) = (tokens, indexes.decode) {
            let instances: Vec<InstanceId> = decode
                .instances
                .iter()
                .map(|instance| instance.id.clone())
                .collect();
            if let Some(found) = index.match_tokens(ids, &instances) {
                let block_size = found.block_size as u32;
                plan.cached_tokens = found
                    .matched
                    .iter()
                    .map(|blocks| blocks * block_size)
                    .collect();
            }
        }
        let cached = plan
            .ranking
            .order
            .first()
            .and_then(|&first| plan.cached_tokens.get(first))
            .map_or(0, |&cached| cached as usize);
        plan.explain = vec![prompt_tokens_header(&count)];
        plan.label = if count.tokens.saturating_sub(cached) < pd.threshold {
            RouteLabel::Direct
        } else if prefill.instances.is_empty() {
            RouteLabel::Fallback
        } else {
            plan.disaggregated = Some(Disaggregated {
                prefill: rank_prefill(prefill, pd, prefill_key, random),
                count,
                prefill_cached_tokens: Vec::new(),
                prefill_body: prefill_body(&plan.body, pd.protocol, prefill),
            });
            RouteLabel::Disaggregated
        };
    }
    if pd.prefill_strategy == PrefillRoutingStrategy::KvAware
        && let Some(disaggregated) = plan.disaggregated.as_mut()
        && let (Some(ids), Some(index)) = (tokens, indexes.prefill)
    {
        let decision = crate::kv::decide(prefill, Some(index), Some(ids), now_ms, random);
        disaggregated.prefill = decision.ranking;
        disaggregated.prefill_cached_tokens = decision.cached_tokens_by_instance;
    }
}

/// Tokens per chat message that the text alone does not show (role markers and separators
/// of the chat template; Llama 3's and OpenAI's add about this many).
const CHAT_TOKENS_PER_MESSAGE: usize = 4;

/// The prompt's tokens, counted until `threshold` is certainly reached. A completions prompt
/// of token ids is its length; a text prompt is tokenized as is; a chat is counted on its
/// messages' text plus [`CHAT_TOKENS_PER_MESSAGE`] per message (an approximation of the
/// template the engine applies).
pub fn count_prompt(request: &OpenAiRequest<'_>, tokenizer: &Tokenizer, threshold: usize) -> Count {
    if let Some(ids) = request.prompt_token_ids() {
        return Count {
            tokens: ids,
            complete: true,
        };
    }
    let overhead = CHAT_TOKENS_PER_MESSAGE * request.message_count();
    let goal = threshold.saturating_sub(overhead);
    // Enough text for the goal at any plausible density; if the text is longer and still
    // counts below the goal, the whole text is counted.
    let limit = goal.saturating_add(1).saturating_mul(16);
    let text = request.prefix_text(limit);
    let mut count = tokenizer.count_up_to(&text, goal);
    if count.complete && text.chars().count() >= limit {
        count = tokenizer.count_up_to(&request.prefix_text(usize::MAX), goal);
    }
    Count {
        tokens: count.tokens + overhead,
        complete: count.complete,
    }
}

/// What the prefill strategies read from the request: the session, and PREFIX_AWARE's key
/// (the prefix-aware id and the prefill variant's PrefixLength of the prompt).
fn prefill_key(
    variant: &VariantRoute,
    pd: &Disaggregation,
    routing: &RoutingHeaders,
    request: &OpenAiRequest<'_>,
) -> PrefillKey {
    let prefix = match pd.prefill_strategy {
        PrefillRoutingStrategy::PrefixAware => {
            let id = routing.prefix_aware_id.as_deref().unwrap_or("").as_bytes();
            routing_key(id, request.prefix_text(variant.prefix_length).as_bytes())
        }
        _ => 0,
    };
    PrefillKey {
        session: routing.session,
        prefix,
    }
}

/// Ranks the prefill pool by the configured strategy (KV_AWARE as LEAST_OUTSTANDING_REQUESTS,
/// until [`settle_disaggregation`] ranks it by the pool's KV index).
fn rank_prefill(
    variant: &VariantRoute,
    pd: &Disaggregation,
    key: &PrefillKey,
    random: u64,
) -> rank::Ranking {
    let views = variant.current_views(switchyard_process::clock::unix_ms());
    let load = |index: usize| variant.instances[index].cell.fleet_load();
    let round_robin = || {
        let turn = pd
            .next_prefill
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        round_robin(&views, turn)
    };
    match pd.prefill_strategy {
        PrefillRoutingStrategy::RoundRobin => round_robin(),
        PrefillRoutingStrategy::Session => match key.session {
            Some(session) => rank::session(&views, session),
            None => round_robin(),
        },
        PrefillRoutingStrategy::PrefixAware => variant.rank_prefix(&views, key.prefix),
        PrefillRoutingStrategy::KvAware => {
            rank::rank(Strategy::LeastOutstandingRequests, &views, load, 0, random)
        }
    }
}

/// Ranks the decode pool by the configured strategy (its own PREFIX_AWARE config when asked).
fn rank_decoders(
    variant: &VariantRoute,
    strategy: DecodeRoutingStrategy,
    routing: &RoutingHeaders,
    openai: Option<(&OpenAiRequest<'_>, TextRule)>,
    body: &[u8],
    random: u64,
) -> rank::Ranking {
    let views = variant.current_views(switchyard_process::clock::unix_ms());
    let load = |index: usize| variant.instances[index].cell.fleet_load();
    match strategy {
        DecodeRoutingStrategy::LeastOutstandingRequests => {
            rank::rank(Strategy::LeastOutstandingRequests, &views, load, 0, random)
        }
        DecodeRoutingStrategy::Random => rank::rank(Strategy::Random, &views, load, 0, random),
        DecodeRoutingStrategy::PrefixAware => {
            let without_session = RoutingHeaders {
                prefix_aware_id: routing.prefix_aware_id.clone(),
                session: None,
                target_variant: None,
            };
            rank_instances(variant, &without_session, openai, body, random).0
        }
    }
}

/// Round robin over the available instances (then the ejected ones), starting at `turn`.
fn round_robin(views: &[rank::InstanceView], turn: usize) -> rank::Ranking {
    let count = views.len().max(1);
    let start = turn % count;
    let rotated = (0..views.len()).map(|offset| (start + offset) % count);
    let (mut order, ejected): (Vec<usize>, Vec<usize>) =
        rotated.partition(|&index| views[index].available);
    order.extend(ejected);
    rank::Ranking {
        order,
        route: Some(Route::Random),
    }
}

/// How a KV_AWARE request gets its token ids: OpenAI bodies by their API; a native body as a
/// chat request if it is a JSON object with `messages`, as a completions request if it has
/// `prompt`, else not at all (routed by load).
fn kv_input(operation: Operation, body: &[u8]) -> KvInput {
    let tokens = match operation {
        Operation::ChatCompletions => PromptTokens::of(PromptKind::Chat, body),
        Operation::Completions => PromptTokens::of(PromptKind::Completion, body),
        Operation::Invocations | Operation::InvocationsStream => PromptTokens::of_native(body),
        _ => Err(TokenizeError::Input(format!(
            "{operation:?} requests are routed by load under KV_AWARE"
        ))),
    };
    match tokens {
        Ok(tokens) => KvInput::Tokens(tokens),
        Err(err) => KvInput::Unusable(err),
    }
}

/// The target variant if one is named, else one drawn by weight among those with instances.
fn choose_variant(
    endpoint: &EndpointRoute,
    target: Option<&str>,
    random: u64,
) -> Result<usize, ApiError> {
    let index = match target {
        Some(name) => endpoint.variant(name).ok_or_else(|| {
            ApiError::validation(format!(
                "header {TARGET_VARIANT}: endpoint {} has no variant {name}",
                endpoint.name
            ))
        })?,
        None => {
            let servable: Vec<bool> = endpoint
                .variants
                .iter()
                .map(|variant| !variant.instances.is_empty())
                .collect();
            rank::choose_variant(&endpoint.weights, &servable, random).ok_or_else(|| {
                ApiError::unavailable(format!(
                    "endpoint {} has no healthy instance",
                    endpoint.name
                ))
            })?
        }
    };
    let variant = &endpoint.variants[index];
    if variant.instances.is_empty() {
        return Err(ApiError::unavailable(format!(
            "variant {} of endpoint {} has no healthy instance",
            variant.name, endpoint.name
        )));
    }
    Ok(index)
}

/// Ranks the variant's instances: a session sticks to its instance; PREFIX_AWARE hashes the
/// prefix-aware id and the prefix; the other strategies read load and `random` (KV_AWARE as
/// LEAST_OUTSTANDING_REQUESTS, until `handle` ranks it by the KV index). With the ranking,
/// PREFIX_AWARE's routing key.
fn rank_instances(
    variant: &VariantRoute,
    routing: &RoutingHeaders,
    openai: Option<(&OpenAiRequest<'_>, TextRule)>,
    body: &[u8],
    random: u64,
) -> (rank::Ranking, Option<u64>) {
    let views = variant.current_views(switchyard_process::clock::unix_ms());
    let load = |index: usize| variant.instances[index].cell.fleet_load();
    match (routing.session, variant.strategy) {
        (Some(session), _) => (rank::session(&views, session), None),
        (None, Strategy::PrefixAware { .. }) => {
            let id = routing.prefix_aware_id.as_deref().unwrap_or("").as_bytes();
            let key = match openai {
                Some((request, rule)) => routing_key(
                    id,
                    request
                        .prefix_text_for(rule, variant.prefix_length)
                        .as_bytes(),
                ),
                None => routing_key(id, native(body, variant.prefix_length)),
            };
            (variant.rank_prefix(&views, key), Some(key))
        }
        (None, strategy) => (rank::rank(strategy, &views, load, 0, random), None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::membership::Membership;
    use arc_swap::ArcSwap;

    /// Endpoint `chat`: variant `a` (PREFIX_AWARE, PrefixLength 1024, threshold 2, ModelName
    /// `m-a`, 3 instances), variant `b` (RANDOM, ModelName `m-b`, 1 instance) and variant `k`
    /// (KV_AWARE, ModelName `m-k`, 2 instances), `b` and `k` with weight 0.
    fn table() -> RoutingTable {
        let yaml = r#"
Endpoints:
  - EndpointName: chat
    ProductionVariants:
      - VariantName: a
        ModelName: m-a
        RoutingConfig:
          RoutingStrategy: PREFIX_AWARE
          PrefixAwareRoutingConfig: {PrefixLength: 1024, ConcurrencyThreshold: 2}
      - VariantName: b
        ModelName: m-b
        InitialVariantWeight: 0
      - VariantName: k
        ModelName: m-k
        InitialVariantWeight: 0
        RoutingConfig: {RoutingStrategy: KV_AWARE}
    Instances:
      - {Url: "http://127.0.0.1:1", InstanceId: a1, VariantName: a}
      - {Url: "http://127.0.0.1:2", InstanceId: a2, VariantName: a}
      - {Url: "http://127.0.0.1:3", InstanceId: a3, VariantName: a}
      - {Url: "http://127.0.0.1:4", InstanceId: b1, VariantName: b}
      - {Url: "http://127.0.0.1:5", InstanceId: k1, VariantName: k}
      - {Url: "http://127.0.0.1:6", InstanceId: k2, VariantName: k}
"#;
        let config = crate::membership::parse_static_text(yaml, true).unwrap();
        let table = Arc::new(ArcSwap::from_pointee(RoutingTable::default()));
        Membership::new(Arc::default(), Arc::clone(&table)).load_static(config);
        RoutingTable::clone(&table.load())
    }

    fn chat(table: &RoutingTable) -> Option<Arc<EndpointRoute>> {
        table.endpoints.get("chat").cloned()
    }

    fn chat_body(model: &str, text: &str) -> Bytes {
        Bytes::from(
            serde_json::json!({"model": model, "messages": [{"role": "user", "content": text}]})
                .to_string(),
        )
    }

    fn first_choice(plan: &Plan) -> &str {
        plan.variant().instances[plan.ranking.order[0]].id.as_str()
    }

    #[test]
    fn same_prefix_different_suffix_same_instance_and_the_suffix_is_ignored() {
        let table = table();
        let prefix = "p".repeat(1024);
        let plan = |suffix: &str| {
            make_plan(
                &table,
                Operation::ChatCompletions,
                chat(&table),
                &http::Uri::from_static("/"),
                &HeaderMap::new(),
                chat_body("m-a", &format!("{prefix}{suffix}")),
                &Tokenizers::new(None),
                &mut fastrand::Rng::with_seed(7),
            )
            .unwrap()
        };
        let first = plan("one ending");
        let second = plan("a different, longer ending");
        assert_eq!(first.ranking.route, Some(Route::Prefix));
        assert_eq!(first.ranking.order, second.ranking.order);
        // A different prefix is ranked on its own hash: over a few, not all land alike.
        let orders: std::collections::HashSet<Vec<usize>> = (0..8)
            .map(|index| {
                make_plan(
                    &table,
                    Operation::ChatCompletions,
                    chat(&table),
                    &http::Uri::from_static("/"),
                    &HeaderMap::new(),
                    chat_body("m-a", &format!("{index}{prefix}")),
                    &Tokenizers::new(None),
                    &mut fastrand::Rng::with_seed(7),
                )
                .unwrap()
                .ranking
                .order
            })
            .collect();
        assert!(orders.len() > 1, "every prefix ranked alike: {orders:?}");
    }

    #[test]
    fn a_plain_v1_model_picks_endpoint_variant_and_model_name() {
        let table = table();
        let plan = make_plan(
            &table,
            Operation::ChatCompletions,
            None,
            &http::Uri::from_static("/"),
            &HeaderMap::new(),
            chat_body("m-b", "hello"),
            &Tokenizers::new(None),
            &mut fastrand::Rng::with_seed(1),
        )
        .unwrap();
        assert_eq!(plan.variant().name.as_str(), "b", "ModelName m-b selects b");
        assert_eq!(first_choice(&plan), "b1");
        // The endpoint's name picks by weight (b has weight 0), and the engine sees m-a.
        let plan = make_plan(
            &table,
            Operation::ChatCompletions,
            None,
            &http::Uri::from_static("/"),
            &HeaderMap::new(),
            chat_body("chat", "hello"),
            &Tokenizers::new(None),
            &mut fastrand::Rng::with_seed(1),
        )
        .unwrap();
        assert_eq!(plan.variant().name.as_str(), "a");
        let sent: serde_json::Value = serde_json::from_slice(&plan.body).unwrap();
        assert_eq!(sent["model"], "m-a");
    }

    #[test]
    fn bad_input_is_refused_with_the_field_named() {
        let table = table();
        let plan = |operation, endpoint, headers: &HeaderMap, body: &str| {
            make_plan(
                &table,
                operation,
                endpoint,
                &http::Uri::from_static("/"),
                headers,
                Bytes::from(body.to_owned()),
                &Tokenizers::new(None),
                &mut fastrand::Rng::with_seed(1),
            )
        };
        let no_model = plan(
            Operation::ChatCompletions,
            None,
            &HeaderMap::new(),
            r#"{"messages":[]}"#,
        )
        .unwrap_err();
        assert_eq!(no_model.param, Some("model"));
        let unknown = plan(
            Operation::Completions,
            None,
            &HeaderMap::new(),
            r#"{"model":"nope","prompt":"x"}"#,
        )
        .unwrap_err();
        assert_eq!(unknown.status, http::StatusCode::NOT_FOUND);
        let mut headers = HeaderMap::new();
        headers.insert(TARGET_VARIANT, "c".parse().unwrap());
        let wrong_variant = plan(Operation::Invocations, chat(&table), &headers, "{}").unwrap_err();
        assert!(
            wrong_variant.message.contains("no variant c"),
            "{wrong_variant:?}"
        );
        let mut headers = HeaderMap::new();
        headers.insert(PREFIX_AWARE_ID, "x".repeat(65).parse().unwrap());
        let long_id = plan(Operation::Invocations, chat(&table), &headers, "{}").unwrap_err();
        assert!(long_id.message.contains("1-64"), "{long_id:?}");
        let not_json = plan(
            Operation::ChatCompletions,
            chat(&table),
            &HeaderMap::new(),
            "{",
        )
        .unwrap_err();
        assert!(not_json.message.contains("not valid JSON"));
    }

    #[test]
    fn native_bodies_route_on_their_first_bytes_and_stay_untouched() {
        let table = table();
        let mut headers = HeaderMap::new();
        headers.insert(TARGET_VARIANT, "a".parse().unwrap());
        let prefix = "n".repeat(1024);
        let plan = |body: String| {
            make_plan(
                &table,
                Operation::Invocations,
                chat(&table),
                &http::Uri::from_static("/"),
                &headers,
                Bytes::from(body),
                &Tokenizers::new(None),
                &mut fastrand::Rng::with_seed(3),
            )
            .unwrap()
        };
        let first = plan(format!("{prefix}-one"));
        let second = plan(format!("{prefix}-two"));
        assert_eq!(first.ranking.order, second.ranking.order);
        assert_eq!(&second.body[..], format!("{prefix}-two").as_bytes());
    }

    fn plan_at(
        table: &RoutingTable,
        operation: Operation,
        endpoint: Option<Arc<EndpointRoute>>,
        uri: &str,
        body: &str,
    ) -> Result<Plan, ApiError> {
        make_plan(
            table,
            operation,
            endpoint,
            &uri.parse().unwrap(),
            &HeaderMap::new(),
            Bytes::from(body.to_owned()),
            &Tokenizers::new(None),
            &mut fastrand::Rng::with_seed(5),
        )
    }

    #[test]
    fn a_disaggregated_endpoint_drops_a_clients_kv_transfer_params_on_every_path() {
        let yaml = r#"
Endpoints:
  - EndpointName: pd
    ProductionVariants:
      - {VariantName: prefill, ModelName: m}
      - {VariantName: decode, ModelName: m}
    DisaggregationConfig: {PrefillVariantName: prefill, DecodeVariantName: decode, RouteThreshold: 16}
    Instances:
      - {Url: "http://127.0.0.1:1", InstanceId: p1, VariantName: prefill, Role: prefill}
      - {Url: "http://127.0.0.1:2", InstanceId: d1, VariantName: decode, Role: decode}
"#;
        let config = crate::membership::parse_static_text(yaml, true).unwrap();
        let shared = Arc::new(ArcSwap::from_pointee(RoutingTable::default()));
        Membership::new(Arc::default(), Arc::clone(&shared)).load_static(config);
        let table = RoutingTable::clone(&shared.load());
        let pd = table.endpoints.get("pd").cloned();
        let body = |prompt: &str| {
            format!(
                r#"{{"model":"m","kv_transfer_para\u006ds":{{"do_remote_prefill":true}},"prompt":"{prompt}","kv_transfer_params":{{"remote_engine_id":"x"}}}}"#
            )
        };
        let no_params = |body: &[u8]| {
            let value: serde_json::Value = serde_json::from_slice(body).unwrap();
            assert!(value.get("kv_transfer_params").is_none(), "{value}");
            value
        };
        let short = plan_at(&table, Operation::Completions, pd.clone(), "/", &body("hi")).unwrap();
        assert!(short.disaggregated.is_none());
        assert_eq!(no_params(&short.body)["prompt"], "hi");
        let long = "hello ".repeat(20);
        let plan = plan_at(
            &table,
            Operation::Completions,
            pd.clone(),
            "/",
            &body(&long),
        )
        .unwrap();
        no_params(&plan.body);
        let copy = plan.disaggregated.unwrap().prefill_body.unwrap();
        let copy: serde_json::Value = serde_json::from_slice(&copy).unwrap();
        assert_eq!(copy["kv_transfer_params"]["do_remote_decode"], true);
        assert!(copy["kv_transfer_params"]["remote_engine_id"].is_null());
        // A Responses follow-up, to the decoder holding the response.
        let wrapped = response_ids::wrap("pd", "decode", "d1", "resp_engine");
        let follow_up = format!(
            r#"{{"input":"x","kv_transfer_params":{{"do_remote_prefill":true}},"previous_response_id":"{wrapped}"}}"#
        );
        let plan = plan_at(&table, Operation::Responses, pd, "/", &follow_up).unwrap();
        assert_eq!(no_params(&plan.body)["previous_response_id"], "resp_engine");
    }

    #[test]
    fn a_follow_up_goes_to_the_holder_even_past_the_threshold() {
        let table = table();
        let wrapped = response_ids::wrap("chat", "a", "a2", "resp_engine");
        // a2 is far above ConcurrencyThreshold (2): the state lives there, so it still wins.
        let endpoint = chat(&table).unwrap();
        endpoint.variants[0].instances[1]
            .cell
            .local
            .store(50, std::sync::atomic::Ordering::Relaxed);
        let body =
            format!(r#"{{"model":"chat","input":"and then?","previous_response_id":"{wrapped}"}}"#);
        for endpoint in [None, chat(&table)] {
            let plan = plan_at(
                &table,
                Operation::Responses,
                endpoint,
                "/v1/responses",
                &body,
            )
            .unwrap();
            assert_eq!(plan.ranking.route, Some(Route::Response));
            assert_eq!(
                plan.ranking.order.len(),
                1,
                "the holder is the only candidate"
            );
            assert_eq!(first_choice(&plan), "a2");
            assert_eq!(plan.path.as_deref(), Some("/v1/responses"));
            let sent: serde_json::Value = serde_json::from_slice(&plan.body).unwrap();
            assert_eq!(sent["previous_response_id"], "resp_engine");
            assert_eq!(sent["model"], "m-a");
        }
        // On a plain path the id alone names the endpoint: `model` may be left out.
        let body = format!(r#"{{"input":"x","previous_response_id":"{wrapped}"}}"#);
        let plan = plan_at(&table, Operation::Responses, None, "/v1/responses", &body).unwrap();
        assert_eq!(first_choice(&plan), "a2");
    }

    #[test]
    fn a_response_whose_instance_left_is_not_found_never_elsewhere() {
        let table = table();
        let gone = response_ids::wrap("chat", "a", "a9", "resp_engine");
        let body = format!(r#"{{"model":"chat","input":"x","previous_response_id":"{gone}"}}"#);
        let error =
            plan_at(&table, Operation::Responses, None, "/v1/responses", &body).unwrap_err();
        assert_eq!(error.status, http::StatusCode::NOT_FOUND);
        assert_eq!(error.openai_code, "response_not_found");
        assert_eq!(error.param, Some("previous_response_id"));
        assert!(error.message.contains("instance a9"), "{error:?}");
        for operation in [Operation::ResponseRetrieve, Operation::ResponseDelete] {
            let error = plan_at(
                &table,
                operation,
                None,
                &format!("/v1/responses/{gone}"),
                "",
            )
            .unwrap_err();
            assert_eq!(error.openai_code, "response_not_found");
            assert_eq!(error.param, Some("response_id"));
        }
        // An id no router made, an endpoint that is gone, another endpoint's response.
        let not_ours = plan_at(
            &table,
            Operation::ResponseRetrieve,
            None,
            "/v1/responses/resp_0123abcd",
            "",
        )
        .unwrap_err();
        assert!(not_ours.message.contains("not issued"), "{not_ours:?}");
        let other = response_ids::wrap("other", "a", "a1", "resp_engine");
        let error = plan_at(
            &table,
            Operation::ResponseRetrieve,
            None,
            &format!("/v1/responses/{other}"),
            "",
        )
        .unwrap_err();
        assert!(error.message.contains("no longer exists"), "{error:?}");
        let error = plan_at(
            &table,
            Operation::ResponseCancel,
            chat(&table),
            &format!("/endpoints/chat/openai/v1/responses/{other}/cancel"),
            "",
        )
        .unwrap_err();
        assert!(
            error.message.contains("belongs to endpoint other"),
            "{error:?}"
        );
    }

    #[test]
    fn retrieve_delete_and_cancel_go_to_the_holder_with_the_engines_id() {
        let table = table();
        let wrapped = response_ids::wrap("chat", "b", "b1", "resp_x/y");
        let retrieve = plan_at(
            &table,
            Operation::ResponseRetrieve,
            None,
            &format!("/v1/responses/{wrapped}?stream=true&starting_after=3"),
            "ignored",
        )
        .unwrap();
        assert_eq!(first_choice(&retrieve), "b1");
        assert_eq!(retrieve.ranking.route, Some(Route::Response));
        assert_eq!(
            retrieve.path.as_deref(),
            Some("/v1/responses/resp_x%2Fy?stream=true&starting_after=3")
        );
        assert!(retrieve.body.is_empty(), "GET sends no body");
        let cancel = plan_at(
            &table,
            Operation::ResponseCancel,
            chat(&table),
            &format!("/endpoints/chat/openai/v1/responses/{wrapped}/cancel"),
            "{}",
        )
        .unwrap();
        assert_eq!(
            cancel.path.as_deref(),
            Some("/v1/responses/resp_x%2Fy/cancel")
        );
        assert_eq!(&cancel.body[..], b"{}");
    }

    #[test]
    fn embeddings_route_on_their_input_and_keep_their_path() {
        let table = table();
        let prefix = "e".repeat(1024);
        let plan = |input: String| {
            plan_at(
                &table,
                Operation::Embeddings,
                None,
                "/v1/embeddings",
                &serde_json::json!({"model": "chat", "input": input}).to_string(),
            )
            .unwrap()
        };
        let first = plan(format!("{prefix} one"));
        let second = plan(format!("{prefix} two, longer"));
        assert_eq!(first.ranking.route, Some(Route::Prefix));
        assert_eq!(first.ranking.order, second.ranking.order);
        assert_eq!(first.path.as_deref(), Some("/v1/embeddings"));
        let others: std::collections::HashSet<Vec<usize>> = (0..8)
            .map(|index| plan(format!("{index}{prefix}")).ranking.order)
            .collect();
        assert!(others.len() > 1, "{others:?}");
    }

    #[test]
    fn kv_aware_plans_say_how_to_get_the_tokens_and_rank_by_load_meanwhile() {
        let table = table();
        let plan = |operation, headers: &HeaderMap, body: &str| {
            make_plan(
                &table,
                operation,
                chat(&table),
                &"/v1/chat/completions".parse().unwrap(),
                headers,
                Bytes::from(body.to_owned()),
                &Tokenizers::new(None),
                &mut fastrand::Rng::with_seed(5),
            )
            .unwrap()
        };
        let mut to_k = HeaderMap::new();
        to_k.insert(TARGET_VARIANT, "k".parse().unwrap());
        let ask = |plan: &Plan| -> serde_json::Value {
            match &plan.kv {
                Some(KvInput::Tokens(PromptTokens::Ask(body))) => {
                    serde_json::from_slice(body).unwrap()
                }
                other => panic!("expected a /tokenize body, got {other:?}"),
            }
        };
        // Chat: the engine is asked with the messages and the variant's ModelName.
        let chat_plan = plan(
            Operation::ChatCompletions,
            &to_k,
            r#"{"model":"chat","messages":[{"role":"user","content":"hi"}],"max_tokens":3}"#,
        );
        assert_eq!(chat_plan.variant().name.as_str(), "k");
        assert_eq!(chat_plan.ranking.route, Some(rank::Route::LeastOutstanding));
        assert_eq!(chat_plan.ranking.order.len(), 2);
        assert_eq!(
            ask(&chat_plan),
            serde_json::json!({"model": "m-k", "messages": [{"role": "user", "content": "hi"}]})
        );
        assert!(chat_plan.cached_tokens.is_empty());
        // A token-id prompt needs no round trip.
        let ids = plan(
            Operation::Completions,
            &to_k,
            r#"{"model":"m-k","prompt":[1,2,3]}"#,
        );
        assert!(matches!(
            ids.kv,
            Some(KvInput::Tokens(PromptTokens::Known(ref ids))) if ids == &[1, 2, 3]
        ));
        // Native bodies: `messages` is a chat, `prompt` a completion, anything else by load.
        let native_chat = plan(
            Operation::Invocations,
            &to_k,
            r#"{"messages":[{"role":"user","content":"x"}]}"#,
        );
        assert!(ask(&native_chat).get("messages").is_some());
        let native_prompt = plan(Operation::Invocations, &to_k, r#"{"prompt":"x y"}"#);
        assert_eq!(ask(&native_prompt), serde_json::json!({"prompt": "x y"}));
        let opaque = plan(Operation::InvocationsStream, &to_k, "raw text");
        assert!(matches!(opaque.kv, Some(KvInput::Unusable(_))));
        assert_eq!(
            &opaque.body[..],
            b"raw text",
            "native bodies stay untouched"
        );
        // A session sticks to its instance: no KV ranking.
        let mut session = to_k.clone();
        session.insert(SESSION_ID, "s-1".parse().unwrap());
        let sticky = plan(Operation::Completions, &session, r#"{"prompt":"x"}"#);
        assert!(sticky.kv.is_none());
        assert_eq!(sticky.ranking.route, Some(rank::Route::Session));
        // Other strategies have nothing to fetch.
        let prefix = plan(
            Operation::ChatCompletions,
            &HeaderMap::new(),
            r#"{"model":"m-a","messages":[]}"#,
        );
        assert!(prefix.kv.is_none());
    }

    /// Endpoint `pd`: prefill `p1`, `p2`, decode `d1`, `d2`, with `disaggregation` (YAML).
    fn pd_table(disaggregation: &str) -> RoutingTable {
        let yaml = format!(
            r#"
Endpoints:
  - EndpointName: pd
    ProductionVariants:
      - {{VariantName: prefill, ModelName: m}}
      - {{VariantName: decode, ModelName: m}}
    DisaggregationConfig: {disaggregation}
    Instances:
      - {{Url: "http://127.0.0.1:1", InstanceId: p1, VariantName: prefill, Role: prefill}}
      - {{Url: "http://127.0.0.1:2", InstanceId: p2, VariantName: prefill, Role: prefill}}
      - {{Url: "http://127.0.0.1:3", InstanceId: d1, VariantName: decode, Role: decode}}
      - {{Url: "http://127.0.0.1:4", InstanceId: d2, VariantName: decode, Role: decode}}
"#
        );
        let config = crate::membership::parse_static_text(&yaml, true).unwrap();
        let table = Arc::new(ArcSwap::from_pointee(RoutingTable::default()));
        Membership::new(Arc::default(), Arc::clone(&table)).load_static(config);
        RoutingTable::clone(&table.load())
    }

    #[test]
    fn kv_aware_prefill_and_uncached_tokens_wait_for_the_token_ids() {
        let long = || {
            Bytes::from(
                serde_json::json!({"model": "pd", "prompt": "word ".repeat(300)}).to_string(),
            )
        };
        let plan = |table: &RoutingTable, body: Bytes| {
            make_plan(
                table,
                Operation::Completions,
                None,
                &"/v1/completions".parse().unwrap(),
                &HeaderMap::new(),
                body,
                &Tokenizers::new(None),
                &mut fastrand::Rng::with_seed(5),
            )
            .unwrap()
        };
        // PROMPT_TOKENS with a KV_AWARE prefill pool: decided now, the prefill pool ranked by
        // load until the token ids come.
        let kv_prefill = pd_table(
            "{PrefillVariantName: prefill, DecodeVariantName: decode, RouteThreshold: 100, PrefillRoutingStrategy: KV_AWARE}",
        );
        let decided = plan(&kv_prefill, long());
        assert_eq!(decided.label, RouteLabel::Disaggregated);
        let prefill = decided.disaggregated.as_ref().expect("disaggregated");
        assert_eq!(prefill.prefill.route, Some(Route::LeastOutstanding));
        let dpd = decided.dpd.as_ref().expect("token ids wanted");
        assert!(dpd.undecided.is_none());
        assert!(matches!(dpd.input, KvInput::Tokens(PromptTokens::Ask(_))));
        // A short prompt goes direct with nothing to fetch.
        let short = plan(
            &kv_prefill,
            Bytes::from_static(br#"{"model":"pd","prompt":"hi"}"#),
        );
        assert_eq!(short.label, RouteLabel::Direct);
        assert!(short.dpd.is_none());

        // UNCACHED_TOKENS: undecided (direct meanwhile), with the router's own count kept.
        let uncached = pd_table(
            "{PrefillVariantName: prefill, DecodeVariantName: decode, RouteThreshold: 100, ThresholdBasis: UNCACHED_TOKENS}",
        );
        let mut undecided = plan(&uncached, long());
        assert_eq!(undecided.label, RouteLabel::Direct);
        assert!(undecided.disaggregated.is_none());
        let dpd = undecided.dpd.take().expect("token ids wanted");
        let count = dpd.undecided.expect("undecided");
        assert!(count.tokens >= 100, "{count:?}");
        // Without token ids every counted token is uncached: disaggregated, round robin.
        settle_disaggregation(
            &mut undecided,
            dpd.undecided,
            &dpd.prefill_key,
            None,
            PoolIndexes::default(),
            0,
            1,
        );
        assert_eq!(undecided.label, RouteLabel::Disaggregated);
        assert!(undecided.cached_tokens.is_empty());
        assert_eq!(
            undecided.disaggregated.expect("disaggregated").count.tokens,
            count.tokens
        );
        // With token ids (and no index yet), their number is the count: 99 is direct, and
        // RouteThreshold (100) exactly is enough.
        for (count, label) in [(99, RouteLabel::Direct), (100, RouteLabel::Disaggregated)] {
            let mut ids = plan(&uncached, long());
            let dpd = ids.dpd.take().expect("token ids wanted");
            let tokens: Vec<u32> = (0..count).collect();
            settle_disaggregation(
                &mut ids,
                dpd.undecided,
                &dpd.prefill_key,
                Some(&tokens),
                PoolIndexes::default(),
                0,
                1,
            );
            assert_eq!(ids.label, label);
            assert_eq!(ids.explain[0].1, count.to_string());
        }
    }

    #[test]
    fn a_prefix_aware_prefill_pool_is_keyed_by_the_prompt() {
        let yaml = r#"
Endpoints:
  - EndpointName: pd
    ProductionVariants:
      - VariantName: prefill
        ModelName: m
        RoutingConfig:
          RoutingStrategy: PREFIX_AWARE
          PrefixAwareRoutingConfig: {PrefixLength: 1024, ConcurrencyThreshold: 10}
      - {VariantName: decode, ModelName: m}
    DisaggregationConfig: {PrefillVariantName: prefill, DecodeVariantName: decode, RouteThreshold: 16, PrefillRoutingStrategy: PREFIX_AWARE}
    Instances:
      - {Url: "http://127.0.0.1:1", InstanceId: p1, VariantName: prefill, Role: prefill}
      - {Url: "http://127.0.0.1:2", InstanceId: p2, VariantName: prefill, Role: prefill}
      - {Url: "http://127.0.0.1:3", InstanceId: d1, VariantName: decode, Role: decode}
"#;
        let config = crate::membership::parse_static_text(yaml, true).unwrap();
        let shared = Arc::new(ArcSwap::from_pointee(RoutingTable::default()));
        Membership::new(Arc::default(), Arc::clone(&shared)).load_static(config);
        let table = RoutingTable::clone(&shared.load());
        let prefill_of = |topic: usize| {
            let prompt = format!("topic {topic}: {}", "word ".repeat(40));
            let body = serde_json::json!({"model": "m", "prompt": prompt}).to_string();
            let plan = plan_at(&table, Operation::Completions, None, "/", &body).unwrap();
            let endpoint = Arc::clone(&plan.endpoint);
            let prefill = plan.disaggregated.expect("disaggregated").prefill;
            assert_eq!(prefill.route, Some(Route::Prefix));
            endpoint.variants[0].instances[prefill.order[0]]
                .id
                .to_string()
        };
        let chosen: Vec<String> = (0..16).map(prefill_of).collect();
        // The same prompt, the same prefill instance; different ones spread (all 16 on one
        // instance: 2^-15 for a fair hash).
        assert_eq!(chosen, (0..16).map(prefill_of).collect::<Vec<_>>());
        assert!(chosen.iter().any(|id| id == "p1") && chosen.iter().any(|id| id == "p2"));
    }

    #[test]
    fn a_chat_counts_its_template_and_a_dense_start_does_not_cut_the_count() {
        let tokenizer = Tokenizers::new(None).get("cl100k_base");
        let count = |body: serde_json::Value, threshold: usize| {
            let body = body.to_string();
            count_prompt(
                &OpenAiRequest::parse(body.as_bytes()).unwrap(),
                &tokenizer,
                threshold,
            )
        };
        let text = format!("hello{}", " hello".repeat(11));
        let plain = count(serde_json::json!({"prompt": text}), 100);
        assert_eq!(
            plain,
            Count {
                tokens: 12,
                complete: true
            }
        );
        // A chat: its text as the router reads it, plus the template's tokens per message.
        let chat = serde_json::json!({"messages": [{"role": "user", "content": text}]}).to_string();
        let request = OpenAiRequest::parse(chat.as_bytes()).unwrap();
        let text_tokens = tokenizer.count(&request.prefix_text(usize::MAX));
        assert!(text_tokens >= 12, "{text_tokens}");
        assert_eq!(
            count_prompt(&request, &tokenizer, 100),
            Count {
                tokens: text_tokens + CHAT_TOKENS_PER_MESSAGE,
                complete: true
            }
        );
        // A start that packs many characters into each token, then ordinary words: the count
        // reads past the first window of text and reaches the threshold.
        let dense = format!("{}{}", "=".repeat(400), " hello".repeat(40));
        let tokens = tokenizer.count(&"=".repeat(400));
        assert!(
            tokens < 10,
            "{tokens} tokens: not dense enough for this test"
        );
        let counted = count(serde_json::json!({"prompt": dense}), 10);
        assert!(counted.tokens >= 10, "{counted:?}");
    }
}
