//! A whole local cluster in this process: a control plane on an embedded store (or on etcd),
//! simulated engines registered as instances, and routers following the control plane (in this
//! process, or as `switchyard-router` processes). Used by `switchyard up`, the benchmarks and
//! the tests.

pub mod http;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use switchyard_engine_sim::{SimConfig, SimHandle};
use switchyard_proto::v1 as pb;
use switchyard_proto::v1::admin_client::AdminClient;
use switchyard_shared::{
    EndpointConfig, EndpointConfigName, HealthCheckConfig, InstanceRole, sagemaker,
};

/// What to start.
#[derive(Debug, Clone)]
pub struct ClusterSpec {
    /// Simulated engines, registered as instances `engine-0` … `engine-{N-1}`.
    pub engines: usize,
    /// Routers following the control plane.
    pub routers: usize,
    /// Endpoint name; its config is `{endpoint}-config`.
    pub endpoint: String,
    /// SageMaker ProductionVariants JSON of the endpoint config. Engines join its first
    /// variant; the engines serve the model name `sim.served_model_name`, so the variant's
    /// `ModelName` should be that (the router rewrites `model` to it).
    pub variants_json: String,
    pub sim: SimConfig,
    /// Embedded store directory; `None`: a temporary directory removed at shutdown. Only for
    /// the embedded store ([`ClusterTuning::store`]).
    pub data_dir: Option<PathBuf>,
    pub control_listen: SocketAddr,
    /// One address per router; empty: `127.0.0.1:0` for each.
    pub router_listen: Vec<SocketAddr>,
    /// OTLP/gRPC collector for the routers' and the control plane's traces.
    pub otlp_endpoint: Option<String>,
    /// Disaggregated prefill/decode; `None`: every engine joins the first variant.
    pub disaggregation: Option<ClusterDisaggregation>,
}

/// A disaggregated endpoint: the config's `--disaggregation-config` JSON, and how many of the
/// engines prefill. Engines `engine-0` … `engine-{prefill_engines-1}` run with role prefill and
/// join the config's prefill variant; the rest run with role decode and join its decode
/// variant. The variants JSON must declare both variants.
#[derive(Debug, Clone)]
pub struct ClusterDisaggregation {
    pub config_json: String,
    pub prefill_engines: usize,
}

impl Default for ClusterSpec {
    fn default() -> Self {
        Self {
            engines: 4,
            routers: 1,
            endpoint: "chat".into(),
            variants_json: variants_json("PREFIX_AWARE", Some((4096, 10))),
            sim: SimConfig::default(),
            data_dir: None,
            control_listen: loopback_any(),
            router_listen: Vec::new(),
            disaggregation: None,
            otlp_endpoint: None,
        }
    }
}

/// Knobs beyond [`ClusterSpec`] that benchmarks and tests change.
#[derive(Debug, Clone)]
pub struct ClusterTuning {
    /// Where the control plane stores the cluster: the embedded store (in
    /// [`ClusterSpec::data_dir`]), as `switchyard up` and the benchmarks run, or etcd, as the
    /// tests run.
    pub store: ClusterStore,
    /// The endpoint config's health checks (default: [`HealthCheckConfig::default`] with a
    /// 2 s timeout).
    pub health_check: HealthCheckConfig,
    /// Serving threads of each router in this process.
    pub router_worker_threads: usize,
    /// How often routers report their in-flight counts and the control plane sends
    /// fleet-wide load (both default to 100 ms). A benchmark on a scaled clock scales it too.
    pub load_interval_ms: u64,
    /// How long to wait for every router to route to every instance.
    pub ready_timeout: Duration,
    /// Run each router as a process of this `switchyard-router` executable (as deployed, and
    /// as peer routers run) instead of inside this process.
    pub router_binary: Option<PathBuf>,
    /// The routers' `--tokenizer-dir` (for variants naming a KvAwareRoutingConfig.Tokenizer).
    pub router_tokenizer_dir: Option<PathBuf>,
    /// The routers' `--tokenize-check-fraction` (None: the router's default).
    pub router_tokenize_check_fraction: Option<f64>,
    /// The routers' `--tokenize-cache-bytes` (None: the router's default; 0: no piece cache).
    pub router_tokenize_cache_bytes: Option<u64>,
    /// The routers' `--decision-time-header` (benchmarks).
    pub router_decision_header: bool,
}

