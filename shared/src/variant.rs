//! A production variant and its routing, shaped like SageMaker's `ProductionVariants`
//! (PascalCase JSON, as `aws sagemaker create-endpoint-config` takes), with Switchyard's
//! extensions (bounded loads, KV_AWARE's knobs); `validate_variant` names the offending field.

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};
use serde_with::skip_serializing_none;

use crate::error::{ValidationError, names_at_most, number_in_range, whole_in_range};
use crate::names::VariantName;

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
/// `MaxInFlightPerInstance` (Switchyard's flow-control extension of ProductionVariant).
pub const MAX_IN_FLIGHT_PER_INSTANCE_RANGE: std::ops::RangeInclusive<u32> = 1..=65536;
/// `FlowHeadroomPerInstance` (with `MaxInFlightPerInstance`).
pub const FLOW_HEADROOM_PER_INSTANCE_RANGE: std::ops::RangeInclusive<u32> = 1..=65536;
/// `FairnessWeights`: a fairness id's weight in the flow-control queue.
pub const FAIRNESS_WEIGHT_RANGE: std::ops::RangeInclusive<f64> = 0.01..=100.0;
/// `FairnessWeights`: most ids given weights, and the longest id in bytes.
pub const MAX_FAIRNESS_WEIGHTS: usize = 1000;
pub const MAX_FAIRNESS_ID_BYTES: usize = 256;
/// Longest `InstanceType`, in characters.
pub const MAX_INSTANCE_TYPE_CHARS: usize = 256;
/// `MigrationLimit` (Switchyard's extension of a ProductionVariant): how many times one
/// streamed answer may move to another instance when its engine dies midway.
pub const MIGRATION_LIMIT_RANGE: std::ops::RangeInclusive<u32> = 0..=10;
/// `LoraAdapters`: most adapter names a variant lists, and the longest, in characters.
pub const MAX_LORA_ADAPTERS: usize = 256;
pub const MAX_LORA_ADAPTER_CHARS: usize = 256;

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
#[skip_serializing_none]
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase", deny_unknown_fields)]
pub struct PrefixAwareRoutingConfig {
    pub prefix_length: u32,
    pub concurrency_threshold: u32,
    /// Switchyard extension: `c` in 1–100; absent, SageMaker's semantics.
    pub load_balance_factor: Option<f64>,
    /// Switchyard extension: `s` in 0–1024, only with a factor (default
    /// [`DEFAULT_LOAD_BALANCE_SLACK`]).
    pub load_balance_slack: Option<u32>,
}

