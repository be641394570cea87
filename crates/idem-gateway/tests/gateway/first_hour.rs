//! The mistakes a new user makes in the first hour, each met by the real
//! binary with one line that names the cause and the next step, and the
//! defaults that keep the first screens readable:
//!
//! - a route with a misspelt method or one that an earlier route shadows,
//!   and a log filter that would log nothing, refused at start;
//! - a store written as a bare path, and a listen address by host name;
//! - a second gateway on one SQLite file, refused naming the first;
//! - a PostgreSQL that refuses for good (an unknown role) stops the
//!   gateway before its ready line; an unmigrated schema points at
//!   `idem migrate`, which says what it did and prints no notices;
//! - `/readyz` names what is unavailable once; every unlabelled counter is
//!   in `/metrics` at zero from the start; log files get no colour codes;
//! - a relay whose NATS is unreachable says so once and names it.

use std::process::{Output, Stdio};
use std::time::Duration;

use http::{Method, StatusCode};
use idem_testkit::client::send;
use idem_testkit::gateway::{GatewayProcess as Gateway, TEST_HASH_SECRET, sqlite_store};
use idem_testkit::services;
use idem_testkit::upstream::CountingUpstream;
use tokio::io::AsyncBufReadExt;
use tokio::process::Command;

const IDEM: &str = env!("CARGO_BIN_EXE_idem");

/// Runs `idem args…` to its end (at most 30 s).
async fn idem(args: &[&str]) -> Output {
    tokio::time::timeout(
        Duration::from_secs(30),
        Command::new(IDEM)
            .args(args)
            .env_remove("IDEM_LOG")
            .env("IDEM_HASH_SECRET", TEST_HASH_SECRET)
            .kill_on_drop(true)
            .output(),
    )
    .await
    .expect("idem ends within 30 s")
    .expect("run idem")
}

