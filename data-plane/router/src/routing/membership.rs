//! Where the routing table comes from: the control plane's sync stream (a snapshot, then
//! batches of changes, as domain `StateUpdate`s) or a static file for users who run no control
//! plane. The sync client converts the wire messages (`switchyard_proto::convert`); this module
//! keeps the membership and builds the table from it.
//!
//! A change costs time in proportion to what it touches: an instance's route is prepared (its
//! URIs parsed) when the instance arrives, and only the endpoints a batch touches are rebuilt;
//! the new table shares the others with the old one, and is swapped in once per batch.
//! Replaced tables are kept here until no request holds them any more, so a serving thread
//! never pays for freeing one.
//!
//! Views never go back: a snapshot older than the state held, from the same cluster, is
//! refused (the sync client then tries another control plane); a snapshot from another
//! cluster (a store recreated on purpose) is taken, and said so.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

use arc_swap::ArcSwap;
use switchyard_shared::sync::{StateUpdate, StateVersion};
use switchyard_shared::{
    Endpoint, EndpointConfig, EndpointConfigName, EndpointName, EndpointStatus, Instance,
    InstanceId, InstanceKey,
};

use crate::plan::count::TokenCounters;
use crate::request::local_tokens::LocalTokenizers;
use crate::routing::cells::LoadRegistry;
use crate::routing::static_file::StaticConfig;
use crate::routing::table::{self, EndpointRoute, InstanceRoute, RoutingTable};

/// An instance and its prepared route (`None`: its URL cannot be routed to).
#[derive(Debug)]
struct Member {
    instance: Arc<Instance>,
    route: Option<InstanceRoute>,
}

/// Membership as this router knows it.
#[derive(Debug, Default)]
struct State {
    configs: HashMap<EndpointConfigName, Arc<EndpointConfig>>,
    endpoints: BTreeMap<EndpointName, Arc<Endpoint>>,
    /// Endpoints by the config they use.
    users: HashMap<EndpointConfigName, BTreeSet<EndpointName>>,
    members: HashMap<EndpointName, BTreeMap<InstanceId, Member>>,
}

impl State {
    fn is_member(&self, key: &InstanceKey) -> bool {
        self.members
            .get(&key.endpoint)
            .is_some_and(|members| members.contains_key(&key.id))
    }

    fn member_count(&self) -> usize {
        self.members.values().map(BTreeMap::len).sum()
    }

    /// Applies an update; records the endpoints whose route changed in `dirty` and the
    /// instances that left in `left`.
    fn apply(
        &mut self,
        update: &StateUpdate,
        registry: &LoadRegistry,
        dirty: &mut BTreeSet<EndpointName>,
        left: &mut Vec<InstanceKey>,
    ) {
        for name in &update.removed_endpoints {
            if let Some(endpoint) = self.endpoints.remove(name) {
                self.unuse(&endpoint);
            }
            if let Some(members) = self.members.remove(name) {
                left.extend(
                    members
                        .into_keys()
                        .map(|id| InstanceKey::new(name.clone(), id)),
                );
            }
            dirty.insert(name.clone());
        }
        for config in &update.configs {
            if let Err(err) = config.validate() {
                tracing::warn!(config = %config.endpoint_config_name, error = %err, "ignored an endpoint config this router cannot use");
                continue;
            }
            let name = config.endpoint_config_name.clone();
            if let Some(users) = self.users.get(&name) {
                dirty.extend(users.iter().cloned());
            }
            self.configs.insert(name, Arc::clone(config));
        }
        for name in &update.removed_configs {
            self.configs.remove(name);
            if let Some(users) = self.users.get(name) {
                dirty.extend(users.iter().cloned());
            }
        }
        for endpoint in &update.endpoints {
            let name = endpoint.endpoint_name.clone();
            if let Some(previous) = self.endpoints.insert(name.clone(), Arc::clone(endpoint)) {
                self.unuse(&previous);
            }
            self.users
                .entry(endpoint.endpoint_config_name.clone())
                .or_default()
                .insert(name.clone());
            dirty.insert(name);
        }
        for instance in &update.instances {
            let members = self
                .members
                .entry(instance.endpoint_name.clone())
                .or_default();
            // A health or weight change keeps the route (URIs, cell) it had; anything the
            // route carries (URL, protocol, KV-event sockets, decode partner, LMCache receiver) makes a new one.
            let route = match members.get(&instance.instance_id) {
                Some(previous)
                    if previous.instance.url == instance.url
                        && previous.instance.protocol == instance.protocol
                        && previous.instance.kv_events == instance.kv_events
                        && previous.instance.decode_partner == instance.decode_partner
                        && previous.instance.lmcache_receiver == instance.lmcache_receiver =>
                {
                    previous.route.clone()
                }
                _ => InstanceRoute::prepare(instance, registry),
            };
            members.insert(
                instance.instance_id.clone(),
                Member {
                    instance: Arc::clone(instance),
                    route,
                },
            );
            dirty.insert(instance.endpoint_name.clone());
        }
        for key in &update.removed_instances {
            let removed = self
                .members
                .get_mut(&key.endpoint)
                .and_then(|members| members.remove(&key.id));
            if removed.is_some() {
                left.push(key.clone());
                dirty.insert(key.endpoint.clone());
            }
        }
    }

