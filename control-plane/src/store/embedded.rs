//! The embedded single-node store: etcd's model (revisions, transactions, leases, watches)
//! in memory, persisted under `DIR` before a commit is acknowledged, so a crash never loses an
//! acknowledged write and never leaves a half-written state:
//!
//! - `DIR/wal.jsonl`: one line per commit (its events, and the leases its keys live on),
//!   appended and fsynced. A torn last line (a crash mid-append: never acknowledged) is
//!   dropped when the store opens.
//! - `DIR/state.json`: everything at one revision. When the log outgrows the state (and 4 MiB),
//!   the state is rewritten (temporary file, fsync, rename, fsync the directory) and the log
//!   emptied; log lines at or below the state's revision are skipped on opening, so a crash
//!   between the two loses nothing.
//! - `DIR/LOCK`: held (`flock`) while the store is open, with the holder's PID in it. A second
//!   process opening the same directory is refused, naming that PID: two writers would each
//!   overwrite the other's state and lose acknowledged writes.
//!
//! A commit costs one small append and one fsync, whatever the size of the state.
//!
//! Commits are copy-on-write: a commit applies to a copy of the data, persists it, and only
//! then swaps it in and publishes its events. A failed write (disk full) changes nothing.
//! Readers take the current version without waiting for a commit's fsync.
//!
//! Leases are persisted with their TTL; after a restart each lease gets a fresh TTL, so an
//! instance that keeps heartbeating survives a control-plane restart.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::sync::broadcast;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::{
    Compare, Kv, LeaseId, Listing, Op, Revision, Store, StoreError, Txn, WatchControl, WatchEvent,
    WatchItem,
};

const STATE_FILE: &str = "state.json";
const LOG_FILE: &str = "wal.jsonl";
const LOCK_FILE: &str = "LOCK";
/// The log is folded into the state once it is larger than the state and than this.
const MIN_LOG_BYTES_TO_COMPACT: u64 = 4 * 1024 * 1024;
const WATCH_BUFFER: usize = 16384;
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

/// One line of `wal.jsonl`: a commit.
#[derive(Serialize, Deserialize)]
struct LogRecord {
    revision: Revision,
    next_lease: LeaseId,
    /// Keys written, with their values and leases.
    puts: Vec<PersistedEntry>,
    deletes: Vec<String>,
    /// The leases the written keys live on.
    leases: Vec<PersistedLease>,
    /// A lease revoked by this commit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    revoked: Option<LeaseId>,
}

/// The files of a store with a directory (held under the writer lock).
#[derive(Debug)]
struct Disk {
    dir: PathBuf,
    log: File,
    log_bytes: u64,
    state_bytes: u64,
    /// Set when a failed append could not be undone: the log's end is unknown, so no further
    /// write is taken until a restart replays the log.
    broken: Option<String>,
    /// Held open for the lock on it.
    _lock: File,
}

#[derive(Debug)]
pub struct EmbeddedStore {
    /// The current version; swapped whole by commits.
    data: Mutex<Arc<Data>>,
    /// Serialises commits and owns the files (held on a blocking thread only, across the fsync).
    writer: Mutex<Option<Disk>>,
    /// Set by `close`: no commit is accepted any more.
    closed: std::sync::atomic::AtomicBool,
    leases: Mutex<HashMap<LeaseId, Lease>>,
    next_lease: AtomicI64,
    events: broadcast::Sender<Arc<WatchItem>>,
}

/// A poisoned lock is safe to keep using here: every guarded value is replaced whole or
/// updated in one step, so a panic cannot leave it half-changed.
fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|poison| poison.into_inner())
}

fn unavailable(what: String) -> impl FnOnce(std::io::Error) -> StoreError {
    move |err| StoreError::Unavailable(format!("{what}: {err}"))
}

