//! The routing table: an immutable snapshot of endpoints, variants and routable instances,
//! swapped in atomically whenever membership changes (no request ever sees half a change).
//! `membership` builds it incrementally: an instance's route (its URIs parsed) is made once
//! when the instance arrives, and a change rebuilds only the endpoints it touches; the new
//! table shares every other endpoint with the old one.
//!
//! Load lives outside the snapshot, in one `InstanceCell` per (endpoint, instance) that
//! survives table swaps, so in-flight counts stay exact across membership and config changes.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use switchyard_policy::hash::instance_hash;
use switchyard_policy::rank::{self, InstanceView, KeyHistory, LoadBalance, Route, Strategy};
use switchyard_shared::{
    DecodeRoutingStrategy, EndpointConfig, EndpointName, Instance, InstanceId, InstanceKey,
    InstanceProtocol, KvEventsEndpoints, KvTransferProtocol, PrefillRoutingStrategy,
    RoutingStrategy, ThresholdBasis, VariantName,
};

/// Why a request went to an instance: the policy's routes, plus the router's own retries.
/// The `route` label of `switchyard_router_requests_total` and `x-switchyard-route`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RouteLabel {
    Prefix,
    Overflow,
    Random,
    LeastOutstanding,
    Session,
    /// KV_AWARE: the instance holding most of the prompt's KV cache.
    Kv,
    /// A disaggregated endpoint's short prompt, served whole by a decoder.
    Direct,
    /// A long prompt prefilled on one instance and decoded on another.
    Disaggregated,
    /// The prefill failed or timed out: the decoder serves the whole request.
    Fallback,
    /// The instance that stores the response a request is about (Responses API).
    Response,
    /// The previous candidate provably never received the request.
    Retry,
    /// The previous candidate may have received it (`--retry-after-send`).
    RetryAfterSend,
}

impl RouteLabel {
    pub const ALL: [RouteLabel; 12] = [
        RouteLabel::Prefix,
        RouteLabel::Overflow,
        RouteLabel::Random,
        RouteLabel::LeastOutstanding,
        RouteLabel::Session,
        RouteLabel::Kv,
        RouteLabel::Direct,
        RouteLabel::Disaggregated,
        RouteLabel::Fallback,
        RouteLabel::Response,
        RouteLabel::Retry,
        RouteLabel::RetryAfterSend,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            RouteLabel::Prefix => Route::Prefix.as_str(),
            RouteLabel::Overflow => Route::Overflow.as_str(),
            RouteLabel::Random => Route::Random.as_str(),
            RouteLabel::LeastOutstanding => Route::LeastOutstanding.as_str(),
            RouteLabel::Session => Route::Session.as_str(),
            RouteLabel::Kv => Route::Kv.as_str(),
            RouteLabel::Direct => "direct",
            RouteLabel::Disaggregated => "disaggregated",
            RouteLabel::Fallback => "fallback",
            RouteLabel::Response => Route::Response.as_str(),
            RouteLabel::Retry => "retry",
            RouteLabel::RetryAfterSend => "retry-after-send",
        }
    }
}

impl From<Route> for RouteLabel {
    fn from(route: Route) -> Self {
        match route {
            Route::Prefix => RouteLabel::Prefix,
            Route::Overflow => RouteLabel::Overflow,
            Route::Random => RouteLabel::Random,
            Route::LeastOutstanding => RouteLabel::LeastOutstanding,
            Route::Session => RouteLabel::Session,
            Route::Kv => RouteLabel::Kv,
            Route::Response => RouteLabel::Response,
        }
    }
}

/// How a request to an instance failed: the `kind` label of
/// `switchyard_router_upstream_errors_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UpstreamError {
    /// Not reached: connection refused or timed out, stream refused (retried elsewhere).
    Refused,
    /// The connection failed after the request was sent (answered 502, or cut mid-answer).
    Reset,
    /// No response head in time (504).
    Timeout,
    /// The answer stalled after it began.
    StreamIdle,
}

