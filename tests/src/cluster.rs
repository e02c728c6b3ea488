//! A whole cluster on loopback for the tests.

use std::time::Duration;

use switchyard_testkit::{Etcd, eventually, loopback_any};

use crate::{admin, control_plane, create_endpoint, register, router, wait_for_router_instances};

/// A whole cluster on loopback: etcd, a control plane on it, simulated engines registered as
/// instances `engine-0..N` of endpoint `chat` (variant `AllTraffic`, ModelName `sim`), and
/// routers following the control plane.
pub struct Cluster {
    pub etcd: Etcd,
    pub control_plane: Option<switchyard_control::ControlPlane>,
    pub engines: Vec<switchyard_engine_sim::SimHandle>,
    pub routers: Vec<switchyard_router::RouterHandle>,
}

impl Cluster {
    pub async fn start(
        engines: usize,
        routers: usize,
        variants_json: &str,
        sim: switchyard_engine_sim::SimConfig,
    ) -> anyhow::Result<Self> {
        let etcd = Etcd::start().await?;
        let control_plane = control_plane(switchyard_control::ControlConfig::etcd(
            loopback_any(),
            vec![etcd.url.clone()],
            "/switchyard/v1/",
        ))
        .await?;
        let mut admin = admin(&control_plane.url()).await?;
        create_endpoint(&mut admin, "chat", variants_json).await?;
        let mut handles = Vec::new();
        for index in 0..engines {
            let engine = switchyard_engine_sim::spawn(sim.clone()).await?;
            register(&mut admin, "chat", &format!("engine-{index}"), &engine.url).await?;
            handles.push(engine);
        }
        let mut started = Vec::new();
        for _ in 0..routers {
            started.push(router(&[control_plane.url()]).await?);
        }
        let cluster = Self {
            etcd,
            control_plane: Some(control_plane),
            engines: handles,
            routers: started,
        };
        cluster.wait_for_instances(engines).await?;
        Ok(cluster)
    }

    pub fn control_plane_url(&self) -> String {
        self.control_plane
            .as_ref()
            .map(|control_plane| control_plane.url())
            .unwrap_or_default()
    }

    /// Waits until every router routes to `count` instances of `chat`.
    pub async fn wait_for_instances(&self, count: usize) -> anyhow::Result<()> {
        for router in &self.routers {
            wait_for_router_instances(router, "chat", count).await?;
        }
        Ok(())
    }

    /// Waits until no router has a request in flight.
    pub async fn wait_idle(&self) -> anyhow::Result<()> {
        for router in &self.routers {
            eventually(
                Duration::from_secs(10),
                "in-flight counts to return to 0",
                || async { router.in_flight() == 0 },
            )
            .await?;
        }
        Ok(())
    }

    /// Index of the engine with instance id `engine-N`.
    pub fn engine_index(id: &str) -> usize {
        id.trim_start_matches("engine-")
            .parse()
            .unwrap_or(usize::MAX)
    }
}
