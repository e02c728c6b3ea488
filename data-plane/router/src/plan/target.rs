//! Where a request goes, before any ranking: its endpoint and variant (or a disaggregated
//! endpoint's two pools), or the one instance holding the stored response it is about. What
//! routing reads from the request is read here once: the routing headers, checked, and an
//! OpenAI body, parsed (borrowed, `policy::openai`).
//!
//! Response affinity (the Responses API): a request about a stored response (a follow-up with
//! `previous_response_id`, or `/v1/responses/{id}` and its `cancel`) goes to the instance
//! holding it, found from the wrapped id alone (`respond::response_ids`): endpoint, variant and
//! instance come from the id, the instance is the only candidate (ahead of any
//! ConcurrencyThreshold), and if it is not routable now the answer is 404
//! `response_not_found`, never another instance.

use std::borrow::Cow;
use std::sync::Arc;

use http::header::{HeaderMap, HeaderName};
use switchyard_policy::hash::session_key;
use switchyard_policy::openai::{OpenAiRequest, RequestError};
use switchyard_policy::prefix::valid_prefix_aware_id;
use switchyard_policy::rank;

use crate::errors::{Api, ApiError};
use crate::headers::{PREFIX_AWARE_ID, SESSION_ID, TARGET_VARIANT};
use crate::operation::Operation;
use crate::respond::response_ids::{self, StoredResponse};
use crate::routing::table::{EndpointRoute, RoutingTable, VariantRoute};

/// What routing reads from the headers, once checked.
#[derive(Debug, Default)]
pub(super) struct RoutingHeaders {
    pub prefix_aware_id: Option<String>,
    pub session: Option<u64>,
    pub target_variant: Option<String>,
}

/// Where the request goes, and what routing read from it on the way.
#[derive(Debug)]
pub(super) struct Target<'a> {
    pub endpoint: Arc<EndpointRoute>,
    pub routing: RoutingHeaders,
    /// The OpenAI body, parsed (None: a native body, or a request about a stored response).
    pub openai: Option<OpenAiRequest<'a>>,
    pub destination: Destination,
}

#[derive(Debug)]
pub(super) enum Destination {
    /// `/v1/responses/{id}[/cancel]`: the instance holding the response (indices into the
    /// endpoint), and the request's path there (the engine's id, the query).
    Stored {
        variant: usize,
        instance: usize,
        path: String,
    },
    /// A Responses follow-up: the instance holding the previous response, whose id the
    /// engine knows as `engine_id`.
    FollowUp {
        variant: usize,
        instance: usize,
        engine_id: String,
    },
    /// A disaggregated endpoint's request: its pools are the endpoint's `disaggregation`.
    Disaggregated,
    /// The variant (an index) named by the target-variant header or the `model`, or drawn by
    /// weight.
    Variant(usize),
}

