//! The trace a comparison or a driven router sends, with its oracle bound and summary.

use crate::error::UsageError;
use crate::oracle::{OracleBound, oracle_bound, prompt_blocks};
use crate::report::WorkloadSummary;
use crate::workload::{Trace, WorkloadSpec};

/// Generates the trace, tokenizes it in nominal order, and computes the oracle bound: with the
/// simulator's approximation, or with `tokenizer` (the model folder the simulators serve with
/// `--tokenizer`).
pub fn prepare(
    spec: &WorkloadSpec,
    concurrency: usize,
    capacity_blocks: u64,
    block_size: usize,
    tokenizer: Option<&std::path::Path>,
) -> anyhow::Result<(Trace, OracleBound, WorkloadSummary)> {
    let trace = Trace::generate(spec).map_err(UsageError::new)?;
    let prompts = match tokenizer {
        None => {
            let texts: Vec<String> = trace
                .nominal_order(concurrency)
                .into_iter()
                .map(|request| request.prompt_text())
                .collect();
            prompt_blocks(&texts, block_size)
        }
        Some(folder) => {
            let tokenizer = switchyard_tokenize::EngineTokenizer::load(
                folder,
                switchyard_tokenize::DEFAULT_CACHE_BYTES,
            )?;
            let mut prompts = Vec::new();
            for request in trace.nominal_order(concurrency) {
                let body = request.tokenize_body();
                let tokens = tokenizer
                    .tokenize(&body)
                    .map_err(|err| anyhow::anyhow!("the oracle's tokenizer: {err}"))?;
                prompts.push(crate::oracle::PromptBlocks::from_tokens(
                    &tokens, block_size,
                ));
            }
            prompts
        }
    };
    let oracle = oracle_bound(&prompts, capacity_blocks, block_size);
    let requests = trace.request_count();
    let workload = WorkloadSummary {
        spec: spec.clone(),
        sessions: trace.sessions.len(),
        prompt_tokens: oracle.prompt_tokens,
        mean_prompt_tokens: oracle.prompt_tokens as f64 / requests.max(1) as f64,
    };
    Ok((trace, oracle, workload))
}
