//! The integration-test harness: a real etcd on loopback ports in a temporary directory
//! (plain, or TLS with client certificates from a throwaway CA), control planes and routers
//! started in-process on `127.0.0.1:0`, the built binaries as real processes (which report the
//! port they bound), and small HTTP/gRPC helpers. Nothing is mocked.
//!
//! Rules the helpers keep, so that tests run in parallel without taking each other's ports or
//! hanging CI: every server binds `127.0.0.1:0` and reports the port it got (etcd cannot, so
//! its start is retried on a conflict); an address meant to refuse connections is held bound
//! by [`RefusingPort`] so nobody else can take it; every wait and every HTTP exchange has a
//! deadline; a binary older than its sources is refused ([`binary`]).

use std::io::{BufRead as _, BufReader};
use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use anyhow::{Context, bail};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use switchyard_proto::v1 as pb;
use switchyard_proto::v1::admin_client::AdminClient;
use tonic::transport::Channel;

/// The longest any one HTTP exchange of the helpers below may take (response head and whole
/// body): a stuck server fails the test with a message instead of hanging it.
pub const HTTP_TIMEOUT: Duration = Duration::from_secs(30);

/// A loopback port nobody listens on right now, for etcd, which must be told its ports up
/// front. Bound then released, so another process may take it before etcd does: `Etcd`
/// retries its start on a conflict. Everything else binds `127.0.0.1:0` itself.
fn unused_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .map(|addr| addr.port())
        .expect("a free loopback port")
}

pub fn loopback_any() -> SocketAddr {
    "127.0.0.1:0".parse().expect("loopback address")
}

/// A loopback address that refuses connections for as long as this value lives: the port is
/// bound (so no parallel test can take it) but never listens, so a connection attempt gets a
/// reset at once. For "connection refused" checks, which a released port cannot give reliably.
pub struct RefusingPort {
    pub addr: SocketAddr,
    socket: Option<tokio::net::TcpSocket>,
}

impl RefusingPort {
    pub fn new() -> anyhow::Result<Self> {
        let socket = tokio::net::TcpSocket::new_v4()?;
        socket.bind(loopback_any())?;
        let addr = socket.local_addr()?;
        Ok(Self {
            addr,
            socket: Some(socket),
        })
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Starts listening on the held port (a service coming back on the address it had).
    pub fn listen(mut self) -> anyhow::Result<tokio::net::TcpListener> {
        let socket = self.socket.take().context("already listening")?;
        Ok(socket.listen(128)?)
    }
}

/// Whether this process has a socket listening on `addr` (IPv4). Read from /proc (the
/// listening sockets of the network namespace, matched to this process's file descriptors),
/// so "our listener closed" does not depend on the port staying free: a connection attempt
/// would succeed if a parallel test bound the port after we released it.
pub fn listens_in_this_process(addr: SocketAddr) -> bool {
    let std::net::IpAddr::V4(ip) = addr.ip() else {
        return false;
    };
    // /proc/net/tcp writes the address as the little-endian u32 in hex, then the port.
    let local = format!(
        "{:08X}:{:04X}",
        u32::from_le_bytes(ip.octets()),
        addr.port()
    );
    let table = std::fs::read_to_string("/proc/net/tcp").unwrap_or_default();
    let listening: Vec<String> = table
        .lines()
        .skip(1)
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            // local_address, state 0A = LISTEN, inode
            (fields.get(1) == Some(&local.as_str()) && fields.get(3) == Some(&"0A"))
                .then(|| fields.get(9).map(|inode| format!("socket:[{inode}]")))
                .flatten()
        })
        .collect();
    if listening.is_empty() {
        return false;
    }
    std::fs::read_dir("/proc/self/fd")
        .map(|fds| {
            fds.filter_map(Result::ok).any(|fd| {
                std::fs::read_link(fd.path()).is_ok_and(|target| {
                    listening
                        .iter()
                        .any(|socket| target.as_os_str() == socket.as_str())
                })
            })
        })
        .unwrap_or(false)
}

