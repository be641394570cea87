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
//! returned; duplicates get it back with `Idempotent-Replayed: true`.

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
use crate::decision::Decision;
use crate::headers::{
    IDEMPOTENCY_STATUS, IDEMPOTENT_REPLAYED, NOT_RETAINED, replayable_name, storable_headers,
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
}

impl<S, T> Counted<S, T> {
    fn record<B, E>(self, mut answer: Answer<B, E>) -> Answer<B, E> {
        let Self {
            shared,
            index,
            matched,
            started,
        } = self;
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

impl<S: Store, T: TenantExtractor> Shared<S, T> {
    fn start_reconciliation(&self) {
        if let Some(r) = &self.reconciliation
            && tokio::runtime::Handle::try_current().is_ok()
        {
            self.started.get_or_init(|| {
                r.spawn();
            });
        }
    }

    /// Routes the request, and answers it: what needs no waiting here
    /// and now (a keyless request goes to the inner service at once), the
    /// rest in `protect`. Every answer is counted.
    ///
    /// Only the future the request needs is boxed. One async function for
    /// all of them held the request, and room for `protect`'s whole state
    /// machine, in every request's box (2,976 bytes, copied into it each
    /// time); a keyless request's box now holds the inner service's future.
    fn handle<I, ReqBody, ResBody>(
        this: &Arc<Self>,
        inner: I,
        req: Request<ReqBody>,
    ) -> Pin<Box<dyn Future<Output = Answer<ResBody, I::Error>> + Send>>
    where
        I: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone + Send + 'static,
        I::Future: Send + 'static,
        I::Error: Send + 'static,
        ReqBody: Body<Data = Bytes> + From<Bytes> + Send + 'static,
        ReqBody::Error: Into<BoxError>,
        ResBody: Body<Data = Bytes> + Send + 'static,
        ResBody::Error: Into<BoxError>,
    {
        let started = Instant::now();
        // Lookups reach the inner service from the first request on: that
        // is where the service and its body types are known.
        if let Some(r) = &this.reconciliation
            && !r.reconciler().connected()
        {
            r.reconciler().connect(|| lookup_sender(inner.clone()));
            this.start_reconciliation();
        }
        // Matched, fingerprinted and forwarded in one spelling. Kept only
        // when it differs from the path sent (rare): no allocation on the
        // common path.
        let normalized = match normalize_path(req.uri().path()) {
            Cow::Borrowed(_) => None,
            Cow::Owned(path) => Some(path.into_boxed_str()),
        };
        let route = this.routes.matching_normalized(
            req.method(),
            normalized.as_deref().unwrap_or(req.uri().path()),
        );
        let counted = Counted {
            shared: Arc::clone(this),
            // Labels index: configured routes, then the defaults, then "none".
            index: route.as_ref().map_or(this.engines.len(), |r| r.index),
            matched: route.is_some(),
            started,
        };
        // A refusal, or `None` to forward the request as it is.
        let refused = match route {
            None => None,
            Some(route)
                if route.policy.path_spelling == PathSpelling::Refuse
                    && !spelled_as_judged(req.uri().path(), normalized.as_deref(), route.exact) =>
            {
                tracing::info!(reason = "path_not_canonical", operation = %route.operation);
                let detail = "this route takes its path only as spelled in its normal form";
                Some(problem(
                    Problem::new(ProblemKind::PathNotCanonical, detail),
                    Decision::BadRequest,
                ))
            }
            Some(route) => match key_from_headers(req.headers(), &route.policy.key_headers) {
                Err(p) => {
                    tracing::info!(reason = "idempotency_invalid_key", operation = %route.operation, detail = p.detail());
                    Some(problem(p, Decision::InvalidKey))
                }
                Ok(None) if !key_in_body(route.policy, req.headers()) => {
                    missing_key(route.policy, &route.operation)
                }
                Ok(key) => {
                    let mut req = req;
                    if let Some(path) = &normalized {
                        forward_as_judged(&mut req, path);
                    }
                    let this = Arc::clone(this);
                    let protected = Protected {
                        index: route.index,
                        operation: route.operation.into_owned(),
                        policy: Arc::clone(route.policy),
                        normalized,
                    };
                    return Box::pin(async move {
                        counted.record(Self::protect(&this, inner, req, key, protected).await)
                    });
                }
            },
        };
        match refused {
            Some(refusal) => Box::pin(async move { counted.record(Ok(refusal)) }),
            None => {
                let mut req = req;
                remove_untrusted(&*this.tenant, &mut req);
                let forwarded = pass_through(inner, req, Decision::PassThrough);
                Box::pin(async move { counted.record(forwarded.await) })
            }
        }
    }

    async fn protect<I, ReqBody, ResBody>(
        this: &Arc<Self>,
        inner: I,
        req: Request<ReqBody>,
        header_key: Option<IdempotencyKey>,
        route: Protected,
    ) -> Answer<ResBody, I::Error>
    where
        I: Service<Request<ReqBody>, Response = Response<ResBody>> + Send + 'static,
        I::Future: Send + 'static,
        I::Error: Send + 'static,
        ReqBody: Body<Data = Bytes> + From<Bytes> + Send + 'static,
        ReqBody::Error: Into<BoxError>,
        ResBody: Body<Data = Bytes> + Send + 'static,
        ResBody::Error: Into<BoxError>,
    {
        let Protected {
            index,
            operation,
            policy,
            normalized,
        } = route;
        let engine = &this.engines[index];
        let (parts, body) = req.into_parts();
        if let Some(refused) = connection_names_what_was_read(&parts, &policy, &*this.tenant) {
            tracing::info!(reason = "idempotency_connection_header", %operation, detail = refused.detail());
            return Ok(problem(refused, Decision::BadRequest));
        }
        // Without a key header (`handle` sends such a request here only
        // when `key_in_body` holds), the body is read first: whether the
        // request is protected at all depends on it.
        let (key, body) = match header_key {
            Some(key) => (key, Received::Unread(body)),
            None => {
                let bytes = match read_body(&parts, body, &policy).await {
                    Ok(bytes) => bytes,
                    Err(refused) => {
                        tracing::info!(reason = refused.reason, %operation, detail = refused.problem.detail());
                        return Ok(problem(refused.problem, Decision::BadRequest));
                    }
                };
                let found = match &policy.key_from {
                    Some(field) => key_from_body(&parts, &bytes, field),
                    None => Ok(None),
                };
                match found {
                    Ok(Some(key)) => (key, Received::Read(bytes)),
                    Ok(None) => {
                        if let Some(refusal) = missing_key(&policy, &operation) {
                            return Ok(refusal);
                        }
                        let mut req = Request::from_parts(parts, ReqBody::from(bytes));
                        remove_untrusted(&*this.tenant, &mut req);
                        return pass_through(inner, req, Decision::PassThrough).await;
                    }
                    Err(p) if p.kind() == Some(ProblemKind::BodyAmbiguous) => {
                        tracing::info!(reason = "idempotency_body_encoding", %operation, detail = p.detail());
                        return Ok(problem(p, Decision::BadRequest));
                    }
                    Err(p) => {
                        tracing::info!(reason = "idempotency_invalid_key", %operation, detail = p.detail());
                        return Ok(problem(p, Decision::InvalidKey));
                    }
                }
            }
        };
        if let Some(lookup) = &policy.lookup
            && !lookup.accepts(&key)
        {
            let p = Problem::new(
                ProblemKind::KeyInvalid,
                "this route's lookup puts the key in a path segment of its own, which cannot be '.' or '..'",
            );
            tracing::info!(reason = "idempotency_invalid_key", %operation, detail = p.detail());
            return Ok(problem(p, Decision::InvalidKey));
        }
        let scope = match this.tenant.tenant(&parts).and_then(|t| {
            Scope::new(&this.hashing.tenant(&t), &operation)
                .map_err(|e| Problem::new(ProblemKind::TenantInvalid, e.to_string()))
        }) {
            Ok(scope) => scope,
            Err(p)
                if p.kind() == Some(ProblemKind::TenantMissing)
                    && policy.on_missing_tenant == MissingTenant::Pass =>
            {
                tracing::warn!(reason = "idempotency_unprotected", %operation, %key, detail = p.detail(), "no tenant credential: forwarded unprotected (on_missing_tenant = pass)");
                let mut req = Request::from_parts(parts, body.into_body());
                remove_untrusted(&*this.tenant, &mut req);
                let mut resp = pass_through(inner, req, Decision::Unprotected).await?;
                resp.headers_mut()
                    .insert(IDEMPOTENCY_STATUS, HeaderValue::from_static("unprotected"));
                return Ok(resp);
            }
            Err(p) => {
                tracing::info!(reason = "idempotency_bad_tenant", %operation, kind = p.slug(), detail = p.detail());
                return Ok(problem(p, Decision::BadRequest));
            }
        };
        let bytes = match body {
            Received::Read(bytes) => bytes,
            Received::Unread(body) => match read_body(&parts, body, &policy).await {
                Ok(bytes) => bytes,
                Err(refused) => {
                    tracing::info!(reason = refused.reason, tenant = scope.tenant(), operation = scope.operation(), %key, detail = refused.problem.detail());
                    return Ok(problem(refused.problem, Decision::BadRequest));
                }
            },
        };
        let path = normalized.as_deref().unwrap_or(parts.uri.path());
        let (fp, v1_fp) = match fingerprints(
            &this.hashing,
            &parts,
            path,
            &operation,
            &policy.fingerprint_headers,
            &policy.fingerprint_body,
            &bytes,
        ) {
            Ok(fps) => fps,
            Err(p) => {
                tracing::info!(reason = "idempotency_body_encoding", tenant = scope.tenant(), operation = scope.operation(), %key);
                return Ok(problem(p, Decision::BadRequest));
            }
        };
        // While records from before keyed hashing may live, the request is
        // also looked for where they would be.
        let v1 = v1_fp.and_then(|fingerprint| {
            let tenant = this.tenant.v1_tenant(&parts)?;
            Some(V1Address {
                scope: Scope::new(&tenant, &operation).ok()?,
                fingerprint,
            })
        });
        // From the reservation on, everything runs in a task of its own: a
        // client that disconnects must not drop a reservation just made, nor
        // cancel the work or the recording of its result (its retry would
        // otherwise wait out the lease or run the work again). Boxed: the
        // task then holds a pointer, not the whole state machine, which
        // spawning copied into place on every request (`bench/cpu-budget`:
        // replays 24.4–24.8 → 22.7–22.8 µs of gateway CPU per request).
        // Even an answer the record cache holds goes through the task:
        // answering it in the caller's task (one poll before spawning) was
        // tried and measured slower on replays (`bench/ab`, same minutes:
        // 0.82–0.89× the requests/s at 1 and 64 connections).
        let decided = Box::pin(decide(
            Arc::clone(this),
            index,
            engine.clone(),
            inner,
            parts,
            bytes,
            scope,
            key,
            fp,
            v1,
            normalized,
            policy,
        ));
        // The task runs in the request's span when traces are kept.
        let task = if trace::active() {
            tokio::spawn(decided.instrument(tracing::Span::current()))
        } else {
            tokio::spawn(decided)
        };
        match task.await {
            Ok(answer) => answer,
            Err(join) => {
                // A panic in the inner service: its guard was dropped and the
                // lease will lapse; the caller learns the outcome is unknown.
                tracing::error!(reason = "idempotency_outcome_unknown", error = %join, "the request task failed");
                Ok(problem(
                    Problem::new(
                        ProblemKind::UpstreamBroken,
                        "processing failed unexpectedly; the outcome is unknown",
                    ),
                    Decision::OutcomeUnknown,
                ))
            }
        }
    }
}

/// Asks the engine and acts on its answer; runs detached from the client.
#[allow(clippy::too_many_arguments)]
async fn decide<I, S, T, ReqBody, ResBody>(
    shared: Arc<Shared<S, T>>,
    route: usize,
    engine: Engine<S>,
    inner: I,
    parts: http::request::Parts,
    bytes: Bytes,
    scope: Scope,
    key: idem::IdempotencyKey,
    fp: idem::Fingerprint,
    v1: Option<V1Address>,
    normalized: Option<Box<str>>,
    policy: Arc<RoutePolicy>,
) -> Answer<ResBody, I::Error>
where
    I: Service<Request<ReqBody>, Response = Response<ResBody>> + Send + 'static,
    I::Future: Send + 'static,
    I::Error: Send + 'static,
    S: Store,
    T: TenantExtractor,
    ReqBody: Body<Data = Bytes> + From<Bytes> + Send + 'static,
    ReqBody::Error: Into<BoxError>,
    ResBody: Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    trace::record(trace::KEY, key.as_str());
    let begin = match &v1 {
        Some(v1) => engine.begin_accepting_v1(&scope, &key, fp, v1).await,
        None => engine.begin(&scope, &key, fp).await,
    };
    // A record the fingerprint does not match may have been written by
    // the version before for this very request: its fingerprint is
    // computed only then.
    let begin = match begin {
        Ok(Begin::Mismatch { state }) => {
            let path = normalized.as_deref().unwrap_or(parts.uri.path());
            match crate::previous_fingerprint(
                &shared.hashing,
                &parts,
                path,
                scope.operation(),
                &policy.fingerprint_headers,
                &policy.fingerprint_body,
                &bytes,
            ) {
                Some(previous) => engine.recheck_mismatch(&scope, &key, state, previous).await,
                None => Ok(Begin::Mismatch { state }),
            }
        }
        other => other,
    };
    match begin {
        Ok(Begin::Execute(guard)) => {
            if let Some(rerun) = guard.rerun() {
                shared.metrics.rerun(&shared.routes, route, rerun.reason);
            }
            let path = normalized.as_deref().unwrap_or(parts.uri.path());
            let handoff = shared.handoff(route, &parts, path, &scope);
            let req = Request::from_parts(parts, ReqBody::from(bytes));
            execute(inner, req, guard, policy, handoff).await
        }
        Ok(Begin::Replay(replay)) => {
            tracing::info!(reason = "idempotency_replay", tenant = scope.tenant(), operation = scope.operation(), %key, state = %replay.state, resource_id = replay.resource_id.as_deref(), status = replay.response.status);
            trace::record(trace::RECORD_STATE, replay.state.as_str());
            Ok(with_decision(replayed(replay), Decision::Replayed))
        }
        Ok(Begin::InProgress {
            retry_after,
            outcome_unknown,
        }) => {
            tracing::info!(reason = "idempotency_in_progress", tenant = scope.tenant(), operation = scope.operation(), %key, outcome_unknown);
            trace::record(
                trace::RECORD_STATE,
                if outcome_unknown {
                    "outcome_unknown"
                } else {
                    "processing"
                },
            );
            let answer = if outcome_unknown {
                let path = normalized.as_deref().unwrap_or(parts.uri.path());
                let handoff = shared.handoff(route, &parts, path, &scope);
                held(handoff, &policy, &scope, &key, retry_after)
            } else {
                // The attempt renews its lease while it runs, so the lease
                // says nothing of when it ends: ask again soon.
                Problem::new(
                    ProblemKind::InProgress,
                    "a request with this key is still being processed; retry after the indicated delay",
                )
                .with_retry_after(retry_after.min(IN_PROGRESS_RETRY_AFTER))
            };
            Ok(problem(answer, Decision::InProgress))
        }
        Ok(Begin::Mismatch { state }) => {
            tracing::info!(reason = "idempotency_mismatch", tenant = scope.tenant(), operation = scope.operation(), %key, %state);
            trace::record(trace::RECORD_STATE, state.as_str());
            Ok(problem(
                Problem::new(
                    ProblemKind::KeyReused,
                    format!("this Idempotency-Key was used for a different request ({state}); use a new key for a new request"),
                )
                .with_status(policy.mismatch_status),
                Decision::Mismatch,
            ))
        }
        Ok(Begin::Unprotected(err)) => {
            tracing::warn!(reason = "idempotency_unprotected", tenant = scope.tenant(), operation = scope.operation(), %key, %err);
            let req = Request::from_parts(parts, ReqBody::from(bytes));
            let mut resp = pass_through(inner, req, Decision::Unprotected).await?;
            resp.headers_mut()
                .insert(IDEMPOTENCY_STATUS, HeaderValue::from_static("unprotected"));
            Ok(resp)
        }
        Err(EngineError::Store(err)) => {
            tracing::warn!(reason = "idempotency_store_error", tenant = scope.tenant(), operation = scope.operation(), %key, %err);
            Ok(problem(
                Problem::new(
                    ProblemKind::StoreUnavailable,
                    "the idempotency store is unavailable; nothing was forwarded",
                )
                .with_retry_after(Duration::from_secs(1)),
                Decision::StoreError,
            ))
        }
        Err(err) => {
            tracing::warn!(reason = "idempotency_store_error", tenant = scope.tenant(), operation = scope.operation(), %key, %err);
            Ok(problem(
                Problem::new(ProblemKind::StoreUnavailable, err.to_string()),
                Decision::StoreError,
            ))
        }
    }
}

fn content_length(headers: &HeaderMap) -> Option<u64> {
    headers
        .get(header::CONTENT_LENGTH)?
        .to_str()
        .ok()?
        .parse()
        .ok()
}

/// A request body, read already or not yet.
enum Received<B> {
    Read(Bytes),
    Unread(B),
}

impl<B: From<Bytes>> Received<B> {
    /// The body to forward as it is.
    fn into_body(self) -> B {
        match self {
            Self::Read(bytes) => B::from(bytes),
            Self::Unread(body) => body,
        }
    }
}

/// Why a request body was not read: the log's reason and the answer.
struct BodyRefused {
    reason: &'static str,
    problem: Problem,
}

/// Reads a protected request's body within the route's limit.
async fn read_body<B>(parts: &Parts, body: B, policy: &RoutePolicy) -> Result<Bytes, BodyRefused>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    let too_large = || BodyRefused {
        reason: "idempotency_body_too_large",
        problem: Problem::new(
            ProblemKind::BodyTooLarge,
            format!(
                "the request body is larger than the {} bytes this route accepts",
                policy.max_request_body
            ),
        ),
    };
    if content_length(&parts.headers).is_some_and(|n| n > policy.max_request_body as u64) {
        return Err(too_large());
    }
    match read_request(body, policy.max_request_body).await {
        Ok(bytes) => Ok(bytes),
        Err(RequestBodyError::TooLarge) => Err(too_large()),
        Err(RequestBodyError::TimedOut(err)) => Err(BodyRefused {
            reason: "idempotency_body_timeout",
            problem: Problem::new(
                ProblemKind::BodyTimeout,
                format!("the request body stalled: {err}; nothing was recorded or forwarded"),
            ),
        }),
        Err(RequestBodyError::Unreadable(err)) => Err(BodyRefused {
            reason: "idempotency_body_unreadable",
            problem: Problem::new(
                ProblemKind::BodyUnreadable,
                format!("the request body could not be read to its end: {err}"),
            ),
        }),
    }
}

