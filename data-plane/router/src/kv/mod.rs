//! KV_AWARE's inputs: the engines' KV-cache events, followed by each router directly, into
//! the KV index (`switchyard_kv`).
//!
//! - [`subscriber`]: one task per instance: ZMQ SUB in sequence order, gap repair by replay,
//!   rebuild when that fails, staleness.
//! - [`frame_guard`]: the loopback relay the subscriber's sockets dial, which cuts an engine
//!   that announces a frame too long to accept (zeromq would reserve it and abort).
//!
//! [`KvThread::spawn`] runs the subscribers for the routing table's KV_AWARE variants (and the
//! disaggregated pools whose caches DPD reads: [`follows_events`]) on a thread of their own
//! (the router's start-up; [`KvEvents::start`] does the same on the calling runtime). The
//! request path reads the index in its settle phase (`request::settle`, `plan::kv`).

pub mod frame_guard;
pub mod subscriber;

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use switchyard_process::{UsageError, check_range};

use arc_swap::ArcSwap;
use switchyard_policy::rank::Strategy;
use switchyard_shared::{
    EndpointName, InstanceId, KvEventsEndpoints, PrefillRoutingStrategy, ThresholdBasis,
    VariantName,
};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

pub use subscriber::SubscriberSettings;
pub use switchyard_kv::{IndexSettings, KvIndex};

use crate::routing::table::{EndpointRoute, RoutingTable};

/// Everything KV_AWARE's event following needs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KvSettings {
    pub index: IndexSettings,
    pub subscriber: SubscriberSettings,
}

/// The router's KV_AWARE flags (for `#[command(flatten)]` in the router's configuration).
#[derive(Debug, Clone, clap::Args)]
pub struct KvArgs {
    /// KV_AWARE (and a disaggregated endpoint's KV_AWARE prefill or UNCACHED_TOKENS): how long
    /// an engine may take to tokenize a request (POST /tokenize), in ms; past it, or on any
    /// error, that request routes as LEAST_OUTSTANDING_REQUESTS (UNCACHED_TOKENS: every prompt
    /// token counts as uncached).
    #[arg(long, default_value_t = 250, value_name = "MS")]
    pub kv_tokenize_timeout_ms: u64,
    /// KV_AWARE: how long an instance whose /tokenize failed twice in a row on its side (no
    /// connection, no answer within the timeout, a 5xx, 408 or 429) is not asked, in ms;
    /// doubled with each further failure up to 30 s (or this, if longer). Then one request
    /// tries it again; the other instances are asked meanwhile.
    #[arg(long, default_value_t = 1000, value_name = "MS")]
    pub kv_tokenize_pause_ms: u64,
    /// KV_AWARE: KV-cache blocks of 16 tokens the router's index keeps per instance (per rank
    /// of a data-parallel one; a token budget: engines with other block sizes keep as many
    /// tokens; ~310 bytes per block); beyond, the least recently stored are forgotten.
    #[arg(long, default_value_t = switchyard_kv::index::DEFAULT_MAX_BLOCKS_PER_INSTANCE, value_name = "BLOCKS")]
    pub kv_index_max_blocks: usize,
    /// KV_AWARE: how often each engine's KV-event replay socket is probed, in ms (two
    /// unanswered probes mark the instance stale: its cache is ignored until it answers).
    #[arg(long, default_value_t = 1000, value_name = "MS")]
    pub kv_events_probe_ms: u64,
}

/// The flags' defaults.
impl Default for KvArgs {
    fn default() -> Self {
        Self {
            kv_tokenize_timeout_ms: 250,
            kv_tokenize_pause_ms: 1000,
            kv_index_max_blocks: switchyard_kv::index::DEFAULT_MAX_BLOCKS_PER_INSTANCE,
            kv_events_probe_ms: 1000,
        }
    }
}

impl KvArgs {
    /// Checks the flags; the error names the flag.
    /// Returns the settings, the `/tokenize` deadline and the first pause.
    pub fn validate(&self) -> Result<(KvSettings, Duration, Duration), UsageError> {
        for (flag, value, range) in [
            (
                "--kv-tokenize-timeout-ms",
                self.kv_tokenize_timeout_ms,
                10..=10_000,
            ),
            (
                "--kv-tokenize-pause-ms",
                self.kv_tokenize_pause_ms,
                100..=600_000,
            ),
            (
                "--kv-index-max-blocks",
                self.kv_index_max_blocks as u64,
                1_000..=100_000_000,
            ),
            ("--kv-events-probe-ms", self.kv_events_probe_ms, 50..=60_000),
        ] {
            check_range(flag, value, range)?;
        }
        let probe = Duration::from_millis(self.kv_events_probe_ms);
        let settings = KvSettings {
            index: IndexSettings {
                max_blocks_per_instance: self.kv_index_max_blocks,
            },
            subscriber: SubscriberSettings {
                probe_interval: probe,
                reply_timeout: probe.min(Duration::from_secs(1)),
                ..SubscriberSettings::default()
            },
        };
        Ok((
            settings,
            Duration::from_millis(self.kv_tokenize_timeout_ms),
            Duration::from_millis(self.kv_tokenize_pause_ms),
        ))
    }
}

