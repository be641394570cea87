//! The clock check: DynamoDB has no clock a condition can read, so the
//! store keeps time by this process' clock, bounded by the endpoint's
//! `Date` header.
//!
//! An answer's `Date` says the endpoint's time, truncated to the second,
//! at some moment between sending the request and reading the answer.
//! From the local times of those two moments, the skew it proves is the
//! distance from zero to the interval of offsets that fit:
//!
//! ```text
//! offset = endpoint − local ∈ (Date − received, Date + 1 s − sent)
//! ```
//!
//! A slow round trip widens the interval and so only ever proves less
//! skew: the check never refuses a clock that may be right.

use std::sync::{Arc, Mutex, PoisonError};

use aws_sdk_dynamodb::config::interceptors::BeforeDeserializationInterceptorContextRef;
use aws_sdk_dynamodb::config::{ConfigBag, Intercept, RuntimeComponents};
use aws_sdk_dynamodb::error::BoxError;
use aws_sdk_dynamodb::primitives::{DateTime, DateTimeFormat};
use idem::Timestamp;

/// The `Date` header's resolution.
const DATE_RESOLUTION_MS: i64 = 1_000;

/// The least skew an answer proves, in milliseconds: positive when the
/// local clock is behind the endpoint's, negative when ahead, zero when a
/// right clock could have seen this `Date`.
///
/// `date` is the header's time; `sent` and `received` the local clock
/// before the request and after the answer.
pub(crate) fn proven_skew_ms(date: Timestamp, sent: Timestamp, received: Timestamp) -> i64 {
    let date = date.as_millis();
    let lowest = date.saturating_sub(received.as_millis());
    let highest = date
        .saturating_add(DATE_RESOLUTION_MS)
        .saturating_sub(sent.as_millis());
    if lowest > 0 {
        lowest
    } else if highest < 0 {
        highest
    } else {
        0
    }
}

/// Parses an HTTP `Date` (RFC 7231 IMF-fixdate) into a time.
pub(crate) fn parse_http_date(value: &str) -> Option<Timestamp> {
    let parsed = DateTime::from_str(value.trim(), DateTimeFormat::HttpDate).ok()?;
    parsed.to_millis().ok().map(Timestamp::from_millis)
}

/// Keeps the `Date` header of the answer to the request it is attached
/// to (the last one, when the SDK retried).
#[derive(Debug, Clone, Default)]
pub(crate) struct DateProbe {
    seen: Arc<Mutex<Option<String>>>,
}

impl DateProbe {
    /// The `Date` header seen, if any.
    pub(crate) fn date(&self) -> Option<String> {
        self.seen
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

impl Intercept for DateProbe {
    fn name(&self) -> &'static str {
        "idem-dynamodb-date-probe"
    }

    fn read_before_deserialization(
        &self,
        context: &BeforeDeserializationInterceptorContextRef<'_>,
        _runtime_components: &RuntimeComponents,
        _cfg: &mut ConfigBag,
    ) -> Result<(), BoxError> {
        let date = context.response().headers().get("date").map(str::to_owned);
        *self.seen.lock().unwrap_or_else(PoisonError::into_inner) = date;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(ms: i64) -> Timestamp {
        Timestamp::from_millis(ms)
    }

    #[test]
    fn a_right_clock_proves_no_skew() {
        // The endpoint stamped 10.000 s (meaning 10.000 to 10.999) while
        // the local clock went from 10.200 to 10.300.
        assert_eq!(proven_skew_ms(t(10_000), t(10_200), t(10_300)), 0);
        // Stamped at the very end of the second.
        assert_eq!(proven_skew_ms(t(10_000), t(10_900), t(10_999)), 0);
    }

    #[test]
    fn skew_is_proven_both_ways() {
        // The endpoint says 15 s while the local clock read 10.2–10.3 s:
        // the local clock is at least 4.7 s behind.
        assert_eq!(proven_skew_ms(t(15_000), t(10_200), t(10_300)), 4_700);
        // The endpoint says 5 s (before 6 s): more than 4.2 s ahead.
        assert_eq!(proven_skew_ms(t(5_000), t(10_200), t(10_300)), -4_200);
    }

    #[test]
    fn a_slow_round_trip_proves_less() {
        let quick = proven_skew_ms(t(15_000), t(10_200), t(10_300));
        let slow = proven_skew_ms(t(15_000), t(10_200), t(13_000));
        assert!(slow < quick, "{slow} < {quick}");
        assert_eq!(slow, 2_000);
    }

    #[test]
    fn http_dates_parse() {
        assert_eq!(
            parse_http_date("Sun, 06 Nov 1994 08:49:37 GMT"),
            Some(t(784_111_777_000))
        );
        assert_eq!(parse_http_date("yesterday"), None);
    }
}
