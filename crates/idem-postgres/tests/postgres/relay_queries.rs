//! The relay's side of the outbox against a real PostgreSQL, each test in
//! a schema of its own: what a round reads (heads first, per partition,
//! after what is in flight, resuming its walk, stopping at a row backing
//! off or a dead one), marking rows published or failed, retention, the
//! backlog, wake-up registrations and the partition locks relays share.
//! `idem_messaging::Relay` is built on exactly these calls.

use crate::common;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use idem_postgres::outbox::{
    AggregateKey, Heads, HeadsQuery, NOTIFY_CHANNEL, Outbox, OutboxMessage, PartitionLocks,
};
use sqlx::postgres::PgConnectOptions;
use sqlx::{ConnectOptions, Connection, PgConnection, PgPool, Row};

async fn count(pool: &PgPool, sql: &str) -> i64 {
    sqlx::query_scalar(sql)
        .fetch_one(pool)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"))
}

/// Enqueues `n` events for each of `aggregates` (type `payment`), one
/// transaction per event; returns the row ids by (aggregate, sequence).
async fn enqueue(pool: &PgPool, aggregates: &[&str], n: i64) -> HashMap<(String, i64), i64> {
    let mut ids = HashMap::new();
    for aggregate in aggregates {
        for _ in 0..n {
            let mut tx = pool.begin().await.expect("begin");
            let msg = OutboxMessage::new("payment", aggregate, "PaymentNoted", r#"{"a":1}"#)
                .expect("valid")
                .with_header("trace-id", "t-1")
                .expect("header");
            let done = Outbox::enqueue(&mut tx, &msg).await.expect("enqueue");
            tx.commit().await.expect("commit");
            ids.insert(((*aggregate).to_owned(), done.sequence), done.id);
        }
    }
    ids
}

/// A read over every partition (one, held), from the start.
fn everything<'a>(after: &'a HashMap<AggregateKey, i64>) -> HeadsQuery<'a> {
    HeadsQuery {
        partitions: 1,
        owned: &[0],
        per_aggregate: 100,
        max_aggregates: 1000,
        after,
        resume_after: None,
        skip_dead: true,
    }
}

/// Per aggregate read: its id and the sequences read.
fn shape(heads: &Heads) -> Vec<(String, Vec<i64>)> {
    heads
        .aggregates
        .iter()
        .map(|rows| {
            (
                rows[0].aggregate_id.clone(),
                rows.iter().map(|r| r.sequence).collect(),
            )
        })
        .collect()
}

