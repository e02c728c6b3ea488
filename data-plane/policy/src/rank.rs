//! Instance selection. A policy is a function of (instances, their loads, the request key, a
//! random draw) that returns candidates in preference order and why the first was chosen. It
//! has no side effects: the caller counts load, retries on the next candidate, and records
//! metrics.

/// One routable instance as the policy sees it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct InstanceView {
    /// `hash::instance_hash(id)`, computed once per membership change.
    pub id_hash: u64,
    /// Relative weight (> 0).
    pub weight: f64,
    /// False while the router has ejected it locally after repeated failures: it is tried
    /// only after every available instance.
    pub available: bool,
}

impl InstanceView {
    /// An available instance with this id and weight.
    pub fn new(instance_id: &str, weight: f64) -> Self {
        Self {
            id_hash: crate::hash::instance_hash(instance_id),
            weight,
            available: true,
        }
    }
}

/// The strategy of a variant, with its parameters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Strategy {
    Random,
    LeastOutstandingRequests,
    /// `balance: None` is SageMaker's PREFIX_AWARE exactly; `Some` is Switchyard's
    /// bounded-load extension (see [`LoadBalance`]).
    PrefixAware {
        concurrency_threshold: u32,
        balance: Option<LoadBalance>,
    },
    /// Needs the request's matched blocks per instance: [`crate::kv::rank_kv`]. [`rank`]
    /// alone (no KV data) ranks it as `LeastOutstandingRequests`.
    KvAware {
        concurrency_threshold: u32,
        load_weight: f64,
    },
}

/// Consistent hashing with bounded loads (Mirrokni, Thorup and Zadimoghaddam, 2018) for
/// PREFIX_AWARE: an instance takes a key only while it has fewer than [`LoadBalance::bound`]
/// requests in flight fleet-wide, a bound that follows the variant's mean load, so a hot
/// prefix spills before its owner drowns while another instance idles. A key goes to the
/// least loaded of its holders below the bound (the instances it was sent to lately, which
/// hold a copy), else to a new copy on a lightly loaded instance below the bound: see
/// [`rank_remembering`].
///
/// Every router computes the same bound from the same fleet-wide loads. Each places and
/// reuses copies from what it sent itself and what the other routers announced through the
/// control plane, so routers agree on a key's holders once the announcements have arrived
/// (within a load report interval); until then two routers may each place a new key once.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LoadBalance {
    /// `c ≥ 1`: how far above the mean load an instance may go.
    pub factor: f64,
    /// `s`: requests an instance may always take beyond `c ×` the mean, so a lightly loaded
    /// fleet does not spill at all (a miss costs a whole prefill; one more request in a
    /// continuous batch costs little).
    pub slack: u32,
}

impl LoadBalance {
    /// `⌈factor × (total_load + 1) / instances⌉ + slack`: the in-flight count at which an
    /// instance stops taking keys it does not come first for. `total_load` is the variant's
    /// fleet-wide in-flight total, `+ 1` the request being placed; `instances` counts every
    /// instance of the variant in the routing table (those the control plane reports
    /// routable, whatever this router ejected locally, so that every router divides by the
    /// same number).
    pub fn bound(&self, total_load: u64, instances: usize) -> u32 {
        let mean_with_this_one = (total_load as f64 + 1.0) / instances.max(1) as f64;
        let bound = (self.factor * mean_with_this_one).ceil();
        // Saturating float-to-int conversion; the threshold caps the result anyway.
        (bound as u32).saturating_add(self.slack)
    }
}

/// The in-flight count below which an instance takes a PREFIX_AWARE key: the
/// ConcurrencyThreshold (SageMaker's meaning), or with a [`LoadBalance`] the smaller of the
/// threshold and the bounded-load bound. `loads` are the variant's fleet-wide counts.
pub fn prefix_aware_bound(
    concurrency_threshold: u32,
    balance: Option<LoadBalance>,
    loads: &[u32],
) -> u32 {
    match balance {
        None => concurrency_threshold,
        Some(balance) => {
            let total: u64 = loads.iter().map(|&load| u64::from(load)).sum();
            concurrency_threshold.min(balance.bound(total, loads.len()))
        }
    }
}

/// Why the first candidate was chosen (`x-switchyard-route`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Route {
    /// The prefix's first choice in rendezvous order.
    Prefix,
    /// A later choice: the earlier ones are at the concurrency threshold or ejected.
    Overflow,
    Random,
    LeastOutstanding,
    /// Sticky session.
    Session,
    /// KV_AWARE: the instance holds the start of the prompt in its KV cache.
    Kv,
    /// A stored response's follow-up, retrieval or deletion: the instance that holds it.
    Response,
}

impl Route {
    pub const ALL: [Route; 7] = [
        Route::Prefix,
        Route::Overflow,
        Route::Random,
        Route::LeastOutstanding,
        Route::Session,
        Route::Kv,
        Route::Response,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Route::Prefix => "prefix",
            Route::Overflow => "overflow",
            Route::Random => "random",
            Route::LeastOutstanding => "least-outstanding",
            Route::Session => "session",
            Route::Kv => "kv",
            Route::Response => "response",
        }
    }
}

/// The outcome: instance indices in preference order (every instance appears once, except
/// under [`affinity`], where the one instance that holds the request's state is the only
/// candidate).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Ranking {
    pub order: Vec<usize>,
    pub route: Option<Route>,
}

impl Ranking {
    pub fn first(&self) -> Option<usize> {
        self.order.first().copied()
    }
}

/// Indices sorted by rendezvous score for `key`, best first; unavailable ones last. Returns the
/// top choice ignoring availability (the instance that owns the key).
pub fn rendezvous_order(
    instances: &[InstanceView],
    key: u64,
    order: &mut Vec<usize>,
) -> Option<usize> {
    let mut scored: Vec<(bool, f64, usize)> = instances
        .iter()
        .enumerate()
        .map(|(index, instance)| {
            (
                instance.available,
                crate::hash::rendezvous_score(key, instance.id_hash, instance.weight),
                index,
            )
        })
        .collect();
    let owner = scored
        .iter()
        .max_by(|a, b| a.1.total_cmp(&b.1).then(b.2.cmp(&a.2)))
        .map(|(_, _, index)| *index);
    // Available first, then higher score; ties (never in practice) by index for determinism.
    scored.sort_by(|a, b| b.0.cmp(&a.0).then(b.1.total_cmp(&a.1)).then(a.2.cmp(&b.2)));
    order.clear();
    order.extend(scored.into_iter().map(|(_, _, index)| index));
    owner
}

/// Selects for one request.
///
/// - `PrefixAware` (SageMaker's, no [`LoadBalance`]): rendezvous order of `key`; the first
///   available instance whose fleet-wide load is below the ConcurrencyThreshold comes first
///   (`Prefix` if it is the top choice, else `Overflow`). If all are at the threshold, the
///   least loaded comes first (ties by rank). The rest follow in rendezvous order, so retries
///   also go where every router would send them. With a [`LoadBalance`]: see
///   [`rank_remembering`] (here with no key remembered anywhere).
/// - `LeastOutstandingRequests` (and `KvAware` without KV data): fewest in flight; ties broken
///   by `random`.
/// - `Random`: weighted by instance weight, using `random`.
///
/// `key` is ignored except by `PrefixAware`; `load(i)` is instance i's fleet-wide in-flight count.
pub fn rank(
    strategy: Strategy,
    instances: &[InstanceView],
    load: impl Fn(usize) -> u32,
    key: u64,
    random: u64,
) -> Ranking {
    rank_remembering(strategy, instances, load, key, random, KeyHistory::none())
}

/// What a router knows of one PREFIX_AWARE key beyond its hash, and of where it sent requests
/// lately ([`rank_remembering`]).
#[derive(Debug, Clone, Copy)]
pub struct KeyHistory<R, S, C> {
    /// `remembered(i)`: the key was sent to instance i lately (by this router, or by another
    /// that announced it).
    pub remembered: R,
    /// `sent(i)`: how many of the variant's recent requests the router sent to instance i.
    pub sent: S,
    /// `copies(i)`: how many new copies of keys were placed on instance i lately (each a
    /// miss of a whole prefix).
    pub copies: C,
    /// Whether a further copy (of a key another instance held) was placed lately, by this
    /// router or by another as announced: then no key is relieved ([`RELIEF_SHARE`]).
    pub further_lately: bool,
}

impl KeyHistory<fn(usize) -> bool, fn(usize) -> u32, fn(usize) -> u32> {
    /// A key seen for the first time, by a router that has sent nothing yet.
    pub fn none() -> Self {
        fn nowhere(_: usize) -> bool {
            false
        }
        fn nothing(_: usize) -> u32 {
            0
        }
        Self {
            remembered: nowhere,
            sent: nothing,
            copies: nothing,
            further_lately: false,
        }
    }
}

