//! Reservation, replay, races, mismatches, takeover, fencing and release:
//! one record's contract while it is being decided.

use super::*;

/// A first reservation is acquired as attempt 1; a completed record is
/// replayed with status, headers, body bytes and resource id intact.
pub async fn reserve_complete_replay<S: Store>(store: Arc<S>) {
    let scope = unique_scope("replay");
    let k = key("k-1");
    assert_eq!(store.get(&scope, &k).await.expect("get"), None);
    let lease = acquire(
        &*store,
        request(&scope, &k, fp("a"), DAY, LeaseExpiry::Retry),
    )
    .await;
    assert_eq!(lease.attempt, 1);

    let rec = store
        .get(&scope, &k)
        .await
        .expect("get")
        .expect("record exists");
    assert_eq!(rec.state, RecordState::Processing);
    assert_eq!(rec.fingerprint, fp("a"));
    assert_eq!(rec.lease, lease);
    assert!(rec.response.is_none());

    let done = outcome(Verdict::Completed, "a", DAY);
    store
        .resolve(&scope, &k, &lease, &done)
        .await
        .expect("resolve");
    // Resolving again as the same owner is harmless (retry after an
    // ambiguous failure).
    store
        .resolve(&scope, &k, &lease, &done)
        .await
        .expect("idempotent resolve");

    match store
        .reserve(request(&scope, &k, fp("a"), DAY, LeaseExpiry::Retry))
        .await
        .expect("reserve")
    {
        Reservation::Existing(rec) => {
            assert_eq!(rec.state, RecordState::Completed);
            assert_eq!(rec.response.as_ref(), Some(&done.response));
            assert_eq!(rec.resource_id.as_deref(), Some("res-a"));
            assert_eq!(rec.fingerprint, fp("a"));
            assert!(rec.expires_at > rec.created_at);
        }
        other => panic!("expected Existing, got {other:?}"),
    }
}

/// A failed record is replayed too, with its error code.
pub async fn failed_is_replayed<S: Store>(store: Arc<S>) {
    let scope = unique_scope("failed");
    let k = key("k-f");
    let lease = acquire(
        &*store,
        request(&scope, &k, fp("a"), DAY, LeaseExpiry::Retry),
    )
    .await;
    let failed = outcome(Verdict::Failed, "f", DAY);
    store
        .resolve(&scope, &k, &lease, &failed)
        .await
        .expect("resolve");
    match store
        .reserve(request(&scope, &k, fp("a"), DAY, LeaseExpiry::Retry))
        .await
        .expect("reserve")
    {
        Reservation::Existing(rec) => {
            assert_eq!(rec.state, RecordState::Failed);
            assert_eq!(rec.response.as_ref().map(|r| r.status), Some(422));
            assert_eq!(rec.error_code.as_deref(), Some("declined"));
        }
        other => panic!("expected Existing, got {other:?}"),
    }
}

