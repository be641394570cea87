//! [`Probe::MissingKey`]: a request without a key is refused where keys
//! are required (`--key-required`); elsewhere it is only reported.

use super::common::Judged;
use crate::client::{Sender, Variant};
use crate::outcome::Verdict;

/// Sends the request without an `Idempotency-Key`.
pub(super) async fn judge(s: &Sender) -> Judged {
    let e = s.send(Variant::default()).await;
    let verdict = match (s.target.key_required, e.status) {
        (true, 400 | 422 | 428) => (Verdict::Pass, format!("refused with {}", e.status)),
        (true, status) => (
            Verdict::Fail,
            format!(
                "a request without a key was answered {status}; with --key-required it must be refused (400)"
            ),
        ),
        (false, status) if (200..300).contains(&status) => (
            Verdict::Pass,
            format!(
                "keys are optional here: answered {status} (pass --key-required if the endpoint must demand one)"
            ),
        ),
        (false, status) => (Verdict::Pass, format!("answered {status} without a key")),
    };
    (verdict.0, verdict.1, vec![e])
}
