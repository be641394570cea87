//! The shared store conformance suite on the SQLite store, alone and as
//! the durable tier under a memory cache.

use std::sync::Arc;

use idem::{MemoryStore, Tiered};
use idem_sqlite::SqliteStore;
use idem_testkit::conformance::Fixture;

/// A store in a fresh temporary directory, removed after the test.
struct TempSqlite<S> {
    store: Arc<S>,
    _dir: tempfile::TempDir,
}

impl<S: idem::Store + idem::ListRecords + idem::Purge> Fixture for TempSqlite<S> {
    type Store = S;
    fn store(&self) -> Arc<S> {
        Arc::clone(&self.store)
    }
}

fn temp_store() -> (SqliteStore, tempfile::TempDir) {
    let dir = tempfile::tempdir().expect("temp dir");
    let store = SqliteStore::open(dir.path().join("idem.db")).expect("open");
    (store, dir)
}

mod sqlite {
    use super::*;
    idem_testkit::store_conformance!(async {
        let (store, dir) = temp_store();
        TempSqlite {
            store: Arc::new(store),
            _dir: dir,
        }
    });
}

mod sqlite_one_row_per_commit {
    use super::*;
    idem_testkit::store_conformance!(async {
        let dir = tempfile::tempdir().expect("temp dir");
        let opts = idem_sqlite::SqliteOptions::new(dir.path().join("idem.db")).with_max_batch(1);
        TempSqlite {
            store: Arc::new(SqliteStore::open_with(opts).expect("open")),
            _dir: dir,
        }
    });
}

mod tiered_memory_sqlite {
    use super::*;
    idem_testkit::store_conformance!(async {
        let (store, dir) = temp_store();
        TempSqlite {
            store: Arc::new(Tiered::new(MemoryStore::new(), store)),
            _dir: dir,
        }
    });
}
