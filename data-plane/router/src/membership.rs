//! Where the routing table comes from: the control plane's sync stream (snapshot, then
//! changes) or a static file for users who run no control plane. Protobuf stops here: sync
//! messages are converted to domain types once, in `apply`.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use arc_swap::ArcSwap;
use serde::Deserialize;
use switchyard_proto::v1 as pb;
use switchyard_shared::{
    EndpointConfig, EndpointConfigName, EndpointName, Health, HealthCheckConfig, Instance,
    InstanceId, InstanceProtocol, InstanceRole, KvEventsEndpoints, ProductionVariant,
    ValidationError, VariantName, sagemaker, validate_instance_url, validate_instance_weight,
};

use crate::table::{self, LoadRegistry, RoutingTable};

/// Membership as the router knows it, and the table built from it.
#[derive(Debug)]
pub struct Membership {
    version: u64,
    endpoints: BTreeMap<EndpointName, EndpointConfig>,
    instances: BTreeMap<(EndpointName, InstanceId), Instance>,
    registry: Arc<LoadRegistry>,
    table: Arc<ArcSwap<RoutingTable>>,
}

impl Membership {
    pub fn new(registry: Arc<LoadRegistry>, table: Arc<ArcSwap<RoutingTable>>) -> Self {
        Self {
            version: 0,
            endpoints: BTreeMap::new(),
            instances: BTreeMap::new(),
            registry,
            table,
        }
    }

    fn publish(&self) {
        let endpoints: Vec<(EndpointName, EndpointConfig)> = self
            .endpoints
            .iter()
            .map(|(name, config)| (name.clone(), config.clone()))
            .collect();
        let instances: Vec<Instance> = self.instances.values().cloned().collect();
        let table = table::build(self.version.max(1), &endpoints, &instances, &self.registry);
        self.table.store(Arc::new(table));
    }

    fn upsert_endpoint(&mut self, routed: pb::RoutedEndpoint) -> Result<(), ValidationError> {
        let endpoint = routed
            .endpoint
            .ok_or_else(|| ValidationError::new("RoutedEndpoint.Endpoint", "missing"))?;
        let name = switchyard_shared::pb::endpoint_name("EndpointName", &endpoint.name)?;
        let config = EndpointConfig::try_from(
            routed
                .config
                .ok_or_else(|| ValidationError::new("RoutedEndpoint.Config", "missing"))?,
        )?;
        config.validate()?;
        self.endpoints.insert(name, config);
        Ok(())
    }

    fn upsert_instance(&mut self, wire: pb::Instance) -> Result<(), ValidationError> {
        let instance = Instance::try_from(wire)?;
        self.instances.insert(
            (instance.endpoint_name.clone(), instance.instance_id.clone()),
            instance,
        );
        Ok(())
    }

    /// Applies one sync message (not FleetLoad) and swaps in the new table.
    pub fn apply(&mut self, message: pb::SyncMessage) {
        use pb::sync_message::Message;
        let version = message.version;
        let result = match message.message {
            Some(Message::Snapshot(snapshot)) => {
                self.endpoints.clear();
                self.instances.clear();
                let mut result = Ok(());
                for routed in snapshot.endpoints {
                    if let Err(err) = self.upsert_endpoint(routed) {
                        result = Err(err);
                    }
                }
                for instance in snapshot.instances {
                    if let Err(err) = self.upsert_instance(instance) {
                        result = Err(err);
                    }
                }
                tracing::info!(
                    version,
                    endpoints = self.endpoints.len(),
                    instances = self.instances.len(),
                    "routing state from snapshot"
                );
                result
            }
            Some(Message::EndpointChanged(routed)) => self.upsert_endpoint(routed),
            Some(Message::EndpointRemoved(removed)) => {
                if let Ok(name) = EndpointName::new(&removed.name) {
                    self.endpoints.remove(&name);
                    self.instances.retain(|(endpoint, _), _| *endpoint != name);
                }
                Ok(())
            }
            Some(Message::InstanceChanged(instance)) => self.upsert_instance(instance),
            Some(Message::InstanceRemoved(removed)) => {
                if let (Ok(endpoint), Ok(id)) = (
                    EndpointName::new(&removed.endpoint_name),
                    InstanceId::new(&removed.id),
                ) {
                    self.instances.remove(&(endpoint, id));
                }
                Ok(())
            }
            Some(Message::FleetLoad(_)) | None => return,
        };
        if let Err(err) = result {
            tracing::warn!(error = %err, "ignored an unreadable part of a sync message");
        }
        self.version = self.version.max(version);
        self.publish();
    }

    /// Replaces everything with a static configuration.
    pub fn load_static(&mut self, file: StaticConfig) {
        self.endpoints = file.endpoints.into_iter().collect();
        self.instances = file
            .instances
            .into_iter()
            .map(|instance| {
                (
                    (instance.endpoint_name.clone(), instance.instance_id.clone()),
                    instance,
                )
            })
            .collect();
        self.version = 1;
        self.publish();
    }
}

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
    #[serde(default)]
    instances: Vec<FileInstance>,
}

