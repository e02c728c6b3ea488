//! Serving: building the state behind the handlers, the accept loop (HTTP/1.1, like vLLM's
//! uvicorn), graceful shutdown, abrupt kill, and the in-process [`SimHandle`].

use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::service::TowerToHyperService;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tokio_util::task::AbortOnDropHandle;

use crate::api;
use crate::api::ResponseStore;
use crate::api::Shared;
use crate::cache::CacheEvent;
use crate::config::SimConfig;
use crate::driver::{EngineDriver, engine};
use crate::engine::Scheduler;
use crate::error::SimError;
use crate::faults::{FaultInjector, Faults};
use crate::kv_events::{KvEventsPublisher, QUEUE_BATCHES};
use crate::metrics::{Metrics, SimStats};
use crate::nixl::{Handoffs, SideChannel};
use crate::records::{ReceivedRequest, Recorder};

/// One simulated vLLM instance, ready to serve on a listener.
#[derive(Debug)]
pub struct SimServer {
    shared: Arc<Shared>,
    driver: EngineDriver,
    kill: CancellationToken,
    /// The engine's prefix-cache changes, for the KV-event publisher (with `--kv-events`).
    kv_batches: Option<mpsc::Receiver<Vec<CacheEvent>>>,
    kv_publisher: Option<KvEventsPublisher>,
    /// The NIXL side channel's listener, once bound.
    side_channel: Option<TcpListener>,
}

impl SimServer {
    /// Validates `config` and builds the engine (nothing runs until [`run`](Self::run)).
    pub fn new(config: SimConfig) -> Result<Self, SimError> {
        config.validate()?;
        let metrics = Arc::new(Metrics::default());
        let (sink, kv_batches) = match config.kv_events {
            Some(_) => {
                let (sink, batches) = mpsc::channel(QUEUE_BATCHES);
                (Some(sink), Some(batches))
            }
            None => (None, None),
        };
        let (client, driver) = engine(
            Scheduler::from_config(&config),
            Arc::clone(&metrics),
            config.time_scale,
            sink,
        );
        let engine_id = config
            .engine_id
            .clone()
            .unwrap_or_else(|| format!("switchyard-sim-{:016x}", fastrand::u64(..)));
        let tokenizer = match &config.tokenizer {
            Some(dir) => Some(Arc::new(switchyard_tokenize::EngineTokenizer::load(
                dir,
                switchyard_tokenize::DEFAULT_CACHE_BYTES,
            )?)),
            None => None,
        };
        let shared = Shared {
            tokenizer,
            engine_id,
            engine: client,
            metrics,
            faults: FaultInjector::new(config.faults(), config.seed),
            records: Recorder::new(config.record_requests),
            handoffs: Handoffs::new(
                config.kv_cache_blocks,
                std::time::Duration::try_from_secs_f64(config.kv_lease_s)
                    .unwrap_or(std::time::Duration::MAX),
            ),
            side_channel: OnceLock::new(),
            kv_events: OnceLock::new(),
            kv_control: Arc::default(),
            http: crate::handoff::http_client(),
            responses: ResponseStore::new(config.max_stored_responses),
            config,
        };
        Ok(Self {
            shared: Arc::new(shared),
            driver,
            kill: CancellationToken::new(),
            kv_batches,
            kv_publisher: None,
            side_channel: None,
        })
    }

    /// Binds the NIXL side channel (`--side-channel-host`, `--side-channel-port`), where
    /// decoders ask about this engine's hand-offs, so that its port is known before serving
    /// starts. [`run`](Self::run) does it if not done yet.
    pub async fn bind_side_channel(&mut self) -> Result<(), SimError> {
        if self.side_channel.is_some() {
            return Ok(());
        }
        let config = &self.shared.config;
        let (host, port) = (config.side_channel_host.as_str(), config.side_channel_port);
        let listener = TcpListener::bind((host.trim_matches(['[', ']']), port))
            .await
            .map_err(|error| SimError::SideChannelBind {
                host: host.to_owned(),
                port,
                error,
            })?;
        let addr = listener.local_addr().map_err(SimError::Io)?;
        let _ = self.shared.side_channel.set(SideChannel {
            host: host.to_owned(),
            addr,
        });
        self.side_channel = Some(listener);
        Ok(())
    }