/// Takes the directory's lock, or says which process holds it.
fn lock_dir(dir: &Path) -> Result<File, StoreError> {
    let path = dir.join(LOCK_FILE);
    let mut file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .map_err(unavailable(format!("cannot open {}", path.display())))?;
    if let Err(err) = rustix::fs::flock(&file, rustix::fs::FlockOperation::NonBlockingLockExclusive)
    {
        if err != rustix::io::Errno::WOULDBLOCK {
            return Err(StoreError::Unavailable(format!(
                "cannot lock {}: {err}",
                path.display()
            )));
        }
        let holder = std::fs::read_to_string(&path).unwrap_or_default();
        let holder = match holder.trim() {
            "" => "another process".to_owned(),
            pid => format!("process {pid}"),
        };
        return Err(StoreError::InUse(format!(
            "--data-dir {}: in use by {holder} (another control plane on the same directory would overwrite its writes; stop it first)",
            dir.display()
        )));
    }
    file.set_len(0)
        .and_then(|()| file.write_all(format!("{}\n", std::process::id()).as_bytes()))
        .and_then(|()| file.sync_all())
        .map_err(unavailable(format!("cannot write {}", path.display())))?;
    Ok(file)
}

impl EmbeddedStore {
    /// Opens (or creates) the store in `dir`; `None` keeps everything in memory (tests).
    /// Spawns the lease reaper, which stops when `shutdown` is cancelled.
    pub fn open(dir: Option<&Path>, shutdown: CancellationToken) -> Result<Arc<Self>, StoreError> {
        let mut data = Data::default();
        let mut leases = HashMap::new();
        let mut next_lease = 1;
        let mut disk = None;
        if let Some(dir) = dir {
            std::fs::create_dir_all(dir)
                .map_err(unavailable(format!("cannot create {}", dir.display())))?;
            let lock = lock_dir(dir)?;
            let path = dir.join(STATE_FILE);
            let mut state_bytes = 0;
            match std::fs::read(&path) {
                Ok(bytes) => {
                    state_bytes = bytes.len() as u64;
                    (data, leases, next_lease) = load(&bytes, &path)?;
                }
                Err(err) if err.kind() == std::io::ErrorKind::NotFound => {}
                Err(err) => {
                    return Err(StoreError::Unavailable(format!(
                        "cannot read {}: {err}",
                        path.display()
                    )));
                }
            }
            let log_path = dir.join(LOG_FILE);
            let log_bytes = replay(&log_path, &mut data, &mut leases, &mut next_lease)?;
            let log = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&log_path)
                .map_err(unavailable(format!("cannot open {}", log_path.display())))?;
            disk = Some(Disk {
                dir: dir.to_path_buf(),
                log,
                log_bytes,
                state_bytes,
                broken: None,
                _lock: lock,
            });
        }
        let (events, _) = broadcast::channel(WATCH_BUFFER);
        let store = Arc::new(Self {
            data: Mutex::new(Arc::new(data)),
            writer: Mutex::new(disk),
            closed: std::sync::atomic::AtomicBool::new(false),
            leases: Mutex::new(leases),
            next_lease: AtomicI64::new(next_lease),
            events,
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

    /// Applies a mutation to a copy of the data, persists it, then swaps it in and publishes
    /// its events. Runs on a blocking thread so the runtime never waits on fsync.
    async fn mutate<T: Send + 'static>(
        self: &Arc<Self>,
        revoked: Option<LeaseId>,
        mutation: impl FnOnce(
            &mut Data,
            &HashMap<LeaseId, Lease>,
        ) -> Result<(T, Vec<WatchEvent>), StoreError>
        + Send
        + 'static,
    ) -> Result<T, StoreError> {
        let store = Arc::clone(self);
        tokio::task::spawn_blocking(move || {
            let mut disk = lock(&store.writer);
            if store.closed.load(Ordering::SeqCst) {
                return Err(StoreError::Unavailable("the store is closed".into()));
            }
            let mut next = (*store.current()).clone();
            let (result, events) = {
                let leases = lock(&store.leases);
                mutation(&mut next, &leases)?
            };
            if events.is_empty() {
                return Ok(result);
            }
            if let Some(disk) = disk.as_mut() {
                let record = log_record(
                    &next,
                    &events,
                    &store.leases,
                    store.next_lease.load(Ordering::SeqCst),
                    revoked,
                )?;
                disk.append(&record)?;
                if disk.log_bytes > disk.state_bytes.max(MIN_LOG_BYTES_TO_COMPACT) {
                    // The commit is durable in the log already; a failed compaction only
                    // leaves the log longer.
                    if let Err(err) = disk.compact(
                        &next,
                        &store.leases,
                        store.next_lease.load(Ordering::SeqCst),
                    ) {
                        tracing::warn!(error = %err, "embedded store could not compact its log");
                    }
                }
            }
            // Swap and publish under the data lock, so `list_and_watch` sees either the old
            // version and then these events, or the new version and not them.
            let mut current = lock(&store.data);
            *current = Arc::new(next);
            // No receivers is fine.
            let _ = store.events.send(Arc::new(WatchItem::Events(events)));
            Ok(result)
        })
        .await
        .map_err(|err| StoreError::Unavailable(format!("store task failed: {err}")))?
    }
}

impl Disk {
    fn append(&mut self, record: &LogRecord) -> Result<(), StoreError> {
        let mut line = serde_json::to_vec(record)
            .map_err(|err| StoreError::Corrupt(format!("cannot encode a log record: {err}")))?;
        line.push(b'\n');
        let path = self.dir.join(LOG_FILE);
        if let Some(why) = &self.broken {
            return Err(StoreError::Unavailable(format!(
                "{} is in an unknown state since a failed write ({why}); restart to replay it",
                path.display()
            )));
        }
        let written = self
            .log
            .write_all(&line)
            .and_then(|()| self.log.sync_data());
        if let Err(err) = written {
            // Part of the line may be in the file (a full disk), or all of it without the
            // fsync: cut the log back to its last acknowledged commit, or a later commit would
            // follow a torn or unacknowledged line. If even that fails, take no more writes.
            if let Err(undo) = self.cut_back(&path) {
                tracing::error!(error = %err, undo = %undo, path = %path.display(), "the embedded store could not undo a failed append; refusing writes until restarted");
                self.broken = Some(err.to_string());
            }
            return Err(StoreError::Unavailable(format!(
                "cannot persist to {}: {err}",
                path.display()
            )));
        }
        self.log_bytes += line.len() as u64;
        Ok(())
    }

