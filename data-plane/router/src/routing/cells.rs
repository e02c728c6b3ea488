//! What the router keeps per instance beyond a table's life: live load, local ejection, the
//! `/tokenize` pause, and the bounded-load memories (keys sent to the instance, recent sends,
//! copies placed, placements to announce) and per-variant request windows. Shared by every table that contains the instance,
//! so counts stay exact across membership and config changes; lock-free (atomics).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};

use switchyard_shared::InstanceKey;

use crate::observe::labels::{MIGRATION_OUTCOMES, RouteLabel, UpstreamError};

/// Live counters of one instance, shared by every table that contains it.
#[derive(Debug, Default)]
pub struct InstanceCell {
    /// Requests this router has in flight on the instance (exact).
    pub local: AtomicU32,
    /// Requests every other router has in flight (from the control plane).
    pub remote: AtomicU32,
    /// Consecutive connection failures.
    pub failures: AtomicU32,
    /// Unix ms until which the instance is ejected locally (0: not ejected).
    pub ejected_until_ms: AtomicU64,
    /// KV_AWARE: whether the instance may be asked to tokenize (paused after failures).
    pub tokenize_backoff: TokenizeBackoff,
    /// Requests sent, by `RouteLabel`.
    pub requests: [AtomicU64; RouteLabel::ALL.len()],
    /// Failed requests, by `UpstreamError`.
    pub upstream_errors: [AtomicU64; UpstreamError::ALL.len()],
    /// Streamed answers of this instance that broke on a variant with a MigrationLimit, by
    /// what became of them (`MIGRATION_OUTCOMES`).
    pub migrations: [AtomicU64; MIGRATION_OUTCOMES.len()],
    /// PREFIX_AWARE keys sent to the instance lately, by this router or (announced through
    /// the control plane) by others (bounded loads).
    pub spills: SpillMemory,
    /// Keys this router placed on the instance that it had not sent there lately, for the
    /// control plane to pass on to the other routers ([`Announcements`]).
    pub announced: Announcements,
    /// Bounded PREFIX_AWARE: requests this router sent to the instance lately, halved every
    /// window of the variant's requests ([`SendWindow`]).
    pub recent: AtomicU32,
    /// Bounded PREFIX_AWARE: new copies of keys placed on the instance lately (by this
    /// router, or by others as announced), halved like `recent`. Each is a miss of a whole
    /// prefix: a new copy goes where the fewest were placed, so those prefills spread.
    pub copies: AtomicU32,
    /// Bounded PREFIX_AWARE: whether a further copy (of a key another instance of the variant
    /// held) was placed on the instance lately, by this router or by another as announced:
    /// [`FURTHER_NOW`] in the variant's current window of requests, [`FURTHER_BEFORE`] in the
    /// one before ([`age_further`]). While any instance of the variant has either, no key is
    /// relieved, so a copy another router announced holds this router back for at least one
    /// whole window of its own.
    pub further: AtomicU32,
    /// MaxInFlightPerInstance: the flow-control queue of the instance's variant, told when a
    /// slot frees here (set by the first request that waits for the variant).
    pub waker: OnceLock<Weak<dyn SlotWaker>>,
    /// A data-parallel engine: requests this router has in flight per rank (those it sent
    /// with `X-data-parallel-rank`).
    pub rank_load: RankLoad,
    /// LMCACHE_PD: prompt tokens of the hand-offs this router has in flight to this decoder
    /// (prefilled into its PD buffer, not yet taken by a decode), against its receiver's
    /// BufferTokens.
    pub handoff_tokens: AtomicU64,
}

/// Requests in flight per data-parallel rank (ranks are below
/// `switchyard_shared::MAX_DATA_PARALLEL_SIZE`; the vector grows to the highest one sent to).
#[derive(Debug, Default)]
pub struct RankLoad(Mutex<Vec<u32>>);

impl RankLoad {
    fn counts(&self) -> std::sync::MutexGuard<'_, Vec<u32>> {
        self.0.lock().unwrap_or_else(|poison| poison.into_inner())
    }

    pub fn add(&self, rank: u32) {
        let mut counts = self.counts();
        let rank = rank as usize;
        if counts.len() <= rank {
            counts.resize(rank + 1, 0);
        }
        counts[rank] += 1;
    }

    pub fn sub(&self, rank: u32) {
        if let Some(count) = self.counts().get_mut(rank as usize) {
            *count = count.saturating_sub(1);
        }
    }

    /// The in-flight count of ranks `0..size`.
    pub fn loads(&self, size: usize) -> Vec<u32> {
        let counts = self.counts();
        (0..size)
            .map(|rank| counts.get(rank).copied().unwrap_or(0))
            .collect()
    }
}

