//! The apply cost on one thread: a full table rebuild beside one change.

use std::sync::Arc;
use std::time::Instant;

use arc_swap::ArcSwap;
use switchyard_router::RoutingTable;
use switchyard_router::parts::Membership;
use switchyard_shared::sync::{StateUpdate, StateVersion};

use super::args::FleetArgs;
use super::report::ApplyReport;
use super::shape::{fleet_state, instance};
use crate::stats::Summary;

/// The full rebuild (a snapshot applied: every route prepared, every endpoint built) beside
/// one change (an instance re-registered with another weight), on this thread.
pub fn measure_apply(args: &FleetArgs) -> ApplyReport {
    let state = fleet_state(args);
    let table = Arc::new(ArcSwap::from_pointee(RoutingTable::default()));
    let mut membership = Membership::new(Arc::default(), Arc::clone(&table));
    let mut revision = 1;
    let mut full = Vec::new();
    for _ in 0..5 {
        let started = Instant::now();
        let version = StateVersion {
            cluster: "bench".into(),
            revision,
        };
        membership
            .apply(version, &state)
            .expect("a snapshot applies");
        full.push(started.elapsed().as_secs_f64() * 1e6);
        revision += 1;
    }
    let mut one = Vec::new();
    for change in 0..2000 {
        let weight = if change % 2 == 0 { 2.0 } else { 1.0 };
        let update = StateUpdate {
            complete: true,
            instances: vec![Arc::new(instance(
                change * 7 % args.instances,
                args.endpoints,
                weight,
            ))],
            ..StateUpdate::default()
        };
        let version = StateVersion {
            cluster: "bench".into(),
            revision,
        };
        let started = Instant::now();
        membership
            .apply(version, &update)
            .expect("a change applies");
        one.push(started.elapsed().as_secs_f64() * 1e6);
        revision += 1;
    }
    ApplyReport {
        instances: args.instances,
        endpoints: args.endpoints,
        full_rebuild_us: Summary::of(&full),
        one_change_us: Summary::of(&one),
    }
}