impl UpstreamError {
    pub const ALL: [UpstreamError; 4] = [
        UpstreamError::Refused,
        UpstreamError::Reset,
        UpstreamError::Timeout,
        UpstreamError::StreamIdle,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            UpstreamError::Refused => "refused",
            UpstreamError::Reset => "reset",
            UpstreamError::Timeout => "timeout",
            UpstreamError::StreamIdle => "stream_idle",
        }
    }
}

/// Live counters of one instance, shared by every table that contains it.
#[derive(Debug, Default)]
pub struct InstanceCell {
    /// Requests this router has in flight on the instance (exact).
    pub local: AtomicU32,
    /// Requests every other router has in flight (from the control plane).
    pub remote: AtomicU32,
    /// Consecutive connection failures.
    pub failures: AtomicU32,
    /// Unix ms until which the instance is ejected locally (0: not ejected).
    pub ejected_until_ms: AtomicU64,
    /// KV_AWARE: whether the instance may be asked to tokenize (paused after failures).
    pub tokenize_backoff: crate::kv::tokenize::TokenizeBackoff,
    /// Requests sent, by `RouteLabel`.
    pub requests: [AtomicU64; RouteLabel::ALL.len()],
    /// Failed requests, by `UpstreamError`.
    pub upstream_errors: [AtomicU64; UpstreamError::ALL.len()],
    /// PREFIX_AWARE keys this router spilled onto the instance (bounded loads).
    pub spills: SpillMemory,
    /// Bounded PREFIX_AWARE: requests this router sent to the instance lately, halved with
    /// the variant's key counts ([`KeyPopularity`]); a new copy goes where it is smallest
    /// among the instances within one request of the least loaded.
    pub recent: AtomicU32,
}

/// The PREFIX_AWARE keys a router spilled onto one instance under bounded loads: where it
/// knows a copy of the prefix is cached besides the key's owner, so that later spills of the
/// key go back there instead of making yet another copy (`rank::rank_remembering`).
///
/// A hint, kept small and lock-free: a direct-mapped table of [`SPILL_SLOTS`] keys, allocated
/// on the first spill. A key that collides with another forgets the older one, whose next
/// spill then goes where a new key's would. Each entry carries when the key was last spilled
/// there and is forgotten [`SPILL_MEMORY_MS`] later: the engine has likely evicted a copy
/// nobody used for that long, and going back to it would cost a miss anyway. Until then, an
/// instance that lost its cache (a restart under the same id) costs one miss per remembered
/// key. Times come from [`switchyard_process::clock::monotonic_ms`], this process's monotonic clock, so a wall clock
/// that steps neither revives nor drops entries.
#[derive(Debug, Default)]
pub struct SpillMemory {
    /// Per slot: 1 (occupied), 31 bits of the key above its slot, then the time of the last
    /// spill in [`SPILL_TICK_MS`] ticks (32 bits: 139 years).
    slots: OnceLock<Box<[AtomicU64]>>,
}

/// Keys remembered per instance (8 bytes each).
pub const SPILL_SLOTS: usize = 512;
/// How long a spill is remembered after the last one of its key to that instance.
pub const SPILL_MEMORY_MS: u64 = 120_000;
/// The resolution of [`SpillMemory`]'s times.
const SPILL_TICK_MS: u64 = 1024;
const SPILL_TICK_BITS: u32 = 32;
const SPILL_TICK_MASK: u64 = (1 << SPILL_TICK_BITS) - 1;

/// How often each PREFIX_AWARE key of one variant came through this router lately, enough to
/// tell a hot key (at least `1 / (2 N)` of the variant's recent requests, N its instances)
/// from the rest: a hot key spills without the slack (`LoadBalance::hot`).
///
/// A heavy-hitter sketch, lock-free and fixed in size: [`POPULARITY_SLOTS`] direct-mapped
/// counters. A key that finds its slot held by another wears the holder's count down by one
/// and takes the slot at zero, so a frequent key keeps its slot against rare ones. Every
/// [`POPULARITY_WINDOW`] requests all counts (and the total) are halved, so a key that cools
/// down stops being hot within a few windows. Nothing counts as hot before
/// [`POPULARITY_MIN_COUNTED`] requests.
#[derive(Debug)]
pub struct KeyPopularity {
    /// Per slot: the key's top 40 bits, then a 24-bit count.
    slots: Box<[AtomicU64]>,
    /// Requests counted, halved with the counts.
    counted: AtomicU64,
    /// Requests seen, never halved: when to halve.
    seen: AtomicU64,
}

