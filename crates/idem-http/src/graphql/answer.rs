//! A GraphQL route's answers: the layer's refusals as GraphQL errors, and
//! what a service's answer says about its mutation.

use bytes::Bytes;
use http::{HeaderValue, Response, header};
use http_body_util::Full;
use idem::json::Value;

use crate::{Problem, retry_after_secs};

/// The media type GraphQL over HTTP answers in, when the client accepts it.
const GRAPHQL_RESPONSE: &str = "application/graphql-response+json";

/// The answer to a request the layer refused or could not run: the
/// problem's status (`409` in flight, `422` key reused, `400` missing
/// key), a GraphQL response with one error and no `data` (nothing ran
/// for it), and `Retry-After` where the problem has one:
///
/// ```json
/// {"errors":[{"message":"…","extensions":{"code":"IDEMPOTENCY_KEY_REUSED",
///   "type":"https://idem.dev/problems/idempotency-key-reused","status":422}}]}
/// ```
///
/// `extensions.code` is the problem's slug in GraphQL's upper-case style;
/// `retry_after` (seconds) is there when the problem has one. The media
/// type is `application/graphql-response+json` when `accept` names it,
/// `application/json` otherwise.
pub fn refusal(problem: &Problem, accept: Option<&str>) -> Response<Full<Bytes>> {
    let mut extensions = serde_json::json!({
        "code": problem.slug().to_ascii_uppercase().replace('-', "_"),
        "type": problem.type_uri(),
        "status": problem.status().as_u16(),
    });
    if let Some(after) = problem.retry_after() {
        extensions["retry_after"] = serde_json::json!(retry_after_secs(after));
    }
    let body = serde_json::json!({
        "errors": [{
            "message": format!("{}: {}", problem.title(), problem.detail()),
            "extensions": extensions,
        }]
    });
    let mut resp = Response::new(Full::new(Bytes::from(body.to_string())));
    *resp.status_mut() = problem.status();
    let media = if accept.is_some_and(|a| a.to_ascii_lowercase().contains(GRAPHQL_RESPONSE)) {
        GRAPHQL_RESPONSE
    } else {
        "application/json"
    };
    resp.headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static(media));
    if let Some(after) = problem.retry_after() {
        resp.headers_mut().insert(
            header::RETRY_AFTER,
            HeaderValue::from(retry_after_secs(after)),
        );
    }
    resp
}

/// What a GraphQL answer says about its mutation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// `data` is there and not `null`, with or without `errors`: the
    /// mutation ran (or partly ran), and its answer is as final as its
    /// status says.
    Ran,
    /// `errors`, no `data` (absent or `null`), and no error with a
    /// `path`: a request error, raised before execution began (the
    /// document did not parse or validate, its variables did not coerce,
    /// a persisted query the service does not know). The GraphQL
    /// specification gives every field error a `path`, and a request
    /// error none. Nothing ran, so its key is released and the corrected
    /// request, or the same one sent with its document, runs.
    NotRun,
    /// `errors`, no `data`, and an error with a `path`: execution began
    /// and a field error reached the root. What the mutation did before
    /// it failed is unknown; judged as a `5xx`, by the route's
    /// `on_server_error`.
    Failed,
}

/// Reads a GraphQL answer's body. An answer without an `errors` member is
/// never parsed; one that is not a JSON object ran as its status says.
pub fn classify(body: &[u8]) -> Outcome {
    // Most answers are data: only one whose bytes hold `"errors"` is
    // parsed (a member name written with escapes is not looked for).
    if !body.windows(8).any(|w| w == b"\"errors\"") {
        return Outcome::Ran;
    }
    let Ok(Value::Object(answer)) = idem::json_strict(body) else {
        return Outcome::Ran;
    };
    let errors = match answer.get("errors") {
        Some(Value::Array(errors)) if !errors.is_empty() => errors,
        _ => return Outcome::Ran,
    };
    match answer.get("data") {
        None | Some(Value::Null) => {}
        Some(_) => return Outcome::Ran,
    }
    let in_a_field = errors
        .iter()
        .any(|e| matches!(e, Value::Object(e) if e.contains_key("path")));
    if in_a_field {
        Outcome::Failed
    } else {
        Outcome::NotRun
    }
}
