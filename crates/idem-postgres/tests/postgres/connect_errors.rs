//! Each way of pointing at the wrong server gives one clear line, with any
//! password redacted.

use crate::common;

use std::time::Duration;

use idem_postgres::{PgError, PgOptions, PgStore};

/// The test server's URL with its database replaced.
fn with_database(url: &str, db: &str) -> String {
    let (base, _) = url.rsplit_once('/').expect("URL has a database");
    format!("{base}/{db}")
}

fn one_line(err: &PgError) -> String {
    let text = err.to_string();
    assert!(!text.contains('\n'), "one line: {text}");
    text
}

#[tokio::test]
async fn wrong_scheme() {
    let err = PgStore::connect("mysql://root:s3cret@127.0.0.1/idem")
        .await
        .expect_err("not postgres");
    let text = one_line(&err);
    assert!(text.contains("must start with postgres://"), "{text}");
    assert!(!text.contains("s3cret"), "{text}");
}

#[tokio::test]
async fn unreachable_server() {
    let err = PgStore::connect("postgres://app:s3cret@127.0.0.1:1/idem")
        .await
        .expect_err("nothing listens on port 1");
    let text = one_line(&err);
    assert!(text.contains("connection refused"), "{text}");
    assert!(
        text.contains("postgres://app:***@127.0.0.1:1/idem"),
        "{text}"
    );
    assert!(!text.contains("s3cret"), "{text}");
    assert!(idem::StoreError::from(err).is_transient());
}

#[tokio::test]
async fn silent_server_times_out() {
    // A listener that accepts but never answers.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let port = listener.local_addr().expect("addr").port();
    let _hold = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((sock, _)) = listener.accept().await {
            held.push(sock);
        }
    });
    let opts = PgOptions::from_url(&format!("postgres://app@127.0.0.1:{port}/idem"))
        .expect("valid")
        .with_connect_timeout(Duration::from_millis(300));
    let err = PgStore::connect_with(opts).await.expect_err("no answer");
    let text = one_line(&err);
    assert!(text.contains("no connection within"), "{text}");
}

#[tokio::test]
async fn missing_database() {
    let Some(url) = idem_testkit::services::postgres() else {
        return;
    };
    let err = PgStore::connect(&with_database(&url, "idem_no_such_database"))
        .await
        .expect_err("no such database");
    let text = one_line(&err);
    assert!(
        text.contains("database \"idem_no_such_database\" does not exist"),
        "{text}"
    );
    assert!(!idem::StoreError::from(err).is_transient());
}

#[tokio::test]
async fn wrong_credentials() {
    let Some(url) = idem_testkit::services::postgres() else {
        return;
    };
    let opts = PgOptions::from_url(&url).expect("valid");
    let connect = opts
        .connect_options()
        .clone()
        .username("idem_no_such_role")
        .password("s3cret");
    let opts = PgOptions::new(connect).with_connect_timeout(Duration::from_secs(5));
    let err = PgStore::connect_with(opts).await.expect_err("no such role");
    let text = one_line(&err);
    assert!(text.contains("authentication failed"), "{text}");
    assert!(text.contains("idem_no_such_role"), "{text}");
    assert!(!text.contains("s3cret"), "{text}");
}

/// A pooled connection that died while idle (a server restart in a quiet
/// spell; here the fault proxy drops it) is pinged and replaced before use,
/// so no operation fails on it; one idle for less than `ping_after_idle` is
/// used without a ping, and if dead fails at most one operation before the
/// pool replaces it.
#[tokio::test]
async fn a_connection_that_died_while_idle_is_replaced_before_use() {
    let Some(opts) = common::options() else {
        return;
    };
    let host = opts.connect_options().get_host().to_owned();
    let target = tokio::net::lookup_host((host.as_str(), opts.connect_options().get_port()))
        .await
        .expect("resolve")
        .next()
        .expect("an address");
    let proxy = idem_testkit::fault::FaultProxy::start(target).await;
    let via_proxy = |ping_after_idle: Duration| {
        let o = opts.clone().with_max_connections(1).with_migrate(false);
        let connect = o
            .connect_options()
            .clone()
            .host("127.0.0.1")
            .port(proxy.addr().port());
        o.with_connect_options(connect)
            .with_ping_after_idle(ping_after_idle)
    };
    let scope = idem::Scope::new("ping-test", "GET /").expect("scope");
    let key: idem::IdempotencyKey = "k".parse().expect("key");
    use idem::Store;

    // Pinged after 100 ms idle: the dead connection is replaced unseen.
    let store = PgStore::connect_with(via_proxy(Duration::from_millis(100)))
        .await
        .expect("connect");
    store.get(&scope, &key).await.expect("first use");
    proxy.cut();
    proxy.restore();
    tokio::time::sleep(Duration::from_millis(250)).await;
    store
        .get(&scope, &key)
        .await
        .expect("the idle connection was pinged, found dead and replaced");

    // Not idle long enough to be pinged: one operation fails, the next works.
    let store = PgStore::connect_with(via_proxy(Duration::from_secs(60)))
        .await
        .expect("connect");
    store.get(&scope, &key).await.expect("first use");
    proxy.cut();
    proxy.restore();
    tokio::time::sleep(Duration::from_millis(50)).await;
    // sqlx notices a connection the peer closed; one that died silently
    // would fail this operation (transient) instead.
    if let Err(err) = store.get(&scope, &key).await {
        assert!(err.is_transient(), "{err}");
    }
    store
        .get(&scope, &key)
        .await
        .expect("the pool replaced the dead connection");
}

