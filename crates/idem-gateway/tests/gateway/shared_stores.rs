//! Gateways sharing PostgreSQL, MySQL, DynamoDB, Redis, a Redis Cluster or tiered stores on
//! loopback: several instances behind one "load balancer", and the store
//! going away and coming back.

use std::net::SocketAddr;
use std::path::Path;

use http::{Method, StatusCode};
use idem_testkit::client::{Answer, metric, send, until_status};
use idem_testkit::fault::FaultProxy;
use idem_testkit::gateway::GatewayProcess as Gateway;
use idem_testkit::services;
use idem_testkit::upstream::CountingUpstream;
use tokio::process::Command;

const IDEM: &str = env!("CARGO_BIN_EXE_idem");

const CONFIG: &str = r#"
[defaults]
retention = "5m"
lease = "30s"

[[route]]
method = "POST"
path = "/v1/storm"
require_key = true
on_in_flight = "wait"
in_flight_wait = "20s"

[[route]]
method = "POST"
path = "/v1/payments"
require_key = true

[[route]]
method = "POST"
path = "/v1/open"
on_store_error = "open"
"#;

async fn start(dir: &Path, upstream: &str, store: &str) -> Gateway {
    start_with(dir, upstream, store, CONFIG).await
}

async fn start_with(dir: &Path, upstream: &str, store: &str, config: &str) -> Gateway {
    Gateway::builder(IDEM, dir)
        .config(config)
        .upstream(upstream)
        .store(store)
        .log("error")
        .start()
        .await
}

fn unique(label: &str) -> String {
    format!(
        "{label}-{}-{}",
        std::process::id(),
        idem::OwnerToken::random()
    )
}

/// Three gateways on one store; 200 keys, each sent 10 times at once,
/// spread over the three: exactly 200 executions, identical answers. On
/// PostgreSQL (alone or tiered) and MySQL, `/metrics` accounts for the
/// store's reservations and resolutions as grouped or alone.
async fn three_gateways_one_store(store: &str) {
    three_gateways_one_store_with(store, CONFIG).await;
}

