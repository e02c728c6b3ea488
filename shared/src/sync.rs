//! What travels on the `RouterSync` stream, as domain types: pieces of routing state (a
//! snapshot in parts, or a batch of changes), their version, and per-instance load figures.
//! `pb.rs` converts them to and from the wire; the control plane produces them, routers apply
//! them.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::sync::Arc;

use crate::endpoint::{Endpoint, EndpointConfig};
use crate::instance::Instance;
use crate::names::{EndpointConfigName, EndpointName, InstanceId};

/// The highest `RouterSync` protocol this build speaks. 1: one whole `Snapshot` message and one
/// message per change (every build). 2: `StateUpdate` pieces and batches.
pub const SYNC_PROTOCOL: u32 = 2;

/// The largest sync message a router accepts. Control planes speaking protocol 2 send pieces
/// of about [`SYNC_PIECE_BYTES`]; the margin is for protocol-1 control planes, which send the
/// whole state in one message.
pub const SYNC_MAX_MESSAGE_BYTES: usize = 64 * 1024 * 1024;

/// The size a control plane aims at for one `StateUpdate` (a piece is cut once it passes this,
/// so a piece holds at most this plus one record; records are bounded by validation).
pub const SYNC_PIECE_BYTES: usize = 1024 * 1024;

/// The largest message a control plane accepts from a router (a load report names at most the
/// instances the router has requests in flight on).
pub const ROUTER_MAX_MESSAGE_BYTES: usize = 8 * 1024 * 1024;

/// An instance within its endpoint: how routers and the control plane key load and membership.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct InstanceKey {
    pub endpoint: EndpointName,
    pub id: InstanceId,
}

impl InstanceKey {
    pub fn new(endpoint: EndpointName, id: InstanceId) -> Self {
        Self { endpoint, id }
    }

    pub fn of(instance: &Instance) -> Self {
        Self::new(instance.endpoint_name.clone(), instance.instance_id.clone())
    }
}

impl fmt::Display for InstanceKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.endpoint, self.id)
    }
}

/// In-flight requests on one instance.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InstanceLoad {
    pub key: InstanceKey,
    pub in_flight: u32,
}

/// A PREFIX_AWARE key a router placed on an instance (bounded loads), announced to the others.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyPlacement {
    pub instance: InstanceKey,
    pub key: u64,
    /// Another instance of the variant held the key when it was placed here.
    pub further: bool,
}

/// Where a routing state comes from and how far it goes: `cluster` is the identity of the store
/// (made when it was first used; empty from control planes before it existed), `revision` the
/// store revision. Within one cluster revisions only grow.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct StateVersion {
    pub cluster: String,
    pub revision: u64,
}

impl fmt::Display for StateVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.cluster.is_empty() {
            write!(f, "revision {}", self.revision)
        } else {
            write!(f, "revision {} of cluster {}", self.revision, self.cluster)
        }
    }
}

/// A piece of routing state. Applied in this order: `removed_endpoints` (each with all its
/// instances), `configs`, `removed_configs`, `endpoints`, `instances`, `removed_instances`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StateUpdate {
    /// Starts a snapshot: the pieces up to the one with `complete` replace everything held.
    pub reset: bool,
    /// The receiver may swap its routing table in now.
    pub complete: bool,
    pub configs: Vec<Arc<EndpointConfig>>,
    pub removed_configs: Vec<EndpointConfigName>,
    pub endpoints: Vec<Arc<Endpoint>>,
    pub removed_endpoints: Vec<EndpointName>,
    pub instances: Vec<Arc<Instance>>,
    pub removed_instances: Vec<InstanceKey>,
}

impl StateUpdate {
    pub fn is_empty(&self) -> bool {
        self.configs.is_empty()
            && self.removed_configs.is_empty()
            && self.endpoints.is_empty()
            && self.removed_endpoints.is_empty()
            && self.instances.is_empty()
            && self.removed_instances.is_empty()
    }

    /// Records in it, for logs and batch bounds.
    pub fn len(&self) -> usize {
        self.configs.len()
            + self.removed_configs.len()
            + self.endpoints.len()
            + self.removed_endpoints.len()
            + self.instances.len()
            + self.removed_instances.len()
    }
}

/// One change to the routing state, in store order.
#[derive(Debug, Clone, PartialEq)]
pub enum StateChange {
    Config(Arc<EndpointConfig>),
    ConfigRemoved(EndpointConfigName),
    Endpoint(Arc<Endpoint>),
    /// The endpoint and every instance of it.
    EndpointRemoved(EndpointName),
    Instance(Arc<Instance>),
    InstanceRemoved(InstanceKey),
}

/// Folds changes, in order, into one [`StateUpdate`] with the same effect: the last change of
/// a record wins, and an endpoint removal drops what came before it for that endpoint's
/// instances (it removes them all anyway).
#[derive(Debug, Default)]
pub struct Coalescer {
    configs: BTreeMap<EndpointConfigName, Option<Arc<EndpointConfig>>>,
    endpoints: BTreeMap<EndpointName, Option<Arc<Endpoint>>>,
    reset_endpoints: BTreeSet<EndpointName>,
    instances: BTreeMap<InstanceKey, Option<Arc<Instance>>>,
    changes: usize,
}

