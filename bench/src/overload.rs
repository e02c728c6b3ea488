//! `switchyard-bench overload`: the router's memory under a flood of large requests that an
//! engine never answers. A `switchyard-router` process runs from a static config in front of
//! one simulated engine that hangs on every request (`--hang-rate 1`); `requests` clients send
//! `body-bytes` each, all at once. Bodies are held from arrival until the instance's response
//! head, so without a bound the router's memory would grow with the flood; with
//! `--max-buffered-bytes` the excess is refused with 503 and the router's peak resident memory
//! (`VmHWM` in `/proc/PID/status`) stays near the bound.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use serde::Serialize;

use crate::child::{ChildServer, sibling_bin, start_child, start_router};
use crate::client::http_client;
use crate::error::UsageError;
use crate::output::{Invocation, emit_json};
use crate::procfs::memory_mib;
use crate::strategy::Strategy;

#[derive(Debug, Clone, clap::Args)]
pub struct OverloadArgs {
    /// Concurrent requests, all sent at once.
    #[arg(long, default_value_t = 200, value_name = "N")]
    pub requests: usize,
    /// Size of each request body (at most 6291456, SageMaker's limit).
    #[arg(long, default_value_t = 6_291_456, value_name = "BYTES")]
    pub body_bytes: usize,
    /// The router's --max-buffered-bytes.
    #[arg(long, default_value = "256MiB", value_name = "BYTES")]
    pub max_buffered_bytes: String,
    /// The router's --upstream-header-timeout-seconds: how long the admitted requests wait on
    /// the hung engine before their 504 (the run lasts about this long).
    #[arg(long, default_value_t = 5, value_name = "SECONDS")]
    pub upstream_header_timeout_seconds: u64,
    /// The switchyard-router executable. Default: next to this one.
    #[arg(long, value_name = "FILE")]
    pub router_bin: Option<PathBuf>,
    /// The switchyard-engine-sim executable. Default: next to this one.
    #[arg(long, value_name = "FILE")]
    pub engine_bin: Option<PathBuf>,
    /// Write the report as JSON.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct OverloadReport {
    #[serde(flatten)]
    pub invocation: Invocation,
    pub requests: usize,
    pub body_bytes: usize,
    pub max_buffered_bytes: u64,
    /// The router's resident memory before the flood and its peak (MiB).
    pub rss_before_mib: f64,
    pub peak_rss_mib: f64,
    /// The bound the issue sets: --max-buffered-bytes + 64 MiB.
    pub peak_bound_mib: f64,
    pub refused_503: usize,
    pub timed_out_504: usize,
    pub other: Vec<String>,
    pub seconds: f64,
}

impl OverloadReport {
    /// Each other answer once, with how many times it came.
    fn other_counted(&self) -> Vec<String> {
        let mut counts = std::collections::BTreeMap::<&str, usize>::new();
        for answer in &self.other {
            *counts.entry(answer).or_default() += 1;
        }
        counts
            .into_iter()
            .map(|(answer, count)| format!("{count} x {answer}"))
            .collect()
    }

    pub fn table(&self) -> String {
        format!(
            "\noverload: {} requests of {} bytes at once against a hung engine, --max-buffered-bytes {} MiB\n  answers: {} refused (503), {} timed out at the engine (504), {} other {:?}\n  router resident memory: {:.0} MiB before, peak {:.0} MiB (bound: buffered limit + 64 MiB = {:.0} MiB: {})\n  took {:.1} s\n",
            self.requests,
            self.body_bytes,
            self.max_buffered_bytes >> 20,
            self.refused_503,
            self.timed_out_504,
            self.other.len(),
            self.other_counted(),
            self.rss_before_mib,
            self.peak_rss_mib,
            self.peak_bound_mib,
            if self.peak_rss_mib <= self.peak_bound_mib {
                "within"
            } else {
                "OVER"
            },
            self.seconds,
        )
    }
}

