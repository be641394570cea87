//! The gateway's configuration: flags, `IDEM_*` environment variables and
//! the TOML file, merged in that order of precedence, validated at start.
//!
//! A bad file is refused with the file, the line, the key, the value and
//! why: `idem.toml:12: defaults.lease = "3x": not a duration (…)`.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use http::{HeaderName, Method, StatusCode, Uri};
use idem::seal::SealKeys;
use idem::{FailMode, HashSecret, InFlight, LeaseExpiry, Policy};
use idem_http::{Lookup, MissingTenant, PathPattern, RoutePolicy, Routes, TenantSource};
use serde::Deserialize;
use toml::Spanned;

pub use crate::limits::LimitsSettings;

/// Defaults of DESIGN.md §7.
pub const DEFAULT_LISTEN: &str = "127.0.0.1:8080";
/// The embedded store in the working directory.
pub const DEFAULT_STORE: &str = "sqlite://idem.db";
/// The admin listener.
pub const DEFAULT_ADMIN_LISTEN: &str = "127.0.0.1:9090";

/// Serving threads when `workers` is not set: one per CPU.
///
/// For every store. In front of Redis, `workers = 0` (connections on the
/// shared runtime, beside the Redis connection's task) made unique keys
/// 1.06× faster but replays 0.69× as fast (docs/BENCHMARKS.md,
/// "Connections on threads of their own").
pub fn default_workers() -> usize {
    std::thread::available_parallelism().map_or(1, usize::from)
}

/// A configuration error, ready to print.
#[derive(Debug)]
pub struct ConfigError(pub String);

impl std::error::Error for ConfigError {}

impl std::fmt::Display for ConfigError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// The file, as written. Every table refuses keys it does not know.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileConfig {
    upstream: Option<Spanned<String>>,
    store: Option<Spanned<String>>,
    listen: Option<Spanned<String>>,
    admin_listen: Option<Spanned<String>>,
    admin_token: Option<Spanned<String>>,
    admin_token_file: Option<Spanned<String>>,
    shutdown_grace: Option<Spanned<String>>,
    workers: Option<Spanned<i64>>,
    store_timeout: Option<Spanned<String>>,
    encryption_keys_file: Option<Spanned<String>>,
    require_sealed: Option<Spanned<bool>>,
    hash_secret_file: Option<Spanned<String>>,
    accept_v1_until: Option<Spanned<String>>,
    ignore_path_case: Option<bool>,
    tenant: Option<TenantConfig>,
    defaults: Option<PolicyConfig>,
    #[serde(default)]
    route: Vec<PolicyConfig>,
    cleanup: Option<CleanupConfig>,
    monitor: Option<MonitorConfig>,
    cache: Option<CacheConfig>,
    limits: Option<LimitsConfig>,
}

/// `[limits]`: what the gateway takes on at once, and slow clients.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct LimitsConfig {
    max_connections: Option<Spanned<i64>>,
    max_in_flight: Option<Spanned<i64>>,
    max_connections_per_peer: Option<Spanned<i64>>,
    max_in_flight_per_peer: Option<Spanned<i64>>,
    queue_wait: Option<Spanned<String>>,
    header_read_timeout: Option<Spanned<String>>,
    body_read_timeout: Option<Spanned<String>>,
    body_total_timeout: Option<Spanned<String>>,
    idle_timeout: Option<Spanned<String>>,
    max_headers: Option<Spanned<i64>>,
    max_header_bytes: Option<Spanned<String>>,
}

/// `[cache]`: the in-process copy of recent records in front of the store.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct CacheConfig {
    size: Option<Spanned<String>>,
    max_age: Option<Spanned<String>>,
}

/// `[cleanup]`: the background deletion of expired records.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct CleanupConfig {
    enabled: Option<bool>,
    interval: Option<Spanned<String>>,
    batch: Option<Spanned<i64>>,
}

/// `[monitor]`: the stuck-record monitor.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct MonitorConfig {
    enabled: Option<bool>,
    interval: Option<Spanned<String>>,
    stuck_after_leases: Option<Spanned<i64>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct TenantConfig {
    from: Spanned<String>,
    name: Option<Spanned<String>>,
    trusted_proxies: Option<Spanned<Vec<String>>>,
}

/// `[defaults]` and each `[[route]]` (routes also say `method` and `path`).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct PolicyConfig {
    method: Option<Spanned<String>>,
    path: Option<Spanned<String>>,
    retention: Option<Spanned<String>>,
    lease: Option<Spanned<String>>,
    require_key: Option<bool>,
    on_in_flight: Option<Spanned<String>>,
    in_flight_wait: Option<Spanned<String>>,
    on_store_error: Option<Spanned<String>>,
    on_lease_expiry: Option<Spanned<String>>,
    on_missing_tenant: Option<Spanned<String>>,
    max_request_body: Option<Spanned<String>>,
    max_stored_response: Option<Spanned<String>>,
    upstream_timeout: Option<Spanned<String>>,
    mismatch_status: Option<Spanned<u16>>,
    fingerprint_headers: Option<Spanned<Vec<String>>>,
    unstored_headers: Option<Spanned<Vec<String>>>,
    release_statuses: Option<Spanned<Vec<u16>>>,
    reconcile: Option<ReconcileConfig>,
}

/// `[route.reconcile]`: how the upstream is asked what became of a held
/// record of this route.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct ReconcileConfig {
    method: Option<Spanned<String>>,
    path: Option<Spanned<String>>,
    status: Option<Spanned<u16>>,
    first: Option<Spanned<String>>,
    max_pause: Option<Spanned<String>>,
    settle: Option<Spanned<String>>,
    give_up: Option<Spanned<String>>,
}

/// Values given on the command line or in the environment (they win over
/// the file).
#[derive(Debug, Default, Clone)]
pub struct Overrides {
    /// `--upstream` / `IDEM_UPSTREAM`.
    pub upstream: Option<String>,
    /// `--store` / `IDEM_STORE`.
    pub store: Option<String>,
    /// `--listen` / `IDEM_LISTEN`.
    pub listen: Option<String>,
    /// `--admin-listen` / `IDEM_ADMIN_LISTEN`.
    pub admin_listen: Option<String>,
    /// `--admin-token` / `IDEM_ADMIN_TOKEN`.
    pub admin_token: Option<String>,
    /// `IDEM_ENCRYPTION_KEYS` (environment only: keys never go on a
    /// command line).
    pub encryption_keys: Option<String>,
    /// `IDEM_HASH_SECRET` (environment only, like the keys).
    pub hash_secret: Option<String>,
}

