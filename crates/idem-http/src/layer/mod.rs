//! The tower layer: the HTTP contract around any service.
//!
//! ```no_run
//! use axum::{Router, routing::post};
//! use idem::MemoryStore;
//! use idem_http::IdempotencyLayer;
//!
//! let app: Router = Router::new()
//!     .route("/v1/payments", post(|| async { "charged" }))
//!     .layer(IdempotencyLayer::new(MemoryStore::new()));
//! ```
//!
//! Per request: find the route (unprotected requests pass through), read
//! the key and the tenant, read the body within the limit, fingerprint it,
//! and ask the engine. The owner of a fresh record runs the inner service
//! **in a task of its own**, so a client that disconnects cancels neither
//! the work nor the recording of its result (otherwise its retry would run
//! the work again). The answer is stored as the route's policy says and
//! returned; duplicates get it back marked as the route's
//! [`Contract`] says (`Idempotent-Replayed: true` by
//! default).

use std::borrow::Cow;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::request::Parts;
use http::{HeaderMap, HeaderName, HeaderValue, Request, Response, StatusCode, header};
use http_body::Body;
use idem::reconcile::{Reconciler as _, Reconciliation};
use idem::{
    Begin, Engine, EngineError, Guard, IdempotencyKey, LeaseExpiry, ListRecords, Replay, Scope,
    Store, StoredResponse, V1Address,
};
use tower_layer::Layer;
use tower_service::Service;

use crate::body::{BoxError, Kept, RequestBodyError, ResponseBody, keep_response, read_request};
use crate::contract::{Contract, NotRetained};
use crate::decision::Decision;
#[cfg(test)]
use crate::headers::IDEMPOTENT_REPLAYED;
use crate::headers::{
    IDEMPOTENCY_STATUS, IDEMPOTENCY_TTL, NOT_RETAINED, TRAILER_PREFIX, replayable_name,
    storable_headers, storable_trailers,
};
use crate::metrics::RequestMetrics;
use crate::pattern::normalize_path;
use crate::problem::{Problem, ProblemKind, retry_after_secs};
use crate::reconcile::{HttpLookup, LookupRequest, Sender};
use crate::request::{
    Hashing, PeerAddr, TenantExtractor, TenantSource, fingerprints, header_label, is_json,
    key_from_body, key_from_headers,
};
use crate::routes::{MissingTenant, PathSpelling, RoutePolicy, Routes};
use crate::trace;
use tracing::Instrument;

/// Set by an inner service (the gateway's proxy) on responses it made
/// itself because the upstream failed, so the layer knows what happened to
/// the side effect.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UpstreamOutcome {
    /// Nothing reached the upstream: the key is released.
    NotSent,
    /// The request may have reached the upstream (timeout or broken
    /// connection after sending): the record stays `outcome_unknown`.
    MaybeSent,
    /// The inner service recorded the outcome itself, with the lease of the
    /// [`Reserved`] extension, inside its own database transaction (e.g.
    /// `PgStore::resolve_in` next to the business change): the layer leaves
    /// the record alone and passes the response on.
    Recorded,
}

/// Put in the request's extensions when the inner service runs as the
/// key's owner: what it needs to record the outcome in its own transaction
/// (and then answer with [`UpstreamOutcome::Recorded`]), or to use the key
/// as a stable operation id towards a third party.
#[derive(Debug, Clone)]
pub struct Reserved {
    /// Tenant and operation.
    pub scope: idem::Scope,
    /// The client's key.
    pub key: idem::IdempotencyKey,
    /// This attempt's lease (the fence for recording).
    pub lease: idem::Lease,
}

/// The longest `Retry-After` for a request whose first attempt is still
/// running.
pub const IN_PROGRESS_RETRY_AFTER: Duration = Duration::from_secs(1);

/// Adds idempotency to a service; see the [module docs](self).
pub struct IdempotencyLayer<S, T = TenantSource> {
    shared: Arc<Shared<S, T>>,
}

impl<S, T> Clone for IdempotencyLayer<S, T> {
    fn clone(&self) -> Self {
        Self {
            shared: Arc::clone(&self.shared),
        }
    }
}

