//! Planning a request: CPU only, no sockets. From the operation, the headers and the body,
//! resolve the endpoint and the variant, rank the variant's instances with the policy, and
//! rewrite `model` for the engine. Forwarding the plan is `forward`'s job.

use std::sync::Arc;

use bytes::Bytes;
use http::header::{HeaderMap, HeaderName};
use switchyard_policy::hash::{routing_key, session_key};
use switchyard_policy::openai::OpenAiRequest;
use switchyard_policy::prefix::{native, valid_prefix_aware_id};
use switchyard_policy::rank::{self, Strategy};

use crate::errors::{Api, ApiError};
use crate::table::{EndpointRoute, InstanceRoute, RoutingTable, VariantRoute};

pub const PREFIX_AWARE_ID: HeaderName = HeaderName::from_static("x-amzn-sagemaker-prefix-aware-id");
pub const TARGET_VARIANT: HeaderName = HeaderName::from_static("x-amzn-sagemaker-target-variant");
pub const SESSION_ID: HeaderName = HeaderName::from_static("x-amzn-sagemaker-session-id");

/// Which API a request came in on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Operation {
    Invocations,
    InvocationsStream,
    ChatCompletions,
    Completions,
}

impl Operation {
    pub fn api(self) -> Api {
        match self {
            Operation::Invocations | Operation::InvocationsStream => Api::Native,
            Operation::ChatCompletions | Operation::Completions => Api::OpenAi,
        }
    }

    /// The instance's URL for this operation.
    pub fn upstream(self, instance: &InstanceRoute) -> &http::Uri {
        match self {
            Operation::Invocations | Operation::InvocationsStream => &instance.invocations,
            Operation::ChatCompletions => &instance.chat_completions,
            Operation::Completions => &instance.completions,
        }
    }
}

/// A request ready to forward: where it may go, in order, and the body to send.
#[derive(Debug)]
pub struct Plan {
    pub endpoint: Arc<EndpointRoute>,
    pub variant_index: usize,
    pub ranking: rank::Ranking,
    pub body: Bytes,
}

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
/// variant, ranks the instances, and rewrites `model` for the engine.
pub fn make_plan(
    table: &RoutingTable,
    operation: Operation,
    mut endpoint: Option<Arc<EndpointRoute>>,
    headers: &HeaderMap,
    body: Bytes,
    rng: &mut fastrand::Rng,
) -> Result<Plan, ApiError> {
    let mut routing = routing_headers(headers)?;
    // OpenAI bodies are parsed once: model, stream, prompt_cache_key, prefix text.
    let openai = match operation.api() {
        Api::OpenAi => Some(parse_openai(&body)?),
        Api::Native => None,
    };
    if let Some(openai) = &openai {
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
    let variant_index = choose_variant(&endpoint, routing.target_variant.as_deref(), rng.u64(..))?;
    let variant = &endpoint.variants[variant_index];
    let ranking = rank_instances(variant, &routing, openai.as_ref(), &body, rng.u64(..));
    // The engine sees the variant's ModelName, whatever name the client used.
    let rewritten = match (&openai, &variant.model_name) {
        (Some(request), Some(model)) if request.model.as_deref() != Some(model.as_str()) => {
            Some(request.with_model(model))
        }
        _ => None,
    };
    drop(openai);
    Ok(Plan {
        body: rewritten.map(Bytes::from).unwrap_or(body),
        endpoint,
        variant_index,
        ranking,
    })
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
/// prefix-aware id and the prefix; the other strategies read load and `random`.
fn rank_instances(
    variant: &VariantRoute,
    routing: &RoutingHeaders,
    openai: Option<&OpenAiRequest<'_>>,
    body: &[u8],
    random: u64,
) -> rank::Ranking {
    let views = variant.current_views(crate::now_unix_ms());
    let load = |index: usize| variant.instances[index].cell.fleet_load();
    match (routing.session, variant.strategy) {
        (Some(session), _) => rank::session(&views, session),
        (None, Strategy::PrefixAware { .. }) => {
            let id = routing.prefix_aware_id.as_deref().unwrap_or("").as_bytes();
            let key = match openai {
                Some(request) => {
                    routing_key(id, request.prefix_text(variant.prefix_length).as_bytes())
                }
                None => routing_key(id, native(body, variant.prefix_length)),
            };
            rank::rank(variant.strategy, &views, load, key, 0)
        }
        (None, strategy) => rank::rank(strategy, &views, load, 0, random),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::membership::Membership;
    use arc_swap::ArcSwap;
    use switchyard_policy::rank::Route;

    /// Endpoint `chat`: variant `a` (PREFIX_AWARE, PrefixLength 1024, threshold 2, ModelName
    /// `m-a`, 3 instances) and variant `b` (RANDOM, ModelName `m-b`, 1 instance).
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
    Instances:
      - {Url: "http://127.0.0.1:1", InstanceId: a1, VariantName: a}
      - {Url: "http://127.0.0.1:2", InstanceId: a2, VariantName: a}
      - {Url: "http://127.0.0.1:3", InstanceId: a3, VariantName: a}
      - {Url: "http://127.0.0.1:4", InstanceId: b1, VariantName: b}
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
                &HeaderMap::new(),
                chat_body("m-a", &format!("{prefix}{suffix}")),
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
                    &HeaderMap::new(),
                    chat_body("m-a", &format!("{index}{prefix}")),
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
            &HeaderMap::new(),
            chat_body("m-b", "hello"),
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
            &HeaderMap::new(),
            chat_body("chat", "hello"),
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
                headers,
                Bytes::from(body.to_owned()),
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
                &headers,
                Bytes::from(body),
                &mut fastrand::Rng::with_seed(3),
            )
            .unwrap()
        };
        let first = plan(format!("{prefix}-one"));
        let second = plan(format!("{prefix}-two"));
        assert_eq!(first.ranking.order, second.ranking.order);
        assert_eq!(&second.body[..], format!("{prefix}-two").as_bytes());
    }
}
