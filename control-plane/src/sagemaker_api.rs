//! A SageMaker-compatible admin API over HTTP (`--sagemaker-api-listen`), so that boto3's
//! `sagemaker` client and `aws sagemaker … --endpoint-url` manage endpoint configs and
//! endpoints unchanged.
//!
//! It speaks the AWS JSON 1.1 protocol those clients use (botocore's `sagemaker` service
//! model): `POST /` with `X-Amz-Target: SageMaker.<Operation>` and a JSON body, answers in
//! `application/x-amz-json-1.1`, errors as `{"__type": code, "message": …}`. Operations:
//! Create/Describe/Delete/ListEndpointConfigs, Create/Update/Describe/Delete/ListEndpoints.
//! Every request goes through the same registry as the gRPC API, so validation and storage
//! are one implementation; this module only translates shapes and errors:
//!
//! - a missing name is SageMaker's `ValidationException` `Could not find endpoint
//!   "arn:…"` (or `endpoint configuration`), a duplicate create `Cannot create already
//!   existing endpoint configuration "arn:…"`; rule violations are `ValidationException`
//!   with the field named; a store outage `ServiceUnavailable` (503), write contention
//!   `ThrottlingException` (botocore retries both);
//! - request members SageMaker defines but Switchyard does not use (`DataCaptureConfig`,
//!   `KmsKeyId`, variant `VolumeSizeInGB`, …) are accepted, stored beside the config and given
//!   back by DescribeEndpointConfig; members the service does not define are refused;
//! - ARNs are `arn:aws:sagemaker:{region}:000000000000:…/{name in lower case}`, the region
//!   being the one the client signed for.
//!
//! Authentication: with an admin token, every request must carry a SigV4 signature made with
//! the token as the secret access key (any access key id); without one, signatures are not
//! checked, as the gRPC API is open then.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use http::{HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value, json};
use switchyard_proto::convert::{endpoint_config_name, endpoint_name};
use switchyard_shared::sagemaker::parse_production_variants_value;
use switchyard_shared::{
    EndpointConfig, EndpointConfigName, EndpointName, HealthCheckConfig, ValidationError,
};
use tokio::net::TcpListener;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::registry::{AdminError, Registry};
use crate::sigv4::{self, Authorization, SignatureError, Signed};

/// Largest request body accepted (a config with ten variants is a few KiB).
pub const MAX_BODY_BYTES: usize = 1 << 20;
/// How long a client may take to send its request head, and then its body.
const READ_TIMEOUT: Duration = Duration::from_secs(30);
/// The account id in ARNs.
pub const ACCOUNT_ID: &str = "000000000000";
/// The region in ARNs when the request does not name one (an unsigned request).
pub const DEFAULT_REGION: &str = "us-east-1";
const CONTENT_TYPE: &str = "application/x-amz-json-1.1";

/// The operations served, as `X-Amz-Target: SageMaker.<name>`.
pub const OPERATIONS: [&str; 9] = [
    "CreateEndpointConfig",
    "DescribeEndpointConfig",
    "DeleteEndpointConfig",
    "ListEndpointConfigs",
    "CreateEndpoint",
    "UpdateEndpoint",
    "DescribeEndpoint",
    "DeleteEndpoint",
    "ListEndpoints",
];

/// CreateEndpointConfig members Switchyard accepts, stores and gives back without using.
const UNUSED_CONFIG_MEMBERS: &[&str] = &[
    "DataCaptureConfig",
    "Tags",
    "KmsKeyId",
    "AsyncInferenceConfig",
    "ExplainerConfig",
    "ShadowProductionVariants",
    "ExecutionRoleArn",
    "VpcConfig",
    "EnableNetworkIsolation",
    "MetricsConfig",
    "CrossRegionTrafficConfig",
];
/// Of those, the ones DescribeEndpointConfig does not return (its output shape lacks them).
const NOT_DESCRIBED: &[&str] = &["Tags"];
/// The members of ListEndpointConfigs' input, which ListEndpoints' extends.
const LIST_MEMBERS: &[&str] = &[
    "SortBy",
    "SortOrder",
    "NextToken",
    "MaxResults",
    "NameContains",
    "CreationTimeBefore",
    "CreationTimeAfter",
];

