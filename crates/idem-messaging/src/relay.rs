//! The outbox relay: publishes pending outbox rows, in order per
//! aggregate, with several relays running at once.
//!
//! ## Why it cannot reorder or skip an aggregate's events
//!
//! * **One relay per aggregate at a time.** Aggregates are hashed into
//!   `partitions`; a relay publishes only the partitions it holds a
//!   PostgreSQL session advisory lock on. A relay that dies (even by
//!   SIGKILL) loses its session and so its locks; another takes the
//!   partitions over at its next rebalance. Plain `FOR UPDATE SKIP LOCKED`
//!   would let two relays publish one aggregate's consecutive rows at the
//!   same time, and the broker could receive them in either order.
//! * **Only the head of each aggregate.** Outbox rows carry a per-aggregate
//!   sequence given out in commit order (see `idem_postgres::outbox`). A
//!   round takes, per aggregate, the pending rows from the lowest sequence
//!   on, stopping at the first row that is not ready (backing off after a
//!   failed publish) or `dead` (under [`OnDead::Block`]); it publishes them
//!   one after the other, each after the previous one's acknowledgement,
//!   and stops the aggregate at the first failure. Reading `id > last_id`
//!   instead would skip a row whose transaction took its id early and
//!   committed late; an aggregate's sequence cannot have such a hole.
//! * **Exactly once in the stream.** A row is marked published only after
//!   the broker acknowledged it. A relay that dies between the ack and the
//!   mark leaves the row pending; whoever takes the partition over
//!   publishes it again with the same id (the outbox row id), which the
//!   broker's de-duplication window drops. The relay checks at start that
//!   the window is longer than its worst re-publish delay and warns loudly
//!   if not.
//!
//! Rows that fail `max_attempts` times become `dead`: counted, logged, and
//! (by default) holding back the rest of their aggregate until an operator
//! replays or discards them.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use idem_postgres::sqlx::postgres::PgConnectOptions;
use idem_postgres::sqlx::{self, ConnectOptions, Connection, PgConnection, PgPool, Row};
use tokio::task::JoinSet;

use crate::headers;
use crate::publisher::{Outgoing, Publisher};

/// The `application_name` prefix of a relay's lock session (relays of one
/// outbox count each other by it to share the partitions).
pub const RELAY_APPLICATION: &str = "idem-relay";

/// The first key of the advisory locks of the relays of the outbox in
/// `namespace` (its schema): a stable hash, so relays of other outboxes in
/// the same database never contend; the second key is the partition.
fn lock_class(namespace: &str) -> i32 {
    // FNV-1a, 32 bits.
    let hash = namespace.bytes().fold(0x811c_9dc5_u32, |h, b| {
        (h ^ u32::from(b)).wrapping_mul(0x0100_0193)
    });
    i32::from_ne_bytes(hash.to_ne_bytes())
}

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
    /// Aggregates published at once.
    pub concurrency: usize,
    /// Attempts before a row becomes `dead`.
    pub max_attempts: i32,
    /// First retry delay (doubled per attempt, with jitter).
    pub backoff: Duration,
    /// Longest retry delay.
    pub max_backoff: Duration,
    /// Pause when a round found nothing.
    pub idle_poll: Duration,
    /// How often partitions are re-balanced between relays.
    pub rebalance: Duration,
    /// What a dead row does to its aggregate.
    pub on_dead: OnDead,
    /// How long published rows are kept.
    pub retention: Duration,
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
            rebalance: Duration::from_secs(1),
            on_dead: OnDead::Block,
            retention: Duration::from_secs(7 * 24 * 3600),
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
    /// Rows published (acknowledged and marked).
    pub published: u64,
    /// Of those, ids the broker already had (re-publishes it dropped).
    pub duplicates: u64,
    /// Failed publish attempts.
    pub failures: u64,
    /// Rows that became dead.
    pub dead: u64,
}

/// One pending row.
#[derive(Debug, Clone)]
struct Row_ {
    id: i64,
    aggregate_type: String,
    aggregate_id: String,
    sequence: i64,
    message_type: String,
    payload: String,
    headers: String,
    attempts: i32,
}

