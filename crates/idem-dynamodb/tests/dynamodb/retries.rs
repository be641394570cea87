//! A reservation whose answer was lost (the SDK sends it again, or the
//! caller does) finds its own record: acquired, with the same lease,
//! never "in progress" against itself.

use std::time::Duration;

use idem::{LeaseExpiry, OwnerToken, Reservation, ReserveRequest, Store};
use idem_testkit::conformance::{fp, key, request, unique_scope};

use crate::common;

fn acquired(reservation: Reservation) -> idem::Lease {
    match reservation {
        Reservation::Acquired(lease) => lease,
        other => panic!("expected Acquired, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repeated_reservation_of_the_same_owner_is_acquired_again() {
    let Some(store) = common::shared_store().await else {
        return;
    };
    let scope = unique_scope("dyn-retry");
    let k = key("again");
    let first = request(
        &scope,
        &k,
        fp("a"),
        Duration::from_millis(200),
        LeaseExpiry::Retry,
    );
    let lease = acquired(store.reserve(first).await.expect("reserve"));
    assert_eq!(
        acquired(store.reserve(first).await.expect("the same request again")),
        lease,
        "the same owner's new record"
    );
    // After a takeover, the new owner's repeat finds attempt 2.
    tokio::time::sleep(Duration::from_millis(400)).await;
    let takeover = ReserveRequest {
        owner: OwnerToken::random(),
        lease: Duration::from_secs(60),
        ..first
    };
    let taken = acquired(store.reserve(takeover).await.expect("take over"));
    assert_eq!(taken.attempt, 2);
    assert_eq!(
        acquired(store.reserve(takeover).await.expect("the takeover again")),
        taken
    );
    // Anyone else is told it is in progress.
    assert!(matches!(
        store
            .reserve(request(
                &scope,
                &k,
                fp("a"),
                Duration::from_secs(60),
                LeaseExpiry::Retry
            ))
            .await
            .expect("reserve"),
        Reservation::InProgress { .. }
    ));
}
