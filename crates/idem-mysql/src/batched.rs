//! Reservations and resolutions as group commit carries them: one
//! transaction and one commit for many callers.
//!
//! A batch of reservations inserts each record in turn (a duplicate-key
//! error rolls back only its own statement, and tells that the record
//! exists), reads every record of the batch with one query, and commits.
//! A batch of resolutions runs each fenced update in turn, each counting
//! its own matched row, and commits.

use std::collections::HashMap;

use super::*;

/// A reservation as a batch carries it: owned, in the statement's types.
#[derive(Debug)]
pub(crate) struct ReserveItem {
    record: batch::RecordId,
    fingerprint: [u8; 32],
    owner: [u8; 16],
    lease_ms: i64,
    retention_ms: i64,
}

impl ReserveItem {
    pub(crate) fn new(req: &ReserveRequest<'_>) -> Self {
        Self {
            record: (
                req.scope.tenant().to_owned(),
                req.scope.operation().to_owned(),
                req.key.as_str().to_owned(),
            ),
            fingerprint: *req.fingerprint.digest(),
            owner: req.owner.to_bytes(),
            lease_ms: millis(req.lease),
            retention_ms: millis(req.retention),
        }
    }
}

impl batch::Batched for ReserveItem {
    fn record(&self) -> &batch::RecordId {
        &self.record
    }
}

/// What a batch did for one reservation.
#[derive(Debug)]
pub(crate) enum Reserved {
    /// It inserted the record: the lease is the caller's.
    Acquired(Lease),
    /// The record was there: its row, with the server's now, for the
    /// caller to decide on after the batch committed.
    Existing(MySqlRow),
    /// The record was there but is gone by the time the batch read it:
    /// the caller reserves on its own.
    Vanished,
}

/// Runs a batch of reservations in one transaction.
pub(crate) async fn reserve_batch(
    pool: MySqlPool,
    items: Vec<ReserveItem>,
) -> Result<Vec<Reserved>, sqlx::Error> {
    let mut tx = pool.begin().await?;
    let mut inserted = Vec::with_capacity(items.len());
    for item in &items {
        let done = sqlx::query(schema::INSERT)
            .bind(&item.record.0)
            .bind(&item.record.1)
            .bind(&item.record.2)
            .bind(&item.fingerprint[..])
            .bind(item.retention_ms)
            .bind(item.lease_ms)
            .bind(&item.owner[..])
            .execute(&mut *tx)
            .await;
        match done {
            Ok(_) => inserted.push(true),
            Err(err) if error::error_number(&err) == Some(error::DUPLICATE_KEY) => {
                inserted.push(false);
            }
            Err(err) => return Err(err),
        }
    }
    let mut read = sqlx::QueryBuilder::<MySql>::new(schema::READ_BATCH);
    for (i, item) in items.iter().enumerate() {
        let [open, and_operation, and_key, close] = schema::READ_BATCH_RECORD;
        read.push(if i == 0 { " " } else { " OR " })
            .push(open)
            .push_bind(&item.record.0)
            .push(and_operation)
            .push_bind(&item.record.1)
            .push(and_key)
            .push_bind(&item.record.2)
            .push(close);
    }
    let rows = read.build().fetch_all(&mut *tx).await?;
    tx.commit().await?;
    let mut by_record = HashMap::with_capacity(rows.len());
    for row in rows {
        let id = (
            row_text(&row, "tenant")?,
            row_text(&row, "operation")?,
            row_text(&row, "idem_key")?,
        );
        by_record.insert(id, row);
    }
    Ok(items
        .iter()
        .zip(inserted)
        .map(|(item, inserted)| match by_record.remove(&item.record) {
            None => Reserved::Vanished,
            Some(row) if inserted => match lease_of(&row, &item.owner) {
                Some(lease) => Reserved::Acquired(lease),
                None => Reserved::Existing(row),
            },
            Some(row) => Reserved::Existing(row),
        })
        .collect())
}

/// A key column of a batch's row, as the batch item spells it; bytes
/// that are not UTF-8 match no item (and the caller, reserving alone,
/// reports the row as corrupt).
fn row_text(row: &MySqlRow, column: &str) -> Result<String, sqlx::Error> {
    let bytes: Vec<u8> = sqlx::Row::try_get(row, column)?;
    Ok(String::from_utf8_lossy(&bytes).into_owned())
}

/// The lease a row shows `owner` holding at attempt 1, if it does.
fn lease_of(row: &MySqlRow, owner: &[u8; 16]) -> Option<Lease> {
    let record = schema::record_from_row(row).ok()?;
    (record.lease.owner.to_bytes() == *owner && record.lease.attempt == 1).then_some(record.lease)
}

/// A resolution as a batch carries it.
#[derive(Debug)]
pub(crate) struct ResolveItem {
    record: batch::RecordId,
    owner: [u8; 16],
    attempt: i32,
    state: &'static str,
    retention_ms: i64,
    status: i32,
    headers: Vec<u8>,
    body: bytes::Bytes,
    resource_id: Option<String>,
    error_code: Option<String>,
}

impl ResolveItem {
    pub(crate) fn new(
        scope: &Scope,
        key: &IdempotencyKey,
        lease: &Lease,
        outcome: &FinalOutcome,
    ) -> Self {
        let state: idem::RecordState = outcome.verdict.into();
        Self {
            record: (
                scope.tenant().to_owned(),
                scope.operation().to_owned(),
                key.as_str().to_owned(),
            ),
            owner: lease.owner.to_bytes(),
            attempt: attempt_param(lease.attempt),
            state: state.as_str(),
            retention_ms: millis(outcome.retention),
            status: i32::from(outcome.response.status),
            headers: outcome.response.encode_headers(),
            body: outcome.response.body.clone(),
            resource_id: outcome.resource_id.clone(),
            error_code: outcome.error_code.clone(),
        }
    }
}

impl batch::Batched for ResolveItem {
    fn record(&self) -> &batch::RecordId {
        &self.record
    }
}

/// Runs a batch of resolutions in one transaction: per item, whether it
/// matched its owner and attempt.
pub(crate) async fn resolve_batch(
    pool: MySqlPool,
    items: Vec<ResolveItem>,
) -> Result<Vec<bool>, sqlx::Error> {
    let mut tx = pool.begin().await?;
    let mut matched = Vec::with_capacity(items.len());
    for item in &items {
        let done = sqlx::query(schema::RESOLVE)
            .bind(item.state)
            .bind(item.retention_ms)
            .bind(item.status)
            .bind(&item.headers[..])
            .bind(&item.body[..])
            .bind(item.resource_id.as_deref())
            .bind(item.error_code.as_deref())
            .bind(&item.record.0)
            .bind(&item.record.1)
            .bind(&item.record.2)
            .bind(&item.owner[..])
            .bind(item.attempt)
            .execute(&mut *tx)
            .await?;
        matched.push(done.rows_affected() > 0);
    }
    tx.commit().await?;
    Ok(matched)
}
