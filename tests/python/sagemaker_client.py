"""Drives Switchyard with the real boto3, as a SageMaker user would.

Usage (tests/tests/sagemaker.rs runs each step; credentials are dummies, the environment sets
AWS_EC2_METADATA_DISABLED=true and points the AWS config files at /dev/null):

  sagemaker_client.py admin-create API_URL     boto3 `sagemaker`: configs, endpoint sm-chat, errors
  sagemaker_client.py admin-delete API_URL     the same client deletes everything again
  sagemaker_client.py auth API_URL SECRET      a wrong secret is refused, SECRET is accepted
  sagemaker_client.py invoke ROUTER_URL ENGINE_URL
                                               `sagemaker-runtime` invoke and streaming invoke
  sagemaker_client.py stream-broken ROUTER_URL the engine dies mid-stream: EventStreamError
  sagemaker_client.py crash ROUTER_URL         the engine dies after reading: ModelError (424),
                                               which boto3's retrying client does not resend

Prints "ok: ..." lines and "all ok" at the end; a failed check raises (non-zero exit).
"""

import json
import sys
import urllib.request

import boto3
import botocore
from botocore.config import Config
from botocore.exceptions import ClientError, EventStreamError

REGION = "us-west-2"
ARN = f"arn:aws:sagemaker:{REGION}:000000000000"


def client(service, url, secret="unused-secret", signed=True):
    config = Config(
        retries={"total_max_attempts": 1},
        connect_timeout=5,
        read_timeout=30,
        signature_version=botocore.UNSIGNED if not signed else None,
    )
    return boto3.client(
        service,
        endpoint_url=url,
        region_name=REGION,
        aws_access_key_id="AKIDSWITCHYARDTEST",
        aws_secret_access_key=secret,
        config=config,
    )


def expect_error(call, code, message=None, contains=None):
    try:
        call()
    except ClientError as err:
        error = err.response["Error"]
        assert error["Code"] == code, (code, error)
        if message is not None:
            assert error["Message"] == message, (message, error)
        if contains is not None:
            assert contains in error["Message"], (contains, error)
        print(f"ok: {code}: {error['Message']}")
        return
    raise AssertionError(f"expected {code}, the call succeeded")


def expect_missing(call, kind, name):
    """`call` fails as SageMaker's API fails on a missing endpoint or endpoint configuration
    (`kind`: "endpoint" or "endpoint-config") named `name`."""
    what = {"endpoint": "endpoint", "endpoint-config": "endpoint configuration"}[kind]
    expect_error(
        call,
        "ValidationException",
        message=f'Could not find {what} "{ARN}:{kind}/{name}".',
    )


PREFIX_VARIANT = {
    "VariantName": "AllTraffic",
    "ModelName": "sim",
    "InitialInstanceCount": 1,
    "InstanceType": "ml.g5.2xlarge",
    # SageMaker fields Switchyard does not use: accepted and given back.
    "VolumeSizeInGB": 64,
    "RoutingConfig": {
        "RoutingStrategy": "PREFIX_AWARE",
        "PrefixAwareRoutingConfig": {"PrefixLength": 1024, "ConcurrencyThreshold": 4},
    },
}
DATA_CAPTURE = {
    "InitialSamplingPercentage": 10,
    "DestinationS3Uri": "s3://unused/capture",
    "CaptureOptions": [{"CaptureMode": "Input"}],
}


