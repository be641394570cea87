//! Behaviour that needs a schema of its own: restarts, exact purge
//! batches, schema versions, pool exhaustion, takeover races.

use crate::common;

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
    let (opts, app) = named(opts);
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
    let killed = terminate(&observer, &app, None).await;
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

/// Options whose connections carry an `application_name` of their own
/// (returned), so the server's view of them can be read and ended.
fn named(opts: idem_postgres::PgOptions) -> (idem_postgres::PgOptions, String) {
    let app = format!("idem-test-{}", &OwnerToken::random().to_string()[..12]);
    let connect = opts.connect_options().clone().application_name(&app);
    (opts.with_connect_options(connect), app)
}

/// Ends the connections named `app` (as a restart or a fail-over would),
/// the `newest` most recently opened only when given; how many it ended.
async fn terminate(observer: &PgStore, app: &str, newest: Option<i64>) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
         WHERE application_name = $1 ORDER BY backend_start DESC LIMIT $2) AS t",
    )
    .bind(app)
    .bind(newest)
    .fetch_one(observer.pool())
    .await
    .expect("terminate")
}

/// The backends of the connections whose `application_name` is `app`.
async fn backends(observer: &PgStore, app: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM pg_stat_activity WHERE application_name = $1")
        .bind(app)
        .fetch_one(observer.pool())
        .await
        .expect("pg_stat_activity")
}

/// One reservation and its resolution of a fresh key, which must succeed.
async fn reserve_and_resolve(store: &PgStore, scope: &idem::Scope, key: &str) {
    try_reserve_and_resolve(store, scope, key)
        .await
        .unwrap_or_else(|err| panic!("{key}: {err}"));
}

/// One reservation and its resolution of a fresh key.
async fn try_reserve_and_resolve(
    store: &PgStore,
    scope: &idem::Scope,
    key: &str,
) -> Result<(), StoreError> {
    let k: idem::IdempotencyKey = key.parse().expect("key");
    let Reservation::Acquired(lease) = store
        .reserve(request(scope, &k, Duration::from_secs(60)))
        .await?
    else {
        panic!("a fresh key is acquired");
    };
    let outcome = FinalOutcome {
        verdict: Verdict::Completed,
        response: StoredResponse::new(200, "done"),
        resource_id: None,
        error_code: None,
        retention: Duration::from_secs(60),
    };
    store.resolve(scope, &k, &lease, &outcome).await
}

/// A thread dedicated to its one runtime, as a serving thread is, which
/// reserves and resolves each key sent to it on `store`.
struct Dedicated {
    keys: tokio::sync::mpsc::UnboundedSender<(
        String,
        tokio::sync::oneshot::Sender<Result<(), StoreError>>,
    )>,
}

impl Dedicated {
    fn start(store: PgStore, scope: idem::Scope) -> Self {
        let (keys, mut rx) = tokio::sync::mpsc::unbounded_channel::<(
            String,
            tokio::sync::oneshot::Sender<Result<(), StoreError>>,
        )>();
        std::thread::spawn(move || {
            idem::store::local::dedicate_current_thread();
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime")
                .block_on(async move {
                    while let Some((key, reply)) = rx.recv().await {
                        let _ = reply.send(try_reserve_and_resolve(&store, &scope, &key).await);
                    }
                });
        });
        Self { keys }
    }

    async fn run(&self, key: &str) -> Result<(), StoreError> {
        let (reply, answer) = tokio::sync::oneshot::channel();
        self.keys
            .send((key.to_owned(), reply))
            .expect("thread alive");
        answer.await.expect("answered")
    }
}

