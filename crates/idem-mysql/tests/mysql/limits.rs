//! The store's limits: an answer larger than the server's
//! `max_allowed_packet` is refused as a lasting store error (retrying
//! cannot help), never stored cut short, and the record stays in progress
//! for its owner; so is a resource id longer than its column; leases and
//! retentions are capped at a hundred years.

use crate::common;

use std::time::Duration;

use idem::{
    FinalOutcome, Fingerprint, IdempotencyKey, LeaseExpiry, OwnerToken, RecordState, Reservation,
    ReserveRequest, Scope, Store, StoreError, StoredResponse, Verdict,
};

#[tokio::test]
async fn an_answer_over_max_allowed_packet_is_refused_whole() {
    let Some(t) = common::Isolated::new("limits").await else {
        return;
    };
    let store = &t.store;
    let packet: i64 = sqlx::query_scalar("SELECT CAST(@@max_allowed_packet AS SIGNED)")
        .fetch_one(store.pool())
        .await
        .expect("max_allowed_packet");
    let scope = Scope::new("acme", "op").expect("scope");
    let key: IdempotencyKey = "big".parse().expect("key");
    let Reservation::Acquired(lease) = store
        .reserve(ReserveRequest {
            scope: &scope,
            key: &key,
            fingerprint: Fingerprint::builder().part("k", b"big").finish(),
            owner: OwnerToken::random(),
            lease: Duration::from_secs(60),
            retention: Duration::from_secs(3600),
            on_lease_expiry: LeaseExpiry::Retry,
        })
        .await
        .expect("reserve")
    else {
        panic!("acquired");
    };
    let body = vec![b'x'; usize::try_from(packet).expect("size") + 1];
    let outcome = |body: Vec<u8>| FinalOutcome {
        verdict: Verdict::Completed,
        response: StoredResponse::new(200, body),
        resource_id: None,
        error_code: None,
        retention: Duration::from_secs(3600),
    };
    let err = store
        .resolve(&scope, &key, &lease, &outcome(body))
        .await
        .expect_err("larger than max_allowed_packet");
    assert!(
        matches!(err, StoreError::Backend(_)) && !err.is_transient(),
        "{err}"
    );
    let record = store.get(&scope, &key).await.expect("get").expect("record");
    assert_eq!(record.state, RecordState::Processing, "nothing stored");
    assert_eq!(record.response, None);
    store
        .resolve(&scope, &key, &lease, &outcome(b"small".to_vec()))
        .await
        .expect("a smaller answer is stored");
    let record = store.get(&scope, &key).await.expect("get").expect("record");
    assert_eq!(record.state, RecordState::Completed);
}

#[tokio::test]
async fn the_longest_durations_are_capped_at_a_hundred_years() {
    let Some(t) = common::Isolated::new("limits_long").await else {
        return;
    };
    let store = &t.store;
    let scope = Scope::new("acme", "op").expect("scope");
    let key: IdempotencyKey = "forever".parse().expect("key");
    let Reservation::Acquired(lease) = store
        .reserve(ReserveRequest {
            scope: &scope,
            key: &key,
            fingerprint: Fingerprint::builder().part("k", b"forever").finish(),
            owner: OwnerToken::random(),
            lease: Duration::MAX,
            retention: Duration::MAX,
            on_lease_expiry: LeaseExpiry::Retry,
        })
        .await
        .expect("reserve with the longest durations")
    else {
        panic!("acquired");
    };
    let record = store.get(&scope, &key).await.expect("get").expect("record");
    let century_ms = 100 * 365 * 86_400 * 1_000;
    assert_eq!(
        lease.locked_until.as_millis() - record.created_at.as_millis(),
        century_ms
    );
    assert_eq!(
        record.expires_at.as_millis() - record.created_at.as_millis(),
        century_ms
    );
    let renewed = store
        .renew(&scope, &key, &lease, Duration::MAX)
        .await
        .expect("renew");
    assert!(renewed >= lease.locked_until);
}

#[tokio::test]
async fn a_resource_id_over_its_column_is_refused_not_cut_short() {
    let Some(t) = common::Isolated::new("limits_text").await else {
        return;
    };
    let store = &t.store;
    let scope = Scope::new("acme", "op").expect("scope");
    let key: IdempotencyKey = "long-id".parse().expect("key");
    let Reservation::Acquired(lease) = store
        .reserve(ReserveRequest {
            scope: &scope,
            key: &key,
            fingerprint: Fingerprint::builder().part("k", b"long-id").finish(),
            owner: OwnerToken::random(),
            lease: Duration::from_secs(60),
            retention: Duration::from_secs(3600),
            on_lease_expiry: LeaseExpiry::Retry,
        })
        .await
        .expect("reserve")
    else {
        panic!("acquired");
    };
    // TEXT holds 65,535 bytes; the server's strict mode (its default)
    // refuses more rather than truncating.
    let outcome = FinalOutcome {
        verdict: Verdict::Completed,
        response: StoredResponse::new(201, "created"),
        resource_id: Some("r".repeat(65_536)),
        error_code: None,
        retention: Duration::from_secs(3600),
    };
    let err = store
        .resolve(&scope, &key, &lease, &outcome)
        .await
        .expect_err("longer than TEXT");
    assert!(!err.is_transient(), "{err}");
    let record = store.get(&scope, &key).await.expect("get").expect("record");
    assert_eq!(record.state, RecordState::Processing, "nothing stored");
}