impl<S, T: std::fmt::Debug> std::fmt::Debug for IdempotencyLayer<S, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdempotencyLayer")
            .field("routes", &self.shared.routes)
            .field("tenant", &self.shared.tenant)
            .finish_non_exhaustive()
    }
}

struct Shared<S, T> {
    store: Arc<S>,
    routes: Routes,
    /// One engine per route policy, in [`Routes::policies`] order.
    engines: Vec<Engine<S>>,
    tenant: Arc<T>,
    /// How tenants and fingerprints are hashed.
    hashing: Hashing,
    metrics: RequestMetrics,
    /// Settles held records of the routes that name a lookup (`None`:
    /// no route does; held records wait for an operator).
    reconciliation: Option<Reconciliation<S, HttpLookup>>,
    /// Set once the reconciliation's task runs.
    started: std::sync::OnceLock<()>,
}

impl<S: Store> IdempotencyLayer<S, TenantSource> {
    /// Protects `POST`/`PATCH` with the default policy, tenants from the
    /// `Authorization` header.
    pub fn new(store: S) -> Self {
        Self::from_arc(Arc::new(store))
    }

    /// Like [`new`](Self::new) over a shared store.
    pub fn from_arc(store: Arc<S>) -> Self {
        Self::build(
            store,
            Routes::default(),
            Arc::new(TenantSource::Authorization),
            Hashing::unkeyed(),
        )
    }
}

impl<S: Store, T: TenantExtractor> IdempotencyLayer<S, T> {
    fn build(store: Arc<S>, routes: Routes, tenant: Arc<T>, hashing: Hashing) -> Self {
        let engines = routes
            .policies()
            .map(|p| Engine::from_arc(Arc::clone(&store)).with_policy(p.engine.clone()))
            .collect();
        let reconciliation = HttpLookup::of(&routes, tenant.needs_credentials())
            .map(|lookup| Reconciliation::new(Arc::clone(&store), lookup));
        Self {
            shared: Arc::new(Shared {
                store,
                routes,
                engines,
                tenant,
                hashing,
                metrics: RequestMetrics::default(),
                reconciliation,
                started: std::sync::OnceLock::new(),
            }),
        }
    }

    /// Starts reconciling held records now, on the current Tokio runtime
    /// (otherwise it starts with the first request, on the runtime serving
    /// it). Does nothing when no route names a lookup, or when started.
    pub fn start_reconciliation(&self) {
        self.shared.start_reconciliation();
    }

    /// Uses this route table.
    pub fn with_routes(self, routes: Routes) -> Self {
        Self::build(
            Arc::clone(&self.shared.store),
            routes,
            Arc::clone(&self.shared.tenant),
            self.shared.hashing.clone(),
        )
    }

    /// Uses this tenant extractor.
    pub fn with_tenant<T2: TenantExtractor>(self, tenant: T2) -> IdempotencyLayer<S, T2> {
        IdempotencyLayer::build(
            Arc::clone(&self.shared.store),
            self.shared.routes.clone(),
            Arc::new(tenant),
            self.shared.hashing.clone(),
        )
    }

    /// Hashes tenants and fingerprints this way (default:
    /// [`Hashing::unkeyed`]; set a secret in production, see [`Hashing`]).
    pub fn with_hashing(self, hashing: Hashing) -> Self {
        Self::build(
            Arc::clone(&self.shared.store),
            self.shared.routes.clone(),
            Arc::clone(&self.shared.tenant),
            hashing,
        )
    }

    /// The store.
    pub fn store(&self) -> &Arc<S> {
        &self.shared.store
    }
}

impl<S: ListRecords, T: TenantExtractor> IdempotencyLayer<S, T> {
    /// Also finds held records that no request of this process told it
    /// of (left by a process that died, their clients gone) by listing the
    /// store's processing records every `every` (`None`: never, for a
    /// store where listing is costly). Call after
    /// [`with_routes`](Self::with_routes) and [`with_tenant`](Self::with_tenant),
    /// which start afresh.
    pub fn with_reconcile_scans(self, every: Option<Duration>) -> Self {
        let mut layer = Self::build(
            Arc::clone(&self.shared.store),
            self.shared.routes.clone(),
            Arc::clone(&self.shared.tenant),
            self.shared.hashing.clone(),
        );
        if let Some(shared) = Arc::get_mut(&mut layer.shared) {
            shared.reconciliation = shared
                .reconciliation
                .take()
                .map(|r| r.with_scan_every(every));
        }
        layer
    }
}

