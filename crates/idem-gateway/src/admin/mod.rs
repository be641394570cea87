//! The admin listener: health, readiness, Prometheus metrics, the records
//! API and the live dashboard.
//!
//! | route | what |
//! |---|---|
//! | `GET /healthz` | `ok` while the process serves (never needs the token) |
//! | `GET /readyz` | 200 when the store answers, 503 with the reason otherwise |
//! | `GET /metrics` | Prometheus text format |
//! | `GET /api/v1/records?state=&older_than=&tenant=&limit=&after=` | a page of records, oldest first |
//! | `GET /api/v1/records/{tenant}/{operation}/{key}[?body=true]` | one record |
//! | `POST …/{key}/release` | free a processing record's key |
//! | `POST …/{key}/resolve` | record a final answer for a processing record |
//! | `DELETE …/{key}` | delete a record in any state |
//! | `GET /dashboard/` | the live dashboard (static files; its data calls need the token) |
//!
//! With an admin token configured every route except `/healthz` and the
//! dashboard's static files needs `Authorization: Bearer <token>`; anything
//! else gets a 401 problem that discloses nothing. Path segments are
//! percent-encoded (`POST%20%2Fv1%2Fpayments`). Errors are RFC 9457
//! problems; the actions go through [`idem::operator`], so they are fenced
//! against owners recording at the same moment.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, UNIX_EPOCH};

use axum::Router;
use axum::body::Bytes;
use axum::extract::{FromRequestParts, Path, Query, Request, State};
use axum::http::request::Parts;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use idem::fingerprint::{from_hex, to_hex};
use idem::operator::{self, OperatorError};
use idem::store::Cursor;
use idem::{
    FinalOutcome, IdempotencyKey, ListFilter, ListRecords, Purge, Record, RecordState, Scope,
    Store, StoreError, StoredResponse, Timestamp, Verdict,
};
use idem_http::{Problem, ProblemKind};
use serde::{Deserialize, Serialize};

use crate::server::error_chain;
use crate::store::GatewayStore;

/// Most records one list call returns.
pub const MAX_PAGE: usize = 1000;
/// Records per page when `limit` is not given.
pub const DEFAULT_PAGE: usize = 100;

/// What the admin routes share.
#[derive(Debug, Clone)]
pub struct AdminState {
    /// The gateway's store.
    pub store: GatewayStore,
    /// The bearer token, if one is configured.
    pub token: Option<Arc<str>>,
    /// Retention of records resolved by hand when the request names none.
    pub default_retention: Duration,
}

/// The admin router.
pub fn router(state: AdminState) -> Router {
    let records = "/api/v1/records/{tenant}/{operation}/{key}";
    let protected = Router::new()
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .route("/api/v1/records", get(list))
        .route(records, get(show).delete(delete))
        .route(&format!("{records}/release"), axum::routing::post(release))
        .route(&format!("{records}/resolve"), axum::routing::post(resolve))
        .fallback(not_found);
    // Records carry stored answers: never kept by a cache on the way.
    let protected = guarded(protected, state.token.clone()).layer(axum::middleware::map_response(
        |mut resp: Response| async move {
            resp.headers_mut()
                .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
            resp
        },
    ));
    Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/dashboard", get(|| async { redirect("/dashboard/") }))
        .route("/dashboard/", get(|| async { asset("index.html") }))
        .route(
            "/dashboard/{file}",
            get(|file: Result<Path<String>, _>| async move {
                match file {
                    Ok(Path(file)) => asset(&file),
                    // Not even a file name (bad percent-encoding).
                    Err(_) => not_found().await,
                }
            }),
        )
        .merge(protected)
        .with_state(state)
}

/// A problem+json response.
fn problem(kind: ProblemKind, detail: impl Into<String>) -> Response {
    let p = Problem::new(kind, detail);
    p.to_response().into_response()
}

