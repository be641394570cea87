//! Route policies: `[defaults]`, each `[[route]]` and its `[route.reconcile]`
//! lookup, and `[tenant]`.

use std::time::Duration;

use http::{HeaderName, Method, StatusCode};
use idem::{FailMode, InFlight, LeaseExpiry, Policy};
use idem_http::{
    BodyFields, JsonPointer, Lookup, MissingTenant, PathSpelling, RoutePolicy, TenantSource,
};
use toml::Spanned;

use super::error::ConfigError;
use super::file::{OneOrMany, PolicyConfig, ReconcileConfig, Source, TenantConfig};
use super::values::{duration, each, header_names, positive, size};

pub(super) fn tenant_source(
    src: &Source<'_>,
    t: &TenantConfig,
) -> Result<TenantSource, ConfigError> {
    let from = t.from.get_ref().as_str();
    let name = |example: &str| {
        let name = t.name.as_ref().ok_or_else(|| {
            src.error(
                "tenant.from",
                &t.from,
                format!("from = \"{from}\" needs name = \"{example}\""),
            )
        })?;
        Ok::<_, ConfigError>((name, name.get_ref().trim().to_owned()))
    };
    let header = |(name, text): (&Spanned<String>, String)| {
        HeaderName::from_bytes(text.to_ascii_lowercase().as_bytes())
            .map_err(|_| src.error("tenant.name", name, "not a header name"))
    };
    if from != "trusted_header"
        && let Some(v) = &t.trusted_proxies
    {
        return Err(src.error(
            "tenant.trusted_proxies",
            v,
            "only from = \"trusted_header\" trusts proxies",
        ));
    }
    match from {
        "authorization" => Ok(TenantSource::Authorization),
        "header" => Ok(TenantSource::Header(header(name("X-Api-Key")?)?)),
        "cookie" => {
            let (span, text) = name("session")?;
            if text.is_empty()
                || !text
                    .bytes()
                    .all(|b| b.is_ascii_graphic() && !b"()<>@,;:\\\"/[]?={}".contains(&b))
            {
                return Err(src.error("tenant.name", span, "not a cookie name"));
            }
            Ok(TenantSource::Cookie(text))
        }
        "trusted_header" => {
            let name = header(name("X-Authenticated-User")?)?;
            let Some(list) = &t.trusted_proxies else {
                return Err(src.error(
                    "tenant.from",
                    &t.from,
                    "from = \"trusted_header\" needs trusted_proxies = [\"10.0.0.0/8\", …]: the addresses of the proxies that set the header (anyone else could write it)",
                ));
            };
            let proxies = list
                .get_ref()
                .iter()
                .map(|p| {
                    p.parse::<ipnet::IpNet>()
                        .or_else(|_| p.parse::<std::net::IpAddr>().map(ipnet::IpNet::from))
                        .map_err(|_| {
                            src.error(
                                "tenant.trusted_proxies",
                                list,
                                format!("{p:?} is not an address or a CIDR range"),
                            )
                        })
                })
                .collect::<Result<Vec<_>, _>>()?;
            if proxies.is_empty() {
                return Err(src.error("tenant.trusted_proxies", list, "name at least one proxy"));
            }
            Ok(TenantSource::TrustedHeader { name, proxies })
        }
        "none" => Ok(TenantSource::Single("default".to_owned())),
        _ => Err(src.error(
            "tenant.from",
            &t.from,
            "expected \"authorization\", \"header\", \"cookie\", \"trusted_header\" or \"none\"",
        )),
    }
}

