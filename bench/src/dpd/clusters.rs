//! The two clusters of a topology (colocated and DPD), and one arm measured on one of them.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use switchyard_engine_sim::SimConfig;

use super::args::{DpdSettings, Load, Topology};
use super::report::{ArmReport, DecisionCheck};
use crate::client::HttpClient;
use crate::report::RunStats;
use crate::run::{RunConfig, run};
use crate::sim::load_interval_for;
use crate::stats::Latency;
use crate::workload::Trace;
use switchyard_cluster::{ClusterDisaggregation, ClusterSpec, ClusterTuning, LocalCluster};

pub fn colocated_spec(settings: &DpdSettings, topology: Topology) -> ClusterSpec {
    ClusterSpec {
        engines: settings.colocated_engines.unwrap_or(topology.engines()),
        routers: 1,
        endpoint: "colocated".into(),
        variants_json: switchyard_cluster::variants_json("LEAST_OUTSTANDING_REQUESTS", None),
        sim: sim_config(settings),
        ..ClusterSpec::default()
    }
}

pub fn dpd_spec(settings: &DpdSettings, topology: Topology) -> ClusterSpec {
    let variants = serde_json::json!([
        {"VariantName": "prefill", "ModelName": "sim", "InitialInstanceCount": topology.prefill},
        {"VariantName": "decode", "ModelName": "sim", "InitialInstanceCount": topology.decode},
    ]);
    let disaggregation = serde_json::json!({
        "PrefillVariantName": "prefill",
        "DecodeVariantName": "decode",
        "RouteThreshold": settings.threshold,
        "PrefillRoutingStrategy": "ROUND_ROBIN",
        "DecodeRoutingStrategy": "LEAST_OUTSTANDING_REQUESTS",
        "KvTransferProtocol": "NIXL",
    });
    ClusterSpec {
        engines: topology.engines(),
        routers: 1,
        endpoint: "dpd".into(),
        variants_json: variants.to_string(),
        sim: sim_config(settings),
        disaggregation: Some(ClusterDisaggregation {
            config_json: disaggregation.to_string(),
            prefill_engines: topology.prefill,
        }),
        ..ClusterSpec::default()
    }
}

/// The simulator's defaults (one ml.p5.48xlarge serving a 70 B model each) on the scaled
/// clock.
fn sim_config(settings: &DpdSettings) -> SimConfig {
    SimConfig {
        time_scale: settings.time_scale,
        ..SimConfig::default()
    }
}

pub fn tuning(settings: &DpdSettings) -> ClusterTuning {
    ClusterTuning {
        // The 100 ms default, on the scaled clock.
        load_interval_ms: load_interval_for(settings.time_scale),
        ..ClusterTuning::default()
    }
}

pub async fn measure(
    settings: &DpdSettings,
    cluster: &LocalCluster,
    trace: &Arc<Trace>,
    load: &Load,
    label: String,
    client: &HttpClient,
    disaggregated: bool,
) -> anyhow::Result<ArmReport> {
    let url = cluster
        .router_urls
        .first()
        .context("the cluster has no router")?;
    let target = format!(
        "{url}/endpoints/{}/openai/v1/chat/completions",
        cluster.endpoint
    )
    .parse::<http::Uri>()?;
    let config = RunConfig {
        targets: vec![target],
        model: cluster.endpoint.clone(),
        concurrency: load.concurrency,
        rate: None,
        seed: settings.seed,
        request_timeout: settings.request_timeout,
        max_duration: Duration::from_secs(3600),
        label,
        progress: settings.progress,
    };
    let output = run(Arc::clone(trace), config, client.clone()).await?;
    // The next run starts on idle engines.
    let deadline = Instant::now() + Duration::from_secs(30);
    while cluster.in_flight() > 0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let stats = RunStats::from_output(&output, settings.time_scale);
    let tpot_wall_ms: Vec<f64> = output
        .measured
        .iter()
        .filter(|item| item.outcome.ok())
        .filter_map(|item| {
            let ttft = item.outcome.ttft?;
            let tokens = item.outcome.output_tokens();
            (tokens > 1).then(|| {
                (item.outcome.e2e.saturating_sub(ttft)).as_secs_f64() * 1e3 / f64::from(tokens - 1)
            })
        })
        .collect();
    Ok(ArmReport {
        stats,
        tpot: Latency::of(&tpot_wall_ms, settings.time_scale),
        decisions: disaggregated.then(|| DecisionCheck::of(&output, settings.threshold)),
    })
}