fn store_problem(err: &StoreError) -> Response {
    problem(ProblemKind::StoreUnavailable, error_chain(err))
}

fn redirect(to: &'static str) -> Response {
    (
        StatusCode::PERMANENT_REDIRECT,
        [(header::LOCATION, HeaderValue::from_static(to))],
    )
        .into_response()
}

async fn not_found() -> Response {
    problem(ProblemKind::NotFound, "no such admin route")
}

/// Compares in time independent of where the first difference is.
fn same_secret(given: &[u8], expected: &[u8]) -> bool {
    given.len() == expected.len()
        && given
            .iter()
            .zip(expected)
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0
}

/// Whether `host` (a `Host` or `Origin` authority, port allowed) names
/// this machine's loopback.
fn is_loopback_host(host: &str) -> bool {
    let host = host.trim();
    if let Ok(ip) = host.parse::<std::net::IpAddr>() {
        return ip.is_loopback();
    }
    let name = if let Some(rest) = host.strip_prefix('[') {
        rest.split(']').next().unwrap_or("")
    } else {
        host.rsplit_once(':').map_or(host, |(h, port)| {
            if port.bytes().all(|b| b.is_ascii_digit()) {
                h
            } else {
                host
            }
        })
    };
    name.eq_ignore_ascii_case("localhost")
        || name
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// Puts `routes` behind the admin rules: the bearer `token` when there is
/// one, same-machine Host and Origin when there is none.
pub fn guarded<S: Clone + Send + Sync + 'static>(
    routes: Router<S>,
    token: Option<Arc<str>>,
) -> Router<S> {
    routes.layer(middleware::from_fn_with_state(token, require_token))
}

async fn require_token(
    State(token): State<Option<Arc<str>>>,
    req: Request,
    next: Next,
) -> Response {
    if token.is_none() {
        // No token (a loopback listener): a web page in the operator's
        // browser must not reach the API through DNS rebinding (a foreign
        // Host) nor make it act cross-site (a foreign Origin).
        let host_ok = req
            .headers()
            .get(header::HOST)
            .and_then(|v| v.to_str().ok())
            .is_none_or(is_loopback_host);
        let origin_ok = req
            .headers()
            .get(header::ORIGIN)
            .and_then(|v| v.to_str().ok())
            .is_none_or(|o| {
                o.split_once("://")
                    .is_some_and(|(_, h)| is_loopback_host(h))
            });
        if !host_ok || !origin_ok {
            return problem(
                ProblemKind::AdminForbidden,
                "without an admin token the admin API answers only same-machine requests (Host and Origin on loopback); set an admin token to reach it otherwise",
            );
        }
    }
    if let Some(token) = &token {
        let given = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.as_bytes().strip_prefix(b"Bearer "));
        if !given.is_some_and(|g| same_secret(g, token.as_bytes())) {
            let mut resp = problem(
                ProblemKind::AdminUnauthorized,
                "send the admin token as Authorization: Bearer <token>",
            );
            resp.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                HeaderValue::from_static("Bearer realm=\"idem admin\""),
            );
            return resp;
        }
    }
    next.run(req).await
}

// ---------------------------------------------------------------- health

async fn readyz(State(state): State<AdminState>) -> Response {
    let probe = Scope::new("idem-readyz", "probe").expect("valid probe scope");
    let key: IdempotencyKey = "probe".parse().expect("valid probe key");
    match state.store.get(&probe, &key).await {
        Ok(_) => (StatusCode::OK, "ready\n").into_response(),
        Err(err) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("store unavailable: {}\n", error_chain(&err)),
        )
            .into_response(),
    }
}

/// `GET /metrics`: the Prometheus text of this process.
pub async fn metrics() -> Response {
    (
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
        )],
        crate::metrics::render(),
    )
        .into_response()
}

// ---------------------------------------------------------------- dashboard

