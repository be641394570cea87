//! Group commit: concurrent reservations and resolutions share statements,
//! and every caller still gets exactly its own answer.

use crate::common;

use std::sync::Arc;
use std::time::Duration;

use idem::{
    FinalOutcome, Fingerprint, IdempotencyKey, LeaseExpiry, OwnerToken, Reservation,
    ReserveRequest, Scope, Store, StoreError, StoredResponse, Verdict,
};
use idem_postgres::{GroupCommitStats, PgOptions, PgStore};
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

/// Keys per [`round`].
const KEYS: usize = 32;

/// Reserves [`KEYS`] fresh keys from `first` on, then resolves each, all at
/// once: mostly in batches.
async fn round(store: &Arc<PgStore>, scope: &Scope, first: usize) {
    let mut tasks = JoinSet::new();
    for n in first..first + KEYS {
        let (store, scope) = (Arc::clone(store), scope.clone());
        tasks.spawn(async move {
            let k = key(n);
            let Reservation::Acquired(lease) =
                store.reserve(request(&scope, &k)).await.expect("reserve")
            else {
                panic!("key {n} was fresh");
            };
            store
                .resolve(&scope, &k, &lease, &outcome(format!("answer {n}")))
                .await
                .expect("resolve");
        });
    }
    while let Some(joined) = tasks.join_next().await {
        joined.expect("task");
    }
}

/// Adds `rows` completed records to `table`, beside the store's own.
async fn grow(admin: &sqlx::PgPool, table: &str, rows: i64) {
    grow_tenant(admin, table, "grown", rows).await;
}

/// Adds `rows` completed records of `tenant` to `table`.
async fn grow_tenant(admin: &sqlx::PgPool, table: &str, tenant: &str, rows: i64) {
    sqlx::query(&format!(
        "INSERT INTO {table} (tenant, operation, key, fingerprint, state, created_at, \
         updated_at, expires_at, locked_until, owner, attempt) \
         SELECT $1, 'POST /grown', 'g-' || n, decode(repeat('ab', 32), 'hex'), \
         'completed', now(), now(), now() + interval '1 hour', now(), \
         decode(repeat('cd', 16), 'hex'), 1 FROM generate_series(1, {rows}) AS n"
    ))
    .bind(tenant)
    .execute(admin)
    .await
    .expect("grow the table");
}

