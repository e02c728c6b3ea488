//! The smoke run with real processes: a switchyard-control on the embedded store and
//! `switchyard-router` processes syncing from it.

use std::time::{Duration, Instant};

use switchyard_proto::v1 as pb;
use switchyard_proto::v1::admin_client::AdminClient;

use super::args::FleetArgs;
use super::report::ProcessReport;
use super::shape::populate;
use super::sync_clients::ms;
use crate::child::default_router_bin;
use crate::error::UsageError;
use crate::procfs::resident_mib;
use crate::stats::Summary;

struct RouterProcess {
    child: std::process::Child,
    url: String,
}

impl Drop for RouterProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn http_get(client: &crate::client::HttpClient, url: &str) -> Option<(u16, String)> {
    use http_body_util::BodyExt;
    let request = http::Request::get(url)
        .body(http_body_util::Full::new(bytes::Bytes::new()))
        .ok()?;
    let response = client.request(request).await.ok()?;
    let status = response.status().as_u16();
    let body = response.into_body().collect().await.ok()?.to_bytes();
    Some((status, String::from_utf8_lossy(&body).into_owned()))
}

pub async fn measure_processes(args: &FleetArgs) -> anyhow::Result<ProcessReport> {
    let binary = match &args.router_bin {
        Some(path) => path.clone(),
        None => default_router_bin().ok_or_else(|| {
            UsageError::new("--router-bin: no switchyard-router next to this executable; build it (cargo build --release -p switchyard-router) or name it")
        })?,
    };
    let control = match &args.control_bin {
        Some(path) => path.clone(),
        None => default_router_bin()
            .and_then(|router| {
                let control = router.with_file_name("switchyard-control");
                control.is_file().then_some(control)
            })
            .ok_or_else(|| {
                UsageError::new("--control-bin: no switchyard-control next to this executable; build it (cargo build --release -p switchyard-control) or name it")
            })?,
    };
    let dir = tempfile::tempdir()?;
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let cp_url = format!("http://127.0.0.1:{port}");
    let cp = RouterProcess {
        child: std::process::Command::new(&control)
            .args(["--listen", &format!("127.0.0.1:{port}")])
            .args(["--metrics-listen", "127.0.0.1:0"])
            .arg("--data-dir")
            .arg(dir.path())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()?,
        url: cp_url.clone(),
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut admin = loop {
        if let Ok(admin) = AdminClient::connect(cp.url.clone()).await {
            break admin;
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "switchyard-control did not start"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    .max_decoding_message_size(64 * 1024 * 1024);
    eprintln!(
        "processes: importing {} instances, starting {} routers",
        args.instances, args.processes
    );
    populate(&mut admin, args).await?;
    let client = crate::client::http_client();
    let mut routers = Vec::new();
    let mut ready = Vec::new();
    for index in 0..args.processes {
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        let started = Instant::now();
        let child = std::process::Command::new(&binary)
            .args(["--listen", &format!("127.0.0.1:{port}")])
            .args(["--control-plane", &cp_url])
            .args(["--worker-threads", "1"])
            .args(["--router-id", &format!("smoke-{index}")])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()?;
        let router = RouterProcess {
            child,
            url: format!("http://127.0.0.1:{port}"),
        };
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some((200, _)) = http_get(&client, &format!("{}/readyz", router.url)).await {
                break;
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "router {index} not ready in 60 s"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        ready.push(ms(started.elapsed()));
        routers.push(router);
    }
    let mut to_all = Vec::new();
    for change in 0..20 {
        let name = format!("smoke-{change}");
        let started = Instant::now();
        admin
            .create_endpoint(pb::CreateEndpointRequest {
                name: name.clone(),
                endpoint_config_name: "cfg-0".into(),
            })
            .await?;
        let mut pending: Vec<&RouterProcess> = routers.iter().collect();
        let deadline = Instant::now() + Duration::from_secs(30);
        while !pending.is_empty() {
            anyhow::ensure!(Instant::now() < deadline, "a router did not list {name}");
            let mut still = Vec::new();
            for router in pending {
                let listed = http_get(&client, &format!("{}/v1/models", router.url))
                    .await
                    .is_some_and(|(_, body)| body.contains(&format!("\"{name}\"")));
                if !listed {
                    still.push(router);
                }
            }
            pending = still;
            if !pending.is_empty() {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
        to_all.push(ms(started.elapsed()));
    }
    let resident: Vec<f64> = routers
        .iter()
        .map(|router| resident_mib(&router.child.id().to_string()))
        .collect();
    let control_plane_resident_mib = resident_mib(&cp.child.id().to_string());
    drop(routers);
    drop(cp);
    Ok(ProcessReport {
        processes: args.processes,
        ready_ms: Summary::of(&ready),
        change_to_all_ms: Summary::of(&to_all),
        resident_mib: Summary::of(&resident),
        control_plane_resident_mib,
    })
}
