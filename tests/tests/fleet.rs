//! Fleet scale and views that never go back: the RouterSync protocol with large states, stale
//! and recreated stores, etcd members that stop answering, the embedded store's directory
//! lock, bulk import. Real etcd, real gRPC, real routers; the scripted control planes below
//! are real tonic servers that send exactly the messages a test needs.

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use futures::Stream;
use prost::Message as _;
use switchyard_control::ControlConfig;
use switchyard_proto::v1 as pb;
use switchyard_tests::*;

/// `count` registrations of endpoint `chat`, variant `AllTraffic`, each with a URL of about
/// `url_bytes` bytes (a path prefix makes it long).
fn registrations(count: usize, url_bytes: usize) -> Vec<pb::RegisterInstanceRequest> {
    (0..count)
        .map(|index| {
            let base = format!("http://127.0.0.1:{}/", 10_000 + index % 50_000);
            let path = "p".repeat(url_bytes.saturating_sub(base.len()));
            pb::RegisterInstanceRequest {
                endpoint_name: "chat".into(),
                variant_name: "AllTraffic".into(),
                url: format!("{base}{path}"),
                id: format!("i-{index}"),
                ..Default::default()
            }
        })
        .collect()
}

/// The settings of a router following the control planes at `urls`, on one serving thread.
fn router_settings(urls: &[String]) -> anyhow::Result<switchyard_router::Settings> {
    let mut config =
        switchyard_router::RouterConfig::with_control_plane(loopback_any(), urls.to_vec());
    config.worker_threads = Some(1);
    config.validate().map_err(anyhow::Error::msg)
}

/// Starts a router of [`router_settings`].
async fn start_router(urls: &[String]) -> anyhow::Result<switchyard_router::RouterHandle> {
    Ok(switchyard_router::RouterHandle::start(router_settings(urls)?).await?)
}

#[tokio::test]
async fn a_snapshot_above_16_mib_reaches_a_router_intact() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let (cp, mut admin) = embedded_admin(dir.path()).await?;
    create_quiet_endpoint(&mut admin, "chat").await?;
    let instances = registrations(9000, 2000);
    let bytes: usize = instances
        .iter()
        .map(|instance| instance.encoded_len())
        .sum();
    assert!(bytes > 16 * 1024 * 1024, "{bytes} bytes");
    let imported = admin
        .import_instances(pb::ImportInstancesRequest {
            instances: instances.clone(),
            dry_run: false,
        })
        .await?
        .into_inner();
    assert_eq!(imported.imported, 9000);
    assert!(imported.transactions >= 9000 / 127, "{imported:?}");

    let router = start_router(&[cp.url()]).await?;
    eventually(
        Duration::from_secs(60),
        "the router to load 9000 instances",
        || async { routed_count(&router, "chat") == Some(9000) },
    )
    .await?;
    let table = router.table();
    let chat = &table.endpoints["chat"].variants[0];
    let mut urls: Vec<&str> = chat
        .instances
        .iter()
        .map(|instance| instance.url.as_str())
        .collect();
    let mut expected: Vec<&str> = instances
        .iter()
        .map(|instance| instance.url.as_str())
        .collect();
    urls.sort_unstable();
    expected.sort_unstable();
    assert!(urls == expected, "every URL arrived whole");
    Ok(())
}

/// A scripted `RouterSync` server: each stream opened gets the next script in turn (the last
/// one again when they run out), sends its messages, then stays open or ends.
#[derive(Clone, Default)]
struct Scripted {
    scripts: Arc<Mutex<VecDeque<Script>>>,
    hellos: Arc<Mutex<Vec<pb::RouterHello>>>,
}

#[derive(Clone)]
struct Script {
    messages: Vec<pb::SyncMessage>,
    /// Keep the stream open after the messages.
    hold: bool,
}

type SyncStream = Pin<Box<dyn Stream<Item = Result<pb::SyncMessage, tonic::Status>> + Send>>;

#[tonic::async_trait]
impl pb::router_sync_server::RouterSync for Scripted {
    type SyncStream = SyncStream;

