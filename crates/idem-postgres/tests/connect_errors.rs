//! Each way of pointing at the wrong server gives one clear line, with any
//! password redacted.

mod common;

use std::time::Duration;

use idem_postgres::{PgError, PgOptions, PgStore};

/// The test server's URL with its database replaced.
fn with_database(url: &str, db: &str) -> String {
    let (base, _) = url.rsplit_once('/').expect("URL has a database");
    format!("{base}/{db}")
}

fn one_line(err: &PgError) -> String {
    let text = err.to_string();
    assert!(!text.contains('\n'), "one line: {text}");
    text
}

#[tokio::test]
async fn wrong_scheme() {
    let err = PgStore::connect("mysql://root:s3cret@127.0.0.1/idem")
        .await
        .expect_err("not postgres");
    let text = one_line(&err);
    assert!(text.contains("must start with postgres://"), "{text}");
    assert!(!text.contains("s3cret"), "{text}");
}

#[tokio::test]
async fn unreachable_server() {
    let err = PgStore::connect("postgres://app:s3cret@127.0.0.1:1/idem")
        .await
        .expect_err("nothing listens on port 1");
    let text = one_line(&err);
    assert!(text.contains("connection refused"), "{text}");
    assert!(
        text.contains("postgres://app:***@127.0.0.1:1/idem"),
        "{text}"
    );
    assert!(!text.contains("s3cret"), "{text}");
    assert!(idem::StoreError::from(err).is_transient());
}

#[tokio::test]
async fn silent_server_times_out() {
    // A listener that accepts but never answers.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let port = listener.local_addr().expect("addr").port();
    let _hold = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((sock, _)) = listener.accept().await {
            held.push(sock);
        }
    });
    let opts = PgOptions::from_url(&format!("postgres://app@127.0.0.1:{port}/idem"))
        .expect("valid")
        .with_connect_timeout(Duration::from_millis(300));
    let err = PgStore::connect_with(opts).await.expect_err("no answer");
    let text = one_line(&err);
    assert!(text.contains("no connection within"), "{text}");
}

#[tokio::test]
async fn missing_database() {
    let Some(url) = idem_testkit::services::postgres() else {
        return;
    };
    let err = PgStore::connect(&with_database(&url, "idem_no_such_database"))
        .await
        .expect_err("no such database");
    let text = one_line(&err);
    assert!(
        text.contains("database \"idem_no_such_database\" does not exist"),
        "{text}"
    );
    assert!(!idem::StoreError::from(err).is_transient());
}

#[tokio::test]
async fn wrong_credentials() {
    let Some(url) = idem_testkit::services::postgres() else {
        return;
    };
    let opts = PgOptions::from_url(&url).expect("valid");
    let connect = opts
        .connect
        .clone()
        .username("idem_no_such_role")
        .password("s3cret");
    let mut opts = PgOptions::new(connect);
    opts.connect_timeout = Duration::from_secs(5);
    let err = PgStore::connect_with(opts).await.expect_err("no such role");
    let text = one_line(&err);
    assert!(text.contains("authentication failed"), "{text}");
    assert!(text.contains("idem_no_such_role"), "{text}");
    assert!(!text.contains("s3cret"), "{text}");
}
