//! `HttpLookup`: held records settled by asking the upstream, through the
//! lookup each route names ([`Lookup`]).

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Method, StatusCode, Uri};
use idem::reconcile::{Reconciled, Reconciler, Schedule, Settled};
use idem::store::BoxError;
use idem::{FinalOutcome, IdempotencyKey, Record, Scope, StoredResponse, Verdict};

use crate::headers::storable_headers;
use crate::lookup::Lookup;
use crate::metrics::ReconcileMetrics;
use crate::request::IDEMPOTENCY_KEY;
use crate::routes::Routes;

/// What a lookup is sent as: its URI and headers (the key and the tenant's
/// credentials), made from the request that left or met the held record.
#[derive(Debug, Clone)]
pub(crate) struct LookupRequest {
    pub(crate) method: Method,
    pub(crate) uri: Uri,
    pub(crate) headers: HeaderMap,
}

/// Sends a lookup through the inner service; answers its status, headers
/// and body (an error when the service could not reach its upstream).
pub(crate) type Sender = Arc<
    dyn Fn(
            LookupRequest,
        )
            -> Pin<Box<dyn Future<Output = Result<(StatusCode, HeaderMap, Bytes), BoxError>> + Send>>
        + Send
        + Sync,
>;

/// One route's lookup with what recording its answer needs.
#[derive(Debug)]
struct RouteLookup {
    lookup: Arc<Lookup>,
    retention: Duration,
    unstored: Vec<HeaderName>,
    /// The header the lookup carries the key in: the route's first
    /// `key_header` (`Idempotency-Key` when it reads only the body).
    key_header: HeaderName,
}

type RecordId = (String, String, String);

fn id_of(scope: &Scope, key: &IdempotencyKey) -> RecordId {
    (
        scope.tenant().to_owned(),
        scope.operation().to_owned(),
        key.as_str().to_owned(),
    )
}

/// The layer's [`Reconciler`]: the routes' lookups, sent through the inner
/// service.
pub(crate) struct HttpLookup {
    routes: HashMap<String, RouteLookup>,
    /// Whether a lookup must carry the tenant's credentials: without them
    /// (a record found by a scan, its client not back yet) it waits.
    needs_credentials: bool,
    send: OnceLock<Sender>,
    /// Lookups made from the requests that left or met held records; a
    /// record found without one waits for its client's retry if it needs
    /// credentials or route parameters.
    requests: Mutex<HashMap<RecordId, LookupRequest>>,
    metrics: ReconcileMetrics,
}