/// An error in the AWS JSON protocol's shape.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AwsError {
    pub status: StatusCode,
    pub code: &'static str,
    pub message: String,
}

impl AwsError {
    fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            code,
            message: message.into(),
        }
    }

    fn validation(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "ValidationException", message)
    }

    fn field(err: ValidationError) -> Self {
        Self::validation(err.to_string())
    }

    fn response(&self, request_id: &str) -> Response<Full<Bytes>> {
        let body = json!({"__type": self.code, "message": self.message});
        let mut response = json_response(self.status, &body, request_id);
        if let Ok(code) = HeaderValue::from_str(self.code) {
            response.headers_mut().insert("x-amzn-errortype", code);
        }
        response
    }
}

impl From<AdminError> for AwsError {
    fn from(err: AdminError) -> Self {
        match err {
            AdminError::Invalid(err) => Self::field(err),
            AdminError::AlreadyExists(message)
            | AdminError::NotFound(message)
            | AdminError::FailedPrecondition(message) => Self::validation(message),
            AdminError::Unavailable(message) => Self::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "ServiceUnavailable",
                format!("the control plane's store is unavailable: {message}"),
            ),
            AdminError::Aborted(message) => {
                Self::new(StatusCode::BAD_REQUEST, "ThrottlingException", message)
            }
            AdminError::Internal(message) => Self::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "InternalFailure",
                message,
            ),
        }
    }
}

impl From<SignatureError> for AwsError {
    fn from(err: SignatureError) -> Self {
        let code = match err {
            SignatureError::Missing => "MissingAuthenticationTokenException",
            SignatureError::Incomplete(_) => "IncompleteSignatureException",
            SignatureError::Skewed(_) | SignatureError::Mismatch => "InvalidSignatureException",
        };
        Self::new(StatusCode::FORBIDDEN, code, err.to_string())
    }
}

fn json_response(status: StatusCode, body: &Value, request_id: &str) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from(body.to_string())));
    *response.status_mut() = status;
    let headers = response.headers_mut();
    headers.insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static(CONTENT_TYPE),
    );
    if let Ok(id) = HeaderValue::from_str(request_id) {
        headers.insert("x-amzn-requestid", id);
    }
    response
}

/// ARNs for the region a request was signed for.
#[derive(Debug, Clone)]
struct Arns {
    region: String,
}

impl Arns {
    fn config(&self, name: &EndpointConfigName) -> String {
        self.arn("endpoint-config", name.as_str())
    }

    fn endpoint(&self, name: &EndpointName) -> String {
        self.arn("endpoint", name.as_str())
    }

    fn arn(&self, kind: &str, name: &str) -> String {
        format!(
            "arn:aws:sagemaker:{}:{ACCOUNT_ID}:{kind}/{}",
            self.region,
            name.to_ascii_lowercase()
        )
    }

    fn config_missing(&self, name: &EndpointConfigName) -> AwsError {
        missing(CONFIG_KIND, &self.config(name))
    }

    fn endpoint_missing(&self, name: &EndpointName) -> AwsError {
        missing(ENDPOINT_KIND, &self.endpoint(name))
    }

    /// A registry error about config `name`, as SageMaker words it.
    fn config_error(&self, name: &EndpointConfigName, err: AdminError) -> AwsError {
        registry_error(CONFIG_KIND, &self.config(name), err)
    }

    /// A registry error about endpoint `name`, as SageMaker words it.
    fn endpoint_error(&self, name: &EndpointName, err: AdminError) -> AwsError {
        registry_error(ENDPOINT_KIND, &self.endpoint(name), err)
    }
}

/// What SageMaker's messages call the two kinds of resource.
const CONFIG_KIND: &str = "endpoint configuration";
const ENDPOINT_KIND: &str = "endpoint";

fn missing(kind: &str, arn: &str) -> AwsError {
    AwsError::validation(format!("Could not find {kind} \"{arn}\"."))
}

/// SageMaker's words for a registry error about the `kind` of resource at `arn`: missing, or
/// already there; any other error as `From<AdminError>` maps it.
fn registry_error(kind: &str, arn: &str, err: AdminError) -> AwsError {
    match err {
        AdminError::NotFound(_) => missing(kind, arn),
        AdminError::AlreadyExists(_) => {
            AwsError::validation(format!("Cannot create already existing {kind} \"{arn}\"."))
        }
        other => other.into(),
    }
}

