//! Admin operations on top of the store: SageMaker's endpoint-config and endpoint lifecycle,
//! and instance membership.
//!
//! Every write is a store transaction guarded by comparisons, so two admins or two
//! control-plane replicas never overwrite each other:
//! - creates compare "key absent" (exactly one of two concurrent creates wins);
//! - updates compare the revision they read (a lost race is retried from a fresh read);
//! - an endpoint create/update also rewrites its config's key unchanged, which bumps the
//!   config's revision, and a config delete compares that revision: so a config can never be
//!   deleted while an endpoint that was just pointed at it is being written.

use std::sync::Arc;

use serde::Serialize;
use serde::de::DeserializeOwned;
use switchyard_shared::{
    Endpoint, EndpointConfig, EndpointConfigName, EndpointName, EndpointStatus, Health, Instance,
    InstanceId, InstanceProtocol, InstanceRole, KvEventsEndpoints, ValidationError, VariantName,
    now_ms, validate_instance_url, validate_instance_weight, validate_ttl,
};

use crate::keys;
use crate::store::{Compare, Kv, LeaseId, Revision, Store, StoreError, Txn};

/// Optimistic-concurrency attempts before giving up with `ABORTED`.
const MAX_ATTEMPTS: usize = 16;

#[derive(Debug, Clone, thiserror::Error)]
pub enum AdminError {
    #[error("{0}")]
    Invalid(#[from] ValidationError),
    #[error("{0}")]
    AlreadyExists(String),
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    FailedPrecondition(String),
    #[error("{0}")]
    Unavailable(String),
    #[error("{0}")]
    Aborted(String),
    #[error("{0}")]
    Internal(String),
}

impl From<StoreError> for AdminError {
    fn from(err: StoreError) -> Self {
        match err {
            StoreError::Unavailable(message) | StoreError::WatchLost(message) => {
                AdminError::Unavailable(message)
            }
            StoreError::LeaseNotFound(lease) => {
                AdminError::NotFound(format!("lease {lease} has lapsed"))
            }
            StoreError::Corrupt(message) => AdminError::Internal(message),
        }
    }
}

impl From<AdminError> for tonic::Status {
    fn from(err: AdminError) -> Self {
        let message = err.to_string();
        match err {
            AdminError::Invalid(_) => tonic::Status::invalid_argument(message),
            AdminError::AlreadyExists(_) => tonic::Status::already_exists(message),
            AdminError::NotFound(_) => tonic::Status::not_found(message),
            AdminError::FailedPrecondition(_) => tonic::Status::failed_precondition(message),
            AdminError::Unavailable(_) => tonic::Status::unavailable(message),
            AdminError::Aborted(_) => tonic::Status::aborted(message),
            AdminError::Internal(_) => tonic::Status::internal(message),
        }
    }
}

/// What `RegisterInstance` asks for, after the edge parsed names.
#[derive(Debug, Clone)]
pub struct Registration {
    pub endpoint: EndpointName,
    pub variant: VariantName,
    pub url: String,
    pub id: Option<InstanceId>,
    pub role: InstanceRole,
    pub protocol: InstanceProtocol,
    pub weight: Option<f64>,
    pub ttl_seconds: u32,
    /// Checked by the edge (`pb::kv_events`).
    pub kv_events: Option<KvEventsEndpoints>,
}

#[derive(Clone)]
pub struct Registry {
    store: Arc<dyn Store>,
}

impl std::fmt::Debug for Registry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registry")
            .field("store", &self.store.kind())
            .finish()
    }
}

fn encode<T: Serialize>(value: &T) -> Vec<u8> {
    serde_json::to_vec(value).expect("domain types always serialise")
}

pub(crate) fn decode<T: DeserializeOwned>(kv: &Kv) -> Result<T, AdminError> {
    serde_json::from_slice(&kv.value)
        .map_err(|err| AdminError::Internal(format!("cannot read {}: {err}", kv.key)))
}

impl Registry {
    pub fn new(store: Arc<dyn Store>) -> Self {
        Self { store }
    }

    pub fn store(&self) -> &Arc<dyn Store> {
        &self.store
    }

    async fn read<T: DeserializeOwned>(&self, key: &str) -> Result<Option<(T, Kv)>, AdminError> {
        match self.store.get(key).await? {
            None => Ok(None),
            Some(kv) => Ok(Some((decode(&kv)?, kv))),
        }
    }

