//! The embedded single-node store: etcd's model (revisions, transactions, leases, watches)
//! in memory, persisted to `DIR/state.json` after every commit before the commit is
//! acknowledged (write to a temporary file, fsync, rename, fsync the directory), so a crash
//! never loses an acknowledged write and never leaves a half-written file.
//!
//! Leases are persisted with their TTL; after a restart each lease gets a fresh TTL, so an
//! instance that keeps heartbeating survives a control-plane restart.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::sync::broadcast;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::{Compare, Kv, LeaseId, Listing, Op, Revision, Store, StoreError, Txn, WatchEvent};

const STATE_FILE: &str = "state.json";
const WATCH_BUFFER: usize = 4096;
const REAPER_PERIOD: Duration = Duration::from_millis(100);

#[derive(Debug, Clone)]
struct Entry {
    value: Vec<u8>,
    mod_revision: Revision,
    lease: LeaseId,
}

#[derive(Debug)]
struct Lease {
    ttl: Duration,
    deadline: Instant,
}

#[derive(Debug, Default)]
struct Inner {
    revision: Revision,
    next_lease: LeaseId,
    entries: BTreeMap<String, Entry>,
    leases: HashMap<LeaseId, Lease>,
}

/// What `state.json` holds.
#[derive(Serialize, Deserialize)]
struct PersistedState {
    revision: Revision,
    next_lease: LeaseId,
    entries: Vec<PersistedEntry>,
    leases: Vec<PersistedLease>,
}

#[derive(Serialize, Deserialize)]
struct PersistedEntry {
    key: String,
    /// Values are UTF-8 (the control plane stores JSON).
    value: String,
    mod_revision: Revision,
    lease: LeaseId,
}

#[derive(Serialize, Deserialize)]
struct PersistedLease {
    id: LeaseId,
    ttl_seconds: u64,
}

#[derive(Debug)]
pub struct EmbeddedStore {
    inner: Mutex<Inner>,
    events: broadcast::Sender<Arc<Vec<WatchEvent>>>,
    dir: Option<PathBuf>,
}

impl EmbeddedStore {
    /// Opens (or creates) the store in `dir`; `None` keeps everything in memory (tests).
    /// Spawns the lease reaper, which stops when `shutdown` is cancelled.
    pub fn open(dir: Option<&Path>, shutdown: CancellationToken) -> Result<Arc<Self>, StoreError> {
        let mut inner = Inner {
            next_lease: 1,
            ..Inner::default()
        };
        if let Some(dir) = dir {
            std::fs::create_dir_all(dir).map_err(|err| {
                StoreError::Unavailable(format!("cannot create {}: {err}", dir.display()))
            })?;
            let path = dir.join(STATE_FILE);
            match std::fs::read(&path) {
                Ok(bytes) => inner = load(&bytes, &path)?,
                Err(err) if err.kind() == std::io::ErrorKind::NotFound => {}
                Err(err) => {
                    return Err(StoreError::Unavailable(format!(
                        "cannot read {}: {err}",
                        path.display()
                    )));
                }
            }
        }
        let (events, _) = broadcast::channel(WATCH_BUFFER);
        let store = Arc::new(Self {
            inner: Mutex::new(inner),
            events,
            dir: dir.map(Path::to_path_buf),
        });
        let reaper = Arc::downgrade(&store);
        tokio::spawn(async move {
            let mut ticks = tokio::time::interval(REAPER_PERIOD);
            loop {
                tokio::select! {
                    () = shutdown.cancelled() => return,
                    _ = ticks.tick() => {}
                }
                let Some(store) = reaper.upgrade() else {
                    return;
                };
                if let Err(err) = store.expire_leases().await {
                    tracing::warn!(error = %err, "embedded store could not expire leases");
                }
            }
        });
        Ok(store)
    }

