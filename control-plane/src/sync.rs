//! The `RouterSync` service: one bidirectional stream per router. The router says hello, then
//! reports its in-flight counts; the control plane sends a snapshot, then every change, and the
//! fleet-wide load of the other routers whenever it changes.

use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use futures::Stream;
use switchyard_proto::v1 as pb;
use tokio::sync::broadcast::error::RecvError;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status, Streaming};

use crate::load::{Counts, LoadHub};
use crate::state::StateCache;

const HELLO_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Debug, Clone)]
pub struct SyncService {
    pub replica_id: String,
    pub cache: Arc<StateCache>,
    pub load: Arc<LoadHub>,
    pub shutdown: CancellationToken,
}

/// Removes a router from the load sums when its stream ends, however it ends.
struct Registration {
    load: Arc<LoadHub>,
    router_id: String,
    connection: u64,
}

impl Drop for Registration {
    fn drop(&mut self) {
        self.load.remove_router(&self.router_id, self.connection);
        tracing::info!(router = %self.router_id, "router disconnected");
    }
}

/// Fleet load is sent when it changes, and at least this often anyway, so a router that
/// rebuilt its view (or missed nothing) converges without waiting for a change.
const FLEET_REFRESH: Duration = Duration::from_secs(1);

fn fleet_message(replica_id: &str, others: &Counts) -> pb::SyncMessage {
    pb::SyncMessage {
        version: 0,
        replica_id: replica_id.to_owned(),
        message: Some(pb::sync_message::Message::FleetLoad(pb::FleetLoad {
            loads: others
                .iter()
                .map(|((endpoint, id), count)| pb::InstanceLoad {
                    endpoint_name: endpoint.clone(),
                    instance_id: id.clone(),
                    in_flight: *count,
                })
                .collect(),
        })),
    }
}

type SyncStream = Pin<Box<dyn Stream<Item = Result<pb::SyncMessage, Status>> + Send>>;

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
        let router_id = match first.and_then(|message| message.message) {
            Some(pb::router_message::Message::Hello(hello)) => hello.router_id,
            _ => {
                return Err(Status::invalid_argument(
                    "the first message must be a RouterHello",
                ));
            }
        };
        if router_id.is_empty() || router_id.len() > 256 {
            return Err(Status::invalid_argument(
                "RouterHello.router_id: must be 1-256 characters",
            ));
        }
        tracing::info!(router = %router_id, "router connected");
        let service = self.clone();
        let stream = async_stream::try_stream! {
            let connection = service.load.connection_id();
            let _registration = Registration {
                load: Arc::clone(&service.load),
                router_id: router_id.clone(),
                connection,
            };
            service.cache.wait_ready().await;
            let (snapshot, mut changes) = service.cache.subscribe();
            yield snapshot;
            let load = service.load.snapshots();
            let mut ticks = tokio::time::interval(service.load.config().interval);
            ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            // None: nothing sent yet, so the first tick always sends (possibly empty) figures.
            let mut last_sent: Option<Counts> = None;
            let mut last_sent_at = tokio::time::Instant::now();
            loop {
                tokio::select! {
                    () = service.shutdown.cancelled() => break,
                    inbound = inbound.message() => match inbound {
                        Ok(Some(pb::RouterMessage { message: Some(pb::router_message::Message::Load(report)) })) => {
                            service.load.report(&router_id, connection, &report.loads);
                        }
                        Ok(Some(_)) => {}
                        Ok(None) => break,
                        Err(status) => {
                            tracing::debug!(router = %router_id, %status, "router stream broke");
                            break;
                        }
                    },
                    change = changes.recv() => match change {
                        Ok(message) => yield (*message).clone(),
                        Err(RecvError::Lagged(missed)) => {
                            tracing::warn!(router = %router_id, missed, "router fell behind; sending a fresh snapshot");
                            let (snapshot, receiver) = service.cache.subscribe();
                            changes = receiver;
                            yield snapshot;
                        }
                        Err(RecvError::Closed) => break,
                    },
                    _ = ticks.tick() => {
                        let others = load.borrow().others(&router_id);
                        let due = last_sent_at.elapsed() >= FLEET_REFRESH;
                        if last_sent.as_ref() != Some(&others) || due {
                            yield fleet_message(&service.replica_id, &others);
                            last_sent = Some(others);
                            last_sent_at = tokio::time::Instant::now();
                        }
                    }
                }
            }
        };
        Ok(Response::new(Box::pin(stream)))
    }
}
