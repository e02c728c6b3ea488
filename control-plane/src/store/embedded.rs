//! The embedded single-node store: etcd's model (revisions, transactions, leases, watches)
//! in memory, persisted to `DIR/state.json` after every commit before the commit is
//! acknowledged (write to a temporary file, fsync, rename, fsync the directory), so a crash
//! never loses an acknowledged write and never leaves a half-written file.
//!
//! Commits are copy-on-write: a commit applies to a copy of the data, persists the copy, and
//! only then swaps it in and publishes its events. A failed write (disk full) changes
//! nothing. Readers take the current version without waiting for a commit's fsync.
//!
//! Leases are persisted with their TTL; after a restart each lease gets a fresh TTL, so an
//! instance that keeps heartbeating survives a control-plane restart.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
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

/// One version of the keys.
#[derive(Debug, Clone, Default)]
struct Data {
    revision: Revision,
    entries: BTreeMap<String, Entry>,
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
    /// The current version; swapped whole by commits.
    data: Mutex<Arc<Data>>,
    /// Serialises commits (held on a blocking thread only, across the fsync).
    writer: Mutex<()>,
    leases: Mutex<HashMap<LeaseId, Lease>>,
    next_lease: AtomicI64,
    events: broadcast::Sender<Arc<Vec<WatchEvent>>>,
    dir: Option<PathBuf>,
}

/// A poisoned lock is safe to keep using here: every guarded value is replaced whole or
/// updated in one step, so a panic cannot leave it half-changed.
fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|poison| poison.into_inner())
}