    fn unuse(&mut self, endpoint: &Endpoint) {
        if let Some(users) = self.users.get_mut(&endpoint.endpoint_config_name) {
            users.remove(&endpoint.endpoint_name);
            if users.is_empty() {
                self.users.remove(&endpoint.endpoint_config_name);
            }
        }
    }

    /// The route of an endpoint, if it is routable (its record and its config are known).
    fn route(&self, name: &EndpointName) -> Option<EndpointRoute> {
        let endpoint = self.endpoints.get(name)?;
        let config = self.configs.get(&endpoint.endpoint_config_name)?;
        let members = self.members.get(name);
        let routed = members.into_iter().flat_map(|members| {
            members.values().filter_map(|member| {
                member
                    .route
                    .as_ref()
                    .map(|route| (member.instance.as_ref(), route))
            })
        });
        Some(table::endpoint_route(name, config, routed))
    }
}

/// Why an update was not applied.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ApplyError {
    /// A snapshot older than the state held, from the same cluster.
    #[error("the control plane offers {offered}, older than the {held} this router holds")]
    Stale {
        held: StateVersion,
        offered: StateVersion,
    },
    /// Changes before any snapshot: a broken stream.
    #[error("changes arrived before a snapshot")]
    NoSnapshot,
}

/// What applying an update did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Applied {
    /// A table was swapped in.
    pub swapped: bool,
    /// The state now comes from another cluster than before: (before, now).
    pub cluster_changed: Option<(String, String)>,
}

/// Membership, and the table built from it.
#[derive(Debug)]
pub struct Membership {
    state: State,
    /// The version of `state`; `None` before the first snapshot.
    version: Option<StateVersion>,
    /// A snapshot being received: applied once its last piece has arrived.
    staged: Option<(StateVersion, State)>,
    /// ModelName -> endpoints with a variant of it (and that variant), for the table's models.
    model_owners: HashMap<String, BTreeMap<EndpointName, usize>>,
    registry: Arc<LoadRegistry>,
    table: Arc<ArcSwap<RoutingTable>>,
    /// Tables replaced but maybe still used by a request.
    retired_tables: Vec<Arc<RoutingTable>>,
    /// Instances that left while their cell may still be in use.
    retired_cells: Vec<InstanceKey>,
    /// Endpoints touched by the pieces of a batch whose last piece has not arrived.
    pending: BTreeSet<EndpointName>,
    /// Loads the tokenizers disaggregation configs name as they arrive.
    tokenizers: Option<Arc<TokenCounters>>,
    /// Starts loading the tokenizer folders KvAwareRoutingConfigs name as they arrive.
    local_tokenizers: Option<Arc<LocalTokenizers>>,
}

impl Membership {
    pub fn new(registry: Arc<LoadRegistry>, table: Arc<ArcSwap<RoutingTable>>) -> Self {
        Self {
            state: State::default(),
            version: None,
            staged: None,
            model_owners: HashMap::new(),
            registry,
            table,
            retired_tables: Vec::new(),
            retired_cells: Vec::new(),
            pending: BTreeSet::new(),
            tokenizers: None,
            local_tokenizers: None,
        }
    }

    /// Has the tokenizers that disaggregation configs name loaded as the configs arrive.
    pub fn with_tokenizers(mut self, tokenizers: Arc<TokenCounters>) -> Self {
        self.tokenizers = Some(tokenizers);
        self
    }

    /// Has the tokenizer folders that KvAwareRoutingConfigs name loaded as the configs arrive,
    /// so the first requests need not ask the engines while a folder loads.
    pub fn with_local_tokenizers(mut self, tokenizers: Arc<LocalTokenizers>) -> Self {
        self.local_tokenizers = Some(tokenizers);
        self
    }

    /// The version of the state held (its cluster and revision).
    pub fn version(&self) -> Option<&StateVersion> {
        self.version.as_ref()
    }

    /// Instances known (routable or not).
    pub fn instance_count(&self) -> usize {
        self.state.member_count()
    }

    /// Forgets a snapshot half received (its stream broke).
    pub fn abandon_staged(&mut self) {
        self.staged = None;
    }

