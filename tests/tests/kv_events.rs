//! KV-cache events: the simulator's publisher against vLLM's own subscriber structures (Python
//! `msgspec` and `pyzmq`, as vLLM's example subscriber uses them), and the router's
//! subscribers and index against real simulators whose caches are filled and emptied by
//! requests sent straight to them.

use std::path::PathBuf;
use std::time::Duration;

use serde_json::{Value, json};
use switchyard_engine_sim::{KvEventsFormat, SimConfig, SimHandle};
use switchyard_tests::{http_get, http_post};
use tokio::io::{AsyncBufReadExt, BufReader};

/// A simulator publishing KV events on free loopback ports, running 1,000× faster than real
/// time, with a small KV cache so that evictions come quickly.
fn kv_sim(format: KvEventsFormat, kv_cache_blocks: usize) -> SimConfig {
    SimConfig {
        time_scale: 0.001,
        kv_cache_blocks,
        kv_events: Some("tcp://127.0.0.1:0".into()),
        kv_events_replay: Some("tcp://127.0.0.1:0".into()),
        kv_events_format: format,
        ..SimConfig::default()
    }
}

/// `count` distinct words (one simulator token each) starting at `first`.
fn words(first: usize, count: usize) -> String {
    (first..first + count)
        .map(|index| format!("w{index}"))
        .collect::<Vec<_>>()
        .join(" ")
}

async fn complete(sim: &SimHandle, prompt: &str) -> anyhow::Result<Value> {
    let reply = http_post(
        &format!("{}/v1/completions", sim.url),
        &[],
        json!({"model": "sim", "prompt": prompt, "max_tokens": 2}).to_string(),
    )
    .await?;
    anyhow::ensure!(reply.status == 200, "completion failed: {}", reply.body);
    Ok(reply.json())
}

async fn tokenize(sim: &SimHandle, prompt: &str) -> anyhow::Result<Vec<u64>> {
    let reply = http_post(
        &format!("{}/tokenize", sim.url),
        &[],
        json!({"model": "sim", "prompt": prompt}).to_string(),
    )
    .await?;
    anyhow::ensure!(reply.status == 200, "tokenize failed: {}", reply.body);
    let body = reply.json();
    assert_eq!(
        body["count"].as_u64(),
        Some(prompt.split(' ').count() as u64)
    );
    assert!(body["max_model_len"].as_u64().is_some(), "{body}");
    Ok(body["tokens"]
        .as_array()
        .expect("token ids")
        .iter()
        .filter_map(Value::as_u64)
        .collect())
}

fn test_python() -> PathBuf {
    let python = std::env::var("SWITCHYARD_TEST_PYTHON")
        .unwrap_or_else(|_| "target/python/bin/python".into());
    let python = PathBuf::from(python);
    let python = if python.is_absolute() {
        python
    } else {
        PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("..")
            .join(python)
    };
    assert!(
        python.is_file(),
        "{} is missing: scripts/test installs msgspec and pyzmq there",
        python.display()
    );
    python
}

