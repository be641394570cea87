//! Shared test helpers: the server from the environment, stores in the
//! shared test database or in a database of their own.

#![allow(dead_code, unreachable_pub)]

use std::sync::Arc;

use idem_mysql::{MySqlOptions, MySqlStore};
use idem_testkit::isolated::MysqlDatabase;

/// Options for the test server with a small pool, or `None` (skip).
pub fn options() -> Option<MySqlOptions> {
    let url = idem_testkit::services::mysql()?;
    Some(
        MySqlOptions::from_url(&url)
            .expect("IDEM_TEST_MYSQL_URL is a valid URL")
            .with_max_connections(8),
    )
}

/// A store on the shared test database (tests there use unique tenants).
pub async fn shared_store() -> Option<Arc<MySqlStore>> {
    let opts = options()?;
    Some(Arc::new(
        MySqlStore::connect_with(opts).await.expect("connect"),
    ))
}

/// A store whose tables live in a fresh database of its own, dropped
/// with everything in it when this is dropped (when the test fails too).
pub struct Isolated {
    pub store: MySqlStore,
    pub opts: MySqlOptions,
    /// Dropped last: the database goes after the store's connections.
    pub guard: MysqlDatabase,
}

impl Isolated {
    pub async fn new(label: &str) -> Option<Self> {
        let guard = MysqlDatabase::new(label)?;
        let opts = MySqlOptions::from_url(&guard.url())
            .expect("valid URL")
            .with_max_connections(8);
        let store = MySqlStore::connect_with(opts.clone())
            .await
            .expect("connect");
        Some(Self { store, opts, guard })
    }
}
