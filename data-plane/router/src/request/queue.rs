//! The queue phase: flow control for variants with `MaxInFlightPerInstance`.
//!
//! A request to such a variant leaves this phase only with a slot at an instance: one whose
//! fleet-wide in-flight count (this router's exact count plus the other routers' last
//! reported one) is below the cap, taken atomically against this router's other requests
//! ([`SlotClaim`]) and handed to the forward phase, whose attempt adopts it. When every
//! candidate is at the cap the request waits in its variant's queue on this router, which
//! lets requests go in this order:
//!
//! 1. **priority**: lower first (strict: a request of priority 0 waits while any of
//!    priority -1 can be served);
//! 2. **fairness id**: within a priority, ids take turns in proportion to their weights
//!    (the variant's `FairnessWeights`, 1 for ids it does not name: stride scheduling, a cost
//!    of one per request), so that two backlogged ids of equal weight share the slots evenly
//!    however many requests each sends;
//! 3. **arrival**, within an id.
//!
//! **Headroom** (`FlowHeadroomPerInstance`): an instance at the cap takes that many more
//! requests, but only those that need not wait behind a backlog: a priority below 0, or, at
//! priority 0 or better, a fairness id with no other request waiting that held less than its
//! weighted share of the slot-seconds held lately by the ids on the variant through this
//! router, while another id is in flight or waiting (id's slot-seconds × total weight < its
//! weight × all of them; a second counts less as it ages, halved every 10 s; an id holding
//! none is remembered until its seconds fade). An id with a backlog waits its turn: two
//! backlogged ids do not take the headroom in turn. Slot-seconds, not the slots held now: a light client's burst holds as
//! many slots at once as a heavy client's capped backlog (its answers take as long), but for
//! a short while. Nor the slots taken lately: with answers much longer than the half-life a
//! backlogged id takes few slots a second, yet holds its share of the cap all along. So an
//! urgent request, or a light client's among a heavy one's backlog, starts at once on an
//! engine that batches cap + headroom, instead of waiting for a capped slot to free; an id
//! alone, or the one that held the most, never takes it.
//! A headroom slot is only ever one past the cap: a slot below it goes by the queue's order.
//! The ids' counts are kept while they hold slots, and after until they fade (at most
//! requests in flight + 256 entries; a retry's or a migrated stream's attempt is not counted);
//! each router judges shares from its own requests, and every instance stays within
//! cap + headroom.
//!
//! A request that cannot be served because its own candidates are full (one pinned to its
//! instance) does not hold up the others: the next one in order that can go, goes.
//!
//! What wakes the queue: an attempt ending on one of the variant's instances
//! ([`InstanceCell::slot_freed`]), a load report that lowers another router's count, and a
//! recheck every [`RECHECK`] by a waiting request (for changes nothing reports, such as an
//! ejection ending). Where a request goes is decided when it leaves, on that moment's counts:
//! the first of its ranked candidates below the cap.
//!
//! Bounds: `--max-queued-requests` waiting requests per variant (beyond: 503), each for at
//! most `--queue-timeout-seconds` (then 503); the fairness ids tracked are those of waiting
//! requests, so never more than the requests waiting. A client that goes away leaves the
//! queue at once. After SIGTERM a waiting request keeps its place for half the grace period,
//! then gets 503, so the answers of those served still fit in the grace period.
//!
//! Disaggregated prefill/decode: each variant applies its own cap, and a request waits for
//! the one it needs next: this phase takes a prefill slot for a request that goes prefill →
//! decode, and the forward phase waits for a decode slot ([`FlowControl::slot`]) once the
//! prefill is done (a direct request waits for the decoders here).
//!
//! Not held here: `/tokenize`, `/detokenize` and requests about a stored response (only
//! inference waits); a request whose candidates are all ejected (forwarding answers it as
//! without flow control).

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use switchyard_process::metrics::{Histogram, TextEncoder};
use switchyard_shared::{EndpointName, VariantName};
use tokio::sync::oneshot;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::errors::ApiError;
use crate::observe::labels::RouteLabel;
use crate::operation::Operation;
use crate::plan::Plan;
use crate::plan::flow::FlowKey;
use crate::routing::cells::{InstanceCell, SlotClaim, SlotWaker};
use crate::routing::table::{EndpointRoute, VariantRoute};

/// How often a waiting request has the queue look again when nothing said a slot freed.
pub const RECHECK: Duration = Duration::from_millis(200);

/// Seconds waited in a queue.
const WAIT_BOUNDS: [f64; 14] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];

/// The queues' bounds, from the router's flags.
#[derive(Debug, Clone, Copy)]
pub struct QueueSettings {
    /// `--max-queued-requests`, per variant.
    pub max_queued: usize,
    /// `--queue-timeout-seconds`.
    pub timeout: Duration,
    /// `--trust-flow-headers`.
    pub trust_headers: bool,
    /// `--shutdown-grace-seconds`: waiting requests keep their place for half of it.
    pub grace: Duration,
}

/// Why a request left a queue without a slot: the `reason` label of
/// `switchyard_router_queue_dropped_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dropped {
    Overflow,
    Timeout,
    Disconnect,
    Shutdown,
}

impl Dropped {
    pub const ALL: [Dropped; 4] = [
        Dropped::Overflow,
        Dropped::Timeout,
        Dropped::Disconnect,
        Dropped::Shutdown,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Dropped::Overflow => "overflow",
            Dropped::Timeout => "timeout",
            Dropped::Disconnect => "disconnect",
            Dropped::Shutdown => "shutdown",
        }
    }
}

/// Every variant queue of one router (made when a request first meets the cap's variant).
#[derive(Debug)]
pub struct FlowControl {
    settings: QueueSettings,
    shutdown: CancellationToken,
    queues: Mutex<HashMap<(EndpointName, VariantName), Arc<VariantQueue>>>,
}

/// A request through the queue phase: its plan (the ranking starting with the instance whose
/// slot it holds), the slot, and how long it waited (None: no cap on its variant).
#[derive(Debug)]
pub struct Admitted {
    pub plan: Plan,
    pub claim: Option<SlotClaim>,
    pub waited: Option<Duration>,
}

impl FlowControl {
    pub fn new(settings: QueueSettings, shutdown: CancellationToken) -> Self {
        Self {
            settings,
            shutdown,
            queues: Mutex::default(),
        }
    }

    /// Whether clients' `x-switchyard-priority` and `x-switchyard-fairness-id` are read.
    pub fn trusts_headers(&self) -> bool {
        self.settings.trust_headers
    }

    /// The queue phase: a slot for `plan` at an instance below its variant's cap, waiting
    /// for one if need be (see the module docs); a plan without a cap goes straight on.
    pub async fn admit(&self, operation: Operation, mut plan: Plan) -> Result<Admitted, ApiError> {
        if !operation.queues() {
            return Ok(Admitted {
                plan,
                claim: None,
                waited: None,
            });
        }
        // A disaggregated request needs a prefill instance first (its decoder waits in the
        // forward phase, once the prefill is done).
        if let Some(pd) = plan.endpoint.disaggregation.as_ref()
            && let Some(hop) = plan.prefill_hop.as_mut()
        {
            let prefill = &plan.endpoint.variants[pd.prefill];
            let slot = self
                .slot(
                    prefill,
                    &plan.endpoint,
                    &mut hop.prefill.order,
                    false,
                    plan.flow,
                )
                .await?;
            return Ok(match slot {
                Some((claim, waited)) => Admitted {
                    plan,
                    claim: Some(claim),
                    waited: Some(waited),
                },
                None => Admitted {
                    plan,
                    claim: None,
                    waited: None,
                },
            });
        }
        let endpoint = Arc::clone(&plan.endpoint);
        let variant = &endpoint.variants[plan.variant_index];
        let first = plan.ranking.order.first().copied();
        let Some((claim, waited)) = self
            .slot(
                variant,
                &endpoint,
                &mut plan.ranking.order,
                plan.pinned,
                plan.flow,
            )
            .await?
        else {
            return Ok(Admitted {
                plan,
                claim: None,
                waited: None,
            });
        };
        // A prefix's (or its copy's) instance was full: another took it, as PREFIX_AWARE's
        // overflow does.
        if plan.ranking.order.first().copied() != first && plan.label == RouteLabel::Prefix {
            plan.label = RouteLabel::Overflow;
        }
        Ok(Admitted {
            plan,
            claim: Some(claim),
            waited: Some(waited),
        })
    }

