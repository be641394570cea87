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
//! This module is the one home of the outbox tables' SQL (the statements
//! are in `queries/outbox/`): the writer's [`Outbox::enqueue`], the
//! operator's [`Outbox::list`], [`Outbox::replay_dead`] and
//! [`Outbox::discard_dead`], and the relay's side: reading what to publish
//! ([`Outbox::claim_heads`]), marking it published or failed, deleting
//! published rows after retention, wake-up registrations, the backlog
//! gauges, and the [`PartitionLocks`] through which relays share the
//! aggregates. `idem_messaging::Relay` schedules and publishes on top of
//! these and holds no SQL.
//!
//! Each row also carries the W3C trace context of the transaction that
//! wrote it (headers `traceparent` and `tracestate`, see
//! [`trace_context`](crate::trace_context)): given with
//! [`OutboxMessage::with_trace_context`], or, with the `otel` feature,
//! taken from the current `tracing` span. The relay publishes it, so the
//! consumer's handler continues the trace.
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

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use serde_json::Value;
use sqlx::postgres::PgListener;
use sqlx::{Executor, PgConnection, PgPool, Postgres, Row, Transaction};

use crate::MessagingError;
use crate::inbox::check_id;
use crate::trace_context::{TRACEPARENT, TRACESTATE, TraceContext};

mod locks;
mod relay;

pub use locks::PartitionLocks;
pub use relay::{AggregateKey, Heads, HeadsQuery, PendingRow, PendingStats};

// The outbox table's statements, one file each under `queries/outbox/`
// (the tables themselves are in migrations 2, 4 and 5). Every statement on
// `idem_outbox`, `idem_outbox_sequences` and `idem_outbox_listeners` is
// here, and only here.
const ENQUEUE: &str = include_str!("../../queries/outbox/enqueue.sql");
const LIST: &str = include_str!("../../queries/outbox/list.sql");
const REPLAY_DEAD: &str = include_str!("../../queries/outbox/replay_dead.sql");
const DISCARD_DEAD: &str = include_str!("../../queries/outbox/discard_dead.sql");
const CLAIM_HEADS: &str = include_str!("../../queries/outbox/claim_heads.sql");
const MARK_PUBLISHED: &str = include_str!("../../queries/outbox/mark_published.sql");
const RECORD_FAILURE: &str = include_str!("../../queries/outbox/record_failure.sql");
const PURGE_PUBLISHED: &str = include_str!("../../queries/outbox/purge_published.sql");
const PENDING_STATS: &str = include_str!("../../queries/outbox/pending_stats.sql");
const REGISTER_LISTENER: &str = include_str!("../../queries/outbox/register_listener.sql");
const UNREGISTER_LISTENER: &str = include_str!("../../queries/outbox/unregister_listener.sql");
const LIVE_RELAYS: &str = include_str!("../../queries/outbox/live_relays.sql");
const TRY_LOCK_PARTITION: &str = include_str!("../../queries/outbox/try_lock_partition.sql");
const UNLOCK_PARTITION: &str = include_str!("../../queries/outbox/unlock_partition.sql");

/// The channel inserting statements notify while a relay waits (migration
/// 4's trigger sends the outbox's schema as payload).
pub const NOTIFY_CHANNEL: &str = "idem_outbox";

/// One outgoing event, validated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutboxMessage {
    aggregate_type: String,
    aggregate_id: String,
    message_type: String,
    payload: String,
    headers: BTreeMap<String, String>,
    trace: Option<TraceContext>,
}

