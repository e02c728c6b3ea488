//! The control plane's own counters: the admin RPC layer, the store wrapper, health probes and
//! router sync streams count into them, and `observe` renders them with the gauges it reads
//! from their owners when scraped.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use switchyard_process::metrics::Histogram;

/// Latency buckets (seconds) of admin RPCs and store operations.
const SECONDS: [f64; 12] = [
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0,
];

/// Store operations, as the `operation` label names them.
pub(crate) const STORE_OPERATIONS: [&str; 7] = [
    "get",
    "list",
    "commit",
    "grant_lease",
    "keep_alive",
    "revoke_lease",
    "list_and_watch",
];

/// The control plane's own counters (gauges are read from their owners when scraped).
#[derive(Debug)]
pub struct ControlMetrics {
    /// Admin RPCs by (method, gRPC code).
    pub(crate) admin_rpcs: Mutex<BTreeMap<(String, &'static str), u64>>,
    pub(crate) admin_rpc_seconds: Histogram,
    /// By operation, in the order of `STORE_OPERATIONS`.
    pub(crate) store_seconds: [Histogram; 7],
    pub(crate) store_errors: [AtomicU64; 7],
    /// Health probes that succeeded and failed.
    pub(crate) probes: [AtomicU64; 2],
    /// From a change reaching this replica's view to its push on a router stream.
    pub sync_push_lag_seconds: Histogram,
}

impl Default for ControlMetrics {
    fn default() -> Self {
        Self {
            admin_rpcs: Mutex::default(),
            admin_rpc_seconds: Histogram::new(&SECONDS),
            store_seconds: std::array::from_fn(|_| Histogram::new(&SECONDS)),
            store_errors: Default::default(),
            probes: Default::default(),
            sync_push_lag_seconds: Histogram::new(&SECONDS),
        }
    }
}

impl ControlMetrics {
    pub fn count_probe(&self, healthy: bool) {
        self.probes[usize::from(!healthy)].fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn count_admin_rpc(&self, method: &str, code: &'static str, seconds: f64) {
        self.admin_rpc_seconds.observe(seconds);
        let mut rpcs = self
            .admin_rpcs
            .lock()
            .unwrap_or_else(|poison| poison.into_inner());
        *rpcs.entry((method.to_owned(), code)).or_default() += 1;
    }
}
