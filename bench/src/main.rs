//! `switchyard-bench`: drives a router with a workload and reports, per routing strategy,
//! KV-cache hit rate, TTFT, inter-token and end-to-end latency, throughput and instance shares.

use clap::{Parser, Subcommand};
use switchyard_bench::{
    DemoArgs, DpdArgs, DriveArgs, FleetArgs, FlowArgs, OverheadArgs, OverloadArgs, UsageError,
};
use switchyard_process::{self as process, EXIT_USAGE};

/// Switchyard's load generator and benchmark report.
///
/// Without a command, drives an existing router (`--target URL --endpoint E`) with a workload
/// and reports what the client measured: TTFT (to the first streamed token), inter-token and
/// end-to-end latency (p50/p90/p99), throughput, each instance's share of requests (from the
/// x-switchyard-instance header), the KV-cache hit rate (from the engines' /metrics with
/// --engine-metrics, else from the answers' usage) and the oracle bound of the trace.
///
/// `compare` runs RANDOM, LEAST_OUTSTANDING_REQUESTS and PREFIX_AWARE on the same trace, each
/// on a fresh in-process cluster of simulated engines, with 1 and with 4 routers, side by
/// side. `overhead` measures the latency the router adds and its requests per core-second.
/// `dpd` compares disaggregated prefill/decode with colocated engines of the same count.
///
/// Latencies are measured on the wall clock; simulated engines run on a scaled clock
/// (--time-scale), so reports also give model ms = wall ms / time scale. Seeds make runs
/// repeatable: the same seed sends the same requests. A progress line is printed on stderr.
/// Output: a table on stdout, --json FILE, --svg FILE. Exit status: 0, 1 on a failure, 64 on
/// a bad flag.
#[derive(Debug, Parser)]
#[command(
    name = "switchyard-bench",
    version,
    args_conflicts_with_subcommands = true,
    after_help = "Examples:\n  switchyard-bench --target http://127.0.0.1:8080 --endpoint chat --workload long-context --requests 500 --engine-metrics http://127.0.0.1:9001,http://127.0.0.1:9002\n  switchyard-bench compare --preset article --json article.json --svg article.svg\n  switchyard-bench compare --preset quick\n  switchyard-bench overhead --requests 2000 --concurrency 16\n  switchyard-bench overload --requests 200 --max-buffered-bytes 256MiB\n  switchyard-bench fleet --etcd http://127.0.0.1:2379\n  switchyard-bench dpd --json dpd.json --svg dpd.svg\n  switchyard-bench dpd --quick"
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    drive: DriveArgs,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Every strategy on the same trace, each on fresh simulated engines (cold caches), with
    /// 1 and several routers, beside the oracle bound. `--preset article` (the default) is
    /// the AWS article's experiment in miniature: 7 engines, 8,000-token shared prefixes,
    /// a few minutes on 2 cores in a release build. docs/benchmarks.md explains the preset.
    Compare(Box<DemoArgs>),
    /// The latency a router adds (router vs direct-to-engine vs a bare reverse proxy,
    /// interleaved, same client) and its requests per core-second, with the router and the
    /// proxy in separate processes. Needs switchyard-router next to this executable.
    Overhead(OverheadArgs),
    /// The router's peak memory under a flood of large requests to an engine that never
    /// answers, with --max-buffered-bytes bounding what it holds. Needs switchyard-router and
    /// switchyard-engine-sim next to this executable.
    Overload(OverloadArgs),
    /// The control plane and the sync protocol at fleet scale: by default 10,000 instances
    /// over 1,000 endpoints and 100 sync clients running the router's own sync code in this
    /// process, on the embedded store and (with --etcd URL) on etcd; then real router
    /// processes. Change → every router p50/p99, a new router's time to ready, apply cost
    /// (beside a full table rebuild), CPU and memory, a rolling restart of every instance.
    Fleet(Box<FleetArgs>),
    /// Disaggregated prefill/decode (DPD) against colocated engines of the same count, in the
    /// source article's shape: long prompts (≥ 1.25 × the router's threshold as it counts
    /// them) and 256 output tokens at concurrency 8, 16, 32 and a mixed long/short load, for
    /// 1P1D, 2P1D and 2P2D. TPOT, ITL, TTFT, e2e p50/p99 and throughput, colocated → DPD.
    /// `--quick` is a smoke run of seconds; the full run takes a few minutes in a release
    /// build. docs/benchmarks.md explains what the simulator models.
    Dpd(Box<DpdArgs>),
    /// Flow control (MaxInFlightPerInstance) under bursty open-loop load at 2x the fleet's
    /// measured capacity, from a heavy and a light fairness id, two priorities: without the
    /// cap and with it, same run, same engines. TTFT per class against an idle fleet's,
    /// engines' queue depth, refusals.
    Flow(FlowArgs),
    /// A bare reverse proxy (internal: the baseline hop `overhead` starts).
    #[command(hide = true)]
    Forward(switchyard_bench::forward::ForwardArgs),
}

#[tokio::main]
async fn main() {
    let cli: Cli = process::parse_args();
    process::init_logging(process::LogFormat::Text, "warn");
    let result = match cli.command {
        Some(Command::Compare(args)) => Box::pin(switchyard_bench::demo(*args)).await.map(drop),
        Some(Command::Overhead(args)) => switchyard_bench::overhead(args).await.map(drop),
        Some(Command::Overload(args)) => switchyard_bench::overload(args).await.map(drop),
        Some(Command::Fleet(args)) => switchyard_bench::fleet(*args).await.map(drop),
        Some(Command::Dpd(args)) => Box::pin(switchyard_bench::dpd(*args)).await.map(drop),
        Some(Command::Flow(args)) => switchyard_bench::flow(args).await.map(drop),
        Some(Command::Forward(args)) => switchyard_bench::forward::forward(args).await,
        None => switchyard_bench::drive(cli.drive).await.map(drop),
    };
    if let Err(err) = result {
        if let Some(usage) = err.downcast_ref::<UsageError>() {
            process::exit_usage(usage);
        }
        eprintln!("error: {err:#}");
        std::process::exit(if err.is::<UsageError>() {
            EXIT_USAGE
        } else {
            1
        });
    }
}
