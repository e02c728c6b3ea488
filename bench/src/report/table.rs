//! The side-by-side table of a report, as printed on the terminal.

use std::fmt::Write as _;

use super::{DecisionStats, Report, RunReport, percent};
use crate::output::count;

impl Report {
    /// The side-by-side table printed on the terminal.
    pub fn table(&self) -> String {
        let mut out = String::new();
        let spec = &self.workload.spec;
        let _ = writeln!(
            out,
            "\n{} workload: {} requests in {} sessions, mean prompt {:.0} tokens, seed {}",
            spec.kind,
            self.workload.spec.requests,
            self.workload.sessions,
            self.workload.mean_prompt_tokens,
            spec.seed
        );
        if let Some(setup) = &self.setup {
            let _ = writeln!(
                out,
                "{} engines × {} KV blocks of {} tokens; PrefixLength {}, ConcurrencyThreshold {}; {}",
                setup.engines,
                setup.kv_cache_blocks,
                setup.block_size,
                setup.prefix_length,
                setup.concurrency_threshold,
                self.load_description()
            );
        } else {
            let _ = writeln!(out, "{}", self.load_description());
        }
        if let Some(oracle) = &self.oracle {
            let _ = writeln!(
                out,
                "oracle bound: {} of prompt tokens (compulsory misses only: {}, with the fleet's capacity: {})",
                percent(oracle.hit_rate),
                percent(oracle.compulsory_hit_tokens as f64 / oracle.prompt_tokens.max(1) as f64),
                percent(oracle.capacity_hit_tokens as f64 / oracle.prompt_tokens.max(1) as f64),
            );
        }
        let _ = writeln!(
            out,
            "latencies in model ms (wall ms / time scale {}); hit rate from {}",
            self.time_scale,
            self.runs
                .first()
                .and_then(|run| run.kv.or(run.kv_from_usage))
                .map_or("nowhere (no engine metrics, no usage)", |kv| if kv.source == "usage" {
                    "the answers' usage.prompt_tokens_details.cached_tokens"
                } else {
                    "the engines' vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total"
                })
        );
        for routers in self.router_groups() {
            let runs: Vec<&RunReport> = self
                .runs
                .iter()
                .filter(|run| run.routers == routers)
                .collect();
            let _ = writeln!(out);
            if self.mode == "compare" {
                let _ = writeln!(out, "{}:", count(routers, "router"));
            }
            out.push_str(&render_columns(&runs));
        }
        let owners = self.prefix_owner_shares.iter().map(|share| share.share);
        if let (Some(min), Some(max)) = (owners.clone().reduce(f64::min), owners.reduce(f64::max)) {
            let _ = writeln!(
                out,
                "\nPREFIX_AWARE without overflow (each prefix on its rendezvous owner) would give instances {}-{} of the requests",
                percent(min),
                percent(max)
            );
        }
        if !self.checks.is_empty() {
            let _ = writeln!(out, "\ntargets:");
            for check in &self.checks {
                let _ = writeln!(
                    out,
                    "  [{}] {}: {} (target {})",
                    if check.pass { "pass" } else { "FAIL" },
                    check.what,
                    check.measured,
                    check.target
                );
            }
        }
        for note in &self.notes {
            let _ = writeln!(out, "note: {note}");
        }
        out
    }

    fn load_description(&self) -> String {
        match self.rate {
            Some(rate) => format!(
                "open loop, {rate} sessions/s (model time), at most {} in flight, time scale {}",
                self.concurrency, self.time_scale
            ),
            None => format!(
                "closed loop, {} clients, time scale {}",
                self.concurrency, self.time_scale
            ),
        }
    }
}

fn signed_percent(fraction: Option<f64>) -> String {
    fraction.map_or_else(|| "-".into(), |value| format!("{:+.1}%", value * 100.0))
}

