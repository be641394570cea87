//! Races on one record: of many concurrent reservations exactly one wins,
//! whether the record is new, its lease lapsed or it expired, and
//! whether the racers share a store or come from two gateways' stores
//! (one grouping its operations, one not).

use crate::common;

use std::sync::Arc;
use std::time::Duration;

use idem::{
    FinalOutcome, Fingerprint, IdempotencyKey, LeaseExpiry, OwnerToken, Reservation,
    ReserveRequest, Scope, Store, StoredResponse, Verdict,
};
use idem_mysql::MySqlStore;

fn request<'a>(scope: &'a Scope, key: &'a IdempotencyKey, body: &[u8]) -> ReserveRequest<'a> {
    ReserveRequest {
        scope,
        key,
        fingerprint: Fingerprint::builder().part("body", body).finish(),
        owner: OwnerToken::random(),
        lease: Duration::from_secs(60),
        retention: Duration::from_secs(3600),
        on_lease_expiry: LeaseExpiry::Retry,
    }
}

/// Sixteen concurrent reservations of `key` (eight on each store) with
/// `body`'s fingerprint: the attempts of those that won.
async fn race(
    stores: [&MySqlStore; 2],
    scope: &Scope,
    key: &IdempotencyKey,
    body: &[u8],
) -> Vec<u32> {
    let mut tasks = tokio::task::JoinSet::new();
    for n in 0..16 {
        let store = stores[n % 2].clone();
        let (scope, key, body) = (scope.clone(), key.clone(), body.to_vec());
        tasks.spawn(async move { store.reserve(request(&scope, &key, &body)).await });
    }
    let mut won = Vec::new();
    while let Some(done) = tasks.join_next().await {
        match done.expect("join").expect("reserve") {
            Reservation::Acquired(lease) => won.push(lease.attempt),
            Reservation::InProgress { .. } => {}
            other => panic!("unexpected {other:?}"),
        }
    }
    won
}

/// Two stores on one database, as two gateways have: one with group
/// commit (one slot, so that racers queue), one without.
async fn two_gateways(t: &common::Isolated) -> (MySqlStore, MySqlStore) {
    let grouped = t.opts.clone().with_group_commit_in_flight(1);
    let plain = t.opts.clone().with_group_commit(false);
    (
        MySqlStore::connect_with(grouped).await.expect("connect"),
        MySqlStore::connect_with(plain).await.expect("connect"),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn one_winner_for_a_new_a_lapsed_and_an_expired_record() {
    let Some(t) = common::Isolated::new("races").await else {
        return;
    };
    let (a, b) = two_gateways(&t).await;
    let scope = Scope::new("acme", "op").expect("scope");

    let fresh: IdempotencyKey = "fresh".parse().expect("key");
    assert_eq!(race([&a, &b], &scope, &fresh, b"1").await, [1], "a new key");

    // A record whose lease lapsed in 2000, by the server's clock: every
    // racer may take it over, and exactly one does.
    let lapsed: IdempotencyKey = "lapsed".parse().expect("key");
    let old = crate::clock::frozen_store(&t).await;
    let Reservation::Acquired(_) = old
        .reserve(request(&scope, &lapsed, b"2"))
        .await
        .expect("reserve in 2000")
    else {
        panic!("acquired");
    };
    assert_eq!(
        race([&a, &b], &scope, &lapsed, b"2").await,
        [2],
        "a takeover"
    );

    // A record answered in 2000 and kept for an hour: expired now, so
    // replaced (attempt 1) by exactly one racer, even for another request.
    let expired: IdempotencyKey = "expired".parse().expect("key");
    let Reservation::Acquired(lease) = old
        .reserve(request(&scope, &expired, b"3"))
        .await
        .expect("reserve in 2000")
    else {
        panic!("acquired");
    };
    let outcome = FinalOutcome {
        verdict: Verdict::Completed,
        response: StoredResponse::new(200, "old"),
        resource_id: None,
        error_code: None,
        retention: Duration::from_secs(3600),
    };
    old.resolve(&scope, &expired, &lease, &outcome)
        .await
        .expect("resolve in 2000");
    assert_eq!(
        race([&a, &b], &scope, &expired, b"another request").await,
        [1],
        "a replacement"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_gateways_reserve_each_key_once() {
    let Some(t) = common::Isolated::new("races_many").await else {
        return;
    };
    let (a, b) = two_gateways(&t).await;
    let (a, b) = (Arc::new(a), Arc::new(b));
    let scope = Scope::new("acme", "op").expect("scope");
    let keys: Vec<IdempotencyKey> = (0..50)
        .map(|n| format!("k-{n}").parse().expect("key"))
        .collect();
    let mut tasks = tokio::task::JoinSet::new();
    for round in 0..4 {
        for key in &keys {
            let store = if round % 2 == 0 {
                Arc::clone(&a)
            } else {
                Arc::clone(&b)
            };
            let (scope, key) = (scope.clone(), key.clone());
            tasks.spawn(async move {
                let won = matches!(
                    store
                        .reserve(request(&scope, &key, b"same"))
                        .await
                        .expect("reserve"),
                    Reservation::Acquired(_)
                );
                (key, won)
            });
        }
    }
    let mut winners = std::collections::HashMap::new();
    while let Some(done) = tasks.join_next().await {
        let (key, won) = done.expect("join");
        *winners.entry(key).or_insert(0) += u32::from(won);
    }
    assert_eq!(winners.len(), keys.len());
    assert!(
        winners.values().all(|&n| n == 1),
        "each key won exactly once: {winners:?}"
    );
}
