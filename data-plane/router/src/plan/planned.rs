//! A plan: where a request may go, in order, and the body to send.

use std::sync::Arc;

use bytes::Bytes;
use http::HeaderValue;
use http::header::HeaderName;
use switchyard_policy::rank as policy_rank;

use super::count::Count;
use super::flow::FlowKey;
use crate::observe::labels::RouteLabel;
use crate::routing::table::{EndpointRoute, VariantRoute};

/// A request ready to forward: where it may go, in order, and the body to send.
#[derive(Debug)]
pub struct Plan {
    pub endpoint: Arc<EndpointRoute>,
    pub variant_index: usize,
    pub ranking: policy_rank::Ranking,
    pub body: Bytes,
    /// The path (and query) on the instance, for operations without a prepared URL
    /// ([`Operation::upstream`]).
    pub path: Option<String>,
    /// Why the first candidate is chosen (`x-switchyard-route`).
    pub label: RouteLabel,
    /// Response headers that explain the decision (`x-switchyard-prompt-tokens`, …).
    pub explain: Vec<(HeaderName, HeaderValue)>,
    /// Set when the request goes prefill → decode (the ranking is then the decoders').
    pub prefill_hop: Option<PrefillHop>,
    /// Once ranked by a KV index: the leading prompt tokens each instance holds, by position
    /// in the variant (`x-switchyard-cached-tokens`); empty otherwise.
    pub cached_tokens: Vec<u32>,
    /// Once ranked by a KV index: the data-parallel rank to send to, by position in the
    /// variant (vLLM's `X-data-parallel-rank`; None: the engine picks); empty otherwise.
    pub data_parallel_ranks: Vec<Option<u32>>,
    /// PREFIX_AWARE: the routing key the ranking hashed (for the trace; None otherwise).
    pub routing_key: Option<u64>,
    /// Its place in a flow-control queue (priority, fairness id).
    pub flow: FlowKey,
    /// Pinned to one instance (a stored response's holder, a follow-up, a session): under
    /// flow control it waits for that instance rather than going elsewhere.
    pub pinned: bool,
}

impl Plan {
    pub fn variant(&self) -> &VariantRoute {
        &self.endpoint.variants[self.variant_index]
    }
}

/// A long prompt's way through a disaggregated endpoint.
#[derive(Debug)]
pub struct PrefillHop {
    /// Prefill candidates (indices into the prefill variant), in preference order.
    pub prefill: policy_rank::Ranking,
    /// The prompt's tokens as counted.
    pub count: Count,
    /// KV_AWARE prefill, once ranked by the prefill pool's KV index: the leading prompt
    /// tokens each prefill instance holds, by position (`x-switchyard-prefill-cached-tokens`);
    /// empty otherwise.
    pub prefill_cached_tokens: Vec<u32>,
    /// KV_AWARE prefill: the data-parallel rank of each prefill instance to send to, by
    /// position (None: the engine picks); empty otherwise.
    pub prefill_ranks: Vec<Option<u32>>,
    /// The request to send to the prefill instance (made here, off the serving thread).
    pub prefill_body: Option<Bytes>,
    /// LMCACHE_PD: the prompt's token ids (both hops are made of them once the decoder is
    /// chosen); None until settled, or when they could not be had.
    pub token_ids: Option<Vec<u32>>,
}
