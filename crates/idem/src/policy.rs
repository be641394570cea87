//! Per-operation policy: how long answers are kept, how long an attempt
//! holds its lease, what happens when it lapses or the store is down, and
//! which answers are final.
//!
//! ```
//! use std::time::Duration;
//! use idem::{FailMode, InFlight, LeaseExpiry, Policy, Resolution};
//!
//! let policy = Policy::default()
//!     .with_retention(Duration::from_secs(3600))
//!     .with_on_in_flight(InFlight::Wait(Duration::from_secs(5)));
//! assert_eq!(policy.lease, Duration::from_secs(30));
//! assert_eq!(policy.on_lease_expiry, LeaseExpiry::Hold);
//! assert_eq!(policy.fail_mode, FailMode::Closed);
//! assert_eq!(policy.resolution_for(201), Resolution::Complete);
//! assert_eq!(policy.resolution_for(422), Resolution::Fail);
//! assert_eq!(policy.resolution_for(503), Resolution::Release);
//! ```

use std::time::Duration;

/// What a new attempt may do when it finds a `processing` record whose lease
/// has lapsed (the previous attempt crashed, hung or timed out), or one whose
/// outcome is unknown once its lease lapses.
///
/// Such an attempt may have taken effect, so the default holds the record:
/// it is never run again on its own, only settled by a
/// [`Reconciler`](crate::reconcile::Reconciler) or an operator.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LeaseExpiry {
    /// Take the record over as attempt + 1 and run again with the same key.
    /// Only for work that is idempotent downstream (a provider that
    /// deduplicates by the forwarded key): the earlier attempt may have
    /// taken effect. Every such re-run is logged as a warning
    /// (`idempotency_rerun`).
    Retry,
    /// Keep answering "in progress" (outcome unknown) until a reconciler or
    /// an operator settles the record: the work never runs twice.
    #[default]
    Hold,
}

/// What to do when the store cannot be reached.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FailMode {
    /// Refuse the request (`503`): nothing runs unprotected.
    #[default]
    Closed,
    /// Run the work without protection and say so.
    Open,
}

/// What a duplicate gets while the first attempt is still running.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum InFlight {
    /// Answer "in progress" at once, with a retry-after hint.
    #[default]
    Reject,
    /// Wait up to this long for the first attempt's answer and replay it;
    /// answer "in progress" if it has not come by then.
    Wait(Duration),
}

/// What a `5xx` answer does when no other rule names its status: the
/// route's `release_statuses` and the trust rule's
/// [`UNKNOWN_OUTCOME_STATUSES`] decide first.
///
/// A server error can come after the side effect (the charge went
/// through, then writing the receipt failed), so only [`Store`] and
/// [`Hold`] keep the promise that the work never runs twice.
///
/// [`Store`]: ServerError::Store
/// [`Hold`]: ServerError::Hold
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ServerError {
    /// Store it as a failure and replay it, as Stripe does.
    #[default]
    Store,
    /// Hold the key as an unknown outcome ([`Resolution::Unknown`]):
    /// nothing replays and nothing runs again until it is reconciled.
    Hold,
    /// Free the key so that a retry runs the work again, as the
    /// IETF-aligned libraries do. **A `5xx` that came after the side
    /// effect then runs it twice**: only for an upstream whose server
    /// errors are known to come before any effect.
    Release,
}

/// How a finished attempt is recorded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resolution {
    /// Store as `completed` and replay it.
    Complete,
    /// Store as `failed` (deterministic failure) and replay it.
    Fail,
    /// Record nothing and free the key: the answer was transient and a retry
    /// should run the work again.
    Release,
    /// Hold the key as an unknown outcome: the answer does not prove that
    /// the work did not run (see [`UNKNOWN_OUTCOME_STATUSES`]). Nothing is
    /// replayed and nothing runs again until the record is reconciled.
    Unknown,
}

