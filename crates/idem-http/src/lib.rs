//! # idem-http — Stripe-style `Idempotency-Key` for HTTP services
//!
//! A [`tower`](https://docs.rs/tower) layer that gives any HTTP service
//! (axum, plain hyper, the `idem` gateway's proxy) the idempotency contract
//! of the IETF *Idempotency-Key* draft, with Stripe's behaviour where the
//! draft is silent:
//!
//! | situation | answer |
//! |---|---|
//! | first request with a key | executed; response stored per policy |
//! | same key, same request, finished | stored status, headers, body + `Idempotent-Replayed: true` |
//! | same key, different request | `422` (configurable), `…/idempotency-key-reused` |
//! | same key while the first still runs | `409` + `Retry-After` |
//! | same key, earlier attempt's outcome unknown, route has a [`Lookup`] | `409` `…/idempotency-outcome-reconciling` + `Retry-After` (the next lookup); then the reconciled answer |
//! | same key, earlier attempt's outcome unknown, no lookup | `409` `…/idempotency-outcome-held`: held for an operator, never run again |
//! | key missing where required / malformed | `400` |
//! | body over the limit | `413` |
//! | store down, fail-closed / fail-open | `503` + `Retry-After` / forwarded with `Idempotency-Status: unprotected` |
//! | upstream unreachable / timed out after sending | `502`, key released / `504`, record `outcome_unknown` |
//!
//! Every refusal is an RFC 9457 `application/problem+json` document with a
//! stable `type` ([`ProblemKind`]).
//!
//! ```no_run
//! use axum::{Router, routing::post};
//! use http::Method;
//! use idem_http::{IdempotencyLayer, RoutePolicy, Routes};
//! use idem_sqlite::SqliteStore;
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let routes = Routes::default()
//!     .route(Method::POST, "/v1/payments", RoutePolicy::default().with_require_key(true))?;
//! let app: Router = Router::new()
//!     .route("/v1/payments", post(|| async { "charged" }))
//!     .layer(IdempotencyLayer::new(SqliteStore::open("idem.db")?).with_routes(routes));
//! # Ok(())
//! # }
//! ```

mod body;
pub mod contract;
mod decision;
pub mod graphql;
pub mod grpc;
mod headers;
pub mod jsonrpc;
pub mod layer;
pub mod lookup;
pub mod metrics;
pub mod openapi;
mod pattern;
mod pointer;
mod problem;
mod reconcile;
pub mod request;
pub mod routes;
pub mod trace;
pub mod webhook;

pub use body::{BoxError, ResponseBody};
pub use contract::{Contract, HELD_RETRY_AFTER, KeyFormat, NotRetained, Profile};
pub use decision::Decision;
pub use headers::{
    HOP_BY_HOP, IDEMPOTENCY_REPLAYED, IDEMPOTENCY_STATUS, IDEMPOTENCY_TTL, IDEMPOTENT_REPLAYED,
    NEVER_STORED, hop_by_hop_names, replayable,
};
pub use layer::{Idempotency, IdempotencyLayer, Reserved, UpstreamOutcome};
pub use lookup::Lookup;
pub use pattern::{PathPattern, PatternError, normalize_path};
pub use pointer::{BodyFields, JsonPointer, PointerError};
pub use problem::{
    PROBLEM_BASE, PROBLEM_JSON, Problem, ProblemKind, ProblemType, retry_after_secs,
};
pub use request::{
    Hashing, IDEMPOTENCY_KEY, PeerAddr, Tenant, TenantExtractor, TenantSource, fingerprints,
    idempotency_key, is_json, is_trusted, previous_fingerprint,
};
pub use routes::{
    MissingTenant, PathSpelling, RouteMatch, RoutePolicy, Routes, UNMATCHED_ROUTE,
    UNPROTECTED_ROUTE,
};

/// The bytes of a whole body, for the unit tests of answers.
#[cfg(test)]
pub(crate) fn full_body(body: http_body_util::Full<bytes::Bytes>) -> bytes::Bytes {
    use http_body_util::BodyExt as _;
    tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("runtime")
        .block_on(body.collect())
        .expect("body")
        .to_bytes()
}
