//! Reading the key, the tenant and the fingerprint, one reading at a time
//! and against the forms earlier records were written in.

use std::sync::Arc;
use std::time::SystemTime;

use http::header::{self, HeaderMap, HeaderName};
use http::request::Parts;
use idem::{Fingerprint, HashSecret, IdempotencyKey};

use super::*;
use crate::{BodyFields, JsonPointer, Problem, ProblemKind};
use http::Request;

#[test]
fn ambiguous_json_is_refused_and_plain_json_keeps_its_fingerprint() {
    let json = |body: &str| {
        let p = parts(|b| b.header("content-type", "application/json"));
        Hashing::unkeyed().fingerprint(
            &p,
            "/v1/payments",
            "POST /v1/payments",
            &[],
            body.as_bytes(),
        )
    };
    for (body, why) in [
        (r#"{"a":1,"a":2}"#, "appears twice"),
        (r#"{"x":{"to":"alice","to":"mallory"}}"#, "appears twice"),
    ] {
        let p = json(body).expect_err(body);
        assert_eq!(p.kind(), Some(ProblemKind::BodyAmbiguous), "{body}");
        assert!(p.detail().contains(why), "{body}: {}", p.detail());
    }
    // Integers of any size are requests of their own.
    let big = json(r#"[{"n":9007199254740993}]"#).expect("accepted");
    assert_ne!(big, json(r#"[{"n":9007199254740992}]"#).expect("accepted"));
    assert_ne!(
        json(r#"{"n":-18446744073709551617}"#).expect("accepted"),
        json(r#"{"n":-18446744073709551616}"#).expect("accepted")
    );
    // Safe integers, floats and the same document reordered are fine
    // and fingerprint as in the earlier form (the canonical JSON's digest).
    let a = json(r#"{"n":9007199254740992,"f":1.5,"s":"x"}"#).expect("safe");
    let b = json(r#"{ "s":"x", "f":1.5, "n":9007199254740992 }"#).expect("safe");
    assert_eq!(a, b);
    let p = parts(|b| b.header("content-type", "application/json"));
    let via_builder = Fingerprint::builder()
        .part("method", b"POST")
        .part("operation", b"POST /v1/payments")
        .part("query", b"a=1&b=2")
        .json_body(br#"{"n":9007199254740992,"f":1.5,"s":"x"}"#)
        .finish();
    // The earlier form is the one versions before this one wrote.
    let upgrading =
        Hashing::unkeyed().accept_v1_until(SystemTime::now() + std::time::Duration::from_secs(60));
    let (_, earlier) = fingerprints(
        &upgrading,
        &p,
        "/v1/payments",
        "POST /v1/payments",
        &[],
        &BodyFields::All,
        br#"{"n":9007199254740992,"f":1.5,"s":"x"}"#,
    )
    .expect("fp");
    assert_eq!(earlier, Some(via_builder));
    // Not JSON at all: its bytes, as in the earlier form.
    assert!(json("{not json").is_ok());
    // A body versions before refused has no earlier fingerprint.
    let (_, earlier) = fingerprints(
        &upgrading,
        &p,
        "/v1/payments",
        "POST /v1/payments",
        &[],
        &BodyFields::All,
        br#"{"n":9007199254740993}"#,
    )
    .expect("fp");
    assert_eq!(earlier, None);
}

/// The previous fingerprint is the `v2` one: the current form with
/// numbers read as doubles, so two bodies one double cannot tell apart
/// share it, and one that version refused has none.
#[test]
fn the_previous_fingerprint_reads_numbers_as_doubles() {
    let p = parts(|b| b.header("content-type", "application/json"));
    let fields = BodyFields::Exclude(vec!["/sent_at".parse().expect("pointer")]);
    let previous = |hashing: &Hashing, body: &str| {
        previous_fingerprint(
            hashing,
            &p,
            "/v1/payments",
            "POST /v1/payments",
            &[header::CONTENT_TYPE],
            &fields,
            body.as_bytes(),
        )
    };
    let a = previous(&secret(1), r#"{"amount":0.1,"sent_at":1}"#).expect("v2");
    assert!(a.to_string().starts_with("v2:"), "{a}");
    assert_eq!(
        Some(a),
        previous(&secret(1), r#"{"amount":0.10000000000000001,"sent_at":2}"#)
    );
    assert_eq!(previous(&secret(1), r#"{"id":9007199254740993}"#), None);
    let unkeyed = previous(&Hashing::unkeyed(), r#"{"amount":0.1}"#).expect("v1");
    assert!(unkeyed.to_string().starts_with("v1:"), "{unkeyed}");
    // The current fingerprint tells the two amounts apart.
    let current = |body: &str| {
        fingerprints(
            &secret(1),
            &p,
            "/v1/payments",
            "POST /v1/payments",
            &[header::CONTENT_TYPE],
            &fields,
            body.as_bytes(),
        )
        .expect("fp")
        .0
    };
    assert_ne!(
        current(r#"{"amount":0.1}"#),
        current(r#"{"amount":0.10000000000000001}"#)
    );
}

fn parts(build: impl FnOnce(http::request::Builder) -> http::request::Builder) -> Parts {
    build(Request::post("/v1/payments?b=2&a=1"))
        .body(())
        .expect("request")
        .into_parts()
        .0
}

fn key_of(value: &[u8]) -> Result<Option<IdempotencyKey>, Problem> {
    let p = parts(|b| {
        b.header(
            "idempotency-key",
            http::HeaderValue::from_bytes(value).expect("header"),
        )
    });
    idempotency_key(&p.headers)
}

#[test]
fn bare_and_structured_keys() {
    assert_eq!(
        key_of(b"abc-123").expect("ok").expect("some").as_str(),
        "abc-123"
    );
    assert_eq!(
        key_of(b"\"abc-123\"").expect("ok").expect("some").as_str(),
        "abc-123"
    );
    assert_eq!(
        key_of(br#""a\"b\\c""#).expect("ok").expect("some").as_str(),
        r#"a"b\c"#
    );
    assert_eq!(idempotency_key(&HeaderMap::new()).expect("ok"), None);
    // A quoted key may hold spaces (an sf-string); a bare one may not.
    assert_eq!(
        key_of(b"\" two words \"")
            .expect("ok")
            .expect("some")
            .as_str(),
        " two words "
    );
    // Item parameters are allowed by the draft and ignored.
    for value in [
        &br#""abc-123";v=1"#[..],
        br#""abc-123"; origin="web;app""#,
        br#""abc-123";a;b=tok;*c=2.5"#,
    ] {
        assert_eq!(
            key_of(value).expect("parameters").expect("some").as_str(),
            "abc-123",
            "{}",
            String::from_utf8_lossy(value)
        );
    }
}

#[test]
fn malformed_keys_are_problems() {
    for (value, kind) in [
        (&b"\"\""[..], ProblemKind::KeyInvalid),
        (b"\"abc", ProblemKind::KeyInvalid),
        (b"\"a\\nb\"", ProblemKind::KeyInvalid),
        (b"a b", ProblemKind::KeyInvalid),
        (b"\"a\"b\"", ProblemKind::KeyInvalid),
        (b"\"a\";", ProblemKind::KeyInvalid),
        (b"\"a\";V=1", ProblemKind::KeyInvalid),
        (b"\"a\";v=", ProblemKind::KeyInvalid),
        (b"\"a\";v=\"open", ProblemKind::KeyInvalid),
        (b"\"a\" junk", ProblemKind::KeyInvalid),
        (b"caf\xc3\xa9", ProblemKind::KeyInvalid),
    ] {
        let err = key_of(value).expect_err("invalid");
        assert_eq!(err.kind(), Some(kind), "{value:?}");
        assert_eq!(err.status(), 400);
    }
    let long = vec![b'k'; 256];
    assert!(
        key_of(&long)
            .expect_err("too long")
            .detail()
            .contains("256")
    );
}

#[test]
fn two_key_headers_are_ambiguous() {
    let p = parts(|b| {
        b.header("idempotency-key", "a")
            .header("idempotency-key", "a")
    });
    assert_eq!(
        idempotency_key(&p.headers).expect_err("two").kind(),
        Some(ProblemKind::KeyAmbiguous)
    );
}

fn secret(byte: u8) -> Hashing {
    Hashing::keyed(Arc::new(
        HashSecret::from_bytes(&[byte; 32]).expect("32 bytes"),
    ))
}

#[test]
fn tenants() {
    let hashing = secret(7);
    let tenant_of = |src: &TenantSource, p: &Parts| src.tenant(p).map(|t| hashing.tenant(&t));
    let with_auth = parts(|b| b.header("authorization", "Bearer one"));
    let other = parts(|b| b.header("authorization", "Bearer two"));
    let t1 = tenant_of(&TenantSource::Authorization, &with_auth).expect("tenant");
    assert_eq!(t1.len(), 64);
    assert_ne!(
        t1,
        tenant_of(&TenantSource::Authorization, &other).expect("tenant")
    );
    // Keyed: neither the credential nor its plain SHA-256, and another
    // secret gives another tenant.
    assert!(!t1.contains("one"));
    assert_ne!(t1, idem::fingerprint::unkeyed_tenant(b"Bearer one"));
    assert_ne!(
        t1,
        secret(8).tenant(&TenantSource::Authorization.tenant(&with_auth).expect("t"))
    );
    assert_eq!(
        TenantSource::Authorization.v1_tenant(&with_auth),
        Some(idem::fingerprint::unkeyed_tenant(b"Bearer one"))
    );
    // Nothing sent, an empty value: no shared tenant, a 401.
    for p in [parts(|b| b), parts(|b| b.header("authorization", " "))] {
        let err = TenantSource::Authorization.tenant(&p).expect_err("missing");
        assert_eq!(
            (err.kind(), err.status().as_u16()),
            (Some(ProblemKind::TenantMissing), 401)
        );
    }
    let two = parts(|b| b.header("authorization", "a").header("authorization", "b"));
    assert_eq!(
        TenantSource::Authorization
            .tenant(&two)
            .expect_err("two")
            .kind(),
        Some(ProblemKind::TenantInvalid)
    );
    let api_key = TenantSource::Header(HeaderName::from_static("x-api-key"));
    assert_eq!(
        api_key
            .tenant(&parts(|b| b.header("x-api-key", "k_1")))
            .expect("tenant"),
        Tenant::Credential(b"k_1")
    );
    assert_eq!(
        api_key.tenant(&parts(|b| b)).expect_err("missing").kind(),
        Some(ProblemKind::TenantMissing)
    );
    let session = TenantSource::Cookie("session".into());
    assert_eq!(
        session
            .tenant(&parts(
                |b| b.header("cookie", "theme=dark; session=s_9; x=1")
            ))
            .expect("tenant"),
        Tenant::Credential(b"s_9")
    );
    for p in [
        parts(|b| b),
        parts(|b| b.header("cookie", "sessionx=1; session=")),
    ] {
        assert_eq!(
            session.tenant(&p).expect_err("missing").kind(),
            Some(ProblemKind::TenantMissing)
        );
    }
    let twice = parts(|b| {
        b.header("cookie", "session=a")
            .header("cookie", "session=b")
    });
    assert_eq!(
        session.tenant(&twice).expect_err("two").kind(),
        Some(ProblemKind::TenantInvalid)
    );
    assert_eq!(
        TenantSource::Single("one".into())
            .tenant(&parts(|b| b))
            .expect("tenant"),
        Tenant::Identity("one".into())
    );
}

#[test]
fn a_trusted_header_counts_only_from_a_trusted_proxy() {
    let src = TenantSource::TrustedHeader {
        name: HeaderName::from_static("x-user"),
        proxies: vec![
            "10.0.0.0/8".parse().expect("net"),
            "::1/128".parse().expect("net"),
        ],
    };
    let from = |peer: Option<&str>| {
        let mut p = parts(|b| b.header("x-user", "alice"));
        if let Some(peer) = peer {
            p.extensions.insert(PeerAddr(peer.parse().expect("addr")));
        }
        p
    };
    for peer in ["10.1.2.3:5000", "[::1]:80"] {
        assert_eq!(
            src.tenant(&from(Some(peer))).expect("trusted"),
            Tenant::Identity("alice".into()),
            "{peer}"
        );
    }
    for peer in [Some("192.168.0.1:5000"), None] {
        let err = src.tenant(&from(peer)).expect_err("untrusted");
        assert_eq!(
            (err.kind(), err.status().as_u16()),
            (Some(ProblemKind::TenantUntrusted), 403)
        );
    }
    let mut without = parts(|b| b);
    without
        .extensions
        .insert(PeerAddr("10.0.0.1:1".parse().expect("addr")));
    assert_eq!(
        src.tenant(&without).expect_err("missing").kind(),
        Some(ProblemKind::TenantMissing)
    );
}

#[test]
fn fingerprint_ignores_json_layout_and_keeps_path_and_query_order() {
    let hashing = secret(1);
    let json =
        |b: http::request::Builder| b.header("content-type", "application/json; charset=utf-8");
    let fp = |p: &Parts, path: &str, op: &str, body: &[u8]| {
        hashing
            .fingerprint(p, path, op, &[header::CONTENT_TYPE], body)
            .expect("fp")
    };
    let a = fp(
        &parts(json),
        "/v1/payments",
        "POST /v1/payments",
        br#"{"a":1,"b":[1,2]}"#,
    );
    assert!(a.to_string().starts_with("v3:"), "{a}");
    let b = fp(
        &parts(json),
        "/v1/payments",
        "POST /v1/payments",
        b"{ \"b\": [1, 2], \"a\": 1.0 }",
    );
    assert_eq!(a, b);
    let c = fp(
        &parts(json),
        "/v1/payments",
        "POST /v1/payments",
        br#"{"a":2,"b":[1,2]}"#,
    );
    assert_ne!(a, c);
    let other_op = fp(
        &parts(json),
        "/v1/payments",
        "POST /v1/refunds",
        br#"{"a":1,"b":[1,2]}"#,
    );
    assert_ne!(a, other_op);
    // One key on another resource of the same route: another request.
    let op = "POST /v1/orders/{id}/capture";
    assert_ne!(
        fp(&parts(json), "/v1/orders/ord_A/capture", op, b"{}"),
        fp(&parts(json), "/v1/orders/ord_B/capture", op, b"{}")
    );
    // Repeated parameters keep their order; parameters stay apart.
    let with_query = |q: &str| {
        let mut p = parts(json);
        p.uri = format!("/v1/payments?{q}").parse().expect("uri");
        fp(&p, "/v1/payments", "POST /v1/payments", b"{}")
    };
    assert_ne!(with_query("a=1&a=2"), with_query("a=2&a=1"));
    assert_ne!(with_query("a=1&b=2"), with_query("a=1%26b=2"));
    // Another secret, another fingerprint; unkeyed is v1, and it too
    // tells one resource from another.
    let other = secret(2).fingerprint(
        &parts(json),
        "/v1/payments",
        "POST /v1/payments",
        &[header::CONTENT_TYPE],
        br#"{"a":1,"b":[1,2]}"#,
    );
    assert_ne!(a, other.expect("fp"));
    let v1 = |path: &str| {
        Hashing::unkeyed()
            .fingerprint(
                &parts(json),
                path,
                "POST /v1/payments",
                &[header::CONTENT_TYPE],
                b"{}",
            )
            .expect("fp")
    };
    assert!(v1("/a").to_string().starts_with("v1:"));
    assert_ne!(v1("/a"), v1("/b"));
    let legacy = Fingerprint::builder()
        .part("method", b"POST")
        .part("operation", b"POST /v1/payments")
        .part("query", b"a=1&b=2")
        .part("content-type", b"application/json; charset=utf-8")
        .json_body(b"{}")
        .finish();
    // While earlier records are looked for, both come out, the v1 one
    // as earlier versions made it.
    let upgrading =
        secret(1).accept_v1_until(SystemTime::now() + std::time::Duration::from_secs(60));
    let (now, earlier) = fingerprints(
        &upgrading,
        &parts(json),
        "/a",
        "POST /v1/payments",
        &[header::CONTENT_TYPE],
        &BodyFields::All,
        b"{}",
    )
    .expect("fp");
    assert_eq!(
        now,
        secret(1)
            .fingerprint(
                &parts(json),
                "/a",
                "POST /v1/payments",
                &[header::CONTENT_TYPE],
                b"{}"
            )
            .expect("fp")
    );
    assert_eq!(earlier, Some(legacy));
    assert_eq!(
        fingerprints(
            &secret(1),
            &parts(json),
            "/a",
            "POST /v1/payments",
            &[],
            &BodyFields::All,
            b"{}"
        )
        .expect("fp")
        .1,
        None
    );
}

#[test]
fn chosen_body_fields_leave_the_rest_of_the_fingerprint_and_plain_bodies_alone() {
    let fp = |content_type: &str, fields: &BodyFields, body: &[u8]| {
        let p = parts(|b| b.header("content-type", content_type));
        let hashing =
            secret(1).accept_v1_until(SystemTime::now() + std::time::Duration::from_secs(60));
        fingerprints(&hashing, &p, "/v1/p", "POST /v1/p", &[], fields, body).expect("fp")
    };
    let p = |t: &str| t.parse::<JsonPointer>().expect("pointer");
    let json = "application/json";
    let exclude = BodyFields::Exclude(vec![p("/sent_at")]);
    let (a, a_earlier) = fp(json, &exclude, br#"{"amount":5,"sent_at":1}"#);
    let (b, b_earlier) = fp(json, &exclude, br#"{"amount":5,"sent_at":2}"#);
    assert_eq!(a, b, "the stamp is left out");
    // Earlier versions covered the whole body, and still do.
    assert_ne!(a_earlier, b_earlier);
    // The same document covered whole is another request: a route that
    // changes what it covers does not replay records made before.
    let (whole, _) = fp(json, &BodyFields::All, br#"{"amount":5}"#);
    let (trimmed, _) = fp(json, &exclude, br#"{"amount":5}"#);
    assert_ne!(whole, trimmed);
    // A body that is not JSON is covered whole, as if no field were named.
    let include = BodyFields::Include(vec![p("/amount")]);
    let (plain, _) = fp("text/plain", &include, b"amount=5");
    assert_eq!(plain, fp("text/plain", &BodyFields::All, b"amount=5").0);
    assert_ne!(plain, fp("text/plain", &include, b"amount=6").0);
    // Ambiguous JSON is refused whatever is covered.
    let p = parts(|b| b.header("content-type", json));
    let ambiguous = fingerprints(
        &secret(1),
        &p,
        "/",
        "op",
        &[],
        &include,
        br#"{"amount":1,"amount":2}"#,
    );
    assert_eq!(
        ambiguous.expect_err("dup").kind(),
        Some(ProblemKind::BodyAmbiguous)
    );
}

#[test]
fn keys_come_from_the_first_named_header_or_the_body_field() {
    let names = [HeaderName::from_static("x-request-id"), IDEMPOTENCY_KEY];
    let p = parts(|b| {
        b.header("idempotency-key", "second")
            .header("x-request-id", "first")
    });
    assert_eq!(
        key_from_headers(&p.headers, &names)
            .expect("ok")
            .expect("key")
            .as_str(),
        "first"
    );
    let p = parts(|b| b.header("idempotency-key", "\"quoted k\""));
    assert_eq!(
        key_from_headers(&p.headers, &names)
            .expect("ok")
            .expect("key")
            .as_str(),
        "quoted k"
    );
    assert_eq!(key_from_headers(&p.headers, &[]).expect("ok"), None);
    let p = parts(|b| b.header("x-request-id", "a").header("x-request-id", "b"));
    let err = key_from_headers(&p.headers, &names).expect_err("two");
    assert!(err.detail().contains("X-Request-Id"), "{}", err.detail());

    let field = "/order/id".parse::<JsonPointer>().expect("pointer");
    let json = parts(|b| b.header("content-type", "application/json"));
    let key = |body: &str| key_from_body(&json, body.as_bytes(), &field);
    assert_eq!(
        key(r#"{"order":{"id":"o-1"}}"#)
            .expect("ok")
            .expect("key")
            .as_str(),
        "o-1"
    );
    assert_eq!(
        key(r#"{"order":{"id":-7}}"#)
            .expect("ok")
            .expect("key")
            .as_str(),
        "-7"
    );
    assert_eq!(key(r#"{"order":{}}"#).expect("ok"), None);
    assert_eq!(key("not json").expect("ok"), None);
    for bad in [
        r#"{"order":{"id":1.5}}"#,
        r#"{"order":{"id":true}}"#,
        r#"{"order":{"id":"\u0007"}}"#,
    ] {
        assert_eq!(
            key(bad).expect_err(bad).kind(),
            Some(ProblemKind::KeyInvalid),
            "{bad}"
        );
    }
    let text = parts(|b| b.header("content-type", "text/plain"));
    assert_eq!(
        key_from_body(&text, br#"{"order":{"id":"o-1"}}"#, &field).expect("ok"),
        None
    );
}

#[test]
fn json_that_is_not_utf8_is_refused() {
    let p = parts(|b| b.header("content-type", "application/merchant+json"));
    let err = secret(1)
        .fingerprint(&p, "/", "op", &[], b"{\"a\":\"\xff\"}")
        .expect_err("not utf-8");
    assert_eq!(err.kind(), Some(ProblemKind::BodyEncoding));
    // Not JSON: any bytes are fine.
    let p = parts(|b| b.header("content-type", "application/octet-stream"));
    assert!(
        secret(1)
            .fingerprint(&p, "/", "op", &[], b"\xff\xfe")
            .is_ok()
    );
}
