//! The consumer runner against real PostgreSQL, NATS JetStream, RabbitMQ
//! and a Kafka-protocol broker (Tansu): a consumer process that dies after its commit and before its
//! acknowledgement changes nothing twice; a re-published event with a new
//! message id is stopped by the business key; out-of-order versions are
//! applied in order; poison messages and messages without an id are
//! parked; stopping finishes the message in hand; and the relay feeds the
//! runner through RabbitMQ, every event applied once, in order.

use crate::common;

use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use idem_messaging::{
    Consumer, ConsumerOptions, ConsumerStats, Delivery, Handler, HandlerError, JetStreamSource,
    JetStreamSourceOptions, KafkaSource, KafkaSourceOptions, Message, RabbitSource,
    RabbitSourceOptions, SettleError, Source,
};
use idem_postgres::PgOptions;
use idem_postgres::sqlx::{self, PgPool, Postgres, Transaction};
use lapin::options::{
    BasicGetOptions, BasicPublishOptions, ConfirmSelectOptions, ExchangeDeleteOptions,
    QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString};

use common::{Db, unique};
use idem_testkit::kafka;

/// Which broker a test runs against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Nats,
    Rabbit,
    Kafka,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Self::Nats => "nats",
            Self::Rabbit => "rabbit",
            Self::Kafka => "kafka",
        }
    }

    /// How long a consumer of this broker takes to start receiving: a
    /// Kafka group join (with the tests' 6 s session timeout, and a dead
    /// member to wait out) takes seconds, about 9 here; the others are at
    /// once. Twice that and more, for a loaded machine.
    fn join_time(self) -> Duration {
        match self {
            Self::Kafka => Duration::from_secs(20),
            _ => Duration::ZERO,
        }
    }
}

/// The aggregate types the tests publish under (Kafka: a topic each).
const AGGREGATES: [&str; 2] = ["payment", "order"];

/// A broker with this test's own names: a stream (NATS) or exchange and
/// queue (RabbitMQ), and where parked messages land.
struct Broker {
    kind: Kind,
    url: String,
    name: String,
    nats: Option<async_nats::Client>,
    amqp: Option<(lapin::Connection, lapin::Channel)>,
    kafka: Option<kafka::Producer>,
}

impl Broker {
    async fn new(kind: Kind, name: &str) -> Option<Self> {
        let url = match kind {
            Kind::Nats => idem_testkit::services::nats()?,
            Kind::Rabbit => idem_testkit::services::rabbitmq()?,
            Kind::Kafka => idem_testkit::services::kafka()?,
        };
        let mut broker = Self {
            kind,
            url,
            name: name.to_owned(),
            nats: None,
            amqp: None,
            kafka: None,
        };
        match kind {
            Kind::Nats => {
                let client = async_nats::connect(&broker.url).await.expect("NATS");
                let js = async_nats::jetstream::new(client.clone());
                for (stream, subject) in [
                    (broker.stream(), format!("{name}.>")),
                    (broker.parked_stream(), broker.parked_subject()),
                ] {
                    let _ = js.delete_stream(&stream).await;
                    common::create_stream(|| async {
                        js.create_stream(async_nats::jetstream::stream::Config {
                            name: stream.clone(),
                            subjects: vec![subject.clone()],
                            ..Default::default()
                        })
                        .await
                        .map(drop)
                    })
                    .await;
                }
                broker.nats = Some(client);
            }
            Kind::Rabbit => {
                let conn = lapin::Connection::connect(&broker.url, Default::default())
                    .await
                    .expect("RabbitMQ");
                let ch = conn.create_channel().await.expect("channel");
                ch.confirm_select(ConfirmSelectOptions::default())
                    .await
                    .expect("confirms");
                broker.amqp = Some((conn, ch));
            }
            Kind::Kafka => {
                let topics: Vec<String> = AGGREGATES
                    .iter()
                    .flat_map(|a| [format!("{name}.{a}"), format!("{name}.{a}.parked")])
                    .collect();
                kafka::create_topics(&broker.url, &topics, 3).await;
                broker.kafka = Some(kafka::producer(&broker.url));
            }
        }
        Some(broker)
    }

    fn stream(&self) -> String {
        self.name.to_uppercase()
    }

    fn parked_stream(&self) -> String {
        format!("{}_PARKED", self.stream())
    }

    fn parked_subject(&self) -> String {
        format!("{}_parked.messages", self.name)
    }

    fn rabbit_options(&self) -> RabbitSourceOptions {
        RabbitSourceOptions::new(
            &self.name,
            &format!("{}.q", self.name),
            &[&format!("{}.#", self.name)],
        )
    }

