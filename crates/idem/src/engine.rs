//! The engine: turns "a request with a key arrived" into exactly one
//! execution and replays for everyone else.
//!
//! ```
//! use idem::{Engine, Fingerprint, IdempotencyKey, MemoryStore, Run, Scope, StoredResponse};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let engine = Engine::new(MemoryStore::new());
//! let scope = Scope::new("tenant-a", "POST /v1/payments")?;
//! let key: IdempotencyKey = "pay-7".parse()?;
//! let fp = Fingerprint::builder().json_body(br#"{"amount":100}"#).finish();
//!
//! let first = engine
//!     .run(&scope, &key, fp, || async { StoredResponse::new(201, "charged once") })
//!     .await?;
//! assert!(matches!(first, Run::Executed(_)));
//!
//! let again = engine
//!     .run(&scope, &key, fp, || async { unreachable!("never runs twice") })
//!     .await?;
//! let Run::Replayed(replay) = again else { panic!("expected a replay") };
//! assert_eq!(&replay.response.body[..], b"charged once");
//! # Ok(())
//! # }
//! ```
//!
//! [`Engine::begin`] is the lower-level form: it hands out a [`Guard`] that
//! owns the record until the caller records a decision.

use std::fmt;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::store::{FinalOutcome, Reservation, ReserveRequest, Store, StoreError, Verdict};
use crate::{
    FailMode, Fingerprint, IdempotencyKey, InFlight, Lease, OwnerToken, Policy, Record,
    RecordState, Resolution, Scope, StoredResponse,
};

/// The idempotency engine over a store `S`. Cheap to clone; clones share the
/// store.
pub struct Engine<S> {
    store: Arc<S>,
    policy: Arc<Policy>,
    unacked: Arc<OnceLock<mpsc::Sender<Unacked>>>,
    waiters: Arc<Waiters>,
}

impl<S> fmt::Debug for Engine<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Engine")
            .field("store", &std::any::type_name::<S>())
            .field("policy", &self.policy)
            .finish()
    }
}

impl<S> Clone for Engine<S> {
    fn clone(&self) -> Self {
        Self {
            store: Arc::clone(&self.store),
            policy: Arc::clone(&self.policy),
            unacked: Arc::clone(&self.unacked),
            waiters: Arc::clone(&self.waiters),
        }
    }
}

/// A final answer found in the store, to be returned instead of running.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Replay {
    /// Completed or failed.
    pub state: RecordState,
    /// What to return.
    pub response: StoredResponse,
    /// What the original execution created, if it said.
    pub resource_id: Option<String>,
}

/// Where hashing v1, before keyed hashing, put a request's record: the
/// scope under its unkeyed tenant and its `v1:` fingerprint
/// ([`Engine::begin_accepting_v1`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct V1Address {
    /// The scope under the unkeyed tenant.
    pub scope: Scope,
    /// The `v1:` fingerprint.
    pub fingerprint: Fingerprint,
}

/// What [`Engine::begin`] decided.
pub enum Begin<S: Store> {
    /// This caller owns the record: do the work, then record a decision on
    /// the guard.
    Execute(Guard<S>),
    /// The same request finished before: return its answer.
    Replay(Replay),
    /// Another attempt is running (or, under [`LeaseExpiry::Hold`](crate::LeaseExpiry),
    /// ran and left no answer): ask again later.
    InProgress {
        /// When asking again is worthwhile.
        retry_after: Duration,
        /// Whether the earlier attempt's outcome is unknown.
        outcome_unknown: bool,
    },
    /// The key was used for a different request.
    Mismatch {
        /// State of the existing record.
        state: RecordState,
    },
    /// The store failed and the policy is [`FailMode::Open`]: run the work
    /// without protection (and count it).
    Unprotected(StoreError),
}

