//! `switchyard-bench dpd` end to end, in miniature: a colocated and a disaggregated cluster
//! (control plane, one router, simulated engines with prefill and decode roles) in this
//! process, the same traces through real HTTP on 127.0.0.1, the router's decisions checked.

use std::time::Duration;

use clap::Parser;
use switchyard_bench::{DpdArgs, DpdSettings, dpd_compare};

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    args: DpdArgs,
}

fn settings(flags: &[&str]) -> Result<DpdSettings, String> {
    let cli = Cli::try_parse_from(std::iter::once("dpd").chain(flags.iter().copied()))
        .map_err(|err| err.to_string())?;
    DpdSettings::from_args(&cli.args).map_err(|err| err.to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quick_dpd_run_disaggregates_every_long_prompt_and_reports_both_arms() {
    let settings = settings(&[
        "--quick",
        "--concurrency",
        "2",
        "--mixed-concurrency",
        "2",
        "--output-tokens",
        "16",
        "--time-scale",
        "0.05",
        "--no-progress",
    ])
    .unwrap();
    let report = tokio::time::timeout(Duration::from_secs(90), dpd_compare(&settings))
        .await
        .expect("the run finishes in time")
        .expect("the run works");

    // The prompts are long as the router counts them, and the engines see about as many.
    assert!(
        report.prompts.long_router_min >= 5120,
        "{:?}",
        report.prompts
    );
    assert!(
        report.prompts.long_engine_min >= 5000,
        "{:?}",
        report.prompts
    );
    assert!(report.prompts.short_router_max.unwrap() < 4096);
    assert_eq!(report.points.len(), 2, "long c=2 and mixed c=2 on 1P1D");
    for point in &report.points {
        for arm in [&point.colocated, &point.dpd] {
            assert_eq!(arm.stats.errors, 0, "{:?}", arm.stats.first_error);
            assert_eq!(arm.stats.ok, point.load.requests);
            assert!(arm.tpot.model_ms.p50 > 0.0);
            assert!(arm.stats.output_tokens_per_s_model > 0.0);
        }
        assert!(point.colocated.decisions.is_none());
        assert!(
            point
                .colocated
                .stats
                .routes
                .keys()
                .all(|route| route == "least-outstanding"),
            "{:?}",
            point.colocated.stats.routes
        );
        let check = point.dpd.decisions.as_ref().unwrap();
        assert!(check.holds(), "{check:?}");
        assert!(check.long > 0);
        // Counting stopped past the threshold: "N+" with N ≥ 4096.
        let header = check.min_long_header.as_deref().unwrap();
        assert!(
            header.trim_end_matches('+').parse::<u32>().unwrap() >= 4096,
            "{header}"
        );
        assert!(point.change.tpot_p50.is_some() && point.change.throughput.is_some());
    }
    let mixed = &report.points[1];
    assert!(mixed.load.name.starts_with("mixed"));
    let check = mixed.dpd.decisions.as_ref().unwrap();
    assert_eq!(check.long + check.short, mixed.load.requests);
    assert!(report.notes.is_empty(), "{:?}", report.notes);

    let table = report.table();
    assert!(table.contains("1P1D vs 2 engines"), "{table}");
    assert!(table.contains("as intended"), "{table}");
    let svg = switchyard_bench::dpd::render_chart(&report);
    assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
    assert!(svg.contains("TPOT p50"));
    serde_json::to_value(&report).unwrap();
}

#[test]
fn bad_dpd_flags_are_refused_naming_the_flag() {
    let error = settings(&["--long-tokens", "4500"]).unwrap_err();
    assert!(
        error.contains("--long-tokens") && error.contains("5120"),
        "{error}"
    );
    let error = settings(&["--topologies", "1P1D,3X"]).unwrap_err();
    assert!(error.contains("--topologies"), "{error}");
    let error = settings(&["--long-fraction", "1"]).unwrap_err();
    assert!(error.contains("--long-fraction"), "{error}");
    let quick = settings(&["--quick"]).unwrap();
    assert_eq!(quick.topologies.len(), 1);
    let full = settings(&[]).unwrap();
    assert_eq!(full.topologies.len(), 3);
    assert_eq!(full.output_tokens, 256);
    assert_eq!(full.loads.len(), 4);
    assert!(f64::from(full.long_tokens) >= 1.25 * f64::from(full.threshold));
}
