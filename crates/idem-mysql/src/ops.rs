//! The store contract on MySQL: each record operation one statement, or
//! a statement and the read of what it wrote (MySQL has no portable
//! `RETURNING`), and what their rows mean.

use super::*;

/// A duration in whole milliseconds, capped at [`MAX_DURATION_MS`].
pub(crate) fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis())
        .unwrap_or(i64::MAX)
        .min(MAX_DURATION_MS)
}

/// An attempt number as stored; one that does not fit can match no row.
pub(crate) fn attempt_param(attempt: u32) -> i32 {
    i32::try_from(attempt).unwrap_or(-1)
}

type Query<'q> = sqlx::query::Query<'q, MySql, sqlx::mysql::MySqlArguments>;

/// Binds the record (tenant, operation, key) and the lease (owner,
/// attempt), in the order every fenced query file's `WHERE` uses.
pub(crate) fn bind_fence<'q>(
    query: Query<'q>,
    scope: &'q Scope,
    key: &'q IdempotencyKey,
    owner: &'q [u8; 16],
    attempt: u32,
) -> Query<'q> {
    query
        .bind(scope.tenant())
        .bind(scope.operation())
        .bind(key.as_str())
        .bind(owner.as_slice())
        .bind(attempt_param(attempt))
}

/// Zero rows matched means "not the owner (any more)". The driver counts
/// rows matched, not rows changed (CLIENT_FOUND_ROWS), so a statement that
/// writes what is already there still counts.
pub(crate) fn fenced(rows: u64) -> Result<(), StoreError> {
    if rows == 0 {
        Err(StoreError::Fenced)
    } else {
        Ok(())
    }
}

pub(crate) fn my(err: MySqlError) -> StoreError {
    err.into()
}

/// The lease `owner` holds at `attempt` on a processing record, as the
/// server stored it; `None` when it holds none.
pub(crate) async fn read_lease(
    conn: &mut MySqlConnection,
    scope: &Scope,
    key: &IdempotencyKey,
    owner: OwnerToken,
    attempt: u32,
) -> Result<Option<Lease>, StoreError> {
    let bytes = owner.to_bytes();
    let row = bind_fence(sqlx::query(schema::READ_LEASE), scope, key, &bytes, attempt)
        .fetch_optional(&mut *conn)
        .await
        .map_err(error::to_store)?;
    row.map(|row| {
        Ok(Lease {
            owner,
            attempt: schema::attempt_column(&row).map_err(my)?,
            locked_until: schema::millis_column(&row, "locked_until_ms").map_err(my)?,
        })
    })
    .transpose()
}

/// Where a reservation runs: on a connection of the store's own (each
/// statement commits on its own) or inside a caller's transaction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Within {
    Own,
    CallersTransaction,
}

/// The reservation: an insert that either creates the record (the
/// primary key makes it the one atomic create-if-absent) or fails on the
/// existing one; then a locking read of that record and idem's rules on
/// it, replacing or taking it over with one conditional update on the
/// version read. A lost race (the row changed or vanished in between)
/// starts over.
pub(crate) async fn reserve_on(
    conn: &mut MySqlConnection,
    req: &ReserveRequest<'_>,
    within: Within,
) -> Result<Reservation, StoreError> {
    let (tenant, operation, key) = (req.scope.tenant(), req.scope.operation(), req.key.as_str());
    let owner = req.owner.to_bytes();
    for _ in 0..MAX_ROUNDS {
        let inserted = sqlx::query(schema::INSERT)
            .bind(tenant)
            .bind(operation)
            .bind(key)
            .bind(req.fingerprint.digest().as_slice())
            .bind(millis(req.retention))
            .bind(millis(req.lease))
            .bind(owner.as_slice())
            .execute(&mut *conn)
            .await;
        match inserted {
            Ok(_) => {
                if let Some(lease) = read_lease(conn, req.scope, req.key, req.owner, 1).await? {
                    return Ok(Reservation::Acquired(lease));
                }
                // Taken from us already (possible only once the lease
                // lapsed): decide on what is there now.
            }
            Err(err) if error::error_number(&err) == Some(error::DUPLICATE_KEY) => {}
            // A deadlock rolled back only this statement's own
            // transaction: try again. In a caller's transaction it rolled
            // back the caller's work too, which only the caller can redo.
            Err(err)
                if within == Within::Own && error::error_number(&err) == Some(error::DEADLOCK) =>
            {
                continue;
            }
            Err(err) => return Err(error::to_store(err)),
        }
        let row = sqlx::query(schema::READ_EXISTING)
            .bind(tenant)
            .bind(operation)
            .bind(key)
            .fetch_optional(&mut *conn)
            .await;
        let row = match row {
            Ok(Some(row)) => row,
            // Deleted since the insert failed.
            Ok(None) => continue,
            Err(err)
                if within == Within::Own && error::error_number(&err) == Some(error::DEADLOCK) =>
            {
                continue;
            }
            Err(err) => return Err(error::to_store(err)),
        };
        if let Some(reservation) = settle(&mut *conn, req, &row).await? {
            return Ok(reservation);
        }
    }
    Err(my(MySqlError::Contention(MAX_ROUNDS)))
}

