//! The router's Prometheus metrics. Counters on the request path are atomics (per instance in
//! its `InstanceCell`, per error kind here); labels are only assembled when `/metrics` is read.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use switchyard_process::metrics::{Histogram, TextEncoder};

use crate::errors::ErrorKind;
use crate::observe::labels::{MIGRATION_OUTCOMES, RouteLabel, UpstreamError};
use crate::plan::tokens::TokenizeError;
use crate::routing::cells::{InstanceCell, LoadRegistry};
use crate::routing::table::RoutingTable;
use crate::server::admission::{Admission, Limit};

/// Fine at the low end: a routing decision takes microseconds.
const LATENCY_BOUNDS: [f64; 17] = [
    0.000_002_5,
    0.000_005,
    0.000_01,
    0.000_025,
    0.000_05,
    0.000_1,
    0.000_25,
    0.000_5,
    0.001,
    0.002_5,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.5,
    2.5,
];

/// Seconds a sync message takes to apply, on the sync thread (table swap included).
const APPLY_BOUNDS: [f64; 14] = [
    0.000_01, 0.000_025, 0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025,
    0.1, 0.5, 2.5,
];

/// What the control-plane stream does, shared by the sync thread and `/metrics`.
#[derive(Debug)]
pub struct SyncMetrics {
    /// True once a stream has delivered a whole snapshot, until it ends.
    pub connected: AtomicBool,
    /// Snapshots refused because they were older than the state held (same cluster).
    pub stale_snapshots_refused: AtomicU64,
    /// Snapshots taken from another cluster than the state held (a store recreated).
    pub cluster_changes: AtomicU64,
    /// Sync messages applied (snapshot pieces and change batches).
    pub updates_applied: AtomicU64,
    /// When the last message of any kind arrived (Unix ms; 0: none yet).
    pub last_message_ms: AtomicU64,
    pub apply_seconds: Histogram,
    /// Load reports not sent because the stream's send queue was full.
    pub reports_skipped: AtomicU64,
    /// Key placements (bounded PREFIX_AWARE) sent to the control plane for the other routers.
    pub placements_announced: AtomicU64,
    /// Key placements of other routers taken from the control plane.
    pub placements_learned: AtomicU64,
    /// Routing tables swapped in so far (watchable: tests and benchmarks wait on it).
    pub swaps: tokio::sync::watch::Sender<u64>,
}

impl Default for SyncMetrics {
    fn default() -> Self {
        Self {
            connected: AtomicBool::new(false),
            stale_snapshots_refused: AtomicU64::new(0),
            cluster_changes: AtomicU64::new(0),
            updates_applied: AtomicU64::new(0),
            last_message_ms: AtomicU64::new(0),
            apply_seconds: Histogram::new(&APPLY_BOUNDS),
            reports_skipped: AtomicU64::new(0),
            placements_announced: AtomicU64::new(0),
            placements_learned: AtomicU64::new(0),
            swaps: tokio::sync::watch::Sender::new(0),
        }
    }
}