impl<S: Store> fmt::Debug for Begin<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Execute(guard) => f.debug_tuple("Execute").field(guard).finish(),
            Self::Replay(replay) => f.debug_tuple("Replay").field(replay).finish(),
            Self::InProgress {
                retry_after,
                outcome_unknown,
            } => f
                .debug_struct("InProgress")
                .field("retry_after", retry_after)
                .field("outcome_unknown", outcome_unknown)
                .finish(),
            Self::Mismatch { state } => f.debug_struct("Mismatch").field("state", state).finish(),
            Self::Unprotected(err) => f.debug_tuple("Unprotected").field(err).finish(),
        }
    }
}

/// What [`Engine::run`] did.
#[derive(Debug)]
pub enum Run {
    /// The work ran here and this is its answer.
    Executed(StoredResponse),
    /// The work ran before; this is the original answer.
    Replayed(Replay),
    /// Another attempt is running.
    InProgress {
        /// When asking again is worthwhile.
        retry_after: Duration,
        /// Whether the earlier attempt's outcome is unknown.
        outcome_unknown: bool,
    },
    /// The key was used for a different request; the work did not run.
    Mismatch {
        /// State of the existing record.
        state: RecordState,
    },
    /// The store failed under [`FailMode::Open`]; the work ran unprotected.
    Unprotected(StoredResponse),
}

/// Why the engine could not decide.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EngineError {
    /// The store failed and the policy is [`FailMode::Closed`]: nothing ran.
    #[error("idempotency store failed; refusing to run unprotected")]
    Store(#[from] StoreError),
}

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

impl<S: Store> Engine<S> {
    /// An engine over `store` with the default [`Policy`].
    pub fn new(store: S) -> Self {
        Self::from_arc(Arc::new(store))
    }

    /// An engine over a shared store.
    pub fn from_arc(store: Arc<S>) -> Self {
        Self {
            store,
            policy: Arc::new(Policy::default()),
            unacked: Arc::default(),
            waiters: Arc::default(),
        }
    }

    /// This engine with another policy (same store).
    pub fn with_policy(mut self, policy: Policy) -> Self {
        self.policy = Arc::new(policy);
        self
    }

    /// The policy in force.
    pub fn policy(&self) -> &Policy {
        &self.policy
    }

    /// The store.
    pub fn store(&self) -> &Arc<S> {
        &self.store
    }

