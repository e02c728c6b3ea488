//! The control plane's in-memory view of everything routers need (endpoint configs, endpoints,
//! instances), kept current by one store watch over `state/`, and the broadcast of changes that
//! every router sync stream forwards. Domain types only: `sync.rs` puts them on the wire.
//!
//! Architecture invariant: a router stream takes its snapshot and subscribes to changes under
//! the same lock the watch loop applies changes under, so a router never misses or repeats a
//! change. If a stream falls behind the broadcast, or the view is rebuilt from a new listing,
//! it takes a fresh snapshot instead.
//!
//! The view also knows whether it is current. The watch is asked every second how far it has
//! come; a store that does not answer within [`STALL_AFTER`] (an etcd member frozen or cut off
//! from its quorum, whose watches etcd's require-leader option ends) makes this replica not
//! ready: router streams end, so routers move to another replica, until a new listing works.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, LazyLock, Mutex};
use std::time::Duration;

use futures::StreamExt;
use switchyard_shared::sync::{StateChange, StateVersion};
use switchyard_shared::{
    Endpoint, EndpointConfig, EndpointConfigName, EndpointName, HealthCheckConfig, Instance,
    InstanceId, InstanceKey,
};
use tokio::sync::{broadcast, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::keys;
use crate::registry::decode;
use crate::store::{Compare, Kv, Revision, Store, Txn, WatchEvent, WatchItem};

/// Batches of changes a stream may fall behind by before it gets a fresh snapshot instead
/// (the default of `ControlConfig::change_buffer`).
pub const CHANGE_BUFFER: usize = 16384;
/// How often the watch is asked how far it has come.
const PROGRESS_EVERY: Duration = Duration::from_secs(1);
/// A watch silent this long (no events, no progress answer) is stalled: the store moves to
/// another member (if it has several) and the state is listed again.
pub const STALL_AFTER: Duration = Duration::from_secs(3);
/// After a stall (or a watch that failed), a listing that does not succeed within this long
/// makes the replica not ready. So a replica turns not ready at most about `STALL_AFTER` + the progress period
/// (1 s) + this after its store stops answering; one that can move to a live member does not
/// turn not ready at all.
pub const RELIST_AFTER_STALL: Duration = Duration::from_secs(2);

/// Whether this replica's view is current.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Readiness {
    /// No listing yet.
    Starting,
    Ready,
    /// The store does not answer or its watch stalled: the reason, for logs and routers.
    NotReady(String),
}

/// What the view publishes.
#[derive(Debug)]
pub enum Published {
    /// Changes of one store watch response, at `revision`.
    Changes {
        revision: Revision,
        changes: Vec<StateChange>,
        /// When this replica's view took them in (the sync push lag is measured from here).
        at: std::time::Instant,
    },
    /// The view was rebuilt from a new listing: subscribe again for a fresh snapshot.
    Rebuilt,
}

/// Everything routers need, at one version.
#[derive(Debug, Clone, Default)]
pub struct StateSnapshot {
    pub version: StateVersion,
    pub configs: Vec<Arc<EndpointConfig>>,
    pub endpoints: Vec<Arc<Endpoint>>,
    pub instances: Vec<Arc<Instance>>,
}

#[derive(Debug, Default)]
struct View {
    cluster: String,
    revision: Revision,
    configs: HashMap<EndpointConfigName, Arc<EndpointConfig>>,
    endpoints: BTreeMap<EndpointName, Arc<Endpoint>>,
    instances: BTreeMap<InstanceKey, Arc<Instance>>,
}

impl View {
    fn from_kvs(kvs: &[Kv], revision: Revision) -> Self {
        let mut view = View {
            revision,
            ..View::default()
        };
        for kv in kvs {
            view.apply_put(kv, &mut Vec::new());
        }
        view
    }

