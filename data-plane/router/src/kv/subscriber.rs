//! One subscriber per instance: follows its KV-event publisher (ZMQ SUB) in sequence order into
//! the variant's index, repairs gaps through the replay socket (ZMQ DEALER to vLLM's ROUTER),
//! and watches that the publisher is alive.
//!
//! - **Start**: subscribe, then ask the replay socket for everything from sequence 0, so the
//!   index learns what the engine cached before this router came (as far as the engine's replay
//!   buffer reaches). Live batches wait until that answer ends.
//! - **In order**: batch `expected` is applied; an older one is a duplicate (its timestamp is
//!   not newer than the last applied) or, if newer, a restarted engine (its entries are dropped
//!   and it is followed from there).
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
use tokio_util::sync::CancellationToken;
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

use switchyard_kv::index::{Freshness, IndexCounters, IndexSettings, VariantIndex};
use switchyard_kv::wire::{EventBatch, decode_batch};

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
    held: VecDeque<(u64, EventBatch)>,
    max_held: usize,
}

/// What the caller must do after offering a live batch.
#[derive(Debug, PartialEq, Eq)]
enum Next {
    Nothing,
    /// Ask the replay socket for batches from this sequence on.
    Replay(u64),
}

impl Follower {
    fn new(target: Target, max_held: usize) -> Self {
        Self {
            target,
            expected: None,
            last_ts: f64::NEG_INFINITY,
            holding: false,
            held: VecDeque::new(),
            max_held,
        }
    }

    fn apply(&mut self, seq: u64, batch: &EventBatch) {
        let target = &self.target;
        target.index.apply(
            &target.instance,
            batch,
            &target.index_settings,
            &target.counters,
        );
        self.expected = Some(seq + 1);
        self.last_ts = self.last_ts.max(batch.ts);
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
                self.target
                    .counters
                    .gaps_repaired
                    .fetch_add(u64::from(self.holding), Ordering::Relaxed);
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
                    self.rebuild("the engine restarted (its sequence numbers began again)");
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

/// Follows one instance's events until `stop`. Drops nothing from the index on exit: the
/// caller decides (an instance that left is cleared by the caller).
pub async fn run(
    target: Target,
    endpoints: KvEventsEndpoints,
    settings: SubscriberSettings,
    stop: CancellationToken,
) {
    let instance = target.instance.clone();
    let mut sub = loop {
        let mut sub = zeromq::SubSocket::new();
        let connected = tokio::select! {
            () = stop.cancelled() => return,
            connected = tokio::time::timeout(settings.reply_timeout, sub.connect(&endpoints.publisher)) => connected,
        };
        match connected {
            Ok(Ok(())) => match sub.subscribe("").await {
                Ok(()) => break sub,
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
        endpoint: endpoints.replay.clone(),
        dealer: None,
        sent_at: None,
        last_probe: Instant::now(),
        failures: 0,
    };
    if can_replay {
        // Learn what the engine cached before we came.
        follower.holding = true;
        replay.request(0, &settings).await;
    }
    let mut housekeeping = tokio::time::interval(Duration::from_millis(50));
    loop {
        tokio::select! {
            () = stop.cancelled() => break,
            received = sub.recv() => match received {
                Ok(message) => {
                    let frames = message_frames(message);
                    let n = frames.len();
                    let (Some(seq), Some(payload)) = (n.checked_sub(2).and_then(|i| sequence(&frames[i])), frames.last()) else {
                        tracing::debug!(%instance, frames = n, "ignored a malformed KV event message");
                        continue;
                    };
                    match decode_batch(payload) {
                        Ok(batch) => {
                            if target.index.freshness(&instance) == Some(Freshness::Stale) {
                                target.index.set_freshness(&instance, Freshness::Live);
                            }
                            if let Next::Replay(from) = follower.offer_live(seq, batch, can_replay)
                                && replay.sent_at.is_none()
                            {
                                replay.request(from, &settings).await;
                            }
                        }
                        Err(err) => {
                            tracing::warn!(%instance, seq, error = %err, "unreadable KV event batch");
                            follower.rebuild("an unreadable batch");
                        }
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
                    match decode_batch(payload) {
                        Ok(batch) => {
                            // The deadline is for silence: a long replay that keeps coming
                            // is not given up half way.
                            replay.progressed();
                            follower.offer_replayed(seq, &batch)
                        }
                        Err(err) => {
                            tracing::warn!(%instance, seq, error = %err, "unreadable replayed KV event batch");
                            follower.rebuild("an unreadable replayed batch");
                        }
                    }
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
        // A restarted engine: sequence 0 again, newer timestamp.
        follower.offer_live(0, batch(7, 3.0), true);
        assert_eq!(follower.expected, Some(1));
        assert!(!holds(&follower, 1), "entries of the old run dropped");
        assert!(holds(&follower, 7));
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
