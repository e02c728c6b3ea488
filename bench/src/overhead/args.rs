//! `switchyard-bench overhead`'s flags.

use std::path::PathBuf;

use crate::strategy::Strategy;

#[derive(Debug, Clone, clap::Args)]
pub struct OverheadArgs {
    /// Rounds in the latency phase: one request each way (direct, through the router, the
    /// bare proxy and the TCP relay), in rotating order.
    #[arg(long, default_value_t = 2000, value_name = "N")]
    pub requests: usize,
    /// Closed-loop clients in the throughput phase.
    #[arg(long, default_value_t = 16, value_name = "C")]
    pub concurrency: usize,
    /// Seconds of each throughput phase (direct, through the router, through the bare proxy).
    #[arg(long, default_value_t = 5.0, value_name = "SECONDS")]
    pub duration: f64,
    /// The endpoint's routing strategy (PREFIX_AWARE does the most work per request).
    #[arg(long, value_enum, default_value = "PREFIX_AWARE")]
    pub strategy: Strategy,
    /// The switchyard-router executable. Default: next to this one (target/release or
    /// target/debug: build it with `cargo build --release -p switchyard-router`).
    #[arg(long, value_name = "FILE")]
    pub router_bin: Option<PathBuf>,
    /// A second switchyard-router executable (say, built from an earlier commit) measured
    /// the same way, interleaved in the same rounds: a before/after comparison free of the
    /// machine's drift between runs.
    #[arg(long, value_name = "FILE")]
    pub baseline_router_bin: Option<PathBuf>,
    /// Where the simulated engine runs: its own process (as a real engine does, so the direct
    /// path pays the same process wake-ups a deployment does), or inside this one, beside
    /// the client.
    #[arg(long, value_enum, default_value = "process")]
    pub engine: EnginePlacement,
    /// The switchyard-engine-sim executable for `--engine process`. Default: next to this one.
    #[arg(long, value_name = "FILE")]
    pub engine_bin: Option<PathBuf>,
    /// The engine's clock scale: tiny, so that it answers at once.
    #[arg(long, default_value_t = 1e-6, value_name = "X")]
    pub time_scale: f64,
    /// Also measure tracing, interleaved in the same rounds: the router with its OTLP
    /// exporter pointed at a dead collector, and with every request traced (100% sampling)
    /// to an OTLP sink in this process that accepts every span; both against the router with
    /// tracing off.
    #[arg(long)]
    pub tracing: bool,
    /// Write the report as JSON.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    /// No progress messages.
    #[arg(long)]
    pub quiet: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum EnginePlacement {
    Process,
    InProcess,
}

impl OverheadArgs {
    pub fn validate(&self) -> Result<(), OverheadArgsError> {
        if self.requests == 0 {
            return Err(OverheadArgsError::NoRequests);
        }
        if self.concurrency == 0 {
            return Err(OverheadArgsError::NoConcurrency);
        }
        if !(self.duration.is_finite() && self.duration > 0.0) {
            return Err(OverheadArgsError::Duration(self.duration));
        }
        if !(self.time_scale.is_finite() && self.time_scale > 0.0) {
            return Err(OverheadArgsError::TimeScale(self.time_scale));
        }
        Ok(())
    }
}

/// An overhead flag out of range; the message names the flag.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum OverheadArgsError {
    #[error("--requests must be at least 1")]
    NoRequests,
    #[error("--concurrency must be at least 1")]
    NoConcurrency,
    #[error("--duration must be positive, got {0}")]
    Duration(f64),
    #[error("--time-scale must be positive, got {0}")]
    TimeScale(f64),
}