/// Decides a reservation on an existing row read with the server's now:
/// idem's rules, replacing or taking it over with one conditional update
/// on the version read. `None`: that update matched nothing (someone else
/// changed the record since it was read), so the caller reads again.
pub(crate) async fn settle(
    conn: &mut MySqlConnection,
    req: &ReserveRequest<'_>,
    row: &MySqlRow,
) -> Result<Option<Reservation>, StoreError> {
    let existing = schema::record_from_row(row).map_err(my)?;
    let now = schema::millis_column(row, "now_ms").map_err(my)?;
    let read_owner = existing.lease.owner.to_bytes();
    let read_attempt = existing.lease.attempt;
    let (tenant, operation, key) = (req.scope.tenant(), req.scope.operation(), req.key.as_str());
    let owner = req.owner.to_bytes();
    let (lease_ms, retention_ms) = (millis(req.lease), millis(req.retention));
    Ok(match decide_existing(&existing, req, now) {
        ExistingDecision::Replace => {
            let replaced = sqlx::query(schema::REPLACE_EXPIRED)
                .bind(req.fingerprint.digest().as_slice())
                .bind(retention_ms)
                .bind(lease_ms)
                .bind(owner.as_slice())
                .bind(tenant)
                .bind(operation)
                .bind(key)
                .bind(read_owner.as_slice())
                .bind(attempt_param(read_attempt))
                .execute(&mut *conn)
                .await
                .map_err(error::to_store)?;
            if replaced.rows_affected() == 0 {
                return Ok(None);
            }
            read_lease(conn, req.scope, req.key, req.owner, 1)
                .await?
                .map(Reservation::Acquired)
        }
        ExistingDecision::TakeOver => {
            let taken = sqlx::query(schema::TAKE_OVER)
                .bind(owner.as_slice())
                .bind(lease_ms)
                .bind(tenant)
                .bind(operation)
                .bind(key)
                .bind(read_owner.as_slice())
                .bind(attempt_param(read_attempt))
                .execute(&mut *conn)
                .await
                .map_err(error::to_store)?;
            if taken.rows_affected() == 0 {
                return Ok(None);
            }
            let attempt = read_attempt.saturating_add(1);
            read_lease(conn, req.scope, req.key, req.owner, attempt)
                .await?
                .map(Reservation::Acquired)
        }
        ExistingDecision::Replay => Some(Reservation::Existing(Box::new(existing))),
        ExistingDecision::InProgress {
            retry_after,
            outcome_unknown,
        } => Some(Reservation::InProgress {
            retry_after,
            outcome_unknown,
        }),
        ExistingDecision::Mismatch => Some(Reservation::Mismatch {
            state: existing.state,
        }),
    })
}

pub(crate) async fn resolve_on(
    conn: &mut MySqlConnection,
    scope: &Scope,
    key: &IdempotencyKey,
    lease: &Lease,
    outcome: &FinalOutcome,
) -> Result<(), StoreError> {
    let state: idem::RecordState = outcome.verdict.into();
    let owner = lease.owner.to_bytes();
    let headers = outcome.response.encode_headers();
    let query = sqlx::query(schema::RESOLVE)
        .bind(state.as_str())
        .bind(millis(outcome.retention))
        .bind(i32::from(outcome.response.status))
        .bind(headers)
        .bind(&outcome.response.body[..])
        .bind(outcome.resource_id.as_deref())
        .bind(outcome.error_code.as_deref());
    let done = bind_fence(query, scope, key, &owner, lease.attempt)
        .execute(&mut *conn)
        .await
        .map_err(error::to_store)?;
    fenced(done.rows_affected())
}

pub(crate) async fn release_on(
    conn: &mut MySqlConnection,
    scope: &Scope,
    key: &IdempotencyKey,
    lease: &Lease,
) -> Result<(), StoreError> {
    let owner = lease.owner.to_bytes();
    let done = bind_fence(
        sqlx::query(schema::RELEASE),
        scope,
        key,
        &owner,
        lease.attempt,
    )
    .execute(&mut *conn)
    .await
    .map_err(error::to_store)?;
    fenced(done.rows_affected())
}

impl Store for MySqlStore {
    async fn reserve(&self, req: ReserveRequest<'_>) -> Result<Reservation, StoreError> {
        let slot = match self.batches() {
            Some(batches) => match batches.reserve.turn(|| ReserveItem::new(&req)).await? {
                batch::Answer::Done(Reserved::Acquired(lease)) => {
                    return Ok(Reservation::Acquired(lease));
                }
                batch::Answer::Done(Reserved::Existing(row)) => {
                    let mut conn = self.acquire().await?;
                    if let Some(reservation) = settle(&mut conn, &req, &row).await? {
                        return Ok(reservation);
                    }
                    // Changed since the batch read it: the plain
                    // statements decide.
                    None
                }
                batch::Answer::Done(Reserved::Vanished) => None,
                batch::Answer::Alone(slot) => slot,
            },
            None => None,
        };
        let mut conn = self.acquire().await?;
        let reserved = reserve_on(&mut conn, &req, Within::Own).await;
        drop(slot);
        reserved
    }

