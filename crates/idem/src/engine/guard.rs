//! The guard: one attempt's ownership of a record, its heartbeat, and
//! the decision it records.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tokio::task::JoinHandle;

use super::waiters::Waiters;
use crate::store::{FinalOutcome, Store, StoreError, Verdict};
use crate::{IdempotencyKey, Lease, Policy, Resolution, Scope, StoredResponse};

/// Why a finished attempt's answer was not recorded. The work **was done**:
/// callers still return its answer to their client.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RecordError {
    /// Another attempt took the lease over before this one finished (the
    /// work ran longer than its lease without a heartbeat), or the record
    /// was released by an operator.
    #[error("lease lost before the answer could be recorded")]
    LeaseLost,
    /// The store kept failing; the record was marked
    /// [`OUTCOME_UNKNOWN`](crate::OUTCOME_UNKNOWN) if `marked_unknown`.
    #[error(
        "the answer could not be recorded (record marked outcome_unknown: {marked_unknown}): {source}"
    )]
    NotRecorded {
        /// Whether the record now says `outcome_unknown`.
        marked_unknown: bool,
        /// The last store error.
        #[source]
        source: StoreError,
    },
}

/// Why an attempt runs work again (see [`Guard::rerun`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum RerunReason {
    /// The earlier attempt's outcome was marked unknown (a timeout or a
    /// broken answer after sending).
    OutcomeUnknown,
    /// The earlier attempt's owner stopped renewing its lease (it crashed,
    /// hung or was killed).
    LeaseLapsed,
}

impl RerunReason {
    /// The metric label and log value.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::OutcomeUnknown => "outcome_unknown",
            Self::LeaseLapsed => "lease_lapsed",
        }
    }
}

/// An attempt that took a lapsed record over under
/// [`LeaseExpiry::Retry`](crate::LeaseExpiry::Retry): the work may run a
/// second time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rerun {
    /// This attempt's number (2 or more).
    pub attempt: u32,
    /// Why the earlier attempt left the record.
    pub reason: RerunReason,
    /// How long the key had been taken, since the first attempt began
    /// (`None` if the record could not be read).
    pub held_for: Option<Duration>,
}

/// Ownership of one record for one attempt.
///
/// Record a decision with [`complete`](Self::complete), [`fail`](Self::fail),
/// [`release`](Self::release) or [`unknown`](Self::unknown). A guard dropped
/// without a decision (a panic, a cancelled request) does **not** release
/// the key: the lease simply runs out, and the policy's
/// [`LeaseExpiry`](crate::LeaseExpiry) decides what the next attempt may do.
/// Releasing would be wrong there, because the work may have had effects.
pub struct Guard<S: Store> {
    store: Arc<S>,
    policy: Arc<Policy>,
    scope: Scope,
    key: IdempotencyKey,
    lease: Lease,
    resource_id: Option<String>,
    error_code: Option<String>,
    heartbeat: Option<Heartbeat>,
    pub(super) rerun: Option<Rerun>,
    waiters: Arc<Waiters>,
}

impl<S: Store> fmt::Debug for Guard<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Guard")
            .field("scope", &self.scope)
            .field("key", &self.key)
            .field("lease", &self.lease)
            .field("heartbeat", &self.heartbeat.is_some())
            .finish_non_exhaustive()
    }
}

struct Heartbeat {
    task: JoinHandle<()>,
    lost: Arc<AtomicBool>,
}

impl<S: Store> Drop for Guard<S> {
    fn drop(&mut self) {
        if let Some(hb) = self.heartbeat.take() {
            hb.task.abort();
        }
        // Decided (every decision consumes the guard and ends here), or
        // given up: whoever waits on the key looks again.
        self.waiters.wake(&self.scope, &self.key);
    }
}

/// The cause recorded for an answer whose status proves nothing
/// ([`Resolution::Unknown`]).
const UNKNOWN_STATUS_CAUSE: &str = "the answer's status does not prove the work did not run";

