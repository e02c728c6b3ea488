//! The etcd store. Every key lives under a namespace prefix (`--etcd-prefix`, default
//! `/switchyard/v1/`); callers see keys without it. Each call has a deadline, so a dead etcd
//! turns into `StoreError::Unavailable` (gRPC `UNAVAILABLE` at the API) instead of a hang.

use std::time::Duration;

use etcd_client::{
    Client, Compare as EtcdCompare, CompareOp, ConnectOptions, DeleteOptions, EventType,
    GetOptions, PutOptions, Txn as EtcdTxn, TxnOp, WatchOptions,
};
use futures::StreamExt;

use super::{Compare, Kv, LeaseId, Listing, Op, Revision, Store, StoreError, Txn, WatchEvent};

const CALL_TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Clone)]
pub struct EtcdStore {
    client: Client,
    prefix: String,
}

impl std::fmt::Debug for EtcdStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdStore")
            .field("prefix", &self.prefix)
            .finish()
    }
}

fn unavailable(err: etcd_client::Error) -> StoreError {
    StoreError::Unavailable(err.to_string())
}

async fn deadline<T>(
    future: impl std::future::Future<Output = Result<T, etcd_client::Error>>,
) -> Result<T, StoreError> {
    match tokio::time::timeout(CALL_TIMEOUT, future).await {
        Ok(result) => result.map_err(unavailable),
        Err(_) => Err(StoreError::Unavailable(format!(
            "etcd did not answer within {CALL_TIMEOUT:?}"
        ))),
    }
}

impl EtcdStore {
    /// Connects to the given endpoints (`http://host:port`). Fails if none answers in time.
    pub async fn connect(endpoints: &[String], prefix: &str) -> Result<Self, StoreError> {
        let options = ConnectOptions::new()
            .with_connect_timeout(Duration::from_secs(3))
            .with_timeout(CALL_TIMEOUT)
            .with_keep_alive(Duration::from_secs(5), Duration::from_secs(3));
        let client = tokio::time::timeout(
            Duration::from_secs(10),
            Client::connect(endpoints, Some(options)),
        )
        .await
        .map_err(|_| {
            StoreError::Unavailable(format!("etcd at {} did not answer", endpoints.join(",")))
        })?
        .map_err(unavailable)?;
        let store = Self {
            client,
            prefix: prefix.to_owned(),
        };
        // Fail fast with a clear message when nothing listens there.
        store.get("__probe__").await?;
        Ok(store)
    }

    fn full(&self, key: &str) -> String {
        format!("{}{key}", self.prefix)
    }

    fn strip(&self, key: &[u8]) -> Result<String, StoreError> {
        let key = std::str::from_utf8(key)
            .map_err(|_| StoreError::Corrupt("non-UTF-8 key in etcd".into()))?;
        Ok(key.strip_prefix(&self.prefix).unwrap_or(key).to_owned())
    }

    fn kv(&self, kv: &etcd_client::KeyValue) -> Result<Kv, StoreError> {
        Ok(Kv {
            key: self.strip(kv.key())?,
            value: kv.value().to_vec(),
            mod_revision: kv.mod_revision(),
            lease: kv.lease(),
        })
    }
}

