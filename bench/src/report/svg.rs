//! A hand-written SVG chart of a report: KV-cache hit rate (with the oracle bound), TTFT
//! p50/p90 in model ms, and each instance's share of requests, per strategy and router count.
//! A comparison with bounded-load or peer columns shows throughput and the idlest instance's
//! share instead of TTFT and per-instance shares.

use std::fmt::Write as _;

use super::{Report, RunReport};
use crate::output::count;

const HEIGHT: f64 = 430.0;
const MIN_PANEL_WIDTH: f64 = 330.0;
/// Room per bar when many runs are compared.
const BAR_SLOT: f64 = 52.0;
const PANEL_GAP: f64 = 85.0;
const PANEL_HEIGHT: f64 = 250.0;
const PANEL_TOP: f64 = 95.0;

/// Colours per column (strategy, bounded-load PREFIX_AWARE, peer), lighter for later router
/// groups.
fn color(column: &str, group: usize) -> &'static str {
    const RANDOM: [&str; 3] = ["#8d8d8d", "#b5b5b5", "#d2d2d2"];
    const LEAST: [&str; 3] = ["#e3902b", "#f0b56b", "#f6d3a4"];
    const PREFIX: [&str; 3] = ["#1f66c2", "#5a95e0", "#9cc0ee"];
    const BOUNDED: [&str; 3] = ["#3c8d5a", "#6bb487", "#a5d4b6"];
    const OTHER: [&str; 3] = ["#8e44ad", "#b07cc6", "#d2b4de"];
    let palette = match column {
        "RANDOM" => RANDOM,
        "LEAST_OUTSTANDING_REQUESTS" => LEAST,
        "PREFIX_AWARE" => PREFIX,
        bounded if bounded.starts_with("PREFIX_AWARE c=") => BOUNDED,
        _ => OTHER,
    };
    palette[group.min(2)]
}

pub(crate) fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// Bar labels are narrow: the legend has the full names.
fn short_name(column: &str) -> String {
    match column {
        "LEAST_OUTSTANDING_REQUESTS" => "LOR".into(),
        "PREFIX_AWARE" => "PREFIX".into(),
        // "PREFIX_AWARE c=1.25 s=2" → "c=1.25 s=2".
        bounded if bounded.starts_with("PREFIX_AWARE c=") => {
            bounded.trim_start_matches("PREFIX_AWARE ").to_owned()
        }
        other => other.split_whitespace().next().unwrap_or(other).to_owned(),
    }
}

