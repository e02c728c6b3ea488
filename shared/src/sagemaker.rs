//! Reads the JSON that `aws sagemaker create-endpoint-config --production-variants` takes, so
//! a user can paste it unchanged.
//!
//! Fields Switchyard understands are parsed; fields SageMaker knows but Switchyard has no use
//! for (`ServerlessConfig`, `VolumeSizeInGB`, ...) are accepted and reported back so the caller
//! can warn; anything else is refused with the path of the field, which catches typos such as
//! `RoutingStrategyy` before they silently fall back to a default.

use serde_json::{Map, Value};

use crate::error::ValidationError;
use crate::variant::ProductionVariant;

const VARIANT_FIELDS: &[&str] = &[
    "VariantName",
    "ModelName",
    "InitialInstanceCount",
    "InstanceType",
    "InitialVariantWeight",
    "RoutingConfig",
    "MaxInFlightPerInstance",
    "FlowHeadroomPerInstance",
    "FairnessWeights",
    // Switchyard's extensions (a pasted SageMaker config never has them).
    "MigrationLimit",
    "LoraAdapters",
];

/// SageMaker ProductionVariant fields that Switchyard accepts and ignores (botocore 1.44's
/// `sagemaker` model lists them all).
const IGNORED_VARIANT_FIELDS: &[&str] = &[
    "InstancePools",
    "VariantInstanceProvisionTimeoutInSeconds",
    "AcceleratorPartitionLayouts",
    "AcceleratorType",
    "CoreDumpConfig",
    "ServerlessConfig",
    "VolumeSizeInGB",
    "ModelDataDownloadTimeoutInSeconds",
    "ContainerStartupHealthCheckTimeoutInSeconds",
    "EnableSSMAccess",
    "ManagedInstanceScaling",
    "InferenceAmiVersion",
    "CapacityReservationConfig",
];

const ROUTING_FIELDS: &[&str] = &[
    "RoutingStrategy",
    "PrefixAwareRoutingConfig",
    "KvAwareRoutingConfig",
];
/// SageMaker's two fields, then Switchyard's optional bounded-load extension (a pasted
/// SageMaker config never has them, so it means what it means on SageMaker).
const PREFIX_FIELDS: &[&str] = &[
    "PrefixLength",
    "ConcurrencyThreshold",
    "LoadBalanceFactor",
    "LoadBalanceSlack",
];
const KV_FIELDS: &[&str] = &["ConcurrencyThreshold", "LoadWeight", "Tokenizer"];

/// Production variants parsed from SageMaker JSON, with the SageMaker-only fields that were
/// ignored (as `ProductionVariants[i].Field`).
#[derive(Debug, Clone)]
pub struct ParsedVariants {
    pub variants: Vec<ProductionVariant>,
    pub ignored_fields: Vec<String>,
    /// The ignored fields with their values, one map per variant (in order), so that an API
    /// can give them back as it received them.
    pub ignored_values: Vec<Map<String, Value>>,
}

/// Parses `--production-variants`: a JSON array of ProductionVariant objects (a single object
/// is accepted too). Only checks shape; `EndpointConfig::validate` checks the rules.
pub fn parse_production_variants(json: &str) -> Result<ParsedVariants, ValidationError> {
    let value: Value = serde_json::from_str(json).map_err(|err| {
        ValidationError::new("ProductionVariants", format!("is not valid JSON: {err}"))
    })?;
    parse_production_variants_value(value)
}

