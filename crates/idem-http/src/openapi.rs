//! The routes' idempotency contract as an OpenAPI 3.1 document: for each
//! configured route, the key's parameter (required or not, its format),
//! the refusals with their problem `code`s, the replay and retention
//! headers, and the whole policy in an `x-idempotency` extension, so that
//! SDK generators and API portals pick them up.
//!
//! ```
//! use http::Method;
//! use idem_http::{RoutePolicy, Routes, openapi};
//!
//! let routes = Routes::default()
//!     .route(Method::POST, "/v1/orders/{id}/capture", RoutePolicy::default().with_require_key(true))?;
//! let doc = openapi::document(&routes);
//! let op = &doc["paths"]["/v1/orders/{id}/capture"]["post"];
//! assert_eq!(op["parameters"][0]["name"], "id");
//! assert_eq!(op["parameters"][1]["name"], "Idempotency-Key");
//! assert_eq!(op["parameters"][1]["required"], true);
//! assert_eq!(op["x-idempotency"]["retention_seconds"], 86400);
//! # Ok::<(), idem_http::PatternError>(())
//! ```

use std::collections::BTreeSet;

use http::StatusCode;
use idem::{ServerError, UNKNOWN_OUTCOME_STATUSES};
use serde_json::{Map, Value, json};

use crate::request::header_label;
use crate::{MissingTenant, PROBLEM_JSON, ProblemKind, RoutePolicy, Routes};

/// The OpenAPI 3.1 document of `routes`' contract. Requests that match no
/// configured route and are protected by the defaults have no path of
/// their own: the defaults are in the document's `x-idempotency`.
pub fn document(routes: &Routes) -> Value {
    let mut paths = Map::new();
    for (method, pattern, policy) in routes.entries() {
        let path = paths
            .entry(pattern.as_str().to_owned())
            .or_insert_with(|| Value::Object(Map::new()));
        let params: BTreeSet<&str> = pattern.param_names().collect();
        path[method.as_str().to_ascii_lowercase()] = operation(policy, &params);
    }
    json!({
        "openapi": "3.1.0",
        "info": {
            "title": "Idempotency contract",
            "version": env!("CARGO_PKG_VERSION"),
            "description": "What the idempotency gateway in front of this API promises for each protected route: where the key goes, its format, the refusals, how a replay is marked, and how long answers are kept. Every refusal is an RFC 9457 problem document with a stable `code`.",
        },
        "paths": paths,
        "components": {
            "schemas": { "Problem": problem_schema() },
        },
        "x-idempotency": { "defaults": extension(routes.defaults(), true) },
    })
}

