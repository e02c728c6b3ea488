//! The KV index: per variant, which instance holds which chain of full blocks, fed by the
//! engines' KV-cache events.
//!
//! Blocks are keyed by the router's own chained hash (`switchyard_policy::kv`), computed from
//! each `BlockStored`'s token ids and its parent's router hash; the engine's hashes (which
//! depend on the engine's hash function and seed) are only mapped to it, for `BlockRemoved`.
//! A request is then scored by walking its own block hashes in order: instance X holds the
//! first `j` blocks if the first `j` hashes list X among their holders. A walk starts, per
//! instance, at the deepest checkpoint an earlier walk found it holding, if it has lost no
//! block since ([`WalkCache`]).
//!
//! What an event means (vLLM's semantics, per instance, KV-cache group and medium): a
//! `BlockStored` says the engine holds these blocks now; storing a block already held changes
//! nothing but its recency (vLLM re-sends held blocks under `kv_cache_report_mode` "full"); a
//! `BlockRemoved` says it no longer holds them, whatever was stored before; an
//! `AllBlocksCleared` empties the instance. An engine that holds one hash twice (vLLM does not
//! de-duplicate blocks computed at once) and evicts one copy is then taken to hold neither: an
//! underestimate, which routes by load, never a phantom.
//!
//! Which events count: the engine's own prefix cache (`medium` "GPU"; an absent medium counts
//! as GPU until the instance names one, then it is another tier's, such as LMCache's), not
//! `locality` "REMOTE", and one KV-cache group: when vLLM labels groups
//! (`kv_cache_spec_kind`) the first full-attention-like one (`full_attention`,
//! `mla_attention`, `sink_full_attention`), else group 0. The variant's block size is the
//! largest full-group block size seen (a partial-block event is smaller and is skipped; if one
//! came first, the index restarts at the real size).
//!
//! Bounds: each instance keeps at most `max_blocks_per_instance` blocks of 16 tokens' worth
//! (a token budget: at block size 1, 16 times as many blocks; at 128, an eighth); beyond that
//! its least recently stored blocks are dropped (a chain's tail before its head, as engines
//! evict). A `BlockStored` whose parent the index does not know (stored before the router
//! subscribed, or dropped) cannot be placed in a chain and is skipped (counted).
//!
//! Concurrency: one `RwLock` per variant. Subscribers take it for writing once per batch;
//! the request path takes it for reading for one walk over the request's hashes (no await
//! while held), and under it one [`WalkCache`] entry's mutex at a time.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, RwLock, RwLockReadGuard, RwLockWriteGuard};

use switchyard_policy::kv::{
    PREFIX_KEY_BLOCKS, block_hash, chain_hashes, chain_seed, salted_seed, unmatchable_block_hash,
};
use switchyard_shared::{EndpointName, InstanceId, VariantName};

use crate::block_hasher::BlockHashing;
use crate::wire::{BlockRemoved, BlockStored, EngineHash, EventBatch, ExtraKeys, KvEvent};

/// An index's bounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IndexSettings {
    /// Blocks of [`BUDGET_BLOCK_TOKENS`] tokens kept per instance (a token budget: see
    /// [`IndexSettings::blocks_at`]). Default 131,072 (2 M tokens, above the 79,000-block
    /// cache of a Llama-70B on 8×H100). An engine's own evictions keep the index at the size
    /// of its cache; the budget bounds a misbehaving one. Measured: ~310 bytes of router
    /// memory per block (1 M blocks, RSS).
    pub max_blocks_per_instance: usize,
}

pub const DEFAULT_MAX_BLOCKS_PER_INSTANCE: usize = 131_072;

/// The block size `max_blocks_per_instance` is counted in: the budget is that many blocks
/// of this many tokens, whatever the engines' block size.
pub const BUDGET_BLOCK_TOKENS: usize = 16;

impl IndexSettings {
    /// Blocks one instance may keep at `block_size` (the token budget in blocks, at least 1).
    pub fn blocks_at(&self, block_size: usize) -> usize {
        (self
            .max_blocks_per_instance
            .saturating_mul(BUDGET_BLOCK_TOKENS)
            / block_size.max(1))
        .max(1)
    }
}

impl Default for IndexSettings {
    fn default() -> Self {
        Self {
            max_blocks_per_instance: DEFAULT_MAX_BLOCKS_PER_INSTANCE,
        }
    }
}

/// Whether an instance's entries may be used for routing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Freshness {
    /// Events arrive (or the replay socket answers): entries are current.
    Live,
    /// Its events stopped: entries are kept but not used (it scores 0 blocks).
    Stale,
}

/// Counters over every variant (Prometheus: `switchyard_kv_*`).
#[derive(Debug, Default)]
pub struct IndexCounters {
    pub batches: AtomicU64,
    pub blocks_stored: AtomicU64,
    pub blocks_removed: AtomicU64,
    /// Stored blocks whose parent the index did not know.
    pub blocks_orphaned: AtomicU64,
    /// Blocks dropped to keep an instance within `max_blocks_per_instance`.
    pub blocks_evicted: AtomicU64,
    /// Events skipped: another medium (CPU offload) or KV-cache group, a mismatched block size,
    /// an unknown type, malformed.
    pub events_ignored: AtomicU64,
    /// Sequence gaps filled from an engine's replay socket.
    pub gaps_repaired: AtomicU64,
    /// Instances whose entries were dropped because their events could not be followed
    /// (replay failed or missing, an engine restart, an unreadable batch).
    pub rebuilds: AtomicU64,
}

#[derive(Debug)]
struct OwnEntry {
    /// The engine hashes that map here (almost always one).
    engine_hashes: Vec<EngineHash>,
    tick: u64,
}

#[derive(Debug)]
struct EngineEntry {
    own: u64,
}

/// Full-attention-like KV-cache groups (vLLM's `KVCacheSpecKind`): they hold every token of a
/// prefix, so their blocks are what a prefill reuses.
fn full_attention_like(kind: &str) -> bool {
    matches!(
        kind,
        "full_attention" | "mla_attention" | "sink_full_attention"
    )
}

fn is_gpu(medium: &str) -> bool {
    medium.eq_ignore_ascii_case("GPU")
}

#[derive(Debug)]
struct InstanceBlocks {
    id: InstanceId,
    freshness: Freshness,
    /// Changes whenever the instance loses a block (and when the slot is taken): while it
    /// stays the same, every block it held is still held ([`WalkCache`]).
    epoch: u64,
    blocks: HashMap<u64, OwnEntry, BlockHashing>,
    engine: HashMap<EngineHash, EngineEntry>,
    /// Blocks by store order (oldest first).
    lru: BTreeMap<u64, u64>,
    next_tick: u64,
    /// The KV-cache group followed, once a labelled full-attention-like group was seen.
    group: Option<i64>,
    /// Groups labelled as something else (sliding window, mamba, …).
    other_groups: Vec<i64>,
    /// The instance named a medium once: an absent one is then another tier's.
    names_medium: bool,
    /// Batches that could not be decoded, and single events that could not be.
    undecodable_batches: u64,
    malformed_events: u64,
}

impl InstanceBlocks {
    fn new(id: InstanceId, epoch: u64) -> Self {
        Self {
            id,
            freshness: Freshness::Live,
            epoch,
            blocks: HashMap::default(),
            engine: HashMap::new(),
            lru: BTreeMap::new(),
            next_tick: 0,
            group: None,
            other_groups: Vec::new(),
            names_medium: false,
            undecodable_batches: 0,
            malformed_events: 0,
        }
    }

    /// Whether an event of `medium` at `locality` is about the engine's own prefix cache.
    fn counts_medium(&mut self, medium: Option<&str>, locality: Option<&str>) -> bool {
        if locality.is_some_and(|locality| locality.eq_ignore_ascii_case("REMOTE")) {
            return false;
        }
        match medium {
            Some(medium) => {
                self.names_medium = true;
                is_gpu(medium)
            }
            None => !self.names_medium,
        }
    }

    /// Whether an event of KV-cache group `group_idx` (labelled `kind`, on stores) counts.
    fn counts_group(&mut self, group_idx: Option<i64>, kind: Option<&str>) -> bool {
        let group = group_idx.unwrap_or(0);
        match kind {
            Some(kind) if full_attention_like(kind) => *self.group.get_or_insert(group) == group,
            Some(_) => {
                if !self.other_groups.contains(&group) {
                    self.other_groups.push(group);
                }
                false
            }
            None => !self.other_groups.contains(&group) && self.group.unwrap_or(0) == group,
        }
    }
}

/// Blocks whose holders are looked up together in a walk.
const LOOKUP_BATCH: usize = 32;

/// The holders of one block: instance slots, sorted (rarely more than a few, so kept inline:
/// a walk reads them without another memory access).
type Holders = smallvec::SmallVec<[u32; 4]>;

#[derive(Debug, Default)]
struct VariantBlocks {
    /// Block size of the variant's engines, from their first event.
    block_size: Option<usize>,
    /// The instance whose event set `block_size`: only it may widen it.
    block_size_from: Option<u32>,
    holders: HashMap<u64, Holders, BlockHashing>,
    slots: Vec<Option<InstanceBlocks>>,
    by_id: HashMap<InstanceId, u32>,
    /// The last epoch handed out (epochs are never reused, whatever the slot).
    last_epoch: u64,
}

impl VariantBlocks {
    fn slot(&mut self, id: &InstanceId) -> u32 {
        if let Some(slot) = self.by_id.get(id) {
            return *slot;
        }
        let slot = match self.slots.iter().position(Option::is_none) {
            Some(free) => free,
            None => {
                self.slots.push(None);
                self.slots.len() - 1
            }
        } as u32;
        let epoch = self.next_epoch();
        self.slots[slot as usize] = Some(InstanceBlocks::new(id.clone(), epoch));
        self.by_id.insert(id.clone(), slot);
        slot
    }

