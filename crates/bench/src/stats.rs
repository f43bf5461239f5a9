//! Summaries of measured numbers: percentiles within one repetition and the
//! median/min/max "stat" over repetitions that every JSON figure uses.
//!
//! Pure arithmetic; what the numbers mean is up to the workloads.

use serde::{Deserialize, Serialize};

/// One figure over the repetitions: median, min and max.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Stat {
    pub median: f64,
    pub min: f64,
    pub max: f64,
}

impl Stat {
    /// The stat of `values`, or `None` when there are none (or only NaNs).
    pub fn of(values: &[f64]) -> Option<Stat> {
        let mut v: Vec<f64> = values.iter().copied().filter(|x| !x.is_nan()).collect();
        if v.is_empty() {
            return None;
        }
        v.sort_by(f64::total_cmp);
        let n = v.len();
        let median = if n % 2 == 1 {
            v[n / 2]
        } else {
            (v[n / 2 - 1] + v[n / 2]) / 2.0
        };
        Some(Stat {
            median,
            min: v[0],
            max: v[n - 1],
        })
    }
}

/// The `p`-th percentile (0..=100) of `values` by the nearest-rank method,
/// or NaN for no values. Nearest rank keeps p99 of 100 samples equal to the
/// 99th smallest, a value that was actually observed.
pub fn percentile(values: &[f64], p: f64) -> f64 {
    let mut v: Vec<f64> = values.iter().copied().filter(|x| !x.is_nan()).collect();
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    let rank = ((p / 100.0) * v.len() as f64).ceil() as usize;
    v[rank.clamp(1, v.len()) - 1]
}

#[cfg(test)]
mod tests {
    use super::*;

    // Goal: the stat and nearest-rank percentiles match hand-computed values,
    // including even counts, single values and empty input.
    #[test]
    fn stats_and_percentiles() {
        // (input, Some((median, min, max)))
        type Case<'a> = (&'a [f64], Option<(f64, f64, f64)>);
        let cases: &[Case] = &[
            (&[], None),
            (&[5.0], Some((5.0, 5.0, 5.0))),
            (&[3.0, 1.0, 2.0], Some((2.0, 1.0, 3.0))),
            (&[4.0, 1.0, 3.0, 2.0], Some((2.5, 1.0, 4.0))),
        ];
        for (input, want) in cases {
            let got = Stat::of(input).map(|s| (s.median, s.min, s.max));
            assert_eq!(got, *want, "stat of {input:?}");
        }

        let hundred: Vec<f64> = (1..=100).map(f64::from).collect();
        for (p, want) in [(50.0, 50.0), (99.0, 99.0), (100.0, 100.0), (0.0, 1.0)] {
            assert_eq!(percentile(&hundred, p), want, "p{p} of 1..=100");
        }
        assert_eq!(percentile(&[7.0, 3.0], 50.0), 3.0);
        assert!(percentile(&[], 50.0).is_nan());
    }
}
