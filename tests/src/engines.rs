//! Simulated engines as the tests configure and drive them.

use switchyard_engine_sim::{KvEventsFormat, SimConfig, SimHandle};
use switchyard_shared::InstanceId;
use switchyard_testkit::http_post;

/// A simulator 50× faster than real time.
pub fn fast() -> SimConfig {
    SimConfig {
        time_scale: 0.02,
        ..SimConfig::default()
    }
}

/// A simulator at real speed (the default model: about 14 ms a token).
pub fn real_time() -> SimConfig {
    SimConfig {
        time_scale: 1.0,
        ..SimConfig::default()
    }
}

/// A simulator publishing KV events in `format` on free loopback ports, 1,000× faster than real
/// time, with `kv_cache_blocks` blocks of KV cache (a small cache evicts quickly).
pub fn kv_sim(format: KvEventsFormat, kv_cache_blocks: usize) -> SimConfig {
    SimConfig {
        time_scale: 0.001,
        kv_cache_blocks,
        kv_events: Some("tcp://127.0.0.1:0".into()),
        kv_events_replay: Some("tcp://127.0.0.1:0".into()),
        kv_events_format: format,
        ..SimConfig::default()
    }
}

/// A completion of `prompt` (2 tokens) sent straight to `sim`, not through a router: the
/// simulator caches the prompt's full blocks, and publishes them when its KV events are on.
pub async fn place(sim: &SimHandle, prompt: &str) -> anyhow::Result<()> {
    let reply = http_post(
        &format!("{}/v1/completions", sim.url),
        &[],
        serde_json::json!({"model": "sim", "prompt": prompt, "max_tokens": 2}).to_string(),
    )
    .await?;
    anyhow::ensure!(reply.status == 200, "completion failed: {}", reply.body);
    Ok(())
}

/// Places 12 prompts on `sims` in turn ([`place`]): each the same 64 words, then 20 to 68 words
/// of its own (so that they share starts of various lengths, and small caches evict some).
pub async fn place_sharing_starts(sims: &[SimHandle]) -> anyhow::Result<Vec<String>> {
    let shared = crate::words(0, 64);
    let mut prompts = Vec::new();
    for round in 0..12usize {
        let prompt = format!(
            "{shared} {}",
            crate::words(1000 + round * 100, 16 * (round % 4) + 20)
        );
        place(&sims[round % sims.len()], &prompt).await?;
        prompts.push(prompt);
    }
    Ok(prompts)
}

/// The prefix-cache hits (in tokens) of `sims`, summed.
pub fn prefix_cache_hits(sims: &[SimHandle]) -> u64 {
    sims.iter().map(|sim| sim.stats().prefix_cache_hits).sum()
}

/// The token ids `sim`'s `/tokenize` gives for `body` (a prompt or messages, and `model`).
pub async fn sim_tokens(sim: &SimHandle, body: serde_json::Value) -> anyhow::Result<Vec<u32>> {
    let reply = http_post(&format!("{}/tokenize", sim.url), &[], body.to_string()).await?;
    anyhow::ensure!(reply.status == 200, "tokenize failed: {}", reply.body);
    Ok(serde_json::from_value(reply.json()["tokens"].clone())?)
}

/// A stand-in engine serving `app` on a free loopback port (one that misbehaves in a way the
/// simulator does not): its URL, and the task serving it.
pub async fn stand_in(
    app: axum::Router,
) -> anyhow::Result<(String, tokio::task::JoinHandle<std::io::Result<()>>)> {
    let listener = tokio::net::TcpListener::bind(switchyard_testkit::loopback_any()).await?;
    let url = format!("http://{}", listener.local_addr()?);
    Ok((
        url,
        tokio::spawn(async move { axum::serve(listener, app).await }),
    ))
}

/// The typed ids of instances `names` (as the router's KV index is asked about them).
pub fn instance_ids(names: &[&str]) -> Vec<InstanceId> {
    names
        .iter()
        .map(|name| InstanceId::new(name).expect("an instance id"))
        .collect()
}
