//! Test support for idem (not published).
//!
//! * [`conformance`]: the store conformance suite every backend runs, and
//!   the [`store_conformance!`] macro that instantiates it;
//! * [`FaultyStore`]: wraps a real store and fails chosen operations on
//!   demand, to test what the engine does when the store breaks mid-flight;
//! * [`mod@bench`]: the shared harness of the store benchmarks;
//! * [`client`]: one-call HTTP requests with the answer fully read;
//! * [`fault`]: a TCP proxy that cuts, black-holes, resets, slows or
//!   throttles the line to a server;
//! * [`servers`]: a private Redis and PostgreSQL a test may crash and
//!   restart;
//! * [`upstream`]: a counting HTTP upstream on loopback for gateway tests;
//! * [`services`]: finds the loopback servers (PostgreSQL, Redis, NATS,
//!   RabbitMQ); skips loudly when one is absent, or fails under
//!   `IDEM_REQUIRE_SERVICES=1`.

pub mod bench;
pub mod client;
pub mod conformance;
pub mod fault;
pub mod gateway;
pub mod ledger;
pub mod servers;
pub mod services;
pub mod upstream;

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use idem::{
    FinalOutcome, IdempotencyKey, Lease, ListFilter, ListRecords, Page, Purge, Record, Reservation,
    ReserveRequest, Scope, Store, StoreError, Timestamp,
};

/// Which operation a fault applies to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// [`Store::reserve`].
    Reserve,
    /// [`Store::resolve`].
    Resolve,
    /// [`Store::mark_unknown`].
    MarkUnknown,
    /// [`Store::release`].
    Release,
    /// [`Store::renew`].
    Renew,
    /// [`Store::get`].
    Get,
}

const OPS: usize = 6;

/// A store that fails the next N calls of chosen operations with
/// [`StoreError::Unavailable`] (before or after they took effect), and
/// otherwise delegates to a real store.
#[derive(Debug)]
pub struct FaultyStore<S> {
    inner: S,
    failures: [AtomicU32; OPS],
    lost_answers: [AtomicU32; OPS],
    calls: [AtomicU32; OPS],
    delays_ms: [AtomicU32; OPS],
}

impl<S> FaultyStore<S> {
    /// Wraps `inner`; no faults until [`fail_next`](Self::fail_next).
    pub fn new(inner: S) -> Self {
        Self {
            inner,
            failures: Default::default(),
            lost_answers: Default::default(),
            calls: Default::default(),
            delays_ms: Default::default(),
        }
    }

    /// Makes the next `n` calls of `op` fail.
    pub fn fail_next(&self, op: Op, n: u32) {
        self.failures[op as usize].store(n, Ordering::SeqCst);
    }

    /// Makes the next `n` calls of `op` take effect in the store and then
    /// fail, as when the connection drops after the commit and before its
    /// acknowledgement reached the caller.
    pub fn lose_answer_next(&self, op: Op, n: u32) {
        self.lost_answers[op as usize].store(n, Ordering::SeqCst);
    }

    /// Makes every call of `op` answer `delay` late, after the operation
    /// took effect (a slow store).
    pub fn delay(&self, op: Op, delay: Duration) {
        self.delays_ms[op as usize].store(
            u32::try_from(delay.as_millis()).unwrap_or(u32::MAX),
            Ordering::SeqCst,
        );
    }

    /// How many times `op` was called (failed or not).
    pub fn calls(&self, op: Op) -> u32 {
        self.calls[op as usize].load(Ordering::SeqCst)
    }

    /// The wrapped store.
    pub fn inner(&self) -> &S {
        &self.inner
    }

    /// The configured delay, applied *after* the real operation: the
    /// store did the work but answers late (like a slow commit).
    async fn pause(&self, op: Op) {
        let delay = self.delays_ms[op as usize].load(Ordering::SeqCst);
        if delay > 0 {
            tokio::time::sleep(Duration::from_millis(u64::from(delay))).await;
        }
    }

    fn check(&self, op: Op) -> Result<(), StoreError> {
        self.calls[op as usize].fetch_add(1, Ordering::SeqCst);
        take_one(&self.failures[op as usize], op, "injected fault")
    }

    /// After the real operation: its delay, then a lost answer if one is
    /// due, else its result.
    async fn answer<T>(&self, op: Op, result: Result<T, StoreError>) -> Result<T, StoreError> {
        self.pause(op).await;
        take_one(&self.lost_answers[op as usize], op, "answer lost after")?;
        result
    }
}

/// Counts one injected fault down; an error while any was left.
fn take_one(left: &AtomicU32, op: Op, what: &str) -> Result<(), StoreError> {
    match left.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1)) {
        Ok(_) => Err(StoreError::unavailable(format!("{what} in {op:?}"))),
        Err(_) => Ok(()),
    }
}

impl<S: Store> Store for FaultyStore<S> {
    async fn reserve(&self, req: ReserveRequest<'_>) -> Result<Reservation, StoreError> {
        self.check(Op::Reserve)?;
        let result = self.inner.reserve(req).await;
        self.answer(Op::Reserve, result).await
    }

    async fn get(&self, scope: &Scope, key: &IdempotencyKey) -> Result<Option<Record>, StoreError> {
        self.check(Op::Get)?;
        let result = self.inner.get(scope, key).await;
        self.answer(Op::Get, result).await
    }

    async fn resolve(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        lease: &Lease,
        outcome: &FinalOutcome,
    ) -> Result<(), StoreError> {
        self.check(Op::Resolve)?;
        let result = self.inner.resolve(scope, key, lease, outcome).await;
        self.answer(Op::Resolve, result).await
    }

    async fn release(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        lease: &Lease,
    ) -> Result<(), StoreError> {
        self.check(Op::Release)?;
        let result = self.inner.release(scope, key, lease).await;
        self.answer(Op::Release, result).await
    }

    async fn mark_unknown(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        lease: &Lease,
        reason: &str,
    ) -> Result<(), StoreError> {
        self.check(Op::MarkUnknown)?;
        let result = self.inner.mark_unknown(scope, key, lease, reason).await;
        self.answer(Op::MarkUnknown, result).await
    }

    async fn renew(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        lease: &Lease,
        duration: Duration,
    ) -> Result<Timestamp, StoreError> {
        self.check(Op::Renew)?;
        let result = self.inner.renew(scope, key, lease, duration).await;
        self.answer(Op::Renew, result).await
    }
}

impl<S: ListRecords> ListRecords for FaultyStore<S> {
    async fn list(&self, filter: &ListFilter) -> Result<Page, StoreError> {
        self.inner.list(filter).await
    }
}

impl<S: Purge> Purge for FaultyStore<S> {
    async fn purge_expired(&self, batch: usize) -> Result<u64, StoreError> {
        self.inner.purge_expired(batch).await
    }

    async fn delete(&self, scope: &Scope, key: &IdempotencyKey) -> Result<bool, StoreError> {
        self.inner.delete(scope, key).await
    }
}