/// [`rank`], with what this router remembers of where `key` was sent lately:
/// `remembered(i)` is true if this router sent `key` to instance i, or another router
/// announced that it did (through the control plane), so i likely holds a copy of the prefix
/// in its KV cache. Only PREFIX_AWARE with a [`LoadBalance`] reads it. The key's *holders* are
/// the remembered instances, or its rendezvous owner if it was sent nowhere yet:
///
/// 1. a key sent somewhere: the least loaded of its holders that is available and below the
///    bound ([`prefix_aware_bound`]); ties go to the earlier in the key's rendezvous order.
///    Unless every available holder took [`RELIEF_SHARE`] fair shares or more of this
///    router's recent requests and no further copy was placed lately (`further_lately`):
///    then the key is *relieved*, a further copy on the most starving instance within one
///    request of the least loaded (see [`RELIEF_SHARE`]);
/// 2. else a new copy, in the band of available instances below the bound as loaded as the
///    least loaded of them (a first copy; an instance below [`REACH_SHARE`] of its fair share
///    also one request above it) or within one request of it (a further copy). A key
///    sent nowhere yet goes to the most starving one
///    (`sent` below [`STARVING_SHARE`] of its fair share of this router's recent requests),
///    then the one with the fewest new copies placed lately (`copies`), then its owner, then
///    the one this router sent the fewest recent requests (`sent`): a first copy is a miss of
///    the whole prefix wherever it goes, a long prefill that stalls whatever the engine
///    batches with it, and spreading those prefills evenly (and giving them to an engine that
///    serves little) matters more than where the key's owner is; a full prefill is best
///    started where least is running. A further copy (the key's holders
///    are all at the bound) adds capacity for a hot key: the fewest requests sent, then the
///    fewest copies. Both per unit of weight, then the least loaded, then by rendezvous order.
///    The band keeps an instance that served little (one that just joined) from drawing
///    every new copy once it is two requests busier than the least loaded (one, for a
///    further copy);
/// 3. else the least loaded available instance.
///
/// `Prefix` if the choice is the owner, else `Overflow`. With a [`LoadBalance`] the rest follow
/// with the key's holders first (retries try a copy before making one), each group in
/// rendezvous order; unavailable instances last. Routers that remember the same placements,
/// count alike and see the same loads choose alike; routers that have not learned of each
/// other's placements yet may each place a new key once.
pub fn rank_remembering(
    strategy: Strategy,
    instances: &[InstanceView],
    load: impl Fn(usize) -> u32,
    key: u64,
    random: u64,
    KeyHistory {
        remembered,
        sent,
        copies,
        further_lately,
    }: KeyHistory<impl Fn(usize) -> bool, impl Fn(usize) -> u32, impl Fn(usize) -> u32>,
) -> Ranking {
    let mut order = Vec::with_capacity(instances.len());
    if instances.is_empty() {
        return Ranking { order, route: None };
    }
    // Loads are read once: live counters change while we look, and a sort needs a
    // consistent order.
    let loads: Vec<u32> = (0..instances.len()).map(load).collect();
    let load = |index: usize| loads[index];
    // So are the requests sent (a window's end halves them meanwhile), when they are read.
    let sent_counts: Vec<u32> = match strategy {
        Strategy::PrefixAware {
            balance: Some(_), ..
        } => (0..instances.len()).map(&sent).collect(),
        _ => Vec::new(),
    };
    let sent = |index: usize| sent_counts[index];
    let route = match strategy {
        Strategy::PrefixAware {
            concurrency_threshold,
            balance,
        } => {
            let bound = prefix_aware_bound(concurrency_threshold, balance, &loads);
            let owner = rendezvous_order(instances, key, &mut order);
            let eligible = |index: usize| instances[index].available && load(index) < bound;
            // Which instances hold the key, read once (the memory changes under concurrent
            // requests, and the retry sort below needs keys that stay put): those the key was
            // sent to lately (by this router, or by another that announced it), or, for a key
            // sent nowhere yet, its owner.
            let remembered: Vec<bool> = match balance {
                None => Vec::new(),
                Some(_) => (0..instances.len()).map(&remembered).collect(),
            };
            let placed = remembered.iter().any(|&held| held);
            let holder: Vec<bool> = if placed {
                remembered
            } else {
                (0..remembered.len())
                    .map(|index| Some(index) == owner)
                    .collect()
            };
            let below = match balance {
                None => order.iter().position(|&index| eligible(index)),
                Some(_) => {
                    let order = &order;
                    // A placed key: the least loaded holder below the bound; ties by position
                    // (rendezvous order).
                    let held = (0..order.len())
                        .filter(|&position| {
                            placed && eligible(order[position]) && holder[order[position]]
                        })
                        .min_by_key(|&position| (load(order[position]), position));
                    // Relief of a key whose holders all took far more than their share.
                    let relief = held
                        .filter(|_| !further_lately)
                        .and_then(|_| relief(instances, order, &holder, eligible, load, &sent));
                    relief.or(held).or_else(|| {
                        // Else a new copy below the bound: a first copy on a least loaded
                        // instance, a further copy within one request of it. A key's first copy: the most starving
                        // one, then the one with the fewest copies placed lately, then the
                        // owner, then the fewest requests this router sent it lately. A further
                        // copy (its holders are at the
                        // bound): the fewest requests sent, then the fewest copies. Counts per
                        // unit of weight (a heavier instance takes more), then the least
                        // loaded, then by position.
                        let floor = order
                            .iter()
                            .filter(|&&i| eligible(i))
                            .map(|&i| load(i))
                            .min()?;
                        // A first copy on a least loaded instance (a full prefill is best
                        // started where least is running), or one request above it for an
                        // instance far below its share; a further copy within one request of
                        // it.
                        let band = u32::from(placed);
                        let starving = if placed {
                            Vec::new()
                        } else {
                            starving(instances, &sent)
                        };
                        (0..order.len())
                            .filter(|&position| {
                                let index = order[position];
                                // A first copy reaches an instance far below its share one
                                // request above the least loaded.
                                let reach = if !placed && starving[index] < REACH_SHARE {
                                    1
                                } else {
                                    band
                                };
                                eligible(index) && load(index) <= floor + reach
                            })
                            .map(|position| {
                                let index = order[position];
                                let weight = instances[index].weight.max(f64::MIN_POSITIVE);
                                let per_weight = |count: u32| f64::from(count) / weight;
                                let (copies, sent) =
                                    (per_weight(copies(index)), per_weight(sent(index)));
                                let order = if placed {
                                    [sent, copies, 0.0, 0.0]
                                } else {
                                    // The most starving instance first (a first copy is
                                    // a miss wherever it goes). Starving is judged on this
                                    // router's own `sent`, so two routers that place the
                                    // same new key before either announced it may choose
                                    // differently (the cost: one more prefill of it). The
                                    // owner before fewer requests sent, for the same reason:
                                    // routers that agree on the copies agree on the owner.
                                    let fed = starving[index];
                                    let other = f64::from(u8::from(Some(index) != owner));
                                    [fed, copies, other, sent]
                                };
                                (order, load(index), position)
                            })
                            .min_by(|a, b| {
                                let by_counts = a.0.iter().zip(&b.0).map(|(x, y)| x.total_cmp(y));
                                by_counts
                                    .fold(std::cmp::Ordering::Equal, std::cmp::Ordering::then)
                                    .then((a.1, a.2).cmp(&(b.1, b.2)))
                            })
                            .map(|(_, _, position)| position)
                    })
                }
            };
            let chosen = match below {
                Some(position) => position,
                None => {
                    // Everyone is at the bound: least loaded available, earliest rank wins ties.
                    let available = order
                        .iter()
                        .take_while(|&&index| instances[index].available)
                        .count()
                        .max(1);
                    (0..available)
                        .min_by_key(|&position| (load(order[position]), position))
                        .unwrap_or(0)
                }
            };
            let index = order.remove(chosen);
            order.insert(0, index);
            if balance.is_some() {
                // Retries try the key's other holders (the owner, then the copies) before
                // instances that would need a new copy; unavailable ones stay last.
                order[1..].sort_by_key(|&index| (!instances[index].available, !holder[index]));
            }
            if Some(index) == owner {
                Route::Prefix
            } else {
                Route::Overflow
            }
        }
        Strategy::LeastOutstandingRequests | Strategy::KvAware { .. } => {
            order.extend(0..instances.len());
            // Sort by (unavailable, load, a per-request random tiebreak).
            let tiebreak = |index: usize| crate::hash::rendezvous_draw(random, index as u64);
            order.sort_by(|&a, &b| {
                instances[b]
                    .available
                    .cmp(&instances[a].available)
                    .then(load(a).cmp(&load(b)))
                    .then(tiebreak(a).total_cmp(&tiebreak(b)))
            });
            Route::LeastOutstanding
        }
        Strategy::Random => {
            weighted_shuffle(instances, random, &mut order);
            Route::Random
        }
    };
    Ranking {
        order,
        route: Some(route),
    }
}

