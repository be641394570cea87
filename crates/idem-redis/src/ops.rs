//! The store contract on Redis: each record operation one script, and
//! what its answer means.

use super::*;

/// A duration in whole milliseconds, capped at [`MAX_DURATION_MS`].
pub(crate) fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis())
        .unwrap_or(i64::MAX)
        .min(MAX_DURATION_MS)
}

/// An optional text as the scripts take it: `'1' .. value` or `'0'`.
pub(crate) fn flagged(value: Option<&str>) -> String {
    value.map_or_else(|| "0".to_owned(), |v| format!("1{v}"))
}

pub(crate) fn corrupt(what: impl Into<String>) -> StoreError {
    RedisError::Corrupt(what.into()).into()
}

pub(crate) fn int(v: &Value) -> Result<i64, StoreError> {
    match v {
        Value::Int(n) => Ok(*n),
        other => Err(corrupt(format!("expected an integer, got {other:?}"))),
    }
}

pub(crate) fn text(v: &Value) -> Result<&str, StoreError> {
    match v {
        Value::BulkString(b) => {
            std::str::from_utf8(b).map_err(|_| corrupt("a script answered non-UTF-8 text"))
        }
        Value::SimpleString(s) => Ok(s),
        other => Err(corrupt(format!("expected text, got {other:?}"))),
    }
}

/// Decodes the reserve script's answer.
pub(crate) fn reservation(
    answer: Value,
    req: &ReserveRequest<'_>,
) -> Result<Reservation, StoreError> {
    let Value::Array(items) = answer else {
        return Err(corrupt(format!("reserve answered {answer:?}")));
    };
    let Some((tag, rest)) = items.split_first() else {
        return Err(corrupt("reserve answered an empty array"));
    };
    match (text(tag)?, rest) {
        ("acquired", [attempt, locked_until]) => Ok(Reservation::Acquired(Lease {
            owner: req.owner,
            attempt: u32::try_from(int(attempt)?).map_err(|_| corrupt("attempt out of range"))?,
            locked_until: Timestamp::from_millis(int(locked_until)?),
        })),
        ("existing", [fields]) => Ok(Reservation::Existing(Box::new(record::from_value(
            fields.clone(),
        )?))),
        ("in_progress", [retry_after, unknown]) => Ok(Reservation::InProgress {
            retry_after: Duration::from_millis(u64::try_from(int(retry_after)?).unwrap_or(0)),
            outcome_unknown: int(unknown)? == 1,
        }),
        ("mismatch", [state]) => Ok(Reservation::Mismatch {
            state: text(state)?
                .parse::<RecordState>()
                .map_err(|e| corrupt(e.to_string()))?,
        }),
        (tag, _) => Err(corrupt(format!("reserve answered {tag:?} {rest:?}"))),
    }
}

impl Store for RedisStore {
    async fn reserve(&self, req: ReserveRequest<'_>) -> Result<Reservation, StoreError> {
        let name = self.key(req.scope, req.key);
        let mut conn = self.conn();
        let answer: Value = RESERVE
            .key(&name)
            .arg(req.scope.tenant())
            .arg(req.scope.operation())
            .arg(req.key.as_str())
            .arg(req.fingerprint.digest().as_slice())
            .arg(req.owner.to_bytes().as_slice())
            .arg(millis(req.lease))
            .arg(millis(req.retention))
            .arg(match req.on_lease_expiry {
                LeaseExpiry::Retry => "retry",
                LeaseExpiry::Hold => "hold",
            })
            .invoke_async(&mut conn)
            .await
            .map_err(error::to_store)?;
        let reservation = reservation(answer, &req)?;
        if let Reservation::Acquired(lease) = &reservation
            && let Err(err) = self.replicated(&mut conn, &name).await
        {
            // Not copied in time: undone on the primary (nothing has run
            // under it), so the key is free for the retry instead of held
            // by a reservation nobody acts on.
            let undone: Result<i64, _> = RELEASE
                .key(&name)
                .arg(lease.owner.to_bytes().as_slice())
                .arg(lease.attempt)
                .invoke_async(&mut conn)
                .await;
            if let Err(undo) = undone {
                tracing::warn!(%undo, "a reservation that was not replicated could not be undone; it waits for the engine's release check");
            }
            return Err(err);
        }
        Ok(reservation)
    }

    async fn get(&self, scope: &Scope, key: &IdempotencyKey) -> Result<Option<Record>, StoreError> {
        let answer: Value = GET
            .key(self.key(scope, key))
            .invoke_async(&mut self.conn())
            .await
            .map_err(error::to_store)?;
        match answer {
            // Lua's `false`: RESP2 makes it a nil, RESP3 a boolean.
            Value::Nil | Value::Boolean(false) => Ok(None),
            fields => record::from_value(fields).map(Some),
        }
    }

