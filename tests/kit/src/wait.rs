//! Waiting with a deadline: a test that would hang fails with a message instead.

use std::fmt::Debug;
use std::future::Future;
use std::time::{Duration, Instant};

use anyhow::bail;

/// The longest one step of a test may take under [`bounded`] (an exchange with a router, the
/// next frame of a stream), as long as one whole HTTP exchange of the helpers may take.
pub const STEP_TIMEOUT: Duration = crate::http::HTTP_TIMEOUT;

/// Waits until `check` holds, polling every 20 ms, for at most `limit`.
pub async fn eventually<F, Fut>(limit: Duration, what: &str, mut check: F) -> anyhow::Result<()>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = Instant::now() + limit;
    loop {
        if check().await {
            return Ok(());
        }
        if Instant::now() >= deadline {
            bail!("timed out after {limit:?} waiting for {what}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// `step`'s output; panics, naming `what`, if it takes longer than [`STEP_TIMEOUT`] (a router
/// that hangs fails the test instead of the suite).
pub async fn bounded<T>(what: &str, step: impl Future<Output = T>) -> T {
    bounded_for(STEP_TIMEOUT, what, step).await
}

/// [`bounded`] with a limit of the caller's, for a step known to take longer.
pub async fn bounded_for<T>(limit: Duration, what: &str, step: impl Future<Output = T>) -> T {
    tokio::time::timeout(limit, step)
        .await
        .unwrap_or_else(|_| panic!("timed out after {limit:?}: {what}"))
}

/// Waits (10 s at most) until `now()` reads `wanted`, e.g. until a KV index says each instance
/// holds the wanted number of leading blocks of a prompt (the engines' events have arrived).
/// On a timeout the error names what `now()` read last.
pub async fn wait_matched<T>(what: &str, wanted: &T, now: impl Fn() -> T) -> anyhow::Result<()>
where
    T: PartialEq + Debug,
{
    let reached = eventually(Duration::from_secs(10), what, || {
        let reached = now() == *wanted;
        async move { reached }
    })
    .await;
    reached.map_err(|err| anyhow::anyhow!("{err}: read {:?}, wanted {wanted:?}", now()))
}