    /// Applies one update at `version`; swaps a new table in when the update completes a
    /// snapshot or a batch.
    pub fn apply(
        &mut self,
        version: StateVersion,
        update: &StateUpdate,
    ) -> Result<Applied, ApplyError> {
        if update.reset {
            if let Some(held) = &self.version {
                let same_cluster = version.cluster.is_empty()
                    || held.cluster.is_empty()
                    || version.cluster == held.cluster;
                if same_cluster && version.revision < held.revision {
                    self.staged = None;
                    return Err(ApplyError::Stale {
                        held: held.clone(),
                        offered: version,
                    });
                }
            }
            self.staged = Some((version.clone(), State::default()));
        }
        let mut dirty = BTreeSet::new();
        let mut left = Vec::new();
        if let Some((staged_version, staged)) = &mut self.staged {
            staged.apply(update, &self.registry, &mut dirty, &mut left);
            *staged_version = version;
            if !update.complete {
                return Ok(Applied::default());
            }
            let (version, staged) = self.staged.take().expect("staged above");
            return Ok(self.replace(version, staged));
        }
        let Some(held) = &mut self.version else {
            return Err(ApplyError::NoSnapshot);
        };
        held.revision = held.revision.max(version.revision);
        self.state
            .apply(update, &self.registry, &mut dirty, &mut left);
        self.retired_cells.extend(left);
        if !update.complete {
            // Pieces of one batch: the table is swapped with the last (nothing is lost: the
            // endpoints touched are rebuilt from the state then).
            self.pending.extend(dirty);
            return Ok(Applied::default());
        }
        let mut dirty_all = std::mem::take(&mut self.pending);
        dirty_all.extend(dirty);
        self.publish_changes(&dirty_all);
        Ok(Applied {
            swapped: true,
            cluster_changed: None,
        })
    }

    /// Takes a whole new state (a snapshot, or a static file).
    fn replace(&mut self, version: StateVersion, state: State) -> Applied {
        let cluster_changed = match &self.version {
            Some(held)
                if !held.cluster.is_empty()
                    && !version.cluster.is_empty()
                    && held.cluster != version.cluster =>
            {
                Some((held.cluster.clone(), version.cluster.clone()))
            }
            _ => None,
        };
        let old = std::mem::replace(&mut self.state, state);
        self.retired_cells
            .extend(old.members.into_iter().flat_map(|(endpoint, members)| {
                members
                    .into_keys()
                    .map(move |id| InstanceKey::new(endpoint.clone(), id))
            }));
        self.pending.clear();
        tracing::info!(
            version = %version,
            endpoints = self.state.endpoints.len(),
            instances = self.state.member_count(),
            "routing state from snapshot"
        );
        self.version = Some(version);
        let mut table = RoutingTable {
            version: self.table_version(),
            ..RoutingTable::default()
        };
        self.model_owners.clear();
        let names: Vec<EndpointName> = self.state.endpoints.keys().cloned().collect();
        let current = self.table.load_full();
        for name in names {
            if let Some(mut route) = self.state.route(&name) {
                if let Some(previous) = current.endpoints.get(&name) {
                    route.inherit(previous);
                }
                for (model, variant) in table::route_models(&route) {
                    self.model_owners
                        .entry(model)
                        .or_default()
                        .insert(name.clone(), variant);
                }
                table.endpoints.insert(name, Arc::new(route));
            }
        }
        for (model, owners) in &self.model_owners {
            if let Some((name, variant)) = owners.first_key_value() {
                table.models.insert(model.clone(), (name.clone(), *variant));
            }
        }
        self.swap(table);
        Applied {
            swapped: true,
            cluster_changed,
        }
    }

    fn table_version(&self) -> u64 {
        self.version
            .as_ref()
            .map_or(0, |version| version.revision)
            .max(1)
    }

    /// Rebuilds the routes of `dirty` endpoints into a copy of the current table.
    fn publish_changes(&mut self, dirty: &BTreeSet<EndpointName>) {
        let current = self.table.load_full();
        let mut table = RoutingTable {
            version: self.table_version(),
            endpoints: current.endpoints.clone(),
            models: current.models.clone(),
        };
        let mut models_touched = BTreeSet::new();
        for name in dirty {
            if let Some(previous) = current.endpoints.get(name) {
                for (model, _) in table::route_models(previous) {
                    if let Some(owners) = self.model_owners.get_mut(&model) {
                        owners.remove(name);
                    }
                    models_touched.insert(model);
                }
            }
            match self.state.route(name) {
                Some(mut route) => {
                    if let Some(previous) = current.endpoints.get(name) {
                        route.inherit(previous);
                    }
                    for (model, variant) in table::route_models(&route) {
                        self.model_owners
                            .entry(model.clone())
                            .or_default()
                            .insert(name.clone(), variant);
                        models_touched.insert(model);
                    }
                    table.endpoints.insert(name.clone(), Arc::new(route));
                }
                None => {
                    table.endpoints.remove(name);
                }
            }
        }
        for model in models_touched {
            let first = self
                .model_owners
                .get(&model)
                .and_then(|owners| owners.first_key_value())
                .map(|(name, variant)| (name.clone(), *variant));
            match first {
                Some(owner) => {
                    table.models.insert(model, owner);
                }
                None => {
                    self.model_owners.remove(&model);
                    table.models.remove(&model);
                }
            }
        }
        drop(current);
        self.swap(table);
    }