/// Everything `serve` needs, validated.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Where clients connect.
    pub listen: SocketAddr,
    /// The upstream origin (`http://host:port`).
    pub upstream: Uri,
    /// The store URL.
    pub store: String,
    /// How long a store operation on the request path may take before the
    /// store counts as unavailable (default 5 s).
    pub store_timeout: Duration,
    /// The admin listener.
    pub admin_listen: SocketAddr,
    /// Bearer token for admin routes other than `/healthz`.
    pub admin_token: Option<String>,
    /// Protected routes and their policies.
    pub routes: Routes,
    /// Where tenants come from.
    pub tenant: TenantSource,
    /// How long to wait for the upstream's response headers.
    pub upstream_timeout: Duration,
    /// How long in-flight requests may take to finish at shutdown.
    pub shutdown_grace: Duration,
    /// Threads serving client connections, each with an event loop of its
    /// own (default: one per CPU).
    pub workers: usize,
    /// Background cleanup of expired records (`None`: disabled).
    pub cleanup: Option<CleanupSettings>,
    /// The stuck-record monitor.
    pub monitor: MonitorSettings,
    /// The in-process record cache (`None`: off).
    pub cache: Option<CacheSettings>,
    /// Connection, concurrency and slow-client limits.
    pub limits: LimitsSettings,
    /// Sealing of stored answers at rest (`None`: bodies stored in clear).
    pub seal: Option<SealSettings>,
    /// The secret keying tenants and fingerprints, from `IDEM_HASH_SECRET`
    /// or `hash_secret_file` (`None`: the embedded store keeps one beside
    /// its database, `memory://` makes one per process, and a shared store
    /// refuses to start).
    pub hash_secret: Option<Arc<HashSecret>>,
    /// Until when records written before keyed hashing are looked for
    /// (`accept_v1_until`, or the secret file's own line).
    pub accept_v1_until: Option<SystemTime>,
}

/// Sealing, validated: the keys, and whether unsealed records are refused.
#[derive(Debug, Clone)]
pub struct SealSettings {
    /// The key ring (`IDEM_ENCRYPTION_KEYS` or `encryption_keys_file`).
    pub keys: Arc<SealKeys>,
    /// `require_sealed`: a final record whose body is not sealed is
    /// refused as corrupt (never replayed, never run again).
    pub require_sealed: bool,
}

/// `[cache]`, validated: a bounded in-process copy of recent records in
/// front of the store (the fast tier of [`idem::Tiered`]), which answers
/// replays and key reuse of final records without a store round trip.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheSettings {
    /// Approximate bytes of records held (default 8 MiB: some 10,000 typical
    /// records, while the gateway stays within 64 MiB of memory under load).
    pub size: usize,
    /// How long a copy may be used before the store is asked again
    /// (default 60 s): bounds how long a change made elsewhere (another
    /// gateway, `idem records purge` on the same file) goes unseen.
    pub max_age: Duration,
}

impl Default for CacheSettings {
    fn default() -> Self {
        Self {
            size: 8 << 20,
            max_age: Duration::from_secs(60),
        }
    }
}

/// `[cleanup]`, validated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CleanupSettings {
    /// Pause between cleanup runs.
    pub interval: Duration,
    /// Records deleted per batch (one transaction each).
    pub batch: usize,
}

/// `[monitor]`, validated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MonitorSettings {
    /// Whether the monitor runs (default: yes, except on a plain Redis
    /// store, where listing scans every key).
    pub enabled: bool,
    /// Pause between censuses of processing records.
    pub interval: Duration,
    /// A processing record without a live lease older than this is stuck
    /// (`stuck_after_leases` × the longest route lease).
    pub stuck_after: Duration,
}

impl Default for MonitorSettings {
    fn default() -> Self {
        Self {
            enabled: true,
            interval: Duration::from_secs(30),
            stuck_after: Duration::from_secs(90),
        }
    }
}

/// Where in the file a value sits, for messages.
struct Source<'a> {
    file: &'a Path,
    text: &'a str,
}

impl Source<'_> {
    fn line(&self, span: std::ops::Range<usize>) -> usize {
        self.text[..span.start.min(self.text.len())]
            .matches('\n')
            .count()
            + 1
    }

    fn error<T: std::fmt::Debug>(
        &self,
        key: &str,
        value: &Spanned<T>,
        why: impl std::fmt::Display,
    ) -> ConfigError {
        ConfigError(format!(
            "{}:{}: {key} = {:?}: {why}",
            self.file.display(),
            self.line(value.span()),
            value.get_ref()
        ))
    }
}

/// Loads and validates: the file (if any), then the overrides.
pub fn load(file: Option<&Path>, overrides: &Overrides) -> Result<Settings, ConfigError> {
    let (path, text) = match file {
        Some(path) => {
            let text = std::fs::read_to_string(path).map_err(|e| {
                ConfigError(format!("cannot read config file {}: {e}", path.display()))
            })?;
            (path.to_path_buf(), text)
        }
        None => (PathBuf::from("(no config file)"), String::new()),
    };
    parse(&path, &text, overrides)
}