impl Default for ClusterTuning {
    fn default() -> Self {
        Self {
            store: ClusterStore::Embedded,
            health_check: HealthCheckConfig {
                timeout_ms: 2000,
                ..HealthCheckConfig::default()
            },
            router_worker_threads: 1,
            load_interval_ms: 100,
            ready_timeout: Duration::from_secs(30),
            router_binary: None,
            router_tokenizer_dir: None,
            router_tokenize_check_fraction: None,
            router_tokenize_cache_bytes: None,
            router_decision_header: false,
        }
    }
}

/// The control plane's store.
#[derive(Debug, Clone, Default)]
pub enum ClusterStore {
    /// The embedded store, in [`ClusterSpec::data_dir`].
    #[default]
    Embedded,
    /// etcd at `endpoints` (`http://HOST:PORT`), keys under `prefix` (`/…/`).
    Etcd {
        endpoints: Vec<String>,
        prefix: String,
    },
}

/// `127.0.0.1:0`.
pub fn loopback_any() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 0))
}

/// A ProductionVariants JSON of one variant `AllTraffic` serving model `sim` with `strategy`
/// (`RANDOM`, `LEAST_OUTSTANDING_REQUESTS`, `PREFIX_AWARE`, `KV_AWARE`) and, for `PREFIX_AWARE`,
/// (PrefixLength, ConcurrencyThreshold).
pub fn variants_json(strategy: &str, prefix: Option<(u32, u32)>) -> String {
    let mut routing = serde_json::json!({ "RoutingStrategy": strategy });
    if let Some((length, threshold)) = prefix {
        routing["PrefixAwareRoutingConfig"] = serde_json::json!({
            "PrefixLength": length,
            "ConcurrencyThreshold": threshold,
        });
    }
    serde_json::json!([{
        "VariantName": "AllTraffic",
        "ModelName": "sim",
        "InitialInstanceCount": 1,
        "RoutingConfig": routing,
    }])
    .to_string()
}

/// A ProductionVariants JSON like [`variants_json`] for KV_AWARE with ConcurrencyThreshold
/// `threshold` (LoadWeight at its default).
pub fn kv_aware_variants_json(threshold: u32) -> String {
    kv_aware_variants_json_with(threshold, None)
}

/// [`kv_aware_variants_json`] with a KvAwareRoutingConfig.Tokenizer (token ids computed in the
/// routers, from the folder of that name under their `--tokenizer-dir`).
pub fn kv_aware_variants_json_with(threshold: u32, tokenizer: Option<&str>) -> String {
    let mut knobs = serde_json::json!({"ConcurrencyThreshold": threshold});
    if let Some(tokenizer) = tokenizer {
        knobs["Tokenizer"] = serde_json::json!(tokenizer);
    }
    serde_json::json!([{
        "VariantName": "AllTraffic",
        "ModelName": "sim",
        "InitialInstanceCount": 1,
        "RoutingConfig": {
            "RoutingStrategy": "KV_AWARE",
            "KvAwareRoutingConfig": knobs,
        },
    }])
    .to_string()
}

/// A ProductionVariants JSON like [`variants_json`] for PREFIX_AWARE with `config` (which may
/// carry Switchyard's bounded-load extension).
pub fn prefix_aware_variants_json(config: &switchyard_shared::PrefixAwareRoutingConfig) -> String {
    serde_json::json!([{
        "VariantName": "AllTraffic",
        "ModelName": "sim",
        "InitialInstanceCount": 1,
        "RoutingConfig": {
            "RoutingStrategy": "PREFIX_AWARE",
            "PrefixAwareRoutingConfig": config,
        },
    }])
    .to_string()
}