/// Reads what routing needs from the headers and body and resolves where the request goes:
/// `endpoint` is the path's (`None` on the plain `/v1/...` paths, where the body's `model`,
/// or a response id, names it); `uri` is the request's (the response id of
/// `/v1/responses/{id}`, and its query, are read from it). Draws one number from `rng` when a
/// variant is chosen by weight.
pub(super) fn resolve<'a>(
    table: &RoutingTable,
    operation: Operation,
    mut endpoint: Option<Arc<EndpointRoute>>,
    uri: &http::Uri,
    headers: &HeaderMap,
    body: &'a [u8],
    rng: &mut fastrand::Rng,
) -> Result<Target<'a>, ApiError> {
    if operation.names_stored_response() {
        return stored_response(table, operation, endpoint, uri);
    }
    let mut routing = routing_headers(headers)?;
    let variant_named_by_header = routing.target_variant.is_some();
    // OpenAI bodies are parsed once: model, stream, prompt_cache_key, prefix text.
    let openai = match operation.api() {
        Api::OpenAi => Some(OpenAiRequest::parse(body).map_err(invalid_body)?),
        Api::Native => None,
    };
    // A Responses follow-up names the response it continues, and so its instance.
    let previous = match openai
        .as_ref()
        .and_then(|request| request.previous_response_id.as_deref())
    {
        Some(id) => Some(unwrap_id(id, "previous_response_id")?),
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
    let destination = match previous {
        // Affinity: the instance holding the previous response, whatever the strategy.
        Some(previous) => {
            let (variant, instance) = holder(&endpoint, &previous, "previous_response_id")?;
            Destination::FollowUp {
                variant,
                instance,
                engine_id: previous.engine_id,
            }
        }
        None if endpoint.disaggregation.is_some() => {
            if variant_named_by_header {
                return Err(ApiError::validation(format!(
                    "header {TARGET_VARIANT}: endpoint {} is disaggregated (prefill and decode \
                     variants), so a variant cannot be chosen",
                    endpoint.name
                )));
            }
            Destination::Disaggregated
        }
        None => Destination::Variant(choose_variant(
            &endpoint,
            routing.target_variant.as_deref(),
            openai.as_ref().and_then(|request| request.model.as_deref()),
            rng.u64(..),
        )?),
    };
    Ok(Target {
        endpoint,
        routing,
        openai,
        destination,
    })
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

fn invalid_body(err: RequestError) -> ApiError {
    match err {
        RequestError::Json(message) => {
            ApiError::validation(format!("the body is not valid JSON: {message}"))
        }
        RequestError::Field { field, message } => {
            ApiError::validation(format!("'{field}' {message}")).with_param(field)
        }
    }
}

/// `GET`/`DELETE /v1/responses/{id}` and `POST /v1/responses/{id}/cancel`: the instance the
/// id names, the engine's id in the path, the query passed on as it is.
fn stored_response<'a>(
    table: &RoutingTable,
    operation: Operation,
    endpoint: Option<Arc<EndpointRoute>>,
    uri: &http::Uri,
) -> Result<Target<'a>, ApiError> {
    let id = response_id_in_path(uri.path()).ok_or_else(|| {
        ApiError::validation("the path has no response id").with_param("response_id")
    })?;
    let stored = unwrap_id(id, "response_id")?;
    let endpoint = match endpoint {
        Some(endpoint) => endpoint,
        None => stored_endpoint(table, &stored, "response_id")?,
    };
    let (variant, instance) = holder(&endpoint, &stored, "response_id")?;
    let mut path = format!("/v1/responses/{}", percent_encode(&stored.engine_id));
    if operation == Operation::ResponseCancel {
        path.push_str("/cancel");
    }
    if let Some(query) = uri.query() {
        path.push('?');
        path.push_str(query);
    }
    Ok(Target {
        endpoint,
        routing: RoutingHeaders::default(),
        openai: None,
        destination: Destination::Stored {
            variant,
            instance,
            path,
        },
    })
}

/// Unwraps a response id a client sent (`param` names where it came from).
fn unwrap_id(id: &str, param: &'static str) -> Result<StoredResponse, ApiError> {
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

/// The `{id}` of `.../v1/responses/{id}[/cancel]`.
fn response_id_in_path(path: &str) -> Option<&str> {
    let (_, rest) = path.rsplit_once("/v1/responses/")?;
    let id = rest.split('/').next()?;
    (!id.is_empty()).then_some(id)
}

/// `text` with everything but RFC 3986's unreserved characters (less `.`) percent-encoded (an
/// engine's response id in a path).
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

/// The target variant if one is named, else one drawn by weight among those with instances.
/// The variant named by `target`, else one drawn by weight among those with instances; a
/// request naming one of the endpoint's LoRA adapters (`model`) only among the variants that
/// list it (a named variant that does not is refused).
fn choose_variant(
    endpoint: &EndpointRoute,
    target: Option<&str>,
    model: Option<&str>,
    random: u64,
) -> Result<usize, ApiError> {
    let adapter = model.filter(|_| {
        endpoint
            .variants
            .iter()
            .any(|variant| variant.adapter(model).is_some())
    });
    let serves = |variant: &VariantRoute| adapter.is_none() || variant.adapter(adapter).is_some();
    let index = match target {
        Some(name) => {
            let index = endpoint.variant(name).ok_or_else(|| {
                ApiError::validation(format!(
                    "header {TARGET_VARIANT}: endpoint {} has no variant {name}",
                    endpoint.name
                ))
            })?;
            if !serves(&endpoint.variants[index]) {
                return Err(ApiError::validation(format!(
                    "header {TARGET_VARIANT}: variant {name} of endpoint {} does not serve the \
                     LoRA adapter {} (it is not among its LoraAdapters)",
                    endpoint.name,
                    adapter.unwrap_or_default()
                ))
                .with_param("model"));
            }
            index
        }
        None => {
            let servable: Vec<bool> = endpoint
                .variants
                .iter()
                .map(|variant| !variant.instances.is_empty() && serves(variant))
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
