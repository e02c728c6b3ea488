//! The etcd store. Every key lives under a namespace prefix (`--etcd-prefix`, default
//! `/switchyard/v1/`); callers see keys without it. Each call has a deadline, so a dead etcd
//! turns into `StoreError::Unavailable` (gRPC `UNAVAILABLE` at the API) instead of a hang.
//! Every request carries etcd's require-leader flag: a member cut off from its quorum refuses
//! it (and ends its watches) instead of answering from a frozen copy.
//!
//! Each endpoint gets a client of its own and calls go to one member at a time: when that
//! member does not answer (a call fails or times out, its watch breaks or stalls), the store
//! moves on to the next. A balanced channel over all members would keep sending some calls,
//! and the watch, to a member that accepts connections but never answers (a hung process).
//! `https://` endpoints are verified against a given CA (`EtcdTls`), with an optional client
//! certificate for etcd's `--client-cert-auth`; rustls with ring, as tonic uses elsewhere.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use etcd_client::{
    Certificate, Client, Compare as EtcdCompare, CompareOp, ConnectOptions, DeleteOptions,
    EventType, GetOptions, Identity, PutOptions, TlsOptions, Txn as EtcdTxn, TxnOp, WatchOptions,
};
use futures::StreamExt;
use tokio::io::AsyncReadExt;
use tokio_rustls::rustls;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};

use super::{
    Compare, Kv, LeaseId, Listing, Op, Revision, Store, StoreError, Txn, WatchControl, WatchEvent,
    WatchItem,
};

const CALL_TIMEOUT: Duration = Duration::from_secs(5);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);

/// TLS to etcd (`https://` endpoints): the CA that etcd's server certificates must chain to,
/// and for etcd's `--client-cert-auth` a client certificate chain and its key, all PEM.
/// Only this CA is trusted: neither the system's roots nor any others.
#[derive(Clone)]
pub struct EtcdTls {
    ca: Vec<u8>,
    /// (certificate chain, private key)
    client: Option<(Vec<u8>, Vec<u8>)>,
}

/// The part of an `EtcdTls` that does not parse.
#[derive(Debug, thiserror::Error)]
pub enum EtcdTlsError {
    #[error("{0}")]
    Ca(String),
    #[error("{0}")]
    Cert(String),
    #[error("{0}")]
    Key(String),
    /// The key is not the certificate's, or the provider cannot use it.
    #[error("{0}")]
    Pair(String),
}

impl std::fmt::Debug for EtcdTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdTls")
            .field("ca", &format_args!("{} bytes", self.ca.len()))
            .field("client", &self.client.is_some())
            .finish()
    }
}

impl EtcdTls {
    /// Checks the PEM as a connection would read it, without connecting: `ca` holds at least
    /// one certificate, and the client key (if any) is its certificate's.
    pub fn new(ca: Vec<u8>, client: Option<(Vec<u8>, Vec<u8>)>) -> Result<Self, EtcdTlsError> {
        let tls = Self { ca, client };
        tls.rustls_config()?;
        Ok(tls)
    }

    /// For etcd-client (tonic's TLS over the same rustls and ring).
    fn options(&self) -> TlsOptions {
        let options = TlsOptions::new().ca_certificate(Certificate::from_pem(&self.ca));
        match &self.client {
            Some((cert, key)) => options.identity(Identity::from_pem(cert, key)),
            None => options,
        }
    }

    /// The same configuration for a direct handshake (`tls_problem`). The ring provider is
    /// named here rather than taken from the process default, which nothing installs.
    fn rustls_config(&self) -> Result<rustls::ClientConfig, EtcdTlsError> {
        let mut roots = rustls::RootCertStore::empty();
        let ca = certificates(&self.ca).map_err(|err| EtcdTlsError::Ca(err.to_string()))?;
        for certificate in ca {
            roots
                .add(certificate)
                .map_err(|err| EtcdTlsError::Ca(format!("not a CA certificate: {err}")))?;
        }
        let builder = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .map_err(|err| EtcdTlsError::Ca(err.to_string()))?
        .with_root_certificates(roots);
        let mut config = match &self.client {
            None => builder.with_no_client_auth(),
            Some((cert, key)) => {
                let chain =
                    certificates(cert).map_err(|err| EtcdTlsError::Cert(err.to_string()))?;
                let key = PrivateKeyDer::from_pem_slice(key)
                    .map_err(|err| EtcdTlsError::Key(format!("no PEM private key in it: {err}")))?;
                builder.with_client_auth_cert(chain, key).map_err(|err| {
                    EtcdTlsError::Pair(format!("the key does not fit the certificate: {err}"))
                })?
            }
        };
        config.alpn_protocols = vec![b"h2".to_vec()];
        Ok(config)
    }
}

