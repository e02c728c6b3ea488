//! The `RouterSync` service: one bidirectional stream per router. The router says hello, then
//! reports its in-flight counts; the control plane sends the routing state, then every change,
//! and the fleet-wide load of the other routers whenever it changes. This is the gRPC edge:
//! the view (`state.rs`) and the load hub (`load.rs`) deal in domain types, converted here.
//!
//! Two protocols, chosen by the router's hello (ARCHITECTURE.md has the compatibility rule):
//! - 2: the snapshot in `StateUpdate` pieces of about `SYNC_PIECE_BYTES` (configs once, then
//!   endpoints, then instances), and changes coalesced into batches: whatever changed while the
//!   previous batch was being sent goes out as one `StateUpdate`, with the net effect.
//! - 1 (routers that announce none): the whole state in one `Snapshot`, then one message per
//!   change, as before protocol 2 existed.
//!
//! A stream ends with `UNAVAILABLE` when this replica's view stops being current (its store
//! does not answer or its watch stalled), so the router moves to another replica.

use std::collections::{BTreeMap, HashMap};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::Stream;
use prost::Message as _;
use switchyard_proto::v1 as pb;
use switchyard_shared::sync::{
    Coalescer, KeyPlacement, SYNC_PIECE_BYTES, SYNC_PROTOCOL, StateChange, StateUpdate,
    StateVersion,
};
use switchyard_shared::{Endpoint, EndpointConfig, EndpointConfigName, EndpointName};
use tokio::sync::broadcast::error::{RecvError, TryRecvError};
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status, Streaming};

use crate::load::{Counts, LoadHub, MOST_PLACEMENTS_PER_MESSAGE};
use crate::metrics::ControlMetrics;
use crate::state::{Published, Readiness, StateCache, StateSnapshot};

const HELLO_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a new stream waits for this replica's first listing before it is refused.
const READY_TIMEOUT: Duration = Duration::from_secs(10);
/// Changes folded into one batch at most (a batch is then cut in pieces by size).
const MAX_BATCH_CHANGES: usize = 50_000;

/// What the sync streams did, for tests, benchmarks and logs.
#[derive(Debug, Default)]
pub struct SyncStats {
    /// Snapshots sent (first ones, and fresh ones).
    pub snapshots: AtomicU64,
    /// Fresh snapshots sent because a stream fell behind the change broadcast.
    pub fell_behind: AtomicU64,
    /// Change batches sent (protocol 2) or change messages (protocol 1).
    pub batches: AtomicU64,
    /// Changes carried by them.
    pub changes: AtomicU64,
    /// Streams refused or ended because this replica was not ready.
    pub not_ready: AtomicU64,
    /// Router streams open now.
    pub open_streams: AtomicU64,
}

#[derive(Debug)]
struct Session {
    incarnation: u64,
    connection: u64,
    /// Ends the stream (a newer stream of the same router process took over).
    end: CancellationToken,
}

/// The open stream of each router id.
#[derive(Debug, Default)]
pub struct Sessions(Mutex<HashMap<String, Session>>);

impl Sessions {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Session>> {
        self.0.lock().unwrap_or_else(|poison| poison.into_inner())
    }

    /// Registers a stream; refuses a second router process using an id that has a live
    /// stream. A reconnecting process (same incarnation, or one that does not say) replaces its
    /// old stream, which may not have noticed yet that it is dead.
    fn open(
        &self,
        router_id: &str,
        incarnation: u64,
        connection: u64,
    ) -> Result<CancellationToken, Status> {
        let mut sessions = self.lock();
        if let Some(existing) = sessions.get(router_id) {
            if incarnation != 0
                && existing.incarnation != 0
                && existing.incarnation != incarnation
                && !existing.end.is_cancelled()
            {
                return Err(Status::already_exists(format!(
                    "router id {router_id} is in use by another router process connected to this control plane; give each router its own --router-id"
                )));
            }
            existing.end.cancel();
        }
        let end = CancellationToken::new();
        sessions.insert(
            router_id.to_owned(),
            Session {
                incarnation,
                connection,
                end: end.clone(),
            },
        );
        Ok(end)
    }

    fn close(&self, router_id: &str, connection: u64) {
        let mut sessions = self.lock();
        if sessions
            .get(router_id)
            .is_some_and(|session| session.connection == connection)
        {
            sessions.remove(router_id);
        }
    }
}

