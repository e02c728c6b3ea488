//! The one place where protobuf types become domain types and back.
//!
//! `TryFrom<pb::X> for X` checks names and enum values and reports the field in SageMaker's
//! spelling; the rules of the configuration model are then checked by `validate()`.

use std::sync::Arc;

use crate::v1 as pb;

use switchyard_shared::disaggregation::{
    DecodeRoutingStrategy, DisaggregationConfig, KvTransferProtocol, PrefillRoutingStrategy,
    ThresholdBasis,
};
use switchyard_shared::sync::{InstanceKey, InstanceLoad, KeyPlacement, StateUpdate};
use switchyard_shared::{
    Endpoint, EndpointConfig, EndpointStatus, Health, HealthCheckConfig, Instance,
    InstanceProtocol, InstanceRole, KvAwareRoutingConfig, KvEventsEndpoints, KvEventsFields,
    LmcacheReceiver, PrefixAwareRoutingConfig, ProductionVariant, RoutingConfig, RoutingStrategy,
    ValidationError,
};
use switchyard_shared::{EndpointConfigName, EndpointName, InstanceId, VariantName};

pub fn parse_name<T>(
    field: &str,
    value: &str,
    parse: impl FnOnce(&str) -> Result<T, switchyard_shared::InvalidName>,
) -> Result<T, ValidationError> {
    parse(value).map_err(|err| ValidationError::new(field, err.to_string()))
}

pub fn endpoint_config_name(
    field: &str,
    value: &str,
) -> Result<EndpointConfigName, ValidationError> {
    parse_name(field, value, EndpointConfigName::new)
}

pub fn endpoint_name(field: &str, value: &str) -> Result<EndpointName, ValidationError> {
    parse_name(field, value, EndpointName::new)
}

pub fn variant_name(field: &str, value: &str) -> Result<VariantName, ValidationError> {
    parse_name(field, value, VariantName::new)
}

pub fn instance_id(field: &str, value: &str) -> Result<InstanceId, ValidationError> {
    parse_name(field, value, InstanceId::new)
}

impl From<RoutingStrategy> for pb::RoutingStrategy {
    fn from(strategy: RoutingStrategy) -> Self {
        match strategy {
            RoutingStrategy::Random => pb::RoutingStrategy::Random,
            RoutingStrategy::LeastOutstandingRequests => {
                pb::RoutingStrategy::LeastOutstandingRequests
            }
            RoutingStrategy::PrefixAware => pb::RoutingStrategy::PrefixAware,
            RoutingStrategy::KvAware => pb::RoutingStrategy::KvAware,
        }
    }
}

fn routing_strategy(field: &str, value: i32) -> Result<RoutingStrategy, ValidationError> {
    match pb::RoutingStrategy::try_from(value) {
        Ok(pb::RoutingStrategy::Unspecified | pb::RoutingStrategy::Random) => {
            Ok(RoutingStrategy::Random)
        }
        Ok(pb::RoutingStrategy::LeastOutstandingRequests) => {
            Ok(RoutingStrategy::LeastOutstandingRequests)
        }
        Ok(pb::RoutingStrategy::PrefixAware) => Ok(RoutingStrategy::PrefixAware),
        Ok(pb::RoutingStrategy::KvAware) => Ok(RoutingStrategy::KvAware),
        Err(_) => Err(ValidationError::new(
            field,
            format!("{value} is not a known routing strategy"),
        )),
    }
}

impl From<&ProductionVariant> for pb::ProductionVariant {
    fn from(variant: &ProductionVariant) -> Self {
        pb::ProductionVariant {
            variant_name: variant.variant_name.to_string(),
            model_name: variant.model_name.clone().unwrap_or_default(),
            initial_instance_count: variant.initial_instance_count.unwrap_or(0),
            instance_type: variant.instance_type.clone().unwrap_or_default(),
            initial_variant_weight: variant.initial_variant_weight,
            routing_config: variant
                .routing_config
                .as_ref()
                .map(|routing| pb::RoutingConfig {
                    routing_strategy: pb::RoutingStrategy::from(routing.routing_strategy) as i32,
                    prefix_aware_routing_config: routing.prefix_aware_routing_config.map(
                        |prefix| pb::PrefixAwareRoutingConfig {
                            prefix_length: prefix.prefix_length,
                            concurrency_threshold: prefix.concurrency_threshold,
                            load_balance_factor: prefix.load_balance_factor,
                            load_balance_slack: prefix.load_balance_slack,
                        },
                    ),
                    kv_aware_routing_config: routing.kv_aware_routing_config.as_ref().map(|kv| {
                        pb::KvAwareRoutingConfig {
                            concurrency_threshold: kv.concurrency_threshold.unwrap_or(0),
                            load_weight: kv.load_weight,
                            tokenizer: kv.tokenizer.clone(),
                        }
                    }),
                }),
            max_in_flight_per_instance: variant.max_in_flight_per_instance,
            flow_headroom_per_instance: variant.flow_headroom_per_instance,
            fairness_weights: variant
                .fairness_weights
                .iter()
                .flatten()
                .map(|(id, weight)| (id.clone(), *weight))
                .collect(),
            migration_limit: variant.migration_limit,
            lora_adapters: variant.lora_adapters().to_vec(),
        }
    }
}

