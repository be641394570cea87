//! The gateway's Prometheus metrics (DESIGN.md §7): the recorder, the
//! names the gateway records itself, and `/metrics` rendering.
//!
//! Request counts and latencies come from the layer
//! ([`idem_http::metrics`]); store latencies from [`GatewayStore`](crate::store::GatewayStore);
//! the processing / stuck gauges and the cleanup counter from the
//! background jobs ([`crate::jobs`]); PostgreSQL group commit's counts from
//! the stores registered with [`watch_group_commit`], read at each render.

use std::future::Future;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use idem::StoreError;
use metrics::{Counter, Histogram, Unit};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

/// Histogram of store operation latency in seconds, by `store` and `op`.
pub const STORE_OP_SECONDS: &str = "idem_store_op_seconds";
/// Counter of failed store operations (a fenced owner is not a failure).
pub const STORE_ERRORS_TOTAL: &str = "idem_store_errors_total";
/// Gauge: processing records at the last census.
pub const RECORDS_PROCESSING: &str = "idem_records_processing";
/// Gauge: stuck records at the last census.
pub const STUCK_RECORDS: &str = "idem_stuck_records";
/// Counter: records deleted by cleanup.
pub const CLEANUP_DELETED_TOTAL: &str = "idem_cleanup_deleted_total";
/// Gauge: seconds the wall clock is ahead of the process' store clock
/// (non-zero after someone stepped the wall clock).
pub const WALL_CLOCK_OFFSET: &str = "idem_wall_clock_offset_seconds";
/// Gauge `{version}` = 1.
pub const BUILD_INFO: &str = "idem_build_info";
/// Counter: grouped PostgreSQL statements run (group commit).
pub const GROUPED_STATEMENTS_TOTAL: &str = "idem_store_grouped_statements_total";
/// Counter: operations those grouped statements carried.
pub const GROUPED_OPERATIONS_TOTAL: &str = "idem_store_grouped_operations_total";
/// Counter: PostgreSQL operations that found a statement slot free and ran
/// alone.
pub const ALONE_OPERATIONS_TOTAL: &str = "idem_store_alone_operations_total";

/// Latency buckets (seconds) for requests and store operations: 50 µs to
/// 10 s, dense where an embedded store and a loopback upstream answer.
const LATENCY_BUCKETS: [f64; 17] = [
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
    2.5, 5.0, 10.0,
];

static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();

/// PostgreSQL stores whose group-commit counts `/metrics` reports.
static GROUP_COMMIT: Mutex<Vec<idem_postgres::PgStore>> = Mutex::new(Vec::new());

/// Reports `store`'s group-commit counts in `/metrics` from now on.
pub fn watch_group_commit(store: &idem_postgres::PgStore) {
    GROUP_COMMIT
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .push(store.clone());
}

/// Sets the group-commit counters to the watched stores' totals.
fn publish_group_commit() {
    let stores = GROUP_COMMIT.lock().unwrap_or_else(|p| p.into_inner());
    if stores.is_empty() {
        return;
    }
    let (mut statements, mut operations, mut alone) = (0, 0, 0);
    for store in stores.iter() {
        let s = store.group_commit_stats();
        statements += s.statements;
        operations += s.operations;
        alone += s.alone;
    }
    metrics::counter!(GROUPED_STATEMENTS_TOTAL).absolute(statements);
    metrics::counter!(GROUPED_OPERATIONS_TOTAL).absolute(operations);
    metrics::counter!(ALONE_OPERATIONS_TOTAL).absolute(alone);
}

/// How often buffered histogram samples are folded into their buckets.
const UPKEEP_EVERY: Duration = Duration::from_secs(1);

/// Installs the process-wide Prometheus recorder (once; later calls return
/// the same handle) and spawns its upkeep. Call it before serving: the
/// layer registers its counters on the first request. Needs a Tokio
/// runtime.
pub fn install() -> &'static PrometheusHandle {
    HANDLE.get_or_init(|| {
        let builder = PrometheusBuilder::new()
            .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), &LATENCY_BUCKETS)
            .expect("the bucket list is not empty");
        let recorder = builder.build_recorder();
        let handle = recorder.handle();
        if metrics::set_global_recorder(recorder).is_err() {
            // An embedding application installed its own recorder: ours
            // then renders nothing, theirs gets every metric.
            tracing::debug!("a metrics recorder is already installed; /metrics stays empty");
        }
        describe();
        metrics::gauge!(BUILD_INFO, "version" => env!("CARGO_PKG_VERSION")).set(1.0);
        let upkeep = handle.clone();
        tokio::spawn(async move {
            // Histogram samples wait in memory until upkeep folds them into
            // their buckets: 8 bytes each, a few per request. At 100k
            // requests/s a 5 s interval held about 10 MiB of them (peak
            // RSS 64 -> 69 MiB); every second, a fifth of that.
            let mut every = tokio::time::interval(UPKEEP_EVERY);
            loop {
                every.tick().await;
                upkeep.run_upkeep();
            }
        });
        handle
    })
}