/// Why PEM text does not give a certificate chain.
#[derive(Debug, thiserror::Error)]
enum PemError {
    #[error("bad PEM: {0}")]
    Unreadable(rustls::pki_types::pem::Error),
    #[error("no PEM certificate in it")]
    NoCertificate,
}

/// The certificates of `pem`, in order: at least one.
fn certificates(pem: &[u8]) -> Result<Vec<CertificateDer<'static>>, PemError> {
    let certificates = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(PemError::Unreadable)?;
    if certificates.is_empty() {
        return Err(PemError::NoCertificate);
    }
    Ok(certificates)
}

/// Why TLS to `endpoint` fails, if it does, by a handshake of its own: the gRPC stack can lose
/// the reason. A TLS 1.3 server refuses a client certificate (or its absence) after the
/// client's side of the handshake is done, and its alert may reach hyper as a bare
/// "connection closed". `None` when TCP does not connect (not a TLS problem) or TLS works.
async fn tls_problem(endpoint: &str, tls: &EtcdTls) -> Option<String> {
    let uri: http::Uri = endpoint.parse().ok()?;
    let host = uri.host()?.trim_start_matches('[').trim_end_matches(']');
    let server_name = ServerName::try_from(host.to_owned()).ok()?;
    let port = uri.port_u16().unwrap_or(443);
    let config = tls.rustls_config().ok()?;
    let tcp = tokio::time::timeout(
        CONNECT_TIMEOUT,
        tokio::net::TcpStream::connect((host, port)),
    )
    .await
    .ok()?
    .ok()?;
    let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
    let handshake = tokio::time::timeout(CONNECT_TIMEOUT, connector.connect(server_name, tcp));
    let mut stream = match handshake.await {
        Err(_) => return Some(format!("no TLS handshake within {CONNECT_TIMEOUT:?}")),
        Ok(Err(err)) => return Some(explain_tls_error(&err.to_string(), tls)),
        Ok(Ok(stream)) => stream,
    };
    // A refusal comes as an alert right away; a willing server sends its HTTP/2 settings.
    let mut first = [0u8; 1];
    match tokio::time::timeout(Duration::from_secs(2), stream.read(&mut first)).await {
        Ok(Err(err)) => Some(explain_tls_error(&err.to_string(), tls)),
        _ => None,
    }
}

/// rustls' words, and what they most likely mean here.
fn explain_tls_error(error: &str, tls: &EtcdTls) -> String {
    let meaning = if error.contains("invalid peer certificate") {
        "etcd's server certificate does not verify against the given CA"
    } else if error.contains("alert") && tls.client.is_none() {
        "etcd refused the connection: no client certificate was presented, and etcd with --client-cert-auth requires one"
    } else if error.contains("alert") {
        "etcd refused the client certificate: is it signed by a CA in etcd's --trusted-ca-file?"
    } else {
        return format!("TLS: {error}");
    };
    format!("TLS: {error} ({meaning})")
}

/// An error and its sources, `: `-separated (tonic's transport errors say only "transport
/// error" themselves; the TLS alert or certificate problem is in a source).
fn error_chain(err: &(dyn std::error::Error + 'static)) -> String {
    let mut message = err.to_string();
    let mut source = err.source();
    while let Some(cause) = source {
        let text = cause.to_string();
        if !message.contains(&text) {
            message.push_str(": ");
            message.push_str(&text);
        }
        source = cause.source();
    }
    message
}

/// One client per etcd member, and the member in use.
struct Members {
    urls: Vec<String>,
    clients: Vec<Client>,
    current: AtomicUsize,
}

#[derive(Clone)]
pub struct EtcdStore {
    members: Arc<Members>,
    prefix: String,
}

impl std::fmt::Debug for EtcdStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdStore")
            .field("members", &self.members.urls)
            .field("prefix", &self.prefix)
            .finish()
    }
}

