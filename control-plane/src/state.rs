//! The control plane's in-memory view of everything routers need (endpoints with their
//! configs, instances), kept current by one store watch over `state/`, and the broadcast of
//! changes that every router sync stream forwards.
//!
//! Architecture invariant: a router stream takes its snapshot and subscribes to changes under
//! the same lock the watch loop applies changes under, so a router never misses or repeats a
//! change. If a stream falls behind the broadcast, it gets a fresh snapshot instead.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use switchyard_proto::v1 as pb;
use switchyard_shared::{Endpoint, EndpointConfig, HealthCheckConfig, Instance};
use tokio::sync::{broadcast, watch};
use tokio_util::sync::CancellationToken;

use crate::keys;
use crate::registry::decode;
use crate::store::{Kv, Revision, Store, WatchEvent};

const BROADCAST_BUFFER: usize = 1024;

#[derive(Debug, Default)]
struct View {
    revision: Revision,
    configs: HashMap<String, EndpointConfig>,
    endpoints: BTreeMap<String, Endpoint>,
    instances: BTreeMap<(String, String), Instance>,
}

impl View {
    fn from_kvs(kvs: &[Kv], revision: Revision) -> Self {
        let mut view = View {
            revision,
            ..View::default()
        };
        for kv in kvs {
            view.apply_put(kv);
        }
        view
    }

    /// Applies a put; returns the sync messages it causes (without versions).
    fn apply_put(&mut self, kv: &Kv) -> Vec<pb::sync_message::Message> {
        use pb::sync_message::Message;
        let key = kv.key.as_str();
        if let Some(name) = key.strip_prefix(keys::CONFIGS) {
            let Some(config) = decode_or_warn::<EndpointConfig>(kv) else {
                return Vec::new();
            };
            if self.configs.get(name) == Some(&config) {
                // A touch by an endpoint write: nothing changed.
                return Vec::new();
            }
            self.configs.insert(name.to_owned(), config);
            return self
                .endpoints
                .values()
                .filter(|endpoint| endpoint.endpoint_config_name.as_str() == name)
                .filter_map(|endpoint| self.routed(endpoint))
                .map(Message::EndpointChanged)
                .collect();
        }
        if let Some(name) = key.strip_prefix(keys::ENDPOINTS) {
            let Some(endpoint) = decode_or_warn::<Endpoint>(kv) else {
                return Vec::new();
            };
            let message = self.routed(&endpoint).map(Message::EndpointChanged);
            self.endpoints.insert(name.to_owned(), endpoint);
            return message.into_iter().collect();
        }
        if key.starts_with(keys::INSTANCES) {
            let Some(instance) = decode_or_warn::<Instance>(kv) else {
                return Vec::new();
            };
            let message = Message::InstanceChanged(pb::Instance::from(&instance));
            self.instances.insert(
                (
                    instance.endpoint_name.to_string(),
                    instance.instance_id.to_string(),
                ),
                instance,
            );
            return vec![message];
        }
        Vec::new()
    }

    fn apply_delete(&mut self, key: &str) -> Vec<pb::sync_message::Message> {
        use pb::sync_message::Message;
        if let Some(name) = key.strip_prefix(keys::CONFIGS) {
            self.configs.remove(name);
            return Vec::new();
        }
        if let Some(name) = key.strip_prefix(keys::ENDPOINTS) {
            return match self.endpoints.remove(name) {
                Some(_) => vec![Message::EndpointRemoved(pb::EndpointRemoved {
                    name: name.to_owned(),
                })],
                None => Vec::new(),
            };
        }
        if let Some(rest) = key.strip_prefix(keys::INSTANCES) {
            let Some((endpoint, id)) = rest.split_once('/') else {
                return Vec::new();
            };
            return match self.instances.remove(&(endpoint.to_owned(), id.to_owned())) {
                Some(_) => vec![Message::InstanceRemoved(pb::InstanceRemoved {
                    endpoint_name: endpoint.to_owned(),
                    id: id.to_owned(),
                })],
                None => Vec::new(),
            };
        }
        Vec::new()
    }

    fn routed(&self, endpoint: &Endpoint) -> Option<pb::RoutedEndpoint> {
        let config = self.configs.get(endpoint.endpoint_config_name.as_str())?;
        Some(pb::RoutedEndpoint {
            endpoint: Some(endpoint.into()),
            config: Some(config.into()),
        })
    }

    fn probe_target(&self, instance: &Instance) -> ProbeTarget {
        let health_check = self
            .endpoints
            .get(instance.endpoint_name.as_str())
            .and_then(|endpoint| self.configs.get(endpoint.endpoint_config_name.as_str()))
            .map(|config| config.health_check_config.clone())
            .unwrap_or_default();
        ProbeTarget {
            instance: instance.clone(),
            health_check,
        }
    }