    /// Truncates the log to what has been acknowledged (through a handle of its own: the
    /// failed one may be the problem).
    fn cut_back(&self, path: &Path) -> std::io::Result<()> {
        let file = std::fs::OpenOptions::new().write(true).open(path)?;
        file.set_len(self.log_bytes)?;
        file.sync_all()
    }

    /// Writes the whole state, then empties the log.
    fn compact(
        &mut self,
        data: &Data,
        leases: &Mutex<HashMap<LeaseId, Lease>>,
        next_lease: LeaseId,
    ) -> Result<(), StoreError> {
        self.state_bytes = persist(&self.dir, data, leases, next_lease)?;
        let path = self.dir.join(LOG_FILE);
        self.log
            .set_len(0)
            .and_then(|()| self.log.sync_all())
            .map_err(unavailable(format!("cannot truncate {}", path.display())))?;
        self.log_bytes = 0;
        Ok(())
    }
}

fn persisted_leases(
    leases: &HashMap<LeaseId, Lease>,
    ids: impl Iterator<Item = LeaseId>,
) -> Vec<PersistedLease> {
    let mut ids: Vec<LeaseId> = ids.filter(|id| *id != 0).collect();
    ids.sort_unstable();
    ids.dedup();
    ids.into_iter()
        .filter_map(|id| {
            leases.get(&id).map(|lease| PersistedLease {
                id,
                ttl_seconds: lease.ttl.as_secs(),
            })
        })
        .collect()
}

fn utf8(key: &str, value: &[u8]) -> Result<String, StoreError> {
    String::from_utf8(value.to_vec())
        .map_err(|_| StoreError::Corrupt(format!("value of {key} is not UTF-8")))
}

fn log_record(
    data: &Data,
    events: &[WatchEvent],
    leases: &Mutex<HashMap<LeaseId, Lease>>,
    next_lease: LeaseId,
    revoked: Option<LeaseId>,
) -> Result<LogRecord, StoreError> {
    let mut puts = Vec::new();
    let mut deletes = Vec::new();
    for event in events {
        match event {
            WatchEvent::Put(kv) => puts.push(PersistedEntry {
                key: kv.key.clone(),
                value: utf8(&kv.key, &kv.value)?,
                mod_revision: kv.mod_revision,
                lease: kv.lease,
            }),
            WatchEvent::Delete { key, .. } => deletes.push(key.clone()),
        }
    }
    let leases = persisted_leases(&lock(leases), puts.iter().map(|put| put.lease));
    Ok(LogRecord {
        revision: data.revision,
        next_lease,
        puts,
        deletes,
        leases,
        revoked,
    })
}

/// Applies the log's records above the state's revision; returns the log's length in bytes
/// once a torn last line (if any) is cut off.
fn replay(
    path: &Path,
    data: &mut Data,
    leases: &mut HashMap<LeaseId, Lease>,
    next_lease: &mut LeaseId,
) -> Result<u64, StoreError> {
    let bytes = match std::fs::read(path) {
        Ok(bytes) => bytes,
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => return Ok(0),
        Err(err) => {
            return Err(StoreError::Unavailable(format!(
                "cannot read {}: {err}",
                path.display()
            )));
        }
    };
    let now = Instant::now();
    let mut good = 0usize;
    let mut lines = bytes.split_inclusive(|byte| *byte == b'\n').peekable();
    while let Some(line) = lines.next() {
        let last = lines.peek().is_none();
        let record = match serde_json::from_slice::<LogRecord>(line) {
            Ok(record) if line.ends_with(b"\n") => record,
            // A crash in the middle of an append: that commit was never acknowledged.
            _ if last => {
                tracing::warn!(path = %path.display(), "dropping a torn last log line");
                break;
            }
            Err(err) => {
                return Err(StoreError::Corrupt(format!(
                    "{} at byte {good}: {err}",
                    path.display()
                )));
            }
            Ok(_) => unreachable!("only the last line can lack its newline"),
        };
        good += line.len();
        *next_lease = (*next_lease).max(record.next_lease);
        for lease in record.leases {
            let ttl = Duration::from_secs(lease.ttl_seconds);
            leases.insert(
                lease.id,
                Lease {
                    ttl,
                    deadline: now + ttl,
                },
            );
        }
        if let Some(revoked) = record.revoked {
            leases.remove(&revoked);
        }
        if record.revision <= data.revision {
            continue;
        }
        for key in record.deletes {
            data.entries.remove(&key);
        }
        for put in record.puts {
            data.entries.insert(
                put.key,
                Entry {
                    value: put.value.into_bytes(),
                    mod_revision: put.mod_revision,
                    lease: put.lease,
                },
            );
        }
        data.revision = record.revision;
    }
    if good < bytes.len() {
        let file = std::fs::OpenOptions::new()
            .write(true)
            .open(path)
            .map_err(unavailable(format!("cannot open {}", path.display())))?;
        file.set_len(good as u64)
            .and_then(|()| file.sync_all())
            .map_err(unavailable(format!("cannot truncate {}", path.display())))?;
    }
    Ok(good as u64)
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

/// Writes the whole state atomically; returns its size.
fn persist(
    dir: &Path,
    data: &Data,
    leases: &Mutex<HashMap<LeaseId, Lease>>,
    next_lease: LeaseId,
) -> Result<u64, StoreError> {
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
                    value: utf8(key, &entry.value)?,
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
    })?;
    Ok(bytes.len() as u64)
}

