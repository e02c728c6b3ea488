//! `switchyard-bench compare` (and `switchyard demo`): the same trace through RANDOM,
//! LEAST_OUTSTANDING_REQUESTS, PREFIX_AWARE (SageMaker's semantics, and with Switchyard's
//! bounded-load extension for each `--load-balance-factor`) and KV_AWARE (the engines
//! publishing their KV-cache events), each on a fresh in-process
//! cluster (cold caches), and optionally through peer routers in front of fresh simulated
//! engines, with 1 and with several routers, side by side with the oracle bound.

use std::sync::Arc;

use anyhow::Context as _;

use crate::client::http_client;
use crate::error::UsageError;
use crate::output::{Machine, command_line, count};
use crate::prepare::prepare;
use crate::report::{Report, Setup};
use crate::strategy::Strategy;

mod args;
mod checks;
mod keys;
mod runs;
mod settings;

use runs::{Column, peer_binary, run_one, run_peer};

pub use args::DemoArgs;
pub use checks::{checks, hot_prefix_checks, kv_aware_checks};
pub use keys::{prefix_owner_shares, trace_key_shares};
pub use settings::{Arm, CompareSettings, Preset, SettingsError};

/// Runs the comparison `args` describes, prints the table, writes the JSON and SVG files.
pub async fn demo(args: DemoArgs) -> anyhow::Result<Report> {
    let settings = args.settings().map_err(UsageError::new)?;
    let report = compare(&settings).await?;
    report.emit(&args.output)?;
    Ok(report)
}

/// Generates the trace and its oracle bound, then runs every (router count, strategy) on a
/// fresh cluster.
pub async fn compare(settings: &CompareSettings) -> anyhow::Result<Report> {
    settings.validate().map_err(UsageError::new)?;
    let time_scale = settings.time_scale();
    let spec = settings.workload.clone();
    let concurrency = settings.concurrency;
    let capacity = (settings.engines * settings.sim.kv_cache_blocks) as u64;
    let block_size = settings.sim.block_size;
    let tokenizer = settings.sim.tokenizer.clone();
    if settings.progress {
        eprintln!("generating the {} trace and its oracle bound…", spec.kind);
    }
    let (trace, oracle, workload) = tokio::task::spawn_blocking(move || {
        prepare(
            &spec,
            concurrency,
            capacity,
            block_size,
            tokenizer.as_deref(),
        )
    })
    .await
    .context("trace generation failed")??;
    let trace = Arc::new(trace);
    let client = http_client();

    let keys = Arc::new(trace_key_shares(
        &trace,
        "bench",
        settings.prefix_length as usize,
    ));
    let mut notes = Vec::new();
    if let Some(binary) = &settings.router_binary {
        notes.push(format!(
            "Switchyard's routers ran as processes of {} (--router-processes): no disagreement sampling",
            binary.display()
        ));
    }
    let mut arms = settings.arms();
    arms.retain(|arm| match arm {
        Arm::Peer(peer) if peer_binary(settings, *peer).is_none() => {
            let note = format!(
                "{}: skipped, `{}` not found (install it: {}; or give {})",
                peer.name(),
                peer.binary_name(),
                peer.install_hint(),
                peer.flag()
            );
            if settings.progress {
                eprintln!("{note}");
            }
            notes.push(note);
            false
        }
        Arm::Peer(peer) => {
            if let Some(binary) = peer_binary(settings, *peer) {
                let version = crate::peer::binary_version(&binary);
                notes.push(format!(
                    "{}: {} ({})",
                    peer.name(),
                    binary.display(),
                    version.as_deref().unwrap_or("version unknown")
                ));
            }
            true
        }
        _ => true,
    });
    let mut runs = Vec::new();
    for &routers in &settings.router_counts {
        for &arm in &arms {
            let label = format!("{} · {}", arm.name(), count(routers, "router"));
            let column = Column {
                settings,
                routers,
                label: &label,
                trace: &trace,
                oracle: &oracle,
                client: &client,
            };
            // Boxed: a run is a large future.
            let run = match arm {
                Arm::Peer(peer) => Box::pin(run_peer(&column, peer)).await,
                Arm::Strategy(_) | Arm::Bounded(_) | Arm::KvNoPieceCache => {
                    Box::pin(run_one(&column, arm, &keys)).await
                }
            }
            .with_context(|| format!("run {label}"))?;
            runs.push(run);
        }
    }
    // Each router group is compared with its first column.
    for routers in &settings.router_counts {
        let base = runs.iter().find(|run| run.routers == *routers).cloned();
        let group = runs.iter().filter(|run| run.routers == *routers).count();
        if let Some(base) = base
            && group > 1
        {
            for run in runs.iter_mut().filter(|run| run.routers == *routers) {
                run.compare_to(&base);
            }
        }
    }

    let mut report = Report {
        tool: "switchyard-bench".into(),
        version: env!("CARGO_PKG_VERSION").into(),
        mode: "compare".into(),
        command: command_line(),
        machine: Machine::current(),
        workload,
        time_scale,
        concurrency: settings.concurrency,
        rate: settings.rate,
        setup: Some(Setup {
            engines: settings.engines,
            kv_cache_blocks: settings.sim.kv_cache_blocks,
            block_size: settings.sim.block_size,
            prefill_tokens_per_s: settings.sim.prefill_tokens_per_s,
            step_overhead_ms: settings.sim.step_overhead_ms,
            weights_ms_per_step: settings.sim.weights_ms_per_step,
            prefix_length: settings.prefix_length,
            concurrency_threshold: settings.concurrency_threshold,
            load_interval_ms: settings.load_interval_ms,
        }),
        oracle: Some(oracle),
        runs,
        prefix_owner_shares: Vec::new(),
        checks: Vec::new(),
        notes,
    };
    if settings.strategies.contains(&Strategy::PrefixAware) || !settings.load_balance.is_empty() {
        report.prefix_owner_shares = prefix_owner_shares(
            &trace,
            "bench",
            settings.prefix_length as usize,
            settings.engines,
        );
    }
    report.checks = checks(&report, settings.engines);
    report
        .checks
        .extend(hot_prefix_checks(&report.runs, settings.engines));
    for run in &report.runs {
        if run
            .instances_routable_at_end
            .iter()
            .any(|&count| count != settings.engines)
        {
            report.notes.push(format!(
                "{}: routers saw {:?} of {} instances at the end (health checks failed?)",
                run.label, run.instances_routable_at_end, settings.engines
            ));
        }
        if !run.stats.complete {
            report.notes.push(format!(
                "{}: the time limit stopped the run after {} of {} requests",
                run.label, run.stats.requests, report.workload.spec.requests
            ));
        }
    }
    Ok(report)
}
