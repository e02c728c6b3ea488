//! `switchyard-engine-sim`: one simulated vLLM instance on a TCP port.

use std::net::SocketAddr;

use anyhow::Context as _;
use clap::Parser;
use switchyard_engine_sim::{SimConfig, SimServer};
use switchyard_process::{LogFormat, exit_usage, init_logging, parse_args, shutdown_signal};
use tokio_util::sync::CancellationToken;

/// A simulated vLLM-compatible inference engine (Llama-3.1-70B-class on 8×H100) for tests,
/// demos and benchmarks. Speaks vLLM's OpenAI-compatible HTTP API, /metrics and the SageMaker
/// container contract. Durations are model time, scaled on the wall clock by --time-scale.
#[derive(Debug, Parser)]
#[command(name = "switchyard-engine-sim", version)]
struct Args {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:8000", value_name = "ADDR")]
    listen: SocketAddr,

    /// Log format.
    #[arg(long, value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,

    #[command(flatten)]
    sim: SimConfig,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args: Args = parse_args();
    if let Err(message) = args.sim.validate() {
        exit_usage(message);
    }
    init_logging(args.log_format, "info");

    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("cannot listen on {}", args.listen))?;
    let shutdown = CancellationToken::new();
    let signal = shutdown.clone();
    let mut server = tokio::spawn(SimServer::serve(listener, args.sim, shutdown.clone()));
    tokio::select! {
        () = shutdown_signal() => signal.cancel(),
        result = &mut server => return Ok(result.context("server task failed")??),
    }
    server.await.context("server task failed")??;
    Ok(())
}
