//! Parsers of single values (durations, sizes, addresses, the upstream
//! URL, header names), each error naming the key, the value and why.

use std::net::SocketAddr;
use std::time::Duration;

use http::{HeaderName, Method, Uri};
use toml::Spanned;

use super::error::ConfigError;

/// Why one value was refused. Its caller knows where the value came from
/// (a file line, a flag) and places this in a [`ConfigError`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Refused(pub(crate) String);

impl From<&str> for Refused {
    fn from(why: &str) -> Self {
        Self(why.to_owned())
    }
}

impl From<String> for Refused {
    fn from(why: String) -> Self {
        Self(why)
    }
}
use super::file::Source;

/// A count from 1 to `max`, or an error naming the key, the value and the range.
pub(super) fn whole(
    src: &Source<'_>,
    key: &str,
    v: &Spanned<i64>,
    max: usize,
) -> Result<usize, ConfigError> {
    usize::try_from(*v.get_ref())
        .ok()
        .filter(|n| (1..=max).contains(n))
        .ok_or_else(|| src.error(key, v, format!("must be a whole number from 1 to {max}")))
}

/// A message for a value that came from the file (with its line) or from a
/// flag / environment variable.
pub(super) fn located(from_file: Option<ConfigError>, why: &Refused, flag: &str) -> ConfigError {
    match from_file {
        Some(prefix) => prefix.map_message(|prefix| format!("{prefix}{why}")),
        None => ConfigError::new(format!("{flag}: {why}")),
    }
}

pub(super) fn parse_upstream(text: &str) -> Result<Uri, Refused> {
    let uri: Uri = text.parse().map_err(|e| format!("not a URL ({e})"))?;
    match uri.scheme_str() {
        Some("http" | "https") => {}
        _ => {
            return Err(Refused(
                "the upstream must be an http:// or https:// URL such as http://127.0.0.1:3000"
                    .to_owned(),
            ));
        }
    }
    match uri.authority() {
        None => return Err(Refused("the upstream URL has no host".to_owned())),
        Some(a) if a.as_str().contains('@') => {
            return Err(Refused("the upstream URL carries a user or password; idem sends no credentials of its own upstream (clients' headers are forwarded): write http://host:port or https://host:port".to_owned()));
        }
        Some(a) if uri.scheme_str() == Some("https") => {
            let host = a.host().trim_start_matches('[').trim_end_matches(']');
            if rustls::pki_types::ServerName::try_from(host).is_err() {
                return Err(Refused(format!(
                    "{host:?} is not a name a TLS certificate can be checked against"
                )));
            }
        }
        Some(_) => {}
    }
    if uri
        .path_and_query()
        .is_some_and(|p| p.as_str() != "/" && !p.as_str().is_empty())
    {
        return Err(Refused(
            "the upstream is an origin (scheme, host, port) without a path".to_owned(),
        ));
    }
    Ok(uri)
}

/// A listening address: `127.0.0.1:8080`, `[::1]:8080`, or a host name and
/// port (`localhost:8080`), resolved once at start (IPv4 first, as most
/// clients try it first).
pub(super) fn parse_addr(text: &str) -> Result<SocketAddr, Refused> {
    use std::net::ToSocketAddrs;
    if let Ok(addr) = text.parse() {
        return Ok(addr);
    }
    let refused = |why: &str| {
        Refused(format!(
            "{text:?} is not an address like 127.0.0.1:8080 or localhost:8080{why}"
        ))
    };
    let Some((host, port)) = text.rsplit_once(':') else {
        return Err(refused(" (no port)"));
    };
    if host.is_empty() || port.parse::<u16>().is_err() {
        return Err(refused(""));
    }
    let addrs: Vec<SocketAddr> = text
        .to_socket_addrs()
        .map_err(|e| refused(&format!(" ({host:?} does not resolve: {e})")))?
        .collect();
    addrs
        .iter()
        .find(|a| a.is_ipv4())
        .or_else(|| addrs.first())
        .copied()
        .ok_or_else(|| refused(&format!(" ({host:?} resolves to no address)")))
}

/// The HTTP methods IANA registers (RFC 9110 §16.1's registry, with
/// WebDAV's, RFC 5789's PATCH and the QUERY draft's), the only ones a
/// route may name: a typo such as `PSOT` would make a route that never
/// matches, and every POST it meant to protect would pass unprotected.
const METHODS: &[&str] = &[
    "ACL",
    "BASELINE-CONTROL",
    "BIND",
    "CHECKIN",
    "CHECKOUT",
    "CONNECT",
    "COPY",
    "DELETE",
    "GET",
    "HEAD",
    "LABEL",
    "LINK",
    "LOCK",
    "MERGE",
    "MKACTIVITY",
    "MKCALENDAR",
    "MKCOL",
    "MKREDIRECTREF",
    "MKWORKSPACE",
    "MOVE",
    "OPTIONS",
    "ORDERPATCH",
    "PATCH",
    "POST",
    "PRI",
    "PROPFIND",
    "PROPPATCH",
    "PUT",
    "QUERY",
    "REBIND",
    "REPORT",
    "SEARCH",
    "TRACE",
    "UNBIND",
    "UNCHECKOUT",
    "UNLINK",
    "UNLOCK",
    "UPDATE",
    "UPDATEREDIRECTREF",
    "VERSION-CONTROL",
];

/// A route's method, any case, refused unless registered; a near miss is
/// named (`PSOT`: did you mean "POST"?).
pub(super) fn parse_method(text: &str) -> Result<Method, Refused> {
    let upper = text.trim().to_ascii_uppercase();
    if METHODS.contains(&upper.as_str())
        && let Ok(m) = Method::from_bytes(upper.as_bytes())
    {
        return Ok(m);
    }
    Err(Refused(format!(
        "not an HTTP method{}",
        did_you_mean(&upper, METHODS.iter().copied())
    )))
}