/// One route's operation object.
fn operation(policy: &RoutePolicy, path_params: &BTreeSet<&str>) -> Value {
    let mut parameters: Vec<Value> = path_params
        .iter()
        .map(|name| json!({ "name": name, "in": "path", "required": true, "schema": { "type": "string" } }))
        .collect();
    // With one place for the key, a required key makes that header
    // required; with several, any one will do, so none is.
    let one_place = policy.key_headers.len() == 1 && policy.key_from.is_none();
    for name in &policy.key_headers {
        parameters.push(json!({
            "name": header_label(name),
            "in": "header",
            "required": policy.require_key && one_place,
            "description": key_description(policy),
            "schema": key_schema(policy),
        }));
    }
    // A webhook route's key is its delivery id: its headers are the
    // provider's, each required.
    if let Some(hook) = &policy.webhook {
        for name in hook.scheme().headers() {
            parameters.push(json!({
                "name": header_label(&name),
                "in": "header",
                "required": true,
                "description": format!("Set by the {} webhook sender; verified before anything else", hook.provider()),
                "schema": { "type": "string" },
            }));
        }
    }
    // A GraphQL route reads its key for mutations only: never required
    // of the route's every request.
    if let Some(gql) = &policy.graphql {
        for name in &gql.key_headers {
            parameters.push(json!({
                "name": header_label(name),
                "in": "header",
                "required": false,
                "description": "The idempotency key of a mutation (x-idempotency.graphql); queries and subscriptions pass unrecorded",
                "schema": key_schema(policy),
            }));
        }
    }
    let mut responses = Map::new();
    let success = json!({
        "description": "The upstream's answer, stored and replayed for the key's retention",
        "headers": answer_headers(policy),
    });
    responses.insert("default".to_owned(), success);
    let mut refusals: Vec<(StatusCode, Vec<ProblemKind>)> = Vec::new();
    let mut refuse = |status: StatusCode, kind: ProblemKind| match refusals
        .iter_mut()
        .find(|(s, _)| *s == status)
    {
        Some((_, kinds)) => kinds.push(kind),
        None => refusals.push((status, vec![kind])),
    };
    match (&policy.webhook, &policy.jsonrpc) {
        // A JSON-RPC route's refusals are error objects in 200 answers
        // (x-idempotency.jsonrpc), not problem documents.
        (None, Some(_)) => {}
        (Some(hook), _) => {
            refuse(
                StatusCode::UNAUTHORIZED,
                ProblemKind::WebhookSignatureInvalid,
            );
            if hook.scheme().has_timestamp() {
                refuse(
                    StatusCode::UNAUTHORIZED,
                    ProblemKind::WebhookTimestampRefused,
                );
            }
            refuse(StatusCode::BAD_REQUEST, ProblemKind::WebhookDeliveryInvalid);
        }
        (None, None) => {
            let graphql = policy.graphql.as_deref();
            if policy.require_key || graphql.is_some_and(|g| g.require_key) {
                refuse(StatusCode::BAD_REQUEST, ProblemKind::KeyMissing);
            }
            if graphql.is_some() {
                refuse(StatusCode::BAD_REQUEST, ProblemKind::GraphQlRequestInvalid);
                refuse(StatusCode::BAD_REQUEST, ProblemKind::GraphQlBatchRefused);
            }
            refuse(StatusCode::BAD_REQUEST, ProblemKind::KeyInvalid);
            refuse(StatusCode::BAD_REQUEST, ProblemKind::KeyAmbiguous);
        }
    }
    if policy.jsonrpc.is_none() {
        refuse(policy.mismatch_status, ProblemKind::KeyReused);
        refuse(StatusCode::CONFLICT, ProblemKind::InProgress);
        if policy.lookup.is_some() {
            refuse(StatusCode::CONFLICT, ProblemKind::OutcomeReconciling);
        }
        refuse(StatusCode::CONFLICT, ProblemKind::OutcomeHeld);
    }
    refuse(StatusCode::PAYLOAD_TOO_LARGE, ProblemKind::BodyTooLarge);
    if policy.on_missing_tenant == MissingTenant::Refuse && policy.webhook.is_none() {
        refuse(StatusCode::UNAUTHORIZED, ProblemKind::TenantMissing);
    }
    if policy.engine.fail_mode == idem::FailMode::Closed {
        refuse(
            StatusCode::SERVICE_UNAVAILABLE,
            ProblemKind::StoreUnavailable,
        );
    }
    refusals.sort_by_key(|(s, _)| s.as_u16());
    for (status, kinds) in refusals {
        responses.insert(status.as_str().to_owned(), refusal(policy, status, &kinds));
    }
    json!({
        "parameters": parameters,
        "responses": responses,
        "x-idempotency": extension(policy, false),
    })
}

/// What the key header's description says: where else the key may be,
/// and whether it is required.
fn key_description(policy: &RoutePolicy) -> String {
    let mut text = String::from(
        "Idempotency key: a retry with the same key and request gets the original answer; the same key with another request is refused.",
    );
    if let Some(field) = &policy.key_from {
        text.push_str(&format!(
            " Without the header, the key is read from the JSON body's {field}."
        ));
    }
    if policy.require_key {
        text.push_str(" A key is required.");
    }
    text
}

/// The key's schema: visible ASCII up to 255 bytes, the route's minimum,
/// and its format as a pattern (with `format: uuid` for the UUID forms).
fn key_schema(policy: &RoutePolicy) -> Value {
    let contract = &policy.contract;
    let mut schema = json!({
        "type": "string",
        "minLength": contract.key_min_length,
        "maxLength": idem::MAX_KEY_LEN,
    });
    if let Some(format) = &contract.key_format {
        schema["pattern"] = Value::String(format.pattern());
        if format.name().starts_with("uuid") {
            schema["format"] = Value::String("uuid".to_owned());
        }
    }
    schema
}

/// The headers of a protected route's answers: the replay markers, and
/// the retention when the route advertises it.
fn answer_headers(policy: &RoutePolicy) -> Value {
    let mut headers = Map::new();
    for name in &policy.contract.replay_headers {
        headers.insert(
            header_label(name),
            json!({
                "description": "Present, `true`, on an answer replayed from the store",
                "schema": { "type": "string", "enum": ["true"] },
            }),
        );
    }
    if policy.contract.retention_header {
        headers.insert(
            "Idempotency-TTL".to_owned(),
            json!({
                "description": "How many seconds this route keeps a key's answer",
                "schema": { "type": "integer", "minimum": 0 },
            }),
        );
    }
    Value::Object(headers)
}

