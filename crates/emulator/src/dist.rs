//! Service-time distributions and the duration syntax used on the command line.
//!
//! Durations are a non-negative number followed by a unit: `us`, `ms` or `s`
//! (`250us`, `5ms`, `1.5s`); a bare `0` is also accepted. A service-time
//! distribution is one of `fixed:D`, `exp:MEAN` or `lognormal:MEAN:SIGMA`.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

/// Longest service time a sample may produce; keeps heavy tails bounded.
const MAX_SAMPLE: Duration = Duration::from_secs(3600);

/// Error returned when a duration or a distribution does not parse.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParseError(String);

impl ParseError {
    fn new(msg: impl Into<String>) -> Self {
        Self(msg.into())
    }
}

impl fmt::Display for ParseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for ParseError {}

/// Parses a duration such as `250us`, `5ms`, `1.5s` or `0`.
pub fn parse_duration(text: &str) -> Result<Duration, ParseError> {
    let text = text.trim();
    if text == "0" {
        return Ok(Duration::ZERO);
    }
    let (number, scale) =
        split_unit(text).ok_or_else(|| ParseError::new(format!("duration `{text}` needs a unit: us, ms or s")))?;
    let value: f64 = number.parse().map_err(|_| ParseError::new(format!("duration `{text}` has no valid number")))?;
    if !value.is_finite() || value < 0.0 {
        return Err(ParseError::new(format!("duration `{text}` must be finite and >= 0")));
    }
    Duration::try_from_secs_f64(value * scale)
        .map_err(|_| ParseError::new(format!("duration `{text}` is out of range")))
}

/// Splits `text` into its number and the unit's scale in seconds.
fn split_unit(text: &str) -> Option<(&str, f64)> {
    if let Some(number) = text.strip_suffix("us") {
        Some((number, 1e-6))
    } else if let Some(number) = text.strip_suffix("ms") {
        Some((number, 1e-3))
    } else {
        text.strip_suffix('s').map(|number| (number, 1.0))
    }
}

/// How long a request holds its service slot.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ServiceTime {
    /// Always the same duration.
    Fixed(Duration),
    /// Exponentially distributed with the given mean.
    Exp {
        /// Mean service time.
        mean: Duration,
    },
    /// Log-normally distributed with the given mean and shape `sigma`.
    LogNormal {
        /// Mean service time (not the median).
        mean: Duration,
        /// Standard deviation of the underlying normal distribution.
        sigma: f64,
    },
}

impl Default for ServiceTime {
    fn default() -> Self {
        Self::Fixed(Duration::ZERO)
    }
}

impl FromStr for ServiceTime {
    type Err = ParseError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let parts: Vec<&str> = text.trim().split(':').collect();
        match parts.as_slice() {
            ["fixed", d] => Ok(Self::Fixed(parse_duration(d)?)),
            ["exp", d] => Ok(Self::Exp { mean: parse_duration(d)? }),
            ["lognormal", d, sigma] => Ok(Self::LogNormal { mean: parse_duration(d)?, sigma: parse_sigma(sigma)? }),
            _ => Err(ParseError::new(format!(
                "service time `{text}`: expected fixed:D, exp:MEAN or lognormal:MEAN:SIGMA"
            ))),
        }
    }
}

fn parse_sigma(text: &str) -> Result<f64, ParseError> {
    match text.trim().parse::<f64>() {
        Ok(sigma) if sigma.is_finite() && sigma >= 0.0 => Ok(sigma),
        _ => Err(ParseError::new(format!("sigma `{text}` must be a finite number >= 0"))),
    }
}

