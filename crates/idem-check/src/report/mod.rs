//! The reports of a run: [`text_report`] for people, [`json_report`] for
//! programs, [`junit_report`] for CI pipelines.
//!
//! Each takes the target's URL and the outcomes of [`run`](crate::run),
//! and returns the whole report; `idem check --format` picks one.
//!
//! ```
//! use idem_check::report::text_report;
//! use idem_check::{Outcome, Probe, Verdict};
//!
//! let outcomes = [Outcome {
//!     probe: Probe::Retry,
//!     verdict: Verdict::Pass,
//!     note: "same status and body".to_owned(),
//!     evidence: Vec::new(),
//!     seconds: 0.01,
//! }];
//! let url = "http://127.0.0.1:8080/v1/payments".parse()?;
//! assert_eq!(
//!     text_report(&url, &outcomes),
//!     "idem check http://127.0.0.1:8080/v1/payments\n\n\
//!      PASS  retry            same status and body\n\
//!      \n1 passed, 0 failed, 0 skipped, 0 errors\n"
//! );
//! # Ok::<(), http::uri::InvalidUri>(())
//! ```

mod json;
mod junit;
mod text;

pub use json::json_report;
pub use junit::junit_report;
pub use text::text_report;

/// `text` on one line (control characters as spaces), cut at `max`
/// characters with an ellipsis.
fn one_line(text: &str, max: usize) -> String {
    let flat: String = text
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    if flat.chars().count() > max {
        format!("{}…", flat.chars().take(max).collect::<String>())
    } else {
        flat
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_line_flattens_and_cuts() {
        assert_eq!(one_line("a\nb\tc", 10), "a b c");
        assert_eq!(one_line("abcdef", 3), "abc…");
        assert_eq!(one_line("abc", 3), "abc");
    }
}
