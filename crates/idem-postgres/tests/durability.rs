//! Behaviour that needs a schema of its own: restarts, exact purge
//! batches, schema versions, pool exhaustion, takeover races.

mod common;

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use idem::{
    Engine, FinalOutcome, Fingerprint, LeaseExpiry, OwnerToken, Purge, Reservation, ReserveRequest,
    Run, Scope, Store, StoreError, StoredResponse, Verdict,
};
use idem_postgres::{PgError, PgStore};
use tokio::task::JoinSet;

fn request<'a>(
    scope: &'a Scope,
    key: &'a idem::IdempotencyKey,
    lease: Duration,
) -> ReserveRequest<'a> {
    ReserveRequest {
        scope,
        key,
        fingerprint: Fingerprint::builder().part("k", b"v").finish(),
        owner: OwnerToken::random(),
        lease,
        retention: Duration::from_secs(3600),
        on_lease_expiry: LeaseExpiry::Retry,
    }
}

#[tokio::test]
async fn completed_records_survive_a_reconnect() {
    let Some(t) = common::Isolated::new("restart").await else {
        return;
    };
    let scope = Scope::new("acme", "POST /v1/payments").expect("scope");
    let executions = Arc::new(AtomicU32::new(0));
    let fp = Fingerprint::builder()
        .json_body(br#"{"amount":100}"#)
        .finish();
    let keys: Vec<idem::IdempotencyKey> = (0..20)
        .map(|i| format!("pay-{i}").parse().expect("key"))
        .collect();
    let engine = Engine::new(t.store.clone());
    for k in &keys {
        let n = Arc::clone(&executions);
        let run = engine
            .run(&scope, k, fp, || async move {
                n.fetch_add(1, Ordering::SeqCst);
                StoredResponse::new(201, k.as_str().to_owned()).with_header("x-id", "7")
            })
            .await
            .expect("run");
        assert!(matches!(run, Run::Executed(_)));
    }
    drop(engine);
    t.store.close().await;

    // A new process: a new pool on the same schema.
    let store = PgStore::connect_with(t.opts.clone())
        .await
        .expect("reconnect");
    let engine = Engine::new(store.clone());
    for k in &keys {
        let run = engine
            .run(&scope, k, fp, || async {
                executions.fetch_add(1, Ordering::SeqCst);
                StoredResponse::new(500, "must not run")
            })
            .await
            .expect("run");
        match run {
            Run::Replayed(r) => {
                assert_eq!(r.response.status, 201);
                assert_eq!(&r.response.body[..], k.as_str().as_bytes());
                assert_eq!(r.response.headers, vec![("x-id".to_owned(), "7".into())]);
            }
            other => panic!("expected a replay after reconnecting, got {other:?}"),
        }
    }
    assert_eq!(executions.load(Ordering::SeqCst), 20);
    let t = common::Isolated { store, ..t };
    t.drop_schema().await;
}

#[tokio::test]
async fn purge_deletes_exact_batches_and_never_processing_rows() {
    let Some(t) = common::Isolated::new("purge").await else {
        return;
    };
    let store = &t.store;
    let scope = Scope::new("acme", "op").expect("scope");
    for i in 0..7 {
        let k: idem::IdempotencyKey = format!("exp-{i}").parse().expect("key");
        let Reservation::Acquired(lease) = store
            .reserve(request(&scope, &k, Duration::from_secs(60)))
            .await
            .expect("reserve")
        else {
            panic!("acquired");
        };
        let outcome = FinalOutcome {
            verdict: Verdict::Completed,
            response: StoredResponse::new(200, "x"),
            resource_id: None,
            error_code: None,
            retention: Duration::from_millis(1),
        };
        store
            .resolve(&scope, &k, &lease, &outcome)
            .await
            .expect("resolve");
    }
    // Processing rows with lapsed leases and a retention in the past.
    for i in 0..3 {
        let k: idem::IdempotencyKey = format!("proc-{i}").parse().expect("key");
        let req = ReserveRequest {
            retention: Duration::from_millis(1),
            ..request(&scope, &k, Duration::from_millis(1))
        };
        let Reservation::Acquired(lease) = store.reserve(req).await.expect("reserve") else {
            panic!("acquired");
        };
        if i == 0 {
            store
                .mark_unknown(&scope, &k, &lease, "timeout")
                .await
                .expect("mark");
        }
    }
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert_eq!(store.purge_expired(0).await.expect("purge"), 0);
    assert_eq!(store.purge_expired(3).await.expect("purge"), 3);
    assert_eq!(store.purge_expired(3).await.expect("purge"), 3);
    assert_eq!(store.purge_expired(3).await.expect("purge"), 1);
    assert_eq!(store.purge_expired(3).await.expect("purge"), 0);
    let left: Vec<(String, String)> =
        sqlx::query_as("SELECT key, state FROM idem_records ORDER BY key")
            .fetch_all(store.pool())
            .await
            .expect("rows");
    assert_eq!(
        left,
        (0..3)
            .map(|i| (format!("proc-{i}"), "processing".to_owned()))
            .collect::<Vec<_>>()
    );
    t.drop_schema().await;
}

#[tokio::test]
async fn migrations_are_idempotent_and_refuse_a_newer_schema() {
    let Some(t) = common::Isolated::new("schema").await else {
        return;
    };
    // Concurrent migrators take turns; a current schema is left alone.
    let mut tasks = JoinSet::new();
    for _ in 0..4 {
        let store = t.store.clone();
        tasks.spawn(async move { store.migrate().await });
    }
    while let Some(done) = tasks.join_next().await {
        done.expect("task").expect("migrate");
    }
    let versions: Vec<i32> =
        sqlx::query_scalar("SELECT version FROM idem_schema_migrations ORDER BY version")
            .fetch_all(t.store.pool())
            .await
            .expect("versions");
    assert_eq!(
        versions,
        (1..=i32::try_from(PgStore::schema_version()).expect("small")).collect::<Vec<_>>()
    );

    sqlx::query("INSERT INTO idem_schema_migrations (version, description) VALUES (999, 'future')")
        .execute(t.store.pool())
        .await
        .expect("fake a newer schema");
    match t.store.migrate().await {
        Err(PgError::SchemaTooNew { found: 999, .. }) => {}
        other => panic!("expected SchemaTooNew, got {other:?}"),
    }
    t.drop_schema().await;
}

#[tokio::test]
async fn an_exhausted_pool_is_unavailable_not_stuck() {
    let Some(opts) = common::options() else {
        return;
    };
    let opts = opts
        .with_max_connections(1)
        .with_acquire_timeout(Duration::from_millis(200));
    let store = PgStore::connect_with(opts).await.expect("connect");
    let held = store.pool().acquire().await.expect("the only connection");
    let scope = Scope::new("acme", "op").expect("scope");
    let k: idem::IdempotencyKey = "k".parse().expect("key");
    let started = std::time::Instant::now();
    let err = store.get(&scope, &k).await.expect_err("no free connection");
    assert!(matches!(err, StoreError::Unavailable(_)), "{err:?}");
    assert!(started.elapsed() < Duration::from_secs(3));
    drop(held);
    assert_eq!(store.get(&scope, &k).await.expect("get"), None);
}

#[tokio::test]
async fn racers_on_a_lapsed_lease_take_it_over_once() {
    let Some(store) = common::shared_store().await else {
        return;
    };
    let scope = idem_testkit::conformance::unique_scope("pg-takeover-race");
    const KEYS: usize = 4;
    const RACERS: usize = 32;
    for k in 0..KEYS {
        let k: idem::IdempotencyKey = format!("k-{k}").parse().expect("key");
        store
            .reserve(request(&scope, &k, Duration::from_millis(50)))
            .await
            .expect("reserve");
    }
    tokio::time::sleep(Duration::from_millis(150)).await;
    let barrier = Arc::new(tokio::sync::Barrier::new(KEYS * RACERS));
    let mut tasks = JoinSet::new();
    for k in 0..KEYS {
        for _ in 0..RACERS {
            let (store, scope, barrier) = (Arc::clone(&store), scope.clone(), Arc::clone(&barrier));
            tasks.spawn(async move {
                let k: idem::IdempotencyKey = format!("k-{k}").parse().expect("key");
                barrier.wait().await;
                let r = store
                    .reserve(request(&scope, &k, Duration::from_secs(60)))
                    .await
                    .expect("reserve");
                (k, r)
            });
        }
    }
    let mut winners = HashSet::new();
    while let Some(joined) = tasks.join_next().await {
        match joined.expect("task") {
            (k, Reservation::Acquired(lease)) => {
                assert_eq!(lease.attempt, 2);
                assert!(winners.insert(k.clone()), "two takeovers of {k}");
            }
            (_, Reservation::InProgress { .. }) => {}
            (_, other) => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(winners.len(), KEYS);
}

#[tokio::test]
async fn racers_on_an_expired_record_replace_it_once() {
    let Some(store) = common::shared_store().await else {
        return;
    };
    let scope = idem_testkit::conformance::unique_scope("pg-replace-race");
    let k: idem::IdempotencyKey = "expired".parse().expect("key");
    let Reservation::Acquired(lease) = store
        .reserve(request(&scope, &k, Duration::from_secs(60)))
        .await
        .expect("reserve")
    else {
        panic!("acquired");
    };
    let outcome = FinalOutcome {
        verdict: Verdict::Completed,
        response: StoredResponse::new(200, "old"),
        resource_id: None,
        error_code: None,
        retention: Duration::from_millis(1),
    };
    store
        .resolve(&scope, &k, &lease, &outcome)
        .await
        .expect("resolve");
    tokio::time::sleep(Duration::from_millis(20)).await;
    const RACERS: usize = 32;
    let barrier = Arc::new(tokio::sync::Barrier::new(RACERS));
    let mut tasks = JoinSet::new();
    for i in 0..RACERS {
        let (store, scope, k, barrier) = (
            Arc::clone(&store),
            scope.clone(),
            k.clone(),
            Arc::clone(&barrier),
        );
        tasks.spawn(async move {
            // Half of them even bring another request under the same key.
            let fingerprint = Fingerprint::builder()
                .part("k", if i % 2 == 0 { b"v" } else { b"w" })
                .finish();
            barrier.wait().await;
            store
                .reserve(ReserveRequest {
                    fingerprint,
                    ..request(&scope, &k, Duration::from_secs(60))
                })
                .await
                .expect("reserve")
        });
    }
    let mut acquired = 0;
    while let Some(joined) = tasks.join_next().await {
        match joined.expect("task") {
            Reservation::Acquired(lease) => {
                assert_eq!(lease.attempt, 1);
                acquired += 1;
            }
            Reservation::InProgress { .. } | Reservation::Mismatch { .. } => {}
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(acquired, 1, "exactly one racer replaces the expired record");
}

#[tokio::test]
async fn killed_server_connections_are_replaced() {
    let Some(opts) = common::options() else {
        return;
    };
    let app = format!("idem-test-{}", &OwnerToken::random().to_string()[..12]);
    let connect = opts.connect_options().clone().application_name(&app);
    let opts = opts.with_connect_options(connect);
    let store = PgStore::connect_with(opts).await.expect("connect");
    let scope = idem_testkit::conformance::unique_scope("pg-killed");
    let k: idem::IdempotencyKey = "k".parse().expect("key");
    let Reservation::Acquired(lease) = store
        .reserve(request(&scope, &k, Duration::from_secs(60)))
        .await
        .expect("reserve")
    else {
        panic!("acquired");
    };
    // The server ends every connection of this store (as a restart or a
    // fail-over would).
    let observer = common::shared_store().await.expect("second store");
    let killed: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
         WHERE application_name = $1) AS t",
    )
    .bind(&app)
    .fetch_one(observer.pool())
    .await
    .expect("terminate");
    assert!(killed >= 1, "the store had a connection open");

    // The pool notices and reconnects; at worst one call fails, transiently.
    let outcome = FinalOutcome {
        verdict: Verdict::Completed,
        response: StoredResponse::new(200, "after"),
        resource_id: None,
        error_code: None,
        retention: Duration::from_secs(60),
    };
    let mut failures = 0;
    loop {
        match store.resolve(&scope, &k, &lease, &outcome).await {
            Ok(()) => break,
            Err(err) => {
                assert!(
                    err.is_transient(),
                    "a killed connection is transient: {err}"
                );
                failures += 1;
                assert!(failures < 5, "no reconnection: {err}");
            }
        }
    }
    let rec = store.get(&scope, &k).await.expect("get").expect("exists");
    assert_eq!(rec.state, idem::RecordState::Completed);
}