/// A refusal's response object: the problem document with its codes.
fn refusal(policy: &RoutePolicy, status: StatusCode, kinds: &[ProblemKind]) -> Value {
    let codes: Vec<&str> = kinds.iter().map(|k| k.slug()).collect();
    // A GraphQL route's refusals are GraphQL responses: one error whose
    // `extensions.code` is the problem code in upper case.
    let content = match &policy.graphql {
        Some(_) => {
            let upper: Vec<String> = codes
                .iter()
                .map(|c| c.to_ascii_uppercase().replace('-', "_"))
                .collect();
            json!({ "application/json": { "schema": {
                "type": "object",
                "required": ["errors"],
                "properties": { "errors": { "type": "array", "items": {
                    "type": "object",
                    "required": ["message", "extensions"],
                    "properties": {
                        "message": { "type": "string" },
                        "extensions": { "type": "object", "required": ["code", "type", "status"], "properties": {
                            "code": { "enum": upper },
                            "type": { "type": "string", "format": "uri" },
                            "status": { "type": "integer" },
                            "retry_after": { "type": "integer" },
                        } },
                    },
                } } },
            } } })
        }
        None => json!({ PROBLEM_JSON: { "schema": {
            "allOf": [
                { "$ref": "#/components/schemas/Problem" },
                { "properties": { "code": { "enum": codes } } },
            ],
        } } }),
    };
    let mut response = json!({
        "description": kinds.iter().map(|k| k.title()).collect::<Vec<_>>().join("; "),
        "content": content,
    });
    let retry_after = status == StatusCode::SERVICE_UNAVAILABLE
        || (status == StatusCode::CONFLICT && policy.contract.held_retry_after.is_some());
    if retry_after {
        response["headers"] = json!({
            "Retry-After": {
                "description": "Seconds to wait before retrying with the same key",
                "schema": { "type": "integer", "minimum": 1 },
            },
        });
    }
    response
}

/// The `x-idempotency` extension: the route's whole policy, in the words
/// of the configuration file.
fn extension(policy: &RoutePolicy, defaults: bool) -> Value {
    let contract = &policy.contract;
    let mut ext = json!({
        "retention_seconds": policy.engine.retention.as_secs(),
        "key": {
            "headers": policy.key_headers.iter().map(header_label).collect::<Vec<_>>(),
            "body_field": policy.key_from.as_ref().map(|p| p.to_string()),
            "required": policy.require_key,
            "format": contract.key_format.as_ref().map(|f| f.name().to_owned()),
            "min_length": contract.key_min_length,
            "max_length": idem::MAX_KEY_LEN,
        },
        "replay_headers": contract.replay_headers.iter().map(header_label).collect::<Vec<_>>(),
        "mismatch_status": policy.mismatch_status.as_u16(),
        "released_statuses": policy.engine.release_statuses,
        "held_statuses": UNKNOWN_OUTCOME_STATUSES
            .iter()
            .filter(|s| !policy.engine.release_statuses.contains(s))
            .collect::<Vec<_>>(),
        "on_server_error": match policy.engine.on_server_error {
            ServerError::Store => "store",
            ServerError::Hold => "hold",
            ServerError::Release => "release",
        },
        "not_retained": match contract.not_retained {
            crate::NotRetained::Problem => "problem",
            crate::NotRetained::Empty => "empty",
        },
    });
    if defaults {
        ext["methods"] = json!(["POST", "PATCH"]);
    }
    if let Some(rpc) = &policy.jsonrpc {
        let codes: Map<String, Value> = ProblemKind::ALL
            .iter()
            .filter(|k| crate::jsonrpc::error_code(**k) != -31000)
            .map(|k| (k.slug().to_owned(), json!(crate::jsonrpc::error_code(*k))))
            .collect();
        ext["jsonrpc"] = json!({
            "methods": rpc.rules().iter().map(|r| json!({
                "method": r.method,
                "tools": match &r.tools {
                    crate::jsonrpc::Tools::All => json!("all"),
                    crate::jsonrpc::Tools::Allow(t) => json!({ "only": t }),
                    crate::jsonrpc::Tools::Deny(t) => json!({ "except": t }),
                },
                "key_headers": r.key_headers.iter().map(header_label).collect::<Vec<_>>(),
                "key_fields": r.key_pointers.iter().map(|p| p.to_string()).collect::<Vec<_>>(),
                "require_key": r.require_key,
            })).collect::<Vec<_>>(),
            "error_codes": codes,
        });
    }
    if let Some(gql) = &policy.graphql {
        ext["graphql"] = json!({
            "protects": "mutation",
            "key_headers": gql.key_headers.iter().map(header_label).collect::<Vec<_>>(),
            "key_fields": gql.key_pointers.iter().map(|p| p.to_string()).collect::<Vec<_>>(),
            "require_key": gql.require_key,
            "batches": "refused when holding a mutation",
            "errors": {
                "request_error": "release",
                "field_error_at_root": "on_server_error",
            },
        });
    }
    if let Some(hook) = &policy.webhook {
        ext["webhook"] = json!({
            "provider": hook.provider().name(),
            "tenant": hook.tenant(),
            "headers": hook.scheme().headers().iter().map(header_label).collect::<Vec<_>>(),
            "tolerance_seconds": hook.scheme().has_timestamp().then(|| hook.tolerance().as_secs()),
        });
    }
    ext
}

