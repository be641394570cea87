//! Migrations run once however often they are asked for, from several
//! processes at once, after a run cut off half-way, and refuse a schema
//! newer than this build.

use crate::common;

use idem::store::Migrated;
use idem_mysql::{MySqlError, MySqlStore};

#[tokio::test]
async fn migrating_again_does_nothing_and_a_cut_off_run_completes() {
    let Some(t) = common::Isolated::new("migrate").await else {
        return;
    };
    let version = MySqlStore::schema_version();
    assert_eq!(
        t.store.migrate().await.expect("migrate again"),
        Migrated {
            from: version,
            to: version
        }
    );
    // A run that created the tables but recorded no version (cut off
    // before its last statement) runs every migration again, cleanly.
    sqlx::query("DELETE FROM idem_schema_migrations")
        .execute(t.store.pool())
        .await
        .expect("forget the versions");
    assert_eq!(
        t.store
            .migrate()
            .await
            .expect("migrate over existing tables"),
        Migrated {
            from: 0,
            to: version
        }
    );
    let versions: Vec<i32> =
        sqlx::query_scalar("SELECT version FROM idem_schema_migrations ORDER BY version")
            .fetch_all(t.store.pool())
            .await
            .expect("versions");
    assert_eq!(versions, (1..=version as i32).collect::<Vec<_>>());
}

#[tokio::test]
async fn concurrent_migrators_take_turns() {
    let Some(db) = idem_testkit::isolated::MysqlDatabase::new("migrate_many") else {
        return;
    };
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..4 {
        let url = db.url();
        tasks.spawn(async move {
            let store = MySqlStore::connect(&format!("{url}?max_connections=2"))
                .await
                .expect("connect and migrate");
            store.close().await;
        });
    }
    while let Some(done) = tasks.join_next().await {
        done.expect("a migrator panicked");
    }
    let store = MySqlStore::connect(&db.url()).await.expect("connect");
    let rows: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM idem_schema_migrations")
        .fetch_one(store.pool())
        .await
        .expect("count");
    assert_eq!(rows, MySqlStore::schema_version(), "each version once");
    store.close().await;
}

#[tokio::test]
async fn a_newer_schema_is_refused() {
    let Some(t) = common::Isolated::new("migrate_newer").await else {
        return;
    };
    sqlx::query(
        "INSERT INTO idem_schema_migrations (version, description, applied_at) \
         VALUES (999, 'from the future', UTC_TIMESTAMP(6))",
    )
    .execute(t.store.pool())
    .await
    .expect("a newer version");
    match t.store.migrate().await {
        Err(MySqlError::SchemaTooNew { found: 999, .. }) => {}
        other => panic!("expected SchemaTooNew, got {other:?}"),
    }
}
