//! The store contract on DynamoDB: each record operation one conditional
//! write (a reservation that finds a record: a consistent read, then one
//! write conditional on what it read), and what a failed condition means.

use std::collections::HashMap;
use std::time::Duration;

use aws_sdk_dynamodb::types::{AttributeValue, ReturnValue};
use idem::store::{ExistingDecision, decide_existing};
use idem::{
    FinalOutcome, Fingerprint, IdempotencyKey, Lease, ListFilter, ListRecords, OUTCOME_UNKNOWN,
    Page, Purge, Record, RecordState, Reservation, ReserveRequest, Scope, Store, StoreError,
    Timestamp,
};

use crate::error::{is_condition_failed, is_item_too_large};
use crate::item::{self, Item, b, n, s};
use crate::schema::LIST_INDEX;
use crate::{DynamoError, DynamoStore, MAX_ROUNDS, millis};

/// The names and values of one request's expressions, collected as the
/// expressions are written: DynamoDB refuses a name or value that no
/// expression uses, and reserves many plain words (`state`, `owner`,
/// `ttl`…), so every attribute goes through a `#name`.
#[derive(Debug, Default)]
struct Expr {
    names: HashMap<String, String>,
    values: HashMap<String, AttributeValue>,
}

impl Expr {
    /// The placeholder of an attribute's name.
    fn name(&mut self, attribute: &str) -> String {
        let placeholder = format!("#{attribute}");
        self.names.insert(placeholder.clone(), attribute.to_owned());
        placeholder
    }

    /// The placeholder of a value.
    fn value(&mut self, label: &str, value: AttributeValue) -> String {
        let placeholder = format!(":{label}");
        self.values.insert(placeholder.clone(), value);
        placeholder
    }

    /// `owner` and `attempt` are the lease's, and, for `processing`, the
    /// record is still processing.
    fn fence(&mut self, lease: &Lease, processing: bool) -> String {
        let owner = format!(
            "{} = {}",
            self.name(item::OWNER),
            self.value("fence_owner", b(lease.owner.to_bytes().to_vec()))
        );
        let attempt = format!(
            "{} = {}",
            self.name(item::ATTEMPT),
            self.value("fence_attempt", n(i64::from(lease.attempt)))
        );
        let mut condition = format!("{owner} AND {attempt}");
        if processing {
            condition.push_str(&format!(" AND {}", self.is_processing()));
        }
        condition
    }

    /// The record is processing.
    fn is_processing(&mut self) -> String {
        format!(
            "{} = {}",
            self.name(item::STATE),
            self.value("processing", s(RecordState::Processing.as_str()))
        )
    }

    /// The record is final and past its retention at `now`.
    fn is_expired(&mut self, now: Timestamp) -> String {
        format!(
            "{} IN ({}, {}) AND {} <= {}",
            self.name(item::STATE),
            self.value("completed", s(RecordState::Completed.as_str())),
            self.value("failed", s(RecordState::Failed.as_str())),
            self.name(item::EXPIRES_AT),
            self.value("now", n(now.as_millis()))
        )
    }

    fn names(&self) -> Option<HashMap<String, String>> {
        (!self.names.is_empty()).then(|| self.names.clone())
    }

    fn values(&self) -> Option<HashMap<String, AttributeValue>> {
        (!self.values.is_empty()).then(|| self.values.clone())
    }
}

/// The key of a record's item.
fn key_of(scope: &Scope, key: &IdempotencyKey) -> Item {
    HashMap::from([(item::PK.to_owned(), s(item::pk(scope, key)))])
}

/// What one conditional write did.
enum Written {
    /// The condition held; the write is done.
    Done,
    /// The condition did not hold; nothing changed.
    ConditionFailed,
    /// DynamoDB refused the item as over its size limit; nothing changed.
    TooLarge,
}

impl DynamoStore {
    /// The store's clock (see the crate docs on the bounded skew).
    fn now(&self) -> Timestamp {
        Timestamp::now()
    }

    /// The record's item as it is now (a strongly consistent read).
    async fn read(&self, scope: &Scope, key: &IdempotencyKey) -> Result<Option<Item>, StoreError> {
        let out = self
            .client
            .get_item()
            .table_name(&*self.table)
            .set_key(Some(key_of(scope, key)))
            .consistent_read(true)
            .send()
            .await
            .map_err(|err| DynamoError::sdk("GetItem", err))?;
        Ok(out.item)
    }