fn production_variant(
    field: &str,
    variant: pb::ProductionVariant,
) -> Result<ProductionVariant, ValidationError> {
    let non_empty = |value: String| (!value.is_empty()).then_some(value);
    let routing_config = match variant.routing_config {
        None => None,
        Some(routing) => Some(RoutingConfig {
            routing_strategy: routing_strategy(
                &format!("{field}.RoutingConfig.RoutingStrategy"),
                routing.routing_strategy,
            )?,
            prefix_aware_routing_config: routing.prefix_aware_routing_config.map(|prefix| {
                PrefixAwareRoutingConfig {
                    prefix_length: prefix.prefix_length,
                    concurrency_threshold: prefix.concurrency_threshold,
                    load_balance_factor: prefix.load_balance_factor,
                    load_balance_slack: prefix.load_balance_slack,
                }
            }),
            // proto3 cannot tell 0 from absent: a 0 threshold means "the default".
            kv_aware_routing_config: routing.kv_aware_routing_config.map(|kv| {
                KvAwareRoutingConfig {
                    concurrency_threshold: (kv.concurrency_threshold != 0)
                        .then_some(kv.concurrency_threshold),
                    load_weight: kv.load_weight,
                    tokenizer: kv.tokenizer,
                }
            }),
        }),
    };
    Ok(ProductionVariant {
        variant_name: variant_name(&format!("{field}.VariantName"), &variant.variant_name)?,
        model_name: non_empty(variant.model_name),
        // proto3 cannot tell 0 from absent; 0 is refused by validate() only when given in JSON.
        initial_instance_count: (variant.initial_instance_count != 0)
            .then_some(variant.initial_instance_count),
        instance_type: non_empty(variant.instance_type),
        initial_variant_weight: variant.initial_variant_weight,
        routing_config,
        max_in_flight_per_instance: variant.max_in_flight_per_instance,
        flow_headroom_per_instance: variant.flow_headroom_per_instance,
        // proto3 maps cannot be absent: empty means no weights.
        fairness_weights: (!variant.fairness_weights.is_empty())
            .then(|| variant.fairness_weights.into_iter().collect()),
        migration_limit: variant.migration_limit,
        // proto3 lists cannot be absent: empty means no adapters.
        lora_adapters: (!variant.lora_adapters.is_empty()).then_some(variant.lora_adapters),
    })
}

impl From<&HealthCheckConfig> for pb::HealthCheckConfig {
    fn from(health: &HealthCheckConfig) -> Self {
        pb::HealthCheckConfig {
            path: health.path.clone(),
            interval_ms: health.interval_ms,
            timeout_ms: health.timeout_ms,
            unhealthy_threshold: health.unhealthy_threshold,
            healthy_threshold: health.healthy_threshold,
        }
    }
}

impl From<pb::HealthCheckConfig> for HealthCheckConfig {
    /// Zero and empty fields take their defaults.
    fn from(health: pb::HealthCheckConfig) -> Self {
        let defaults = HealthCheckConfig::default();
        let or = |value: u32, default: u32| if value == 0 { default } else { value };
        HealthCheckConfig {
            path: if health.path.is_empty() {
                defaults.path
            } else {
                health.path
            },
            interval_ms: or(health.interval_ms, defaults.interval_ms),
            timeout_ms: or(health.timeout_ms, defaults.timeout_ms),
            unhealthy_threshold: or(health.unhealthy_threshold, defaults.unhealthy_threshold),
            healthy_threshold: or(health.healthy_threshold, defaults.healthy_threshold),
        }
    }
}

impl From<&EndpointConfig> for pb::EndpointConfig {
    fn from(config: &EndpointConfig) -> Self {
        pb::EndpointConfig {
            name: config.endpoint_config_name.to_string(),
            production_variants: config.production_variants.iter().map(Into::into).collect(),
            health_check: Some((&config.health_check_config).into()),
            creation_time_ms: config.creation_time_ms,
            disaggregation_config: config.disaggregation_config.as_ref().map(Into::into),
        }
    }
}

impl From<&DisaggregationConfig> for pb::DisaggregationConfig {
    fn from(config: &DisaggregationConfig) -> Self {
        pb::DisaggregationConfig {
            prefill_variant_name: config.prefill_variant_name.to_string(),
            decode_variant_name: config.decode_variant_name.to_string(),
            route_threshold: config.route_threshold,
            prefill_routing_strategy: match config.prefill_routing_strategy {
                None => pb::PrefillRoutingStrategy::Unspecified,
                Some(PrefillRoutingStrategy::RoundRobin) => pb::PrefillRoutingStrategy::RoundRobin,
                Some(PrefillRoutingStrategy::PrefixAware) => {
                    pb::PrefillRoutingStrategy::PrefixAware
                }
                Some(PrefillRoutingStrategy::KvAware) => pb::PrefillRoutingStrategy::KvAware,
                Some(PrefillRoutingStrategy::Session) => pb::PrefillRoutingStrategy::Session,
            } as i32,
            decode_routing_strategy: match config.decode_routing_strategy {
                None => pb::DecodeRoutingStrategy::Unspecified,
                Some(DecodeRoutingStrategy::LeastOutstandingRequests) => {
                    pb::DecodeRoutingStrategy::LeastOutstandingRequests
                }
                Some(DecodeRoutingStrategy::Random) => pb::DecodeRoutingStrategy::Random,
                Some(DecodeRoutingStrategy::PrefixAware) => pb::DecodeRoutingStrategy::PrefixAware,
            } as i32,
            threshold_basis: match config.threshold_basis {
                None => pb::ThresholdBasis::Unspecified,
                Some(ThresholdBasis::PromptTokens) => pb::ThresholdBasis::PromptTokens,
                Some(ThresholdBasis::UncachedTokens) => pb::ThresholdBasis::UncachedTokens,
            } as i32,
            kv_transfer_protocol: match config.kv_transfer_protocol {
                None => pb::KvTransferProtocol::Unspecified,
                Some(KvTransferProtocol::Nixl) => pb::KvTransferProtocol::Nixl,
                Some(KvTransferProtocol::Lmcache) => pb::KvTransferProtocol::Lmcache,
                Some(KvTransferProtocol::LmcachePd) => pb::KvTransferProtocol::LmcachePd,
            } as i32,
            tokenizer: config.tokenizer.clone(),
            prefill_timeout_seconds: config.prefill_timeout_seconds,
        }
    }
}

