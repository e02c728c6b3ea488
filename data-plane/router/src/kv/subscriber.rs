//! One subscriber per instance: follows its KV-event publisher (ZMQ SUB) in sequence order into
//! the variant's index, repairs gaps through the replay socket (ZMQ DEALER to vLLM's ROUTER),
//! and watches that the publisher is alive.
//!
//! - **Start**: subscribe, then ask the replay socket for everything from sequence 0, so the
//!   index learns what the engine cached before this router came (as far as the engine's replay
//!   buffer reaches). Live batches wait until that answer ends.
//! - **In order**: batch `expected` is applied; an older one is a duplicate (its timestamp is
//!   not newer than the last applied) or, if newer, a restarted engine (below).
//! - **Restart**: vLLM's batches carry no run id, so a restart is inferred from what can be
//!   seen: a sequence number that goes backwards with a newer timestamp, or the publisher's
//!   connection lost and made again (the ZMQ library reports both). Either drops the
//!   instance's entries and resynchronises from the start of the engine's replay buffer
//!   (replay from 0), holding live batches meanwhile, so a new run's first batches missed live
//!   are fetched and the old run's blocks never linger. The control plane's health checks are
//!   the third signal: an instance marked unhealthy leaves the routing table, its subscriber
//!   stops and its entries go; when it is healthy again a new subscriber starts from 0.
//! - **Undecodable batch**: skipped by its sequence number as if it were empty (no gap, no
//!   rebuild, no replay), counted per instance (`switchyard_kv_undecodable_batches_total`) and
//!   logged once per subscriber. Inside a readable batch, an unreadable event costs only that
//!   event (`switchyard_kv_malformed_events_total`).
//! - **Gap** (a newer sequence than `expected`): live batches wait while the replay socket is
//!   asked for the missing ones. If the answer does not cover the gap, does not come within
//!   `reply_timeout`, or there is no replay socket, the instance's entries are dropped
//!   (a missed `BlockRemoved` would otherwise leave blocks it no longer has) and it is followed
//!   from the next batch: until it stores blocks again it scores 0 matched blocks, so its
//!   requests route by load.
//! - **Liveness**: every `probe_interval` the replay socket is asked for batches from
//!   `expected` (this also delivers a lost last batch). `stale_after_failures` probes in a row
//!   without an answer mark the instance stale: its entries are kept but score nothing until an
//!   answer comes. Without a replay socket a silent engine cannot be told from an idle one; the
//!   control plane's health checks then decide.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use bytes::Bytes;
use switchyard_shared::{InstanceId, KvEventsEndpoints};
use tokio_stream::StreamExt;
use tokio_util::sync::CancellationToken;
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

use switchyard_kv::index::{Freshness, IndexCounters, IndexSettings, VariantIndex};
use switchyard_kv::wire::{EventBatch, decode_batch};

use super::frame_guard;

/// The replay stream's end marker: sequence -1.
const END_OF_REPLAY: [u8; 8] = [0xff; 8];

/// How a subscriber follows its publisher.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SubscriberSettings {
    /// How often the replay socket is asked for anything newer (liveness and tail losses).
    pub probe_interval: Duration,
    /// How long an answer from the replay socket (or a connection to it) may take.
    pub reply_timeout: Duration,
    /// Probes in a row without an answer before the instance is marked stale.
    pub stale_after_failures: u32,
    /// Live batches held while a gap is being repaired; beyond, the instance is rebuilt.
    pub max_held_batches: usize,
    /// Wait between attempts to connect to a publisher that is not up.
    pub reconnect_delay: Duration,
}

impl Default for SubscriberSettings {
    fn default() -> Self {
        Self {
            probe_interval: Duration::from_secs(1),
            reply_timeout: Duration::from_secs(1),
            stale_after_failures: 2,
            max_held_batches: 10_000,
            reconnect_delay: Duration::from_millis(500),
        }
    }
}

/// What one subscriber writes into.
#[derive(Debug, Clone)]
pub struct Target {
    pub instance: InstanceId,
    /// A data-parallel engine's rank this stream is (its batches must say so); None: not
    /// data parallel.
    pub rank: Option<u32>,
    pub index: Arc<VariantIndex>,
    pub index_settings: IndexSettings,
    pub counters: Arc<IndexCounters>,
}