    async fn list_decoded<T: DeserializeOwned>(&self, prefix: &str) -> Result<Vec<T>, AdminError> {
        self.store.list(prefix).await?.iter().map(decode).collect()
    }

    async fn read_config(
        &self,
        name: &EndpointConfigName,
    ) -> Result<(EndpointConfig, Kv), AdminError> {
        self.read(&keys::config(name.as_str()))
            .await?
            .ok_or_else(|| AdminError::NotFound(format!("endpoint config {name} does not exist")))
    }

    async fn read_endpoint(&self, name: &EndpointName) -> Result<(Endpoint, Kv), AdminError> {
        self.read(&keys::endpoint(name.as_str()))
            .await?
            .ok_or_else(|| AdminError::NotFound(format!("endpoint {name} does not exist")))
    }

    // ----- endpoint configs -------------------------------------------------------------

    pub async fn create_config(
        &self,
        config: EndpointConfig,
    ) -> Result<EndpointConfig, AdminError> {
        self.create_config_with(config, None).await
    }

    /// Creates a config, and stores beside it, in the same transaction, the SageMaker API's
    /// fields of it that Switchyard does not use (opaque here; deleted with the config).
    pub async fn create_config_with(
        &self,
        mut config: EndpointConfig,
        sagemaker_fields: Option<Vec<u8>>,
    ) -> Result<EndpointConfig, AdminError> {
        config.validate()?;
        config.creation_time_ms = now_ms();
        let name = config.endpoint_config_name.as_str();
        let key = keys::config(name);
        let mut txn = Txn::new()
            .when(Compare::Absent(key.clone()))
            .put(key, encode(&config), 0);
        if let Some(fields) = sagemaker_fields {
            txn = txn.put(keys::sagemaker_config(name), fields, 0);
        }
        let created = self.store.commit(txn).await?;
        match created {
            Some(_) => Ok(config),
            None => Err(AdminError::AlreadyExists(format!(
                "endpoint config {} already exists",
                config.endpoint_config_name
            ))),
        }
    }

    pub async fn describe_config(
        &self,
        name: &EndpointConfigName,
    ) -> Result<EndpointConfig, AdminError> {
        Ok(self.read_config(name).await?.0)
    }

    /// What [`Registry::create_config_with`] stored beside the config, if anything.
    pub async fn sagemaker_fields(
        &self,
        name: &EndpointConfigName,
    ) -> Result<Option<Vec<u8>>, AdminError> {
        Ok(self
            .store
            .get(&keys::sagemaker_config(name.as_str()))
            .await?
            .map(|kv| kv.value))
    }

    pub async fn list_configs(&self) -> Result<Vec<EndpointConfig>, AdminError> {
        self.list_decoded(keys::CONFIGS).await
    }

    pub async fn delete_config(&self, name: &EndpointConfigName) -> Result<(), AdminError> {
        for _ in 0..MAX_ATTEMPTS {
            let (_, kv) = self.read_config(name).await?;
            let users: Vec<String> = self
                .list_endpoints()
                .await?
                .into_iter()
                .filter(|endpoint| endpoint.endpoint_config_name == *name)
                .map(|endpoint| endpoint.endpoint_name.to_string())
                .collect();
            if !users.is_empty() {
                return Err(AdminError::FailedPrecondition(format!(
                    "endpoint config {name} is used by endpoint {}; update or delete it first",
                    users.join(", ")
                )));
            }
            let deleted = self
                .store
                .commit(
                    Txn::new()
                        .when(Compare::ModRevision(kv.key.clone(), kv.mod_revision))
                        .delete(kv.key)
                        .delete(keys::sagemaker_config(name.as_str())),
                )
                .await?;
            if deleted.is_some() {
                return Ok(());
            }
        }
        Err(too_much_contention("endpoint config", name.as_str()))
    }

    // ----- endpoints ----------------------------------------------------------------------

