//! The outbox relay: publishes pending outbox rows, in order per
//! aggregate, with several relays running at once.
//!
//! ## Why it cannot reorder or skip an aggregate's events
//!
//! * **One relay per aggregate at a time.** Aggregates are hashed into
//!   `partitions`; a relay publishes only the partitions it holds a
//!   PostgreSQL session advisory lock on. A relay that dies (even by
//!   SIGKILL) loses its session and so its locks; another takes the
//!   partitions over at its next rebalance (the locks are
//!   `idem_postgres::outbox::PartitionLocks`). Plain row locks skipped by
//!   other relays (`SKIP LOCKED`) would let two relays publish one
//!   aggregate's consecutive rows at the same time, and the broker could
//!   receive them in either order.
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
//!   publishes it again with the same id (the random event id the row
//!   got at enqueue; `<source>:<row id>` for rows older than event ids,
//!   see [`RelayOptions::source`]), which the broker's de-duplication
//!   window drops. A restored or recreated database reuses row numbers,
//!   never event ids. The relay checks at start that
//!   the window is longer than its worst re-publish delay and warns loudly
//!   if not.
//!
//! Rows that fail `max_attempts` times become `dead`: counted, logged, and
//! (by default) holding back the rest of their aggregate until an operator
//! replays or discards them.
//!
//! ## What a round costs
//!
//! A round reads what it will publish, not the backlog: it walks the
//! aggregates that have pending rows on the pending-rows index (one probe
//! per aggregate, at most `batch` of them, resuming where the last walk
//! stopped so no aggregate starves) and reads each one's first rows by
//! index. Rounds overlap: while a round publishes, the next one is read
//! (starting after the rows in flight; an aggregate that fails in the
//! current round is dropped from it), and acknowledged rows are marked
//! published by a background task, one statement for whatever piled up.
//! Until marked, an aggregate's acknowledged rows count as gone for reads.
//!
//! The relay holds no SQL: reading a round (`Outbox::claim_heads`),
//! marking rows published or failed, retention, the backlog gauges,
//! wake-up registrations and partition locks are `idem_postgres::outbox`'s
//! typed operations; this module schedules them and publishes.
//!
//! ## Traces
//!
//! A row that carries a W3C trace context (see `idem_postgres::outbox`) is
//! published inside an `idem.publish` span of [`crate::trace::TARGET`],
//! child of the row's context. With the `otel` feature and an
//! OpenTelemetry layer, the message's `traceparent` is that span's own
//! context, so the consumer's span becomes the publish's child; otherwise
//! the row's `traceparent` goes out unchanged. Rows without one are
//! published without a span. Every broker gets it the same way, in
//! [`Outgoing::headers`](crate::Outgoing::headers).
//!
//! ## Waking up
//!
//! An idle relay `LISTEN`s on [`NOTIFY_CHANNEL`] after registering in
//! `idem_outbox_listeners`; a statement-level trigger on the outbox sends
//! one notification per inserting statement, and only while a registration
//! is live. Busy relays hold no registration, so under load business
//! commits never take PostgreSQL's notification lock (a `NOTIFY` per row or
//! per commit would serialise them there). A row whose inserting statement
//! ran just before the registration and committed after the relay's last
//! read sends nothing; the fallback poll (`notify_fallback`, 1 s) finds it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idem_postgres::MessagingError;
use idem_postgres::outbox::{AggregateKey, HeadsQuery, Outbox, PartitionLocks, PendingRow};
use idem_postgres::sqlx::postgres::PgConnectOptions;
use idem_postgres::sqlx::{ConnectOptions, Connection, PgConnection, PgPool};
use tokio::task::JoinSet;

use crate::publisher::Publisher;

mod marker;
mod options;
mod publish;
mod readiness;
mod wake;

use marker::Marker;
pub use options::{OnDead, RelayError, RelayOptions, RelayStats};
use publish::{outgoing, publish};
pub use readiness::{NotReady, Readiness};
use wake::Wake;

/// The `application_name` prefix of a relay's lock session (relays of one
/// outbox count each other by it to share the partitions).
pub const RELAY_APPLICATION: &str = "idem-relay";

/// One round: per aggregate, its rows in sequence order.
type Batch = Vec<Vec<PendingRow>>;

/// The channel inserting statements notify while a relay waits.
pub use idem_postgres::outbox::NOTIFY_CHANNEL;

