//! What the relay asks of the outbox: heads claimed per aggregate,
//! rows marked published or failed, published rows purged, listeners.

use super::*;

/// An aggregate: its type and id.
pub type AggregateKey = (String, String);

/// A pending row as a relay publishes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PendingRow {
    /// Row id.
    pub id: i64,
    /// The random event id given at enqueue: the broker's de-duplication
    /// id (`None` for rows written before schema version 5).
    pub event_id: Option<String>,
    /// Aggregate type.
    pub aggregate_type: String,
    /// Aggregate id.
    pub aggregate_id: String,
    /// Number in the aggregate's sequence.
    pub sequence: i64,
    /// Event type.
    pub message_type: String,
    /// The JSON payload, as text.
    pub payload: String,
    /// The headers given at enqueue, as a JSON object of strings.
    pub headers: String,
    /// Failed publish attempts so far.
    pub attempts: i32,
}

/// What [`Outbox::claim_heads`] reads.
#[derive(Debug, Clone, Copy)]
pub struct HeadsQuery<'a> {
    /// The partitions aggregates are hashed into (every relay of one
    /// outbox uses the same number).
    pub partitions: u16,
    /// The partitions the caller holds (see [`PartitionLocks`]): only
    /// their aggregates' rows are read.
    pub owned: &'a [i32],
    /// Most rows per aggregate.
    pub per_aggregate: usize,
    /// Most aggregates walked, and most rows read.
    pub max_aggregates: usize,
    /// Per aggregate, the sequence to read after: its rows acknowledged
    /// and not yet marked, or still in flight, count as gone.
    pub after: &'a HashMap<AggregateKey, i64>,
    /// Where the walk starts: after this aggregate (the last read's
    /// [`Heads::resume_after`]), or from the first one.
    pub resume_after: Option<&'a AggregateKey>,
    /// Leave out aggregates that have a `dead` row (the relay's "block"
    /// rule: a dead row holds back the rest of its aggregate).
    pub skip_dead: bool,
}

/// What [`Outbox::claim_heads`] found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Heads {
    /// Per aggregate (in walk order), its due rows in sequence order;
    /// aggregates with none are left out.
    pub aggregates: Vec<Vec<PendingRow>>,
    /// Where the next read's walk starts: the last aggregate walked when
    /// the walk stopped at `max_aggregates`, `None` when it reached the
    /// end (the next read starts from the beginning).
    pub resume_after: Option<AggregateKey>,
}

/// The backlog, as [`Outbox::pending_stats`] reads it.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PendingStats {
    /// Rows waiting to be published (dead rows not included).
    pub pending: i64,
    /// Age of the oldest of them (zero when there are none).
    pub lag: Duration,
}