def admin_create(url):
    sm = client("sagemaker", url)
    created = sm.create_endpoint_config(
        EndpointConfigName="sm-prefix",
        ProductionVariants=[PREFIX_VARIANT],
        DataCaptureConfig=DATA_CAPTURE,
        KmsKeyId="alias/unused",
        Tags=[{"Key": "team", "Value": "ml"}],
    )
    assert created["EndpointConfigArn"] == f"{ARN}:endpoint-config/sm-prefix", created
    print("ok: created sm-prefix")
    expect_error(
        lambda: sm.create_endpoint_config(
            EndpointConfigName="sm-prefix", ProductionVariants=[PREFIX_VARIANT]
        ),
        "ValidationException",
        message=f'Cannot create already existing endpoint configuration "{ARN}:endpoint-config/sm-prefix".',
    )
    # Invalid: PREFIX_AWARE needs PrefixAwareRoutingConfig (boto3 cannot see that; the server does).
    invalid = dict(PREFIX_VARIANT, RoutingConfig={"RoutingStrategy": "PREFIX_AWARE"})
    expect_error(
        lambda: sm.create_endpoint_config(EndpointConfigName="sm-bad", ProductionVariants=[invalid]),
        "ValidationException",
        contains="ProductionVariants[0].RoutingConfig.PrefixAwareRoutingConfig",
    )
    expect_missing(
        lambda: sm.describe_endpoint_config(EndpointConfigName="sm-bad"),
        "endpoint-config",
        "sm-bad",
    )

    described = sm.describe_endpoint_config(EndpointConfigName="sm-prefix")
    variant = described["ProductionVariants"][0]
    assert variant["RoutingConfig"] == PREFIX_VARIANT["RoutingConfig"], variant
    assert variant["VolumeSizeInGB"] == 64, variant
    assert variant["InstanceType"] == "ml.g5.2xlarge", variant
    assert described["DataCaptureConfig"] == DATA_CAPTURE, described
    assert described["KmsKeyId"] == "alias/unused", described
    assert "Tags" not in described, described
    assert described["CreationTime"].year >= 2024, described
    print("ok: described sm-prefix with its unused fields")

    sm.create_endpoint_config(
        EndpointConfigName="sm-lor",
        ProductionVariants=[
            {
                "VariantName": "AllTraffic",
                "ModelName": "sim",
                "InitialInstanceCount": 1,
                "RoutingConfig": {"RoutingStrategy": "LEAST_OUTSTANDING_REQUESTS"},
            }
        ],
    )
    created = sm.create_endpoint(EndpointName="sm-chat", EndpointConfigName="sm-lor")
    assert created["EndpointArn"] == f"{ARN}:endpoint/sm-chat", created
    sm.get_waiter("endpoint_in_service").wait(
        EndpointName="sm-chat", WaiterConfig={"Delay": 1, "MaxAttempts": 5}
    )
    print("ok: sm-chat in service")
    expect_error(
        lambda: sm.create_endpoint(EndpointName="sm-chat", EndpointConfigName="sm-lor"),
        "ValidationException",
        message=f'Cannot create already existing endpoint "{ARN}:endpoint/sm-chat".',
    )
    expect_missing(
        lambda: sm.create_endpoint(EndpointName="sm-other", EndpointConfigName="nope"),
        "endpoint-config",
        "nope",
    )

    updated = sm.update_endpoint(EndpointName="sm-chat", EndpointConfigName="sm-prefix")
    assert updated["EndpointArn"] == f"{ARN}:endpoint/sm-chat", updated
    endpoint = sm.describe_endpoint(EndpointName="sm-chat")
    assert endpoint["EndpointConfigName"] == "sm-prefix", endpoint
    assert endpoint["EndpointStatus"] == "InService", endpoint
    summary = endpoint["ProductionVariants"][0]
    assert summary["VariantName"] == "AllTraffic", summary
    assert summary["RoutingConfig"]["RoutingStrategy"] == "PREFIX_AWARE", summary
    print("ok: sm-chat updated to sm-prefix")
    expect_missing(
        lambda: sm.update_endpoint(EndpointName="missing", EndpointConfigName="sm-lor"),
        "endpoint",
        "missing",
    )
    expect_missing(
        lambda: sm.update_endpoint(EndpointName="sm-chat", EndpointConfigName="nope"),
        "endpoint-config",
        "nope",
    )
    expect_missing(lambda: sm.describe_endpoint(EndpointName="missing"), "endpoint", "missing")

    pages = sm.get_paginator("list_endpoint_configs").paginate(
        SortBy="Name", SortOrder="Ascending", PaginationConfig={"PageSize": 1}
    )
    names = [config["EndpointConfigName"] for page in pages for config in page["EndpointConfigs"]]
    assert names == ["sm-lor", "sm-prefix"], names
    endpoints = sm.list_endpoints(NameContains="SM-", StatusEquals="InService")["Endpoints"]
    assert [e["EndpointName"] for e in endpoints] == ["sm-chat"], endpoints
    assert endpoints[0]["EndpointArn"] == f"{ARN}:endpoint/sm-chat", endpoints
    print("ok: listed")


def admin_delete(url):
    sm = client("sagemaker", url)
    # Switchyard keeps a config an endpoint uses (SageMaker would let it go).
    expect_error(
        lambda: sm.delete_endpoint_config(EndpointConfigName="sm-prefix"),
        "ValidationException",
        contains="used by endpoint sm-chat",
    )
    sm.delete_endpoint(EndpointName="sm-chat")
    expect_missing(lambda: sm.delete_endpoint(EndpointName="sm-chat"), "endpoint", "sm-chat")
    sm.delete_endpoint_config(EndpointConfigName="sm-prefix")
    sm.delete_endpoint_config(EndpointConfigName="sm-lor")
    expect_missing(
        lambda: sm.delete_endpoint_config(EndpointConfigName="sm-lor"),
        "endpoint-config",
        "sm-lor",
    )
    assert sm.list_endpoints()["Endpoints"] == []
    assert sm.list_endpoint_configs()["EndpointConfigs"] == []
    print("ok: deleted")


def auth(url, secret):
    expect_error(
        lambda: client("sagemaker", url, secret="not-the-token").list_endpoints(),
        "InvalidSignatureException",
        contains="does not match the signature you provided",
    )
    expect_error(
        lambda: client("sagemaker", url, signed=False).list_endpoints(),
        "MissingAuthenticationTokenException",
    )
    good = client("sagemaker", url, secret=secret)
    assert good.list_endpoints()["Endpoints"] == []
    good.create_endpoint_config(
        EndpointConfigName="signed",
        ProductionVariants=[{"VariantName": "AllTraffic", "ModelName": "sim"}],
    )
    assert good.describe_endpoint_config(EndpointConfigName="signed")["EndpointConfigName"] == "signed"
    print("ok: signed with the token")


