//! An in-process store for tests, single-process services and as the fast
//! tier of [`Tiered`](crate::Tiered).
//!
//! Records live in a sharded hash map; every operation takes one shard lock,
//! so reservation is atomic and concurrent callers on different keys rarely
//! contend. Nothing survives the process.
//!
//! [`MemoryStore::cache`] makes a *bounded* one for the fast tier: it
//! forgets records when over its byte budget, treats a copy older than its
//! age limit as absent, and as a fast tier holds final records only (it
//! answers replays and mismatches; reservations go to the durable tier).
//! A store that forgets is only ever a cache, never the store of record:
//! [`Tiered`](crate::Tiered) asks the durable tier whenever the copy is
//! missing.
//!
//! ```
//! use idem::{Engine, MemoryStore};
//! let engine = Engine::new(MemoryStore::new());
//! # let _ = engine;
//! ```

use std::collections::HashMap;
use std::hash::{BuildHasher, BuildHasherDefault, Hash, Hasher, RandomState};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::store::{
    ExistingDecision, FinalOutcome, ListFilter, ListRecords, Page, Purge, Reservation,
    ReserveRequest, Store, StoreError, decide_existing,
};
use crate::tiered::CacheStore;
use crate::{IdempotencyKey, Lease, OUTCOME_UNKNOWN, Record, RecordState, Scope, Timestamp};

const SHARDS: usize = 16;

/// What a record costs beyond its variable-length parts (map slot, fixed
/// fields, allocation headers), for the byte budget of a bounded store.
const RECORD_OVERHEAD: usize = 256;

/// A record's place: its scope and key, with their hash under the store's
/// secret [`RandomState`], computed once per operation. It picks the shard
/// and is the shard map's hash as it is ([`Prehashed`]): hashing the two
/// strings again inside the shard cost as much as the first time
/// (`callgrind`: some 650 instructions each, twice per operation).
#[derive(Debug, Clone)]
struct Id {
    hash: u64,
    scope: Scope,
    key: IdempotencyKey,
}

impl PartialEq for Id {
    fn eq(&self, other: &Self) -> bool {
        self.hash == other.hash && self.key == other.key && self.scope == other.scope
    }
}

impl Eq for Id {}

impl Hash for Id {
    fn hash<H: Hasher>(&self, state: &mut H) {
        state.write_u64(self.hash);
    }
}

/// The hasher of a shard's map: [`Id`]'s hash, already keyed, passed
/// through. The shard is chosen from bits 32 and up, which the map's
/// own bucket choice (the low bits) and tag (the top seven) leave alone
/// below 2³² buckets, so the keys of one shard still spread over its table.
#[derive(Debug, Default)]
struct Prehashed(u64);

impl Hasher for Prehashed {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        // Only `write_u64` is called (by `Id`); anything else still hashes.
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

#[derive(Debug)]
struct Entry {
    record: Record,
    /// When this entry was written (its age, for a bounded store).
    since: Instant,
}

#[derive(Debug, Default)]
struct Shard {
    map: HashMap<Id, Entry, BuildHasherDefault<Prehashed>>,
    /// Approximate bytes held, by [`weight`].
    bytes: usize,
}

impl Shard {
    fn insert(&mut self, id: Id, record: Record) {
        self.bytes += weight(&record);
        let entry = Entry {
            record,
            since: Instant::now(),
        };
        if let Some(old) = self.map.insert(id, entry) {
            self.bytes -= weight(&old.record);
        }
    }

    fn remove(&mut self, id: &Id) -> Option<Record> {
        let entry = self.map.remove(id)?;
        self.bytes -= weight(&entry.record);
        Some(entry.record)
    }

    /// Changes a record in place, keeping the byte count right.
    fn update<T>(&mut self, id: &Id, f: impl FnOnce(&mut Record) -> T) -> Option<T> {
        let entry = self.map.get_mut(id)?;
        let before = weight(&entry.record);
        let out = f(&mut entry.record);
        self.bytes = self.bytes - before + weight(&entry.record);
        entry.since = Instant::now();
        Some(out)
    }