/// What CreateEndpointConfig received that Switchyard does not use, stored beside the config.
#[derive(Debug, Default, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase")]
struct UnusedFields {
    #[serde(default)]
    config: Map<String, Value>,
    /// One map per production variant, in order.
    #[serde(default)]
    variants: Vec<Map<String, Value>>,
}

/// The SageMaker-compatible API over a registry.
pub struct SageMakerApi {
    registry: Registry,
    token: Option<Arc<str>>,
}

impl std::fmt::Debug for SageMakerApi {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SageMakerApi")
            .field("registry", &self.registry)
            .field("authenticated", &self.token.is_some())
            .finish()
    }
}

impl SageMakerApi {
    /// `token`: the admin token, the secret SigV4 signatures are verified with (none: open).
    pub fn new(registry: Registry, token: Option<String>) -> Self {
        Self {
            registry,
            token: token.map(Arc::from),
        }
    }

    /// Serves HTTP/1.1 on `listener` until `shutdown`, then lets calls in progress finish.
    pub async fn serve(self: Arc<Self>, listener: TcpListener, shutdown: CancellationToken) {
        let mut connections = JoinSet::new();
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => break,
                Some(_) = connections.join_next(), if !connections.is_empty() => {}
                accepted = listener.accept() => {
                    let stream = match accepted {
                        Ok((stream, _)) => stream,
                        Err(err) => {
                            // Out of descriptors and the like: wait rather than spin.
                            tracing::warn!(error = %err, "sagemaker api: accept failed");
                            tokio::time::sleep(Duration::from_millis(50)).await;
                            continue;
                        }
                    };
                    let _ = stream.set_nodelay(true);
                    let api = Arc::clone(&self);
                    let stop = shutdown.clone();
                    connections.spawn(async move {
                        let service = hyper::service::service_fn(move |request| {
                            let api = Arc::clone(&api);
                            async move { Ok::<_, Infallible>(api.handle(request).await) }
                        });
                        let connection = hyper::server::conn::http1::Builder::new()
                            .timer(TokioTimer::new())
                            .header_read_timeout(READ_TIMEOUT)
                            .serve_connection(TokioIo::new(stream), service);
                        tokio::pin!(connection);
                        tokio::select! {
                            _ = connection.as_mut() => {}
                            _ = stop.cancelled() => {
                                connection.as_mut().graceful_shutdown();
                                let _ = connection.await;
                            }
                        }
                    });
                }
            }
        }
        while connections.join_next().await.is_some() {}
    }

    /// Answers one HTTP request.
    pub async fn handle(&self, request: Request<Incoming>) -> Response<Full<Bytes>> {
        let request_id = format!(
            "{:08x}-{:04x}-{:04x}-{:04x}-{:012x}",
            fastrand::u32(..),
            fastrand::u16(..),
            fastrand::u16(..),
            fastrand::u16(..),
            fastrand::u64(..) & 0xffff_ffff_ffff
        );
        let (parts, body) = request.into_parts();
        let body =
            match tokio::time::timeout(READ_TIMEOUT, Limited::new(body, MAX_BODY_BYTES).collect())
                .await
            {
                Ok(Ok(collected)) => collected.to_bytes(),
                Ok(Err(err)) => {
                    let error = if err.is::<http_body_util::LengthLimitError>() {
                        AwsError::new(
                            StatusCode::PAYLOAD_TOO_LARGE,
                            "ValidationException",
                            format!("the request body exceeds {MAX_BODY_BYTES} bytes"),
                        )
                    } else {
                        AwsError::validation(format!("cannot read the request body: {err}"))
                    };
                    return error.response(&request_id);
                }
                Err(_) => {
                    return AwsError::new(
                        StatusCode::REQUEST_TIMEOUT,
                        "RequestTimeout",
                        "the request body did not arrive in time",
                    )
                    .response(&request_id);
                }
            };
        match self.call(&parts, &body).await {
            Ok(output) => json_response(StatusCode::OK, &output, &request_id),
            Err(err) => {
                tracing::info!(code = err.code, message = %err.message, "sagemaker api: refused");
                err.response(&request_id)
            }
        }
    }

    async fn call(&self, parts: &http::request::Parts, body: &[u8]) -> Result<Value, AwsError> {
        if parts.method != Method::POST || parts.uri.path() != "/" {
            return Err(AwsError::new(
                StatusCode::NOT_FOUND,
                "UnknownOperationException",
                "the SageMaker API takes POST / with X-Amz-Target: SageMaker.<Operation>",
            ));
        }
        let operation = parts
            .headers
            .get("x-amz-target")
            .and_then(|value| value.to_str().ok())
            .and_then(|target| target.strip_prefix("SageMaker."))
            .ok_or_else(|| {
                AwsError::new(
                    StatusCode::BAD_REQUEST,
                    "UnknownOperationException",
                    "X-Amz-Target: SageMaker.<Operation> is required",
                )
            })?;
        let region = self.authenticate(parts, body)?;
        let input =
            match serde_json::from_slice::<Value>(if body.is_empty() { b"{}" } else { body }) {
                Ok(Value::Object(input)) => input,
                Ok(_) => {
                    return Err(AwsError::new(
                        StatusCode::BAD_REQUEST,
                        "SerializationException",
                        "the request body must be a JSON object",
                    ));
                }
                Err(err) => {
                    return Err(AwsError::new(
                        StatusCode::BAD_REQUEST,
                        "SerializationException",
                        format!("the request body is not valid JSON: {err}"),
                    ));
                }
            };
        let mut input = Input {
            members: input,
            operation,
            arns: Arns { region },
        };
        match operation {
            "CreateEndpointConfig" => self.create_endpoint_config(&mut input).await,
            "DescribeEndpointConfig" => self.describe_endpoint_config(&mut input).await,
            "DeleteEndpointConfig" => self.delete_endpoint_config(&mut input).await,
            "ListEndpointConfigs" => self.list_endpoint_configs(&mut input).await,
            "CreateEndpoint" => self.create_endpoint(&mut input).await,
            "UpdateEndpoint" => self.update_endpoint(&mut input).await,
            "DescribeEndpoint" => self.describe_endpoint(&mut input).await,
            "DeleteEndpoint" => self.delete_endpoint(&mut input).await,
            "ListEndpoints" => self.list_endpoints(&mut input).await,
            other => Err(AwsError::new(
                StatusCode::BAD_REQUEST,
                "UnknownOperationException",
                format!(
                    "SageMaker.{other} is not served by Switchyard; it serves {}",
                    OPERATIONS.join(", ")
                ),
            )),
        }
    }

    /// Verifies the signature when a token is configured; returns the region signed for.
    fn authenticate(&self, parts: &http::request::Parts, body: &[u8]) -> Result<String, AwsError> {
        let authorization = match &self.token {
            Some(token) => Some(sigv4::verify(
                Signed {
                    method: parts.method.as_str(),
                    uri: &parts.uri,
                    headers: &parts.headers,
                    body,
                },
                token,
                SystemTime::now(),
            )?),
            None => Authorization::from_headers(&parts.headers).ok().flatten(),
        };
        Ok(authorization
            .map(|authorization| authorization.region)
            .filter(|region| {
                !region.is_empty()
                    && region.len() <= 32
                    && region.bytes().all(|byte| {
                        byte.is_ascii_lowercase() || byte.is_ascii_digit() || byte == b'-'
                    })
            })
            .unwrap_or_else(|| DEFAULT_REGION.to_owned()))
    }

    // ----- endpoint configs -------------------------------------------------------------

    async fn create_endpoint_config(&self, input: &mut Input<'_>) -> Result<Value, AwsError> {
        let mut known = vec!["EndpointConfigName", "ProductionVariants"];
        known.extend_from_slice(UNUSED_CONFIG_MEMBERS);
        input.check_members(&known)?;
        let name = input.config_name()?;
        let variants = input.required("ProductionVariants")?;
        let mut unused = UnusedFields::default();
        for member in UNUSED_CONFIG_MEMBERS {
            if let Some(value) = input.members.remove(*member) {
                unused.config.insert((*member).to_owned(), value);
            }
        }
        let parsed = parse_production_variants_value(variants).map_err(AwsError::field)?;
        if parsed
            .ignored_values
            .iter()
            .any(|fields| !fields.is_empty())
        {
            unused.variants = parsed.ignored_values;
        }
        let ignored: Vec<&str> = unused.config.keys().map(String::as_str).collect();
        if !ignored.is_empty() || !parsed.ignored_fields.is_empty() {
            tracing::info!(endpoint_config = %name, fields = ?ignored, variant_fields = ?parsed.ignored_fields, "sagemaker api: fields stored but not used");
        }
        let stored = (!unused.config.is_empty() || !unused.variants.is_empty())
            .then(|| serde_json::to_vec(&unused).expect("JSON values serialise"));
        let config = EndpointConfig {
            endpoint_config_name: name.clone(),
            production_variants: parsed.variants,
            health_check_config: HealthCheckConfig::default(),
            creation_time_ms: 0,
            // SageMaker's API has no disaggregation; the switchyard CLI sets it.
            disaggregation_config: None,
        };
        self.registry
            .create_config_with(config, stored)
            .await
            .map_err(|err| input.arns.config_error(&name, err))?;
        tracing::info!(endpoint_config = %name, "endpoint config created (SageMaker API)");
        Ok(json!({"EndpointConfigArn": input.arns.config(&name)}))
    }

    async fn describe_endpoint_config(&self, input: &mut Input<'_>) -> Result<Value, AwsError> {
        input.check_members(&["EndpointConfigName"])?;
        let name = input.config_name()?;
        let config = self
            .registry
            .describe_config(&name)
            .await
            .map_err(|err| input.arns.config_error(&name, err))?;
        let unused: UnusedFields = match self.registry.sagemaker_fields(&name).await? {
            Some(bytes) => serde_json::from_slice(&bytes).map_err(|err| {
                AwsError::from(AdminError::Internal(format!(
                    "stored SageMaker fields of {name}: {err}"
                )))
            })?,
            None => UnusedFields::default(),
        };
        let variants: Vec<Value> = config
            .production_variants
            .iter()
            .enumerate()
            .map(|(index, variant)| {
                let mut value = serde_json::to_value(variant).expect("variants serialise");
                if let (Value::Object(object), Some(extra)) =
                    (&mut value, unused.variants.get(index))
                {
                    for (key, field) in extra {
                        object.entry(key.clone()).or_insert_with(|| field.clone());
                    }
                }
                value
            })
            .collect();
        let mut output = Map::new();
        output.insert("EndpointConfigName".into(), json!(name.as_str()));
        output.insert("EndpointConfigArn".into(), json!(input.arns.config(&name)));
        output.insert("ProductionVariants".into(), Value::Array(variants));
        output.insert(
            "CreationTime".into(),
            json!(seconds(config.creation_time_ms)),
        );
        for (key, value) in unused.config {
            if !NOT_DESCRIBED.contains(&key.as_str()) {
                output.insert(key, value);
            }
        }
        Ok(Value::Object(output))
    }

    async fn delete_endpoint_config(&self, input: &mut Input<'_>) -> Result<Value, AwsError> {
        input.check_members(&["EndpointConfigName"])?;
        let name = input.config_name()?;
        self.registry
            .delete_config(&name)
            .await
            .map_err(|err| input.arns.config_error(&name, err))?;
        tracing::info!(endpoint_config = %name, "endpoint config deleted (SageMaker API)");
        Ok(json!({}))
    }

    async fn list_endpoint_configs(&self, input: &mut Input<'_>) -> Result<Value, AwsError> {
        input.check_members(LIST_MEMBERS)?;
        let query = ListQuery::read(input, &["Name", "CreationTime"])?;
        let rows = self
            .registry
            .list_configs()
            .await?
            .into_iter()
            .map(|config| Row {
                name: config.endpoint_config_name.to_string(),
                created: seconds(config.creation_time_ms),
                modified: seconds(config.creation_time_ms),
                status: String::new(),
                summary: json!({
                    "EndpointConfigName": config.endpoint_config_name.as_str(),
                    "EndpointConfigArn": input.arns.config(&config.endpoint_config_name),
                    "CreationTime": seconds(config.creation_time_ms),
                }),
            })
            .collect();
        Ok(query.answer(rows, "EndpointConfigs"))
    }

    // ----- endpoints --------------------------------------------------------------------

    async fn create_endpoint(&self, input: &mut Input<'_>) -> Result<Value, AwsError> {
        // DeploymentConfig and Tags are accepted, not used: routers switch to a new config
        // atomically, there is no deployment to shape.
        input.check_members(&[
            "EndpointName",
            "EndpointConfigName",
            "DeploymentConfig",
            "Tags",
        ])?;
        let name = input.endpoint_name()?;
        let config = input.config_name()?;
        self.registry
            .create_endpoint(name.clone(), config.clone())
            .await
            .map_err(|err| match err {
                // The endpoint is what is created: what is missing is its config.
                AdminError::NotFound(_) => input.arns.config_missing(&config),
                err => input.arns.endpoint_error(&name, err),
            })?;
        tracing::info!(endpoint = %name, endpoint_config = %config, "endpoint created (SageMaker API)");
        Ok(json!({"EndpointArn": input.arns.endpoint(&name)}))
    }

    async fn update_endpoint(&self, input: &mut Input<'_>) -> Result<Value, AwsError> {
        input.check_members(&[
            "EndpointName",
            "EndpointConfigName",
            "RetainAllVariantProperties",
            "ExcludeRetainedVariantProperties",
            "DeploymentConfig",
            "RetainDeploymentConfig",
        ])?;
        let name = input.endpoint_name()?;
        let config = input.config_name()?;
        match self.registry.update_endpoint(&name, config.clone()).await {
            Ok(_) => {
                tracing::info!(endpoint = %name, endpoint_config = %config, "endpoint updated (SageMaker API)");
                Ok(json!({"EndpointArn": input.arns.endpoint(&name)}))
            }
            Err(AdminError::NotFound(_)) => {
                // Either the endpoint or the config is missing: say which.
                match self.registry.describe_endpoint(&name).await {
                    Err(AdminError::NotFound(_)) => Err(input.arns.endpoint_missing(&name)),
                    _ => Err(input.arns.config_missing(&config)),
                }
            }
            Err(err) => Err(err.into()),
        }
    }

    async fn describe_endpoint(&self, input: &mut Input<'_>) -> Result<Value, AwsError> {
        input.check_members(&["EndpointName"])?;
        let name = input.endpoint_name()?;
        let endpoint = self
            .registry
            .describe_endpoint(&name)
            .await
            .map_err(|err| input.arns.endpoint_error(&name, err))?;
        let mut output = Map::new();
        output.insert("EndpointName".into(), json!(name.as_str()));
        output.insert("EndpointArn".into(), json!(input.arns.endpoint(&name)));
        output.insert(
            "EndpointConfigName".into(),
            json!(endpoint.endpoint_config_name.as_str()),
        );
        // The config the endpoint points at, with each variant's live instance count.
        match self
            .registry
            .describe_config(&endpoint.endpoint_config_name)
            .await
        {
            Ok(config) => {
                let instances = self.registry.list_instances(Some(&name)).await?;
                let variants: Vec<Value> = config
                    .production_variants
                    .iter()
                    .map(|variant| {
                        let current = instances
                            .iter()
                            .filter(|instance| {
                                instance.variant_name == variant.variant_name
                                    && instance.health.routable()
                            })
                            .count();
                        json!({
                            "VariantName": variant.variant_name.as_str(),
                            "CurrentWeight": variant.weight(),
                            "DesiredWeight": variant.weight(),
                            "CurrentInstanceCount": current,
                            "DesiredInstanceCount": variant.initial_instance_count.unwrap_or(current as u32),
                            "RoutingConfig": variant.routing(),
                        })
                    })
                    .collect();
                output.insert("ProductionVariants".into(), Value::Array(variants));
            }
            Err(AdminError::NotFound(_)) => {}
            Err(err) => return Err(err.into()),
        }
        output.insert(
            "EndpointStatus".into(),
            json!(endpoint.endpoint_status.to_string()),
        );
        if !endpoint.failure_reason.is_empty() {
            output.insert("FailureReason".into(), json!(endpoint.failure_reason));
        }
        output.insert(
            "CreationTime".into(),
            json!(seconds(endpoint.creation_time_ms)),
        );
        output.insert(
            "LastModifiedTime".into(),
            json!(seconds(endpoint.last_modified_time_ms)),
        );
        Ok(Value::Object(output))
    }

    async fn delete_endpoint(&self, input: &mut Input<'_>) -> Result<Value, AwsError> {
        input.check_members(&["EndpointName"])?;
        let name = input.endpoint_name()?;
        self.registry
            .delete_endpoint(&name)
            .await
            .map_err(|err| input.arns.endpoint_error(&name, err))?;
        tracing::info!(endpoint = %name, "endpoint deleted (SageMaker API)");
        Ok(json!({}))
    }

    async fn list_endpoints(&self, input: &mut Input<'_>) -> Result<Value, AwsError> {
        let mut known = LIST_MEMBERS.to_vec();
        known.extend_from_slice(&[
            "LastModifiedTimeBefore",
            "LastModifiedTimeAfter",
            "StatusEquals",
        ]);
        input.check_members(&known)?;
        let mut query = ListQuery::read(input, &["Name", "CreationTime", "Status"])?;
        query.modified_before = input.timestamp("LastModifiedTimeBefore")?;
        query.modified_after = input.timestamp("LastModifiedTimeAfter")?;
        query.status = input.string("StatusEquals")?;
        let rows = self
            .registry
            .list_endpoints()
            .await?
            .into_iter()
            .map(|endpoint| Row {
                name: endpoint.endpoint_name.to_string(),
                created: seconds(endpoint.creation_time_ms),
                modified: seconds(endpoint.last_modified_time_ms),
                status: endpoint.endpoint_status.to_string(),
                summary: json!({
                    "EndpointName": endpoint.endpoint_name.as_str(),
                    "EndpointArn": input.arns.endpoint(&endpoint.endpoint_name),
                    "CreationTime": seconds(endpoint.creation_time_ms),
                    "LastModifiedTime": seconds(endpoint.last_modified_time_ms),
                    "EndpointStatus": endpoint.endpoint_status.to_string(),
                }),
            })
            .collect();
        Ok(query.answer(rows, "Endpoints"))
    }
}