    /// A slot at one of `variant`'s instances in `order` (only the first when `pinned`), below
    /// its MaxInFlightPerInstance, waiting in the variant's queue at `flow`'s place if need
    /// be; `order` then starts with the granted instance, followed (for a retry after a
    /// failed connection) by the others below the cap now. None: the variant has no cap, or
    /// none of its candidates is available (forwarding answers as without flow control).
    pub async fn slot(
        &self,
        variant: &VariantRoute,
        endpoint: &EndpointRoute,
        order: &mut Vec<usize>,
        pinned: bool,
        flow: FlowKey,
    ) -> Result<Option<(SlotClaim, Duration)>, ApiError> {
        let Some(cap) = variant.max_in_flight_per_instance else {
            return Ok(None);
        };
        let now_ms = switchyard_process::clock::unix_ms();
        let ranked: &[usize] = if pinned {
            &order[..order.len().min(1)]
        } else {
            order
        };
        let candidates: Vec<Candidate> = ranked
            .iter()
            .filter(|&&position| variant.instances[position].cell.available(now_ms))
            .map(|&position| Candidate {
                position,
                cell: Arc::clone(&variant.instances[position].cell),
            })
            .collect();
        if candidates.is_empty() {
            return Ok(None);
        }
        let queue = self.queue(&endpoint.name, &variant.name);
        for candidate in &candidates {
            let waker: Weak<dyn SlotWaker> = Arc::downgrade(&queue) as Weak<dyn SlotWaker>;
            let _ = candidate.cell.waker.get_or_init(|| waker);
        }
        let body_priority = flow.body_priority.filter(|_| self.settings.trust_headers);
        let fairness = flow.fairness.unwrap_or(0);
        let place = Place {
            priority: flow.header_priority.or(body_priority).unwrap_or(0),
            fairness,
            weight: variant
                .fairness_weights
                .get(&fairness)
                .copied()
                .unwrap_or(1.0),
        };
        let since = Instant::now();
        let limits = Limits {
            cap,
            headroom: variant.flow_headroom_per_instance,
        };
        let grant = match queue.wait(self, place, candidates, limits, since).await {
            Ok(grant) => grant,
            Err(dropped) => {
                queue.dropped[dropped as usize].fetch_add(1, Ordering::Relaxed);
                return Err(self.refusal(dropped, &endpoint.name, &variant.name));
            }
        };
        let waited = since.elapsed();
        queue.wait_seconds.observe(waited.as_secs_f64());
        let granted = grant.position;
        // The retries (a pinned request's ranking keeps its fallbacks too: a session's
        // rendezvous order; a stored response's has none).
        let rest: Vec<usize> = order
            .iter()
            .copied()
            .filter(|&position| {
                position != granted && variant.instances[position].cell.fleet_load() < cap
            })
            .collect();
        *order = std::iter::once(granted).chain(rest).collect();
        Ok(Some((grant.claim, waited)))
    }

    fn refusal(
        &self,
        dropped: Dropped,
        endpoint: &EndpointName,
        variant: &VariantName,
    ) -> ApiError {
        let mut error = match dropped {
            Dropped::Overflow => ApiError::overloaded(format!(
                "{} requests already wait for variant {variant} of endpoint {endpoint} on this \
                 router (--max-queued-requests); retry shortly",
                self.settings.max_queued
            )),
            Dropped::Timeout => ApiError::overloaded(format!(
                "no instance of variant {variant} of endpoint {endpoint} had a free slot \
                 (MaxInFlightPerInstance) within {} s (--queue-timeout-seconds); retry shortly",
                self.settings.timeout.as_secs()
            )),
            // The client is gone: nobody reads this.
            Dropped::Disconnect | Dropped::Shutdown => ApiError::overloaded(
                "the router is shutting down and its queue was not served in time; retry on \
                 another router",
            ),
        };
        error.openai_code = match dropped {
            Dropped::Overflow => "queue_full",
            Dropped::Timeout => "queue_timeout",
            Dropped::Disconnect | Dropped::Shutdown => "shutting_down",
        };
        error
    }

    fn queue(&self, endpoint: &EndpointName, variant: &VariantName) -> Arc<VariantQueue> {
        let mut queues = self
            .queues
            .lock()
            .unwrap_or_else(|poison| poison.into_inner());
        Arc::clone(
            queues
                .entry((endpoint.clone(), variant.clone()))
                .or_insert_with(|| Arc::new(VariantQueue::default())),
        )
    }

    /// Requests waiting in `endpoint`'s `variant` queue now.
    pub fn queued(&self, endpoint: &str, variant: &str) -> usize {
        let queues = self
            .queues
            .lock()
            .unwrap_or_else(|poison| poison.into_inner());
        queues
            .iter()
            .find(|((e, v), _)| e.as_str() == endpoint && v.as_str() == variant)
            .map_or(0, |(_, queue)| queue.lock().len)
    }

    /// The queues' metrics: length and oldest wait per variant and priority (priorities with
    /// waiting requests only), waits, and requests dropped by reason. No label per fairness
    /// id.
    pub fn render(&self, out: &mut TextEncoder) {
        let mut queues: Vec<((EndpointName, VariantName), Arc<VariantQueue>)> = self
            .queues
            .lock()
            .unwrap_or_else(|poison| poison.into_inner())
            .iter()
            .map(|(key, queue)| (key.clone(), Arc::clone(queue)))
            .collect();
        queues.sort_by(|a, b| a.0.cmp(&b.0));
        let now = Instant::now();
        let mut bands = Vec::new();
        for ((endpoint, variant), queue) in &queues {
            let state = queue.lock();
            for (priority, band) in &state.bands {
                let length: usize = band.flows.values().map(|flow| flow.waiters.len()).sum();
                let oldest = band
                    .flows
                    .values()
                    .filter_map(|flow| flow.waiters.front().map(|waiter| waiter.since))
                    .min()
                    .map_or(0.0, |since| now.duration_since(since).as_secs_f64());
                bands.push((
                    endpoint.to_string(),
                    variant.to_string(),
                    priority.to_string(),
                    length,
                    oldest,
                ));
            }
        }
        out.family(
            "switchyard_router_queue_length",
            "gauge",
            "Requests waiting in this router's flow-control queue, per variant and priority (MaxInFlightPerInstance).",
        );
        for (endpoint, variant, priority, length, _) in &bands {
            out.sample(
                "switchyard_router_queue_length",
                &[
                    ("endpoint", endpoint),
                    ("variant", variant),
                    ("priority", priority),
                ],
                *length as f64,
            );
        }
        out.family(
            "switchyard_router_queue_oldest_seconds",
            "gauge",
            "How long the oldest waiting request has waited, per variant and priority.",
        );
        for (endpoint, variant, priority, _, oldest) in &bands {
            out.sample(
                "switchyard_router_queue_oldest_seconds",
                &[
                    ("endpoint", endpoint),
                    ("variant", variant),
                    ("priority", priority),
                ],
                *oldest,
            );
        }
        out.family(
            "switchyard_router_queue_wait_seconds",
            "histogram",
            "Time requests of capped variants waited for a slot (0 when one was free), per variant.",
        );
        // The labels of each queue's variant, in the order of `queues`.
        let variant_labels: Vec<[(&str, &str); 2]> = queues
            .iter()
            .map(|((endpoint, variant), _)| {
                [
                    ("endpoint", endpoint.as_str()),
                    ("variant", variant.as_str()),
                ]
            })
            .collect();
        for (labels, (_, queue)) in variant_labels.iter().zip(&queues) {
            out.histogram(
                "switchyard_router_queue_wait_seconds",
                labels,
                &queue.wait_seconds,
            );
        }
        out.family(
            "switchyard_router_queue_dropped_total",
            "counter",
            "Requests that left the queue without a slot, by reason: overflow (--max-queued-requests), timeout (--queue-timeout-seconds), disconnect (the client went away), shutdown.",
        );
        for (&[endpoint, variant], (_, queue)) in variant_labels.iter().zip(&queues) {
            for reason in Dropped::ALL {
                out.sample(
                    "switchyard_router_queue_dropped_total",
                    &[endpoint, variant, ("reason", reason.as_str())],
                    queue.dropped[reason as usize].load(Ordering::Relaxed) as f64,
                );
            }
        }
        out.family(
            "switchyard_router_queue_headroom_grants_total",
            "counter",
            "Slots granted past MaxInFlightPerInstance, within FlowHeadroomPerInstance (to a priority below 0, or a fairness id below its fair share), per variant.",
        );
        for (labels, (_, queue)) in variant_labels.iter().zip(&queues) {
            out.sample(
                "switchyard_router_queue_headroom_grants_total",
                labels,
                queue.headroom_grants.load(Ordering::Relaxed) as f64,
            );
        }
    }
}