    /// A source for the consumer `durable` (NATS) / the test's queue.
    async fn source(&self, durable: &str, ack_wait: Duration) -> AnySource {
        match self.kind {
            Kind::Nats => {
                let mut options =
                    JetStreamSourceOptions::new(&self.stream(), durable, &self.parked_subject());
                options.ack_wait = ack_wait;
                let client = async_nats::connect(&self.url).await.expect("NATS");
                AnySource::Nats(Box::new(
                    JetStreamSource::bind(client, &options).await.expect("bind"),
                ))
            }
            Kind::Rabbit => AnySource::Rabbit(Box::new(
                RabbitSource::bind(&self.url, self.rabbit_options())
                    .await
                    .expect("bind"),
            )),
            Kind::Kafka => {
                let topics: Vec<String> = AGGREGATES
                    .iter()
                    .map(|a| format!("{}.{a}", self.name))
                    .collect();
                let topics: Vec<&str> = topics.iter().map(String::as_str).collect();
                let mut options =
                    KafkaSourceOptions::new(&format!("{}-{durable}", self.name), &topics);
                options.session_timeout = kafka::SESSION_TIMEOUT;
                AnySource::Kafka(Box::new(
                    KafkaSource::subscribe(&self.url, &options).expect("subscribe"),
                ))
            }
        }
    }

    /// Declares the queue (so messages published before the runner starts
    /// are kept).
    async fn prepare(&self) {
        if self.kind == Kind::Rabbit {
            self.source("-", Duration::from_secs(1)).await.close().await;
        }
    }

    /// Publishes one message (id `None`: without an id).
    async fn publish(
        &self,
        id: Option<&str>,
        subject: &str,
        headers: &[(&str, String)],
        payload: &str,
    ) {
        let subject = format!("{}.{subject}", self.name);
        match self.kind {
            Kind::Nats => {
                let js = async_nats::jetstream::new(self.nats.clone().expect("client"));
                let mut map = async_nats::HeaderMap::new();
                if let Some(id) = id {
                    map.insert(async_nats::header::NATS_MESSAGE_ID, id);
                }
                for (n, v) in headers {
                    map.insert(*n, v.as_str());
                }
                js.publish_with_headers(subject, map, Bytes::from(payload.to_owned()))
                    .await
                    .expect("publish")
                    .await
                    .expect("ack");
            }
            Kind::Rabbit => {
                let (_, ch) = self.amqp.as_ref().expect("channel");
                let mut table = FieldTable::default();
                for (n, v) in headers {
                    table.insert(
                        (*n).into(),
                        AMQPValue::LongString(LongString::from(v.as_str())),
                    );
                }
                let mut props = lapin::BasicProperties::default().with_headers(table);
                if let Some(id) = id {
                    props = props.with_message_id(id.into());
                }
                let confirm = ch
                    .basic_publish(
                        self.name.as_str().into(),
                        subject.as_str().into(),
                        BasicPublishOptions::default(),
                        payload.as_bytes(),
                        props,
                    )
                    .await
                    .expect("publish")
                    .await
                    .expect("confirm");
                assert!(confirm.is_ack());
            }
            Kind::Kafka => {
                // `<name>.<aggregate>.<type>`: topic `<name>.<aggregate>`.
                let (topic, kind) = subject.rsplit_once('.').expect("a subject with a type");
                let mut list: Vec<(&str, &str)> =
                    headers.iter().map(|(n, v)| (*n, v.as_str())).collect();
                list.push(("Idem-Message-Type", kind));
                if let Some(id) = id {
                    list.push(("Idem-Message-Id", id));
                }
                // Keyed as the relay keys: by aggregate id.
                let key = headers
                    .iter()
                    .find(|(n, _)| *n == "Idem-Aggregate-Id")
                    .map_or("k", |(_, v)| v.as_str());
                kafka::send(
                    self.kafka.as_ref().expect("producer"),
                    topic,
                    key,
                    &list,
                    payload,
                )
                .await;
            }
        }
    }