/// Whether a request without a key header may carry its key in the body:
/// the route names a `key_from` field, and only a JSON body can hold it
/// (any other is forwarded, or refused, unread, as on a route without
/// `key_from`).
fn key_in_body(policy: &RoutePolicy, headers: &HeaderMap) -> bool {
    policy.key_from.is_some() && is_json(headers)
}

/// The answer to a protected route's request that carries no key: a
/// refusal where the route requires one; `None` passes it through.
fn missing_key<B>(policy: &RoutePolicy, operation: &str) -> Option<Response<ResponseBody<B>>> {
    if !policy.require_key {
        return None;
    }
    tracing::info!(reason = "idempotency_missing_key", %operation);
    let headers: Vec<String> = policy.key_headers.iter().map(header_label).collect();
    let mut wanted = match headers.as_slice() {
        [] => String::new(),
        // The default, as it always read: "requires an Idempotency-Key header".
        [one] => format!("an {one} header"),
        many => format!("one of the headers {}", many.join(", ")),
    };
    if let Some(field) = &policy.key_from {
        let body = format!("the JSON body's {field}");
        wanted = if wanted.is_empty() {
            body
        } else {
            format!("{wanted} or {body}")
        };
    }
    Some(problem(
        Problem::new(
            ProblemKind::KeyMissing,
            format!("{operation} requires {wanted}"),
        ),
        Decision::MissingKey,
    ))
}

