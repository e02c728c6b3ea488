//! Sync clients in this process, each running the router's own sync code on a thread of its
//! own and applying to a table of its own, and the waits on what their tables show.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use switchyard_router::parts::{Membership, SyncMetrics, SyncSettings, SyncTask, spawn_sync};
use switchyard_router::{LoadRegistry, RoutingTable};
use tokio::task::JoinSet;

use super::shape::endpoint_name;

/// One router's sync side: its thread, table and metrics.
pub struct Client {
    pub task: SyncTask,
    pub table: Arc<ArcSwap<RoutingTable>>,
    pub metrics: Arc<SyncMetrics>,
}

pub fn start_client(url: &str, name: String) -> anyhow::Result<Client> {
    let registry = Arc::new(LoadRegistry::default());
    let table = Arc::new(ArcSwap::from_pointee(RoutingTable::default()));
    let metrics = Arc::new(SyncMetrics::default());
    let task = spawn_sync(
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
pub fn routable(table: &RoutingTable) -> usize {
    table
        .endpoints
        .values()
        .flat_map(|endpoint| &endpoint.variants)
        .map(|variant| variant.instances.len())
        .sum()
}

/// Resolves with the time at which `holds` first holds for the client's table.
pub async fn when(
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
pub fn routes(table: &RoutingTable, endpoint: &str, id: &str, weight: Option<f64>) -> bool {
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
pub fn watch_all(
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

pub async fn collect(
    mut waiters: JoinSet<anyhow::Result<Instant>>,
) -> anyhow::Result<Vec<Instant>> {
    let mut times = Vec::with_capacity(waiters.len());
    while let Some(time) = waiters.join_next().await {
        times.push(time??);
    }
    Ok(times)
}

pub fn ms(duration: Duration) -> f64 {
    duration.as_secs_f64() * 1e3
}

/// Sync messages applied by the clients, and the seconds their applies took, summed.
pub fn applied(clients: &[Client]) -> (u64, f64) {
    clients.iter().fold((0, 0.0), |(count, sum), client| {
        let snapshot = client.metrics.apply_seconds.snapshot();
        (count + snapshot.count, sum + snapshot.sum)
    })
}

/// Table reads ([`sample_reads`]) on a thread of their own until [`ReadSampler::finish`].
pub struct ReadSampler {
    stop: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<Vec<f64>>,
}

impl ReadSampler {
    pub fn start(tables: Vec<Arc<ArcSwap<RoutingTable>>>) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let stop = Arc::clone(&stop);
            std::thread::spawn(move || sample_reads(tables, stop))
        };
        Self { stop, thread }
    }

    /// Stops the sampling: each read's time, µs.
    pub fn finish(self) -> anyhow::Result<Vec<f64>> {
        self.stop.store(true, Ordering::Relaxed);
        self.thread
            .join()
            .map_err(|_| anyhow::anyhow!("sampler panicked"))
    }
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
