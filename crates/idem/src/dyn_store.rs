//! A store chosen at run time.
//!
//! Library users are generic over `S: Store`; a binary that picks the
//! backend from a URL (the `idem` gateway) needs one type for all of them.
//! [`DynStore`] boxes any store that also lists and purges, at the cost of
//! one allocation per operation.
//!
//! ```
//! use idem::{DynStore, Engine, MemoryStore};
//! let store = DynStore::new(MemoryStore::new());
//! let engine = Engine::new(store.clone());
//! # let _ = engine;
//! ```

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use crate::store::{
    FinalOutcome, ListFilter, ListRecords, Page, Purge, Reservation, ReserveRequest, Store,
    StoreError,
};
use crate::{IdempotencyKey, Lease, Record, Scope, Timestamp};

type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// The object-safe mirror of [`Store`] + [`ListRecords`] + [`Purge`],
/// implemented for every such store.
trait ErasedStore: Send + Sync + 'static {
    fn reserve<'a>(
        &'a self,
        req: ReserveRequest<'a>,
    ) -> BoxFuture<'a, Result<Reservation, StoreError>>;
    fn get<'a>(
        &'a self,
        scope: &'a Scope,
        key: &'a IdempotencyKey,
    ) -> BoxFuture<'a, Result<Option<Record>, StoreError>>;
    fn resolve<'a>(
        &'a self,
        scope: &'a Scope,
        key: &'a IdempotencyKey,
        lease: &'a Lease,
        outcome: &'a FinalOutcome,
    ) -> BoxFuture<'a, Result<(), StoreError>>;
    fn release<'a>(
        &'a self,
        scope: &'a Scope,
        key: &'a IdempotencyKey,
        lease: &'a Lease,
    ) -> BoxFuture<'a, Result<(), StoreError>>;
    fn mark_unknown<'a>(
        &'a self,
        scope: &'a Scope,
        key: &'a IdempotencyKey,
        lease: &'a Lease,
        reason: &'a str,
    ) -> BoxFuture<'a, Result<(), StoreError>>;
    fn renew<'a>(
        &'a self,
        scope: &'a Scope,
        key: &'a IdempotencyKey,
        lease: &'a Lease,
        duration: Duration,
    ) -> BoxFuture<'a, Result<Timestamp, StoreError>>;
    fn list<'a>(&'a self, filter: &'a ListFilter) -> BoxFuture<'a, Result<Page, StoreError>>;
    fn purge_expired(&self, batch: usize) -> BoxFuture<'_, Result<u64, StoreError>>;
    fn delete<'a>(
        &'a self,
        scope: &'a Scope,
        key: &'a IdempotencyKey,
    ) -> BoxFuture<'a, Result<bool, StoreError>>;
}

impl<S: Store + ListRecords + Purge> ErasedStore for S {
    fn reserve<'a>(
        &'a self,
        req: ReserveRequest<'a>,
    ) -> BoxFuture<'a, Result<Reservation, StoreError>> {
        Box::pin(Store::reserve(self, req))
    }
    fn get<'a>(
        &'a self,
        scope: &'a Scope,
        key: &'a IdempotencyKey,
    ) -> BoxFuture<'a, Result<Option<Record>, StoreError>> {
        Box::pin(Store::get(self, scope, key))
    }
    fn resolve<'a>(
        &'a self,
        scope: &'a Scope,
        key: &'a IdempotencyKey,
        lease: &'a Lease,
        outcome: &'a FinalOutcome,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(Store::resolve(self, scope, key, lease, outcome))
    }
    fn release<'a>(
        &'a self,
        scope: &'a Scope,
        key: &'a IdempotencyKey,
        lease: &'a Lease,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(Store::release(self, scope, key, lease))
    }
    fn mark_unknown<'a>(
        &'a self,
        scope: &'a Scope,
        key: &'a IdempotencyKey,
        lease: &'a Lease,
        reason: &'a str,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(Store::mark_unknown(self, scope, key, lease, reason))
    }
    fn renew<'a>(
        &'a self,
        scope: &'a Scope,
        key: &'a IdempotencyKey,
        lease: &'a Lease,
        duration: Duration,
    ) -> BoxFuture<'a, Result<Timestamp, StoreError>> {
        Box::pin(Store::renew(self, scope, key, lease, duration))
    }
    fn list<'a>(&'a self, filter: &'a ListFilter) -> BoxFuture<'a, Result<Page, StoreError>> {
        Box::pin(ListRecords::list(self, filter))
    }
    fn purge_expired(&self, batch: usize) -> BoxFuture<'_, Result<u64, StoreError>> {
        Box::pin(Purge::purge_expired(self, batch))
    }
    fn delete<'a>(
        &'a self,
        scope: &'a Scope,
        key: &'a IdempotencyKey,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        Box::pin(Purge::delete(self, scope, key))
    }
}

/// Any store (that also lists and purges) behind one type; cheap to clone.
#[derive(Clone)]
pub struct DynStore {
    inner: Arc<dyn ErasedStore>,
    name: &'static str,
}

impl std::fmt::Debug for DynStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("DynStore").field(&self.name).finish()
    }
}

impl DynStore {
    /// Boxes `store`.
    pub fn new<S: Store + ListRecords + Purge>(store: S) -> Self {
        Self::from_arc(Arc::new(store))
    }

    /// Boxes a shared store.
    pub fn from_arc<S: Store + ListRecords + Purge>(store: Arc<S>) -> Self {
        Self {
            inner: store,
            name: std::any::type_name::<S>(),
        }
    }

    /// The concrete store's type name (for logs).
    pub fn type_name(&self) -> &'static str {
        self.name
    }
}

impl Store for DynStore {
    async fn reserve(&self, req: ReserveRequest<'_>) -> Result<Reservation, StoreError> {
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
        self.inner.resolve(scope, key, lease, outcome).await
    }

    async fn release(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        lease: &Lease,
    ) -> Result<(), StoreError> {
        self.inner.release(scope, key, lease).await
    }

    async fn mark_unknown(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        lease: &Lease,
        reason: &str,
    ) -> Result<(), StoreError> {
        self.inner.mark_unknown(scope, key, lease, reason).await
    }

    async fn renew(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        lease: &Lease,
        duration: Duration,
    ) -> Result<Timestamp, StoreError> {
        self.inner.renew(scope, key, lease, duration).await
    }
}

impl ListRecords for DynStore {
    async fn list(&self, filter: &ListFilter) -> Result<Page, StoreError> {
        self.inner.list(filter).await
    }
}

impl Purge for DynStore {
    async fn purge_expired(&self, batch: usize) -> Result<u64, StoreError> {
        self.inner.purge_expired(batch).await
    }

    async fn delete(&self, scope: &Scope, key: &IdempotencyKey) -> Result<bool, StoreError> {
        self.inner.delete(scope, key).await
    }
}