/// The sequence-following state, apart from the sockets (unit-tested alone).
#[derive(Debug)]
struct Follower {
    target: Target,
    expected: Option<u64>,
    last_ts: f64,
    /// A replay answer is awaited before live batches may be applied.
    holding: bool,
    /// That answer is a catch-up from the buffer's start (start-up, resync), not a gap's.
    catching_up: bool,
    /// The highest undecodable batch counted (a replay re-sends it).
    last_undecodable: Option<u64>,
    /// An undecodable batch was logged (at warn level: once).
    logged_undecodable: bool,
    held: VecDeque<(u64, EventBatch)>,
    max_held: usize,
}

/// What the caller must do after offering a live batch.
#[derive(Debug, PartialEq, Eq)]
enum Next {
    Nothing,
    /// Ask the replay socket for batches from this sequence on.
    Replay(u64),
    /// The engine restarted: ask for its whole buffer, abandoning any request in flight.
    Resync,
}

impl Follower {
    fn new(target: Target, max_held: usize) -> Self {
        Self {
            target,
            expected: None,
            last_ts: f64::NEG_INFINITY,
            holding: false,
            catching_up: false,
            last_undecodable: None,
            logged_undecodable: false,
            held: VecDeque::new(),
            max_held,
        }
    }

    /// Drops the instance's entries and waits for a replay from the buffer's start. Batches
    /// held until now are let go: the replay has them if they are the engine's current run.
    fn resync(&mut self, why: &str) {
        self.rebuild(why);
        self.held.clear();
        self.holding = true;
        self.catching_up = true;
        self.last_undecodable = None;
    }

    /// A batch (live or replayed) that could not be decoded: counted once per sequence
    /// number, logged once; the caller then offers it as an empty batch, so its sequence
    /// number is used up and nothing else changes.
    fn undecodable(&mut self, seq: u64, error: &dyn std::fmt::Display) -> EventBatch {
        if self.last_undecodable.is_none_or(|last| seq > last) {
            self.last_undecodable = Some(seq);
            self.target.index.count_undecodable(&self.target.instance);
            if self.logged_undecodable {
                tracing::debug!(instance = %self.target.instance, seq, %error, "skipped an undecodable KV event batch");
            } else {
                self.logged_undecodable = true;
                tracing::warn!(instance = %self.target.instance, seq, %error, "skipped an undecodable KV event batch (counted in switchyard_kv_undecodable_batches_total; further ones are logged at debug level)");
            }
        }
        EventBatch {
            ts: self.last_ts,
            events: Vec::new(),
            data_parallel_rank: None,
        }
    }

    fn apply(&mut self, seq: u64, batch: &EventBatch) {
        // A data-parallel rank's socket publishing another rank's batches (a registered size
        // larger than the engine's, meeting a neighbour on port + r): not this rank's cache.
        if let (Some(rank), Some(said)) = (self.target.rank, batch.data_parallel_rank)
            && said != i64::from(rank)
        {
            let error = format!(
                "the batch says data_parallel_rank {said}, but this socket is rank {rank}'s \
                 (is KvEventsDataParallelSize larger than the engine's?)"
            );
            let empty = self.undecodable(seq, &error);
            self.expected = Some(seq + 1);
            self.last_ts = self.last_ts.max(empty.ts);
            return;
        }
        let target = &self.target;
        target.index.apply(
            &target.instance,
            batch,
            &target.index_settings,
            &target.counters,
        );
        self.expected = Some(seq + 1);
        // A timestamp that is not a number of seconds would blind the restart rule for good.
        if batch.ts.is_finite() {
            self.last_ts = self.last_ts.max(batch.ts);
        }
    }

    fn rebuild(&mut self, why: &str) {
        tracing::warn!(instance = %self.target.instance, why, "dropping the instance's KV entries; following its events from here");
        self.target.index.clear(&self.target.instance, true);
        self.target
            .counters
            .rebuilds
            .fetch_add(1, Ordering::Relaxed);
        self.expected = None;
    }

    /// A batch from the replay socket.
    fn offer_replayed(&mut self, seq: u64, batch: &EventBatch) {
        match self.expected {
            None => self.apply(seq, batch),
            Some(expected) if seq == expected => {
                self.apply(seq, batch);
                // A catch-up from the buffer's start fills no gap.
                self.target.counters.gaps_repaired.fetch_add(
                    u64::from(self.holding && !self.catching_up),
                    Ordering::Relaxed,
                );
            }
            Some(expected) if seq < expected => {}
            Some(_) => {
                // The engine's buffer no longer has what we missed.
                self.rebuild("the replay buffer does not reach back to the gap");
                self.apply(seq, batch);
            }
        }
    }