/// An enum field: unspecified is absent; an unknown number is refused with the field named.
fn wire_enum<W, T>(
    field: &str,
    value: i32,
    convert: impl Fn(W) -> Option<T>,
) -> Result<Option<T>, ValidationError>
where
    W: TryFrom<i32>,
{
    let known = W::try_from(value)
        .map_err(|_| ValidationError::new(field, format!("{value} is not a known value")))?;
    Ok(convert(known))
}

fn disaggregation_config(
    config: pb::DisaggregationConfig,
) -> Result<DisaggregationConfig, ValidationError> {
    let field = |name: &str| format!("DisaggregationConfig.{name}");
    Ok(DisaggregationConfig {
        prefill_variant_name: variant_name(
            &field("PrefillVariantName"),
            &config.prefill_variant_name,
        )?,
        decode_variant_name: variant_name(
            &field("DecodeVariantName"),
            &config.decode_variant_name,
        )?,
        route_threshold: config.route_threshold,
        prefill_routing_strategy: wire_enum(
            &field("PrefillRoutingStrategy"),
            config.prefill_routing_strategy,
            |wire| match wire {
                pb::PrefillRoutingStrategy::Unspecified => None,
                pb::PrefillRoutingStrategy::RoundRobin => Some(PrefillRoutingStrategy::RoundRobin),
                pb::PrefillRoutingStrategy::PrefixAware => {
                    Some(PrefillRoutingStrategy::PrefixAware)
                }
                pb::PrefillRoutingStrategy::KvAware => Some(PrefillRoutingStrategy::KvAware),
                pb::PrefillRoutingStrategy::Session => Some(PrefillRoutingStrategy::Session),
            },
        )?,
        decode_routing_strategy: wire_enum(
            &field("DecodeRoutingStrategy"),
            config.decode_routing_strategy,
            |wire| match wire {
                pb::DecodeRoutingStrategy::Unspecified => None,
                pb::DecodeRoutingStrategy::LeastOutstandingRequests => {
                    Some(DecodeRoutingStrategy::LeastOutstandingRequests)
                }
                pb::DecodeRoutingStrategy::Random => Some(DecodeRoutingStrategy::Random),
                pb::DecodeRoutingStrategy::PrefixAware => Some(DecodeRoutingStrategy::PrefixAware),
            },
        )?,
        threshold_basis: wire_enum(&field("ThresholdBasis"), config.threshold_basis, |wire| {
            match wire {
                pb::ThresholdBasis::Unspecified => None,
                pb::ThresholdBasis::PromptTokens => Some(ThresholdBasis::PromptTokens),
                pb::ThresholdBasis::UncachedTokens => Some(ThresholdBasis::UncachedTokens),
            }
        })?,
        kv_transfer_protocol: wire_enum(
            &field("KvTransferProtocol"),
            config.kv_transfer_protocol,
            |wire| match wire {
                pb::KvTransferProtocol::Unspecified => None,
                pb::KvTransferProtocol::Nixl => Some(KvTransferProtocol::Nixl),
                pb::KvTransferProtocol::Lmcache => Some(KvTransferProtocol::Lmcache),
                pb::KvTransferProtocol::LmcachePd => Some(KvTransferProtocol::LmcachePd),
            },
        )?,
        tokenizer: config.tokenizer,
        prefill_timeout_seconds: config.prefill_timeout_seconds,
    })
}

impl TryFrom<pb::EndpointConfig> for EndpointConfig {
    type Error = ValidationError;
    fn try_from(config: pb::EndpointConfig) -> Result<Self, Self::Error> {
        let production_variants = config
            .production_variants
            .into_iter()
            .enumerate()
            .map(|(index, variant)| {
                production_variant(&format!("ProductionVariants[{index}]"), variant)
            })
            .collect::<Result<_, _>>()?;
        Ok(EndpointConfig {
            endpoint_config_name: endpoint_config_name("EndpointConfigName", &config.name)?,
            production_variants,
            health_check_config: config.health_check.map(Into::into).unwrap_or_default(),
            creation_time_ms: config.creation_time_ms,
            disaggregation_config: config
                .disaggregation_config
                .map(disaggregation_config)
                .transpose()?,
        })
    }
}

impl From<EndpointStatus> for pb::EndpointStatus {
    fn from(status: EndpointStatus) -> Self {
        match status {
            EndpointStatus::Creating => pb::EndpointStatus::Creating,
            EndpointStatus::InService => pb::EndpointStatus::InService,
            EndpointStatus::Updating => pb::EndpointStatus::Updating,
            EndpointStatus::Deleting => pb::EndpointStatus::Deleting,
            EndpointStatus::Failed => pb::EndpointStatus::Failed,
        }
    }
}

