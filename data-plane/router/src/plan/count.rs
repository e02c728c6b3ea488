//! Counting a prompt's tokens for the disaggregation threshold, with a real tokenizer: OpenAI's
//! BPEs shipped in the router (`cl100k_base`, `o200k_base`), or a Hugging Face `tokenizer.json`
//! found under `--tokenizer-dir` (`NAME/tokenizer.json` or `NAME.json`), so the count matches
//! the served model. A name the router cannot find falls back to `cl100k_base` (logged once,
//! counted in `switchyard_router_tokenizer_fallbacks_total`) rather than failing requests.
//!
//! Counting stops once the threshold is passed: a prompt is tokenized in growing windows from
//! its start, so a 100,000-token prompt costs about what the threshold's worth of text costs.
//! This is CPU work of milliseconds: callers run it on a blocking thread.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use switchyard_policy::openai::OpenAiRequest;
use switchyard_shared::disaggregation::DEFAULT_TOKENIZER;
use switchyard_tokenize::truncation::{Keep, Truncation};

/// A loaded tokenizer.
pub enum TokenCounter {
    Bpe(&'static tiktoken_rs::CoreBPE),
    HuggingFace(Box<tokenizers::Tokenizer>),
}

impl std::fmt::Debug for TokenCounter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TokenCounter::Bpe(_) => f.write_str("TokenCounter::Bpe"),
            TokenCounter::HuggingFace(_) => f.write_str("TokenCounter::HuggingFace"),
        }
    }
}

/// A token count that stops at a threshold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Count {
    pub tokens: usize,
    /// False when counting stopped early, at or past the threshold (`N+`).
    pub complete: bool,
}

impl Count {
    /// `N`, or `N+` when counting stopped early (`x-switchyard-prompt-tokens`).
    pub fn header_text(&self) -> String {
        if self.complete {
            self.tokens.to_string()
        } else {
            format!("{}+", self.tokens)
        }
    }
}

impl TokenCounter {
    /// Tokens of `text` (no special tokens added).
    pub fn count(&self, text: &str) -> usize {
        match self {
            TokenCounter::Bpe(bpe) => bpe.encode_ordinary(text).len(),
            TokenCounter::HuggingFace(tokenizer) => tokenizer
                .encode_fast(text, false)
                .map_or_else(|_| text.len().div_ceil(4), |encoding| encoding.len()),
        }
    }

    /// Counts `text`'s tokens, stopping once `threshold` is certainly reached: windows from
    /// the start of the text, eight bytes per token of the threshold at first, doubled until
    /// the window holds `threshold + 1` tokens (a window cut mid-word may count one token
    /// more than the same text in full) or the whole text.
    pub fn count_up_to(&self, text: &str, threshold: usize) -> Count {
        let mut window = threshold.saturating_add(1).saturating_mul(8).max(64);
        loop {
            if window >= text.len() {
                return Count {
                    tokens: self.count(text),
                    complete: true,
                };
            }
            let cut = floor_char_boundary(text, window);
            let tokens = self.count(&text[..cut]);
            if tokens > threshold {
                return Count {
                    tokens,
                    complete: false,
                };
            }
            window = window.saturating_mul(2);
        }
    }
}

fn floor_char_boundary(text: &str, at: usize) -> usize {
    let mut at = at.min(text.len());
    while !text.is_char_boundary(at) {
        at -= 1;
    }
    at
}

/// The largest tokenizer file read (Llama 3's is 9 MB; the largest published ones are a few
/// tens of MB).
pub const MOST_TOKENIZER_BYTES: u64 = 64 << 20;

/// How long a tokenizer that failed to load is replaced by cl100k_base before it is tried
/// again (a file put in place later is picked up without a restart).
const RETRY_LOAD_AFTER: Duration = Duration::from_secs(30);

/// The router's tokenizers, loaded on first use and kept.
#[derive(Debug)]
pub struct TokenCounters {
    dir: Option<PathBuf>,
    /// One slot per name; a slot's lock is held while its tokenizer loads, so that requests
    /// arriving meanwhile wait for that load instead of each doing their own.
    slots: Mutex<HashMap<String, Arc<Mutex<Slot>>>>,
    fallbacks: AtomicU64,
    retry_after: Duration,
    /// Tokenizer files read (tests check that concurrent first requests share one read).
    #[cfg(test)]
    file_loads: AtomicU64,
}

