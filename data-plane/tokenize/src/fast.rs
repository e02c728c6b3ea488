//! A faster way to the same ids for new text, for the commonest shape of byte-level BPE
//! tokenizer (Llama 3's, GPT-4's): no normalizer, a pre-tokenizer that is a `Split` on one
//! regex (pieces isolated) then `ByteLevel` without a regex of its own, and a BPE model.
//!
//! The `tokenizers` crate runs that regex with `fancy-regex`, because of one alternative,
//! `\s+(?!\S)` (a run of spaces, less the last one when a word follows it), and builds an
//! `Encoding` (token strings, offsets) around every call: on this project's machines that is
//! three quarters of its 2 µs per token. Here the regex runs without that alternative on the
//! `regex-automata` crate's automata (the `regex` crate's engine), the alternative's effect is
//! applied to the matches (a whitespace run without a line break, of two or more characters
//! and followed by a non-space, gives up its last character to what follows), and each piece
//! goes straight to the tokenizer's own BPE model. For Llama 3's pattern, ASCII text is cut by
//! hand (`llama3_ascii`), the regex deciding wherever a non-ASCII character could matter. [`FastBpe::new`] accepts only the patterns for which that rule is known to hold
//! (Llama 3's), and the caller compares both ways on sample texts when it loads
//! (`crate::EngineTokenizer::load`), so a tokenizer for which this would not hold keeps the
//! `tokenizers` crate's own path.

use std::sync::Mutex;

use regex_automata::{Anchored, Input};
use serde_json::Value;
use tokenizers::{Model, Tokenizer};
use xxhash_rust::xxh3::xxh3_64;

/// The alternative `regex-automata` cannot run, and the one after it.
const LOOKAHEAD_TAIL: &str = r"|\s+(?!\S)|\s+";

/// The patterns before [`LOOKAHEAD_TAIL`] for which the look-ahead rule is known to hold:
/// only `\s*[\r\n]+` and the tail match whitespace alone, so a whitespace match without a line
/// break comes from the tail. Llama 3's (and OpenAI's cl100k_base).
const KNOWN_HEADS: &[&str] = &[LLAMA3_HEAD];

/// Llama 3's, which [`llama3_ascii`] also matches by hand.
const LLAMA3_HEAD: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+";

/// See the module docs.
pub struct FastBpe {
    split: regex_automata::meta::Regex,
    /// The pattern is [`LLAMA3_HEAD`]: ASCII text is cut by [`llama3_ascii`].
    llama3: bool,
    /// GPT-2's byte-to-character map of the `ByteLevel` pre-tokenizer.
    byte_chars: [char; 256],
    /// Short pieces seen before and their ids.
    words: Words,
}