/// Whether the instances of `endpoint`'s variant at `position` are followed: KV_AWARE
/// variants, and on a disaggregated endpoint the pools whose caches its decision reads
/// whatever their own RoutingStrategy: the prefill variant when PrefillRoutingStrategy is
/// KV_AWARE, the decode variant when ThresholdBasis is UNCACHED_TOKENS.
pub fn follows_events(endpoint: &EndpointRoute, position: usize) -> bool {
    if matches!(
        endpoint.variants[position].strategy,
        Strategy::KvAware { .. }
    ) {
        return true;
    }
    endpoint.disaggregation.as_ref().is_some_and(|pd| {
        (position == pd.prefill && pd.prefill_strategy == PrefillRoutingStrategy::KvAware)
            || (position == pd.decode && pd.basis == ThresholdBasis::UncachedTokens)
    })
}

type SubscriberKey = (EndpointName, VariantName, InstanceId);

/// The running subscribers and the index they fill.
#[derive(Debug)]
pub struct KvEvents {
    index: Arc<KvIndex>,
    stop: CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

impl KvEvents {
    /// Follows the KV events of every instance that declares them in the variants
    /// [`follows_events`] names, starting and stopping subscribers as the table changes
    /// (checked every 100 ms), until `stop`. The returned handle gives the index to the
    /// request path.
    pub fn start(
        table: Arc<ArcSwap<RoutingTable>>,
        settings: KvSettings,
        stop: CancellationToken,
    ) -> Self {
        let index = Arc::new(KvIndex::new(settings.index));
        let task = tokio::spawn(reconcile_loop(
            table,
            Arc::clone(&index),
            settings,
            stop.clone(),
        ));
        Self { index, stop, task }
    }

    pub fn index(&self) -> &Arc<KvIndex> {
        &self.index
    }