#[derive(Debug, Clone)]
pub struct SyncService {
    pub replica_id: String,
    pub cache: Arc<StateCache>,
    pub load: Arc<LoadHub>,
    pub shutdown: CancellationToken,
    pub sessions: Arc<Sessions>,
    pub stats: Arc<SyncStats>,
    pub metrics: Arc<ControlMetrics>,
}

/// Removes a router from the load sums and the sessions when its stream ends, however it ends.
struct StreamGuard {
    stats: Arc<SyncStats>,
    load: Arc<LoadHub>,
    sessions: Arc<Sessions>,
    router_id: String,
    connection: u64,
}

impl Drop for StreamGuard {
    fn drop(&mut self) {
        self.stats.open_streams.fetch_sub(1, Ordering::Relaxed);
        self.load.remove_router(&self.router_id, self.connection);
        self.sessions.close(&self.router_id, self.connection);
        tracing::info!(router = %self.router_id, "router disconnected");
    }
}

/// Fleet load is sent when it changes, and at least this often anyway, so a router that
/// rebuilt its view (or missed nothing) converges without waiting for a change.
const FLEET_REFRESH: Duration = Duration::from_secs(1);

fn frame(
    replica_id: &str,
    version: &StateVersion,
    message: pb::sync_message::Message,
) -> pb::SyncMessage {
    pb::SyncMessage {
        version: version.revision,
        replica_id: replica_id.to_owned(),
        cluster_id: version.cluster.clone(),
        message: Some(message),
    }
}

fn fleet_message(replica_id: &str, others: &Counts) -> pb::SyncMessage {
    frame(
        replica_id,
        &StateVersion::default(),
        pb::sync_message::Message::FleetLoad(pb::FleetLoad {
            loads: others
                .iter()
                .map(|(key, count)| pb::InstanceLoad {
                    endpoint_name: key.endpoint.to_string(),
                    instance_id: key.id.to_string(),
                    in_flight: *count,
                })
                .collect(),
        }),
    )
}

fn placements_message(replica_id: &str, placements: &[KeyPlacement]) -> pb::SyncMessage {
    frame(
        replica_id,
        &StateVersion::default(),
        pb::sync_message::Message::Placements(pb::KeyPlacements {
            placements: placements.iter().map(Into::into).collect(),
        }),
    )
}

/// Cuts an update into pieces of about `SYNC_PIECE_BYTES`, in the order the router applies
/// them; `reset` goes on the first piece and `complete` (if set) on the last. Lazily: each
/// piece is converted when asked for, so a stream sending a large snapshot yields between
/// pieces instead of holding its thread for the whole state.
struct Pieces {
    update: StateUpdate,
    /// Where the next piece starts: section (in apply order) and index within it.
    section: usize,
    index: usize,
    first: bool,
    done: bool,
}

impl Pieces {
    fn new(update: StateUpdate) -> Self {
        Self {
            update,
            section: 0,
            index: 0,
            first: true,
            done: false,
        }
    }

    /// Adds the record at (section, index) to `piece`; its size, or `None` past the end of
    /// the section.
    fn add(&self, piece: &mut pb::StateUpdate) -> Option<usize> {
        let update = &self.update;
        let index = self.index;
        Some(match self.section {
            0 => {
                let name = update.removed_endpoints.get(index)?.to_string();
                let bytes = name.len();
                piece.removed_endpoints.push(name);
                bytes
            }
            1 => {
                let config = pb::EndpointConfig::from(update.configs.get(index)?.as_ref());
                let bytes = config.encoded_len();
                piece.configs.push(config);
                bytes
            }
            2 => {
                let name = update.removed_configs.get(index)?.to_string();
                let bytes = name.len();
                piece.removed_configs.push(name);
                bytes
            }
            3 => {
                let endpoint = pb::Endpoint::from(update.endpoints.get(index)?.as_ref());
                let bytes = endpoint.encoded_len();
                piece.endpoints.push(endpoint);
                bytes
            }
            4 => {
                let instance = pb::Instance::from(update.instances.get(index)?.as_ref());
                let bytes = instance.encoded_len();
                piece.instances.push(instance);
                bytes
            }
            5 => {
                let removed = pb::InstanceRemoved::from(update.removed_instances.get(index)?);
                let bytes = removed.encoded_len();
                piece.removed_instances.push(removed);
                bytes
            }
            _ => return None,
        })
    }
}

impl Iterator for Pieces {
    type Item = pb::StateUpdate;

