//! `/readyz` and `/metrics`.

use axum::extract::State;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use idem::{IdempotencyKey, Scope, Store};

use crate::error::error_chain;

use super::state::AdminState;

pub(super) async fn readyz(State(state): State<AdminState>) -> Response {
    let probe = Scope::new("idem-readyz", "probe").expect("valid probe scope");
    let key: IdempotencyKey = "probe".parse().expect("valid probe key");
    match state.store.get(&probe, &key).await {
        Ok(_) => (StatusCode::OK, "ready\n").into_response(),
        Err(err) => (
            StatusCode::SERVICE_UNAVAILABLE,
            // The error says what is unavailable, once.
            format!("not ready: {}\n", error_chain(&err)),
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