    async fn expire_leases(self: &Arc<Self>) -> Result<(), StoreError> {
        let now = Instant::now();
        let expired: Vec<LeaseId> = {
            let inner = self.lock();
            inner
                .leases
                .iter()
                .filter(|(_, lease)| lease.deadline <= now)
                .map(|(id, _)| *id)
                .collect()
        };
        for lease in expired {
            tracing::debug!(lease, "embedded store lease lapsed");
            self.revoke_lease(lease).await?;
        }
        Ok(())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // A panic while holding the lock leaves consistent data (every mutation is applied
        // to a copy first), so a poisoned lock is safe to keep using.
        self.inner
            .lock()
            .unwrap_or_else(|poison| poison.into_inner())
    }

    /// Runs a mutation under the lock, persists the result, then publishes its events.
    /// The file write happens on a blocking thread so the runtime never stalls on fsync.
    async fn mutate<T: Send + 'static>(
        self: &Arc<Self>,
        mutation: impl FnOnce(&mut Inner) -> Result<(T, Vec<WatchEvent>), StoreError> + Send + 'static,
    ) -> Result<T, StoreError> {
        let store = Arc::clone(self);
        tokio::task::spawn_blocking(move || {
            let mut inner = store.lock();
            let (result, events) = mutation(&mut inner)?;
            if !events.is_empty() {
                if let Some(dir) = &store.dir {
                    persist(dir, &inner)?;
                }
                // No receivers is fine.
                let _ = store.events.send(Arc::new(events));
            }
            Ok(result)
        })
        .await
        .map_err(|err| StoreError::Unavailable(format!("store task failed: {err}")))?
    }
}

fn load(bytes: &[u8], path: &Path) -> Result<Inner, StoreError> {
    let state: PersistedState = serde_json::from_slice(bytes)
        .map_err(|err| StoreError::Corrupt(format!("{}: {err}", path.display())))?;
    let now = Instant::now();
    let leases = state
        .leases
        .into_iter()
        .map(|lease| {
            let ttl = Duration::from_secs(lease.ttl_seconds);
            (
                lease.id,
                Lease {
                    ttl,
                    deadline: now + ttl,
                },
            )
        })
        .collect();
    let entries = state
        .entries
        .into_iter()
        .map(|entry| {
            (
                entry.key,
                Entry {
                    value: entry.value.into_bytes(),
                    mod_revision: entry.mod_revision,
                    lease: entry.lease,
                },
            )
        })
        .collect();
    Ok(Inner {
        revision: state.revision,
        next_lease: state.next_lease,
        entries,
        leases,
    })
}

fn persist(dir: &Path, inner: &Inner) -> Result<(), StoreError> {
    let state = PersistedState {
        revision: inner.revision,
        next_lease: inner.next_lease,
        entries: inner
            .entries
            .iter()
            .map(|(key, entry)| {
                Ok(PersistedEntry {
                    key: key.clone(),
                    value: String::from_utf8(entry.value.clone())
                        .map_err(|_| StoreError::Corrupt(format!("value of {key} is not UTF-8")))?,
                    mod_revision: entry.mod_revision,
                    lease: entry.lease,
                })
            })
            .collect::<Result<_, StoreError>>()?,
        leases: inner
            .leases
            .iter()
            .map(|(id, lease)| PersistedLease {
                id: *id,
                ttl_seconds: lease.ttl.as_secs(),
            })
            .collect(),
    };
    let bytes = serde_json::to_vec(&state)
        .map_err(|err| StoreError::Corrupt(format!("cannot encode state: {err}")))?;
    write_atomically(dir, &bytes).map_err(|err| {
        StoreError::Unavailable(format!("cannot persist to {}: {err}", dir.display()))
    })
}

fn write_atomically(dir: &Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write as _;
    let temporary = dir.join(format!("{STATE_FILE}.tmp"));
    let mut file = std::fs::File::create(&temporary)?;
    file.write_all(bytes)?;
    file.sync_all()?;
    drop(file);
    std::fs::rename(&temporary, dir.join(STATE_FILE))?;
    std::fs::File::open(dir)?.sync_all()
}

