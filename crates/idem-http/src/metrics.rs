//! Request metrics, through the [`metrics`] facade (no-ops until the
//! application installs a recorder, as the gateway does for Prometheus):
//!
//! * [`REQUESTS_TOTAL`] `{route, outcome}` — one count per request;
//! * [`REQUEST_DURATION`] `{route, outcome}` — seconds from the request
//!   reaching the layer to its response head;
//! * [`RERUNS_TOTAL`] `{route, reason}` — attempts that took a lapsed
//!   record over and ran its work again (`on_lease_expiry = retry` only);
//!   `reason` is `outcome_unknown` or `lease_lapsed`;
//! * [`RECONCILED_TOTAL`] `{route, result}` — held records settled by the
//!   route's lookup: `completed`, `released`, or `gave_up` (left for an
//!   operator);
//! * [`WEBHOOK_DELIVERIES_TOTAL`] `{route, provider, result}` — deliveries
//!   to webhook routes: `verified`, or the [`Refused`] reason.
//!
//! `route` is the configured operation (`POST /v1/payments`),
//! [`UNMATCHED_ROUTE`](crate::routes::UNMATCHED_ROUTE) or
//! [`UNPROTECTED_ROUTE`](crate::routes::UNPROTECTED_ROUTE) — never a raw path, a key or a
//! tenant, so the label set stays small. `outcome` is
//! [`Decision::as_str`]. The handles are registered (at zero) when the
//! layer makes its service, so install the metrics recorder before
//! building the service: counters registered before it stay no-ops.

use std::sync::OnceLock;
use std::time::Duration;

use idem::RerunReason;
use idem::reconcile::Settled;
use metrics::{Counter, Histogram};

use crate::decision::Decision;
use crate::routes::Routes;
use crate::webhook::Refused;

pub use idem::metrics::{
    RECONCILED_TOTAL, REQUEST_DURATION, REQUESTS_TOTAL, RERUNS_TOTAL, WEBHOOK_DELIVERIES_TOTAL,
};

/// Pre-registered handles, one pair per route and outcome, so recording a
/// request is two atomic updates with no label hashing.
#[derive(Debug, Default)]
pub(crate) struct RequestMetrics {
    handles: OnceLock<Vec<Vec<(Counter, Histogram)>>>,
    /// Per route: re-runs whose earlier attempt was marked unknown, and
    /// those whose owner stopped renewing.
    reruns: OnceLock<Vec<[Counter; 2]>>,
    /// Per route: for a webhook route, its verified deliveries and then
    /// one counter per [`Refused`] reason, in [`Refused::ALL`] order.
    webhooks: OnceLock<Vec<Vec<Counter>>>,
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
        let handles = self.handles(routes);
        if let Some((count, latency)) = handles
            .get(route)
            .and_then(|per_route| per_route.get(decision as usize))
        {
            count.increment(1);
            latency.record(elapsed.as_secs_f64());
        }
    }

    /// Every route's request counters and latency histograms, one per
    /// outcome, registered (at zero) on first use.
    fn handles(&self, routes: &Routes) -> &[Vec<(Counter, Histogram)>] {
        self.register(routes);
        self.handles.get_or_init(|| {
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
                                metrics::counter!(REQUESTS_TOTAL.name, &labels),
                                metrics::histogram!(REQUEST_DURATION.name, &labels),
                            )
                        })
                        .collect()
                })
                .collect()
        })
    }

    /// Registers every counter of every route at zero now (the layer does
    /// when it makes its service), so that `/metrics` lists each route and
    /// outcome, and alerts on a rate see a zero, before the first request.
    pub(crate) fn init(&self, routes: &Routes) {
        self.handles(routes);
        self.webhook_handles(routes);
    }

    /// Registers every route's re-run counters at zero, so that dashboards
    /// and alerts see them before the first re-run.
    pub(crate) fn register(&self, routes: &Routes) {
        self.reruns.get_or_init(|| {
            routes
                .labels()
                .map(|label| {
                    [RerunReason::OutcomeUnknown, RerunReason::LeaseLapsed].map(|reason| {
                        metrics::counter!(RERUNS_TOTAL.name, "route" => label.to_owned(), "reason" => reason.as_str())
                    })
                })
                .collect()
        });
    }

    /// Registers every webhook route's delivery counters at zero.
    fn webhook_handles(&self, routes: &Routes) -> &[Vec<Counter>] {
        self.webhooks.get_or_init(|| {
            routes
                .labels()
                .zip(routes.policies())
                .map(|(label, policy)| {
                    let Some(hook) = &policy.webhook else {
                        return Vec::new();
                    };
                    let provider = hook.provider().name();
                    std::iter::once("verified")
                        .chain(Refused::ALL.iter().map(|r| r.as_str()))
                        .map(|result| {
                            metrics::counter!(WEBHOOK_DELIVERIES_TOTAL.name, "route" => label.to_owned(), "provider" => provider, "result" => result)
                        })
                        .collect()
                })
                .collect()
        })
    }

    /// Counts a webhook delivery of route `route`: verified (`None`) or
    /// refused.
    pub(crate) fn webhook(&self, routes: &Routes, route: usize, refused: Option<Refused>) {
        let slot = refused.map_or(0, |r| 1 + r as usize);
        if let Some(counter) = self
            .webhook_handles(routes)
            .get(route)
            .and_then(|c| c.get(slot))
        {
            counter.increment(1);
        }
    }

    /// Counts a re-run; `route` indexes [`Routes::labels`].
    pub(crate) fn rerun(&self, routes: &Routes, route: usize, reason: RerunReason) {
        self.register(routes);
        let slot = match reason {
            RerunReason::OutcomeUnknown => 0,
            _ => 1,
        };
        if let Some(counters) = self.reruns.get().and_then(|r| r.get(route)) {
            counters[slot].increment(1);
        }
    }
}

/// Counters of held records settled by lookups, registered at zero for
/// every route with a lookup.
#[derive(Debug)]
pub(crate) struct ReconcileMetrics {
    by_route: Vec<(String, [Counter; 3])>,
}

const SETTLED: [Settled; 3] = [Settled::Completed, Settled::Released, Settled::GaveUp];

impl ReconcileMetrics {
    pub(crate) fn new<'a>(labels: impl Iterator<Item = &'a str>) -> Self {
        Self {
            by_route: labels
                .map(|label| {
                    let counters = SETTLED.map(|how| {
                        metrics::counter!(RECONCILED_TOTAL.name, "route" => label.to_owned(), "result" => how.as_str())
                    });
                    (label.to_owned(), counters)
                })
                .collect(),
        }
    }

    pub(crate) fn settled(&self, label: &str, how: Settled) {
        if let Some((_, counters)) = self.by_route.iter().find(|(l, _)| l == label)
            && let Some(i) = SETTLED.iter().position(|s| *s == how)
        {
            counters[i].increment(1);
        }
    }
}
