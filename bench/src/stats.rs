//! Percentiles and latency summaries.
//!
//! Percentiles use linear interpolation between the two closest ranks (the definition numpy
//! and most load generators use by default, "R-7"): for `n` sorted samples, the q-quantile sits
//! at rank `q × (n − 1)`, between samples `floor` and `ceil` of that rank.

use serde::Serialize;

/// The q-quantile (`q` in 0–1) of `sorted` (ascending), or `None` when there is no sample.
pub fn percentile(sorted: &[f64], q: f64) -> Option<f64> {
    if sorted.is_empty() || !q.is_finite() {
        return None;
    }
    let q = q.clamp(0.0, 1.0);
    let rank = q * (sorted.len() - 1) as f64;
    let below = rank.floor() as usize;
    let above = rank.ceil() as usize;
    let fraction = rank - below as f64;
    Some(sorted[below] + (sorted[above] - sorted[below]) * fraction)
}

/// Count, mean and percentiles of a set of latencies, in milliseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Summary {
    pub count: usize,
    pub mean: f64,
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub min: f64,
    pub max: f64,
}

impl Summary {
    /// Summarises `samples` (any order; NaNs are dropped). All zero when empty.
    pub fn of(samples: &[f64]) -> Self {
        let mut sorted: Vec<f64> = samples.iter().copied().filter(|x| !x.is_nan()).collect();
        if sorted.is_empty() {
            return Self::default();
        }
        sorted.sort_by(f64::total_cmp);
        let at = |q: f64| percentile(&sorted, q).unwrap_or(0.0);
        Self {
            count: sorted.len(),
            mean: sorted.iter().sum::<f64>() / sorted.len() as f64,
            p50: at(0.50),
            p90: at(0.90),
            p99: at(0.99),
            min: sorted[0],
            max: sorted[sorted.len() - 1],
        }
    }

    /// The same summary with every value multiplied by `factor` (wall ms → model ms).
    pub fn scaled(&self, factor: f64) -> Self {
        Self {
            count: self.count,
            mean: self.mean * factor,
            p50: self.p50 * factor,
            p90: self.p90 * factor,
            p99: self.p99 * factor,
            min: self.min * factor,
            max: self.max * factor,
        }
    }
}

/// A latency measured on the wall clock, and the same in model time (wall / time scale) for
/// engines that run on a scaled clock.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Latency {
    pub wall_ms: Summary,
    pub model_ms: Summary,
}

impl Latency {
    pub fn of(wall_ms: &[f64], time_scale: f64) -> Self {
        let wall_ms = Summary::of(wall_ms);
        Self {
            wall_ms,
            model_ms: wall_ms.scaled(1.0 / time_scale),
        }
    }
}

/// `(new − base) / base`, or `None` when the base is zero.
pub fn relative_change(base: f64, new: f64) -> Option<f64> {
    (base != 0.0 && base.is_finite() && new.is_finite()).then(|| (new - base) / base)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_interpolate_between_closest_ranks() {
        let samples: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&samples, 0.0), Some(1.0));
        assert_eq!(percentile(&samples, 1.0), Some(100.0));
        assert!((percentile(&samples, 0.5).unwrap() - 50.5).abs() < 1e-9);
        assert!((percentile(&samples, 0.9).unwrap() - 90.1).abs() < 1e-9);
        assert!((percentile(&samples, 0.99).unwrap() - 99.01).abs() < 1e-9);
        assert_eq!(percentile(&[7.0], 0.99), Some(7.0));
        assert_eq!(percentile(&[], 0.5), None);
        assert_eq!(percentile(&[1.0, 3.0], 0.5), Some(2.0));
        // Out-of-range quantiles clamp.
        assert_eq!(percentile(&[1.0, 3.0], 2.0), Some(3.0));
    }

    #[test]
    fn summary_sorts_and_ignores_nan() {
        let summary = Summary::of(&[5.0, 1.0, f64::NAN, 3.0]);
        assert_eq!(summary.count, 3);
        assert_eq!(summary.min, 1.0);
        assert_eq!(summary.max, 5.0);
        assert_eq!(summary.p50, 3.0);
        assert!((summary.mean - 3.0).abs() < 1e-12);
        assert_eq!(Summary::of(&[]), Summary::default());
    }

    #[test]
    fn model_time_divides_by_the_time_scale() {
        let latency = Latency::of(&[1.0, 2.0, 3.0], 0.25);
        assert_eq!(latency.wall_ms.p50, 2.0);
        assert_eq!(latency.model_ms.p50, 8.0);
        assert_eq!(latency.model_ms.count, 3);
    }

    #[test]
    fn relative_change_needs_a_base() {
        assert_eq!(relative_change(200.0, 50.0), Some(-0.75));
        assert_eq!(relative_change(0.0, 50.0), None);
    }
}
