//! Reservations whose answer was an error: looked up in the background
//! and released if they reached the store as ours, so that no key stays
//! held by an attempt that never ran.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;
use tokio::time::Instant;

use crate::store::{Store, StoreError};
use crate::{IdempotencyKey, OwnerToken, RecordState, Scope};

/// How many unanswered reservations are being checked, and how many more
/// may wait for a place; beyond that they are left to lapse with their
/// lease.
pub(super) const UNACKED_QUEUE: usize = 4096;
/// How long an unanswered reservation is watched at least: under
/// [`LeaseExpiry::Hold`](crate::LeaseExpiry) its lapsed lease does not free
/// the key.
pub(super) const UNACKED_MIN_WATCH: Duration = Duration::from_secs(300);
/// How long "no such reservation" is not believed: a statement the caller
/// gave up on (a time-out) may still reach the store and commit.
pub(super) const UNACKED_SETTLE: Duration = Duration::from_secs(5);
pub(super) const UNACKED_FIRST_PAUSE: Duration = Duration::from_millis(20);
pub(super) const UNACKED_MAX_PAUSE: Duration = Duration::from_secs(1);

/// A reservation sent to the store whose answer was an error.
pub(super) struct Unacked {
    pub(super) scope: Scope,
    pub(super) key: IdempotencyKey,
    pub(super) owner: OwnerToken,
    /// Watched until then.
    pub(super) until: Instant,
    /// Absent until then means "not arrived yet".
    pub(super) settled: Instant,
    /// The next check.
    pub(super) due: Instant,
    pub(super) pause: Duration,
    /// A check failed with an error that is not transient, and said so.
    pub(super) warned: bool,
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

/// The background check of [`Engine::check_unacked`](super::Engine::check_unacked): every unanswered
/// reservation is looked up, with growing pauses, while the store is
/// unreachable and while it might still arrive. Ends when the engine and
/// all its clones are gone.
pub(super) async fn release_unacked<S: Store>(store: Arc<S>, mut queue: mpsc::Receiver<Unacked>) {
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