#[derive(Deserialize)]
#[serde(rename_all = "PascalCase", deny_unknown_fields)]
struct FileInstance {
    url: String,
    #[serde(default)]
    instance_id: Option<String>,
    #[serde(default)]
    variant_name: Option<String>,
    #[serde(default)]
    weight: Option<f64>,
    #[serde(default)]
    role: Option<InstanceRole>,
    #[serde(default)]
    protocol: InstanceProtocol,
    /// vLLM's KV-event publisher, `tcp://host:port` (KV_AWARE).
    #[serde(default)]
    kv_events: Option<String>,
    /// Its replay socket, `tcp://host:port`.
    #[serde(default)]
    kv_events_replay: Option<String>,
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
pub fn read_static_config(path: &Path) -> Result<StaticConfig, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|err| format!("--config {}: {err}", path.display()))?;
    let yaml = matches!(
        path.extension().and_then(|extension| extension.to_str()),
        Some("yaml" | "yml")
    );
    parse_static_text(&text, yaml).map_err(|err| format!("--config {}: {err}", path.display()))
}

/// Parses and validates the text of a static configuration (YAML, or JSON).
pub fn parse_static_text(text: &str, yaml: bool) -> Result<StaticConfig, String> {
    let root: FileRoot = if yaml {
        serde_yaml::from_str(text).map_err(|err| err.to_string())?
    } else {
        serde_json::from_str(text).map_err(|err| err.to_string())?
    };
    parse_static(root).map_err(|err| err.to_string())
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
        let config = EndpointConfig {
            endpoint_config_name: EndpointConfigName::new(name.as_str())
                .map_err(|err| ValidationError::new(at("EndpointName"), err.to_string()))?,
            production_variants: parsed.variants,
            health_check_config: HealthCheckConfig::default(),
            creation_time_ms: 0,
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
                &at("KvEvents"),
                &at("KvEventsReplay"),
            )?;
            let weight = instance.weight.unwrap_or(1.0);
            validate_instance_weight(weight)
                .map_err(|err| ValidationError::new(at("Weight"), err.message))?;
            if instances.iter().any(|existing: &Instance| {
                existing.endpoint_name == name && existing.instance_id == id
            }) {
                return Err(ValidationError::new(
                    at("InstanceId"),
                    format!("{id} appears twice in this endpoint"),
                ));
            }
            instances.push(Instance {
                instance_id: id,
                endpoint_name: name.clone(),
                variant_name: variant,
                url,
                role: instance.role.unwrap_or_default(),
                protocol: instance.protocol,
                weight,
                health: Health::Unknown,
                health_detail: String::new(),
                ttl_seconds: 0,
                registered_time_ms: 0,
                lease_id: 0,
                kv_events,
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
        parse_static(serde_json::from_str(json).unwrap())
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
    fn static_config_carries_the_load_balance_extension_into_the_table() {
        use switchyard_policy::rank::{LoadBalance, Strategy};
        let config = parse(
            r#"{"Endpoints":[{"EndpointName":"chat","ProductionVariants":[
            {"VariantName":"bounded","RoutingConfig":{"RoutingStrategy":"PREFIX_AWARE","PrefixAwareRoutingConfig":
              {"PrefixLength":4096,"ConcurrencyThreshold":16,"LoadBalanceFactor":1.5,"LoadBalanceSlack":3}}},
            {"VariantName":"default-slack","RoutingConfig":{"RoutingStrategy":"PREFIX_AWARE","PrefixAwareRoutingConfig":
              {"PrefixLength":4096,"ConcurrencyThreshold":16,"LoadBalanceFactor":1.25}}},
            {"VariantName":"sagemaker","RoutingConfig":{"RoutingStrategy":"PREFIX_AWARE","PrefixAwareRoutingConfig":
              {"PrefixLength":4096,"ConcurrencyThreshold":16}}}],
            "Instances":[{"Url":"http://127.0.0.1:9001","VariantName":"bounded"}]}]}"#,
        )
        .unwrap();
        let table = Arc::new(ArcSwap::from_pointee(RoutingTable::default()));
        let mut membership = Membership::new(Arc::default(), Arc::clone(&table));
        membership.load_static(config);
        let table = table.load();
        let endpoint = &table.endpoints[&EndpointName::new("chat").unwrap()];
        let strategies: Vec<Strategy> = endpoint
            .variants
            .iter()
            .map(|variant| variant.strategy)
            .collect();
        let strategy = |factor: f64, slack: u32| Strategy::PrefixAware {
            concurrency_threshold: 16,
            balance: Some(LoadBalance { factor, slack }),
        };
        assert_eq!(
            strategies,
            [
                strategy(1.5, 3),
                strategy(1.25, switchyard_shared::DEFAULT_LOAD_BALANCE_SLACK),
                Strategy::PrefixAware {
                    concurrency_threshold: 16,
                    balance: None
                },
            ]
        );
        let err = parse(
            r#"{"Endpoints":[{"EndpointName":"chat","ProductionVariants":[{"VariantName":"v","RoutingConfig":{"RoutingStrategy":"PREFIX_AWARE",
            "PrefixAwareRoutingConfig":{"PrefixLength":4096,"ConcurrencyThreshold":16,"LoadBalanceFactor":0.5}}}]}]}"#,
        )
        .unwrap_err();
        assert_eq!(
            err.field,
            "Endpoints[0].ProductionVariants[0].RoutingConfig.PrefixAwareRoutingConfig.LoadBalanceFactor"
        );
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