/// Milliseconds as the queries bind them (saturating).
pub(super) fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// The relay's side of the table: reading what to publish, marking it
/// published or failed, retention, wake-ups and the backlog. The relay
/// itself (scheduling, publishing, ordering) is `idem_messaging::Relay`.
impl Outbox {
    /// Reads a relay's next round: per aggregate of the held partitions,
    /// its pending rows from the head on (after the sequence in
    /// [`HeadsQuery::after`]), cut before the first row that is not due
    /// yet (backing off after a failure: the rows after it wait for it);
    /// heads of every aggregate first, at most
    /// [`HeadsQuery::max_aggregates`] rows.
    ///
    /// Nothing is locked: the rows are the caller's because it holds their
    /// partitions. The read costs what it returns, not the backlog: the
    /// aggregates with pending rows are walked on the pending-rows index,
    /// one probe each, resuming where the last walk stopped so that no
    /// aggregate starves.
    pub async fn claim_heads<'e>(
        executor: impl Executor<'e, Database = Postgres>,
        query: &HeadsQuery<'_>,
    ) -> Result<Heads, MessagingError> {
        let max_aggregates = i64::try_from(query.max_aggregates).unwrap_or(i64::MAX);
        let rows = sqlx::query(CLAIM_HEADS)
            .bind(i32::from(query.partitions))
            .bind(query.owned)
            .bind(i64::try_from(query.per_aggregate).unwrap_or(i64::MAX))
            .bind(max_aggregates)
            .bind(
                query
                    .after
                    .keys()
                    .map(|(t, _)| t.as_str())
                    .collect::<Vec<_>>(),
            )
            .bind(
                query
                    .after
                    .keys()
                    .map(|(_, a)| a.as_str())
                    .collect::<Vec<_>>(),
            )
            .bind(query.after.values().copied().collect::<Vec<_>>())
            // Aggregate types are never empty: ("", "") is before them all.
            .bind(query.resume_after.map_or("", |(t, _)| t.as_str()))
            .bind(query.resume_after.map_or("", |(_, a)| a.as_str()))
            .bind(query.skip_dead)
            .fetch_all(executor)
            .await?;
        // Rows come heads first (every aggregate's first row, then every
        // second row…) up to the limit, so a round spreads over as many
        // aggregates as it can; an aggregate's rows come in sequence order.
        // Per aggregate walked (by walk position): its rows, and whether it
        // stopped at a row not due yet.
        let mut walked: BTreeMap<i32, (Vec<PendingRow>, bool)> = BTreeMap::new();
        let mut last: Option<(i32, String, String)> = None;
        for r in rows {
            let n: i32 = r.try_get("n")?;
            let entry = walked.entry(n).or_default();
            if last.as_ref().is_none_or(|(m, _, _)| *m < n) {
                last = Some((n, r.try_get("aggregate_type")?, r.try_get("aggregate_id")?));
            }
            // No row: not ours, blocked by a dead row, or all in flight.
            let Some(id) = r.try_get::<Option<i64>, _>("id")? else {
                continue;
            };
            let (rows, stopped) = entry;
            if *stopped || r.try_get::<bool, _>("later")? {
                *stopped = true;
                continue;
            }
            rows.push(PendingRow {
                id,
                event_id: r.try_get("event_id")?,
                aggregate_type: r.try_get("aggregate_type")?,
                aggregate_id: r.try_get("aggregate_id")?,
                sequence: r.try_get("sequence")?,
                message_type: r.try_get("message_type")?,
                payload: r.try_get("payload")?,
                headers: r.try_get("headers")?,
                attempts: r.try_get("attempts")?,
            });
        }
        // Where the next read starts: after the last aggregate walked, or
        // from the beginning when the walk reached the end. (Every walked
        // aggregate has its first row, or its empty one, among the heads,
        // and there are at most `max_aggregates` of them.)
        let resume_after = last
            .filter(|(n, _, _)| i64::from(*n) >= max_aggregates)
            .map(|(_, t, a)| (t, a));
        let aggregates = walked
            .into_values()
            .map(|(rows, _)| rows)
            .filter(|rows| !rows.is_empty())
            .collect();
        Ok(Heads {
            aggregates,
            resume_after,
        })
    }

    /// Marks rows the broker acknowledged as published (their attempt
    /// counts, their last error is cleared). Rows no longer pending are
    /// left alone. Returns the rows marked.
    pub async fn mark_published<'e>(
        executor: impl Executor<'e, Database = Postgres>,
        ids: &[i64],
    ) -> Result<u64, MessagingError> {
        Ok(sqlx::query(MARK_PUBLISHED)
            .bind(ids)
            .execute(executor)
            .await?
            .rows_affected())
    }

    /// Counts a failed publish of row `id`: `error` becomes its
    /// `last_error`, and it is retried `retry_in` from now, or becomes
    /// `dead` (when `dead`: its last attempt). Returns whether the row was
    /// still pending (otherwise nothing changed).
    pub async fn record_failure<'e>(
        executor: impl Executor<'e, Database = Postgres>,
        id: i64,
        error: &str,
        retry_in: Duration,
        dead: bool,
    ) -> Result<bool, MessagingError> {
        Ok(sqlx::query(RECORD_FAILURE)
            .bind(id)
            .bind(error)
            .bind(millis(retry_in))
            .bind(dead)
            .execute(executor)
            .await?
            .rows_affected()
            == 1)
    }

    /// Deletes at most `batch` rows published more than `retention` ago
    /// (one short statement; call it in a loop until it returns less than
    /// `batch`). Pending and dead rows are never deleted.
    pub async fn purge_published_older_than<'e>(
        executor: impl Executor<'e, Database = Postgres>,
        retention: Duration,
        batch: usize,
    ) -> Result<u64, MessagingError> {
        Ok(sqlx::query(PURGE_PUBLISHED)
            .bind(millis(retention))
            .bind(i64::try_from(batch).unwrap_or(i64::MAX))
            .execute(executor)
            .await?
            .rows_affected())
    }

    /// The backlog: how many rows are pending, and how old the oldest one
    /// is (the relay exports them as `idem_outbox_pending` and
    /// `idem_outbox_lag_seconds`).
    pub async fn pending_stats<'e>(
        executor: impl Executor<'e, Database = Postgres>,
    ) -> Result<PendingStats, MessagingError> {
        let row = sqlx::query(PENDING_STATS).fetch_one(executor).await?;
        let lag: f64 = row.try_get("lag")?;
        Ok(PendingStats {
            pending: row.try_get("pending")?,
            lag: Duration::try_from_secs_f64(lag).unwrap_or_default(),
        })
    }

    /// A connection `LISTEN`ing on [`NOTIFY_CHANNEL`], where inserting
    /// statements notify while some relay is registered (see
    /// [`register_listener`](Self::register_listener)).
    pub async fn listener(pool: &PgPool) -> Result<PgListener, MessagingError> {
        let mut listener = PgListener::connect_with(pool).await?;
        listener.listen(NOTIFY_CHANNEL).await?;
        Ok(listener)
    }

    /// Registers the idle relay `relay` for `ttl`: until then, every
    /// statement inserting outbox rows sends one notification on
    /// [`NOTIFY_CHANNEL`] at commit (migration 4's trigger). Registering
    /// again moves the deadline. Busy relays stay unregistered, so under
    /// load commits never take PostgreSQL's notification lock.
    pub async fn register_listener<'e>(
        executor: impl Executor<'e, Database = Postgres>,
        relay: &str,
        ttl: Duration,
    ) -> Result<(), MessagingError> {
        sqlx::query(REGISTER_LISTENER)
            .bind(relay)
            .bind(millis(ttl))
            .execute(executor)
            .await?;
        Ok(())
    }

    /// Withdraws `relay`'s registration (it has work again).
    pub async fn unregister_listener<'e>(
        executor: impl Executor<'e, Database = Postgres>,
        relay: &str,
    ) -> Result<(), MessagingError> {
        sqlx::query(UNREGISTER_LISTENER)
            .bind(relay)
            .execute(executor)
            .await?;
        Ok(())
    }
}
