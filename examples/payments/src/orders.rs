//! `payments orders`: an Order service that never applies a payment twice.
//!
//! `POST /v1/orders` `{amount_cents, currency}` creates an order in
//! `payment_pending` (behind the idempotency layer: a keyed create is
//! created once); `GET /v1/orders/{id}` shows it. A consumer runner takes
//! `PaymentAuthorized` events from the broker (see [`crate::Bus`]) and, in
//! one transaction with the inbox row, moves the order `payment_pending →
//! paid` with a conditional update and enqueues `OrderPaid` in its own
//! outbox, carrying the event's W3C trace context on:
//!
//! * another payment event (on Kafka, the payment topic holds all of
//!   them) is acknowledged and skipped; one whose type cannot be told is
//!   parked;
//! * a redelivered event is an inbox duplicate: nothing happens;
//! * the same payment announced again under another message id finds the
//!   order already paid by that payment: an idempotent no-op;
//! * another payment for a paid order, a payment for an unknown order or
//!   with the wrong amount is refused and parked for a person to look at.

use std::sync::Arc;

use axum::extract::{Path, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use bytes::Bytes;
use idem_http::{IdempotencyLayer, RoutePolicy, Routes, TenantSource};
use idem_messaging::trace::TraceContext;
use idem_messaging::{Handler, HandlerError, Message, headers};
use idem_postgres::PgStore;
use idem_postgres::outbox::{Outbox, OutboxMessage};
use idem_postgres::sqlx::{self, Postgres, Row, Transaction};
use serde::{Deserialize, Serialize};

use crate::api::{self, PaymentAuthorized};
use crate::problem_response;

/// The consumer's name in the inbox.
pub const CONSUMER: &str = "orders";

/// The aggregate type of the orders' events (the `order` of subject
/// `<prefix>.order.<message_type>` and of Kafka topic `<prefix>.order`).
pub const AGGREGATE_TYPE: &str = "order";

/// The message type of the [`OrderPaid`] event.
pub const ORDER_PAID: &str = "OrderPaid";

const SCHEMA: &str = "CREATE TABLE IF NOT EXISTS orders (
    id           text PRIMARY KEY,
    amount_cents bigint NOT NULL CHECK (amount_cents > 0),
    currency     text NOT NULL,
    state        text NOT NULL CHECK (state IN ('payment_pending', 'paid')),
    payment_id   text UNIQUE,
    created_at   timestamptz NOT NULL DEFAULT now(),
    paid_at      timestamptz
)";

/// An order as the service shows it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Order {
    /// `ord_…`.
    pub id: String,
    /// Minor units.
    pub amount_cents: i64,
    /// ISO 4217.
    pub currency: String,
    /// `payment_pending` or `paid`.
    pub state: String,
    /// The payment that paid it.
    pub payment_id: Option<String>,
}

/// The `OrderPaid` event.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct OrderPaid {
    /// The order.
    pub order_id: String,
    /// The payment that paid it.
    pub payment_id: String,
}

/// The service: its database (orders, inbox, outbox, idempotency records).
#[derive(Clone)]
pub struct Orders {
    store: Arc<PgStore>,
}

impl std::fmt::Debug for Orders {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Orders").finish_non_exhaustive()
    }
}

impl Orders {
    /// Connects (creating idem's tables and `orders`).
    pub async fn connect(database: &str) -> Result<Self, String> {
        let store = crate::connect_store(database, &[SCHEMA]).await?;
        Ok(Self {
            store: Arc::new(store),
        })
    }

    /// The database (for the runner, operators and tests).
    pub fn store(&self) -> &PgStore {
        &self.store
    }

    /// `POST /v1/orders` (idempotent with a key) and `GET /v1/orders/{id}`.
    pub fn router(&self) -> Router {
        let routes = Routes::default()
            .route(
                axum::http::Method::POST,
                "/v1/orders",
                RoutePolicy::default().with_max_request_body(16 * 1024),
            )
            .unwrap_or_default();
        Router::new()
            .route("/v1/orders", post(create))
            .route("/v1/orders/{id}", get(show))
            .layer(
                IdempotencyLayer::from_arc(Arc::clone(&self.store))
                    .with_routes(routes)
                    .with_tenant(TenantSource::Authorization),
            )
            .with_state(self.clone())
    }
}

#[derive(Deserialize)]
struct NewOrder {
    amount_cents: Option<i64>,
    currency: Option<String>,
}

