//! The transactional outbox: outgoing events written in the same
//! transaction as the change they announce, so there is never a change
//! without its event nor an event without its change (no dual write).
//!
//! [`Outbox::enqueue`] inserts the message in the caller's transaction and
//! gives it the next number of its aggregate's sequence. The enqueue that
//! takes number `n` holds the aggregate's counter row until its transaction
//! ends, so `n + 1` can only be taken after `n` committed (or rolled back,
//! freeing `n` again): per aggregate, sequence order is commit order, and a
//! relay that publishes only the lowest pending number of each aggregate
//! can neither reorder an aggregate's events nor skip one that commits
//! late.
//!
//! Because that counter row stays locked until commit, two transactions
//! that each enqueue for the same two aggregates in opposite orders can
//! deadlock (PostgreSQL then aborts one; retry it). Enqueue in a stable
//! order (e.g. by aggregate id) when one transaction announces several
//! aggregates.
//!
//! ```no_run
//! # async fn pay(pool: sqlx::PgPool) -> Result<(), idem_postgres::MessagingError> {
//! use idem_postgres::outbox::{Outbox, OutboxMessage};
//! let mut tx = pool.begin().await?;
//! // … the business change …
//! let msg = OutboxMessage::new("payment", "pay_1", "PaymentAuthorized", r#"{"amount_cents":100}"#)?;
//! Outbox::enqueue(&mut tx, &msg).await?;
//! tx.commit().await?;
//! # Ok(())
//! # }
//! ```

use std::collections::BTreeMap;

use serde_json::Value;
use sqlx::{Postgres, Row, Transaction};

use crate::MessagingError;
use crate::inbox::check_id;

/// One outgoing event, validated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutboxMessage {
    aggregate_type: String,
    aggregate_id: String,
    message_type: String,
    payload: String,
    headers: BTreeMap<String, String>,
}

/// Where an enqueued message sits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Enqueued {
    /// The row id: also the broker's de-duplication id.
    pub id: i64,
    /// Its number in the aggregate's sequence (1, 2, 3…).
    pub sequence: i64,
}

/// Accepts a name used as a subject / routing-key token: letters, digits,
/// `_` and `-` (no `.`, spaces or wildcards).
fn check_token(field: &'static str, value: &str) -> Result<(), MessagingError> {
    check_id(field, value)?;
    if let Some(bad) = value
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || *c == '_' || *c == '-'))
    {
        return Err(MessagingError::invalid(
            field,
            format!(
                "{value:?} contains {bad:?}; use letters, digits, '_' and '-' (it becomes part of the subject)"
            ),
        ));
    }
    Ok(())
}

impl OutboxMessage {
    /// A message whose payload is JSON text; anything that is not valid
    /// JSON is refused here, before it reaches the table or a consumer.
    pub fn new(
        aggregate_type: &str,
        aggregate_id: &str,
        message_type: &str,
        payload: &str,
    ) -> Result<Self, MessagingError> {
        serde_json::from_str::<serde::de::IgnoredAny>(payload)
            .map_err(|e| MessagingError::invalid("payload", format!("is not valid JSON: {e}")))?;
        Self::checked(
            aggregate_type,
            aggregate_id,
            message_type,
            payload.to_owned(),
        )
    }

    /// A message from a JSON value.
    pub fn from_value(
        aggregate_type: &str,
        aggregate_id: &str,
        message_type: &str,
        payload: &Value,
    ) -> Result<Self, MessagingError> {
        Self::checked(
            aggregate_type,
            aggregate_id,
            message_type,
            payload.to_string(),
        )
    }

    fn checked(
        aggregate_type: &str,
        aggregate_id: &str,
        message_type: &str,
        payload: String,
    ) -> Result<Self, MessagingError> {
        check_token("aggregate_type", aggregate_type)?;
        check_id("aggregate_id", aggregate_id)?;
        check_token("message_type", message_type)?;
        Ok(Self {
            aggregate_type: aggregate_type.to_owned(),
            aggregate_id: aggregate_id.to_owned(),
            message_type: message_type.to_owned(),
            payload,
            headers: BTreeMap::new(),
        })
    }

