//! Token ids computed in the router (KvAwareRoutingConfig.Tokenizer): the model's Hugging Face
//! tokenizer and chat template from `--tokenizer-dir/NAME/`, rendered and tokenized as vLLM's
//! `/tokenize` would ([`switchyard_tokenize`]), so KV_AWARE (and a disaggregated endpoint's
//! KV_AWARE prefill and UNCACHED_TOKENS) need no engine round trip.
//!
//! - **Loading** happens off the request path: the first request naming a tokenizer starts its
//!   load on a thread of its own and is tokenized by the engine meanwhile (reason `loading`).
//!   A folder that cannot be loaded is logged and its requests go to the engine
//!   (`unavailable`); it is tried again [`RETRY_LOAD`] after each failure, so a folder put in
//!   place later is picked up without a restart; so do chat requests when the folder has no template or one the renderer
//!   cannot parse (`no_template`, `template_feature`, logged once at load).
//! - **Per request**, what the renderer does not follow (multimodal content, a request's own
//!   `chat_template`, …) goes to the engine; what vLLM would refuse too (a template's
//!   `raise_exception`, both `add_generation_prompt` and `continue_final_message`) is routed
//!   by load and the engine answers it.
//! - **The check**: a fraction of the requests tokenized here (`--tokenize-check-fraction`,
//!   default 1%) is also sent to the engine's `/tokenize`, apart from the request, which is
//!   routed on the router's ids at once (a checked request does not wait for an engine; at
//!   most [`MOST_CHECKS_RUNNING`] checks per tokenizer at a time, the rest counted `skipped`). A difference is counted and logged with
//!   the tokenizer's name; three among the last 16 checks turn the tokenizer off until the
//!   router restarts: its requests go to the engine (`disabled`), as they did before this
//!   tokenizer was configured.
//!
//! Tokenizers are at most [`MOST_TOKENIZERS`] per router, so the metrics' `tokenizer` label
//! is bounded (a name past that goes to the engine, `too_many`).

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use switchyard_process::metrics::TextEncoder;
use switchyard_tokenize::{EngineTokenizer, Refusal, Unsupported, Within};

/// How long after a failed load the folder is tried again.
pub const RETRY_LOAD: std::time::Duration = std::time::Duration::from_secs(30);
/// Tokenizer folders one router loads at most.
pub const MOST_TOKENIZERS: usize = 64;
/// Differences among the last [`CHECK_WINDOW`] checks that turn a tokenizer off.
pub const MISMATCHES_TO_DISABLE: u32 = 3;
/// The checks [`MISMATCHES_TO_DISABLE`] counts over (a tokenizer wrong for one request in
/// five or more is caught within a few windows).
pub const CHECK_WINDOW: u32 = 16;
/// The default share of locally tokenized requests also sent to the engine.
pub const DEFAULT_CHECK_FRACTION: f64 = 0.01;
/// Checks of one tokenizer under way at once at most (a request sampled beyond them is not
/// checked, counted `skipped`): an engine whose `/tokenize` hangs holds each one for
/// `--kv-tokenize-timeout-ms`, and one model's hanging engines do not stop another's checks.
pub const MOST_CHECKS_RUNNING: usize = 16;

/// Why a request's ids came from the engine although its variant names a tokenizer, beyond
/// [`Unsupported`]'s reasons.
const ROUTER_REASONS: [&str; 4] = ["loading", "unavailable", "disabled", "too_many"];

/// The router's tokenizers by name.
pub struct LocalTokenizers {
    dir: Option<PathBuf>,
    cache_bytes: usize,
    check_fraction: f64,
    slots: Mutex<HashMap<Arc<str>, Arc<Slot>>>,
    too_many: AtomicU64,
    retry: std::time::Duration,
}

/// A check under way, counted in its tokenizer's bound until it is dropped.
#[derive(Debug)]
pub struct CheckTicket(Arc<AtomicUsize>);

impl CheckTicket {
    fn take(running: &Arc<AtomicUsize>) -> Option<Self> {
        running
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |now| {
                (now < MOST_CHECKS_RUNNING).then_some(now + 1)
            })
            .ok()
            .map(|_| Self(Arc::clone(running)))
    }
}

impl Drop for CheckTicket {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

impl std::fmt::Debug for LocalTokenizers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalTokenizers")
            .field("dir", &self.dir)
            .field("check_fraction", &self.check_fraction)
            .finish_non_exhaustive()
    }
}

/// What [`LocalTokenizers::tokenize`] made of a body.
#[derive(Debug)]
pub enum Local {
    /// The ids, and a ticket when this request is one of the checked ones: its caller asks
    /// the engine too, apart from the request, and reports with [`LocalTokenizers::checked`].
    Ids {
        ids: Vec<u32>,
        check: Option<CheckTicket>,
    },
    /// Ask the engine (the reason is counted).
    Engine,
    /// vLLM would refuse it too: route by load.
    Refused(String),
    /// [`LocalTokenizers::tokenize_within`]: more fresh text than its budget (nothing done or
    /// counted); tokenize it where a wait does no harm.
    Costly,
}

impl LocalTokenizers {
    pub fn new(dir: Option<PathBuf>, cache_bytes: usize, check_fraction: f64) -> Self {
        Self {
            dir,
            cache_bytes,
            check_fraction,
            slots: Mutex::new(HashMap::new()),
            too_many: AtomicU64::new(0),
            retry: RETRY_LOAD,
        }
    }

    /// The same with failed loads tried again after `retry` (tests).
    #[cfg(test)]
    fn retrying_after(mut self, retry: std::time::Duration) -> Self {
        self.retry = retry;
        self
    }

    /// The slot of `name`, its load started on first use (None: too many names, counted).
    pub fn slot(&self, name: &Arc<str>) -> Option<Arc<Slot>> {
        let slot = self.slot_or_none(name);
        if slot.is_none() {
            self.too_many.fetch_add(1, Ordering::Relaxed);
        }
        slot
    }

