//! What a relay is told and what it reports: its options, what a dead
//! row does, its errors and its counts.

use idem_postgres::sqlx::{self};
use std::time::Duration;

/// What a `dead` row does to the rows after it in its aggregate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OnDead {
    /// Hold them back until the dead row is replayed or discarded
    /// (order is kept).
    #[default]
    Block,
    /// Publish them anyway (order is broken around the dead row).
    Skip,
}

/// How the relay runs.
#[derive(Debug, Clone)]
pub struct RelayOptions {
    /// Subject prefix: `<prefix>.<aggregate_type>.<message_type>`.
    pub prefix: String,
    /// Partitions aggregates are hashed into (the unit of ownership).
    pub partitions: u16,
    /// Rows read per round.
    pub batch: usize,
    /// Rows per aggregate per round.
    pub per_aggregate: usize,
    /// Publishes in flight at once (over all aggregates; one per
    /// aggregate at a time).
    pub concurrency: usize,
    /// Attempts before a row becomes `dead`.
    pub max_attempts: i32,
    /// First retry delay (doubled per attempt, with jitter).
    pub backoff: Duration,
    /// Longest retry delay.
    pub max_backoff: Duration,
    /// Pause when a round found nothing and the relay cannot `LISTEN`
    /// (or `listen` is off).
    pub idle_poll: Duration,
    /// Wait for a notification when idle (migration 4's trigger sends one
    /// per inserting statement while some relay waits).
    pub listen: bool,
    /// While listening, how often to look anyway (what a notification can
    /// miss is found by then).
    pub notify_fallback: Duration,
    /// How often partitions are re-balanced between relays.
    pub rebalance: Duration,
    /// What a dead row does to its aggregate.
    pub on_dead: OnDead,
    /// How long published rows are kept.
    pub retention: Duration,
    /// The message-id prefix (`<source>:<row id>`) of rows written before
    /// schema version 5, which have no random event id: row ids alone
    /// repeat across outboxes, and a broker de-duplicating by id would drop
    /// the second outbox's event as a copy of the first's. Newer rows are
    /// published under their event id, unique whatever the database.
    /// `None`: the namespace given to [`Relay::new`](super::Relay::new) (the schema); set it
    /// when outboxes in different databases share a schema name.
    pub source: Option<String>,
}

impl Default for RelayOptions {
    fn default() -> Self {
        Self {
            prefix: "idem".to_owned(),
            partitions: 16,
            batch: 5000,
            per_aggregate: 100,
            concurrency: 64,
            max_attempts: 10,
            backoff: Duration::from_millis(200),
            max_backoff: Duration::from_secs(30),
            idle_poll: Duration::from_millis(100),
            listen: true,
            notify_fallback: Duration::from_secs(1),
            rebalance: Duration::from_secs(1),
            on_dead: OnDead::Block,
            retention: Duration::from_secs(7 * 24 * 3600),
            source: None,
        }
    }
}

impl RelayOptions {
    /// The longest time between a relay publishing a row and another relay
    /// publishing it again (a crash between the broker's ack and the mark):
    /// the broker's duplicate window must be longer.
    pub fn worst_republish_delay(&self) -> Duration {
        self.rebalance * 2 + self.max_backoff + Duration::from_secs(10)
    }
}

/// Why the relay stopped.
#[derive(Debug, thiserror::Error)]
pub enum RelayError {
    /// The database failed in a way retrying will not fix.
    #[error("outbox database: {0}")]
    Database(#[from] sqlx::Error),
}

/// Counts since start (also exported as metrics).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct RelayStats {
    /// Rows published (acknowledged by the broker; marked in the table
    /// right after).
    pub published: u64,
    /// Of those, ids the broker already had (re-publishes it dropped).
    pub duplicates: u64,
    /// Failed publish attempts.
    pub failures: u64,
    /// Rows that became dead.
    pub dead: u64,
}
