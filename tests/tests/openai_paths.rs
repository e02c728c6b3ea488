//! vLLM's other OpenAI-compatible paths through routers: the Responses API and its stored
//! state with the real `openai` Python client (`tests/python/openai_responses.py`),
//! embeddings, rerank, tokenize and the rest with plain HTTP, PREFIX_AWARE on embeddings,
//! OpenAI-shaped errors, and what a client sees when the instance holding a response leaves,
//! dies, or fails mid-stream.

use std::time::Duration;

use http::Method;
use switchyard_proto::v1 as pb;
use switchyard_router::{RouterConfig, RouterHandle};
use switchyard_tests::*;

/// Runs `tests/python/openai_responses.py` with `args`; its stdout, once it printed "all ok".
async fn python_client(args: &[&str]) -> anyhow::Result<String> {
    let script =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("python/openai_responses.py");
    let output = bounded_for(
        Duration::from_secs(60),
        "the openai client",
        tokio::process::Command::new(test_python())
            .arg(&script)
            .args(args)
            .kill_on_drop(true)
            .output(),
    )
    .await?;
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success() && stdout.contains("all ok"),
        "openai client failed ({}):\n{stdout}\n{stderr}",
        output.status
    );
    Ok(stdout)
}

/// The value of a `NAME value` line the script printed.
fn printed<'a>(stdout: &'a str, name: &str) -> &'a str {
    stdout
        .lines()
        .find_map(|line| line.strip_prefix(name)?.strip_prefix(' '))
        .unwrap_or_else(|| panic!("the script printed no {name}: {stdout}"))
}

#[tokio::test]
async fn the_openai_client_follows_stored_responses_across_routers() -> anyhow::Result<()> {
    // RANDOM over three instances: only affinity brings a follow-up to its response.
    let cluster = Cluster::start(3, 2, &variant_json("RANDOM", None), fast()).await?;
    let base = |index: usize| format!("{}/v1", cluster.routers()[index].url());
    let stdout = python_client(&["flow", &base(0), &base(1)]).await?;
    let holder = printed(&stdout, "holder").to_owned();
    let kept = printed(&stdout, "kept").to_owned();
    // The follow-ups reached the holder only, every one of them recorded there.
    let holder_engine = &cluster.engines()[Cluster::engine_index(&holder)];
    let follow_ups = holder_engine
        .received()
        .iter()
        .filter(|request| request.path == "/v1/responses")
        .count();
    assert!(
        follow_ups >= 5,
        "{follow_ups} responses requests on {holder}"
    );
    cluster.wait_idle().await?;

    // The holder leaves: its responses are not found, and no other instance is asked.
    let mut admin = admin(cluster.control_plane_url()).await?;
    admin
        .deregister_instance(pb::DeregisterInstanceRequest {
            endpoint_name: "chat".into(),
            id: holder.clone(),
        })
        .await?;
    cluster.wait_for_instances(2).await?;
    let others_before: usize = cluster
        .engines()
        .iter()
        .map(|engine| engine.received().len())
        .sum();
    python_client(&["gone", &base(1), &kept]).await?;
    let others_after: usize = cluster
        .engines()
        .iter()
        .map(|engine| engine.received().len())
        .sum();
    assert_eq!(others_before, others_after, "no engine was asked");
    // The same with plain HTTP, on the path form too: OpenAI's shape, the instance named.
    let reply = http_request(
        Method::GET,
        &format!(
            "{}/endpoints/chat/openai/v1/responses/{kept}",
            cluster.routers()[0].url()
        ),
        &[],
        "",
    )
    .await?;
    assert_eq!(reply.status, 404, "{}", reply.body);
    let error = &reply.json()["error"];
    assert_eq!(error["code"], "response_not_found", "{}", reply.body);
    assert_eq!(error["type"], "invalid_request_error");
    assert_eq!(error["param"], "response_id");
    assert!(
        error["message"].as_str().unwrap().contains(&holder),
        "{}",
        reply.body
    );
    cluster.wait_idle().await?;
    Ok(())
}