    /// The parked messages: (reason, payload).
    async fn parked(&self) -> Vec<(String, String)> {
        let mut out = Vec::new();
        match self.kind {
            Kind::Nats => {
                let js = async_nats::jetstream::new(self.nats.clone().expect("client"));
                let mut stream = js.get_stream(self.parked_stream()).await.expect("stream");
                let last = stream.info().await.expect("info").state.last_sequence;
                for seq in 1..=last {
                    let raw = stream.get_raw_message(seq).await.expect("parked message");
                    let reason = raw
                        .headers
                        .get("Idem-Parked-Reason")
                        .map(|v| v.to_string())
                        .unwrap_or_default();
                    out.push((reason, String::from_utf8_lossy(&raw.payload).into_owned()));
                }
            }
            Kind::Rabbit => {
                let (_, ch) = self.amqp.as_ref().expect("channel");
                let queue = self.rabbit_options().parked_queue();
                while let Some(m) = ch
                    .basic_get(queue.as_str().into(), BasicGetOptions { no_ack: true })
                    .await
                    .expect("get")
                {
                    let reason = m
                        .delivery
                        .properties
                        .headers()
                        .as_ref()
                        .and_then(|h| h.inner().get("Idem-Parked-Reason").cloned())
                        .map(|v| match v {
                            AMQPValue::LongString(s) => {
                                String::from_utf8_lossy(s.as_bytes()).into_owned()
                            }
                            other => format!("{other:?}"),
                        })
                        .unwrap_or_default();
                    out.push((
                        reason,
                        String::from_utf8_lossy(&m.delivery.data).into_owned(),
                    ));
                }
            }
            Kind::Kafka => {
                for a in AGGREGATES {
                    let topic = format!("{}.{a}.parked", self.name);
                    for record in kafka::read_all(&self.url, &topic).await {
                        let reason = record.header("Idem-Parked-Reason").unwrap_or_default();
                        out.push((reason, record.payload));
                    }
                }
            }
        }
        out
    }

    async fn cleanup(self) {
        match self.kind {
            Kind::Nats => {
                let js = async_nats::jetstream::new(self.nats.clone().expect("client"));
                let _ = js.delete_stream(self.stream()).await;
                let _ = js.delete_stream(self.parked_stream()).await;
            }
            Kind::Rabbit => {
                let (_, ch) = self.amqp.as_ref().expect("channel");
                let o = self.rabbit_options();
                for q in [o.queue.clone(), o.retry_queue(), o.parked_queue()] {
                    let _ = ch
                        .queue_delete(q.as_str().into(), QueueDeleteOptions::default())
                        .await;
                }
                let _ = ch
                    .exchange_delete(self.name.as_str().into(), ExchangeDeleteOptions::default())
                    .await;
            }
            // Tansu keeps topics in memory: they go with the broker.
            Kind::Kafka => {}
        }
    }
}

/// Either broker's source, so one test body serves both.
enum AnySource {
    Nats(Box<JetStreamSource>),
    Rabbit(Box<RabbitSource>),
    Kafka(Box<KafkaSource>),
}

enum AnyDelivery {
    Nats(idem_messaging::JetStreamDelivery),
    Rabbit(idem_messaging::RabbitDelivery),
    Kafka(idem_messaging::KafkaDelivery),
}

impl Source for AnySource {
    type Delivery = AnyDelivery;
    async fn close(self) {
        match self {
            Self::Nats(s) => s.close().await,
            Self::Rabbit(s) => s.close().await,
            Self::Kafka(s) => s.close().await,
        }
    }
    async fn next(&mut self) -> Option<Result<AnyDelivery, SettleError>> {
        match self {
            Self::Nats(s) => s.next().await.map(|r| r.map(AnyDelivery::Nats)),
            Self::Rabbit(s) => s.next().await.map(|r| r.map(AnyDelivery::Rabbit)),
            Self::Kafka(s) => s.next().await.map(|r| r.map(AnyDelivery::Kafka)),
        }
    }
}

impl Delivery for AnyDelivery {
    fn message(&self) -> &Message {
        match self {
            Self::Nats(d) => d.message(),
            Self::Rabbit(d) => d.message(),
            Self::Kafka(d) => d.message(),
        }
    }
    async fn ack(self) -> Result<(), SettleError> {
        if std::env::var_os(CRASH_ENV).is_some() {
            // The crash this test is about: committed, not acknowledged.
            std::process::abort();
        }
        match self {
            Self::Nats(d) => d.ack().await,
            Self::Rabbit(d) => d.ack().await,
            Self::Kafka(d) => d.ack().await,
        }
    }
    async fn retry(self, delay: Duration) -> Result<(), SettleError> {
        match self {
            Self::Nats(d) => d.retry(delay).await,
            Self::Rabbit(d) => d.retry(delay).await,
            Self::Kafka(d) => d.retry(delay).await,
        }
    }
    async fn park(self, reason: &str) -> Result<(), SettleError> {
        match self {
            Self::Nats(d) => d.park(reason).await,
            Self::Rabbit(d) => d.park(reason).await,
            Self::Kafka(d) => d.park(reason).await,
        }
    }
}

/// Set in the child process: abort instead of acknowledging.
const CRASH_ENV: &str = "IDEM_CONSUMER_CRASH_CHILD";