/// Waits until `check` holds, polling every 20 ms, for at most `limit`.
pub async fn eventually<F, Fut>(limit: Duration, what: &str, mut check: F) -> anyhow::Result<()>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + limit;
    loop {
        if check().await {
            return Ok(());
        }
        if Instant::now() >= deadline {
            bail!("timed out after {limit:?} waiting for {what}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Runs the `openssl` CLI (`scripts/ensure-deps --for-tests` installs it), failing with its
/// stderr.
fn openssl(command: &mut Command) -> anyhow::Result<()> {
    let output = command
        .stdin(Stdio::null())
        .output()
        .context("cannot run openssl: run scripts/test (it installs openssl)")?;
    if !output.status.success() {
        bail!(
            "openssl failed: {}",
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    Ok(())
}

/// A throwaway PKI made with the `openssl` CLI, as the `--tls-cert` test makes its certificate:
/// a CA, a server certificate for 127.0.0.1 (IP SAN) and a client certificate, both signed by
/// the CA. EC P-256 keys (PKCS#8 PEM), valid for a day, in a temporary directory.
pub struct TestPki {
    pub ca: PathBuf,
    pub server_cert: PathBuf,
    pub server_key: PathBuf,
    pub client_cert: PathBuf,
    pub client_key: PathBuf,
    dir: tempfile::TempDir,
}

impl TestPki {
    pub fn generate() -> anyhow::Result<Self> {
        let dir = tempfile::tempdir()?;
        let path = |name: &str| dir.path().join(name);
        let new_key = [
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
        ];
        openssl(
            Command::new("openssl")
                .args(["req", "-x509", "-days", "1"])
                .args(new_key)
                .args(["-subj", "/CN=switchyard test CA"])
                .args(["-addext", "basicConstraints=critical,CA:TRUE"])
                .args(["-addext", "keyUsage=critical,keyCertSign,cRLSign"])
                .arg("-keyout")
                .arg(path("ca.key"))
                .arg("-out")
                .arg(path("ca.pem")),
        )?;
        let pki = Self {
            ca: path("ca.pem"),
            server_cert: path("server.pem"),
            server_key: path("server.key"),
            client_cert: path("client.pem"),
            client_key: path("client.key"),
            dir,
        };
        // etcd 3.4's gateway dials its own gRPC port with the server certificate, so that one
        // is a client too.
        pki.sign(
            "server",
            "/CN=etcd",
            "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth",
        )?;
        pki.sign(
            "client",
            "/CN=switchyard-control",
            "extendedKeyUsage=clientAuth",
        )?;
        Ok(pki)
    }

    /// Makes `{name}.key` and `{name}.pem`, signed by the CA, with the given v3 extensions.
    fn sign(&self, name: &str, subject: &str, extensions: &str) -> anyhow::Result<()> {
        let path = |file: String| self.dir.path().join(file);
        let extensions_file = path(format!("{name}.ext"));
        std::fs::write(
            &extensions_file,
            format!(
                "basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature\n{extensions}\n"
            ),
        )?;
        openssl(
            Command::new("openssl")
                .args(["req", "-new", "-newkey", "ec"])
                .args(["-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"])
                .args(["-subj", subject])
                .arg("-keyout")
                .arg(path(format!("{name}.key")))
                .arg("-out")
                .arg(path(format!("{name}.csr"))),
        )?;
        openssl(
            Command::new("openssl")
                .args(["x509", "-req", "-days", "1", "-CAcreateserial"])
                .arg("-in")
                .arg(path(format!("{name}.csr")))
                .arg("-CA")
                .arg(&self.ca)
                .arg("-CAkey")
                .arg(path("ca.key".into()))
                .arg("-extfile")
                .arg(&extensions_file)
                .arg("-out")
                .arg(path(format!("{name}.pem"))),
        )
    }

    /// A gRPC client TLS configuration trusting this CA and presenting the client certificate.
    pub fn client_tls(&self) -> anyhow::Result<tonic::transport::ClientTlsConfig> {
        use tonic::transport::{Certificate, ClientTlsConfig, Identity};
        Ok(ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(std::fs::read(&self.ca)?))
            .identity(Identity::from_pem(
                std::fs::read(&self.client_cert)?,
                std::fs::read(&self.client_key)?,
            )))
    }
}

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
        let _ = self.child.kill();
        let _ = self.child.wait();
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
            let _ = member.child.kill();
            let _ = member.child.wait();
        }
    }
}

/// Sends a signal by name to a child process that must still be there (`kill -NAME PID`).
fn signal_child(child: &Child, name: &str) -> anyhow::Result<()> {
    let status = Command::new("kill")
        .arg(format!("-{name}"))
        .arg(child.id().to_string())
        .status()
        .context("cannot run kill")?;
    if !status.success() {
        bail!("kill -{name} {} failed: {status}", child.id());
    }
    Ok(())
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

/// Sends `signal` (a name `kill -s` knows: TERM, KILL, STOP, CONT) to process `pid`.
pub fn signal(pid: u32, signal: &str) {
    let status = Command::new("kill")
        .args(["-s", signal, &pid.to_string()])
        .stderr(Stdio::null())
        .status();
    // A process that already exited cannot be signalled; callers check what they expect.
    drop(status);
}

/// A built binary of this workspace (`scripts/test` builds them before the tests run).
///
/// Refuses (panics) when the binary is missing or older than any source file it was built
/// from (its cargo dep-info, `target/debug/NAME.d`, lists them), so `cargo test` after an edit
/// cannot silently test yesterday's binary.
pub fn binary(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    // target/debug/deps/<test> -> target/debug/<name>
    let dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("target directory")
        .to_path_buf();
    let path = dir.join(name);
    let rebuild = "build the binaries first: cargo build --workspace --bins (scripts/test does)";
    let built = std::fs::metadata(&path)
        .and_then(|meta| meta.modified())
        .unwrap_or_else(|_| panic!("{} is missing: {rebuild}", path.display()));
    let dep_info = dir.join(format!("{name}.d"));
    let sources = std::fs::read_to_string(&dep_info).unwrap_or_else(|err| {
        panic!(
            "{}: {err}: cannot tell whether {name} is up to date; {rebuild}",
            dep_info.display()
        )
    });
    if let Some(newer) = newer_sources(&sources, built).first() {
        panic!(
            "{} is older than its source {}: {rebuild}",
            path.display(),
            newer.display()
        );
    }
    path
}

/// The files of a Makefile-style dep-info (`target: a.rs b.rs`, spaces in names escaped with
/// a backslash) changed after `built`. A source that no longer exists counts as changed. A
/// source a build script generated (`.../build/PKG-HASH/out/...`) is rewritten, with the same
/// text, whenever cargo runs the script again (another build's features, say), so it counts
/// by the script's own inputs, its `rerun-if-changed` paths (see [`generated_inputs`]).
fn newer_sources(dep_info: &str, built: SystemTime) -> Vec<PathBuf> {
    let first_rule = dep_info.lines().next().unwrap_or_default();
    let Some((_, sources)) = first_rule.split_once(": ") else {
        return Vec::new();
    };
    let mut files = Vec::new();
    let mut current = String::new();
    let mut chars = sources.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\\' if chars.peek() == Some(&' ') => {
                current.push(' ');
                chars.next();
            }
            ' ' => files.push(std::mem::take(&mut current)),
            c => current.push(c),
        }
    }
    files.push(current);
    let files: Vec<PathBuf> = files
        .into_iter()
        .filter(|file| !file.is_empty())
        .map(PathBuf::from)
        .collect();
    let changed = |file: &Path| {
        let modified = std::fs::metadata(file).and_then(|meta| meta.modified());
        !modified.is_ok_and(|modified| modified <= built)
    };
    let mut newer = Vec::new();
    for file in &files {
        if !changed(file) {
            continue;
        }
        match generated_inputs(file, &files) {
            Some(inputs) => newer.extend(inputs.into_iter().filter(|input| changed(input))),
            None => newer.push(file.clone()),
        }
    }
    newer
}

