//! The product targets a comparison is checked against.

use crate::output::count;
use crate::peer::Peer;
use crate::report::{Check, Report, RunReport, percent};
use crate::strategy::Strategy;
use crate::workload::WorkloadKind;

/// The product targets (PRODUCT.md), checked on the PREFIX_AWARE runs: hit rate against the
/// oracle and TTFT against RANDOM for long shared prefixes (the long-context workload),
/// instance shares and 1 vs several routers for any workload.
pub fn checks(report: &Report, engines: usize) -> Vec<Check> {
    let mut checks = Vec::new();
    let long_context = report.workload.spec.kind == WorkloadKind::LongContext;
    let prefix_runs: Vec<&RunReport> = report
        .runs
        .iter()
        .filter(|run| {
            run.strategy.as_deref() == Some(Strategy::PrefixAware.as_str())
                && run.load_balance.is_none()
        })
        .collect();
    for run in &prefix_runs {
        let routers = count(run.routers, "router");
        if let Some(fraction) = run.kv.and_then(|kv| kv.fraction_of_oracle)
            && long_context
        {
            checks.push(Check {
                what: format!("PREFIX_AWARE hit rate / oracle, {routers}"),
                target: ">= 90%".into(),
                measured: percent(fraction),
                pass: fraction >= 0.9,
            });
        }
        if let Some(change) = run
            .versus_baseline
            .as_ref()
            .and_then(|versus| versus.ttft_p50_change)
            && run
                .versus_baseline
                .as_ref()
                .is_some_and(|versus| versus.baseline != run.label)
            && long_context
        {
            checks.push(Check {
                what: format!("TTFT p50 change vs RANDOM, {routers}"),
                target: "<= -77%".into(),
                measured: format!("{:+.1}%", change * 100.0),
                pass: change <= -0.77,
            });
        }
        if let Some((min, max)) = run.stats.share_range() {
            let even = 1.0 / engines as f64;
            let off = (min - even).abs().max((max - even).abs());
            checks.push(Check {
                what: format!("PREFIX_AWARE instance shares, {routers}"),
                target: format!("within 1 point of {}", percent(even)),
                measured: format!("{}-{}", percent(min), percent(max)),
                pass: off <= 0.01,
            });
        }
    }
    checks.extend(no_drop_with_more_routers("PREFIX_AWARE", &prefix_runs));
    checks.extend(kv_aware_checks(report));
    checks
}

/// KV_AWARE's targets (issue 10), on any workload: hit rate ≥ 95% of the oracle with every
/// router count, and several routers no worse than one (within 1 point).
pub fn kv_aware_checks(report: &Report) -> Vec<Check> {
    let mut checks = Vec::new();
    let kv_runs: Vec<&RunReport> = report
        .runs
        .iter()
        .filter(|run| run.column() == Strategy::KvAware.as_str())
        .collect();
    for run in &kv_runs {
        if let Some(check) = kv_decision_check(report, run) {
            checks.extend(check);
        }
        if let Some(fraction) = run.kv.and_then(|kv| kv.fraction_of_oracle) {
            checks.push(Check {
                what: format!(
                    "KV_AWARE hit rate / oracle, {}",
                    count(run.routers, "router")
                ),
                target: ">= 95%".into(),
                measured: percent(fraction),
                pass: fraction >= 0.95,
            });
        }
    }
    checks.extend(no_drop_with_more_routers("KV_AWARE", &kv_runs));
    checks
}

/// With the token ids computed in the router (issue 27): KV_AWARE's decision p50 at most 3×
/// PREFIX_AWARE's of the same router count, its p99 over prefixes seen before at most 1 ms,
/// and no engine `/tokenize` call needed for routing (the sampled checks apart).
fn kv_decision_check(report: &Report, run: &RunReport) -> Option<Vec<Check>> {
    let cost = run.router_cost?;
    let calls = cost.tokenize_calls?;
    let routers = count(run.routers, "router");
    let prefix = report.runs.iter().find(|other| {
        other.routers == run.routers && other.column() == Strategy::PrefixAware.as_str()
    });
    let mut checks = Vec::new();
    if let (Some(ours), Some(theirs)) = (
        cost.decision,
        prefix.and_then(|prefix| prefix.router_cost?.decision),
    ) {
        checks.push(Check {
            what: format!("KV_AWARE decision p50 vs PREFIX_AWARE's, {routers}"),
            target: "<= 3x".into(),
            measured: format!(
                "{:.0} us vs {:.0} us ({:.1}x)",
                ours.p50_ms * 1e3,
                theirs.p50_ms * 1e3,
                ours.p50_ms / theirs.p50_ms.max(f64::MIN_POSITIVE)
            ),
            pass: ours.p50_ms <= 3.0 * theirs.p50_ms,
        });
    }
    if let Some(seen) = cost.decision_seen_before {
        checks.push(Check {
            what: format!("KV_AWARE decision p99, prefix seen before, {routers}"),
            target: "<= 1 ms".into(),
            measured: format!("{:.2} ms", seen.p99_ms),
            pass: seen.p99_ms <= 1.0,
        });
    }
    let routing = calls.routing;
    checks.push(Check {
        what: format!("KV_AWARE engine /tokenize calls for routing, {routers}"),
        target: "0".into(),
        measured: format!("{routing:.0}"),
        pass: routing == 0.0,
    });
    Some(checks)
}

