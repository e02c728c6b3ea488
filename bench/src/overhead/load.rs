//! Requests and closed-loop load through one path, with the CPU time of the process behind it.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};

use super::report::Throughput;
use crate::client::HttpClient;
use crate::procfs::process_cpu_seconds;

/// One non-streaming POST read to its end; its wall time, or why it failed.
pub async fn post_once(
    client: &HttpClient,
    url: &http::Uri,
    body: &Bytes,
) -> Result<Duration, PostError> {
    let started = Instant::now();
    let request = http::Request::post(url.clone())
        .header(http::header::CONTENT_TYPE, "application/json")
        .body(Full::new(body.clone()))
        .map_err(PostError::Request)?;
    let response = tokio::time::timeout(Duration::from_secs(10), client.request(request))
        .await
        .map_err(|_| PostError::TimedOut)?
        .map_err(PostError::Transport)?;
    let status = response.status();
    response
        .into_body()
        .collect()
        .await
        .map_err(PostError::Body)?;
    if !status.is_success() {
        return Err(PostError::Status(status));
    }
    Ok(started.elapsed())
}

/// Why one POST of [`post_once`] failed (the message alone: no source chain).
#[derive(Debug, thiserror::Error)]
pub enum PostError {
    #[error("{0}")]
    Request(http::Error),
    #[error("timed out")]
    TimedOut,
    #[error("{0}")]
    Transport(hyper_util::client::legacy::Error),
    #[error("{0}")]
    Body(hyper::Error),
    #[error("status {0}")]
    Status(http::StatusCode),
}

pub async fn closed_loop(
    client: &HttpClient,
    url: &http::Uri,
    body: &Bytes,
    concurrency: usize,
    duration: Duration,
) -> Throughput {
    let done = Arc::new(AtomicU64::new(0));
    let errors = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let deadline = started + duration;
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..concurrency {
        let (client, url, body) = (client.clone(), url.clone(), body.clone());
        let (done, errors) = (Arc::clone(&done), Arc::clone(&errors));
        tasks.spawn(async move {
            while Instant::now() < deadline {
                match post_once(&client, &url, &body).await {
                    Ok(_) => done.fetch_add(1, Ordering::Relaxed),
                    Err(_) => errors.fetch_add(1, Ordering::Relaxed),
                };
            }
        });
    }
    while tasks.join_next().await.is_some() {}
    let seconds = started.elapsed().as_secs_f64();
    let requests = done.load(Ordering::Relaxed);
    Throughput {
        requests,
        errors: errors.load(Ordering::Relaxed),
        seconds,
        requests_per_s: requests as f64 / seconds.max(1e-9),
    }
}

/// Slices each tracing comparison's throughput phase is cut into.
pub const TRACING_SLICES: usize = 10;

/// Closed-loop load on each target in turn, [`TRACING_SLICES`] rounds (the order rotating),
/// `duration` per target in all, after one warm-up slice each: each target's summed
/// throughput and CPU seconds.
pub async fn interleaved(
    client: &HttpClient,
    targets: &[(&http::Uri, u32)],
    body: &Bytes,
    concurrency: usize,
    duration: Duration,
) -> anyhow::Result<Vec<(Throughput, f64)>> {
    let slice = duration / TRACING_SLICES as u32;
    let mut totals: Vec<(Throughput, f64)> = targets
        .iter()
        .map(|_| {
            (
                Throughput {
                    requests: 0,
                    errors: 0,
                    seconds: 0.0,
                    requests_per_s: 0.0,
                },
                0.0,
            )
        })
        .collect();
    // One slice each first, not counted: a process's first seconds under load (its
    // allocator growing, its pools filling) are slower, and the untraced router has just had
    // its own throughput phase while the traced ones have not.
    for &(url, pid) in targets {
        loaded(client, url, body, concurrency, slice, pid).await?;
    }
    for round in 0..TRACING_SLICES {
        for turn in 0..targets.len() {
            let at = (round + turn) % targets.len();
            let (url, pid) = targets[at];
            let (throughput, cpu, _) = loaded(client, url, body, concurrency, slice, pid).await?;
            let total = &mut totals[at];
            total.0.requests += throughput.requests;
            total.0.errors += throughput.errors;
            total.0.seconds += throughput.seconds;
            total.1 += cpu;
        }
    }
    for (throughput, _) in &mut totals {
        if throughput.seconds > 0.0 {
            throughput.requests_per_s = throughput.requests as f64 / throughput.seconds;
        }
    }
    Ok(totals)
}

/// A closed loop through a proxy process, with that process's CPU seconds and this one's.
pub async fn loaded(
    client: &HttpClient,
    url: &http::Uri,
    body: &Bytes,
    concurrency: usize,
    duration: Duration,
    pid: u32,
) -> anyhow::Result<(Throughput, f64, f64)> {
    let pid = pid.to_string();
    let before = process_cpu_seconds(&pid).context("cannot read the proxy's CPU time")?;
    let bench_before = process_cpu_seconds("self").unwrap_or(0.0);
    let throughput = closed_loop(client, url, body, concurrency, duration).await;
    let cpu = process_cpu_seconds(&pid).context("cannot read the proxy's CPU time")? - before;
    let bench = process_cpu_seconds("self").unwrap_or(0.0) - bench_before;
    if throughput.requests == 0 {
        bail!("no request went through {url} in the throughput phase");
    }
    Ok((throughput, cpu, bench))
}
