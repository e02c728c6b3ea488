//! The configuration model, shaped like SageMaker's: endpoint configs with production
//! variants ([`crate::variant`]), and endpoints that point at a config.
//!
//! These are the domain types every crate works with. They serialise to the JSON that
//! `aws sagemaker create-endpoint-config --production-variants` takes (PascalCase), which is
//! also the form stored in etcd. `validate()` enforces every rule of PRODUCT.md and names the
//! offending field in SageMaker's spelling.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::disaggregation::DisaggregationConfig;
use crate::error::ValidationError;
use crate::names::{EndpointConfigName, EndpointName};
use crate::variant::{ProductionVariant, validate_variant};

pub const MIN_VARIANTS: usize = 1;
pub const MAX_VARIANTS: usize = 10;
/// Longest health-check path, in bytes.
pub const MAX_HEALTH_PATH_BYTES: usize = 1024;

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
    pub disaggregation_config: Option<DisaggregationConfig>,
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
            // A request's `model` is either a ModelName or an adapter, never both.
            if let Some((position, adapter)) =
                variant
                    .lora_adapters()
                    .iter()
                    .enumerate()
                    .find(|(_, adapter)| {
                        self.production_variants
                            .iter()
                            .any(|other| other.model_name.as_deref() == Some(adapter.as_str()))
                    })
            {
                return Err(ValidationError::new(
                    format!("ProductionVariants[{index}].LoraAdapters[{position}]"),
                    format!("{adapter:?} is a ModelName of this endpoint config, not an adapter"),
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::*;

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
            model_name: Some("m".into()),
            initial_instance_count: Some(1),
            routing_config: routing,
            ..ProductionVariant::named(VariantName::new(name).unwrap())
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
            tokenizer: None,
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
    fn max_in_flight_per_instance_is_optional_and_refused_out_of_range_by_name() {
        let capped = |cap| ProductionVariant {
            max_in_flight_per_instance: cap,
            ..variant("a", None)
        };
        for cap in [None, Some(1), Some(65536)] {
            config(vec![capped(cap)]).validate().unwrap();
        }
        for cap in [0, 65537] {
            assert_eq!(
                field_of(&config(vec![capped(Some(cap))])),
                "ProductionVariants[0].MaxInFlightPerInstance"
            );
        }
        // FlowHeadroomPerInstance: in range, and only with a cap to add to.
        let headroom = |cap, headroom| ProductionVariant {
            max_in_flight_per_instance: cap,
            flow_headroom_per_instance: Some(headroom),
            ..variant("a", None)
        };
        config(vec![headroom(Some(4), 2)]).validate().unwrap();
        for bad in [
            headroom(None, 2),
            headroom(Some(4), 0),
            headroom(Some(4), 65537),
        ] {
            assert_eq!(
                field_of(&config(vec![bad])),
                "ProductionVariants[0].FlowHeadroomPerInstance"
            );
        }
        // FairnessWeights: weights in range, ids named.
        let weighted = |id: &str, weight: f64| ProductionVariant {
            fairness_weights: Some([(id.to_owned(), weight)].into_iter().collect()),
            ..variant("a", None)
        };
        config(vec![weighted("gold", 3.0)]).validate().unwrap();
        assert_eq!(
            field_of(&config(vec![weighted("gold", 0.0)])),
            "ProductionVariants[0].FairnessWeights.gold"
        );
        assert_eq!(
            field_of(&config(vec![weighted("", 1.0)])),
            "ProductionVariants[0].FairnessWeights"
        );
        // LoraAdapters: names of 1-256 characters, each once, never the ModelName.
        let adapters = |names: &[&str]| ProductionVariant {
            lora_adapters: Some(names.iter().map(|name| (*name).to_owned()).collect()),
            ..variant("a", None)
        };
        config(vec![adapters(&["sql-lora", "chat-lora"])])
            .validate()
            .unwrap();
        config(vec![adapters(&[])]).validate().unwrap();
        let long = "x".repeat(257);
        for (names, field) in [
            (&["a", ""][..], "ProductionVariants[0].LoraAdapters[1]"),
            (&["a", "a"][..], "ProductionVariants[0].LoraAdapters[1]"),
            (&["m"][..], "ProductionVariants[0].LoraAdapters[0]"),
            (
                &[long.as_str()][..],
                "ProductionVariants[0].LoraAdapters[0]",
            ),
            (&["tab\there"][..], "ProductionVariants[0].LoraAdapters[0]"),
        ] {
            assert_eq!(field_of(&config(vec![adapters(names)])), field, "{names:?}");
        }
        let many: Vec<String> = (0..257).map(|index| format!("a{index}")).collect();
        let many: Vec<&str> = many.iter().map(String::as_str).collect();
        assert_eq!(
            field_of(&config(vec![adapters(&many)])),
            "ProductionVariants[0].LoraAdapters"
        );
        let parsed = crate::sagemaker::parse_production_variants(
            r#"[{"VariantName":"a","ModelName":"m","LoraAdapters":["sql-lora"]}]"#,
        )
        .unwrap();
        assert_eq!(parsed.variants[0].lora_adapters(), ["sql-lora".to_owned()]);
        // Read from SageMaker-shaped JSON beside RoutingConfig, and absent by default.
        let parsed = crate::sagemaker::parse_production_variants(
            r#"[{"VariantName":"a","MaxInFlightPerInstance":8},{"VariantName":"b"}]"#,
        )
        .unwrap();
        assert_eq!(parsed.variants[0].max_in_flight_per_instance, Some(8));
        assert_eq!(parsed.variants[1].max_in_flight_per_instance, None);
        assert!(
            !serde_json::to_string(&parsed.variants[1])
                .unwrap()
                .contains("MaxInFlightPerInstance")
        );
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
        let fields = KvEventsFields {
            publisher: "P",
            replay: "R",
            data_parallel_size: "D",
        };
        let parse_dp =
            |publisher, replay, size| KvEventsEndpoints::parse(publisher, replay, size, fields);
        let parse = |publisher, replay| parse_dp(publisher, replay, None);
        assert_eq!(parse(None, None), Ok(None));
        assert_eq!(parse(Some(""), Some(" ")), Ok(None));
        assert_eq!(parse_dp(None, None, Some(0)), Ok(None));
        assert_eq!(
            parse(Some("tcp://10.0.0.7:5557"), Some("tcp://[::1]:5558")),
            Ok(Some(KvEventsEndpoints::single(
                "tcp://10.0.0.7:5557",
                Some("tcp://[::1]:5558")
            )))
        );
        // Data parallel: rank r on each port + r.
        let dp = parse_dp(Some("tcp://h:5557"), Some("tcp://[::1]:6000"), Some(4))
            .unwrap()
            .unwrap();
        assert_eq!(dp.data_parallel_size, 4);
        assert_eq!(
            dp.rank(0),
            KvEventsEndpoints::single("tcp://h:5557", Some("tcp://[::1]:6000"))
        );
        assert_eq!(
            dp.rank(3),
            KvEventsEndpoints::single("tcp://h:5560", Some("tcp://[::1]:6003"))
        );
        assert_eq!(parse_dp(None, None, Some(2)).unwrap_err().field, "D");
        assert_eq!(
            parse_dp(Some("tcp://h:1"), None, Some(MAX_DATA_PARALLEL_SIZE + 1))
                .unwrap_err()
                .field,
            "D"
        );
        assert!(parse_dp(Some("tcp://h:65534"), None, Some(2)).is_ok());
        // vLLM's usual 5557 and 5558 cannot serve two ranks: rank 1 would publish on 5558.
        let overlap = parse_dp(Some("tcp://h:5557"), Some("tcp://h:5558"), Some(2)).unwrap_err();
        assert_eq!(overlap.field, "D");
        assert!(overlap.message.contains("overlap"), "{overlap:?}");
        assert!(parse_dp(Some("tcp://h:5557"), Some("tcp://h:5559"), Some(2)).is_ok());
        assert!(parse_dp(Some("tcp://h:5557"), Some("tcp://g:5558"), Some(2)).is_ok());
        let past = parse_dp(Some("tcp://h:1"), Some("tcp://h:65535"), Some(2)).unwrap_err();
        assert_eq!(past.field, "D");
        assert!(past.message.contains("65535"), "{past:?}");
        // Stored records written before the field existed read as one rank, and one rank is
        // left out.
        let stored: KvEventsEndpoints =
            serde_json::from_str(r#"{"Publisher":"tcp://h:1"}"#).unwrap();
        assert_eq!(stored.data_parallel_size, 1);
        assert_eq!(
            serde_json::to_string(&stored).unwrap(),
            r#"{"Publisher":"tcp://h:1"}"#
        );
        assert!(
            serde_json::to_string(&dp)
                .unwrap()
                .contains(r#""DataParallelSize":4"#)
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