/// AWS JSON timestamps: seconds since the epoch.
fn seconds(ms: i64) -> f64 {
    ms as f64 / 1000.0
}

/// A request's members, taken one by one so that what is left over can be refused, and the
/// ARNs of the region it was signed for.
struct Input<'a> {
    members: Map<String, Value>,
    operation: &'a str,
    arns: Arns,
}

impl Input<'_> {
    fn required(&mut self, member: &str) -> Result<Value, AwsError> {
        match self.members.remove(member) {
            Some(Value::Null) | None => Err(AwsError::validation(format!(
                "{member}: is required by {}",
                self.operation
            ))),
            Some(value) => Ok(value),
        }
    }

    fn string(&mut self, member: &str) -> Result<Option<String>, AwsError> {
        match self.members.remove(member) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(text)) => Ok(Some(text)),
            Some(_) => Err(AwsError::validation(format!("{member}: must be a string"))),
        }
    }

    fn required_string(&mut self, member: &str) -> Result<String, AwsError> {
        match self.required(member)? {
            Value::String(text) => Ok(text),
            _ => Err(AwsError::validation(format!("{member}: must be a string"))),
        }
    }

    fn config_name(&mut self) -> Result<EndpointConfigName, AwsError> {
        let text = self.required_string("EndpointConfigName")?;
        endpoint_config_name("EndpointConfigName", &text).map_err(AwsError::field)
    }

    fn endpoint_name(&mut self) -> Result<EndpointName, AwsError> {
        let text = self.required_string("EndpointName")?;
        endpoint_name("EndpointName", &text).map_err(AwsError::field)
    }

    fn timestamp(&mut self, member: &str) -> Result<Option<f64>, AwsError> {
        match self.members.remove(member) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Number(number)) => Ok(number.as_f64()),
            Some(_) => Err(AwsError::validation(format!(
                "{member}: must be a timestamp (seconds since the epoch)"
            ))),
        }
    }

    fn integer(&mut self, member: &str) -> Result<Option<u64>, AwsError> {
        match self.members.remove(member) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Number(number)) if number.as_u64().is_some() => Ok(number.as_u64()),
            Some(_) => Err(AwsError::validation(format!(
                "{member}: must be a whole number"
            ))),
        }
    }

    /// Refuses a member the operation's input does not define (a typo, most likely).
    fn check_members(&self, known: &[&str]) -> Result<(), AwsError> {
        match self
            .members
            .keys()
            .find(|member| !known.contains(&member.as_str()))
        {
            None => Ok(()),
            Some(member) => Err(AwsError::validation(format!(
                "{member}: is not a member of {}'s input",
                self.operation
            ))),
        }
    }
}