fn asset(file: &str) -> Response {
    let (body, kind) = match file {
        "index.html" => (
            include_str!("../assets/dashboard/index.html"),
            "text/html; charset=utf-8",
        ),
        "app.js" => (
            include_str!("../assets/dashboard/app.js"),
            "text/javascript; charset=utf-8",
        ),
        "style.css" => (
            include_str!("../assets/dashboard/style.css"),
            "text/css; charset=utf-8",
        ),
        _ => return problem(ProblemKind::NotFound, "no such dashboard file"),
    };
    (
        [
            (header::CONTENT_TYPE, HeaderValue::from_static(kind)),
            (header::CACHE_CONTROL, HeaderValue::from_static("no-cache")),
            (
                header::CONTENT_SECURITY_POLICY,
                HeaderValue::from_static("default-src 'self'; frame-ancestors 'none'"),
            ),
            (
                header::X_CONTENT_TYPE_OPTIONS,
                HeaderValue::from_static("nosniff"),
            ),
        ],
        body,
    )
        .into_response()
}

// ---------------------------------------------------------------- records

/// A record as the API shows it.
#[derive(Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct RecordView {
    /// Tenant.
    pub tenant: String,
    /// Operation (`METHOD pattern`).
    pub operation: String,
    /// The client's key.
    pub key: String,
    /// `processing`, `completed` or `failed`.
    pub state: String,
    /// Request fingerprint.
    pub fingerprint: String,
    /// RFC 3339, milliseconds.
    pub created_at: String,
    /// RFC 3339, milliseconds.
    pub updated_at: String,
    /// When a final record stops being replayed.
    pub expires_at: String,
    /// Attempt number of the current (or last) owner.
    pub attempt: u32,
    /// End of the current lease.
    pub locked_until: String,
    /// Whether the side effect may or may not have happened.
    pub outcome_unknown: bool,
    /// What the work created, if known.
    pub resource_id: Option<String>,
    /// Machine-readable reason.
    pub error_code: Option<String>,
    /// The stored answer (final records).
    pub response: Option<ResponseView>,
}

/// A stored response as the API shows it.
#[derive(Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct ResponseView {
    /// HTTP status.
    pub status: u16,
    /// Stored headers (values as text; non-UTF-8 bytes replaced).
    pub headers: std::collections::BTreeMap<String, String>,
    /// Body size in bytes.
    pub body_bytes: usize,
    /// The body, when asked for and UTF-8.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub body: Option<String>,
    /// The body as hex, when asked for and not UTF-8.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub body_hex: Option<String>,
}

/// RFC 3339 with milliseconds.
pub fn rfc3339(t: Timestamp) -> String {
    let ms = u64::try_from(t.as_millis()).unwrap_or(0);
    humantime::format_rfc3339_millis(UNIX_EPOCH + Duration::from_millis(ms)).to_string()
}

impl RecordView {
    /// The view of `record`, with the response body if `body`.
    pub fn new(record: &Record, body: bool) -> Self {
        let response = record.response.as_ref().map(|r| {
            let text = body.then(|| std::str::from_utf8(&r.body).ok());
            ResponseView {
                status: r.status,
                headers: r
                    .headers
                    .iter()
                    .map(|(n, v)| (n.clone(), String::from_utf8_lossy(v).into_owned()))
                    .collect(),
                body_bytes: r.body.len(),
                body: text.flatten().map(str::to_owned),
                body_hex: matches!(text, Some(None)).then(|| to_hex(&r.body)),
            }
        });
        Self {
            tenant: record.scope.tenant().to_owned(),
            operation: record.scope.operation().to_owned(),
            key: record.key.as_str().to_owned(),
            state: record.state.as_str().to_owned(),
            fingerprint: record.fingerprint.to_string(),
            created_at: rfc3339(record.created_at),
            updated_at: rfc3339(record.updated_at),
            expires_at: rfc3339(record.expires_at),
            attempt: record.lease.attempt,
            locked_until: rfc3339(record.lease.locked_until),
            outcome_unknown: record.is_outcome_unknown(),
            resource_id: record.resource_id.clone(),
            error_code: record.error_code.clone(),
            response,
        }
    }
}

