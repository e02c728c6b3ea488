//! Switchyard's control plane: the admin gRPC API (SageMaker-shaped endpoint configs and
//! endpoints, instance membership), state in etcd or an embedded store, health checks on the
//! elected leader, and the `RouterSync` stream that keeps every router current and carries
//! fleet-wide load.
//!
//! Code map: `store` (the storage trait, etcd and embedded), `keys` (key layout), `registry`
//! (admin operations as store transactions), `admin` (the gRPC edge and auth), `state` (the
//! watched view and change broadcast), `sync` (router streams), `load` (fleet-wide load),
//! `leader` (election), `health` (probing), `sagemaker_api` (the SageMaker-compatible HTTP
//! API over the same registry) with `sigv4` (its signature check), `metrics` (the control
//! plane's counters) and `observe` (their Prometheus page, admin RPC and store spans).

pub mod admin;
pub mod health;
pub mod keys;
pub mod leader;
pub mod load;
pub mod metrics;
pub mod observe;
pub mod registry;
pub mod sagemaker_api;
pub mod sigv4;
pub mod state;
pub mod store;
pub mod sync;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use switchyard_proto::v1 as pb;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::store::etcd::{EtcdTls, EtcdTlsError};
use crate::store::{Store, StoreError};

/// The largest admin request accepted: an `ImportInstances` of a few hundred thousand
/// instances.
pub const MAX_ADMIN_REQUEST_BYTES: usize = 64 * 1024 * 1024;

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum StoreKind {
    /// Single node, persisted under --data-dir.
    Embedded,
    /// etcd at --etcd-endpoints; several control-plane replicas may share it.
    Etcd,
}

/// Command-line configuration of `switchyard-control`.
#[derive(Debug, Clone, clap::Args)]
pub struct ControlConfig {
    /// Address the gRPC API listens on.
    #[arg(long, default_value = "127.0.0.1:50051")]
    pub listen: SocketAddr,
    /// Where state is kept.
    #[arg(long, value_enum, default_value_t = StoreKind::Embedded)]
    pub store: StoreKind,
    /// Directory of the embedded store (created if missing).
    #[arg(long, default_value = "switchyard-data")]
    pub data_dir: PathBuf,
    /// etcd client URLs, comma-separated (with --store etcd): all http://HOST:PORT, or all
    /// https://HOST:PORT with --etcd-ca.
    #[arg(long, value_delimiter = ',')]
    pub etcd_endpoints: Vec<String>,
    /// Key prefix in etcd; several Switchyard clusters can share one etcd with different prefixes.
    #[arg(long, default_value = "/switchyard/v1/")]
    pub etcd_prefix: String,
    /// PEM CA certificate(s) etcd's server certificate must chain to (https:// endpoints; no
    /// other roots are trusted).
    #[arg(long, value_name = "FILE")]
    pub etcd_ca: Option<PathBuf>,
    /// PEM client certificate chain presented to etcd, for its --client-cert-auth (with
    /// --etcd-key and https:// endpoints).
    #[arg(long, value_name = "FILE", requires = "etcd_key")]
    pub etcd_cert: Option<PathBuf>,
    /// PEM private key of --etcd-cert.
    #[arg(long, value_name = "FILE", requires = "etcd_cert")]
    pub etcd_key: Option<PathBuf>,
    /// File holding the bearer token admin calls must present. Unset: no authentication.
    /// On --sagemaker-api-listen it is the secret access key of SigV4 signatures.
    #[arg(long)]
    pub admin_token_file: Option<PathBuf>,
    /// Also serve the SageMaker-compatible admin API (AWS JSON 1.1, as boto3's `sagemaker`
    /// client and `aws sagemaker --endpoint-url http://ADDR` speak it) on this address, plain
    /// HTTP. Default: off. With --admin-token-file, requests must be SigV4-signed with the
    /// token as the secret access key (any access key id).
    #[arg(long, value_name = "ADDR")]
    pub sagemaker_api_listen: Option<SocketAddr>,
    /// File holding the bearer token routers must present on the RouterSync stream (routers:
    /// --control-plane-token-file). Unset: routers are not authenticated.
    #[arg(long)]
    pub router_token_file: Option<PathBuf>,
    /// PEM certificate chain for TLS on the gRPC server (with --tls-key).
    #[arg(long, requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// PEM private key for TLS on the gRPC server (with --tls-cert).
    #[arg(long, requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// Name of this replica in leader election and load sharing. Default: random.
    #[arg(long)]
    pub replica_id: Option<String>,
    /// Leader lease TTL in seconds: a dead leader's duties move on after about this long.
    #[arg(long, default_value_t = 3)]
    pub leader_ttl_seconds: u32,
    /// How often fleet-wide load is recomputed and sent to routers, in milliseconds.
    #[arg(long, default_value_t = 100)]
    pub load_interval_ms: u64,
    /// A router that has not reported load for this long is dropped from the sums (ms).
    #[arg(long, default_value_t = 3000)]
    pub router_timeout_ms: u64,
    /// Seconds to finish in-flight calls on shutdown before closing streams.
    #[arg(long, default_value_t = 10)]
    pub shutdown_grace_seconds: u64,
    /// Batches of changes a router stream may fall behind by before it is sent a fresh
    /// snapshot instead. Not a flag: the default suits every fleet; tests lower it to make a
    /// stream fall behind with few changes.
    #[arg(skip = state::CHANGE_BUFFER)]
    pub change_buffer: usize,
    /// Address of the Prometheus endpoint (GET /metrics, plain HTTP).
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:9464")]
    pub metrics_listen: SocketAddr,
    #[command(flatten)]
    pub telemetry: switchyard_telemetry::TelemetryArgs,
}

