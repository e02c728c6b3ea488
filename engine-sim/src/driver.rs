//! Runs the [`Scheduler`] in real time: one task per engine, a virtual clock in model seconds
//! mapped onto the wall clock by `--time-scale`, and one event channel per request.
//!
//! Steps are not slept one by one at fine granularity (tokio timers have ~1 ms resolution,
//! and at `--time-scale 0.01` a step may last 0.1 ms). Instead each step advances the virtual
//! clock by its model duration and the driver sleeps until the wall instant that corresponds
//! to the step's end; when that instant has already passed it runs the next step at once, so
//! the engine catches up and its throughput stays true to the model. While idle, virtual time
//! follows the wall clock.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::mpsc::error::TryRecvError;
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;

use crate::cache::CacheEvent;
use crate::engine::{FinishedSeq, Rejected, Scheduler, SeqId, SeqSpec, Step, StepReport};
use crate::metrics::{EngineGauges, Metrics};

/// If the driver falls this far behind the wall clock (a stalled process), it stops catching
/// up and lets virtual time jump instead of running a long burst of back-to-back steps.
const MAX_LAG: Duration = Duration::from_millis(250);

/// What the engine tells a request's handler.
#[derive(Debug)]
pub(crate) enum EngineEvent {
    /// One output token, at the end of the step that produced it.
    Token,
    /// The request is done; its last token was the previous event.
    Finished(FinishedSeq),
    /// The engine refused the request.
    Rejected(Rejected),
}

#[derive(Debug, thiserror::Error)]
#[error("the engine has stopped")]
pub(crate) struct EngineStopped;

struct Submission {
    spec: SeqSpec,
    arrival: Instant,
    events: mpsc::UnboundedSender<EngineEvent>,
}

/// What handlers ask of the engine task.
enum Command {
    Submit(Submission),
    /// vLLM's `reset_prefix_cache`; answers whether it happened.
    ResetPrefixCache(oneshot::Sender<bool>),
    /// KV blocks pushed by a prefill engine (LMCache): cached as if computed here; answers
    /// how many were new.
    StorePushed {
        block_hashes: Vec<u64>,
        tokens: Vec<u32>,
        answer: oneshot::Sender<usize>,
    },
}

/// The handlers' side: submit a request, get its event stream.
#[derive(Debug, Clone)]
pub(crate) struct EngineClient {
    submissions: mpsc::UnboundedSender<Command>,
}

impl EngineClient {
    /// Queues a request that arrived at `arrival`. Dropping the receiver cancels it.
    pub(crate) fn submit(
        &self,
        spec: SeqSpec,
        arrival: Instant,
    ) -> Result<mpsc::UnboundedReceiver<EngineEvent>, EngineStopped> {
        let (events, receiver) = mpsc::unbounded_channel();
        self.submissions
            .send(Command::Submit(Submission {
                spec,
                arrival,
                events,
            }))
            .map_err(|_| EngineStopped)?;
        Ok(receiver)
    }

    /// Caches KV blocks another engine pushed here (LMCache's PD backend): `block_hashes`
    /// chained as this engine hashes prompts, `tokens` their tokens. Answers how many were new.
    pub(crate) async fn store_pushed(
        &self,
        block_hashes: Vec<u64>,
        tokens: Vec<u32>,
    ) -> Result<usize, EngineStopped> {
        let (answer, answered) = oneshot::channel();
        self.submissions
            .send(Command::StorePushed {
                block_hashes,
                tokens,
                answer,
            })
            .map_err(|_| EngineStopped)?;
        answered.await.map_err(|_| EngineStopped)
    }

    /// Empties the prefix cache unless a running request holds blocks (then false).
    pub(crate) async fn reset_prefix_cache(&self) -> Result<bool, EngineStopped> {
        let (answer, answered) = oneshot::channel();
        self.submissions
            .send(Command::ResetPrefixCache(answer))
            .map_err(|_| EngineStopped)?;
        answered.await.map_err(|_| EngineStopped)
    }
}

/// Where the engine sends its prefix-cache changes after each step (the KV-event publisher).
pub(crate) type CacheEventSink = mpsc::Sender<Vec<CacheEvent>>;

