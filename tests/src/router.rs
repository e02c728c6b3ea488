//! Routers in this process: following control planes, or from a static file; what they route
//! to, and their counts back at zero.

use std::path::Path;
use std::time::Duration;

use switchyard_router::{RouterConfig, RouterHandle};
use switchyard_testkit::{eventually, loopback_any};

/// Starts an in-process router following `control_planes`, serving on two threads (the
/// test's runtime and one of its own) as the binary does on a 2-CPU machine, so that every
/// router test also covers requests and connections spread over serving threads.
pub async fn router(control_planes: &[String]) -> anyhow::Result<RouterHandle> {
    router_with(RouterConfig::with_control_plane(
        loopback_any(),
        control_planes.to_vec(),
    ))
    .await
}

/// Starts an in-process router from `config`, on two serving threads as [`router`] does.
pub async fn router_with(mut config: RouterConfig) -> anyhow::Result<RouterHandle> {
    config.worker_threads = Some(2);
    let settings = config.validate().map_err(anyhow::Error::msg)?;
    Ok(RouterHandle::start(settings).await?)
}

/// Starts an in-process router from a static file (no control plane): `contents` (YAML or
/// JSON) written to `path`, every flag at its default (one serving thread) but for what `tune`
/// sets.
pub async fn router_from_file(
    path: &Path,
    contents: &str,
    tune: impl FnOnce(&mut RouterConfig),
) -> anyhow::Result<RouterHandle> {
    std::fs::write(path, contents)?;
    let mut config = RouterConfig::with_control_plane(loopback_any(), vec![]);
    config.config = Some(path.to_path_buf());
    tune(&mut config);
    Ok(RouterHandle::start(config.validate().map_err(anyhow::Error::msg)?).await?)
}

/// The chat completions URL of endpoint `chat` through `router`.
pub fn chat_url(router: &RouterHandle) -> String {
    format!("{}/endpoints/chat/openai/v1/chat/completions", router.url())
}

/// The SageMaker invocations URL of endpoint `chat` through `router`.
pub fn invocations_url(router: &RouterHandle) -> String {
    format!("{}/endpoints/chat/invocations", router.url())
}

/// The ids of the instances `router` routes `endpoint` to now, over all its variants, sorted.
pub fn routed_instances(router: &RouterHandle, endpoint: &str) -> Vec<String> {
    let table = router.table();
    let mut ids: Vec<String> = table
        .endpoints
        .get(endpoint)
        .map(|endpoint| {
            endpoint
                .variants
                .iter()
                .flat_map(|variant| &variant.instances)
                .map(|instance| instance.id.to_string())
                .collect()
        })
        .unwrap_or_default();
    ids.sort();
    ids
}

/// How many instances `router` routes `endpoint` to now, over all its variants (`None`: it
/// does not know the endpoint).
pub fn routed_count(router: &RouterHandle, endpoint: &str) -> Option<usize> {
    router.table().endpoints.get(endpoint).map(|endpoint| {
        endpoint
            .variants
            .iter()
            .map(|variant| variant.instances.len())
            .sum()
    })
}

/// Waits (15 s at most) until `router` routes to `count` instances of `endpoint`, over all
/// its variants.
pub async fn wait_for_router_instances(
    router: &RouterHandle,
    endpoint: &str,
    count: usize,
) -> anyhow::Result<()> {
    eventually(
        Duration::from_secs(15),
        &format!("the router to see {count} instances of {endpoint}"),
        || async { routed_count(router, endpoint) == Some(count) },
    )
    .await
}

/// Waits (10 s at most) until nothing is counted in flight any more in `router`: requests,
/// admission slots, buffered bytes. After every case of a test, so that no count leaks.
pub async fn settles(router: &RouterHandle) -> anyhow::Result<()> {
    eventually(
        Duration::from_secs(10),
        "in-flight counts back to 0",
        || async {
            router.in_flight() == 0
                && router.admission().in_flight() == 0
                && router.admission().buffered_bytes() == 0
        },
    )
    .await
}
