//! A faster way to the same ids for new text, for the commonest shape of byte-level BPE
//! tokenizer (Llama 3's, GPT-4's): no normalizer, a pre-tokenizer that is a `Split` on one
//! regex (pieces isolated) then `ByteLevel` without a regex of its own, and a BPE model.
//!
//! The `tokenizers` crate runs that regex with `fancy-regex`, because of one alternative,
//! `\s+(?!\S)` (a run of spaces, less the last one when a word follows it), and builds an
//! `Encoding` (token strings, offsets) around every call: on this project's machines that is
//! three quarters of its 2 µs per token. Here the regex runs without that alternative on the
//! `regex` crate's automata, the alternative's effect is applied to the matches (a whitespace
//! run without a line break, of two or more characters and followed by a non-space, gives up
//! its last character to what follows), and each piece goes straight to the tokenizer's own
//! BPE model. [`FastBpe::new`] accepts only the patterns for which that rule is known to hold
//! (Llama 3's), and the caller compares both ways on sample texts when it loads
//! (`crate::EngineTokenizer::load`), so a tokenizer for which this would not hold keeps the
//! `tokenizers` crate's own path.

use std::collections::HashMap;
use std::sync::Mutex;

use serde_json::Value;
use tokenizers::{Model, Tokenizer};
use xxhash_rust::xxh3::xxh3_64;

/// The alternative the `regex` crate cannot run, and the one after it.
const LOOKAHEAD_TAIL: &str = r"|\s+(?!\S)|\s+";

/// The patterns before [`LOOKAHEAD_TAIL`] for which the look-ahead rule is known to hold:
/// only `\s*[\r\n]+` and the tail match whitespace alone, so a whitespace match without a line
/// break comes from the tail. Llama 3's (and OpenAI's cl100k_base).
const KNOWN_HEADS: &[&str] = &[
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+",
];

/// See the module docs.
pub struct FastBpe {
    split: regex::Regex,
    /// GPT-2's byte-to-character map of the `ByteLevel` pre-tokenizer.
    byte_chars: [char; 256],
    /// Short pieces seen before and their ids.
    words: Words,
}

impl std::fmt::Debug for FastBpe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FastBpe")
            .field("split", &self.split.as_str())
            .finish_non_exhaustive()
    }
}

impl FastBpe {
    /// For a `tokenizer.json` of the shape above (None otherwise, or when an added token is
    /// matched on normalized text: such a token could occur inside a piece).
    pub fn new(config: &Value) -> Option<Self> {
        if !config.get("normalizer").is_none_or(Value::is_null) {
            return None;
        }
        let added_normalized = config
            .get("added_tokens")?
            .as_array()?
            .iter()
            .any(|token| token.get("normalized") != Some(&Value::Bool(false)));
        if added_normalized {
            return None;
        }
        let model = config.get("model")?;
        let plain_bpe = model.get("type")?.as_str()? == "BPE"
            && model.get("dropout").is_none_or(Value::is_null)
            && model.get("byte_fallback") != Some(&Value::Bool(true))
            && model
                .get("continuing_subword_prefix")
                .is_none_or(Value::is_null)
            && model.get("end_of_word_suffix").is_none_or(Value::is_null);
        if !plain_bpe {
            return None;
        }
        let pre = config.get("pre_tokenizer")?;
        if pre.get("type")?.as_str()? != "Sequence" {
            return None;
        }
        let [split, byte_level] = pre.get("pretokenizers")?.as_array()?.as_slice() else {
            return None;
        };
        let split_ok = split.get("type")?.as_str()? == "Split"
            && split.get("behavior")?.as_str()? == "Isolated"
            && split.get("invert") == Some(&Value::Bool(false));
        let byte_level_ok = byte_level.get("type")?.as_str()? == "ByteLevel"
            && byte_level.get("add_prefix_space") == Some(&Value::Bool(false))
            && byte_level.get("use_regex") == Some(&Value::Bool(false));
        if !(split_ok && byte_level_ok) {
            return None;
        }
        let pattern = split.get("pattern")?.get("Regex")?.as_str()?;
        let head = pattern.strip_suffix(LOOKAHEAD_TAIL)?;
        if !KNOWN_HEADS.contains(&head) {
            return None;
        }
        let split = regex::Regex::new(&format!(r"{head}|\s+")).ok()?;
        Some(Self {
            split,
            byte_chars: byte_chars(),
            words: Words::default(),
        })
    }

    /// The ids of `text` (no special tokens added), as `tokenizer` gives them. `tokenizer`
    /// must be the one this was made for, every time: the word cache keeps that model's ids.
    pub fn encode(&self, tokenizer: &Tokenizer, text: &str) -> Result<Vec<u32>, String> {
        let unbounded = std::cell::Cell::new(usize::MAX);
        Ok(self
            .encode_within(tokenizer, text, &unbounded)?
            .unwrap_or_default())
    }