impl From<&Endpoint> for pb::Endpoint {
    fn from(endpoint: &Endpoint) -> Self {
        pb::Endpoint {
            name: endpoint.endpoint_name.to_string(),
            endpoint_config_name: endpoint.endpoint_config_name.to_string(),
            status: pb::EndpointStatus::from(endpoint.endpoint_status) as i32,
            creation_time_ms: endpoint.creation_time_ms,
            last_modified_time_ms: endpoint.last_modified_time_ms,
            failure_reason: endpoint.failure_reason.clone(),
        }
    }
}

impl TryFrom<pb::Endpoint> for Endpoint {
    type Error = ValidationError;
    fn try_from(endpoint: pb::Endpoint) -> Result<Self, Self::Error> {
        let endpoint_status = match pb::EndpointStatus::try_from(endpoint.status) {
            Ok(pb::EndpointStatus::Creating) => EndpointStatus::Creating,
            Ok(pb::EndpointStatus::InService | pb::EndpointStatus::Unspecified) => {
                EndpointStatus::InService
            }
            Ok(pb::EndpointStatus::Updating) => EndpointStatus::Updating,
            Ok(pb::EndpointStatus::Deleting) => EndpointStatus::Deleting,
            Ok(pb::EndpointStatus::Failed) => EndpointStatus::Failed,
            Err(_) => {
                return Err(ValidationError::new(
                    "EndpointStatus",
                    format!("{} is not a known status", endpoint.status),
                ));
            }
        };
        Ok(Endpoint {
            endpoint_name: endpoint_name("EndpointName", &endpoint.name)?,
            endpoint_config_name: endpoint_config_name(
                "EndpointConfigName",
                &endpoint.endpoint_config_name,
            )?,
            endpoint_status,
            creation_time_ms: endpoint.creation_time_ms,
            last_modified_time_ms: endpoint.last_modified_time_ms,
            failure_reason: endpoint.failure_reason,
        })
    }
}

impl From<InstanceRole> for pb::InstanceRole {
    fn from(role: InstanceRole) -> Self {
        match role {
            InstanceRole::Both => pb::InstanceRole::Both,
            InstanceRole::Prefill => pb::InstanceRole::Prefill,
            InstanceRole::Decode => pb::InstanceRole::Decode,
        }
    }
}

pub fn instance_role(field: &str, value: i32) -> Result<InstanceRole, ValidationError> {
    match pb::InstanceRole::try_from(value) {
        Ok(pb::InstanceRole::Unspecified | pb::InstanceRole::Both) => Ok(InstanceRole::Both),
        Ok(pb::InstanceRole::Prefill) => Ok(InstanceRole::Prefill),
        Ok(pb::InstanceRole::Decode) => Ok(InstanceRole::Decode),
        Err(_) => Err(ValidationError::new(
            field,
            format!("{value} is not a known role"),
        )),
    }
}

impl From<InstanceProtocol> for pb::InstanceProtocol {
    fn from(protocol: InstanceProtocol) -> Self {
        match protocol {
            InstanceProtocol::Unspecified => pb::InstanceProtocol::Unspecified,
            InstanceProtocol::Http1 => pb::InstanceProtocol::Http1,
            InstanceProtocol::H2c => pb::InstanceProtocol::H2c,
        }
    }
}

pub fn instance_protocol(field: &str, value: i32) -> Result<InstanceProtocol, ValidationError> {
    match pb::InstanceProtocol::try_from(value) {
        Ok(pb::InstanceProtocol::Unspecified) => Ok(InstanceProtocol::Unspecified),
        Ok(pb::InstanceProtocol::Http1) => Ok(InstanceProtocol::Http1),
        Ok(pb::InstanceProtocol::H2c) => Ok(InstanceProtocol::H2c),
        Err(_) => Err(ValidationError::new(
            field,
            format!("{value} is not a known protocol"),
        )),
    }
}

impl From<Health> for pb::HealthStatus {
    fn from(health: Health) -> Self {
        match health {
            Health::Unknown => pb::HealthStatus::Unknown,
            Health::Healthy => pb::HealthStatus::Healthy,
            Health::Unhealthy => pb::HealthStatus::Unhealthy,
        }
    }
}

impl From<&Instance> for pb::Instance {
    fn from(instance: &Instance) -> Self {
        pb::Instance {
            id: instance.instance_id.to_string(),
            endpoint_name: instance.endpoint_name.to_string(),
            variant_name: instance.variant_name.to_string(),
            url: instance.url.clone(),
            role: pb::InstanceRole::from(instance.role) as i32,
            weight: instance.weight,
            health: pb::HealthStatus::from(instance.health) as i32,
            ttl_seconds: instance.ttl_seconds,
            registered_time_ms: instance.registered_time_ms,
            health_detail: instance.health_detail.clone(),
            protocol: pb::InstanceProtocol::from(instance.protocol) as i32,
            kv_events_endpoint: instance
                .kv_events
                .as_ref()
                .map(|kv| kv.publisher.clone())
                .unwrap_or_default(),
            kv_events_replay_endpoint: instance
                .kv_events
                .as_ref()
                .and_then(|kv| kv.replay.clone())
                .unwrap_or_default(),
            kv_events_data_parallel_size: instance
                .kv_events
                .as_ref()
                .filter(|kv| kv.data_parallel_size > 1)
                .map_or(0, |kv| kv.data_parallel_size),
            decode_partner: instance
                .decode_partner
                .as_ref()
                .map(ToString::to_string)
                .unwrap_or_default(),
            lmcache_receiver: instance
                .lmcache_receiver
                .as_ref()
                .map(lmcache_receiver_message),
        }
    }
}