/// One in-flight slot of an instance taken ahead of sending (flow control): counted in the
/// instance's `local` count from the moment it is taken, so no other request of this router
/// can take it meanwhile. The attempt that sends to that instance adopts it
/// ([`SlotClaim::adopt`]); dropped unused, it frees the slot.
#[derive(Debug)]
pub struct SlotClaim(Option<Arc<InstanceCell>>, Option<Ticket>);

/// What a request holds for as long as it runs besides its slot (the flow-control queue's
/// count of its fairness id's requests in flight), dropped with the attempt.
pub type Ticket = Box<dyn std::fmt::Debug + Send + Sync>;

impl SlotClaim {
    /// Takes a slot of `cell` below `cap` ([`InstanceCell::try_take_slot`]), if one is free.
    pub fn take(cell: &Arc<InstanceCell>, cap: u32) -> Option<Self> {
        cell.try_take_slot(cap)
            .then(|| Self(Some(Arc::clone(cell)), None))
    }

    /// A slot of `cell` while `floor` ≤ its load < `cap` ([`InstanceCell::try_take_slot_from`]).
    pub fn take_from(cell: &Arc<InstanceCell>, floor: u32, cap: u32) -> Option<Self> {
        cell.try_take_slot_from(floor, cap)
            .then(|| Self(Some(Arc::clone(cell)), None))
    }

    /// The claim, holding `ticket` too.
    pub fn with_ticket(mut self, ticket: Ticket) -> Self {
        self.1 = Some(ticket);
        self
    }

    /// The ticket, for the attempt that runs the request (it keeps it to the end).
    pub fn take_ticket(&mut self) -> Option<Ticket> {
        self.1.take()
    }

    /// Whether the claim is on `cell`; if so it becomes that attempt's count (nothing is
    /// freed when the claim goes).
    pub fn adopt(mut self, cell: &Arc<InstanceCell>) -> bool {
        let same = self.0.as_ref().is_some_and(|held| Arc::ptr_eq(held, cell));
        if same {
            self.0 = None;
        }
        same
    }
}

impl Drop for SlotClaim {
    fn drop(&mut self) {
        // The ticket first: the queue woken below reads what it counted.
        drop(self.1.take());
        if let Some(cell) = self.0.take() {
            cell.local.fetch_sub(1, Ordering::Relaxed);
            cell.slot_freed();
        }
    }
}

/// Told when an instance's in-flight count drops (a request ended, or a load report lowered
/// the other routers' count): a flow-control queue, which may now let a request go.
pub trait SlotWaker: Send + Sync + std::fmt::Debug {
    fn slot_freed(&self);
}

/// The PREFIX_AWARE keys sent to one instance lately under bounded loads (by this router, or
/// by others as announced): where a copy of the prefix is cached, so that the key's later
/// requests go back there instead of making yet another copy (`rank::rank_remembering`).
///
/// A hint, kept small and lock-free: a direct-mapped table of [`SPILL_SLOTS`] keys, allocated
/// on the first placement. A key that collides with another forgets the older one, whose next
/// request is then placed as a new key's would be (4,096 slots per instance, 32 KiB, keep
/// collisions rare below a few thousand active keys per instance). Each entry carries when the key was last spilled
/// there and is forgotten [`SPILL_MEMORY_MS`] later: the engine has likely evicted a copy
/// nobody used for that long, and going back to it would cost a miss anyway. Until then, an
/// instance that lost its cache (a restart under the same id) costs one miss per remembered
/// key. Times come from [`switchyard_process::clock::monotonic_ms`], this process's monotonic clock, so a wall clock
/// that steps neither revives nor drops entries.
#[derive(Debug, Default)]
pub struct SpillMemory {
    /// Per slot: 1 (occupied), 31 bits of the key above its slot, then the time of the last
    /// spill in [`SPILL_TICK_MS`] ticks (32 bits: 139 years).
    slots: OnceLock<Box<[AtomicU64]>>,
}

