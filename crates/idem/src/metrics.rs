//! Every `idem_*` metric, in one table: its name, kind, labels and
//! description. The crates that record a metric (`idem-http`'s layer,
//! `idem-messaging`'s relay and consumer runner, the gateway) take its name
//! from here, and the gateway describes every entry of [`ALL`] to its
//! Prometheus recorder, so a name is written once and never drifts.
//!
//! This crate records nothing itself and depends on no metrics library:
//! these are names, not instruments.
//!
//! ```
//! use idem::metrics::{ALL, Kind, REQUESTS_TOTAL};
//!
//! assert_eq!(REQUESTS_TOTAL.name, "idem_requests_total");
//! assert_eq!(REQUESTS_TOTAL.labels, ["route", "outcome"]);
//! assert!(ALL.iter().all(|m| m.name.starts_with("idem_")));
//! assert!(ALL.iter().any(|m| m.kind == Kind::Histogram));
//! ```

/// What kind of instrument a metric is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Only goes up.
    Counter,
    /// A value that moves both ways.
    Gauge,
    /// A distribution of observations.
    Histogram,
}

/// One metric: what dashboards and alerts rely on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Metric {
    /// The Prometheus name.
    pub name: &'static str,
    /// The instrument.
    pub kind: Kind,
    /// Its labels, in the order they are documented.
    pub labels: &'static [&'static str],
    /// Whether its values are seconds.
    pub seconds: bool,
    /// The description shown by `/metrics`.
    pub help: &'static str,
}

const fn metric(
    name: &'static str,
    kind: Kind,
    labels: &'static [&'static str],
    seconds: bool,
    help: &'static str,
) -> Metric {
    Metric {
        name,
        kind,
        labels,
        seconds,
        help,
    }
}

use Kind::{Counter, Gauge, Histogram};

/// Requests by route pattern and idempotency outcome (`executed`,
/// `replayed`, `mismatch`, `in_progress`, …).
pub const REQUESTS_TOTAL: Metric = metric(
    "idem_requests_total",
    Counter,
    &["route", "outcome"],
    false,
    "Requests by route pattern and idempotency outcome.",
);
/// Request latency by route and outcome.
pub const REQUEST_DURATION: Metric = metric(
    "idem_request_duration_seconds",
    Histogram,
    &["route", "outcome"],
    true,
    "Time from a request reaching the gateway to its response head.",
);
/// Re-runs (lease takeovers) by route and reason.
pub const RERUNS_TOTAL: Metric = metric(
    "idem_reruns_total",
    Counter,
    &["route", "reason"],
    false,
    "Requests run again after their lease lapsed, by route and why.",
);
/// Held records settled by a lookup, by route and result.
pub const RECONCILED_TOTAL: Metric = metric(
    "idem_reconciled_total",
    Counter,
    &["route", "result"],
    false,
    "Held records settled through the route's lookup, by result.",
);
/// Store operation latency by store and operation.
pub const STORE_OP_SECONDS: Metric = metric(
    "idem_store_op_seconds",
    Histogram,
    &["store", "op"],
    true,
    "Store operation latency.",
);
/// Failed store operations (a fenced owner is not a failure).
pub const STORE_ERRORS_TOTAL: Metric = metric(
    "idem_store_errors_total",
    Counter,
    &["store", "op"],
    false,
    "Store operations that failed.",
);
/// Processing records at the last census.
pub const RECORDS_PROCESSING: Metric = metric(
    "idem_records_processing",
    Gauge,
    &[],
    false,
    "Processing records at the last census (a lower bound when the census is capped).",
);
/// Processing records without a live lease, older than the stuck threshold.
pub const STUCK_RECORDS: Metric = metric(
    "idem_stuck_records",
    Gauge,
    &[],
    false,
    "Processing records without a live lease, older than the stuck threshold.",
);
/// Expired records deleted by cleanup.
pub const CLEANUP_DELETED_TOTAL: Metric = metric(
    "idem_cleanup_deleted_total",
    Counter,
    &[],
    false,
    "Expired records deleted by cleanup.",
);
/// How far the wall clock is ahead of the store clock.
pub const WALL_CLOCK_OFFSET: Metric = metric(
    "idem_wall_clock_offset_seconds",
    Gauge,
    &[],
    true,
    "How far the wall clock is ahead of the store clock (stepped since start if not 0).",
);
/// Always 1; the version is a label.
pub const BUILD_INFO: Metric = metric(
    "idem_build_info",
    Gauge,
    &["version"],
    false,
    "Always 1; the version is a label.",
);
/// Requests answered `503` because the gateway (or their peer's share)
/// was full.
pub const REQUESTS_SHED_TOTAL: Metric = metric(
    "idem_requests_shed_total",
    Counter,
    &[],
    false,
    "Requests answered 503 because every in-flight slot was taken (or their peer's share).",
);
/// Connections closed at once because their peer held its share already.
pub const CONNECTIONS_REFUSED_TOTAL: Metric = metric(
    "idem_connections_refused_total",
    Counter,
    &[],
    false,
    "Connections closed at once because their peer held max_connections_per_peer already.",
);
/// Connections closed because their client took nothing of the answers
/// in flight within `idle_timeout`.
pub const CONNECTIONS_STALLED_TOTAL: Metric = metric(
    "idem_connections_stalled_total",
    Counter,
    &[],
    false,
    "Connections closed because their client took nothing of the answers in flight within idle_timeout.",
);
/// PostgreSQL statements that carried a group of operations.
pub const GROUPED_STATEMENTS_TOTAL: Metric = metric(
    "idem_store_grouped_statements_total",
    Counter,
    &[],
    false,
    "PostgreSQL statements (MySQL transactions) that carried a group of queued reservations or resolutions.",
);
/// Operations carried by grouped PostgreSQL statements (MySQL transactions).
pub const GROUPED_OPERATIONS_TOTAL: Metric = metric(
    "idem_store_grouped_operations_total",
    Counter,
    &[],
    false,
    "Reservations and resolutions carried by grouped PostgreSQL statements (MySQL transactions).",
);
/// PostgreSQL and MySQL operations that ran alone.
pub const ALONE_OPERATIONS_TOTAL: Metric = metric(
    "idem_store_alone_operations_total",
    Counter,
    &[],
    false,
    "PostgreSQL and MySQL reservations and resolutions that found a slot free and ran alone.",
);
/// Grouped PostgreSQL statements planned as they ran, without a kept plan.
pub const PLANNED_STATEMENTS_TOTAL: Metric = metric(
    "idem_store_planned_statements_total",
    Counter,
    &[],
    false,
    "Grouped PostgreSQL statements planned as they ran: the records table was small on a server without autovacuum.",
);
/// Answers a store could not keep because their record would exceed its
/// item limit (DynamoDB's 400 KB).
pub const ITEMS_TOO_LARGE_TOTAL: Metric = metric(
    "idem_store_items_too_large_total",
    Counter,
    &[],
    false,
    "Answers not retained because their record would exceed the store's item limit (DynamoDB: 400 KB).",
);
/// Outbox rows published.
pub const OUTBOX_PUBLISHED_TOTAL: Metric = metric(
    "idem_outbox_published_total",
    Counter,
    &[],
    false,
    "Outbox rows the broker acknowledged and the relay marked published.",
);
/// Outbox rows that became dead.
pub const OUTBOX_DEAD_TOTAL: Metric = metric(
    "idem_outbox_dead_total",
    Counter,
    &[],
    false,
    "Outbox rows parked as dead after max_attempts failed publications.",
);
/// Outbox rows waiting to be published.
pub const OUTBOX_PENDING: Metric = metric(
    "idem_outbox_pending",
    Gauge,
    &[],
    false,
    "Outbox rows waiting to be published.",
);
/// Age of the oldest pending outbox row.
pub const OUTBOX_LAG: Metric = metric(
    "idem_outbox_lag_seconds",
    Gauge,
    &[],
    true,
    "Age of the oldest pending outbox row.",
);
/// Messages through the inbox, by consumer and outcome.
pub const INBOX_MESSAGES_TOTAL: Metric = metric(
    "idem_inbox_messages_total",
    Counter,
    &["consumer", "outcome"],
    false,
    "Messages handled by a consumer runner, by consumer and outcome (applied, duplicate, …).",
);