/// One listed item with what filters and sorting look at.
struct Row {
    name: String,
    created: f64,
    modified: f64,
    status: String,
    summary: Value,
}

/// The filters, order and page of a List call.
struct ListQuery {
    name_contains: Option<String>,
    created_before: Option<f64>,
    created_after: Option<f64>,
    modified_before: Option<f64>,
    modified_after: Option<f64>,
    status: Option<String>,
    sort_by: String,
    descending: bool,
    max_results: usize,
    offset: usize,
}

impl ListQuery {
    /// SageMaker's defaults: sorted by CreationTime, Descending, 10 per page.
    fn read(input: &mut Input<'_>, sort_keys: &[&str]) -> Result<Self, AwsError> {
        let sort_by = input
            .string("SortBy")?
            .unwrap_or_else(|| "CreationTime".to_owned());
        if !sort_keys.contains(&sort_by.as_str()) {
            return Err(AwsError::validation(format!(
                "SortBy: {sort_by:?} is not one of {}",
                sort_keys.join(", ")
            )));
        }
        let descending = match input.string("SortOrder")?.as_deref() {
            None | Some("Descending") => true,
            Some("Ascending") => false,
            Some(other) => {
                return Err(AwsError::validation(format!(
                    "SortOrder: {other:?} is not one of Ascending, Descending"
                )));
            }
        };
        let max_results = input.integer("MaxResults")?.unwrap_or(10);
        if !(1..=100).contains(&max_results) {
            return Err(AwsError::validation(format!(
                "MaxResults: must be between 1 and 100, got {max_results}"
            )));
        }
        let offset = match input.string("NextToken")? {
            None => 0,
            Some(token) => token.parse::<usize>().map_err(|_| {
                AwsError::validation(format!(
                    "NextToken: {token:?} is not a token this API returned"
                ))
            })?,
        };
        Ok(Self {
            name_contains: input.string("NameContains")?,
            created_before: input.timestamp("CreationTimeBefore")?,
            created_after: input.timestamp("CreationTimeAfter")?,
            modified_before: None,
            modified_after: None,
            status: None,
            sort_by,
            descending,
            max_results: max_results as usize,
            offset,
        })
    }

