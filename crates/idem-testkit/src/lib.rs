//! Test support for idem (not published).
//!
//! * [`conformance`]: the store conformance suite every backend runs, and
//!   the [`store_conformance!`] macro that instantiates it;
//! * [`FaultyStore`]: wraps a real store and fails chosen operations on
//!   demand, to test what the engine does when the store breaks mid-flight;
//! * [`services`]: finds the loopback servers (PostgreSQL, Redis, NATS,
//!   RabbitMQ); skips loudly when one is absent, or fails under
//!   `IDEM_REQUIRE_SERVICES=1`.

pub mod conformance;
pub mod services;

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
}

const OPS: usize = 5;

/// A store that fails the next N calls of chosen operations with
/// [`StoreError::Unavailable`], and otherwise delegates to a real store.
#[derive(Debug)]
pub struct FaultyStore<S> {
    inner: S,
    failures: [AtomicU32; OPS],
    calls: [AtomicU32; OPS],
}

impl<S> FaultyStore<S> {
    /// Wraps `inner`; no faults until [`fail_next`](Self::fail_next).
    pub fn new(inner: S) -> Self {
        Self {
            inner,
            failures: Default::default(),
            calls: Default::default(),
        }
    }

    /// Makes the next `n` calls of `op` fail.
    pub fn fail_next(&self, op: Op, n: u32) {
        self.failures[op as usize].store(n, Ordering::SeqCst);
    }

    /// How many times `op` was called (failed or not).
    pub fn calls(&self, op: Op) -> u32 {
        self.calls[op as usize].load(Ordering::SeqCst)
    }

    /// The wrapped store.
    pub fn inner(&self) -> &S {
        &self.inner
    }

    fn check(&self, op: Op) -> Result<(), StoreError> {
        self.calls[op as usize].fetch_add(1, Ordering::SeqCst);
        let left = &self.failures[op as usize];
        match left.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1)) {
            Ok(_) => Err(StoreError::unavailable(format!("injected fault in {op:?}"))),
            Err(_) => Ok(()),
        }
    }
}

impl<S: Store> Store for FaultyStore<S> {
    async fn reserve(&self, req: ReserveRequest<'_>) -> Result<Reservation, StoreError> {
        self.check(Op::Reserve)?;
        self.inner.reserve(req).await
    }

    async fn get(&self, scope: &Scope, key: &IdempotencyKey) -> Result<Option<Record>, StoreError> {
        self.inner.get(scope, key).await
    }

    async fn resolve(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        lease: &Lease,
        outcome: &FinalOutcome,
    ) -> Result<(), StoreError> {
        self.check(Op::Resolve)?;
        self.inner.resolve(scope, key, lease, outcome).await
    }

    async fn release(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        lease: &Lease,
    ) -> Result<(), StoreError> {
        self.check(Op::Release)?;
        self.inner.release(scope, key, lease).await
    }

    async fn mark_unknown(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        lease: &Lease,
        reason: &str,
    ) -> Result<(), StoreError> {
        self.check(Op::MarkUnknown)?;
        self.inner.mark_unknown(scope, key, lease, reason).await
    }

    async fn renew(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        lease: &Lease,
        duration: Duration,
    ) -> Result<Timestamp, StoreError> {
        self.check(Op::Renew)?;
        self.inner.renew(scope, key, lease, duration).await
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
}
