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

use tokenizers::Tokenizer;
use xxhash_rust::xxh3::xxh3_128;

use crate::markers::Markers;

// Every piece is cached, however short: a short one (a role name, `"\n\n"`) costs the
// tokenizer several microseconds of fixed work per call, more than a lookup, and a unique one
// (a new question) is evicted before pieces in use.

/// The cache's bookkeeping per entry, counted against its budget.
const ENTRY_OVERHEAD_BYTES: usize = 64;

/// The markers to cut at, with their ids, and the cache.
pub struct Pieces {
    markers: Markers,
    cache: PieceCache,
}

impl std::fmt::Debug for Pieces {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pieces")
            .field("markers", &self.markers.len())
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
        markers.sort();
        Some(Self {
            markers: Markers::new(&markers)?,
            cache: PieceCache::new(budget_bytes),
        })
    }

    /// The ids of `text` without the post-processor's special tokens; `plain` tokenizes a
    /// piece the cache does not hold (the tokenizer's own ids for it).
    pub fn encode(&self, plain: &Plain<'_>, text: &str) -> Result<Vec<u32>, String> {
        Ok(self.encode_within(plain, text, None)?.unwrap_or_default())
    }

    /// The ids of `text` without the post-processor's special tokens, or None (nothing
    /// tokenized, nothing counted) when the pieces the cache does not hold add up to more than
    /// `fresh_bytes` (None: no bound), or, with a bound, the text has more than [`MOST_PARTS_WITHIN`] pieces
    /// and markers: what is cached costs a lookup, what is not costs the tokenizer about a
    /// microsecond per token, so a caller can keep a cold prompt off a thread that must not
    /// wait. Also None when `plain` gives up on a piece (its budget of new words spent; the
    /// pieces tokenized before are cached). A piece that recurs in the text is tokenized once.
    pub fn encode_within(
        &self,
        plain: &Plain<'_>,
        text: &str,
        fresh_bytes: Option<usize>,
    ) -> Result<Option<Vec<u32>>, String> {
        let (fresh_bytes, most_parts) = match fresh_bytes {
            None => (usize::MAX, usize::MAX),
            Some(bytes) => (bytes, MOST_PARTS_WITHIN),
        };
        let mut parts = Vec::new();
        let mut fresh = 0usize;
        let mut fresh_keys = std::collections::HashSet::new();
        let mut at = 0;
        // False once over the budget.
        let mut cut = |start: usize, end: usize, parts: &mut Vec<Part>| -> bool {
            let piece = &text[start..end];
            if piece.is_empty() {
                return parts.len() <= most_parts;
            }
            let key = xxh3_128(piece.as_bytes());
            match self.cache.lookup(key, piece.len()) {
                Some(ids) => parts.push(Part::Cached(ids)),
                None => {
                    if fresh_keys.insert((key, piece.len())) {
                        fresh = fresh.saturating_add(piece.len());
                    }
                    parts.push(Part::Fresh(start, piece.len(), key));
                }
            }
            fresh <= fresh_bytes && parts.len() <= most_parts
        };
        for found in self.markers.find_iter(text) {
            if !cut(at, found.start, &mut parts) {
                return Ok(None);
            }
            parts.push(Part::Marker(found.id));
            at = found.end;
        }
        if !cut(at, text.len(), &mut parts) {
            return Ok(None);
        }
        // Sized once: a long cached prompt's ids are not copied again by a reallocation.
        let capacity = parts
            .iter()
            .map(|part| match part {
                Part::Marker(_) => 1,
                Part::Cached(ids) => ids.len(),
                Part::Fresh(_, len, _) => len / 2 + 1,
            })
            .sum();
        let mut ids = Vec::with_capacity(capacity);
        let (mut hits, mut misses) = (0, 0);
        // Fresh pieces tokenized in this call, for their repeats (the cache may not keep them).
        let mut done: std::collections::HashMap<(u128, usize), std::sync::Arc<[u32]>> =
            std::collections::HashMap::new();
        for part in parts {
            match part {
                Part::Marker(id) => ids.push(id),
                Part::Cached(cached) => {
                    hits += 1;
                    ids.extend_from_slice(&cached);
                }
                Part::Fresh(start, len, key) => {
                    if let Some(piece) = done.get(&(key, len)) {
                        hits += 1;
                        ids.extend_from_slice(piece);
                        continue;
                    }
                    misses += 1;
                    let Some(piece) = plain(&text[start..start + len])? else {
                        // Over the caller's budget of new words: nothing more is done, nothing
                        // counted (the retry counts).
                        return Ok(None);
                    };
                    let piece: std::sync::Arc<[u32]> = piece.into();
                    ids.extend_from_slice(&piece);
                    self.cache.put(key, len, std::sync::Arc::clone(&piece));
                    done.insert((key, len), piece);
                }
            }
        }
        self.cache.count(hits, misses);
        Ok(Some(ids))
    }

    pub fn stats(&self) -> CacheStats {
        self.cache.stats()
    }
}

/// A stretch of a text being encoded: a marker's id, a piece the cache holds, or a piece to
/// tokenize (its start, length and cache key).
enum Part {
    Marker(u32),
    Cached(std::sync::Arc<[u32]>),
    Fresh(usize, usize, u128),
}

/// A piece's ids, without the post-processor's special tokens, or None when the caller's
/// budget of new words is spent.
pub type Plain<'a> = dyn Fn(&str) -> Result<Option<Vec<u32>>, String> + 'a;

/// Pieces and markers past which [`Pieces::encode_within`] gives up under a budget (a prompt
/// of thousands of short pieces costs thousands of lookups even when all are cached).
pub const MOST_PARTS_WITHIN: usize = 2048;

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

    /// The ids cached for (`key`, `len`), marked as used; not counted ([`Self::count`]).
    fn lookup(&self, key: u128, len: usize) -> Option<std::sync::Arc<[u32]>> {
        let mut inner = self
            .inner
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        inner.entries.get_mut(&(key, len)).map(|entry| {
            entry.used = true;
            std::sync::Arc::clone(&entry.ids)
        })
    }

    fn count(&self, hits: u64, misses: u64) {
        if hits > 0 {
            self.hits.fetch_add(hits, Ordering::Relaxed);
        }
        if misses > 0 {
            self.misses.fetch_add(misses, Ordering::Relaxed);
        }
    }

    #[cfg(test)]
    fn get(&self, key: u128, len: usize) -> Option<std::sync::Arc<[u32]>> {
        let found = self.lookup(key, len);
        self.count(u64::from(found.is_some()), u64::from(found.is_none()));
        found
    }

    fn put(&self, key: u128, len: usize, ids: std::sync::Arc<[u32]>) {
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
        inner.entries.insert((key, len), Entry { ids, used: false });
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
            cache.put(key, 1, vec![7; 100].into());
        }
        assert!(cache.get(0, 1).is_some());
        cache.put(3, 1, vec![8; 100].into());
        let stats = cache.stats();
        assert_eq!(stats.entries, 3);
        assert!(stats.bytes <= 3 * (400 + ENTRY_OVERHEAD_BYTES) as u64);
        // 0 was used, so 1 (the oldest unused) went.
        assert!(
            cache.get(0, 1).is_some() && cache.get(1, 1).is_none() && cache.get(3, 1).is_some()
        );
        cache.put(9, 1, vec![0; 10_000].into());
        assert!(
            cache.get(9, 1).is_none(),
            "larger than the whole budget: not kept"
        );
    }
}