    fn next_epoch(&mut self) -> u64 {
        self.last_epoch += 1;
        self.last_epoch
    }

    /// `slot` lost (or is about to lose) a block: what the walk cache holds of it is void.
    fn lost_block(&mut self, slot: u32) {
        let epoch = self.next_epoch();
        self.instance(slot).epoch = epoch;
    }

    fn instance(&mut self, slot: u32) -> &mut InstanceBlocks {
        self.slots[slot as usize]
            .as_mut()
            .expect("a slot in by_id is occupied")
    }

    fn add_holder(&mut self, own: u64, slot: u32) {
        let holders = self.holders.entry(own).or_default();
        if let Err(position) = holders.binary_search(&slot) {
            holders.insert(position, slot);
        }
    }

    fn remove_holder(&mut self, own: u64, slot: u32) {
        if let Some(holders) = self.holders.get_mut(&own) {
            if let Ok(position) = holders.binary_search(&slot) {
                holders.remove(position);
            }
            if holders.is_empty() {
                self.holders.remove(&own);
            }
        }
    }

    /// Drops one of `slot`'s blocks and the engine hashes mapped to it.
    fn drop_block(&mut self, slot: u32, own: u64) {
        self.lost_block(slot);
        let instance = self.instance(slot);
        if let Some(entry) = instance.blocks.remove(&own) {
            instance.lru.remove(&entry.tick);
            for engine in entry.engine_hashes {
                instance.engine.remove(&engine);
            }
        }
        self.remove_holder(own, slot);
    }

    fn clear_instance(&mut self, slot: u32) {
        self.lost_block(slot);
        let instance = self.instance(slot);
        let owns: Vec<u64> = instance.blocks.keys().copied().collect();
        instance.blocks.clear();
        instance.engine.clear();
        instance.lru.clear();
        for own in owns {
            self.remove_holder(own, slot);
        }
    }

    /// Takes `block_size` (of an event from `slot`) as the variant's if it is the largest
    /// seen from the instance that set the current one: that earlier, smaller size was a
    /// partial block's, and what was indexed at it is dropped. False if the event does not
    /// count: smaller than the variant's block size (a partial block), or larger from another
    /// instance (a misconfigured engine must not switch the variant's KV routing off).
    fn learn_block_size(&mut self, slot: u32, block_size: usize) -> bool {
        match self.block_size {
            Some(known) if known == block_size => true,
            Some(known) if known > block_size => false,
            Some(_) if self.block_size_from != Some(slot) => false,
            Some(_) => {
                for slot in 0..self.slots.len() as u32 {
                    if self.slots[slot as usize].is_some() {
                        self.clear_instance(slot);
                    }
                }
                self.block_size = Some(block_size);
                true
            }
            None => {
                self.block_size = Some(block_size);
                self.block_size_from = Some(slot);
                true
            }
        }
    }

    fn store(&mut self, slot: u32, event: &BlockStored, counters: &IndexCounters) {
        let block_size = event.block_size as usize;
        if block_size == 0
            || event.token_ids.len() != event.block_hashes.len() * block_size
            || !self.learn_block_size(slot, block_size)
        {
            counters.events_ignored.fetch_add(1, Ordering::Relaxed);
            return;
        }
        let parent = match event.parent_block_hash {
            None => Some(chain_seed(event.lora_name.as_deref())),
            Some(engine) => self
                .instance(slot)
                .engine
                .get(&engine)
                .map(|entry| entry.own),
        };
        let Some(mut parent) = parent else {
            counters
                .blocks_orphaned
                .fetch_add(event.block_hashes.len() as u64, Ordering::Relaxed);
            return;
        };
        // Ticks: a chain's head gets the newest, so the budget drops tails first.
        let count = event.block_hashes.len() as u64;
        let first_tick = {
            let instance = self.instance(slot);
            let first = instance.next_tick;
            instance.next_tick += count;
            first
        };
        for (index, (engine, tokens)) in event
            .block_hashes
            .iter()
            .zip(event.token_ids.chunks_exact(block_size))
            .enumerate()
        {
            let chain_start = index == 0 && event.parent_block_hash.is_none();
            let own = match hashing(event, index, chain_start) {
                Hashing::Plain => block_hash(parent, tokens),
                Hashing::Salted(salt) => block_hash(salted_seed(parent, salt), tokens),
                Hashing::Unmatchable => unmatchable_block_hash(parent, tokens),
            };
            parent = own;
            let tick = first_tick + count - 1 - index as u64;
            let instance = self.instance(slot);
            if let Some(previous) = instance.engine.get_mut(engine) {
                if previous.own != own {
                    // The engine reused a hash for other content: trust the newest.
                    let old = previous.own;
                    previous.own = own;
                    if let Some(entry) = instance.blocks.get_mut(&old) {
                        entry.engine_hashes.retain(|hash| hash != engine);
                        if entry.engine_hashes.is_empty() {
                            self.drop_block(slot, old);
                        }
                    }
                }
            } else {
                instance.engine.insert(*engine, EngineEntry { own });
            }
            let instance = self.instance(slot);
            match instance.blocks.get_mut(&own) {
                Some(entry) => {
                    instance.lru.remove(&entry.tick);
                    entry.tick = tick;
                    if !entry.engine_hashes.contains(engine) {
                        entry.engine_hashes.push(*engine);
                    }
                }
                None => {
                    instance.blocks.insert(
                        own,
                        OwnEntry {
                            engine_hashes: vec![*engine],
                            tick,
                        },
                    );
                }
            }
            instance.lru.insert(tick, own);
            self.add_holder(own, slot);
        }
        counters.blocks_stored.fetch_add(count, Ordering::Relaxed);
    }

    fn remove(&mut self, slot: u32, event: &BlockRemoved, counters: &IndexCounters) {
        for engine in &event.block_hashes {
            let instance = self.instance(slot);
            let Some(entry) = instance.engine.remove(engine) else {
                continue;
            };
            let own = entry.own;
            let now_unmapped = match instance.blocks.get_mut(&own) {
                Some(block) => {
                    block.engine_hashes.retain(|hash| hash != engine);
                    block.engine_hashes.is_empty()
                }
                None => false,
            };
            if now_unmapped {
                self.drop_block(slot, own);
            }
            counters.blocks_removed.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn enforce_budget(&mut self, slot: u32, settings: &IndexSettings, counters: &IndexCounters) {
        let max_blocks = settings.blocks_at(self.block_size.unwrap_or(BUDGET_BLOCK_TOKENS));
        loop {
            let instance = self.instance(slot);
            if instance.blocks.len() <= max_blocks {
                return;
            }
            let Some((_, own)) = instance.lru.pop_first() else {
                return;
            };
            self.drop_block(slot, own);
            counters.blocks_evicted.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// How the router hashes one stored block, from what the engine mixed into its hash.
enum Hashing<'a> {
    Plain,
    /// The chain's first block of a request with this `cache_salt`.
    Salted(&'a str),
    /// Something no request's text reproduces (multimodal inputs, prompt embeddings, a salt
    /// or name where none is expected).
    Unmatchable,
}

/// vLLM's extra keys of block `index` (its LoRA name on every block, then its `cache_salt`
/// on the chain's first), or SGLang's event-wide `cache_salt` (on the chain's first block).
fn hashing(event: &BlockStored, index: usize, chain_start: bool) -> Hashing<'_> {
    let strings: &[String] = match event.extra_keys.get(index) {
        None | Some(ExtraKeys::None) => &[],
        Some(ExtraKeys::Strings(strings)) => strings,
        Some(ExtraKeys::Opaque) => return Hashing::Unmatchable,
    };
    // A LoRA block names its adapter first; the chain's seed is already the adapter's.
    let rest = match (event.lora_name.as_deref(), strings.split_first()) {
        (Some(lora), Some((first, rest))) if first == lora => rest,
        _ => strings,
    };
    let salt = match (rest, event.cache_salt.as_deref()) {
        ([], None) => return Hashing::Plain,
        ([], Some(salt)) => salt,
        ([salt], None) => salt.as_str(),
        ([salt], Some(event_salt)) if salt == event_salt => salt.as_str(),
        _ => return Hashing::Unmatchable,
    };
    if chain_start {
        Hashing::Salted(salt)
    } else if rest.is_empty() {
        // SGLang names the salt on every event of a salted chain: past its first block the
        // chain continues from the salted parent.
        Hashing::Plain
    } else {
        // vLLM mixes the salt into the first block only.
        Hashing::Unmatchable
    }
}

/// What a request's chain is hashed under besides its token ids, as the engine keys its
/// blocks: the LoRA adapter the request names (vLLM's `lora_name` extra key on every block)
/// and its `cache_salt` (on the first).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ChainKey<'a> {
    pub lora_name: Option<&'a str>,
    pub cache_salt: Option<&'a str>,
}

impl ChainKey<'_> {
    /// The parent hash of the chain's first block.
    pub fn seed(&self) -> u64 {
        let seed = chain_seed(self.lora_name);
        match self.cache_salt {
            Some(salt) => salted_seed(seed, salt),
            None => seed,
        }
    }
}

/// A request's match against a variant's index ([`VariantIndex::match_tokens`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenMatch {
    /// Per instance asked about, the leading full blocks it holds.
    pub matched: Vec<u32>,
    /// Full blocks of the prompt.
    pub blocks: u32,
    pub block_size: usize,
    /// `switchyard_policy::kv::prefix_key` of the prompt's hashes.
    pub prefix_key: u64,
}

/// Blocks between two checkpoints of a [`WalkCache`]. A walk from the deepest one a prompt
/// reaches looks up the blocks past it (on average half this many, each a cache miss in a
/// full index) and the prompt's new tail.
const CHECKPOINT_BLOCKS: usize = if cfg!(test) { 2 } else { 16 };
/// Every so many checkpoints one is also recorded among the coarse ones, so that a prompt
/// that leaves a known chain further back (another conversation after the same system
/// prompt) still finds a checkpoint within [`RECORDED_CHECKPOINTS`] of these.
const COARSE_EVERY: usize = 4;
/// Checkpoints a variant's [`WalkCache`] keeps (direct-mapped by chain hash; about 100 bytes
/// each, 400 KB, allocated by the variant's first walk past a checkpoint, freed with the
/// variant).
const WALK_CACHE_ENTRIES: usize = 4096;
/// Checkpoints a walk records per depth an instance reached: the deepest up to it, and as
/// many of the coarse ones (every [`COARSE_EVERY`]th).
const RECORDED_CHECKPOINTS: usize = 2;

/// What earlier walks found at a checkpoint of a chain (every [`CHECKPOINT_BLOCKS`]th block):
/// the instances that held every block of the chain up to it, each with its epoch then.
#[derive(Debug, Default)]
struct Checkpoint {
    /// The chain hash of the checkpoint's block.
    key: u64,
    /// (slot, epoch) of each instance that held the chain up to it.
    holders: smallvec::SmallVec<[(u32, u64); 4]>,
}

/// Where the walks of a variant's prompts may start. An instance whose epoch has not changed
/// since a walk found that it held a chain up to a checkpoint has lost no block since, so it
/// still holds them: the next walk over a prompt with the same start (a shared system prompt,
/// an earlier turn) starts there for that instance, instead of looking up every block again
/// (in a large index each lookup is a cache miss). Exact: blocks stored since are found by
/// walking on from the checkpoint, and any lost block voids the instance's checkpoints.
#[derive(Debug, Default)]
struct WalkCache {
    entries: OnceLock<Box<[Mutex<Checkpoint>]>>,
}

impl WalkCache {
    fn entry(&self, key: u64) -> std::sync::MutexGuard<'_, Checkpoint> {
        let entries = self
            .entries
            .get_or_init(|| (0..WALK_CACHE_ENTRIES).map(|_| Mutex::default()).collect());
        entries[(key % WALK_CACHE_ENTRIES as u64) as usize]
            .lock()
            .unwrap_or_else(|poison| poison.into_inner())
    }