/// An engine that has not started yet; [`EngineDriver::run`] runs it until cancelled.
pub(crate) struct EngineDriver {
    scheduler: Scheduler,
    submissions: mpsc::UnboundedReceiver<Command>,
    cache_events: Option<CacheEventSink>,
    metrics: Arc<Metrics>,
    clock: Clock,
    live: HashMap<SeqId, LiveRequest>,
    next_id: SeqId,
}

impl std::fmt::Debug for EngineDriver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineDriver")
            .field("live", &self.live.len())
            .finish_non_exhaustive()
    }
}

struct LiveRequest {
    events: mpsc::UnboundedSender<EngineEvent>,
    arrival: Instant,
    last_token: Option<Instant>,
}

/// Maps virtual (model) seconds to wall-clock instants.
#[derive(Debug, Clone, Copy)]
struct Clock {
    origin: Instant,
    time_scale: f64,
}

impl Clock {
    fn virtual_now(self) -> f64 {
        self.origin.elapsed().as_secs_f64() / self.time_scale
    }

    fn instant_at(self, virtual_s: f64) -> Instant {
        let wall = Duration::try_from_secs_f64((virtual_s * self.time_scale).max(0.0))
            .unwrap_or(Duration::MAX);
        self.origin.checked_add(wall).unwrap_or_else(|| {
            Instant::now() + Duration::from_secs(365 * 24 * 3600) // far future
        })
    }

    /// A wall-clock duration in model seconds.
    fn model_seconds(self, wall: Duration) -> f64 {
        wall.as_secs_f64() / self.time_scale
    }
}

/// Creates an engine and the client handlers use to reach it. With `cache_events`, the
/// engine records its prefix-cache changes and sends them there after every step.
pub(crate) fn engine(
    mut scheduler: Scheduler,
    metrics: Arc<Metrics>,
    time_scale: f64,
    cache_events: Option<CacheEventSink>,
) -> (EngineClient, EngineDriver) {
    let (sender, receiver) = mpsc::unbounded_channel();
    scheduler.record_cache_events(cache_events.is_some());
    let driver = EngineDriver {
        scheduler,
        submissions: receiver,
        cache_events,
        metrics,
        clock: Clock {
            origin: Instant::now(),
            time_scale,
        },
        live: HashMap::new(),
        next_id: 0,
    };
    (
        EngineClient {
            submissions: sender,
        },
        driver,
    )
}

impl EngineDriver {
    /// Runs the step loop until `stop` is cancelled or every client is gone. Requests still
    /// queued or running then see their event channel close.
    pub(crate) async fn run(mut self, stop: CancellationToken) {
        let mut now_v = 0.0_f64;
        let mut busy = false;
        loop {
            if !self.take_submissions() {
                break;
            }
            self.reap_disconnected();
            let wall_v = self.clock.virtual_now();
            if !busy || wall_v - now_v > self.clock.model_seconds(MAX_LAG) {
                now_v = now_v.max(wall_v);
            }
            match self.scheduler.step(now_v) {
                Step::Ran(report) => {
                    // Admissions count as running while the step executes.
                    self.publish();
                    now_v = report.end_s();
                    let deadline = self.clock.instant_at(now_v);
                    if deadline > Instant::now() {
                        tokio::select! {
                            () = tokio::time::sleep_until(deadline.into()) => {}
                            () = stop.cancelled() => break,
                        }
                    } else {
                        // Behind schedule: run the next step now, but let handlers run too.
                        tokio::task::yield_now().await;
                    }
                    self.emit(report);
                    busy = true;
                }
                Step::WaitUntil(lands_at) => {
                    busy = false;
                    self.publish();
                    tokio::select! {
                        () = tokio::time::sleep_until(self.clock.instant_at(lands_at).into()) => {
                            now_v = now_v.max(lands_at);
                        }
                        command = self.submissions.recv() => match command {
                            Some(command) => self.handle(command),
                            None => break,
                        },
                        () = stop.cancelled() => break,
                    }
                }
                Step::Idle => {
                    busy = false;
                    self.publish();
                    tokio::select! {
                        command = self.submissions.recv() => match command {
                            Some(command) => self.handle(command),
                            None => break,
                        },
                        () = stop.cancelled() => break,
                    }
                }
            }
            self.publish();
            self.send_cache_events();
        }
        for id in self.live.keys().copied().collect::<Vec<_>>() {
            self.scheduler.abort(id);
        }
        self.live.clear();
        self.publish();
        tracing::debug!("engine stopped");
    }

