//! The integration-test harness: a real etcd on free loopback ports in a temporary directory
//! (plain, or TLS with client certificates from a throwaway CA), control planes and routers
//! started in-process on `127.0.0.1:0`, the built binaries for tests that need a real
//! process, and small HTTP/gRPC helpers. Nothing is mocked.

use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use switchyard_proto::v1 as pb;
use switchyard_proto::v1::admin_client::AdminClient;
use tonic::transport::Channel;

/// A free TCP port on 127.0.0.1 (bound then released; etcd needs numbers up front).
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .map(|addr| addr.port())
        .expect("a free loopback port")
}

pub fn loopback_any() -> SocketAddr {
    "127.0.0.1:0".parse().expect("loopback address")
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

    async fn spawn(tls: Option<&TestPki>) -> anyhow::Result<Self> {
        let binary = which("etcd").context(
            "etcd is not installed: run scripts/test (it installs Debian's etcd-server) or apt-get install etcd-server",
        )?;
        let dir = tempfile::tempdir()?;
        let client_port = free_port();
        let peer_port = free_port();
        let scheme = if tls.is_some() { "https" } else { "http" };
        let url = format!("{scheme}://127.0.0.1:{client_port}");
        let peer = format!("http://127.0.0.1:{peer_port}");
        let log = std::fs::File::create(dir.path().join("etcd.log"))?;
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
        let ready = match tls {
            None => etcd.wait_healthy().await,
            Some(pki) => etcd.wait_serving_tls(pki).await,
        };
        if let Err(err) = ready {
            let _ = etcd.child.kill();
            return Err(err);
        }
        Ok(etcd)
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
    /// Starts `size` members and waits until the cluster has a leader. Ports are picked free
    /// and may be taken meanwhile by someone else: a start that fails is retried (3 tries).
    pub async fn start(size: usize) -> anyhow::Result<Self> {
        let mut last = None;
        for _ in 0..3 {
            match Self::try_start(size).await {
                Ok(cluster) => return Ok(cluster),
                Err(err) => last = Some(err),
            }
        }
        Err(last.unwrap_or_else(|| anyhow::anyhow!("etcd cluster did not start")))
    }

    async fn try_start(size: usize) -> anyhow::Result<Self> {
        let binary = which("etcd").context(
            "etcd is not installed: run scripts/test (it installs Debian's etcd-server) or apt-get install etcd-server",
        )?;
        let dir = tempfile::tempdir()?;
        let ports: Vec<(u16, u16)> = (0..size).map(|_| (free_port(), free_port())).collect();
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
        for (index, (client, peer)) in ports.iter().enumerate() {
            let url = format!("http://127.0.0.1:{client}");
            let peer_url = format!("http://127.0.0.1:{peer}");
            let log = std::fs::File::create(cluster._dir.path().join(format!("m{index}.log")))?;
            let child = Command::new(&binary)
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
        }
        // Dropping `cluster` on failure kills what started.
        for index in 0..size {
            let health = format!("{}/health", cluster.members[index].url);
            eventually(
                Duration::from_secs(20),
                "etcd members to elect a leader",
                || {
                    let health = health.clone();
                    async move {
                        matches!(http_get(&health).await, Ok((200, body)) if body.contains("true"))
                    }
                },
            )
            .await?;
            if let Ok(Some(status)) = cluster.members[index].child.try_wait() {
                bail!("etcd member m{index} exited: {status}");
            }
        }
        Ok(cluster)
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
        signal(&member.child, "STOP")?;
        member.frozen = true;
        Ok(())
    }

    /// Lets a frozen member run again (SIGCONT).
    pub fn thaw(&mut self, index: usize) -> anyhow::Result<()> {
        let member = &mut self.members[index];
        signal(&member.child, "CONT")?;
        member.frozen = false;
        Ok(())
    }
}

impl Drop for EtcdCluster {
    fn drop(&mut self) {
        for member in &mut self.members {
            if member.frozen {
                let _ = signal(&member.child, "CONT");
            }
            let _ = member.child.kill();
            let _ = member.child.wait();
        }
    }
}

/// Sends a signal by name to a child process (`kill -NAME PID`).
fn signal(child: &Child, name: &str) -> anyhow::Result<()> {
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

fn which(name: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|dir| dir.join(name))
            .find(|candidate| candidate.is_file())
    })
}

