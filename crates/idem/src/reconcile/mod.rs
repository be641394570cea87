//! Settling held records with the system of record.
//!
//! A record is *held* when an attempt may have taken effect and nobody is
//! running it: its outcome was marked unknown (a timeout or a broken answer
//! after the request was sent), or its owner stopped renewing its lease
//! under [`LeaseExpiry::Hold`](crate::LeaseExpiry::Hold), the default.
//! Held records are never run again on their own. A [`Reconciler`] asks
//! the system of record what became of one; a [`Reconciliation`] does so
//! in the background, with backoff, for every held record it hears of or
//! finds, and applies the verdict through the same fenced actions as an
//! operator:
//!
//! * [`Reconciled::Done`]: the record is completed (or failed) with that
//!   answer, so the client's retry gets it as a replay;
//! * [`Reconciled::NotDone`]: the key is released and the client's retry
//!   runs the work. Believed only once the attempt has been quiet for the
//!   [`Schedule::settle`] time: a request abandoned a moment ago may still be
//!   on its way to taking effect;
//! * [`Reconciled::Unknown`] or an error: asked again later, until
//!   [`Schedule::give_up`]; then the record stays held for an operator and
//!   counts as stuck.
//!
//! ```
//! use std::sync::Arc;
//! use std::time::Duration;
//! use idem::reconcile::{Reconciled, Reconciler, Reconciliation, Schedule};
//! use idem::store::BoxError;
//! use idem::{MemoryStore, Record, Scope};
//!
//! /// Asks the payment provider by the key the work sent along.
//! struct Provider;
//!
//! impl Reconciler for Provider {
//!     async fn reconcile(&self, record: &Record) -> Result<Reconciled, BoxError> {
//!         let _charge_id = format!("{}:{}", record.scope.tenant(), record.key);
//!         Ok(Reconciled::Unknown) // ask the provider here
//!     }
//!
//!     fn schedule(&self, scope: &Scope) -> Option<Schedule> {
//!         (scope.operation() == "charge").then(|| Schedule::default().with_settle(Duration::from_secs(60)))
//!     }
//! }
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! let reconciliation = Reconciliation::new(Arc::new(MemoryStore::new()), Provider)
//!     .with_scan_every(Some(Duration::from_secs(10)));
//! let _task = reconciliation.spawn(); // runs until the last handle is dropped
//! # }
//! ```

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::task::{JoinHandle, JoinSet};
use tokio::time::Instant;

use crate::operator::{self, OperatorError};
use crate::store::BoxError;
use crate::{
    FinalOutcome, IdempotencyKey, Lease, ListFilter, ListRecords, Page, Record, RecordState, Scope,
    Store, StoreError, Timestamp,
};

mod background;
mod schedule;

pub use background::{MAX_FOLLOWED, Reconciliation};
pub use schedule::{Schedule, Settled};

/// What the system of record says about an operation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reconciled {
    /// It happened (or failed deterministically): record this answer.
    Done(FinalOutcome),
    /// It never happened: free the key so a retry runs it.
    NotDone,
    /// Still unknown: leave the record as it is and ask again later.
    Unknown,
}

/// Asks the system of record (a payment provider, a downstream service)
/// what became of an operation whose outcome is unknown, by a stable id
/// derived from the record (e.g. `tenant:key`, the id the work sent along).
pub trait Reconciler: Send + Sync + 'static {
    /// Looks `record` up; errors leave the record for the next round.
    fn reconcile(
        &self,
        record: &Record,
    ) -> impl Future<Output = Result<Reconciled, BoxError>> + Send;

    /// How records of `scope` are reconciled by a [`Reconciliation`], or
    /// `None` when they are not this reconciler's: they stay held for an
    /// operator. Default: every record, on the default [`Schedule`].
    fn schedule(&self, scope: &Scope) -> Option<Schedule> {
        let _ = scope;
        Some(Schedule::default())
    }

    /// Told once a [`Reconciliation`] settled a record, or gave up on it
    /// (for metrics; the reconciliation logs it already).
    fn settled(&self, record: &Record, how: Settled) {
        let _ = (record, how);
    }

    /// Told when a [`Reconciliation`] stops following a record, for any
    /// reason (settled, settled by someone else, taken over, given up and
    /// no longer held), so that whatever the reconciler keeps per record
    /// can go.
    fn forget(&self, scope: &Scope, key: &IdempotencyKey) {
        let _ = (scope, key);
    }
}

/// What one reconciliation round did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ReconcileReport {
    /// Stuck records looked at.
    pub examined: u64,
    /// Resolved with the answer the reconciler found.
    pub resolved: u64,
    /// Released (the work never happened).
    pub released: u64,
    /// Left alone: still unknown, a live lease, a reconciler error, or a
    /// record that changed meanwhile.
    pub left: u64,
}

/// One reconciliation round: every stuck processing record (see
/// [`operator::is_stuck`]; at most `cap`) goes to the reconciler, and its verdict is
/// applied through [`operator::resolve`] or [`operator::release`], fenced like any operator
/// action.
pub async fn reconcile<S, R>(
    store: &S,
    reconciler: &R,
    stuck_after: Duration,
    cap: usize,
) -> Result<ReconcileReport, StoreError>
where
    S: ListRecords,
    R: Reconciler,
{
    let now = Timestamp::now();
    let mut report = ReconcileReport::default();
    let mut filter = ListFilter {
        state: Some(RecordState::Processing),
        older_than: Some(stuck_after),
        limit: cap.clamp(1, 1000),
        ..ListFilter::default()
    };
    loop {
        let page = store.list(&filter).await?;
        for record in page
            .records
            .iter()
            .filter(|r| operator::is_stuck(r, stuck_after, now))
        {
            if report.examined as usize >= cap {
                return Ok(report);
            }
            report.examined += 1;
            // Act only on the attempt the reconciler was asked about.
            let attempt = Some(record.lease.attempt);
            let applied = match reconciler.reconcile(record).await {
                Ok(Reconciled::Done(outcome)) => {
                    operator::resolve(store, &record.scope, &record.key, &outcome, attempt)
                        .await
                        .map(|_| &mut report.resolved)
                }
                Ok(Reconciled::NotDone) => {
                    operator::release(store, &record.scope, &record.key, attempt)
                        .await
                        .map(|_| &mut report.released)
                }
                Ok(Reconciled::Unknown) => Ok(&mut report.left),
                Err(err) => {
                    tracing::warn!(reason = "idempotency_reconcile_failed", tenant = record.scope.tenant(), operation = record.scope.operation(), key = %record.key, %err);
                    Ok(&mut report.left)
                }
            };
            match applied {
                Ok(counter) => *counter += 1,
                Err(OperatorError::Store(err)) => return Err(err),
                Err(err) => {
                    tracing::info!(reason = "idempotency_reconcile_skipped", tenant = record.scope.tenant(), operation = record.scope.operation(), key = %record.key, %err);
                    report.left += 1;
                }
            }
        }
        match page.next {
            Some(next) => filter.after = Some(next),
            None => return Ok(report),
        }
    }
}
