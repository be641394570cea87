//! `payments api`: a Payment API that never charges twice.
//!
//! `POST /v1/payments` `{order_id, amount_cents, currency,
//! payment_method_id}` with a required `Idempotency-Key`, the tenant being
//! the API key in `Authorization`. The `idem-http` layer answers retries,
//! concurrent duplicates and reused keys; the handler runs once per key as
//! the record's owner and follows the flow that keeps every failure
//! recoverable:
//!
//! 1. the key is reserved (`processing`) by the layer;
//! 2. a local payment attempt is written (`attempted`), keyed by the
//!    operation id `tenant:key` (`UNIQUE (tenant, operation_id)`);
//! 3. the provider is called with that operation id, so a repeated call
//!    (a retry after a crash or a timeout) returns the original charge;
//! 4. one transaction stores the result on the payment, enqueues the
//!    `PaymentAuthorized` outbox event and completes the idempotency record
//!    (`PgStore::resolve_in`): the three commit together or not at all;
//! 5. `201` with the payment.
//!
//! A decline is recorded as a deterministic failure (`422
//! payment_declined`, replayed to retries). A provider timeout answers
//! `503` + `Retry-After` and leaves the record `processing`, marked
//! `provider_outcome_unknown`; the reconciliation worker ([`Api::reconcile`]) asks
//! the provider by operation id and finishes it, so a later retry gets the
//! real answer. A provider error before charging releases the key.
//!
//! The request's W3C trace context (`traceparent`, `tracestate`) is kept
//! with the payment attempt and given to its `PaymentAuthorized` outbox
//! row, whichever path settles it (this request, or the reconciler after
//! it timed out): the event, and what the Order service does with it,
//! continue the trace of the request that caused the charge. A request
//! without a valid `traceparent` is served all the same (a malformed one
//! is ignored, as W3C says); its events carry no trace context.

use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Path, Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use idem::{
    FinalOutcome, LeaseExpiry, ListFilter, ListRecords, OwnerToken, Policy, RecordState,
    Reservation, ReserveRequest, Store, StoredResponse, Verdict,
};
use idem_http::{IdempotencyLayer, Reserved, RoutePolicy, Routes, TenantSource, UpstreamOutcome};
use idem_messaging::trace::TraceContext;
use idem_postgres::PgStore;
use idem_postgres::outbox::{Outbox, OutboxMessage};
use idem_postgres::sqlx::{self, Postgres, Row, Transaction};
use serde::{Deserialize, Serialize};

use crate::problem_response;
use crate::provider::{Charge, ChargeRequest};

/// The operation the layer protects (method and route pattern).
pub const OPERATION: &str = "POST /v1/payments";

/// The aggregate type of the payments' events (the `payment` of subject
/// `<prefix>.payment.<message_type>` and of Kafka topic
/// `<prefix>.payment`).
pub const AGGREGATE_TYPE: &str = "payment";

/// The message type of the [`PaymentAuthorized`] event.
pub const PAYMENT_AUTHORIZED: &str = "PaymentAuthorized";

/// How the API runs.
#[derive(Debug, Clone)]
pub struct ApiConfig {
    /// PostgreSQL: payments, the idempotency records and the outbox.
    pub database: String,
    /// The provider's base URL.
    pub provider: String,
    /// The Order service's base URL: when set, a payment for an order it
    /// does not know, or for another amount, is refused before anything
    /// is charged.
    pub orders: Option<String>,
    /// How long to wait for the provider before the outcome is unknown.
    pub provider_timeout: Duration,
    /// The idempotency lease (a crashed attempt's key is taken over or
    /// reconciled after it).
    pub lease: Duration,
    /// How long answers are kept for retries.
    pub retention: Duration,
}

