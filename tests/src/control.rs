//! Control planes in this process (on etcd or an embedded store) and as real processes.

use std::path::Path;

use switchyard_proto::v1::admin_client::AdminClient;
use switchyard_testkit::{Etcd, Process, loopback_any};
use tonic::transport::Channel;

/// Starts an in-process control plane.
pub async fn control_plane(
    config: switchyard_control::ControlConfig,
) -> anyhow::Result<switchyard_control::ControlPlane> {
    let settings = config.validate()?;
    Ok(switchyard_control::ControlPlane::start(settings).await?)
}

/// A control plane on `etcd`, its keys under `prefix`.
pub async fn etcd_control_plane(
    etcd: &Etcd,
    prefix: &str,
) -> anyhow::Result<switchyard_control::ControlPlane> {
    control_plane(switchyard_control::ControlConfig::etcd(
        loopback_any(),
        vec![etcd.url.clone()],
        prefix,
    ))
    .await
}

/// A fresh etcd, a control plane on it (its keys under `prefix`) and an admin client of that
/// control plane ([`crate::admin`]): where the tests of the admin API over etcd begin. The etcd
/// and the control plane stop when dropped, so keep them while the client is used.
pub async fn etcd_admin(
    prefix: &str,
) -> anyhow::Result<(Etcd, switchyard_control::ControlPlane, AdminClient<Channel>)> {
    let etcd = Etcd::start().await?;
    let control_plane = etcd_control_plane(&etcd, prefix).await?;
    let admin = crate::admin(&control_plane.url()).await?;
    Ok((etcd, control_plane, admin))
}

/// A fresh etcd and two control-plane replicas on it, their keys under `prefix`: a real
/// process ([`etcd_control_process`], for a crash by SIGKILL) and one in this process.
pub async fn etcd_replica_pair(
    prefix: &str,
) -> anyhow::Result<(Etcd, Process, switchyard_control::ControlPlane)> {
    let etcd = Etcd::start().await?;
    let process = etcd_control_process(&etcd, prefix)?;
    let in_process = etcd_control_plane(&etcd, prefix).await?;
    Ok((etcd, process, in_process))
}

/// A control plane on a fresh embedded store in `dir` ([`embedded_control_plane`]) and an admin
/// client of it ([`crate::admin`]).
pub async fn embedded_admin(
    dir: &Path,
) -> anyhow::Result<(switchyard_control::ControlPlane, AdminClient<Channel>)> {
    let control_plane = embedded_control_plane(dir).await?;
    let admin = crate::admin(&control_plane.url()).await?;
    Ok((control_plane, admin))
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

/// A real `switchyard-control` process listening on `127.0.0.1:0`, with `store_args` (e.g.
/// `["--data-dir", DIR]` or `["--store", "etcd", "--etcd-endpoints", URL]`): for crashes,
/// which only a process killed with SIGKILL shows as they are.
pub fn control_process(store_args: &[&str]) -> anyhow::Result<Process> {
    let mut args = vec!["--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0"];
    args.extend_from_slice(store_args);
    Process::start("switchyard-control", &args, "control plane listening")
}

/// [`control_process`] on `etcd`, its keys under `prefix`.
pub fn etcd_control_process(etcd: &Etcd, prefix: &str) -> anyhow::Result<Process> {
    control_process(&[
        "--store",
        "etcd",
        "--etcd-endpoints",
        &etcd.url,
        "--etcd-prefix",
        prefix,
    ])
}
