//! A real etcd (Debian's `etcd-server`) per test on loopback ports in a temporary directory:
//! one member, plain or TLS ([`Etcd`]), or several forming a cluster whose members can be
//! frozen ([`EtcdCluster`]).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};

use crate::pki::TestPki;
use crate::ports::unused_port;
use crate::process::{kill_and_reap, signal_child};
use crate::{eventually, http_get};

/// A real etcd (Debian's `etcd-server`) for one test, stopped and wiped on drop.
pub struct Etcd {
    child: Child,
    pub url: String,
    _dir: tempfile::TempDir,
}

impl Etcd {
    /// etcd on plain HTTP (`http://127.0.0.1:PORT`).
    pub async fn start() -> anyhow::Result<Self> {
        Self::spawn(None).await
    }

    /// etcd serving clients over TLS only (`https://127.0.0.1:PORT`) with `pki`'s server
    /// certificate, and requiring a client certificate signed by `pki`'s CA
    /// (`--client-cert-auth`). Peers (there are none) stay on plain loopback.
    pub async fn start_tls(pki: &TestPki) -> anyhow::Result<Self> {
        Self::spawn(Some(pki)).await
    }

    /// Starts etcd on two unused ports; when another process takes one of them first (etcd
    /// cannot bind port 0), starts again on two others, at most 10 times.
    async fn spawn(tls: Option<&TestPki>) -> anyhow::Result<Self> {
        let binary = which("etcd").context(
            "etcd is not installed: run scripts/test (it installs Debian's etcd-server) or apt-get install etcd-server",
        )?;
        for _ in 0..10 {
            match Self::spawn_once(&binary, tls).await? {
                Some(etcd) => return Ok(etcd),
                None => continue,
            }
        }
        bail!("etcd found its ports taken 10 times in a row")
    }