async fn create(State(svc): State<Orders>, body: Bytes) -> Response {
    let new: NewOrder = match serde_json::from_slice(&body) {
        Ok(n) => n,
        Err(e) => {
            return problem_response(
                StatusCode::BAD_REQUEST,
                "invalid_order",
                format!("the body is not an order: {e}"),
            );
        }
    };
    let amount = match new.amount_cents {
        Some(a) if a > 0 => a,
        _ => {
            return problem_response(
                StatusCode::BAD_REQUEST,
                "invalid_order",
                "amount_cents must be a positive integer",
            );
        }
    };
    let currency = match new.currency {
        Some(c) if c.len() == 3 && c.bytes().all(|b| b.is_ascii_uppercase()) => c,
        _ => {
            return problem_response(
                StatusCode::BAD_REQUEST,
                "invalid_order",
                "currency must be a three-letter ISO 4217 code such as EUR",
            );
        }
    };
    let id = format!("ord_{}", uuid::Uuid::new_v4().simple());
    let inserted = sqlx::query(
        "INSERT INTO orders (id, amount_cents, currency, state) VALUES ($1, $2, $3, 'payment_pending')",
    )
    .bind(&id)
    .bind(amount)
    .bind(&currency)
    .execute(svc.store.pool())
    .await;
    match inserted {
        Ok(_) => (
            StatusCode::CREATED,
            [(header::LOCATION, format!("/v1/orders/{id}"))],
            Json(Order {
                id,
                amount_cents: amount,
                currency,
                state: "payment_pending".to_owned(),
                payment_id: None,
            }),
        )
            .into_response(),
        Err(e) => problem_response(
            StatusCode::SERVICE_UNAVAILABLE,
            "temporarily_unavailable",
            e.to_string(),
        ),
    }
}

async fn show(State(svc): State<Orders>, Path(id): Path<String>) -> Response {
    let row = sqlx::query(
        "SELECT id, amount_cents, currency, state, payment_id FROM orders WHERE id = $1",
    )
    .bind(&id)
    .fetch_optional(svc.store.pool())
    .await;
    let order = |r: &sqlx::postgres::PgRow| -> Result<Order, sqlx::Error> {
        Ok(Order {
            id: r.try_get("id")?,
            amount_cents: r.try_get("amount_cents")?,
            currency: r.try_get("currency")?,
            state: r.try_get("state")?,
            payment_id: r.try_get("payment_id")?,
        })
    };
    match row {
        Ok(Some(r)) => match order(&r) {
            Ok(o) => Json(o).into_response(),
            Err(e) => {
                problem_response(StatusCode::INTERNAL_SERVER_ERROR, "internal", e.to_string())
            }
        },
        Ok(None) => problem_response(StatusCode::NOT_FOUND, "not_found", format!("no order {id}")),
        Err(e) => problem_response(
            StatusCode::SERVICE_UNAVAILABLE,
            "temporarily_unavailable",
            e.to_string(),
        ),
    }
}

/// The type of a payment event: its `Idem-Message-Type` header (Kafka,
/// where one topic holds all of a payment's events), else the last part
/// of a `<prefix>.payment.<message_type>` subject (NATS). `None` when
/// neither says.
pub fn payment_event_type(msg: &Message) -> Option<&str> {
    if let Some(kind) = msg.header(headers::MESSAGE_TYPE) {
        return Some(kind).filter(|k| !k.is_empty());
    }
    let (rest, kind) = msg.subject.rsplit_once('.')?;
    let aggregate = rest.rsplit('.').next()?;
    (aggregate == api::AGGREGATE_TYPE && !kind.is_empty()).then_some(kind)
}

/// The consumer's handler for payment events; see the module docs.
///
/// It applies `PaymentAuthorized` and nothing else. Another payment event
/// type is acknowledged without a change: the runner still records it in
/// the inbox and moves the payment's ordering guard past it, so the
/// payment's next event is not held back waiting for it (parking it would
/// leave that gap open for good). A message whose type cannot be told is
/// parked: it was not published by a relay.
#[derive(Debug, Clone, Copy, Default)]
pub struct PaymentHandler;

impl Handler for PaymentHandler {
    async fn handle(
        &self,
        tx: &mut Transaction<'static, Postgres>,
        msg: &Message,
    ) -> Result<(), HandlerError> {
        match payment_event_type(msg) {
            Some(api::PAYMENT_AUTHORIZED) => {}
            Some(other) => {
                tracing::debug!(
                    message_id = %msg.id,
                    message_type = other,
                    "not a {}: skipped",
                    api::PAYMENT_AUTHORIZED
                );
                return Ok(());
            }
            None => {
                return Err(HandlerError::permanent(format!(
                    "message {:?} on {} has no type (no {} header, and the subject is not <prefix>.{}.<message_type>)",
                    msg.id,
                    msg.subject,
                    headers::MESSAGE_TYPE,
                    api::AGGREGATE_TYPE
                )));
            }
        }
        let event: PaymentAuthorized = msg.json()?;
        apply_payment(tx, &event, msg.trace_context().as_ref()).await
    }
}

