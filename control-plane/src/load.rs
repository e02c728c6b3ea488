//! Fleet-wide load: routers report their exact in-flight counts per instance several times a
//! second; each router gets back the sum of every *other* router's counts (it adds its own live
//! count, so its own part is never stale nor counted twice).
//!
//! With several control-plane replicas on one etcd, each replica publishes the sum of its own
//! routers under `load/{replica}` (on a lease, so a dead replica's share disappears) and adds
//! the other replicas' sums to what it sends. A router whose reports stop is dropped from the
//! sums after `router_timeout`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use serde::{Deserialize, Serialize};
use switchyard_proto::v1 as pb;
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::keys;
use crate::store::{Store, Txn, WatchEvent};

/// (endpoint, instance id).
pub type InstanceKey = (String, String);
pub type Counts = HashMap<InstanceKey, u32>;

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
    counts: Counts,
    updated: Instant,
}

#[derive(Debug, Default)]
struct Inner {
    routers: HashMap<String, RouterLoad>,
    /// Sums published by other replicas.
    remote: HashMap<String, Counts>,
}

#[derive(Debug)]
pub struct LoadHub {
    replica_id: String,
    config: LoadConfig,
    inner: Mutex<Inner>,
    totals: watch::Sender<Arc<Counts>>,
}

/// What a replica publishes under `load/{replica}`.
#[derive(Serialize, Deserialize)]
struct Published {
    loads: Vec<(String, String, u32)>,
}

impl LoadHub {
    pub fn new(replica_id: String, config: LoadConfig) -> Arc<Self> {
        Arc::new(Self {
            replica_id,
            config,
            inner: Mutex::new(Inner::default()),
            totals: watch::Sender::new(Arc::new(Counts::new())),
        })
    }

    pub fn config(&self) -> LoadConfig {
        self.config
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner
            .lock()
            .unwrap_or_else(|poison| poison.into_inner())
    }

    pub fn report(&self, router_id: &str, loads: &[pb::InstanceLoad]) {
        let counts = loads
            .iter()
            .filter(|load| load.in_flight > 0)
            .map(|load| {
                (
                    (load.endpoint_name.clone(), load.instance_id.clone()),
                    load.in_flight,
                )
            })
            .collect();
        self.lock().routers.insert(
            router_id.to_owned(),
            RouterLoad {
                counts,
                updated: Instant::now(),
            },
        );
    }

    pub fn remove_router(&self, router_id: &str) {
        self.lock().routers.remove(router_id);
    }

    /// Fleet totals, refreshed every interval.
    pub fn totals(&self) -> watch::Receiver<Arc<Counts>> {
        self.totals.subscribe()
    }

    /// The totals minus this router's own last report.
    pub fn others(&self, router_id: &str, totals: &Counts) -> Counts {
        let inner = self.lock();
        let own = inner.routers.get(router_id).map(|router| &router.counts);
        totals
            .iter()
            .filter_map(|(key, total)| {
                let mine = own.and_then(|own| own.get(key)).copied().unwrap_or(0);
                let others = total.saturating_sub(mine);
                (others > 0).then(|| (key.clone(), others))
            })
            .collect()
    }

    fn local_sum(&self, now: Instant) -> Counts {
        let mut inner = self.lock();
        let timeout = self.config.router_timeout;
        inner.routers.retain(|router_id, router| {
            let fresh = now.duration_since(router.updated) < timeout;
            if !fresh {
                tracing::info!(router = %router_id, "router stopped reporting load; dropping it from the sums");
            }
            fresh
        });
        let mut sum = Counts::new();
        for router in inner.routers.values() {
            for (key, count) in &router.counts {
                *sum.entry(key.clone()).or_default() += count;
            }
        }
        sum
    }

    fn recompute(&self, local: &Counts) {
        let mut totals = local.clone();
        for counts in self.lock().remote.values() {
            for (key, count) in counts {
                *totals.entry(key.clone()).or_default() += count;
            }
        }
        if **self.totals.borrow() != totals {
            self.totals.send_replace(Arc::new(totals));
        }
    }