fn write_atomically(dir: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let temporary = dir.join(format!("{STATE_FILE}.tmp"));
    let mut file = File::create(&temporary)?;
    file.write_all(bytes)?;
    file.sync_all()?;
    drop(file);
    std::fs::rename(&temporary, dir.join(STATE_FILE))?;
    File::open(dir)?.sync_all()
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
        self.mutate(None, move |data, leases| apply(data, leases, txn))
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
        self.mutate(Some(lease), move |data, leases| {
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
                        Ok(item) => match item.as_ref() {
                            WatchItem::Events(batch) => {
                                let events: Vec<WatchEvent> = batch
                                    .iter()
                                    .filter(|event| event.key().starts_with(&prefix))
                                    .cloned()
                                    .collect();
                                if !events.is_empty() {
                                    return Some((Ok(WatchItem::Events(events)), receiver));
                                }
                            }
                            WatchItem::Progress(revision) => {
                                return Some((Ok(WatchItem::Progress(*revision)), receiver));
                            }
                        },
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
            control: Box::new(EmbeddedWatchControl(Arc::clone(self))),
        })
    }

    fn close(&self) {
        self.close_files();
    }
}

impl EmbeddedStore {
    fn close_files(&self) {
        let mut disk = lock(&self.writer);
        self.closed.store(true, Ordering::SeqCst);
        // Dropping the files releases the directory lock.
        disk.take();
    }
}

