//! The ordering guard: a consumer applies each aggregate's events in
//! version order, exactly once, whatever order the broker delivers them in.
//!
//! [`OrderingGuard::check`] runs in the consumer's transaction. It locks the
//! aggregate's row (concurrent deliveries for one aggregate serialise) and
//! compares the event's version with the last one applied: `last + 1` is
//! [`Order::Apply`] (the row moves to it when the transaction commits),
//! `<= last` is [`Order::Stale`] (already applied: acknowledge and drop),
//! and anything higher is a [`Order::Gap`] (an earlier event is still on
//! its way: redeliver this one later). An aggregate never seen starts at 0.
//! The PostgreSQL store has the same guard, for events its outbox relays.
//!
//! ```no_run
//! # async fn handle(pool: sqlx::MySqlPool) -> Result<(), idem_mysql::MessagingError> {
//! use idem_mysql::guard::{Order, OrderingGuard};
//! let mut tx = pool.begin().await?;
//! match OrderingGuard::check(&mut tx, "billing", "order", "order-7", 3).await? {
//!     Order::Apply => { /* apply version 3 in `tx` */ }
//!     Order::Stale { .. } => {} // applied before: acknowledge
//!     Order::Gap { .. } => { /* roll back; redeliver later */ }
//! }
//! tx.commit().await?;
//! # Ok(())
//! # }
//! ```

use sqlx::{MySql, Transaction};

use crate::MessagingError;
use crate::inbox::check_id;

// The aggregate-versions table's statements (the table is in migration 3).
const SEEN: &str = include_str!("../queries/guard/seen.sql");
const LAST: &str = include_str!("../queries/guard/last.sql");
const ADVANCE: &str = include_str!("../queries/guard/advance.sql");

/// What to do with an event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Order {
    /// The next version: apply it in this transaction.
    Apply,
    /// Already applied (`version <= last`): drop it, acknowledge.
    Stale {
        /// The last version applied.
        last: i64,
    },
    /// An earlier version is missing: redeliver this one later.
    Gap {
        /// The version that must come first.
        expected: i64,
    },
}

/// The aggregate-versions table's operations; see the [module docs](self).
#[derive(Debug, Clone, Copy, Default)]
pub struct OrderingGuard;

impl OrderingGuard {
    /// Decides about `version` of the aggregate `(aggregate_type,
    /// aggregate_id)` for `consumer`, and on [`Order::Apply`] records it in
    /// `tx`.
    pub async fn check(
        tx: &mut Transaction<'_, MySql>,
        consumer: &str,
        aggregate_type: &str,
        aggregate_id: &str,
        version: i64,
    ) -> Result<Order, MessagingError> {
        check_id("consumer", consumer)?;
        check_id("aggregate_type", aggregate_type)?;
        check_id("aggregate_id", aggregate_id)?;
        if version < 1 {
            return Err(MessagingError::invalid(
                "version",
                format!("{version} is not a version (they start at 1)"),
            ));
        }
        sqlx::query(SEEN)
            .bind(consumer)
            .bind(aggregate_type)
            .bind(aggregate_id)
            .execute(&mut **tx)
            .await?;
        let last: i64 = sqlx::query_scalar(LAST)
            .bind(consumer)
            .bind(aggregate_type)
            .bind(aggregate_id)
            .fetch_one(&mut **tx)
            .await?;
        if version <= last {
            return Ok(Order::Stale { last });
        }
        if version > last + 1 {
            return Ok(Order::Gap { expected: last + 1 });
        }
        sqlx::query(ADVANCE)
            .bind(version)
            .bind(consumer)
            .bind(aggregate_type)
            .bind(aggregate_id)
            .execute(&mut **tx)
            .await?;
        Ok(Order::Apply)
    }
}