    pub async fn create_endpoint(
        &self,
        name: EndpointName,
        config_name: EndpointConfigName,
    ) -> Result<Endpoint, AdminError> {
        for _ in 0..MAX_ATTEMPTS {
            let (_, config_kv) = self
                .read_config(&config_name)
                .await
                .map_err(|err| config_missing(err, "EndpointConfigName", &config_name))?;
            let now = now_ms();
            let endpoint = Endpoint {
                endpoint_name: name.clone(),
                endpoint_config_name: config_name.clone(),
                endpoint_status: EndpointStatus::InService,
                creation_time_ms: now,
                last_modified_time_ms: now,
                failure_reason: String::new(),
            };
            let key = keys::endpoint(name.as_str());
            let committed = self
                .store
                .commit(
                    Txn::new()
                        .when(Compare::Absent(key.clone()))
                        .when(Compare::ModRevision(
                            config_kv.key.clone(),
                            config_kv.mod_revision,
                        ))
                        .put(key.clone(), encode(&endpoint), 0)
                        .put(config_kv.key, config_kv.value, 0),
                )
                .await?;
            if committed.is_some() {
                return Ok(endpoint);
            }
            if self.store.get(&key).await?.is_some() {
                return Err(AdminError::AlreadyExists(format!(
                    "endpoint {name} already exists"
                )));
            }
        }
        Err(too_much_contention("endpoint", name.as_str()))
    }

    pub async fn describe_endpoint(&self, name: &EndpointName) -> Result<Endpoint, AdminError> {
        Ok(self.read_endpoint(name).await?.0)
    }

    pub async fn list_endpoints(&self) -> Result<Vec<Endpoint>, AdminError> {
        self.list_decoded(keys::ENDPOINTS).await
    }

    /// Points the endpoint at another config. Routers swap to it atomically, so no request
    /// is dropped.
    pub async fn update_endpoint(
        &self,
        name: &EndpointName,
        config_name: EndpointConfigName,
    ) -> Result<Endpoint, AdminError> {
        for _ in 0..MAX_ATTEMPTS {
            let (mut endpoint, endpoint_kv) = self.read_endpoint(name).await?;
            let (_, config_kv) = self
                .read_config(&config_name)
                .await
                .map_err(|err| config_missing(err, "EndpointConfigName", &config_name))?;
            endpoint.endpoint_config_name = config_name.clone();
            endpoint.endpoint_status = EndpointStatus::InService;
            endpoint.last_modified_time_ms = now_ms();
            let committed = self
                .store
                .commit(
                    Txn::new()
                        .when(Compare::ModRevision(
                            endpoint_kv.key.clone(),
                            endpoint_kv.mod_revision,
                        ))
                        .when(Compare::ModRevision(
                            config_kv.key.clone(),
                            config_kv.mod_revision,
                        ))
                        .put(endpoint_kv.key, encode(&endpoint), 0)
                        .put(config_kv.key, config_kv.value, 0),
                )
                .await?;
            if committed.is_some() {
                return Ok(endpoint);
            }
        }
        Err(too_much_contention("endpoint", name.as_str()))
    }

    /// Deletes the endpoint and every instance registered to it.
    pub async fn delete_endpoint(&self, name: &EndpointName) -> Result<(), AdminError> {
        for _ in 0..MAX_ATTEMPTS {
            let (_, kv) = self.read_endpoint(name).await?;
            let instances = self.list_instances(Some(name)).await?;
            let committed = self
                .store
                .commit(
                    Txn::new()
                        .when(Compare::ModRevision(kv.key.clone(), kv.mod_revision))
                        .delete(kv.key)
                        .delete_prefix(keys::instances_of(name.as_str())),
                )
                .await?;
            if committed.is_some() {
                for instance in instances.iter().filter(|instance| instance.lease_id != 0) {
                    if let Err(err) = self.store.revoke_lease(instance.lease_id).await {
                        tracing::warn!(instance = %instance.instance_id, error = %err, "could not revoke lease");
                    }
                }
                return Ok(());
            }
        }
        Err(too_much_contention("endpoint", name.as_str()))
    }

    // ----- instances ----------------------------------------------------------------------