    /// Decides what to do with a request: run it (and own the record), replay
    /// an earlier answer, or refuse.
    ///
    /// Under [`InFlight::Wait`], a duplicate of a running attempt waits (up
    /// to the bound) for its answer and gets [`Begin::Replay`]; if the first
    /// attempt releases the key meanwhile, the duplicate may get
    /// [`Begin::Execute`] itself. It does not poll the store: it asks again
    /// when an attempt of this engine on the same key decides (an
    /// in-process notification), and, for an attempt running in another
    /// process, after pauses that grow fourfold from 25 ms and at the end
    /// of the wait: at most [`MAX_LOOKS`] looks however long it waits. At
    /// most [`MAX_WAITERS_PER_KEY`] wait on one key; the others are answered
    /// [`Begin::InProgress`] at once.
    pub async fn begin(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        fingerprint: Fingerprint,
    ) -> Result<Begin<S>, EngineError> {
        let deadline = match self.policy.on_in_flight {
            InFlight::Reject => None,
            InFlight::Wait(bound) => Some(Instant::now() + bound),
        };
        // Joined at the first "in progress", then armed before each look,
        // so that a decision made between a look and the wait still wakes
        // this caller.
        let mut waiter: Option<Waiter> = None;
        let mut pause = FIRST_LOOK;
        let mut looks = 0;
        loop {
            looks += 1;
            let mut wake = waiter
                .as_ref()
                .map(|w| Box::pin(Arc::clone(&w.notify).notified_owned()));
            if let Some(wake) = wake.as_mut() {
                wake.as_mut().enable();
            }
            let owner = OwnerToken::random();
            let req = ReserveRequest {
                scope,
                key,
                fingerprint,
                owner,
                lease: self.policy.lease,
                retention: self.policy.retention,
                on_lease_expiry: self.policy.on_lease_expiry,
            };
            let reservation = match self.store.reserve(req).await {
                Ok(r) => r,
                Err(err) => {
                    // Any error: a store may report one after the commit.
                    if self.policy.fail_mode == FailMode::Closed {
                        self.check_unacked(scope, key, owner);
                    }
                    return self.store_failed(err, scope, key);
                }
            };
            match reservation {
                Reservation::Acquired(lease) => {
                    tracing::debug!(reason = "idempotency_execute", tenant = scope.tenant(), operation = scope.operation(), %key, attempt = lease.attempt);
                    let mut guard = Guard::new(self, scope, key, lease);
                    if lease.attempt > 1 {
                        guard.rerun = Some(self.rerun(scope, key, lease.attempt).await);
                    }
                    return Ok(Begin::Execute(guard));
                }
                Reservation::Existing(record) => {
                    tracing::debug!(reason = "idempotency_replay", tenant = scope.tenant(), operation = scope.operation(), %key, state = %record.state);
                    let record = *record;
                    let Some(response) = record.response else {
                        let err = StoreError::corrupt(format!(
                            "final record {scope}/{key} has no stored response"
                        ));
                        return self.store_failed(err, scope, key);
                    };
                    return Ok(Begin::Replay(Replay {
                        state: record.state,
                        response,
                        resource_id: record.resource_id,
                    }));
                }
                Reservation::Mismatch { state } => {
                    tracing::debug!(reason = "idempotency_mismatch", tenant = scope.tenant(), operation = scope.operation(), %key, %state);
                    return Ok(Begin::Mismatch { state });
                }
                Reservation::InProgress {
                    retry_after,
                    outcome_unknown,
                } => {
                    let now = Instant::now();
                    let waiting = match (deadline, wake) {
                        // Woken by a decision here, or at the end of the
                        // wait: look once more.
                        (Some(deadline), Some(wake)) if now < deadline => {
                            // The last look is kept for the end of the wait.
                            let until = if looks + 1 >= MAX_LOOKS {
                                deadline
                            } else {
                                deadline.min(now + pause)
                            };
                            let _ = tokio::time::timeout_at(until, wake).await;
                            pause *= 4;
                            true
                        }
                        // Join, then look again with the wake armed.
                        (Some(deadline), None) if now < deadline => {
                            waiter = self.waiters.join(scope, key);
                            waiter.is_some()
                        }
                        _ => false,
                    };
                    if !waiting {
                        tracing::debug!(reason = "idempotency_in_progress", tenant = scope.tenant(), operation = scope.operation(), %key, ?retry_after);
                        return Ok(Begin::InProgress {
                            retry_after,
                            outcome_unknown,
                        });
                    }
                }
            }
        }
    }

    /// [`begin`](Self::begin), also finding a record written before keyed
    /// hashing, under the request's `earlier` scope and fingerprint (the
    /// unkeyed tenant and the `v1:` fingerprint).
    ///
    /// A retry that crosses the upgrade then gets its original answer, not
    /// a second execution (its tenant moved) nor a `Mismatch` (its
    /// fingerprint did). It costs one read per fresh reservation, for as
    /// long as such records may live (the caller bounds that by the
    /// longest retention).
    pub async fn begin_accepting_v1(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        fingerprint: Fingerprint,
        earlier: &V1Address,
    ) -> Result<Begin<S>, EngineError> {
        match self.begin(scope, key, fingerprint).await? {
            Begin::Execute(guard) if earlier.scope != *scope => {
                match self.store.get(&earlier.scope, key).await {
                    Ok(None) => Ok(Begin::Execute(guard)),
                    Ok(Some(record)) => {
                        // The work is not ours to run: hand the key back.
                        if let Err(err) = guard.release().await {
                            tracing::warn!(reason = "idempotency_store_error", tenant = scope.tenant(), operation = scope.operation(), %key, %err, "releasing a reservation an earlier record answers");
                        }
                        tracing::debug!(reason = "idempotency_earlier_record", tenant = earlier.scope.tenant(), operation = scope.operation(), %key, state = %record.state);
                        Ok(self.earlier_answer(record, earlier.fingerprint))
                    }
                    Err(err) => {
                        let _ = guard.release().await;
                        self.store_failed(err, scope, key)
                    }
                }
            }
            Begin::Mismatch { state } if earlier.scope == *scope => {
                match self.store.get(scope, key).await {
                    Ok(Some(record)) if record.fingerprint == earlier.fingerprint => {
                        Ok(self.earlier_answer(record, earlier.fingerprint))
                    }
                    _ => Ok(Begin::Mismatch { state }),
                }
            }
            other => Ok(other),
        }
    }

