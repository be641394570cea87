//! The gateway's configuration: flags, `IDEM_*` environment variables and
//! the TOML file, merged in that order of precedence, validated at start.
//!
//! A bad file is refused with the file, the line, the key, the value and
//! why: `idem.toml:12: defaults.lease = "3x": not a duration (…)`.

use std::path::{Path, PathBuf};

use idem_http::TenantSource;
use toml::Spanned;

mod cache;
mod contract;
pub mod defaults;
mod error;
mod file;
mod graphql;
mod grpc;
mod jobs;
mod jsonrpc;
mod limits;
mod policy;
mod routes;
mod secrets;
mod settings;
mod telemetry;
mod tls;
mod values;
mod webhook;

pub use defaults::{DEFAULT_ADMIN_LISTEN, DEFAULT_LISTEN, DEFAULT_STORE, default_workers};
pub use error::ConfigError;
pub use secrets::{
    ENCRYPTION_KEYS_ENV, HASH_SECRET_ENV, MIN_ADMIN_TOKEN, encryption_keys_from_env, env_seal_keys,
    hash_secret_from_env, parse_secret_file,
};
pub use settings::{
    CacheSettings, CleanupSettings, LimitsSettings, MonitorSettings, Overrides, SealSettings,
    Settings, TelemetrySettings,
};
pub use telemetry::traces_url;
pub use values::{Refused, log_filter, parse_size};

use cache::cache;
use file::{FileConfig, Source};
use jobs::jobs;
use limits::limits;
use policy::tenant_source;
use secrets::{admin_token, exposed, hash_secret, seal_keys};
use telemetry::telemetry;
use values::{duration, located, parse_addr, parse_upstream, positive};

/// Loads and validates: the file (if any), then the overrides.
pub fn load(file: Option<&Path>, overrides: &Overrides) -> Result<Settings, ConfigError> {
    let (path, text) = match file {
        Some(path) => (path.to_path_buf(), read(path)?),
        None => (PathBuf::from("(no config file)"), String::new()),
    };
    parse(&path, &text, overrides)
}

/// Only the `[telemetry]` part of the config file, validated: what the
/// logging set up at start needs, before the rest of the file is read
/// (which checks it again, with everything else).
pub fn telemetry_settings(file: Option<&Path>) -> Result<Option<TelemetrySettings>, ConfigError> {
    let Some(path) = file else {
        return Ok(None);
    };
    let text = read(path)?;
    let parsed = from_toml(path, &text)?;
    let src = Source {
        file: path,
        text: &text,
    };
    telemetry(&src, parsed.telemetry.as_ref())
}

/// The config file's text.
fn read(path: &Path) -> Result<String, ConfigError> {
    std::fs::read_to_string(path).map_err(|e| {
        ConfigError::caused(
            format!("cannot read config file {}: {e}", path.display()),
            e,
        )
    })
}

/// The file's TOML, every table refusing keys it does not know.
fn from_toml(file: &Path, text: &str) -> Result<FileConfig, ConfigError> {
    toml::from_str(text).map_err(|e| ConfigError::caused(format!("{}: {e}", file.display()), e))
}

/// Validates config `text` as read from `file` (named in errors), then
/// the overrides. Reads no file itself, except the one
/// `encryption_keys_file` names.
pub fn parse(file: &Path, text: &str, overrides: &Overrides) -> Result<Settings, ConfigError> {
    let parsed = from_toml(file, text)?;
    if parsed.admin_token.is_some()
        && let Some(why) = exposed(file)
    {
        tracing::warn!(reason = "secret_file_exposed", file = %file.display(), "the config file holds the admin token and {why}: chmod 600 it, or pass the token in IDEM_ADMIN_TOKEN");
    }
    let src = Source { file, text };
    build(parsed, &src, overrides)
}

