//! A short comparison end to end: a control plane, real routers and simulated engines in this
//! process, every strategy on the same trace, through real HTTP on 127.0.0.1.

use std::time::Duration;

use switchyard_bench::{
    CompareSettings, LoadBalanceSetting, Peer, Preset, Report, Strategy, compare,
};

/// The quick preset, quiet and with short time limits.
fn quick() -> CompareSettings {
    let mut settings = CompareSettings::preset(Preset::Quick);
    settings.progress = false;
    settings.max_duration = Duration::from_secs(20);
    settings.request_timeout = Duration::from_secs(10);
    settings
}

/// The comparison, within a minute.
async fn run(settings: &CompareSettings) -> Report {
    tokio::time::timeout(Duration::from_secs(60), compare(settings))
        .await
        .expect("the comparison finishes in time")
        .expect("the comparison runs")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_short_compare_reports_every_strategy_through_real_routers() {
    let settings = quick();
    assert_eq!(settings.engines, 3);
    assert!(settings.workload.requests <= 64);

    let report = run(&settings).await;

    assert_eq!(report.runs.len(), Strategy::ALL.len());
    for (run, strategy) in report.runs.iter().zip(Strategy::ALL) {
        assert_eq!(run.strategy.as_deref(), Some(strategy.as_str()));
        assert_eq!(
            run.stats.errors, 0,
            "{}: {:?}",
            run.label, run.stats.first_error
        );
        assert_eq!(run.stats.ok, settings.workload.requests, "{}", run.label);
        assert!(run.stats.complete);
        assert!(run.stats.ttft.wall_ms.p50 > 0.0);
        assert!(run.stats.ttft.model_ms.p50 >= run.stats.ttft.wall_ms.p50);
        // The instances' shares and request counts add up to the whole run.
        let (shares, requests) = run
            .stats
            .instance_shares
            .iter()
            .fold((0.0, 0), |(shares, requests), share| {
                (shares + share.share, requests + share.requests)
            });
        assert!(
            (shares - 1.0).abs() < 1e-9,
            "{}: shares sum to {shares}",
            run.label
        );
        assert_eq!(requests as usize, settings.workload.requests);
        // The engines' counters and the answers' usage agree on what was cached.
        let (kv, usage) = (run.kv.unwrap(), run.kv_from_usage.unwrap());
        assert_eq!(kv.query_tokens, usage.query_tokens, "{}", run.label);
        assert_eq!(kv.hit_tokens, usage.hit_tokens, "{}", run.label);
        assert_eq!(
            kv.query_tokens as u64, report.workload.prompt_tokens,
            "{}",
            run.label
        );
    }
    let oracle = report.oracle.unwrap();
    let hit = |strategy: Strategy| {
        report
            .runs
            .iter()
            .find(|run| run.strategy.as_deref() == Some(strategy.as_str()))
            .and_then(|run| run.hit_rate())
            .unwrap()
    };
    let (random, prefix) = (hit(Strategy::Random), hit(Strategy::PrefixAware));
    // 12 prefixes, 4 requests each, over 3 engines. PREFIX_AWARE sends every repeat to the
    // prefix's owner (4 clients never reach the threshold of 8): it reaches the oracle bound,
    // whatever the draws. RANDOM sends a repeat to an engine that saw the prefix with
    // probability 1/3, 5/9, 19/27 for the 2nd, 3rd, 4th request: 53% of the bound on average
    // without evictions (fewer hits with them), standard deviation 5.4% over 12 prefixes
    // (simulated, 200,000 draws: RANDOM reached 80% of the bound once in 200,000). So
    // PREFIX_AWARE must reach 90% of the bound (the project's target) and beat RANDOM by 20%
    // of it; a PREFIX_AWARE that routes like RANDOM fails both.
    assert!(
        prefix >= 0.9 * oracle.hit_rate,
        "PREFIX_AWARE {prefix:.3} below 90% of the oracle's {:.3}",
        oracle.hit_rate
    );
    assert!(
        prefix - random >= 0.2 * oracle.hit_rate,
        "PREFIX_AWARE {prefix:.3} barely beats RANDOM {random:.3} (oracle {:.3})",
        oracle.hit_rate
    );
    assert!(
        prefix <= oracle.hit_rate + 1e-9,
        "{prefix} above the oracle {}",
        oracle.hit_rate
    );
    for run in &report.runs {
        assert!(
            run.hit_rate().unwrap() <= oracle.hit_rate + 1e-9,
            "{}",
            run.label
        );
    }
    let run_of = |strategy: Strategy| {
        report
            .runs
            .iter()
            .find(|run| run.strategy.as_deref() == Some(strategy.as_str()))
            .unwrap()
    };
    // Every request of PREFIX_AWARE went where the rendezvous owner is unless it overflowed.
    let prefix_run = run_of(Strategy::PrefixAware);
    assert!(
        prefix_run
            .stats
            .routes
            .keys()
            .all(|route| route == "prefix" || route == "overflow")
    );
    assert_eq!(report.prefix_owner_shares.len(), 3);
    // KV_AWARE followed the engines' KV events: repeated prefixes went where they were held,
    // and each such request cost one /tokenize round trip.
    let kv_run = run_of(Strategy::KvAware);
    assert!(
        kv_run.stats.routes.get("kv").copied().unwrap_or(0) > 0,
        "{:?}",
        kv_run.stats.routes
    );
    assert!(
        kv_run
            .kv_tokenize
            .is_some_and(|tokenize| tokenize.count > 0.0)
    );
    assert!(hit(Strategy::KvAware) >= random, "KV_AWARE below RANDOM");

    let table = report.table();
    for strategy in Strategy::ALL {
        assert!(table.contains(strategy.as_str()));
    }
    let svg = switchyard_bench::svg::render(&report);
    assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
    let json = serde_json::to_value(&report).unwrap();
    assert_eq!(json["runs"].as_array().unwrap().len(), Strategy::ALL.len());
}

/// The hot-prefix comparison's machinery on the quick preset: a bounded-load PREFIX_AWARE
/// column through two routers (their agreement sampled), and a peer whose binary is missing
/// skipped with a note rather than failing the comparison.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bounded_load_column_through_two_routers_and_a_missing_peer_skipped() {
    let mut settings = quick();
    settings.strategies = Vec::new();
    settings.router_counts = vec![2];
    settings.load_balance = vec![LoadBalanceSetting {
        factor: 1.0,
        slack: 0,
    }];
    settings.peers = vec![Peer::Sglang];
    settings.sglang_bin = Some("/nonexistent/smg".into());

    let report = run(&settings).await;

    assert_eq!(report.runs.len(), 1, "the peer is skipped");
    assert!(
        report
            .notes
            .iter()
            .any(|note| note.contains("SGLang") && note.contains("skipped")),
        "{:?}",
        report.notes
    );
    let run = &report.runs[0];
    assert_eq!(run.column(), "PREFIX_AWARE c=1 s=0");
    assert_eq!(run.strategy.as_deref(), Some("PREFIX_AWARE"));
    assert_eq!(run.routers, 2);
    assert_eq!(run.stats.errors, 0, "{:?}", run.stats.first_error);
    // Every instance is listed, even one that served nothing.
    assert_eq!(run.stats.instance_shares.len(), 3);
    // With c = 1 and no slack, 4 clients over 3 instances move some requests off the owner.
    assert!(
        run.stats.routes.get("overflow").copied().unwrap_or(0) > 0,
        "{:?}",
        run.stats.routes
    );
    let disagreement = run.disagreement.expect("two routers are sampled");
    assert!(disagreement.samples > 0);
    assert!((0.0..=1.0).contains(&disagreement.pairwise));
    assert!(disagreement.pairwise <= disagreement.any + 1e-9);
    assert!(report.table().contains("PREFIX_AWARE c=1 s=0"));
    let svg = switchyard_bench::svg::render(&report);
    assert!(svg.contains("Throughput"), "the sweep chart");
}
