//! Active health checks, run by the leader only: every instance is probed with
//! `GET {url}{HealthCheckConfig.Path}` (vLLM serves `/health`) at the endpoint's interval.
//! `UnhealthyThreshold` consecutive failures mark it unhealthy (routers stop sending to it),
//! `HealthyThreshold` consecutive successes mark it healthy again; a new instance becomes
//! healthy at its first success. Transitions are written to the store, so every replica and
//! every router sees them.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Empty;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use switchyard_shared::{EndpointName, Health, InstanceId, InstanceProtocol};
use tokio::sync::watch;
use tokio::task::JoinSet;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::registry::Registry;
use crate::state::{ProbeTarget, StateCache};
use crate::store::Revision;

const TICK: Duration = Duration::from_millis(50);
/// Probes in flight at once.
const MAX_CONCURRENT_PROBES: usize = 256;

type HttpClient = Client<HttpConnector, Empty<Bytes>>;

#[derive(Debug, Default)]
struct Tracker {
    next_due: Option<Instant>,
    in_flight: bool,
    successes: u32,
    failures: u32,
}

struct ProbeResult {
    key: (EndpointName, InstanceId),
    outcome: Result<(), String>,
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
    let key = (
        target.instance.endpoint_name.clone(),
        target.instance.instance_id.clone(),
    );
    let url = format!("{}{}", target.instance.url, target.health_check.path);
    let timeout = Duration::from_millis(u64::from(target.health_check.timeout_ms));
    let outcome = match url.parse::<http::Uri>() {
        Err(err) => Err(format!("bad probe URL {url}: {err}")),
        Ok(uri) => match tokio::time::timeout(timeout, client.get(uri)).await {
            Err(_) => Err(format!("no answer within {timeout:?}")),
            Ok(Err(err)) => Err(describe_client_error(&err)),
            Ok(Ok(response)) if response.status().is_success() => Ok(()),
            Ok(Ok(response)) => Err(format!("status {}", response.status())),
        },
    };
    ProbeResult { key, outcome }
}

/// The innermost cause reads best ("Connection refused (os error 111)").
fn describe_client_error(err: &hyper_util::client::legacy::Error) -> String {
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
    shutdown: CancellationToken,
) {
    let client = clients();
    let mut trackers: HashMap<(EndpointName, InstanceId), Tracker> = HashMap::new();
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
                start_due_probes(&client, targets, &mut trackers, &mut probes);
            }
            Some(result) = probes.join_next(), if !probes.is_empty() => {
                let Ok(result) = result else { continue };
                record(&registry, &cache, &mut trackers, result, fence).await;
            }
        }
    }
}

fn start_due_probes(
    client: &Clients,
    targets: Vec<ProbeTarget>,
    trackers: &mut HashMap<(EndpointName, InstanceId), Tracker>,
    probes: &mut JoinSet<ProbeResult>,
) {
    let now = Instant::now();
    let live: std::collections::HashSet<_> = targets
        .iter()
        .map(|target| {
            (
                target.instance.endpoint_name.clone(),
                target.instance.instance_id.clone(),
            )
        })
        .collect();
    trackers.retain(|key, _| live.contains(key));
    for target in targets {
        if probes.len() >= MAX_CONCURRENT_PROBES {
            break;
        }
        let key = (
            target.instance.endpoint_name.clone(),
            target.instance.instance_id.clone(),
        );
        let tracker = trackers.entry(key).or_default();
        if tracker.in_flight || tracker.next_due.is_some_and(|due| due > now) {
            continue;
        }
        tracker.in_flight = true;
        tracker.next_due =
            Some(now + Duration::from_millis(u64::from(target.health_check.interval_ms)));
        probes.spawn(probe(client.clone(), target));
    }
}

async fn record(
    registry: &Registry,
    cache: &StateCache,
    trackers: &mut HashMap<(EndpointName, InstanceId), Tracker>,
    result: ProbeResult,
    fence: Revision,
) {
    let Some(tracker) = trackers.get_mut(&result.key) else {
        return;
    };
    tracker.in_flight = false;
    let Some(target) = cache.probe_target(result.key.0.as_str(), result.key.1.as_str()) else {
        return;
    };
    let current = target.instance.health;
    let config = &target.health_check;
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
            (next, reason.clone())
        }
    };
    if next == current {
        return;
    }
    let (endpoint, id) = &result.key;
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
