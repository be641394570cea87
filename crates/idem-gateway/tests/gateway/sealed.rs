//! Response bodies sealed at rest (`IDEM_ENCRYPTION_KEYS`) through the real
//! gateway on the embedded store: nothing of a body in the database files,
//! replays in clear, keys rotated across restarts, a record whose key is
//! gone never run again, bad keys refused at start without echoing them.

use std::path::Path;

use http::StatusCode;
use idem_testkit::gateway::{GatewayProcess as Gateway, sqlite_store};
use idem_testkit::upstream::CountingUpstream;

const IDEM: &str = env!("CARGO_BIN_EXE_idem");

const K1: &str = "k1:000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f";
const K2: &str = "k2:ffeeddccbbaa99887766554433221100ffeeddccbbaa99887766554433221100";

const CONFIG: &str = r#"
[[route]]
method = "POST"
path = "/v1/payments"
require_key = true

[[route]]
method = "POST"
path = "/v1/open"
require_key = true
on_store_error = "open"
"#;

/// A 2,000-byte body of `x`, as the upstream answers with `x-size`.
const BODY_LEN: &str = "2000";

async fn start(dir: &Path, up: &CountingUpstream, keys: &str) -> Gateway {
    let store = sqlite_store(dir);
    let env = [("IDEM_ENCRYPTION_KEYS", keys)];
    Gateway::builder(IDEM, dir)
        .config(CONFIG)
        .upstream(&up.url())
        .store(&store)
        .log("error")
        .envs(&env)
        .start()
        .await
}

/// Whether any of the database's files (main, WAL) hold 100 `x` in a row.
fn clear_text_on_disk(dir: &Path) -> bool {
    let run = vec![b'x'; 100];
    std::fs::read_dir(dir)
        .expect("dir")
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().starts_with("idem.db"))
        .any(|e| {
            std::fs::read(e.path())
                .map(|bytes| bytes.windows(run.len()).any(|w| w == run.as_slice()))
                .unwrap_or(false)
        })
}

async fn pay(gw: &Gateway, key: &str) -> idem_testkit::client::Answer {
    pay_at(gw, "/v1/payments", key).await
}