/// The table's `(n_tup_upd, seq_scan, seq_tup_read)` once at least
/// `updated` updates are counted (a backend reports its counters when it
/// ends), or as they stand after 10 s.
async fn table_counters(admin: &sqlx::PgPool, table: &str, updated: i64) -> (i64, i64, i64) {
    let stats = format!(
        "SELECT n_tup_upd, seq_scan, seq_tup_read FROM pg_stat_user_tables \
         WHERE relid = '{table}'::regclass"
    );
    let mut counted = (0, 0, 0);
    for _ in 0..100 {
        counted = sqlx::query_as::<_, (i64, i64, i64)>(&stats)
            .fetch_one(admin)
            .await
            .expect("table counters");
        if counted.0 >= updated {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    counted
}

/// What a plan test starts from: the server's URL, a schema of its own,
/// an admin pool of one connection (so that its own counters can be
/// flushed on demand) and the schema's records table, quoted. `None`: no
/// server (the test skips).
async fn plan_test(label: &str) -> Option<(String, common::Isolated, sqlx::PgPool, String)> {
    let url = services::postgres()?;
    let isolated = common::Isolated::new(label).await?;
    let admin = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect(&url)
        .await
        .expect("admin connection");
    let table = format!("\"{}\".idem_records", isolated.schema);
    Some((url, isolated, admin, table))
}

/// Batches on a small table: planned at each run where autovacuum is off,
/// on kept plans where it runs.
fn assert_small_table_batches(stats: GroupCommitStats, autovacuum: bool) {
    assert!(stats.statements > 0, "the rounds formed batches: {stats:?}");
    if autovacuum {
        assert_eq!(stats.planned, 0, "autovacuum runs: plans kept: {stats:?}");
    } else {
        assert_eq!(
            stats.planned, stats.statements,
            "a small table, no autovacuum: every batch planned: {stats:?}"
        );
    }
}

/// Group commit's statements are planned for the table as it is, not as it
/// was. PostgreSQL keeps a prepared statement's generic plan, and the
/// resolutions' plan made while the table is empty is a hash join over a
/// sequential scan of the whole table. With autovacuum off (as some CI
/// servers run) nothing plans it again: at 30,000 records each batch reads
/// all of them, and the gateway at 64 connections falls from about 5,000 to
/// 700–900 req/s (docs/BENCHMARKS.md#current-figures). Here: batches while the
/// table is empty, then 100,000 records, then batches again; the table's
/// own counters, read after the store's connections closed, say no
/// statement read the grown table sequentially. They also count the early
/// batches' scans of the small table (a few hundred rows each, some 11,000
/// rows in all), so the bound is one scan of the grown table.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn grouped_statements_use_the_key_index_however_the_table_has_grown() {
    let Some(url) = services::postgres() else {
        return;
    };
    let Some(isolated) = common::Isolated::new("plans").await else {
        return;
    };
    let (store, table) = (
        Arc::new(isolated.store),
        format!("\"{}\".idem_records", isolated.schema),
    );
    let scope = idem_testkit::conformance::unique_scope("pg-plans");
    // Enough executions on each connection for PostgreSQL to settle on a
    // generic plan (after five).
    const BEFORE: usize = 24;
    for r in 0..BEFORE {
        round(&store, &scope, r * KEYS).await;
    }
    assert!(
        store.group_commit_stats().statements > 0,
        "the rounds formed batches: {:?}",
        store.group_commit_stats()
    );
    let admin = sqlx::PgPool::connect(&url).await.expect("admin connection");
    const GROWN: i64 = 100_000;
    grow(&admin, &table, GROWN).await;
    // The store keeps its plans on a server running autovacuum, and
    // PostgreSQL plans them again after the ANALYZE.
    common::analyze_if_autovacuum(&admin, &table).await;
    const AFTER: usize = 4;
    for r in 0..AFTER {
        round(&store, &scope, (BEFORE + r) * KEYS).await;
    }
    // A backend reports its counters when it ends: close them all, then
    // wait until every resolution is counted.
    store.close().await;
    let counted = table_counters(&admin, &table, ((BEFORE + AFTER) * KEYS) as i64).await;
    let (updated, seq_scans, seq_rows) = counted;
    eprintln!(
        "after growing the table: {updated} rows updated, {seq_scans} sequential scans read {seq_rows} rows"
    );
    assert!(
        updated >= ((BEFORE + AFTER) * KEYS) as i64,
        "the counters never showed the {} resolutions: {counted:?}",
        (BEFORE + AFTER) * KEYS
    );
    assert!(
        seq_rows < GROWN,
        "statements read the grown table sequentially: {seq_scans} scans, {seq_rows} rows"
    );
    // `isolated`'s schema goes when it is dropped, here.
}

/// Where autovacuum is off, grouped statements are planned each time they
/// run while the records table is small, and keep their plans once it has
/// grown (some 500 pages here): planning each batch costs a quarter of the
/// rate at 64 connections (docs/BENCHMARKS.md#current-figures). The
/// kept plans, made on the grown table, still look every key up in the
/// primary key. Where autovacuum runs, plans are kept from the start.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn grouped_statements_keep_their_plans_once_the_table_has_grown() {
    let Some((_, isolated, admin, table)) = plan_test("kept").await else {
        return;
    };
    let autovacuum = common::autovacuum(&admin).await;
    let scope = idem_testkit::conformance::unique_scope("pg-kept");
    const ROUNDS: usize = 8;

    let small = Arc::new(
        PgStore::connect_with(isolated.opts.clone())
            .await
            .expect("connect"),
    );
    for r in 0..ROUNDS {
        round(&small, &scope, r * KEYS).await;
    }
    assert_small_table_batches(small.group_commit_stats(), autovacuum);
    small.close().await;

    const GROWN: i64 = 20_000;
    grow(&admin, &table, GROWN).await;
    let (_, _, read_before) = table_counters(&admin, &table, (ROUNDS * KEYS) as i64).await;
    let grown = Arc::new(
        PgStore::connect_with(isolated.opts.clone())
            .await
            .expect("connect"),
    );
    // Enough executions on each connection for PostgreSQL to settle on a
    // generic plan (after five).
    const AFTER: usize = 16;
    for r in ROUNDS..ROUNDS + AFTER {
        round(&grown, &scope, r * KEYS).await;
    }
    let stats = grown.group_commit_stats();
    assert!(stats.statements > 0, "the rounds formed batches: {stats:?}");
    assert_eq!(stats.planned, 0, "a grown table: plans kept: {stats:?}");
    grown.close().await;
    let (updated, seq_scans, read_after) =
        table_counters(&admin, &table, ((ROUNDS + AFTER) * KEYS) as i64).await;
    eprintln!("after the grown rounds: {updated} rows updated, {seq_scans} sequential scans");
    assert!(
        read_after - read_before < GROWN,
        "kept plans read the grown table sequentially: {} rows",
        read_after - read_before
    );
    isolated.drop_schema().await;
}