    /// Binds the KV-event sockets (with `--kv-events`; otherwise does nothing), so that their
    /// endpoints are known before serving starts. [`run`](Self::run) does it if not done yet.
    pub async fn bind_kv_events(&mut self) -> Result<(), SimError> {
        let config = &self.shared.config;
        let Some(endpoint) = &config.kv_events else {
            return Ok(());
        };
        if self.kv_publisher.is_some() {
            return Ok(());
        }
        let publisher = KvEventsPublisher::bind(
            endpoint,
            config.kv_events_replay.as_deref(),
            &config.kv_events_topic,
            config.kv_events_format,
            config.kv_events_replay_buffer,
        )
        .await?;
        let info = publisher.info();
        tracing::info!(
            endpoint = %info.endpoint,
            replay = info.replay_endpoint.as_deref().unwrap_or("-"),
            topic = %info.topic,
            format = ?info.format,
            "publishing KV-cache events"
        );
        let _ = self.shared.kv_events.set(info.clone());
        self.kv_publisher = Some(publisher);
        Ok(())
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
        mut self,
        listener: TcpListener,
        shutdown: CancellationToken,
    ) -> Result<(), SimError> {
        self.bind_kv_events().await?;
        self.bind_side_channel().await?;
        let SimServer {
            shared,
            driver,
            kill,
            kv_batches,
            kv_publisher,
            side_channel,
        } = self;
        let addr = listener.local_addr().map_err(SimError::Io)?;
        // LMCache PD receiver: its alloc ports live as long as the server.
        let _receiver = crate::lmcache_pd::bind_receiver(
            &shared.engine,
            &shared.metrics,
            &shared.config.lmcache_receiver_host,
            &shared.config.lmcache_receiver_alloc_ports,
        )
        .await
        .map_err(|why| SimError::Io(std::io::Error::other(why)))?;
        let config = &shared.config;
        let side_addr = shared.side_channel.get().map(|side| side.addr);
        tracing::info!(
            %addr,
            side_channel = ?side_addr,
            model = %config.served_model_name,
            role = %config.role,
            time_scale = config.time_scale,
            engine_id = %shared.engine_id,
            "engine simulator listening"
        );
        // The side channel lives until the HTTP connections are drained (a decoder may still
        // pull what a finished prefill handed off), and dies with a kill.
        let side_stop = CancellationToken::new();
        let side_task = side_channel.map(|listener| {
            let (stop, kill) = (side_stop.clone(), kill.clone());
            let app = api::side_channel(Arc::clone(&shared));
            AbortOnDropHandle::new(tokio::spawn(async move {
                serve_connections(listener, app, &stop, &kill, Duration::ZERO).await;
            }))
        });

        let engine_stop = CancellationToken::new();
        let engine_task = AbortOnDropHandle::new(tokio::spawn(driver.run(engine_stop.clone())));
        let publisher_task = match (kv_publisher, kv_batches) {
            (Some(publisher), Some(batches)) => {
                Some(AbortOnDropHandle::new(tokio::spawn(publisher.run(
                    batches,
                    Arc::clone(&shared.kv_control),
                    Arc::clone(&shared.metrics),
                    engine_stop.clone(),
                ))))
            }
            _ => None,
        };
        let grace = Duration::try_from_secs_f64(config.shutdown_grace_s).unwrap_or(Duration::MAX);
        let app = api::router(Arc::clone(&shared));
        serve_connections(listener, app, &shutdown, &kill, grace).await;
        side_stop.cancel();
        drop(side_task);

        // Connections are closed: nothing can use the engine any more.
        engine_stop.cancel();
        if let Err(err) = engine_task.await
            && err.is_panic()
        {
            return Err(SimError::EnginePanicked);
        }
        if let Some(publisher) = publisher_task {
            let _ = publisher.await;
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
    let mut server = SimServer::new(config)?;
    server.bind_kv_events().await?;
    server.bind_side_channel().await?;
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
            error_mid_stream_rate: clamp(faults.error_mid_stream_rate),
            tokenize_fail_rate: clamp(faults.tokenize_fail_rate),
            tokenize_hang_rate: clamp(faults.tokenize_hang_rate),
            kv_pull_fail_rate: clamp(faults.kv_pull_fail_rate),
        });
    }

    pub fn faults(&self) -> Faults {
        self.shared.faults.get()
    }

    /// This engine's id (`remote_engine_id` in kv_transfer_params).
    pub fn engine_id(&self) -> &str {
        &self.shared.engine_id
    }

    /// Where the NIXL side channel listens (`remote_port` in kv_transfer_params).
    pub fn side_channel_addr(&self) -> Option<SocketAddr> {
        self.shared.side_channel.get().map(|side| side.addr)
    }

    /// Responses API responses this instance stores now.
    pub fn stored_responses(&self) -> usize {
        self.shared.responses.len()
    }

    pub fn config(&self) -> &SimConfig {
        &self.shared.config
    }

    /// The KV-event PUB endpoint as bound (`tcp://127.0.0.1:PORT`), with `--kv-events`.
    pub fn kv_events_endpoint(&self) -> Option<String> {
        self.shared
            .kv_events
            .get()
            .map(|info| info.endpoint.clone())
    }

    /// The KV-event replay endpoint as bound, with `--kv-events-replay`.
    pub fn kv_events_replay_endpoint(&self) -> Option<String> {
        self.shared
            .kv_events
            .get()
            .and_then(|info| info.replay_endpoint.clone())
    }

    /// Test control: the next `batches` KV-event batches reach the replay buffer but not the
    /// wire (subscribers see a gap).
    pub fn drop_kv_event_batches(&self, batches: u64) {
        self.shared.kv_control.set(None, Some(batches));
    }

    /// Test control: stop (or resume) publishing KV events and answering replay requests,
    /// like a stuck publisher thread. Batches queue meanwhile and go out in order on resume.
    pub fn stall_kv_events(&self, stalled: bool) {
        self.shared.kv_control.set(Some(stalled), None);
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
