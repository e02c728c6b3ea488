//! The `dpd` report: both arms of every point, the changes, and the Markdown table.

use std::fmt::Write as _;

use serde::Serialize;

use super::args::{Load, Topology};
use crate::output::{Invocation, count};
use crate::report::RunStats;
use crate::run::RunOutput;
use crate::stats::{Latency, relative_change};
use crate::workload::RequestClass;

/// Did the router decide as intended (DPD arms only)?
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct DecisionCheck {
    pub long: usize,
    /// Long prompts answered with `x-switchyard-route: disaggregated` and a prompt count at
    /// or past the threshold.
    pub long_disaggregated: usize,
    pub short: usize,
    /// Short prompts answered `direct` with a count below the threshold.
    pub short_direct: usize,
    /// The smallest `x-switchyard-prompt-tokens` of a long prompt (`N+`: counting stopped).
    pub min_long_header: Option<String>,
}

impl DecisionCheck {
    pub fn holds(&self) -> bool {
        self.long == self.long_disaggregated && self.short == self.short_direct
    }

    pub(crate) fn of(output: &RunOutput, threshold: u32) -> Self {
        let mut check = Self::default();
        let mut min_long: Option<(u32, String)> = None;
        for item in output.measured.iter().filter(|item| item.outcome.ok()) {
            let header = item.outcome.router_prompt_tokens.as_deref();
            let counted = header.and_then(|text| text.trim_end_matches('+').parse::<u32>().ok());
            let route = item.outcome.route.as_deref();
            match item.class {
                RequestClass::Long => {
                    check.long += 1;
                    if route == Some("disaggregated") && counted.is_some_and(|n| n >= threshold) {
                        check.long_disaggregated += 1;
                    }
                    if let (Some(n), Some(text)) = (counted, header)
                        && min_long.as_ref().is_none_or(|(least, _)| n < *least)
                    {
                        min_long = Some((n, text.to_owned()));
                    }
                }
                RequestClass::Short => {
                    check.short += 1;
                    if route == Some("direct") && counted.is_some_and(|n| n < threshold) {
                        check.short_direct += 1;
                    }
                }
            }
        }
        check.min_long_header = min_long.map(|(_, text)| text);
        check
    }
}

/// One arm (colocated or DPD) on one load.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ArmReport {
    pub stats: RunStats,
    /// Per request: (e2e − TTFT) / (output tokens − 1).
    pub tpot: Latency,
    /// DPD arms: the router's decisions checked against the prompts.
    pub decisions: Option<DecisionCheck>,
}

/// Relative changes of DPD against colocated (negative: DPD lower).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Changes {
    pub tpot_p50: Option<f64>,
    pub itl_p50: Option<f64>,
    pub itl_p99: Option<f64>,
    pub ttft_p50: Option<f64>,
    pub e2e_p50: Option<f64>,
    pub e2e_p99: Option<f64>,
    pub throughput: Option<f64>,
}

impl Changes {
    pub(crate) fn of(colocated: &ArmReport, dpd: &ArmReport) -> Self {
        let (a, b) = (&colocated.stats, &dpd.stats);
        Self {
            tpot_p50: relative_change(colocated.tpot.model_ms.p50, dpd.tpot.model_ms.p50),
            itl_p50: relative_change(a.itl.model_ms.p50, b.itl.model_ms.p50),
            itl_p99: relative_change(a.itl.model_ms.p99, b.itl.model_ms.p99),
            ttft_p50: relative_change(a.ttft.model_ms.p50, b.ttft.model_ms.p50),
            e2e_p50: relative_change(a.e2e.model_ms.p50, b.e2e.model_ms.p50),
            e2e_p99: relative_change(a.e2e.model_ms.p99, b.e2e.model_ms.p99),
            throughput: relative_change(a.output_tokens_per_s_model, b.output_tokens_per_s_model),
        }
    }
}

/// One topology on one load: both arms and the changes.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DpdPoint {
    pub topology: Topology,
    /// Engines of the colocated baseline.
    pub colocated_engines: usize,
    pub load: Load,
    pub colocated: ArmReport,
    pub dpd: ArmReport,
    pub change: Changes,
}

/// The prompts as both sides count them.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct PromptCounts {
    /// Smallest long prompt by the router's count (cl100k_base, chat overhead included).
    pub long_router_min: usize,
    /// Smallest long prompt by the simulator's tokenizer and chat template.
    pub long_engine_min: usize,
    /// Largest short prompt by the router's count.
    pub short_router_max: Option<usize>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DpdReport {
    #[serde(flatten)]
    pub invocation: Invocation,
    pub threshold: u32,
    pub long_tokens: u32,
    pub output_tokens: u32,
    pub time_scale: f64,
    pub prompts: PromptCounts,
    pub points: Vec<DpdPoint>,
    pub seconds: f64,
    pub notes: Vec<String>,
}

