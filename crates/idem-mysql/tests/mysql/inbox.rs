//! The transactional inbox on a real server: an id recorded with the
//! change or not at all, duplicates seen, racing deliveries serialised,
//! old ids purged.

use crate::common;

use std::time::Duration;

use idem_mysql::MessagingError;
use idem_mysql::inbox::{Inbox, InboxOutcome, MAX_ID_LEN};

async fn applied(pool: &sqlx::MySqlPool) -> i64 {
    sqlx::query_scalar("SELECT COUNT(*) FROM applied")
        .fetch_one(pool)
        .await
        .expect("count")
}

#[tokio::test]
async fn a_message_is_applied_once_and_a_rollback_forgets_it() {
    let Some(t) = common::Isolated::new("inbox").await else {
        return;
    };
    let pool = t.store.pool();
    sqlx::query("CREATE TABLE applied (id INT AUTO_INCREMENT PRIMARY KEY) ENGINE = InnoDB")
        .execute(pool)
        .await
        .expect("create");

    // First delivery, rolled back: neither the id nor the change stays.
    let mut tx = pool.begin().await.expect("begin");
    assert_eq!(
        Inbox::process(&mut tx, "orders", "msg-1", Some("order-7"))
            .await
            .expect("process"),
        InboxOutcome::Fresh
    );
    sqlx::query("INSERT INTO applied () VALUES ()")
        .execute(&mut *tx)
        .await
        .expect("change");
    tx.rollback().await.expect("rollback");
    assert_eq!(applied(pool).await, 0);

    // Redelivered: fresh again, committed with its change.
    let mut tx = pool.begin().await.expect("begin");
    assert_eq!(
        Inbox::process(&mut tx, "orders", "msg-1", Some("order-7"))
            .await
            .expect("process"),
        InboxOutcome::Fresh
    );
    sqlx::query("INSERT INTO applied () VALUES ()")
        .execute(&mut *tx)
        .await
        .expect("change");
    tx.commit().await.expect("commit");

    // Redelivered after the commit: a duplicate, and the transaction
    // goes on (the duplicate-key error rolled back only its statement).
    let mut tx = pool.begin().await.expect("begin");
    assert_eq!(
        Inbox::process(&mut tx, "orders", "msg-1", None)
            .await
            .expect("process"),
        InboxOutcome::Duplicate
    );
    assert_eq!(
        Inbox::process(&mut tx, "orders", "msg-2", None)
            .await
            .expect("the transaction is still usable"),
        InboxOutcome::Fresh
    );
    tx.commit().await.expect("commit");
    assert_eq!(applied(pool).await, 1);

    // Ids are per consumer, and compared byte by byte.
    let mut tx = pool.begin().await.expect("begin");
    for (consumer, id) in [
        ("billing", "msg-1"),
        ("orders", "MSG-1"),
        ("orders", "msg-1 "),
    ] {
        assert_eq!(
            Inbox::process(&mut tx, consumer, id, None)
                .await
                .expect("process"),
            InboxOutcome::Fresh,
            "{consumer}/{id:?}"
        );
    }
    tx.commit().await.expect("commit");
}

#[tokio::test]
async fn racing_deliveries_of_one_id_serialise() {
    let Some(t) = common::Isolated::new("inbox_race").await else {
        return;
    };
    let pool = t.store.pool().clone();
    let mut first = pool.begin().await.expect("begin");
    assert_eq!(
        Inbox::process(&mut first, "orders", "msg-9", None)
            .await
            .expect("process"),
        InboxOutcome::Fresh
    );
    let second = tokio::spawn({
        let pool = pool.clone();
        async move {
            let mut tx = pool.begin().await.expect("begin");
            let outcome = Inbox::process(&mut tx, "orders", "msg-9", None).await;
            tx.commit().await.expect("commit");
            outcome
        }
    });
    tokio::task::yield_now().await;
    first.commit().await.expect("commit");
    assert_eq!(
        second.await.expect("join").expect("process"),
        InboxOutcome::Duplicate,
        "the second delivery waited for the first and saw its id"
    );
}

#[tokio::test]
async fn bad_ids_are_refused_and_old_ids_purged() {
    let Some(t) = common::Isolated::new("inbox_purge").await else {
        return;
    };
    let pool = t.store.pool();
    let mut tx = pool.begin().await.expect("begin");
    let long = "x".repeat(MAX_ID_LEN + 1);
    for (consumer, id) in [("", "m"), ("orders", ""), ("orders", long.as_str())] {
        let err = Inbox::process(&mut tx, consumer, id, None)
            .await
            .expect_err("refused");
        assert!(
            matches!(err, MessagingError::InvalidMessage { .. }),
            "{err}"
        );
        assert!(!err.is_transient());
    }
    for (consumer, id) in [("a", "1"), ("a", "2"), ("b", "1")] {
        Inbox::process(&mut tx, consumer, id, None)
            .await
            .expect("process");
    }
    tx.commit().await.expect("commit");
    // Backdate them a day (processed_at is the server's time).
    sqlx::query("UPDATE idem_inbox SET processed_at = processed_at - INTERVAL 1 DAY")
        .execute(pool)
        .await
        .expect("backdate");
    let hour = Duration::from_secs(3600);
    assert_eq!(
        Inbox::purge_consumer_older_than(pool, "a", hour, 1)
            .await
            .expect("purge"),
        1,
        "at most the batch"
    );
    assert_eq!(
        Inbox::purge_older_than(pool, Duration::from_secs(3 * 86_400), 10)
            .await
            .expect("purge"),
        0,
        "younger than the retention"
    );
    assert_eq!(
        Inbox::purge_older_than(pool, hour, 10)
            .await
            .expect("purge"),
        2
    );
    let mut tx = pool.begin().await.expect("begin");
    assert_eq!(
        Inbox::process(&mut tx, "a", "1", None)
            .await
            .expect("process"),
        InboxOutcome::Fresh,
        "a purged id is new again"
    );
    tx.commit().await.expect("commit");
}