const RECORD_FIRST_PAUSE: Duration = Duration::from_millis(20);
const RECORD_MAX_PAUSE: Duration = Duration::from_millis(500);

impl<S: Store> Guard<S> {
    pub(super) fn new(
        store: Arc<S>,
        policy: Arc<Policy>,
        waiters: Arc<Waiters>,
        scope: &Scope,
        key: &IdempotencyKey,
        lease: Lease,
    ) -> Self {
        Self {
            store,
            policy,
            scope: scope.clone(),
            key: key.clone(),
            lease,
            resource_id: None,
            error_code: None,
            heartbeat: None,
            rerun: None,
            waiters,
        }
    }

    /// Set when this attempt took a lapsed record over and so may run the
    /// work a second time (already logged as `idempotency_rerun`).
    pub fn rerun(&self) -> Option<&Rerun> {
        self.rerun.as_ref()
    }

    /// The lease this guard holds.
    pub fn lease(&self) -> &Lease {
        &self.lease
    }

    /// Which attempt this is (1 for the first; higher after takeovers).
    pub fn attempt(&self) -> u32 {
        self.lease.attempt
    }

    /// The record's scope.
    pub fn scope(&self) -> &Scope {
        &self.scope
    }

    /// The record's key.
    pub fn key(&self) -> &IdempotencyKey {
        &self.key
    }

    /// Names what the work created (a payment id…), stored with the answer.
    pub fn set_resource_id(&mut self, id: impl Into<String>) {
        self.resource_id = Some(id.into());
    }

    /// A machine-readable reason stored with the answer (e.g. a decline code).
    pub fn set_error_code(&mut self, code: impl Into<String>) {
        self.error_code = Some(code.into());
    }

    /// Whether a heartbeat found the lease taken over (the work should stop
    /// if it can: its answer will not be recorded).
    pub fn lease_lost(&self) -> bool {
        self.heartbeat
            .as_ref()
            .is_some_and(|hb| hb.lost.load(Ordering::Acquire))
    }

    /// Extends the lease by the policy's lease duration, now.
    pub async fn renew(&mut self) -> Result<(), StoreError> {
        let until = self
            .store
            .renew(&self.scope, &self.key, &self.lease, self.policy.lease)
            .await?;
        self.lease.locked_until = until;
        Ok(())
    }

    /// Starts a background heartbeat that renews the lease every third of
    /// its duration until the guard is resolved or dropped, so slow work is
    /// not taken over while its process lives. If the process dies, the
    /// heartbeat dies with it and the lease lapses as usual. Needs a Tokio
    /// runtime; calling it twice has no further effect.
    pub fn keep_alive(&mut self) {
        if self.heartbeat.is_some() {
            return;
        }
        let lost = Arc::new(AtomicBool::new(false));
        let task = tokio::spawn(heartbeat(
            Arc::clone(&self.store),
            self.scope.clone(),
            self.key.clone(),
            self.lease,
            self.policy.lease,
            Arc::clone(&lost),
        ));
        self.heartbeat = Some(Heartbeat { task, lost });
    }

    fn stop_heartbeat(&mut self) {
        if let Some(hb) = self.heartbeat.take() {
            hb.task.abort();
        }
    }

    /// Records success: the response is replayed to every later duplicate.
    pub async fn complete(self, response: StoredResponse) -> Result<(), RecordError> {
        self.record(Verdict::Completed, response).await
    }

    /// Records a deterministic failure: it is replayed, not retried.
    pub async fn fail(self, response: StoredResponse) -> Result<(), RecordError> {
        self.record(Verdict::Failed, response).await
    }

    /// Records the answer chosen by the policy for its status (complete,
    /// fail, release, or hold as an unknown outcome).
    pub async fn finish(self, response: StoredResponse) -> Result<(), RecordError> {
        let not_recorded = |source| RecordError::NotRecorded {
            marked_unknown: false,
            source,
        };
        match self.policy.resolution_for(response.status) {
            Resolution::Complete => self.complete(response).await,
            Resolution::Fail => self.fail(response).await,
            Resolution::Release => self.release().await.map_err(not_recorded),
            Resolution::Unknown => self
                .unknown(UNKNOWN_STATUS_CAUSE)
                .await
                .map_err(not_recorded),
        }
    }

