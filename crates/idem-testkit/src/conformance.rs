//! The store conformance suite: one set of checks every backend must pass.
//!
//! Each check is an `async fn` over an `Arc<S>`; the
//! [`store_conformance!`](crate::store_conformance) macro turns them into
//! `#[tokio::test]`s for one backend. Every check works in its own tenant
//! (random suffix), so several checks — and several test binaries — can
//! share one database or Redis.
//!
//! Times are real: leases of a few hundred milliseconds and sleeps past
//! them, because every backend must use its own clock.

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use bytes::Bytes;
use idem::store::{Cursor, MAX_PAGE};
use idem::{
    Engine, FinalOutcome, Fingerprint, IdempotencyKey, InFlight, Lease, LeaseExpiry, ListFilter,
    ListRecords, OUTCOME_UNKNOWN, OwnerToken, Policy, Purge, RecordState, Reservation,
    ReserveRequest, Run, Scope, Store, StoreError, StoredResponse, Verdict,
};
use tokio::task::JoinSet;

/// A short lease, so that lapses can be waited for.
pub const SHORT_LEASE: Duration = Duration::from_millis(300);
/// Sleeping this long lets a [`SHORT_LEASE`] lapse on any store clock.
pub const PAST_SHORT_LEASE: Duration = Duration::from_millis(450);
const DAY: Duration = Duration::from_secs(86_400);

/// What a backend's test provides: a store, plus whatever keeps it alive
/// (a temporary directory, a database handle).
pub trait Fixture: Send + Sync + 'static {
    /// The store under test.
    type Store: Store + ListRecords + Purge;
    /// A handle on the store.
    fn store(&self) -> Arc<Self::Store>;
}

/// What a backend's fixture expression may evaluate to: a [`Fixture`], or
/// `Option<Fixture>` where `None` means "server absent, test skipped" (see
/// [`services`](crate::services)).
pub trait IntoFixture {
    /// The fixture.
    type Fixture: Fixture;
    /// The fixture, or `None` to skip.
    fn into_fixture(self) -> Option<Self::Fixture>;
}

impl<F: Fixture> IntoFixture for F {
    type Fixture = F;
    fn into_fixture(self) -> Option<F> {
        Some(self)
    }
}

impl<F: Fixture> IntoFixture for Option<F> {
    type Fixture = F;
    fn into_fixture(self) -> Option<F> {
        self
    }
}

impl<S: Store + ListRecords + Purge> Fixture for Arc<S> {
    type Store = S;
    fn store(&self) -> Arc<S> {
        Arc::clone(self)
    }
}

/// A scope in a tenant of its own.
pub fn unique_scope(check: &str) -> Scope {
    let tenant = format!("{check}-{}", OwnerToken::random());
    Scope::new(&tenant, "POST /v1/things").expect("valid scope")
}

/// A key from text known to be valid.
pub fn key(text: &str) -> IdempotencyKey {
    text.parse().expect("valid key")
}

/// A fingerprint derived from a label.
pub fn fp(label: &str) -> Fingerprint {
    Fingerprint::builder().bytes_body(label.as_bytes()).finish()
}

/// A reservation request with the given lease and policy for lapses.
pub fn request<'a>(
    scope: &'a Scope,
    key: &'a IdempotencyKey,
    fingerprint: Fingerprint,
    lease: Duration,
    on_lease_expiry: LeaseExpiry,
) -> ReserveRequest<'a> {
    ReserveRequest {
        scope,
        key,
        fingerprint,
        owner: OwnerToken::random(),
        lease,
        retention: DAY,
        on_lease_expiry,
    }
}

/// A response with binary body bytes and headers, to check they survive.
pub fn sample_response(status: u16, tag: &str) -> StoredResponse {
    let mut body = tag.as_bytes().to_vec();
    body.extend_from_slice(&[0, 0xff, 0xfe, b'\n']);
    StoredResponse::new(status, body)
        .with_header("content-type", "application/octet-stream")
        .with_header("x-tag", Bytes::copy_from_slice(tag.as_bytes()))
}

fn outcome(verdict: Verdict, tag: &str, retention: Duration) -> FinalOutcome {
    FinalOutcome {
        verdict,
        response: sample_response(
            if verdict == Verdict::Completed {
                201
            } else {
                422
            },
            tag,
        ),
        resource_id: Some(format!("res-{tag}")),
        error_code: (verdict == Verdict::Failed).then(|| "declined".to_owned()),
        retention,
    }
}

