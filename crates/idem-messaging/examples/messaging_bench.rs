//! Messaging benchmark: the relay against the broker's raw
//! publish-with-ack rate, inbox-wrapped transactions against the same
//! transactions without the inbox, and a Kafka consumer with and without
//! the runner's inbox, measured in the same run.
//!
//! ```text
//! cargo run --release -p idem-messaging --example messaging_bench
//! ```
//! Uses `IDEM_TEST_PG_URL` (default `postgres://postgres@127.0.0.1:5432/test`)
//! `IDEM_TEST_NATS_URL` (default `nats://127.0.0.1:4222`),
//! `IDEM_TEST_AMQP_URL` (default `amqp://guest:guest@127.0.0.1:5672/%2f`) and
//! `IDEM_TEST_KAFKA_URL` (default `kafka://127.0.0.1:9092`); everything
//! lives in a schema, a stream, an exchange and topics of its own, dropped
//! at the end (topics stay: drop them with the broker).
//! `IDEM_BENCH_PARTS` (default `nats,rabbitmq,inbox,kafka`) picks the parts.

use std::sync::Arc;
use std::time::{Duration, Instant};

use idem_messaging::{
    Consumer, ConsumerOptions, Delivery, HandlerError, KafkaPublisher, KafkaPublisherOptions,
    KafkaSource, KafkaSourceOptions, Message, NatsPublisher, Outgoing, Publisher, RabbitPublisher,
    Relay, RelayOptions, Source, TopicSpec,
};
use idem_postgres::inbox::Inbox;
use idem_postgres::outbox::{Outbox, OutboxMessage};
use idem_postgres::sqlx;
use idem_postgres::sqlx::postgres::PgConnectOptions;
use idem_postgres::{PgOptions, PgStore};
use tokio::task::JoinSet;

const ROWS: usize = 100_000;
const AGGREGATES: usize = 100;
const CONCURRENCY: usize = 64;
const TRANSACTIONS: usize = 5_000;
const PASSES: usize = 5;
/// Messages each Kafka consumer pass handles.
const CONSUMED: usize = 20_000;
/// Kafka consumer passes of each kind (alternating).
const CONSUMER_PASSES: usize = 3;
/// Partitions of the Kafka topics the bench creates.
const PARTITIONS: i32 = 16;

fn env(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.to_owned())
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let pg = env(
        "IDEM_TEST_PG_URL",
        "postgres://postgres@127.0.0.1:5432/test",
    );
    let nats = env("IDEM_TEST_NATS_URL", "nats://127.0.0.1:4222");
    let tag = format!("{:08x}", idem::OwnerToken::random().as_u128() as u32);
    let schema = format!("idem_bench_{tag}");
    let sep = if pg.contains('?') { '&' } else { '?' };
    let opts = PgOptions::from_url(&format!("{pg}{sep}schema={schema}&max_connections=16"))?;
    let lock_options = opts.connect_options().clone();
    let store = PgStore::connect_with(opts).await?;
    let pool = store.pool().clone();
    let (stream, prefix) = (format!("IDEMBENCH_{tag}"), format!("idembench{tag}"));
    let publisher = NatsPublisher::connect(&nats, &stream).await?;
    publisher
        .create_stream(vec![format!("{prefix}.>")], Duration::from_secs(120))
        .await?;
    println!(
        "machine: {} cpus; rows {ROWS} over {AGGREGATES} aggregates; {CONCURRENCY} in flight",
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );

    let parts = env("IDEM_BENCH_PARTS", "nats,rabbitmq,inbox,kafka");
    let part = |name: &str| parts.split(',').any(|p| p.trim() == name);

    if part("nats") {
        nats_part(&pool, &lock_options, &schema, &prefix, &publisher).await?;
    }
    if part("rabbitmq") {
        rabbitmq_part(&pool, &lock_options, &schema, &prefix, &tag).await?;
    }
    // Inbox overhead: the same business transaction with and without the
    // inbox row, CONCURRENCY/4 at a time.
    sqlx::query("CREATE TABLE bench_orders (id int PRIMARY KEY, n bigint NOT NULL)")
        .execute(&pool)
        .await?;
    sqlx::query("INSERT INTO bench_orders SELECT g, 0 FROM generate_series(0, 999) g")
        .execute(&pool)
        .await?;
    if part("inbox") {
        inbox_part(&pool).await?;
    }
    if part("kafka") {
        let kafka = env("IDEM_TEST_KAFKA_URL", "kafka://127.0.0.1:9092");
        kafka_part(&pool, &lock_options, &schema, &prefix, &kafka).await?;
    }

    publisher.jetstream().delete_stream(&stream).await?;
    sqlx::query(&format!("DROP SCHEMA \"{schema}\" CASCADE"))
        .execute(&pool)
        .await?;
    Ok(())
}