    /// A live batch. `can_replay`: a replay socket exists.
    fn offer_live(&mut self, seq: u64, batch: EventBatch, can_replay: bool) -> Next {
        if self.holding {
            if self.held.len() >= self.max_held {
                self.held.clear();
                self.holding = false;
                self.rebuild("too many batches arrived while a gap was being repaired");
                self.apply(seq, &batch);
                return Next::Nothing;
            }
            self.held.push_back((seq, batch));
            return Next::Nothing;
        }
        match self.expected {
            None => self.apply(seq, &batch),
            Some(expected) if seq == expected => self.apply(seq, &batch),
            Some(expected) if seq < expected => {
                if batch.ts > self.last_ts {
                    let why = "the engine restarted (its sequence numbers began again)";
                    if can_replay {
                        self.resync(why);
                        self.held.push_back((seq, batch));
                        return Next::Resync;
                    }
                    self.rebuild(why);
                    self.apply(seq, &batch);
                }
            }
            Some(expected) => {
                if can_replay {
                    self.holding = true;
                    self.held.push_back((seq, batch));
                    return Next::Replay(expected);
                }
                self.rebuild("a sequence gap and no replay socket");
                self.apply(seq, &batch);
            }
        }
        Next::Nothing
    }

    /// The replay answer ended (or will not come): apply what was held, rebuilding if a gap
    /// remains.
    fn release_held(&mut self) {
        self.holding = false;
        self.catching_up = false;
        while let Some((seq, batch)) = self.held.pop_front() {
            match self.expected {
                Some(expected) if seq > expected => {
                    self.rebuild("replay did not fill the gap");
                    self.apply(seq, &batch);
                }
                _ => {
                    let next = self.offer_live(seq, batch, false);
                    debug_assert_eq!(next, Next::Nothing);
                }
            }
        }
    }
}

fn message_frames(message: ZmqMessage) -> Vec<Bytes> {
    message.into_vec()
}

fn sequence(frame: &[u8]) -> Option<u64> {
    frame.try_into().ok().map(u64::from_be_bytes)
}

/// Failed connection attempts to a publisher before a warning (with the 500 ms default delay,
/// about 10 s): a publisher that never listens is most likely configured to connect out.
const UNREACHABLE_WARNING_ATTEMPTS: u32 = 20;