    /// Applies a put; pushes the change it makes, if any.
    fn apply_put(&mut self, kv: &Kv, changes: &mut Vec<StateChange>) {
        let key = kv.key.as_str();
        if key == keys::CLUSTER_ID {
            self.cluster = String::from_utf8_lossy(&kv.value).into_owned();
            return;
        }
        if key.starts_with(keys::CONFIGS) {
            let Some(config) = decode_or_warn::<EndpointConfig>(kv) else {
                return;
            };
            let name = config.endpoint_config_name.clone();
            if self
                .configs
                .get(&name)
                .is_some_and(|known| **known == config)
            {
                // A touch by an endpoint write: nothing changed.
                return;
            }
            let config = Arc::new(config);
            self.configs.insert(name, Arc::clone(&config));
            changes.push(StateChange::Config(config));
            return;
        }
        if key.starts_with(keys::ENDPOINTS) {
            let Some(endpoint) = decode_or_warn::<Endpoint>(kv) else {
                return;
            };
            let endpoint = Arc::new(endpoint);
            self.endpoints
                .insert(endpoint.endpoint_name.clone(), Arc::clone(&endpoint));
            changes.push(StateChange::Endpoint(endpoint));
            return;
        }
        if key.starts_with(keys::INSTANCES) {
            let Some(instance) = decode_or_warn::<Instance>(kv) else {
                return;
            };
            let instance = Arc::new(instance);
            self.instances
                .insert(InstanceKey::of(&instance), Arc::clone(&instance));
            changes.push(StateChange::Instance(instance));
        }
    }

    fn apply_delete(&mut self, key: &str, changes: &mut Vec<StateChange>) {
        if let Some(name) = key.strip_prefix(keys::CONFIGS) {
            let Ok(name) = EndpointConfigName::new(name) else {
                return;
            };
            if self.configs.remove(&name).is_some() {
                changes.push(StateChange::ConfigRemoved(name));
            }
            return;
        }
        if let Some(name) = key.strip_prefix(keys::ENDPOINTS) {
            let Ok(name) = EndpointName::new(name) else {
                return;
            };
            if self.endpoints.remove(&name).is_none() {
                return;
            }
            // An endpoint removal removes its instances too (the registry deletes them in the
            // same transaction): routers are sent one removal, not one per instance.
            let doomed: Vec<InstanceKey> = self
                .instances
                .keys()
                .filter(|instance| instance.endpoint == name)
                .cloned()
                .collect();
            for instance in doomed {
                self.instances.remove(&instance);
            }
            changes.push(StateChange::EndpointRemoved(name));
            return;
        }
        if let Some(rest) = key.strip_prefix(keys::INSTANCES) {
            let Some((endpoint, id)) = rest.split_once('/') else {
                return;
            };
            let (Ok(endpoint), Ok(id)) = (EndpointName::new(endpoint), InstanceId::new(id)) else {
                return;
            };
            let key = InstanceKey::new(endpoint, id);
            if self.instances.remove(&key).is_some() {
                changes.push(StateChange::InstanceRemoved(key));
            }
        }
    }

    /// The changes that turn this view into `new`, in the order routers apply them.
    fn difference(&self, new: &View) -> Vec<StateChange> {
        let mut changes = Vec::new();
        for name in self.endpoints.keys() {
            if !new.endpoints.contains_key(name) {
                changes.push(StateChange::EndpointRemoved(name.clone()));
            }
        }
        for (name, config) in &new.configs {
            if self.configs.get(name) != Some(config) {
                changes.push(StateChange::Config(Arc::clone(config)));
            }
        }
        for name in self.configs.keys() {
            if !new.configs.contains_key(name) {
                changes.push(StateChange::ConfigRemoved(name.clone()));
            }
        }
        for (name, endpoint) in &new.endpoints {
            if self.endpoints.get(name) != Some(endpoint) {
                changes.push(StateChange::Endpoint(Arc::clone(endpoint)));
            }
        }
        for (key, instance) in &new.instances {
            // An endpoint removed above took its instances: whatever remains is put again.
            let removed_with_endpoint = !new.endpoints.contains_key(&key.endpoint)
                && self.endpoints.contains_key(&key.endpoint);
            if removed_with_endpoint || self.instances.get(key) != Some(instance) {
                changes.push(StateChange::Instance(Arc::clone(instance)));
            }
        }
        for key in self.instances.keys() {
            let endpoint_removed = self.endpoints.contains_key(&key.endpoint)
                && !new.endpoints.contains_key(&key.endpoint);
            if !new.instances.contains_key(key) && !endpoint_removed {
                changes.push(StateChange::InstanceRemoved(key.clone()));
            }
        }
        changes
    }

