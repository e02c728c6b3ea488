//! `switchyard-bench fleet`: the control plane and the sync protocol at fleet scale.
//!
//! By default 10,000 instances over 1,000 endpoints and 100 sync clients, each running the
//! router's own sync code (`switchyard_router::sync_client`, on a thread of its own, applying
//! to a table of its own) in this process, against a control plane in this process on its own
//! runtime; on the embedded store and, with `--etcd URL`, on etcd. Then a smoke run with real
//! `switchyard-router` processes. Measured, in one run:
//!
//! - **change → every router**: an admin write (an instance registered, or deregistered) until
//!   every client's table shows it, p50/p99, and per client;
//! - **new router ready**: a client joining the running fleet until it holds the whole
//!   snapshot (and all clients starting at once);
//! - **apply cost**: one change applied to a router's membership and table, beside a full
//!   rebuild of the table from the same state (what every change cost before protocol 2),
//!   timed on one thread; and the sync threads' CPU per applied change in the fleet run;
//! - **table swaps seen by a serving thread**: load + lookup of the current table while
//!   changes swap tables, beside the same with no changes;
//! - **control-plane CPU per change** (its runtime's threads) and memory (resident size);
//! - **rolling restart**: every instance deregistered and registered again, by several
//!   workers, while sampled writes are timed to every router; no stream may fall behind.
//!
//! CPU times come from `/proc/self/task/*/stat` (10 ms ticks, summed over threads), memory from
//! `/proc/self/status` and `/proc/PID/status`. On a 2-core machine the 100 sync threads, the
//! control plane and etcd share those cores: the figures include that contention.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use serde::Serialize;
use switchyard_control::{ControlConfig, ControlPlane};
use switchyard_proto::v1 as pb;
use switchyard_proto::v1::admin_client::AdminClient;
use switchyard_router::membership::Membership;
use switchyard_router::metrics::SyncMetrics;
use switchyard_router::sync_client::{self, SyncSettings, SyncTask};
use switchyard_router::table::{LoadRegistry, RoutingTable};
use switchyard_shared::sync::{StateUpdate, StateVersion};
use switchyard_shared::{
    Endpoint, EndpointConfig, EndpointConfigName, EndpointName, EndpointStatus, Health,
    HealthCheckConfig, Instance, InstanceId, InstanceProtocol, InstanceRole, ProductionVariant,
    VariantName,
};
use tokio::task::JoinSet;
use tonic::transport::Channel;

use crate::child::default_router_bin;
use crate::error::UsageError;
use crate::procfs::{load_average, resident_mib, threads_cpu};
use crate::stats::Summary;

#[derive(Debug, Clone, clap::Args)]
pub struct FleetArgs {
    /// Instances registered (spread evenly over the endpoints).
    #[arg(long, default_value_t = 10_000, value_name = "N")]
    pub instances: usize,
    /// Endpoints (each on one of 10 endpoint configs).
    #[arg(long, default_value_t = 1_000, value_name = "N")]
    pub endpoints: usize,
    /// Sync clients in this process, each running the router's sync code on its own thread.
    #[arg(long, default_value_t = 100, value_name = "N")]
    pub routers: usize,
    /// Timed changes (alternately an instance registered and deregistered).
    #[arg(long, default_value_t = 200, value_name = "N")]
    pub changes: usize,
    /// New routers timed joining the running fleet, one after another.
    #[arg(long, default_value_t = 5, value_name = "N")]
    pub joins: usize,
    /// Measure on etcd too, at this URL (a prefix of its own is used and removed).
    #[arg(long, value_name = "URL")]
    pub etcd: Option<String>,
    /// Skip the embedded store (with --etcd: measure etcd only).
    #[arg(long)]
    pub skip_embedded: bool,
    /// Workers of the rolling restart (each deregisters and registers its share, one instance
    /// at a time); 0 skips it.
    #[arg(long, default_value_t = 16, value_name = "N")]
    pub rolling_workers: usize,
    /// Real `switchyard-router` processes in the smoke run; 0 skips it.
    #[arg(long, default_value_t = 10, value_name = "N")]
    pub processes: usize,
    /// The switchyard-router executable for the smoke run. Default: next to this one.
    #[arg(long, value_name = "FILE")]
    pub router_bin: Option<PathBuf>,
    /// The switchyard-control executable for the smoke run (embedded store). Default: next
    /// to this one.
    #[arg(long, value_name = "FILE")]
    pub control_bin: Option<PathBuf>,
    /// Write the report as JSON.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
}