pub async fn overload(args: OverloadArgs) -> anyhow::Result<OverloadReport> {
    if args.requests == 0 || args.requests > 10_000 {
        return Err(UsageError::new("--requests must be within 1..=10000").into());
    }
    if args.body_bytes == 0 || args.body_bytes > 6_291_456 {
        return Err(UsageError::new("--body-bytes must be within 1..=6291456").into());
    }
    let max_buffered_bytes = switchyard_router::parse_byte_size(&args.max_buffered_bytes)
        .map_err(|err| UsageError::new(format!("--max-buffered-bytes: {err}")))?;
    let find = |given: &Option<PathBuf>, name: &str| {
        given.clone().or_else(|| sibling_bin(name)).ok_or_else(|| {
            UsageError::new(format!(
                "{name} is not next to this executable: build it (cargo build --release -p {name}) or pass its path"
            ))
        })
    };
    let router_bin = find(&args.router_bin, "switchyard-router")?;
    let engine_bin = find(&args.engine_bin, "switchyard-engine-sim")?;
    let client = http_client();
    let engine_args = |listen: &str| -> Vec<std::ffi::OsString> {
        [
            "--listen",
            listen,
            "--hang-rate",
            "1",
            "--record-requests",
            "1",
            // Long enough for a 6 MiB prompt: the engine must take the request and hang, not
            // refuse it for its length.
            "--max-model-len",
            "4000000",
        ]
        .into_iter()
        .map(Into::into)
        .collect()
    };
    let engine = start_child(&engine_bin, &engine_args, "/health", &client).await?;
    let config_dir = tempfile::Builder::new()
        .prefix("switchyard-overload-")
        .tempdir()?;
    let timeout = args.upstream_header_timeout_seconds.to_string();
    let router = start_router(
        &router_bin,
        config_dir.path(),
        &engine.url,
        Strategy::Random,
        &[
            "--max-buffered-bytes",
            &args.max_buffered_bytes,
            "--upstream-header-timeout-seconds",
            &timeout,
            "--max-in-flight",
            "100000",
        ],
        &client,
    )
    .await
    .context("starting the router")?;
    let (_, rss_before_mib) = memory_mib(router.pid).context("cannot read the router's memory")?;
    let report = flood(&args, &router, &engine, max_buffered_bytes, rss_before_mib).await?;
    emit_json(&report.table(), &report, args.json.as_deref())?;
    Ok(report)
}

async fn flood(
    args: &OverloadArgs,
    router: &ChildServer,
    _engine: &ChildServer,
    max_buffered_bytes: u64,
    rss_before_mib: f64,
) -> anyhow::Result<OverloadReport> {
    // One chat body of the asked size, shared by every request.
    let filler = args.body_bytes.saturating_sub(100);
    let body = Bytes::from(
        serde_json::json!({
            "model": "sim",
            "messages": [{"role": "user", "content": "x".repeat(filler)}],
            "max_tokens": 1,
        })
        .to_string(),
    );
    let url: http::Uri =
        format!("{}/endpoints/bench/openai/v1/chat/completions", router.url).parse()?;
    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..args.requests {
        let client = http_client();
        let (url, body) = (url.clone(), body.clone());
        tasks.spawn(async move {
            let request = http::Request::post(url)
                .header("content-type", "application/json")
                .body(Full::new(body))
                .map_err(|err| err.to_string())?;
            let response = client
                .request(request)
                .await
                .map_err(|err| err.to_string())?;
            let status = response.status().as_u16();
            let body = response
                .into_body()
                .collect()
                .await
                .map(|body| body.to_bytes());
            if matches!(status, 503 | 504) {
                return Ok::<u16, String>(status);
            }
            // Anything else is reported with the start of its body, to say what it was.
            let text = body.map_or_else(
                |err| format!("(body: {err})"),
                |bytes| String::from_utf8_lossy(&bytes[..bytes.len().min(200)]).into_owned(),
            );
            Err(format!("{status} {text}"))
        });
    }
    let (mut refused, mut timed_out, mut other) = (0, 0, Vec::new());
    let limit = Duration::from_secs(args.upstream_header_timeout_seconds + 60);
    let deadline = tokio::time::Instant::now() + limit;
    while let Some(joined) = tokio::time::timeout_at(deadline, tasks.join_next())
        .await
        .context("the flood did not end in time")?
    {
        match joined {
            Ok(Ok(503)) => refused += 1,
            Ok(Ok(504)) => timed_out += 1,
            Ok(Ok(status)) => other.push(status.to_string()),
            Ok(Err(err)) => other.push(err),
            Err(err) => other.push(err.to_string()),
        }
    }
    let (peak_rss_mib, _) = memory_mib(router.pid).context("cannot read the router's memory")?;
    Ok(OverloadReport {
        invocation: Invocation::current("switchyard-bench".into()),
        requests: args.requests,
        body_bytes: body.len(),
        max_buffered_bytes,
        rss_before_mib,
        peak_rss_mib,
        peak_bound_mib: (max_buffered_bytes >> 20) as f64 + 64.0,
        refused_503: refused,
        timed_out_504: timed_out,
        other,
        seconds: started.elapsed().as_secs_f64(),
    })
}