/// A table emptied while the store runs (a `TRUNCATE`) and grown again:
/// where autovacuum is off, the store finds it small at its next look at
/// the size (within a second) and plans its grouped statements at each run
/// again, so no plan is kept that was made on the emptied table; once the
/// table has grown back, plans are kept again, and they look every key up
/// in the primary key. Without the first half, a generic plan made on the
/// empty table would read all of the grown one for every batch. Where
/// autovacuum runs, plans are kept throughout, and its `ANALYZE` (stood in
/// for here) plans them again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn grouped_plans_are_made_anew_after_the_table_is_emptied_and_grows_back() {
    let Some((_, isolated, admin, table)) = plan_test("emptied").await else {
        return;
    };
    let autovacuum = common::autovacuum(&admin).await;
    let scope = idem_testkit::conformance::unique_scope("pg-emptied");
    const GROWN: i64 = 20_000;
    // A look at the size is due once a second; wait a little longer.
    let next_look = || tokio::time::sleep(Duration::from_millis(1_200));

    grow(&admin, &table, GROWN).await;
    let store = Arc::new(
        PgStore::connect_with(isolated.opts.clone())
            .await
            .expect("connect"),
    );
    let mut first = 0;
    for _ in 0..8 {
        round(&store, &scope, first).await;
        first += KEYS;
    }
    let grown = store.group_commit_stats();
    assert!(grown.statements > 0, "the rounds formed batches: {grown:?}");
    assert_eq!(grown.planned, 0, "a grown table: plans kept: {grown:?}");

    sqlx::query(&format!("TRUNCATE {table}"))
        .execute(&admin)
        .await
        .expect("truncate");
    next_look().await;
    // The first round's first batch looks at the size; each batch after
    // it runs planned.
    round(&store, &scope, first).await;
    first += KEYS;
    let looked = store.group_commit_stats();
    for _ in 0..4 {
        round(&store, &scope, first).await;
        first += KEYS;
    }
    let emptied = store.group_commit_stats();
    assert!(emptied.statements > looked.statements, "{emptied:?}");
    let (ran, planned) = (
        emptied.statements - looked.statements,
        emptied.planned - looked.planned,
    );
    if autovacuum {
        assert_eq!(planned, 0, "autovacuum runs: plans kept: {emptied:?}");
    } else {
        assert_eq!(
            planned, ran,
            "an emptied table, no autovacuum: every batch planned: {emptied:?}"
        );
    }

    grow(&admin, &table, GROWN).await;
    common::analyze_if_autovacuum(&admin, &table).await;
    next_look().await;
    // Enough executions on each connection for PostgreSQL to settle on a
    // generic plan (after five).
    round(&store, &scope, first).await;
    first += KEYS;
    let regrown = store.group_commit_stats();
    for _ in 0..16 {
        round(&store, &scope, first).await;
        first += KEYS;
    }
    let kept = store.group_commit_stats();
    assert!(kept.statements > regrown.statements, "{kept:?}");
    assert_eq!(
        kept.planned, regrown.planned,
        "grown back: plans kept again: {kept:?}"
    );
    store.close().await;
    // Every round's resolutions count, the truncated ones too: the
    // counters are complete once all `first` show.
    let resolved = first as i64;
    let counted = table_counters(&admin, &table, resolved).await;
    let (updated, seq_scans, seq_rows) = counted;
    eprintln!(
        "over the test: {updated} rows updated, {seq_scans} sequential scans read {seq_rows} rows"
    );
    assert!(
        updated >= resolved,
        "the counters never showed the {resolved} resolutions: {counted:?}"
    );
    assert!(
        seq_rows < GROWN,
        "statements read a grown table sequentially: {seq_scans} scans, {seq_rows} rows"
    );
    isolated.drop_schema().await;
}

