//! Shared test helpers: the server from the environment, stores in the
//! shared test database or in a schema of their own.

#![allow(dead_code, unreachable_pub)]

use std::sync::Arc;

use idem_postgres::{PgOptions, PgStore};
use idem_testkit::isolated::PgSchema;

/// Options for the test server with a small pool, or `None` (skip).
pub fn options() -> Option<PgOptions> {
    let url = idem_testkit::services::postgres()?;
    Some(
        PgOptions::from_url(&url)
            .expect("IDEM_TEST_PG_URL is a valid URL")
            .with_max_connections(8),
    )
}

/// A store on the shared test database (tests there use unique tenants).
pub async fn shared_store() -> Option<Arc<PgStore>> {
    let opts = options()?;
    Some(Arc::new(
        PgStore::connect_with(opts).await.expect("connect"),
    ))
}

/// A store whose tables live in a fresh schema of their own, dropped
/// with everything in it when this is dropped (when the test fails too).
pub struct Isolated {
    pub store: PgStore,
    pub schema: String,
    pub opts: PgOptions,
    /// Dropped last: the schema goes after the store's connections.
    pub guard: PgSchema,
}

impl Isolated {
    pub async fn new(label: &str) -> Option<Self> {
        let opts = options()?;
        let guard = PgSchema::new(label)?;
        let schema = guard.name().to_owned();
        let opts = opts.with_schema(schema.clone());
        let store = PgStore::connect_with(opts.clone()).await.expect("connect");
        Some(Self {
            store,
            schema,
            opts,
            guard,
        })
    }

    /// Closes the store's connections, then drops the schema.
    pub async fn drop_schema(self) {
        self.store.close().await;
    }
}

/// Whether the server runs autovacuum.
pub async fn autovacuum(admin: &sqlx::PgPool) -> bool {
    sqlx::query_scalar("SELECT current_setting('autovacuum')::boolean")
        .fetch_one(admin)
        .await
        .expect("autovacuum setting")
}

/// Does what autovacuum would do soon after a table grew (`ANALYZE`), when
/// the server runs autovacuum; where it does not, the table keeps the
/// statistics it had, as it would in production there.
pub async fn analyze_if_autovacuum(admin: &sqlx::PgPool, table: &str) {
    if autovacuum(admin).await {
        eprintln!("autovacuum is on: ANALYZE stands in for it");
        sqlx::query(&format!("ANALYZE {table}"))
            .execute(admin)
            .await
            .expect("analyze");
    }
}
