//! The fleet's shape: its endpoint configs, endpoints and instances, as admin requests to the
//! control plane and as the state a router receives.

use std::sync::Arc;
use std::time::Instant;

use switchyard_proto::v1 as pb;
use switchyard_proto::v1::admin_client::AdminClient;
use switchyard_shared::sync::StateUpdate;
use switchyard_shared::{
    Endpoint, EndpointConfig, EndpointConfigName, EndpointName, EndpointStatus, HealthCheckConfig,
    Instance, InstanceId, ProductionVariant, VariantName,
};
use tonic::transport::Channel;

use super::args::FleetArgs;

pub const CONFIGS: usize = 10;
pub const VARIANT: &str = "AllTraffic";

pub fn endpoint_name(index: usize) -> String {
    format!("e-{index}")
}

pub fn instance_url(index: usize) -> String {
    // Nothing listens there: probes fail at once, and with the configs' health checks (once
    // an hour, unhealthy after 100 failures) no instance changes health during the run.
    format!("http://127.0.0.1:{}/i-{index}", 20_000 + index % 40_000)
}

pub fn health_check() -> HealthCheckConfig {
    HealthCheckConfig {
        interval_ms: 3_600_000,
        unhealthy_threshold: 100,
        ..HealthCheckConfig::default()
    }
}

pub fn config(index: usize) -> EndpointConfig {
    EndpointConfig {
        endpoint_config_name: EndpointConfigName::new(&format!("cfg-{index}")).expect("name"),
        production_variants: vec![ProductionVariant {
            variant_name: VariantName::new(VARIANT).expect("name"),
            model_name: Some(format!("model-{index}")),
            initial_instance_count: None,
            instance_type: None,
            initial_variant_weight: None,
            routing_config: None,
            max_in_flight_per_instance: None,
            fairness_weights: None,
        }],
        health_check_config: health_check(),
        creation_time_ms: 0,
        disaggregation_config: None,
    }
}

pub fn registration(index: usize, endpoints: usize, weight: f64) -> pb::RegisterInstanceRequest {
    pb::RegisterInstanceRequest {
        endpoint_name: endpoint_name(index % endpoints),
        variant_name: VARIANT.into(),
        url: instance_url(index),
        id: format!("i-{index}"),
        weight: Some(weight),
        ..Default::default()
    }
}

pub async fn populate(
    admin: &mut AdminClient<Channel>,
    args: &FleetArgs,
) -> anyhow::Result<(f64, u32)> {
    for index in 0..CONFIGS {
        admin
            .create_endpoint_config(pb::CreateEndpointConfigRequest {
                endpoint_config: Some((&config(index)).into()),
            })
            .await?;
    }
    for index in 0..args.endpoints {
        admin
            .create_endpoint(pb::CreateEndpointRequest {
                name: endpoint_name(index),
                endpoint_config_name: format!("cfg-{}", index % CONFIGS),
            })
            .await?;
    }
    let started = Instant::now();
    let imported = admin
        .import_instances(pb::ImportInstancesRequest {
            instances: (0..args.instances)
                .map(|index| registration(index, args.endpoints, 1.0))
                .collect(),
            dry_run: false,
        })
        .await?
        .into_inner();
    Ok((started.elapsed().as_secs_f64(), imported.transactions))
}

/// The fleet's state as the router receives it, in domain types.
pub fn fleet_state(args: &FleetArgs) -> StateUpdate {
    let configs = (0..CONFIGS).map(|index| Arc::new(config(index))).collect();
    let endpoints = (0..args.endpoints)
        .map(|index| {
            Arc::new(Endpoint {
                endpoint_name: EndpointName::new(&endpoint_name(index)).expect("name"),
                endpoint_config_name: EndpointConfigName::new(&format!("cfg-{}", index % CONFIGS))
                    .expect("name"),
                endpoint_status: EndpointStatus::InService,
                creation_time_ms: 0,
                last_modified_time_ms: 0,
                failure_reason: String::new(),
            })
        })
        .collect();
    let instances = (0..args.instances)
        .map(|index| Arc::new(instance(index, args.endpoints, 1.0)))
        .collect();
    StateUpdate {
        reset: true,
        complete: true,
        configs,
        endpoints,
        instances,
        ..StateUpdate::default()
    }
}

pub fn instance(index: usize, endpoints: usize, weight: f64) -> Instance {
    Instance {
        weight,
        ..Instance::new(
            InstanceId::new(&format!("i-{index}")).expect("id"),
            EndpointName::new(&endpoint_name(index % endpoints)).expect("name"),
            VariantName::new(VARIANT).expect("name"),
            instance_url(index),
        )
    }
}