/// Keys remembered per instance (8 bytes each).
pub const SPILL_SLOTS: usize = 4096;
/// How long a spill is remembered after the last one of its key to that instance.
pub const SPILL_MEMORY_MS: u64 = 120_000;
/// The resolution of [`SpillMemory`]'s times.
const SPILL_TICK_MS: u64 = 1024;
const SPILL_TICK_BITS: u32 = 32;
const SPILL_TICK_MASK: u64 = (1 << SPILL_TICK_BITS) - 1;

/// Adds one to `count`, stopping at `u32::MAX`.
pub fn saturating_increment(count: &AtomicU32) {
    let _ = count.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_add(1));
}

/// Bounded PREFIX_AWARE: the variant's requests through this router, in windows of
/// [`WINDOW_REQUESTS`]. Each window's end halves the instances' `recent` and `copies` counts,
/// so that they follow what happened lately. Kept across table rebuilds.
#[derive(Debug, Default)]
pub struct SendWindow {
    seen: AtomicU64,
}

pub const WINDOW_REQUESTS: u64 = 1024;

/// [`InstanceCell::further`]: a further copy placed in the current window.
pub const FURTHER_NOW: u32 = 1;
/// [`InstanceCell::further`]: a further copy placed in the window before.
pub const FURTHER_BEFORE: u32 = 2;

/// Marks a further copy placed on the instance of `further` ([`InstanceCell::further`]).
pub fn mark_further(further: &AtomicU32) {
    further.fetch_or(FURTHER_NOW, Ordering::Relaxed);
}

/// At a window's end: what was placed in it now dates from the window before; what was placed
/// before that is forgotten.
pub fn age_further(further: &AtomicU32) {
    let _ = further.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |flags| {
        Some(if flags & FURTHER_NOW != 0 {
            FURTHER_BEFORE
        } else {
            0
        })
    });
}

impl SendWindow {
    /// Counts one request; whether it closed a window.
    pub fn record(&self) -> bool {
        (self.seen.fetch_add(1, Ordering::Relaxed) + 1).is_multiple_of(WINDOW_REQUESTS)
    }
}

impl SpillMemory {
    /// The slot of `key` (its low bits) and its tag there: the occupied bit and the key's
    /// next 31 bits.
    fn slot(key: u64) -> (usize, u64) {
        const TAG_BITS: u32 = 63 - SPILL_TICK_BITS;
        let above_slot = key / SPILL_SLOTS as u64;
        (
            (key % SPILL_SLOTS as u64) as usize,
            1 << 63 | (above_slot & ((1 << TAG_BITS) - 1)) << SPILL_TICK_BITS,
        )
    }

    fn tick(now_ms: u64) -> u64 {
        (now_ms / SPILL_TICK_MS) & SPILL_TICK_MASK
    }

    /// Whether `key` was spilled onto the instance less than [`SPILL_MEMORY_MS`] before
    /// `now_ms` ([`switchyard_process::clock::monotonic_ms`]). An entry dated after `now_ms` (another request stored it
    /// meanwhile) counts as fresh.
    pub fn remembers(&self, key: u64, now_ms: u64) -> bool {
        let (index, tag) = Self::slot(key);
        let Some(word) = self
            .slots
            .get()
            .map(|slots| slots[index].load(Ordering::Relaxed))
        else {
            return false;
        };
        let age = Self::tick(now_ms).saturating_sub(word & SPILL_TICK_MASK);
        word & !SPILL_TICK_MASK == tag && age * SPILL_TICK_MS < SPILL_MEMORY_MS
    }

    /// Records that `key` was spilled onto the instance at `now_ms` ([`switchyard_process::clock::monotonic_ms`]).
    /// Returns how it stood before: `Fresh` if the key was remembered here and stored less
    /// than half of [`SPILL_MEMORY_MS`] ago, `Aging` if remembered but older (worth telling
    /// the other routers again, whose memory of it may run out first), `New` if not
    /// remembered.
    pub fn remember(&self, key: u64, now_ms: u64) -> Remembered {
        let (index, tag) = Self::slot(key);
        let slots = self
            .slots
            .get_or_init(|| (0..SPILL_SLOTS).map(|_| AtomicU64::new(0)).collect());
        let before = slots[index].swap(tag | Self::tick(now_ms), Ordering::Relaxed);
        let age = Self::tick(now_ms).saturating_sub(before & SPILL_TICK_MASK) * SPILL_TICK_MS;
        if before & !SPILL_TICK_MASK != tag || age >= SPILL_MEMORY_MS {
            Remembered::New
        } else if age >= SPILL_MEMORY_MS / 2 {
            Remembered::Aging
        } else {
            Remembered::Fresh
        }
    }
}

