//! HTTP tests against real simulators on 127.0.0.1:0, with a hyper client.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{Context as _, Result, bail};
use bytes::Bytes;
use http::{HeaderMap, Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};
use switchyard_engine_sim::{
    Faults, InstanceRole, SimConfig, SimHandle, SimStats, count_tokens, spawn,
};
use tokio::net::TcpStream;

/// Every wait in these tests is bounded by this.
const WAIT: Duration = Duration::from_secs(10);

fn fast_config() -> SimConfig {
    SimConfig {
        time_scale: 0.001,
        ..SimConfig::default()
    }
}

/// Slow enough for a test to act while a stream is running.
fn slow_config() -> SimConfig {
    SimConfig {
        time_scale: 0.01,
        ..SimConfig::default()
    }
}

struct Reply {
    status: StatusCode,
    headers: HeaderMap,
    body: Bytes,
}

impl Reply {
    fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|err| {
            panic!("not JSON ({err}): {}", String::from_utf8_lossy(&self.body))
        })
    }
}

/// Sends one request on a fresh connection and returns the response head and its body
/// stream (the connection lives as long as the body is read).
async fn open(
    addr: SocketAddr,
    method: Method,
    path: &str,
    headers: &[(&str, &str)],
    body: Vec<u8>,
) -> Result<hyper::Response<Incoming>> {
    let stream = TcpStream::connect(addr).await?;
    let (mut sender, connection) =
        hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    tokio::spawn(async move {
        let _ = connection.await;
    });
    let mut request = Request::builder()
        .method(method)
        .uri(path)
        .header("host", addr.to_string())
        .header("content-type", "application/json");
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let response = tokio::time::timeout(
        WAIT,
        sender.send_request(request.body(Full::new(Bytes::from(body)))?),
    )
    .await
    .context("no response in time")??;
    Ok(response)
}

async fn send(
    addr: SocketAddr,
    method: Method,
    path: &str,
    headers: &[(&str, &str)],
    body: Vec<u8>,
) -> Result<Reply> {
    let response = open(addr, method, path, headers, body).await?;
    let (parts, body) = response.into_parts();
    let body = tokio::time::timeout(WAIT, body.collect())
        .await
        .context("body not complete in time")??
        .to_bytes();
    Ok(Reply {
        status: parts.status,
        headers: parts.headers,
        body,
    })
}

async fn post(addr: SocketAddr, path: &str, body: &Value) -> Result<Reply> {
    post_with(addr, path, &[], body).await
}

async fn post_with(
    addr: SocketAddr,
    path: &str,
    headers: &[(&str, &str)],
    body: &Value,
) -> Result<Reply> {
    send(
        addr,
        Method::POST,
        path,
        headers,
        body.to_string().into_bytes(),
    )
    .await
}

/// [`open`] for a JSON `POST`: the response head and its body stream.
async fn open_post(
    addr: SocketAddr,
    path: &str,
    body: &Value,
) -> Result<hyper::Response<Incoming>> {
    open_post_with(addr, path, &[], body).await
}

async fn open_post_with(
    addr: SocketAddr,
    path: &str,
    headers: &[(&str, &str)],
    body: &Value,
) -> Result<hyper::Response<Incoming>> {
    open(
        addr,
        Method::POST,
        path,
        headers,
        body.to_string().into_bytes(),
    )
    .await
}

/// Starts a completion stream far too long to end during the test and reads its first event.
async fn endless_stream(addr: SocketAddr) -> Result<Incoming> {
    let body = json!({"prompt": "go", "max_tokens": 100_000, "stream": true});
    let mut body = open_post(addr, "/v1/completions", &body).await?.into_body();
    read_first_event(&mut body).await?;
    Ok(body)
}

async fn get(addr: SocketAddr, path: &str) -> Result<Reply> {
    send(addr, Method::GET, path, &[], Vec::new()).await
}

/// Reads a body to its end as text.
async fn read_text(body: &mut Incoming) -> Result<String> {
    let mut text = String::new();
    while let Some(frame) = tokio::time::timeout(WAIT, body.frame())
        .await
        .context("stream stalled")?
    {
        if let Ok(data) = frame?.into_data() {
            text.push_str(std::str::from_utf8(&data)?);
        }
    }
    Ok(text)
}

/// Reads a body until it ends or breaks: the text so far, and whether it broke.
async fn read_until_broken(body: &mut Incoming) -> Result<(String, bool)> {
    let mut text = String::new();
    while let Some(frame) = tokio::time::timeout(WAIT, body.frame()).await? {
        let Ok(frame) = frame else {
            return Ok((text, true));
        };
        if let Ok(data) = frame.into_data() {
            text.push_str(std::str::from_utf8(&data)?);
        }
    }
    Ok((text, false))
}

/// Reads one SSE body to its end; returns the `data:` payloads.
async fn read_events(body: &mut Incoming) -> Result<Vec<String>> {
    Ok(sse_payloads(&read_text(body).await?))
}

fn sse_payloads(text: &str) -> Vec<String> {
    text.split("\n\n")
        .filter_map(|event| event.strip_prefix("data: "))
        .map(str::to_owned)
        .collect()
}

/// Reads frames until at least one whole `data:` event arrived; returns the text so far.
async fn read_first_event(body: &mut Incoming) -> Result<String> {
    let mut text = String::new();
    while !text.contains("\n\n") {
        let Some(frame) = tokio::time::timeout(WAIT, body.frame())
            .await
            .context("stream stalled")?
        else {
            bail!("stream ended before any event");
        };
        if let Ok(data) = frame?.into_data() {
            text.push_str(std::str::from_utf8(&data)?);
        }
    }
    Ok(text)
}

/// Polls the simulator's stats until `done` holds (bounded by [`WAIT`]).
async fn wait_for_stats(sim: &SimHandle, done: impl Fn(&SimStats) -> bool) -> SimStats {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let stats = sim.stats();
        if done(&stats) {
            return stats;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "stats never matched: {stats:?}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

fn words(count: usize) -> String {
    (0..count)
        .map(|index| format!("w{index}"))
        .collect::<Vec<_>>()
        .join(" ")
}

#[tokio::test]
async fn non_streaming_chat_has_vllm_shape() -> Result<()> {
    let sim = spawn(fast_config()).await?;
    let reply = post_with(
        sim.addr,
        "/v1/chat/completions",
        &[("x-request-id", "req-42")],
        &json!({"model": "sim", "messages": [{"role": "user", "content": "the cat sat"}],
               "max_tokens": 5, "temperature": 0.7}),
    )
    .await?;
    assert_eq!(reply.status, StatusCode::OK);
    assert_eq!(reply.headers["x-request-id"], "req-42");
    let body = reply.json();
    assert_eq!(body["id"], "chatcmpl-req-42");
    assert_eq!(body["object"], "chat.completion");
    assert_eq!(body["model"], "sim");
    let choice = &body["choices"][0];
    assert_eq!(choice["message"]["role"], "assistant");
    assert_eq!(choice["finish_reason"], "length");
    let content = choice["message"]["content"].as_str().unwrap();
    assert_eq!(count_tokens(content), 5);
    let usage = &body["usage"];
    assert_eq!(usage["completion_tokens"], 5);
    assert_eq!(usage["prompt_tokens"], 14);
    assert_eq!(usage["total_tokens"], 19);
    assert_eq!(usage["prompt_tokens_details"]["cached_tokens"], 0);

    // A missing model is the served model; the default is 16 tokens.
    let reply = post(
        sim.addr,
        "/v1/completions",
        &json!({"prompt": "the cat sat"}),
    )
    .await?;
    assert_eq!(reply.status, StatusCode::OK);
    let body = reply.json();
    assert_eq!(body["object"], "text_completion");
    assert_eq!(body["usage"]["completion_tokens"], 16);
    assert_eq!(
        count_tokens(body["choices"][0]["text"].as_str().unwrap()),
        16
    );
    assert_eq!(sim.stats().requests_completed, 2);
    sim.shutdown().await;
    Ok(())
}

/// A continuation of the simulator's own earlier output resumes at the next word, so the text
/// so far plus the continuation is the undisturbed answer (what request migration relies on).
#[tokio::test]
async fn a_continuation_resumes_where_the_earlier_answer_stopped() -> Result<()> {
    let sim = spawn(fast_config()).await?;
    let text = |reply: &Reply, path: &str| reply.json()["choices"][0][path].clone();
    let user = json!({"role": "user", "content": "the cat sat"});
    let whole = post(
        sim.addr,
        "/v1/chat/completions",
        &json!({"messages": [user], "max_tokens": 7}),
    )
    .await?;
    let whole = text(&whole, "message")["content"]
        .as_str()
        .unwrap()
        .to_owned();
    let words: Vec<&str> = whole.split(' ').collect();
    let (head, _) = whole.split_at(words[..3].join(" ").len());
    let rest = post(
        sim.addr,
        "/v1/chat/completions",
        &json!({"messages": [user, {"role": "assistant", "content": head}], "max_tokens": 4,
                "continue_final_message": true, "add_generation_prompt": false}),
    )
    .await?;
    assert_eq!(rest.status, StatusCode::OK);
    let rest = text(&rest, "message")["content"]
        .as_str()
        .unwrap()
        .to_owned();
    assert_eq!(format!("{head}{rest}"), whole);

    // vLLM refuses to continue a message and start a new one (its default adds the prompt).
    let both = post(
        sim.addr,
        "/v1/chat/completions",
        &json!({"messages": [user, {"role": "assistant", "content": head}],
                "continue_final_message": true}),
    )
    .await?;
    assert_eq!(both.status, StatusCode::BAD_REQUEST);
    assert!(
        both.json()["error"]["message"]
            .as_str()
            .unwrap()
            .contains("add_generation_prompt")
    );

    // Completions: the prompt plus the text so far.
    let whole = post(
        sim.addr,
        "/v1/completions",
        &json!({"prompt": "the cat sat", "max_tokens": 6}),
    )
    .await?;
    let whole = text(&whole, "text").as_str().unwrap().to_owned();
    let head = &whole[..whole.match_indices(' ').nth(1).unwrap().0];
    let rest = post(
        sim.addr,
        "/v1/completions",
        &json!({"prompt": format!("the cat sat{head}"), "max_tokens": 4}),
    )
    .await?;
    let rest = text(&rest, "text").as_str().unwrap().to_owned();
    assert_eq!(format!("{head}{rest}"), whole);
    sim.shutdown().await;
    Ok(())
}

#[tokio::test]
async fn streaming_chat_arrives_in_chunks_and_ends_with_done() -> Result<()> {
    let sim = spawn(fast_config()).await?;
    let response = open_post(
        sim.addr,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6,
               "stream": true, "stream_options": {"include_usage": true}}),
    )
    .await?;
    assert_eq!(response.status(), StatusCode::OK);
    assert!(
        response.headers()["content-type"]
            .to_str()?
            .starts_with("text/event-stream")
    );
    let mut body = response.into_body();
    let events = read_events(&mut body).await?;
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|event| serde_json::from_str(event))
        .collect::<Result<_, _>>()?;
    // Role chunk, 6 token chunks, usage chunk.
    assert_eq!(chunks.len(), 8, "{events:?}");
    assert_eq!(chunks[0]["object"], "chat.completion.chunk");
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let text: String = chunks[1..7]
        .iter()
        .map(|chunk| chunk["choices"][0]["delta"]["content"].as_str().unwrap())
        .collect();
    assert_eq!(count_tokens(&text), 6);
    assert!(chunks[1]["choices"][0]["finish_reason"].is_null());
    assert_eq!(chunks[6]["choices"][0]["finish_reason"], "length");
    assert_eq!(chunks[7]["choices"], json!([]));
    assert_eq!(chunks[7]["usage"]["completion_tokens"], 6);
    sim.shutdown().await;
    Ok(())
}