async fn pay_at(gw: &Gateway, path: &str, key: &str) -> idem_testkit::client::Answer {
    gw.post(
        path,
        &[("idempotency-key", key), ("x-size", BODY_LEN)],
        "{}",
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bodies_are_sealed_at_rest_replayed_in_clear_and_keys_rotate() {
    let up = CountingUpstream::start().await;

    // The control: without keys the body is on disk, and found.
    let plain = tempfile::tempdir().expect("temp dir");
    let store = sqlite_store(plain.path());
    let gw = Gateway::builder(IDEM, plain.path())
        .config(CONFIG)
        .upstream(&up.url())
        .store(&store)
        .log("error")
        .start()
        .await;
    assert_eq!(pay(&gw, "plain-1").await.status, StatusCode::CREATED);
    gw.terminate().await;
    assert!(
        clear_text_on_disk(plain.path()),
        "the check finds a clear body"
    );

    let dir = tempfile::tempdir().expect("temp dir");
    let gw = start(dir.path(), &up, K1).await;
    let first = pay(&gw, "sealed-1").await;
    assert_eq!(first.status, StatusCode::CREATED);
    let open_first = pay_at(&gw, "/v1/open", "sealed-open").await;
    assert_eq!(open_first.status, StatusCode::CREATED);
    assert_eq!(first.body.len(), 2000);
    let replay = pay(&gw, "sealed-1").await;
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    assert_eq!(replay.body, first.body, "replayed in clear");
    gw.terminate().await;
    assert!(
        !clear_text_on_disk(dir.path()),
        "a body reached the disk in clear"
    );

    // Rotation: k2 seals from now on, k1 still opens what it sealed.
    let gw = start(dir.path(), &up, &format!("{K2},{K1}")).await;
    let old = pay(&gw, "sealed-1").await;
    assert_eq!(old.header("idempotent-replayed"), Some("true"));
    assert_eq!(old.body, first.body);
    let second = pay(&gw, "sealed-2").await;
    assert_eq!(second.status, StatusCode::CREATED);
    gw.terminate().await;

    // k1 dropped too early: its record cannot be read, and is not run
    // again either; k2's still replays.
    let gw = start(dir.path(), &up, K2).await;
    let unreadable = pay(&gw, "sealed-1").await;
    assert_eq!(
        unreadable.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "{:?}",
        unreadable.body
    );
    assert_eq!(up.executions("sealed-1"), 1, "never run twice");
    // Not even on a fail-open route: the store answered, with a record it
    // cannot read; that is not an unreachable store.
    let open_unreadable = pay_at(&gw, "/v1/open", "sealed-open").await;
    assert_eq!(open_unreadable.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(open_unreadable.header("idempotency-status"), None);
    assert_eq!(up.executions("sealed-open"), 1, "not forwarded unprotected");
    let newer = pay(&gw, "sealed-2").await;
    assert_eq!(newer.header("idempotent-replayed"), Some("true"));
    assert_eq!(newer.body, second.body);
    assert_eq!(up.executions("sealed-2"), 1);
    gw.terminate().await;
    assert!(!clear_text_on_disk(dir.path()));
}

#[tokio::test]
async fn bad_keys_stop_the_gateway_at_start_without_echoing_them() {
    let dir = tempfile::tempdir().expect("temp dir");
    let secret = "k1:00010203040506070809zz";
    let out = tokio::process::Command::new(IDEM)
        .args([
            "serve",
            "--upstream",
            "http://127.0.0.1:9",
            "--listen",
            "127.0.0.1:0",
        ])
        .args(["--admin-listen", "127.0.0.1:0"])
        .arg("--store")
        .arg(sqlite_store(dir.path()))
        .env("IDEM_ENCRYPTION_KEYS", secret)
        .output()
        .await
        .expect("run idem");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("IDEM_ENCRYPTION_KEYS") && stderr.contains("64 hex digits"),
        "{stderr}"
    );
    assert!(
        !stderr.contains("00010203"),
        "key material in the message: {stderr}"
    );
}

/// Someone who can write to the store changes a sealed answer's status
/// and headers, gives it another fingerprint, or plants a record of their
/// own with a clear body: none of it is replayed (`503`, the record
/// refused as corrupt), and nothing runs again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_changed_or_planted_in_the_store_are_refused_not_replayed() {
    use idem_sqlite::rusqlite;
    let up = CountingUpstream::start().await;
    let dir = tempfile::tempdir().expect("temp dir");
    let store = sqlite_store(dir.path());
    let env = [("IDEM_ENCRYPTION_KEYS", K1)];
    let strict = format!("require_sealed = true\n{CONFIG}");
    let gw = Gateway::builder(IDEM, dir.path())
        .config(&strict)
        .upstream(&up.url())
        .store(&store)
        .log("error")
        .envs(&env)
        .start()
        .await;
    for key in ["status", "headers", "fingerprint", "model"] {
        assert_eq!(pay(&gw, key).await.status, StatusCode::CREATED);
    }
    gw.terminate().await;
    let db = rusqlite::Connection::open(dir.path().join("idem.db")).expect("open the database");
    for change in [
        "UPDATE idem_records SET response_status = 200 WHERE key = 'status'",
        "UPDATE idem_records SET response_headers = X'' WHERE key = 'headers'",
        "UPDATE idem_records SET fingerprint = zeroblob(32) WHERE key = 'fingerprint'",
        // A planted record: a copy of a real one under another key, its
        // body in clear.
        "INSERT INTO idem_records SELECT tenant, operation, 'planted', fingerprint, state, created_at, updated_at, expires_at, locked_until, owner, attempt, response_status, response_headers, CAST('{\"charge\":\"forged\"}' AS BLOB), resource_id, error_code FROM idem_records WHERE key = 'model'",
    ] {
        assert_eq!(db.execute(change, []).expect(change), 1, "{change}");
    }
    drop(db);
    let gw = Gateway::builder(IDEM, dir.path())
        .config(&strict)
        .upstream(&up.url())
        .store(&store)
        .log("error")
        .envs(&env)
        .start()
        .await;
    for key in ["status", "headers", "planted"] {
        let answer = pay(&gw, key).await;
        assert_eq!(answer.status, StatusCode::SERVICE_UNAVAILABLE, "{key}");
        assert!(
            !String::from_utf8_lossy(&answer.body).contains("forged"),
            "{key}"
        );
    }
    // The one whose fingerprint changed no longer matches this request:
    // a key reused for another request, not a replay of the altered record.
    assert_eq!(
        pay(&gw, "fingerprint").await.status,
        StatusCode::UNPROCESSABLE_ENTITY
    );
    let untouched = pay(&gw, "model").await;
    assert_eq!(untouched.header("idempotent-replayed"), Some("true"));
    for key in ["status", "headers", "fingerprint", "model", "planted"] {
        assert!(up.executions(key) <= 1, "{key} ran again");
    }
}
