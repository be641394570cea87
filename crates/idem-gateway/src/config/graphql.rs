//! `protocol = "graphql"`: a route whose requests are GraphQL over HTTP,
//! each judged by the operation it selects. The route's `key_header`,
//! `key_from` (a JSON Pointer into the request, such as
//! `/variables/idempotencyKey`) and `require_key` say where a mutation's
//! key is and whether it needs one.

use http::Method;
use idem_http::RoutePolicy;
use idem_http::graphql::GraphQl;

use super::error::ConfigError;
use super::file::{PolicyConfig, Source};
use super::policy::speaks;

/// Whether the route speaks GraphQL; its other keys checked against it.
pub(super) fn is_graphql(
    src: &Source<'_>,
    at: &str,
    route: &PolicyConfig,
    method: &Method,
) -> Result<bool, ConfigError> {
    speaks(
        src,
        at,
        route,
        method,
        ("graphql", "GraphQL"),
        &[
            ("fingerprint_include", route.fingerprint_include.is_some()),
            ("fingerprint_exclude", route.fingerprint_exclude.is_some()),
            ("webhook", route.webhook.is_some()),
        ],
        "a GraphQL route fingerprints the operation its request selects, its document normalised and its variables",
    )
}

/// The route's policy, speaking GraphQL: its key places and whether a
/// mutation needs a key move from the route to its [`GraphQl`].
pub(super) fn with_graphql(policy: RoutePolicy) -> RoutePolicy {
    let graphql = GraphQl::new()
        .with_key_headers(policy.key_headers.clone())
        .with_key_pointers(policy.key_from.iter().cloned().collect())
        .with_require_key(policy.require_key);
    policy.with_graphql(graphql)
}
