//! Propagation: the time from an admin write to the change arriving at N connected router sync
//! streams (N = 1, 10, 100), p50 and p99, on the embedded store and, when an etcd is given, on
//! etcd.
//!
//! `cargo bench -p switchyard-control --bench propagation [-- --etcd http://127.0.0.1:2379]
//! [--writes 50]`
//!
//! Each write registers an instance (a membership change); the clock starts just before the
//! admin call and stops when a client receives the `StateUpdate` carrying it. "all" is the time
//! until the last of the N clients has it, the figure PRODUCT.md's target (p99 ≤ 200 ms with
//! 100 routers) is about.

use std::time::{Duration, Instant};

use futures::StreamExt;
use switchyard_control::{ControlConfig, ControlPlane};
use switchyard_proto::v1 as pb;
use tokio::sync::mpsc;

struct Args {
    etcd: Option<String>,
    writes: usize,
}

fn args() -> Args {
    let mut args = Args {
        etcd: None,
        writes: 50,
    };
    let mut iter = std::env::args().skip(1);
    while let Some(arg) = iter.next() {
        match arg.as_str() {
            "--etcd" => args.etcd = iter.next(),
            "--writes" => {
                args.writes = iter
                    .next()
                    .and_then(|value| value.parse().ok())
                    .unwrap_or(args.writes)
            }
            _ => {} // cargo bench passes --bench; ignore what is not ours
        }
    }
    args
}

fn percentile(sorted: &[Duration], fraction: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let rank = ((sorted.len() as f64 * fraction).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}

fn ms(duration: Duration) -> String {
    format!("{:.2} ms", duration.as_secs_f64() * 1000.0)
}

async fn start(
    store: &str,
    etcd: Option<&str>,
    dir: &std::path::Path,
) -> anyhow::Result<ControlPlane> {
    let listen = "127.0.0.1:0".parse()?;
    let config = match (store, etcd) {
        ("etcd", Some(url)) => ControlConfig::etcd(
            listen,
            vec![url.to_owned()],
            &format!("/switchyard-bench-{}/", std::process::id()),
        ),
        _ => ControlConfig::embedded(listen, dir.to_path_buf()),
    };
    Ok(ControlPlane::start(config.validate()?).await?)
}

/// Opens a sync stream; forwards the arrival time of every InstanceChanged id.
async fn client(
    url: String,
    index: usize,
    arrivals: mpsc::UnboundedSender<(usize, String, Instant)>,
) -> anyhow::Result<tokio::task::JoinHandle<()>> {
    let mut sync = pb::router_sync_client::RouterSyncClient::connect(url).await?;
    let (sender, receiver) = mpsc::channel(4);
    sender
        .send(pb::RouterMessage {
            message: Some(pb::router_message::Message::Hello(pb::RouterHello {
                router_id: format!("bench-{index}"),
                protocol: 2,
                incarnation: 0,
            })),
        })
        .await?;
    let mut stream = sync
        .sync(tokio_stream::wrappers::ReceiverStream::new(receiver))
        .await?
        .into_inner();
    // Wait for the snapshot so the client is fully connected before writes start.
    let _ = stream.next().await;
    Ok(tokio::spawn(async move {
        let _keep_open = sender;
        while let Some(Ok(message)) = stream.next().await {
            if let Some(pb::sync_message::Message::Update(update)) = message.message {
                for instance in update.instances {
                    let _ = arrivals.send((index, instance.id, Instant::now()));
                }
            }
        }
    }))
}

async fn measure(
    store: &str,
    etcd: Option<&str>,
    clients: usize,
    writes: usize,
) -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let control_plane = start(store, etcd, dir.path()).await?;
    let url = control_plane.url();
    let mut admin = pb::admin_client::AdminClient::connect(url.clone()).await?;
    let suffix = format!("{}-{clients}", std::process::id());
    let config = format!("bench-{suffix}");
    admin
        .create_endpoint_config(pb::CreateEndpointConfigRequest {
            endpoint_config: Some(pb::EndpointConfig {
                name: config.clone(),
                production_variants: vec![pb::ProductionVariant {
                    variant_name: "AllTraffic".into(),
                    ..Default::default()
                }],
                ..Default::default()
            }),
        })
        .await?;
    let endpoint = format!("e-{suffix}");
    admin
        .create_endpoint(pb::CreateEndpointRequest {
            name: endpoint.clone(),
            endpoint_config_name: config,
        })
        .await?;
    let (arrivals_tx, mut arrivals) = mpsc::unbounded_channel();
    let mut tasks = Vec::new();
    for index in 0..clients {
        tasks.push(client(url.clone(), index, arrivals_tx.clone()).await?);
    }
    let mut per_client = Vec::new();
    let mut all = Vec::new();
    for write in 0..writes {
        let id = format!("w{write}");
        let started = Instant::now();
        admin
            .register_instance(pb::RegisterInstanceRequest {
                endpoint_name: endpoint.clone(),
                variant_name: "AllTraffic".into(),
                url: "http://127.0.0.1:9".into(),
                id: id.clone(),
                ..Default::default()
            })
            .await?;
        let mut seen = 0;
        let mut last = started;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while seen < clients {
            let Ok(Some((_, arrived_id, at))) =
                tokio::time::timeout_at(deadline, arrivals.recv()).await
            else {
                anyhow::bail!("write {write} did not reach every client within 10 s");
            };
            if arrived_id != id {
                continue; // a health update of an earlier instance
            }
            seen += 1;
            per_client.push(at.duration_since(started));
            last = last.max(at);
        }
        all.push(last.duration_since(started));
    }
    per_client.sort();
    all.sort();
    println!(
        "{store:<8} clients {clients:>3}  writes {writes:>3}  per client p50 {:>9}  p99 {:>9}   all clients p50 {:>9}  p99 {:>9}",
        ms(percentile(&per_client, 0.5)),
        ms(percentile(&per_client, 0.99)),
        ms(percentile(&all, 0.5)),
        ms(percentile(&all, 0.99)),
    );
    for task in tasks {
        task.abort();
    }
    control_plane.shutdown().await?;
    Ok(())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = args();
    println!("propagation: admin write (RegisterInstance) -> InstanceChanged on N sync streams");
    let mut stores = vec!["embedded"];
    if args.etcd.is_some() {
        stores.push("etcd");
    }
    for store in stores {
        for clients in [1, 10, 100] {
            measure(store, args.etcd.as_deref(), clients, args.writes).await?;
        }
    }
    Ok(())
}
