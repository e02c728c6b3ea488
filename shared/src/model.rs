//! The configuration model, shaped like SageMaker's: endpoint configs with production
//! variants, endpoints that point at a config, and instances that serve a variant.
//!
//! These are the domain types every crate works with. They serialise to the JSON that
//! `aws sagemaker create-endpoint-config --production-variants` takes (PascalCase), which is
//! also the form stored in etcd. `validate()` enforces every rule of PRODUCT.md and names the
//! offending field in SageMaker's spelling.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::names::{EndpointConfigName, EndpointName, InstanceId, VariantName};

pub const MIN_VARIANTS: usize = 1;
pub const MAX_VARIANTS: usize = 10;
pub const PREFIX_LENGTH_RANGE: std::ops::RangeInclusive<u32> = 1024..=65536;
pub const CONCURRENCY_THRESHOLD_RANGE: std::ops::RangeInclusive<u32> = 1..=1024;
/// KV_AWARE's ConcurrencyThreshold when `KvAwareRoutingConfig` does not set one.
pub const DEFAULT_KV_CONCURRENCY_THRESHOLD: u32 = 10;
/// KV_AWARE's LoadWeight when `KvAwareRoutingConfig` does not set one.
pub const DEFAULT_KV_LOAD_WEIGHT: f64 = 0.5;
pub const KV_LOAD_WEIGHT_RANGE: std::ops::RangeInclusive<f64> = 0.0..=100.0;
/// `LoadBalanceFactor` (Switchyard's extension of PrefixAwareRoutingConfig).
pub const LOAD_BALANCE_FACTOR_RANGE: std::ops::RangeInclusive<f64> = 1.0..=100.0;
/// `LoadBalanceSlack` (Switchyard's extension of PrefixAwareRoutingConfig).
pub const LOAD_BALANCE_SLACK_RANGE: std::ops::RangeInclusive<u32> = 0..=1024;
/// `LoadBalanceSlack` when `LoadBalanceFactor` is given alone (docs/benchmarks.md, section 7,
/// shows why).
pub const DEFAULT_LOAD_BALANCE_SLACK: u32 = 3;
pub const DEFAULT_VARIANT_WEIGHT: f64 = 1.0;
pub const DEFAULT_INSTANCE_WEIGHT: f64 = 1.0;
/// Longest instance lease a registration may ask for.
pub const MAX_TTL_SECONDS: u32 = 86_400;
/// Longest instance base URL, in bytes. Every record that travels to routers is bounded, so a
/// sync message of one record stays small.
pub const MAX_URL_BYTES: usize = 2048;
/// Longest `InstanceType`, in characters.
pub const MAX_INSTANCE_TYPE_CHARS: usize = 256;
/// Longest health-check path, in bytes.
pub const MAX_HEALTH_PATH_BYTES: usize = 1024;

/// An input that breaks a rule, with the field named.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {message}")]
pub struct ValidationError {
    pub field: String,
    pub message: String,
}

impl ValidationError {
    pub fn new(field: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            field: field.into(),
            message: message.into(),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum RoutingStrategy {
    #[default]
    Random,
    LeastOutstandingRequests,
    PrefixAware,
    KvAware,
}

impl RoutingStrategy {
    pub const ALL: [RoutingStrategy; 4] = [
        RoutingStrategy::Random,
        RoutingStrategy::LeastOutstandingRequests,
        RoutingStrategy::PrefixAware,
        RoutingStrategy::KvAware,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            RoutingStrategy::Random => "RANDOM",
            RoutingStrategy::LeastOutstandingRequests => "LEAST_OUTSTANDING_REQUESTS",
            RoutingStrategy::PrefixAware => "PREFIX_AWARE",
            RoutingStrategy::KvAware => "KV_AWARE",
        }
    }
}

impl fmt::Display for RoutingStrategy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for RoutingStrategy {
    type Err = ValidationError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|strategy| strategy.as_str() == s)
            .ok_or_else(|| {
                ValidationError::new(
                    "RoutingStrategy",
                    format!(
                        "{s:?} is not one of RANDOM, LEAST_OUTSTANDING_REQUESTS, PREFIX_AWARE, KV_AWARE"
                    ),
                )
            })
    }
}

/// SageMaker's PrefixAwareRoutingConfig, plus Switchyard's optional bounded-load extension.
/// Without `LoadBalanceFactor` it means exactly what it means on SageMaker: an instance takes
/// its prefixes until ConcurrencyThreshold requests are in flight on it fleet-wide. With it,
/// an instance takes a prefix only while its fleet-wide in-flight count is below
/// `min(ConcurrencyThreshold, ⌈LoadBalanceFactor × (L + 1) / N⌉ + LoadBalanceSlack)`, where
/// L is the variant's fleet-wide in-flight total and N its routable instances; past it, the
/// prefix goes to another instance below the bound (`x-switchyard-route: overflow`): a copy
/// the router made before, else a lightly loaded one (`switchyard_policy::rank`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase", deny_unknown_fields)]
pub struct PrefixAwareRoutingConfig {
    pub prefix_length: u32,
    pub concurrency_threshold: u32,
    /// Switchyard extension: `c` in 1–100; absent, SageMaker's semantics.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub load_balance_factor: Option<f64>,
    /// Switchyard extension: `s` in 0–1024, only with a factor (default
    /// [`DEFAULT_LOAD_BALANCE_SLACK`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub load_balance_slack: Option<u32>,
}