/// A `Connection` header that names the key or the tenant's header: the
/// layer would read them, and the next hop strip them, so the upstream
/// would run a request other than the one judged. Refused (`400`).
fn connection_names_what_was_read<T: TenantExtractor>(
    parts: &Parts,
    policy: &RoutePolicy,
    tenant: &T,
) -> Option<Problem> {
    if !parts.headers.contains_key(header::CONNECTION) {
        return None;
    }
    let named = crate::headers::hop_by_hop_names(&parts.headers);
    if let Some(key) = policy.key_headers.iter().find(|h| named.contains(h)) {
        return Some(Problem::new(
            ProblemKind::KeyInvalid,
            format!(
                "the Connection header names {key}, which would be removed before the upstream; nothing was forwarded"
            ),
        ));
    }
    let credentials = tenant.credentials(parts);
    let name = credentials.keys().find(|h| named.contains(h))?;
    Some(Problem::new(
        ProblemKind::TenantInvalid,
        format!(
            "the Connection header names {name}, which would be removed before the upstream; nothing was forwarded"
        ),
    ))
}

/// Whether a request path `sent` is the spelling its route judged: it
/// matched its route `exact`ly, and it is what is forwarded for it
/// ([`judged_path`]; `normalized` is `None` when normalising left it as
/// it is).
fn spelled_as_judged(sent: &str, normalized: Option<&str>, exact: bool) -> bool {
    exact && normalized.is_none_or(|n| judged_path(sent, n) == sent)
}