def sse_text(raw):
    """The completion text of an SSE stream of OpenAI completion chunks, and its event count."""
    text, events = "", 0
    for event in raw.decode().split("\n\n"):
        if not event.startswith("data: ") or event == "data: [DONE]":
            continue
        events += 1
        chunk = json.loads(event[len("data: "):])
        text += "".join(choice.get("text", "") for choice in chunk.get("choices", []))
    return text, events


def engine_running(engine_url):
    with urllib.request.urlopen(f"{engine_url}/metrics", timeout=10) as response:
        for line in response.read().decode().splitlines():
            if line.startswith("vllm:num_requests_running"):
                return float(line.split()[-1])
    raise AssertionError("no vllm:num_requests_running in the engine's metrics")


STREAM_BODY = json.dumps({"prompt": "Tell me a story", "max_tokens": 24, "stream": True})


def invoke(router_url, engine_url):
    runtime = client("sagemaker-runtime", router_url)
    answer = runtime.invoke_endpoint(
        EndpointName="chat",
        ContentType="application/json",
        Body=json.dumps({"prompt": "Hello", "max_tokens": 4}),
    )
    assert answer["InvokedProductionVariant"] == "AllTraffic", answer
    text = json.loads(answer["Body"].read())["choices"][0]["text"]
    assert text, answer
    print("ok: invoke_endpoint:", text)

    stream = runtime.invoke_endpoint_with_response_stream(
        EndpointName="chat", ContentType="application/json", Body=STREAM_BODY
    )
    assert stream["InvokedProductionVariant"] == "AllTraffic", stream
    assert stream["ContentType"].startswith("text/event-stream"), stream
    parts, running_at_first = [], None
    for event in stream["Body"]:
        parts.append(event["PayloadPart"]["Bytes"])
        if running_at_first is None:
            # The engine is still generating when the first part arrives: nothing is buffered.
            running_at_first = engine_running(engine_url)
    assert running_at_first >= 1, running_at_first
    assert len(parts) >= 2, parts
    streamed_text, streamed_events = sse_text(b"".join(parts))

    direct = urllib.request.Request(
        f"{engine_url}/invocations",
        data=STREAM_BODY.encode(),
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(direct, timeout=30) as response:
        direct_text, direct_events = sse_text(response.read())
    assert streamed_text == direct_text, (streamed_text, direct_text)
    assert streamed_events == direct_events, (streamed_events, direct_events)
    print(f"ok: streamed {len(parts)} parts, {streamed_events} events: {streamed_text!r}")


def stream_broken(router_url):
    runtime = client("sagemaker-runtime", router_url)
    stream = runtime.invoke_endpoint_with_response_stream(
        EndpointName="chat", ContentType="application/json", Body=STREAM_BODY
    )
    parts = []
    try:
        for event in stream["Body"]:
            parts.append(event["PayloadPart"]["Bytes"])
    except EventStreamError as err:
        assert err.response["Error"]["Code"] == "ModelStreamError", err.response
        assert parts, "no part arrived before the error"
        print(f"ok: ModelStreamError after {len(parts)} parts: {err.response['Error']['Message']}")
        return
    raise AssertionError(f"the stream ended without an error after {len(parts)} parts")


def crash(router_url):
    # boto3's standard retry mode resends 500/502/503/504 up to twice: a request that crashed
    # its engine must come back as something it does not resend.
    runtime = boto3.client(
        "sagemaker-runtime",
        endpoint_url=router_url,
        region_name=REGION,
        aws_access_key_id="AKIDSWITCHYARDTEST",
        aws_secret_access_key="unused-secret",
        config=Config(retries={"mode": "standard", "max_attempts": 3}, read_timeout=30),
    )
    try:
        runtime.invoke_endpoint(
            EndpointName="chat",
            ContentType="application/json",
            Body=json.dumps({"prompt": "crash", "max_tokens": 4}),
        )
    except ClientError as err:
        assert err.response["Error"]["Code"] == "ModelError", err.response
        status = err.response["ResponseMetadata"]["HTTPStatusCode"]
        assert status == 424, err.response
        attempts = err.response["ResponseMetadata"].get("RetryAttempts", 0)
        assert attempts == 0, f"boto3 resent it {attempts} times"
        print(f"ok: ModelError ({status}), not resent: {err.response['Error']['Message']}")
        return
    raise AssertionError("the call to a dying engine succeeded")


def main():
    step, args = sys.argv[1], sys.argv[2:]
    {
        "admin-create": admin_create,
        "admin-delete": admin_delete,
        "auth": auth,
        "invoke": invoke,
        "stream-broken": stream_broken,
        "crash": crash,
    }[step](*args)
    print("all ok")


if __name__ == "__main__":
    main()
