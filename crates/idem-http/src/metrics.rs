//! Request metrics, through the [`metrics`] facade (no-ops until the
//! application installs a recorder, as the gateway does for Prometheus):
//!
//! * [`REQUESTS_TOTAL`] `{route, outcome}` — one count per request;
//! * [`REQUEST_DURATION`] `{route, outcome}` — seconds from the request
//!   reaching the layer to its response head.
//!
//! `route` is the configured operation (`POST /v1/payments`),
//! [`UNMATCHED_ROUTE`](crate::routes::UNMATCHED_ROUTE) or
//! [`NO_ROUTE`](crate::routes::NO_ROUTE) — never a raw path, a key or a
//! tenant, so the label set stays small. `outcome` is
//! [`Decision::as_str`]. The handles are registered on the first request,
//! so install the recorder before serving.

use std::sync::OnceLock;
use std::time::Duration;

use metrics::{Counter, Histogram};

use crate::layer::Decision;
use crate::routes::Routes;

/// Counter of requests by route and outcome.
pub const REQUESTS_TOTAL: &str = "idem_requests_total";
/// Histogram of request latency in seconds by route and outcome.
pub const REQUEST_DURATION: &str = "idem_request_duration_seconds";

/// Pre-registered handles, one pair per route and outcome, so recording a
/// request is two atomic updates with no label hashing.
#[derive(Debug, Default)]
pub(crate) struct RequestMetrics {
    handles: OnceLock<Vec<Vec<(Counter, Histogram)>>>,
}

impl RequestMetrics {
    /// Records one request; `route` indexes [`Routes::labels`].
    pub(crate) fn record(
        &self,
        routes: &Routes,
        route: usize,
        decision: Decision,
        elapsed: Duration,
    ) {
        let handles = self.handles.get_or_init(|| {
            routes
                .labels()
                .map(|label| {
                    Decision::ALL
                        .iter()
                        .map(|d| {
                            let labels = [
                                ("route", label.to_owned()),
                                ("outcome", d.as_str().to_owned()),
                            ];
                            (
                                metrics::counter!(REQUESTS_TOTAL, &labels),
                                metrics::histogram!(REQUEST_DURATION, &labels),
                            )
                        })
                        .collect()
                })
                .collect()
        });
        if let Some((count, latency)) = handles
            .get(route)
            .and_then(|per_route| per_route.get(decision as usize))
        {
            count.increment(1);
            latency.record(elapsed.as_secs_f64());
        }
    }
}
