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
use std::time::Duration;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use idem::{Engine, Scope};
use idem_postgres::{PgOptions, PgStore};
use idem_testkit::bench::{CALLERS, reserve_op, run_op, spread};

const SCHEMA: &str = "idem_bench";

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
        let no_ping = opts.with_test_before_acquire(false);
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