    /// Stops every subscriber and waits until they have ended.
    pub async fn shutdown(mut self) {
        self.stop.cancel();
        let _ = (&mut self.task).await;
    }
}

impl Drop for KvEvents {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// The router's KV-event following: what [`KvEvents`] does, on a thread of its own
/// (`switchyard-kv`, with its own runtime), so that decoding and applying batches never holds
/// up a serving thread (as the control-plane stream runs on `switchyard-sync`).
#[derive(Debug)]
pub struct KvThread {
    index: Arc<KvIndex>,
    stop: CancellationToken,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl KvThread {
    /// Starts following the variants [`follows_events`] names until `shutdown` (or
    /// [`join`](Self::join)).
    pub fn spawn(
        table: Arc<ArcSwap<RoutingTable>>,
        settings: KvSettings,
        shutdown: &CancellationToken,
    ) -> std::io::Result<Self> {
        let stop = shutdown.child_token();
        let index = Arc::new(KvIndex::new(settings.index));
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let (thread_index, token) = (Arc::clone(&index), stop.clone());
        let thread = std::thread::Builder::new()
            .name("switchyard-kv".into())
            .spawn(move || {
                runtime.block_on(reconcile_loop(table, thread_index, settings, token));
                runtime.shutdown_timeout(Duration::from_secs(1));
            })?;
        Ok(Self {
            index,
            stop,
            thread: Some(thread),
        })
    }

    pub fn index(&self) -> &Arc<KvIndex> {
        &self.index
    }

    /// Stops every subscriber and waits for the thread to end (blocking: from async code, on
    /// a blocking thread).
    pub fn join(mut self) {
        self.stop.cancel();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl Drop for KvThread {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

struct Running {
    endpoints: KvEventsEndpoints,
    stop: CancellationToken,
}

async fn reconcile_loop(
    table: Arc<ArcSwap<RoutingTable>>,
    index: Arc<KvIndex>,
    settings: KvSettings,
    stop: CancellationToken,
) {
    let mut running: HashMap<SubscriberKey, Running> = HashMap::new();
    let mut tasks = JoinSet::new();
    let mut seen: Option<Arc<RoutingTable>> = None;
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    loop {
        tokio::select! {
            () = stop.cancelled() => break,
            _ = tick.tick() => {}
            Some(_) = tasks.join_next(), if !tasks.is_empty() => continue,
        }
        let current = table.load_full();
        if seen
            .as_ref()
            .is_some_and(|seen| Arc::ptr_eq(seen, &current))
        {
            continue;
        }
        reconcile(&current, &index, &settings, &mut running, &mut tasks, &stop);
        seen = Some(current);
    }
    for subscriber in running.values() {
        subscriber.stop.cancel();
    }
    while tasks.join_next().await.is_some() {}
}

/// One stream of KV events: the name the index knows it by, its sockets, and the
/// data-parallel rank it is (None: not data parallel).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Source {
    pub id: InstanceId,
    pub endpoints: KvEventsEndpoints,
    pub rank: Option<u32>,
}

/// The index's sources of one instance's events: the instance itself, or for a
/// data-parallel engine each rank (`ID#dpR`, on each port + R).
pub fn sources(id: &InstanceId, endpoints: &KvEventsEndpoints) -> Vec<Source> {
    match endpoints.data_parallel_size {
        0 | 1 => vec![Source {
            id: id.clone(),
            endpoints: endpoints.clone(),
            rank: None,
        }],
        size => (0..size)
            .map(|rank| Source {
                id: id.data_parallel_rank(rank),
                endpoints: endpoints.rank(rank),
                rank: Some(rank),
            })
            .collect(),
    }
}

fn reconcile(
    table: &RoutingTable,
    index: &Arc<KvIndex>,
    settings: &KvSettings,
    running: &mut HashMap<SubscriberKey, Running>,
    tasks: &mut JoinSet<()>,
    stop: &CancellationToken,
) {
    let mut wanted: HashMap<SubscriberKey, Source> = HashMap::new();
    let mut variants = HashSet::new();
    for endpoint in table.endpoints.values() {
        for variant in (0..endpoint.variants.len())
            .filter(|&position| follows_events(endpoint, position))
            .map(|position| &endpoint.variants[position])
        {
            variants.insert((endpoint.name.clone(), variant.name.clone()));
            for instance in &variant.instances {
                let Some(endpoints) = &instance.kv_events else {
                    continue;
                };
                // A data-parallel engine: one stream per rank, indexed apart.
                for source in sources(&instance.id, endpoints) {
                    wanted.insert(
                        (
                            endpoint.name.clone(),
                            variant.name.clone(),
                            source.id.clone(),
                        ),
                        source,
                    );
                }
            }
        }
    }
    running.retain(|key, subscriber| {
        let keep = wanted
            .get(key)
            .is_some_and(|source| source.endpoints == subscriber.endpoints);
        if !keep {
            subscriber.stop.cancel();
            if let Some(variant) = index.variant(&key.0, &key.1) {
                variant.clear(&key.2, false);
            }
            tracing::info!(endpoint = %key.0, instance = %key.2, "stopped following KV events");
        }
        keep
    });
    for (
        key,
        Source {
            endpoints, rank, ..
        },
    ) in wanted
    {
        if running.contains_key(&key) {
            continue;
        }
        let variant = index.variant_or_insert(&(key.0.clone(), key.1.clone()));
        let target = subscriber::Target {
            instance: key.2.clone(),
            rank,
            index: variant,
            index_settings: index.settings,
            counters: Arc::clone(&index.counters),
        };
        let child = stop.child_token();
        tasks.spawn(subscriber::run(
            target,
            endpoints.clone(),
            settings.subscriber,
            child.clone(),
        ));
        running.insert(
            key,
            Running {
                endpoints,
                stop: child,
            },
        );
    }
    index.retain_variants(&variants);
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Flags {
        #[command(flatten)]
        kv: KvArgs,
    }

    #[test]
    fn flags_default_and_name_themselves_when_wrong() {
        let flags = Flags::parse_from(["router"]);
        let (settings, timeout, pause) = flags.kv.validate().unwrap();
        assert_eq!(
            format!("{:?}", flags.kv),
            format!("{:?}", KvArgs::default())
        );
        assert_eq!(timeout, crate::request::tokenize::DEFAULT_TIMEOUT);
        assert_eq!(pause, crate::request::tokenize::DEFAULT_PAUSE);
        assert_eq!(settings.index, IndexSettings::default());
        assert_eq!(settings.subscriber, SubscriberSettings::default());
        for (flag, value) in [
            ("--kv-tokenize-timeout-ms", "0"),
            ("--kv-tokenize-pause-ms", "0"),
            ("--kv-index-max-blocks", "10"),
            ("--kv-events-probe-ms", "1"),
        ] {
            let flags = Flags::parse_from(["router", flag, value]);
            assert!(flags.kv.validate().unwrap_err().0.contains(flag), "{flag}");
        }
    }

    #[test]
    fn the_disaggregated_pools_whose_caches_dpd_reads_are_followed() {
        let pools = |disaggregation: &str| -> Vec<bool> {
            let yaml = format!(
                "Endpoints:\n  - EndpointName: pd\n    ProductionVariants:\n      - {{VariantName: prefill}}\n      - {{VariantName: decode}}\n    DisaggregationConfig: {disaggregation}\n"
            );
            let table = crate::routing::membership::static_table(&yaml);
            let endpoint = Arc::clone(&table.endpoints["pd"]);
            (0..2)
                .map(|position| follows_events(&endpoint, position))
                .collect()
        };
        let both = "PrefillVariantName: prefill, DecodeVariantName: decode";
        assert_eq!(pools(&format!("{{{both}}}")), [false, false]);
        assert_eq!(
            pools(&format!("{{{both}, PrefillRoutingStrategy: KV_AWARE}}")),
            [true, false]
        );
        assert_eq!(
            pools(&format!("{{{both}, ThresholdBasis: UNCACHED_TOKENS}}")),
            [false, true]
        );
    }
}
