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
}

impl RoutingStrategy {
    pub const ALL: [RoutingStrategy; 3] = [
        RoutingStrategy::Random,
        RoutingStrategy::LeastOutstandingRequests,
        RoutingStrategy::PrefixAware,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            RoutingStrategy::Random => "RANDOM",
            RoutingStrategy::LeastOutstandingRequests => "LEAST_OUTSTANDING_REQUESTS",
            RoutingStrategy::PrefixAware => "PREFIX_AWARE",
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
                    format!("{s:?} is not one of RANDOM, LEAST_OUTSTANDING_REQUESTS, PREFIX_AWARE"),
                )
            })
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase", deny_unknown_fields)]
pub struct PrefixAwareRoutingConfig {
    pub prefix_length: u32,
    pub concurrency_threshold: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase", deny_unknown_fields)]
pub struct RoutingConfig {
    #[serde(default)]
    pub routing_strategy: RoutingStrategy,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefix_aware_routing_config: Option<PrefixAwareRoutingConfig>,
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
        if self
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
    let prefix_field = format!("{field}.RoutingConfig.PrefixAwareRoutingConfig");
    match (
        routing.routing_strategy,
        routing.prefix_aware_routing_config,
    ) {
        (RoutingStrategy::PrefixAware, None) => Err(ValidationError::new(
            prefix_field,
            "is required when RoutingStrategy is PREFIX_AWARE (PrefixLength and ConcurrencyThreshold)",
        )),
        (RoutingStrategy::PrefixAware, Some(prefix)) => {
            if !PREFIX_LENGTH_RANGE.contains(&prefix.prefix_length) {
                return Err(ValidationError::new(
                    format!("{prefix_field}.PrefixLength"),
                    format!(
                        "must be between {} and {}, got {}",
                        PREFIX_LENGTH_RANGE.start(),
                        PREFIX_LENGTH_RANGE.end(),
                        prefix.prefix_length
                    ),
                ));
            }
            if !CONCURRENCY_THRESHOLD_RANGE.contains(&prefix.concurrency_threshold) {
                return Err(ValidationError::new(
                    format!("{prefix_field}.ConcurrencyThreshold"),
                    format!(
                        "must be between {} and {}, got {}",
                        CONCURRENCY_THRESHOLD_RANGE.start(),
                        CONCURRENCY_THRESHOLD_RANGE.end(),
                        prefix.concurrency_threshold
                    ),
                ));
            }
            Ok(())
        }
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
                PrefixAwareRoutingConfig {
                    prefix_length,
                    concurrency_threshold,
                }
            }),
        })
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
    fn instance_urls() {
        assert_eq!(
            validate_instance_url("http://127.0.0.1:8000/").unwrap(),
            "http://127.0.0.1:8000"
        );
        assert_eq!(
            validate_instance_url("http://gw.local/v1-pool").unwrap(),
            "http://gw.local/v1-pool"
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
