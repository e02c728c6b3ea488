//! SageMaker's own clients, unchanged: the real boto3 (`tests/python/sagemaker_client.py`, in
//! the venv `scripts/ensure-deps` makes under target/python) against the control plane's
//! SageMaker-compatible API (`--sagemaker-api-listen`) and against a router's
//! `invocations` / `invocations-response-stream`, with simulated engines behind it.
//!
//! Credentials are dummies, the region is us-west-2, and `AWS_EC2_METADATA_DISABLED=true` with
//! the AWS config files pointed at /dev/null keeps boto3 from looking for real ones.

use std::time::Duration;

use switchyard_control::ControlConfig;
use switchyard_engine_sim::{Faults, SimConfig};
use switchyard_tests::*;

/// Runs one step of the boto3 script; fails the test with its output unless it says "all ok".
async fn boto3(step: &str, args: &[&str]) -> anyhow::Result<String> {
    let script =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("python/sagemaker_client.py");
    let run = tokio::process::Command::new(test_python())
        .arg(&script)
        .arg(step)
        .args(args)
        .env("AWS_EC2_METADATA_DISABLED", "true")
        .env("AWS_CONFIG_FILE", "/dev/null")
        .env("AWS_SHARED_CREDENTIALS_FILE", "/dev/null")
        .env_remove("AWS_PROFILE")
        .env_remove("AWS_ACCESS_KEY_ID")
        .env_remove("AWS_SECRET_ACCESS_KEY")
        .env_remove("AWS_SESSION_TOKEN")
        .kill_on_drop(true)
        .output();
    let output = tokio::time::timeout(Duration::from_secs(120), run).await??;
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&output.stderr);
    anyhow::ensure!(
        output.status.success() && stdout.contains("all ok"),
        "boto3 step {step} failed:\n{stdout}\n{stderr}"
    );
    Ok(stdout)
}

/// A control plane on an embedded store in `dir`, serving the SageMaker API too.
async fn control_plane_with_sagemaker_api(
    dir: &std::path::Path,
    admin_token: Option<&str>,
) -> anyhow::Result<switchyard_control::ControlPlane> {
    let mut config = ControlConfig::embedded(loopback_any(), dir.join("data"));
    config.sagemaker_api_listen = Some(loopback_any());
    if let Some(token) = admin_token {
        let path = dir.join("admin-token");
        std::fs::write(&path, format!("{token}\n"))?;
        config.admin_token_file = Some(path);
    }
    control_plane(config).await
}

#[tokio::test]
async fn boto3_manages_endpoint_configs_and_endpoints_that_then_route_traffic() -> anyhow::Result<()>
{
    let dir = tempfile::tempdir()?;
    let control = control_plane_with_sagemaker_api(dir.path(), None).await?;
    let api = control
        .sagemaker_url()
        .expect("the SageMaker API is served");
    let engine = switchyard_engine_sim::spawn(SimConfig {
        time_scale: 0.05,
        ..SimConfig::default()
    })
    .await?;
    let router = router(&[control.url()]).await?;

    // Configs (PREFIX_AWARE with SageMaker-only fields, LEAST_OUTSTANDING_REQUESTS), endpoint
    // sm-chat created on one and updated to the other, SageMaker's errors, listings.
    boto3("admin-create", &[&api]).await?;

    // What boto3 made is Switchyard's own: the CLI describes it...
    let describe = tokio::process::Command::new(binary("switchyard"))
        .args(["--control-plane", &control.url(), "--output", "json"])
        .args(["endpoint", "describe", "--name", "sm-chat"])
        .env_remove("SWITCHYARD_CONTROL_PLANE")
        .output()
        .await?;
    anyhow::ensure!(
        describe.status.success(),
        "{}",
        String::from_utf8_lossy(&describe.stderr)
    );
    let described: serde_json::Value = serde_json::from_slice(&describe.stdout)?;
    assert_eq!(described["EndpointConfigName"], "sm-prefix", "{described}");
    assert_eq!(described["EndpointStatus"], "InService", "{described}");

    // ...and routers route it, with the PREFIX_AWARE strategy of the config boto3 switched to.
    let mut admin = admin(&control.url()).await?;
    register(&mut admin, "sm-chat", "engine-0", &engine.url).await?;
    eventually(
        Duration::from_secs(10),
        "the router to see engine-0",
        || async {
            router
                .table()
                .endpoints
                .get("sm-chat")
                .is_some_and(|endpoint| endpoint.variants.iter().any(|v| !v.instances.is_empty()))
        },
    )
    .await?;
    let reply = http_post(
        &format!("{}/endpoints/sm-chat/invocations", router.url()),
        &[],
        r#"{"prompt":"Hello","max_tokens":2}"#,
    )
    .await?;
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert_eq!(reply.header("x-switchyard-route"), Some("prefix"));
    assert_eq!(
        reply.header("x-amzn-invoked-production-variant"),
        Some("AllTraffic")
    );

    // boto3 deletes it all again; the router forgets the endpoint.
    boto3("admin-delete", &[&api]).await?;
    eventually(
        Duration::from_secs(10),
        "the router to drop sm-chat",
        || async { !router.table().endpoints.contains_key("sm-chat") },
    )
    .await?;
    router.shutdown().await;
    control.shutdown().await?;
    Ok(())
}

