//! When the group-commit statements keep their plans, and when the
//! records table is analyzed: the plan heuristics of a table that grows.

use super::*;

/// Whether the group-commit statements keep their plan or are planned
/// each time they run, and when the records table is analyzed for every
/// statement's sake.
///
/// PostgreSQL keeps one generic plan for a prepared statement after its
/// fifth run, and plans it again only when the table's statistics change
/// (autovacuum's `ANALYZE`). A plan made while the table is empty joins the
/// batch's keys to the table by reading all of it (a hash join over a
/// sequential scan). With autovacuum off nothing replaces that plan, and
/// every batch reads every record: at 30,000 records the gateway at 64
/// connections falls from about 5,000 req/s to 700–900
/// (docs/BENCHMARKS.md#current-figures). Planned each time, a batch looks its
/// keys up in the primary key, but parsing and planning each batch costs a
/// quarter of the rate on a grown table (docs/BENCHMARKS.md#current-figures).
///
/// So plans are kept where autovacuum runs. Where it does not, they are
/// made each time while the table is small, and kept once it has
/// [`KEEP_PLANS_FROM_PAGES`]: from some fifty pages on, PostgreSQL's
/// generic plans look every key up in the primary key. The size is read
/// again every [`LOOK_AT_SIZE_EVERY`] on a connection about to run a record
/// operation. Each time the table is found grown past the bound again
/// (after a `TRUNCATE`, say), the statements get a new text, so PostgreSQL
/// prepares and plans them anew instead of keeping a plan made on the
/// small table.
///
/// The single-key statements are prepared from the first operation on,
/// and on an empty table their generic plans find a key through
/// `idem_records_tenant_created` (tenant, created_at, …): a walk over all of
/// the tenant's records, which grows with them (45–80 ms per resolution at
/// 300,000 records of one tenant: docs/BENCHMARKS.md#current-figures).
/// So at each crossing of the bound it saw (small at one look, large at a
/// later one) the store also analyzes the table: the new statistics make
/// PostgreSQL plan every statement on every connection again, by the
/// primary key. A store started on a large table prepares its statements
/// there and analyzes nothing. Where the store's role may not analyze the
/// table, it says so once.
#[derive(Debug)]
pub(crate) struct Plans {
    /// Autovacuum runs: PostgreSQL plans again as the statistics change.
    /// Unset until the server is asked (a store made from the caller's
    /// pool asks at its first look).
    autovacuum: std::sync::OnceLock<bool>,
    sized: std::sync::Mutex<SizedPlans>,
    /// Grouped statements run without a kept plan.
    planned: std::sync::atomic::AtomicU64,
    /// Told the operator that the table could not be analyzed.
    warned: std::sync::atomic::AtomicBool,
}

/// Pages of the records table from which grouped statements keep their
/// plans on a server without autovacuum (2 MiB).
pub(crate) const KEEP_PLANS_FROM_PAGES: i64 = 256;

/// How often the records table's size is read while autovacuum is off.
/// A second: a store started on an empty table keeps its plans within a
/// second of the table's reaching the bound, for one small query a second.
pub(crate) const LOOK_AT_SIZE_EVERY: Duration = Duration::from_secs(1);

/// What the last look at the table's size decided.
#[derive(Debug)]
pub(crate) struct SizedPlans {
    looked: Option<std::time::Instant>,
    large: bool,
    /// A look found the table small: statements may have been prepared
    /// on it since.
    seen_small: bool,
    /// The statements' texts for the current run of kept plans.
    reserve: Arc<str>,
    resolve: Arc<str>,
    runs: u64,
}

/// Which grouped statement.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Grouped {
    Reserve,
    Resolve,
}