pub const POPULARITY_SLOTS: usize = 1024;
pub const POPULARITY_WINDOW: u64 = 1024;
pub const POPULARITY_MIN_COUNTED: u64 = 64;
const COUNT_BITS: u32 = 24;
const COUNT_MASK: u64 = (1 << COUNT_BITS) - 1;

impl Default for KeyPopularity {
    fn default() -> Self {
        Self {
            slots: (0..POPULARITY_SLOTS).map(|_| AtomicU64::new(0)).collect(),
            counted: AtomicU64::new(0),
            seen: AtomicU64::new(0),
        }
    }
}

impl KeyPopularity {
    /// Counts one request for `key`: whether the key is hot among `instances` instances, and
    /// whether this request closed a window (every count was halved).
    pub fn record(&self, key: u64, instances: usize) -> (bool, bool) {
        let slot = &self.slots[(key % POPULARITY_SLOTS as u64) as usize];
        let tag = key >> COUNT_BITS;
        let mut count = 0;
        // The closure never returns None, so this cannot fail.
        let _ = slot.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |word| {
            let (holder, held) = (word >> COUNT_BITS, word & COUNT_MASK);
            let next = if holder == tag || held == 0 {
                count = if holder == tag { held + 1 } else { 1 };
                (tag << COUNT_BITS) | count.min(COUNT_MASK)
            } else {
                count = 0;
                word - 1
            };
            Some(next)
        });
        let counted = self.counted.fetch_add(1, Ordering::Relaxed) + 1;
        let closed =
            (self.seen.fetch_add(1, Ordering::Relaxed) + 1).is_multiple_of(POPULARITY_WINDOW);
        if closed {
            self.halve();
        }
        (Self::is_hot(count, counted, instances), closed)
    }

    /// Whether `key` is hot now, without counting it.
    pub fn peek(&self, key: u64, instances: usize) -> bool {
        let word = self.slots[(key % POPULARITY_SLOTS as u64) as usize].load(Ordering::Relaxed);
        let count = if word >> COUNT_BITS == key >> COUNT_BITS {
            word & COUNT_MASK
        } else {
            0
        };
        Self::is_hot(count, self.counted.load(Ordering::Relaxed), instances)
    }

    fn is_hot(count: u64, counted: u64, instances: usize) -> bool {
        counted >= POPULARITY_MIN_COUNTED
            && count.saturating_mul(2 * instances.max(1) as u64) >= counted
    }

    fn halve(&self) {
        for slot in self.slots.iter() {
            let _ = slot.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |word| {
                Some((word & !COUNT_MASK) | ((word & COUNT_MASK) >> 1))
            });
        }
        let _ = self
            .counted
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |counted| {
                Some(counted / 2)
            });
    }
}

impl SpillMemory {
    /// The slot of `key` (its low bits) and its tag there: the occupied bit and the key's
    /// next 31 bits.
    fn slot(key: u64) -> (usize, u64) {
        const TAG_BITS: u32 = 63 - SPILL_TICK_BITS;
        let above_slot = key / SPILL_SLOTS as u64;
        (
            (key % SPILL_SLOTS as u64) as usize,
            1 << 63 | (above_slot & ((1 << TAG_BITS) - 1)) << SPILL_TICK_BITS,
        )
    }

    fn tick(now_ms: u64) -> u64 {
        (now_ms / SPILL_TICK_MS) & SPILL_TICK_MASK
    }