fn compare_holds(inner: &Inner, compare: &Compare) -> bool {
    match compare {
        Compare::Absent(key) => !inner.entries.contains_key(key),
        Compare::ModRevision(key, revision) => inner
            .entries
            .get(key)
            .is_some_and(|entry| entry.mod_revision == *revision),
    }
}

fn kv(key: &str, entry: &Entry) -> Kv {
    Kv {
        key: key.to_owned(),
        value: entry.value.clone(),
        mod_revision: entry.mod_revision,
        lease: entry.lease,
    }
}

fn apply(inner: &mut Inner, txn: Txn) -> Result<(Option<Revision>, Vec<WatchEvent>), StoreError> {
    if !txn
        .compares
        .iter()
        .all(|compare| compare_holds(inner, compare))
    {
        return Ok((None, Vec::new()));
    }
    for op in &txn.ops {
        if let Op::Put { lease, .. } = op
            && *lease != 0
            && !inner.leases.contains_key(lease)
        {
            return Err(StoreError::LeaseNotFound(*lease));
        }
    }
    let revision = inner.revision + 1;
    let mut events = Vec::new();
    for op in txn.ops {
        match op {
            Op::Put { key, value, lease } => {
                let entry = Entry {
                    value,
                    mod_revision: revision,
                    lease,
                };
                events.push(WatchEvent::Put(kv(&key, &entry)));
                inner.entries.insert(key, entry);
            }
            Op::Delete { key } => {
                if inner.entries.remove(&key).is_some() {
                    events.push(WatchEvent::Delete { key, revision });
                }
            }
            Op::DeletePrefix { prefix } => {
                let keys: Vec<String> = inner
                    .entries
                    .range(prefix.clone()..)
                    .take_while(|(key, _)| key.starts_with(&prefix))
                    .map(|(key, _)| key.clone())
                    .collect();
                for key in keys {
                    inner.entries.remove(&key);
                    events.push(WatchEvent::Delete { key, revision });
                }
            }
        }
    }
    if !events.is_empty() {
        inner.revision = revision;
    }
    Ok((Some(inner.revision), events))
}

fn list_prefix(inner: &Inner, prefix: &str) -> Vec<Kv> {
    inner
        .entries
        .range(prefix.to_owned()..)
        .take_while(|(key, _)| key.starts_with(prefix))
        .map(|(key, entry)| kv(key, entry))
        .collect()
}

