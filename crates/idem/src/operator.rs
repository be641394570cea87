//! What operators do to records, on any store: release a stuck key,
//! resolve an `outcome_unknown` record by hand, run batched cleanup, and
//! count processing and stuck records. Settling unknown outcomes with the
//! system of record automatically is [`crate::reconcile`]'s, through these
//! same fenced actions.
//!
//! The admin API and the `idem records` / `idem cleanup` commands are thin
//! layers over these functions, so both behave the same. Every change goes
//! through the store's fenced operations, so an operator can never
//! overwrite an answer an owner is recording at the same moment:
//!
//! * [`release`] deletes a processing record using the lease it read; if
//!   the owner resolved it meanwhile, the store fences the release out and
//!   the operator is told the record changed;
//! * [`resolve`] first takes the record over with an ordinary reservation
//!   (which succeeds only once the previous owner's lease lapsed, and
//!   fences that owner out), then records the answer under its own lease.
//!
//! ```
//! use std::time::Duration;
//! use idem::{FinalOutcome, Fingerprint, MemoryStore, Policy, Scope, StoredResponse, Verdict};
//! use idem::operator::{self, OperatorError};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let store = MemoryStore::new();
//! let scope = Scope::new("acme", "POST /v1/payments")?;
//! let key = "pay-1".parse()?;
//! // No such record: the operator is told so.
//! let err = operator::release(&store, &scope, &key, None).await.unwrap_err();
//! assert!(matches!(err, OperatorError::NotFound));
//! # Ok(())
//! # }
//! ```

use std::time::{Duration, Instant};

use crate::{
    FinalOutcome, IdempotencyKey, LeaseExpiry, ListFilter, ListRecords, OwnerToken, Purge, Record,
    RecordState, Reservation, ReserveRequest, Scope, Store, StoreError, Timestamp,
};

/// Why an operator's action was refused.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OperatorError {
    /// There is no such record (or it expired).
    #[error("no such record")]
    NotFound,
    /// The action needs a processing record and this one is final.
    #[error(
        "the record is {0}, not processing; only processing records can be released or resolved"
    )]
    NotProcessing(RecordState),
    /// An attempt still holds a live lease: its owner may be recording an
    /// answer right now.
    #[error(
        "an attempt still holds the record (lease live for another {} ms); retry after it lapses",
        .retry_after.as_millis()
    )]
    LeaseLive {
        /// When the lease lapses.
        retry_after: Duration,
    },
    /// The record changed between reading and acting (resolved, released,
    /// taken over); read it again.
    #[error("the record changed while acting on it; read it again")]
    Changed,
    /// The store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// Deletes a processing record so its key can be used again — for a record
/// whose work is known not to have happened. Returns the record as it was.
/// Works whether or not its lease is live: an owner still running is fenced
/// out when it tries to record its answer.
///
/// `expected_attempt` is the attempt the operator looked at (`None`: any).
/// If another attempt took the record over since — a client's retry that
/// may be running the work right now — nothing is released and the answer
/// is [`OperatorError::Changed`]: a verdict about one attempt must never
/// free the key under the next one.
pub async fn release<S: Store>(
    store: &S,
    scope: &Scope,
    key: &IdempotencyKey,
    expected_attempt: Option<u32>,
) -> Result<Record, OperatorError> {
    let record = processing_record(store, scope, key, expected_attempt).await?;
    match store.release(scope, key, &record.lease).await {
        Ok(()) => Ok(record),
        Err(StoreError::Fenced) => Err(OperatorError::Changed),
        Err(err) => Err(err.into()),
    }
}

/// The record, if it exists, is processing, and (when given) is still at
/// the expected attempt.
async fn processing_record<S: Store>(
    store: &S,
    scope: &Scope,
    key: &IdempotencyKey,
    expected_attempt: Option<u32>,
) -> Result<Record, OperatorError> {
    let record = store
        .get(scope, key)
        .await?
        .ok_or(OperatorError::NotFound)?;
    if record.state.is_final() {
        return Err(OperatorError::NotProcessing(record.state));
    }
    if expected_attempt.is_some_and(|a| a != record.lease.attempt) {
        return Err(OperatorError::Changed);
    }
    Ok(record)
}

/// How long an operator's takeover holds the record while it records the
/// answer.
const OPERATOR_LEASE: Duration = Duration::from_secs(30);

