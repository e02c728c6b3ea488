//! vLLM's NixlConnector hand-off, as the prefill side sees it: the `kv_transfer_params` a
//! prefill-only request is answered with, and a bounded memory of recent hand-offs.
//!
//! The decode side needs nothing from here: it reads `do_remote_prefill` and the number of
//! `remote_block_ids`, and models the pull by its transfer time (see [`crate::engine`]).

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use serde::Serialize;
use serde_json::{Value, json};

/// How many recent hand-offs a prefill engine remembers.
const HANDOFFS_KEPT: usize = 1000;

/// One prefill result handed to a remote decoder (listed by `GET /sim/handoffs`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub(crate) struct Handoff {
    pub request_id: String,
    pub block_ids: Vec<u64>,
    pub prompt_tokens: u32,
}

/// Hands out block ids and remembers the latest hand-offs.
#[derive(Debug)]
pub(crate) struct Handoffs {
    next_block_id: AtomicU64,
    pool_blocks: u64,
    recent: Mutex<VecDeque<Handoff>>,
}

impl Handoffs {
    pub(crate) fn new(pool_blocks: usize) -> Self {
        Self {
            next_block_id: AtomicU64::new(0),
            pool_blocks: (pool_blocks as u64).max(1),
            recent: Mutex::new(VecDeque::new()),
        }
    }

    /// Records a hand-off of a `prompt_tokens`-token prompt and returns its block ids (one per
    /// block, the partial last one included). The ids look like vLLM's physical block
    /// indices; a decoder only counts them.
    pub(crate) fn record(
        &self,
        request_id: &str,
        prompt_tokens: u32,
        block_size: usize,
    ) -> Vec<u64> {
        let blocks = (prompt_tokens as usize).div_ceil(block_size.max(1)) as u64;
        let first = self.next_block_id.fetch_add(blocks, Ordering::Relaxed);
        let block_ids: Vec<u64> = (first..first + blocks)
            .map(|id| id % self.pool_blocks)
            .collect();
        let mut recent = self
            .recent
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if recent.len() == HANDOFFS_KEPT {
            recent.pop_front();
        }
        recent.push_back(Handoff {
            request_id: request_id.to_owned(),
            block_ids: block_ids.clone(),
            prompt_tokens,
        });
        block_ids
    }

    /// The remembered hand-offs, oldest first.
    pub(crate) fn snapshot(&self) -> Vec<Handoff> {
        self.recent
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .iter()
            .cloned()
            .collect()
    }
}

/// The `kv_transfer_params` of a prefill response, which a proxy copies into the decode
/// request.
pub(crate) fn prefill_response_params(
    engine_id: &str,
    request_id: &str,
    block_ids: &[u64],
    addr: Option<SocketAddr>,
) -> Value {
    let host = match addr {
        Some(addr) if !addr.ip().is_unspecified() => addr.ip().to_string(),
        _ => "127.0.0.1".to_owned(),
    };
    json!({
        "do_remote_prefill": true,
        "do_remote_decode": false,
        "remote_block_ids": block_ids,
        "remote_engine_id": engine_id,
        "remote_request_id": request_id,
        "remote_host": host,
        "remote_port": addr.map_or(0, |addr| addr.port()),
        "tp_size": 1,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_block_id_per_prompt_block_including_the_partial_one() {
        let handoffs = Handoffs::new(10);
        assert_eq!(handoffs.record("a", 33, 16), vec![0, 1, 2]);
        assert_eq!(handoffs.record("b", 160, 16).len(), 10);
        let recent = handoffs.snapshot();
        assert_eq!(recent.len(), 2);
        assert_eq!(recent[0].request_id, "a");
        assert_eq!(recent[0].prompt_tokens, 33);
    }

    #[test]
    fn params_name_this_engine() {
        let addr: SocketAddr = "0.0.0.0:9001".parse().unwrap();
        let params = prefill_response_params("engine-1", "req-1", &[4, 5], Some(addr));
        assert_eq!(params["remote_host"], "127.0.0.1");
        assert_eq!(params["remote_port"], 9001);
        assert_eq!(params["do_remote_prefill"], true);
        assert_eq!(params["remote_block_ids"], json!([4, 5]));
        assert_eq!(params["tp_size"], 1);
    }
}
