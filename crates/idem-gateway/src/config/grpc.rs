//! `protocol = "grpc"`: a route of gRPC calls, `POST
//! /package.Service/Method` (or a pattern over a service's methods), its
//! key in request metadata (`key_header`, `idempotency-key` by default).
//! Every gRPC call is judged by its `grpc-status` and refused in gRPC
//! statuses on any route; this key says the route is one, so that its
//! policy starts where gRPC's needs it to.

use http::Method;

use super::error::ConfigError;
use super::file::{PolicyConfig, Source};
use super::policy::speaks;

/// Whether the route takes gRPC calls; its other keys checked against it.
pub(super) fn is_grpc(
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
        ("grpc", "gRPC"),
        &[
            ("key_from", route.key_from.is_some()),
            ("fingerprint_include", route.fingerprint_include.is_some()),
            ("fingerprint_exclude", route.fingerprint_exclude.is_some()),
            ("webhook", route.webhook.is_some()),
        ],
        "a gRPC call's key is in its metadata and its fingerprint covers its messages as sent",
    )
}