impl ApiConfig {
    /// Defaults: provider timeout 2 s, lease 30 s, retention 72 h.
    pub fn new(database: &str, provider: &str) -> Self {
        Self {
            database: database.to_owned(),
            provider: provider.trim_end_matches('/').to_owned(),
            orders: None,
            provider_timeout: Duration::from_secs(2),
            lease: Duration::from_secs(30),
            retention: Duration::from_secs(72 * 3600),
        }
    }
}

/// Shared by the handlers and the reconciliation worker.
#[derive(Clone)]
pub struct Api {
    store: Arc<PgStore>,
    provider: ProviderClient,
    config: Arc<ApiConfig>,
}

impl std::fmt::Debug for Api {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Api")
            .field("provider", &self.config.provider)
            .finish_non_exhaustive()
    }
}

const SCHEMA: &str = "CREATE TABLE IF NOT EXISTS payments (
    id                 text PRIMARY KEY,
    tenant             text NOT NULL,
    operation_id       text NOT NULL,
    order_id           text NOT NULL,
    amount_cents       bigint NOT NULL CHECK (amount_cents > 0),
    currency           text NOT NULL,
    payment_method_id  text NOT NULL,
    status             text NOT NULL CHECK (status IN ('attempted', 'authorized', 'declined')),
    provider_charge_id text,
    traceparent        text,
    tracestate         text,
    created_at         timestamptz NOT NULL DEFAULT now(),
    updated_at         timestamptz NOT NULL DEFAULT now(),
    UNIQUE (tenant, operation_id)
)";

/// The trace context columns, for a `payments` table made before them.
const ADD_TRACE_CONTEXT: &str = "ALTER TABLE payments \
    ADD COLUMN IF NOT EXISTS traceparent text, \
    ADD COLUMN IF NOT EXISTS tracestate text";

impl Api {
    /// Connects to the database (creating idem's tables and `payments`).
    pub async fn connect(config: ApiConfig) -> Result<Self, String> {
        let store = crate::connect_store(&config.database, &[SCHEMA, ADD_TRACE_CONTEXT]).await?;
        Ok(Self {
            store: Arc::new(store),
            provider: ProviderClient::new(&config.provider, config.provider_timeout),
            config: Arc::new(config),
        })
    }

    /// The idempotency store (for operators and tests).
    pub fn store(&self) -> &PgStore {
        &self.store
    }

    /// The HTTP routes: `POST /v1/payments` behind the idempotency layer,
    /// `GET /v1/payments/{id}`, all behind an API key.
    pub fn router(&self) -> Router {
        let policy = Policy::default()
            .with_retention(self.config.retention)
            .with_lease(self.config.lease)
            // Safe: the provider deduplicates by the operation id a retry
            // sends again.
            .with_on_lease_expiry(LeaseExpiry::Retry);
        let routes = Routes::default()
            .route(
                axum::http::Method::POST,
                "/v1/payments",
                RoutePolicy::default()
                    .with_require_key(true)
                    .with_max_request_body(16 * 1024)
                    .with_engine(policy),
            )
            .unwrap_or_default();
        Router::new()
            .route("/v1/payments", post(create))
            .route("/v1/payments/{id}", get(show))
            .layer(
                IdempotencyLayer::from_arc(Arc::clone(&self.store))
                    .with_routes(routes)
                    .with_tenant(TenantSource::Authorization),
            )
            .layer(middleware::from_fn(require_api_key))
            .with_state(self.clone())
    }
}

/// Every route needs `Authorization: Bearer <api key>`; nothing else is
/// looked at (the key's hash is the tenant).
async fn require_api_key(req: Request, next: Next) -> Response {
    let ok = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .is_some_and(|k| !k.trim().is_empty());
    if !ok {
        return problem_response(
            StatusCode::UNAUTHORIZED,
            "unauthorized",
            "send your API key as Authorization: Bearer <key>",
        );
    }
    next.run(req).await
}

/// The request body; every field is checked before anything is charged.
#[derive(Debug, Deserialize)]
pub struct NewPayment {
    order_id: Option<String>,
    amount_cents: Option<i64>,
    currency: Option<String>,
    payment_method_id: Option<String>,
}

