//! The engine model: a continuous-batching scheduler with chunked prefill, like vLLM V1's,
//! and the time model that prices each step. Pure code over a virtual clock (model seconds):
//! no tokio, no wall clock, so the timing math is unit-tested without sleeping. The async
//! driver (`driver.rs`) runs it in real time.
//!
//! One step:
//! 1. requests whose KV transfer has landed become runnable;
//! 2. every running request that decodes takes 1 token of the step's budget
//!    (`--max-num-batched-tokens`);
//! 3. the rest of the budget goes to prefill chunks, first of running requests, then of waiting
//!    ones admitted in FIFO order while there are seats (`--max-num-seqs`) and KV blocks;
//! 4. the step lasts `overhead + weights read + uncached prefill tokens / prefill rate +
//!    KV read time × decode context`: every forward pass reads the weights once, so a short
//!    prompt's prefill alone costs about a decode step. A long prefill stretches the step for
//!    every decode batched with it: the prefill/decode interference that disaggregation
//!    removes;
//! 5. at the end of the step, each decode emits one token, and so does each request whose
//!    prefill completed (its first token).
//!
//! Admission pins the request's cached leading blocks (at most `prompt − 1` tokens are taken
//! from the cache: the last prompt token is always computed, as in vLLM) and reserves blocks
//! for the rest of its prompt and all of its output. The full blocks a prefill chunk computes
//! are cached when the chunk is scheduled (as vLLM caches them when it allocates the step's
//! slots), so a request admitted later in the same step hits them. The sim never preempts.

use std::collections::VecDeque;

use crate::cache::{Lora, PrefixCache};

/// An engine-local request id.
pub type SeqId = u64;

/// Prices an engine step, in model seconds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TimeModel {
    pub step_overhead_s: f64,
    pub prefill_tokens_per_s: f64,
    pub weights_s_per_step: f64,
    pub kv_read_s_per_token: f64,
    pub kv_transfer_bytes_per_s: f64,
    pub kv_bytes_per_token: f64,
}

impl TimeModel {
    /// Duration of a step that prefills `prefill_tokens` (uncached) tokens and decodes
    /// `decode_seqs` requests whose contexts total `decode_context_tokens`.
    pub fn step_duration(
        &self,
        prefill_tokens: u64,
        decode_seqs: usize,
        decode_context_tokens: u64,
    ) -> f64 {
        let mut seconds = self.step_overhead_s + prefill_tokens as f64 / self.prefill_tokens_per_s;
        if prefill_tokens > 0 || decode_seqs > 0 {
            // One forward pass reads every weight once, for a prefill as for a decode.
            seconds += self.weights_s_per_step;
        }
        seconds + self.kv_read_s_per_token * decode_context_tokens as f64
    }

    /// Time to pull the KV cache of `tokens` tokens from a remote prefill engine.
    pub fn transfer_duration(&self, tokens: u64) -> f64 {
        tokens as f64 * self.kv_bytes_per_token / self.kv_transfer_bytes_per_s
    }
}

/// Scheduling limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    pub max_num_seqs: usize,
    pub max_num_batched_tokens: u64,
    pub block_size: usize,
    pub kv_cache_blocks: usize,
}

/// One step's batch under construction: decodes first, then prefill chunks while the token
/// budget lasts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepBuilder {
    budget_left: u64,
    prefill_tokens: u64,
    decode_seqs: usize,
    decode_context_tokens: u64,
}

impl StepBuilder {
    pub fn new(token_budget: u64) -> Self {
        Self {
            budget_left: token_budget,
            prefill_tokens: 0,
            decode_seqs: 0,
            decode_context_tokens: 0,
        }
    }

    /// Adds one decoding request with `context_tokens` of context; false if no budget is left.
    pub fn add_decode(&mut self, context_tokens: u64) -> bool {
        if self.budget_left == 0 {
            return false;
        }
        self.budget_left -= 1;
        self.decode_seqs += 1;
        self.decode_context_tokens += context_tokens;
        true
    }

    /// Adds a prefill chunk of up to `wanted` tokens; returns the tokens granted.
    pub fn add_prefill(&mut self, wanted: u64) -> u64 {
        let granted = wanted.min(self.budget_left);
        self.budget_left -= granted;
        self.prefill_tokens += granted;
        granted
    }

    pub fn budget_left(&self) -> u64 {
        self.budget_left
    }

    pub fn is_empty(&self) -> bool {
        self.prefill_tokens == 0 && self.decode_seqs == 0
    }

    pub fn prefill_tokens(&self) -> u64 {
        self.prefill_tokens
    }

    pub fn decode_seqs(&self) -> usize {
        self.decode_seqs
    }

    pub fn duration(&self, model: &TimeModel) -> f64 {
        model.step_duration(
            self.prefill_tokens,
            self.decode_seqs,
            self.decode_context_tokens,
        )
    }
}