    fn swap(&mut self, table: RoutingTable) {
        if let Some(tokenizers) = &self.tokenizers {
            let names = table
                .endpoints
                .values()
                .filter_map(|endpoint| endpoint.disaggregation.as_ref())
                .map(|pd| pd.tokenizer.clone())
                .collect();
            tokenizers.preload(names);
        }
        if let Some(tokenizers) = &self.local_tokenizers {
            let names: BTreeSet<&Arc<str>> = table
                .endpoints
                .values()
                .flat_map(|endpoint| &endpoint.variants)
                .filter_map(|variant| variant.tokenizer.as_ref())
                .collect();
            for name in names {
                // Starts its load on a thread of its own, once.
                tokenizers.preload(name);
            }
        }
        let old = self.table.swap(Arc::new(table));
        self.retired_tables.push(old);
        self.collect_garbage();
    }

    /// Frees replaced tables no request holds any more, and the cells of departed instances
    /// no request uses any more. Called after every swap and periodically by the sync client.
    pub fn collect_garbage(&mut self) {
        self.retired_tables
            .retain(|table| Arc::strong_count(table) > 1);
        let state = &self.state;
        self.registry
            .prune(&mut self.retired_cells, |key| state.is_member(key));
    }

    /// Replaces everything with a static configuration.
    pub fn load_static(&mut self, file: StaticConfig) {
        let mut update = StateUpdate {
            reset: true,
            complete: true,
            ..StateUpdate::default()
        };
        for (name, config) in file.endpoints {
            update.endpoints.push(Arc::new(Endpoint {
                endpoint_name: name,
                endpoint_config_name: config.endpoint_config_name.clone(),
                endpoint_status: EndpointStatus::InService,
                creation_time_ms: 0,
                last_modified_time_ms: 0,
                failure_reason: String::new(),
            }));
            update.configs.push(Arc::new(config));
        }
        update.instances = file.instances.into_iter().map(Arc::new).collect();
        let version = StateVersion {
            cluster: String::new(),
            revision: 1,
        };
        if let Err(err) = self.apply(version, &update) {
            tracing::error!(error = %err, "cannot load the static config");
        }
    }
}

/// The routing table a static config in YAML makes (the unit tests' tables).
#[cfg(test)]
pub(crate) fn static_table(yaml: &str) -> RoutingTable {
    let config = crate::routing::static_file::parse_static_text(yaml, true).unwrap();
    let table = Arc::new(ArcSwap::from_pointee(RoutingTable::default()));
    Membership::new(Arc::default(), Arc::clone(&table)).load_static(config);
    RoutingTable::clone(&table.load())
}

#[cfg(test)]
mod tests {
    use super::*;
    use switchyard_shared::{Health, ValidationError, VariantName};

    fn parse(json: &str) -> Result<StaticConfig, ValidationError> {
        crate::routing::static_file::parse_json(json)
    }

    fn config(name: &str, model: &str) -> Arc<EndpointConfig> {
        Arc::new(
            serde_json::from_str(&format!(
                r#"{{"EndpointConfigName":"{name}","ProductionVariants":[{{"VariantName":"v","ModelName":"{model}"}}]}}"#
            ))
            .unwrap(),
        )
    }

    fn endpoint(name: &str, config: &str) -> Arc<Endpoint> {
        Arc::new(Endpoint {
            endpoint_name: EndpointName::new(name).unwrap(),
            endpoint_config_name: EndpointConfigName::new(config).unwrap(),
            endpoint_status: EndpointStatus::InService,
            creation_time_ms: 0,
            last_modified_time_ms: 0,
            failure_reason: String::new(),
        })
    }

    fn instance(endpoint: &str, id: &str, health: Health) -> Arc<Instance> {
        Arc::new(Instance {
            health,
            ..Instance::new(
                InstanceId::new(id).unwrap(),
                EndpointName::new(endpoint).unwrap(),
                VariantName::new("v").unwrap(),
                format!("http://127.0.0.1:9/{id}"),
            )
        })
    }

    fn version(cluster: &str, revision: u64) -> StateVersion {
        StateVersion {
            cluster: cluster.into(),
            revision,
        }
    }

