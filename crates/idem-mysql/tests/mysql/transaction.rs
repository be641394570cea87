//! Reservations and answers inside the caller's own transaction commit or
//! roll back together with the business change.

use crate::common;

use std::time::Duration;

use idem::{
    FinalOutcome, Fingerprint, IdempotencyKey, LeaseExpiry, OwnerToken, RecordState, Reservation,
    ReserveRequest, Scope, Store, StoredResponse, Verdict,
};
use idem_mysql::MySqlStore;

fn request<'a>(scope: &'a Scope, key: &'a IdempotencyKey) -> ReserveRequest<'a> {
    ReserveRequest {
        scope,
        key,
        fingerprint: Fingerprint::builder().part("order", b"17").finish(),
        owner: OwnerToken::random(),
        lease: Duration::from_secs(30),
        retention: Duration::from_secs(3600),
        on_lease_expiry: LeaseExpiry::Retry,
    }
}

fn shipped() -> FinalOutcome {
    FinalOutcome {
        verdict: Verdict::Completed,
        response: StoredResponse::new(200, "shipped"),
        resource_id: Some("order-17".to_owned()),
        error_code: None,
        retention: Duration::from_secs(3600),
    }
}

async fn orders(store: &MySqlStore) -> i64 {
    sqlx::query_scalar("SELECT COUNT(*) FROM orders WHERE shipped")
        .fetch_one(store.pool())
        .await
        .expect("count orders")
}

#[tokio::test]
async fn rollback_leaves_nothing_commit_keeps_both() {
    let Some(t) = common::Isolated::new("tx").await else {
        return;
    };
    let store = &t.store;
    sqlx::query("CREATE TABLE orders (id INT PRIMARY KEY, shipped BOOL NOT NULL) ENGINE = InnoDB")
        .execute(store.pool())
        .await
        .expect("create business table");
    let scope = Scope::new("acme", "ship-order").expect("scope");
    let key: IdempotencyKey = "order-17".parse().expect("key");

    // Rolled back: neither the reservation, nor the answer, nor the order.
    let mut tx = store.pool().begin().await.expect("begin");
    let Reservation::Acquired(lease) = store
        .reserve_in(&mut tx, request(&scope, &key))
        .await
        .expect("reserve in tx")
    else {
        panic!("first reservation is acquired");
    };
    sqlx::query("INSERT INTO orders VALUES (17, true)")
        .execute(&mut *tx)
        .await
        .expect("business change");
    store
        .resolve_in(&mut tx, &scope, &key, &lease, &shipped())
        .await
        .expect("resolve in tx");
    tx.rollback().await.expect("rollback");
    assert_eq!(store.get(&scope, &key).await.expect("get"), None);
    assert_eq!(orders(store).await, 0);

    // Committed: the record (completed, with its answer) and the order.
    let mut tx = store.pool().begin().await.expect("begin");
    let Reservation::Acquired(lease) = store
        .reserve_in(&mut tx, request(&scope, &key))
        .await
        .expect("reserve in tx")
    else {
        panic!("the key is free again after the rollback");
    };
    sqlx::query("INSERT INTO orders VALUES (17, true)")
        .execute(&mut *tx)
        .await
        .expect("business change");
    store
        .resolve_in(&mut tx, &scope, &key, &lease, &shipped())
        .await
        .expect("resolve in tx");
    tx.commit().await.expect("commit");
    let record = store.get(&scope, &key).await.expect("get").expect("record");
    assert_eq!(record.state, RecordState::Completed);
    assert_eq!(
        record.response.expect("answer").body.as_ref(),
        b"shipped".as_slice()
    );
    assert_eq!(orders(store).await, 1);

    // A retry outside the transaction replays the committed answer.
    match store.reserve(request(&scope, &key)).await.expect("reserve") {
        Reservation::Existing(record) => assert_eq!(record.state, RecordState::Completed),
        other => panic!("expected a replay, got {other:?}"),
    }
}

/// A reservation held by an open transaction keeps a concurrent duplicate
/// waiting; once the transaction commits, the duplicate sees the record
/// in progress; a release inside a transaction frees the key only when it
/// commits.
#[tokio::test]
async fn a_duplicate_waits_for_the_transaction_then_sees_its_record() {
    let Some(t) = common::Isolated::new("tx_wait").await else {
        return;
    };
    let store = t.store.clone();
    let scope = Scope::new("acme", "ship-order").expect("scope");
    let key: IdempotencyKey = "order-18".parse().expect("key");
    let mut tx = store.pool().begin().await.expect("begin");
    let Reservation::Acquired(lease) = store
        .reserve_in(&mut tx, request(&scope, &key))
        .await
        .expect("reserve in tx")
    else {
        panic!("acquired");
    };
    let (started_tx, started) = tokio::sync::oneshot::channel();
    let duplicate = tokio::spawn({
        let (store, scope, key) = (store.clone(), scope.clone(), key.clone());
        async move {
            let _ = started_tx.send(());
            store.reserve(request(&scope, &key)).await
        }
    });
    started.await.expect("the duplicate started");
    tokio::task::yield_now().await;
    assert!(
        !duplicate.is_finished(),
        "the duplicate waits on the uncommitted row"
    );
    tx.commit().await.expect("commit");
    match duplicate.await.expect("join").expect("reserve") {
        Reservation::InProgress { .. } => {}
        other => panic!("expected the committed record in progress, got {other:?}"),
    }

    let mut tx = store.pool().begin().await.expect("begin");
    store
        .release_in(&mut tx, &scope, &key, &lease)
        .await
        .expect("release in tx");
    tx.rollback().await.expect("rollback");
    assert!(
        store.get(&scope, &key).await.expect("get").is_some(),
        "a rolled-back release keeps the record"
    );
    let mut tx = store.pool().begin().await.expect("begin");
    store
        .release_in(&mut tx, &scope, &key, &lease)
        .await
        .expect("release in tx");
    tx.commit().await.expect("commit");
    assert_eq!(store.get(&scope, &key).await.expect("get"), None);
}
