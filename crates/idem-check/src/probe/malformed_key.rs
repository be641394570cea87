//! [`Probe::MalformedKey`]: a key with spaces and an oversized key are
//! both refused (400 or 422), never used.

use super::common::Judged;
use crate::client::{Sender, Variant};
use crate::outcome::{Exchange, Probe, Verdict};

const PROBE: Probe = Probe::MalformedKey;

/// The length of the oversized key: well past the 255 the IETF draft and
/// idem allow, and exactly what the docs say it sends.
const OVERSIZED: usize = 300;

/// Sends one request with a malformed key and one with a key of
/// [`OVERSIZED`] characters (the run's key for the probe, padded).
pub(super) async fn judge(s: &Sender) -> Judged {
    let bad = s
        .send(Variant {
            key: Some("bad key with spaces".to_owned()),
            ..Variant::default()
        })
        .await;
    let long = s
        .send(Variant {
            key: Some(oversized(&s.key(PROBE, 0))),
            ..Variant::default()
        })
        .await;
    let refused = |e: &Exchange| matches!(e.status, 400 | 422);
    let verdict = match (refused(&bad), refused(&long)) {
        (true, true) => (
            Verdict::Pass,
            format!("both refused ({} and {})", bad.status, long.status),
        ),
        (false, _) => (
            Verdict::Fail,
            format!(
                "a key with spaces was answered {}: malformed keys are accepted",
                bad.status
            ),
        ),
        (_, false) => (
            Verdict::Fail,
            format!(
                "a {OVERSIZED}-character key was answered {}: oversized keys are accepted",
                long.status
            ),
        ),
    };
    (verdict.0, verdict.1, vec![bad, long])
}

/// `key-xxx…` cut or padded to exactly [`OVERSIZED`] characters.
fn oversized(key: &str) -> String {
    let mut long: String = format!("{key}-").chars().take(OVERSIZED).collect();
    while long.len() < OVERSIZED {
        long.push('x');
    }
    long
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_oversized_key_is_as_long_as_the_docs_say() {
        assert_eq!(oversized("idem-check-malformed-key-0").len(), OVERSIZED);
        assert!(oversized("k").starts_with("k-x"));
        assert_eq!(oversized(&"k".repeat(400)).len(), OVERSIZED);
    }
}