    fn keeps(&self, row: &Row) -> bool {
        let contains = self.name_contains.as_ref().is_none_or(|part| {
            row.name
                .to_ascii_lowercase()
                .contains(&part.to_ascii_lowercase())
        });
        contains
            && self.created_before.is_none_or(|time| row.created < time)
            && self.created_after.is_none_or(|time| row.created > time)
            && self.modified_before.is_none_or(|time| row.modified < time)
            && self.modified_after.is_none_or(|time| row.modified > time)
            && self
                .status
                .as_ref()
                .is_none_or(|status| row.status == *status)
    }

    /// The page of the filtered, sorted rows, as `{list_member: [...], NextToken?}`.
    fn answer(&self, mut rows: Vec<Row>, list_member: &str) -> Value {
        rows.retain(|row| self.keeps(row));
        rows.sort_by(|a, b| {
            let order = match self.sort_by.as_str() {
                "Name" => a.name.cmp(&b.name),
                "Status" => a.status.cmp(&b.status).then_with(|| a.name.cmp(&b.name)),
                _ => a
                    .created
                    .total_cmp(&b.created)
                    .then_with(|| a.name.cmp(&b.name)),
            };
            if self.descending {
                order.reverse()
            } else {
                order
            }
        });
        let total = rows.len();
        let page: Vec<Value> = rows
            .into_iter()
            .skip(self.offset)
            .take(self.max_results)
            .map(|row| row.summary)
            .collect();
        let mut output = Map::new();
        output.insert(list_member.to_owned(), Value::Array(page));
        let next = self.offset + self.max_results;
        if next < total {
            output.insert("NextToken".into(), json!(next.to_string()));
        }
        Value::Object(output)
    }
}