    /// Whether `key` was spilled onto the instance less than [`SPILL_MEMORY_MS`] before
    /// `now_ms` ([`switchyard_process::clock::monotonic_ms`]). An entry dated after `now_ms` (another request stored it
    /// meanwhile) counts as fresh.
    pub fn remembers(&self, key: u64, now_ms: u64) -> bool {
        let (index, tag) = Self::slot(key);
        let Some(word) = self
            .slots
            .get()
            .map(|slots| slots[index].load(Ordering::Relaxed))
        else {
            return false;
        };
        let age = Self::tick(now_ms).saturating_sub(word & SPILL_TICK_MASK);
        word & !SPILL_TICK_MASK == tag && age * SPILL_TICK_MS < SPILL_MEMORY_MS
    }

    /// Records that `key` was spilled onto the instance at `now_ms` ([`switchyard_process::clock::monotonic_ms`]).
    pub fn remember(&self, key: u64, now_ms: u64) {
        let (index, tag) = Self::slot(key);
        let slots = self
            .slots
            .get_or_init(|| (0..SPILL_SLOTS).map(|_| AtomicU64::new(0)).collect());
        slots[index].store(tag | Self::tick(now_ms), Ordering::Relaxed);
    }
}

impl InstanceCell {
    pub fn fleet_load(&self) -> u32 {
        self.local
            .load(Ordering::Relaxed)
            .saturating_add(self.remote.load(Ordering::Relaxed))
    }

    pub fn count_upstream(&self, kind: UpstreamError) {
        self.upstream_errors[kind as usize].fetch_add(1, Ordering::Relaxed);
    }

    pub fn available(&self, now_ms: u64) -> bool {
        self.ejected_until_ms.load(Ordering::Relaxed) <= now_ms
    }
}

/// Every instance cell by key. Cells of instances that left membership are kept while
/// requests are still in flight on them, so the counts reported stay exact.
#[derive(Debug, Default)]
pub struct LoadRegistry {
    cells: Mutex<HashMap<InstanceKey, Arc<InstanceCell>>>,
}

impl LoadRegistry {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<InstanceKey, Arc<InstanceCell>>> {
        self.cells
            .lock()
            .unwrap_or_else(|poison| poison.into_inner())
    }

    pub fn cell(&self, key: &InstanceKey) -> Arc<InstanceCell> {
        Arc::clone(self.lock().entry(key.clone()).or_default())
    }

    /// Forgets the cells of `retired` instances (no longer members: `is_member` says) that
    /// nothing else holds (no table a request may still use, no request in flight), so every
    /// count stays reported until it ends. Keeps in `retired` the keys still held.
    pub fn prune(&self, retired: &mut Vec<InstanceKey>, is_member: impl Fn(&InstanceKey) -> bool) {
        let mut cells = self.lock();
        retired.retain(|key| {
            if is_member(key) {
                return false;
            }
            let Some(cell) = cells.get(key) else {
                return false;
            };
            if Arc::strong_count(cell) > 1 || cell.local.load(Ordering::Relaxed) > 0 {
                return true;
            }
            cells.remove(key);
            false
        });
    }

    /// Cells held, for tests and metrics.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.lock().is_empty()
    }

    /// Calls `visit` for every cell (under the registry lock: keep it short).
    pub fn for_each(&self, mut visit: impl FnMut(&InstanceKey, &InstanceCell)) {
        for (key, cell) in self.lock().iter() {
            visit(key, cell);
        }
    }
}

#[derive(Debug, Clone)]
pub struct InstanceRoute {
    pub id: InstanceId,
    /// `id` as a response header value, made once.
    pub id_header: http::HeaderValue,
    pub url: String,
    pub invocations: http::Uri,
    pub chat_completions: http::Uri,
    pub completions: http::Uri,
    /// How to reach it (unspecified: the router's --upstream-protocol).
    pub protocol: InstanceProtocol,
    /// Where it publishes KV-cache events (KV_AWARE), if it does.
    pub kv_events: Option<KvEventsEndpoints>,
    /// LMCACHE disaggregation: the decoder this prefill instance pushes its KV cache to.
    pub decode_partner: Option<InstanceId>,
    pub cell: Arc<InstanceCell>,
}

