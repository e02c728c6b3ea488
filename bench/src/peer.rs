//! Peer routers run in front of the same simulated engines as Switchyard, so that `compare`
//! can put them in the same table: today the SGLang model gateway (`pip install
//! sglang-router`, binary `smg`) with its `cache_aware` policy. Optional: a missing binary
//! skips the peer's runs with a note, it never fails a comparison.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use serde::Serialize;

use crate::child::free_port;
use crate::client::HttpClient;

/// A peer router.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, clap::ValueEnum, Serialize)]
pub enum Peer {
    /// The SGLang model gateway (`smg launch … --policy cache_aware`), one process per router.
    #[value(name = "sglang")]
    Sglang,
}

impl Peer {
    /// The column name in reports.
    pub fn name(self) -> &'static str {
        match self {
            Peer::Sglang => "SGLang cache_aware",
        }
    }

    /// The binary, and how to install it, for messages.
    pub fn binary_name(self) -> &'static str {
        match self {
            Peer::Sglang => "smg",
        }
    }

    pub fn install_hint(self) -> &'static str {
        match self {
            Peer::Sglang => {
                "python3 -m venv target/peers && target/peers/bin/pip install sglang-router"
            }
        }
    }

    /// `explicit`, else the binary on PATH, else in the `target/peers` venv of the current
    /// directory (where docs/benchmarks.md installs it).
    pub fn find_binary(self, explicit: Option<&Path>) -> Option<PathBuf> {
        if let Some(path) = explicit {
            return path.is_file().then(|| path.to_path_buf());
        }
        let name = self.binary_name();
        let on_path = std::env::var_os("PATH").and_then(|paths| {
            std::env::split_paths(&paths)
                .map(|dir| dir.join(name))
                .find(|candidate| candidate.is_file())
        });
        on_path.or_else(|| {
            let venv = Path::new("target/peers/bin").join(name);
            venv.is_file().then_some(venv)
        })
    }
}

/// Running peer router processes (killed on drop).
pub struct PeerRouters {
    pub urls: Vec<String>,
    children: Vec<tokio::process::Child>,
    _logs: tempfile::TempDir,
}

impl PeerRouters {
    /// Starts `count` processes of `peer`, each in front of every engine, and waits until each
    /// reports every engine healthy.
    pub async fn start(
        peer: Peer,
        binary: &Path,
        count: usize,
        engine_urls: &[String],
        client: &HttpClient,
    ) -> anyhow::Result<Self> {
        let logs = tempfile::Builder::new()
            .prefix("switchyard-bench-peer-")
            .tempdir()
            .context("cannot create a directory for the peer's logs")?;
        let mut routers = Self {
            urls: Vec::new(),
            children: Vec::new(),
            _logs: logs,
        };
        for index in 0..count {
            let port = free_port()?;
            let metrics_port = free_port()?;
            let log_path = routers._logs.path().join(format!("{index}.log"));
            let log = std::fs::File::create(&log_path)?;
            let mut command = tokio::process::Command::new(binary);
            match peer {
                Peer::Sglang => {
                    command
                        .args(["launch", "--host", "127.0.0.1", "--port"])
                        .arg(port.to_string())
                        .arg("--worker-urls")
                        .args(engine_urls)
                        .args(["--policy", "cache_aware", "--log-level", "warn"])
                        .args(["--prometheus-host", "127.0.0.1", "--prometheus-port"])
                        .arg(metrics_port.to_string());
                }
            }
            let child = command
                .stdin(Stdio::null())
                .stdout(log.try_clone()?)
                .stderr(log)
                .kill_on_drop(true)
                .spawn()
                .with_context(|| format!("cannot start {}", binary.display()))?;
            routers.children.push(child);
            let url = format!("http://127.0.0.1:{port}");
            routers
                .wait_ready(&url, engine_urls.len(), client)
                .await
                .with_context(|| {
                    let log = std::fs::read_to_string(&log_path).unwrap_or_default();
                    let tail: Vec<&str> = log.lines().rev().take(5).collect();
                    format!(
                        "{} on {url} (last log lines, newest first: {tail:?})",
                        peer.name()
                    )
                })?;
            routers.urls.push(url);
        }
        Ok(routers)
    }

    /// GET /readiness until it reports `workers` healthy workers (30 s at most).
    async fn wait_ready(
        &mut self,
        url: &str,
        workers: usize,
        client: &HttpClient,
    ) -> anyhow::Result<()> {
        let deadline = Instant::now() + Duration::from_secs(30);
        let ready = format!("{url}/readiness");
        loop {
            if let Some(child) = self.children.last_mut()
                && let Ok(Some(status)) = child.try_wait()
            {
                anyhow::bail!("exited with {status}");
            }
            if let Ok(text) = crate::scrape::get_text(client, &ready).await
                && let Ok(body) = serde_json::from_str::<serde_json::Value>(&text)
                && body["healthy_workers"].as_u64() == Some(workers as u64)
            {
                return Ok(());
            }
            if Instant::now() >= deadline {
                anyhow::bail!("not ready with {workers} healthy workers within 30 s");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Stops every process.
    pub async fn shutdown(mut self) {
        for child in &mut self.children {
            let _ = child.kill().await;
        }
    }
}
