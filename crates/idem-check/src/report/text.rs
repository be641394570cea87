//! The human report: one line per probe, the evidence of failures and
//! errors under it, the counts at the end.

use std::fmt::Write as _;

use http::Uri;

use super::one_line;
use crate::{Outcome, Verdict};

/// The human report.
pub fn text_report(url: &Uri, outcomes: &[Outcome]) -> String {
    let mut out = format!("idem check {url}\n\n");
    if let Some(why) = crate::probe::never_reached(outcomes) {
        let _ = writeln!(
            out,
            "ERROR {why}\n      no probe was run: start the API there (or correct --url) and run the check again"
        );
        return out;
    }
    for o in outcomes {
        let mark = match o.verdict {
            Verdict::Pass => "PASS",
            Verdict::Fail => "FAIL",
            Verdict::Skip => "SKIP",
            Verdict::Error => "ERROR",
        };
        let _ = writeln!(out, "{mark:<5} {:<16} {}", o.probe.name(), o.note);
        if matches!(o.verdict, Verdict::Fail | Verdict::Error) {
            for e in o.evidence.iter().take(6) {
                let _ = writeln!(out, "      → {}", e.request);
                let headers: Vec<String> =
                    e.headers.iter().map(|(n, v)| format!("{n}: {v}")).collect();
                let _ = writeln!(
                    out,
                    "      ← {} {} {}",
                    e.status,
                    headers.join("; "),
                    one_line(&e.body, 120)
                );
            }
            if o.evidence.len() > 6 {
                let _ = writeln!(
                    out,
                    "      … {} more exchanges (--format json shows all)",
                    o.evidence.len() - 6
                );
            }
        }
    }
    let count = |v: Verdict| outcomes.iter().filter(|o| o.verdict == v).count();
    let _ = writeln!(
        out,
        "\n{} passed, {} failed, {} skipped, {} errors",
        count(Verdict::Pass),
        count(Verdict::Fail),
        count(Verdict::Skip),
        count(Verdict::Error)
    );
    out
}