/// Recent requests an instance may fall short of before it counts as starving: below this
/// share of its fair share (by weight) of the requests this router sent the variant lately.
/// 1: any instance below its fair share (measured, docs/benchmarks.md section 7: at 0.5 an
/// instance holding only cold prefixes stayed below half a fair share on some seeds; at 1 the
/// hit rate is the same, since a first copy is a miss wherever it goes).
pub const STARVING_SHARE: f64 = 1.0;
/// Recent requests per instance, on average, before starvation is judged at all (fewer say
/// little: a fleet that just started has sent each instance a handful).
pub const STARVING_AFTER: u32 = 4;

/// How starving each instance is: its share of the requests this router sent the variant
/// lately over its fair share (by weight, among the available instances), where that is below
/// [`STARVING_SHARE`], once those requests average [`STARVING_AFTER`] an available instance;
/// [`STARVING_SHARE`] for the others (and for all before), so they tie. Only eligible
/// instances are read.
fn starving(instances: &[InstanceView], sent: &impl Fn(usize) -> u32) -> Vec<f64> {
    match shares(instances, sent, STARVING_AFTER) {
        Some(share) => (0..instances.len())
            .map(|index| share(index).min(STARVING_SHARE))
            .collect(),
        None => vec![STARVING_SHARE; instances.len()],
    }
}

/// Each instance's share of the requests this router sent the variant lately over its fair
/// share (by weight, among the available instances), once those requests average `after` an
/// available instance; `None` before.
fn shares<'a>(
    instances: &'a [InstanceView],
    sent: &'a impl Fn(usize) -> u32,
    after: u32,
) -> Option<impl Fn(usize) -> f64 + 'a> {
    let available = || (0..instances.len()).filter(|&index| instances[index].available);
    let total: f64 = available().map(|index| f64::from(sent(index))).sum();
    let weights: f64 = available().map(|index| instances[index].weight).sum();
    let judged = total >= f64::from(after) * available().count() as f64 && weights > 0.0;
    judged.then_some(move |index: usize| {
        f64::from(sent(index)) / (total * instances[index].weight / weights)
    })
}

/// A placed key whose every available holder took at least this many fair shares of the
/// requests this router sent lately is *relieved*: one request of it goes to the most starving
/// instance instead (a further copy: one miss of the whole prefix, so that an instance left
/// with only cold keys takes part of a hot one), unless a further copy was placed lately
/// (`KeyHistory::further_lately`; the router keeps that for one to two windows of its
/// requests). 1.75: on a Zipf workload the hottest key alone is about 1.85 fair shares of
/// seven instances (docs/benchmarks.md section 7). The first key whose holders are that busy
/// is relieved, which need not be the hottest one there.
pub const RELIEF_SHARE: f64 = 1.75;
/// Recent requests per available instance, on average, before relief is judged at all. The
/// router halves its counts every 1,024 requests, so on a variant of more than about 250
/// instances relief is never judged (nor starving above about 500).
pub const RELIEF_AFTER: u32 = 8;
/// A key's first copy goes to a least loaded instance, or to one a request above it that took
/// less than this share of its fair share lately (starving judged as for [`STARVING_SHARE`]).
pub const REACH_SHARE: f64 = 0.75;

/// The position in `order` of the instance that relieves a key held by `holder`
/// ([`RELIEF_SHARE`]): of the eligible instances that do not hold it, within one request of the
/// least loaded eligible one and below their fair share, the most starving, then the least
/// loaded, then the earliest in the key's order. `None` if the key needs no relief or no one
/// can take it.
fn relief(
    instances: &[InstanceView],
    order: &[usize],
    holder: &[bool],
    eligible: impl Fn(usize) -> bool,
    load: impl Fn(usize) -> u32,
    sent: &impl Fn(usize) -> u32,
) -> Option<usize> {
    let share = shares(instances, sent, RELIEF_AFTER)?;
    let overloaded = (0..instances.len())
        .filter(|&index| holder[index] && instances[index].available)
        .all(|index| share(index) >= RELIEF_SHARE);
    if !overloaded {
        return None;
    }
    let floor = order
        .iter()
        .filter(|&&index| eligible(index))
        .map(|&index| load(index))
        .min()?;
    (0..order.len())
        .filter(|&position| {
            let index = order[position];
            eligible(index)
                && !holder[index]
                && load(index) <= floor + 1
                && share(index) < STARVING_SHARE
        })
        .min_by(|&a, &b| {
            let (a_index, b_index) = (order[a], order[b]);
            share(a_index)
                .total_cmp(&share(b_index))
                .then((load(a_index), a).cmp(&(load(b_index), b)))
        })
}

/// Sticky sessions: the session's rendezvous order, whatever the load.
pub fn session(instances: &[InstanceView], session_key: u64) -> Ranking {
    let mut order = Vec::with_capacity(instances.len());
    let _owner = rendezvous_order(instances, session_key, &mut order);
    Ranking {
        order,
        route: (!instances.is_empty()).then_some(Route::Session),
    }
}

/// Response affinity: a request about a stored response (a Responses API follow-up, a
/// retrieval, a deletion) can only be served by the instance `holder` that stores it, so it is
/// the only candidate, whatever its load (the ConcurrencyThreshold does not apply) or its
/// local ejection: another instance would answer "not found".
pub fn affinity(holder: usize) -> Ranking {
    Ranking {
        order: vec![holder],
        route: Some(Route::Response),
    }
}

/// A weighted random order (Efraimidis-Spirakis keys: u^(1/w), largest first), so the first
/// element is drawn with probability weight / Σweight. Unavailable instances go last.
fn weighted_shuffle(instances: &[InstanceView], random: u64, order: &mut Vec<usize>) {
    let mut keyed: Vec<(bool, f64, usize)> = instances
        .iter()
        .enumerate()
        .map(|(index, instance)| {
            let draw = crate::hash::rendezvous_draw(random, index as u64);
            (instance.available, draw.ln() / instance.weight, index)
        })
        .collect();
    keyed.sort_by(|a, b| b.0.cmp(&a.0).then(b.1.total_cmp(&a.1)));
    order.clear();
    order.extend(keyed.into_iter().map(|(_, _, index)| index));
}

/// Chooses a variant by weight among those that can serve (`servable[i]`); `None` if none can.
pub fn choose_variant(weights: &[f64], servable: &[bool], random: u64) -> Option<usize> {
    let total: f64 = weights
        .iter()
        .zip(servable)
        .filter(|(_, servable)| **servable)
        .map(|(weight, _)| *weight)
        .sum();
    if total <= 0.0 {
        // Only zero-weight variants can serve: SageMaker sends nothing to weight 0, but an
        // explicit target header still can; here the first servable one takes it.
        return servable.iter().position(|servable| *servable);
    }
    variant_at(
        weights,
        servable,
        crate::hash::rendezvous_draw(random, u64::MAX) * total,
    )
}

/// The variant whose share holds `point`: servable variants of weight w > 0 own consecutive
/// intervals [start, start + w) from 0 in index order. A point at or past the end (rounding)
/// goes to the last of them.
fn variant_at(weights: &[f64], servable: &[bool], mut point: f64) -> Option<usize> {
    let mut last = None;
    for (index, (weight, servable)) in weights.iter().zip(servable).enumerate() {
        if !*servable || *weight <= 0.0 {
            continue;
        }
        last = Some(index);
        if point < *weight {
            return Some(index);
        }
        point -= weight;
    }
    last
}