/// An instance a waiting request may go to, by position in its variant.
#[derive(Debug)]
struct Candidate {
    position: usize,
    cell: Arc<InstanceCell>,
}

/// A slot for a waiting request: where, and the slot itself.
#[derive(Debug)]
struct Grant {
    position: usize,
    claim: SlotClaim,
    /// Taken within the headroom (past the cap).
    headroom: bool,
}

/// Where a request waits: its priority band, its fairness id and that id's weight.
#[derive(Debug, Clone, Copy)]
struct Place {
    priority: i32,
    fairness: u64,
    weight: f64,
}

#[derive(Debug)]
struct Waiter {
    seq: u64,
    since: Instant,
    limits: Limits,
    candidates: Vec<Candidate>,
    reply: oneshot::Sender<Grant>,
}

impl Waiter {
    /// A slot below the cap or, for a request that may use it (`favoured`, asked only when
    /// the cap is full and the variant has headroom), within the headroom.
    fn try_grant(
        &self,
        favoured: impl FnOnce() -> bool,
        full: &mut Vec<*const InstanceCell>,
    ) -> Option<Grant> {
        try_grant(&self.candidates, self.limits.cap, full).or_else(|| {
            (self.limits.headroom > 0)
                .then(favoured)
                .and_then(|favoured| headroom_grant(&self.candidates, self.limits, favoured))
        })
    }
}

/// A slot within the headroom (an instance at the cap or past it, below cap + headroom), for
/// a request that may use it.
fn headroom_grant(candidates: &[Candidate], limits: Limits, favoured: bool) -> Option<Grant> {
    let limit = limits.favoured(favoured)?;
    let now_ms = switchyard_process::clock::unix_ms();
    candidates
        .iter()
        .filter(|candidate| candidate.cell.available(now_ms))
        .find_map(|candidate| {
            SlotClaim::take_from(&candidate.cell, limits.cap, limit).map(|claim| Grant {
                position: candidate.position,
                claim,
                headroom: true,
            })
        })
}

/// A variant's per-instance limits, for one request.
#[derive(Debug, Clone, Copy)]
struct Limits {
    /// MaxInFlightPerInstance.
    cap: u32,
    /// FlowHeadroomPerInstance (0: none).
    headroom: u32,
}

impl Limits {
    /// The higher limit a request may use when `favoured` (None: no headroom for it).
    fn favoured(self, favoured: bool) -> Option<u32> {
        (favoured && self.headroom > 0).then(|| self.cap.saturating_add(self.headroom))
    }
}

/// A fairness id's requests holding slots of a variant with headroom, through this router.
#[derive(Debug, Clone, Copy)]
struct Holding {
    count: u32,
    weight: f64,
    /// The slot-seconds it held since it began holding, each second counting less as it ages
    /// (halved every [`HELD_HALF_LIFE`]), as of `at`: how much of the variant it used lately.
    held: f64,
    at: std::time::Instant,
}

/// How fast a fairness id's slot-seconds held are forgotten ([`Holding::held`]).
const HELD_HALF_LIFE: Duration = Duration::from_secs(10);

/// An id holding no slot is remembered (its slot-seconds fading) until they are below this
/// part of one slot held for ever, and at most [`MOST_IDLE_IDS`] such ids are: so that an id
/// holding one slot at a time through this router, one request after the other, is not
/// taken afresh for a light one at each request.
const FORGET_BELOW: f64 = 0.01;

/// At most this many ids holding no slot are remembered per variant; past it the faded are
/// forgotten, then those that held least, down to half as many ([`release`]).
const MOST_IDLE_IDS: usize = 256;

impl Holding {
    /// A holding of nothing, from `now`.
    fn new(weight: f64, now: std::time::Instant) -> Self {
        Self {
            count: 0,
            weight,
            held: 0.0,
            at: now,
        }
    }

    /// [`Self::held`] as of `now`: the faded past, plus `count` slots held since `at`.
    fn held_at(&self, now: std::time::Instant) -> f64 {
        let half_life = HELD_HALF_LIFE.as_secs_f64();
        let fade = (-now.saturating_duration_since(self.at).as_secs_f64() / half_life).exp2();
        // Integral of count × 2^(-age / half-life) over the time since `at`.
        let mean_life = half_life / std::f64::consts::LN_2;
        self.held * fade + f64::from(self.count) * mean_life * (1.0 - fade)
    }

    /// `count` slots held from `now` on.
    fn set_count(&mut self, count: u32, now: std::time::Instant) {
        self.held = self.held_at(now);
        self.at = now;
        self.count = count;
    }

    /// Holding nothing, and what it held faded to nothing that counts.
    fn faded(&self, now: std::time::Instant) -> bool {
        self.count == 0 && self.held_at(now) < FORGET_BELOW * mean_life()
    }
}

/// Seconds one slot held for ever counts for ([`Holding::held`]'s limit).
fn mean_life() -> f64 {
    HELD_HALF_LIFE.as_secs_f64() / std::f64::consts::LN_2
}

/// The fairness ids' holdings of one variant, and how many of them hold no slot.
#[derive(Debug, Default, Clone)]
struct Held {
    ids: HashMap<u64, Holding>,
    /// Entries with a count of 0 (remembered for their seconds).
    idle: usize,
}

impl std::ops::Deref for Held {
    type Target = HashMap<u64, Holding>;

    fn deref(&self) -> &Self::Target {
        &self.ids
    }
}

type Holdings = Arc<Mutex<Held>>;

fn lock_holdings(holdings: &Holdings) -> MutexGuard<'_, Held> {
    holdings.lock().unwrap_or_else(|poison| poison.into_inner())
}

/// One request's part of its id's [`Holding`], for as long as it holds its slot.
#[derive(Debug)]
struct HoldTicket {
    holdings: Holdings,
    fairness: u64,
}

impl Drop for HoldTicket {
    fn drop(&mut self) {
        let mut holdings = lock_holdings(&self.holdings);
        release(&mut holdings, self.fairness, std::time::Instant::now());
    }
}

/// One slot of `fairness`'s let go at `now`: its seconds until then are kept. An id holding
/// none is remembered while its seconds count ([`FORGET_BELOW`]); past [`MOST_IDLE_IDS`] such
/// ids, the faded are forgotten and then those that held least, down to half of it (so the
/// walk over the ids is paid once per many releases, however many ids hold slots).
fn release(held: &mut Held, fairness: u64, now: std::time::Instant) {
    let Some(holding) = held.ids.get_mut(&fairness) else {
        return;
    };
    if holding.count == 0 {
        return;
    }
    holding.set_count(holding.count - 1, now);
    if holding.count > 0 {
        return;
    }
    if holding.faded(now) {
        held.ids.remove(&fairness);
        return;
    }
    held.idle += 1;
    if held.idle <= MOST_IDLE_IDS {
        return;
    }
    held.ids.retain(|_, holding| !holding.faded(now));
    let mut idle: Vec<(f64, u64)> = held
        .ids
        .iter()
        .filter(|(_, holding)| holding.count == 0)
        .map(|(id, holding)| (holding.held_at(now), *id))
        .collect();
    let keep = MOST_IDLE_IDS / 2;
    if idle.len() > keep {
        let cut = idle.len() - keep;
        idle.select_nth_unstable_by(cut - 1, |a, b| a.0.total_cmp(&b.0));
        for (_, id) in &idle[..cut] {
            held.ids.remove(id);
        }
    }
    held.idle = idle.len().min(keep);
}

