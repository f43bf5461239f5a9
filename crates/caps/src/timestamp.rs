//! RFC 3339 timestamps as capabilities write them: UTC, whole seconds,
//! `YYYY-MM-DDTHH:MM:SSZ`, one spelling per instant.
//!
//! Parsing accepts exactly the strings [`format`] writes, so that a signed
//! timestamp cannot be respelled (`+00:00`, `.000`, lowercase `z`).

use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;

/// Length of `YYYY-MM-DDTHH:MM:SSZ`.
const LEN: usize = 20;

/// `2026-12-01T00:00:00Z` for a unix time, if its year has four digits.
pub(crate) fn format(unix_secs: i64) -> Option<String> {
    let at = OffsetDateTime::from_unix_timestamp(unix_secs).ok()?;
    let text = at.format(&Rfc3339).ok()?;
    (text.len() == LEN).then_some(text)
}

/// The unix time of a timestamp written as [`format`] writes it.
pub(crate) fn parse(text: &str) -> Option<i64> {
    if text.len() != LEN {
        return None;
    }
    let at = OffsetDateTime::parse(text, &Rfc3339).ok()?;
    let unix_secs = at.unix_timestamp();
    (format(unix_secs).as_deref() == Some(text)).then_some(unix_secs)
}

/// A timestamp for messages: RFC 3339 when it has one, else the number.
pub(crate) fn display(unix_secs: i64) -> String {
    format(unix_secs).unwrap_or_else(|| format!("{unix_secs} (unix seconds)"))
}

#[cfg(test)]
mod tests {
    use super::*;

    // Goal: the canonical spelling round-trips and every other spelling of an instant is refused.
    #[test]
    fn one_spelling_per_instant() {
        assert_eq!(format(0).as_deref(), Some("1970-01-01T00:00:00Z"));
        assert_eq!(parse("2026-12-01T00:00:00Z"), Some(1_796_083_200));
        assert_eq!(
            format(1_796_083_200).as_deref(),
            Some("2026-12-01T00:00:00Z")
        );
        for bad in [
            "2026-12-01T00:00:00+00:00",
            "2026-12-01T00:00:00.000Z",
            "2026-12-01t00:00:00z",
            "2026-12-01 00:00:00Z",
            "2026-12-01T00:00:60Z",
            "2026-02-30T00:00:00Z",
            "2026-12-01T00:00:00",
            "",
            "+12026-12-01T00:00:00Z",
        ] {
            assert_eq!(parse(bad), None, "{bad:?} accepted");
        }
        // Years beyond four digits have no RFC 3339 spelling.
        assert_eq!(format(i64::MAX), None);
        assert_eq!(format(253_402_300_800), None);
        assert_eq!(
            format(253_402_300_799).as_deref(),
            Some("9999-12-31T23:59:59Z")
        );
    }
}
