//! `switchyard-bench dpd`: disaggregated prefill/decode against colocated engines, in the shape
//! of the source article's benchmark (`seeds/002_*`: fixed-length long prompts and 256 output
//! tokens at concurrency 8, 16 and 32, DPD 1P1D against a colocated baseline).
//!
//! For each topology `PpDd` two fresh in-process clusters run side by side (control plane on
//! an embedded store, one router, simulated engines): **colocated**, `p + d` engines of role
//! both behind one LEAST_OUTSTANDING_REQUESTS variant, and **DPD**, `p` prefill and `d` decode
//! engines behind a disaggregated endpoint (`RouteThreshold`, ROUND_ROBIN prefill, least
//! outstanding decode, NIXL hand-offs). Every load runs on the colocated cluster, then on the
//! DPD one, with the same trace, so each ratio compares two runs made one after the other.
//!
//! Prompts are single user messages of common English words, each exactly one token both for
//! the router's tokenizer (cl100k_base, with its leading space) and for the simulator's, so the
//! router decides on the count the engines work on. Every long prompt is checked before the
//! run to count at least 1.25 × the threshold with the router's own counting code
//! (`plan::count_prompt`), and every answer's decision headers are checked after it: long
//! prompts `x-switchyard-route: disaggregated` with `x-switchyard-prompt-tokens` at or past
//! the threshold, short ones `direct`.
//!
//! TPOT is per request, (e2e − TTFT) / (output tokens − 1); ITL is every gap between two
//! streamed tokens. Latencies are in model ms (wall ms / time scale), throughput in output
//! tokens per model second.

use std::sync::Arc;
use std::time::Instant;

use anyhow::Context as _;
use switchyard_router::parts::TokenCounters;

use crate::client::http_client;
use crate::error::UsageError;
use crate::output::Invocation;
use switchyard_cluster::LocalCluster;

mod args;
mod chart;
mod clusters;
mod prompts;
mod report;

pub use args::{
    DpdArgs, DpdArgsError, DpdSettings, Load, MIN_LONG_FACTOR, Topology, TopologyError,
};
pub use chart::render_chart;
pub use report::{ArmReport, Changes, DecisionCheck, DpdPoint, DpdReport, PromptCounts};

use clusters::{colocated_spec, dpd_spec, measure, tuning};
use prompts::{trace, vocabulary};

/// Runs every topology on every load, colocated then DPD.
pub async fn dpd_compare(settings: &DpdSettings) -> anyhow::Result<DpdReport> {
    let started = Instant::now();
    let tokenizers = TokenCounters::new(None);
    let tokenizer = tokenizers.get(switchyard_shared::disaggregation::DEFAULT_TOKENIZER);
    let words = vocabulary(&tokenizer);
    anyhow::ensure!(
        words.len() >= 64,
        "only {} one-token words for the prompts",
        words.len()
    );
    let mut counts = None;
    let mut traces = Vec::with_capacity(settings.loads.len());
    for (index, load) in settings.loads.iter().enumerate() {
        let trace = trace(settings, index, load, &tokenizer, &words, &mut counts)?;
        traces.push(Arc::new(trace));
    }
    let prompts = counts.context("no long prompt in any load")?;
    let minimum = (f64::from(settings.threshold) * MIN_LONG_FACTOR).ceil() as usize;
    anyhow::ensure!(
        prompts.long_router_min >= minimum,
        "a long prompt counts {} tokens for the router, under 1.25 × the threshold ({minimum})",
        prompts.long_router_min
    );

    let client = http_client();
    let mut points = Vec::new();
    let mut notes = Vec::new();
    for &topology in &settings.topologies {
        let colocated =
            LocalCluster::start_with(colocated_spec(settings, topology), tuning(settings))
                .await
                .context("cannot start the colocated cluster")?;
        let disaggregated =
            match LocalCluster::start_with(dpd_spec(settings, topology), tuning(settings)).await {
                Ok(cluster) => cluster,
                Err(err) => {
                    colocated.shutdown().await;
                    return Err(err.context("cannot start the disaggregated cluster"));
                }
            };
        let mut result = Ok(());
        for (load, trace) in settings.loads.iter().zip(&traces) {
            let name = topology.name();
            // Boxed: a run is a large future.
            let arm = |cluster, kind: &str, disaggregated| {
                let label = format!("{name} {} {kind}", load.name);
                Box::pin(measure(
                    settings,
                    cluster,
                    trace,
                    load,
                    label,
                    &client,
                    disaggregated,
                ))
            };
            let colocated_arm = arm(&colocated, "colocated", false).await;
            let dpd_arm = arm(&disaggregated, "DPD", true).await;
            match (colocated_arm, dpd_arm) {
                (Ok(colocated), Ok(dpd)) => {
                    if let Some(check) = &dpd.decisions
                        && !check.holds()
                    {
                        notes.push(format!(
                            "{name} {}: {} of {} long prompts disaggregated, {} of {} short direct",
                            load.name,
                            check.long_disaggregated,
                            check.long,
                            check.short_direct,
                            check.short
                        ));
                    }
                    points.push(DpdPoint {
                        topology,
                        colocated_engines: settings.colocated_engines.unwrap_or(topology.engines()),
                        load: load.clone(),
                        change: Changes::of(&colocated, &dpd),
                        colocated,
                        dpd,
                    });
                }
                (Err(err), _) | (_, Err(err)) => {
                    result = Err(err);
                    break;
                }
            }
        }
        colocated.shutdown().await;
        disaggregated.shutdown().await;
        result?;
    }
    Ok(DpdReport {
        invocation: Invocation::current(format!("switchyard-bench {}", env!("CARGO_PKG_VERSION"))),
        threshold: settings.threshold,
        long_tokens: settings.long_tokens,
        output_tokens: settings.output_tokens,
        time_scale: settings.time_scale,
        prompts,
        points,
        seconds: started.elapsed().as_secs_f64(),
        notes,
    })
}

/// `switchyard-bench dpd`.
pub async fn dpd(args: DpdArgs) -> anyhow::Result<DpdReport> {
    let settings = DpdSettings::from_args(&args).map_err(UsageError::new)?;
    let report = dpd_compare(&settings).await?;
    crate::output::print_stdout(&report.table());
    if let Some(path) = &args.json {
        let json = serde_json::to_string_pretty(&report)?;
        std::fs::write(path, json).with_context(|| format!("cannot write {}", path.display()))?;
    }
    if let Some(path) = &args.svg {
        std::fs::write(path, render_chart(&report))
            .with_context(|| format!("cannot write {}", path.display()))?;
    }
    let errors: usize = report
        .points
        .iter()
        .map(|point| point.colocated.stats.errors + point.dpd.stats.errors)
        .sum();
    anyhow::ensure!(errors == 0, "{errors} requests failed");
    anyhow::ensure!(
        report.notes.is_empty(),
        "the router did not decide as intended: {:?}",
        report.notes
    );
    Ok(report)
}