/// KV_AWARE's knobs, Switchyard's extension: every field is optional and defaults to the
/// documented value, so a pasted SageMaker config (which has no such object) behaves the same.
#[skip_serializing_none]
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase", deny_unknown_fields)]
pub struct KvAwareRoutingConfig {
    /// Fleet-wide in-flight requests at which an instance stops being preferred for its cached
    /// blocks (1–1024, default 10).
    pub concurrency_threshold: Option<u32>,
    /// How much load counts against matched blocks in the score (0–100, default 0.5; see
    /// `switchyard_policy::kv`).
    pub load_weight: Option<f64>,
    /// The model's tokenizer and chat template, a folder under the routers' `--tokenizer-dir`
    /// (`NAME/tokenizer.json`, `NAME/tokenizer_config.json`, `NAME/chat_template.jinja`):
    /// with it the routers compute a prompt's token ids themselves instead of asking an
    /// engine's `/tokenize` (also for a disaggregated endpoint's KV_AWARE prefill and
    /// UNCACHED_TOKENS). Absent: the engine is asked.
    pub tokenizer: Option<String>,
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
        if let Some(threshold) = self.concurrency_threshold {
            whole_in_range(
                format!("{field}.ConcurrencyThreshold"),
                &CONCURRENCY_THRESHOLD_RANGE,
                threshold,
                "",
            )?;
        }
        if let Some(weight) = self.load_weight {
            number_in_range(format!("{field}.LoadWeight"), &KV_LOAD_WEIGHT_RANGE, weight)?;
        }
        if let Some(name) = &self.tokenizer {
            crate::tokenizer_name::validate_engine_tokenizer_name(name).map_err(|err| {
                ValidationError::new(format!("{field}.Tokenizer"), err.to_string())
            })?;
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
        whole_in_range(
            format!("{field}.PrefixLength"),
            &PREFIX_LENGTH_RANGE,
            self.prefix_length,
            "",
        )?;
        whole_in_range(
            format!("{field}.ConcurrencyThreshold"),
            &CONCURRENCY_THRESHOLD_RANGE,
            self.concurrency_threshold,
            "",
        )?;
        if let Some(factor) = self.load_balance_factor {
            number_in_range(
                format!("{field}.LoadBalanceFactor"),
                &LOAD_BALANCE_FACTOR_RANGE,
                factor,
            )?;
        }
        match (self.load_balance_factor, self.load_balance_slack) {
            (None, Some(_)) => Err(ValidationError::new(
                format!("{field}.LoadBalanceSlack"),
                "is only allowed together with LoadBalanceFactor",
            )),
            (_, Some(slack)) => whole_in_range(
                format!("{field}.LoadBalanceSlack"),
                &LOAD_BALANCE_SLACK_RANGE,
                slack,
                "",
            ),
            _ => Ok(()),
        }
    }
}

#[skip_serializing_none]
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase", deny_unknown_fields)]
pub struct RoutingConfig {
    #[serde(default)]
    pub routing_strategy: RoutingStrategy,
    pub prefix_aware_routing_config: Option<PrefixAwareRoutingConfig>,
    pub kv_aware_routing_config: Option<KvAwareRoutingConfig>,
}

#[skip_serializing_none]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase")]
pub struct ProductionVariant {
    pub variant_name: VariantName,
    pub model_name: Option<String>,
    pub initial_instance_count: Option<u32>,
    pub instance_type: Option<String>,
    pub initial_variant_weight: Option<f64>,
    pub routing_config: Option<RoutingConfig>,
    /// Switchyard extension (flow control): at most this many requests in flight on each
    /// instance of the variant, fleet-wide; past it requests wait in the router's queue.
    /// Absent: no cap (SageMaker's behaviour).
    pub max_in_flight_per_instance: Option<u32>,
    /// Switchyard extension (flow control, with MaxInFlightPerInstance): this many more
    /// requests in flight per instance, only for requests that need not wait behind a
    /// backlog: a priority below 0, or a fairness id holding less than its fair share of the
    /// variant's capped slots on the router. Absent: none (the cap is a hard limit).
    pub flow_headroom_per_instance: Option<u32>,
    /// Switchyard extension (flow control): the share of the queue's turns each fairness id
    /// gets, relative to the others (ids not named weigh 1). Absent: every id weighs the same.
    pub fairness_weights: Option<BTreeMap<String, f64>>,
    /// Switchyard extension: a streamed chat or completions answer whose engine dies midway
    /// continues on another instance, at most this many times (0–10; absent or 0: the stream
    /// ends with an error event, as on SageMaker).
    pub migration_limit: Option<u32>,
    /// Switchyard extension: the LoRA adapters the variant's engines serve (vLLM's
    /// `--lora-modules` names). A request whose `model` names one keeps that name upstream
    /// (every other `model` becomes ModelName) and is matched against the KV blocks the engines
    /// cached under that adapter. Absent: no adapter.
    pub lora_adapters: Option<Vec<String>>,
}

impl ProductionVariant {
    /// A variant with only its name: every other field absent (its default).
    pub fn named(variant_name: VariantName) -> Self {
        Self {
            variant_name,
            model_name: None,
            initial_instance_count: None,
            instance_type: None,
            initial_variant_weight: None,
            routing_config: None,
            max_in_flight_per_instance: None,
            flow_headroom_per_instance: None,
            fairness_weights: None,
            migration_limit: None,
            lora_adapters: None,
        }
    }

