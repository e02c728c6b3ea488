//! The storage trait and its two implementations: etcd (several control-plane replicas share
//! one etcd cluster) and an embedded single-node store persisted to a directory.
//!
//! The trait is the small part of etcd's model the control plane needs: keys with a
//! modification revision, multi-key transactions guarded by comparisons (create-if-absent,
//! compare-revision-on-update), leases that delete their keys when they lapse, and a watch that
//! starts exactly where a listing ended and can be asked how far it has come (so that a stalled
//! watch is noticed rather than taken for a quiet one).

pub mod embedded;
pub mod etcd;

use std::pin::Pin;

use futures::Stream;

/// Store-wide revision, increased by every committed change (etcd's revision).
pub type Revision = i64;
/// Id of a lease; 0 means "no lease".
pub type LeaseId = i64;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Kv {
    pub key: String,
    pub value: Vec<u8>,
    pub mod_revision: Revision,
    pub lease: LeaseId,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Compare {
    /// The key does not exist.
    Absent(String),
    /// The key exists and was last modified at this revision.
    ModRevision(String, Revision),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op {
    Put {
        key: String,
        value: Vec<u8>,
        lease: LeaseId,
    },
    Delete {
        key: String,
    },
    DeletePrefix {
        prefix: String,
    },
}

/// A transaction: if every comparison holds, apply every operation atomically.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Txn {
    pub compares: Vec<Compare>,
    pub ops: Vec<Op>,
}

impl Txn {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn when(mut self, compare: Compare) -> Self {
        self.compares.push(compare);
        self
    }

    /// Holds while the key of `kv` is still at the revision it was read at.
    pub fn when_unchanged(self, kv: &Kv) -> Self {
        self.when(Compare::ModRevision(kv.key.clone(), kv.mod_revision))
    }

    pub fn put(mut self, key: impl Into<String>, value: Vec<u8>, lease: LeaseId) -> Self {
        self.ops.push(Op::Put {
            key: key.into(),
            value,
            lease,
        });
        self
    }

    pub fn delete(mut self, key: impl Into<String>) -> Self {
        self.ops.push(Op::Delete { key: key.into() });
        self
    }

    pub fn delete_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.ops.push(Op::DeletePrefix {
            prefix: prefix.into(),
        });
        self
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WatchEvent {
    Put(Kv),
    Delete { key: String, revision: Revision },
}

impl WatchEvent {
    pub fn key(&self) -> &str {
        match self {
            WatchEvent::Put(kv) => &kv.key,
            WatchEvent::Delete { key, .. } => key,
        }
    }

    pub fn revision(&self) -> Revision {
        match self {
            WatchEvent::Put(kv) => kv.mod_revision,
            WatchEvent::Delete { revision, .. } => *revision,
        }
    }
}

/// What a watch delivers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WatchItem {
    /// The events of one committed transaction (or several), in revision order.
    Events(Vec<WatchEvent>),
    /// The answer to [`WatchControl::request_progress`]: every event up to this revision has
    /// been delivered.
    Progress(Revision),
}

#[derive(Debug, Clone, thiserror::Error)]
pub enum StoreError {
    /// The store cannot be reached or did not answer in time.
    #[error("store unavailable: {0}")]
    Unavailable(String),
    /// A lease named in a put no longer exists.
    #[error("lease {0} not found")]
    LeaseNotFound(LeaseId),
    /// The watch fell behind (compaction, or a slow consumer); list and watch again.
    #[error("watch lost its place: {0}")]
    WatchLost(String),
    /// Stored data could not be read back.
    #[error("store data corrupt: {0}")]
    Corrupt(String),
    /// Another process holds the embedded store's directory.
    #[error("{0}")]
    InUse(String),
}

/// Batches of events, one batch per committed transaction, in revision order, and progress
/// answers.
pub type WatchStream = Pin<Box<dyn Stream<Item = Result<WatchItem, StoreError>> + Send + 'static>>;

/// The request side of a watch.
#[async_trait::async_trait]
pub trait WatchControl: Send {
    /// Asks the store to confirm in the watch stream, as soon as it can, how far the watch has
    /// come (a [`WatchItem::Progress`]). A store that cannot answer (etcd frozen, cut off from
    /// its quorum) never does.
    async fn request_progress(&mut self) -> Result<(), StoreError>;

    /// Says the watch stopped answering: a store with several members moves to another one.
    fn stalled(&mut self) {}
}

/// Everything under a prefix at one revision, and the changes after it.
pub struct Listing {
    pub kvs: Vec<Kv>,
    pub revision: Revision,
    pub watch: WatchStream,
    pub control: Box<dyn WatchControl>,
}

impl std::fmt::Debug for Listing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Listing")
            .field("kvs", &self.kvs.len())
            .field("revision", &self.revision)
            .finish()
    }
}

