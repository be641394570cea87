//! Rows this build cannot read (written by hand, by another program, or
//! damaged) are `StoreError::Corrupt`, never a panic.

use crate::common;

use std::time::Duration;

use idem::{
    FinalOutcome, Fingerprint, IdempotencyKey, LeaseExpiry, ListFilter, ListRecords, OwnerToken,
    Reservation, ReserveRequest, Scope, Store, StoreError, StoredResponse, Verdict,
};

#[tokio::test]
async fn unreadable_rows_are_corrupt_errors() {
    let Some(t) = common::Isolated::new("corrupt").await else {
        return;
    };
    let store = &t.store;
    let scope = Scope::new("acme", "op").expect("scope");
    let key: IdempotencyKey = "k-1".parse().expect("key");
    let fingerprint = Fingerprint::builder().part("k", b"1").finish();
    let req = || ReserveRequest {
        scope: &scope,
        key: &key,
        fingerprint,
        owner: OwnerToken::random(),
        lease: Duration::from_secs(30),
        retention: Duration::from_secs(3600),
        on_lease_expiry: LeaseExpiry::Retry,
    };
    let Reservation::Acquired(lease) = store.reserve(req()).await.expect("reserve") else {
        panic!("acquired");
    };
    let outcome = FinalOutcome {
        verdict: Verdict::Completed,
        response: StoredResponse::new(200, "ok"),
        resource_id: None,
        error_code: None,
        retention: Duration::from_secs(3600),
    };
    store
        .resolve(&scope, &key, &lease, &outcome)
        .await
        .expect("resolve");

    let is_corrupt = |result: Result<_, StoreError>, what: &str| match result {
        Err(StoreError::Corrupt(err)) => eprintln!("{what}: {err}"),
        other => panic!("{what}: expected a corrupt error, got {other:?}"),
    };

    // Stored headers that do not decode.
    damage(
        store,
        "UPDATE idem_records SET response_headers = x'00ff41'",
    )
    .await;
    is_corrupt(store.get(&scope, &key).await.map(|_| ()), "headers, get");
    is_corrupt(store.reserve(req()).await.map(|_| ()), "headers, reserve");
    damage(store, "UPDATE idem_records SET response_headers = NULL").await;

    // A status out of range.
    damage(store, "UPDATE idem_records SET response_status = 70000").await;
    is_corrupt(store.get(&scope, &key).await.map(|_| ()), "status");
    damage(store, "UPDATE idem_records SET response_status = 200").await;

    // Repaired, the row reads again.
    assert!(
        store
            .get(&scope, &key)
            .await
            .expect("readable again")
            .is_some()
    );

    // A key that is not UTF-8, found only by listing.
    damage(store, "UPDATE idem_records SET idem_key = x'ff6b'").await;
    is_corrupt(
        store
            .list(&ListFilter {
                limit: 10,
                ..ListFilter::default()
            })
            .await
            .map(|_| ()),
        "key, list",
    );
    // A key that is UTF-8 but not a valid idempotency key (a control byte).
    damage(store, "UPDATE idem_records SET idem_key = x'6b07'").await;
    is_corrupt(
        store
            .list(&ListFilter {
                limit: 10,
                ..ListFilter::default()
            })
            .await
            .map(|_| ()),
        "key with a control byte, list",
    );
}

/// Writes over the test's one record by hand.
async fn damage(store: &idem_mysql::MySqlStore, sql: &str) {
    sqlx::query(sql)
        .execute(store.pool())
        .await
        .expect("damage the row");
}