/// The relay; see the [module docs](self).
#[derive(Debug)]
pub struct Relay<P> {
    pool: PgPool,
    lock_options: PgConnectOptions,
    lock_class: i32,
    application: String,
    publisher: Arc<P>,
    options: RelayOptions,
    lock: Option<PgConnection>,
    owned: Vec<i32>,
    stats: RelayStats,
    ready: Arc<AtomicBool>,
    /// Whether the current broker outage was logged (once per outage).
    outage_logged: bool,
}

impl<P: Publisher> Relay<P> {
    /// A relay over the outbox that `pool` sees; `lock_options` open its
    /// dedicated lock session (usually the pool's own options) and
    /// `namespace` names that outbox among others in the database (its
    /// schema, e.g. `public`).
    pub fn new(
        pool: PgPool,
        lock_options: PgConnectOptions,
        namespace: &str,
        publisher: P,
        options: RelayOptions,
    ) -> Self {
        let application = format!("{RELAY_APPLICATION}:{namespace}");
        Self {
            pool,
            lock_options: lock_options.application_name(&application),
            lock_class: lock_class(namespace),
            application,
            publisher: Arc::new(publisher),
            options,
            lock: None,
            owned: Vec::new(),
            stats: RelayStats::default(),
            ready: Arc::new(AtomicBool::new(false)),
            outage_logged: false,
        }
    }

    /// Whether the last round reached both the database and the broker.
    pub fn readiness(&self) -> Arc<AtomicBool> {
        Arc::clone(&self.ready)
    }

    /// Counts so far.
    pub fn stats(&self) -> RelayStats {
        self.stats
    }

    /// The partitions this relay holds now.
    pub fn owned(&self) -> &[i32] {
        &self.owned
    }

    /// Warns (and returns the warning) when the broker's duplicate window
    /// is shorter than the relay's worst re-publish delay.
    pub async fn check_duplicate_window(&self) -> Option<String> {
        let worst = self.options.worst_republish_delay();
        match self.publisher.duplicate_window().await {
            Ok(Some(window)) if window < worst => {
                let msg = format!(
                    "the broker's duplicate window ({window:?}) is shorter than the relay's worst re-publish delay ({worst:?}): a row re-published after a relay crash could reach consumers twice; raise the stream's duplicate_window"
                );
                tracing::warn!(reason = "relay_duplicate_window_short", "{msg}");
                Some(msg)
            }
            Ok(_) => None,
            Err(err) => {
                let msg = format!("cannot read the broker's duplicate window: {err}");
                tracing::warn!(reason = "relay_duplicate_window_unknown", "{msg}");
                Some(msg)
            }
        }
    }

    /// Runs until `stop` completes; returns the counts. Database and
    /// broker failures are retried (the relay reports not ready meanwhile).
    pub async fn run(mut self, stop: impl std::future::Future<Output = ()>) -> RelayStats {
        let mut stop = std::pin::pin!(stop);
        let mut last_rebalance: Option<Instant> = None;
        let mut last_cleanup = Instant::now();
        let mut last_gauges: Option<Instant> = None;
        loop {
            if last_gauges.is_none_or(|t| t.elapsed() >= Duration::from_secs(5)) {
                last_gauges = Some(Instant::now());
                if let Err(err) = self.export_backlog().await {
                    tracing::debug!(%err, "cannot read the outbox backlog");
                }
            }
            if last_rebalance.is_none_or(|t| t.elapsed() >= self.options.rebalance) {
                if let Err(err) = self.rebalance().await {
                    tracing::warn!(reason = "relay_rebalance_failed", %err, "cannot hold partitions; retrying");
                    self.drop_lock_session().await;
                }
                last_rebalance = Some(Instant::now());
            }
            let worked = match self.round().await {
                Ok(n) => {
                    self.ready
                        .store(self.publisher.is_connected(), Ordering::Relaxed);
                    n > 0
                }
                Err(err) => {
                    self.ready.store(false, Ordering::Relaxed);
                    tracing::warn!(reason = "relay_round_failed", %err, "retrying");
                    false
                }
            };
            if last_cleanup.elapsed() >= Duration::from_secs(60) {
                last_cleanup = Instant::now();
                if let Err(err) = self.delete_published().await {
                    tracing::warn!(reason = "relay_retention_failed", %err);
                }
            }
            if !worked {
                tokio::select! {
                    () = &mut stop => break,
                    () = tokio::time::sleep(self.options.idle_poll) => {}
                }
            } else if futures_ready(&mut stop).await {
                break;
            }
        }
        self.drop_lock_session().await;
        self.stats
    }