impl ControlConfig {
    /// Defaults for an embedded store in `data_dir`, listening on `listen`.
    pub fn embedded(listen: SocketAddr, data_dir: PathBuf) -> Self {
        Self {
            listen,
            store: StoreKind::Embedded,
            data_dir,
            etcd_endpoints: Vec::new(),
            etcd_prefix: "/switchyard/v1/".into(),
            etcd_ca: None,
            etcd_cert: None,
            etcd_key: None,
            admin_token_file: None,
            sagemaker_api_listen: None,
            router_token_file: None,
            tls_cert: None,
            tls_key: None,
            replica_id: None,
            leader_ttl_seconds: 3,
            load_interval_ms: 100,
            router_timeout_ms: 3000,
            shutdown_grace_seconds: 10,
            change_buffer: state::CHANGE_BUFFER,
            // Tests and embedded uses run several control planes: any free port.
            metrics_listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            telemetry: Default::default(),
        }
    }

    /// Defaults for etcd at `endpoints`.
    pub fn etcd(listen: SocketAddr, endpoints: Vec<String>, prefix: &str) -> Self {
        Self {
            store: StoreKind::Etcd,
            etcd_endpoints: endpoints,
            etcd_prefix: prefix.to_owned(),
            ..Self::embedded(listen, PathBuf::new())
        }
    }

    /// Checks the flags and reads the files they name.
    pub fn validate(&self) -> Result<Settings, StartError> {
        let bad = |message: String| Err(StartError::Config(message));
        if self.store == StoreKind::Etcd {
            if self.etcd_endpoints.is_empty() {
                return bad("--store etcd needs --etcd-endpoints http://HOST:PORT[,...]".into());
            }
            for endpoint in &self.etcd_endpoints {
                if !endpoint.starts_with("http://") && !endpoint.starts_with("https://") {
                    return bad(format!(
                        "--etcd-endpoints: {endpoint:?} must start with http:// or https://"
                    ));
                }
            }
            if !self.etcd_prefix.starts_with('/') || !self.etcd_prefix.ends_with('/') {
                return bad(format!(
                    "--etcd-prefix: {:?} must start and end with '/'",
                    self.etcd_prefix
                ));
            }
        } else if self.data_dir.as_os_str().is_empty() {
            return bad("--data-dir must not be empty".into());
        }
        if !(2..=60).contains(&self.leader_ttl_seconds) {
            return bad(format!(
                "--leader-ttl-seconds: {} is outside 2..=60",
                self.leader_ttl_seconds
            ));
        }
        if !(10..=10_000).contains(&self.load_interval_ms) {
            return bad(format!(
                "--load-interval-ms: {} is outside 10..=10000",
                self.load_interval_ms
            ));
        }
        if self.router_timeout_ms < self.load_interval_ms * 2 {
            return bad("--router-timeout-ms must be at least twice --load-interval-ms".into());
        }
        let token = |path: &Option<PathBuf>, flag: &str| {
            path.as_deref()
                .map(|path| switchyard_process::read_token_file(path, flag))
                .transpose()
                .map_err(|err| StartError::Config(err.0))
        };
        let admin_token = token(&self.admin_token_file, "--admin-token-file")?;
        let router_token = token(&self.router_token_file, "--router-token-file")?;
        let etcd_tls = self.etcd_tls()?;
        let tls = match (&self.tls_cert, &self.tls_key) {
            (Some(cert), Some(key)) => Some((
                read_flag_file(cert, "--tls-cert")?,
                read_flag_file(key, "--tls-key")?,
            )),
            _ => None,
        };
        let replica_id = self.replica_id.clone().unwrap_or_else(|| {
            format!(
                "replica-{}-{:06x}",
                std::process::id(),
                fastrand::u32(..0xff_ffff)
            )
        });
        let telemetry = self
            .telemetry
            .validate()
            .map_err(|err| StartError::Config(err.0))?;
        Ok(Settings {
            telemetry,
            config: self.clone(),
            admin_token,
            router_token,
            tls,
            etcd_tls,
            replica_id,
        })
    }