/// [`parse_production_variants`] of JSON already parsed (a request body's member).
pub fn parse_production_variants_value(value: Value) -> Result<ParsedVariants, ValidationError> {
    let items = match value {
        Value::Array(items) => items,
        object @ Value::Object(_) => vec![object],
        _ => {
            return Err(ValidationError::new(
                "ProductionVariants",
                "must be a JSON array of ProductionVariant objects",
            ));
        }
    };
    let mut ignored_fields = Vec::new();
    let mut ignored_values = Vec::with_capacity(items.len());
    let mut variants = Vec::with_capacity(items.len());
    for (index, mut item) in items.into_iter().enumerate() {
        let path = format!("ProductionVariants[{index}]");
        let Value::Object(object) = &mut item else {
            return Err(ValidationError::new(path, "must be a JSON object"));
        };
        let keys: Vec<String> = object.keys().cloned().collect();
        let mut ignored = Map::new();
        for key in keys {
            if VARIANT_FIELDS.contains(&key.as_str()) {
                continue;
            }
            if IGNORED_VARIANT_FIELDS.contains(&key.as_str()) {
                if let Some(value) = object.remove(&key) {
                    ignored.insert(key.clone(), value);
                }
                ignored_fields.push(format!("{path}.{key}"));
                continue;
            }
            return Err(unknown_field(&path, &key, VARIANT_FIELDS));
        }
        if !object.contains_key("VariantName") {
            return Err(ValidationError::new(
                format!("{path}.VariantName"),
                "is required",
            ));
        }
        if let Some(routing) = object.get("RoutingConfig") {
            check_keys(routing, &format!("{path}.RoutingConfig"), ROUTING_FIELDS)?;
            if let Some(prefix) = routing.get("PrefixAwareRoutingConfig") {
                check_keys(
                    prefix,
                    &format!("{path}.RoutingConfig.PrefixAwareRoutingConfig"),
                    PREFIX_FIELDS,
                )?;
            }
            if let Some(kv) = routing.get("KvAwareRoutingConfig") {
                check_keys(
                    kv,
                    &format!("{path}.RoutingConfig.KvAwareRoutingConfig"),
                    KV_FIELDS,
                )?;
            }
        }
        let variant: ProductionVariant = serde_json::from_value(item)
            .map_err(|err| ValidationError::new(path.clone(), err.to_string()))?;
        variants.push(variant);
        ignored_values.push(ignored);
    }
    Ok(ParsedVariants {
        variants,
        ignored_fields,
        ignored_values,
    })
}

fn check_keys(value: &Value, path: &str, allowed: &[&str]) -> Result<(), ValidationError> {
    let Value::Object(object) = value else {
        return Err(ValidationError::new(path, "must be a JSON object"));
    };
    for key in object.keys() {
        if !allowed.contains(&key.as_str()) {
            return Err(unknown_field(path, key, allowed));
        }
    }
    Ok(())
}

/// The fields of `--disaggregation-config` (Switchyard's extension; see
/// [`crate::disaggregation`]).
const DISAGGREGATION_FIELDS: &[&str] = &[
    "PrefillVariantName",
    "DecodeVariantName",
    "RouteThreshold",
    "PrefillRoutingStrategy",
    "DecodeRoutingStrategy",
    "ThresholdBasis",
    "KvTransferProtocol",
    "Tokenizer",
    "PrefillTimeoutSeconds",
];

/// Parses `--disaggregation-config` (a JSON object). Only checks shape, naming the field;
/// `EndpointConfig::validate` checks it against the variants.
pub fn parse_disaggregation_config(
    json: &str,
) -> Result<crate::disaggregation::DisaggregationConfig, ValidationError> {
    let value: Value = serde_json::from_str(json).map_err(|err| {
        ValidationError::new("DisaggregationConfig", format!("is not valid JSON: {err}"))
    })?;
    parse_disaggregation_config_value(value)
}