    fn membership() -> (Membership, Arc<ArcSwap<RoutingTable>>) {
        let table = Arc::new(ArcSwap::from_pointee(RoutingTable::default()));
        (Membership::new(Arc::default(), Arc::clone(&table)), table)
    }

    /// Instance ids per endpoint in the table.
    fn routed(table: &RoutingTable) -> BTreeMap<String, Vec<String>> {
        table
            .endpoints
            .iter()
            .map(|(name, route)| {
                let ids = route.variants[0]
                    .instances
                    .iter()
                    .map(|instance| instance.id.to_string())
                    .collect();
                (name.to_string(), ids)
            })
            .collect()
    }

    fn snapshot() -> StateUpdate {
        StateUpdate {
            reset: true,
            complete: true,
            configs: vec![config("cfg", "m1"), config("cfg2", "m2")],
            endpoints: vec![endpoint("a", "cfg"), endpoint("b", "cfg")],
            instances: vec![
                instance("a", "a1", Health::Healthy),
                instance("a", "a2", Health::Unknown),
                instance("b", "b1", Health::Healthy),
            ],
            ..StateUpdate::default()
        }
    }

    #[test]
    fn a_snapshot_in_pieces_swaps_in_once_complete() {
        let (mut membership, table) = membership();
        let whole = snapshot();
        let first = StateUpdate {
            reset: true,
            complete: false,
            configs: whole.configs.clone(),
            endpoints: whole.endpoints.clone(),
            ..StateUpdate::default()
        };
        let last = StateUpdate {
            reset: false,
            complete: true,
            instances: whole.instances.clone(),
            ..StateUpdate::default()
        };
        let applied = membership.apply(version("c", 5), &first).unwrap();
        assert!(!applied.swapped);
        assert_eq!(
            table.load().version,
            0,
            "nothing routable before the last piece"
        );
        assert!(membership.apply(version("c", 5), &last).unwrap().swapped);
        let loaded = table.load();
        assert_eq!(loaded.version, 5);
        assert_eq!(routed(&loaded)["a"], ["a1", "a2"]);
        assert_eq!(routed(&loaded)["b"], ["b1"]);
        assert_eq!(
            loaded.models["m1"].0.as_str(),
            "a",
            "first endpoint by name"
        );
    }

    #[test]
    fn a_change_rebuilds_only_the_endpoints_it_touches() {
        let (mut membership, table) = membership();
        membership.apply(version("c", 5), &snapshot()).unwrap();
        let before = table.load_full();
        let change = StateUpdate {
            complete: true,
            instances: vec![instance("a", "a2", Health::Unhealthy)],
            removed_instances: vec![InstanceKey::new(
                EndpointName::new("a").unwrap(),
                InstanceId::new("a1").unwrap(),
            )],
            ..StateUpdate::default()
        };
        membership.apply(version("c", 6), &change).unwrap();
        let after = table.load_full();
        assert_eq!(after.version, 6);
        assert!(routed(&after)["a"].is_empty(), "a1 left, a2 unhealthy");
        assert!(
            Arc::ptr_eq(&before.endpoints["b"], &after.endpoints["b"]),
            "b untouched and shared"
        );
        // The departed instance's cell goes once no table holds it.
        drop(before);
        membership.collect_garbage();
        assert_eq!(membership.registry.len(), 2, "a2 and b1 remain");
    }

    #[test]
    fn a_re_registration_with_a_new_partner_or_kv_sockets_takes_effect() {
        let (mut membership, table) = membership();
        membership.apply(version("c", 5), &snapshot()).unwrap();
        let mut moved = (*instance("a", "a1", Health::Healthy)).clone();
        moved.decode_partner = Some(InstanceId::new("d9").unwrap());
        moved.kv_events = Some(switchyard_shared::KvEventsEndpoints::single(
            "tcp://127.0.0.1:5557",
            None,
        ));
        let change = StateUpdate {
            complete: true,
            instances: vec![Arc::new(moved)],
            ..StateUpdate::default()
        };
        membership.apply(version("c", 6), &change).unwrap();
        let loaded = table.load();
        let a1 = &loaded.endpoints["a"].variants[0].instances[0];
        assert_eq!(a1.decode_partner.as_ref().map(|id| id.as_str()), Some("d9"));
        assert!(a1.kv_events.is_some(), "the new sockets, not the old none");
    }

