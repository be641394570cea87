//! Property tests: the same JSON written any way is the same request; a
//! key is accepted exactly when it is 1 to 255 bytes of visible ASCII, and
//! a refusal points at the first offending byte; and the record state
//! machine, driven by random operations of three would-be owners on one
//! key, never lets two attempts own it, never forgets or rewrites a
//! final answer, and fences out everyone but the current owner.

use std::time::Duration;

use idem::{
    FinalOutcome, Fingerprint, IdempotencyKey, JsonRefusal, KeyError, LeaseExpiry, MemoryStore,
    OwnerToken, Reservation, ReserveRequest, Scope, Store, StoredResponse, Verdict, canonical_json,
    canonical_json_strict,
};
use proptest::prelude::*;

/// A JSON document as a tree whose objects keep their members in a list,
/// so it can be written with the members in any order.
#[derive(Debug, Clone)]
enum J {
    Null,
    Bool(bool),
    Int(i64),
    Float(f64),
    Str(String),
    Arr(Vec<J>),
    Obj(Vec<(String, J)>),
}

/// An object of the first member of each name: member names are unique in
/// a document worth comparing.
fn object(members: Vec<(String, J)>) -> J {
    let mut seen = std::collections::HashSet::new();
    J::Obj(
        members
            .into_iter()
            .filter(|(k, _)| seen.insert(k.clone()))
            .collect(),
    )
}

/// Integers within ±2^53, where each one has a double of its own (the
/// reference implementation reads numbers as doubles).
const SAFE: std::ops::RangeInclusive<i64> = -(1 << 53)..=(1 << 53);

fn json() -> impl Strategy<Value = J> {
    let leaf = prop_oneof![
        Just(J::Null),
        any::<bool>().prop_map(J::Bool),
        SAFE.prop_map(J::Int),
        (-1.0e12f64..1.0e12).prop_map(J::Float),
        "[a-zé\"\\\\ \\n€]{0,8}".prop_map(J::Str),
    ];
    leaf.prop_recursive(4, 32, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(J::Arr),
            prop::collection::vec(("[a-d]{1,2}", inner), 0..4).prop_map(object),
        ]
    })
}

/// Documents over the whole range the canonicaliser must get right, for
/// the comparison with the reference implementation: any finite double
/// (tiny, huge, negative zero), every control character, characters on both
/// sides of the surrogate range in member names (where UTF-8 and UTF-16
/// order differ).
fn wide_json() -> impl Strategy<Value = J> {
    let text = "[\\u{0}-\\u{1f}a-z\"\\\\é\\u{7f}\\u{d7ff}\\u{e000}\\u{fb01}\\u{ffff}\\u{10000}\\u{1f600}]{0,6}";
    let leaf = prop_oneof![
        Just(J::Null),
        any::<bool>().prop_map(J::Bool),
        SAFE.prop_map(J::Int),
        any::<f64>()
            .prop_filter("finite", |f| f.is_finite())
            .prop_map(J::Float),
        Just(J::Float(-0.0)),
        prop_oneof![
            Just(1e21),
            Just(1e-7),
            Just(123456789012345680000.0),
            Just(5e-324)
        ]
        .prop_map(J::Float),
        text.prop_map(J::Str),
    ];
    leaf.prop_recursive(3, 24, 4, move |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(J::Arr),
            prop::collection::vec((text, inner), 0..5).prop_map(object),
        ]
    })
}

/// Writes `j` as JSON text, members reversed or not, with or without
/// white space.
fn write(j: &J, reversed: bool, spaced: bool) -> String {
    let (comma, colon) = if spaced { (" ,\n ", " : ") } else { (",", ":") };
    match j {
        J::Null => "null".to_owned(),
        J::Bool(b) => b.to_string(),
        J::Int(i) => i.to_string(),
        J::Float(f) => serde_json::to_string(f).unwrap_or_else(|_| "0".to_owned()),
        J::Str(s) => serde_json::to_string(s).unwrap_or_default(),
        J::Arr(items) => format!(
            "[{}]",
            items
                .iter()
                .map(|i| write(i, reversed, spaced))
                .collect::<Vec<_>>()
                .join(comma)
        ),
        J::Obj(members) => {
            let mut parts: Vec<String> = members
                .iter()
                .map(|(k, v)| {
                    format!(
                        "{}{colon}{}",
                        serde_json::to_string(k).unwrap_or_default(),
                        write(v, reversed, spaced)
                    )
                })
                .collect();
            if reversed {
                parts.reverse();
            }
            format!("{{{}}}", parts.join(comma))
        }
    }
}

