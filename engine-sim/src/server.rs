//! Serving: the shared state behind the handlers, the accept loop (HTTP/1.1, like vLLM's
//! uvicorn), graceful shutdown, abrupt kill, and the in-process [`SimHandle`].

use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::service::TowerToHyperService;
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tokio_util::task::AbortOnDropHandle;

use crate::config::SimConfig;
use crate::driver::{EngineClient, EngineDriver, engine};
use crate::engine::Scheduler;
use crate::faults::{FaultInjector, Faults};
use crate::metrics::{Metrics, SimStats};
use crate::nixl::Handoffs;
use crate::records::{ReceivedRequest, Recorder};
use crate::{SimError, api};

/// What every handler can reach.
#[derive(Debug)]
pub(crate) struct Shared {
    pub config: SimConfig,
    pub engine_id: String,
    pub engine: EngineClient,
    pub metrics: Arc<Metrics>,
    pub faults: FaultInjector,
    pub records: Recorder,
    pub handoffs: Handoffs,
    /// The listening address, known once serving starts.
    pub local_addr: OnceLock<SocketAddr>,
}

/// One simulated vLLM instance, ready to serve on a listener.
#[derive(Debug)]
pub struct SimServer {
    shared: Arc<Shared>,
    driver: EngineDriver,
    kill: CancellationToken,
}

impl SimServer {
    /// Validates `config` and builds the engine (nothing runs until [`run`](Self::run)).
    pub fn new(config: SimConfig) -> Result<Self, SimError> {
        config.validate().map_err(SimError::Config)?;
        let metrics = Arc::new(Metrics::default());
        let (client, driver) = engine(
            Scheduler::from_config(&config),
            Arc::clone(&metrics),
            config.time_scale,
        );
        let engine_id = config
            .engine_id
            .clone()
            .unwrap_or_else(|| format!("switchyard-sim-{:016x}", fastrand::u64(..)));
        let shared = Shared {
            engine_id,
            engine: client,
            metrics,
            faults: FaultInjector::new(config.faults(), config.seed),
            records: Recorder::new(config.record_requests),
            handoffs: Handoffs::new(config.kv_cache_blocks),
            local_addr: OnceLock::new(),
            config,
        };
        Ok(Self {
            shared: Arc::new(shared),
            driver,
            kill: CancellationToken::new(),
        })
    }

    /// Binds nothing itself: serves on `listener` until `shutdown` is cancelled, then stops
    /// accepting and lets in-flight requests (streams included) finish within
    /// `--shutdown-grace-s` before dropping their connections.
    pub async fn serve(
        listener: TcpListener,
        config: SimConfig,
        shutdown: CancellationToken,
    ) -> Result<(), SimError> {
        Self::new(config)?.run(listener, shutdown).await
    }

    /// This engine's id (`remote_engine_id` in kv_transfer_params).
    pub fn engine_id(&self) -> &str {
        &self.shared.engine_id
    }

    pub fn stats(&self) -> SimStats {
        self.shared.metrics.stats()
    }

    /// Serves on `listener` until `shutdown` is cancelled (see [`serve`](Self::serve)).
    pub async fn run(
        self,
        listener: TcpListener,
        shutdown: CancellationToken,
    ) -> Result<(), SimError> {
        let SimServer {
            shared,
            driver,
            kill,
        } = self;
        let addr = listener.local_addr().map_err(SimError::Io)?;
        let _ = shared.local_addr.set(addr);
        let config = &shared.config;
        tracing::info!(
            %addr,
            model = %config.served_model_name,
            role = %config.role,
            time_scale = config.time_scale,
            engine_id = %shared.engine_id,
            "engine simulator listening"
        );

        let engine_stop = CancellationToken::new();
        let engine_task = AbortOnDropHandle::new(tokio::spawn(driver.run(engine_stop.clone())));
        let grace = Duration::try_from_secs_f64(config.shutdown_grace_s).unwrap_or(Duration::MAX);
        let app = api::router(Arc::clone(&shared));
        serve_connections(listener, app, &shutdown, &kill, grace).await;

        // Connections are closed: nothing can use the engine any more.
        engine_stop.cancel();
        if let Err(err) = engine_task.await
            && err.is_panic()
        {
            return Err(SimError::EnginePanicked);
        }
        tracing::info!(%addr, "engine simulator stopped");
        Ok(())
    }
}

