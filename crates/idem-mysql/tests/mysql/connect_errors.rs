//! Each wrong server, database, credential or URL gives one clear line,
//! password redacted, and a store on a database never migrated says so.

use crate::common;

use std::time::Duration;

use idem::{IdempotencyKey, Scope, Store, StoreError};
use idem_mysql::{MySqlError, MySqlOptions, MySqlStore};

#[tokio::test]
async fn refused_connections_and_bad_urls_are_defined_errors() {
    // Port 1 on loopback: nothing listens there.
    let err = MySqlStore::connect("mysql://u:s3cret@127.0.0.1:1/idem")
        .await
        .expect_err("refused");
    assert!(
        matches!(&err, MySqlError::Connect { reason, .. } if reason.contains("connection refused")),
        "{err}"
    );
    assert!(err.is_transient(), "a server may come up: {err}");
    let text = err.to_string();
    assert!(!text.contains("s3cret"), "{text}");
    assert!(text.contains("mysql://u:***@127.0.0.1:1/idem"), "{text}");

    for url in [
        "postgres://127.0.0.1/idem",
        "mysql://u:s3cret@127.0.0.1:port/idem",
    ] {
        let err = MySqlStore::connect(url).await.expect_err(url);
        assert!(matches!(err, MySqlError::Url { .. }), "{url}: {err}");
        assert!(!err.to_string().contains("s3cret"), "{err}");
        assert!(!err.is_transient(), "{err}");
    }
}

#[tokio::test]
async fn an_unknown_database_or_user_is_refused_in_one_line() {
    let Some(opts) = common::options() else {
        return;
    };
    let connect = opts.connect_options().clone();
    let unknown_db = opts
        .clone()
        .with_connect_options(connect.clone().database("idem_no_such_database"));
    let err = MySqlStore::connect_with(unknown_db)
        .await
        .expect_err("no such database");
    assert!(
        matches!(&err, MySqlError::Connect { reason, .. } if reason.contains("create it")),
        "{err}"
    );
    assert!(!err.is_transient(), "{err}");

    let unknown_user =
        opts.with_connect_options(connect.username("idem_no_such_user").password("s3cret"));
    let err = MySqlStore::connect_with(unknown_user)
        .await
        .expect_err("no such user");
    assert!(
        matches!(&err, MySqlError::Connect { reason, .. } if reason.contains("authentication failed")),
        "{err}"
    );
    assert!(!err.to_string().contains("s3cret"), "{err}");
}

#[tokio::test]
async fn a_database_never_migrated_says_how_to_migrate() {
    let Some(db) = idem_testkit::isolated::MysqlDatabase::new("not_migrated") else {
        return;
    };
    let opts = MySqlOptions::from_url(&db.url())
        .expect("url")
        .with_migrate(false)
        .with_connect_timeout(Duration::from_secs(5));
    let store = MySqlStore::connect_with(opts).await.expect("connect");
    let scope = Scope::new("acme", "op").expect("scope");
    let key: IdempotencyKey = "k".parse().expect("key");
    match store.get(&scope, &key).await {
        Err(StoreError::Backend(err)) => {
            assert!(
                err.to_string()
                    .contains("idem schema is not in this database"),
                "{err}"
            );
        }
        other => panic!("expected a missing-schema error, got {other:?}"),
    }
    store.close().await;
}
