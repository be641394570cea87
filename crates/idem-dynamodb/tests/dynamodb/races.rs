//! One winner per record, between two store handles (two gateways'
//! clients on one table): new records, lapsed leases, expired records,
//! and a stale owner fenced out by the other handle's takeover.

use std::sync::Arc;
use std::time::Duration;

use idem::{
    FinalOutcome, LeaseExpiry, RecordState, Reservation, Store, StoreError, StoredResponse, Verdict,
};
use idem_testkit::conformance::{fp, key, request, unique_scope};
use tokio::task::JoinSet;

use crate::common;

const DAY: Duration = Duration::from_secs(86_400);

/// Two handles, as two gateways would have.
async fn two_handles() -> Option<[Arc<idem_dynamodb::DynamoStore>; 2]> {
    let one = common::shared_store().await?;
    let two = common::shared_store().await?;
    Some([one, two])
}

fn answer(tag: &str, retention: Duration) -> FinalOutcome {
    FinalOutcome {
        verdict: Verdict::Completed,
        response: StoredResponse::new(201, tag.to_owned()),
        resource_id: Some(tag.to_owned()),
        error_code: None,
        retention,
    }
}

/// Races `racers` reservations of one key over both handles; returns how
/// many acquired it and the attempts they got.
async fn race(
    stores: &[Arc<idem_dynamodb::DynamoStore>; 2],
    scope: &idem::Scope,
    k: &idem::IdempotencyKey,
    lease: Duration,
    racers: usize,
) -> Vec<u32> {
    let mut tasks = JoinSet::new();
    for i in 0..racers {
        let (store, scope, k) = (Arc::clone(&stores[i % 2]), scope.clone(), k.clone());
        tasks.spawn(async move {
            match store
                .reserve(request(&scope, &k, fp("a"), lease, LeaseExpiry::Retry))
                .await
                .expect("reserve")
            {
                Reservation::Acquired(lease) => Some(lease.attempt),
                Reservation::InProgress { .. } | Reservation::Existing(_) => None,
                other => panic!("unexpected {other:?}"),
            }
        });
    }
    let mut won = Vec::new();
    while let Some(done) = tasks.join_next().await {
        won.extend(done.expect("racer"));
    }
    won
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn one_winner_for_a_new_a_lapsed_and_an_expired_record() {
    let Some(stores) = two_handles().await else {
        return;
    };
    let scope = unique_scope("dyn-race");
    let k = key("contested");
    // A lease long enough that no racer sees it lapse while they run.
    assert_eq!(
        race(&stores, &scope, &k, Duration::from_secs(1), 16).await,
        [1],
        "one of 16 creates the record"
    );
    // The lease lapses: of 16 racers over both handles, one takes over.
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    assert_eq!(
        race(&stores, &scope, &k, DAY, 16).await,
        [2],
        "one of 16 takes the lapsed lease over, as attempt 2"
    );
    let rec = stores[0]
        .get(&scope, &k)
        .await
        .expect("get")
        .expect("there");
    stores[1]
        .resolve(
            &scope,
            &k,
            &rec.lease,
            &answer("a", Duration::from_millis(1)),
        )
        .await
        .expect("the winner resolves through the other handle");
    // Expired: of 16 racers, one replaces it with a fresh attempt 1.
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert_eq!(
        race(&stores, &scope, &k, DAY, 16).await,
        [1],
        "one of 16 replaces the expired record"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stale_owner_is_fenced_out_by_the_other_handles_takeover() {
    let Some([a, b]) = two_handles().await else {
        return;
    };
    let scope = unique_scope("dyn-fence");
    let k = key("fenced");
    let Reservation::Acquired(stale) = a
        .reserve(request(
            &scope,
            &k,
            fp("a"),
            Duration::from_millis(200),
            LeaseExpiry::Retry,
        ))
        .await
        .expect("reserve")
    else {
        panic!("the first reservation acquires");
    };
    tokio::time::sleep(Duration::from_millis(400)).await;
    let Reservation::Acquired(fresh) = b
        .reserve(request(&scope, &k, fp("a"), DAY, LeaseExpiry::Retry))
        .await
        .expect("reserve")
    else {
        panic!("the lapsed lease is taken over");
    };
    assert_eq!(fresh.attempt, 2);
    for refused in [
        a.resolve(&scope, &k, &stale, &answer("zombie", DAY)).await,
        a.mark_unknown(&scope, &k, &stale, "late").await,
        a.renew(&scope, &k, &stale, DAY).await.map(|_| ()),
        a.release(&scope, &k, &stale).await,
    ] {
        assert!(matches!(refused, Err(StoreError::Fenced)), "{refused:?}");
    }
    b.resolve(&scope, &k, &fresh, &answer("winner", DAY))
        .await
        .expect("the new owner resolves");
    let rec = a.get(&scope, &k).await.expect("get").expect("there");
    assert_eq!(rec.state, RecordState::Completed);
    assert_eq!(rec.resource_id.as_deref(), Some("winner"));
    assert_eq!(rec.lease, fresh);
}