/// `[route.reconcile]`, validated.
pub(super) fn lookup(
    src: &Source<'_>,
    at: &str,
    cfg: &ReconcileConfig,
) -> Result<Lookup, ConfigError> {
    let key = |k: &str| format!("{at}.{k}");
    let path = cfg.path.as_ref().ok_or_else(|| {
        ConfigError::new(format!(
            "{}: {at} has no path: write path = \"/v1/payments/by-key/{{key}}\", the upstream's lookup of an operation by its Idempotency-Key",
            src.file.display()
        ))
    })?;
    let method = match &cfg.method {
        Some(m) => Method::from_bytes(m.get_ref().to_ascii_uppercase().as_bytes())
            .ok()
            .filter(|m| {
                [Method::GET, Method::POST, Method::HEAD].contains(m) || m.as_str() == "QUERY"
            })
            .ok_or_else(|| {
                src.error(&key("method"), m, "expected \"GET\" (or POST, HEAD, QUERY)")
            })?,
        None => Method::GET,
    };
    let mut lookup =
        Lookup::new(method, path.get_ref()).map_err(|e| src.error(&key("path"), path, e))?;
    if let Some(v) = &cfg.status {
        let status = StatusCode::from_u16(*v.get_ref())
            .ok()
            .filter(|s| s.is_success())
            .ok_or_else(|| {
                src.error(
                    &key("status"),
                    v,
                    "must be a 2xx status (what the original request answers, e.g. 201)",
                )
            })?;
        lookup = lookup.with_status(status);
    }
    let mut schedule = *lookup.schedule();
    let every =
        |name: &str, v: &Option<Spanned<String>>| -> Result<Option<Duration>, ConfigError> {
            v.as_ref()
                .map(|v| positive(src, &key(name), v, duration(src, &key(name), v)?))
                .transpose()
        };
    if let Some(d) = every("first", &cfg.first)? {
        schedule = schedule.with_first(d);
    }
    if let Some(d) = every("max_pause", &cfg.max_pause)? {
        schedule = schedule.with_max_pause(d);
    }
    if let Some(d) = every("settle", &cfg.settle)? {
        schedule = schedule.with_settle(d);
    }
    if let Some(d) = every("give_up", &cfg.give_up)? {
        schedule = schedule.with_give_up(d);
    }
    Ok(lookup.with_schedule(schedule))
}

/// Headers no route may take its key from: what they carry is a secret,
/// and a key is kept and shown as it was sent.
const CREDENTIALS: [HeaderName; 3] = [
    http::header::AUTHORIZATION,
    http::header::PROXY_AUTHORIZATION,
    http::header::COOKIE,
];

/// The headers a key may be read from (`key_header`): never one that
/// carries a credential, `tenant_credential` (the tenant's header) among
/// them.
pub(super) fn key_headers(
    src: &Source<'_>,
    key: &str,
    v: &Spanned<OneOrMany>,
    tenant_credential: Option<&HeaderName>,
) -> Result<Vec<HeaderName>, ConfigError> {
    let names = Spanned::new(v.span(), v.get_ref().to_vec());
    let names = header_names(src, key, &names)?;
    if let Some(credential) = names
        .iter()
        .find(|n| CREDENTIALS.contains(n) || Some(*n) == tenant_credential)
    {
        return Err(src.error(
            key,
            v,
            format!(
                "{credential} carries a credential, not a key: keys are stored and listed in plain"
            ),
        ));
    }
    Ok(names)
}

/// The policy a JSON-RPC, GraphQL or gRPC route starts from, before its
/// own keys: an error in an answer that says the call began (a JSON-RPC
/// internal or server error, a GraphQL field error at the root, a gRPC
/// `UNKNOWN` or `INTERNAL`), and a `5xx`, holds the key as an unknown
/// outcome, since it does not prove the call did not run. Stored, a client could never get past it with
/// its key; released, its retry could run the call twice.
pub(super) fn holding_server_errors(defaults: &RoutePolicy) -> RoutePolicy {
    let engine = defaults
        .engine
        .clone()
        .with_on_server_error(idem::ServerError::Hold);
    defaults.clone().with_engine(engine)
}

/// Whether the route says `protocol = "<protocol>"` (`("grpc", "gRPC")`:
/// the value, and its name in messages); if so, it is checked as a route
/// of that kind ([`post_route_of_kind`]).
pub(super) fn speaks(
    src: &Source<'_>,
    at: &str,
    route: &PolicyConfig,
    method: &Method,
    (protocol, name): (&str, &str),
    decided: &[(&str, bool)],
    why: &str,
) -> Result<bool, ConfigError> {
    if route
        .protocol
        .as_ref()
        .is_none_or(|v| v.get_ref() != protocol)
    {
        return Ok(false);
    }
    post_route_of_kind(src, at, method, &format!("a {name} route"), decided, why)?;
    Ok(true)
}