#[tokio::test]
async fn with_an_admin_token_only_requests_signed_with_it_are_served() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let token = "the-admin-token-0123";
    let control = control_plane_with_sagemaker_api(dir.path(), Some(token)).await?;
    let api = control
        .sagemaker_url()
        .expect("the SageMaker API is served");
    // A wrong secret and no signature are refused as AWS refuses them; the token signs.
    boto3("auth", &[&api, token]).await?;
    // The gRPC API sees what the signed request created, with the same token.
    let mut admin = switchyard_proto::v1::admin_client::AdminClient::with_interceptor(
        tonic::transport::Channel::from_shared(control.url())?
            .connect()
            .await?,
        move |mut request: tonic::Request<()>| {
            request
                .metadata_mut()
                .insert("authorization", format!("Bearer {token}").parse().unwrap());
            Ok(request)
        },
    );
    let config = admin
        .describe_endpoint_config(switchyard_proto::v1::DescribeEndpointConfigRequest {
            name: "signed".into(),
        })
        .await?
        .into_inner();
    assert_eq!(config.name, "signed");
    control.shutdown().await?;
    Ok(())
}

#[tokio::test]
async fn boto3_invokes_through_the_router_and_streams_event_by_event() -> anyhow::Result<()> {
    // One engine, slow enough (14 ms a token) that a 24-token answer is still being generated
    // when the first part reaches boto3.
    let cluster = Cluster::start(1, 1, &variant_json("RANDOM", None), real_time()).await?;
    let router_url = cluster.routers()[0].url();
    let engine_url = cluster.engines()[0].url.clone();
    boto3("invoke", &[&router_url, &engine_url]).await?;

    // The engine dies after a few tokens: boto3 raises EventStreamError, code ModelStreamError.
    cluster.engines()[0].set_faults(Faults {
        die_mid_stream_rate: 1.0,
        ..Faults::default()
    });
    boto3("stream-broken", &[&router_url]).await?;

    // The engine dies after reading a non-streaming request: boto3 gets ModelError (424) and,
    // retrying client as it is, sends it once.
    let before = cluster.engines()[0].received().len();
    boto3("crash", &[&router_url]).await?;
    assert_eq!(
        cluster.engines()[0].received().len(),
        before + 1,
        "the engine got the request exactly once"
    );
    cluster.wait_idle().await?;
    Ok(())
}

/// POSTs one AWS JSON 1.1 call (unsigned) and returns (status, `__type`, message).
async fn call(api: &str, target: &str, body: &str) -> anyhow::Result<(u16, String, String)> {
    let reply = http_post(
        api,
        &[
            ("x-amz-target", target),
            ("content-type", "application/x-amz-json-1.1"),
        ],
        body.to_owned(),
    )
    .await?;
    assert_eq!(
        reply.header("content-type"),
        Some("application/x-amz-json-1.1")
    );
    let json = reply.json();
    Ok((
        reply.status,
        json["__type"].as_str().unwrap_or_default().to_owned(),
        json["message"].as_str().unwrap_or_default().to_owned(),
    ))
}