    /// Brings a bounded shard back under its budget: expired and over-age
    /// copies go first, then arbitrary ones (hash order is as good as
    /// random), down to 7/8 of the budget so that eviction runs rarely.
    fn trim(&mut self, limit: &Limit, now: Timestamp) {
        if self.bytes <= limit.shard_bytes {
            return;
        }
        let target = limit.shard_bytes - limit.shard_bytes / 8;
        let stale: Vec<Id> = self
            .map
            .iter()
            .filter(|(_, e)| limit.is_stale(e, now))
            .map(|(id, _)| id.clone())
            .collect();
        for id in &stale {
            self.remove(id);
        }
        while self.bytes > target {
            let Some(id) = self.map.keys().next().cloned() else {
                break;
            };
            self.remove(&id);
        }
    }
}

/// What a record costs in a bounded store: its variable-length parts plus
/// a fixed overhead. An estimate, not an allocator's count.
fn weight(r: &Record) -> usize {
    let response = r.response.as_ref().map_or(0, |resp| {
        resp.body.len()
            + resp
                .headers
                .iter()
                .map(|(n, v)| n.len() + v.len() + 32)
                .sum::<usize>()
    });
    RECORD_OVERHEAD
        + r.scope.tenant().len()
        + r.scope.operation().len()
        + r.key.as_str().len()
        + response
        + r.resource_id.as_ref().map_or(0, String::len)
        + r.error_code.as_ref().map_or(0, String::len)
}

/// The bounds of a [`MemoryStore::cache`].
#[derive(Debug, Clone, Copy)]
struct Limit {
    shard_bytes: usize,
    max_age: Duration,
}

impl Limit {
    fn is_stale(&self, e: &Entry, now: Timestamp) -> bool {
        e.record.is_expired(now) || e.since.elapsed() >= self.max_age
    }
}

/// In-memory [`Store`].
#[derive(Debug)]
pub struct MemoryStore {
    shards: Box<[Mutex<Shard>]>,
    hasher: RandomState,
    limit: Option<Limit>,
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self::new()
    }
}

impl MemoryStore {
    /// An empty store, unbounded: it keeps every record until purged.
    pub fn new() -> Self {
        Self {
            shards: (0..SHARDS).map(|_| Mutex::new(Shard::default())).collect(),
            hasher: RandomState::new(),
            limit: None,
        }
    }

    /// An empty, **bounded** store for the fast tier of
    /// [`Tiered`](crate::Tiered): it holds about `max_bytes` of records
    /// (estimated: keys, stored responses and a fixed overhead each) and
    /// forgets others when over it, and it treats a record written more
    /// than `max_age` ago as absent, which bounds how long a copy can
    /// outlive a change made elsewhere (another gateway deleting the
    /// record, say). Because it forgets, it must never be the store of
    /// record.
    pub fn cache(max_bytes: usize, max_age: Duration) -> Self {
        Self {
            limit: Some(Limit {
                shard_bytes: (max_bytes / SHARDS).max(RECORD_OVERHEAD),
                max_age,
            }),
            ..Self::new()
        }
    }

    /// Number of records held (including expired ones not yet purged).
    pub fn len(&self) -> usize {
        self.shards.iter().map(|s| lock(s).map.len()).sum()
    }

    /// Whether no record is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Approximate bytes held (the measure a bounded store keeps under its
    /// budget).
    pub fn bytes(&self) -> usize {
        self.shards.iter().map(|s| lock(s).bytes).sum()
    }

    /// The record's [`Id`] and its shard, locked.
    fn locate(&self, scope: &Scope, key: &IdempotencyKey) -> (MutexGuard<'_, Shard>, Id) {
        let mut h = self.hasher.build_hasher();
        scope.hash(&mut h);
        key.hash(&mut h);
        let hash = h.finish();
        let shard = lock(&self.shards[(hash >> 32) as usize % SHARDS]);
        let id = Id {
            hash,
            scope: scope.clone(),
            key: key.clone(),
        };
        (shard, id)
    }

    /// After a write: keeps a bounded store within its budget.
    fn trim(&self, shard: &mut Shard, now: Timestamp) {
        if let Some(limit) = &self.limit {
            shard.trim(limit, now);
        }
    }

    /// Whether a bounded store treats this entry as absent.
    fn is_stale(&self, entry: &Entry, now: Timestamp) -> bool {
        self.limit.is_some_and(|l| l.is_stale(entry, now))
    }

