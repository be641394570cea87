//! A record over time: deleted, renewed, held as unknown, expired,
//! purged in batches and replaced.

use super::*;

/// An operator's delete removes a record in any state: a final one can be
/// executed again, and the owner of a deleted processing one is fenced
/// out instead of recording into a record that is gone.
pub async fn delete_removes_any_state<S: Store + Purge>(store: Arc<S>) {
    let scope = unique_scope("delete");
    let done = key("done");
    let lease = acquire(
        &*store,
        request(&scope, &done, fp("a"), DAY, LeaseExpiry::Retry),
    )
    .await;
    let answer = outcome(Verdict::Completed, "done", DAY);
    store
        .resolve(&scope, &done, &lease, &answer)
        .await
        .expect("resolve");
    assert!(store.delete(&scope, &done).await.expect("delete"));
    assert_eq!(store.get(&scope, &done).await.expect("get"), None);
    assert!(!store.delete(&scope, &done).await.expect("delete again"));
    let again = acquire(
        &*store,
        request(&scope, &done, fp("a"), DAY, LeaseExpiry::Retry),
    )
    .await;
    assert_eq!(again.attempt, 1, "a fresh attempt, not a replay");

    let busy = key("busy");
    let lease = acquire(
        &*store,
        request(&scope, &busy, fp("a"), DAY, LeaseExpiry::Retry),
    )
    .await;
    assert!(store.delete(&scope, &busy).await.expect("delete"));
    assert!(matches!(
        store.resolve(&scope, &busy, &lease, &answer).await,
        Err(StoreError::Fenced)
    ));
    assert_eq!(store.get(&scope, &busy).await.expect("get"), None);
}

/// Renewing moves the lease forward, so a slow owner keeps its record.
pub async fn renew_extends_the_lease<S: Store>(store: Arc<S>) {
    let scope = unique_scope("renew");
    let k = key("renewed");
    let lease = acquire(
        &*store,
        request(&scope, &k, fp("a"), SHORT_LEASE, LeaseExpiry::Retry),
    )
    .await;
    let until = store
        .renew(&scope, &k, &lease, Duration::from_secs(5))
        .await
        .expect("renew");
    assert!(until > lease.locked_until);
    tokio::time::sleep(PAST_SHORT_LEASE).await;
    assert!(matches!(
        store
            .reserve(request(
                &scope,
                &k,
                fp("a"),
                SHORT_LEASE,
                LeaseExpiry::Retry
            ))
            .await
            .expect("reserve"),
        Reservation::InProgress { .. }
    ));
    let rec = store.get(&scope, &k).await.expect("get").expect("exists");
    assert_eq!(rec.lease.locked_until, until);
    assert_eq!(rec.lease.attempt, 1);
}

/// An outcome-unknown record stays processing, says so to duplicates, and
/// can still be taken over after its lease lapses (Retry).
///
/// The live check and the lapse use two records: a duplicate's answer
/// while the lease is live must not depend on how fast the store answers.
pub async fn outcome_unknown_is_kept<S: Store>(store: Arc<S>) {
    let scope = unique_scope("unknown");
    let live = key("unknown-live");
    let lease = acquire(
        &*store,
        request(&scope, &live, fp("a"), DAY, LeaseExpiry::Retry),
    )
    .await;
    store
        .mark_unknown(&scope, &live, &lease, "provider timeout")
        .await
        .expect("mark");
    let rec = store
        .get(&scope, &live)
        .await
        .expect("get")
        .expect("exists");
    assert_eq!(rec.state, RecordState::Processing);
    assert_eq!(rec.error_code.as_deref(), Some(OUTCOME_UNKNOWN));
    assert!(rec.is_outcome_unknown());
    match store
        .reserve(request(&scope, &live, fp("a"), DAY, LeaseExpiry::Retry))
        .await
        .expect("reserve")
    {
        Reservation::InProgress {
            outcome_unknown, ..
        } => assert!(outcome_unknown),
        other => panic!("expected InProgress, got {other:?}"),
    }

    let k = key("unknown-lapsed");
    let lease = acquire(
        &*store,
        request(&scope, &k, fp("a"), SHORT_LEASE, LeaseExpiry::Retry),
    )
    .await;
    store
        .mark_unknown(&scope, &k, &lease, "provider timeout")
        .await
        .expect("mark");
    tokio::time::sleep(PAST_SHORT_LEASE).await;
    let retry = acquire(
        &*store,
        request(&scope, &k, fp("a"), DAY, LeaseExpiry::Retry),
    )
    .await;
    assert_eq!(retry.attempt, 2);
    // The retry was marked unknown too, then learnt the outcome: the final
    // record carries the new resource and no longer the unknown flag.
    store
        .mark_unknown(&scope, &k, &retry, "provider timeout again")
        .await
        .expect("mark the retry");
    let done = outcome(Verdict::Completed, "known", DAY);
    store
        .resolve(&scope, &k, &retry, &done)
        .await
        .expect("resolve after unknown");
    let rec = store.get(&scope, &k).await.expect("get").expect("exists");
    assert_eq!(rec.state, RecordState::Completed);
    assert_eq!(rec.error_code, None);
    assert!(!rec.is_outcome_unknown());
    assert_eq!(rec.resource_id.as_deref(), Some("res-known"));
}

