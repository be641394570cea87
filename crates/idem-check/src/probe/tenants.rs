//! [`Probe::Tenants`]: the same key under two credentials (`--auth2`)
//! makes two independent requests; a replay across credentials leaks one
//! tenant's answer to another.

use super::common::{Judged, failed_baseline, keyed, same_answer};
use crate::client::{Sender, Variant};
use crate::outcome::{Probe, Verdict};

const PROBE: Probe = Probe::Tenants;

/// Sends the keyed request, then the same key as the second credential;
/// skipped without `--auth2`.
pub(super) async fn judge(s: &Sender) -> Judged {
    let Some(second) = s.target.second_auth.clone() else {
        return (
            Verdict::Skip,
            "needs --auth2 (a second credential)".to_owned(),
            Vec::new(),
        );
    };
    let a = s.send(keyed(s, PROBE, 0)).await;
    if !a.success() {
        return failed_baseline(vec![a]);
    }
    let b = s
        .send(Variant {
            auth: Some(second),
            label: "as the second credential".into(),
            ..keyed(s, PROBE, 0)
        })
        .await;
    let (ra, rb) = (s.resource(&a), s.resource(&b));
    let verdict = if !a.success() || !b.success() {
        (
            Verdict::Fail,
            format!(
                "not both succeeded ({} and {}): one tenant's key blocked the other's",
                a.status, b.status
            ),
        )
    } else if b.replayed() || same_answer(&a, &b) && ra == rb {
        (
            Verdict::Fail,
            "the second credential got the first one's answer: keys are not scoped by tenant (a data leak)".to_owned(),
        )
    } else {
        (Verdict::Pass, "two independent executions".to_owned())
    };
    (verdict.0, verdict.1, vec![a, b])
}
