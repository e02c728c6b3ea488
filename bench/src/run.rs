//! Sends a trace: closed loop (`concurrency` clients, each running one session after
//! another) or open loop (sessions start at Poisson arrival times), with a progress line.

use std::io::{IsTerminal as _, Write as _};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::client::{HttpClient, Outcome, stream_request};
use crate::workload::{RequestClass, Trace};

/// How to send a trace.
#[derive(Debug, Clone)]
pub struct RunConfig {
    /// Chat-completions URLs; requests are spread over them round-robin (several routers).
    pub targets: Vec<http::Uri>,
    /// The body's `model` (the endpoint name on the router's endpoint path).
    pub model: String,
    /// Closed loop: clients; open loop: the most sessions in flight.
    pub concurrency: usize,
    /// Open loop: new sessions per second of wall time. `None`: closed loop.
    pub rate: Option<f64>,
    /// Seed of the open loop's arrival times.
    pub seed: u64,
    pub request_timeout: Duration,
    /// No session starts after this much time.
    pub max_duration: Duration,
    /// Shown on the progress line.
    pub label: String,
    pub progress: bool,
}

/// One request's outcome, with where it came from in the trace.
#[derive(Debug, Clone)]
pub struct Measured {
    pub session: usize,
    pub turn: usize,
    pub class: RequestClass,
    /// The index in [`RunConfig::targets`] it was sent to.
    pub target: usize,
    /// When it was sent, from the run's start.
    pub sent: Duration,
    pub outcome: Outcome,
}

/// What a run produced.
#[derive(Debug, Clone)]
pub struct RunOutput {
    pub measured: Vec<Measured>,
    /// From the first request sent to the last answer complete.
    pub wall: Duration,
    /// False if the time limit stopped the run before the trace was done.
    pub complete: bool,
}

#[derive(Debug, Default)]
struct Counters {
    done: AtomicU64,
    errors: AtomicU64,
}

struct Shared {
    trace: Arc<Trace>,
    config: RunConfig,
    client: HttpClient,
    counters: Counters,
    next_target: AtomicUsize,
    started: Instant,
}

impl Shared {
    async fn run_session(&self, session: usize) -> Vec<Measured> {
        let requests = &self.trace.sessions[session].requests;
        let mut measured = Vec::with_capacity(requests.len());
        for (turn, request) in requests.iter().enumerate() {
            let body = request.body(&self.config.model);
            let target =
                self.next_target.fetch_add(1, Ordering::Relaxed) % self.config.targets.len();
            let sent = self.started.elapsed();
            let outcome = stream_request(
                &self.client,
                &self.config.targets[target],
                body,
                self.config.request_timeout,
            )
            .await;
            self.counters.done.fetch_add(1, Ordering::Relaxed);
            if !outcome.ok() {
                self.counters.errors.fetch_add(1, Ordering::Relaxed);
            }
            measured.push(Measured {
                session,
                turn,
                class: request.class,
                target,
                sent,
                outcome,
            });
        }
        measured
    }
}

/// Sends `trace` as `config` says and returns every outcome.
pub async fn run(
    trace: Arc<Trace>,
    config: RunConfig,
    client: HttpClient,
) -> anyhow::Result<RunOutput> {
    anyhow::ensure!(!config.targets.is_empty(), "no target to send requests to");
    let total = trace.request_count();
    let started = Instant::now();
    let shared = Arc::new(Shared {
        trace,
        config,
        client,
        counters: Counters::default(),
        next_target: AtomicUsize::new(0),
        started,
    });
    let deadline = started + shared.config.max_duration;
    let finished = CancellationToken::new();
    let progress = shared.config.progress.then(|| {
        tokio::spawn(progress_line(
            Arc::clone(&shared),
            total,
            started,
            finished.clone(),
        ))
    });

    let mut tasks: JoinSet<Vec<Measured>> = JoinSet::new();
    let sessions = shared.trace.sessions.len();
    let mut complete = true;
    let mut measured = Vec::with_capacity(total);
    match shared.config.rate {
        None => {
            let next = Arc::new(AtomicUsize::new(0));
            for _ in 0..shared.config.concurrency.max(1) {
                let shared = Arc::clone(&shared);
                let next = Arc::clone(&next);
                tasks.spawn(async move {
                    let mut measured = Vec::new();
                    loop {
                        let session = next.fetch_add(1, Ordering::Relaxed);
                        if session >= sessions || Instant::now() >= deadline {
                            break;
                        }
                        measured.extend(shared.run_session(session).await);
                    }
                    measured
                });
            }
        }
        Some(rate) => {
            let mut rng = fastrand::Rng::with_seed(shared.config.seed ^ 0x5eed_a771_7a1e);
            let mut at = started;
            let limit = shared.config.concurrency.max(1);
            for session in 0..sessions {
                // Exponential inter-arrival times: a Poisson process of `rate` per second.
                let gap = -(1.0 - rng.f64()).ln() / rate.max(1e-9);
                at += Duration::from_secs_f64(gap.min(3600.0));
                if at >= deadline {
                    complete = false;
                    break;
                }
                tokio::time::sleep_until(at.into()).await;
                while tasks.len() >= limit {
                    match tasks.join_next().await {
                        Some(done) => measured.extend(done?),
                        None => break,
                    }
                }
                let shared = Arc::clone(&shared);
                tasks.spawn(async move { shared.run_session(session).await });
            }
        }
    }
    while let Some(done) = tasks.join_next().await {
        measured.extend(done?);
    }
    let wall = started.elapsed();
    finished.cancel();
    if let Some(progress) = progress {
        let _ = progress.await;
    }
    if measured.len() < total {
        complete = false;
    }
    measured.sort_by_key(|item| (item.session, item.turn));
    Ok(RunOutput {
        measured,
        wall,
        complete,
    })
}

/// Prints `label  done/total  req/s  errors  elapsed` on stderr: rewritten in place four times
/// a second on a terminal, a line every five seconds otherwise.
async fn progress_line(
    shared: Arc<Shared>,
    total: usize,
    started: Instant,
    finished: CancellationToken,
) {
    let terminal = std::io::stderr().is_terminal();
    let period = if terminal {
        Duration::from_millis(250)
    } else {
        Duration::from_secs(5)
    };
    let mut ticker = tokio::time::interval(period);
    ticker.tick().await;
    loop {
        let stop = tokio::select! {
            _ = ticker.tick() => false,
            () = finished.cancelled() => true,
        };
        let done = shared.counters.done.load(Ordering::Relaxed);
        let errors = shared.counters.errors.load(Ordering::Relaxed);
        let elapsed = started.elapsed().as_secs_f64();
        let line = format!(
            "{}  {done}/{total} requests  {:.1} req/s  {errors} errors  {elapsed:.1} s",
            shared.config.label,
            done as f64 / elapsed.max(1e-9),
        );
        let mut err = std::io::stderr().lock();
        if terminal {
            let _ = write!(err, "\r\x1b[2K{line}");
            if stop {
                let _ = write!(err, "\r\x1b[2K");
            }
        } else if !stop {
            let _ = writeln!(err, "{line}");
        }
        let _ = err.flush();
        if stop {
            return;
        }
    }
}
