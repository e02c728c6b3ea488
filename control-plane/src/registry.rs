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
use switchyard_process::clock::unix_ms;
use switchyard_shared::{
    Endpoint, EndpointConfig, EndpointConfigName, EndpointName, EndpointStatus, Health, Instance,
    InstanceId, InstanceProtocol, InstanceRole, KvEventsEndpoints, LmcacheReceiver,
    ValidationError, VariantName, validate_instance_url, validate_instance_weight, validate_ttl,
};

use crate::keys;
use crate::store::{Compare, Kv, LeaseId, Revision, Store, StoreError, Txn};

/// Optimistic-concurrency attempts before giving up with `ABORTED`.
const MAX_ATTEMPTS: usize = 16;
/// Writes per import transaction: etcd refuses more than 128 operations (or comparisons) in
/// one transaction by default (`--max-txn-ops`).
const IMPORT_BATCH_OPS: usize = 127;
/// Bytes of values per import transaction: etcd refuses requests above 1.5 MiB by default
/// (`--max-request-bytes`).
const IMPORT_BATCH_BYTES: usize = 1024 * 1024;

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
            StoreError::Unavailable(message)
            | StoreError::WatchLost(message)
            | StoreError::InUse(message) => AdminError::Unavailable(message),
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
    /// Checked by the edge (`switchyard_proto::convert::kv_events`).
    pub kv_events: Option<KvEventsEndpoints>,
    /// LMCACHE disaggregation: the decoder this prefill instance pushes its KV cache to.
    pub decode_partner: Option<InstanceId>,
    /// LMCACHE_PD disaggregation: this decode instance's LMCache receiver (checked by the edge).
    pub lmcache_receiver: Option<LmcacheReceiver>,
}