    /// Starts loading `name` (the routing state names it) unless it is loaded, loading, or
    /// past [`MOST_TOKENIZERS`] (then left to the requests that name it, and counted there).
    pub fn preload(&self, name: &Arc<str>) {
        let _ = self.slot_or_none(name);
    }

    /// The slot of `name`, its load started on first use; None past [`MOST_TOKENIZERS`].
    fn slot_or_none(&self, name: &Arc<str>) -> Option<Arc<Slot>> {
        let mut slots = self
            .slots
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(slot) = slots.get(name) {
            return Some(Arc::clone(slot));
        }
        if slots.len() >= MOST_TOKENIZERS {
            return None;
        }
        let slot = Arc::new(Slot::new(
            Arc::clone(name),
            self.dir.clone(),
            self.cache_bytes,
            self.retry,
        ));
        slots.insert(Arc::clone(name), Arc::clone(&slot));
        drop(slots);
        Slot::start_load(&slot);
        Some(slot)
    }

    /// How tokenizer `name`'s engine cuts a truncated prompt that names no side
    /// ([`switchyard_tokenize::EngineTokenizer::truncation_cut`]); None until it is loaded.
    pub fn truncation_cut(
        &self,
        name: &Arc<str>,
        specials_added: bool,
    ) -> Option<switchyard_tokenize::truncation::Cut> {
        let slot = self.slot_or_none(name)?;
        slot.usable()
            .map(|tokenizer| tokenizer.truncation_cut(specials_added))
    }

    /// `body` (a `/tokenize` body) tokenized by `name`'s tokenizer, or why not. CPU work:
    /// callers run long bodies on a blocking thread.
    pub fn tokenize(&self, name: &Arc<str>, body: &[u8]) -> Local {
        self.tokenize_within(name, body, Within::ALL)
    }

    /// [`Self::tokenize`], or [`Local::Costly`] when it would take more work than `within`
    /// allows (new text the piece cache does not hold, new words the word cache does not
    /// hold): a prompt seen before costs tens of microseconds, a cold one about a millisecond
    /// per 3 KiB of new text.
    pub fn tokenize_within(&self, name: &Arc<str>, body: &[u8], within: Within) -> Local {
        let Some(slot) = self.slot(name) else {
            return Local::Engine;
        };
        // A panic in the tokenizer or the renderer costs this request its local ids, nothing
        // more.
        if slot.ready.get().is_none() {
            Slot::retry_load(&slot);
        }
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            slot.tokenize(body, within)
        }))
            .unwrap_or_else(|_| {
                tracing::error!(tokenizer = %name, "the router's tokenizer panicked on a request; asking the engine");
                Local::Engine
            });
        match outcome {
            Local::Ids { ids, .. } => {
                let sampled = self.check_fraction > 0.0 && fastrand::f64() < self.check_fraction;
                let check = sampled
                    .then(|| CheckTicket::take(&slot.checks_running))
                    .flatten();
                if sampled && check.is_none() {
                    slot.checks[3].fetch_add(1, Ordering::Relaxed);
                }
                Local::Ids { ids, check }
            }
            Local::Costly => {
                slot.costly.fetch_add(1, Ordering::Relaxed);
                Local::Costly
            }
            other => other,
        }
    }

    /// Counts a check of `name`'s ids against the engine's: equal, different, or the engine
    /// did not answer.
    pub fn checked(&self, name: &Arc<str>, engine: Option<&[u32]>, local: &[u32]) {
        let Some(slot) = self.slot(name) else { return };
        match engine {
            None => {
                slot.checks[2].fetch_add(1, Ordering::Relaxed);
            }
            Some(engine) if engine == local => {
                slot.checks[0].fetch_add(1, Ordering::Relaxed);
                slot.remember_check(false);
            }
            Some(engine) => {
                slot.checks[1].fetch_add(1, Ordering::Relaxed);
                let at = engine
                    .iter()
                    .zip(local)
                    .position(|(a, b)| a != b)
                    .unwrap_or(engine.len().min(local.len()));
                let run = slot.remember_check(true);
                tracing::warn!(
                    tokenizer = %name,
                    engine_tokens = engine.len(),
                    router_tokens = local.len(),
                    first_difference = at,
                    "the router's token ids differ from the engine's /tokenize"
                );
                if run >= MISMATCHES_TO_DISABLE && !slot.disabled.swap(true, Ordering::Relaxed) {
                    tracing::error!(
                        tokenizer = %name,
                        mismatches_of_last_16 = run,
                        "the router's tokenizer keeps disagreeing with the engine: its requests are tokenized by the engines' /tokenize until the router restarts (check that the folder holds the served model's tokenizer.json and chat template, the one passed to vLLM with --chat-template if any)"
                    );
                }
            }
        }
    }

    /// The metric families of every tokenizer loaded.
    pub fn render(&self, out: &mut TextEncoder) {
        let slots: Vec<Arc<Slot>> = {
            let slots = self
                .slots
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            let mut slots: Vec<Arc<Slot>> = slots.values().cloned().collect();
            slots.sort_by(|a, b| a.name.cmp(&b.name));
            slots
        };
        slot_counters(
            out,
            &slots,
            (
                "switchyard_router_local_tokenize_total",
                "Requests whose token ids the router computed with the variant's tokenizer (KvAwareRoutingConfig.Tokenizer), by outcome: local (computed here), refused (the template or vLLM's rules refuse it: routed by load, the engine answers), engine (asked of an engine's /tokenize; see switchyard_router_local_tokenize_engine_total).",
            ),
            ("outcome", &["local", "refused", "engine"]),
            |slot| &slot.outcomes,
        );
        slot_counters(
            out,
            &slots,
            (
                "switchyard_router_local_tokenize_engine_total",
                "Requests of a variant with a tokenizer whose ids were asked of an engine, by reason: what the renderer does not follow (no_template, template_feature, request_template, non_text, message, field, large) or the tokenizer's state (loading, unavailable: its folder could not be loaded, disabled: it disagreed with the engine, too_many: past 64 tokenizer names, counted without a tokenizer label).",
            ),
            ("reason", &engine_reasons().collect::<Vec<_>>()),
            |slot| &slot.engine,
        );
        out.sample(
            "switchyard_router_local_tokenize_engine_total",
            &[("reason", "too_many")],
            self.too_many.load(Ordering::Relaxed) as f64,
        );
        slot_counters(
            out,
            &slots,
            (
                "switchyard_router_local_tokenize_checks_total",
                "Locally tokenized requests also sent to an engine's /tokenize (--tokenize-check-fraction), by outcome: match, mismatch (three among the last 16 checks turn the tokenizer off), failed (the engine did not answer), skipped (sampled while 16 checks of the tokenizer were under way: not checked).",
            ),
            ("outcome", &["match", "mismatch", "failed", "skipped"]),
            |slot| &slot.checks,
        );
        out.family(
            "switchyard_router_local_tokenizer_usable",
            "gauge",
            "1 while the tokenizer is loaded and agrees with the engines; 0 while it loads, if its folder could not be loaded, or once it disagreed with the engine.",
        );
        for slot in &slots {
            out.sample(
                "switchyard_router_local_tokenizer_usable",
                &[("tokenizer", &slot.name)],
                f64::from(u8::from(slot.usable().is_some())),
            );
        }
        hits_and_misses(
            out,
            &slots,
            (
                "switchyard_router_local_tokenize_cache_total",
                "Pieces of prompt text (between the chat template's special tokens) looked up in the tokenizer's cache, by outcome: hit (not tokenized again), miss.",
            ),
            |slot| {
                let stats = slot.cache_stats();
                Some((stats.hits, stats.misses))
            },
        );
        hits_and_misses(
            out,
            &slots,
            (
                "switchyard_router_local_tokenize_words_total",
                "Pieces of new text (words, mostly) of a Llama 3-shaped tokenizer, by outcome: hit (found in its word cache), miss (asked of the BPE model).",
            ),
            |slot| slot.ready.get().and_then(EngineTokenizer::word_stats),
        );
        out.family(
            "switchyard_router_local_tokenize_blocking_total",
            "counter",
            "Prompts whose new text was over the serving thread's budget (more than 4 KiB, or 1 KiB of words not seen before): tokenized on a blocking thread.",
        );
        for slot in &slots {
            out.sample(
                "switchyard_router_local_tokenize_blocking_total",
                &[("tokenizer", &slot.name)],
                slot.costly.load(Ordering::Relaxed) as f64,
            );
        }
        out.family(
            "switchyard_router_local_tokenize_cache_bytes",
            "gauge",
            "Bytes the tokenizer's piece cache holds (at most --tokenize-cache-bytes).",
        );
        for slot in &slots {
            out.sample(
                "switchyard_router_local_tokenize_cache_bytes",
                &[("tokenizer", &slot.name)],
                slot.cache_stats().bytes as f64,
            );
        }
    }
}

