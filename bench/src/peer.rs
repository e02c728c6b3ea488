//! Peer routers run in front of the same simulated engines as Switchyard, so that `compare`
//! can put them in the same table: the SGLang model gateway in its two PyPI lineages, the older
//! `sglang-router` (0.3.2, whose binary prints `sgl-model-gateway`) and the current `smg`
//! (1.13.0), both with their `cache_aware` policy. Both install a binary named `smg`, so each is
//! looked for in its own venv first and a candidate is taken only when its `--version` names its
//! lineage. Optional: a missing binary skips the peer's runs with a note, it never fails a
//! comparison.

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
    /// The SGLang model gateway as PyPI's `sglang-router` 0.3.2 ships it (`smg launch …
    /// --policy cache_aware`), one process per router.
    #[value(name = "sglang")]
    Sglang,
    /// The current SGLang model gateway, PyPI's `smg` 1.13.0 (same command line).
    #[value(name = "smg")]
    Smg,
}

impl Peer {
    /// The column name in reports.
    pub fn name(self) -> &'static str {
        match self {
            Peer::Sglang => "SGLang cache_aware",
            Peer::Smg => "smg cache_aware",
        }
    }

    /// The binary, and how to install it, for messages.
    pub fn binary_name(self) -> &'static str {
        "smg"
    }

    /// The flag that names the binary.
    pub fn flag(self) -> &'static str {
        match self {
            Peer::Sglang => "--sglang-bin",
            Peer::Smg => "--smg-bin",
        }
    }

    pub fn install_hint(self) -> &'static str {
        match self {
            Peer::Sglang => {
                "python3 -m venv target/peers-sglang && target/peers-sglang/bin/pip install sglang-router==0.3.2"
            }
            Peer::Smg => {
                "python3 -m venv target/peers-smg && target/peers-smg/bin/pip install smg==1.13.0"
            }
        }
    }

    /// What the first word of `smg --version` is for this lineage.
    fn version_word(self) -> &'static str {
        match self {
            Peer::Sglang => "sgl-model-gateway",
            Peer::Smg => "smg",
        }
    }

    /// Whether `version` (the output of `smg --version`) is this peer's lineage.
    pub fn is_version_of(self, version: &str) -> bool {
        version.split_whitespace().next() == Some(self.version_word())
    }

    /// `explicit` as given, else the first `smg` of this lineage among: this peer's venv under
    /// `target/` of the current directory (where docs/benchmarks.md installs it), PATH, and
    /// `target/peers/bin` (the older single venv).
    pub fn find_binary(self, explicit: Option<&Path>) -> Option<PathBuf> {
        if let Some(path) = explicit {
            return path.is_file().then(|| path.to_path_buf());
        }
        let name = self.binary_name();
        let venv = match self {
            Peer::Sglang => "target/peers-sglang/bin",
            Peer::Smg => "target/peers-smg/bin",
        };
        let on_path = std::env::var_os("PATH")
            .map(|paths| std::env::split_paths(&paths).collect::<Vec<_>>())
            .unwrap_or_default();
        std::iter::once(PathBuf::from(venv))
            .chain(on_path)
            .chain(std::iter::once(PathBuf::from("target/peers/bin")))
            .map(|dir| dir.join(name))
            .filter(|candidate| candidate.is_file())
            .find(|candidate| {
                binary_version(candidate).is_some_and(|version| self.is_version_of(&version))
            })
    }
}

/// The first line of `binary --version`; None if it cannot run or takes over 10 s (killed).
pub fn binary_version(binary: &Path) -> Option<String> {
    let mut child = std::process::Command::new(binary)
        .arg("--version")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .ok()?;
    let deadline = Instant::now() + Duration::from_secs(10);
    while child.try_wait().ok()?.is_none() {
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let output = child.wait_with_output().ok()?;
    let text = String::from_utf8_lossy(&output.stdout).into_owned()
        + &String::from_utf8_lossy(&output.stderr);
    text.lines()
        .map(str::trim)
        .find(|line| !line.is_empty())
        .map(str::to_owned)
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
                Peer::Sglang | Peer::Smg => {
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

#[cfg(test)]
mod tests {
    use super::Peer;

    #[test]
    fn a_version_line_names_its_lineage() {
        assert!(Peer::Sglang.is_version_of("sgl-model-gateway 0.3.2"));
        assert!(!Peer::Smg.is_version_of("sgl-model-gateway 0.3.2"));
        assert!(Peer::Smg.is_version_of("smg 1.13.0"));
        assert!(!Peer::Sglang.is_version_of("smg 1.13.0"));
        assert!(!Peer::Smg.is_version_of(""));
    }
}