#[derive(Debug)]
pub struct VariantRoute {
    pub name: VariantName,
    /// `name` as a response header value, made once.
    pub name_header: http::HeaderValue,
    pub model_name: Option<String>,
    pub strategy: Strategy,
    /// PrefixLength (PREFIX_AWARE only).
    pub prefix_length: usize,
    pub instances: Vec<InstanceRoute>,
    pub views: Vec<InstanceView>,
    /// PREFIX_AWARE with bounded loads: how often each key came through this router lately.
    /// Shared with the tables that replace this one ([`EndpointRoute::inherit`]).
    pub popularity: Option<Arc<KeyPopularity>>,
}

impl VariantRoute {
    /// PREFIX_AWARE's ranking of `key` over `views` (this variant's, as of now): with bounded
    /// loads, it counts the key, and reads and updates what this router remembers of where it
    /// sent requests and spilled the key.
    pub fn rank_prefix(&self, views: &[InstanceView], key: u64) -> rank::Ranking {
        let load = |index: usize| self.instances[index].cell.fleet_load();
        let (
            Strategy::PrefixAware {
                balance: Some(_), ..
            },
            Some(popularity),
        ) = (self.strategy, &self.popularity)
        else {
            return rank::rank(self.strategy, views, load, key, 0);
        };
        let (hot, closed) = popularity.record(key, views.len());
        if closed {
            for instance in &self.instances {
                let recent = &instance.cell.recent;
                let _ = recent.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| Some(n / 2));
            }
        }
        let now_ms = switchyard_process::clock::monotonic_ms();
        let history = KeyHistory {
            hot,
            remembered: |index: usize| self.instances[index].cell.spills.remembers(key, now_ms),
            sent: |index: usize| self.instances[index].cell.recent.load(Ordering::Relaxed),
        };
        let ranking = rank::rank_remembering(self.strategy, views, load, key, 0, history);
        if let Some(first) = ranking.first() {
            self.instances[first]
                .cell
                .recent
                .fetch_add(1, Ordering::Relaxed);
            // Remembered only if the request can go there now: an ejected instance chosen
            // because every instance is ejected would not get it.
            if ranking.route == Some(Route::Overflow) && views[first].available {
                self.instances[first].cell.spills.remember(key, now_ms);
            }
        }
        ranking
    }

    /// Views with availability as of `now_ms`.
    pub fn current_views(&self, now_ms: u64) -> Vec<InstanceView> {
        self.views
            .iter()
            .zip(&self.instances)
            .map(|(view, instance)| InstanceView {
                available: instance.cell.available(now_ms),
                ..*view
            })
            .collect()
    }
}

impl EndpointRoute {
    /// Keeps what `previous` (the route this one replaces) learned of its keys' popularity,
    /// variant by variant (by name), so a membership or config change does not reset it.
    pub fn inherit(&mut self, previous: &EndpointRoute) {
        for variant in &mut self.variants {
            let Some(popularity) = &mut variant.popularity else {
                continue;
            };
            if let Some(old) = previous
                .variants
                .iter()
                .find(|old| old.name == variant.name)
                .and_then(|old| old.popularity.as_ref())
            {
                *popularity = Arc::clone(old);
            }
        }
    }
}

#[derive(Debug)]
pub struct EndpointRoute {
    pub name: EndpointName,
    pub variants: Vec<VariantRoute>,
    pub weights: Vec<f64>,
    /// Disaggregated prefill/decode, when the endpoint's config asks for it.
    pub disaggregation: Option<Disaggregation>,
}

