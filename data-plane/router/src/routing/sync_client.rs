//! The router's side of `RouterSync`: keeps one stream open to a control-plane replica
//! (trying the configured URLs in turn, with backoff), applies what it receives to the
//! membership, and reports this router's in-flight counts several times a second.
//!
//! It runs on a thread of its own (`switchyard-sync`, with its own single-threaded runtime):
//! decoding the stream and applying changes never take time from the serving threads, which
//! only ever load the current table.
//!
//! Wire messages are converted to domain types as they arrive (`switchyard_proto::convert`); the
//! router announces protocol 2 and also understands control planes that speak only 1.
//!
//! Static stability: while no replica answers, the router keeps routing with the last table
//! it had. Nothing on the request path waits for the control plane. A replica whose state is
//! older than the one held (same cluster) is refused and the next one tried.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use switchyard_proto::v1 as pb;
use switchyard_proto::v1::router_sync_client::RouterSyncClient;
use switchyard_shared::InstanceKey;
use switchyard_shared::sync::{
    InstanceLoad, KeyPlacement, ROUTER_MAX_MESSAGE_BYTES, SYNC_MAX_MESSAGE_BYTES, SYNC_PROTOCOL,
    StateUpdate, StateVersion,
};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tonic::transport::{Channel, Endpoint};

use crate::observe::metrics::SyncMetrics;
use crate::routing::cells::{LoadRegistry, Remembered, mark_further, saturating_increment};
use crate::routing::membership::{ApplyError, Membership};

/// How often replaced tables and departed instances' cells are checked for freeing.
const GARBAGE_EVERY: Duration = Duration::from_secs(1);
/// A stream with no message for this long is given up (the control plane sends fleet load
/// at least once a second), and the router reconnects, to another replica if there is one.
const SILENCE_LIMIT: Duration = Duration::from_secs(10);

#[derive(Debug, Clone)]
pub struct SyncSettings {
    pub urls: Vec<String>,
    pub router_id: String,
    pub report_interval: Duration,
    pub tls_ca: Option<Vec<u8>>,
    /// Bearer token for the control plane's --router-token-file.
    pub token: Option<String>,
}

