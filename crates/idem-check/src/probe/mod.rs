//! The probes: what each one checks, the verdicts, the evidence, and the
//! run that drives them in order.
//!
//! Each probe lives in its own module and judges the endpoint from the
//! answers to a few requests it sends through the run's
//! [`Sender`]; this module holds what they share: the outcome types, the
//! judging helpers, and [`run`], which also turns transport failures and
//! rate limiting into errors (not blamed on the endpoint) and stops
//! sending once the target proved unreachable.

mod common;
mod concurrent;
mod distinct_keys;
mod equivalent_json;
mod malformed_key;
mod missing_key;
mod retry;
mod reuse;
mod tenants;

use self::common::Judged;
use crate::outcome::{Outcome, Probe, Verdict};

use std::time::Instant;

use crate::Target;
use crate::client::Sender;

/// Runs the probes in order and returns their outcomes.
///
/// Call [`validate`](crate::validate) first; a target whose `--ca-file`
/// certificates cannot be used gets every probe in error with the reason.
/// The probe right after one that got no answer at all is not run (it is
/// in error, "not run: …").
pub async fn run(target: Target, probes: &[Probe]) -> Vec<Outcome> {
    let sender = match Sender::new(target) {
        Ok(sender) => sender,
        // `validate` refuses this first; a caller that skipped it gets
        // every probe in error with the reason.
        Err(why) => {
            let why = why.to_string();
            return probes
                .iter()
                .map(|&probe| Outcome {
                    probe,
                    verdict: Verdict::Error,
                    note: why.clone(),
                    evidence: Vec::new(),
                    seconds: 0.0,
                })
                .collect();
        }
    };
    let mut outcomes = Vec::with_capacity(probes.len());
    let mut gone = None;
    for &probe in probes {
        // Once a probe got no answer at all, the rest are not sent.
        gone = gone.or_else(|| unreachable(&outcomes));
        if let Some(why) = &gone {
            outcomes.push(Outcome {
                probe,
                verdict: Verdict::Error,
                note: format!("not run: {why}"),
                evidence: Vec::new(),
                seconds: 0.0,
            });
            continue;
        }
        let started = Instant::now();
        let (verdict, note, evidence) = probe_once(&sender, probe).await;
        // Transport failures and rate limiting are not the endpoint's
        // idempotency failing: say so instead of blaming it.
        let (verdict, note) = match evidence.iter().find(|e| e.status == 0 || e.status == 429) {
            Some(e) if e.status == 0 => (Verdict::Error, e.body.clone()),
            Some(e) => (
                Verdict::Error,
                format!(
                    "the target rate-limited the check (429{}); lower --concurrency or run it later",
                    e.header("retry-after")
                        .map(|r| format!(", Retry-After: {r}"))
                        .unwrap_or_default()
                ),
            ),
            None => (verdict, note),
        };
        outcomes.push(Outcome {
            probe,
            verdict,
            note,
            evidence,
            seconds: started.elapsed().as_secs_f64(),
        });
    }
    outcomes
}

/// Why the target could not be reached, if the first probe got no answer
/// at all and so no other probe was run: the report then says that once.
pub(crate) fn never_reached(outcomes: &[Outcome]) -> Option<String> {
    let (first, rest) = outcomes.split_first()?;
    let why = unreachable(std::slice::from_ref(first))?;
    rest.iter()
        .all(|o| o.verdict == Verdict::Error && o.evidence.is_empty())
        .then_some(why)
}

/// Why the target is unreachable, if the last probe got no answer at all.
fn unreachable(outcomes: &[Outcome]) -> Option<String> {
    let last = outcomes.last()?;
    (last.verdict == Verdict::Error
        && !last.evidence.is_empty()
        && last.evidence.iter().all(|e| e.status == 0))
    .then(|| last.evidence[0].body.clone())
}

/// Sends `probe`'s requests and judges the answers.
async fn probe_once(s: &Sender, probe: Probe) -> Judged {
    match probe {
        Probe::Retry => retry::judge(s).await,
        Probe::Concurrent => concurrent::judge(s).await,
        Probe::Reuse => reuse::judge(s).await,
        Probe::EquivalentJson => equivalent_json::judge(s).await,
        Probe::DistinctKeys => distinct_keys::judge(s).await,
        Probe::MissingKey => missing_key::judge(s).await,
        Probe::MalformedKey => malformed_key::judge(s).await,
        Probe::Tenants => tenants::judge(s).await,
    }
}