#[tokio::test]
async fn hand_made_requests_get_aws_errors_naming_the_problem() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let control = control_plane_with_sagemaker_api(dir.path(), None).await?;
    let api = control
        .sagemaker_url()
        .expect("the SageMaker API is served");

    let (status, code, _) = call(&format!("{api}/other"), "SageMaker.ListEndpoints", "{}").await?;
    assert_eq!((status, code.as_str()), (404, "UnknownOperationException"));
    let (status, code, message) = call(&api, "SageMaker.CreateModel", "{}").await?;
    assert_eq!((status, code.as_str()), (400, "UnknownOperationException"));
    assert!(message.contains("CreateEndpointConfig"), "{message}");
    let (status, code, _) = call(&api, "SageMaker.ListEndpoints", "[1]").await?;
    assert_eq!((status, code.as_str()), (400, "SerializationException"));

    let cases = [
        (
            "SageMaker.CreateEndpointConfig",
            r#"{"EndpointConfigName":"c","ProductionVariant":[]}"#,
            "ProductionVariant: is not a member of CreateEndpointConfig's input",
        ),
        (
            "SageMaker.CreateEndpointConfig",
            r#"{"EndpointConfigName":"bad name","ProductionVariants":[]}"#,
            "EndpointConfigName: ",
        ),
        (
            "SageMaker.CreateEndpointConfig",
            r#"{"EndpointConfigName":"c","ProductionVariants":[{"VariantName":"a","RoutingConfig":{"RoutingStrategyy":"RANDOM"}}]}"#,
            "ProductionVariants[0].RoutingConfig.RoutingStrategyy: is not a known field",
        ),
        (
            "SageMaker.CreateEndpointConfig",
            r#"{"EndpointConfigName":"c","ProductionVariants":[]}"#,
            "ProductionVariants: must hold 1 to 10 variants, got 0",
        ),
        (
            "SageMaker.CreateEndpoint",
            r#"{"EndpointName":"e"}"#,
            "EndpointConfigName: is required by CreateEndpoint",
        ),
        (
            "SageMaker.ListEndpoints",
            r#"{"MaxResults":0}"#,
            "MaxResults: must be between 1 and 100, got 0",
        ),
        (
            "SageMaker.ListEndpointConfigs",
            r#"{"NextToken":"zzz"}"#,
            "NextToken: ",
        ),
    ];
    for (target, body, expected) in cases {
        let (status, code, message) = call(&api, target, body).await?;
        assert_eq!(
            (status, code.as_str()),
            (400, "ValidationException"),
            "{body}"
        );
        assert!(message.starts_with(expected), "{body}: {message}");
    }
    // Nothing was stored by any of them.
    let (status, _, _) = call(
        &api,
        "SageMaker.DescribeEndpointConfig",
        r#"{"EndpointConfigName":"c"}"#,
    )
    .await?;
    assert_eq!(status, 400);

    let huge = format!(
        r#"{{"EndpointConfigName":"c","KmsKeyId":"{}"}}"#,
        "k".repeat(2 << 20)
    );
    let (status, _, message) = call(&api, "SageMaker.CreateEndpointConfig", &huge).await?;
    assert_eq!(status, 413, "{message}");
    control.shutdown().await?;
    Ok(())
}

#[tokio::test]
async fn with_etcd_down_calls_answer_service_unavailable() -> anyhow::Result<()> {
    let mut etcd = Etcd::start().await?;
    let mut config = ControlConfig::etcd(loopback_any(), vec![etcd.url.clone()], "/sm/");
    config.sagemaker_api_listen = Some(loopback_any());
    let control = control_plane(config).await?;
    let api = control
        .sagemaker_url()
        .expect("the SageMaker API is served");
    let (status, _, _) = call(&api, "SageMaker.ListEndpoints", "{}").await?;
    assert_eq!(status, 200);
    etcd.kill();
    // A 503 that boto3 retries, naming the store, rather than a hang or a 500.
    let (status, code, message) = call(&api, "SageMaker.ListEndpoints", "{}").await?;
    assert_eq!(
        (status, code.as_str()),
        (503, "ServiceUnavailable"),
        "{message}"
    );
    assert!(message.contains("store is unavailable"), "{message}");
    control.shutdown().await?;
    Ok(())
}

#[tokio::test]
async fn the_sagemaker_api_takes_max_in_flight_per_instance_and_names_a_bad_one()
-> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let control = control_plane_with_sagemaker_api(dir.path(), None).await?;
    let api = control
        .sagemaker_url()
        .expect("the SageMaker API is served");
    let (status, code, message) = call(
        &api,
        "SageMaker.CreateEndpointConfig",
        r#"{"EndpointConfigName":"c","ProductionVariants":[{"VariantName":"a","MaxInFlightPerInstance":0}]}"#,
    )
    .await?;
    assert_eq!((status, code.as_str()), (400, "ValidationException"));
    assert!(
        message.starts_with("ProductionVariants[0].MaxInFlightPerInstance: "),
        "{message}"
    );
    let (status, _, message) = call(
        &api,
        "SageMaker.CreateEndpointConfig",
        r#"{"EndpointConfigName":"c","ProductionVariants":[{"VariantName":"a","MaxInFlightPerInstance":8}]}"#,
    )
    .await?;
    assert_eq!(status, 200, "{message}");
    let described = http_post(
        &api,
        &[
            ("x-amz-target", "SageMaker.DescribeEndpointConfig"),
            ("content-type", "application/x-amz-json-1.1"),
        ],
        r#"{"EndpointConfigName":"c"}"#,
    )
    .await?;
    assert_eq!(
        described.json()["ProductionVariants"][0]["MaxInFlightPerInstance"],
        8,
        "{}",
        described.body
    );
    control.shutdown().await?;
    Ok(())
}