/// What a request asks of the engine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SeqSpec {
    /// Prompt length in tokens.
    pub prompt_len: u32,
    /// Chained hashes of the prompt's full blocks (see [`crate::cache::block_hashes`]).
    pub block_hashes: Vec<u64>,
    /// The prompt's token ids (what KV-cache events report for each stored block). May be
    /// empty when events are off.
    pub prompt_tokens: Vec<u32>,
    /// Output tokens to generate (the request always runs to this length).
    pub max_tokens: u32,
    /// Leading prompt tokens whose KV a remote prefill engine computed
    /// (`kv_transfer_params.do_remote_prefill`): pulled over the wire instead of prefilled.
    pub remote_prompt_tokens: u32,
    /// vLLM's `kv_cache_report_mode` "full": the prefix blocks found in the cache are
    /// published again (a `BlockStored` from the first block) when the request is admitted.
    pub report_reuse: bool,
    /// The LoRA adapter the request runs under (its blocks are keyed and published as its).
    pub lora: Option<Lora>,
    /// vLLM's `skip_reading_prefix_cache` (prompt logprobs asked for, `echo` among them): the
    /// request finds nothing in the cache and computes its whole prompt.
    pub skip_prefix_cache: bool,
}

/// Why a request was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Rejected {
    #[error("the request needs {needed} KV-cache blocks but the engine has only {capacity}")]
    TooLarge { needed: usize, capacity: usize },
}

/// A request that finished at the end of a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FinishedSeq {
    pub id: SeqId,
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
    /// Prompt tokens found in this engine's prefix cache.
    pub cached_tokens: u32,
    /// Prompt tokens pulled from a remote prefill engine.
    pub transferred_tokens: u32,
}

/// What one step did.
#[derive(Debug, Clone, PartialEq)]
pub struct StepReport {
    pub start_s: f64,
    pub duration_s: f64,
    pub prefill_tokens: u64,
    pub decode_seqs: usize,
    /// Requests that emit one token at the end of the step, in batch order.
    pub tokens: Vec<SeqId>,
    /// Requests that finished with this step (their last token is in `tokens`).
    pub finished: Vec<FinishedSeq>,
}

impl StepReport {
    pub fn end_s(&self) -> f64 {
        self.start_s + self.duration_s
    }
}

/// The outcome of [`Scheduler::step`].
#[derive(Debug, Clone, PartialEq)]
pub enum Step {
    Ran(StepReport),
    /// Nothing can run before this virtual time, when a KV transfer lands.
    WaitUntil(f64),
    /// No work.
    Idle,
}

/// Cumulative counters, in tokens (vLLM counts prefix-cache queries and hits in tokens).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counters {
    pub prefix_cache_queries: u64,
    pub prefix_cache_hits: u64,
    pub prompt_tokens: u64,
    pub generation_tokens: u64,
    pub transferred_tokens: u64,
    /// Prompt tokens actually prefilled (neither cached nor transferred).
    pub prefill_tokens_computed: u64,
}

#[derive(Debug)]
struct Seq {
    id: SeqId,
    spec: SeqSpec,
    /// Prompt tokens whose KV is in place (cached, transferred or prefilled).
    computed: u32,
    generated: u32,
    cached_tokens: u32,
    transferred_tokens: u32,
    /// While a KV transfer is in flight: when it lands.
    transfer_lands_at: Option<f64>,
    /// How many leading prompt blocks this request holds in the cache table.
    held_blocks: usize,
    /// Blocks reserved and not in the table.
    private_blocks: usize,
}

impl Seq {
    fn ready(&self) -> bool {
        self.transfer_lands_at.is_none()
    }

    fn prefill_left(&self) -> u32 {
        self.spec.prompt_len - self.computed
    }

    fn decoding(&self) -> bool {
        self.ready() && self.prefill_left() == 0 && self.generated < self.spec.max_tokens
    }

    fn context_tokens(&self) -> u64 {
        u64::from(self.computed) + u64::from(self.generated)
    }

    fn finished(&self) -> bool {
        self.generated >= self.spec.max_tokens
    }

    /// Grants this request the prefill chunk the step's budget allows and caches the full
    /// blocks it computes at once, as vLLM does when it schedules them; whether it got one.
    fn schedule_prefill(
        &mut self,
        batch: &mut StepBuilder,
        cache: &mut PrefixCache,
        block_size: usize,
    ) -> bool {
        let granted = batch.add_prefill(u64::from(self.prefill_left()));
        if granted == 0 {
            return false;
        }
        self.computed += granted as u32;
        self.commit_computed_blocks(cache, block_size);
        true
    }

    /// Moves the blocks that `computed` now covers into the cache table, logging each run of
    /// blocks new to the table when the cache records events.
    fn commit_computed_blocks(&mut self, cache: &mut PrefixCache, block_size: usize) {
        let full = (self.computed as usize / block_size).min(self.spec.block_hashes.len());
        let start = self.held_blocks.min(full);
        let recording =
            cache.recording_events() && self.spec.prompt_tokens.len() >= full * block_size;
        // The run of consecutive new blocks being gathered for one event: (first index, hashes).
        let mut run: Option<(usize, Vec<u64>)> = None;
        for index in start..full {
            let hash = self.spec.block_hashes[index];
            let new = cache.commit(hash);
            self.private_blocks = self.private_blocks.saturating_sub(1);
            if !recording {
                continue;
            }
            match (&mut run, new) {
                (Some((_, hashes)), true) => hashes.push(hash),
                (None, true) => run = Some((index, vec![hash])),
                (Some(_), false) => self.log_run(cache, run.take(), block_size),
                (None, false) => {}
            }
        }
        self.log_run(cache, run, block_size);
        self.held_blocks = self.held_blocks.max(full);
    }

