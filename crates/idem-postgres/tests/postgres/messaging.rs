//! The inbox, the outbox and the ordering guard against a real PostgreSQL,
//! each in a schema of its own: redeliveries change nothing twice, events
//! commit with their change and are numbered in commit order per
//! aggregate, and out-of-order versions are applied in order.

use crate::common;

use idem_postgres::MessagingError;
use idem_postgres::guard::{Order, OrderingGuard};
use idem_postgres::inbox::{Inbox, InboxOutcome};
use idem_postgres::outbox::{Outbox, OutboxMessage};
use sqlx::{PgPool, Row};

async fn exec(pool: &PgPool, sql: &str) {
    sqlx::query(sql)
        .execute(pool)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
}

async fn count(pool: &PgPool, sql: &str) -> i64 {
    sqlx::query_scalar(sql)
        .fetch_one(pool)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"))
}

/// One delivery of a "payment authorized" message to the order service:
/// inbox check and business change in one transaction.
async fn deliver(pool: &PgPool, message_id: &str, order: &str) -> InboxOutcome {
    let mut tx = pool.begin().await.expect("begin");
    let outcome = Inbox::process(&mut tx, "orders", message_id, Some(order))
        .await
        .expect("inbox");
    if outcome == InboxOutcome::Fresh {
        sqlx::query("UPDATE orders SET paid_count = paid_count + 1 WHERE id = $1")
            .bind(order)
            .execute(&mut *tx)
            .await
            .expect("business change");
    }
    tx.commit().await.expect("commit");
    outcome
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn redeliveries_change_nothing_twice() {
    let Some(t) = common::Isolated::new("inbox").await else {
        return;
    };
    let pool = t.store.pool().clone();
    exec(
        &pool,
        "CREATE TABLE orders (id text PRIMARY KEY, paid_count int NOT NULL)",
    )
    .await;
    exec(&pool, "INSERT INTO orders VALUES ('o-1', 0), ('o-2', 0)").await;

    assert_eq!(deliver(&pool, "m-1", "o-1").await, InboxOutcome::Fresh);
    // The consumer crashed after commit, before its ack: the broker
    // redelivers, and the redelivery is a duplicate.
    assert_eq!(deliver(&pool, "m-1", "o-1").await, InboxOutcome::Duplicate);
    assert_eq!(
        count(
            &pool,
            "SELECT paid_count::bigint FROM orders WHERE id = 'o-1'"
        )
        .await,
        1
    );

    // A transaction that rolls back (a crash before commit) leaves no
    // trace: the redelivery is processed.
    let mut tx = pool.begin().await.expect("begin");
    assert_eq!(
        Inbox::process(&mut tx, "orders", "m-2", Some("o-2"))
            .await
            .expect("inbox"),
        InboxOutcome::Fresh
    );
    tx.rollback().await.expect("rollback");
    assert_eq!(deliver(&pool, "m-2", "o-2").await, InboxOutcome::Fresh);

    // Twenty deliveries of one message at once: one applies it.
    let mut tasks = tokio::task::JoinSet::new();
    exec(&pool, "INSERT INTO orders VALUES ('o-3', 0)").await;
    for _ in 0..20 {
        let pool = pool.clone();
        tasks.spawn(async move { deliver(&pool, "m-3", "o-3").await });
    }
    let mut fresh = 0;
    while let Some(done) = tasks.join_next().await {
        fresh += usize::from(done.expect("task") == InboxOutcome::Fresh);
    }
    assert_eq!(fresh, 1);
    assert_eq!(
        count(
            &pool,
            "SELECT paid_count::bigint FROM orders WHERE id = 'o-3'"
        )
        .await,
        1
    );

    // Consumers are independent; ids are checked.
    let mut tx = pool.begin().await.expect("begin");
    assert_eq!(
        Inbox::process(&mut tx, "billing", "m-1", None)
            .await
            .expect("inbox"),
        InboxOutcome::Fresh
    );
    for (consumer, id) in [("", "m"), ("orders", ""), ("orders", &"x".repeat(300))] {
        let err = Inbox::process(&mut tx, consumer, id, None)
            .await
            .expect_err("refused");
        assert!(
            matches!(err, MessagingError::InvalidMessage { .. }),
            "{err}"
        );
    }
    tx.commit().await.expect("commit");

    // Retention: nothing is younger than an hour; everything is older than 0.
    assert_eq!(
        Inbox::purge_older_than(&pool, std::time::Duration::from_secs(3600), 100)
            .await
            .expect("purge"),
        0
    );
    // One consumer's rows only.
    assert_eq!(
        Inbox::purge_consumer_older_than(&pool, "billing", std::time::Duration::ZERO, 100)
            .await
            .expect("purge"),
        1
    );
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM idem_inbox WHERE consumer = 'billing'"
        )
        .await,
        0
    );
    assert_eq!(
        Inbox::purge_older_than(&pool, std::time::Duration::ZERO, 2)
            .await
            .expect("purge"),
        2
    );
    assert_eq!(count(&pool, "SELECT count(*) FROM idem_inbox").await, 1);
    t.drop_schema().await;
}

