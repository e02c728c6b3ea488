//! The trace a comparison or a driven router sends, with its oracle bound and summary.

use crate::error::UsageError;
use crate::oracle::{OracleBound, oracle_bound, prompt_blocks};
use crate::report::WorkloadSummary;
use crate::workload::{Trace, WorkloadSpec};

/// Generates the trace, tokenizes it in nominal order, and computes the oracle bound.
pub fn prepare(
    spec: &WorkloadSpec,
    concurrency: usize,
    capacity_blocks: u64,
    block_size: usize,
) -> anyhow::Result<(Trace, OracleBound, WorkloadSummary)> {
    let trace = Trace::generate(spec).map_err(UsageError::new)?;
    let texts: Vec<String> = trace
        .nominal_order(concurrency)
        .into_iter()
        .map(|request| request.prompt_text())
        .collect();
    let prompts = prompt_blocks(&texts, block_size);
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