impl std::fmt::Debug for FastBpe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FastBpe")
            .field("split", &self.split)
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
        let split = regex_automata::meta::Regex::new(&format!(r"{head}|\s+")).ok()?;
        Some(Self {
            split,
            llama3: head == LLAMA3_HEAD,
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
    ///
    /// The pieces are looked up [`LOOKUP_BATCH`] at a time, each shard locked once per batch:
    /// on a serving thread the table is mostly out of the CPU's caches, and lookups with no
    /// lock between them wait for memory together rather than one after another.
    pub fn encode_within(
        &self,
        tokenizer: &Tokenizer,
        text: &str,
        new_words: &std::cell::Cell<usize>,
    ) -> Result<Option<Vec<u32>>, String> {
        let model = tokenizer.get_model();
        let mut ids = Vec::with_capacity(text.len() / 3 + 4);
        let mut mapped = String::new();
        let mut split = Split {
            regex: &self.split,
            llama3: self.llama3,
            text,
            at: 0,
            pending: None,
        };
        let mut batch: Vec<Piece> = Vec::with_capacity(LOOKUP_BATCH);
        let mut found: Vec<Option<Word>> = Vec::with_capacity(LOOKUP_BATCH);
        // Words this batch asked of the BPE model: (piece, where its ids are in `ids`).
        let mut asked: Vec<(Piece, usize, usize)> = Vec::new();
        loop {
            batch.clear();
            batch.extend(split.by_ref().take(LOOKUP_BATCH).map(|(start, end)| {
                let piece = &text[start..end];
                let key = (piece.len() <= Word::MOST_BYTES).then(|| xxh3_64(piece.as_bytes()));
                Piece { start, end, key }
            }));
            if batch.is_empty() {
                return Ok(Some(ids));
            }
            self.words.find_all(text, &batch, &mut found);
            asked.clear();
            for (piece, word) in batch.iter().zip(&found) {
                if let Some(word) = word {
                    ids.extend_from_slice(word.ids());
                    continue;
                }
                let text_of = |piece: &Piece| &text[piece.start..piece.end];
                // A word this batch already asked for (a common word, twice in new text).
                if piece.key.is_some()
                    && let Some(&(_, from, to)) = asked.iter().find(|(other, _, _)| {
                        other.key == piece.key && text_of(other) == text_of(piece)
                    })
                {
                    ids.extend_from_within(from..to);
                    continue;
                }
                // A long piece (a run of letters without spaces, CJK, punctuation) costs the
                // BPE model more: every 8 bytes count as a word.
                if !spend_new_words(new_words, text_of(piece)) {
                    self.words.put_all(text, &asked, &ids);
                    return Ok(None);
                }
                self.words
                    .misses
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                mapped.clear();
                mapped.extend(
                    text_of(piece)
                        .bytes()
                        .map(|byte| self.byte_chars[usize::from(byte)]),
                );
                let tokens = model.tokenize(&mapped).map_err(|err| err.to_string())?;
                let from = ids.len();
                ids.extend(tokens.iter().map(|token| token.id));
                if piece.key.is_some() {
                    asked.push((*piece, from, ids.len()));
                }
            }
            self.words.put_all(text, &asked, &ids);
        }
    }
}

/// Pieces of new text looked up in the word cache together ([`FastBpe::encode_within`]).
const LOOKUP_BATCH: usize = 64;

/// A piece of the text being encoded, and its key in the word cache (None: too long to keep).
#[derive(Debug, Clone, Copy)]
struct Piece {
    start: usize,
    end: usize,
    key: Option<u64>,
}

/// The pieces of a text as the tokenizer's pre-tokenizer cuts it: the regex's matches, with
/// `\s+(?!\S)` applied to them (a run of spaces less its last character when a non-space
/// follows), and whatever lies between or after them.
struct Split<'a> {
    regex: &'a regex_automata::meta::Regex,
    /// The regex is [`LLAMA3_HEAD`]`|\s+`: where [`llama3_ascii`] can decide, it does.
    llama3: bool,
    text: &'a str,
    at: usize,
    /// A match to give after the stretch before it.
    pending: Option<(usize, usize)>,
}

impl Iterator for Split<'_> {
    type Item = (usize, usize);

    fn next(&mut self) -> Option<(usize, usize)> {
        if let Some(pending) = self.pending.take() {
            return Some(pending);
        }
        let text = self.text;
        if self.at >= text.len() {
            return None;
        }
        let rest = (self.at, text.len());
        let by_hand = self
            .llama3
            .then(|| llama3_ascii(text.as_bytes(), self.at))
            .flatten();
        let (start, mut end) = match by_hand {
            Some(end) => (self.at, end),
            None => {
                // A match at `at` is the leftmost one, and the anchored search finds it
                // without the reverse scan an unanchored one needs for where a match starts.
                // The known patterns match at every position; the unanchored search is for
                // the others.
                let from = Input::new(text).span(self.at..text.len());
                let found = self
                    .regex
                    .search(&from.clone().anchored(Anchored::Yes))
                    .or_else(|| self.regex.search(&from));
                let Some(found) = found else {
                    self.at = text.len();
                    return Some(rest);
                };
                (found.start(), found.end())
            }
        };
        if end <= start {
            // The known patterns never match nothing; were one to, the rest is one piece.
            self.at = text.len();
            return Some(rest);
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
        let gap = (start > self.at).then_some((self.at, start));
        self.at = end;
        match gap {
            Some(gap) => {
                self.pending = Some((start, end));
                Some(gap)
            }
            None => Some((start, end)),
        }
    }
}

