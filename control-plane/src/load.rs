//! Fleet-wide load: routers report their exact in-flight counts per instance several times a
//! second; each router gets back the sum of every *other* router's counts (it adds its own live
//! count, so its own part is never stale nor counted twice).
//!
//! Every interval the hub takes one snapshot: each router's last report and their sum. A
//! router's "others" is computed from that one snapshot (the total minus that router's share
//! *of the same snapshot*), so a report arriving between two ticks never makes a router count
//! its own finished work as someone else's.
//!
//! With several control-plane replicas on one etcd, each replica publishes the sum of its own
//! routers under `load/{replica}` (on a lease, so a dead replica's share disappears) and adds
//! the other replicas' sums to what it sends. Publishing runs in its own task, so a slow etcd
//! never delays the local sums. A router whose reports stop is dropped from the sums after
//! `router_timeout`; if the other replicas' sums cannot be followed, they are dropped too
//! rather than kept frozen.
//!
//! Key placements (PREFIX_AWARE with bounded loads: a router sent a key to an instance it had
//! not sent it to lately) are not summed: each router's are passed on at once to this
//! replica's other routers ([`LoadHub::announce`]). Routers on other replicas do not get them
//! (a hint: a router that misses one places a copy of its own).
//!
//! A report is trusted only so far: the sync stream keeps the figures of instances the control
//! plane knows (`StateCache::retain_known`), and each count is capped at
//! [`MAX_IN_FLIGHT_PER_ROUTER`], so one router token cannot steer the whole fleet's view.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use serde::{Deserialize, Serialize};
use switchyard_shared::sync::{InstanceLoad, KeyPlacement};
use switchyard_shared::{EndpointName, InstanceId, InstanceKey};
use tokio::sync::{broadcast, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::keys;
use crate::store::{Store, Txn, WatchEvent, WatchItem};

pub type Counts = HashMap<InstanceKey, u32>;

/// The most in-flight requests one router may claim on one instance (a router's
/// `--max-in-flight` is far below it; more is a broken or hostile report).
pub const MAX_IN_FLIGHT_PER_ROUTER: u32 = 100_000;

/// The most placements taken from one message of a router (more are dropped).
pub const MOST_PLACEMENTS_PER_MESSAGE: usize = 4096;
/// Announcements (messages) a slow stream may fall behind by before it skips some; with
/// [`MOST_PLACEMENTS_PER_MESSAGE`] this bounds what the hub holds for its slowest stream.
const ANNOUNCEMENTS_BUFFERED: usize = 128;

/// Key placements one router announced, for the others.
#[derive(Debug)]
pub struct Announced {
    pub router_id: String,
    pub placements: Vec<KeyPlacement>,
}

#[derive(Debug, Clone, Copy)]
pub struct LoadConfig {
    /// How often totals are recomputed and pushed to routers.
    pub interval: Duration,
    /// A router silent this long is dropped from the sums.
    pub router_timeout: Duration,
}

impl Default for LoadConfig {
    fn default() -> Self {
        Self {
            interval: Duration::from_millis(100),
            router_timeout: Duration::from_secs(3),
        }
    }
}

#[derive(Debug)]
struct RouterLoad {
    /// Which stream of this router reported (a router that reconnects gets a new one).
    connection: u64,
    counts: Counts,
    updated: Instant,
}

#[derive(Debug, Default)]
struct Inner {
    routers: HashMap<String, RouterLoad>,
    /// Sums published by other replicas.
    remote: HashMap<String, Counts>,
}

/// One consistent view: the fleet totals and each local router's share of them.
#[derive(Debug, Default, PartialEq)]
pub struct Snapshot {
    pub totals: Counts,
    pub per_router: HashMap<String, Counts>,
}

impl Snapshot {
    /// The totals minus `router_id`'s own share.
    pub fn others(&self, router_id: &str) -> Counts {
        let own = self.per_router.get(router_id);
        self.totals
            .iter()
            .filter_map(|(key, total)| {
                let mine = own.and_then(|own| own.get(key)).copied().unwrap_or(0);
                let others = total.saturating_sub(mine);
                (others > 0).then(|| (key.clone(), others))
            })
            .collect()
    }
}

#[derive(Debug)]
pub struct LoadHub {
    replica_id: String,
    config: LoadConfig,
    inner: Mutex<Inner>,
    snapshot: watch::Sender<Arc<Snapshot>>,
    /// The sum of this replica's routers, for the publisher.
    local: watch::Sender<Arc<Counts>>,
    connections: AtomicU64,
    announced: broadcast::Sender<Arc<Announced>>,
}

/// What a replica publishes under `load/{replica}`.
#[derive(Serialize, Deserialize)]
struct Published {
    loads: Vec<(String, String, u32)>,
}

fn add(sum: &mut Counts, counts: &Counts) {
    for (key, count) in counts {
        let entry = sum.entry(key.clone()).or_default();
        *entry = entry.saturating_add(*count);
    }
}

impl LoadHub {
    pub fn new(replica_id: String, config: LoadConfig) -> Arc<Self> {
        Arc::new(Self {
            replica_id,
            config,
            inner: Mutex::new(Inner::default()),
            snapshot: watch::Sender::new(Arc::new(Snapshot::default())),
            local: watch::Sender::new(Arc::new(Counts::new())),
            connections: AtomicU64::new(1),
            announced: broadcast::Sender::new(ANNOUNCEMENTS_BUFFERED),
        })
    }

    /// Passes `router_id`'s key placements (of instances the caller knows) on to every stream;
    /// each sends them to its router unless it is `router_id`.
    pub fn announce(&self, router_id: &str, mut placements: Vec<KeyPlacement>) {
        if placements.is_empty() {
            return;
        }
        placements.truncate(MOST_PLACEMENTS_PER_MESSAGE);
        // No stream listening is not an error.
        let _ = self.announced.send(Arc::new(Announced {
            router_id: router_id.to_owned(),
            placements,
        }));
    }

    /// Every router's announced placements from now on.
    pub fn announcements(&self) -> broadcast::Receiver<Arc<Announced>> {
        self.announced.subscribe()
    }

    pub fn config(&self) -> LoadConfig {
        self.config
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner
            .lock()
            .unwrap_or_else(|poison| poison.into_inner())
    }

    /// A new id for a router's stream.
    pub fn connection_id(&self) -> u64 {
        self.connections.fetch_add(1, Ordering::Relaxed)
    }

    /// Records a router's report (figures of known instances: the caller filters).
    pub fn report(&self, router_id: &str, connection: u64, loads: &[InstanceLoad]) {
        let counts = loads
            .iter()
            .filter(|load| load.in_flight > 0)
            .map(|load| {
                (
                    load.key.clone(),
                    load.in_flight.min(MAX_IN_FLIGHT_PER_ROUTER),
                )
            })
            .collect();
        self.lock().routers.insert(
            router_id.to_owned(),
            RouterLoad {
                connection,
                counts,
                updated: Instant::now(),
            },
        );
    }

    /// Forgets a router's load when its stream ends, unless a newer stream of the same router
    /// has reported since.
    pub fn remove_router(&self, router_id: &str, connection: u64) {
        let mut inner = self.lock();
        if inner
            .routers
            .get(router_id)
            .is_some_and(|router| router.connection == connection)
        {
            inner.routers.remove(router_id);
        }
    }

    /// The latest snapshot, refreshed every interval.
    pub fn snapshots(&self) -> watch::Receiver<Arc<Snapshot>> {
        self.snapshot.subscribe()
    }

    /// Drops silent routers, then takes a snapshot and publishes it (and the local sum).
    fn recompute(&self, now: Instant) {
        let snapshot = {
            let mut inner = self.lock();
            let timeout = self.config.router_timeout;
            inner.routers.retain(|router_id, router| {
                let fresh = now.duration_since(router.updated) < timeout;
                if !fresh {
                    tracing::info!(router = %router_id, "router stopped reporting load; dropping it from the sums");
                }
                fresh
            });
            let mut local = Counts::new();
            let per_router: HashMap<String, Counts> = inner
                .routers
                .iter()
                .map(|(router_id, router)| {
                    add(&mut local, &router.counts);
                    (router_id.clone(), router.counts.clone())
                })
                .collect();
            let mut totals = local.clone();
            for counts in inner.remote.values() {
                add(&mut totals, counts);
            }
            if **self.local.borrow() != local {
                self.local.send_replace(Arc::new(local));
            }
            Snapshot { totals, per_router }
        };
        if **self.snapshot.borrow() != snapshot {
            self.snapshot.send_replace(Arc::new(snapshot));
        }
    }

    /// Recomputes the snapshot every interval until `shutdown`.
    pub async fn run(self: Arc<Self>, shutdown: CancellationToken) {
        let mut ticks = tokio::time::interval(self.config.interval);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                () = shutdown.cancelled() => return,
                _ = ticks.tick() => self.recompute(Instant::now()),
            }
        }
    }

    /// Publishes this replica's sum under `load/{replica}` for the other replicas, whenever it
    /// changes, on a lease renewed every second, until `shutdown`.
    pub async fn publish(self: Arc<Self>, store: Arc<dyn Store>, shutdown: CancellationToken) {
        let mut local = self.local.subscribe();
        let mut published: Option<Arc<Counts>> = None;
        let mut lease: i64 = 0;
        let mut renewals = tokio::time::interval(Duration::from_secs(1));
        renewals.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                () = shutdown.cancelled() => break,
                changed = local.changed() => if changed.is_err() { break },
                _ = renewals.tick() => {
                    if lease != 0 && !matches!(store.keep_alive(lease).await, Ok(true)) {
                        lease = 0;
                        published = None;
                    }
                }
            }
            let current = Arc::clone(&local.borrow_and_update());
            if published.as_ref() == Some(&current) {
                continue;
            }
            if lease == 0 {
                match store.grant_lease(3).await {
                    Ok(granted) => lease = granted,
                    Err(err) => {
                        tracing::debug!(error = %err, "cannot publish load");
                        continue;
                    }
                }
            }
            let value = Published {
                loads: current
                    .iter()
                    .map(|(key, count)| (key.endpoint.to_string(), key.id.to_string(), *count))
                    .collect(),
            };
            let bytes = serde_json::to_vec(&value).unwrap_or_default();
            match store
                .commit(Txn::new().put(keys::load(&self.replica_id), bytes, lease))
                .await
            {
                Ok(_) => published = Some(current),
                Err(err) => {
                    tracing::debug!(error = %err, "cannot publish load");
                    lease = 0;
                }
            }
        }
        if lease != 0 {
            let _ = store.revoke_lease(lease).await;
        }
    }

    /// Follows the sums other replicas publish, until `shutdown`.
    pub async fn follow_remote(
        self: Arc<Self>,
        store: Arc<dyn Store>,
        shutdown: CancellationToken,
    ) {
        while !shutdown.is_cancelled() {
            let listing = tokio::select! {
                () = shutdown.cancelled() => return,
                listing = store.list_and_watch(keys::LOAD) => listing,
            };
            match listing {
                Ok(mut listing) => {
                    {
                        let mut inner = self.lock();
                        inner.remote.clear();
                        for kv in &listing.kvs {
                            self.absorb(&mut inner, &kv.key, Some(&kv.value));
                        }
                    }
                    loop {
                        let next = tokio::select! {
                            () = shutdown.cancelled() => return,
                            next = listing.watch.next() => next,
                        };
                        let events = match next {
                            Some(Ok(WatchItem::Events(events))) => events,
                            Some(Ok(WatchItem::Progress(_))) => continue,
                            _ => break,
                        };
                        let mut inner = self.lock();
                        for event in events {
                            match &event {
                                WatchEvent::Put(kv) => {
                                    self.absorb(&mut inner, &kv.key, Some(&kv.value))
                                }
                                WatchEvent::Delete { key, .. } => {
                                    self.absorb(&mut inner, key, None)
                                }
                            }
                        }
                    }
                }
                Err(err) => tracing::debug!(error = %err, "cannot follow other replicas' load"),
            }
            // Sums that cannot be followed are not kept frozen.
            self.lock().remote.clear();
            tokio::select! {
                () = shutdown.cancelled() => return,
                () = tokio::time::sleep(Duration::from_millis(500)) => {}
            }
        }
    }

    fn absorb(&self, inner: &mut Inner, key: &str, value: Option<&[u8]>) {
        let Some(replica) = key.strip_prefix(keys::LOAD) else {
            return;
        };
        if replica == self.replica_id {
            return;
        }
        match value.and_then(|value| serde_json::from_slice::<Published>(value).ok()) {
            Some(published) => {
                let counts = published
                    .loads
                    .into_iter()
                    .filter_map(|(endpoint, id, count)| {
                        let key = InstanceKey::new(
                            EndpointName::new(&endpoint).ok()?,
                            InstanceId::new(&id).ok()?,
                        );
                        Some((key, count))
                    })
                    .collect();
                inner.remote.insert(replica.to_owned(), counts);
            }
            None => {
                inner.remote.remove(replica);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key_of(endpoint: &str, id: &str) -> InstanceKey {
        InstanceKey::new(
            EndpointName::new(endpoint).unwrap(),
            InstanceId::new(id).unwrap(),
        )
    }

    #[test]
    fn placements_go_to_every_stream_bounded_per_message() {
        let hub = LoadHub::new("r".into(), LoadConfig::default());
        let mut stream = hub.announcements();
        hub.announce("router-1", Vec::new());
        let many: Vec<KeyPlacement> = (0..MOST_PLACEMENTS_PER_MESSAGE as u64 + 10)
            .map(|key| KeyPlacement {
                instance: key_of("chat", "i-1"),
                key,
                further: key % 2 == 1,
            })
            .collect();
        hub.announce("router-1", many);
        let announced = stream.try_recv().expect("one announcement");
        assert_eq!(announced.router_id, "router-1");
        assert_eq!(announced.placements.len(), MOST_PLACEMENTS_PER_MESSAGE);
        assert!(stream.try_recv().is_err(), "nothing for an empty list");
        // A stream that falls behind skips what it missed, and goes on.
        for key in 0..ANNOUNCEMENTS_BUFFERED as u64 + 1 {
            let placement = KeyPlacement {
                instance: key_of("chat", "i-1"),
                key,
                further: false,
            };
            hub.announce("router-2", vec![placement]);
        }
        assert!(matches!(
            stream.try_recv(),
            Err(broadcast::error::TryRecvError::Lagged(1))
        ));
        assert_eq!(stream.try_recv().expect("the rest").placements[0].key, 1);
    }

    fn load(endpoint: &str, id: &str, in_flight: u32) -> InstanceLoad {
        InstanceLoad {
            key: key_of(endpoint, id),
            in_flight,
        }
    }

    fn key(id: &str) -> InstanceKey {
        key_of("e", id)
    }

    #[tokio::test]
    async fn a_count_beyond_reason_is_capped() {
        let hub = LoadHub::new("r".into(), LoadConfig::default());
        hub.report("a", 1, &[load("e", "i1", u32::MAX)]);
        hub.recompute(Instant::now());
        assert_eq!(
            hub.snapshots().borrow().totals[&key("i1")],
            MAX_IN_FLIGHT_PER_ROUTER
        );
    }

    #[tokio::test]
    async fn each_router_sees_the_others() {
        let hub = LoadHub::new("r".into(), LoadConfig::default());
        hub.report("a", 1, &[load("e", "i1", 3), load("e", "i2", 1)]);
        hub.report("b", 2, &[load("e", "i1", 2)]);
        hub.recompute(Instant::now());
        let snapshot = hub.snapshots().borrow().clone();
        assert_eq!(snapshot.totals[&key("i1")], 5);
        let for_a = snapshot.others("a");
        assert_eq!(for_a.get(&key("i1")), Some(&2));
        assert_eq!(for_a.get(&key("i2")), None);
        let for_b = snapshot.others("b");
        assert_eq!(for_b[&key("i1")], 3);
        assert_eq!(for_b[&key("i2")], 1);
    }

    #[tokio::test]
    async fn a_report_between_ticks_is_not_counted_as_someone_else() {
        let hub = LoadHub::new("r".into(), LoadConfig::default());
        hub.report("a", 1, &[load("e", "i1", 10)]);
        hub.report("b", 2, &[load("e", "i2", 2)]);
        hub.recompute(Instant::now());
        // Router a's requests finish and it reports 0 before the next tick. What a stream
        // sends router a now is read from the published snapshot (as `sync` reads it): it
        // must hold b's 2 and nothing of a's own 10, before the tick and after it.
        hub.report("a", 1, &[]);
        let others = hub.snapshots().borrow().others("a");
        assert_eq!(others, Counts::from([(key("i2"), 2)]), "before the tick");
        hub.recompute(Instant::now());
        let others = hub.snapshots().borrow().others("a");
        assert_eq!(others, Counts::from([(key("i2"), 2)]), "after the tick");
    }

    #[tokio::test]
    async fn a_stale_stream_does_not_remove_a_newer_one() {
        let hub = LoadHub::new("r".into(), LoadConfig::default());
        hub.report("a", 1, &[load("e", "i1", 1)]);
        hub.report("a", 2, &[load("e", "i1", 4)]);
        hub.remove_router("a", 1);
        hub.recompute(Instant::now());
        assert_eq!(hub.snapshots().borrow().totals[&key("i1")], 4);
        hub.remove_router("a", 2);
        hub.recompute(Instant::now());
        assert!(hub.snapshots().borrow().totals.is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn silent_routers_are_dropped() {
        let hub = LoadHub::new("r".into(), LoadConfig::default());
        hub.report("a", 1, &[load("e", "i1", 3)]);
        tokio::time::advance(Duration::from_secs(4)).await;
        hub.report("b", 2, &[load("e", "i1", 1)]);
        hub.recompute(Instant::now());
        assert_eq!(hub.snapshots().borrow().totals[&key("i1")], 1);
    }

    #[tokio::test]
    async fn remote_replicas_are_added() {
        let hub = LoadHub::new("r1".into(), LoadConfig::default());
        {
            let mut inner = hub.lock();
            let value = serde_json::to_vec(&Published {
                loads: vec![("e".into(), "i1".into(), 4)],
            })
            .unwrap();
            hub.absorb(&mut inner, "load/r2", Some(&value));
            hub.absorb(&mut inner, "load/r1", Some(&value));
        }
        hub.report("a", 1, &[load("e", "i1", 1)]);
        hub.recompute(Instant::now());
        let snapshot = hub.snapshots().borrow().clone();
        assert_eq!(
            snapshot.totals[&key("i1")],
            5,
            "own replica not counted twice"
        );
        assert_eq!(snapshot.others("a")[&key("i1")], 4);
        assert_eq!(**hub.local.borrow(), Counts::from([(key("i1"), 1)]));
    }
}
