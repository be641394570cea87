//! The pool's ping at work: a connection the server closed while it sat
//! idle is replaced before an operation uses it, or, with the ping off,
//! fails that one operation as a transient error.

use crate::common;

use std::time::Duration;

use idem::{IdempotencyKey, Scope, Store, StoreError};
use idem_mysql::MySqlStore;
use sqlx::Connection;

/// Kills the one connection of `store`'s pool from another connection.
async fn kill_the_pooled_connection(store: &MySqlStore, t: &common::Isolated) {
    let id: u64 = sqlx::query_scalar("SELECT CONNECTION_ID()")
        .fetch_one(store.pool())
        .await
        .expect("connection id");
    let mut admin = sqlx::MySqlConnection::connect_with(t.opts.connect_options())
        .await
        .expect("admin connection");
    sqlx::query(&format!("KILL {id}"))
        .execute(&mut admin)
        .await
        .expect("kill");
    admin.close().await.expect("close");
}

#[tokio::test]
async fn a_connection_killed_while_idle_is_replaced_when_pinged() {
    let Some(t) = common::Isolated::new("pool").await else {
        return;
    };
    let scope = Scope::new("acme", "op").expect("scope");
    let key: IdempotencyKey = "k".parse().expect("key");

    let pinged = t
        .opts
        .clone()
        .with_max_connections(1)
        .with_ping_after_idle(Duration::ZERO);
    let store = MySqlStore::connect_with(pinged).await.expect("connect");
    kill_the_pooled_connection(&store, &t).await;
    assert_eq!(
        store.get(&scope, &key).await.expect("the ping replaced it"),
        None
    );
    store.close().await;

    let unpinged = t
        .opts
        .clone()
        .with_max_connections(1)
        .with_test_before_acquire(false);
    let store = MySqlStore::connect_with(unpinged).await.expect("connect");
    kill_the_pooled_connection(&store, &t).await;
    match store.get(&scope, &key).await {
        Err(err @ StoreError::Unavailable(_)) => assert!(err.is_transient()),
        other => panic!("expected a transient failure, got {other:?}"),
    }
    assert_eq!(
        store
            .get(&scope, &key)
            .await
            .expect("replaced after the failure"),
        None
    );
    store.close().await;
}
