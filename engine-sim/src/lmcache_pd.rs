//! Current LMCache's PD backend (LMCacheConnectorV1, `enable_pd`), both sides, over real
//! sockets so that a router cannot fake the hand-off:
//!
//! - A prefill engine started with `--lmcache-pd-proxy tcp://HOST:PORT` is LMCache's
//!   `pd_role: sender` with that `pd_proxy_host`/`pd_proxy_port`. Every completions request
//!   must carry `kv_transfer_params.disagg_spec` (LMCache's async backend fails without one:
//!   answered 500 here); its answer carries `kv_transfer_params.first_tok`
//!   (`ret_first_tok`). After answering, for each rank of the spec's port lists, it sends the
//!   receiver at `receiver_host:receiver_alloc_port[rank]` the prompt's blocks (a ZMQ DEALER to
//!   the receiver's ROUTER, msgspec-style tagged msgpack `AllocRequest`, answered
//!   `AllocResponse`) and then PUSHes `{"type": "ProxyNotif", "req_id": …}` to the proxy
//!   address, as LMCache does once a rank's KV is in the decoder's buffer.
//! - A decode engine started with `--lmcache-receiver-alloc-ports P[,P…]` is
//!   `pd_role: receiver`: a ROUTER socket per rank on `--lmcache-receiver-host`; the blocks it
//!   receives are cached as if computed here, so the decode request (the prompt's ids plus the
//!   first token) finds them.
//!
//! `--lmcache-drop-notices` (a fault) makes the sender transfer but never notify.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

use crate::driver::EngineClient;
use crate::metrics::Metrics;

/// Each socket exchange's deadline.
const CALL_TIMEOUT: Duration = Duration::from_secs(5);

/// `kv_transfer_params.disagg_spec`, as LMCache's proxy sends it.
#[derive(Debug, Clone, Deserialize)]
pub(crate) struct DisaggSpec {
    pub req_id: String,
    pub receiver_host: String,
    pub receiver_init_port: Vec<u16>,
    pub receiver_alloc_port: Vec<u16>,
}

impl DisaggSpec {
    /// The spec in `kv_transfer_params`, or why it is unusable (None: there is none).
    pub(crate) fn of(params: Option<&Value>) -> Option<Result<Self, String>> {
        let spec = params?.get("disagg_spec")?;
        Some(
            serde_json::from_value::<Self>(spec.clone())
                .map_err(|err| format!("kv_transfer_params.disagg_spec: {err}"))
                .and_then(|spec| {
                    if spec.receiver_init_port.is_empty()
                        || spec.receiver_init_port.len() != spec.receiver_alloc_port.len()
                    {
                        Err("kv_transfer_params.disagg_spec: receiver_init_port and \
                             receiver_alloc_port must list one port per rank each"
                            .to_owned())
                    } else {
                        Ok(spec)
                    }
                }),
        )
    }
}

#[derive(Debug, Serialize, Deserialize)]
struct AllocRequest {
    #[serde(rename = "type")]
    tag: String,
    /// One key per block (the simulator's block hash, as text).
    keys: Vec<String>,
    req_id: String,
    /// The blocks' tokens (the simulator's own addition: what LMCache's memory objects hold).
    token_ids: Vec<u32>,
}

#[derive(Debug, Serialize, Deserialize)]
struct AllocResponse {
    #[serde(rename = "type")]
    tag: String,
    already_sent_indexes: Vec<u32>,
    remote_indexes: Vec<u32>,
}

#[derive(Debug, Serialize)]
struct ProxyNotif<'a> {
    #[serde(rename = "type")]
    tag: &'a str,
    req_id: &'a str,
}