impl ServiceTime {
    /// Draws one service time.
    pub fn sample(&self, rng: &mut fastrand::Rng) -> Duration {
        match *self {
            Self::Fixed(d) => d,
            Self::Exp { mean } => {
                // 1 - u lies in (0, 1], so the logarithm is finite.
                let u = 1.0 - rng.f64();
                seconds(-mean.as_secs_f64() * u.ln())
            }
            Self::LogNormal { mean, sigma } => {
                if mean.is_zero() {
                    return Duration::ZERO;
                }
                let mu = mean.as_secs_f64().ln() - sigma * sigma / 2.0;
                seconds((mu + sigma * standard_normal(rng)).exp())
            }
        }
    }
}

/// One standard normal variate (Box-Muller).
fn standard_normal(rng: &mut fastrand::Rng) -> f64 {
    let u1 = 1.0 - rng.f64();
    let u2 = rng.f64();
    (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
}

/// Converts seconds to a duration, clamped to `0..=MAX_SAMPLE`.
fn seconds(secs: f64) -> Duration {
    Duration::try_from_secs_f64(secs).unwrap_or(Duration::ZERO).min(MAX_SAMPLE)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_parse_with_units() {
        assert_eq!(parse_duration("250us"), Ok(Duration::from_micros(250)));
        assert_eq!(parse_duration("5ms"), Ok(Duration::from_millis(5)));
        assert_eq!(parse_duration("2s"), Ok(Duration::from_secs(2)));
        assert_eq!(parse_duration("1.5s"), Ok(Duration::from_millis(1500)));
        assert_eq!(parse_duration("0"), Ok(Duration::ZERO));
        assert_eq!(parse_duration("0ms"), Ok(Duration::ZERO));
    }

    #[test]
    fn bad_durations_are_rejected() {
        for bad in ["", "5", "ms", "-1ms", "5m", "infs", "NaNms", "1e400s", "5 min"] {
            assert!(parse_duration(bad).is_err(), "{bad} should not parse");
        }
    }

    #[test]
    fn distributions_parse() {
        assert_eq!("fixed:5ms".parse(), Ok(ServiceTime::Fixed(Duration::from_millis(5))));
        assert_eq!("exp:2ms".parse(), Ok(ServiceTime::Exp { mean: Duration::from_millis(2) }));
        assert_eq!(
            "lognormal:5ms:0.5".parse(),
            Ok(ServiceTime::LogNormal { mean: Duration::from_millis(5), sigma: 0.5 })
        );
        assert_eq!(ServiceTime::default(), ServiceTime::Fixed(Duration::ZERO));
    }

    #[test]
    fn bad_distributions_are_rejected() {
        for bad in
            ["", "fixed", "fixed:", "exp:5ms:1", "lognormal:5ms", "lognormal:5ms:-1", "lognormal:5ms:x", "uniform:5ms"]
        {
            assert!(bad.parse::<ServiceTime>().is_err(), "{bad} should not parse");
        }
    }

    fn mean_of(dist: ServiceTime, n: u32) -> f64 {
        let mut rng = fastrand::Rng::with_seed(7);
        let total: f64 = (0..n).map(|_| dist.sample(&mut rng).as_secs_f64()).sum();
        total / f64::from(n)
    }

    #[test]
    fn samples_have_the_requested_mean() {
        let fixed = ServiceTime::Fixed(Duration::from_millis(3));
        assert!((mean_of(fixed, 10) - 0.003).abs() < 1e-12);
        let exp = ServiceTime::Exp { mean: Duration::from_millis(10) };
        assert!((mean_of(exp, 50_000) / 0.010 - 1.0).abs() < 0.03);
        let logn = ServiceTime::LogNormal { mean: Duration::from_millis(10), sigma: 0.5 };
        assert!((mean_of(logn, 50_000) / 0.010 - 1.0).abs() < 0.03);
    }

    #[test]
    fn zero_means_sample_zero() {
        let mut rng = fastrand::Rng::with_seed(1);
        for dist in
            [ServiceTime::Exp { mean: Duration::ZERO }, ServiceTime::LogNormal { mean: Duration::ZERO, sigma: 1.0 }]
        {
            assert_eq!(dist.sample(&mut rng), Duration::ZERO);
        }
    }
}
