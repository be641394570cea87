//! `protocol = "jsonrpc"` and `[[route.call]]`: a route whose calls are
//! JSON-RPC 2.0 (MCP, A2A, any JSON-RPC API), each method it protects
//! with where its key is and whether it is required.

use http::Method;
use idem_http::jsonrpc::{JsonRpc, MethodRule, TOOLS_CALL, Tools};
use idem_http::{JsonPointer, TenantSource};

use super::error::ConfigError;
use super::file::{CallConfig, PolicyConfig, Source};
use super::policy::{key_headers, post_route_of_kind};

/// The route's JSON-RPC rules, if it speaks JSON-RPC; its other keys
/// checked against them.
pub(super) fn jsonrpc(
    src: &Source<'_>,
    at: &str,
    route: &PolicyConfig,
    method: &Method,
    tenant: &TenantSource,
) -> Result<Option<JsonRpc>, ConfigError> {
    let file = || src.file.display();
    let protocol = match &route.protocol {
        None => None,
        Some(v) if ["http", "graphql", "grpc"].contains(&v.get_ref().as_str()) => None,
        Some(v) if v.get_ref() == "jsonrpc" => Some(v),
        Some(v) => {
            return Err(src.error(
                &format!("{at}.protocol"),
                v,
                "expected \"http\" (the default), \"jsonrpc\", \"graphql\" or \"grpc\"",
            ));
        }
    };
    let Some(_) = protocol else {
        if !route.call.is_empty() {
            return Err(ConfigError::new(format!(
                "{}: {at}.call: [[route.call]] names JSON-RPC methods; write protocol = \"jsonrpc\" on the route",
                file()
            )));
        }
        return Ok(None);
    };
    post_route_of_kind(
        src,
        at,
        method,
        "a JSON-RPC route",
        &[
            ("key_header", route.key_header.is_some()),
            ("key_from", route.key_from.is_some()),
            ("require_key", route.require_key.is_some()),
            ("webhook", route.webhook.is_some()),
        ],
        "a JSON-RPC route says where each method's key is under [[route.call]]",
    )?;
    if route.call.is_empty() {
        return Err(ConfigError::new(format!(
            "{}: {at}: a JSON-RPC route protects the methods its [[route.call]] tables name; name at least one, such as method = \"tools/call\"",
            file()
        )));
    }
    let rules = route
        .call
        .iter()
        .enumerate()
        .map(|(i, c)| rule(src, &format!("{at}.call[{i}]"), c, tenant))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Some(JsonRpc::new(rules)))
}

fn rule(
    src: &Source<'_>,
    at: &str,
    cfg: &CallConfig,
    tenant: &TenantSource,
) -> Result<MethodRule, ConfigError> {
    let key = |k: &str| format!("{at}.{k}");
    let method = cfg.method.as_ref().ok_or_else(|| {
        ConfigError::new(format!(
            "{}: {at} has no method: write method = \"tools/call\" (the JSON-RPC method)",
            src.file.display()
        ))
    })?;
    let name = method.get_ref().trim();
    if name.is_empty() {
        return Err(src.error(&key("method"), method, "a method has a name"));
    }
    let mut rule = MethodRule::new(name);
    let tools = match (&cfg.tools, &cfg.tools_except) {
        (Some(_), Some(v)) => {
            return Err(src.error(
                &key("tools_except"),
                v,
                "set tools or tools_except, not both",
            ));
        }
        (Some(v), None) => Some((v, Tools::Allow(v.get_ref().clone()))),
        (None, Some(v)) => Some((v, Tools::Deny(v.get_ref().clone()))),
        (None, None) => None,
    };
    if let Some((v, tools)) = tools {
        if name != TOOLS_CALL {
            return Err(src.error(&key("tools"), v, "only method = \"tools/call\" names tools"));
        }
        rule = rule.with_tools(tools);
    }
    if let Some(v) = &cfg.key_header {
        let credential = match tenant {
            TenantSource::Header(h) => Some(h),
            _ => None,
        };
        rule = rule.with_key_headers(key_headers(src, &key("key_header"), v, credential)?);
    }
    if let Some(v) = &cfg.key_field {
        let fields = v
            .get_ref()
            .to_vec()
            .iter()
            .map(|f| {
                f.parse::<JsonPointer>()
                    .map_err(|why| format!("{f:?}: {why}"))
            })
            .collect::<Result<Vec<_>, _>>()
            .map_err(|why| src.error(&key("key_field"), v, why))?;
        rule = rule.with_key_pointers(fields);
    }
    if rule.key_headers.is_empty() && rule.key_pointers.is_empty() {
        let at_key = cfg.key_header.as_ref().or(cfg.key_field.as_ref());
        return Err(match at_key {
            Some(v) => src.error(
                &key("key_header"),
                v,
                "name a header or a field for the key",
            ),
            None => ConfigError::new(format!("{at}: no place for the key")),
        });
    }
    if let Some(v) = cfg.require_key {
        rule = rule.with_require_key(v);
    }
    Ok(rule)
}