    async fn drop_lock_session(&mut self) {
        self.owned.clear();
        if let Some(conn) = self.lock.take() {
            let _ = conn.close().await;
        }
    }

    /// Takes free partitions up to a fair share (partitions ÷ live relays)
    /// and gives back any above it.
    async fn rebalance(&mut self) -> Result<(), sqlx::Error> {
        if self.lock.is_none() {
            self.lock = Some(self.lock_options.connect().await?);
            self.owned.clear();
        }
        let Some(conn) = self.lock.as_mut() else {
            return Ok(());
        };
        let relays: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 AND datname = current_database()",
        )
        .bind(&self.application)
        .fetch_one(&mut *conn)
        .await?;
        let partitions = i32::from(self.options.partitions);
        let share = usize::try_from((i64::from(partitions) + relays.max(1) - 1) / relays.max(1))
            .unwrap_or(usize::MAX);
        while self.owned.len() > share {
            if let Some(p) = self.owned.pop() {
                sqlx::query("SELECT pg_advisory_unlock($1, $2)")
                    .bind(self.lock_class)
                    .bind(p)
                    .execute(&mut *conn)
                    .await?;
            }
        }
        // Start at a different partition per relay so they do not all
        // race for the same ones.
        let start = (idem::OwnerToken::random().as_u128() % partitions as u128) as i32;
        for i in 0..partitions {
            if self.owned.len() >= share {
                break;
            }
            let p = (start + i) % partitions;
            if self.owned.contains(&p) {
                continue;
            }
            let got: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock($1, $2)")
                .bind(self.lock_class)
                .bind(p)
                .fetch_one(&mut *conn)
                .await?;
            if got {
                self.owned.push(p);
            }
        }
        self.owned.sort_unstable();
        Ok(())
    }

    /// One round over the held partitions; returns the rows published.
    async fn round(&mut self) -> Result<usize, sqlx::Error> {
        if self.owned.is_empty() {
            return Ok(0);
        }
        let dead_filter = match self.options.on_dead {
            OnDead::Block => "state IN ('pending', 'dead')",
            OnDead::Skip => "state = 'pending'",
        };
        let sql = format!(
            "WITH candidates AS ( \
               SELECT id, aggregate_type, aggregate_id, sequence, message_type, \
                      payload::text AS payload, headers::text AS headers, attempts, \
                      row_number() OVER w AS rn, \
                      bool_or(state = 'dead' OR available_at > clock_timestamp()) OVER w AS held \
               FROM idem_outbox \
               WHERE {dead_filter} \
                 AND ((hashtext(aggregate_type || '/' || aggregate_id) & 2147483647) % $1) = ANY($2) \
               WINDOW w AS (PARTITION BY aggregate_type, aggregate_id ORDER BY sequence) \
             ) \
             SELECT id, aggregate_type, aggregate_id, sequence, message_type, payload, headers, attempts \
             FROM candidates WHERE NOT held AND rn <= $3 \
             ORDER BY rn, aggregate_type, aggregate_id LIMIT $4"
        );
        let rows = sqlx::query(&sql)
            .bind(i32::from(self.options.partitions))
            .bind(&self.owned)
            .bind(i64::try_from(self.options.per_aggregate).unwrap_or(i64::MAX))
            .bind(i64::try_from(self.options.batch).unwrap_or(i64::MAX))
            .fetch_all(&self.pool)
            .await?;
        // Rows come heads first (every aggregate's first row, then every
        // second row…), so a round spreads over as many aggregates as it
        // can; within an aggregate they are in sequence order.
        let mut by_aggregate: BTreeMap<(String, String), Vec<Row_>> = BTreeMap::new();
        for r in rows {
            let row = Row_ {
                id: r.try_get("id")?,
                aggregate_type: r.try_get("aggregate_type")?,
                aggregate_id: r.try_get("aggregate_id")?,
                sequence: r.try_get("sequence")?,
                message_type: r.try_get("message_type")?,
                payload: r.try_get("payload")?,
                headers: r.try_get("headers")?,
                attempts: r.try_get("attempts")?,
            };
            by_aggregate
                .entry((row.aggregate_type.clone(), row.aggregate_id.clone()))
                .or_default()
                .push(row);
        }
        if by_aggregate.is_empty() {
            return Ok(0);
        }
        let limit = Arc::new(tokio::sync::Semaphore::new(self.options.concurrency.max(1)));
        let mut tasks = JoinSet::new();
        for (_, rows) in by_aggregate {
            let (publisher, prefix, limit) = (
                Arc::clone(&self.publisher),
                self.options.prefix.clone(),
                Arc::clone(&limit),
            );
            tasks.spawn(async move {
                let _permit = limit.acquire_owned().await;
                let mut published = Vec::new();
                for row in rows {
                    match publisher.publish(&outgoing(&prefix, &row)).await {
                        Ok(p) => published.push((row.id, p.duplicate)),
                        // Stop this aggregate at its first failure: the
                        // rows after it must wait for it.
                        Err(err) => return (published, Some((row, err))),
                    }
                }
                (published, None)
            });
        }
        let mut done = Vec::new();
        let mut broker_down = None;
        while let Some(joined) = tasks.join_next().await {
            let Ok((published, failure)) = joined else {
                continue;
            };
            self.stats.duplicates += published.iter().filter(|(_, dup)| *dup).count() as u64;
            done.extend(published.into_iter().map(|(id, _)| id));
            match failure {
                // An unreachable broker is nobody's fault: no attempt is
                // counted, the row stays pending as it was.
                Some((_, err)) if err.broker_down => broker_down = Some(err.message),
                Some((row, err)) => self.record_failure(&row, &err.message).await?,
                None => {}
            }
        }
        if !done.is_empty() {
            sqlx::query(
                "UPDATE idem_outbox SET state = 'published', published_at = clock_timestamp(), \
                 attempts = attempts + 1, last_error = NULL \
                 WHERE id = ANY($1) AND state = 'pending'",
            )
            .bind(&done)
            .execute(&self.pool)
            .await?;
            self.stats.published += done.len() as u64;
            metrics::counter!("idem_outbox_published_total").increment(done.len() as u64);
        }
        if let Some(why) = broker_down {
            self.ready.store(false, Ordering::Relaxed);
            if !self.outage_logged {
                self.outage_logged = true;
                tracing::warn!(reason = "relay_broker_down", err = %why, "broker unreachable; rows stay pending until it is back");
            }
            return Ok(0);
        }
        if self.outage_logged && !done.is_empty() {
            self.outage_logged = false;
            tracing::info!(
                reason = "relay_broker_back",
                "broker reachable again; publishing"
            );
        }
        Ok(done.len())
    }

    async fn record_failure(&mut self, row: &Row_, err: &str) -> Result<(), sqlx::Error> {
        self.stats.failures += 1;
        let attempt = row.attempts + 1;
        let dead = attempt >= self.options.max_attempts;
        let delay = crate::backoff(
            self.options.backoff,
            self.options.max_backoff,
            attempt.unsigned_abs(),
        );
        sqlx::query(
            "UPDATE idem_outbox SET attempts = attempts + 1, last_error = $2, \
             available_at = clock_timestamp() + $3::bigint * interval '1 millisecond', \
             state = CASE WHEN $4 THEN 'dead' ELSE state END \
             WHERE id = $1 AND state = 'pending'",
        )
        .bind(row.id)
        .bind(err)
        .bind(i64::try_from(delay.as_millis()).unwrap_or(i64::MAX))
        .bind(dead)
        .execute(&self.pool)
        .await?;
        if dead {
            self.stats.dead += 1;
            metrics::counter!("idem_outbox_dead_total").increment(1);
            tracing::error!(reason = "relay_row_dead", id = row.id, aggregate_type = %row.aggregate_type, aggregate_id = %row.aggregate_id, sequence = row.sequence, attempts = attempt, %err, "outbox row is dead after its last attempt");
        } else {
            tracing::warn!(reason = "relay_publish_failed", id = row.id, aggregate_type = %row.aggregate_type, aggregate_id = %row.aggregate_id, attempt, retry_in_ms = delay.as_millis() as u64, %err);
        }
        Ok(())
    }

    /// Sets `idem_outbox_pending` (rows waiting) and
    /// `idem_outbox_lag_seconds` (age of the oldest one).
    async fn export_backlog(&self) -> Result<(), sqlx::Error> {
        let row = sqlx::query(
            "SELECT count(*) AS pending, \
             COALESCE(EXTRACT(EPOCH FROM clock_timestamp() - min(created_at)), 0)::float8 AS lag \
             FROM idem_outbox WHERE state = 'pending'",
        )
        .fetch_one(&self.pool)
        .await?;
        let pending: i64 = row.try_get("pending")?;
        let lag: f64 = row.try_get("lag")?;
        metrics::gauge!("idem_outbox_pending").set(pending as f64);
        metrics::gauge!("idem_outbox_lag_seconds").set(lag);
        Ok(())
    }

    async fn delete_published(&self) -> Result<u64, sqlx::Error> {
        let done = sqlx::query(
            "DELETE FROM idem_outbox WHERE id IN (SELECT id FROM idem_outbox \
             WHERE state = 'published' AND published_at < clock_timestamp() - $1::bigint * interval '1 millisecond' \
             LIMIT 1000)",
        )
        .bind(i64::try_from(self.options.retention.as_millis()).unwrap_or(i64::MAX))
        .execute(&self.pool)
        .await?;
        Ok(done.rows_affected())
    }
}