/// Each record operation costs its statement's round trip and nothing
/// more. sqlx tests every connection it takes back into its pool with a
/// round trip of its own; the store keeps the connection an operation
/// used for the next one instead, so sequential reservations, resolutions
/// and reads send one message each (a counting proxy on the link).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_operation_costs_one_round_trip() {
    use idem::Store;
    use idem_testkit::services;
    let Some(url) = services::postgres() else {
        return;
    };
    let link = idem_testkit::fault::FaultProxy::start(services::socket_addr(&url)).await;
    // No test after an idle spell, so that a slow moment cannot add one.
    let extra = "max_connections=4&ping_after_idle_ms=600000";
    let opts = PgOptions::from_url(&services::via(&url, link.addr(), extra)).expect("url");
    let store = PgStore::connect_with(opts).await.expect("connect");
    let scope = idem_testkit::conformance::unique_scope("pg-round-trips");
    let pair = |n: usize| {
        let (store, scope) = (&store, &scope);
        async move {
            let key: idem::IdempotencyKey = format!("k-{n}").parse().expect("key");
            let req = idem::ReserveRequest {
                scope,
                key: &key,
                fingerprint: idem::Fingerprint::builder().part("n", b"1").finish(),
                owner: idem::OwnerToken::random(),
                lease: Duration::from_secs(60),
                retention: Duration::from_secs(3600),
                on_lease_expiry: idem::LeaseExpiry::Retry,
            };
            let idem::Reservation::Acquired(lease) = store.reserve(req).await.expect("reserve")
            else {
                panic!("a fresh key is ours");
            };
            let outcome = idem::FinalOutcome {
                verdict: idem::Verdict::Completed,
                response: idem::StoredResponse::new(201, "done"),
                resource_id: None,
                error_code: None,
                retention: Duration::from_secs(3600),
            };
            store
                .resolve(scope, &key, &lease, &outcome)
                .await
                .expect("resolve");
            let record = store.get(scope, &key).await.expect("get");
            assert!(record.is_some(), "the record is there");
        }
    };
    // The first uses prepare the statements on the connection.
    for n in 0..3 {
        pair(n).await;
    }
    link.quiet_for(Duration::from_millis(50)).await;
    let before = link.chunks_to_server();
    const PAIRS: usize = 20;
    for n in 3..3 + PAIRS {
        pair(n).await;
    }
    link.quiet_for(Duration::from_millis(50)).await;
    let sent = link.chunks_to_server() - before;
    assert_eq!(
        sent,
        3 * PAIRS as u64,
        "messages for {PAIRS} reservations, resolutions and reads"
    );
    store.close().await;
}

/// A connection the store keeps between operations goes back to the pool
/// once the store stops using it: with a pool of one, the caller's own
/// transaction gets it, and the store's next operation works after.
#[tokio::test]
async fn a_kept_connection_goes_back_to_the_pool_when_unused() {
    use idem::Store;
    let Some(opts) = common::options() else {
        return;
    };
    let opts = opts
        .with_max_connections(1)
        .with_acquire_timeout(Duration::from_secs(5));
    let store = PgStore::connect_with(opts).await.expect("connect");
    let scope = idem_testkit::conformance::unique_scope("pg-kept");
    let key: idem::IdempotencyKey = "k".parse().expect("key");
    store.get(&scope, &key).await.expect("first use");
    let mut tx = store
        .pool()
        .begin()
        .await
        .expect("the kept connection came back to the pool");
    sqlx::query("SELECT 1")
        .execute(&mut *tx)
        .await
        .expect("the caller's statement");
    tx.rollback().await.expect("rollback");
    store.get(&scope, &key).await.expect("the store's next use");
    store.close().await;
}