/// A valid payment request.
#[derive(Debug, Clone)]
struct Valid {
    order_id: String,
    amount_cents: i64,
    currency: String,
    payment_method_id: String,
}

impl NewPayment {
    fn validate(self) -> Result<Valid, String> {
        let text = |name: &str, v: Option<String>| match v {
            Some(v) if !v.trim().is_empty() && v.len() <= 255 => Ok(v),
            Some(_) => Err(format!("{name} must be 1 to 255 characters")),
            None => Err(format!("{name} is required")),
        };
        let order_id = text("order_id", self.order_id)?;
        let payment_method_id = text("payment_method_id", self.payment_method_id)?;
        let amount_cents = match self.amount_cents {
            Some(a) if a > 0 => a,
            Some(a) => return Err(format!("amount_cents must be positive, not {a}")),
            None => return Err("amount_cents is required".to_owned()),
        };
        let currency = match self.currency {
            Some(c) if c.len() == 3 && c.bytes().all(|b| b.is_ascii_uppercase()) => c,
            Some(c) => {
                return Err(format!(
                    "currency must be a three-letter ISO 4217 code such as EUR, not {c:?}"
                ));
            }
            None => return Err("currency is required".to_owned()),
        };
        Ok(Valid {
            order_id,
            amount_cents,
            currency,
            payment_method_id,
        })
    }
}

/// A payment as the API shows it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Payment {
    /// `pay_…`.
    pub id: String,
    /// The order it pays.
    pub order_id: String,
    /// Minor units.
    pub amount_cents: i64,
    /// ISO 4217.
    pub currency: String,
    /// `attempted`, `authorized` or `declined`.
    pub status: String,
    /// The provider's charge, once known.
    pub provider_charge_id: Option<String>,
}

/// The `PaymentAuthorized` event.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct PaymentAuthorized {
    /// The payment.
    pub payment_id: String,
    /// The order it pays.
    pub order_id: String,
    /// Minor units.
    pub amount_cents: i64,
    /// ISO 4217.
    pub currency: String,
}

/// The W3C trace context of a request's `traceparent` and `tracestate`
/// headers; `None` without a valid `traceparent` (a malformed one is
/// ignored, as W3C says, never refused). A `tracestate` that does not pass
/// is dropped and the `traceparent` kept.
pub fn request_trace_context(headers: &HeaderMap) -> Option<TraceContext> {
    TraceContext::from_headers(
        headers
            .iter()
            .filter_map(|(name, value)| Some((name.as_str(), value.to_str().ok()?))),
    )
}

async fn create(
    State(api): State<Api>,
    reserved: Option<Extension<Reserved>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let Some(Extension(reserved)) = reserved else {
        // Only reachable if the layer is missing: refuse rather than charge
        // unprotected.
        return problem_response(
            StatusCode::INTERNAL_SERVER_ERROR,
            "not_protected",
            "this route runs only behind the idempotency layer",
        );
    };
    let valid = match serde_json::from_slice::<NewPayment>(&body)
        .map_err(|e| format!("the body is not a payment request: {e}"))
        .and_then(NewPayment::validate)
    {
        Ok(v) => v,
        // A deterministic failure: the layer records and replays it.
        Err(why) => return problem_response(StatusCode::BAD_REQUEST, "invalid_payment", why),
    };
    let trace = request_trace_context(&headers);
    match api.pay(&reserved, &valid, trace.as_ref()).await {
        Ok(resp) => resp,
        Err(why) => {
            tracing::error!(%why, "payment failed");
            let mut resp = problem_response(
                StatusCode::SERVICE_UNAVAILABLE,
                "temporarily_unavailable",
                why,
            );
            resp.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("2"));
            resp
        }
    }
}

