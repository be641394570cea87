//! The secret keying a store's tenants and fingerprints: configured, or
//! the embedded store's own, kept beside its database.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use idem::HashSecret;

use crate::error::GatewayError;

/// The embedded store's own hash secret, beside its database: read, or
/// made (mode 0600) at first start. Made beside a database that already
/// exists (records from before keyed hashing), the file also says until
/// when those are looked for: `retention` from now.
pub(super) fn embedded_secret(
    db: &Path,
    retention: Duration,
) -> Result<(Arc<HashSecret>, Option<SystemTime>), GatewayError> {
    let mut name = db.as_os_str().to_owned();
    name.push(".secret");
    let path = PathBuf::from(name);
    let read = |path: &Path| {
        let text = std::fs::read_to_string(path).map_err(|e| {
            GatewayError::io(format!("cannot read the hash secret {}", path.display()), e)
        })?;
        crate::config::parse_secret_file(&text)
            .map(|(s, until)| (Arc::new(s), until))
            .map_err(|e| GatewayError::StoreUrl(format!("{}: {e}", path.display())))
    };
    if path.exists() {
        return read(&path);
    }
    let (secret, hex) = HashSecret::generate();
    let existing = std::fs::metadata(db).is_ok_and(|m| m.len() > 0);
    let until = existing.then(|| SystemTime::now() + retention);
    let mut text = format!(
        "# The secret keying this database's tenants and fingerprints (made by idem serve).\n# Keep it with the database: without it, no retry finds its record.\n{hex}\n"
    );
    if let Some(until) = until {
        text.push_str(&format!(
            "# The database held records from before keyed hashing: looked for until then.\naccept_v1_until = {}\n",
            humantime::format_rfc3339_seconds(until)
        ));
    }
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create_new(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
    match options.open(&path) {
        Ok(mut file) => {
            use std::io::Write as _;
            file.write_all(text.as_bytes())
                .and_then(|()| file.sync_all())
                .map_err(|e| {
                    GatewayError::io(
                        format!("cannot write the hash secret {}", path.display()),
                        e,
                    )
                })?;
            tracing::info!(file = %path.display(), "made a hash secret for this database: keep it with the database");
            Ok((Arc::new(secret), until))
        }
        // Another gateway made it first.
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => read(&path),
        Err(e) => Err(GatewayError::io(
            format!("cannot create the hash secret {}", path.display()),
            e,
        )),
    }
}