    async fn sync(
        &self,
        request: tonic::Request<tonic::Streaming<pb::RouterMessage>>,
    ) -> Result<tonic::Response<SyncStream>, tonic::Status> {
        let mut inbound = request.into_inner();
        if let Some(pb::RouterMessage {
            message: Some(pb::router_message::Message::Hello(hello)),
        }) = inbound.message().await?
        {
            self.hellos.lock().unwrap().push(hello);
        }
        let script = {
            let mut scripts = self.scripts.lock().unwrap();
            if scripts.len() > 1 {
                scripts.pop_front()
            } else {
                scripts.front().cloned()
            }
        }
        .ok_or_else(|| tonic::Status::unavailable("no script"))?;
        let stream = async_stream::stream! {
            for message in script.messages {
                yield Ok(message);
            }
            if script.hold {
                // Reads reports until the router goes away.
                while let Ok(Some(_)) = inbound.message().await {}
            }
        };
        Ok(tonic::Response::new(Box::pin(stream)))
    }
}

impl Scripted {
    fn new(scripts: Vec<Script>) -> Self {
        Self {
            scripts: Arc::new(Mutex::new(scripts.into())),
            hellos: Arc::default(),
        }
    }

    async fn serve(self) -> anyhow::Result<(String, tokio_util::sync::CancellationToken)> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let url = format!("http://{}", listener.local_addr()?);
        let stop = tokio_util::sync::CancellationToken::new();
        let signal = stop.clone();
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(pb::router_sync_server::RouterSyncServer::new(self))
                .serve_with_incoming_shutdown(
                    tokio_stream::wrappers::TcpListenerStream::new(listener),
                    signal.cancelled_owned(),
                ),
        );
        Ok((url, stop))
    }
}

fn config_wire(name: &str) -> pb::EndpointConfig {
    pb::EndpointConfig {
        name: name.into(),
        production_variants: vec![pb::ProductionVariant {
            variant_name: "AllTraffic".into(),
            model_name: "sim".into(),
            ..Default::default()
        }],
        ..Default::default()
    }
}

fn endpoint_wire(name: &str) -> pb::Endpoint {
    pb::Endpoint {
        name: name.into(),
        endpoint_config_name: "cfg".into(),
        status: pb::EndpointStatus::InService as i32,
        ..Default::default()
    }
}

fn instance_wire(id: &str) -> pb::Instance {
    pb::Instance {
        id: id.into(),
        endpoint_name: "chat".into(),
        variant_name: "AllTraffic".into(),
        url: "http://127.0.0.1:9".into(),
        weight: 1.0,
        ..Default::default()
    }
}

/// A one-piece protocol-2 snapshot of endpoint `chat` with the given instances.
fn snapshot(cluster: &str, revision: u64, ids: &[&str]) -> pb::SyncMessage {
    pb::SyncMessage {
        version: revision,
        replica_id: "scripted".into(),
        cluster_id: cluster.into(),
        message: Some(pb::sync_message::Message::Update(pb::StateUpdate {
            reset: true,
            complete: true,
            configs: vec![config_wire("cfg")],
            endpoints: vec![endpoint_wire("chat")],
            instances: ids.iter().map(|id| instance_wire(id)).collect(),
            ..Default::default()
        })),
    }
}

#[tokio::test]
async fn a_router_refuses_an_older_snapshot_and_takes_a_new_cluster() -> anyhow::Result<()> {
    // Replica A: cluster c at revision 10, then (on the router's return) a recreated store,
    // cluster d at revision 2. Replica B: cluster c at revision 9, one behind.
    let a = Scripted::new(vec![
        Script {
            messages: vec![snapshot("c", 10, &["a1", "a2"])],
            hold: false,
        },
        Script {
            messages: vec![snapshot("d", 2, &["d1"])],
            hold: true,
        },
    ]);
    let b = Scripted::new(vec![Script {
        messages: vec![snapshot("c", 9, &["b1"])],
        hold: true,
    }]);
    let (a_url, _a_stop) = a.clone().serve().await?;
    let (b_url, _b_stop) = b.clone().serve().await?;
    let router = start_router(&[a_url, b_url]).await?;
    // A's first stream delivers revision 10 and ends; B offers 9 and is refused; A's next
    // stream, another cluster, is taken.
    eventually(
        Duration::from_secs(20),
        "the router to take cluster d",
        || async { routed_instances(&router, "chat") == ["d1"] },
    )
    .await?;
    let metrics = Metrics::scrape(&router.url()).await?;
    assert_eq!(
        metrics.get("switchyard_router_stale_snapshots_refused_total"),
        Some(1.0)
    );
    assert_eq!(
        metrics.get("switchyard_router_cluster_changes_total"),
        Some(1.0)
    );
    assert_eq!(router.table().version, 2);
    let hellos = a.hellos.lock().unwrap().clone();
    assert_eq!(hellos[0].protocol, 2, "the router announces protocol 2");
    assert_ne!(hellos[0].incarnation, 0);
    Ok(())
}

