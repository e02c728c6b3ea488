//! The `Admin` gRPC service: the edge where requests are parsed into typed names and domain
//! types (field named on any error), then handed to the registry.

use switchyard_proto::convert::{
    endpoint_config_name, endpoint_name, instance_id, instance_protocol, instance_role,
    variant_name,
};
use switchyard_proto::v1 as pb;
use switchyard_shared::{EndpointConfig, EndpointConfigName, EndpointName, InstanceId};
use tonic::{Request, Response, Status};

use crate::registry::{AdminError, Registration, Registry};

#[derive(Debug, Clone)]
pub struct AdminService {
    pub registry: Registry,
}

fn invalid(err: switchyard_shared::ValidationError) -> Status {
    AdminError::Invalid(err).into()
}

/// A request's `EndpointName`, parsed.
fn parse_endpoint_name(name: &str) -> Result<EndpointName, Status> {
    endpoint_name("EndpointName", name).map_err(invalid)
}

/// A request's `EndpointConfigName`, parsed.
fn parse_config_name(name: &str) -> Result<EndpointConfigName, Status> {
    endpoint_config_name("EndpointConfigName", name).map_err(invalid)
}

/// A request's `InstanceId`, parsed.
fn parse_instance_id(id: &str) -> Result<InstanceId, Status> {
    instance_id("InstanceId", id).map_err(invalid)
}

/// A `RegisterInstanceRequest` with its names parsed (field named on any error).
fn registration(
    request: pb::RegisterInstanceRequest,
) -> Result<Registration, switchyard_shared::ValidationError> {
    Ok(Registration {
        endpoint: endpoint_name("EndpointName", &request.endpoint_name)?,
        variant: variant_name("VariantName", &request.variant_name)?,
        url: request.url,
        id: if request.id.is_empty() {
            None
        } else {
            Some(instance_id("InstanceId", &request.id)?)
        },
        role: instance_role("Role", request.role)?,
        protocol: instance_protocol("Protocol", request.protocol)?,
        weight: request.weight,
        ttl_seconds: request.ttl_seconds,
        kv_events: switchyard_proto::convert::kv_events(
            &request.kv_events_endpoint,
            &request.kv_events_replay_endpoint,
            request.kv_events_data_parallel_size,
        )?,
        decode_partner: switchyard_proto::convert::decode_partner(&request.decode_partner)?,
        lmcache_receiver: switchyard_proto::convert::lmcache_receiver(
            request.lmcache_receiver.as_ref(),
        )?,
    })
}

#[tonic::async_trait]
impl pb::admin_server::Admin for AdminService {
    async fn import_instances(
        &self,
        request: Request<pb::ImportInstancesRequest>,
    ) -> Result<Response<pb::ImportInstancesResponse>, Status> {
        let request = request.into_inner();
        let registrations = request
            .instances
            .into_iter()
            .enumerate()
            .map(|(index, wire)| {
                registration(wire).map_err(|err| {
                    invalid(switchyard_shared::ValidationError::new(
                        format!("Instances[{index}].{}", err.field),
                        err.message,
                    ))
                })
            })
            .collect::<Result<Vec<_>, Status>>()?;
        let count = registrations.len();
        let outcome = self
            .registry
            .import_instances(registrations, request.dry_run)
            .await?;
        tracing::info!(
            instances = count,
            imported = outcome.imported,
            transactions = outcome.transactions,
            dry_run = request.dry_run,
            "instances imported"
        );
        Ok(Response::new(pb::ImportInstancesResponse {
            imported: outcome.imported as u32,
            transactions: outcome.transactions as u32,
        }))
    }

    async fn create_endpoint_config(
        &self,
        request: Request<pb::CreateEndpointConfigRequest>,
    ) -> Result<Response<pb::EndpointConfig>, Status> {
        let wire = request
            .into_inner()
            .endpoint_config
            .ok_or_else(|| Status::invalid_argument("EndpointConfig: is required"))?;
        let config = EndpointConfig::try_from(wire).map_err(invalid)?;
        let name = config.endpoint_config_name.clone();
        let created = self.registry.create_config(config).await?;
        tracing::info!(endpoint_config = %name, "endpoint config created");
        Ok(Response::new((&created).into()))
    }

    async fn describe_endpoint_config(
        &self,
        request: Request<pb::DescribeEndpointConfigRequest>,
    ) -> Result<Response<pb::EndpointConfig>, Status> {
        let name = parse_config_name(&request.into_inner().name)?;
        let config = self.registry.describe_config(&name).await?;
        Ok(Response::new((&config).into()))
    }

    async fn list_endpoint_configs(
        &self,
        _request: Request<pb::ListEndpointConfigsRequest>,
    ) -> Result<Response<pb::ListEndpointConfigsResponse>, Status> {
        let configs = self.registry.list_configs().await?;
        Ok(Response::new(pb::ListEndpointConfigsResponse {
            endpoint_configs: configs.iter().map(Into::into).collect(),
        }))
    }

    async fn delete_endpoint_config(
        &self,
        request: Request<pb::DeleteEndpointConfigRequest>,
    ) -> Result<Response<pb::DeleteEndpointConfigResponse>, Status> {
        let name = parse_config_name(&request.into_inner().name)?;
        self.registry.delete_config(&name).await?;
        tracing::info!(endpoint_config = %name, "endpoint config deleted");
        Ok(Response::new(pb::DeleteEndpointConfigResponse {}))
    }