/// Progress of an embedded watch: the current revision, published in order with the commits.
struct EmbeddedWatchControl(Arc<EmbeddedStore>);

#[async_trait::async_trait]
impl WatchControl for EmbeddedWatchControl {
    async fn request_progress(&mut self) -> Result<(), StoreError> {
        let data = lock(&self.0.data);
        // Every watcher sees it; to them all it is true.
        let _ = self
            .0
            .events
            .send(Arc::new(WatchItem::Progress(data.revision)));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::contract;

    fn memory() -> Arc<EmbeddedStore> {
        EmbeddedStore::open(None, CancellationToken::new()).unwrap()
    }

    /// Puts `key`, and expects the commit to apply.
    async fn put(store: &Arc<EmbeddedStore>, key: &str) {
        store
            .commit(Txn::new().put(key, b"v".to_vec(), 0))
            .await
            .unwrap()
            .unwrap();
    }

    /// Gives the store a read-only handle on its log, so that every append fails as on a full
    /// disk; returns the writable one, for [`mend_log`].
    fn break_log(store: &EmbeddedStore, log_path: &Path) -> File {
        let mut disk = lock(&store.writer);
        let disk = disk.as_mut().unwrap();
        std::mem::replace(&mut disk.log, File::open(log_path).unwrap())
    }

    fn mend_log(store: &EmbeddedStore, writable: File) {
        lock(&store.writer).as_mut().unwrap().log = writable;
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
        let writable = break_log(&store, &dir.path().join(LOG_FILE));
        let err = store
            .commit(Txn::new().put("k", b"v".to_vec(), 0))
            .await
            .unwrap_err();
        assert!(matches!(err, StoreError::Unavailable(_)), "{err}");
        assert!(store.get("k").await.unwrap().is_none(), "not visible");
        mend_log(&store, writable);
        put(&store, "k2").await;
        use futures::StreamExt as _;
        let item = listing.watch.next().await.unwrap().unwrap();
        let WatchItem::Events(batch) = item else {
            panic!("expected events, got {item:?}");
        };
        assert_eq!(batch.len(), 1);
        assert_eq!(batch[0].key(), "k2", "the failed write published nothing");
    }

    #[tokio::test]
    async fn a_torn_append_is_cut_back_so_later_commits_survive_a_restart() {
        let dir = tempfile::tempdir().unwrap();
        let log_path = dir.path().join(LOG_FILE);
        {
            let store = EmbeddedStore::open(Some(dir.path()), CancellationToken::new()).unwrap();
            put(&store, "k1").await;
            // A full disk: half a line reaches the file, then the append fails.
            let mut torn = std::fs::OpenOptions::new()
                .append(true)
                .open(&log_path)
                .unwrap();
            torn.write_all(br#"{"revision":99,"ops":[{"put"#).unwrap();
            let writable = break_log(&store, &log_path);
            store
                .commit(Txn::new().put("lost", b"v".to_vec(), 0))
                .await
                .unwrap_err();
            mend_log(&store, writable);
            put(&store, "k2").await;
            store.close();
        }
        let reopened = EmbeddedStore::open(Some(dir.path()), CancellationToken::new()).unwrap();
        assert!(reopened.get("k1").await.unwrap().is_some());
        assert!(reopened.get("k2").await.unwrap().is_some(), "acknowledged");
        assert!(reopened.get("lost").await.unwrap().is_none(), "refused");
    }

    #[tokio::test]
    async fn a_second_opener_of_the_directory_is_refused_with_the_holders_pid() {
        let dir = tempfile::tempdir().unwrap();
        let first = EmbeddedStore::open(Some(dir.path()), CancellationToken::new()).unwrap();
        let err = EmbeddedStore::open(Some(dir.path()), CancellationToken::new()).unwrap_err();
        let StoreError::InUse(message) = err else {
            panic!("expected InUse, got {err}");
        };
        assert!(
            message.contains(&format!("process {}", std::process::id())),
            "{message}"
        );
        drop(first);
        EmbeddedStore::open(Some(dir.path()), CancellationToken::new())
            .expect("the lock goes with the store");
    }

    #[tokio::test]
    async fn the_log_replays_compacts_and_drops_a_torn_last_line() {
        let dir = tempfile::tempdir().unwrap();
        let value = vec![b'x'; 64 * 1024];
        {
            let store = EmbeddedStore::open(Some(dir.path()), CancellationToken::new()).unwrap();
            // Enough to pass the compaction threshold (4 MiB of log) once, then more.
            for index in 0..100 {
                store
                    .commit(Txn::new().put(format!("k/{index}"), value.clone(), 0))
                    .await
                    .unwrap()
                    .unwrap();
            }
            store.commit(Txn::new().delete("k/0")).await.unwrap();
            let disk = lock(&store.writer);
            let disk = disk.as_ref().unwrap();
            assert!(disk.state_bytes > 0, "compacted once");
            assert!(disk.log_bytes < 4 * 1024 * 1024 + 70 * 1024);
        }
        // A crash in the middle of an append leaves half a line.
        let log = dir.path().join(LOG_FILE);
        let mut file = std::fs::OpenOptions::new().append(true).open(&log).unwrap();
        file.write_all(br#"{"revision":999,"next_le"#).unwrap();
        drop(file);
        let store = EmbeddedStore::open(Some(dir.path()), CancellationToken::new()).unwrap();
        assert_eq!(store.list("k/").await.unwrap().len(), 99);
        assert!(store.get("k/0").await.unwrap().is_none());
        assert_eq!(store.current().revision, 101);
        assert!(
            std::fs::read(&log).unwrap().ends_with(b"\n"),
            "the torn line is cut off"
        );
        store
            .commit(Txn::new().put("after", b"1".to_vec(), 0))
            .await
            .unwrap();
        drop(store);
        let store = EmbeddedStore::open(Some(dir.path()), CancellationToken::new()).unwrap();
        assert_eq!(store.get("after").await.unwrap().unwrap().mod_revision, 102);
    }

    #[tokio::test]
    async fn corrupt_state_is_reported() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(STATE_FILE), b"{not json").unwrap();
        let err = EmbeddedStore::open(Some(dir.path()), CancellationToken::new()).unwrap_err();
        assert!(matches!(err, StoreError::Corrupt(_)), "{err}");
    }
}