#[async_trait::async_trait]
impl Store for EtcdStore {
    fn kind(&self) -> &'static str {
        "etcd"
    }

    async fn get(&self, key: &str) -> Result<Option<Kv>, StoreError> {
        let mut kv_client = self.client.kv_client();
        let response = deadline(kv_client.get(self.full(key), None)).await?;
        response.kvs().first().map(|kv| self.kv(kv)).transpose()
    }

    async fn list(&self, prefix: &str) -> Result<Vec<Kv>, StoreError> {
        let mut kv_client = self.client.kv_client();
        let response =
            deadline(kv_client.get(self.full(prefix), Some(GetOptions::new().with_prefix())))
                .await?;
        response.kvs().iter().map(|kv| self.kv(kv)).collect()
    }

    async fn commit(&self, txn: Txn) -> Result<Option<Revision>, StoreError> {
        let compares: Vec<EtcdCompare> = txn
            .compares
            .iter()
            .map(|compare| match compare {
                Compare::Absent(key) => EtcdCompare::version(self.full(key), CompareOp::Equal, 0),
                Compare::ModRevision(key, revision) => {
                    EtcdCompare::mod_revision(self.full(key), CompareOp::Equal, *revision)
                }
            })
            .collect();
        let leases: Vec<LeaseId> = txn
            .ops
            .iter()
            .filter_map(|op| match op {
                Op::Put { lease, .. } if *lease != 0 => Some(*lease),
                _ => None,
            })
            .collect();
        let ops: Vec<TxnOp> = txn
            .ops
            .into_iter()
            .map(|op| match op {
                Op::Put { key, value, lease } => {
                    let options = (lease != 0).then(|| PutOptions::new().with_lease(lease));
                    TxnOp::put(self.full(&key), value, options)
                }
                Op::Delete { key } => TxnOp::delete(self.full(&key), None),
                Op::DeletePrefix { prefix } => {
                    TxnOp::delete(self.full(&prefix), Some(DeleteOptions::new().with_prefix()))
                }
            })
            .collect();
        let mut kv_client = self.client.kv_client();
        let request = EtcdTxn::new().when(compares).and_then(ops);
        let response = match tokio::time::timeout(CALL_TIMEOUT, kv_client.txn(request)).await {
            Err(_) => {
                return Err(StoreError::Unavailable(format!(
                    "etcd did not answer within {CALL_TIMEOUT:?}"
                )));
            }
            Ok(Err(etcd_client::Error::GRpcStatus(status)))
                if status.message().contains("lease not found") =>
            {
                return Err(StoreError::LeaseNotFound(
                    leases.first().copied().unwrap_or_default(),
                ));
            }
            Ok(result) => result.map_err(unavailable)?,
        };
        if !response.succeeded() {
            return Ok(None);
        }
        Ok(Some(
            response
                .header()
                .map(|header| header.revision())
                .unwrap_or_default(),
        ))
    }

    async fn grant_lease(&self, ttl_seconds: u32) -> Result<LeaseId, StoreError> {
        let mut lease_client = self.client.lease_client();
        let response = deadline(lease_client.grant(i64::from(ttl_seconds.max(1)), None)).await?;
        Ok(response.id())
    }

    async fn keep_alive(&self, lease: LeaseId) -> Result<bool, StoreError> {
        let renew = async {
            let mut lease_client = self.client.lease_client();
            let (mut keeper, mut responses) = deadline(lease_client.keep_alive(lease)).await?;
            deadline(keeper.keep_alive()).await?;
            let response = deadline(responses.message()).await?;
            Ok(response.is_some_and(|response| response.ttl() > 0))
        };
        match renew.await {
            // etcd answers a lapsed lease with an error rather than a zero TTL.
            Err(StoreError::Unavailable(message)) if message.contains("lease not found") => {
                Ok(false)
            }
            other => other,
        }
    }

    async fn revoke_lease(&self, lease: LeaseId) -> Result<(), StoreError> {
        let mut lease_client = self.client.lease_client();
        match tokio::time::timeout(CALL_TIMEOUT, lease_client.revoke(lease)).await {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(etcd_client::Error::GRpcStatus(status)))
                if status.message().contains("lease not found") =>
            {
                Ok(())
            }
            Ok(Err(err)) => Err(unavailable(err)),
            Err(_) => Err(StoreError::Unavailable("lease revoke timed out".into())),
        }
    }

    async fn list_and_watch(&self, prefix: &str) -> Result<Listing, StoreError> {
        let mut kv_client = self.client.kv_client();
        let response =
            deadline(kv_client.get(self.full(prefix), Some(GetOptions::new().with_prefix())))
                .await?;
        let revision = response
            .header()
            .map(|header| header.revision())
            .unwrap_or_default();
        let kvs = response
            .kvs()
            .iter()
            .map(|kv| self.kv(kv))
            .collect::<Result<_, _>>()?;
        let mut watch_client = self.client.watch_client();
        let stream = deadline(
            watch_client.watch(
                self.full(prefix),
                Some(
                    WatchOptions::new()
                        .with_prefix()
                        .with_start_revision(revision + 1),
                ),
            ),
        )
        .await?;
        let store = self.clone();
        let watch = stream.filter_map(move |response| {
            let store = store.clone();
            async move {
                let response = match response {
                    Ok(response) => response,
                    Err(err) => return Some(Err(StoreError::WatchLost(err.to_string()))),
                };
                if response.canceled() || response.compact_revision() > 0 {
                    return Some(Err(StoreError::WatchLost(format!(
                        "watch cancelled: {} (compacted at {})",
                        response.cancel_reason(),
                        response.compact_revision()
                    ))));
                }
                let events: Result<Vec<WatchEvent>, StoreError> = response
                    .events()
                    .iter()
                    .filter_map(|event| {
                        let kv = event.kv()?;
                        Some(match event.event_type() {
                            EventType::Put => store.kv(kv).map(WatchEvent::Put),
                            EventType::Delete => {
                                store.strip(kv.key()).map(|key| WatchEvent::Delete {
                                    key,
                                    revision: kv.mod_revision(),
                                })
                            }
                        })
                    })
                    .collect();
                match events {
                    Ok(events) if events.is_empty() => None,
                    other => Some(other),
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