/// Statuses that free the key instead of being stored, by default:
/// authentication failures (401, 403, 407: a caller who could claim a key
/// with a bad credential must not fix the answer its owner gets), request
/// timeout, conflict, too early, too many requests, and service
/// unavailable. Each says the request was not acted on, so retrying it may
/// rightly succeed.
pub const DEFAULT_RELEASE_STATUSES: &[u16] = &[401, 403, 407, 408, 409, 425, 429, 503];

/// Statuses that prove nothing about the request: `502` and `504` are what
/// a load balancer or ingress between the caller and the app answers when
/// the app is slow or its connection breaks, often after the app ran. They
/// hold the key as an unknown outcome ([`Resolution::Unknown`]) unless the
/// policy's `release_statuses` name them (an upstream that is the app
/// itself, whose own `502` means it did nothing).
pub const UNKNOWN_OUTCOME_STATUSES: &[u16] = &[502, 504];

/// Per-operation idempotency policy. Defaults: retention 24 h, lease 30 s,
/// [`LeaseExpiry::Hold`], [`FailMode::Closed`], [`InFlight::Reject`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Policy {
    /// How long a final answer is kept and replayed.
    pub retention: Duration,
    /// How long one attempt holds the record before others may act on it.
    /// A [`Guard`](crate::Guard) with a heartbeat renews it while work runs.
    pub lease: Duration,
    /// What a new attempt may do with a lapsed lease.
    pub on_lease_expiry: LeaseExpiry,
    /// What to do when the store is unreachable.
    pub fail_mode: FailMode,
    /// What a duplicate gets while the first attempt runs.
    pub on_in_flight: InFlight,
    /// Statuses recorded as nothing and answered as-is: the key is released.
    pub release_statuses: Vec<u16>,
    /// What a `5xx` answer that no other rule names does.
    pub on_server_error: ServerError,
    /// How many times recording a finished attempt's answer is tried at
    /// least; transient failures are tried again beyond that while half
    /// the lease is not spent (a store restarting or failing over still
    /// gets the answer). Then the record is marked
    /// [`OUTCOME_UNKNOWN`](crate::OUTCOME_UNKNOWN).
    pub record_attempts: u32,
}

impl Default for Policy {
    fn default() -> Self {
        Self {
            retention: Duration::from_secs(24 * 3600),
            lease: Duration::from_secs(30),
            on_lease_expiry: LeaseExpiry::Hold,
            fail_mode: FailMode::Closed,
            on_in_flight: InFlight::Reject,
            release_statuses: DEFAULT_RELEASE_STATUSES.to_vec(),
            on_server_error: ServerError::Store,
            record_attempts: 4,
        }
    }
}

impl Policy {
    /// Sets the retention.
    pub fn with_retention(mut self, retention: Duration) -> Self {
        self.retention = retention;
        self
    }