/// Everything measured on one store.
#[derive(Debug, Clone, Serialize)]
pub struct StoreReport {
    pub store: String,
    pub instances: usize,
    pub endpoints: usize,
    pub routers: usize,
    /// Seconds to import every instance, and the transactions it took.
    pub import_seconds: f64,
    pub import_transactions: u32,
    /// Milliseconds until every client started at once held the whole snapshot.
    pub all_routers_ready_ms: f64,
    /// Milliseconds for one new client to hold the whole snapshot, the fleet running.
    pub join_ready_ms: Summary,
    /// Change → every router, milliseconds.
    pub change_to_all_ms: Summary,
    /// Change → each router, milliseconds.
    pub change_to_each_ms: Summary,
    /// The sync threads' CPU per change applied by one router, microseconds.
    pub router_cpu_per_change_us: f64,
    /// Mean time of one applied sync message on a sync thread, microseconds (wall time of
    /// the apply; the 100 threads share the cores with everything else).
    pub router_apply_mean_us: f64,
    /// Control-plane threads' CPU per change, milliseconds (fan-out to every stream included).
    pub control_plane_cpu_per_change_ms: f64,
    /// The control plane's CPU with nothing changing (health prober, load sums, streams'
    /// fleet-load ticks), percent of one core.
    pub control_plane_idle_cpu_percent: f64,
    /// Load + lookup of the current table by a serving thread, microseconds: without and with
    /// changes being applied.
    pub table_read_idle_us: Summary,
    pub table_read_during_changes_us: Summary,
    pub rolling: Option<RollingReport>,
}