    fn log_run(&self, cache: &mut PrefixCache, run: Option<(usize, Vec<u64>)>, block_size: usize) {
        let Some((first, hashes)) = run else {
            return;
        };
        let parent = first
            .checked_sub(1)
            .map(|index| self.spec.block_hashes[index]);
        let tokens = self.spec.prompt_tokens
            [first * block_size..(first + hashes.len()) * block_size]
            .to_vec();
        cache.log_stored(parent, hashes, tokens, self.spec.lora.clone());
    }

    fn release(&self, cache: &mut PrefixCache) {
        cache.release(
            &self.spec.block_hashes[..self.held_blocks],
            self.private_blocks,
        );
    }
}

#[derive(Debug, Clone, Copy)]
enum Work {
    Decode(usize),
    /// A prefill chunk, already counted in the request's `computed` when it was scheduled.
    Prefill(usize),
}

/// The continuous-batching scheduler.
#[derive(Debug)]
pub struct Scheduler {
    model: TimeModel,
    limits: Limits,
    cache: PrefixCache,
    waiting: VecDeque<Seq>,
    running: Vec<Seq>,
    counters: Counters,
}

impl Scheduler {
    pub fn new(model: TimeModel, limits: Limits) -> Self {
        Self {
            model,
            limits,
            cache: PrefixCache::new(limits.kv_cache_blocks),
            waiting: VecDeque::new(),
            running: Vec::new(),
            counters: Counters::default(),
        }
    }

    pub fn time_model(&self) -> &TimeModel {
        &self.model
    }

    pub fn cache(&self) -> &PrefixCache {
        &self.cache
    }

    /// Starts (or stops) logging prefix-cache changes ([`crate::cache::CacheEvent`]).
    pub fn record_cache_events(&mut self, on: bool) {
        self.cache.record_events(on);
    }

    /// The prefix-cache changes since the last call.
    pub fn take_cache_events(&mut self) -> Vec<crate::cache::CacheEvent> {
        self.cache.take_events()
    }

    /// Caches blocks pushed by a prefill engine (LMCache) as if computed here: the run of
    /// `block_hashes` not yet cached, after the cached start, becomes cached (evictable, LRU),
    /// logged as stored for the KV events. `tokens` are the blocks' tokens (may be empty when
    /// events are off). Returns how many blocks were new; 0 when they do not fit.
    pub fn store_pushed(&mut self, block_hashes: &[u64], tokens: &[u32]) -> usize {
        let block_size = self.limits.block_size;
        let cache = &mut self.cache;
        let known = cache.longest_prefix(block_hashes);
        let new = &block_hashes[known..];
        if new.is_empty() || !cache.admit(&block_hashes[..known], new.len()) {
            return 0;
        }
        let mut stored = Vec::with_capacity(new.len());
        for hash in new {
            if cache.commit(*hash) {
                stored.push(*hash);
            }
        }
        if cache.recording_events() && tokens.len() >= block_hashes.len() * block_size {
            let parent = known.checked_sub(1).map(|index| block_hashes[index]);
            let run = tokens[known * block_size..block_hashes.len() * block_size].to_vec();
            // LMCache's push names no adapter: the blocks are published as the base model's.
            cache.log_stored(parent, new.to_vec(), run, None);
        }
        cache.release(block_hashes, 0);
        stored.len()
    }

    /// vLLM's `reset_prefix_cache`: empties the prefix cache unless a running request holds
    /// blocks (then false).
    pub fn reset_prefix_cache(&mut self) -> bool {
        self.cache.reset()
    }

    pub fn counters(&self) -> Counters {
        self.counters
    }

    /// Requests in the batch (not counting those waiting for a KV transfer).
    pub fn num_running(&self) -> usize {
        self.running.iter().filter(|seq| seq.ready()).count()
    }

    /// Requests queued, plus those waiting for a KV transfer (vLLM counts them as waiting).
    pub fn num_waiting(&self) -> usize {
        self.waiting.len() + self.running.len() - self.num_running()
    }

    pub fn is_idle(&self) -> bool {
        self.waiting.is_empty() && self.running.is_empty()
    }

    /// Queues a request under `id`, which must be unique among queued and running requests.
    /// Refused only if it could never fit in the KV cache.
    pub fn add(&mut self, id: SeqId, mut spec: SeqSpec) -> Result<(), Rejected> {
        debug_assert!(!self.contains(id), "request id {id} is already in use");
        spec.prompt_len = spec.prompt_len.max(1);
        spec.max_tokens = spec.max_tokens.max(1);
        spec.remote_prompt_tokens = spec.remote_prompt_tokens.min(spec.prompt_len - 1);
        let needed = self.blocks_for(&spec);
        if needed > self.cache.capacity() {
            return Err(Rejected::TooLarge {
                needed,
                capacity: self.cache.capacity(),
            });
        }
        self.waiting.push_back(Seq {
            id,
            spec,
            computed: 0,
            generated: 0,
            cached_tokens: 0,
            transferred_tokens: 0,
            transfer_lands_at: None,
            held_blocks: 0,
            private_blocks: 0,
        });
        Ok(())
    }