/// Whether a request at `place` may use the headroom at `now`: a priority below 0; or, at
/// priority 0 or better, no other request of its id waiting (`own_waiting`: an id with a
/// backlog waits its turn, so that two backlogged ids do not take the headroom in turn and
/// fill cap + headroom between them), another id in flight or waiting ([`Weights::active`],
/// the weights of the ids holding or waiting, this one's included, is more than its own) and
/// its id having held less than its weighted share of the slot-seconds those ids held on the
/// variant through this router lately ([`Holding::held`]; [`Weights::all_held`], their sum;
/// ids holding nothing and not waiting weigh in neither). Slot-seconds, not the slots held now:
/// a light client's burst holds as many slots at once as the heavy client's capped backlog
/// (its answers take as long), but for a short while. Nor the slots taken lately: with
/// answers much longer than the half-life a backlogged id takes few slots a second while it
/// holds its backlog's all along.
fn may_use_headroom(
    place: Place,
    limits: Limits,
    (holdings, own_waiting): (&HashMap<u64, Holding>, bool),
    weights: impl FnOnce() -> Weights,
    now: std::time::Instant,
) -> bool {
    if limits.headroom == 0 || place.priority > 0 {
        return false;
    }
    if place.priority < 0 {
        return true;
    }
    if own_waiting {
        return false;
    }
    let Weights { active, all_held } = weights();
    if active <= place.weight {
        return false;
    }
    let held = holdings
        .get(&place.fairness)
        .map_or(0.0, |holding| holding.held_at(now));
    // Nothing held through this router (other routers fill the cap): below any share.
    all_held <= 0.0 || held * active < place.weight * all_held
}

/// What the fair share of the headroom is judged against ([`State::weights`]), worked out
/// once per pass over the queue.
#[derive(Debug, Clone, Copy)]
struct Weights {
    /// The weights of the ids holding slots or waiting.
    active: f64,
    /// The slot-seconds those ids held lately.
    all_held: f64,
}

/// A slot at the first of `candidates` below `cap`, skipping cells already found full in this
/// pass (`full`, which gets the ones found full now).
fn try_grant(
    candidates: &[Candidate],
    cap: u32,
    full: &mut Vec<*const InstanceCell>,
) -> Option<Grant> {
    let now_ms = switchyard_process::clock::unix_ms();
    for candidate in candidates {
        let cell = Arc::as_ptr(&candidate.cell);
        // An instance ejected meanwhile (it failed fast: its slots free at once) is not
        // granted, or it would turn the queue into errors while healthy instances are busy.
        if full.contains(&cell) || !candidate.cell.available(now_ms) {
            continue;
        }
        match SlotClaim::take(&candidate.cell, cap) {
            Some(claim) => {
                return Some(Grant {
                    position: candidate.position,
                    claim,
                    headroom: false,
                });
            }
            None => full.push(cell),
        }
    }
    None
}

/// One variant's queue on this router.
#[derive(Debug)]
struct VariantQueue {
    state: Mutex<State>,
    /// Headroom variants: each fairness id's requests holding slots (lock after `state`).
    holdings: Holdings,
    /// Slots granted within the headroom.
    headroom_grants: AtomicU64,
    wait_seconds: Histogram,
    dropped: [AtomicU64; Dropped::ALL.len()],
    /// When a waiting request last had the queue look again (ms since `epoch`), so that a
    /// long queue rechecks a few times a second, not once per request.
    rechecked_ms: AtomicU64,
    epoch: Instant,
}

impl Default for VariantQueue {
    fn default() -> Self {
        Self {
            state: Mutex::default(),
            holdings: Holdings::default(),
            headroom_grants: AtomicU64::new(0),
            wait_seconds: Histogram::new(&WAIT_BOUNDS),
            dropped: Default::default(),
            rechecked_ms: AtomicU64::new(0),
            epoch: Instant::now(),
        }
    }
}

/// Priority bands, lowest first; in each, fairness ids by their pass (weighted turns); in
/// each id, arrival order.
#[derive(Debug, Default)]
struct State {
    bands: BTreeMap<i32, Band>,
    len: usize,
    next_seq: u64,
}

/// One priority's waiting requests. Each fairness id has a pass: served ids in order of it
/// (ties by who was served longest ago, or arrived first), and a request served adds
/// 1 / weight to its id's pass (stride scheduling: over time each backlogged id gets turns in
/// proportion to its weight; with equal weights, one each in turn). An id that starts waiting
/// starts at the pass of the last request served, neither behind the others nor ahead.
#[derive(Debug, Default)]
struct Band {
    flows: HashMap<u64, Flow>,
    /// The pass at which the last request was served.
    clock: f64,
    /// Tie-break order: when each id last arrived or was served.
    next_order: u64,
}

#[derive(Debug)]
struct Flow {
    waiters: VecDeque<Waiter>,
    pass: f64,
    weight: f64,
    order: u64,
}

impl State {
    /// The weights of the fairness ids holding slots or waiting (`extra`: one more id), and
    /// the slot-seconds they held lately as of `now` (an id waiting with none held counts its
    /// remembered seconds). One walk over the ids (a hash set: linear in the ids remembered
    /// and waiting).
    fn weights(
        &self,
        holdings: &HashMap<u64, Holding>,
        extra: Option<Place>,
        now: std::time::Instant,
    ) -> Weights {
        let mut seen = std::collections::HashSet::new();
        let mut weights = Weights {
            active: 0.0,
            all_held: 0.0,
        };
        for (id, holding) in holdings.iter().filter(|(_, holding)| holding.count > 0) {
            seen.insert(*id);
            weights.active += holding.weight;
            weights.all_held += holding.held_at(now);
        }
        let waiting = self
            .bands
            .values()
            .flat_map(|band| band.flows.iter().map(|(id, flow)| (*id, flow.weight)));
        for (id, weight) in waiting.chain(extra.map(|place| (place.fairness, place.weight))) {
            if seen.insert(id) {
                weights.active += weight;
                weights.all_held += holdings
                    .get(&id)
                    .map_or(0.0, |holding| holding.held_at(now));
            }
        }
        weights
    }

    fn push(&mut self, place: Place, waiter: Waiter) {
        let band = self.bands.entry(place.priority).or_default();
        let (clock, order) = (band.clock, band.next_order);
        let flow = band.flows.entry(place.fairness).or_insert_with(|| Flow {
            waiters: VecDeque::new(),
            pass: clock,
            weight: place.weight,
            order,
        });
        if flow.waiters.is_empty() {
            band.next_order += 1;
        }
        flow.waiters.push_back(waiter);
        self.len += 1;
    }

    /// Takes out the waiter `seq` (if it is still there).
    fn remove(&mut self, place: Place, seq: u64) -> bool {
        let Some(band) = self.bands.get_mut(&place.priority) else {
            return false;
        };
        let Some(flow) = band.flows.get_mut(&place.fairness) else {
            return false;
        };
        let Some(at) = flow.waiters.iter().position(|waiter| waiter.seq == seq) else {
            return false;
        };
        flow.waiters.remove(at);
        self.len -= 1;
        if flow.waiters.is_empty() {
            band.flows.remove(&place.fairness);
        }
        if band.flows.is_empty() {
            self.bands.remove(&place.priority);
        }
        true
    }

