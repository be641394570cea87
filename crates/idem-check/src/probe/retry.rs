//! [`Probe::Retry`]: the same request sent again with the same key gets
//! the same answer (status and body), ideally marked as a replay.

use super::common::{Judged, failed_baseline, keyed, same_answer};
use crate::client::Sender;
use crate::outcome::{Probe, Verdict};

const PROBE: Probe = Probe::Retry;

/// Sends the keyed request twice, one after the other.
pub(super) async fn judge(s: &Sender) -> Judged {
    let first = s.send(keyed(s, PROBE, 0)).await;
    if !first.success() {
        return failed_baseline(vec![first]);
    }
    let second = s.send(keyed(s, PROBE, 0)).await;
    let marker = match second.replay_marker() {
        Some(name) => format!("the retry is marked {name}: true"),
        None => "the retry is not marked Idempotent-Replayed (nor Idempotency-Replayed)".to_owned(),
    };
    let verdict = if same_answer(&first, &second) {
        (Verdict::Pass, format!("same status and body; {marker}"))
    } else if first.status != second.status {
        (
            Verdict::Fail,
            format!(
                "the retry got {} where the first request got {}",
                second.status, first.status
            ),
        )
    } else {
        (
            Verdict::Fail,
            format!("same status but a different body: the retry was executed again ({marker})"),
        )
    };
    (verdict.0, verdict.1, vec![first, second])
}
