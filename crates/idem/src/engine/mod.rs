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
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use tokio::sync::mpsc;
use tokio::time::Instant;

mod guard;
mod unacked;
mod waiters;

pub use guard::{Guard, RecordError, Rerun, RerunReason};
use unacked::{
    UNACKED_FIRST_PAUSE, UNACKED_MIN_WATCH, UNACKED_QUEUE, UNACKED_SETTLE, Unacked, release_unacked,
};
use waiters::{FIRST_LOOK, Waiter, Waiters};
pub use waiters::{MAX_LOOKS, MAX_WAITERS_PER_KEY};

use crate::store::{Reservation, ReserveRequest, Store, StoreError};
use crate::{
    FailMode, Fingerprint, IdempotencyKey, InFlight, OwnerToken, Policy, Record, RecordState,
    Scope, StoredResponse,
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
                    let mut guard = Guard::new(
                        Arc::clone(&self.store),
                        Arc::clone(&self.policy),
                        Arc::clone(&self.waiters),
                        scope,
                        key,
                        lease,
                    );
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
