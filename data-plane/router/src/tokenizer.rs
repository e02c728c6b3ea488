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

use switchyard_shared::disaggregation::DEFAULT_TOKENIZER;

/// A loaded tokenizer.
pub enum Tokenizer {
    Bpe(&'static tiktoken_rs::CoreBPE),
    HuggingFace(Box<tokenizers::Tokenizer>),
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Tokenizer::Bpe(_) => f.write_str("Tokenizer::Bpe"),
            Tokenizer::HuggingFace(_) => f.write_str("Tokenizer::HuggingFace"),
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

impl Tokenizer {
    /// Tokens of `text` (no special tokens added).
    pub fn count(&self, text: &str) -> usize {
        match self {
            Tokenizer::Bpe(bpe) => bpe.encode_ordinary(text).len(),
            Tokenizer::HuggingFace(tokenizer) => tokenizer
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

/// The router's tokenizers, loaded on first use and kept.
#[derive(Debug)]
pub struct Tokenizers {
    dir: Option<PathBuf>,
    loaded: Mutex<HashMap<String, Arc<Tokenizer>>>,
    fallbacks: AtomicU64,
}

impl Tokenizers {
    pub fn new(dir: Option<PathBuf>) -> Self {
        Self {
            dir,
            loaded: Mutex::new(HashMap::new()),
            fallbacks: AtomicU64::new(0),
        }
    }

    /// Loads the built-in default now (about 0.1 s), so that no request waits for it.
    pub fn warm_up(&self) {
        let _ = self.get(DEFAULT_TOKENIZER);
    }

    /// The tokenizer named `name`, or `cl100k_base` if it cannot be had. Blocking (it may read
    /// and parse a file of megabytes): call it off the serving threads.
    pub fn get(&self, name: &str) -> Arc<Tokenizer> {
        if let Some(found) = self.lock().get(name) {
            return Arc::clone(found);
        }
        let tokenizer = match self.load(name) {
            Ok(tokenizer) => Arc::new(tokenizer),
            Err(why) => {
                self.fallbacks.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(
                    tokenizer = name,
                    why,
                    "tokenizer unavailable; counting with cl100k_base instead"
                );
                Arc::new(Tokenizer::Bpe(tiktoken_rs::cl100k_base_singleton()))
            }
        };
        // Kept even when it is the fallback, so that the warning is logged once per name.
        Arc::clone(self.lock().entry(name.to_owned()).or_insert(tokenizer))
    }

    /// Names that fell back to cl100k_base so far.
    pub fn fallbacks(&self) -> u64 {
        self.fallbacks.load(Ordering::Relaxed)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<Tokenizer>>> {
        self.loaded
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn load(&self, name: &str) -> Result<Tokenizer, String> {
        match name {
            "cl100k_base" => return Ok(Tokenizer::Bpe(tiktoken_rs::cl100k_base_singleton())),
            "o200k_base" => return Ok(Tokenizer::Bpe(tiktoken_rs::o200k_base_singleton())),
            _ => {}
        }
        switchyard_shared::disaggregation::validate_tokenizer_name(name)?;
        let Some(dir) = &self.dir else {
            return Err("no --tokenizer-dir given".into());
        };
        let path = [
            dir.join(name).join("tokenizer.json"),
            dir.join(format!("{name}.json")),
        ]
        .into_iter()
        .find(|path| path.is_file())
        .ok_or_else(|| {
            format!(
                "neither {0}/{name}/tokenizer.json nor {0}/{name}.json exists",
                dir.display()
            )
        })?;
        load_file(&path).map(|tokenizer| Tokenizer::HuggingFace(Box::new(tokenizer)))
    }
}

fn load_file(path: &Path) -> Result<tokenizers::Tokenizer, String> {
    tokenizers::Tokenizer::from_file(path).map_err(|err| format!("{}: {err}", path.display()))
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
        let tokenizers = Tokenizers::new(None);
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
        let bpe = Tokenizers::new(None).get("cl100k_base");
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
        let tokenizers = Tokenizers::new(Some(dir.path().to_owned()));
        let first = tokenizers.get("llama-3");
        assert!(matches!(*first, Tokenizer::Bpe(_)));
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
}