/// KV_AWARE's knobs, Switchyard's extension: every field is optional and defaults to the
/// documented value, so a pasted SageMaker config (which has no such object) behaves the same.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase", deny_unknown_fields)]
pub struct KvAwareRoutingConfig {
    /// Fleet-wide in-flight requests at which an instance stops being preferred for its cached
    /// blocks (1–1024, default 10).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub concurrency_threshold: Option<u32>,
    /// How much load counts against matched blocks in the score (0–100, default 0.5; see
    /// `switchyard_policy::kv`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub load_weight: Option<f64>,
}

impl KvAwareRoutingConfig {
    pub fn concurrency_threshold(&self) -> u32 {
        self.concurrency_threshold
            .unwrap_or(DEFAULT_KV_CONCURRENCY_THRESHOLD)
    }

    pub fn load_weight(&self) -> f64 {
        self.load_weight.unwrap_or(DEFAULT_KV_LOAD_WEIGHT)
    }

    fn validate(&self, field: &str) -> Result<(), ValidationError> {
        if let Some(threshold) = self.concurrency_threshold
            && !CONCURRENCY_THRESHOLD_RANGE.contains(&threshold)
        {
            return Err(ValidationError::new(
                format!("{field}.ConcurrencyThreshold"),
                format!(
                    "must be between {} and {}, got {threshold}",
                    CONCURRENCY_THRESHOLD_RANGE.start(),
                    CONCURRENCY_THRESHOLD_RANGE.end(),
                ),
            ));
        }
        if let Some(weight) = self.load_weight
            && !KV_LOAD_WEIGHT_RANGE.contains(&weight)
        {
            return Err(ValidationError::new(
                format!("{field}.LoadWeight"),
                format!(
                    "must be a number between {} and {}, got {weight}",
                    KV_LOAD_WEIGHT_RANGE.start(),
                    KV_LOAD_WEIGHT_RANGE.end(),
                ),
            ));
        }
        Ok(())
    }
}

impl PrefixAwareRoutingConfig {
    /// SageMaker's fields only (no extension).
    pub fn sagemaker(prefix_length: u32, concurrency_threshold: u32) -> Self {
        Self {
            prefix_length,
            concurrency_threshold,
            load_balance_factor: None,
            load_balance_slack: None,
        }
    }

    /// The bounded-load extension as (factor, slack), if configured.
    pub fn load_balance(&self) -> Option<(f64, u32)> {
        self.load_balance_factor.map(|factor| {
            (
                factor,
                self.load_balance_slack
                    .unwrap_or(DEFAULT_LOAD_BALANCE_SLACK),
            )
        })
    }