/// A page cursor as an opaque, URL-safe string.
pub fn encode_cursor(c: &Cursor) -> String {
    let json = serde_json::json!([c.created_at.as_millis(), c.tenant, c.operation, c.key]);
    to_hex(json.to_string().as_bytes())
}

/// Reads a cursor made by [`encode_cursor`].
pub fn decode_cursor(text: &str) -> Option<Cursor> {
    let (created_at, tenant, operation, key): (i64, String, String, String) =
        serde_json::from_slice(&from_hex(text)?).ok()?;
    Some(Cursor {
        created_at: Timestamp::from_millis(created_at),
        tenant,
        operation,
        key,
    })
}

/// The query of the list route, validated; errors name the parameter.
pub fn list_filter(query: &HashMap<String, String>) -> Result<ListFilter, String> {
    let mut filter = ListFilter {
        limit: DEFAULT_PAGE,
        ..ListFilter::default()
    };
    for (name, value) in query {
        match name.as_str() {
            "state" => {
                filter.state = Some(
                    value
                        .parse::<RecordState>()
                        .map_err(|e| format!("state: {e}"))?,
                );
            }
            "older_than" => {
                filter.older_than = Some(humantime::parse_duration(value).map_err(|e| {
                    format!("older_than: {value:?} is not a duration like 60s or 2h ({e})")
                })?);
            }
            "tenant" if !value.is_empty() => filter.tenant = Some(value.clone()),
            "tenant" => return Err("tenant: must not be empty".to_owned()),
            "limit" => {
                filter.limit = value
                    .parse::<usize>()
                    .ok()
                    .filter(|n| (1..=MAX_PAGE).contains(n))
                    .ok_or_else(|| {
                        format!("limit: {value:?} is not a whole number from 1 to {MAX_PAGE}")
                    })?;
            }
            "after" => {
                filter.after = Some(decode_cursor(value).ok_or_else(|| {
                    "after: not a cursor returned by this API (use the previous page's next)"
                        .to_owned()
                })?);
            }
            other => {
                return Err(format!(
                    "{other}: unknown parameter (state, older_than, tenant, limit, after)"
                ));
            }
        }
    }
    Ok(filter)
}

#[derive(Serialize)]
struct PageView {
    records: Vec<RecordView>,
    next: Option<String>,
}

fn json<T: Serialize>(status: StatusCode, value: &T) -> Response {
    (
        status,
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        )],
        serde_json::to_vec(value).unwrap_or_default(),
    )
        .into_response()
}

async fn list(State(state): State<AdminState>, Params(query): Params) -> Response {
    let filter = match list_filter(&query) {
        Ok(f) => f,
        Err(why) => return problem(ProblemKind::InvalidParameter, why),
    };
    match state.store.list(&filter).await {
        Ok(page) => json(
            StatusCode::OK,
            &PageView {
                records: page
                    .records
                    .iter()
                    .map(|r| RecordView::new(r, false))
                    .collect(),
                next: page.next.as_ref().map(encode_cursor),
            },
        ),
        Err(err) => store_problem(&err),
    }
}

/// The record a `/api/v1/records/{tenant}/{operation}/{key}` path names,
/// validated. A path that does not decode (bad percent-encoding, not
/// UTF-8) or names no valid record is refused as problem+json, like every
/// other admin error.
struct RecordId(Scope, IdempotencyKey);

impl<S: Send + Sync> FromRequestParts<S> for RecordId {
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Response> {
        let invalid = |why: String| problem(ProblemKind::InvalidParameter, why);
        let Path((tenant, operation, key)) =
            Path::<(String, String, String)>::from_request_parts(parts, state)
                .await
                .map_err(|e| invalid(format!("path: {}", e.body_text())))?;
        let scope = Scope::new(&tenant, &operation)
            .map_err(|e| invalid(format!("tenant/operation: {e}")))?;
        let key = key
            .parse::<IdempotencyKey>()
            .map_err(|e| invalid(format!("key: {e}")))?;
        Ok(Self(scope, key))
    }
}