/// The path a request sent as `sent` and judged on `normalized` goes
/// upstream with: the normal form, and a trailing slash as sent, so that
/// upstreams that route `/payments/` and `/payments` apart (Django's
/// `APPEND_SLASH`) keep working.
fn judged_path(sent: &str, normalized: &str) -> String {
    let mut path = String::with_capacity(sent.len());
    path.push_str(normalized);
    if sent.len() > 1 && sent.ends_with('/') && normalized != "/" {
        path.push('/');
    }
    path
}

/// Puts the path a protected request was matched and fingerprinted on in
/// its URI, so that the upstream runs the request that was judged: an
/// upstream that does not resolve `%2e%2e` would otherwise run
/// `/orders/B/%2e%2e/A/capture` as B's capture under A's fingerprint
/// ([`judged_path`]).
fn forward_as_judged<B>(req: &mut Request<B>, normalized: &str) {
    let sent = req.uri().path();
    let mut path = judged_path(sent, normalized);
    if path == sent {
        return;
    }
    if let Some(query) = req.uri().query() {
        path.push('?');
        path.push_str(query);
    }
    let mut uri = req.uri().clone().into_parts();
    uri.path_and_query = path.parse().ok();
    if let Ok(uri) = http::Uri::from_parts(uri) {
        *req.uri_mut() = uri;
    }
}

