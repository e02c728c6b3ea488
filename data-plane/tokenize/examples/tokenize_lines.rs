//! Reads vLLM `/tokenize` bodies, one per line, from stdin and writes what
//! `EngineTokenizer::tokenize` makes of each, one JSON line per body: `{"tokens": [...]}` or
//! `{"refused": "..."}`. For checking a tokenizer folder against an engine by hand:
//!
//! `cargo run -p switchyard-tokenize --example tokenize_lines -- DIR < bodies.jsonl`

use std::io::{BufRead, Write};

fn main() {
    let dir = std::env::args()
        .nth(1)
        .expect("usage: tokenize_lines DIR < bodies.jsonl");
    let tokenizer = switchyard_tokenize::EngineTokenizer::load(
        std::path::Path::new(&dir),
        switchyard_tokenize::DEFAULT_CACHE_BYTES,
    )
    .expect("a tokenizer folder");
    if let Some(note) = tokenizer.template_note() {
        eprintln!("chat bodies left to the engine: {note}");
    }
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    for line in std::io::stdin().lock().lines() {
        let line = line.expect("stdin");
        let answer = match tokenizer.tokenize(line.as_bytes()) {
            Ok(tokens) => serde_json::json!({ "tokens": tokens }),
            Err(refusal) => serde_json::json!({ "refused": refusal.to_string() }),
        };
        writeln!(out, "{answer}").expect("stdout");
    }
}