    /// The outcome was recorded by other means with this guard's lease
    /// (the caller's own transaction, e.g. `PgStore::resolve_in` next to
    /// the business change): stops renewing the lease and lets go.
    pub fn recorded_elsewhere(mut self) {
        self.stop_heartbeat();
    }

    /// Frees the key: the work had no effect and may run again.
    pub async fn release(mut self) -> Result<(), StoreError> {
        self.stop_heartbeat();
        self.store
            .release(&self.scope, &self.key, &self.lease)
            .await
    }

    /// Marks the outcome unknown (the side effect may have happened, e.g. a
    /// timeout after sending). The record stays processing until reconciled
    /// or, under [`LeaseExpiry::Retry`](crate::LeaseExpiry::Retry), until its
    /// lease lapses and a retry takes over.
    pub async fn unknown(mut self, reason: &str) -> Result<(), StoreError> {
        self.stop_heartbeat();
        tracing::warn!(reason = "idempotency_outcome_unknown", tenant = self.scope.tenant(), operation = self.scope.operation(), key = %self.key, cause = reason);
        self.store
            .mark_unknown(&self.scope, &self.key, &self.lease, reason)
            .await
    }

    async fn record(
        mut self,
        verdict: Verdict,
        response: StoredResponse,
    ) -> Result<(), RecordError> {
        self.stop_heartbeat();
        let outcome = FinalOutcome {
            verdict,
            response,
            resource_id: self.resource_id.take(),
            error_code: self.error_code.take(),
            retention: self.policy.retention,
        };
        // The quick tries of the policy, and beyond them as long as half
        // the lease is not spent: an answer not recorded is work a retry
        // may run again once the lease lapses, so a store that is back
        // within that time (a restart, a failover) must still get it. The
        // other half of the lease is the margin before anyone may take the
        // key over.
        let budget = self.policy.lease / 2;
        let started = std::time::Instant::now();
        let mut pause = RECORD_FIRST_PAUSE;
        let mut attempt = 0;
        let source = loop {
            attempt += 1;
            match self
                .store
                .resolve(&self.scope, &self.key, &self.lease, &outcome)
                .await
            {
                Ok(()) => return Ok(()),
                Err(StoreError::Fenced) => return Err(RecordError::LeaseLost),
                Err(err) => {
                    tracing::warn!(%err, attempt, tenant = self.scope.tenant(), operation = self.scope.operation(), key = %self.key, "recording the answer failed");
                    let again =
                        attempt < self.policy.record_attempts || started.elapsed() + pause < budget;
                    if !err.is_transient() || !again {
                        break err;
                    }
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(RECORD_MAX_PAUSE);
                }
            }
        };
        let marked_unknown = self
            .store
            .mark_unknown(
                &self.scope,
                &self.key,
                &self.lease,
                "answer could not be recorded",
            )
            .await
            .is_ok();
        Err(RecordError::NotRecorded {
            marked_unknown,
            source,
        })
    }
}

async fn heartbeat<S: Store>(
    store: Arc<S>,
    scope: Scope,
    key: IdempotencyKey,
    lease: Lease,
    duration: Duration,
    lost: Arc<AtomicBool>,
) {
    let period = (duration / 3).max(Duration::from_millis(10));
    loop {
        tokio::time::sleep(period).await;
        match store.renew(&scope, &key, &lease, duration).await {
            Ok(_) => {}
            Err(StoreError::Fenced) => {
                tracing::warn!(tenant = scope.tenant(), operation = scope.operation(), %key, attempt = lease.attempt, "heartbeat: lease lost");
                lost.store(true, Ordering::Release);
                return;
            }
            Err(err) => {
                tracing::warn!(tenant = scope.tenant(), operation = scope.operation(), %key, %err, "heartbeat: renewing the lease failed")
            }
        }
    }
}