    /// `None` when a port was taken.
    async fn spawn_once(binary: &Path, tls: Option<&TestPki>) -> anyhow::Result<Option<Self>> {
        let dir = tempfile::tempdir()?;
        let client_port = unused_port();
        let peer_port = unused_port();
        let scheme = if tls.is_some() { "https" } else { "http" };
        let url = format!("{scheme}://127.0.0.1:{client_port}");
        let peer = format!("http://127.0.0.1:{peer_port}");
        let log_path = dir.path().join("etcd.log");
        let log = std::fs::File::create(&log_path)?;
        let mut command = Command::new(binary);
        command
            .arg("--data-dir")
            .arg(dir.path().join("data"))
            .args(["--name", "default"])
            .args(["--listen-client-urls", &url])
            .args(["--advertise-client-urls", &url])
            .args(["--listen-peer-urls", &peer])
            .args(["--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &format!("default={peer}")])
            .args(["--heartbeat-interval=10", "--election-timeout=100"]);
        if let Some(pki) = tls {
            command
                .arg("--cert-file")
                .arg(&pki.server_cert)
                .arg("--key-file")
                .arg(&pki.server_key)
                .arg("--trusted-ca-file")
                .arg(&pki.ca)
                .arg("--client-cert-auth");
        }
        let child = command
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .context("cannot start etcd")?;
        let mut etcd = Self {
            child,
            url,
            _dir: dir,
        };
        match wait_serving(&mut [(&mut etcd.child, &log_path, client_port)]).await {
            Ok(EtcdStart::Serving) => {}
            Ok(EtcdStart::PortTaken) => return Ok(None),
            Err(err) => {
                etcd.kill();
                return Err(err);
            }
        }
        let ready = match tls {
            None => etcd.wait_healthy().await,
            Some(pki) => etcd.wait_serving_tls(pki).await,
        };
        if let Err(err) = ready {
            etcd.kill();
            return Err(err);
        }
        Ok(Some(etcd))
    }

    /// Plain HTTP: `/health` says true once etcd has a leader.
    async fn wait_healthy(&self) -> anyhow::Result<()> {
        let health = format!("{}/health", self.url);
        eventually(Duration::from_secs(20), "etcd to become healthy", || {
            let health = health.clone();
            async move { matches!(http_get(&health).await, Ok((200, body)) if body.contains("true")) }
        })
        .await
    }

    /// TLS: the gRPC health service answers SERVING to a client with the client certificate
    /// (the harness has no HTTPS client for `/health`; etcd waits for its leader on requests).
    async fn wait_serving_tls(&self, pki: &TestPki) -> anyhow::Result<()> {
        use tonic_health::pb::health_check_response::ServingStatus;
        let endpoint = tonic::transport::Endpoint::from_shared(self.url.clone())?
            .tls_config(pki.client_tls()?)?
            .connect_timeout(Duration::from_secs(1))
            .timeout(Duration::from_secs(1));
        eventually(
            Duration::from_secs(20),
            "etcd to serve gRPC over TLS",
            || {
                let endpoint = endpoint.clone();
                async move {
                    let Ok(channel) = endpoint.connect().await else {
                        return false;
                    };
                    let mut health = tonic_health::pb::health_client::HealthClient::new(channel);
                    let request = tonic_health::pb::HealthCheckRequest {
                        service: String::new(),
                    };
                    health.check(request).await.is_ok_and(|response| {
                        response.into_inner().status == ServingStatus::Serving as i32
                    })
                }
            },
        )
        .await
    }

    /// Stops etcd abruptly (SIGKILL).
    pub fn kill(&mut self) {
        kill_and_reap(&mut self.child);
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        self.kill();
    }
}

/// One member of an [`EtcdCluster`].
pub struct EtcdMember {
    child: Child,
    /// Client URL, `http://127.0.0.1:PORT`.
    pub url: String,
    frozen: bool,
}

/// Several etcd members forming one cluster on loopback, for tests of a member that stops
/// answering. A member can be frozen (SIGSTOP: its sockets stay open, nothing answers, as
/// with a hung process or a partition) and thawed. On drop every member is thawed and killed,
/// whatever happened before.
pub struct EtcdCluster {
    pub members: Vec<EtcdMember>,
    _dir: tempfile::TempDir,
}

impl EtcdCluster {
    /// Starts `size` members and waits until each serves clients (which an etcd member does
    /// once the cluster has a leader). etcd cannot bind port 0: when a port turns out taken,
    /// the whole cluster starts again on other ports, at most 10 times.
    pub async fn start(size: usize) -> anyhow::Result<Self> {
        let binary = which("etcd").context(
            "etcd is not installed: run scripts/test (it installs Debian's etcd-server) or apt-get install etcd-server",
        )?;
        for _ in 0..10 {
            if let Some(cluster) = Self::start_once(&binary, size).await? {
                return Ok(cluster);
            }
        }
        bail!("an etcd cluster found its ports taken 10 times in a row")
    }

    /// `None` when a port was taken.
    async fn start_once(binary: &Path, size: usize) -> anyhow::Result<Option<Self>> {
        let dir = tempfile::tempdir()?;
        let ports: Vec<(u16, u16)> = (0..size).map(|_| (unused_port(), unused_port())).collect();
        let initial_cluster = ports
            .iter()
            .enumerate()
            .map(|(index, (_, peer))| format!("m{index}=http://127.0.0.1:{peer}"))
            .collect::<Vec<_>>()
            .join(",");
        let mut cluster = Self {
            members: Vec::new(),
            _dir: dir,
        };
        let mut logs = Vec::new();
        // Dropping `cluster` (on an error or a taken port) kills what started.
        for (index, (client, peer)) in ports.iter().enumerate() {
            let url = format!("http://127.0.0.1:{client}");
            let peer_url = format!("http://127.0.0.1:{peer}");
            let log_path = cluster._dir.path().join(format!("m{index}.log"));
            let log = std::fs::File::create(&log_path)?;
            let child = Command::new(binary)
                .arg("--data-dir")
                .arg(cluster._dir.path().join(format!("m{index}")))
                .args(["--name", &format!("m{index}")])
                .args(["--listen-client-urls", &url])
                .args(["--advertise-client-urls", &url])
                .args(["--listen-peer-urls", &peer_url])
                .args(["--initial-advertise-peer-urls", &peer_url])
                .args(["--initial-cluster", &initial_cluster])
                .args(["--initial-cluster-state", "new"])
                .args(["--heartbeat-interval=50", "--election-timeout=500"])
                .stdout(Stdio::null())
                .stderr(log)
                .spawn()
                .context("cannot start etcd")?;
            cluster.members.push(EtcdMember {
                child,
                url,
                frozen: false,
            });
            logs.push((log_path, *client));
        }
        let mut waiting: Vec<(&mut Child, &Path, u16)> = cluster
            .members
            .iter_mut()
            .zip(&logs)
            .map(|(member, (log, port))| (&mut member.child, log.as_path(), *port))
            .collect();
        match wait_serving(&mut waiting).await? {
            EtcdStart::Serving => Ok(Some(cluster)),
            EtcdStart::PortTaken => Ok(None),
        }
    }

    pub fn urls(&self) -> Vec<String> {
        self.members
            .iter()
            .map(|member| member.url.clone())
            .collect()
    }

    /// Stops member `index` where it stands (SIGSTOP).
    pub fn freeze(&mut self, index: usize) -> anyhow::Result<()> {
        let member = &mut self.members[index];
        signal_child(&member.child, "STOP")?;
        member.frozen = true;
        Ok(())
    }

    /// Lets a frozen member run again (SIGCONT).
    pub fn thaw(&mut self, index: usize) -> anyhow::Result<()> {
        let member = &mut self.members[index];
        signal_child(&member.child, "CONT")?;
        member.frozen = false;
        Ok(())
    }
}

impl Drop for EtcdCluster {
    fn drop(&mut self) {
        for member in &mut self.members {
            if member.frozen {
                let _ = signal_child(&member.child, "CONT");
            }
            kill_and_reap(&mut member.child);
        }
    }
}

/// How the start of etcd processes on ports picked by [`unused_port`] ended.
enum EtcdStart {
    /// Each one logged that it serves clients on its own port.
    Serving,
    /// One exited because another process had taken one of its ports first.
    PortTaken,
}

/// Waits (at most 20 s) until each etcd `(process, log file, client port)` logs that it serves
/// client requests on its port (so an answer on the port is this etcd's, not another one's
/// that took the port), or one of them exits because a port was taken.
async fn wait_serving(etcds: &mut [(&mut Child, &Path, u16)]) -> anyhow::Result<EtcdStart> {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let mut serving = 0;
        for (child, log_path, client_port) in etcds.iter_mut() {
            let log = std::fs::read_to_string(*log_path).unwrap_or_default();
            if log.contains(&format!("client requests on 127.0.0.1:{client_port}")) {
                serving += 1;
            } else if let Some(status) = child.try_wait()? {
                if log.contains("address already in use") {
                    return Ok(EtcdStart::PortTaken);
                }
                bail!("etcd exited ({status}) before serving:\n{log}");
            }
        }
        if serving == etcds.len() {
            return Ok(EtcdStart::Serving);
        }
        if Instant::now() >= deadline {
            let logs: Vec<String> = etcds
                .iter()
                .map(|(_, log_path, _)| std::fs::read_to_string(log_path).unwrap_or_default())
                .collect();
            bail!("etcd did not serve within 20 s:\n{}", logs.join("\n---\n"));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn which(name: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|dir| dir.join(name))
            .find(|candidate| candidate.is_file())
    })
}
