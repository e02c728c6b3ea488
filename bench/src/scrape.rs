//! Reading Prometheus text: the engines' vLLM counters (prefix-cache queries and hits) and the
//! routers' decision-time histogram.

use serde::Serialize;

use crate::client::HttpClient;

pub use switchyard_process::metrics::parse::Sample;
use switchyard_process::metrics::parse::{parse_sample, sample_lines};

/// Parses the Prometheus text format (comments and unparsable lines are skipped).
pub fn parse(text: &str) -> Vec<Sample> {
    sample_lines(text)
        .filter_map(|line| parse_sample(line).ok())
        .collect()
}

/// The sum of `name` over every label set.
pub fn total(samples: &[Sample], name: &str) -> f64 {
    samples
        .iter()
        .filter(|sample| sample.name == name)
        .map(|sample| sample.value)
        .sum()
}

/// An engine's vLLM counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct EngineCounters {
    /// `vllm:prefix_cache_queries_total` (tokens).
    pub prefix_cache_queries: f64,
    /// `vllm:prefix_cache_hits_total` (tokens).
    pub prefix_cache_hits: f64,
    pub prompt_tokens: f64,
    pub generation_tokens: f64,
    pub requests_success: f64,
}

impl EngineCounters {
    pub fn from_samples(samples: &[Sample]) -> Self {
        Self {
            prefix_cache_queries: total(samples, "vllm:prefix_cache_queries_total"),
            prefix_cache_hits: total(samples, "vllm:prefix_cache_hits_total"),
            prompt_tokens: total(samples, "vllm:prompt_tokens_total"),
            generation_tokens: total(samples, "vllm:generation_tokens_total"),
            requests_success: total(samples, "vllm:request_success_total"),
        }
    }

    /// What happened between `before` and `self`.
    pub fn since(&self, before: &Self) -> Self {
        Self {
            prefix_cache_queries: self.prefix_cache_queries - before.prefix_cache_queries,
            prefix_cache_hits: self.prefix_cache_hits - before.prefix_cache_hits,
            prompt_tokens: self.prompt_tokens - before.prompt_tokens,
            generation_tokens: self.generation_tokens - before.generation_tokens,
            requests_success: self.requests_success - before.requests_success,
        }
    }

    pub fn add(&mut self, other: &Self) {
        self.prefix_cache_queries += other.prefix_cache_queries;
        self.prefix_cache_hits += other.prefix_cache_hits;
        self.prompt_tokens += other.prompt_tokens;
        self.generation_tokens += other.generation_tokens;
        self.requests_success += other.requests_success;
    }

    /// Hits / queries, in tokens (0 before any query).
    pub fn hit_rate(&self) -> f64 {
        if self.prefix_cache_queries > 0.0 {
            self.prefix_cache_hits / self.prefix_cache_queries
        } else {
            0.0
        }
    }
}

/// A cumulative histogram summed over label sets: (upper bound, cumulative count), sum, count.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Histogram {
    pub buckets: Vec<(f64, f64)>,
    pub sum: f64,
    pub count: f64,
}

impl Histogram {
    pub fn from_samples(samples: &[Sample], name: &str) -> Option<Self> {
        let bucket_name = format!("{name}_bucket");
        let mut buckets: Vec<(f64, f64)> = Vec::new();
        for sample in samples.iter().filter(|sample| sample.name == bucket_name) {
            let Some(le) = sample.label("le") else {
                continue;
            };
            let bound = if le == "+Inf" {
                f64::INFINITY
            } else {
                match le.parse() {
                    Ok(bound) => bound,
                    Err(_) => continue,
                }
            };
            match buckets.iter_mut().find(|(existing, _)| *existing == bound) {
                Some((_, count)) => *count += sample.value,
                None => buckets.push((bound, sample.value)),
            }
        }
        if buckets.is_empty() {
            return None;
        }
        buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
        Some(Self {
            buckets,
            sum: total(samples, &format!("{name}_sum")),
            count: total(samples, &format!("{name}_count")),
        })
    }

    /// The observations between `before` and `self`.
    pub fn since(&self, before: &Self) -> Self {
        let buckets = self
            .buckets
            .iter()
            .map(|(bound, count)| {
                let earlier = before
                    .buckets
                    .iter()
                    .find(|(other, _)| other == bound)
                    .map_or(0.0, |(_, count)| *count);
                (*bound, count - earlier)
            })
            .collect();
        Self {
            buckets,
            sum: self.sum - before.sum,
            count: self.count - before.count,
        }
    }