#[tokio::test]
async fn the_other_paths_route_plain_and_under_endpoints_with_openai_errors() -> anyhow::Result<()>
{
    let cluster = Cluster::start(2, 1, &variant_json("RANDOM", None), fast()).await?;
    let router = cluster.routers()[0].url();
    let paths_seen = || {
        let mut seen: Vec<String> = cluster
            .engines()
            .iter()
            .flat_map(|engine| engine.received())
            .map(|request| request.path)
            .collect();
        seen.sort();
        seen
    };

    // rerank and tokenize with plain HTTP: vLLM's shapes, the model rewritten for the engine.
    let rerank = http_post(
        &format!("{router}/v1/rerank"),
        &[],
        r#"{"model":"chat","query":"where is my order","documents":["it shipped","a poem","refunds"],"top_n":2}"#,
    )
    .await?;
    assert_eq!(rerank.status, 200, "{}", rerank.body);
    assert_eq!(rerank.json()["results"].as_array().map(Vec::len), Some(2));
    assert_eq!(rerank.json()["model"], "sim");
    assert!(rerank.header("x-switchyard-instance").is_some());
    let tokenize = http_post(
        &format!("{router}/tokenize"),
        &[],
        r#"{"model":"chat","prompt":"the cat sat"}"#,
    )
    .await?;
    assert_eq!(tokenize.status, 200, "{}", tokenize.body);
    assert_eq!(tokenize.json()["count"], 3);

    // Every other path, plain and under /endpoints/chat/openai, reaches an engine at vLLM's path.
    let cases = [
        ("/v1/embeddings", r#"{"model":"chat","input":"x"}"#),
        ("/pooling", r#"{"model":"chat","input":"x"}"#),
        ("/classify", r#"{"model":"chat","input":"x"}"#),
        ("/score", r#"{"model":"chat","text_1":"a","text_2":"b"}"#),
        (
            "/v1/score",
            r#"{"model":"chat","queries":"a","documents":["b"]}"#,
        ),
        (
            "/rerank",
            r#"{"model":"chat","query":"a","documents":["b"]}"#,
        ),
        (
            "/v2/rerank",
            r#"{"model":"chat","query":"a","documents":["b"]}"#,
        ),
        ("/detokenize", r#"{"model":"chat","tokens":[1,2]}"#),
        (
            "/v1/responses",
            r#"{"model":"chat","input":"hi","store":false}"#,
        ),
    ];
    for (path, body) in cases {
        for url in [
            format!("{router}{path}"),
            format!("{router}/endpoints/chat/openai{path}"),
        ] {
            let reply = http_post(&url, &[], body).await?;
            assert_eq!(reply.status, 200, "{url}: {}", reply.body);
            // Answers without response ids pass as the engine framed them (the Responses
            // answer is rewritten as it passes).
            if path != "/v1/responses" {
                let length = reply.header("content-length").map(str::to_owned);
                assert_eq!(length, Some(reply.body.len().to_string()), "{url}");
            }
        }
    }
    let seen = paths_seen();
    for (path, _) in cases {
        assert_eq!(
            seen.iter().filter(|seen| *seen == path).count(),
            2,
            "{path} in {seen:?}"
        );
    }

    // OpenAI-shaped errors on every OpenAI path; SageMaker's on the native ones: (method,
    // path, JSON body or none, status if checked, JSON pointer, its value; `None`: any text).
    let json = Some("{}");
    let errors = [
        (
            Method::POST,
            "/v1/foo",
            json,
            Some(404),
            "/error/code",
            Some("unknown_url"),
        ),
        (
            Method::GET,
            "/endpoints/chat/openai/v1/foo",
            None,
            None,
            "/error/type",
            Some("invalid_request_error"),
        ),
        (
            Method::POST,
            "/v1/models",
            None,
            Some(405),
            "/error/code",
            Some("method_not_allowed"),
        ),
        (
            Method::GET,
            "/v1/embeddings",
            None,
            Some(405),
            "/error/code",
            Some("method_not_allowed"),
        ),
        (
            Method::PUT,
            "/v1/responses/resp_x",
            None,
            Some(405),
            "/error/code",
            Some("method_not_allowed"),
        ),
        (
            Method::GET,
            "/endpoints/chat/openai/v1/chat/completions",
            None,
            Some(405),
            "/error/code",
            Some("method_not_allowed"),
        ),
        (
            Method::GET,
            "/endpoints/chat/invocations",
            None,
            Some(405),
            "/ErrorCode",
            None,
        ),
        (
            Method::POST,
            "/endpoints/chat/foo",
            json,
            Some(404),
            "/ErrorCode",
            None,
        ),
    ];
    for (method, path, body, status, pointer, value) in errors {
        let url = format!("{router}{path}");
        let reply = match body {
            Some(body) => http_post(&url, &[], body).await?,
            None => http_request(method.clone(), &url, &[], "").await?,
        };
        if let Some(status) = status {
            assert_eq!(reply.status, status, "{method} {path}: {}", reply.body);
        }
        let found = reply.json().pointer(pointer).cloned().unwrap_or_default();
        match value {
            Some(value) => assert_eq!(found, value, "{method} {path}: {}", reply.body),
            None => assert!(found.is_string(), "{method} {path}: {}", reply.body),
        }
    }
    // A plain path needs the model; /tokenize too.
    let no_model = http_post(&format!("{router}/tokenize"), &[], r#"{"prompt":"x"}"#).await?;
    assert_eq!(no_model.status, 400);
    assert_eq!(no_model.json()["error"]["param"], "model");
    cluster.wait_idle().await?;
    Ok(())
}

#[tokio::test]
async fn prefix_aware_keeps_a_shared_prefix_on_one_instance_on_every_path() -> anyhow::Result<()> {
    // Each path's own text rule: a shared document and different questions stay together,
    // and different documents spread (a path read with another path's rule would find no
    // text, and send every document to one instance).
    let cluster = Cluster::start(
        4,
        2,
        &variant_json("PREFIX_AWARE", Some((1024, 100))),
        fast(),
    )
    .await?;
    type Body = fn(&str, &str, usize, usize) -> serde_json::Value;
    let paths: [(&str, Body); 5] = [
        (
            "/v1/embeddings",
            |shared, suffix, _, _| serde_json::json!({"model": "chat", "input": [format!("{shared} {suffix}")]}),
        ),
        (
            "/v1/responses",
            |shared, suffix, _, _| serde_json::json!({"model": "chat", "input": format!("{shared} {suffix}"), "max_output_tokens": 2}),
        ),
        (
            "/v1/score",
            |shared, suffix, _, _| serde_json::json!({"model": "chat", "text_1": shared, "text_2": suffix}),
        ),
        (
            "/rerank",
            |shared, suffix, _, _| serde_json::json!({"model": "chat", "query": shared, "documents": [suffix]}),
        ),
        ("/detokenize", |_, _, document, question| {
            let mut tokens: Vec<usize> = (0..600).map(|i| 1000 + document * 700 + i).collect();
            tokens.extend([question + 1; 3]);
            serde_json::json!({"model": "chat", "tokens": tokens})
        }),
    ];
    for (path, body) in paths {
        let mut owners = std::collections::HashSet::new();
        for document in 0..6 {
            let shared = prompt(&format!("document-{document}"), 2000);
            let mut chosen = std::collections::HashSet::new();
            for (question, (suffix, router)) in
                ["a question", "another, longer question", "a third"]
                    .iter()
                    .zip(cluster.routers().iter().cycle())
                    .enumerate()
            {
                let body = body(&shared, suffix, document, question).to_string();
                let reply = http_post(&format!("{}{path}", router.url()), &[], body).await?;
                assert_eq!(reply.status, 200, "{path}: {}", reply.body);
                assert_eq!(reply.header("x-switchyard-route"), Some("prefix"), "{path}");
                chosen.insert(reply.header("x-switchyard-instance").unwrap().to_owned());
            }
            assert_eq!(
                chosen.len(),
                1,
                "{path}: document {document} spread over {chosen:?}"
            );
            owners.extend(chosen);
        }
        assert!(owners.len() >= 2, "{path}: six prefixes all on {owners:?}");
    }
    cluster.wait_idle().await?;
    Ok(())
}

/// A router for endpoint `chat` (RANDOM) over `instances` (id, url), from a static file.
async fn static_router(
    dir: &tempfile::TempDir,
    instances: &[(&str, &str)],
    tune: impl FnOnce(&mut RouterConfig),
) -> anyhow::Result<RouterHandle> {
    let mut yaml = String::from(
        "Endpoints:\n  - EndpointName: chat\n    ProductionVariants:\n      - VariantName: AllTraffic\n        ModelName: sim\n    Instances:\n",
    );
    for (id, url) in instances {
        yaml.push_str(&format!("      - {{Url: \"{url}\", InstanceId: {id}}}\n"));
    }
    router_from_file(&dir.path().join("routes.yaml"), &yaml, tune).await
}

/// Whether `engine` was sent no Responses API request.
fn no_follow_up(engine: &switchyard_engine_sim::SimHandle) -> bool {
    engine
        .received()
        .iter()
        .all(|request| request.path != "/v1/responses")
}

/// A stored response made through `router`: (wrapped id, instance).
async fn stored_response(router: &RouterHandle) -> anyhow::Result<(String, String)> {
    let reply = http_post(
        &format!("{}/v1/responses", router.url()),
        &[],
        r#"{"model":"chat","input":"remember this","max_output_tokens":2}"#,
    )
    .await?;
    assert_eq!(reply.status, 200, "{}", reply.body);
    let id = reply.json()["id"].as_str().unwrap().to_owned();
    assert!(id.starts_with("resp_sy1"), "{id}");
    Ok((
        id,
        reply.header("x-switchyard-instance").unwrap().to_owned(),
    ))
}

#[tokio::test]
async fn a_dead_holder_is_unreachable_not_replaced_and_a_broken_stream_ends_in_error()
-> anyhow::Result<()> {
    let engines = [
        switchyard_engine_sim::spawn(fast()).await?,
        switchyard_engine_sim::spawn(fast()).await?,
    ];
    let dir = tempfile::tempdir()?;
    let instances = [
        ("e0", engines[0].url.as_str()),
        ("e1", engines[1].url.as_str()),
    ];
    let router = static_router(&dir, &instances, |config| {
        config.stream_idle_timeout_seconds = 1;
    })
    .await?;
    let (id, holder) = stored_response(&router).await?;
    let holder_index = usize::from(holder == "e1");
    let other = &engines[1 - holder_index];

    // The holder dies mid-stream on a follow-up: the events so far (ids wrapped), then the
    // stream breaks; nothing is sent to the other instance.
    engines[holder_index].set_faults(switchyard_engine_sim::Faults {
        die_mid_stream_rate: 1.0,
        ..Default::default()
    });
    let body = format!(
        r#"{{"model":"chat","input":"go on","previous_response_id":"{id}","stream":true,"max_output_tokens":8}}"#
    );
    let mut response = bounded(
        "a dying follow-up",
        post_streaming(&format!("{}/v1/responses", router.url()), &[], body.clone()),
    )
    .await?;
    assert_eq!(response.status(), 200);
    assert_eq!(response.headers()["x-switchyard-route"], "response");
    let Body { text, broke } = read_body(&mut response).await;
    assert!(!broke, "the client's stream was cut: {text}");
    assert!(
        text.trim_end().ends_with(r#""code":"upstream_reset"}}"#),
        "no final error event: {text}"
    );
    assert!(text.contains("response.output_text.delta"), "{text}");
    assert!(!text.contains("response.completed"), "{text}");
    let created = text
        .lines()
        .find_map(|line| line.strip_prefix("data: "))
        .map(|data| serde_json::from_str::<serde_json::Value>(data).unwrap())
        .unwrap();
    let new_id = created["response"]["id"].as_str().unwrap();
    assert!(new_id.starts_with("resp_sy1"), "{new_id}");
    assert_eq!(created["response"]["previous_response_id"], id.as_str());
    assert!(no_follow_up(other), "the other instance got a follow-up");

    // The holder stalls: the router ends the stream with its idle error event.
    engines[holder_index].set_faults(switchyard_engine_sim::Faults {
        stall_mid_stream_rate: 1.0,
        ..Default::default()
    });
    let (status, _, frames) = bounded(
        "a stalled follow-up",
        http_post_frames(&format!("{}/v1/responses", router.url()), &[], body.clone()),
    )
    .await?;
    assert_eq!(status, 200);
    let text = frames_text(&frames);
    assert!(text.contains("\"stream_idle_timeout\""), "{text}");

    // The holder is gone but still registered: 503 upstream_unreachable, never the other one.
    engines[holder_index].set_faults(switchyard_engine_sim::Faults::default());
    engines[holder_index].kill();
    let reply = bounded(
        "a follow-up to a dead holder",
        http_post(
            &format!("{}/v1/responses", router.url()),
            &[],
            body.replace("true", "false"),
        ),
    )
    .await?;
    assert_eq!(reply.status, 503, "{}", reply.body);
    assert_eq!(reply.json()["error"]["code"], "upstream_unreachable");
    assert_eq!(reply.header("retry-after"), Some("1"));
    let retrieve = http_request(
        Method::GET,
        &format!("{}/v1/responses/{id}", router.url()),
        &[],
        "",
    )
    .await?;
    assert_eq!(retrieve.status, 503, "{}", retrieve.body);
    assert!(no_follow_up(other), "the other instance got a follow-up");
    settles(&router).await?;
    Ok(())
}