    /// Queues every pending submission; false once all clients are gone and nothing is left.
    fn take_submissions(&mut self) -> bool {
        loop {
            match self.submissions.try_recv() {
                Ok(command) => self.handle(command),
                Err(TryRecvError::Empty) => return true,
                Err(TryRecvError::Disconnected) => return !self.live.is_empty(),
            }
        }
    }

    fn handle(&mut self, command: Command) {
        match command {
            Command::Submit(submission) => self.accept(submission),
            Command::ResetPrefixCache(answer) => {
                let reset = self.scheduler.reset_prefix_cache();
                self.send_cache_events();
                let _ = answer.send(reset);
            }
            Command::StorePushed {
                block_hashes,
                tokens,
                answer,
            } => {
                let stored = self.scheduler.store_pushed(&block_hashes, &tokens);
                self.send_cache_events();
                let _ = answer.send(stored);
            }
        }
    }

    /// Hands the step's prefix-cache changes to the publisher. Never waits: if its queue is
    /// full the changes are lost (counted), as a stalled vLLM publisher loses them.
    fn send_cache_events(&mut self) {
        let Some(sink) = &self.cache_events else {
            return;
        };
        let events = self.scheduler.take_cache_events();
        if events.is_empty() {
            return;
        }
        if sink.try_send(events).is_err() {
            Metrics::increment(&self.metrics.kv_event_batches_lost);
        }
    }

    fn accept(&mut self, submission: Submission) {
        let id = self.next_id;
        self.next_id += 1;
        match self.scheduler.add(id, submission.spec) {
            Ok(()) => {
                self.live.insert(
                    id,
                    LiveRequest {
                        events: submission.events,
                        arrival: submission.arrival,
                        last_token: None,
                    },
                );
            }
            Err(rejected) => {
                let _ = submission.events.send(EngineEvent::Rejected(rejected));
            }
        }
    }

    /// Aborts requests whose handler dropped its receiver (client disconnected).
    fn reap_disconnected(&mut self) {
        let gone: Vec<SeqId> = self
            .live
            .iter()
            .filter(|(_, request)| request.events.is_closed())
            .map(|(id, _)| *id)
            .collect();
        for id in gone {
            self.abort(id);
        }
    }

    fn abort(&mut self, id: SeqId) {
        self.live.remove(&id);
        if self.scheduler.abort(id) {
            Metrics::increment(&self.metrics.requests_aborted);
            tracing::debug!(request = id, "client went away, request aborted");
        }
    }

    /// Delivers a step's tokens and completions (at the step's end) and records latencies.
    fn emit(&mut self, report: StepReport) {
        let now = Instant::now();
        let mut gone = Vec::new();
        for id in &report.tokens {
            let Some(request) = self.live.get_mut(id) else {
                continue;
            };
            match request.last_token {
                None => self
                    .metrics
                    .time_to_first_token
                    .observe(self.clock.model_seconds(now - request.arrival)),
                Some(last) => self
                    .metrics
                    .inter_token_latency
                    .observe(self.clock.model_seconds(now - last)),
            }
            request.last_token = Some(now);
            if request.events.send(EngineEvent::Token).is_err() {
                gone.push(*id);
            }
        }
        for finished in report.finished {
            let Some(request) = self.live.remove(&finished.id) else {
                continue;
            };
            self.metrics
                .e2e_request_latency
                .observe(self.clock.model_seconds(now - request.arrival));
            Metrics::increment(&self.metrics.requests_completed);
            let _ = request.events.send(EngineEvent::Finished(finished));
        }
        for id in gone {
            if self.live.contains_key(&id) {
                self.abort(id);
            }
        }
    }

    fn publish(&self) {
        self.metrics.publish(EngineGauges {
            running: self.scheduler.num_running(),
            waiting: self.scheduler.num_waiting(),
            kv_cache_usage: self.scheduler.cache().usage(),
            cached_blocks: self.scheduler.cache().cached_blocks(),
            counters: self.scheduler.counters(),
        });
    }
}