    pub fn add(&mut self, other: &Self) {
        if self.buckets.is_empty() {
            *self = other.clone();
            return;
        }
        for (bound, count) in &mut self.buckets {
            if let Some((_, more)) = other.buckets.iter().find(|(other, _)| other == bound) {
                *count += more;
            }
        }
        self.sum += other.sum;
        self.count += other.count;
    }

    pub fn mean(&self) -> Option<f64> {
        (self.count > 0.0).then(|| self.sum / self.count)
    }

    /// The q-quantile estimated as Prometheus' `histogram_quantile` does: linear within the
    /// bucket it falls in (the lowest bucket starts at 0; the +Inf bucket answers its lower
    /// bound).
    pub fn quantile(&self, q: f64) -> Option<f64> {
        let total = self.buckets.last()?.1;
        if total <= 0.0 {
            return None;
        }
        let rank = q.clamp(0.0, 1.0) * total;
        let mut lower_bound = 0.0;
        let mut lower_count = 0.0;
        for &(bound, count) in &self.buckets {
            if count >= rank {
                if bound.is_infinite() {
                    return Some(lower_bound);
                }
                let width = count - lower_count;
                let fraction = if width > 0.0 {
                    (rank - lower_count) / width
                } else {
                    1.0
                };
                return Some(lower_bound + (bound - lower_bound) * fraction);
            }
            lower_bound = bound;
            lower_count = count;
        }
        Some(lower_bound)
    }
}

/// GETs a `/metrics` page and parses it.
pub async fn scrape(client: &HttpClient, url: &str) -> anyhow::Result<Vec<Sample>> {
    Ok(parse(&get_text(client, url).await?))
}

pub use switchyard_cluster::http::get_text;

/// `base` + `/metrics` unless it already names a path.
pub fn metrics_url(base: &str) -> String {
    let trimmed = base.trim_end_matches('/');
    let after_scheme = trimmed.split_once("://").map_or(trimmed, |(_, rest)| rest);
    if after_scheme.contains('/') {
        trimmed.to_owned()
    } else {
        format!("{trimmed}/metrics")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ENGINE: &str = r#"# HELP vllm:prefix_cache_hits_total Prefix cache hits, in tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{model_name="sim"} 1600
vllm:prefix_cache_queries_total{model_name="sim",engine="0"} 2000
vllm:prefix_cache_queries_total{model_name="sim",engine="1"} 1000
vllm:request_success_total{model_name="sim",finished_reason="length"} 3
weird{label="a \"quoted\" } value"} 5 1700000000000
"#;

    #[test]
    fn parses_samples_and_sums_counters() {
        let samples = parse(ENGINE);
        assert_eq!(samples.len(), 5);
        assert_eq!(samples[4].label("label"), Some("a \"quoted\" } value"));
        assert_eq!(samples[4].value, 5.0);
        let counters = EngineCounters::from_samples(&samples);
        assert_eq!(counters.prefix_cache_queries, 3000.0);
        assert_eq!(counters.prefix_cache_hits, 1600.0);
        assert!((counters.hit_rate() - 1600.0 / 3000.0).abs() < 1e-12);
        let zero = EngineCounters::default();
        assert_eq!(counters.since(&zero), counters);
        assert_eq!(zero.hit_rate(), 0.0);
    }

    #[test]
    fn histogram_quantiles_interpolate_within_buckets() {
        let text = r#"
d_bucket{le="0.001"} 0
d_bucket{le="0.002"} 50
d_bucket{le="0.004"} 100
d_bucket{le="+Inf"} 100
d_sum 0.2
d_count 100
"#;
        let histogram = Histogram::from_samples(&parse(text), "d").unwrap();
        assert!((histogram.quantile(0.5).unwrap() - 0.002).abs() < 1e-12);
        assert!((histogram.quantile(0.25).unwrap() - 0.0015).abs() < 1e-12);
        assert!((histogram.quantile(0.99).unwrap() - 0.00396).abs() < 1e-9);
        assert!((histogram.mean().unwrap() - 0.002).abs() < 1e-12);
        let before = histogram.clone();
        let mut doubled = histogram.clone();
        doubled.add(&before);
        assert_eq!(doubled.count, 200.0);
        assert_eq!(doubled.since(&before), before);
        assert_eq!(Histogram::from_samples(&parse(text), "missing"), None);
    }

    #[test]
    fn metrics_url_appends_the_path_once() {
        assert_eq!(metrics_url("http://h:1"), "http://h:1/metrics");
        assert_eq!(metrics_url("http://h:1/"), "http://h:1/metrics");
        assert_eq!(metrics_url("http://h:1/metrics"), "http://h:1/metrics");
    }
}
