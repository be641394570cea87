//! The JSON report: the URL, whether the run passed, and every outcome
//! with all its evidence.

use http::Uri;

use crate::{Outcome, exit_code};

/// The JSON report.
pub fn json_report(url: &Uri, outcomes: &[Outcome]) -> String {
    serde_json::json!({
        "url": url.to_string(),
        "passed": exit_code(outcomes) == 0,
        "probes": outcomes,
    })
    .to_string()
}
