//! Parsers of single values (durations, sizes, addresses, the upstream
//! URL, header names), each error naming the key, the value and why.

use std::net::SocketAddr;
use std::time::Duration;

use http::{HeaderName, Uri};
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
        Some("http") => {}
        Some("https") => return Err(Refused("https upstreams are not supported yet; put the gateway next to the service and use http://".to_owned())),
        _ => return Err(Refused("the upstream must be an http:// URL such as http://127.0.0.1:3000".to_owned())),
    }
    match uri.authority() {
        None => return Err(Refused("the upstream URL has no host".to_owned())),
        Some(a) if a.as_str().contains('@') => {
            return Err(Refused("the upstream URL carries a user or password; idem sends no credentials of its own upstream (clients' headers are forwarded): write http://host:port".to_owned()));
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

pub(super) fn parse_addr(text: &str) -> Result<SocketAddr, Refused> {
    text.parse()
        .map_err(|_| Refused(format!("{text:?} is not an address like 127.0.0.1:8080")))
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
    v.get_ref()
        .iter()
        .map(|h| {
            HeaderName::from_bytes(h.trim().to_ascii_lowercase().as_bytes())
                .map_err(|_| src.error(key, v, format!("{h:?} is not a header name")))
        })
        .collect()
}