#[derive(Debug, Clone, Serialize)]
pub struct RollingReport {
    pub writes: usize,
    pub seconds: f64,
    pub writes_per_second: f64,
    /// Sampled writes (1 in 100) → every router, milliseconds.
    pub sampled_write_to_all_ms: Summary,
    /// After the last write: milliseconds until every router held the final state.
    pub converged_after_ms: f64,
    /// Router streams that fell behind and needed a fresh snapshot (must be 0).
    pub streams_fell_behind: u64,
    pub control_plane_cpu_seconds: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct ApplyReport {
    pub instances: usize,
    pub endpoints: usize,
    /// Rebuilding the whole table from the state (every change before protocol 2), µs.
    pub full_rebuild_us: Summary,
    /// Applying one instance change and swapping the table, µs.
    pub one_change_us: Summary,
}

#[derive(Debug, Clone, Serialize)]
pub struct ProcessReport {
    pub processes: usize,
    /// From process start to `/readyz` answering 200, milliseconds.
    pub ready_ms: Summary,
    /// A new endpoint → listed by every router's `/v1/models` (polled every 10 ms), ms.
    pub change_to_all_ms: Summary,
    /// Resident memory of each router process holding the whole state, MiB.
    pub resident_mib: Summary,
    /// Resident memory of the control-plane process holding the state (embedded store) and
    /// serving the routers, MiB.
    pub control_plane_resident_mib: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct FleetReport {
    pub cores: usize,
    /// The machine's one-minute load average at the start and the end of the run.
    pub load_average: (f64, f64),
    pub apply: ApplyReport,
    pub stores: Vec<StoreReport>,
    pub processes: Option<ProcessReport>,
}

fn usage(message: String) -> anyhow::Error {
    anyhow::Error::new(UsageError(message))
}

impl FleetArgs {
    fn check(&self) -> anyhow::Result<()> {
        if self.endpoints == 0 || self.endpoints > 100_000 {
            return Err(usage(format!(
                "--endpoints: {} is outside 1..=100000",
                self.endpoints
            )));
        }
        if self.instances < self.endpoints || self.instances > 1_000_000 {
            return Err(usage(format!(
                "--instances: {} must be at least --endpoints ({}) and at most 1000000",
                self.instances, self.endpoints
            )));
        }
        if self.routers == 0 || self.routers > 1000 {
            return Err(usage(format!(
                "--routers: {} is outside 1..=1000",
                self.routers
            )));
        }
        if self.changes == 0 || self.changes > 100_000 {
            return Err(usage(format!(
                "--changes: {} is outside 1..=100000",
                self.changes
            )));
        }
        if let Some(url) = &self.etcd
            && !url.starts_with("http://")
        {
            return Err(usage(format!("--etcd: {url:?} must start with http://")));
        }
        if self.skip_embedded && self.etcd.is_none() {
            return Err(usage("--skip-embedded needs --etcd URL".into()));
        }
        Ok(())
    }
}

// ----- the fleet's shape -------------------------------------------------------------------

const CONFIGS: usize = 10;
const VARIANT: &str = "AllTraffic";

fn endpoint_name(index: usize) -> String {
    format!("e-{index}")
}

fn instance_url(index: usize) -> String {
    // Nothing listens there: probes fail at once, and with the configs' health checks (once
    // an hour, unhealthy after 100 failures) no instance changes health during the run.
    format!("http://127.0.0.1:{}/i-{index}", 20_000 + index % 40_000)
}

fn health_check() -> HealthCheckConfig {
    HealthCheckConfig {
        interval_ms: 3_600_000,
        unhealthy_threshold: 100,
        ..HealthCheckConfig::default()
    }
}

fn config(index: usize) -> EndpointConfig {
    EndpointConfig {
        endpoint_config_name: EndpointConfigName::new(&format!("cfg-{index}")).expect("name"),
        production_variants: vec![ProductionVariant {
            variant_name: VariantName::new(VARIANT).expect("name"),
            model_name: Some(format!("model-{index}")),
            initial_instance_count: None,
            instance_type: None,
            initial_variant_weight: None,
            routing_config: None,
        }],
        health_check_config: health_check(),
        creation_time_ms: 0,
        disaggregation_config: None,
    }
}

fn registration(index: usize, endpoints: usize, weight: f64) -> pb::RegisterInstanceRequest {
    pb::RegisterInstanceRequest {
        endpoint_name: endpoint_name(index % endpoints),
        variant_name: VARIANT.into(),
        url: instance_url(index),
        id: format!("i-{index}"),
        weight: Some(weight),
        ..Default::default()
    }
}

async fn populate(
    admin: &mut AdminClient<Channel>,
    args: &FleetArgs,
) -> anyhow::Result<(f64, u32)> {
    for index in 0..CONFIGS {
        admin
            .create_endpoint_config(pb::CreateEndpointConfigRequest {
                endpoint_config: Some((&config(index)).into()),
            })
            .await?;
    }
    for index in 0..args.endpoints {
        admin
            .create_endpoint(pb::CreateEndpointRequest {
                name: endpoint_name(index),
                endpoint_config_name: format!("cfg-{}", index % CONFIGS),
            })
            .await?;
    }
    let started = Instant::now();
    let imported = admin
        .import_instances(pb::ImportInstancesRequest {
            instances: (0..args.instances)
                .map(|index| registration(index, args.endpoints, 1.0))
                .collect(),
            dry_run: false,
        })
        .await?
        .into_inner();
    Ok((started.elapsed().as_secs_f64(), imported.transactions))
}

// ----- sync clients ------------------------------------------------------------------------

/// One router's sync side: its thread, table and metrics.
struct Client {
    task: SyncTask,
    table: Arc<ArcSwap<RoutingTable>>,
    metrics: Arc<SyncMetrics>,
}

fn start_client(url: &str, name: String) -> anyhow::Result<Client> {
    let registry = Arc::new(LoadRegistry::default());
    let table = Arc::new(ArcSwap::from_pointee(RoutingTable::default()));
    let metrics = Arc::new(SyncMetrics::default());
    let task = sync_client::spawn(
        SyncSettings {
            urls: vec![url.to_owned()],
            router_id: name,
            report_interval: Duration::from_millis(100),
            tls_ca: None,
            token: None,
        },
        Membership::new(Arc::clone(&registry), Arc::clone(&table)),
        registry,
        Arc::clone(&metrics),
        tokio_util::sync::CancellationToken::new(),
    )?;
    Ok(Client {
        task,
        table,
        metrics,
    })
}

/// Instances routable in the table, over every endpoint.
fn routable(table: &RoutingTable) -> usize {
    table
        .endpoints
        .values()
        .flat_map(|endpoint| &endpoint.variants)
        .map(|variant| variant.instances.len())
        .sum()
}

/// Resolves with the time at which `holds` first holds for the client's table.
async fn when(
    table: Arc<ArcSwap<RoutingTable>>,
    mut swaps: tokio::sync::watch::Receiver<u64>,
    holds: impl Fn(&RoutingTable) -> bool,
    limit: Duration,
) -> anyhow::Result<Instant> {
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        swaps.borrow_and_update();
        if holds(&table.load()) {
            return Ok(Instant::now());
        }
        tokio::time::timeout_at(deadline, swaps.changed())
            .await
            .map_err(|_| anyhow::anyhow!("a router did not see a change within {limit:?}"))??;
    }
}

/// Whether `table` routes instance `id` of `endpoint` with `weight` (None: not at all).
fn routes(table: &RoutingTable, endpoint: &str, id: &str, weight: Option<f64>) -> bool {
    let found = table.endpoints.get(endpoint).and_then(|route| {
        let variant = &route.variants[0];
        variant
            .instances
            .iter()
            .zip(&variant.views)
            .find(|(instance, _)| instance.id.as_str() == id)
            .map(|(_, view)| view.weight)
    });
    match (found, weight) {
        (Some(found), Some(weight)) => found == weight,
        (None, None) => true,
        _ => false,
    }
}

/// Waiters on every client for `holds`; resolves with each client's time.
fn watch_all(
    clients: &[Client],
    holds: impl Fn(&RoutingTable) -> bool + Clone + Send + Sync + 'static,
) -> JoinSet<anyhow::Result<Instant>> {
    let mut waiters = JoinSet::new();
    for client in clients {
        waiters.spawn(when(
            Arc::clone(&client.table),
            client.metrics.swaps.subscribe(),
            holds.clone(),
            Duration::from_secs(30),
        ));
    }
    waiters
}

async fn collect(mut waiters: JoinSet<anyhow::Result<Instant>>) -> anyhow::Result<Vec<Instant>> {
    let mut times = Vec::with_capacity(waiters.len());
    while let Some(time) = waiters.join_next().await {
        times.push(time??);
    }
    Ok(times)
}

fn ms(duration: Duration) -> f64 {
    duration.as_secs_f64() * 1e3
}

/// Samples load + lookup of the current table on a thread of its own (a serving thread's
/// read), about every 200 µs, until `stop`.
fn sample_reads(tables: Vec<Arc<ArcSwap<RoutingTable>>>, stop: Arc<AtomicBool>) -> Vec<f64> {
    let mut samples = Vec::new();
    let mut index = 0usize;
    while !stop.load(Ordering::Relaxed) && samples.len() < 1_000_000 {
        let table = &tables[index % tables.len()];
        let name = endpoint_name(index % 997);
        let started = Instant::now();
        let loaded = table.load_full();
        let found = loaded
            .endpoints
            .get(name.as_str())
            .map(|route| route.variants.len());
        drop(loaded);
        samples.push(started.elapsed().as_secs_f64() * 1e6);
        std::hint::black_box(found);
        index += 1;
        std::thread::sleep(Duration::from_micros(200));
    }
    samples
}

// ----- one store -----------------------------------------------------------------------------

async fn start_control_plane(
    runtime: &tokio::runtime::Runtime,
    config: ControlConfig,
) -> anyhow::Result<ControlPlane> {
    let settings = config.validate()?;
    let cp = runtime
        .spawn(async move { ControlPlane::start(settings).await })
        .await??;
    Ok(cp)
}

async fn measure_store(
    args: &FleetArgs,
    store: &str,
    runtime: &tokio::runtime::Runtime,
) -> anyhow::Result<StoreReport> {
    let dir = tempfile::tempdir()?;
    let listen = "127.0.0.1:0".parse()?;
    let prefix = format!("/switchyard-fleet-{}/", std::process::id());
    let config = match (store, &args.etcd) {
        ("etcd", Some(url)) => ControlConfig::etcd(listen, vec![url.clone()], &prefix),
        _ => ControlConfig::embedded(listen, dir.path().to_path_buf()),
    };
    let cp = start_control_plane(runtime, config).await?;
    let url = cp.url();
    let mut admin = AdminClient::connect(url.clone())
        .await?
        .max_decoding_message_size(64 * 1024 * 1024);
    eprintln!(
        "{store}: creating {} endpoints and importing {} instances",
        args.endpoints, args.instances
    );
    let (import_seconds, import_transactions) = populate(&mut admin, args).await?;

    // All clients at once.
    eprintln!("{store}: starting {} sync clients", args.routers);
    let started = Instant::now();
    let mut clients = Vec::with_capacity(args.routers);
    for index in 0..args.routers {
        clients.push(start_client(&url, format!("fleet-{index}"))?);
    }
    let total = args.instances;
    collect(watch_all(&clients, move |table| routable(table) == total)).await?;
    let all_routers_ready_ms = ms(started.elapsed());

    // One at a time, joining the running fleet.
    let mut joins = Vec::new();
    for join in 0..args.joins {
        let started = Instant::now();
        let client = start_client(&url, format!("join-{join}"))?;
        let one = std::slice::from_ref(&client);
        collect(watch_all(one, move |table| routable(table) == total)).await?;
        joins.push(ms(started.elapsed()));
        client.task.join();
    }

    // Table reads with nothing changing.
    let tables: Vec<_> = clients
        .iter()
        .map(|client| Arc::clone(&client.table))
        .collect();
    let idle_cpu_before = threads_cpu("switchyard-cp");
    let idle_started = Instant::now();
    let idle = {
        let stop = Arc::new(AtomicBool::new(false));
        let sampler = {
            let (tables, stop) = (tables.clone(), Arc::clone(&stop));
            std::thread::spawn(move || sample_reads(tables, stop))
        };
        tokio::time::sleep(Duration::from_secs(2)).await;
        stop.store(true, Ordering::Relaxed);
        sampler
            .join()
            .map_err(|_| anyhow::anyhow!("sampler panicked"))?
    };
    let control_plane_idle_cpu_percent = (threads_cpu("switchyard-cp") - idle_cpu_before)
        / idle_started.elapsed().as_secs_f64()
        * 100.0;

    // Timed changes.
    eprintln!("{store}: {} timed changes", args.changes);
    let stop = Arc::new(AtomicBool::new(false));
    let sampler = {
        let (tables, stop) = (tables.clone(), Arc::clone(&stop));
        std::thread::spawn(move || sample_reads(tables, stop))
    };
    let applied_before: u64 = clients
        .iter()
        .map(|client| client.metrics.apply_seconds.snapshot().count)
        .sum();
    let apply_sum_before: f64 = clients
        .iter()
        .map(|client| client.metrics.apply_seconds.snapshot().sum)
        .sum();
    let sync_cpu_before = threads_cpu("switchyard-sync");
    let cp_cpu_before = threads_cpu("switchyard-cp");
    let mut to_all = Vec::new();
    let mut to_each = Vec::new();
    for change in 0..args.changes {
        let index = args.instances + change / 2;
        let request = registration(index, args.endpoints, 1.0);
        let (endpoint, id) = (request.endpoint_name.clone(), request.id.clone());
        let register = change % 2 == 0;
        let waiters = watch_all(&clients, move |table| {
            routes(table, &endpoint, &id, register.then_some(1.0))
        });
        let started = Instant::now();
        if register {
            admin.register_instance(request).await?;
        } else {
            admin
                .deregister_instance(pb::DeregisterInstanceRequest {
                    endpoint_name: request.endpoint_name,
                    id: request.id,
                })
                .await?;
        }
        let times = collect(waiters).await?;
        let last = times.iter().max().copied().unwrap_or(started);
        to_all.push(ms(last.duration_since(started)));
        to_each.extend(times.iter().map(|time| ms(time.duration_since(started))));
    }
    let sync_cpu = threads_cpu("switchyard-sync") - sync_cpu_before;
    let cp_cpu = threads_cpu("switchyard-cp") - cp_cpu_before;
    stop.store(true, Ordering::Relaxed);
    let during = sampler
        .join()
        .map_err(|_| anyhow::anyhow!("sampler panicked"))?;
    let applied: u64 = clients
        .iter()
        .map(|client| client.metrics.apply_seconds.snapshot().count)
        .sum::<u64>()
        - applied_before;
    let apply_sum: f64 = clients
        .iter()
        .map(|client| client.metrics.apply_seconds.snapshot().sum)
        .sum::<f64>()
        - apply_sum_before;
    let per_router_changes = (args.changes * args.routers) as f64;

    let rolling = if args.rolling_workers > 0 {
        eprintln!(
            "{store}: rolling restart of {} instances with {} workers",
            args.instances, args.rolling_workers
        );
        Some(rolling_restart(args, &url, &clients, &cp).await?)
    } else {
        None
    };

    for client in clients {
        client.task.abort();
    }
    let shutdown = runtime.spawn(cp.shutdown());
    shutdown.await??;
    Ok(StoreReport {
        store: store.into(),
        instances: args.instances,
        endpoints: args.endpoints,
        routers: args.routers,
        import_seconds,
        import_transactions,
        all_routers_ready_ms,
        join_ready_ms: Summary::of(&joins),
        change_to_all_ms: Summary::of(&to_all),
        change_to_each_ms: Summary::of(&to_each),
        router_cpu_per_change_us: sync_cpu / per_router_changes * 1e6,
        router_apply_mean_us: if applied > 0 {
            apply_sum / applied as f64 * 1e6
        } else {
            0.0
        },
        control_plane_cpu_per_change_ms: cp_cpu / args.changes as f64 * 1e3,
        control_plane_idle_cpu_percent,
        table_read_idle_us: Summary::of(&idle),
        table_read_during_changes_us: Summary::of(&during),
        rolling,
    })
}

async fn rolling_restart(
    args: &FleetArgs,
    url: &str,
    clients: &[Client],
    cp: &ControlPlane,
) -> anyhow::Result<RollingReport> {
    let fell_behind_before = cp.sync_stats().fell_behind.load(Ordering::Relaxed);
    let cp_cpu_before = threads_cpu("switchyard-cp");
    let started = Instant::now();
    let mut workers = JoinSet::new();
    let samples = Arc::new(std::sync::Mutex::new(Vec::new()));
    let watchers: Arc<Vec<_>> = Arc::new(
        clients
            .iter()
            .map(|client| (Arc::clone(&client.table), client.metrics.swaps.subscribe()))
            .collect(),
    );
    for worker in 0..args.rolling_workers {
        let url = url.to_owned();
        let (instances, endpoints, workers_count) =
            (args.instances, args.endpoints, args.rolling_workers);
        let samples = Arc::clone(&samples);
        let watchers = Arc::clone(&watchers);
        workers.spawn(async move {
            let mut admin = AdminClient::connect(url).await?;
            for index in (worker..instances).step_by(workers_count) {
                let request = registration(index, endpoints, 2.0);
                let sampled = index % 100 == 0;
                let waiters = sampled.then(|| {
                    let mut waiters = JoinSet::new();
                    for (table, swaps) in watchers.iter() {
                        let (endpoint, id) = (request.endpoint_name.clone(), request.id.clone());
                        waiters.spawn(when(
                            Arc::clone(table),
                            swaps.clone(),
                            move |table| routes(table, &endpoint, &id, Some(2.0)),
                            Duration::from_secs(60),
                        ));
                    }
                    waiters
                });
                admin
                    .deregister_instance(pb::DeregisterInstanceRequest {
                        endpoint_name: request.endpoint_name.clone(),
                        id: request.id.clone(),
                    })
                    .await?;
                let registered = Instant::now();
                admin.register_instance(request).await?;
                if let Some(waiters) = waiters {
                    let times = collect(waiters).await?;
                    let last = times.iter().max().copied().unwrap_or(registered);
                    samples
                        .lock()
                        .map_err(|_| anyhow::anyhow!("poisoned"))?
                        .push(ms(last.duration_since(registered)));
                }
            }
            anyhow::Ok(())
        });
    }
    while let Some(done) = workers.join_next().await {
        done??;
    }
    let seconds = started.elapsed().as_secs_f64();
    let finished = Instant::now();
    let instances = args.instances;
    // Every router holds every instance again, re-registered (weight 2).
    collect(watch_all(clients, move |table| {
        routable(table) == instances
            && table.endpoints.values().all(|route| {
                route.variants[0]
                    .views
                    .iter()
                    .all(|view| view.weight == 2.0)
            })
    }))
    .await?;
    let converged_after_ms = ms(finished.elapsed());
    let samples = samples
        .lock()
        .map_err(|_| anyhow::anyhow!("poisoned"))?
        .clone();
    let writes = args.instances * 2;
    Ok(RollingReport {
        writes,
        seconds,
        writes_per_second: writes as f64 / seconds,
        sampled_write_to_all_ms: Summary::of(&samples),
        converged_after_ms,
        streams_fell_behind: cp.sync_stats().fell_behind.load(Ordering::Relaxed)
            - fell_behind_before,
        control_plane_cpu_seconds: threads_cpu("switchyard-cp") - cp_cpu_before,
    })
}

// ----- apply cost on one thread ------------------------------------------------------------

/// The fleet's state as the router receives it, in domain types.
fn fleet_state(args: &FleetArgs) -> StateUpdate {
    let configs = (0..CONFIGS).map(|index| Arc::new(config(index))).collect();
    let endpoints = (0..args.endpoints)
        .map(|index| {
            Arc::new(Endpoint {
                endpoint_name: EndpointName::new(&endpoint_name(index)).expect("name"),
                endpoint_config_name: EndpointConfigName::new(&format!("cfg-{}", index % CONFIGS))
                    .expect("name"),
                endpoint_status: EndpointStatus::InService,
                creation_time_ms: 0,
                last_modified_time_ms: 0,
                failure_reason: String::new(),
            })
        })
        .collect();
    let instances = (0..args.instances)
        .map(|index| Arc::new(instance(index, args.endpoints, 1.0)))
        .collect();
    StateUpdate {
        reset: true,
        complete: true,
        configs,
        endpoints,
        instances,
        ..StateUpdate::default()
    }
}

fn instance(index: usize, endpoints: usize, weight: f64) -> Instance {
    Instance {
        instance_id: InstanceId::new(&format!("i-{index}")).expect("id"),
        endpoint_name: EndpointName::new(&endpoint_name(index % endpoints)).expect("name"),
        variant_name: VariantName::new(VARIANT).expect("name"),
        url: instance_url(index),
        role: InstanceRole::Both,
        protocol: InstanceProtocol::Unspecified,
        weight,
        health: Health::Unknown,
        health_detail: String::new(),
        ttl_seconds: 0,
        registered_time_ms: 0,
        lease_id: 0,
        kv_events: None,
        decode_partner: None,
    }
}

/// The full rebuild (a snapshot applied: every route prepared, every endpoint built) beside
/// one change (an instance re-registered with another weight), on this thread.
fn measure_apply(args: &FleetArgs) -> ApplyReport {
    let state = fleet_state(args);
    let table = Arc::new(ArcSwap::from_pointee(RoutingTable::default()));
    let mut membership = Membership::new(Arc::default(), Arc::clone(&table));
    let mut revision = 1;
    let mut full = Vec::new();
    for _ in 0..5 {
        let started = Instant::now();
        let version = StateVersion {
            cluster: "bench".into(),
            revision,
        };
        membership
            .apply(version, &state)
            .expect("a snapshot applies");
        full.push(started.elapsed().as_secs_f64() * 1e6);
        revision += 1;
    }
    let mut one = Vec::new();
    for change in 0..2000 {
        let weight = if change % 2 == 0 { 2.0 } else { 1.0 };
        let update = StateUpdate {
            complete: true,
            instances: vec![Arc::new(instance(
                change * 7 % args.instances,
                args.endpoints,
                weight,
            ))],
            ..StateUpdate::default()
        };
        let version = StateVersion {
            cluster: "bench".into(),
            revision,
        };
        let started = Instant::now();
        membership
            .apply(version, &update)
            .expect("a change applies");
        one.push(started.elapsed().as_secs_f64() * 1e6);
        revision += 1;
    }
    ApplyReport {
        instances: args.instances,
        endpoints: args.endpoints,
        full_rebuild_us: Summary::of(&full),
        one_change_us: Summary::of(&one),
    }
}

// ----- real router processes -----------------------------------------------------------------

struct RouterProcess {
    child: std::process::Child,
    url: String,
}

impl Drop for RouterProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn http_get(client: &crate::client::HttpClient, url: &str) -> Option<(u16, String)> {
    use http_body_util::BodyExt;
    let request = http::Request::get(url)
        .body(http_body_util::Full::new(bytes::Bytes::new()))
        .ok()?;
    let response = client.request(request).await.ok()?;
    let status = response.status().as_u16();
    let body = response.into_body().collect().await.ok()?.to_bytes();
    Some((status, String::from_utf8_lossy(&body).into_owned()))
}

async fn measure_processes(args: &FleetArgs) -> anyhow::Result<ProcessReport> {
    let binary = match &args.router_bin {
        Some(path) => path.clone(),
        None => default_router_bin().ok_or_else(|| {
            usage("--router-bin: no switchyard-router next to this executable; build it (cargo build --release -p switchyard-router) or name it".into())
        })?,
    };
    let control = match &args.control_bin {
        Some(path) => path.clone(),
        None => default_router_bin()
            .and_then(|router| {
                let control = router.with_file_name("switchyard-control");
                control.is_file().then_some(control)
            })
            .ok_or_else(|| {
                usage("--control-bin: no switchyard-control next to this executable; build it (cargo build --release -p switchyard-control) or name it".into())
            })?,
    };
    let dir = tempfile::tempdir()?;
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let cp_url = format!("http://127.0.0.1:{port}");
    let cp = RouterProcess {
        child: std::process::Command::new(&control)
            .args(["--listen", &format!("127.0.0.1:{port}")])
            .args(["--metrics-listen", "127.0.0.1:0"])
            .arg("--data-dir")
            .arg(dir.path())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()?,
        url: cp_url.clone(),
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut admin = loop {
        if let Ok(admin) = AdminClient::connect(cp.url.clone()).await {
            break admin;
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "switchyard-control did not start"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    .max_decoding_message_size(64 * 1024 * 1024);
    eprintln!(
        "processes: importing {} instances, starting {} routers",
        args.instances, args.processes
    );
    populate(&mut admin, args).await?;
    let client = crate::client::http_client();
    let mut routers = Vec::new();
    let mut ready = Vec::new();
    for index in 0..args.processes {
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        let started = Instant::now();
        let child = std::process::Command::new(&binary)
            .args(["--listen", &format!("127.0.0.1:{port}")])
            .args(["--control-plane", &cp_url])
            .args(["--worker-threads", "1"])
            .args(["--router-id", &format!("smoke-{index}")])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()?;
        let router = RouterProcess {
            child,
            url: format!("http://127.0.0.1:{port}"),
        };
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some((200, _)) = http_get(&client, &format!("{}/readyz", router.url)).await {
                break;
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "router {index} not ready in 60 s"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        ready.push(ms(started.elapsed()));
        routers.push(router);
    }
    let mut to_all = Vec::new();
    for change in 0..20 {
        let name = format!("smoke-{change}");
        let started = Instant::now();
        admin
            .create_endpoint(pb::CreateEndpointRequest {
                name: name.clone(),
                endpoint_config_name: "cfg-0".into(),
            })
            .await?;
        let mut pending: Vec<&RouterProcess> = routers.iter().collect();
        let deadline = Instant::now() + Duration::from_secs(30);
        while !pending.is_empty() {
            anyhow::ensure!(Instant::now() < deadline, "a router did not list {name}");
            let mut still = Vec::new();
            for router in pending {
                let listed = http_get(&client, &format!("{}/v1/models", router.url))
                    .await
                    .is_some_and(|(_, body)| body.contains(&format!("\"{name}\"")));
                if !listed {
                    still.push(router);
                }
            }
            pending = still;
            if !pending.is_empty() {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
        to_all.push(ms(started.elapsed()));
    }
    let resident: Vec<f64> = routers
        .iter()
        .map(|router| resident_mib(&router.child.id().to_string()))
        .collect();
    let control_plane_resident_mib = resident_mib(&cp.child.id().to_string());
    drop(routers);
    drop(cp);
    Ok(ProcessReport {
        processes: args.processes,
        ready_ms: Summary::of(&ready),
        change_to_all_ms: Summary::of(&to_all),
        resident_mib: Summary::of(&resident),
        control_plane_resident_mib,
    })
}

// ----- the report ------------------------------------------------------------------------------

fn print(report: &FleetReport) {
    let apply = &report.apply;
    println!(
        "fleet benchmark on {} cores (everything below shares them; load average {:.1} at the start, {:.1} at the end)\n",
        report.cores, report.load_average.0, report.load_average.1
    );
    println!(
        "apply cost on one thread, {} instances over {} endpoints:",
        apply.instances, apply.endpoints
    );
    println!(
        "  full table rebuild (every change before protocol 2): p50 {:.0} µs  p99 {:.0} µs",
        apply.full_rebuild_us.p50, apply.full_rebuild_us.p99
    );
    println!(
        "  one change now:                                      p50 {:.1} µs  p99 {:.1} µs  ({:.0}x less at p50)\n",
        apply.one_change_us.p50,
        apply.one_change_us.p99,
        apply.full_rebuild_us.p50 / apply.one_change_us.p50.max(1e-9)
    );
    for store in &report.stores {
        println!(
            "{}: {} instances, {} endpoints, {} routers",
            store.store, store.instances, store.endpoints, store.routers
        );
        println!(
            "  import: {:.2} s in {} transactions",
            store.import_seconds, store.import_transactions
        );
        println!(
            "  change -> every router: p50 {:.1} ms  p99 {:.1} ms  max {:.1} ms  (each router: p50 {:.1} ms, p99 {:.1} ms)",
            store.change_to_all_ms.p50,
            store.change_to_all_ms.p99,
            store.change_to_all_ms.max,
            store.change_to_each_ms.p50,
            store.change_to_each_ms.p99
        );
        println!(
            "  new router ready (joining the running fleet): p50 {:.0} ms  max {:.0} ms; all {} starting at once: {:.0} ms",
            store.join_ready_ms.p50,
            store.join_ready_ms.max,
            store.routers,
            store.all_routers_ready_ms
        );
        println!(
            "  router: {:.1} µs sync-thread CPU per change applied (decoding included), apply {:.1} µs mean",
            store.router_cpu_per_change_us, store.router_apply_mean_us
        );
        println!(
            "  control plane: {:.2} ms CPU per change (admin call, store, fan-out to {} streams; {:.1}% of a core when idle)",
            store.control_plane_cpu_per_change_ms,
            store.routers,
            store.control_plane_idle_cpu_percent,
        );
        println!(
            "  serving-thread table read: idle p50 {:.2} µs p99 {:.2} µs; during changes p50 {:.2} µs p99 {:.2} µs",
            store.table_read_idle_us.p50,
            store.table_read_idle_us.p99,
            store.table_read_during_changes_us.p50,
            store.table_read_during_changes_us.p99
        );
        if let Some(rolling) = &store.rolling {
            println!(
                "  rolling restart: {} writes in {:.1} s ({:.0}/s); sampled write -> every router p50 {:.1} ms p99 {:.1} ms; converged {:.0} ms after the last write; streams fallen behind: {}; control plane {:.1} CPU s",
                rolling.writes,
                rolling.seconds,
                rolling.writes_per_second,
                rolling.sampled_write_to_all_ms.p50,
                rolling.sampled_write_to_all_ms.p99,
                rolling.converged_after_ms,
                rolling.streams_fell_behind,
                rolling.control_plane_cpu_seconds
            );
        }
        println!();
    }
    if let Some(processes) = &report.processes {
        println!(
            "{} router processes on a switchyard-control process (embedded store): ready p50 {:.0} ms max {:.0} ms; new endpoint -> every router p50 {:.0} ms p99 {:.0} ms (polled every 10 ms); {:.1} MiB resident per router, {:.0} MiB for the control plane",
            processes.processes,
            processes.ready_ms.p50,
            processes.ready_ms.max,
            processes.change_to_all_ms.p50,
            processes.change_to_all_ms.p99,
            processes.resident_mib.mean,
            processes.control_plane_resident_mib
        );
    }
}

/// A runtime dropped in the background (dropping one on an async thread would panic), on
/// every way out.
struct Background(Option<tokio::runtime::Runtime>);

impl Background {
    fn get(&self) -> &tokio::runtime::Runtime {
        self.0.as_ref().expect("present until dropped")
    }
}

impl Drop for Background {
    fn drop(&mut self) {
        if let Some(runtime) = self.0.take() {
            runtime.shutdown_background();
        }
    }
}

async fn run_stores(
    args: &FleetArgs,
    runtime: &tokio::runtime::Runtime,
) -> anyhow::Result<(Vec<StoreReport>, Option<ProcessReport>)> {
    let mut stores = Vec::new();
    if !args.skip_embedded {
        stores.push(measure_store(args, "embedded", runtime).await?);
    }
    if args.etcd.is_some() {
        stores.push(measure_store(args, "etcd", runtime).await?);
    }
    let processes = if args.processes > 0 {
        Some(measure_processes(args).await?)
    } else {
        None
    };
    Ok((stores, processes))
}

/// Runs the fleet benchmark and prints its report.
pub async fn fleet(args: FleetArgs) -> anyhow::Result<FleetReport> {
    args.check()?;
    let cores = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
    let load_at_start = load_average();
    eprintln!("apply cost on one thread");
    let apply = tokio::task::block_in_place(|| measure_apply(&args));
    // The control plane on a runtime of its own, so that its CPU can be told apart.
    let runtime = Background(Some(
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(cores)
            .thread_name("switchyard-cp")
            .enable_all()
            .build()?,
    ));
    let result = run_stores(&args, runtime.get()).await;
    drop(runtime);
    let (stores, processes) = result?;
    let report = FleetReport {
        cores,
        load_average: (load_at_start, load_average()),
        apply,
        stores,
        processes,
    };
    print(&report);
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_vec_pretty(&report)?)?;
    }
    Ok(report)
}