/// An LMCache receiver as its message.
pub fn lmcache_receiver_message(receiver: &LmcacheReceiver) -> pb::LmcacheReceiver {
    pb::LmcacheReceiver {
        host: receiver.host.clone(),
        init_ports: receiver.init_ports.iter().map(|&p| u32::from(p)).collect(),
        alloc_ports: receiver.alloc_ports.iter().map(|&p| u32::from(p)).collect(),
        buffer_tokens: receiver.buffer_tokens.unwrap_or(0),
    }
}

/// An LMCache receiver of an `Instance` or a `RegisterInstanceRequest` (absent: none).
pub fn lmcache_receiver(
    receiver: Option<&pb::LmcacheReceiver>,
) -> Result<Option<LmcacheReceiver>, ValidationError> {
    let Some(receiver) = receiver else {
        return Ok(None);
    };
    let ports = |ports: &[u32], name: &str| {
        ports
            .iter()
            .map(|&port| {
                u16::try_from(port).map_err(|_| {
                    ValidationError::new(
                        format!("LmcacheReceiver.{name}"),
                        format!("ports must be 1 to 65535, got {port}"),
                    )
                })
            })
            .collect::<Result<Vec<u16>, _>>()
    };
    let domain = LmcacheReceiver {
        host: receiver.host.clone(),
        init_ports: ports(&receiver.init_ports, "InitPorts")?,
        alloc_ports: ports(&receiver.alloc_ports, "AllocPorts")?,
        buffer_tokens: (receiver.buffer_tokens != 0).then_some(receiver.buffer_tokens),
    };
    domain.validate("LmcacheReceiver")?;
    Ok(Some(domain))
}

/// A decode partner id (empty: none).
pub fn decode_partner(id: &str) -> Result<Option<InstanceId>, ValidationError> {
    if id.is_empty() {
        Ok(None)
    } else {
        instance_id("DecodePartner", id).map(Some)
    }
}

/// The KV-event endpoints of an `Instance` or a `RegisterInstanceRequest` (empty and 0:
/// none; a data-parallel size of 0 is 1).
pub fn kv_events(
    publisher: &str,
    replay: &str,
    data_parallel_size: u32,
) -> Result<Option<KvEventsEndpoints>, ValidationError> {
    KvEventsEndpoints::parse(
        Some(publisher),
        Some(replay),
        Some(data_parallel_size),
        KvEventsFields {
            publisher: "KvEventsEndpoint",
            replay: "KvEventsReplayEndpoint",
            data_parallel_size: "KvEventsDataParallelSize",
        },
    )
}

impl TryFrom<pb::Instance> for Instance {
    type Error = ValidationError;
    fn try_from(instance: pb::Instance) -> Result<Self, Self::Error> {
        let health = match pb::HealthStatus::try_from(instance.health) {
            Ok(pb::HealthStatus::Healthy) => Health::Healthy,
            Ok(pb::HealthStatus::Unhealthy) => Health::Unhealthy,
            _ => Health::Unknown,
        };
        Ok(Instance {
            instance_id: instance_id("InstanceId", &instance.id)?,
            endpoint_name: endpoint_name("EndpointName", &instance.endpoint_name)?,
            variant_name: variant_name("VariantName", &instance.variant_name)?,
            url: instance.url,
            role: instance_role("Role", instance.role)?,
            protocol: instance_protocol("Protocol", instance.protocol)?,
            weight: instance.weight,
            health,
            health_detail: instance.health_detail,
            ttl_seconds: instance.ttl_seconds,
            registered_time_ms: instance.registered_time_ms,
            lease_id: 0,
            kv_events: kv_events(
                &instance.kv_events_endpoint,
                &instance.kv_events_replay_endpoint,
                instance.kv_events_data_parallel_size,
            )?,
            decode_partner: decode_partner(&instance.decode_partner)?,
            lmcache_receiver: lmcache_receiver(instance.lmcache_receiver.as_ref())?,
        })
    }
}

// ----- RouterSync ---------------------------------------------------------------------------

impl From<&InstanceKey> for pb::InstanceRemoved {
    fn from(key: &InstanceKey) -> Self {
        pb::InstanceRemoved {
            endpoint_name: key.endpoint.to_string(),
            id: key.id.to_string(),
        }
    }
}

fn instance_key(field: &str, endpoint: &str, id: &str) -> Result<InstanceKey, ValidationError> {
    Ok(InstanceKey::new(
        endpoint_name(&format!("{field}.EndpointName"), endpoint)?,
        instance_id(&format!("{field}.InstanceId"), id)?,
    ))
}

impl From<&StateUpdate> for pb::StateUpdate {
    fn from(update: &StateUpdate) -> Self {
        pb::StateUpdate {
            reset: update.reset,
            complete: update.complete,
            configs: update
                .configs
                .iter()
                .map(|config| config.as_ref().into())
                .collect(),
            removed_configs: update
                .removed_configs
                .iter()
                .map(ToString::to_string)
                .collect(),
            endpoints: update
                .endpoints
                .iter()
                .map(|endpoint| endpoint.as_ref().into())
                .collect(),
            removed_endpoints: update
                .removed_endpoints
                .iter()
                .map(ToString::to_string)
                .collect(),
            instances: update
                .instances
                .iter()
                .map(|instance| instance.as_ref().into())
                .collect(),
            removed_instances: update.removed_instances.iter().map(Into::into).collect(),
        }
    }
}