async fn show(State(api): State<Api>, Path(id): Path<String>) -> Response {
    let row = sqlx::query(
        "SELECT id, order_id, amount_cents, currency, status, provider_charge_id FROM payments WHERE id = $1",
    )
    .bind(&id)
    .fetch_optional(api.store.pool())
    .await;
    match row {
        Ok(Some(r)) => match payment_from_row(&r) {
            Ok(p) => Json(p).into_response(),
            Err(e) => {
                problem_response(StatusCode::INTERNAL_SERVER_ERROR, "internal", e.to_string())
            }
        },
        Ok(None) => problem_response(
            StatusCode::NOT_FOUND,
            "not_found",
            format!("no payment {id}"),
        ),
        Err(e) => problem_response(
            StatusCode::SERVICE_UNAVAILABLE,
            "temporarily_unavailable",
            e.to_string(),
        ),
    }
}

fn payment_from_row(r: &sqlx::postgres::PgRow) -> Result<Payment, sqlx::Error> {
    Ok(Payment {
        id: r.try_get("id")?,
        order_id: r.try_get("order_id")?,
        amount_cents: r.try_get("amount_cents")?,
        currency: r.try_get("currency")?,
        status: r.try_get("status")?,
        provider_charge_id: r.try_get("provider_charge_id")?,
    })
}

/// A response the layer must not record (the handler did, or chose the
/// record's fate itself).
fn with_outcome(mut resp: Response, outcome: UpstreamOutcome) -> Response {
    resp.extensions_mut().insert(outcome);
    resp
}

impl Api {
    /// Steps 2 to 5 of the flow, as the record's owner; `trace` is the
    /// request's, kept with the attempt for its event.
    async fn pay(
        &self,
        reserved: &Reserved,
        p: &Valid,
        trace: Option<&TraceContext>,
    ) -> Result<Response, String> {
        let tenant = reserved.scope.tenant().to_owned();
        let operation_id = format!("{tenant}:{}", reserved.key);
        // Refuse what can never succeed before charging anything.
        if let Some(refusal) = self.check_order(p).await? {
            return Ok(refusal);
        }
        // 2. The local attempt (a retry after a takeover finds it, and
        // its request becomes the one the event's trace continues).
        let payment_id: String = sqlx::query_scalar(
            "INSERT INTO payments (id, tenant, operation_id, order_id, amount_cents, currency, payment_method_id, status, traceparent, tracestate) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, 'attempted', $8, $9) \
             ON CONFLICT (tenant, operation_id) DO UPDATE \
             SET updated_at = now(), traceparent = EXCLUDED.traceparent, tracestate = EXCLUDED.tracestate \
             RETURNING id",
        )
        .bind(format!("pay_{}", uuid::Uuid::new_v4().simple()))
        .bind(&tenant)
        .bind(&operation_id)
        .bind(&p.order_id)
        .bind(p.amount_cents)
        .bind(&p.currency)
        .bind(&p.payment_method_id)
        .bind(trace.map(TraceContext::traceparent))
        .bind(trace.and_then(TraceContext::tracestate))
        .fetch_one(self.store.pool())
        .await
        .map_err(|e| format!("cannot record the payment attempt: {e}"))?;
        // 3. The provider, with the stable operation id.
        let request = ChargeRequest {
            operation_id: operation_id.clone(),
            amount_cents: p.amount_cents,
            currency: p.currency.clone(),
            payment_method_id: p.payment_method_id.clone(),
        };
        match self.provider.charge(&request).await {
            ProviderAnswer::Charged(charge) | ProviderAnswer::Declined(charge) => {
                // 4 and 5.
                let resp = self.settle(reserved, &payment_id, &charge).await?;
                Ok(with_outcome(resp, UpstreamOutcome::Recorded))
            }
            ProviderAnswer::Unknown(why) => {
                // The charge may have happened: keep the record processing,
                // marked, for the reconciler (and for a retry after the
                // lease, which asks the provider again with the same id).
                self.store
                    .mark_unknown(
                        &reserved.scope,
                        &reserved.key,
                        &reserved.lease,
                        "provider_outcome_unknown",
                    )
                    .await
                    .map_err(|e| format!("cannot mark the outcome unknown: {e}"))?;
                tracing::warn!(%operation_id, %why, "provider outcome unknown");
                let mut resp = problem_response(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "provider_outcome_unknown",
                    "the payment provider did not answer in time; retry with the same Idempotency-Key",
                );
                resp.headers_mut()
                    .insert(header::RETRY_AFTER, HeaderValue::from_static("5"));
                Ok(with_outcome(resp, UpstreamOutcome::Recorded))
            }
            ProviderAnswer::NotCharged(why) => {
                // Nothing happened at the provider: free the key.
                let mut resp = problem_response(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "provider_unavailable",
                    format!(
                        "the payment provider refused for now ({why}); retry with the same Idempotency-Key"
                    ),
                );
                resp.headers_mut()
                    .insert(header::RETRY_AFTER, HeaderValue::from_static("2"));
                Ok(with_outcome(resp, UpstreamOutcome::NotSent))
            }
        }
    }