    /// The next waiter in order that can have a slot now, taken out with its slot; its id's
    /// pass moves on by 1 / weight.
    fn next_grant(
        &mut self,
        full: &mut Vec<*const InstanceCell>,
        holdings: &HashMap<u64, Holding>,
        now: std::time::Instant,
    ) -> Option<(Waiter, Grant, Place)> {
        // Once per pass, on a variant with headroom only (its waiters share the limits).
        let headroom = self
            .bands
            .values()
            .flat_map(|band| band.flows.values())
            .flat_map(|flow| flow.waiters.front())
            .any(|waiter| waiter.limits.headroom > 0);
        let weights = if headroom {
            self.weights(holdings, None, now)
        } else {
            Weights {
                active: 0.0,
                all_held: 0.0,
            }
        };
        let mut found = None;
        'bands: for (&priority, band) in self.bands.iter_mut() {
            let mut ids: Vec<(f64, u64, u64)> = band
                .flows
                .iter()
                .map(|(id, flow)| (flow.pass, flow.order, *id))
                .collect();
            ids.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
            for (_, _, id) in ids {
                let Some(flow) = band.flows.get_mut(&id) else {
                    continue;
                };
                let place = Place {
                    priority,
                    fairness: id,
                    weight: flow.weight,
                };
                let own_waiting = flow.waiters.len() > 1;
                for at in 0..flow.waiters.len() {
                    let waiter = &flow.waiters[at];
                    let favoured = || {
                        may_use_headroom(
                            place,
                            waiter.limits,
                            (holdings, own_waiting),
                            || weights,
                            now,
                        )
                    };
                    if let Some(grant) = waiter.try_grant(favoured, full) {
                        let waiter = flow.waiters.remove(at).expect("the waiter is there");
                        band.clock = flow.pass;
                        flow.pass += 1.0 / flow.weight;
                        flow.order = band.next_order;
                        band.next_order += 1;
                        if flow.waiters.is_empty() {
                            band.flows.remove(&id);
                        }
                        found = Some((place, waiter, grant));
                        break 'bands;
                    }
                }
            }
        }
        let (place, waiter, grant) = found?;
        self.len -= 1;
        let priority = place.priority;
        if self
            .bands
            .get(&priority)
            .is_some_and(|band| band.flows.is_empty())
        {
            self.bands.remove(&priority);
        }
        Some((waiter, grant, place))
    }
}

impl VariantQueue {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(|poison| poison.into_inner())
    }

    fn count_headroom(&self, grant: &Grant) {
        if grant.headroom {
            self.headroom_grants.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// `grant`, counted at `now` for `place`'s fairness id while the request holds it (on a
    /// variant with headroom: the fair shares are judged from these counts).
    fn hold(
        &self,
        holdings: &mut Held,
        limits: Limits,
        place: Place,
        mut grant: Grant,
        now: std::time::Instant,
    ) -> Grant {
        if limits.headroom == 0 {
            return grant;
        }
        if holdings
            .ids
            .get(&place.fairness)
            .is_some_and(|holding| holding.count == 0)
        {
            holdings.idle = holdings.idle.saturating_sub(1);
        }
        let holding = holdings
            .ids
            .entry(place.fairness)
            .or_insert_with(|| Holding::new(place.weight, now));
        holding.set_count(holding.count + 1, now);
        // The endpoint's weights may have changed since the id began holding.
        holding.weight = place.weight;
        let ticket = HoldTicket {
            holdings: Arc::clone(&self.holdings),
            fairness: place.fairness,
        };
        grant.claim = grant.claim.with_ticket(Box::new(ticket));
        grant
    }

    /// Gives slots to waiting requests, in order, while there are free ones for them.
    fn dispatch(&self) {
        let mut unsent = Vec::new();
        {
            let mut state = self.lock();
            let mut full = Vec::new();
            loop {
                let mut holdings = lock_holdings(&self.holdings);
                let now = std::time::Instant::now();
                let Some((waiter, grant, place)) = state.next_grant(&mut full, &holdings, now)
                else {
                    break;
                };
                let grant = self.hold(&mut holdings, waiter.limits, place, grant, now);
                drop(holdings);
                // A waiter in the queue is still listening (it leaves before it stops);
                // a grant it cannot take is freed outside the lock.
                let headroom = grant.headroom;
                match waiter.reply.send(grant) {
                    Ok(()) if headroom => {
                        self.headroom_grants.fetch_add(1, Ordering::Relaxed);
                    }
                    Ok(()) => {}
                    Err(grant) => unsent.push(grant),
                }
            }
        }
        drop(unsent);
    }

    /// Waits for a slot at one of `candidates` (see the module docs).
    async fn wait(
        self: &Arc<Self>,
        flow: &FlowControl,
        place: Place,
        candidates: Vec<Candidate>,
        limits: Limits,
        since: Instant,
    ) -> Result<Grant, Dropped> {
        let cap = limits.cap;
        let (seq, receiver) = {
            let mut state = self.lock();
            let mut holdings = lock_holdings(&self.holdings);
            let now = std::time::Instant::now();
            // Nobody waits: a free slot is this request's (the common case, no channel).
            let free = if state.len == 0 {
                try_grant(&candidates, cap, &mut Vec::new())
            } else {
                None
            };
            // Past the cap, a request that need not wait behind the others takes the headroom.
            let free = free.or_else(|| {
                let own_waiting = state.bands.get(&place.priority).is_some_and(|band| {
                    band.flows
                        .get(&place.fairness)
                        .is_some_and(|flow| !flow.waiters.is_empty())
                });
                let favoured = may_use_headroom(
                    place,
                    limits,
                    (&holdings, own_waiting),
                    || state.weights(&holdings, Some(place), now),
                    now,
                );
                headroom_grant(&candidates, limits, favoured)
            });
            if let Some(grant) = free {
                self.count_headroom(&grant);
                return Ok(self.hold(&mut holdings, limits, place, grant, now));
            }
            if state.len >= flow.settings.max_queued {
                // A full queue refuses only a request that would wait: a slot free now is one
                // no waiter can use (waiters pinned to a busy instance fill a queue too).
                return try_grant(&candidates, cap, &mut Vec::new())
                    .map(|grant| self.hold(&mut holdings, limits, place, grant, now))
                    .ok_or(Dropped::Overflow);
            }
            drop(holdings);
            let (reply, receiver) = oneshot::channel();
            let seq = state.next_seq;
            state.next_seq += 1;
            state.push(
                place,
                Waiter {
                    seq,
                    since,
                    limits,
                    candidates,
                    reply,
                },
            );
            (seq, receiver)
        };
        let mut waiting = Waiting {
            queue: self,
            place,
            seq,
            receiver,
            settled: false,
        };
        self.dispatch();
        let grace_left = flow.settings.grace / 2;
        let mut deadline = since + flow.settings.timeout;
        let mut draining = flow.shutdown.is_cancelled();
        if draining {
            // Arrived during shutdown: a slot now or a refusal.
            deadline = since;
        }
        loop {
            tokio::select! {
                biased;
                granted = &mut waiting.receiver => {
                    waiting.settled = true;
                    // The sender goes only with a grant or with the queue's entry, which
                    // is only taken out by `Waiting` itself.
                    return granted.map_err(|_| Dropped::Shutdown);
                }
                () = tokio::time::sleep_until(deadline) => {
                    let reason = if draining { Dropped::Shutdown } else { Dropped::Timeout };
                    return waiting.leave(reason);
                }
                () = flow.shutdown.cancelled(), if !draining => {
                    draining = true;
                    deadline = deadline.min(Instant::now() + grace_left);
                }
                () = tokio::time::sleep(RECHECK) => self.recheck(),
            }
        }
    }

    /// A waiting request's periodic look, at most once per [`RECHECK`] for the queue.
    fn recheck(&self) {
        let now_ms = self.epoch.elapsed().as_millis() as u64;
        let last = self.rechecked_ms.load(Ordering::Relaxed);
        if now_ms.saturating_sub(last) >= RECHECK.as_millis() as u64 / 2
            && self
                .rechecked_ms
                .compare_exchange(last, now_ms, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            self.dispatch();
        }
    }
}

impl SlotWaker for VariantQueue {
    fn slot_freed(&self) {
        self.dispatch();
    }
}

/// A request's place in the queue while it waits: dropped (the client went away), it leaves
/// the queue at once.
struct Waiting<'a> {
    queue: &'a Arc<VariantQueue>,
    place: Place,
    seq: u64,
    receiver: oneshot::Receiver<Grant>,
    settled: bool,
}