/// Webhook deliveries by route, provider and result: `verified`, or why
/// one was refused (`signature_invalid`, `timestamp_stale`, …).
pub const WEBHOOK_DELIVERIES_TOTAL: Metric = metric(
    "idem_webhook_deliveries_total",
    Counter,
    &["route", "provider", "result"],
    false,
    "Webhook deliveries by route, provider and result: verified, or the reason one was refused (nothing forwarded).",
);

/// Every metric, in the order `/metrics` describes them.
pub const ALL: &[Metric] = &[
    REQUESTS_TOTAL,
    REQUEST_DURATION,
    RERUNS_TOTAL,
    RECONCILED_TOTAL,
    STORE_OP_SECONDS,
    STORE_ERRORS_TOTAL,
    RECORDS_PROCESSING,
    STUCK_RECORDS,
    CLEANUP_DELETED_TOTAL,
    WALL_CLOCK_OFFSET,
    BUILD_INFO,
    REQUESTS_SHED_TOTAL,
    CONNECTIONS_REFUSED_TOTAL,
    CONNECTIONS_STALLED_TOTAL,
    GROUPED_STATEMENTS_TOTAL,
    GROUPED_OPERATIONS_TOTAL,
    ALONE_OPERATIONS_TOTAL,
    PLANNED_STATEMENTS_TOTAL,
    ITEMS_TOO_LARGE_TOTAL,
    OUTBOX_PUBLISHED_TOTAL,
    OUTBOX_DEAD_TOTAL,
    OUTBOX_PENDING,
    OUTBOX_LAG,
    INBOX_MESSAGES_TOTAL,
    WEBHOOK_DELIVERIES_TOTAL,
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_unique_prefixed_and_follow_prometheus_conventions() {
        let mut names: Vec<&str> = ALL.iter().map(|m| m.name).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), ALL.len(), "a name listed twice");
        for m in ALL {
            assert!(m.name.starts_with("idem_"), "{}", m.name);
            assert_eq!(
                m.kind == Kind::Counter,
                m.name.ends_with("_total"),
                "{}",
                m.name
            );
            assert_eq!(m.seconds, m.name.ends_with("_seconds"), "{}", m.name);
            assert!(!m.help.is_empty(), "{}", m.name);
        }
    }
}
