//! The router's side of `RouterSync`: keeps one stream open to a control-plane replica
//! (trying the configured URLs in turn, with backoff), applies what it receives to the
//! membership, and reports this router's in-flight counts several times a second.
//!
//! Static stability: while no replica answers, the router keeps routing with the last table
//! it had. Nothing on the request path waits for the control plane.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use switchyard_proto::v1 as pb;
use switchyard_proto::v1::router_sync_client::RouterSyncClient;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tonic::transport::{Channel, Endpoint};

use crate::membership::Membership;
use crate::table::LoadRegistry;

#[derive(Debug, Clone)]
pub struct SyncSettings {
    pub urls: Vec<String>,
    pub router_id: String,
    pub report_interval: Duration,
    pub tls_ca: Option<Vec<u8>>,
    /// Bearer token for the control plane's --router-token-file.
    pub token: Option<String>,
}

/// Follows the control plane until `shutdown`.
pub async fn run(
    settings: SyncSettings,
    mut membership: Membership,
    registry: Arc<LoadRegistry>,
    connected: Arc<AtomicBool>,
    shutdown: CancellationToken,
) {
    let mut backoff = Duration::from_millis(100);
    let mut attempt = 0usize;
    while !shutdown.is_cancelled() {
        let url = &settings.urls[attempt % settings.urls.len()];
        attempt += 1;
        let outcome = tokio::select! {
            () = shutdown.cancelled() => return,
            outcome = follow(url, &settings, &mut membership, &registry, &connected) => outcome,
        };
        let was_synced = connected.swap(false, Ordering::Relaxed);
        // Other routers' load is unknown from now on: count only our own rather than keep
        // figures that can only grow stale (a frozen "10 in flight" would push every prefix
        // off its instance for the whole outage).
        apply_fleet_load(&registry, &pb::FleetLoad::default());
        if was_synced {
            // A stream that worked for a while and broke: reconnect at once.
            backoff = Duration::from_millis(100);
        }
        match outcome {
            Ok(()) => {
                tracing::warn!(control_plane = %url, "sync stream ended; reconnecting (routing continues on the last state)");
            }
            Err(err) => {
                tracing::warn!(control_plane = %url, error = %err, retry_in = ?backoff, "control plane unreachable; routing continues on the last state");
            }
        }
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = tokio::time::sleep(backoff) => {}
        }
        if !was_synced {
            backoff = (backoff * 2).min(Duration::from_secs(5));
        }
    }
}

async fn connect(url: &str, settings: &SyncSettings) -> Result<Channel, String> {
    let mut endpoint = Endpoint::from_shared(url.to_owned())
        .map_err(|err| format!("bad URL: {err}"))?
        .connect_timeout(Duration::from_secs(2))
        .tcp_nodelay(true)
        .http2_keep_alive_interval(Duration::from_secs(5))
        .keep_alive_timeout(Duration::from_secs(3))
        .keep_alive_while_idle(true);
    if let Some(ca) = &settings.tls_ca {
        endpoint = endpoint
            .tls_config(
                tonic::transport::ClientTlsConfig::new()
                    .ca_certificate(tonic::transport::Certificate::from_pem(ca)),
            )
            .map_err(|err| format!("TLS: {err}"))?;
    }
    endpoint.connect().await.map_err(|err| err.to_string())
}

async fn follow(
    url: &str,
    settings: &SyncSettings,
    membership: &mut Membership,
    registry: &LoadRegistry,
    connected: &AtomicBool,
) -> Result<(), String> {
    let channel = connect(url, settings).await?;
    let mut client = RouterSyncClient::new(channel);
    let (outbound, receiver) = mpsc::channel::<pb::RouterMessage>(16);
    outbound
        .send(pb::RouterMessage {
            message: Some(pb::router_message::Message::Hello(pb::RouterHello {
                router_id: settings.router_id.clone(),
            })),
        })
        .await
        .map_err(|_| "stream closed".to_owned())?;
    let mut request = tonic::Request::new(tokio_stream::wrappers::ReceiverStream::new(receiver));
    if let Some(token) = &settings.token {
        let value = format!("Bearer {token}")
            .parse()
            .map_err(|_| "the control-plane token cannot be sent in a header".to_owned())?;
        request.metadata_mut().insert("authorization", value);
    }
    let mut inbound = client
        .sync(request)
        .await
        .map_err(|status| format!("{}: {}", status.code(), status.message()))?
        .into_inner();
    let mut reports = tokio::time::interval(settings.report_interval);
    reports.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last_report: Option<Vec<pb::InstanceLoad>> = None;
    let mut since_report = 0u32;
    loop {
        tokio::select! {
            message = inbound.message() => {
                let message = message.map_err(|status| format!("{}: {}", status.code(), status.message()))?;
                let Some(message) = message else { return Ok(()) };
                if !connected.swap(true, Ordering::Relaxed) {
                    tracing::info!(control_plane = %url, replica = %message.replica_id, "synced with control plane");
                }
                match message.message {
                    Some(pb::sync_message::Message::FleetLoad(fleet)) => apply_fleet_load(registry, &fleet),
                    _ => membership.apply(message),
                }
            }
            _ = reports.tick() => {
                let loads = local_loads(registry);
                since_report += 1;
                // Unchanged reports are skipped, but one goes out every second regardless so
                // the control plane knows this router is alive.
                let heartbeat_due = u128::from(since_report) * settings.report_interval.as_millis() >= 1000;
                if last_report.as_ref() == Some(&loads) && !heartbeat_due {
                    continue;
                }
                since_report = 0;
                let message = pb::RouterMessage {
                    message: Some(pb::router_message::Message::Load(pb::LoadReport { loads: loads.clone() })),
                };
                if outbound.send(message).await.is_err() {
                    return Ok(());
                }
                last_report = Some(loads);
            }
        }
    }
}

fn local_loads(registry: &LoadRegistry) -> Vec<pb::InstanceLoad> {
    let mut loads = Vec::new();
    registry.for_each(|(endpoint, id), cell| {
        let in_flight = cell.local.load(Ordering::Relaxed);
        if in_flight > 0 {
            loads.push(pb::InstanceLoad {
                endpoint_name: endpoint.to_string(),
                instance_id: id.to_string(),
                in_flight,
            });
        }
    });
    loads.sort_by(|a, b| {
        (&a.endpoint_name, &a.instance_id).cmp(&(&b.endpoint_name, &b.instance_id))
    });
    loads
}

/// Sets every cell's remote count from the control plane's figures (absent means zero).
pub fn apply_fleet_load(registry: &LoadRegistry, fleet: &pb::FleetLoad) {
    let figures: HashMap<(&str, &str), u32> = fleet
        .loads
        .iter()
        .map(|load| {
            (
                (load.endpoint_name.as_str(), load.instance_id.as_str()),
                load.in_flight,
            )
        })
        .collect();
    registry.for_each(|(endpoint, id), cell| {
        let remote = figures
            .get(&(endpoint.as_str(), id.as_str()))
            .copied()
            .unwrap_or(0);
        cell.remote.store(remote, Ordering::Relaxed);
    });
}
