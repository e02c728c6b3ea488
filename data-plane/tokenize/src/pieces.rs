//! Tokenizing a long prompt piece by piece, with the pieces cached.
//!
//! A Hugging Face tokenizer first cuts its input at its added tokens that match on the raw
//! text (`normalized: false`: the chat template's markers such as `<|im_start|>` or
//! `<|start_header_id|>`), takes each marker as its own id, and tokenizes each piece between
//! them on its own. So the ids of a text are the ids of its pieces and markers, in order, and a
//! piece seen before (a shared system prompt, an earlier turn of the conversation) need not be
//! tokenized again. [`Pieces::encode`] cuts the text the same way (leftmost, longest marker
//! first) and takes the pieces it has seen from a cache bounded in bytes; whether this equals
//! tokenizing the whole text is checked when the tokenizer is loaded (`Pieces::new` refuses a
//! tokenizer whose markers strip or match whole words only, and `crate::EngineTokenizer::load`
//! compares both ways on sample texts), so a tokenizer for which it would not hold is always
//! tokenized whole.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use aho_corasick::{AhoCorasick, MatchKind};
use tokenizers::Tokenizer;
use xxhash_rust::xxh3::xxh3_128;

/// Pieces shorter than this are tokenized every time. Every piece is cached: a short one (a
/// role name, `"\n\n"`) costs the tokenizer several microseconds of fixed work per call, more
/// than a lookup, and a unique one (a new question) is evicted before pieces in use.
pub const MIN_CACHED_BYTES: usize = 1;
/// The cache's bookkeeping per entry, counted against its budget.
const ENTRY_OVERHEAD_BYTES: usize = 64;

/// The markers to cut at, with their ids, and the cache.
pub struct Pieces {
    markers: AhoCorasick,
    marker_ids: Vec<u32>,
    cache: PieceCache,
}

impl std::fmt::Debug for Pieces {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pieces")
            .field("markers", &self.marker_ids.len())
            .finish_non_exhaustive()
    }
}

/// The cache's counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheStats {
    pub hits: u64,
    pub misses: u64,
    pub entries: u64,
    pub bytes: u64,
}

impl Pieces {
    /// For `tokenizer` with a cache of at most `budget_bytes`; None when the tokenizer has a
    /// raw-text added token that strips spaces around it or matches whole words only (the cut
    /// would not be the tokenizer's own), or no such token at all.
    pub fn new(tokenizer: &Tokenizer, budget_bytes: usize) -> Option<Self> {
        let mut markers: Vec<(String, u32)> = Vec::new();
        for (id, token) in tokenizer.get_added_tokens_decoder() {
            if token.normalized {
                continue;
            }
            if token.lstrip || token.rstrip || token.single_word {
                return None;
            }
            markers.push((token.content.clone(), id));
        }
        if markers.is_empty() {
            return None;
        }
        markers.sort();
        // A DFA: the markers are a few hundred short strings, and a prompt is scanned whole
        // on every request.
        let automaton = AhoCorasick::builder()
            .match_kind(MatchKind::LeftmostLongest)
            .kind(Some(aho_corasick::AhoCorasickKind::DFA))
            .build(markers.iter().map(|(content, _)| content.as_str()))
            .ok()?;
        Some(Self {
            markers: automaton,
            marker_ids: markers.into_iter().map(|(_, id)| id).collect(),
            cache: PieceCache::new(budget_bytes),
        })
    }

    /// The ids of `text` without the post-processor's special tokens.
    pub fn encode(&self, tokenizer: &Tokenizer, text: &str) -> Result<Vec<u32>, String> {
        let mut ids = Vec::with_capacity(text.len() / 3 + 8);
        let mut at = 0;
        for found in self.markers.find_iter(text) {
            self.piece(tokenizer, &text[at..found.start()], &mut ids)?;
            ids.push(self.marker_ids[found.pattern().as_usize()]);
            at = found.end();
        }
        self.piece(tokenizer, &text[at..], &mut ids)?;
        Ok(ids)
    }

    fn piece(&self, tokenizer: &Tokenizer, piece: &str, ids: &mut Vec<u32>) -> Result<(), String> {
        if piece.is_empty() {
            return Ok(());
        }
        if piece.len() < MIN_CACHED_BYTES {
            ids.extend_from_slice(&plain(tokenizer, piece)?);
            return Ok(());
        }
        let key = xxh3_128(piece.as_bytes());
        if let Some(cached) = self.cache.get(key, piece.len()) {
            ids.extend_from_slice(&cached);
            return Ok(());
        }
        let fresh = plain(tokenizer, piece)?;
        ids.extend_from_slice(&fresh);
        self.cache.put(key, piece.len(), fresh);
        Ok(())
    }