/// [`parse_disaggregation_config`] of JSON already parsed (a static file's member).
pub fn parse_disaggregation_config_value(
    value: Value,
) -> Result<crate::disaggregation::DisaggregationConfig, ValidationError> {
    const PATH: &str = "DisaggregationConfig";
    let Value::Object(object) = &value else {
        return Err(ValidationError::new(PATH, "must be a JSON object"));
    };
    for key in object.keys() {
        if !DISAGGREGATION_FIELDS.contains(&key.as_str()) {
            return Err(unknown_field(PATH, key, DISAGGREGATION_FIELDS));
        }
    }
    for key in ["PrefillVariantName", "DecodeVariantName"] {
        if !object.contains_key(key) {
            return Err(ValidationError::new(format!("{PATH}.{key}"), "is required"));
        }
    }
    for (key, value) in object {
        // Each field alone, so that a bad value is named by its field.
        let mut single = Map::new();
        single.insert("PrefillVariantName".into(), Value::String("p".into()));
        single.insert("DecodeVariantName".into(), Value::String("d".into()));
        single.insert(key.clone(), value.clone());
        serde_json::from_value::<crate::disaggregation::DisaggregationConfig>(Value::Object(
            single,
        ))
        .map_err(|err| ValidationError::new(format!("{PATH}.{key}"), err.to_string()))?;
    }
    serde_json::from_value(value).map_err(|err| ValidationError::new(PATH, err.to_string()))
}