    /// A [`Begin::Mismatch`] (whose record was in `state`) judged again
    /// against `previous`, the fingerprint the version before gave the
    /// request (`v2:`, its JSON numbers read as doubles): a record that
    /// carries it was written by that version for this request, and
    /// answers it as it would have. Anything else stays a mismatch.
    ///
    /// A retry that crosses the upgrade then gets its original answer.
    /// It costs one read, and only on a mismatch, so the caller computes
    /// `previous` only then.
    pub async fn recheck_mismatch(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        state: RecordState,
        previous: Fingerprint,
    ) -> Result<Begin<S>, EngineError> {
        match self.store.get(scope, key).await {
            Ok(Some(record)) if record.fingerprint == previous => {
                tracing::debug!(reason = "idempotency_previous_record", tenant = scope.tenant(), operation = scope.operation(), %key, state = %record.state);
                Ok(self.earlier_answer(record, previous))
            }
            _ => Ok(Begin::Mismatch { state }),
        }
    }

    /// What a record an older version wrote answers a request that version
    /// would have fingerprinted as `fingerprint`.
    fn earlier_answer(&self, record: Record, fingerprint: Fingerprint) -> Begin<S> {
        if record.fingerprint != fingerprint {
            return Begin::Mismatch {
                state: record.state,
            };
        }
        match record.response {
            Some(response) if record.state.is_final() => Begin::Replay(Replay {
                state: record.state,
                response,
                resource_id: record.resource_id,
            }),
            _ => Begin::InProgress {
                retry_after: record
                    .lease
                    .locked_until
                    .since(crate::Timestamp::now())
                    .max(Duration::from_secs(1)),
                outcome_unknown: record.is_outcome_unknown(),
            },
        }
    }

    /// A takeover: this attempt runs work an earlier attempt may already
    /// have done. Says so loudly, with why and for how long the key was
    /// taken. The record keeps its creation time and its unknown flag
    /// through a takeover, so one read tells both (on this rare path only).
    async fn rerun(&self, scope: &Scope, key: &IdempotencyKey, attempt: u32) -> Rerun {
        let record = self.store.get(scope, key).await.ok().flatten();
        let reason = match &record {
            Some(r) if r.is_outcome_unknown() => RerunReason::OutcomeUnknown,
            _ => RerunReason::LeaseLapsed,
        };
        let held_for = record.map(|r| crate::Timestamp::now().since(r.created_at));
        tracing::warn!(
            reason = "idempotency_rerun",
            tenant = scope.tenant(),
            operation = scope.operation(),
            %key,
            attempt,
            why = reason.as_str(),
            held_ms = held_for.map(|d| d.as_millis() as u64),
            "running again work an earlier attempt may have done (on_lease_expiry = retry)"
        );
        Rerun {
            attempt,
            reason,
            held_for,
        }
    }