    /// Puts a fresh processing record, attempt 1, if `condition` holds.
    async fn put_fresh(
        &self,
        req: &ReserveRequest<'_>,
        now: Timestamp,
        condition: String,
        expr: Expr,
    ) -> Result<Written, StoreError> {
        let fresh = item::fresh(
            req.scope,
            req.key,
            &req.fingerprint,
            req.owner,
            now,
            now.plus(req.lease),
            now.plus(req.retention),
        );
        let put = self
            .client
            .put_item()
            .table_name(&*self.table)
            .set_item(Some(fresh))
            .condition_expression(condition)
            .set_expression_attribute_names(expr.names())
            .set_expression_attribute_values(expr.values())
            .send()
            .await;
        match put {
            Ok(_) => Ok(Written::Done),
            Err(err) if is_condition_failed(&err) => Ok(Written::ConditionFailed),
            Err(err) if is_item_too_large(&err) => Ok(Written::TooLarge),
            Err(err) => Err(DynamoError::sdk("PutItem", err).into()),
        }
    }

    /// Updates a record with `update` if `condition` holds.
    async fn update(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        update: String,
        condition: String,
        expr: Expr,
    ) -> Result<Written, StoreError> {
        let updated = self
            .client
            .update_item()
            .table_name(&*self.table)
            .set_key(Some(key_of(scope, key)))
            .update_expression(update)
            .condition_expression(condition)
            .set_expression_attribute_names(expr.names())
            .set_expression_attribute_values(expr.values())
            .send()
            .await;
        match updated {
            Ok(_) => Ok(Written::Done),
            Err(err) if is_condition_failed(&err) => Ok(Written::ConditionFailed),
            Err(err) if is_item_too_large(&err) => Ok(Written::TooLarge),
            Err(err) => Err(DynamoError::sdk("UpdateItem", err).into()),
        }
    }