/// The query parameters, decoded; a query that does not decode is
/// refused as problem+json.
struct Params(HashMap<String, String>);

impl<S: Send + Sync> FromRequestParts<S> for Params {
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Response> {
        Query::<HashMap<String, String>>::from_request_parts(parts, state)
            .await
            .map(|Query(q)| Self(q))
            .map_err(|e| {
                problem(
                    ProblemKind::InvalidParameter,
                    format!("query: {}", e.body_text()),
                )
            })
    }
}

fn operator_problem(err: &OperatorError) -> Response {
    match err {
        OperatorError::NotFound => problem(ProblemKind::RecordNotFound, err.to_string()),
        OperatorError::LeaseLive { retry_after } => {
            Problem::new(ProblemKind::RecordConflict, err.to_string())
                .with_retry_after(*retry_after)
                .to_response()
                .into_response()
        }
        OperatorError::Store(e) => store_problem(e),
        _ => problem(ProblemKind::RecordConflict, err.to_string()),
    }
}

async fn show(
    State(state): State<AdminState>,
    RecordId(scope, key): RecordId,
    Params(query): Params,
) -> Response {
    let body = match query.get("body").map(String::as_str) {
        None | Some("false") => false,
        Some("true") => true,
        Some(other) => {
            return problem(
                ProblemKind::InvalidParameter,
                format!("body: {other:?} is not true or false"),
            );
        }
    };
    match state.store.get(&scope, &key).await {
        Ok(Some(record)) => json(StatusCode::OK, &RecordView::new(&record, body)),
        Ok(None) => operator_problem(&OperatorError::NotFound),
        Err(err) => store_problem(&err),
    }
}

/// `?attempt=N`: act only if the record is still at the attempt the
/// operator looked at.
fn expected_attempt(query: &HashMap<String, String>) -> Result<Option<u32>, Problem> {
    for name in query.keys() {
        if name != "attempt" {
            return Err(Problem::new(
                ProblemKind::InvalidParameter,
                format!("{name}: unknown parameter (attempt)"),
            ));
        }
    }
    query
        .get("attempt")
        .map(|v| {
            v.parse::<u32>().ok().filter(|n| *n >= 1).ok_or_else(|| {
                Problem::new(
                    ProblemKind::InvalidParameter,
                    format!("attempt: {v:?} is not an attempt number (1, 2, …)"),
                )
            })
        })
        .transpose()
}

async fn release(
    State(state): State<AdminState>,
    RecordId(scope, key): RecordId,
    Params(query): Params,
) -> Response {
    let attempt = match expected_attempt(&query) {
        Ok(attempt) => attempt,
        Err(p) => return p.to_response().into_response(),
    };
    match operator::release(&state.store, &scope, &key, attempt).await {
        Ok(record) => {
            tracing::warn!(reason = "idempotency_operator_release", tenant = scope.tenant(), operation = scope.operation(), %key, attempt = record.lease.attempt, "record released by an operator");
            json(
                StatusCode::OK,
                &serde_json::json!({"released": true, "record": RecordView::new(&record, false)}),
            )
        }
        Err(err) => operator_problem(&err),
    }
}

/// The body of `POST …/resolve`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ResolveRequest {
    /// `completed` or `failed`; by default from the status (< 400 completed).
    pub verdict: Option<String>,
    /// The HTTP status to replay.
    pub status: u16,
    /// Headers to replay.
    #[serde(default)]
    pub headers: std::collections::BTreeMap<String, String>,
    /// The body to replay, as text.
    #[serde(default)]
    pub body: Option<String>,
    /// The body to replay, hex-encoded (for bytes that are not UTF-8; as
    /// `show` prints them).
    #[serde(default)]
    pub body_hex: Option<String>,
    /// What the operation created.
    pub resource_id: Option<String>,
    /// Machine-readable reason (failures).
    pub error_code: Option<String>,
    /// How long to keep the answer (`24h`); the gateway's default if absent.
    pub retention: Option<String>,
}