/// For a file a build script wrote (`.../build/PKG-HASH/out/...`): the files its script said
/// to rerun on (`cargo:rerun-if-changed` in `.../build/PKG-HASH/output`, relative to the
/// package's directory, a directory standing for every file in it). The package's directory
/// is found among the ancestors of the other `sources` (the package's own sources are among
/// them). `None` when the file is not generated or this cannot be told: then it counts as is.
fn generated_inputs(file: &Path, sources: &[PathBuf]) -> Option<Vec<PathBuf>> {
    let build_dir = file
        .ancestors()
        .find(|dir| dir.file_name() == Some("out".as_ref()))?
        .parent()?;
    if build_dir.parent()?.file_name() != Some("build".as_ref()) {
        return None;
    }
    let (package, _hash) = build_dir.file_name()?.to_str()?.rsplit_once('-')?;
    let output = std::fs::read_to_string(build_dir.join("output")).ok()?;
    let reruns: Vec<&str> = output
        .lines()
        .filter_map(|line| {
            line.strip_prefix("cargo:rerun-if-changed=")
                .or_else(|| line.strip_prefix("cargo::rerun-if-changed="))
        })
        .collect();
    if reruns.is_empty() {
        // Without it, cargo reruns the script on any change in the package: not told here.
        return None;
    }
    let name_line = format!("name = \"{package}\"");
    let package_dir = sources
        .iter()
        .flat_map(|source| source.ancestors().skip(1))
        .find(|dir| {
            std::fs::read_to_string(dir.join("Cargo.toml"))
                .is_ok_and(|manifest| manifest.lines().any(|line| line.trim() == name_line))
        })?;
    let mut inputs = Vec::new();
    for rerun in reruns {
        let mut pending = vec![package_dir.join(rerun)];
        while let Some(path) = pending.pop() {
            match std::fs::read_dir(&path) {
                Ok(entries) => pending.extend(entries.filter_map(Result::ok).map(|e| e.path())),
                // A file, or a path that does not exist (which cargo also reruns on).
                Err(_) => inputs.push(path),
            }
        }
    }
    Some(inputs)
}

/// One of the workspace's binaries running as a real process, its JSON log lines collected.
/// Killed (SIGKILL) on drop.
pub struct Process {
    /// The address it reported it listens on.
    pub addr: SocketAddr,
    child: Child,
    logs: Arc<Mutex<Vec<String>>>,
    name: String,
}