/// A disaggregated endpoint's routing: its two pools and how requests cross them.
#[derive(Debug)]
pub struct Disaggregation {
    /// Variant indices.
    pub prefill: usize,
    pub decode: usize,
    /// Prompts of at least this many tokens go prefill → decode.
    pub threshold: usize,
    pub prefill_strategy: PrefillRoutingStrategy,
    pub decode_strategy: DecodeRoutingStrategy,
    pub basis: ThresholdBasis,
    pub protocol: KvTransferProtocol,
    pub tokenizer: String,
    pub prefill_timeout: std::time::Duration,
    /// LMCACHE: per prefill instance (by index), its decode partner's index in the decode
    /// variant, if that partner is routable now.
    pub partners: Vec<Option<usize>>,
    /// ROUND_ROBIN's turn (per router, per table).
    pub next_prefill: std::sync::atomic::AtomicUsize,
}

impl EndpointRoute {
    pub fn variant(&self, name: &str) -> Option<usize> {
        self.variants
            .iter()
            .position(|variant| variant.name.as_str() == name)
    }
}

#[derive(Debug, Default, Clone)]
pub struct RoutingTable {
    /// Store revision (control plane) or 1 (static config); 0: nothing loaded yet.
    pub version: u64,
    pub endpoints: HashMap<EndpointName, Arc<EndpointRoute>>,
    /// ModelName -> (endpoint, variant index), for `/v1/...` requests naming a model: the
    /// first endpoint by name with a variant of that ModelName, and its first such variant.
    pub models: HashMap<String, (EndpointName, usize)>,
}

impl RoutingTable {
    /// Resolves a `model` from a plain `/v1/...` request: an endpoint name first, then a
    /// variant's ModelName (which also selects that variant).
    pub fn resolve_model(&self, model: &str) -> Option<(Arc<EndpointRoute>, Option<usize>)> {
        if let Some(endpoint) = self.endpoints.get(model) {
            return Some((Arc::clone(endpoint), None));
        }
        let (name, variant) = self.models.get(model)?;
        let endpoint = self.endpoints.get(name)?;
        Some((Arc::clone(endpoint), Some(*variant)))
    }
}

/// Names and ids are validated ASCII, so this never falls back in practice.
fn header_value(text: &str) -> http::HeaderValue {
    http::HeaderValue::from_str(text).unwrap_or_else(|_| http::HeaderValue::from_static("invalid"))
}

fn uri(base: &str, path: &str) -> Option<http::Uri> {
    format!("{base}{path}").parse().ok()
}

impl InstanceRoute {
    /// The route of an instance of `endpoint`, with its URIs parsed once; `None` when its URL
    /// cannot make them (logged).
    pub fn prepare(instance: &Instance, registry: &LoadRegistry) -> Option<InstanceRoute> {
        let (Some(invocations), Some(chat_completions), Some(completions)) = (
            uri(&instance.url, "/invocations"),
            uri(&instance.url, "/v1/chat/completions"),
            uri(&instance.url, "/v1/completions"),
        ) else {
            tracing::warn!(instance = %instance.instance_id, url = %instance.url, "skipping instance with an unusable URL");
            return None;
        };
        Some(InstanceRoute {
            id_header: header_value(instance.instance_id.as_str()),
            id: instance.instance_id.clone(),
            url: instance.url.clone(),
            invocations,
            chat_completions,
            completions,
            protocol: instance.protocol,
            kv_events: instance.kv_events.clone(),
            decode_partner: instance.decode_partner.clone(),
            cell: registry.cell(&InstanceKey::of(instance)),
        })
    }
}

impl InstanceRoute {
    /// The instance's URL for `path_and_query` (a path of the operations without a prepared
    /// URI); `None` if it does not make one.
    pub fn uri_for(&self, path_and_query: &str) -> Option<http::Uri> {
        uri(&self.url, path_and_query)
    }
}