    async fn get(&self, scope: &Scope, key: &IdempotencyKey) -> Result<Option<Record>, StoreError> {
        let row = sqlx::query(schema::GET)
            .bind(scope.tenant())
            .bind(scope.operation())
            .bind(key.as_str())
            .fetch_optional(self.pool())
            .await
            .map_err(error::to_store)?;
        row.as_ref()
            .map(schema::record_from_row)
            .transpose()
            .map_err(my)
    }

    async fn resolve(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        lease: &Lease,
        outcome: &FinalOutcome,
    ) -> Result<(), StoreError> {
        let slot = match self.batches() {
            Some(batches) => {
                let item = || ResolveItem::new(scope, key, lease, outcome);
                match batches.resolve.turn(item).await? {
                    batch::Answer::Done(matched) => return fenced(u64::from(matched)),
                    batch::Answer::Alone(slot) => slot,
                }
            }
            None => None,
        };
        let mut conn = self.acquire().await?;
        let resolved = resolve_on(&mut conn, scope, key, lease, outcome).await;
        drop(slot);
        resolved
    }

    async fn release(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        lease: &Lease,
    ) -> Result<(), StoreError> {
        let mut conn = self.acquire().await?;
        release_on(&mut conn, scope, key, lease).await
    }

    async fn mark_unknown(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        lease: &Lease,
        _reason: &str,
    ) -> Result<(), StoreError> {
        let owner = lease.owner.to_bytes();
        let done = bind_fence(
            sqlx::query(schema::MARK_UNKNOWN),
            scope,
            key,
            &owner,
            lease.attempt,
        )
        .execute(self.pool())
        .await
        .map_err(error::to_store)?;
        fenced(done.rows_affected())
    }

    async fn renew(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        lease: &Lease,
        duration: Duration,
    ) -> Result<Timestamp, StoreError> {
        let owner = lease.owner.to_bytes();
        let mut conn = self.acquire().await?;
        let query = sqlx::query(schema::RENEW).bind(millis(duration));
        let done = bind_fence(query, scope, key, &owner, lease.attempt)
            .execute(&mut *conn)
            .await
            .map_err(error::to_store)?;
        fenced(done.rows_affected())?;
        match read_lease(&mut conn, scope, key, lease.owner, lease.attempt).await? {
            Some(renewed) => Ok(renewed.locked_until),
            // Taken over or deleted right after the renewal.
            None => Err(StoreError::Fenced),
        }
    }
}

impl ListRecords for MySqlStore {
    async fn list(&self, filter: &ListFilter) -> Result<Page, StoreError> {
        let limit = filter.page_size();
        let mut query = sqlx::QueryBuilder::<MySql>::new(schema::LIST);
        if let Some(state) = filter.state {
            query.push(schema::LIST_STATE).push_bind(state.as_str());
        }
        if let Some(age) = filter.older_than {
            query
                .push(schema::LIST_OLDER_THAN)
                .push_bind(millis(age))
                .push(schema::LIST_OLDER_THAN_END);
        }
        if let Some(tenant) = &filter.tenant {
            query.push(schema::LIST_TENANT).push_bind(tenant.clone());
        }
        if let Some(c) = &filter.after {
            let [a, b, c2, d, e] = schema::LIST_AFTER;
            query
                .push(a)
                .push_bind(c.created_at.as_millis())
                .push(b)
                .push_bind(c.tenant.clone())
                .push(c2)
                .push_bind(c.operation.clone())
                .push(d)
                .push_bind(c.key.clone())
                .push(e);
        }
        query
            .push(schema::LIST_TAIL)
            .push_bind(i64::try_from(limit + 1).unwrap_or(i64::MAX));
        let rows = query
            .build()
            .fetch_all(self.pool())
            .await
            .map_err(error::to_store)?;
        let records = rows
            .iter()
            .map(schema::record_from_row)
            .collect::<Result<Vec<_>, _>>()
            .map_err(my)?;
        Ok(Page::from_read_ahead(records, limit))
    }
}

impl Purge for MySqlStore {
    async fn purge_expired(&self, batch: usize) -> Result<u64, StoreError> {
        if batch == 0 {
            return Ok(0);
        }
        let done = sqlx::query(schema::PURGE_EXPIRED)
            .bind(i64::try_from(batch).unwrap_or(i64::MAX))
            .execute(self.pool())
            .await
            .map_err(error::to_store)?;
        Ok(done.rows_affected())
    }

    async fn delete(&self, scope: &Scope, key: &IdempotencyKey) -> Result<bool, StoreError> {
        let done = sqlx::query(schema::DELETE)
            .bind(scope.tenant())
            .bind(scope.operation())
            .bind(key.as_str())
            .execute(self.pool())
            .await
            .map_err(error::to_store)?;
        Ok(done.rows_affected() > 0)
    }
}