    /// The TLS flags for etcd, checked against the endpoints, with their files read and parsed.
    fn etcd_tls(&self) -> Result<Option<EtcdTls>, StartError> {
        let bad = |message: String| Err(StartError::Config(message));
        let flag = [
            ("--etcd-ca", &self.etcd_ca),
            ("--etcd-cert", &self.etcd_cert),
            ("--etcd-key", &self.etcd_key),
        ]
        .into_iter()
        .find_map(|(flag, path)| path.is_some().then_some(flag));
        if self.store != StoreKind::Etcd {
            return match flag {
                Some(flag) => bad(format!(
                    "{flag} is for --store etcd with https:// endpoints"
                )),
                None => Ok(None),
            };
        }
        let https = self
            .etcd_endpoints
            .iter()
            .filter(|endpoint| endpoint.starts_with("https://"))
            .count();
        if https == 0 {
            return match flag {
                Some(flag) => bad(format!(
                    "{flag} is for https:// etcd endpoints; --etcd-endpoints are http://"
                )),
                None => Ok(None),
            };
        }
        if https < self.etcd_endpoints.len() {
            return bad(
                "--etcd-endpoints: http:// and https:// mixed; use one scheme for all".into(),
            );
        }
        let Some(ca_path) = &self.etcd_ca else {
            return bad(
                "--etcd-endpoints are https://: give --etcd-ca, the CA that signed etcd's server certificate"
                    .into(),
            );
        };
        let ca = read_flag_file(ca_path, "--etcd-ca")?;
        let client_paths = match (&self.etcd_cert, &self.etcd_key) {
            (None, None) => None,
            (Some(_), None) => return bad("--etcd-cert needs --etcd-key".into()),
            (None, Some(_)) => return bad("--etcd-key needs --etcd-cert".into()),
            (Some(cert), Some(key)) => Some((cert, key)),
        };
        let client = match client_paths {
            Some((cert, key)) => Some((
                read_flag_file(cert, "--etcd-cert")?,
                read_flag_file(key, "--etcd-key")?,
            )),
            None => None,
        };
        let tls = EtcdTls::new(ca, client).map_err(|err| {
            StartError::Config(match (err, client_paths) {
                (EtcdTlsError::Cert(message), Some((cert, _))) => {
                    format!("--etcd-cert {}: {message}", cert.display())
                }
                (EtcdTlsError::Key(message), Some((_, key))) => {
                    format!("--etcd-key {}: {message}", key.display())
                }
                (EtcdTlsError::Pair(message), Some((cert, key))) => format!(
                    "--etcd-cert {} / --etcd-key {}: {message}",
                    cert.display(),
                    key.display()
                ),
                (err, _) => format!("--etcd-ca {}: {err}", ca_path.display()),
            })
        })?;
        Ok(Some(tls))
    }
}

/// The file a flag names; a usage error naming both when it cannot be read.
fn read_flag_file(path: &Path, flag: &str) -> Result<Vec<u8>, StartError> {
    std::fs::read(path)
        .map_err(|err| StartError::Config(format!("{flag} {}: {err}", path.display())))
}