/// What [`SpillMemory::remember`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Remembered {
    New,
    Aging,
    Fresh,
}

impl InstanceCell {
    pub fn fleet_load(&self) -> u32 {
        self.local
            .load(Ordering::Relaxed)
            .saturating_add(self.remote.load(Ordering::Relaxed))
    }

    /// Takes one of this instance's `cap` fleet-wide slots for a request of this router, if
    /// one is free: atomic against this router's other requests (the other routers' share is
    /// as of their last load report).
    pub fn try_take_slot(&self, cap: u32) -> bool {
        self.try_take_slot_from(0, cap)
    }

    /// [`try_take_slot`](Self::try_take_slot) only while at least `floor` are in flight (a
    /// flow-control headroom slot: never one below the cap, which the queue's order gives).
    pub fn try_take_slot_from(&self, floor: u32, cap: u32) -> bool {
        let remote = self.remote.load(Ordering::Relaxed);
        self.local
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |local| {
                let load = local.saturating_add(remote);
                (floor <= load && load < cap).then_some(local + 1)
            })
            .is_ok()
    }

    /// Tells the variant's flow-control queue, if it has one, that a slot may be free.
    pub fn slot_freed(&self) {
        if let Some(waker) = self.waker.get().and_then(Weak::upgrade) {
            waker.slot_freed();
        }
    }

    pub fn count_upstream(&self, kind: UpstreamError) {
        self.upstream_errors[kind as usize].fetch_add(1, Ordering::Relaxed);
    }

    pub fn available(&self, now_ms: u64) -> bool {
        self.ejected_until_ms.load(Ordering::Relaxed) <= now_ms
    }
}

/// The keys a router placed on one instance for the first time lately (bounded loads), until
/// its sync loop takes them to the control plane, which passes them on to every other router:
/// a router that has not seen a key then sends it where another router put it, instead of
/// placing a copy of its own. At most [`MOST_ANNOUNCED`] wait; past that (no control plane,
/// or a stream that cannot keep up) new ones are dropped, which costs other routers a copy
/// at most.
#[derive(Debug, Default)]
pub struct Announcements(Mutex<Vec<(u64, bool)>>);

/// The most keys waiting to be announced per instance.
pub const MOST_ANNOUNCED: usize = 1024;

impl Announcements {
    fn keys(&self) -> std::sync::MutexGuard<'_, Vec<(u64, bool)>> {
        self.0.lock().unwrap_or_else(|poison| poison.into_inner())
    }

    /// Queues `key`, and whether it was a further copy (another instance of the variant held
    /// it); false if the queue is full (the key is not announced).
    pub fn push(&self, key: u64, further: bool) -> bool {
        let mut keys = self.keys();
        if keys.len() >= MOST_ANNOUNCED {
            return false;
        }
        keys.push((key, further));
        true
    }

    /// At most `most` of the keys waiting (with their further-copy flag), oldest first, taken
    /// off the queue.
    pub fn take(&self, most: usize) -> Vec<(u64, bool)> {
        let mut keys = self.keys();
        let most = most.min(keys.len());
        keys.drain(..most).collect()
    }
}

/// Every instance cell by key. Cells of instances that left membership are kept while
/// requests are still in flight on them, so the counts reported stay exact.
#[derive(Debug, Default)]
pub struct LoadRegistry {
    cells: Mutex<HashMap<InstanceKey, Arc<InstanceCell>>>,
}

impl LoadRegistry {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<InstanceKey, Arc<InstanceCell>>> {
        self.cells
            .lock()
            .unwrap_or_else(|poison| poison.into_inner())
    }

    pub fn cell(&self, key: &InstanceKey) -> Arc<InstanceCell> {
        Arc::clone(self.lock().entry(key.clone()).or_default())
    }

    /// The cell of `key`, if the router holds one (it does for every member instance).
    pub fn find(&self, key: &InstanceKey) -> Option<Arc<InstanceCell>> {
        self.lock().get(key).cloned()
    }

    /// Forgets the cells of `retired` instances (no longer members: `is_member` says) that
    /// nothing else holds (no table a request may still use, no request in flight), so every
    /// count stays reported until it ends. Keeps in `retired` the keys still held.
    pub fn prune(&self, retired: &mut Vec<InstanceKey>, is_member: impl Fn(&InstanceKey) -> bool) {
        let mut cells = self.lock();
        retired.retain(|key| {
            if is_member(key) {
                return false;
            }
            let Some(cell) = cells.get(key) else {
                return false;
            };
            if Arc::strong_count(cell) > 1 || cell.local.load(Ordering::Relaxed) > 0 {
                return true;
            }
            cells.remove(key);
            false
        });
    }