/// A failed operation on one thread's connection (the server ended it)
/// makes every other thread test its own before using it: a restart or a
/// broken link ends them all, and each thread would otherwise fail one
/// request to learn it, however long it waits between pings.
#[tokio::test]
async fn a_failure_on_one_threads_connection_makes_the_others_test_theirs() {
    let Some(opts) = common::options() else {
        return;
    };
    let (opts, app) = named(opts);
    let opts = opts
        .with_ping_after_idle(Duration::from_secs(600))
        .with_max_connections(3)
        .with_thread_connections(2);
    let store = PgStore::connect_with(opts).await.expect("connect");
    let observer = common::shared_store().await.expect("second store");
    let scope = idem_testkit::conformance::unique_scope("pg-own-fail");
    let (a, b) = (
        Dedicated::start(store.clone(), scope.clone()),
        Dedicated::start(store.clone(), scope.clone()),
    );
    for (n, thread) in [(2, &a), (3, &b)] {
        thread.run(&format!("open-{n}")).await.expect("on the pool");
        idem_testkit::wait::eventually("the thread's own connection opens", async || {
            backends(&observer, &app).await == n
        })
        .await;
        thread.run(&format!("own-{n}")).await.expect("on its own");
    }
    // The server ends both threads' connections (the newest two), not the
    // pool's.
    assert_eq!(terminate(&observer, &app, Some(2)).await, 2);
    let failed = a.run("after-kill-a").await;
    assert!(
        failed.as_ref().is_err_and(StoreError::is_transient),
        "a learns it the hard way: {failed:?}"
    );
    b.run("after-kill-b")
        .await
        .expect("b tests its connection first and runs on the pool");
    a.run("again-a").await.expect("a recovered");
    store.close().await;
}

/// On a thread dedicated to its one runtime (as the gateway's serving
/// threads are), the store opens a connection of the thread's own beside
/// the pool's, so the thread's event loop hears the server's answers; it
/// is set aside out of `max_connections`, so a second such thread finds no
/// seat left and uses the pool. One killed while idle is replaced without
/// failing an operation, and closing the store closes it with the pool's.
#[tokio::test]
async fn a_dedicated_thread_has_a_connection_of_its_own_closed_with_the_store() {
    let Some(opts) = common::options() else {
        return;
    };
    // This test's thread runs its one runtime to the end.
    idem::store::local::dedicate_current_thread();
    let (opts, app) = named(opts);
    let idle = Duration::from_millis(100);
    // Two connections: the pool's one and one thread's own.
    let opts = opts
        .with_ping_after_idle(idle)
        .with_max_connections(2)
        .with_thread_connections(1);
    let store = PgStore::connect_with(opts).await.expect("connect");
    let observer = common::shared_store().await.expect("second store");
    let scope = idem_testkit::conformance::unique_scope("pg-own");

    // The first operation runs on the pool's connection and starts opening
    // the thread's own.
    reserve_and_resolve(&store, &scope, "first").await;
    idem_testkit::wait::eventually("the thread's own connection opens", async || {
        backends(&observer, &app).await == 2
    })
    .await;
    for i in 0..5 {
        reserve_and_resolve(&store, &scope, &format!("warm-{i}")).await;
    }
    assert_eq!(
        backends(&observer, &app).await,
        2,
        "the pool's connection and this thread's own, nothing more"
    );
    // Another dedicated thread: no seat is left for it, so it runs on the
    // pool, and the server still sees two connections.
    // (Joined off this thread: its event loop must keep running, since the
    // pool's connection was opened here.)
    let other = store.clone();
    let other_scope = scope.clone();
    let thread = std::thread::spawn(move || {
        idem::store::local::dedicate_current_thread();
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime")
            .block_on(async {
                for i in 0..5 {
                    reserve_and_resolve(&other, &other_scope, &format!("other-{i}")).await;
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            });
    });
    tokio::task::spawn_blocking(move || thread.join())
        .await
        .expect("joined")
        .expect("the other thread's operations succeed");
    assert_eq!(
        backends(&observer, &app).await,
        2,
        "no more than max_connections"
    );

    // The server ends them all while the store is idle (a restart, a
    // fail-over): both are tested after the idle spell and replaced.
    assert_eq!(terminate(&observer, &app, None).await, 2);
    tokio::time::sleep(idle * 3).await;
    reserve_and_resolve(&store, &scope, "after-kill").await;
    idem_testkit::wait::eventually("the thread opens a new connection", async || {
        backends(&observer, &app).await == 2
    })
    .await;
    reserve_and_resolve(&store, &scope, "on-the-new-one").await;

    store.close().await;
    idem_testkit::wait::eventually("closing the store closes every connection", async || {
        backends(&observer, &app).await == 0
    })
    .await;
}