    fn probe_target(&self, instance: &Arc<Instance>) -> ProbeTarget {
        let config = self
            .endpoints
            .get(&instance.endpoint_name)
            .and_then(|endpoint| self.configs.get(&endpoint.endpoint_config_name))
            .cloned();
        ProbeTarget {
            instance: Arc::clone(instance),
            config,
        }
    }

    fn snapshot(&self) -> StateSnapshot {
        StateSnapshot {
            version: StateVersion {
                cluster: self.cluster.clone(),
                revision: self.revision.max(0) as u64,
            },
            configs: self.configs.values().cloned().collect(),
            endpoints: self.endpoints.values().cloned().collect(),
            instances: self.instances.values().cloned().collect(),
        }
    }
}

fn decode_or_warn<T: serde::de::DeserializeOwned>(kv: &Kv) -> Option<T> {
    match decode(kv) {
        Ok(value) => Some(value),
        Err(err) => {
            tracing::error!(key = %kv.key, error = %err, "skipping unreadable record");
            None
        }
    }
}

static DEFAULT_HEALTH_CHECK: LazyLock<HealthCheckConfig> =
    LazyLock::new(HealthCheckConfig::default);

/// An instance with the config of its endpoint (for its health-check settings).
#[derive(Debug, Clone)]
pub struct ProbeTarget {
    pub instance: Arc<Instance>,
    pub config: Option<Arc<EndpointConfig>>,
}

impl ProbeTarget {
    pub fn health_check(&self) -> &HealthCheckConfig {
        self.config
            .as_ref()
            .map_or(&DEFAULT_HEALTH_CHECK, |config| &config.health_check_config)
    }
}

#[derive(Debug)]
pub struct StateCache {
    view: Mutex<View>,
    changes: broadcast::Sender<Arc<Published>>,
    readiness: watch::Sender<Readiness>,
}