    /// Cells held, for tests and metrics.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.lock().is_empty()
    }

    /// Calls `visit` for every cell (under the registry lock: keep it short).
    pub fn for_each(&self, mut visit: impl FnMut(&InstanceKey, &InstanceCell)) {
        for (key, cell) in self.lock().iter() {
            visit(key, cell);
        }
    }
}

/// Failures in a row on an instance's side before it is paused: one failure may be the
/// request's own (a huge prompt that takes longer than the deadline), two in a row are the
/// instance's.
pub const PAUSE_AFTER_FAILURES: u32 = 2;
/// Longest pause (`--kv-tokenize-pause-ms` doubles up to it, or stays if it is longer).
pub const PAUSE_MAX_MS: u64 = 30_000;

/// Whether an instance may be asked to tokenize, after failures on its side; kept in its
/// [`crate::routing::table::InstanceCell`], so table rebuilds keep it. Times are
/// [`switchyard_process::clock::monotonic_ms`].
///
/// After [`PAUSE_AFTER_FAILURES`] failures in a row the instance is paused for the first
/// pause, doubling with each further failure up to [`PAUSE_MAX_MS`]. Requests that were
/// already asking when a failure was recorded (one incident seen by many) do not count
/// again. When a pause ends, one request claims the probe ([`TokenizeBackoff::claim`]); the
/// others keep away until it answers or its deadline passes.
#[derive(Debug, Default)]
pub struct TokenizeBackoff {
    /// Before this the instance is not asked (0: it may be).
    until_ms: AtomicU64,
    /// When the last failure was recorded.
    failed_at_ms: AtomicU64,
    /// Failures in a row.
    failures: AtomicU32,
}

impl TokenizeBackoff {
    /// Whether the instance may be asked at `now_ms`.
    pub fn ready(&self, now_ms: u64) -> bool {
        self.until_ms.load(Ordering::Relaxed) <= now_ms
    }

    /// Takes the right to ask the instance at `now_ms`, for `deadline_ms`: always granted to
    /// an instance that is not failing; after a pause, to one request only.
    pub fn claim(&self, now_ms: u64, deadline_ms: u64) -> bool {
        if self.failures.load(Ordering::Relaxed) < PAUSE_AFTER_FAILURES {
            return true;
        }
        let until = self.until_ms.load(Ordering::Relaxed);
        until <= now_ms
            && self
                .until_ms
                .compare_exchange(
                    until,
                    now_ms.saturating_add(deadline_ms),
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                )
                .is_ok()
    }

    /// Records a failure on the instance's side of a request asked at `asked_ms`, at `now_ms`;
    /// returns the pause it starts, if it starts one.
    pub fn failed(&self, asked_ms: u64, now_ms: u64, first_pause_ms: u64) -> Option<u64> {
        let last = self.failed_at_ms.load(Ordering::Relaxed);
        let in_row = self.failures.load(Ordering::Relaxed);
        if in_row > 0 && asked_ms < last {
            // Asked before the last failure was recorded: the same incident.
            return None;
        }
        self.failed_at_ms.fetch_max(now_ms, Ordering::Relaxed);
        let failures = self
            .failures
            .fetch_add(1, Ordering::Relaxed)
            .saturating_add(1);
        if failures < PAUSE_AFTER_FAILURES {
            return None;
        }
        let doublings = (failures - PAUSE_AFTER_FAILURES).min(16);
        let pause = (first_pause_ms << doublings).min(PAUSE_MAX_MS.max(first_pause_ms));
        self.until_ms
            .fetch_max(now_ms.saturating_add(pause), Ordering::Relaxed);
        Some(pause)
    }