/// Removes what the request's peer may not carry on to the service (see
/// [`TenantExtractor::remove_untrusted`]): on every path that forwards a
/// request whose tenant was not judged trusted.
fn remove_untrusted<T: TenantExtractor, B>(tenant: &T, req: &mut Request<B>) {
    let peer = req.extensions().get::<PeerAddr>().copied();
    tenant.remove_untrusted(req.headers_mut(), peer.as_ref());
}

/// Forwards `req` as it is and labels the answer with `decision`. The
/// request goes to the inner service at once, not when the future is
/// first polled: held in the future, it was one more copy of the request
/// (and of the future around it) on every request.
fn pass_through<I, ReqBody, ResBody>(
    mut inner: I,
    req: Request<ReqBody>,
    decision: Decision,
) -> impl Future<Output = Answer<ResBody, I::Error>>
where
    I: Service<Request<ReqBody>, Response = Response<ResBody>>,
{
    let called = inner.call(req);
    async move {
        Ok(with_decision(
            called.await?.map(ResponseBody::inner),
            decision,
        ))
    }
}

/// Runs the work as the record's owner, detached from the caller.
async fn execute<I, S, ReqBody, ResBody>(
    mut inner: I,
    req: Request<ReqBody>,
    mut guard: Guard<S>,
    policy: Arc<RoutePolicy>,
    handoff: Option<Handoff<S>>,
) -> Answer<ResBody, I::Error>
where
    I: Service<Request<ReqBody>, Response = Response<ResBody>> + Send + 'static,
    I::Future: Send + 'static,
    I::Error: Send + 'static,
    S: Store,
    ReqBody: Send + 'static,
    ResBody: Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    guard.keep_alive();
    let mut req = req;
    req.extensions_mut().insert(Reserved {
        scope: guard.scope().clone(),
        key: guard.key().clone(),
        lease: *guard.lease(),
    });
    let work = inner.call(req);
    {
        let (scope, key) = (guard.scope().clone(), guard.key().clone());
        let resp = match work.await {
            Ok(resp) => resp,
            Err(err) => {
                unknown(guard, "inner service failed", handoff).await;
                return Err(err);
            }
        };
        let (mut parts, body) = resp.into_parts();
        // The layer's own marker, never the upstream's to set.
        parts.headers.remove(NOT_RETAINED);
        // What the inner service knows of the side effect decides first;
        // otherwise the answer's status does, by the route's policy.
        let (resolution, cause) = match parts.extensions.get::<UpstreamOutcome>() {
            Some(UpstreamOutcome::NotSent) => (
                idem::Resolution::Release,
                "upstream not reached; key released",
            ),
            Some(UpstreamOutcome::MaybeSent) => (
                idem::Resolution::Unknown,
                "upstream failed after the request was sent",
            ),
            Some(UpstreamOutcome::Recorded) => {
                guard.recorded_elsewhere();
                return Ok(with_decision(
                    Response::from_parts(parts, ResponseBody::inner(body)),
                    Decision::Executed,
                ));
            }
            None => match policy.engine.resolution_for(parts.status.as_u16()) {
                idem::Resolution::Release => {
                    (idem::Resolution::Release, "transient status; key released")
                }
                idem::Resolution::Unknown => (
                    idem::Resolution::Unknown,
                    "the upstream's status does not prove the request was not executed",
                ),
                recorded => (recorded, ""),
            },
        };
        match resolution {
            idem::Resolution::Release => {
                trace::record(trace::RECORD_STATE, "released");
                log_recording(&scope, &key, cause, guard.release().await);
                return Ok(with_decision(
                    Response::from_parts(parts, ResponseBody::inner(body)),
                    Decision::Executed,
                ));
            }
            idem::Resolution::Unknown => {
                return Ok(held_as_unknown(parts, body, guard, handoff, cause).await);
            }
            idem::Resolution::Complete | idem::Resolution::Fail => {}
        }
        let streamed = is_streamed(&parts.headers);
        let kept = if streamed {
            Kept::TooLarge {
                prefix: Bytes::new(),
                rest: Box::pin(body),
            }
        } else {
            keep_response(body, policy.max_stored_response).await
        };
        let stored_headers = storable_headers(&parts.headers, &policy.unstored_headers);
        let status = parts.status.as_u16();
        trace::record(
            trace::RECORD_STATE,
            match policy.engine.resolution_for(status) {
                idem::Resolution::Fail => "failed",
                _ => "completed",
            },
        );
        match kept {
            Kept::Whole(bytes) => {
                let stored = StoredResponse {
                    status,
                    headers: stored_headers,
                    body: bytes.clone(),
                };
                if let Err(err) = guard.finish(stored).await {
                    tracing::error!(reason = "idempotency_record_failed", tenant = scope.tenant(), operation = scope.operation(), %key, %err);
                }
                tracing::info!(reason = "idempotency_executed", tenant = scope.tenant(), operation = scope.operation(), %key, status, resolution = ?policy.engine.resolution_for(status));
                Ok(with_decision(
                    Response::from_parts(parts, ResponseBody::full(bytes)),
                    Decision::Executed,
                ))
            }
            Kept::TooLarge { prefix, rest } => {
                let mut headers = stored_headers;
                headers.push((NOT_RETAINED.as_str().to_owned(), Bytes::from_static(b"1")));
                let tombstone = StoredResponse {
                    status,
                    headers,
                    body: Bytes::new(),
                };
                if let Err(err) = guard.finish(tombstone).await {
                    tracing::error!(reason = "idempotency_record_failed", tenant = scope.tenant(), operation = scope.operation(), %key, %err);
                }
                tracing::info!(reason = "idempotency_body_not_retained", tenant = scope.tenant(), operation = scope.operation(), %key, status, streamed);
                let body = ResponseBody::Prefixed {
                    prefix: (!prefix.is_empty()).then_some(prefix),
                    rest,
                };
                Ok(with_decision(
                    Response::from_parts(parts, body),
                    Decision::Executed,
                ))
            }
            Kept::Broken(err) => {
                tracing::warn!(reason = "idempotency_outcome_unknown", tenant = scope.tenant(), operation = scope.operation(), %key, %err, "response body broke off");
                let first_lookup = unknown(guard, "response body broke off", handoff).await;
                let mut answer = Problem::new(
                    ProblemKind::UpstreamBroken,
                    "the response broke off after the request was processed; its outcome is unknown",
                );
                if let Some(after) = first_lookup {
                    answer = answer.with_retry_after(after);
                }
                Ok(problem(answer, Decision::OutcomeUnknown))
            }
        }
    }
}

