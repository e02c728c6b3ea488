//! How often several routers would send the same request to different instances.
//!
//! Each router adds its own live in-flight counts to the other routers' counts as the control
//! plane last reported them (up to one report interval old), so under load routers see
//! slightly different fleet-wide loads. PREFIX_AWARE's rendezvous order is the same on every
//! router; where load moves a request (past the ConcurrencyThreshold, or past the bounded-load
//! bound), routers may decide differently: for a moment when their loads differ, for longer
//! under bounded loads, where each router places and reuses copies from what it sent and
//! spilled itself. This module measures it: every few
//! milliseconds during a run, it asks every router's current routing table and load cells
//! (the same inputs and the same policy code the request path uses) where each of the
//! trace's prefixes would go, and counts the disagreements, weighted by how many of the
//! trace's requests carry each prefix.

use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;
use switchyard_policy::rank::{self, Route};
use switchyard_router::{RouterHandle, RoutingTable};
use tokio_util::sync::CancellationToken;

/// Routing keys of a trace with their share of its requests (summing to 1).
#[derive(Debug, Clone, Default)]
pub struct KeyShares(pub Vec<(u64, f64)>);

/// What the sampler found.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Disagreement {
    /// Instants sampled (every `interval_ms` of wall time while the run was going).
    pub samples: u64,
    pub interval_ms: u64,
    /// Popularity-weighted share of (instant, prefix) where two routers, averaged over every
    /// pair, would choose different instances: the chance that two requests for one prefix
    /// sent at the same instant through two different routers land apart.
    pub pairwise: f64,
    /// … where not every router would choose the same instance.
    pub any: f64,
    /// … where at least one router would move the prefix off its first choice (overflow).
    pub moving: f64,
}

/// Samples `routers` every `interval` until `stop` is cancelled.
pub async fn sample_until(
    routers: &[RouterHandle],
    endpoint: &str,
    keys: &KeyShares,
    interval: Duration,
    stop: CancellationToken,
) -> Option<Disagreement> {
    if routers.len() < 2 || keys.0.is_empty() {
        return None;
    }
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    let mut tally = Tally::default();
    loop {
        tokio::select! {
            () = stop.cancelled() => break,
            _ = ticker.tick() => {}
        }
        let tables: Vec<Arc<RoutingTable>> = routers.iter().map(RouterHandle::table).collect();
        tally.sample(
            &tables,
            endpoint,
            keys,
            switchyard_process::clock::unix_ms(),
        );
    }
    Some(tally.finish(interval))
}

#[derive(Debug, Default)]
struct Tally {
    samples: u64,
    pairwise: f64,
    any: f64,
    moving: f64,
}

impl Tally {
    fn sample(&mut self, tables: &[Arc<RoutingTable>], endpoint: &str, keys: &KeyShares, now: u64) {
        // Per router: the first variant's views, loads and strategy, read once per instant.
        let mut routers = Vec::with_capacity(tables.len());
        for table in tables {
            let Some(variant) = table
                .endpoints
                .get(endpoint)
                .and_then(|endpoint| endpoint.variants.first())
            else {
                return;
            };
            let views = variant.current_views(now);
            let loads: Vec<u32> = variant
                .instances
                .iter()
                .map(|instance| instance.cell.fleet_load())
                .collect();
            routers.push((variant, views, loads));
        }
        let mut choices: Vec<(&str, Option<Route>)> = Vec::with_capacity(routers.len());
        let pairs = (routers.len() * (routers.len() - 1) / 2) as f64;
        let clock = switchyard_process::clock::monotonic_ms();
        for &(key, weight) in &keys.0 {
            choices.clear();
            for (variant, views, loads) in &routers {
                // What this router knows of the key, as when it routes.
                let history = variant.key_history(key, clock);
                let ranking =
                    rank::rank_remembering(variant.strategy, views, |i| loads[i], key, 0, history);
                let Some(first) = ranking.first() else {
                    return;
                };
                choices.push((variant.instances[first].id.as_str(), ranking.route));
            }
            let mut differing = 0usize;
            for (index, (a, _)) in choices.iter().enumerate() {
                differing += choices[index + 1..].iter().filter(|(b, _)| a != b).count();
            }
            self.pairwise += weight * differing as f64 / pairs;
            if differing > 0 {
                self.any += weight;
            }
            if choices
                .iter()
                .any(|(_, route)| *route == Some(Route::Overflow))
            {
                self.moving += weight;
            }
        }
        self.samples += 1;
    }

    fn finish(self, interval: Duration) -> Disagreement {
        let samples = self.samples.max(1) as f64;
        Disagreement {
            samples: self.samples,
            interval_ms: interval.as_millis() as u64,
            pairwise: self.pairwise / samples,
            any: self.any / samples,
            moving: self.moving / samples,
        }
    }
}