    /// Asks the Order service (when configured) whether the order exists,
    /// awaits payment and costs this much. `Some(response)`: refused, a
    /// deterministic answer the layer records; `Err`: the Order service
    /// could not say (the key is released, the client retries).
    async fn check_order(&self, p: &Valid) -> Result<Option<Response>, String> {
        let Some(orders) = &self.config.orders else {
            return Ok(None);
        };
        let url = format!(
            "{}/v1/orders/{}",
            orders.trim_end_matches('/'),
            encode(&p.order_id)
        );
        let (status, body) = self.provider.fetch(&url).await?;
        match status {
            200 => {}
            404 => {
                return Ok(Some(problem_response(
                    StatusCode::NOT_FOUND,
                    "unknown_order",
                    format!("there is no order {}", p.order_id),
                )));
            }
            s => return Err(format!("the Order service answered {s}")),
        }
        #[derive(Deserialize)]
        struct OrderView {
            amount_cents: i64,
            currency: String,
            state: String,
        }
        let order: OrderView = serde_json::from_slice(&body).map_err(|e| e.to_string())?;
        if order.state != "payment_pending" {
            return Ok(Some(problem_response(
                StatusCode::UNPROCESSABLE_ENTITY,
                "order_not_payable",
                format!("order {} is {}", p.order_id, order.state),
            )));
        }
        if (order.amount_cents, order.currency.as_str()) != (p.amount_cents, p.currency.as_str()) {
            return Ok(Some(problem_response(
                StatusCode::UNPROCESSABLE_ENTITY,
                "amount_mismatch",
                format!(
                    "order {} is for {} {}, not {} {}",
                    p.order_id, order.amount_cents, order.currency, p.amount_cents, p.currency
                ),
            )));
        }
        Ok(None)
    }

    /// Step 4: the payment's result, its event and the idempotency record,
    /// in one transaction; then the response.
    async fn settle(
        &self,
        reserved: &Reserved,
        payment_id: &str,
        charge: &Charge,
    ) -> Result<Response, String> {
        let mut tx = self
            .store
            .pool()
            .begin()
            .await
            .map_err(|e| format!("database: {e}"))?;
        let stored = self
            .record_in(
                &mut tx,
                &reserved.scope,
                &reserved.key,
                &reserved.lease,
                payment_id,
                charge,
            )
            .await?;
        tx.commit().await.map_err(|e| format!("commit: {e}"))?;
        Response::builder()
            .status(stored.status)
            .header(header::CONTENT_TYPE, content_type(&stored))
            .body(axum::body::Body::from(stored.body.clone()))
            .map_err(|e| e.to_string())
    }

