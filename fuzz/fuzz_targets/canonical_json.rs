//! The JSON canonicaliser behind request fingerprints, on arbitrary bytes:
//! never panics; its output is JSON that means the same, numbers to the
//! last digit, and is its own canonical form. Where the doubles form of
//! earlier versions reads both the input and its canonical form, it reads
//! them alike: the exact form never changes a number's value.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some(canonical) = idem::fingerprint::canonical_json(data) else {
        return;
    };
    // serde_json reads numbers as doubles and refuses those beyond their
    // range; where it reads the input, it reads the canonical form alike.
    if let Ok(original) = serde_json::from_slice::<serde_json::Value>(data) {
        let reread: serde_json::Value =
            serde_json::from_slice(&canonical).expect("the canonical form is JSON");
        assert!(same(&original, &reread), "meaning changed");
    }
    match idem::fingerprint::canonical_json_strict(&canonical) {
        Ok(again) => assert_eq!(again, canonical, "canonical form is stable"),
        Err(why) => panic!("the canonical form does not read back: {why}"),
    }
    // The exact form keeps each number's value: its doubles are the
    // input's (an integer literal beyond ±2^53 in the canonical form is
    // refused by the doubles form, as earlier versions refused it).
    if let (Ok(before), Ok(after)) = (
        idem::fingerprint::canonical_json_doubles(data),
        idem::fingerprint::canonical_json_doubles(&canonical),
    ) {
        assert_eq!(before, after, "a number's value changed");
    }
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