/// The sync thread. Dropping or aborting it stops the thread (it ends within a moment).
#[derive(Debug)]
pub struct SyncTask {
    stop: CancellationToken,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl SyncTask {
    /// Stops the thread without waiting for it.
    pub fn abort(mut self) {
        self.stop.cancel();
        self.thread.take();
    }

    /// Stops the thread and waits for it to end (blocking: not from a serving thread).
    pub fn join(mut self) {
        self.stop.cancel();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl Drop for SyncTask {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// Starts following the control plane on a thread of its own, until `shutdown` (or the
/// task's abort).
pub fn spawn(
    settings: SyncSettings,
    membership: Membership,
    registry: Arc<LoadRegistry>,
    metrics: Arc<SyncMetrics>,
    shutdown: CancellationToken,
) -> std::io::Result<SyncTask> {
    let stop = shutdown.child_token();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let token = stop.clone();
    let thread = std::thread::Builder::new()
        .name("switchyard-sync".into())
        .spawn(move || {
            runtime.block_on(run(settings, membership, registry, metrics, token));
            runtime.shutdown_timeout(Duration::from_secs(1));
        })?;
    Ok(SyncTask {
        stop,
        thread: Some(thread),
    })
}

/// How a stream ended.
enum Ended {
    /// The control plane closed it.
    Closed,
    /// It could not be opened, or broke.
    Failed(String),
    /// The control plane's state is older than ours: try another.
    Stale(ApplyError),
}

/// Follows the control plane until `shutdown`, on the calling runtime.
pub async fn run(
    settings: SyncSettings,
    mut membership: Membership,
    registry: Arc<LoadRegistry>,
    metrics: Arc<SyncMetrics>,
    shutdown: CancellationToken,
) {
    // Tells this process from another one using the same --router-id.
    let incarnation = fastrand::u64(1..);
    let mut backoff = Duration::from_millis(100);
    let mut attempt = 0usize;
    while !shutdown.is_cancelled() {
        let url = &settings.urls[attempt % settings.urls.len()];
        attempt += 1;
        let ended = tokio::select! {
            () = shutdown.cancelled() => return,
            ended = follow(url, &settings, incarnation, &mut membership, &registry, &metrics) => ended,
        };
        membership.abandon_staged();
        let was_synced = metrics.connected.swap(false, Ordering::Relaxed);
        // Other routers' load is unknown from now on: count only our own rather than keep
        // figures that can only grow stale (a frozen "10 in flight" would push every prefix
        // off its instance for the whole outage).
        apply_fleet_load(&registry, &[]);
        if was_synced {
            // A stream that worked for a while and broke: reconnect at once.
            backoff = Duration::from_millis(100);
        }
        match ended {
            Ended::Closed => {
                tracing::warn!(control_plane = %url, "sync stream ended; reconnecting (routing continues on the last state)");
            }
            Ended::Failed(err) => {
                tracing::warn!(control_plane = %url, error = %err, retry_in = ?backoff, "control plane unreachable; routing continues on the last state");
            }
            Ended::Stale(err) => {
                metrics
                    .stale_snapshots_refused
                    .fetch_add(1, Ordering::Relaxed);
                tracing::warn!(control_plane = %url, error = %err, "refused a stale snapshot; trying another control plane");
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

/// Why a control plane could not be reached.
#[derive(Debug, thiserror::Error)]
enum ConnectError {
    #[error("bad URL: {0}")]
    Url(tonic::transport::Error),
    #[error("TLS: {0}")]
    Tls(tonic::transport::Error),
    #[error("{0}")]
    Connect(tonic::transport::Error),
}

async fn connect(url: &str, settings: &SyncSettings) -> Result<Channel, ConnectError> {
    let mut endpoint = Endpoint::from_shared(url.to_owned())
        .map_err(ConnectError::Url)?
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
            .map_err(ConnectError::Tls)?;
    }
    endpoint.connect().await.map_err(ConnectError::Connect)
}

/// A received message as domain types.
enum Received {
    State(StateVersion, StateUpdate),
    FleetLoad(Vec<InstanceLoad>),
    Placements(Vec<KeyPlacement>),
    Nothing,
}

fn receive(message: pb::SyncMessage) -> Received {
    use pb::sync_message::Message;
    let version = StateVersion {
        cluster: message.cluster_id,
        revision: message.version,
    };
    let converted = match message.message {
        None => return Received::Nothing,
        Some(Message::FleetLoad(fleet)) => {
            let (loads, skipped) = switchyard_proto::convert::instance_loads(fleet.loads);
            if skipped > 0 {
                tracing::debug!(skipped, "fleet load names unreadable instances; ignored");
            }
            return Received::FleetLoad(loads);
        }
        Some(Message::Placements(placed)) => {
            let (placements, skipped) =
                switchyard_proto::convert::key_placements(placed.placements);
            if skipped > 0 {
                tracing::debug!(skipped, "key placements name unreadable instances; ignored");
            }
            return Received::Placements(placements);
        }
        Some(Message::Update(update)) => switchyard_proto::convert::state_update(update),
        Some(legacy) => match switchyard_proto::convert::legacy_state_update(legacy) {
            Some(converted) => converted,
            None => return Received::Nothing,
        },
    };
    let (update, errors) = converted;
    for err in errors {
        tracing::warn!(error = %err, "ignored an unreadable part of a sync message");
    }
    Received::State(version, update)
}

async fn follow(
    url: &str,
    settings: &SyncSettings,
    incarnation: u64,
    membership: &mut Membership,
    registry: &LoadRegistry,
    metrics: &SyncMetrics,
) -> Ended {
    let channel = match connect(url, settings).await {
        Ok(channel) => channel,
        Err(err) => return Ended::Failed(err.to_string()),
    };
    let mut client = RouterSyncClient::new(channel)
        .max_decoding_message_size(SYNC_MAX_MESSAGE_BYTES)
        .max_encoding_message_size(ROUTER_MAX_MESSAGE_BYTES);
    let (outbound, receiver) = mpsc::channel::<pb::RouterMessage>(16);
    let hello = pb::RouterMessage {
        message: Some(pb::router_message::Message::Hello(pb::RouterHello {
            router_id: settings.router_id.clone(),
            protocol: SYNC_PROTOCOL,
            incarnation,
        })),
    };
    if outbound.send(hello).await.is_err() {
        return Ended::Failed("stream closed".into());
    }
    let mut request = tonic::Request::new(tokio_stream::wrappers::ReceiverStream::new(receiver));
    if let Some(token) = &settings.token {
        let Ok(value) = format!("Bearer {token}").parse() else {
            return Ended::Failed("the control-plane token cannot be sent in a header".into());
        };
        request.metadata_mut().insert("authorization", value);
    }
    let status = |status: tonic::Status| format!("{}: {}", status.code(), status.message());
    let mut inbound = match client.sync(request).await {
        Ok(response) => response.into_inner(),
        Err(err) => return Ended::Failed(status(err)),
    };
    forget_placements(registry);
    let mut reports = tokio::time::interval(settings.report_interval);
    reports.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut garbage = tokio::time::interval(GARBAGE_EVERY);
    garbage.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last_report: Option<Vec<InstanceLoad>> = None;
    let mut since_report = 0u32;
    // The control plane sends fleet load at least once a second: a stream silent for longer
    // than SILENCE_LIMIT is stuck (HTTP/2 pings may still pass), and another replica is tried.
    let silence = tokio::time::sleep(SILENCE_LIMIT);
    tokio::pin!(silence);
    loop {
        tokio::select! {
            () = &mut silence => {
                return Ended::Failed(format!(
                    "no message from the control plane for {} s",
                    SILENCE_LIMIT.as_secs()
                ));
            }
            message = inbound.message() => {
                let message = match message {
                    Ok(Some(message)) => message,
                    Ok(None) => return Ended::Closed,
                    Err(err) => return Ended::Failed(status(err)),
                };
                silence.as_mut().reset(tokio::time::Instant::now() + SILENCE_LIMIT);
                metrics.last_message_ms.store(switchyard_process::clock::unix_ms(), Ordering::Relaxed);
                let replica = message.replica_id.clone();
                match receive(message) {
                    Received::Nothing => {}
                    Received::FleetLoad(loads) => apply_fleet_load(registry, &loads),
                    Received::Placements(placements) => {
                        let learned = apply_placements(registry, &placements);
                        metrics.placements_learned.fetch_add(learned, Ordering::Relaxed);
                    }
                    Received::State(version, update) => {
                        let started = Instant::now();
                        let applied = match membership.apply(version, &update) {
                            Ok(applied) => applied,
                            Err(err @ ApplyError::Stale { .. }) => return Ended::Stale(err),
                            Err(err) => return Ended::Failed(err.to_string()),
                        };
                        metrics.apply_seconds.observe(started.elapsed().as_secs_f64());
                        metrics.updates_applied.fetch_add(1, Ordering::Relaxed);
                        if let Some((before, now)) = &applied.cluster_changed {
                            metrics.cluster_changes.fetch_add(1, Ordering::Relaxed);
                            tracing::warn!(control_plane = %url, before = %before, now = %now, "the control plane serves another cluster (its store was recreated?); taking its state");
                        }
                        if applied.swapped {
                            metrics.swaps.send_modify(|swaps| *swaps += 1);
                            if !metrics.connected.swap(true, Ordering::Relaxed) {
                                tracing::info!(control_plane = %url, replica = %replica, instances = membership.instance_count(), "synced with control plane");
                            }
                        }
                    }
                }
            }
            _ = garbage.tick() => membership.collect_garbage(),
            _ = reports.tick() => {
                let loads = local_loads(registry);
                since_report += 1;
                // Unchanged reports are skipped, but one goes out every second regardless so
                // the control plane knows this router is alive.
                let heartbeat_due = u128::from(since_report) * settings.report_interval.as_millis() >= 1000;
                if last_report.as_ref() != Some(&loads) || heartbeat_due {
                    since_report = 0;
                    let message = pb::RouterMessage {
                        message: Some(pb::router_message::Message::Load(pb::LoadReport {
                            loads: loads.iter().map(Into::into).collect(),
                        })),
                    };
                    // Never wait here: a router blocked on sending stops reading the stream,
                    // and a control plane blocked on a full stream stops reading reports. A
                    // report that does not fit is skipped; the next one carries the same
                    // figures.
                    match outbound.try_send(message) {
                        Ok(()) => last_report = Some(loads),
                        Err(tokio::sync::mpsc::error::TrySendError::Full(_)) => {
                            metrics.reports_skipped.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(tokio::sync::mpsc::error::TrySendError::Closed(_)) => return Ended::Closed,
                    }
                }
                // Then the key placements, after the load report and only into room the
                // reports do not need: placements that find none wait for the next tick (at
                // most MOST_ANNOUNCED per instance; past that, new ones are dropped).
                let sent = send_placements(registry, &outbound);
                metrics.placements_announced.fetch_add(sent, Ordering::Relaxed);
            }
        }
    }
}

fn local_loads(registry: &LoadRegistry) -> Vec<InstanceLoad> {
    let mut loads = Vec::new();
    registry.for_each(|key, cell| {
        let in_flight = cell.local.load(Ordering::Relaxed);
        if in_flight > 0 {
            loads.push(InstanceLoad {
                key: key.clone(),
                in_flight,
            });
        }
    });
    loads.sort_by(|a, b| a.key.cmp(&b.key));
    loads
}

/// The most placements in one message (the control plane takes at most 4,096 from one).
const PLACEMENTS_PER_MESSAGE: usize = 4096;
/// Room in the stream's send queue that placements leave to load reports.
const ROOM_FOR_REPORTS: usize = 4;

/// Sends the key placements the routing tables queued, in messages of at most
/// [`PLACEMENTS_PER_MESSAGE`], while the stream's send queue has more than
/// [`ROOM_FOR_REPORTS`] free; what finds no room stays queued. Returns how many were sent.
fn send_placements(registry: &LoadRegistry, outbound: &mpsc::Sender<pb::RouterMessage>) -> u64 {
    let mut sent = 0;
    while outbound.capacity() > ROOM_FOR_REPORTS {
        let mut placements = Vec::new();
        registry.for_each(|instance, cell| {
            let room = PLACEMENTS_PER_MESSAGE - placements.len();
            placements.extend(cell.announced.take(room).into_iter().map(|(key, further)| {
                KeyPlacement {
                    instance: instance.clone(),
                    key,
                    further,
                }
            }));
        });
        if placements.is_empty() {
            break;
        }
        let count = placements.len() as u64;
        let message = pb::RouterMessage {
            message: Some(pb::router_message::Message::Placements(pb::KeyPlacements {
                placements: placements.iter().map(Into::into).collect(),
            })),
        };
        // Only this task sends, and there was room: this fails only on a closed stream,
        // whose end the loop sees next.
        if outbound.try_send(message).is_err() {
            break;
        }
        sent += count;
    }
    sent
}

/// Forgets the placements still queued (a new stream starts from what happens on it: older
/// ones would reach the other routers as if they had just happened).
fn forget_placements(registry: &LoadRegistry) {
    registry.for_each(|_, cell| {
        cell.announced.take(usize::MAX);
    });
}

/// Remembers the keys other routers placed, as if this router had sent them there (a copy it
/// did not know of counts among the instance's copies, and a further copy as one this router
/// placed); how many named an instance this router knows.
pub fn apply_placements(registry: &LoadRegistry, placements: &[KeyPlacement]) -> u64 {
    let now_ms = switchyard_process::clock::monotonic_ms();
    let mut learned = 0;
    for placement in placements {
        if let Some(cell) = registry.find(&placement.instance) {
            if cell.spills.remember(placement.key, now_ms) == Remembered::New {
                saturating_increment(&cell.copies);
                if placement.further {
                    mark_further(&cell.further);
                }
            }
            learned += 1;
        }
    }
    learned
}

/// Sets every cell's remote count from the control plane's figures (absent means zero).
pub fn apply_fleet_load(registry: &LoadRegistry, loads: &[InstanceLoad]) {
    let figures: HashMap<&InstanceKey, u32> = loads
        .iter()
        .map(|load| (&load.key, load.in_flight))
        .collect();
    registry.for_each(|key, cell| {
        let remote = figures.get(key).copied().unwrap_or(0);
        if cell.remote.swap(remote, Ordering::Relaxed) > remote {
            cell.slot_freed();
        }
    });
}