impl ResolveRequest {
    /// The outcome to record; errors name the field.
    pub fn outcome(&self, default_retention: Duration) -> Result<FinalOutcome, String> {
        if !(100..=599).contains(&self.status) {
            return Err(format!("status: {} is not an HTTP status", self.status));
        }
        let verdict = match self.verdict.as_deref() {
            Some("completed") => Verdict::Completed,
            Some("failed") => Verdict::Failed,
            Some(other) => return Err(format!("verdict: {other:?} is not completed or failed")),
            None if self.status < 400 => Verdict::Completed,
            None => Verdict::Failed,
        };
        let body = match (&self.body, &self.body_hex) {
            (Some(_), Some(_)) => return Err("body, body_hex: give one or the other".to_owned()),
            (Some(text), None) => text.clone().into_bytes(),
            (None, Some(hex)) => from_hex(hex)
                .ok_or_else(|| "body_hex: not an even number of hex digits".to_owned())?,
            (None, None) => Vec::new(),
        };
        let mut response = StoredResponse::new(self.status, body);
        for (name, value) in &self.headers {
            header::HeaderName::from_bytes(name.as_bytes())
                .map_err(|_| format!("headers: {name:?} is not a header name"))?;
            HeaderValue::from_str(value)
                .map_err(|_| format!("headers: the value of {name:?} is not a header value"))?;
            response = response.with_header(name, value.clone().into_bytes());
        }
        let retention = match &self.retention {
            None => default_retention,
            Some(text) => humantime::parse_duration(text)
                .ok()
                .filter(|d| !d.is_zero())
                .ok_or_else(|| format!("retention: {text:?} is not a duration like 24h"))?,
        };
        Ok(FinalOutcome {
            verdict,
            response,
            resource_id: self.resource_id.clone(),
            error_code: self.error_code.clone(),
            retention,
        })
    }
}

async fn resolve(
    State(state): State<AdminState>,
    RecordId(scope, key): RecordId,
    Params(query): Params,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let attempt = match expected_attempt(&query) {
        Ok(attempt) => attempt,
        Err(p) => return p.to_response().into_response(),
    };
    let is_json = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/json"));
    if !is_json {
        return problem(
            ProblemKind::InvalidParameter,
            "body: send the answer as application/json",
        );
    }
    let outcome = serde_json::from_slice::<ResolveRequest>(&body)
        .map_err(|e| format!("body: {e}"))
        .and_then(|r| r.outcome(state.default_retention));
    let outcome = match outcome {
        Ok(o) => o,
        Err(why) => return problem(ProblemKind::InvalidParameter, why),
    };
    match operator::resolve(&state.store, &scope, &key, &outcome, attempt).await {
        Ok(record) => {
            tracing::warn!(reason = "idempotency_operator_resolve", tenant = scope.tenant(), operation = scope.operation(), %key, state = %record.state, status = outcome.response.status, "record resolved by an operator");
            json(StatusCode::OK, &RecordView::new(&record, false))
        }
        Err(err) => operator_problem(&err),
    }
}

