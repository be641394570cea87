//! The JUnit XML report: one test suite for the run, one test case per
//! probe (failures and errors carry their evidence), for CI pipelines.

use std::fmt::Write as _;

use http::Uri;

use super::one_line;
use crate::{Outcome, Verdict};

/// A JUnit XML report (one test case per probe) for CI pipelines.
pub fn junit_report(url: &Uri, outcomes: &[Outcome]) -> String {
    let count = |v: Verdict| outcomes.iter().filter(|o| o.verdict == v).count();
    let total: f64 = outcomes.iter().map(|o| o.seconds).sum();
    let mut out = String::from("<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n");
    let _ = writeln!(
        out,
        "<testsuite name=\"idem check {}\" tests=\"{}\" failures=\"{}\" errors=\"{}\" skipped=\"{}\" time=\"{total:.3}\">",
        xml(&url.to_string()),
        outcomes.len(),
        count(Verdict::Fail),
        count(Verdict::Error),
        count(Verdict::Skip)
    );
    for o in outcomes {
        let _ = write!(
            out,
            "  <testcase classname=\"idem.check\" name=\"{}\" time=\"{:.3}\">",
            o.probe.name(),
            o.seconds
        );
        let evidence: String = o
            .evidence
            .iter()
            .map(|e| {
                format!(
                    "-> {}\n<- {} {}\n",
                    e.request,
                    e.status,
                    one_line(&e.body, 200)
                )
            })
            .collect();
        match o.verdict {
            Verdict::Pass => {}
            Verdict::Skip => {
                let _ = write!(out, "<skipped message=\"{}\"/>", xml(&o.note));
            }
            Verdict::Fail => {
                let _ = write!(
                    out,
                    "<failure message=\"{}\">{}</failure>",
                    xml(&o.note),
                    xml(&evidence)
                );
            }
            Verdict::Error => {
                let _ = write!(
                    out,
                    "<error message=\"{}\">{}</error>",
                    xml(&o.note),
                    xml(&evidence)
                );
            }
        }
        let _ = writeln!(
            out,
            "<system-out>{}</system-out></testcase>",
            xml(o.probe.summary())
        );
    }
    out.push_str("</testsuite>\n");
    out
}

/// `text` escaped for XML text and attributes, without the control
/// characters XML 1.0 cannot hold (new lines and tabs stay).
fn xml(text: &str) -> String {
    text.chars()
        .filter(|c| !c.is_control() || *c == '\n' || *c == '\t')
        .fold(String::with_capacity(text.len()), |mut s, c| {
            match c {
                '&' => s.push_str("&amp;"),
                '<' => s.push_str("&lt;"),
                '>' => s.push_str("&gt;"),
                '"' => s.push_str("&quot;"),
                '\'' => s.push_str("&apos;"),
                c => s.push(c),
            }
            s
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Probe, exit_code};

    #[test]
    fn junit_escapes_and_counts() {
        let outcomes = vec![Outcome {
            probe: Probe::Retry,
            verdict: Verdict::Fail,
            note: "got <201> & \"more\"".into(),
            evidence: Vec::new(),
            seconds: 0.5,
        }];
        let xml = junit_report(&"http://h/x".parse().expect("uri"), &outcomes);
        assert!(xml.contains("failures=\"1\""), "{xml}");
        assert!(
            xml.contains("got &lt;201&gt; &amp; &quot;more&quot;"),
            "{xml}"
        );
        assert_eq!(exit_code(&outcomes), 1);
    }
}