    /// Drops a request (client gone), freeing its seat and blocks. False if unknown.
    pub fn abort(&mut self, id: SeqId) -> bool {
        if let Some(index) = self.waiting.iter().position(|seq| seq.id == id) {
            self.waiting.remove(index);
            return true;
        }
        if let Some(index) = self.running.iter().position(|seq| seq.id == id) {
            let seq = self.running.remove(index);
            seq.release(&mut self.cache);
            return true;
        }
        false
    }

    pub fn contains(&self, id: SeqId) -> bool {
        self.waiting.iter().any(|seq| seq.id == id) || self.running.iter().any(|seq| seq.id == id)
    }

    /// Plans and applies one engine step starting at virtual time `now_s`.
    pub fn step(&mut self, now_s: f64) -> Step {
        self.land_transfers(now_s);

        let mut batch = StepBuilder::new(self.limits.max_num_batched_tokens);
        let mut work = Vec::new();
        for (index, seq) in self.running.iter().enumerate() {
            if seq.decoding() && batch.add_decode(seq.context_tokens()) {
                work.push(Work::Decode(index));
            }
        }
        // A chunk's blocks are cached when it is scheduled, as vLLM's `allocate_slots` caches
        // the blocks a step will compute: a request admitted later in the same step hits
        // them (measured on vLLM 0.32: two identical prompts scheduled in one step, the
        // second's full blocks all hit).
        let block_size = self.limits.block_size;
        for (index, seq) in self.running.iter_mut().enumerate() {
            if seq.ready()
                && seq.prefill_left() > 0
                && seq.schedule_prefill(&mut batch, &mut self.cache, block_size)
            {
                work.push(Work::Prefill(index));
            }
        }
        while batch.budget_left() > 0 && self.running.len() < self.limits.max_num_seqs {
            if !self.admit_next(now_s) {
                break;
            }
            let index = self.running.len() - 1;
            let seq = &mut self.running[index];
            if seq.ready() && seq.schedule_prefill(&mut batch, &mut self.cache, block_size) {
                work.push(Work::Prefill(index));
            }
        }

        if batch.is_empty() {
            return match self.next_transfer_landing() {
                Some(lands_at) => Step::WaitUntil(lands_at),
                None => Step::Idle,
            };
        }

        let mut tokens = Vec::with_capacity(work.len());
        for item in work {
            match item {
                Work::Decode(index) => {
                    let seq = &mut self.running[index];
                    seq.generated += 1;
                    tokens.push(seq.id);
                }
                Work::Prefill(index) => {
                    let seq = &mut self.running[index];
                    if seq.prefill_left() == 0 {
                        seq.generated += 1;
                        tokens.push(seq.id);
                    }
                }
            }
        }
        self.counters.generation_tokens += tokens.len() as u64;
        self.counters.prefill_tokens_computed += batch.prefill_tokens();

        let mut finished = Vec::new();
        let cache = &mut self.cache;
        self.running.retain(|seq| {
            if !seq.finished() {
                return true;
            }
            seq.release(cache);
            finished.push(FinishedSeq {
                id: seq.id,
                prompt_tokens: seq.spec.prompt_len,
                completion_tokens: seq.generated,
                cached_tokens: seq.cached_tokens,
                transferred_tokens: seq.transferred_tokens,
            });
            false
        });

        Step::Ran(StepReport {
            start_s: now_s,
            duration_s: batch.duration(&self.model),
            prefill_tokens: batch.prefill_tokens(),
            decode_seqs: batch.decode_seqs(),
            tokens,
            finished,
        })
    }

    /// Blocks a request reserves: its whole prompt and output.
    fn blocks_for(&self, spec: &SeqSpec) -> usize {
        let tokens = spec.prompt_len as usize + spec.max_tokens as usize;
        tokens.div_ceil(self.limits.block_size)
    }

    /// Moves the head of the queue into the batch if it has a seat and its blocks fit.
    fn admit_next(&mut self, now_s: f64) -> bool {
        let block_size = self.limits.block_size;
        let Some(seq) = self.waiting.front() else {
            return false;
        };
        let prompt_len = seq.spec.prompt_len;
        // At least the last prompt token is computed, so at most prompt − 1 come from cache.
        let max_hit_blocks = if seq.spec.skip_prefix_cache {
            0
        } else {
            ((prompt_len - 1) as usize / block_size).min(seq.spec.block_hashes.len())
        };
        let hit_blocks = self
            .cache
            .longest_prefix(&seq.spec.block_hashes[..max_hit_blocks]);
        let hits = &seq.spec.block_hashes[..hit_blocks];
        let new_blocks = self.blocks_for(&seq.spec) - hit_blocks;
        if !self.cache.admit(hits, new_blocks) {
            return false;
        }
        let Some(mut seq) = self.waiting.pop_front() else {
            return false;
        };
        let cached_tokens = (hit_blocks * block_size) as u32;
        seq.cached_tokens = cached_tokens;
        seq.computed = cached_tokens;
        seq.held_blocks = hit_blocks;
        seq.private_blocks = new_blocks;
        if seq.spec.report_reuse && hit_blocks > 0 && self.cache.recording_events() {
            // As vLLM's emit_cached_block_events: the reused prefix, from its first block.
            let tokens = seq
                .spec
                .prompt_tokens
                .get(..hit_blocks * block_size)
                .unwrap_or_default()
                .to_vec();
            self.cache.log_stored(
                None,
                seq.spec.block_hashes[..hit_blocks].to_vec(),
                tokens,
                seq.spec.lora.clone(),
            );
        }
        // A request that skips the prefix cache skips the remote KV too: it computes its whole
        // prompt (vLLM's scheduler drops its connector tokens).
        let transferred = if seq.spec.skip_prefix_cache {
            0
        } else {
            seq.spec.remote_prompt_tokens.saturating_sub(cached_tokens)
        };
        if transferred > 0 {
            seq.transferred_tokens = transferred;
            seq.transfer_lands_at =
                Some(now_s + self.model.transfer_duration(u64::from(transferred)));
        }
        // A request that skipped the lookup is not counted as a query (as vLLM's stats).
        if !seq.spec.skip_prefix_cache {
            self.counters.prefix_cache_queries += u64::from(prompt_len);
            self.counters.prefix_cache_hits += u64::from(cached_tokens);
        }
        self.counters.prompt_tokens += u64::from(prompt_len);
        self.counters.transferred_tokens += u64::from(transferred);
        self.running.push(seq);
        true
    }