type BenchResult<T = ()> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// The relay against JetStream's publish-with-ack rate.
async fn nats_part(
    pool: &sqlx::PgPool,
    lock_options: &PgConnectOptions,
    schema: &str,
    prefix: &str,
    publisher: &NatsPublisher,
) -> BenchResult {
    let nats_publisher = Arc::new(publisher.clone());
    let (raw, relayed) = relay_against_raw(
        pool,
        lock_options,
        schema,
        prefix,
        "JetStream publish-with-ack",
        nats_publisher,
    )
    .await?;
    println!(
        "NATS JetStream: raw {raw:.0} msg/s, relay {relayed:.0} msg/s = {:.2}x raw",
        relayed / raw
    );
    Ok(())
}

/// The relay against RabbitMQ's publish-with-confirm rate, to a durable
/// queue bound to the prefix.
async fn rabbitmq_part(
    pool: &sqlx::PgPool,
    lock_options: &PgConnectOptions,
    schema: &str,
    prefix: &str,
    tag: &str,
) -> BenchResult {
    let amqp = env(
        "IDEM_TEST_AMQP_URL",
        "amqp://guest:guest@127.0.0.1:5672/%2f",
    );
    let exchange = format!("idembench{tag}");
    let rabbit = Arc::new(RabbitPublisher::connect(&amqp, &exchange).await?);
    let conn = lapin::Connection::connect(&amqp, Default::default()).await?;
    let ch = conn.create_channel().await?;
    ch.queue_declare(
        exchange.as_str().into(),
        lapin::options::QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        Default::default(),
    )
    .await?;
    ch.queue_bind(
        exchange.as_str().into(),
        exchange.as_str().into(),
        format!("{prefix}.#").as_str().into(),
        Default::default(),
        Default::default(),
    )
    .await?;
    let (raw, relayed) = relay_against_raw(
        pool,
        lock_options,
        schema,
        prefix,
        "RabbitMQ publish-with-confirm",
        rabbit,
    )
    .await?;
    println!(
        "RabbitMQ: raw {raw:.0} msg/s, relay {relayed:.0} msg/s = {:.2}x raw",
        relayed / raw
    );
    ch.queue_delete(exchange.as_str().into(), Default::default())
        .await?;
    ch.exchange_delete(exchange.as_str().into(), Default::default())
        .await?;
    Ok(())
}

