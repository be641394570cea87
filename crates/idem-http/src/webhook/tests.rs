//! Each provider's published test vector (Standard Webhooks' from Svix's
//! docs, GitHub's from its docs), and vectors made with Python's `hmac`
//! for Stripe, Shopify and a Slack-style generic scheme; then every way a
//! delivery is refused.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use http::{HeaderMap, HeaderName, HeaderValue};

use super::*;

fn at(secs: u64) -> SystemTime {
    UNIX_EPOCH + Duration::from_secs(secs)
}

fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
    let mut h = HeaderMap::new();
    for (name, value) in pairs {
        h.append(
            HeaderName::from_static(name),
            HeaderValue::from_str(value).expect("header value"),
        );
    }
    h
}

fn hook(provider: Provider, secrets: &[&str]) -> Webhook {
    let secrets = secrets
        .iter()
        .map(|s| Secret::parse(s, provider.secret_form()).expect("secret"))
        .collect();
    Webhook::for_provider(provider, secrets).expect("webhook")
}

fn refused(r: Result<IdempotencyKey, Refusal>) -> Refused {
    r.expect_err("refused").reason
}

const SW_SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
const SW_ID: &str = "msg_p5jXN8AQM9LWM0D4loKWxJek";
const SW_TS: u64 = 1_614_265_330;
const SW_BODY: &[u8] = br#"{"test": 2432232314}"#;
const SW_SIG: &str = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=";

fn sw(sig: &str) -> HeaderMap {
    headers(&[
        ("webhook-id", SW_ID),
        ("webhook-timestamp", &SW_TS.to_string()),
        ("webhook-signature", sig),
    ])
}

#[test]
fn standard_webhooks_vector_verifies_and_its_id_is_the_key() {
    let h = hook(Provider::Standard, &[SW_SECRET]);
    let key = h
        .verify_at(&sw(SW_SIG), SW_BODY, at(SW_TS))
        .expect("verified");
    assert_eq!(key.as_str(), SW_ID);
    assert_eq!(h.tenant(), "webhook:standard");
    // Svix's own names for the same three headers.
    let svix = headers(&[
        ("svix-id", SW_ID),
        ("svix-timestamp", &SW_TS.to_string()),
        ("svix-signature", SW_SIG),
    ]);
    assert!(h.verify_at(&svix, SW_BODY, at(SW_TS + 299)).is_ok());
}

#[test]
fn standard_webhooks_rotation_and_other_versions() {
    let h = hook(Provider::Standard, &[SW_SECRET]);
    // Signed with an old and the current secret, and an asymmetric one.
    let many = format!("v1,AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA= v1a,abc {SW_SIG}");
    assert!(h.verify_at(&sw(&many), SW_BODY, at(SW_TS)).is_ok());
    // The route holds the new and the old secret: either verifies.
    let rotated = hook(
        Provider::Standard,
        &["whsec_dGhlIG5ldyBzZWNyZXQgb2YgdGhlIHNlbmRlcg==", SW_SECRET],
    );
    assert!(rotated.verify_at(&sw(SW_SIG), SW_BODY, at(SW_TS)).is_ok());
    assert_eq!(
        refused(h.verify_at(&sw("v1a,abc v2,def"), SW_BODY, at(SW_TS))),
        Refused::SignatureMalformed
    );
}