/// Collects what converts; what does not is kept as an error naming it.
#[derive(Debug, Default)]
struct Gather {
    errors: Vec<ValidationError>,
}

impl Gather {
    /// Converts each item of the wire list named `list`; an item that does not convert is
    /// left out and named in the errors as `list[index].field`.
    fn each<W, T>(
        &mut self,
        list: &str,
        wire: impl IntoIterator<Item = W>,
        convert: impl Fn(W) -> Result<T, ValidationError>,
    ) -> Vec<T> {
        let mut kept = Vec::new();
        for (index, item) in wire.into_iter().enumerate() {
            match convert(item) {
                Ok(value) => kept.push(value),
                Err(err) => self.errors.push(ValidationError::new(
                    format!("{list}[{index}].{}", err.field),
                    err.message,
                )),
            }
        }
        kept
    }
}

/// A received `StateUpdate`, with the records that do not convert left out and named in the
/// errors (the rest still applies: one bad record does not hold up a fleet's state).
pub fn state_update(wire: pb::StateUpdate) -> (StateUpdate, Vec<ValidationError>) {
    let mut gather = Gather::default();
    let update = StateUpdate {
        reset: wire.reset,
        complete: wire.complete,
        configs: gather.each("StateUpdate.Configs", wire.configs, |config| {
            EndpointConfig::try_from(config).map(Arc::new)
        }),
        removed_configs: gather.each(
            "StateUpdate.RemovedConfigs",
            &wire.removed_configs,
            |name| endpoint_config_name("Name", name),
        ),
        endpoints: gather.each("StateUpdate.Endpoints", wire.endpoints, |endpoint| {
            Endpoint::try_from(endpoint).map(Arc::new)
        }),
        removed_endpoints: gather.each(
            "StateUpdate.RemovedEndpoints",
            &wire.removed_endpoints,
            |name| endpoint_name("Name", name),
        ),
        instances: gather.each("StateUpdate.Instances", wire.instances, |instance| {
            Instance::try_from(instance).map(Arc::new)
        }),
        removed_instances: gather.each(
            "StateUpdate.RemovedInstances",
            &wire.removed_instances,
            |removed| instance_key("Instance", &removed.endpoint_name, &removed.id),
        ),
    };
    (update, gather.errors)
}

/// A protocol-1 message (a whole `Snapshot` or one change) as the `StateUpdate` with the same
/// effect; `None` for messages that carry no state.
pub fn legacy_state_update(
    message: pb::sync_message::Message,
) -> Option<(StateUpdate, Vec<ValidationError>)> {
    use pb::sync_message::Message;
    let wire = match message {
        Message::Snapshot(snapshot) => {
            let mut wire = pb::StateUpdate {
                reset: true,
                complete: true,
                instances: snapshot.instances,
                ..pb::StateUpdate::default()
            };
            for routed in snapshot.endpoints {
                wire.configs.extend(routed.config);
                wire.endpoints.extend(routed.endpoint);
            }
            wire
        }
        Message::EndpointChanged(routed) => pb::StateUpdate {
            complete: true,
            configs: routed.config.into_iter().collect(),
            endpoints: routed.endpoint.into_iter().collect(),
            ..pb::StateUpdate::default()
        },
        Message::EndpointRemoved(removed) => pb::StateUpdate {
            complete: true,
            removed_endpoints: vec![removed.name],
            ..pb::StateUpdate::default()
        },
        Message::InstanceChanged(instance) => pb::StateUpdate {
            complete: true,
            instances: vec![instance],
            ..pb::StateUpdate::default()
        },
        Message::InstanceRemoved(removed) => pb::StateUpdate {
            complete: true,
            removed_instances: vec![removed],
            ..pb::StateUpdate::default()
        },
        Message::FleetLoad(_) | Message::Update(_) | Message::Placements(_) => return None,
    };
    Some(state_update(wire))
}

/// An endpoint with its config, as protocol 1 sends it.
pub fn routed_endpoint(endpoint: &Endpoint, config: &EndpointConfig) -> pb::RoutedEndpoint {
    pb::RoutedEndpoint {
        endpoint: Some(endpoint.into()),
        config: Some(config.into()),
    }
}

impl From<&InstanceLoad> for pb::InstanceLoad {
    fn from(load: &InstanceLoad) -> Self {
        pb::InstanceLoad {
            endpoint_name: load.key.endpoint.to_string(),
            instance_id: load.key.id.to_string(),
            in_flight: load.in_flight,
        }
    }
}

/// Load figures from the wire; entries with names that are not valid cannot name an instance
/// and are left out (counted in the second value).
pub fn instance_loads(wire: Vec<pb::InstanceLoad>) -> (Vec<InstanceLoad>, usize) {
    let mut skipped = 0;
    let loads = wire
        .into_iter()
        .filter_map(|load| {
            let key = instance_key("Load", &load.endpoint_name, &load.instance_id);
            match key {
                Ok(key) => Some(InstanceLoad {
                    key,
                    in_flight: load.in_flight,
                }),
                Err(_) => {
                    skipped += 1;
                    None
                }
            }
        })
        .collect();
    (loads, skipped)
}