/// A byte of text as [`LLAMA3_HEAD`]'s classes see it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Class {
    /// `\p{L}`: in ASCII, `A-Z` and `a-z`.
    Letter,
    /// `\p{N}`: in ASCII, `0-9`.
    Digit,
    /// `\r` or `\n`.
    Newline,
    /// The rest of `\s` in ASCII (Unicode's White_Space): tab, `\x0B`, `\x0C`, space.
    Space,
    /// Any other ASCII byte (punctuation, symbols, control characters).
    Other,
    /// A byte of a non-ASCII character, which only the regex classifies.
    Wide,
}

fn class(byte: u8) -> Class {
    CLASSES[usize::from(byte)]
}

const CLASSES: [Class; 256] = {
    let mut classes = [Class::Other; 256];
    let mut byte = 0;
    while byte < 256 {
        classes[byte] = match byte as u8 {
            b'A'..=b'Z' | b'a'..=b'z' => Class::Letter,
            b'0'..=b'9' => Class::Digit,
            b'\r' | b'\n' => Class::Newline,
            b'\t' | 0x0B | 0x0C | b' ' => Class::Space,
            0x80.. => Class::Wide,
            _ => Class::Other,
        };
        byte += 1;
    }
    classes
};

/// Where [`LLAMA3_HEAD`]`|\s+` matched anchored at `at` ends (leftmost-first, as the regex),
/// found by hand, or None where that depends on a non-ASCII character (the regex decides then).
/// `at` is within `text`. About 10 ns a piece against the regex's 45–65 on English text; the two
/// agree on every text (`tests::llama3_by_hand_cuts_as_the_regex_does`).
fn llama3_ascii(text: &[u8], at: usize) -> Option<usize> {
    let class_at = |i: usize| text.get(i).copied().map(class);
    // The end of the run of bytes of the classes `of` from `from`; None when it stops at a
    // non-ASCII character, which could belong to the run.
    let run = |from: usize, of: &[Class]| {
        let mask = of.iter().fold(0_u8, |mask, &class| mask | 1 << class as u8);
        let end = from
            + text[from..]
                .iter()
                .position(|&byte| mask & 1 << class(byte) as u8 == 0)
                .unwrap_or(text.len() - from);
        (class_at(end) != Some(Class::Wide)).then_some(end)
    };
    let first = class(text[at]);
    match first {
        Class::Wide => return None,
        // `[^\r\n\p{L}\p{N}]?\p{L}+`, without the optional character.
        Class::Letter => return run(at, &[Class::Letter]),
        // `\p{N}{1,3}`
        Class::Digit => {
            let end = run(at, &[Class::Digit]).or_else(|| {
                // A non-ASCII digit matters only within the first three.
                let ascii = text[at..].iter().take_while(|b| b.is_ascii_digit()).count();
                (ascii >= 3).then_some(at + 3)
            })?;
            return Some(end.min(at + 3));
        }
        _ => {}
    }
    // `(?i:'s|'t|'re|'ve|'m|'ll|'d)`: case folding reaches beyond ASCII (`ſ` is an `s`).
    if text[at] == b'\'' {
        let next = |i: usize| match class_at(at + i) {
            Some(Class::Wide) => Err(()),
            _ => Ok(text.get(at + i).map(u8::to_ascii_lowercase)),
        };
        match next(1).ok()? {
            Some(b's' | b't' | b'm' | b'd') => return Some(at + 2),
            Some(second @ (b'r' | b'v' | b'l')) => match (second, next(2).ok()?) {
                (b'r' | b'v', Some(b'e')) | (b'l', Some(b'l')) => return Some(at + 3),
                _ => {}
            },
            _ => {}
        }
    }
    // `[^\r\n\p{L}\p{N}]\p{L}+`
    if first != Class::Newline {
        match class_at(at + 1) {
            Some(Class::Wide) => return None,
            Some(Class::Letter) => return run(at + 1, &[Class::Letter]),
            _ => {}
        }
    }
    // ` ?[^\s\p{L}\p{N}]+[\r\n]*`
    let symbols = match first {
        Class::Other => Some(at),
        _ if text[at] == b' ' && class_at(at + 1) == Some(Class::Other) => Some(at + 1),
        _ => None,
    };
    if let Some(from) = symbols {
        let end = run(from, &[Class::Other])?;
        let newlines = text[end..]
            .iter()
            .take_while(|&&byte| class(byte) == Class::Newline)
            .count();
        return Some(end + newlines);
    }
    // `\s*[\r\n]+`: the whitespace run up to its last line break; else `\s+`, the whole run
    // (the look-ahead is applied by the caller).
    let end = run(at, &[Class::Space, Class::Newline])?;
    Some(
        match text[at..end]
            .iter()
            .rposition(|&byte| class(byte) == Class::Newline)
        {
            Some(last) => at + last + 1,
            None => end,
        },
    )
}

