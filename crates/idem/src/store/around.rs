//! [`Around`]: the one generic store decorator. Whatever is done around
//! every operation of a store without changing what it means — timing it,
//! counting it, bounding it with a time-out, failing it on purpose in a
//! test, waiting for a store that is still connecting — is a [`Hook`];
//! `Around` turns a hook into a [`Store`] (and a [`ListRecords`] and a
//! [`Purge`] where the inner store is one), so no decorator spells out the
//! nine methods again.
//!
//! Decorators that change what an operation means (`Tiered`, `Sealed`,
//! `DynStore`) implement the traits themselves.
//!
//! ```
//! use std::future::Future;
//! use std::sync::atomic::{AtomicU32, Ordering};
//!
//! use idem::store::{Around, Hook, Op, Store, StoreError};
//! use idem::{IdempotencyKey, MemoryStore, Scope};
//!
//! /// Counts the operations that reach the store.
//! struct Counted {
//!     store: MemoryStore,
//!     calls: AtomicU32,
//! }
//!
//! impl Hook for Counted {
//!     type Inner = MemoryStore;
//!
//!     fn around<'a, T, Fut>(
//!         &'a self,
//!         _op: Op,
//!         call: impl FnOnce(&'a MemoryStore) -> Fut + Send + 'a,
//!     ) -> impl Future<Output = Result<T, StoreError>> + Send + 'a
//!     where
//!         T: Send + 'a,
//!         Fut: Future<Output = Result<T, StoreError>> + Send + 'a,
//!     {
//!         self.calls.fetch_add(1, Ordering::Relaxed);
//!         call(&self.store)
//!     }
//! }
//!
//! # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
//! let store = Around::new(Counted { store: MemoryStore::new(), calls: AtomicU32::new(0) });
//! let scope = Scope::new("tenant", "POST /v1/payments").unwrap();
//! let key: IdempotencyKey = "k1".parse().unwrap();
//! assert!(store.get(&scope, &key).await.unwrap().is_none());
//! assert_eq!(store.hook().calls.load(Ordering::Relaxed), 1);
//! # });
//! ```

use std::future::Future;
use std::time::Duration;

use super::op::Op;
use super::{
    FinalOutcome, ListFilter, ListRecords, Page, Purge, Reservation, ReserveRequest, Store,
    StoreError,
};
use crate::record::Lease;
use crate::{IdempotencyKey, Record, Scope, Timestamp};

/// What runs around every operation of a store; see the [module docs](self).
pub trait Hook: Send + Sync + 'static {
    /// The store the operations run on.
    type Inner: Store;

    /// Runs operation `op`: `call` starts it on the inner store (nothing
    /// happens in the store until the future it returns is polled, so a
    /// hook may refuse an operation by not polling it). The hook may time
    /// it, bound it, count it, or answer in its place.
    fn around<'a, T, Fut>(
        &'a self,
        op: Op,
        call: impl FnOnce(&'a Self::Inner) -> Fut + Send + 'a,
    ) -> impl Future<Output = Result<T, StoreError>> + Send + 'a
    where
        T: Send + 'a,
        Fut: Future<Output = Result<T, StoreError>> + Send + 'a;
}

/// A store whose every operation goes through a [`Hook`].
#[derive(Debug, Clone)]
pub struct Around<H> {
    hook: H,
}

impl<H: Hook> Around<H> {
    /// Routes every operation through `hook`.
    pub fn new(hook: H) -> Self {
        Self { hook }
    }

    /// The hook.
    pub fn hook(&self) -> &H {
        &self.hook
    }
}

// The methods return `impl Future + Send` explicitly rather than being
// `async fn`: written as `async fn`, the futures' `Send` is inferred through
// the hook's lifetimes and lost for callers such as axum handlers.
#[allow(clippy::manual_async_fn)]
impl<H: Hook> Store for Around<H> {
    fn reserve(
        &self,
        req: ReserveRequest<'_>,
    ) -> impl Future<Output = Result<Reservation, StoreError>> + Send {
        async move { self.hook.around(Op::Reserve, move |s| s.reserve(req)).await }
    }

    fn get(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
    ) -> impl Future<Output = Result<Option<Record>, StoreError>> + Send {
        async move { self.hook.around(Op::Get, move |s| s.get(scope, key)).await }
    }

    fn resolve(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        lease: &Lease,
        outcome: &FinalOutcome,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        async move {
            self.hook
                .around(Op::Resolve, move |s| s.resolve(scope, key, lease, outcome))
                .await
        }
    }

    fn release(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        lease: &Lease,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        async move {
            self.hook
                .around(Op::Release, move |s| s.release(scope, key, lease))
                .await
        }
    }

    fn mark_unknown(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        lease: &Lease,
        reason: &str,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        async move {
            self.hook
                .around(Op::MarkUnknown, move |s| {
                    s.mark_unknown(scope, key, lease, reason)
                })
                .await
        }
    }

    fn renew(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        lease: &Lease,
        duration: Duration,
    ) -> impl Future<Output = Result<Timestamp, StoreError>> + Send {
        async move {
            self.hook
                .around(Op::Renew, move |s| s.renew(scope, key, lease, duration))
                .await
        }
    }
}

#[allow(clippy::manual_async_fn)]
impl<H: Hook> ListRecords for Around<H>
where
    H::Inner: ListRecords,
{
    fn list(&self, filter: &ListFilter) -> impl Future<Output = Result<Page, StoreError>> + Send {
        async move { self.hook.around(Op::List, move |s| s.list(filter)).await }
    }
}

#[allow(clippy::manual_async_fn)]
impl<H: Hook> Purge for Around<H>
where
    H::Inner: Purge,
{
    fn purge_expired(&self, batch: usize) -> impl Future<Output = Result<u64, StoreError>> + Send {
        async move {
            self.hook
                .around(Op::Purge, move |s| s.purge_expired(batch))
                .await
        }
    }

    fn delete(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send {
        async move {
            self.hook
                .around(Op::Delete, move |s| s.delete(scope, key))
                .await
        }
    }
}