/// Key placements of the wire; the count of those skipped (an unreadable instance name).
pub fn key_placements(wire: Vec<pb::KeyPlacement>) -> (Vec<KeyPlacement>, usize) {
    let total = wire.len();
    let placements: Vec<KeyPlacement> = wire
        .into_iter()
        .filter_map(|placement| {
            let instance = instance_key(
                "Placement",
                &placement.endpoint_name,
                &placement.instance_id,
            )
            .ok()?;
            Some(KeyPlacement {
                instance,
                key: placement.key,
                further: placement.further,
            })
        })
        .collect();
    let skipped = total - placements.len();
    (placements, skipped)
}

impl From<&KeyPlacement> for pb::KeyPlacement {
    fn from(placement: &KeyPlacement) -> Self {
        pb::KeyPlacement {
            endpoint_name: placement.instance.endpoint.to_string(),
            instance_id: placement.instance.id.to_string(),
            key: placement.key,
            further: placement.further,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_placements_cross_the_wire_with_their_further_flag() {
        let placements = [
            KeyPlacement {
                instance: instance_key("Placement", "chat", "i-1").unwrap(),
                key: u64::MAX,
                further: true,
            },
            KeyPlacement {
                instance: instance_key("Placement", "chat", "i-2").unwrap(),
                key: 7,
                further: false,
            },
        ];
        let mut wire: Vec<pb::KeyPlacement> = placements.iter().map(Into::into).collect();
        // A router before the flag sends none: false. An unreadable name is skipped, counted.
        wire.push(pb::KeyPlacement {
            endpoint_name: "chat".into(),
            instance_id: "i-3".into(),
            key: 9,
            ..Default::default()
        });
        wire.push(pb::KeyPlacement {
            endpoint_name: "bad name!".into(),
            instance_id: "i-4".into(),
            key: 1,
            further: true,
        });
        let (read, skipped) = key_placements(wire);
        assert_eq!(skipped, 1);
        assert_eq!(read[..2], placements[..]);
        assert!(!read[2].further);
    }

    /// An endpoint config named `cfg` with the variants of a SageMaker JSON list.
    fn config_from_json(json: &str, creation_time_ms: i64) -> EndpointConfig {
        EndpointConfig {
            endpoint_config_name: EndpointConfigName::new("cfg").unwrap(),
            production_variants: switchyard_shared::sagemaker::parse_production_variants(json)
                .unwrap()
                .variants,
            health_check_config: HealthCheckConfig::default(),
            creation_time_ms,
            disaggregation_config: None,
        }
    }

    #[test]
    fn an_lmcache_receiver_travels_and_is_checked_at_the_edge() {
        let wire = pb::LmcacheReceiver {
            host: "10.0.0.2".into(),
            init_ports: vec![7300, 7301],
            alloc_ports: vec![7400, 7401],
            buffer_tokens: 8192,
        };
        let domain = lmcache_receiver(Some(&wire)).unwrap().unwrap();
        assert_eq!(domain.buffer_tokens, Some(8192));
        assert_eq!(lmcache_receiver_message(&domain), wire);
        assert_eq!(lmcache_receiver(None).unwrap(), None);
        for (bad, field) in [
            (
                pb::LmcacheReceiver {
                    host: String::new(),
                    ..wire.clone()
                },
                "LmcacheReceiver.Host",
            ),
            (
                pb::LmcacheReceiver {
                    init_ports: vec![],
                    ..wire.clone()
                },
                "LmcacheReceiver.InitPorts",
            ),
            (
                pb::LmcacheReceiver {
                    alloc_ports: vec![7400],
                    ..wire.clone()
                },
                "LmcacheReceiver.AllocPorts",
            ),
            (
                pb::LmcacheReceiver {
                    alloc_ports: vec![7400, 70000],
                    ..wire.clone()
                },
                "LmcacheReceiver.AllocPorts",
            ),
            (
                pb::LmcacheReceiver {
                    alloc_ports: vec![7300, 7401],
                    ..wire.clone()
                },
                "LmcacheReceiver.AllocPorts",
            ),
            (
                pb::LmcacheReceiver {
                    host: "a b".into(),
                    ..wire.clone()
                },
                "LmcacheReceiver.Host",
            ),
        ] {
            assert_eq!(
                lmcache_receiver(Some(&bad)).unwrap_err().field,
                field,
                "{bad:?}"
            );
        }
        assert!(
            lmcache_receiver(Some(&pb::LmcacheReceiver {
                host: "::1".into(),
                ..wire
            }))
            .is_ok()
        );
        // The CLI's flags: all absent is none, a port without a host names the host flag.
        let fields = ["--h", "--i", "--a", "--b"];
        assert_eq!(
            LmcacheReceiver::parse(None, None, Some(vec![]), None, fields).unwrap(),
            None
        );
        assert_eq!(
            LmcacheReceiver::parse(None, Some(vec![1]), None, None, fields)
                .unwrap_err()
                .field,
            "--h"
        );
        assert_eq!(
            LmcacheReceiver::parse(Some("h"), Some(vec![1]), Some(vec![2, 3]), None, fields)
                .unwrap_err()
                .field,
            "--a"
        );
    }

    #[test]
    fn endpoint_config_round_trip() {
        let json = r#"[{"VariantName":"AllTraffic","ModelName":"m","InitialInstanceCount":3,
            "InitialVariantWeight":2.5,
            "RoutingConfig":{"RoutingStrategy":"PREFIX_AWARE",
            "PrefixAwareRoutingConfig":{"PrefixLength":4096,"ConcurrencyThreshold":10}}}]"#;
        let config = config_from_json(json, 42);
        let wire = pb::EndpointConfig::from(&config);
        assert_eq!(EndpointConfig::try_from(wire).unwrap(), config);
    }