    /// Pieces of new text found in the word cache, and pieces asked of the BPE model.
    pub fn word_stats(&self) -> (u64, u64) {
        use std::sync::atomic::Ordering::Relaxed;
        (
            self.words.hits.load(Relaxed),
            self.words.misses.load(Relaxed),
        )
    }

    /// [`Self::encode`], or None when the pieces the BPE model must be asked (not in the word
    /// cache, which costs a lookup) add up to more than `new_words` words, a piece counting
    /// one word per [`BYTES_PER_NEW_WORD`] bytes begun (about a microsecond or more of BPE
    /// each); `new_words` is lowered by those asked. The budget is checked before each piece
    /// is tokenized, so giving up costs at most the budget's work, and what was done is kept
    /// in the word cache: a retry costs less.
    pub fn encode_within(
        &self,
        tokenizer: &Tokenizer,
        text: &str,
        new_words: &std::cell::Cell<usize>,
    ) -> Result<Option<Vec<u32>>, String> {
        let model = tokenizer.get_model();
        let mut ids = Vec::with_capacity(text.len() / 3 + 4);
        let mut mapped = String::new();
        // False once over `new_words`.
        let mut piece = |piece: &str, ids: &mut Vec<u32>| -> Result<bool, String> {
            let key = (piece.len() <= Word::MOST_BYTES).then(|| xxh3_64(piece.as_bytes()));
            if let Some(key) = key
                && self.words.extend(key, piece, ids)
            {
                return Ok(true);
            }
            // A long piece (a run of letters without spaces, CJK, punctuation) costs the BPE
            // model more: every 8 bytes count as a word.
            if !spend_new_words(new_words, piece) {
                return Ok(false);
            }
            self.words
                .misses
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            mapped.clear();
            mapped.extend(piece.bytes().map(|byte| self.byte_chars[usize::from(byte)]));
            let tokens = model.tokenize(&mapped).map_err(|err| err.to_string())?;
            let start = ids.len();
            ids.extend(tokens.iter().map(|token| token.id));
            if let Some(key) = key {
                self.words.put(key, piece, &ids[start..]);
            }
            Ok(true)
        };
        let mut at = 0;
        while at < text.len() {
            let Some(found) = self.split.find_at(text, at) else {
                break;
            };
            let (start, mut end) = (found.start(), found.end());
            if start > at && !piece(&text[at..start], &mut ids)? {
                return Ok(None);
            }
            let matched = &text[start..end];
            // `\s+(?!\S)`: the run less its last character when a non-space follows.
            if text[end..]
                .chars()
                .next()
                .is_some_and(|next| !next.is_whitespace())
                && matched.chars().all(char::is_whitespace)
                && !matched.contains(['\r', '\n'])
                && let Some((last, _)) = matched.char_indices().last()
                && last > 0
            {
                end = start + last;
            }
            if !piece(&text[start..end], &mut ids)? {
                return Ok(None);
            }
            at = end;
        }
        if at < text.len() && !piece(&text[at..], &mut ids)? {
            return Ok(None);
        }
        Ok(Some(ids))
    }
}

/// Pieces of new text seen before (words, mostly: a question's, a new turn's) and their ids,
/// so a piece costs one lookup in a small table instead of the BPE model's work, which on a
/// serving thread whose caches other requests have filled is mostly misses in the model's
/// large vocabulary and merge tables. Exact: a piece's ids depend on the piece alone (for the
/// one model this [`FastBpe`] serves). Only pieces of at most [`Word::MOST_BYTES`] bytes and
/// [`Word::MOST_IDS`] ids are kept, inline; at most [`WORDS_PER_SHARD`] in each of
/// [`WORD_SHARDS`] shards, whose tables are sized once so that they never grow (64 bytes an
/// entry, about 2 MiB in all, allocated by a shard's first word); a full shard is emptied. A
/// shard another thread holds is passed by (a miss, or nothing kept): a serving thread never
/// waits here.
struct Words {
    shards: Box<[Shard]>,
    /// Pieces found here, and pieces asked of the BPE model.
    hits: std::sync::atomic::AtomicU64,
    misses: std::sync::atomic::AtomicU64,
}

/// A shard on cache lines of its own (two threads using neighbouring shards do not contend).
#[repr(align(128))]
#[derive(Default)]
struct Shard(Mutex<HashMap<u64, Word>>);

/// Bytes of a piece counted as one new word ([`FastBpe::encode_within`]).
pub const BYTES_PER_NEW_WORD: usize = 8;