/// The order service's handler for `PaymentAuthorized {order_id,
/// payment_id}`: applies a payment once per *payment id* (the business
/// identity, guarded by `payments_applied`'s primary key), whatever the
/// message id; logs every applied version of the order.
#[derive(Default, Clone)]
struct Orders {
    calls: Arc<AtomicUsize>,
    slow: Option<Duration>,
    fail: Option<&'static str>,
}

#[derive(serde::Deserialize)]
struct PaymentAuthorized {
    order_id: String,
    payment_id: String,
}

impl Handler for Orders {
    async fn handle(
        &self,
        tx: &mut Transaction<'static, Postgres>,
        msg: &Message,
    ) -> Result<(), HandlerError> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        let event: PaymentAuthorized = msg.json()?;
        if self.fail == Some(event.payment_id.as_str()) {
            return Err(HandlerError::retry("the ledger is down"));
        }
        if let Some(pause) = self.slow {
            tokio::time::sleep(pause).await;
        }
        sqlx::query("INSERT INTO orders (id) VALUES ($1) ON CONFLICT DO NOTHING")
            .bind(&event.order_id)
            .execute(&mut **tx)
            .await?;
        // The business identity: a second event for the same payment,
        // whatever its message id, changes nothing.
        let fresh = sqlx::query(
            "INSERT INTO payments_applied (payment_id, order_id) VALUES ($1, $2) ON CONFLICT DO NOTHING",
        )
        .bind(&event.payment_id)
        .bind(&event.order_id)
        .execute(&mut **tx)
        .await?
        .rows_affected()
            == 1;
        if fresh {
            sqlx::query(
                "UPDATE orders SET paid_count = paid_count + 1, applied = applied || $2 WHERE id = $1",
            )
            .bind(&event.order_id)
            .bind(msg.header("Idem-Sequence").unwrap_or(&event.payment_id))
            .execute(&mut **tx)
            .await?;
        }
        Ok(())
    }
}