#[tokio::test]
async fn a_router_follows_a_control_plane_that_speaks_only_protocol_1() -> anyhow::Result<()> {
    use pb::sync_message::Message;
    let frame = |version: u64, message: Message| pb::SyncMessage {
        version,
        replica_id: "old".into(),
        cluster_id: String::new(),
        message: Some(message),
    };
    let routed = pb::RoutedEndpoint {
        endpoint: Some(endpoint_wire("chat")),
        config: Some(config_wire("cfg")),
    };
    let old = Scripted::new(vec![Script {
        messages: vec![
            frame(
                5,
                Message::Snapshot(pb::Snapshot {
                    endpoints: vec![routed],
                    instances: vec![instance_wire("x1"), instance_wire("x2")],
                }),
            ),
            frame(6, Message::InstanceChanged(instance_wire("x3"))),
            frame(
                7,
                Message::InstanceRemoved(pb::InstanceRemoved {
                    endpoint_name: "chat".into(),
                    id: "x1".into(),
                }),
            ),
        ],
        hold: true,
    }]);
    let (url, _stop) = old.serve().await?;
    let router = start_router(&[url]).await?;
    eventually(
        Duration::from_secs(10),
        "the router to apply every change",
        || async { routed_instances(&router, "chat") == ["x2", "x3"] },
    )
    .await?;
    assert_eq!(router.table().version, 7);
    Ok(())
}

#[test]
fn applying_happens_off_the_serving_threads() -> anyhow::Result<()> {
    // The control plane and the admin client run on a runtime of their own.
    let control = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    let dir = tempfile::tempdir()?;
    let cp = control.block_on(embedded_control_plane(dir.path()))?;
    let url = cp.url();
    let mut admin = control.block_on(admin(&url))?;
    control.block_on(create_quiet_endpoint(&mut admin, "chat"))?;
    // The router's only serving thread is this runtime, which nothing drives once `start`
    // returns: if anything the router does with the control plane ran there, it would stall.
    let serving = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let router = serving.block_on(switchyard_router::RouterHandle::start(router_settings(&[
        url,
    ])?))?;
    let wait = |what: &str, check: &dyn Fn() -> bool| -> anyhow::Result<()> {
        let deadline = Instant::now() + Duration::from_secs(20);
        while !check() {
            anyhow::ensure!(Instant::now() < deadline, "timed out waiting for {what}");
            std::thread::sleep(Duration::from_millis(10));
        }
        Ok(())
    };
    wait("the snapshot", &|| router.table().version > 0)?;
    control.block_on(register(&mut admin, "chat", "i-1", "http://127.0.0.1:9"))?;
    wait("the change", &|| routed_count(&router, "chat") == Some(1))?;
    drop(router);
    serving.block_on(async {});
    control.block_on(cp.shutdown())?;
    Ok(())
}

/// The time until `check` holds, polling every 20 ms, or an error after `limit`.
async fn time_until<F, Fut>(limit: Duration, what: &str, mut check: F) -> anyhow::Result<Duration>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let started = Instant::now();
    eventually(limit, what, &mut check).await?;
    Ok(started.elapsed())
}

