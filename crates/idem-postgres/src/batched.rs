//! Reservations and resolutions as group commit carries them: one
//! statement and one commit for many callers.

use super::*;
use crate::plans::{Grouped, Plans};

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

/// Runs reserve_batch.sql: per item, its insert-or-read row, or `None`
/// when its conflicting row was not visible to the statement.
pub(crate) async fn reserve_batch(
    conns: conns::Conns,
    items: Vec<ReserveItem>,
    plans: Arc<Plans>,
) -> Result<Vec<Option<PgRow>>, sqlx::Error> {
    let column = |f: fn(&ReserveItem) -> &str| items.iter().map(f).collect::<Vec<_>>();
    let mut conn = conns.lend().await?;
    let (sql, persistent) = plans.statement(Grouped::Reserve, &mut conn).await;
    let rows = sqlx::query(&sql)
        .persistent(persistent)
        .bind(column(|i| &i.record.0))
        .bind(column(|i| &i.record.1))
        .bind(column(|i| &i.record.2))
        .bind(items.iter().map(|i| &i.fingerprint[..]).collect::<Vec<_>>())
        .bind(items.iter().map(|i| &i.owner[..]).collect::<Vec<_>>())
        .bind(items.iter().map(|i| i.lease_ms).collect::<Vec<_>>())
        .bind(items.iter().map(|i| i.retention_ms).collect::<Vec<_>>());
    let rows = rows.fetch_all(&mut *conn).await?;
    conn.done();
    let mut answers: Vec<Option<PgRow>> = items.iter().map(|_| None).collect();
    for row in rows {
        let at = batch_position(&row, answers.len())?;
        answers[at] = Some(row);
    }
    Ok(answers)
}

/// The 0-based item a batch's result row answers (its column `n` counts
/// from 1).
pub(crate) fn batch_position(row: &PgRow, items: usize) -> Result<usize, sqlx::Error> {
    let n: i64 = row.try_get("n")?;
    usize::try_from(n - 1)
        .ok()
        .filter(|at| *at < items)
        .ok_or_else(|| sqlx::Error::Protocol(format!("batch position {n} out of range")))
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

/// Runs resolve_batch.sql: per item, whether it matched its owner and
/// attempt.
pub(crate) async fn resolve_batch(
    conns: conns::Conns,
    items: Vec<ResolveItem>,
    plans: Arc<Plans>,
) -> Result<Vec<bool>, sqlx::Error> {
    let column = |f: fn(&ResolveItem) -> &str| items.iter().map(f).collect::<Vec<_>>();
    let optional = |f: fn(&ResolveItem) -> Option<&str>| items.iter().map(f).collect::<Vec<_>>();
    let mut conn = conns.lend().await?;
    let (sql, persistent) = plans.statement(Grouped::Resolve, &mut conn).await;
    let rows = sqlx::query(&sql)
        .persistent(persistent)
        .bind(column(|i| &i.record.0))
        .bind(column(|i| &i.record.1))
        .bind(column(|i| &i.record.2))
        .bind(items.iter().map(|i| &i.owner[..]).collect::<Vec<_>>())
        .bind(items.iter().map(|i| i.attempt).collect::<Vec<_>>())
        .bind(column(|i| i.state))
        .bind(items.iter().map(|i| i.retention_ms).collect::<Vec<_>>())
        .bind(items.iter().map(|i| i.status).collect::<Vec<_>>())
        .bind(items.iter().map(|i| &i.headers[..]).collect::<Vec<_>>())
        .bind(items.iter().map(|i| &i.body[..]).collect::<Vec<_>>())
        .bind(optional(|i| i.resource_id.as_deref()))
        .bind(optional(|i| i.error_code.as_deref()));
    let rows = rows.fetch_all(&mut *conn).await?;
    conn.done();
    let mut matched = vec![false; items.len()];
    for row in rows {
        matched[batch_position(&row, items.len())?] = true;
    }
    Ok(matched)
}
