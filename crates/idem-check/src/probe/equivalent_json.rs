//! [`Probe::EquivalentJson`]: the same JSON written differently (object
//! keys reordered, other white space) is the same request, so it gets the
//! first answer.

use serde_json::Value;

use super::common::{Judged, failed_baseline, keyed, reformat, same_answer};
use crate::client::{Sender, Variant};
use crate::outcome::{Probe, Verdict};

const PROBE: Probe = Probe::EquivalentJson;

/// Sends the keyed request, then the same key with the body reformatted;
/// skipped when the body is not JSON.
pub(super) async fn judge(s: &Sender) -> Judged {
    let Ok(json) = serde_json::from_slice::<Value>(&s.target.body) else {
        return (Verdict::Skip, "the body is not JSON".to_owned(), Vec::new());
    };
    let first = s.send(keyed(s, PROBE, 0)).await;
    if !first.success() {
        return failed_baseline(vec![first]);
    }
    let second = s
        .send(Variant {
            body: Some(reformat(&json)),
            label: "reordered".into(),
            ..keyed(s, PROBE, 0)
        })
        .await;
    let verdict = if same_answer(&first, &second) {
        (
            Verdict::Pass,
            "the reordered, re-spaced JSON got the first answer".to_owned(),
        )
    } else if matches!(second.status, 400 | 409 | 422) {
        (
            Verdict::Fail,
            format!(
                "the same JSON written differently was refused with {} as a different request",
                second.status
            ),
        )
    } else if second.status == first.status {
        (
            Verdict::Fail,
            format!(
                "the same JSON written differently got the same status ({}) with another body: it was run again instead of replayed",
                first.status
            ),
        )
    } else {
        (
            Verdict::Fail,
            format!(
                "the same JSON written differently got another answer ({} where the first got {})",
                second.status, first.status
            ),
        )
    };
    (verdict.0, verdict.1, vec![first, second])
}