impl Process {
    /// Starts `binary` with `args` and `--log-format json`, and waits (at most 30 s) for its
    /// log line with message `listening`, whose `addr` field is the address it bound (give it
    /// `--listen 127.0.0.1:0`).
    pub fn start(binary_name: &str, args: &[&str], listening: &str) -> anyhow::Result<Self> {
        Self::start_with_env(binary_name, args, &[], listening)
    }

    /// [`Process::start`] with environment variables set for the process.
    pub fn start_with_env(
        binary_name: &str,
        args: &[&str],
        env: &[(&str, &str)],
        listening: &str,
    ) -> anyhow::Result<Self> {
        let mut child = Command::new(binary(binary_name))
            .args(args)
            .envs(env.iter().copied())
            .args(["--log-format", "json"])
            .env_remove("SWITCHYARD_CONTROL_PLANE")
            .env_remove("RUST_LOG")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .with_context(|| format!("cannot start {binary_name}"))?;
        let stderr = child.stderr.take().context("stderr")?;
        let logs = Arc::new(Mutex::new(Vec::new()));
        let (lines_tx, lines) = std::sync::mpsc::channel::<String>();
        let collected = Arc::clone(&logs);
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                collected
                    .lock()
                    .unwrap_or_else(|poison| poison.into_inner())
                    .push(line.clone());
                let _ = lines_tx.send(line);
            }
        });
        let mut process = Self {
            addr: loopback_any(),
            child,
            logs,
            name: binary_name.to_owned(),
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let line = match lines.recv_timeout(deadline.saturating_duration_since(Instant::now()))
            {
                Ok(line) => line,
                Err(_) => {
                    process.kill();
                    bail!(
                        "{binary_name} did not log {listening:?} within 30 s:\n{}",
                        process.logs().join("\n")
                    );
                }
            };
            let Ok(entry) = serde_json::from_str::<serde_json::Value>(&line) else {
                continue;
            };
            if entry["message"] == listening
                && let Some(addr) = entry["addr"].as_str()
            {
                process.addr = addr.parse().with_context(|| format!("address {addr}"))?;
                return Ok(process);
            }
        }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The log lines so far.
    pub fn logs(&self) -> Vec<String> {
        self.logs
            .lock()
            .unwrap_or_else(|poison| poison.into_inner())
            .clone()
    }

    /// Sends SIGTERM.
    pub fn terminate(&self) {
        signal(self.child.id(), "TERM");
    }

    /// Waits at most `limit` for the process to exit.
    pub fn wait_exit(&mut self, limit: Duration) -> anyhow::Result<ExitStatus> {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(status) = self.child.try_wait()? {
                return Ok(status);
            }
            if Instant::now() >= deadline {
                bail!(
                    "{} did not exit within {limit:?}:\n{}",
                    self.name,
                    self.logs().join("\n")
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Stops it abruptly (SIGKILL), as a crash would, and reaps it.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        self.kill();
    }
}

type HttpClient = Client<HttpConnector, Full<Bytes>>;

fn http_client() -> HttpClient {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    Client::builder(TokioExecutor::new()).build(connector)
}

/// `exchange`, failing after [`HTTP_TIMEOUT`] instead of waiting forever.
async fn bounded<T>(
    what: impl std::fmt::Display,
    exchange: impl std::future::Future<Output = anyhow::Result<T>>,
) -> anyhow::Result<T> {
    tokio::time::timeout(HTTP_TIMEOUT, exchange)
        .await
        .with_context(|| format!("{what}: no complete answer within {HTTP_TIMEOUT:?}"))?
        .with_context(|| what.to_string())
}

/// GET, returning (status, body).
pub async fn http_get(url: &str) -> anyhow::Result<(u16, String)> {
    bounded(format!("GET {url}"), async {
        let response = http_client().get(url.parse()?).await?;
        let status = response.status().as_u16();
        let body = response.into_body().collect().await?.to_bytes();
        Ok((status, String::from_utf8_lossy(&body).into_owned()))
    })
    .await
}

/// A response read whole.
#[derive(Debug)]
pub struct Reply {
    pub status: u16,
    pub headers: http::HeaderMap,
    pub body: String,
}

impl Reply {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|value| value.to_str().ok())
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body).unwrap_or(serde_json::Value::Null)
    }
}

/// POST a JSON body with headers, reading the whole response.
pub async fn http_post(
    url: &str,
    headers: &[(&str, &str)],
    body: impl Into<Bytes>,
) -> anyhow::Result<Reply> {
    let mut with_type = Vec::with_capacity(headers.len() + 1);
    with_type.push(("content-type", "application/json"));
    with_type.extend_from_slice(headers);
    http_request(http::Method::POST, url, &with_type, body).await
}