async fn delete(State(state): State<AdminState>, RecordId(scope, key): RecordId) -> Response {
    match state.store.delete(&scope, &key).await {
        Ok(true) => {
            tracing::warn!(reason = "idempotency_operator_delete", tenant = scope.tenant(), operation = scope.operation(), %key, "record deleted by an operator");
            StatusCode::NO_CONTENT.into_response()
        }
        Ok(false) => operator_problem(&OperatorError::NotFound),
        Err(err) => store_problem(&err),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cursors_round_trip_and_refuse_garbage() {
        let c = Cursor {
            created_at: Timestamp::from_millis(1_700_000_000_123),
            tenant: "t/ü".into(),
            operation: "POST /v1/payments".into(),
            key: "k 1".into(),
        };
        let text = encode_cursor(&c);
        assert!(text.bytes().all(|b| b.is_ascii_hexdigit()));
        assert_eq!(decode_cursor(&text), Some(c));
        for bad in ["", "zz", "abc", &to_hex(b"[1,2]")] {
            assert_eq!(decode_cursor(bad), None, "{bad}");
        }
    }

    #[test]
    fn list_parameters_are_validated_by_name() {
        let q = |pairs: &[(&str, &str)]| {
            list_filter(
                &pairs
                    .iter()
                    .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                    .collect(),
            )
        };
        let f = q(&[
            ("state", "processing"),
            ("older_than", "60s"),
            ("limit", "5"),
        ])
        .expect("valid");
        assert_eq!(f.state, Some(RecordState::Processing));
        assert_eq!(f.older_than, Some(Duration::from_secs(60)));
        assert_eq!(f.limit, 5);
        assert_eq!(q(&[]).expect("valid").limit, DEFAULT_PAGE);
        for (pairs, name) in [
            (vec![("state", "done")], "state:"),
            (vec![("older_than", "soon")], "older_than:"),
            (vec![("limit", "0")], "limit:"),
            (vec![("limit", "5000")], "limit:"),
            (vec![("after", "nope")], "after:"),
            (vec![("tenant", "")], "tenant:"),
            (vec![("colour", "blue")], "colour:"),
        ] {
            let err = q(&pairs).expect_err(name);
            assert!(err.starts_with(name), "{err}");
        }
    }

    #[test]
    fn resolve_requests_are_validated_by_field() {
        let parse = |text: &str| {
            serde_json::from_str::<ResolveRequest>(text)
                .map_err(|e| e.to_string())
                .and_then(|r| r.outcome(Duration::from_secs(60)))
        };
        let ok = parse(r#"{"status":201,"headers":{"content-type":"application/json"},"body":"{}","resource_id":"pay_1"}"#)
            .expect("valid");
        assert_eq!(ok.verdict, Verdict::Completed);
        assert_eq!(ok.retention, Duration::from_secs(60));
        assert_eq!(ok.resource_id.as_deref(), Some("pay_1"));
        assert_eq!(
            parse(r#"{"status":402,"retention":"2h"}"#)
                .expect("valid")
                .verdict,
            Verdict::Failed
        );
        for (text, needle) in [
            (r#"{"status":99}"#, "status:"),
            (r#"{"status":200,"verdict":"maybe"}"#, "verdict:"),
            (r#"{"status":200,"headers":{"bad name":"x"}}"#, "headers:"),
            (r#"{"status":200,"retention":"forever"}"#, "retention:"),
            (r#"{"status":200,"colour":"blue"}"#, "unknown field"),
        ] {
            let err = parse(text).expect_err(text);
            assert!(err.contains(needle), "{text}: {err}");
        }
    }

    #[test]
    fn loopback_hosts() {
        for host in [
            "localhost",
            "LOCALHOST:9090",
            "127.0.0.1",
            "127.0.0.1:9090",
            "[::1]:9090",
            "::1",
        ] {
            assert!(is_loopback_host(host), "{host}");
        }
        for host in [
            "evil.example",
            "evil.example:9090",
            "10.0.0.1:9090",
            "localhost.evil.example",
            "",
        ] {
            assert!(!is_loopback_host(host), "{host}");
        }
    }

    #[test]
    fn secrets_compare_whole() {
        assert!(same_secret(b"abc", b"abc"));
        assert!(!same_secret(b"abc", b"abd"));
        assert!(!same_secret(b"ab", b"abc"));
    }
}
