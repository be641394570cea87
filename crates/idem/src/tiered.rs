//! Two stores as one: a fast cache in front of a durable source of truth.
//!
//! [`Tiered<Fast, Durable>`](Tiered) answers replays and in-flight
//! conflicts from the fast store (e.g. Redis) when it can, and makes every
//! reservation and every resolution in the durable store (e.g. PostgreSQL)
//! **first**. The fast store is only ever a copy: if it loses everything (a
//! restart, `FLUSHALL`, eviction), requests fall through to the durable
//! store, which still replays completed work and still refuses duplicates.
//! Writes to the fast store are best effort; a failed one costs a durable
//! round trip later, never a duplicate execution.
//!
//! ```
//! use idem::{Engine, MemoryStore, Tiered};
//! let store = Tiered::new(MemoryStore::new(), MemoryStore::new());
//! let engine = Engine::new(store);
//! # let _ = engine;
//! ```

use std::future::Future;
use std::time::Duration;

use crate::store::{
    FinalOutcome, ListFilter, ListRecords, Page, Purge, Reservation, ReserveRequest, Store,
    StoreError,
};
use crate::{IdempotencyKey, Lease, Record, RecordState, Scope, Timestamp};

/// A store that can also hold copies of records made elsewhere: the fast
/// tier of [`Tiered`].
pub trait CacheStore: Store {
    /// Stores `record` as is, replacing any copy.
    fn put(&self, record: Record) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Drops any copy of the record.
    fn evict(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Whether copies of records still in progress are worth keeping
    /// (default: yes). A shared cache (Redis) answers the in-flight
    /// duplicates that reach other gateways; an in-process cache mostly
    /// sees its own requests, so it keeps only final records, and a fresh
    /// reservation costs it nothing.
    fn keeps_in_progress(&self) -> bool {
        true
    }
}

/// A fast cache over a durable store; see the [module docs](self).
#[derive(Debug, Clone)]
pub struct Tiered<F, D> {
    fast: F,
    durable: D,
}

impl<F, D> Tiered<F, D> {
    /// Composes `fast` in front of `durable`.
    pub fn new(fast: F, durable: D) -> Self {
        Self { fast, durable }
    }

    /// The fast tier.
    pub fn fast(&self) -> &F {
        &self.fast
    }

    /// The durable tier.
    pub fn durable(&self) -> &D {
        &self.durable
    }
}

impl<F: CacheStore, D: Store> Tiered<F, D> {
    /// What the fast copy alone can answer, if anything. Only a final record
    /// (replay or mismatch) or a live lease on the same request are
    /// answered; anything else asks the durable store. Lease liveness is
    /// judged on this process' clock, which at worst makes a duplicate wait
    /// a little longer before the durable store decides. The copy's lease
    /// end was set on the durable store's clock, which may run ahead of this
    /// one, so the wait it suggests is capped at the caller's lease: no
    /// lease granted from the store's own now lasts longer.
    fn answer_from_copy(copy: Record, req: &ReserveRequest<'_>) -> Option<Reservation> {
        let now = Timestamp::now();
        if copy.is_expired(now) {
            return None;
        }
        match copy.state {
            RecordState::Completed | RecordState::Failed => {
                Some(if copy.fingerprint == req.fingerprint {
                    Reservation::Existing(Box::new(copy))
                } else {
                    Reservation::Mismatch { state: copy.state }
                })
            }
            RecordState::Processing
                if copy.fingerprint == req.fingerprint && copy.lease_live(now) =>
            {
                Some(Reservation::InProgress {
                    retry_after: copy.lease.locked_until.since(now).min(req.lease),
                    outcome_unknown: copy.is_outcome_unknown(),
                })
            }
            RecordState::Processing => None,
        }
    }

    /// Applies to the fast copy of an in-progress record the change just
    /// made durable (`change` is not run when the fast tier keeps no such
    /// copies); a copy that cannot follow is dropped.
    async fn follow<T>(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        change: impl Future<Output = Result<T, StoreError>>,
    ) {
        if self.fast.keeps_in_progress() && change.await.is_err() {
            self.drop_copy(scope, key).await;
        }
    }

    async fn drop_copy(&self, scope: &Scope, key: &IdempotencyKey) {
        if let Err(err) = self.fast.evict(scope, key).await {
            tracing::debug!(%err, %scope, %key, "tiered: evicting the fast copy failed");
        }
    }
}

impl<F: CacheStore, D: Store> Store for Tiered<F, D> {
    async fn reserve(&self, req: ReserveRequest<'_>) -> Result<Reservation, StoreError> {
        match self.fast.get(req.scope, req.key).await {
            Ok(Some(copy)) => {
                if let Some(answer) = Self::answer_from_copy(copy, &req) {
                    return Ok(answer);
                }
            }
            Ok(None) => {}
            Err(err) => tracing::debug!(%err, "tiered: fast store read failed; asking durable"),
        }
        let reservation = self.durable.reserve(req).await?;
        let copy = match &reservation {
            Reservation::Acquired(_) if !self.fast.keeps_in_progress() => None,
            Reservation::Acquired(lease) => Some(Record {
                scope: req.scope.clone(),
                key: req.key.clone(),
                fingerprint: req.fingerprint,
                state: RecordState::Processing,
                created_at: lease.locked_until.minus(req.lease),
                updated_at: lease.locked_until.minus(req.lease),
                expires_at: lease.locked_until.plus(req.retention),
                lease: *lease,
                response: None,
                resource_id: None,
                error_code: None,
            }),
            Reservation::Existing(record) => Some((**record).clone()),
            Reservation::InProgress { .. } | Reservation::Mismatch { .. } => None,
        };
        if let Some(copy) = copy
            && let Err(err) = self.fast.put(copy).await
        {
            tracing::debug!(%err, "tiered: caching the record failed");
        }
        Ok(reservation)
    }

