//! Background jobs of `idem serve`: the cleanup loop and the stuck-record
//! monitor. Both are configurable (`[cleanup]`, `[monitor]`), on by
//! default, and stop with the server.

use std::time::Duration;

use idem::operator;
use tokio::task::JoinSet;

use crate::config::{CleanupSettings, MonitorSettings};
use crate::error::error_chain;
use crate::store::GatewayStore;
use idem::metrics::{CLEANUP_DELETED_TOTAL, RECORDS_PROCESSING, STUCK_RECORDS, WALL_CLOCK_OFFSET};

/// Most processing records one census reads.
pub const CENSUS_CAP: usize = 10_000;

/// Starts the jobs; dropping (or aborting) the set stops them.
pub fn spawn(
    store: &GatewayStore,
    cleanup: Option<CleanupSettings>,
    monitor: MonitorSettings,
) -> JoinSet<()> {
    let mut jobs = JoinSet::new();
    if let Some(settings) = cleanup {
        jobs.spawn(cleanup_loop(store.clone(), settings));
    }
    if monitor.enabled != Some(false) {
        jobs.spawn(monitor_loop(store.clone(), monitor));
    }
    jobs
}

/// The share of time the serving gateway's cleanup spends deleting: a
/// backlog of expired records is worked off at about a quarter of the
/// store's deletion rate, so that the serving p99 moves little (1.25× at
/// 64 connections with `bench/growth`: docs/BENCHMARKS.md, "Targets").
/// `idem cleanup` runs at full speed.
const SERVING_CLEANUP_SHARE: f64 = 0.25;

/// Runs one cleanup and counts what it deleted. Each run gets the interval
/// as its time budget, so a huge backlog is worked off across runs while
/// the store keeps serving between batches.
pub async fn cleanup_once(store: &GatewayStore, settings: CleanupSettings) {
    let counter = metrics::counter!(CLEANUP_DELETED_TOTAL.name);
    let mut counted = 0;
    let result = operator::cleanup_paced(
        store,
        settings.batch,
        Some(settings.interval),
        SERVING_CLEANUP_SHARE,
        |total| {
            counter.increment(total - counted);
            counted = total;
        },
    )
    .await;
    match result {
        Ok(report) if report.deleted > 0 => tracing::info!(
            reason = "idempotency_cleanup",
            deleted = report.deleted,
            batches = report.batches,
            more_left = report.stopped_early,
            "expired records deleted"
        ),
        Ok(_) => tracing::debug!(reason = "idempotency_cleanup", "nothing expired"),
        Err(err) => {
            tracing::warn!(reason = "idempotency_cleanup_failed", err = %error_chain(&err), "cleanup failed; retrying next interval")
        }
    }
}

async fn cleanup_loop(store: GatewayStore, settings: CleanupSettings) {
    let mut every = tokio::time::interval(settings.interval);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        every.tick().await;
        cleanup_once(&store, settings).await;
    }
}

/// Counts processing and stuck records into the gauges and warns about
/// stuck ones.
pub async fn census_once(store: &GatewayStore, stuck_after: Duration) {
    match operator::census(store, stuck_after, CENSUS_CAP).await {
        Ok(c) => {
            metrics::gauge!(RECORDS_PROCESSING.name).set(c.processing as f64);
            metrics::gauge!(STUCK_RECORDS.name).set(c.stuck as f64);
            if c.stuck > 0 {
                tracing::warn!(
                    reason = "idempotency_stuck_record",
                    stuck = c.stuck,
                    outcome_unknown = c.outcome_unknown,
                    stuck_after_secs = stuck_after.as_secs(),
                    "processing records without a live owner; list them with GET /api/v1/records?state=processing&older_than={}s",
                    stuck_after.as_secs()
                );
            }
        }
        Err(err) => {
            tracing::warn!(reason = "idempotency_census_failed", err = %error_chain(&err), "cannot count processing records")
        }
    }
}

/// A wall clock this far from the store clock has been stepped.
const CLOCK_STEP_MS: i64 = 1_000;

/// Reports how far the wall clock has moved from the process' store clock
/// ([`idem::Timestamp::now`]): a gauge, and a warning while it is more
/// than a second.
pub fn check_clock() {
    let offset = idem::Timestamp::wall_clock_offset();
    metrics::gauge!(WALL_CLOCK_OFFSET.name).set(offset as f64 / 1000.0);
    if offset.abs() > CLOCK_STEP_MS {
        tracing::warn!(
            reason = "wall_clock_stepped",
            offset_ms = offset,
            "the wall clock was stepped while idem ran; leases and expiry keep to the time that really passed (restart to take the wall clock's time again)"
        );
    }
}

async fn monitor_loop(store: GatewayStore, settings: MonitorSettings) {
    let mut every = tokio::time::interval(settings.interval);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        every.tick().await;
        census_once(&store, settings.stuck_after).await;
        check_clock();
    }
}
