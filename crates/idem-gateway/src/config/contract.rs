//! What a route's answers promise: `profile` and the switches it is made
//! of (`replay_header`, `not_retained`, `held_retry_after`,
//! `retention_header`, `on_server_error`), and the format of its keys
//! (`key_format`, `key_min_length`), for `[defaults]` and each
//! `[[route]]`; and `contract_path`, where the serving listener publishes
//! them.

use http::Method;
use idem::ServerError;
use idem_http::{
    Contract, IDEMPOTENCY_REPLAYED, IDEMPOTENT_REPLAYED, KeyFormat, NotRetained, Profile,
    RoutePolicy, Routes,
};
use toml::Spanned;

use super::error::ConfigError;
use super::file::{PolicyConfig, Source};
use super::values::{duration, header_names, positive};

/// Applies the contract keys present in `cfg` on top of `p`: the profile
/// first, then each switch, so that a route may take a profile and change
/// one switch of it.
pub(super) fn apply(
    src: &Source<'_>,
    at: &str,
    cfg: &PolicyConfig,
    mut p: RoutePolicy,
) -> Result<RoutePolicy, ConfigError> {
    let key = |k: &str| format!("{at}.{k}");
    let mut c: Contract = p.contract.clone();
    if let Some(v) = &cfg.profile {
        let profile = Profile::from_name(v.get_ref())
            .ok_or_else(|| src.error(&key("profile"), v, "expected \"stripe\" or \"ietf\""))?;
        c = c.with_profile(profile);
    }
    if let Some(v) = &cfg.replay_header {
        let names = Spanned::new(v.span(), v.get_ref().to_vec());
        let names = header_names(src, &key("replay_header"), &names)?;
        if names.is_empty() {
            return Err(src.error(
                &key("replay_header"),
                v,
                "name \"Idempotent-Replayed\", \"Idempotency-Replayed\" or both: a replay is always marked",
            ));
        }
        if let Some(other) = names
            .iter()
            .find(|n| **n != IDEMPOTENT_REPLAYED && **n != IDEMPOTENCY_REPLAYED)
        {
            return Err(src.error(
                &key("replay_header"),
                v,
                format!("{other} is not a replay marker: expected \"Idempotent-Replayed\", \"Idempotency-Replayed\" or both (only these are kept out of stored answers, so no upstream can forge them)"),
            ));
        }
        c = c.with_replay_headers(names);
    }
    match cfg.not_retained.as_ref().map(|v| (v, v.get_ref().as_str())) {
        Some((_, "problem")) => c = c.with_not_retained(NotRetained::Problem),
        Some((_, "empty")) => c = c.with_not_retained(NotRetained::Empty),
        Some((v, _)) => {
            return Err(src.error(&key("not_retained"), v, "expected \"problem\" or \"empty\""));
        }
        None => {}
    }
    if let Some(v) = &cfg.held_retry_after {
        c = c.with_held_retry_after(match v.get_ref().trim() {
            "none" => None,
            _ => Some(positive(
                src,
                &key("held_retry_after"),
                v,
                duration(src, &key("held_retry_after"), v)?,
            )?),
        });
    }
    if let Some(on) = cfg.retention_header {
        c = c.with_retention_header(on);
    }
    if let Some(v) = &cfg.key_format {
        let format = KeyFormat::parse(v.get_ref()).map_err(|e| {
            src.error(
                &key("key_format"),
                v,
                format!("expected \"uuid\", \"uuidv4\", \"uuidv7\", \"ulid\" or a regular expression; as a regular expression: {e}"),
            )
        })?;
        c = c.with_key_format(format);
    }
    if let Some(v) = &cfg.key_min_length {
        let n = usize::try_from(*v.get_ref())
            .ok()
            .filter(|n| (1..=idem::MAX_KEY_LEN).contains(n))
            .ok_or_else(|| {
                src.error(
                    &key("key_min_length"),
                    v,
                    format!("must be 1 to {} bytes", idem::MAX_KEY_LEN),
                )
            })?;
        c = c.with_key_min_length(n);
    }
    match cfg
        .on_server_error
        .as_ref()
        .map(|v| (v, v.get_ref().as_str()))
    {
        Some((_, "store")) => p.engine = p.engine.with_on_server_error(ServerError::Store),
        Some((_, "hold")) => p.engine = p.engine.with_on_server_error(ServerError::Hold),
        Some((_, "release")) => {
            tracing::warn!(
                reason = "config_server_error_released",
                route = at,
                "on_server_error = \"release\": a 5xx answer frees the key, so a server error that came after the side effect runs it twice on retry"
            );
            p.engine = p.engine.with_on_server_error(ServerError::Release);
        }
        Some((v, _)) => {
            return Err(src.error(
                &key("on_server_error"),
                v,
                "expected \"store\", \"hold\" or \"release\"",
            ));
        }
        None => {}
    }
    Ok(p.with_contract(c))
}

/// `contract_path`: an absolute path, without query or fragment, that no
/// route protects for `GET` (the document would hide it).
pub(super) fn path(
    src: &Source<'_>,
    v: Option<&Spanned<String>>,
    routes: &Routes,
) -> Result<Option<String>, ConfigError> {
    let Some(v) = v else { return Ok(None) };
    let path = v.get_ref().trim();
    let plain = path.starts_with('/')
        && !path.contains(['?', '#'])
        && path.parse::<http::uri::PathAndQuery>().is_ok()
        && idem_http::normalize_path(path) == path;
    if !plain {
        return Err(src.error(
            "contract_path",
            v,
            "expected an absolute path in normal form, such as \"/.well-known/idempotency\"",
        ));
    }
    if let Some(route) = routes.matching(&Method::GET, path)
        && route.pattern.is_some()
    {
        return Err(src.error(
            "contract_path",
            v,
            format!("{} protects this path: pick another", route.operation),
        ));
    }
    Ok(Some(path.to_owned()))
}