/// The last router count's hit rate against the first's (`runs` of one strategy, in run
/// order): no drop beyond 1 point. None with a single router count.
fn no_drop_with_more_routers(strategy: &str, runs: &[&RunReport]) -> Option<Check> {
    let (first, last) = (runs.first()?, runs.last()?);
    if first.routers == last.routers {
        return None;
    }
    let (one, many) = (first.hit_rate()?, last.hit_rate()?);
    Some(Check {
        what: format!(
            "{strategy} hit rate, {} routers vs {}",
            last.routers, first.routers
        ),
        target: "no drop (within 1 point)".into(),
        measured: format!("{} vs {}", percent(many), percent(one)),
        pass: many >= one - 0.01,
    })
}

/// The hot-prefix targets (PRODUCT.md, issue 12), checked on the bounded-load runs against
/// plain PREFIX_AWARE and the SGLang gateway of the same router count: with 1 router,
/// throughput at least the gateway's, hit rate within 2 points of plain PREFIX_AWARE, and the
/// least used instance at least half a fair share; with several, hit rate ≥ 90% of the oracle.
pub fn hot_prefix_checks(report: &Report, engines: usize) -> Vec<Check> {
    let mut checks = Vec::new();
    for routers in report.router_groups() {
        let group: Vec<&RunReport> = report
            .runs
            .iter()
            .filter(|run| run.routers == routers)
            .collect();
        let plain = group.iter().find(|run| {
            run.strategy.as_deref() == Some(Strategy::PrefixAware.as_str())
                && run.load_balance.is_none()
        });
        let peer = group
            .iter()
            .find(|run| run.peer.as_deref() == Some(Peer::Sglang.name()));
        for run in group.iter().filter(|run| run.load_balance.is_some()) {
            let name = run.column();
            let routers_text = count(routers, "router");
            if routers == 1 {
                if let Some(peer) = peer {
                    let (ours, theirs) = (
                        run.stats.requests_per_s_wall,
                        peer.stats.requests_per_s_wall,
                    );
                    checks.push(Check {
                        what: format!("{name} throughput vs the SGLang gateway, {routers_text}"),
                        target: ">= 100%".into(),
                        measured: percent(ours / theirs.max(f64::MIN_POSITIVE)),
                        pass: ours >= theirs,
                    });
                }
                if let (Some(plain), Some(hit)) = (plain, run.hit_rate())
                    && let Some(plain_hit) = plain.hit_rate()
                {
                    checks.push(Check {
                        what: format!("{name} hit rate vs plain PREFIX_AWARE, {routers_text}"),
                        target: "within 2 points".into(),
                        measured: format!("{} vs {}", percent(hit), percent(plain_hit)),
                        pass: hit >= plain_hit - 0.02,
                    });
                }
                if let Some((min, _)) = run.stats.share_range() {
                    let half_fair = 0.5 / engines as f64;
                    checks.push(Check {
                        what: format!("{name} least used instance's share, {routers_text}"),
                        target: format!(">= half a fair share ({})", percent(half_fair)),
                        measured: percent(min),
                        pass: min >= half_fair,
                    });
                }
            } else if let Some(fraction) = run.kv.and_then(|kv| kv.fraction_of_oracle) {
                checks.push(Check {
                    what: format!("{name} hit rate / oracle, {routers_text}"),
                    target: ">= 90%".into(),
                    measured: percent(fraction),
                    pass: fraction >= 0.9,
                });
            }
        }
    }
    checks
}