fn payment(order: &str, payment: &str) -> String {
    format!(r#"{{"order_id":"{order}","payment_id":"{payment}"}}"#)
}

fn ordering(order: &str, sequence: i64) -> Vec<(&'static str, String)> {
    vec![
        ("Idem-Aggregate-Type", "order".to_owned()),
        ("Idem-Aggregate-Id", order.to_owned()),
        ("Idem-Sequence", sequence.to_string()),
    ]
}

/// Runs `handler` on `source` until `done` says so (checked every 50 ms)
/// or 60 s pass.
async fn run_until<S, F, Fut>(
    db: &Db,
    handler: Orders,
    options: ConsumerOptions,
    source: S,
    done: F,
) -> ConsumerStats
where
    S: Source,
    F: Fn(ConsumerProbe) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = bool> + Send,
{
    let consumer = Consumer::new(db.pool(), handler, options);
    let probe = ConsumerProbe { pool: db.pool() };
    let stop = async move {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        while tokio::time::Instant::now() < deadline {
            if done(probe.clone()).await {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        eprintln!("run_until: gave up after 60 s");
    };
    consumer.run(source, stop).await
}

#[derive(Clone)]
struct ConsumerProbe {
    pool: PgPool,
}

impl ConsumerProbe {
    async fn scalar(&self, sql: &str) -> i64 {
        sqlx::query_scalar(sql)
            .fetch_one(&self.pool)
            .await
            .unwrap_or(-1)
    }
}

/// The child half of `a_crash_after_commit_before_ack_is_a_duplicate_*`:
/// handles messages and aborts where it would acknowledge.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "child process of a_crash_after_commit_before_ack_is_a_duplicate"]
async fn crash_child_consumer() {
    let (Ok(kind), Ok(name), Ok(url), Ok(schema)) = (
        std::env::var(CRASH_ENV),
        std::env::var("IDEM_CONSUMER_BROKER_NAME"),
        std::env::var("IDEM_CONSUMER_DB_URL"),
        std::env::var("IDEM_CONSUMER_DB_SCHEMA"),
    ) else {
        return;
    };
    let kind = [Kind::Nats, Kind::Rabbit, Kind::Kafka]
        .into_iter()
        .find(|k| k.name() == kind)
        .expect("a broker kind");
    let broker = Broker::new_existing(kind, &name).await;
    let db = Db::open(&url, schema).await.expect("database");
    let source = broker.source("orders", Duration::from_secs(1)).await;
    Consumer::new(db.pool(), Orders::default(), ConsumerOptions::new("orders"))
        .run(source, std::future::pending())
        .await;
}

impl Broker {
    /// The broker objects made by the parent (the child must not recreate
    /// the stream).
    async fn new_existing(kind: Kind, name: &str) -> Self {
        let url = match kind {
            Kind::Nats => idem_testkit::services::nats(),
            Kind::Rabbit => idem_testkit::services::rabbitmq(),
            Kind::Kafka => idem_testkit::services::kafka(),
        }
        .expect("broker");
        Self {
            kind,
            url,
            name: name.to_owned(),
            nats: None,
            amqp: None,
            kafka: None,
        }
    }
}

async fn crash_after_commit_before_ack(kind: Kind) {
    let (Some(db), Some(broker)) = (
        Db::new("crash").await,
        Broker::new(kind, &unique("crash")).await,
    ) else {
        return;
    };
    broker.prepare().await;
    broker
        .publish(
            Some("evt-1"),
            "payment.PaymentAuthorized",
            &[],
            &payment("o-1", "pay-1"),
        )
        .await;
    let status = tokio::task::spawn_blocking({
        let (name, url, schema) = (broker.name.clone(), db.url.clone(), db.schema.clone());
        move || {
            // A test's name is its path in the binary, without the crate.
            let module = module_path!().split_once("::").map_or("", |(_, m)| m);
            let child_test = format!("{module}::crash_child_consumer");
            Command::new(std::env::current_exe().expect("test binary"))
                .args([
                    "--ignored",
                    "--exact",
                    child_test.as_str(),
                    "--nocapture",
                    "--test-threads",
                    "1",
                ])
                .env(CRASH_ENV, kind.name())
                .env("IDEM_CONSUMER_BROKER_NAME", name)
                .env("IDEM_CONSUMER_DB_URL", url)
                .env("IDEM_CONSUMER_DB_SCHEMA", schema)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .expect("child")
        }
    })
    .await
    .expect("join");
    assert!(
        !status.success(),
        "the child must die at its acknowledgement"
    );
    // The child committed: the change is there once, with its inbox row.
    assert_eq!(
        db.scalar("SELECT paid_count::bigint FROM orders WHERE id = 'o-1'")
            .await,
        1
    );
    assert_eq!(
        db.scalar("SELECT count(*) FROM idem_inbox WHERE message_id = 'evt-1'")
            .await,
        1
    );

    // The broker delivers the message again; the redelivery is a duplicate.
    let handler = Orders::default();
    let calls = Arc::clone(&handler.calls);
    let source = broker.source("orders", Duration::from_secs(1)).await;
    let stats = Consumer::new(db.pool(), handler, ConsumerOptions::new("orders"))
        .run(
            source,
            tokio::time::sleep(Duration::from_secs(4) + kind.join_time()),
        )
        .await;
    assert_eq!(stats.duplicates, 1, "{stats:?}");
    assert_eq!(stats.applied, 0, "{stats:?}");
    assert_eq!(
        calls.load(Ordering::SeqCst),
        0,
        "the handler is not called for a duplicate"
    );
    assert_eq!(
        db.scalar("SELECT paid_count::bigint FROM orders WHERE id = 'o-1'")
            .await,
        1
    );
    broker.cleanup().await;
    db.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_after_commit_before_ack_is_a_duplicate_nats() {
    crash_after_commit_before_ack(Kind::Nats).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_after_commit_before_ack_is_a_duplicate_rabbitmq() {
    crash_after_commit_before_ack(Kind::Rabbit).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_after_commit_before_offset_commit_is_a_duplicate_kafka() {
    crash_after_commit_before_ack(Kind::Kafka).await;
}

async fn business_identity_and_ordering(kind: Kind) {
    let (Some(db), Some(broker)) = (
        Db::new("order").await,
        Broker::new(kind, &unique("order")).await,
    ) else {
        return;
    };
    broker.prepare().await;
    // The same payment announced twice under two message ids (a producer
    // without an outbox retried its publish): the business key stops it.
    broker
        .publish(
            Some("a-1"),
            "payment.PaymentAuthorized",
            &[],
            &payment("o-1", "pay-1"),
        )
        .await;
    broker
        .publish(
            Some("a-2"),
            "payment.PaymentAuthorized",
            &[],
            &payment("o-1", "pay-1"),
        )
        .await;
    // Versions 1..=20 of order o-2, published in a scrambled order, and
    // version 5 published again under another id (stale).
    let mut versions: Vec<i64> = (1..=20).collect();
    versions.sort_by_key(|v| (v * 7919) % 23);
    for v in &versions {
        broker
            .publish(
                Some(&format!("v-{v}")),
                "order.PaymentAuthorized",
                &ordering("o-2", *v),
                &payment("o-2", &format!("pay-v{v}")),
            )
            .await;
    }
    broker
        .publish(
            Some("v-5-again"),
            "order.PaymentAuthorized",
            &ordering("o-2", 5),
            &payment("o-2", "pay-v5"),
        )
        .await;
    let source = broker.source("orders", Duration::from_secs(5)).await;
    let mut options = ConsumerOptions::new("orders");
    options.gap_delay = Duration::from_millis(20);
    options.max_deliveries = 1000;
    let stats = run_until(&db, Orders::default(), options, source, |p| async move {
        p.scalar("SELECT count(*) FROM idem_inbox").await == 23
    })
    .await;
    assert_eq!(
        db.scalar("SELECT paid_count::bigint FROM orders WHERE id = 'o-1'")
            .await,
        1
    );
    let applied = db.applied("o-2").await;
    let expected: Vec<String> = (1..=20).map(|v| v.to_string()).collect();
    assert_eq!(applied, expected, "versions applied in order, each once");
    assert_eq!(stats.stale, 1, "{stats:?}");
    assert_eq!(stats.applied, 22, "{stats:?}");
    assert_eq!(stats.parked, 0, "{stats:?}");
    broker.cleanup().await;
    db.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn business_identity_and_ordering_nats() {
    business_identity_and_ordering(Kind::Nats).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn business_identity_and_ordering_rabbitmq() {
    business_identity_and_ordering(Kind::Rabbit).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn business_identity_and_ordering_kafka() {
    business_identity_and_ordering(Kind::Kafka).await;
}

/// Two members of one Kafka group and three partitions: a second member
/// joins while the first is handling (a rebalance splits the partitions),
/// then, once the second has handled one, the first leaves (the second
/// takes them all). Messages the first
/// held uncommitted are read again by their new owner; every event is
/// applied once, each order's versions in order, and the copies are inbox
/// duplicates.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn rebalances_apply_every_event_once_in_order_kafka() {
    let (Some(db), Some(broker)) = (
        Db::new("rebalance").await,
        Broker::new(Kind::Kafka, &unique("rebalance")).await,
    ) else {
        return;
    };
    let (orders, versions) = (30, 10);
    for v in 1..=versions {
        for o in 0..orders {
            let order = format!("o-{o}");
            broker
                .publish(
                    Some(&format!("{order}-v{v}")),
                    "order.PaymentAuthorized",
                    &ordering(&order, v),
                    &payment(&order, &format!("pay-{o}-{v}")),
                )
                .await;
        }
    }
    let total = orders * versions;
    // Slow enough that the first member is still at work when the second
    // has joined (a Tansu join takes seconds).
    let handler = Orders {
        slow: Some(Duration::from_millis(250)),
        ..Orders::default()
    };
    let second_handler = Orders {
        calls: Arc::new(AtomicUsize::new(0)),
        ..handler.clone()
    };
    let second_calls = Arc::clone(&second_handler.calls);
    let options = || {
        let mut options = ConsumerOptions::new("orders");
        options.gap_delay = Duration::from_millis(20);
        options.max_deliveries = 1000;
        options
    };
    let inbox = move |p: ConsumerProbe, n: i64| async move {
        p.scalar("SELECT count(*) FROM idem_inbox").await >= n
    };
    // The first member, until the second has handled one (the partitions
    // were split between them), then it leaves.
    let first = {
        let (db_pool, source) = (
            db.pool(),
            broker.source("orders", Duration::from_secs(5)).await,
        );
        let handler = handler.clone();
        let options = options();
        tokio::spawn(async move {
            let consumer = Consumer::new(db_pool.clone(), handler, options);
            let probe = ConsumerProbe { pool: db_pool };
            consumer
                .run(source, async move {
                    while second_calls.load(Ordering::SeqCst) == 0
                        && !inbox(probe.clone(), total).await
                    {
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                })
                .await
        })
    };
    // The second member joins once the first has applied some.
    let probe = ConsumerProbe { pool: db.pool() };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while !inbox(probe.clone(), total / 10).await {
        assert!(tokio::time::Instant::now() < deadline, "nothing applied");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let source = broker.source("orders", Duration::from_secs(5)).await;
    let second = run_until(
        &db,
        second_handler,
        options(),
        source,
        move |p| async move { p.scalar("SELECT count(*) FROM idem_inbox").await >= total },
    )
    .await;
    let first = first.await.expect("first member");
    eprintln!("kafka rebalance: first member {first:?}; second member {second:?}");
    for o in 0..orders {
        let expected: Vec<String> = (1..=versions).map(|v| v.to_string()).collect();
        assert_eq!(
            db.applied(&format!("o-{o}")).await,
            expected,
            "o-{o}: every version once, in order"
        );
    }
    assert_eq!(
        first.applied + second.applied,
        total as u64,
        "{first:?} {second:?}"
    );
    assert_eq!(first.parked + second.parked, 0, "{first:?} {second:?}");
    // The second member took partitions: it was handed deliveries. Whether
    // any of them was still new depends on how far the first had got when
    // the rebalance finished (a Tansu join takes seconds: the first may
    // have applied all 300, and the second then reads only copies).
    assert!(
        second.applied + second.duplicates > 0,
        "the second member took partitions: {second:?}"
    );
    broker.cleanup().await;
    db.drop().await;
}

async fn poison_and_id_less_messages_are_parked(kind: Kind) {
    let (Some(db), Some(broker)) = (
        Db::new("park").await,
        Broker::new(kind, &unique("park")).await,
    ) else {
        return;
    };
    broker.prepare().await;
    broker
        .publish(
            Some("p-1"),
            "payment.PaymentAuthorized",
            &[],
            &payment("o-1", "poison"),
        )
        .await;
    broker
        .publish(
            None,
            "payment.PaymentAuthorized",
            &[],
            &payment("o-1", "no-id"),
        )
        .await;
    broker
        .publish(
            Some("p-3"),
            "payment.PaymentAuthorized",
            &[],
            "this is not JSON",
        )
        .await;
    broker
        .publish(
            Some("p-4"),
            "payment.PaymentAuthorized",
            &[],
            &payment("o-1", "good"),
        )
        .await;
    let handler = Orders {
        fail: Some("poison"),
        ..Orders::default()
    };
    let calls = Arc::clone(&handler.calls);
    let mut options = ConsumerOptions::new("orders");
    options.max_deliveries = 3;
    options.backoff = Duration::from_millis(10);
    let source = broker.source("orders", Duration::from_secs(5)).await;
    // Three deliveries of the poison message with short backoffs, then
    // quiet.
    let stats = Consumer::new(db.pool(), handler, options)
        .run(
            source,
            tokio::time::sleep(Duration::from_secs(4) + kind.join_time()),
        )
        .await;
    assert_eq!(stats.parked, 3, "{stats:?}");
    assert_eq!(stats.applied, 1, "{stats:?}");
    assert_eq!(stats.retried, 2, "{stats:?}");
    // poison: 3 deliveries; not JSON: 1; good: 1; no id: never.
    assert_eq!(calls.load(Ordering::SeqCst), 5);
    let mut parked = broker.parked().await;
    parked.sort();
    assert_eq!(parked.len(), 3, "{parked:?}");
    assert!(
        parked
            .iter()
            .any(|(why, body)| why.contains("failed 3 deliveries")
                && why.contains("ledger is down")
                && body.contains("poison")),
        "{parked:?}"
    );
    assert!(
        parked
            .iter()
            .any(|(why, body)| why.contains("no id") && body.contains("no-id")),
        "{parked:?}"
    );
    assert!(
        parked
            .iter()
            .any(|(why, body)| why.contains("not the expected JSON") && body == "this is not JSON"),
        "{parked:?}"
    );
    // Nothing of the failed messages was committed, not even an inbox row.
    assert_eq!(db.scalar("SELECT count(*) FROM idem_inbox").await, 1);
    broker.cleanup().await;
    db.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poison_and_id_less_messages_are_parked_nats() {
    poison_and_id_less_messages_are_parked(Kind::Nats).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poison_and_id_less_messages_are_parked_rabbitmq() {
    poison_and_id_less_messages_are_parked(Kind::Rabbit).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poison_and_id_less_messages_are_parked_kafka() {
    poison_and_id_less_messages_are_parked(Kind::Kafka).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stopping_finishes_the_message_in_hand() {
    let (Some(db), Some(broker)) = (
        Db::new("stop").await,
        Broker::new(Kind::Nats, &unique("stop")).await,
    ) else {
        return;
    };
    broker
        .publish(
            Some("s-1"),
            "payment.PaymentAuthorized",
            &[],
            &payment("o-1", "pay-1"),
        )
        .await;
    let handler = Orders {
        slow: Some(Duration::from_millis(1500)),
        ..Orders::default()
    };
    let calls = Arc::clone(&handler.calls);
    let source = broker.source("orders", Duration::from_secs(30)).await;
    let stop = {
        let calls = Arc::clone(&calls);
        async move {
            while calls.load(Ordering::SeqCst) == 0 {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    };
    let stats = Consumer::new(db.pool(), handler, ConsumerOptions::new("orders"))
        .run(source, stop)
        .await;
    assert_eq!(
        stats.applied, 1,
        "the message in hand was finished: {stats:?}"
    );
    assert_eq!(
        db.scalar("SELECT paid_count::bigint FROM orders WHERE id = 'o-1'")
            .await,
        1
    );
    // …and acknowledged: a new runner gets nothing (no redelivery).
    let source = broker.source("orders", Duration::from_secs(30)).await;
    let stats = Consumer::new(db.pool(), Orders::default(), ConsumerOptions::new("orders"))
        .run(source, tokio::time::sleep(Duration::from_secs(2)))
        .await;
    assert_eq!(stats, ConsumerStats::default());
    broker.cleanup().await;
    db.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relay_feeds_the_runner_through_rabbitmq_once_and_in_order() {
    use idem_messaging::{RabbitPublisher, Relay, RelayOptions};
    use idem_postgres::outbox::{Outbox, OutboxMessage};
    const AGGREGATES: usize = 10;
    const EVENTS: usize = 50;
    let (Some(db), Some(broker)) = (
        Db::new("rmq").await,
        Broker::new(Kind::Rabbit, &unique("rmq")).await,
    ) else {
        return;
    };
    broker.prepare().await;
    for e in 1..=EVENTS {
        let mut tx = db.store.pool().begin().await.expect("begin");
        for a in 0..AGGREGATES {
            let msg = OutboxMessage::new(
                "order",
                &format!("o-{a}"),
                "PaymentAuthorized",
                &payment(&format!("o-{a}"), &format!("pay-{a}-{e}")),
            )
            .expect("message");
            Outbox::enqueue(&mut tx, &msg).await.expect("enqueue");
        }
        tx.commit().await.expect("commit");
    }
    let publisher = RabbitPublisher::connect(&broker.url, &broker.name)
        .await
        .expect("publisher");
    let opts = PgOptions::from_url(&db.url).expect("url");
    let relay = Relay::new(
        db.pool(),
        opts.connect_options().clone(),
        &db.schema,
        publisher,
        RelayOptions {
            prefix: broker.name.clone(),
            ..RelayOptions::default()
        },
    );
    let relay_stop = Arc::new(tokio::sync::Notify::new());
    let relay_task = tokio::spawn({
        let stop = Arc::clone(&relay_stop);
        async move { relay.run(async move { stop.notified().await }).await }
    });
    let source = broker.source("orders", Duration::from_secs(5)).await;
    let mut options = ConsumerOptions::new("orders");
    options.gap_delay = Duration::from_millis(20);
    let total = (AGGREGATES * EVENTS) as i64;
    let stats = run_until(
        &db,
        Orders::default(),
        options,
        source,
        move |p| async move { p.scalar("SELECT count(*) FROM idem_inbox").await == total },
    )
    .await;
    relay_stop.notify_one();
    let relayed = relay_task.await.expect("relay");
    assert_eq!(relayed.published, total as u64);
    assert_eq!(stats.applied, total as u64, "{stats:?}");
    let expected: Vec<String> = (1..=EVENTS).map(|v| v.to_string()).collect();
    for a in 0..AGGREGATES {
        assert_eq!(db.applied(&format!("o-{a}")).await, expected, "order o-{a}");
    }
    broker.cleanup().await;
    db.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_runner_purges_its_own_inbox_rows_past_retention() {
    let (Some(db), Some(broker)) = (
        Db::new("purge").await,
        Broker::new(Kind::Nats, &unique("purge")).await,
    ) else {
        return;
    };
    sqlx::query(
        "INSERT INTO idem_inbox (consumer, message_id, processed_at) VALUES \
         ('orders', 'old', now() - interval '8 days'), \
         ('orders', 'recent', now() - interval '1 day'), \
         ('billing', 'old', now() - interval '8 days')",
    )
    .execute(&db.pool())
    .await
    .expect("seed");
    let source = broker.source("orders", Duration::from_secs(30)).await;
    // Default retention: 7 days, checked when the runner starts and then
    // every minute.
    let stats = run_until(
        &db,
        Orders::default(),
        ConsumerOptions::new("orders"),
        source,
        |p| async move {
            p.scalar("SELECT count(*) FROM idem_inbox WHERE consumer = 'orders'")
                .await
                == 1
        },
    )
    .await;
    assert_eq!(stats, ConsumerStats::default());
    assert_eq!(
        db.scalar(
            "SELECT count(*) FROM idem_inbox WHERE consumer = 'orders' AND message_id = 'old'"
        )
        .await,
        0,
        "past retention: deleted"
    );
    assert_eq!(
        db.scalar("SELECT count(*) FROM idem_inbox WHERE message_id = 'recent'")
            .await,
        1
    );
    assert_eq!(
        db.scalar("SELECT count(*) FROM idem_inbox WHERE consumer = 'billing'")
            .await,
        1,
        "another consumer's rows are its own business"
    );
    broker.cleanup().await;
    db.drop().await;
}