    fn store_failed(
        &self,
        err: StoreError,
        scope: &Scope,
        key: &IdempotencyKey,
    ) -> Result<Begin<S>, EngineError> {
        match self.policy.fail_mode {
            // Fail-open is for a store that cannot be reached. One that
            // answered with data it cannot read back (a corrupt record, a
            // body sealed with a key no longer configured) may hold a
            // finished answer: running the work again could repeat it.
            FailMode::Open if !err.is_transient() => {
                tracing::warn!(reason = "idempotency_store_error", tenant = scope.tenant(), operation = scope.operation(), %key, %err, "refusing: the store answered but its record cannot be read (fail-open covers an unreachable store only)");
                Err(EngineError::Store(err))
            }
            FailMode::Closed => {
                tracing::debug!(reason = "idempotency_store_error", tenant = scope.tenant(), operation = scope.operation(), %key, %err, "refusing: fail-closed");
                Err(EngineError::Store(err))
            }
            FailMode::Open => {
                tracing::debug!(reason = "idempotency_unprotected", tenant = scope.tenant(), operation = scope.operation(), %key, %err, "running unprotected: fail-open");
                Ok(Begin::Unprotected(err))
            }
        }
    }

    /// Hands a reservation whose answer never came back to the background
    /// check that releases it once the store answers again.
    ///
    /// A store can commit a reservation and lose the acknowledgement (the
    /// connection drops, the server restarts, the call times out), or
    /// report an error after the commit (a hook that ran after it). The
    /// caller was refused and ran nothing, yet the record holds the key as
    /// processing: every retry would be told "in progress" until the lease
    /// lapses (for ever under [`LeaseExpiry::Hold`](crate::LeaseExpiry)).
    /// The owner token is ours alone, so a processing record that carries
    /// it is exactly that orphan, and releasing it is safe: the work never
    /// started. Only under fail-closed: a fail-open caller goes on to run
    /// the work unprotected, and its record then keeps duplicates out for
    /// the lease.
    fn check_unacked(&self, scope: &Scope, key: &IdempotencyKey, owner: OwnerToken) {
        let queue = self.unacked.get_or_init(|| {
            let (tx, rx) = mpsc::channel(UNACKED_QUEUE);
            tokio::spawn(release_unacked(Arc::clone(&self.store), rx));
            tx
        });
        let now = Instant::now();
        let item = Unacked {
            scope: scope.clone(),
            key: key.clone(),
            owner,
            until: now + self.policy.lease.max(UNACKED_MIN_WATCH),
            settled: now + UNACKED_SETTLE,
            due: now,
            pause: UNACKED_FIRST_PAUSE,
            warned: false,
        };
        if queue.try_send(item).is_err() {
            tracing::warn!(tenant = scope.tenant(), operation = scope.operation(), %key, "too many unanswered reservations to check; this key waits out its lease");
        }
    }

