//! Shared test helpers: the server from the environment, stores on the
//! shared test table or on a table of their own.

#![allow(dead_code, unreachable_pub)]

use std::sync::Arc;

use idem_dynamodb::{DynamoOptions, DynamoStore};
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

/// A store whose table is its own, deleted when this is dropped (when
/// the test fails too).
pub struct Isolated {
    pub store: DynamoStore,
    pub opts: DynamoOptions,
    /// Dropped last: the table goes after the store.
    pub guard: DynamoTable,
}

impl Isolated {
    pub async fn new(label: &str) -> Option<Self> {
        let guard = DynamoTable::new(label)?;
        let opts = DynamoOptions::from_url(&guard.url()).expect("valid URL");
        let store = DynamoStore::connect_with(opts.clone())
            .await
            .expect("connect");
        Some(Self { store, opts, guard })
    }
}
