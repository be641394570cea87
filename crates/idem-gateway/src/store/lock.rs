//! One gateway per embedded database: [`ServingLock`], an exclusive lock
//! on `<database>.lock` held for as long as a gateway serves the file.
//!
//! The embedded store's writer thread is what makes its reservations
//! atomic: two gateways on one file would each have one, and their group
//! commits would contend for SQLite's write lock until requests time out.
//! So a second `idem serve` on the same file is refused at start, naming
//! the process that serves it. Operator commands (`records`, `cleanup`,
//! `migrate`) take no lock: they are meant to run beside the gateway.
//!
//! The lock is `flock(2)` on a file of its own (SQLite's own locks are
//! POSIX record locks on the database, which `flock` leaves alone), so it
//! goes with the process: a gateway that is SIGKILLed holds nothing.

use std::fs::{File, OpenOptions, TryLockError};
use std::io::{Read, Seek, Write};
use std::path::{Path, PathBuf};

use crate::error::GatewayError;

/// Held while this process serves the embedded database; released when
/// dropped or when the process ends, however it ends.
#[derive(Debug)]
pub struct ServingLock {
    _file: File,
    path: PathBuf,
}

impl ServingLock {
    /// Takes the lock of the database at `database`, or says who holds it.
    pub fn acquire(database: &Path) -> Result<Self, GatewayError> {
        // One file, one lock, however it is named: through a symlink, a
        // relative path or another spelling of its directory.
        let canonical = match database.canonicalize() {
            Ok(path) => path,
            Err(_) => match (database.parent(), database.file_name()) {
                (Some(dir), Some(file)) => {
                    let dir = if dir.as_os_str().is_empty() {
                        Path::new(".")
                    } else {
                        dir
                    };
                    dir.canonicalize()
                        .map_or_else(|_| database.to_path_buf(), |d| d.join(file))
                }
                _ => database.to_path_buf(),
            },
        };
        let mut name = canonical.into_os_string();
        name.push(".lock");
        let path = PathBuf::from(name);
        let io = |what: &str, e| GatewayError::io(format!("{what} {}", path.display()), e);
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(|e| io("cannot open the embedded store's lock file", e))?;
        match file.try_lock() {
            Ok(()) => {}
            Err(TryLockError::WouldBlock) => {
                let mut holder = String::new();
                let _ = file.read_to_string(&mut holder);
                let holder = holder.trim();
                let who = if holder.is_empty() {
                    "another process".to_owned()
                } else {
                    format!("another gateway ({holder})")
                };
                return Err(GatewayError::InUse(format!(
                    "the embedded store {} is already served by {who}: one gateway per database file. Stop that one, give this one a file of its own (--store sqlite://other.db), or share a PostgreSQL store between gateways",
                    database.display()
                )));
            }
            Err(TryLockError::Error(e)) => return Err(io("cannot lock", e)),
        }
        // Who holds it, for the next one that tries.
        let holder = format!(
            "pid {}, since {}\n",
            std::process::id(),
            humantime::format_rfc3339_seconds(std::time::SystemTime::now())
        );
        file.set_len(0)
            .and_then(|()| file.rewind())
            .and_then(|()| file.write_all(holder.as_bytes()))
            .map_err(|e| io("cannot write", e))?;
        Ok(Self { _file: file, path })
    }

    /// The lock file.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_lock_is_refused_naming_the_holder_and_freed_on_drop() {
        let dir = tempfile::tempdir().expect("temp dir");
        let db = dir.path().join("idem.db");
        let first = ServingLock::acquire(&db).expect("first");
        let canonical_dir = dir.path().canonicalize().expect("dir");
        assert_eq!(first.path(), canonical_dir.join("idem.db.lock"));
        let err = ServingLock::acquire(&db).expect_err("second");
        let msg = err.to_string();
        assert!(
            msg.contains(&format!(
                "already served by another gateway (pid {}",
                std::process::id()
            )),
            "{msg}"
        );
        assert!(msg.contains("one gateway per database file"), "{msg}");
        // The same file through a symlink is the same lock.
        std::fs::write(&db, b"").expect("create");
        let link = dir.path().join("current.db");
        std::os::unix::fs::symlink(&db, &link).expect("symlink");
        assert!(
            ServingLock::acquire(&link).is_err(),
            "a symlink's lock is the file's"
        );
        drop(first);
        ServingLock::acquire(&db).expect("free again");
    }
}