    /// In `tx`: the payment moves to the charge's result (with its event
    /// for a success) and the idempotency record gets the answer, fenced by
    /// `lease`. Returns the answer.
    async fn record_in(
        &self,
        tx: &mut Transaction<'_, Postgres>,
        scope: &idem::Scope,
        key: &idem::IdempotencyKey,
        lease: &idem::Lease,
        payment_id: &str,
        charge: &Charge,
    ) -> Result<StoredResponse, String> {
        let stored = settle_in(tx, payment_id, charge).await?;
        let verdict = if stored.status < 300 {
            Verdict::Completed
        } else {
            Verdict::Failed
        };
        self.store
            .resolve_in(
                tx,
                scope,
                key,
                lease,
                &FinalOutcome {
                    verdict,
                    response: stored.clone(),
                    resource_id: Some(payment_id.to_owned()),
                    error_code: (verdict == Verdict::Failed).then(|| "payment_declined".to_owned()),
                    retention: self.config.retention,
                },
            )
            .await
            .map_err(|e| format!("cannot complete the idempotency record: {e}"))?;
        Ok(stored)
    }
}

fn content_type(stored: &StoredResponse) -> String {
    stored
        .headers
        .iter()
        .find(|(n, _)| n.eq_ignore_ascii_case("content-type"))
        .map(|(_, v)| String::from_utf8_lossy(v).into_owned())
        .unwrap_or_else(|| "application/json".to_owned())
}

/// In `tx`: moves the payment to the charge's result and, for a success,
/// enqueues `PaymentAuthorized` with the trace context kept with the
/// attempt. Returns the answer to record.
async fn settle_in(
    tx: &mut Transaction<'_, Postgres>,
    payment_id: &str,
    charge: &Charge,
) -> Result<StoredResponse, String> {
    let authorized = charge.status == "succeeded";
    let row = sqlx::query(
        "UPDATE payments SET status = $2, provider_charge_id = $3, updated_at = now() \
         WHERE id = $1 \
         RETURNING id, order_id, amount_cents, currency, status, provider_charge_id, traceparent, tracestate",
    )
    .bind(payment_id)
    .bind(if authorized { "authorized" } else { "declined" })
    .bind(&charge.id)
    .fetch_one(&mut **tx)
    .await
    .map_err(|e| format!("cannot store the payment: {e}"))?;
    let payment = payment_from_row(&row).map_err(|e| e.to_string())?;
    // Stored from a valid context; read leniently all the same (an event
    // without its trace beats no event).
    let traceparent: Option<String> = row.try_get("traceparent").map_err(|e| e.to_string())?;
    let tracestate: Option<String> = row.try_get("tracestate").map_err(|e| e.to_string())?;
    let trace = traceparent.and_then(|p| TraceContext::new(&p, tracestate.as_deref()).ok());
    if !authorized {
        let (_, body) = crate::problem(
            StatusCode::UNPROCESSABLE_ENTITY,
            "payment_declined",
            format!("the card was declined (charge {})", charge.id),
        );
        return Ok(
            StoredResponse::new(422, body).with_header("content-type", "application/problem+json")
        );
    }
    let event = PaymentAuthorized {
        payment_id: payment.id.clone(),
        order_id: payment.order_id.clone(),
        amount_cents: payment.amount_cents,
        currency: payment.currency.clone(),
    };
    let payload = serde_json::to_string(&event).map_err(|e| e.to_string())?;
    let msg = OutboxMessage::new(AGGREGATE_TYPE, &payment.id, PAYMENT_AUTHORIZED, &payload)
        .and_then(|msg| crate::traced(msg, trace.as_ref()))
        .map_err(|e| e.to_string())?;
    Outbox::enqueue(tx, &msg)
        .await
        .map_err(|e| format!("cannot enqueue the event: {e}"))?;
    let body = serde_json::to_string(&payment).map_err(|e| e.to_string())?;
    Ok(StoredResponse::new(201, body)
        .with_header("content-type", "application/json")
        .with_header("location", format!("/v1/payments/{}", payment.id)))
}