/// Accepts connections until `shutdown` or `kill`; then drains (shutdown) or drops (kill)
/// the open ones. Every connection task lives in one `JoinSet`, so none outlives this call.
async fn serve_connections(
    listener: TcpListener,
    app: axum::Router,
    shutdown: &CancellationToken,
    kill: &CancellationToken,
    grace: Duration,
) {
    let hard_stop = kill.child_token();
    let mut connections = JoinSet::new();
    loop {
        tokio::select! {
            () = kill.cancelled() => break,
            () = shutdown.cancelled() => break,
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
            accepted = listener.accept() => match accepted {
                Ok((stream, _peer)) => {
                    connections.spawn(serve_connection(
                        stream,
                        app.clone(),
                        shutdown.clone(),
                        hard_stop.clone(),
                    ));
                }
                Err(err) => {
                    // Out of file descriptors and the like: back off instead of spinning.
                    tracing::warn!(error = %err, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
        }
    }
    drop(listener);

    if !kill.is_cancelled() && !connections.is_empty() {
        tracing::info!(open = connections.len(), "draining connections");
        let drained = tokio::time::timeout(grace, async {
            while connections.join_next().await.is_some() {}
        });
        tokio::select! {
            result = drained => if result.is_err() {
                tracing::warn!("grace period over, dropping open connections");
            },
            () = kill.cancelled() => {}
        }
    }
    hard_stop.cancel();
    connections.abort_all();
    while connections.join_next().await.is_some() {}
}

/// Serves one connection, HTTP/1.1 or HTTP/2 with prior knowledge (h2c), as the client
/// chooses; on shutdown, finishes the requests in flight and closes.
async fn serve_connection(
    stream: TcpStream,
    app: axum::Router,
    shutdown: CancellationToken,
    hard_stop: CancellationToken,
) {
    // Small SSE chunks must not wait for Nagle's algorithm.
    let _ = stream.set_nodelay(true);
    let builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
    let connection = builder.serve_connection(TokioIo::new(stream), TowerToHyperService::new(app));
    tokio::pin!(connection);
    tokio::select! {
        result = connection.as_mut() => {
            log_connection_end(result);
            return;
        }
        () = shutdown.cancelled() => {}
        () = hard_stop.cancelled() => return,
    }
    connection.as_mut().graceful_shutdown();
    tokio::select! {
        result = connection => log_connection_end(result),
        () = hard_stop.cancelled() => {}
    }
}

fn log_connection_end(result: Result<(), Box<dyn std::error::Error + Send + Sync>>) {
    if let Err(err) = result {
        tracing::debug!(error = %err, "connection ended with an error");
    }
}

/// A simulator running in the current tokio runtime, for tests and `switchyard up`.
/// Dropping the handle kills the simulator (see [`kill`](Self::kill)).
#[derive(Debug)]
pub struct SimHandle {
    pub addr: SocketAddr,
    /// `http://127.0.0.1:PORT`
    pub url: String,
    shared: Arc<Shared>,
    shutdown: CancellationToken,
    kill: CancellationToken,
    task: Option<tokio::task::JoinHandle<Result<(), SimError>>>,
}

/// Starts a simulator on `127.0.0.1:0` in the current runtime. Returns once the listener is
/// bound, so the simulator accepts connections right away.
pub async fn spawn(config: SimConfig) -> Result<SimHandle, SimError> {
    let server = SimServer::new(config)?;
    let listener = TcpListener::bind((std::net::Ipv4Addr::LOCALHOST, 0))
        .await
        .map_err(SimError::Io)?;
    let addr = listener.local_addr().map_err(SimError::Io)?;
    let shared = Arc::clone(&server.shared);
    let kill = server.kill.clone();
    let shutdown = CancellationToken::new();
    let task = tokio::spawn(server.run(listener, shutdown.clone()));
    Ok(SimHandle {
        addr,
        url: format!("http://{addr}"),
        shared,
        shutdown,
        kill,
        task: Some(task),
    })
}

impl SimHandle {
    /// A snapshot of the counters: requests served, prefix-cache query/hit tokens, running,
    /// waiting, KV usage…
    pub fn stats(&self) -> SimStats {
        self.shared.metrics.stats()
    }

    /// The latest recorded inference requests (at most `--record-requests`), oldest first.
    pub fn received(&self) -> Vec<ReceivedRequest> {
        self.shared.records.snapshot()
    }

    /// Changes the fault knobs at run time. Rates are clamped into 0–1 (NaN counts as 0).
    pub fn set_faults(&self, faults: Faults) {
        let clamp = |rate: f64| {
            if rate.is_nan() {
                0.0
            } else {
                rate.clamp(0.0, 1.0)
            }
        };
        self.shared.faults.set(Faults {
            fail_rate: clamp(faults.fail_rate),
            hang_rate: clamp(faults.hang_rate),
            die_mid_stream_rate: clamp(faults.die_mid_stream_rate),
            stall_mid_stream_rate: clamp(faults.stall_mid_stream_rate),
        });
    }

    pub fn faults(&self) -> Faults {
        self.shared.faults.get()
    }

    /// This engine's id (`remote_engine_id` in kv_transfer_params).
    pub fn engine_id(&self) -> &str {
        &self.shared.engine_id
    }

    pub fn config(&self) -> &SimConfig {
        &self.shared.config
    }

    /// Graceful stop: stop accepting, let in-flight requests and streams finish (within
    /// `--shutdown-grace-s`), stop the engine. Returns when all of that is done.
    pub async fn shutdown(mut self) {
        self.shutdown.cancel();
        self.join().await;
    }

    /// Abrupt stop, like a crashed instance: the listener is closed and every open connection
    /// dropped mid-request. Takes effect as soon as the simulator's task next runs (it does
    /// not wait); [`killed`](Self::killed) waits for it.
    pub fn kill(&self) {
        self.kill.cancel();
    }

    /// Kills the simulator and waits until its listener and connections are closed.
    pub async fn killed(mut self) {
        self.kill.cancel();
        self.join().await;
    }

    async fn join(&mut self) {
        let Some(task) = self.task.take() else {
            return;
        };
        match task.await {
            Ok(Ok(())) => {}
            Ok(Err(err)) => tracing::warn!(error = %err, "engine simulator failed"),
            Err(err) => tracing::warn!(error = %err, "engine simulator task failed"),
        }
    }
}

impl Drop for SimHandle {
    fn drop(&mut self) {
        self.kill.cancel();
    }
}
