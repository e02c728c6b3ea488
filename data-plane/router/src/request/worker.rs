//! What each serving thread works with (see [`Worker`]).

use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use switchyard_kv::KvIndex;

use super::local_tokens::LocalTokenizers;
use super::queue::FlowControl;
use super::tokenize::TokenizeClient;
use crate::forward::ForwardSettings;
use crate::forward::notices::NoticeBoard;
use crate::forward::upstream::UpstreamClients;
use crate::observe::metrics::RouterMetrics;
use crate::plan::count::TokenCounters;
use crate::routing::cells::LoadRegistry;
use crate::routing::table::RoutingTable;
use crate::server::admission::Admission;

/// What one serving thread works with: the routing state, limits and metrics every thread
/// shares, and this thread's own upstream connection pools (so that a request and the
/// upstream connection it uses are driven by the same thread).
#[derive(Debug)]
pub struct Worker {
    pub table: Arc<ArcSwap<RoutingTable>>,
    pub registry: Arc<LoadRegistry>,
    pub clients: UpstreamClients,
    pub forwarding: ForwardSettings,
    pub client_body_deadline: Duration,
    pub metrics: Arc<RouterMetrics>,
    pub admission: Arc<Admission>,
    /// Prompt token counters for disaggregated endpoints.
    pub counters: Arc<TokenCounters>,
    /// Starts the requests' spans when tracing is on.
    pub tracer: Option<switchyard_telemetry::SpanSink>,
    /// KV_AWARE: what the engines' KV events say each instance holds.
    pub kv_index: Arc<KvIndex>,
    /// KV_AWARE: this thread's `/tokenize` client.
    pub tokenize: TokenizeClient,
    /// KV_AWARE: the token ids computed in the router (KvAwareRoutingConfig.Tokenizer).
    pub local_tokens: Arc<LocalTokenizers>,
    /// MaxInFlightPerInstance: the router's flow-control queues (shared by every thread).
    pub flow: Arc<FlowControl>,
    /// LMCACHE_PD: the requests waiting for LMCache's "KV ready" notices (None without
    /// `--lmcache-notice-bind`).
    pub notices: Option<Arc<NoticeBoard>>,
}

impl Worker {
    /// The same shared state with other connection pools (another serving thread's, its
    /// `/tokenize` client included).
    pub fn with_clients(&self, clients: UpstreamClients) -> Self {
        Self {
            table: Arc::clone(&self.table),
            registry: Arc::clone(&self.registry),
            clients,
            forwarding: self.forwarding,
            client_body_deadline: self.client_body_deadline,
            metrics: Arc::clone(&self.metrics),
            admission: Arc::clone(&self.admission),
            counters: Arc::clone(&self.counters),
            tracer: self.tracer.clone(),
            kv_index: Arc::clone(&self.kv_index),
            tokenize: self.tokenize.like(),
            local_tokens: Arc::clone(&self.local_tokens),
            flow: Arc::clone(&self.flow),
            notices: self.notices.clone(),
        }
    }
}