/// Any method, with headers and a body (empty for none), reading the whole response (bounded
/// like [`http_get`]).
pub async fn http_request(
    method: http::Method,
    url: &str,
    headers: &[(&str, &str)],
    body: impl Into<Bytes>,
) -> anyhow::Result<Reply> {
    let mut request = http::Request::builder().method(method.clone()).uri(url);
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let request = request.body(Full::new(body.into()))?;
    bounded(format!("{method} {url}"), async {
        let response = http_client().request(request).await?;
        let status = response.status().as_u16();
        let headers = response.headers().clone();
        let body = response.into_body().collect().await?.to_bytes();
        Ok(Reply {
            status,
            headers,
            body: String::from_utf8_lossy(&body).into_owned(),
        })
    })
    .await
}

/// The test venv's Python (`scripts/ensure-deps --for-tests` installs the `openai`, `boto3`,
/// `msgspec` and `pyzmq` clients there): `$SWITCHYARD_TEST_PYTHON`, else
/// `target/python/bin/python` of the workspace.
pub fn test_python() -> PathBuf {
    let python = std::env::var("SWITCHYARD_TEST_PYTHON")
        .unwrap_or_else(|_| "target/python/bin/python".into());
    let python = if Path::new(&python).is_absolute() {
        PathBuf::from(python)
    } else {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("..")
            .join(python)
    };
    assert!(
        python.is_file(),
        "{} is missing: scripts/test installs the Python clients there",
        python.display()
    );
    python
}

/// The longest one admin call may take before the test fails instead of hanging.
pub const RPC_TIMEOUT: Duration = Duration::from_secs(30);

/// An admin client of a control plane (each call bounded by [`RPC_TIMEOUT`]).
pub async fn admin(url: &str) -> anyhow::Result<AdminClient<Channel>> {
    let channel = tonic::transport::Endpoint::from_shared(url.to_owned())?
        .connect_timeout(Duration::from_secs(5))
        .timeout(RPC_TIMEOUT)
        .connect()
        .await
        .with_context(|| format!("admin client of {url}"))?;
    Ok(AdminClient::new(channel))
}

/// Waits at most `limit` for `control_plane` to lead.
pub async fn wait_leader(
    control_plane: &switchyard_control::ControlPlane,
    limit: Duration,
) -> anyhow::Result<()> {
    tokio::time::timeout(limit, control_plane.wait_leader())
        .await
        .with_context(|| {
            format!(
                "replica {} did not lead within {limit:?}",
                control_plane.replica_id
            )
        })
}

/// A SageMaker ProductionVariants JSON for one variant.
pub fn variant_json(strategy: &str, prefix: Option<(u32, u32)>) -> String {
    let prefix = match prefix {
        Some((length, threshold)) => format!(
            r#","PrefixAwareRoutingConfig":{{"PrefixLength":{length},"ConcurrencyThreshold":{threshold}}}"#
        ),
        None => String::new(),
    };
    format!(
        r#"[{{"VariantName":"AllTraffic","ModelName":"sim","InitialInstanceCount":1,"RoutingConfig":{{"RoutingStrategy":"{strategy}"{prefix}}}}}]"#
    )
}

/// Builds a CreateEndpointConfig request from SageMaker JSON (health checks every 200 ms,
/// unhealthy after 2 failures, healthy again after 1 success).
pub fn config_request(name: &str, variants_json: &str) -> pb::CreateEndpointConfigRequest {
    config_request_with_health(
        name,
        variants_json,
        switchyard_shared::HealthCheckConfig {
            interval_ms: 200,
            unhealthy_threshold: 2,
            healthy_threshold: 1,
            ..Default::default()
        },
    )
}

/// Builds a CreateEndpointConfig request from SageMaker JSON with these health checks.
pub fn config_request_with_health(
    name: &str,
    variants_json: &str,
    health_check_config: switchyard_shared::HealthCheckConfig,
) -> pb::CreateEndpointConfigRequest {
    let variants = switchyard_shared::sagemaker::parse_production_variants(variants_json)
        .expect("test JSON parses")
        .variants;
    let config = switchyard_shared::EndpointConfig {
        endpoint_config_name: switchyard_shared::EndpointConfigName::new(name).expect("name"),
        production_variants: variants,
        health_check_config,
        creation_time_ms: 0,
        disaggregation_config: None,
    };
    pb::CreateEndpointConfigRequest {
        endpoint_config: Some((&config).into()),
    }
}

/// Creates config `{endpoint}-cfg` and endpoint `endpoint`.
pub async fn create_endpoint(
    admin: &mut AdminClient<Channel>,
    endpoint: &str,
    variants_json: &str,
) -> anyhow::Result<()> {
    let config = format!("{endpoint}-cfg");
    admin
        .create_endpoint_config(config_request(&config, variants_json))
        .await?;
    admin
        .create_endpoint(pb::CreateEndpointRequest {
            name: endpoint.into(),
            endpoint_config_name: config,
        })
        .await?;
    Ok(())
}