impl<I, S, T> Layer<I> for IdempotencyLayer<S, T> {
    type Service = Idempotency<I, S, T>;

    fn layer(&self, inner: I) -> Self::Service {
        self.shared.metrics.init(&self.shared.routes);
        Idempotency {
            inner,
            shared: Arc::clone(&self.shared),
        }
    }
}

/// The service made by [`IdempotencyLayer`].
pub struct Idempotency<I, S, T = TenantSource> {
    inner: I,
    shared: Arc<Shared<S, T>>,
}

impl<I: Clone, S, T> Clone for Idempotency<I, S, T> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            shared: Arc::clone(&self.shared),
        }
    }
}

impl<I: std::fmt::Debug, S, T> std::fmt::Debug for Idempotency<I, S, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Idempotency")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

impl<I, S, T> Idempotency<I, S, T> {
    /// The inner service.
    pub fn get_ref(&self) -> &I {
        &self.inner
    }

    /// The inner service, mutably.
    pub fn get_mut(&mut self) -> &mut I {
        &mut self.inner
    }

    /// The inner service, consuming this one.
    pub fn into_inner(self) -> I {
        self.inner
    }
}

type Answer<B, E> = Result<Response<ResponseBody<B>>, E>;

impl<I, S, T, ReqBody, ResBody> Service<Request<ReqBody>> for Idempotency<I, S, T>
where
    I: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone + Send + 'static,
    I::Future: Send + 'static,
    I::Error: Send + 'static,
    S: Store,
    T: TenantExtractor,
    ReqBody: Body<Data = Bytes> + From<Bytes> + Send + 'static,
    ReqBody::Error: Into<BoxError>,
    ResBody: Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    type Response = Response<ResponseBody<ResBody>>;
    type Error = I::Error;
    type Future = Pin<Box<dyn Future<Output = Answer<ResBody, I::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<ReqBody>) -> Self::Future {
        // The ready service handles this request; a fresh clone waits for
        // the next poll_ready (tower's clone-and-swap).
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        Shared::handle(&self.shared, inner, req)
    }
}

/// What `protect` needs of a request's route, owned: its future outlives
/// the borrow of the route table.
struct Protected {
    index: usize,
    operation: String,
    policy: Arc<RoutePolicy>,
    /// The request's path in normal form, when that differs from the path
    /// sent.
    normalized: Option<Box<str>>,
}

/// Counts a request's answer when it is ready: under its route's labels,
/// with the decision the answer carries and the time since `started`.
struct Counted<S, T> {
    shared: Arc<Shared<S, T>>,
    index: usize,
    matched: bool,
    started: Instant,
    /// The request is a gRPC call: a refusal is said as a gRPC status.
    grpc: bool,
}

impl<S, T> Counted<S, T> {
    fn record<B, E>(self, mut answer: Answer<B, E>) -> Answer<B, E> {
        let Self {
            shared,
            index,
            matched,
            started,
            grpc,
        } = self;
        if grpc && let Ok(resp) = answer {
            answer = Ok(crate::grpc::answer(resp));
        }
        if let Ok(resp) = &mut answer {
            let decision = resp
                .extensions()
                .get::<Decision>()
                .copied()
                .unwrap_or(Decision::PassThrough);
            shared
                .metrics
                .record(&shared.routes, index, decision, started.elapsed());
            if trace::active() {
                let label = shared.routes.label(index);
                trace::record(trace::ROUTE, label);
                trace::record(trace::OUTCOME, decision.as_str());
                if matched {
                    resp.extensions_mut().insert(trace::Route(label.to_owned()));
                }
            }
        }
        answer
    }
}

fn with_decision<B>(mut resp: Response<B>, decision: Decision) -> Response<B> {
    resp.extensions_mut().insert(decision);
    resp
}

fn problem<B>(problem: Problem, decision: Decision) -> Response<ResponseBody<B>> {
    with_decision(ResponseBody::problem(&problem), decision)
}

mod execute;
mod flow;
mod held;
mod incoming;
mod replay;
#[cfg(test)]
mod tests;

pub use held::LOOKUP_BODY_LIMIT;