/// The route of one endpoint: for each variant of `config`, its routable `members` (healthy
/// or not probed yet) in the order given.
pub fn endpoint_route<'a>(
    name: &EndpointName,
    config: &EndpointConfig,
    members: impl Iterator<Item = (&'a Instance, &'a InstanceRoute)> + Clone,
) -> EndpointRoute {
    let mut variants = Vec::with_capacity(config.production_variants.len());
    for variant in &config.production_variants {
        let routing = variant.routing();
        let (strategy, prefix_length) = match routing.routing_strategy {
            RoutingStrategy::Random => (Strategy::Random, 0),
            RoutingStrategy::LeastOutstandingRequests => (Strategy::LeastOutstandingRequests, 0),
            RoutingStrategy::PrefixAware => {
                // validate() requires the config; the article's example stands in otherwise.
                let prefix = routing.prefix_aware_routing_config.unwrap_or(
                    switchyard_shared::PrefixAwareRoutingConfig::sagemaker(4096, 10),
                );
                (
                    Strategy::PrefixAware {
                        concurrency_threshold: prefix.concurrency_threshold,
                        balance: prefix
                            .load_balance()
                            .map(|(factor, slack)| LoadBalance { factor, slack }),
                    },
                    prefix.prefix_length as usize,
                )
            }
            RoutingStrategy::KvAware => {
                let knobs = routing.kv_aware_routing_config.unwrap_or_default();
                (
                    Strategy::KvAware {
                        concurrency_threshold: knobs.concurrency_threshold(),
                        load_weight: knobs.load_weight(),
                    },
                    0,
                )
            }
        };
        let mut routes = Vec::new();
        let mut views = Vec::new();
        for (instance, route) in members.clone().filter(|(instance, _)| {
            instance.health.routable() && instance.variant_name == variant.variant_name
        }) {
            views.push(InstanceView {
                id_hash: instance_hash(instance.instance_id.as_str()),
                weight: instance.weight,
                available: true,
            });
            routes.push(route.clone());
        }
        variants.push(VariantRoute {
            name_header: header_value(variant.variant_name.as_str()),
            name: variant.variant_name.clone(),
            model_name: variant.model_name.clone(),
            strategy,
            prefix_length,
            instances: routes,
            views,
            popularity: matches!(
                strategy,
                Strategy::PrefixAware {
                    balance: Some(_),
                    ..
                }
            )
            .then(Arc::default),
        });
    }
    let disaggregation = config
        .disaggregation_config
        .as_ref()
        .and_then(|pd| disaggregation(pd, &variants));
    EndpointRoute {
        name: name.clone(),
        variants,
        weights: config
            .production_variants
            .iter()
            .map(|variant| variant.weight())
            .collect(),
        disaggregation,
    }
}

fn disaggregation(
    config: &switchyard_shared::DisaggregationConfig,
    variants: &[VariantRoute],
) -> Option<Disaggregation> {
    let index = |name: &VariantName| variants.iter().position(|variant| variant.name == *name);
    let (prefill, decode) = (
        index(&config.prefill_variant_name)?,
        index(&config.decode_variant_name)?,
    );
    let partners = variants[prefill]
        .instances
        .iter()
        .map(|instance| {
            let partner = instance.decode_partner.as_ref()?;
            variants[decode]
                .instances
                .iter()
                .position(|decoder| decoder.id == *partner)
        })
        .collect();
    Some(Disaggregation {
        prefill,
        decode,
        threshold: config.route_threshold() as usize,
        prefill_strategy: config.prefill_routing_strategy(),
        decode_strategy: config.decode_routing_strategy(),
        basis: config.threshold_basis(),
        protocol: config.kv_transfer_protocol(),
        tokenizer: config.tokenizer().to_owned(),
        prefill_timeout: std::time::Duration::from_secs(u64::from(
            config.prefill_timeout_seconds(),
        )),
        partners,
        next_prefill: std::sync::atomic::AtomicUsize::new(0),
    })
}

/// The ModelNames an endpoint route answers to, each with its first variant of that name.
pub fn route_models(route: &EndpointRoute) -> Vec<(String, usize)> {
    let mut models: Vec<(String, usize)> = Vec::new();
    for (index, variant) in route.variants.iter().enumerate() {
        if let Some(model) = &variant.model_name
            && !models.iter().any(|(known, _)| known == model)
        {
            models.push((model.clone(), index));
        }
    }
    models
}