/// The relay; see the [module docs](self).
#[derive(Debug)]
pub struct Relay<P> {
    pool: PgPool,
    lock_options: PgConnectOptions,
    locks: PartitionLocks,
    application: String,
    publisher: Arc<P>,
    options: RelayOptions,
    lock: Option<PgConnection>,
    owned: Vec<i32>,
    stats: RelayStats,
    ready: Arc<Readiness>,
    /// Whether the current broker outage was logged (once per outage).
    outage_logged: bool,
    /// The aggregate the last read's walk stopped at.
    cursor: Mutex<Option<(String, String)>>,
    /// The message-id prefix (see [`RelayOptions::source`]).
    source: String,
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
        let publisher = Arc::new(publisher);
        let link = Arc::clone(&publisher);
        let source = options
            .source
            .clone()
            .unwrap_or_else(|| namespace.to_owned());
        Self {
            pool,
            lock_options: lock_options.application_name(&application),
            locks: PartitionLocks::new(namespace),
            application,
            publisher,
            options,
            lock: None,
            owned: Vec::new(),
            stats: RelayStats::default(),
            ready: Arc::new(Readiness::new(move || link.is_connected())),
            outage_logged: false,
            cursor: Mutex::new(None),
            source,
        }
    }

    /// Whether the last round reached both the database and the broker,
    /// and if not, which of them failed.
    pub fn readiness(&self) -> Arc<Readiness> {
        Arc::clone(&self.ready)
    }

    /// The database just answered: ready while the broker's client is
    /// connected ([`Readiness::check`] reads the link when asked).
    fn database_answered(&self) {
        self.ready.set(None);
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
    ///
    /// Rounds overlap: while one round's rows are being published, the
    /// next round is read (without the rows in flight, and without the
    /// aggregates of the round that failed), and acknowledged rows are
    /// marked published by a background task. Partitions are re-balanced
    /// only between rounds, with nothing in flight.
    pub async fn run(mut self, stop: impl std::future::Future<Output = ()>) -> RelayStats {
        let mut stop = std::pin::pin!(stop);
        let marker = Marker::start(self.pool.clone());
        let mut wake = Wake::new(&self.pool, &self.options).await;
        let mut last_rebalance: Option<Instant> = None;
        let mut last_cleanup = Instant::now();
        let mut last_gauges: Option<Instant> = None;
        let mut prefetched: Option<Batch> = None;
        loop {
            if last_gauges.is_none_or(|t| t.elapsed() >= Duration::from_secs(5)) {
                last_gauges = Some(Instant::now());
                if let Err(err) = self.export_backlog().await {
                    tracing::debug!(%err, "cannot read the outbox backlog");
                }
            }
            if last_rebalance.is_none_or(|t| t.elapsed() >= self.options.rebalance) {
                let before = self.owned.clone();
                if let Err(err) = self.rebalance().await {
                    self.ready.set(Some(NotReady::Database(err.to_string())));
                    tracing::warn!(reason = "relay_rebalance_failed", %err, "cannot hold partitions; retrying");
                    self.drop_lock_session().await;
                }
                if self.owned != before {
                    // Read ahead for partitions that may not be ours now.
                    prefetched = None;
                }
                last_rebalance = Some(Instant::now());
            }
            let batch = match prefetched.take() {
                Some(batch) => Ok(batch),
                None => self.read(&marker.through()).await,
            };
            let worked = match batch {
                Ok(batch) if batch.is_empty() => {
                    // An empty read without a lock session asked nothing
                    // of the database (it holds no partitions): no news.
                    if self.lock.is_some() {
                        self.database_answered();
                    }
                    false
                }
                Ok(batch) => match self.publish_round(batch, &marker).await {
                    Ok((n, next)) => {
                        prefetched = next;
                        n > 0
                    }
                    Err(err) => {
                        self.ready.set(Some(NotReady::Database(err.to_string())));
                        tracing::warn!(reason = "relay_round_failed", %err, "retrying");
                        false
                    }
                },
                Err(err) => {
                    self.ready.set(Some(NotReady::Database(err.to_string())));
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
            if worked {
                wake.busy(&self.pool).await;
                if futures_ready(&mut stop).await {
                    break;
                }
            } else if wake.idle(&self.pool, &mut stop).await {
                break;
            }
        }
        wake.busy(&self.pool).await;
        marker.finish().await;
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
    async fn rebalance(&mut self) -> Result<(), MessagingError> {
        if self.lock.is_none() {
            self.lock = Some(self.lock_options.connect().await?);
            self.owned.clear();
        }
        let Some(conn) = self.lock.as_mut() else {
            return Ok(());
        };
        let relays = PartitionLocks::live_relays(&mut *conn, &self.application).await?;
        let partitions = i32::from(self.options.partitions);
        let share = usize::try_from((i64::from(partitions) + relays.max(1) - 1) / relays.max(1))
            .unwrap_or(usize::MAX);
        while self.owned.len() > share {
            if let Some(p) = self.owned.pop() {
                self.locks.unlock(conn, p).await?;
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
            if self.locks.try_lock(conn, p).await? {
                self.owned.push(p);
            }
        }
        self.owned.sort_unstable();
        Ok(())
    }

    /// Reads the next round: per aggregate of the held partitions, its
    /// pending rows from the head on (after the sequence given in `after`
    /// for aggregates with rows acknowledged or in flight), cut before the
    /// first row that is
    /// not due yet; at most `batch` rows, heads of every aggregate first.
    ///
    /// The read costs what it returns, not the backlog: the aggregates with
    /// pending rows are walked on the pending index (one probe each, at
    /// most `batch` aggregates, continuing from the last round's position
    /// so none starves), and each one's first rows are read by index.
    async fn read(&self, after: &HashMap<AggregateKey, i64>) -> Result<Batch, MessagingError> {
        if self.owned.is_empty() {
            return Ok(Vec::new());
        }
        let cursor = self
            .cursor
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let heads = Outbox::claim_heads(
            &self.pool,
            &HeadsQuery {
                partitions: self.options.partitions,
                owned: &self.owned,
                per_aggregate: self.options.per_aggregate,
                max_aggregates: self.options.batch,
                after,
                resume_after: cursor.as_ref(),
                skip_dead: self.options.on_dead == OnDead::Block,
            },
        )
        .await?;
        // The next read walks on from where this one stopped.
        *self.cursor.lock().unwrap_or_else(|p| p.into_inner()) = heads.resume_after;
        Ok(heads.aggregates)
    }

    /// Publishes `batch` (one task per aggregate, each row after the
    /// previous one's acknowledgement, stopping the aggregate at its first
    /// failure) and, when the batch suggests more is waiting, reads the
    /// next round meanwhile. Returns the rows acknowledged and the next
    /// round, if read.
    async fn publish_round(
        &mut self,
        batch: Batch,
        marker: &Marker,
    ) -> Result<(usize, Option<Batch>), MessagingError> {
        let rows: usize = batch.iter().map(Vec::len).sum();
        let more = rows >= self.options.batch
            || batch.iter().any(|r| r.len() >= self.options.per_aggregate);
        // The next read starts after this round's rows.
        let mut after = marker.through();
        for rows in &batch {
            if let Some(last) = rows.last() {
                after.insert(
                    (last.aggregate_type.clone(), last.aggregate_id.clone()),
                    last.sequence,
                );
            }
        }
        let limit = Arc::new(tokio::sync::Semaphore::new(self.options.concurrency.max(1)));
        let mut tasks = JoinSet::new();
        for rows in batch {
            let (publisher, prefix, source, limit) = (
                Arc::clone(&self.publisher),
                self.options.prefix.clone(),
                self.source.clone(),
                Arc::clone(&limit),
            );
            let key: AggregateKey = rows
                .first()
                .map(|r| (r.aggregate_type.clone(), r.aggregate_id.clone()))
                .unwrap_or_default();
            tasks.spawn(async move {
                let mut published = Vec::new();
                for row in rows {
                    // A slot per publish, not per aggregate: every
                    // aggregate of the round moves, `concurrency`
                    // publishes in flight at most.
                    let _slot = limit.acquire().await;
                    match publish(&*publisher, outgoing(&prefix, &source, &row), &row).await {
                        Ok(p) => published.push((row.id, row.sequence, p.duplicate)),
                        // Stop this aggregate at its first failure: the
                        // rows after it must wait for it.
                        Err(err) => return (key, published, Some((row, err))),
                    }
                }
                (key, published, None)
            });
        }
        let publishing = async {
            let mut results = Vec::new();
            while let Some(joined) = tasks.join_next().await {
                if let Ok(result) = joined {
                    results.push(result);
                }
            }
            results
        };
        let (results, next) = if more {
            let (results, next) = tokio::join!(publishing, self.read(&after));
            (results, next.ok())
        } else {
            (publishing.await, None)
        };
        let mut done = Vec::new();
        let mut failed: Vec<(String, String)> = Vec::new();
        let mut broker_down = None;
        for (key, published, failure) in results {
            self.stats.duplicates += published.iter().filter(|(_, _, dup)| *dup).count() as u64;
            done.extend(
                published
                    .into_iter()
                    .map(|(id, sequence, _)| (id, key.clone(), sequence)),
            );
            if let Some((row, err)) = failure {
                failed.push((row.aggregate_type.clone(), row.aggregate_id.clone()));
                if err.is_broker_down() {
                    // An unreachable broker is nobody's fault: no attempt
                    // is counted, the row stays pending as it was.
                    broker_down = Some(err.to_string());
                } else {
                    self.record_failure(&row, &err.to_string()).await?;
                }
            }
        }
        let published = done.len();
        if !done.is_empty() {
            self.stats.published += done.len() as u64;
            metrics::counter!(idem::metrics::OUTBOX_PUBLISHED_TOTAL.name)
                .increment(done.len() as u64);
            marker.mark(done);
        }
        if let Some(why) = broker_down {
            self.ready.set(Some(NotReady::Broker(why.clone())));
            if !self.outage_logged {
                self.outage_logged = true;
                tracing::warn!(reason = "relay_broker_down", err = %why, "broker unreachable; rows stay pending until it is back");
            }
            return Ok((0, None));
        }
        self.database_answered();
        if self.outage_logged && published > 0 {
            self.outage_logged = false;
            tracing::info!(
                reason = "relay_broker_back",
                "broker reachable again; publishing"
            );
        }
        // The next round was read before this one's failures: an aggregate
        // that stopped at a failure must not go on past it.
        let next = next.map(|mut next| {
            next.retain(|rows| {
                rows.first().is_none_or(|r| {
                    !failed
                        .iter()
                        .any(|(t, a)| *t == r.aggregate_type && *a == r.aggregate_id)
                })
            });
            next
        });
        Ok((published, next.filter(|n| !n.is_empty())))
    }

    async fn record_failure(&mut self, row: &PendingRow, err: &str) -> Result<(), MessagingError> {
        self.stats.failures += 1;
        let attempt = row.attempts + 1;
        let dead = attempt >= self.options.max_attempts;
        let delay = crate::backoff(
            self.options.backoff,
            self.options.max_backoff,
            attempt.unsigned_abs(),
        );
        Outbox::record_failure(&self.pool, row.id, err, delay, dead).await?;
        if dead {
            self.stats.dead += 1;
            metrics::counter!(idem::metrics::OUTBOX_DEAD_TOTAL.name).increment(1);
            tracing::error!(reason = "relay_row_dead", id = row.id, aggregate_type = %row.aggregate_type, aggregate_id = %row.aggregate_id, sequence = row.sequence, attempts = attempt, %err, "outbox row is dead after its last attempt");
        } else {
            tracing::warn!(reason = "relay_publish_failed", id = row.id, aggregate_type = %row.aggregate_type, aggregate_id = %row.aggregate_id, attempt, retry_in_ms = delay.as_millis() as u64, %err);
        }
        Ok(())
    }

    /// Sets `idem_outbox_pending` (rows waiting) and
    /// `idem_outbox_lag_seconds` (age of the oldest one).
    async fn export_backlog(&self) -> Result<(), MessagingError> {
        let backlog = Outbox::pending_stats(&self.pool).await?;
        metrics::gauge!(idem::metrics::OUTBOX_PENDING.name).set(backlog.pending as f64);
        metrics::gauge!(idem::metrics::OUTBOX_LAG.name).set(backlog.lag.as_secs_f64());
        Ok(())
    }

    /// Deletes a batch of rows published longer than `retention` ago.
    async fn delete_published(&self) -> Result<u64, MessagingError> {
        Outbox::purge_published_older_than(&self.pool, self.options.retention, RETENTION_BATCH)
            .await
    }
}

/// Published rows deleted per retention pass (one pass a minute).
const RETENTION_BATCH: usize = 1000;

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
}