    #[test]
    fn config_changes_reach_every_endpoint_using_it_and_models_follow() {
        let (mut membership, table) = membership();
        membership.apply(version("c", 5), &snapshot()).unwrap();
        let change = StateUpdate {
            complete: true,
            configs: vec![config("cfg", "m3")],
            endpoints: vec![endpoint("a", "cfg2")],
            ..StateUpdate::default()
        };
        membership.apply(version("c", 6), &change).unwrap();
        let loaded = table.load();
        let model_of = |name: &str| loaded.endpoints[name].variants[0].model_name.clone();
        assert_eq!(model_of("a").as_deref(), Some("m2"));
        assert_eq!(model_of("b").as_deref(), Some("m3"));
        assert!(!loaded.models.contains_key("m1"));
        assert_eq!(loaded.models["m2"].0.as_str(), "a");
        assert_eq!(loaded.models["m3"].0.as_str(), "b");
        // An endpoint removal takes its instances; the other keeps the model.
        let removal = StateUpdate {
            complete: true,
            removed_endpoints: vec![EndpointName::new("a").unwrap()],
            ..StateUpdate::default()
        };
        membership.apply(version("c", 7), &removal).unwrap();
        let loaded = table.load();
        assert!(!loaded.endpoints.contains_key("a"));
        assert!(!loaded.models.contains_key("m2"));
        assert_eq!(membership.instance_count(), 1);
    }

    #[test]
    fn an_older_snapshot_of_the_same_cluster_is_refused_another_cluster_is_taken() {
        let (mut membership, table) = membership();
        membership.apply(version("c", 10), &snapshot()).unwrap();
        let older = StateUpdate {
            reset: true,
            complete: true,
            ..StateUpdate::default()
        };
        let err = membership.apply(version("c", 9), &older).unwrap_err();
        assert_eq!(
            err,
            ApplyError::Stale {
                held: version("c", 10),
                offered: version("c", 9)
            }
        );
        assert_eq!(table.load().endpoints.len(), 2, "the state held stays");
        // The same revision (a reconnect to a replica with nothing new) is fine.
        membership.apply(version("c", 10), &snapshot()).unwrap();
        // A control plane that sends no cluster id counts as the same cluster.
        assert!(membership.apply(version("", 3), &older).is_err());
        // Another cluster: taken, and said so.
        let applied = membership.apply(version("d", 2), &older).unwrap();
        assert_eq!(applied.cluster_changed, Some(("c".into(), "d".into())));
        assert!(table.load().endpoints.is_empty());
        assert_eq!(membership.version(), Some(&version("d", 2)));
    }