/// [`three_gateways_one_store`] with a config of its own.
async fn three_gateways_one_store_with(store: &str, config: &str) {
    const KEYS: usize = 200;
    const COPIES: usize = 10;
    let dir = tempfile::tempdir().expect("temp dir");
    let up = CountingUpstream::start().await;
    let mut running = Vec::new();
    for _ in 0..3 {
        running.push(start_with(dir.path(), &up.url(), store, config).await);
    }
    let gateways: Vec<SocketAddr> = running.iter().map(|g| g.addr).collect();
    let auth = format!("Bearer {}", unique("tenant"));
    // At most 250 requests in flight (a fair semaphore keeps each key's ten
    // copies together), so the test stays within file descriptor limits.
    let in_flight = std::sync::Arc::new(tokio::sync::Semaphore::new(250));
    let mut tasks = tokio::task::JoinSet::new();
    for k in 0..KEYS {
        for c in 0..COPIES {
            let addr = gateways[(k + c) % gateways.len()];
            let auth = auth.clone();
            let permit = std::sync::Arc::clone(&in_flight).acquire_owned();
            tasks.spawn(async move {
                let _permit = permit.await.expect("semaphore");
                let key = format!("mi-{k}");
                let a = send(
                    addr,
                    Method::POST,
                    "/v1/storm",
                    &[
                        ("content-type", "application/json"),
                        ("authorization", &auth),
                        ("idempotency-key", &key),
                        ("x-delay-ms", "50"),
                    ],
                    format!(r#"{{"amount":{k}}}"#),
                )
                .await;
                (k, a)
            });
        }
    }
    let mut answers: Vec<Vec<Answer>> = vec![Vec::new(); KEYS];
    while let Some(done) = tasks.join_next().await {
        let (k, a) = done.expect("task");
        assert_eq!(a.status, StatusCode::CREATED, "key {k}: {:?}", a.body);
        answers[k].push(a);
    }
    assert_eq!(
        up.total(),
        KEYS as u64,
        "exactly one upstream execution per key"
    );
    for (k, a) in answers.iter().enumerate() {
        let bodies: Vec<String> = a
            .iter()
            .map(|x| String::from_utf8_lossy(&x.body).into_owned())
            .collect();
        assert!(
            bodies.iter().all(|b| *b == bodies[0]),
            "key {k}: answers differ: {bodies:#?}"
        );
    }
    if store.contains("postgres") || store.starts_with("mysql") {
        let (mut statements, mut grouped, mut alone, mut planned) = (0.0, 0.0, 0.0, 0.0);
        for gw in &running {
            statements += metric(gw.admin, "idem_store_grouped_statements_total", "").await;
            grouped += metric(gw.admin, "idem_store_grouped_operations_total", "").await;
            alone += metric(gw.admin, "idem_store_alone_operations_total", "").await;
            planned += metric(gw.admin, "idem_store_planned_statements_total", "").await;
        }
        eprintln!(
            "group commit over 3 gateways: {statements} statements carried {grouped} operations \
             ({planned} of them planned as they ran); {alone} alone"
        );
        // Each key's winner reserved and resolved in the database.
        assert!(
            grouped + alone >= 2.0 * KEYS as f64,
            "{grouped} grouped + {alone} alone"
        );
        assert!(grouped >= statements);
        assert!(planned <= statements, "{planned} planned of {statements}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_gateways_share_postgres() {
    let Some(pg) = services::postgres() else {
        return;
    };
    three_gateways_one_store(&pg).await;
}

#[cfg(feature = "mysql")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_gateways_share_mysql() {
    let Some(db) = idem_testkit::isolated::MysqlDatabase::new("shared") else {
        return;
    };
    three_gateways_one_store(&db.url()).await;
}

#[cfg(feature = "dynamodb")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_gateways_share_dynamodb() {
    let Some(table) = idem_testkit::isolated::DynamoTable::new("shared") else {
        return;
    };
    // The emulator is one Python process that the other DynamoDB tests
    // use at the same time: the storm's 2,000 requests may wait on it
    // longer than the default 5 s a store operation may take, and a
    // gateway then rightly answers 503. The test is about one execution
    // per key, so the store gets the time it needs.
    let config = format!("store_timeout = \"60s\"\n{CONFIG}");
    three_gateways_one_store_with(&format!("{}&timeout_ms=60000", table.url()), &config).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_gateways_share_redis() {
    let Some(redis) = services::redis() else {
        return;
    };
    three_gateways_one_store(&redis).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_gateways_share_a_redis_cluster() {
    let Some(cluster) = services::redis_cluster() else {
        return;
    };
    three_gateways_one_store(&cluster).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_gateways_share_tiered_redis_cluster_postgres() {
    let (Some(cluster), Some(pg)) = (services::redis_cluster(), services::postgres()) else {
        return;
    };
    three_gateways_one_store(&format!("tiered:{cluster},{pg}")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_gateways_share_tiered_redis_postgres() {
    let (Some(redis), Some(pg)) = (services::redis(), services::postgres()) else {
        return;
    };
    three_gateways_one_store(&format!("tiered:{redis},{pg}")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_going_away_fails_closed_or_open_and_protection_resumes() {
    let Some(pg) = services::postgres() else {
        return;
    };
    let target = services::socket_addr(&pg);
    let proxy = FaultProxy::start(target).await;
    let store = services::via(
        &pg,
        proxy.addr(),
        "connect_timeout_ms=500&acquire_timeout_ms=500",
    );
    let dir = tempfile::tempdir().expect("temp dir");
    let up = CountingUpstream::start().await;
    let gw = start(dir.path(), &up.url(), &store).await;
    let auth = format!("Bearer {}", unique("pg-down"));
    let h = |key: &'static str| {
        [
            ("content-type", "application/json"),
            ("authorization", auth.as_str()),
            ("idempotency-key", key),
        ]
    };
    let ok = send(gw.addr, Method::POST, "/v1/payments", &h("before"), "{}").await;
    assert_eq!(ok.status, StatusCode::CREATED);

    proxy.cut();
    let closed = until_status(
        async || send(gw.addr, Method::POST, "/v1/payments", &h("during"), "{}").await,
        StatusCode::SERVICE_UNAVAILABLE,
    )
    .await;
    assert_eq!(closed.problem_type(), "idempotency-store-unavailable");
    assert!(closed.header("retry-after").is_some());
    assert_eq!(up.executions("during"), 0, "fail-closed forwards nothing");
    let open = send(gw.addr, Method::POST, "/v1/open", &h("open-1"), "{}").await;
    assert_eq!(open.status, StatusCode::CREATED);
    assert_eq!(open.header("idempotency-status"), Some("unprotected"));
    assert_eq!(
        send(gw.admin, Method::GET, "/readyz", &[], "").await.status,
        StatusCode::SERVICE_UNAVAILABLE
    );

    proxy.restore();
    let back = until_status(
        async || send(gw.addr, Method::POST, "/v1/payments", &h("during"), "{}").await,
        StatusCode::CREATED,
    )
    .await;
    assert_eq!(back.header("idempotent-replayed"), None);
    let replay = send(gw.addr, Method::POST, "/v1/payments", &h("during"), "{}").await;
    assert_eq!(
        replay.header("idempotent-replayed"),
        Some("true"),
        "protected again, no restart"
    );
    assert_eq!(
        send(gw.admin, Method::GET, "/readyz", &[], "").await.status,
        StatusCode::OK
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_started_without_its_store_becomes_ready_when_it_appears() {
    let Some(pg) = services::postgres() else {
        return;
    };
    let proxy = FaultProxy::start(services::socket_addr(&pg)).await;
    proxy.cut();
    let store = services::via(
        &pg,
        proxy.addr(),
        "connect_timeout_ms=300&acquire_timeout_ms=500",
    );
    let dir = tempfile::tempdir().expect("temp dir");
    let up = CountingUpstream::start().await;
    let gw = start(dir.path(), &up.url(), &store).await;
    let ready = send(gw.admin, Method::GET, "/readyz", &[], "").await;
    assert_eq!(ready.status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(
        String::from_utf8_lossy(&ready.body).contains("not connected yet"),
        "{:?}",
        ready.body
    );
    let auth = format!("Bearer {}", unique("pg-late"));
    let h = [
        ("content-type", "application/json"),
        ("authorization", auth.as_str()),
        ("idempotency-key", "late-1"),
    ];
    assert_eq!(
        send(gw.addr, Method::POST, "/v1/payments", &h, "{}")
            .await
            .status,
        StatusCode::SERVICE_UNAVAILABLE
    );
    proxy.restore();
    until_status(
        async || send(gw.admin, Method::GET, "/readyz", &[], "").await,
        StatusCode::OK,
    )
    .await;
    assert_eq!(
        send(gw.addr, Method::POST, "/v1/payments", &h, "{}")
            .await
            .status,
        StatusCode::CREATED
    );
    assert_eq!(up.executions("late-1"), 1);
}

#[tokio::test]
async fn migrate_reports_success_or_fails_with_one_line() {
    let Some(pg) = services::postgres() else {
        return;
    };
    let out = Command::new(IDEM)
        .args(["migrate", "--store", &pg])
        .output()
        .await
        .expect("runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(
        said.contains("schema already at version") || said.contains("schema created"),
        "{said}"
    );
    let out = Command::new(IDEM)
        .args([
            "migrate",
            "--store",
            "postgres://app:hunter2@127.0.0.1:1/test?connect_timeout_ms=300",
        ])
        .output()
        .await
        .expect("runs");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("127.0.0.1:1") && !err.contains("hunter2"),
        "{err}"
    );
    assert_eq!(err.trim().lines().count(), 1, "one line: {err}");
}

/// `idem migrate` creates the MySQL schema, then finds it in place; an
/// unreachable server is one line, its password never shown.
#[cfg(feature = "mysql")]
#[tokio::test]
async fn migrate_creates_the_mysql_schema_or_fails_with_one_line() {
    let Some(db) = idem_testkit::isolated::MysqlDatabase::new("migrate") else {
        return;
    };
    migrate_creates_then_finds(&db.url()).await;
    let out = Command::new(IDEM)
        .args([
            "migrate",
            "--store",
            "mysql://app:hunter2@127.0.0.1:1/test?connect_timeout_ms=300",
        ])
        .output()
        .await
        .expect("runs");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("127.0.0.1:1") && !err.contains("hunter2"),
        "{err}"
    );
    assert_eq!(err.trim().lines().count(), 1, "one line: {err}");
}

/// `idem migrate` creates the DynamoDB table (with its TTL on), then finds
/// it in place; a gateway whose lease the store's clock bound cannot
/// cover refuses to start, saying why.
#[cfg(feature = "dynamodb")]
#[tokio::test]
async fn migrate_creates_the_dynamodb_table_and_short_leases_are_refused() {
    let Some(table) = idem_testkit::isolated::DynamoTable::new("migrate") else {
        return;
    };
    migrate_creates_then_finds(&table.url()).await;
    let dir = tempfile::tempdir().expect("temp dir");
    let config = dir.path().join("idem.toml");
    std::fs::write(&config, "[defaults]\nlease = \"2s\"\n").expect("config");
    let out = Command::new(IDEM)
        .args([
            "serve",
            "--upstream",
            "http://127.0.0.1:9",
            "--listen",
            "127.0.0.1:0",
        ])
        .args(["--admin-listen", "127.0.0.1:0", "--store"])
        .arg(format!("{}&max_skew_ms=1000", table.url()))
        .arg("--config")
        .arg(&config)
        .env(
            idem_testkit::gateway::HASH_SECRET_ENV,
            idem_testkit::gateway::TEST_HASH_SECRET,
        )
        .output()
        .await
        .expect("runs");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("lease of 2s is too short") && err.contains("twice"),
        "{err}"
    );
}

/// On DynamoDB an answer larger than an item can hold is recorded
/// without its body: its retry gets the original status, marked not
/// retained, and never runs again.
#[cfg(feature = "dynamodb")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_larger_than_a_dynamodb_item_replays_as_not_retained() {
    let Some(table) = idem_testkit::isolated::DynamoTable::new("large") else {
        return;
    };
    let dir = tempfile::tempdir().expect("temp dir");
    let up = CountingUpstream::start().await;
    let gw = start(dir.path(), &up.url(), &table.url()).await;
    let big = [("idempotency-key", "big-1"), ("x-size", "600000")];
    let first = gw.post("/v1/payments", &big, "{}").await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(first.body.len(), 600_000);
    let retry = gw.post("/v1/payments", &big, "{}").await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert_eq!(retry.header("idempotency-status"), Some("not-retained"));
    assert_eq!(retry.header("idempotent-replayed"), Some("true"));
    assert_eq!(up.executions("big-1"), 1);
}

/// `idem migrate --store url` twice: the first creates the schema, the
/// second finds it in place.
#[cfg(any(feature = "mysql", feature = "dynamodb"))]
async fn migrate_creates_then_finds(url: &str) {
    for expected in ["schema created", "schema already at version"] {
        let out = Command::new(IDEM)
            .args(["migrate", "--store", url])
            .output()
            .await
            .expect("runs");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let said = String::from_utf8_lossy(&out.stdout);
        assert!(said.contains(expected), "{said}");
    }
}