/// Where an enqueued message sits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Enqueued {
    /// The row id: the message's place in the outbox. The broker's
    /// de-duplication id is the row's random event id, not this.
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
            trace: None,
        })
    }

    /// Adds a header published with the message (e.g. a tenant). The
    /// trace context's headers (`traceparent`, `tracestate`) are refused
    /// here: they are given, checked, with
    /// [`with_trace_context`](Self::with_trace_context).
    pub fn with_header(mut self, name: &str, value: &str) -> Result<Self, MessagingError> {
        check_id("header name", name)?;
        if name.eq_ignore_ascii_case(TRACEPARENT) || name.eq_ignore_ascii_case(TRACESTATE) {
            return Err(MessagingError::invalid(
                "header name",
                format!("{name:?} is the trace context: give it with with_trace_context"),
            ));
        }
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

    /// Records this W3C trace context with the message (headers
    /// `traceparent` and `tracestate`), instead of the current span's:
    /// for a context that came from elsewhere (an incoming request's
    /// headers, a job's record). Checked strictly (see
    /// [`TraceContext::new`]): a malformed value is refused with
    /// [`MessagingError::InvalidMessage`] and never stored.
    pub fn with_trace_context(
        mut self,
        traceparent: &str,
        tracestate: Option<&str>,
    ) -> Result<Self, MessagingError> {
        self.trace = Some(TraceContext::new(traceparent, tracestate)?);
        Ok(self)
    }

    /// The trace context given with
    /// [`with_trace_context`](Self::with_trace_context), if any (the
    /// current span's, used when there is none, is read at enqueue).
    pub fn trace_context(&self) -> Option<&TraceContext> {
        self.trace.as_ref()
    }

    /// The headers stored with the row: the message's own, and the trace
    /// context: the explicit one, else the current span's (`otel`
    /// feature), else none.
    fn stored_headers(&self) -> String {
        let trace = self.trace.clone().or_else(TraceContext::current);
        let json = match trace {
            None => serde_json::to_string(&self.headers),
            Some(trace) => {
                let mut headers = self.headers.clone();
                headers.insert(TRACEPARENT.to_owned(), trace.traceparent().to_owned());
                if let Some(state) = trace.tracestate() {
                    headers.insert(TRACESTATE.to_owned(), state.to_owned());
                }
                serde_json::to_string(&headers)
            }
        };
        // A map of strings always serialises.
        json.unwrap_or_else(|_| "{}".to_owned())
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
    /// Row id (the broker's de-duplication id is the row's random event
    /// id, published as the message id).
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
    /// Writes `msg` in `tx` as the next event of its aggregate, with its
    /// trace context: the one given with
    /// [`OutboxMessage::with_trace_context`], else (feature `otel`) the
    /// current span's, if an OpenTelemetry layer backs it.
    pub async fn enqueue(
        tx: &mut Transaction<'_, Postgres>,
        msg: &OutboxMessage,
    ) -> Result<Enqueued, MessagingError> {
        let headers = msg.stored_headers();
        let row = sqlx::query(ENQUEUE)
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
        let rows = sqlx::query(LIST)
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
        Ok(sqlx::query_scalar(REPLAY_DEAD)
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
        Ok(sqlx::query_scalar(DISCARD_DEAD)
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
        assert!(msg.clone().with_header("x", "line\nbreak").is_err());
        assert!(msg.clone().with_header("Traceparent", "x").is_err());
        assert!(msg.with_header("tracestate", "x").is_err());
    }

    #[test]
    fn the_trace_context_is_checked_and_stored_in_the_headers() {
        const GOOD: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let msg = OutboxMessage::new("payment", "pay_1", "PaymentAuthorized", "{}")
            .and_then(|m| m.with_header("tenant", "acme"))
            .expect("valid");
        assert_eq!(msg.stored_headers(), r#"{"tenant":"acme"}"#);
        let traced = msg
            .clone()
            .with_trace_context(GOOD, Some("rojo=1"))
            .expect("valid");
        assert_eq!(
            traced.trace_context().map(TraceContext::trace_id),
            Some("4bf92f3577b34da6a3ce929d0e0e4736")
        );
        let stored: BTreeMap<String, String> =
            serde_json::from_str(&traced.stored_headers()).expect("JSON");
        assert_eq!(stored.get("traceparent").map(String::as_str), Some(GOOD));
        assert_eq!(stored.get("tracestate").map(String::as_str), Some("rojo=1"));
        assert_eq!(stored.get("tenant").map(String::as_str), Some("acme"));
        for (parent, state, field) in [
            (&GOOD.to_uppercase()[..], None, "traceparent"),
            (
                "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
                None,
                "traceparent",
            ),
            (GOOD, Some("a\u{0}b"), "tracestate"),
        ] {
            let err = msg
                .clone()
                .with_trace_context(parent, state)
                .expect_err("malformed");
            assert!(
                matches!(&err, MessagingError::InvalidMessage { field: f, .. } if *f == field),
                "{parent:?}: {err}"
            );
        }
    }

    #[test]
    fn lock_classes_differ_per_namespace_and_are_stable() {
        assert_eq!(PartitionLocks::new("public"), PartitionLocks::new("public"));
        assert_ne!(
            PartitionLocks::new("public").class(),
            PartitionLocks::new("billing").class()
        );
    }
}
