//! Reservations and answers inside the caller's own transaction commit or
//! roll back together with the business change.

use crate::common;

use std::time::Duration;

use idem::{
    FinalOutcome, Fingerprint, LeaseExpiry, OwnerToken, RecordState, Reservation, ReserveRequest,
    Scope, Store, StoredResponse, Verdict,
};

fn request<'a>(scope: &'a Scope, key: &'a idem::IdempotencyKey) -> ReserveRequest<'a> {
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

async fn orders(store: &idem_postgres::PgStore) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM orders WHERE shipped")
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
    sqlx::query("CREATE TABLE orders (id int PRIMARY KEY, shipped bool NOT NULL)")
        .execute(store.pool())
        .await
        .expect("create business table");
    let scope = Scope::new("acme", "ship-order").expect("scope");
    let key: idem::IdempotencyKey = "order-17".parse().expect("key");

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
    assert_eq!(lease.attempt, 1);
    // Not visible outside the transaction before it commits.
    assert_eq!(store.get(&scope, &key).await.expect("get"), None);
    sqlx::query("INSERT INTO orders VALUES (17, true)")
        .execute(&mut *tx)
        .await
        .expect("business change");
    store
        .resolve_in(&mut tx, &scope, &key, &lease, &shipped())
        .await
        .expect("resolve in tx");
    tx.commit().await.expect("commit");
    let rec = store
        .get(&scope, &key)
        .await
        .expect("get")
        .expect("record committed");
    assert_eq!(rec.state, RecordState::Completed);
    assert_eq!(rec.resource_id.as_deref(), Some("order-17"));
    assert_eq!(orders(store).await, 1);

    // A retry replays instead of shipping again.
    let mut tx = store.pool().begin().await.expect("begin");
    match store
        .reserve_in(&mut tx, request(&scope, &key))
        .await
        .expect("reserve")
    {
        Reservation::Existing(rec) => {
            assert_eq!(rec.response.map(|r| r.body), Some("shipped".into()));
        }
        other => panic!("expected a replay, got {other:?}"),
    }
    tx.commit().await.expect("commit");
    t.drop_schema().await;
}

#[tokio::test]
async fn a_duplicate_waits_for_the_reserving_transaction() {
    let Some(t) = common::Isolated::new("txwait").await else {
        return;
    };
    let store = t.store.clone();
    let scope = Scope::new("acme", "ship-order").expect("scope");
    let key: idem::IdempotencyKey = "order-18".parse().expect("key");

    let mut tx = store.pool().begin().await.expect("begin");
    let Reservation::Acquired(lease) = store
        .reserve_in(&mut tx, request(&scope, &key))
        .await
        .expect("reserve in tx")
    else {
        panic!("first reservation is acquired");
    };
    let duplicate = {
        let (store, scope, key) = (store.clone(), scope.clone(), key.clone());
        tokio::spawn(async move { store.reserve(request(&scope, &key)).await })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!duplicate.is_finished(), "the duplicate waits on the row");
    store
        .resolve_in(&mut tx, &scope, &key, &lease, &shipped())
        .await
        .expect("resolve");
    tx.commit().await.expect("commit");
    match duplicate.await.expect("task").expect("reserve") {
        Reservation::Existing(rec) => assert_eq!(rec.state, RecordState::Completed),
        other => panic!("the duplicate replays the committed answer, got {other:?}"),
    }
    t.drop_schema().await;
}

#[tokio::test]
async fn in_transaction_calls_run_in_spawned_tasks() {
    let Some(t) = common::Isolated::new("txspawn").await else {
        return;
    };
    let store = t.store.clone();
    // The futures are Send: a service can spawn its handler as a task.
    let answer = tokio::spawn(async move {
        let scope = Scope::new("acme", "ship-order").expect("scope");
        let key: idem::IdempotencyKey = "order-19".parse().expect("key");
        let mut tx = store.pool().begin().await.expect("begin");
        let Reservation::Acquired(lease) = store
            .reserve_in(&mut tx, request(&scope, &key))
            .await
            .expect("reserve")
        else {
            panic!("acquired");
        };
        store
            .resolve_in(&mut tx, &scope, &key, &lease, &shipped())
            .await
            .expect("resolve");
        tx.commit().await.expect("commit");
        store.get(&scope, &key).await.expect("get")
    })
    .await
    .expect("task");
    assert_eq!(answer.map(|r| r.state), Some(RecordState::Completed));
    t.drop_schema().await;
}
