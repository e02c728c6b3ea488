//! The plan phase: CPU only, no sockets. From the operation, the headers and the body, where
//! the request goes (`target`: endpoint, variant, or the holder of a stored response), in what
//! order the instances are tried (`rank`), a disaggregated endpoint's decision (`disaggregation`,
//! counting the prompt with `count`), and the body the engine gets (`engine_body`). The result is
//! ready to forward, or says that it needs the prompt's token ids ([`Planned::NeedsTokens`]:
//! KV_AWARE, a KV_AWARE prefill pool, UNCACHED_TOKENS), which the settle phase gets and hands
//! back to `kv::finish` or `disaggregation::finish` here. Forwarding the plan is `forward`'s job.

pub(crate) mod count;
pub(crate) mod disaggregation;
pub(crate) mod engine_body;
pub(crate) mod flow;
pub(crate) mod kv;
pub(crate) mod lmcache;
mod planned;
mod rank;
mod target;
pub(crate) mod tokens;

use std::sync::Arc;

use bytes::Bytes;
use http::header::HeaderMap;
use switchyard_kv::VariantIndex;
use switchyard_policy::rank::{Route, Strategy};
use switchyard_shared::{PrefillRoutingStrategy, ThresholdBasis};

use crate::errors::ApiError;
use crate::observe::labels::RouteLabel;
use crate::operation::Operation;
use crate::routing::table::{EndpointRoute, RoutingTable};
use count::TokenCounters;
pub use planned::{Plan, PrefillHop};
use target::Destination;
use tokens::{KvInput, RequestChain};

/// What planning made of a request.
#[derive(Debug)]
pub enum Planned {
    /// Ready to forward.
    Ready(Plan),
    /// Its ranking or its decision waits for the prompt's token ids, had by `input`.
    NeedsTokens { needs: NeedsTokens, input: KvInput },
}

impl Planned {
    /// The plan as it stands (the one forwarded if token ids cannot be had).
    pub fn plan(&self) -> &Plan {
        match self {
            Planned::Ready(plan) => plan,
            Planned::NeedsTokens { needs, .. } => &needs.plan,
        }
    }
}

/// A plan that needs the prompt's token ids to be finished: for a KV_AWARE variant (without a
/// session) to rank it by its KV index; on a disaggregated endpoint to rank a KV_AWARE prefill
/// pool by its index, or to make the decision itself (ThresholdBasis UNCACHED_TOKENS). The
/// settle phase gets the ids (one `/tokenize` round trip at most, asked of [`Self::tokenizer`])
/// and calls [`Self::finish`].
#[derive(Debug)]
pub struct NeedsTokens {
    /// The plan as it stands without the ids: ranked by load; on a disaggregated endpoint
    /// decided as far as the router's own count allows (`direct` while UNCACHED_TOKENS waits).
    /// It is what is forwarded when no KV index has data yet.
    pub plan: Plan,
    purpose: Purpose,
    /// The LoRA adapter and `cache_salt` the request's chain is hashed under
    /// (`VariantIndex::match_prompt`).
    chain: RequestChain,
}

#[derive(Debug)]
enum Purpose {
    /// KV_AWARE: rank the variant by its KV index ([`kv::finish`]).
    Kv,
    /// A disaggregated endpoint ([`disaggregation::finish`]).
    Disaggregation(disaggregation::Pending),
}

/// What [`NeedsTokens::into_kv`] found.
#[derive(Debug)]
pub enum KvOrNot {
    /// A KV_AWARE plan, its variant's index and the request's adapter and `cache_salt`.
    Kv(Plan, Arc<VariantIndex>, RequestChain),
    /// Any other.
    Not(NeedsTokens),
}

/// The KV indexes finishing a plan reads (None: not read, or no engine of the pool has
/// published yet).
#[derive(Debug, Default)]
pub struct Indexes {
    /// KV_AWARE: the plan's variant's.
    pub kv: Option<Arc<VariantIndex>>,
    /// UNCACHED_TOKENS: the decode pool's.
    pub decode: Option<Arc<VariantIndex>>,
    /// KV_AWARE prefill: the prefill pool's.
    pub prefill: Option<Arc<VariantIndex>>,
    /// LMCACHE_PD: the hops are made of the token ids, index or not.
    pub token_ids: bool,
}

impl Indexes {
    fn none(&self) -> bool {
        self.kv.is_none() && self.decode.is_none() && self.prefill.is_none() && !self.token_ids
    }
}

impl NeedsTokens {
    /// The variant whose engines are asked to tokenize: the plan's (a disaggregated endpoint's
    /// decoders; the body names their ModelName), as its endpoint and position (a check may
    /// outlive the request).
    pub fn tokenizer(&self) -> (&Arc<EndpointRoute>, usize) {
        (&self.plan.endpoint, self.plan.variant_index)
    }

    /// The tokenizer folder that gives the token ids in the router: the plan's variant's
    /// KvAwareRoutingConfig.Tokenizer, else on a disaggregated endpoint its prefill variant's
    /// (the two pools serve one model); None: the engine is asked.
    pub fn local_tokenizer(&self) -> Option<&Arc<str>> {
        let endpoint = &self.plan.endpoint;
        self.plan.variant().tokenizer.as_ref().or_else(|| {
            let pd = endpoint.disaggregation.as_ref()?;
            endpoint.variants.get(pd.prefill)?.tokenizer.as_ref()
        })
    }