#[derive(Debug, Default)]
enum Slot {
    #[default]
    Unloaded,
    Loaded(Arc<TokenCounter>),
    /// The load failed; cl100k_base counts until `retry_at`.
    Failed {
        retry_at: Instant,
    },
}

impl TokenCounters {
    pub fn new(dir: Option<PathBuf>) -> Self {
        Self {
            dir,
            slots: Mutex::new(HashMap::new()),
            fallbacks: AtomicU64::new(0),
            retry_after: RETRY_LOAD_AFTER,
            #[cfg(test)]
            file_loads: AtomicU64::new(0),
        }
    }

    /// Loads the built-in default now (about 0.1 s), so that no request waits for it.
    pub fn warm_up(&self) {
        let _ = self.get(DEFAULT_TOKENIZER);
    }

    /// Loads the named tokenizers not yet loaded or tried, on a thread of their own (a
    /// configuration naming them has arrived: the first request should not wait for the
    /// file).
    pub fn preload(self: &Arc<Self>, names: Vec<String>) {
        let unseen: Vec<String> = {
            let slots = lock(&self.slots);
            names
                .into_iter()
                .filter(|name| !slots.contains_key(name))
                .collect()
        };
        if unseen.is_empty() {
            return;
        }
        let tokenizers = Arc::clone(self);
        let spawned = std::thread::Builder::new()
            .name("switchyard-tokenizer".into())
            .spawn(move || {
                for name in unseen {
                    let _ = tokenizers.get(&name);
                }
            });
        if let Err(err) = spawned {
            tracing::warn!(error = %err, "could not start a thread to load tokenizers; the first requests will");
        }
    }

    /// The tokenizer named `name`, or `cl100k_base` if it cannot be had. Blocking (it may read
    /// and parse a file of megabytes, or wait for another thread doing so): call it off the
    /// serving threads.
    pub fn get(&self, name: &str) -> Arc<TokenCounter> {
        let slot = Arc::clone(lock(&self.slots).entry(name.to_owned()).or_default());
        let mut slot = lock(&slot);
        let first_failure = match &*slot {
            Slot::Loaded(tokenizer) => return Arc::clone(tokenizer),
            Slot::Failed { retry_at } if Instant::now() < *retry_at => return fallback(),
            Slot::Failed { .. } => false,
            Slot::Unloaded => true,
        };
        match self.load(name) {
            Ok(tokenizer) => {
                let tokenizer = Arc::new(tokenizer);
                if !first_failure {
                    tracing::info!(tokenizer = name, "tokenizer loaded after failing before");
                }
                *slot = Slot::Loaded(Arc::clone(&tokenizer));
                tokenizer
            }
            Err(why) => {
                self.fallbacks.fetch_add(1, Ordering::Relaxed);
                // Logged once per name; later failed retries only count.
                if first_failure {
                    tracing::warn!(
                        tokenizer = name,
                        why = %why,
                        retry_after = ?self.retry_after,
                        "tokenizer unavailable; counting with cl100k_base instead"
                    );
                } else {
                    tracing::debug!(tokenizer = name, why = %why, "tokenizer still unavailable");
                }
                *slot = Slot::Failed {
                    retry_at: Instant::now() + self.retry_after,
                };
                fallback()
            }
        }
    }

    /// Failed loads of named tokenizers so far (each counted with cl100k_base meanwhile).
    pub fn fallbacks(&self) -> u64 {
        self.fallbacks.load(Ordering::Relaxed)
    }

    fn load(&self, name: &str) -> Result<TokenCounter, LoadError> {
        match name {
            "cl100k_base" => return Ok(TokenCounter::Bpe(tiktoken_rs::cl100k_base_singleton())),
            "o200k_base" => return Ok(TokenCounter::Bpe(tiktoken_rs::o200k_base_singleton())),
            _ => {}
        }
        switchyard_shared::disaggregation::validate_tokenizer_name(name)?;
        let Some(dir) = &self.dir else {
            return Err(LoadError::NoDirectory);
        };
        let path = [
            dir.join(name).join("tokenizer.json"),
            dir.join(format!("{name}.json")),
        ]
        .into_iter()
        .find(|path| path.is_file())
        .ok_or_else(|| LoadError::Missing {
            dir: dir.display().to_string(),
            name: name.to_owned(),
        })?;
        #[cfg(test)]
        self.file_loads.fetch_add(1, Ordering::Relaxed);
        load_file(&path).map(|tokenizer| TokenCounter::HuggingFace(Box::new(tokenizer)))
    }
}

