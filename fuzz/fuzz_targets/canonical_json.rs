//! The JSON canonicaliser (RFC 8785) behind request fingerprints, on
//! arbitrary bytes: never panics; its output is JSON that means the same
//! and is its own canonical form.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some(canonical) = idem::fingerprint::canonical_json(data) else {
        return;
    };
    let original: serde_json::Value = serde_json::from_slice(data).expect("accepted input is JSON");
    let reread: serde_json::Value =
        serde_json::from_slice(&canonical).expect("the canonical form is JSON");
    // Numbers may be rewritten (1.0 → 1); compare them as numbers.
    assert!(same(&original, &reread), "meaning changed");
    assert_eq!(
        idem::fingerprint::canonical_json(&canonical).as_deref(),
        Some(canonical.as_slice()),
        "canonical form is stable"
    );
});

fn same(a: &serde_json::Value, b: &serde_json::Value) -> bool {
    use serde_json::Value::*;
    match (a, b) {
        (Number(x), Number(y)) => x.as_f64() == y.as_f64(),
        (Array(x), Array(y)) => x.len() == y.len() && x.iter().zip(y).all(|(p, q)| same(p, q)),
        (Object(x), Object(y)) => {
            x.len() == y.len() && x.iter().all(|(k, v)| y.get(k).is_some_and(|w| same(v, w)))
        }
        _ => a == b,
    }
}