    /// The KV indexes finishing reads, from `index_of(variant position)` (which answers only
    /// for a variant whose engines have published): for KV_AWARE the plan's variant; on a
    /// disaggregated endpoint the decode pool's for UNCACHED_TOKENS and the prefill pool's
    /// for a KV_AWARE prefill that is or may be used.
    pub fn indexes(&self, index_of: impl Fn(usize) -> Option<Arc<VariantIndex>>) -> Indexes {
        match &self.purpose {
            Purpose::Kv => Indexes {
                kv: index_of(self.plan.variant_index),
                ..Indexes::default()
            },
            Purpose::Disaggregation(pending) => {
                let Some(pd) = self.plan.endpoint.disaggregation.as_ref() else {
                    return Indexes::default();
                };
                let prefill_used = pending.undecided.is_some() || self.plan.prefill_hop.is_some();
                Indexes {
                    kv: None,
                    decode: (pd.basis == ThresholdBasis::UncachedTokens)
                        .then(|| index_of(pd.decode))
                        .flatten(),
                    prefill: (pd.prefill_strategy == PrefillRoutingStrategy::KvAware
                        && prefill_used)
                        .then(|| index_of(pd.prefill))
                        .flatten(),
                    token_ids: pending.token_ids && prefill_used,
                }
            }
        }
    }

    /// Whether the ids are worth asking for: some index to read has data. Without one the
    /// plan is finished with none (see [`Self::finish`]).
    pub fn worth_asking(indexes: &Indexes) -> bool {
        !indexes.none()
    }

    /// Whether finishing is CPU work for a blocking thread: a prompt beyond
    /// [`kv::OFFLOAD_TOKENS`] (the walk over the index), or an UNCACHED_TOKENS decision (it
    /// may make the prefill copy, a parse of the body).
    pub fn heavy(&self, tokens: Option<&[u32]>) -> bool {
        let undecided = matches!(&self.purpose, Purpose::Disaggregation(pending) if pending.undecided.is_some());
        undecided || tokens.is_some_and(|tokens| tokens.len() > kv::OFFLOAD_TOKENS)
    }

    /// A KV_AWARE plan with its variant's index (of [`Self::indexes`]), to rank by
    /// [`kv::decide`] off the serving thread while the plan stays where it is; any other as it
    /// is.
    pub fn into_kv(self, indexes: &Indexes) -> KvOrNot {
        match (&self.purpose, &indexes.kv) {
            (Purpose::Kv, Some(index)) => KvOrNot::Kv(self.plan, Arc::clone(index), self.chain),
            _ => KvOrNot::Not(self),
        }
    }

    /// The plan, finished with the prompt's `tokens` (None: they could not be had) and the
    /// `indexes` of [`Self::indexes`]. CPU only. With no index, a KV_AWARE plan stays as it
    /// is (ranked by load); a disaggregated one is decided without ids (UNCACHED_TOKENS counts
    /// every prompt token as uncached; the prefill pool stays ranked by load).
    pub fn finish(
        self,
        tokens: Option<&[u32]>,
        indexes: &Indexes,
        now_ms: u64,
        random: u64,
    ) -> Plan {
        let chain = self.chain.key();
        match self.purpose {
            Purpose::Kv => match &indexes.kv {
                Some(index) => kv::finish(self.plan, index, tokens, chain, now_ms, random),
                None => self.plan,
            },
            Purpose::Disaggregation(pending) => {
                let pools = disaggregation::PoolIndexes {
                    decode: indexes.decode.as_deref(),
                    prefill: indexes.prefill.as_deref(),
                };
                disaggregation::finish(self.plan, pending, tokens, chain, pools, now_ms, random)
            }
        }
    }
}

/// What a request's plan is made from, besides its body.
#[derive(Debug, Clone, Copy)]
pub struct Request<'a> {
    pub table: &'a RoutingTable,
    pub operation: Operation,
    /// The path's endpoint (`None` on the plain `/v1/...` paths, where the body's `model`, or
    /// a response id, names it).
    pub endpoint: Option<&'a Arc<EndpointRoute>>,
    /// The request's URI (the response id of `/v1/responses/{id}`, and its query).
    pub uri: &'a http::Uri,
    pub headers: &'a HeaderMap,
}