#[tokio::test]
async fn the_simulators_kv_events_decode_with_vllms_msgspec_structures() -> anyhow::Result<()> {
    for (format, layout) in [
        (KvEventsFormat::Array, "array"),
        (KvEventsFormat::Map, "map"),
    ] {
        // 20 blocks: each request below reserves 4 (50 prompt + 2 output tokens).
        let sim = switchyard_engine_sim::spawn(kv_sim(format, 20)).await?;
        let (status, info) = http_get(&format!("{}/sim/kv-events", sim.url)).await?;
        assert_eq!(status, 200, "{info}");
        let info: Value = serde_json::from_str(&info)?;
        let endpoint = sim.kv_events_endpoint().expect("bound");
        let replay = sim.kv_events_replay_endpoint().expect("bound");
        assert_eq!(info["endpoint"], endpoint.as_str());
        assert_eq!(info["replay_endpoint"], replay.as_str());
        assert!(!endpoint.ends_with(":0"), "port 0 resolved: {endpoint}");

        // Fill the cache (3 full blocks of 16 per prompt), evict the first prompt, reset.
        let first = words(0, 50);
        complete(&sim, &first).await?;
        for round in 1..=8 {
            complete(&sim, &words(round * 100, 50)).await?;
        }
        let reset = http_post(&format!("{}/reset_prefix_cache", sim.url), &[], "").await?;
        assert_eq!(reset.json()["reset"], true, "{}", reset.body);
        let first_tokens = tokenize(&sim, &first).await?;

        let mut child = tokio::process::Command::new(test_python())
            .arg(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("python/kv_events_subscriber.py"))
            .args([&endpoint, &replay, layout])
            .stdout(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()?;
        let mut lines = BufReader::new(child.stdout.take().expect("piped")).lines();
        let ready = tokio::time::timeout(Duration::from_secs(20), lines.next_line()).await??;
        assert_eq!(ready.as_deref(), Some("ready"));
        // The subscription is made before "ready"; libzmq may still be completing it, so send
        // requests (each stores new blocks) until the subscriber has its live message.
        let mut round = 100;
        let output = loop {
            complete(&sim, &words(round * 100, 20)).await?;
            round += 1;
            if let Ok(line) =
                tokio::time::timeout(Duration::from_millis(200), lines.next_line()).await
            {
                break line?.expect("a JSON line");
            }
            anyhow::ensure!(round < 150, "no live message reached the Python subscriber");
        };
        let status = child.wait().await?;
        assert!(status.success(), "{layout}: subscriber failed");
        let decoded: Value = serde_json::from_str(&output)?;

        let replayed = decoded["replayed"].as_array().expect("replayed batches");
        let events: Vec<&Value> = replayed
            .iter()
            .enumerate()
            .flat_map(|(index, entry)| {
                assert_eq!(entry["seq"], index, "{layout}: sequence numbers from 0");
                assert_eq!(
                    entry["batch"]["data_parallel_rank"],
                    match format {
                        KvEventsFormat::Array => Value::Null, // not in the example's structure
                        KvEventsFormat::Map => json!(0),
                    }
                );
                entry["batch"]["events"].as_array().expect("events")
            })
            .collect();
        let stored = events[0];
        assert_eq!(stored["type"], "BlockStored", "{layout}: {stored}");
        assert_eq!(stored["parent_block_hash"], Value::Null);
        assert_eq!(stored["block_size"], 16);
        assert_eq!(stored["medium"], "GPU");
        assert_eq!(stored["lora_id"], Value::Null);
        let first_hashes = stored["block_hashes"].as_array().expect("hashes").clone();
        assert_eq!(
            first_hashes.len(),
            3,
            "{layout}: 50 tokens are 3 full blocks"
        );
        let token_ids: Vec<u64> = stored["token_ids"]
            .as_array()
            .expect("token ids")
            .iter()
            .filter_map(Value::as_u64)
            .collect();
        assert_eq!(
            token_ids,
            first_tokens[..48],
            "{layout}: the ids /tokenize returns"
        );
        let removed: Vec<&Value> = events
            .iter()
            .filter(|event| event["type"] == "BlockRemoved")
            .flat_map(|event| event["block_hashes"].as_array().expect("hashes"))
            .collect();
        for hash in &first_hashes {
            assert!(removed.contains(&hash), "{layout}: {hash} evicted");
        }
        assert_eq!(events.last().expect("events")["type"], "AllBlocksCleared");
        if format == KvEventsFormat::Map {
            assert_eq!(stored["group_idx"], 0);
            assert_eq!(stored["extra_keys"], json!([null, null, null]));
        }
        let live = &decoded["live"];
        assert!(
            live["seq"].as_u64() >= Some(replayed.len() as u64),
            "{live}"
        );
        assert_eq!(live["topic"], "");
        assert_eq!(live["batch"]["events"][0]["type"], "BlockStored");
        sim.shutdown().await;
    }
    Ok(())
}
