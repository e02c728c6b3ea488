//! The router's configuration without a control plane (`--config FILE`): endpoints, their
//! SageMaker-shaped production variants and their instances, in JSON or YAML, checked as the
//! control plane checks what it stores (the field named), then loaded into the membership
//! (`Membership::load_static`).

use std::path::Path;

use serde::Deserialize;
use switchyard_shared::{
    EndpointConfig, EndpointConfigName, EndpointName, HealthCheckConfig, Instance, InstanceId,
    InstanceProtocol, InstanceRole, KvEventsEndpoints, ProductionVariant, ValidationError,
    VariantName, sagemaker, validate_instance_url, validate_instance_weight,
};

/// The validated content of a `--config` file.
#[derive(Debug, Clone)]
pub struct StaticConfig {
    pub endpoints: Vec<(EndpointName, EndpointConfig)>,
    pub instances: Vec<Instance>,
}

#[derive(Deserialize)]
#[serde(rename_all = "PascalCase", deny_unknown_fields)]
struct FileRoot {
    endpoints: Vec<FileEndpoint>,
}

#[derive(Deserialize)]
#[serde(rename_all = "PascalCase", deny_unknown_fields)]
struct FileEndpoint {
    endpoint_name: String,
    production_variants: serde_json::Value,
    /// Disaggregated prefill/decode, the JSON of `--disaggregation-config`.
    disaggregation_config: Option<serde_json::Value>,
    #[serde(default)]
    instances: Vec<FileInstance>,
}

#[derive(Deserialize)]
#[serde(rename_all = "PascalCase", deny_unknown_fields)]
struct FileInstance {
    url: String,
    instance_id: Option<String>,
    variant_name: Option<String>,
    weight: Option<f64>,
    /// both, prefill or decode, in any case.
    role: Option<String>,
    #[serde(default)]
    protocol: InstanceProtocol,
    /// vLLM's KV-event publisher, `tcp://host:port` (KV_AWARE).
    kv_events: Option<String>,
    /// Its replay socket, `tcp://host:port`.
    kv_events_replay: Option<String>,
    /// A data-parallel engine's ranks (rank r on each KV-event port + r).
    kv_events_data_parallel_size: Option<u32>,
    /// LMCACHE disaggregation: the InstanceId of the decoder this prefill instance pushes to.
    decode_partner: Option<String>,
    /// LMCACHE_PD disaggregation: a decode instance's LMCache receiver
    /// (`{Host, InitPorts, AllocPorts, BufferTokens}`).
    lmcache_receiver: Option<switchyard_shared::LmcacheReceiver>,
}

/// Reads a static configuration (JSON, or YAML by extension `.yaml`/`.yml`):
///
/// ```yaml
/// Endpoints:
///   - EndpointName: chat
///     ProductionVariants:        # the same JSON as `aws sagemaker create-endpoint-config`
///       - VariantName: AllTraffic
///         ModelName: meta-llama/Llama-3.1-8B-Instruct
///         RoutingConfig:
///           RoutingStrategy: PREFIX_AWARE
///           PrefixAwareRoutingConfig: {PrefixLength: 4096, ConcurrencyThreshold: 10}
///           # Switchyard's bounded-load extension (optional; absent: SageMaker's semantics):
///           # PrefixAwareRoutingConfig: {PrefixLength: 4096, ConcurrencyThreshold: 16,
///           #                            LoadBalanceFactor: 1.25, LoadBalanceSlack: 2}
///     Instances:
///       - Url: http://10.0.0.7:8000    # InstanceId defaults to the URL's host:port,
///       - Url: http://10.0.0.8:8000    # VariantName to the only variant
///         Protocol: h2c                # http1 or h2c; default: --upstream-protocol
///         KvEvents: tcp://10.0.0.8:5557        # vLLM's KV-event publisher (KV_AWARE)
///         KvEventsReplay: tcp://10.0.0.8:5558  # and its replay socket
/// ```
pub fn read_static_config(path: &Path) -> Result<StaticConfig, StaticConfigError> {
    let file = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|source| StaticConfigError::Read {
        file: file.clone(),
        source,
    })?;
    let yaml = matches!(
        path.extension().and_then(|extension| extension.to_str()),
        Some("yaml" | "yml")
    );
    parse_static_text(&text, yaml).map_err(|source| StaticConfigError::Invalid { file, source })
}

/// A `--config` file that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum StaticConfigError {
    #[error("--config {file}: {source}")]
    Read {
        file: String,
        source: std::io::Error,
    },
    #[error("--config {file}: {source}")]
    Invalid { file: String, source: ParseError },
}

