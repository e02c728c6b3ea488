//! The two KV hand-offs between simulated engines, done for real over the network so that a
//! router cannot fake them:
//!
//! - NixlConnector (pull): a decode request carries the `kv_transfer_params` a prefill engine
//!   answered with. Before pulling, the decoder asks that engine's side channel (a listener
//!   apart from its HTTP port, at `remote_host:remote_port`, as vLLM's NIXL handshake is) for
//!   the hand-off `remote_request_id`, and pulls only if it was issued, not pulled before, and
//!   the engine id and the block ids (one list per KV-cache group) match. Otherwise the pull
//!   fails, and the request fails or is recomputed as `--kv-load-failure-policy` says. Like
//!   vLLM, the decoder never compares `remote_request_id` with its own request id.
//! - LMCache (push): a prefill engine started with `--kv-push-to URL` pushes each prompt's
//!   blocks to that decoder (`POST /sim/kv-push`) after prefilling it; the decoder caches them,
//!   so the request sent to it next finds its prompt cached.

use std::time::Duration;

use bytes::Bytes;
use http::StatusCode;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde::{Deserialize, Serialize};

use crate::openai::{BlockIds, KvTransfer};

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

/// What a prefill engine's side channel says it handed off for one request
/// (`GET /handoffs/{id}` there).
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

/// Why a hand-off could not be checked or done; the message is what the request's record and
/// the log show.
#[derive(Debug, thiserror::Error)]
pub(crate) enum HandoffError {
    #[error("kv_transfer_params has no remote_host/remote_port")]
    NoRemoteAddress,
    #[error("kv_transfer_params has no remote_request_id")]
    NoRemoteRequestId,
    #[error(
        "remote_block_ids must hold one list of block ids per KV-cache group (this engine has 1)"
    )]
    NotGrouped,
    #[error("remote_engine_id {claimed:?} is not the engine at {host}:{port} ({actual})")]
    OtherEngine {
        claimed: Option<String>,
        host: String,
        port: u16,
        actual: String,
    },
    #[error("remote_block_ids differ from the blocks the prefill engine issued")]
    OtherBlocks,
    #[error("{url} answered {status}: {why}")]
    NoSuchHandoff {
        url: String,
        status: StatusCode,
        /// The prefill engine's own message (what became of the hand-off).
        why: String,
    },
    #[error("{url} answered {status}")]
    Refused { url: String, status: StatusCode },
    /// The other engine's answer is not the JSON expected (the error is in the message).
    #[error("{url}: {error}")]
    BadAnswer {
        url: String,
        error: serde_json::Error,
    },
    #[error("no answer within {0:?}")]
    Timeout(Duration),
    #[error(transparent)]
    Request(#[from] http::Error),
    #[error(transparent)]
    Encode(serde_json::Error),
    #[error(transparent)]
    Send(#[from] hyper_util::client::legacy::Error),
    #[error(transparent)]
    Read(Box<dyn std::error::Error + Send + Sync>),
}

async fn call(
    client: &HttpClient,
    request: http::Request<Full<Bytes>>,
) -> Result<(StatusCode, Bytes), HandoffError> {
    tokio::time::timeout(CALL_TIMEOUT, async {
        let response = client.request(request).await?;
        let status = response.status();
        let body = http_body_util::Limited::new(response.into_body(), MOST_ANSWER_BYTES)
            .collect()
            .await
            .map_err(HandoffError::Read)?
            .to_bytes();
        Ok((status, body))
    })
    .await
    .map_err(|_| HandoffError::Timeout(CALL_TIMEOUT))?
}

/// Checks a decode request's hand-off with the prefill engine it names. `Ok` means the KV can
/// be pulled; `Err` says why not.
pub(crate) async fn verify(client: &HttpClient, kv: &KvTransfer) -> Result<(), HandoffError> {
    let (Some(host), Some(port)) = (&kv.remote_host, kv.remote_port) else {
        return Err(HandoffError::NoRemoteAddress);
    };
    let request_id = kv
        .remote_request_id
        .as_deref()
        .ok_or(HandoffError::NoRemoteRequestId)?;
    let groups = match &kv.remote_block_ids {
        Some(BlockIds::Groups(groups)) if groups.len() == 1 => groups,
        _ => return Err(HandoffError::NotGrouped),
    };
    let host = host.trim_matches(['[', ']']);
    let authority = if host.contains(':') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    };
    let url = format!("http://{authority}/handoffs/{}", path_segment(request_id));
    let request = http::Request::get(&url).body(Full::new(Bytes::new()))?;
    let (status, body) = call(client, request).await?;
    if !status.is_success() {
        let why = serde_json::from_slice::<serde_json::Value>(&body)
            .ok()
            .and_then(|answer| answer["error"]["message"].as_str().map(str::to_owned))
            .unwrap_or_else(|| "no such hand-off (or it was pulled already)".to_owned());
        return Err(HandoffError::NoSuchHandoff { url, status, why });
    }
    let issued: IssuedHandoff = match serde_json::from_slice(&body) {
        Ok(issued) => issued,
        Err(error) => return Err(HandoffError::BadAnswer { url, error }),
    };
    if kv.remote_engine_id.as_deref() != Some(issued.engine_id.as_str()) {
        return Err(HandoffError::OtherEngine {
            claimed: kv.remote_engine_id.clone(),
            host: host.to_owned(),
            port,
            actual: issued.engine_id,
        });
    }
    if groups[0] != issued.block_ids {
        return Err(HandoffError::OtherBlocks);
    }
    Ok(())
}

