//! `idem::Tiered<RedisStore, PgStore>`: Redis as the fast tier in front of
//! PostgreSQL. The conformance suite on the composition, and proof that
//! losing Redis' data never lets completed or running work execute again.

use crate::common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use common::Prefixed;
use idem::{Begin, Engine, Fingerprint, RecordState, Run, Store, StoredResponse, Tiered};
use idem_postgres::{PgOptions, PgStore};
use idem_redis::{RedisStore, redis};
use tokio::task::JoinSet;

/// A store on the shared PostgreSQL test database, or `None` (skip).
async fn postgres() -> Option<PgStore> {
    let url = idem_testkit::services::postgres()?;
    let opts = PgOptions::from_url(&url)
        .expect("valid PostgreSQL URL")
        .with_max_connections(8);
    Some(
        PgStore::connect_with(opts)
            .await
            .expect("connect PostgreSQL"),
    )
}

/// Redis (under a fresh prefix, at `redis_url` or the default) over
/// PostgreSQL.
async fn tiered(redis_url: Option<String>) -> Option<Prefixed<Tiered<RedisStore, PgStore>>> {
    let (opts, prefix) = match redis_url {
        Some(url) => common::options_for(&url),
        None => common::options()?,
    };
    let durable = postgres().await?;
    let url = opts.url().to_owned();
    let fast = RedisStore::connect_with(opts).await.expect("connect Redis");
    Some(Prefixed {
        store: Arc::new(Tiered::new(fast.clone(), durable)),
        redis: fast,
        url,
        prefix,
    })
}

mod tiered_redis_postgres {
    idem_testkit::store_conformance!(async { super::tiered(None).await });
}

/// The dedicated Redis database these tests may flush (never FLUSHALL: the
/// server is shared).
const FLUSHABLE_DB: u8 = 9;

/// The tests that flush take turns, so one's flush never lands in the
/// middle of another's checks.
static FLUSHING: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

async fn flush(fast: &RedisStore) {
    let db: i64 = redis::cmd("CLIENT")
        .arg("INFO")
        .query_async::<String>(&mut fast.connection())
        .await
        .expect("CLIENT INFO")
        .split_whitespace()
        .find_map(|field| field.strip_prefix("db="))
        .and_then(|db| db.parse().ok())
        .expect("CLIENT INFO names the database");
    assert_eq!(
        db,
        i64::from(FLUSHABLE_DB),
        "only the dedicated database is flushed"
    );
    // ASYNC: the keys are gone at once, their memory freed afterwards, so a
    // database left large (by a benchmark, say) cannot time the flush out.
    redis::cmd("FLUSHDB")
        .arg("ASYNC")
        .query_async::<()>(&mut fast.connection())
        .await
        .expect("FLUSHDB");
}