/// Single-key statements are prepared from a store's first operation on. On
/// an empty table PostgreSQL's generic plans for them find a key through
/// `idem_records_tenant_created` (tenant, created_at, operation, key): a
/// walk over every record of the tenant. With autovacuum off nothing plans
/// them again, and each lone resolution takes 45–80 ms at 300,000 records
/// of one tenant (docs/BENCHMARKS.md#current-figures). Here: a store without
/// group commit (every operation a single statement) runs on the empty
/// table, the table grows by 200,000 records of the same tenant, and after
/// the store's next look at the size no operation walks them. (The index
/// blocks counted include the early rounds' own, reported when the store
/// closes: some hundreds.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn single_key_statements_find_keys_by_the_primary_key_once_the_table_has_grown() {
    let Some((_, isolated, admin, table)) = plan_test("single").await else {
        return;
    };
    let index = format!("\"{}\".idem_records_tenant_created", isolated.schema);
    let scope = idem_testkit::conformance::unique_scope("pg-single");
    let store = Arc::new(
        PgStore::connect_with(isolated.opts.clone().with_group_commit(false))
            .await
            .expect("connect"),
    );
    // Rounds of KEYS at once, each operation a single statement: every
    // connection of the pool runs each statement more than the five times
    // after which PostgreSQL settles on a generic plan.
    const EARLY: usize = 6;
    for r in 0..EARLY {
        round(&store, &scope, r * KEYS).await;
    }
    const GROWN: i64 = 200_000;
    grow_tenant(&admin, &table, scope.tenant(), GROWN).await;
    common::analyze_if_autovacuum(&admin, &table).await;
    // Index blocks touched so far (the growth's own, flushed now), and the
    // index's size: one walk over the tenant's entries touches about all
    // of it.
    sqlx::query("SELECT pg_stat_force_next_flush()")
        .execute(&admin)
        .await
        .expect("flush");
    let blocks = format!(
        "SELECT idx_blks_read + idx_blks_hit, pg_relation_size(indexrelid) / 8192 \
         FROM pg_statio_user_indexes WHERE indexrelid = '{index}'::regclass"
    );
    let (before, size): (i64, i64) = sqlx::query_as(&blocks)
        .fetch_one(&admin)
        .await
        .expect("index counters");
    // The next look at the size is due a second after the last; one
    // operation alone takes it (operations already under way when the
    // table is analyzed finish on the plans they had).
    tokio::time::sleep(Duration::from_millis(1_200)).await;
    let k = key(usize::MAX);
    let Reservation::Acquired(lease) = store.reserve(request(&scope, &k)).await.expect("reserve")
    else {
        panic!("a fresh key");
    };
    store
        .resolve(&scope, &k, &lease, &outcome("alone".into()))
        .await
        .expect("resolve");
    round(&store, &scope, EARLY * KEYS).await;
    // A backend reports its counters when it ends.
    store.close().await;
    let resolved = ((EARLY + 1) * KEYS + 1) as i64;
    let (updated, _, _) = table_counters(&admin, &table, resolved).await;
    assert!(
        updated >= resolved,
        "the counters never showed the {resolved} resolutions: {updated}"
    );
    let (after, _): (i64, i64) = sqlx::query_as(&blocks)
        .fetch_one(&admin)
        .await
        .expect("index counters");
    eprintln!(
        "idem_records_tenant_created ({size} pages): {} blocks touched by {} keys after the growth",
        after - before,
        KEYS + 1
    );
    assert!(
        after - before < size,
        "single-key statements walked the tenant's records: {} index blocks for {} keys, the index has {size}",
        after - before,
        KEYS + 1
    );
    isolated.drop_schema().await;
}