fn render_columns(runs: &[&RunReport]) -> String {
    let ms = |value: f64| format!("{value:.1}");
    let mut rows: Vec<(String, Vec<String>)> = Vec::new();
    let mut row = |name: &str, cell: &dyn Fn(&RunReport) -> String| {
        rows.push((name.to_owned(), runs.iter().map(|run| cell(run)).collect()));
    };
    row("", &RunReport::column);
    row("KV-cache hit rate", &|run| {
        run.hit_rate().map_or_else(|| "-".into(), percent)
    });
    row("  of the oracle bound", &|run| {
        run.kv
            .or(run.kv_from_usage)
            .and_then(|kv| kv.fraction_of_oracle)
            .map_or_else(|| "-".into(), percent)
    });
    row("TTFT p50 / p90 / p99", &|run| {
        let ttft = run.stats.ttft.model_ms;
        format!("{} / {} / {}", ms(ttft.p50), ms(ttft.p90), ms(ttft.p99))
    });
    row("  TTFT p50 vs baseline", &|run| {
        signed_percent(run.versus_baseline.as_ref().and_then(|v| v.ttft_p50_change))
    });
    row("  TTFT p90 vs baseline", &|run| {
        signed_percent(run.versus_baseline.as_ref().and_then(|v| v.ttft_p90_change))
    });
    row("ITL p50 / p99", &|run| {
        let itl = run.stats.itl.model_ms;
        format!("{} / {}", ms(itl.p50), ms(itl.p99))
    });
    row("e2e p50 / p99", &|run| {
        let e2e = run.stats.e2e.model_ms;
        format!("{} / {}", ms(e2e.p50), ms(e2e.p99))
    });
    row("throughput req/s (model)", &|run| {
        format!("{:.2}", run.stats.requests_per_s_model)
    });
    row("  vs baseline", &|run| {
        signed_percent(
            run.versus_baseline
                .as_ref()
                .and_then(|v| v.throughput_change),
        )
    });
    row("output tokens/s (model)", &|run| {
        format!("{:.0}", run.stats.output_tokens_per_s_model)
    });
    row("instance shares min-max", &|run| {
        run.stats.share_range().map_or_else(
            || "-".into(),
            |(min, max)| format!("{}-{}", percent(min), percent(max)),
        )
    });
    if runs.iter().any(|run| !run.stats.routes.is_empty()) {
        row("routes", &|run| {
            run.stats
                .routes
                .iter()
                .map(|(route, count)| format!("{route} {count}"))
                .collect::<Vec<_>>()
                .join(", ")
        });
    }
    if runs.iter().any(|run| run.disagreement.is_some()) {
        row("routers disagree (pairwise)", &|run| {
            run.disagreement
                .map_or_else(|| "-".into(), |found| percent(found.pairwise))
        });
    }
    // p50 / p99 of a router histogram, in µs.
    let micros = |stats: Option<DecisionStats>| {
        stats.map_or_else(
            || "-".into(),
            |stats| format!("{:.0} / {:.0}", stats.p50_ms * 1e3, stats.p99_ms * 1e3),
        )
    };
    // Exact, from the answers' x-switchyard-decision-us, where the routers sent it; else
    // their histogram's buckets.
    row("router decision p50/p99 us", &|run| {
        micros(
            run.router_cost
                .and_then(|cost| cost.decision)
                .or(run.router_decision),
        )
    });
    if runs.iter().any(|run| run.router_cost.is_some()) {
        let cost = |run: &RunReport| run.router_cost.unwrap_or_default();
        row("decision p50/p99 us, prefix seen before", &|run| {
            micros(cost(run).decision_seen_before)
        });
        row("decision p50/p99 us, first seen", &|run| {
            micros(cost(run).decision_first_seen)
        });
        if runs
            .iter()
            .any(|run| cost(run).cpu_ms_per_request.is_some())
        {
            row("router CPU ms per request", &|run| {
                cost(run)
                    .cpu_ms_per_request
                    .map_or_else(|| "-".into(), |ms| format!("{ms:.3}"))
            });
        }
    }
    if runs.iter().any(|run| run.kv_tokenize.is_some()) {
        row("KV tokenize round trip p50/p99 us", &|run| {
            micros(run.kv_tokenize)
        });
    }
    if runs.iter().any(|run| {
        run.router_cost
            .is_some_and(|cost| cost.tokenize_calls.is_some())
    }) {
        row("engine /tokenize calls: routing / checks", &|run| match run
            .router_cost
            .and_then(|cost| cost.tokenize_calls)
        {
            Some(calls) => format!("{:.0} / {:.0}", calls.routing, calls.checks),
            None => "-".into(),
        });
    }
    row("requests ok / errors", &|run| {
        format!("{} / {}", run.stats.ok, run.stats.errors)
    });
    row("wall time s", &|run| {
        format!("{:.1}", run.stats.wall_seconds)
    });
    if runs.iter().any(|run| !run.stats.classes.is_empty()) {
        for class in ["long", "short"] {
            let name = format!("{class}: TTFT p50 / ITL p99");
            row(&name, &|run| {
                run.stats.classes.get(class).map_or_else(
                    || "-".into(),
                    |stats| {
                        format!(
                            "{} / {}",
                            ms(stats.ttft.model_ms.p50),
                            ms(stats.itl.model_ms.p99)
                        )
                    },
                )
            });
        }
    }

    let name_width = rows
        .iter()
        .map(|(name, _)| name.chars().count())
        .max()
        .unwrap_or(0);
    let widths: Vec<usize> = (0..runs.len())
        .map(|column| {
            rows.iter()
                .map(|(_, cells)| cells[column].chars().count())
                .max()
                .unwrap_or(0)
        })
        .collect();
    let mut out = String::new();
    for (name, cells) in &rows {
        let _ = write!(out, "  {name:<name_width$}");
        for (cell, width) in cells.iter().zip(&widths) {
            let _ = write!(out, "   {cell:>width$}");
        }
        out.push('\n');
    }
    out
}