/// The Prometheus text exposition of everything recorded so far.
pub fn render() -> String {
    let handle = install();
    publish_group_commit();
    handle.render()
}

fn describe() {
    use idem_http::metrics::{REQUEST_DURATION, REQUESTS_TOTAL};
    metrics::describe_counter!(
        REQUESTS_TOTAL,
        "Requests by route pattern and idempotency outcome."
    );
    metrics::describe_histogram!(
        REQUEST_DURATION,
        Unit::Seconds,
        "Time from a request reaching the gateway to its response head."
    );
    metrics::describe_histogram!(STORE_OP_SECONDS, Unit::Seconds, "Store operation latency.");
    metrics::describe_counter!(STORE_ERRORS_TOTAL, "Store operations that failed.");
    metrics::describe_gauge!(
        RECORDS_PROCESSING,
        "Processing records at the last census (a lower bound when the census is capped)."
    );
    metrics::describe_gauge!(
        STUCK_RECORDS,
        "Processing records without a live lease, older than the stuck threshold."
    );
    metrics::describe_counter!(CLEANUP_DELETED_TOTAL, "Expired records deleted by cleanup.");
    metrics::describe_gauge!(
        WALL_CLOCK_OFFSET,
        Unit::Seconds,
        "How far the wall clock is ahead of the store clock (stepped since start if not 0)."
    );
    metrics::describe_counter!(
        crate::limits::REQUESTS_SHED_TOTAL,
        "Requests answered 503 because every in-flight slot was taken (or their peer's share)."
    );
    metrics::describe_counter!(
        crate::limits::CONNECTIONS_REFUSED_TOTAL,
        "Connections closed at once because their peer held max_connections_per_peer already."
    );
    metrics::describe_gauge!(BUILD_INFO, "Always 1; the version is a label.");
    metrics::describe_counter!(
        GROUPED_STATEMENTS_TOTAL,
        "PostgreSQL statements that carried a group of queued reservations or resolutions."
    );
    metrics::describe_counter!(
        GROUPED_OPERATIONS_TOTAL,
        "Reservations and resolutions carried by grouped PostgreSQL statements."
    );
    metrics::describe_counter!(
        ALONE_OPERATIONS_TOTAL,
        "PostgreSQL reservations and resolutions that found a statement slot free and ran alone."
    );
}

/// The store operations timed in [`STORE_OP_SECONDS`], by their `op` label.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreOp {
    /// `reserve`.
    Reserve,
    /// `get`.
    Get,
    /// `resolve`.
    Resolve,
    /// `release`.
    Release,
    /// `mark_unknown`.
    MarkUnknown,
    /// `renew`.
    Renew,
    /// `list`.
    List,
    /// `purge`.
    Purge,
    /// `delete`.
    Delete,
}

impl StoreOp {
    /// Every operation, in declaration order (`op as usize` indexes it).
    pub const ALL: [StoreOp; 9] = [
        Self::Reserve,
        Self::Get,
        Self::Resolve,
        Self::Release,
        Self::MarkUnknown,
        Self::Renew,
        Self::List,
        Self::Purge,
        Self::Delete,
    ];

    /// The `op` label.
    pub const fn name(self) -> &'static str {
        match self {
            Self::Reserve => "reserve",
            Self::Get => "get",
            Self::Resolve => "resolve",
            Self::Release => "release",
            Self::MarkUnknown => "mark_unknown",
            Self::Renew => "renew",
            Self::List => "list",
            Self::Purge => "purge",
            Self::Delete => "delete",
        }
    }
}

/// One store's latency histograms and error counters, registered once so
/// that timing an operation on the request path is two atomic updates
/// with no label hashing (register after [`install`]).
#[derive(Clone)]
pub struct StoreOpMetrics {
    handles: Arc<[(Histogram, Counter)]>,
}

impl std::fmt::Debug for StoreOpMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoreOpMetrics").finish_non_exhaustive()
    }
}

impl StoreOpMetrics {
    /// The handles of every operation of the store labelled `store`.
    pub fn new(store: &'static str) -> Self {
        let handles = StoreOp::ALL
            .iter()
            .map(|op| {
                (
                    metrics::histogram!(STORE_OP_SECONDS, "store" => store, "op" => op.name()),
                    metrics::counter!(STORE_ERRORS_TOTAL, "store" => store, "op" => op.name()),
                )
            })
            .collect();
        Self { handles }
    }

    /// Runs one store operation, recording its latency and any failure
    /// (a fenced owner is not a failure).
    pub async fn timed<T>(
        &self,
        op: StoreOp,
        fut: impl Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        let started = Instant::now();
        let result = fut.await;
        if let Some((latency, errors)) = self.handles.get(op as usize) {
            latency.record(started.elapsed().as_secs_f64());
            if matches!(&result, Err(err) if !matches!(err, StoreError::Fenced)) {
                errors.increment(1);
            }
        }
        result
    }
}