/// Plans `request` with `body`: where it goes, ranked, the body the engine gets, and what it
/// still needs. `counters` count a disaggregated endpoint's prompts; `rng` draws the variant
/// (by weight) and breaks load ties.
pub fn plan(
    request: Request<'_>,
    body: Bytes,
    counters: &TokenCounters,
    rng: &mut fastrand::Rng,
) -> Result<Planned, ApiError> {
    let operation = request.operation;
    let target = target::resolve(
        request.table,
        operation,
        request.endpoint.cloned(),
        request.uri,
        request.headers,
        &body,
        rng,
    )?;
    let endpoint = Arc::clone(&target.endpoint);
    // Who serves it, in what order (a disaggregated endpoint's decoders).
    let (variant_index, ranking, routing_key) = rank::serving(&target, operation, &body, rng)?;
    // A disaggregated endpoint's decision: direct, disaggregated, fallback, or undecided.
    let split = match target.destination {
        Destination::Disaggregated => {
            disaggregation::split(&target, operation, &body, counters, rng)
        }
        _ => None,
    };
    let variant = &endpoint.variants[variant_index];
    let flow = flow::FlowKey::read(request.headers, target.openai.as_ref())?;
    let pinned = match target.destination {
        Destination::Stored { .. } | Destination::FollowUp { .. } => true,
        Destination::Variant(_) => target.routing.session.is_some(),
        Destination::Disaggregated => false,
    };
    let (engine_body, path) = match &target.destination {
        // Stored responses: the engine's id in the path, the body as it came (none but on
        // POST).
        Destination::Stored { path, .. } => {
            let body = match operation.method() {
                http::Method::POST => body.clone(),
                _ => Bytes::new(),
            };
            (body, Some(path.clone()))
        }
        destination => {
            let previous_id = match destination {
                Destination::FollowUp { engine_id, .. } => Some(engine_id.as_str()),
                _ => None,
            };
            let body = engine_body::for_engine(
                body.clone(),
                target.openai.as_ref(),
                variant,
                previous_id,
                endpoint.disaggregation.is_some(),
            );
            (body, operation.fixed_path().map(str::to_owned))
        }
    };
    // KV_AWARE without a session (and not pinned to a response's holder) ranks by the KV
    // index once it has the prompt's token ids.
    let kv_aware = matches!(target.destination, Destination::Variant(_))
        && target.routing.session.is_none()
        && matches!(variant.strategy, Strategy::KvAware { .. });
    // What settling needs to get the prompt's ids, read from the fields planning parsed for
    // routing (a native body is parsed for it below).
    let needs_tokens = match &split {
        Some(split) => split.pending.is_some(),
        None => kv_aware,
    };
    let kv_input = target
        .openai
        .as_ref()
        .filter(|_| needs_tokens)
        .map(|request| KvInput::of_openai(operation, request, &engine_body, variant));
    // The client's body is let go before the prefill copy is made (a rewritten body is a
    // copy: the two need not be held at once).
    drop(target);
    drop(body);
    let mut plan = Plan {
        label: RouteLabel::from(ranking.route.unwrap_or(Route::Random)),
        endpoint,
        variant_index,
        ranking,
        body: engine_body,
        path,
        explain: Vec::new(),
        prefill_hop: None,
        cached_tokens: Vec::new(),
        data_parallel_ranks: Vec::new(),
        routing_key,
        flow,
        pinned,
    };
    let purpose = match split {
        Some(split) => {
            plan.label = split.label;
            plan.explain = split.explain;
            plan.prefill_hop = split.prefill_hop.map(|mut disaggregated| {
                if let Some(pd) = &plan.endpoint.disaggregation {
                    let prefill = &plan.endpoint.variants[pd.prefill];
                    disaggregated.prefill_body =
                        engine_body::prefill_body(&plan.body, pd.protocol, prefill);
                }
                disaggregated
            });
            split.pending.map(Purpose::Disaggregation)
        }
        None if kv_aware => Some(Purpose::Kv),
        None => None,
    };
    Ok(match purpose {
        None => Planned::Ready(plan),
        Some(purpose) => {
            let (input, chain) =
                kv_input.unwrap_or_else(|| KvInput::of(operation, &plan.body, plan.variant()));
            Planned::NeedsTokens {
                input,
                needs: NeedsTokens {
                    plan,
                    purpose,
                    chain,
                },
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::headers::{PREFIX_AWARE_ID, SESSION_ID, TARGET_VARIANT};
    use crate::respond::response_ids;
    use crate::routing::membership::static_table;
    use switchyard_policy::rank;
    use tokens::PromptTokens;

    /// What planning makes of `body` on `operation`, with fresh token counters and the
    /// random choices seeded with `seed`.
    fn planned(
        table: &RoutingTable,
        operation: Operation,
        endpoint: Option<Arc<EndpointRoute>>,
        uri: &http::Uri,
        headers: &HeaderMap,
        body: Bytes,
        seed: u64,
    ) -> Result<Planned, ApiError> {
        let request = Request {
            table,
            operation,
            endpoint: endpoint.as_ref(),
            uri,
            headers,
        };
        let counters = TokenCounters::new(None);
        plan(
            request,
            body,
            &counters,
            &mut fastrand::Rng::with_seed(seed),
        )
    }

    /// The plan as it stands, also when it needs token ids.
    fn as_it_stands(planned: Planned) -> Plan {
        match planned {
            Planned::Ready(plan) => plan,
            Planned::NeedsTokens { needs, .. } => needs.plan,
        }
    }

    /// The plan (as it stands) of `body` sent to `/` on `operation`.
    fn make_plan(
        table: &RoutingTable,
        operation: Operation,
        endpoint: Option<Arc<EndpointRoute>>,
        headers: &HeaderMap,
        body: Bytes,
        seed: u64,
    ) -> Result<Plan, ApiError> {
        let uri = http::Uri::from_static("/");
        planned(table, operation, endpoint, &uri, headers, body, seed).map(as_it_stands)
    }

    fn needs_tokens(planned: Planned) -> (NeedsTokens, KvInput) {
        match planned {
            Planned::NeedsTokens { needs, input } => (needs, input),
            Planned::Ready(plan) => panic!("expected the token ids to be wanted: {plan:?}"),
        }
    }

    fn pending(needs: &NeedsTokens) -> &disaggregation::Pending {
        match &needs.purpose {
            Purpose::Disaggregation(pending) => pending,
            Purpose::Kv => panic!("expected a disaggregated plan"),
        }
    }

    /// Endpoint `chat`: variant `a` (PREFIX_AWARE, PrefixLength 1024, threshold 2, ModelName
    /// `m-a`, 3 instances), variant `b` (RANDOM, ModelName `m-b`, LoRA adapter `sql`, 1
    /// instance) and variant `k`
    /// (KV_AWARE, ModelName `m-k`, 2 instances), `b` and `k` with weight 0.
    fn table() -> RoutingTable {
        let yaml = r#"
Endpoints:
  - EndpointName: chat
    ProductionVariants:
      - VariantName: a
        ModelName: m-a
        RoutingConfig:
          RoutingStrategy: PREFIX_AWARE
          PrefixAwareRoutingConfig: {PrefixLength: 1024, ConcurrencyThreshold: 2}
      - VariantName: b
        ModelName: m-b
        InitialVariantWeight: 0
        LoraAdapters: [sql]
      - VariantName: k
        ModelName: m-k
        InitialVariantWeight: 0
        RoutingConfig: {RoutingStrategy: KV_AWARE}
    Instances:
      - {Url: "http://127.0.0.1:1", InstanceId: a1, VariantName: a}
      - {Url: "http://127.0.0.1:2", InstanceId: a2, VariantName: a}
      - {Url: "http://127.0.0.1:3", InstanceId: a3, VariantName: a}
      - {Url: "http://127.0.0.1:4", InstanceId: b1, VariantName: b}
      - {Url: "http://127.0.0.1:5", InstanceId: k1, VariantName: k}
      - {Url: "http://127.0.0.1:6", InstanceId: k2, VariantName: k}
"#;
        static_table(yaml)
    }

    fn chat(table: &RoutingTable) -> Option<Arc<EndpointRoute>> {
        table.endpoints.get("chat").cloned()
    }

    fn chat_body(model: &str, text: &str) -> Bytes {
        Bytes::from(
            serde_json::json!({"model": model, "messages": [{"role": "user", "content": text}]})
                .to_string(),
        )
    }

    fn first_choice(plan: &Plan) -> &str {
        plan.variant().instances[plan.ranking.order[0]].id.as_str()
    }

    #[test]
    fn same_prefix_different_suffix_same_instance_and_the_suffix_is_ignored() {
        let table = table();
        let prefix = "p".repeat(1024);
        let plan = |prompt: &str| {
            make_plan(
                &table,
                Operation::ChatCompletions,
                chat(&table),
                &HeaderMap::new(),
                chat_body("m-a", prompt),
                7,
            )
            .unwrap()
        };
        let first = plan(&format!("{prefix}one ending"));
        let second = plan(&format!("{prefix}a different, longer ending"));
        assert_eq!(first.ranking.route, Some(Route::Prefix));
        assert_eq!(first.ranking.order, second.ranking.order);
        // A different prefix is ranked on its own hash: over a few, not all land alike.
        let orders: std::collections::HashSet<Vec<usize>> = (0..8)
            .map(|index| plan(&format!("{index}{prefix}")).ranking.order)
            .collect();
        assert!(orders.len() > 1, "every prefix ranked alike: {orders:?}");
    }

    #[test]
    fn a_plain_v1_model_picks_endpoint_variant_and_model_name() {
        let table = table();
        let plan_for = |model: &str| {
            make_plan(
                &table,
                Operation::ChatCompletions,
                None,
                &HeaderMap::new(),
                chat_body(model, "hello"),
                1,
            )
            .unwrap()
        };
        let plan = plan_for("m-b");
        assert_eq!(plan.variant().name.as_str(), "b", "ModelName m-b selects b");
        assert_eq!(first_choice(&plan), "b1");
        // The endpoint's name picks by weight (b has weight 0), and the engine sees m-a.
        let plan = plan_for("chat");
        assert_eq!(plan.variant().name.as_str(), "a");
        let sent: serde_json::Value = serde_json::from_slice(&plan.body).unwrap();
        assert_eq!(sent["model"], "m-a");
    }

    #[test]
    fn a_lora_adapter_goes_to_a_variant_that_serves_it_and_keeps_its_name() {
        let table = table();
        let plan = |headers: &HeaderMap, seed| {
            make_plan(
                &table,
                Operation::ChatCompletions,
                chat(&table),
                headers,
                chat_body("sql", "hello"),
                seed,
            )
        };
        for seed in 0..8 {
            // b's weight is 0, yet it is the only variant that serves the adapter.
            let plan = plan(&HeaderMap::new(), seed).unwrap();
            assert_eq!(plan.variant().name.as_str(), "b");
            let sent: serde_json::Value = serde_json::from_slice(&plan.body).unwrap();
            assert_eq!(sent["model"], "sql");
        }
        let mut headers = HeaderMap::new();
        headers.insert(TARGET_VARIANT, "a".parse().unwrap());
        let refused = plan(&headers, 1).unwrap_err();
        assert_eq!(refused.status, http::StatusCode::BAD_REQUEST);
        assert_eq!(refused.param, Some("model"));
        assert!(refused.message.contains("LoraAdapters"), "{refused:?}");
    }

    #[test]
    fn bad_input_is_refused_with_the_field_named() {
        let table = table();
        let plan = |operation, endpoint, headers: &HeaderMap, body: &str| {
            make_plan(
                &table,
                operation,
                endpoint,
                headers,
                Bytes::from(body.to_owned()),
                1,
            )
        };
        let no_model = plan(
            Operation::ChatCompletions,
            None,
            &HeaderMap::new(),
            r#"{"messages":[]}"#,
        )
        .unwrap_err();
        assert_eq!(no_model.param, Some("model"));
        let unknown = plan(
            Operation::Completions,
            None,
            &HeaderMap::new(),
            r#"{"model":"nope","prompt":"x"}"#,
        )
        .unwrap_err();
        assert_eq!(unknown.status, http::StatusCode::NOT_FOUND);
        let mut headers = HeaderMap::new();
        headers.insert(TARGET_VARIANT, "c".parse().unwrap());
        let wrong_variant = plan(Operation::Invocations, chat(&table), &headers, "{}").unwrap_err();
        assert!(
            wrong_variant.message.contains("no variant c"),
            "{wrong_variant:?}"
        );
        let mut headers = HeaderMap::new();
        headers.insert(PREFIX_AWARE_ID, "x".repeat(65).parse().unwrap());
        let long_id = plan(Operation::Invocations, chat(&table), &headers, "{}").unwrap_err();
        assert!(long_id.message.contains("1-64"), "{long_id:?}");
        let not_json = plan(
            Operation::ChatCompletions,
            chat(&table),
            &HeaderMap::new(),
            "{",
        )
        .unwrap_err();
        assert!(not_json.message.contains("not valid JSON"));
    }

    #[test]
    fn native_bodies_route_on_their_first_bytes_and_stay_untouched() {
        let table = table();
        let mut headers = HeaderMap::new();
        headers.insert(TARGET_VARIANT, "a".parse().unwrap());
        let prefix = "n".repeat(1024);
        let plan = |body: String| {
            make_plan(
                &table,
                Operation::Invocations,
                chat(&table),
                &headers,
                Bytes::from(body),
                3,
            )
            .unwrap()
        };
        let first = plan(format!("{prefix}-one"));
        let second = plan(format!("{prefix}-two"));
        assert_eq!(first.ranking.order, second.ranking.order);
        assert_eq!(&second.body[..], format!("{prefix}-two").as_bytes());
    }

    fn plan_at(
        table: &RoutingTable,
        operation: Operation,
        endpoint: Option<Arc<EndpointRoute>>,
        uri: &str,
        body: &str,
    ) -> Result<Plan, ApiError> {
        planned(
            table,
            operation,
            endpoint,
            &uri.parse().unwrap(),
            &HeaderMap::new(),
            Bytes::from(body.to_owned()),
            5,
        )
        .map(as_it_stands)
    }

    #[test]
    fn a_disaggregated_endpoint_drops_a_clients_kv_transfer_params_on_every_path() {
        let yaml = r#"
Endpoints:
  - EndpointName: pd
    ProductionVariants:
      - {VariantName: prefill, ModelName: m}
      - {VariantName: decode, ModelName: m}
    DisaggregationConfig: {PrefillVariantName: prefill, DecodeVariantName: decode, RouteThreshold: 16}
    Instances:
      - {Url: "http://127.0.0.1:1", InstanceId: p1, VariantName: prefill, Role: prefill}
      - {Url: "http://127.0.0.1:2", InstanceId: d1, VariantName: decode, Role: decode}
"#;
        let table = static_table(yaml);
        let pd = table.endpoints.get("pd").cloned();
        let body = |prompt: &str| {
            format!(
                r#"{{"model":"m","kv_transfer_para\u006ds":{{"do_remote_prefill":true}},"prompt":"{prompt}","kv_transfer_params":{{"remote_engine_id":"x"}}}}"#
            )
        };
        let no_params = |body: &[u8]| {
            let value: serde_json::Value = serde_json::from_slice(body).unwrap();
            assert!(value.get("kv_transfer_params").is_none(), "{value}");
            value
        };
        let short = plan_at(&table, Operation::Completions, pd.clone(), "/", &body("hi")).unwrap();
        assert!(short.prefill_hop.is_none());
        assert_eq!(no_params(&short.body)["prompt"], "hi");
        let long = "hello ".repeat(20);
        let plan = plan_at(
            &table,
            Operation::Completions,
            pd.clone(),
            "/",
            &body(&long),
        )
        .unwrap();
        no_params(&plan.body);
        let copy = plan.prefill_hop.unwrap().prefill_body.unwrap();
        let copy: serde_json::Value = serde_json::from_slice(&copy).unwrap();
        assert_eq!(copy["kv_transfer_params"]["do_remote_decode"], true);
        assert!(copy["kv_transfer_params"]["remote_engine_id"].is_null());
        // A Responses follow-up, to the decoder holding the response.
        let wrapped = response_ids::wrap("pd", "decode", "d1", "resp_engine");
        let follow_up = format!(
            r#"{{"input":"x","kv_transfer_params":{{"do_remote_prefill":true}},"previous_response_id":"{wrapped}"}}"#
        );
        let plan = plan_at(&table, Operation::Responses, pd, "/", &follow_up).unwrap();
        assert_eq!(no_params(&plan.body)["previous_response_id"], "resp_engine");
    }

    #[test]
    fn a_follow_up_goes_to_the_holder_even_past_the_threshold() {
        let table = table();
        let wrapped = response_ids::wrap("chat", "a", "a2", "resp_engine");
        // a2 is far above ConcurrencyThreshold (2): the state lives there, so it still wins.
        let endpoint = chat(&table).unwrap();
        endpoint.variants[0].instances[1]
            .cell
            .local
            .store(50, std::sync::atomic::Ordering::Relaxed);
        let body =
            format!(r#"{{"model":"chat","input":"and then?","previous_response_id":"{wrapped}"}}"#);
        for endpoint in [None, chat(&table)] {
            let plan = plan_at(
                &table,
                Operation::Responses,
                endpoint,
                "/v1/responses",
                &body,
            )
            .unwrap();
            assert_eq!(plan.ranking.route, Some(Route::Response));
            assert_eq!(
                plan.ranking.order.len(),
                1,
                "the holder is the only candidate"
            );
            assert_eq!(first_choice(&plan), "a2");
            assert_eq!(plan.path.as_deref(), Some("/v1/responses"));
            let sent: serde_json::Value = serde_json::from_slice(&plan.body).unwrap();
            assert_eq!(sent["previous_response_id"], "resp_engine");
            assert_eq!(sent["model"], "m-a");
        }
        // On a plain path the id alone names the endpoint: `model` may be left out.
        let body = format!(r#"{{"input":"x","previous_response_id":"{wrapped}"}}"#);
        let plan = plan_at(&table, Operation::Responses, None, "/v1/responses", &body).unwrap();
        assert_eq!(first_choice(&plan), "a2");
    }

    #[test]
    fn a_response_whose_instance_left_is_not_found_never_elsewhere() {
        let table = table();
        let gone = response_ids::wrap("chat", "a", "a9", "resp_engine");
        let body = format!(r#"{{"model":"chat","input":"x","previous_response_id":"{gone}"}}"#);
        let error =
            plan_at(&table, Operation::Responses, None, "/v1/responses", &body).unwrap_err();
        assert_eq!(error.status, http::StatusCode::NOT_FOUND);
        assert_eq!(error.openai_code, "response_not_found");
        assert_eq!(error.param, Some("previous_response_id"));
        assert!(error.message.contains("instance a9"), "{error:?}");
        for operation in [Operation::ResponseRetrieve, Operation::ResponseDelete] {
            let error = plan_at(
                &table,
                operation,
                None,
                &format!("/v1/responses/{gone}"),
                "",
            )
            .unwrap_err();
            assert_eq!(error.openai_code, "response_not_found");
            assert_eq!(error.param, Some("response_id"));
        }
        // An id no router made, an endpoint that is gone, another endpoint's response.
        let other = response_ids::wrap("other", "a", "a1", "resp_engine");
        for (operation, endpoint, uri, says) in [
            (
                Operation::ResponseRetrieve,
                None,
                "/v1/responses/resp_0123abcd".to_owned(),
                "not issued",
            ),
            (
                Operation::ResponseRetrieve,
                None,
                format!("/v1/responses/{other}"),
                "no longer exists",
            ),
            (
                Operation::ResponseCancel,
                chat(&table),
                format!("/endpoints/chat/openai/v1/responses/{other}/cancel"),
                "belongs to endpoint other",
            ),
        ] {
            let error = plan_at(&table, operation, endpoint, &uri, "").unwrap_err();
            assert!(error.message.contains(says), "{error:?}");
        }
    }

    #[test]
    fn retrieve_delete_and_cancel_go_to_the_holder_with_the_engines_id() {
        let table = table();
        let wrapped = response_ids::wrap("chat", "b", "b1", "resp_x/y");
        let retrieve = plan_at(
            &table,
            Operation::ResponseRetrieve,
            None,
            &format!("/v1/responses/{wrapped}?stream=true&starting_after=3"),
            "ignored",
        )
        .unwrap();
        assert_eq!(first_choice(&retrieve), "b1");
        assert_eq!(retrieve.ranking.route, Some(Route::Response));
        assert_eq!(
            retrieve.path.as_deref(),
            Some("/v1/responses/resp_x%2Fy?stream=true&starting_after=3")
        );
        assert!(retrieve.body.is_empty(), "GET sends no body");
        let cancel = plan_at(
            &table,
            Operation::ResponseCancel,
            chat(&table),
            &format!("/endpoints/chat/openai/v1/responses/{wrapped}/cancel"),
            "{}",
        )
        .unwrap();
        assert_eq!(
            cancel.path.as_deref(),
            Some("/v1/responses/resp_x%2Fy/cancel")
        );
        assert_eq!(&cancel.body[..], b"{}");
    }

    #[test]
    fn embeddings_route_on_their_input_and_keep_their_path() {
        let table = table();
        let prefix = "e".repeat(1024);
        let plan = |input: String| {
            plan_at(
                &table,
                Operation::Embeddings,
                None,
                "/v1/embeddings",
                &serde_json::json!({"model": "chat", "input": input}).to_string(),
            )
            .unwrap()
        };
        let first = plan(format!("{prefix} one"));
        let second = plan(format!("{prefix} two, longer"));
        assert_eq!(first.ranking.route, Some(Route::Prefix));
        assert_eq!(first.ranking.order, second.ranking.order);
        assert_eq!(first.path.as_deref(), Some("/v1/embeddings"));
        let others: std::collections::HashSet<Vec<usize>> = (0..8)
            .map(|index| plan(format!("{index}{prefix}")).ranking.order)
            .collect();
        assert!(others.len() > 1, "{others:?}");
    }

    #[test]
    fn kv_aware_plans_say_how_to_get_the_tokens_and_rank_by_load_meanwhile() {
        let table = table();
        let plan = |operation, headers: &HeaderMap, body: &str| {
            planned(
                &table,
                operation,
                chat(&table),
                &"/v1/chat/completions".parse().unwrap(),
                headers,
                Bytes::from(body.to_owned()),
                5,
            )
            .unwrap()
        };
        let mut to_k = HeaderMap::new();
        to_k.insert(TARGET_VARIANT, "k".parse().unwrap());
        let ask = |(_, input): &(NeedsTokens, KvInput)| -> serde_json::Value {
            match input {
                KvInput::Tokens(PromptTokens::Ask(prompt)) => {
                    serde_json::from_slice(&prompt.tokenize_body().unwrap()).unwrap()
                }
                other => panic!("expected a /tokenize body, got {other:?}"),
            }
        };
        // Chat: the engine is asked with the messages and the variant's ModelName.
        let chat_plan = needs_tokens(plan(
            Operation::ChatCompletions,
            &to_k,
            r#"{"model":"chat","messages":[{"role":"user","content":"hi"}],"max_tokens":3}"#,
        ));
        assert_eq!(chat_plan.0.plan.variant().name.as_str(), "k");
        assert_eq!(
            chat_plan.0.plan.ranking.route,
            Some(rank::Route::LeastOutstanding)
        );
        assert_eq!(chat_plan.0.plan.ranking.order.len(), 2);
        assert_eq!(
            ask(&chat_plan),
            serde_json::json!({"model": "m-k", "messages": [{"role": "user", "content": "hi"}]})
        );
        assert!(chat_plan.0.plan.cached_tokens.is_empty());
        // A token-id prompt needs no round trip.
        let ids = needs_tokens(plan(
            Operation::Completions,
            &to_k,
            r#"{"model":"m-k","prompt":[1,2,3]}"#,
        ));
        assert!(matches!(
            ids.1,
            KvInput::Tokens(PromptTokens::Known(ref ids)) if ids == &[1, 2, 3]
        ));
        // Native bodies: `messages` is a chat, `prompt` a completion, anything else by load.
        let native_chat = needs_tokens(plan(
            Operation::Invocations,
            &to_k,
            r#"{"messages":[{"role":"user","content":"x"}]}"#,
        ));
        assert!(ask(&native_chat).get("messages").is_some());
        let native_prompt =
            needs_tokens(plan(Operation::Invocations, &to_k, r#"{"prompt":"x y"}"#));
        assert_eq!(ask(&native_prompt), serde_json::json!({"prompt": "x y"}));
        let opaque = needs_tokens(plan(Operation::InvocationsStream, &to_k, "raw text"));
        assert!(matches!(opaque.1, KvInput::Unusable(_)));
        assert_eq!(
            &opaque.0.plan.body[..],
            b"raw text",
            "native bodies stay untouched"
        );
        // A session sticks to its instance: no KV ranking.
        let mut session = to_k.clone();
        session.insert(SESSION_ID, "s-1".parse().unwrap());
        let Planned::Ready(sticky) = plan(Operation::Completions, &session, r#"{"prompt":"x"}"#)
        else {
            panic!("a session needs no token ids");
        };
        assert_eq!(sticky.ranking.route, Some(rank::Route::Session));
        // Other strategies have nothing to fetch.
        let prefix = plan(
            Operation::ChatCompletions,
            &HeaderMap::new(),
            r#"{"model":"m-a","messages":[]}"#,
        );
        assert!(matches!(prefix, Planned::Ready(_)));
    }

    /// Endpoint `pd`: prefill `p1`, `p2`, decode `d1`, `d2`, with `disaggregation` (YAML).
    fn pd_table(disaggregation: &str) -> RoutingTable {
        let yaml = format!(
            r#"
Endpoints:
  - EndpointName: pd
    ProductionVariants:
      - {{VariantName: prefill, ModelName: m}}
      - {{VariantName: decode, ModelName: m}}
    DisaggregationConfig: {disaggregation}
    Instances:
      - {{Url: "http://127.0.0.1:1", InstanceId: p1, VariantName: prefill, Role: prefill}}
      - {{Url: "http://127.0.0.1:2", InstanceId: p2, VariantName: prefill, Role: prefill}}
      - {{Url: "http://127.0.0.1:3", InstanceId: d1, VariantName: decode, Role: decode}}
      - {{Url: "http://127.0.0.1:4", InstanceId: d2, VariantName: decode, Role: decode}}
"#
        );
        static_table(&yaml)
    }

    #[test]
    fn kv_aware_prefill_and_uncached_tokens_wait_for_the_token_ids() {
        let long = || {
            Bytes::from(
                serde_json::json!({"model": "pd", "prompt": "word ".repeat(300)}).to_string(),
            )
        };
        let plan = |table: &RoutingTable, body: Bytes| {
            planned(
                table,
                Operation::Completions,
                None,
                &"/v1/completions".parse().unwrap(),
                &HeaderMap::new(),
                body,
                5,
            )
            .unwrap()
        };
        // PROMPT_TOKENS with a KV_AWARE prefill pool: decided now, the prefill pool ranked by
        // load until the token ids come.
        let kv_prefill = pd_table(
            "{PrefillVariantName: prefill, DecodeVariantName: decode, RouteThreshold: 100, PrefillRoutingStrategy: KV_AWARE}",
        );
        let (decided, input) = needs_tokens(plan(&kv_prefill, long()));
        assert_eq!(decided.plan.label, RouteLabel::Disaggregated);
        let prefill = decided.plan.prefill_hop.as_ref().expect("disaggregated");
        assert_eq!(prefill.prefill.route, Some(Route::LeastOutstanding));
        assert!(pending(&decided).undecided.is_none());
        assert!(matches!(input, KvInput::Tokens(PromptTokens::Ask(_))));
        // A short prompt goes direct with nothing to fetch.
        let Planned::Ready(short) = plan(
            &kv_prefill,
            Bytes::from_static(br#"{"model":"pd","prompt":"hi"}"#),
        ) else {
            panic!("a short prompt needs no token ids");
        };
        assert_eq!(short.label, RouteLabel::Direct);

        // UNCACHED_TOKENS: undecided (direct meanwhile), with the router's own count kept.
        let uncached = pd_table(
            "{PrefillVariantName: prefill, DecodeVariantName: decode, RouteThreshold: 100, ThresholdBasis: UNCACHED_TOKENS}",
        );
        let (undecided, _) = needs_tokens(plan(&uncached, long()));
        assert_eq!(undecided.plan.label, RouteLabel::Direct);
        assert!(undecided.plan.prefill_hop.is_none());
        let count = pending(&undecided).undecided.expect("undecided");
        assert!(count.tokens >= 100, "{count:?}");
        // Without token ids every counted token is uncached: disaggregated, round robin.
        let settled = undecided.finish(None, &Indexes::default(), 0, 1);
        assert_eq!(settled.label, RouteLabel::Disaggregated);
        assert!(settled.cached_tokens.is_empty());
        assert_eq!(
            settled.prefill_hop.expect("disaggregated").count.tokens,
            count.tokens
        );
        // With token ids (and no index yet), their number is the count: 99 is direct, and
        // RouteThreshold (100) exactly is enough.
        for (count, label) in [(99, RouteLabel::Direct), (100, RouteLabel::Disaggregated)] {
            let (ids, _) = needs_tokens(plan(&uncached, long()));
            let tokens: Vec<u32> = (0..count).collect();
            let settled = ids.finish(Some(&tokens), &Indexes::default(), 0, 1);
            assert_eq!(settled.label, label);
            assert_eq!(settled.explain[0].1, count.to_string());
        }
    }

    #[test]
    fn a_prefix_aware_prefill_pool_is_keyed_by_the_prompt() {
        let yaml = r#"
Endpoints:
  - EndpointName: pd
    ProductionVariants:
      - VariantName: prefill
        ModelName: m
        RoutingConfig:
          RoutingStrategy: PREFIX_AWARE
          PrefixAwareRoutingConfig: {PrefixLength: 1024, ConcurrencyThreshold: 10}
      - {VariantName: decode, ModelName: m}
    DisaggregationConfig: {PrefillVariantName: prefill, DecodeVariantName: decode, RouteThreshold: 16, PrefillRoutingStrategy: PREFIX_AWARE}
    Instances:
      - {Url: "http://127.0.0.1:1", InstanceId: p1, VariantName: prefill, Role: prefill}
      - {Url: "http://127.0.0.1:2", InstanceId: p2, VariantName: prefill, Role: prefill}
      - {Url: "http://127.0.0.1:3", InstanceId: d1, VariantName: decode, Role: decode}
"#;
        let table = static_table(yaml);
        let prefill_of = |topic: usize| {
            let prompt = format!("topic {topic}: {}", "word ".repeat(40));
            let body = serde_json::json!({"model": "m", "prompt": prompt}).to_string();
            let plan = plan_at(&table, Operation::Completions, None, "/", &body).unwrap();
            let endpoint = Arc::clone(&plan.endpoint);
            let prefill = plan.prefill_hop.expect("disaggregated").prefill;
            assert_eq!(prefill.route, Some(Route::Prefix));
            endpoint.variants[0].instances[prefill.order[0]]
                .id
                .to_string()
        };
        let chosen: Vec<String> = (0..16).map(prefill_of).collect();
        // The same prompt, the same prefill instance; different ones spread (all 16 on one
        // instance: 2^-15 for a fair hash).
        assert_eq!(chosen, (0..16).map(prefill_of).collect::<Vec<_>>());
        assert!(chosen.iter().any(|id| id == "p1") && chosen.iter().any(|id| id == "p2"));
    }
}
