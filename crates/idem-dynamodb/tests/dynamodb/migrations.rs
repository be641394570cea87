//! `migrate` creates the table with its index and turns TTL on, once:
//! again, and from several handles at once, it changes nothing.

use idem::Store;
use idem::store::Migrated;
use idem_dynamodb::DynamoStore;
use idem_dynamodb::aws_sdk_dynamodb::types::{BillingMode, TimeToLiveStatus};
use idem_testkit::isolated::DynamoTable;
use tokio::task::JoinSet;

use crate::common;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn migrate_creates_the_table_with_ttl_on_and_is_idempotent() {
    let Some(shared) = common::shared_store().await else {
        return;
    };
    let Some(table) = DynamoTable::new("migrate") else {
        return;
    };
    let store = DynamoStore::from_client(shared.client().clone(), table.name());
    assert_eq!(
        store.migrate().await.expect("migrate"),
        Migrated { from: 0, to: 1 }
    );
    assert_eq!(
        store.migrate().await.expect("migrate again"),
        Migrated { from: 1, to: 1 },
        "nothing to do"
    );
    assert_eq!(DynamoStore::schema_version(), 1);
    let ttl = store
        .client()
        .describe_time_to_live()
        .table_name(table.name())
        .send()
        .await
        .expect("DescribeTimeToLive")
        .time_to_live_description
        .expect("a TTL description");
    assert_eq!(ttl.attribute_name(), Some("ttl"));
    assert!(matches!(
        ttl.time_to_live_status(),
        Some(TimeToLiveStatus::Enabled | TimeToLiveStatus::Enabling)
    ));
    let description = store
        .client()
        .describe_table()
        .table_name(table.name())
        .send()
        .await
        .expect("DescribeTable")
        .table
        .expect("the table");
    assert_eq!(
        description
            .global_secondary_indexes()
            .iter()
            .filter_map(|index| index.index_name())
            .collect::<Vec<_>>(),
        ["idem_list"]
    );
    assert_eq!(
        description
            .billing_mode_summary()
            .and_then(|b| b.billing_mode()),
        Some(&BillingMode::PayPerRequest)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_first_migrations_all_succeed() {
    let Some(table) = DynamoTable::new("migrate_race") else {
        return;
    };
    // Four processes' first start on a missing table: each connect
    // migrates, racing the others to create it.
    let mut tasks = JoinSet::new();
    for _ in 0..4 {
        let url = table.url();
        tasks.spawn(async move { DynamoStore::connect(&url).await.expect("connect") });
    }
    let mut stores = Vec::new();
    while let Some(done) = tasks.join_next().await {
        stores.push(done.expect("task"));
    }
    for store in &stores {
        assert_eq!(
            store.migrate().await.expect("migrate"),
            Migrated { from: 1, to: 1 }
        );
    }
    // And the table works.
    let scope = idem_testkit::conformance::unique_scope("migrated");
    let k = idem_testkit::conformance::key("k");
    let reserved = stores[0]
        .reserve(idem_testkit::conformance::request(
            &scope,
            &k,
            idem_testkit::conformance::fp("a"),
            std::time::Duration::from_secs(30),
            idem::LeaseExpiry::Retry,
        ))
        .await
        .expect("reserve");
    assert!(
        matches!(reserved, idem::Reservation::Acquired(_)),
        "{reserved:?}"
    );
    assert!(stores[3].get(&scope, &k).await.expect("get").is_some());
}