/// The first line a started process prints (its ready line), within 30 s.
async fn first_line(child: &mut tokio::process::Child) -> String {
    let stdout = child.stdout.take().expect("stdout piped");
    let mut lines = tokio::io::BufReader::new(stdout).lines();
    tokio::time::timeout(Duration::from_secs(30), lines.next_line())
        .await
        .expect("it starts within 30 s")
        .expect("read stdout")
        .expect("a ready line")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Asserts `out` failed with `code`, saying `needle` in one line on
/// stderr, and printed no ready line.
fn refused(out: &Output, code: i32, needle: &str) {
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert_eq!(out.status.code(), Some(code), "{stdout}\n{stderr}");
    assert!(stderr.contains(needle), "wanted {needle:?} in: {stderr}");
    assert_eq!(stderr.trim().lines().count(), 1, "one line: {stderr}");
    assert!(!stdout.contains("listening"), "no ready line: {stdout}");
}

#[tokio::test]
async fn config_mistakes_are_refused_at_start_with_their_line() {
    let dir = tempfile::tempdir().expect("temp dir");
    let config = dir.path().join("idem.toml");
    let config = config.to_str().expect("utf-8 path");
    let serve = |extra: &'static [&'static str]| {
        let mut args = vec![
            "serve",
            "--config",
            config,
            "--upstream",
            "http://127.0.0.1:1",
            "--listen",
            "127.0.0.1:0",
            "--admin-listen",
            "127.0.0.1:0",
        ];
        args.extend_from_slice(extra);
        args
    };
    for (file, needle) in [
        (
            "[[route]]\nmethod = \"PSOT\"\npath = \"/v1/payments\"\n",
            "idem.toml:2: route[0].method = \"PSOT\": not an HTTP method (did you mean \"POST\"?)",
        ),
        (
            "[[route]]\nmethod = \"POST\"\npath = \"/v1/payments\"\n\n[[route]]\nmethod = \"POST\"\npath = \"/v1/payments\"\nrequire_key = true\n",
            "idem.toml:7: route[1].path = \"/v1/payments\": this route is never chosen: route[0] (line 3, POST \"/v1/payments\") comes first",
        ),
    ] {
        std::fs::write(config, file).expect("write config");
        refused(&idem(&serve(&[])).await, 1, needle);
    }
    std::fs::write(config, "").expect("write config");
    refused(
        &idem(&[&["--log", "inf0"][..], &serve(&[])].concat()).await,
        2,
        "--log / IDEM_LOG: \"inf0\" is not a level (did you mean \"info\"?)",
    );
    refused(
        &idem(&serve(&["--store", "idem.db"])).await,
        1,
        "(for the embedded store's database file idem.db, write sqlite://idem.db)",
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_gateway_on_one_sqlite_file_is_refused_naming_the_first() {
    let dir = tempfile::tempdir().expect("temp dir");
    let up = CountingUpstream::start().await;
    let first = Gateway::builder(IDEM, dir.path())
        .upstream(&up.url())
        .start()
        .await;
    let pid = first.child.id().expect("running");
    let store = sqlite_store(dir.path());
    let out = idem(&[
        "serve",
        "--upstream",
        &up.url(),
        "--store",
        &store,
        "--listen",
        "localhost:0",
        "--admin-listen",
        "127.0.0.1:0",
    ])
    .await;
    refused(
        &out,
        1,
        &format!("is already served by another gateway (pid {pid}, since "),
    );
    assert!(text(&out.stderr).contains("one gateway per database file"));
    // Operator commands run beside it.
    let listed = idem(&["records", "list", "--store", &store]).await;
    assert!(listed.status.success(), "{}", text(&listed.stderr));
    assert!(first.terminate().await.success());
    // Once it has stopped, the file is free; and a host name for the
    // listener, as a newcomer writes it, is a fine address.
    let dir2 = dir.path().to_path_buf();
    let mut second = Command::new(IDEM)
        .args(["--log", "warn", "serve", "--upstream", &up.url()])
        .args(["--store", &store, "--listen", "localhost:0"])
        .args(["--admin-listen", "127.0.0.1:0"])
        .current_dir(dir2)
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn");
    let line = first_line(&mut second).await;
    assert!(line.starts_with("idem: listening on 127.0.0.1:"), "{line}");
    second.kill().await.expect("kill");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_names_the_failure_once_and_counters_start_at_zero() {
    let dir = tempfile::tempdir().expect("temp dir");
    let up = CountingUpstream::start().await;
    // Nothing listens on port 1: the gateway starts, not ready.
    let gw = Gateway::builder(IDEM, dir.path())
        .upstream(&up.url())
        .store("postgres://postgres@127.0.0.1:1/test?connect_timeout_ms=200")
        .log("info")
        .log_to_file()
        .start()
        .await;
    let ready = send(gw.admin, Method::GET, "/readyz", &[], "").await;
    assert_eq!(ready.status, StatusCode::SERVICE_UNAVAILABLE);
    let body = text(&ready.body);
    assert!(body.starts_with("not ready: store unavailable: "), "{body}");
    assert_eq!(body.matches("unavailable").count(), 1, "{body}");
    let metrics = text(&send(gw.admin, Method::GET, "/metrics", &[], "").await.body);
    for counter in idem::metrics::ALL
        .iter()
        .filter(|m| m.kind == idem::metrics::Kind::Counter && m.labels.is_empty())
    {
        assert!(
            metrics.lines().any(|l| l == format!("{} 0", counter.name)),
            "{} at zero before any: {metrics}",
            counter.name
        );
    }
    // Every route's request counter too, before the first request.
    assert!(
        metrics.contains("idem_requests_total{route=\"unmatched\",outcome=\"executed\"} 0"),
        "{metrics}"
    );
    assert!(gw.terminate().await.success());
    // Written to a file, the log has no colour codes.
    let log = std::fs::read_to_string(dir.path().join("idem.log")).expect("log");
    assert!(log.contains("store_unreachable"), "{log}");
    assert!(!log.contains('\u{1b}'), "{log:?}");
}

#[tokio::test]
async fn postgres_mistakes_say_what_to_do() {
    let Some(pg) = services::postgres() else {
        return;
    };
    // A role the server does not know: refused for good, so no start.
    let base = pg.split_once('?').map_or(pg.as_str(), |(b, _)| b);
    let (_, host_db) = base.split_once('@').expect("postgres://user@host/db");
    let nobody = format!("postgres://no_such_role_idem@{host_db}");
    let out = idem(&[
        "serve",
        "--upstream",
        "http://127.0.0.1:1",
        "--store",
        &nobody,
        "--listen",
        "127.0.0.1:0",
        "--admin-listen",
        "127.0.0.1:0",
    ])
    .await;
    refused(
        &out,
        1,
        "authentication failed: role \"no_such_role_idem\" does not exist",
    );

    // A schema never migrated: records and outbox point at `idem migrate`.
    let schema = idem_testkit::isolated::PgSchema::on(&pg, "first_hour");
    let store = format!("{}&migrate=false", schema.url());
    let admin = idem_postgres::sqlx::PgPool::connect(&pg)
        .await
        .expect("connect");
    idem_postgres::sqlx::query(&format!("CREATE SCHEMA {}", schema.name()))
        .execute(&admin)
        .await
        .expect("create schema");
    for command in [&["records", "list"][..], &["outbox", "list"][..]] {
        let out = idem(&[command, &["--store", &store]].concat()).await;
        refused(
            &out,
            1,
            "the idem schema is not in this database (relation \"idem_",
        );
        assert!(text(&out.stderr).contains("`idem migrate --store URL`"));
    }
    // The first migration says it created the schema, the second that
    // there was nothing to do; neither prints the server's notices.
    let first = idem(&["migrate", "--store", &store]).await;
    assert!(first.status.success(), "{}", text(&first.stderr));
    assert!(
        text(&first.stdout).contains(": schema created: migrations 1 to "),
        "{}",
        text(&first.stdout)
    );
    let again = idem(&["migrate", "--store", &store]).await;
    assert!(again.status.success(), "{}", text(&again.stderr));
    assert!(
        text(&again.stdout).contains(": schema already at version "),
        "{}",
        text(&again.stdout)
    );
    for out in [&first, &again] {
        assert!(text(&out.stderr).trim().is_empty(), "{}", text(&out.stderr));
    }
    let listed = idem(&["records", "list", "--store", &store]).await;
    assert!(listed.status.success(), "{}", text(&listed.stderr));
    admin.close().await;
    drop(schema);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_without_its_nats_says_so_once_and_names_it() {
    let Some(pg) = services::postgres() else {
        return;
    };
    // A port where nothing listens.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let broker = format!("nats://127.0.0.1:{port}");
    let mut relay = Command::new(IDEM)
        .args(["relay", "--store", &pg, "--broker", &broker])
        .args(["--admin-listen", "127.0.0.1:0"])
        .env_remove("IDEM_LOG")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn idem relay");
    let line = first_line(&mut relay).await;
    let admin: std::net::SocketAddr = line
        .rsplit_once("admin ")
        .and_then(|(_, a)| a.trim().parse().ok())
        .unwrap_or_else(|| panic!("no admin address in {line:?}"));
    // A few seconds of reconnect attempts.
    tokio::time::sleep(Duration::from_secs(4)).await;
    let ready = send(admin, Method::GET, "/readyz", &[], "").await;
    assert_eq!(ready.status, StatusCode::SERVICE_UNAVAILABLE);
    let body = text(&ready.body);
    assert!(
        body.starts_with("not ready: the broker is unreachable")
            && body.trim_end().ends_with(&format!("(broker {broker})")),
        "{body}"
    );
    let pid = relay.id().expect("running").to_string();
    std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .expect("kill");
    let out = tokio::time::timeout(Duration::from_secs(30), relay.wait_with_output())
        .await
        .expect("stops")
        .expect("output");
    let stderr = text(&out.stderr);
    let said: Vec<&str> = stderr
        .lines()
        .filter(|l| l.contains("is unreachable"))
        .collect();
    assert_eq!(said.len(), 1, "once: {stderr}");
    assert!(said[0].contains(&broker), "{stderr}");
    assert!(
        !stderr.contains("async_nats"),
        "no client chatter: {stderr}"
    );
}
