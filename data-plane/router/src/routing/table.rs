//! The routing table: an immutable snapshot of endpoints, variants and routable instances,
//! swapped in atomically whenever membership changes (no request ever sees half a change).
//! `membership` builds it incrementally: an instance's route (its URIs parsed) is made once
//! when the instance arrives, and a change rebuilds only the endpoints it touches; the new
//! table shares every other endpoint with the old one.
//!
//! Load lives outside the snapshot, in one `InstanceCell` per (endpoint, instance) that
//! survives table swaps, so in-flight counts stay exact across membership and config changes.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use crate::routing::cells::{
    InstanceCell, LoadRegistry, Remembered, SendWindow, age_further, mark_further,
    saturating_increment,
};
use switchyard_policy::rank::{self, InstanceView, KeyHistory, LoadBalance, Strategy};
use switchyard_shared::{
    DecodeRoutingStrategy, EndpointConfig, EndpointName, Instance, InstanceId, InstanceKey,
    InstanceProtocol, KvEventsEndpoints, KvTransferProtocol, PrefillRoutingStrategy,
    RoutingStrategy, ThresholdBasis, VariantName,
};

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
    /// A data-parallel engine: the KV index's name of each rank's events (`ID#dpR`, by rank;
    /// empty otherwise, when the index knows the instance by its id).
    pub data_parallel_ranks: Arc<[InstanceId]>,
    /// Those ranks as the KV formula sees them (`policy::kv::rank_kv` picks among them).
    pub data_parallel_views: Arc<[InstanceView]>,
    /// LMCACHE disaggregation: the decoder this prefill instance pushes its KV cache to.
    pub decode_partner: Option<InstanceId>,
    /// LMCACHE_PD: this decode instance's LMCache receiver, named in each `disagg_spec`.
    pub lmcache_receiver: Option<Arc<switchyard_shared::LmcacheReceiver>>,
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
    /// PREFIX_AWARE with bounded loads: the variant's requests through this router, in
    /// windows. Shared with the tables that replace this one ([`EndpointRoute::inherit`]).
    pub window: Option<Arc<SendWindow>>,
    /// MaxInFlightPerInstance: fleet-wide requests in flight per instance before requests
    /// wait in the router's queue (None: no cap, no queue).
    pub max_in_flight_per_instance: Option<u32>,
    /// FlowHeadroomPerInstance: slots past the cap for requests that need not wait (0: none).
    pub flow_headroom_per_instance: u32,
    /// FairnessWeights, by fairness key (`switchyard_policy::hash::fairness_key`); ids not
    /// named weigh 1.
    pub fairness_weights: Arc<HashMap<u64, f64>>,
    /// MigrationLimit: how many times a streamed answer may continue on another instance.
    pub migration_limit: u32,
    /// LoraAdapters: the adapter names a request's `model` may name (kept upstream).
    pub lora_adapters: Arc<[String]>,
    /// KvAwareRoutingConfig.Tokenizer: the folder under `--tokenizer-dir` whose tokenizer and
    /// chat template give this variant's token ids in the router.
    pub tokenizer: Option<Arc<str>>,
}