/// A built binary of this workspace (`scripts/test` builds them before the tests run).
pub fn binary(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    // target/debug/deps/<test> -> target/debug/<name>
    let dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("target directory")
        .to_path_buf();
    let path = dir.join(name);
    assert!(
        path.is_file(),
        "{} is missing: build the binaries first (cargo build --workspace --bins; scripts/test does)",
        path.display()
    );
    path
}

type HttpClient = Client<HttpConnector, Full<Bytes>>;

fn http_client() -> HttpClient {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    Client::builder(TokioExecutor::new()).build(connector)
}

/// GET, returning (status, body).
pub async fn http_get(url: &str) -> anyhow::Result<(u16, String)> {
    let response = http_client()
        .get(url.parse()?)
        .await
        .with_context(|| format!("GET {url}"))?;
    let status = response.status().as_u16();
    let body = response.into_body().collect().await?.to_bytes();
    Ok((status, String::from_utf8_lossy(&body).into_owned()))
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

/// POST a body with headers, reading the whole response.
pub async fn http_post(
    url: &str,
    headers: &[(&str, &str)],
    body: impl Into<Bytes>,
) -> anyhow::Result<Reply> {
    let mut request = http::Request::post(url).header("content-type", "application/json");
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let request = request.body(Full::new(body.into()))?;
    let response = http_client()
        .request(request)
        .await
        .with_context(|| format!("POST {url}"))?;
    let status = response.status().as_u16();
    let headers = response.headers().clone();
    let body = response.into_body().collect().await?.to_bytes();
    Ok(Reply {
        status,
        headers,
        body: String::from_utf8_lossy(&body).into_owned(),
    })
}

/// Any method, with headers and a body (empty for none), reading the whole response.
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
    let response = http_client()
        .request(request)
        .await
        .with_context(|| format!("{method} {url}"))?;
    let status = response.status().as_u16();
    let headers = response.headers().clone();
    let body = response.into_body().collect().await?.to_bytes();
    Ok(Reply {
        status,
        headers,
        body: String::from_utf8_lossy(&body).into_owned(),
    })
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

/// An admin client of a control plane.
pub async fn admin(url: &str) -> anyhow::Result<AdminClient<Channel>> {
    Ok(AdminClient::connect(url.to_owned()).await?)
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

/// Builds a CreateEndpointConfig request from SageMaker JSON.
pub fn config_request(name: &str, variants_json: &str) -> pb::CreateEndpointConfigRequest {
    let variants = switchyard_shared::sagemaker::parse_production_variants(variants_json)
        .expect("test JSON parses")
        .variants;
    let config = switchyard_shared::EndpointConfig {
        endpoint_config_name: switchyard_shared::EndpointConfigName::new(name).expect("name"),
        production_variants: variants,
        health_check_config: switchyard_shared::HealthCheckConfig {
            interval_ms: 200,
            unhealthy_threshold: 2,
            healthy_threshold: 1,
            ..Default::default()
        },
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
    let mut config = switchyard_router::RouterConfig::with_control_plane(
        loopback_any(),
        control_planes.to_vec(),
    );
    config.worker_threads = Some(2);
    let settings = config.validate().map_err(anyhow::Error::msg)?;
    let router = switchyard_router::RouterHandle::start(settings).await?;
    Ok(router)
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
            eventually(
                Duration::from_secs(15),
                "routers to see every instance",
                || async {
                    router.table().endpoints.get("chat").map(|endpoint| {
                        endpoint
                            .variants
                            .iter()
                            .map(|v| v.instances.len())
                            .sum::<usize>()
                    }) == Some(count)
                },
            )
            .await?;
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
    let mut frames = Vec::new();
    while let Some(frame) = response.body_mut().frame().await {
        if let Ok(data) = frame?.into_data() {
            frames.push((Instant::now(), data));
        }
    }
    Ok((status, response_headers, frames))
}

/// POST and return the response with its body unread (to read it slowly, or drop it early).
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
    Ok(http_client().request(request).await?)
}
