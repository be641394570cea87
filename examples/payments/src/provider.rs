//! `payments provider`: a fake card processor that behaves like a real one
//! where it matters for idempotency.
//!
//! * It honours its own idempotency by operation id: a charge request with
//!   an operation id it has seen returns the original charge (declined
//!   ones too) and charges nothing.
//! * It fails the ways real processors fail, chosen per request by the
//!   payment method (like a processor's test cards) or at random at rates
//!   set with `POST /v1/faults`:
//!   `pm_card_declined` → a decline (recorded, `402`);
//!   `pm_timeout_after_charge` → charges, then does not answer for a minute
//!   (the caller times out not knowing);
//!   `pm_error_before_charge` → `500` without charging;
//!   `pm_slow` → answers after 300 ms.
//! * `GET /v1/charges?operation_id=…` shows the charge for an operation
//!   (what a reconciler asks), and `GET /v1/stats` counts real charges, so
//!   tests can prove nothing was charged twice.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::{Deserialize, Serialize};

/// A charge request.
#[derive(Debug, Clone, Deserialize, Serialize)]
pub struct ChargeRequest {
    /// The caller's stable id for this operation: a retry sends the same.
    pub operation_id: String,
    /// Amount in the currency's minor unit.
    pub amount_cents: i64,
    /// ISO 4217 code.
    pub currency: String,
    /// The card or wallet (test methods trigger faults; see the module).
    pub payment_method_id: String,
}

/// A charge the provider made (or declined).
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq, Eq)]
pub struct Charge {
    /// `ch_…`.
    pub id: String,
    /// The operation it answers.
    pub operation_id: String,
    /// `succeeded` or `declined`.
    pub status: String,
    /// Amount in minor units.
    pub amount_cents: i64,
    /// ISO 4217 code.
    pub currency: String,
    /// How many requests asked for this operation.
    pub requests: u64,
}

/// Random fault rates (0.0–1.0) and a base latency.
#[derive(Debug, Clone, Copy, Default, Deserialize, Serialize)]
pub struct Faults {
    /// Charge, then never answer.
    #[serde(default)]
    pub timeout_after_charge: f64,
    /// Answer 500 without charging.
    #[serde(default)]
    pub error_before_charge: f64,
    /// Added to every charge request.
    #[serde(default)]
    pub latency_ms: u64,
}

#[derive(Default)]
struct Ledger {
    charges: HashMap<String, Charge>,
    faults: Faults,
}

/// The provider's state.
#[derive(Clone, Default)]
pub struct Provider {
    ledger: Arc<Mutex<Ledger>>,
    requests: Arc<AtomicU64>,
    seq: Arc<AtomicU64>,
}

impl std::fmt::Debug for Provider {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Provider")
            .field("requests", &self.requests.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

/// How long a "timeout after charge" keeps the caller waiting.
const HANG: Duration = Duration::from_secs(60);

/// What one charge request will do.
enum Fate {
    Charge,
    Decline,
    ChargeThenHang,
    FailBeforeCharge,
}

impl Provider {
    /// The HTTP routes.
    pub fn router(self) -> Router {
        Router::new()
            .route("/v1/charges", post(charge).get(lookup))
            .route("/v1/faults", post(set_faults))
            .route("/v1/stats", get(stats))
            .with_state(self)
    }

    fn fate(&self, method: &str) -> (Fate, u64) {
        let ledger = self.ledger.lock().unwrap_or_else(|p| p.into_inner());
        let faults = ledger.faults;
        let roll = (idem::OwnerToken::random().as_u128() % 10_000) as f64 / 10_000.0;
        let fate = match method {
            "pm_card_declined" => Fate::Decline,
            "pm_timeout_after_charge" => Fate::ChargeThenHang,
            "pm_error_before_charge" => Fate::FailBeforeCharge,
            _ if roll < faults.timeout_after_charge => Fate::ChargeThenHang,
            _ if roll < faults.timeout_after_charge + faults.error_before_charge => {
                Fate::FailBeforeCharge
            }
            _ => Fate::Charge,
        };
        let latency = faults.latency_ms + if method == "pm_slow" { 300 } else { 0 };
        (fate, latency)
    }
}

async fn charge(State(p): State<Provider>, Json(req): Json<ChargeRequest>) -> Response {
    p.requests.fetch_add(1, Ordering::Relaxed);
    if req.operation_id.is_empty() || req.amount_cents <= 0 {
        return (
            StatusCode::BAD_REQUEST,
            "operation_id and a positive amount are required",
        )
            .into_response();
    }
    let (fate, latency) = p.fate(&req.payment_method_id);
    if latency > 0 {
        tokio::time::sleep(Duration::from_millis(latency)).await;
    }
    let (charge, fresh) = {
        let mut ledger = p.ledger.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(existing) = ledger.charges.get_mut(&req.operation_id) {
            // The provider's own idempotency: the original answer.
            existing.requests += 1;
            (existing.clone(), false)
        } else {
            if matches!(fate, Fate::FailBeforeCharge) {
                drop(ledger);
                return (StatusCode::INTERNAL_SERVER_ERROR, "processor unavailable")
                    .into_response();
            }
            let charge = Charge {
                id: format!("ch_{}", p.seq.fetch_add(1, Ordering::Relaxed) + 1),
                operation_id: req.operation_id.clone(),
                status: if matches!(fate, Fate::Decline) {
                    "declined".to_owned()
                } else {
                    "succeeded".to_owned()
                },
                amount_cents: req.amount_cents,
                currency: req.currency.clone(),
                requests: 1,
            };
            ledger
                .charges
                .insert(req.operation_id.clone(), charge.clone());
            (charge, true)
        }
    };
    if fresh && matches!(fate, Fate::ChargeThenHang) {
        tokio::time::sleep(HANG).await;
    }
    let status = if charge.status == "declined" {
        StatusCode::PAYMENT_REQUIRED
    } else if fresh {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    (status, Json(charge)).into_response()
}

#[derive(Deserialize)]
struct LookupQuery {
    operation_id: String,
}

async fn lookup(
    State(p): State<Provider>,
    Query(q): Query<LookupQuery>,
) -> Json<serde_json::Value> {
    let ledger = p.ledger.lock().unwrap_or_else(|e| e.into_inner());
    let charges: Vec<&Charge> = ledger.charges.get(&q.operation_id).into_iter().collect();
    Json(serde_json::json!({ "charges": charges }))
}

async fn set_faults(State(p): State<Provider>, Json(faults): Json<Faults>) -> Json<Faults> {
    p.ledger.lock().unwrap_or_else(|e| e.into_inner()).faults = faults;
    Json(faults)
}

async fn stats(State(p): State<Provider>) -> Json<serde_json::Value> {
    let ledger = p.ledger.lock().unwrap_or_else(|e| e.into_inner());
    let succeeded = ledger
        .charges
        .values()
        .filter(|c| c.status == "succeeded")
        .count();
    Json(serde_json::json!({
        "requests": p.requests.load(Ordering::Relaxed),
        "operations": ledger.charges.len(),
        "succeeded": succeeded,
    }))
}