async fn acquire<S: Store>(store: &S, req: ReserveRequest<'_>) -> Lease {
    match store.reserve(req).await.expect("reserve") {
        Reservation::Acquired(lease) => lease,
        other => panic!("expected Acquired, got {other:?}"),
    }
}

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
pub async fn lease_takeover_and_hold<S: Store>(store: Arc<S>) {
    let scope = unique_scope("lease");
    let k = key("lease-retry");
    let first = acquire(
        &*store,
        request(&scope, &k, fp("a"), SHORT_LEASE, LeaseExpiry::Retry),
    )
    .await;
    match store
        .reserve(request(
            &scope,
            &k,
            fp("a"),
            SHORT_LEASE,
            LeaseExpiry::Retry,
        ))
        .await
        .expect("reserve")
    {
        Reservation::InProgress {
            retry_after,
            outcome_unknown,
        } => {
            assert!(retry_after <= SHORT_LEASE, "{retry_after:?}");
            assert!(!outcome_unknown);
        }
        other => panic!("expected InProgress, got {other:?}"),
    }
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
pub async fn outcome_unknown_is_kept<S: Store>(store: Arc<S>) {
    let scope = unique_scope("unknown");
    let k = key("unknown");
    let lease = acquire(
        &*store,
        request(&scope, &k, fp("a"), SHORT_LEASE, LeaseExpiry::Retry),
    )
    .await;
    store
        .mark_unknown(&scope, &k, &lease, "provider timeout")
        .await
        .expect("mark");
    let rec = store.get(&scope, &k).await.expect("get").expect("exists");
    assert_eq!(rec.state, RecordState::Processing);
    assert_eq!(rec.error_code.as_deref(), Some(OUTCOME_UNKNOWN));
    assert!(rec.is_outcome_unknown());
    match store
        .reserve(request(
            &scope,
            &k,
            fp("a"),
            SHORT_LEASE,
            LeaseExpiry::Retry,
        ))
        .await
        .expect("reserve")
    {
        Reservation::InProgress {
            outcome_unknown, ..
        } => assert!(outcome_unknown),
        other => panic!("expected InProgress, got {other:?}"),
    }
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

/// Listing filters by tenant, state and age, pages without gaps or
/// repeats, and reports records oldest first.
pub async fn list_filters_and_pages<S: Store + ListRecords>(store: Arc<S>) {
    let scope = unique_scope("list");
    let mut all = Vec::new();
    for i in 0..5 {
        let k = key(&format!("list-{i}"));
        let lease = acquire(
            &*store,
            request(&scope, &k, fp("a"), DAY, LeaseExpiry::Retry),
        )
        .await;
        if i < 3 {
            store
                .resolve(&scope, &k, &lease, &outcome(Verdict::Completed, "l", DAY))
                .await
                .expect("resolve");
        }
        all.push(k);
        tokio::time::sleep(Duration::from_millis(3)).await;
    }
    let tenant = Some(scope.tenant().to_owned());
    let mut seen = Vec::new();
    let mut after: Option<Cursor> = None;
    let mut pages = 0;
    loop {
        let page = store
            .list(&ListFilter {
                tenant: tenant.clone(),
                limit: 2,
                after: after.clone(),
                ..ListFilter::default()
            })
            .await
            .expect("list");
        assert!(page.records.len() <= 2);
        seen.extend(page.records.iter().map(|r| r.key.clone()));
        pages += 1;
        assert!(pages < 10, "paging does not end");
        match page.next {
            Some(c) => after = Some(c),
            None => break,
        }
    }
    assert_eq!(seen, all, "every record once, oldest first");

    let processing = store
        .list(&ListFilter {
            tenant: tenant.clone(),
            state: Some(RecordState::Processing),
            limit: 100,
            ..ListFilter::default()
        })
        .await
        .expect("list");
    assert_eq!(processing.records.len(), 2);
    assert!(
        processing
            .records
            .iter()
            .all(|r| r.state == RecordState::Processing)
    );
    assert!(processing.next.is_none());

    let old = store
        .list(&ListFilter {
            tenant: tenant.clone(),
            older_than: Some(Duration::from_secs(3600)),
            limit: 100,
            ..ListFilter::default()
        })
        .await
        .expect("list");
    assert!(old.records.is_empty());
    tokio::time::sleep(Duration::from_millis(30)).await;
    let recent = store
        .list(&ListFilter {
            tenant,
            older_than: Some(Duration::from_millis(20)),
            limit: 100,
            ..ListFilter::default()
        })
        .await
        .expect("list");
    assert_eq!(recent.records.len(), 5);
}

/// One list call returns at most [`MAX_PAGE`] records, whatever limit it
/// asks for, and a cursor to the rest; a limit of 0 reads as 1.
pub async fn list_pages_are_bounded<S: Store + ListRecords>(store: Arc<S>) {
    let scope = unique_scope("list-bound");
    let mut tasks = JoinSet::new();
    for worker in 0..8 {
        let (store, scope) = (store.clone(), scope.clone());
        tasks.spawn(async move {
            for i in (worker..=MAX_PAGE).step_by(8) {
                let k = key(&format!("bound-{i}"));
                acquire(
                    &*store,
                    request(&scope, &k, fp("a"), DAY, LeaseExpiry::Retry),
                )
                .await;
            }
        });
    }
    while let Some(done) = tasks.join_next().await {
        done.expect("reserve task");
    }
    let tenant = Some(scope.tenant().to_owned());
    let first = store
        .list(&ListFilter {
            tenant: tenant.clone(),
            limit: usize::MAX,
            ..ListFilter::default()
        })
        .await
        .expect("list");
    assert_eq!(first.records.len(), MAX_PAGE, "a page is capped");
    let rest = store
        .list(&ListFilter {
            tenant: tenant.clone(),
            limit: usize::MAX,
            after: Some(first.next.expect("a cursor to the rest")),
            ..ListFilter::default()
        })
        .await
        .expect("list");
    assert_eq!(rest.records.len(), 1, "the record past the cap");
    assert!(rest.next.is_none());
    let one = store
        .list(&ListFilter {
            tenant,
            limit: 0,
            ..ListFilter::default()
        })
        .await
        .expect("list");
    assert_eq!(one.records.len(), 1, "a limit of 0 reads as 1");
}

/// Through the engine: many concurrent callers of one key run the work
/// exactly once; with `InFlight::Wait`, all the others get the replay.
pub async fn engine_runs_work_once<S: Store>(store: Arc<S>) {
    const CALLERS: usize = 64;
    let scope = unique_scope("engine");
    let k = key("once");
    let engine = Engine::from_arc(store)
        .with_policy(Policy::default().with_on_in_flight(InFlight::Wait(Duration::from_secs(10))));
    let executions = Arc::new(AtomicU32::new(0));
    let barrier = Arc::new(tokio::sync::Barrier::new(CALLERS));
    let mut tasks = JoinSet::new();
    for _ in 0..CALLERS {
        let (engine, scope, k, executions, barrier) = (
            engine.clone(),
            scope.clone(),
            k.clone(),
            Arc::clone(&executions),
            Arc::clone(&barrier),
        );
        tasks.spawn(async move {
            barrier.wait().await;
            engine
                .run(&scope, &k, fp("same"), || async {
                    executions.fetch_add(1, Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    StoredResponse::new(201, "made")
                })
                .await
                .expect("run")
        });
    }
    let (mut executed, mut replayed) = (0, 0);
    while let Some(joined) = tasks.join_next().await {
        match joined.expect("task") {
            Run::Executed(r) => {
                assert_eq!(&r.body[..], b"made");
                executed += 1;
            }
            Run::Replayed(r) => {
                assert_eq!(&r.response.body[..], b"made");
                replayed += 1;
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(executions.load(Ordering::SeqCst), 1);
    assert_eq!((executed, replayed), (1, CALLERS - 1));
}

/// Through the engine: a heartbeat keeps slow work's record from being
/// taken over; without one, the lapsed lease is taken over under `Retry`
/// (a re-run, said so on the guard) and the stale owner's answer is
/// refused.
pub async fn engine_heartbeat_protects_slow_work<S: Store>(store: Arc<S>) {
    // The heartbeat renews every third of the lease, so each renewal has
    // two thirds of it to land: 1 s here, not the 200 ms of a
    // [`SHORT_LEASE`], which one stalled fsync on a loaded machine spends.
    const HEARTBEAT_LEASE: Duration = Duration::from_millis(1500);
    let scope = unique_scope("heartbeat");
    let beating = Engine::from_arc(Arc::clone(&store)).with_policy(
        Policy::default()
            .with_lease(HEARTBEAT_LEASE)
            .with_on_lease_expiry(LeaseExpiry::Retry),
    );
    let engine = Engine::from_arc(store).with_policy(
        Policy::default()
            .with_lease(SHORT_LEASE)
            .with_on_lease_expiry(LeaseExpiry::Retry),
    );

    let k = key("slow-with-heartbeat");
    let idem::Begin::Execute(mut guard) = beating.begin(&scope, &k, fp("a")).await.expect("begin")
    else {
        panic!("first begin executes");
    };
    guard.keep_alive();
    tokio::time::sleep(HEARTBEAT_LEASE * 3).await;
    assert!(matches!(
        beating.begin(&scope, &k, fp("a")).await.expect("begin"),
        idem::Begin::InProgress { .. }
    ));
    assert!(!guard.lease_lost());
    guard
        .complete(StoredResponse::new(200, "slow"))
        .await
        .expect("complete");

    let k = key("slow-without-heartbeat");
    let idem::Begin::Execute(zombie) = engine.begin(&scope, &k, fp("a")).await.expect("begin")
    else {
        panic!("first begin executes");
    };
    tokio::time::sleep(PAST_SHORT_LEASE).await;
    let idem::Begin::Execute(second) = engine.begin(&scope, &k, fp("a")).await.expect("begin")
    else {
        panic!("lapsed lease is taken over");
    };
    assert_eq!(second.attempt(), 2);
    let rerun = second.rerun().expect("a takeover is a re-run");
    assert_eq!(
        (rerun.attempt, rerun.reason),
        (2, idem::RerunReason::LeaseLapsed)
    );
    assert!(rerun.held_for.is_some_and(|d| d >= SHORT_LEASE));
    assert!(matches!(
        zombie.complete(StoredResponse::new(200, "zombie")).await,
        Err(idem::RecordError::LeaseLost)
    ));
    second
        .complete(StoredResponse::new(200, "second"))
        .await
        .expect("complete");
    let rec = engine
        .store()
        .get(&scope, &k)
        .await
        .expect("get")
        .expect("exists");
    assert_eq!(
        rec.response.map(|r| r.body),
        Some(Bytes::from_static(b"second"))
    );
}

/// Through the engine: a guard dropped without a decision (a crash, a
/// cancelled request) keeps the record. By default its lapsed lease holds
/// it (the outcome is unknown, nothing runs again); under `Retry` the
/// next attempt takes it over.
pub async fn engine_dropped_guard_keeps_record<S: Store>(store: Arc<S>) {
    let scope = unique_scope("dropped");
    let policy = Policy::default().with_lease(SHORT_LEASE);
    let held = Engine::from_arc(Arc::clone(&store)).with_policy(policy.clone());
    let retry =
        Engine::from_arc(store).with_policy(policy.with_on_lease_expiry(LeaseExpiry::Retry));
    for (k, engine) in [("dropped-held", &held), ("dropped-retry", &retry)] {
        let k = key(k);
        match engine.begin(&scope, &k, fp("a")).await.expect("begin") {
            idem::Begin::Execute(mut guard) => {
                guard.keep_alive();
                drop(guard);
            }
            other => panic!("expected Execute, got {other:?}"),
        }
        assert!(matches!(
            engine.begin(&scope, &k, fp("a")).await.expect("begin"),
            idem::Begin::InProgress {
                outcome_unknown: false,
                ..
            }
        ));
    }
    tokio::time::sleep(PAST_SHORT_LEASE).await;
    match held
        .begin(&scope, &key("dropped-held"), fp("a"))
        .await
        .expect("begin")
    {
        idem::Begin::InProgress {
            outcome_unknown, ..
        } => assert!(outcome_unknown, "held: its owner stopped renewing"),
        other => panic!("the default never runs it again, got {other:?}"),
    }
    match retry
        .begin(&scope, &key("dropped-retry"), fp("a"))
        .await
        .expect("begin")
    {
        idem::Begin::Execute(guard) => assert_eq!(guard.attempt(), 2),
        other => panic!("expected a takeover, got {other:?}"),
    }
}

/// Generates one `#[tokio::test]` per conformance check for a backend.
///
/// `$fixture` is an async expression (evaluated once per test) producing a
/// [`Fixture`], or an `Option` of one where `None` skips the test (a server
/// is absent); give it the form `async { ... }`.
///
/// ```text
/// idem_testkit::store_conformance!(async { std::sync::Arc::new(idem::MemoryStore::new()) });
/// ```
#[macro_export]
macro_rules! store_conformance {
    ($fixture:expr) => {
        $crate::store_conformance!(@tests $fixture;
            reserve_complete_replay,
            failed_is_replayed,
            reservation_race,
            mismatch_in_every_state,
            lease_takeover_and_hold,
            fencing_of_stale_owner,
            release_frees_the_key,
            delete_removes_any_state,
            renew_extends_the_lease,
            outcome_unknown_is_kept,
            expiry_and_batched_purge,
            expired_record_is_replaced,
            list_filters_and_pages,
            list_pages_are_bounded,
            engine_runs_work_once,
            engine_heartbeat_protects_slow_work,
            engine_dropped_guard_keeps_record,
        );
    };
    (@tests $fixture:expr; $($check:ident),* $(,)?) => {
        $(
            #[::tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn $check() {
                let Some(fixture) = $crate::conformance::IntoFixture::into_fixture($fixture.await) else {
                    return;
                };
                let store = $crate::conformance::Fixture::store(&fixture);
                $crate::conformance::$check(store).await;
                drop(fixture);
            }
        )*
    };
}