impl std::fmt::Debug for HttpLookup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HttpLookup")
            .field("routes", &self.routes.keys().collect::<Vec<_>>())
            .field("connected", &self.send.get().is_some())
            .finish_non_exhaustive()
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl HttpLookup {
    /// The lookups of `routes`, or `None` when no route has one.
    pub(crate) fn of(routes: &Routes, needs_credentials: bool) -> Option<Self> {
        let routes: HashMap<String, RouteLookup> = routes
            .configured()
            .filter_map(|(operation, policy)| {
                let lookup = policy.lookup.clone()?;
                Some((
                    operation.to_owned(),
                    RouteLookup {
                        lookup,
                        retention: policy.engine.retention,
                        unstored: policy.unstored_headers.clone(),
                        key_header: policy
                            .key_headers
                            .first()
                            .unwrap_or(&IDEMPOTENCY_KEY)
                            .clone(),
                    },
                ))
            })
            .collect();
        (!routes.is_empty()).then(|| Self {
            metrics: ReconcileMetrics::new(routes.keys().map(String::as_str)),
            routes,
            needs_credentials,
            send: OnceLock::new(),
            requests: Mutex::new(HashMap::new()),
        })
    }

    /// Whether records of `operation` are looked up.
    pub(crate) fn covers(&self, operation: &str) -> bool {
        self.routes.contains_key(operation)
    }

    /// Whether lookups can reach the inner service yet.
    pub(crate) fn connected(&self) -> bool {
        self.send.get().is_some()
    }

    /// Sets how lookups reach the inner service (once; later calls are
    /// ignored).
    pub(crate) fn connect(&self, make: impl FnOnce() -> Sender) {
        if self.send.get().is_none() {
            let _ = self.send.set(make());
        }
    }

    /// Keeps the lookup for this record, made from a request of its own
    /// client: the key, the tenant's `credentials` and the concrete path's
    /// parameters.
    pub(crate) fn remember(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        credentials: HeaderMap,
        param: impl Fn(&str) -> Option<String>,
    ) {
        let Some(route) = self.routes.get(scope.operation()) else {
            return;
        };
        let values: Vec<(String, String)> = route
            .lookup
            .params()
            .filter_map(|name| Some((name.to_owned(), param(name)?)))
            .collect();
        let Some(uri) = route.lookup.uri(key, |name| {
            values
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, v)| v.as_str())
        }) else {
            return;
        };
        let mut requests = lock(&self.requests);
        if requests.len() >= idem::reconcile::MAX_FOLLOWED {
            return;
        }
        requests.insert(
            id_of(scope, key),
            LookupRequest {
                method: route.lookup.method().clone(),
                uri,
                headers: with_key(credentials, &route.key_header, key),
            },
        );
    }

    /// The lookup for a record nobody brought one for: only when it needs
    /// neither credentials nor route parameters.
    fn request_for(&self, record: &Record, route: &RouteLookup) -> Option<LookupRequest> {
        if let Some(req) = lock(&self.requests).get(&id_of(&record.scope, &record.key)) {
            return Some(req.clone());
        }
        if self.needs_credentials || route.lookup.params().next().is_some() {
            return None;
        }
        Some(LookupRequest {
            method: route.lookup.method().clone(),
            uri: route.lookup.uri(&record.key, |_| None)?,
            headers: with_key(HeaderMap::new(), &route.key_header, &record.key),
        })
    }
}

fn with_key(mut headers: HeaderMap, name: &HeaderName, key: &IdempotencyKey) -> HeaderMap {
    if let Ok(v) = HeaderValue::from_str(key.as_str()) {
        headers.insert(name.clone(), v);
    }
    headers
}

impl Reconciler for HttpLookup {
    async fn reconcile(&self, record: &Record) -> Result<Reconciled, BoxError> {
        let Some(route) = self.routes.get(record.scope.operation()) else {
            return Ok(Reconciled::Unknown);
        };
        let (Some(send), Some(req)) = (self.send.get(), self.request_for(record, route)) else {
            tracing::debug!(reason = "idempotency_reconcile_waiting", tenant = record.scope.tenant(), operation = record.scope.operation(), key = %record.key, "no lookup yet: waiting for the client's retry to bring its credentials");
            return Ok(Reconciled::Unknown);
        };
        let (status, headers, body) = send(req).await?;
        if status == StatusCode::NOT_FOUND {
            return Ok(Reconciled::NotDone);
        }
        if !status.is_success() {
            return Err(format!(
                "the lookup {} {} answered {status}",
                route.lookup.method(),
                route.lookup.path()
            )
            .into());
        }
        // An upstream that echoes the key says which record it answered
        // about: an answer about another key never settles this one.
        if let Some(echoed) = headers.get(&route.key_header)
            && echoed.as_bytes() != record.key.as_str().as_bytes()
        {
            return Err(format!(
                "the lookup {} {} answered about another key ({}: {echoed:?})",
                route.lookup.method(),
                route.lookup.path(),
                route.key_header
            )
            .into());
        }
        let status = route.lookup.status().unwrap_or(status);
        Ok(Reconciled::Done(FinalOutcome {
            verdict: Verdict::Completed,
            response: StoredResponse {
                status: status.as_u16(),
                headers: storable_headers(&headers, &route.unstored),
                body,
            },
            resource_id: None,
            error_code: None,
            retention: route.retention,
        }))
    }

    fn schedule(&self, scope: &Scope) -> Option<Schedule> {
        self.routes
            .get(scope.operation())
            .map(|r| *r.lookup.schedule())
    }

    fn settled(&self, record: &Record, how: Settled) {
        // The route label is the operation (a configured route's).
        self.metrics.settled(record.scope.operation(), how);
    }

    fn forget(&self, scope: &Scope, key: &IdempotencyKey) {
        lock(&self.requests).remove(&id_of(scope, key));
    }
}
