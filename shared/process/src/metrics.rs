//! A small Prometheus text-format writer and a lock-free histogram, enough for the few metrics
//! each component exposes without pulling in a metrics framework; [`parse`] reads such a page
//! back.

pub mod parse;

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};

/// Builds a Prometheus text exposition (format 0.0.4).
#[derive(Debug, Default)]
pub struct TextEncoder {
    out: String,
}

pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

impl TextEncoder {
    pub fn new() -> Self {
        Self::default()
    }

    /// Writes the `# HELP` and `# TYPE` lines of a metric family.
    pub fn family(&mut self, name: &str, kind: &str, help: &str) -> &mut Self {
        let _ = writeln!(self.out, "# HELP {name} {help}");
        let _ = writeln!(self.out, "# TYPE {name} {kind}");
        self
    }

    pub fn sample(&mut self, name: &str, labels: &[(&str, &str)], value: f64) -> &mut Self {
        self.out.push_str(name);
        write_labels(&mut self.out, labels, None);
        let _ = writeln!(self.out, " {}", format_value(value));
        self
    }

    /// Writes the `_bucket`, `_sum` and `_count` samples of a histogram.
    pub fn histogram(&mut self, name: &str, labels: &[(&str, &str)], histogram: &Histogram) {
        let snapshot = histogram.snapshot();
        let mut cumulative = 0u64;
        for (bound, count) in histogram.bounds.iter().zip(&snapshot.buckets) {
            cumulative += count;
            self.out.push_str(name);
            self.out.push_str("_bucket");
            write_labels(&mut self.out, labels, Some(&format_value(*bound)));
            let _ = writeln!(self.out, " {cumulative}");
        }
        self.out.push_str(name);
        self.out.push_str("_bucket");
        write_labels(&mut self.out, labels, Some("+Inf"));
        let _ = writeln!(self.out, " {}", snapshot.count);
        self.sample(&format!("{name}_sum"), labels, snapshot.sum);
        self.sample(&format!("{name}_count"), labels, snapshot.count as f64);
    }

    pub fn finish(self) -> String {
        self.out
    }
}

fn write_labels(out: &mut String, labels: &[(&str, &str)], le: Option<&str>) {
    if labels.is_empty() && le.is_none() {
        return;
    }
    out.push('{');
    let mut first = true;
    for (key, value) in labels.iter().copied().chain(le.map(|le| ("le", le))) {
        if !first {
            out.push(',');
        }
        first = false;
        out.push_str(key);
        out.push_str("=\"");
        for c in value.chars() {
            match c {
                '\\' => out.push_str("\\\\"),
                '"' => out.push_str("\\\""),
                '\n' => out.push_str("\\n"),
                c => out.push(c),
            }
        }
        out.push('"');
    }
    out.push('}');
}

fn format_value(value: f64) -> String {
    if value.is_infinite() {
        if value > 0.0 {
            "+Inf".into()
        } else {
            "-Inf".into()
        }
    } else {
        format!("{value}")
    }
}

/// A fixed-bucket histogram updated with atomics (no lock on the hot path).
#[derive(Debug)]
pub struct Histogram {
    bounds: Vec<f64>,
    buckets: Vec<AtomicU64>,
    count: AtomicU64,
    /// Sum in micro-units, so it fits an atomic integer.
    sum_micros: AtomicU64,
}

#[derive(Debug, Clone)]
pub struct HistogramSnapshot {
    pub buckets: Vec<u64>,
    pub count: u64,
    pub sum: f64,
}

impl Histogram {
    /// `bounds` are the upper bounds of the buckets, ascending.
    pub fn new(bounds: &[f64]) -> Self {
        Self {
            bounds: bounds.to_vec(),
            buckets: bounds.iter().map(|_| AtomicU64::new(0)).collect(),
            count: AtomicU64::new(0),
            sum_micros: AtomicU64::new(0),
        }
    }

    pub fn observe(&self, value: f64) {
        if let Some(index) = self.bounds.iter().position(|bound| value <= *bound) {
            self.buckets[index].fetch_add(1, Ordering::Relaxed);
        }
        self.count.fetch_add(1, Ordering::Relaxed);
        let micros = (value.max(0.0) * 1e6) as u64;
        self.sum_micros.fetch_add(micros, Ordering::Relaxed);
    }

    pub fn snapshot(&self) -> HistogramSnapshot {
        HistogramSnapshot {
            buckets: self
                .buckets
                .iter()
                .map(|bucket| bucket.load(Ordering::Relaxed))
                .collect(),
            count: self.count.load(Ordering::Relaxed),
            sum: self.sum_micros.load(Ordering::Relaxed) as f64 / 1e6,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_prometheus_text() {
        let histogram = Histogram::new(&[0.1, 1.0]);
        histogram.observe(0.05);
        histogram.observe(0.5);
        histogram.observe(5.0);
        let mut encoder = TextEncoder::new();
        encoder
            .family("x_total", "counter", "things")
            .sample("x_total", &[("a", "q\"")], 3.0);
        encoder.family("lat", "histogram", "latency");
        encoder.histogram("lat", &[("m", "sim")], &histogram);
        let text = encoder.finish();
        assert!(text.contains("x_total{a=\"q\\\"\"} 3\n"), "{text}");
        assert!(
            text.contains("lat_bucket{m=\"sim\",le=\"0.1\"} 1\n"),
            "{text}"
        );
        assert!(
            text.contains("lat_bucket{m=\"sim\",le=\"1\"} 2\n"),
            "{text}"
        );
        assert!(
            text.contains("lat_bucket{m=\"sim\",le=\"+Inf\"} 3\n"),
            "{text}"
        );
        assert!(text.contains("lat_count{m=\"sim\"} 3\n"), "{text}");
    }
}