/// Takes `piece`'s words (one per [`BYTES_PER_NEW_WORD`] bytes begun) from `new_words`;
/// false, leaving it as it was, when there are not that many left.
pub fn spend_new_words(new_words: &std::cell::Cell<usize>, piece: &str) -> bool {
    match new_words
        .get()
        .checked_sub(piece.len().div_ceil(BYTES_PER_NEW_WORD))
    {
        Some(left) => {
            new_words.set(left);
            true
        }
        None => false,
    }
}

const WORD_SHARDS: usize = 8;
/// 7/8 of a 4,096-slot table: the most it holds without growing.
const WORDS_PER_SHARD: usize = 3584;

impl Default for Words {
    fn default() -> Self {
        Self {
            shards: (0..WORD_SHARDS).map(|_| Shard::default()).collect(),
            hits: Default::default(),
            misses: Default::default(),
        }
    }
}

impl Words {
    /// `key`'s shard, or None while another thread holds it.
    fn shard(&self, key: u64) -> Option<std::sync::MutexGuard<'_, HashMap<u64, Word>>> {
        // The shard from the high bits, the map's own hash from all of them.
        let shard = &self.shards[(key >> 61) as usize % WORD_SHARDS];
        match shard.0.try_lock() {
            Ok(guard) => Some(guard),
            Err(std::sync::TryLockError::Poisoned(poisoned)) => Some(poisoned.into_inner()),
            Err(std::sync::TryLockError::WouldBlock) => None,
        }
    }

    /// Appends `piece`'s ids to `ids` when they are kept.
    fn extend(&self, key: u64, piece: &str, ids: &mut Vec<u32>) -> bool {
        let found = self.shard(key).and_then(|shard| {
            shard
                .get(&key)
                .filter(|word| word.text() == piece.as_bytes())
                .map(|word| (word.ids, word.ids_len))
        });
        match found {
            Some((found, len)) => {
                ids.extend_from_slice(&found[..usize::from(len)]);
                self.hits.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                true
            }
            None => false,
        }
    }

    fn put(&self, key: u64, piece: &str, ids: &[u32]) {
        let Some(word) = Word::new(piece, ids) else {
            return;
        };
        let Some(mut shard) = self.shard(key) else {
            return;
        };
        if shard.len() >= WORDS_PER_SHARD {
            shard.clear();
        } else if shard.capacity() == 0 {
            shard.reserve(WORDS_PER_SHARD);
        }
        shard.insert(key, word);
    }
}

/// A kept piece and its ids, inline.
struct Word {
    text: [u8; Word::MOST_BYTES],
    text_len: u8,
    ids: [u32; Word::MOST_IDS],
    ids_len: u8,
}

impl Word {
    const MOST_BYTES: usize = 24;
    const MOST_IDS: usize = 6;

    fn new(piece: &str, ids: &[u32]) -> Option<Self> {
        if piece.len() > Self::MOST_BYTES || ids.len() > Self::MOST_IDS {
            return None;
        }
        let mut word = Self {
            text: [0; Self::MOST_BYTES],
            text_len: piece.len() as u8,
            ids: [0; Self::MOST_IDS],
            ids_len: ids.len() as u8,
        };
        word.text[..piece.len()].copy_from_slice(piece.as_bytes());
        word.ids[..ids.len()].copy_from_slice(ids);
        Some(word)
    }

    fn text(&self) -> &[u8] {
        &self.text[..usize::from(self.text_len)]
    }
}

