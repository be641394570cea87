//! [`Probe::DistinctKeys`]: two different keys make two different
//! resources; an endpoint that merges them loses real requests.

use super::common::{Judged, failed_baseline, keyed};
use crate::client::Sender;
use crate::outcome::{Probe, Verdict};

const PROBE: Probe = Probe::DistinctKeys;

/// Sends the request under two keys and compares the resources named
/// (or, without an id, the answers).
pub(super) async fn judge(s: &Sender) -> Judged {
    let a = s.send(keyed(s, PROBE, 0)).await;
    if !a.success() {
        return failed_baseline(vec![a]);
    }
    let b = s.send(keyed(s, PROBE, 1)).await;
    let (ra, rb) = (s.resource(&a), s.resource(&b));
    let verdict = match (&ra, &rb) {
        _ if !a.success() || !b.success() => (
            Verdict::Fail,
            format!("not both succeeded ({} and {})", a.status, b.status),
        ),
        (Some(x), Some(y)) if x != y => (Verdict::Pass, format!("two resources: {x} and {y}")),
        (Some(x), Some(_)) => (
            Verdict::Fail,
            format!("both keys got resource {x}: distinct keys were merged"),
        ),
        _ if a.full_body != b.full_body => (
            Verdict::Pass,
            "the answers differ (no resource id found)".to_owned(),
        ),
        _ => (
            Verdict::Fail,
            "both keys got the identical answer".to_owned(),
        ),
    };
    (verdict.0, verdict.1, vec![a, b])
}