/// Validates config `text` as read from `file` (named in errors), then
/// the overrides. Reads no file itself, except the one
/// `encryption_keys_file` names.
pub fn parse(file: &Path, text: &str, overrides: &Overrides) -> Result<Settings, ConfigError> {
    let parsed: FileConfig =
        toml::from_str(text).map_err(|e| ConfigError(format!("{}: {e}", file.display())))?;
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
        ConfigError("no upstream: pass --upstream URL, set IDEM_UPSTREAM, or write upstream = \"http://…\" in the config file".to_owned())
    })?;
    let upstream = parse_upstream(&upstream.0).map_err(|why| {
        let err = located(upstream.1, &why, "--upstream / IDEM_UPSTREAM");
        // Never a password in a message.
        ConfigError(
            err.0
                .replace(&upstream.0, &idem::store::redact_url(&upstream.0)),
        )
    })?;
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
        return Err(ConfigError(format!(
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
        None => Duration::from_secs(30),
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
        None => Duration::from_secs(5),
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

    let base = RoutePolicy::default();
    let defaults_cfg = file.defaults.unwrap_or_default();
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
    if defaults_cfg.reconcile.is_some() {
        return Err(ConfigError(format!(
            "{}: [defaults.reconcile]: a lookup belongs to one route; write it as [route.reconcile] under that [[route]]",
            src.file.display()
        )));
    }
    let mut upstream_timeout = Duration::from_secs(30);
    if let Some(v) = &defaults_cfg.upstream_timeout {
        upstream_timeout = positive(
            src,
            "defaults.upstream_timeout",
            v,
            duration(src, "defaults.upstream_timeout", v)?,
        )?;
    }
    let defaults = apply(src, "defaults", &defaults_cfg, base)?;
    let mut routes =
        Routes::new(defaults.clone()).with_ignore_case(file.ignore_path_case == Some(true));
    for (i, r) in file.route.iter().enumerate() {
        let at = format!("route[{i}]");
        if let Some(v) = &r.upstream_timeout {
            return Err(src.error(
                &format!("{at}.upstream_timeout"),
                v,
                "upstream_timeout is set once, in [defaults]",
            ));
        }
        let method = r
            .method
            .as_ref()
            .ok_or_else(|| ConfigError(format!("{}: {at} has no method", src.file.display())))?;
        let m = Method::from_bytes(method.get_ref().to_ascii_uppercase().as_bytes())
            .map_err(|_| src.error(&format!("{at}.method"), method, "not an HTTP method"))?;
        let path = r
            .path
            .as_ref()
            .ok_or_else(|| ConfigError(format!("{}: {at} has no path", src.file.display())))?;
        let mut policy = apply(src, &at, r, defaults.clone())?;
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
    let longest_lease = routes
        .policies()
        .map(|p| p.engine.lease)
        .max()
        .unwrap_or(Duration::from_secs(30));
    // Listing processing records on plain Redis scans every key: the
    // monitor is off there unless asked for.
    let redis = store.starts_with("redis://") || store.starts_with("rediss://");
    let (cleanup, monitor) = jobs(src, &file.cleanup, &file.monitor, longest_lease, !redis)?;
    let cache = cache(src, file.cache.as_ref())?;
    let limits = limits(src, file.limits.as_ref())?;
    let keys = seal_keys(
        src,
        o.encryption_keys.as_deref(),
        file.encryption_keys_file.as_ref(),
    )?;
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
        store,
        store_timeout,
        admin_listen,
        admin_token,
        routes,
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
    })
}

/// The fewest characters an admin token may have: a guessable one would
/// open the records (and the operator actions) to anyone who can reach the
/// admin listener.
pub const MIN_ADMIN_TOKEN: usize = 32;

/// The admin token: `--admin-token`/`IDEM_ADMIN_TOKEN`, else `admin_token`,
/// else the first line of the file `admin_token_file` names. At least
/// [`MIN_ADMIN_TOKEN`] visible characters; errors never quote it.
fn admin_token(
    src: &Source<'_>,
    given: Option<&str>,
    file: &FileConfig,
) -> Result<Option<String>, ConfigError> {
    if let (Some(_), Some(path)) = (&file.admin_token, &file.admin_token_file) {
        return Err(src.error(
            "admin_token_file",
            path,
            "set admin_token or admin_token_file, not both",
        ));
    }
    let (token, from) = match (given, &file.admin_token, &file.admin_token_file) {
        (Some(t), _, _) => (t.to_owned(), "--admin-token / IDEM_ADMIN_TOKEN".to_owned()),
        (None, Some(t), _) => (t.get_ref().clone(), "admin_token".to_owned()),
        (None, None, Some(path)) => {
            let text = read_secret_file(src, "admin_token_file", path, "the admin token file")?;
            (
                text.lines().next().unwrap_or("").trim().to_owned(),
                format!("admin_token_file {}", path.get_ref()),
            )
        }
        (None, None, None) => return Ok(None),
    };
    if token.is_empty() && file.admin_token_file.is_none() {
        return Ok(None);
    }
    if token.chars().count() < MIN_ADMIN_TOKEN || !token.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(ConfigError(format!(
            "{from}: an admin token must be at least {MIN_ADMIN_TOKEN} visible ASCII characters (openssl rand -hex 32)"
        )));
    }
    Ok(Some(token))
}

/// The environment variable holding the hash secret.
pub const HASH_SECRET_ENV: &str = "IDEM_HASH_SECRET";

/// `IDEM_HASH_SECRET`, if set and not blank.
pub fn hash_secret_from_env() -> Option<String> {
    std::env::var(HASH_SECRET_ENV)
        .ok()
        .filter(|k| !k.trim().is_empty())
}

/// A hash secret file: the secret as hex on a line of its own, `#`
/// comment lines, and optionally `accept_v1_until = <RFC 3339 time>`
/// (written by the gateway when it made the secret beside a database
/// that already held records). Errors never quote the secret.
pub fn parse_secret_file(text: &str) -> Result<(HashSecret, Option<SystemTime>), String> {
    let mut secret = None;
    let mut until = None;
    for line in text.lines().map(str::trim) {
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        if let Some(value) = line
            .strip_prefix("accept_v1_until")
            .and_then(|r| r.trim_start().strip_prefix('='))
        {
            let value = value.trim().trim_matches('"');
            until = Some(
                humantime::parse_rfc3339(value)
                    .map_err(|e| format!("accept_v1_until {value:?}: {e}"))?,
            );
        } else if secret.is_some() {
            return Err("more than one secret line".to_owned());
        } else {
            secret = Some(HashSecret::from_hex(line).map_err(|e| e.to_string())?);
        }
    }
    let secret = secret.ok_or("no secret in it (openssl rand -hex 32)")?;
    Ok((secret, until))
}

/// The hash secret: `IDEM_HASH_SECRET`, else the file `hash_secret_file`
/// names. Errors name the source, never the secret.
fn hash_secret(
    src: &Source<'_>,
    env: Option<&str>,
    file: Option<&Spanned<String>>,
) -> Result<(Option<Arc<HashSecret>>, Option<SystemTime>), ConfigError> {
    match (env, file) {
        (Some(hex), _) => HashSecret::from_hex(hex)
            .map(|s| (Some(Arc::new(s)), None))
            .map_err(|e| ConfigError(format!("{HASH_SECRET_ENV}: {e}"))),
        (None, Some(path)) => {
            let text = read_secret_file(src, "hash_secret_file", path, "the hash secret file")?;
            parse_secret_file(&text)
                .map(|(s, until)| (Some(Arc::new(s)), until))
                .map_err(|e| src.error("hash_secret_file", path, e))
        }
        (None, None) => Ok((None, None)),
    }
}

/// The environment variable holding the sealing keys (never a flag: a
/// command line is visible to every user in `ps`).
pub const ENCRYPTION_KEYS_ENV: &str = "IDEM_ENCRYPTION_KEYS";

/// `IDEM_ENCRYPTION_KEYS`, if set and not blank.
pub fn encryption_keys_from_env() -> Option<String> {
    std::env::var(ENCRYPTION_KEYS_ENV)
        .ok()
        .filter(|k| !k.trim().is_empty())
}

/// The keys in the environment, parsed: for one-off commands, which read
/// no config file.
pub fn env_seal_keys() -> Result<Option<Arc<SealKeys>>, ConfigError> {
    encryption_keys_from_env()
        .map(|spec| env_keys(&spec))
        .transpose()
}

fn env_keys(spec: &str) -> Result<Arc<SealKeys>, ConfigError> {
    SealKeys::parse(spec)
        .map(Arc::new)
        .map_err(|e| ConfigError(format!("{ENCRYPTION_KEYS_ENV}: {e}")))
}

