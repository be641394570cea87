//! [`Probe::Reuse`]: the key reused with a changed field (`--vary-field`)
//! is refused (400, 409 or 422), neither executed nor silently answered
//! with the first request's answer.

use super::common::{Judged, failed_baseline, keyed, same_answer, vary};
use crate::client::{Sender, Variant};
use crate::outcome::{Probe, Verdict};

const PROBE: Probe = Probe::Reuse;

/// Sends the keyed request, then the same key with the field changed;
/// skipped without `--vary-field`.
pub(super) async fn judge(s: &Sender) -> Judged {
    let Some(field) = &s.target.vary_field else {
        return (
            Verdict::Skip,
            "needs --vary-field FIELD (a top-level JSON field to change)".to_owned(),
            Vec::new(),
        );
    };
    let first = s.send(keyed(s, PROBE, 0)).await;
    if !first.success() {
        return failed_baseline(vec![first]);
    }
    let varied = vary(&s.target.body, field);
    let second = s
        .send(Variant {
            body: Some(varied),
            ..keyed(s, PROBE, 0)
        })
        .await;
    let verdict = if matches!(second.status, 400 | 409 | 422) {
        (
            Verdict::Pass,
            format!("the changed request was refused with {}", second.status),
        )
    } else if same_answer(&first, &second) {
        (
            Verdict::Fail,
            "the changed request silently got the first request's answer: a client changing its request would never learn it was not applied".to_owned(),
        )
    } else {
        (
            Verdict::Fail,
            format!(
                "the changed request was answered {} and may have been executed",
                second.status
            ),
        )
    };
    (verdict.0, verdict.1, vec![first, second])
}
