//! What the payments tests share: databases in schemas of their own,
//! services on ephemeral loopback ports, orders.

#![allow(dead_code, unreachable_pub)]

use std::net::SocketAddr;

use axum::http::{Method, StatusCode};
use idem_postgres::sqlx;
use idem_testkit::client::send;

/// The test server's URL with `schema=NAME`.
pub fn database(pg: &str, schema: &str) -> String {
    format!(
        "{pg}{}schema={schema}",
        if pg.contains('?') { '&' } else { '?' }
    )
}

/// Serves `router` on an ephemeral loopback port for the rest of the test.
pub async fn serve(router: axum::Router) -> SocketAddr {
    let (addr, _) = payments::serve(
        "127.0.0.1:0".parse().expect("addr"),
        router,
        std::future::pending(),
    )
    .await
    .expect("serve");
    addr
}

/// Creates an order of `amount_cents` EUR; returns its id.
pub async fn create_order(orders: SocketAddr, amount_cents: i64) -> String {
    let r = send(
        orders,
        Method::POST,
        "/v1/orders",
        &[
            ("authorization", "Bearer shop-1"),
            ("content-type", "application/json"),
        ],
        format!(r#"{{"amount_cents":{amount_cents},"currency":"EUR"}}"#),
    )
    .await;
    assert_eq!(r.status, StatusCode::CREATED);
    let order: serde_json::Value = serde_json::from_slice(&r.body).expect("order");
    order["id"].as_str().expect("id").to_owned()
}

/// One number from `sql`.
pub async fn scalar(pool: &sqlx::PgPool, sql: &str) -> i64 {
    sqlx::query_scalar(sql)
        .fetch_one(pool)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"))
}