/// The business transaction with and without `Inbox::process`, in the
/// database alone.
async fn inbox_part(pool: &sqlx::PgPool) -> BenchResult {
    // Alternate the two (without, with, without, with…) so drift (table
    // growth, autovacuum, the page cache) weighs on both; report medians.
    let (mut without, mut with) = (Vec::new(), Vec::new());
    for pass in 0..2 * PASSES {
        let with_inbox = pass % 2 == 1;
        let started = Instant::now();
        let mut tasks = JoinSet::new();
        for w in 0..16 {
            let pool = pool.clone();
            tasks.spawn(async move {
                for i in (w..TRANSACTIONS).step_by(16) {
                    let mut tx = pool.begin().await.expect("begin");
                    if with_inbox {
                        Inbox::process(&mut tx, "bench", &format!("m-{pass}-{i}"), None)
                            .await
                            .expect("inbox");
                    }
                    sqlx::query("UPDATE bench_orders SET n = n + 1 WHERE id = $1")
                        .bind((i % 1000) as i32)
                        .execute(&mut *tx)
                        .await
                        .expect("update");
                    tx.commit().await.expect("commit");
                }
            });
        }
        while let Some(done) = tasks.join_next().await {
            done?;
        }
        let rate = TRANSACTIONS as f64 / started.elapsed().as_secs_f64();
        if with_inbox {
            with.push(rate)
        } else {
            without.push(rate)
        }
    }
    let (without, with) = (median(&mut without), median(&mut with));
    println!(
        "business transaction (median of {PASSES} alternating passes) without inbox: {without:.0} tx/s; with inbox: {with:.0} tx/s; overhead {:.1}%",
        (1.0 - with / without) * 100.0
    );
    Ok(())
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Kafka: the relay against the idempotent producer's produce-with-ack
/// rate, then the consumer runner (inbox, ordering) against a bare
/// consumer of the same source doing the same transaction.
async fn kafka_part(
    pool: &sqlx::PgPool,
    lock_options: &PgConnectOptions,
    schema: &str,
    prefix: &str,
    url: &str,
) -> BenchResult {
    let publisher = Arc::new(KafkaPublisher::connect(
        url,
        KafkaPublisherOptions {
            create: Some(TopicSpec {
                partitions: PARTITIONS,
                replication: 1,
            }),
            ..KafkaPublisherOptions::default()
        },
    )?);
    let (raw, relayed) = relay_against_raw(
        pool,
        lock_options,
        schema,
        prefix,
        "Kafka produce-with-ack (idempotent, acks=all)",
        Arc::clone(&publisher),
    )
    .await?;
    println!(
        "Kafka: raw {raw:.0} msg/s, relay {relayed:.0} msg/s = {:.2}x raw",
        relayed / raw
    );

    // The consumer's input: CONSUMED messages as the relay sends them
    // (ids, ordering headers), over AGGREGATES aggregates.
    let topic = format!("{prefix}.consume");
    let mut tasks = JoinSet::new();
    for w in 0..CONCURRENCY {
        let (p, prefix) = (Arc::clone(&publisher), prefix.to_owned());
        tasks.spawn(async move {
            // Each aggregate's rows in order: one task per aggregate set.
            for a in (w..AGGREGATES).step_by(CONCURRENCY) {
                for seq in 1..=CONSUMED / AGGREGATES {
                    let msg = Outgoing {
                        subject: format!("{prefix}.consume.Noted"),
                        id: format!("c-{a}-{seq}"),
                        payload: bytes::Bytes::from(format!(r#"{{"n":{seq}}}"#)),
                        headers: vec![
                            ("Idem-Aggregate-Type".to_owned(), "consume".to_owned()),
                            ("Idem-Aggregate-Id".to_owned(), format!("o-{a}")),
                            ("Idem-Sequence".to_owned(), seq.to_string()),
                        ],
                    };
                    p.publish(&msg).await.expect("publish");
                }
            }
        });
    }
    while let Some(done) = tasks.join_next().await {
        done?;
    }
    // Bare, runner with the inbox, runner with the inbox and the ordering
    // guard, in turn.
    let mut rates: [Vec<f64>; 3] = Default::default();
    for pass in 0..3 * CONSUMER_PASSES {
        let group = format!("{prefix}-pass{pass}");
        let mut options = KafkaSourceOptions::new(&group, &[topic.as_str()]);
        options.session_timeout = Duration::from_secs(6);
        let source = KafkaSource::subscribe(url, &options)?;
        let rate = match pass % 3 {
            0 => consume_bare(pool, source).await,
            kind => consume_with_runner(pool, source, &group, kind == 2).await,
        };
        rates[pass % 3].push(rate);
    }
    let [bare, inbox, ordered] = rates.map(|mut r| median(&mut r));
    let overhead = |rate: f64| (1.0 - rate / bare) * 100.0;
    println!(
        "Kafka consumer, {CONSUMED} messages over {PARTITIONS} partitions (median of {CONSUMER_PASSES} alternating passes, timed from the first delivery): bare {bare:.0} msg/s; runner with inbox {inbox:.0} msg/s (overhead {:.1}%); with inbox and ordering guard {ordered:.0} msg/s (overhead {:.1}%)",
        overhead(inbox),
        overhead(ordered)
    );
    Ok(())
}

/// The business change both consumers make.
async fn bump(tx: &mut sqlx::PgConnection, msg: &Message) -> Result<(), sqlx::Error> {
    let aggregate = msg.header("Idem-Aggregate-Id").unwrap_or("o-0");
    let n: i32 = aggregate
        .trim_start_matches("o-")
        .parse()
        .unwrap_or_default();
    sqlx::query("UPDATE bench_orders SET n = n + 1 WHERE id = $1")
        .bind(n)
        .execute(tx)
        .await?;
    Ok(())
}

/// What a consumer without idem would do: 16 deliveries at once, each
/// its transaction, then the acknowledgement. Returns msg/s from the
/// first delivery to the CONSUMED-th acknowledgement.
async fn consume_bare(pool: &sqlx::PgPool, mut source: KafkaSource) -> f64 {
    let limit = Arc::new(tokio::sync::Semaphore::new(16));
    let mut tasks = JoinSet::new();
    let mut started = None;
    for _ in 0..CONSUMED {
        let permit = Arc::clone(&limit).acquire_owned().await.expect("permit");
        let delivery = source.next().await.expect("open").expect("a delivery");
        started.get_or_insert_with(Instant::now);
        let pool = pool.clone();
        tasks.spawn(async move {
            let _permit = permit;
            let mut tx = pool.begin().await.expect("begin");
            bump(&mut tx, delivery.message()).await.expect("update");
            tx.commit().await.expect("commit");
            delivery.ack().await.expect("ack");
        });
    }
    while let Some(done) = tasks.join_next().await {
        done.expect("task");
    }
    let rate = CONSUMED as f64 / started.expect("started").elapsed().as_secs_f64();
    source.close().await;
    rate
}

/// The consumer runner (the inbox, the ordering guard if `ordering`, 16 at
/// once) with the same change as its handler. Returns msg/s from the first
/// delivery to the CONSUMED-th applied message.
async fn consume_with_runner(
    pool: &sqlx::PgPool,
    source: KafkaSource,
    consumer: &str,
    ordering: bool,
) -> f64 {
    struct Bump {
        applied: Arc<std::sync::atomic::AtomicUsize>,
        first: Arc<std::sync::OnceLock<Instant>>,
        done: Arc<tokio::sync::Notify>,
    }
    impl idem_messaging::Handler for Bump {
        async fn handle(
            &self,
            tx: &mut sqlx::Transaction<'static, sqlx::Postgres>,
            msg: &Message,
        ) -> Result<(), HandlerError> {
            self.first.get_or_init(Instant::now);
            bump(tx, msg).await?;
            if self
                .applied
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
                + 1
                == CONSUMED
            {
                self.done.notify_one();
            }
            Ok(())
        }
    }
    let (applied, first, done) = (
        Arc::new(std::sync::atomic::AtomicUsize::new(0)),
        Arc::new(std::sync::OnceLock::new()),
        Arc::new(tokio::sync::Notify::new()),
    );
    let runner = Consumer::new(
        pool.clone(),
        Bump {
            applied: Arc::clone(&applied),
            first: Arc::clone(&first),
            done: Arc::clone(&done),
        },
        ConsumerOptions {
            ordering,
            ..ConsumerOptions::new(consumer)
        },
    );
    let stats = runner.run(source, done.notified()).await;
    let elapsed = first.get().expect("started").elapsed();
    // The handler's count includes transactions that rolled back (none
    // here: one consumer, no failures); the stats say what was applied.
    eprintln!("kafka runner pass: {stats:?}");
    CONSUMED as f64 / elapsed.as_secs_f64()
}

/// Measures `publisher`'s raw publish-with-ack rate (CONCURRENCY
/// publishers, ROWS messages), then the relay publishing ROWS outbox rows
/// over AGGREGATES aggregates through it. Returns both rates, in msg/s.
async fn relay_against_raw<P: Publisher>(
    pool: &sqlx::PgPool,
    lock_options: &PgConnectOptions,
    schema: &str,
    prefix: &str,
    what: &str,
    publisher: Arc<P>,
) -> Result<(f64, f64), Box<dyn std::error::Error + Send + Sync>> {
    // 1. Raw publish-with-ack, CONCURRENCY publishers each awaiting its ack.
    let raw = {
        let started = Instant::now();
        let mut tasks = JoinSet::new();
        for w in 0..CONCURRENCY {
            let (p, prefix) = (Arc::clone(&publisher), prefix.to_owned());
            tasks.spawn(async move {
                for i in (w..ROWS).step_by(CONCURRENCY) {
                    // The message the relay sends for such a row: same
                    // payload, same headers.
                    let msg = Outgoing {
                        subject: format!("{prefix}.raw.Noted"),
                        id: format!("raw-{i}"),
                        payload: bytes::Bytes::from(format!(r#"{{"n":{i}}}"#)),
                        headers: vec![
                            ("Idem-Aggregate-Type".to_owned(), "order".to_owned()),
                            (
                                "Idem-Aggregate-Id".to_owned(),
                                format!("o-{}", i % AGGREGATES),
                            ),
                            ("Idem-Sequence".to_owned(), (i / AGGREGATES + 1).to_string()),
                        ],
                    };
                    p.publish(&msg).await.expect("publish");
                }
            });
        }
        while let Some(done) = tasks.join_next().await {
            done?;
        }
        ROWS as f64 / started.elapsed().as_secs_f64()
    };
    println!("raw {what} ({CONCURRENCY} concurrent): {raw:.0} msg/s");

    // 2. The relay: ROWS outbox rows over AGGREGATES aggregates, one relay,
    //    on an empty outbox.
    sqlx::query("TRUNCATE idem_outbox, idem_outbox_sequences")
        .execute(pool)
        .await?;
    let mut writers = JoinSet::new();
    for w in 0..8 {
        let pool = pool.clone();
        writers.spawn(async move {
            for chunk in (w..ROWS).step_by(8).collect::<Vec<_>>().chunks(50) {
                let mut tx = pool.begin().await.expect("begin");
                let mut rows: Vec<usize> = chunk.to_vec();
                rows.sort_by_key(|i| i % AGGREGATES); // stable aggregate order
                for i in rows {
                    let msg = OutboxMessage::new(
                        "order",
                        &format!("o-{}", i % AGGREGATES),
                        "Noted",
                        &format!(r#"{{"n":{i}}}"#),
                    )
                    .expect("valid");
                    Outbox::enqueue(&mut tx, &msg).await.expect("enqueue");
                }
                tx.commit().await.expect("commit");
            }
        });
    }
    while let Some(done) = writers.join_next().await {
        done?;
    }
    let relay = Relay::new(
        pool.clone(),
        lock_options.clone(),
        schema,
        publisher,
        RelayOptions {
            prefix: prefix.to_owned(),
            concurrency: CONCURRENCY,
            batch: std::env::var("B")
                .ok()
                .and_then(|b| b.parse().ok())
                .unwrap_or(5000),
            per_aggregate: std::env::var("PA")
                .ok()
                .and_then(|b| b.parse().ok())
                .unwrap_or(100),
            ..RelayOptions::default()
        },
    );
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let started = Instant::now();
    let running = tokio::spawn(relay.run(async {
        let _ = stopped.await;
    }));
    loop {
        let pending: i64 =
            sqlx::query_scalar("SELECT count(*) FROM idem_outbox WHERE state = 'pending'")
                .fetch_one(pool)
                .await?;
        if pending == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let relayed = ROWS as f64 / started.elapsed().as_secs_f64();
    let _ = stop.send(());
    let stats = running.await?;
    assert_eq!(stats.published as usize, ROWS);
    println!(
        "relay to {what} (1 process, {} partitions): {relayed:.0} msg/s",
        RelayOptions::default().partitions,
    );
    Ok((raw, relayed))
}