    async fn get(&self, scope: &Scope, key: &IdempotencyKey) -> Result<Option<Record>, StoreError> {
        self.durable.get(scope, key).await
    }

    async fn resolve(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        lease: &Lease,
        outcome: &FinalOutcome,
    ) -> Result<(), StoreError> {
        self.durable.resolve(scope, key, lease, outcome).await?;
        self.follow(scope, key, self.fast.resolve(scope, key, lease, outcome))
            .await;
        Ok(())
    }

    async fn release(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        lease: &Lease,
    ) -> Result<(), StoreError> {
        self.durable.release(scope, key, lease).await?;
        self.drop_copy(scope, key).await;
        Ok(())
    }

    async fn mark_unknown(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        lease: &Lease,
        reason: &str,
    ) -> Result<(), StoreError> {
        self.durable.mark_unknown(scope, key, lease, reason).await?;
        self.follow(
            scope,
            key,
            self.fast.mark_unknown(scope, key, lease, reason),
        )
        .await;
        Ok(())
    }

    async fn renew(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        lease: &Lease,
        duration: Duration,
    ) -> Result<Timestamp, StoreError> {
        let until = self.durable.renew(scope, key, lease, duration).await?;
        self.follow(scope, key, self.fast.renew(scope, key, lease, duration))
            .await;
        Ok(until)
    }
}

impl<F: CacheStore, D: ListRecords> ListRecords for Tiered<F, D> {
    async fn list(&self, filter: &ListFilter) -> Result<Page, StoreError> {
        self.durable.list(filter).await
    }
}

impl<F: CacheStore + Purge, D: Purge> Purge for Tiered<F, D> {
    async fn purge_expired(&self, batch: usize) -> Result<u64, StoreError> {
        // The durable count is the one that matters; the fast tier's copies
        // of expired records are dropped too so they stop taking memory.
        let deleted = self.durable.purge_expired(batch).await?;
        if let Err(err) = self.fast.purge_expired(batch).await {
            tracing::debug!(%err, "tiered: purging the fast tier failed");
        }
        Ok(deleted)
    }

    async fn delete(&self, scope: &Scope, key: &IdempotencyKey) -> Result<bool, StoreError> {
        // The copy goes first (so no reader answers from it once the
        // durable record is gone) and again after (in case a reader copied
        // the record back in between).
        self.drop_copy(scope, key).await;
        let existed = self.durable.delete(scope, key).await?;
        self.drop_copy(scope, key).await;
        Ok(existed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Fingerprint, LeaseExpiry, MemoryStore, OwnerToken};

    /// The fast copy of a lease carries the durable store's clock, and this
    /// process reads its own: a few milliseconds apart, so the remaining
    /// time it sees can exceed any lease ever granted. The hint it returns
    /// must not.
    #[tokio::test]
    async fn a_copy_from_a_clock_ahead_never_asks_for_more_than_a_lease() {
        let scope = Scope::new("tenant", "POST /v1/payments").expect("scope");
        let key: IdempotencyKey = "k".parse().expect("key");
        let fingerprint = Fingerprint::builder().json_body(b"{}").finish();
        let lease = Duration::from_millis(300);
        // The durable clock runs 40 ms ahead of this process'.
        let durable_now = Timestamp::now().plus(Duration::from_millis(40));
        let fast = MemoryStore::new();
        fast.put(Record {
            scope: scope.clone(),
            key: key.clone(),
            fingerprint,
            state: RecordState::Processing,
            created_at: durable_now,
            updated_at: durable_now,
            expires_at: durable_now.plus(Duration::from_secs(3600)),
            lease: Lease {
                owner: OwnerToken::random(),
                attempt: 1,
                locked_until: durable_now.plus(lease),
            },
            response: None,
            resource_id: None,
            error_code: None,
        })
        .await
        .expect("put");
        let store = Tiered::new(fast, MemoryStore::new());
        let got = store
            .reserve(ReserveRequest {
                scope: &scope,
                key: &key,
                fingerprint,
                owner: OwnerToken::random(),
                lease,
                retention: Duration::from_secs(3600),
                on_lease_expiry: LeaseExpiry::Retry,
            })
            .await
            .expect("reserve");
        match got {
            Reservation::InProgress {
                retry_after,
                outcome_unknown,
            } => {
                assert!(retry_after <= lease, "{retry_after:?}");
                assert!(!outcome_unknown);
            }
            other => panic!("expected InProgress from the copy, got {other:?}"),
        }
    }
}
