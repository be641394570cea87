//! DynamoDB's 400 KB item: a larger answer is refused as not retained
//! (never truncated) and counted; one that fits is kept byte for byte.

use std::time::Duration;

use idem::{
    FinalOutcome, LeaseExpiry, RecordState, Reservation, Store, StoreError, StoredResponse, Verdict,
};
use idem_testkit::conformance::{fp, key, request, unique_scope};

use crate::common;

const DAY: Duration = Duration::from_secs(86_400);

fn answer(body: Vec<u8>) -> FinalOutcome {
    FinalOutcome {
        verdict: Verdict::Completed,
        response: StoredResponse::new(200, body).with_header("content-type", "application/json"),
        resource_id: None,
        error_code: None,
        retention: DAY,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_over_the_item_limit_is_refused_and_counted() {
    let Some(store) = common::shared_store().await else {
        return;
    };
    let scope = unique_scope("dyn-size");
    let k = key("large");
    let Reservation::Acquired(lease) = store
        .reserve(request(&scope, &k, fp("a"), DAY, LeaseExpiry::Retry))
        .await
        .expect("reserve")
    else {
        panic!("acquired");
    };
    let before = store.stats().items_too_large;
    let refused = store
        .resolve(&scope, &k, &lease, &answer(vec![b'x'; 400 * 1024]))
        .await
        .expect_err("over the item limit");
    assert!(
        matches!(refused, StoreError::Backend(_)),
        "lasting: {refused:?}"
    );
    assert!(!refused.is_transient());
    let message = refused.to_string();
    assert!(message.contains("not retained"), "{message}");
    assert!(message.contains("409600"), "{message}");
    assert_eq!(store.stats().items_too_large, before + 1);
    // Nothing was written: the record is still its owner's, processing.
    let rec = store.get(&scope, &k).await.expect("get").expect("there");
    assert_eq!(rec.state, RecordState::Processing);
    assert_eq!(rec.response, None);
    assert_eq!(rec.lease, lease);

    // An answer that fits is kept whole.
    let body: Vec<u8> = (0..350 * 1024).map(|i| (i % 251) as u8).collect();
    let fits = answer(body);
    store
        .resolve(&scope, &k, &lease, &fits)
        .await
        .expect("350 KB fits");
    let rec = store.get(&scope, &k).await.expect("get").expect("there");
    assert_eq!(rec.response.as_ref(), Some(&fits.response), "byte for byte");
    assert_eq!(store.stats().items_too_large, before + 1);
}
