//! What the probes share: the shape of a judgement and the helpers that
//! make one (a keyed request, a failed baseline, comparing answers,
//! varying and reformatting a JSON body).

use bytes::Bytes;
use serde_json::Value;

use crate::client::{Sender, Variant};

use crate::outcome::{Exchange, Probe, Verdict};

/// A probe's verdict, its note, and the exchanges that justify it.
pub(super) type Judged = (Verdict, String, Vec<Exchange>);

/// The base request with `probe`'s `n`th key of the run.
pub(super) fn keyed(s: &Sender, probe: Probe, n: u32) -> Variant {
    Variant {
        key: Some(s.key(probe, n)),
        ..Variant::default()
    }
}

/// A probe judged on answers that are not successes would prove nothing
/// (two identical 401s look idempotent): the request itself must work.
pub(super) fn failed_baseline(evidence: Vec<Exchange>) -> Judged {
    let first = evidence
        .iter()
        .find(|e| !e.success())
        .map_or(0, |e| e.status);
    (
        Verdict::Error,
        format!(
            "the request was answered {first}, not a success: fix the request (URL, credentials, body) before judging idempotency"
        ),
        evidence,
    )
}

/// Whether two answers are the same: status and whole body.
pub(super) fn same_answer(a: &Exchange, b: &Exchange) -> bool {
    a.status == b.status && a.full_body == b.full_body
}

/// The body with `field` changed to a value that differs from the original.
pub(super) fn vary(body: &[u8], field: &str) -> Bytes {
    let mut json: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
    if let Some(v) = json.get_mut(field) {
        *v = match v.take() {
            Value::Number(n) => n.as_i64().map_or_else(
                || Value::from(n.as_f64().unwrap_or(0.0) + 1.0),
                |i| Value::from(i.wrapping_add(1)),
            ),
            Value::String(s) => Value::from(format!("{s}-changed")),
            Value::Bool(b) => Value::from(!b),
            _ => Value::from("changed"),
        };
    }
    Bytes::from(json.to_string())
}

/// The same JSON value written differently: object keys in reverse order,
/// with white space.
pub(super) fn reformat(json: &Value) -> Bytes {
    fn write(v: &Value, out: &mut String) {
        match v {
            Value::Object(map) => {
                out.push_str("{ ");
                let mut first = true;
                for (k, v) in map.iter().rev() {
                    if !first {
                        out.push_str(" ,\n  ");
                    }
                    first = false;
                    out.push_str(&Value::from(k.clone()).to_string());
                    out.push_str(" :  ");
                    write(v, out);
                }
                out.push_str(" }");
            }
            Value::Array(items) => {
                out.push_str("[ ");
                for (i, v) in items.iter().enumerate() {
                    if i > 0 {
                        out.push_str(" , ");
                    }
                    write(v, out);
                }
                out.push_str(" ]");
            }
            other => out.push_str(&other.to_string()),
        }
    }
    let mut out = String::new();
    write(json, &mut out);
    out.push('\n');
    Bytes::from(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::outcome::PROBES;

    #[test]
    fn reformatted_json_is_the_same_value_written_differently() {
        let json: Value = serde_json::from_str(r#"{"a":1,"b":{"c":[1,2],"d":"x"}}"#).expect("json");
        let text = reformat(&json);
        assert_ne!(text, Bytes::from(json.to_string()));
        let back: Value = serde_json::from_slice(&text).expect("still JSON");
        assert_eq!(back, json);
    }

    #[test]
    fn varied_fields_change() {
        let body = br#"{"amount_cents":100,"currency":"EUR","live":true}"#;
        for field in ["amount_cents", "currency", "live"] {
            let varied: Value = serde_json::from_slice(&vary(body, field)).expect("json");
            let original: Value = serde_json::from_slice(body).expect("json");
            assert_ne!(varied[field], original[field], "{field}");
        }
    }

    #[test]
    fn probe_names_round_trip() {
        for p in PROBES {
            assert_eq!(Probe::parse(p.name()), Some(p));
        }
        assert_eq!(Probe::parse("nope"), None);
    }
}
