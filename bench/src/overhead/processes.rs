//! The processes the overhead benchmark measures besides the router: the engine, in its own
//! process or in this one, and this executable's bare forwarder and TCP relay.

use std::time::{Duration, Instant};

use anyhow::bail;
use bytes::Bytes;

use super::args::{EnginePlacement, OverheadArgs};
use super::load::post_once;
use crate::child::{ChildServer, KvSockets, get_status, sibling_bin, start_child};
use crate::client::HttpClient;
use crate::error::UsageError;
use crate::scrape::scrape;
use crate::sim::bench_sim;
use crate::strategy::Strategy;

/// The simulated engine, in its own process or in this one.
pub enum Engine {
    Process(ChildServer),
    InProcess(switchyard_engine_sim::SimHandle),
}

impl Engine {
    /// Starts the engine; for KV_AWARE it publishes KV events on free loopback ports.
    pub async fn start(args: &OverheadArgs, client: &HttpClient) -> anyhow::Result<Self> {
        let kv_events = args.strategy == Strategy::KvAware;
        match args.engine {
            EnginePlacement::InProcess => {
                let mut sim = bench_sim(args.time_scale, 79_000);
                sim.step_overhead_ms = 0.0;
                if kv_events {
                    sim.kv_events = Some("tcp://127.0.0.1:0".into());
                    sim.kv_events_replay = Some("tcp://127.0.0.1:0".into());
                }
                Ok(Self::InProcess(switchyard_engine_sim::spawn(sim).await?))
            }
            EnginePlacement::Process => {
                let binary = match &args.engine_bin {
                    Some(path) => path.clone(),
                    None => sibling_bin("switchyard-engine-sim").ok_or_else(|| {
                        UsageError::new(
                            "switchyard-engine-sim is not next to this executable: build it (cargo build --release -p switchyard-engine-sim), pass --engine-bin, or use --engine in-process",
                        )
                    })?,
                };
                let time_scale = args.time_scale.to_string();
                let args = |listen: &str| -> Vec<std::ffi::OsString> {
                    let mut args: Vec<std::ffi::OsString> = [
                        "--listen",
                        listen,
                        "--time-scale",
                        &time_scale,
                        "--step-overhead-ms",
                        "0",
                        "--record-requests",
                        "16",
                    ]
                    .into_iter()
                    .map(Into::into)
                    .collect();
                    if kv_events {
                        for flag in ["--kv-events", "--kv-events-replay"] {
                            args.push(flag.into());
                            args.push("tcp://127.0.0.1:0".into());
                        }
                    }
                    args
                };
                Ok(Self::Process(
                    start_child(&binary, &args, "/health", client).await?,
                ))
            }
        }
    }

    pub fn url(&self) -> &str {
        match self {
            Self::Process(child) => &child.url,
            Self::InProcess(sim) => &sim.url,
        }
    }

    /// Where it publishes KV events (ports resolved), if it does.
    pub async fn kv_sockets(&self, client: &HttpClient) -> anyhow::Result<Option<KvSockets>> {
        match self {
            Self::InProcess(sim) => Ok(sim.kv_events_endpoint().map(|publisher| KvSockets {
                publisher,
                replay: sim.kv_events_replay_endpoint().unwrap_or_default(),
            })),
            Self::Process(child) => {
                let url = format!("{}/sim/kv-events", child.url);
                if get_status(client, &url).await != Some(200) {
                    return Ok(None);
                }
                let text = crate::scrape::get_text(client, &url).await?;
                Ok(Some(serde_json::from_str(&text)?))
            }
        }
    }

    pub async fn shutdown(self) {
        if let Self::InProcess(sim) = self {
            sim.shutdown().await;
        }
    }
}

/// KV_AWARE: one prompt of several blocks sent straight to the engine, so that it publishes
/// (until an engine has, the router does not ask it to tokenize), then a wait until the router
/// has applied that batch. From then on every request through the router makes its `/tokenize`
/// round trip (the measured prompt is shorter than a block: it matches nothing and is routed
/// by load, so the round trip is the whole difference).
pub async fn kv_warm_up(
    engine_url: &str,
    router: &ChildServer,
    client: &HttpClient,
) -> anyhow::Result<()> {
    let words: Vec<String> = (0..64).map(|index| format!("w{index}")).collect();
    let body = serde_json::json!({"model": "sim", "prompt": words.join(" "), "max_tokens": 1});
    post_once(
        client,
        &format!("{engine_url}/v1/completions").parse()?,
        &Bytes::from(body.to_string()),
    )
    .await?;
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let applied = scrape(client, &format!("{}/metrics", router.url))
            .await
            .ok()
            .and_then(|samples| {
                samples
                    .iter()
                    .find(|sample| sample.name == "switchyard_kv_event_batches_total")
                    .map(|sample| sample.value)
            })
            .unwrap_or(0.0);
        if applied >= 1.0 {
            return Ok(());
        }
        if Instant::now() >= deadline {
            bail!("the router applied no KV event of the engine within 10 s");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// This executable's bare forwarder (`switchyard-bench forward`) in front of the engine,
/// when this executable is switchyard-bench.
pub async fn start_forwarder(
    engine_url: &str,
    mode: &str,
    client: &HttpClient,
) -> Option<anyhow::Result<ChildServer>> {
    let exe = std::env::current_exe().ok()?;
    let name = exe.file_name()?.to_str()?;
    if !name.starts_with("switchyard-bench") {
        return None;
    }
    let args = |listen: &str| -> Vec<std::ffi::OsString> {
        vec![
            "forward".into(),
            "--listen".into(),
            listen.into(),
            "--upstream".into(),
            engine_url.into(),
            "--mode".into(),
            mode.into(),
        ]
    };
    // Both baselines pass the engine's /health through.
    Some(start_child(&exe, &args, "/health", client).await)
}