/// Follows one instance's events until `stop`. Drops nothing from the index on exit: the
/// caller decides (an instance that left is cleared by the caller).
pub async fn run(
    target: Target,
    endpoints: KvEventsEndpoints,
    settings: SubscriberSettings,
    stop: CancellationToken,
) {
    let instance = target.instance.clone();
    // A new subscription starts from nothing: whatever an earlier one of this instance left
    // (a write that raced its stop) is not this run's.
    target.index.clear(&instance, true);
    // The ZMQ sockets dial the engine through a frame guard (an engine announcing a huge
    // frame would otherwise abort the router); the guards live as long as this subscription.
    let publisher_guard = frame_guard::start(&endpoints.publisher, instance.as_str()).await;
    let publisher = publisher_guard
        .as_ref()
        .map_or(endpoints.publisher.clone(), |guard| guard.endpoint.clone());
    let replay_guard = match &endpoints.replay {
        Some(replay) => frame_guard::start(replay, instance.as_str()).await,
        None => None,
    };
    let replay_endpoint = match &replay_guard {
        Some(guard) => Some(guard.endpoint.clone()),
        None => endpoints.replay.clone(),
    };
    let mut attempts = 0u32;
    let (mut sub, mut monitor) = loop {
        attempts = attempts.saturating_add(1);
        if attempts == UNREACHABLE_WARNING_ATTEMPTS {
            tracing::warn!(%instance, endpoint = %endpoints.publisher, "no KV event publisher accepts connections there yet (still trying): the engine may still be starting, or it is configured to connect out: vLLM listens only on a wildcard or ipc endpoint (\"endpoint\":\"tcp://*:5557\"); given a specific address it connects out to it instead");
        }
        let mut sub = zeromq::SubSocket::new();
        let monitor = sub.monitor();
        let connected = tokio::select! {
            () = stop.cancelled() => return,
            connected = tokio::time::timeout(settings.reply_timeout, sub.connect(&publisher)) => connected,
        };
        match connected {
            Ok(Ok(())) => match sub.subscribe("").await {
                Ok(()) => break (sub, monitor),
                Err(err) => tracing::debug!(%instance, error = %err, "cannot subscribe"),
            },
            Ok(Err(err)) => {
                tracing::debug!(%instance, endpoint = %endpoints.publisher, error = %err, "KV event publisher not reachable yet");
            }
            Err(_) => tracing::debug!(%instance, "KV event publisher connection timed out"),
        }
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(settings.reconnect_delay) => {}
        }
    };
    tracing::info!(%instance, endpoint = %endpoints.publisher, replay = endpoints.replay.as_deref().unwrap_or("-"), "following KV events");

    let can_replay = endpoints.replay.is_some();
    let mut follower = Follower::new(target.clone(), settings.max_held_batches);
    let mut replay = Replay {
        endpoint: replay_endpoint,
        dealer: None,
        sent_at: None,
        last_probe: Instant::now(),
        failures: 0,
    };
    if can_replay {
        // Learn what the engine cached before we came.
        follower.holding = true;
        follower.catching_up = true;
        replay.request(0, &settings).await;
    }
    // The publisher's connection was lost: when it is made again, the engine may be a new run.
    let mut connection_lost = false;
    let mut monitor_open = true;
    let mut housekeeping = tokio::time::interval(Duration::from_millis(50));
    loop {
        tokio::select! {
            // A stopped subscriber writes nothing more: the instance was cleared after it was
            // told to stop, and a batch applied now would come back as a leftover.
            biased;
            () = stop.cancelled() => break,
            event = monitor.next(), if monitor_open => match event {
                Some(zeromq::SocketEvent::Disconnected(_)) => {
                    tracing::info!(%instance, "KV event publisher connection lost");
                    connection_lost = true;
                }
                Some(zeromq::SocketEvent::Connected(..)) if connection_lost => {
                    connection_lost = false;
                    let why = "the KV event publisher's connection was made again (the engine may have restarted)";
                    if can_replay {
                        follower.resync(why);
                        replay.restart(0, &settings).await;
                    } else {
                        follower.rebuild(why);
                    }
                }
                Some(_) => {}
                // The socket dropped its monitor: the other signals remain.
                None => monitor_open = false,
            },
            received = sub.recv() => match received {
                Ok(message) => {
                    let frames = message_frames(message);
                    let n = frames.len();
                    let (Some(seq), Some(payload)) = (n.checked_sub(2).and_then(|i| sequence(&frames[i])), frames.last()) else {
                        tracing::debug!(%instance, frames = n, "ignored a malformed KV event message");
                        continue;
                    };
                    let batch = match decode_batch(payload) {
                        Ok(batch) => {
                            if target.index.freshness(&instance) == Some(Freshness::Stale) {
                                target.index.set_freshness(&instance, Freshness::Live);
                            }
                            batch
                        }
                        Err(err) => follower.undecodable(seq, &err),
                    };
                    match follower.offer_live(seq, batch, can_replay) {
                        Next::Replay(from) if replay.sent_at.is_none() => replay.request(from, &settings).await,
                        Next::Resync => replay.restart(0, &settings).await,
                        _ => {}
                    }
                }
                Err(err) => {
                    tracing::debug!(%instance, error = %err, "KV event subscription error");
                    tokio::time::sleep(settings.reconnect_delay.min(Duration::from_millis(100))).await;
                }
            },
            answer = replay.recv(), if replay.dealer.is_some() => match answer {
                Ok(frames) => {
                    let n = frames.len();
                    let (Some(seq_frame), Some(payload)) = (n.checked_sub(2).map(|i| &frames[i]), frames.last()) else {
                        continue;
                    };
                    if seq_frame.as_ref() == END_OF_REPLAY {
                        replay.answered();
                        if target.index.freshness(&instance) == Some(Freshness::Stale) {
                            tracing::info!(%instance, "KV events answer again");
                        }
                        target.index.set_freshness(&instance, Freshness::Live);
                        if follower.holding {
                            follower.release_held();
                        }
                        continue;
                    }
                    let Some(seq) = sequence(seq_frame) else { continue };
                    // The deadline is for silence: a long replay that keeps coming is not
                    // given up half way.
                    replay.progressed();
                    let batch = match decode_batch(payload) {
                        Ok(batch) => batch,
                        Err(err) => follower.undecodable(seq, &err),
                    };
                    follower.offer_replayed(seq, &batch);
                }
                Err(err) => {
                    tracing::debug!(%instance, error = %err, "KV event replay socket error");
                    replay.failed(&follower.target, &settings);
                    if follower.holding {
                        follower.release_held();
                    }
                }
            },
            _ = housekeeping.tick() => {
                if replay.timed_out(&settings) {
                    replay.failed(&follower.target, &settings);
                    if follower.holding {
                        follower.release_held();
                    }
                }
                if can_replay && replay.sent_at.is_none() && replay.last_probe.elapsed() >= settings.probe_interval {
                    replay.request(follower.expected.unwrap_or(0), &settings).await;
                }
            }
        }
    }
    tracing::debug!(%instance, "stopped following KV events");
}

