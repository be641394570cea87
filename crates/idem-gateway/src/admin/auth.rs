//! The admin token: every route but `/healthz` and the dashboard's static
//! files needs `Authorization: Bearer <token>` once one is configured.

use std::sync::Arc;

use axum::Router;
use axum::extract::{Request, State};
use axum::http::{HeaderValue, header};
use axum::middleware::{self, Next};
use axum::response::Response;

use super::problem::{AdminProblem, problem};

/// Compares in time independent of where the first difference is.
pub(super) fn same_secret(given: &[u8], expected: &[u8]) -> bool {
    given.len() == expected.len()
        && given
            .iter()
            .zip(expected)
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0
}

/// Whether `host` (a `Host` or `Origin` authority, port allowed) names
/// this machine's loopback.
pub(super) fn is_loopback_host(host: &str) -> bool {
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

/// Whether a request's `Host` and `Origin` (each when present) name
/// loopback. A value that is not text names nothing, so it is refused,
/// not skipped.
pub(super) fn from_same_machine(headers: &http::HeaderMap) -> bool {
    let host_ok = headers
        .get_all(header::HOST)
        .iter()
        .all(|v| v.to_str().is_ok_and(is_loopback_host));
    let origin_ok = headers.get_all(header::ORIGIN).iter().all(|v| {
        v.to_str().is_ok_and(|o| {
            o.split_once("://")
                .is_some_and(|(_, h)| is_loopback_host(h))
        })
    });
    host_ok && origin_ok
}

pub(super) async fn require_token(
    State(token): State<Option<Arc<str>>>,
    req: Request,
    next: Next,
) -> Response {
    if token.is_none() {
        // No token (a loopback listener): a web page in the operator's
        // browser must not reach the API through DNS rebinding (a foreign
        // Host) nor make it act cross-site (a foreign Origin).
        if !from_same_machine(req.headers()) {
            return problem(
                AdminProblem::Forbidden,
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
                AdminProblem::Unauthorized,
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
