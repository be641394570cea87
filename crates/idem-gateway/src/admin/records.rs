//! The records API: list, show, release, resolve, delete.

use std::collections::HashMap;

use axum::body::Bytes;
use axum::extract::{FromRequestParts, Path, Query, State};
use axum::http::request::Parts;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use idem::operator::{self, OperatorError};
use idem::store::MAX_PAGE;
use idem::{IdempotencyKey, ListFilter, ListRecords, Purge, RecordState, Scope, Store};
use idem_http::Problem;
use serde::Serialize;

use super::problem::{AdminProblem, operator_problem, problem, store_problem};
use super::state::AdminState;
use crate::records::{
    DEFAULT_PAGE, InvalidParameter, RecordView, ResolveRequest, decode_cursor, encode_cursor,
};

/// The query of the list route, validated; errors name the parameter.
pub(super) fn list_filter(query: &HashMap<String, String>) -> Result<ListFilter, InvalidParameter> {
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
            "tenant" => {
                return Err(InvalidParameter::from(
                    "tenant: must not be empty".to_owned(),
                ));
            }
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
                return Err(InvalidParameter::from(format!(
                    "{other}: unknown parameter (state, older_than, tenant, limit, after)"
                )));
            }
        }
    }
    Ok(filter)
}

#[derive(Serialize)]
pub(super) struct PageView {
    records: Vec<RecordView>,
    next: Option<String>,
}

pub(super) fn json<T: Serialize>(status: StatusCode, value: &T) -> Response {
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

pub(super) async fn list(State(state): State<AdminState>, Params(query): Params) -> Response {
    let filter = match list_filter(&query) {
        Ok(f) => f,
        Err(why) => return problem(AdminProblem::InvalidParameter, why.to_string()),
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
pub(super) struct RecordId(Scope, IdempotencyKey);

impl<S: Send + Sync> FromRequestParts<S> for RecordId {
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Response> {
        let invalid = |why: String| problem(AdminProblem::InvalidParameter, why);
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
pub(super) struct Params(HashMap<String, String>);

impl<S: Send + Sync> FromRequestParts<S> for Params {
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Response> {
        Query::<HashMap<String, String>>::from_request_parts(parts, state)
            .await
            .map(|Query(q)| Self(q))
            .map_err(|e| {
                problem(
                    AdminProblem::InvalidParameter,
                    format!("query: {}", e.body_text()),
                )
            })
    }
}

pub(super) async fn show(
    State(state): State<AdminState>,
    RecordId(scope, key): RecordId,
    Params(query): Params,
) -> Response {
    let body = match query.get("body").map(String::as_str) {
        None | Some("false") => false,
        Some("true") => true,
        Some(other) => {
            return problem(
                AdminProblem::InvalidParameter,
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
pub(super) fn expected_attempt(query: &HashMap<String, String>) -> Result<Option<u32>, Problem> {
    for name in query.keys() {
        if name != "attempt" {
            return Err(Problem::of_type(
                AdminProblem::InvalidParameter.into(),
                format!("{name}: unknown parameter (attempt)"),
            ));
        }
    }
    query
        .get("attempt")
        .map(|v| {
            v.parse::<u32>().ok().filter(|n| *n >= 1).ok_or_else(|| {
                Problem::of_type(
                    AdminProblem::InvalidParameter.into(),
                    format!("attempt: {v:?} is not an attempt number (1, 2, …)"),
                )
            })
        })
        .transpose()
}

pub(super) async fn release(
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

pub(super) async fn resolve(
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
            AdminProblem::InvalidParameter,
            "body: send the answer as application/json",
        );
    }
    let outcome = serde_json::from_slice::<ResolveRequest>(&body)
        .map_err(|e| InvalidParameter::from(format!("body: {e}")))
        .and_then(|r| r.outcome(state.default_retention));
    let outcome = match outcome {
        Ok(o) => o,
        Err(why) => return problem(AdminProblem::InvalidParameter, why.to_string()),
    };
    match operator::resolve(&state.store, &scope, &key, &outcome, attempt).await {
        Ok(record) => {
            tracing::warn!(reason = "idempotency_operator_resolve", tenant = scope.tenant(), operation = scope.operation(), %key, state = %record.state, status = outcome.response.status, "record resolved by an operator");
            json(StatusCode::OK, &RecordView::new(&record, false))
        }
        Err(err) => operator_problem(&err),
    }
}

pub(super) async fn delete(
    State(state): State<AdminState>,
    RecordId(scope, key): RecordId,
) -> Response {
    match state.store.delete(&scope, &key).await {
        Ok(true) => {
            tracing::warn!(reason = "idempotency_operator_delete", tenant = scope.tenant(), operation = scope.operation(), %key, "record deleted by an operator");
            StatusCode::NO_CONTENT.into_response()
        }
        Ok(false) => operator_problem(&OperatorError::NotFound),
        Err(err) => store_problem(&err),
    }
}