fn engine_reasons() -> impl Iterator<Item = &'static str> {
    Unsupported::REASONS
        .iter()
        .copied()
        .chain(ROUTER_REASONS.iter().copied().take(3))
}

/// A counter family with one sample per tokenizer and value of `label`, read from each slot's
/// `counters` in the order of `values`.
/// A counter family of hits and misses per tokenizer (`of` None: no samples for that one).
fn hits_and_misses(
    out: &mut TextEncoder,
    slots: &[Arc<Slot>],
    (name, help): (&str, &str),
    of: impl Fn(&Slot) -> Option<(u64, u64)>,
) {
    out.family(name, "counter", help);
    for slot in slots {
        let Some((hits, misses)) = of(slot) else {
            continue;
        };
        for (outcome, count) in [("hit", hits), ("miss", misses)] {
            out.sample(
                name,
                &[("tokenizer", &slot.name), ("outcome", outcome)],
                count as f64,
            );
        }
    }
}

fn slot_counters(
    out: &mut TextEncoder,
    slots: &[Arc<Slot>],
    (name, help): (&str, &str),
    (label, values): (&str, &[&str]),
    counters: fn(&Slot) -> &[AtomicU64],
) {
    out.family(name, "counter", help);
    for slot in slots {
        for (value, count) in values.iter().zip(counters(slot)) {
            out.sample(
                name,
                &[("tokenizer", &slot.name), (label, value)],
                count.load(Ordering::Relaxed) as f64,
            );
        }
    }
}

/// One tokenizer: loading, loaded or failed, with its counters.
pub struct Slot {
    name: Arc<str>,
    dir: Option<PathBuf>,
    cache_bytes: usize,
    retry: std::time::Duration,
    /// The tokenizer, once a load succeeded.
    ready: OnceLock<EngineTokenizer>,
    /// A load is under way.
    loading: AtomicBool,
    /// When the last load failed (monotonic ms; 0: none has).
    failed_ms: AtomicU64,
    disabled: AtomicBool,
    /// The last checks, newest in the lowest bit: 1 for a difference.
    check_history: AtomicU32,
    /// local, refused, engine.
    outcomes: [AtomicU64; 3],
    /// By [`engine_reasons`].
    engine: [AtomicU64; Unsupported::REASONS.len() + 3],
    /// match, mismatch, failed, skipped.
    checks: [AtomicU64; 4],
    /// Checks under way ([`CheckTicket`]).
    checks_running: Arc<AtomicUsize>,
    /// Prompts over a caller's budget ([`Local::Costly`]).
    costly: AtomicU64,
}

