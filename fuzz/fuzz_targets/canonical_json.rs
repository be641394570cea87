//! The JSON canonicaliser (RFC 8785) behind request fingerprints, on
//! arbitrary bytes: never panics; its output is JSON that means the same
//! and is its own canonical form, except where it writes a double of 2^53
//! or more in integer notation (as RFC 8785 must): read back, that is an
//! integer literal beyond ±2^53, which the strict reader refuses as
//! ambiguous, as it refuses any such literal.
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
    match idem::fingerprint::canonical_json_strict(&canonical) {
        Ok(again) => assert_eq!(again, canonical, "canonical form is stable"),
        Err(idem::JsonRefusal::Ambiguous(why)) => assert!(
            unsafe_integer(&reread),
            "a canonical form refused for another reason: {why}"
        ),
        Err(other) => panic!("the canonical form does not read back: {other}"),
    }
});

/// Whether `v` holds an integer beyond ±2^53 (as serde_json reads it).
fn unsafe_integer(v: &serde_json::Value) -> bool {
    use serde_json::Value::*;
    const SAFE: u64 = 1 << 53;
    match v {
        Number(n) => n.as_u64().is_some_and(|u| u > SAFE) || n.as_i64().is_some_and(|i| i.unsigned_abs() > SAFE),
        Array(items) => items.iter().any(unsafe_integer),
        Object(members) => members.values().any(unsafe_integer),
        _ => false,
    }
}

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