    #[test]
    fn kv_aware_and_kv_events_round_trip() {
        let json = r#"[{"VariantName":"a","RoutingConfig":{"RoutingStrategy":"KV_AWARE",
            "KvAwareRoutingConfig":{"LoadWeight":2.0}}},
            {"VariantName":"b","MaxInFlightPerInstance":4,"FlowHeadroomPerInstance":2,"FairnessWeights":{"gold":2.5},"RoutingConfig":{"RoutingStrategy":"KV_AWARE",
            "KvAwareRoutingConfig":{"ConcurrencyThreshold":3}}}]"#;
        let config = config_from_json(json, 1);
        let wire = pb::EndpointConfig::from(&config);
        assert_eq!(
            wire.production_variants[0]
                .routing_config
                .as_ref()
                .unwrap()
                .routing_strategy,
            4
        );
        assert_eq!(wire.production_variants[0].max_in_flight_per_instance, None);
        assert_eq!(
            wire.production_variants[1].max_in_flight_per_instance,
            Some(4)
        );
        assert_eq!(EndpointConfig::try_from(wire).unwrap(), config);

        let instance = pb::Instance {
            id: "a".into(),
            endpoint_name: "chat".into(),
            variant_name: "v".into(),
            url: "http://127.0.0.1:1".into(),
            kv_events_endpoint: "tcp://127.0.0.1:5557".into(),
            kv_events_replay_endpoint: "tcp://127.0.0.1:5558".into(),
            role: pb::InstanceRole::Both as i32,
            ..Default::default()
        };
        let domain = Instance::try_from(instance.clone()).unwrap();
        let kv = domain.kv_events.clone().unwrap();
        assert_eq!(kv.publisher, "tcp://127.0.0.1:5557");
        assert_eq!(kv.replay.as_deref(), Some("tcp://127.0.0.1:5558"));
        assert_eq!(kv.data_parallel_size, 1);
        assert_eq!(pb::Instance::from(&domain), instance);
        let data_parallel = pb::Instance {
            kv_events_data_parallel_size: 4,
            kv_events_replay_endpoint: "tcp://127.0.0.1:6557".into(),
            ..instance.clone()
        };
        let domain = Instance::try_from(data_parallel.clone()).unwrap();
        assert_eq!(domain.kv_events.as_ref().unwrap().data_parallel_size, 4);
        assert_eq!(pb::Instance::from(&domain), data_parallel);
        let without_publisher = pb::Instance {
            kv_events_endpoint: String::new(),
            kv_events_replay_endpoint: String::new(),
            ..data_parallel
        };
        assert_eq!(
            Instance::try_from(without_publisher).unwrap_err().field,
            "KvEventsDataParallelSize"
        );
        let bad = pb::Instance {
            kv_events_endpoint: "tcp://*:5557".into(),
            ..instance
        };
        assert_eq!(
            Instance::try_from(bad).unwrap_err().field,
            "KvEventsEndpoint"
        );
    }

    #[test]
    fn bad_names_and_enums_name_the_field() {
        let wire = pb::EndpointConfig {
            name: "bad name".into(),
            ..Default::default()
        };
        assert_eq!(
            EndpointConfig::try_from(wire).unwrap_err().field,
            "EndpointConfigName"
        );
        let wire = pb::EndpointConfig {
            name: "ok".into(),
            production_variants: vec![pb::ProductionVariant {
                variant_name: "v".into(),
                routing_config: Some(pb::RoutingConfig {
                    routing_strategy: 99,
                    prefix_aware_routing_config: None,
                    kv_aware_routing_config: None,
                }),
                ..Default::default()
            }],
            ..Default::default()
        };
        assert_eq!(
            EndpointConfig::try_from(wire).unwrap_err().field,
            "ProductionVariants[0].RoutingConfig.RoutingStrategy"
        );
    }
    #[test]
    fn the_load_balance_extension_round_trips_and_stays_absent_when_absent() {
        let json = r#"[{"VariantName":"AllTraffic","RoutingConfig":{"RoutingStrategy":"PREFIX_AWARE",
            "PrefixAwareRoutingConfig":{"PrefixLength":4096,"ConcurrencyThreshold":16,
            "LoadBalanceFactor":1.25,"LoadBalanceSlack":2}}},
            {"VariantName":"SageMaker","RoutingConfig":{"RoutingStrategy":"PREFIX_AWARE",
            "PrefixAwareRoutingConfig":{"PrefixLength":4096,"ConcurrencyThreshold":16}}}]"#;
        let config = config_from_json(json, 0);
        let wire = pb::EndpointConfig::from(&config);
        let prefix = |index: usize| {
            wire.production_variants[index]
                .routing_config
                .as_ref()
                .unwrap()
                .prefix_aware_routing_config
                .unwrap()
        };
        assert_eq!(prefix(0).load_balance_factor, Some(1.25));
        assert_eq!(prefix(0).load_balance_slack, Some(2));
        assert_eq!(prefix(1).load_balance_factor, None);
        assert_eq!(prefix(1).load_balance_slack, None);
        assert_eq!(EndpointConfig::try_from(wire).unwrap(), config);
    }
}