/// Why the text of a static configuration was refused.
#[derive(Debug, thiserror::Error)]
pub enum ParseError {
    #[error("{0}")]
    Yaml(#[from] serde_yaml::Error),
    #[error("{0}")]
    Json(#[from] serde_json::Error),
    #[error("{0}")]
    Invalid(#[from] ValidationError),
}

/// Parses and validates the text of a static configuration (YAML, or JSON).
pub fn parse_static_text(text: &str, yaml: bool) -> Result<StaticConfig, ParseError> {
    let root: FileRoot = if yaml {
        serde_yaml::from_str(text)?
    } else {
        serde_json::from_str(text)?
    };
    Ok(parse_static(root)?)
}

/// A JSON configuration's checks alone (for tests that name the failing field).
#[cfg(test)]
pub(crate) fn parse_json(json: &str) -> Result<StaticConfig, ValidationError> {
    parse_static(serde_json::from_str(json).expect("JSON"))
}

fn parse_static(root: FileRoot) -> Result<StaticConfig, ValidationError> {
    let mut endpoints = Vec::new();
    let mut instances = Vec::new();
    for (index, endpoint) in root.endpoints.into_iter().enumerate() {
        let at = |field: &str| format!("Endpoints[{index}].{field}");
        let name = EndpointName::new(&endpoint.endpoint_name)
            .map_err(|err| ValidationError::new(at("EndpointName"), err.to_string()))?;
        let parsed =
            sagemaker::parse_production_variants(&endpoint.production_variants.to_string())
                .map_err(|err| ValidationError::new(at(&err.field), err.message))?;
        let disaggregation_config = endpoint
            .disaggregation_config
            .map(sagemaker::parse_disaggregation_config_value)
            .transpose()
            .map_err(|err| ValidationError::new(at(&err.field), err.message))?;
        let config = EndpointConfig {
            endpoint_config_name: EndpointConfigName::new(name.as_str())
                .map_err(|err| ValidationError::new(at("EndpointName"), err.to_string()))?,
            production_variants: parsed.variants,
            health_check_config: HealthCheckConfig::default(),
            creation_time_ms: 0,
            disaggregation_config,
        };
        config
            .validate()
            .map_err(|err| ValidationError::new(at(&err.field), err.message))?;
        for (position, instance) in endpoint.instances.into_iter().enumerate() {
            let at = |field: &str| format!("Endpoints[{index}].Instances[{position}].{field}");
            let url = validate_instance_url(&instance.url)
                .map_err(|err| ValidationError::new(at("Url"), err.message))?;
            let variant = match &instance.variant_name {
                Some(variant) => VariantName::new(variant)
                    .map_err(|err| ValidationError::new(at("VariantName"), err.to_string()))?,
                None if config.production_variants.len() == 1 => {
                    config.production_variants[0].variant_name.clone()
                }
                None => {
                    return Err(ValidationError::new(
                        at("VariantName"),
                        "is required when the endpoint has several variants",
                    ));
                }
            };
            if !config
                .production_variants
                .iter()
                .any(|candidate: &ProductionVariant| candidate.variant_name == variant)
            {
                return Err(ValidationError::new(
                    at("VariantName"),
                    format!("{variant} is not a variant of this endpoint"),
                ));
            }
            let default_id = url
                .trim_start_matches("http://")
                .split('/')
                .next()
                .unwrap_or_default()
                .to_owned();
            let id = InstanceId::new(instance.instance_id.as_deref().unwrap_or(&default_id))
                .map_err(|err| ValidationError::new(at("InstanceId"), err.to_string()))?;
            let kv_events = KvEventsEndpoints::parse(
                instance.kv_events.as_deref(),
                instance.kv_events_replay.as_deref(),
                instance.kv_events_data_parallel_size,
                switchyard_shared::KvEventsFields {
                    publisher: &at("KvEvents"),
                    replay: &at("KvEventsReplay"),
                    data_parallel_size: &at("KvEventsDataParallelSize"),
                },
            )?;
            let weight = instance.weight.unwrap_or(1.0);
            validate_instance_weight(weight)
                .map_err(|err| ValidationError::new(at("Weight"), err.message))?;
            let decode_partner = instance
                .decode_partner
                .as_deref()
                .map(InstanceId::new)
                .transpose()
                .map_err(|err| ValidationError::new(at("DecodePartner"), err.to_string()))?;
            if let Some(receiver) = &instance.lmcache_receiver {
                receiver.validate(&at("LmcacheReceiver"))?;
            }
            let role = instance
                .role
                .as_deref()
                .map(str::parse::<InstanceRole>)
                .transpose()
                .map_err(|err| ValidationError::new(at("Role"), err))?
                .unwrap_or_default();
            switchyard_shared::disaggregation::check_instance_place(
                config.disaggregation_config.as_ref(),
                &variant,
                role,
                (
                    decode_partner.is_some(),
                    instance.lmcache_receiver.is_some(),
                ),
            )
            .map_err(|err| ValidationError::new(at(&err.field), err.message))?;
            if instances.iter().any(|existing: &Instance| {
                existing.endpoint_name == name && existing.instance_id == id
            }) {
                return Err(ValidationError::new(
                    at("InstanceId"),
                    format!("{id} appears twice in this endpoint"),
                ));
            }
            instances.push(Instance {
                role,
                protocol: instance.protocol,
                weight,
                kv_events,
                decode_partner,
                lmcache_receiver: instance.lmcache_receiver,
                ..Instance::new(id, name.clone(), variant, url)
            });
        }
        if endpoints
            .iter()
            .any(|(existing, _): &(EndpointName, _)| *existing == name)
        {
            return Err(ValidationError::new(
                at("EndpointName"),
                format!("{name} appears twice"),
            ));
        }
        endpoints.push((name, config));
    }
    Ok(StaticConfig {
        endpoints,
        instances,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(json: &str) -> Result<StaticConfig, ValidationError> {
        parse_json(json)
    }

    #[test]
    fn static_config_defaults() {
        let config = parse(
            r#"{"Endpoints":[{"EndpointName":"chat","ProductionVariants":[{"VariantName":"v"}],
            "Instances":[{"Url":"http://127.0.0.1:9001"},{"Url":"http://127.0.0.1:9002","Weight":2}]}]}"#,
        )
        .unwrap();
        assert_eq!(config.instances.len(), 2);
        assert_eq!(config.instances[0].instance_id.as_str(), "127.0.0.1:9001");
        assert_eq!(config.instances[0].variant_name.as_str(), "v");
        assert_eq!(config.instances[1].weight, 2.0);
    }

    #[test]
    fn static_config_kv_events() {
        let config = parse(
            r#"{"Endpoints":[{"EndpointName":"chat","ProductionVariants":[{"VariantName":"v",
            "RoutingConfig":{"RoutingStrategy":"KV_AWARE"}}],
            "Instances":[{"Url":"http://127.0.0.1:9001","KvEvents":"tcp://127.0.0.1:5557",
            "KvEventsReplay":"tcp://127.0.0.1:5558"},{"Url":"http://127.0.0.1:9002"}]}]}"#,
        )
        .unwrap();
        let kv = config.instances[0].kv_events.clone().unwrap();
        assert_eq!(kv.publisher, "tcp://127.0.0.1:5557");
        assert_eq!(kv.replay.as_deref(), Some("tcp://127.0.0.1:5558"));
        assert_eq!(config.instances[1].kv_events, None);
        let config = parse(
            r#"{"Endpoints":[{"EndpointName":"chat","ProductionVariants":[{"VariantName":"v"}],
            "Instances":[{"Url":"http://127.0.0.1:9001","KvEvents":"tcp://127.0.0.1:5557",
            "KvEventsDataParallelSize":4}]}]}"#,
        )
        .unwrap();
        let kv = config.instances[0].kv_events.clone().unwrap();
        assert_eq!(kv.data_parallel_size, 4);
        let err = parse(
            r#"{"Endpoints":[{"EndpointName":"chat","ProductionVariants":[{"VariantName":"v"}],
            "Instances":[{"Url":"http://127.0.0.1:9001","KvEventsDataParallelSize":2}]}]}"#,
        )
        .unwrap_err();
        assert_eq!(
            err.field,
            "Endpoints[0].Instances[0].KvEventsDataParallelSize"
        );
        let err = parse(
            r#"{"Endpoints":[{"EndpointName":"chat","ProductionVariants":[{"VariantName":"v"}],
            "Instances":[{"Url":"http://127.0.0.1:9001","KvEventsReplay":"tcp://127.0.0.1:5558"}]}]}"#,
        )
        .unwrap_err();
        assert_eq!(err.field, "Endpoints[0].Instances[0].KvEventsReplay");
        let err = parse(
            r#"{"Endpoints":[{"EndpointName":"chat","ProductionVariants":[{"VariantName":"v"}],
            "Instances":[{"Url":"http://127.0.0.1:9001","KvEvents":"tcp://*:5557"}]}]}"#,
        )
        .unwrap_err();
        assert_eq!(err.field, "Endpoints[0].Instances[0].KvEvents");
    }

    #[test]
    fn static_config_errors_name_the_field() {
        let err = parse(
            r#"{"Endpoints":[{"EndpointName":"chat","ProductionVariants":[{"VariantName":"v","RoutingConfig":{"RoutingStrategy":"PREFIX_AWARE"}}]}]}"#,
        )
        .unwrap_err();
        assert_eq!(
            err.field,
            "Endpoints[0].ProductionVariants[0].RoutingConfig.PrefixAwareRoutingConfig"
        );
        let err = parse(
            r#"{"Endpoints":[{"EndpointName":"chat","ProductionVariants":[{"VariantName":"v"}],"Instances":[{"Url":"ftp://x"}]}]}"#,
        )
        .unwrap_err();
        assert_eq!(err.field, "Endpoints[0].Instances[0].Url");
    }
}