/// Whether `stop` has completed (without waiting).
async fn futures_ready(
    stop: &mut std::pin::Pin<&mut impl std::future::Future<Output = ()>>,
) -> bool {
    tokio::select! {
        biased;
        () = stop.as_mut() => true,
        () = std::future::ready(()) => false,
    }
}

fn outgoing(prefix: &str, row: &Row_) -> Outgoing {
    let mut list: Vec<(String, String)> =
        serde_json::from_str::<BTreeMap<String, String>>(&row.headers)
            .unwrap_or_default()
            .into_iter()
            .collect();
    list.push((
        headers::AGGREGATE_TYPE.to_owned(),
        row.aggregate_type.clone(),
    ));
    list.push((headers::AGGREGATE_ID.to_owned(), row.aggregate_id.clone()));
    list.push((headers::SEQUENCE.to_owned(), row.sequence.to_string()));
    Outgoing {
        subject: format!("{prefix}.{}.{}", row.aggregate_type, row.message_type),
        id: row.id.to_string(),
        payload: Bytes::from(row.payload.clone()),
        headers: list,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_grows_is_capped_and_jittered() {
        let base = Duration::from_millis(100);
        let max = Duration::from_secs(5);
        for attempt in 1..30 {
            let d = crate::backoff(base, max, attempt);
            assert!(d <= max, "{attempt}: {d:?}");
            assert!(
                d >= base.saturating_mul(1 << attempt.min(20)).min(max) / 2,
                "{attempt}: {d:?}"
            );
        }
    }

    #[test]
    fn lock_classes_differ_per_namespace_and_are_stable() {
        assert_eq!(lock_class("public"), lock_class("public"));
        assert_ne!(lock_class("public"), lock_class("billing"));
    }

    #[test]
    fn subjects_and_headers() {
        let row = Row_ {
            id: 42,
            aggregate_type: "payment".into(),
            aggregate_id: "pay_1".into(),
            sequence: 3,
            message_type: "PaymentAuthorized".into(),
            payload: "{}".into(),
            headers: r#"{"trace-id":"t"}"#.into(),
            attempts: 0,
        };
        let out = outgoing("idem", &row);
        assert_eq!(out.subject, "idem.payment.PaymentAuthorized");
        assert_eq!(out.id, "42");
        assert!(out.headers.contains(&("Idem-Sequence".into(), "3".into())));
        assert!(out.headers.contains(&("trace-id".into(), "t".into())));
    }
}
