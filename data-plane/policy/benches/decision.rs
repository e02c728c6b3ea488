//! The cost of one routing decision: parse an OpenAI chat body, extract the prefix text,
//! hash it, and rank the instances (PREFIX_AWARE), at PrefixLength 4096 and 65536, plus the
//! native-API path (byte prefix), and the ranking alone with SageMaker's semantics and with
//! the bounded-load extension. `cargo bench -p switchyard-policy`.

use std::hint::black_box;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use switchyard_policy::hash::routing_key;
use switchyard_policy::openai::OpenAiRequest;
use switchyard_policy::rank::{InstanceView, LoadBalance, Strategy, rank};

fn chat_body(prompt_chars: usize) -> Vec<u8> {
    let words = [
        "policy", "refund", "order", "customer", "support", "ticket", "shipping",
    ];
    let mut text = String::with_capacity(prompt_chars + 16);
    let mut index = 0;
    while text.len() < prompt_chars {
        text.push_str(words[index % words.len()]);
        text.push(' ');
        index += 1;
    }
    serde_json::to_vec(&serde_json::json!({
        "model": "endpoint",
        "messages": [
            {"role": "system", "content": text},
            {"role": "user", "content": "Where is my order?"}
        ],
        "max_tokens": 64
    }))
    .unwrap()
}

fn instances(count: usize) -> Vec<InstanceView> {
    (0..count)
        .map(|index| InstanceView::new(&format!("engine-{index}"), 1.0))
        .collect()
}

fn decision(c: &mut Criterion) {
    let fleet = instances(7);
    let strategy = Strategy::PrefixAware {
        concurrency_threshold: 10,
        balance: None,
    };
    let mut group = c.benchmark_group("openai_decision");
    for prefix_length in [4096usize, 65536] {
        let body = chat_body(prefix_length + 2000);
        group.throughput(Throughput::Bytes(body.len() as u64));
        group.bench_with_input(
            BenchmarkId::from_parameter(prefix_length),
            &body,
            |b, body| {
                b.iter(|| {
                    let request = OpenAiRequest::parse(black_box(body)).unwrap();
                    let text = request.prefix_text(prefix_length);
                    let key = routing_key(b"", text.as_bytes());
                    black_box(rank(strategy, &fleet, |_| 0, key, 1).first())
                });
            },
        );
    }
    group.finish();

    let mut group = c.benchmark_group("native_decision");
    for prefix_length in [4096usize, 65536] {
        let body = chat_body(prefix_length + 2000);
        group.bench_with_input(
            BenchmarkId::from_parameter(prefix_length),
            &body,
            |b, body| {
                b.iter(|| {
                    let prefix = switchyard_policy::prefix::native(black_box(body), prefix_length);
                    let key = routing_key(b"", prefix);
                    black_box(rank(strategy, &fleet, |_| 0, key, 1).first())
                });
            },
        );
    }
    group.finish();

    // Loads as a busy fleet has them (the bounded walk sums them and may pass the owner).
    let bounded = Strategy::PrefixAware {
        concurrency_threshold: 16,
        balance: Some(LoadBalance {
            factor: 1.25,
            slack: 2,
        }),
    };
    let mut group = c.benchmark_group("rank_only");
    for count in [7usize, 64] {
        let fleet = instances(count);
        let loads: Vec<u32> = (0..count as u32).map(|index| (index * 7) % 9).collect();
        for (name, strategy) in [("sagemaker", strategy), ("bounded", bounded)] {
            group.bench_with_input(
                BenchmarkId::new(name, count),
                &(&fleet, &loads),
                |b, (fleet, loads)| {
                    let mut key = 0u64;
                    b.iter(|| {
                        key = key.wrapping_add(0x9E37_79B9_7F4A_7C15);
                        black_box(rank(strategy, fleet, |i| loads[i], key, 1).first())
                    });
                },
            );
        }
    }
    group.finish();
}

criterion_group!(benches, decision);
criterion_main!(benches);
