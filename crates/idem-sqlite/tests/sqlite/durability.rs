//! What survives: a clean restart (drop and reopen), a killed process, and
//! a batch that fails half-way.

use std::collections::HashSet;
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use idem::{Engine, Fingerprint, IdempotencyKey, RecordState, Run, Scope, Store, StoredResponse};
use idem_sqlite::SqliteStore;
use tokio::task::JoinSet;

fn scope() -> Scope {
    Scope::new("tenant", "POST /v1/payments").expect("scope")
}

fn fp(i: usize) -> Fingerprint {
    Fingerprint::builder()
        .json_body(format!(r#"{{"amount":{i}}}"#).as_bytes())
        .finish()
}

fn key(i: usize) -> IdempotencyKey {
    format!("key-{i}").parse().expect("key")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn completed_records_survive_drop_and_reopen() {
    const N: usize = 500;
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("idem.db");
    let engine = Engine::new(SqliteStore::open(&path).expect("open"));
    let mut tasks = JoinSet::new();
    for i in 0..N {
        let engine = engine.clone();
        tasks.spawn(async move {
            let body = format!("payment {i}");
            let run = engine
                .run(&scope(), &key(i), fp(i), || async move {
                    StoredResponse::new(201, body)
                        .with_header("location", format!("/v1/payments/{i}"))
                })
                .await
                .expect("run");
            assert!(matches!(run, Run::Executed(_)));
        });
    }
    while let Some(done) = tasks.join_next().await {
        done.expect("task");
    }
    let stats = engine.store().commit_stats();
    assert_eq!(stats.failed_commits, 0);
    assert!(stats.operations >= 2 * N as u64, "{stats:?}");
    drop(engine);

    let store = SqliteStore::open(&path).expect("reopen");
    for i in 0..N {
        let rec = store
            .get(&scope(), &key(i))
            .await
            .expect("get")
            .expect("record survived");
        assert_eq!(rec.state, RecordState::Completed);
        assert_eq!(rec.fingerprint, fp(i));
        let resp = rec.response.expect("response kept");
        assert_eq!(resp.body, format!("payment {i}").into_bytes());
        assert_eq!(
            resp.headers,
            vec![("location".to_owned(), format!("/v1/payments/{i}").into())]
        );
    }
    // And the reopened store still replays instead of executing.
    let engine = Engine::new(store);
    let run = engine
        .run(&scope(), &key(7), fp(7), || async {
            panic!("must not run again")
        })
        .await
        .expect("run");
    assert!(matches!(run, Run::Replayed(ref r) if r.response.body == "payment 7"));
}

/// The child half of `acknowledged_records_survive_sigkill`: writes and
/// completes records forever, printing each key once its completion was
/// acknowledged (committed). Run only by that test.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "child process of acknowledged_records_survive_sigkill"]
async fn sigkill_child_writer() {
    let Ok(path) = std::env::var("IDEM_SQLITE_CHILD_DB") else {
        return;
    };
    let engine = Engine::new(SqliteStore::open(&path).expect("open"));
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    for worker in 0..16 {
        let (engine, tx) = (engine.clone(), tx.clone());
        tokio::spawn(async move {
            for n in 0.. {
                let i = worker * 1_000_000 + n;
                let run = engine
                    .run(&scope(), &key(i), fp(i), || async move {
                        StoredResponse::new(201, format!("p{i}"))
                    })
                    .await
                    .expect("run");
                assert!(matches!(run, Run::Executed(_)));
                if tx.send(i).is_err() {
                    return;
                }
            }
        });
    }
    while let Some(i) = rx.recv().await {
        println!("acked {i}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acknowledged_records_survive_sigkill() {
    const ACKS: usize = 2_000;
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("idem.db");
    // A test's name is its path in the binary, without the crate.
    let module = module_path!().split_once("::").map_or("", |(_, m)| m);
    let child_test = format!("{module}::sigkill_child_writer");
    let mut child = Command::new(std::env::current_exe().expect("test binary"))
        .args([
            "--ignored",
            "--exact",
            child_test.as_str(),
            "--nocapture",
            "--test-threads",
            "1",
        ])
        .env("IDEM_SQLITE_CHILD_DB", &path)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn child");
    let stdout = child.stdout.take().expect("stdout");
    let acked: Vec<usize> = tokio::task::spawn_blocking(move || {
        BufReader::new(stdout)
            .lines()
            .map_while(Result::ok)
            .filter_map(|l| l.strip_prefix("acked ").and_then(|n| n.parse().ok()))
            .take(ACKS)
            .collect()
    })
    .await
    .expect("reader");
    // SIGKILL mid-stream: no destructor, no checkpoint, commits in flight.
    child.kill().expect("kill");
    child.wait().expect("reap");
    assert_eq!(
        acked.len(),
        ACKS,
        "child acknowledged enough writes before the kill"
    );

    let store = SqliteStore::open(&path).expect("reopen after kill");
    for &i in &acked {
        let rec = store.get(&scope(), &key(i)).await.expect("get");
        let rec = rec.unwrap_or_else(|| panic!("acknowledged record {i} lost"));
        assert_eq!(rec.state, RecordState::Completed, "record {i}");
        assert_eq!(
            rec.response.expect("response").body,
            format!("p{i}").into_bytes()
        );
    }
    drop(store);
    let conn = rusqlite::Connection::open(&path).expect("open");
    let check: String = conn
        .query_row("PRAGMA integrity_check", [], |r| r.get(0))
        .expect("check");
    assert_eq!(check, "ok");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_failed_batch_is_reported_to_its_callers_and_loses_nothing_else() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("idem.db");
    let store = Arc::new(SqliteStore::open(&path).expect("open"));
    // Records committed before the failure.
    for i in 0..20 {
        let engine = Engine::from_arc(Arc::clone(&store));
        engine
            .run(&scope(), &key(i), fp(i), || async move {
                StoredResponse::new(201, "before")
            })
            .await
            .expect("run");
    }
    // A trigger that aborts the whole transaction when it meets one key:
    // whatever shares a batch with it is rolled back by SQLite.
    let admin = rusqlite::Connection::open(&path).expect("open");
    admin
        .execute_batch(
            "CREATE TRIGGER poison BEFORE INSERT ON idem_records WHEN NEW.key = 'key-poison' \
             BEGIN SELECT RAISE(ROLLBACK, 'injected batch failure'); END;",
        )
        .expect("trigger");

    let mut tasks = JoinSet::new();
    for i in 100..400 {
        let store = Arc::clone(&store);
        tasks.spawn(async move {
            let k = key(i);
            let r = store
                .reserve(idem_testkit::conformance::request(
                    &scope(),
                    &k,
                    fp(i),
                    Duration::from_secs(60),
                    idem::LeaseExpiry::Retry,
                ))
                .await;
            (i, r.is_ok())
        });
    }
    let poison: IdempotencyKey = "key-poison".parse().expect("key");
    let poisoned = store
        .reserve(idem_testkit::conformance::request(
            &scope(),
            &poison,
            fp(0),
            Duration::from_secs(60),
            idem::LeaseExpiry::Retry,
        ))
        .await;
    let err = poisoned.expect_err("the poisoned insert fails");
    assert!(err.is_transient(), "{err}");

    let mut ok = HashSet::new();
    let mut failed = HashSet::new();
    while let Some(done) = tasks.join_next().await {
        let (i, success) = done.expect("task");
        if success {
            ok.insert(i)
        } else {
            failed.insert(i)
        };
    }
    assert!(!ok.is_empty());
    // Every caller told "ok" has its record; every caller told "failed" has
    // none: nothing was half-stored or silently dropped.
    for i in 100..400 {
        let present = store.get(&scope(), &key(i)).await.expect("get").is_some();
        assert_eq!(present, ok.contains(&i), "record {i}: present={present}");
    }
    assert!(store.get(&scope(), &poison).await.expect("get").is_none());
    for i in 0..20 {
        let rec = store
            .get(&scope(), &key(i))
            .await
            .expect("get")
            .expect("earlier record kept");
        assert_eq!(rec.state, RecordState::Completed);
    }
    let stats = store.commit_stats();
    assert!(stats.failed_commits >= 1, "{stats:?}");
    eprintln!(
        "batch failure: {} ok, {} failed with the poisoned batch",
        ok.len(),
        failed.len()
    );
}

#[tokio::test]
async fn purge_deletes_exactly_its_batch_and_never_processing_rows() {
    use idem::{FinalOutcome, LeaseExpiry, Purge, Reservation, Verdict};
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("idem.db");
    let store = SqliteStore::open(&path).expect("open");
    for i in 0..10 {
        let k = key(i);
        let Reservation::Acquired(lease) = store
            .reserve(idem_testkit::conformance::request(
                &scope(),
                &k,
                fp(i),
                Duration::from_secs(60),
                LeaseExpiry::Retry,
            ))
            .await
            .expect("reserve")
        else {
            panic!("acquired");
        };
        if i < 7 {
            let outcome = FinalOutcome {
                verdict: Verdict::Completed,
                response: StoredResponse::new(200, "x"),
                resource_id: None,
                error_code: None,
                retention: Duration::from_millis(1),
            };
            store
                .resolve(&scope(), &k, &lease, &outcome)
                .await
                .expect("resolve");
        }
    }
    tokio::time::sleep(Duration::from_millis(20)).await;
    let rows = |path: &std::path::Path| -> i64 {
        let conn = rusqlite::Connection::open(path).expect("open");
        conn.query_row("SELECT count(*) FROM idem_records", [], |r| r.get(0))
            .expect("count")
    };
    assert_eq!(rows(&path), 10);
    assert_eq!(store.purge_expired(3).await.expect("purge"), 3);
    assert_eq!(rows(&path), 7);
    assert_eq!(store.purge_expired(3).await.expect("purge"), 3);
    assert_eq!(store.purge_expired(3).await.expect("purge"), 1);
    assert_eq!(store.purge_expired(3).await.expect("purge"), 0);
    assert_eq!(rows(&path), 3, "the three processing rows stay");
}

/// A large purge batch does not become one long transaction on the single
/// writer: it is spread over commits of at most `PURGE_CHUNK` rows, so
/// serving operations queued meanwhile are committed in between instead of
/// waiting for (and paying the fsync of) a thousand deletions.
#[tokio::test]
async fn a_large_purge_is_spread_over_short_commits() {
    use idem::Purge;
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("idem.db");
    let store = SqliteStore::open(&path).expect("open");
    drop(store);
    {
        let conn = rusqlite::Connection::open(&path).expect("open");
        let tx = conn.unchecked_transaction().expect("tx");
        for i in 0..1000 {
            tx.execute(
                "INSERT INTO idem_records (tenant, operation, key, fingerprint, state, created_at, \
                 updated_at, expires_at, locked_until, owner, attempt) \
                 VALUES ('t', 'op', ?1, zeroblob(32), 'completed', 0, 0, 1, 0, zeroblob(16), 1)",
                [format!("k{i}")],
            )
            .expect("insert");
        }
        tx.commit().expect("commit");
    }
    let store = SqliteStore::open(&path).expect("reopen");
    let before = store.commit_stats().commits;
    assert_eq!(store.purge_expired(1000).await.expect("purge"), 1000);
    let commits = store.commit_stats().commits - before;
    // At most 100 deletions per commit (PURGE_CHUNK is 8).
    assert!(commits >= 10, "1000 deletions in {commits} commits");
    assert_eq!(store.purge_expired(1000).await.expect("purge"), 0);
}

/// The WAL is copied back into the database file by the background
/// checkpoint thread, not left to grow until the writer does it inside a
/// commit: the database file itself grows while the store sits idle.
#[tokio::test]
async fn the_wal_is_checkpointed_in_the_background() {
    use idem::{LeaseExpiry, Reservation};
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("idem.db");
    let store = SqliteStore::open(&path).expect("open");
    let size = || std::fs::metadata(&path).expect("database file").len();
    tokio::time::sleep(Duration::from_millis(600)).await;
    let before = size();
    for i in 0..2000 {
        let reserved = store
            .reserve(idem_testkit::conformance::request(
                &scope(),
                &key(i),
                fp(i),
                Duration::from_secs(60),
                LeaseExpiry::Retry,
            ))
            .await
            .expect("reserve");
        assert!(matches!(reserved, Reservation::Acquired(_)));
    }
    // 2,000 records are far below the writer's own threshold; only the
    // background checkpoints, kicked by the commits, copy them into the
    // file.
    let mut grown = false;
    for _ in 0..40 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        if size() > before + 100 * 1024 {
            grown = true;
            break;
        }
    }
    assert!(grown, "database file still {} bytes (was {before})", size());
}