    /// The record, unless a bounded store considers its copy stale.
    fn live<'a>(&self, shard: &'a Shard, id: &Id, now: Timestamp) -> Option<&'a Record> {
        shard
            .map
            .get(id)
            .filter(|e| !self.is_stale(e, now))
            .map(|e| &e.record)
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
        let (mut shard, id) = self.locate(scope, key);
        match shard.map.get(&id) {
            Some(e) if allowed(&e.record, lease) => Ok(f(&mut shard, id)),
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
        let (mut shard, id) = self.locate(req.scope, req.key);
        // Read under the lock: a racer that read the clock before the winner
        // but locked after it would otherwise see the winner's lease end more
        // than a whole lease ahead (`conformance::reservation_race` caught a
        // retry hint a few µs over the lease).
        let now = Timestamp::now();
        let existing = match shard.map.get_mut(&id) {
            Some(e) if !self.is_stale(e, now) => Some(&mut e.record),
            _ => None,
        };
        let Some(existing) = existing else {
            let record = new_record(&req, now, 1);
            let lease = record.lease;
            shard.insert(id, record);
            self.trim(&mut shard, now);
            return Ok(Reservation::Acquired(lease));
        };
        Ok(match decide_existing(existing, &req, now) {
            ExistingDecision::Replace => {
                let record = new_record(&req, now, 1);
                let lease = record.lease;
                shard.insert(id, record);
                self.trim(&mut shard, now);
                Reservation::Acquired(lease)
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
            ExistingDecision::InProgress {
                retry_after,
                outcome_unknown,
            } => Reservation::InProgress {
                retry_after,
                outcome_unknown,
            },
            ExistingDecision::Mismatch => Reservation::Mismatch {
                state: existing.state,
            },
        })
    }

    async fn get(&self, scope: &Scope, key: &IdempotencyKey) -> Result<Option<Record>, StoreError> {
        let now = Timestamp::now();
        let (shard, id) = self.locate(scope, key);
        Ok(self
            .live(&shard, &id, now)
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
            shard.update(&id, |r| {
                r.state = outcome.verdict.into();
                r.updated_at = now;
                r.expires_at = now.plus(outcome.retention);
                r.response = Some(outcome.response.clone());
                r.resource_id.clone_from(&outcome.resource_id);
                r.error_code.clone_from(&outcome.error_code);
            });
            self.trim(shard, now);
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
            shard.update(&id, |r| {
                r.error_code = Some(OUTCOME_UNKNOWN.to_owned());
                r.updated_at = now;
            });
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
            shard.update(&id, |r| {
                r.lease.locked_until = until;
                r.updated_at = now;
            });
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
                    .map
                    .values()
                    .map(|e| &e.record)
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
        let limit = filter.page_size();
        Ok(Page::from_read_ahead(records, limit))
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
                .map
                .iter()
                .filter(|(_, e)| e.record.is_expired(now))
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
        let (mut shard, id) = self.locate(scope, key);
        Ok(shard.remove(&id).is_some())
    }
}

impl CacheStore for MemoryStore {
    async fn put(&self, record: Record) -> Result<(), StoreError> {
        let now = Timestamp::now();
        let (mut shard, id) = self.locate(&record.scope, &record.key);
        shard.insert(id, record);
        self.trim(&mut shard, now);
        Ok(())
    }

    async fn evict(&self, scope: &Scope, key: &IdempotencyKey) -> Result<(), StoreError> {
        let (mut shard, id) = self.locate(scope, key);
        shard.remove(&id);
        Ok(())
    }

    /// A bounded store is an in-process cache: final records only.
    fn keeps_in_progress(&self) -> bool {
        self.limit.is_none()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Fingerprint, OwnerToken, StoredResponse, Verdict};

    fn scope() -> Scope {
        Scope::new("tenant", "POST /v1/payments").expect("scope")
    }

    fn record(key: &str, body_len: usize) -> Record {
        let now = Timestamp::now();
        Record {
            scope: scope(),
            key: key.parse().expect("key"),
            fingerprint: Fingerprint::builder().json_body(b"{}").finish(),
            state: RecordState::Completed,
            created_at: now,
            updated_at: now,
            expires_at: now.plus(Duration::from_secs(3600)),
            lease: Lease {
                owner: OwnerToken::random(),
                attempt: 1,
                locked_until: now,
            },
            response: Some(StoredResponse::new(201, vec![b'x'; body_len])),
            resource_id: None,
            error_code: None,
        }
    }

    /// The shard comes from the hash's bits 32 and up, so within a shard the
    /// low bits (where the map picks a bucket) still take every value, and
    /// the shards fill evenly.
    #[tokio::test]
    async fn records_spread_over_shards_and_within_them() {
        let store = MemoryStore::new();
        for i in 0..2_000 {
            store.put(record(&format!("k{i}"), 10)).await.expect("put");
        }
        for shard in store.shards.iter() {
            let shard = lock(shard);
            let n = shard.map.len();
            assert!(
                (60..=190).contains(&n),
                "{n} records of 2,000 in one of 16 shards"
            );
            let low: std::collections::HashSet<u64> =
                shard.map.keys().map(|id| id.hash & 0xf).collect();
            assert!(low.len() >= 12, "the low bits within a shard: {low:?}");
        }
        assert_eq!(store.len(), 2_000);
    }

    #[tokio::test]
    async fn a_bounded_store_stays_within_its_budget() {
        let budget = 256 * 1024;
        let cache = MemoryStore::cache(budget, Duration::from_secs(60));
        for i in 0..5_000 {
            cache.put(record(&format!("k{i}"), 500)).await.expect("put");
            assert!(cache.bytes() <= budget, "{} > {budget}", cache.bytes());
        }
        // It keeps what fits (eviction stops at 7/8 of each shard's share).
        let per_record = weight(&record("k0", 500));
        assert!(cache.len() * per_record >= budget / 2, "{}", cache.len());
        // Whatever is still held is answered whole; the rest is absent.
        let mut held = 0;
        for i in 0..5_000 {
            let k: IdempotencyKey = format!("k{i}").parse().expect("key");
            if let Some(r) = cache.get(&scope(), &k).await.expect("get") {
                assert_eq!(r.response.expect("response").body.len(), 500);
                held += 1;
            }
        }
        assert_eq!(held, cache.len());
    }

    #[tokio::test]
    async fn a_bounded_store_treats_old_copies_as_absent() {
        // Put then get must fit in the age: a second, not tens of ms that
        // one descheduling on a loaded machine spends.
        let cache = MemoryStore::cache(1 << 20, Duration::from_secs(1));
        cache.put(record("old", 10)).await.expect("put");
        let k: IdempotencyKey = "old".parse().expect("key");
        assert!(cache.get(&scope(), &k).await.expect("get").is_some());
        tokio::time::sleep(Duration::from_millis(1100)).await;
        assert!(cache.get(&scope(), &k).await.expect("get").is_none());
        // An unbounded store keeps it.
        let store = MemoryStore::new();
        store.put(record("old", 10)).await.expect("put");
        tokio::time::sleep(Duration::from_millis(40)).await;
        assert!(store.get(&scope(), &k).await.expect("get").is_some());
    }

    #[tokio::test]
    async fn the_byte_count_follows_every_change() {
        let store = MemoryStore::new();
        let k: IdempotencyKey = "k".parse().expect("key");
        let fp = Fingerprint::builder().json_body(b"{}").finish();
        let Reservation::Acquired(lease) = store
            .reserve(ReserveRequest {
                scope: &scope(),
                key: &k,
                fingerprint: fp,
                owner: OwnerToken::random(),
                lease: Duration::from_secs(30),
                retention: Duration::from_secs(60),
                on_lease_expiry: Default::default(),
            })
            .await
            .expect("reserve")
        else {
            panic!("acquires");
        };
        let reserved = store.bytes();
        assert!(reserved >= RECORD_OVERHEAD);
        let outcome = FinalOutcome {
            verdict: Verdict::Completed,
            response: StoredResponse::new(201, vec![b'y'; 1000]),
            resource_id: None,
            error_code: None,
            retention: Duration::from_secs(60),
        };
        store
            .resolve(&scope(), &k, &lease, &outcome)
            .await
            .expect("resolve");
        assert!(store.bytes() >= reserved + 1000);
        assert!(store.delete(&scope(), &k).await.expect("delete"));
        assert_eq!(store.bytes(), 0);
    }
}