#[tokio::test]
async fn after_redis_loses_everything_completed_work_is_replayed_from_postgres() {
    let _turn = FLUSHING.lock().await;
    let Some(f) = tiered(common::redis_url_with_db(FLUSHABLE_DB)).await else {
        return;
    };
    let engine = Engine::from_arc(Arc::clone(&f.store));
    let scope = idem_testkit::conformance::unique_scope("tiered-loss");
    let fp = Fingerprint::builder()
        .json_body(br#"{"amount":100}"#)
        .finish();
    let keys: Vec<idem::IdempotencyKey> = (0..10)
        .map(|i| format!("pay-{i}").parse().expect("key"))
        .collect();
    let executions = Arc::new(AtomicU32::new(0));
    let work = |executions: Arc<AtomicU32>, key: idem::IdempotencyKey| async move {
        executions.fetch_add(1, Ordering::SeqCst);
        StoredResponse::new(201, format!("paid {key}"))
    };
    for k in &keys {
        let run = engine
            .run(&scope, k, fp, || work(Arc::clone(&executions), k.clone()))
            .await
            .expect("run");
        assert!(matches!(run, Run::Executed(_)));
        // The answer is cached in Redis.
        let copy = f.redis.get(&scope, k).await.expect("get").expect("cached");
        assert_eq!(copy.state, RecordState::Completed);
    }
    assert_eq!(executions.load(Ordering::SeqCst), 10);

    flush(&f.redis).await;
    for k in &keys {
        assert_eq!(f.redis.get(&scope, k).await.expect("get"), None, "lost");
    }

    // Retries, eight concurrent ones per key: all replayed from
    // PostgreSQL, none executed.
    let mut tasks = JoinSet::new();
    for k in &keys {
        for _ in 0..8 {
            let (engine, scope, k, executions) = (
                engine.clone(),
                scope.clone(),
                k.clone(),
                Arc::clone(&executions),
            );
            tasks.spawn(async move {
                let run = engine
                    .run(&scope, &k, fp, || work(executions, k.clone()))
                    .await
                    .expect("run");
                (k, run)
            });
        }
    }
    while let Some(joined) = tasks.join_next().await {
        match joined.expect("task") {
            (k, Run::Replayed(r)) => {
                assert_eq!(r.response.status, 201);
                assert_eq!(r.response.body, format!("paid {k}").into_bytes());
            }
            (k, other) => panic!("{k}: expected a replay, got {other:?}"),
        }
    }
    assert_eq!(executions.load(Ordering::SeqCst), 10, "no work re-executed");
    // The replay put the copy back in Redis.
    for k in &keys {
        assert!(f.redis.get(&scope, k).await.expect("get").is_some());
    }
}

#[tokio::test]
async fn after_redis_loses_everything_running_work_is_not_duplicated() {
    let _turn = FLUSHING.lock().await;
    let Some(f) = tiered(common::redis_url_with_db(FLUSHABLE_DB)).await else {
        return;
    };
    let engine = Engine::from_arc(Arc::clone(&f.store));
    let scope = idem_testkit::conformance::unique_scope("tiered-loss-running");
    let k: idem::IdempotencyKey = "ship-1".parse().expect("key");
    let fp = Fingerprint::builder().part("order", b"1").finish();
    let Begin::Execute(guard) = engine.begin(&scope, &k, fp).await.expect("begin") else {
        panic!("the first attempt executes");
    };
    flush(&f.redis).await;
    match engine.begin(&scope, &k, fp).await.expect("begin") {
        Begin::InProgress { .. } => {}
        other => panic!("PostgreSQL still holds the live lease, got {other:?}"),
    }
    guard
        .complete(StoredResponse::new(200, "shipped"))
        .await
        .expect("complete");
    match engine.begin(&scope, &k, fp).await.expect("begin") {
        Begin::Replay(r) => assert_eq!(&r.response.body[..], b"shipped"),
        other => panic!("expected a replay, got {other:?}"),
    }
}

#[tokio::test]
async fn a_broken_fast_tier_costs_speed_not_correctness() {
    let Some(f) = tiered(None).await else {
        return;
    };
    let engine = Engine::from_arc(Arc::clone(&f.store));
    let scope = idem_testkit::conformance::unique_scope("tiered-broken-fast");
    let k: idem::IdempotencyKey = "pay-1".parse().expect("key");
    let fp = Fingerprint::builder().part("amount", b"100").finish();
    let executions = Arc::new(AtomicU32::new(0));
    // Kill the fast tier's connection before every engine call: the calls
    // that hit the dead connection fail inside Tiered, which then relies on
    // PostgreSQL alone.
    let kill = || async {
        let id: i64 = redis::cmd("CLIENT")
            .arg("ID")
            .query_async(&mut f.redis.connection())
            .await
            .expect("CLIENT ID");
        let client = redis::Client::open(f.url.as_str()).expect("client");
        let mut other = client
            .get_multiplexed_async_connection()
            .await
            .expect("second connection");
        redis::cmd("CLIENT")
            .arg("KILL")
            .arg("ID")
            .arg(id)
            .query_async::<i64>(&mut other)
            .await
            .expect("CLIENT KILL");
    };
    for round in 0..3 {
        kill().await;
        let n = Arc::clone(&executions);
        let run = engine
            .run(&scope, &k, fp, || async move {
                n.fetch_add(1, Ordering::SeqCst);
                StoredResponse::new(201, "paid")
            })
            .await
            .expect("the durable tier answers");
        match (round, run) {
            (0, Run::Executed(_)) | (1.., Run::Replayed(_)) => {}
            (round, other) => panic!("round {round}: unexpected {other:?}"),
        }
    }
    assert_eq!(executions.load(Ordering::SeqCst), 1);
}