/// The replay socket side: one request at a time on a DEALER; a fresh connection after a
/// failure (so a late answer to an abandoned request never arrives).
struct Replay {
    endpoint: Option<String>,
    dealer: Option<zeromq::DealerSocket>,
    sent_at: Option<Instant>,
    last_probe: Instant,
    failures: u32,
}

impl Replay {
    async fn request(&mut self, from: u64, settings: &SubscriberSettings) {
        let Some(endpoint) = &self.endpoint else {
            return;
        };
        self.last_probe = Instant::now();
        self.sent_at = Some(Instant::now());
        if self.dealer.is_none() {
            let mut dealer = zeromq::DealerSocket::new();
            match tokio::time::timeout(settings.reply_timeout, dealer.connect(endpoint)).await {
                Ok(Ok(())) => self.dealer = Some(dealer),
                _ => return, // counted as a failure when the reply times out
            }
        }
        let Some(dealer) = &mut self.dealer else {
            return;
        };
        let request = ZmqMessage::try_from(vec![
            Bytes::new(),
            Bytes::copy_from_slice(&from.to_be_bytes()),
        ]);
        let Ok(request) = request else { return };
        if !matches!(
            tokio::time::timeout(settings.reply_timeout, dealer.send(request)).await,
            Ok(Ok(()))
        ) {
            self.dealer = None;
        }
    }

    /// Abandons any request in flight (a fresh connection, so its late answer never arrives)
    /// and asks from `from`.
    async fn restart(&mut self, from: u64, settings: &SubscriberSettings) {
        self.dealer = None;
        self.sent_at = None;
        self.request(from, settings).await;
    }

    async fn recv(&mut self) -> zeromq::ZmqResult<Vec<Bytes>> {
        match &mut self.dealer {
            Some(dealer) => dealer.recv().await.map(message_frames),
            None => std::future::pending().await,
        }
    }

    /// A replayed batch arrived: the reply deadline starts again.
    fn progressed(&mut self) {
        if self.sent_at.is_some() {
            self.sent_at = Some(Instant::now());
        }
    }

    fn answered(&mut self) {
        self.sent_at = None;
        self.failures = 0;
    }

    fn timed_out(&self, settings: &SubscriberSettings) -> bool {
        self.sent_at
            .is_some_and(|sent| sent.elapsed() >= settings.reply_timeout)
    }

