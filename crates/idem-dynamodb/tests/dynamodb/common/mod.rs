//! Shared test helpers: the server from the environment, stores on the
//! shared test table or on a table of their own.

#![allow(dead_code, unreachable_pub)]

use std::sync::Arc;

use idem::{ListRecords, Purge, Store};
use idem_dynamodb::{DynamoOptions, DynamoStore};
use idem_testkit::conformance::Fixture;
use idem_testkit::isolated::DynamoTable;

/// Options for the test server, or `None` (skip).
pub fn options() -> Option<DynamoOptions> {
    let url = idem_testkit::services::dynamodb()?;
    Some(DynamoOptions::from_url(&url).expect("IDEM_TEST_DYNAMODB_URL is a valid URL"))
}

/// A store on the shared test table (tests there use unique tenants).
pub async fn shared_store() -> Option<Arc<DynamoStore>> {
    let opts = options()?;
    Some(Arc::new(
        DynamoStore::connect_with(opts).await.expect("connect"),
    ))
}

/// A store (or a store over one) on a table of its own, deleted with this:
/// a conformance fixture. A listing filtered by tenant and a purge read
/// the whole table, so on a shared table that grows run after run every
/// check would slow down; a table per check keeps each check's cost its
/// own.
pub struct OwnTable<S> {
    pub store: Arc<S>,
    /// Dropped after the store.
    pub table: DynamoTable,
}

impl<S: Store + ListRecords + Purge> Fixture for OwnTable<S> {
    type Store = S;
    fn store(&self) -> Arc<S> {
        Arc::clone(&self.store)
    }
}

/// A store on a fresh table of its own, wrapped by `wrap`.
pub async fn own_table<S>(label: &str, wrap: impl FnOnce(DynamoStore) -> S) -> Option<OwnTable<S>> {
    let table = DynamoTable::new(label)?;
    let store = DynamoStore::connect(&table.url()).await.expect("connect");
    Some(OwnTable {
        store: Arc::new(wrap(store)),
        table,
    })
}