    /// Adds a header published with the message (e.g. a trace id).
    pub fn with_header(mut self, name: &str, value: &str) -> Result<Self, MessagingError> {
        check_id("header name", name)?;
        if name
            .chars()
            .any(|c| c.is_ascii_control() || c == ':' || c == ' ')
        {
            return Err(MessagingError::invalid(
                "header name",
                format!("{name:?} is not a header name"),
            ));
        }
        if value.chars().any(|c| c.is_ascii_control()) {
            return Err(MessagingError::invalid(
                "header value",
                format!("the value of {name:?} contains control characters"),
            ));
        }
        self.headers.insert(name.to_owned(), value.to_owned());
        Ok(self)
    }

    /// The aggregate's type (`payment`).
    pub fn aggregate_type(&self) -> &str {
        &self.aggregate_type
    }

    /// The aggregate's id (`pay_1`).
    pub fn aggregate_id(&self) -> &str {
        &self.aggregate_id
    }

    /// The event's type (`PaymentAuthorized`).
    pub fn message_type(&self) -> &str {
        &self.message_type
    }

    /// The JSON payload.
    pub fn payload(&self) -> &str {
        &self.payload
    }
}

/// The outbox table's operations; see the [module docs](self).
#[derive(Debug, Clone, Copy, Default)]
pub struct Outbox;

/// One outbox row as operators see it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct OutboxRow {
    /// Row id (the broker's de-duplication id).
    pub id: i64,
    /// Aggregate type.
    pub aggregate_type: String,
    /// Aggregate id.
    pub aggregate_id: String,
    /// Number in the aggregate's sequence.
    pub sequence: i64,
    /// Event type.
    pub message_type: String,
    /// `pending`, `published` or `dead`.
    pub state: String,
    /// Publish attempts so far.
    pub attempts: i32,
    /// The last failure, if any.
    pub last_error: Option<String>,
    /// When it was enqueued (RFC 3339).
    pub created_at: String,
}

impl Outbox {
    /// Writes `msg` in `tx` as the next event of its aggregate.
    pub async fn enqueue(
        tx: &mut Transaction<'_, Postgres>,
        msg: &OutboxMessage,
    ) -> Result<Enqueued, MessagingError> {
        let headers = serde_json::to_string(&msg.headers).unwrap_or_else(|_| "{}".to_owned());
        let row = sqlx::query(
            "WITH next AS ( \
               INSERT INTO idem_outbox_sequences (aggregate_type, aggregate_id, last_sequence) \
               VALUES ($1, $2, 1) \
               ON CONFLICT (aggregate_type, aggregate_id) \
               DO UPDATE SET last_sequence = idem_outbox_sequences.last_sequence + 1 \
               RETURNING last_sequence) \
             INSERT INTO idem_outbox (aggregate_type, aggregate_id, sequence, message_type, payload, headers) \
             SELECT $1, $2, next.last_sequence, $3, $4::jsonb, $5::jsonb FROM next \
             RETURNING id, sequence",
        )
        .bind(&msg.aggregate_type)
        .bind(&msg.aggregate_id)
        .bind(&msg.message_type)
        .bind(&msg.payload)
        .bind(headers)
        .fetch_one(&mut **tx)
        .await?;
        Ok(Enqueued {
            id: row.try_get("id")?,
            sequence: row.try_get("sequence")?,
        })
    }
}