/// What an attempt needs to hand its record to the reconciliation when its
/// outcome turns out unknown, or what a request that met a held record
/// tells it: the route's lookup, with the tenant's credentials and the
/// concrete path's parameters.
struct Handoff<S> {
    reconciliation: Reconciliation<S, HttpLookup>,
    credentials: HeaderMap,
    params: Vec<(String, String)>,
}

impl<S: Store> Handoff<S> {
    /// Keeps this request's lookup for the record.
    fn remember(&self, scope: &Scope, key: &IdempotencyKey) {
        self.reconciliation
            .reconciler()
            .remember(scope, key, self.credentials.clone(), |name| {
                self.params
                    .iter()
                    .find(|(n, _)| n == name)
                    .map(|(_, v)| v.clone())
            });
    }
}

impl<S: Store, T: TenantExtractor> Shared<S, T> {
    /// The hand-off for a request of route `route`, if its record can be
    /// reconciled.
    fn handoff(
        &self,
        route: usize,
        parts: &http::request::Parts,
        path: &str,
        scope: &Scope,
    ) -> Option<Handoff<S>> {
        let reconciliation = self.reconciliation.as_ref()?;
        if !reconciliation.reconciler().covers(scope.operation()) {
            return None;
        }
        let params = self
            .routes
            .pattern(route)
            .map(|p| {
                p.param_names()
                    .filter_map(|n| Some((n.to_owned(), p.param(n, path)?.to_owned())))
                    .collect()
            })
            .unwrap_or_default();
        Some(Handoff {
            reconciliation: reconciliation.clone(),
            credentials: self.tenant.credentials(parts),
            params,
        })
    }
}

/// An answer that does not prove the request was not executed: the record
/// is held as an unknown outcome and the answer goes to the client as it
/// came, with `Retry-After` when a lookup will settle the record.
async fn held_as_unknown<S: Store, B>(
    mut parts: http::response::Parts,
    body: B,
    guard: Guard<S>,
    handoff: Option<Handoff<S>>,
    cause: &str,
) -> Response<ResponseBody<B>> {
    tracing::warn!(reason = "idempotency_outcome_unknown", tenant = guard.scope().tenant(), operation = guard.scope().operation(), key = %guard.key(), status = parts.status.as_u16(), cause);
    trace::record(trace::RECORD_STATE, "outcome_unknown");
    if let Some(after) = unknown(guard, cause, handoff).await {
        parts.headers.insert(
            header::RETRY_AFTER,
            HeaderValue::from(retry_after_secs(after)),
        );
    }
    with_decision(
        Response::from_parts(parts, ResponseBody::inner(body)),
        Decision::OutcomeUnknown,
    )
}