impl Slot {
    fn new(
        name: Arc<str>,
        dir: Option<PathBuf>,
        cache_bytes: usize,
        retry: std::time::Duration,
    ) -> Self {
        Self {
            name,
            dir,
            cache_bytes,
            retry,
            ready: OnceLock::new(),
            loading: AtomicBool::new(false),
            failed_ms: AtomicU64::new(0),
            disabled: AtomicBool::new(false),
            check_history: AtomicU32::new(0),
            outcomes: Default::default(),
            engine: Default::default(),
            checks: Default::default(),
            checks_running: Arc::new(AtomicUsize::new(0)),
            costly: AtomicU64::new(0),
        }
    }

    /// Records a check's outcome; returns the differences among the last [`CHECK_WINDOW`].
    fn remember_check(&self, different: bool) -> u32 {
        let window = (1u32 << CHECK_WINDOW) - 1;
        let previous = self
            .check_history
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |history| {
                Some(((history << 1) | u32::from(different)) & window)
            })
            .unwrap_or(0);
        (((previous << 1) | u32::from(different)) & window).count_ones()
    }

    /// Starts a load on a thread of its own unless one is under way.
    fn start_load(slot: &Arc<Slot>) {
        if slot.loading.swap(true, Ordering::AcqRel) {
            return;
        }
        let loading = Arc::clone(slot);
        let started = std::thread::Builder::new()
            .name("switchyard-tokenizer-load".into())
            .spawn(move || loading.load());
        if let Err(err) = started {
            slot.fail(format!("no thread to load it on: {err}"));
        }
    }

    /// Starts a load again if the last one failed at least `retry` ago.
    fn retry_load(slot: &Arc<Slot>) {
        let failed = slot.failed_ms.load(Ordering::Acquire);
        if failed != 0
            && switchyard_process::clock::monotonic_ms().saturating_sub(failed)
                >= slot.retry.as_millis() as u64
        {
            Slot::start_load(slot);
        }
    }

    fn load(&self) {
        let Some(dir) = &self.dir else {
            self.fail("no --tokenizer-dir given".into());
            return;
        };
        let folder = dir.join(&*self.name);
        let started = std::time::Instant::now();
        match EngineTokenizer::load(&folder, self.cache_bytes) {
            Ok(tokenizer) => {
                match tokenizer.template_note() {
                    Some(note) => tracing::warn!(
                        tokenizer = %self.name,
                        folder = %folder.display(),
                        reason = note,
                        "chat requests are tokenized by the engines' /tokenize: the folder's chat template cannot be used here"
                    ),
                    None => tracing::info!(
                        tokenizer = %self.name,
                        folder = %folder.display(),
                        piece_cache = tokenizer.caches_pieces(),
                        ms = started.elapsed().as_millis() as u64,
                        "tokenizer loaded: token ids are computed in the router"
                    ),
                }
                let _ = self.ready.set(tokenizer);
                self.loading.store(false, Ordering::Release);
            }
            Err(err) => self.fail(err.to_string()),
        }
    }

    fn fail(&self, reason: String) {
        tracing::error!(
            tokenizer = %self.name,
            reason = %reason,
            retry_s = self.retry.as_secs(),
            "tokenizer not loaded: its requests are tokenized by the engines' /tokenize; tried again after the pause"
        );
        self.failed_ms.store(
            switchyard_process::clock::monotonic_ms().max(1),
            Ordering::Release,
        );
        self.loading.store(false, Ordering::Release);
    }

    /// The tokenizer, when loaded and not turned off.
    fn usable(&self) -> Option<&EngineTokenizer> {
        if self.disabled.load(Ordering::Relaxed) {
            return None;
        }
        self.ready.get()
    }

    fn cache_stats(&self) -> switchyard_tokenize::pieces::CacheStats {
        self.ready
            .get()
            .map(EngineTokenizer::cache_stats)
            .unwrap_or_default()
    }

    fn engine_reason(&self, reason: &str) -> Local {
        self.outcomes[2].fetch_add(1, Ordering::Relaxed);
        if let Some(index) = engine_reasons().position(|known| known == reason) {
            self.engine[index].fetch_add(1, Ordering::Relaxed);
        }
        Local::Engine
    }

    fn tokenize(&self, body: &[u8], within: Within) -> Local {
        let tokenizer = match self.ready.get() {
            None if self.failed_ms.load(Ordering::Acquire) == 0 => {
                return self.engine_reason("loading");
            }
            None => return self.engine_reason("unavailable"),
            Some(_) if self.disabled.load(Ordering::Relaxed) => {
                return self.engine_reason("disabled");
            }
            Some(tokenizer) => tokenizer,
        };
        match tokenizer.tokenize_within(body, within) {
            Ok(None) => Local::Costly,
            Ok(Some(ids)) => {
                self.outcomes[0].fetch_add(1, Ordering::Relaxed);
                Local::Ids { ids, check: None }
            }
            Err(Refusal::Engine(reason)) => self.engine_reason(reason.reason()),
            Err(Refusal::Invalid(reason)) => {
                self.outcomes[1].fetch_add(1, Ordering::Relaxed);
                Local::Refused(reason.to_string())
            }
        }
    }

    /// Waits (a bounded number of short sleeps) until the load has ended (tests).
    #[cfg(test)]
    fn wait_loaded(&self) {
        for _ in 0..500 {
            if !self.loading.load(Ordering::Acquire) {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// At most 64 bytes of new text.
    const BYTES_64: Within = Within {
        fresh_bytes: 64,
        new_words: usize::MAX,
    };

    const TEMPLATE: &str = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

    /// A folder with a word-level tokenizer (whitespace split) and ChatML markers.
    fn folder(template: Option<&str>) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        let model = dir.path().join("m");
        std::fs::create_dir(&model).unwrap();
        let tokenizer = serde_json::json!({
            "version": "1.0",
            "added_tokens": [
                {"id": 0, "content": "<|im_start|>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true},
                {"id": 1, "content": "<|im_end|>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true},
            ],
            "normalizer": null,
            "pre_tokenizer": {"type": "Whitespace"},
            "post_processor": null,
            "decoder": null,
            "model": {"type": "WordLevel", "vocab": {"<|im_start|>": 0, "<|im_end|>": 1, "[UNK]": 2, "user": 3, "assistant": 4, "hello": 5, "world": 6}, "unk_token": "[UNK]"}
        });
        std::fs::write(model.join("tokenizer.json"), tokenizer.to_string()).unwrap();
        std::fs::write(
            model.join("tokenizer_config.json"),
            r#"{"eos_token":"<|im_end|>"}"#,
        )
        .unwrap();
        if let Some(template) = template {
            std::fs::write(model.join("chat_template.jinja"), template).unwrap();
        }
        dir
    }

    fn loaded(tokenizers: &LocalTokenizers) -> Arc<Slot> {
        let slot = tokenizers.slot(&Arc::from("m")).unwrap();
        slot.wait_loaded();
        slot
    }

    /// The tokenizer `m` of a folder with TEMPLATE (1 MiB cache, checking `check_fraction`),
    /// loaded: the folder (kept while the test runs), the tokenizers, its slot.
    fn templated(check_fraction: f64) -> (tempfile::TempDir, LocalTokenizers, Arc<Slot>) {
        let dir = folder(Some(TEMPLATE));
        let tokenizers = LocalTokenizers::new(Some(dir.path().into()), 1 << 20, check_fraction);
        let slot = loaded(&tokenizers);
        (dir, tokenizers, slot)
    }

    #[test]
    fn a_chat_is_rendered_and_tokenized_here_and_what_is_not_followed_goes_to_the_engine() {
        let (_dir, tokenizers, _) = templated(0.0);
        let name: Arc<str> = Arc::from("m");
        let chat = br#"{"model":"m","messages":[{"role":"user","content":"hello world"}]}"#;
        assert!(matches!(
            tokenizers.tokenize(&name, chat),
            Local::Ids { ids, check: None } if ids == [0, 3, 5, 6, 1, 0, 4]
        ));
        // A completions body whose `messages` is null is read as vLLM reads it: its prompt.
        let prompt = br#"{"model":"m","prompt":"hello world"}"#;
        let null_messages = br#"{"model":"m","prompt":"hello world","messages":null}"#;
        let Local::Ids { ids, .. } = tokenizers.tokenize(&name, prompt) else {
            panic!("a prompt is tokenized here");
        };
        assert!(matches!(
            tokenizers.tokenize(&name, null_messages),
            Local::Ids { ids: same, .. } if same == ids
        ));
        let image = br#"{"messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"x"}}]}]}"#;
        assert!(matches!(tokenizers.tokenize(&name, image), Local::Engine));
        let both = br#"{"messages":[{"role":"user","content":"x"}],"continue_final_message":true}"#;
        assert!(matches!(
            tokenizers.tokenize(&name, both),
            Local::Refused(_)
        ));
        let mut out = TextEncoder::new();
        tokenizers.render(&mut out);
        let text = out.finish();
        assert!(
            text.contains(
                r#"switchyard_router_local_tokenize_total{tokenizer="m",outcome="local"} 3"#
            ),
            "{text}"
        );
        assert!(text.contains(r#"switchyard_router_local_tokenize_engine_total{tokenizer="m",reason="non_text"} 1"#), "{text}");
        assert!(
            text.contains(r#"switchyard_router_local_tokenizer_usable{tokenizer="m"} 1"#),
            "{text}"
        );
    }

    #[test]
    fn boolean_fields_are_read_as_vllm_reads_them() {
        use serde_json::json;
        let (_dir, tokenizers, _) = templated(0.0);
        let name: Arc<str> = Arc::from("m");
        let ids = |body: serde_json::Value| match tokenizers
            .tokenize(&name, body.to_string().as_bytes())
        {
            Local::Ids { ids, .. } => Ok(ids),
            Local::Refused(reason) => Err(reason),
            other => Err(format!("{other:?}")),
        };
        let chat = |flag: serde_json::Value| {
            serde_json::json!({"messages": [{"role": "user", "content": "hello"}],
                "add_generation_prompt": flag})
        };
        let (with, without) = (
            ids(chat(true.into())).unwrap(),
            ids(chat(false.into())).unwrap(),
        );
        assert_ne!(with, without);
        // pydantic's lax booleans, as vLLM's request models take them (None: refused).
        let spellings = [
            (json!(1), Some(true)),
            (json!(1.0), Some(true)),
            (json!("true"), Some(true)),
            (json!("Yes"), Some(true)),
            (json!("ON"), Some(true)),
            (json!("t"), Some(true)),
            (json!(0), Some(false)),
            (json!("false"), Some(false)),
            (json!("No"), Some(false)),
            (json!("off"), Some(false)),
            (json!("f"), Some(false)),
            (json!("0"), Some(false)),
            (json!(null), None),
            (json!(2), None),
            (json!(0.5), None),
            (json!("maybe"), None),
            (json!(" true"), None),
            (json!([]), None),
        ];
        for (spelling, read) in spellings {
            let expected = match read {
                Some(true) => Ok(with.clone()),
                Some(false) => Ok(without.clone()),
                None => Err(()),
            };
            assert_eq!(
                ids(chat(spelling.clone())).map_err(|_| ()),
                expected,
                "{spelling}"
            );
        }
        // vLLM tests the two flags as given before it reads them: "false" is a non-empty
        // string, so this asks for both and is refused.
        let mut both = chat(json!("false"));
        both["continue_final_message"] = json!(true);
        assert!(ids(both).is_err());
        let mut continued = chat(json!(false));
        continued["continue_final_message"] = json!("yes");
        assert!(ids(continued).is_ok());
        // A chat's add_special_tokens "true" adds a BOS the template does not write: the
        // engine is asked.
        let special = json!({"messages": [{"role": "user", "content": "hello"}],
            "add_special_tokens": "true"});
        assert!(matches!(
            tokenizers.tokenize(&name, special.to_string().as_bytes()),
            Local::Engine
        ));
    }

    #[test]
    fn a_prompt_with_more_uncached_text_than_the_budget_is_left_for_a_blocking_thread() {
        let (dir, tokenizers, slot) = templated(0.0);
        let name: Arc<str> = Arc::from("m");
        let long = vec!["hello world"; 200].join(" ");
        let chat = |question: &str| {
            serde_json::json!({"messages": [
                {"role": "system", "content": long},
                {"role": "user", "content": question},
            ]})
            .to_string()
        };
        let first = chat("hello");
        let looked_up = |slot: &Slot| slot.cache_stats().misses + slot.cache_stats().hits;
        let before = looked_up(&slot);
        assert!(
            matches!(
                tokenizers.tokenize_within(&name, first.as_bytes(), BYTES_64),
                Local::Costly
            ),
            "2 KiB of new text is over a 64-byte budget"
        );
        assert_eq!(looked_up(&slot), before, "nothing tokenized or counted");
        let mut out = TextEncoder::new();
        tokenizers.render(&mut out);
        assert!(
            out.finish()
                .contains(r#"switchyard_router_local_tokenize_blocking_total{tokenizer="m"} 1"#)
        );
        let Local::Ids { ids: whole, .. } = tokenizers.tokenize(&name, first.as_bytes()) else {
            panic!("tokenized without a budget")
        };
        // The system prompt is cached now: a new question is within the budget, and the ids
        // are those of tokenizing everything.
        let second = chat("world hello");
        let Local::Ids { ids, .. } = tokenizers.tokenize_within(&name, second.as_bytes(), BYTES_64)
        else {
            panic!("the new text is 11 bytes")
        };
        let uncached = LocalTokenizers::new(Some(dir.path().into()), 0, 0.0);
        loaded(&uncached);
        let Local::Ids { ids: fresh, .. } = uncached.tokenize(&name, second.as_bytes()) else {
            panic!("tokenized without a cache")
        };
        assert_eq!(ids, fresh);
        // "hello" then "world hello", each followed by <|im_end|>, <|im_start|>, "assistant".
        assert_eq!(ids[..ids.len() - 5], whole[..whole.len() - 4]);
        let mut out = TextEncoder::new();
        tokenizers.render(&mut out);
        assert!(
            out.finish().contains(
                r#"switchyard_router_local_tokenize_total{tokenizer="m",outcome="local"} 2"#
            ),
            "the refused attempt is not counted as an outcome"
        );
    }

    #[test]
    fn without_a_word_cache_every_8_bytes_of_new_text_count_as_a_new_word() {
        // The tests' toy tokenizer is not of Llama 3's shape: no fast way, no word cache.
        let (_dir, tokenizers, _slot) = templated(0.0);
        let name: Arc<str> = Arc::from("m");
        let question = "hello world ".repeat(8); // 96 bytes: 12 words of 8 bytes.
        let body =
            serde_json::json!({"messages": [{"role": "user", "content": question}]}).to_string();
        let within = |new_words| Within {
            fresh_bytes: 4096,
            new_words,
        };
        // The rendered prompt's new text is the question and the template's own pieces.
        assert!(matches!(
            tokenizers.tokenize_within(&name, body.as_bytes(), within(11)),
            Local::Costly
        ));
        let Local::Ids { ids, .. } = tokenizers.tokenize_within(&name, body.as_bytes(), within(64))
        else {
            panic!("within 64 words")
        };
        let Local::Ids { ids: whole, .. } = tokenizers.tokenize(&name, body.as_bytes()) else {
            panic!("tokenized without a budget")
        };
        assert_eq!(ids, whole);
    }

    #[test]
    fn a_new_piece_repeated_in_one_prompt_is_tokenized_once() {
        let dir = folder(Some(TEMPLATE));
        // No cache at all: only the call's own memory can spare the repeats.
        let tokenizers = LocalTokenizers::new(Some(dir.path().into()), 0, 0.0);
        let slot = loaded(&tokenizers);
        let name: Arc<str> = Arc::from("m");
        let messages: Vec<serde_json::Value> = (0..50)
            .map(|_| serde_json::json!({"role": "user", "content": "hello world"}))
            .collect();
        let body = serde_json::json!({"messages": messages}).to_string();
        let before = slot.cache_stats();
        let Local::Ids { ids, .. } = tokenizers.tokenize_within(&name, body.as_bytes(), BYTES_64)
        else {
            panic!("three distinct pieces of 27 bytes in all are within 64")
        };
        assert_eq!(ids.len(), 50 * 5 + 2);
        let after = slot.cache_stats();
        assert_eq!(
            after.misses - before.misses,
            3,
            "user+text, the newline, assistant"
        );
        assert_eq!(after.hits - before.hits, 98);
    }

    #[test]
    fn a_folder_put_in_place_after_a_failed_load_is_picked_up() {
        let dir = tempfile::tempdir().unwrap();
        let tokenizers = LocalTokenizers::new(Some(dir.path().into()), 1 << 20, 0.0)
            .retrying_after(std::time::Duration::ZERO);
        let name: Arc<str> = Arc::from("m");
        let slot = loaded(&tokenizers);
        assert!(matches!(
            tokenizers.tokenize(&name, br#"{"prompt":"hello"}"#),
            Local::Engine
        ));
        slot.wait_loaded();
        let ready = folder(Some(TEMPLATE));
        std::fs::rename(ready.path().join("m"), dir.path().join("m")).unwrap();
        // The next request starts another load; the one after finds it done.
        let _ = tokenizers.tokenize(&name, br#"{"prompt":"hello"}"#);
        slot.wait_loaded();
        assert!(matches!(
            tokenizers.tokenize(&name, br#"{"prompt":"hello"}"#),
            Local::Ids { ids, .. } if ids == [5]
        ));
    }

    #[test]
    fn what_a_chat_completion_adds_to_the_template_is_rendered_and_sent_in_the_kwargs() {
        use crate::plan::tokens::{PromptKind, tokenize_body};
        use serde_json::json;
        // Documents' texts, then "hello" if thinking, "world" if not, then the effort (an
        // unknown word: 2), then the conversation.
        let dir = folder(Some(
            "{% for d in documents or [] %}{{ d.text }} {% endfor %}\
             {% if enable_thinking is defined %}{{ 'hello' if enable_thinking else 'world' }} {% endif %}\
             {% if reasoning_effort is defined %}{{ reasoning_effort }} {% endif %}\
             {% for m in messages %}<|im_start|>{{ m.role }} {{ m.content }}<|im_end|>{% endfor %}",
        ));
        let tokenizers = LocalTokenizers::new(Some(dir.path().into()), 1 << 20, 0.0);
        loaded(&tokenizers);
        let name: Arc<str> = Arc::from("m");
        let ids = |body: &[u8]| match tokenizers.tokenize(&name, body) {
            Local::Ids { ids, .. } => Ok(ids),
            other => Err(format!("{other:?}")),
        };
        // As the request's own body, and as the `/tokenize` body an engine would be sent.
        let both = |extra: serde_json::Value| {
            let mut body =
                json!({"model": "m", "messages": [{"role": "user", "content": "hello"}]});
            for (name, value) in extra.as_object().unwrap() {
                body[name] = value.clone();
            }
            let body = body.to_string();
            let direct = ids(body.as_bytes());
            let sent = tokenize_body(PromptKind::Chat, body.as_bytes()).unwrap();
            // vLLM's `/tokenize` takes neither field: they travel in the kwargs.
            let fields: serde_json::Value = serde_json::from_slice(&sent).unwrap();
            assert!(fields.get("documents").is_none(), "{fields}");
            assert!(fields.get("reasoning_effort").is_none(), "{fields}");
            (direct, ids(&sent))
        };
        let chat = [0, 3, 5, 1];
        let with = |head: &[u32]| Ok(head.iter().chain(&chat).copied().collect::<Vec<u32>>());
        for (extra, expected) in [
            (json!({}), with(&[])),
            (
                json!({"documents": [{"title": "t", "text": "world"}]}),
                with(&[6]),
            ),
            // The request's documents win over the kwargs'; the kwargs' alone are rendered.
            (
                json!({"documents": [{"text": "world"}],
                       "chat_template_kwargs": {"documents": [{"text": "hello"}]}}),
                with(&[6]),
            ),
            (
                json!({"chat_template_kwargs": {"documents": [{"text": "hello"}]}}),
                with(&[5]),
            ),
            (json!({"reasoning_effort": "none"}), with(&[6, 2])),
            (json!({"reasoning_effort": "high"}), with(&[5, 2])),
            // The kwargs' enable_thinking stays; the request's effort wins over theirs.
            (
                json!({"reasoning_effort": "high",
                       "chat_template_kwargs": {"enable_thinking": false, "reasoning_effort": "low"}}),
                with(&[6, 2]),
            ),
            (
                json!({"reasoning_effort": null, "documents": null}),
                with(&[]),
            ),
            // A kwarg named enable_thinking keeps vLLM from setting it, even a null or
            // "auto" one, which its renderer then drops.
            (
                json!({"reasoning_effort": "high", "chat_template_kwargs": {"enable_thinking": null}}),
                with(&[2]),
            ),
            (
                json!({"reasoning_effort": "high", "chat_template_kwargs": {"enable_thinking": "auto"}}),
                with(&[2]),
            ),
        ] {
            let (direct, sent) = both(extra.clone());
            assert_eq!(direct, expected, "{extra}");
            assert_eq!(sent, expected, "{extra} as the /tokenize body");
        }
        // What vLLM refuses is refused here; the `/tokenize` body leaves it out.
        for bad in [
            json!({"reasoning_effort": "bogus"}),
            json!({"reasoning_effort": 3}),
            json!({"documents": [{"text": 5}]}),
            json!({"documents": {"text": "x"}}),
            json!({"chat_template_kwargs": {"documents": "abc"}}),
            json!({"chat_template_kwargs": {"documents": [1]}}),
        ] {
            let (direct, _) = both(bad.clone());
            assert!(
                direct.as_ref().is_err_and(|why| why.contains("Refused")),
                "{bad}: {direct:?}"
            );
        }
    }

    #[test]
    fn documents_reach_the_engine_with_their_keys_in_the_order_given() {
        use crate::plan::tokens::{PromptKind, tokenize_body};
        let dir = folder(Some(
            "{{ documents | tojson }} {% for m in messages %}{{ m.content }}{% endfor %}",
        ));
        let tokenizers = LocalTokenizers::new(Some(dir.path().into()), 1 << 20, 0.0);
        loaded(&tokenizers);
        let name: Arc<str> = Arc::from("m");
        let ids = |body: &[u8]| match tokenizers.tokenize(&name, body) {
            Local::Ids { ids, .. } => ids,
            other => panic!("{other:?}"),
        };
        // "title" before "text", as Python keeps them; and with a reasoning_effort, which
        // rewrites the kwargs, and a number Rust's f64 would round.
        for body in [
            r#"{"messages":[{"role":"user","content":"hello"}],"documents":[{"title":"hello","text":"world"}]}"#,
            r#"{"messages":[{"role":"user","content":"hello"}],"documents":[{"title":"hello","text":"world"}],
               "reasoning_effort":"low","chat_template_kwargs":{"n":{"b":1,"a":100000000000000000001}}}"#,
        ] {
            let direct = ids(body.as_bytes());
            let hello = direct.iter().position(|&id| id == 5).unwrap();
            let world = direct.iter().position(|&id| id == 6).unwrap();
            assert!(hello < world, "{direct:?}");
            let sent = tokenize_body(PromptKind::Chat, body.as_bytes()).unwrap();
            assert_eq!(ids(&sent), direct, "{}", String::from_utf8_lossy(&sent));
            let text = String::from_utf8_lossy(&sent);
            assert!(
                text.contains(r#"{"title":"hello","text":"world"}"#),
                "{text}"
            );
            if body.contains("reasoning_effort") {
                assert!(
                    text.contains(r#"{"b":1,"a":100000000000000000001}"#),
                    "{text}"
                );
            }
        }
    }

    #[test]
    fn a_missing_folder_or_template_leaves_the_requests_to_the_engine() {
        let tokenizers = LocalTokenizers::new(Some("/nonexistent-switchyard".into()), 1 << 20, 0.0);
        loaded(&tokenizers);
        assert!(matches!(
            tokenizers.tokenize(&Arc::from("m"), br#"{"prompt":"hello"}"#),
            Local::Engine
        ));
        let dir = folder(None);
        let tokenizers = LocalTokenizers::new(Some(dir.path().into()), 1 << 20, 0.0);
        loaded(&tokenizers);
        let name: Arc<str> = Arc::from("m");
        assert!(
            matches!(tokenizers.tokenize(&name, br#"{"prompt":"hello"}"#), Local::Ids { ids, .. } if ids == [5])
        );
        assert!(matches!(
            tokenizers.tokenize(
                &name,
                br#"{"messages":[{"role":"user","content":"hello"}]}"#
            ),
            Local::Engine
        ));
        let dir = folder(Some(
            "{% for m in messages %}{{ m.content | no_such_filter }}{% endfor %}",
        ));
        let tokenizers = LocalTokenizers::new(Some(dir.path().into()), 1 << 20, 0.0);
        let slot = loaded(&tokenizers);
        assert!(matches!(
            tokenizers.tokenize(
                &name,
                br#"{"messages":[{"role":"user","content":"hello"}]}"#
            ),
            Local::Engine
        ));
        assert_eq!(
            slot.engine[engine_reasons()
                .position(|r| r == "template_feature")
                .unwrap()]
            .load(Ordering::Relaxed),
            1
        );
    }

    #[test]
    fn three_differences_among_the_last_16_checks_turn_the_tokenizer_off() {
        let (_dir, tokenizers, _) = templated(1.0);
        let name: Arc<str> = Arc::from("m");
        let body = br#"{"prompt":"hello"}"#;
        let Local::Ids {
            ids,
            check: Some(_),
        } = tokenizers.tokenize(&name, body)
        else {
            panic!("a fraction of 1 checks every request")
        };
        tokenizers.checked(&name, Some(&[9]), &ids);
        for _ in 0..15 {
            tokenizers.checked(&name, Some(&ids), &ids);
        }
        tokenizers.checked(&name, None, &ids);
        tokenizers.checked(&name, Some(&[9]), &ids);
        assert!(
            matches!(tokenizers.tokenize(&name, body), Local::Ids { .. }),
            "the first difference has left the window of 16"
        );
        tokenizers.checked(&name, Some(&[9]), &ids);
        assert!(
            matches!(tokenizers.tokenize(&name, body), Local::Ids { .. }),
            "two in the window"
        );
        tokenizers.checked(&name, Some(&ids), &ids);
        tokenizers.checked(&name, Some(&[9]), &ids);
        assert!(matches!(tokenizers.tokenize(&name, body), Local::Engine));
        let mut out = TextEncoder::new();
        tokenizers.render(&mut out);
        let text = out.finish();
        assert!(text.contains(r#"switchyard_router_local_tokenize_checks_total{tokenizer="m",outcome="mismatch"} 4"#), "{text}");
        assert!(
            text.contains(r#"switchyard_router_local_tokenizer_usable{tokenizer="m"} 0"#),
            "{text}"
        );
        assert!(text.contains(r#"switchyard_router_local_tokenize_engine_total{tokenizer="m",reason="disabled"} 1"#), "{text}");
    }
    #[test]
    fn at_most_16_checks_of_a_tokenizer_run_at_once() {
        let (dir, tokenizers, _) = templated(1.0);
        let name: Arc<str> = Arc::from("m");
        let body = br#"{"prompt":"hello"}"#;
        let ticket = || match tokenizers.tokenize(&name, body) {
            Local::Ids { check, .. } => check,
            other => panic!("{other:?}"),
        };
        let mut running: Vec<CheckTicket> =
            (0..MOST_CHECKS_RUNNING).map_while(|_| ticket()).collect();
        assert_eq!(running.len(), MOST_CHECKS_RUNNING);
        assert!(ticket().is_none(), "the 17th is not checked");
        running.pop();
        assert!(ticket().is_some(), "one ended: a check again");
        assert!(ticket().is_some(), "and that one ended too");
        running.push(ticket().unwrap());
        assert!(ticket().is_none());
        // Per tokenizer: another model's checks still run.
        let other: Arc<str> = Arc::from("n");
        std::fs::create_dir(dir.path().join("n")).unwrap();
        for file in std::fs::read_dir(dir.path().join("m")).unwrap() {
            let file = file.unwrap();
            std::fs::copy(file.path(), dir.path().join("n").join(file.file_name())).unwrap();
        }
        tokenizers.slot(&other).unwrap().wait_loaded();
        match tokenizers.tokenize(&other, body) {
            Local::Ids { check, .. } => assert!(check.is_some(), "another tokenizer's checks run"),
            other => panic!("{other:?}"),
        }
        let mut out = TextEncoder::new();
        tokenizers.render(&mut out);
        let text = out.finish();
        assert!(
            text.contains(r#"switchyard_router_local_tokenize_checks_total{tokenizer="m",outcome="skipped"} 2"#),
            "{text}"
        );
    }
}