/// The sealing keys: `IDEM_ENCRYPTION_KEYS`, else the file named by
/// `encryption_keys_file` (same format, one key per line). Errors name the
/// source, never a key.
fn seal_keys(
    src: &Source<'_>,
    env: Option<&str>,
    file: Option<&Spanned<String>>,
) -> Result<Option<Arc<SealKeys>>, ConfigError> {
    match (env, file) {
        (Some(spec), _) => env_keys(spec).map(Some),
        (None, Some(path)) => {
            let text =
                read_secret_file(src, "encryption_keys_file", path, "the sealing keys file")?;
            SealKeys::parse(&text)
                .map(|keys| Some(Arc::new(keys)))
                .map_err(|e| src.error("encryption_keys_file", path, e))
        }
        (None, None) => Ok(None),
    }
}

/// The text of the secret file `path` (config key `key`), with a warning
/// when other local users may read it; errors name the key and the file,
/// never the content.
fn read_secret_file(
    src: &Source<'_>,
    key: &str,
    path: &Spanned<String>,
    what: &str,
) -> Result<String, ConfigError> {
    let text = std::fs::read_to_string(path.get_ref())
        .map_err(|e| src.error(key, path, format!("cannot read it: {e}")))?;
    if let Some(why) = exposed(Path::new(path.get_ref())) {
        tracing::warn!(reason = "secret_file_exposed", file = %path.get_ref(), "{what} {why}: chmod 600 it");
    }
    Ok(text)
}

/// Why a file holding a secret is exposed to other local users (its
/// group or others may read it), or `None`.
fn exposed(path: &Path) -> Option<String> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(path).ok()?.permissions().mode();
        (mode & 0o044 != 0).then(|| {
            format!(
                "is readable by {} (mode {:o})",
                match (mode & 0o040 != 0, mode & 0o004 != 0) {
                    (true, true) => "its group and every local user",
                    (true, false) => "its group",
                    _ => "every local user",
                },
                mode & 0o777
            )
        })
    }
    #[cfg(not(unix))]
    {
        let _ = path;
        None
    }
}

/// A count from 1 to `max`, or an error naming the key, the value and the range.
fn whole(src: &Source<'_>, key: &str, v: &Spanned<i64>, max: usize) -> Result<usize, ConfigError> {
    usize::try_from(*v.get_ref())
        .ok()
        .filter(|n| (1..=max).contains(n))
        .ok_or_else(|| src.error(key, v, format!("must be a whole number from 1 to {max}")))
}

/// `[limits]`, each value checked against a sane range.
fn limits(src: &Source<'_>, cfg: Option<&LimitsConfig>) -> Result<LimitsSettings, ConfigError> {
    let mut out = LimitsSettings::default();
    let Some(cfg) = cfg else {
        return Ok(out);
    };
    if let Some(v) = &cfg.max_connections {
        out.max_connections = whole(src, "limits.max_connections", v, 1_000_000)?;
    }
    if let Some(v) = &cfg.max_in_flight {
        out.max_in_flight = whole(src, "limits.max_in_flight", v, 1_000_000)?;
    }
    // Per peer: half of the whole unless said (0: no cap of its own).
    out.max_connections_per_peer = match &cfg.max_connections_per_peer {
        Some(v) if *v.get_ref() == 0 => 0,
        Some(v) => whole(
            src,
            "limits.max_connections_per_peer",
            v,
            out.max_connections,
        )?,
        None => (out.max_connections / 2).max(1),
    };
    out.max_in_flight_per_peer = match &cfg.max_in_flight_per_peer {
        Some(v) if *v.get_ref() == 0 => 0,
        Some(v) => whole(src, "limits.max_in_flight_per_peer", v, out.max_in_flight)?,
        None => (out.max_in_flight / 2).max(1),
    };
    if let Some(v) = &cfg.max_headers {
        out.max_headers = whole(src, "limits.max_headers", v, 10_000)?;
    }
    if let Some(v) = &cfg.queue_wait {
        out.queue_wait = duration(src, "limits.queue_wait", v)?;
    }
    // "0s" turns a read time-out off (behind a proxy that enforces its own).
    if let Some(v) = &cfg.header_read_timeout {
        out.header_read_timeout = duration(src, "limits.header_read_timeout", v)?;
    }
    if let Some(v) = &cfg.body_read_timeout {
        out.body_read_timeout = duration(src, "limits.body_read_timeout", v)?;
    }
    if let Some(v) = &cfg.body_total_timeout {
        out.body_total_timeout = duration(src, "limits.body_total_timeout", v)?;
    }
    if let Some(v) = &cfg.idle_timeout {
        out.idle_timeout = duration(src, "limits.idle_timeout", v)?;
    }
    if let Some(v) = &cfg.max_header_bytes {
        let n =
            parse_size(v.get_ref()).map_err(|why| src.error("limits.max_header_bytes", v, why))?;
        if !(8 << 10..=16 << 20).contains(&n) {
            return Err(src.error("limits.max_header_bytes", v, "must be from 8KiB to 16MiB"));
        }
        out.max_header_bytes = n;
    }
    Ok(out)
}

/// `[cache]`: on by default; `size = "0"` turns it off.
fn cache(
    src: &Source<'_>,
    cfg: Option<&CacheConfig>,
) -> Result<Option<CacheSettings>, ConfigError> {
    let mut out = CacheSettings::default();
    let Some(cfg) = cfg else {
        return Ok(Some(out));
    };
    if let Some(v) = &cfg.size {
        match parse_size(v.get_ref()) {
            Ok(0) => return Ok(None),
            Ok(n) => out.size = n,
            Err(why) => return Err(src.error("cache.size", v, why)),
        }
    }
    if let Some(v) = &cfg.max_age {
        out.max_age = positive(src, "cache.max_age", v, duration(src, "cache.max_age", v)?)?;
    }
    Ok(Some(out))
}

fn jobs(
    src: &Source<'_>,
    cleanup: &Option<CleanupConfig>,
    monitor: &Option<MonitorConfig>,
    longest_lease: Duration,
    monitor_by_default: bool,
) -> Result<(Option<CleanupSettings>, MonitorSettings), ConfigError> {
    let count =
        |key: &str, v: &Option<Spanned<i64>>, default: usize| -> Result<usize, ConfigError> {
            v.as_ref()
                .map_or(Ok(default), |n| whole(src, key, n, 1_000_000))
        };
    let every =
        |key: &str, v: &Option<Spanned<String>>, default: u64| -> Result<Duration, ConfigError> {
            match v {
                None => Ok(Duration::from_secs(default)),
                Some(v) => positive(src, key, v, duration(src, key, v)?),
            }
        };
    let c = cleanup.as_ref();
    let cleanup = if c.and_then(|c| c.enabled).unwrap_or(true) {
        Some(CleanupSettings {
            interval: every("cleanup.interval", &c.and_then(|c| c.interval.clone()), 60)?,
            batch: count("cleanup.batch", &c.and_then(|c| c.batch.clone()), 1000)?,
        })
    } else {
        None
    };
    let m = monitor.as_ref();
    let leases = count(
        "monitor.stuck_after_leases",
        &m.and_then(|m| m.stuck_after_leases.clone()),
        3,
    )?;
    let monitor = MonitorSettings {
        enabled: m.and_then(|m| m.enabled).unwrap_or(monitor_by_default),
        interval: every("monitor.interval", &m.and_then(|m| m.interval.clone()), 30)?,
        stuck_after: longest_lease.saturating_mul(u32::try_from(leases).unwrap_or(u32::MAX)),
    };
    Ok((cleanup, monitor))
}

