//! LMCACHE_PD's notice socket: LMCache's prefill engines PUSH a "KV ready" notice (msgspec's
//! tagged msgpack map `{"type": "ProxyNotif", "req_id": …}`) to the address their LMCache
//! config names (`pd_proxy_host`, `pd_proxy_port`), one per tensor-parallel rank, once that
//! rank's KV cache is in the decoder's buffer. The router binds a ZMQ PULL socket there
//! (`--lmcache-notice-bind`) on a thread of its own and wakes the request waiting for it.
//!
//! **Several routers.** A prefiller names one notice address, and PUSH load-balances, so a
//! notice may reach a router that did not send the request. Each request id therefore names
//! its router: `sy-<random hex>@<host:port>`, the address that router advertises for its notice
//! socket (`--lmcache-notice-advertise`, else the bound address). A router that receives a
//! notice for another router's request relays it there (a PUSH socket per peer, at most
//! [`MOST_PEERS`], dialled on first use, each fed by a bounded queue on a task of its own; a
//! peer that cannot be reached is not dialled again for 5 s; a relayed notice is marked and
//! never relayed again, so none goes round), so any number of routers can share one notice
//! address behind a load balancer, nothing is asked of the control plane, and no router needs
//! to know the others in advance. A notice for an unknown request (it timed out, or the id is
//! not one of ours) or one that cannot be decoded is dropped and counted.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use serde::Deserialize;
use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

use crate::observe::metrics::RouterMetrics;

/// The most peers a router relays notices to (each a PUSH socket); past it the one relayed
/// to least recently is closed.
pub const MOST_PEERS: usize = 64;
/// The most peers remembered as unreachable at once (each for [`PEER_PAUSE`]); past it a
/// failing peer is not remembered, and is dialled again on its next notice.
const MOST_PAUSED: usize = 1024;
/// How long relaying one notice may take.
const RELAY_TIMEOUT: Duration = Duration::from_millis(500);

/// A "KV ready" notice, as LMCache's PD backend encodes it.
#[derive(Debug, Deserialize)]
struct ProxyNotif {
    #[serde(rename = "type")]
    tag: String,
    req_id: String,
}

/// The requests waiting for notices, and where this router's notices arrive.
#[derive(Debug)]
pub struct NoticeBoard {
    /// `host:port` that request ids name as this router's.
    advertised: String,
    waiting: Mutex<HashMap<String, Waiting>>,
    metrics: Arc<RouterMetrics>,
}

#[derive(Debug)]
struct Waiting {
    needed: usize,
    got: usize,
    ready: Option<oneshot::Sender<()>>,
}

/// One request's wait: [`Expected::ready`] resolves once every rank's notice has come; dropped
/// (answered, timed out, or the client left), the request is forgotten.
#[derive(Debug)]
pub struct Expected {
    board: Arc<NoticeBoard>,
    pub req_id: String,
    ready: Option<oneshot::Receiver<()>>,
}

impl Expected {
    /// Waits for the notices, at most `deadline`; false if they did not all come in time.
    pub async fn ready(&mut self, deadline: Duration) -> bool {
        let Some(ready) = self.ready.take() else {
            return true;
        };
        matches!(tokio::time::timeout(deadline, ready).await, Ok(Ok(())))
    }
}

impl Drop for Expected {
    fn drop(&mut self) {
        self.board.lock().remove(&self.req_id);
    }
}