    fn next(&mut self) -> Option<pb::StateUpdate> {
        if self.done {
            return None;
        }
        let mut piece = pb::StateUpdate {
            reset: self.update.reset && self.first,
            ..pb::StateUpdate::default()
        };
        self.first = false;
        let mut bytes = 0usize;
        while self.section < 6 {
            match self.add(&mut piece) {
                Some(size) => {
                    bytes += size + 8;
                    self.index += 1;
                    if bytes >= SYNC_PIECE_BYTES {
                        break;
                    }
                }
                None => {
                    self.section += 1;
                    self.index = 0;
                }
            }
        }
        // Past the last record (or exactly at it): this piece is the last one.
        while self.section < 6 && self.add(&mut pb::StateUpdate::default()).is_none() {
            self.section += 1;
            self.index = 0;
        }
        if self.section >= 6 {
            self.done = true;
            piece.complete = self.update.complete;
        }
        Some(piece)
    }
}

#[cfg(test)]
fn pieces(update: &StateUpdate) -> Vec<pb::StateUpdate> {
    Pieces::new(update.clone()).collect()
}

/// Turns the view's snapshots and changes into the messages of one stream's protocol.
enum Encoder {
    Pieces,
    /// Protocol 1 sends each endpoint with its config: it keeps what it needs to do so.
    Whole {
        configs: HashMap<EndpointConfigName, Arc<EndpointConfig>>,
        endpoints: BTreeMap<EndpointName, Arc<Endpoint>>,
    },
}

impl Encoder {
    fn new(protocol: u32) -> Self {
        if protocol >= 2 {
            Encoder::Pieces
        } else {
            Encoder::Whole {
                configs: HashMap::new(),
                endpoints: BTreeMap::new(),
            }
        }
    }

    /// The messages of a snapshot, made one at a time as they are sent.
    fn snapshot(
        &mut self,
        replica_id: &str,
        snapshot: StateSnapshot,
    ) -> Box<dyn Iterator<Item = pb::SyncMessage> + Send> {
        use pb::sync_message::Message;
        match self {
            Encoder::Pieces => {
                let version = snapshot.version.clone();
                let replica_id = replica_id.to_owned();
                let update = StateUpdate {
                    reset: true,
                    complete: true,
                    configs: snapshot.configs,
                    endpoints: snapshot.endpoints,
                    instances: snapshot.instances,
                    ..StateUpdate::default()
                };
                Box::new(
                    Pieces::new(update)
                        .map(move |piece| frame(&replica_id, &version, Message::Update(piece))),
                )
            }
            Encoder::Whole { configs, endpoints } => {
                *configs = snapshot
                    .configs
                    .iter()
                    .map(|config| (config.endpoint_config_name.clone(), Arc::clone(config)))
                    .collect();
                *endpoints = snapshot
                    .endpoints
                    .iter()
                    .map(|endpoint| (endpoint.endpoint_name.clone(), Arc::clone(endpoint)))
                    .collect();
                let whole = pb::Snapshot {
                    endpoints: endpoints
                        .values()
                        .filter_map(|endpoint| {
                            let config = configs.get(&endpoint.endpoint_config_name)?;
                            Some(switchyard_proto::convert::routed_endpoint(endpoint, config))
                        })
                        .collect(),
                    instances: snapshot
                        .instances
                        .iter()
                        .map(|instance| pb::Instance::from(instance.as_ref()))
                        .collect(),
                };
                Box::new(std::iter::once(frame(
                    replica_id,
                    &snapshot.version,
                    Message::Snapshot(whole),
                )))
            }
        }
    }