/// `" (did you mean \"POST\"?)"` when one of `known` is within two edits
/// of `word` (a transposition counts as one), else nothing.
pub(crate) fn did_you_mean<'a>(word: &str, known: impl IntoIterator<Item = &'a str>) -> String {
    known
        .into_iter()
        .map(|k| (strsim::damerau_levenshtein(word, k), k))
        // Two edits apart for longer words; one for short ones, where two
        // make another word (PURGE is not a misspelt MERGE).
        .filter(|(d, _)| *d <= if word.len() > 5 { 2 } else { 1 } && *d < word.len())
        .min_by_key(|(d, _)| *d)
        .map(|(_, k)| format!(" (did you mean {k:?}?)"))
        .unwrap_or_default()
}

pub(super) fn duration(
    src: &Source<'_>,
    key: &str,
    v: &Spanned<String>,
) -> Result<Duration, ConfigError> {
    humantime::parse_duration(v.get_ref().trim()).map_err(|e| {
        src.error(
            key,
            v,
            format!("not a duration like \"30s\" or \"24h\" ({e})"),
        )
    })
}

pub(super) fn positive<T>(
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
pub fn parse_size(text: &str) -> Result<usize, Refused> {
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
            return Err(Refused(format!(
                "unknown unit {other:?}; use B, KiB, MiB, GiB, KB, MB or GB"
            )));
        }
    };
    n.checked_mul(mult)
        .and_then(|b| usize::try_from(b).ok())
        .ok_or_else(|| Refused("too large".to_owned()))
}

pub(super) fn size(src: &Source<'_>, key: &str, v: &Spanned<String>) -> Result<usize, ConfigError> {
    match parse_size(v.get_ref()) {
        Ok(0) => Err(src.error(key, v, "must be greater than zero")),
        Ok(n) => Ok(n),
        Err(why) => Err(src.error(key, v, why)),
    }
}

pub(super) fn header_names(
    src: &Source<'_>,
    key: &str,
    v: &Spanned<Vec<String>>,
) -> Result<Vec<HeaderName>, ConfigError> {
    each(src, key, v, |h| {
        HeaderName::from_bytes(h.trim().to_ascii_lowercase().as_bytes())
            .map_err(|_| format!("{h:?} is not a header name"))
    })
}

/// Each item of a list, parsed by `parse`; the first refusal names the
/// key, the line and the item's reason.
pub(super) fn each<T>(
    src: &Source<'_>,
    key: &str,
    v: &Spanned<Vec<String>>,
    parse: impl Fn(&str) -> Result<T, String>,
) -> Result<Vec<T>, ConfigError> {
    v.get_ref()
        .iter()
        .map(|item| parse(item).map_err(|why| src.error(key, v, why)))
        .collect()
}

/// The `--log` filter (`info`, `warn,idem_http=debug`), checked before it
/// is used: a bare word must be a level, since tracing would read `inf0` as
/// the name of a module to trace and then log nothing else at all.
pub fn log_filter(text: &str) -> Result<tracing_subscriber::filter::Targets, Refused> {
    use tracing_subscriber::filter::LevelFilter;
    const LEVELS: [&str; 6] = ["off", "error", "warn", "info", "debug", "trace"];
    let level = |l: &str| l.parse::<LevelFilter>().ok();
    // Trimmed and without empty directives: tracing would read " warn" as
    // a target and an empty one as "error only".
    let directives: Vec<&str> = text
        .split(',')
        .map(str::trim)
        .filter(|d| !d.is_empty())
        .collect();
    let mut global = None;
    let mut names_client = false;
    for directive in &directives {
        let (target, lvl) = match directive.split_once('=') {
            Some((t, l)) => (Some(t.trim()), l.trim()),
            None => (None, *directive),
        };
        let Some(parsed) = level(lvl) else {
            let hint = did_you_mean(&lvl.to_ascii_lowercase(), LEVELS);
            return Err(Refused(match target {
                Some(t) => format!(
                    "{directive:?}: {lvl:?} is not a level{hint}; write {t}=LEVEL with LEVEL one of off, error, warn, info, debug, trace"
                ),
                None if hint.is_empty() => format!(
                    "{directive:?} is not a level: write one of off, error, warn, info, debug, trace, or TARGET=LEVEL such as idem_http=debug"
                ),
                None => format!("{directive:?} is not a level{hint}"),
            }));
        };
        match target {
            None => global = Some(parsed),
            Some(t) => {
                let t = t.split('[').next().unwrap_or(t);
                names_client |= t == QUIET_CLIENT || t.starts_with(&format!("{QUIET_CLIENT}::"));
            }
        }
    }
    let mut cleaned = directives.join(",");
    // The NATS client logs every reconnect attempt at INFO; the relay says
    // an outage once, in its own words. Its lines stay a target away, and
    // never louder than the rest (`--log off` stays off).
    if !names_client {
        let quiet = global.unwrap_or(LevelFilter::OFF).min(LevelFilter::WARN);
        if !cleaned.is_empty() {
            cleaned.push(',');
        }
        cleaned.push_str(&format!("{QUIET_CLIENT}={quiet}"));
    }
    cleaned.parse().map_err(|e| {
        Refused(format!(
            "{text:?} is not a log filter ({e}); write e.g. info or warn,idem_http=debug"
        ))
    })
}

/// The client library whose own event lines `--log` leaves out unless it
/// names it (`--log info,async_nats=info`).
const QUIET_CLIENT: &str = "async_nats";