/// A message for a value that came from the file (with its line) or from a
/// flag / environment variable.
fn located(from_file: Option<ConfigError>, why: &str, flag: &str) -> ConfigError {
    match from_file {
        Some(ConfigError(prefix)) => ConfigError(format!("{prefix}{why}")),
        None => ConfigError(format!("{flag}: {why}")),
    }
}

fn parse_upstream(text: &str) -> Result<Uri, String> {
    let uri: Uri = text.parse().map_err(|e| format!("not a URL ({e})"))?;
    match uri.scheme_str() {
        Some("http") => {}
        Some("https") => return Err("https upstreams are not supported yet; put the gateway next to the service and use http://".to_owned()),
        _ => return Err("the upstream must be an http:// URL such as http://127.0.0.1:3000".to_owned()),
    }
    match uri.authority() {
        None => return Err("the upstream URL has no host".to_owned()),
        Some(a) if a.as_str().contains('@') => {
            return Err("the upstream URL carries a user or password; idem sends no credentials of its own upstream (clients' headers are forwarded): write http://host:port".to_owned());
        }
        Some(_) => {}
    }
    if uri
        .path_and_query()
        .is_some_and(|p| p.as_str() != "/" && !p.as_str().is_empty())
    {
        return Err("the upstream is an origin (scheme, host, port) without a path".to_owned());
    }
    Ok(uri)
}

fn parse_addr(text: &str) -> Result<SocketAddr, String> {
    text.parse()
        .map_err(|_| format!("{text:?} is not an address like 127.0.0.1:8080"))
}

fn duration(src: &Source<'_>, key: &str, v: &Spanned<String>) -> Result<Duration, ConfigError> {
    humantime::parse_duration(v.get_ref().trim()).map_err(|e| {
        src.error(
            key,
            v,
            format!("not a duration like \"30s\" or \"24h\" ({e})"),
        )
    })
}

fn positive<T>(
    src: &Source<'_>,
    key: &str,
    v: &Spanned<T>,
    d: Duration,
) -> Result<Duration, ConfigError>
where
    T: std::fmt::Debug,
{
    if d.is_zero() {
        return Err(src.error(key, v, "must be greater than zero"));
    }
    Ok(d)
}

/// Parses `1MiB`, `512 KiB`, `10MB`, `1048576` into bytes.
pub fn parse_size(text: &str) -> Result<usize, String> {
    let t = text.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (digits, unit) = t.split_at(split);
    let n: u64 = digits
        .parse()
        .map_err(|_| "not a size like \"1MiB\" or \"64KiB\"".to_owned())?;
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "kb" => 1_000,
        "kib" => 1 << 10,
        "mb" => 1_000_000,
        "mib" => 1 << 20,
        "gb" => 1_000_000_000,
        "gib" => 1 << 30,
        other => {
            return Err(format!(
                "unknown unit {other:?}; use B, KiB, MiB, GiB, KB, MB or GB"
            ));
        }
    };
    n.checked_mul(mult)
        .and_then(|b| usize::try_from(b).ok())
        .ok_or_else(|| "too large".to_owned())
}

fn size(src: &Source<'_>, key: &str, v: &Spanned<String>) -> Result<usize, ConfigError> {
    match parse_size(v.get_ref()) {
        Ok(0) => Err(src.error(key, v, "must be greater than zero")),
        Ok(n) => Ok(n),
        Err(why) => Err(src.error(key, v, why)),
    }
}

fn header_names(
    src: &Source<'_>,
    key: &str,
    v: &Spanned<Vec<String>>,
) -> Result<Vec<HeaderName>, ConfigError> {
    v.get_ref()
        .iter()
        .map(|h| {
            HeaderName::from_bytes(h.trim().to_ascii_lowercase().as_bytes())
                .map_err(|_| src.error(key, v, format!("{h:?} is not a header name")))
        })
        .collect()
}