/// Pieces of new text seen before (words, mostly: a question's, a new turn's) and their ids,
/// so a piece costs one lookup in a small table instead of the BPE model's work, which on a
/// serving thread whose caches other requests have filled is mostly misses in the model's
/// large vocabulary and merge tables. Exact: a piece's ids depend on the piece alone (for the
/// one model this [`FastBpe`] serves). Only pieces of at most [`Word::MOST_BYTES`] bytes and
/// [`Word::MOST_IDS`] ids are kept, inline, 64 bytes a word.
///
/// [`WORD_SHARDS`] shards of [`SETS_PER_SHARD`] sets of two words, 2 MiB in all, a shard's
/// table allocated by its first word and never grown. A word's set comes from its key: a
/// lookup reads one pair of cache lines, and a new word takes the place of the one of its set
/// used least lately. A lookup waits for a shard another thread holds (never while holding
/// one itself, so no two threads wait for each other): a miss it would otherwise see spends a
/// caller's budget of new words on a known word. Keeping new words passes a held shard by
/// (nothing kept).
struct Words {
    shards: Box<[Shard]>,
    /// Pieces found here, and pieces asked of the BPE model.
    hits: std::sync::atomic::AtomicU64,
    misses: std::sync::atomic::AtomicU64,
}

/// A shard on cache lines of its own (two threads using neighbouring shards do not contend).
#[repr(align(128))]
#[derive(Default)]
struct Shard(Mutex<Box<[Set]>>);

/// A shard's table, locked.
type Table<'a> = std::sync::MutexGuard<'a, Box<[Set]>>;

