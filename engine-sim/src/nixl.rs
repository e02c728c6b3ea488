//! vLLM's NixlConnector hand-off, as the prefill side sees it: the `kv_transfer_params` a
//! prefill-only request is answered with (vLLM 0.32's fields), and a bounded memory of recent
//! hand-offs, each of which a decoder can pull once (vLLM frees the blocks once read).
//!
//! The decode side (`crate::handoff`) asks the prefill engine's side channel about the hand-off
//! before it models the pull by its transfer time (see [`crate::engine`]).

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use serde::Serialize;
use serde_json::{Value, json};

/// How many recent hand-offs a prefill engine remembers.
const HANDOFFS_KEPT: usize = 1000;

/// One prefill result handed to a remote decoder (listed by `GET /sim/handoffs`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub(crate) struct Handoff {
    /// The engine's internal id of the prefill request (`remote_request_id`): the client's
    /// id, then `-` and 8 hex digits, as vLLM makes it.
    pub request_id: String,
    /// The client's `X-Request-Id` of the prefill request.
    pub external_id: String,
    pub block_ids: Vec<u64>,
    pub prompt_tokens: u32,
    /// A decoder pulled it (a second pull finds nothing).
    pub pulled: bool,
    /// When it was handed off (its blocks are kept for the lease from then).
    #[serde(skip)]
    pub issued: Instant,
}

/// Hands out block ids and remembers the latest hand-offs.
#[derive(Debug)]
pub(crate) struct Handoffs {
    next_block_id: AtomicU64,
    pool_blocks: u64,
    /// How long a hand-off can be pulled (`--kv-lease-s`, on the wall clock).
    lease: Duration,
    recent: Mutex<VecDeque<Handoff>>,
}