/// A store made from the caller's own pool cannot ask the server anything
/// when it is made, so it asks at its first operation whether autovacuum
/// runs, and then plans as a connected store does: where autovacuum is
/// off, batches on a small table run planned (and the table is analyzed
/// when it grows), not on plans made on the empty table.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_store_from_a_pool_asks_whether_autovacuum_runs() {
    let Some((url, isolated, admin, _)) = plan_test("pool").await else {
        return;
    };
    let autovacuum = common::autovacuum(&admin).await;
    let connect = url
        .parse::<sqlx::postgres::PgConnectOptions>()
        .expect("url")
        .options([("search_path", isolated.schema.as_str())]);
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(8)
        .connect_with(connect)
        .await
        .expect("pool");
    let store = Arc::new(PgStore::from_pool(pool));
    let scope = idem_testkit::conformance::unique_scope("pg-pool");
    for r in 0..4 {
        round(&store, &scope, r * KEYS).await;
    }
    assert_small_table_batches(store.group_commit_stats(), autovacuum);
    store.close().await;
    isolated.drop_schema().await;
}

/// `with_group_commit_in_flight(3)`: three reservations run at once, each
/// alone on a connection of its own (here each waits on a row another
/// transaction holds uncommitted); with those three slots busy, the next
/// reservation queues, and runs as a grouped statement once slots free.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn group_commit_in_flight_is_how_many_statements_of_a_kind_run_at_once() {
    let Some(opts) = common::options() else {
        return;
    };
    let store = Arc::new(
        PgStore::connect_with(opts.with_group_commit_in_flight(3))
            .await
            .expect("connect"),
    );
    let scope = idem_testkit::conformance::unique_scope("pg-in-flight");
    // Keys reserved in transactions left open: a reservation of one waits
    // until its transaction ends.
    let mut holders = Vec::new();
    for n in 0..3 {
        let mut tx = store.pool().begin().await.expect("begin");
        let held = store
            .reserve_in(&mut tx, request(&scope, &key(n)))
            .await
            .expect("reserve_in");
        assert!(matches!(held, Reservation::Acquired(_)), "{held:?}");
        holders.push(tx);
    }
    let mut blocked = JoinSet::new();
    for n in 0..3 {
        let (store, scope) = (Arc::clone(&store), scope.clone());
        blocked.spawn(async move { store.reserve(request(&scope, &key(n))).await });
    }
    idem_testkit::wait::eventually("three reservations running alone at once", async || {
        store.group_commit_stats().alone == 3
    })
    .await;
    let fourth_key = key(3);
    let mut fourth = Box::pin(store.reserve(request(&scope, &fourth_key)));
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    assert!(
        fourth.as_mut().poll(&mut cx).is_pending(),
        "every slot is busy: the fourth queues"
    );
    for tx in holders {
        tx.commit().await.expect("commit");
    }
    while let Some(joined) = blocked.join_next().await {
        let reserved = joined.expect("task").expect("reserve");
        assert!(
            matches!(reserved, Reservation::InProgress { .. }),
            "{reserved:?}"
        );
    }
    let reserved = fourth.await.expect("reserve");
    assert!(matches!(reserved, Reservation::Acquired(_)), "{reserved:?}");
    let stats = store.group_commit_stats();
    assert_eq!(
        (stats.alone, stats.statements, stats.operations),
        (3, 1, 1),
        "{stats:?}"
    );
}