impl VariantRoute {
    /// `model` if it names one of the variant's LoRA adapters.
    pub fn adapter<'m>(&self, model: Option<&'m str>) -> Option<&'m str> {
        model.filter(|model| self.lora_adapters.iter().any(|name| name == model))
    }

    /// A RANDOM variant without instances (unit tests).
    #[cfg(test)]
    pub(crate) fn bare(name: &str, model_name: Option<&str>, lora_adapters: &[&str]) -> Self {
        VariantRoute {
            name: VariantName::new(name).expect("a variant name"),
            name_header: header_value(name),
            model_name: model_name.map(str::to_owned),
            strategy: Strategy::Random,
            prefix_length: 0,
            instances: Vec::new(),
            views: Vec::new(),
            window: None,
            max_in_flight_per_instance: None,
            flow_headroom_per_instance: 0,
            fairness_weights: Default::default(),
            migration_limit: 0,
            lora_adapters: lora_adapters
                .iter()
                .map(|name| (*name).to_owned())
                .collect(),
            tokenizer: None,
        }
    }

    /// PREFIX_AWARE's ranking of `key` over `views` (this variant's, as of now): with bounded
    /// loads, it reads and updates what this router knows of where the key and the variant's
    /// requests went lately, and queues a new placement for the other routers.
    pub fn rank_prefix(&self, views: &[InstanceView], key: u64) -> rank::Ranking {
        let load = |index: usize| self.instances[index].cell.fleet_load();
        let (
            Strategy::PrefixAware {
                balance: Some(_), ..
            },
            Some(window),
        ) = (self.strategy, &self.window)
        else {
            return rank::rank(self.strategy, views, load, key, 0);
        };
        if window.record() {
            let halve = |count: &AtomicU32| {
                let _ = count.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| Some(n / 2));
            };
            for instance in &self.instances {
                halve(&instance.cell.recent);
                halve(&instance.cell.copies);
                age_further(&instance.cell.further);
            }
        }
        let now_ms = switchyard_process::clock::monotonic_ms();
        let history = self.key_history(key, now_ms);
        let ranking = rank::rank_remembering(self.strategy, views, load, key, 0, history);
        if let Some(first) = ranking.first() {
            let cell = &self.instances[first].cell;
            cell.recent.fetch_add(1, Ordering::Relaxed);
            // Remembered only if the request can go there now: an ejected instance chosen
            // because every instance is ejected would not get it. A placement that neither
            // this router nor (as announced) another made lately is a new copy; it is
            // announced to the others, and again once a minute while the key keeps coming
            // here, so that their memory of it does not run out while this router's is kept.
            if views[first].available {
                let before = cell.spills.remember(key, now_ms);
                // A further copy: another instance of the variant held the key (a hot key
                // spread, or relieved); announced as such.
                let mut further = false;
                if before == Remembered::New {
                    saturating_increment(&cell.copies);
                    further = (0..self.instances.len()).any(|index| {
                        index != first && self.instances[index].cell.spills.remembers(key, now_ms)
                    });
                    if further {
                        mark_further(&cell.further);
                    }
                }
                if before != Remembered::Fresh && !cell.announced.push(key, further) {
                    tracing::debug!("too many placements waiting to be announced; one dropped");
                }
            }
        }
        ranking
    }

    /// What this router knows of where `key` and the variant's requests went lately, as
    /// bounded PREFIX_AWARE reads it (`now_ms`: [`switchyard_process::clock::monotonic_ms`]).
    pub fn key_history(
        &self,
        key: u64,
        now_ms: u64,
    ) -> KeyHistory<
        impl Fn(usize) -> bool + '_,
        impl Fn(usize) -> u32 + '_,
        impl Fn(usize) -> u32 + '_,
    > {
        KeyHistory {
            remembered: move |index: usize| {
                self.instances[index].cell.spills.remembers(key, now_ms)
            },
            sent: |index: usize| self.instances[index].cell.recent.load(Ordering::Relaxed),
            copies: |index: usize| self.instances[index].cell.copies.load(Ordering::Relaxed),
            further_lately: self
                .instances
                .iter()
                .any(|instance| instance.cell.further.load(Ordering::Relaxed) > 0),
        }
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
    /// Keeps the request windows of `previous` (the route this one replaces), variant by
    /// variant (by name), so a membership or config change does not restart them.
    pub fn inherit(&mut self, previous: &EndpointRoute) {
        for variant in &mut self.variants {
            let Some(window) = &mut variant.window else {
                continue;
            };
            if let Some(old) = previous
                .variants
                .iter()
                .find(|old| old.name == variant.name)
                .and_then(|old| old.window.as_ref())
            {
                *window = Arc::clone(old);
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
        let ranks: Arc<[InstanceId]> = match &instance.kv_events {
            Some(kv) if kv.data_parallel_size > 1 => (0..kv.data_parallel_size)
                .map(|rank| instance.instance_id.data_parallel_rank(rank))
                .collect(),
            _ => Arc::from([]),
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
            data_parallel_ranks: ranks.clone(),
            data_parallel_views: ranks
                .iter()
                .map(|rank| InstanceView::new(rank.as_str(), 1.0))
                .collect(),
            decode_partner: instance.decode_partner.clone(),
            lmcache_receiver: instance.lmcache_receiver.clone().map(Arc::new),
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
                let knobs = routing.kv_aware_routing_config.clone().unwrap_or_default();
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
            views.push(InstanceView::new(
                instance.instance_id.as_str(),
                instance.weight,
            ));
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
            window: matches!(
                strategy,
                Strategy::PrefixAware {
                    balance: Some(_),
                    ..
                }
            )
            .then(Arc::default),
            max_in_flight_per_instance: variant.max_in_flight_per_instance,
            flow_headroom_per_instance: variant.flow_headroom_per_instance.unwrap_or(0),
            fairness_weights: Arc::new(
                variant
                    .fairness_weights
                    .iter()
                    .flatten()
                    .map(|(id, weight)| {
                        (
                            switchyard_policy::hash::fairness_key(id.as_bytes()),
                            *weight,
                        )
                    })
                    .collect(),
            ),
            migration_limit: variant.migration_limit(),
            lora_adapters: variant.lora_adapters().into(),
            tokenizer: routing
                .kv_aware_routing_config
                .as_ref()
                .and_then(|kv| kv.tokenizer.as_deref())
                .map(Arc::from),
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

/// The ModelNames and LoRA adapter names an endpoint route answers to, each with its first
/// variant of that name (ModelNames first).
pub fn route_models(route: &EndpointRoute) -> Vec<(String, usize)> {
    let mut models: Vec<(String, usize)> = Vec::new();
    let names =
        |variant: &VariantRoute| -> Vec<String> { variant.model_name.iter().cloned().collect() };
    let adapters = |variant: &VariantRoute| variant.lora_adapters.to_vec();
    for names_of in [&names as &dyn Fn(&VariantRoute) -> Vec<String>, &adapters] {
        for (index, variant) in route.variants.iter().enumerate() {
            for model in names_of(variant) {
                if !models.iter().any(|(known, _)| *known == model) {
                    models.push((model, index));
                }
            }
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
