//! The store contract on PostgreSQL: each record operation one statement
//! (or its share of a grouped one), and what its rows mean.

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

/// Zero rows touched means "not the owner (any more)".
/// A fenced statement with its first five parameters bound, in the order
/// every fenced query file uses: the record (tenant, operation, key) and
/// the lease (owner, attempt).
pub(crate) fn fenced_query<'q>(
    sql: &'q str,
    scope: &'q Scope,
    key: &'q IdempotencyKey,
    owner: &'q [u8; 16],
    attempt: u32,
) -> sqlx::query::Query<'q, Postgres, sqlx::postgres::PgArguments> {
    sqlx::query(sql)
        .bind(scope.tenant())
        .bind(scope.operation())
        .bind(key.as_str())
        .bind(owner.as_slice())
        .bind(attempt_param(attempt))
}

pub(crate) fn fenced(rows: u64) -> Result<(), StoreError> {
    if rows == 0 {
        Err(StoreError::Fenced)
    } else {
        Ok(())
    }
}

pub(crate) fn pg(err: PgError) -> StoreError {
    err.into()
}

pub(crate) fn ms_column(
    row: &sqlx::postgres::PgRow,
    column: &str,
) -> Result<Timestamp, StoreError> {
    row.try_get::<i64, _>(column)
        .map(Timestamp::from_millis)
        .map_err(error::to_store)
}

/// The reservation: insert-or-read in one statement, then, when the
/// existing row must be replaced or taken over, one conditional update on
/// the version read. A lost race (the row changed or vanished in between)
/// starts over.
pub(crate) async fn reserve_on(
    conn: &mut PgConnection,
    req: &ReserveRequest<'_>,
) -> Result<Reservation, StoreError> {
    let (tenant, operation, key) = (req.scope.tenant(), req.scope.operation(), req.key.as_str());
    let owner = req.owner.to_bytes();
    for _ in 0..MAX_ROUNDS {
        let row = sqlx::query(schema::RESERVE)
            .bind(tenant)
            .bind(operation)
            .bind(key)
            .bind(req.fingerprint.digest().as_slice())
            .bind(owner.as_slice())
            .bind(millis(req.lease))
            .bind(millis(req.retention))
            .fetch_optional(&mut *conn)
            .await
            .map_err(error::to_store)?;
        // Not visible yet (committed after our snapshot) or just deleted.
        let Some(row) = row else { continue };
        if let Some(reservation) = settle(&mut *conn, req, &row).await? {
            return Ok(reservation);
        }
    }
    Err(pg(PgError::Contention(MAX_ROUNDS)))
}

