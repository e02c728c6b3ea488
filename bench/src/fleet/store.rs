//! Everything measured on one store: the import, routers starting and joining, timed
//! changes, table reads, and the rolling restart.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use switchyard_control::{ControlConfig, ControlPlane};
use switchyard_proto::v1 as pb;
use switchyard_proto::v1::admin_client::AdminClient;
use tokio::task::JoinSet;

use super::args::FleetArgs;
use super::report::{RollingReport, StoreReport};
use super::shape::{populate, registration};
use super::sync_clients::{
    Client, ReadSampler, applied, collect, ms, routable, routes, start_client, watch_all, when,
};
use crate::procfs::threads_cpu;
use crate::stats::Summary;

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

pub async fn measure_store(
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
        let sampler = ReadSampler::start(tables.clone());
        tokio::time::sleep(Duration::from_secs(2)).await;
        sampler.finish()?
    };
    let control_plane_idle_cpu_percent = (threads_cpu("switchyard-cp") - idle_cpu_before)
        / idle_started.elapsed().as_secs_f64()
        * 100.0;

    // Timed changes.
    eprintln!("{store}: {} timed changes", args.changes);
    let sampler = ReadSampler::start(tables.clone());
    let (applied_before, apply_sum_before) = applied(&clients);
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
    let during = sampler.finish()?;
    let (applied_after, apply_sum_after) = applied(&clients);
    let (applied, apply_sum) = (
        applied_after - applied_before,
        apply_sum_after - apply_sum_before,
    );
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