fn signed(change: Option<f64>) -> String {
    change.map_or_else(
        || "n/a".into(),
        |value| {
            format!(
                "{}{:.0}%",
                if value >= 0.0 { "+" } else { "−" },
                value.abs() * 100.0
            )
        },
    )
}

impl DpdReport {
    /// The Markdown table of docs/benchmarks.md: colocated → DPD (change) per point.
    pub fn table(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "\ndpd: long prompts {} tokens as the router counts them (smallest {}, {:.2} × the {} threshold; {} for the engines), {} output tokens, time scale {}; latencies in model ms, throughput in output tokens per model second; colocated → DPD (change)\n",
            self.long_tokens,
            self.prompts.long_router_min,
            self.prompts.long_router_min as f64 / f64::from(self.threshold),
            self.threshold,
            self.prompts.long_engine_min,
            self.output_tokens,
            self.time_scale,
        );
        let _ = writeln!(
            out,
            "| topology | load | TPOT p50 | ITL p50 / p99 | TTFT p50 | e2e p50 | e2e p99 | throughput |"
        );
        let _ = writeln!(
            out,
            "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"
        );
        for point in &self.points {
            let (a, b) = (&point.colocated, &point.dpd);
            let pair = |x: f64, y: f64, change: Option<f64>| {
                format!("{x:.1} → {y:.1} ({})", signed(change))
            };
            let change = &point.change;
            let _ = writeln!(
                out,
                "| {} vs {} | {} | {} | {:.1} / {:.0} → {:.1} / {:.0} ({} / {}) | {} | {} | {} | {:.0} → {:.0} ({}) |",
                point.topology.name(),
                count(point.colocated_engines, "engine"),
                point.load.name,
                pair(a.tpot.model_ms.p50, b.tpot.model_ms.p50, change.tpot_p50),
                a.stats.itl.model_ms.p50,
                a.stats.itl.model_ms.p99,
                b.stats.itl.model_ms.p50,
                b.stats.itl.model_ms.p99,
                signed(change.itl_p50),
                signed(change.itl_p99),
                pair(
                    a.stats.ttft.model_ms.p50,
                    b.stats.ttft.model_ms.p50,
                    change.ttft_p50
                ),
                pair(
                    a.stats.e2e.model_ms.p50,
                    b.stats.e2e.model_ms.p50,
                    change.e2e_p50
                ),
                pair(
                    a.stats.e2e.model_ms.p99,
                    b.stats.e2e.model_ms.p99,
                    change.e2e_p99
                ),
                a.stats.output_tokens_per_s_model,
                b.stats.output_tokens_per_s_model,
                signed(change.throughput),
            );
        }
        let errors: usize = self
            .points
            .iter()
            .map(|point| point.colocated.stats.errors + point.dpd.stats.errors)
            .sum();
        let decided = self
            .points
            .iter()
            .filter_map(|point| point.dpd.decisions.as_ref())
            .all(DecisionCheck::holds);
        let _ = writeln!(
            out,
            "\n{} failed requests; router decisions {} (long → disaggregated at ≥ threshold, short → direct); smallest long-prompt header {}; took {:.0} s",
            errors,
            if decided {
                "as intended"
            } else {
                "NOT as intended"
            },
            self.points
                .iter()
                .filter_map(|point| point.dpd.decisions.as_ref()?.min_long_header.clone())
                .next()
                .unwrap_or_else(|| "n/a".into()),
            self.seconds,
        );
        for note in &self.notes {
            let _ = writeln!(out, "note: {note}");
        }
        if let Some(mixed) = self
            .points
            .iter()
            .find(|point| !point.colocated.stats.classes.is_empty())
        {
            let _ = writeln!(
                out,
                "\nmixed load, per class ({}): TTFT p50 / ITL p99 colocated → DPD",
                mixed.topology.name()
            );
            for (class, colocated) in &mixed.colocated.stats.classes {
                if let Some(dpd) = mixed.dpd.stats.classes.get(class) {
                    let _ = writeln!(
                        out,
                        "  {class} ({} requests): TTFT {:.1} → {:.1} ms, ITL p99 {:.1} → {:.1} ms",
                        colocated.requests,
                        colocated.ttft.model_ms.p50,
                        dpd.ttft.model_ms.p50,
                        colocated.itl.model_ms.p99,
                        dpd.itl.model_ms.p99
                    );
                }
            }
        }
        out
    }
}