    /// Decides a reservation on an existing record read at `now`: idem's
    /// rules, replacing or taking it over with one write conditional on
    /// the owner and attempt read. `None`: that write's condition failed
    /// (someone changed the record since), so the caller reads again.
    async fn settle(
        &self,
        req: &ReserveRequest<'_>,
        existing: Record,
        now: Timestamp,
    ) -> Result<Option<Reservation>, StoreError> {
        // Our own reservation, whose answer was lost and whose retry then
        // found it: owner tokens are never reused.
        if existing.state == RecordState::Processing && existing.lease.owner == req.owner {
            return Ok(Some(Reservation::Acquired(existing.lease)));
        }
        let read = existing.lease;
        Ok(match decide_existing(&existing, req, now) {
            ExistingDecision::Replace => {
                let mut expr = Expr::default();
                let condition =
                    format!("{} AND {}", expr.fence(&read, false), expr.is_expired(now));
                match self.put_fresh(req, now, condition, expr).await? {
                    Written::Done => Some(Reservation::Acquired(Lease {
                        owner: req.owner,
                        attempt: 1,
                        locked_until: now.plus(req.lease),
                    })),
                    Written::ConditionFailed => None,
                    Written::TooLarge => return Err(Self::refused_size(None)),
                }
            }
            ExistingDecision::TakeOver => {
                let attempt = read.attempt.saturating_add(1);
                let locked_until = now.plus(req.lease);
                let mut expr = Expr::default();
                let condition = format!(
                    "{} AND {} <= {}",
                    expr.fence(&read, true),
                    expr.name(item::LOCKED_UNTIL),
                    expr.value("now", n(now.as_millis()))
                );
                let update = format!(
                    "SET {} = {}, {} = {}, {} = {}, {} = {}",
                    expr.name(item::OWNER),
                    expr.value("owner", b(req.owner.to_bytes().to_vec())),
                    expr.name(item::ATTEMPT),
                    expr.value("attempt", n(i64::from(attempt))),
                    expr.name(item::LOCKED_UNTIL),
                    expr.value("locked_until", n(locked_until.as_millis())),
                    expr.name(item::UPDATED_AT),
                    expr.value("updated_at", n(now.as_millis())),
                );
                match self
                    .update(req.scope, req.key, update, condition, expr)
                    .await?
                {
                    Written::Done => Some(Reservation::Acquired(Lease {
                        owner: req.owner,
                        attempt,
                        locked_until,
                    })),
                    Written::ConditionFailed => None,
                    Written::TooLarge => return Err(Self::refused_size(None)),
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

    /// A fenced write's refusal: not the owner (any more).
    fn fenced(written: Written) -> Result<(), StoreError> {
        match written {
            Written::Done => Ok(()),
            Written::ConditionFailed => Err(StoreError::Fenced),
            Written::TooLarge => Err(Self::refused_size(None)),
        }
    }

    /// DynamoDB refused an item as too large: `size` as the store
    /// counted it, when it did.
    fn refused_size(size: Option<usize>) -> StoreError {
        DynamoError::ItemTooLarge {
            size,
            limit: item::MAX_ITEM_BYTES,
        }
        .into()
    }
}

impl Store for DynamoStore {
    async fn reserve(&self, req: ReserveRequest<'_>) -> Result<Reservation, StoreError> {
        for _ in 0..MAX_ROUNDS {
            let now = self.now();
            let mut expr = Expr::default();
            let absent = format!("attribute_not_exists({})", expr.name(item::PK));
            match self.put_fresh(&req, now, absent, expr).await? {
                Written::Done => {
                    return Ok(Reservation::Acquired(Lease {
                        owner: req.owner,
                        attempt: 1,
                        locked_until: now.plus(req.lease),
                    }));
                }
                Written::ConditionFailed => {}
                Written::TooLarge => return Err(Self::refused_size(None)),
            }
            let Some(found) = self.read(req.scope, req.key).await? else {
                // Deleted since the put failed.
                continue;
            };
            let existing = item::record(&found)?;
            if let Some(reservation) = self.settle(&req, existing, self.now()).await? {
                return Ok(reservation);
            }
        }
        Err(DynamoError::Contention(MAX_ROUNDS).into())
    }

    async fn get(&self, scope: &Scope, key: &IdempotencyKey) -> Result<Option<Record>, StoreError> {
        let Some(found) = self.read(scope, key).await? else {
            return Ok(None);
        };
        let record = item::record(&found)?;
        // DynamoDB deletes items past their TTL late (within days): an
        // expired record reads as absent from the moment it expires.
        Ok((!record.is_expired(self.now())).then_some(record))
    }

    async fn resolve(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        lease: &Lease,
        outcome: &FinalOutcome,
    ) -> Result<(), StoreError> {
        let now = self.now();
        let state: RecordState = outcome.verdict.into();
        let expires_at = now.plus(outcome.retention);
        let response = &outcome.response;
        let mut sets: Vec<(&str, AttributeValue)> = vec![
            (item::STATE, s(state.as_str())),
            (item::UPDATED_AT, n(now.as_millis())),
            (item::EXPIRES_AT, n(expires_at.as_millis())),
            (item::TTL, n(ttl_seconds(expires_at, self.max_skew))),
            (item::STATUS, n(i64::from(response.status))),
        ];
        let mut removes = Vec::new();
        let headers = response.encode_headers();
        for (name, bytes) in [
            (item::HEADERS, headers),
            (item::BODY, response.body.to_vec()),
        ] {
            // Empty answers are absent attributes: read back as empty.
            if bytes.is_empty() {
                removes.push(name);
            } else {
                sets.push((name, b(bytes)));
            }
        }
        for (name, text) in [
            (item::RESOURCE_ID, &outcome.resource_id),
            (item::ERROR_CODE, &outcome.error_code),
        ] {
            match text {
                Some(text) => sets.push((name, s(text.as_str()))),
                None => removes.push(name),
            }
        }
        let size = resolved_size(scope, key, lease, &sets);
        if size > item::MAX_ITEM_BYTES {
            self.count_too_large();
            return Err(Self::refused_size(Some(size)));
        }
        let mut expr = Expr::default();
        let condition = expr.fence(lease, false);
        let assignments: Vec<String> = sets
            .into_iter()
            .map(|(name, value)| format!("{} = {}", expr.name(name), expr.value(name, value)))
            .collect();
        let mut update = format!("SET {}", assignments.join(", "));
        if !removes.is_empty() {
            let removed: Vec<String> = removes.iter().map(|name| expr.name(name)).collect();
            update.push_str(&format!(" REMOVE {}", removed.join(", ")));
        }
        match self.update(scope, key, update, condition, expr).await? {
            // DynamoDB counted more than the store did: refused all the same.
            Written::TooLarge => {
                self.count_too_large();
                Err(Self::refused_size(Some(size)))
            }
            written => Self::fenced(written),
        }
    }

    async fn release(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        lease: &Lease,
    ) -> Result<(), StoreError> {
        let mut expr = Expr::default();
        let condition = expr.fence(lease, true);
        let deleted = self
            .client
            .delete_item()
            .table_name(&*self.table)
            .set_key(Some(key_of(scope, key)))
            .condition_expression(condition)
            .set_expression_attribute_names(expr.names())
            .set_expression_attribute_values(expr.values())
            .send()
            .await;
        match deleted {
            Ok(_) => Ok(()),
            Err(err) if is_condition_failed(&err) => Err(StoreError::Fenced),
            Err(err) => Err(DynamoError::sdk("DeleteItem", err).into()),
        }
    }

    async fn mark_unknown(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        lease: &Lease,
        _reason: &str,
    ) -> Result<(), StoreError> {
        let mut expr = Expr::default();
        let condition = expr.fence(lease, true);
        let update = format!(
            "SET {} = {}, {} = {}",
            expr.name(item::ERROR_CODE),
            expr.value("error_code", s(OUTCOME_UNKNOWN)),
            expr.name(item::UPDATED_AT),
            expr.value("updated_at", n(self.now().as_millis())),
        );
        Self::fenced(self.update(scope, key, update, condition, expr).await?)
    }

    async fn renew(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        lease: &Lease,
        duration: Duration,
    ) -> Result<Timestamp, StoreError> {
        let now = self.now();
        let locked_until = now.plus(duration);
        let mut expr = Expr::default();
        let condition = expr.fence(lease, true);
        let update = format!(
            "SET {} = {}, {} = {}",
            expr.name(item::LOCKED_UNTIL),
            expr.value("locked_until", n(locked_until.as_millis())),
            expr.name(item::UPDATED_AT),
            expr.value("updated_at", n(now.as_millis())),
        );
        Self::fenced(self.update(scope, key, update, condition, expr).await?)?;
        Ok(locked_until)
    }
}

/// The TTL attribute of a record expiring at `expires_at`: whole seconds,
/// rounded up, `max_skew` later, so that DynamoDB's deletion (by its own
/// clock) never comes before the record's expiry by the store's clock.
fn ttl_seconds(expires_at: Timestamp, max_skew: Duration) -> i64 {
    let ms = expires_at.as_millis().saturating_add(millis(max_skew));
    ms.div_euclid(1_000) + i64::from(ms.rem_euclid(1_000) != 0)
}

/// The size of a record's item once resolved with `sets`: the attributes
/// every record has, then the answer's.
fn resolved_size(
    scope: &Scope,
    key: &IdempotencyKey,
    lease: &Lease,
    sets: &[(&str, AttributeValue)],
) -> usize {
    let t = Timestamp::from_millis(0);
    let mut full = item::fresh(
        scope,
        key,
        &Fingerprint::from_digest([0; 32]),
        lease.owner,
        t,
        t,
        t,
    );
    for (name, _) in sets {
        full.remove(*name);
    }
    item::size(full.iter().map(|(name, value)| (name.as_str(), value)))
        + item::size(sets.iter().map(|(name, value)| (*name, value)))
}

impl ListRecords for DynamoStore {
    async fn list(&self, filter: &ListFilter) -> Result<Page, StoreError> {
        let page_size = filter.page_size();
        let wanted = page_size + 1;
        let now = self.now();
        let cutoff = filter.older_than.map(|age| now.minus(age));
        let mut expr = Expr::default();
        let mut key_condition = format!(
            "{} = {}",
            expr.name(item::LIST_PK),
            expr.value("list_pk", s(item::LIST_PARTITION))
        );
        match (&filter.after, cutoff) {
            (Some(after), _) => {
                let after = item::list_sort_key(
                    after.created_at,
                    &after.tenant,
                    &after.operation,
                    &after.key,
                );
                key_condition.push_str(&format!(
                    " AND {} > {}",
                    expr.name(item::LIST_SK),
                    expr.value("after", s(after))
                ));
            }
            // Created at the cutoff or before: sort keys below the next
            // millisecond's digits.
            (None, Some(cutoff)) => {
                let upper = format!("{:016}", cutoff.as_millis().saturating_add(1).max(0));
                key_condition.push_str(&format!(
                    " AND {} < {}",
                    expr.name(item::LIST_SK),
                    expr.value("upper", s(upper))
                ));
            }
            (None, None) => {}
        }
        let mut filters = Vec::new();
        if let Some(tenant) = &filter.tenant {
            filters.push(format!(
                "{} = {}",
                expr.name(item::TENANT),
                expr.value("tenant", s(tenant.as_str()))
            ));
        }
        if let Some(state) = filter.state {
            filters.push(format!(
                "{} = {}",
                expr.name(item::STATE),
                expr.value("state", s(state.as_str()))
            ));
        }
        let filtered = !filters.is_empty();
        let filter_expression = filtered.then(|| filters.join(" AND "));
        let mut records = Vec::new();
        let mut start = None;
        'pages: loop {
            // Without a filter every item read is one of the page; with
            // one, read more at a time (a page is at most 1 MB anyway).
            let missing = wanted - records.len();
            let limit = if filtered { missing.max(100) } else { missing };
            let out = self
                .client
                .query()
                .table_name(&*self.table)
                .index_name(LIST_INDEX)
                .key_condition_expression(&key_condition)
                .set_filter_expression(filter_expression.clone())
                .set_expression_attribute_names(expr.names())
                .set_expression_attribute_values(expr.values())
                .limit(i32::try_from(limit.min(1_000)).unwrap_or(1_000))
                .set_exclusive_start_key(start)
                .send()
                .await
                .map_err(|err| DynamoError::sdk("Query", err))?;
            for found in out.items() {
                let record = item::record(found)?;
                if cutoff.is_some_and(|cutoff| record.created_at > cutoff) {
                    break 'pages;
                }
                if record.is_expired(now) {
                    continue;
                }
                records.push(record);
                if records.len() == wanted {
                    break 'pages;
                }
            }
            start = out.last_evaluated_key;
            if start.is_none() {
                break;
            }
        }
        Ok(Page::from_read_ahead(records, page_size))
    }
}

impl Purge for DynamoStore {
    async fn purge_expired(&self, batch: usize) -> Result<u64, StoreError> {
        if batch == 0 {
            return Ok(0);
        }
        let now = self.now();
        let mut scan = Expr::default();
        let expired = scan.is_expired(now);
        let projection = [item::PK, item::OWNER, item::ATTEMPT]
            .map(|name| scan.name(name))
            .join(", ");
        let mut deleted = 0_u64;
        let mut start = None;
        loop {
            let out = self
                .client
                .scan()
                .table_name(&*self.table)
                .filter_expression(&expired)
                .projection_expression(&projection)
                .set_expression_attribute_names(scan.names())
                .set_expression_attribute_values(scan.values())
                .set_exclusive_start_key(start)
                .send()
                .await
                .map_err(|err| DynamoError::sdk("Scan", err))?;
            for found in out.items() {
                let (Some(pk), Some(owner), Ok(attempt)) = (
                    found.get(item::PK),
                    found.get(item::OWNER),
                    item::number(found, item::ATTEMPT),
                ) else {
                    return Err(DynamoError::Corrupt(
                        "an item lacks its key, owner or attempt".to_owned(),
                    )
                    .into());
                };
                // Still the record scanned, and still expired: a record
                // replaced or taken since stays.
                let mut expr = Expr::default();
                let condition = format!(
                    "{} = {} AND {} = {} AND {}",
                    expr.name(item::OWNER),
                    expr.value("owner", owner.clone()),
                    expr.name(item::ATTEMPT),
                    expr.value("attempt", n(attempt)),
                    expr.is_expired(now)
                );
                let removed = self
                    .client
                    .delete_item()
                    .table_name(&*self.table)
                    .key(item::PK, pk.clone())
                    .condition_expression(condition)
                    .set_expression_attribute_names(expr.names())
                    .set_expression_attribute_values(expr.values())
                    .send()
                    .await;
                match removed {
                    Ok(_) => deleted += 1,
                    Err(err) if is_condition_failed(&err) => {}
                    Err(err) => return Err(DynamoError::sdk("DeleteItem", err).into()),
                }
                if deleted >= u64::try_from(batch).unwrap_or(u64::MAX) {
                    return Ok(deleted);
                }
            }
            start = out.last_evaluated_key;
            if start.is_none() {
                return Ok(deleted);
            }
        }
    }

    async fn delete(&self, scope: &Scope, key: &IdempotencyKey) -> Result<bool, StoreError> {
        let out = self
            .client
            .delete_item()
            .table_name(&*self.table)
            .set_key(Some(key_of(scope, key)))
            .return_values(ReturnValue::AllOld)
            .send()
            .await
            .map_err(|err| DynamoError::sdk("DeleteItem", err))?;
        Ok(out.attributes.is_some_and(|old| !old.is_empty()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ttl_rounds_up_past_the_skew() {
        let second = Duration::from_secs(1);
        assert_eq!(ttl_seconds(Timestamp::from_millis(10_000), second), 11);
        assert_eq!(ttl_seconds(Timestamp::from_millis(10_001), second), 12);
        assert_eq!(
            ttl_seconds(Timestamp::from_millis(10_001), Duration::ZERO),
            11
        );
    }
}