impl EmbeddedStore {
    /// Opens (or creates) the store in `dir`; `None` keeps everything in memory (tests).
    /// Spawns the lease reaper, which stops when `shutdown` is cancelled.
    pub fn open(dir: Option<&Path>, shutdown: CancellationToken) -> Result<Arc<Self>, StoreError> {
        let mut data = Data::default();
        let mut leases = HashMap::new();
        let mut next_lease = 1;
        if let Some(dir) = dir {
            std::fs::create_dir_all(dir).map_err(|err| {
                StoreError::Unavailable(format!("cannot create {}: {err}", dir.display()))
            })?;
            let path = dir.join(STATE_FILE);
            match std::fs::read(&path) {
                Ok(bytes) => (data, leases, next_lease) = load(&bytes, &path)?,
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
            data: Mutex::new(Arc::new(data)),
            writer: Mutex::new(()),
            leases: Mutex::new(leases),
            next_lease: AtomicI64::new(next_lease),
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
        let expired: Vec<LeaseId> = lock(&self.leases)
            .iter()
            .filter(|(_, lease)| lease.deadline <= now)
            .map(|(id, _)| *id)
            .collect();
        for lease in expired {
            tracing::debug!(lease, "embedded store lease lapsed");
            self.revoke_lease(lease).await?;
        }
        Ok(())
    }

    fn current(&self) -> Arc<Data> {
        Arc::clone(&lock(&self.data))
    }

    /// Applies a mutation to a copy of the data, persists the copy, then swaps it in and
    /// publishes its events. Runs on a blocking thread so the runtime never waits on fsync.
    async fn mutate<T: Send + 'static>(
        self: &Arc<Self>,
        mutation: impl FnOnce(
            &mut Data,
            &HashMap<LeaseId, Lease>,
        ) -> Result<(T, Vec<WatchEvent>), StoreError>
        + Send
        + 'static,
    ) -> Result<T, StoreError> {
        let store = Arc::clone(self);
        tokio::task::spawn_blocking(move || {
            let _writer = lock(&store.writer);
            let mut next = (*store.current()).clone();
            let (result, events) = {
                let leases = lock(&store.leases);
                mutation(&mut next, &leases)?
            };
            if events.is_empty() {
                return Ok(result);
            }
            if let Some(dir) = &store.dir {
                persist(
                    dir,
                    &next,
                    &store.leases,
                    store.next_lease.load(Ordering::SeqCst),
                )?;
            }
            // Swap and publish under the data lock, so `list_and_watch` sees either the old
            // version and then these events, or the new version and not them.
            let mut current = lock(&store.data);
            *current = Arc::new(next);
            // No receivers is fine.
            let _ = store.events.send(Arc::new(events));
            Ok(result)
        })
        .await
        .map_err(|err| StoreError::Unavailable(format!("store task failed: {err}")))?
    }
}

type Loaded = (Data, HashMap<LeaseId, Lease>, LeaseId);

fn load(bytes: &[u8], path: &Path) -> Result<Loaded, StoreError> {
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
    let data = Data {
        revision: state.revision,
        entries,
    };
    Ok((data, leases, state.next_lease))
}

fn persist(
    dir: &Path,
    data: &Data,
    leases: &Mutex<HashMap<LeaseId, Lease>>,
    next_lease: LeaseId,
) -> Result<(), StoreError> {
    let leases: Vec<PersistedLease> = lock(leases)
        .iter()
        .map(|(id, lease)| PersistedLease {
            id: *id,
            ttl_seconds: lease.ttl.as_secs(),
        })
        .collect();
    let state = PersistedState {
        revision: data.revision,
        next_lease,
        entries: data
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
        leases,
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

fn compare_holds(data: &Data, compare: &Compare) -> bool {
    match compare {
        Compare::Absent(key) => !data.entries.contains_key(key),
        Compare::ModRevision(key, revision) => data
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

fn apply(
    data: &mut Data,
    leases: &HashMap<LeaseId, Lease>,
    txn: Txn,
) -> Result<(Option<Revision>, Vec<WatchEvent>), StoreError> {
    if !txn
        .compares
        .iter()
        .all(|compare| compare_holds(data, compare))
    {
        return Ok((None, Vec::new()));
    }
    for op in &txn.ops {
        if let Op::Put { lease, .. } = op
            && *lease != 0
            && !leases.contains_key(lease)
        {
            return Err(StoreError::LeaseNotFound(*lease));
        }
    }
    let revision = data.revision + 1;
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
                data.entries.insert(key, entry);
            }
            Op::Delete { key } => {
                if data.entries.remove(&key).is_some() {
                    events.push(WatchEvent::Delete { key, revision });
                }
            }
            Op::DeletePrefix { prefix } => {
                let keys: Vec<String> = data
                    .entries
                    .range(prefix.clone()..)
                    .take_while(|(key, _)| key.starts_with(&prefix))
                    .map(|(key, _)| key.clone())
                    .collect();
                for key in keys {
                    data.entries.remove(&key);
                    events.push(WatchEvent::Delete { key, revision });
                }
            }
        }
    }
    if !events.is_empty() {
        data.revision = revision;
    }
    Ok((Some(data.revision), events))
}

fn list_prefix(data: &Data, prefix: &str) -> Vec<Kv> {
    data.entries
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
        Ok(self.current().entries.get(key).map(|entry| kv(key, entry)))
    }

    async fn list(&self, prefix: &str) -> Result<Vec<Kv>, StoreError> {
        Ok(list_prefix(&self.current(), prefix))
    }

    async fn commit(&self, txn: Txn) -> Result<Option<Revision>, StoreError> {
        self.mutate(move |data, leases| apply(data, leases, txn))
            .await
    }

    async fn grant_lease(&self, ttl_seconds: u32) -> Result<LeaseId, StoreError> {
        let ttl = Duration::from_secs(u64::from(ttl_seconds.max(1)));
        // A grant is persisted with the next commit; a lease nobody used is worth nothing
        // after a restart.
        let id = self.next_lease.fetch_add(1, Ordering::SeqCst);
        lock(&self.leases).insert(
            id,
            Lease {
                ttl,
                deadline: Instant::now() + ttl,
            },
        );
        Ok(id)
    }

    async fn keep_alive(&self, lease: LeaseId) -> Result<bool, StoreError> {
        let now = Instant::now();
        match lock(&self.leases).get_mut(&lease) {
            Some(entry) if entry.deadline > now => {
                entry.deadline = now + entry.ttl;
                Ok(true)
            }
            _ => Ok(false),
        }
    }

    async fn revoke_lease(&self, lease: LeaseId) -> Result<(), StoreError> {
        if !lock(&self.leases).contains_key(&lease) {
            return Ok(());
        }
        // Delete its keys first; the lease goes only once that is on disk, so a failed
        // write leaves the lease to be reaped again.
        self.mutate(move |data, leases| {
            let keys: Vec<String> = data
                .entries
                .iter()
                .filter(|(_, entry)| entry.lease == lease)
                .map(|(key, _)| key.clone())
                .collect();
            let mut txn = Txn::new();
            for key in keys {
                txn = txn.delete(key);
            }
            let (_, events) = apply(data, leases, txn)?;
            Ok(((), events))
        })
        .await?;
        lock(&self.leases).remove(&lease);
        Ok(())
    }

    async fn list_and_watch(&self, prefix: &str) -> Result<Listing, StoreError> {
        // Subscribing under the data lock means no commit falls between the listing and the
        // watch (commits swap and publish under the same lock).
        let (kvs, revision, receiver) = {
            let data = lock(&self.data);
            (
                list_prefix(&data, prefix),
                data.revision,
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
    async fn a_failed_write_changes_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let store = EmbeddedStore::open(Some(dir.path()), CancellationToken::new()).unwrap();
        let mut listing = store.list_and_watch("").await.unwrap();
        // A directory where the temporary file must go makes every persist fail.
        std::fs::create_dir(dir.path().join(format!("{STATE_FILE}.tmp"))).unwrap();
        let err = store
            .commit(Txn::new().put("k", b"v".to_vec(), 0))
            .await
            .unwrap_err();
        assert!(matches!(err, StoreError::Unavailable(_)), "{err}");
        assert!(store.get("k").await.unwrap().is_none(), "not visible");
        std::fs::remove_dir(dir.path().join(format!("{STATE_FILE}.tmp"))).unwrap();
        store
            .commit(Txn::new().put("k2", b"v".to_vec(), 0))
            .await
            .unwrap()
            .unwrap();
        use futures::StreamExt as _;
        let batch = listing.watch.next().await.unwrap().unwrap();
        assert_eq!(batch.len(), 1);
        assert_eq!(batch[0].key(), "k2", "the failed write published nothing");
    }

    #[tokio::test]
    async fn corrupt_state_is_reported() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(STATE_FILE), b"{not json").unwrap();
        let err = EmbeddedStore::open(Some(dir.path()), CancellationToken::new()).unwrap_err();
        assert!(matches!(err, StoreError::Corrupt(_)), "{err}");
    }
}