    /// Runs `work` at most once per `(scope, key)`: the common case of
    /// [`begin`](Self::begin). The guard keeps its lease alive while `work`
    /// runs; the answer is recorded as the policy's
    /// [`resolution_for`](Policy::resolution_for) its status says.
    ///
    /// If recording fails after the work ran, the answer is still returned
    /// as [`Run::Executed`] (the work was done) and the failure is logged;
    /// the record is left `outcome_unknown` where possible.
    pub async fn run<F, Fut>(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        fingerprint: Fingerprint,
        work: F,
    ) -> Result<Run, EngineError>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = StoredResponse>,
    {
        Ok(match self.begin(scope, key, fingerprint).await? {
            Begin::Execute(mut guard) => {
                guard.keep_alive();
                let response = work().await;
                let recorded = guard.finish(response.clone()).await;
                if let Err(err) = recorded {
                    tracing::error!(reason = "idempotency_record_failed", tenant = scope.tenant(), operation = scope.operation(), %key, %err);
                }
                Run::Executed(response)
            }
            Begin::Replay(replay) => Run::Replayed(replay),
            Begin::InProgress {
                retry_after,
                outcome_unknown,
            } => Run::InProgress {
                retry_after,
                outcome_unknown,
            },
            Begin::Mismatch { state } => Run::Mismatch { state },
            Begin::Unprotected(_) => Run::Unprotected(work().await),
        })
    }
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
    rerun: Option<Rerun>,
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
    fn new(engine: &Engine<S>, scope: &Scope, key: &IdempotencyKey, lease: Lease) -> Self {
        Self {
            store: Arc::clone(&engine.store),
            policy: Arc::clone(&engine.policy),
            scope: scope.clone(),
            key: key.clone(),
            lease,
            resource_id: None,
            error_code: None,
            heartbeat: None,
            rerun: None,
            waiters: Arc::clone(&engine.waiters),
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

/// The most callers that wait on one key under [`InFlight::Wait`]; more
/// are answered "in progress" at once.
pub const MAX_WAITERS_PER_KEY: usize = 64;

/// The most times a caller under [`InFlight::Wait`] asks the store, from
/// its first look to its last, however long the wait.
pub const MAX_LOOKS: u32 = 8;

/// The first pause of a waiter that no decision here woke; each next one
/// is four times longer.
const FIRST_LOOK: Duration = Duration::from_millis(25);

type WaitKey = (String, String, String);

/// Callers waiting for an attempt of this engine to decide, per key: the
/// key's notification and how many wait on it.
#[derive(Debug, Default)]
struct Waiters {
    keys: std::sync::Mutex<std::collections::HashMap<WaitKey, (Arc<tokio::sync::Notify>, usize)>>,
    /// How many wait, on any key: a decision with nobody waiting (nearly
    /// all of them) takes no lock.
    waiting: std::sync::atomic::AtomicUsize,
}

fn wait_key(scope: &Scope, key: &IdempotencyKey) -> WaitKey {
    (
        scope.tenant().to_owned(),
        scope.operation().to_owned(),
        key.as_str().to_owned(),
    )
}

impl Waiters {
    fn lock(
        &self,
    ) -> std::sync::MutexGuard<
        '_,
        std::collections::HashMap<WaitKey, (Arc<tokio::sync::Notify>, usize)>,
    > {
        self.keys.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Joins the waiters of `key`, unless there are too many.
    fn join(self: &Arc<Self>, scope: &Scope, key: &IdempotencyKey) -> Option<Waiter> {
        let id = wait_key(scope, key);
        let mut keys = self.lock();
        let (notify, count) = keys.entry(id.clone()).or_default();
        if *count >= MAX_WAITERS_PER_KEY {
            drop(keys);
            tracing::debug!(tenant = scope.tenant(), operation = scope.operation(), %key, "too many callers wait on this key; answering in progress");
            return None;
        }
        *count += 1;
        self.waiting.fetch_add(1, Ordering::SeqCst);
        Some(Waiter {
            notify: Arc::clone(notify),
            waiters: Arc::clone(self),
            id,
        })
    }

    /// An attempt on `key` decided: its waiters look again.
    fn wake(&self, scope: &Scope, key: &IdempotencyKey) {
        // A waiter joins before it looks at the store, and the decision
        // was made there before this: one that joins after this load
        // sees the decision.
        if self.waiting.load(Ordering::SeqCst) == 0 {
            return;
        }
        let keys = self.lock();
        if let Some((notify, _)) = keys.get(&wait_key(scope, key)) {
            notify.notify_waiters();
        }
    }
}

/// One caller's place among the waiters of a key; leaving drops the key's
/// entry with its last waiter.
struct Waiter {
    notify: Arc<tokio::sync::Notify>,
    waiters: Arc<Waiters>,
    id: WaitKey,
}

impl Drop for Waiter {
    fn drop(&mut self) {
        self.waiters.waiting.fetch_sub(1, Ordering::SeqCst);
        let mut keys = self.waiters.lock();
        if let Some((_, count)) = keys.get_mut(&self.id) {
            *count -= 1;
            if *count == 0 {
                keys.remove(&self.id);
            }
        }
    }
}

/// How many unanswered reservations are being checked, and how many more
/// may wait for a place; beyond that they are left to lapse with their
/// lease.
const UNACKED_QUEUE: usize = 4096;
/// How long an unanswered reservation is watched at least: under
/// [`LeaseExpiry::Hold`](crate::LeaseExpiry) its lapsed lease does not free
/// the key.
const UNACKED_MIN_WATCH: Duration = Duration::from_secs(300);
/// How long "no such reservation" is not believed: a statement the caller
/// gave up on (a time-out) may still reach the store and commit.
const UNACKED_SETTLE: Duration = Duration::from_secs(5);
const UNACKED_FIRST_PAUSE: Duration = Duration::from_millis(20);
const UNACKED_MAX_PAUSE: Duration = Duration::from_secs(1);

/// A reservation sent to the store whose answer was an error.
struct Unacked {
    scope: Scope,
    key: IdempotencyKey,
    owner: OwnerToken,
    /// Watched until then.
    until: Instant,
    /// Absent until then means "not arrived yet".
    settled: Instant,
    /// The next check.
    due: Instant,
    pause: Duration,
    /// A check failed with an error that is not transient, and said so.
    warned: bool,
}

impl Unacked {
    /// Looks once; `true` when there is nothing more to do.
    async fn check<S: Store>(&mut self, store: &S) -> bool {
        let found = match store.get(&self.scope, &self.key).await {
            Ok(found) => found,
            Err(err) => return self.failed(&err),
        };
        match found {
            Some(record)
                if record.state == RecordState::Processing && record.lease.owner == self.owner =>
            {
                match store.release(&self.scope, &self.key, &record.lease).await {
                    Ok(()) => {
                        tracing::info!(tenant = self.scope.tenant(), operation = self.scope.operation(), key = %self.key, "released a reservation whose acknowledgement was lost");
                        true
                    }
                    Err(StoreError::Fenced) => true,
                    Err(err) => self.failed(&err),
                }
            }
            // Someone else's by now: never ours to release.
            Some(_) => true,
            None => Instant::now() >= self.settled,
        }
    }

    /// A failed check: the watch goes on, whatever the error. One the
    /// store gives no reason to expect will pass (a protocol error on a
    /// connection the time-out left mid-statement, a refused statement)
    /// is logged once; giving up on it would leave the key held for the
    /// whole lease, and under [`LeaseExpiry::Hold`](crate::LeaseExpiry) for good.
    fn failed(&mut self, err: &StoreError) -> bool {
        if !err.is_transient() && !self.warned {
            self.warned = true;
            tracing::warn!(tenant = self.scope.tenant(), operation = self.scope.operation(), key = %self.key, %err, "checking a reservation whose acknowledgement was lost failed; checking on until the store answers");
        }
        false
    }
}

/// The background check of [`Engine::check_unacked`]: every unanswered
/// reservation is looked up, with growing pauses, while the store is
/// unreachable and while it might still arrive. Ends when the engine and
/// all its clones are gone.
async fn release_unacked<S: Store>(store: Arc<S>, mut queue: mpsc::Receiver<Unacked>) {
    let mut pending: Vec<Unacked> = Vec::new();
    loop {
        let next = pending.iter().map(|u| u.due).min();
        let arrived = match next {
            None => Some(queue.recv().await),
            Some(due) if pending.len() < UNACKED_QUEUE => {
                tokio::time::timeout_at(due, queue.recv()).await.ok()
            }
            // Full: new ones wait in the queue (and past it are refused).
            Some(due) => {
                tokio::time::sleep_until(due).await;
                None
            }
        };
        match arrived {
            Some(Some(u)) => pending.push(u),
            Some(None) => return,
            None => {}
        }
        let now = Instant::now();
        let mut i = 0;
        while i < pending.len() {
            let u = &mut pending[i];
            let done = if u.due > now {
                false
            } else {
                let done = u.check(&*store).await || Instant::now() >= u.until;
                u.due = Instant::now() + u.pause;
                u.pause = (u.pause * 2).min(UNACKED_MAX_PAUSE);
                done
            };
            if done {
                pending.swap_remove(i);
            } else {
                i += 1;
            }
        }
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