impl Outbox {
    /// Rows in `state` (all states if `None`), oldest first, at most `limit`.
    pub async fn list<'e>(
        executor: impl sqlx::Executor<'e, Database = Postgres>,
        state: Option<&str>,
        limit: i64,
    ) -> Result<Vec<OutboxRow>, MessagingError> {
        if let Some(state) = state
            && !matches!(state, "pending" | "published" | "dead")
        {
            return Err(MessagingError::invalid(
                "state",
                format!("{state:?}: expected pending, published or dead"),
            ));
        }
        let rows = sqlx::query(
            "SELECT id, aggregate_type, aggregate_id, sequence, message_type, state, attempts, last_error, \
             to_char(created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.MS\"Z\"') AS created_at \
             FROM idem_outbox WHERE ($1::text IS NULL OR state = $1) ORDER BY id LIMIT $2",
        )
        .bind(state)
        .bind(limit.max(1))
        .fetch_all(executor)
        .await?;
        rows.iter()
            .map(|r| {
                Ok(OutboxRow {
                    id: r.try_get("id")?,
                    aggregate_type: r.try_get("aggregate_type")?,
                    aggregate_id: r.try_get("aggregate_id")?,
                    sequence: r.try_get("sequence")?,
                    message_type: r.try_get("message_type")?,
                    state: r.try_get("state")?,
                    attempts: r.try_get("attempts")?,
                    last_error: r.try_get("last_error")?,
                    created_at: r.try_get("created_at")?,
                })
            })
            .collect()
    }

    /// Puts dead rows back in line: pending, attempts reset, available
    /// now. Returns the ids that were dead (others are left alone).
    pub async fn replay_dead<'e>(
        executor: impl sqlx::Executor<'e, Database = Postgres>,
        ids: &[i64],
    ) -> Result<Vec<i64>, MessagingError> {
        Ok(sqlx::query_scalar(
            "UPDATE idem_outbox SET state = 'pending', attempts = 0, available_at = clock_timestamp() \
             WHERE id = ANY($1) AND state = 'dead' RETURNING id",
        )
        .bind(ids)
        .fetch_all(executor)
        .await?)
    }

    /// Deletes dead rows for good: their events are never delivered, and
    /// consumers that check versions see a gap at their sequence numbers
    /// (prefer [`replay_dead`](Self::replay_dead)). Returns the ids that
    /// were dead.
    pub async fn discard_dead<'e>(
        executor: impl sqlx::Executor<'e, Database = Postgres>,
        ids: &[i64],
    ) -> Result<Vec<i64>, MessagingError> {
        Ok(sqlx::query_scalar(
            "DELETE FROM idem_outbox WHERE id = ANY($1) AND state = 'dead' RETURNING id",
        )
        .bind(ids)
        .fetch_all(executor)
        .await?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_are_validated_before_the_database() {
        assert!(OutboxMessage::new("payment", "pay_1", "PaymentAuthorized", r#"{"a":1}"#).is_ok());
        for (args, field) in [
            (
                ("payment", "pay_1", "PaymentAuthorized", "{not json"),
                "payload",
            ),
            (("payment", "pay_1", "PaymentAuthorized", ""), "payload"),
            (
                ("pay.ment", "pay_1", "PaymentAuthorized", "{}"),
                "aggregate_type",
            ),
            (("payment", "", "PaymentAuthorized", "{}"), "aggregate_id"),
            (
                ("payment", "pay_1", "Payment Authorized", "{}"),
                "message_type",
            ),
            (("payment", "pay_1", "a>", "{}"), "message_type"),
        ] {
            let err = OutboxMessage::new(args.0, args.1, args.2, args.3).expect_err(field);
            assert!(
                matches!(&err, MessagingError::InvalidMessage { field: f, .. } if *f == field),
                "{args:?}: {err}"
            );
        }
        let msg = OutboxMessage::new("payment", "pay_1", "PaymentAuthorized", "{}").expect("valid");
        assert!(msg.clone().with_header("trace-id", "abc").is_ok());
        assert!(msg.clone().with_header("bad name", "x").is_err());
        assert!(msg.with_header("x", "line\nbreak").is_err());
    }
}
