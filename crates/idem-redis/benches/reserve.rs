//! Reservations per second on Redis, by number of concurrent callers.
//!
//! * `reserve/redis`: one reservation of a fresh key (one `EVALSHA` of the
//!   reserve script);
//! * `engine_run/redis`: the whole cycle through the engine — reserve,
//!   trivial work, record the answer (two scripts);
//! * `engine_run/tiered_redis_postgres`: the same through
//!   `Tiered<RedisStore, PgStore>` (PostgreSQL first, then the Redis copy),
//!   when PostgreSQL is reachable too.
//!
//! Keys live under the prefix `idembench-<pid>` and are deleted at the end
//! (processing records carry no TTL). All callers share the store's one
//! multiplexed connection.
//!
//! Run: `cargo bench -p idem-redis --bench reserve` (servers from
//! `IDEM_TEST_REDIS_URL` / `IDEM_TEST_PG_URL`, defaulting to loopback).

#![allow(missing_docs)]

use std::sync::Arc;
use std::time::Duration;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use idem::{Engine, Scope, Tiered};
use idem_postgres::{PgOptions, PgStore};
use idem_redis::{RedisOptions, RedisStore, redis};
use idem_testkit::bench::{CALLERS, reserve_op, run_op, spread};

async fn delete_prefix(store: &RedisStore) -> redis::RedisResult<u64> {
    let mut conn = store.connection();
    let pattern = format!("{}:*", store.prefix());
    let mut cursor: u64 = 0;
    let mut deleted = 0;
    loop {
        let (next, names): (u64, Vec<Vec<u8>>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(&pattern)
            .arg("COUNT")
            .arg(10_000)
            .query_async(&mut conn)
            .await?;
        if !names.is_empty() {
            deleted += redis::cmd("UNLINK")
                .arg(&names)
                .query_async::<u64>(&mut conn)
                .await?;
        }
        if next == 0 {
            return Ok(deleted);
        }
        cursor = next;
    }
}

fn benches(c: &mut Criterion) {
    let redis_url = std::env::var("IDEM_TEST_REDIS_URL")
        .unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned());
    let pg_url = std::env::var("IDEM_TEST_PG_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned());
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let stores = rt.block_on(async {
        let opts = RedisOptions::from_url(&redis_url)
            .expect("valid URL")
            .with_prefix(format!("idembench-{}", std::process::id()));
        let redis = match RedisStore::connect_with(opts).await {
            Ok(store) => store,
            Err(err) => {
                eprintln!("!!!!!!!! SKIPPED: Redis benchmark: {err}");
                return None;
            }
        };
        let pg = match PgOptions::from_url(&pg_url) {
            Ok(opts) => {
                PgStore::connect_with(opts.with_schema("idem_bench").with_max_connections(32))
                    .await
                    .map_err(|err| eprintln!("!!!!!!!! SKIPPED: tiered benchmark: {err}"))
                    .ok()
            }
            Err(err) => {
                eprintln!("!!!!!!!! SKIPPED: tiered benchmark: {err}");
                None
            }
        };
        Some((Arc::new(redis), pg))
    });
    let Some((store, pg)) = stores else { return };
    let tiered = pg.map(|pg| Arc::new(Tiered::new((*store).clone(), pg)));
    let scope = Scope::new("bench-tenant", "POST /v1/payments").expect("scope");

    let mut group = c.benchmark_group("reserve");
    group.throughput(Throughput::Elements(1));
    group.sample_size(10);
    group.warm_up_time(Duration::from_secs(1));
    group.measurement_time(Duration::from_secs(3));
    for callers in CALLERS {
        let op = reserve_op(Arc::clone(&store), scope.clone());
        group.bench_function(BenchmarkId::new("redis", callers), |b| {
            b.to_async(&rt)
                .iter_custom(|iters| spread(iters, callers, op.clone()))
        });
    }
    group.finish();

    let mut group = c.benchmark_group("engine_run");
    group.throughput(Throughput::Elements(1));
    group.sample_size(10);
    group.warm_up_time(Duration::from_secs(1));
    group.measurement_time(Duration::from_secs(3));
    for callers in CALLERS {
        let op = run_op(Engine::from_arc(Arc::clone(&store)), scope.clone());
        group.bench_function(BenchmarkId::new("redis", callers), |b| {
            b.to_async(&rt)
                .iter_custom(|iters| spread(iters, callers, op.clone()))
        });
        if let Some(tiered) = &tiered {
            let op = run_op(Engine::from_arc(Arc::clone(tiered)), scope.clone());
            group.bench_function(BenchmarkId::new("tiered_redis_postgres", callers), |b| {
                b.to_async(&rt)
                    .iter_custom(|iters| spread(iters, callers, op.clone()))
            });
        }
    }
    group.finish();

    match rt.block_on(delete_prefix(&store)) {
        Ok(n) => eprintln!("deleted {n} benchmark keys under {}:*", store.prefix()),
        Err(err) => eprintln!(
            "deleting benchmark keys under {}:* failed: {err}",
            store.prefix()
        ),
    }
}

criterion_group!(reserve, benches);
criterion_main!(reserve);