#[async_trait::async_trait]
impl Store for Arc<EmbeddedStore> {
    fn kind(&self) -> &'static str {
        "embedded"
    }

    async fn get(&self, key: &str) -> Result<Option<Kv>, StoreError> {
        Ok(self.lock().entries.get(key).map(|entry| kv(key, entry)))
    }

    async fn list(&self, prefix: &str) -> Result<Vec<Kv>, StoreError> {
        Ok(list_prefix(&self.lock(), prefix))
    }

    async fn commit(&self, txn: Txn) -> Result<Option<Revision>, StoreError> {
        self.mutate(move |inner| apply(inner, txn)).await
    }

    async fn grant_lease(&self, ttl_seconds: u32) -> Result<LeaseId, StoreError> {
        let ttl = Duration::from_secs(u64::from(ttl_seconds.max(1)));
        // A grant is persisted with the next commit that uses it; a lease nobody used is
        // worth nothing after a restart.
        let mut inner = self.lock();
        let id = inner.next_lease;
        inner.next_lease += 1;
        inner.leases.insert(
            id,
            Lease {
                ttl,
                deadline: Instant::now() + ttl,
            },
        );
        Ok(id)
    }

    async fn keep_alive(&self, lease: LeaseId) -> Result<bool, StoreError> {
        let mut inner = self.lock();
        let now = Instant::now();
        match inner.leases.get_mut(&lease) {
            Some(entry) if entry.deadline > now => {
                entry.deadline = now + entry.ttl;
                Ok(true)
            }
            _ => Ok(false),
        }
    }

    async fn revoke_lease(&self, lease: LeaseId) -> Result<(), StoreError> {
        self.mutate(move |inner| {
            if inner.leases.remove(&lease).is_none() {
                return Ok(((), Vec::new()));
            }
            let keys: Vec<String> = inner
                .entries
                .iter()
                .filter(|(_, entry)| entry.lease == lease)
                .map(|(key, _)| key.clone())
                .collect();
            let mut txn = Txn::new();
            for key in keys {
                txn = txn.delete(key);
            }
            let (_, events) = apply(inner, txn)?;
            Ok(((), events))
        })
        .await
    }

    async fn list_and_watch(&self, prefix: &str) -> Result<Listing, StoreError> {
        // Subscribing under the lock means no commit falls between the listing and the watch.
        let (kvs, revision, receiver) = {
            let inner = self.lock();
            (
                list_prefix(&inner, prefix),
                inner.revision,
                self.events.subscribe(),
            )
        };
        let prefix = prefix.to_owned();
        let watch = futures::stream::unfold(receiver, move |mut receiver| {
            let prefix = prefix.clone();
            async move {
                loop {
                    match receiver.recv().await {
                        Ok(batch) => {
                            let events: Vec<WatchEvent> = batch
                                .iter()
                                .filter(|event| event.key().starts_with(&prefix))
                                .cloned()
                                .collect();
                            if !events.is_empty() {
                                return Some((Ok(events), receiver));
                            }
                        }
                        Err(broadcast::error::RecvError::Lagged(missed)) => {
                            return Some((
                                Err(StoreError::WatchLost(format!(
                                    "consumer fell {missed} batches behind"
                                ))),
                                receiver,
                            ));
                        }
                        Err(broadcast::error::RecvError::Closed) => return None,
                    }
                }
            }
        });
        Ok(Listing {
            kvs,
            revision,
            watch: Box::pin(watch),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::contract;

    fn memory() -> Arc<EmbeddedStore> {
        EmbeddedStore::open(None, CancellationToken::new()).unwrap()
    }

    #[tokio::test]
    async fn contract_transactions() {
        contract::create_if_absent_and_compare_revision(&memory()).await;
    }

    #[tokio::test]
    async fn contract_watch() {
        contract::watch_follows_listing(&memory()).await;
    }

    #[tokio::test]
    async fn contract_leases() {
        contract::lapsed_lease_deletes_its_keys(&memory()).await;
    }

    #[tokio::test]
    async fn survives_a_restart() {
        let dir = tempfile::tempdir().unwrap();
        let shutdown = CancellationToken::new();
        let store = EmbeddedStore::open(Some(dir.path()), shutdown.clone()).unwrap();
        let lease = store.grant_lease(60).await.unwrap();
        store
            .commit(
                Txn::new()
                    .put("k", b"v".to_vec(), 0)
                    .put("leased", b"l".to_vec(), lease),
            )
            .await
            .unwrap();
        let revision = store.get("k").await.unwrap().unwrap().mod_revision;
        shutdown.cancel();
        drop(store);

        let store = EmbeddedStore::open(Some(dir.path()), CancellationToken::new()).unwrap();
        let kv = store.get("k").await.unwrap().unwrap();
        assert_eq!(kv.value, b"v");
        assert_eq!(kv.mod_revision, revision);
        assert!(store.keep_alive(lease).await.unwrap(), "lease survives");
        assert_eq!(store.get("leased").await.unwrap().unwrap().lease, lease);
        let next = store.grant_lease(5).await.unwrap();
        assert!(next > lease, "lease ids are not reused");
    }

    #[tokio::test]
    async fn corrupt_state_is_reported() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(STATE_FILE), b"{not json").unwrap();
        let err = EmbeddedStore::open(Some(dir.path()), CancellationToken::new()).unwrap_err();
        assert!(matches!(err, StoreError::Corrupt(_)), "{err}");
    }
}