/// Decides a reservation on the row the insert-or-read answered: ours if
/// it inserted; else idem's rules on the existing record, replacing or
/// taking it over with one conditional update on the version read. `None`:
/// that update matched nothing (someone else changed the record since it
/// was read), so the caller reads again.
pub(crate) async fn settle<'e, E: Executor<'e, Database = Postgres>>(
    exec: E,
    req: &ReserveRequest<'_>,
    row: &PgRow,
) -> Result<Option<Reservation>, StoreError> {
    let existing = schema::record_from_row(row).map_err(pg)?;
    if row
        .try_get::<bool, _>("inserted")
        .map_err(error::to_store)?
    {
        return Ok(Some(Reservation::Acquired(existing.lease)));
    }
    let now = ms_column(row, "now_ms")?;
    let read_owner = existing.lease.owner.to_bytes();
    let read_attempt = attempt_param(existing.lease.attempt);
    let (tenant, operation, key) = (req.scope.tenant(), req.scope.operation(), req.key.as_str());
    let owner = req.owner.to_bytes();
    let (lease_ms, retention_ms) = (millis(req.lease), millis(req.retention));
    Ok(match decide_existing(&existing, req, now) {
        ExistingDecision::Replace => {
            let replaced = sqlx::query(schema::REPLACE_EXPIRED)
                .bind(tenant)
                .bind(operation)
                .bind(key)
                .bind(req.fingerprint.digest().as_slice())
                .bind(owner.as_slice())
                .bind(lease_ms)
                .bind(retention_ms)
                .bind(read_owner.as_slice())
                .bind(read_attempt)
                .fetch_optional(exec)
                .await
                .map_err(error::to_store)?;
            match replaced {
                Some(row) => Some(Reservation::Acquired(Lease {
                    owner: req.owner,
                    attempt: 1,
                    locked_until: ms_column(&row, "locked_until_ms")?,
                })),
                None => None,
            }
        }
        ExistingDecision::TakeOver => {
            let taken = sqlx::query(schema::TAKE_OVER)
                .bind(tenant)
                .bind(operation)
                .bind(key)
                .bind(owner.as_slice())
                .bind(lease_ms)
                .bind(read_owner.as_slice())
                .bind(read_attempt)
                .fetch_optional(exec)
                .await
                .map_err(error::to_store)?;
            match taken {
                Some(row) => {
                    let attempt: i32 = row.try_get("attempt").map_err(error::to_store)?;
                    Some(Reservation::Acquired(Lease {
                        owner: req.owner,
                        attempt: u32::try_from(attempt).map_err(|_| {
                            pg(PgError::Corrupt(format!("attempt {attempt} is negative")))
                        })?,
                        locked_until: ms_column(&row, "locked_until_ms")?,
                    }))
                }
                None => None,
            }
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

pub(crate) async fn resolve_on<'e, E: Executor<'e, Database = Postgres>>(
    exec: E,
    scope: &Scope,
    key: &IdempotencyKey,
    lease: &Lease,
    outcome: &FinalOutcome,
) -> Result<(), StoreError> {
    let state: idem::RecordState = outcome.verdict.into();
    let owner = lease.owner.to_bytes();
    let headers = outcome.response.encode_headers();
    let done = fenced_query(schema::RESOLVE, scope, key, &owner, lease.attempt)
        .bind(state.as_str())
        .bind(millis(outcome.retention))
        .bind(i32::from(outcome.response.status))
        .bind(headers)
        .bind(&outcome.response.body[..])
        .bind(outcome.resource_id.as_deref())
        .bind(outcome.error_code.as_deref())
        .execute(exec)
        .await
        .map_err(error::to_store)?;
    fenced(done.rows_affected())
}

pub(crate) async fn release_on<'e, E: Executor<'e, Database = Postgres>>(
    exec: E,
    scope: &Scope,
    key: &IdempotencyKey,
    lease: &Lease,
) -> Result<(), StoreError> {
    let owner = lease.owner.to_bytes();
    let done = fenced_query(schema::RELEASE, scope, key, &owner, lease.attempt)
        .execute(exec)
        .await
        .map_err(error::to_store)?;
    fenced(done.rows_affected())
}

/// Keeps a lent connection whose fenced statement completed, matched or
/// not ([`StoreError::Fenced`] is an answer, not a failed statement).
pub(crate) fn kept_if_done(conn: conns::Lent, result: &Result<(), StoreError>) {
    if matches!(result, Ok(()) | Err(StoreError::Fenced)) {
        conn.done();
    }
}

impl Store for PgStore {
    async fn reserve(&self, req: ReserveRequest<'_>) -> Result<Reservation, StoreError> {
        let slot = match self.batches() {
            Some(batches) => match batches.reserve.turn(|| ReserveItem::new(&req)).await? {
                batch::Answer::Done(Some(row)) => {
                    if let Some(reservation) = settle(self.pool(), &req, &row).await? {
                        return Ok(reservation);
                    }
                    // Changed since the batch read it: the single
                    // statement decides.
                    None
                }
                // Not visible to the batch's snapshot.
                batch::Answer::Done(None) => None,
                batch::Answer::Alone(slot) => slot,
            },
            None => None,
        };
        let mut conn = self.lend().await?;
        let reserved = reserve_on(&mut conn, &req).await;
        // Kept before the slot frees, for the batch waiting on the slot.
        if reserved.is_ok() {
            conn.done();
        }
        drop(slot);
        reserved
    }

    async fn get(&self, scope: &Scope, key: &IdempotencyKey) -> Result<Option<Record>, StoreError> {
        let row = sqlx::query(schema::GET)
            .bind(scope.tenant())
            .bind(scope.operation())
            .bind(key.as_str());
        let mut conn = self.lend().await?;
        let row = row
            .fetch_optional(&mut *conn)
            .await
            .map_err(error::to_store)?;
        conn.done();
        row.as_ref()
            .map(schema::record_from_row)
            .transpose()
            .map_err(pg)
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
        let mut conn = self.lend().await?;
        let resolved = resolve_on(&mut *conn, scope, key, lease, outcome).await;
        kept_if_done(conn, &resolved);
        drop(slot);
        resolved
    }

    async fn release(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        lease: &Lease,
    ) -> Result<(), StoreError> {
        let mut conn = self.lend().await?;
        let released = release_on(&mut *conn, scope, key, lease).await;
        kept_if_done(conn, &released);
        released
    }

    async fn mark_unknown(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        lease: &Lease,
        _reason: &str,
    ) -> Result<(), StoreError> {
        let owner = lease.owner.to_bytes();
        let mut conn = self.lend().await?;
        let done = fenced_query(schema::MARK_UNKNOWN, scope, key, &owner, lease.attempt)
            .execute(&mut *conn)
            .await
            .map_err(error::to_store)?;
        conn.done();
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
        let row =
            fenced_query(schema::RENEW, scope, key, &owner, lease.attempt).bind(millis(duration));
        let mut conn = self.lend().await?;
        let row = row
            .fetch_optional(&mut *conn)
            .await
            .map_err(error::to_store)?;
        conn.done();
        match row {
            Some(row) => ms_column(&row, "locked_until_ms"),
            None => Err(StoreError::Fenced),
        }
    }
}

impl ListRecords for PgStore {
    async fn list(&self, filter: &ListFilter) -> Result<Page, StoreError> {
        let limit = filter.page_size();
        let after = filter.after.as_ref();
        let mut query = sqlx::QueryBuilder::<Postgres>::new(schema::LIST);
        if let Some(state) = filter.state {
            // A literal, not a bind (the state is one of three fixed words):
            // a generic plan can then prove idem_records_processing's
            // predicate and read only the processing records, which the
            // stuck-record monitor lists every 30 s. With a bind, the plan
            // made while the table was small walked the creation index over
            // every record once it had grown.
            query
                .push(schema::LIST_STATE)
                .push("'")
                .push(state.as_str())
                .push("'");
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
        if let Some(c) = after {
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
            .map_err(pg)?;
        Ok(Page::from_read_ahead(records, limit))
    }
}

impl Purge for PgStore {
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