/// What the provider said.
enum ProviderAnswer {
    /// Charged (or charged before, for this operation id).
    Charged(Charge),
    /// Declined (a deterministic answer).
    Declined(Charge),
    /// No answer: the charge may or may not have happened.
    Unknown(String),
    /// Refused before charging (unreachable, or an error it reports as
    /// such).
    NotCharged(String),
}

/// A small JSON client for the provider.
#[derive(Clone)]
struct ProviderClient {
    base: String,
    timeout: Duration,
    http: Client<HttpConnector, Full<Bytes>>,
}

impl ProviderClient {
    fn new(base: &str, timeout: Duration) -> Self {
        Self {
            base: base.trim_end_matches('/').to_owned(),
            timeout,
            http: Client::builder(TokioExecutor::new()).build_http(),
        }
    }

    async fn charge(&self, req: &ChargeRequest) -> ProviderAnswer {
        let body = match serde_json::to_vec(req) {
            Ok(b) => b,
            Err(e) => return ProviderAnswer::NotCharged(e.to_string()),
        };
        let request = match hyper::Request::post(format!("{}/v1/charges", self.base))
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body)))
        {
            Ok(r) => r,
            Err(e) => return ProviderAnswer::NotCharged(e.to_string()),
        };
        let call = async {
            let resp = self.http.request(request).await?;
            let status = resp.status();
            let body = resp.into_body().collect().await?.to_bytes();
            Ok::<_, Box<dyn std::error::Error + Send + Sync>>((status, body))
        };
        match tokio::time::timeout(self.timeout, call).await {
            Err(_) => ProviderAnswer::Unknown(format!("no answer within {:?}", self.timeout)),
            Ok(Err(e)) => {
                // Refused connections never reached the provider; anything
                // else may have.
                let refused = std::error::Error::source(e.as_ref())
                    .map(|s| s.to_string())
                    .unwrap_or_default()
                    .contains("refused")
                    || e.to_string().contains("refused");
                if refused {
                    ProviderAnswer::NotCharged(e.to_string())
                } else {
                    ProviderAnswer::Unknown(e.to_string())
                }
            }
            Ok(Ok((status, body))) => {
                match (status.as_u16(), serde_json::from_slice::<Charge>(&body)) {
                    (200 | 201, Ok(c)) => ProviderAnswer::Charged(c),
                    (402, Ok(c)) => ProviderAnswer::Declined(c),
                    (s, _) if s >= 500 => {
                        ProviderAnswer::NotCharged(format!("provider answered {s}"))
                    }
                    (s, _) => ProviderAnswer::Unknown(format!("provider answered {s}")),
                }
            }
        }
    }

    /// `GET url`: status and body, within the timeout.
    async fn fetch(&self, url: &str) -> Result<(u16, Bytes), String> {
        let request = hyper::Request::get(url)
            .body(Full::new(Bytes::new()))
            .map_err(|e| e.to_string())?;
        let call = async {
            let resp = self
                .http
                .request(request)
                .await
                .map_err(|e| e.to_string())?;
            let status = resp.status().as_u16();
            let body = resp
                .into_body()
                .collect()
                .await
                .map_err(|e| e.to_string())?
                .to_bytes();
            Ok::<_, String>((status, body))
        };
        tokio::time::timeout(self.timeout, call)
            .await
            .map_err(|_| format!("no answer from {url} within {:?}", self.timeout))?
    }

    /// The charge for an operation, if the provider made one.
    async fn lookup(&self, operation_id: &str) -> Result<Option<Charge>, String> {
        let url = format!(
            "{}/v1/charges?operation_id={}",
            self.base,
            encode(operation_id)
        );
        let (status, body) = self.fetch(&url).await?;
        if status != 200 {
            return Err(format!("the provider answered {status}"));
        }
        #[derive(Deserialize)]
        struct Found {
            charges: Vec<Charge>,
        }
        let found: Found = serde_json::from_slice(&body).map_err(|e| e.to_string())?;
        Ok(found.charges.into_iter().next())
    }
}

