//! The gateway's Prometheus metrics: the recorder, the
//! description of every metric of the one table (`idem::metrics`), and
//! `/metrics` rendering.
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
use idem::store::Op;
use metrics::{Counter, Histogram, Unit};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use tracing::Instrument;

use idem::metrics::{
    ALL, ALONE_OPERATIONS_TOTAL, BUILD_INFO, GROUPED_OPERATIONS_TOTAL, GROUPED_STATEMENTS_TOTAL,
    Kind, PLANNED_STATEMENTS_TOTAL, STORE_ERRORS_TOTAL, STORE_OP_SECONDS,
};

/// Latency buckets (seconds) for requests and store operations: 50 µs to
/// 10 s, dense where an embedded store and a loopback upstream answer.
const LATENCY_BUCKETS: [f64; 17] = [
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
    2.5, 5.0, 10.0,
];

static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();

/// Group-commit counts of one store, as `/metrics` reports them.
#[derive(Debug, Clone, Copy, Default)]
pub struct GroupCounts {
    /// Statements (PostgreSQL) or transactions (MySQL) that carried a group.
    pub statements: u64,
    /// Operations those carried.
    pub operations: u64,
    /// Operations that ran alone.
    pub alone: u64,
    /// Statements run from a prepared plan (PostgreSQL only).
    pub planned: u64,
}

/// A store that groups its operations and counts them.
pub trait GroupCommit: Send + 'static {
    /// Its counts so far.
    fn group_counts(&self) -> GroupCounts;
}

impl GroupCommit for idem_postgres::PgStore {
    fn group_counts(&self) -> GroupCounts {
        let s = self.group_commit_stats();
        GroupCounts {
            statements: s.statements,
            operations: s.operations,
            alone: s.alone,
            planned: s.planned,
        }
    }
}

#[cfg(feature = "mysql")]
impl GroupCommit for idem_mysql::MySqlStore {
    fn group_counts(&self) -> GroupCounts {
        let s = self.group_commit_stats();
        GroupCounts {
            statements: s.transactions,
            operations: s.operations,
            alone: s.alone,
            planned: 0,
        }
    }
}

/// DynamoDB stores whose refused oversized answers `/metrics` reports.
#[cfg(feature = "dynamodb")]
static ITEM_LIMITS: Mutex<Vec<idem_dynamodb::DynamoStore>> = Mutex::new(Vec::new());

/// Reports `store`'s answers refused for DynamoDB's item limit in
/// `/metrics` from now on.
#[cfg(feature = "dynamodb")]
pub fn watch_items_too_large(store: &idem_dynamodb::DynamoStore) {
    ITEM_LIMITS
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .push(store.clone());
}

/// Sets the items-too-large counter to the watched stores' total.
fn publish_items_too_large() {
    #[cfg(feature = "dynamodb")]
    {
        let stores = ITEM_LIMITS.lock().unwrap_or_else(|p| p.into_inner());
        if !stores.is_empty() {
            let total: u64 = stores.iter().map(|s| s.stats().items_too_large).sum();
            metrics::counter!(idem::metrics::ITEMS_TOO_LARGE_TOTAL.name).absolute(total);
        }
    }
}

/// Stores whose group-commit counts `/metrics` reports.
static GROUP_COMMIT: Mutex<Vec<Box<dyn GroupCommit>>> = Mutex::new(Vec::new());

/// Reports `store`'s group-commit counts in `/metrics` from now on.
pub fn watch_group_commit<S: GroupCommit + Clone>(store: &S) {
    GROUP_COMMIT
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .push(Box::new(store.clone()));
}

/// Sets the group-commit counters to the watched stores' totals.
fn publish_group_commit() {
    let stores = GROUP_COMMIT.lock().unwrap_or_else(|p| p.into_inner());
    if stores.is_empty() {
        return;
    }
    let (mut statements, mut operations, mut alone, mut planned) = (0, 0, 0, 0);
    for store in stores.iter() {
        let s = store.group_counts();
        statements += s.statements;
        operations += s.operations;
        alone += s.alone;
        planned += s.planned;
    }
    metrics::counter!(GROUPED_STATEMENTS_TOTAL.name).absolute(statements);
    metrics::counter!(GROUPED_OPERATIONS_TOTAL.name).absolute(operations);
    metrics::counter!(ALONE_OPERATIONS_TOTAL.name).absolute(alone);
    metrics::counter!(PLANNED_STATEMENTS_TOTAL.name).absolute(planned);
}

/// How often buffered histogram samples are folded into their buckets.
const UPKEEP_EVERY: Duration = Duration::from_secs(1);

/// Installs the process-wide Prometheus recorder (once; later calls return
/// the same handle) and spawns its upkeep. Call it before building the
/// layer's service: the layer registers its counters then. Needs a Tokio
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
        register_counters();
        metrics::gauge!(BUILD_INFO.name, "version" => env!("CARGO_PKG_VERSION")).set(1.0);
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
    publish_items_too_large();
    handle.render()
}

/// Describes every metric of the table (`idem::metrics::ALL`), so
/// `/metrics` carries each one's help and unit.
fn describe() {
    for m in ALL {
        let unit = m.seconds.then_some(Unit::Seconds);
        match (m.kind, unit) {
            (Kind::Counter, _) => metrics::describe_counter!(m.name, m.help),
            (Kind::Gauge, Some(u)) => metrics::describe_gauge!(m.name, u, m.help),
            (Kind::Gauge, None) => metrics::describe_gauge!(m.name, m.help),
            (Kind::Histogram, Some(u)) => metrics::describe_histogram!(m.name, u, m.help),
            (Kind::Histogram, None) => metrics::describe_histogram!(m.name, m.help),
        }
    }
}

/// Registers every counter without labels at zero (`idem_requests_shed_total 0`
/// before the first shed), so dashboards and alerts see a zero rather than
/// nothing. Labelled ones are registered by who knows their labels: the
/// layer per route and outcome, the store per operation. Gauges are left
/// until their first reading: a zero there would be a claim.
fn register_counters() {
    for m in ALL {
        if m.kind == Kind::Counter && m.labels.is_empty() {
            metrics::counter!(m.name).increment(0);
        }
    }
}

/// One store's latency histograms and error counters, registered once so
/// that timing an operation on the request path is two atomic updates
/// with no label hashing (register after [`install`]).
#[derive(Clone)]
pub struct StoreOpMetrics {
    store: &'static str,
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
        let handles = Op::ALL
            .iter()
            .map(|op| {
                (
                    metrics::histogram!(STORE_OP_SECONDS.name, "store" => store, "op" => op.name()),
                    metrics::counter!(STORE_ERRORS_TOTAL.name, "store" => store, "op" => op.name()),
                )
            })
            .collect();
        Self { store, handles }
    }

    /// Runs one store operation, recording its latency and any failure
    /// (a fenced owner is not a failure), in a span of its own when
    /// traces are on.
    pub async fn timed<T>(
        &self,
        op: Op,
        fut: impl Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        let started = Instant::now();
        let span = crate::telemetry::store_span(self.store, op.name());
        let result = fut.instrument(span.clone()).await;
        if result.is_err() && !span.is_disabled() {
            span.record("otel.status_code", "ERROR");
        }
        if let Some((latency, errors)) = self.handles.get(op as usize) {
            latency.record(started.elapsed().as_secs_f64());
            if matches!(&result, Err(err) if !matches!(err, StoreError::Fenced)) {
                errors.increment(1);
            }
        }
        result
    }
}