    fn snapshot(&self, replica_id: &str) -> pb::SyncMessage {
        pb::SyncMessage {
            version: self.revision as u64,
            replica_id: replica_id.to_owned(),
            message: Some(pb::sync_message::Message::Snapshot(pb::Snapshot {
                endpoints: self
                    .endpoints
                    .values()
                    .filter_map(|endpoint| self.routed(endpoint))
                    .collect(),
                instances: self.instances.values().map(pb::Instance::from).collect(),
            })),
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

/// An instance with the health-check settings of its endpoint's config.
#[derive(Debug, Clone)]
pub struct ProbeTarget {
    pub instance: Instance,
    pub health_check: HealthCheckConfig,
}

#[derive(Debug)]
pub struct StateCache {
    replica_id: String,
    view: Mutex<View>,
    changes: broadcast::Sender<Arc<pb::SyncMessage>>,
    ready: watch::Sender<bool>,
}

impl StateCache {
    pub fn new(replica_id: String) -> Arc<Self> {
        let (changes, _) = broadcast::channel(BROADCAST_BUFFER);
        Arc::new(Self {
            replica_id,
            view: Mutex::new(View::default()),
            changes,
            ready: watch::Sender::new(false),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, View> {
        self.view
            .lock()
            .unwrap_or_else(|poison| poison.into_inner())
    }

    /// The current snapshot and a receiver for every change after it.
    pub fn subscribe(&self) -> (pb::SyncMessage, broadcast::Receiver<Arc<pb::SyncMessage>>) {
        let view = self.lock();
        (view.snapshot(&self.replica_id), self.changes.subscribe())
    }

    /// Resolves once the first listing has been loaded.
    pub async fn wait_ready(&self) {
        let mut ready = self.ready.subscribe();
        let _ = ready.wait_for(|ready| *ready).await;
    }

    pub fn revision(&self) -> Revision {
        self.lock().revision
    }

    pub fn probe_targets(&self) -> Vec<ProbeTarget> {
        let view = self.lock();
        view.instances
            .values()
            .map(|instance| view.probe_target(instance))
            .collect()
    }

    /// The current record of one instance, with its health-check settings.
    pub fn probe_target(&self, endpoint: &str, id: &str) -> Option<ProbeTarget> {
        let view = self.lock();
        view.instances
            .get(&(endpoint.to_owned(), id.to_owned()))
            .map(|instance| view.probe_target(instance))
    }

    fn replace(&self, kvs: &[Kv], revision: Revision) {
        let mut view = self.lock();
        *view = View::from_kvs(kvs, revision);
        let snapshot = view.snapshot(&self.replica_id);
        let _ = self.changes.send(Arc::new(snapshot));
        drop(view);
        self.ready.send_replace(true);
    }

    fn apply(&self, events: &[WatchEvent]) {
        let mut view = self.lock();
        for event in events {
            let revision = event.revision();
            let messages = match event {
                WatchEvent::Put(kv) => view.apply_put(kv),
                WatchEvent::Delete { key, .. } => view.apply_delete(key),
            };
            view.revision = view.revision.max(revision);
            for message in messages {
                let _ = self.changes.send(Arc::new(pb::SyncMessage {
                    version: revision as u64,
                    replica_id: self.replica_id.clone(),
                    message: Some(message),
                }));
            }
        }
    }

    /// Follows the store until `shutdown`: list, then apply the watch; on any watch failure
    /// list again (every router stream then receives a fresh snapshot).
    pub async fn run(self: Arc<Self>, store: Arc<dyn Store>, shutdown: CancellationToken) {
        let mut backoff = Duration::from_millis(100);
        while !shutdown.is_cancelled() {
            let listing = tokio::select! {
                () = shutdown.cancelled() => return,
                listing = store.list_and_watch(keys::STATE) => listing,
            };
            let mut listing = match listing {
                Ok(listing) => listing,
                Err(err) => {
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
            tracing::info!(
                revision = listing.revision,
                records = listing.kvs.len(),
                "loaded state"
            );
            self.replace(&listing.kvs, listing.revision);
            loop {
                let next = tokio::select! {
                    () = shutdown.cancelled() => return,
                    next = listing.watch.next() => next,
                };
                match next {
                    Some(Ok(events)) => self.apply(&events),
                    Some(Err(err)) => {
                        tracing::warn!(error = %err, "state watch failed; listing again");
                        break;
                    }
                    None => {
                        tracing::warn!("state watch ended; listing again");
                        break;
                    }
                }
            }
            tokio::select! {
                () = shutdown.cancelled() => return,
                () = tokio::time::sleep(Duration::from_millis(100)) => {}
            }
        }
    }
}
