//! What the layer tells a trace: the route, the outcome, the record's
//! state and (when the span asks for it) the key, recorded on the span the
//! request runs in.
//!
//! The layer makes no span of its own. A server around it that exports
//! traces (the `idem` gateway, with OpenTelemetry) runs each request in a
//! span of the [`TARGET`] target that declares the fields below; the layer
//! fills them in. Without such a span, or with nothing listening for the
//! target, recording is one cached check.
//!
//! ```
//! use idem_http::trace;
//! let span = tracing::info_span!(
//!     target: trace::TARGET,
//!     "idem.request",
//!     http.route = tracing::field::Empty,
//!     idem.outcome = tracing::field::Empty,
//!     idem.record_state = tracing::field::Empty,
//! );
//! # let _ = span;
//! ```

/// The `tracing` target of the spans meant for traces (not for logs).
pub const TARGET: &str = "idem_trace";

/// The route's operation (`POST /v1/payments`), as the metrics label it.
pub const ROUTE: &str = "http.route";
/// The layer's [`Decision`](crate::Decision), as the metrics label it.
pub const OUTCOME: &str = "idem.outcome";
/// The record's state as this request left it or found it: `completed`,
/// `failed`, `released`, `processing`, `outcome_unknown`.
pub const RECORD_STATE: &str = "idem.record_state";
/// The idempotency key: recorded only on spans that declare the field (a
/// server declares it when told to: keys can be personal data).
pub const KEY: &str = "idem.key";

/// The operation of the route a request matched (`POST /v1/payments`),
/// left in the response's extensions while traces are kept: a server span
/// is named after it once the layer has matched the route.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Route(pub String);

/// Whether anything listens to spans of the [`TARGET`] target (a cached
/// check per call site).
pub(crate) fn active() -> bool {
    tracing::enabled!(target: TARGET, tracing::Level::INFO)
}

/// Records `value` as `field` of the current span, if any span of the
/// [`TARGET`] target can be seen at all.
pub(crate) fn record(field: &str, value: &str) {
    if active() {
        tracing::Span::current().record(field, value);
    }
}
