//! Active health checks, run by the leader only: every instance is probed with
//! `GET {url}{HealthCheckConfig.Path}` (vLLM serves `/health`) at the endpoint's interval.
//! `UnhealthyThreshold` consecutive failures mark it unhealthy (routers stop sending to it),
//! `HealthyThreshold` consecutive successes mark it healthy again; a new instance becomes
//! healthy at its first success. Transitions are written to the store, so every replica and
//! every router sees them.
//!
//! At most `MAX_CONCURRENT_PROBES` probes run at once. Due instances are started in turn from
//! where the last tick stopped, so when many probes hang until their timeout the others still
//! get theirs, rather than the first few hundred in name order every time.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Empty;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use switchyard_shared::{Health, InstanceKey, InstanceProtocol};
use tokio::sync::watch;
use tokio::task::JoinSet;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::metrics::ControlMetrics;
use crate::registry::Registry;
use crate::state::{ProbeTarget, StateCache};
use crate::store::Revision;

const TICK: Duration = Duration::from_millis(50);
/// Probes in flight at once.
const MAX_CONCURRENT_PROBES: usize = 256;
/// Ticks between two prunings of the trackers of departed instances.
const PRUNE_EVERY_TICKS: u64 = 20;
/// Longest failure reason recorded (it travels to every router with the instance).
const MAX_DETAIL_CHARS: usize = 256;

type HttpClient = Client<HttpConnector, Empty<Bytes>>;

#[derive(Debug, Default)]
struct Tracker {
    next_due: Option<Instant>,
    in_flight: bool,
    successes: u32,
    failures: u32,
}

struct ProbeResult {
    key: InstanceKey,
    outcome: Result<(), ProbeFailure>,
}

/// Why a probe failed: the detail recorded with an unhealthy instance.
#[derive(Debug, thiserror::Error)]
enum ProbeFailure {
    #[error("bad probe URL {url}: {source}")]
    BadUrl {
        url: String,
        source: http::uri::InvalidUri,
    },
    #[error("no answer within {0:?}")]
    Timeout(Duration),
    /// The innermost cause, which reads best ("Connection refused (os error 111)").
    #[error("{}", innermost_cause(.0))]
    Client(hyper_util::client::legacy::Error),
    #[error("status {0}")]
    Status(http::StatusCode),
}

/// Probe clients: HTTP/1.1, and h2c for instances registered with protocol h2c (the
/// control plane does not know a router's --upstream-protocol, so others get HTTP/1.1).
#[derive(Clone)]
struct Clients {
    http1: HttpClient,
    h2c: HttpClient,
}

fn clients() -> Clients {
    let build = |h2c: bool| {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(Duration::from_secs(2)));
        let mut builder = Client::builder(TokioExecutor::new());
        builder
            .pool_idle_timeout(Duration::from_secs(30))
            .pool_max_idle_per_host(1)
            .http2_only(h2c);
        builder.build(connector)
    };
    Clients {
        http1: build(false),
        h2c: build(true),
    }
}

async fn probe(clients: Clients, target: ProbeTarget) -> ProbeResult {
    let client = match target.instance.protocol {
        InstanceProtocol::H2c => clients.h2c,
        InstanceProtocol::Http1 | InstanceProtocol::Unspecified => clients.http1,
    };
    let key = InstanceKey::of(&target.instance);
    let health_check = target.health_check();
    let url = format!("{}{}", target.instance.url, health_check.path);
    let timeout = Duration::from_millis(u64::from(health_check.timeout_ms));
    let outcome = match url.parse::<http::Uri>() {
        Err(source) => Err(ProbeFailure::BadUrl { url, source }),
        Ok(uri) => match tokio::time::timeout(timeout, client.get(uri)).await {
            Err(_) => Err(ProbeFailure::Timeout(timeout)),
            Ok(Err(err)) => Err(ProbeFailure::Client(err)),
            Ok(Ok(response)) if response.status().is_success() => Ok(()),
            Ok(Ok(response)) => Err(ProbeFailure::Status(response.status())),
        },
    };
    ProbeResult { key, outcome }
}

fn innermost_cause(err: &hyper_util::client::legacy::Error) -> String {
    let mut innermost: &dyn std::error::Error = err;
    while let Some(inner) = innermost.source() {
        innermost = inner;
    }
    innermost.to_string()
}

/// Probes while this replica leads, until `shutdown`.
pub async fn run(
    registry: Registry,
    cache: Arc<StateCache>,
    mut leading: watch::Receiver<Option<Revision>>,
    metrics: Arc<ControlMetrics>,
    shutdown: CancellationToken,
) {
    let client = clients();
    let mut trackers: HashMap<InstanceKey, Tracker> = HashMap::new();
    let mut cursor = 0usize;
    let mut tick = 0u64;
    let mut probes: JoinSet<ProbeResult> = JoinSet::new();
    let mut ticks = tokio::time::interval(TICK);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let Some(fence) = *leading.borrow() else {
            trackers.clear();
            probes.abort_all();
            tokio::select! {
                () = shutdown.cancelled() => return,
                changed = leading.changed() => {
                    if changed.is_err() {
                        return;
                    }
                    continue;
                }
            }
        };
        tokio::select! {
            () = shutdown.cancelled() => {
                probes.abort_all();
                return;
            }
            _ = leading.changed() => continue,
            _ = ticks.tick() => {
                let targets = cache.probe_targets();
                // Trackers of departed instances are dropped about once a second.
                tick += 1;
                if tick.is_multiple_of(PRUNE_EVERY_TICKS) {
                    prune(&targets, &mut trackers);
                }
                let slots = MAX_CONCURRENT_PROBES.saturating_sub(probes.len());
                for target in pick_due(&targets, &mut trackers, slots, &mut cursor, Instant::now()) {
                    probes.spawn(probe(client.clone(), target));
                }
            }
            Some(result) = probes.join_next(), if !probes.is_empty() => {
                let Ok(result) = result else { continue };
                metrics.count_probe(result.outcome.is_ok());
                record(&registry, &cache, &mut trackers, result, fence).await;
            }
        }
    }
}