    /// The messages for changes up to `version`; `coalescer` holds them folded (protocol 2),
    /// `ordered` in order (protocol 1).
    fn changes(
        &mut self,
        replica_id: &str,
        version: &StateVersion,
        coalescer: &mut Coalescer,
        ordered: &mut Vec<StateChange>,
    ) -> Vec<pb::SyncMessage> {
        use pb::sync_message::Message;
        match self {
            Encoder::Pieces => {
                ordered.clear();
                Pieces::new(coalescer.take())
                    .map(|piece| frame(replica_id, version, Message::Update(piece)))
                    .collect()
            }
            Encoder::Whole { configs, endpoints } => {
                coalescer.take();
                let mut out = Vec::new();
                for change in ordered.drain(..) {
                    match change {
                        StateChange::Config(config) => {
                            let name = config.endpoint_config_name.clone();
                            for endpoint in endpoints
                                .values()
                                .filter(|endpoint| endpoint.endpoint_config_name == name)
                            {
                                out.push(Message::EndpointChanged(
                                    switchyard_proto::convert::routed_endpoint(endpoint, &config),
                                ));
                            }
                            configs.insert(name, config);
                        }
                        StateChange::ConfigRemoved(name) => {
                            configs.remove(&name);
                        }
                        StateChange::Endpoint(endpoint) => {
                            if let Some(config) = configs.get(&endpoint.endpoint_config_name) {
                                out.push(Message::EndpointChanged(
                                    switchyard_proto::convert::routed_endpoint(&endpoint, config),
                                ));
                            }
                            endpoints.insert(endpoint.endpoint_name.clone(), endpoint);
                        }
                        StateChange::EndpointRemoved(name) => {
                            endpoints.remove(&name);
                            out.push(Message::EndpointRemoved(pb::EndpointRemoved {
                                name: name.to_string(),
                            }));
                        }
                        StateChange::Instance(instance) => {
                            out.push(Message::InstanceChanged(instance.as_ref().into()));
                        }
                        StateChange::InstanceRemoved(key) => {
                            out.push(Message::InstanceRemoved((&key).into()));
                        }
                    }
                }
                out.into_iter()
                    .map(|message| frame(replica_id, version, message))
                    .collect()
            }
        }
    }
}

type SyncStream = Pin<Box<dyn Stream<Item = Result<pb::SyncMessage, Status>> + Send>>;

impl SyncService {
    /// Waits for this replica's first listing (bounded); refuses at once when it is not ready.
    async fn wait_ready(&self) -> Result<(), Status> {
        let mut readiness = self.cache.readiness();
        let waited = tokio::time::timeout(READY_TIMEOUT, async {
            tokio::select! {
                () = self.shutdown.cancelled() => None,
                ready = readiness.wait_for(|readiness| *readiness != Readiness::Starting) => {
                    ready.ok().map(|ready| ready.clone())
                }
            }
        })
        .await;
        match waited {
            Ok(Some(Readiness::Ready)) => Ok(()),
            Ok(Some(Readiness::NotReady(reason))) => {
                self.stats.not_ready.fetch_add(1, Ordering::Relaxed);
                Err(Status::unavailable(format!(
                    "this control plane's state may be stale ({reason}); try another replica"
                )))
            }
            Ok(_) => Err(Status::unavailable("the control plane is shutting down")),
            Err(_) => Err(Status::unavailable(
                "the control plane has not loaded its state yet",
            )),
        }
    }
}

#[tonic::async_trait]
impl pb::router_sync_server::RouterSync for SyncService {
    type SyncStream = SyncStream;

