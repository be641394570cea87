//! Files and situations a user can get wrong: each gives a typed error with
//! a clear message, and nothing panics.

use std::time::Duration;

use idem::{LeaseExpiry, ListRecords, Store, StoreError};
use idem_sqlite::{SqliteError, SqliteOptions, SqliteStore};
use idem_testkit::conformance::{fp, key, request, unique_scope};

#[test]
fn a_file_that_is_not_a_database_is_refused() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("notes.txt");
    std::fs::write(&path, "these are my notes, not a database\n".repeat(200)).expect("write");
    let err = SqliteStore::open(&path).expect_err("not a database");
    let msg = err.to_string();
    assert!(msg.contains("notes.txt"), "{msg}");
    assert!(
        matches!(err, SqliteError::Open { ref source, .. } if matches!(**source, SqliteError::NotADatabase(_))),
        "{err:?}"
    );
    assert!(
        format!("{msg} {}", source_chain(&err)).contains("not an SQLite database"),
        "{msg}"
    );
    assert!(matches!(StoreError::from(err), StoreError::Corrupt(_)));
    // The file is untouched.
    assert!(
        std::fs::read_to_string(&path)
            .expect("read")
            .starts_with("these are my notes")
    );
}

#[test]
fn a_missing_directory_names_the_path() {
    let err =
        SqliteStore::open("/nonexistent-idem-dir/sub/idem.db").expect_err("no such directory");
    let msg = err.to_string();
    assert!(msg.contains("/nonexistent-idem-dir/sub/idem.db"), "{msg}");
}

#[test]
fn a_newer_schema_is_refused_not_downgraded() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("idem.db");
    drop(SqliteStore::open(&path).expect("create"));
    let conn = rusqlite::Connection::open(&path).expect("open");
    conn.pragma_update(None, "user_version", 99).expect("bump");
    drop(conn);
    let err = SqliteStore::open(&path).expect_err("too new");
    let chain = source_chain(&err);
    assert!(
        chain.contains("version 99") && chain.contains("upgrade idem"),
        "{chain}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_locked_by_another_process_is_unavailable_then_recovers() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("idem.db");
    let opts = SqliteOptions::new(&path).with_busy_timeout(Duration::from_millis(200));
    let store = SqliteStore::open_with(opts.clone()).expect("open");

    // Another connection (as another process would) holds the write lock.
    let other = rusqlite::Connection::open(&path).expect("open");
    other.execute_batch("BEGIN EXCLUSIVE").expect("lock");

    let (scope, k) = (unique_scope("locked"), key("k"));
    let err = store
        .reserve(request(
            &scope,
            &k,
            fp("a"),
            Duration::from_secs(30),
            LeaseExpiry::Retry,
        ))
        .await
        .expect_err("locked");
    assert!(err.is_transient(), "{err:?}");
    assert!(
        source_chain(&err).contains("locked"),
        "{}",
        source_chain(&err)
    );
    // Opening a second store while locked fails with the same clear reason.
    let open_err = SqliteStore::open_with(opts).expect_err("locked at open");
    assert!(
        source_chain(&open_err).contains("locked"),
        "{}",
        source_chain(&open_err)
    );

    other.execute_batch("ROLLBACK").expect("unlock");
    let ok = store
        .reserve(request(
            &scope,
            &k,
            fp("a"),
            Duration::from_secs(30),
            LeaseExpiry::Retry,
        ))
        .await
        .expect("works again once the lock is gone");
    assert!(matches!(ok, idem::Reservation::Acquired(_)));
}

#[tokio::test]
async fn a_corrupt_stored_row_is_reported_as_corrupt() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("idem.db");
    let store = SqliteStore::open(&path).expect("open");
    let (scope, k) = (unique_scope("corrupt"), key("k"));
    store
        .reserve(request(
            &scope,
            &k,
            fp("a"),
            Duration::from_secs(30),
            LeaseExpiry::Retry,
        ))
        .await
        .expect("reserve");
    let conn = rusqlite::Connection::open(&path).expect("open");
    conn.execute("UPDATE idem_records SET fingerprint = x'00'", [])
        .expect("damage");
    let err = store.get(&scope, &k).await.expect_err("corrupt row");
    assert!(matches!(err, StoreError::Corrupt(_)), "{err:?}");
    assert!(
        source_chain(&err).contains("fingerprint"),
        "{}",
        source_chain(&err)
    );
}

fn source_chain(err: &dyn std::error::Error) -> String {
    let mut out = err.to_string();
    let mut cur = err.source();
    while let Some(e) = cur {
        out.push_str(" <- ");
        out.push_str(&e.to_string());
        cur = e.source();
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_do_not_wait_behind_a_stuck_writer() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("idem.db");
    let opts = SqliteOptions::new(&path).with_busy_timeout(Duration::from_secs(3));
    let store = std::sync::Arc::new(SqliteStore::open_with(opts).expect("open"));
    let (scope, k) = (unique_scope("reads"), key("existing"));
    store
        .reserve(request(
            &scope,
            &k,
            fp("a"),
            Duration::from_secs(30),
            LeaseExpiry::Retry,
        ))
        .await
        .expect("reserve");

    // Another process holds the write lock: the writer thread blocks in
    // its busy timeout on the next write.
    let other = rusqlite::Connection::open(&path).expect("open");
    other.execute_batch("BEGIN EXCLUSIVE").expect("lock");
    let blocked = {
        let store = std::sync::Arc::clone(&store);
        let scope = scope.clone();
        tokio::spawn(async move {
            let k = key("blocked-write");
            store
                .reserve(request(
                    &scope,
                    &k,
                    fp("a"),
                    Duration::from_secs(30),
                    LeaseExpiry::Retry,
                ))
                .await
        })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    // Reads go to their own connections: answered while the write waits.
    let rec = store
        .get(&scope, &k)
        .await
        .expect("read while the writer waits");
    assert!(rec.is_some());
    let page = store
        .list(&idem::ListFilter {
            tenant: Some(scope.tenant().to_owned()),
            limit: 10,
            ..Default::default()
        })
        .await
        .expect("list while the writer waits");
    assert_eq!(page.records.len(), 1);
    assert!(
        !blocked.is_finished(),
        "the write is still waiting for the lock"
    );
    other.execute_batch("ROLLBACK").expect("unlock");
    let write = blocked
        .await
        .expect("task")
        .expect("write goes through once the lock is gone");
    assert!(matches!(write, idem::Reservation::Acquired(_)));
}

/// The database holds every stored answer: it, its WAL and its shared
/// memory file are the owner's only (0600), whatever the umask.
#[cfg(unix)]
#[tokio::test]
async fn a_new_database_and_its_wal_are_readable_by_their_owner_only() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("idem.db");
    let store = SqliteStore::open(&path).expect("open");
    let scope = unique_scope("perms");
    store
        .reserve(request(
            &scope,
            &key("k"),
            fp("a"),
            Duration::from_secs(30),
            LeaseExpiry::Hold,
        ))
        .await
        .expect("reserve");
    for name in ["idem.db", "idem.db-wal", "idem.db-shm"] {
        let mode = std::fs::metadata(dir.path().join(name))
            .unwrap_or_else(|e| panic!("{name}: {e}"))
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600, "{name}: {:o}", mode & 0o777);
    }
}
