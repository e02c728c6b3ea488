//! The `dpd` chart: DPD's change against colocated, four panels of bars.

use std::fmt::Write as _;

use super::report::{Changes, DpdReport};
use crate::report::svg::{Bar, document_start, escape};

/// One panel of [`render_chart`]: a bar per point, up or down from a zero line, on an axis
/// symmetric about 0 in steps of 25%.
fn change_panel(out: &mut String, (x, y): (f64, f64), width: f64, title: &str, bars: &[Bar]) {
    const HEIGHT: f64 = 200.0;
    let largest = bars
        .iter()
        .map(|bar| bar.value.abs())
        .fold(0.25_f64, f64::max);
    let top = (largest / 0.25).ceil() * 0.25;
    let scale = |value: f64| y + HEIGHT / 2.0 - (value / top).clamp(-1.0, 1.0) * HEIGHT / 2.0;
    let _ = writeln!(
        out,
        r#"<text x="{x:.1}" y="{:.1}" class="title">{}</text>"#,
        y - 14.0,
        escape(title)
    );
    let ticks = (top / 0.25).round() as i32;
    for tick in -ticks..=ticks {
        let value = 0.25 * f64::from(tick);
        let line_y = scale(value);
        let stroke = if tick == 0 { "#444" } else { "#e4e4e4" };
        let _ = writeln!(
            out,
            r##"<line x1="{x:.1}" y1="{line_y:.1}" x2="{:.1}" y2="{line_y:.1}" stroke="{stroke}"/><text x="{:.1}" y="{:.1}" class="axis" text-anchor="end">{:+.0}%</text>"##,
            x + width,
            x - 6.0,
            line_y + 4.0,
            value * 100.0
        );
    }
    let slot = width / bars.len().max(1) as f64;
    let bar_width = (slot * 0.7).min(40.0);
    for (index, bar) in bars.iter().enumerate() {
        let center = x + slot * (index as f64 + 0.5);
        let (zero, end) = (scale(0.0), scale(bar.value));
        let _ = writeln!(
            out,
            r#"<rect x="{:.1}" y="{:.1}" width="{bar_width:.1}" height="{:.1}" fill="{}"><title>{}: {}</title></rect>"#,
            center - bar_width / 2.0,
            zero.min(end),
            (zero - end).abs(),
            bar.color,
            escape(&bar.label.replace('\n', " ")),
            escape(&bar.text)
        );
        let text_y = if bar.value >= 0.0 {
            end - 4.0
        } else {
            end + 11.0
        };
        bar.write_captions(out, center, text_y, y + HEIGHT + 14.0, 11.0);
    }
}

/// The `dpd` chart: DPD's change against colocated (same engine count, same run) in TPOT p50,
/// output throughput, TTFT p50 and e2e p50, a bar per topology and load.
pub fn render_chart(report: &DpdReport) -> String {
    const PALETTE: [&str; 4] = ["#1f66c2", "#3c8d5a", "#e3902b", "#8e44ad"];
    let mut topologies: Vec<String> = Vec::new();
    for point in &report.points {
        let name = point.topology.name();
        if !topologies.contains(&name) {
            topologies.push(name);
        }
    }
    let panel_width = (44.0 * report.points.len() as f64).max(300.0);
    let width = 2.0 * panel_width + 200.0;
    let height = 640.0;
    let mut out = String::new();
    document_start(&mut out, width, height, "");
    let _ = writeln!(
        out,
        r#"<text x="20" y="26" class="head">switchyard-bench dpd: disaggregated prefill/decode vs colocated (same engine count)</text>"#
    );
    let _ = writeln!(
        out,
        r#"<text x="20" y="44" class="sub">long prompts {} router tokens (threshold {}), {} output tokens, simulated engines, time scale {}; change of DPD against colocated measured in the same run</text>"#,
        report.long_tokens, report.threshold, report.output_tokens, report.time_scale
    );
    let bars = |value: &dyn Fn(&Changes) -> Option<f64>| -> Vec<Bar> {
        report
            .points
            .iter()
            .map(|point| {
                let change = value(&point.change).unwrap_or(0.0);
                let topology = point.topology.name();
                let color_index = topologies
                    .iter()
                    .position(|name| *name == topology)
                    .unwrap_or(0);
                Bar {
                    label: format!("{topology}\n{}", point.load.name.replace(" c=", "\nc=")),
                    value: change,
                    text: format!("{:+.0}%", change * 100.0),
                    color: PALETTE[color_index % PALETTE.len()],
                }
            })
            .collect()
    };
    let panels: [(&str, Vec<Bar>); 4] = [
        ("TPOT p50 (lower is better)", bars(&|c| c.tpot_p50)),
        (
            "Output throughput (higher is better)",
            bars(&|c| c.throughput),
        ),
        ("TTFT p50 (lower is better)", bars(&|c| c.ttft_p50)),
        ("e2e latency p50 (lower is better)", bars(&|c| c.e2e_p50)),
    ];
    for (index, (title, bars)) in panels.iter().enumerate() {
        let x = 70.0 + (index % 2) as f64 * (panel_width + 90.0);
        let y = 90.0 + (index / 2) as f64 * 290.0;
        change_panel(&mut out, (x, y), panel_width, title, bars);
    }
    out.push_str("</svg>\n");
    out
}