impl NoticeBoard {
    pub fn new(advertised: String, metrics: Arc<RouterMetrics>) -> Arc<Self> {
        Arc::new(Self {
            advertised,
            waiting: Mutex::new(HashMap::new()),
            metrics,
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Waiting>> {
        self.waiting
            .lock()
            .unwrap_or_else(|poison| poison.into_inner())
    }

    /// The address request ids name as this router's.
    pub fn advertised(&self) -> &str {
        &self.advertised
    }

    /// A new request id naming this router, expecting `ranks` notices.
    pub fn expect(self: &Arc<Self>, ranks: usize) -> Expected {
        let req_id = format!("sy-{:016x}@{}", fastrand::u64(..), self.advertised);
        let (ready, receiver) = oneshot::channel();
        self.lock().insert(
            req_id.clone(),
            Waiting {
                needed: ranks.max(1),
                got: 0,
                ready: Some(ready),
            },
        );
        Expected {
            board: Arc::clone(self),
            req_id,
            ready: Some(receiver),
        }
    }

    fn count(&self, outcome: &str) {
        self.metrics.count_notice(outcome);
    }

    /// Takes one notice for `req_id`: this router's request (counted toward its ranks), or
    /// the address of the router that owns it (to relay to), or nothing (unknown).
    fn take(&self, req_id: &str) -> Delivery {
        let mut waiting = self.lock();
        if let Some(entry) = waiting.get_mut(req_id) {
            entry.got += 1;
            if entry.got >= entry.needed
                && let Some(ready) = entry.ready.take()
            {
                let _ = ready.send(());
            }
            return Delivery::Matched;
        }
        drop(waiting);
        match req_id.rsplit_once('@') {
            Some((_, owner)) if owner != self.advertised && !owner.is_empty() => {
                Delivery::Relay(owner.to_owned())
            }
            _ => Delivery::Unknown,
        }
    }
}

enum Delivery {
    Matched,
    Relay(String),
    Unknown,
}

/// Decodes one notice; None if it is no `ProxyNotif`.
fn decode(frame: &[u8]) -> Option<String> {
    let notice: ProxyNotif = rmp_serde::from_slice(frame).ok()?;
    (notice.tag == "ProxyNotif").then_some(notice.req_id)
}

/// Binds the PULL socket at `bind` (`tcp://host:port`) and serves it on a thread of its own
/// until `stop`. Request ids name `advertise`, else the bound address (a port 0 resolved).
pub fn start(
    bind: &str,
    advertise: Option<String>,
    metrics: Arc<RouterMetrics>,
    stop: CancellationToken,
) -> std::io::Result<Arc<NoticeBoard>> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    // Bound on the socket's own thread (this may run inside another runtime), then told here.
    let (told, bound) = std::sync::mpsc::channel();
    let bind = bind.to_owned();
    std::thread::Builder::new()
        .name("switchyard-notices".into())
        .spawn(move || {
            runtime.block_on(async move {
                // The socket binds on loopback behind a frame guard that listens where asked:
                // zeromq reserves whatever length a frame header announces, so one forged
                // header from anyone who can reach the port would abort the router.
                let mut socket = zeromq::PullSocket::new();
                let bound = match guarded_bind(&mut socket, &bind, stop.clone()).await {
                    Ok(bound) => bound,
                    Err(err) => {
                        let _ = told.send(Err(format!("--lmcache-notice-bind {bind}: {err}")));
                        return;
                    }
                };
                let advertised = advertise.unwrap_or_else(|| bound.to_string());
                let board = NoticeBoard::new(advertised, metrics);
                let _ = told.send(Ok((format!("tcp://{bound}"), Arc::clone(&board))));
                serve(socket, board, stop).await;
            });
        })?;
    let (bound, board) = bound
        .recv()
        .map_err(|_| std::io::Error::other("the notice socket's thread ended"))?
        .map_err(std::io::Error::other)?;
    tracing::info!(
        bound,
        advertised = board.advertised(),
        "LMCache notice socket listening (LMCACHE_PD: the prefill engines' pd_proxy_host and pd_proxy_port name it)"
    );
    Ok(board)
}

/// The longest frame, and message, a notice sender may send: a `ProxyNotif` is well under a
/// kilobyte, a relayed one two frames of about that.
pub const MOST_NOTICE_BYTES: u64 = 64 * 1024;

/// Binds `socket` on a loopback port and a frame guard at `bind` (`tcp://HOST:PORT`, `*` for
/// every address) in front of it, relaying until `stop`; the guard's bound address.
async fn guarded_bind(
    socket: &mut zeromq::PullSocket,
    bind: &str,
    stop: CancellationToken,
) -> Result<std::net::SocketAddr, String> {
    let address = bind
        .strip_prefix("tcp://")
        .ok_or_else(|| "must be tcp://HOST:PORT".to_owned())?;
    let address = match address.strip_prefix("*:") {
        Some(port) => format!("0.0.0.0:{port}"),
        None => address.to_owned(),
    };
    let listener = tokio::net::TcpListener::bind(&address)
        .await
        .map_err(|err| err.to_string())?;
    let public = listener.local_addr().map_err(|err| err.to_string())?;
    let internal = socket
        .bind("tcp://127.0.0.1:0")
        .await
        .map_err(|err| format!("the loopback socket behind the frame guard: {err}"))?;
    let internal = internal.to_string();
    let internal = internal.trim_start_matches("tcp://").to_owned();
    tokio::spawn(crate::kv::frame_guard::serve_inbound(
        listener,
        internal,
        "LMCache notice socket",
        MOST_NOTICE_BYTES,
        stop,
    ));
    Ok(public)
}

/// The frame a relayed notice carries after the notice: a router never relays it again, so a
/// notice cannot go round between routers that name each other differently.
const RELAYED: &[u8] = b"switchyard-relayed";
/// Notices queued for one peer before more are dropped.
const PEER_QUEUE: usize = 1024;
/// How long a peer that could not be reached is not dialled again.
const PEER_PAUSE: Duration = Duration::from_secs(5);

async fn serve(mut socket: zeromq::PullSocket, board: Arc<NoticeBoard>, stop: CancellationToken) {
    let mut peers = Peers::default();
    loop {
        let message = tokio::select! {
            () = stop.cancelled() => return,
            message = socket.recv() => message,
        };
        let message = match message {
            Ok(message) => message,
            Err(err) => {
                tracing::warn!(error = %err, "LMCache notice socket: receive failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let frames = message.into_vec();
        let relayed = frames.get(1).is_some_and(|frame| frame.as_ref() == RELAYED);
        let Some(req_id) = frames.first().and_then(|frame| decode(frame)) else {
            board.count("undecodable");
            tracing::debug!("LMCache notice socket: a message that is no ProxyNotif; dropped");
            continue;
        };
        match board.take(&req_id) {
            Delivery::Matched => board.count("matched"),
            Delivery::Relay(_) | Delivery::Unknown if relayed => {
                board.count("unknown");
                tracing::debug!(
                    req_id,
                    "a notice relayed here by another router names no request waiting here (do two routers advertise the same --lmcache-notice-advertise?); dropped"
                );
            }
            Delivery::Unknown => {
                board.count("unknown");
                tracing::debug!(
                    req_id,
                    "an LMCache notice for no request waiting here (it timed out, or the id is not a Switchyard router's); dropped"
                );
            }
            Delivery::Relay(owner) => {
                let queued = peers.send(&owner, &req_id, &board);
                if !queued {
                    board.count("relay_failed");
                    tracing::warn!(
                        req_id,
                        owner,
                        "could not relay an LMCache notice to the router that owns the request"
                    );
                }
            }
        }
    }
}

/// The routers notices are relayed to: one task each, fed by a bounded queue, so that a slow
/// or unreachable peer never holds up this router's own notices.
#[derive(Default)]
struct Peers {
    /// Each peer's queue, and when a notice was last queued for it.
    queues: HashMap<String, (tokio::sync::mpsc::Sender<Vec<u8>>, tokio::time::Instant)>,
    /// Peers that could not be reached, not dialled again until then.
    paused: Arc<Mutex<HashMap<String, tokio::time::Instant>>>,
}

impl Peers {
    /// Queues a notice for `req_id` to `owner`; false if it cannot be.
    fn send(&mut self, owner: &str, req_id: &str, board: &Arc<NoticeBoard>) -> bool {
        let now = tokio::time::Instant::now();
        {
            let mut paused = self
                .paused
                .lock()
                .unwrap_or_else(|poison| poison.into_inner());
            paused.retain(|_, until| *until > now);
            if paused.contains_key(owner) {
                return false;
            }
        }
        self.queues.retain(|_, (queue, _)| !queue.is_closed());
        if !self.queues.contains_key(owner) {
            if self.queues.len() >= MOST_PEERS {
                let Some(evicted) = self
                    .queues
                    .iter()
                    .min_by_key(|(_, (_, used))| *used)
                    .map(|(peer, _)| peer.clone())
                else {
                    return false;
                };
                // Its task ends once the queue is gone, without pausing the peer.
                self.queues.remove(&evicted);
            }
            let (queue, notices) = tokio::sync::mpsc::channel(PEER_QUEUE);
            tokio::spawn(relay(
                owner.to_owned(),
                notices,
                Arc::clone(&self.paused),
                Arc::clone(board),
            ));
            self.queues.insert(owner.to_owned(), (queue, now));
        }
        let notice = ProxyNotifOut {
            tag: "ProxyNotif",
            req_id,
        };
        let Ok(notice) = rmp_serde::to_vec_named(&notice) else {
            return false;
        };
        self.queues.get_mut(owner).is_some_and(|(queue, used)| {
            *used = now;
            queue.try_send(notice).is_ok()
        })
    }
}

#[derive(serde::Serialize)]
struct ProxyNotifOut<'a> {
    #[serde(rename = "type")]
    tag: &'a str,
    req_id: &'a str,
}

/// One peer's relay: dials `owner` (`host:port`) and sends it what is queued, each notice
/// rebuilt from its request id and marked relayed. A failure pauses the peer and ends the
/// task (what is still queued counts as failed); a queue closed here (the peer evicted) ends
/// it quietly.
async fn relay(
    owner: String,
    mut notices: tokio::sync::mpsc::Receiver<Vec<u8>>,
    paused: Arc<Mutex<HashMap<String, tokio::time::Instant>>>,
    board: Arc<NoticeBoard>,
) {
    let mut push = zeromq::PushSocket::new();
    let endpoint = format!("tcp://{owner}");
    let connected = matches!(
        tokio::time::timeout(RELAY_TIMEOUT, push.connect(&endpoint)).await,
        Ok(Ok(()))
    );
    if connected {
        loop {
            let Some(notice) = notices.recv().await else {
                // Evicted: nothing failed.
                return;
            };
            let frames = vec![Bytes::from(notice), Bytes::from_static(RELAYED)];
            let Ok(message) = ZmqMessage::try_from(frames) else {
                continue;
            };
            match tokio::time::timeout(RELAY_TIMEOUT, push.send(message)).await {
                Ok(Ok(())) => board.count("relayed"),
                _ => {
                    board.count("relay_failed");
                    break;
                }
            }
        }
    }
    tracing::warn!(
        owner,
        "LMCache notices cannot be relayed to this router for now"
    );
    {
        let mut paused = paused.lock().unwrap_or_else(|poison| poison.into_inner());
        if paused.len() < MOST_PAUSED {
            paused.insert(owner, tokio::time::Instant::now() + PEER_PAUSE);
        }
    }
    notices.close();
    while notices.recv().await.is_some() {
        board.count("relay_failed");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn notice(req_id: &str) -> Vec<u8> {
        let mut out = Vec::new();
        rmp::encode::write_map_len(&mut out, 2).unwrap();
        rmp::encode::write_str(&mut out, "type").unwrap();
        rmp::encode::write_str(&mut out, "ProxyNotif").unwrap();
        rmp::encode::write_str(&mut out, "req_id").unwrap();
        rmp::encode::write_str(&mut out, req_id).unwrap();
        out
    }

    #[tokio::test]
    async fn a_request_is_ready_once_every_rank_has_told_and_others_are_relayed() {
        let metrics = Arc::new(RouterMetrics::new(Default::default()));
        let board = NoticeBoard::new("127.0.0.1:7500".into(), metrics);
        let mut expected = board.expect(2);
        assert!(expected.req_id.ends_with("@127.0.0.1:7500"));
        assert_eq!(
            decode(&notice(&expected.req_id)).as_deref(),
            Some(expected.req_id.as_str())
        );
        assert!(matches!(board.take(&expected.req_id), Delivery::Matched));
        assert!(!expected.ready(Duration::from_millis(10)).await);
        // The wait above took the receiver: a second wait answers at once.
        let mut again = board.expect(2);
        board.take(&again.req_id);
        board.take(&again.req_id);
        assert!(again.ready(Duration::from_millis(10)).await);
        assert!(
            matches!(board.take("sy-1@127.0.0.2:7500"), Delivery::Relay(owner) if owner == "127.0.0.2:7500")
        );
        assert!(matches!(
            board.take("sy-1@127.0.0.1:7500"),
            Delivery::Unknown
        ));
        assert!(matches!(board.take("42"), Delivery::Unknown));
        let id = again.req_id.clone();
        drop(again);
        assert!(matches!(board.take(&id), Delivery::Unknown));
        assert_eq!(decode(b"\x90"), None);
    }
}
