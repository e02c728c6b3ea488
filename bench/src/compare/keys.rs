//! The trace's PREFIX_AWARE routing keys, computed with the router's own code, and the
//! instances that own them.

use crate::agreement::KeyShares;
use crate::report::InstanceShare;
use crate::workload::Trace;

/// The share of the trace's requests whose prefix each instance `engine-0..N` owns in
/// PREFIX_AWARE's rendezvous order (the placement before any overflow), computed with the
/// router's own prefix extraction, routing key and ranking.
pub fn prefix_owner_shares(
    trace: &Trace,
    model: &str,
    prefix_length: usize,
    engines: usize,
) -> Vec<InstanceShare> {
    use switchyard_policy::rank::{InstanceView, rendezvous_order};
    let ids: Vec<String> = (0..engines)
        .map(|index| format!("engine-{index}"))
        .collect();
    let views: Vec<InstanceView> = ids.iter().map(|id| InstanceView::new(id, 1.0)).collect();
    let mut owned = vec![0.0f64; engines];
    let mut order = Vec::with_capacity(engines);
    for (key, share) in trace_key_shares(trace, model, prefix_length).0 {
        if let Some(owner) = rendezvous_order(&views, key, &mut order) {
            owned[owner] += share;
        }
    }
    let requests = trace.request_count() as f64;
    ids.into_iter()
        .zip(owned)
        .map(|(instance, share)| InstanceShare {
            instance,
            requests: (share * requests).round() as u64,
            share,
        })
        .collect()
}

/// The trace's PREFIX_AWARE routing keys (no prefix-aware id), each with its share of the
/// requests, computed with the router's own prefix extraction and key.
pub fn trace_key_shares(trace: &Trace, model: &str, prefix_length: usize) -> KeyShares {
    use switchyard_policy::hash::routing_key;
    use switchyard_policy::openai::OpenAiRequest;
    let mut counts: std::collections::BTreeMap<u64, u64> = std::collections::BTreeMap::new();
    for request in trace.requests() {
        let body = request.body(model);
        let Ok(parsed) = OpenAiRequest::parse(&body) else {
            continue;
        };
        let key = routing_key(b"", parsed.prefix_text(prefix_length).as_bytes());
        *counts.entry(key).or_default() += 1;
    }
    let total = counts.values().sum::<u64>().max(1) as f64;
    KeyShares(
        counts
            .into_iter()
            .map(|(key, count)| (key, count as f64 / total))
            .collect(),
    )
}
