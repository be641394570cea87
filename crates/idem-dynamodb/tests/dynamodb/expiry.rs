//! Expiry by the table's TTL: final records carry the TTL attribute, a
//! record past its expiry reads as absent while its item is still there
//! (DynamoDB deletes late), and processing records never carry one.

use std::time::Duration;

use idem::{FinalOutcome, LeaseExpiry, Reservation, Store, StoredResponse, Timestamp, Verdict};
use idem_dynamodb::aws_sdk_dynamodb::types::AttributeValue;
use idem_testkit::conformance::{fp, key, request, unique_scope};

use crate::common;

/// The raw item of a record, as DynamoDB holds it: the partition key is
/// tenant, operation and key, each separated by U+0001.
async fn raw_item(
    store: &idem_dynamodb::DynamoStore,
    scope: &idem::Scope,
    k: &idem::IdempotencyKey,
) -> Option<std::collections::HashMap<String, AttributeValue>> {
    let pk = format!(
        "{}\u{1}{}\u{1}{}",
        scope.tenant(),
        scope.operation(),
        k.as_str()
    );
    store
        .client()
        .get_item()
        .table_name(store.table())
        .key("pk", AttributeValue::S(pk))
        .consistent_read(true)
        .send()
        .await
        .expect("GetItem")
        .item
}

fn number(item: &std::collections::HashMap<String, AttributeValue>, name: &str) -> i64 {
    match item.get(name) {
        Some(AttributeValue::N(n)) => n.parse().expect("a number"),
        other => panic!("{name} is {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_record_reads_as_absent_before_dynamodb_deletes_it() {
    let Some(store) = common::shared_store().await else {
        return;
    };
    let scope = unique_scope("dyn-ttl");
    let k = key("short");
    let day = Duration::from_secs(86_400);
    let Reservation::Acquired(lease) = store
        .reserve(request(&scope, &k, fp("a"), day, LeaseExpiry::Retry))
        .await
        .expect("reserve")
    else {
        panic!("acquired");
    };
    let processing = raw_item(&store, &scope, &k).await.expect("the item");
    assert!(
        !processing.contains_key("ttl"),
        "a processing record never expires on its own"
    );
    store
        .resolve(
            &scope,
            &k,
            &lease,
            &FinalOutcome {
                verdict: Verdict::Completed,
                response: StoredResponse::new(200, "done"),
                resource_id: None,
                error_code: None,
                retention: Duration::from_millis(1),
            },
        )
        .await
        .expect("resolve");
    let resolved = raw_item(&store, &scope, &k).await.expect("the item");
    let expires_at_ms = number(&resolved, "expires_at_ms");
    let ttl = number(&resolved, "ttl");
    // Whole seconds, never before the expiry, max_skew (1 s) later.
    let skew_ms = i64::try_from(store.max_skew().as_millis()).expect("small");
    assert!(
        ttl * 1_000 >= expires_at_ms + skew_ms,
        "{ttl} s vs {expires_at_ms} ms"
    );
    assert!(ttl * 1_000 < expires_at_ms + skew_ms + 1_000);
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert!(Timestamp::now().as_millis() > expires_at_ms);
    assert_eq!(
        store.get(&scope, &k).await.expect("get"),
        None,
        "expired: absent to readers"
    );
    assert!(
        raw_item(&store, &scope, &k).await.is_some(),
        "while the item itself is still in the table"
    );
    // And the key is free again: a fresh attempt 1.
    let Reservation::Acquired(again) = store
        .reserve(request(&scope, &k, fp("other"), day, LeaseExpiry::Retry))
        .await
        .expect("reserve")
    else {
        panic!("the expired key is free");
    };
    assert_eq!(again.attempt, 1);
    let replaced = raw_item(&store, &scope, &k).await.expect("the item");
    assert!(
        !replaced.contains_key("ttl"),
        "the new record is processing"
    );
}