fn fallback() -> Arc<TokenCounter> {
    Arc::new(TokenCounter::Bpe(tiktoken_rs::cl100k_base_singleton()))
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Why a named tokenizer could not be loaded (it is counted with cl100k_base meanwhile).
#[derive(Debug, thiserror::Error)]
enum LoadError {
    #[error(transparent)]
    Name(#[from] switchyard_shared::disaggregation::InvalidTokenizerName),
    #[error("no --tokenizer-dir given")]
    NoDirectory,
    #[error("neither {dir}/{name}/tokenizer.json nor {dir}/{name}.json exists")]
    Missing { dir: String, name: String },
    #[error("{path}: {source}")]
    Unreadable {
        path: String,
        source: std::io::Error,
    },
    #[error("{path}: {size} bytes, more than the {} MiB a tokenizer file may have", MOST_TOKENIZER_BYTES >> 20)]
    TooLarge { path: String, size: u64 },
    #[error("{path}: {message}")]
    Invalid { path: String, message: String },
}

fn load_file(path: &Path) -> Result<tokenizers::Tokenizer, LoadError> {
    let shown = || path.display().to_string();
    let size = std::fs::metadata(path)
        .map_err(|source| LoadError::Unreadable {
            path: shown(),
            source,
        })?
        .len();
    if size > MOST_TOKENIZER_BYTES {
        return Err(LoadError::TooLarge {
            path: shown(),
            size,
        });
    }
    tokenizers::Tokenizer::from_file(path).map_err(|err| LoadError::Invalid {
        path: shown(),
        message: err.to_string(),
    })
}

/// Tokens per chat message that the text alone does not show (role markers and separators
/// of the chat template; Llama 3's and OpenAI's add about this many).
const CHAT_TOKENS_PER_MESSAGE: usize = 4;

/// The prompt's tokens, counted until `threshold` is certainly reached. A completions prompt
/// of token ids is its length; a text prompt is tokenized as is; a chat is counted on its
/// messages' text plus [`CHAT_TOKENS_PER_MESSAGE`] per message (an approximation of the
/// template the engine applies). At most the request's `truncate_prompt_tokens` (what the
/// engine keeps of the prompt; -1, the model's context, is not known here).
pub fn count_prompt(
    request: &OpenAiRequest<'_>,
    tokenizer: &TokenCounter,
    threshold: usize,
) -> Count {
    let counted = count_whole_prompt(request, tokenizer, threshold);
    match kept_tokens(request) {
        Some(kept) if kept < counted.tokens => Count {
            tokens: kept,
            complete: true,
        },
        _ => counted,
    }
}

/// The request's `truncate_prompt_tokens` when it keeps a number of tokens (none for -1 or a
/// value vLLM refuses, which the engine answers).
fn kept_tokens(request: &OpenAiRequest<'_>) -> Option<usize> {
    let raw = request.truncation().truncate_prompt_tokens?;
    let value: serde_json::Value = serde_json::from_str(raw.get()).ok()?;
    match Truncation::read(Some(&value), None).ok()??.keep {
        Keep::Tokens(kept) => usize::try_from(kept).ok(),
        Keep::Context => None,
    }
}

fn count_whole_prompt(
    request: &OpenAiRequest<'_>,
    tokenizer: &TokenCounter,
    threshold: usize,
) -> Count {
    if let Some(ids) = request.prompt_token_ids() {
        return Count {
            tokens: ids,
            complete: true,
        };
    }
    let overhead = CHAT_TOKENS_PER_MESSAGE * request.message_count();
    let goal = threshold.saturating_sub(overhead);
    // Enough text for the goal at any plausible density; if the text is longer and still
    // counts below the goal, the whole text is counted.
    let limit = goal.saturating_add(1).saturating_mul(16);
    let text = request.prefix_text(limit);
    let mut count = tokenizer.count_up_to(&text, goal);
    if count.complete && text.chars().count() >= limit {
        count = tokenizer.count_up_to(&request.prefix_text(usize::MAX), goal);
    }
    Count {
        tokens: count.tokens + overhead,
        complete: count.complete,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hellos(count: usize) -> String {
        // "hello" then " hello"s: one token each in cl100k_base.
        let mut text = String::from("hello");
        for _ in 1..count {
            text.push_str(" hello");
        }
        text
    }

    #[test]
    fn cl100k_counts_exactly_at_the_boundary() {
        let tokenizers = TokenCounters::new(None);
        let bpe = tokenizers.get("cl100k_base");
        assert_eq!(bpe.count("hello world"), 2);
        for tokens in [4095, 4096, 4097] {
            let text = hellos(tokens);
            assert_eq!(bpe.count(&text), tokens);
            let count = bpe.count_up_to(&text, 4096);
            if tokens <= 4096 {
                assert_eq!(
                    count,
                    Count {
                        tokens,
                        complete: true
                    },
                    "{tokens}"
                );
            } else {
                assert!(count.tokens > 4096);
            }
        }
    }

    #[test]
    fn long_prompts_stop_past_the_threshold_and_say_so() {
        let bpe = TokenCounters::new(None).get("cl100k_base");
        let count = bpe.count_up_to(&hellos(100_000), 4096);
        assert!(!count.complete);
        assert!(count.tokens > 4096 && count.tokens < 20_000, "{count:?}");
        assert!(count.header_text().ends_with('+'));
        // Multi-byte text is cut on character boundaries.
        let greek = "καλημέρα ".repeat(5000);
        let count = bpe.count_up_to(&greek, 100);
        assert!(count.tokens > 100);
    }

    #[test]
    fn an_unknown_tokenizer_falls_back_and_is_counted_once() {
        let dir = tempfile::tempdir().unwrap();
        let tokenizers = TokenCounters::new(Some(dir.path().to_owned()));
        let first = tokenizers.get("llama-3");
        assert!(matches!(*first, TokenCounter::Bpe(_)));
        let _ = tokenizers.get("llama-3");
        assert_eq!(tokenizers.fallbacks(), 1);
        // A broken file is a fallback too, not a failed request.
        std::fs::write(dir.path().join("broken.json"), "{}").unwrap();
        let _ = tokenizers.get("broken");
        assert_eq!(tokenizers.fallbacks(), 2);
        // A path is never a name.
        let _ = tokenizers.get("../broken");
        assert_eq!(tokenizers.fallbacks(), 3);
    }

    /// A small valid tokenizer.json (a word-level model: one token per known word).
    fn word_level() -> String {
        word_level_of(0)
    }

    /// The same with `extra` more words: a file that takes a while to parse.
    fn word_level_of(extra: usize) -> String {
        let mut vocab = serde_json::Map::new();
        vocab.insert("hello".into(), 0.into());
        vocab.insert("[UNK]".into(), 1.into());
        for word in 0..extra {
            vocab.insert(format!("w{word}"), (word + 2).into());
        }
        serde_json::json!({
            "version": "1.0",
            "truncation": null,
            "padding": null,
            "added_tokens": [],
            "normalizer": null,
            "pre_tokenizer": {"type": "Whitespace"},
            "post_processor": null,
            "decoder": null,
            "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"}
        })
        .to_string()
    }

    #[test]
    fn a_failed_load_is_retried_after_the_backoff() {
        let dir = tempfile::tempdir().unwrap();
        let mut tokenizers = TokenCounters::new(Some(dir.path().to_owned()));
        tokenizers.retry_after = Duration::from_millis(500);
        // The fallback loaded first (seconds in a debug build), not within the backoff.
        tokenizers.warm_up();
        assert!(matches!(*tokenizers.get("words"), TokenCounter::Bpe(_)));
        // Put in place later: still the fallback within the backoff, then loaded.
        std::fs::write(dir.path().join("words.json"), word_level()).unwrap();
        assert!(matches!(*tokenizers.get("words"), TokenCounter::Bpe(_)));
        assert_eq!(tokenizers.fallbacks(), 1);
        std::thread::sleep(Duration::from_millis(600));
        let loaded = tokenizers.get("words");
        assert!(matches!(*loaded, TokenCounter::HuggingFace(_)));
        assert_eq!(loaded.count("hello hello hello"), 3);
        assert_eq!(tokenizers.fallbacks(), 1);
    }

    #[test]
    fn concurrent_first_requests_share_one_load_and_oversized_files_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        // A parse long enough (tens of ms) for the callers to overlap.
        std::fs::write(dir.path().join("words.json"), word_level_of(50_000)).unwrap();
        let tokenizers = TokenCounters::new(Some(dir.path().to_owned()));
        let start = std::sync::Barrier::new(4);
        let loaded: Vec<Arc<TokenCounter>> = std::thread::scope(|scope| {
            let handles: Vec<_> = (0..4)
                .map(|_| {
                    scope.spawn(|| {
                        start.wait();
                        tokenizers.get("words")
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|handle| handle.join().unwrap())
                .collect()
        });
        // One load: every caller holds the same tokenizer.
        assert_eq!(tokenizers.file_loads.load(Ordering::Relaxed), 1);
        assert!(
            loaded
                .iter()
                .all(|tokenizer| Arc::ptr_eq(tokenizer, &loaded[0]))
        );
        assert!(matches!(*loaded[0], TokenCounter::HuggingFace(_)));
        // A file over the cap is not read; the error names it.
        let big = dir.path().join("big.json");
        let file = std::fs::File::create(&big).unwrap();
        file.set_len(MOST_TOKENIZER_BYTES + 1).unwrap();
        let err = load_file(&big).unwrap_err().to_string();
        assert!(err.contains("big.json") && err.contains("64 MiB"), "{err}");
        assert!(matches!(*tokenizers.get("big"), TokenCounter::Bpe(_)));
    }

    #[test]
    fn preloading_loads_a_configured_name_before_any_request() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("words.json"), word_level()).unwrap();
        let tokenizers = Arc::new(TokenCounters::new(Some(dir.path().to_owned())));
        tokenizers.preload(vec!["words".into()]);
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let slot = lock(&tokenizers.slots).get("words").cloned();
            if slot.is_some_and(|slot| matches!(*lock(&slot), Slot::Loaded(_))) {
                break;
            }
            assert!(Instant::now() < deadline, "not preloaded");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    #[test]
    fn a_chat_counts_its_template_and_a_dense_start_does_not_cut_the_count() {
        let tokenizer = TokenCounters::new(None).get("cl100k_base");
        let count = |body: serde_json::Value, threshold: usize| {
            let body = body.to_string();
            count_prompt(
                &OpenAiRequest::parse(body.as_bytes()).unwrap(),
                &tokenizer,
                threshold,
            )
        };
        let text = format!("hello{}", " hello".repeat(11));
        let plain = count(serde_json::json!({"prompt": text}), 100);
        assert_eq!(
            plain,
            Count {
                tokens: 12,
                complete: true
            }
        );
        // A chat: its text as the router reads it, plus the template's tokens per message.
        let chat = serde_json::json!({"messages": [{"role": "user", "content": text}]}).to_string();
        let request = OpenAiRequest::parse(chat.as_bytes()).unwrap();
        let text_tokens = tokenizer.count(&request.prefix_text(usize::MAX));
        assert!(text_tokens >= 12, "{text_tokens}");
        assert_eq!(
            count_prompt(&request, &tokenizer, 100),
            Count {
                tokens: text_tokens + CHAT_TOKENS_PER_MESSAGE,
                complete: true
            }
        );
        // A start that packs many characters into each token, then ordinary words: the count
        // reads past the first window of text and reaches the threshold.
        let dense = format!("{}{}", "=".repeat(400), " hello".repeat(40));
        let tokens = tokenizer.count(&"=".repeat(400));
        assert!(
            tokens < 10,
            "{tokens} tokens: not dense enough for this test"
        );
        let counted = count(serde_json::json!({"prompt": dense}), 10);
        assert!(counted.tokens >= 10, "{counted:?}");
        // What the engine keeps: at most `truncate_prompt_tokens`.
        let long = format!("hello{}", " hello".repeat(999));
        let whole = count(serde_json::json!({"prompt": long}), 100);
        assert!(!whole.complete && whole.tokens > 100, "{whole:?}");
        for (truncation, kept) in [
            (serde_json::json!(50), Some(50)),
            (serde_json::json!("50"), Some(50)),
            (serde_json::json!(5000), None),
            (serde_json::json!(-1), None),
            (serde_json::json!(-5), None),
        ] {
            let body = serde_json::json!({"prompt": long, "truncate_prompt_tokens": truncation});
            let expected = kept.map_or(whole, |tokens| Count {
                tokens,
                complete: true,
            });
            assert_eq!(count(body, 100), expected, "{truncation}");
        }
    }
}
