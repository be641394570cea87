//! Listings are planned for the table as it is: the stuck-record monitor
//! lists processing records every 30 s, and must read only those.

use crate::common;

use std::time::Duration;

use idem::{ListFilter, ListRecords, RecordState};
use idem_postgres::PgStore;

/// PostgreSQL keeps a prepared statement's generic plan from its sixth
/// run, and with autovacuum off nothing plans it again. A listing of
/// processing records with the state as a bind got a generic plan made
/// for the empty table: the creation-order index, every record fetched
/// and filtered (405 ms at 1M records, `EXPLAIN ANALYZE` with
/// `plan_cache_mode = force_generic_plan`). Here: listings while the table
/// is small, then 100,000 final records, then one listing; the table's own
/// counters, read after the store's connection closed, say it fetched only
/// the processing records.
#[tokio::test]
async fn listing_processing_records_reads_only_them_however_the_table_has_grown() {
    let Some(isolated) = common::Isolated::new("listplans").await else {
        return;
    };
    // One connection, so one prepared statement sees every run.
    let store = PgStore::connect_with(isolated.opts.clone().with_max_connections(1))
        .await
        .expect("connect");
    let table = format!("\"{}\".idem_records", isolated.schema);
    let admin = isolated.store.pool().clone();
    let insert = |state: &'static str, from: i64, to: i64| {
        format!(
            "INSERT INTO {table} (tenant, operation, key, fingerprint, state, created_at, \
             updated_at, expires_at, locked_until, owner, attempt) \
             SELECT 't', 'POST /p', '{state}-' || n, decode(repeat('ab', 32), 'hex'), \
             '{state}', now(), now(), now() + interval '1 hour', now(), \
             decode(repeat('cd', 16), 'hex'), 1 FROM generate_series({from}, {to}) AS n"
        )
    };
    sqlx::query(&insert("processing", 1, 3))
        .execute(&admin)
        .await
        .expect("processing records");
    let processing = ListFilter {
        state: Some(RecordState::Processing),
        limit: 1000,
        ..ListFilter::default()
    };
    for _ in 0..12 {
        let page = store.list(&processing).await.expect("list");
        assert_eq!(page.records.len(), 3);
    }
    const GROWN: i64 = 100_000;
    sqlx::query(&insert("completed", 1, GROWN))
        .execute(&admin)
        .await
        .expect("grow the table");
    common::analyze_if_autovacuum(&admin, &table).await;
    let counters = format!(
        "SELECT coalesce(seq_tup_read, 0) + coalesce(idx_tup_fetch, 0), \
         coalesce(seq_scan, 0) + coalesce(idx_scan, 0) FROM pg_stat_user_tables \
         WHERE relid = '{table}'::regclass"
    );
    let read = || async {
        sqlx::query_as::<_, (i64, i64)>(&counters)
            .fetch_one(&admin)
            .await
            .expect("table counters")
    };
    // The listings so far have reached the counters once the scans counted
    // stop growing (a backend reports at most once a second).
    let mut before = read().await;
    for _ in 0..30 {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let now = read().await;
        if now == before && now.1 >= 12 {
            break;
        }
        before = now;
    }
    let page = store.list(&processing).await.expect("list after growth");
    assert_eq!(page.records.len(), 3);
    // A backend reports its counters when it ends.
    store.close().await;
    let mut after = before;
    for _ in 0..100 {
        after = read().await;
        if after.1 > before.1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        after.1 > before.1,
        "the last listing was never counted: {before:?} {after:?}"
    );
    let fetched = after.0 - before.0;
    assert!(
        fetched < GROWN,
        "listing 3 processing records beside {GROWN} final ones read {fetched} rows"
    );
    isolated.drop_schema().await;
}