#[derive(Debug)]
pub struct RouterMetrics {
    errors: [AtomicU64; ErrorKind::ALL.len()],
    /// Time from request arrival to the routing decision (body read and parse included).
    pub decision_seconds: Histogram,
    /// Time from sending upstream to the upstream's response head.
    pub upstream_header_seconds: Histogram,
    /// Time from sending upstream to the answer's first data frame.
    pub upstream_ttft_seconds: Histogram,
    /// Disaggregated endpoints: the prefill hop (sending to the prefill answer read).
    pub disaggregation_prefill_seconds: Histogram,
    /// From the prefill answer to the decode request sent (reading its hand-off, building the
    /// decode request).
    pub disaggregation_handoff_seconds: Histogram,
    /// From sending the decode request to the answer's first frame.
    pub disaggregation_decode_ttft_seconds: Histogram,
    /// Requests of disaggregated endpoints by path: direct, disaggregated, fallback.
    disaggregation_paths: [AtomicU64; 3],
    /// Fallbacks by reason (`FALLBACK_REASONS`).
    disaggregation_fallbacks: [AtomicU64; FALLBACK_REASONS.len()],
    /// LMCACHE_PD notices by outcome (`NOTICE_OUTCOMES`).
    lmcache_notices: [AtomicU64; NOTICE_OUTCOMES.len()],
    /// KV_AWARE: a request's `/tokenize` round trip to an engine (answered ones).
    pub kv_tokenize_seconds: Histogram,
    /// KV_AWARE: requests routed by load because their token ids could not be had, by
    /// `TokenizeError::reason`.
    kv_tokenize_failures: [AtomicU64; TokenizeError::REASONS.len()],
    /// Broken streams of variants with a MigrationLimit, by outcome (`MIGRATION_OUTCOMES`).
    migrations: [AtomicU64; MIGRATION_OUTCOMES.len()],
    pub sync: Arc<SyncMetrics>,
}

/// Why a disaggregated request fell back to its decoder alone: the `reason` label of
/// `switchyard_router_disaggregation_fallbacks_total`.
pub const FALLBACK_REASONS: [&str; 14] = [
    "no_prefill_instance",
    "prefill_unreachable",
    "prefill_failed",
    "prefill_refused",
    "prefill_timeout",
    "no_decode_partner",
    "bad_handoff",
    "buffer_full",
    "decode_refused_handoff",
    // LMCACHE_PD only.
    "no_token_ids",
    "no_notice_socket",
    "no_receiver",
    "handoff_cap",
    "notice_timeout",
];

/// What became of an LMCache "KV ready" notice (LMCACHE_PD): the `outcome` label of
/// `switchyard_router_lmcache_notices_total`.
pub const NOTICE_OUTCOMES: [&str; 5] = [
    "matched",
    "relayed",
    "unknown",
    "undecodable",
    "relay_failed",
];

const DISAGGREGATION_PATHS: [RouteLabel; 3] = [
    RouteLabel::Direct,
    RouteLabel::Disaggregated,
    RouteLabel::Fallback,
];

/// Seconds, for hops that take whole prefills.
const HOP_BOUNDS: [f64; 14] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];

impl RouterMetrics {
    pub fn new(sync: Arc<SyncMetrics>) -> Self {
        Self {
            errors: Default::default(),
            decision_seconds: Histogram::new(&LATENCY_BOUNDS),
            upstream_header_seconds: Histogram::new(&LATENCY_BOUNDS),
            upstream_ttft_seconds: Histogram::new(&HOP_BOUNDS),
            disaggregation_prefill_seconds: Histogram::new(&HOP_BOUNDS),
            disaggregation_handoff_seconds: Histogram::new(&LATENCY_BOUNDS),
            disaggregation_decode_ttft_seconds: Histogram::new(&HOP_BOUNDS),
            disaggregation_paths: Default::default(),
            disaggregation_fallbacks: Default::default(),
            lmcache_notices: Default::default(),
            kv_tokenize_seconds: Histogram::new(&LATENCY_BOUNDS),
            kv_tokenize_failures: Default::default(),
            migrations: Default::default(),
            sync,
        }
    }

