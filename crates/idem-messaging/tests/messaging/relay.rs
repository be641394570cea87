//! The relay in-process against real PostgreSQL and NATS JetStream: a row
//! the broker keeps refusing becomes dead and holds back the rest of its
//! aggregate only (or not, under `OnDead::Skip`); an idle relay is woken by
//! a notification, which inserting statements send only while a relay
//! waits.

use crate::common;

use std::sync::Arc;
use std::time::Duration;

use common::{Db, unique};
use idem_messaging::relay::NOTIFY_CHANNEL;
use idem_messaging::{NatsPublisher, OnDead, Relay, RelayOptions, RelayStats};
use idem_postgres::PgOptions;
use idem_postgres::outbox::{Outbox, OutboxMessage};
use idem_postgres::sqlx::{self, postgres::PgListener};

/// A stream capturing only `<prefix>.*.Good`: a `Bad` message has no stream
/// and JetStream refuses it.
async fn publisher(prefix: &str) -> Option<NatsPublisher> {
    let url = idem_testkit::services::nats()?;
    let publisher = NatsPublisher::connect(&url, &prefix.to_uppercase())
        .await
        .expect("NATS");
    let _ = publisher
        .jetstream()
        .delete_stream(prefix.to_uppercase())
        .await;
    common::create_stream(|| {
        publisher.create_stream(vec![format!("{prefix}.*.Good")], Duration::from_secs(120))
    })
    .await;
    Some(publisher)
}

async fn enqueue(db: &Db, aggregate: &str, message_type: &str) {
    let mut tx = db.store.pool().begin().await.expect("begin");
    let msg = OutboxMessage::new("order", aggregate, message_type, "{}").expect("message");
    Outbox::enqueue(&mut tx, &msg).await.expect("enqueue");
    tx.commit().await.expect("commit");
}

/// Runs `relay` until `done` holds (checked every 20 ms, at most 30 s).
async fn run_until<F, Fut>(relay: Relay<NatsPublisher>, db: &Db, done: F) -> RelayStats
where
    F: Fn(sqlx::PgPool) -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let stop = Arc::new(tokio::sync::Notify::new());
    let running = tokio::spawn({
        let stop = Arc::clone(&stop);
        relay.run(async move { stop.notified().await })
    });
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while !done(db.pool()).await {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the relay did not get there in 30 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    stop.notify_one();
    running.await.expect("relay")
}

fn relay(db: &Db, publisher: NatsPublisher, options: RelayOptions) -> Relay<NatsPublisher> {
    let opts = PgOptions::from_url(&db.url).expect("url");
    Relay::new(
        db.pool(),
        opts.connect_options().clone(),
        &db.schema,
        publisher,
        options,
    )
}

/// (state, attempts) of every row, by aggregate and sequence.
async fn rows(db: &Db) -> Vec<(String, i64, String, i32)> {
    sqlx::query_as(
        "SELECT aggregate_id, sequence, state, attempts FROM idem_outbox ORDER BY aggregate_id, sequence",
    )
    .fetch_all(db.store.pool())
    .await
    .expect("rows")
}