/// The sender's work after answering: the blocks to every rank of the receiver, then a notice
/// per rank to the proxy. Failures are logged (LMCache's proxy then never hears of it).
pub(crate) async fn send(
    drop_notices: bool,
    spec: DisaggSpec,
    proxy: String,
    block_hashes: Vec<u64>,
    token_ids: Vec<u32>,
) {
    let request = AllocRequest {
        tag: "AllocRequest".into(),
        keys: block_hashes.iter().map(u64::to_string).collect(),
        req_id: spec.req_id.clone(),
        token_ids,
    };
    let Ok(payload) = rmp_serde::to_vec_named(&request) else {
        return;
    };
    for &port in &spec.receiver_alloc_port {
        let endpoint = format!("tcp://{}:{port}", spec.receiver_host);
        if let Err(why) = allocate(&endpoint, payload.clone()).await {
            tracing::warn!(
                req_id = spec.req_id,
                endpoint,
                why,
                "LMCache PD: the transfer to the receiver failed; no notice is sent"
            );
            return;
        }
    }
    if drop_notices {
        tracing::info!(
            req_id = spec.req_id,
            "LMCache PD: transferred; the notices are dropped (--lmcache-drop-notices)"
        );
        return;
    }
    let notice = ProxyNotif {
        tag: "ProxyNotif",
        req_id: &spec.req_id,
    };
    let Ok(notice) = rmp_serde::to_vec_named(&notice) else {
        return;
    };
    let mut push = zeromq::PushSocket::new();
    if tokio::time::timeout(CALL_TIMEOUT, push.connect(&proxy))
        .await
        .is_err()
    {
        tracing::warn!(
            proxy,
            "LMCache PD: the proxy's notice socket is unreachable"
        );
        return;
    }
    for _ in &spec.receiver_init_port {
        let sent =
            tokio::time::timeout(CALL_TIMEOUT, push.send(ZmqMessage::from(notice.clone()))).await;
        if !matches!(sent, Ok(Ok(()))) {
            tracing::warn!(proxy, "LMCache PD: a notice could not be sent");
            return;
        }
    }
    // Let the last notice leave before the socket closes.
    tokio::time::sleep(Duration::from_millis(50)).await;
}

async fn allocate(endpoint: &str, payload: Vec<u8>) -> Result<(), String> {
    let mut dealer = zeromq::DealerSocket::new();
    tokio::time::timeout(CALL_TIMEOUT, dealer.connect(endpoint))
        .await
        .map_err(|_| "connect timed out".to_owned())?
        .map_err(|err| err.to_string())?;
    tokio::time::timeout(CALL_TIMEOUT, dealer.send(ZmqMessage::from(payload)))
        .await
        .map_err(|_| "send timed out".to_owned())?
        .map_err(|err| err.to_string())?;
    let answer = tokio::time::timeout(CALL_TIMEOUT, dealer.recv())
        .await
        .map_err(|_| "no AllocResponse in time".to_owned())?
        .map_err(|err| err.to_string())?;
    let frames = answer.into_vec();
    let reply = frames.last().ok_or("an empty answer")?;
    let reply: AllocResponse = rmp_serde::from_slice(reply).map_err(|err| err.to_string())?;
    if reply.tag != "AllocResponse" {
        return Err(format!("answered {} instead of AllocResponse", reply.tag));
    }
    Ok(())
}

/// Binds the receiver's ROUTER socket on each of `ports` at `host` and serves them until the
/// returned tasks are dropped.
pub(crate) async fn bind_receiver(
    engine: &EngineClient,
    metrics: &Arc<Metrics>,
    host: &str,
    ports: &[u16],
) -> Result<Vec<tokio_util::task::AbortOnDropHandle<()>>, String> {
    let mut tasks = Vec::new();
    for &port in ports {
        let mut router = zeromq::RouterSocket::new();
        let endpoint = format!("tcp://{host}:{port}");
        router
            .bind(&endpoint)
            .await
            .map_err(|err| format!("--lmcache-receiver-alloc-ports {endpoint}: {err}"))?;
        let (engine, metrics) = (engine.clone(), Arc::clone(metrics));
        tasks.push(tokio_util::task::AbortOnDropHandle::new(tokio::spawn(
            serve_receiver(router, engine, metrics),
        )));
    }
    Ok(tasks)
}

async fn serve_receiver(
    mut router: zeromq::RouterSocket,
    engine: EngineClient,
    metrics: Arc<Metrics>,
) {
    while let Ok(message) = router.recv().await {
        let mut frames = message.into_vec();
        let Some(payload) = frames.pop() else {
            continue;
        };
        let Ok(request) = rmp_serde::from_slice::<AllocRequest>(&payload) else {
            tracing::warn!("LMCache PD receiver: a message that is no AllocRequest");
            continue;
        };
        let hashes: Vec<u64> = request
            .keys
            .iter()
            .filter_map(|key| key.parse().ok())
            .collect();
        let count = hashes.len() as u32;
        let _ = engine.store_pushed(hashes, request.token_ids).await;
        Metrics::increment(&metrics.kv_pushes_received);
        let reply = AllocResponse {
            tag: "AllocResponse".into(),
            already_sent_indexes: Vec::new(),
            remote_indexes: (0..count).collect(),
        };
        let Ok(reply) = rmp_serde::to_vec_named(&reply) else {
            continue;
        };
        frames.push(Bytes::from(reply));
        let Ok(reply) = ZmqMessage::try_from(frames) else {
            continue;
        };
        if router.send(reply).await.is_err() {
            tracing::warn!("LMCache PD receiver: the answer could not be sent");
        }
    }
}