/// The chunks of a stream (its `data:` payloads but `[DONE]`).
async fn stream_chunks(addr: SocketAddr, path: &str, body: &Value) -> Result<Vec<Value>> {
    let mut response = open_post(addr, path, body).await?.into_body();
    let events = read_events(&mut response).await?;
    anyhow::ensure!(
        events.last().map(String::as_str) == Some("[DONE]"),
        "{events:?}"
    );
    Ok(events[..events.len() - 1]
        .iter()
        .map(|event| serde_json::from_str(event))
        .collect::<Result<_, _>>()?)
}

/// vLLM 0.32's `return_token_ids`, as a real vLLM answers it: a chat's prompt ids at the top
/// (on its first chunk when streamed) and each choice's or chunk's token ids; a completion's
/// prompt ids in its choice (on its first chunk).
#[tokio::test]
async fn return_token_ids_puts_the_ids_where_vllm_puts_them() -> Result<()> {
    let sim = spawn(fast_config()).await?;
    let chat = json!({"messages": [{"role": "user", "content": "the cat sat"}], "max_tokens": 3,
                      "return_token_ids": true});
    let prompt = |body: &Value| -> Result<Value> {
        let sent = body.clone();
        Ok(serde_json::to_value(
            switchyard_engine_sim::tokenizer::tokenize(&if sent.get("messages").is_some() {
                switchyard_engine_sim::tokenizer::chat_prompt_text(
                    sent["messages"].as_array().unwrap(),
                )
            } else {
                sent["prompt"].as_str().unwrap().to_owned()
            }),
        )?)
    };
    let whole = post(sim.addr, "/v1/chat/completions", &chat).await?.json();
    assert_eq!(whole["prompt_token_ids"], prompt(&chat)?);
    assert_eq!(
        whole["choices"][0]["token_ids"].as_array().map(Vec::len),
        Some(3)
    );
    let completion = json!({"prompt": "the cat sat", "max_tokens": 2, "return_token_ids": true});
    let whole = post(sim.addr, "/v1/completions", &completion).await?.json();
    assert_eq!(
        whole["choices"][0]["prompt_token_ids"],
        prompt(&completion)?
    );
    assert_eq!(
        whole["choices"][0]["token_ids"].as_array().map(Vec::len),
        Some(2)
    );
    assert!(whole.get("prompt_token_ids").is_none());
    // Streamed: the chat's role chunk carries the prompt, each token chunk its id.
    let mut streamed = chat.clone();
    streamed["stream"] = json!(true);
    let chunks = stream_chunks(sim.addr, "/v1/chat/completions", &streamed).await?;
    assert_eq!(chunks[0]["prompt_token_ids"], prompt(&chat)?);
    let ids: Vec<Value> = chunks[1..]
        .iter()
        .map(|chunk| chunk["choices"][0]["token_ids"].clone())
        .collect();
    let whole = post(sim.addr, "/v1/chat/completions", &chat).await?.json();
    let one_by_one: Vec<Value> = whole["choices"][0]["token_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|id| json!([id]))
        .collect();
    assert_eq!(ids, one_by_one);
    let mut streamed = completion.clone();
    streamed["stream"] = json!(true);
    let chunks = stream_chunks(sim.addr, "/v1/completions", &streamed).await?;
    assert_eq!(
        chunks[0]["choices"][0]["prompt_token_ids"],
        prompt(&completion)?
    );
    assert_eq!(chunks[1]["choices"][0]["prompt_token_ids"], Value::Null);
    assert_eq!(
        chunks[1]["choices"][0]["token_ids"]
            .as_array()
            .map(Vec::len),
        Some(1)
    );
    // Not asked: none of it.
    let plain = post(
        sim.addr,
        "/v1/chat/completions",
        &json!({"messages": chat["messages"], "max_tokens": 1}),
    )
    .await?
    .json();
    assert!(
        plain.get("prompt_token_ids").is_none() && plain["choices"][0].get("token_ids").is_none()
    );
    sim.shutdown().await;
    Ok(())
}

/// vLLM 0.32's decode-side token reuse: a chat's `kv_transfer_params.prompt_token_ids` are
/// served as the prompt, not rendered from `messages` (unless `echo` or non-text content);
/// malformed ones are refused naming the field.
#[tokio::test]
async fn a_chats_forwarded_prompt_ids_are_served_instead_of_its_messages() -> Result<()> {
    let sim = spawn(fast_config()).await?;
    let chat = |extra: Value| {
        let mut body = json!({"messages": [{"role": "user", "content": "the cat sat on the mat"}],
                              "max_tokens": 1, "return_token_ids": true});
        for (key, value) in extra.as_object().unwrap() {
            body[key] = value.clone();
        }
        body
    };
    let given = json!([7, 8, 9, 10]);
    let reused = post(
        sim.addr,
        "/v1/chat/completions",
        &chat(json!({"kv_transfer_params": {"prompt_token_ids": given}})),
    )
    .await?
    .json();
    assert_eq!(reused["prompt_token_ids"], given);
    assert_eq!(reused["usage"]["prompt_tokens"], 4);
    let rendered = post(sim.addr, "/v1/chat/completions", &chat(json!({})))
        .await?
        .json();
    assert_ne!(rendered["prompt_token_ids"], given);
    for extra in [
        json!({"echo": true}),
        json!({"messages": [{"role": "user", "content": [{"type": "text", "text": "the cat sat on the mat"}, {"type": "image_url", "image_url": {"url": "data:,"}}]}]}),
    ] {
        let mut extra = extra;
        extra["kv_transfer_params"] = json!({"prompt_token_ids": given});
        let answer = post(sim.addr, "/v1/chat/completions", &chat(extra.clone())).await?;
        assert_eq!(answer.status, StatusCode::OK, "{extra}");
        let ids = &answer.json()["prompt_token_ids"];
        assert!(ids.as_array().is_some_and(|ids| !ids.is_empty()), "{extra}");
        assert_ne!(ids, &given, "{extra}");
    }
    // `echo` and `return_token_ids` are read as pydantic reads booleans.
    for (field, value) in [("echo", json!(2)), ("return_token_ids", json!("maybe"))] {
        let mut body = chat(json!({}));
        body[field] = value;
        let refused = post(sim.addr, "/v1/chat/completions", &body).await?;
        assert_eq!(refused.status, StatusCode::BAD_REQUEST, "{field}");
        assert_eq!(refused.json()["error"]["param"], format!("body.{field}"));
    }
    let mut body = chat(json!({}));
    body["return_token_ids"] = json!("yes");
    let answer = post(sim.addr, "/v1/chat/completions", &body).await?.json();
    assert!(answer["prompt_token_ids"].is_array());
    for ids in [
        json!([]),
        json!([-1]),
        json!([1.0]),
        json!("1"),
        json!([4294967296_u64]),
    ] {
        let refused = post(
            sim.addr,
            "/v1/chat/completions",
            &chat(json!({"kv_transfer_params": {"prompt_token_ids": ids}})),
        )
        .await?;
        assert_eq!(refused.status, StatusCode::BAD_REQUEST, "{ids}");
        assert_eq!(
            refused.json()["error"]["param"],
            "kv_transfer_params.prompt_token_ids",
            "{ids}"
        );
    }
    // Completions do not reuse them (vLLM's chat path only).
    let completion = post(
        sim.addr,
        "/v1/completions",
        &json!({"prompt": "the cat sat on the mat", "max_tokens": 1,
        "return_token_ids": true, "kv_transfer_params": {"prompt_token_ids": given}}),
    )
    .await?;
    assert_eq!(completion.status, StatusCode::OK);
    assert_ne!(completion.json()["choices"][0]["prompt_token_ids"], given);
    sim.shutdown().await;
    Ok(())
}

#[tokio::test]
async fn streaming_completions_and_invocations() -> Result<()> {
    let sim = spawn(fast_config()).await?;
    let response = open_post(
        sim.addr,
        "/invocations",
        &json!({"prompt": "hello there", "max_tokens": 3, "stream": true}),
    )
    .await?;
    let events = read_events(&mut response.into_body()).await?;
    assert_eq!(events.len(), 4, "{events:?}");
    let first: Value = serde_json::from_str(&events[0])?;
    assert_eq!(first["object"], "text_completion");
    assert_eq!(first["choices"][0]["text"], "lorem");

    let chat = post(
        sim.addr,
        "/invocations",
        &json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
    )
    .await?;
    assert_eq!(chat.json()["object"], "chat.completion");
    let completion = post(sim.addr, "/invocations", &json!({"prompt": "hi"})).await?;
    assert_eq!(completion.json()["object"], "text_completion");
    sim.shutdown().await;
    Ok(())
}

#[tokio::test]
async fn a_repeated_long_prompt_hits_the_prefix_cache() -> Result<()> {
    let sim = spawn(fast_config()).await?;
    // ~84 KB of body: large enough to be tokenized on a blocking thread.
    let request =
        json!({"messages": [{"role": "user", "content": words(12_000)}], "max_tokens": 2});
    let first = post(sim.addr, "/v1/chat/completions", &request)
        .await?
        .json();
    let second = post(sim.addr, "/v1/chat/completions", &request)
        .await?
        .json();
    let prompt_tokens = first["usage"]["prompt_tokens"].as_u64().unwrap();
    assert_eq!(prompt_tokens, 12_000 + 5 + 6);
    assert_eq!(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    // Every full block but the one holding the last prompt token.
    assert_eq!(cached, (prompt_tokens - 1) / 16 * 16);
    let stats = sim.stats();
    assert_eq!(stats.prefix_cache_queries, 2 * prompt_tokens);
    assert_eq!(stats.prefix_cache_hits, cached);
    sim.shutdown().await;
    Ok(())
}

#[tokio::test]
async fn a_lora_adapter_is_served_by_name_with_a_prefix_cache_of_its_own() -> Result<()> {
    let sim = spawn(SimConfig {
        lora_modules: vec!["sql-lora=/adapters/sql".into(), "chat-lora".into()],
        ..fast_config()
    })
    .await?;
    let ask = |model: &str| json!({"model": model, "prompt": words(100), "max_tokens": 2});
    let cached =
        |reply: &Reply| reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"].clone();
    let base = post(sim.addr, "/v1/completions", &ask("sim")).await?;
    assert_eq!(base.status, StatusCode::OK);
    // The same prompt under an adapter: none of the base model's blocks, then its own.
    let first = post(sim.addr, "/v1/completions", &ask("sql-lora")).await?;
    assert_eq!(first.status, StatusCode::OK);
    assert_eq!(first.json()["model"], "sql-lora");
    assert_eq!(cached(&first), 0);
    let again = post(sim.addr, "/v1/completions", &ask("sql-lora")).await?;
    assert_eq!(cached(&again), 96);
    assert_eq!(
        cached(&post(sim.addr, "/v1/completions", &ask("chat-lora")).await?),
        0
    );
    let unknown = post(sim.addr, "/v1/completions", &ask("other-lora")).await?;
    assert_eq!(unknown.status, StatusCode::NOT_FOUND);
    assert_eq!(unknown.json()["error"]["param"], "model");
    let models = get(sim.addr, "/v1/models").await?.json();
    let listed: Vec<(Value, Value, Value)> = models["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|model| {
            (
                model["id"].clone(),
                model["parent"].clone(),
                model["root"].clone(),
            )
        })
        .collect();
    assert_eq!(
        listed,
        [
            (json!("sim"), Value::Null, json!("sim")),
            (json!("sql-lora"), json!("sim"), json!("/adapters/sql")),
            (json!("chat-lora"), json!("sim"), json!("chat-lora")),
        ]
    );
    sim.shutdown().await;
    Ok(())
}

#[tokio::test]
async fn errors_look_like_vllm() -> Result<()> {
    let sim = spawn(fast_config()).await?;
    let wrong = post(
        sim.addr,
        "/v1/chat/completions",
        &json!({"model": "gpt-4", "messages": []}),
    )
    .await?;
    assert_eq!(wrong.status, StatusCode::NOT_FOUND);
    assert_eq!(
        wrong.json(),
        json!({"error": {"message": "The model `gpt-4` does not exist.",
                         "type": "NotFoundError", "param": "model", "code": 404}})
    );

    let malformed = send(
        sim.addr,
        Method::POST,
        "/v1/completions",
        &[],
        b"{\"prompt\": ".to_vec(),
    )
    .await?;
    assert_eq!(malformed.status, StatusCode::BAD_REQUEST);
    let error = malformed.json();
    assert_eq!(error["error"]["type"], "BadRequestError");
    assert_eq!(error["error"]["code"], 400);

    // As vLLM 0.32: a budget over the whole context is refused; one over what the prompt
    // leaves is cut to it; a prompt past the context is refused.
    let too_long = post(
        sim.addr,
        "/v1/completions",
        &json!({"prompt": "hi", "max_tokens": 200_000}),
    )
    .await?;
    assert_eq!(too_long.status, StatusCode::BAD_REQUEST);
    assert_eq!(too_long.json()["error"]["param"], "max_tokens");
    assert!(
        too_long.json()["error"]["message"]
            .as_str()
            .unwrap()
            .starts_with("max_tokens=200000 cannot be greater than max_model_len=")
    );
    sim.shutdown().await;
    let sim = spawn(SimConfig {
        max_model_len: 64,
        ..fast_config()
    })
    .await?;
    let context = 64;
    let cut = post(
        sim.addr,
        "/v1/completions",
        &json!({"prompt": "hi there", "max_tokens": context}),
    )
    .await?;
    assert_eq!(cut.status, StatusCode::OK, "{}", cut.json());
    assert_eq!(
        cut.json()["usage"]["completion_tokens"],
        json!(context - 2),
        "the budget is what the context leaves"
    );
    let prompt = vec!["w"; context as usize + 1].join(" ");
    let long_prompt = post(
        sim.addr,
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 1}),
    )
    .await?;
    assert_eq!(long_prompt.status, StatusCode::BAD_REQUEST);
    assert!(
        long_prompt.json()["error"]["message"]
            .as_str()
            .unwrap()
            .contains("maximum context length")
    );
    sim.shutdown().await;
    Ok(())
}