impl Handoffs {
    pub(crate) fn new(pool_blocks: usize, lease: Duration) -> Self {
        Self {
            next_block_id: AtomicU64::new(0),
            pool_blocks: (pool_blocks as u64).max(1),
            lease,
            recent: Mutex::new(VecDeque::new()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, VecDeque<Handoff>> {
        self.recent
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Records a hand-off of a `prompt_tokens`-token prompt under the engine's internal id
    /// `request_id` and returns its block ids (one per block, the partial last one
    /// included). The ids look like vLLM's physical block indices; a decoder only counts them.
    pub(crate) fn record(
        &self,
        request_id: &str,
        external_id: &str,
        prompt_tokens: u32,
        block_size: usize,
    ) -> Vec<u64> {
        let blocks = (prompt_tokens as usize).div_ceil(block_size.max(1)) as u64;
        let first = self.next_block_id.fetch_add(blocks, Ordering::Relaxed);
        let block_ids: Vec<u64> = (first..first + blocks)
            .map(|id| id % self.pool_blocks)
            .collect();
        let mut recent = self.lock();
        if recent.len() == HANDOFFS_KEPT {
            recent.pop_front();
        }
        recent.push_back(Handoff {
            request_id: request_id.to_owned(),
            external_id: external_id.to_owned(),
            block_ids: block_ids.clone(),
            prompt_tokens,
            pulled: false,
            issued: Instant::now(),
        });
        block_ids
    }

    /// A decoder's pull of the hand-off `request_id`: it, marked pulled, if it was issued,
    /// not pulled yet and is within its lease (vLLM frees the blocks of a lapsed lease).
    pub(crate) fn pull(&self, request_id: &str) -> Result<Handoff, PullError> {
        let mut recent = self.lock();
        let handoff = recent
            .iter_mut()
            .rev()
            .find(|handoff| handoff.request_id == request_id && !handoff.pulled)
            .ok_or(PullError::Unknown)?;
        if handoff.issued.elapsed() > self.lease {
            return Err(PullError::Lapsed);
        }
        handoff.pulled = true;
        Ok(handoff.clone())
    }

    /// The remembered hand-offs, oldest first.
    pub(crate) fn snapshot(&self) -> Vec<Handoff> {
        self.lock().iter().cloned().collect()
    }
}

/// Why a pull found nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PullError {
    /// Never issued under that id, or pulled already.
    Unknown,
    /// Issued, but its lease lapsed before the pull: the blocks are freed.
    Lapsed,
}

/// The engine's internal id of a request whose client id is `external` (vLLM:
/// `{external}-{8 hex digits}`).
pub(crate) fn internal_request_id(external: &str) -> String {
    format!("{external}-{:08x}", fastrand::u32(..))
}

/// Where this engine's side channel is: the host it reports and the address it listens on.
#[derive(Debug, Clone)]
pub(crate) struct SideChannel {
    pub host: String,
    pub addr: SocketAddr,
}

/// The `kv_transfer_params` of a prefill response, which a proxy copies into the decode
/// request: vLLM 0.32's fields, the block ids as one list per KV-cache group (one group here).
pub(crate) fn prefill_response_params(
    engine_id: &str,
    request_id: &str,
    block_ids: &[u64],
    prompt_tokens: u32,
    side_channel: Option<&SideChannel>,
) -> Value {
    json!({
        "do_remote_prefill": true,
        "do_remote_decode": false,
        "remote_block_ids": [block_ids],
        "remote_engine_id": engine_id,
        "remote_request_id": request_id,
        "remote_host": side_channel.map_or("localhost", |side| side.host.as_str()),
        "remote_port": side_channel.map_or(0, |side| side.addr.port()),
        "tp_size": 1,
        "dcp_size": 1,
        "pp_size": 1,
        "remote_num_tokens": prompt_tokens,
        "remote_blocks_expiry_time": null,
        "transfer_mode": "pull",
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_block_id_per_prompt_block_including_the_partial_one() {
        let handoffs = Handoffs::new(10, Duration::from_secs(30));
        assert_eq!(handoffs.record("a-1", "a", 33, 16), vec![0, 1, 2]);
        assert_eq!(handoffs.record("b-1", "b", 160, 16).len(), 10);
        let recent = handoffs.snapshot();
        assert_eq!(recent.len(), 2);
        assert_eq!(recent[0].request_id, "a-1");
        assert_eq!(recent[0].external_id, "a");
        assert_eq!(recent[0].prompt_tokens, 33);
    }

    #[test]
    fn a_hand_off_is_pulled_once_within_its_lease() {
        let handoffs = Handoffs::new(10, Duration::from_secs(30));
        handoffs.record("a-1", "a", 33, 16);
        assert_eq!(
            handoffs.pull("a").unwrap_err(),
            PullError::Unknown,
            "the client's id is not the engine's"
        );
        assert_eq!(handoffs.pull("a-1").unwrap().block_ids, vec![0, 1, 2]);
        assert_eq!(handoffs.pull("a-1").unwrap_err(), PullError::Unknown);
        assert!(handoffs.snapshot()[0].pulled);
        let lapsing = Handoffs::new(10, Duration::ZERO);
        lapsing.record("b-1", "b", 33, 16);
        std::thread::sleep(Duration::from_millis(1));
        assert_eq!(lapsing.pull("b-1").unwrap_err(), PullError::Lapsed);
    }

    #[test]
    fn params_are_vllm_0_32s() {
        let side = SideChannel {
            host: "localhost".into(),
            addr: "127.0.0.1:5600".parse().unwrap(),
        };
        let params =
            prefill_response_params("engine-1", "req-1-0a1b2c3d", &[4, 5], 20, Some(&side));
        assert_eq!(params["remote_host"], "localhost");
        assert_eq!(params["remote_port"], 5600);
        assert_eq!(params["do_remote_prefill"], true);
        assert_eq!(params["remote_block_ids"], json!([[4, 5]]));
        assert_eq!(params["remote_num_tokens"], 20);
        for (field, value) in [
            ("tp_size", json!(1)),
            ("dcp_size", json!(1)),
            ("pp_size", json!(1)),
        ] {
            assert_eq!(params[field], value, "{field}");
        }
        assert_eq!(params["transfer_mode"], "pull");
        assert!(params["remote_blocks_expiry_time"].is_null());
        let id = internal_request_id("chatcmpl-r");
        assert!(
            id.starts_with("chatcmpl-r-") && id.len() == "chatcmpl-r-".len() + 8,
            "{id}"
        );
    }
}