fn tenant_source(src: &Source<'_>, t: &TenantConfig) -> Result<TenantSource, ConfigError> {
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
fn lookup(src: &Source<'_>, at: &str, cfg: &ReconcileConfig) -> Result<Lookup, ConfigError> {
    let key = |k: &str| format!("{at}.{k}");
    let path = cfg.path.as_ref().ok_or_else(|| {
        ConfigError(format!(
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

/// Applies the keys present in `cfg` on top of `base`.
fn apply(
    src: &Source<'_>,
    at: &str,
    cfg: &PolicyConfig,
    base: RoutePolicy,
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
    if let Some(v) = &cfg.fingerprint_headers {
        p.fingerprint_headers = header_names(src, &key("fingerprint_headers"), v)?;
    }
    if let Some(v) = &cfg.unstored_headers {
        p.unstored_headers = header_names(src, &key("unstored_headers"), v)?;
    }
    Ok(p)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tenant_sources_and_hash_settings() {
        let tenant = |t: &str| {
            from_text(&format!("upstream = \"http://127.0.0.1:1\"\n[tenant]\n{t}"))
                .map(|s| s.tenant)
        };
        assert_eq!(
            tenant("from = \"authorization\"").expect("ok"),
            TenantSource::Authorization
        );
        assert_eq!(
            tenant("from = \"header\"\nname = \"X-Api-Key\"").expect("ok"),
            TenantSource::Header(HeaderName::from_static("x-api-key"))
        );
        assert_eq!(
            tenant("from = \"cookie\"\nname = \"session\"").expect("ok"),
            TenantSource::Cookie("session".into())
        );
        assert_eq!(
            tenant("from = \"trusted_header\"\nname = \"X-User\"\ntrusted_proxies = [\"10.0.0.0/8\", \"192.168.1.7\"]").expect("ok"),
            TenantSource::TrustedHeader {
                name: HeaderName::from_static("x-user"),
                proxies: vec!["10.0.0.0/8".parse().expect("net"), "192.168.1.7/32".parse().expect("net")],
            }
        );
        for (bad, why) in [
            (
                "from = \"trusted_header\"\nname = \"X-User\"",
                "trusted_proxies",
            ),
            (
                "from = \"trusted_header\"\nname = \"X-User\"\ntrusted_proxies = [\"nope\"]",
                "not an address",
            ),
            (
                "from = \"header\"\nname = \"X-Api-Key\"\ntrusted_proxies = [\"10.0.0.0/8\"]",
                "only from",
            ),
            ("from = \"cookie\"\nname = \"a;b\"", "not a cookie name"),
            ("from = \"cookie\"", "needs name"),
            ("from = \"ip\"", "expected"),
        ] {
            let err = tenant(bad).expect_err(bad).to_string();
            assert!(err.contains(why), "{bad}: {err}");
        }
        let route = |r: &str| {
            from_text(&format!(
                "upstream = \"http://127.0.0.1:1\"\n[[route]]\nmethod = \"POST\"\npath = \"/p\"\n{r}"
            ))
        };
        let pass = route("on_missing_tenant = \"pass\"").expect("ok");
        let m = pass.routes.matching(&Method::POST, "/p").expect("route");
        assert_eq!(m.policy.on_missing_tenant, MissingTenant::Pass);
        assert!(route("on_missing_tenant = \"maybe\"").is_err());
        let until = from_text(
            "upstream = \"http://127.0.0.1:1\"\naccept_v1_until = \"2030-01-02T03:04:05Z\"",
        )
        .expect("ok");
        assert_eq!(
            until.accept_v1_until,
            humantime::parse_rfc3339("2030-01-02T03:04:05Z").ok()
        );
        let err = from_text("upstream = \"http://127.0.0.1:1\"\naccept_v1_until = \"tomorrow\"")
            .expect_err("bad");
        assert!(err.to_string().contains("RFC 3339"), "{err}");
        // A secret file: the secret line, comments, an optional deadline.
        let hex = "ab".repeat(32);
        let (_, until) = parse_secret_file(&format!(
            "# made by idem\n{hex}\naccept_v1_until = 2030-01-02T03:04:05Z\n"
        ))
        .expect("ok");
        assert!(until.is_some());
        assert!(parse_secret_file("# nothing\n").is_err());
        assert!(parse_secret_file(&format!("{hex}\n{hex}\n")).is_err());
    }

    fn from_text(text: &str) -> Result<Settings, ConfigError> {
        let path = Path::new("idem.toml");
        let parsed: FileConfig =
            toml::from_str(text).map_err(|e| ConfigError(format!("idem.toml: {e}")))?;
        build(parsed, &Source { file: path, text }, &Overrides::default())
    }

    const FULL: &str = r#"
upstream = "http://127.0.0.1:3000"
store = "sqlite://idem.db"
[tenant]
from = "header"
name = "X-Tenant-Id"
[defaults]
retention = "24h"
lease = "30s"
require_key = false
on_in_flight = "wait"
in_flight_wait = "5s"
on_store_error = "closed"
max_request_body = "1MiB"
max_stored_response = "1MiB"
upstream_timeout = "30s"
[[route]]
method = "POST"
path = "/v1/payments"
require_key = true
retention = "72h"
mismatch_status = 400
[[route]]
method = "put"
path = "/v1/orders/{id}/capture"
on_store_error = "open"
"#;

    #[test]
    fn the_documented_example_loads() {
        let s = from_text(FULL).expect("valid");
        assert_eq!(s.upstream, "http://127.0.0.1:3000");
        assert_eq!(s.listen.to_string(), DEFAULT_LISTEN);
        assert_eq!(
            s.tenant,
            TenantSource::Header(HeaderName::from_static("x-tenant-id"))
        );
        let pay = s
            .routes
            .matching(&Method::POST, "/v1/payments")
            .expect("route");
        assert!(pay.policy.require_key);
        assert_eq!(pay.policy.engine.retention, Duration::from_secs(72 * 3600));
        assert_eq!(
            pay.policy.engine.on_in_flight,
            InFlight::Wait(Duration::from_secs(5))
        );
        assert_eq!(pay.policy.mismatch_status, StatusCode::BAD_REQUEST);
        let cap = s
            .routes
            .matching(&Method::PUT, "/v1/orders/1/capture")
            .expect("route");
        assert_eq!(cap.policy.engine.fail_mode, FailMode::Open);
        assert!(!cap.policy.require_key);
        assert_eq!(s.upstream_timeout, Duration::from_secs(30));
    }

    #[cfg(unix)]
    #[test]
    fn files_holding_secrets_that_others_can_read_are_named() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().expect("dir");
        let path = dir.path().join("keys");
        std::fs::write(&path, "k1:00").expect("write");
        for (mode, want) in [
            (0o600, None),
            (0o640, Some("readable by its group (mode 640)")),
            (
                0o644,
                Some("readable by its group and every local user (mode 644)"),
            ),
            (0o604, Some("readable by every local user (mode 604)")),
        ] {
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).expect("chmod");
            assert_eq!(
                exposed(&path).as_deref(),
                want.map(|w| format!("is {w}")).as_deref()
            );
        }
    }

    #[test]
    fn an_upstream_with_credentials_is_refused() {
        let err =
            from_text("upstream = \"http://user:secret@127.0.0.1:3000\"\n").expect_err("userinfo");
        assert!(err.0.contains("carries a user or password"), "{err}");
        assert!(
            err.0
                .starts_with("idem.toml:1: upstream = \"http://user:***@127.0.0.1:3000\""),
            "{err}"
        );
        assert!(
            !err.0.contains("secret"),
            "no password in the message: {err}"
        );
    }

    #[test]
    fn routes_hold_by_default_and_may_name_a_lookup() {
        let s = from_text(
            "upstream = \"http://x:1\"\n[[route]]\nmethod = \"POST\"\npath = \"/v1/orders/{id}/capture\"\n\
             [route.reconcile]\npath = \"/v1/orders/{id}/captures/{key}\"\nstatus = 201\nsettle = \"10s\"\ngive_up = \"2h\"\n\
             [[route]]\nmethod = \"POST\"\npath = \"/v1/refunds\"\non_lease_expiry = \"retry\"\n",
        )
        .expect("valid");
        let capture = s
            .routes
            .matching(&Method::POST, "/v1/orders/7/capture")
            .expect("route");
        assert_eq!(capture.policy.engine.on_lease_expiry, LeaseExpiry::Hold);
        let lookup = capture.policy.lookup.as_ref().expect("lookup");
        assert_eq!(lookup.method(), Method::GET);
        assert_eq!(lookup.status(), Some(StatusCode::CREATED));
        assert_eq!(lookup.schedule().settle, Duration::from_secs(10));
        assert_eq!(lookup.schedule().give_up, Duration::from_secs(7200));
        let refunds = s
            .routes
            .matching(&Method::POST, "/v1/refunds")
            .expect("route");
        assert_eq!(refunds.policy.engine.on_lease_expiry, LeaseExpiry::Retry);
        assert!(refunds.policy.lookup.is_none());
        assert_eq!(
            s.routes.defaults().engine.on_lease_expiry,
            LeaseExpiry::Hold,
            "the default never runs a held attempt again"
        );
    }

    #[test]
    fn bad_lookups_are_refused_with_the_line() {
        let route = "upstream = \"http://x:1\"\n[[route]]\nmethod = \"POST\"\npath = \"/v1/payments\"\n[route.reconcile]\n";
        for (tail, want) in [
            ("status = 201\n", "route[0].reconcile has no path"),
            (
                "path = \"/v1/payments/{id}/{key}\"\n",
                "idem.toml:6: route[0].reconcile.path = \"/v1/payments/{id}/{key}\": {id} is not a parameter of the route's path \"/v1/payments\"",
            ),
            (
                "path = \"/v1/payments/by-key\"\n",
                "must name the record by {key}",
            ),
            (
                "path = \"/v1/p/{key}\"\nstatus = 404\n",
                "idem.toml:7: route[0].reconcile.status = 404: must be a 2xx status",
            ),
            (
                "path = \"/v1/p/{key}\"\nmethod = \"DELETE\"\n",
                "route[0].reconcile.method = \"DELETE\": expected \"GET\"",
            ),
            (
                "path = \"/v1/p/{key}\"\nsettle = \"0s\"\n",
                "route[0].reconcile.settle = \"0s\": must be greater than zero",
            ),
        ] {
            let err = from_text(&format!("{route}{tail}")).expect_err(tail);
            assert!(err.0.contains(want), "{tail}: {err}");
        }
        let err =
            from_text("upstream = \"http://x:1\"\n[defaults.reconcile]\npath = \"/v1/{key}\"\n")
                .expect_err("defaults");
        assert!(err.0.contains("a lookup belongs to one route"), "{err}");
    }

    #[test]
    fn bad_values_name_line_key_value_and_why() {
        let cases = [
            (
                "upstream = \"http://x:1\"\n[defaults]\nlease = \"3x\"\n",
                "idem.toml:3: defaults.lease = \"3x\": not a duration",
            ),
            (
                "upstream = \"http://x:1\"\n[defaults]\nmax_request_body = \"1 parsec\"\n",
                "idem.toml:3: defaults.max_request_body = \"1 parsec\": unknown unit",
            ),
            (
                "upstream = \"http://x:1\"\n[defaults]\non_in_flight = \"queue\"\n",
                "idem.toml:3: defaults.on_in_flight = \"queue\": expected \"reject\" or \"wait\"",
            ),
            (
                "upstream = \"http://x:1\"\n[[route]]\nmethod = \"POST\"\npath = \"v1\"\n",
                "idem.toml:4: route[0].path = \"v1\": invalid path pattern",
            ),
            (
                "upstream = \"http://x:1\"\n[[route]]\nmethod = \"P OST\"\npath = \"/v1\"\n",
                "idem.toml:3: route[0].method = \"P OST\": not an HTTP method",
            ),
            (
                "upstream = \"http://x:1\"\n[[route]]\npath = \"/v1\"\n",
                "route[0] has no method",
            ),
            (
                "upstream = \"http://x:1\"\n[defaults]\nmismatch_status = 200\n",
                "idem.toml:3: defaults.mismatch_status = 200: must be a 4xx",
            ),
            (
                "upstream = \"ftp://x\"\n",
                "idem.toml:1: upstream = \"ftp://x\": the upstream must be an http:// URL",
            ),
            (
                "upstream = \"http://x:1\"\nlisten = \"localhost\"\n",
                "idem.toml:2: listen = \"localhost\": \"localhost\" is not an address",
            ),
            (
                "upstream = \"http://x:1\"\n[tenant]\nfrom = \"jwt\"\n",
                "idem.toml:3: tenant.from = \"jwt\": expected",
            ),
            (
                "upstream = \"http://x:1\"\n[defaults]\nlease = \"0s\"\n",
                "idem.toml:3: defaults.lease = \"0s\": must be greater than zero",
            ),
            (
                "upstream = \"http://x:1\"\n[[route]]\nmethod = \"POST\"\npath = \"/a\"\nupstream_timeout = \"1s\"\n",
                "upstream_timeout is set once",
            ),
            (
                "upstream = \"http://x:1\"\n[cleanup]\nbatch = 0\n",
                "idem.toml:3: cleanup.batch = 0: must be a whole number from 1 to 1000000",
            ),
            (
                "upstream = \"http://x:1\"\n[cleanup]\ninterval = \"soon\"\n",
                "idem.toml:3: cleanup.interval = \"soon\": not a duration",
            ),
            (
                "upstream = \"http://x:1\"\n[monitor]\nstuck_after_leases = -1\n",
                "idem.toml:3: monitor.stuck_after_leases = -1: must be a whole number",
            ),
            (
                "upstream = \"http://x:1\"\n[monitor]\ninterval = \"0s\"\n",
                "idem.toml:3: monitor.interval = \"0s\": must be greater than zero",
            ),
        ];
        for (text, expected) in cases {
            let err = from_text(text).expect_err(text).to_string();
            assert!(
                err.starts_with(expected) || err.contains(expected),
                "{text:?}\n got: {err}\nwant: {expected}"
            );
        }
    }

    #[test]
    fn unknown_keys_are_refused_with_their_line() {
        let err = from_text("upstream = \"http://x:1\"\n[defaults]\nretension = \"1h\"\n")
            .expect_err("typo")
            .to_string();
        assert!(err.contains("line 3") && err.contains("retension"), "{err}");
        let err = from_text("upstream = \"http://x:1\"\ncolour = 1\n")
            .expect_err("unknown")
            .to_string();
        assert!(err.contains("colour"), "{err}");
    }

    #[test]
    fn upstream_is_required_and_flags_win() {
        let err = from_text("").expect_err("no upstream").to_string();
        assert!(
            err.contains("--upstream") && err.contains("IDEM_UPSTREAM"),
            "{err}"
        );
        let parsed: FileConfig =
            toml::from_str("upstream = \"http://a:1\"\nlisten = \"127.0.0.1:1\"").expect("toml");
        let o = Overrides {
            upstream: Some("http://b:2".into()),
            listen: Some("127.0.0.1:2".into()),
            ..Overrides::default()
        };
        let s = build(
            parsed,
            &Source {
                file: Path::new("f"),
                text: "",
            },
            &o,
        )
        .expect("valid");
        assert_eq!(
            (s.upstream.to_string().as_str(), s.listen.port()),
            ("http://b:2/", 2)
        );
        let err = build(
            FileConfig::default(),
            &Source {
                file: Path::new("f"),
                text: "",
            },
            &Overrides {
                upstream: Some("nope".into()),
                ..Overrides::default()
            },
        )
        .expect_err("bad flag")
        .to_string();
        assert!(err.starts_with("--upstream / IDEM_UPSTREAM:"), "{err}");
    }

    #[test]
    fn exposed_admin_needs_a_token() {
        let err = from_text("upstream = \"http://x:1\"\nadmin_listen = \"0.0.0.0:9090\"\n")
            .expect_err("no token")
            .to_string();
        assert!(err.contains("admin token"), "{err}");
        assert!(from_text("upstream = \"http://x:1\"\nadmin_listen = \"0.0.0.0:9090\"\nadmin_token = \"s3cret-0123456789abcdef0123456789ab\"\n").is_ok());
        // A guessable token is refused, wherever it comes from, unquoted.
        let short =
            from_text("upstream = \"http://x:1\"\nadmin_token = \"s3cret\"\n").expect_err("short");
        assert!(short.to_string().contains("at least 32"), "{short}");
        assert!(!short.to_string().contains("s3cret"), "{short}");
        let dir = tempfile::tempdir().expect("dir");
        let token_file = dir.path().join("admin-token");
        std::fs::write(&token_file, "t0ken-from-a-file-0123456789abcdef\n").expect("write");
        let from_file = from_text(&format!(
            "upstream = \"http://x:1\"\nadmin_token_file = {:?}\n",
            token_file.display().to_string()
        ))
        .expect("file");
        assert_eq!(
            from_file.admin_token.as_deref(),
            Some("t0ken-from-a-file-0123456789abcdef")
        );
        let both = from_text(&format!(
            "upstream = \"http://x:1\"\nadmin_token = \"x\"\nadmin_token_file = {:?}\n",
            token_file.display().to_string()
        ));
        assert!(both.expect_err("both").to_string().contains("not both"));
    }

    #[test]
    fn background_jobs_default_on_and_follow_the_longest_lease() {
        let s = from_text("upstream = \"http://x:1\"\n").expect("valid");
        assert_eq!(
            s.cleanup,
            Some(CleanupSettings {
                interval: Duration::from_secs(60),
                batch: 1000
            })
        );
        assert_eq!(s.monitor, MonitorSettings::default());
        let s = from_text(
            "upstream = \"http://x:1\"\n[cleanup]\nenabled = false\n[monitor]\nstuck_after_leases = 2\n[[route]]\nmethod = \"POST\"\npath = \"/slow\"\nlease = \"2m\"\n",
        )
        .expect("valid");
        assert_eq!(s.cleanup, None);
        assert_eq!(s.monitor.stuck_after, Duration::from_secs(240));
    }

    #[test]
    fn the_record_cache_defaults_on_and_can_be_sized_or_turned_off() {
        let s = from_text("upstream = \"http://x:1\"\n").expect("valid");
        assert_eq!(s.cache, Some(CacheSettings::default()));
        let s =
            from_text("upstream = \"http://x:1\"\n[cache]\nsize = \"4MiB\"\nmax_age = \"5s\"\n")
                .expect("valid");
        assert_eq!(
            s.cache,
            Some(CacheSettings {
                size: 4 << 20,
                max_age: Duration::from_secs(5)
            })
        );
        let s = from_text("upstream = \"http://x:1\"\n[cache]\nsize = \"0\"\n").expect("valid");
        assert_eq!(s.cache, None);
        for (text, needle) in [
            (
                "[cache]\nsize = \"lots\"\n",
                "idem.toml:3: cache.size = \"lots\"",
            ),
            (
                "[cache]\nmax_age = \"0s\"\n",
                "idem.toml:3: cache.max_age = \"0s\": must be greater than zero",
            ),
            ("[cache]\nttl = \"1s\"\n", "unknown field `ttl`"),
        ] {
            let err = from_text(&format!("upstream = \"http://x:1\"\n{text}")).expect_err(text);
            assert!(err.0.contains(needle), "{text}: {}", err.0);
        }
    }

    #[test]
    fn limits_default_sane_and_refuse_nonsense() {
        let s = from_text("upstream = \"http://x:1\"\n").expect("valid");
        assert_eq!(s.limits, LimitsSettings::default());
        assert_eq!(s.workers, default_workers());
        assert!(s.workers >= 1);
        let s = from_text("upstream = \"http://x:1\"\nworkers = 3\n").expect("valid");
        assert_eq!(s.workers, 3);
        let s = from_text("upstream = \"http://x:1\"\nworkers = 0\n").expect("valid");
        assert_eq!(s.workers, 0);
        let s = from_text(
            "upstream = \"http://x:1\"\n[limits]\nmax_connections = 100\nmax_in_flight = 8\nqueue_wait = \"0s\"\nheader_read_timeout = \"2s\"\nbody_read_timeout = \"3s\"\nbody_total_timeout = \"0s\"\nmax_headers = 20\nmax_header_bytes = \"16KiB\"\n",
        )
        .expect("valid");
        assert_eq!(
            s.limits,
            LimitsSettings {
                max_connections: 100,
                max_in_flight: 8,
                max_connections_per_peer: 50,
                max_in_flight_per_peer: 4,
                queue_wait: Duration::ZERO,
                header_read_timeout: Duration::from_secs(2),
                body_read_timeout: Duration::from_secs(3),
                body_total_timeout: Duration::ZERO,
                idle_timeout: Duration::from_secs(60),
                max_headers: 20,
                max_header_bytes: 16 << 10,
            }
        );
        for (text, needle) in [
            (
                "[limits]\nmax_in_flight = 0\n",
                "idem.toml:3: limits.max_in_flight = 0: must be a whole number from 1 to 1000000",
            ),
            (
                "[limits]\nmax_connections = -5\n",
                "idem.toml:3: limits.max_connections = -5",
            ),
            (
                "[limits]\nheader_read_timeout = \"-1s\"\n",
                "limits.header_read_timeout = \"-1s\"",
            ),
            (
                "[limits]\nbody_read_timeout = \"soon\"\n",
                "limits.body_read_timeout = \"soon\"",
            ),
            (
                "[limits]\nmax_header_bytes = \"1KiB\"\n",
                "limits.max_header_bytes = \"1KiB\": must be from 8KiB to 16MiB",
            ),
            ("[limits]\nmax_body = 5\n", "unknown field `max_body`"),
            (
                "workers = -1\n",
                "idem.toml:2: workers = -1: must be a whole number from 0 (serve on the shared runtime) to 1024",
            ),
            ("workers = \"many\"\n", "line 2, column 11"),
        ] {
            let err = from_text(&format!("upstream = \"http://x:1\"\n{text}")).expect_err(text);
            assert!(err.0.contains(needle), "{text}: {}", err.0);
        }
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_size("1MiB"), Ok(1 << 20));
        assert_eq!(parse_size("64 KiB"), Ok(64 << 10));
        assert_eq!(parse_size("10MB"), Ok(10_000_000));
        assert_eq!(parse_size("512"), Ok(512));
        assert!(parse_size("MiB").is_err());
        assert!(parse_size("1.5MiB").is_err());
        assert!(parse_size("99999999999999GiB").is_err());
    }
}