/// `cases` random cases; no failure files (the seed is printed instead).
fn config(cases: u32) -> ProptestConfig {
    ProptestConfig {
        cases,
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

fn fingerprint(body: &str) -> Fingerprint {
    Fingerprint::builder()
        .part("method", b"POST")
        .json_body(body.as_bytes())
        .finish()
}

proptest! {
    #![proptest_config(config(256))]

    #[test]
    fn equivalent_json_is_the_same_request(j in json()) {
        let (plain, other) = (write(&j, false, false), write(&j, true, true));
        prop_assert_eq!(fingerprint(&plain), fingerprint(&other), "{} vs {}", plain, other);
        let canonical = canonical_json(plain.as_bytes()).expect("valid JSON");
        prop_assert_eq!(canonical_json(&canonical), Some(canonical.clone()), "canonical form is stable");
    }

    #[test]
    fn canonical_form_matches_the_reference_implementation(j in wide_json()) {
        let text = write(&j, true, true);
        let reference = serde_json::from_str::<serde_json::Value>(&text)
            .ok()
            .and_then(|v| serde_json_canonicalizer::to_vec(&v).ok());
        prop_assert!(reference.is_some(), "reference refused {}", text);
        prop_assert_eq!(canonical_json(text.as_bytes()), reference, "{}", text);
    }

    #[test]
    fn ambiguous_json_gets_no_canonical_form_and_big_integers_do(j in json(), big in (1i64 << 53) + 1..=i64::MAX, neg in any::<bool>()) {
        let n = if neg { -big } else { big };
        let text = format!("[{}, {n}]", write(&j, false, false));
        let canonical = canonical_json(text.as_bytes());
        prop_assert!(canonical.as_ref().is_some_and(|c| c.ends_with(format!(",{n}]").as_bytes())), "{}", text);
        let neighbour = format!("[{}, {}]", write(&j, false, false), n - n.signum());
        prop_assert_ne!(canonical, canonical_json(neighbour.as_bytes()), "{}", text);
        let twice = format!(r#"{{"k":{0},"k":{0}}}"#, write(&j, false, false));
        prop_assert!(matches!(canonical_json_strict(twice.as_bytes()), Err(JsonRefusal::Ambiguous(_))), "{}", twice);
    }

    #[test]
    fn different_json_is_a_different_request(a in json(), b in json()) {
        let (a, b) = (write(&a, false, false), write(&b, false, false));
        let same = canonical_json(a.as_bytes()) == canonical_json(b.as_bytes());
        prop_assert_eq!(fingerprint(&a) == fingerprint(&b), same, "{} vs {}", a, b);
    }

    #[test]
    fn one_decimal_value_is_one_number_and_another_is_another(
        digits in "[1-9][0-9]{0,39}",
        exp in -400i32..400,
        point in 0usize..45,
        zeros in 0usize..4,
        neg in any::<bool>(),
        change in any::<prop::sample::Index>(),
    ) {
        let sign = if neg { "-" } else { "" };
        let plain = format!("{sign}{digits}e{exp}");
        // The same value with the point moved, trailing zeros added to
        // the fraction, and the exponent padded with zeros.
        let shifted = {
            let point = point.min(digits.len());
            let (int, frac) = digits.split_at(point);
            let int = if int.is_empty() { "0" } else { int };
            let moved = exp + i32::try_from(digits.len() - point).expect("small");
            let (esign, magnitude) = if moved < 0 { ("-", -moved) } else { ("+", moved) };
            format!("{sign}{int}.{frac}{}E{esign}{magnitude:03}", "0".repeat(zeros + 1))
        };
        let (a, b) = (canonical_json(plain.as_bytes()), canonical_json(shifted.as_bytes()));
        prop_assert!(a.is_some(), "{}", plain);
        prop_assert_eq!(&a, &b, "{} vs {}", plain, shifted);
        // One digit changed: another number, however far down.
        let i = change.index(digits.len());
        let mut other = digits.clone().into_bytes();
        other[i] = if other[i] == b'9' { b'1' } else { other[i] + 1 };
        let other = format!("{sign}{}e{exp}", String::from_utf8(other).expect("digits"));
        prop_assert_ne!(&a, &canonical_json(other.as_bytes()), "{} vs {}", plain, other);
    }

    #[test]
    fn keys_are_visible_ascii_of_1_to_255_bytes(
        bytes in prop::collection::vec(
            prop_oneof![8 => 0x21u8..=0x7e, 1 => any::<u8>()],
            0..300,
        )
    ) {
        match IdempotencyKey::from_bytes(&bytes) {
            Ok(key) => {
                prop_assert!((1..=255).contains(&bytes.len()));
                prop_assert!(bytes.iter().all(u8::is_ascii_graphic));
                prop_assert_eq!(key.as_str().as_bytes(), &bytes[..]);
            }
            Err(KeyError::Empty) => prop_assert!(bytes.is_empty()),
            Err(KeyError::TooLong { len }) => {
                prop_assert_eq!(len, bytes.len());
                prop_assert!(len > 255);
            }
            Err(KeyError::InvalidByte { position, byte }) => {
                prop_assert_eq!(bytes[position], byte);
                prop_assert!(!byte.is_ascii_graphic());
                prop_assert!(bytes[..position].iter().all(u8::is_ascii_graphic));
            }
        }
    }
}

/// One operation of owner `who` (0..3) on the key.
#[derive(Debug, Clone, Copy)]
enum Op {
    /// Reserve, for the request with fingerprint `fp` (0 or 1).
    Reserve {
        who: usize,
        fp: u8,
    },
    Complete {
        who: usize,
    },
    Fail {
        who: usize,
    },
    Release {
        who: usize,
    },
    Unknown {
        who: usize,
    },
}

fn op() -> impl Strategy<Value = Op> {
    (0usize..3, 0u8..5, 0u8..2).prop_map(|(who, kind, fp)| match kind {
        0 => Op::Reserve { who, fp },
        1 => Op::Complete { who },
        2 => Op::Fail { who },
        3 => Op::Release { who },
        _ => Op::Unknown { who },
    })
}

/// What the record should be.
#[derive(Debug, Clone, PartialEq)]
enum Model {
    Absent,
    Processing {
        owner: usize,
        fp: u8,
    },
    Final {
        owner: usize,
        fp: u8,
        body: String,
        verdict: Verdict,
    },
}

proptest! {
    #![proptest_config(config(200))]

    #[test]
    fn the_record_state_machine_holds(ops in prop::collection::vec(op(), 1..40)) {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
        rt.block_on(async {
            let store = MemoryStore::new();
            let scope = Scope::new("tenant", "POST /v1/payments").expect("scope");
            let key: IdempotencyKey = "the-key".parse().expect("key");
            let owners = [OwnerToken::random(), OwnerToken::random(), OwnerToken::random()];
            let mut leases = [None, None, None];
            let mut model = Model::Absent;
            let fps = [fingerprint("{\"a\":1}"), fingerprint("{\"a\":2}")];
            for (step, op) in ops.into_iter().enumerate() {
                match op {
                    Op::Reserve { who, fp } => {
                        let got = store
                            .reserve(ReserveRequest {
                                scope: &scope,
                                key: &key,
                                fingerprint: fps[fp as usize],
                                owner: owners[who],
                                lease: Duration::from_secs(600),
                                retention: Duration::from_secs(600),
                                on_lease_expiry: LeaseExpiry::Retry,
                            })
                            .await
                            .expect("reserve");
                        match (&model, got) {
                            (Model::Absent, Reservation::Acquired(lease)) => {
                                leases[who] = Some(lease);
                                model = Model::Processing { owner: who, fp };
                            }
                            (Model::Processing { fp: held, .. }, Reservation::InProgress { .. })
                                if *held == fp => {}
                            (Model::Processing { fp: held, .. }, Reservation::Mismatch { .. })
                                if *held != fp => {}
                            (Model::Final { fp: held, body, .. }, Reservation::Existing(record))
                                if *held == fp =>
                            {
                                let stored = record.response.expect("a final record has its answer");
                                assert_eq!(stored.body, body.as_bytes(), "step {step}: the answer is replayed as recorded");
                            }
                            (Model::Final { fp: held, .. }, Reservation::Mismatch { .. }) if *held != fp => {}
                            (m, got) => panic!("step {step}: reserve by {who} (fp {fp}) in {m:?} gave {got:?}"),
                        }
                    }
                    Op::Complete { who } | Op::Fail { who } => {
                        let verdict = if matches!(op, Op::Complete { .. }) { Verdict::Completed } else { Verdict::Failed };
                        let body = format!("answer of {who} at {step}");
                        let outcome = FinalOutcome {
                            verdict,
                            response: StoredResponse::new(if verdict == Verdict::Completed { 201 } else { 422 }, body.clone()),
                            resource_id: None,
                            error_code: None,
                            retention: Duration::from_secs(600),
                        };
                        let result = match leases[who] {
                            Some(lease) => store.resolve(&scope, &key, &lease, &outcome).await.is_ok(),
                            None => false,
                        };
                        match model.clone() {
                            Model::Processing { owner, fp } if owner == who => {
                                assert!(result, "step {step}: the owner records its answer");
                                model = Model::Final { owner, fp, body, verdict };
                            }
                            // The attempt that recorded may record again (the
                            // engine retries a recording whose first try it
                            // could not confirm); the stores keep the latest.
                            // Nobody else can touch a final record.
                            Model::Final { owner, fp, .. } if owner == who => {
                                assert!(result, "step {step}: the owner's recording is retried");
                                model = Model::Final { owner, fp, body, verdict };
                            }
                            m => assert!(!result, "step {step}: {who} recorded over {m:?}"),
                        }
                    }
                    Op::Release { who } => {
                        let result = match leases[who] {
                            Some(lease) => store.release(&scope, &key, &lease).await.is_ok(),
                            None => false,
                        };
                        match model {
                            Model::Processing { owner, .. } if owner == who => {
                                assert!(result, "step {step}: the owner releases");
                                model = Model::Absent;
                            }
                            ref m => assert!(!result, "step {step}: {who} released {m:?}"),
                        }
                    }
                    Op::Unknown { who } => {
                        let result = match leases[who] {
                            Some(lease) => store.mark_unknown(&scope, &key, &lease, "timeout").await.is_ok(),
                            None => false,
                        };
                        match model {
                            // Still processing: the owner keeps it.
                            Model::Processing { owner, .. } if owner == who => {
                                assert!(result, "step {step}: the owner marks it unknown");
                            }
                            ref m => assert!(!result, "step {step}: {who} marked {m:?}"),
                        }
                    }
                }
            }
        });
    }
}
