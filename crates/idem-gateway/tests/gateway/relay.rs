//! `idem relay` against real PostgreSQL and NATS JetStream: 10,000 outbox
//! rows over 100 aggregates, three relays publishing at once, one killed
//! with SIGKILL mid-way and started again. Every row reaches the stream
//! exactly once (after the broker's de-duplication), in order per
//! aggregate, and every row ends up marked published.

use std::collections::HashMap;
use std::process::Stdio;
use std::time::Duration;

use idem_postgres::outbox::{Outbox, OutboxMessage};
use idem_postgres::sqlx;
use idem_postgres::{PgOptions, PgStore};
use idem_testkit::isolated::PgSchema;
use idem_testkit::services;
use idem_testkit::wait::eventually;
use tokio::io::AsyncBufReadExt;
use tokio::process::{Child, Command};

const IDEM: &str = env!("CARGO_BIN_EXE_idem");
const AGGREGATES: usize = 100;
const PER_AGGREGATE: usize = 100;

struct RelayProcess {
    admin: std::net::SocketAddr,
    child: Child,
    stdout: tokio::io::Lines<tokio::io::BufReader<tokio::process::ChildStdout>>,
}

async fn start_relay(store: &str, broker: &str, stream: &str, prefix: &str) -> RelayProcess {
    start_relay_with(store, broker, stream, prefix, &[], Stdio::inherit()).await
}

async fn start_relay_with(
    store: &str,
    broker: &str,
    stream: &str,
    prefix: &str,
    extra: &[&str],
    stderr: Stdio,
) -> RelayProcess {
    let mut args = vec!["--stream", stream, "--prefix", prefix, "--create-stream"];
    args.extend_from_slice(extra);
    spawn_relay(store, broker, &args, stderr).await
}

/// Starts `idem relay` on `store` and `broker` with `args`, and waits for
/// its start line.
async fn spawn_relay(store: &str, broker: &str, args: &[&str], stderr: Stdio) -> RelayProcess {
    let mut child = Command::new(IDEM)
        .args([
            "--log", "warn", "relay", "--store", store, "--broker", broker,
        ])
        .args(["--admin-listen", "127.0.0.1:0"])
        .args(args)
        .stdout(Stdio::piped())
        .stderr(stderr)
        .kill_on_drop(true)
        .spawn()
        .expect("spawn idem relay");
    let mut lines = tokio::io::BufReader::new(child.stdout.take().expect("stdout")).lines();
    let line = tokio::time::timeout(Duration::from_secs(30), lines.next_line())
        .await
        .expect("the relay starts")
        .expect("stdout")
        .expect("a start line");
    assert!(line.starts_with("idem relay: publishing"), "{line}");
    let admin = line
        .rsplit_once("admin ")
        .and_then(|(_, a)| a.trim().parse().ok())
        .unwrap_or_else(|| panic!("no admin address in {line:?}"));
    RelayProcess {
        admin,
        child,
        stdout: lines,
    }
}

fn kill(p: &RelayProcess, signal: &str) {
    let pid = p.child.id().expect("running").to_string();
    std::process::Command::new("kill")
        .args([signal, &pid])
        .status()
        .expect("kill");
}

/// While the broker is away: nothing published, no attempt spent, nothing
/// dead.
async fn assert_nothing_spent(store: &PgStore) {
    let (published, attempts, dead): (i64, i64, i64) = sqlx::query_as(
        "SELECT count(*) FILTER (WHERE state = 'published'), COALESCE(sum(attempts), 0), \
         count(*) FILTER (WHERE state = 'dead') FROM idem_outbox",
    )
    .fetch_one(store.pool())
    .await
    .expect("counts");
    assert_eq!(
        (published, attempts, dead),
        (0, 0, 0),
        "nothing published, spent or dead while the broker is away"
    );
}

async fn published_count(store: &PgStore) -> i64 {
    published(store).await
}

async fn published(store: &PgStore) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM idem_outbox WHERE state = 'published'")
        .fetch_one(store.pool())
        .await
        .expect("count")
}