impl Plans {
    /// Grouped statements run without a kept plan so far.
    pub(crate) fn planned(&self) -> u64 {
        self.planned.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Plans for a server known to run autovacuum or not (tests).
    #[cfg(test)]
    pub(crate) fn new(autovacuum: bool) -> Self {
        let plans = Self::ask_later();
        let _ = plans.autovacuum.set(autovacuum);
        plans
    }

    /// Asks the server whether autovacuum runs at the first look, on the
    /// connection of the store's first operation.
    pub(crate) fn ask_later() -> Self {
        Self {
            autovacuum: std::sync::OnceLock::new(),
            sized: std::sync::Mutex::new(SizedPlans {
                looked: None,
                large: false,
                seen_small: false,
                reserve: schema::RESERVE_BATCH.into(),
                resolve: schema::RESOLVE_BATCH.into(),
                runs: 0,
            }),
            planned: std::sync::atomic::AtomicU64::new(0),
            warned: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// Plans kept from the start, as on a server that runs autovacuum.
    #[cfg(test)]
    pub(crate) fn kept() -> Self {
        Self::new(true)
    }

    /// Whether autovacuum runs, for the records table too: asked of the
    /// server on `exec` unless known.
    pub(crate) async fn ask<'e, E: Executor<'e, Database = Postgres>>(
        &self,
        exec: E,
    ) -> Result<bool, sqlx::Error> {
        if let Some(known) = self.autovacuum.get() {
            return Ok(*known);
        }
        let analyzed: bool = sqlx::query_scalar(schema::AUTOVACUUM_ON)
            .fetch_one(exec)
            .await?;
        if self.autovacuum.set(analyzed).is_ok() && !analyzed {
            // Debug, not a warning: `idem migrate` and the tools print
            // nothing on success. docs/STORES.md tells operators what
            // autovacuum off asks of them.
            tracing::debug!(
                "postgres: autovacuum is off for idem_records; its grouped statements are planned at each run until the table has grown"
            );
        }
        Ok(analyzed)
    }

    /// Whether autovacuum runs, as far as known: until the server is
    /// asked, it is taken to run, so plans are kept.
    pub(crate) fn autovacuum(&self) -> bool {
        self.autovacuum.get().copied().unwrap_or(true)
    }

    pub(crate) fn lock(&self) -> std::sync::MutexGuard<'_, SizedPlans> {
        self.sized
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The text of the `which` statement and sqlx's `persistent` flag for
    /// it; reads the table's size on `conn` first when that is due.
    pub(crate) async fn statement(
        &self,
        which: Grouped,
        conn: &mut PgConnection,
    ) -> (Arc<str>, bool) {
        self.look(conn).await;
        self.current(which)
    }

    /// Reads the table's size on `conn` when a look is due (once per
    /// [`LOOK_AT_SIZE_EVERY`], by one caller; never where autovacuum runs),
    /// and analyzes the table when it has just crossed the bound.
    pub(crate) async fn look(&self, conn: &mut PgConnection) {
        let autovacuum = match self.ask(&mut *conn).await {
            Ok(autovacuum) => autovacuum,
            Err(err) => {
                tracing::debug!(%err, "postgres: whether autovacuum runs could not be read");
                return;
            }
        };
        let due = !autovacuum && {
            let mut sized = self.lock();
            let due = sized
                .looked
                .is_none_or(|at| at.elapsed() >= LOOK_AT_SIZE_EVERY);
            if due {
                // Claimed: one caller looks per interval.
                sized.looked = Some(std::time::Instant::now());
            }
            due
        };
        if !due {
            return;
        }
        match sqlx::query_scalar::<_, Option<i64>>(schema::RECORD_PAGES)
            .fetch_one(&mut *conn)
            .await
        {
            Ok(pages) => {
                if self.record_size(pages.unwrap_or(0)) {
                    self.analyze(conn).await;
                }
            }
            Err(err) => {
                tracing::debug!(%err, "postgres: the records table's size could not be read")
            }
        }
    }

    /// `ANALYZE idem_records` on `conn`; says once when the role may not.
    pub(crate) async fn analyze(&self, conn: &mut PgConnection) {
        let analyzed = match sqlx::query(schema::ANALYZE_RECORDS)
            .persistent(false)
            .execute(&mut *conn)
            .await
        {
            // A role that does not own the table gets a warning from the
            // server, not an error: the statistics say whether it ran.
            Ok(_) => sqlx::query_scalar::<_, Option<bool>>(schema::RECORDS_ANALYZED)
                .fetch_optional(&mut *conn)
                .await
                .map(|analyzed| analyzed.flatten().unwrap_or(true)),
            Err(err) => Err(err),
        };
        let err = match analyzed {
            Ok(true) => {
                tracing::debug!(
                    "postgres: idem_records analyzed at its crossing of the plan bound"
                );
                return;
            }
            Ok(false) => String::new(),
            Err(err) => err.to_string(),
        };
        if !self.warned.swap(true, std::sync::atomic::Ordering::Relaxed) {
            tracing::warn!(%err, "postgres: autovacuum is off and idem_records could not be analyzed by this role: statements prepared while the table was small may read all of a tenant's records for each key; run ANALYZE idem_records as its owner, or turn autovacuum on");
        }
    }

    /// The text of the `which` statement and whether its plan is kept, as
    /// the last look at the table's size decided; counts it in `planned`
    /// when it is not.
    pub(crate) fn current(&self, which: Grouped) -> (Arc<str>, bool) {
        let sized = self.lock();
        let sql = match which {
            Grouped::Reserve => &sized.reserve,
            Grouped::Resolve => &sized.resolve,
        };
        let kept = self.autovacuum() || sized.large;
        if !kept {
            self.planned
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        (Arc::clone(sql), kept)
    }

    /// Records that the table has `pages`: plans are kept from
    /// [`KEEP_PLANS_FROM_PAGES`] on, under new texts each time the table
    /// crosses that bound. True when this store saw it small before, so
    /// that statements prepared on the small table need the table
    /// analyzed; a store started on a large table prepares them there and
    /// analyzes nothing (an `ANALYZE` at every start would hold up the
    /// first operation, the longer the larger the table).
    pub(crate) fn record_size(&self, pages: i64) -> bool {
        let mut sized = self.lock();
        let large = pages >= KEEP_PLANS_FROM_PAGES;
        let crossed = large && !sized.large;
        if crossed {
            sized.runs += 1;
            let tag = format!("\n-- plans kept from run {}\n", sized.runs);
            sized.reserve = format!("{}{tag}", schema::RESERVE_BATCH).into();
            sized.resolve = format!("{}{tag}", schema::RESOLVE_BATCH).into();
        }
        let analyze = crossed && sized.seen_small;
        sized.large = large;
        sized.seen_small = !large;
        analyze
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A table that shrinks back below the bound (a `TRUNCATE`) has its
    /// grouped statements planned at each run again, and when it grows past
    /// the bound once more they get texts of their own, so no connection
    /// runs a plan it prepared for the table as it was before.
    #[test]
    fn grouped_plans_follow_the_table_across_the_bound() {
        let planned = |plans: &Plans| plans.planned.load(std::sync::atomic::Ordering::Relaxed);
        let plans = Plans::new(false);
        let (small, kept) = plans.current(Grouped::Reserve);
        assert!(!kept, "a table not yet looked at is planned each run");
        assert_eq!(&*small, schema::RESERVE_BATCH);
        assert_eq!(planned(&plans), 1);

        assert!(!plans.record_size(KEEP_PLANS_FROM_PAGES - 1));
        assert!(!plans.current(Grouped::Resolve).1);
        assert_eq!(planned(&plans), 2);

        assert!(plans.record_size(KEEP_PLANS_FROM_PAGES), "crossed: analyze");
        let (first, kept) = plans.current(Grouped::Reserve);
        let (first_resolve, _) = plans.current(Grouped::Resolve);
        assert!(kept, "a grown table keeps its plans");
        assert!(first.starts_with(schema::RESERVE_BATCH) && first.ends_with("run 1\n"));
        assert!(first_resolve.starts_with(schema::RESOLVE_BATCH));
        assert!(first_resolve.ends_with("run 1\n"));
        assert_eq!(planned(&plans), 2, "kept plans are not counted");

        // Still large: the same texts, so the prepared statements stay.
        assert!(!plans.record_size(KEEP_PLANS_FROM_PAGES * 10));
        assert_eq!(plans.current(Grouped::Reserve), (Arc::clone(&first), true));

        // Truncated: planned each run (unprepared, so whatever its text,
        // no plan is kept from it).
        assert!(!plans.record_size(0));
        assert!(!plans.current(Grouped::Reserve).1);
        assert_eq!(planned(&plans), 3);

        // Grown again: kept, under texts no connection has prepared yet.
        assert!(plans.record_size(KEEP_PLANS_FROM_PAGES), "crossed again");
        let (second, kept) = plans.current(Grouped::Reserve);
        let (second_resolve, _) = plans.current(Grouped::Resolve);
        assert!(kept);
        assert_ne!(second, first);
        assert_ne!(second_resolve, first_resolve);
        assert!(second.ends_with("run 2\n") && second_resolve.ends_with("run 2\n"));
        assert_eq!(planned(&plans), 3);

        // A store whose first look finds the table large keeps its plans
        // and analyzes nothing: it prepares its statements there.
        let started_large = Plans::new(false);
        assert!(!started_large.record_size(KEEP_PLANS_FROM_PAGES * 100));
        assert!(started_large.current(Grouped::Reserve).1);
        assert!(!started_large.record_size(0));
        assert!(
            started_large.record_size(KEEP_PLANS_FROM_PAGES),
            "then a crossing it saw"
        );

        // Where autovacuum runs, the store's own texts, kept (the size is
        // never read there).
        let analyzed = Plans::kept();
        assert_eq!(
            analyzed.current(Grouped::Resolve),
            (Arc::from(schema::RESOLVE_BATCH), true)
        );
        assert_eq!(planned(&analyzed), 0);
    }
}