/// A whole table at once, for tests and tools (the router itself builds its table
/// incrementally in `membership`): every instance's route prepared, every endpoint built.
pub fn build(
    version: u64,
    endpoints: &[(EndpointName, EndpointConfig)],
    instances: &[Instance],
    registry: &LoadRegistry,
) -> RoutingTable {
    let routes: Vec<(&Instance, InstanceRoute)> = instances
        .iter()
        .filter_map(|instance| {
            InstanceRoute::prepare(instance, registry).map(|route| (instance, route))
        })
        .collect();
    let mut table = RoutingTable {
        version,
        ..RoutingTable::default()
    };
    for (name, config) in endpoints {
        let members = routes
            .iter()
            .filter(|(instance, _)| instance.endpoint_name == *name)
            .map(|(instance, route)| (*instance, route));
        let route = Arc::new(endpoint_route(name, config, members));
        for (model, index) in route_models(&route) {
            table
                .models
                .entry(model)
                .or_insert_with(|| (name.clone(), index));
        }
        table.endpoints.insert(name.clone(), route);
    }
    table
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_with_a_large_share_of_recent_requests_is_hot() {
        let popularity = KeyPopularity::default();
        let instances = 7;
        // Key 1 carries 30% of the requests, key 2 8%, key 3 58%, and 4% are keys seen once.
        // Hot means at least 1 / 14 (7.1%).
        let mut hot = [0u32; 4];
        let mut windows = 0;
        for request in 0..5000u64 {
            let (class, key) = match request % 100 {
                0..=29 => (1, 1u64 << 40 | 1),
                30..=37 => (2, 2u64 << 40 | 2),
                38..=41 => (0, 1000 + request),
                _ => (3, 3u64 << 40 | 3),
            };
            let (is_hot, closed) = popularity.record(key, instances);
            windows += u32::from(closed);
            if request >= 2000 {
                hot[class] += u32::from(is_hot);
            }
        }
        // Of the last 3000 requests, every one of keys 1, 2 and 3 was hot; no rare one.
        assert_eq!(hot, [0, 900, 240, 1740]);
        assert_eq!(windows as u64, 5000 / POPULARITY_WINDOW);
        assert!(popularity.peek(1u64 << 40 | 1, instances));
        // A rare key never is, and 8% is not hot among 4 instances (at least 12.5%).
        assert!(!popularity.peek(1000 + 4999, instances));
        assert!(!popularity.peek(2u64 << 40 | 2, 4));
        // Nothing is hot before enough requests were counted.
        let fresh = KeyPopularity::default();
        for _ in 0..POPULARITY_MIN_COUNTED - 1 {
            assert!(!fresh.record(5, instances).0);
        }
        assert!(fresh.record(5, instances).0);
        // A key that stops coming cools down within a few windows.
        for request in 0..8 * POPULARITY_WINDOW {
            popularity.record(10_000 + request, instances);
        }
        assert!(!popularity.peek(1u64 << 40 | 1, instances));
    }

    #[test]
    fn route_labels_and_upstream_error_kinds_are_the_documented_values() {
        // x-switchyard-route and the `route` label (README.md), the `kind` label of
        // switchyard_router_upstream_errors_total (docs/failure-behaviour.md).
        let routes: Vec<&str> = RouteLabel::ALL.iter().map(|label| label.as_str()).collect();
        assert_eq!(
            routes,
            [
                "prefix",
                "overflow",
                "random",
                "least-outstanding",
                "session",
                "kv",
                "direct",
                "disaggregated",
                "fallback",
                "response",
                "retry",
                "retry-after-send"
            ]
        );
        for route in Route::ALL {
            assert_eq!(RouteLabel::from(route).as_str(), route.as_str());
        }
        let kinds: Vec<&str> = UpstreamError::ALL
            .iter()
            .map(|kind| kind.as_str())
            .collect();
        assert_eq!(kinds, ["refused", "reset", "timeout", "stream_idle"]);
    }
}