/// Records a final answer for a processing record — typically one marked
/// `outcome_unknown`, once the operator (or a
/// [`Reconciler`](crate::reconcile::Reconciler)) learned what
/// really happened. Returns the resolved record.
///
/// The record must not be held by a live lease ([`OperatorError::LeaseLive`]
/// otherwise): the operator takes it over as the next attempt, which fences
/// the previous owner out, and records the answer under that new lease.
/// `expected_attempt` works as for [`release`].
pub async fn resolve<S: Store>(
    store: &S,
    scope: &Scope,
    key: &IdempotencyKey,
    outcome: &FinalOutcome,
    expected_attempt: Option<u32>,
) -> Result<Record, OperatorError> {
    let record = processing_record(store, scope, key, expected_attempt).await?;
    let reservation = store
        .reserve(ReserveRequest {
            scope,
            key,
            fingerprint: record.fingerprint,
            owner: OwnerToken::random(),
            lease: OPERATOR_LEASE,
            retention: outcome.retention,
            on_lease_expiry: LeaseExpiry::Retry,
        })
        .await?;
    let lease = match reservation {
        // Taken over from exactly the attempt examined: nobody slipped in.
        Reservation::Acquired(lease) if lease.attempt == record.lease.attempt + 1 => lease,
        Reservation::Acquired(lease) => {
            // The record vanished in between and this created a fresh one:
            // undo that, there is nothing to resolve.
            store.release(scope, key, &lease).await?;
            return Err(if lease.attempt == 1 {
                OperatorError::NotFound
            } else {
                OperatorError::Changed
            });
        }
        Reservation::InProgress { retry_after, .. } => {
            return Err(OperatorError::LeaseLive { retry_after });
        }
        Reservation::Existing(_) | Reservation::Mismatch { .. } => {
            return Err(OperatorError::Changed);
        }
    };
    match store.resolve(scope, key, &lease, outcome).await {
        Ok(()) => {}
        Err(StoreError::Fenced) => return Err(OperatorError::Changed),
        Err(err) => return Err(err.into()),
    }
    store.get(scope, key).await?.ok_or(OperatorError::Changed)
}

/// What one cleanup run did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CleanupReport {
    /// Records deleted.
    pub deleted: u64,
    /// Batches run (each one its own transaction).
    pub batches: u64,
    /// Whether the run stopped at its time budget with work possibly left.
    pub stopped_early: bool,
}

/// Deletes expired completed and failed records in batches of `batch`
/// until none are left or `budget` is spent, calling `progress` with the
/// running total after each batch. Never touches a processing record.
///
/// Each batch commits on its own: a run interrupted at any point (signal,
/// crash) has deleted only expired records, and the next run carries on.
pub async fn cleanup<S: Purge>(
    store: &S,
    batch: usize,
    budget: Option<Duration>,
    progress: impl FnMut(u64),
) -> Result<CleanupReport, StoreError> {
    cleanup_paced(store, batch, budget, 1.0, progress).await
}

/// Like [`cleanup`], but spending at most `share` (0 < share ≤ 1) of the
/// wall-clock time deleting: after each batch it pauses for the batch's
/// duration × (1/share − 1). A gateway that cleans up while serving uses
/// this, so that deletions — which share the store's commits with the
/// serving writes (on SQLite, its single writer) — cannot crowd them out.
pub async fn cleanup_paced<S: Purge>(
    store: &S,
    batch: usize,
    budget: Option<Duration>,
    share: f64,
    mut progress: impl FnMut(u64),
) -> Result<CleanupReport, StoreError> {
    let batch = batch.max(1);
    let share = if share.is_finite() {
        share.clamp(0.01, 1.0)
    } else {
        1.0
    };
    let started = Instant::now();
    let mut report = CleanupReport::default();
    loop {
        let began = Instant::now();
        let deleted = store.purge_expired(batch).await?;
        report.deleted += deleted;
        report.batches += 1;
        progress(report.deleted);
        if (deleted as usize) < batch {
            return Ok(report);
        }
        if budget.is_some_and(|b| started.elapsed() >= b) {
            report.stopped_early = true;
            return Ok(report);
        }
        // Let serving traffic in between batches.
        if share < 1.0 {
            tokio::time::sleep(began.elapsed().mul_f64(1.0 / share - 1.0)).await;
        } else {
            tokio::task::yield_now().await;
        }
    }
}

/// Processing records right now, and how many of them look stuck.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Census {
    /// Processing records (counted up to the scan cap).
    pub processing: u64,
    /// Processing records created more than `stuck_after` ago whose lease
    /// is no longer renewed (no live owner): they need a retry, a
    /// reconciler or an operator.
    pub stuck: u64,
    /// Of those, the ones marked `outcome_unknown`.
    pub outcome_unknown: u64,
    /// Whether the scan stopped at its cap (the counts are lower bounds).
    pub capped: bool,
}