/// The due targets to probe now, at most `slots`, taken in turn from `cursor` (which moves
/// past the last one taken); marks them in flight and schedules their next probe.
fn pick_due(
    targets: &[ProbeTarget],
    trackers: &mut HashMap<InstanceKey, Tracker>,
    slots: usize,
    cursor: &mut usize,
    now: Instant,
) -> Vec<ProbeTarget> {
    let mut picked = Vec::new();
    if targets.is_empty() {
        return picked;
    }
    let start = *cursor % targets.len();
    for offset in 0..targets.len() {
        if picked.len() >= slots {
            break;
        }
        let index = (start + offset) % targets.len();
        let target = &targets[index];
        let tracker = trackers
            .entry(InstanceKey::of(&target.instance))
            .or_default();
        if tracker.in_flight || tracker.next_due.is_some_and(|due| due > now) {
            continue;
        }
        tracker.in_flight = true;
        tracker.next_due =
            Some(now + Duration::from_millis(u64::from(target.health_check().interval_ms)));
        picked.push(target.clone());
        *cursor = index + 1;
    }
    picked
}

/// Forgets the trackers of instances no longer there.
fn prune(targets: &[ProbeTarget], trackers: &mut HashMap<InstanceKey, Tracker>) {
    let live: std::collections::HashSet<InstanceKey> = targets
        .iter()
        .map(|target| InstanceKey::of(&target.instance))
        .collect();
    trackers.retain(|key, _| live.contains(key));
}

fn truncate(detail: &str) -> String {
    match detail.char_indices().nth(MAX_DETAIL_CHARS) {
        Some((end, _)) => format!("{}...", &detail[..end]),
        None => detail.to_owned(),
    }
}

async fn record(
    registry: &Registry,
    cache: &StateCache,
    trackers: &mut HashMap<InstanceKey, Tracker>,
    result: ProbeResult,
    fence: Revision,
) {
    let Some(tracker) = trackers.get_mut(&result.key) else {
        return;
    };
    tracker.in_flight = false;
    let Some(target) = cache.probe_target(&result.key) else {
        return;
    };
    let current = target.instance.health;
    let config = target.health_check();
    let (next, detail) = match &result.outcome {
        Ok(()) => {
            tracker.failures = 0;
            tracker.successes = tracker.successes.saturating_add(1);
            let next = match current {
                Health::Unknown => Health::Healthy,
                Health::Unhealthy if tracker.successes >= config.healthy_threshold => {
                    Health::Healthy
                }
                other => other,
            };
            (next, String::new())
        }
        Err(reason) => {
            tracker.successes = 0;
            tracker.failures = tracker.failures.saturating_add(1);
            let next = if tracker.failures >= config.unhealthy_threshold {
                Health::Unhealthy
            } else {
                current
            };
            (next, truncate(&reason.to_string()))
        }
    };
    if next == current {
        return;
    }
    let (endpoint, id) = (&result.key.endpoint, &result.key.id);
    match registry
        .set_health(endpoint, id, next, &detail, fence)
        .await
    {
        Ok(true) if next == Health::Unhealthy => {
            tracing::warn!(endpoint = %endpoint, instance = %id, reason = %detail, "instance unhealthy")
        }
        Ok(true) => {
            tracing::info!(endpoint = %endpoint, instance = %id, health = %next, "instance healthy")
        }
        Ok(false) => tracing::info!(
            endpoint = %endpoint,
            instance = %id,
            health = %next,
            "health not recorded: the instance changed or is gone, or this replica no longer leads"
        ),
        Err(err) => tracing::warn!(instance = %id, error = %err, "cannot record health"),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use switchyard_shared::Instance;

    use super::*;

    fn target(index: usize) -> ProbeTarget {
        let instance: Instance = serde_json::from_str(&format!(
            r#"{{"InstanceId":"i{index:04}","EndpointName":"chat","VariantName":"v","Url":"http://127.0.0.1:1","Weight":1.0}}"#
        ))
        .unwrap();
        ProbeTarget {
            instance: Arc::new(instance),
            config: None,
        }
    }

    #[test]
    fn when_every_probe_hangs_the_rest_still_get_their_turn() {
        let targets: Vec<ProbeTarget> = (0..1000).map(target).collect();
        let mut trackers = HashMap::new();
        let mut cursor = 0;
        let mut probed = std::collections::HashSet::new();
        let mut now = Instant::now();
        // Each round: the probes of the round before time out (they were in flight all along),
        // and 256 slots free up.
        for _ in 0..4 {
            for tracker in trackers.values_mut() {
                let tracker: &mut Tracker = tracker;
                tracker.in_flight = false;
            }
            let picked = pick_due(&targets, &mut trackers, 256, &mut cursor, now);
            assert_eq!(picked.len(), 256);
            for target in picked {
                probed.insert(target.instance.instance_id.clone());
            }
            now += Duration::from_millis(1100);
        }
        assert_eq!(
            probed.len(),
            1000,
            "every instance was probed within four rounds"
        );
    }

    #[test]
    fn long_failure_reasons_are_cut() {
        assert_eq!(truncate("refused"), "refused");
        let cut = truncate(&"é".repeat(1000));
        assert_eq!(cut.chars().count(), MAX_DETAIL_CHARS + 3);
    }
}