/// Marks the attempt's outcome unknown; with a hand-off, the record goes to
/// the reconciliation (settled with this attempt's lease). Returns when
/// the first lookup is due, if one will be made.
async fn unknown<S: Store>(
    guard: Guard<S>,
    cause: &str,
    handoff: Option<Handoff<S>>,
) -> Option<Duration> {
    let (scope, key, lease) = (guard.scope().clone(), guard.key().clone(), *guard.lease());
    let marked = guard.unknown(cause).await;
    let ok = marked.is_ok();
    log_recording(&scope, &key, "outcome unknown", marked);
    let handoff = handoff.filter(|_| ok)?;
    handoff.remember(&scope, &key);
    let first = handoff.reconciliation.hold(&scope, &key, lease);
    if first.is_none() {
        handoff.reconciliation.reconciler().forget(&scope, &key);
    }
    first
}

/// The answer to a request that met a held record (its outcome unknown,
/// nobody running it): being reconciled (when the next lookup is due),
/// about to be run again (`on_lease_expiry = "retry"`), or held for an
/// operator.
fn held<S: Store>(
    handoff: Option<Handoff<S>>,
    policy: &RoutePolicy,
    scope: &Scope,
    key: &IdempotencyKey,
    retry_after: Duration,
) -> Problem {
    if let Some(handoff) = handoff {
        handoff.remember(scope, key);
        let next = handoff.reconciliation.held(scope, key);
        if next.is_none() {
            handoff.reconciliation.reconciler().forget(scope, key);
        }
        if let Some(next) = next {
            return Problem::new(
                ProblemKind::OutcomeReconciling,
                "an earlier attempt with this key may have taken effect; the upstream is being asked what became of it: retry after the indicated delay to get its answer",
            )
            .with_retry_after(next);
        }
    } else if policy.engine.on_lease_expiry == LeaseExpiry::Retry {
        return Problem::new(
            ProblemKind::InProgress,
            "an earlier attempt with this key may have taken effect; this route runs it again with the same key once its lease lapses (on_lease_expiry = \"retry\")",
        )
        .with_retry_after(retry_after);
    }
    tracing::info!(reason = "idempotency_held", tenant = scope.tenant(), operation = scope.operation(), %key, "a held record: nothing reconciles it automatically");
    Problem::new(
        ProblemKind::OutcomeHeld,
        "an earlier attempt with this key may have taken effect and nothing can tell automatically whether it did; the request is held for an operator and will not run again. Retrying will not change the answer until it is resolved",
    )
}

fn log_recording(
    scope: &Scope,
    key: &idem::IdempotencyKey,
    what: &str,
    result: Result<(), idem::StoreError>,
) {
    if let Err(err) = result {
        tracing::error!(reason = "idempotency_record_failed", tenant = scope.tenant(), operation = scope.operation(), %key, %err, what);
    }
}

/// Server-sent events and the like are never buffered for storage.
fn is_streamed(headers: &HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|ct| {
            ct.trim_start()
                .to_ascii_lowercase()
                .starts_with("text/event-stream")
        })
}

/// Rebuilds the original answer from the store.
fn replayed<B>(replay: Replay) -> Response<ResponseBody<B>> {
    let StoredResponse {
        status,
        headers,
        body,
    } = replay.response;
    let status = StatusCode::from_u16(status).unwrap_or(StatusCode::OK);
    let tombstone = headers.iter().any(|(n, _)| n == NOT_RETAINED.as_str());
    let mut resp = if tombstone {
        let (mut parts, body) = Problem::new(
            ProblemKind::ResponseNotRetained,
            "this request was already processed; its original response body was too large (or streamed) to keep",
        )
        .with_status(status)
        .to_response()
        .into_parts();
        for (name, value) in &headers {
            if name == NOT_RETAINED.as_str() || name == header::CONTENT_TYPE.as_str() {
                continue;
            }
            append(&mut parts.headers, name, value);
        }
        Response::from_parts(parts, ResponseBody::Full { body })
    } else {
        let mut resp = Response::new(ResponseBody::full(body));
        *resp.status_mut() = status;
        for (name, value) in &headers {
            append(resp.headers_mut(), name, value);
        }
        resp
    };
    resp.headers_mut()
        .insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    resp
}

/// Adds a stored header to a replay, through the one gate of what is
/// replayable: a record written by hand, or by an older gateway, cannot
/// frame the replay nor hand out a session.
fn append(headers: &mut HeaderMap, name: &str, value: &Bytes) {
    if let (Ok(name), Ok(value)) = (
        HeaderName::from_bytes(name.as_bytes()),
        HeaderValue::from_bytes(value),
    ) && replayable_name(&name)
    {
        headers.append(name, value);
    }
}

