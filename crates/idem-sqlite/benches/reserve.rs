//! Reservations per second, by store and number of concurrent callers.
//!
//! * `reserve/*`: one atomic reservation of a fresh key (a durable write);
//! * `engine_run/*`: the whole cycle through the engine — reserve, run
//!   trivial work, record the answer (two durable writes).
//!
//! Stores: `memory` (no durability; the ceiling), `sqlite_group_commit`
//! (the default: durable, `synchronous=FULL`, batched commits) and the
//! baseline `sqlite_one_row_per_commit` (the same store with `max_batch=1`:
//! one fsync per operation). Databases live under Cargo's target tmp dir, on
//! the same disk as the build, never on tmpfs.
//!
//! Run: `cargo bench -p idem-sqlite --bench reserve`. Criterion reports
//! time per operation and `thrpt` in operations/s (elements/s).

#![allow(missing_docs)]

use std::sync::Arc;
use std::time::Duration;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use idem::{Engine, MemoryStore, Scope};
use idem_sqlite::{SqliteOptions, SqliteStore};
use idem_testkit::bench::{CALLERS, reserve_op, run_op, spread};

fn sqlite(name: &str, max_batch: usize) -> SqliteStore {
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("idem-bench");
    std::fs::create_dir_all(&dir).expect("bench dir");
    let path = dir.join(format!("{name}-{}.db", std::process::id()));
    for suffix in ["", "-wal", "-shm"] {
        let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
    }
    let opts = SqliteOptions::new(path).with_max_batch(max_batch);
    SqliteStore::open_with(opts).expect("open bench store")
}

fn benches(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let scope = Scope::new("bench-tenant", "POST /v1/payments").expect("scope");
    let memory = Arc::new(MemoryStore::new());
    let group_commit = Arc::new(sqlite("group", 512));
    let one_per_commit = Arc::new(sqlite("single", 1));

    let mut group = c.benchmark_group("reserve");
    group.throughput(Throughput::Elements(1));
    group.sample_size(10);
    group.warm_up_time(Duration::from_secs(1));
    group.measurement_time(Duration::from_secs(3));
    for callers in CALLERS {
        let id = |name| BenchmarkId::new(name, callers);
        let op = reserve_op(Arc::clone(&memory), scope.clone());
        group.bench_function(id("memory"), |b| {
            b.to_async(&rt)
                .iter_custom(|iters| spread(iters, callers, op.clone()))
        });
        let op = reserve_op(Arc::clone(&group_commit), scope.clone());
        group.bench_function(id("sqlite_group_commit"), |b| {
            b.to_async(&rt)
                .iter_custom(|iters| spread(iters, callers, op.clone()))
        });
        let op = reserve_op(Arc::clone(&one_per_commit), scope.clone());
        group.bench_function(id("sqlite_one_row_per_commit"), |b| {
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
        let id = |name| BenchmarkId::new(name, callers);
        let op = run_op(Engine::from_arc(Arc::clone(&memory)), scope.clone());
        group.bench_function(id("memory"), |b| {
            b.to_async(&rt)
                .iter_custom(|iters| spread(iters, callers, op.clone()))
        });
        let op = run_op(Engine::from_arc(Arc::clone(&group_commit)), scope.clone());
        group.bench_function(id("sqlite_group_commit"), |b| {
            b.to_async(&rt)
                .iter_custom(|iters| spread(iters, callers, op.clone()))
        });
    }
    group.finish();

    let stats = group_commit.commit_stats();
    eprintln!(
        "sqlite group commit: {} operations in {} commits (mean batch {:.1})",
        stats.operations,
        stats.commits,
        stats.operations as f64 / stats.commits.max(1) as f64
    );
}

criterion_group!(reserve, benches);
criterion_main!(reserve);