    async fn sync(
        &self,
        request: Request<Streaming<pb::RouterMessage>>,
    ) -> Result<Response<Self::SyncStream>, Status> {
        let mut inbound = request.into_inner();
        let first = tokio::time::timeout(HELLO_TIMEOUT, inbound.message())
            .await
            .map_err(|_| Status::deadline_exceeded("no RouterHello within 10s"))??;
        let hello = match first.and_then(|message| message.message) {
            Some(pb::router_message::Message::Hello(hello)) => hello,
            _ => {
                return Err(Status::invalid_argument(
                    "the first message must be a RouterHello",
                ));
            }
        };
        let router_id = hello.router_id;
        if router_id.is_empty() || router_id.len() > 256 {
            return Err(Status::invalid_argument(
                "RouterHello.router_id: must be 1-256 characters",
            ));
        }
        self.wait_ready().await?;
        let connection = self.load.connection_id();
        let end = self
            .sessions
            .open(&router_id, hello.incarnation, connection)?;
        let protocol = hello.protocol.clamp(1, SYNC_PROTOCOL);
        tracing::info!(router = %router_id, protocol, "router connected");
        let service = self.clone();
        let stream = async_stream::try_stream! {
            service.stats.open_streams.fetch_add(1, Ordering::Relaxed);
            let _guard = StreamGuard {
                stats: Arc::clone(&service.stats),
                load: Arc::clone(&service.load),
                sessions: Arc::clone(&service.sessions),
                router_id: router_id.clone(),
                connection,
            };
            let replica = service.replica_id.clone();
            let mut readiness = service.cache.readiness();
            let mut encoder = Encoder::new(protocol);
            let (snapshot, mut changes) = service.cache.subscribe();
            let mut version = snapshot.version.clone();
            service.stats.snapshots.fetch_add(1, Ordering::Relaxed);
            let messages = {
                let _span = tracing::info_span!("sync snapshot", router = %router_id, instances = snapshot.instances.len(), reason = "connected").entered();
                encoder.snapshot(&replica, snapshot)
            };
            for message in messages {
                yield message;
            }
            let load = service.load.snapshots();
            let mut announcements = service.load.announcements();
            let mut ticks = tokio::time::interval(service.load.config().interval);
            ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            // None: nothing sent yet, so the first tick always sends (possibly empty) figures.
            let mut last_sent: Option<Counts> = None;
            let mut last_sent_at = tokio::time::Instant::now();
            let mut coalescer = Coalescer::default();
            let mut ordered: Vec<StateChange> = Vec::new();
            // When the oldest change not yet pushed reached this replica's view.
            let mut oldest_change: Option<std::time::Instant> = None;
            loop {
                // What to do once the select is over: end with an error, send a fresh snapshot,
                // or send the changes.
                let mut failure: Option<Status> = None;
                let mut fresh_snapshot = false;
                tokio::select! {
                    () = service.shutdown.cancelled() => break,
                    () = end.cancelled() => {
                        failure = Some(Status::aborted("a newer stream of this router took over"));
                    }
                    changed = readiness.changed() => {
                        let current = readiness.borrow_and_update().clone();
                        if changed.is_err() {
                            break;
                        }
                        if let Readiness::NotReady(reason) = current {
                            service.stats.not_ready.fetch_add(1, Ordering::Relaxed);
                            failure = Some(Status::unavailable(format!(
                                "this control plane's state may be stale ({reason}); try another replica"
                            )));
                        }
                    }
                    inbound = inbound.message() => match inbound {
                        Ok(Some(pb::RouterMessage { message: Some(pb::router_message::Message::Load(report)) })) => {
                            let (mut loads, _) = switchyard_proto::convert::instance_loads(report.loads);
                            let unknown = service.cache.retain_known(&mut loads, |load| &load.key);
                            if unknown > 0 {
                                tracing::debug!(router = %router_id, unknown, "load report names instances this control plane does not know; ignored");
                            }
                            service.load.report(&router_id, connection, &loads);
                        }
                        Ok(Some(pb::RouterMessage { message: Some(pb::router_message::Message::Placements(mut placed)) })) => {
                            placed.placements.truncate(MOST_PLACEMENTS_PER_MESSAGE);
                            let (mut placements, unreadable) = switchyard_proto::convert::key_placements(placed.placements);
                            let unknown = service.cache.retain_known(&mut placements, |placement| &placement.instance);
                            if unreadable + unknown > 0 {
                                tracing::debug!(router = %router_id, unreadable, unknown, "key placements name instances this control plane does not know; ignored");
                            }
                            service.load.announce(&router_id, placements);
                        }
                        Ok(Some(_)) => {}
                        Ok(None) => break,
                        Err(status) => {
                            tracing::debug!(router = %router_id, %status, "router stream broke");
                            break;
                        }
                    },
                    published = changes.recv() => {
                        let mut next = Some(published);
                        // Fold in whatever else is already waiting: one batch for all of it.
                        while let Some(published) = next.take() {
                            match published {
                                Ok(published) => match published.as_ref() {
                                    Published::Changes { revision, changes: batch, at } => {
                                        version.revision = (*revision).max(0) as u64;
                                        oldest_change.get_or_insert(*at);
                                        for change in batch {
                                            coalescer.push(change);
                                            if matches!(encoder, Encoder::Whole { .. }) {
                                                ordered.push(change.clone());
                                            }
                                        }
                                    }
                                    Published::Rebuilt => fresh_snapshot = true,
                                },
                                Err(RecvError::Lagged(missed)) => {
                                    tracing::warn!(router = %router_id, missed, "router stream fell behind; sending a fresh snapshot");
                                    service.stats.fell_behind.fetch_add(1, Ordering::Relaxed);
                                    fresh_snapshot = true;
                                }
                                Err(RecvError::Closed) => break,
                            }
                            if fresh_snapshot || coalescer.changes() >= MAX_BATCH_CHANGES {
                                break;
                            }
                            next = match changes.try_recv() {
                                Ok(published) => Some(Ok(published)),
                                Err(TryRecvError::Lagged(missed)) => Some(Err(RecvError::Lagged(missed))),
                                Err(TryRecvError::Empty | TryRecvError::Closed) => None,
                            };
                        }
                    }
                    announced = announcements.recv() => match announced {
                        Ok(announced) => if announced.router_id != router_id {
                            yield placements_message(&replica, &announced.placements);
                        },
                        Err(RecvError::Lagged(missed)) => {
                            tracing::debug!(router = %router_id, missed, "router stream fell behind the key placements; skipped some");
                        }
                        Err(RecvError::Closed) => break,
                    },
                    _ = ticks.tick() => {
                        let others = load.borrow().others(&router_id);
                        let due = last_sent_at.elapsed() >= FLEET_REFRESH;
                        if last_sent.as_ref() != Some(&others) || due {
                            yield fleet_message(&replica, &others);
                            last_sent = Some(others);
                            last_sent_at = tokio::time::Instant::now();
                        }
                    }
                }
                if let Some(status) = failure {
                    Err(status)?;
                }
                if fresh_snapshot {
                    coalescer.take();
                    ordered.clear();
                    let (snapshot, receiver) = service.cache.subscribe();
                    changes = receiver;
                    version = snapshot.version.clone();
                    service.stats.snapshots.fetch_add(1, Ordering::Relaxed);
                    oldest_change = None;
                    let messages = {
                        let _span = tracing::info_span!("sync snapshot", router = %router_id, instances = snapshot.instances.len(), reason = "fresh").entered();
                        encoder.snapshot(&replica, snapshot)
                    };
                    for message in messages {
                        yield message;
                    }
                } else if !coalescer.is_empty() {
                    service.stats.changes.fetch_add(coalescer.changes() as u64, Ordering::Relaxed);
                    if let Some(at) = oldest_change.take() {
                        service.metrics.sync_push_lag_seconds.observe(at.elapsed().as_secs_f64());
                    }
                    let messages = {
                        let _span = tracing::info_span!("sync changes", router = %router_id, changes = coalescer.changes()).entered();
                        encoder.changes(&replica, &version, &mut coalescer, &mut ordered)
                    };
                    service.stats.batches.fetch_add(messages.len() as u64, Ordering::Relaxed);
                    for message in messages {
                        yield message;
                    }
                }
            }
        };
        Ok(Response::new(Box::pin(stream)))
    }
}

