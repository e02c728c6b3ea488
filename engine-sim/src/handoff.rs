//! The two KV hand-offs between simulated engines, done for real over HTTP so that a router
//! cannot fake them:
//!
//! - NixlConnector (pull): a decode request carries the `kv_transfer_params` a prefill engine
//!   answered with. Before pulling, the decoder asks that engine (`remote_host:remote_port`,
//!   `GET /sim/handoffs/{remote_request_id}`) what it issued, and accepts the hand-off only if
//!   the engine id, the request id (its own `X-Request-Id` too) and the block ids all match;
//!   otherwise it recomputes the prompt, as vLLM does when a KV load fails.
//! - LMCache (push): a prefill engine started with `--kv-push-to URL` pushes each prompt's
//!   blocks to that decoder (`POST /sim/kv-push`) after prefilling it; the decoder caches them,
//!   so the request sent to it next finds its prompt cached.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde::{Deserialize, Serialize};

use crate::openai::KvTransfer;

pub(crate) type HttpClient = Client<HttpConnector, Full<Bytes>>;

/// Each hand-off call's deadline.
const CALL_TIMEOUT: Duration = Duration::from_secs(5);
/// The most of an answer read.
const MOST_ANSWER_BYTES: usize = 4 << 20;

pub(crate) fn http_client() -> HttpClient {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    connector.set_connect_timeout(Some(Duration::from_secs(2)));
    Client::builder(TokioExecutor::new()).build(connector)
}

/// What a prefill engine says it handed off for one request (`GET /sim/handoffs/{id}`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct IssuedHandoff {
    pub engine_id: String,
    pub request_id: String,
    pub block_ids: Vec<u64>,
    pub prompt_tokens: u32,
}

/// Blocks pushed by a prefill engine (`POST /sim/kv-push`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Push {
    pub block_hashes: Vec<u64>,
    /// The blocks' tokens (for KV events); may be empty.
    #[serde(default)]
    pub token_ids: Vec<u32>,
}

async fn call(
    client: &HttpClient,
    request: http::Request<Full<Bytes>>,
) -> Result<(http::StatusCode, Bytes), String> {
    let answer = tokio::time::timeout(CALL_TIMEOUT, async {
        let response = client
            .request(request)
            .await
            .map_err(|err| err.to_string())?;
        let status = response.status();
        let body = http_body_util::Limited::new(response.into_body(), MOST_ANSWER_BYTES)
            .collect()
            .await
            .map_err(|err| err.to_string())?
            .to_bytes();
        Ok::<_, String>((status, body))
    })
    .await
    .map_err(|_| format!("no answer within {CALL_TIMEOUT:?}"))??;
    Ok(answer)
}

/// Checks a decode request's hand-off with the prefill engine it names. `Ok` means the KV can
/// be pulled; `Err` says why not.
pub(crate) async fn verify(
    client: &HttpClient,
    kv: &KvTransfer,
    own_request_id: &str,
) -> Result<(), String> {
    let (Some(host), Some(port)) = (&kv.remote_host, kv.remote_port) else {
        return Err("kv_transfer_params has no remote_host/remote_port".into());
    };
    let request_id = kv
        .remote_request_id
        .as_deref()
        .ok_or("kv_transfer_params has no remote_request_id")?;
    if request_id != own_request_id {
        return Err(format!(
            "remote_request_id {request_id} is not this request's ({own_request_id})"
        ));
    }
    let url = format!("http://{host}:{port}/sim/handoffs/{request_id}");
    let request = http::Request::get(&url)
        .body(Full::new(Bytes::new()))
        .map_err(|err| err.to_string())?;
    let (status, body) = call(client, request).await?;
    if !status.is_success() {
        return Err(format!("{url} answered {status}: no such hand-off"));
    }
    let issued: IssuedHandoff =
        serde_json::from_slice(&body).map_err(|err| format!("{url}: {err}"))?;
    if kv.remote_engine_id.as_deref() != Some(issued.engine_id.as_str()) {
        return Err(format!(
            "remote_engine_id {:?} is not the engine at {host}:{port} ({})",
            kv.remote_engine_id, issued.engine_id
        ));
    }
    if kv.remote_block_ids.as_deref() != Some(issued.block_ids.as_slice()) {
        return Err("remote_block_ids differ from the blocks the prefill engine issued".into());
    }
    Ok(())
}

/// Pushes a prompt's blocks to the decoder at `partner` (a base URL); returns how many were
/// new there.
pub(crate) async fn push(client: &HttpClient, partner: &str, push: &Push) -> Result<usize, String> {
    let url = format!("{}/sim/kv-push", partner.trim_end_matches('/'));
    let body = serde_json::to_vec(push).map_err(|err| err.to_string())?;
    let request = http::Request::post(&url)
        .header(http::header::CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from(body)))
        .map_err(|err| err.to_string())?;
    let (status, body) = call(client, request).await?;
    if !status.is_success() {
        return Err(format!("{url} answered {status}"));
    }
    #[derive(Deserialize)]
    struct Stored {
        stored: usize,
    }
    serde_json::from_slice::<Stored>(&body)
        .map(|stored| stored.stored)
        .map_err(|err| format!("{url}: {err}"))
}
