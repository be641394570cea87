//! Group commit: concurrent reservations and resolutions share statements,
//! and every caller still gets exactly its own answer.

mod common;

use std::sync::Arc;
use std::time::Duration;

use idem::{
    FinalOutcome, Fingerprint, IdempotencyKey, LeaseExpiry, OwnerToken, Reservation,
    ReserveRequest, Scope, Store, StoreError, StoredResponse, Verdict,
};
use idem_postgres::{PgOptions, PgStore};
use idem_testkit::fault::FaultProxy;
use idem_testkit::services;
use tokio::sync::Barrier;
use tokio::task::JoinSet;

fn request<'a>(scope: &'a Scope, key: &'a IdempotencyKey) -> ReserveRequest<'a> {
    ReserveRequest {
        scope,
        key,
        fingerprint: Fingerprint::builder()
            .part("k", key.as_str().as_bytes())
            .finish(),
        owner: OwnerToken::random(),
        lease: Duration::from_secs(60),
        retention: Duration::from_secs(3600),
        on_lease_expiry: LeaseExpiry::Retry,
    }
}

fn outcome(body: String) -> FinalOutcome {
    FinalOutcome {
        verdict: Verdict::Completed,
        response: StoredResponse::new(201, body),
        resource_id: None,
        error_code: None,
        retention: Duration::from_secs(3600),
    }
}

fn key(n: usize) -> IdempotencyKey {
    format!("k-{n}").parse().expect("key")
}

/// 64 keys, 4 racers each, all at once: one reservation per key, the
/// other racers told "in progress"; then the 64 winners resolve at once,
/// beside a resolution that lost its lease: each winner's own answer is
/// recorded, the stale one is fenced. Grouped statements carried more than
/// one operation each.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_operations_share_statements_and_each_gets_its_own_answer() {
    let Some(store) = common::shared_store().await else {
        return;
    };
    let scope = idem_testkit::conformance::unique_scope("pg-group");
    const KEYS: usize = 64;
    const RACERS: usize = 4;
    let barrier = Arc::new(Barrier::new(KEYS * RACERS));
    let mut tasks = JoinSet::new();
    for n in 0..KEYS {
        for _ in 0..RACERS {
            let (store, scope, barrier) = (Arc::clone(&store), scope.clone(), Arc::clone(&barrier));
            tasks.spawn(async move {
                let k = key(n);
                barrier.wait().await;
                let r = store.reserve(request(&scope, &k)).await.expect("reserve");
                (n, r)
            });
        }
    }
    let mut leases = vec![None; KEYS];
    let mut in_progress = 0;
    while let Some(joined) = tasks.join_next().await {
        match joined.expect("task") {
            (n, Reservation::Acquired(lease)) => {
                assert!(leases[n].is_none(), "two reservations of key {n}");
                leases[n] = Some(lease);
            }
            (_, Reservation::InProgress { .. }) => in_progress += 1,
            (n, other) => panic!("key {n}: unexpected {other:?}"),
        }
    }
    assert!(
        leases.iter().all(Option::is_some),
        "every key reserved once"
    );
    assert_eq!(in_progress, KEYS * (RACERS - 1));

    let barrier = Arc::new(Barrier::new(KEYS + 1));
    let mut tasks = JoinSet::new();
    for (n, lease) in leases.into_iter().enumerate() {
        let lease = lease.expect("reserved");
        let (store, scope, barrier) = (Arc::clone(&store), scope.clone(), Arc::clone(&barrier));
        tasks.spawn(async move {
            barrier.wait().await;
            let done = store
                .resolve(&scope, &key(n), &lease, &outcome(format!("answer {n}")))
                .await;
            (Some(n), done)
        });
    }
    // A stale owner of key 0: same key, another owner token.
    let stale = idem::Lease {
        owner: OwnerToken::random(),
        attempt: 1,
        locked_until: idem::Timestamp::from_millis(0),
    };
    {
        let (store, scope, barrier) = (Arc::clone(&store), scope.clone(), Arc::clone(&barrier));
        tasks.spawn(async move {
            barrier.wait().await;
            let done = store
                .resolve(&scope, &key(0), &stale, &outcome("stale".to_owned()))
                .await;
            (None, done)
        });
    }
    while let Some(joined) = tasks.join_next().await {
        match joined.expect("task") {
            (Some(n), done) => done.unwrap_or_else(|e| panic!("key {n}: {e}")),
            (None, done) => assert!(matches!(done, Err(StoreError::Fenced)), "{done:?}"),
        }
    }
    for n in 0..KEYS {
        let k = key(n);
        match store.reserve(request(&scope, &k)).await.expect("replay") {
            Reservation::Existing(record) => {
                let response = record.response.expect("a stored answer");
                assert_eq!(response.status, 201);
                assert_eq!(response.body, format!("answer {n}").as_bytes());
            }
            other => panic!("key {n}: unexpected {other:?}"),
        }
    }
    let stats = store.group_commit_stats();
    eprintln!("group commit: {stats:?}");
    assert!(
        stats.operations > stats.statements,
        "grouped statements carried more than one operation each: {stats:?}"
    );
}