impl Waiting<'_> {
    /// Leaves the queue for `reason`, unless a slot arrived meanwhile (then it is taken).
    fn leave(&mut self, reason: Dropped) -> Result<Grant, Dropped> {
        self.settled = true;
        let removed = self.queue.lock().remove(self.place, self.seq);
        if removed {
            // One id fewer may make another's share larger (headroom).
            self.queue.dispatch();
        }
        self.receiver.try_recv().map_err(|_| reason)
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        if self.settled {
            return;
        }
        let removed = self.queue.lock().remove(self.place, self.seq);
        if removed {
            self.queue.dropped[Dropped::Disconnect as usize].fetch_add(1, Ordering::Relaxed);
            self.queue.dispatch();
        }
        // A slot granted but not taken goes with the receiver, after the lock.
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(max_queued: usize) -> QueueSettings {
        QueueSettings {
            max_queued,
            timeout: Duration::from_secs(5),
            trust_headers: true,
            grace: Duration::from_secs(2),
        }
    }

    /// A cap of `cap` on one instance, no headroom.
    fn capped(cap: u32) -> Limits {
        Limits { cap, headroom: 0 }
    }

    fn candidates(cells: &[Arc<InstanceCell>]) -> Vec<Candidate> {
        cells
            .iter()
            .enumerate()
            .map(|(position, cell)| Candidate {
                position,
                cell: Arc::clone(cell),
            })
            .collect()
    }

    /// Waits in `queue` at `place` for a slot at `cell` (cap 1), reporting on `served`.
    fn spawn_waiter(
        flow: &Arc<FlowControl>,
        queue: &Arc<VariantQueue>,
        cell: &Arc<InstanceCell>,
        place: Place,
        name: &'static str,
        served: &tokio::sync::mpsc::UnboundedSender<(&'static str, SlotClaim)>,
    ) -> tokio::task::JoinHandle<()> {
        let (flow, queue, cell, served) = (
            Arc::clone(flow),
            Arc::clone(queue),
            Arc::clone(cell),
            served.clone(),
        );
        tokio::spawn(async move {
            let grant = queue
                .wait(&flow, place, candidates(&[cell]), capped(1), Instant::now())
                .await
                .unwrap();
            served.send((name, grant.claim)).unwrap();
        })
    }

    fn registered(queue: &Arc<VariantQueue>) -> Arc<InstanceCell> {
        let cell = Arc::new(InstanceCell::default());
        let waker: Weak<dyn SlotWaker> = Arc::downgrade(queue) as Weak<dyn SlotWaker>;
        let _ = cell.waker.set(waker);
        cell
    }

    /// A place of priority `priority` for the fairness id `fairness`, of weight 1.
    fn place(priority: i32, fairness: u64) -> Place {
        Place {
            priority,
            fairness,
            weight: 1.0,
        }
    }

    /// Waits in `queue` for a slot at `cell` (cap 1) at a place of no priority or id.
    async fn wait_anywhere(
        queue: &Arc<VariantQueue>,
        flow: &FlowControl,
        cell: &Arc<InstanceCell>,
        since: Instant,
    ) -> Result<Grant, Dropped> {
        let candidates = candidates(&[Arc::clone(cell)]);
        queue
            .wait(flow, place(0, 0), candidates, capped(1), since)
            .await
    }

    /// One instance of cap 1 and its queue, its slot held, and the waiters spawned on it,
    /// which report on `order` when served.
    struct Waiting {
        flow: Arc<FlowControl>,
        queue: Arc<VariantQueue>,
        cell: Arc<InstanceCell>,
        held: Option<SlotClaim>,
        served: tokio::sync::mpsc::UnboundedSender<(&'static str, SlotClaim)>,
        order: tokio::sync::mpsc::UnboundedReceiver<(&'static str, SlotClaim)>,
        tasks: Vec<tokio::task::JoinHandle<()>>,
    }

    impl Waiting {
        fn new(max_queued: usize) -> Self {
            let flow = Arc::new(FlowControl::new(
                settings(max_queued),
                CancellationToken::new(),
            ));
            let queue = Arc::new(VariantQueue::default());
            let cell = registered(&queue);
            let held = Some(SlotClaim::take(&cell, 1).unwrap());
            let (served, order) = tokio::sync::mpsc::unbounded_channel();
            Waiting {
                flow,
                queue,
                cell,
                held,
                served,
                order,
                tasks: Vec::new(),
            }
        }

        fn spawn(&mut self, place: Place, name: &'static str) {
            let waiter = spawn_waiter(
                &self.flow,
                &self.queue,
                &self.cell,
                place,
                name,
                &self.served,
            );
            self.tasks.push(waiter);
        }

        /// Lets the held slot go, then takes the next `count` slots served one at a time
        /// (each given back before the next; `check` runs while it is held): the names.
        async fn served(&mut self, count: usize, check: impl Fn()) -> Vec<&'static str> {
            drop(self.held.take());
            let mut seen = Vec::new();
            for _ in 0..count {
                let (name, claim) = self.order.recv().await.unwrap();
                check();
                seen.push(name);
                drop(claim);
            }
            seen
        }

        async fn join(self) {
            for task in self.tasks {
                task.await.unwrap();
            }
        }
    }

    async fn settle() {
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
    }

    /// `active` weight against all that `holdings` held at `now`.
    fn weights(active: f64, holdings: &HashMap<u64, Holding>, now: std::time::Instant) -> Weights {
        Weights {
            active,
            all_held: holdings.values().map(|holding| holding.held_at(now)).sum(),
        }
    }

    /// An id of weight 1 holding `count` slots since `at`.
    fn holding(count: u32, at: std::time::Instant) -> Holding {
        Holding {
            count,
            ..Holding::new(1.0, at)
        }
    }

    /// A moment (`then`), a minute later (`now`), and a cap of 4 with a headroom of 4.
    fn a_minute_later() -> (std::time::Instant, std::time::Instant, Limits) {
        let then = std::time::Instant::now();
        let limits = Limits {
            cap: 4,
            headroom: 4,
        };
        (then, then + Duration::from_secs(60), limits)
    }

    #[test]
    fn the_headroom_goes_by_the_share_of_slot_seconds_held_lately_not_of_slots_held_now() {
        let (then, now, limits) = a_minute_later();
        let since = |secs_ago| now - Duration::from_secs(secs_ago);
        let may = |place, limits, holdings: &HashMap<u64, Holding>, active: f64| {
            may_use_headroom(
                place,
                limits,
                (holdings, false),
                || weights(active, holdings, now),
                now,
            )
        };
        // Both hold 4 slots now: the heavy id (1) for a minute (its capped backlog), the light
        // one (2) for a second (its burst).
        let holdings = HashMap::from([(1, holding(4, then)), (2, holding(4, since(1)))]);
        assert!(may(place(0, 2), limits, &holdings, 2.0));
        assert!(!may(place(0, 1), limits, &holdings, 2.0));
        // An id alone never takes it; an urgent request always may.
        assert!(!may(place(0, 2), limits, &holdings, 1.0));
        assert!(may(place(-1, 1), limits, &holdings, 2.0));
        // Nobody holds a slot through this router (other routers fill the cap): below any share.
        assert!(may(place(0, 1), limits, &HashMap::new(), 2.0));
        // Without headroom, nobody.
        let none = Limits {
            cap: 4,
            headroom: 0,
        };
        assert!(!may(place(-1, 2), none, &holdings, 2.0));
    }

    #[test]
    fn with_answers_longer_than_the_half_life_the_backlogged_id_still_waits() {
        // Answers of a minute: the heavy id (1) took its 6 slots (cap and 2 of headroom) a
        // minute ago and holds them still; the light id (2) took its one just now. Counted
        // by slots taken lately, the heavy id's 6 would weigh 6 / 64 and the light id's 1
        // more: the heavy id would take the headroom. By slot-seconds held, it does not.
        let (then, now, limits) = a_minute_later();
        let holdings = HashMap::from([
            (1, holding(6, then)),
            (2, holding(1, now - Duration::from_secs(5))),
        ]);
        let may = |fairness, holdings: &HashMap<u64, Holding>| {
            may_use_headroom(
                place(0, fairness),
                limits,
                (holdings, false),
                || weights(2.0, holdings, now),
                now,
            )
        };
        assert!(!may(1, &holdings), "the backlogged id waits");
        assert!(may(2, &holdings), "the light id goes");
        // Once the light id held as much for as long, it is no longer below its share.
        let even = HashMap::from([(1, holding(6, then)), (2, holding(6, then))]);
        assert!(!may(1, &even) && !may(2, &even));
        // Two backlogged ids do not take the headroom in turn: one a little below its share
        // (5 slots against 6) may, unless another of its requests waits already.
        let near = HashMap::from([(1, holding(6, then)), (2, holding(5, then))]);
        assert!(may(2, &near));
        let backlogged = may_use_headroom(
            place(0, 2),
            limits,
            (&near, true),
            || weights(2.0, &near, now),
            now,
        );
        assert!(!backlogged, "its own request waits: it waits its turn");
        let urgent = may_use_headroom(
            place(-1, 2),
            limits,
            (&near, true),
            || weights(2.0, &near, now),
            now,
        );
        assert!(urgent, "urgent requests are not held back by their own");
        // Per weight: 6 slots against 2 is above an even share; with a weight of 8 against 1
        // it is below its share (8 / 9).
        let weighted = |weight| {
            HashMap::from([
                (
                    1,
                    Holding {
                        weight,
                        ..holding(6, then)
                    },
                ),
                (2, holding(2, then)),
            ])
        };
        let id_1 = |weight| {
            let holdings = weighted(weight);
            let place = Place {
                priority: 0,
                fairness: 1,
                weight,
            };
            may_use_headroom(
                place,
                limits,
                (&holdings, false),
                || weights(weight + 1.0, &holdings, now),
                now,
            )
        };
        assert!(!id_1(1.0));
        assert!(id_1(8.0));
    }

    #[test]
    fn ids_holding_nothing_do_not_loosen_the_others_shares() {
        let (then, now, limits) = a_minute_later();
        // The heavy id (1) has held 8 slots for a minute, the light one (2) one for a second;
        // ten more held as much as the heavy one and hold nothing now.
        let mut holdings = HashMap::from([
            (1, holding(8, then)),
            (2, holding(1, now - Duration::from_secs(1))),
        ]);
        for id in 10..20 {
            let mut idle = holding(8, then);
            idle.set_count(0, now);
            holdings.insert(id, idle);
        }
        let state = State::default();
        let may = |id| {
            may_use_headroom(
                place(0, id),
                limits,
                (&holdings, false),
                || state.weights(&holdings, Some(place(0, id)), now),
                now,
            )
        };
        assert!(
            !may(1),
            "the heavy id is not below its share for the idle ids' seconds"
        );
        assert!(may(2));
    }

    #[test]
    fn an_id_holding_nothing_is_remembered_while_its_seconds_count_and_within_a_bound() {
        let t0 = std::time::Instant::now();
        let after = |secs| t0 + Duration::from_secs(secs);
        let queue = VariantQueue::default();
        let cell = Arc::new(InstanceCell::default());
        let limits = Limits {
            cap: 1000,
            headroom: 1,
        };
        let mut held = Held::default();
        // Takes a slot for `id` at `at` and lets it go at `until`.
        let hold_for = |held: &mut Held, id: u64, at, until| {
            let grant = Grant {
                position: 0,
                claim: SlotClaim::take(&cell, 1000).unwrap(),
                headroom: false,
            };
            let grant = queue.hold(held, limits, place(0, id), grant, at);
            // The ticket would lock the queue's own holdings: these are the test's.
            std::mem::forget(grant);
            release(held, id, until);
        };
        // One slot for 20 s, let go: remembered, holding nothing, its seconds fading.
        hold_for(&mut held, 1, t0, after(20));
        assert_eq!((held[&1].count, held.idle), (0, 1));
        let seconds = held[&1].held_at(after(20));
        assert!((seconds - mean_life() * 0.75).abs() < 1e-9);
        // Neither its weight nor its seconds weigh in the others' shares; back (here as the
        // request asking), its seconds count for it.
        let state = State::default();
        let idle = state.weights(&held, None, after(20));
        assert_eq!((idle.active, idle.all_held), (0.0, 0.0));
        let back = state.weights(&held, Some(place(0, 1)), after(20));
        assert_eq!(back.active, 1.0);
        assert!((back.all_held - seconds).abs() < 1e-9);
        // Holding again, it is no longer idle; a second release counts it idle once.
        hold_for(&mut held, 1, after(20), after(21));
        assert_eq!(held.idle, 1);
        release(&mut held, 1, after(21));
        release(&mut held, 999, after(21));
        assert_eq!(
            (held.len(), held.idle),
            (1, 1),
            "releasing nothing changes nothing"
        );
        // An id whose seconds faded below a hundredth of a slot's by its release is forgotten
        // at once.
        let mut faded = Holding::new(1.0, t0);
        faded.count = 1;
        held.ids.insert(2, faded);
        release(&mut held, 2, t0 + Duration::from_millis(1));
        assert!(!held.contains_key(&2));
        // Past MOST_IDLE_IDS idle ids: the faded go (id 1, by 300 s), then those that held
        // least, down to half.
        for id in 10..10 + MOST_IDLE_IDS as u64 {
            // Id 10 held 1 s, id 11 2 s, …: the longest ones are kept.
            hold_for(&mut held, id, after(300 - (id - 9)), after(300));
        }
        assert!(!held.contains_key(&1), "faded: forgotten");
        assert_eq!(held.idle, MOST_IDLE_IDS / 2);
        assert_eq!(held.len(), MOST_IDLE_IDS / 2);
        let kept = (10..10 + MOST_IDLE_IDS as u64).filter(|id| held.contains_key(id));
        assert!(kept.eq(10 + MOST_IDLE_IDS as u64 / 2..10 + MOST_IDLE_IDS as u64));
    }

    #[test]
    fn a_holding_adds_up_the_slot_seconds_and_fades_the_past() {
        let queue = Arc::new(VariantQueue::default());
        let cell = registered(&queue);
        let limits = Limits {
            cap: 8,
            headroom: 1,
        };
        let t0 = std::time::Instant::now();
        let after = |secs| t0 + Duration::from_secs(secs);
        let grant = || Grant {
            position: 0,
            claim: SlotClaim::take(&cell, 8).unwrap(),
            headroom: false,
        };
        let close = |a: f64, b: f64| (a - b).abs() < 1e-9 * b.max(1.0);
        // The slots, declared before the lock: a failed assert lets the lock go before the
        // tickets (a ticket locks the holdings when it is dropped).
        let mut slots = Vec::new();
        let mut holdings = lock_holdings(&queue.holdings);
        slots.push(queue.hold(&mut holdings, limits, place(0, 1), grant(), t0));
        assert_eq!((holdings[&1].count, holdings[&1].held), (1, 0.0));
        // One slot for a half-life: half of all it could ever count for.
        assert!(close(holdings[&1].held_at(after(10)), mean_life() / 2.0));
        // A second slot at 10 s: the first's seconds are kept as of then.
        slots.push(queue.hold(&mut holdings, limits, place(0, 1), grant(), after(10)));
        assert_eq!(holdings[&1].count, 2);
        assert!(close(holdings[&1].held, mean_life() / 2.0));
        assert_eq!(holdings[&1].at, after(10));
        // 10 s on: the past halved, plus two slots for a half-life.
        assert!(close(
            holdings[&1].held_at(after(20)),
            mean_life() / 4.0 + mean_life()
        ));
        // Another id starts from nothing; a variant without headroom keeps no count.
        slots.push(queue.hold(&mut holdings, limits, place(0, 2), grant(), after(10)));
        assert_eq!(holdings[&2].held, 0.0);
        slots.push(queue.hold(&mut holdings, capped(8), place(0, 3), grant(), after(10)));
        assert!(!holdings.contains_key(&3));
        // A slot let go at 20 s: the seconds until then are kept, one slot counts on.
        let mut copy = (*holdings).clone();
        release(&mut copy, 1, after(20));
        assert_eq!(copy[&1].count, 1);
        assert!(close(copy[&1].held, mean_life() / 4.0 + mean_life()));
        assert!(close(
            copy[&1].held_at(after(30)),
            (mean_life() / 4.0 + mean_life()) / 2.0 + mean_life() / 2.0
        ));
        release(&mut copy, 1, after(30));
        assert_eq!(copy[&1].count, 0, "holding none: its seconds still count");
        // Each slot's ticket counts its id down when it ends.
        drop(holdings);
        drop(slots.remove(0));
        assert_eq!(lock_holdings(&queue.holdings)[&1].count, 1);
        drop(slots);
        assert!(
            lock_holdings(&queue.holdings)
                .values()
                .all(|holding| holding.count == 0)
        );
        assert_eq!(cell.fleet_load(), 0);
    }

    #[tokio::test]
    async fn the_headroom_goes_to_urgent_requests_and_to_ids_below_their_share() {
        let flow = Arc::new(FlowControl::new(settings(100), CancellationToken::new()));
        let queue = Arc::new(VariantQueue::default());
        let cell = registered(&queue);
        // Cap 1 and headroom 1 on one instance.
        let limits = Limits {
            cap: 1,
            headroom: 1,
        };
        let ask = |place: Place| {
            let (flow, queue, cell) = (Arc::clone(&flow), Arc::clone(&queue), Arc::clone(&cell));
            tokio::spawn(async move {
                queue
                    .wait(&flow, place, candidates(&[cell]), limits, Instant::now())
                    .await
                    .unwrap()
            })
        };
        // The heavy id (1) takes the capped slot, and its next request waits: it took every
        // slot so far.
        let heavy = ask(place(0, 1)).await.unwrap();
        assert!(!heavy.headroom);
        let heavy_next = ask(place(0, 1));
        settle().await;
        assert_eq!(queue.lock().len, 1);
        // The light id (2) took none of the slots: it takes the headroom at once.
        let light = ask(place(0, 2)).await.unwrap();
        assert!(light.headroom);
        assert_eq!(cell.fleet_load(), 2);
        // Cap + headroom reached: an urgent request waits, and goes first when a slot frees,
        // within the headroom, before the heavy id's request.
        let urgent = ask(place(-1, 3));
        settle().await;
        assert_eq!(queue.lock().len, 2);
        drop(light);
        let urgent = urgent.await.unwrap();
        assert!(urgent.headroom);
        assert!(
            !heavy_next.is_finished(),
            "the heavy id still waits for the cap"
        );
        assert_eq!(queue.headroom_grants.load(Ordering::Relaxed), 2);
        // The urgent one done, the heavy id still holds its share: it waits for the cap.
        drop(urgent);
        settle().await;
        assert!(!heavy_next.is_finished());
        // Below the cap again, the heavy id's request goes.
        drop(heavy);
        let next = heavy_next.await.unwrap();
        assert!(!next.headroom);
        drop(next);
        assert!(
            lock_holdings(&queue.holdings).is_empty(),
            "no id is remembered"
        );
    }

    #[tokio::test]
    async fn slots_go_by_priority_then_in_turn_across_ids_then_in_arrival_order() {
        let mut waiting = Waiting::new(100);
        for (name, priority, fairness) in [
            ("a1", 0, 1),
            ("a2", 0, 1),
            ("a3", 0, 1),
            ("b1", 0, 2),
            ("b2", 0, 2),
            ("urgent", -1, 3),
        ] {
            waiting.spawn(place(priority, fairness), name);
            settle().await;
        }
        assert_eq!(waiting.queue.lock().len, 6);
        let cell = Arc::clone(&waiting.cell);
        let seen = waiting
            .served(6, || {
                assert_eq!(cell.local.load(Ordering::Relaxed), 1, "one at a time");
            })
            .await;
        assert_eq!(seen, ["urgent", "a1", "b1", "a2", "b2", "a3"]);
        assert_eq!(cell.local.load(Ordering::Relaxed), 0);
        waiting.join().await;
    }

    #[tokio::test]
    async fn ids_take_turns_in_proportion_to_their_weights() {
        let mut waiting = Waiting::new(100);
        for (name, fairness, weight) in [("gold", 1, 3.0), ("plain", 2, 1.0)] {
            for _ in 0..20 {
                let place = Place {
                    priority: 0,
                    fairness,
                    weight,
                };
                waiting.spawn(place, name);
            }
            settle().await;
        }
        assert_eq!(waiting.queue.lock().len, 40);
        let seen = waiting.served(40, || {}).await;
        // While both wait (the first 20 served), gold has three turns for each of plain's.
        let gold = seen[..20].iter().filter(|name| **name == "gold").count();
        assert_eq!(gold, 15, "{seen:?}");
        waiting.join().await;
    }

    #[tokio::test]
    async fn overflow_is_refused_and_a_dropped_waiter_leaves_at_once() {
        let flow = Arc::new(FlowControl::new(settings(1), CancellationToken::new()));
        let queue = Arc::new(VariantQueue::default());
        let cell = registered(&queue);
        let _held = SlotClaim::take(&cell, 1).unwrap();
        let (served, _order) = tokio::sync::mpsc::unbounded_channel();
        let waiter = spawn_waiter(&flow, &queue, &cell, place(0, 0), "w", &served);
        settle().await;
        let second = wait_anywhere(&queue, &flow, &cell, Instant::now()).await;
        assert_eq!(second.unwrap_err(), Dropped::Overflow);
        waiter.abort();
        let _ = waiter.await;
        assert_eq!(queue.lock().len, 0);
        assert_eq!(
            queue.dropped[Dropped::Disconnect as usize].load(Ordering::Relaxed),
            1
        );
    }

    #[tokio::test]
    async fn a_wait_ends_at_the_timeout_and_sooner_after_shutdown() {
        let shutdown = CancellationToken::new();
        let flow = FlowControl::new(
            QueueSettings {
                timeout: Duration::from_millis(300),
                ..settings(10)
            },
            shutdown.clone(),
        );
        let queue = Arc::new(VariantQueue::default());
        let cell = registered(&queue);
        let _held = SlotClaim::take(&cell, 1).unwrap();
        let started = Instant::now();
        let timed_out = wait_anywhere(&queue, &flow, &cell, started).await;
        assert_eq!(timed_out.unwrap_err(), Dropped::Timeout);
        assert!(started.elapsed() >= Duration::from_millis(300));
        // After the signal a waiting request keeps its place for half the grace period
        // (1 s), well before its own timeout (60 s).
        let flow = FlowControl::new(
            QueueSettings {
                timeout: Duration::from_secs(60),
                ..settings(10)
            },
            shutdown.clone(),
        );
        let cancel = shutdown.clone();
        tokio::spawn(async move {
            tokio::task::yield_now().await;
            cancel.cancel();
        });
        let started = Instant::now();
        let shut = wait_anywhere(&queue, &flow, &cell, started).await;
        assert_eq!(shut.unwrap_err(), Dropped::Shutdown);
        let waited = started.elapsed();
        assert!(
            waited >= Duration::from_secs(1) && waited < Duration::from_secs(30),
            "{waited:?}"
        );
        assert_eq!(queue.lock().len, 0);
        // Arriving during shutdown: a slot now, or a refusal at once.
        let refused = wait_anywhere(&queue, &flow, &cell, Instant::now()).await;
        assert_eq!(refused.unwrap_err(), Dropped::Shutdown);
    }
}
