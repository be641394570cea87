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

/// One run's world: the Payment API's and the Order service's databases
/// (schemas of their own) and a bus (stream and prefix of its own, streams
/// created).
pub struct World {
    pub pg: String,
    pub nats: String,
    pub pay_schema: String,
    pub ord_schema: String,
    pub pay_db: String,
    pub ord_db: String,
    pub bus: payments::Bus,
}

/// A [`World`] named after `label`, or `None` (skip) without PostgreSQL
/// and NATS.
pub async fn world(label: &str) -> Option<World> {
    let (Some(pg), Some(nats)) = (
        idem_testkit::services::postgres(),
        idem_testkit::services::nats(),
    ) else {
        return None;
    };
    let tag = idem::OwnerToken::random().to_string()[..8].to_owned();
    let (pay_schema, ord_schema) = (format!("pay_{label}_{tag}"), format!("ord_{label}_{tag}"));
    let (pay_db, ord_db) = (database(&pg, &pay_schema), database(&pg, &ord_schema));
    let bus = payments::Bus {
        nats: nats.clone(),
        stream: format!("{label}_{tag}").to_uppercase(),
        prefix: format!("{label}{tag}"),
    };
    bus.ensure_streams().await.expect("streams");
    Some(World {
        pg,
        nats,
        pay_schema,
        ord_schema,
        pay_db,
        ord_db,
        bus,
    })
}
