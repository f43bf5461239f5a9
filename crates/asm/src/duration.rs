//! ISO-8601 durations as NIP-8 writes them in `x-ttl` and
//! `x-retention.window` (`P14D`, `PT1H30M`, `P1Y2M3DT4H5M6S`), turned into
//! whole seconds.
//!
//! Calendar units have no fixed length, so this module fixes them: a year is
//! 365 days and a month is 30 days. A TTL is a retention promise, not a
//! calendar date, and a fixed length keeps expiry identical on every replica
//! whatever its time zone or calendar. Only integer components are
//! accepted; what to do when a duration elapses is left to the caller.

use thiserror::Error;

/// Seconds in one of each designator; years are 365 days, months 30 days.
const MINUTE_SECS: u64 = 60;
const HOUR_SECS: u64 = 60 * MINUTE_SECS;
const DAY_SECS: u64 = 24 * HOUR_SECS;
const WEEK_SECS: u64 = 7 * DAY_SECS;
const MONTH_SECS: u64 = 30 * DAY_SECS;
const YEAR_SECS: u64 = 365 * DAY_SECS;

/// Inputs longer than this are refused before parsing: no valid duration
/// needs more (7 components of 20 digits each, plus designators).
const MAX_INPUT_BYTES: usize = 160;

/// Why a duration was refused.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum DurationError {
    /// The text is not of the form `PnYnMnWnDTnHnMnS`.
    #[error(
        "bad ISO-8601 duration {input:?}: {reason}; write PnYnMnWnDTnHnMnS with whole numbers, e.g. P14D, PT1H30M or P1Y2M3DT4H5M6S"
    )]
    Malformed { input: String, reason: &'static str },
    /// The duration does not fit in 64-bit seconds.
    #[error("ISO-8601 duration {input:?} is too long: it overflows 64-bit seconds")]
    Overflow { input: String },
}

/// Parses an ISO-8601 duration `PnYnMnWnDTnHnMnS` into seconds.
///
/// Components are whole numbers, each designator at most once and in that
/// order; at least one component must be present, and a `T` must be
/// followed by at least one time component. Years count 365 days and months
/// 30 days (see the module doc).
pub fn parse_iso8601_duration(s: &str) -> Result<u64, DurationError> {
    let malformed = |reason| DurationError::Malformed {
        input: truncate(s),
        reason,
    };

    if s.len() > MAX_INPUT_BYTES {
        return Err(malformed("it is too long"));
    }
    let body = match s.strip_prefix('P') {
        Some(body) => body,
        None if s.starts_with('-') || s.starts_with('+') => {
            return Err(malformed("signed durations are not accepted"));
        }
        None if s.starts_with('p') => {
            return Err(malformed("designators must be upper case"));
        }
        None => return Err(malformed("it must start with P")),
    };
    let (date_part, time_part) = match body.split_once('T') {
        Some((date, time)) => (date, Some(time)),
        None => (body, None),
    };

    let mut total: u64 = 0;
    let mut components = 0usize;
    let date_units: [(char, u64); 4] = [
        ('Y', YEAR_SECS),
        ('M', MONTH_SECS),
        ('W', WEEK_SECS),
        ('D', DAY_SECS),
    ];
    let time_units: [(char, u64); 3] = [('H', HOUR_SECS), ('M', MINUTE_SECS), ('S', 1)];

    components +=
        sum_components(date_part, &date_units, &mut total).map_err(|e| e.into_error(s))?;
    if let Some(time) = time_part {
        let n = sum_components(time, &time_units, &mut total).map_err(|e| e.into_error(s))?;
        if n == 0 {
            return Err(malformed("T must be followed by hours, minutes or seconds"));
        }
        components += n;
    }
    if components == 0 {
        return Err(malformed("it has no component"));
    }
    Ok(total)
}