/// One operation at a time finds a slot free every time: each runs alone,
/// as a plain statement, and no group is formed.
#[tokio::test]
async fn operations_one_at_a_time_run_alone() {
    let Some(opts) = common::options() else {
        return;
    };
    let store = PgStore::connect_with(opts).await.expect("connect");
    let scope = idem_testkit::conformance::unique_scope("pg-group-alone");
    for n in 0..5 {
        let k = key(n);
        let Reservation::Acquired(lease) =
            store.reserve(request(&scope, &k)).await.expect("reserve")
        else {
            panic!("a fresh key is acquired");
        };
        store
            .resolve(&scope, &k, &lease, &outcome(format!("alone {n}")))
            .await
            .expect("resolve");
    }
    let stats = store.group_commit_stats();
    assert_eq!((stats.statements, stats.alone), (0, 10), "{stats:?}");
}

/// With group commit off, every operation is its own statement and no
/// group is counted.
#[tokio::test]
async fn group_commit_off_runs_each_operation_alone() {
    let Some(opts) = common::options() else {
        return;
    };
    let url_opts = PgOptions::from_url(&format!(
        "{}?group_commit=false",
        services::postgres().expect("checked above")
    ))
    .expect("url");
    assert!(!url_opts.group_commit());
    let opts = opts.with_group_commit(false);
    let store = PgStore::connect_with(opts).await.expect("connect");
    let scope = idem_testkit::conformance::unique_scope("pg-group-off");
    let k = key(1);
    let Reservation::Acquired(lease) = store.reserve(request(&scope, &k)).await.expect("reserve")
    else {
        panic!("a fresh key is acquired");
    };
    store
        .resolve(&scope, &k, &lease, &outcome("alone".to_owned()))
        .await
        .expect("resolve");
    assert_eq!(store.group_commit_stats(), Default::default());
}

/// A batch that cannot reach the server fails each of its operations with
/// a transient error; once the server is back, the same store serves again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_batch_fails_every_operation_as_unavailable() {
    let Some(url) = services::postgres() else {
        return;
    };
    let link = FaultProxy::start(services::socket_addr(&url)).await;
    let opts = PgOptions::from_url(&services::via(
        &url,
        link.addr(),
        "max_connections=4&acquire_timeout_ms=1000&connect_timeout_ms=1000",
    ))
    .expect("url");
    let store = Arc::new(PgStore::connect_with(opts).await.expect("connect"));
    let scope = idem_testkit::conformance::unique_scope("pg-group-down");
    link.cut();
    let mut tasks = JoinSet::new();
    for n in 0..16 {
        let (store, scope) = (Arc::clone(&store), scope.clone());
        tasks.spawn(async move { store.reserve(request(&scope, &key(n))).await });
    }
    while let Some(joined) = tasks.join_next().await {
        let err = joined.expect("task").expect_err("no server");
        assert!(err.is_transient(), "{err:?}");
    }
    link.restore();
    let k = key(99);
    let reserved = store.reserve(request(&scope, &k)).await.expect("back");
    assert!(matches!(reserved, Reservation::Acquired(_)), "{reserved:?}");
}
