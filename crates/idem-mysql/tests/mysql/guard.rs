//! The ordering guard on a real server: versions applied in order and
//! once, per consumer and aggregate type, a rollback advancing nothing,
//! and concurrent deliveries of one aggregate serialised.

use crate::common;

use idem_mysql::MessagingError;
use idem_mysql::guard::{Order, OrderingGuard};

async fn check(pool: &sqlx::MySqlPool, consumer: &str, kind: &str, id: &str, v: i64) -> Order {
    let mut tx = pool.begin().await.expect("begin");
    let order = OrderingGuard::check(&mut tx, consumer, kind, id, v)
        .await
        .expect("check");
    tx.commit().await.expect("commit");
    order
}

#[tokio::test]
async fn versions_apply_in_order_and_once() {
    let Some(t) = common::Isolated::new("guard").await else {
        return;
    };
    let pool = t.store.pool();
    assert_eq!(
        check(pool, "billing", "order", "o-1", 2).await,
        Order::Gap { expected: 1 },
        "an aggregate never seen starts at 0"
    );
    assert_eq!(
        check(pool, "billing", "order", "o-1", 1).await,
        Order::Apply
    );
    assert_eq!(
        check(pool, "billing", "order", "o-1", 1).await,
        Order::Stale { last: 1 }
    );
    assert_eq!(
        check(pool, "billing", "order", "o-1", 2).await,
        Order::Apply
    );
    assert_eq!(
        check(pool, "billing", "order", "o-1", 4).await,
        Order::Gap { expected: 3 }
    );
    // Another consumer, another aggregate type, another case: their own.
    assert_eq!(
        check(pool, "shipping", "order", "o-1", 1).await,
        Order::Apply
    );
    assert_eq!(
        check(pool, "billing", "payment", "o-1", 1).await,
        Order::Apply
    );
    assert_eq!(
        check(pool, "billing", "order", "O-1", 1).await,
        Order::Apply
    );

    // Rolled back: the version is not recorded.
    let mut tx = pool.begin().await.expect("begin");
    assert_eq!(
        OrderingGuard::check(&mut tx, "billing", "order", "o-1", 3)
            .await
            .expect("check"),
        Order::Apply
    );
    tx.rollback().await.expect("rollback");
    assert_eq!(
        check(pool, "billing", "order", "o-1", 3).await,
        Order::Apply
    );

    let mut tx = pool.begin().await.expect("begin");
    for (consumer, kind, id, version) in [("", "t", "i", 1), ("c", "t", "i", 0)] {
        let err = OrderingGuard::check(&mut tx, consumer, kind, id, version)
            .await
            .expect_err("refused");
        assert!(
            matches!(err, MessagingError::InvalidMessage { .. }),
            "{err}"
        );
    }
    tx.rollback().await.expect("rollback");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_deliveries_of_one_version_apply_it_once() {
    let Some(t) = common::Isolated::new("guard_race").await else {
        return;
    };
    let pool = t.store.pool().clone();
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..8 {
        let pool = pool.clone();
        tasks.spawn(async move {
            loop {
                let mut tx = pool.begin().await.expect("begin");
                match OrderingGuard::check(&mut tx, "billing", "order", "new", 1).await {
                    Ok(order) => {
                        tx.commit().await.expect("commit");
                        return order;
                    }
                    // Should InnoDB break a lock cycle, the transaction
                    // is gone: handle the delivery again, as a consumer
                    // does.
                    Err(err) if err.is_transient() => continue,
                    Err(err) => panic!("{err}"),
                }
            }
        });
    }
    let mut applied = 0;
    while let Some(order) = tasks.join_next().await {
        match order.expect("join") {
            Order::Apply => applied += 1,
            Order::Stale { last: 1 } => {}
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(applied, 1, "one delivery applies version 1");
}