/// How lookups reach `inner`: a fresh clone per lookup, readied, called;
/// its answer read up to [`LOOKUP_BODY_LIMIT`]. An answer the inner
/// service made because its upstream failed is an error, not a verdict.
fn lookup_sender<I, ReqBody, ResBody>(inner: I) -> Sender
where
    I: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone + Send + 'static,
    I::Future: Send + 'static,
    ReqBody: From<Bytes> + Send + 'static,
    ResBody: Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    let inner = std::sync::Mutex::new(inner);
    Arc::new(move |lookup: LookupRequest| {
        let mut svc = inner.lock().unwrap_or_else(|p| p.into_inner()).clone();
        Box::pin(async move {
            let mut req = Request::new(ReqBody::from(Bytes::new()));
            *req.method_mut() = lookup.method;
            *req.uri_mut() = lookup.uri;
            *req.headers_mut() = lookup.headers;
            std::future::poll_fn(|cx| svc.poll_ready(cx))
                .await
                .map_err(|_| BoxError::from("the service is not ready for the lookup"))?;
            let resp = svc
                .call(req)
                .await
                .map_err(|_| BoxError::from("the service failed the lookup"))?;
            let (parts, body) = resp.into_parts();
            if parts.extensions.get::<UpstreamOutcome>().is_some() {
                return Err(format!(
                    "the lookup got no answer from the upstream ({})",
                    parts.status
                )
                .into());
            }
            match keep_response(body, LOOKUP_BODY_LIMIT).await {
                Kept::Whole(bytes) => Ok((parts.status, parts.headers, bytes)),
                Kept::TooLarge { .. } => Err("the lookup's answer is too large to record".into()),
                Kept::Broken(err) => Err(err),
            }
        })
    })
}

/// The largest lookup answer recorded as a held record's answer.
pub const LOOKUP_BODY_LIMIT: usize = 1024 * 1024;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stored_headers_drop_hop_by_hop_cookies_and_connection_named() {
        let mut h = HeaderMap::new();
        h.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        h.insert(header::CONTENT_LENGTH, HeaderValue::from_static("10"));
        h.insert(
            header::CONNECTION,
            HeaderValue::from_static("keep-alive, x-private"),
        );
        h.insert("x-private", HeaderValue::from_static("secret"));
        h.insert(
            header::TRANSFER_ENCODING,
            HeaderValue::from_static("chunked"),
        );
        h.insert(header::SET_COOKIE, HeaderValue::from_static("session=1"));
        h.insert(header::LOCATION, HeaderValue::from_static("/v1/payments/1"));
        let kept = storable_headers(&h, &[header::SET_COOKIE]);
        let names: Vec<&str> = kept.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["content-type", "location"]);
        // The setting adds to what is never stored: a cookie stays out even
        // when a route lists other headers, and so does a forged marker.
        h.insert(NOT_RETAINED, HeaderValue::from_static("1"));
        h.insert("x-secret", HeaderValue::from_static("s"));
        let kept = storable_headers(&h, &[HeaderName::from_static("x-secret")]);
        let names: Vec<&str> = kept.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["content-type", "location"]);
        assert!(
            storable_headers(&h, &[])
                .iter()
                .all(|(n, _)| n != "set-cookie")
        );
    }

    #[test]
    fn replay_marks_and_restores() {
        let replay = Replay {
            state: idem::RecordState::Completed,
            response: StoredResponse::new(201, "made").with_header("location", "/x/1"),
            resource_id: None,
        };
        let resp: Response<ResponseBody<http_body_util::Empty<Bytes>>> = replayed(replay);
        assert_eq!(resp.status(), 201);
        assert_eq!(resp.headers()["location"], "/x/1");
        assert_eq!(resp.headers()[IDEMPOTENT_REPLAYED], "true");
    }

    /// A record written by hand (or by a store writer that skipped the
    /// gate) cannot frame its replay, hand out a session, or mark itself:
    /// every stored header goes through the one gate again on the way out.
    #[test]
    fn a_replay_carries_no_framing_session_or_marker_headers_whatever_was_stored() {
        let mut stored = StoredResponse::new(201, "made").with_header("location", "/x/1");
        for (name, value) in [
            ("Content-Length", "100"),
            ("transfer-encoding", "chunked"),
            ("connection", "close"),
            ("proxy-connection", "keep-alive"),
            ("set-cookie", "s=alice"),
            ("set-cookie2", "s=alice"),
            ("authentication-info", "nextnonce=1"),
            ("proxy-authentication-info", "nextnonce=1"),
            ("idempotent-replayed", "false"),
            ("idempotency-status", "unprotected"),
        ] {
            stored = stored.with_header(name, value);
        }
        let replay = Replay {
            state: idem::RecordState::Completed,
            response: stored,
            resource_id: None,
        };
        let resp: Response<ResponseBody<http_body_util::Empty<Bytes>>> = replayed(replay);
        let names: Vec<_> = resp.headers().keys().map(|n| n.as_str()).collect();
        assert_eq!(names, ["location", "idempotent-replayed"], "{names:?}");
        assert_eq!(resp.headers()[IDEMPOTENT_REPLAYED], "true");
    }

    #[test]
    fn tombstone_replays_as_problem_with_original_status() {
        let replay = Replay {
            state: idem::RecordState::Completed,
            response: StoredResponse::new(200, "")
                .with_header("content-type", "text/plain")
                .with_header("x-request-id", "abc")
                .with_header(NOT_RETAINED.as_str(), "1"),
            resource_id: None,
        };
        let resp: Response<ResponseBody<http_body_util::Empty<Bytes>>> = replayed(replay);
        assert_eq!(resp.status(), 200);
        assert_eq!(resp.headers()[header::CONTENT_TYPE], crate::PROBLEM_JSON);
        assert_eq!(resp.headers()["x-request-id"], "abc");
        assert!(resp.headers().get(NOT_RETAINED).is_none());
    }
}
