//! Reservations per second on PostgreSQL, by number of concurrent callers.
//!
//! * `reserve/postgres`: one atomic reservation of a fresh key (one
//!   `INSERT … ON CONFLICT DO NOTHING` round trip, committed);
//! * `engine_run/postgres`: the whole cycle through the engine — reserve,
//!   trivial work, record the answer (two committed statements).
//!
//! Two pool settings: `postgres` (the default: the pool pings a connection
//! before handing it out) and `postgres_no_ping` (`test_before_acquire =
//! false`: one round trip less per operation).
//!
//! The tables live in their own schema, `idem_bench`, dropped and
//! recreated at start. Each pool holds up to 32 connections, so 256 callers
//! queue for them, as a gateway's requests would.
//!
//! Run: `IDEM_TEST_PG_URL=postgres://… cargo bench -p idem-postgres --bench
//! reserve` (default `postgres://postgres@127.0.0.1:5432/test`). Without a
//! server the benchmark says so and measures nothing.

#![allow(missing_docs)]

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use idem::{
    Engine, Fingerprint, LeaseExpiry, OwnerToken, ReserveRequest, Scope, Store, StoredResponse,
};
use idem_postgres::{PgOptions, PgStore};

const CALLERS: [u64; 3] = [1, 16, 256];
const SCHEMA: &str = "idem_bench";

static NEXT_KEY: AtomicU64 = AtomicU64::new(0);

fn fresh_key() -> idem::IdempotencyKey {
    format!("bench-{}", NEXT_KEY.fetch_add(1, Ordering::Relaxed))
        .parse()
        .expect("valid key")
}

/// Runs `iters` operations spread over `callers` concurrent tasks and
/// returns the wall time.
async fn spread<F, Fut>(iters: u64, callers: u64, op: F) -> Duration
where
    F: Fn() -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    let start = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for c in 0..callers {
        let n = iters / callers + u64::from(c < iters % callers);
        let op = op.clone();
        tasks.spawn(async move {
            for _ in 0..n {
                op().await;
            }
        });
    }
    while let Some(done) = tasks.join_next().await {
        done.expect("bench task");
    }
    start.elapsed()
}

type Op = std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>;

fn reserve_op(store: Arc<PgStore>, scope: Scope) -> impl Fn() -> Op + Clone + Send + 'static {
    let fp = Fingerprint::builder()
        .json_body(br#"{"amount":100}"#)
        .finish();
    move || {
        let (store, scope) = (Arc::clone(&store), scope.clone());
        Box::pin(async move {
            let key = fresh_key();
            let r = store
                .reserve(ReserveRequest {
                    scope: &scope,
                    key: &key,
                    fingerprint: fp,
                    owner: OwnerToken::random(),
                    lease: Duration::from_secs(30),
                    retention: Duration::from_secs(86_400),
                    on_lease_expiry: LeaseExpiry::Retry,
                })
                .await
                .expect("reserve");
            assert!(matches!(r, idem::Reservation::Acquired(_)));
        })
    }
}

fn run_op(engine: Engine<PgStore>, scope: Scope) -> impl Fn() -> Op + Clone + Send + 'static {
    let fp = Fingerprint::builder()
        .json_body(br#"{"amount":100}"#)
        .finish();
    move || {
        let (engine, scope) = (engine.clone(), scope.clone());
        Box::pin(async move {
            let key = fresh_key();
            let run = engine
                .run(&scope, &key, fp, || async {
                    StoredResponse::new(201, "ok")
                })
                .await
                .expect("run");
            assert!(matches!(run, idem::Run::Executed(_)));
        })
    }
}

fn benches(c: &mut Criterion) {
    let url = std::env::var("IDEM_TEST_PG_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned());
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let store = rt.block_on(async {
        let opts = PgOptions::from_url(&url).expect("valid URL");
        let admin = PgStore::connect_with(opts.clone().with_migrate(false)).await;
        let admin = match admin {
            Ok(admin) => admin,
            Err(err) => {
                eprintln!("!!!!!!!! SKIPPED: PostgreSQL benchmark: {err}");
                return None;
            }
        };
        sqlx::query(&format!("DROP SCHEMA IF EXISTS {SCHEMA} CASCADE"))
            .execute(admin.pool())
            .await
            .expect("drop bench schema");
        admin.close().await;
        let opts = opts.with_schema(SCHEMA).with_max_connections(32);
        let pinging = PgStore::connect_with(opts.clone())
            .await
            .expect("connect bench store");
        let mut no_ping = opts;
        no_ping.test_before_acquire = false;
        let no_ping = PgStore::connect_with(no_ping)
            .await
            .expect("connect bench store");
        Some([
            ("postgres", Arc::new(pinging)),
            ("postgres_no_ping", Arc::new(no_ping)),
        ])
    });
    let Some(stores) = store else { return };
    let scope = Scope::new("bench-tenant", "POST /v1/payments").expect("scope");

    for (name, engine_cycle) in [("reserve", false), ("engine_run", true)] {
        let mut group = c.benchmark_group(name);
        group.throughput(Throughput::Elements(1));
        group.sample_size(10);
        group.warm_up_time(Duration::from_secs(1));
        group.measurement_time(Duration::from_secs(3));
        for callers in CALLERS {
            for (label, store) in &stores {
                let id = BenchmarkId::new(*label, callers);
                if engine_cycle {
                    let op = run_op(Engine::from_arc(Arc::clone(store)), scope.clone());
                    group.bench_function(id, |b| {
                        b.to_async(&rt)
                            .iter_custom(|iters| spread(iters, callers, op.clone()))
                    });
                } else {
                    let op = reserve_op(Arc::clone(store), scope.clone());
                    group.bench_function(id, |b| {
                        b.to_async(&rt)
                            .iter_custom(|iters| spread(iters, callers, op.clone()))
                    });
                }
            }
        }
        group.finish();
    }
}

criterion_group!(reserve, benches);
criterion_main!(reserve);