/// Two words whose keys share their low bits, the one used last first; a pair of cache lines.
#[repr(align(128))]
#[derive(Clone, Copy, Default)]
struct Set([Word; 2]);

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
/// 2,048 sets of two words: 4,096 words, 256 KiB a shard.
const SETS_PER_SHARD: usize = 2048;

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
    /// The shard of `key`: its high bits (the set comes from the low ones).
    fn shard_of(key: u64) -> usize {
        (key >> 61) as usize % WORD_SHARDS
    }

    /// `index`'s table, or None while another thread holds it.
    fn lock(&self, index: usize) -> Option<Table<'_>> {
        match self.shards[index].0.try_lock() {
            Ok(guard) => Some(guard),
            Err(std::sync::TryLockError::Poisoned(poisoned)) => Some(poisoned.into_inner()),
            Err(std::sync::TryLockError::WouldBlock) => None,
        }
    }

    /// The shards `keys` fall in, as a bit set.
    fn shards_of(keys: impl Iterator<Item = u64>) -> u32 {
        keys.fold(0, |shards, key| shards | 1 << Self::shard_of(key))
    }

    /// `index`'s table, waiting while another thread holds it.
    fn wait_for(&self, index: usize) -> Table<'_> {
        self.shards[index]
            .0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// `found[i]`: the word kept for `batch[i]` (a piece of `text`), if any. The shards the
    /// batch needs are taken at once if none is held (one pass over the batch); else each is
    /// waited for and looked up in alone, then let go before the next. A thread never holds a
    /// shard while it waits for another, so no two threads wait for each other, and one that
    /// meets another holds a shard for an eighth of its batch.
    fn find_all(&self, text: &str, batch: &[Piece], found: &mut Vec<Option<Word>>) {
        found.clear();
        found.resize(batch.len(), None);
        let needed = Self::shards_of(batch.iter().filter_map(|piece| piece.key));
        let needed = || (0..WORD_SHARDS).filter(move |index| needed & 1 << index != 0);
        let mut tables: [Option<Table<'_>>; WORD_SHARDS] = Default::default();
        let mut free = true;
        for index in needed() {
            tables[index] = self.lock(index);
            free &= tables[index].is_some();
        }
        let hits = if free {
            Self::look_up(text, batch, &mut tables, found)
        } else {
            tables = Default::default();
            needed()
                .map(|index| {
                    tables[index] = Some(self.wait_for(index));
                    let hits = Self::look_up(text, batch, &mut tables, found);
                    tables[index] = None;
                    hits
                })
                .sum()
        };
        if hits > 0 {
            self.hits
                .fetch_add(hits, std::sync::atomic::Ordering::Relaxed);
        }
    }

    /// [`Self::find_all`]'s lookups in the shards held in `tables` (the others' pieces are
    /// left as they are in `found`): the hits.
    fn look_up(
        text: &str,
        batch: &[Piece],
        tables: &mut [Option<Table<'_>>; WORD_SHARDS],
        found: &mut [Option<Word>],
    ) -> u64 {
        // First each set's first line is read, with nothing else between the reads, so that
        // the CPU waits for all those lines at once; the lookups then find them in its cache.
        let mut touched = 0_u64;
        for key in batch.iter().filter_map(|piece| piece.key) {
            if let Some(set) = tables[Self::shard_of(key)]
                .as_ref()
                .and_then(|sets| sets.get(key as usize % SETS_PER_SHARD))
            {
                touched ^= set.0[0].key;
            }
        }
        std::hint::black_box(touched);
        let mut hits = 0;
        for (at, piece) in batch.iter().enumerate() {
            let Some(key) = piece.key else { continue };
            let Some(set) = tables[Self::shard_of(key)]
                .as_mut()
                .and_then(|sets| sets.get_mut(key as usize % SETS_PER_SHARD))
            else {
                continue;
            };
            let word = set.find(key, &text.as_bytes()[piece.start..piece.end]);
            hits += u64::from(word.is_some());
            found[at] = word;
        }
        hits
    }

    /// Keeps the words `asked` (a piece of `text`, its ids at `ids[from..to]`) that fit, each
    /// shard locked once; a held one keeps nothing.
    fn put_all(&self, text: &str, asked: &[(Piece, usize, usize)], ids: &[u32]) {
        let needed = Self::shards_of(asked.iter().filter_map(|(piece, _, _)| piece.key));
        for index in (0..WORD_SHARDS).filter(|index| needed & 1 << index != 0) {
            let Some(mut sets) = self.lock(index) else {
                continue;
            };
            for (piece, from, to) in asked {
                let Some(key) = piece.key.filter(|&key| Self::shard_of(key) == index) else {
                    continue;
                };
                let Some(word) = Word::new(key, &text[piece.start..piece.end], &ids[*from..*to])
                else {
                    continue;
                };
                if sets.is_empty() {
                    *sets = vec![Set::default(); SETS_PER_SHARD].into_boxed_slice();
                }
                sets[key as usize % SETS_PER_SHARD].put(word);
            }
        }
    }
}

impl Set {
    /// The word kept for (`key`, `text`), now first in its set.
    fn find(&mut self, key: u64, text: &[u8]) -> Option<Word> {
        if self.0[0].is(key, text) {
            return Some(self.0[0]);
        }
        if !self.0[1].is(key, text) {
            return None;
        }
        self.0.swap(0, 1);
        Some(self.0[0])
    }

    /// Keeps `word` first; the other word of the set is the one used last before it.
    fn put(&mut self, word: Word) {
        let text = word.text();
        match self.0.iter().position(|kept| kept.is(word.key, text)) {
            Some(way) => self.0.swap(0, way),
            None => {
                self.0[1] = self.0[0];
                self.0[0] = word;
            }
        }
    }
}

/// A kept piece and its ids, inline (no ids: an empty place).
#[derive(Clone, Copy, Default)]
struct Word {
    key: u64,
    text: [u8; Word::MOST_BYTES],
    ids: [u32; Word::MOST_IDS],
    text_len: u8,
    ids_len: u8,
}

impl Word {
    const MOST_BYTES: usize = 24;
    const MOST_IDS: usize = 6;

    fn new(key: u64, piece: &str, ids: &[u32]) -> Option<Self> {
        if piece.len() > Self::MOST_BYTES || ids.is_empty() || ids.len() > Self::MOST_IDS {
            return None;
        }
        let mut word = Self {
            key,
            text: [0; Self::MOST_BYTES],
            ids: [0; Self::MOST_IDS],
            text_len: piece.len() as u8,
            ids_len: ids.len() as u8,
        };
        word.text[..piece.len()].copy_from_slice(piece.as_bytes());
        word.ids[..ids.len()].copy_from_slice(ids);
        Some(word)
    }

    fn is(&self, key: u64, text: &[u8]) -> bool {
        self.ids_len > 0 && self.key == key && self.text() == text
    }

    fn text(&self) -> &[u8] {
        &self.text[..usize::from(self.text_len)]
    }

    fn ids(&self) -> &[u32] {
        &self.ids[..usize::from(self.ids_len)]
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

    /// One piece at a time through the batch calls: the ids found for `piece` under `key`.
    fn find(words: &Words, key: u64, piece: &str) -> Option<Vec<u32>> {
        let batch = [Piece {
            start: 0,
            end: piece.len(),
            key: Some(key),
        }];
        let mut found = Vec::new();
        words.find_all(piece, &batch, &mut found);
        found[0].map(|word| word.ids().to_vec())
    }

    fn put(words: &Words, key: u64, piece: &str, ids: &[u32]) {
        let asked = [(
            Piece {
                start: 0,
                end: piece.len(),
                key: Some(key),
            },
            0,
            ids.len(),
        )];
        words.put_all(piece, &asked, ids);
    }

    #[test]
    fn the_word_cache_keeps_short_pieces_within_its_bound_and_checks_the_text() {
        let words = Words::default();
        put(&words, 7, "hello", &[1, 2]);
        assert_eq!(find(&words, 7, "hello"), Some(vec![1, 2]));
        assert_eq!(find(&words, 7, "jello"), None, "same key, other text");
        assert_eq!(find(&words, 8, "hello"), None);
        put(&words, 9, &"x".repeat(Word::MOST_BYTES + 1), &[3]);
        put(&words, 10, "many", &[1; Word::MOST_IDS + 1]);
        put(&words, 11, "none", &[]);
        assert_eq!(find(&words, 9, &"x".repeat(Word::MOST_BYTES + 1)), None);
        assert_eq!(find(&words, 10, "many"), None);
        assert_eq!(find(&words, 11, "none"), None);
        assert_eq!(words.hits.load(std::sync::atomic::Ordering::Relaxed), 1);
    }

    #[test]
    fn a_set_keeps_the_two_words_used_last_and_the_table_never_grows() {
        let words = Words::default();
        // Keys below 2^61 share the first shard; these three share a set.
        let [a, b, c] = [
            5u64,
            5 + SETS_PER_SHARD as u64,
            5 + 2 * SETS_PER_SHARD as u64,
        ];
        put(&words, a, "a", &[1]);
        put(&words, b, "b", &[2]);
        assert_eq!(find(&words, a, "a"), Some(vec![1]), "both kept");
        // `a` was used last, so `c` takes `b`'s place.
        put(&words, c, "c", &[3]);
        assert_eq!(find(&words, b, "b"), None);
        assert_eq!(find(&words, a, "a"), Some(vec![1]));
        assert_eq!(find(&words, c, "c"), Some(vec![3]));
        for key in 0..(4 * SETS_PER_SHARD as u64) {
            put(&words, key, "w", &[4]);
        }
        let sets = words.lock(0).expect("no other thread");
        assert_eq!(sets.len(), SETS_PER_SHARD, "the table never grew");
        assert_eq!(std::mem::size_of::<Set>(), 128, "a pair of cache lines");
        assert_eq!(std::mem::align_of::<Set>(), 128);
    }

    #[test]
    fn a_word_of_24_bytes_and_6_ids_is_kept_and_one_byte_or_id_more_is_not() {
        let bytes_24 = "abcdefghijklmnopqrstuvwx";
        let ids_6 = [1, 2, 3, 4, 5, 6];
        let word = Word::new(9, bytes_24, &ids_6).expect("at the limits");
        assert_eq!((word.text(), word.ids()), (bytes_24.as_bytes(), &ids_6[..]));
        assert!(word.is(9, bytes_24.as_bytes()));
        assert!(
            !word.is(9, &bytes_24.as_bytes()[..23]),
            "a prefix is another word"
        );
        assert!(Word::new(9, &format!("{bytes_24}y"), &ids_6).is_none());
        assert!(Word::new(9, bytes_24, &[1, 2, 3, 4, 5, 6, 7]).is_none());
        assert!(Word::new(9, "a", &[]).is_none(), "no ids: an empty place");
        // Through the cache: kept and found whole.
        let words = Words::default();
        put(&words, 9, bytes_24, &ids_6);
        assert_eq!(find(&words, 9, bytes_24), Some(ids_6.to_vec()));
    }

    #[test]
    fn a_lookup_waits_for_a_shard_another_thread_holds_and_keeping_passes_it_by() {
        let words = Words::default();
        let other = 1 << 61;
        put(&words, other, "v", &[5]);
        let held = words.lock(1).expect("free");
        put(&words, other + 1, "u", &[6]);
        assert_eq!(find(&words, 3, "t"), None, "another shard is not held");
        let started = std::sync::Barrier::new(2);
        std::thread::scope(|scope| {
            let finder = scope.spawn(|| {
                started.wait();
                find(&words, other, "v")
            });
            started.wait();
            // Let the finder reach the held shard (if it has not, it finds the word all the
            // same: the assert below then checks less, never wrongly).
            std::thread::sleep(std::time::Duration::from_millis(20));
            drop(held);
            assert_eq!(finder.join().unwrap(), Some(vec![5]), "waited, then found");
        });
        assert_eq!(
            find(&words, other + 1, "u"),
            None,
            "nothing kept while held"
        );
    }

    #[test]
    fn lookups_on_many_threads_hold_one_shard_at_a_time_and_never_wait_for_each_other() {
        let words = Words::default();
        // Keys in every shard, each thread asking them in another order (bounded: 200
        // batches a thread).
        let keys: Vec<u64> = (0..WORD_SHARDS as u64)
            .map(|shard| shard << 61 | 7)
            .collect();
        for &key in &keys {
            put(&words, key, "w", &[key as u32 & 0xff]);
        }
        let text = "w";
        std::thread::scope(|scope| {
            for turn in 0..4 {
                let (words, keys) = (&words, &keys);
                scope.spawn(move || {
                    let mut order = keys.clone();
                    order.rotate_left(turn * 2);
                    if turn % 2 == 1 {
                        order.reverse();
                    }
                    let batch: Vec<Piece> = order
                        .iter()
                        .map(|&key| Piece {
                            start: 0,
                            end: text.len(),
                            key: Some(key),
                        })
                        .collect();
                    let mut found = Vec::new();
                    for _ in 0..200 {
                        words.find_all(text, &batch, &mut found);
                        assert!(found.iter().all(Option::is_some), "every word found");
                    }
                });
            }
        });
    }

    #[test]
    fn the_split_keeps_what_lies_between_matches() {
        // Not a known pattern: `x` matches nowhere, so the search falls back to unanchored.
        let regex = regex_automata::meta::Regex::new(r"a+|\s+").unwrap();
        let text = "xxaa  b aa x";
        let split = Split {
            regex: &regex,
            llama3: false,
            text,
            at: 0,
            pending: None,
        };
        let pieces: Vec<&str> = split.map(|(start, end)| &text[start..end]).collect();
        // "  " before `b` gives up its last space (`\s+(?!\S)`), which stands alone then.
        assert_eq!(pieces, ["xx", "aa", " ", " ", "b", " ", "aa", " ", "x"]);
    }

    fn pieces(
        regex: &regex_automata::meta::Regex,
        llama3: bool,
        text: &str,
    ) -> Vec<(usize, usize)> {
        let split = Split {
            regex,
            llama3,
            text,
            at: 0,
            pending: None,
        };
        split.collect()
    }

    #[test]
    fn llama3_by_hand_cuts_as_the_regex_does() {
        let regex = regex_automata::meta::Regex::new(&format!(r"{LLAMA3_HEAD}|\s+")).unwrap();
        // Every class the pattern tells apart, and non-ASCII characters of each (letters,
        // digits, spaces, a symbol, `ſ`, which `(?i:'s)` matches, an emoji), in short texts.
        let alphabet: Vec<char> = "aZq09 \t\n\r\u{b}\u{c}'sStTrReEvVlLmMdD.!(-\0\u{1f}\u{7f}\
                                   é中ſ٣\u{85}\u{a0}\u{2028}€😀"
            .chars()
            .collect();
        let mut state = 0x9e37_79b9_7f4a_7c15_u64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        for round in 0..200_000 {
            let len = (next() % 24) as usize + 1;
            // Mostly ASCII, as prompts are, so that long ASCII runs meet the odd wide one.
            let text: String = (0..len)
                .map(|_| {
                    let pick = next() as usize;
                    if pick.is_multiple_of(8) {
                        alphabet[pick / 8 % alphabet.len()]
                    } else {
                        alphabet[pick / 8 % 34]
                    }
                })
                .collect();
            assert_eq!(
                pieces(&regex, true, &text),
                pieces(&regex, false, &text),
                "round {round}: {text:?}"
            );
        }
        let examples = [
            "Hello, world! It's 2026: we'll see 12345 items\n\n  \tdone.\r\n",
            "I'M HERE'LL'VE'RE'D 'x '' 'ſ 'Re",
            "  spaces   before\n \n  x (paren) #tag 3.14159 ...\n\n\n",
            "naïve café 中文 123٣4 a\u{a0}b a\u{85}\nb",
        ];
        for text in examples {
            assert_eq!(
                pieces(&regex, true, text),
                pieces(&regex, false, text),
                "{text:?}"
            );
        }
    }

    #[test]
    fn the_hand_cut_answers_on_ascii_and_defers_on_wide_characters() {
        // Without these the differential test above would pass if the hand cut always
        // deferred to the regex.
        let cut = |text: &str, at: usize| llama3_ascii(text.as_bytes(), at);
        assert_eq!(cut("'s", 0), Some(2));
        assert_eq!(cut("'LL go", 0), Some(3));
        assert_eq!(cut("hello world", 0), Some(5));
        assert_eq!(
            cut("hello world", 5),
            Some(11),
            "a space joins the word after it"
        );
        assert_eq!(cut("123456", 0), Some(3));
        assert_eq!(
            cut(" \n\nx", 0),
            Some(3),
            "whitespace up to its last line break"
        );
        assert_eq!(
            cut("a  b", 1),
            Some(3),
            "the caller leaves the last space to the word"
        );
        assert_eq!(
            cut("...!\n\nx", 0),
            Some(6),
            "symbols take the line breaks after them"
        );
        assert_eq!(
            cut("héllo", 0),
            None,
            "a letter beyond ASCII may continue the word"
        );
        assert_eq!(cut("'ſ", 0), None, "`ſ` folds to `s`");
        assert_eq!(
            cut("12٣", 0),
            None,
            "a digit beyond ASCII within the first three"
        );
        assert_eq!(cut("123٣", 0), Some(3));
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