#[tokio::test]
async fn health_models_and_metrics() -> Result<()> {
    let sim = spawn(SimConfig {
        served_model_name: "llama".into(),
        ..fast_config()
    })
    .await?;
    post(
        sim.addr,
        "/v1/completions",
        &json!({"model": "llama", "prompt": "x", "max_tokens": 3}),
    )
    .await?;

    let health = get(sim.addr, "/health").await?;
    assert_eq!(health.status, StatusCode::OK);
    assert!(health.body.is_empty());
    assert_eq!(get(sim.addr, "/ping").await?.status, StatusCode::OK);

    let models = get(sim.addr, "/v1/models").await?.json();
    assert_eq!(models["object"], "list");
    assert_eq!(models["data"][0]["id"], "llama");

    let metrics = get(sim.addr, "/metrics").await?;
    assert!(
        metrics.headers["content-type"]
            .to_str()?
            .starts_with("text/plain")
    );
    let text = String::from_utf8(metrics.body.to_vec())?;
    for name in [
        "vllm:num_requests_running{model_name=\"llama\"} 0",
        "vllm:num_requests_waiting{model_name=\"llama\"} 0",
        "vllm:kv_cache_usage_perc{model_name=\"llama\"} 0",
        "vllm:prefix_cache_queries_total{model_name=\"llama\"} 1",
        "vllm:prefix_cache_hits_total{model_name=\"llama\"} 0",
        "vllm:prompt_tokens_total{model_name=\"llama\"} 1",
        "vllm:generation_tokens_total{model_name=\"llama\"} 3",
        "vllm:request_success_total{model_name=\"llama\",finished_reason=\"length\"} 1",
        "vllm:time_to_first_token_seconds_count{model_name=\"llama\"} 1",
        "vllm:inter_token_latency_seconds_count{model_name=\"llama\"} 2",
        "vllm:e2e_request_latency_seconds_count{model_name=\"llama\"} 1",
    ] {
        assert!(text.contains(name), "missing {name} in\n{text}");
    }

    let tokenized = post(sim.addr, "/tokenize", &json!({"prompt": "the cat sat"})).await?;
    assert_eq!(tokenized.json()["count"], 3);
    // A tokenize request as vLLM reads one: no generation checks or truncation, `messages`
    // that are no list ignored, both generation-prompt flags refused.
    for (body, status) in [
        (json!({"prompt": ""}), 200),
        (
            json!({"prompt": "the cat sat", "truncate_prompt_tokens": 1}),
            200,
        ),
        (json!({"prompt": "the cat sat", "messages": "hi"}), 200),
        (json!({"prompt": "x", "temperature": -1, "echo": "x"}), 200),
        (
            json!({"messages": [{"role": "user", "content": "hi"}], "continue_final_message": true}),
            400,
        ),
    ] {
        let reply = post(sim.addr, "/tokenize", &body).await?;
        assert_eq!(reply.status.as_u16(), status, "{body}: {}", reply.json());
    }
    let kept = post(
        sim.addr,
        "/tokenize",
        &json!({"prompt": "the cat sat", "truncate_prompt_tokens": 1}),
    )
    .await?;
    assert_eq!(kept.json()["count"], 3, "not truncated");
    sim.shutdown().await;
    Ok(())
}