/// Final records past retention disappear from reads, are replaced by a
/// new reservation, and are purged in batches; processing records, and
/// outcome-unknown ones above all, are never purged.
pub async fn expiry_and_batched_purge<S: Store + Purge>(store: Arc<S>) {
    let scope = unique_scope("purge");
    let instant = Duration::from_millis(1);
    let mut expired = Vec::new();
    for i in 0..7 {
        let k = key(&format!("exp-{i}"));
        let lease = acquire(
            &*store,
            request(&scope, &k, fp("a"), DAY, LeaseExpiry::Retry),
        )
        .await;
        let verdict = if i % 2 == 0 {
            Verdict::Completed
        } else {
            Verdict::Failed
        };
        store
            .resolve(&scope, &k, &lease, &outcome(verdict, "x", instant))
            .await
            .expect("resolve");
        expired.push(k);
    }
    let kept = key("kept");
    let lease = acquire(
        &*store,
        request(&scope, &kept, fp("a"), DAY, LeaseExpiry::Retry),
    )
    .await;
    store
        .resolve(
            &scope,
            &kept,
            &lease,
            &outcome(Verdict::Completed, "k", DAY),
        )
        .await
        .expect("resolve");
    let processing = key("processing");
    // A lapsed lease and an expires_at in the past: still never purged.
    let p_lease = acquire(
        &*store,
        ReserveRequest {
            retention: instant,
            ..request(&scope, &processing, fp("a"), instant, LeaseExpiry::Hold)
        },
    )
    .await;
    let unknown = key("unknown");
    let u_lease = acquire(
        &*store,
        ReserveRequest {
            retention: instant,
            ..request(&scope, &unknown, fp("a"), instant, LeaseExpiry::Hold)
        },
    )
    .await;
    store
        .mark_unknown(&scope, &unknown, &u_lease, "timeout")
        .await
        .expect("mark");
    tokio::time::sleep(Duration::from_millis(50)).await;

    for k in &expired {
        assert_eq!(
            store.get(&scope, k).await.expect("get"),
            None,
            "{k} expired"
        );
    }
    // Batches: never more than asked for, and purging ends. (Stores whose
    // records expire on their own, like Redis with TTLs, may find nothing
    // left to delete; backends that delete explicitly check exact batch
    // counts in their own tests.)
    let mut rounds = 0;
    loop {
        let n = store.purge_expired(3).await.expect("purge");
        assert!(n <= 3, "a batch of 3 deleted {n}");
        rounds += 1;
        assert!(rounds < 1_000, "purging does not end");
        if n == 0 {
            break;
        }
    }
    assert!(store.get(&scope, &kept).await.expect("get").is_some());
    let p = store
        .get(&scope, &processing)
        .await
        .expect("get")
        .expect("processing kept");
    assert_eq!(p.lease, p_lease);
    let u = store
        .get(&scope, &unknown)
        .await
        .expect("get")
        .expect("unknown kept");
    assert!(u.is_outcome_unknown());

    // An expired key is free again, even for another request.
    let k = &expired[0];
    let fresh = acquire(
        &*store,
        request(&scope, k, fp("other"), DAY, LeaseExpiry::Retry),
    )
    .await;
    assert_eq!(fresh.attempt, 1);
}

/// An expired record that was not purged yet is replaced, not replayed.
pub async fn expired_record_is_replaced<S: Store>(store: Arc<S>) {
    let scope = unique_scope("replace");
    let k = key("replace");
    let lease = acquire(
        &*store,
        request(&scope, &k, fp("a"), DAY, LeaseExpiry::Retry),
    )
    .await;
    store
        .resolve(
            &scope,
            &k,
            &lease,
            &outcome(Verdict::Completed, "old", Duration::from_millis(1)),
        )
        .await
        .expect("resolve");
    tokio::time::sleep(Duration::from_millis(20)).await;
    let fresh = acquire(
        &*store,
        request(&scope, &k, fp("a"), DAY, LeaseExpiry::Retry),
    )
    .await;
    assert_eq!(fresh.attempt, 1);
    let rec = store.get(&scope, &k).await.expect("get").expect("exists");
    assert_eq!(rec.state, RecordState::Processing);
    assert_eq!(rec.response, None);
    assert_eq!(rec.resource_id, None);
}