async fn dead_row_rule(on_dead: OnDead) {
    let prefix = unique("dead");
    let (Some(db), Some(publisher)) = (Db::new("dead").await, publisher(&prefix).await) else {
        return;
    };
    let js = publisher.jetstream().clone();
    for (aggregate, kind) in [
        ("a", "Bad"),
        ("a", "Good"),
        ("a", "Good"),
        ("b", "Good"),
        ("b", "Good"),
        ("b", "Good"),
    ] {
        enqueue(&db, aggregate, kind).await;
    }
    let options = RelayOptions {
        prefix: prefix.clone(),
        max_attempts: 2,
        backoff: Duration::from_millis(10),
        max_backoff: Duration::from_millis(20),
        on_dead,
        ..RelayOptions::default()
    };
    let expected_published: i64 = if on_dead == OnDead::Block { 3 } else { 5 };
    let stats = run_until(relay(&db, publisher, options), &db, move |pool| async move {
        let (published, dead): (i64, i64) = sqlx::query_as(
            "SELECT count(*) FILTER (WHERE state = 'published'), count(*) FILTER (WHERE state = 'dead') FROM idem_outbox",
        )
        .fetch_one(&pool)
        .await
        .expect("count");
        published == expected_published && dead == 1
    })
    .await;
    assert_eq!(stats.dead, 1, "{stats:?}");
    assert_eq!(stats.failures, 2, "{stats:?}");
    let rows = rows(&db).await;
    let later = if on_dead == OnDead::Block {
        "pending"
    } else {
        "published"
    };
    assert_eq!(
        rows,
        vec![
            ("a".to_owned(), 1, "dead".to_owned(), 2),
            (
                "a".to_owned(),
                2,
                later.to_owned(),
                i32::from(on_dead == OnDead::Skip)
            ),
            (
                "a".to_owned(),
                3,
                later.to_owned(),
                i32::from(on_dead == OnDead::Skip)
            ),
            ("b".to_owned(), 1, "published".to_owned(), 1),
            ("b".to_owned(), 2, "published".to_owned(), 1),
            ("b".to_owned(), 3, "published".to_owned(), 1),
        ]
    );
    let mut stream = js.get_stream(prefix.to_uppercase()).await.expect("stream");
    let info = stream.info().await.expect("info");
    assert_eq!(info.state.messages as i64, expected_published);
    let _ = js.delete_stream(prefix.to_uppercase()).await;
    db.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_row_holds_back_its_aggregate_only() {
    dead_row_rule(OnDead::Block).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_skip_a_dead_row_holds_back_nothing() {
    dead_row_rule(OnDead::Skip).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_relay_is_woken_by_a_notification_sent_only_while_it_waits() {
    let prefix = unique("wake");
    let (Some(db), Some(publisher)) = (Db::new("wake").await, publisher(&prefix).await) else {
        return;
    };
    let js = publisher.jetstream().clone();
    let mut observer = PgListener::connect_with(&db.pool())
        .await
        .expect("listener");
    observer.listen(NOTIFY_CHANNEL).await.expect("listen");

    // No relay waits: inserting sends no notification.
    enqueue(&db, "a", "Good").await;
    let quiet = tokio::time::timeout(Duration::from_millis(500), observer.recv()).await;
    assert!(quiet.is_err(), "no relay waits, yet got {quiet:?}");

    // A relay that would poll only every 30 s.
    let options = RelayOptions {
        prefix: prefix.clone(),
        idle_poll: Duration::from_secs(30),
        notify_fallback: Duration::from_secs(30),
        ..RelayOptions::default()
    };
    let relay = relay(&db, publisher, options);
    let stop = Arc::new(tokio::sync::Notify::new());
    let running = tokio::spawn({
        let stop = Arc::clone(&stop);
        relay.run(async move { stop.notified().await })
    });
    let published = |n: i64| {
        let pool = db.pool();
        async move {
            let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
            loop {
                let count: i64 = sqlx::query_scalar(
                    "SELECT count(*) FROM idem_outbox WHERE state = 'published'",
                )
                .fetch_one(&pool)
                .await
                .expect("count");
                if count == n {
                    return;
                }
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "{count} of {n} published"
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    };
    published(1).await;
    // Once idle, the relay registers and waits.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while db
        .scalar("SELECT count(*) FROM idem_outbox_listeners")
        .await
        == 0
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the relay never waited"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    enqueue(&db, "a", "Good").await;
    let note = tokio::time::timeout(Duration::from_secs(5), observer.recv())
        .await
        .expect("a notification while a relay waits")
        .expect("notification");
    assert_eq!(note.payload(), db.schema);
    // Published long before the 30 s poll would have found it.
    published(2).await;
    stop.notify_one();
    let stats = running.await.expect("relay");
    assert_eq!(stats.published, 2);
    assert_eq!(
        db.scalar("SELECT count(*) FROM idem_outbox_listeners")
            .await,
        0,
        "a stopped relay leaves no registration"
    );
    let _ = js.delete_stream(prefix.to_uppercase()).await;
    db.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backlog_wider_than_a_round_is_walked_to_the_end() {
    const AGGREGATES: usize = 35;
    let prefix = unique("wide");
    let (Some(db), Some(publisher)) = (Db::new("wide").await, publisher(&prefix).await) else {
        return;
    };
    let js = publisher.jetstream().clone();
    for _ in 0..3 {
        for a in 0..AGGREGATES {
            enqueue(&db, &format!("agg-{a:02}"), "Good").await;
        }
    }
    // Rounds of 10 rows walk at most 10 aggregates at a time, each walk
    // resuming where the last one stopped; all 35 aggregates get through.
    let options = RelayOptions {
        prefix: prefix.clone(),
        batch: 10,
        per_aggregate: 2,
        ..RelayOptions::default()
    };
    let total = (AGGREGATES * 3) as i64;
    let stats = run_until(
        relay(&db, publisher, options),
        &db,
        move |pool| async move {
            let published: i64 =
                sqlx::query_scalar("SELECT count(*) FROM idem_outbox WHERE state = 'published'")
                    .fetch_one(&pool)
                    .await
                    .expect("count");
            published == total
        },
    )
    .await;
    assert_eq!(stats.published, total as u64);
    let mut stream = js.get_stream(prefix.to_uppercase()).await.expect("stream");
    assert_eq!(
        stream.info().await.expect("info").state.messages,
        total as u64
    );
    let _ = js.delete_stream(prefix.to_uppercase()).await;
    db.drop().await;
}

/// Two outboxes (two services' schemas) publish to one stream: their row
/// ids repeat (both start at 1), but their message ids do not, so the
/// broker drops neither's events as copies of the other's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_outboxes_share_a_stream_without_their_ids_colliding() {
    let prefix = unique("two");
    let (Some(first), Some(second), Some(publisher)) = (
        Db::new("twoa").await,
        Db::new("twob").await,
        publisher(&prefix).await,
    ) else {
        return;
    };
    let js = publisher.jetstream().clone();
    let url = idem_testkit::services::nats().expect("NATS");
    let second_publisher = NatsPublisher::connect(&url, &prefix.to_uppercase())
        .await
        .expect("NATS");
    for _ in 0..5 {
        enqueue(&first, "a", "Good").await;
        enqueue(&second, "b", "Good").await;
    }
    let options = RelayOptions {
        prefix: prefix.clone(),
        ..RelayOptions::default()
    };
    let both_done = |pool: sqlx::PgPool| async move {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM idem_outbox WHERE state = 'published'")
            .fetch_one(&pool)
            .await
            .expect("count")
            == 5
    };
    let a = run_until(relay(&first, publisher, options.clone()), &first, both_done).await;
    let b = run_until(
        relay(&second, second_publisher, options),
        &second,
        both_done,
    )
    .await;
    assert_eq!(
        (a.duplicates, b.duplicates),
        (0, 0),
        "no event taken for a copy"
    );
    let mut stream = js.get_stream(prefix.to_uppercase()).await.expect("stream");
    assert_eq!(stream.info().await.expect("info").state.messages, 10);
    let _ = js.delete_stream(prefix.to_uppercase()).await;
    first.drop().await;
    second.drop().await;
}