#[tokio::test]
async fn records_headers_and_sets_faults_over_http() -> Result<()> {
    let sim = spawn(fast_config()).await?;
    post_with(
        sim.addr,
        "/v1/chat/completions",
        &[
            (
                "traceparent",
                "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            ),
            ("x-amzn-sagemaker-target-variant", "v1"),
            ("x-switchyard-route", "prefix"),
            ("authorization", "Bearer secret"),
        ],
        &json!({"model": "sim", "messages": [], "max_tokens": 1,
               "kv_transfer_params": {"do_remote_decode": false}}),
    )
    .await?;
    let received = sim.received();
    assert_eq!(received.len(), 1);
    let record = &received[0];
    assert_eq!(record.path, "/v1/chat/completions");
    assert_eq!(record.model.as_deref(), Some("sim"));
    assert!(record.kv_transfer_params);
    assert_eq!(
        record.header("traceparent"),
        Some("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")
    );
    assert_eq!(record.header("x-amzn-sagemaker-target-variant"), Some("v1"));
    assert_eq!(record.header("x-switchyard-route"), Some("prefix"));
    assert_eq!(record.header("authorization"), None);
    let over_http = get(sim.addr, "/sim/requests").await?.json();
    assert_eq!(over_http[0]["headers"]["x-switchyard-route"], "prefix");

    let set = post(sim.addr, "/sim/faults", &json!({"fail_rate": 1.0})).await?;
    assert_eq!(set.status, StatusCode::OK);
    assert!((sim.faults().fail_rate - 1.0).abs() < f64::EPSILON);
    let failed = post(sim.addr, "/v1/completions", &json!({"prompt": "x"})).await?;
    assert_eq!(failed.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(failed.json()["error"]["code"], 500);
    let bad = post(sim.addr, "/sim/faults", &json!({"fail_rate": 2.0})).await?;
    assert_eq!(bad.status, StatusCode::BAD_REQUEST);
    assert_eq!(sim.stats().requests_failed, 1);
    sim.shutdown().await;
    Ok(())
}

/// A prefill and a decode engine of [`fast_config`].
async fn prefill_and_decode() -> Result<(SimHandle, SimHandle)> {
    let role = |role| SimConfig {
        role,
        ..fast_config()
    };
    Ok((
        spawn(role(InstanceRole::Prefill)).await?,
        spawn(role(InstanceRole::Decode)).await?,
    ))
}

#[tokio::test]
async fn kv_transfer_params_round_trip() -> Result<()> {
    let (prefill, decode) = prefill_and_decode().await?;
    let messages = json!([{"role": "user", "content": words(1000)}]);

    // Hop 1: the proxy's prefill request.
    let reply = post_with(
        prefill.addr,
        "/v1/chat/completions",
        &[("x-request-id", "r1")],
        &json!({"model": "sim", "messages": messages, "max_tokens": 1, "stream": false,
               "kv_transfer_params": {"do_remote_decode": true, "do_remote_prefill": false,
                   "remote_engine_id": null, "remote_block_ids": null,
                   "remote_host": null, "remote_port": null}}),
    )
    .await?;
    assert_eq!(reply.status, StatusCode::OK);
    let body = reply.json();
    let prompt_tokens = body["usage"]["prompt_tokens"].as_u64().unwrap();
    assert_eq!(body["usage"]["completion_tokens"], 1);
    let params = body["kv_transfer_params"].clone();
    assert_eq!(params["do_remote_prefill"], true);
    assert_eq!(params["do_remote_decode"], false);
    assert_eq!(params["remote_engine_id"], prefill.engine_id());
    // vLLM's internal id: the API's id of the request, then 8 hex digits.
    let internal = params["remote_request_id"].as_str().unwrap();
    assert!(
        internal.starts_with("chatcmpl-r1-") && internal.len() == "chatcmpl-r1-".len() + 8,
        "{internal}"
    );
    // The side channel: vLLM's default host, a port of its own.
    assert_eq!(params["remote_host"], "localhost");
    let side = prefill.side_channel_addr().expect("a side channel");
    assert_eq!(params["remote_port"], side.port());
    assert_ne!(side.port(), prefill.addr.port());
    // One list of block ids per KV-cache group.
    let groups = params["remote_block_ids"].as_array().unwrap();
    assert_eq!(groups.len(), 1);
    assert_eq!(
        groups[0].as_array().unwrap().len() as u64,
        prompt_tokens.div_ceil(16)
    );
    assert_eq!(params["remote_num_tokens"].as_u64(), Some(prompt_tokens));
    for field in ["tp_size", "dcp_size", "pp_size"] {
        assert_eq!(params[field], 1, "{field}");
    }
    assert_eq!(params["transfer_mode"], "pull");
    assert_eq!(prefill.stats().kv_handoffs, 1);
    assert_eq!(prefill.stats().prefill_tokens_computed, prompt_tokens);

    // Hop 2: the original request plus the prefill's params, to the decoder (under another
    // request id: vLLM never compares the two).
    let response = open_post_with(
        decode.addr,
        "/v1/chat/completions",
        &[("x-request-id", "d1")],
        &json!({"model": "sim", "messages": messages, "max_tokens": 4, "stream": true,
               "stream_options": {"include_usage": true}, "kv_transfer_params": params}),
    )
    .await?;
    let events = read_events(&mut response.into_body()).await?;
    let usage_chunk: Value = serde_json::from_str(&events[events.len() - 2])?;
    let usage = &usage_chunk["usage"];
    assert_eq!(usage["prompt_tokens"].as_u64(), Some(prompt_tokens));
    assert_eq!(usage["completion_tokens"], 4);
    // Everything but the last prompt token came over the wire.
    assert_eq!(
        usage["prompt_tokens_details"]["cached_tokens"].as_u64(),
        Some(prompt_tokens - 1)
    );
    let stats = decode.stats();
    assert_eq!(stats.kv_transfer_tokens, prompt_tokens - 1);
    assert_eq!(stats.prefill_tokens_computed, 1);
    assert_eq!(stats.prefix_cache_hits, 0);
    assert!(decode.received()[0].do_remote_prefill);

    // A plain request to the decoder now hits the blocks it pulled.
    let plain = post(
        decode.addr,
        "/v1/chat/completions",
        &json!({"messages": messages, "max_tokens": 1}),
    )
    .await?
    .json();
    assert_eq!(
        plain["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64(),
        Some((prompt_tokens - 1) / 16 * 16)
    );
    prefill.shutdown().await;
    decode.shutdown().await;
    Ok(())
}

/// A decode engine refuses what vLLM 0.32 refuses: a hand-off pulled before, block ids not
/// grouped per KV-cache group, a side channel that is the HTTP port. Under
/// `kv_load_failure_policy` "fail" (the default) it answers vLLM's generation error; under
/// "recompute" it prefills the prompt itself.
#[tokio::test]
async fn a_failed_kv_pull_fails_the_request_as_vllm_does() -> Result<()> {
    let (prefill, decode) = prefill_and_decode().await?;
    let recompute = spawn(SimConfig {
        role: InstanceRole::Decode,
        kv_load_failure_policy: switchyard_engine_sim::KvLoadFailurePolicy::Recompute,
        ..fast_config()
    })
    .await?;
    let prompt = words(300);
    let handoff = || async {
        let reply = post(
            prefill.addr,
            "/v1/completions",
            &json!({"model": "sim", "prompt": prompt, "max_tokens": 1,
                   "kv_transfer_params": {"do_remote_decode": true}}),
        )
        .await?;
        anyhow::Ok(reply.json()["kv_transfer_params"].clone())
    };
    let decode_body = |params: &Value, stream: bool| {
        json!({"model": "sim", "prompt": prompt, "max_tokens": 3, "stream": stream,
               "kv_transfer_params": params})
    };
    let params = handoff().await?;
    let ok = post(decode.addr, "/v1/completions", &decode_body(&params, false)).await?;
    assert_eq!(ok.status, StatusCode::OK);
    assert_eq!(decode.received()[0].handoff.as_deref(), Some("accepted"));

    // Pulled already; flat block ids; the HTTP port named as the side channel.
    let mut flat = handoff().await?;
    flat["remote_block_ids"] = flat["remote_block_ids"][0].clone();
    let mut http_port = handoff().await?;
    http_port["remote_port"] = prefill.addr.port().into();
    for (what, bad) in [
        ("pulled", &params),
        ("flat", &flat),
        ("http port", &http_port),
    ] {
        let reply = post(decode.addr, "/v1/completions", &decode_body(bad, false)).await?;
        assert_eq!(reply.status, StatusCode::INTERNAL_SERVER_ERROR, "{what}");
        assert_eq!(
            reply.json(),
            json!({"error": {"message": "Internal server error",
                             "type": "InternalServerError", "param": null, "code": 500}}),
            "{what}"
        );
    }
    let verdicts: Vec<String> = decode
        .received()
        .iter()
        .skip(1)
        .map(|request| request.handoff.clone().unwrap_or_default())
        .collect();
    assert!(verdicts[0].contains("pulled already"), "{verdicts:?}");
    assert!(
        verdicts[1].contains("one list of block ids per KV-cache group"),
        "{verdicts:?}"
    );
    assert!(verdicts[2].starts_with("rejected"), "{verdicts:?}");
    assert_eq!(decode.stats().kv_pull_failures, 3);

    // A stream has begun: the role chunk (chat), the error event, [DONE].
    let chat = json!({"model": "sim", "messages": [{"role": "user", "content": prompt}],
                      "max_tokens": 3, "stream": true, "kv_transfer_params": params});
    let response = open_post(decode.addr, "/v1/chat/completions", &chat).await?;
    assert_eq!(response.status(), StatusCode::OK);
    let events = read_events(&mut response.into_body()).await?;
    assert_eq!(events.len(), 3, "{events:?}");
    let role: Value = serde_json::from_str(&events[0])?;
    assert_eq!(role["choices"][0]["delta"]["role"], "assistant");
    let error: Value = serde_json::from_str(&events[1])?;
    assert_eq!(error["error"]["code"], 500);
    assert_eq!(events[2], "[DONE]");

    // Under "recompute" the same refusal is prefilled here and answered.
    let reply = post(
        recompute.addr,
        "/v1/completions",
        &decode_body(&params, false),
    )
    .await?;
    assert_eq!(reply.status, StatusCode::OK);
    assert_eq!(reply.json()["usage"]["completion_tokens"], 3);
    assert_eq!(recompute.stats().kv_pull_failures, 1);

    // A hand-off not pulled within its lease (vLLM's kv_lease_duration) is freed: the pull
    // fails like any other.
    let lapsing = spawn(SimConfig {
        role: InstanceRole::Prefill,
        kv_lease_s: 1e-6,
        ..fast_config()
    })
    .await?;
    let lapsed = post(
        lapsing.addr,
        "/v1/completions",
        &json!({"model": "sim", "prompt": prompt, "max_tokens": 1,
               "kv_transfer_params": {"do_remote_decode": true}}),
    )
    .await?
    .json()["kv_transfer_params"]
        .clone();
    let reply = post(decode.addr, "/v1/completions", &decode_body(&lapsed, false)).await?;
    assert_eq!(reply.status, StatusCode::INTERNAL_SERVER_ERROR);
    let verdict = decode.received().last().unwrap().handoff.clone();
    assert!(
        verdict.as_deref().unwrap_or("").contains("lapsed"),
        "{verdict:?}"
    );
    for sim in [prefill, decode, recompute, lapsing] {
        sim.shutdown().await;
    }
    Ok(())
}

#[tokio::test]
async fn graceful_shutdown_finishes_an_in_flight_stream() -> Result<()> {
    // 400 decode steps of ~14 ms model time: ~56 ms on the wall at this scale.
    let sim = spawn(slow_config()).await?;
    let addr = sim.addr;
    let response = open_post(
        addr,
        "/v1/completions",
        &json!({"prompt": "go", "max_tokens": 400, "stream": true}),
    )
    .await?;
    let mut body = response.into_body();
    let first = read_first_event(&mut body).await?;
    let shutdown = tokio::spawn(sim.shutdown());
    let rest = read_text(&mut body).await?;
    let events = sse_payloads(&(first + &rest));
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    assert_eq!(events.len(), 401);
    tokio::time::timeout(WAIT, shutdown).await??;
    assert!(TcpStream::connect(addr).await.is_err());
    Ok(())
}

#[tokio::test]
async fn client_disconnect_frees_the_batch_slot() -> Result<()> {
    let sim = spawn(slow_config()).await?;
    // Streaming: read one chunk, then hang up.
    let body = endless_stream(sim.addr).await?;
    assert_eq!(sim.stats().running, 1);
    drop(body);
    wait_for_stats(&sim, |stats| {
        stats.running == 0 && stats.requests_aborted == 1
    })
    .await;

    // Non-streaming: the client gives up before the answer.
    let addr = sim.addr;
    let pending = tokio::spawn(async move {
        post(
            addr,
            "/v1/completions",
            &json!({"prompt": "go", "max_tokens": 100_000}),
        )
        .await
    });
    wait_for_stats(&sim, |stats| stats.running == 1).await;
    pending.abort();
    let stats = wait_for_stats(&sim, |stats| {
        stats.running == 0 && stats.requests_aborted == 2
    })
    .await;
    assert!((stats.kv_cache_usage - 0.0).abs() < f64::EPSILON);
    sim.shutdown().await;
    Ok(())
}

#[tokio::test]
async fn faults_hang_and_die_mid_stream() -> Result<()> {
    let sim = spawn(fast_config()).await?;
    sim.set_faults(Faults {
        die_mid_stream_rate: 1.0,
        ..Faults::default()
    });
    let response = open_post(
        sim.addr,
        "/v1/completions",
        &json!({"prompt": "go", "max_tokens": 50, "stream": true}),
    )
    .await?;
    let (text, cut) = read_until_broken(&mut response.into_body()).await?;
    assert!(cut, "the stream should break: {text}");
    assert_eq!(sse_payloads(&text).len(), 2);
    assert!(!text.contains("[DONE]"));
    assert!(
        post(sim.addr, "/v1/completions", &json!({"prompt": "go"}))
            .await
            .is_err()
    );

    sim.set_faults(Faults {
        hang_rate: 1.0,
        ..Faults::default()
    });
    let hung = tokio::time::timeout(
        Duration::from_millis(200),
        post(sim.addr, "/v1/completions", &json!({"prompt": "go"})),
    )
    .await;
    assert!(hung.is_err(), "a hung request must not be answered");
    assert_eq!(sim.stats().requests_hung, 1);

    sim.set_faults(Faults::default());
    let ok = post(sim.addr, "/v1/completions", &json!({"prompt": "go"})).await?;
    assert_eq!(ok.status, StatusCode::OK);
    sim.shutdown().await;
    Ok(())
}

#[tokio::test]
async fn kill_drops_connections_and_closes_the_port() -> Result<()> {
    let sim = spawn(slow_config()).await?;
    let addr = sim.addr;
    let mut body = endless_stream(addr).await?;
    sim.killed().await;
    let (_, broken) = read_until_broken(&mut body).await?;
    assert!(broken, "the stream must not end cleanly");
    assert!(TcpStream::connect(addr).await.is_err());
    Ok(())
}

#[tokio::test]
async fn responses_are_stored_and_a_follow_up_sees_the_stored_turns() -> Result<()> {
    let sim = spawn(fast_config()).await?;
    let first = post(
        sim.addr,
        "/v1/responses",
        &json!({"model": "sim", "input": words(40), "instructions": "be brief", "max_output_tokens": 5}),
    )
    .await?;
    assert_eq!(
        first.status,
        StatusCode::OK,
        "{}",
        String::from_utf8_lossy(&first.body)
    );
    let first = first.json();
    let id = first["id"].as_str().unwrap().to_owned();
    assert!(id.starts_with("resp_"), "{id}");
    assert_eq!(first["object"], "response");
    assert_eq!(
        first["status"], "incomplete",
        "stopped at max_output_tokens"
    );
    assert_eq!(first["output"][0]["type"], "message");
    assert_eq!(first["output"][0]["content"][0]["type"], "output_text");
    assert_eq!(first["usage"]["output_tokens"], 5);
    let first_input = first["usage"]["input_tokens"].as_u64().unwrap();
    assert!(first_input > 40, "{first_input}");

    // The follow-up's prompt starts with the stored turns: more input tokens than its own.
    let follow = post(
        sim.addr,
        "/v1/responses",
        &json!({"model": "sim", "input": "and then?", "previous_response_id": id}),
    )
    .await?
    .json();
    assert_eq!(follow["previous_response_id"], id.as_str());
    assert_eq!(follow["status"], "completed");
    let follow_input = follow["usage"]["input_tokens"].as_u64().unwrap();
    assert!(
        follow_input > first_input,
        "{follow_input} vs {first_input}"
    );
    assert!(
        follow["usage"]["input_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
            > 0,
        "the stored turns are in the prefix cache: {follow}"
    );

    let retrieved = get(sim.addr, &format!("/v1/responses/{id}")).await?;
    assert_eq!(retrieved.status, StatusCode::OK);
    assert_eq!(retrieved.json()["id"], id.as_str());
    let cancel = post(sim.addr, &format!("/v1/responses/{id}/cancel"), &json!({})).await?;
    assert_eq!(cancel.status, StatusCode::BAD_REQUEST);
    assert_eq!(sim.stored_responses(), 2);
    // vLLM has no DELETE here: FastAPI's 405, and the response stays.
    let deleted = send(
        sim.addr,
        Method::DELETE,
        &format!("/v1/responses/{id}"),
        &[],
        Vec::new(),
    )
    .await?;
    assert_eq!(deleted.status, StatusCode::METHOD_NOT_ALLOWED);
    assert_eq!(deleted.json(), json!({"detail": "Method Not Allowed"}));
    assert_eq!(sim.stored_responses(), 2);
    let gone = get(sim.addr, "/v1/responses/resp_unknown").await?;
    assert_eq!(gone.status, StatusCode::NOT_FOUND);
    assert_eq!(gone.json()["error"]["param"], "response_id");
    assert_eq!(gone.json()["error"]["type"], "invalid_request_error");
    let unknown = post(
        sim.addr,
        "/v1/responses",
        &json!({"input": "x", "previous_response_id": "resp_unknown"}),
    )
    .await?;
    assert_eq!(unknown.status, StatusCode::NOT_FOUND);
    assert_eq!(unknown.json()["error"]["param"], "response_id");
    // Any id is looked up (vLLM 0.32 checks no prefix).
    let other = get(sim.addr, "/v1/responses/abc").await?;
    assert_eq!(other.status, StatusCode::NOT_FOUND);
    // store: false keeps nothing.
    let unstored = post(
        sim.addr,
        "/v1/responses",
        &json!({"input": "x", "store": false}),
    )
    .await?
    .json();
    let missing = get(
        sim.addr,
        &format!("/v1/responses/{}", unstored["id"].as_str().unwrap()),
    )
    .await?;
    assert_eq!(missing.status, StatusCode::NOT_FOUND);
    sim.shutdown().await;
    Ok(())
}

#[tokio::test]
async fn streamed_responses_send_vllms_events_in_order() -> Result<()> {
    let sim = spawn(fast_config()).await?;
    let mut response = open_post(
        sim.addr,
        "/v1/responses",
        &json!({"input": "hi", "stream": true, "max_output_tokens": 3}),
    )
    .await?;
    assert!(
        response.headers()["content-type"]
            .to_str()?
            .starts_with("text/event-stream")
    );
    let text = read_text(response.body_mut()).await?;
    let events: Vec<Value> = text
        .lines()
        .filter_map(|line| line.strip_prefix("data: "))
        .map(|data| serde_json::from_str(data).unwrap())
        .collect();
    let kinds: Vec<&str> = events
        .iter()
        .map(|event| event["type"].as_str().unwrap())
        .collect();
    assert_eq!(
        kinds,
        [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added",
            "response.output_text.delta",
            "response.output_text.delta",
            "response.output_text.delta",
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            // vLLM's last event, for an incomplete response too.
            "response.completed",
        ]
    );
    for (index, event) in events.iter().enumerate() {
        assert_eq!(event["sequence_number"], index);
    }
    assert!(
        text.starts_with("event: response.created\ndata: "),
        "{text}"
    );
    let id = events[0]["response"]["id"].as_str().unwrap();
    assert_eq!(events.last().unwrap()["response"]["id"], id);
    assert_eq!(events.last().unwrap()["response"]["status"], "incomplete");
    assert_eq!(
        get(sim.addr, &format!("/v1/responses/{id}")).await?.status,
        StatusCode::OK
    );
    sim.shutdown().await;
    Ok(())
}

#[tokio::test]
async fn background_responses_run_on_and_can_be_cancelled() -> Result<()> {
    let sim = spawn(slow_config()).await?;
    let addr = sim.addr;
    let create = |max: u32| async move {
        post(
            addr,
            "/v1/responses",
            &json!({"input": "hi", "background": true, "max_output_tokens": max}),
        )
        .await
    };
    // Answered at once, queued; it runs on and is stored when done.
    let quick = create(3).await?.json();
    assert_eq!(quick["status"], "queued", "{quick}");
    assert_eq!(quick["background"], true);
    let id = quick["id"].as_str().unwrap().to_owned();
    let mut finished = Value::Null;
    for _ in 0..200 {
        finished = get(sim.addr, &format!("/v1/responses/{id}")).await?.json();
        if finished["status"] != "queued" {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(finished["status"], "incomplete", "{finished}");
    assert_eq!(finished["usage"]["output_tokens"], 3);
    // A finished response cannot be cancelled.
    let late = post(sim.addr, &format!("/v1/responses/{id}/cancel"), &json!({})).await?;
    assert_eq!(late.status, StatusCode::BAD_REQUEST);
    assert_eq!(late.json()["error"]["type"], "invalid_request_error");

    // A long one is cancelled while it runs, and stays cancelled.
    let long = create(2000).await?.json();
    let id = long["id"].as_str().unwrap().to_owned();
    let cancelled = post(sim.addr, &format!("/v1/responses/{id}/cancel"), &json!({})).await?;
    assert_eq!(cancelled.status, StatusCode::OK);
    assert_eq!(cancelled.json()["status"], "cancelled");
    assert_eq!(cancelled.json()["id"], id.as_str());
    let kept = get(sim.addr, &format!("/v1/responses/{id}")).await?.json();
    assert_eq!(kept["status"], "cancelled");
    assert_eq!(kept["max_output_tokens"], 2000);
    // Its engine work stops: the engine drops the request nobody reads.
    let mut aborted = 0;
    for _ in 0..200 {
        aborted = sim.stats().requests_aborted;
        if aborted >= 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(aborted, 1, "the cancelled response's work stops");

    // Streamed in the background: a client that leaves does not stop it.
    let mut streamed = open_post(
        sim.addr,
        "/v1/responses",
        &json!({"input": "hi", "background": true, "stream": true, "max_output_tokens": 20}),
    )
    .await?;
    let first = streamed
        .body_mut()
        .frame()
        .await
        .context("a first event")??;
    let first = String::from_utf8_lossy(first.data_ref().context("data")?).into_owned();
    let data = first
        .lines()
        .find_map(|line| line.strip_prefix("data: "))
        .context("a data line")?;
    let id = serde_json::from_str::<Value>(data)?["response"]["id"]
        .as_str()
        .context("an id")?
        .to_owned();
    drop(streamed);
    let mut left = Value::Null;
    for _ in 0..300 {
        left = get(sim.addr, &format!("/v1/responses/{id}")).await?.json();
        if left["status"] != "queued" {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(
        left["status"], "incomplete",
        "done without its client: {left}"
    );
    assert_eq!(left["usage"]["output_tokens"], 20);

    // Background needs the store.
    let unstored = post(
        sim.addr,
        "/v1/responses",
        &json!({"input": "hi", "background": true, "store": false}),
    )
    .await?;
    assert_eq!(unstored.status, StatusCode::BAD_REQUEST);
    assert_eq!(unstored.json()["error"]["param"], "background");
    sim.shutdown().await;
    Ok(())
}

#[tokio::test]
async fn responses_are_refused_where_vllm_refuses_them() -> Result<()> {
    let sim = spawn(SimConfig {
        max_model_len: 2048,
        ..fast_config()
    })
    .await?;
    let cases = [
        (json!({"max_output_tokens": 4}), "body.input"),
        (json!({"input": 5}), "body.input"),
        (
            json!({"input": [{"role": "robot", "content": "hi"}]}),
            "body.input",
        ),
        (
            json!({"input": "hi", "truncation": "bad"}),
            "body.truncation",
        ),
        (
            json!({"input": "hi", "include": ["nope"]}),
            "body.include.0",
        ),
        (json!({"input": "hi", "background": "x"}), "body.background"),
        (
            json!({"input": "hi", "tool_choice": "required"}),
            "tool_choice",
        ),
        (json!({"input": "hi", "prompt": {"id": "p"}}), "prompt"),
        (json!({"input": "hi", "temperature": -1}), "temperature"),
        (json!({"input": "hi", "top_p": 0}), "top_p"),
        (json!({"input": "hi", "max_output_tokens": 0}), "max_tokens"),
        (
            json!({"input": "hi", "max_output_tokens": 4000}),
            "max_output_tokens",
        ),
        (json!({"input": words(5000)}), "input_tokens"),
        (
            json!({"input": "hi", "presence_penalty": 3}),
            "body.presence_penalty",
        ),
    ];
    for (body, param) in cases {
        let reply = post(sim.addr, "/v1/responses", &body).await?;
        assert_eq!(reply.status, StatusCode::BAD_REQUEST, "{body}");
        assert_eq!(reply.json()["error"]["param"], param, "{body}");
    }
    let empty = post(sim.addr, "/v1/responses", &json!({"input": []})).await?;
    assert_eq!(empty.status, StatusCode::BAD_REQUEST);
    assert!(
        empty.json()["error"]["message"]
            .as_str()
            .unwrap()
            .contains("empty conversation")
    );
    // What vLLM serves: an empty string, unknown fields, a system message in the input, an
    // empty stop string (no stop string there).
    for body in [
        json!({"input": ""}),
        json!({"input": "hi", "stop": ""}),
        json!({"input": "hi", "frobnicate": 1}),
        json!({"input": [{"role": "system", "content": "x"}, {"role": "user", "content": "hi"}]}),
    ] {
        let reply = post(sim.addr, "/v1/responses", &body).await?;
        assert_eq!(reply.status, StatusCode::OK, "{body}");
    }
    // A tool call's follow-up: the call and its output are turns of the conversation.
    let tool_turns = post(
        sim.addr,
        "/v1/responses",
        &json!({"input": [
            {"role": "user", "content": "weather?"},
            {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_text", "text": "sunny"}]},
            {"type": "reasoning", "summary": []},
        ]}),
    )
    .await?;
    assert_eq!(tool_turns.status, StatusCode::OK, "{}", tool_turns.json());
    // The response echoes what was asked, and vLLM's budget.
    let echoed = post(
        sim.addr,
        "/v1/responses",
        &json!({"input": "hi", "user": "u1", "truncation": "auto", "presence_penalty": 0.5,
                "parallel_tool_calls": false, "store": null}),
    )
    .await?
    .json();
    assert_eq!(echoed["user"], "u1");
    assert_eq!(echoed["truncation"], "auto");
    assert_eq!(echoed["presence_penalty"], 0.5);
    assert_eq!(echoed["parallel_tool_calls"], false);
    assert!(
        echoed["max_output_tokens"].as_i64().unwrap() > 2000,
        "{echoed}"
    );
    let unstored = get(
        sim.addr,
        &format!("/v1/responses/{}", echoed["id"].as_str().unwrap()),
    )
    .await?;
    assert_eq!(
        unstored.status,
        StatusCode::NOT_FOUND,
        "store: null stores nothing"
    );
    let unknown = get(sim.addr, "/v1/responses/resp_x/input_items").await?;
    assert_eq!(unknown.status, StatusCode::NOT_FOUND);
    assert_eq!(unknown.json(), json!({"detail": "Not Found"}));
    sim.shutdown().await;
    Ok(())
}

#[tokio::test]
async fn invocations_try_a_chat_then_a_completion_as_vllm_does() -> Result<()> {
    let sim = spawn(fast_config()).await?;
    let hi = json!([{"role": "user", "content": "hi"}]);
    let cases = [
        // The chat model refuses a type: tried as a completion, which has no prompt.
        (
            json!({"messages": hi, "temperature": "x"}),
            400,
            Some("prompt"),
        ),
        // A range is the chat's own refusal, once it took the body.
        (
            json!({"messages": hi, "temperature": -1}),
            400,
            Some("temperature"),
        ),
        // Neither model takes it.
        (json!({"prompt": "hi", "temperature": "x"}), 400, None),
        (json!({"messages": hi, "prompt": "x", "n": "x"}), 400, None),
        // Raised while the chat model reads it: no completion is tried.
        (
            json!({"messages": hi, "continue_final_message": true, "add_generation_prompt": true}),
            400,
            None,
        ),
        // `messages` that are no chat's: a completion, which ignores them.
        (json!({"messages": "hi", "prompt": "hi"}), 200, None),
        // A field the chat model refuses by its type (pydantic's): the completion is tried.
        (
            json!({"messages": hi, "truncate_prompt_tokens": -5}),
            400,
            Some("prompt"),
        ),
        (json!({"messages": "hi"}), 400, Some("prompt")),
    ];
    for (body, status, param) in cases {
        let reply = post(sim.addr, "/invocations", &body).await?;
        assert_eq!(
            reply.status.as_u16(),
            status,
            "{body}: {}",
            String::from_utf8_lossy(&reply.body)
        );
        if status == 400 {
            assert_eq!(reply.json()["error"]["param"], json!(param), "{body}");
        }
    }
    let neither = post(
        sim.addr,
        "/invocations",
        &json!({"prompt": "hi", "temperature": "x"}),
    )
    .await?;
    assert!(
        neither.json()["error"]["message"]
            .as_str()
            .is_some_and(|message| message.contains("Cannot find suitable handler")),
        "{}",
        neither.json()
    );
    sim.shutdown().await;
    Ok(())
}

#[tokio::test]
async fn n_choices_are_answered_each_in_turn() -> Result<()> {
    let sim = spawn(fast_config()).await?;
    let whole = post(
        sim.addr,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "n": 3}),
    )
    .await?
    .json();
    let indexes: Vec<u64> = whole["choices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|choice| choice["index"].as_u64().unwrap())
        .collect();
    assert_eq!(indexes, [0, 1, 2], "{whole}");
    assert_eq!(
        whole["usage"]["completion_tokens"], 12,
        "every choice's tokens"
    );
    let mut response = open_post(
        sim.addr,
        "/v1/completions",
        &json!({"prompt": "hi", "max_tokens": 3, "n": 2, "stream": true,
                "stream_options": {"include_usage": true}}),
    )
    .await?;
    let text = read_text(response.body_mut()).await?;
    let chunks: Vec<Value> = text
        .lines()
        .filter_map(|line| line.strip_prefix("data: "))
        .filter(|data| *data != "[DONE]")
        .map(|data| serde_json::from_str(data).unwrap())
        .collect();
    for index in [0, 1] {
        let of_choice: Vec<&Value> = chunks
            .iter()
            .filter_map(|chunk| chunk["choices"].as_array()?.first())
            .filter(|choice| choice["index"] == index)
            .collect();
        assert_eq!(of_choice.len(), 3, "choice {index}: {text}");
        assert_eq!(of_choice[2]["finish_reason"], "length");
    }
    assert_eq!(chunks.last().unwrap()["usage"]["completion_tokens"], 6);
    // Continuous usage counts each choice's own tokens; the last chunk sums them.
    let mut response = open_post(
        sim.addr,
        "/v1/completions",
        &json!({"prompt": "hi", "max_tokens": 3, "n": 2, "stream": true,
                "stream_options": {"include_usage": true, "continuous_usage_stats": true}}),
    )
    .await?;
    let text = read_text(response.body_mut()).await?;
    let counts: Vec<u64> = text
        .lines()
        .filter_map(|line| line.strip_prefix("data: "))
        .filter(|data| *data != "[DONE]")
        .map(|data| serde_json::from_str::<Value>(data).unwrap())
        .map(|chunk| chunk["usage"]["completion_tokens"].as_u64().unwrap())
        .collect();
    assert_eq!(counts, [1, 1, 2, 2, 3, 3, 6], "{text}");
    sim.shutdown().await;
    Ok(())
}

#[tokio::test]
async fn pooling_apis_answer_in_vllms_shapes() -> Result<()> {
    let sim = spawn(fast_config()).await?;
    let embeddings = post(
        sim.addr,
        "/v1/embeddings",
        &json!({"model": "sim", "input": ["a b", "c"]}),
    )
    .await?
    .json();
    assert_eq!(embeddings["object"], "list");
    assert_eq!(embeddings["data"][1]["index"], 1);
    assert_eq!(embeddings["data"][0]["object"], "embedding");
    assert_eq!(
        embeddings["data"][0]["embedding"].as_array().unwrap().len(),
        64
    );
    assert_eq!(embeddings["usage"]["prompt_tokens"], 3);
    let base64 = post(
        sim.addr,
        "/v1/embeddings",
        &json!({"input": "a b", "encoding_format": "base64", "dimensions": 8}),
    )
    .await?
    .json();
    assert_eq!(
        base64["data"][0]["embedding"].as_str().unwrap().len(),
        44,
        "8 f32s in base64"
    );
    let bad = post(
        sim.addr,
        "/v1/embeddings",
        &json!({"input": "a", "dimensions": 1000}),
    )
    .await?;
    assert_eq!(bad.status, StatusCode::BAD_REQUEST);
    assert_eq!(bad.json()["error"]["param"], "dimensions");

    let pooling = post(sim.addr, "/pooling", &json!({"input": "a"}))
        .await?
        .json();
    assert_eq!(pooling["data"][0]["object"], "pooling");
    let classify = post(sim.addr, "/classify", &json!({"input": ["a", "b"]}))
        .await?
        .json();
    assert_eq!(classify["data"][1]["num_classes"], 2);
    for path in ["/score", "/v1/score"] {
        let score = post(
            sim.addr,
            path,
            &json!({"text_1": "q", "text_2": ["d1", "d2"]}),
        )
        .await?
        .json();
        assert_eq!(score["data"].as_array().unwrap().len(), 2, "{score}");
        assert_eq!(score["data"][0]["object"], "score");
    }
    for path in ["/rerank", "/v1/rerank", "/v2/rerank"] {
        let rerank = post(
            sim.addr,
            path,
            &json!({"query": "q", "documents": ["d1", "d2", "d3"], "top_n": 2}),
        )
        .await?
        .json();
        let results = rerank["results"].as_array().unwrap();
        assert_eq!(results.len(), 2, "{rerank}");
        assert!(results[0]["relevance_score"].as_f64() >= results[1]["relevance_score"].as_f64());
        let index = results[0]["index"].as_u64().unwrap() as usize;
        assert_eq!(results[0]["document"]["text"], format!("d{}", index + 1));
    }
    let generated = post(
        sim.addr,
        "/v1/completions",
        &json!({"prompt": "x", "max_tokens": 2}),
    )
    .await?
    .json();
    let text = generated["choices"][0]["text"].as_str().unwrap();
    let tokens = post(sim.addr, "/tokenize", &json!({"prompt": text}))
        .await?
        .json();
    let back = post(
        sim.addr,
        "/detokenize",
        &json!({"tokens": tokens["tokens"]}),
    )
    .await?
    .json();
    assert_eq!(
        back["prompt"], text,
        "the simulator's output words detokenize"
    );
    let wrong = post(
        sim.addr,
        "/rerank",
        &json!({"model": "other", "query": "q", "documents": ["d"]}),
    )
    .await?;
    assert_eq!(wrong.status, StatusCode::NOT_FOUND);
    assert_eq!(sim.stats().requests_received, 13);
    sim.shutdown().await;
    Ok(())
}

#[tokio::test]
async fn a_data_parallel_rank_outside_the_servers_is_refused_as_vllm_does() -> Result<()> {
    let sim = spawn(SimConfig {
        data_parallel_size: 2,
        ..fast_config()
    })
    .await?;
    let body = json!({"model": "sim", "prompt": "hello", "max_tokens": 2});
    let path = "/v1/completions";
    for (rank, status) in [
        ("0", StatusCode::OK),
        ("1", StatusCode::OK),
        // Not an integer: vLLM ignores it and its balancer picks.
        ("one", StatusCode::OK),
        ("2", StatusCode::BAD_REQUEST),
        ("-1", StatusCode::BAD_REQUEST),
    ] {
        let reply = post_with(sim.addr, path, &[("x-data-parallel-rank", rank)], &body).await?;
        assert_eq!(reply.status, status, "rank {rank}");
        if status == StatusCode::BAD_REQUEST {
            assert_eq!(
                reply.json()["error"]["message"],
                format!("data_parallel_rank {rank} is out of range [0, 2).")
            );
        }
    }
    let recorded = sim.received();
    assert_eq!(
        recorded[0]
            .headers
            .get("x-data-parallel-rank")
            .map(String::as_str),
        Some("0")
    );
    // One rank (the default): only rank 0.
    let single = spawn(fast_config()).await?;
    let refused = post_with(single.addr, path, &[("x-data-parallel-rank", "1")], &body).await?;
    assert_eq!(refused.status, StatusCode::BAD_REQUEST);
    Ok(())
}

#[tokio::test]
async fn a_chats_reasoning_effort_and_documents_are_checked_as_vllm_checks_them() -> Result<()> {
    let sim = spawn(fast_config()).await?;
    let chat = |extra: Value| {
        let mut body = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2});
        for (name, value) in extra.as_object().unwrap() {
            body[name] = value.clone();
        }
        body
    };
    for good in [
        json!({"reasoning_effort": "low", "documents": [{"title": "t", "text": "x"}]}),
        json!({"reasoning_effort": null, "documents": null}),
        json!({"documents": []}),
    ] {
        let reply = post(sim.addr, "/v1/chat/completions", &chat(good.clone())).await?;
        assert_eq!(reply.status, StatusCode::OK, "{good}");
    }
    for (bad, param) in [
        (json!({"reasoning_effort": "bogus"}), "reasoning_effort"),
        (json!({"reasoning_effort": 1}), "reasoning_effort"),
        (json!({"documents": [{"text": 5}]}), "documents"),
        (json!({"documents": {"text": "x"}}), "documents"),
    ] {
        let reply = post(sim.addr, "/v1/chat/completions", &chat(bad.clone())).await?;
        assert_eq!(reply.status, StatusCode::BAD_REQUEST, "{bad}");
        assert_eq!(reply.json()["error"]["param"], param, "{bad}");
    }
    // A completion has no such fields: vLLM passes them over.
    let reply = post(
        sim.addr,
        "/v1/completions",
        &json!({"prompt": "hi", "max_tokens": 2, "reasoning_effort": "bogus"}),
    )
    .await?;
    assert_eq!(reply.status, StatusCode::OK);
    sim.shutdown().await;
    Ok(())
}

/// Generation fields vLLM 0.32 refuses are refused with its status, `param` and message, at
/// the point where it refuses them (the request model's checks before the model name is
/// looked up, the sampling parameters' after); what it takes (a number in a string, `"true"`
/// for `stream`) is taken. Each answer here is the one the real vLLM gave on this machine
/// (tests/tests/real_vllm.rs compares the two).
#[tokio::test]
async fn generation_fields_are_refused_where_vllm_refuses_them() -> Result<()> {
    let sim = spawn(fast_config()).await?;
    let chat = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3});
    let completion = json!({"prompt": "hello there", "max_tokens": 3});
    let with = |base: &Value, fields: Value| {
        let mut body = base.clone();
        for (key, value) in fields.as_object().into_iter().flatten() {
            body[key] = value.clone();
        }
        body
    };
    let refused = [
        (
            &chat,
            json!({"n": 0}),
            Value::Null,
            "n must be at least 1, got 0.",
        ),
        (
            &chat,
            json!({"temperature": -1}),
            json!("temperature"),
            "temperature must be non-negative, got -1.0. (parameter=temperature, value=-1.0)",
        ),
        (
            &chat,
            json!({"top_p": 1.5}),
            json!("top_p"),
            "top_p must be in (0, 1], got 1.5. (parameter=top_p, value=1.5)",
        ),
        (
            &chat,
            json!({"min_tokens": 10}),
            Value::Null,
            "min_tokens must be less than or equal to max_tokens=3, got 10.",
        ),
        (
            &chat,
            json!({"stream_options": {"include_usage": true}}),
            json!("stream_options"),
            "Stream options can only be defined when `stream=True`. (parameter=stream_options)",
        ),
        (
            &chat,
            json!({"top_logprobs": 3}),
            json!("top_logprobs"),
            "when using `top_logprobs`, `logprobs` must be set to true. \
             (parameter=top_logprobs)",
        ),
        (
            &chat,
            json!({"tool_choice": "auto"}),
            json!("tool_choice"),
            "When using `tool_choice`, `tools` must be set. (parameter=tool_choice)",
        ),
        (
            &chat,
            json!({"logit_bias": {"x": 1}}),
            json!("logit_bias"),
            "logit_bias contains key(s) that cannot be converted to integer token IDs: ['x'] \
             (parameter=logit_bias, value=['x'])",
        ),
        (
            &chat,
            json!({"messages": []}),
            Value::Null,
            "Cannot apply chat template to an empty conversation. Provide at least one message.",
        ),
        (
            &chat,
            json!({"max_tokens": 0}),
            json!("max_tokens"),
            "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)",
        ),
        (
            &completion,
            json!({"prompt": ""}),
            json!("prompt"),
            "Either prompt or prompt_embeds must be provided and non-empty. (parameter=prompt)",
        ),
        (
            &completion,
            json!({"prompt": []}),
            Value::Null,
            "You must pass at least one prompt",
        ),
        (
            &completion,
            json!({"logprobs": 30}),
            json!("logprobs"),
            "Requested sample logprobs of 30, which is greater than max allowed: 20 \
             (parameter=logprobs, value=30)",
        ),
        (
            &completion,
            json!({"suffix": "x"}),
            json!("suffix"),
            "suffix is only supported for models with FIM completion rendering",
        ),
        (
            &completion,
            json!({"stop": [""]}),
            Value::Null,
            "stop cannot contain an empty string.",
        ),
    ];
    for (base, fields, param, message) in refused {
        let path = if base.get("messages").is_some() {
            "/v1/chat/completions"
        } else {
            "/v1/completions"
        };
        let reply = post(sim.addr, path, &with(base, fields.clone())).await?;
        assert_eq!(reply.status, StatusCode::BAD_REQUEST, "{fields}");
        let error = &reply.json()["error"];
        assert_eq!(
            (&error["param"], error["message"].as_str()),
            (&param, Some(message))
        );
    }
    // A field of the wrong type is the request model's refusal, named `body.FIELD`.
    for (fields, param) in [
        (json!({"temperature": "x"}), "body.temperature"),
        (json!({"stop": 5}), "body.stop"),
        (json!({"stop": ["a", "b", "c", "d", "e"]}), "body.stop"),
        (json!({"user": 5}), "body.user"),
        (json!({"max_tokens": 1.5}), "body.max_tokens"),
        (
            json!({"response_format": {"type": "bogus"}}),
            "body.response_format.type",
        ),
    ] {
        let reply = post(
            sim.addr,
            "/v1/chat/completions",
            &with(&chat, fields.clone()),
        )
        .await?;
        assert_eq!(reply.status, StatusCode::BAD_REQUEST, "{fields}");
        assert_eq!(reply.json()["error"]["param"], param, "{fields}");
    }
    // Before the model is looked up (a type), or after (a range).
    let other = |fields: Value| with(&chat, with(&json!({"model": "other"}), fields));
    let early = post(
        sim.addr,
        "/v1/chat/completions",
        &other(json!({"temperature": "x"})),
    )
    .await?;
    assert_eq!(early.status, StatusCode::BAD_REQUEST);
    let late = post(
        sim.addr,
        "/v1/chat/completions",
        &other(json!({"temperature": -1})),
    )
    .await?;
    assert_eq!(late.status, StatusCode::NOT_FOUND);
    // Taken as vLLM takes them.
    for fields in [
        json!({"temperature": "0.5", "max_tokens": "2", "top_k": -1, "min_tokens": 2}),
        json!({"stream_options": {}, "tool_choice": "none", "logit_bias": {" 5 ": 1}}),
        json!({"messages": [{"role": "user"}]}),
        json!({"logprobs": true, "top_logprobs": 20}),
    ] {
        let reply = post(
            sim.addr,
            "/v1/chat/completions",
            &with(&chat, fields.clone()),
        )
        .await?;
        assert_eq!(reply.status, StatusCode::OK, "{fields}: {}", reply.json());
    }
    // `min_tokens` is held against vLLM's budget: a chat without `max_tokens` has the whole
    // context (the simulator generates its default 16, or the minimum if more); a prefill's
    // one token does not count.
    let without_budget = json!({"messages": [{"role": "user", "content": "hi"}], "min_tokens": 20});
    let reply = post(sim.addr, "/v1/chat/completions", &without_budget).await?;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.json());
    assert_eq!(
        reply.json()["usage"]["completion_tokens"],
        20,
        "never fewer than the minimum"
    );
    // A minimum past the context is refused against the context left, as vLLM refuses it.
    let past = json!({"messages": [{"role": "user", "content": "hi"}], "min_tokens": 200_000});
    let reply = post(sim.addr, "/v1/chat/completions", &past).await?;
    assert_eq!(reply.status, StatusCode::BAD_REQUEST);
    let message = reply.json()["error"]["message"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(
        message.starts_with("min_tokens must be less than or equal to max_tokens="),
        "{message}"
    );
    let prefill = with(
        &completion,
        json!({"max_tokens": 5, "min_tokens": 3, "kv_transfer_params": {"do_remote_decode": true}}),
    );
    let reply = post(sim.addr, "/v1/completions", &prefill).await?;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.json());
    let streamed = open_post(
        sim.addr,
        "/v1/chat/completions",
        &with(&chat, json!({"stream": "true"})),
    )
    .await?;
    let events = read_events(&mut streamed.into_body()).await?;
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    sim.shutdown().await;
    Ok(())
}

/// `echo` as vLLM 0.32 answers it: a completion's prompt before its answer (in the first
/// chunk, with the prompt's ids, when streamed), the prompt alone for `max_tokens: 0`; a
/// chat's final assistant message before the answer (a chunk of its own after the role chunk).
#[tokio::test]
async fn echo_puts_the_prompt_before_the_answer() -> Result<()> {
    let sim = spawn(fast_config()).await?;
    let prompt = "the cat sat";
    let plain = post(
        sim.addr,
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 2}),
    )
    .await?;
    let answer = plain.json()["choices"][0]["text"]
        .as_str()
        .unwrap()
        .to_owned();
    let echoed = post(
        sim.addr,
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 2, "echo": true}),
    )
    .await?;
    assert_eq!(
        echoed.json()["choices"][0]["text"],
        format!("{prompt}{answer}")
    );
    let alone = post(
        sim.addr,
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 0, "echo": true}),
    )
    .await?;
    let alone = alone.json();
    assert_eq!(alone["choices"][0]["text"], prompt);
    assert_eq!(alone["usage"]["completion_tokens"], 1);
    let streamed = open_post(
        sim.addr,
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 2, "echo": true, "stream": true}),
    )
    .await?;
    let events = read_events(&mut streamed.into_body()).await?;
    let first: Value = serde_json::from_str(&events[0])?;
    assert!(
        first["choices"][0]["text"]
            .as_str()
            .unwrap()
            .starts_with(prompt)
    );
    assert!(
        first["choices"][0]["prompt_token_ids"].is_array(),
        "{first}"
    );
    let messages = json!([{"role": "user", "content": "hi"},
                          {"role": "assistant", "content": "Well"}]);
    let chat = json!({"messages": messages, "max_tokens": 2, "echo": true,
                      "continue_final_message": true, "add_generation_prompt": false});
    let whole = post(sim.addr, "/v1/chat/completions", &chat).await?;
    let content = whole.json()["choices"][0]["message"]["content"].clone();
    assert!(content.as_str().unwrap().starts_with("Well"), "{content}");
    let mut stream = chat.clone();
    stream["stream"] = json!(true);
    let streamed = open_post(sim.addr, "/v1/chat/completions", &stream).await?;
    let events = read_events(&mut streamed.into_body()).await?;
    let second: Value = serde_json::from_str(&events[1])?;
    assert_eq!(second["choices"][0]["delta"]["content"], "Well");
    // Without the generation prompt vLLM answers in the last message's role: that message,
    // a user's here, is echoed.
    let user_last = json!({"messages": [{"role": "user", "content": "Why"}], "max_tokens": 2,
                           "echo": true, "add_generation_prompt": false});
    let answer = post(sim.addr, "/v1/chat/completions", &user_last)
        .await?
        .json();
    let content = answer["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(content.starts_with("Why"), "{content}");
    assert_eq!(answer["choices"][0]["message"]["role"], "user");
    let mut streamed_user = user_last.clone();
    streamed_user["stream"] = json!(true);
    let streamed = open_post(sim.addr, "/v1/chat/completions", &streamed_user).await?;
    let events = read_events(&mut streamed.into_body()).await?;
    let first: Value = serde_json::from_str(&events[0])?;
    assert_eq!(first["choices"][0]["delta"]["role"], "user");
    // Echo asks for the prompt's logprobs, so vLLM reads nothing from the prefix cache: the
    // same long prompt twice is cached the second time, but not for an echo.
    let long = "lorem ipsum dolor sit amet ".repeat(40);
    let ask = |echo: bool| json!({"prompt": long, "max_tokens": 1, "echo": echo});
    let cached = |answer: &Value| answer["usage"]["prompt_tokens_details"]["cached_tokens"].clone();
    post(sim.addr, "/v1/completions", &ask(false)).await?;
    let again = post(sim.addr, "/v1/completions", &ask(false)).await?.json();
    assert_ne!(cached(&again), json!(0), "{again}");
    let mut logprobs = ask(true);
    logprobs["logprobs"] = json!(1);
    let echoed = post(sim.addr, "/v1/completions", &logprobs).await?.json();
    assert_eq!(cached(&echoed), json!(0), "{echoed}");
    let mut prompt_logprobs = ask(false);
    prompt_logprobs["prompt_logprobs"] = json!(0);
    let skipped = post(sim.addr, "/v1/completions", &prompt_logprobs)
        .await?
        .json();
    assert_eq!(cached(&skipped), json!(0), "{skipped}");
    sim.shutdown().await;
    Ok(())
}
