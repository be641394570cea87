//! [`Probe::MalformedKey`]: a key with spaces and an oversized key are
//! both refused (400 or 422), never used.

use super::common::Judged;
use crate::client::{Sender, Variant};
use crate::outcome::{Exchange, Probe, Verdict};

const PROBE: Probe = Probe::MalformedKey;

/// Sends one request with a malformed key and one with a key of over 300
/// characters.
pub(super) async fn judge(s: &Sender) -> Judged {
    let bad = s
        .send(Variant {
            key: Some("bad key with spaces".to_owned()),
            ..Variant::default()
        })
        .await;
    let long = s
        .send(Variant {
            key: Some(format!("{}-{}", s.key(PROBE, 0), "x".repeat(300))),
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
                "a {}-character key was answered {}: oversized keys are accepted",
                300 + s.key(PROBE, 0).len() + 1,
                long.status
            ),
        ),
    };
    (verdict.0, verdict.1, vec![bad, long])
}