/// A failure inside one part (date or time) before the input is attached.
enum PartError {
    Malformed(&'static str),
    Overflow,
}

impl PartError {
    fn into_error(self, input: &str) -> DurationError {
        match self {
            Self::Malformed(reason) => DurationError::Malformed {
                input: truncate(input),
                reason,
            },
            Self::Overflow => DurationError::Overflow {
                input: truncate(input),
            },
        }
    }
}

/// Adds the components of one part (`nYnMnWnD` or `nHnMnS`) to `total`,
/// enforcing designator order, and returns how many there were.
fn sum_components(part: &str, units: &[(char, u64)], total: &mut u64) -> Result<usize, PartError> {
    let mut next_unit = 0usize;
    let mut count = 0usize;
    let mut number: Option<u64> = None;
    for c in part.chars() {
        if let Some(d) = c.to_digit(10) {
            let n = number
                .unwrap_or(0)
                .checked_mul(10)
                .and_then(|n| n.checked_add(u64::from(d)))
                .ok_or(PartError::Overflow)?;
            number = Some(n);
            continue;
        }
        if c == '.' || c == ',' {
            return Err(PartError::Malformed("fractions are not accepted"));
        }
        if c == 'T' {
            return Err(PartError::Malformed("T appears more than once"));
        }
        if c.is_ascii_lowercase() {
            return Err(PartError::Malformed("designators must be upper case"));
        }
        let Some(offset) = units[next_unit..].iter().position(|(u, _)| *u == c) else {
            return Err(if units.iter().any(|(u, _)| *u == c) {
                PartError::Malformed("designators repeat or are out of order")
            } else {
                PartError::Malformed("it has an unknown designator or character")
            });
        };
        let Some(n) = number.take() else {
            return Err(PartError::Malformed("a designator has no number before it"));
        };
        let unit_secs = units[next_unit + offset].1;
        *total = n
            .checked_mul(unit_secs)
            .and_then(|secs| total.checked_add(secs))
            .ok_or(PartError::Overflow)?;
        next_unit += offset + 1;
        count += 1;
    }
    if number.is_some() {
        return Err(PartError::Malformed("a number has no designator after it"));
    }
    Ok(count)
}

/// Keeps error messages short whatever the input length.
fn truncate(s: &str) -> String {
    const MAX_CHARS: usize = 64;
    if s.chars().count() <= MAX_CHARS {
        s.to_owned()
    } else {
        let mut t: String = s.chars().take(MAX_CHARS).collect();
        t.push('…');
        t
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Goal: every accepted form gives the expected seconds; method: a table
    // of inputs and results checked through one helper.
    #[test]
    fn accepted_durations() {
        let day = 86_400u64;
        let cases: &[(&str, u64)] = &[
            ("P14D", 14 * day),
            ("P90D", 90 * day),
            ("PT1H30M", 5_400),
            (
                "P1Y2M3DT4H5M6S",
                365 * day + 60 * day + 3 * day + 4 * 3_600 + 5 * 60 + 6,
            ),
            ("P2W", 14 * day),
            ("P1W1D", 8 * day),
            ("PT0S", 0),
            ("P0D", 0),
            ("PT36H", 36 * 3_600),
            ("P1M", 30 * day),
            ("P1MT1M", 30 * day + 60),
            ("P007D", 7 * day),
            ("PT18446744073709551615S", u64::MAX),
        ];
        for (input, want) in cases {
            assert_eq!(parse_iso8601_duration(input), Ok(*want), "input {input:?}");
        }
    }

    // Goal: malformed inputs are refused with an error naming the input and
    // the reason; method: a table of inputs and expected reason fragments.
    #[test]
    fn refused_durations() {
        let cases: &[(&str, &str)] = &[
            ("", "must start with P"),
            ("P", "no component"),
            ("PT", "T must be followed"),
            ("P1DT", "T must be followed"),
            ("14D", "must start with P"),
            ("-P1D", "signed"),
            ("P-1D", "unknown designator"),
            ("p14d", "upper case"),
            ("P14d", "upper case"),
            ("PT1.5S", "fractions"),
            ("PT1,5S", "fractions"),
            ("P1.5D", "fractions"),
            ("P1X", "unknown designator"),
            ("P1S", "unknown designator"),
            ("PT1D", "unknown designator"),
            ("P1H", "unknown designator"),
            ("P1D2Y", "out of order"),
            ("P1D1D", "out of order"),
            ("PT1M1H", "out of order"),
            ("P1DT1H1T", "more than once"),
            ("PD", "no number"),
            ("P14", "no designator"),
            ("PT5", "no designator"),
            (" P1D", "must start with P"),
            ("P1D ", "unknown designator"),
            ("P١D", "unknown designator"),
        ];
        for (input, reason) in cases {
            let err = parse_iso8601_duration(input).expect_err(input);
            let msg = err.to_string();
            assert!(
                matches!(err, DurationError::Malformed { .. }),
                "input {input:?}: {msg}"
            );
            assert!(msg.contains(reason), "input {input:?}: {msg}");
            assert!(
                msg.contains(&format!("{input:?}")),
                "input {input:?}: {msg}"
            );
        }
    }

    // Goal: values beyond 64-bit seconds are refused, not wrapped; method:
    // inputs overflowing in the number, the unit product and the sum.
    #[test]
    fn overflow_is_refused() {
        for input in [
            "PT18446744073709551616S",
            "P18446744073709551615D",
            "P584942417356Y",
            "PT18446744073709551615H",
            "P1DT18446744073709551615S",
        ] {
            assert_eq!(
                parse_iso8601_duration(input),
                Err(DurationError::Overflow {
                    input: input.to_owned()
                }),
                "input {input:?}"
            );
        }
        let long = format!("P{}D", "9".repeat(200));
        assert!(matches!(
            parse_iso8601_duration(&long),
            Err(DurationError::Malformed { .. })
        ));
    }
}