impl StateCache {
    /// A view whose change broadcast holds `buffer` batches (at least 1).
    pub fn new(buffer: usize) -> Arc<Self> {
        let (changes, _) = broadcast::channel(buffer.max(1));
        Arc::new(Self {
            view: Mutex::new(View::default()),
            changes,
            readiness: watch::Sender::new(Readiness::Starting),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, View> {
        self.view
            .lock()
            .unwrap_or_else(|poison| poison.into_inner())
    }

    /// The current snapshot and a receiver for everything published after it.
    pub fn subscribe(&self) -> (StateSnapshot, broadcast::Receiver<Arc<Published>>) {
        let view = self.lock();
        (view.snapshot(), self.changes.subscribe())
    }

    /// Follows whether the view is current.
    pub fn readiness(&self) -> watch::Receiver<Readiness> {
        self.readiness.subscribe()
    }

    pub fn is_ready(&self) -> bool {
        *self.readiness.borrow() == Readiness::Ready
    }

    fn set_readiness(&self, readiness: Readiness) {
        self.readiness.send_if_modified(|current| {
            if *current == readiness {
                return false;
            }
            match &readiness {
                Readiness::Ready => tracing::info!("state is current; serving routers"),
                Readiness::NotReady(reason) => tracing::warn!(
                    reason = %reason,
                    "state may be stale: not ready, router streams end so routers move to another replica"
                ),
                Readiness::Starting => {}
            }
            *current = readiness;
            true
        });
    }

    pub fn revision(&self) -> Revision {
        self.lock().revision
    }

    /// Endpoint configs, endpoints and instances in the view.
    pub fn sizes(&self) -> (usize, usize, usize) {
        let view = self.lock();
        (
            view.configs.len(),
            view.endpoints.len(),
            view.instances.len(),
        )
    }

    pub fn probe_targets(&self) -> Vec<ProbeTarget> {
        let view = self.lock();
        view.instances
            .values()
            .map(|instance| view.probe_target(instance))
            .collect()
    }

    /// The current record of one instance, with its endpoint's config.
    pub fn probe_target(&self, key: &InstanceKey) -> Option<ProbeTarget> {
        let view = self.lock();
        view.instances
            .get(key)
            .map(|instance| view.probe_target(instance))
    }

    /// Keeps the figures (or placements) of instances the view knows; returns how many it
    /// dropped. (A router can only have requests in flight on instances it was sent.)
    pub fn retain_known<T>(&self, items: &mut Vec<T>, key: impl Fn(&T) -> &InstanceKey) -> usize {
        let before = items.len();
        let view = self.lock();
        items.retain(|item| view.instances.contains_key(key(item)));
        before - items.len()
    }

    /// Takes a new listing. Listed again from the same cluster and not older, the difference
    /// is published as changes (routers get a batch, not a snapshot each: a relist after a
    /// stall is cheap); otherwise every stream is told to send a fresh snapshot.
    fn replace(&self, kvs: &[Kv], revision: Revision) {
        let mut view = self.lock();
        let new = View::from_kvs(kvs, revision);
        let loaded = view.revision > 0 || !view.cluster.is_empty();
        if loaded && view.cluster == new.cluster && revision >= view.revision {
            let changes = view.difference(&new);
            *view = new;
            if !changes.is_empty() {
                let _ = self.changes.send(Arc::new(Published::Changes {
                    revision,
                    changes,
                    at: std::time::Instant::now(),
                }));
            }
            return;
        }
        *view = new;
        let _ = self.changes.send(Arc::new(Published::Rebuilt));
    }

    /// Applies a batch of watch events; false when the batch touched the cluster id (the store
    /// was recreated under this replica: list again).
    fn apply(&self, events: &[WatchEvent]) -> bool {
        let mut view = self.lock();
        let mut changes = Vec::new();
        let mut revision = view.revision;
        for event in events {
            if event.key() == keys::CLUSTER_ID {
                return false;
            }
            match event {
                WatchEvent::Put(kv) => view.apply_put(kv, &mut changes),
                WatchEvent::Delete { key, .. } => view.apply_delete(key, &mut changes),
            }
            revision = revision.max(event.revision());
        }
        view.revision = revision;
        if !changes.is_empty() {
            let _ = self.changes.send(Arc::new(Published::Changes {
                revision,
                changes,
                at: std::time::Instant::now(),
            }));
        }
        true
    }

    /// Follows the store until `shutdown`: list, then apply the watch; on any watch failure
    /// or stall list again (every router stream then takes a fresh snapshot).
    pub async fn run(self: Arc<Self>, store: Arc<dyn Store>, shutdown: CancellationToken) {
        let mut backoff = Duration::from_millis(100);
        let mut stalled = false;
        while !shutdown.is_cancelled() {
            let listed = async {
                if !stalled {
                    return store.list_and_watch(keys::STATE).await;
                }
                match tokio::time::timeout(RELIST_AFTER_STALL, store.list_and_watch(keys::STATE))
                    .await
                {
                    Ok(listing) => listing,
                    Err(_) => Err(crate::store::StoreError::Unavailable(format!(
                        "the store watch stalled and no listing came within {} ms",
                        RELIST_AFTER_STALL.as_millis()
                    ))),
                }
            };
            let listing = tokio::select! {
                () = shutdown.cancelled() => return,
                listing = listed => listing,
            };
            stalled = false;
            let mut listing = match listing {
                Ok(listing) => listing,
                Err(err) => {
                    self.set_readiness(Readiness::NotReady(format!("cannot list state: {err}")));
                    tracing::warn!(error = %err, retry_in = ?backoff, "cannot list state; routers keep their last state");
                    tokio::select! {
                        () = shutdown.cancelled() => return,
                        () = tokio::time::sleep(backoff) => {}
                    }
                    backoff = (backoff * 2).min(Duration::from_secs(5));
                    continue;
                }
            };
            backoff = Duration::from_millis(100);
            if !listing.kvs.iter().any(|kv| kv.key == keys::CLUSTER_ID) {
                // A store nobody used yet (or one recreated): give it an identity, then list
                // again so the id and the revision come from one listing.
                let id = format!("{:016x}{:016x}", fastrand::u64(..), fastrand::u64(..));
                let made = store
                    .commit(
                        Txn::new()
                            .when(Compare::Absent(keys::CLUSTER_ID.to_owned()))
                            .put(keys::CLUSTER_ID, id.clone().into_bytes(), 0),
                    )
                    .await;
                match made {
                    Ok(Some(_)) => tracing::info!(cluster = %id, "new cluster id for this store"),
                    Ok(None) => {}
                    Err(err) => {
                        self.set_readiness(Readiness::NotReady(format!(
                            "cannot record the cluster id: {err}"
                        )));
                        tokio::select! {
                            () = shutdown.cancelled() => return,
                            () = tokio::time::sleep(Duration::from_millis(500)) => {}
                        }
                    }
                }
                continue;
            }
            tracing::info!(
                revision = listing.revision,
                records = listing.kvs.len(),
                "loaded state"
            );
            self.replace(&listing.kvs, listing.revision);
            self.set_readiness(Readiness::Ready);
            let mut progress = tokio::time::interval(PROGRESS_EVERY);
            progress.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut last_heard = Instant::now();
            loop {
                let next = tokio::select! {
                    // What the watch delivered is looked at before the clock: a replica whose
                    // threads were busy must not take answers waiting for silence.
                    biased;
                    () = shutdown.cancelled() => return,
                    next = listing.watch.next() => next,
                    due = progress.tick() => {
                        // A tick that comes late means this replica's own threads did not
                        // run (a starved machine): the store is not to blame for that time.
                        if due.elapsed() > PROGRESS_EVERY / 2 {
                            last_heard = Instant::now();
                        }
                        let silent = last_heard.elapsed();
                        if silent > STALL_AFTER {
                            tracing::warn!(silent_ms = silent.as_millis() as u64, "the store watch answers nothing; listing again");
                            listing.control.stalled();
                            stalled = true;
                            break;
                        }
                        let asked = tokio::time::timeout(
                            PROGRESS_EVERY,
                            listing.control.request_progress(),
                        )
                        .await;
                        if !matches!(asked, Ok(Ok(()))) {
                            tracing::debug!("cannot ask the store watch for progress");
                        }
                        continue;
                    }
                };
                last_heard = Instant::now();
                match next {
                    Some(Ok(WatchItem::Events(events))) => {
                        if !self.apply(&events) {
                            tracing::warn!("the cluster id changed in the store; listing again");
                            break;
                        }
                    }
                    Some(Ok(WatchItem::Progress(_))) => {}
                    // Listed again at once, within a deadline: not ready only if that fails.
                    Some(Err(err)) => {
                        tracing::warn!(error = %err, "state watch failed; listing again");
                        stalled = true;
                        break;
                    }
                    None => {
                        tracing::warn!("state watch ended; listing again");
                        stalled = true;
                        break;
                    }
                }
            }
            if !stalled {
                tokio::select! {
                    () = shutdown.cancelled() => return,
                    () = tokio::time::sleep(Duration::from_millis(100)) => {}
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::embedded::EmbeddedStore;

    fn kv(key: String, value: Vec<u8>) -> Kv {
        Kv {
            key,
            value,
            mod_revision: 1,
            lease: 0,
        }
    }

    #[test]
    fn a_relist_publishes_only_the_difference() {
        let endpoint = |name: &str| {
            kv(
                keys::endpoint(name),
                format!(r#"{{"EndpointName":"{name}","EndpointConfigName":"cfg","EndpointStatus":"InService","CreationTimeMs":0,"LastModifiedTimeMs":0}}"#).into_bytes(),
            )
        };
        let instance = |endpoint: &str, id: &str| {
            kv(keys::instance(endpoint, id), instance_json(endpoint, id))
        };
        let old = View::from_kvs(
            &[
                endpoint("a"),
                endpoint("b"),
                instance("a", "a1"),
                instance("a", "a2"),
                instance("b", "b1"),
            ],
            5,
        );
        let mut moved = instance("a", "a2");
        moved.value = String::from_utf8(moved.value)
            .unwrap()
            .replace("127.0.0.1:1", "127.0.0.1:2")
            .into_bytes();
        let new = View::from_kvs(
            &[
                endpoint("a"),
                instance("a", "a1"),
                moved,
                instance("a", "a3"),
            ],
            9,
        );
        let changes = old.difference(&new);
        let described: Vec<String> = changes
            .iter()
            .map(|change| match change {
                StateChange::EndpointRemoved(name) => format!("-endpoint {name}"),
                StateChange::Instance(instance) => format!("+{}", instance.instance_id),
                StateChange::InstanceRemoved(key) => format!("-{key}"),
                other => format!("{other:?}"),
            })
            .collect();
        assert_eq!(described, ["-endpoint b", "+a2", "+a3"]);
    }

    fn instance_json(endpoint: &str, id: &str) -> Vec<u8> {
        format!(
            r#"{{"InstanceId":"{id}","EndpointName":"{endpoint}","VariantName":"v","Url":"http://127.0.0.1:1","Weight":1.0}}"#
        )
        .into_bytes()
    }

    #[tokio::test]
    async fn an_endpoint_delete_is_one_change_and_takes_its_instances() {
        let store: Arc<dyn Store> =
            Arc::new(EmbeddedStore::open(None, CancellationToken::new()).unwrap());
        let endpoint = br#"{"EndpointName":"chat","EndpointConfigName":"cfg","EndpointStatus":"InService","CreationTimeMs":0,"LastModifiedTimeMs":0}"#;
        let mut txn = Txn::new().put(keys::endpoint("chat"), endpoint.to_vec(), 0);
        for index in 0..50 {
            let id = format!("i{index}");
            txn = txn.put(keys::instance("chat", &id), instance_json("chat", &id), 0);
        }
        store.commit(txn).await.unwrap();
        let cache = StateCache::new(CHANGE_BUFFER);
        let shutdown = CancellationToken::new();
        tokio::spawn(Arc::clone(&cache).run(Arc::clone(&store), shutdown.clone()));
        let mut readiness = cache.readiness();
        readiness
            .wait_for(|readiness| *readiness == Readiness::Ready)
            .await
            .unwrap();
        let (snapshot, mut changes) = cache.subscribe();
        assert_eq!(snapshot.instances.len(), 50);
        assert!(
            !snapshot.version.cluster.is_empty(),
            "a cluster id was made"
        );
        store
            .commit(
                Txn::new()
                    .delete(keys::endpoint("chat"))
                    .delete_prefix(keys::instances_of("chat")),
            )
            .await
            .unwrap();
        let published = tokio::time::timeout(Duration::from_secs(5), changes.recv())
            .await
            .unwrap()
            .unwrap();
        let Published::Changes { changes, .. } = published.as_ref() else {
            panic!("expected changes, got {published:?}");
        };
        assert_eq!(
            changes,
            &vec![StateChange::EndpointRemoved(
                EndpointName::new("chat").unwrap()
            )]
        );
        assert!(cache.probe_targets().is_empty());
        shutdown.cancel();
    }
}