fn unavailable(err: etcd_client::Error) -> StoreError {
    StoreError::Unavailable(error_chain(&err))
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
    /// Connects to the given endpoints (`http://host:port`; `https://` with `tls`). Fails, naming
    /// the endpoints, if none answers in time or TLS fails (an untrusted server certificate, a
    /// client certificate etcd refuses).
    pub async fn connect(
        endpoints: &[String],
        prefix: &str,
        tls: Option<&EtcdTls>,
    ) -> Result<Self, StoreError> {
        let mut options = ConnectOptions::new()
            .with_connect_timeout(CONNECT_TIMEOUT)
            .with_timeout(CALL_TIMEOUT)
            .with_keep_alive(Duration::from_secs(2), Duration::from_secs(2))
            .with_keep_alive_while_idle(true)
            .with_require_leader(true);
        if let Some(tls) = tls {
            options = options.with_tls(tls.options());
        }
        let at = endpoints.join(",");
        let failed = |message: &str| StoreError::Unavailable(format!("etcd at {at}: {message}"));
        let mut clients = Vec::with_capacity(endpoints.len());
        for endpoint in endpoints {
            let client = tokio::time::timeout(
                Duration::from_secs(10),
                Client::connect([endpoint], Some(options.clone())),
            )
            .await
            .map_err(|_| failed("did not answer"))?
            .map_err(|err| failed(&error_chain(&err)))?;
            clients.push(client);
        }
        let store = Self {
            members: Arc::new(Members {
                urls: endpoints.to_vec(),
                clients,
                current: AtomicUsize::new(0),
            }),
            prefix: prefix.to_owned(),
        };
        // Fail fast with a clear message when nothing listens there, or TLS fails; start on
        // the first member that answers.
        let mut message = String::new();
        for _ in endpoints {
            match store.get("__probe__").await {
                Ok(_) => return Ok(store),
                Err(StoreError::Unavailable(problem)) => message = problem,
                Err(err) => return Err(err),
            }
        }
        if let Some(tls) = tls {
            let problems = futures::future::join_all(
                endpoints
                    .iter()
                    .map(|endpoint| async move { (endpoint, tls_problem(endpoint, tls).await) }),
            )
            .await;
            if let Some((endpoint, Some(problem))) =
                problems.into_iter().find(|(_, problem)| problem.is_some())
            {
                return Err(StoreError::Unavailable(format!(
                    "etcd at {endpoint}: {problem}"
                )));
            }
        }
        Err(failed(&message))
    }

    /// The member in use: its index and client.
    fn member(&self) -> (usize, Client) {
        let members = &self.members;
        let index = members.current.load(Ordering::Relaxed) % members.clients.len();
        (index, members.clients[index].clone())
    }

    /// Moves to the next member if `index` is still the one in use (it did not answer).
    fn move_on(&self, index: usize) {
        let members = &self.members;
        let count = members.clients.len();
        if count < 2 {
            return;
        }
        let next = (index + 1) % count;
        if members
            .current
            .compare_exchange(index, next, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
        {
            tracing::warn!(
                member = %members.urls[index],
                next = %members.urls[next],
                "etcd member does not answer; using the next one"
            );
        }
    }

    /// Passes a call's result on, moving to the next member if this one did not answer.
    fn checked<T>(&self, index: usize, result: Result<T, StoreError>) -> Result<T, StoreError> {
        if matches!(result, Err(StoreError::Unavailable(_))) {
            self.move_on(index);
        }
        result
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
        let (index, client) = self.member();
        let mut kv_client = client.kv_client();
        let response = deadline(kv_client.get(self.full(key), None)).await;
        let response = self.checked(index, response)?;
        response.kvs().first().map(|kv| self.kv(kv)).transpose()
    }

    async fn list(&self, prefix: &str) -> Result<Vec<Kv>, StoreError> {
        let (index, client) = self.member();
        let mut kv_client = client.kv_client();
        let response =
            deadline(kv_client.get(self.full(prefix), Some(GetOptions::new().with_prefix()))).await;
        let response = self.checked(index, response)?;
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
        let (index, client) = self.member();
        let mut kv_client = client.kv_client();
        let request = EtcdTxn::new().when(compares).and_then(ops);
        let response = match tokio::time::timeout(CALL_TIMEOUT, kv_client.txn(request)).await {
            Err(_) => {
                self.move_on(index);
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
            Ok(result) => self.checked(index, result.map_err(unavailable))?,
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
        let (index, client) = self.member();
        let mut lease_client = client.lease_client();
        let response = deadline(lease_client.grant(i64::from(ttl_seconds.max(1)), None)).await;
        Ok(self.checked(index, response)?.id())
    }

    async fn keep_alive(&self, lease: LeaseId) -> Result<bool, StoreError> {
        let (index, client) = self.member();
        let renew = async {
            let mut lease_client = client.lease_client();
            let (mut keeper, mut responses) = deadline(lease_client.keep_alive(lease)).await?;
            deadline(keeper.keep_alive()).await?;
            let response = deadline(responses.message()).await?;
            Ok(response.is_some_and(|response| response.ttl() > 0))
        };
        let renewed = match renew.await {
            // etcd answers a lapsed lease with an error rather than a zero TTL.
            Err(StoreError::Unavailable(message)) if message.contains("lease not found") => {
                Ok(false)
            }
            other => other,
        };
        self.checked(index, renewed)
    }

    async fn revoke_lease(&self, lease: LeaseId) -> Result<(), StoreError> {
        let (index, client) = self.member();
        let mut lease_client = client.lease_client();
        let revoked = match tokio::time::timeout(CALL_TIMEOUT, lease_client.revoke(lease)).await {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(etcd_client::Error::GRpcStatus(status)))
                if status.message().contains("lease not found") =>
            {
                Ok(())
            }
            Ok(Err(err)) => Err(unavailable(err)),
            Err(_) => Err(StoreError::Unavailable("lease revoke timed out".into())),
        };
        self.checked(index, revoked)
    }

    async fn list_and_watch(&self, prefix: &str) -> Result<Listing, StoreError> {
        let (index, client) = self.member();
        let mut kv_client = client.kv_client();
        let response =
            deadline(kv_client.get(self.full(prefix), Some(GetOptions::new().with_prefix()))).await;
        let response = self.checked(index, response)?;
        let revision = response
            .header()
            .map(|header| header.revision())
            .unwrap_or_default();
        let kvs = response
            .kvs()
            .iter()
            .map(|kv| self.kv(kv))
            .collect::<Result<_, _>>()?;
        let mut watch_client = client.watch_client();
        let watch_stream = deadline(
            watch_client.watch(
                self.full(prefix),
                Some(
                    WatchOptions::new()
                        .with_prefix()
                        .with_start_revision(revision + 1),
                ),
            ),
        )
        .await;
        let watch_stream = self.checked(index, watch_stream)?;
        let (requests, stream) = watch_stream.split();
        let store = self.clone();
        let watch = stream.filter_map(move |response| {
            let store = store.clone();
            async move {
                let response = match response {
                    Ok(response) => response,
                    Err(err) => {
                        store.move_on(index);
                        return Some(Err(StoreError::WatchLost(err.to_string())));
                    }
                };
                if response.canceled() && response.compact_revision() == 0 {
                    // Cancelled by the member (no leader, with require-leader): try another.
                    store.move_on(index);
                }
                if response.canceled() || response.compact_revision() > 0 {
                    return Some(Err(StoreError::WatchLost(format!(
                        "watch cancelled: {} (compacted at {})",
                        response.cancel_reason(),
                        response.compact_revision()
                    ))));
                }
                if response.created() {
                    return None;
                }
                if response.events().is_empty() {
                    let revision = response
                        .header()
                        .map(|header| header.revision())
                        .unwrap_or_default();
                    return Some(Ok(WatchItem::Progress(revision)));
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
                    other => Some(other.map(WatchItem::Events)),
                }
            }
        });
        Ok(Listing {
            kvs,
            revision,
            watch: Box::pin(watch),
            control: Box::new(EtcdWatchControl {
                requests,
                store: self.clone(),
                index,
            }),
        })
    }
}

struct EtcdWatchControl {
    requests: etcd_client::WatchRequestSender,
    store: EtcdStore,
    /// The member the watch is on.
    index: usize,
}

#[async_trait::async_trait]
impl WatchControl for EtcdWatchControl {
    async fn request_progress(&mut self) -> Result<(), StoreError> {
        deadline(self.requests.request_progress()).await
    }

    fn stalled(&mut self) {
        self.store.move_on(self.index);
    }
}