/// What an import did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ImportOutcome {
    pub imported: usize,
    pub transactions: usize,
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
        config.creation_time_ms = unix_ms() as i64;
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
                        .when_unchanged(&kv)
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
            let now = unix_ms() as i64;
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
                        .when_unchanged(&config_kv)
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
            endpoint.last_modified_time_ms = unix_ms() as i64;
            let committed = self
                .store
                .commit(
                    Txn::new()
                        .when_unchanged(&endpoint_kv)
                        .when_unchanged(&config_kv)
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
                        .when_unchanged(&kv)
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
            switchyard_shared::disaggregation::check_instance_place(
                config.disaggregation_config.as_ref(),
                &request.variant,
                request.role,
                (
                    request.decode_partner.is_some(),
                    request.lmcache_receiver.is_some(),
                ),
            )?;
            let lease_id: LeaseId = if request.ttl_seconds > 0 {
                self.store.grant_lease(request.ttl_seconds).await?
            } else {
                0
            };
            let instance = Instance {
                role: request.role,
                protocol: request.protocol,
                weight,
                ttl_seconds: request.ttl_seconds,
                registered_time_ms: unix_ms() as i64,
                lease_id,
                kv_events: request.kv_events.clone(),
                decode_partner: request.decode_partner.clone(),
                lmcache_receiver: request.lmcache_receiver.clone(),
                ..Instance::new(
                    id.clone(),
                    request.endpoint.clone(),
                    request.variant.clone(),
                    url.clone(),
                )
            };
            let previous = self.read::<Instance>(&key).await?;
            let committed = self
                .store
                .commit(Txn::new().when_unchanged(&endpoint_kv).put(
                    key.clone(),
                    encode(&instance),
                    lease_id,
                ))
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

    /// Removes an instance. The delete compares the revision it read, so a registration that
    /// lands in between (an agent re-registering the same id) is not deleted with it: the call
    /// then fails with `ABORTED` and the new registration stays.
    pub async fn deregister_instance(
        &self,
        endpoint: &EndpointName,
        id: &InstanceId,
    ) -> Result<(), AdminError> {
        let key = keys::instance(endpoint.as_str(), id.as_str());
        let (instance, kv) = self.read::<Instance>(&key).await?.ok_or_else(|| {
            AdminError::NotFound(format!("endpoint {endpoint} has no instance {id}"))
        })?;
        self.deregister_read(&instance, &kv).await
    }

    /// Deletes the instance record `kv` if it is still the one read.
    async fn deregister_read(&self, instance: &Instance, kv: &Kv) -> Result<(), AdminError> {
        let deleted = self
            .store
            .commit(Txn::new().when_unchanged(kv).delete(kv.key.clone()))
            .await?;
        if deleted.is_none() {
            return Err(AdminError::Aborted(format!(
                "instance {} of endpoint {} changed while it was being deregistered (registered again?); nothing was deleted",
                instance.instance_id, instance.endpoint_name
            )));
        }
        if instance.lease_id != 0 {
            self.store.revoke_lease(instance.lease_id).await?;
        }
        Ok(())
    }

    /// Registers many instances without leases, in transactions of at most
    /// `IMPORT_BATCH_OPS` writes and about `IMPORT_BATCH_BYTES`. Everything is checked first
    /// (each registration, duplicates, endpoints and variants): if anything is refused,
    /// nothing is written, and the error names the registration by its index
    /// (`Instances[7].Url: ...`). Each transaction compares the revisions of the endpoints it
    /// writes to, as a single registration does; if one of them changes meanwhile, that
    /// transaction is checked and tried again, and if an endpoint or variant went away the
    /// import stops, saying how many were imported before.
    pub async fn import_instances(
        &self,
        requests: Vec<Registration>,
        dry_run: bool,
    ) -> Result<ImportOutcome, AdminError> {
        let at = |index: usize, err: ValidationError| {
            AdminError::Invalid(ValidationError::new(
                format!("Instances[{index}].{}", err.field),
                err.message,
            ))
        };
        let now = unix_ms() as i64;
        let mut instances = Vec::with_capacity(requests.len());
        let mut seen = std::collections::HashMap::new();
        for (index, request) in requests.into_iter().enumerate() {
            if request.ttl_seconds != 0 {
                return Err(at(
                    index,
                    ValidationError::new(
                        "TtlSeconds",
                        "an import cannot heartbeat; register instances with a TTL one by one",
                    ),
                ));
            }
            let Some(id) = request.id.clone() else {
                return Err(at(
                    index,
                    ValidationError::new("InstanceId", "is required in an import"),
                ));
            };
            let url = validate_instance_url(&request.url).map_err(|err| at(index, err))?;
            let weight = request
                .weight
                .unwrap_or(switchyard_shared::DEFAULT_INSTANCE_WEIGHT);
            validate_instance_weight(weight).map_err(|err| at(index, err))?;
            if let Some(first) = seen.insert((request.endpoint.clone(), id.clone()), index) {
                return Err(at(
                    index,
                    ValidationError::new(
                        "InstanceId",
                        format!(
                            "{id} of endpoint {} is also Instances[{first}]",
                            request.endpoint
                        ),
                    ),
                ));
            }
            instances.push(Instance {
                role: request.role,
                protocol: request.protocol,
                weight,
                registered_time_ms: now,
                kv_events: request.kv_events.clone(),
                decode_partner: request.decode_partner.clone(),
                lmcache_receiver: request.lmcache_receiver.clone(),
                ..Instance::new(id, request.endpoint, request.variant, url)
            });
        }
        let mut endpoints = self.import_endpoints(&instances, 0).await?;
        if dry_run {
            return Ok(ImportOutcome::default());
        }
        // Leases of the registrations the import replaces (they hold no key once replaced).
        let mut replaced: std::collections::HashMap<(EndpointName, InstanceId), LeaseId> = self
            .list_instances(None)
            .await?
            .into_iter()
            .filter(|existing| existing.lease_id != 0)
            .map(|existing| {
                (
                    (existing.endpoint_name, existing.instance_id),
                    existing.lease_id,
                )
            })
            .collect();
        let mut outcome = ImportOutcome::default();
        let mut start = 0;
        while start < instances.len() {
            let mut end = start;
            let mut bytes = 0;
            let mut compared = std::collections::BTreeSet::new();
            while end < instances.len()
                && end - start < IMPORT_BATCH_OPS
                && bytes < IMPORT_BATCH_BYTES
            {
                let endpoint = &instances[end].endpoint_name;
                if !compared.contains(endpoint) && compared.len() == IMPORT_BATCH_OPS {
                    break;
                }
                compared.insert(endpoint.clone());
                bytes += encode(&instances[end]).len();
                end += 1;
            }
            let batch = &instances[start..end];
            let mut committed = false;
            for _ in 0..MAX_ATTEMPTS {
                let mut txn = Txn::new();
                for endpoint in &compared {
                    let revision = endpoints[endpoint].1;
                    txn = txn.when(Compare::ModRevision(
                        keys::endpoint(endpoint.as_str()),
                        revision,
                    ));
                }
                for instance in batch {
                    txn = txn.put(
                        keys::instance(
                            instance.endpoint_name.as_str(),
                            instance.instance_id.as_str(),
                        ),
                        encode(instance),
                        0,
                    );
                }
                if self.store.commit(txn).await?.is_some() {
                    outcome.transactions += 1;
                    outcome.imported += batch.len();
                    let leases = batch.iter().filter_map(|instance| {
                        replaced
                            .remove(&(instance.endpoint_name.clone(), instance.instance_id.clone()))
                    });
                    for lease in leases.collect::<Vec<_>>() {
                        if let Err(err) = self.store.revoke_lease(lease).await {
                            tracing::warn!(lease, error = %err, "could not revoke the lease of a replaced registration");
                        }
                    }
                    committed = true;
                    break;
                }
                // An endpoint changed: check this batch against it again.
                endpoints = self
                    .import_endpoints(batch, start)
                    .await
                    .map_err(|err| match err {
                        AdminError::Invalid(err) => AdminError::FailedPrecondition(format!(
                            "{} instances imported, then {}: {} (an endpoint changed during the import)",
                            outcome.imported, err.field, err.message
                        )),
                        other => other,
                    })?;
            }
            if !committed {
                return Err(AdminError::Aborted(format!(
                    "{} instances imported, then the endpoints kept changing under the import; try again",
                    outcome.imported
                )));
            }
            start = end;
        }
        Ok(outcome)
    }

    /// The endpoints `instances` belong to, with their revisions; checks that each exists and
    /// has the instance's variant (errors name `Instances[offset + i]`).
    async fn import_endpoints(
        &self,
        instances: &[Instance],
        offset: usize,
    ) -> Result<std::collections::HashMap<EndpointName, (Endpoint, Revision)>, AdminError> {
        let configs: std::collections::HashMap<EndpointConfigName, EndpointConfig> = self
            .list_configs()
            .await?
            .into_iter()
            .map(|config| (config.endpoint_config_name.clone(), config))
            .collect();
        let mut endpoints = std::collections::HashMap::new();
        for kv in self.store.list(keys::ENDPOINTS).await? {
            let endpoint: Endpoint = decode(&kv)?;
            endpoints.insert(endpoint.endpoint_name.clone(), (endpoint, kv.mod_revision));
        }
        for (index, instance) in instances.iter().enumerate() {
            let field = |name: &str| format!("Instances[{}].{name}", offset + index);
            let Some((endpoint, _)) = endpoints.get(&instance.endpoint_name) else {
                return Err(AdminError::Invalid(ValidationError::new(
                    field("EndpointName"),
                    format!("endpoint {} does not exist", instance.endpoint_name),
                )));
            };
            let config = configs.get(&endpoint.endpoint_config_name);
            let has_variant = config
                .is_some_and(|config| config.variant(instance.variant_name.as_str()).is_some());
            if let Some(config) = config {
                switchyard_shared::disaggregation::check_instance_place(
                    config.disaggregation_config.as_ref(),
                    &instance.variant_name,
                    instance.role,
                    (
                        instance.decode_partner.is_some(),
                        instance.lmcache_receiver.is_some(),
                    ),
                )
                .map_err(|err| {
                    AdminError::Invalid(ValidationError::new(field(&err.field), err.message))
                })?;
            }
            if !has_variant {
                return Err(AdminError::Invalid(ValidationError::new(
                    field("VariantName"),
                    format!(
                        "endpoint {} (config {}) has no variant {}",
                        endpoint.endpoint_name,
                        endpoint.endpoint_config_name,
                        instance.variant_name
                    ),
                )));
            }
        }
        Ok(endpoints)
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
                    .when_unchanged(&kv)
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
    async fn a_deregistration_does_not_delete_a_registration_that_came_in_between() {
        let store: Arc<dyn Store> =
            Arc::new(EmbeddedStore::open(None, CancellationToken::new()).unwrap());
        let registry = Registry::new(Arc::clone(&store));
        let key = keys::instance("chat", "a");
        let instance: Instance = serde_json::from_str(
            r#"{"InstanceId":"a","EndpointName":"chat","VariantName":"v","Url":"http://127.0.0.1:1","Weight":1.0}"#,
        )
        .unwrap();
        put(store.as_ref(), &key, encode(&instance)).await;
        // Read for deregistration; meanwhile the agent registers again.
        let (read, kv) = registry.read::<Instance>(&key).await.unwrap().unwrap();
        let again = Instance {
            url: "http://127.0.0.1:2".into(),
            ..instance
        };
        put(store.as_ref(), &key, encode(&again)).await;
        let err = registry.deregister_read(&read, &kv).await.unwrap_err();
        assert!(matches!(err, AdminError::Aborted(_)), "{err}");
        let (kept, _) = registry.read::<Instance>(&key).await.unwrap().unwrap();
        assert_eq!(kept.url, "http://127.0.0.1:2", "the new registration stays");
        // Deregistering what is there now works.
        registry
            .deregister_instance(
                &EndpointName::new("chat").unwrap(),
                &InstanceId::new("a").unwrap(),
            )
            .await
            .unwrap();
        assert!(store.get(&key).await.unwrap().is_none());
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