/// Registers an instance without a lease.
pub async fn register(
    admin: &mut AdminClient<Channel>,
    endpoint: &str,
    id: &str,
    url: &str,
) -> anyhow::Result<pb::Instance> {
    Ok(admin
        .register_instance(pb::RegisterInstanceRequest {
            endpoint_name: endpoint.into(),
            variant_name: "AllTraffic".into(),
            url: url.into(),
            id: id.into(),
            ..Default::default()
        })
        .await?
        .into_inner())
}

/// Starts an in-process control plane.
pub async fn control_plane(
    config: switchyard_control::ControlConfig,
) -> anyhow::Result<switchyard_control::ControlPlane> {
    let settings = config.validate()?;
    Ok(switchyard_control::ControlPlane::start(settings).await?)
}

/// A control plane on a fresh embedded store in `dir`.
pub async fn embedded_control_plane(
    dir: &Path,
) -> anyhow::Result<switchyard_control::ControlPlane> {
    control_plane(switchyard_control::ControlConfig::embedded(
        loopback_any(),
        dir.to_path_buf(),
    ))
    .await
}

/// Starts an in-process router following `control_planes`, serving on two threads (the
/// test's runtime and one of its own) as the binary does on a 2-CPU machine, so that every
/// router test also covers requests and connections spread over serving threads.
pub async fn router(control_planes: &[String]) -> anyhow::Result<switchyard_router::RouterHandle> {
    router_with(switchyard_router::RouterConfig::with_control_plane(
        loopback_any(),
        control_planes.to_vec(),
    ))
    .await
}

/// Starts an in-process router from `config`, on two serving threads as [`router`] does.
pub async fn router_with(
    mut config: switchyard_router::RouterConfig,
) -> anyhow::Result<switchyard_router::RouterHandle> {
    config.worker_threads = Some(2);
    let settings = config.validate().map_err(anyhow::Error::msg)?;
    Ok(switchyard_router::RouterHandle::start(settings).await?)
}

/// A real `switchyard-control` process listening on `127.0.0.1:0`, with `store_args` (e.g.
/// `["--data-dir", DIR]` or `["--store", "etcd", "--etcd-endpoints", URL]`): for crashes,
/// which only a process killed with SIGKILL shows as they are.
pub fn control_process(store_args: &[&str]) -> anyhow::Result<Process> {
    let mut args = vec!["--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0"];
    args.extend_from_slice(store_args);
    Process::start("switchyard-control", &args, "control plane listening")
}

/// Waits (15 s at most) until `router` routes to `count` instances of `endpoint`, over all
/// its variants.
pub async fn wait_for_router_instances(
    router: &switchyard_router::RouterHandle,
    endpoint: &str,
    count: usize,
) -> anyhow::Result<()> {
    eventually(
        Duration::from_secs(15),
        &format!("the router to see {count} instances of {endpoint}"),
        || async {
            router.table().endpoints.get(endpoint).map(|endpoint| {
                endpoint
                    .variants
                    .iter()
                    .map(|v| v.instances.len())
                    .sum::<usize>()
            }) == Some(count)
        },
    )
    .await
}

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

/// An OpenAI chat body with one user message.
pub fn chat_body(text: &str, max_tokens: u32, stream: bool) -> String {
    serde_json::json!({
        "model": "chat",
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "stream": stream,
    })
    .to_string()
}

/// A prompt of about `chars` characters that starts with `seed`'s own text, so different
/// seeds differ within the first characters.
pub fn prompt(seed: &str, chars: usize) -> String {
    let mut text = format!("{seed}: ");
    let words = [
        "alpha", "bravo", "delta", "echo", "kilo", "lima", "oscar", "tango",
    ];
    let mut index = seed.len();
    while text.len() < chars {
        text.push_str(words[index % words.len()]);
        text.push(' ');
        index += 1;
    }
    text
}

/// POST and read the response frame by frame, noting when each arrived.
pub async fn http_post_frames(
    url: &str,
    headers: &[(&str, &str)],
    body: impl Into<Bytes>,
) -> anyhow::Result<(u16, http::HeaderMap, Vec<(Instant, Bytes)>)> {
    let mut response = post_streaming(url, headers, body).await?;
    let status = response.status().as_u16();
    let response_headers = response.headers().clone();
    bounded(format!("POST {url} (reading the body)"), async {
        let mut frames = Vec::new();
        while let Some(frame) = response.body_mut().frame().await {
            if let Ok(data) = frame?.into_data() {
                frames.push((Instant::now(), data));
            }
        }
        Ok((status, response_headers, frames))
    })
    .await
}

