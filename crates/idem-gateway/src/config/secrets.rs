//! Secrets: the admin token, the hash secret and the sealing keys, from
//! the environment or from files, whose errors never quote the secret and
//! whose exposure to other local users is warned about.

use std::path::Path;
use std::sync::Arc;
use std::time::SystemTime;

use idem::HashSecret;
use idem::seal::SealKeys;
use toml::Spanned;

use super::error::ConfigError;
use super::file::{FileConfig, Source};
use super::values::Refused;

/// The fewest characters an admin token may have: a guessable one would
/// open the records (and the operator actions) to anyone who can reach the
/// admin listener.
pub const MIN_ADMIN_TOKEN: usize = 32;

/// The admin token: `--admin-token`/`IDEM_ADMIN_TOKEN`, else `admin_token`,
/// else the first line of the file `admin_token_file` names. At least
/// [`MIN_ADMIN_TOKEN`] visible characters; errors never quote it.
pub(super) fn admin_token(
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
        return Err(ConfigError::new(format!(
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
pub fn parse_secret_file(text: &str) -> Result<(HashSecret, Option<SystemTime>), Refused> {
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
            return Err(Refused("more than one secret line".to_owned()));
        } else {
            secret = Some(HashSecret::from_hex(line).map_err(|e| e.to_string())?);
        }
    }
    let secret = secret.ok_or("no secret in it (openssl rand -hex 32)")?;
    Ok((secret, until))
}

/// The hash secret: `IDEM_HASH_SECRET`, else the file `hash_secret_file`
/// names. Errors name the source, never the secret.
pub(super) fn hash_secret(
    src: &Source<'_>,
    env: Option<&str>,
    file: Option<&Spanned<String>>,
) -> Result<(Option<Arc<HashSecret>>, Option<SystemTime>), ConfigError> {
    match (env, file) {
        (Some(hex), _) => HashSecret::from_hex(hex)
            .map(|s| (Some(Arc::new(s)), None))
            .map_err(|e| ConfigError::new(format!("{HASH_SECRET_ENV}: {e}"))),
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

pub(super) fn env_keys(spec: &str) -> Result<Arc<SealKeys>, ConfigError> {
    SealKeys::parse(spec)
        .map(Arc::new)
        .map_err(|e| ConfigError::new(format!("{ENCRYPTION_KEYS_ENV}: {e}")))
}

/// The sealing keys: `IDEM_ENCRYPTION_KEYS`, else the file named by
/// `encryption_keys_file` (same format, one key per line). Errors name the
/// source, never a key.
pub(super) fn seal_keys(
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
pub(super) fn read_secret_file(
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
pub(super) fn exposed(path: &Path) -> Option<String> {
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