#[tokio::test]
async fn a_frozen_etcd_member_stops_its_replica_and_routers_move() -> anyhow::Result<()> {
    let mut etcd = EtcdCluster::start(3).await?;
    let urls = etcd.urls();
    let prefix = "/frozen/";
    let start = |endpoints: Vec<String>| async move {
        let mut config = ControlConfig::etcd(loopback_any(), endpoints, prefix);
        config.shutdown_grace_seconds = 2;
        control_plane(config).await
    };
    // One replica knows every member; the other only the member that will freeze.
    let all = start(urls.clone()).await?;
    let lone = start(vec![urls[0].clone()]).await?;
    all.wait_ready().await;
    lone.wait_ready().await;
    let mut admin_all = admin(&all.url()).await?;
    create_quiet_endpoint(&mut admin_all, "chat").await?;
    register(&mut admin_all, "chat", "before", "http://127.0.0.1:9").await?;
    // One router starts on the lone replica, with the other as its fallback; one follows the
    // replica with every member.
    let moving = start_router(&[lone.url(), all.url()]).await?;
    let staying = start_router(&[all.url()]).await?;
    for router in [&moving, &staying] {
        eventually(
            Duration::from_secs(15),
            "routers to see the first instance",
            || async { routed_count(router, "chat") == Some(1) },
        )
        .await?;
    }

    etcd.freeze(0)?;
    let not_ready = time_until(
        Duration::from_secs(15),
        "the lone replica to turn not ready",
        || async { !lone.is_ready() },
    )
    .await?;
    // The replica with every member keeps taking writes and serving them.
    let write = time_until(
        Duration::from_secs(30),
        "a write through the other replica",
        || {
            let mut admin = admin_all.clone();
            async move {
                tokio::time::timeout(
                    Duration::from_secs(6),
                    register(&mut admin, "chat", "after", "http://127.0.0.1:9"),
                )
                .await
                .is_ok_and(|registered| registered.is_ok())
            }
        },
    )
    .await?;
    let moved = time_until(
        Duration::from_secs(30),
        "both routers to see the write",
        || async {
            routed_count(&moving, "chat") == Some(2) && routed_count(&staying, "chat") == Some(2)
        },
    )
    .await?;
    assert!(all.is_ready(), "the replica with live members is ready");
    assert_eq!(
        all.sync_stats()
            .not_ready
            .load(std::sync::atomic::Ordering::Relaxed),
        0,
        "it moved to a live member without ever turning a router away"
    );
    eprintln!(
        "member frozen: lone replica not ready after {not_ready:?}; write through the other replica after {write:?}; both routers current {moved:?} later"
    );
    // A replica whose store never answers still shuts down within its grace period (2 s).
    tokio::time::timeout(Duration::from_secs(10), lone.shutdown())
        .await
        .map_err(|_| anyhow::anyhow!("the lone replica did not shut down"))??;
    etcd.thaw(0)?;
    all.shutdown().await?;
    Ok(())
}

#[tokio::test]
async fn shutdown_says_not_serving_before_it_stops() -> anyhow::Result<()> {
    use tonic_health::pb::health_check_response::ServingStatus;
    let dir = tempfile::tempdir()?;
    let cp = embedded_control_plane(dir.path()).await?;
    cp.wait_ready().await;
    let channel = tonic::transport::Channel::from_shared(cp.url())?
        .connect()
        .await?;
    let mut health = tonic_health::pb::health_client::HealthClient::new(channel);
    let mut watch = health
        .watch(tonic_health::pb::HealthCheckRequest {
            service: "switchyard.v1.RouterSync".into(),
        })
        .await?
        .into_inner();
    let first = watch.message().await?.map(|status| status.status);
    assert_eq!(first, Some(ServingStatus::Serving as i32));
    let stopping = tokio::spawn(cp.shutdown());
    let next = tokio::time::timeout(Duration::from_secs(10), watch.message()).await??;
    assert_eq!(
        next.map(|status| status.status),
        Some(ServingStatus::NotServing as i32),
        "NOT_SERVING is heard before the server goes"
    );
    // The watch was the last call open: once it goes, the server stops at once.
    drop(watch);
    drop(health);
    tokio::time::timeout(Duration::from_secs(15), stopping).await???;
    Ok(())
}

/// A `switchyard-control` process on the embedded store in `dir` (killed on drop).
fn embedded_control_process(dir: &std::path::Path) -> anyhow::Result<Process> {
    let data_dir = dir.to_str().context("a UTF-8 data directory")?;
    control_process(&["--data-dir", data_dir])
}