fn build(file: FileConfig, src: &Source<'_>, o: &Overrides) -> Result<Settings, ConfigError> {
    let pick = |flag: &Option<String>,
                key: &str,
                value: &Option<Spanned<String>>|
     -> Option<(String, Option<ConfigError>)> {
        match (flag, value) {
            (Some(v), _) => Some((v.clone(), None)),
            (None, Some(v)) => Some((v.get_ref().clone(), Some(src.error(key, v, "")))),
            (None, None) => None,
        }
    };
    let upstream = pick(&o.upstream, "upstream", &file.upstream).ok_or_else(|| {
        ConfigError::new("no upstream: pass --upstream URL, set IDEM_UPSTREAM, or write upstream = \"http://…\" in the config file".to_owned())
    })?;
    let upstream = parse_upstream(&upstream.0).map_err(|why| {
        let err = located(upstream.1, &why, "--upstream / IDEM_UPSTREAM");
        // Never a password in a message.
        err.map_message(|m| m.replace(&upstream.0, &idem::store::redact_url(&upstream.0)))
    })?;
    let https = upstream.scheme_str() == Some("https");
    let upstream_tls = tls::upstream_tls(src, &file, https)?;
    let upstream_prior_knowledge = tls::prior_knowledge(src, &file, https)?;
    let listen =
        pick(&o.listen, "listen", &file.listen).unwrap_or((DEFAULT_LISTEN.to_owned(), None));
    let listen =
        parse_addr(&listen.0).map_err(|why| located(listen.1, &why, "--listen / IDEM_LISTEN"))?;
    let admin = pick(&o.admin_listen, "admin_listen", &file.admin_listen)
        .unwrap_or((DEFAULT_ADMIN_LISTEN.to_owned(), None));
    let admin_listen = parse_addr(&admin.0)
        .map_err(|why| located(admin.1, &why, "--admin-listen / IDEM_ADMIN_LISTEN"))?;
    let admin_token = admin_token(src, o.admin_token.as_deref(), &file)?;
    if admin_token.is_none() && !admin_listen.ip().is_loopback() {
        return Err(ConfigError::new(format!(
            "admin_listen {admin_listen} is not a loopback address: set an admin token (--admin-token or IDEM_ADMIN_TOKEN) before exposing the admin API"
        )));
    }
    let store = o
        .store
        .clone()
        .or_else(|| file.store.as_ref().map(|s| s.get_ref().clone()))
        .unwrap_or_else(|| DEFAULT_STORE.to_owned());
    let shutdown_grace = match &file.shutdown_grace {
        Some(v) => duration(src, "shutdown_grace", v)?,
        None => defaults::SHUTDOWN_GRACE,
    };
    let workers = match &file.workers {
        Some(v) => usize::try_from(*v.get_ref())
            .ok()
            .filter(|n| *n <= 1024)
            .ok_or_else(|| {
                src.error(
                    "workers",
                    v,
                    "must be a whole number from 0 (serve on the shared runtime) to 1024",
                )
            })?,
        None => default_workers(),
    };
    let store_timeout = match &file.store_timeout {
        Some(v) => positive(src, "store_timeout", v, duration(src, "store_timeout", v)?)?,
        None => defaults::STORE_TIMEOUT,
    };
    let tenant = match &file.tenant {
        None => TenantSource::Authorization,
        Some(t) => tenant_source(src, t)?,
    };
    let (hash_secret, file_v1_until) = hash_secret(
        src,
        o.hash_secret.as_deref(),
        file.hash_secret_file.as_ref(),
    )?;
    let accept_v1_until = match &file.accept_v1_until {
        Some(v) => Some(humantime::parse_rfc3339(v.get_ref()).map_err(|e| {
            src.error(
                "accept_v1_until",
                v,
                format!("{e}: write an RFC 3339 time in UTC, as \"2026-12-02T18:00:00Z\""),
            )
        })?),
        None => file_v1_until,
    };

    let (routes, upstream_timeout) = routes::routes(src, &file, &tenant)?;
    let contract_path = contract::path(src, file.contract_path.as_ref(), &routes)?;
    let longest_lease = routes
        .policies()
        .map(|p| p.engine.lease)
        .max()
        .unwrap_or(idem::Policy::default().lease);
    let (cleanup, monitor) = jobs(src, &file.cleanup, &file.monitor, longest_lease)?;
    let cache = cache(src, file.cache.as_ref())?;
    let limits = limits(src, file.limits.as_ref())?;
    let keys = seal_keys(
        src,
        o.encryption_keys.as_deref(),
        file.encryption_keys_file.as_ref(),
    )?;
    let telemetry = telemetry(src, file.telemetry.as_ref())?;
    let require_sealed = file.require_sealed.as_ref().is_some_and(|v| *v.get_ref());
    if require_sealed && keys.is_none() {
        let v = file.require_sealed.as_ref().expect("set");
        return Err(src.error(
            "require_sealed",
            v,
            format!("needs sealing keys: set {ENCRYPTION_KEYS_ENV} or encryption_keys_file"),
        ));
    }
    let seal = keys.map(|keys| SealSettings {
        keys,
        require_sealed,
    });
    Ok(Settings {
        listen,
        upstream,
        upstream_tls,
        upstream_prior_knowledge,
        store,
        store_timeout,
        admin_listen,
        admin_token,
        routes,
        contract_path,
        tenant,
        upstream_timeout,
        shutdown_grace,
        workers,
        cleanup,
        monitor,
        cache,
        limits,
        seal,
        hash_secret,
        accept_v1_until,
        telemetry,
    })
}

#[cfg(test)]
mod tests;