    /// Registers an instance, or replaces the registration with the same id (an agent that
    /// restarts registers again). With a TTL the instance lives on a lease that
    /// `heartbeat` renews. The write compares the endpoint's revision, so a registration
    /// racing an endpoint delete or update cannot leave an orphan or a stale variant.
    pub async fn register_instance(&self, request: Registration) -> Result<Instance, AdminError> {
        let url = validate_instance_url(&request.url)?;
        let weight = request
            .weight
            .unwrap_or(switchyard_shared::DEFAULT_INSTANCE_WEIGHT);
        validate_instance_weight(weight)?;
        validate_ttl(request.ttl_seconds)?;
        let id = match &request.id {
            Some(id) => id.clone(),
            None => InstanceId::new(&format!("{}-{:08x}", request.variant, fastrand::u32(..)))
                .map_err(|err| AdminError::Internal(err.to_string()))?,
        };
        let key = keys::instance(request.endpoint.as_str(), id.as_str());
        for _ in 0..MAX_ATTEMPTS {
            let (endpoint, endpoint_kv) =
                self.read_endpoint(&request.endpoint)
                    .await
                    .map_err(|err| match err {
                        AdminError::NotFound(message) => {
                            AdminError::Invalid(ValidationError::new("EndpointName", message))
                        }
                        other => other,
                    })?;
            let (config, _) = self.read_config(&endpoint.endpoint_config_name).await?;
            if config.variant(request.variant.as_str()).is_none() {
                let known: Vec<&str> = config
                    .production_variants
                    .iter()
                    .map(|variant| variant.variant_name.as_str())
                    .collect();
                return Err(AdminError::Invalid(ValidationError::new(
                    "VariantName",
                    format!(
                        "endpoint {} (config {}) has no variant {}; it has {}",
                        endpoint.endpoint_name,
                        config.endpoint_config_name,
                        request.variant,
                        known.join(", ")
                    ),
                )));
            }
            let lease_id: LeaseId = if request.ttl_seconds > 0 {
                self.store.grant_lease(request.ttl_seconds).await?
            } else {
                0
            };
            let instance = Instance {
                instance_id: id.clone(),
                endpoint_name: request.endpoint.clone(),
                variant_name: request.variant.clone(),
                url: url.clone(),
                role: request.role,
                protocol: request.protocol,
                weight,
                health: Health::Unknown,
                health_detail: String::new(),
                ttl_seconds: request.ttl_seconds,
                registered_time_ms: now_ms(),
                lease_id,
                kv_events: request.kv_events.clone(),
            };
            let previous = self.read::<Instance>(&key).await?;
            let committed = self
                .store
                .commit(
                    Txn::new()
                        .when(Compare::ModRevision(
                            endpoint_kv.key.clone(),
                            endpoint_kv.mod_revision,
                        ))
                        .put(key.clone(), encode(&instance), lease_id),
                )
                .await?;
            if committed.is_none() {
                // The endpoint changed under us: read it again.
                if lease_id != 0 {
                    let _ = self.store.revoke_lease(lease_id).await;
                }
                continue;
            }
            if let Some((previous, _)) = previous
                && previous.lease_id != 0
                && previous.lease_id != lease_id
            {
                // The old lease now holds no key; let it go.
                let _ = self.store.revoke_lease(previous.lease_id).await;
            }
            return Ok(instance);
        }
        Err(too_much_contention("instance", id.as_str()))
    }

    pub async fn deregister_instance(
        &self,
        endpoint: &EndpointName,
        id: &InstanceId,
    ) -> Result<(), AdminError> {
        let key = keys::instance(endpoint.as_str(), id.as_str());
        let (instance, kv) = self.read::<Instance>(&key).await?.ok_or_else(|| {
            AdminError::NotFound(format!("endpoint {endpoint} has no instance {id}"))
        })?;
        self.store.commit(Txn::new().delete(kv.key)).await?;
        if instance.lease_id != 0 {
            self.store.revoke_lease(instance.lease_id).await?;
        }
        Ok(())
    }

    pub async fn list_instances(
        &self,
        endpoint: Option<&EndpointName>,
    ) -> Result<Vec<Instance>, AdminError> {
        let prefix = match endpoint {
            Some(endpoint) => keys::instances_of(endpoint.as_str()),
            None => keys::INSTANCES.to_owned(),
        };
        self.list_decoded(&prefix).await
    }

    /// Renews the lease of an instance registered with a TTL; returns the TTL (0: no lease).
    pub async fn heartbeat(
        &self,
        endpoint: &EndpointName,
        id: &InstanceId,
    ) -> Result<u32, AdminError> {
        let key = keys::instance(endpoint.as_str(), id.as_str());
        let (instance, _) = self.read::<Instance>(&key).await?.ok_or_else(|| {
            AdminError::NotFound(format!(
                "endpoint {endpoint} has no instance {id} (its lease may have lapsed; register again)"
            ))
        })?;
        if instance.lease_id == 0 {
            return Ok(0);
        }
        if self.store.keep_alive(instance.lease_id).await? {
            Ok(instance.ttl_seconds)
        } else {
            Err(AdminError::NotFound(format!(
                "the lease of instance {id} has lapsed; register again"
            )))
        }
    }