impl Coalescer {
    pub fn push(&mut self, change: &StateChange) {
        self.changes += 1;
        match change {
            StateChange::Config(config) => {
                self.configs.insert(
                    config.endpoint_config_name.clone(),
                    Some(Arc::clone(config)),
                );
            }
            StateChange::ConfigRemoved(name) => {
                self.configs.insert(name.clone(), None);
            }
            StateChange::Endpoint(endpoint) => {
                self.endpoints
                    .insert(endpoint.endpoint_name.clone(), Some(Arc::clone(endpoint)));
            }
            StateChange::EndpointRemoved(name) => {
                self.endpoints.insert(name.clone(), None);
                self.reset_endpoints.insert(name.clone());
                let first = InstanceKey::new(name.clone(), instance_id_floor());
                let doomed: Vec<InstanceKey> = self
                    .instances
                    .range(first..)
                    .take_while(|(key, _)| key.endpoint == *name)
                    .map(|(key, _)| key.clone())
                    .collect();
                for key in doomed {
                    self.instances.remove(&key);
                }
            }
            StateChange::Instance(instance) => {
                self.instances
                    .insert(InstanceKey::of(instance), Some(Arc::clone(instance)));
            }
            StateChange::InstanceRemoved(key) => {
                self.instances.insert(key.clone(), None);
            }
        }
    }

    /// Changes pushed since the last `take`.
    pub fn changes(&self) -> usize {
        self.changes
    }

    pub fn is_empty(&self) -> bool {
        self.changes == 0
    }

    /// The update with the effect of everything pushed (marked complete), and a fresh start.
    pub fn take(&mut self) -> StateUpdate {
        let taken = std::mem::take(self);
        let mut update = StateUpdate {
            complete: true,
            removed_endpoints: taken.reset_endpoints.into_iter().collect(),
            ..StateUpdate::default()
        };
        for (name, config) in taken.configs {
            match config {
                Some(config) => update.configs.push(config),
                None => update.removed_configs.push(name),
            }
        }
        update.endpoints = taken.endpoints.into_values().flatten().collect();
        for (key, instance) in taken.instances {
            match instance {
                Some(instance) => update.instances.push(instance),
                None => update.removed_instances.push(key),
            }
        }
        update
    }
}

/// The smallest valid instance id in `Ord` ("0" sorts before every other valid id: ids start
/// with a letter or digit).
fn instance_id_floor() -> InstanceId {
    InstanceId::new("0").expect("\"0\" is a valid instance id")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::endpoint::EndpointStatus;

    use crate::names::VariantName;

    fn instance(endpoint: &str, id: &str, url: &str) -> Arc<Instance> {
        Arc::new(Instance::new(
            InstanceId::new(id).unwrap(),
            EndpointName::new(endpoint).unwrap(),
            VariantName::new("v").unwrap(),
            url.into(),
        ))
    }

    fn endpoint(name: &str) -> Arc<Endpoint> {
        Arc::new(Endpoint {
            endpoint_name: EndpointName::new(name).unwrap(),
            endpoint_config_name: EndpointConfigName::new("cfg").unwrap(),
            endpoint_status: EndpointStatus::InService,
            creation_time_ms: 0,
            last_modified_time_ms: 0,
            failure_reason: String::new(),
        })
    }

    fn key(endpoint: &str, id: &str) -> InstanceKey {
        InstanceKey::new(
            EndpointName::new(endpoint).unwrap(),
            InstanceId::new(id).unwrap(),
        )
    }

    #[test]
    fn the_last_change_of_a_record_wins_in_either_order() {
        let mut coalescer = Coalescer::default();
        coalescer.push(&StateChange::InstanceRemoved(key("e", "a")));
        coalescer.push(&StateChange::Instance(instance("e", "a", "http://x:1")));
        coalescer.push(&StateChange::Instance(instance("e", "b", "http://x:2")));
        coalescer.push(&StateChange::InstanceRemoved(key("e", "b")));
        assert_eq!(coalescer.changes(), 4);
        let update = coalescer.take();
        assert!(update.complete && !update.reset);
        assert_eq!(update.instances, vec![instance("e", "a", "http://x:1")]);
        assert_eq!(update.removed_instances, vec![key("e", "b")]);
        assert!(coalescer.is_empty());
    }

    #[test]
    fn an_endpoint_removal_supersedes_its_earlier_instance_changes() {
        let mut coalescer = Coalescer::default();
        coalescer.push(&StateChange::Instance(instance("e", "old", "http://x:1")));
        coalescer.push(&StateChange::Instance(instance("f", "kept", "http://x:2")));
        coalescer.push(&StateChange::EndpointRemoved(
            EndpointName::new("e").unwrap(),
        ));
        // Recreated, with a new instance.
        coalescer.push(&StateChange::Endpoint(endpoint("e")));
        coalescer.push(&StateChange::Instance(instance("e", "new", "http://x:3")));
        let update = coalescer.take();
        assert_eq!(
            update.removed_endpoints,
            vec![EndpointName::new("e").unwrap()]
        );
        assert_eq!(update.endpoints, vec![endpoint("e")]);
        let ids: Vec<&str> = update
            .instances
            .iter()
            .map(|instance| instance.instance_id.as_str())
            .collect();
        assert_eq!(ids, ["new", "kept"]);
    }
}
