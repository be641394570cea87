//! The pool's options at work on a running store: connections kept open
//! while idle, idle ones above them closed, and connections ended while
//! idle tested before use.

use crate::common;

use std::time::Duration;

use idem::{OwnerToken, Store, StoreError};
use idem_postgres::{PgOptions, PgStore};
use idem_testkit::wait::eventually;

/// Options whose connections carry an `application_name` of their own
/// (returned), so the server's view of them can be read and ended.
fn named(opts: PgOptions) -> (PgOptions, String) {
    let app = format!("idem-test-{}", &OwnerToken::random().to_string()[..12]);
    let connect = opts.connect_options().clone().application_name(&app);
    (opts.with_connect_options(connect), app)
}

/// The backends of the connections whose `application_name` is `app`.
async fn backends(observer: &PgStore, app: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM pg_stat_activity WHERE application_name = $1")
        .bind(app)
        .fetch_one(observer.pool())
        .await
        .expect("pg_stat_activity")
}

/// `with_min_connections(3)` and `with_idle_timeout`: with nothing to do,
/// the pool opens three connections and keeps them; after a burst of six,
/// the idle ones above the three are closed, on the server too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn min_connections_stay_open_and_idle_ones_above_them_close() {
    let Some(opts) = common::options() else {
        return;
    };
    let observer = common::shared_store().await.expect("observer");
    let (opts, app) = named(opts);
    let idle = Duration::from_millis(300);
    let store = PgStore::connect_with(opts.with_min_connections(3).with_idle_timeout(Some(idle)))
        .await
        .expect("connect");
    let pool = store.pool();
    eventually("min_connections opened with nothing to do", async || {
        pool.size() == 3 && pool.num_idle() == 3
    })
    .await;
    let mut burst = Vec::new();
    for _ in 0..6 {
        burst.push(pool.acquire().await.expect("acquire"));
    }
    assert_eq!(pool.size(), 6);
    drop(burst);
    eventually(
        "idle connections above min_connections closed",
        async || pool.size() == 3 && pool.num_idle() == 3 && backends(&observer, &app).await == 3,
    )
    .await;
    assert_eq!(pool.options().get_idle_timeout(), Some(idle));
    store.close().await;

    let keep = PgStore::connect_with(common::options().expect("checked").with_idle_timeout(None))
        .await
        .expect("connect");
    assert_eq!(keep.pool().options().get_idle_timeout(), None, "kept open");
    keep.close().await;
}

/// `with_test_before_acquire`, against the URL saying the opposite: a
/// connection the server ended while it sat idle is pinged and replaced
/// when on, so the next operation succeeds; off, it fails that operation
/// as the store being unavailable, and the one after succeeds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_ended_while_idle_fails_an_operation_only_untested() {
    let Some(url) = idem_testkit::services::postgres() else {
        return;
    };
    let observer = common::shared_store().await.expect("observer");
    let scope = idem_testkit::conformance::unique_scope("pg-test-before-acquire");
    let k: idem::IdempotencyKey = "k".parse().expect("key");
    let sep = if url.contains('?') { '&' } else { '?' };
    for test in [true, false] {
        let opts = PgOptions::from_url(&format!(
            "{url}{sep}max_connections=1&test_before_acquire={}",
            !test
        ))
        .expect("valid");
        let (opts, app) = named(opts);
        let opts = opts
            .with_test_before_acquire(test)
            .with_ping_after_idle(Duration::ZERO);
        let store = PgStore::connect_with(opts).await.expect("connect");
        assert!(store.get(&scope, &k).await.expect("get").is_none());
        let ended: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
             WHERE application_name = $1) AS t",
        )
        .bind(&app)
        .fetch_one(observer.pool())
        .await
        .expect("terminate");
        // The pool's one connection, and perhaps the connection that
        // checked the server at connect, still closing.
        assert!(
            ended >= 1,
            "test_before_acquire={test}: the pool's connection"
        );
        eventually("the server ended the connection", async || {
            backends(&observer, &app).await == 0
        })
        .await;
        let next = store.get(&scope, &k).await;
        if test {
            assert!(matches!(next, Ok(None)), "tested and replaced: {next:?}");
        } else {
            assert!(
                matches!(next, Err(StoreError::Unavailable(_))),
                "untested: {next:?}"
            );
            let after = store.get(&scope, &k).await;
            assert!(matches!(after, Ok(None)), "replaced after: {after:?}");
        }
        store.close().await;
    }
}