/// POST and return the response with its body unread (to read it slowly, or drop it early);
/// the response head must come within [`HTTP_TIMEOUT`].
pub async fn post_streaming(
    url: &str,
    headers: &[(&str, &str)],
    body: impl Into<Bytes>,
) -> anyhow::Result<http::Response<hyper::body::Incoming>> {
    let mut request = http::Request::post(url).header("content-type", "application/json");
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let request = request.body(Full::new(body.into()))?;
    bounded(format!("POST {url}"), async {
        Ok(http_client().request(request).await?)
    })
    .await
}

/// The value of the Prometheus sample `name{labels}` in `text` (labels in the order the
/// exporter writes them, e.g. `endpoint="chat",instance="engine-0"`; empty for none).
pub fn metric_value(text: &str, name: &str, labels: &str) -> Option<f64> {
    let series = if labels.is_empty() {
        format!("{name} ")
    } else {
        format!("{name}{{{labels}}} ")
    };
    text.lines()
        .find_map(|line| line.strip_prefix(&series))
        .and_then(|value| value.trim().parse().ok())
}

/// A metric of a router (or any component serving `/metrics` at `base_url`); `None` when the
/// sample is absent or `/metrics` does not answer.
pub async fn scrape(base_url: &str, name: &str, labels: &str) -> Option<f64> {
    let (_, text) = http_get(&format!("{base_url}/metrics")).await.ok()?;
    metric_value(&text, name, labels)
}

/// A TCP relay on loopback in front of `target` that can be frozen: while frozen, bytes stop
/// flowing both ways on every connection (connections stay open, new ones are accepted but not
/// connected through), as in a network partition. For faults between two real components
/// (a control plane and its etcd) that cannot be had by stopping either of them.
pub struct Relay {
    pub addr: SocketAddr,
    frozen: tokio::sync::watch::Sender<bool>,
    _task: tokio_util::task::AbortOnDropHandle<()>,
}

impl Relay {
    pub async fn start(target: SocketAddr) -> anyhow::Result<Self> {
        let listener = tokio::net::TcpListener::bind(loopback_any()).await?;
        let addr = listener.local_addr()?;
        let (frozen, _) = tokio::sync::watch::channel(false);
        let watch = frozen.clone();
        let task = tokio::spawn(async move {
            let mut connections = tokio::task::JoinSet::new();
            while let Ok((inbound, _)) = listener.accept().await {
                let frozen = watch.subscribe();
                connections.spawn(async move {
                    let _ = relay_connection(inbound, target, frozen).await;
                });
            }
        });
        Ok(Self {
            addr,
            frozen,
            _task: tokio_util::task::AbortOnDropHandle::new(task),
        })
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn freeze(&self) {
        self.frozen.send_replace(true);
    }

    pub fn thaw(&self) {
        self.frozen.send_replace(false);
    }
}

async fn relay_connection(
    inbound: tokio::net::TcpStream,
    target: SocketAddr,
    frozen: tokio::sync::watch::Receiver<bool>,
) -> std::io::Result<()> {
    let mut gate = frozen.clone();
    let _ = gate.wait_for(|frozen| !*frozen).await;
    let outbound = tokio::net::TcpStream::connect(target).await?;
    inbound.set_nodelay(true)?;
    outbound.set_nodelay(true)?;
    let (inbound_read, inbound_write) = inbound.into_split();
    let (outbound_read, outbound_write) = outbound.into_split();
    tokio::select! {
        result = pump(inbound_read, outbound_write, frozen.clone()) => result,
        result = pump(outbound_read, inbound_write, frozen) => result,
    }
}

/// Copies `from` to `to`, holding every chunk while the relay is frozen.
async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mut frozen: tokio::sync::watch::Receiver<bool>,
) -> std::io::Result<()> {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let mut buffer = vec![0u8; 16 * 1024];
    loop {
        let read = from.read(&mut buffer).await?;
        if read == 0 {
            return Ok(());
        }
        if frozen.wait_for(|frozen| !*frozen).await.is_err() {
            return Ok(());
        }
        to.write_all(&buffer[..read]).await?;
    }
}

/// An HTTP server on loopback whose `GET /health` answers 200 while `healthy` is set and 503
/// otherwise, counting the 200s: an instance whose health a test controls.
pub struct HealthServer {
    pub url: String,
    healthy: Arc<AtomicBool>,
    successes: Arc<AtomicU64>,
    _task: tokio_util::task::AbortOnDropHandle<()>,
}