/// Many tasks race to reserve one key: exactly one wins, everyone else is
/// told it is in progress. Repeated over several keys at once.
pub async fn reservation_race<S: Store>(store: Arc<S>) {
    const KEYS: usize = 4;
    const TASKS_PER_KEY: usize = 64;
    let scope = unique_scope("race");
    let barrier = Arc::new(tokio::sync::Barrier::new(KEYS * TASKS_PER_KEY));
    let mut tasks = JoinSet::new();
    for k in 0..KEYS {
        for _ in 0..TASKS_PER_KEY {
            let (store, scope, barrier) = (Arc::clone(&store), scope.clone(), Arc::clone(&barrier));
            tasks.spawn(async move {
                let k = key(&format!("race-{k}"));
                barrier.wait().await;
                let r = store
                    .reserve(request(&scope, &k, fp("same"), DAY, LeaseExpiry::Retry))
                    .await
                    .expect("reserve");
                (k, r)
            });
        }
    }
    let mut winners = HashSet::new();
    let mut in_progress = 0;
    while let Some(joined) = tasks.join_next().await {
        let (k, r) = joined.expect("task");
        match r {
            Reservation::Acquired(lease) => {
                assert_eq!(lease.attempt, 1);
                assert!(winners.insert(k.clone()), "two winners for {k}");
            }
            Reservation::InProgress { retry_after, .. } => {
                assert!(retry_after <= DAY);
                in_progress += 1;
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(winners.len(), KEYS, "exactly one winner per key");
    assert_eq!(in_progress, KEYS * (TASKS_PER_KEY - 1));
}

/// A key reused with another fingerprint is a mismatch in every state:
/// processing, outcome unknown, completed, failed.
pub async fn mismatch_in_every_state<S: Store>(store: Arc<S>) {
    let scope = unique_scope("mismatch");
    let states = [
        ("processing", None),
        ("unknown", None),
        ("completed", Some(Verdict::Completed)),
        ("failed", Some(Verdict::Failed)),
    ];
    for (name, verdict) in states {
        let k = key(&format!("mm-{name}"));
        let lease = acquire(
            &*store,
            request(&scope, &k, fp("original"), DAY, LeaseExpiry::Retry),
        )
        .await;
        if name == "unknown" {
            store
                .mark_unknown(&scope, &k, &lease, "timeout")
                .await
                .expect("mark");
        }
        if let Some(v) = verdict {
            store
                .resolve(&scope, &k, &lease, &outcome(v, name, DAY))
                .await
                .expect("resolve");
        }
        let expected = verdict.map_or(RecordState::Processing, RecordState::from);
        let got = store
            .reserve(request(&scope, &k, fp("changed"), DAY, LeaseExpiry::Retry))
            .await
            .expect("reserve");
        assert_eq!(
            got,
            Reservation::Mismatch { state: expected },
            "state {name}"
        );
        // The mismatch changed nothing.
        let rec = store
            .get(&scope, &k)
            .await
            .expect("get")
            .expect("still there");
        assert_eq!(rec.fingerprint, fp("original"));
        assert_eq!(rec.lease.attempt, 1);
    }
}

/// A live lease makes duplicates wait; a lapsed one is taken over as
/// attempt 2 under `Retry`, and kept under `Hold` (reported as an unknown
/// outcome: nobody runs it).
///
/// The live check and the lapse use two records: a duplicate's answer
/// while the lease is live must not depend on how fast the store answers.
pub async fn lease_takeover_and_hold<S: Store>(store: Arc<S>) {
    let scope = unique_scope("lease");
    let live = key("lease-live");
    acquire(
        &*store,
        request(&scope, &live, fp("a"), DAY, LeaseExpiry::Retry),
    )
    .await;
    match store
        .reserve(request(&scope, &live, fp("a"), DAY, LeaseExpiry::Retry))
        .await
        .expect("reserve")
    {
        Reservation::InProgress {
            retry_after,
            outcome_unknown,
        } => {
            assert!(
                retry_after > Duration::ZERO && retry_after <= DAY,
                "{retry_after:?}"
            );
            assert!(!outcome_unknown);
        }
        other => panic!("expected InProgress, got {other:?}"),
    }

    let k = key("lease-retry");
    let first = acquire(
        &*store,
        request(&scope, &k, fp("a"), SHORT_LEASE, LeaseExpiry::Retry),
    )
    .await;
    tokio::time::sleep(PAST_SHORT_LEASE).await;
    let second = acquire(
        &*store,
        request(&scope, &k, fp("a"), DAY, LeaseExpiry::Retry),
    )
    .await;
    assert_eq!(second.attempt, first.attempt + 1);
    assert_ne!(second.owner, first.owner);

    let k = key("lease-hold");
    acquire(
        &*store,
        request(&scope, &k, fp("a"), SHORT_LEASE, LeaseExpiry::Hold),
    )
    .await;
    tokio::time::sleep(PAST_SHORT_LEASE).await;
    match store
        .reserve(request(&scope, &k, fp("a"), SHORT_LEASE, LeaseExpiry::Hold))
        .await
        .expect("reserve")
    {
        // Its owner stopped renewing: nobody runs it, and what it did is
        // unknown, whether or not it was marked so.
        Reservation::InProgress {
            retry_after,
            outcome_unknown,
        } => {
            assert!(retry_after > Duration::ZERO);
            assert!(outcome_unknown, "a held record says its outcome is unknown");
        }
        other => panic!("Hold must not take over, got {other:?}"),
    }
}

/// After a takeover the old owner can no longer resolve, release, mark or
/// renew the record; a forged owner with the right attempt cannot either.
pub async fn fencing_of_stale_owner<S: Store>(store: Arc<S>) {
    let scope = unique_scope("fence");
    let k = key("fenced");
    let zombie = acquire(
        &*store,
        request(&scope, &k, fp("a"), SHORT_LEASE, LeaseExpiry::Retry),
    )
    .await;
    tokio::time::sleep(PAST_SHORT_LEASE).await;
    let current = acquire(
        &*store,
        request(&scope, &k, fp("a"), DAY, LeaseExpiry::Retry),
    )
    .await;

    let late = outcome(Verdict::Completed, "zombie", DAY);
    assert!(matches!(
        store.resolve(&scope, &k, &zombie, &late).await,
        Err(StoreError::Fenced)
    ));
    assert!(matches!(
        store.release(&scope, &k, &zombie).await,
        Err(StoreError::Fenced)
    ));
    assert!(matches!(
        store.mark_unknown(&scope, &k, &zombie, "late").await,
        Err(StoreError::Fenced)
    ));
    assert!(matches!(
        store.renew(&scope, &k, &zombie, DAY).await,
        Err(StoreError::Fenced)
    ));
    let forged = Lease {
        owner: OwnerToken::random(),
        ..current
    };
    assert!(matches!(
        store.resolve(&scope, &k, &forged, &late).await,
        Err(StoreError::Fenced)
    ));
    let stale_attempt = Lease {
        attempt: current.attempt - 1,
        ..current
    };
    assert!(matches!(
        store.resolve(&scope, &k, &stale_attempt, &late).await,
        Err(StoreError::Fenced)
    ));

    let good = outcome(Verdict::Completed, "current", DAY);
    store
        .resolve(&scope, &k, &current, &good)
        .await
        .expect("owner resolves");
    let rec = store.get(&scope, &k).await.expect("get").expect("exists");
    assert_eq!(rec.state, RecordState::Completed);
    assert_eq!(rec.response.as_ref(), Some(&good.response));
    // A resolved record cannot be released or re-leased by anyone.
    assert!(matches!(
        store.release(&scope, &k, &current).await,
        Err(StoreError::Fenced)
    ));
    // Operations on a record that does not exist are fenced too.
    let nothing = key("never-reserved");
    assert!(matches!(
        store.resolve(&scope, &nothing, &current, &good).await,
        Err(StoreError::Fenced)
    ));
}

/// Release frees the key: it is gone, and the next reservation is a fresh
/// attempt 1 that may even carry another fingerprint.
pub async fn release_frees_the_key<S: Store>(store: Arc<S>) {
    let scope = unique_scope("release");
    let k = key("released");
    let lease = acquire(
        &*store,
        request(&scope, &k, fp("a"), DAY, LeaseExpiry::Retry),
    )
    .await;
    store.release(&scope, &k, &lease).await.expect("release");
    assert_eq!(store.get(&scope, &k).await.expect("get"), None);
    let again = acquire(
        &*store,
        request(&scope, &k, fp("b"), DAY, LeaseExpiry::Retry),
    )
    .await;
    assert_eq!(again.attempt, 1);
}