    async fn resolve(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        lease: &Lease,
        outcome: &FinalOutcome,
    ) -> Result<(), StoreError> {
        let state: RecordState = outcome.verdict.into();
        let name = self.key(scope, key);
        self.fenced(
            &name,
            RESOLVE
                .key(&name)
                .arg(lease.owner.to_bytes().as_slice())
                .arg(lease.attempt)
                .arg(state.as_str())
                .arg(millis(outcome.retention))
                .arg(outcome.response.status)
                .arg(outcome.response.encode_headers())
                .arg(&outcome.response.body[..])
                .arg(flagged(outcome.resource_id.as_deref()))
                .arg(flagged(outcome.error_code.as_deref())),
        )
        .await
    }

    async fn release(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        lease: &Lease,
    ) -> Result<(), StoreError> {
        let name = self.key(scope, key);
        self.fenced(
            &name,
            RELEASE
                .key(&name)
                .arg(lease.owner.to_bytes().as_slice())
                .arg(lease.attempt),
        )
        .await
    }

    async fn mark_unknown(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        lease: &Lease,
        _reason: &str,
    ) -> Result<(), StoreError> {
        let name = self.key(scope, key);
        self.fenced(
            &name,
            MARK_UNKNOWN
                .key(&name)
                .arg(lease.owner.to_bytes().as_slice())
                .arg(lease.attempt),
        )
        .await
    }

    async fn renew(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        lease: &Lease,
        duration: Duration,
    ) -> Result<Timestamp, StoreError> {
        let name = self.key(scope, key);
        let mut conn = self.conn();
        let until: i64 = RENEW
            .key(&name)
            .arg(lease.owner.to_bytes().as_slice())
            .arg(lease.attempt)
            .arg(millis(duration))
            .invoke_async(&mut conn)
            .await
            .map_err(error::to_store)?;
        if until < 0 {
            return Err(StoreError::Fenced);
        }
        self.replicated(&mut conn, &name).await?;
        Ok(Timestamp::from_millis(until))
    }
}

impl ListRecords for RedisStore {
    /// Scans every record key of the tenant (or of the whole prefix), reads
    /// the records in pipelined batches, and filters, sorts and pages on
    /// the client: O(records) per page. Meant for operators.
    async fn list(&self, filter: &ListFilter) -> Result<Page, StoreError> {
        let now = self.now().await?;
        let cutoff = filter.older_than.map(|age| now.minus(age));
        let pattern = keys::scan_pattern(&self.prefix, filter.tenant.as_deref());
        let names = self.scan(&pattern).await?;
        let mut records = Vec::new();
        {
            let answers = self.fetch(&names).await?;
            for answer in answers {
                if matches!(&answer, Value::Array(a) if a.is_empty())
                    || matches!(&answer, Value::Map(m) if m.is_empty())
                {
                    continue; // deleted or expired since the scan
                }
                let r = record::from_value(answer)?;
                let keep = !r.is_expired(now)
                    && filter.state.is_none_or(|s| r.state == s)
                    && cutoff.is_none_or(|c| r.created_at <= c)
                    && filter
                        .tenant
                        .as_deref()
                        .is_none_or(|t| r.scope.tenant() == t)
                    && filter.after.as_ref().is_none_or(|c| c.is_before(&r));
                if keep {
                    records.push(r);
                }
            }
        }
        records.sort_by(|a, b| {
            (
                a.created_at,
                a.scope.tenant(),
                a.scope.operation(),
                a.key.as_str(),
            )
                .cmp(&(
                    b.created_at,
                    b.scope.tenant(),
                    b.scope.operation(),
                    b.key.as_str(),
                ))
        });
        let limit = filter.page_size();
        Ok(Page::from_read_ahead(records, limit))
    }
}

impl Purge for RedisStore {
    /// Final records expire by themselves (`PEXPIREAT` at their
    /// retention), and processing ones are never purged, so there is
    /// nothing to delete: always 0.
    async fn purge_expired(&self, _batch: usize) -> Result<u64, StoreError> {
        Ok(0)
    }

    async fn delete(&self, scope: &Scope, key: &IdempotencyKey) -> Result<bool, StoreError> {
        let removed: i64 = redis::cmd("DEL")
            .arg(self.key(scope, key))
            .query_async(&mut self.conn())
            .await
            .map_err(error::to_store)?;
        Ok(removed > 0)
    }
}

impl CacheStore for RedisStore {
    /// Stores a copy that expires when the record stops being answerable
    /// from a copy: at `expires_at` when final, at the lease's end when
    /// processing. A copy already past that time is not kept.
    async fn put(&self, record: Record) -> Result<(), StoreError> {
        let expire_at = if record.state.is_final() {
            record.expires_at
        } else {
            record.lease.locked_until
        };
        let name = self.key(&record.scope, &record.key);
        let fields = record::to_fields(&record);
        let mut invocation = PUT.key(name);
        invocation.arg(expire_at.as_millis());
        for (field, value) in &fields {
            invocation.arg(*field).arg(value.as_slice());
        }
        let _kept: i64 = invocation
            .invoke_async(&mut self.conn())
            .await
            .map_err(error::to_store)?;
        Ok(())
    }

    async fn evict(&self, scope: &Scope, key: &IdempotencyKey) -> Result<(), StoreError> {
        redis::cmd("DEL")
            .arg(self.key(scope, key))
            .query_async::<i64>(&mut self.conn())
            .await
            .map_err(error::to_store)?;
        Ok(())
    }
}