    pub fn stats(&self) -> CacheStats {
        self.cache.stats()
    }
}

/// `text`'s ids from the tokenizer itself, without the post-processor's special tokens.
pub fn plain(tokenizer: &Tokenizer, text: &str) -> Result<Vec<u32>, String> {
    tokenizer
        .encode_fast(text, false)
        .map(|encoding| encoding.get_ids().to_vec())
        .map_err(|err| err.to_string())
}

/// Token ids of pieces by a 128-bit hash of their text (and its length), within a byte budget,
/// evicted in insertion order with a second chance for the entries used since they were last
/// passed.
struct PieceCache {
    budget: usize,
    inner: Mutex<CacheInner>,
    hits: AtomicU64,
    misses: AtomicU64,
}

#[derive(Default)]
struct CacheInner {
    entries: HashMap<(u128, usize), Entry>,
    order: VecDeque<(u128, usize)>,
    bytes: usize,
}

struct Entry {
    ids: std::sync::Arc<[u32]>,
    used: bool,
}

impl PieceCache {
    fn new(budget: usize) -> Self {
        Self {
            budget,
            inner: Mutex::new(CacheInner::default()),
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
        }
    }

    fn get(&self, key: u128, len: usize) -> Option<std::sync::Arc<[u32]>> {
        let found = {
            let mut inner = self
                .inner
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            inner.entries.get_mut(&(key, len)).map(|entry| {
                entry.used = true;
                std::sync::Arc::clone(&entry.ids)
            })
        };
        let counter = if found.is_some() {
            &self.hits
        } else {
            &self.misses
        };
        counter.fetch_add(1, Ordering::Relaxed);
        found
    }

    fn put(&self, key: u128, len: usize, ids: Vec<u32>) {
        let cost = ids.len() * 4 + ENTRY_OVERHEAD_BYTES;
        if cost > self.budget {
            return;
        }
        let mut inner = self
            .inner
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if inner.entries.contains_key(&(key, len)) {
            return;
        }
        // Each entry is passed at most twice (a second chance, then out).
        let mut passes = inner.order.len() * 2;
        while inner.bytes + cost > self.budget && passes > 0 {
            passes -= 1;
            let Some(oldest) = inner.order.pop_front() else {
                break;
            };
            let keep = match inner.entries.get_mut(&oldest) {
                Some(entry) if entry.used => {
                    entry.used = false;
                    true
                }
                _ => false,
            };
            if keep {
                inner.order.push_back(oldest);
            } else if let Some(entry) = inner.entries.remove(&oldest) {
                inner.bytes -= entry.ids.len() * 4 + ENTRY_OVERHEAD_BYTES;
            }
        }
        if inner.bytes + cost > self.budget {
            return;
        }
        inner.bytes += cost;
        inner.order.push_back((key, len));
        inner.entries.insert(
            (key, len),
            Entry {
                ids: ids.into(),
                used: false,
            },
        );
    }

    fn stats(&self) -> CacheStats {
        let inner = self
            .inner
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        CacheStats {
            hits: self.hits.load(Ordering::Relaxed),
            misses: self.misses.load(Ordering::Relaxed),
            entries: inner.entries.len() as u64,
            bytes: inner.bytes as u64,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cache_stays_within_its_budget_and_keeps_what_is_used() {
        let cache = PieceCache::new(3 * (400 + ENTRY_OVERHEAD_BYTES));
        for key in 0..3u128 {
            cache.put(key, 1, vec![7; 100]);
        }
        assert!(cache.get(0, 1).is_some());
        cache.put(3, 1, vec![8; 100]);
        let stats = cache.stats();
        assert_eq!(stats.entries, 3);
        assert!(stats.bytes <= 3 * (400 + ENTRY_OVERHEAD_BYTES) as u64);
        // 0 was used, so 1 (the oldest unused) went.
        assert!(
            cache.get(0, 1).is_some() && cache.get(1, 1).is_none() && cache.get(3, 1).is_some()
        );
        cache.put(9, 1, vec![0; 10_000]);
        assert!(
            cache.get(9, 1).is_none(),
            "larger than the whole budget: not kept"
        );
    }
}
