//! The storage contract every backend implements.
//!
//! A [`Store`] keeps records and makes every state change atomic and fenced:
//!
//! 1. [`reserve`](Store::reserve) is one atomic create-if-absent (or takeover
//!    of a lapsed lease), never read-then-write across two round trips;
//! 2. [`resolve`](Store::resolve), [`release`](Store::release),
//!    [`mark_unknown`](Store::mark_unknown) and [`renew`](Store::renew)
//!    succeed only for the current owner token *and* attempt; anyone else
//!    gets [`StoreError::Fenced`];
//! 3. a key reused with a different fingerprint is a mismatch, whatever the
//!    record's state;
//! 4. a processing record (including one whose outcome is unknown) is never
//!    purged;
//! 5. all times come from the store's one clock.
//!
//! Optional capabilities are separate traits: [`ListRecords`], [`Purge`].
//! The shared conformance suite (crate `idem-testkit`) checks all of this
//! against every backend.

pub mod around;
pub mod backend;
pub mod group;
pub mod local;
pub mod op;

pub use around::{Around, Hook};
pub use backend::{ExistingDecision, Migrated, decide_existing, redact_broker_url, redact_url};
pub use op::Op;

use std::error::Error as StdError;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use crate::{
    Fingerprint, IdempotencyKey, LeaseExpiry, Record, RecordState, Scope, StoredResponse,
    Timestamp,
    record::{Lease, OwnerToken},
};

/// A boxed error from a backend driver, kept as the cause.
pub type BoxError = Box<dyn StdError + Send + Sync + 'static>;

/// What went wrong in a store. Backends map their driver errors into it and
/// keep the driver error as the [`source`](StdError::source).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// The caller does not own the record (any more): another attempt took
    /// the lease over, or the record was released, resolved or deleted.
    #[error(
        "lease lost: this attempt no longer owns the record (taken over, released or resolved)"
    )]
    Fenced,
    /// The store cannot be reached or is too busy right now; retrying later
    /// may succeed.
    #[error("store unavailable: {0}")]
    Unavailable(#[source] BoxError),
    /// Stored data cannot be read back (a corrupt file, an unknown schema).
    #[error("store data is corrupt or unreadable: {0}")]
    Corrupt(#[source] BoxError),
    /// Any other backend failure.
    #[error("store failure: {0}")]
    Backend(#[source] BoxError),
}

impl StoreError {
    /// Whether retrying the same operation later may succeed.
    pub fn is_transient(&self) -> bool {
        matches!(self, Self::Unavailable(_))
    }

    /// Wraps a transient error given as text.
    pub fn unavailable(msg: impl Into<String>) -> Self {
        Self::Unavailable(msg.into().into())
    }

    /// Wraps a corruption described as text.
    pub fn corrupt(msg: impl Into<String>) -> Self {
        Self::Corrupt(msg.into().into())
    }
}

/// Everything a store needs to reserve a record.
#[derive(Debug, Clone, Copy)]
pub struct ReserveRequest<'a> {
    /// Tenant and operation.
    pub scope: &'a Scope,
    /// The client's key.
    pub key: &'a IdempotencyKey,
    /// Fingerprint of this request.
    pub fingerprint: Fingerprint,
    /// Token of the would-be owner.
    pub owner: OwnerToken,
    /// How long the new attempt holds the record.
    pub lease: Duration,
    /// Initial retention (replaced when the record is resolved).
    pub retention: Duration,
    /// Whether a lapsed lease may be taken over.
    pub on_lease_expiry: LeaseExpiry,
}

/// What [`Store::reserve`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reservation {
    /// The caller owns the record now: run the work.
    Acquired(Lease),
    /// A final record for the same request exists: replay it.
    Existing(Box<Record>),
    /// Another attempt holds a live lease (or a lapsed one under
    /// [`LeaseExpiry::Hold`]).
    InProgress {
        /// When asking again is worthwhile.
        retry_after: Duration,
        /// Whether the earlier attempt may have taken effect and nobody is
        /// running it: the record is marked outcome-unknown, or its lease
        /// lapsed under [`LeaseExpiry::Hold`] (the record is held).
        outcome_unknown: bool,
    },
    /// The key was used for a different request.
    Mismatch {
        /// State of the existing record.
        state: RecordState,
    },
}

/// The two final verdicts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// The work succeeded.
    Completed,
    /// The work failed deterministically; replay the failure.
    Failed,
}

impl From<Verdict> for RecordState {
    fn from(v: Verdict) -> Self {
        match v {
            Verdict::Completed => RecordState::Completed,
            Verdict::Failed => RecordState::Failed,
        }
    }
}

/// The final answer the owner records.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FinalOutcome {
    /// Completed or failed.
    pub verdict: Verdict,
    /// What to replay.
    pub response: StoredResponse,
    /// Identifier of what was created, if any.
    pub resource_id: Option<String>,
    /// Machine-readable reason (for failures).
    pub error_code: Option<String>,
    /// How long to keep it, from now.
    pub retention: Duration,
}

/// Filter and page position for [`ListRecords::list`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ListFilter {
    /// Only records in this state.
    pub state: Option<RecordState>,
    /// Only records created at least this long ago.
    pub older_than: Option<Duration>,
    /// Only this tenant's records.
    pub tenant: Option<String>,
    /// At most this many; a store returns [`ListFilter::page_size`] at most.
    pub limit: usize,
    /// Continue after this position (from a previous [`Page`]).
    pub after: Option<Cursor>,
}

/// Most records one [`ListRecords::list`] call returns, whatever its
/// [`ListFilter::limit`]: each record can carry a stored answer as large as
/// the body limit, so a page's memory stays bounded only if its length is.
pub const MAX_PAGE: usize = 1_000;