fn tolerate_existing<T>(
    result: Result<tonic::Response<T>, tonic::Status>,
    call: &str,
    name: &str,
) -> anyhow::Result<()> {
    match result {
        Ok(_) => Ok(()),
        Err(status) if status.code() == tonic::Code::AlreadyExists => {
            tracing::info!(%name, "{call}: already stored, keeping it");
            Ok(())
        }
        Err(status) => Err(anyhow::anyhow!("{call} {name}: {}", status.message())),
    }
}

/// A running local cluster. Shut it down with [`LocalCluster::shutdown`]; dropping it stops
/// everything abruptly (engines killed, routers and control plane told to stop, not awaited).
pub struct LocalCluster {
    /// `http://127.0.0.1:PORT` of the control plane's gRPC API.
    pub control_plane_url: String,
    pub router_urls: Vec<String>,
    pub engine_urls: Vec<String>,
    pub endpoint: String,
    control_plane: Option<switchyard_control::ControlPlane>,
    routers: Vec<switchyard_router::RouterHandle>,
    /// Routers running as processes (`ClusterTuning::router_binary`), killed on drop.
    router_processes: Vec<tokio::process::Child>,
    engines: Vec<SimHandle>,
    _temp_dir: Option<tempfile::TempDir>,
}

impl std::fmt::Debug for LocalCluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalCluster")
            .field("control_plane_url", &self.control_plane_url)
            .field("router_urls", &self.router_urls)
            .field("engine_urls", &self.engine_urls)
            .field("endpoint", &self.endpoint)
            .finish()
    }
}

impl Drop for LocalCluster {
    fn drop(&mut self) {
        for router in &self.routers {
            router.shutdown_token().cancel();
        }
        if let Some(control_plane) = &self.control_plane {
            control_plane.shutdown_token().cancel();
        }
        // SimHandle's own Drop kills the engines.
    }
}

impl LocalCluster {
    /// Starts everything with default tuning; returns once every router routes to every
    /// instance.
    /// `http://ADDR/metrics` of the control plane (Prometheus).
    pub fn control_metrics_url(&self) -> Option<String> {
        self.control_plane
            .as_ref()
            .map(|control_plane| format!("http://{}/metrics", control_plane.metrics_addr))
    }

    pub async fn start(spec: ClusterSpec) -> anyhow::Result<Self> {
        Self::start_with(spec, ClusterTuning::default()).await
    }

    /// Starts everything; on failure, stops what had started.
    pub async fn start_with(spec: ClusterSpec, tuning: ClusterTuning) -> anyhow::Result<Self> {
        if spec.engines == 0 {
            bail!("a cluster needs at least one engine");
        }
        if !spec.router_listen.is_empty() && spec.router_listen.len() != spec.routers {
            bail!(
                "{} router addresses given for {} routers",
                spec.router_listen.len(),
                spec.routers
            );
        }
        let (mut control, temp_dir) = match (&tuning.store, &spec.data_dir) {
            (ClusterStore::Embedded, Some(dir)) => (
                switchyard_control::ControlConfig::embedded(spec.control_listen, dir.clone()),
                None,
            ),
            (ClusterStore::Embedded, None) => {
                let temp = tempfile::Builder::new()
                    .prefix("switchyard-cluster-")
                    .tempdir()
                    .context("cannot create a temporary directory for the embedded store")?;
                let control = switchyard_control::ControlConfig::embedded(
                    spec.control_listen,
                    temp.path().to_path_buf(),
                );
                (control, Some(temp))
            }
            (ClusterStore::Etcd { endpoints, prefix }, None) => (
                switchyard_control::ControlConfig::etcd(
                    spec.control_listen,
                    endpoints.clone(),
                    prefix,
                ),
                None,
            ),
            (ClusterStore::Etcd { .. }, Some(dir)) => bail!(
                "a data directory ({}) is for the embedded store, not etcd",
                dir.display()
            ),
        };
        control.load_interval_ms = tuning.load_interval_ms;
        control.telemetry.otlp_endpoint = spec.otlp_endpoint.clone();
        control.router_timeout_ms = control.router_timeout_ms.max(tuning.load_interval_ms * 2);
        let settings = control
            .validate()
            .map_err(|err| anyhow::anyhow!("control plane: {err}"))?;
        let control_plane = switchyard_control::ControlPlane::start(settings)
            .await
            .context("cannot start the control plane")?;
        let mut cluster = Self {
            control_plane_url: control_plane.url(),
            router_urls: Vec::new(),
            engine_urls: Vec::new(),
            endpoint: spec.endpoint.clone(),
            control_plane: Some(control_plane),
            routers: Vec::new(),
            router_processes: Vec::new(),
            engines: Vec::new(),
            _temp_dir: temp_dir,
        };
        match cluster.populate(&spec, &tuning).await {
            Ok(()) => Ok(cluster),
            Err(err) => {
                cluster.shutdown().await;
                Err(err)
            }
        }
    }

