//! The route table: `[defaults]` and each `[[route]]`, checked against
//! each other (a route no request can reach is refused).

use std::time::Duration;

use idem_http::{PathPattern, RoutePolicy, Routes, TenantSource};

use super::defaults;
use super::error::ConfigError;
use super::file::{FileConfig, PolicyConfig, Source};
use super::graphql::{is_graphql, with_graphql};
use super::grpc::is_grpc;
use super::jsonrpc::jsonrpc;
use super::policy::{apply, holding_server_errors, lookup};
use super::values::{duration, parse_method, positive};
use super::webhook::{base_policy, webhook};

/// The routes of `file`, and the upstream time-out of `[defaults]` (which
/// no route sets apart). `tenant` keeps every route from taking its key
/// from the header that carries the tenant's credential: a key is stored
/// and listed as sent.
pub(super) fn routes(
    src: &Source<'_>,
    file: &FileConfig,
    tenant: &TenantSource,
) -> Result<(Routes, Duration), ConfigError> {
    let base = RoutePolicy::default();
    let unset = PolicyConfig::default();
    let defaults_cfg = file.defaults.as_ref().unwrap_or(&unset);
    for (key, value) in [
        ("method", &defaults_cfg.method),
        ("path", &defaults_cfg.path),
    ] {
        if let Some(v) = value {
            return Err(src.error(
                &format!("defaults.{key}"),
                v,
                "only [[route]] entries have a method and a path",
            ));
        }
    }
    if defaults_cfg.protocol.is_some() || !defaults_cfg.call.is_empty() {
        return Err(ConfigError::new(format!(
            "{}: [defaults]: protocol and [[defaults.call]] belong to one route; write them under that [[route]]",
            src.file.display()
        )));
    }
    if defaults_cfg.webhook.is_some() {
        return Err(ConfigError::new(format!(
            "{}: [defaults.webhook]: a webhook sender belongs to one route; write it as [route.webhook] under that [[route]]",
            src.file.display()
        )));
    }
    if defaults_cfg.reconcile.is_some() {
        return Err(ConfigError::new(format!(
            "{}: [defaults.reconcile]: a lookup belongs to one route; write it as [route.reconcile] under that [[route]]",
            src.file.display()
        )));
    }
    let mut upstream_timeout = defaults::UPSTREAM_TIMEOUT;
    if let Some(v) = &defaults_cfg.upstream_timeout {
        upstream_timeout = positive(
            src,
            "defaults.upstream_timeout",
            v,
            duration(src, "defaults.upstream_timeout", v)?,
        )?;
    }
    // A key is stored and listed as sent: never the tenant's credential.
    let credential = match tenant {
        TenantSource::Header(name) => Some(name),
        _ => None,
    };
    let defaults = apply(src, "defaults", defaults_cfg, base, credential)?;
    // Case, parameters and suffixes are ignored unless turned off: a route
    // that matches more spellings only protects more (the fingerprint
    // keeps the path sent), and the upstreams that route them leniently
    // are common (ASP.NET, servlet containers, Rails).
    let mut routes = Routes::new(defaults.clone())
        .with_ignore_case(file.ignore_path_case != Some(false))
        .with_ignore_path_parameters(file.ignore_path_parameters != Some(false))
        .with_ignore_path_suffixes(file.ignore_path_suffixes != Some(false));
    for (i, r) in file.route.iter().enumerate() {
        let at = format!("route[{i}]");
        if let Some(v) = &r.upstream_timeout {
            return Err(src.error(
                &format!("{at}.upstream_timeout"),
                v,
                "upstream_timeout is set once, in [defaults]",
            ));
        }
        let method = r.method.as_ref().ok_or_else(|| {
            ConfigError::new(format!("{}: {at} has no method", src.file.display()))
        })?;
        let m = parse_method(method.get_ref())
            .map_err(|why| src.error(&format!("{at}.method"), method, why))?;
        let path = r
            .path
            .as_ref()
            .ok_or_else(|| ConfigError::new(format!("{}: {at} has no path", src.file.display())))?;
        if let Ok(pattern) = PathPattern::parse(path.get_ref())
            && let Some(earlier) = routes.shadowing(&m, &pattern)
        {
            let first = &file.route[earlier];
            return Err(src.error(
                &format!("{at}.path"),
                path,
                format!(
                    "this route is never chosen: route[{earlier}] (line {}, {m} {:?}) comes first and matches every path it does; remove this one, or move it above route[{earlier}] if it is meant to be the more specific",
                    first.path.as_ref().map_or(0, |p| src.line(p.span())),
                    first.path.as_ref().map_or("", |p| p.get_ref().as_str()),
                ),
            ));
        }
        let hook = r
            .webhook
            .as_ref()
            .map(|w| webhook(src, &at, r, &m, w))
            .transpose()?;
        let rpc = jsonrpc(src, &at, r, &m, tenant)?;
        let gql = is_graphql(src, &at, r, &m)?;
        let grpc = is_grpc(src, &at, r, &m)?;
        let base = match (&hook, &rpc) {
            (Some(hook), _) => base_policy(&defaults, hook.provider()),
            (None, Some(_)) => holding_server_errors(&defaults),
            (None, None) if gql || grpc => holding_server_errors(&defaults),
            (None, None) => defaults.clone(),
        };
        let mut policy = apply(src, &at, r, base, credential)?;
        if let Some(hook) = hook {
            policy = policy.with_webhook(hook);
        }
        if let Some(rpc) = rpc {
            policy = policy.with_jsonrpc(rpc);
        }
        if gql {
            policy = with_graphql(policy);
        }
        if let Some(rc) = &r.reconcile {
            let at = format!("{at}.reconcile");
            let lookup = lookup(src, &at, rc)?;
            if let (Ok(pattern), Some(lookup_path)) = (PathPattern::parse(path.get_ref()), &rc.path)
                && let Some(missing) = lookup
                    .params()
                    .find(|name| !pattern.param_names().any(|p| p == *name))
            {
                return Err(src.error(
                    &format!("{at}.path"),
                    lookup_path,
                    format!(
                        "{{{missing}}} is not a parameter of the route's path {:?}",
                        path.get_ref()
                    ),
                ));
            }
            policy = policy.with_lookup(lookup);
        }
        routes = routes
            .route(m, path.get_ref(), policy)
            .map_err(|e| src.error(&format!("{at}.path"), path, e))?;
    }
    Ok((routes, upstream_timeout))
}