/// The problem document every refusal is.
fn problem_schema() -> Value {
    let codes: Vec<&str> = ProblemKind::ALL.iter().map(|k| k.slug()).collect();
    json!({
        "type": "object",
        "description": "An RFC 9457 problem document. `code` is the last segment of `type`; published codes never change.",
        "required": ["type", "code", "title", "status"],
        "properties": {
            "type": { "type": "string", "format": "uri" },
            "code": { "type": "string", "enum": codes },
            "title": { "type": "string" },
            "status": { "type": "integer" },
            "detail": { "type": "string" },
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Contract, KeyFormat, Profile};
    use http::Method;

    #[test]
    fn a_route_states_its_key_refusals_and_markers() {
        let policy = RoutePolicy::default().with_require_key(true).with_contract(
            Contract::of(Profile::Ietf)
                .with_key_format(KeyFormat::UuidV7)
                .with_key_min_length(36),
        );
        let routes = Routes::default()
            .route(Method::POST, "/v1/orders/{id}/capture", policy)
            .expect("route");
        let doc = document(&routes);
        let op = &doc["paths"]["/v1/orders/{id}/capture"]["post"];
        assert_eq!(op["parameters"][0]["name"], "id");
        assert_eq!(op["parameters"][0]["in"], "path");
        let key = &op["parameters"][1];
        assert_eq!(key["name"], "Idempotency-Key");
        assert_eq!(key["required"], true);
        assert_eq!(key["schema"]["format"], "uuid");
        assert_eq!(key["schema"]["minLength"], 36);
        let headers = &op["responses"]["default"]["headers"];
        assert!(headers["Idempotency-Replayed"].is_object(), "{headers}");
        assert!(headers["Idempotency-TTL"].is_object(), "{headers}");
        let codes = |status: &str| {
            op["responses"][status]["content"][PROBLEM_JSON]["schema"]["allOf"][1]["properties"]
                ["code"]["enum"]
                .clone()
        };
        assert_eq!(
            codes("400"),
            json!([
                "idempotency-key-missing",
                "idempotency-key-invalid",
                "idempotency-key-ambiguous"
            ])
        );
        assert_eq!(codes("422"), json!(["idempotency-key-reused"]));
        assert_eq!(
            codes("409"),
            json!([
                "idempotency-request-in-progress",
                "idempotency-outcome-held"
            ])
        );
        assert!(op["responses"]["409"]["headers"]["Retry-After"].is_object());
        assert_eq!(op["x-idempotency"]["key"]["format"], "uuidv7");
        assert_eq!(op["x-idempotency"]["held_statuses"], json!([502, 504]));
    }

    #[test]
    fn a_key_in_several_places_is_required_in_none_of_them() {
        let policy = RoutePolicy::default()
            .with_require_key(true)
            .with_key_from("/idempotency_key".parse().expect("pointer"));
        let routes = Routes::default()
            .route(Method::POST, "/v1/payments", policy)
            .expect("route");
        let op = &document(&routes)["paths"]["/v1/payments"]["post"];
        assert_eq!(op["parameters"][0]["required"], false);
        assert_eq!(op["x-idempotency"]["key"]["body_field"], "/idempotency_key");
        assert_eq!(op["x-idempotency"]["key"]["required"], true);
    }
}