fn unknown_field(path: &str, key: &str, allowed: &[&str]) -> ValidationError {
    ValidationError::new(
        format!("{path}.{key}"),
        format!(
            "is not a known field (expected one of {})",
            allowed.join(", ")
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::variant::RoutingStrategy;

    #[test]
    fn reads_a_disaggregation_config_naming_bad_fields() {
        let config = parse_disaggregation_config(
            r#"{"PrefillVariantName":"prefill","DecodeVariantName":"decode","RouteThreshold":4096,"PrefillRoutingStrategy":"PREFIX_AWARE","KvTransferProtocol":"LMCACHE"}"#,
        )
        .unwrap();
        assert_eq!(config.route_threshold(), 4096);
        for (json, field) in [
            (
                r#"{"PrefillVariantName":"p","DecodeVariantName":"d","Treshold":1}"#,
                "DisaggregationConfig.Treshold",
            ),
            (
                r#"{"PrefillVariantName":"p"}"#,
                "DisaggregationConfig.DecodeVariantName",
            ),
            (
                r#"{"PrefillVariantName":"p","DecodeVariantName":"d","PrefillRoutingStrategy":"FASTEST"}"#,
                "DisaggregationConfig.PrefillRoutingStrategy",
            ),
            (
                r#"{"PrefillVariantName":"p","DecodeVariantName":"d","RouteThreshold":"many"}"#,
                "DisaggregationConfig.RouteThreshold",
            ),
            (
                r#"{"PrefillVariantName":"-bad-","DecodeVariantName":"d"}"#,
                "DisaggregationConfig.PrefillVariantName",
            ),
            ("[]", "DisaggregationConfig"),
        ] {
            assert_eq!(
                parse_disaggregation_config(json).unwrap_err().field,
                field,
                "{json}"
            );
        }
    }

    #[test]
    fn parses_the_aws_cli_json() {
        let json = r#"[{"VariantName":"AllTraffic","ModelName":"m","InitialInstanceCount":3,
            "InstanceType":"ml.p5.48xlarge",
            "RoutingConfig":{"RoutingStrategy":"PREFIX_AWARE",
            "PrefixAwareRoutingConfig":{"PrefixLength":4096,"ConcurrencyThreshold":10}}}]"#;
        let parsed = parse_production_variants(json).unwrap();
        assert_eq!(parsed.variants.len(), 1);
        let routing = parsed.variants[0].routing();
        assert_eq!(routing.routing_strategy, RoutingStrategy::PrefixAware);
        assert_eq!(
            routing
                .prefix_aware_routing_config
                .unwrap()
                .concurrency_threshold,
            10
        );
        assert!(parsed.ignored_fields.is_empty());
    }

    #[test]
    fn parses_kv_aware_with_and_without_knobs() {
        let parsed = parse_production_variants(
            r#"[{"VariantName":"a","RoutingConfig":{"RoutingStrategy":"KV_AWARE"}},
            {"VariantName":"b","RoutingConfig":{"RoutingStrategy":"KV_AWARE",
            "KvAwareRoutingConfig":{"ConcurrencyThreshold":4,"LoadWeight":1.5}}}]"#,
        )
        .unwrap();
        assert_eq!(
            parsed.variants[0].routing().routing_strategy,
            RoutingStrategy::KvAware
        );
        assert_eq!(parsed.variants[0].routing().kv_aware_routing_config, None);
        let knobs = parsed.variants[1]
            .routing()
            .kv_aware_routing_config
            .unwrap();
        assert_eq!(knobs.concurrency_threshold(), 4);
        assert!((knobs.load_weight() - 1.5).abs() < f64::EPSILON);
        let err = parse_production_variants(
            r#"[{"VariantName":"a","RoutingConfig":{"RoutingStrategy":"KV_AWARE",
            "KvAwareRoutingConfig":{"Threshold":4}}}]"#,
        )
        .unwrap_err();
        assert_eq!(
            err.field,
            "ProductionVariants[0].RoutingConfig.KvAwareRoutingConfig.Threshold"
        );
    }

    #[test]
    fn sagemaker_only_fields_are_reported_not_refused() {
        let json = r#"[{"VariantName":"a","VolumeSizeInGB":100}]"#;
        let parsed = parse_production_variants(json).unwrap();
        assert_eq!(
            parsed.ignored_fields,
            ["ProductionVariants[0].VolumeSizeInGB"]
        );
        assert_eq!(
            Value::Object(parsed.ignored_values[0].clone()),
            serde_json::json!({"VolumeSizeInGB": 100})
        );
    }

    #[test]
    fn typos_are_refused_with_the_path() {
        let err = parse_production_variants(
            r#"[{"VariantName":"a","RoutingConfig":{"RoutingStrategyy":"RANDOM"}}]"#,
        )
        .unwrap_err();
        assert_eq!(
            err.field,
            "ProductionVariants[0].RoutingConfig.RoutingStrategyy"
        );
        let err = parse_production_variants(r#"[{"ModelName":"m"}]"#).unwrap_err();
        assert_eq!(err.field, "ProductionVariants[0].VariantName");
        let err = parse_production_variants(
            r#"[{"VariantName":"a","RoutingConfig":{"RoutingStrategy":"FASTEST"}}]"#,
        )
        .unwrap_err();
        assert_eq!(err.field, "ProductionVariants[0]");
        assert!(err.message.contains("FASTEST"), "{err}");
        let err = parse_production_variants("[{").unwrap_err();
        assert_eq!(err.field, "ProductionVariants");
    }
    #[test]
    fn reads_the_load_balance_extension() {
        let json = r#"[{"VariantName":"a","RoutingConfig":{"RoutingStrategy":"PREFIX_AWARE",
            "PrefixAwareRoutingConfig":{"PrefixLength":4096,"ConcurrencyThreshold":16,
            "LoadBalanceFactor":1.25,"LoadBalanceSlack":1}}}]"#;
        let prefix = parse_production_variants(json).unwrap().variants[0]
            .routing()
            .prefix_aware_routing_config
            .unwrap();
        assert_eq!(prefix.load_balance(), Some((1.25, 1)));
        let err = parse_production_variants(
            r#"[{"VariantName":"a","RoutingConfig":{"RoutingStrategy":"PREFIX_AWARE",
            "PrefixAwareRoutingConfig":{"PrefixLength":4096,"ConcurrencyThreshold":16,"LoadBalanceFactr":1.25}}}]"#,
        )
        .unwrap_err();
        assert_eq!(
            err.field,
            "ProductionVariants[0].RoutingConfig.PrefixAwareRoutingConfig.LoadBalanceFactr"
        );
        assert!(err.message.contains("LoadBalanceFactor"), "{err}");
        let err = parse_production_variants(
            r#"[{"VariantName":"a","RoutingConfig":{"RoutingStrategy":"PREFIX_AWARE",
            "PrefixAwareRoutingConfig":{"PrefixLength":4096,"ConcurrencyThreshold":16,"LoadBalanceFactor":"high"}}}]"#,
        )
        .unwrap_err();
        assert_eq!(err.field, "ProductionVariants[0]");
    }
}
