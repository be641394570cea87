//! [`Probe::Concurrent`]: `--concurrency` copies of one keyed request at
//! once make exactly one resource; every other copy is replayed or gets
//! 409 with `Retry-After`.

use std::collections::BTreeSet;

use super::common::{Judged, failed_baseline};
use crate::client::{Sender, Variant};
use crate::outcome::{Probe, Verdict};

const PROBE: Probe = Probe::Concurrent;

/// Sends the copies from as many tasks, then judges all the answers
/// (sorted by how long each took).
pub(super) async fn judge(s: &Sender) -> Judged {
    let key = s.key(PROBE, 0);
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..s.target.concurrency {
        let (s, key) = (s.clone(), key.clone());
        tasks.spawn(async move {
            s.send(Variant {
                key: Some(key),
                ..Variant::default()
            })
            .await
        });
    }
    let mut answers = Vec::new();
    while let Some(done) = tasks.join_next().await {
        if let Ok(e) = done {
            answers.push(e);
        }
    }
    let resources: BTreeSet<String> = answers
        .iter()
        .filter(|e| e.success())
        .filter_map(|e| s.resource(e))
        .collect();
    let successes = answers.iter().filter(|e| e.success()).count();
    let conflicts = answers.iter().filter(|e| e.status == 409).count();
    let bad_conflicts = answers
        .iter()
        .filter(|e| e.status == 409 && e.header("retry-after").is_none())
        .count();
    let others: Vec<u16> = answers
        .iter()
        .filter(|e| !e.success() && e.status != 409)
        .map(|e| e.status)
        .collect();
    let summary = format!(
        "{} copies: {successes} success ({} distinct resource(s)), {conflicts} × 409, others {others:?}",
        answers.len(),
        resources.len()
    );
    let verdict = if successes == 0 && conflicts == 0 {
        answers.sort_by_key(|e| e.millis);
        return failed_baseline(answers);
    } else if successes == 0 {
        (Verdict::Fail, format!("no copy succeeded; {summary}"))
    } else if resources.len() > 1 {
        (
            Verdict::Fail,
            format!("duplicates created several resources; {summary}"),
        )
    } else if resources.is_empty()
        && answers
            .iter()
            .filter(|e| e.success())
            .map(|e| &e.full_body)
            .collect::<BTreeSet<_>>()
            .len()
            > 1
    {
        (
            Verdict::Fail,
            format!(
                "successful answers differ and name no resource id (set --id-field); {summary}"
            ),
        )
    } else if !others.is_empty() {
        (
            Verdict::Fail,
            format!("some copies got neither the answer nor 409; {summary}"),
        )
    } else if bad_conflicts > 0 {
        (
            Verdict::Fail,
            format!("{bad_conflicts} × 409 without Retry-After; {summary}"),
        )
    } else {
        (Verdict::Pass, format!("exactly one resource; {summary}"))
    };
    answers.sort_by_key(|e| e.millis);
    (verdict.0, verdict.1, answers)
}
