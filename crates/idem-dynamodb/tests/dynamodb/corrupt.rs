//! Items the store cannot read (written by hand, or by a newer layout)
//! are corrupt errors, never panics.

use idem::{Purge, Store, StoreError};
use idem_dynamodb::aws_sdk_dynamodb::types::AttributeValue;
use idem_testkit::conformance::{key, unique_scope};

use crate::common;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreadable_items_are_corrupt_errors() {
    let Some(store) = common::shared_store().await else {
        return;
    };
    let scope = unique_scope("dyn-corrupt");
    // Without the listing index's attributes, so that listings of the
    // shared table never meet them.
    for (label, state, attempt) in [
        ("state", "sideways", "1"),
        ("attempt", "processing", "0"),
        ("number", "processing", "one"),
    ] {
        let k = key(label);
        let pk = format!("{}\u{1}{}\u{1}{label}", scope.tenant(), scope.operation());
        let s = |v: &str| AttributeValue::S(v.to_owned());
        let n = |v: &str| AttributeValue::N(v.to_owned());
        store
            .client()
            .put_item()
            .table_name(store.table())
            .item("pk", s(&pk))
            .item("tenant", s(scope.tenant()))
            .item("operation", s(scope.operation()))
            .item("idem_key", s(label))
            .item("fingerprint", AttributeValue::B(vec![0; 32].into()))
            .item("state", s(state))
            .item("created_at_ms", n("1"))
            .item("updated_at_ms", n("1"))
            .item("expires_at_ms", n("1"))
            .item("locked_until_ms", n("1"))
            .item("owner", AttributeValue::B(vec![0; 16].into()))
            .item(
                "attempt",
                if label == "number" {
                    s(attempt)
                } else {
                    n(attempt)
                },
            )
            .send()
            .await
            .expect("PutItem");
        match store.get(&scope, &k).await {
            Err(StoreError::Corrupt(err)) => {
                assert!(
                    err.to_string().contains("unreadable item"),
                    "{label}: {err}"
                );
            }
            other => panic!("{label}: expected Corrupt, got {other:?}"),
        }
        // Deleting needs no reading.
        assert!(store.delete(&scope, &k).await.expect("delete"));
    }
}