fn key(aggregate: &str) -> AggregateKey {
    ("payment".to_owned(), aggregate.to_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_round_reads_heads_first_and_walks_on_from_where_it_stopped() {
    let Some(t) = common::Isolated::new("claim").await else {
        return;
    };
    let pool = t.store.pool().clone();
    let ids = enqueue(&pool, &["a1", "a2", "a3", "a4"], 3).await;
    let none = HashMap::new();

    // Everything, in aggregate order, each aggregate's rows in sequence
    // order; the walk reached the end.
    let heads = Outbox::claim_heads(&pool, &everything(&none))
        .await
        .expect("read");
    assert_eq!(
        shape(&heads),
        [
            ("a1".to_owned(), vec![1, 2, 3]),
            ("a2".to_owned(), vec![1, 2, 3]),
            ("a3".to_owned(), vec![1, 2, 3]),
            ("a4".to_owned(), vec![1, 2, 3]),
        ]
    );
    assert_eq!(heads.resume_after, None);
    let row = &heads.aggregates[0][1];
    assert_eq!(row.id, ids[&("a1".to_owned(), 2)]);
    assert_eq!(
        (row.message_type.as_str(), row.payload.as_str()),
        ("PaymentNoted", r#"{"a": 1}"#)
    );
    assert_eq!(row.headers, r#"{"trace-id": "t-1"}"#);
    assert_eq!(row.attempts, 0);
    assert!(
        row.event_id.as_deref().is_some_and(|e| e.len() == 36),
        "{row:?}"
    );

    // Rows per aggregate, and rows after those in flight.
    let after = HashMap::from([(key("a1"), 2), (key("a3"), 3)]);
    let heads = Outbox::claim_heads(
        &pool,
        &HeadsQuery {
            per_aggregate: 2,
            ..everything(&after)
        },
    )
    .await
    .expect("read");
    assert_eq!(
        shape(&heads),
        [
            ("a1".to_owned(), vec![3]),
            ("a2".to_owned(), vec![1, 2]),
            ("a4".to_owned(), vec![1, 2]),
        ]
    );

    // At most two aggregates (and two rows): heads first, and the next
    // read walks on after the last aggregate walked, until the end.
    let mut walk = Vec::new();
    let mut resume: Option<AggregateKey> = None;
    for _ in 0..3 {
        let heads = Outbox::claim_heads(
            &pool,
            &HeadsQuery {
                max_aggregates: 2,
                resume_after: resume.as_ref(),
                ..everything(&none)
            },
        )
        .await
        .expect("read");
        walk.push(shape(&heads));
        resume = heads.resume_after;
    }
    assert_eq!(
        walk,
        [
            vec![("a1".to_owned(), vec![1]), ("a2".to_owned(), vec![1])],
            vec![("a3".to_owned(), vec![1]), ("a4".to_owned(), vec![1])],
            vec![],
        ]
    );
    assert_eq!(
        resume, None,
        "an empty walk starts again from the beginning"
    );

    // Partitions: two relays holding one partition each read disjoint
    // aggregates that together are all of them; holding none reads none.
    let mut seen = Vec::new();
    for p in [0, 1] {
        let heads = Outbox::claim_heads(
            &pool,
            &HeadsQuery {
                partitions: 2,
                owned: &[p],
                ..everything(&none)
            },
        )
        .await
        .expect("read");
        seen.extend(shape(&heads).into_iter().map(|(a, _)| a));
    }
    seen.sort();
    assert_eq!(seen, ["a1", "a2", "a3", "a4"]);
    let heads = Outbox::claim_heads(
        &pool,
        &HeadsQuery {
            owned: &[],
            ..everything(&none)
        },
    )
    .await
    .expect("read");
    assert!(heads.aggregates.is_empty());

    // A failed publish: counted, backing off (its aggregate waits behind
    // it); after the last attempt, dead (its aggregate is held back under
    // the block rule, and publishes past it under skip).
    let a2 = ids[&("a2".to_owned(), 1)];
    assert!(
        Outbox::record_failure(&pool, a2, "refused", Duration::from_secs(3600), false)
            .await
            .expect("failure")
    );
    let a3 = ids[&("a3".to_owned(), 1)];
    assert!(
        Outbox::record_failure(&pool, a3, "refused again", Duration::ZERO, true)
            .await
            .expect("failure")
    );
    let failed = sqlx::query(
        "SELECT id, state, attempts, last_error, available_at > clock_timestamp() AS later \
         FROM idem_outbox WHERE id = ANY($1) ORDER BY id",
    )
    .bind(&[a2, a3][..])
    .fetch_all(&pool)
    .await
    .expect("rows");
    let failed: Vec<(String, i32, String, bool)> = failed
        .iter()
        .map(|r| {
            (
                r.get("state"),
                r.get("attempts"),
                r.get("last_error"),
                r.get("later"),
            )
        })
        .collect();
    assert_eq!(
        failed,
        [
            ("pending".to_owned(), 1, "refused".to_owned(), true),
            ("dead".to_owned(), 1, "refused again".to_owned(), false),
        ]
    );
    assert!(
        !Outbox::record_failure(&pool, a3, "late", Duration::ZERO, false)
            .await
            .expect("failure"),
        "a row no longer pending is left alone"
    );
    let heads = Outbox::claim_heads(&pool, &everything(&none))
        .await
        .expect("read");
    assert_eq!(
        shape(&heads),
        [
            ("a1".to_owned(), vec![1, 2, 3]),
            ("a4".to_owned(), vec![1, 2, 3]),
        ]
    );
    let heads = Outbox::claim_heads(
        &pool,
        &HeadsQuery {
            skip_dead: false,
            ..everything(&none)
        },
    )
    .await
    .expect("read");
    assert_eq!(
        shape(&heads),
        [
            ("a1".to_owned(), vec![1, 2, 3]),
            ("a3".to_owned(), vec![2, 3]),
            ("a4".to_owned(), vec![1, 2, 3]),
        ]
    );
    t.drop_schema().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn published_rows_leave_the_backlog_and_are_purged_after_retention() {
    let Some(t) = common::Isolated::new("published").await else {
        return;
    };
    let pool = t.store.pool().clone();
    let stats = Outbox::pending_stats(&pool).await.expect("stats");
    assert_eq!((stats.pending, stats.lag), (0, Duration::ZERO));

    let ids = enqueue(&pool, &["p1", "p2"], 3).await;
    tokio::time::sleep(Duration::from_millis(20)).await;
    let stats = Outbox::pending_stats(&pool).await.expect("stats");
    assert_eq!(stats.pending, 6);
    assert!(stats.lag >= Duration::from_millis(20), "{stats:?}");

    let mut all: Vec<i64> = ids.values().copied().collect();
    all.sort_unstable();
    let (first, rest) = all.split_at(4);
    let a = first[0];
    Outbox::record_failure(&pool, a, "broker said no", Duration::ZERO, false)
        .await
        .expect("failure");
    assert_eq!(Outbox::mark_published(&pool, first).await.expect("mark"), 4);
    assert_eq!(
        Outbox::mark_published(&pool, first).await.expect("mark"),
        0,
        "rows already published are left alone"
    );
    let row = sqlx::query(
        "SELECT state, attempts, last_error, published_at IS NOT NULL AS stamped \
         FROM idem_outbox WHERE id = $1",
    )
    .bind(a)
    .fetch_one(&pool)
    .await
    .expect("row");
    assert_eq!(row.get::<String, _>("state"), "published");
    assert_eq!(
        row.get::<i32, _>("attempts"),
        2,
        "the acknowledged attempt counts"
    );
    assert_eq!(row.get::<Option<String>, _>("last_error"), None);
    assert!(row.get::<bool, _>("stamped"));
    assert_eq!(
        Outbox::pending_stats(&pool).await.expect("stats").pending,
        2
    );

    // Retention: nothing is old enough yet; then a batch at a time, and
    // never a pending row.
    assert_eq!(
        Outbox::purge_published_older_than(&pool, Duration::from_secs(3600), 10)
            .await
            .expect("purge"),
        0
    );
    tokio::time::sleep(Duration::from_millis(5)).await;
    assert_eq!(
        Outbox::purge_published_older_than(&pool, Duration::ZERO, 3)
            .await
            .expect("purge"),
        3
    );
    assert_eq!(
        Outbox::purge_published_older_than(&pool, Duration::ZERO, 3)
            .await
            .expect("purge"),
        1
    );
    let left: Vec<i64> = sqlx::query_scalar("SELECT id FROM idem_outbox ORDER BY id")
        .fetch_all(&pool)
        .await
        .expect("ids");
    assert_eq!(left, rest);
    t.drop_schema().await;
}

/// Waits up to 5 s for a notification on `listener` whose payload is
/// `schema`; other schemas' notifications (tests running alongside) are
/// skipped.
async fn notified(listener: &mut sqlx::postgres::PgListener, schema: &str, wait: Duration) -> bool {
    let deadline = Instant::now() + wait;
    while let Some(left) = deadline.checked_duration_since(Instant::now()) {
        match tokio::time::timeout(left, listener.recv()).await {
            Ok(Ok(n)) if n.channel() == NOTIFY_CHANNEL && n.payload() == schema => return true,
            Ok(Ok(_)) => {}
            Ok(Err(e)) => panic!("listener: {e}"),
            Err(_) => return false,
        }
    }
    false
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inserts_notify_only_while_a_relay_is_registered() {
    let Some(t) = common::Isolated::new("wake").await else {
        return;
    };
    let pool = t.store.pool().clone();
    let mut listener = Outbox::listener(&pool).await.expect("listen");

    enqueue(&pool, &["w1"], 1).await;
    assert!(
        !notified(&mut listener, &t.schema, Duration::from_millis(300)).await,
        "nobody registered: no notification"
    );

    Outbox::register_listener(&pool, "relay-1", Duration::from_secs(30))
        .await
        .expect("register");
    // Registering again moves the deadline; it is still one registration.
    Outbox::register_listener(&pool, "relay-1", Duration::from_secs(60))
        .await
        .expect("register");
    assert_eq!(
        count(&pool, "SELECT count(*) FROM idem_outbox_listeners").await,
        1
    );
    enqueue(&pool, &["w1"], 1).await;
    assert!(notified(&mut listener, &t.schema, Duration::from_secs(5)).await);

    Outbox::unregister_listener(&pool, "relay-1")
        .await
        .expect("unregister");
    assert_eq!(
        count(&pool, "SELECT count(*) FROM idem_outbox_listeners").await,
        0
    );
    enqueue(&pool, &["w1"], 1).await;
    assert!(!notified(&mut listener, &t.schema, Duration::from_millis(300)).await);

    // A registration past its deadline notifies no more.
    Outbox::register_listener(&pool, "relay-2", Duration::ZERO)
        .await
        .expect("register");
    enqueue(&pool, &["w1"], 1).await;
    assert!(!notified(&mut listener, &t.schema, Duration::from_millis(300)).await);
    drop(listener);
    t.drop_schema().await;
}

/// A relay's lock session: its own connection, named for the outbox.
async fn session(options: &PgConnectOptions, application: &str) -> PgConnection {
    options
        .clone()
        .application_name(application)
        .connect()
        .await
        .expect("lock session")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relays_share_partitions_through_session_locks() {
    let Some(t) = common::Isolated::new("locks").await else {
        return;
    };
    // The schema name is unique to this run: no other relay contends.
    let locks = PartitionLocks::new(&t.schema);
    let other = PartitionLocks::new(&format!("{}_other", t.schema));
    assert_ne!(locks.class(), other.class());
    let application = format!("idem-relay:{}", t.schema);
    let mut a = session(t.opts.connect_options(), &application).await;
    let mut b = session(t.opts.connect_options(), &application).await;
    assert_eq!(
        PartitionLocks::live_relays(&mut a, &application)
            .await
            .expect("count"),
        2
    );

    assert!(locks.try_lock(&mut a, 0).await.expect("lock"));
    assert!(!locks.try_lock(&mut b, 0).await.expect("lock"), "held by a");
    assert!(locks.try_lock(&mut b, 1).await.expect("lock"));
    // Another outbox's partition 1 is another lock.
    assert!(other.try_lock(&mut a, 1).await.expect("lock"));
    assert!(locks.unlock(&mut a, 0).await.expect("unlock"));
    assert!(
        !locks.unlock(&mut a, 0).await.expect("unlock"),
        "not held any more"
    );
    assert!(locks.try_lock(&mut b, 0).await.expect("lock"));

    // A relay that goes away loses its partitions with its session.
    b.close().await.expect("close");
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let relays = PartitionLocks::live_relays(&mut a, &application)
            .await
            .expect("count");
        if relays == 1 && locks.try_lock(&mut a, 1).await.expect("lock") {
            break;
        }
        assert!(Instant::now() < deadline, "b's session is still there");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(locks.try_lock(&mut a, 0).await.expect("lock"));
    a.close().await.expect("close");
    t.drop_schema().await;
}