/// A validated configuration with its files read: nothing left to fail but the network.
#[derive(Clone)]
pub struct Settings {
    pub config: ControlConfig,
    pub admin_token: Option<String>,
    pub router_token: Option<String>,
    /// (certificate PEM, key PEM)
    pub tls: Option<(Vec<u8>, Vec<u8>)>,
    /// TLS to etcd (https:// endpoints).
    pub etcd_tls: Option<EtcdTls>,
    pub replica_id: String,
    /// OpenTelemetry traces, when on (started by the binary, which owns the subscriber).
    pub telemetry: Option<switchyard_telemetry::TelemetrySettings>,
}

impl std::fmt::Debug for Settings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Settings")
            .field("config", &self.config)
            .field("admin_token", &self.admin_token.as_ref().map(|_| "<set>"))
            .field("router_token", &self.router_token.as_ref().map(|_| "<set>"))
            .field("tls", &self.tls.is_some())
            .field("etcd_tls", &self.etcd_tls)
            .field("replica_id", &self.replica_id)
            .finish()
    }
}

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// A bad flag or file: exit 64.
    #[error("{0}")]
    Config(String),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("cannot listen on {addr}: {source}")]
    Listen {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("--metrics-listen: cannot listen on {addr}: {source}")]
    MetricsListen {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("--sagemaker-api-listen: cannot listen on {addr}: {source}")]
    SageMakerListen {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("gRPC server: {0}")]
    Server(String),
}

/// A running control plane.
#[derive(Debug)]
pub struct ControlPlane {
    pub addr: SocketAddr,
    /// Where `GET /metrics` is served (`--metrics-listen`).
    pub metrics_addr: SocketAddr,
    /// Where the SageMaker-compatible API listens (`--sagemaker-api-listen`), if it does.
    pub sagemaker_addr: Option<SocketAddr>,
    pub replica_id: String,
    shutdown: CancellationToken,
    server: JoinHandle<Result<(), StartError>>,
    leading: tokio::sync::watch::Receiver<Option<store::Revision>>,
    cache: Arc<state::StateCache>,
    sync_stats: Arc<sync::SyncStats>,
    /// For closing the store once stopped.
    registry: registry::Registry,
}

