//! The admin API's answers for failures: RFC 9457 problems.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use idem::StoreError;
use idem::operator::OperatorError;
use idem_http::{Problem, ProblemKind, ProblemType};

use crate::error::error_chain;

/// The admin API's own problem types, beside the idempotency contract's
/// [`ProblemKind`]s (the store being unavailable is one of those).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum AdminProblem {
    /// No or a wrong bearer token (401).
    Unauthorized,
    /// A cross-site or non-loopback request to an admin listener without a
    /// token (403).
    Forbidden,
    /// No such record (404).
    RecordNotFound,
    /// The record's state forbids the action (409).
    RecordConflict,
    /// A malformed query or path parameter (400).
    InvalidParameter,
    /// No such route or file (404).
    NotFound,
}

impl From<AdminProblem> for ProblemType {
    fn from(p: AdminProblem) -> Self {
        match p {
            AdminProblem::Unauthorized => ProblemType::new(
                "admin-unauthorized",
                "Admin token required",
                StatusCode::UNAUTHORIZED,
            ),
            AdminProblem::Forbidden => ProblemType::new(
                "admin-forbidden",
                "Admin request refused",
                StatusCode::FORBIDDEN,
            ),
            AdminProblem::RecordNotFound => ProblemType::new(
                "record-not-found",
                "No such idempotency record",
                StatusCode::NOT_FOUND,
            ),
            AdminProblem::RecordConflict => ProblemType::new(
                "record-state-conflict",
                "The record's state does not allow this action",
                StatusCode::CONFLICT,
            ),
            AdminProblem::InvalidParameter => ProblemType::new(
                "invalid-parameter",
                "Invalid parameter",
                StatusCode::BAD_REQUEST,
            ),
            AdminProblem::NotFound => {
                ProblemType::new("not-found", "Not found", StatusCode::NOT_FOUND)
            }
        }
    }
}

/// A problem+json response.
pub(super) fn problem(ty: impl Into<ProblemType>, detail: impl Into<String>) -> Response {
    Problem::of_type(ty.into(), detail)
        .to_response()
        .into_response()
}

pub(super) fn store_problem(err: &StoreError) -> Response {
    problem(ProblemKind::StoreUnavailable, error_chain(err))
}

pub(super) fn operator_problem(err: &OperatorError) -> Response {
    match err {
        OperatorError::NotFound => problem(AdminProblem::RecordNotFound, err.to_string()),
        OperatorError::LeaseLive { retry_after } => {
            Problem::of_type(AdminProblem::RecordConflict.into(), err.to_string())
                .with_retry_after(*retry_after)
                .to_response()
                .into_response()
        }
        OperatorError::Store(e) => store_problem(e),
        _ => problem(AdminProblem::RecordConflict, err.to_string()),
    }
}

pub(super) async fn not_found() -> Response {
    problem(AdminProblem::NotFound, "no such admin route")
}
