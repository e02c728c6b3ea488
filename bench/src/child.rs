//! Child processes serving HTTP on 127.0.0.1: started on port 0, their port learnt from
//! /proc, ready when a path answers 200; and the workspace's executables next to this one.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};

use crate::client::HttpClient;
use crate::procfs::listening_ports;
use crate::strategy::Strategy;
use switchyard_cluster::variants_json;

/// The router executable next to the current one.
pub fn default_router_bin() -> Option<PathBuf> {
    sibling_bin("switchyard-router")
}

/// An executable of this workspace next to the current one.
pub fn sibling_bin(name: &str) -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let mut dir = exe.parent()?.to_path_buf();
    // Tests and examples run from target/{profile}/deps.
    if dir.ends_with("deps") {
        dir.pop();
    }
    let candidate = dir.join(name);
    candidate.is_file().then_some(candidate)
}

/// A child process serving HTTP on 127.0.0.1 (a router or the bare forwarder), killed on
/// drop.
pub struct ChildServer {
    _child: tokio::process::Child,
    pub pid: u32,
    pub url: String,
}

/// Starts `binary` with `args(listen address)` on `127.0.0.1:0`, learns the port it bound
/// from /proc, and waits until GET `ready_path` answers 200 (30 s at most).
pub async fn start_child(
    binary: &Path,
    args: &dyn Fn(&str) -> Vec<std::ffi::OsString>,
    ready_path: &str,
    client: &HttpClient,
) -> anyhow::Result<ChildServer> {
    let mut child = tokio::process::Command::new(binary)
        .args(args("127.0.0.1:0"))
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .with_context(|| format!("cannot start {}", binary.display()))?;
    let pid = child.id().context("the process exited at once")?;
    // Generous: on a busy 2-core machine (the test suite beside it) a debug build can take
    // over 10 s to listen.
    let deadline = Instant::now() + READY_WITHIN;
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            bail!("{} exited with {status}", binary.display());
        }
        // Whichever of its listening ports answers the ready path (the others are its side
        // channel or KV-event sockets: a short probe each).
        for port in listening_ports(pid) {
            let url = format!("http://127.0.0.1:{port}");
            let ready = format!("{url}{ready_path}");
            let probe = get_status(client, &ready);
            if tokio::time::timeout(Duration::from_millis(300), probe).await == Ok(Some(200)) {
                return Ok(ChildServer {
                    _child: child,
                    pid,
                    url,
                });
            }
        }
        if Instant::now() >= deadline {
            let _ = child.kill().await;
            bail!(
                "{} was not ready within {} s",
                binary.display(),
                READY_WITHIN.as_secs()
            );
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// How long a child server may take to answer its readiness path.
const READY_WITHIN: Duration = Duration::from_secs(30);

/// Where an engine publishes its KV-cache events.
#[derive(Debug, Clone, serde::Deserialize)]
pub struct KvSockets {
    #[serde(rename = "endpoint")]
    pub publisher: String,
    #[serde(rename = "replay_endpoint")]
    pub replay: String,
}

/// A router process routing endpoint `bench` to the engine from a static config file, with
/// `extra` flags.
pub async fn start_router(
    binary: &Path,
    config_dir: &Path,
    engine_url: &str,
    strategy: Strategy,
    extra: &[&str],
    client: &HttpClient,
) -> anyhow::Result<ChildServer> {
    start_router_with(
        binary, config_dir, engine_url, None, strategy, extra, client,
    )
    .await
}

/// [`start_router`], the engine declaring its KV-event sockets (KV_AWARE) if given.
pub async fn start_router_with(
    binary: &Path,
    config_dir: &Path,
    engine_url: &str,
    kv_events: Option<&KvSockets>,
    strategy: Strategy,
    extra: &[&str],
    client: &HttpClient,
) -> anyhow::Result<ChildServer> {
    let prefix = (strategy == Strategy::PrefixAware).then_some((1024, 1024));
    let variants: serde_json::Value =
        serde_json::from_str(&variants_json(strategy.as_str(), prefix))?;
    let mut instance = serde_json::json!({"Url": engine_url, "InstanceId": "engine-0"});
    if let Some(sockets) = kv_events {
        instance["KvEvents"] = sockets.publisher.clone().into();
        instance["KvEventsReplay"] = sockets.replay.clone().into();
    }
    let config = serde_json::json!({
        "Endpoints": [{
            "EndpointName": "bench",
            "ProductionVariants": variants,
            "Instances": [instance],
        }]
    });
    let path = config_dir.join("router.json");
    std::fs::write(&path, serde_json::to_vec_pretty(&config)?)?;
    let args = |listen: &str| -> Vec<std::ffi::OsString> {
        let mut args: Vec<std::ffi::OsString> = vec![
            "--listen".into(),
            listen.into(),
            "--config".into(),
            path.clone().into_os_string(),
        ];
        args.extend(extra.iter().map(Into::into));
        args
    };
    start_child(binary, &args, "/readyz", client).await
}

pub async fn get_status(client: &HttpClient, url: &str) -> Option<u16> {
    let request = http::Request::get(url).body(Full::new(Bytes::new())).ok()?;
    let response = tokio::time::timeout(Duration::from_secs(2), client.request(request))
        .await
        .ok()?
        .ok()?;
    let status = response.status().as_u16();
    let _ = response.into_body().collect().await;
    Some(status)
}

/// A free loopback port (bound, then released).
pub fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}