impl ControlPlane {
    /// Opens the store, binds the listener and starts serving. Returns once the port accepts.
    pub async fn start(settings: Settings) -> Result<Self, StartError> {
        let config = &settings.config;
        let shutdown = CancellationToken::new();
        let background = CancellationToken::new();
        let store: Arc<dyn Store> = match config.store {
            StoreKind::Embedded => Arc::new(
                store::embedded::EmbeddedStore::open(Some(&config.data_dir), background.clone())
                    .map_err(|err| match err {
                        // Another process holds --data-dir: a usage error (exit 64).
                        StoreError::InUse(message) => StartError::Config(message),
                        other => StartError::Store(other),
                    })?,
            ),
            StoreKind::Etcd => Arc::new(
                store::etcd::EtcdStore::connect(
                    &config.etcd_endpoints,
                    &config.etcd_prefix,
                    settings.etcd_tls.as_ref(),
                )
                .await?,
            ),
        };
        if config.store == StoreKind::Embedded {
            // Single node: a leader key or load sums left by the previous process are stale.
            store
                .commit(
                    store::Txn::new()
                        .delete(keys::LEADER)
                        .delete_prefix(keys::LOAD),
                )
                .await?;
        }
        tracing::info!(store = store.kind(), replica = %settings.replica_id, "store open");
        let metrics = Arc::new(metrics::ControlMetrics::default());
        let store: Arc<dyn Store> = Arc::new(observe::ObservedStore {
            inner: store,
            metrics: Arc::clone(&metrics),
        });
        let metrics_error = |source| StartError::MetricsListen {
            addr: config.metrics_listen,
            source,
        };
        let metrics_listener = tokio::net::TcpListener::bind(config.metrics_listen)
            .await
            .map_err(metrics_error)?;
        let metrics_addr = metrics_listener.local_addr().map_err(metrics_error)?;
        let listener = tokio::net::TcpListener::bind(config.listen)
            .await
            .map_err(|source| StartError::Listen {
                addr: config.listen,
                source,
            })?;
        let addr = listener.local_addr().map_err(|source| StartError::Listen {
            addr: config.listen,
            source,
        })?;

        let sagemaker_listener = match config.sagemaker_api_listen {
            Some(addr) => Some(
                tokio::net::TcpListener::bind(addr)
                    .await
                    .map_err(|source| StartError::SageMakerListen { addr, source })?,
            ),
            None => None,
        };
        let sagemaker_addr = match &sagemaker_listener {
            Some(listener) => {
                Some(
                    listener
                        .local_addr()
                        .map_err(|source| StartError::SageMakerListen {
                            addr: config.listen,
                            source,
                        })?,
                )
            }
            None => None,
        };

        let mut tasks = tokio::task::JoinSet::new();
        let registry = registry::Registry::new(Arc::clone(&store));
        if let Some(listener) = sagemaker_listener {
            let api = Arc::new(sagemaker_api::SageMakerApi::new(
                registry.clone(),
                settings.admin_token.clone(),
            ));
            tasks.spawn(api.serve(listener, shutdown.clone()));
        }
        let closer = registry.clone();
        let cache = state::StateCache::new(config.change_buffer);
        tasks.spawn(Arc::clone(&cache).run(Arc::clone(&store), background.clone()));
        let hub = load::LoadHub::new(
            settings.replica_id.clone(),
            load::LoadConfig {
                interval: Duration::from_millis(config.load_interval_ms),
                router_timeout: Duration::from_millis(config.router_timeout_ms),
            },
        );
        tasks.spawn(Arc::clone(&hub).run(background.clone()));
        if config.store == StoreKind::Etcd {
            // Other replicas may share this etcd: exchange load sums with them.
            tasks.spawn(Arc::clone(&hub).publish(Arc::clone(&store), background.clone()));
            tasks.spawn(Arc::clone(&hub).follow_remote(Arc::clone(&store), background.clone()));
        }
        let leading = leader::spawn(
            Arc::clone(&store),
            leader::ElectionConfig {
                replica_id: settings.replica_id.clone(),
                ttl_seconds: config.leader_ttl_seconds,
            },
            background.clone(),
            &mut tasks,
        );
        tasks.spawn(health::run(
            registry.clone(),
            Arc::clone(&cache),
            leading.clone(),
            Arc::clone(&metrics),
            background.clone(),
        ));

        let (health_reporter, health_service) = tonic_health::server::health_reporter();
        // Serving while the view of the store is current; NOT_SERVING otherwise (and from the
        // start of a shutdown on).
        tasks.spawn(report_readiness(
            health_reporter.clone(),
            cache.readiness(),
            shutdown.clone(),
        ));
        let reflection = tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(pb::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
            .build_v1()
            .map_err(|err| StartError::Server(err.to_string()))?;
        let admin_service = tonic::service::interceptor::InterceptedService::new(
            pb::admin_server::AdminServer::new(admin::AdminService { registry })
                .max_decoding_message_size(MAX_ADMIN_REQUEST_BYTES),
            admin::BearerAuth::new(settings.admin_token.clone()),
        );
        let sync_stats = Arc::new(sync::SyncStats::default());
        let streams_stop = CancellationToken::new();
        let sync_service = pb::router_sync_server::RouterSyncServer::new(sync::SyncService {
            replica_id: settings.replica_id.clone(),
            cache: Arc::clone(&cache),
            load: Arc::clone(&hub),
            shutdown: streams_stop.clone(),
            sessions: Arc::default(),
            stats: Arc::clone(&sync_stats),
            metrics: Arc::clone(&metrics),
        })
        .max_decoding_message_size(switchyard_shared::sync::ROUTER_MAX_MESSAGE_BYTES)
        .max_encoding_message_size(switchyard_shared::sync::SYNC_MAX_MESSAGE_BYTES);
        let sync_service = tonic::service::interceptor::InterceptedService::new(
            sync_service,
            admin::BearerAuth::new(settings.router_token.clone()),
        );

        let mut builder = tonic::transport::Server::builder()
            .http2_keepalive_interval(Some(Duration::from_secs(10)))
            .http2_keepalive_timeout(Some(Duration::from_secs(5)));
        if let Some((cert, key)) = &settings.tls {
            builder = builder
                .tls_config(
                    tonic::transport::ServerTlsConfig::new()
                        .identity(tonic::transport::Identity::from_pem(cert, key)),
                )
                .map_err(|err| StartError::Config(format!("--tls-cert/--tls-key: {err}")))?;
        }
        tasks.spawn(observe::serve_metrics(
            metrics_listener,
            observe::Sources {
                metrics: Arc::clone(&metrics),
                cache: Arc::clone(&cache),
                sync: Arc::clone(&sync_stats),
                leading: leading.clone(),
            },
            shutdown.clone(),
        ));
        let router = builder
            .layer(observe::AdminRpcLayer {
                metrics: Arc::clone(&metrics),
            })
            .add_service(health_service)
            .add_service(reflection)
            .add_service(admin_service)
            .add_service(sync_service);
        let incoming =
            tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
        let grace = Duration::from_secs(config.shutdown_grace_seconds);
        let stop = shutdown.clone();
        let server = tokio::spawn(async move {
            // On shutdown: NOT_SERVING first (health watchers and load balancers hear it while
            // the server still answers), then router streams end (routers move to another
            // replica), then the server stops accepting and drains calls within the grace
            // period (a stream that does not end is cut then), then background duties stop.
            let signal = {
                let stop = stop.clone();
                let reporter = health_reporter.clone();
                async move {
                    stop.cancelled().await;
                    set_all(&reporter, ServingStatus::NotServing).await;
                    streams_stop.cancel();
                }
            };
            let serving = router.serve_with_incoming_shutdown(incoming, signal);
            let served = tokio::select! {
                served = serving => served,
                () = async {
                    stop.cancelled().await;
                    tokio::time::sleep(grace).await;
                } => {
                    tracing::warn!(?grace, "calls outlived the grace period; closing them");
                    Ok(())
                }
            };
            background.cancel();
            let drained = async { while tasks.join_next().await.is_some() {} };
            if tokio::time::timeout(grace, drained).await.is_err() {
                tracing::warn!("background tasks did not stop within the grace period");
            }
            served.map_err(|err| StartError::Server(err.to_string()))
        });
        tracing::info!(%addr, "control plane listening");
        if let Some(sagemaker_addr) = sagemaker_addr {
            tracing::info!(addr = %sagemaker_addr, authenticated = settings.admin_token.is_some(), "SageMaker-compatible API listening");
        }
        tracing::info!(%metrics_addr, "metrics listening");
        Ok(Self {
            addr,
            metrics_addr,
            sagemaker_addr,
            replica_id: settings.replica_id,
            shutdown,
            server,
            leading,
            cache,
            sync_stats,
            registry: closer,
        })
    }

    /// Whether this replica's view of the store is current (it serves routers).
    pub fn is_ready(&self) -> bool {
        self.cache.is_ready()
    }

    /// Resolves when this replica's view of the store is current.
    pub async fn wait_ready(&self) {
        let mut readiness = self.cache.readiness();
        let _ = readiness
            .wait_for(|readiness| *readiness == state::Readiness::Ready)
            .await;
    }

    /// What the router sync streams of this replica did.
    pub fn sync_stats(&self) -> &sync::SyncStats {
        &self.sync_stats
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The SageMaker-compatible API's URL (boto3's `endpoint_url`), if it is served.
    pub fn sagemaker_url(&self) -> Option<String> {
        self.sagemaker_addr.map(|addr| format!("http://{addr}"))
    }

    /// Whether this replica currently runs the singleton duties.
    pub fn is_leader(&self) -> bool {
        self.leading.borrow().is_some()
    }

    /// Resolves when this replica becomes leader.
    pub async fn wait_leader(&self) {
        let mut leading = self.leading.clone();
        let _ = leading.wait_for(Option::is_some).await;
    }

    /// A token that stops the server when cancelled.
    pub fn shutdown_token(&self) -> CancellationToken {
        self.shutdown.clone()
    }

    /// Stops accepting, ends router streams, stops background duties, and waits.
    pub async fn shutdown(self) -> Result<(), StartError> {
        self.shutdown.cancel();
        self.wait().await
    }

    /// Waits until the server stops (after its shutdown token is cancelled), then lets go of
    /// the store (the embedded store's directory lock).
    pub async fn wait(self) -> Result<(), StartError> {
        let result = match self.server.await {
            Ok(result) => result,
            Err(err) => Err(StartError::Server(err.to_string())),
        };
        self.registry.store().close();
        result
    }

    /// Stops abruptly, as a crash would: every task is dropped, the leader lease is not
    /// handed over (tests of fail-over), the embedded store's lock is let go as the exit of
    /// the process would.
    pub fn abort(self) {
        // The background tasks live in a JoinSet owned by the server task: aborting it aborts them.
        self.server.abort();
        self.registry.store().close();
    }
}

use tonic_health::ServingStatus;

/// Sets every service this server reports (and the server as a whole, "") to `status`.
async fn set_all(reporter: &tonic_health::server::HealthReporter, status: ServingStatus) {
    reporter.set_service_status("", status).await;
    reporter
        .set_service_status(
            <pb::admin_server::AdminServer<admin::AdminService> as tonic::server::NamedService>::NAME,
            status,
        )
        .await;
    reporter
        .set_service_status(
            <pb::router_sync_server::RouterSyncServer<sync::SyncService> as tonic::server::NamedService>::NAME,
            status,
        )
        .await;
}

/// Keeps the gRPC health service in step with the view's readiness until shutdown.
async fn report_readiness(
    reporter: tonic_health::server::HealthReporter,
    mut readiness: tokio::sync::watch::Receiver<state::Readiness>,
    shutdown: CancellationToken,
) {
    loop {
        let status = match *readiness.borrow_and_update() {
            state::Readiness::Ready => ServingStatus::Serving,
            _ => ServingStatus::NotServing,
        };
        if shutdown.is_cancelled() {
            return;
        }
        set_all(&reporter, status).await;
        tokio::select! {
            () = shutdown.cancelled() => return,
            changed = readiness.changed() => if changed.is_err() { return },
        }
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;

    const CA: &str = include_str!("../testdata/etcd-ca.pem");
    const CLIENT_CERT: &str = include_str!("../testdata/etcd-client.pem");
    const CLIENT_KEY: &str = include_str!("../testdata/etcd-client.key");
    const OTHER_KEY: &str = include_str!("../testdata/etcd-other.key");

    /// The fixtures written to `dir`: (ca, client cert, client key, other key).
    fn pem_files(dir: &Path) -> (PathBuf, PathBuf, PathBuf, PathBuf) {
        let write = |name: &str, text: &str| {
            let path = dir.join(name);
            std::fs::write(&path, text).unwrap();
            path
        };
        (
            write("ca.pem", CA),
            write("client.pem", CLIENT_CERT),
            write("client.key", CLIENT_KEY),
            write("other.key", OTHER_KEY),
        )
    }

    fn etcd(endpoints: &[&str]) -> ControlConfig {
        ControlConfig::etcd(
            "127.0.0.1:0".parse().unwrap(),
            endpoints
                .iter()
                .map(|endpoint| endpoint.to_string())
                .collect(),
            "/switchyard/v1/",
        )
    }

    /// The usage error `config` is refused with.
    fn refusal(config: &ControlConfig) -> String {
        match config.validate() {
            Err(StartError::Config(message)) => message,
            Err(other) => panic!("not a usage error: {other}"),
            Ok(_) => panic!("accepted: {config:?}"),
        }
    }

    #[test]
    fn http_endpoints_need_no_tls_flags() {
        let settings = etcd(&["http://127.0.0.1:2379", "http://127.0.0.1:2380"])
            .validate()
            .unwrap();
        assert!(settings.etcd_tls.is_none());
        let message = refusal(&etcd(&["ftp://127.0.0.1:2379"]));
        assert!(message.contains("--etcd-endpoints"), "{message}");
    }

    #[test]
    fn https_endpoints_take_a_ca_and_optionally_a_client_certificate() {
        let dir = tempfile::tempdir().unwrap();
        let (ca, cert, key, _) = pem_files(dir.path());
        let mut config = etcd(&["https://127.0.0.1:2379", "https://127.0.0.1:2380"]);
        let message = refusal(&config);
        assert!(
            message.contains("--etcd-ca") && message.contains("https://"),
            "{message}"
        );
        config.etcd_ca = Some(ca);
        let settings = config.validate().unwrap();
        assert!(settings.etcd_tls.is_some());
        config.etcd_cert = Some(cert);
        config.etcd_key = Some(key);
        let settings = config.validate().unwrap();
        assert!(
            format!("{settings:?}").contains("client: true"),
            "{settings:?}"
        );
    }

    #[test]
    fn tls_flags_with_http_endpoints_or_mixed_schemes_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let (ca, cert, key, _) = pem_files(dir.path());
        let mut config = etcd(&["http://127.0.0.1:2379"]);
        config.etcd_ca = Some(ca.clone());
        let message = refusal(&config);
        assert!(
            message.starts_with("--etcd-ca") && message.contains("http://"),
            "{message}"
        );
        config.etcd_ca = None;
        config.etcd_cert = Some(cert);
        config.etcd_key = Some(key);
        assert!(refusal(&config).starts_with("--etcd-cert"));

        let mut mixed = etcd(&["https://127.0.0.1:2379", "http://127.0.0.1:2380"]);
        mixed.etcd_ca = Some(ca.clone());
        let message = refusal(&mixed);
        assert!(
            message.contains("--etcd-endpoints") && message.contains("mixed"),
            "{message}"
        );

        let mut embedded =
            ControlConfig::embedded("127.0.0.1:0".parse().unwrap(), dir.path().into());
        embedded.etcd_ca = Some(ca);
        let message = refusal(&embedded);
        assert!(
            message.contains("--etcd-ca") && message.contains("--store etcd"),
            "{message}"
        );
    }

    #[test]
    fn a_client_certificate_needs_its_key_and_the_other_way_round() {
        let dir = tempfile::tempdir().unwrap();
        let (ca, cert, key, _) = pem_files(dir.path());
        let mut config = etcd(&["https://127.0.0.1:2379"]);
        config.etcd_ca = Some(ca);
        config.etcd_cert = Some(cert);
        assert_eq!(refusal(&config), "--etcd-cert needs --etcd-key");
        config.etcd_cert = None;
        config.etcd_key = Some(key);
        assert_eq!(refusal(&config), "--etcd-key needs --etcd-cert");
    }

    #[test]
    fn unreadable_or_wrong_files_are_named_with_their_flag() {
        let dir = tempfile::tempdir().unwrap();
        let (ca, cert, key, other_key) = pem_files(dir.path());
        let missing = dir.path().join("missing.pem");
        let https = || {
            let mut config = etcd(&["https://127.0.0.1:2379"]);
            config.etcd_ca = Some(ca.clone());
            config.etcd_cert = Some(cert.clone());
            config.etcd_key = Some(key.clone());
            config
        };
        let shown = |path: &Path| path.display().to_string();
        type Flag = fn(&mut ControlConfig) -> &mut Option<PathBuf>;
        let etcd_ca: Flag = |config| &mut config.etcd_ca;
        let etcd_cert: Flag = |config| &mut config.etcd_cert;
        let etcd_key: Flag = |config| &mut config.etcd_key;
        // (the flag, the file it is given, how the refusal starts)
        let cases = [
            (
                etcd_ca,
                &missing,
                format!("--etcd-ca {}: ", shown(&missing)),
            ),
            (
                etcd_cert,
                &missing,
                format!("--etcd-cert {}: ", shown(&missing)),
            ),
            (
                etcd_key,
                &missing,
                format!("--etcd-key {}: ", shown(&missing)),
            ),
            // A key where a certificate belongs, a certificate where the key belongs.
            (
                etcd_ca,
                &key,
                format!("--etcd-ca {}: no PEM certificate", shown(&key)),
            ),
            (
                etcd_cert,
                &key,
                format!("--etcd-cert {}: no PEM certificate", shown(&key)),
            ),
            (
                etcd_key,
                &cert,
                format!("--etcd-key {}: no PEM private key", shown(&cert)),
            ),
            // A key that is not the certificate's.
            (
                etcd_key,
                &other_key,
                format!(
                    "--etcd-cert {} / --etcd-key {}: ",
                    shown(&cert),
                    shown(&other_key)
                ),
            ),
        ];
        for (flag, path, start) in cases {
            let mut config = https();
            *flag(&mut config) = Some(path.clone());
            let message = refusal(&config);
            assert!(message.starts_with(&start), "{message} (wanted {start})");
        }
    }
}
