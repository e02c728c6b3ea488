//! The fleet benchmark's report, and how it is printed.

use serde::Serialize;

use crate::stats::Summary;

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

pub fn print(report: &FleetReport) {
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
