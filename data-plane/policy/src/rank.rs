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

/// The strategy of a variant, with its parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Strategy {
    Random,
    LeastOutstandingRequests,
    PrefixAware { concurrency_threshold: u32 },
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
}

impl Route {
    pub const ALL: [Route; 5] = [
        Route::Prefix,
        Route::Overflow,
        Route::Random,
        Route::LeastOutstanding,
        Route::Session,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Route::Prefix => "prefix",
            Route::Overflow => "overflow",
            Route::Random => "random",
            Route::LeastOutstanding => "least-outstanding",
            Route::Session => "session",
        }
    }
}

/// The outcome: instance indices in preference order (every instance appears once).
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
/// - `PrefixAware`: rendezvous order of `key`; the first available instance whose fleet-wide
///   load is below the threshold comes first (`Prefix` if it is the top choice, else
///   `Overflow`). If all are at the threshold, the least loaded comes first (ties by rank). The
///   rest follow in rendezvous order, so retries also go where every router would send them.
/// - `LeastOutstandingRequests`: fewest in flight; ties broken by `random`.
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
    let mut order = Vec::with_capacity(instances.len());
    if instances.is_empty() {
        return Ranking { order, route: None };
    }
    // Loads are read once: live counters change while we look, and a sort needs a
    // consistent order.
    let loads: Vec<u32> = (0..instances.len()).map(load).collect();
    let load = |index: usize| loads[index];
    let route = match strategy {
        Strategy::PrefixAware {
            concurrency_threshold,
        } => {
            let owner = rendezvous_order(instances, key, &mut order);
            let below = order.iter().position(|&index| {
                instances[index].available && load(index) < concurrency_threshold
            });
            let chosen = match below {
                Some(position) => position,
                None => {
                    // Everyone is at the threshold: least loaded available, earliest rank wins ties.
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
            if Some(index) == owner {
                Route::Prefix
            } else {
                Route::Overflow
            }
        }
        Strategy::LeastOutstandingRequests => {
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

/// Sticky sessions: the session's rendezvous order, whatever the load.
pub fn session(instances: &[InstanceView], session_key: u64) -> Ranking {
    let mut order = Vec::with_capacity(instances.len());
    let _owner = rendezvous_order(instances, session_key, &mut order);
    Ranking {
        order,
        route: (!instances.is_empty()).then_some(Route::Session),
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hash::instance_hash;
    use proptest::prelude::{ProptestConfig, any, prop_assert, prop_assert_eq, proptest};

    fn views(count: usize) -> Vec<InstanceView> {
        (0..count)
            .map(|index| InstanceView {
                id_hash: instance_hash(&format!("engine-{index}")),
                weight: 1.0,
                available: true,
            })
            .collect()
    }

    const PREFIX: Strategy = Strategy::PrefixAware {
        concurrency_threshold: 10,
    };

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
                "session"
            ]
        );
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
            let before = views(count);
            let after = views(count + 1);
            let keys = 4000u64;
            let moved = (0..keys)
                .filter(|key| {
                    let key = key.wrapping_mul(0x9E37_79B9_7F4A_7C15);
                    let old = before[rank(PREFIX, &before, |_| 0, key, 0).first().unwrap()].id_hash;
                    let new = after[rank(PREFIX, &after, |_| 0, key, 0).first().unwrap()].id_hash;
                    old != new
                })
                .count();
            let fraction = moved as f64 / keys as f64;
            let ideal = 1.0 / (count + 1) as f64;
            // Only keys won by the newcomer move; sampling noise on 4000 keys stays well inside this.
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