    pub fn weight(&self) -> f64 {
        self.initial_variant_weight
            .unwrap_or(DEFAULT_VARIANT_WEIGHT)
    }

    pub fn routing(&self) -> RoutingConfig {
        self.routing_config.clone().unwrap_or_default()
    }

    pub fn migration_limit(&self) -> u32 {
        self.migration_limit.unwrap_or(0)
    }

    /// The adapter names of `LoraAdapters` (none when absent).
    pub fn lora_adapters(&self) -> &[String] {
        self.lora_adapters.as_deref().unwrap_or_default()
    }
}

fn validate_lora_adapters(variant: &ProductionVariant, field: &str) -> Result<(), ValidationError> {
    let field = format!("{field}.LoraAdapters");
    let adapters = variant.lora_adapters();
    names_at_most(
        field.as_str(),
        MAX_LORA_ADAPTERS,
        "adapters",
        adapters.len(),
    )?;
    for (index, name) in adapters.iter().enumerate() {
        let at = format!("{field}[{index}]");
        if name.is_empty()
            || name.chars().count() > MAX_LORA_ADAPTER_CHARS
            || name.chars().any(char::is_control)
        {
            return Err(ValidationError::new(
                at,
                format!("must be 1-{MAX_LORA_ADAPTER_CHARS} characters without control characters"),
            ));
        }
        if variant.model_name.as_deref() == Some(name.as_str()) {
            return Err(ValidationError::new(
                at,
                format!("{name:?} is the variant's ModelName, not an adapter"),
            ));
        }
        if adapters[..index].contains(name) {
            return Err(ValidationError::new(
                at,
                format!("{name:?} is listed twice"),
            ));
        }
    }
    Ok(())
}

pub(crate) fn validate_variant(
    variant: &ProductionVariant,
    field: &str,
) -> Result<(), ValidationError> {
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
    if let Some(limit) = variant.migration_limit {
        whole_in_range(
            format!("{field}.MigrationLimit"),
            &MIGRATION_LIMIT_RANGE,
            limit,
            "",
        )?;
    }
    validate_lora_adapters(variant, field)?;
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
    if let Some(cap) = variant.max_in_flight_per_instance {
        whole_in_range(
            format!("{field}.MaxInFlightPerInstance"),
            &MAX_IN_FLIGHT_PER_INSTANCE_RANGE,
            cap,
            "",
        )?;
    }
    if let Some(headroom) = variant.flow_headroom_per_instance {
        let headroom_field = format!("{field}.FlowHeadroomPerInstance");
        whole_in_range(
            headroom_field.as_str(),
            &FLOW_HEADROOM_PER_INSTANCE_RANGE,
            headroom,
            "",
        )?;
        if variant.max_in_flight_per_instance.is_none() {
            return Err(ValidationError::new(
                headroom_field,
                "needs MaxInFlightPerInstance (the cap it adds to)",
            ));
        }
    }
    if let Some(weights) = &variant.fairness_weights {
        let weights_field = format!("{field}.FairnessWeights");
        names_at_most(
            weights_field.as_str(),
            MAX_FAIRNESS_WEIGHTS,
            "fairness ids",
            weights.len(),
        )?;
        for (id, weight) in weights {
            if id.is_empty() || id.len() > MAX_FAIRNESS_ID_BYTES {
                return Err(ValidationError::new(
                    weights_field,
                    format!("ids must be 1-{MAX_FAIRNESS_ID_BYTES} bytes, got {:?}", id),
                ));
            }
            number_in_range(
                format!("{weights_field}.{id}"),
                &FAIRNESS_WEIGHT_RANGE,
                *weight,
            )?;
        }
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