/// GPT-2's map of bytes to printable characters: the printable Latin-1 bytes stand for
/// themselves, the others for 256 and up in byte order.
fn byte_chars() -> [char; 256] {
    let printable = |byte: u8| matches!(byte, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    let mut chars = ['\0'; 256];
    let mut next = 256u32;
    for byte in 0..=255u8 {
        chars[usize::from(byte)] = if printable(byte) {
            char::from(byte)
        } else {
            let mapped = char::from_u32(next).unwrap_or('\u{fffd}');
            next += 1;
            mapped
        };
    }
    chars
}

/// Texts the two ways must agree on before the fast one is used: words, contractions in
/// both cases, digit runs, runs of spaces and tabs before words, digits, punctuation and line
/// breaks and at the end, line breaks of both kinds, non-breaking spaces, accents, CJK and
/// emoji.
pub const SAMPLES: &[&str] = &[
    "Hello world, this is a test.",
    "I'm sure you'll see they've DON'T it's WE'RE I'D",
    "12345 1 22 333 4444 3.14159 1,000,000",
    "a  b   c    d\te\t\tf  1  !!  ?",
    "line one\nline two\r\nline three\n\n\nindented\n    code\n\t\ttabs   \n  ",
    "trailing spaces   ",
    "   leading spaces",
    "naïve café — 日本語のテキスト ✓ 🙂👍🏽 Ελληνικά кириллица",
    "x\u{a0}\u{a0}y \u{3000}z\u{2003}\u{2003}w",
    "x'ſ y 'ſ 'K",
    "a\u{85}\u{85}b a\u{b}\u{c}b a \u{2028}b a\u{2029}\u{2029}b",
    "x\r y \r\r z\r",
    "  \u{301} \u{1680}\u{1680}1 \u{1680}x",
    "!!! ... ?? a.b (c) [d] {e} \"quoted\" 'single' `tick` #hash @at $5 %6 ^7 &8 *9",
    "The quick brown fox, naïve café 123 — jumps.\n\n  ",
    "mixedCASE snake_case kebab-case CamelCase HTTPServer v2.0.1-rc3",
    " \n \r\n  \t \u{a0}",
    "",
];

/// Whether `fast` gives `tokenizer`'s own ids on every sample.
pub fn agrees(fast: &FastBpe, tokenizer: &Tokenizer) -> bool {
    SAMPLES.iter().all(|text| {
        let own = tokenizer
            .encode_fast(*text, false)
            .map(|encoding| encoding.get_ids().to_vec());
        own.is_ok() && fast.encode(tokenizer, text).ok() == own.ok()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_word_cache_keeps_short_pieces_within_its_bound_and_checks_the_text() {
        let words = Words::default();
        let mut ids = Vec::new();
        words.put(7, "hello", &[1, 2]);
        assert!(words.extend(7, "hello", &mut ids));
        assert_eq!(ids, [1, 2]);
        assert!(!words.extend(7, "jello", &mut ids), "same key, other text");
        assert!(!words.extend(8, "hello", &mut ids));
        words.put(9, &"x".repeat(Word::MOST_BYTES + 1), &[3]);
        words.put(10, "many", &[1; Word::MOST_IDS + 1]);
        assert!(!words.extend(9, &"x".repeat(Word::MOST_BYTES + 1), &mut ids));
        assert!(!words.extend(10, "many", &mut ids));
        assert_eq!(ids, [1, 2], "nothing appended on a miss");
        // Keys below 2^61 share the first shard; a full shard is emptied, never outgrown.
        for key in 0..=(WORDS_PER_SHARD as u64 * 2) {
            words.put(key, "w", &[4]);
            let shard = words.shard(key).expect("no other thread");
            assert!(shard.len() <= WORDS_PER_SHARD);
            assert!(
                shard.capacity() < 2 * WORDS_PER_SHARD,
                "the table never grew"
            );
        }
        assert!(words.extend(WORDS_PER_SHARD as u64 * 2, "w", &mut ids));
        // A shard another thread holds is passed by, not waited for.
        let other = 1 << 61;
        words.put(other, "v", &[5]);
        let held = words.shard(other).expect("free");
        assert!(!words.extend(other, "v", &mut ids), "a miss while held");
        words.put(other + 1, "u", &[6]);
        drop(held);
        assert!(words.extend(other, "v", &mut ids));
        assert!(
            !words.extend(other + 1, "u", &mut ids),
            "nothing kept while held"
        );
    }

    #[test]
    fn the_byte_map_is_gpt2s() {
        let chars = byte_chars();
        assert_eq!(chars[usize::from(b'a')], 'a');
        assert_eq!(chars[usize::from(b' ')], 'Ġ');
        assert_eq!(chars[usize::from(b'\n')], 'Ċ');
        assert_eq!(chars[0], 'Ā');
        let mut sorted = chars.to_vec();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(sorted.len(), 256, "one character per byte");
    }

    #[test]
    fn only_the_known_shape_is_taken() {
        let config = |pattern: &str, normalizer: Value| {
            serde_json::json!({
                "added_tokens": [{"id": 0, "content": "<s>", "normalized": false}],
                "normalizer": normalizer,
                "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
                    {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": false},
                    {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false},
                ]},
                "model": {"type": "BPE", "dropout": null, "byte_fallback": false},
            })
        };
        let llama3 = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
        assert!(FastBpe::new(&config(llama3, Value::Null)).is_some());
        assert!(
            FastBpe::new(&config(llama3, serde_json::json!({"type": "NFC"}))).is_none(),
            "a normalizer"
        );
        assert!(
            FastBpe::new(&config(r"(?=x)a|\s+(?!\S)|\s+", Value::Null)).is_none(),
            "another look-around"
        );
        assert!(
            FastBpe::new(&config(
                r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+",
                Value::Null
            ))
            .is_none(),
            "GPT-2's: its head matches whitespace too"
        );
        assert!(
            FastBpe::new(&config(r"\p{L}+|\s+", Value::Null)).is_none(),
            "not the known tail"
        );
    }
}