    async fn populate(&mut self, spec: &ClusterSpec, tuning: &ClusterTuning) -> anyhow::Result<()> {
        let variants = sagemaker::parse_production_variants(&spec.variants_json)
            .map_err(|err| anyhow::anyhow!("variants JSON: {}: {}", err.field, err.message))?
            .variants;
        let variant = variants
            .first()
            .map(|variant| variant.variant_name.to_string())
            .context("the variants JSON has no variant")?;
        let disaggregation = spec
            .disaggregation
            .as_ref()
            .map(|pd| {
                sagemaker::parse_disaggregation_config(&pd.config_json)
                    .map(|config| (config, pd.prefill_engines))
                    .map_err(|err| {
                        anyhow::anyhow!("disaggregation JSON: {}: {}", err.field, err.message)
                    })
            })
            .transpose()?;
        if let Some((_, prefill_engines)) = &disaggregation
            && !(1..spec.engines).contains(prefill_engines)
        {
            bail!(
                "{prefill_engines} prefill engines of {}: a disaggregated cluster needs at least one of each role",
                spec.engines
            );
        }
        let config_name = format!("{}-config", spec.endpoint);
        let config = EndpointConfig {
            endpoint_config_name: EndpointConfigName::new(&config_name)
                .map_err(|err| anyhow::anyhow!("endpoint config name {config_name:?}: {err}"))?,
            production_variants: variants,
            health_check_config: tuning.health_check.clone(),
            creation_time_ms: 0,
            disaggregation_config: disaggregation.as_ref().map(|(config, _)| config.clone()),
        };
        config
            .validate()
            .map_err(|err| anyhow::anyhow!("endpoint config: {}: {}", err.field, err.message))?;

        let mut admin = AdminClient::connect(self.control_plane_url.clone())
            .await
            .context("cannot reach the control plane's admin API")?;
        // A persistent data directory may already hold them (a restarted `switchyard up`):
        // what is stored wins, as after any restart.
        let created = admin
            .create_endpoint_config(pb::CreateEndpointConfigRequest {
                endpoint_config: Some((&config).into()),
            })
            .await;
        tolerate_existing(created, "CreateEndpointConfig", &config_name)?;
        let created = admin
            .create_endpoint(pb::CreateEndpointRequest {
                name: spec.endpoint.clone(),
                endpoint_config_name: config_name,
            })
            .await;
        tolerate_existing(created, "CreateEndpoint", &spec.endpoint)?;
        // Instances `engine-N` of an earlier, larger cluster are gone for good.
        let ours: Vec<String> = (0..spec.engines)
            .map(|index| format!("engine-{index}"))
            .collect();
        let listed = admin
            .list_instances(pb::ListInstancesRequest {
                endpoint_name: spec.endpoint.clone(),
            })
            .await
            .context("ListInstances")?
            .into_inner();
        for stale in listed
            .instances
            .iter()
            .filter(|instance| instance.id.starts_with("engine-") && !ours.contains(&instance.id))
        {
            admin
                .deregister_instance(pb::DeregisterInstanceRequest {
                    endpoint_name: spec.endpoint.clone(),
                    id: stale.id.clone(),
                })
                .await
                .context("DeregisterInstance")?;
        }

        for index in 0..spec.engines {
            let (role, variant) = match &disaggregation {
                None => (InstanceRole::Both, variant.clone()),
                Some((config, prefill_engines)) if index < *prefill_engines => (
                    InstanceRole::Prefill,
                    config.prefill_variant_name.to_string(),
                ),
                Some((config, _)) => (InstanceRole::Decode, config.decode_variant_name.to_string()),
            };
            let mut sim = spec.sim.clone();
            sim.role = role;
            let engine = switchyard_engine_sim::spawn(sim)
                .await
                .context("cannot start a simulated engine")?;
            admin
                .register_instance(pb::RegisterInstanceRequest {
                    endpoint_name: spec.endpoint.clone(),
                    variant_name: variant,
                    role: pb::InstanceRole::from(role) as i32,
                    url: engine.url.clone(),
                    id: format!("engine-{index}"),
                    // Set when the simulators publish KV-cache events (`sim.kv_events`).
                    kv_events_endpoint: engine.kv_events_endpoint().unwrap_or_default(),
                    kv_events_replay_endpoint: engine
                        .kv_events_replay_endpoint()
                        .unwrap_or_default(),
                    ..Default::default()
                })
                .await
                .context("RegisterInstance")?;
            self.engine_urls.push(engine.url.clone());
            self.engines.push(engine);
        }

        if let Some(binary) = &tuning.router_binary {
            return self
                .start_router_processes(binary, spec.routers, tuning)
                .await;
        }
        for index in 0..spec.routers {
            let listen = spec
                .router_listen
                .get(index)
                .copied()
                .unwrap_or_else(loopback_any);
            let mut config = switchyard_router::RouterConfig::with_control_plane(
                listen,
                vec![self.control_plane_url.clone()],
            );
            config.load_report_interval_ms = tuning.load_interval_ms;
            config.router_id = Some(format!("router-{index}"));
            config.worker_threads = Some(tuning.router_worker_threads);
            config.telemetry.otlp_endpoint = spec.otlp_endpoint.clone();
            config.tokenizer_dir = tuning.router_tokenizer_dir.clone();
            if let Some(fraction) = tuning.router_tokenize_check_fraction {
                config.tokenize_check_fraction = fraction;
            }
            if let Some(bytes) = tuning.router_tokenize_cache_bytes {
                config.tokenize_cache_bytes = bytes;
            }
            config.decision_time_header = tuning.router_decision_header;
            let settings = config
                .validate()
                .map_err(|err| anyhow::anyhow!("router: {err}"))?;
            let router = switchyard_router::RouterHandle::start(settings)
                .await
                .with_context(|| format!("cannot start a router on {listen}"))?;
            self.router_urls.push(router.url());
            self.routers.push(router);
        }
        self.wait_routable(tuning.ready_timeout).await
    }

