//! The cost of KV_AWARE's decision once the request's token ids are known: the router's block
//! hashes over the prompt, the walk over the index for every instance, and the ranking, for
//! prompts of 8,000 and 100,000 tokens on 7 instances (each holding a different share of the
//! prompt; one all of it, the worst case), and for a prompt nobody holds ("cold"); and the
//! 18,000-token prompt of the article preset (Llama 3's tokenizer) in an index as full as that
//! benchmark's ("fleet": 300 prefixes of 1,125 blocks over 7 instances, about 340,000 blocks,
//! so that the walk's lookups miss the CPU's caches as they do in a router).
//! `cargo bench -p switchyard-router --bench kv_decision`.

use std::hint::black_box;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use switchyard_kv::wire::{BlockStored, EngineHash, EventBatch, KvEvent};
use switchyard_kv::{IndexCounters, IndexSettings, VariantIndex};
use switchyard_policy::hash::instance_hash;
use switchyard_policy::kv::{KvParams, rank_kv};
use switchyard_policy::rank::InstanceView;
use switchyard_shared::InstanceId;

const BLOCK: usize = 16;

fn decision(c: &mut Criterion) {
    let mut group = c.benchmark_group("kv_decision");
    for prompt_tokens in [8_000usize, 100_000] {
        let tokens: Vec<u32> = (0..prompt_tokens as u32)
            .map(|t| t.wrapping_mul(2_654_435_761))
            .collect();
        let index = VariantIndex::default();
        let ids: Vec<InstanceId> = (0..7)
            .map(|i| InstanceId::new(&format!("engine-{i}")).unwrap())
            .collect();
        let blocks = prompt_tokens / BLOCK;
        for (i, id) in ids.iter().enumerate() {
            // Instance i holds the first (i + 1) / 7 of the prompt (one holds all of it: the
            // worst case, every block hashed and looked up).
            let held = blocks * (i + 1) / 7;
            let event = KvEvent::BlockStored(BlockStored {
                block_hashes: (0..held as u64).map(|b| EngineHash(b + 1)).collect(),
                parent_block_hash: None,
                token_ids: tokens[..held * BLOCK].to_vec(),
                block_size: BLOCK as u32,
                ..BlockStored::default()
            });
            let batch = EventBatch {
                ts: 0.0,
                events: vec![event],
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
        group.throughput(Throughput::Elements(prompt_tokens as u64));
        group.bench_with_input(
            BenchmarkId::from_parameter(prompt_tokens),
            &tokens,
            |b, tokens| {
                b.iter(|| {
                    let found = index.match_tokens(black_box(tokens), &ids).unwrap();
                    let ranking = rank_kv(
                        params,
                        &views,
                        |_| 0,
                        &found.matched,
                        found.blocks,
                        found.prefix_key,
                        1,
                    );
                    black_box(ranking.first())
                });
            },
        );
        // A prompt nobody holds: only the first blocks are hashed (for the tie-break key).
        let cold: Vec<u32> = tokens.iter().map(|token| token ^ 1).collect();
        group.bench_with_input(
            BenchmarkId::new("cold", prompt_tokens),
            &cold,
            |b, tokens| {
                b.iter(|| {
                    let found = index.match_tokens(black_box(tokens), &ids).unwrap();
                    black_box(found.prefix_key)
                });
            },
        );
    }
    fleet(&mut group);
    group.finish();
}

/// 300 prefixes of 18,000 tokens, each held by one or two of 7 instances; the request's prefix
/// held whole by one of them.
fn fleet(group: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>) {
    const PREFIXES: u32 = 300;
    const TOKENS: usize = 18_000;
    let ids: Vec<InstanceId> = (0..7)
        .map(|i| InstanceId::new(&format!("engine-{i}")).unwrap())
        .collect();
    let index = VariantIndex::default();
    let prompt = |prefix: u32| -> Vec<u32> {
        (0..TOKENS as u32)
            .map(|t| (t ^ prefix.wrapping_mul(0x9e37_79b9)).wrapping_mul(2_654_435_761))
            .collect()
    };
    for prefix in 0..PREFIXES {
        let tokens = prompt(prefix);
        let held = TOKENS / BLOCK;
        let holders = [prefix as usize % 7, (prefix as usize * 3 + 1) % 7];
        for &holder in &holders[..1 + (prefix % 2) as usize] {
            let batch = EventBatch {
                ts: 0.0,
                events: vec![KvEvent::BlockStored(BlockStored {
                    block_hashes: (0..held as u64)
                        .map(|b| EngineHash(u64::from(prefix) << 32 | b))
                        .collect(),
                    parent_block_hash: None,
                    token_ids: tokens[..held * BLOCK].to_vec(),
                    block_size: BLOCK as u32,
                    ..BlockStored::default()
                })],
                data_parallel_rank: None,
            };
            index.apply(
                &ids[holder],
                &batch,
                &IndexSettings::default(),
                &IndexCounters::default(),
            );
        }
    }
    // Each iteration another prefix, as requests come (a prefix walked just before would be
    // in the caches). After the first round every prefix has been walked before, so the walk
    // starts at its last checkpoint: this measures a prompt whose start was seen before.
    let requests: Vec<Vec<u32>> = (0..PREFIXES)
        .map(|prefix| {
            let mut request = prompt(prefix);
            request.extend((0..40).map(|t| t * 7 + 1));
            request
        })
        .collect();
    group.throughput(Throughput::Elements(requests[0].len() as u64));
    let mut next = 0;
    group.bench_function(BenchmarkId::new("fleet", requests[0].len()), |b| {
        b.iter(|| {
            next = (next + 1) % requests.len();
            let found = index
                .match_tokens(black_box(&requests[next]), &ids)
                .unwrap();
            black_box(found.matched)
        });
    });
}

criterion_group!(benches, decision);
criterion_main!(benches);