/// The same business event published twice under different message ids
/// passes the inbox twice; the business table's own unique constraint is
/// what stops the second application (the pattern the reference Order
/// service uses for "one payment per order").
#[tokio::test]
async fn a_business_unique_constraint_stops_a_republished_event() {
    let Some(t) = common::Isolated::new("business").await else {
        return;
    };
    let pool = t.store.pool().clone();
    exec(
        &pool,
        "CREATE TABLE payments_applied (payment_id text PRIMARY KEY, order_id text NOT NULL)",
    )
    .await;
    let apply = |message_id: &'static str| {
        let pool = pool.clone();
        async move {
            let mut tx = pool.begin().await.expect("begin");
            if Inbox::process(&mut tx, "orders", message_id, Some("o-1"))
                .await
                .expect("inbox")
                == InboxOutcome::Duplicate
            {
                return "duplicate message";
            }
            let inserted = sqlx::query(
                "INSERT INTO payments_applied VALUES ('pay_1', 'o-1') ON CONFLICT (payment_id) DO NOTHING",
            )
            .execute(&mut *tx)
            .await
            .expect("insert")
            .rows_affected();
            tx.commit().await.expect("commit");
            if inserted == 1 {
                "applied"
            } else {
                "same payment already applied"
            }
        }
    };
    assert_eq!(apply("outbox-17").await, "applied");
    assert_eq!(apply("outbox-99").await, "same payment already applied");
    assert_eq!(apply("outbox-17").await, "duplicate message");
    assert_eq!(
        count(&pool, "SELECT count(*) FROM payments_applied").await,
        1
    );
    t.drop_schema().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn outbox_rows_commit_with_their_change_in_sequence() {
    let Some(t) = common::Isolated::new("outbox").await else {
        return;
    };
    let pool = t.store.pool().clone();
    let msg = |agg: &str, kind: &str| {
        OutboxMessage::new(
            "payment",
            agg,
            kind,
            r#"{"amount_cents":100,"currency":"EUR"}"#,
        )
        .expect("valid")
    };

    // Rolled back: no row, and its sequence number is given out again.
    let mut tx = pool.begin().await.expect("begin");
    Outbox::enqueue(&mut tx, &msg("pay_1", "PaymentAuthorized"))
        .await
        .expect("enqueue");
    tx.rollback().await.expect("rollback");
    assert_eq!(count(&pool, "SELECT count(*) FROM idem_outbox").await, 0);

    let mut tx = pool.begin().await.expect("begin");
    let a1 = Outbox::enqueue(&mut tx, &msg("pay_1", "PaymentAuthorized"))
        .await
        .expect("enqueue");
    let a2 = Outbox::enqueue(
        &mut tx,
        &msg("pay_1", "PaymentCaptured")
            .with_header("trace-id", "t-1")
            .expect("header"),
    )
    .await
    .expect("enqueue");
    let b1 = Outbox::enqueue(&mut tx, &msg("pay_2", "PaymentAuthorized"))
        .await
        .expect("enqueue");
    tx.commit().await.expect("commit");
    assert_eq!((a1.sequence, a2.sequence, b1.sequence), (1, 2, 1));
    assert!(a1.id < a2.id);
    let row = sqlx::query(
        "SELECT state, payload->>'currency' AS currency, headers->>'trace-id' AS trace, published_at IS NULL AS unpublished \
         FROM idem_outbox WHERE id = $1",
    )
    .bind(a2.id)
    .fetch_one(&pool)
    .await
    .expect("row");
    assert_eq!(row.get::<String, _>("state"), "pending");
    assert_eq!(row.get::<String, _>("currency"), "EUR");
    assert_eq!(row.get::<String, _>("trace"), "t-1");
    assert!(row.get::<bool, _>("unpublished"));

    // Concurrent writers on one aggregate: numbers 3.. with no gap and no
    // repeat, and numbered in commit order.
    let mut tasks = tokio::task::JoinSet::new();
    for w in 0..8 {
        let pool = pool.clone();
        tasks.spawn(async move {
            for i in 0..25 {
                let mut tx = pool.begin().await.expect("begin");
                let m = OutboxMessage::new(
                    "payment",
                    "pay_1",
                    "PaymentNoted",
                    &format!(r#"{{"w":{w},"i":{i}}}"#),
                )
                .expect("valid");
                Outbox::enqueue(&mut tx, &m).await.expect("enqueue");
                tx.commit().await.expect("commit");
            }
        });
    }
    while let Some(done) = tasks.join_next().await {
        done.expect("writer");
    }
    let sequences: Vec<i64> = sqlx::query_scalar(
        "SELECT sequence FROM idem_outbox WHERE aggregate_id = 'pay_1' ORDER BY sequence",
    )
    .fetch_all(&pool)
    .await
    .expect("sequences");
    assert_eq!(sequences, (1..=202).collect::<Vec<i64>>());
    // Commit order: ids (taken at insert) rise with the sequence.
    let out_of_order = count(
        &pool,
        "SELECT count(*) FROM idem_outbox a JOIN idem_outbox b \
         ON a.aggregate_id = b.aggregate_id AND a.sequence < b.sequence AND a.id > b.id",
    )
    .await;
    assert_eq!(out_of_order, 0);

    // The operator path for dead rows: list, replay, discard.
    exec(&pool, &format!("UPDATE idem_outbox SET state = 'dead', attempts = 10, last_error = 'boom' WHERE id IN ({}, {})", a1.id, b1.id)).await;
    let dead = Outbox::list(&pool, Some("dead"), 10).await.expect("list");
    assert_eq!(
        dead.iter().map(|r| r.id).collect::<Vec<_>>(),
        [a1.id, b1.id]
    );
    assert_eq!(dead[0].last_error.as_deref(), Some("boom"));
    assert!(Outbox::list(&pool, Some("lost"), 10).await.is_err());
    assert_eq!(
        Outbox::replay_dead(&pool, &[a1.id, a2.id])
            .await
            .expect("replay"),
        [a1.id]
    );
    assert_eq!(
        count(&pool, &format!("SELECT count(*) FROM idem_outbox WHERE id = {} AND state = 'pending' AND attempts = 0", a1.id)).await,
        1
    );
    assert_eq!(
        Outbox::discard_dead(&pool, &[b1.id, a1.id])
            .await
            .expect("discard"),
        [b1.id]
    );
    assert_eq!(
        count(
            &pool,
            &format!("SELECT count(*) FROM idem_outbox WHERE id = {}", b1.id)
        )
        .await,
        0
    );
    t.drop_schema().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn out_of_order_versions_are_applied_in_order() {
    let Some(t) = common::Isolated::new("guard").await else {
        return;
    };
    let pool = t.store.pool().clone();
    exec(
        &pool,
        "CREATE TABLE applied (aggregate_id text, version bigint, seq serial)",
    )
    .await;
    let deliver = |version: i64| {
        let pool = pool.clone();
        async move {
            let mut tx = pool.begin().await.expect("begin");
            let order = OrderingGuard::check(&mut tx, "orders", "order", "o-1", version)
                .await
                .expect("guard");
            if order == Order::Apply {
                sqlx::query("INSERT INTO applied (aggregate_id, version) VALUES ('o-1', $1)")
                    .bind(version)
                    .execute(&mut *tx)
                    .await
                    .expect("apply");
            }
            tx.commit().await.expect("commit");
            order
        }
    };
    // The broker hands them over as 3, 1, 1, 2, then the gap is redelivered.
    assert_eq!(deliver(3).await, Order::Gap { expected: 1 });
    assert_eq!(deliver(1).await, Order::Apply);
    assert_eq!(deliver(1).await, Order::Stale { last: 1 });
    assert_eq!(deliver(2).await, Order::Apply);
    assert_eq!(deliver(3).await, Order::Apply);
    let applied: Vec<i64> = sqlx::query_scalar("SELECT version FROM applied ORDER BY seq")
        .fetch_all(&pool)
        .await
        .expect("applied");
    assert_eq!(applied, [1, 2, 3]);

    // A storm of shuffled redeliveries of versions 4..=30: each applied
    // once, in order.
    let mut pending: Vec<i64> = (4..=30).chain(4..=30).collect();
    pending.reverse();
    while !pending.is_empty() {
        let mut tasks = tokio::task::JoinSet::new();
        for v in std::mem::take(&mut pending) {
            let d = deliver(v);
            tasks.spawn(async move { (v, d.await) });
        }
        while let Some(done) = tasks.join_next().await {
            let (v, order) = done.expect("task");
            if matches!(order, Order::Gap { .. }) {
                pending.push(v); // redelivered later
            }
        }
    }
    let applied: Vec<i64> = sqlx::query_scalar("SELECT version FROM applied ORDER BY seq")
        .fetch_all(&pool)
        .await
        .expect("applied");
    assert_eq!(applied, (1..=30).collect::<Vec<i64>>());

    // Two first deliveries of a new aggregate at once: one applies it,
    // the other waits on its row and finds it applied.
    let first = |pool: PgPool| async move {
        let mut tx = pool.begin().await.expect("begin");
        let order = OrderingGuard::check(&mut tx, "orders", "order", "o-new", 1)
            .await
            .expect("guard");
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        tx.commit().await.expect("commit");
        order
    };
    let (a, b) = tokio::join!(first(pool.clone()), first(pool.clone()));
    let mut both = [a, b];
    both.sort_by_key(|o| matches!(o, Order::Stale { .. }));
    assert_eq!(both, [Order::Apply, Order::Stale { last: 1 }]);

    // Another aggregate type with the same id is another aggregate.
    let mut tx = pool.begin().await.expect("begin");
    assert_eq!(
        OrderingGuard::check(&mut tx, "orders", "payment", "o-1", 1)
            .await
            .expect("guard"),
        Order::Apply
    );
    tx.commit().await.expect("commit");

    let mut tx = pool.begin().await.expect("begin");
    let err = OrderingGuard::check(&mut tx, "orders", "order", "o-1", 0)
        .await
        .expect_err("version 0");
    assert!(
        matches!(
            err,
            MessagingError::InvalidMessage {
                field: "version",
                ..
            }
        ),
        "{err}"
    );
    drop(tx);
    t.drop_schema().await;
}