    /// Starts `count` router processes following the control plane, and waits until each
    /// lists every engine in its /metrics.
    async fn start_router_processes(
        &mut self,
        binary: &std::path::Path,
        count: usize,
        tuning: &ClusterTuning,
    ) -> anyhow::Result<()> {
        let client = http::http_client();
        for index in 0..count {
            let port = std::net::TcpListener::bind("127.0.0.1:0")?
                .local_addr()?
                .port();
            let tokenizer_dir = tuning
                .router_tokenizer_dir
                .iter()
                .flat_map(|dir| [std::ffi::OsStr::new("--tokenizer-dir"), dir.as_os_str()]);
            let mut tokenize = Vec::new();
            if let Some(fraction) = tuning.router_tokenize_check_fraction {
                tokenize.extend(["--tokenize-check-fraction".to_owned(), fraction.to_string()]);
            }
            if let Some(bytes) = tuning.router_tokenize_cache_bytes {
                tokenize.extend(["--tokenize-cache-bytes".to_owned(), bytes.to_string()]);
            }
            if tuning.router_decision_header {
                tokenize.push("--decision-time-header".to_owned());
            }
            let child = tokio::process::Command::new(binary)
                .args(tokenizer_dir)
                .args(tokenize)
                .args(["--listen", &format!("127.0.0.1:{port}")])
                .args(["--control-plane", &self.control_plane_url])
                .args(["--router-id", &format!("router-{index}")])
                .args([
                    "--load-report-interval-ms",
                    &tuning.load_interval_ms.to_string(),
                ])
                .env("RUST_LOG", "warn")
                .stdin(std::process::Stdio::null())
                .stdout(std::process::Stdio::null())
                .kill_on_drop(true)
                .spawn()
                .with_context(|| format!("cannot start {}", binary.display()))?;
            self.router_processes.push(child);
            self.router_urls.push(format!("http://127.0.0.1:{port}"));
        }
        let deadline = Instant::now() + tuning.ready_timeout;
        let needle = format!(
            "switchyard_router_fleet_in_flight{{endpoint=\"{}\"",
            self.endpoint
        );
        for url in &self.router_urls {
            loop {
                let metrics = http::get_text(&client, &format!("{url}/metrics")).await;
                let listed = metrics.map_or(0, |text| {
                    text.lines()
                        .filter(|line| line.starts_with(&needle))
                        .count()
                });
                if listed == self.engines.len() {
                    break;
                }
                if Instant::now() >= deadline {
                    bail!(
                        "router {url} lists {listed} of {} instances after {:?}",
                        self.engines.len(),
                        tuning.ready_timeout
                    );
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        Ok(())
    }

    /// Instances each router routes to now (healthy or not yet probed), per router (routers
    /// in this process only).
    pub fn routable_instances(&self) -> Vec<usize> {
        self.routers
            .iter()
            .map(|router| {
                router
                    .table()
                    .endpoints
                    .get(self.endpoint.as_str())
                    .map_or(0, |endpoint| {
                        endpoint
                            .variants
                            .iter()
                            .map(|variant| variant.instances.len())
                            .sum()
                    })
            })
            .collect()
    }

    /// Waits until every router routes to every engine.
    pub async fn wait_routable(&self, timeout: Duration) -> anyhow::Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            let routable = self.routable_instances();
            if routable.iter().all(|&count| count == self.engines.len()) {
                return Ok(());
            }
            if Instant::now() >= deadline {
                bail!(
                    "routers still see {routable:?} of {} instances after {timeout:?}",
                    self.engines.len()
                );
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Requests in flight in the routers in this process (0 once every answer is complete).
    pub fn in_flight(&self) -> u32 {
        self.routers.iter().map(|router| router.in_flight()).sum()
    }

    /// The process ids of routers running as processes ([`ClusterTuning::router_binary`]).
    pub fn router_pids(&self) -> Vec<u32> {
        self.router_processes
            .iter()
            .filter_map(tokio::process::Child::id)
            .collect()
    }

    pub fn engines(&self) -> &[SimHandle] {
        &self.engines
    }

    pub fn routers(&self) -> &[switchyard_router::RouterHandle] {
        &self.routers
    }

    /// Takes router `index` (in this process) out of the cluster, to stop it alone.
    pub fn take_router(&mut self, index: usize) -> switchyard_router::RouterHandle {
        self.router_urls.remove(index);
        self.routers.remove(index)
    }

    pub fn control_plane(&self) -> Option<&switchyard_control::ControlPlane> {
        self.control_plane.as_ref()
    }

    /// Instance ids, in engine order.
    pub fn instance_ids(&self) -> Vec<String> {
        (0..self.engines.len())
            .map(|index| format!("engine-{index}"))
            .collect()
    }

    /// Stops the routers (draining), then the engines, then the control plane.
    pub async fn shutdown(mut self) {
        for router in self.routers.drain(..) {
            router.shutdown().await;
        }
        for mut process in self.router_processes.drain(..) {
            let _ = process.kill().await;
        }
        for engine in self.engines.drain(..) {
            engine.shutdown().await;
        }
        if let Some(control_plane) = self.control_plane.take()
            && let Err(err) = control_plane.shutdown().await
        {
            tracing::warn!(error = %err, "control plane stopped with an error");
        }
    }
}