    fn failed(&mut self, target: &Target, settings: &SubscriberSettings) {
        self.sent_at = None;
        self.dealer = None;
        self.failures += 1;
        if self.failures == settings.stale_after_failures {
            tracing::warn!(instance = %target.instance, "KV events stopped answering; routing ignores its cache until they return");
            target
                .index
                .set_freshness(&target.instance, Freshness::Stale);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use switchyard_kv::wire::{BlockStored, EngineHash, KvEvent};

    fn target() -> Target {
        Target {
            rank: None,
            instance: InstanceId::new("a").unwrap(),
            index: Arc::new(VariantIndex::default()),
            index_settings: IndexSettings::default(),
            counters: Arc::new(IndexCounters::default()),
        }
    }

    /// Batch `seq` stores one block (tokens [seq, seq]) as the first block of a sequence.
    fn batch(seq: u64, ts: f64) -> EventBatch {
        EventBatch {
            ts,
            events: vec![KvEvent::BlockStored(BlockStored {
                block_hashes: vec![EngineHash(seq)],
                token_ids: vec![seq as u32, seq as u32],
                block_size: 2,
                ..BlockStored::default()
            })],
            data_parallel_rank: None,
        }
    }

    fn holds(follower: &Follower, seq: u64) -> bool {
        let index = &follower.target.index;
        let hashes = index.request_hashes(&[seq as u32, seq as u32]).unwrap();
        index.matched_blocks_of(&hashes, &follower.target.instance) == 1
    }

    #[test]
    fn in_order_duplicates_and_restarts() {
        let mut follower = Follower::new(target(), 10);
        assert_eq!(follower.offer_live(0, batch(0, 1.0), true), Next::Nothing);
        assert_eq!(follower.offer_live(1, batch(1, 2.0), true), Next::Nothing);
        // A duplicate (older timestamp) changes nothing.
        follower.offer_live(0, batch(0, 1.0), true);
        assert_eq!(follower.expected, Some(2));
        // A restarted engine: sequence 1 again, newer timestamp. Its batch 0 was missed live:
        // the whole buffer is asked for.
        assert_eq!(follower.offer_live(1, batch(8, 4.0), true), Next::Resync);
        assert!(
            !holds(&follower, 0) && !holds(&follower, 1),
            "the old run dropped"
        );
        assert!(!holds(&follower, 8), "held until the replay");
        // A reconnect while that replay is awaited: the held batch goes, the replay has it.
        follower.resync("reconnected");
        assert!(follower.held.is_empty() && follower.holding);
        follower.offer_replayed(0, &batch(7, 3.0));
        follower.offer_replayed(1, &batch(8, 4.0));
        follower.release_held();
        assert!(holds(&follower, 7) && holds(&follower, 8));
        assert_eq!(follower.expected, Some(2));
        assert_eq!(
            follower
                .target
                .counters
                .gaps_repaired
                .load(Ordering::Relaxed),
            0,
            "a catch-up is no gap"
        );
        // Without a replay socket the new run is followed from where it is.
        let mut follower = Follower::new(target(), 10);
        follower.offer_live(0, batch(0, 1.0), false);
        follower.offer_live(1, batch(1, 2.0), false);
        assert_eq!(follower.offer_live(0, batch(7, 3.0), false), Next::Nothing);
        assert!(!holds(&follower, 0) && holds(&follower, 7));
    }

    #[test]
    fn an_undecodable_batch_uses_up_its_sequence_number_and_nothing_else() {
        let mut follower = Follower::new(target(), 10);
        follower.offer_live(0, batch(0, 1.0), true);
        let empty = follower.undecodable(1, &"bad");
        assert_eq!(follower.offer_live(1, empty, true), Next::Nothing);
        assert_eq!(follower.offer_live(2, batch(2, 3.0), true), Next::Nothing);
        assert!(holds(&follower, 0) && holds(&follower, 2));
        // A replay re-sending it is not counted again.
        let again = follower.undecodable(1, &"bad");
        follower.offer_replayed(1, &again);
        let counters = follower.target.counters.as_ref();
        assert_eq!(counters.rebuilds.load(Ordering::Relaxed), 0);
        assert_eq!(
            follower.target.index.decode_failures()[0].1,
            1,
            "counted once"
        );
    }

    #[test]
    fn a_gap_holds_live_batches_until_replay_fills_it() {
        let mut follower = Follower::new(target(), 10);
        follower.offer_live(0, batch(0, 1.0), true);
        assert_eq!(follower.offer_live(3, batch(3, 4.0), true), Next::Replay(1));
        follower.offer_live(4, batch(4, 5.0), true);
        assert!(!holds(&follower, 3), "held, not applied");
        for seq in 1..=4 {
            follower.offer_replayed(seq, &batch(seq, seq as f64 + 1.0));
        }
        follower.release_held();
        assert_eq!(follower.expected, Some(5));
        assert!((0..=4).all(|seq| holds(&follower, seq)));
        assert_eq!(follower.target.counters.rebuilds.load(Ordering::Relaxed), 0);
        assert!(
            follower
                .target
                .counters
                .gaps_repaired
                .load(Ordering::Relaxed)
                > 0
        );
    }

    #[test]
    fn an_unfilled_gap_rebuilds() {
        let mut follower = Follower::new(target(), 10);
        follower.offer_live(0, batch(0, 1.0), true);
        assert_eq!(follower.offer_live(5, batch(5, 6.0), true), Next::Replay(1));
        // The replay buffer starts at 4: batches 1-3 are gone.
        follower.offer_replayed(4, &batch(4, 5.0));
        follower.release_held();
        assert!(!holds(&follower, 0));
        assert!(holds(&follower, 4) && holds(&follower, 5));
        assert_eq!(follower.target.counters.rebuilds.load(Ordering::Relaxed), 1);
        // No replay socket at all: a gap rebuilds at once.
        let mut follower = Follower::new(target(), 10);
        follower.offer_live(0, batch(0, 1.0), false);
        assert_eq!(follower.offer_live(2, batch(2, 3.0), false), Next::Nothing);
        assert!(!holds(&follower, 0) && holds(&follower, 2));
    }
}