    /// Sets the lease.
    pub fn with_lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }

    /// Sets what happens to a lapsed lease.
    pub fn with_on_lease_expiry(mut self, on_lease_expiry: LeaseExpiry) -> Self {
        self.on_lease_expiry = on_lease_expiry;
        self
    }

    /// Sets the fail mode.
    pub fn with_fail_mode(mut self, fail_mode: FailMode) -> Self {
        self.fail_mode = fail_mode;
        self
    }

    /// Sets what duplicates get while the first attempt runs.
    pub fn with_on_in_flight(mut self, on_in_flight: InFlight) -> Self {
        self.on_in_flight = on_in_flight;
        self
    }

    /// Sets which statuses release the key instead of being stored.
    pub fn with_release_statuses(mut self, statuses: impl Into<Vec<u16>>) -> Self {
        self.release_statuses = statuses.into();
        self
    }

    /// Sets how many times recording an answer is tried (at least once).
    pub fn with_record_attempts(mut self, attempts: u32) -> Self {
        self.record_attempts = attempts.max(1);
        self
    }

    /// Sets what a `5xx` answer that no other rule names does.
    pub fn with_on_server_error(mut self, on_server_error: ServerError) -> Self {
        self.on_server_error = on_server_error;
        self
    }

    /// How an answer with this status is recorded: release statuses free the
    /// key, [`UNKNOWN_OUTCOME_STATUSES`] hold it, other `5xx` statuses do
    /// what [`on_server_error`](Self::on_server_error) says, other statuses
    /// from 400 up are deterministic failures, the rest complete.
    pub fn resolution_for(&self, status: u16) -> Resolution {
        if self.release_statuses.contains(&status) {
            Resolution::Release
        } else if UNKNOWN_OUTCOME_STATUSES.contains(&status) {
            Resolution::Unknown
        } else if status >= 500 {
            match self.on_server_error {
                ServerError::Store => Resolution::Fail,
                ServerError::Hold => Resolution::Unknown,
                ServerError::Release => Resolution::Release,
            }
        } else if status >= 400 {
            Resolution::Fail
        } else {
            Resolution::Complete
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_match_the_design() {
        let p = Policy::default();
        assert_eq!(p.retention, Duration::from_secs(86_400));
        assert_eq!(p.lease, Duration::from_secs(30));
        assert_eq!(p.on_lease_expiry, LeaseExpiry::Hold);
        assert_eq!(p.fail_mode, FailMode::Closed);
        assert_eq!(p.on_in_flight, InFlight::Reject);
    }

    #[test]
    fn resolution_by_status() {
        let p = Policy::default();
        for s in [200, 201, 204, 302] {
            assert_eq!(p.resolution_for(s), Resolution::Complete, "{s}");
        }
        for s in [400, 402, 404, 422, 500] {
            assert_eq!(p.resolution_for(s), Resolution::Fail, "{s}");
        }
        for s in [401, 403, 407, 408, 409, 425, 429, 503] {
            assert_eq!(p.resolution_for(s), Resolution::Release, "{s}");
        }
        for s in [502, 504] {
            assert_eq!(p.resolution_for(s), Resolution::Unknown, "{s}");
        }
        let p = p.with_release_statuses(vec![500, 502]);
        assert_eq!(p.resolution_for(500), Resolution::Release);
        assert_eq!(p.resolution_for(502), Resolution::Release);
        assert_eq!(p.resolution_for(504), Resolution::Unknown);
        assert_eq!(p.resolution_for(503), Resolution::Fail);
        assert_eq!(Policy::default().with_record_attempts(0).record_attempts, 1);
    }

    /// `on_server_error` decides the 5xx answers no other rule names:
    /// release statuses and the trust rule's 502/504 keep theirs.
    #[test]
    fn server_errors_are_stored_held_or_released_as_the_policy_says() {
        let stored = Policy::default();
        assert_eq!(stored.on_server_error, ServerError::Store);
        for s in [500, 501, 505, 599] {
            assert_eq!(stored.resolution_for(s), Resolution::Fail, "{s}");
        }
        let held = Policy::default().with_on_server_error(ServerError::Hold);
        let released = Policy::default().with_on_server_error(ServerError::Release);
        for s in [500, 501, 505, 599] {
            assert_eq!(held.resolution_for(s), Resolution::Unknown, "{s}");
            assert_eq!(released.resolution_for(s), Resolution::Release, "{s}");
        }
        for p in [&held, &released] {
            assert_eq!(p.resolution_for(502), Resolution::Unknown);
            assert_eq!(p.resolution_for(504), Resolution::Unknown);
            assert_eq!(p.resolution_for(503), Resolution::Release);
            assert_eq!(p.resolution_for(422), Resolution::Fail);
            assert_eq!(p.resolution_for(201), Resolution::Complete);
        }
        let named = held.with_release_statuses(vec![500]);
        assert_eq!(named.resolution_for(500), Resolution::Release);
        assert_eq!(named.resolution_for(501), Resolution::Unknown);
    }
}