impl HealthServer {
    pub async fn start(healthy: bool) -> anyhow::Result<Self> {
        use hyper::service::service_fn;
        let listener = tokio::net::TcpListener::bind(loopback_any()).await?;
        let url = format!("http://{}", listener.local_addr()?);
        let state = (
            Arc::new(AtomicBool::new(healthy)),
            Arc::new(AtomicU64::new(0)),
        );
        let (serving_health, serving_successes) = (Arc::clone(&state.0), Arc::clone(&state.1));
        let task = tokio::spawn(async move {
            let mut connections = tokio::task::JoinSet::new();
            while let Ok((stream, _)) = listener.accept().await {
                let (healthy, successes) =
                    (Arc::clone(&serving_health), Arc::clone(&serving_successes));
                let service = service_fn(move |request: http::Request<hyper::body::Incoming>| {
                    let status = if request.uri().path() != "/health" {
                        404
                    } else if healthy.load(Ordering::SeqCst) {
                        successes.fetch_add(1, Ordering::SeqCst);
                        200
                    } else {
                        503
                    };
                    async move {
                        http::Response::builder()
                            .status(status)
                            .body(Full::new(Bytes::new()))
                    }
                });
                connections.spawn(async move {
                    let io = hyper_util::rt::TokioIo::new(stream);
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(io, service)
                        .await;
                });
            }
        });
        Ok(Self {
            url,
            healthy: state.0,
            successes: state.1,
            _task: tokio_util::task::AbortOnDropHandle::new(task),
        })
    }

    pub fn set_healthy(&self, healthy: bool) {
        self.healthy.store(healthy, Ordering::SeqCst);
    }

    /// Probes answered 200 so far.
    pub fn successes(&self) -> u64 {
        self.successes.load(Ordering::SeqCst)
    }
}

/// A `switchyard up` process (its own ports all `127.0.0.1:0`), once it has printed its
/// banner; `extra` adds arguments. Killed on drop.
pub struct SwitchyardUp {
    pub child: Child,
    /// The banner's first router URL.
    pub router: String,
    /// The banner's `curl` example.
    pub curl: String,
}

impl SwitchyardUp {
    pub fn start(engines: usize, extra: &[&str]) -> anyhow::Result<Self> {
        let engines = engines.to_string();
        let mut child = Command::new(binary("switchyard"))
            .args(["up", "--engines", &engines, "--time-scale", "0.05"])
            .args(["--listen", "127.0.0.1:0", "--control-listen", "127.0.0.1:0"])
            .args(extra)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .context("cannot start switchyard up")?;
        let stdout = child.stdout.take().context("stdout")?;
        let (lines_tx, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if lines_tx.send(line).is_err() {
                    break;
                }
            }
        });
        let mut up = Self {
            child,
            router: String::new(),
            curl: String::new(),
        };
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let Ok(line) = lines.recv_timeout(deadline.saturating_duration_since(Instant::now()))
            else {
                bail!("switchyard up printed no whole banner within 60 s");
            };
            let words: Vec<&str> = line.split_whitespace().collect();
            if let ["router", _, url, ..] = words[..]
                && up.router.is_empty()
            {
                up.router = url.to_owned();
            }
            if line.trim_start().starts_with("curl -s") && line.contains("chat/completions") {
                up.curl = line.trim().to_owned();
            }
            if line.contains("Ctrl-C stops everything") {
                break;
            }
        }
        if up.router.is_empty() || up.curl.is_empty() {
            bail!("the banner named no router or no curl example");
        }
        Ok(up)
    }

    /// SIGTERM, then its exit status (SIGKILL after 30 s).
    pub fn terminate(&mut self) -> anyhow::Result<ExitStatus> {
        signal(self.child.id(), "TERM");
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            if let Some(status) = self.child.try_wait()? {
                return Ok(status);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        bail!("switchyard up did not exit within 30 s of SIGTERM")
    }
}

impl Drop for SwitchyardUp {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_regenerated_file_counts_by_its_build_scripts_inputs() {
        let root = tempfile::tempdir().unwrap();
        let package = root.path().join("proto");
        let source = package.join("src/lib.rs");
        let input = package.join("defs/a.proto");
        let build = root.path().join("target/debug/build/my-proto-0123abcd");
        let generated = build.join("out/a.rs");
        for dir in [source.parent(), input.parent(), generated.parent()] {
            std::fs::create_dir_all(dir.unwrap()).unwrap();
        }
        std::fs::write(
            package.join("Cargo.toml"),
            "[package]\nname = \"my-proto\"\n",
        )
        .unwrap();
        std::fs::write(build.join("output"), "cargo:rerun-if-changed=defs\n").unwrap();
        for file in [&source, &input] {
            std::fs::write(file, "").unwrap();
        }
        let built = SystemTime::now();
        std::thread::sleep(Duration::from_millis(20));
        // The script ran again and wrote its output anew: the inputs did not change.
        std::fs::write(&generated, "").unwrap();
        let dep_info = format!("/t/bin: {} {}\n", source.display(), generated.display());
        assert_eq!(newer_sources(&dep_info, built), Vec::<PathBuf>::new());
        // An input changed: that is what is named.
        std::fs::write(&input, "message A {}").unwrap();
        assert_eq!(newer_sources(&dep_info, built), vec![input.clone()]);
        // A plain source changed.
        std::fs::write(&source, "").unwrap();
        assert!(newer_sources(&dep_info, built).contains(&source));
    }
}
