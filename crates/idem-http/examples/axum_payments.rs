//! An axum payments API made retry-safe by one layer.
//!
//! `POST /v1/payments` charges (here: counts) once per `Idempotency-Key`
//! and tenant; retries get the original answer with `Idempotent-Replayed:
//! true`; a key reused with another body gets `422`. Records live in an
//! embedded SQLite file.
//!
//! Run: `cargo run -p idem-http --example axum_payments` then
//!
//! ```text
//! curl -i -X POST localhost:3000/v1/payments -H 'Idempotency-Key: k1' \
//!      -H 'Authorization: Bearer sk_1' -H 'Content-Type: application/json' \
//!      -d '{"amount_cents":500,"currency":"EUR"}'
//! ```
//!
//! Environment: `ADDR` (default `127.0.0.1:3000`; `127.0.0.1:0` picks a
//! port), `IDEM_DB` (default `payments-example.db`). Prints
//! `listening on ADDR` once ready.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use axum::extract::State;
use axum::http::{Method, StatusCode};
use axum::routing::{get, post};
use axum::{Json, Router};
use idem_http::{IdempotencyLayer, RoutePolicy, Routes};
use idem_sqlite::SqliteStore;
use serde_json::{Value, json};

#[derive(Clone, Default)]
struct Ledger {
    charges: Arc<AtomicU64>,
}

async fn create_payment(
    State(ledger): State<Ledger>,
    Json(body): Json<Value>,
) -> (StatusCode, Json<Value>) {
    let Some(amount) = body
        .get("amount_cents")
        .and_then(Value::as_u64)
        .filter(|a| *a > 0)
    else {
        return (
            StatusCode::UNPROCESSABLE_ENTITY,
            Json(json!({"error": "amount_cents must be a positive integer"})),
        );
    };
    let n = ledger.charges.fetch_add(1, Ordering::SeqCst) + 1;
    (
        StatusCode::CREATED,
        Json(json!({"id": format!("pay_{n}"), "amount_cents": amount, "status": "succeeded"})),
    )
}

async fn count(State(ledger): State<Ledger>) -> Json<Value> {
    Json(json!({"charges": ledger.charges.load(Ordering::SeqCst)}))
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let addr = std::env::var("ADDR").unwrap_or_else(|_| "127.0.0.1:3000".to_owned());
    let db = std::env::var("IDEM_DB").unwrap_or_else(|_| "payments-example.db".to_owned());
    let routes = Routes::default().route(
        Method::POST,
        "/v1/payments",
        RoutePolicy::default().with_require_key(true),
    )?;
    let app = Router::new()
        .route("/v1/payments", post(create_payment))
        .route("/v1/charges/count", get(count))
        .layer(IdempotencyLayer::new(SqliteStore::open(&db)?).with_routes(routes))
        .with_state(Ledger::default());
    let listener = tokio::net::TcpListener::bind(&addr).await?;
    println!("listening on {}", listener.local_addr()?);
    axum::serve(listener, app).await?;
    Ok(())
}
