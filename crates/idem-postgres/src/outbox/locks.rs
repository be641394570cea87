//! The partition locks relays share an outbox by: one session advisory
//! lock per partition, held by at most one relay.

use super::*;

/// The PostgreSQL session advisory locks through which the relays of one
/// outbox share its partitions: a relay publishes only the aggregates of
/// the partitions it holds, so one aggregate is never published by two
/// relays at once. A lock lasts as long as the session that took it: a
/// relay that dies (even by SIGKILL) loses its partitions with its
/// connection, and another relay takes them at its next rebalance.
///
/// The first key of every lock is the outbox's class, a stable hash of its
/// namespace (its schema), so relays of other outboxes in the same database
/// never contend; the second key is the partition.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PartitionLocks {
    class: i32,
}

impl PartitionLocks {
    /// The locks of the outbox in `namespace` (its schema, e.g. `public`).
    pub fn new(namespace: &str) -> Self {
        // FNV-1a, 32 bits.
        let hash = namespace.bytes().fold(0x811c_9dc5_u32, |h, b| {
            (h ^ u32::from(b)).wrapping_mul(0x0100_0193)
        });
        Self {
            class: i32::from_ne_bytes(hash.to_ne_bytes()),
        }
    }

    /// The first key of this outbox's locks.
    pub fn class(self) -> i32 {
        self.class
    }

    /// Takes `partition` on the session `conn`, unless another session
    /// holds it; returns whether it is held now. Taking a partition the
    /// session already holds stacks a second lock on it (PostgreSQL's
    /// rule): keep track of what is held.
    pub async fn try_lock(
        self,
        conn: &mut PgConnection,
        partition: i32,
    ) -> Result<bool, MessagingError> {
        Ok(sqlx::query_scalar(TRY_LOCK_PARTITION)
            .bind(self.class)
            .bind(partition)
            .fetch_one(conn)
            .await?)
    }

    /// Gives `partition` back; returns whether the session held it.
    pub async fn unlock(
        self,
        conn: &mut PgConnection,
        partition: i32,
    ) -> Result<bool, MessagingError> {
        Ok(sqlx::query_scalar(UNLOCK_PARTITION)
            .bind(self.class)
            .bind(partition)
            .fetch_one(conn)
            .await?)
    }

    /// The relays sharing the partitions now: the sessions connected to
    /// this database under `application` (the `application_name` every
    /// relay of this outbox gives its lock session).
    pub async fn live_relays<'e>(
        executor: impl Executor<'e, Database = Postgres>,
        application: &str,
    ) -> Result<i64, MessagingError> {
        Ok(sqlx::query_scalar(LIVE_RELAYS)
            .bind(application)
            .fetch_one(executor)
            .await?)
    }
}
