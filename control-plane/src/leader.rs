//! Leader election among control-plane replicas sharing one store, for the singleton duties
//! (health probing). The leader holds the `leader` key on a short lease and renews it; when it
//! dies the lease lapses and another replica takes the key within about one TTL.
//!
//! While leading, the watch carries the store revision at which this replica took the key:
//! the fence of its writes. Health writes compare it, so a replica that lost the key (its
//! lease lapsed and another took it) cannot overwrite the new leader's view, however late
//! its write arrives.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::keys;
use crate::store::{Compare, Revision, Store, Txn};

#[derive(Debug, Clone)]
pub struct ElectionConfig {
    pub replica_id: String,
    /// Lease TTL of the leader key: how long a dead leader keeps the role.
    pub ttl_seconds: u32,
}

/// Campaigns until `shutdown`; the returned receiver holds the leader key's revision while
/// this replica leads, `None` otherwise.
pub fn spawn(
    store: Arc<dyn Store>,
    config: ElectionConfig,
    shutdown: CancellationToken,
    tasks: &mut tokio::task::JoinSet<()>,
) -> watch::Receiver<Option<Revision>> {
    let (leading, receiver) = watch::channel(None);
    tasks.spawn(campaign(store, config, leading, shutdown));
    receiver
}

async fn campaign(
    store: Arc<dyn Store>,
    config: ElectionConfig,
    leading: watch::Sender<Option<Revision>>,
    shutdown: CancellationToken,
) {
    let ttl = config.ttl_seconds.max(2);
    let renew_every = Duration::from_millis(u64::from(ttl) * 1000 / 3);
    let retry_every =
        Duration::from_millis(u64::from(ttl) * 1000 / 6).max(Duration::from_millis(200));
    while !shutdown.is_cancelled() {
        match try_acquire(store.as_ref(), &config.replica_id, ttl).await {
            Ok(Some((lease, revision))) => {
                tracing::info!(replica = %config.replica_id, revision, "became leader");
                leading.send_replace(Some(revision));
                loop {
                    tokio::select! {
                        () = shutdown.cancelled() => {
                            // Hand over at once instead of making the others wait a TTL.
                            let _ = store.revoke_lease(lease).await;
                            leading.send_replace(None);
                            return;
                        }
                        () = tokio::time::sleep(renew_every) => {}
                    }
                    // A renewal must answer within one renewal period: the lease was last
                    // renewed at most ttl/3 ago, so stepping down now leaves at least ttl/3
                    // before anyone else can take over; two leaders never overlap.
                    match tokio::time::timeout(renew_every, store.keep_alive(lease)).await {
                        Ok(Ok(true)) => {}
                        Ok(Ok(false)) => {
                            tracing::warn!("leader lease lapsed; stepping down");
                            break;
                        }
                        Ok(Err(err)) => {
                            tracing::warn!(error = %err, "cannot renew leader lease; stepping down");
                            break;
                        }
                        Err(_) => {
                            tracing::warn!("leader lease renewal too slow; stepping down");
                            break;
                        }
                    }
                }
                leading.send_replace(None);
                // Best effort: free the key now rather than after its TTL.
                let _ = tokio::time::timeout(renew_every, store.revoke_lease(lease)).await;
            }
            Ok(None) => {}
            Err(err) => tracing::debug!(error = %err, "leader campaign failed"),
        }
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = tokio::time::sleep(retry_every) => {}
        }
    }
}

/// Takes the leader key if nobody holds it; returns the lease it lives on and the revision
/// that wrote it.
async fn try_acquire(
    store: &dyn Store,
    replica_id: &str,
    ttl: u32,
) -> Result<Option<(i64, Revision)>, crate::store::StoreError> {
    if store.get(keys::LEADER).await?.is_some() {
        return Ok(None);
    }
    let lease = store.grant_lease(ttl).await?;
    let won = store
        .commit(
            Txn::new()
                .when(Compare::Absent(keys::LEADER.to_owned()))
                .put(keys::LEADER, replica_id.as_bytes().to_vec(), lease),
        )
        .await?;
    if let Some(revision) = won {
        Ok(Some((lease, revision)))
    } else {
        let _ = store.revoke_lease(lease).await;
        Ok(None)
    }
}