#[tokio::test]
async fn a_second_control_plane_on_the_same_data_dir_exits_64_and_the_first_keeps_every_write()
-> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let mut first = embedded_control_process(dir.path())?;
    let mut admin_first = admin(&first.url()).await?;
    create_quiet_endpoint(&mut admin_first, "chat").await?;
    for index in 0..5 {
        register(
            &mut admin_first,
            "chat",
            &format!("before-{index}"),
            "http://127.0.0.1:9",
        )
        .await?;
    }
    // The second one binds nothing: it stops at the lock, before its listener.
    let second = tokio::process::Command::new(binary("switchyard-control"))
        .args([
            "--listen",
            "127.0.0.1:0",
            "--metrics-listen",
            "127.0.0.1:0",
            "--data-dir",
        ])
        .arg(dir.path())
        .kill_on_drop(true)
        .output();
    let output = tokio::time::timeout(Duration::from_secs(30), second)
        .await
        .context("the second control plane did not exit within 30 s")??;
    assert_eq!(output.status.code(), Some(64), "{output:?}");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains(&format!("in use by process {}", first.pid())),
        "{stderr}"
    );
    assert!(stderr.contains("--data-dir"), "{stderr}");
    for index in 0..5 {
        register(
            &mut admin_first,
            "chat",
            &format!("after-{index}"),
            "http://127.0.0.1:9",
        )
        .await?;
    }
    drop(admin_first);
    first.terminate();
    // Waited for off this runtime, so that the test's closed connections can go meanwhile.
    let stopped =
        tokio::task::spawn_blocking(move || first.wait_exit(Duration::from_secs(30))).await??;
    assert_eq!(stopped.code(), Some(0));
    let again = embedded_control_process(dir.path())?;
    let listed = admin(&again.url())
        .await?
        .list_instances(pb::ListInstancesRequest {
            endpoint_name: "chat".into(),
        })
        .await?
        .into_inner()
        .instances;
    assert_eq!(
        listed.len(),
        10,
        "every acknowledged write is there: {listed:?}"
    );
    Ok(())
}

#[tokio::test]
async fn instance_import_checks_every_line_first_and_imports_in_batches() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let (cp, mut admin) = embedded_admin(dir.path()).await?;
    create_quiet_endpoint(&mut admin, "chat").await?;
    let line = |id: usize, variant: &str| {
        format!(
            r#"{{"EndpointName": "chat", "VariantName": "{variant}", "InstanceId": "i-{id}", "Url": "http://10.0.0.7:{}", "Role": "decode", "Weight": 1}}"#,
            8000 + id
        )
    };
    let url = cp.url();
    let run = |file: &std::path::Path| {
        tokio::process::Command::new(binary("switchyard"))
            .args(["--control-plane", &url, "instance", "import", "--file"])
            .arg(file)
            .output()
    };
    let files = tempfile::tempdir()?;
    // A bad line in the file (line 3), found before anything is sent.
    let bad = files.path().join("bad.jsonl");
    let mut text: Vec<String> = (0..300).map(|id| line(id, "AllTraffic")).collect();
    text[2] = text[2].replace("http://", "ftp://");
    std::fs::write(&bad, text.join("\n"))?;
    let output = run(&bad).await?;
    assert_eq!(output.status.code(), Some(64), "{output:?}");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("line 3: Url:"), "{stderr}");
    // A line the control plane refuses (no such variant, line 250): nothing imported.
    let unknown = files.path().join("unknown.jsonl");
    let mut text: Vec<String> = (0..300).map(|id| line(id, "AllTraffic")).collect();
    text[249] = line(249, "Nope");
    std::fs::write(&unknown, text.join("\n"))?;
    let output = run(&unknown).await?;
    assert_eq!(output.status.code(), Some(64), "{output:?}");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("line 250: VariantName:"), "{stderr}");
    let listed = |admin: &mut pb::admin_client::AdminClient<tonic::transport::Channel>| {
        let mut admin = admin.clone();
        async move {
            anyhow::Ok(
                admin
                    .list_instances(pb::ListInstancesRequest::default())
                    .await?
                    .into_inner()
                    .instances,
            )
        }
    };
    assert!(listed(&mut admin).await?.is_empty(), "nothing imported");
    // The good file: 300 instances in 3 transactions (127 writes at most in each).
    let good = files.path().join("good.jsonl");
    let text: Vec<String> = (0..300).map(|id| line(id, "AllTraffic")).collect();
    std::fs::write(&good, text.join("\n"))?;
    let output = run(&good).await?;
    assert!(output.status.success(), "{output:?}");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        stdout.contains("imported 300 instances in 3 transactions"),
        "{stdout}"
    );
    let instances = listed(&mut admin).await?;
    assert_eq!(instances.len(), 300);
    assert!(
        instances
            .iter()
            .all(|instance| instance.role == pb::InstanceRole::Decode as i32)
    );
    Ok(())
}