/// Opens a standalone SVG document of `width` × `height` on a white background, with the
/// charts' text classes and `extra_styles` (rules of further classes).
pub(crate) fn document_start(out: &mut String, width: f64, height: f64, extra_styles: &str) {
    let _ = writeln!(
        out,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" font-family="Helvetica, Arial, sans-serif">"#
    );
    let _ = writeln!(
        out,
        "<style>.title{{font-size:14px;font-weight:bold}}.axis{{font-size:10px;fill:#555}}.label{{font-size:9px;fill:#333}}.value{{font-size:10px;fill:#111}}{extra_styles}.head{{font-size:16px;font-weight:bold}}.sub{{font-size:11px;fill:#555}}</style>"
    );
    out.push_str(r##"<rect width="100%" height="100%" fill="#ffffff"/>"##);
    out.push('\n');
}

/// A bar: label under it, value text over it.
pub(crate) struct Bar {
    pub label: String,
    pub value: f64,
    pub text: String,
    pub color: &'static str,
}

impl Bar {
    /// Writes the value text centred at `value_y` and the label's lines below the bar, the
    /// first at `labels_top`, one every `line_height`.
    pub(crate) fn write_captions(
        &self,
        out: &mut String,
        center: f64,
        value_y: f64,
        labels_top: f64,
        line_height: f64,
    ) {
        let _ = writeln!(
            out,
            r#"<text x="{center:.1}" y="{value_y:.1}" class="value" text-anchor="middle">{}</text>"#,
            escape(&self.text)
        );
        for (line, text) in self.label.lines().enumerate() {
            let _ = writeln!(
                out,
                r#"<text x="{center:.1}" y="{:.1}" class="label" text-anchor="middle">{}</text>"#,
                labels_top + line_height * line as f64,
                escape(text)
            );
        }
    }
}

/// A bar chart panel at x with a y axis from 0 to `axis.0` in steps of `axis.1`, and an
/// optional dashed reference line.
#[allow(clippy::too_many_arguments)]
fn panel(
    out: &mut String,
    x: f64,
    width: f64,
    title: &str,
    bars: &[Bar],
    (top, step): (f64, f64),
    axis: &dyn Fn(f64) -> String,
    reference: Option<(f64, String)>,
) {
    let y = PANEL_TOP;
    let _ = writeln!(
        out,
        r#"<text x="{:.1}" y="{:.1}" class="title">{}</text>"#,
        x,
        y - 22.0,
        escape(title)
    );
    let top = if top > 0.0 { top } else { 1.0 };
    let step = if step > 0.0 { step } else { top };
    let scale = |value: f64| y + PANEL_HEIGHT - (value / top).clamp(0.0, 1.0) * PANEL_HEIGHT;
    let ticks = (top / step).round() as u32;
    for tick in 0..=ticks {
        let value = step * f64::from(tick);
        let line_y = scale(value);
        let _ = writeln!(
            out,
            r##"<line x1="{x:.1}" y1="{line_y:.1}" x2="{:.1}" y2="{line_y:.1}" stroke="#e4e4e4"/><text x="{:.1}" y="{:.1}" class="axis" text-anchor="end">{}</text>"##,
            x + width,
            x - 6.0,
            line_y + 4.0,
            escape(&axis(value))
        );
    }
    let slot = width / bars.len().max(1) as f64;
    let bar_width = (slot * 0.7).min(60.0);
    for (index, bar) in bars.iter().enumerate() {
        let center = x + slot * (index as f64 + 0.5);
        let bar_top = scale(bar.value);
        let _ = writeln!(
            out,
            r#"<rect x="{:.1}" y="{bar_top:.1}" width="{bar_width:.1}" height="{:.1}" fill="{}"><title>{}: {}</title></rect>"#,
            center - bar_width / 2.0,
            (y + PANEL_HEIGHT - bar_top).max(0.0),
            bar.color,
            escape(&bar.label.replace('\n', " ")),
            escape(&bar.text)
        );
        bar.write_captions(out, center, bar_top - 4.0, y + PANEL_HEIGHT + 14.0, 12.0);
    }
    if let Some((value, label)) = reference {
        let line_y = scale(value);
        let _ = writeln!(
            out,
            r##"<line x1="{x:.1}" y1="{line_y:.1}" x2="{:.1}" y2="{line_y:.1}" stroke="#c0392b" stroke-dasharray="6 4" stroke-width="1.5"/><text x="{:.1}" y="{:.1}" class="ref">{}</text>"##,
            x + width,
            x + 4.0,
            line_y - 5.0,
            escape(&label)
        );
    }
    let _ = writeln!(
        out,
        r##"<line x1="{x:.1}" y1="{:.1}" x2="{:.1}" y2="{:.1}" stroke="#444"/>"##,
        y + PANEL_HEIGHT,
        x + width,
        y + PANEL_HEIGHT
    );
}

fn run_label(run: &RunReport, groups: usize) -> String {
    let column = run.column();
    if groups > 1 {
        format!("{}\n{}", short_name(&column), count(run.routers, "router"))
    } else {
        short_name(&column)
    }
}

/// Renders `report` as a standalone SVG document.
pub fn render(report: &Report) -> String {
    let groups = report.router_groups();
    let group_of = |run: &RunReport| groups.iter().position(|g| *g == run.routers).unwrap_or(0);
    let strategy_of = RunReport::column;
    let sweep = report
        .runs
        .iter()
        .any(|run| run.load_balance.is_some() || run.peer.is_some());
    let panel_width = (BAR_SLOT * report.runs.len() as f64).max(MIN_PANEL_WIDTH);
    let panel_x = |index: f64| 60.0 + index * (panel_width + PANEL_GAP);
    let width = panel_x(3.0) - PANEL_GAP + 20.0;
    let mut out = String::new();
    document_start(&mut out, width, HEIGHT, ".ref{font-size:10px;fill:#c0392b}");
    let spec = &report.workload.spec;
    let _ = writeln!(
        out,
        r#"<text x="20" y="26" class="head">switchyard-bench: {} workload, {}</text>"#,
        escape(spec.kind.as_str()),
        escape(&match &report.setup {
            Some(setup) => format!("{} engines", setup.engines),
            None => "existing router".to_owned(),
        })
    );
    let _ = writeln!(
        out,
        r#"<text x="20" y="44" class="sub">{} requests, seed {}, time scale {} (latencies in model ms = wall ms / time scale); hit rate = cached / prompt tokens</text>"#,
        spec.requests, spec.seed, report.time_scale
    );

    // Panel 1: hit rate.
    let hit_bars: Vec<Bar> = report
        .runs
        .iter()
        .map(|run| {
            let rate = run.hit_rate().unwrap_or(0.0);
            Bar {
                label: run_label(run, groups.len()),
                value: rate,
                text: format!("{:.0}%", rate * 100.0),
                color: color(&strategy_of(run), group_of(run)),
            }
        })
        .collect();
    let oracle = report.oracle.map(|oracle| {
        (
            oracle.hit_rate,
            format!("oracle {:.0}%", oracle.hit_rate * 100.0),
        )
    });
    panel(
        &mut out,
        panel_x(0.0),
        panel_width,
        "KV-cache hit rate",
        &hit_bars,
        (1.0, 0.25),
        &|value| format!("{:.0}%", value * 100.0),
        oracle,
    );

    if sweep {
        sweep_panels(&mut out, report, panel_width, &panel_x);
    } else {
        strategy_panels(&mut out, report, panel_width, &panel_x);
    }
    legend(&mut out, report, &groups);
    out.push_str("</svg>\n");
    out
}

/// Throughput and the idlest instance's share per run (bounded-load and peer comparisons).
fn sweep_panels(out: &mut String, report: &Report, panel_width: f64, panel_x: &dyn Fn(f64) -> f64) {
    let groups = report.router_groups();
    let group_of = |run: &RunReport| groups.iter().position(|g| *g == run.routers).unwrap_or(0);
    let throughput_bars: Vec<Bar> = report
        .runs
        .iter()
        .map(|run| Bar {
            label: run_label(run, groups.len()),
            value: run.stats.requests_per_s_model,
            text: format!("{:.1}", run.stats.requests_per_s_model),
            color: color(&run.column(), group_of(run)),
        })
        .collect();
    let throughput_axis = axis(
        throughput_bars
            .iter()
            .map(|bar| bar.value)
            .fold(0.0, f64::max)
            * 1.1,
    );
    panel(
        out,
        panel_x(1.0),
        panel_width,
        "Throughput, requests/s (model time)",
        &throughput_bars,
        throughput_axis,
        &|value| format!("{value:.0}"),
        None,
    );
    let idle_bars: Vec<Bar> = report
        .runs
        .iter()
        .map(|run| {
            let (min, _) = run.stats.share_range().unwrap_or((0.0, 0.0));
            Bar {
                label: run_label(run, groups.len()),
                value: min,
                text: format!("{:.0}%", min * 100.0),
                color: color(&run.column(), group_of(run)),
            }
        })
        .collect();
    let engines = report
        .setup
        .as_ref()
        .map_or(1, |setup| setup.engines.max(1));
    let fair = 1.0 / engines as f64;
    panel(
        out,
        panel_x(2.0),
        panel_width,
        "Idlest instance's share of requests",
        &idle_bars,
        axis(fair * 1.1),
        &|value| format!("{:.0}%", value * 100.0),
        Some((
            fair / 2.0,
            format!("half a fair share ({:.1}%)", fair * 50.0),
        )),
    );
}

/// TTFT p50 per run and each instance's share (strategy comparisons).
fn strategy_panels(
    out: &mut String,
    report: &Report,
    panel_width: f64,
    panel_x: &dyn Fn(f64) -> f64,
) {
    let groups = report.router_groups();
    let group_of = |run: &RunReport| groups.iter().position(|g| *g == run.routers).unwrap_or(0);
    let strategy_of = RunReport::column;
    // Panel 2: TTFT p50 (bars) with p90 in the label.
    let ttft_bars: Vec<Bar> = report
        .runs
        .iter()
        .map(|run| Bar {
            label: run_label(run, groups.len()),
            value: run.stats.ttft.model_ms.p50,
            text: format!("{:.0}", run.stats.ttft.model_ms.p50),
            color: color(&strategy_of(run), group_of(run)),
        })
        .collect();
    let ttft_axis = axis(ttft_bars.iter().map(|bar| bar.value).fold(0.0, f64::max) * 1.1);
    panel(
        out,
        panel_x(1.0),
        panel_width,
        "TTFT p50, model ms",
        &ttft_bars,
        ttft_axis,
        &|value| format!("{value:.0}"),
        None,
    );

    // Panel 3: instance shares of the first router group, one bar per (instance, strategy).
    let first_group: Vec<&RunReport> = report
        .runs
        .iter()
        .filter(|run| Some(&run.routers) == groups.first())
        .collect();
    let instances: Vec<String> = first_group
        .iter()
        .flat_map(|run| {
            run.stats
                .instance_shares
                .iter()
                .map(|share| share.instance.clone())
        })
        .fold(Vec::new(), |mut seen, instance| {
            if !seen.contains(&instance) {
                seen.push(instance);
            }
            seen
        });
    let mut share_bars = Vec::new();
    for instance in &instances {
        for run in &first_group {
            let share = run
                .stats
                .instance_shares
                .iter()
                .find(|share| &share.instance == instance)
                .map_or(0.0, |share| share.share);
            share_bars.push(Bar {
                label: String::new(),
                value: share,
                text: String::new(),
                color: color(&strategy_of(run), 0),
            });
        }
        if let Some(bar) = share_bars.iter_mut().rev().nth(first_group.len() / 2) {
            bar.label = instance.trim_start_matches("engine-").to_owned();
        }
    }
    let share_axis = axis(share_bars.iter().map(|bar| bar.value).fold(0.0, f64::max) * 1.1);
    let even = (!instances.is_empty()).then(|| {
        let even = 1.0 / instances.len() as f64;
        (
            even,
            format!("1/{} = {:.1}%", instances.len(), even * 100.0),
        )
    });
    panel(
        out,
        panel_x(2.0),
        panel_width,
        &format!(
            "Share of requests per instance{}",
            groups.first().map_or(String::new(), |routers| format!(
                " ({})",
                count(*routers, "router")
            ))
        ),
        &share_bars,
        share_axis,
        &|value| format!("{:.0}%", value * 100.0),
        even,
    );
}

fn legend(out: &mut String, report: &Report, groups: &[usize]) {
    let strategy_of = RunReport::column;
    let mut legend_x = 60.0;
    let mut seen = Vec::new();
    for run in &report.runs {
        let strategy = strategy_of(run);
        if seen.contains(&strategy) {
            continue;
        }
        let _ = writeln!(
            out,
            r#"<rect x="{legend_x:.1}" y="{:.1}" width="12" height="12" fill="{}"/><text x="{:.1}" y="{:.1}" class="axis">{}</text>"#,
            HEIGHT - 26.0,
            color(&strategy, 0),
            legend_x + 16.0,
            HEIGHT - 16.0,
            escape(&strategy)
        );
        legend_x += 30.0 + 7.0 * strategy.len() as f64;
        seen.push(strategy);
    }
    if groups.len() > 1 {
        let _ = writeln!(
            out,
            r#"<text x="{legend_x:.1}" y="{:.1}" class="axis">lighter: more routers ({})</text>"#,
            HEIGHT - 16.0,
            groups
                .iter()
                .map(usize::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
}

/// 1, 2, 2.5 or 5 times a power of ten, at least `value`.
fn nice_ceiling(value: f64) -> f64 {
    if !(value.is_finite() && value > 0.0) {
        return 1.0;
    }
    let magnitude = 10f64.powf(value.log10().floor());
    for step in [1.0, 2.0, 2.5, 5.0, 10.0] {
        if step * magnitude >= value * (1.0 - 1e-9) {
            return step * magnitude;
        }
    }
    10.0 * magnitude
}

/// (top, step) of an axis showing 0..`max` in about four nice steps.
fn axis(max: f64) -> (f64, f64) {
    let step = nice_ceiling(max / 4.0);
    ((max / step).ceil().max(1.0) * step, step)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nice_ceilings() {
        assert_eq!(nice_ceiling(0.0), 1.0);
        assert_eq!(nice_ceiling(0.17), 0.2);
        assert_eq!(nice_ceiling(430.0), 500.0);
        assert_eq!(nice_ceiling(100.0), 100.0);
        assert_eq!(nice_ceiling(21.0), 25.0);
        assert_eq!(axis(395.0), (400.0, 100.0));
        assert_eq!(axis(0.0), (1.0, 1.0));
        let (top, step) = axis(0.21);
        assert!((top - 0.3).abs() < 1e-12 && (step - 0.1).abs() < 1e-12);
    }

    #[test]
    fn text_is_escaped() {
        assert_eq!(escape("a<b & \"c\""), "a&lt;b &amp; &quot;c&quot;");
    }
}
