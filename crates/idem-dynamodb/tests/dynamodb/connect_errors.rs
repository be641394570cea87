//! Each wrong URL, endpoint or table gives one defined error and a clear
//! line.

use std::time::Duration;

use idem_dynamodb::aws_sdk_dynamodb::types::{
    AttributeDefinition, BillingMode, KeySchemaElement, KeyType, ScalarAttributeType,
};
use idem_dynamodb::{DynamoError, DynamoOptions, DynamoStore};
use idem_testkit::isolated::DynamoTable;

use crate::common;

#[tokio::test]
async fn a_bad_url_is_refused_before_any_request() {
    for url in [
        "dynamo://t?region=us-east-1",
        "dynamodb://?region=us-east-1",
        "dynamodb://idem?region=us-east-1&max_skew_ms=none",
        "dynamodb://idem?region=us-east-1&endpoint=127.0.0.1:8000",
        "dynamodb://idem?region=us-east-1&colour=blue",
    ] {
        match DynamoStore::connect(url).await {
            Err(DynamoError::Url { .. }) => {}
            other => panic!("{url}: expected Url, got {other:?}"),
        }
    }
}

#[tokio::test]
async fn an_unreachable_endpoint_is_a_connect_error() {
    // Port 1 on loopback is never one of ours.
    let err = DynamoStore::connect_with(
        DynamoOptions::new("idem")
            .with_region("us-east-1")
            .with_endpoint("http://127.0.0.1:1")
            .with_connect_timeout(Duration::from_secs(2)),
    )
    .await
    .expect_err("nothing listens there");
    assert!(matches!(err, DynamoError::Connect { .. }), "{err:?}");
    assert!(err.is_transient(), "it may come up");
    let line = err.to_string();
    assert!(line.contains("http://127.0.0.1:1"), "{line}");
    assert!(line.contains("no connection"), "{line}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_table_without_migrate_says_how_to_create_it() {
    let Some(table) = DynamoTable::new("absent") else {
        return;
    };
    let opts = DynamoOptions::from_url(&table.url())
        .expect("valid")
        .with_migrate(false);
    let err = DynamoStore::connect_with(opts)
        .await
        .expect_err("no such table");
    assert!(matches!(err, DynamoError::NotMigrated { .. }), "{err:?}");
    assert!(err.to_string().contains("idem migrate"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_table_with_another_key_is_not_taken_over() {
    let Some(table) = DynamoTable::new("foreign") else {
        return;
    };
    let Some(shared) = common::shared_store().await else {
        return;
    };
    shared
        .client()
        .create_table()
        .table_name(table.name())
        .billing_mode(BillingMode::PayPerRequest)
        .attribute_definitions(
            AttributeDefinition::builder()
                .attribute_name("id")
                .attribute_type(ScalarAttributeType::S)
                .build()
                .expect("definition"),
        )
        .key_schema(
            KeySchemaElement::builder()
                .attribute_name("id")
                .key_type(KeyType::Hash)
                .build()
                .expect("key"),
        )
        .send()
        .await
        .expect("a table of someone else's");
    let err = DynamoStore::connect(&table.url())
        .await
        .expect_err("not an idem table");
    assert!(matches!(err, DynamoError::ForeignTable { .. }), "{err:?}");
    assert!(err.to_string().contains("\"pk\""), "{err}");
}