/// Counts processing and stuck records, reading at most `cap` of them.
pub async fn census<S: ListRecords>(
    store: &S,
    stuck_after: Duration,
    cap: usize,
) -> Result<Census, StoreError> {
    let now = Timestamp::now();
    let mut census = Census::default();
    let mut filter = ListFilter {
        state: Some(RecordState::Processing),
        limit: cap.clamp(1, 1000),
        ..ListFilter::default()
    };
    let mut seen = 0usize;
    loop {
        let page = store.list(&filter).await?;
        for record in &page.records {
            census.processing += 1;
            if is_stuck(record, stuck_after, now) {
                census.stuck += 1;
                census.outcome_unknown += u64::from(record.is_outcome_unknown());
            }
        }
        seen += page.records.len();
        match page.next {
            Some(next) if seen < cap => filter.after = Some(next),
            Some(_) => {
                census.capped = true;
                return Ok(census);
            }
            None => return Ok(census),
        }
    }
}

/// Whether a processing record counts as stuck at `now`.
pub fn is_stuck(record: &Record, stuck_after: Duration, now: Timestamp) -> bool {
    record.state == RecordState::Processing
        && !record.lease_live(now)
        && record.created_at <= now.minus(stuck_after)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Fingerprint, MemoryStore, StoredResponse, Verdict};

    fn scope() -> Scope {
        Scope::new("t", "POST /v1/payments").expect("scope")
    }

    fn key(k: &str) -> IdempotencyKey {
        k.parse().expect("key")
    }

    fn fp() -> Fingerprint {
        Fingerprint::builder().part("body", b"x").finish()
    }

    async fn reserve(store: &MemoryStore, k: &str, lease: Duration) -> crate::Lease {
        match store
            .reserve(ReserveRequest {
                scope: &scope(),
                key: &key(k),
                fingerprint: fp(),
                owner: OwnerToken::random(),
                lease,
                retention: Duration::from_secs(60),
                on_lease_expiry: LeaseExpiry::Retry,
            })
            .await
            .expect("reserve")
        {
            Reservation::Acquired(lease) => lease,
            other => panic!("expected a fresh reservation, got {other:?}"),
        }
    }

    fn answer(status: u16) -> FinalOutcome {
        FinalOutcome {
            verdict: Verdict::Completed,
            response: StoredResponse::new(status, "charged"),
            resource_id: Some("pay_1".into()),
            error_code: None,
            retention: Duration::from_secs(60),
        }
    }

    #[tokio::test]
    async fn release_only_processing_records() {
        let store = MemoryStore::new();
        let lease = reserve(&store, "a", Duration::from_secs(30)).await;
        let released = release(&store, &scope(), &key("a"), None)
            .await
            .expect("release");
        assert_eq!(released.lease, lease);
        assert_eq!(store.get(&scope(), &key("a")).await.expect("get"), None);
        // The owner that was running is fenced out.
        assert!(matches!(
            store
                .resolve(&scope(), &key("a"), &lease, &answer(201))
                .await,
            Err(StoreError::Fenced)
        ));

        let lease = reserve(&store, "b", Duration::from_secs(30)).await;
        store
            .resolve(&scope(), &key("b"), &lease, &answer(201))
            .await
            .expect("resolve");
        assert!(matches!(
            release(&store, &scope(), &key("b"), None).await,
            Err(OperatorError::NotProcessing(RecordState::Completed))
        ));
        assert!(matches!(
            release(&store, &scope(), &key("none"), None).await,
            Err(OperatorError::NotFound)
        ));
    }

    #[tokio::test]
    async fn resolve_waits_for_the_lease_and_fences_the_owner() {
        let store = MemoryStore::new();
        let lease = reserve(&store, "a", Duration::from_millis(1000)).await;
        assert!(matches!(
            resolve(&store, &scope(), &key("a"), &answer(201), None).await,
            Err(OperatorError::LeaseLive { .. })
        ));
        tokio::time::sleep(Duration::from_millis(1100)).await;
        let record = resolve(&store, &scope(), &key("a"), &answer(201), Some(1))
            .await
            .expect("resolve");
        assert_eq!(record.state, RecordState::Completed);
        assert_eq!(record.resource_id.as_deref(), Some("pay_1"));
        assert_eq!(record.lease.attempt, 2, "taken over as the next attempt");
        // The old owner's late answer cannot overwrite the operator's.
        assert!(matches!(
            store
                .resolve(&scope(), &key("a"), &lease, &answer(500))
                .await,
            Err(StoreError::Fenced)
        ));
        assert!(matches!(
            resolve(&store, &scope(), &key("a"), &answer(201), None).await,
            Err(OperatorError::NotProcessing(RecordState::Completed))
        ));
    }

    /// A verdict about attempt 1 must not touch attempt 2, which a client's
    /// retry started meanwhile and which may be running the work.
    #[tokio::test]
    async fn actions_on_an_examined_attempt_never_touch_the_next() {
        let store = MemoryStore::new();
        reserve(&store, "a", Duration::from_millis(1)).await;
        tokio::time::sleep(Duration::from_millis(5)).await;
        // The retry takes the lapsed record over as attempt 2.
        let retry = match store
            .reserve(ReserveRequest {
                scope: &scope(),
                key: &key("a"),
                fingerprint: fp(),
                owner: OwnerToken::random(),
                lease: Duration::from_millis(1),
                retention: Duration::from_secs(60),
                on_lease_expiry: LeaseExpiry::Retry,
            })
            .await
            .expect("reserve")
        {
            Reservation::Acquired(lease) => lease,
            other => panic!("{other:?}"),
        };
        assert_eq!(retry.attempt, 2);
        tokio::time::sleep(Duration::from_millis(5)).await;
        assert!(matches!(
            release(&store, &scope(), &key("a"), Some(1)).await,
            Err(OperatorError::Changed)
        ));
        assert!(matches!(
            resolve(&store, &scope(), &key("a"), &answer(201), Some(1)).await,
            Err(OperatorError::Changed)
        ));
        let kept = store
            .get(&scope(), &key("a"))
            .await
            .expect("get")
            .expect("kept");
        assert_eq!(
            (kept.state, kept.lease.attempt),
            (RecordState::Processing, 2)
        );
        release(&store, &scope(), &key("a"), Some(2))
            .await
            .expect("the examined attempt");
    }

    #[tokio::test]
    async fn cleanup_runs_in_batches_and_keeps_processing_records() {
        let store = MemoryStore::new();
        for i in 0..25 {
            let k = format!("done-{i}");
            let lease = reserve(&store, &k, Duration::from_secs(30)).await;
            let mut outcome = answer(201);
            outcome.retention = Duration::ZERO;
            store
                .resolve(&scope(), &key(&k), &lease, &outcome)
                .await
                .expect("resolve");
        }
        reserve(&store, "busy", Duration::from_millis(1)).await;
        tokio::time::sleep(Duration::from_millis(5)).await;
        let mut seen = Vec::new();
        let report = cleanup(&store, 10, None, |n| seen.push(n))
            .await
            .expect("cleanup");
        assert_eq!(report.deleted, 25);
        assert_eq!(report.batches, 3);
        assert_eq!(seen, [10, 20, 25]);
        assert!(!report.stopped_early);
        let busy = store.get(&scope(), &key("busy")).await.expect("get");
        assert!(busy.is_some(), "a processing record is never purged");
    }

    use crate::reconcile::{ReconcileReport, Reconciled, Reconciler, reconcile};
    use crate::store::BoxError;

    struct Provider;

    impl Reconciler for Provider {
        async fn reconcile(&self, record: &Record) -> Result<Reconciled, BoxError> {
            match record.key.as_str() {
                "charged" => Ok(Reconciled::Done(answer(201))),
                "never" => Ok(Reconciled::NotDone),
                "asleep" => Ok(Reconciled::Unknown),
                _ => Err("provider timed out".into()),
            }
        }
    }

    #[tokio::test]
    async fn census_and_reconcile_stuck_records() {
        let store = MemoryStore::new();
        for k in ["charged", "never", "asleep", "broken"] {
            reserve(&store, k, Duration::from_millis(1)).await;
        }
        reserve(&store, "live", Duration::from_secs(30)).await;
        tokio::time::sleep(Duration::from_millis(20)).await;
        let c = census(&store, Duration::from_millis(10), 100)
            .await
            .expect("census");
        assert_eq!((c.processing, c.stuck, c.capped), (5, 4, false));
        let capped = census(&store, Duration::from_millis(10), 2)
            .await
            .expect("census");
        assert!(capped.capped);

        let report = reconcile(&store, &Provider, Duration::from_millis(10), 100)
            .await
            .expect("reconcile");
        assert_eq!(
            report,
            ReconcileReport {
                examined: 4,
                resolved: 1,
                released: 1,
                left: 2
            }
        );
        let charged = store.get(&scope(), &key("charged")).await.expect("get");
        assert_eq!(charged.map(|r| r.state), Some(RecordState::Completed));
        assert_eq!(store.get(&scope(), &key("never")).await.expect("get"), None);
        let live = store.get(&scope(), &key("live")).await.expect("get");
        assert_eq!(live.map(|r| r.state), Some(RecordState::Processing));
    }
}
