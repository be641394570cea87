//! An in-process store for tests, single-process services and as the fast
//! tier of [`Tiered`](crate::Tiered).
//!
//! Records live in a sharded hash map; every operation takes one shard lock,
//! so reservation is atomic and concurrent callers on different keys rarely
//! contend. Nothing survives the process.
//!
//! ```
//! use idem::{Engine, MemoryStore};
//! let engine = Engine::new(MemoryStore::new());
//! # let _ = engine;
//! ```

use std::collections::HashMap;
use std::hash::{BuildHasher, Hash, Hasher, RandomState};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use crate::store::{
    Cursor, ExistingDecision, FinalOutcome, ListFilter, ListRecords, Page, Purge, Reservation,
    ReserveRequest, Store, StoreError, decide_existing,
};
use crate::tiered::CacheStore;
use crate::{IdempotencyKey, Lease, OUTCOME_UNKNOWN, Record, RecordState, Scope, Timestamp};

const SHARDS: usize = 16;

type Id = (Scope, IdempotencyKey);
type Shard = HashMap<Id, Record>;

/// In-memory [`Store`].
#[derive(Debug)]
pub struct MemoryStore {
    shards: Box<[Mutex<Shard>]>,
    hasher: RandomState,
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self::new()
    }
}

impl MemoryStore {
    /// An empty store.
    pub fn new() -> Self {
        Self {
            shards: (0..SHARDS).map(|_| Mutex::new(HashMap::new())).collect(),
            hasher: RandomState::new(),
        }
    }

    /// Number of records held (including expired ones not yet purged).
    pub fn len(&self) -> usize {
        self.shards.iter().map(|s| lock(s).len()).sum()
    }

    /// Whether no record is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn shard(&self, scope: &Scope, key: &IdempotencyKey) -> MutexGuard<'_, Shard> {
        let mut h = self.hasher.build_hasher();
        scope.hash(&mut h);
        key.hash(&mut h);
        lock(&self.shards[(h.finish() as usize) % SHARDS])
    }

    /// Runs `f` on the record if `lease` is the current lease of a record
    /// that `allowed` accepts.
    fn with_owned<T>(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        lease: &Lease,
        allowed: fn(&Record, &Lease) -> bool,
        f: impl FnOnce(&mut Shard, Id) -> T,
    ) -> Result<T, StoreError> {
        let mut shard = self.shard(scope, key);
        let id = (scope.clone(), key.clone());
        match shard.get(&id) {
            Some(r) if allowed(r, lease) => Ok(f(&mut shard, id)),
            _ => Err(StoreError::Fenced),
        }
    }
}

/// A poisoned lock only means another thread panicked mid-operation; every
/// operation leaves the map consistent before it can panic, so go on.
fn lock(m: &Mutex<Shard>) -> MutexGuard<'_, Shard> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn owns(record: &Record, lease: &Lease) -> bool {
    record.state == RecordState::Processing && same_attempt(record, lease)
}

fn same_attempt(record: &Record, lease: &Lease) -> bool {
    record.lease.owner == lease.owner && record.lease.attempt == lease.attempt
}

fn new_record(req: &ReserveRequest<'_>, now: Timestamp, attempt: u32) -> Record {
    Record {
        scope: req.scope.clone(),
        key: req.key.clone(),
        fingerprint: req.fingerprint,
        state: RecordState::Processing,
        created_at: now,
        updated_at: now,
        expires_at: now.plus(req.retention),
        lease: Lease {
            owner: req.owner,
            attempt,
            locked_until: now.plus(req.lease),
        },
        response: None,
        resource_id: None,
        error_code: None,
    }
}

impl Store for MemoryStore {
    async fn reserve(&self, req: ReserveRequest<'_>) -> Result<Reservation, StoreError> {
        let now = Timestamp::now();
        let mut shard = self.shard(req.scope, req.key);
        let id = (req.scope.clone(), req.key.clone());
        let Some(existing) = shard.get_mut(&id) else {
            let record = new_record(&req, now, 1);
            let lease = record.lease;
            shard.insert(id, record);
            return Ok(Reservation::Acquired(lease));
        };
        Ok(match decide_existing(existing, &req, now) {
            ExistingDecision::Replace => {
                *existing = new_record(&req, now, 1);
                Reservation::Acquired(existing.lease)
            }
            ExistingDecision::TakeOver => {
                existing.lease = Lease {
                    owner: req.owner,
                    attempt: existing.lease.attempt + 1,
                    locked_until: now.plus(req.lease),
                };
                existing.updated_at = now;
                Reservation::Acquired(existing.lease)
            }
            ExistingDecision::Replay => Reservation::Existing(Box::new(existing.clone())),
            ExistingDecision::InProgress { retry_after } => Reservation::InProgress {
                retry_after,
                outcome_unknown: existing.is_outcome_unknown(),
            },
            ExistingDecision::Mismatch => Reservation::Mismatch {
                state: existing.state,
            },
        })
    }

