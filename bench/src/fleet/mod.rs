//! `switchyard-bench fleet`: the control plane and the sync protocol at fleet scale.
//!
//! By default 10,000 instances over 1,000 endpoints and 100 sync clients, each running the
//! router's own sync code (`switchyard_router::parts::spawn_sync`, on a thread of its own, applying
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

use crate::error::UsageError;
use crate::procfs::load_average;

mod apply;
mod args;
mod processes;
mod report;
mod shape;
mod store;
mod sync_clients;

pub use args::{FleetArgs, FleetArgsError};
pub use report::{ApplyReport, FleetReport, ProcessReport, RollingReport, StoreReport};

use apply::measure_apply;
use processes::measure_processes;
use report::print;
use store::measure_store;

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
    args.check().map_err(UsageError::new)?;
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