    /// The instances known to hold the chain up to the checkpoint `key`.
    fn holders(&self, key: u64) -> smallvec::SmallVec<[(u32, u64); 4]> {
        let entry = self.entry(key);
        if entry.key == key {
            entry.holders.clone()
        } else {
            smallvec::SmallVec::new()
        }
    }

    fn record(&self, key: u64, holders: smallvec::SmallVec<[(u32, u64); 4]>) {
        let mut entry = self.entry(key);
        if entry.key != key || entry.holders != holders {
            *entry = Checkpoint { key, holders };
        }
    }
}

/// The index of one variant.
#[derive(Debug, Default)]
pub struct VariantIndex {
    blocks: RwLock<VariantBlocks>,
    walks: WalkCache,
    /// Instances walked past a prompt's first 16 blocks, and of them those walked from a
    /// checkpoint (the [`WalkCache`]'s hits).
    walked: [AtomicU64; 2],
    /// Blocks looked up by walks (tests).
    #[cfg(test)]
    lookups: AtomicU64,
}

impl VariantIndex {
    fn read(&self) -> RwLockReadGuard<'_, VariantBlocks> {
        self.blocks
            .read()
            .unwrap_or_else(|poison| poison.into_inner())
    }

    fn write(&self) -> RwLockWriteGuard<'_, VariantBlocks> {
        self.blocks
            .write()
            .unwrap_or_else(|poison| poison.into_inner())
    }

    /// Instances walked past a prompt's first 16 blocks, and of them those walked from a
    /// checkpoint, since the index was made.
    pub fn walked(&self) -> (u64, u64) {
        let [walked, from_checkpoint] = &self.walked;
        (
            walked.load(Ordering::Relaxed),
            from_checkpoint.load(Ordering::Relaxed),
        )
    }

    /// The block size of the variant's engines, once one has published.
    pub fn block_size(&self) -> Option<usize> {
        self.read().block_size
    }

    /// The router's block hashes of a request's token ids (base model), or None before any
    /// engine of the variant has published (the block size is unknown).
    pub fn request_hashes(&self, token_ids: &[u32]) -> Option<Vec<u64>> {
        let block_size = self.block_size()?;
        let mut hashes = Vec::with_capacity(token_ids.len() / block_size);
        chain_hashes(chain_seed(None), token_ids, block_size, &mut hashes);
        Some(hashes)
    }

    /// For each of `instances`, how many of the leading `hashes` it holds (0 for an instance
    /// that is unknown or stale). One walk over the hashes, stopping when no instance matches.
    pub fn matched_blocks(&self, hashes: &[u64], instances: &[InstanceId]) -> Vec<u32> {
        let blocks = self.read();
        let mut matched = vec![0u32; instances.len()];
        // (position in `instances`, slot) of those still matching.
        let mut active = Self::live_slots(&blocks, instances);
        for (depth, hash) in hashes.iter().enumerate() {
            if active.is_empty() {
                break;
            }
            let holders = blocks.holders.get(hash);
            active.retain(|&(position, slot, _)| {
                let held = holders.is_some_and(|holders| holders.binary_search(&slot).is_ok());
                if !held {
                    matched[position] = depth as u32;
                }
                held
            });
        }
        for (position, _, _) in active {
            matched[position] = hashes.len() as u32;
        }
        matched
    }

    /// [`matched_blocks`](Self::matched_blocks) straight from token ids: hashes the first
    /// `switchyard_policy::kv::PREFIX_KEY_BLOCKS` (the tie-break key), and the rest only if
    /// some instance holds the first block, so a prompt nobody holds costs little. None before
    /// the block size is known.
    pub fn match_tokens(&self, token_ids: &[u32], instances: &[InstanceId]) -> Option<TokenMatch> {
        self.match_prompt(token_ids, ChainKey::default(), instances)
    }

    /// [`match_tokens`](Self::match_tokens) for a request under `chain`: a LoRA adapter (only
    /// the adapter's blocks match) or a `cache_salt` (vLLM's request field: only chains stored
    /// under the same salt match), or both. An instance known to hold the prompt's chain up to
    /// one of its checkpoints ([`WalkCache`]) is walked from there; what this walk finds is
    /// kept for the next.
    pub fn match_prompt(
        &self,
        token_ids: &[u32],
        chain: ChainKey<'_>,
        instances: &[InstanceId],
    ) -> Option<TokenMatch> {
        let blocks = self.read();
        let block_size = blocks.block_size?;
        // An engine never reuses a prompt's last token (vLLM caps a cache hit at
        // `num_tokens - 1`): a prompt of exactly k blocks recomputes its last one, so at most
        // k - 1 of its blocks can be a hit.
        let total = token_ids.len().saturating_sub(1) / block_size;
        let full = token_ids.len() / block_size;
        let mut matched = vec![0u32; instances.len()];
        let live = Self::live_slots(&blocks, instances);
        // The chain's hashes, as far as they are needed: the tie-break key covers the first
        // blocks; the walk needs all `total` only if some instance holds the head.
        let mut hashes = Vec::new();
        let mut parent = chain.seed();
        let mut hash_to = |count: usize, hashes: &mut Vec<u64>| {
            while hashes.len() < count {
                let at = hashes.len() * block_size;
                parent = block_hash(parent, &token_ids[at..at + block_size]);
                hashes.push(parent);
            }
        };
        hash_to(PREFIX_KEY_BLOCKS.min(full).max(total.min(1)), &mut hashes);
        let prefix_key = hashes[..PREFIX_KEY_BLOCKS.min(full)]
            .last()
            .copied()
            .unwrap_or(0);
        let held = |slot: u32, holders: Option<&Holders>| {
            holders.is_some_and(|holders| holders.binary_search(&slot).is_ok())
        };
        // Only the instances that hold the first block are walked.
        let first = hashes.first().and_then(|hash| blocks.holders.get(hash));
        let walkers: Vec<(usize, u32, u64)> = live
            .into_iter()
            .filter(|&(_, slot, _)| held(slot, first))
            .collect();
        if total > 0 && !walkers.is_empty() {
            // The head (one batch of lookups) for all of them: a prompt they share only the
            // start of (a chat template's) is hashed no further.
            let head = LOOKUP_BATCH.min(CHECKPOINT_BLOCKS).min(total);
            hash_to(head, &mut hashes);
            let still = self.walk_head(&blocks, &hashes[..head], walkers, &mut matched);
            if head == total {
                for &(position, _, _) in &still {
                    matched[position] = total as u32;
                }
            } else if !still.is_empty() {
                hash_to(total, &mut hashes);
                self.walk(&blocks, &hashes[..total], &still, head, &mut matched);
            }
        }
        Some(TokenMatch {
            matched,
            blocks: total as u32,
            block_size,
            prefix_key,
        })
    }

    /// The `walkers` that hold every block of `head` (one batch of lookups); `matched` set for
    /// the others.
    fn walk_head(
        &self,
        blocks: &VariantBlocks,
        head: &[u64],
        mut walkers: Vec<(usize, u32, u64)>,
        matched: &mut [u32],
    ) -> Vec<(usize, u32, u64)> {
        #[cfg(test)]
        self.lookups.fetch_add(head.len() as u64, Ordering::Relaxed);
        let found: [Option<&Holders>; LOOKUP_BATCH] =
            std::array::from_fn(|depth| head.get(depth).and_then(|hash| blocks.holders.get(hash)));
        for (depth, holders) in found[..head.len()].iter().enumerate() {
            walkers.retain(|&(position, slot, _)| {
                let held = holders.is_some_and(|holders| holders.binary_search(&slot).is_ok());
                if !held {
                    matched[position] = depth as u32;
                }
                held
            });
        }
        walkers
    }

    /// Sets `matched` (by position in the instances asked about) for the `live` instances,
    /// which hold the first `from` of `hashes`: the leading `hashes` each holds, walked from
    /// the deepest checkpoint the [`WalkCache`] vouches for (else from `from`), the lookups 32
    /// at a time; then records the checkpoints this walk reached.
    fn walk(
        &self,
        blocks: &VariantBlocks,
        hashes: &[u64],
        live: &[(usize, u32, u64)],
        from: usize,
        matched: &mut [u32],
    ) {
        let total = hashes.len();
        // (where its walk starts, index into `live`) of each live instance: its deepest
        // vouched-for checkpoint, else `from`.
        let mut waiting: Vec<(usize, usize)> = (0..live.len()).map(|index| (from, index)).collect();
        let mut open = live.len();
        for depth in (1..=total / CHECKPOINT_BLOCKS)
            .rev()
            .map(|k| k * CHECKPOINT_BLOCKS)
        {
            if open == 0 || depth <= from {
                break;
            }
            for (slot, epoch) in self.walks.holders(hashes[depth - 1]) {
                for (start, index) in &mut waiting {
                    let (_, live_slot, live_epoch) = live[*index];
                    if *start == from && (live_slot, live_epoch) == (slot, epoch) {
                        *start = depth;
                        open -= 1;
                    }
                }
            }
        }
        self.walked[0].fetch_add(live.len() as u64, Ordering::Relaxed);
        self.walked[1].fetch_add((live.len() - open) as u64, Ordering::Relaxed);
        waiting.sort_by_key(|&(start, _)| std::cmp::Reverse(start));
        // Indexes into `live` of the instances still matching at `depth`.
        let mut active: Vec<usize> = Vec::with_capacity(live.len());
        let mut depth = from;
        loop {
            while waiting.last().is_some_and(|&(start, _)| start <= depth) {
                active.extend(waiting.pop().map(|(_, index)| index));
            }
            let next_start = waiting.last().map(|&(start, _)| start);
            if active.is_empty() {
                match next_start {
                    Some(next) => {
                        depth = next;
                        continue;
                    }
                    None => break,
                }
            }
            if depth >= total {
                break;
            }
            // Up to the next waiting instance's start, so that it joins there.
            let size = LOOKUP_BATCH.min(next_start.unwrap_or(total).min(total) - depth);
            #[cfg(test)]
            self.lookups.fetch_add(size as u64, Ordering::Relaxed);
            // The batch's lookups do not depend on each other, so the CPU overlaps their
            // cache misses (in a full index nearly every lookup is one); then the walk.
            let found: [Option<&Holders>; LOOKUP_BATCH] = std::array::from_fn(|offset| {
                if offset < size {
                    blocks.holders.get(&hashes[depth + offset])
                } else {
                    None
                }
            });
            for (offset, holders) in found[..size].iter().enumerate() {
                if active.is_empty() {
                    break;
                }
                active.retain(|&index| {
                    let (position, slot, _) = live[index];
                    let held = holders.is_some_and(|holders| holders.binary_search(&slot).is_ok());
                    if !held {
                        matched[position] = (depth + offset) as u32;
                    }
                    held
                });
            }
            depth += size;
        }
        for index in active {
            matched[live[index].0] = total as u32;
        }
        // For each depth an instance reached, the deepest checkpoints up to it and the deepest
        // coarse ones: the next prompt with the same start (a longer turn, another question
        // after the same system prompt) finds one of them, for every instance that holds it.
        let deepest = |reached: usize, every: usize| {
            (1..=reached / every)
                .rev()
                .take(RECORDED_CHECKPOINTS)
                .map(move |k| k * every)
        };
        let mut depths: Vec<usize> = live
            .iter()
            .flat_map(|&(position, _, _)| {
                let reached = matched[position] as usize;
                deepest(reached, CHECKPOINT_BLOCKS)
                    .chain(deepest(reached, CHECKPOINT_BLOCKS * COARSE_EVERY))
            })
            .filter(|&depth| depth > from)
            .collect();
        depths.sort_unstable();
        depths.dedup();
        for depth in depths {
            let holders: smallvec::SmallVec<[(u32, u64); 4]> = live
                .iter()
                .filter(|&&(position, _, _)| matched[position] as usize >= depth)
                .map(|&(_, slot, epoch)| (slot, epoch))
                .collect();
            self.walks.record(hashes[depth - 1], holders);
        }
    }

    /// (position in `instances`, slot, epoch) of the instances known and live.
    fn live_slots(blocks: &VariantBlocks, instances: &[InstanceId]) -> Vec<(usize, u32, u64)> {
        instances
            .iter()
            .enumerate()
            .filter_map(|(position, id)| {
                let slot = *blocks.by_id.get(id)?;
                let instance = blocks.slots[slot as usize].as_ref()?;
                (instance.freshness == Freshness::Live).then_some((position, slot, instance.epoch))
            })
            .collect()
    }

    /// How many of the leading `hashes` one instance holds (the DPD threshold's question:
    /// leading tokens = this × block size).
    pub fn matched_blocks_of(&self, hashes: &[u64], instance: &InstanceId) -> u32 {
        self.matched_blocks(hashes, std::slice::from_ref(instance))[0]
    }

    /// Applies one batch of `instance`'s events.
    pub fn apply(
        &self,
        instance: &InstanceId,
        batch: &EventBatch,
        settings: &IndexSettings,
        counters: &IndexCounters,
    ) {
        let mut blocks = self.write();
        let slot = blocks.slot(instance);
        for event in &batch.events {
            let counted = {
                let this = blocks.instance(slot);
                match event {
                    KvEvent::BlockStored(stored) => {
                        this.counts_medium(stored.medium.as_deref(), stored.locality.as_deref())
                            && this.counts_group(
                                stored.group_idx,
                                stored.kv_cache_spec_kind.as_deref(),
                            )
                    }
                    KvEvent::BlockRemoved(removed) => {
                        this.counts_medium(removed.medium.as_deref(), removed.locality.as_deref())
                            && this.counts_group(removed.group_idx, None)
                    }
                    KvEvent::AllBlocksCleared { medium } => medium.as_deref().is_none_or(is_gpu),
                    KvEvent::Malformed(_) => {
                        this.malformed_events += 1;
                        false
                    }
                    KvEvent::Other(_) => false,
                }
            };
            match event {
                KvEvent::BlockStored(stored) if counted => blocks.store(slot, stored, counters),
                KvEvent::BlockRemoved(removed) if counted => {
                    blocks.remove(slot, removed, counters);
                }
                KvEvent::AllBlocksCleared { .. } if counted => blocks.clear_instance(slot),
                _ => {
                    counters.events_ignored.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        blocks.enforce_budget(slot, settings, counters);
        counters.batches.fetch_add(1, Ordering::Relaxed);
    }

    /// Drops everything known about `instance` (its events could not be followed, or it
    /// left), keeping its slot if `keep` (it is still subscribed).
    pub fn clear(&self, instance: &InstanceId, keep: bool) {
        let mut blocks = self.write();
        let Some(slot) = blocks.by_id.get(instance).copied() else {
            return;
        };
        blocks.clear_instance(slot);
        if !keep {
            blocks.slots[slot as usize] = None;
            blocks.by_id.remove(instance);
        }
    }

    /// Counts a batch of `instance`'s that could not be decoded (and was skipped).
    pub fn count_undecodable(&self, instance: &InstanceId) {
        let mut blocks = self.write();
        let slot = blocks.slot(instance);
        blocks.instance(slot).undecodable_batches += 1;
    }

    /// Per instance: (undecodable batches, malformed events) since it was first followed.
    pub fn decode_failures(&self) -> Vec<(InstanceId, u64, u64)> {
        self.each_instance(|instance| {
            (
                instance.id.clone(),
                instance.undecodable_batches,
                instance.malformed_events,
            )
        })
    }

    pub fn set_freshness(&self, instance: &InstanceId, freshness: Freshness) {
        let mut blocks = self.write();
        let slot = blocks.slot(instance);
        blocks.instance(slot).freshness = freshness;
    }

    pub fn freshness(&self, instance: &InstanceId) -> Option<Freshness> {
        let blocks = self.read();
        let slot = *blocks.by_id.get(instance)?;
        blocks.slots[slot as usize]
            .as_ref()
            .map(|instance| instance.freshness)
    }

    /// Blocks indexed for `instance`.
    pub fn block_count(&self, instance: &InstanceId) -> usize {
        let blocks = self.read();
        blocks
            .by_id
            .get(instance)
            .and_then(|slot| blocks.slots[*slot as usize].as_ref())
            .map_or(0, |instance| instance.blocks.len())
    }

    /// Instances indexed, with their block count and freshness.
    pub fn instances(&self) -> Vec<(InstanceId, usize, Freshness)> {
        self.each_instance(|instance| {
            (
                instance.id.clone(),
                instance.blocks.len(),
                instance.freshness,
            )
        })
    }

    /// `view` of every instance indexed, in slot order.
    fn each_instance<T>(&self, view: impl Fn(&InstanceBlocks) -> T) -> Vec<T> {
        self.read().slots.iter().flatten().map(view).collect()
    }
}

pub type VariantKey = (EndpointName, VariantName);

/// Every variant's index, with the bounds and counters they share.
#[derive(Debug, Default)]
pub struct KvIndex {
    variants: RwLock<HashMap<VariantKey, Arc<VariantIndex>>>,
    pub settings: IndexSettings,
    pub counters: Arc<IndexCounters>,
}

impl KvIndex {
    pub fn new(settings: IndexSettings) -> Self {
        Self {
            settings,
            ..Self::default()
        }
    }

    /// A variant's index, if any of its instances publishes events.
    pub fn variant(
        &self,
        endpoint: &EndpointName,
        variant: &VariantName,
    ) -> Option<Arc<VariantIndex>> {
        self.variants
            .read()
            .unwrap_or_else(|poison| poison.into_inner())
            .get(&(endpoint.clone(), variant.clone()))
            .cloned()
    }

    /// A variant's index, made if missing.
    pub fn variant_or_insert(&self, key: &VariantKey) -> Arc<VariantIndex> {
        if let Some(index) = self.variant(&key.0, &key.1) {
            return index;
        }
        Arc::clone(
            self.variants
                .write()
                .unwrap_or_else(|poison| poison.into_inner())
                .entry(key.clone())
                .or_default(),
        )
    }

    /// Forgets variants not in `live`.
    pub fn retain_variants(&self, live: &std::collections::HashSet<VariantKey>) {
        self.variants
            .write()
            .unwrap_or_else(|poison| poison.into_inner())
            .retain(|key, _| live.contains(key));
    }

    /// Every variant's index.
    pub fn variants(&self) -> Vec<(VariantKey, Arc<VariantIndex>)> {
        self.variants
            .read()
            .unwrap_or_else(|poison| poison.into_inner())
            .iter()
            .map(|(key, index)| (key.clone(), Arc::clone(index)))
            .collect()
    }

    /// Prometheus text for the index: blocks per instance, stale instances, counters.
    pub fn render_metrics(&self) -> String {
        let mut out = switchyard_process::metrics::TextEncoder::new();
        out.family(
            "switchyard_kv_index_blocks",
            "gauge",
            "Blocks the KV index holds per instance (bounded by the per-instance budget).",
        );
        let mut stale = 0usize;
        for ((endpoint, variant), index) in self.variants() {
            for (id, blocks, freshness) in index.instances() {
                stale += usize::from(freshness == Freshness::Stale);
                out.sample(
                    "switchyard_kv_index_blocks",
                    &[
                        ("endpoint", endpoint.as_str()),
                        ("variant", variant.as_str()),
                        ("instance", id.as_str()),
                    ],
                    blocks as f64,
                );
            }
        }
        for (name, help, pick) in [
            (
                "switchyard_kv_undecodable_batches_total",
                "KV event batches skipped because they could not be decoded, per instance.",
                0usize,
            ),
            (
                "switchyard_kv_malformed_events_total",
                "Single KV events skipped because they could not be decoded, per instance.",
                1,
            ),
        ] {
            out.family(name, "counter", help);
            for ((endpoint, variant), index) in self.variants() {
                for (id, batches, events) in index.decode_failures() {
                    out.sample(
                        name,
                        &[
                            ("endpoint", endpoint.as_str()),
                            ("variant", variant.as_str()),
                            ("instance", id.as_str()),
                        ],
                        [batches, events][pick] as f64,
                    );
                }
            }
        }
        out.family(
            "switchyard_kv_stale_instances",
            "gauge",
            "Instances whose KV events stopped (routed as if they held nothing).",
        );
        out.sample("switchyard_kv_stale_instances", &[], stale as f64);
        let (walked, from_checkpoint) = self
            .variants()
            .iter()
            .map(|(_, index)| index.walked())
            .fold((0, 0), |(a, b), (c, d)| (a + c, b + d));
        for (name, help, value) in [
            (
                "switchyard_kv_walked_instances_total",
                "Instances walked past a prompt's first 16 blocks in the KV index.",
                walked,
            ),
            (
                "switchyard_kv_walk_checkpoint_starts_total",
                "Of those, instances walked from a checkpoint an earlier walk recorded.",
                from_checkpoint,
            ),
        ] {
            out.family(name, "counter", help);
            out.sample(name, &[], value as f64);
        }
        let counters = &self.counters;
        for (name, help, value) in [
            (
                "switchyard_kv_event_batches_total",
                "KV event batches applied.",
                &counters.batches,
            ),
            (
                "switchyard_kv_blocks_stored_total",
                "Blocks stored by KV events.",
                &counters.blocks_stored,
            ),
            (
                "switchyard_kv_blocks_removed_total",
                "Blocks removed by KV events.",
                &counters.blocks_removed,
            ),
            (
                "switchyard_kv_blocks_orphaned_total",
                "Stored blocks skipped: their parent was unknown.",
                &counters.blocks_orphaned,
            ),
            (
                "switchyard_kv_blocks_evicted_total",
                "Blocks dropped to stay within the per-instance budget.",
                &counters.blocks_evicted,
            ),
            (
                "switchyard_kv_events_ignored_total",
                "KV events skipped (other medium or group, bad block size, unknown type).",
                &counters.events_ignored,
            ),
            (
                "switchyard_kv_gaps_repaired_total",
                "KV event sequence gaps filled by replay.",
                &counters.gaps_repaired,
            ),
            (
                "switchyard_kv_rebuilds_total",
                "Instance entries dropped and rebuilt from new events.",
                &counters.rebuilds,
            ),
        ] {
            out.family(name, "counter", help);
            out.sample(name, &[], value.load(Ordering::Relaxed) as f64);
        }
        out.finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(name: &str) -> InstanceId {
        InstanceId::new(name).unwrap()
    }

    fn stored(parent: Option<u64>, hashes: &[u64], tokens: &[u32]) -> KvEvent {
        KvEvent::BlockStored(BlockStored {
            block_hashes: hashes.iter().map(|hash| EngineHash(*hash)).collect(),
            parent_block_hash: parent.map(EngineHash),
            token_ids: tokens.to_vec(),
            block_size: 2,
            medium: Some("GPU".into()),
            ..BlockStored::default()
        })
    }

    fn removed(hashes: &[u64]) -> KvEvent {
        KvEvent::BlockRemoved(BlockRemoved {
            block_hashes: hashes.iter().map(|hash| EngineHash(*hash)).collect(),
            medium: Some("GPU".into()),
            ..BlockRemoved::default()
        })
    }

    fn batch(events: Vec<KvEvent>) -> EventBatch {
        EventBatch {
            ts: 0.0,
            events,
            data_parallel_rank: None,
        }
    }

    fn apply(index: &VariantIndex, instance: &str, events: Vec<KvEvent>) {
        index.apply(
            &id(instance),
            &batch(events),
            &IndexSettings::default(),
            &IndexCounters::default(),
        );
    }

    #[test]
    fn a_walk_starts_where_an_earlier_one_found_the_chain_held_until_a_block_is_lost() {
        let index = VariantIndex::default();
        let tokens: Vec<u32> = (0..40).collect();
        let hashes: Vec<u64> = (100..120).collect();
        apply(&index, "a", vec![stored(None, &hashes, &tokens)]);
        // 20 blocks of 2, and one more token (the last token's block is never a hit).
        let prompt: Vec<u32> = (0..41).collect();
        let walk = |expected: u32| {
            let before = index.lookups.load(Ordering::Relaxed);
            let found = index.match_tokens(&prompt, &[id("a"), id("b")]).unwrap();
            assert_eq!(found.matched, [expected, 0]);
            index.lookups.load(Ordering::Relaxed) - before
        };
        assert_eq!(walk(20), 20, "the first walk looks up every block");
        assert_eq!(
            walk(20),
            2,
            "the next: the head, then from the last checkpoint"
        );
        assert_eq!(index.walked(), (2, 1));
        // A block stored since is found past the checkpoint (a longer prompt).
        let longer: Vec<u32> = (0..45).collect();
        apply(
            &index,
            "a",
            vec![stored(Some(119), &[120, 121], &longer[40..44])],
        );
        let found = index.match_tokens(&longer, &[id("a")]).unwrap();
        assert_eq!(found.matched, [22]);
        // A lost block voids what was known of the instance: walked from the start again.
        apply(&index, "a", vec![removed(&[115])]);
        // (Lookups go 32 at a time, so a walk counts its whole batch.)
        assert_eq!(walk(15), 20);
        assert_eq!(walk(15), 2 + 6, "the head, then from the checkpoint at 14");
        // Another instance's loss changes nothing for this one (nor does an instance that
        // held the first block once).
        apply(&index, "b", vec![stored(None, &[200], &[0, 1])]);
        apply(&index, "b", vec![removed(&[200])]);
        assert_eq!(walk(15), 2 + 6);
    }

    #[test]
    fn a_prompt_that_leaves_a_walked_chain_further_back_starts_at_a_coarse_checkpoint() {
        let index = VariantIndex::default();
        let tokens: Vec<u32> = (0..40).collect();
        let hashes: Vec<u64> = (100..120).collect();
        apply(&index, "a", vec![stored(None, &hashes, &tokens)]);
        let lookups = |prompt: &[u32], expected: u32| {
            let before = index.lookups.load(Ordering::Relaxed);
            let found = index.match_tokens(prompt, &[id("a")]).unwrap();
            assert_eq!(found.matched, [expected]);
            index.lookups.load(Ordering::Relaxed) - before
        };
        // Walked whole: checkpoints at 20 and 18, and the coarse ones at 16 and 8.
        let whole: Vec<u32> = (0..41).collect();
        assert_eq!(lookups(&whole, 20), 20);
        // Shares 17 blocks, then another question: past the fine checkpoints, so the walk
        // starts at the coarse one at 16 (the head, then one batch from 16 to the end).
        let other: Vec<u32> = (0..34).chain(500..507).collect();
        assert_eq!(lookups(&other, 17), 2 + 4);
    }

    #[test]
    fn chains_are_keyed_by_token_ids_not_engine_hashes() {
        let index = VariantIndex::default();
        // Two engines with different hash functions store the same tokens.
        apply(&index, "a", vec![stored(None, &[1, 2], &[10, 11, 12, 13])]);
        apply(&index, "b", vec![stored(None, &[900], &[10, 11])]);
        apply(&index, "b", vec![stored(Some(900), &[901], &[12, 13])]);
        let hashes = index.request_hashes(&[10, 11, 12, 13, 14]).unwrap();
        assert_eq!(hashes.len(), 2);
        assert_eq!(
            index.matched_blocks(&hashes, &[id("a"), id("b"), id("c")]),
            [2, 2, 0]
        );
        // Same tokens after another first block: no match.
        let other = index.request_hashes(&[99, 11, 12, 13]).unwrap();
        assert_eq!(index.matched_blocks(&other, &[id("a")]), [0]);
        assert_eq!(index.matched_blocks_of(&hashes[..1], &id("b")), 1);
    }

    #[test]
    fn removal_cuts_the_chain_and_clearing_empties_the_instance() {
        let index = VariantIndex::default();
        apply(
            &index,
            "a",
            vec![stored(None, &[1, 2, 3], &[1, 2, 3, 4, 5, 6])],
        );
        let hashes = index.request_hashes(&[1, 2, 3, 4, 5, 6]).unwrap();
        assert_eq!(index.matched_blocks_of(&hashes, &id("a")), 3);
        apply(&index, "a", vec![removed(&[2])]);
        assert_eq!(index.matched_blocks_of(&hashes, &id("a")), 1);
        apply(
            &index,
            "a",
            vec![KvEvent::AllBlocksCleared { medium: None }],
        );
        assert_eq!(index.matched_blocks_of(&hashes, &id("a")), 0);
        assert_eq!(index.block_count(&id("a")), 0);
    }

    #[test]
    fn a_block_reported_again_is_gone_after_one_removal() {
        // vLLM's kv_cache_report_mode "full": every reuse re-sends BlockStored for the held
        // prefix; the one eviction sends one BlockRemoved.
        let index = VariantIndex::default();
        apply(&index, "a", vec![stored(None, &[1, 2], &[1, 2, 3, 4])]);
        for _ in 0..3 {
            apply(&index, "a", vec![stored(None, &[1, 2], &[1, 2, 3, 4])]);
        }
        let hashes = index.request_hashes(&[1, 2, 3, 4]).unwrap();
        assert_eq!(index.matched_blocks_of(&hashes, &id("a")), 2);
        assert_eq!(index.block_count(&id("a")), 2);
        apply(&index, "a", vec![removed(&[2])]);
        assert_eq!(index.matched_blocks_of(&hashes, &id("a")), 1);
        apply(&index, "a", vec![removed(&[1])]);
        assert_eq!(index.matched_blocks_of(&hashes, &id("a")), 0);
        assert_eq!(index.block_count(&id("a")), 0);
    }

    fn with(event: KvEvent, change: impl FnOnce(&mut BlockStored)) -> KvEvent {
        let KvEvent::BlockStored(mut stored) = event else {
            unreachable!("a store")
        };
        change(&mut stored);
        KvEvent::BlockStored(stored)
    }

    #[test]
    fn salted_chains_match_only_requests_with_the_same_salt() {
        let index = VariantIndex::default();
        let ids = [id("vllm"), id("sglang")];
        let tokens = [1, 2, 3, 4];
        // vLLM: the salt is the first block's extra key.
        apply(
            &index,
            "vllm",
            vec![with(stored(None, &[1, 2], &tokens), |e| {
                e.extra_keys = vec![ExtraKeys::Strings(vec!["s".into()]), ExtraKeys::None];
            })],
        );
        // SGLang: every event of the salted chain names it; the second continues the first.
        let salted = |event: KvEvent| with(event, |e| e.cache_salt = Some("s".into()));
        apply(
            &index,
            "sglang",
            vec![
                salted(stored(None, &[7], &[1, 2])),
                salted(stored(Some(7), &[8], &[3, 4])),
            ],
        );
        // One token past the held blocks: an engine never reuses a prompt's last token.
        let asked = [1, 2, 3, 4, 5];
        let matched = |salt| {
            let chain = ChainKey {
                cache_salt: salt,
                ..ChainKey::default()
            };
            index.match_prompt(&asked, chain, &ids).unwrap().matched
        };
        assert_eq!(matched(Some("s")), [2, 2]);
        assert_eq!(matched(None), [0, 0]);
        assert_eq!(matched(Some("t")), [0, 0]);
        // A salt where vLLM never puts one (past the first block) is not reproducible.
        apply(
            &index,
            "odd",
            vec![with(stored(None, &[1, 2], &tokens), |e| {
                e.extra_keys = vec![ExtraKeys::None, ExtraKeys::Strings(vec!["s".into()])];
            })],
        );
        let odd = index
            .match_prompt(&asked, ChainKey::default(), &[id("odd")])
            .unwrap();
        assert_eq!(odd.matched, [1]);
    }

    #[test]
    fn an_adapters_blocks_match_only_requests_for_that_adapter() {
        // vLLM 0.32 names a LoRA block's adapter in `lora_name` and first in its extra keys,
        // on every block of the chain; a salted one has the salt after it on the first block.
        let index = VariantIndex::default();
        let lora = |event: KvEvent, keys: Vec<Vec<&str>>| {
            with(event, |e| {
                e.lora_name = Some("sql".into());
                e.extra_keys = keys
                    .into_iter()
                    .map(|keys| ExtraKeys::Strings(keys.into_iter().map(Into::into).collect()))
                    .collect();
            })
        };
        apply(
            &index,
            "a",
            vec![lora(
                stored(None, &[1, 2], &[1, 2, 3, 4]),
                vec![vec!["sql"], vec!["sql"]],
            )],
        );
        apply(
            &index,
            "b",
            vec![lora(
                stored(None, &[1, 2], &[1, 2, 3, 4]),
                vec![vec!["sql", "s"], vec!["sql"]],
            )],
        );
        apply(&index, "c", vec![stored(None, &[1, 2], &[1, 2, 3, 4])]);
        let ids = [id("a"), id("b"), id("c")];
        let asked = [1, 2, 3, 4, 5];
        let matched = |lora_name, cache_salt| {
            let chain = ChainKey {
                lora_name,
                cache_salt,
            };
            index.match_prompt(&asked, chain, &ids).unwrap().matched
        };
        assert_eq!(matched(Some("sql"), None), [2, 0, 0]);
        assert_eq!(matched(Some("sql"), Some("s")), [0, 2, 0]);
        assert_eq!(matched(None, None), [0, 0, 2]);
        assert_eq!(matched(Some("other"), None), [0, 0, 0]);
    }

    #[test]
    fn the_block_holding_the_last_prompt_token_is_never_a_hit() {
        // vLLM caps a prefix-cache hit at the prompt's length minus one token, so a prompt of
        // exactly k held blocks gets k - 1 of them (seen: 640 cached tokens, not 768, for a
        // 768-token prompt at block size 128).
        let index = VariantIndex::default();
        apply(&index, "a", vec![stored(None, &[1, 2], &[1, 2, 3, 4])]);
        let found = |tokens: &[u32]| index.match_tokens(tokens, &[id("a")]).unwrap();
        assert_eq!(found(&[1, 2, 3, 4]).matched, [1]);
        assert_eq!(found(&[1, 2, 3, 4]).blocks, 1);
        assert_eq!(found(&[1, 2, 3, 4, 5]).matched, [2]);
        assert_eq!(found(&[1, 2]).matched, [0]);
        assert_eq!(found(&[]).matched, [0]);
        // The tie-break key still covers the prompt's full blocks.
        assert_ne!(found(&[1, 2]).prefix_key, found(&[]).prefix_key);
    }

    #[test]
    fn media_and_localities_other_than_the_engines_own_cache_are_not_indexed() {
        let index = VariantIndex::default();
        let hashes = || index.request_hashes(&[1, 2]).unwrap();
        // An instance that never names a medium (older vLLM, older SGLang): its blocks count.
        let unnamed = with(stored(None, &[1], &[1, 2]), |event| event.medium = None);
        apply(&index, "old", vec![unnamed.clone()]);
        assert_eq!(index.matched_blocks_of(&hashes(), &id("old")), 1);
        // One that names it: its unnamed events are another tier's (LMCache), as are CPU,
        // SGLang's CPU_PINNED and REMOTE ones.
        apply(&index, "new", vec![stored(None, &[7], &[5, 5])]);
        for event in [
            unnamed,
            with(stored(None, &[1], &[1, 2]), |e| {
                e.medium = Some("CPU".into())
            }),
            with(stored(None, &[1], &[1, 2]), |e| {
                e.medium = Some("CPU_PINNED".into())
            }),
            with(stored(None, &[1], &[1, 2]), |e| {
                e.locality = Some("REMOTE".into())
            }),
        ] {
            apply(&index, "new", vec![event]);
        }
        assert_eq!(index.matched_blocks_of(&hashes(), &id("new")), 0);
        // A CPU tier's reset leaves the GPU entries; the engine's own reset clears them.
        apply(
            &index,
            "old",
            vec![KvEvent::AllBlocksCleared {
                medium: Some("CPU".into()),
            }],
        );
        assert_eq!(index.matched_blocks_of(&hashes(), &id("old")), 1);
        apply(
            &index,
            "old",
            vec![KvEvent::AllBlocksCleared { medium: None }],
        );
        assert_eq!(index.matched_blocks_of(&hashes(), &id("old")), 0);
    }

    #[test]
    fn a_hybrid_model_is_indexed_by_its_first_full_attention_group() {
        let index = VariantIndex::default();
        let group = |event: KvEvent, group: i64, kind: &str| {
            with(event, |e| {
                e.group_idx = Some(group);
                e.kv_cache_spec_kind = Some(kind.into());
            })
        };
        let removed_in = |hashes: &[u64], group: i64| {
            let KvEvent::BlockRemoved(mut removed) = removed(hashes) else {
                unreachable!()
            };
            removed.group_idx = Some(group);
            KvEvent::BlockRemoved(removed)
        };
        // Group 0 is a sliding window (it keeps only the tail), group 1 full attention: the
        // same engine hashes in both.
        apply(
            &index,
            "a",
            vec![
                group(stored(None, &[1, 2], &[1, 2, 3, 4]), 0, "sliding_window"),
                group(stored(None, &[1, 2], &[1, 2, 3, 4]), 1, "full_attention"),
                group(stored(None, &[9], &[9, 9]), 2, "mamba"),
            ],
        );
        let hashes = index.request_hashes(&[1, 2, 3, 4]).unwrap();
        assert_eq!(index.matched_blocks_of(&hashes, &id("a")), 2);
        // The window slides: group 0 drops block 1, group 1 still holds it.
        apply(&index, "a", vec![removed_in(&[1], 0), removed_in(&[9], 2)]);
        assert_eq!(index.matched_blocks_of(&hashes, &id("a")), 2);
        apply(&index, "a", vec![removed_in(&[2], 1)]);
        assert_eq!(index.matched_blocks_of(&hashes, &id("a")), 1);
        // Unlabelled events (older vLLM) follow group 0 as before.
        apply(&index, "b", vec![stored(None, &[1], &[1, 2])]);
        apply(
            &index,
            "b",
            vec![with(stored(None, &[5], &[1, 2]), |e| e.group_idx = Some(1))],
        );
        assert_eq!(index.block_count(&id("b")), 1);
    }

    #[test]
    fn the_block_size_is_the_full_blocks_not_a_partial_block_that_came_first() {
        let index = VariantIndex::default();
        // A partial tail entry (vLLM's hash-block granularity, or SGLang's last page) first.
        let partial = KvEvent::BlockStored(BlockStored {
            block_hashes: vec![EngineHash(50)],
            token_ids: vec![1],
            block_size: 1,
            ..BlockStored::default()
        });
        apply(&index, "a", vec![partial.clone()]);
        assert_eq!(index.block_size(), Some(1));
        apply(&index, "a", vec![stored(None, &[1, 2], &[1, 2, 3, 4])]);
        assert_eq!(index.block_size(), Some(2));
        apply(&index, "a", vec![partial]);
        assert_eq!(index.block_size(), Some(2));
        assert_eq!(index.block_count(&id("a")), 2);
        let hashes = index.request_hashes(&[1, 2, 3, 4]).unwrap();
        assert_eq!(index.matched_blocks_of(&hashes, &id("a")), 2);
    }

    #[test]
    fn a_larger_block_size_from_another_instance_changes_nothing() {
        let index = VariantIndex::default();
        apply(&index, "a", vec![stored(None, &[1, 2], &[1, 2, 3, 4])]);
        let misconfigured = KvEvent::BlockStored(BlockStored {
            block_hashes: vec![EngineHash(9)],
            token_ids: vec![1, 2, 3, 4],
            block_size: 4,
            ..BlockStored::default()
        });
        apply(&index, "b", vec![misconfigured]);
        assert_eq!(index.block_size(), Some(2));
        assert_eq!(index.block_count(&id("a")), 2, "another instance cleared a");
        assert_eq!(index.block_count(&id("b")), 0);
        apply(&index, "a", vec![stored(Some(2), &[3], &[5, 6])]);
        assert_eq!(index.block_count(&id("a")), 3);
    }

    #[test]
    fn the_budget_counts_tokens_so_small_pages_keep_as_many_tokens() {
        let settings = IndexSettings {
            max_blocks_per_instance: 1000,
        };
        assert_eq!(settings.blocks_at(16), 1000);
        assert_eq!(settings.blocks_at(1), 16_000);
        assert_eq!(settings.blocks_at(128), 125);
        assert_eq!(settings.blocks_at(100_000), 1);
        assert_eq!(settings.blocks_at(0), 16_000);
    }

    #[test]
    fn orphans_other_media_and_extra_keys_never_match() {
        let index = VariantIndex::default();
        let counters = IndexCounters::default();
        let settings = IndexSettings::default();
        let mut cpu = stored(None, &[5], &[1, 2]);
        if let KvEvent::BlockStored(event) = &mut cpu {
            event.medium = Some("CPU".into());
        }
        let mut salted = stored(None, &[6, 7], &[1, 2, 3, 4]);
        if let KvEvent::BlockStored(event) = &mut salted {
            event.extra_keys = vec![ExtraKeys::Opaque, ExtraKeys::None];
        }
        index.apply(
            &id("a"),
            &batch(vec![cpu, stored(Some(404), &[8], &[1, 2]), salted]),
            &settings,
            &counters,
        );
        let hashes = index.request_hashes(&[1, 2, 3, 4]).unwrap();
        assert_eq!(index.matched_blocks_of(&hashes, &id("a")), 0);
        assert_eq!(counters.blocks_orphaned.load(Ordering::Relaxed), 1);
        assert_eq!(counters.events_ignored.load(Ordering::Relaxed), 1);
        assert_eq!(index.block_count(&id("a")), 2);
    }

    #[test]
    fn the_budget_drops_the_oldest_tails_first() {
        let index = VariantIndex::default();
        let counters = IndexCounters::default();
        // 1 block of 16 tokens: 8 blocks of 2.
        let settings = IndexSettings {
            max_blocks_per_instance: 1,
        };
        let apply = |events| index.apply(&id("a"), &batch(events), &settings, &counters);
        apply(vec![stored(None, &[1, 2], &[1, 2, 3, 4])]);
        let second_tokens: Vec<u32> = (0..14).map(|t| 100 + t).collect();
        apply(vec![stored(None, &[3, 4, 5, 6, 7, 8, 9], &second_tokens)]);
        assert_eq!(index.block_count(&id("a")), 8);
        assert_eq!(counters.blocks_evicted.load(Ordering::Relaxed), 1);
        let first = index.request_hashes(&[1, 2, 3, 4]).unwrap();
        let second = index.request_hashes(&second_tokens).unwrap();
        assert_eq!(
            index.matched_blocks_of(&first, &id("a")),
            1,
            "the old tail went"
        );
        assert_eq!(index.matched_blocks_of(&second, &id("a")), 7);
        // The evicted block's engine hash is forgotten too: a child of it is an orphan.
        apply(vec![stored(Some(2), &[10], &[5, 6])]);
        assert_eq!(counters.blocks_orphaned.load(Ordering::Relaxed), 1);
    }

    #[test]
    fn stale_instances_score_nothing_and_leaving_drops_them() {
        let index = VariantIndex::default();
        apply(&index, "a", vec![stored(None, &[1], &[1, 2])]);
        let hashes = index.request_hashes(&[1, 2]).unwrap();
        index.set_freshness(&id("a"), Freshness::Stale);
        assert_eq!(index.matched_blocks_of(&hashes, &id("a")), 0);
        index.set_freshness(&id("a"), Freshness::Live);
        assert_eq!(index.matched_blocks_of(&hashes, &id("a")), 1);
        index.clear(&id("a"), false);
        assert_eq!(index.freshness(&id("a")), None);
        assert!(index.instances().is_empty());
    }

    #[test]
    fn two_indexes_fed_the_same_events_agree() {
        let events = || {
            vec![
                stored(None, &[1, 2, 3], &[1, 2, 3, 4, 5, 6]),
                stored(Some(2), &[9], &[7, 7]),
                removed(&[3]),
            ]
        };
        let (a, b) = (VariantIndex::default(), VariantIndex::default());
        for index in [&a, &b] {
            apply(index, "x", events());
            apply(index, "y", vec![stored(None, &[50], &[1, 2])]);
        }
        let ids = [id("x"), id("y")];
        for tokens in [&[1, 2, 3, 4, 5, 6][..], &[1, 2, 3, 4, 7, 7], &[1, 2]] {
            let hashes = a.request_hashes(tokens).unwrap();
            assert_eq!(
                a.matched_blocks(&hashes, &ids),
                b.matched_blocks(&hashes, &ids)
            );
        }
    }

    /// Prompt `p` of `len` tokens: its first `shared` tokens are those of its pair (0-1, 2-3),
    /// the rest its own.
    fn paired_prompt(p: usize, shared: usize, len: usize) -> Vec<u32> {
        (0..len)
            .map(|t| {
                if t < shared {
                    (p / 2 * 100 + t) as u32
                } else {
                    (p * 1000 + t) as u32
                }
            })
            .collect()
    }

    mod walk_cache {
        //! Walking from token ids (with the walk cache) against the plain linear walk over the
        //! prompt's hashes (`matched_blocks`), after every kind of change to the index: stores
        //! (some reusing another chain's engine hashes), removals, clears, an instance leaving
        //! and coming back, staleness, the budget, a larger block size; three chains (plain, a
        //! LoRA adapter, a salt) and three instance lists (with duplicates and an unknown id).
        use super::*;
        use proptest::prelude::*;

        const BLOCK: usize = 2;
        const BLOCKS: usize = 7;
        /// Four prompts of 7 blocks and a token; 0-1 share 4 blocks, 2-3 share 1.
        fn prompt(p: usize) -> Vec<u32> {
            paired_prompt(p, [4, 4, 1, 1][p] * BLOCK, BLOCKS * BLOCK + 1)
        }
        fn engine_hash(p: usize, j: usize, lora: bool) -> u64 {
            let mut chain: Vec<u8> = prompt(p)[..(j + 1) * BLOCK]
                .iter()
                .flat_map(|t| t.to_le_bytes())
                .collect();
            chain.push(u8::from(lora));
            xxhash_rust::xxh3::xxh3_64(&chain)
        }
        fn stored_as(
            parent: Option<u64>,
            hashes: &[u64],
            tokens: &[u32],
            block_size: u32,
            lora: bool,
        ) -> KvEvent {
            KvEvent::BlockStored(BlockStored {
                block_hashes: hashes.iter().map(|hash| EngineHash(*hash)).collect(),
                parent_block_hash: parent.map(EngineHash),
                token_ids: tokens.to_vec(),
                block_size,
                medium: Some("GPU".into()),
                lora_name: lora.then(|| "l".to_string()),
                extra_keys: if lora {
                    hashes
                        .iter()
                        .map(|_| ExtraKeys::Strings(vec!["l".into()]))
                        .collect()
                } else {
                    Vec::new()
                },
                ..BlockStored::default()
            })
        }
        /// The linear walk over the prompt's hashes.
        fn linear(
            index: &VariantIndex,
            tokens: &[u32],
            chain: ChainKey<'_>,
            list: &[InstanceId],
        ) -> Option<TokenMatch> {
            let block_size = index.block_size()?;
            let total = tokens.len().saturating_sub(1) / block_size;
            let full = tokens.len() / block_size;
            let mut hashes = Vec::new();
            chain_hashes(
                chain.seed(),
                &tokens[..full * block_size],
                block_size,
                &mut hashes,
            );
            Some(TokenMatch {
                matched: index.matched_blocks(&hashes[..total], list),
                blocks: total as u32,
                block_size,
                prefix_key: hashes[..PREFIX_KEY_BLOCKS.min(full)]
                    .last()
                    .copied()
                    .unwrap_or(0),
            })
        }
        const NAMES: [&str; 3] = ["x", "y", "z"];

        #[test]
        fn a_cleared_instance_is_walked_from_the_start_again() {
            let index = VariantIndex::default();
            let store = |count: usize| {
                let hashes: Vec<u64> = (0..count).map(|j| engine_hash(0, j, false)).collect();
                apply(
                    &index,
                    "x",
                    vec![stored_as(
                        None,
                        &hashes,
                        &prompt(0)[..count * BLOCK],
                        BLOCK as u32,
                        false,
                    )],
                );
            };
            let tokens = &prompt(0)[..9];
            let walk = || {
                index
                    .match_prompt(tokens, ChainKey::default(), &[id("x")])
                    .unwrap()
                    .matched
            };
            store(4);
            assert_eq!(walk(), [4]);
            apply(
                &index,
                "x",
                vec![KvEvent::AllBlocksCleared { medium: None }],
            );
            store(2);
            assert_eq!(walk(), [2]);
            index.clear(&id("x"), false);
            store(3);
            assert_eq!(walk(), [3]);
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(256))]

            #[test]
            fn a_walk_from_checkpoints_equals_the_linear_walk(
                budget in 0usize..3,
                ops in proptest::collection::vec((0usize..16, 0usize..3, 0usize..4, 0usize..BLOCKS, 1usize..5, any::<bool>(), any::<bool>()), 1..60),
            ) {
                let index = VariantIndex::default();
                let settings = IndexSettings { max_blocks_per_instance: [1, 2, DEFAULT_MAX_BLOCKS_PER_INSTANCE][budget] };
                let counters = IndexCounters::default();
                let lists: Vec<Vec<InstanceId>> = vec![
                    NAMES.iter().map(|name| id(name)).collect(),
                    vec![id("z"), id("y")],
                    vec![id("x"), id("x"), id("y"), id("w")],
                ];
                for (kind, instance, p, start, len, lora, flag) in ops {
                    let name = NAMES[instance];
                    let send = |events: Vec<KvEvent>| index.apply(&id(name), &batch(events), &settings, &counters);
                    match kind {
                        0..=7 => {
                            // Blocks [start, start + len) of prompt p after their parent; with
                            // `flag`, kind 7 reuses another prompt's engine hashes.
                            let end = (start + len).min(BLOCKS);
                            let hashed = if flag && kind == 7 { (p + 1) % 4 } else { p };
                            let hashes: Vec<u64> = (start..end).map(|j| engine_hash(hashed, j, lora)).collect();
                            let tokens = prompt(p)[start * BLOCK..end * BLOCK].to_vec();
                            let parent = start.checked_sub(1).map(|j| engine_hash(hashed, j, lora));
                            send(vec![stored_as(parent, &hashes, &tokens, BLOCK as u32, lora)]);
                        }
                        8..=10 => send(vec![removed(&[engine_hash(p, start, lora)])]),
                        11 => send(vec![KvEvent::AllBlocksCleared { medium: None }]),
                        12 => index.clear(&id(name), flag),
                        13 | 14 => index.set_freshness(&id(name), if flag { Freshness::Stale } else { Freshness::Live }),
                        _ => {
                            if flag && len == 4 {
                                // A larger block size: the index restarts if it comes from the
                                // instance that set the block size.
                                let hashes = [engine_hash(p, 0, lora) ^ 7];
                                send(vec![stored_as(None, &hashes, &prompt(p)[..2 * BLOCK], 2 * BLOCK as u32, lora)]);
                            }
                        }
                    }
                    for p in 0..4 {
                        for cut in [3usize, 9, 15] {
                            let tokens = &prompt(p)[..cut];
                            for chain in [ChainKey::default(), ChainKey { lora_name: Some("l"), cache_salt: None }] {
                                for list in &lists {
                                    let expected = linear(&index, tokens, chain, list);
                                    for round in 0..2 {
                                        let found = index.match_prompt(tokens, chain, list);
                                        prop_assert_eq!(&found, &expected, "prompt {} cut {} round {} list {:?}", p, cut, round, list);
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
    }

    mod model {
        //! The index against a plain model of what each engine holds, over random store and
        //! remove sequences like an engine's (a block is stored only after its parent; any
        //! held block may be evicted).
        use super::*;
        use proptest::prelude::{ProptestConfig, prop_assert_eq, proptest};
        use std::collections::HashMap;

        const BLOCK: usize = 2;
        /// Four prompts of 6 blocks; prompts 0-1 share 3 blocks, 2-3 share 1.
        fn prompt(p: usize) -> Vec<u32> {
            paired_prompt(p, [3, 3, 1, 1][p] * BLOCK, 6 * BLOCK)
        }
        /// The engine's hash of block j of prompt p: a function of the chain's content.
        fn engine_hash(p: usize, j: usize) -> u64 {
            let chain: Vec<u8> = prompt(p)[..(j + 1) * BLOCK]
                .iter()
                .flat_map(|t| t.to_le_bytes())
                .collect();
            xxhash_rust::xxh3::xxh3_64(&chain)
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(200))]

            #[test]
            fn matches_the_model(ops in proptest::collection::vec((0usize..2, 0usize..4, 0usize..6, 1usize..4, proptest::bool::ANY), 1..60)) {
                let index = VariantIndex::default();
                // Per instance: the engine hashes held (a store of a held one is a reuse report;
                // a removal removes).
                let mut held: Vec<HashMap<u64, ()>> = vec![HashMap::new(); 2];
                for (instance, p, start, len, store) in ops {
                    let name = ["x", "y"][instance];
                    let engine = &mut held[instance];
                    if store {
                        // From the first block the engine lacks (or a duplicate run at `start`
                        // when its parent is held), like a prefill after a cache hit.
                        let start = if start == 0 || engine.contains_key(&engine_hash(p, start - 1)) { start } else { 0 };
                        let end = (start + len).min(6);
                        let hashes: Vec<u64> = (start..end).map(|j| engine_hash(p, j)).collect();
                        let tokens = prompt(p)[start * BLOCK..end * BLOCK].to_vec();
                        let parent = start.checked_sub(1).map(|j| engine_hash(p, j));
                        for hash in &hashes {
                            engine.insert(*hash, ());
                        }
                        apply(&index, name, vec![stored(parent, &hashes, &tokens)]);
                    } else {
                        let hash = engine_hash(p, start);
                        if engine.remove(&hash).is_some() {
                            apply(&index, name, vec![removed(&[hash])]);
                        }
                    }
                    // Walking from token ids (twice: the second walk may start at checkpoints
                    // the first recorded, whatever changed since the last op).
                    for p in 0..4 {
                        for _ in 0..2 {
                            let Some(found) = index.match_tokens(&prompt(p), &[id("x"), id("y")]) else { continue };
                            for (instance, held) in held.iter().enumerate() {
                                // (The block of the last prompt token is never a hit.)
                                let expected = (0..5).take_while(|j| held.contains_key(&engine_hash(p, *j))).count() as u32;
                                prop_assert_eq!(found.matched[instance], expected, "prompt {} instance {}", p, instance);
                            }
                        }
                    }
                }
                for p in 0..4 {
                    let hashes = index.request_hashes(&prompt(p)).unwrap_or_default();
                    if hashes.is_empty() {
                        continue;
                    }
                    for (instance, name) in ["x", "y"].iter().enumerate() {
                        let expected = (0..6).take_while(|j| held[instance].contains_key(&engine_hash(p, *j))).count() as u32;
                        prop_assert_eq!(index.matched_blocks_of(&hashes, &id(name)), expected, "prompt {}", p);
                    }
                }
            }
        }
    }
}
