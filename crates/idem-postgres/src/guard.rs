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

use sqlx::{Postgres, Row, Transaction};

use crate::MessagingError;
use crate::inbox::check_id;

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
    /// `tx`. (The relay publishes both as headers, with the outbox sequence
    /// as the version.)
    pub async fn check(
        tx: &mut Transaction<'_, Postgres>,
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
        // One statement on the common path: a new aggregate's row is
        // created (at 1 for its first version, else at 0), an existing row
        // moves to `version` when it is the next one. The conflicting row
        // is locked either way (ON CONFLICT DO UPDATE locks it even when
        // its WHERE is false), so concurrent deliveries of one aggregate
        // serialise, and two first deliveries of a new aggregate cannot
        // both see "nothing yet".
        let moved: Option<i64> = sqlx::query_scalar(
            "INSERT INTO idem_aggregate_versions AS v \
               (consumer, aggregate_type, aggregate_id, version) \
             VALUES ($1, $2, $3, CASE WHEN $4 = 1 THEN 1 ELSE 0 END) \
             ON CONFLICT (consumer, aggregate_type, aggregate_id) DO UPDATE \
               SET version = $4, updated_at = clock_timestamp() \
               WHERE v.version = $4 - 1 \
             RETURNING version",
        )
        .bind(consumer)
        .bind(aggregate_type)
        .bind(aggregate_id)
        .bind(version)
        .fetch_optional(&mut **tx)
        .await?;
        let last = match moved {
            Some(v) if v == version => return Ok(Order::Apply),
            // Created at 0: its first version has not come yet.
            Some(v) => v,
            // Not the next version: read the last one (the row is ours).
            None => sqlx::query(
                "SELECT version FROM idem_aggregate_versions \
                 WHERE consumer = $1 AND aggregate_type = $2 AND aggregate_id = $3",
            )
            .bind(consumer)
            .bind(aggregate_type)
            .bind(aggregate_id)
            .fetch_one(&mut **tx)
            .await?
            .try_get("version")?,
        };
        if version <= last {
            return Ok(Order::Stale { last });
        }
        Ok(Order::Gap { expected: last + 1 })
    }
}