    fn validate(&self, field: &str) -> Result<(), ValidationError> {
        if !PREFIX_LENGTH_RANGE.contains(&self.prefix_length) {
            return Err(ValidationError::new(
                format!("{field}.PrefixLength"),
                format!(
                    "must be between {} and {}, got {}",
                    PREFIX_LENGTH_RANGE.start(),
                    PREFIX_LENGTH_RANGE.end(),
                    self.prefix_length
                ),
            ));
        }
        if !CONCURRENCY_THRESHOLD_RANGE.contains(&self.concurrency_threshold) {
            return Err(ValidationError::new(
                format!("{field}.ConcurrencyThreshold"),
                format!(
                    "must be between {} and {}, got {}",
                    CONCURRENCY_THRESHOLD_RANGE.start(),
                    CONCURRENCY_THRESHOLD_RANGE.end(),
                    self.concurrency_threshold
                ),
            ));
        }
        if let Some(factor) = self.load_balance_factor
            && !LOAD_BALANCE_FACTOR_RANGE.contains(&factor)
        {
            return Err(ValidationError::new(
                format!("{field}.LoadBalanceFactor"),
                format!(
                    "must be a number between {} and {}, got {factor}",
                    LOAD_BALANCE_FACTOR_RANGE.start(),
                    LOAD_BALANCE_FACTOR_RANGE.end(),
                ),
            ));
        }
        match (self.load_balance_factor, self.load_balance_slack) {
            (None, Some(_)) => Err(ValidationError::new(
                format!("{field}.LoadBalanceSlack"),
                "is only allowed together with LoadBalanceFactor",
            )),
            (_, Some(slack)) if !LOAD_BALANCE_SLACK_RANGE.contains(&slack) => {
                Err(ValidationError::new(
                    format!("{field}.LoadBalanceSlack"),
                    format!(
                        "must be between {} and {}, got {slack}",
                        LOAD_BALANCE_SLACK_RANGE.start(),
                        LOAD_BALANCE_SLACK_RANGE.end(),
                    ),
                ))
            }
            _ => Ok(()),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase", deny_unknown_fields)]
pub struct RoutingConfig {
    #[serde(default)]
    pub routing_strategy: RoutingStrategy,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefix_aware_routing_config: Option<PrefixAwareRoutingConfig>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_aware_routing_config: Option<KvAwareRoutingConfig>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase")]
pub struct ProductionVariant {
    pub variant_name: VariantName,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model_name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub initial_instance_count: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub instance_type: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub initial_variant_weight: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub routing_config: Option<RoutingConfig>,
}

impl ProductionVariant {
    pub fn weight(&self) -> f64 {
        self.initial_variant_weight
            .unwrap_or(DEFAULT_VARIANT_WEIGHT)
    }

    pub fn routing(&self) -> RoutingConfig {
        self.routing_config.unwrap_or_default()
    }
}

/// How the control plane probes the instances of an endpoint.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase", deny_unknown_fields)]
pub struct HealthCheckConfig {
    #[serde(default = "HealthCheckConfig::default_path")]
    pub path: String,
    #[serde(default = "HealthCheckConfig::default_interval_ms")]
    pub interval_ms: u32,
    #[serde(default = "HealthCheckConfig::default_timeout_ms")]
    pub timeout_ms: u32,
    #[serde(default = "HealthCheckConfig::default_unhealthy_threshold")]
    pub unhealthy_threshold: u32,
    #[serde(default = "HealthCheckConfig::default_healthy_threshold")]
    pub healthy_threshold: u32,
}

impl HealthCheckConfig {
    fn default_path() -> String {
        "/health".to_owned()
    }
    fn default_interval_ms() -> u32 {
        1000
    }
    fn default_timeout_ms() -> u32 {
        1000
    }
    fn default_unhealthy_threshold() -> u32 {
        3
    }
    fn default_healthy_threshold() -> u32 {
        2
    }

    pub fn validate(&self, field: &str) -> Result<(), ValidationError> {
        if !self.path.starts_with('/') || self.path.chars().any(|c| c.is_whitespace()) {
            return Err(ValidationError::new(
                format!("{field}.Path"),
                format!("{:?} must start with '/' and contain no spaces", self.path),
            ));
        }
        if self.path.len() > MAX_HEALTH_PATH_BYTES {
            return Err(ValidationError::new(
                format!("{field}.Path"),
                format!(
                    "is {} bytes long; at most {MAX_HEALTH_PATH_BYTES}",
                    self.path.len()
                ),
            ));
        }
        if !(100..=3_600_000).contains(&self.interval_ms) {
            return Err(ValidationError::new(
                format!("{field}.IntervalMs"),
                format!("{} is outside 100..=3600000", self.interval_ms),
            ));
        }
        if !(10..=60_000).contains(&self.timeout_ms) {
            return Err(ValidationError::new(
                format!("{field}.TimeoutMs"),
                format!("{} is outside 10..=60000", self.timeout_ms),
            ));
        }
        for (name, value) in [
            ("UnhealthyThreshold", self.unhealthy_threshold),
            ("HealthyThreshold", self.healthy_threshold),
        ] {
            if !(1..=100).contains(&value) {
                return Err(ValidationError::new(
                    format!("{field}.{name}"),
                    format!("{value} is outside 1..=100"),
                ));
            }
        }
        Ok(())
    }
}

impl Default for HealthCheckConfig {
    fn default() -> Self {
        Self {
            path: Self::default_path(),
            interval_ms: Self::default_interval_ms(),
            timeout_ms: Self::default_timeout_ms(),
            unhealthy_threshold: Self::default_unhealthy_threshold(),
            healthy_threshold: Self::default_healthy_threshold(),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase")]
pub struct EndpointConfig {
    pub endpoint_config_name: EndpointConfigName,
    pub production_variants: Vec<ProductionVariant>,
    #[serde(default)]
    pub health_check_config: HealthCheckConfig,
    #[serde(default)]
    pub creation_time_ms: i64,
    /// Disaggregated prefill/decode (Switchyard's extension); absent: colocated.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disaggregation_config: Option<crate::disaggregation::DisaggregationConfig>,
}

impl EndpointConfig {
    /// Checks every rule of the configuration model; the error names the first bad field.
    pub fn validate(&self) -> Result<(), ValidationError> {
        let count = self.production_variants.len();
        if !(MIN_VARIANTS..=MAX_VARIANTS).contains(&count) {
            return Err(ValidationError::new(
                "ProductionVariants",
                format!("must hold {MIN_VARIANTS} to {MAX_VARIANTS} variants, got {count}"),
            ));
        }
        for (index, variant) in self.production_variants.iter().enumerate() {
            validate_variant(variant, &format!("ProductionVariants[{index}]"))?;
            if self.production_variants[..index]
                .iter()
                .any(|earlier| earlier.variant_name == variant.variant_name)
            {
                return Err(ValidationError::new(
                    format!("ProductionVariants[{index}].VariantName"),
                    format!("{} is used by an earlier variant", variant.variant_name),
                ));
            }
        }
        let total: f64 = self
            .production_variants
            .iter()
            .map(ProductionVariant::weight)
            .sum();
        if !total.is_finite() {
            return Err(ValidationError::new(
                "ProductionVariants",
                "the InitialVariantWeights must add up to a finite number",
            ));
        }
        if let Some(disaggregation) = &self.disaggregation_config {
            disaggregation.validate(&self.production_variants, "DisaggregationConfig")?;
        }
        if self.disaggregation_config.is_none()
            && self
                .production_variants
                .iter()
                .all(|variant| variant.weight() == 0.0)
        {
            return Err(ValidationError::new(
                "ProductionVariants",
                "at least one variant needs an InitialVariantWeight above 0",
            ));
        }
        self.health_check_config.validate("HealthCheckConfig")
    }

    pub fn variant(&self, name: &str) -> Option<&ProductionVariant> {
        self.production_variants
            .iter()
            .find(|variant| variant.variant_name.as_str() == name)
    }
}

fn validate_variant(variant: &ProductionVariant, field: &str) -> Result<(), ValidationError> {
    if let Some(model) = &variant.model_name
        && (model.is_empty() || model.len() > 256 || model.chars().any(char::is_control))
    {
        return Err(ValidationError::new(
            format!("{field}.ModelName"),
            "must be 1-256 characters without control characters",
        ));
    }
    if let Some(instance_type) = &variant.instance_type
        && (instance_type.chars().count() > MAX_INSTANCE_TYPE_CHARS
            || instance_type.chars().any(char::is_control))
    {
        return Err(ValidationError::new(
            format!("{field}.InstanceType"),
            format!(
                "must be at most {MAX_INSTANCE_TYPE_CHARS} characters without control characters"
            ),
        ));
    }
    if let Some(count) = variant.initial_instance_count
        && count < 1
    {
        return Err(ValidationError::new(
            format!("{field}.InitialInstanceCount"),
            format!("must be at least 1, got {count}"),
        ));
    }
    if let Some(weight) = variant.initial_variant_weight
        && (!weight.is_finite() || weight < 0.0)
    {
        return Err(ValidationError::new(
            format!("{field}.InitialVariantWeight"),
            format!("must be a finite number at least 0, got {weight}"),
        ));
    }
    let routing = variant.routing();
    let kv_field = format!("{field}.RoutingConfig.KvAwareRoutingConfig");
    match (routing.routing_strategy, routing.kv_aware_routing_config) {
        (RoutingStrategy::KvAware, Some(kv)) => kv.validate(&kv_field)?,
        (other, Some(_)) if other != RoutingStrategy::KvAware => {
            return Err(ValidationError::new(
                kv_field,
                format!("is only allowed when RoutingStrategy is KV_AWARE, not {other}"),
            ));
        }
        _ => {}
    }
    let prefix_field = format!("{field}.RoutingConfig.PrefixAwareRoutingConfig");
    match (
        routing.routing_strategy,
        routing.prefix_aware_routing_config,
    ) {
        (RoutingStrategy::PrefixAware, None) => Err(ValidationError::new(
            prefix_field,
            "is required when RoutingStrategy is PREFIX_AWARE (PrefixLength and ConcurrencyThreshold)",
        )),
        (RoutingStrategy::PrefixAware, Some(prefix)) => prefix.validate(&prefix_field),
        (other, Some(_)) => Err(ValidationError::new(
            prefix_field,
            format!("is only allowed when RoutingStrategy is PREFIX_AWARE, not {other}"),
        )),
        (_, None) => Ok(()),
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase")]
pub enum EndpointStatus {
    Creating,
    #[default]
    InService,
    Updating,
    Deleting,
    Failed,
}

impl fmt::Display for EndpointStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            EndpointStatus::Creating => "Creating",
            EndpointStatus::InService => "InService",
            EndpointStatus::Updating => "Updating",
            EndpointStatus::Deleting => "Deleting",
            EndpointStatus::Failed => "Failed",
        })
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase")]
pub struct Endpoint {
    pub endpoint_name: EndpointName,
    pub endpoint_config_name: EndpointConfigName,
    pub endpoint_status: EndpointStatus,
    pub creation_time_ms: i64,
    pub last_modified_time_ms: i64,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub failure_reason: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum InstanceRole {
    #[default]
    Both,
    Prefill,
    Decode,
}

impl InstanceRole {
    pub fn as_str(self) -> &'static str {
        match self {
            InstanceRole::Both => "both",
            InstanceRole::Prefill => "prefill",
            InstanceRole::Decode => "decode",
        }
    }
}

impl fmt::Display for InstanceRole {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for InstanceRole {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "both" => Ok(InstanceRole::Both),
            "prefill" => Ok(InstanceRole::Prefill),
            "decode" => Ok(InstanceRole::Decode),
            _ => Err(format!("{s:?} is not one of both, prefill, decode")),
        }
    }
}

/// How routers talk to an instance: HTTP/1.1 keep-alive (what vLLM and SGLang serve), h2c
/// (HTTP/2 without TLS, prior knowledge), or unspecified: the router's `--upstream-protocol`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum InstanceProtocol {
    #[default]
    #[serde(alias = "UNSPECIFIED")]
    Unspecified,
    #[serde(alias = "HTTP1")]
    Http1,
    #[serde(alias = "H2C")]
    H2c,
}

impl InstanceProtocol {
    pub fn as_str(self) -> &'static str {
        match self {
            InstanceProtocol::Unspecified => "unspecified",
            InstanceProtocol::Http1 => "http1",
            InstanceProtocol::H2c => "h2c",
        }
    }
}

impl fmt::Display for InstanceProtocol {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for InstanceProtocol {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "unspecified" => Ok(InstanceProtocol::Unspecified),
            "http1" => Ok(InstanceProtocol::Http1),
            "h2c" => Ok(InstanceProtocol::H2c),
            _ => Err(format!("{s:?} is not one of http1, h2c, unspecified")),
        }
    }
}

fn is_unspecified(protocol: &InstanceProtocol) -> bool {
    *protocol == InstanceProtocol::Unspecified
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum Health {
    /// Not probed yet. Routable: a router ejects it locally if it fails.
    #[default]
    Unknown,
    Healthy,
    Unhealthy,
}

impl Health {
    pub fn routable(self) -> bool {
        self != Health::Unhealthy
    }
}

impl fmt::Display for Health {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Health::Unknown => "unknown",
            Health::Healthy => "healthy",
            Health::Unhealthy => "unhealthy",
        })
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase")]
pub struct Instance {
    pub instance_id: InstanceId,
    pub endpoint_name: EndpointName,
    pub variant_name: VariantName,
    pub url: String,
    #[serde(default)]
    pub role: InstanceRole,
    /// Unspecified is left out of the stored JSON, so records written before this field
    /// existed and records that do not set it read the same.
    #[serde(default, skip_serializing_if = "is_unspecified")]
    pub protocol: InstanceProtocol,
    pub weight: f64,
    #[serde(default)]
    pub health: Health,
    #[serde(default)]
    pub health_detail: String,
    /// 0: no lease, the instance stays until deregistered.
    #[serde(default)]
    pub ttl_seconds: u32,
    #[serde(default)]
    pub registered_time_ms: i64,
    /// The store lease the instance lives on (0: none). Internal to the control plane.
    #[serde(default)]
    pub lease_id: i64,
    /// Where the engine publishes its KV-cache events (vLLM's `--kv-events-config`), for
    /// KV_AWARE routing. Left out of the stored JSON when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_events: Option<KvEventsEndpoints>,
    /// LMCACHE disaggregation: the decode instance this prefill instance pushes its KV cache
    /// to (named in the engine's own LMCache config). Left out of the stored JSON when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decode_partner: Option<InstanceId>,
}

/// An engine's KV-cache event sockets: vLLM's ZMQ PUB endpoint and, optionally, its ROUTER
/// replay endpoint (`tcp://host:port` each; routers connect to them).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase", deny_unknown_fields)]
pub struct KvEventsEndpoints {
    pub publisher: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replay: Option<String>,
}

impl KvEventsEndpoints {
    /// Builds the endpoints from the two optional inputs (empty counts as absent), checking
    /// each is `tcp://host:port` and that a replay endpoint comes with a publisher. The error
    /// names `publisher_field` or `replay_field`.
    pub fn parse(
        publisher: Option<&str>,
        replay: Option<&str>,
        publisher_field: &str,
        replay_field: &str,
    ) -> Result<Option<Self>, ValidationError> {
        fn present(value: Option<&str>) -> Option<&str> {
            value.map(str::trim).filter(|text| !text.is_empty())
        }
        match (present(publisher), present(replay)) {
            (None, None) => Ok(None),
            (None, Some(_)) => Err(ValidationError::new(
                replay_field,
                format!("needs {publisher_field} (the event publisher) as well"),
            )),
            (Some(publisher), replay) => Ok(Some(Self {
                publisher: validate_zmq_tcp_endpoint(publisher, publisher_field)?,
                replay: replay
                    .map(|replay| validate_zmq_tcp_endpoint(replay, replay_field))
                    .transpose()?,
            })),
        }
    }
}

/// Checks a ZMQ endpoint a router can connect to: `tcp://host:port` (host a name, an IPv4
/// address or a bracketed IPv6 address; not the bind wildcard `*`; port 1–65535).
pub fn validate_zmq_tcp_endpoint(endpoint: &str, field: &str) -> Result<String, ValidationError> {
    let bad = |why: &str| ValidationError::new(field, format!("{endpoint:?} {why}"));
    let Some(address) = endpoint.strip_prefix("tcp://") else {
        return Err(bad("must look like tcp://host:port"));
    };
    let Some((host, port)) = address.rsplit_once(':') else {
        return Err(bad("needs a port (tcp://host:port)"));
    };
    if host.is_empty() || host == "*" || host.contains('/') || host.chars().any(char::is_whitespace)
    {
        return Err(bad(
            "needs a host routers can connect to (not *), e.g. tcp://10.0.0.7:5557",
        ));
    }
    match port.parse::<u16>() {
        Ok(port) if port > 0 => Ok(endpoint.to_owned()),
        _ => Err(bad("needs a port between 1 and 65535")),
    }
}

/// Checks an instance base URL: `http://host[:port][/path-prefix]`, no query, no fragment.
/// Returns the URL without a trailing slash.
pub fn validate_instance_url(url: &str) -> Result<String, ValidationError> {
    let field = "Url";
    if url.len() > MAX_URL_BYTES {
        return Err(ValidationError::new(
            field,
            format!("is {} bytes long; at most {MAX_URL_BYTES}", url.len()),
        ));
    }
    let uri: http::Uri = url
        .parse()
        .map_err(|err| ValidationError::new(field, format!("{url:?} is not a URL: {err}")))?;
    match uri.scheme_str() {
        Some("http") => {}
        Some("https") => {
            return Err(ValidationError::new(
                field,
                format!("{url:?}: https to instances is not supported yet; use http://"),
            ));
        }
        _ => {
            return Err(ValidationError::new(
                field,
                format!("{url:?} must start with http://"),
            ));
        }
    }
    let Some(authority) = uri.authority() else {
        return Err(ValidationError::new(field, format!("{url:?} has no host")));
    };
    if authority.host().is_empty() || authority.as_str().contains('@') {
        return Err(ValidationError::new(
            field,
            format!("{url:?} needs a host and no user info"),
        ));
    }
    // `http::Uri` accepts any port text and then reports no port: an unusable port would
    // silently become 80.
    let after_host = authority
        .as_str()
        .rsplit_once(']')
        .map_or(authority.as_str(), |(_, rest)| rest);
    if let Some((_, port)) = after_host.rsplit_once(':')
        && !matches!(port.parse::<u16>(), Ok(1..))
    {
        return Err(ValidationError::new(
            field,
            format!("{url:?}: the port {port:?} is not a number in 1..=65535"),
        ));
    }
    if uri.query().is_some() || url.contains('#') {
        return Err(ValidationError::new(
            field,
            format!("{url:?} must not have a query or fragment"),
        ));
    }
    Ok(url.trim_end_matches('/').to_owned())
}

pub fn validate_instance_weight(weight: f64) -> Result<(), ValidationError> {
    if weight.is_finite() && weight > 0.0 && weight <= 1_000_000.0 {
        Ok(())
    } else {
        Err(ValidationError::new(
            "Weight",
            format!("must be above 0 and at most 1000000, got {weight}"),
        ))
    }
}

pub fn validate_ttl(ttl_seconds: u32) -> Result<(), ValidationError> {
    if ttl_seconds == 0 || (2..=MAX_TTL_SECONDS).contains(&ttl_seconds) {
        Ok(())
    } else {
        Err(ValidationError::new(
            "TtlSeconds",
            format!("must be 0 (no lease) or 2..={MAX_TTL_SECONDS}, got {ttl_seconds}"),
        ))
    }
}

pub fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|elapsed| elapsed.as_millis() as i64)
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(variants: Vec<ProductionVariant>) -> EndpointConfig {
        EndpointConfig {
            endpoint_config_name: EndpointConfigName::new("cfg").unwrap(),
            production_variants: variants,
            health_check_config: HealthCheckConfig::default(),
            creation_time_ms: 0,
            disaggregation_config: None,
        }
    }

    fn variant(name: &str, routing: Option<RoutingConfig>) -> ProductionVariant {
        ProductionVariant {
            variant_name: VariantName::new(name).unwrap(),
            model_name: Some("m".into()),
            initial_instance_count: Some(1),
            instance_type: None,
            initial_variant_weight: None,
            routing_config: routing,
        }
    }

    fn prefix(strategy: RoutingStrategy, prefix: Option<(u32, u32)>) -> Option<RoutingConfig> {
        Some(RoutingConfig {
            routing_strategy: strategy,
            prefix_aware_routing_config: prefix.map(|(prefix_length, concurrency_threshold)| {
                PrefixAwareRoutingConfig::sagemaker(prefix_length, concurrency_threshold)
            }),
            kv_aware_routing_config: None,
        })
    }

    fn kv(threshold: Option<u32>, weight: Option<f64>) -> Option<KvAwareRoutingConfig> {
        Some(KvAwareRoutingConfig {
            concurrency_threshold: threshold,
            load_weight: weight,
        })
    }

    fn routing(
        strategy: RoutingStrategy,
        prefix: Option<(u32, u32)>,
        kv: Option<KvAwareRoutingConfig>,
    ) -> Option<RoutingConfig> {
        let mut routing = self::prefix(strategy, prefix)?;
        routing.kv_aware_routing_config = kv;
        Some(routing)
    }

    #[test]
    fn kv_aware_takes_optional_knobs_and_refuses_the_prefix_config() {
        for knobs in [
            None,
            kv(None, None),
            kv(Some(1), Some(0.0)),
            kv(Some(1024), Some(100.0)),
        ] {
            config(vec![variant(
                "a",
                routing(RoutingStrategy::KvAware, None, knobs),
            )])
            .validate()
            .unwrap();
        }
        let base = "ProductionVariants[0].RoutingConfig";
        assert_eq!(
            field_of(&config(vec![variant(
                "a",
                routing(RoutingStrategy::KvAware, Some((4096, 10)), None)
            )])),
            format!("{base}.PrefixAwareRoutingConfig")
        );
        assert_eq!(
            field_of(&config(vec![variant(
                "a",
                routing(
                    RoutingStrategy::PrefixAware,
                    Some((4096, 10)),
                    kv(None, None)
                )
            )])),
            format!("{base}.KvAwareRoutingConfig")
        );
        for (threshold, weight, field) in [
            (Some(0), None, "ConcurrencyThreshold"),
            (Some(1025), None, "ConcurrencyThreshold"),
            (None, Some(-0.1), "LoadWeight"),
            (None, Some(f64::NAN), "LoadWeight"),
            (None, Some(101.0), "LoadWeight"),
        ] {
            assert_eq!(
                field_of(&config(vec![variant(
                    "a",
                    routing(RoutingStrategy::KvAware, None, kv(threshold, weight))
                )])),
                format!("{base}.KvAwareRoutingConfig.{field}")
            );
        }
        let defaults = KvAwareRoutingConfig::default();
        assert_eq!(defaults.concurrency_threshold(), 10);
        assert!((defaults.load_weight() - 0.5).abs() < f64::EPSILON);
        assert_eq!("KV_AWARE".parse(), Ok(RoutingStrategy::KvAware));
    }

    #[test]
    fn kv_events_endpoints() {
        let parse = |publisher, replay| KvEventsEndpoints::parse(publisher, replay, "P", "R");
        assert_eq!(parse(None, None), Ok(None));
        assert_eq!(parse(Some(""), Some(" ")), Ok(None));
        assert_eq!(
            parse(Some("tcp://10.0.0.7:5557"), Some("tcp://[::1]:5558")),
            Ok(Some(KvEventsEndpoints {
                publisher: "tcp://10.0.0.7:5557".into(),
                replay: Some("tcp://[::1]:5558".into()),
            }))
        );
        assert_eq!(parse(None, Some("tcp://h:1")).unwrap_err().field, "R");
        for bad in [
            "http://h:1",
            "tcp://h",
            "tcp://*:5557",
            "tcp://h:0",
            "tcp://h:x",
            "tcp://:1",
        ] {
            assert_eq!(parse(Some(bad), None).unwrap_err().field, "P", "{bad}");
            assert_eq!(
                parse(Some("tcp://h:1"), Some(bad)).unwrap_err().field,
                "R",
                "{bad}"
            );
        }
    }

    fn field_of(config: &EndpointConfig) -> String {
        config.validate().unwrap_err().field
    }

    #[test]
    fn valid_configs_pass() {
        config(vec![variant("a", None)]).validate().unwrap();
        config(vec![variant(
            "a",
            prefix(RoutingStrategy::PrefixAware, Some((1024, 1))),
        )])
        .validate()
        .unwrap();
        config(vec![variant(
            "a",
            prefix(RoutingStrategy::PrefixAware, Some((65536, 1024))),
        )])
        .validate()
        .unwrap();
    }

    #[test]
    fn each_rule_names_its_field() {
        assert_eq!(field_of(&config(vec![])), "ProductionVariants");
        let eleven = (0..11).map(|i| variant(&format!("v{i}"), None)).collect();
        assert_eq!(field_of(&config(eleven)), "ProductionVariants");
        assert_eq!(
            field_of(&config(vec![variant("a", None), variant("a", None)])),
            "ProductionVariants[1].VariantName"
        );
        let base = "ProductionVariants[0].RoutingConfig.PrefixAwareRoutingConfig";
        assert_eq!(
            field_of(&config(vec![variant(
                "a",
                prefix(RoutingStrategy::PrefixAware, None)
            )])),
            base
        );
        assert_eq!(
            field_of(&config(vec![variant(
                "a",
                prefix(RoutingStrategy::Random, Some((4096, 10)))
            )])),
            base
        );
        for (length, threshold, field) in [
            (1023, 10, "PrefixLength"),
            (65537, 10, "PrefixLength"),
            (4096, 0, "ConcurrencyThreshold"),
            (4096, 1025, "ConcurrencyThreshold"),
        ] {
            assert_eq!(
                field_of(&config(vec![variant(
                    "a",
                    prefix(RoutingStrategy::PrefixAware, Some((length, threshold)))
                )])),
                format!("{base}.{field}")
            );
        }
        let mut zero_count = variant("a", None);
        zero_count.initial_instance_count = Some(0);
        assert_eq!(
            field_of(&config(vec![zero_count])),
            "ProductionVariants[0].InitialInstanceCount"
        );
        let mut negative = variant("a", None);
        negative.initial_variant_weight = Some(-1.0);
        assert_eq!(
            field_of(&config(vec![negative])),
            "ProductionVariants[0].InitialVariantWeight"
        );
        let mut all_zero = variant("a", None);
        all_zero.initial_variant_weight = Some(0.0);
        assert_eq!(field_of(&config(vec![all_zero])), "ProductionVariants");
        // Each weight is finite, their sum is not: the weighted draw would break.
        let mut huge = variant("a", None);
        huge.initial_variant_weight = Some(1e308);
        let mut also_huge = variant("b", None);
        also_huge.initial_variant_weight = Some(1e308);
        assert_eq!(
            field_of(&config(vec![huge, also_huge])),
            "ProductionVariants"
        );
        let mut bad_health = config(vec![variant("a", None)]);
        bad_health.health_check_config.path = "health".into();
        assert_eq!(field_of(&bad_health), "HealthCheckConfig.Path");
        bad_health.health_check_config.path = format!("/{}", "h".repeat(MAX_HEALTH_PATH_BYTES));
        assert_eq!(field_of(&bad_health), "HealthCheckConfig.Path");
        let mut long_type = variant("a", None);
        long_type.instance_type = Some("x".repeat(MAX_INSTANCE_TYPE_CHARS + 1));
        assert_eq!(
            field_of(&config(vec![long_type])),
            "ProductionVariants[0].InstanceType"
        );
    }

    #[test]
    fn the_load_balance_extension_is_optional_and_checked() {
        let base = "ProductionVariants[0].RoutingConfig.PrefixAwareRoutingConfig";
        let with = |factor: Option<f64>, slack: Option<u32>| {
            let mut routing = prefix(RoutingStrategy::PrefixAware, Some((4096, 16))).unwrap();
            if let Some(prefix) = routing.prefix_aware_routing_config.as_mut() {
                prefix.load_balance_factor = factor;
                prefix.load_balance_slack = slack;
            }
            config(vec![variant("a", Some(routing))])
        };
        with(None, None).validate().unwrap();
        with(Some(1.0), None).validate().unwrap();
        with(Some(1.25), Some(0)).validate().unwrap();
        with(Some(100.0), Some(1024)).validate().unwrap();
        for (factor, slack, field) in [
            (Some(0.99), None, "LoadBalanceFactor"),
            (Some(100.5), None, "LoadBalanceFactor"),
            (Some(f64::NAN), None, "LoadBalanceFactor"),
            (Some(f64::INFINITY), None, "LoadBalanceFactor"),
            (Some(1.25), Some(1025), "LoadBalanceSlack"),
            (None, Some(2), "LoadBalanceSlack"),
        ] {
            assert_eq!(
                field_of(&with(factor, slack)),
                format!("{base}.{field}"),
                "{factor:?} {slack:?}"
            );
        }
        let sagemaker = PrefixAwareRoutingConfig::sagemaker(4096, 16);
        assert_eq!(sagemaker.load_balance(), None);
        let factor_only = PrefixAwareRoutingConfig {
            load_balance_factor: Some(1.5),
            ..sagemaker
        };
        assert_eq!(
            factor_only.load_balance(),
            Some((1.5, DEFAULT_LOAD_BALANCE_SLACK))
        );
        // Absent fields stay absent in the stored JSON, so a SageMaker config reads back as itself.
        let text = serde_json::to_string(&sagemaker).unwrap();
        assert_eq!(text, r#"{"PrefixLength":4096,"ConcurrencyThreshold":16}"#);
        let both = PrefixAwareRoutingConfig {
            load_balance_slack: Some(3),
            ..factor_only
        };
        let text = serde_json::to_string(&both).unwrap();
        assert_eq!(
            text,
            r#"{"PrefixLength":4096,"ConcurrencyThreshold":16,"LoadBalanceFactor":1.5,"LoadBalanceSlack":3}"#
        );
        assert_eq!(
            serde_json::from_str::<PrefixAwareRoutingConfig>(&text).unwrap(),
            both
        );
    }

    #[test]
    fn instance_urls() {
        assert_eq!(
            validate_instance_url("http://127.0.0.1:8000/").unwrap(),
            "http://127.0.0.1:8000"
        );
        assert_eq!(
            validate_instance_url("http://gw.local/v1-pool").unwrap(),
            "http://gw.local/v1-pool"
        );
        assert_eq!(
            validate_instance_url("http://[::1]:65535").unwrap(),
            "http://[::1]:65535"
        );
        assert!(
            validate_instance_url("http://x:80000")
                .unwrap_err()
                .message
                .contains("port")
        );
        let long = format!("http://x/{}", "a".repeat(MAX_URL_BYTES));
        for bad in [
            long.as_str(),
            "127.0.0.1:8000",
            "ftp://x",
            "https://x",
            "http://",
            "http://x?q=1",
            "http://u@x",
            "http://x:80000",
            "http://x:abc",
            "http://x:0",
            "http://x:",
            "http://[::1]:99999",
        ] {
            assert_eq!(
                validate_instance_url(bad).unwrap_err().field,
                "Url",
                "{bad}"
            );
        }
    }

    #[test]
    fn ttl_and_weight() {
        validate_ttl(0).unwrap();
        validate_ttl(10).unwrap();
        assert!(validate_ttl(1).is_err());
        assert!(validate_ttl(MAX_TTL_SECONDS + 1).is_err());
        validate_instance_weight(1.0).unwrap();
        assert!(validate_instance_weight(0.0).is_err());
        assert!(validate_instance_weight(f64::NAN).is_err());
    }

    #[test]
    fn instance_records_without_a_protocol_read_as_unspecified() {
        let stored = r#"{"InstanceId":"a","EndpointName":"chat","VariantName":"v","Url":"http://127.0.0.1:1","Weight":1.0}"#;
        let instance: Instance = serde_json::from_str(stored).unwrap();
        assert_eq!(instance.protocol, InstanceProtocol::Unspecified);
        assert!(
            !serde_json::to_string(&instance)
                .unwrap()
                .contains("Protocol")
        );
        let h2c = Instance {
            protocol: InstanceProtocol::H2c,
            ..instance
        };
        let text = serde_json::to_string(&h2c).unwrap();
        assert!(text.contains(r#""Protocol":"h2c""#), "{text}");
        assert_eq!(serde_json::from_str::<Instance>(&text).unwrap(), h2c);
        assert_eq!("H2C".parse::<InstanceProtocol>(), Ok(InstanceProtocol::H2c));
        // Upper case too, like Role and Health beside it in a static file.
        assert_eq!(
            serde_json::from_str::<InstanceProtocol>(r#""H2C""#).unwrap(),
            InstanceProtocol::H2c
        );
        assert!("h3".parse::<InstanceProtocol>().is_err());
    }
}
