//! The transactional inbox: effectively-once processing of redelivered
//! messages.
//!
//! [`Inbox::process`] records the message id in the caller's transaction,
//! *before* the business change. When the transaction commits, the id and
//! the change are there together; when it rolls back (or the process dies
//! first), neither is, and the redelivery is processed as new. A message
//! already recorded is a [`InboxOutcome::Duplicate`]: skip the change and
//! acknowledge it. Two deliveries racing on the same id serialise on its
//! row: the second waits for the first transaction and then sees a
//! duplicate (or, if the first rolled back, processes it). The contract
//! and [`InboxOutcome`] are the core's ([`idem::inbox`]); the PostgreSQL
//! and SQLite stores have the same `Inbox`.
//!
//! ```no_run
//! # async fn handle(pool: sqlx::MySqlPool) -> Result<(), idem_mysql::MessagingError> {
//! use idem_mysql::inbox::{Inbox, InboxOutcome};
//! let mut tx = pool.begin().await?;
//! match Inbox::process(&mut tx, "orders", "msg-42", Some("order-7")).await? {
//!     InboxOutcome::Fresh => {
//!         sqlx::query("UPDATE orders SET state = 'paid' WHERE id = 'order-7'")
//!             .execute(&mut *tx)
//!             .await?;
//!     }
//!     InboxOutcome::Duplicate => {} // already applied: change nothing
//! }
//! tx.commit().await?; // then acknowledge the message
//! # Ok(())
//! # }
//! ```
//!
//! A duplicate is the insert's duplicate-key error, which MySQL rolls
//! back alone: the caller's transaction goes on.

use std::time::Duration;

use sqlx::{Executor, MySql, Transaction};

pub use idem::InboxOutcome;
pub use idem::inbox::MAX_ID_LEN;

use crate::MessagingError;
use crate::error::{DUPLICATE_KEY, error_number};

// The inbox table's statements (the table is in migration 2).
const PROCESS: &str = include_str!("../queries/inbox/process.sql");
const PURGE: &str = include_str!("../queries/inbox/purge.sql");
const PURGE_CONSUMER: &str = include_str!("../queries/inbox/purge_consumer.sql");

/// The inbox table's operations; see the [module docs](self).
#[derive(Debug, Clone, Copy, Default)]
pub struct Inbox;

impl Inbox {
    /// Records `message_id` for `consumer` in `tx`, or reports that it was
    /// processed before. Empty or over-long ids are refused: a message
    /// without an id can never be processed unprotected.
    pub async fn process(
        tx: &mut Transaction<'_, MySql>,
        consumer: &str,
        message_id: &str,
        aggregate_id: Option<&str>,
    ) -> Result<InboxOutcome, MessagingError> {
        check_id("consumer", consumer)?;
        check_id("message_id", message_id)?;
        let inserted = sqlx::query(PROCESS)
            .bind(consumer)
            .bind(message_id)
            .bind(aggregate_id)
            .execute(&mut **tx)
            .await;
        match inserted {
            Ok(_) => Ok(InboxOutcome::Fresh),
            Err(err) if error_number(&err) == Some(DUPLICATE_KEY) => Ok(InboxOutcome::Duplicate),
            Err(err) => Err(err.into()),
        }
    }

    /// Deletes at most `batch` inbox rows processed more than `retention`
    /// ago, of every consumer, oldest first (one short statement; call it
    /// in a loop until it returns less than `batch`). Keep the retention
    /// longer than the broker can redeliver a message, or an old
    /// redelivery would be processed again.
    pub async fn purge_older_than<'e>(
        executor: impl Executor<'e, Database = MySql>,
        retention: Duration,
        batch: usize,
    ) -> Result<u64, MessagingError> {
        let done = sqlx::query(PURGE)
            .bind(retention_ms(retention))
            .bind(i64::try_from(batch).unwrap_or(i64::MAX))
            .execute(executor)
            .await?;
        Ok(done.rows_affected())
    }

    /// [`purge_older_than`](Self::purge_older_than) for one consumer's rows
    /// only (consumers sharing a database may keep their ids for different
    /// times).
    pub async fn purge_consumer_older_than<'e>(
        executor: impl Executor<'e, Database = MySql>,
        consumer: &str,
        retention: Duration,
        batch: usize,
    ) -> Result<u64, MessagingError> {
        check_id("consumer", consumer)?;
        let done = sqlx::query(PURGE_CONSUMER)
            .bind(consumer)
            .bind(retention_ms(retention))
            .bind(i64::try_from(batch).unwrap_or(i64::MAX))
            .execute(executor)
            .await?;
        Ok(done.rows_affected())
    }
}

/// A retention in milliseconds, capped as record durations are (100
/// years), so that the server's date arithmetic stays in range.
fn retention_ms(retention: Duration) -> i64 {
    crate::ops::millis(retention)
}

/// Refuses an empty or over-long identifier.
pub(crate) fn check_id(field: &'static str, value: &str) -> Result<(), MessagingError> {
    if value.is_empty() {
        return Err(MessagingError::invalid(field, "must not be empty"));
    }
    if value.len() > MAX_ID_LEN {
        return Err(MessagingError::invalid(
            field,
            format!("is {} bytes; at most {MAX_ID_LEN}", value.len()),
        ));
    }
    Ok(())
}