/// In `tx`: `payment_pending → paid` for the event's order, with its
/// `OrderPaid` event carrying `trace` (the payment event's trace
/// context); a repeat of the same payment changes nothing.
pub async fn apply_payment(
    tx: &mut Transaction<'static, Postgres>,
    event: &PaymentAuthorized,
    trace: Option<&TraceContext>,
) -> Result<(), HandlerError> {
    let paid = sqlx::query(
        "UPDATE orders SET state = 'paid', payment_id = $2, paid_at = now() \
         WHERE id = $1 AND state = 'payment_pending' AND amount_cents = $3 AND currency = $4",
    )
    .bind(&event.order_id)
    .bind(&event.payment_id)
    .bind(event.amount_cents)
    .bind(&event.currency)
    .execute(&mut **tx)
    .await?
    .rows_affected();
    if paid == 1 {
        let payload = serde_json::to_string(&OrderPaid {
            order_id: event.order_id.clone(),
            payment_id: event.payment_id.clone(),
        })
        .map_err(|e| HandlerError::permanent(e.to_string()))?;
        let msg = OutboxMessage::new(AGGREGATE_TYPE, &event.order_id, ORDER_PAID, &payload)
            .and_then(|msg| crate::traced(msg, trace))?;
        Outbox::enqueue(tx, &msg).await?;
        return Ok(());
    }
    // Why not: look at the order as it is.
    let row =
        sqlx::query("SELECT state, payment_id, amount_cents, currency FROM orders WHERE id = $1")
            .bind(&event.order_id)
            .fetch_optional(&mut **tx)
            .await?;
    let Some(row) = row else {
        return Err(HandlerError::permanent(format!(
            "payment {} is for order {}, which does not exist",
            event.payment_id, event.order_id
        )));
    };
    let state: String = row.try_get("state")?;
    let payment_id: Option<String> = row.try_get("payment_id")?;
    if state == "paid" && payment_id.as_deref() == Some(event.payment_id.as_str()) {
        // The same payment again (a producer's re-publish under another
        // message id): already applied.
        return Ok(());
    }
    if state == "paid" {
        return Err(HandlerError::permanent(format!(
            "order {} is already paid by {}; payment {} conflicts (refund it)",
            event.order_id,
            payment_id.unwrap_or_default(),
            event.payment_id
        )));
    }
    let (amount, currency): (i64, String) =
        (row.try_get("amount_cents")?, row.try_get("currency")?);
    Err(HandlerError::permanent(format!(
        "payment {} of {} {} does not match order {} of {amount} {currency}",
        event.payment_id, event.amount_cents, event.currency, event.order_id
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(subject: &str, headers: &[(&str, &str)]) -> Message {
        Message {
            id: "m1".to_owned(),
            subject: subject.to_owned(),
            headers: headers
                .iter()
                .map(|(n, v)| ((*n).to_owned(), (*v).to_owned()))
                .collect(),
            payload: Bytes::from_static(b"{}"),
            deliveries: 1,
        }
    }

    #[test]
    fn payment_event_types_come_from_the_header_else_the_subject() {
        // NATS: the subject's last part.
        assert_eq!(
            payment_event_type(&message("idem.payment.PaymentAuthorized", &[])),
            Some("PaymentAuthorized")
        );
        assert_eq!(
            payment_event_type(&message("idem.v2.payment.PaymentRefunded", &[])),
            Some("PaymentRefunded")
        );
        // Kafka: the header (the source's subject is `<topic>.<type>`, or
        // the bare topic without one).
        assert_eq!(
            payment_event_type(&message(
                "idem.payment.PaymentRefunded",
                &[("Idem-Message-Type", "PaymentRefunded")]
            )),
            Some("PaymentRefunded")
        );
        assert_eq!(
            payment_event_type(&message(
                "idem.payment",
                &[("idem-message-type", "PaymentAuthorized")]
            )),
            Some("PaymentAuthorized")
        );
        // Neither says.
        for untyped in [
            message("idem.payment", &[]),
            message("payment", &[]),
            message("idem.order.OrderPaid", &[]),
            message("idem.payment.", &[]),
            message(
                "idem.payment.PaymentAuthorized",
                &[("Idem-Message-Type", "")],
            ),
        ] {
            assert_eq!(payment_event_type(&untyped), None, "{untyped:?}");
        }
    }
}
