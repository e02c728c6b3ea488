//! The admin API as tests call it: a bounded client, endpoint configs from SageMaker JSON,
//! endpoints and instance registrations.

use std::time::Duration;

use anyhow::Context as _;
use switchyard_proto::v1 as pb;
use switchyard_proto::v1::admin_client::AdminClient;
use tonic::transport::Channel;

/// A SageMaker ProductionVariants JSON for one variant `AllTraffic` serving model `sim`.
pub use switchyard_cluster::variants_json as variant_json;

/// The longest one admin call may take before the test fails instead of hanging.
pub const RPC_TIMEOUT: Duration = Duration::from_secs(30);

/// An admin client of a control plane (each call bounded by [`RPC_TIMEOUT`]).
pub async fn admin(url: &str) -> anyhow::Result<AdminClient<Channel>> {
    let channel = tonic::transport::Endpoint::from_shared(url.to_owned())?
        .connect_timeout(Duration::from_secs(5))
        .timeout(RPC_TIMEOUT)
        .connect()
        .await
        .with_context(|| format!("admin client of {url}"))?;
    Ok(AdminClient::new(channel))
}

/// Waits at most `limit` for `control_plane` to lead.
pub async fn wait_leader(
    control_plane: &switchyard_control::ControlPlane,
    limit: Duration,
) -> anyhow::Result<()> {
    tokio::time::timeout(limit, control_plane.wait_leader())
        .await
        .with_context(|| {
            format!(
                "replica {} did not lead within {limit:?}",
                control_plane.replica_id
            )
        })
}

/// Builds a CreateEndpointConfig request from SageMaker JSON (health checks every 200 ms,
/// unhealthy after 2 failures, healthy again after 1 success).
pub fn config_request(name: &str, variants_json: &str) -> pb::CreateEndpointConfigRequest {
    config_request_with_health(
        name,
        variants_json,
        switchyard_shared::HealthCheckConfig {
            interval_ms: 200,
            unhealthy_threshold: 2,
            healthy_threshold: 1,
            ..Default::default()
        },
    )
}

/// Builds a CreateEndpointConfig request from SageMaker JSON with these health checks.
pub fn config_request_with_health(
    name: &str,
    variants_json: &str,
    health_check_config: switchyard_shared::HealthCheckConfig,
) -> pb::CreateEndpointConfigRequest {
    let variants = switchyard_shared::sagemaker::parse_production_variants(variants_json)
        .expect("test JSON parses")
        .variants;
    let config = switchyard_shared::EndpointConfig {
        endpoint_config_name: switchyard_shared::EndpointConfigName::new(name).expect("name"),
        production_variants: variants,
        health_check_config,
        creation_time_ms: 0,
        disaggregation_config: None,
    };
    pb::CreateEndpointConfigRequest {
        endpoint_config: Some((&config).into()),
    }
}

/// Creates config `{endpoint}-cfg` and endpoint `endpoint`.
pub async fn create_endpoint(
    admin: &mut AdminClient<Channel>,
    endpoint: &str,
    variants_json: &str,
) -> anyhow::Result<()> {
    let request = config_request(&format!("{endpoint}-cfg"), variants_json);
    create_endpoint_from(admin, endpoint, request).await
}

/// Creates the config `request` makes, and endpoint `endpoint` on it.
pub async fn create_endpoint_from(
    admin: &mut AdminClient<Channel>,
    endpoint: &str,
    request: pb::CreateEndpointConfigRequest,
) -> anyhow::Result<()> {
    let config = request
        .endpoint_config
        .as_ref()
        .map(|config| config.name.clone())
        .unwrap_or_default();
    admin.create_endpoint_config(request).await?;
    admin
        .create_endpoint(pb::CreateEndpointRequest {
            name: endpoint.into(),
            endpoint_config_name: config,
        })
        .await?;
    Ok(())
}

/// Points endpoint `endpoint` at the config `config` (UpdateEndpoint); returns the endpoint.
pub async fn switch_endpoint_config(
    admin: &mut AdminClient<Channel>,
    endpoint: &str,
    config: &str,
) -> anyhow::Result<pb::Endpoint> {
    let updated = admin
        .update_endpoint(pb::UpdateEndpointRequest {
            name: endpoint.into(),
            endpoint_config_name: config.into(),
        })
        .await?;
    Ok(updated.into_inner())
}

/// Registers an instance without a lease.
pub async fn register(
    admin: &mut AdminClient<Channel>,
    endpoint: &str,
    id: &str,
    url: &str,
) -> anyhow::Result<pb::Instance> {
    Ok(admin
        .register_instance(pb::RegisterInstanceRequest {
            endpoint_name: endpoint.into(),
            variant_name: "AllTraffic".into(),
            url: url.into(),
            id: id.into(),
            ..Default::default()
        })
        .await?
        .into_inner())
}

/// Creates config `{endpoint}-cfg` (one RANDOM variant `AllTraffic`) and endpoint `endpoint`,
/// whose instances are probed once an hour and never marked unhealthy: for instances at
/// addresses nothing answers on, in tests about membership, not health.
pub async fn create_quiet_endpoint(
    admin: &mut AdminClient<Channel>,
    endpoint: &str,
) -> anyhow::Result<()> {
    let mut request = config_request(&format!("{endpoint}-cfg"), &variant_json("RANDOM", None));
    if let Some(config) = request.endpoint_config.as_mut() {
        config.health_check = Some(pb::HealthCheckConfig {
            interval_ms: 3_600_000,
            unhealthy_threshold: 100,
            ..Default::default()
        });
    }
    create_endpoint_from(admin, endpoint, request).await
}

/// The health (`pb::HealthStatus` as a number) of the first instance the control plane lists, -1 when
/// it lists none or does not answer.
pub async fn first_instance_health(admin: &AdminClient<Channel>) -> i32 {
    let mut admin = admin.clone();
    admin
        .list_instances(pb::ListInstancesRequest::default())
        .await
        .ok()
        .and_then(|response| {
            response
                .into_inner()
                .instances
                .first()
                .map(|instance| instance.health)
        })
        .unwrap_or(-1)
}

/// Waits (10 s at most) until the first instance the control plane lists has `health`
/// ([`first_instance_health`]); `what` names the wait.
pub async fn wait_first_instance_health(
    admin: &AdminClient<Channel>,
    health: pb::HealthStatus,
    what: &str,
) -> anyhow::Result<()> {
    switchyard_testkit::eventually(Duration::from_secs(10), what, || async {
        first_instance_health(admin).await == health as i32
    })
    .await
}

/// The ids of the instances of `endpoint` the control plane lists, sorted.
pub async fn listed_instances(
    admin: &mut AdminClient<Channel>,
    endpoint: &str,
) -> anyhow::Result<Vec<String>> {
    let mut ids: Vec<String> = admin
        .list_instances(pb::ListInstancesRequest {
            endpoint_name: endpoint.into(),
        })
        .await?
        .into_inner()
        .instances
        .into_iter()
        .map(|instance| instance.id)
        .collect();
    ids.sort();
    Ok(ids)
}