    async fn create_endpoint(
        &self,
        request: Request<pb::CreateEndpointRequest>,
    ) -> Result<Response<pb::Endpoint>, Status> {
        let request = request.into_inner();
        let name = parse_endpoint_name(&request.name)?;
        let config = parse_config_name(&request.endpoint_config_name)?;
        let endpoint = self.registry.create_endpoint(name, config).await?;
        tracing::info!(endpoint = %endpoint.endpoint_name, endpoint_config = %endpoint.endpoint_config_name, "endpoint created");
        Ok(Response::new((&endpoint).into()))
    }

    async fn describe_endpoint(
        &self,
        request: Request<pb::DescribeEndpointRequest>,
    ) -> Result<Response<pb::Endpoint>, Status> {
        let name = parse_endpoint_name(&request.into_inner().name)?;
        let endpoint = self.registry.describe_endpoint(&name).await?;
        Ok(Response::new((&endpoint).into()))
    }

    async fn list_endpoints(
        &self,
        _request: Request<pb::ListEndpointsRequest>,
    ) -> Result<Response<pb::ListEndpointsResponse>, Status> {
        let endpoints = self.registry.list_endpoints().await?;
        Ok(Response::new(pb::ListEndpointsResponse {
            endpoints: endpoints.iter().map(Into::into).collect(),
        }))
    }

    async fn update_endpoint(
        &self,
        request: Request<pb::UpdateEndpointRequest>,
    ) -> Result<Response<pb::Endpoint>, Status> {
        let request = request.into_inner();
        let name = parse_endpoint_name(&request.name)?;
        let config = parse_config_name(&request.endpoint_config_name)?;
        let endpoint = self.registry.update_endpoint(&name, config).await?;
        tracing::info!(endpoint = %name, endpoint_config = %endpoint.endpoint_config_name, "endpoint updated");
        Ok(Response::new((&endpoint).into()))
    }

    async fn delete_endpoint(
        &self,
        request: Request<pb::DeleteEndpointRequest>,
    ) -> Result<Response<pb::DeleteEndpointResponse>, Status> {
        let name = parse_endpoint_name(&request.into_inner().name)?;
        self.registry.delete_endpoint(&name).await?;
        tracing::info!(endpoint = %name, "endpoint deleted");
        Ok(Response::new(pb::DeleteEndpointResponse {}))
    }

    async fn register_instance(
        &self,
        request: Request<pb::RegisterInstanceRequest>,
    ) -> Result<Response<pb::Instance>, Status> {
        let registration = registration(request.into_inner()).map_err(invalid)?;
        let instance = self.registry.register_instance(registration).await?;
        tracing::info!(endpoint = %instance.endpoint_name, instance = %instance.instance_id, url = %instance.url, ttl = instance.ttl_seconds, "instance registered");
        Ok(Response::new((&instance).into()))
    }

    async fn deregister_instance(
        &self,
        request: Request<pb::DeregisterInstanceRequest>,
    ) -> Result<Response<pb::DeregisterInstanceResponse>, Status> {
        let request = request.into_inner();
        let endpoint = parse_endpoint_name(&request.endpoint_name)?;
        let id = parse_instance_id(&request.id)?;
        self.registry.deregister_instance(&endpoint, &id).await?;
        tracing::info!(endpoint = %endpoint, instance = %id, "instance deregistered");
        Ok(Response::new(pb::DeregisterInstanceResponse {}))
    }

    async fn list_instances(
        &self,
        request: Request<pb::ListInstancesRequest>,
    ) -> Result<Response<pb::ListInstancesResponse>, Status> {
        let request = request.into_inner();
        let endpoint = if request.endpoint_name.is_empty() {
            None
        } else {
            Some(parse_endpoint_name(&request.endpoint_name)?)
        };
        let instances = self.registry.list_instances(endpoint.as_ref()).await?;
        Ok(Response::new(pb::ListInstancesResponse {
            instances: instances.iter().map(Into::into).collect(),
        }))
    }

    async fn heartbeat(
        &self,
        request: Request<pb::HeartbeatRequest>,
    ) -> Result<Response<pb::HeartbeatResponse>, Status> {
        let request = request.into_inner();
        let endpoint = parse_endpoint_name(&request.endpoint_name)?;
        let id = parse_instance_id(&request.id)?;
        let ttl_seconds = self.registry.heartbeat(&endpoint, &id).await?;
        Ok(Response::new(pb::HeartbeatResponse { ttl_seconds }))
    }
}

/// Requires `authorization: Bearer <token>` on every call of a service when a token is
/// configured (admin calls: the admin token; router streams: the router token).
#[derive(Clone)]
pub struct BearerAuth {
    expected: Option<std::sync::Arc<str>>,
}

impl std::fmt::Debug for BearerAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BearerAuth")
            .field("enabled", &self.expected.is_some())
            .finish()
    }
}

impl BearerAuth {
    pub fn new(token: Option<String>) -> Self {
        Self {
            expected: token.map(|token| std::sync::Arc::from(format!("Bearer {token}"))),
        }
    }
}

/// Compares in time independent of where the first difference is.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

impl tonic::service::Interceptor for BearerAuth {
    fn call(&mut self, request: Request<()>) -> Result<Request<()>, Status> {
        let Some(expected) = &self.expected else {
            return Ok(request);
        };
        match request.metadata().get("authorization") {
            None => Err(Status::unauthenticated(
                "missing token (authorization: Bearer ...)",
            )),
            Some(value) if constant_time_eq(value.as_bytes(), expected.as_bytes()) => Ok(request),
            Some(_) => Err(Status::unauthenticated("wrong token")),
        }
    }
}