    async fn get(&self, scope: &Scope, key: &IdempotencyKey) -> Result<Option<Record>, StoreError> {
        let now = Timestamp::now();
        let shard = self.shard(scope, key);
        Ok(shard
            .get(&(scope.clone(), key.clone()))
            .filter(|r| !r.is_expired(now))
            .cloned())
    }

    async fn resolve(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        lease: &Lease,
        outcome: &FinalOutcome,
    ) -> Result<(), StoreError> {
        let now = Timestamp::now();
        self.with_owned(scope, key, lease, same_attempt, |shard, id| {
            if let Some(r) = shard.get_mut(&id) {
                r.state = outcome.verdict.into();
                r.updated_at = now;
                r.expires_at = now.plus(outcome.retention);
                r.response = Some(outcome.response.clone());
                r.resource_id.clone_from(&outcome.resource_id);
                r.error_code.clone_from(&outcome.error_code);
            }
        })
    }

    async fn release(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        lease: &Lease,
    ) -> Result<(), StoreError> {
        self.with_owned(scope, key, lease, owns, |shard, id| {
            shard.remove(&id);
        })
    }

    async fn mark_unknown(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        lease: &Lease,
        _reason: &str,
    ) -> Result<(), StoreError> {
        let now = Timestamp::now();
        self.with_owned(scope, key, lease, owns, |shard, id| {
            if let Some(r) = shard.get_mut(&id) {
                r.error_code = Some(OUTCOME_UNKNOWN.to_owned());
                r.updated_at = now;
            }
        })
    }

    async fn renew(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        lease: &Lease,
        duration: Duration,
    ) -> Result<Timestamp, StoreError> {
        let now = Timestamp::now();
        let until = now.plus(duration);
        self.with_owned(scope, key, lease, owns, |shard, id| {
            if let Some(r) = shard.get_mut(&id) {
                r.lease.locked_until = until;
                r.updated_at = now;
            }
        })?;
        Ok(until)
    }
}

impl ListRecords for MemoryStore {
    async fn list(&self, filter: &ListFilter) -> Result<Page, StoreError> {
        let now = Timestamp::now();
        let cutoff = filter.older_than.map(|age| now.minus(age));
        let mut records: Vec<Record> = Vec::new();
        for shard in self.shards.iter() {
            let shard = lock(shard);
            records.extend(
                shard
                    .values()
                    .filter(|r| !r.is_expired(now))
                    .filter(|r| filter.state.is_none_or(|s| r.state == s))
                    .filter(|r| cutoff.is_none_or(|c| r.created_at <= c))
                    .filter(|r| {
                        filter
                            .tenant
                            .as_deref()
                            .is_none_or(|t| r.scope.tenant() == t)
                    })
                    .filter(|r| filter.after.as_ref().is_none_or(|c| c.is_before(r)))
                    .cloned(),
            );
        }
        records.sort_by(|a, b| {
            (a.created_at, &a.scope, &a.key).cmp(&(b.created_at, &b.scope, &b.key))
        });
        let limit = filter.limit.max(1);
        let next = if records.len() > limit {
            records.truncate(limit);
            records.last().map(Cursor::after)
        } else {
            None
        };
        Ok(Page { records, next })
    }
}

impl Purge for MemoryStore {
    async fn purge_expired(&self, batch: usize) -> Result<u64, StoreError> {
        let now = Timestamp::now();
        let mut left = batch;
        let mut deleted = 0;
        for shard in self.shards.iter() {
            if left == 0 {
                break;
            }
            let mut shard = lock(shard);
            let doomed: Vec<Id> = shard
                .iter()
                .filter(|(_, r)| r.is_expired(now))
                .map(|(id, _)| id.clone())
                .take(left)
                .collect();
            for id in doomed {
                shard.remove(&id);
                left -= 1;
                deleted += 1;
            }
        }
        Ok(deleted)
    }

    async fn delete(&self, scope: &Scope, key: &IdempotencyKey) -> Result<bool, StoreError> {
        Ok(self
            .shard(scope, key)
            .remove(&(scope.clone(), key.clone()))
            .is_some())
    }
}

impl CacheStore for MemoryStore {
    async fn put(&self, record: Record) -> Result<(), StoreError> {
        let mut shard = self.shard(&record.scope, &record.key);
        shard.insert((record.scope.clone(), record.key.clone()), record);
        Ok(())
    }

    async fn evict(&self, scope: &Scope, key: &IdempotencyKey) -> Result<(), StoreError> {
        self.shard(scope, key).remove(&(scope.clone(), key.clone()));
        Ok(())
    }
}
