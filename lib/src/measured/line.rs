//! A straight line through measured (batch, bytes) points.

use serde::Serialize;

/// `bytes = fixed + per_sample * batch`, fitted by least squares.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Line {
    pub fixed: f64,
    pub per_sample: f64,
}

impl Line {
    /// The least-squares line through `points`; a flat one through a single point.
    pub fn least_squares(points: &[(f64, f64)]) -> Line {
        let n = points.len() as f64;
        if points.is_empty() {
            return Line { fixed: 0.0, per_sample: 0.0 };
        }
        let mean_x = points.iter().map(|p| p.0).sum::<f64>() / n;
        let mean_y = points.iter().map(|p| p.1).sum::<f64>() / n;
        let spread: f64 = points.iter().map(|p| (p.0 - mean_x).powi(2)).sum();
        if spread == 0.0 {
            return Line { fixed: mean_y, per_sample: 0.0 };
        }
        let per_sample = points.iter().map(|p| (p.0 - mean_x) * (p.1 - mean_y)).sum::<f64>() / spread;
        Line { fixed: mean_y - per_sample * mean_x, per_sample }
    }

    /// Bytes at `batch`, never below zero (saturating at `u64::MAX` for an absurd batch).
    pub fn at(&self, batch: usize) -> u64 {
        (self.fixed + self.per_sample * batch as f64).round().max(0.0) as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fits_a_line_exactly_and_clamps_below_zero() {
        let line = Line::least_squares(&[(2.0, 110.0), (4.0, 210.0), (8.0, 410.0)]);
        assert!((line.per_sample - 50.0).abs() < 1e-9 && (line.fixed - 10.0).abs() < 1e-9, "{line:?}");
        assert_eq!(line.at(32), 1610);
        assert_eq!(Line::least_squares(&[(2.0, 10.0), (4.0, 5.0)]).at(100), 0);
        assert_eq!(Line::least_squares(&[(2.0, 7.0)]).at(64), 7);
        assert_eq!(Line { fixed: 0.0, per_sample: 1e30 }.at(usize::MAX), u64::MAX);
    }
}
