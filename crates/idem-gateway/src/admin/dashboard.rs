//! The live dashboard's static files.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};

use super::problem::{AdminProblem, problem};

pub(super) fn redirect(to: &'static str) -> Response {
    (
        StatusCode::PERMANENT_REDIRECT,
        [(header::LOCATION, HeaderValue::from_static(to))],
    )
        .into_response()
}

pub(super) fn asset(file: &str) -> Response {
    let (body, kind) = match file {
        "index.html" => (
            include_str!("../../assets/dashboard/index.html"),
            "text/html; charset=utf-8",
        ),
        "app.js" => (
            include_str!("../../assets/dashboard/app.js"),
            "text/javascript; charset=utf-8",
        ),
        "style.css" => (
            include_str!("../../assets/dashboard/style.css"),
            "text/css; charset=utf-8",
        ),
        _ => return problem(AdminProblem::NotFound, "no such dashboard file"),
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