impl ListFilter {
    /// The length of the page a store returns: [`ListFilter::limit`], at
    /// least 1 and at most [`MAX_PAGE`].
    pub fn page_size(&self) -> usize {
        self.limit.clamp(1, MAX_PAGE)
    }
}

/// A position in the listing order `(created_at, tenant, operation, key)`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cursor {
    /// Creation time of the last record returned.
    pub created_at: Timestamp,
    /// Its tenant.
    pub tenant: String,
    /// Its operation.
    pub operation: String,
    /// Its key.
    pub key: String,
}

impl Cursor {
    /// The cursor pointing just after `record`.
    pub fn after(record: &Record) -> Self {
        Self {
            created_at: record.created_at,
            tenant: record.scope.tenant().to_owned(),
            operation: record.scope.operation().to_owned(),
            key: record.key.as_str().to_owned(),
        }
    }

    /// Whether `record` sorts after this cursor.
    pub fn is_before(&self, record: &Record) -> bool {
        (
            record.created_at,
            record.scope.tenant(),
            record.scope.operation(),
            record.key.as_str(),
        ) > (
            self.created_at,
            self.tenant.as_str(),
            self.operation.as_str(),
            self.key.as_str(),
        )
    }
}

/// One page of records, oldest first.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Page {
    /// The records.
    pub records: Vec<Record>,
    /// Where the next page starts, if there may be one.
    pub next: Option<Cursor>,
}

impl Page {
    /// The page of `page_size` records out of `records`, read in listing
    /// order with one more than the page when there is one: the extra
    /// record only says that a next page exists, and the cursor points
    /// after the page's last record.
    pub fn from_read_ahead(mut records: Vec<Record>, page_size: usize) -> Self {
        let next = if records.len() > page_size {
            records.truncate(page_size);
            records.last().map(Cursor::after)
        } else {
            None
        };
        Self { records, next }
    }
}

/// The storage contract; see the [module docs](self) for the rules every
/// implementation keeps.
pub trait Store: Send + Sync + 'static {
    /// Atomically creates a `processing` record owned by `req.owner`, or
    /// takes over one whose lease lapsed (when the policy allows), or reports
    /// what is there.
    fn reserve(
        &self,
        req: ReserveRequest<'_>,
    ) -> impl Future<Output = Result<Reservation, StoreError>> + Send;

    /// Reads a record; `None` if absent or expired.
    fn get(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
    ) -> impl Future<Output = Result<Option<Record>, StoreError>> + Send;

    /// Records the final answer, if `lease` is still the current one.
    ///
    /// Idempotent for its owner: resolving a record that this same
    /// owner and attempt already resolved succeeds again (so a retry after an
    /// ambiguous failure is safe). Anyone else gets [`StoreError::Fenced`].
    fn resolve(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        lease: &Lease,
        outcome: &FinalOutcome,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Deletes the record so the key can be used again, if `lease` is still
    /// the current one: the work had no effect.
    fn release(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        lease: &Lease,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Marks the record [`OUTCOME_UNKNOWN`](crate::OUTCOME_UNKNOWN) (it stays
    /// processing), if `lease` is still the current one.
    fn mark_unknown(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        lease: &Lease,
        reason: &str,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Extends the lease to `now + duration`, if `lease` is still the
    /// current one; returns the new expiry.
    fn renew(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        lease: &Lease,
        duration: Duration,
    ) -> impl Future<Output = Result<Timestamp, StoreError>> + Send;
}

/// Listing records for operators (admin API, CLI, stuck-record monitor).
pub trait ListRecords: Store {
    /// Records matching `filter`, oldest first.
    fn list(&self, filter: &ListFilter) -> impl Future<Output = Result<Page, StoreError>> + Send;
}

/// Batched removal of expired final records.
pub trait Purge: Store {
    /// Deletes at most `batch` completed or failed records whose retention
    /// has passed; never a processing one. Returns how many were deleted.
    fn purge_expired(&self, batch: usize) -> impl Future<Output = Result<u64, StoreError>> + Send;

    /// Deletes one record whatever its state — an operator's decision (a
    /// record written by mistake, a key a client must be able to reuse).
    /// Returns whether there was a record. An owner still working on a
    /// deleted processing record is fenced out when it tries to record.
    fn delete(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send;
}

impl<S: Store> Store for Arc<S> {
    fn reserve(
        &self,
        req: ReserveRequest<'_>,
    ) -> impl Future<Output = Result<Reservation, StoreError>> + Send {
        (**self).reserve(req)
    }

    fn get(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
    ) -> impl Future<Output = Result<Option<Record>, StoreError>> + Send {
        (**self).get(scope, key)
    }

    fn resolve(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        lease: &Lease,
        outcome: &FinalOutcome,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        (**self).resolve(scope, key, lease, outcome)
    }

    fn release(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        lease: &Lease,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        (**self).release(scope, key, lease)
    }

    fn mark_unknown(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        lease: &Lease,
        reason: &str,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        (**self).mark_unknown(scope, key, lease, reason)
    }

    fn renew(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        lease: &Lease,
        duration: Duration,
    ) -> impl Future<Output = Result<Timestamp, StoreError>> + Send {
        (**self).renew(scope, key, lease, duration)
    }
}

impl<S: ListRecords> ListRecords for Arc<S> {
    fn list(&self, filter: &ListFilter) -> impl Future<Output = Result<Page, StoreError>> + Send {
        (**self).list(filter)
    }
}

impl<S: Purge> Purge for Arc<S> {
    fn purge_expired(&self, batch: usize) -> impl Future<Output = Result<u64, StoreError>> + Send {
        (**self).purge_expired(batch)
    }

    fn delete(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send {
        (**self).delete(scope, key)
    }
}
