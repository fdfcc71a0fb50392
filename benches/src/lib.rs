//! Benchmark helpers: latency recording and percentiles.

use std::time::Duration;

/// Latencies of one run.
#[derive(Debug, Default, Clone)]
pub struct Latencies(Vec<Duration>);

impl Latencies {
    /// Records one sample.
    pub fn push(&mut self, d: Duration) {
        self.0.push(d);
    }

    /// Merges another run's samples.
    pub fn extend(&mut self, other: Latencies) {
        self.0.extend(other.0);
    }

    /// Number of samples.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether there are no samples.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The `q` quantile (0.0..=1.0) in microseconds, nearest-rank.
    pub fn quantile_us(&mut self, q: f64) -> f64 {
        if self.0.is_empty() {
            return 0.0;
        }
        self.0.sort_unstable();
        let n = self.0.len();
        #[allow(
            clippy::cast_precision_loss,
            clippy::cast_possible_truncation,
            clippy::cast_sign_loss
        )]
        let rank = ((q * n as f64).ceil() as usize).clamp(1, n);
        self.0[rank - 1].as_secs_f64() * 1e6
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_quantiles() {
        let mut l = Latencies::default();
        for us in 1..=100 {
            l.push(Duration::from_micros(us));
        }
        assert!((l.quantile_us(0.5) - 50.0).abs() < 1e-9);
        assert!((l.quantile_us(0.99) - 99.0).abs() < 1e-9);
        assert!((l.quantile_us(1.0) - 100.0).abs() < 1e-9);
    }
}