    #[test]
    fn changes_before_any_snapshot_are_refused() {
        let (mut membership, _) = membership();
        let change = StateUpdate {
            complete: true,
            ..StateUpdate::default()
        };
        assert_eq!(
            membership.apply(version("c", 1), &change),
            Err(ApplyError::NoSnapshot)
        );
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

    /// Endpoint `chat`: one bounded PREFIX_AWARE variant `v` (PrefixLength 4096, threshold 16,
    /// the factor and slack given) over instances a, b, c, d.
    fn bounded_four(factor: &str, slack: u32) -> StaticConfig {
        parse(&format!(
            r#"{{"Endpoints":[{{"EndpointName":"chat","ProductionVariants":[
            {{"VariantName":"v","RoutingConfig":{{"RoutingStrategy":"PREFIX_AWARE","PrefixAwareRoutingConfig":
              {{"PrefixLength":4096,"ConcurrencyThreshold":16,"LoadBalanceFactor":{factor},"LoadBalanceSlack":{slack}}}}}}}],
            "Instances":[{{"Url":"http://127.0.0.1:9001","InstanceId":"a"}},{{"Url":"http://127.0.0.1:9002","InstanceId":"b"}},
              {{"Url":"http://127.0.0.1:9003","InstanceId":"c"}},{{"Url":"http://127.0.0.1:9004","InstanceId":"d"}}]}}]}}"#
        ))
        .unwrap()
    }

    #[test]
    fn a_hot_key_is_relieved_once_a_window_and_not_after_another_routers_further_copy() {
        use crate::routing::cells::{FURTHER_BEFORE, FURTHER_NOW};
        use std::sync::atomic::Ordering;
        use switchyard_process::clock::monotonic_ms;
        use switchyard_shared::sync::KeyPlacement;
        let registry: Arc<LoadRegistry> = Arc::default();
        let table = Arc::new(ArcSwap::from_pointee(RoutingTable::default()));
        let mut membership = Membership::new(Arc::clone(&registry), Arc::clone(&table));
        membership.load_static(bounded_four("2.0", 6));
        let current = table.load();
        let variant = &current.endpoints[&EndpointName::new("chat").unwrap()].variants[0];
        let views = variant.current_views(0);
        let cell = |index: usize| &variant.instances[index].cell;
        let holders = |key: u64| -> Vec<usize> {
            (0..4)
                .filter(|&index| cell(index).spills.remembers(key, monotonic_ms()))
                .collect()
        };
        // Two keys, each placed on its owner.
        let (hot, warm) = (0x5eed_u64, 0xbeef_u64);
        let hot_owner = variant.rank_prefix(&views, hot).order[0];
        let warm_owner = variant.rank_prefix(&views, warm).order[0];
        // This router sent 32 requests lately (8 an instance): the hot key's owner took 16,
        // two fair shares; the idlest instance 2.
        let idlest = (0..4).find(|&index| index != hot_owner).unwrap();
        for index in 0..4 {
            let sent = if index == hot_owner {
                16
            } else if index == idlest {
                2
            } else {
                7
            };
            cell(index).recent.store(sent, Ordering::Relaxed);
        }
        // The hot key is relieved: its next request goes to the idlest instance, a further
        // copy there, remembered, and announced as one.
        assert_eq!(variant.rank_prefix(&views, hot).first(), Some(idlest));
        assert_eq!(cell(idlest).further.load(Ordering::Relaxed), FURTHER_NOW);
        let queued = cell(idlest).announced.take(usize::MAX);
        assert_eq!(queued.last(), Some(&(hot, true)));
        let mut both = vec![hot_owner, idlest];
        both.sort_unstable();
        assert_eq!(holders(hot), both);
        // Once: another key whose holder took as much stays where it is for the rest of the
        // window, and for the whole next one.
        let busy = |index: usize| {
            cell(index).recent.store(16, Ordering::Relaxed);
            for other in (0..4).filter(|&other| other != index) {
                cell(other).recent.store(6, Ordering::Relaxed);
            }
        };
        busy(warm_owner);
        assert_eq!(variant.rank_prefix(&views, warm).first(), Some(warm_owner));
        // (The window's end: the variant's 1,024th request, 4 made so far.)
        let window = variant.window.as_ref().unwrap();
        let close_window = |made: u64| {
            for _ in 0..crate::routing::cells::WINDOW_REQUESTS - made - 1 {
                assert!(!window.record());
            }
            variant.rank_prefix(&views, warm);
            busy(warm_owner);
        };
        close_window(4);
        assert_eq!(cell(idlest).further.load(Ordering::Relaxed), FURTHER_BEFORE);
        assert_eq!(variant.rank_prefix(&views, warm).first(), Some(warm_owner));
        close_window(1);
        assert!((0..4).all(|index| cell(index).further.load(Ordering::Relaxed) == 0));
        // Another router's further copy counts as this router's own; a placement that was
        // not one (the first of a key) does not.
        let announced = (0..4)
            .find(|&index| !holders(warm).contains(&index))
            .unwrap();
        let place = |index: usize, key: u64, further: bool| {
            crate::routing::sync_client::apply_placements(
                &registry,
                &[KeyPlacement {
                    instance: InstanceKey::new(
                        EndpointName::new("chat").unwrap(),
                        variant.instances[index].id.clone(),
                    ),
                    key,
                    further,
                }],
            )
        };
        assert_eq!(place(announced, 0xf00d, false), 1);
        assert!((0..4).all(|index| cell(index).further.load(Ordering::Relaxed) == 0));
        assert_eq!(place(announced, warm, true), 1);
        assert_eq!(cell(announced).further.load(Ordering::Relaxed), FURTHER_NOW);
        // Until then, the warm key was not relieved: it is held where it was placed, and
        // now (as announced) there.
        let mut warm_holders = vec![warm_owner, announced];
        warm_holders.sort_unstable();
        assert_eq!(holders(warm), warm_holders);
    }

    #[test]
    fn bounded_loads_remember_a_spill_and_send_the_key_back_to_its_copy() {
        use std::sync::atomic::Ordering;
        use switchyard_policy::rank::Route;
        use switchyard_process::clock::monotonic_ms;
        let config = || bounded_four("1.0", 0);
        let table = Arc::new(ArcSwap::from_pointee(RoutingTable::default()));
        let mut membership = Membership::new(Arc::default(), Arc::clone(&table));
        membership.load_static(config());
        let key = 0x5eed_u64;
        let current = table.load();
        let variant = &current.endpoints[&EndpointName::new("chat").unwrap()].variants[0];
        let views = variant.current_views(0);
        let idle = variant.rank_prefix(&views, key);
        assert_eq!(idle.route, Some(Route::Prefix));
        let (owner, second, third) = (idle.order[0], idle.order[1], idle.order[2]);
        // Every placement is remembered (and counted as a copy, and queued for the other
        // routers), the owner's too.
        let held: Vec<bool> = variant
            .instances
            .iter()
            .map(|i| i.cell.spills.remembers(key, monotonic_ms()))
            .collect();
        assert_eq!(held.iter().filter(|&&held| held).count(), 1);
        assert!(held[owner]);
        let cell = &variant.instances[owner].cell;
        assert_eq!(cell.copies.load(Ordering::Relaxed), 1);
        assert_eq!(cell.announced.take(usize::MAX), [(key, false)]);
        // 8 in flight over 4: bound ⌈9 / 4⌉ = 3. The owner is at 5; the third choice is idler
        // than the second, so the first spill goes there and is remembered.
        let set = |loads: [(usize, u32); 4]| {
            for (index, load) in loads {
                variant.instances[index]
                    .cell
                    .local
                    .store(load, Ordering::Relaxed);
            }
        };
        let fourth = idle.order[3];
        set([(owner, 5), (second, 2), (third, 0), (fourth, 1)]);
        let spill = variant.rank_prefix(&views, key);
        assert_eq!(
            (spill.first(), spill.route),
            (Some(third), Some(Route::Overflow))
        );
        assert!(
            variant.instances[third]
                .cell
                .spills
                .remembers(key, monotonic_ms())
        );
        // Now the second choice is the idlest, but the copy is below the bound: back there.
        set([(owner, 5), (second, 0), (third, 2), (fourth, 1)]);
        assert_eq!(variant.rank_prefix(&views, key).first(), Some(third));
        // The router counts where it sent each request: a new copy goes where it sent fewest.
        let recent = |index: usize| variant.instances[index].cell.recent.load(Ordering::Relaxed);
        assert_eq!((recent(owner), recent(second), recent(third)), (1, 0, 2));
        // The counts are halved once per window of the variant's requests: idle, the next
        // WINDOW_REQUESTS requests go to the owner, and one of them closes a window.
        set([(owner, 0), (second, 0), (third, 0), (fourth, 0)]);
        for _ in 0..crate::routing::cells::WINDOW_REQUESTS {
            assert_eq!(variant.rank_prefix(&views, key).first(), Some(owner));
        }
        // (The owner had 1; 1,020 more make 1,021, halved to 510 when the variant's 1,024th
        // request closed the window, then 4 more: 514.)
        assert_eq!((recent(owner), recent(second), recent(third)), (514, 0, 1));
        let owner_recent = recent(owner);
        // The memory lives in the instance's cell, so a new table (any config or membership
        // change) keeps it.
        membership.load_static(config());
        let rebuilt = table.load();
        let variant = &rebuilt.endpoints[&EndpointName::new("chat").unwrap()].variants[0];
        let id = |index: usize| {
            current.endpoints[&EndpointName::new("chat").unwrap()].variants[0].instances[index]
                .id
                .clone()
        };
        let copy = variant
            .instances
            .iter()
            .position(|i| i.id == id(third))
            .unwrap();
        assert!(
            variant.instances[copy]
                .cell
                .spills
                .remembers(key, monotonic_ms())
        );
        let kept_owner = variant
            .instances
            .iter()
            .position(|i| i.id == id(owner))
            .unwrap();
        assert_eq!(
            variant.instances[kept_owner]
                .cell
                .recent
                .load(Ordering::Relaxed),
            owner_recent
        );
        // So is the window of requests.
        let old_variant = &current.endpoints[&EndpointName::new("chat").unwrap()].variants[0];
        assert!(Arc::ptr_eq(
            variant.window.as_ref().unwrap(),
            old_variant.window.as_ref().unwrap()
        ));
        // The memory itself: direct-mapped, so a colliding key replaces the older one.
        use crate::routing::cells::{SPILL_MEMORY_MS, SPILL_SLOTS, SpillMemory};
        let memory = SpillMemory::default();
        let t = 1_764_590_000_000;
        assert!(!memory.remembers(key, t));
        memory.remember(key, t);
        assert!(memory.remembers(key, t));
        memory.remember(key + SPILL_SLOTS as u64, t);
        assert!(!memory.remembers(key, t));
        assert!(memory.remembers(key + SPILL_SLOTS as u64, t));
        memory.remember(0, t);
        assert!(memory.remembers(0, t));
        // A spill is forgotten SPILL_MEMORY_MS (to a 1 s tick) after the last one; spilling the
        // key there again renews it.
        let later = t + SPILL_MEMORY_MS - 2_000;
        assert!(memory.remembers(0, later));
        assert!(!memory.remembers(0, t + SPILL_MEMORY_MS + 2_000));
        memory.remember(0, later);
        assert!(memory.remembers(0, t + SPILL_MEMORY_MS + 2_000));
        // An entry stored by a request that read the clock later than this one is fresh.
        assert!(memory.remembers(0, t - 5_000));
        // Far later (the 16-bit ticks of an earlier version wrapped after 18 hours) it stays
        // forgotten.
        assert!(!memory.remembers(0, later + 65_536 * 1024));
    }
}