#[async_trait::async_trait]
pub trait Store: Send + Sync + 'static {
    /// "etcd" or "embedded", for logs.
    fn kind(&self) -> &'static str;
    async fn get(&self, key: &str) -> Result<Option<Kv>, StoreError>;
    async fn list(&self, prefix: &str) -> Result<Vec<Kv>, StoreError>;
    /// Applies the transaction if its comparisons hold: `Some(revision)`; else `None`.
    async fn commit(&self, txn: Txn) -> Result<Option<Revision>, StoreError>;
    async fn grant_lease(&self, ttl_seconds: u32) -> Result<LeaseId, StoreError>;
    /// Renews a lease; `false` when it has already lapsed.
    async fn keep_alive(&self, lease: LeaseId) -> Result<bool, StoreError>;
    /// Revokes a lease and deletes its keys; revoking a lapsed lease is not an error.
    async fn revoke_lease(&self, lease: LeaseId) -> Result<(), StoreError>;
    /// Lists a prefix and watches it from the listing's revision on, with no gap between.
    async fn list_and_watch(&self, prefix: &str) -> Result<Listing, StoreError>;
    /// Lets go of what the store holds for this process (the embedded store's directory lock):
    /// every call after it fails. For a shutdown, or a simulated crash in tests.
    fn close(&self) {}
}

#[doc(hidden)]
pub mod contract {
    //! Behaviour both stores must share, run against each: the embedded store in this crate's
    //! unit tests, etcd in the integration tests (which start a real etcd). Public only so
    //! that the integration tests can reach it.

    use std::time::Duration;

    use futures::StreamExt;

    use super::*;

    /// Puts `value` at "a" if `compare` holds: the revision, or `None` when it did not.
    async fn put_a_if(store: &dyn Store, compare: Compare, value: &[u8]) -> Option<Revision> {
        store
            .commit(Txn::new().when(compare).put("a", value.to_vec(), 0))
            .await
            .unwrap()
    }

    pub async fn create_if_absent_and_compare_revision(store: &dyn Store) {
        let created = put_a_if(store, Compare::Absent("a".into()), b"1").await;
        let revision = created.expect("first create wins");
        let again = put_a_if(store, Compare::Absent("a".into()), b"2").await;
        assert_eq!(again, None, "second create loses");
        let kv = store.get("a").await.unwrap().unwrap();
        assert_eq!(kv.value, b"1");
        assert_eq!(kv.mod_revision, revision);
        let stale = put_a_if(store, Compare::ModRevision("a".into(), revision - 1), b"3").await;
        assert_eq!(stale, None, "stale revision refused");
        let fresh = store
            .commit(
                Txn::new()
                    .when(Compare::ModRevision("a".into(), revision))
                    .put("a", b"4".to_vec(), 0)
                    .put("b/1", b"x".to_vec(), 0)
                    .put("b/2", b"y".to_vec(), 0),
            )
            .await
            .unwrap();
        assert!(fresh.unwrap() > revision);
        assert_eq!(store.list("b/").await.unwrap().len(), 2);
        store
            .commit(Txn::new().delete_prefix("b/").delete("a"))
            .await
            .unwrap()
            .unwrap();
        assert!(store.get("a").await.unwrap().is_none());
        assert!(store.list("b/").await.unwrap().is_empty());
    }

    pub async fn watch_follows_listing(store: &dyn Store) {
        store
            .commit(Txn::new().put("w/1", b"one".to_vec(), 0))
            .await
            .unwrap();
        let mut listing = store.list_and_watch("w/").await.unwrap();
        assert_eq!(listing.kvs.len(), 1);
        store
            .commit(
                Txn::new()
                    .put("w/2", b"two".to_vec(), 0)
                    .put("other", b"".to_vec(), 0),
            )
            .await
            .unwrap();
        store.commit(Txn::new().delete("w/1")).await.unwrap();
        let mut seen = Vec::new();
        while seen.len() < 2 {
            let item = tokio::time::timeout(Duration::from_secs(5), listing.watch.next())
                .await
                .expect("watch event in time")
                .expect("stream open")
                .unwrap();
            if let WatchItem::Events(batch) = item {
                seen.extend(batch);
            }
        }
        assert!(matches!(&seen[0], WatchEvent::Put(kv) if kv.key == "w/2" && kv.value == b"two"));
        assert!(matches!(&seen[1], WatchEvent::Delete { key, .. } if key == "w/1"));
        assert!(seen[0].revision() > listing.revision);
        // Asked how far it has come, the watch answers with a revision that covers both.
        listing.control.request_progress().await.unwrap();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            let item = tokio::time::timeout_at(deadline, listing.watch.next())
                .await
                .expect("progress answer in time")
                .expect("stream open")
                .unwrap();
            if let WatchItem::Progress(revision) = item {
                assert!(revision >= seen[1].revision(), "{revision}");
                break;
            }
        }
    }

    pub async fn lapsed_lease_deletes_its_keys(store: &dyn Store) {
        let lease = store.grant_lease(2).await.unwrap();
        store
            .commit(Txn::new().put("l/1", b"x".to_vec(), lease))
            .await
            .unwrap()
            .unwrap();
        assert!(store.keep_alive(lease).await.unwrap());
        assert_eq!(store.get("l/1").await.unwrap().unwrap().lease, lease);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while store.get("l/1").await.unwrap().is_some() {
            assert!(tokio::time::Instant::now() < deadline, "lease never lapsed");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert!(!store.keep_alive(lease).await.unwrap());
        let err = store
            .commit(Txn::new().put("l/2", b"x".to_vec(), lease))
            .await
            .unwrap_err();
        assert!(matches!(err, StoreError::LeaseNotFound(_)), "{err}");
        let lease = store.grant_lease(30).await.unwrap();
        store
            .commit(Txn::new().put("l/3", b"x".to_vec(), lease))
            .await
            .unwrap();
        store.revoke_lease(lease).await.unwrap();
        assert!(store.get("l/3").await.unwrap().is_none());
    }
}