/// Starts three relays with `start`, SIGKILLs one once about a third of
/// `total` rows is published and starts it again, and waits until every
/// row is marked published; returns the three running relays.
async fn three_relays_one_killed<F, Fut>(store: &PgStore, total: i64, start: F) -> Vec<RelayProcess>
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = RelayProcess>,
{
    let mut relays = Vec::new();
    for _ in 0..3 {
        relays.push(start().await);
    }
    for _ in 0..600 {
        if published(store).await >= total / 3 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let victim = relays.remove(0);
    kill(&victim, "-KILL");
    drop(victim);
    relays.push(start().await);
    for _ in 0..1200 {
        if published(store).await == total {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(published(store).await, total, "every row marked published");
    relays
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_relays_one_killed_every_row_once_in_order() {
    let Some(pg) = services::postgres() else {
        return;
    };
    let Some(nats) = services::nats() else {
        return;
    };
    let tag = format!("{:08x}", idem::OwnerToken::random().as_u128() as u32);
    let schema = PgSchema::on(&pg, "relay");
    let store_url = format!("{}&max_connections=4", schema.url());
    let store = PgStore::connect_with(PgOptions::from_url(&store_url).expect("url"))
        .await
        .expect("connect");
    let (stream, prefix) = (format!("IDEMTEST_{tag}"), format!("idemtest{tag}"));

    // 10,000 events: 100 per aggregate, written by 10 concurrent writers.
    let mut writers = tokio::task::JoinSet::new();
    for w in 0..10 {
        let pool = store.pool().clone();
        writers.spawn(async move {
            for i in 0..PER_AGGREGATE {
                let mut tx = pool.begin().await.expect("begin");
                for a in (w..AGGREGATES).step_by(10) {
                    let msg = OutboxMessage::new(
                        "order",
                        &format!("o-{a}"),
                        "OrderNoted",
                        &format!(r#"{{"aggregate":{a},"n":{i}}}"#),
                    )
                    .expect("valid");
                    Outbox::enqueue(&mut tx, &msg).await.expect("enqueue");
                }
                tx.commit().await.expect("commit");
            }
        });
    }
    while let Some(done) = writers.join_next().await {
        done.expect("writer");
    }
    let total = (AGGREGATES * PER_AGGREGATE) as i64;

    let relays = three_relays_one_killed(&store, total, || {
        start_relay(&store_url, &nats, &stream, &prefix)
    })
    .await;
    for r in &relays {
        kill(r, "-TERM");
    }
    for mut r in relays {
        let status = tokio::time::timeout(Duration::from_secs(20), r.child.wait())
            .await
            .expect("stops on SIGTERM")
            .expect("wait");
        assert!(status.success(), "clean exit: {status}");
        let summary = r
            .stdout
            .next_line()
            .await
            .expect("stdout")
            .unwrap_or_default();
        assert!(
            summary.starts_with("idem relay: stopped after publishing"),
            "{summary}"
        );
    }

    let js = stream_once_in_order(&nats, &stream, &prefix, AGGREGATES, PER_AGGREGATE).await;
    js.delete_stream(&stream).await.expect("delete stream");
    drop(schema);
}

/// Reads the stream back: exactly one message per row (no duplicate got
/// past the broker's de-duplication), each aggregate's sequence numbers
/// strictly 1, 2, 3… in stream order. Returns the JetStream context.
async fn stream_once_in_order(
    nats: &str,
    stream: &str,
    prefix: &str,
    aggregates: usize,
    per_aggregate: usize,
) -> async_nats::jetstream::Context {
    let client = async_nats::connect(nats).await.expect("nats");
    let js = async_nats::jetstream::new(client);
    let mut s = js.get_stream(stream).await.expect("stream");
    let messages = s.info().await.expect("info").state.messages;
    assert_eq!(
        messages,
        (aggregates * per_aggregate) as u64,
        "no duplicate reached the stream"
    );
    let mut next: HashMap<String, i64> = HashMap::new();
    let mut ids = std::collections::HashSet::new();
    for seq in 1..=messages {
        let m = s.get_raw_message(seq).await.expect("message");
        let header = |name: &str| {
            m.headers
                .get(name)
                .map(|v| v.as_str().to_owned())
                .unwrap_or_else(|| panic!("{name} missing on message {seq}"))
        };
        assert!(ids.insert(header("Nats-Msg-Id")), "id repeated at {seq}");
        let aggregate = header("Idem-Aggregate-Id");
        let sequence: i64 = header("Idem-Sequence").parse().expect("number");
        let expected = next.entry(aggregate.clone()).or_insert(1);
        assert_eq!(
            sequence, *expected,
            "{aggregate} out of order at stream seq {seq}"
        );
        *expected += 1;
        assert_eq!(m.subject.as_str(), format!("{prefix}.order.OrderNoted"));
    }
    assert_eq!(next.len(), aggregates);
    assert!(next.values().all(|n| *n == per_aggregate as i64 + 1));
    js
}

/// Waits (up to a minute) until `n` rows are published.
async fn until_published(store: &PgStore, n: i64) {
    for _ in 0..600 {
        if published(store).await >= n {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(published(store).await, n, "rows published in time");
}

/// The broker link turns slow (latency with jitter), then silent (a black
/// hole: the relay's connection stays open and nothing comes back), then
/// returns: nothing is marked published that the broker did not confirm,
/// and every row reaches the stream once, in order per aggregate.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_slow_then_silent_broker_link_delivers_every_row_once_in_order() {
    let Some(pg) = services::postgres() else {
        return;
    };
    let Some(nats) = services::nats() else {
        return;
    };
    let (store, store_url, schema, stream, prefix) = isolated(&pg, "hole").await;
    let proxy = idem_testkit::fault::FaultProxy::start(services::socket_addr(&nats)).await;
    let via_proxy = services::via(&nats, proxy.addr(), "");
    let mut relay = start_relay(&store_url, &via_proxy, &stream, &prefix).await;

    enqueue(&store, 5, 4).await;
    until_published(&store, 20).await;

    proxy.set_latency(Duration::from_millis(100), Duration::from_millis(100));
    enqueue(&store, 5, 4).await;
    until_published(&store, 40).await;

    proxy.restore();
    proxy.blackhole();
    enqueue(&store, 5, 4).await;
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(
        published(&store).await,
        40,
        "nothing confirmed through the hole"
    );

    proxy.restore();
    until_published(&store, 60).await;
    kill(&relay, "-TERM");
    let _ = tokio::time::timeout(Duration::from_secs(20), relay.child.wait()).await;
    let _ = relay.stdout.next_line().await;

    let js = stream_once_in_order(&nats, &stream, &prefix, 5, 12).await;
    js.delete_stream(&stream).await.expect("delete stream");
    drop(schema);
}

/// A database restored, recreated or failed over hands out row numbers
/// that were published already. Two fresh outboxes under one source (as
/// the same service's database before and after a restore) publish to one
/// stream within its de-duplication window: every event of both arrives,
/// once. With row numbers as ids, the second's were dropped as copies.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_recreated_database_never_reuses_a_published_event_id() {
    let Some(pg) = services::postgres() else {
        return;
    };
    let Some(nats) = services::nats() else {
        return;
    };
    let (before, before_url, before_schema, stream, prefix) = isolated(&pg, "restore").await;
    let (after, after_url, after_schema, _, _) = isolated(&pg, "restore").await;
    for (store, url) in [(&before, &before_url), (&after, &after_url)] {
        enqueue(store, 10, 20).await;
        let mut relay = start_relay_with(
            url,
            &nats,
            &stream,
            &prefix,
            &["--source", "billing"],
            Stdio::inherit(),
        )
        .await;
        until_published(store, 200).await;
        kill(&relay, "-TERM");
        let _ = tokio::time::timeout(Duration::from_secs(20), relay.child.wait()).await;
        let _ = relay.stdout.next_line().await;
    }
    let client = async_nats::connect(&nats).await.expect("nats");
    let js = async_nats::jetstream::new(client);
    let mut s = js.get_stream(&stream).await.expect("stream");
    assert_eq!(
        s.info().await.expect("info").state.messages,
        400,
        "both databases' 200 events, none taken for a copy"
    );
    let ids: std::collections::HashSet<String> = {
        let mut ids = std::collections::HashSet::new();
        for seq in 1..=400 {
            let m = s.get_raw_message(seq).await.expect("message");
            let id = m
                .headers
                .get("Nats-Msg-Id")
                .expect("id")
                .as_str()
                .to_owned();
            assert!(
                !id.starts_with("billing:"),
                "a random event id, not a row number: {id}"
            );
            ids.insert(id);
        }
        ids
    };
    assert_eq!(ids.len(), 400);
    js.delete_stream(&stream).await.expect("delete stream");
    drop((before_schema, after_schema));
}

/// A schema and stream of their own, and the store URL to reach them.
async fn isolated(pg: &str, label: &str) -> (PgStore, String, PgSchema, String, String) {
    let tag = format!("{label}{:08x}", idem::OwnerToken::random().as_u128() as u32);
    let schema = PgSchema::on(pg, "relay");
    let store_url = format!("{}&max_connections=4", schema.url());
    let store = PgStore::connect_with(PgOptions::from_url(&store_url).expect("url"))
        .await
        .expect("connect");
    (
        store,
        store_url,
        schema,
        format!("IDEMTEST_{tag}"),
        format!("idemtest{tag}"),
    )
}

async fn enqueue(store: &PgStore, aggregates: usize, per_aggregate: usize) {
    for i in 0..per_aggregate {
        let mut tx = store.pool().begin().await.expect("begin");
        for a in 0..aggregates {
            let msg = OutboxMessage::new(
                "order",
                &format!("o-{a}"),
                "OrderNoted",
                &format!(r#"{{"n":{i}}}"#),
            )
            .expect("valid");
            Outbox::enqueue(&mut tx, &msg).await.expect("enqueue");
        }
        tx.commit().await.expect("commit");
    }
}

/// The broker goes away: rows stay pending, no attempt is spent, nothing
/// is marked published; when it is back, everything goes out in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_broker_outage_leaves_rows_pending_and_spends_no_attempts() {
    let Some(pg) = services::postgres() else {
        return;
    };
    let Some(nats) = services::nats() else {
        return;
    };
    let (store, store_url, schema, stream, prefix) = isolated(&pg, "down").await;
    let proxy = idem_testkit::fault::FaultProxy::start(services::socket_addr(&nats)).await;
    let via_proxy = services::via(&nats, proxy.addr(), "");
    let mut relay = start_relay(&store_url, &via_proxy, &stream, &prefix).await;

    proxy.cut();
    enqueue(&store, 5, 10).await;
    tokio::time::sleep(Duration::from_secs(8)).await;
    // Not ready while the broker is away; the backlog is exported.
    let ready =
        idem_testkit::client::send(relay.admin, http::Method::GET, "/readyz", &[], "").await;
    assert_eq!(ready.status, http::StatusCode::SERVICE_UNAVAILABLE);
    // The gauges are refreshed every 5 s of the relay's loop: polled, not
    // read once at a fixed moment.
    let mut metrics = String::new();
    eventually("idem_outbox_pending 50", async || {
        let page =
            idem_testkit::client::send(relay.admin, http::Method::GET, "/metrics", &[], "").await;
        metrics = String::from_utf8_lossy(&page.body).into_owned();
        metrics.lines().any(|l| l == "idem_outbox_pending 50")
    })
    .await;
    assert!(metrics.contains("idem_outbox_lag_seconds"), "{metrics}");
    assert_nothing_spent(&store).await;

    proxy.restore();
    for _ in 0..600 {
        if published_count(&store).await == 50 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        published_count(&store).await,
        50,
        "everything went out once the broker was back"
    );
    kill(&relay, "-TERM");
    let _ = tokio::time::timeout(Duration::from_secs(20), relay.child.wait()).await;
    let _ = relay.stdout.next_line().await;

    let js = stream_once_in_order(&nats, &stream, &prefix, 5, 10).await;

    // The operator path: list, replay and discard dead rows by id.
    let idem = |args: &[&str]| {
        let out = std::process::Command::new(IDEM)
            .arg("outbox")
            .args(args)
            .args(["--store", &store_url])
            .output()
            .expect("idem outbox");
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (code, out, _) = idem(&["list", "--state", "published", "--limit", "1000"]);
    assert_eq!(code, Some(0));
    assert!(out.contains("50 row(s)"), "{out}");
    let ids: Vec<i64> = sqlx::query_scalar("SELECT id FROM idem_outbox ORDER BY id LIMIT 2")
        .fetch_all(store.pool())
        .await
        .expect("ids");
    sqlx::query("UPDATE idem_outbox SET state = 'dead', last_error = 'refused' WHERE id = ANY($1)")
        .bind(&ids)
        .execute(store.pool())
        .await
        .expect("kill rows");
    let (code, out, _) = idem(&["list", "--state", "dead", "--json"]);
    assert_eq!(code, Some(0));
    let dead: serde_json::Value = serde_json::from_str(&out).expect("json");
    assert_eq!(dead.as_array().map(Vec::len), Some(2), "{out}");
    let (first, second) = (ids[0].to_string(), ids[1].to_string());
    let (code, out, _) = idem(&["replay", &first]);
    assert_eq!(code, Some(0), "{out}");
    let (code, _, err) = idem(&["replay", &first]);
    assert_eq!(code, Some(1), "no longer dead");
    assert!(err.contains("not dead"), "{err}");
    let (code, out, _) = idem(&["discard", &second]);
    assert_eq!(code, Some(0), "{out}");
    let (code, _, err) = idem(&["list", "--state", "lost"]);
    assert_eq!(code, Some(1));
    assert!(err.contains("expected pending, published or dead"), "{err}");

    js.delete_stream(&stream).await.expect("delete stream");
    drop(schema);
}

/// A stream whose duplicate window is shorter than the relay's worst
/// re-publish delay gets a loud warning at start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_short_duplicate_window_is_reported_at_start() {
    let Some(pg) = services::postgres() else {
        return;
    };
    let Some(nats) = services::nats() else {
        return;
    };
    let (_store, store_url, schema, stream, prefix) = isolated(&pg, "window").await;
    let dir = tempfile::tempdir().expect("temp dir");
    let log = dir.path().join("relay.err");
    let relay = start_relay_with(
        &store_url,
        &nats,
        &stream,
        &prefix,
        &["--duplicate-window", "5s"],
        Stdio::from(std::fs::File::create(&log).expect("log file")),
    )
    .await;
    kill(&relay, "-TERM");
    let mut relay = relay;
    let _ = tokio::time::timeout(Duration::from_secs(20), relay.child.wait()).await;
    let err = std::fs::read_to_string(&log).expect("stderr");
    assert!(
        err.contains("WARNING") && err.contains("duplicate window (5s)"),
        "{err}"
    );

    let client = async_nats::connect(&nats).await.expect("nats");
    let js = async_nats::jetstream::new(client);
    js.delete_stream(&stream).await.expect("delete stream");
    drop(schema);
}

/// A durable topic exchange `name` and a queue `name` bound to everything
/// under `<name>.`, on a connection of the test's own.
async fn rabbit_queue(amqp: &str, name: &str) -> (lapin::Connection, lapin::Channel) {
    use lapin::options::{ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions};
    let conn = lapin::Connection::connect(amqp, Default::default())
        .await
        .expect("RabbitMQ");
    let ch = conn.create_channel().await.expect("channel");
    let durable = ExchangeDeclareOptions {
        durable: true,
        ..Default::default()
    };
    ch.exchange_declare(
        name.into(),
        lapin::ExchangeKind::Topic,
        durable,
        Default::default(),
    )
    .await
    .expect("exchange");
    ch.queue_declare(
        name.into(),
        QueueDeclareOptions::default(),
        Default::default(),
    )
    .await
    .expect("queue");
    ch.queue_bind(
        name.into(),
        name.into(),
        format!("{name}.#").as_str().into(),
        QueueBindOptions::default(),
        Default::default(),
    )
    .await
    .expect("bind");
    (conn, ch)
}

/// Takes every message off the queue `name` (then deletes it and its
/// exchange) and checks that each aggregate's rows came in sequence order,
/// copies aside; returns (messages, distinct row ids).
async fn drain_in_order(store: &PgStore, ch: &lapin::Channel, name: &str) -> (usize, usize) {
    use lapin::options::BasicGetOptions;
    let rows: HashMap<String, (String, i64)> = sqlx::query_as::<_, (String, String, i64)>(
        "SELECT event_id, aggregate_id, sequence FROM idem_outbox",
    )
    .fetch_all(store.pool())
    .await
    .expect("rows")
    .into_iter()
    .map(|(id, a, s)| (id, (a, s)))
    .collect();
    let mut seen = std::collections::HashSet::new();
    let mut last: HashMap<String, i64> = HashMap::new();
    let mut got = 0;
    while let Some(m) = ch
        .basic_get(name.into(), BasicGetOptions { no_ack: true })
        .await
        .expect("get")
    {
        got += 1;
        let id = m
            .delivery
            .properties
            .message_id()
            .as_ref()
            .expect("a message id")
            .as_str()
            .to_owned();
        let (aggregate, sequence) = rows.get(&id).expect("the event id of a row").clone();
        if !seen.insert(id) {
            continue; // a copy after a lost confirm
        }
        let before = last.insert(aggregate.clone(), sequence).unwrap_or(0);
        assert_eq!(
            sequence,
            before + 1,
            "{aggregate}: {sequence} after {before}"
        );
    }
    let _ = ch.queue_delete(name.into(), Default::default()).await;
    let _ = ch.exchange_delete(name.into(), Default::default()).await;
    (got, seen.len())
}

/// `idem relay --broker amqp://…`: every row reaches a queue bound to the
/// exchange once (the relay crashes nowhere here), with the row's event id
/// as `message_id` and each aggregate's rows in sequence order.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn relays_to_rabbitmq_in_order_with_message_ids() {
    let Some(pg) = services::postgres() else {
        return;
    };
    let Some(amqp) = services::rabbitmq() else {
        return;
    };
    let (store, store_url, schema, _, prefix) = isolated(&pg, "amqp").await;
    let exchange = prefix.clone();
    let (_conn, ch) = rabbit_queue(&amqp, &exchange).await;
    enqueue(&store, 4, 50).await;

    let mut relay = start_relay_with(
        &store_url,
        &amqp,
        "unused",
        &prefix,
        &["--exchange", &exchange],
        Stdio::inherit(),
    )
    .await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while published(&store).await < 200 {
        assert!(tokio::time::Instant::now() < deadline, "not all published");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    kill(&relay, "-TERM");
    let _ = tokio::time::timeout(Duration::from_secs(20), relay.child.wait()).await;

    let (got, distinct) = drain_in_order(&store, &ch, &exchange).await;
    assert_eq!((got, distinct), (200, 200), "every row once");
    drop(schema);
}

/// A broker URL of another kind is refused with the accepted forms.
#[test]
fn an_unknown_broker_scheme_is_refused() {
    let Some(pg) = services::postgres() else {
        return;
    };
    let out = std::process::Command::new(IDEM)
        .args(["relay", "--store", &pg, "--broker", "mqtt://127.0.0.1:1883"])
        .args(["--admin-listen", "127.0.0.1:0"])
        .output()
        .expect("run idem relay");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("mqtt://")
            && err.contains("kafka://")
            && err.contains("nats://")
            && err.contains("amqp://"),
        "{err}"
    );
}

/// A relay publishing to RabbitMQ through a fault proxy, with its own
/// schema, exchange and queue.
struct RabbitLink {
    store: PgStore,
    /// The link's schema, which goes with it.
    _schema: PgSchema,
    exchange: String,
    _conn: lapin::Connection,
    ch: lapin::Channel,
    proxy: idem_testkit::fault::FaultProxy,
    relay: RelayProcess,
}

impl RabbitLink {
    /// `None` (after the notice) when PostgreSQL or RabbitMQ is absent.
    async fn start(label: &str) -> Option<Self> {
        let pg = services::postgres()?;
        let amqp = services::rabbitmq()?;
        let (store, store_url, schema, _, prefix) = isolated(&pg, label).await;
        let exchange = prefix.clone();
        let (conn, ch) = rabbit_queue(&amqp, &exchange).await;
        let proxy = idem_testkit::fault::FaultProxy::start(services::socket_addr(&amqp)).await;
        let via_proxy = services::via(&amqp, proxy.addr(), "");
        let relay = start_relay_with(
            &store_url,
            &via_proxy,
            "unused",
            &prefix,
            &["--exchange", &exchange],
            Stdio::inherit(),
        )
        .await;
        Some(Self {
            store,
            _schema: schema,
            exchange,
            _conn: conn,
            ch,
            proxy,
            relay,
        })
    }

    /// Stops the relay, drains the queue ([`drain_in_order`]) and drops
    /// the schema; (messages, distinct rows).
    async fn finish(mut self) -> (usize, usize) {
        kill(&self.relay, "-TERM");
        let _ = tokio::time::timeout(Duration::from_secs(20), self.relay.child.wait()).await;
        drain_in_order(&self.store, &self.ch, &self.exchange).await
    }
}

/// RabbitMQ goes away under the relay: rows stay pending with no attempt
/// spent and `/readyz` says not ready; when it is back, the relay opens a
/// new connection and every row reaches the queue, in order per aggregate.
/// (A confirm lost with the connection may make a row arrive twice, with
/// one `message_id`: RabbitMQ does not de-duplicate; consumers' inboxes
/// do.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_rabbitmq_outage_leaves_rows_pending_and_the_relay_reconnects() {
    let Some(t) = RabbitLink::start("amqpdown").await else {
        return;
    };
    let (store, proxy) = (&t.store, &t.proxy);

    proxy.cut();
    enqueue(store, 5, 10).await;
    tokio::time::sleep(Duration::from_secs(6)).await;
    let ready =
        idem_testkit::client::send(t.relay.admin, http::Method::GET, "/readyz", &[], "").await;
    assert_eq!(ready.status, http::StatusCode::SERVICE_UNAVAILABLE);
    assert_nothing_spent(store).await;

    proxy.restore();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while published(store).await < 50 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the relay did not come back"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let ready =
        idem_testkit::client::send(t.relay.admin, http::Method::GET, "/readyz", &[], "").await;
    assert_eq!(ready.status, http::StatusCode::OK);
    let (got, distinct) = t.finish().await;
    assert!(got >= 50, "{got}");
    assert_eq!(distinct, 50, "every row reached the queue");
}

/// The RabbitMQ link turns slow, then every connection is reset while
/// rows flow, then it goes silent (a black hole: connections stay open,
/// nothing comes back), then returns: nothing is marked published that the
/// broker did not confirm, and every row reaches the queue, in order per
/// aggregate (a copy after a lost confirm carries its row's `message_id`).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_slow_reset_then_silent_rabbitmq_link_delivers_every_row_in_order() {
    let Some(t) = RabbitLink::start("amqphole").await else {
        return;
    };
    let (store, proxy) = (&t.store, &t.proxy);

    enqueue(store, 5, 4).await;
    until_published(store, 20).await;

    proxy.set_latency(Duration::from_millis(100), Duration::from_millis(100));
    enqueue(store, 5, 4).await;
    until_published(store, 40).await;
    proxy.restore();

    // Reset under way: 50 rows at 100 ms a chunk each way take seconds,
    // and the relay's connection breaks once the first of them are in
    // (whenever that is: enqueueing them may itself be slow).
    proxy.set_latency(Duration::from_millis(100), Duration::ZERO);
    enqueue(store, 5, 10).await;
    eventually("rows flowing", async || published(store).await > 40).await;
    proxy.reset_all();
    let at_reset = published(store).await;
    assert!(at_reset < 90, "the reset came after the rows: {at_reset}");
    proxy.restore();
    until_published(store, 90).await;

    // Silent for longer than the relay's 5 s confirm time-out.
    proxy.blackhole();
    enqueue(store, 5, 4).await;
    tokio::time::sleep(Duration::from_secs(7)).await;
    assert_eq!(
        published(store).await,
        90,
        "nothing confirmed through the hole"
    );

    proxy.restore();
    until_published(store, 110).await;
    let (got, distinct) = t.finish().await;
    assert!(got >= 110, "{got}");
    assert_eq!(distinct, 110, "every row reached the queue");
    eprintln!(
        "rabbitmq link: {at_reset} of 90 published at the reset; {got} messages for 110 rows"
    );
}

/// `idem relay --broker kafka://…` against a Kafka-protocol broker
/// (Tansu), read back with a plain Kafka client.
mod kafka {
    use super::*;
    use idem_testkit::kafka::{self, Record};

    /// Starts a Kafka relay publishing to `<prefix>.<aggregate_type>`,
    /// creating topics of 6 partitions and one replica.
    async fn start(store: &str, broker: &str, prefix: &str, stderr: Stdio) -> RelayProcess {
        spawn_relay(
            store,
            broker,
            &[
                "--prefix",
                prefix,
                "--create-topics",
                "--topic-partitions",
                "6",
                "--topic-replication",
                "1",
            ],
            stderr,
        )
        .await
    }

    /// Stops `relay` with SIGTERM and checks its clean exit.
    async fn stop(mut relay: RelayProcess) {
        kill(&relay, "-TERM");
        let status = tokio::time::timeout(Duration::from_secs(20), relay.child.wait())
            .await
            .expect("stops on SIGTERM")
            .expect("wait");
        assert!(status.success(), "clean exit: {status}");
    }

    /// The topic read back, de-duplicated as a consumer's inbox would (by
    /// `Idem-Message-Id`, first copy kept): every row once, each
    /// aggregate's sequence 1, 2, 3… in its partition's order, every
    /// aggregate in one partition and keyed by its id. Returns how many
    /// copies the de-duplication dropped.
    fn once_in_order(records: &[Record], aggregates: usize, per_aggregate: usize) -> usize {
        once_in_order_from(records, aggregates, 1, per_aggregate)
    }

    /// [`once_in_order`] for a topic whose aggregates start at `first`
    /// (a broker that lost the earlier records) and hold `count` rows each.
    fn once_in_order_from(
        records: &[Record],
        aggregates: usize,
        first: i64,
        count: usize,
    ) -> usize {
        let mut seen = std::collections::HashSet::new();
        let mut next: HashMap<String, (i32, i64)> = HashMap::new();
        let mut copies = 0;
        for r in records {
            let header = |name: &str| {
                r.header(name)
                    .unwrap_or_else(|| panic!("{name} missing at {}:{}", r.partition, r.offset))
            };
            if !seen.insert(header("Idem-Message-Id")) {
                copies += 1;
                continue;
            }
            let aggregate = header("Idem-Aggregate-Id");
            assert_eq!(r.key, aggregate, "keyed by the aggregate id");
            assert_eq!(header("Idem-Message-Type"), "OrderNoted");
            let sequence: i64 = header("Idem-Sequence").parse().expect("number");
            let (partition, expected) = next
                .entry(aggregate.clone())
                .or_insert((r.partition, first));
            assert_eq!(*partition, r.partition, "{aggregate} in one partition");
            assert_eq!(
                sequence, *expected,
                "{aggregate} out of order at {}:{}",
                r.partition, r.offset
            );
            *expected += 1;
        }
        assert_eq!(next.len(), aggregates, "every aggregate arrived");
        assert!(
            next.values().all(|(_, n)| *n == first + count as i64),
            "every row of every aggregate arrived"
        );
        copies
    }

    /// Three relays on one outbox, one SIGKILLed a third of the way and
    /// started again: every row in the topic once after the consumer's
    /// de-duplication, in order per aggregate.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn three_relays_one_killed_every_row_once_in_order_kafka() {
        let (Some(pg), Some(broker)) = (services::postgres(), services::kafka()) else {
            return;
        };
        let (store, store_url, schema, _, prefix) = isolated(&pg, "kkill").await;
        let (aggregates, per_aggregate) = (50, 40);
        enqueue(&store, aggregates, per_aggregate).await;
        let total = (aggregates * per_aggregate) as i64;
        let relays = three_relays_one_killed(&store, total, || {
            start(&store_url, &broker, &prefix, Stdio::inherit())
        })
        .await;
        for relay in relays {
            stop(relay).await;
        }
        let records = kafka::read_all(&broker, &format!("{prefix}.order")).await;
        let copies = once_in_order(&records, aggregates, per_aggregate);
        eprintln!(
            "kafka relay kill: {} records, {copies} re-published copies dropped by id",
            records.len()
        );
        drop(schema);
    }

    /// Attempts spent on rows still pending: the relay counts an attempt
    /// when a row is published too, so only the pending ones tell whether
    /// an outage was charged to the rows.
    async fn attempts_on_pending(store: &PgStore) -> i64 {
        sqlx::query_scalar(
            "SELECT COALESCE(sum(attempts) FILTER (WHERE state = 'pending'), 0) FROM idem_outbox",
        )
        .fetch_one(store.pool())
        .await
        .expect("attempts")
    }

    /// The broker link is cut (connections closed, new ones refused), then
    /// turns slow (latency with jitter), then silent for longer than the
    /// producer's delivery time-out (a black hole: the connection stays
    /// open and nothing comes back), then returns. Nothing is marked
    /// published while cut or through the hole, no attempt is spent on
    /// either, `/readyz` says not ready, and afterwards every row reaches
    /// the topic once (after de-duplication), in order per aggregate: the
    /// producer that timed out is not left stuck.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn a_cut_slow_then_silent_kafka_link_delivers_every_row_once_in_order() {
        let Some(pg) = services::postgres() else {
            return;
        };
        // The broker must advertise the proxy: Kafka clients connect where
        // the metadata says, not where they bootstrapped.
        let port = idem_testkit::servers::free_port();
        let proxy = idem_testkit::fault::FaultProxy::start(std::net::SocketAddr::from((
            [127, 0, 0, 1],
            port,
        )))
        .await;
        let Some(broker) = idem_testkit::servers::PrivateKafka::start_behind(port, proxy.addr())
        else {
            return;
        };
        let url = format!("kafka://{}", proxy.addr());
        let (store, store_url, schema, _, prefix) = isolated(&pg, "khole").await;
        let relay = start(&store_url, &url, &prefix, Stdio::inherit()).await;

        enqueue(&store, 5, 4).await;
        until_published(&store, 20).await;

        proxy.cut();
        enqueue(&store, 5, 4).await;
        // Past the 10 s delivery time-out: the sends fail, and say so.
        tokio::time::sleep(Duration::from_secs(12)).await;
        assert_eq!(published(&store).await, 20, "nothing published while cut");
        assert_eq!(attempts_on_pending(&store).await, 0, "no attempt spent");
        let ready =
            idem_testkit::client::send(relay.admin, http::Method::GET, "/readyz", &[], "").await;
        assert_eq!(ready.status, http::StatusCode::SERVICE_UNAVAILABLE);
        proxy.restore();
        until_published(&store, 40).await;

        proxy.set_latency(Duration::from_millis(100), Duration::from_millis(100));
        enqueue(&store, 5, 4).await;
        until_published(&store, 60).await;

        proxy.restore();
        proxy.blackhole();
        enqueue(&store, 5, 4).await;
        // Past the delivery time-out again: the sends in the hole fail.
        tokio::time::sleep(Duration::from_secs(14)).await;
        assert_eq!(
            published(&store).await,
            60,
            "nothing confirmed through the hole"
        );
        assert_eq!(attempts_on_pending(&store).await, 0, "no attempt spent");

        proxy.restore();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(90);
        while published(&store).await < 80 {
            assert!(
                tokio::time::Instant::now() < deadline,
                "the relay did not recover from the hole; the broker's log:\n{}",
                broker.log()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        stop(relay).await;
        let records = kafka::read_all(&url, &format!("{prefix}.order")).await;
        let copies = once_in_order(&records, 5, 16);
        eprintln!(
            "kafka link cut, slow, silent: {} records, {copies} copies dropped by id",
            records.len()
        );
        drop(schema);
    }

    /// The broker is SIGKILLed with rows pending and started again empty
    /// (as a broker whose disk was lost): the rows stay pending with no
    /// attempt spent and `/readyz` says not ready while it is away; once
    /// it is back, the relay re-creates the topic and every later row
    /// reaches it once, in order per aggregate. The relay warned at start
    /// that one replica cannot keep an acknowledged event.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn a_restarted_kafka_broker_gets_every_pending_row_in_order() {
        let Some(pg) = services::postgres() else {
            return;
        };
        let Some(mut broker) = idem_testkit::servers::PrivateKafka::start() else {
            return;
        };
        let url = broker.url();
        let (store, store_url, schema, _, prefix) = isolated(&pg, "krestart").await;
        let dir = tempfile::tempdir().expect("temp dir");
        let log = dir.path().join("relay.err");
        let stderr = Stdio::from(std::fs::File::create(&log).expect("log file"));
        let relay = start(&store_url, &url, &prefix, stderr).await;

        enqueue(&store, 5, 4).await;
        until_published(&store, 20).await;

        broker.kill();
        let killed = tokio::time::Instant::now();
        enqueue(&store, 5, 4).await;
        // The round now waiting on the lost broker fails only after the
        // client's 10 s delivery time-out; /readyz reads the link and must
        // say not ready well before that.
        loop {
            let ready =
                idem_testkit::client::send(relay.admin, http::Method::GET, "/readyz", &[], "")
                    .await;
            if ready.status == http::StatusCode::SERVICE_UNAVAILABLE {
                let body = String::from_utf8_lossy(&ready.body);
                assert!(body.contains("broker"), "{body}");
                break;
            }
            assert!(
                killed.elapsed() < Duration::from_secs(8),
                "/readyz still said {} {}s after the broker was killed",
                ready.status,
                killed.elapsed().as_secs()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        // Past the delivery time-out: the round failed as broker-down.
        tokio::time::sleep_until(killed + Duration::from_secs(12)).await;
        let ready =
            idem_testkit::client::send(relay.admin, http::Method::GET, "/readyz", &[], "").await;
        assert_eq!(ready.status, http::StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(published(&store).await, 20, "nothing published while away");
        assert_eq!(attempts_on_pending(&store).await, 0, "no attempt spent");

        broker.restart();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(90);
        while published(&store).await < 40 {
            assert!(
                tokio::time::Instant::now() < deadline,
                "the relay did not come back; its log:\n{}",
                std::fs::read_to_string(&log).unwrap_or_default()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let ready =
            idem_testkit::client::send(relay.admin, http::Method::GET, "/readyz", &[], "").await;
        assert_eq!(ready.status, http::StatusCode::OK);
        stop(relay).await;
        let err = std::fs::read_to_string(&log).expect("stderr");
        assert!(err.contains("1 replica(s)"), "{err}");
        let records = kafka::read_all(&url, &format!("{prefix}.order")).await;
        let copies = once_in_order_from(&records, 5, 5, 4);
        eprintln!(
            "kafka restart: {} records, {copies} copies dropped by id",
            records.len()
        );
        drop(schema);
    }
}