/// Percent-encodes a query value.
fn encode(value: &str) -> String {
    value
        .bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// What one reconciliation pass did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Reconciled {
    /// Processing payment records looked at.
    pub examined: u64,
    /// Finished from the provider's answer (authorized or declined).
    pub settled: u64,
    /// Released: the provider never charged.
    pub released: u64,
    /// Left for later (a live lease, the provider unreachable).
    pub left: u64,
}

impl Api {
    /// One reconciliation pass: every `processing` payment record whose
    /// lease has lapsed (its attempt died or timed out) is taken over and
    /// finished from what the provider says for its operation id, in one
    /// transaction with the payment and its event; one the provider never
    /// charged is released so a retry runs it again.
    pub async fn reconcile(&self) -> Result<Reconciled, String> {
        let mut report = Reconciled::default();
        let mut after = None;
        loop {
            let page = self
                .store
                .list(&ListFilter {
                    state: Some(RecordState::Processing),
                    older_than: None,
                    tenant: None,
                    limit: 100,
                    after,
                })
                .await
                .map_err(|e| e.to_string())?;
            for record in page
                .records
                .iter()
                .filter(|r| r.scope.operation() == OPERATION)
            {
                report.examined += 1;
                match self.reconcile_one(record).await {
                    Ok(Some(true)) => report.settled += 1,
                    Ok(Some(false)) => report.released += 1,
                    Ok(None) => report.left += 1,
                    Err(why) => {
                        report.left += 1;
                        tracing::warn!(key = %record.key, %why, "cannot reconcile yet");
                    }
                }
            }
            match page.next {
                Some(next) => after = Some(next),
                None => return Ok(report),
            }
        }
    }

    /// `Some(true)`: settled; `Some(false)`: released; `None`: left.
    async fn reconcile_one(&self, record: &idem::Record) -> Result<Option<bool>, String> {
        let operation_id = format!("{}:{}", record.scope.tenant(), record.key);
        let mut tx = self.store.pool().begin().await.map_err(|e| e.to_string())?;
        // Take the record over (only possible once its lease lapsed): the
        // attempt that was running, if it still is, is fenced out.
        let reservation = self
            .store
            .reserve_in(
                &mut tx,
                ReserveRequest {
                    scope: &record.scope,
                    key: &record.key,
                    fingerprint: record.fingerprint,
                    owner: OwnerToken::random(),
                    lease: self.config.lease,
                    retention: self.config.retention,
                    on_lease_expiry: LeaseExpiry::Retry,
                },
            )
            .await
            .map_err(|e| e.to_string())?;
        let Reservation::Acquired(lease) = reservation else {
            return Ok(None);
        };
        let payment_id: Option<String> =
            sqlx::query_scalar("SELECT id FROM payments WHERE tenant = $1 AND operation_id = $2")
                .bind(record.scope.tenant())
                .bind(&operation_id)
                .fetch_optional(&mut *tx)
                .await
                .map_err(|e| e.to_string())?;
        let charge = self.provider.lookup(&operation_id).await?;
        let (Some(payment_id), Some(charge)) = (payment_id, charge) else {
            // Never charged (or never got as far as the attempt row): the
            // key is free again, and a retry runs the payment from the
            // start with the same operation id.
            self.store
                .release_in(&mut tx, &record.scope, &record.key, &lease)
                .await
                .map_err(|e| e.to_string())?;
            tx.commit().await.map_err(|e| e.to_string())?;
            return Ok(Some(false));
        };
        self.record_in(
            &mut tx,
            &record.scope,
            &record.key,
            &lease,
            &payment_id,
            &charge,
        )
        .await?;
        tx.commit().await.map_err(|e| e.to_string())?;
        Ok(Some(true))
    }
}