/// `text` as one URL path segment: unreserved characters as they are, every other byte
/// percent-encoded (a client's request id may hold anything).
fn path_segment(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for byte in text.bytes() {
        if byte.is_ascii_alphanumeric() || b"-._~".contains(&byte) {
            out.push(char::from(byte));
        } else {
            out.push_str(&format!("%{byte:02X}"));
        }
    }
    out
}

/// Pushes a prompt's blocks to the decoder at `partner` (a base URL); returns how many were
/// new there.
pub(crate) async fn push(
    client: &HttpClient,
    partner: &str,
    push: &Push,
) -> Result<usize, HandoffError> {
    let url = format!("{}/sim/kv-push", partner.trim_end_matches('/'));
    let body = serde_json::to_vec(push).map_err(HandoffError::Encode)?;
    let request = http::Request::post(&url)
        .header(http::header::CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from(body)))?;
    let (status, body) = call(client, request).await?;
    if !status.is_success() {
        return Err(HandoffError::Refused { url, status });
    }
    #[derive(Deserialize)]
    struct Stored {
        stored: usize,
    }
    match serde_json::from_slice::<Stored>(&body) {
        Ok(stored) => Ok(stored.stored),
        Err(error) => Err(HandoffError::BadAnswer { url, error }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_id_is_one_path_segment() {
        assert_eq!(path_segment("chatcmpl-a_b.c~1-0f"), "chatcmpl-a_b.c~1-0f");
        assert_eq!(path_segment("a/b c?é"), "a%2Fb%20c%3F%C3%A9");
    }

    #[test]
    fn messages_are_the_ones_records_and_logs_show() {
        let url = "http://h:1/sim/handoffs/r".to_owned();
        for (error, message) in [
            (
                HandoffError::NoRemoteAddress,
                "kv_transfer_params has no remote_host/remote_port",
            ),
            (
                HandoffError::NoRemoteRequestId,
                "kv_transfer_params has no remote_request_id",
            ),
            (
                HandoffError::NotGrouped,
                "remote_block_ids must hold one list of block ids per KV-cache group (this engine has 1)",
            ),
            (
                HandoffError::OtherEngine {
                    claimed: Some("e1".into()),
                    host: "h".into(),
                    port: 1,
                    actual: "e2".into(),
                },
                "remote_engine_id Some(\"e1\") is not the engine at h:1 (e2)",
            ),
            (
                HandoffError::OtherBlocks,
                "remote_block_ids differ from the blocks the prefill engine issued",
            ),
            (
                HandoffError::NoSuchHandoff {
                    url: url.clone(),
                    status: StatusCode::NOT_FOUND,
                    why: "no such hand-off (or it was pulled already)".into(),
                },
                "http://h:1/sim/handoffs/r answered 404 Not Found: no such hand-off (or it was pulled already)",
            ),
            (
                HandoffError::Refused {
                    url,
                    status: StatusCode::BAD_REQUEST,
                },
                "http://h:1/sim/handoffs/r answered 400 Bad Request",
            ),
            (HandoffError::Timeout(CALL_TIMEOUT), "no answer within 5s"),
        ] {
            assert_eq!(error.to_string(), message);
        }
    }
}