/// `count` instances of weight 1 named `engine-0`, `engine-1`, … (the unit tests' fleet).
#[cfg(test)]
pub(crate) fn views(count: usize) -> Vec<InstanceView> {
    (0..count)
        .map(|index| InstanceView::new(&format!("engine-{index}"), 1.0))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::{ProptestConfig, any, prop_assert, prop_assert_eq, proptest};

    const PREFIX: Strategy = Strategy::PrefixAware {
        concurrency_threshold: 10,
        balance: None,
    };

    #[test]
    fn a_stored_response_has_its_holder_as_the_only_candidate() {
        let ranking = affinity(3);
        assert_eq!(ranking.order, vec![3]);
        assert_eq!(ranking.first(), Some(3));
        assert_eq!(ranking.route, Some(Route::Response));
    }

    #[test]
    fn prefix_aware_prefers_rank_zero_until_threshold() {
        let instances = views(5);
        let top = rank(PREFIX, &instances, |_| 0, 7, 0);
        assert_eq!(top.route, Some(Route::Prefix));
        let first = top.first().unwrap();
        let second = top.order[1];
        let overflow = rank(
            PREFIX,
            &instances,
            |i| if i == first { 10 } else { 0 },
            7,
            0,
        );
        assert_eq!(overflow.route, Some(Route::Overflow));
        assert_eq!(
            overflow.first(),
            Some(second),
            "overflow goes to the second choice"
        );
    }

    #[test]
    fn all_saturated_picks_least_loaded() {
        let instances = views(4);
        let ranking = rank(PREFIX, &instances, |i| 20 + i as u32, 99, 0);
        assert_eq!(ranking.first(), Some(0));
        let top = rank(PREFIX, &instances, |_| 0, 99, 0).first();
        let expected = if top == Some(0) {
            Route::Prefix
        } else {
            Route::Overflow
        };
        assert_eq!(ranking.route, Some(expected));
    }

    #[test]
    fn ejected_instances_come_last() {
        let mut instances = views(3);
        let top = rank(PREFIX, &instances, |_| 0, 5, 0).first().unwrap();
        instances[top].available = false;
        let ranking = rank(PREFIX, &instances, |_| 0, 5, 0);
        assert_ne!(ranking.first(), Some(top));
        assert_eq!(*ranking.order.last().unwrap(), top);
        assert_eq!(ranking.route, Some(Route::Overflow));
    }

    #[test]
    fn least_outstanding_breaks_ties_randomly() {
        let instances = views(4);
        let mut firsts = std::collections::HashSet::new();
        for random in 0..200 {
            let ranking = rank(
                Strategy::LeastOutstandingRequests,
                &instances,
                |_| 0,
                0,
                random,
            );
            firsts.insert(ranking.first().unwrap());
        }
        assert_eq!(
            firsts.len(),
            4,
            "zero loads must not pile onto one instance"
        );
        let ranking = rank(
            Strategy::LeastOutstandingRequests,
            &instances,
            |i| [3, 1, 2, 5][i],
            0,
            1,
        );
        assert_eq!(ranking.order, vec![1, 2, 0, 3]);
    }

    #[test]
    fn random_respects_weights() {
        let mut instances = views(2);
        instances[1].weight = 3.0;
        let picks = (0..20_000u64)
            .filter(|random| {
                rank(
                    Strategy::Random,
                    &instances,
                    |_| 0,
                    0,
                    random.wrapping_mul(0x9E37_79B9_7F4A_7C15),
                )
                .first()
                    == Some(1)
            })
            .count();
        let share = picks as f64 / 20_000.0;
        assert!((share - 0.75).abs() < 0.02, "share {share}");
    }

    #[test]
    fn variants_by_weight() {
        let weights = [1.0, 0.0, 3.0];
        let servable = [true, true, true];
        let mut counts = [0usize; 3];
        for random in 0..20_000u64 {
            counts[choose_variant(
                &weights,
                &servable,
                random.wrapping_mul(0x9E37_79B9_7F4A_7C15),
            )
            .unwrap()] += 1;
        }
        assert_eq!(counts[1], 0);
        let share = counts[2] as f64 / 20_000.0;
        assert!((share - 0.75).abs() < 0.02, "share {share}");
        assert_eq!(choose_variant(&weights, &[false, true, false], 1), Some(1));
        assert_eq!(choose_variant(&weights, &[false, false, false], 1), None);
    }

    #[test]
    fn a_variant_owns_its_interval_and_no_more() {
        let all = [true, true, true];
        // Weights 1, 0, 3: [0, 1) is the first's, [1, 4) the third's; 0 owns nothing.
        for (point, expected) in [(0.0, 0), (0.999, 0), (1.0, 2), (2.5, 2), (3.999, 2)] {
            assert_eq!(
                variant_at(&[1.0, 0.0, 3.0], &all, point),
                Some(expected),
                "point {point}"
            );
        }
        // Equal weights: [0, 1), [1, 2), [2, 3); past the end, the last.
        for (point, expected) in [(0.5, 0), (1.5, 1), (2.0, 2), (7.0, 2)] {
            assert_eq!(
                variant_at(&[1.0, 1.0, 1.0], &all, point),
                Some(expected),
                "point {point}"
            );
        }
        // A variant that cannot serve owns nothing, whatever its weight.
        assert_eq!(
            variant_at(&[1.0, 1.0, 1.0], &[false, true, true], 0.5),
            Some(1)
        );
        assert_eq!(variant_at(&[2.0, 1.0], &[false, false], 0.5), None);
    }

    #[test]
    fn sessions_follow_their_key_whatever_the_load() {
        let instances = views(5);
        for id in [b"s-1".as_slice(), b"s-2", b"another session"] {
            let key = crate::hash::session_key(id);
            let ranking = session(&instances, key);
            let mut expected = Vec::new();
            rendezvous_order(&instances, key, &mut expected);
            assert_eq!(ranking.order, expected, "{id:?}");
            assert_eq!(ranking.route, Some(Route::Session));
        }
        assert_eq!(session(&[], 7), Ranking::default());
    }

    #[test]
    fn route_names_are_the_documented_header_values() {
        let names: Vec<&str> = Route::ALL.iter().map(|route| route.as_str()).collect();
        assert_eq!(
            names,
            [
                "prefix",
                "overflow",
                "random",
                "least-outstanding",
                "session",
                "kv",
                "response"
            ]
        );
    }

    /// `KeyHistory::none`'s `sent` is 0 everywhere (cargo mutants: 0 → 1 would favour weight).
    #[test]
    fn a_first_seen_keys_new_copy_ignores_weight_when_nothing_was_sent() {
        // Nothing sent anywhere: every candidate's share is 0 whatever its weight, so the new
        // copy goes by load, then rendezvous position (not to the heaviest instance).
        let instances = vec![
            InstanceView::new("engine-0", 1.0),
            InstanceView::new("engine-1", 1.0),
            InstanceView::new("engine-2", 10.0),
        ];
        let strategy = bounded(1.25, 3, 10);
        let mut checked = 0;
        for key in 0..2_000u64 {
            let mut order = Vec::new();
            let Some(owner) = rendezvous_order(&instances, key, &mut order) else {
                continue;
            };
            // Keys whose owner is a light instance and whose last is the heavy one.
            if order[0] != owner || order[2] != 2 {
                continue;
            }
            let mut loads = [0u32; 3];
            loads[owner] = 100;
            let ranking = rank(strategy, &instances, |index| loads[index], key, 0);
            assert_eq!(
                ranking.order[0], order[1],
                "key {key}: by position, not by weight"
            );
            checked += 1;
            if checked == 5 {
                break;
            }
        }
        assert_eq!(checked, 5, "too few keys with the heavy instance last");
    }

    fn bounded(factor: f64, slack: u32, concurrency_threshold: u32) -> Strategy {
        Strategy::PrefixAware {
            concurrency_threshold,
            balance: Some(LoadBalance { factor, slack }),
        }
    }

    /// SageMaker's PREFIX_AWARE as it was before the bounded-load extension, kept verbatim
    /// so that `balance: None` can be checked against it.
    fn sagemaker_prefix_aware(
        threshold: u32,
        instances: &[InstanceView],
        loads: &[u32],
        key: u64,
    ) -> Ranking {
        let mut order = Vec::new();
        if instances.is_empty() {
            return Ranking { order, route: None };
        }
        let owner = rendezvous_order(instances, key, &mut order);
        let below = order
            .iter()
            .position(|&index| instances[index].available && loads[index] < threshold);
        let chosen = match below {
            Some(position) => position,
            None => {
                let available = order
                    .iter()
                    .take_while(|&&index| instances[index].available)
                    .count()
                    .max(1);
                (0..available)
                    .min_by_key(|&position| (loads[order[position]], position))
                    .unwrap_or(0)
            }
        };
        let index = order.remove(chosen);
        order.insert(0, index);
        let route = if Some(index) == owner {
            Route::Prefix
        } else {
            Route::Overflow
        };
        Ranking {
            order,
            route: Some(route),
        }
    }

    #[test]
    fn the_bound_follows_the_mean_load() {
        let balance = LoadBalance {
            factor: 1.25,
            slack: 0,
        };
        // 16 in flight over 7: ⌈1.25 × 17 / 7⌉ = ⌈3.04⌉ = 4.
        assert_eq!(balance.bound(16, 7), 4);
        // An idle fleet: ⌈1.25 / 7⌉ = 1, so the owner takes the first request.
        assert_eq!(balance.bound(0, 7), 1);
        // An exact multiple is not rounded up further: ⌈1.0 × 14 / 7⌉ = 2.
        let exact = LoadBalance {
            factor: 1.0,
            slack: 0,
        };
        assert_eq!(exact.bound(13, 7), 2);
        let slack = LoadBalance {
            factor: 1.25,
            slack: 2,
        };
        assert_eq!(slack.bound(16, 7), 6);
        // The threshold still caps it; without a balance it is the bound.
        assert_eq!(
            prefix_aware_bound(5, Some(slack), &[16, 0, 0, 0, 0, 0, 0]),
            5
        );
        assert_eq!(
            prefix_aware_bound(10, Some(slack), &[16, 0, 0, 0, 0, 0, 0]),
            6
        );
        assert_eq!(prefix_aware_bound(10, None, &[100; 7]), 10);
        // Never a panic or a wrap on absurd inputs.
        let huge = LoadBalance {
            factor: 100.0,
            slack: u32::MAX,
        };
        assert_eq!(huge.bound(u64::MAX, 1), u32::MAX);
        assert_eq!(huge.bound(0, 0), u32::MAX);
    }

    #[test]
    fn a_hot_prefix_spills_below_the_threshold_once_its_owner_is_above_the_bound() {
        let instances = views(7);
        let strategy = bounded(1.25, 2, 16);
        let idle = rank(strategy, &instances, |_| 0, 7, 0);
        let owner = idle.first().unwrap();
        let second = idle.order[1];
        assert_eq!(idle.route, Some(Route::Prefix));
        // Owner at 5, the rest idle: bound ⌈1.25 × 6 / 7⌉ + 2 = 3, so it spills, though far
        // below the ConcurrencyThreshold of 16.
        let loads = |i: usize| if i == owner { 5 } else { 0 };
        let busy = rank(strategy, &instances, loads, 7, 0);
        assert_eq!(busy.route, Some(Route::Overflow));
        assert_eq!(
            busy.first(),
            Some(second),
            "the spill goes to the second choice"
        );
        // Without the extension it stays (SageMaker's semantics).
        let sagemaker = Strategy::PrefixAware {
            concurrency_threshold: 16,
            balance: None,
        };
        assert_eq!(
            rank(sagemaker, &instances, loads, 7, 0).first(),
            Some(owner)
        );
        // The same owner load on a busy fleet is below the mean: a key held there stays.
        let loaded = |i: usize| if i == owner { 5 } else { 4 };
        let history = held_on(|i: usize| i == owner);
        assert_eq!(
            rank_remembering(strategy, &instances, loaded, 7, 0, history).first(),
            Some(owner)
        );
        // A key sent nowhere yet starts on a least loaded instance.
        assert_eq!(
            rank(strategy, &instances, loaded, 7, 0).first(),
            Some(second)
        );
    }

    fn held_on(
        remembered: impl Fn(usize) -> bool,
    ) -> KeyHistory<impl Fn(usize) -> bool, impl Fn(usize) -> u32, impl Fn(usize) -> u32> {
        KeyHistory {
            remembered,
            sent: |_: usize| 0,
            copies: |_: usize| 0,
            further_lately: false,
        }
    }

    /// Seven instances of weight 1, key 7's rendezvous order on an idle fleet and its owner.
    fn idle_seven(strategy: Strategy) -> (Vec<InstanceView>, Vec<usize>, usize) {
        let instances = views(7);
        let order = rank(strategy, &instances, |_| 0, 7, 0).order;
        let owner = order[0];
        (instances, order, owner)
    }

    #[test]
    fn a_new_copy_goes_where_the_fewest_copies_were_placed() {
        let strategy = bounded(2.0, 3, 16);
        let (instances, order, owner) = idle_seven(strategy);
        let idle = |_: usize| 0;
        // A key sent nowhere, on an idle fleet: its owner, unless another instance had fewer
        // new copies placed on it lately.
        let nowhere = |_: usize| false;
        let even = KeyHistory {
            remembered: nowhere,
            sent: |_: usize| 3,
            copies: |_: usize| 1,
            further_lately: false,
        };
        let first = rank_remembering(strategy, &instances, idle, 7, 0, even);
        assert_eq!(
            (first.first(), first.route),
            (Some(owner), Some(Route::Prefix))
        );
        let fewer = |i: usize| u32::from(i != order[4]);
        let spread = KeyHistory {
            remembered: nowhere,
            sent: |_: usize| 3,
            copies: fewer,
            further_lately: false,
        };
        let spread = rank_remembering(strategy, &instances, idle, 7, 0, spread);
        assert_eq!(
            (spread.first(), spread.route),
            (Some(order[4]), Some(Route::Overflow))
        );
        // Copies count before requests sent: fewer copies beats fewer requests.
        let busy = KeyHistory {
            remembered: nowhere,
            sent: |i: usize| if i == order[4] { 9 } else { 0 },
            copies: fewer,
            further_lately: false,
        };
        let by_copies = rank_remembering(strategy, &instances, idle, 7, 0, busy);
        assert_eq!(by_copies.first(), Some(order[4]));
        // Per unit of weight: an instance of weight 4 with 2 copies takes the copy from those
        // of weight 1 with 1.
        let mut heavy = instances.clone();
        heavy[order[5]].weight = 4.0;
        let weighted = KeyHistory {
            remembered: nowhere,
            sent: |_: usize| 0,
            copies: |i: usize| if i == order[5] { 2 } else { 1 },
            further_lately: false,
        };
        let chosen = rank_remembering(strategy, &heavy, idle, 7, 0, weighted).first();
        assert_eq!(chosen, Some(order[5]));
        // A key held on its owner stays there below the bound, whatever the copies elsewhere.
        let held = KeyHistory {
            remembered: |i: usize| i == owner,
            sent: |_: usize| 0,
            copies: |i: usize| if i == owner { 9 } else { 0 },
            further_lately: false,
        };
        assert_eq!(
            rank_remembering(strategy, &instances, idle, 7, 0, held).first(),
            Some(owner)
        );
        // Without the extension, none of it changes anything.
        let sagemaker = Strategy::PrefixAware {
            concurrency_threshold: 5,
            balance: None,
        };
        assert_eq!(
            rank_remembering(sagemaker, &instances, idle, 7, 0, busy),
            rank(sagemaker, &instances, idle, 7, 0)
        );
    }

    #[test]
    fn a_key_whose_holders_all_took_far_more_than_their_share_is_relieved_once() {
        let strategy = bounded(2.0, 6, 16);
        let (instances, order, owner) = idle_seven(strategy);
        // The key is held by its owner (order[0]) and by `also`; sent counts, loads and
        // whether a further copy was placed lately, all in the key's rendezvous order.
        let choose =
            |also: Option<usize>, counts: [u32; 7], loads: [u32; 7], further_lately: bool| {
                let at = |i: usize| order.iter().position(|&o| o == i).unwrap();
                let history = KeyHistory {
                    remembered: |i: usize| at(i) == 0 || Some(at(i)) == also,
                    sent: |i: usize| counts[at(i)],
                    copies: |_: usize| 0,
                    further_lately,
                };
                let ranking =
                    rank_remembering(strategy, &instances, |i| loads[at(i)], 7, 0, history);
                (ranking.first().map(at), ranking.route)
            };
        // 56 sent (8 an instance on average, enough to judge): the owner took 14, 1.75 fair
        // shares; order[3] took 4 (half its share), the most starving: it takes the request.
        let counts = [14, 10, 7, 4, 7, 7, 7];
        let idle = [0; 7];
        assert_eq!(
            choose(None, counts, idle, false),
            (Some(3), Some(Route::Overflow))
        );
        // Not once a further copy was placed lately.
        assert_eq!(
            choose(None, counts, idle, true),
            (Some(0), Some(Route::Prefix))
        );
        // Not below 1.75 fair shares (13 of 56), nor before 8 an instance (55 sent).
        assert_eq!(
            choose(None, [13, 11, 7, 4, 7, 7, 7], idle, false).0,
            Some(0)
        );
        assert_eq!(choose(None, [14, 9, 7, 4, 7, 7, 7], idle, false).0, Some(0));
        // Every holder must be that far above: a second holder below keeps the key (the
        // least loaded holder, then the earliest); two holders at 14 each are relieved.
        assert_eq!(choose(Some(2), counts, idle, false).0, Some(0));
        assert_eq!(
            choose(Some(1), [14, 14, 7, 5, 7, 6, 3], idle, false).0,
            Some(6)
        );
        // Within one request of the least loaded: order[3] one above still takes it, two
        // above not (the next most starving does, the least loaded of those, then the earliest).
        assert_eq!(
            choose(None, counts, [0, 0, 0, 1, 0, 0, 0], false).0,
            Some(3)
        );
        assert_eq!(
            choose(None, counts, [0, 0, 1, 2, 0, 0, 0], false).0,
            Some(4)
        );
        // Only an instance below its fair share relieves (8 of 56 is exactly it).
        assert_eq!(
            choose(None, [14, 8, 8, 2, 8, 8, 8], [0, 0, 0, 2, 0, 0, 0], false).0,
            Some(0)
        );
        // A holder at the bound is not relieved: the key takes a further copy as before.
        let full = [16, 0, 0, 0, 0, 0, 0];
        assert_eq!(choose(None, counts, full, false).0, Some(3));
        assert_eq!(choose(None, counts, full, true).0, Some(3));
        assert_eq!(order[0], owner);
    }

    #[test]
    fn a_first_copy_reaches_a_starving_instance_one_request_above_the_least_loaded() {
        let strategy = bounded(2.0, 6, 16);
        let (instances, order, _) = idle_seven(strategy);
        let first_copy = |counts: [u32; 7], loads: [u32; 7]| {
            let at = |i: usize| order.iter().position(|&o| o == i).unwrap();
            let history = KeyHistory {
                remembered: |_: usize| false,
                sent: |i: usize| counts[at(i)],
                copies: |_: usize| 0,
                further_lately: false,
            };
            let ranking = rank_remembering(strategy, &instances, |i| loads[at(i)], 7, 0, history);
            ranking.first().map(at)
        };
        // 28 sent: order[3] took 2 of its fair 4, below three quarters of it.
        let counts = [5, 5, 4, 2, 4, 4, 4];
        assert_eq!(first_copy(counts, [0, 0, 0, 1, 0, 0, 0]), Some(3));
        // A retry tries the key's owner first (its holder, the key being sent nowhere yet),
        // then the rest in the key's order.
        let history = KeyHistory {
            remembered: |_: usize| false,
            sent: |i: usize| counts[order.iter().position(|&o| o == i).unwrap()],
            copies: |_: usize| 0,
            further_lately: false,
        };
        let loads = |i: usize| u32::from(i == order[3]);
        let ranking = rank_remembering(strategy, &instances, loads, 7, 0, history);
        let expected = [3, 0, 1, 2, 4, 5, 6].map(|position| order[position]);
        assert_eq!(ranking.order, expected);
        // Two above, not: the least loaded (none of them below its share): the owner.
        assert_eq!(first_copy(counts, [0, 0, 0, 2, 0, 0, 0]), Some(0));
        // Three quarters exactly (3 of 4) is not reached for either.
        assert_eq!(
            first_copy([5, 4, 4, 3, 4, 4, 4], [0, 0, 0, 1, 0, 0, 0]),
            Some(0)
        );
    }

    #[test]
    fn a_first_copy_goes_to_the_most_starving_instance() {
        let (nowhere, idle) = (|_: usize| false, |_: usize| 0);
        let strategy = bounded(2.0, 6, 16);
        let (instances, order, owner) = idle_seven(strategy);
        // Sent counts in the key's rendezvous order; copies alike everywhere.
        let first_copy = |counts: [u32; 7], copies: [u32; 7]| {
            let sent = |i: usize| counts[order.iter().position(|&o| o == i).unwrap()];
            let copies = |i: usize| copies[order.iter().position(|&o| o == i).unwrap()];
            let history = KeyHistory {
                remembered: nowhere,
                sent,
                copies,
                further_lately: false,
            };
            rank_remembering(strategy, &instances, idle, 7, 0, history).first()
        };
        // 28 sent (4 an instance on average, enough to judge): order[3] had 1, a quarter of
        // its fair share of 4, so it takes the key although it is not the owner (the three
        // at 4 have their fair share, not less).
        assert_eq!(first_copy([5, 5, 5, 1, 4, 4, 4], [0; 7]), Some(order[3]));
        // Exactly its fair share is not starving: the owner.
        assert_eq!(first_copy([4; 7], [0; 7]), Some(owner));
        // Below it is, however little: order[1] at 3 of its fair 4.
        assert_eq!(first_copy([5, 3, 4, 4, 4, 4, 4], [0; 7]), Some(order[1]));
        // Fewer than 4 an instance on average: nothing is judged yet.
        assert_eq!(first_copy([5, 5, 5, 0, 4, 4, 4], [0; 7]), Some(owner));
        // The most starving first, whatever the copies placed on it.
        assert_eq!(
            first_copy([6, 6, 6, 1, 6, 0, 5], [0, 0, 0, 0, 0, 3, 0]),
            Some(order[5])
        );
        // Fair shares follow the weights: order[3] of weight 4 with 5 of the 32 sent has 0.39
        // of its fair share (32 × 4 / 10 = 12.8); order[5] of weight 1 with 2 starves less
        // (0.63 of its fair 3.2), though it was sent fewer.
        let mut heavy = instances.clone();
        heavy[order[3]].weight = 4.0;
        let weighted = KeyHistory {
            remembered: nowhere,
            sent: |i: usize| match order.iter().position(|&o| o == i).unwrap() {
                3 => 5,
                5 => 2,
                _ => 5,
            },
            copies: |_: usize| 0,
            further_lately: false,
        };
        // (A key that order[3], heavier now, does not own.)
        let key = (0..64)
            .find(|&key| rank(strategy, &heavy, idle, key, 0).first() != Some(order[3]))
            .unwrap();
        assert_eq!(
            rank_remembering(strategy, &heavy, idle, key, 0, weighted).first(),
            Some(order[3])
        );
        // Only available instances count: with order[6] ejected, 24 sent over 6 is judged
        // (order[3]'s 1 is a quarter of its fair 4); with it counted, 24 over 7 would not be.
        let mut ejected = instances.clone();
        ejected[order[6]].available = false;
        let without = KeyHistory {
            remembered: nowhere,
            sent: |i: usize| match order.iter().position(|&o| o == i).unwrap() {
                3 => 1,
                6 => 0,
                1 => 3,
                _ => 5,
            },
            copies: |_: usize| 0,
            further_lately: false,
        };
        assert_eq!(
            rank_remembering(strategy, &ejected, idle, 7, 0, without).first(),
            Some(order[3])
        );
        // A starving instance outside the band (two above the least loaded) does not; the
        // band's instances all have their fair share (4 of 28) or more, so they tie however
        // many more one has: the owner (sent 5) before order[4] (sent 4).
        let busy = |i: usize| u32::from(i == order[3]) * 2;
        let history = KeyHistory {
            remembered: nowhere,
            sent: |i: usize| [5, 5, 5, 1, 4, 4, 4][order.iter().position(|&o| o == i).unwrap()],
            copies: |_: usize| 0,
            further_lately: false,
        };
        assert_eq!(
            rank_remembering(strategy, &instances, busy, 7, 0, history).first(),
            Some(owner)
        );
    }

    #[test]
    fn a_memory_that_changes_while_ranking_is_read_once_per_instance() {
        // Other requests update the spill memory concurrently; a ranking must neither panic
        // nor ask twice (a retry sort whose keys change under it may panic).
        let instances = views(40);
        let calls = std::cell::Cell::new(0usize);
        let flipping = KeyHistory {
            copies: |_: usize| 0,
            remembered: |_: usize| {
                calls.set(calls.get() + 1);
                calls.get().is_multiple_of(2)
            },
            sent: |_: usize| 0,
            further_lately: false,
        };
        let load = |i: usize| (i % 5) as u32 * 3;
        let ranking = rank_remembering(bounded(1.0, 0, 16), &instances, load, 7, 0, flipping);
        assert_eq!(ranking.order.len(), 40);
        assert!(calls.get() <= 40, "{} reads", calls.get());
    }

    #[test]
    fn a_spill_goes_back_to_a_remembered_copy_and_otherwise_to_the_instance_that_serves_least() {
        let instances = views(7);
        let strategy = bounded(1.0, 0, 16);
        let idle = rank(strategy, &instances, |_| 0, 7, 0);
        let (owner, second, third) = (idle.order[0], idle.order[1], idle.order[2]);
        // 17 in flight: bound ⌈18 / 7⌉ = 3. The owner is at it; the second choice at 2, the
        // third idle, the rest at 3.
        let load = |i: usize| match i {
            i if i == second => 2,
            i if i == third => 0,
            _ => 3,
        };
        assert_eq!(load(owner), 3);
        let fresh = rank(strategy, &instances, load, 7, 0);
        assert_eq!(
            (fresh.first(), fresh.route),
            (Some(third), Some(Route::Overflow)),
            "a first spill goes to the least loaded, not the next in order"
        );
        // A further copy (the key's holder, the owner, is at the bound) goes within one
        // request of the least loaded to the one the router sent the fewest requests lately:
        // an instance idle on the whole beats one momentarily idler ...
        let served = KeyHistory {
            copies: |_: usize| 0,
            remembered: |i: usize| i == owner,
            sent: |i: usize| if i == third { 9 } else { 1 },
            further_lately: false,
        };
        let near = |i: usize| if i == second { 1 } else { load(i) };
        let spread = rank_remembering(strategy, &instances, near, 7, 0, served);
        assert_eq!(
            (spread.first(), spread.route),
            (Some(second), Some(Route::Overflow))
        );
        // ... but not one further from the least loaded: an instance that served little (one
        // that just joined) does not draw every new copy.
        let far = rank_remembering(strategy, &instances, load, 7, 0, served);
        assert_eq!(far.first(), Some(third));
        // Sent counts are per unit of weight: an instance of weight 10 that was sent 9 takes
        // the copy from one of weight 1 that was sent 1 (the owner is as heavy, so it stays
        // first in the key's order).
        let mut heavy = instances.clone();
        heavy[third].weight = 10.0;
        heavy[owner].weight = 10.0;
        assert_eq!(rank(strategy, &heavy, |_| 0, 7, 0).first(), Some(owner));
        let weighted = rank_remembering(strategy, &heavy, near, 7, 0, served);
        assert_eq!(
            (weighted.first(), weighted.route),
            (Some(third), Some(Route::Overflow))
        );
        // Once the router has spilled the key to the second choice, it goes back there
        // while that copy is below the bound, though another instance is idler.
        let back = rank_remembering(strategy, &instances, load, 7, 0, held_on(|i| i == second));
        assert_eq!(back.first(), Some(second));
        // A spill that goes to a new copy is retried on the key's holders first (the
        // instances it was sent to: here only the fourth choice, not the owner), then the rest
        // in rendezvous order.
        let fourth = idle.order[3];
        let copy = rank_remembering(strategy, &instances, load, 7, 0, held_on(|i| i == fourth));
        assert_eq!(copy.first(), Some(third), "the copy is at the bound (3)");
        assert_eq!(copy.order[1], fourth);
        assert_eq!(copy.order[2..4], [owner, second]);
        // An owner that holds the key and is as idle as its copy keeps it (12 in flight:
        // bound 2).
        let even = |i: usize| if i == owner || i == second { 1 } else { 2 };
        let both = |i: usize| i == second || i == owner;
        let kept = rank_remembering(strategy, &instances, even, 7, 0, held_on(both));
        assert_eq!(
            (kept.first(), kept.route),
            (Some(owner), Some(Route::Prefix))
        );
        // A remembered copy less loaded than the owner takes it, both below the bound
        // (13 in flight: bound 2).
        let lighter = |i: usize| match i {
            i if i == second => 0,
            i if i == owner => 1,
            _ => 2,
        };
        let moved = rank_remembering(
            strategy,
            &instances,
            lighter,
            7,
            0,
            held_on(|i| i == second),
        );
        assert_eq!(
            (moved.first(), moved.route),
            (Some(second), Some(Route::Overflow))
        );
    }

    #[test]
    fn locally_ejected_instances_still_count_in_the_bound() {
        // Two routers may eject different instances; the bound must not depend on it.
        let mut instances = views(4);
        let loads = [3u32, 1, 0, 0];
        let strategy = bounded(1.0, 0, 100);
        let before = prefix_aware_bound(
            100,
            Some(LoadBalance {
                factor: 1.0,
                slack: 0,
            }),
            &loads,
        );
        instances[2].available = false;
        let ranking = rank(strategy, &instances, |i| loads[i], 11, 0);
        assert_eq!(before, 2, "⌈1.0 × 5 / 4⌉ = 2 over all four instances");
        let first = ranking.first().unwrap();
        assert_ne!(first, 2);
        assert!(loads[first] < before, "{ranking:?}");
    }

    /// The share of 4000 keys whose first choice moves when `count` idle instances become
    /// `count + 1`, and the ideal share (1 / (count + 1)).
    fn moved_by_one_more_instance(strategy: Strategy, count: usize) -> (f64, f64) {
        let before = views(count);
        let after = views(count + 1);
        let keys = 4000u64;
        let moved = (0..keys)
            .filter(|key| {
                let key = key.wrapping_mul(0x9E37_79B9_7F4A_7C15);
                let old = before[rank(strategy, &before, |_| 0, key, 0).first().unwrap()].id_hash;
                let new = after[rank(strategy, &after, |_| 0, key, 0).first().unwrap()].id_hash;
                old != new
            })
            .count();
        (moved as f64 / keys as f64, 1.0 / (count + 1) as f64)
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]

        #[test]
        fn same_input_same_choice(key in any::<u64>(), count in 1usize..50) {
            let instances = views(count);
            // Two routers build their views independently (in a different order, even).
            let mut reversed = instances.clone();
            reversed.reverse();
            let a = rank(PREFIX, &instances, |_| 0, key, 1).first().unwrap();
            let b = rank(PREFIX, &reversed, |_| 0, key, 2).first().unwrap();
            prop_assert_eq!(instances[a].id_hash, reversed[b].id_hash);
        }

        #[test]
        fn never_saturated_while_one_is_below(key in any::<u64>(), loads in proptest::collection::vec(0u32..20, 1..30)) {
            let instances = views(loads.len());
            let ranking = rank(PREFIX, &instances, |i| loads[i], key, 0);
            let first = ranking.first().unwrap();
            if loads.iter().any(|load| *load < 10) {
                prop_assert!(loads[first] < 10);
            } else {
                prop_assert_eq!(loads[first], *loads.iter().min().unwrap());
            }
            let mut sorted = ranking.order.clone();
            sorted.sort_unstable();
            prop_assert_eq!(sorted, (0..loads.len()).collect::<Vec<_>>());
        }

        #[test]
        fn adding_one_instance_moves_about_one_in_n_plus_one(count in 2usize..20) {
            let (fraction, ideal) = moved_by_one_more_instance(PREFIX, count);
            // Only keys won by the newcomer move; sampling noise on 4000 keys stays well inside this.
            prop_assert!(fraction <= ideal * 1.1 + 0.02, "moved {fraction}, ideal {ideal}");
            prop_assert!(fraction >= ideal * 0.9 - 0.02, "moved {fraction}, ideal {ideal}");
        }

        #[test]
        fn with_a_balance_the_choice_is_below_the_bound_whenever_one_is(
            key in any::<u64>(),
            loads in proptest::collection::vec(0u32..40, 1..30),
            ejected in proptest::collection::vec(any::<bool>(), 30),
            factor in 1.0f64..3.0,
            slack in 0u32..4,
            threshold in 1u32..64,
        ) {
            let mut instances = views(loads.len());
            for (instance, ejected) in instances.iter_mut().zip(&ejected) {
                instance.available = !ejected;
            }
            let balance = LoadBalance { factor, slack };
            let strategy = bounded(factor, slack, threshold);
            let bound = prefix_aware_bound(threshold, Some(balance), &loads);
            prop_assert!(bound <= threshold);
            let ranking = rank(strategy, &instances, |i| loads[i], key, 0);
            let first = ranking.first().unwrap();
            let available: Vec<usize> = (0..loads.len()).filter(|&i| instances[i].available).collect();
            if available.iter().any(|&i| loads[i] < bound) {
                prop_assert!(instances[first].available);
                prop_assert!(loads[first] < bound, "chose load {} at bound {bound}", loads[first]);
                // A key sent nowhere yet: the owner if it is below the bound and as little
                // loaded as the least loaded below it, else the least loaded below it, the
                // earliest in the key's rendezvous order among equals.
                let mut order = Vec::new();
                let owner = rendezvous_order(&instances, key, &mut order).unwrap();
                let eligible = |i: usize| instances[i].available && loads[i] < bound;
                let least = order.iter().filter(|&&i| eligible(i)).map(|&i| loads[i]).min().unwrap();
                let expected = if eligible(owner) && loads[owner] == least {
                    owner
                } else {
                    order.iter().copied().find(|&i| eligible(i) && loads[i] == least).unwrap()
                };
                prop_assert_eq!(first, expected);
            } else if !available.is_empty() {
                let least = available.iter().map(|&i| loads[i]).min().unwrap();
                prop_assert_eq!(loads[first], least);
            }
            // With c ≥ 1 and no threshold in the way, some instance is always below the bound.
            let uncapped = prefix_aware_bound(u32::MAX, Some(balance), &loads);
            prop_assert!(loads.iter().any(|&load| load < uncapped));
            let mut sorted = ranking.order.clone();
            sorted.sort_unstable();
            prop_assert_eq!(sorted, (0..loads.len()).collect::<Vec<_>>());
        }

        #[test]
        fn a_remembered_copy_below_the_bound_is_preferred_to_a_new_one(
            key in any::<u64>(),
            loads in proptest::collection::vec(proptest::prop_oneof![0u32..3, 0u32..40], 1..30),
            remembered in proptest::collection::vec(proptest::prop_oneof![any::<bool>(), proptest::bool::weighted(0.1)], 30),
            ejected in proptest::collection::vec(any::<bool>(), 30),
            sent in proptest::collection::vec(proptest::prop_oneof![0u32..12, 0u32..40], 30),
            copies in proptest::collection::vec(0u32..3, 30),
            weights in proptest::collection::vec(proptest::prop_oneof![proptest::strategy::Just(1.0f64), 0.5f64..4.0], 30),
            factor in 1.0f64..3.0,
            slack in 0u32..4,
            further_lately in any::<bool>(),
        ) {
            let mut instances = views(loads.len());
            for ((instance, ejected), weight) in instances.iter_mut().zip(&ejected).zip(&weights) {
                instance.available = !ejected;
                instance.weight = *weight;
            }
            let strategy = bounded(factor, slack, 1024);
            let balance = LoadBalance { factor, slack };
            let bound = prefix_aware_bound(1024, Some(balance), &loads);
            let history = KeyHistory { remembered: |i: usize| remembered[i], sent: |i: usize| sent[i], copies: |i: usize| copies[i], further_lately };
            let ranking = rank_remembering(strategy, &instances, |i| loads[i], key, 0, history);
            let first = ranking.first().unwrap();
            let mut order = Vec::new();
            let owner = rendezvous_order(&instances, key, &mut order).unwrap();
            let eligible = |i: usize| instances[i].available && loads[i] < bound;
            // The instances the key was sent to, or its owner if it was sent nowhere.
            let placed = remembered[..loads.len()].iter().any(|&held| held);
            let holder = |i: usize| if placed { remembered[i] } else { i == owner };
            // Each instance's share of the requests sent over its fair share (by weight,
            // among the available instances), judged once they average `after` an instance.
            let available: Vec<usize> = (0..loads.len()).filter(|&i| instances[i].available).collect();
            let total: f64 = available.iter().map(|&i| f64::from(sent[i])).sum();
            let all_weight: f64 = available.iter().map(|&i| weights[i]).sum();
            let judged = |after: f64| total >= after * available.len() as f64;
            let share = |i: usize| f64::from(sent[i]) / (total * weights[i] / all_weight);
            let floor = (0..loads.len()).filter(|&i| eligible(i)).map(|i| loads[i]).min();
            // Relief: every available holder took 1.75 fair shares or more (judged after 8
            // an instance); the most starving non-holder below its fair share within one
            // request of the least loaded, then the least loaded, then the earliest.
            let overloaded = !further_lately && judged(8.0)
                && (0..loads.len()).filter(|&i| holder(i) && instances[i].available).all(|i| share(i) >= 1.75);
            let reliever = |i: usize| overloaded && eligible(i) && !holder(i) && Some(loads[i]) <= floor.map(|f| f + 1) && share(i) < 1.0;
            let relief = (0..loads.len()).filter(|&i| reliever(i)).min_by(|&a, &b| share(a).total_cmp(&share(b)).then(loads[a].cmp(&loads[b])));
            if placed && (0..loads.len()).any(|i| eligible(i) && holder(i)) && relief.is_some() {
                let most = relief.unwrap();
                let expected = order.iter().copied().find(|&i| reliever(i) && share(i) == share(most) && loads[i] == loads[most]);
                prop_assert_eq!(Some(first), expected);
            } else if placed && (0..loads.len()).any(|i| eligible(i) && holder(i)) {
                // The least loaded holder below the bound, the earliest in the key's order.
                prop_assert!(eligible(first) && holder(first), "chose {first}");
                let least = (0..loads.len()).filter(|&i| eligible(i) && holder(i)).map(|i| loads[i]).min().unwrap();
                let expected = order.iter().copied().find(|&i| eligible(i) && holder(i) && loads[i] == least);
                prop_assert_eq!(Some(first), expected);
            } else if (0..loads.len()).any(eligible) {
                // A new copy: for a key sent nowhere yet, of the least loaded instances below
                // the bound, the most starving one, then the one with the fewest copies, then
                // the owner, then the fewest requests sent; for a further copy, of those
                // within one request of the least loaded, the fewest requests sent, then the
                // fewest copies (per unit of weight); then the least loaded, then the earliest
                // in the key's order.
                prop_assert!(eligible(first));
                let floor = floor.unwrap();
                // Starving (a key sent nowhere yet): below its fair share of the requests sent,
                // once those average 4 an available instance; the most starving first.
                let hunger = |i: usize| {
                    if judged(4.0) && instances[i].available && share(i) < 1.0 { share(i) } else { 1.0 }
                };
                // A first copy: the least loaded, or one request above for an instance below
                // three quarters of its share; a further copy: within one request.
                let near = |i: usize| eligible(i) && loads[i] <= floor + u32::from(placed || hunger(i) < 0.75);
                let (copies, sent) = (|i: usize| f64::from(copies[i]) / weights[i], |i: usize| f64::from(sent[i]) / weights[i]);
                let is_other = |i: usize| f64::from(u8::from(i != owner));
                let share = |i: usize| if placed { (0.0, sent(i), copies(i), 0.0) } else { (hunger(i), copies(i), is_other(i), sent(i)) };
                let fewest = (0..loads.len()).filter(|&i| near(i)).map(share).min_by(|a, b| a.0.total_cmp(&b.0).then(a.1.total_cmp(&b.1)).then(a.2.total_cmp(&b.2)).then(a.3.total_cmp(&b.3))).unwrap();
                let best = |i: usize| near(i) && share(i) == fewest;
                let least = (0..loads.len()).filter(|&i| best(i)).map(|i| loads[i]).min().unwrap();
                let expected = order.iter().copied().find(|&i| best(i) && loads[i] == least);
                prop_assert_eq!(Some(first), expected);
            }
            // Retries: the other holders first, then the rest, the unavailable last.
            let rank_of = |i: usize| (!instances[i].available, !holder(i));
            let position = |i: usize| order.iter().position(|&o| o == i).unwrap();
            prop_assert!(ranking.order[1..].windows(2).all(|pair| {
                let (a, b) = (rank_of(pair[0]), rank_of(pair[1]));
                a < b || (a == b && position(pair[0]) < position(pair[1]))
            }), "each group in the key's rendezvous order");
            prop_assert_eq!(ranking.route, Some(if first == owner { Route::Prefix } else { Route::Overflow }));
            let mut sorted = ranking.order.clone();
            sorted.sort_unstable();
            prop_assert_eq!(sorted, (0..loads.len()).collect::<Vec<_>>());
            // Without the extension, memory changes nothing.
            let sagemaker = Strategy::PrefixAware { concurrency_threshold: 10, balance: None };
            prop_assert_eq!(
                rank_remembering(sagemaker, &instances, |i| loads[i], key, 0, history),
                rank(sagemaker, &instances, |i| loads[i], key, 0)
            );
        }

        #[test]
        fn every_router_given_the_same_loads_makes_the_same_choice(
            key in any::<u64>(),
            loads in proptest::collection::vec(0u32..40, 1..30),
            factor in 1.0f64..3.0,
            slack in 0u32..4,
            rotation in 0usize..30,
        ) {
            let instances = views(loads.len());
            let strategy = bounded(factor, slack, 1024);
            // Another router lists the same instances (with the same loads) in another order,
            // and draws other random numbers.
            let rotation = rotation % loads.len();
            let mut other_instances = instances.clone();
            let mut other_loads = loads.clone();
            other_instances.rotate_left(rotation);
            other_loads.rotate_left(rotation);
            other_instances.reverse();
            other_loads.reverse();
            let a = rank(strategy, &instances, |i| loads[i], key, 1);
            let b = rank(strategy, &other_instances, |i| other_loads[i], key, 99);
            // The same holds for routers that remember the same spills and sent alike.
            let remembered: Vec<bool> = instances.iter().map(|instance| instance.id_hash % 3 == 0).collect();
            let mut other_remembered = remembered.clone();
            other_remembered.rotate_left(rotation);
            other_remembered.reverse();
            let sent: Vec<u32> = instances.iter().map(|instance| (instance.id_hash % 4) as u32).collect();
            let mut other_sent = sent.clone();
            other_sent.rotate_left(rotation);
            other_sent.reverse();
            let copies = |i: usize| (instances[i].id_hash % 3) as u32;
            let other_copies = |i: usize| (other_instances[i].id_hash % 3) as u32;
            let c = rank_remembering(strategy, &instances, |i| loads[i], key, 1, KeyHistory { remembered: |i: usize| remembered[i], sent: |i: usize| sent[i], copies, further_lately: false });
            let d = rank_remembering(strategy, &other_instances, |i| other_loads[i], key, 99, KeyHistory { remembered: |i: usize| other_remembered[i], sent: |i: usize| other_sent[i], copies: other_copies, further_lately: false });
            let ids_c: Vec<u64> = c.order.iter().map(|&i| instances[i].id_hash).collect();
            let ids_d: Vec<u64> = d.order.iter().map(|&i| other_instances[i].id_hash).collect();
            prop_assert_eq!(ids_c, ids_d);
            prop_assert_eq!(c.route, d.route);
            let ids_a: Vec<u64> = a.order.iter().map(|&i| instances[i].id_hash).collect();
            let ids_b: Vec<u64> = b.order.iter().map(|&i| other_instances[i].id_hash).collect();
            prop_assert_eq!(ids_a, ids_b);
            prop_assert_eq!(a.route, b.route);
        }

        #[test]
        fn without_the_extension_the_ranking_is_exactly_sagemakers(
            key in any::<u64>(),
            loads in proptest::collection::vec(0u32..20, 0..30),
            ejected in proptest::collection::vec(any::<bool>(), 30),
            threshold in 1u32..24,
        ) {
            let mut instances = views(loads.len());
            for (instance, ejected) in instances.iter_mut().zip(&ejected) {
                instance.available = !ejected;
            }
            let strategy = Strategy::PrefixAware { concurrency_threshold: threshold, balance: None };
            prop_assert_eq!(
                rank(strategy, &instances, |i| loads[i], key, 5),
                sagemaker_prefix_aware(threshold, &instances, &loads, key)
            );
        }

        #[test]
        fn with_a_balance_adding_one_instance_moves_about_one_in_n_plus_one(
            count in 2usize..20,
            factor in 1.0f64..3.0,
            slack in 0u32..4,
        ) {
            let (fraction, ideal) = moved_by_one_more_instance(bounded(factor, slack, 10), count);
            prop_assert!(fraction <= ideal * 1.1 + 0.02, "moved {fraction}, ideal {ideal}");
            prop_assert!(fraction >= ideal * 0.9 - 0.02, "moved {fraction}, ideal {ideal}");
        }

        #[test]
        fn weights_are_respected_by_rendezvous(seed in any::<u64>()) {
            let mut instances = views(3);
            instances[0].weight = 2.0;
            let keys = 6000u64;
            let wins = (0..keys)
                .filter(|key| rank(PREFIX, &instances, |_| 0, key.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ seed, 0).first() == Some(0))
                .count();
            let share = wins as f64 / keys as f64;
            prop_assert!((share - 0.5).abs() < 0.04, "share {share}");
        }
    }
}
