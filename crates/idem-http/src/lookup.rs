//! Lookups: how the layer asks the service behind it what became of a held
//! record, so that nothing has to run twice.
//!
//! A record is held when its attempt may have taken effect and nobody runs
//! it: the upstream timed out or broke off after the request was sent, or
//! the process that ran it died. A route that names a [`Lookup`] has such
//! records settled in the background ([`idem::reconcile`]): the layer sends
//! the lookup (say `GET /v1/payments/by-key/{key}`) to the inner service
//! with the client's `Idempotency-Key` and the tenant's credentials, and
//!
//! * `404` means it never happened: the key is released and the client's
//!   retry runs the work (believed only after the schedule's settle time);
//! * `2xx` means it happened: the record is completed with that answer (its
//!   status replaced by [`Lookup::with_status`] if set), and the client's
//!   retry gets it as a replay;
//! * anything else leaves the record held, to be asked again with backoff.
//!
//! ```
//! use std::time::Duration;
//! use http::{Method, StatusCode};
//! use idem::reconcile::Schedule;
//! use idem_http::{Lookup, RoutePolicy, Routes};
//!
//! let lookup = Lookup::new(Method::GET, "/v1/payments/by-key/{key}")?
//!     .with_status(StatusCode::CREATED)
//!     .with_schedule(Schedule::default().with_settle(Duration::from_secs(10)));
//! let routes = Routes::default()
//!     .route(Method::POST, "/v1/payments", RoutePolicy::default().with_lookup(lookup))?;
//! # Ok::<(), idem_http::PatternError>(())
//! ```

use std::collections::HashMap;
use std::fmt::Write as _;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Method, StatusCode, Uri};
use idem::reconcile::{Reconciled, Reconciler, Schedule, Settled};
use idem::store::BoxError;
use idem::{FinalOutcome, IdempotencyKey, Record, Scope, StoredResponse, Verdict};

use crate::routes::{PatternError, Routes};

/// A route's lookup on the inner service; see the [module docs](self).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lookup {
    method: Method,
    path: String,
    parts: Vec<Part>,
    status: Option<StatusCode>,
    schedule: Schedule,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Part {
    Text(String),
    Key,
    Param(String),
}

impl Lookup {
    /// A lookup by `method` at `path`, where `{key}` stands for the
    /// client's key (percent-encoded) and `{name}` for the value of the
    /// route's own path parameter `name` (the route refuses a name its
    /// pattern lacks). A query may follow: `/v1/charges?key={key}`.
    pub fn new(method: Method, path: &str) -> Result<Self, PatternError> {
        let err = |reason| PatternError {
            pattern: path.to_owned(),
            reason,
        };
        if !path.starts_with('/') {
            return Err(err("must start with '/'"));
        }
        let mut parts = Vec::new();
        let mut rest = path;
        while let Some(open) = rest.find(['{', '}']) {
            if rest.as_bytes()[open] == b'}' {
                return Err(err("a '}' without its '{'"));
            }
            let close = rest[open..]
                .find('}')
                .ok_or_else(|| err("a '{' without its '}'"))?
                + open;
            let name = &rest[open + 1..close];
            if name.is_empty() || !name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_') {
                return Err(err("a placeholder is {key} or {name} of a path parameter"));
            }
            if open > 0 {
                parts.push(Part::Text(rest[..open].to_owned()));
            }
            parts.push(if name == "key" {
                Part::Key
            } else {
                Part::Param(name.to_owned())
            });
            rest = &rest[close + 1..];
        }
        if !rest.is_empty() {
            parts.push(Part::Text(rest.to_owned()));
        }
        if !parts.contains(&Part::Key) {
            return Err(err("the lookup must name the record by {key}"));
        }
        Ok(Self {
            method,
            path: path.to_owned(),
            parts,
            status: None,
            schedule: Schedule::default(),
        })
    }

    /// Records a `2xx` answer under this status instead of the lookup's
    /// own (e.g. `201`, what the original request would have answered).
    pub fn with_status(mut self, status: StatusCode) -> Self {
        self.status = Some(status);
        self
    }

    /// Sets when and for how long held records are asked about.
    pub fn with_schedule(mut self, schedule: Schedule) -> Self {
        self.schedule = schedule;
        self
    }

    /// The method.
    pub fn method(&self) -> &Method {
        &self.method
    }

    /// The path template as written.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// The status a `2xx` answer is recorded under, if set.
    pub fn status(&self) -> Option<StatusCode> {
        self.status
    }

    /// The schedule.
    pub fn schedule(&self) -> &Schedule {
        &self.schedule
    }

    /// The route parameters the path uses (besides `key`).
    pub fn params(&self) -> impl Iterator<Item = &str> {
        self.parts.iter().filter_map(|p| match p {
            Part::Param(name) => Some(name.as_str()),
            _ => None,
        })
    }

    /// The lookup's URI for `key`, taking route parameters from `param`;
    /// `None` when one is missing.
    fn uri<'a>(
        &self,
        key: &IdempotencyKey,
        param: impl Fn(&str) -> Option<&'a str>,
    ) -> Option<Uri> {
        let mut out = String::with_capacity(self.path.len() + key.as_str().len());
        for part in &self.parts {
            match part {
                Part::Text(text) => out.push_str(text),
                Part::Key => encode(&mut out, key.as_str()),
                Part::Param(name) => out.push_str(param(name)?),
            }
        }
        out.parse().ok()
    }
}

/// Percent-encodes all but the unreserved characters (RFC 3986 §2.3).
fn encode(out: &mut String, text: &str) {
    for b in text.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(char::from(b));
        } else {
            let _ = write!(out, "%{b:02X}");
        }
    }
}

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
    metrics: crate::metrics::ReconcileMetrics,
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
                    },
                ))
            })
            .collect();
        (!routes.is_empty()).then(|| Self {
            metrics: crate::metrics::ReconcileMetrics::new(routes.keys().map(String::as_str)),
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
                headers: with_key(credentials, key),
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
            headers: with_key(HeaderMap::new(), &record.key),
        })
    }
}

fn with_key(mut headers: HeaderMap, key: &IdempotencyKey) -> HeaderMap {
    if let Ok(v) = HeaderValue::from_str(key.as_str()) {
        headers.insert(crate::request::IDEMPOTENCY_KEY, v);
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
        let status = route.lookup.status().unwrap_or(status);
        Ok(Reconciled::Done(FinalOutcome {
            verdict: Verdict::Completed,
            response: StoredResponse {
                status: status.as_u16(),
                headers: crate::layer::storable_headers(&headers, &route.unstored),
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn templates() {
        let key: IdempotencyKey = "k/1?%~".parse().expect("key");
        let l = Lookup::new(Method::GET, "/v1/orders/{id}/by-key/{key}?x=1").expect("valid");
        assert_eq!(l.params().collect::<Vec<_>>(), ["id"]);
        let uri = l
            .uri(&key, |n| (n == "id").then_some("ord_7"))
            .expect("uri");
        assert_eq!(uri.path(), "/v1/orders/ord_7/by-key/k%2F1%3F%25~");
        assert_eq!(uri.query(), Some("x=1"));
        assert!(l.uri(&key, |_| None).is_none(), "a missing parameter");
        for bad in [
            "v1/{key}",
            "/v1/{key",
            "/v1/}{key}",
            "/v1/{}",
            "/v1/{a-b}/{key}",
            "/v1/payments",
        ] {
            assert!(Lookup::new(Method::GET, bad).is_err(), "{bad}");
        }
    }
}