/// Refuses a route of a kind that receives only `POST` (`kind`: "a
/// webhook route") when it takes another method, or when it sets one of
/// the keys its kind decides itself (`decided`: each key and whether it
/// is set; `why` says who decides).
pub(super) fn post_route_of_kind(
    src: &Source<'_>,
    at: &str,
    method: &Method,
    kind: &str,
    decided: &[(&str, bool)],
    why: &str,
) -> Result<(), ConfigError> {
    let file = src.file.display();
    if method != Method::POST {
        return Err(ConfigError::new(format!(
            "{file}: {at}: {kind} takes POST, not {method}"
        )));
    }
    if let Some((name, _)) = decided.iter().find(|(_, set)| *set) {
        return Err(ConfigError::new(format!(
            "{file}: {at}.{name}: {why}; remove {name}"
        )));
    }
    Ok(())
}

/// A list of JSON Pointers, each checked.
fn pointers(
    src: &Source<'_>,
    key: &str,
    v: &Spanned<Vec<String>>,
) -> Result<Vec<JsonPointer>, ConfigError> {
    each(src, key, v, |text| {
        text.parse().map_err(|why| format!("{text:?}: {why}"))
    })
}

/// Applies the keys present in `cfg` on top of `base`.
pub(super) fn apply(
    src: &Source<'_>,
    at: &str,
    cfg: &PolicyConfig,
    base: RoutePolicy,
    tenant_credential: Option<&HeaderName>,
) -> Result<RoutePolicy, ConfigError> {
    let key = |k: &str| format!("{at}.{k}");
    let mut p = base;
    let mut engine: Policy = p.engine.clone();
    if let Some(v) = &cfg.retention {
        engine = engine.with_retention(positive(
            src,
            &key("retention"),
            v,
            duration(src, &key("retention"), v)?,
        )?);
    }
    if let Some(v) = &cfg.lease {
        engine = engine.with_lease(positive(
            src,
            &key("lease"),
            v,
            duration(src, &key("lease"), v)?,
        )?);
    }
    let wait = match &cfg.in_flight_wait {
        Some(v) => Some(positive(
            src,
            &key("in_flight_wait"),
            v,
            duration(src, &key("in_flight_wait"), v)?,
        )?),
        None => None,
    };
    match cfg.on_in_flight.as_ref().map(|v| (v, v.get_ref().as_str())) {
        Some((_, "reject")) => engine = engine.with_on_in_flight(InFlight::Reject),
        Some((_, "wait")) => {
            engine =
                engine.with_on_in_flight(InFlight::Wait(wait.unwrap_or(Duration::from_secs(5))))
        }
        Some((v, _)) => {
            return Err(src.error(&key("on_in_flight"), v, "expected \"reject\" or \"wait\""));
        }
        None => {
            if let (Some(w), InFlight::Wait(_)) = (wait, engine.on_in_flight) {
                engine = engine.with_on_in_flight(InFlight::Wait(w));
            }
        }
    }
    match cfg
        .on_store_error
        .as_ref()
        .map(|v| (v, v.get_ref().as_str()))
    {
        Some((_, "closed")) => engine = engine.with_fail_mode(FailMode::Closed),
        Some((_, "open")) => engine = engine.with_fail_mode(FailMode::Open),
        Some((v, _)) => {
            return Err(src.error(&key("on_store_error"), v, "expected \"closed\" or \"open\""));
        }
        None => {}
    }
    match cfg
        .on_lease_expiry
        .as_ref()
        .map(|v| (v, v.get_ref().as_str()))
    {
        Some((_, "retry")) => engine = engine.with_on_lease_expiry(LeaseExpiry::Retry),
        Some((_, "hold")) => engine = engine.with_on_lease_expiry(LeaseExpiry::Hold),
        Some((v, _)) => {
            return Err(src.error(&key("on_lease_expiry"), v, "expected \"retry\" or \"hold\""));
        }
        None => {}
    }
    match cfg
        .on_missing_tenant
        .as_ref()
        .map(|v| (v, v.get_ref().as_str()))
    {
        Some((_, "refuse")) => p = p.with_on_missing_tenant(MissingTenant::Refuse),
        Some((_, "pass")) => p = p.with_on_missing_tenant(MissingTenant::Pass),
        Some((v, _)) => {
            return Err(src.error(
                &key("on_missing_tenant"),
                v,
                "expected \"refuse\" or \"pass\"",
            ));
        }
        None => {}
    }
    match cfg
        .path_spelling
        .as_ref()
        .map(|v| (v, v.get_ref().as_str()))
    {
        Some((_, "normalise")) => p = p.with_path_spelling(PathSpelling::Normalise),
        Some((_, "refuse")) => p = p.with_path_spelling(PathSpelling::Refuse),
        Some((v, _)) => {
            return Err(src.error(
                &key("path_spelling"),
                v,
                "expected \"normalise\" or \"refuse\"",
            ));
        }
        None => {}
    }
    if let Some(v) = &cfg.release_statuses {
        if let Some(bad) = v.get_ref().iter().find(|s| !(100..=599).contains(*s)) {
            return Err(src.error(
                &key("release_statuses"),
                v,
                format!("{bad} is not an HTTP status"),
            ));
        }
        engine = engine.with_release_statuses(v.get_ref().clone());
    }
    p = p.with_engine(engine);
    if let Some(v) = cfg.require_key {
        p = p.with_require_key(v);
    }
    if let Some(v) = &cfg.max_request_body {
        p = p.with_max_request_body(size(src, &key("max_request_body"), v)?);
    }
    if let Some(v) = &cfg.max_stored_response {
        p = p.with_max_stored_response(size(src, &key("max_stored_response"), v)?);
    }
    if let Some(v) = &cfg.mismatch_status {
        let status = StatusCode::from_u16(*v.get_ref())
            .ok()
            .filter(|s| s.is_client_error())
            .ok_or_else(|| {
                src.error(
                    &key("mismatch_status"),
                    v,
                    "must be a 4xx status (422 per the IETF draft, 400 as Stripe does)",
                )
            })?;
        p = p.with_mismatch_status(status);
    }
    if let Some(v) = &cfg.key_header {
        p = p.with_key_headers(key_headers(src, &key("key_header"), v, tenant_credential)?);
    }
    if let Some(v) = &cfg.key_from {
        let field = v
            .get_ref()
            .parse::<JsonPointer>()
            .map_err(|why| src.error(&key("key_from"), v, why))?;
        p = p.with_key_from(field);
    }
    // Only a `key_header = []` here empties the list.
    if let Some(at) = &cfg.key_header
        && p.key_headers.is_empty()
        && p.key_from.is_none()
    {
        return Err(src.error(
            &key("key_header"),
            at,
            "name a header, or set key_from to read the key from the body",
        ));
    }
    if let Some(v) = &cfg.fingerprint_headers {
        p.fingerprint_headers = header_names(src, &key("fingerprint_headers"), v)?;
    }
    match (&cfg.fingerprint_include, &cfg.fingerprint_exclude) {
        (Some(_), Some(v)) => {
            return Err(src.error(
                &key("fingerprint_exclude"),
                v,
                "set fingerprint_include or fingerprint_exclude, not both",
            ));
        }
        (Some(v), None) if v.get_ref().is_empty() => {
            return Err(src.error(
                &key("fingerprint_include"),
                v,
                "an empty list covers none of the body; leave it out to cover the whole body",
            ));
        }
        (Some(v), None) => {
            let fields = pointers(src, &key("fingerprint_include"), v)?;
            p = p.with_fingerprint_body(BodyFields::Include(fields));
        }
        (None, Some(v)) if v.get_ref().is_empty() => {
            p = p.with_fingerprint_body(BodyFields::All);
        }
        (None, Some(v)) => {
            let fields = pointers(src, &key("fingerprint_exclude"), v)?;
            p = p.with_fingerprint_body(BodyFields::Exclude(fields));
        }
        (None, None) => {}
    }
    if let Some(v) = &cfg.unstored_headers {
        p.unstored_headers = header_names(src, &key("unstored_headers"), v)?;
    }
    super::contract::apply(src, at, cfg, p)
}