    /// Records a health transition decided by the prober, fenced by the leader key's revision
    /// when this replica took it. Returns false when the instance is gone or changed
    /// meanwhile, or the leader key is no longer the one this replica wrote.
    pub async fn set_health(
        &self,
        endpoint: &EndpointName,
        id: &InstanceId,
        health: Health,
        detail: &str,
        leader_revision: Revision,
    ) -> Result<bool, AdminError> {
        let key = keys::instance(endpoint.as_str(), id.as_str());
        let Some((mut instance, kv)) = self.read::<Instance>(&key).await? else {
            return Ok(false);
        };
        if instance.health == health && instance.health_detail == detail {
            return Ok(true);
        }
        instance.health = health;
        instance.health_detail = detail.to_owned();
        let result = self
            .store
            .commit(
                Txn::new()
                    .when(Compare::ModRevision(kv.key.clone(), kv.mod_revision))
                    .when(Compare::ModRevision(
                        keys::LEADER.to_owned(),
                        leader_revision,
                    ))
                    .put(kv.key, encode(&instance), instance.lease_id),
            )
            .await;
        match result {
            Ok(committed) => Ok(committed.is_some()),
            Err(StoreError::LeaseNotFound(_)) => Ok(false),
            Err(err) => Err(err.into()),
        }
    }
}

fn config_missing(err: AdminError, field: &str, name: &EndpointConfigName) -> AdminError {
    match err {
        AdminError::NotFound(_) => {
            AdminError::NotFound(format!("{field}: endpoint config {name} does not exist"))
        }
        other => other,
    }
}

fn too_much_contention(kind: &str, name: &str) -> AdminError {
    AdminError::Aborted(format!(
        "{kind} {name} kept changing under concurrent writes; try again"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::embedded::EmbeddedStore;
    use tokio_util::sync::CancellationToken;

    async fn put(store: &dyn Store, key: &str, value: Vec<u8>) -> Revision {
        store
            .commit(Txn::new().put(key, value, 0))
            .await
            .unwrap()
            .expect("an unguarded put commits")
    }

    #[tokio::test]
    async fn health_writes_are_fenced_by_the_leader_key() {
        let store: Arc<dyn Store> =
            Arc::new(EmbeddedStore::open(None, CancellationToken::new()).unwrap());
        let registry = Registry::new(Arc::clone(&store));
        let endpoint = EndpointName::new("chat").unwrap();
        let id = InstanceId::new("a").unwrap();
        let instance: Instance = serde_json::from_str(
            r#"{"InstanceId":"a","EndpointName":"chat","VariantName":"v","Url":"http://127.0.0.1:1","Weight":1.0}"#,
        )
        .unwrap();
        put(
            store.as_ref(),
            &keys::instance("chat", "a"),
            encode(&instance),
        )
        .await;
        let health = |registry: Registry| async move {
            let (instance, _) = registry
                .read::<Instance>(&keys::instance("chat", "a"))
                .await
                .unwrap()
                .unwrap();
            instance.health
        };

        let first = put(store.as_ref(), keys::LEADER, b"replica-1".to_vec()).await;
        assert!(
            registry
                .set_health(&endpoint, &id, Health::Healthy, "", first)
                .await
                .unwrap()
        );
        assert_eq!(health(registry.clone()).await, Health::Healthy);

        // Another replica took the key: the first one's late write is refused.
        let second = put(store.as_ref(), keys::LEADER, b"replica-2".to_vec()).await;
        assert!(
            !registry
                .set_health(&endpoint, &id, Health::Unhealthy, "late", first)
                .await
                .unwrap()
        );
        assert_eq!(health(registry.clone()).await, Health::Healthy);
        assert!(
            registry
                .set_health(&endpoint, &id, Health::Unhealthy, "refused", second)
                .await
                .unwrap()
        );
        assert_eq!(health(registry).await, Health::Unhealthy);
    }
}