    /// Recomputes totals every interval until `shutdown`. When `share` is set (etcd: other
    /// replicas may exist) the local sum is published for them (see `follow_remote`).
    pub async fn run(
        self: Arc<Self>,
        store: Arc<dyn Store>,
        share: bool,
        shutdown: CancellationToken,
    ) {
        let mut ticks = tokio::time::interval(self.config.interval);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut published: Option<Counts> = None;
        let mut lease: i64 = 0;
        let mut last_keep_alive = Instant::now();
        loop {
            tokio::select! {
                () = shutdown.cancelled() => break,
                _ = ticks.tick() => {}
            }
            let now = Instant::now();
            let local = self.local_sum(now);
            self.recompute(&local);
            if !share {
                continue;
            }
            if lease != 0 && now.duration_since(last_keep_alive) >= Duration::from_secs(1) {
                last_keep_alive = now;
                if !matches!(store.keep_alive(lease).await, Ok(true)) {
                    lease = 0;
                    published = None;
                }
            }
            if published.as_ref() == Some(&local) {
                continue;
            }
            if lease == 0 {
                match store.grant_lease(3).await {
                    Ok(granted) => {
                        lease = granted;
                        last_keep_alive = now;
                    }
                    Err(err) => {
                        tracing::debug!(error = %err, "cannot publish load");
                        continue;
                    }
                }
            }
            let value = Published {
                loads: local
                    .iter()
                    .map(|((endpoint, id), count)| (endpoint.clone(), id.clone(), *count))
                    .collect(),
            };
            let bytes = serde_json::to_vec(&value).unwrap_or_default();
            match store
                .commit(Txn::new().put(keys::load(&self.replica_id), bytes, lease))
                .await
            {
                Ok(_) => published = Some(local),
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
                        let Some(Ok(events)) = next else { break };
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
                    .map(|(endpoint, id, count)| ((endpoint, id), count))
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

    fn load(endpoint: &str, id: &str, in_flight: u32) -> pb::InstanceLoad {
        pb::InstanceLoad {
            endpoint_name: endpoint.into(),
            instance_id: id.into(),
            in_flight,
        }
    }

    #[tokio::test]
    async fn each_router_sees_the_others() {
        let hub = LoadHub::new("r".into(), LoadConfig::default());
        hub.report("a", &[load("e", "i1", 3), load("e", "i2", 1)]);
        hub.report("b", &[load("e", "i1", 2)]);
        let local = hub.local_sum(Instant::now());
        hub.recompute(&local);
        let totals = hub.totals().borrow().clone();
        assert_eq!(totals[&("e".into(), "i1".into())], 5);
        let for_a = hub.others("a", &totals);
        assert_eq!(for_a.get(&("e".into(), "i1".into())), Some(&2));
        assert_eq!(for_a.get(&("e".into(), "i2".into())), None);
        let for_b = hub.others("b", &totals);
        assert_eq!(for_b[&("e".into(), "i1".into())], 3);
        assert_eq!(for_b[&("e".into(), "i2".into())], 1);
    }

    #[tokio::test(start_paused = true)]
    async fn silent_routers_are_dropped() {
        let hub = LoadHub::new("r".into(), LoadConfig::default());
        hub.report("a", &[load("e", "i1", 3)]);
        tokio::time::advance(Duration::from_secs(4)).await;
        hub.report("b", &[load("e", "i1", 1)]);
        let local = hub.local_sum(Instant::now());
        assert_eq!(local[&("e".into(), "i1".into())], 1);
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
        hub.report("a", &[load("e", "i1", 1)]);
        let local = hub.local_sum(Instant::now());
        hub.recompute(&local);
        let totals = hub.totals().borrow().clone();
        assert_eq!(
            totals[&("e".into(), "i1".into())],
            5,
            "own replica not counted twice"
        );
        assert_eq!(hub.others("a", &totals)[&("e".into(), "i1".into())], 4);
    }
}
