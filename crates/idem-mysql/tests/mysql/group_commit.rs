//! Group commit: operations queued while the only slot is busy run
//! together in one transaction, and each caller gets its own answer —
//! one winner per key, duplicates in progress, stale leases fenced.

use crate::common;

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use idem::{
    FinalOutcome, Fingerprint, IdempotencyKey, Lease, LeaseExpiry, OwnerToken, RecordState,
    Reservation, ReserveRequest, Scope, Store, StoreError, StoredResponse, Verdict,
};
use idem_mysql::MySqlStore;

type Boxed<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Polls `fut` once with a waker that does nothing: far enough for an
/// operation to queue behind a busy slot. A later `.await` polls it again
/// with a real waker.
fn poll_once<T>(fut: &mut Boxed<'_, T>) -> Poll<T> {
    fut.as_mut().poll(&mut Context::from_waker(Waker::noop()))
}

fn request<'a>(scope: &'a Scope, key: &'a IdempotencyKey) -> ReserveRequest<'a> {
    ReserveRequest {
        scope,
        key,
        fingerprint: Fingerprint::builder()
            .part("k", key.as_str().as_bytes())
            .finish(),
        owner: OwnerToken::random(),
        lease: Duration::from_secs(60),
        retention: Duration::from_secs(3600),
        on_lease_expiry: LeaseExpiry::Retry,
    }
}

fn answer(n: usize) -> FinalOutcome {
    FinalOutcome {
        verdict: Verdict::Completed,
        response: StoredResponse::new(201, format!("answer {n}")),
        resource_id: Some(format!("r-{n}")),
        error_code: None,
        retention: Duration::from_secs(3600),
    }
}

/// Waits until `done` holds, checking between short sleeps.
async fn until(mut done: impl FnMut() -> bool) {
    while !done() {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn queued_operations_share_a_transaction_and_get_their_own_answers() {
    let Some(t) = common::Isolated::new("group").await else {
        return;
    };
    let opts = t
        .opts
        .clone()
        .with_group_commit(true)
        .with_group_commit_in_flight(1)
        .with_group_commit_max(16);
    let store = MySqlStore::connect_with(opts).await.expect("connect");
    let scope = Scope::new("acme", "op").expect("scope");

    // A caller's transaction holds "held" uncommitted; a reservation of
    // it takes the one slot and waits on the row.
    let held: IdempotencyKey = "held".parse().expect("key");
    let mut tx = store.pool().begin().await.expect("begin");
    let Reservation::Acquired(_) = store
        .reserve_in(&mut tx, request(&scope, &held))
        .await
        .expect("reserve in tx")
    else {
        panic!("acquired");
    };
    let blocker = tokio::spawn({
        let (store, scope, held) = (store.clone(), scope.clone(), held.clone());
        async move { store.reserve(request(&scope, &held)).await }
    });
    until(|| store.group_commit_stats().alone == 1).await;

    // Twenty reservations queue behind it: ten keys once, five keys twice.
    let keys: Vec<IdempotencyKey> = (0..15)
        .map(|n| format!("k-{n:02}").parse().expect("key"))
        .collect();
    let wanted: Vec<&IdempotencyKey> = keys.iter().chain(&keys[10..]).collect();
    let requests: Vec<ReserveRequest<'_>> = wanted.iter().map(|k| request(&scope, k)).collect();
    let mut queued: Vec<Boxed<'_, Result<Reservation, StoreError>>> = requests
        .iter()
        .map(|req| Box::pin(store.reserve(*req)) as Boxed<'_, _>)
        .collect();
    for fut in &mut queued {
        assert!(poll_once(fut).is_pending(), "the slot is busy: queued");
    }
    tx.commit().await.expect("commit the caller's transaction");
    assert!(
        matches!(
            blocker.await.expect("join").expect("reserve"),
            Reservation::InProgress { .. }
        ),
        "the held key is the caller's, in progress"
    );
    let mut leases: Vec<Option<Lease>> = Vec::new();
    for fut in queued {
        leases.push(match fut.await.expect("reserve") {
            Reservation::Acquired(lease) => Some(lease),
            Reservation::InProgress { .. } => None,
            other => panic!("unexpected {other:?}"),
        });
    }
    for (i, key) in keys.iter().enumerate() {
        let winners = wanted
            .iter()
            .zip(&leases)
            .filter(|(k, lease)| **k == key && lease.is_some())
            .count();
        assert_eq!(winners, 1, "{key}: exactly one reservation wins");
        let record = store.get(&scope, key).await.expect("get").expect("record");
        assert_eq!(record.state, RecordState::Processing, "{i}");
    }
    let stats = store.group_commit_stats();
    assert_eq!(stats.alone, 1, "{stats:?}");
    assert_eq!(stats.operations, 20, "every queued reservation ran grouped");
    assert!(
        stats.transactions >= 2,
        "a key twice in the queue waits for the next group: {stats:?}"
    );

    // Resolutions queue the same way behind a resolution that waits on a
    // row the caller's transaction locked.
    let winners: Vec<(&IdempotencyKey, Lease)> = wanted
        .iter()
        .zip(&leases)
        .filter_map(|(k, lease)| lease.map(|l| (*k, l)))
        .collect();
    let (first_key, first_lease) = winners[0];
    let mut tx = store.pool().begin().await.expect("begin");
    sqlx::query("SELECT 1 FROM idem_records WHERE idem_key = ? FOR UPDATE")
        .bind(first_key.as_str())
        .fetch_all(&mut *tx)
        .await
        .expect("lock a row");
    let resolving = tokio::spawn({
        let (store, scope, key) = (store.clone(), scope.clone(), first_key.clone());
        async move { store.resolve(&scope, &key, &first_lease, &answer(0)).await }
    });
    until(|| store.group_commit_stats().alone == 2).await;
    let stale = Lease {
        owner: OwnerToken::random(),
        ..winners[1].1
    };
    let outcomes: Vec<FinalOutcome> = (0..winners.len()).map(answer).collect();
    let mut queued: Vec<Boxed<'_, Result<(), StoreError>>> = winners[1..]
        .iter()
        .enumerate()
        .map(|(i, (key, lease))| {
            Box::pin(store.resolve(&scope, key, lease, &outcomes[i + 1])) as Boxed<'_, _>
        })
        .collect();
    let stale_key = winners[1].0;
    queued.push(Box::pin(store.resolve(
        &scope,
        stale_key,
        &stale,
        &outcomes[0],
    )));
    for fut in &mut queued {
        assert!(poll_once(fut).is_pending(), "the slot is busy: queued");
    }
    tx.commit().await.expect("commit");
    resolving.await.expect("join").expect("resolve");
    let stale_result = queued.pop().expect("the stale one").await;
    for fut in queued {
        fut.await.expect("resolved in the group");
    }
    assert!(
        matches!(stale_result, Err(StoreError::Fenced)),
        "a stale lease in a group is fenced: {stale_result:?}"
    );
    for (n, (key, _)) in winners.iter().enumerate() {
        let record = store.get(&scope, key).await.expect("get").expect("record");
        assert_eq!(record.state, RecordState::Completed, "{key}");
        assert_eq!(
            record.resource_id,
            Some(format!("r-{n}")),
            "{key}: its own answer"
        );
    }
    assert_eq!(store.group_commit_stats().operations, 20 + 15);
    store.close().await;
}
