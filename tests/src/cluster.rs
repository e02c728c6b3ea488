//! A whole cluster on loopback for the tests: [`switchyard_cluster::LocalCluster`] (what
//! `switchyard up` and the benchmarks run) on a real etcd of its own.

use std::time::Duration;

use switchyard_cluster::{ClusterSpec, ClusterStore, ClusterTuning, LocalCluster};
use switchyard_engine_sim::{SimConfig, SimHandle};
use switchyard_router::RouterHandle;
use switchyard_testkit::{Etcd, eventually};

/// etcd, a control plane on it, simulated engines registered as instances `engine-0..N` of
/// endpoint `chat` (variant `AllTraffic`, ModelName `sim`; health checks every 200 ms,
/// unhealthy after 2 failures, healthy again after 1 success), and routers following the
/// control plane, each on two serving threads (as [`router`](crate::router) starts them).
pub struct Cluster {
    local: LocalCluster,
    /// Declared after `local`: dropped (killed) once the cluster on it has been told to stop.
    _etcd: Etcd,
}

impl Cluster {
    /// Starts everything; returns once every router routes to every engine (15 s at most).
    pub async fn start(
        engines: usize,
        routers: usize,
        variants_json: &str,
        sim: SimConfig,
    ) -> anyhow::Result<Self> {
        let etcd = Etcd::start().await?;
        let spec = ClusterSpec {
            engines,
            routers,
            endpoint: "chat".into(),
            variants_json: variants_json.into(),
            sim,
            ..ClusterSpec::default()
        };
        let tuning = ClusterTuning {
            store: ClusterStore::Etcd {
                endpoints: vec![etcd.url.clone()],
                prefix: "/switchyard/v1/".into(),
            },
            health_check: switchyard_shared::HealthCheckConfig {
                interval_ms: 200,
                unhealthy_threshold: 2,
                healthy_threshold: 1,
                ..Default::default()
            },
            router_worker_threads: 2,
            ready_timeout: Duration::from_secs(15),
            ..ClusterTuning::default()
        };
        Ok(Self {
            local: LocalCluster::start_with(spec, tuning).await?,
            _etcd: etcd,
        })
    }

    pub fn routers(&self) -> &[RouterHandle] {
        self.local.routers()
    }

    /// Takes router `index` out of the cluster (to stop it alone).
    pub fn take_router(&mut self, index: usize) -> RouterHandle {
        self.local.take_router(index)
    }

    /// The engines, `engine-N` at index N.
    pub fn engines(&self) -> &[SimHandle] {
        self.local.engines()
    }

    pub fn control_plane_url(&self) -> &str {
        &self.local.control_plane_url
    }

    /// Waits (15 s at most) until every router routes to `count` instances of `chat`.
    pub async fn wait_for_instances(&self, count: usize) -> anyhow::Result<()> {
        eventually(
            Duration::from_secs(15),
            &format!("the routers to see {count} instances of chat"),
            || async {
                self.local
                    .routable_instances()
                    .iter()
                    .all(|&routable| routable == count)
            },
        )
        .await
    }

    /// Waits (10 s at most) until no router has a request in flight.
    pub async fn wait_idle(&self) -> anyhow::Result<()> {
        eventually(
            Duration::from_secs(10),
            "in-flight counts to return to 0",
            || async { self.local.in_flight() == 0 },
        )
        .await
    }

    /// Index of the engine with instance id `engine-N`.
    pub fn engine_index(id: &str) -> usize {
        id.trim_start_matches("engine-")
            .parse()
            .unwrap_or(usize::MAX)
    }
}