    /// Records an answer; true if the instance had been failing.
    pub fn answered(&self) -> bool {
        if self.failures.load(Ordering::Relaxed) == 0 {
            return false;
        }
        self.until_ms.store(0, Ordering::Relaxed);
        self.failures.swap(0, Ordering::Relaxed) > 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn remembering_tells_a_new_key_from_a_fresh_and_an_aging_one() {
        let memory = SpillMemory::default();
        let t = 1_000_000;
        assert_eq!(memory.remember(7, t), Remembered::New);
        assert_eq!(memory.remember(7, t + 1_000), Remembered::Fresh);
        // Past half the memory's span since it was last stored: worth announcing again.
        let half = t + 1_000 + SPILL_MEMORY_MS / 2 + SPILL_TICK_MS;
        assert_eq!(memory.remember(7, half), Remembered::Aging);
        // Past the whole span: forgotten, so new again.
        assert_eq!(
            memory.remember(7, half + SPILL_MEMORY_MS + SPILL_TICK_MS),
            Remembered::New
        );
        // Another key in the same slot replaces it.
        let other = 7 + SPILL_SLOTS as u64;
        assert_eq!(memory.remember(other, half), Remembered::New);
        assert_eq!(memory.remember(7, half), Remembered::New);
        // Announcements wait in order, bounded, and are taken a number at a time.
        let queue = Announcements::default();
        for key in 0..MOST_ANNOUNCED as u64 {
            assert!(queue.push(key, key == 1));
        }
        assert!(!queue.push(u64::MAX, false), "full");
        assert_eq!(queue.take(2), [(0, false), (1, true)]);
        assert_eq!(queue.take(usize::MAX).len(), MOST_ANNOUNCED - 2);
        // A further copy is kept for the rest of the window and the next one.
        let further = AtomicU32::new(0);
        age_further(&further);
        assert_eq!(further.load(Ordering::Relaxed), 0);
        mark_further(&further);
        mark_further(&further);
        assert_eq!(further.load(Ordering::Relaxed), FURTHER_NOW);
        age_further(&further);
        assert_eq!(further.load(Ordering::Relaxed), FURTHER_BEFORE);
        mark_further(&further);
        assert_eq!(
            further.load(Ordering::Relaxed),
            FURTHER_NOW | FURTHER_BEFORE
        );
        age_further(&further);
        assert_eq!(further.load(Ordering::Relaxed), FURTHER_BEFORE);
        age_further(&further);
        assert_eq!(further.load(Ordering::Relaxed), 0);
        // Counts stop at the top instead of wrapping.
        let count = AtomicU32::new(u32::MAX - 1);
        saturating_increment(&count);
        saturating_increment(&count);
        assert_eq!(count.load(Ordering::Relaxed), u32::MAX);
    }

    #[test]
    fn an_instance_failing_to_tokenize_is_paused_longer_each_time_until_it_answers() {
        let backoff = TokenizeBackoff::default();
        let first = 1_000;
        // One failure may be the request's own: no pause yet.
        assert_eq!(backoff.failed(0, 10, first), None);
        assert!(backoff.ready(10) && backoff.claim(10, 250));
        // Requests asked before that failure was recorded are the same incident.
        assert_eq!(backoff.failed(5, 20, first), None);
        assert!(backoff.ready(20));
        // The second failure in a row pauses it: 1 s, then one request probes.
        assert_eq!(backoff.failed(30, 40, first), Some(1_000));
        assert!(!backoff.ready(1_039) && backoff.ready(1_040));
        assert!(backoff.claim(1_040, 250), "the probe");
        assert!(
            !backoff.ready(1_041) && !backoff.claim(1_041, 250),
            "one probe at a time"
        );
        // The probe fails: 2 s; then each failure doubles the pause up to 30 s.
        let mut now = 1_100;
        let mut pauses = vec![];
        for _ in 0..6 {
            let pause = backoff.failed(now, now + 10, first).unwrap();
            pauses.push(pause);
            now += 10 + pause;
        }
        assert_eq!(pauses, [2_000, 4_000, 8_000, 16_000, 30_000, 30_000]);
        // A probe's deadline passes unanswered (the request was dropped): another may probe.
        assert!(backoff.claim(now, 250));
        assert!(!backoff.claim(now + 249, 250) && backoff.claim(now + 250, 250));
        // An answer ends it, and the count starts over.
        assert!(backoff.answered());
        assert!(backoff.ready(0) && !backoff.answered());
        assert_eq!(backoff.failed(now + 300, now + 300, first), None);
        assert_eq!(backoff.failed(now + 400, now + 400, first), Some(1_000));
        // A first pause above the cap stays as given.
        let long = TokenizeBackoff::default();
        long.failed(0, 0, 60_000);
        assert_eq!(long.failed(1, 1, 60_000), Some(60_000));
        assert_eq!(long.failed(60_001, 60_001, 60_000), Some(60_000));
    }
}