    /// Counts a disaggregated endpoint's request by its path (`direct`, `disaggregated`,
    /// `fallback`); other labels are not paths and are ignored.
    pub fn count_disaggregation(&self, label: RouteLabel) {
        if let Some(index) = DISAGGREGATION_PATHS.iter().position(|path| *path == label) {
            self.disaggregation_paths[index].fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Counts a broken stream's outcome (one of [`MIGRATION_OUTCOMES`]), router-wide and on
    /// `broken`, the cell of the instance whose answer broke.
    pub fn count_migration(&self, outcome: &str, broken: Option<&InstanceCell>) {
        if let Some(index) = MIGRATION_OUTCOMES
            .iter()
            .position(|known| *known == outcome)
        {
            self.migrations[index].fetch_add(1, Ordering::Relaxed);
            if let Some(cell) = broken {
                cell.migrations[index].fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Counts a fallback by its reason (one of [`FALLBACK_REASONS`]).
    /// One LMCache notice, by what became of it (`NOTICE_OUTCOMES`).
    pub fn count_notice(&self, outcome: &str) {
        if let Some(index) = NOTICE_OUTCOMES.iter().position(|known| *known == outcome) {
            self.lmcache_notices[index].fetch_add(1, Ordering::Relaxed);
        }
    }

    pub fn count_fallback(&self, reason: &str) {
        self.count_disaggregation(RouteLabel::Fallback);
        if let Some(index) = FALLBACK_REASONS.iter().position(|known| *known == reason) {
            self.disaggregation_fallbacks[index].fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Requests of disaggregated endpoints that took `label`'s path so far.
    pub fn disaggregation_count(&self, label: RouteLabel) -> u64 {
        DISAGGREGATION_PATHS
            .iter()
            .position(|path| *path == label)
            .map_or(0, |index| {
                self.disaggregation_paths[index].load(Ordering::Relaxed)
            })
    }

    pub fn error(&self, kind: ErrorKind) {
        self.errors[kind.index()].fetch_add(1, Ordering::Relaxed);
    }

    /// Counts a KV_AWARE request routed by load because its token ids could not be had.
    pub fn kv_tokenize_failed(&self, error: &TokenizeError) {
        if let Some(position) = TokenizeError::REASONS
            .iter()
            .position(|reason| *reason == error.reason())
        {
            self.kv_tokenize_failures[position].fetch_add(1, Ordering::Relaxed);
        }
    }

    /// KV_AWARE requests routed by load for `reason` so far.
    pub fn kv_tokenize_failures(&self, reason: &str) -> u64 {
        TokenizeError::REASONS
            .iter()
            .position(|known| *known == reason)
            .map_or(0, |position| {
                self.kv_tokenize_failures[position].load(Ordering::Relaxed)
            })
    }

    /// Errors of `kind` counted so far.
    pub fn errors(&self, kind: ErrorKind) -> u64 {
        self.errors[kind.index()].load(Ordering::Relaxed)
    }

    pub fn render(
        &self,
        table: &RoutingTable,
        registry: &LoadRegistry,
        admission: &Admission,
        tokenizer_fallbacks: u64,
    ) -> String {
        let mut out = TextEncoder::new();
        out.family(
            "switchyard_router_table_version",
            "gauge",
            "Version (store revision) of the routing state in use; 0 before any state arrived.",
        )
        .sample("switchyard_router_table_version", &[], table.version as f64);
        out.family(
            "switchyard_router_control_plane_connected",
            "gauge",
            "1 while a sync stream to the control plane is open.",
        )
        .sample(
            "switchyard_router_control_plane_connected",
            &[],
            f64::from(u8::from(self.sync.connected.load(Ordering::Relaxed))),
        );
        let counters = [
            (
                "switchyard_router_stale_snapshots_refused_total",
                "Snapshots refused because they were older than the routing state held (same cluster); the router then tries another control plane.",
                &self.sync.stale_snapshots_refused,
            ),
            (
                "switchyard_router_cluster_changes_total",
                "Snapshots taken from another cluster than the state held (its store was recreated).",
                &self.sync.cluster_changes,
            ),
            (
                "switchyard_router_sync_updates_total",
                "Sync messages applied: snapshot pieces and batches of changes.",
                &self.sync.updates_applied,
            ),
            (
                "switchyard_router_sync_reports_skipped_total",
                "Load reports to the control plane skipped because the stream's send queue was full (the control plane is not reading; the next report carries the same figures).",
                &self.sync.reports_skipped,
            ),
            (
                "switchyard_router_key_placements_announced_total",
                "Bounded PREFIX_AWARE: keys this router sent to an instance it had not sent them to lately, announced to the other routers through the control plane.",
                &self.sync.placements_announced,
            ),
            (
                "switchyard_router_key_placements_learned_total",
                "Bounded PREFIX_AWARE: key placements of other routers taken from the control plane (the instance then counts as holding the key).",
                &self.sync.placements_learned,
            ),
        ];
        for (name, help, counter) in counters {
            out.family(name, "counter", help).sample(
                name,
                &[],
                counter.load(Ordering::Relaxed) as f64,
            );
        }
        out.family(
            "switchyard_router_table_swaps_total",
            "counter",
            "Routing tables swapped in (one per snapshot or batch of changes).",
        )
        .sample(
            "switchyard_router_table_swaps_total",
            &[],
            *self.sync.swaps.borrow() as f64,
        );
        out.family(
            "switchyard_router_sync_apply_seconds",
            "histogram",
            "Time to apply one sync message on the sync thread (table swap included).",
        );
        out.histogram(
            "switchyard_router_sync_apply_seconds",
            &[],
            &self.sync.apply_seconds,
        );
        let mut rows: Vec<InstanceRow> = Vec::new();
        registry.for_each(|key, cell| {
            let requests: Vec<u64> = cell
                .requests
                .iter()
                .chain(&cell.upstream_errors)
                .chain(&cell.migrations)
                .map(|counter| counter.load(Ordering::Relaxed))
                .collect();
            rows.push((
                key.endpoint.to_string(),
                key.id.to_string(),
                cell.local.load(Ordering::Relaxed),
                cell.remote.load(Ordering::Relaxed),
                cell.ejected_until_ms.load(Ordering::Relaxed),
                requests,
            ));
        });
        rows.sort_by(|a, b| (&a.0, &a.1).cmp(&(&b.0, &b.1)));
        out.family(
            "switchyard_router_in_flight",
            "gauge",
            "Requests this router has in flight, per instance.",
        );
        for (endpoint, id, local, ..) in &rows {
            out.sample(
                "switchyard_router_in_flight",
                &[("endpoint", endpoint), ("instance", id)],
                f64::from(*local),
            );
        }
        out.family(
            "switchyard_router_fleet_in_flight",
            "gauge",
            "Requests in flight across every router, per instance, as this router sees it.",
        );
        for (endpoint, id, local, remote, ..) in &rows {
            out.sample(
                "switchyard_router_fleet_in_flight",
                &[("endpoint", endpoint), ("instance", id)],
                f64::from(local + remote),
            );
        }
        let now = switchyard_process::clock::unix_ms();
        out.family(
            "switchyard_router_instance_ejected",
            "gauge",
            "1 while this router has ejected the instance after repeated connection failures.",
        );
        for (endpoint, id, _, _, ejected_until, _) in &rows {
            out.sample(
                "switchyard_router_instance_ejected",
                &[("endpoint", endpoint), ("instance", id)],
                f64::from(u8::from(*ejected_until > now)),
            );
        }
        let routes = RouteLabel::ALL.map(RouteLabel::as_str);
        let errors = UpstreamError::ALL.map(UpstreamError::as_str);
        instance_counters(
            &mut out,
            &rows,
            (
                "switchyard_router_requests_total",
                "Requests sent to each instance, by why it was chosen.",
            ),
            ("route", &routes),
            0,
        );
        instance_counters(
            &mut out,
            &rows,
            (
                "switchyard_router_upstream_errors_total",
                "Requests to each instance that failed, by how: refused (not reached, retried elsewhere), reset (after sending: 502 or an answer cut short), timeout (no response head in time: 504), stream_idle (the answer stalled).",
            ),
            ("kind", &errors),
            routes.len(),
        );
        instance_counters(
            &mut out,
            &rows,
            (
                "switchyard_router_instance_migrations_total",
                "Streamed answers of each instance that broke midway on a variant with a MigrationLimit, by outcome (as switchyard_router_migrations_total).",
            ),
            ("outcome", &MIGRATION_OUTCOMES),
            routes.len() + errors.len(),
        );
        labelled_counters(
            &mut out,
            (
                "switchyard_router_errors_total",
                "Requests answered with an error by the router, by kind.",
            ),
            ("kind", &ErrorKind::ALL.map(ErrorKind::as_str)),
            &self.errors,
        );
        out.family(
            "switchyard_router_admission_refused_total",
            "counter",
            "Connections or requests refused with 503 by an admission limit (--max-connections, --max-in-flight, --max-buffered-bytes).",
        );
        for limit in Limit::ALL {
            out.sample(
                "switchyard_router_admission_refused_total",
                &[("limit", limit.as_str())],
                admission.refused(limit) as f64,
            );
        }
        out.family(
            "switchyard_router_open_connections",
            "gauge",
            "Client connections open now.",
        )
        .sample(
            "switchyard_router_open_connections",
            &[],
            admission.connections() as f64,
        );
        out.family(
            "switchyard_router_requests_in_flight",
            "gauge",
            "Requests admitted and not yet answered in full, over all instances.",
        )
        .sample(
            "switchyard_router_requests_in_flight",
            &[],
            admission.in_flight() as f64,
        );
        out.family(
            "switchyard_router_buffered_request_bytes",
            "gauge",
            "Request-body bytes held in memory now (bounded by --max-buffered-bytes).",
        )
        .sample(
            "switchyard_router_buffered_request_bytes",
            &[],
            admission.buffered_bytes() as f64,
        );
        out.family(
            "switchyard_router_decision_seconds",
            "histogram",
            "From request arrival to routing decision (reading and parsing the body included; for KV_AWARE, the /tokenize round trip too).",
        );
        out.histogram(
            "switchyard_router_decision_seconds",
            &[],
            &self.decision_seconds,
        );
        out.family(
            "switchyard_router_upstream_header_seconds",
            "histogram",
            "From sending a request upstream to the instance's response head.",
        );
        out.histogram(
            "switchyard_router_upstream_header_seconds",
            &[],
            &self.upstream_header_seconds,
        );
        out.family(
            "switchyard_router_upstream_ttft_seconds",
            "histogram",
            "From sending a request upstream to the first byte of the instance's answer (time to first token for a streamed answer).",
        );
        out.histogram(
            "switchyard_router_upstream_ttft_seconds",
            &[],
            &self.upstream_ttft_seconds,
        );
        let last_message_ms = self.sync.last_message_ms.load(Ordering::Relaxed);
        out.family(
            "switchyard_router_sync_message_age_seconds",
            "gauge",
            "Seconds since the last message from the control plane (a live stream sends fleet load at least every second); 0 before the first.",
        )
        .sample(
            "switchyard_router_sync_message_age_seconds",
            &[],
            if last_message_ms == 0 {
                0.0
            } else {
                switchyard_process::clock::unix_ms().saturating_sub(last_message_ms) as f64 / 1000.0
            },
        );
        switchyard_telemetry::write_metrics(&mut out);
        out.family(
            "switchyard_router_tokenizer_fallbacks_total",
            "counter",
            "Tokenizers named by a disaggregation config that could not be loaded (missing under --tokenizer-dir, unreadable): prompts counted with cl100k_base instead.",
        )
        .sample(
            "switchyard_router_tokenizer_fallbacks_total",
            &[],
            tokenizer_fallbacks as f64,
        );
        labelled_counters(
            &mut out,
            (
                "switchyard_router_disaggregation_requests_total",
                "Requests of disaggregated endpoints by path: direct (below the threshold, a decoder alone), disaggregated (prefill then decode), fallback (the prefill could not be done; the decoder served it whole).",
            ),
            ("path", &DISAGGREGATION_PATHS.map(RouteLabel::as_str)),
            &self.disaggregation_paths,
        );
        labelled_counters(
            &mut out,
            (
                "switchyard_router_migrations_total",
                "Streamed answers that broke midway on a variant with a MigrationLimit, by outcome: continued (on another instance), whole (only the end was lost), limit (the limit reached or not continuable), failed (no instance took the continuation).",
            ),
            ("outcome", &MIGRATION_OUTCOMES),
            &self.migrations,
        );
        labelled_counters(
            &mut out,
            (
                "switchyard_router_disaggregation_fallbacks_total",
                "Disaggregated requests the decoder served whole, by why the prefill was not used.",
            ),
            ("reason", &FALLBACK_REASONS),
            &self.disaggregation_fallbacks,
        );
        labelled_counters(
            &mut out,
            (
                "switchyard_router_lmcache_notices_total",
                "LMCACHE_PD: LMCache \"KV ready\" notices this router's notice socket received, by \
             outcome (matched a request here, relayed to the router that owns it, unknown, \
             undecodable, relay failed).",
            ),
            ("outcome", &NOTICE_OUTCOMES),
            &self.lmcache_notices,
        );
        out.family(
            "switchyard_router_kv_tokenize_seconds",
            "histogram",
            "KV_AWARE: a request's POST /tokenize round trip to an engine (answered ones).",
        );
        out.histogram(
            "switchyard_router_kv_tokenize_seconds",
            &[],
            &self.kv_tokenize_seconds,
        );
        labelled_counters(
            &mut out,
            (
                "switchyard_router_kv_tokenize_failures_total",
                "KV_AWARE requests routed as LEAST_OUTSTANDING_REQUESTS because their token ids could not be had, by reason: no_instance, backoff (every available instance paused after its /tokenize failed), input (no prompt or messages in the body), request (connection failed), timeout (--kv-tokenize-timeout-ms), status (an error status), answer (unreadable).",
            ),
            ("reason", &TokenizeError::REASONS),
            &self.kv_tokenize_failures,
        );
        for (name, help, histogram) in [
            (
                "switchyard_router_disaggregation_prefill_seconds",
                "Disaggregated requests: from sending the prefill request to its answer read.",
                &self.disaggregation_prefill_seconds,
            ),
            (
                "switchyard_router_disaggregation_handoff_seconds",
                "Disaggregated requests: from the prefill answer to the decode request sent.",
                &self.disaggregation_handoff_seconds,
            ),
            (
                "switchyard_router_disaggregation_decode_ttft_seconds",
                "Disaggregated requests: from sending the decode request to its answer's first frame.",
                &self.disaggregation_decode_ttft_seconds,
            ),
        ] {
            out.family(name, "histogram", help);
            out.histogram(name, &[], histogram);
        }
        out.finish()
    }
}

/// An instance's figures for the per-instance families: endpoint, id, requests in flight here
/// and elsewhere, ejected until (unix ms), and its counters (routes, upstream errors,
/// migrations, in that order).
type InstanceRow = (String, String, u32, u32, u64, Vec<u64>);

/// A counter family with one sample per value of `label`, read from `counters` in that order.
fn labelled_counters(
    out: &mut TextEncoder,
    (name, help): (&str, &str),
    (label, values): (&str, &[&str]),
    counters: &[AtomicU64],
) {
    out.family(name, "counter", help);
    for (value, count) in values.iter().zip(counters) {
        out.sample(
            name,
            &[(label, value)],
            count.load(Ordering::Relaxed) as f64,
        );
    }
}

/// A counter family with one sample per instance and value of `label`, read from each row's
/// counters from `first` on.
fn instance_counters(
    out: &mut TextEncoder,
    rows: &[InstanceRow],
    (name, help): (&str, &str),
    (label, values): (&str, &[&str]),
    first: usize,
) {
    out.family(name, "counter", help);
    for (endpoint, id, _, _, _, counts) in rows {
        for (value, count) in values.iter().zip(&counts[first..]) {
            out.sample(
                name,
                &[("endpoint", endpoint), ("instance", id), (label, value)],
                *count as f64,
            );
        }
    }
}