    fn land_transfers(&mut self, now_s: f64) {
        let block_size = self.limits.block_size;
        for seq in &mut self.running {
            if seq
                .transfer_lands_at
                .is_some_and(|lands_at| lands_at <= now_s)
            {
                seq.transfer_lands_at = None;
                seq.computed += seq.transferred_tokens;
                seq.commit_computed_blocks(&mut self.cache, block_size);
            }
        }
    }

    fn next_transfer_landing(&self) -> Option<f64> {
        self.running
            .iter()
            .filter_map(|seq| seq.transfer_lands_at)
            .min_by(f64::total_cmp)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::cache::block_hashes;

    /// The time model of the flags' defaults (`config.rs` checks that they agree).
    pub(crate) fn model() -> TimeModel {
        TimeModel {
            step_overhead_s: 4.0 / 1e3,
            prefill_tokens_per_s: 25_000.0,
            weights_s_per_step: 10.0 / 1e3,
            kv_read_s_per_token: 0.02 / 1e6,
            kv_transfer_bytes_per_s: 50.0 * 1e9,
            kv_bytes_per_token: 327_680.0,
        }
    }

    /// The scheduling limits of the flags' defaults (`config.rs` checks that they agree).
    pub(crate) fn limits() -> Limits {
        Limits {
            max_num_seqs: 256,
            max_num_batched_tokens: 8192,
            block_size: 16,
            kv_cache_blocks: 79_000,
        }
    }

    /// A scheduler with the defaults' model and limits.
    fn scheduler() -> Scheduler {
        Scheduler::new(model(), limits())
    }

    fn spec(first_token: u32, prompt_len: u32, max_tokens: u32) -> SeqSpec {
        let tokens: Vec<u32> = (first_token..first_token + prompt_len).collect();
        SeqSpec {
            prompt_len,
            block_hashes: block_hashes(&tokens, 16),
            prompt_tokens: tokens,
            max_tokens,
            remote_prompt_tokens: 0,
            report_reuse: false,
            lora: None,
            skip_prefix_cache: false,
        }
    }

    /// Steps until idle (bounded); returns every report.
    fn run(scheduler: &mut Scheduler, now: &mut f64) -> Vec<StepReport> {
        let mut reports = Vec::new();
        for _ in 0..100_000 {
            match scheduler.step(*now) {
                Step::Ran(report) => {
                    *now = report.end_s();
                    reports.push(report);
                }
                Step::WaitUntil(at) => *now = at,
                Step::Idle => return reports,
            }
        }
        panic!("scheduler did not go idle");
    }

    /// Queues request `id` and steps until idle; returns every report.
    fn serve(
        scheduler: &mut Scheduler,
        now: &mut f64,
        id: SeqId,
        spec: SeqSpec,
    ) -> Vec<StepReport> {
        scheduler.add(id, spec).unwrap();
        run(scheduler, now)
    }

    /// Virtual times at which `id` got each of its tokens.
    fn token_times(reports: &[StepReport], id: SeqId) -> Vec<f64> {
        reports
            .iter()
            .filter(|report| report.tokens.contains(&id))
            .map(StepReport::end_s)
            .collect()
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-9
    }

    #[test]
    fn step_duration_follows_the_documented_formula() {
        let model = model();
        assert!(close(model.step_duration(0, 0, 0), 0.004));
        assert!(close(model.step_duration(25_000, 0, 0), 1.014));
        // A short prompt's prefill reads the weights as a decode step does.
        assert!(close(
            model.step_duration(15, 0, 0),
            model.step_duration(0, 1, 0) + 15.0 / 25_000.0
        ));
        assert!(close(
            model.step_duration(0, 3, 100_000),
            0.004 + 0.010 + 0.002
        ));
        assert!(close(
            model.step_duration(8_000, 1, 1_000),
            0.004 + 0.32 + 0.010 + 0.00002
        ));
        // 50 GB/s and 327,680 bytes per token: 8,000 tokens take 52.4 ms.
        assert!(close(model.transfer_duration(8_000), 0.052_428_8));
    }

    #[test]
    fn builder_gives_decodes_one_token_and_prefill_the_rest() {
        let mut batch = StepBuilder::new(10);
        assert!(batch.add_decode(100));
        assert!(batch.add_decode(50));
        assert_eq!(batch.add_prefill(5), 5);
        assert_eq!(batch.add_prefill(5), 3);
        assert_eq!(batch.add_prefill(5), 0);
        assert!(!batch.add_decode(1));
        assert_eq!(batch.prefill_tokens(), 8);
        assert!(close(
            batch.duration(&model()),
            model().step_duration(8, 2, 150)
        ));
    }

    #[test]
    fn single_request_ttft_and_itl() {
        let mut scheduler = scheduler();
        let mut now = 0.0;
        let reports = serve(&mut scheduler, &mut now, 1, spec(0, 1000, 4));
        let times = token_times(&reports, 1);
        assert_eq!(times.len(), 4);
        // First token after one prefill step of 1,000 tokens (it reads the weights too).
        assert!(close(times[0], 0.004 + 0.010 + 1000.0 / 25_000.0));
        // Then one decode step each: overhead + decode + KV read of ~1,000 tokens.
        let itl = times[1] - times[0];
        assert!(close(itl, 0.004 + 0.010 + 0.02 * 1001.0 / 1000.0 / 1000.0));
        assert_eq!(reports.last().unwrap().finished[0].completion_tokens, 4);
        assert_eq!(scheduler.cache().used_blocks(), 0);
    }

    #[test]
    fn long_prompts_prefill_in_chunks_of_the_budget() {
        let mut scheduler = scheduler();
        let mut now = 0.0;
        let reports = serve(&mut scheduler, &mut now, 1, spec(0, 20_000, 1));
        let chunks: Vec<u64> = reports.iter().map(|r| r.prefill_tokens).collect();
        assert_eq!(chunks, vec![8192, 8192, 3616]);
        assert!(close(now, 3.0 * (0.004 + 0.010) + 20_000.0 / 25_000.0));
    }

    #[test]
    fn prefill_time_is_proportional_to_uncached_tokens() {
        let mut scheduler = scheduler();
        let mut now = 0.0;
        serve(&mut scheduler, &mut now, 1, spec(0, 8_000, 1));
        let cold = now;

        // The same 8,000 tokens (500 full blocks) plus 100 new ones: only the 100 are prefilled.
        scheduler.add(2, spec(0, 8_100, 1)).unwrap();
        let start = now;
        let reports = run(&mut scheduler, &mut now);
        assert_eq!(reports[0].prefill_tokens, 100);
        assert_eq!(reports[0].finished[0].cached_tokens, 8_000);
        assert!(close(now - start, 0.004 + 0.010 + 100.0 / 25_000.0));
        assert!(close(cold, 0.004 + 0.010 + 8_000.0 / 25_000.0));
        let counters = scheduler.counters();
        assert_eq!(counters.prefix_cache_queries, 16_100);
        assert_eq!(counters.prefix_cache_hits, 8_000);
    }

    #[test]
    fn a_prompt_scheduled_after_the_same_prompt_in_one_step_hits_its_blocks() {
        // vLLM 0.32 caches a step's blocks when it schedules them: two identical 700-token
        // prompts scheduled together, the second's full blocks all hit (measured with its
        // `vllm:prefix_cache_hits_total`).
        let mut together = scheduler();
        let mut now = 0.0;
        together.add(1, spec(0, 700, 1)).unwrap();
        together.add(2, spec(0, 700, 1)).unwrap();
        let reports = run(&mut together, &mut now);
        assert_eq!(reports[0].prefill_tokens, 700 + 700 - 688);
        let mut cached: Vec<u32> = reports[0]
            .finished
            .iter()
            .map(|seq| seq.cached_tokens)
            .collect();
        cached.sort_unstable();
        assert_eq!(cached, vec![0, 688]);
        assert_eq!(together.counters().prefix_cache_hits, 688);
        // A chunk scheduled for a running request counts too: a 20,000-token prompt is
        // prefilled in chunks of the 8,192-token budget; the same prompt, arriving after the
        // first chunk, is admitted in the step of the last chunk (3,616 tokens) and hits every
        // full block but the one with its last token, that chunk's included (16,384 before).
        let mut chunked = scheduler();
        let mut now = 0.0;
        chunked.add(1, spec(0, 20_000, 1)).unwrap();
        let Step::Ran(first) = chunked.step(now) else {
            panic!("a step");
        };
        now = first.end_s();
        chunked.add(2, spec(0, 20_000, 1)).unwrap();
        let reports = run(&mut chunked, &mut now);
        let prefills: Vec<u64> = reports.iter().map(|r| r.prefill_tokens).collect();
        assert_eq!(prefills, vec![8_192, 3_616 + 16]);
        assert_eq!(chunked.counters().prefix_cache_hits, 19_984);
    }

    #[test]
    fn the_last_prompt_token_is_always_computed() {
        let mut scheduler = scheduler();
        let mut now = 0.0;
        for (id, len) in [(1, 32), (2, 32), (3, 33), (4, 31)] {
            let reports = serve(&mut scheduler, &mut now, id, spec(0, len, 1));
            let finished = reports.last().unwrap().finished[0];
            let expected = match id {
                1 => 0,  // cold
                2 => 16, // 32 tokens: the second block holds the last token
                3 => 32, // 33 tokens: both full blocks hit
                _ => 16, // 31 tokens: one full block
            };
            assert_eq!(finished.cached_tokens, expected, "request {id}");
        }
    }

    #[test]
    fn block_boundaries_fifteen_sixteen_seventeen() {
        let mut scheduler = scheduler();
        let mut now = 0.0;
        // Warm the cache with 48 tokens (3 full blocks).
        serve(&mut scheduler, &mut now, 1, spec(0, 48, 1));
        for (id, len, cached) in [(2, 15, 0), (3, 16, 0), (4, 17, 16), (5, 33, 32)] {
            let reports = serve(&mut scheduler, &mut now, id, spec(0, len, 1));
            assert_eq!(
                reports.last().unwrap().finished[0].cached_tokens,
                cached,
                "{len} tokens"
            );
        }
    }

    #[test]
    fn a_long_prefill_stretches_the_itl_of_running_decodes() {
        let mut scheduler = scheduler();
        let mut now = 0.0;
        scheduler.add(1, spec(0, 100, 50)).unwrap();
        let mut reports = Vec::new();
        // Let the short request decode alone for a few steps.
        for _ in 0..5 {
            let Step::Ran(report) = scheduler.step(now) else {
                panic!("should run");
            };
            now = report.end_s();
            reports.push(report);
        }
        scheduler.add(2, spec(1_000_000, 16_000, 1)).unwrap();
        reports.extend(run(&mut scheduler, &mut now));
        let times = token_times(&reports, 1);
        let itls: Vec<f64> = times.windows(2).map(|pair| pair[1] - pair[0]).collect();
        let quiet = itls[1];
        let during_prefill = itls[4];
        let after = itls[10];
        // While the 16,000-token prompt is prefilled (two chunks of 8,191 and 7,809), each
        // step also carries the decode, and takes ~0.33 s instead of ~0.014 s.
        assert!(quiet < 0.02, "{quiet}");
        assert!(during_prefill > 0.3, "{during_prefill}");
        assert!(after < 0.02, "{after}");
        assert_eq!(times.len(), 50);
    }

    #[test]
    fn max_num_seqs_caps_the_batch_and_the_rest_waits() {
        let limits = Limits {
            max_num_seqs: 2,
            ..limits()
        };
        let mut scheduler = Scheduler::new(model(), limits);
        for id in 0..4 {
            scheduler.add(id, spec(id as u32 * 1000, 100, 3)).unwrap();
        }
        let Step::Ran(report) = scheduler.step(0.0) else {
            panic!("should run");
        };
        assert_eq!(report.prefill_tokens, 200);
        assert_eq!(scheduler.num_running(), 2);
        assert_eq!(scheduler.num_waiting(), 2);
        let mut now = report.end_s();
        let reports = run(&mut scheduler, &mut now);
        let finished: Vec<SeqId> = reports
            .iter()
            .flat_map(|r| r.finished.iter().map(|f| f.id))
            .collect();
        assert_eq!(finished, vec![0, 1, 2, 3]);
    }

    #[test]
    fn admission_waits_for_kv_blocks() {
        let limits = Limits {
            kv_cache_blocks: 10,
            ..limits()
        };
        let mut scheduler = Scheduler::new(model(), limits);
        // Each needs (100 + 20) / 16 = 8 blocks: only one fits at a time.
        scheduler.add(1, spec(0, 100, 20)).unwrap();
        scheduler.add(2, spec(5000, 100, 20)).unwrap();
        assert_eq!(
            scheduler.add(3, spec(0, 200, 1)),
            Err(Rejected::TooLarge {
                needed: 13,
                capacity: 10
            })
        );
        let Step::Ran(_) = scheduler.step(0.0) else {
            panic!("should run");
        };
        assert_eq!(scheduler.num_running(), 1);
        assert_eq!(scheduler.num_waiting(), 1);
        let mut now = 1.0;
        let reports = run(&mut scheduler, &mut now);
        assert_eq!(reports.iter().map(|r| r.finished.len()).sum::<usize>(), 2);
    }

    #[test]
    fn abort_frees_the_seat_and_blocks() {
        let mut scheduler = scheduler();
        scheduler.add(1, spec(0, 100, 1000)).unwrap();
        scheduler.step(0.0);
        assert!(scheduler.cache().used_blocks() > 0);
        assert!(scheduler.abort(1));
        assert!(!scheduler.abort(1));
        assert_eq!(scheduler.cache().used_blocks(), 0);
        assert!(scheduler.is_idle());
        assert_eq!(scheduler.step(1.0), Step::Idle);
        // The computed full blocks stay cached.
        assert_eq!(scheduler.cache().cached_blocks(), 6);
    }

    #[test]
    fn remote_prefill_pays_transfer_time_instead_of_prefill() {
        let mut scheduler = scheduler();
        let mut request = spec(0, 8_000, 2);
        request.remote_prompt_tokens = 8_000;
        scheduler.add(1, request).unwrap();
        let mut now = 0.0;
        let first = scheduler.step(now);
        // Transfer of 7,999 tokens in flight (the last token is computed locally).
        let transfer = model().transfer_duration(7_999);
        assert_eq!(first, Step::WaitUntil(transfer));
        assert_eq!(scheduler.num_waiting(), 1);
        let reports = run(&mut scheduler, &mut now);
        assert_eq!(reports[0].prefill_tokens, 1);
        assert!(close(reports[0].start_s, transfer));
        let finished = reports.last().unwrap().finished[0];
        assert_eq!(finished.transferred_tokens, 7_999);
        assert_eq!(finished.cached_tokens, 0);
        assert_eq!(scheduler.counters().transferred_tokens, 7_999);
        assert_eq!(scheduler.counters().prefill_tokens_computed, 1);
        // The pulled blocks are now in this engine's cache.
        assert_eq!(scheduler.cache().cached_blocks(), 500);
        // Far faster than prefilling 8,000 tokens (0.324 s).
        assert!(now < 0.1, "{now}");
    }

    /// The event of `blocks` of `spec`'s prompt (16 tokens each) stored, chained to the block
    /// before them.
    fn stored(spec: &SeqSpec, blocks: std::ops::Range<usize>) -> crate::cache::CacheEvent {
        crate::cache::CacheEvent::Stored {
            parent: blocks
                .start
                .checked_sub(1)
                .map(|last| spec.block_hashes[last]),
            tokens: spec.prompt_tokens[blocks.start * 16..blocks.end * 16].to_vec(),
            hashes: spec.block_hashes[blocks].to_vec(),
            lora: None,
        }
    }

    #[test]
    fn reuse_reports_publish_the_reused_prefix_from_its_first_block() {
        let mut scheduler = scheduler();
        scheduler.record_cache_events(true);
        let mut now = 0.0;
        serve(&mut scheduler, &mut now, 1, spec(0, 40, 1));
        scheduler.take_cache_events();
        // The same prompt again: incremental mode publishes nothing, "full" the 2 reused
        // blocks (the last prompt token is always computed, so 39 tokens can hit: 2 blocks).
        serve(&mut scheduler, &mut now, 2, spec(0, 40, 1));
        assert_eq!(scheduler.take_cache_events(), vec![]);
        let full = SeqSpec {
            report_reuse: true,
            ..spec(0, 40, 1)
        };
        serve(&mut scheduler, &mut now, 3, full.clone());
        assert_eq!(scheduler.take_cache_events(), vec![stored(&full, 0..2)]);
    }

    #[test]
    fn stored_blocks_are_logged_in_runs_with_their_parent_and_tokens() {
        use crate::cache::CacheEvent;
        let mut scheduler = scheduler();
        scheduler.record_cache_events(true);
        let mut now = 0.0;
        serve(&mut scheduler, &mut now, 1, spec(0, 40, 1));
        let first = spec(0, 40, 1);
        assert_eq!(scheduler.take_cache_events(), vec![stored(&first, 0..2)]);
        // A longer prompt with the same start: only the new blocks, chained to the last old one.
        serve(&mut scheduler, &mut now, 2, spec(0, 70, 1));
        let second = spec(0, 70, 1);
        assert_eq!(scheduler.take_cache_events(), vec![stored(&second, 2..4)]);
        assert!(scheduler.reset_prefix_cache());
        assert_eq!(scheduler.take_cache_events(), vec![CacheEvent::Cleared]);
    }

    #[test]
    fn blocks_shared_within_one_step_are_stored_once_and_all_released() {
        // Two identical prompts scheduled in one step: one BlockStored event for the first's
        // full blocks (the second hits them, so it stores nothing new; with reuse reports it
        // publishes the reused prefix as vLLM's "full" mode does), and when both finish no
        // block is held.
        for report_reuse in [false, true] {
            let mut scheduler = scheduler();
            scheduler.record_cache_events(true);
            let mut now = 0.0;
            let prompt = SeqSpec {
                report_reuse,
                ..spec(0, 40, 1)
            };
            scheduler.add(1, prompt.clone()).unwrap();
            scheduler.add(2, prompt.clone()).unwrap();
            let reports = run(&mut scheduler, &mut now);
            assert_eq!(
                reports[0].prefill_tokens,
                40 + 8,
                "reuse reports {report_reuse}"
            );
            let mut expected = vec![stored(&prompt, 0..2)];
            if report_reuse {
                expected.push(stored(&prompt, 0..2));
            }
            assert_eq!(scheduler.take_cache_events(), expected);
            assert_eq!(scheduler.cache().used_blocks(), 0);
            assert_eq!(scheduler.cache().cached_blocks(), 2);
        }
    }

    #[test]
    fn remote_prefill_only_pulls_what_is_not_cached_locally() {
        let mut scheduler = scheduler();
        let mut now = 0.0;
        serve(&mut scheduler, &mut now, 1, spec(0, 4_000, 1));
        let mut request = spec(0, 8_000, 1);
        request.remote_prompt_tokens = 8_000;
        let reports = serve(&mut scheduler, &mut now, 2, request);
        let finished = reports.last().unwrap().finished[0];
        assert_eq!(finished.cached_tokens, 4_000);
        assert_eq!(finished.transferred_tokens, 3_999);
    }
}