#[cfg(test)]
mod tests {
    use switchyard_shared::Instance;

    use super::*;

    fn instance(index: usize, url_bytes: usize) -> Arc<Instance> {
        let url = format!("http://127.0.0.1:9/{}", "p".repeat(url_bytes));
        Arc::new(
            serde_json::from_str(&format!(
                r#"{{"InstanceId":"i{index}","EndpointName":"chat","VariantName":"v","Url":"{url}","Weight":1.0}}"#
            ))
            .unwrap(),
        )
    }

    #[test]
    fn a_large_update_is_cut_into_bounded_pieces_reset_first_complete_last() {
        let update = StateUpdate {
            reset: true,
            complete: true,
            instances: (0..3000).map(|index| instance(index, 1500)).collect(),
            ..StateUpdate::default()
        };
        let pieces = pieces(&update);
        assert!(pieces.len() >= 4, "{}", pieces.len());
        for (index, piece) in pieces.iter().enumerate() {
            assert!(piece.encoded_len() < SYNC_PIECE_BYTES + 4096);
            assert_eq!(piece.reset, index == 0);
            assert_eq!(piece.complete, index == pieces.len() - 1);
        }
        let total: usize = pieces.iter().map(|piece| piece.instances.len()).sum();
        assert_eq!(total, 3000);
    }

    #[test]
    fn an_empty_snapshot_is_one_piece() {
        let pieces = pieces(&StateUpdate {
            reset: true,
            complete: true,
            ..StateUpdate::default()
        });
        assert_eq!(pieces.len(), 1);
        assert!(pieces[0].reset && pieces[0].complete);
    }

    #[test]
    fn a_second_process_with_the_same_router_id_is_refused_a_reconnect_is_not() {
        let sessions = Sessions::default();
        let first = sessions.open("r", 7, 1).unwrap();
        let refused = sessions.open("r", 8, 2).unwrap_err();
        assert_eq!(refused.code(), tonic::Code::AlreadyExists);
        assert!(refused.message().contains("--router-id"), "{refused:?}");
        assert!(!first.is_cancelled());
        // The same process again (its old stream not noticed dead yet): it takes over.
        let second = sessions.open("r", 7, 3).unwrap();
        assert!(first.is_cancelled());
        // A stale stream's end does not remove the newer one.
        sessions.close("r", 1);
        assert!(sessions.open("r", 9, 4).is_err());
        sessions.close("r", 3);
        assert!(!second.is_cancelled());
        sessions.open("r", 9, 5).unwrap();
    }
}