#[test]
fn standard_webhooks_refusals() {
    let h = hook(Provider::Standard, &[SW_SECRET]);
    let other = hook(Provider::Standard, &["whsec_b3RoZXIgc2VjcmV0"]);
    assert_eq!(
        refused(other.verify_at(&sw(SW_SIG), SW_BODY, at(SW_TS))),
        Refused::SignatureInvalid
    );
    // The same JSON, re-encoded by a proxy: not what was signed.
    assert_eq!(
        refused(h.verify_at(&sw(SW_SIG), br#"{"test":2432232314}"#, at(SW_TS))),
        Refused::SignatureInvalid
    );
    assert_eq!(
        refused(h.verify_at(&sw(SW_SIG), SW_BODY, at(SW_TS + 301))),
        Refused::TimestampStale
    );
    assert_eq!(
        refused(h.verify_at(&sw(SW_SIG), SW_BODY, at(SW_TS - 301))),
        Refused::TimestampFuture
    );
    let wide = h.clone().with_tolerance(Duration::from_secs(3600));
    assert!(
        wide.verify_at(&sw(SW_SIG), SW_BODY, at(SW_TS + 3000))
            .is_ok()
    );
    let mut no_id = sw(SW_SIG);
    no_id.remove("webhook-id");
    assert_eq!(
        refused(h.verify_at(&no_id, SW_BODY, at(SW_TS))),
        Refused::IdMissing
    );
    let mut no_ts = sw(SW_SIG);
    no_ts.remove("webhook-timestamp");
    assert_eq!(
        refused(h.verify_at(&no_ts, SW_BODY, at(SW_TS))),
        Refused::TimestampMissing
    );
    let mut bad_ts = sw(SW_SIG);
    bad_ts.insert("webhook-timestamp", HeaderValue::from_static("-5"));
    assert_eq!(
        refused(h.verify_at(&bad_ts, SW_BODY, at(SW_TS))),
        Refused::TimestampInvalid
    );
    let mut no_sig = sw(SW_SIG);
    no_sig.remove("webhook-signature");
    assert_eq!(
        refused(h.verify_at(&no_sig, SW_BODY, at(SW_TS))),
        Refused::SignatureMissing
    );
    let mut twice = sw(SW_SIG);
    twice.append("webhook-signature", HeaderValue::from_static(SW_SIG));
    assert_eq!(
        refused(h.verify_at(&twice, SW_BODY, at(SW_TS))),
        Refused::SignatureMalformed
    );
}

const STRIPE_SECRET: &str = "whsec_test";
const STRIPE_BODY: &[u8] = br#"{"id":"evt_1","type":"payment_intent.succeeded"}"#;
const STRIPE_V1: &str = "001ce3ef73e456cedaab328328720d3ad59defb8bbd0f1518f46c04ad4ac0bb7";

fn stripe(value: &str) -> HeaderMap {
    headers(&[("stripe-signature", value)])
}

#[test]
fn stripe_signature_and_the_event_id_in_the_body() {
    let h = hook(Provider::Stripe, &[STRIPE_SECRET]);
    let ok = format!(
        "t=1700000000,v1={STRIPE_V1},v0=6ffbb59b2300aae63f272406069a9788598b792a944a07aba816edb039989a39"
    );
    let key = h
        .verify_at(&stripe(&ok), STRIPE_BODY, at(1_700_000_000))
        .expect("verified");
    assert_eq!(key.as_str(), "evt_1");
    // One v1 per secret while Stripe rolls them; uppercase hex too.
    let rolled = format!(
        "t=1700000000, v1=0000, v1={}",
        STRIPE_V1.to_ascii_uppercase()
    );
    assert!(
        h.verify_at(&stripe(&rolled), STRIPE_BODY, at(1_700_000_100))
            .is_ok()
    );
    assert_eq!(
        refused(h.verify_at(
            &stripe("t=1700000000,v0=abcd"),
            STRIPE_BODY,
            at(1_700_000_000)
        )),
        Refused::SignatureMalformed
    );
    assert_eq!(
        refused(h.verify_at(
            &stripe(&format!("v1={STRIPE_V1}")),
            STRIPE_BODY,
            at(1_700_000_000)
        )),
        Refused::TimestampMissing
    );
    assert_eq!(
        refused(h.verify_at(
            &stripe(&format!("t=1,t=1700000000,v1={STRIPE_V1}")),
            STRIPE_BODY,
            at(1_700_000_000)
        )),
        Refused::SignatureMalformed
    );
    // The signature is checked before the timestamp: a forged fresh t= is
    // a wrong signature, an honest old one is stale.
    assert_eq!(
        refused(h.verify_at(
            &stripe(&format!("t=1700000500,v1={STRIPE_V1}")),
            STRIPE_BODY,
            at(1_700_000_500)
        )),
        Refused::SignatureInvalid
    );
    assert_eq!(
        refused(h.verify_at(&stripe(&ok), STRIPE_BODY, at(1_700_000_301))),
        Refused::TimestampStale
    );
}

#[test]
fn a_stripe_body_without_an_id_is_refused_after_verification() {
    // Signed with Python's hmac: t=1700000000, body {"type":"x"}.
    let body = br#"{"type":"x"}"#;
    let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, STRIPE_SECRET.as_bytes());
    let tag = ring::hmac::sign(&key, &[b"1700000000.".as_slice(), body].concat());
    let sig = format!("t=1700000000,v1={}", hex::encode(tag.as_ref()));
    let h = hook(Provider::Stripe, &[STRIPE_SECRET]);
    assert_eq!(
        refused(h.verify_at(&stripe(&sig), body, at(1_700_000_000))),
        Refused::IdMissing
    );
}

#[test]
fn github_documented_vector() {
    let h = hook(Provider::Github, &["It's a Secret to Everybody"]);
    let ok = headers(&[
        (
            "x-hub-signature-256",
            "sha256=757107ea0eb2509fc211221cce984b8a37570b6d7586c22c46f4379c8b043e17",
        ),
        ("x-github-delivery", "72d3162e-cc78-11e3-81ab-4c9367dc0958"),
    ]);
    let key = h
        .verify_at(&ok, b"Hello, World!", SystemTime::now())
        .expect("verified");
    assert_eq!(key.as_str(), "72d3162e-cc78-11e3-81ab-4c9367dc0958");
    assert!(!h.scheme().has_timestamp());
    let bare = headers(&[
        (
            "x-hub-signature-256",
            "757107ea0eb2509fc211221cce984b8a37570b6d7586c22c46f4379c8b043e17",
        ),
        ("x-github-delivery", "1"),
    ]);
    assert_eq!(
        refused(h.verify(&bare, b"Hello, World!")),
        Refused::SignatureMalformed
    );
    let mut no_id = ok.clone();
    no_id.remove("x-github-delivery");
    assert_eq!(
        refused(h.verify(&no_id, b"Hello, World!")),
        Refused::IdMissing
    );
    let mut bad_id = ok.clone();
    bad_id.insert("x-github-delivery", HeaderValue::from_static("a b"));
    assert_eq!(
        refused(h.verify(&bad_id, b"Hello, World!")),
        Refused::IdInvalid
    );
    assert_eq!(
        refused(h.verify(&ok, b"Hello, World?")),
        Refused::SignatureInvalid
    );
}

#[test]
fn shopify_base64_over_the_body() {
    let h = hook(Provider::Shopify, &["shpss_test"]);
    let ok = headers(&[
        (
            "x-shopify-hmac-sha256",
            "1GxccvotnkOedTjSm8S0m/VA3yAUKshyqT52ccNYHj4=",
        ),
        (
            "x-shopify-webhook-id",
            "b54557e4-bdd9-4b37-8a5f-bf7d70bcd043",
        ),
    ]);
    assert!(h.verify(&ok, br#"{"id":1}"#).is_ok());
    let hexed = headers(&[
        ("x-shopify-hmac-sha256", "not base64!"),
        ("x-shopify-webhook-id", "1"),
    ]);
    assert_eq!(
        refused(h.verify(&hexed, br#"{"id":1}"#)),
        Refused::SignatureMalformed
    );
}

#[test]
fn a_generic_scheme_as_slack_signs() {
    let body = br#"{"event_id":"Ev1","type":"event_callback"}"#;
    let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, b"8f742231b10e8888abcd99yyyzzz85a5");
    let tag = ring::hmac::sign(&key, &[b"v0:1531420618:".as_slice(), body].concat());
    let scheme = Scheme::hmac(
        HeaderName::from_static("x-slack-signature"),
        IdSource::Field("/event_id".parse().expect("pointer")),
    )
    .with_prefix("v0=")
    .with_signed("v0:{timestamp}:{body}".parse().expect("template"))
    .with_timestamp_header(HeaderName::from_static("x-slack-request-timestamp"));
    assert!(scheme.has_timestamp());
    let secret = Secret::parse("8f742231b10e8888abcd99yyyzzz85a5", SecretForm::Text).expect("s");
    let h = Webhook::new(Provider::Hmac, scheme, vec![secret])
        .expect("webhook")
        .with_sender("slack-acme")
        .expect("sender");
    assert_eq!(h.tenant(), "webhook:slack-acme");
    let sig = format!("v0={}", hex::encode(tag.as_ref()));
    let ok = headers(&[
        ("x-slack-signature", &sig),
        ("x-slack-request-timestamp", "1531420618"),
    ]);
    let key = h.verify_at(&ok, body, at(1_531_420_618)).expect("verified");
    assert_eq!(key.as_str(), "Ev1");
    assert_eq!(
        refused(h.verify_at(&ok, body, at(1_531_420_618 + 301))),
        Refused::TimestampStale
    );
}

#[test]
fn templates_and_schemes_that_cannot_work_are_refused() {
    assert!("{id}.{timestamp}.{body}".parse::<Signed>().is_ok());
    assert!("{timestamp}".parse::<Signed>().is_err());
    assert!("{body}{body}".parse::<Signed>().is_err());
    assert!("{body}{nonce}".parse::<Signed>().is_err());
    assert!("{body".parse::<Signed>().is_err());
    let id_in_body = Scheme::hmac(
        HeaderName::from_static("x-sig"),
        IdSource::Field("/id".parse().expect("pointer")),
    )
    .with_signed("{id}.{body}".parse().expect("template"));
    assert!(id_in_body.check().is_err());
    let no_ts = Scheme::hmac(
        HeaderName::from_static("x-sig"),
        IdSource::Header(vec![HeaderName::from_static("x-id")]),
    )
    .with_signed("{timestamp}.{body}".parse().expect("template"));
    assert!(no_ts.check().is_err());
    let secret = Secret::parse("s", SecretForm::Text).expect("s");
    assert!(Webhook::new(Provider::Hmac, no_ts, vec![secret.clone()]).is_err());
    assert!(Webhook::for_provider(Provider::Hmac, vec![secret.clone()]).is_err());
    assert!(Webhook::for_provider(Provider::Github, Vec::new()).is_err());
    let github = Webhook::for_provider(Provider::Github, vec![secret]).expect("webhook");
    assert!(github.clone().with_sender("a b").is_err());
    assert!(github.with_sender(&"x".repeat(65)).is_err());
}

#[test]
fn secrets_are_never_shown() {
    assert!(Secret::parse("  ", SecretForm::Text).is_err());
    let err = Secret::parse("whsec_!!not-base64!!", SecretForm::Base64).expect_err("refused");
    assert!(!err.to_string().contains("not-base64"), "{err}");
    let s = Secret::parse("sekrit-value", SecretForm::Text).expect("s");
    assert!(!format!("{s:?}").contains("sekrit"));
    let h = hook(Provider::Github, &["sekrit-value"]);
    assert!(!format!("{h:?}").contains("sekrit"));
    let forged = headers(&[
        ("x-hub-signature-256", "sha256=00ff"),
        ("x-github-delivery", "1"),
    ]);
    let refusal = h.verify(&forged, b"{}").expect_err("refused");
    assert!(!refusal.detail().contains("00ff"), "{}", refusal.detail());
    assert_eq!(refusal.problem().status().as_u16(), 401);
}

#[test]
fn provider_names_windows_and_problems() {
    for p in Provider::ALL {
        assert_eq!(p.name().parse::<Provider>(), Ok(p));
    }
    assert!("svix".parse::<Provider>().is_err());
    assert_eq!(
        Provider::Stripe.retry_window(),
        Duration::from_secs(3 * 86400)
    );
    assert_eq!(
        Refused::TimestampStale.kind().default_status().as_u16(),
        401
    );
    assert_eq!(Refused::IdMissing.kind().default_status().as_u16(), 400);
    assert_eq!(Refused::ALL.len(), 9);
    for (i, r) in Refused::ALL.iter().enumerate() {
        assert_eq!(*r as usize, i, "ALL is in declaration order");
    }
}
