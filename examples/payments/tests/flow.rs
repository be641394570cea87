//! The whole pattern end to end, in-process, against real PostgreSQL and
//! NATS JetStream: orders created, paid through the Payment API by a client
//! firing duplicates (one payment's provider call times out after charging
//! and is reconciled), `PaymentAuthorized` relayed from the Payment API's
//! outbox to JetStream and applied by the Order service's runner once per
//! order, `OrderPaid` in the Order service's outbox. Then the same payment
//! re-announced under a new message id changes nothing, and a conflicting
//! payment or one for an unknown order is parked.

mod common;

use std::sync::Arc;
use std::time::Duration;

use axum::http::{Method, StatusCode};
use bytes::Bytes;
use idem_postgres::sqlx;
use idem_testkit::client::send;
use payments::api::{Api, ApiConfig, PaymentAuthorized};
use payments::orders::Orders;
use payments::provider::Provider;
use tokio::sync::Notify;

use common::{create_order, scalar, serve};

const AUTH: (&str, &str) = ("authorization", "Bearer shop-1");
const JSON: (&str, &str) = ("content-type", "application/json");

async fn wait_for(what: &str, mut done: impl AsyncFnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while !done().await {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn orders_are_paid_once_each_end_to_end() {
    let Some(common::World {
        nats,
        pay_schema,
        ord_schema,
        pay_db,
        ord_db,
        bus,
        ..
    }) = common::world("e2e").await
    else {
        return;
    };
    let stop = Arc::new(Notify::new());
    let stopped = |stop: &Arc<Notify>| {
        let stop = Arc::clone(stop);
        async move { stop.notified().await }
    };

    let provider = serve(Provider::default().router()).await;
    let orders = Orders::connect(&ord_db).await.expect("orders");
    let orders_addr = serve(orders.router()).await;
    let mut config = ApiConfig::new(&pay_db, &format!("http://{provider}"));
    config.orders = Some(format!("http://{orders_addr}"));
    config.provider_timeout = Duration::from_millis(500);
    config.lease = Duration::from_secs(2);
    let api = Api::connect(config).await.expect("api");
    let api_addr = serve(api.router()).await;
    let relays = [pay_db.clone(), ord_db.clone()].map(|db| {
        let (bus, stop) = (bus.clone(), stopped(&stop));
        tokio::spawn(async move { bus.run_relay(&db, stop).await.expect("relay") })
    });
    let consumer = {
        let (bus, orders, stop) = (bus.clone(), orders.clone(), stopped(&stop));
        tokio::spawn(async move {
            bus.run_order_consumer(&orders, stop)
                .await
                .expect("consumer")
        })
    };

    // Ten orders; bad input refused.
    let bad = send(
        orders_addr,
        Method::POST,
        "/v1/orders",
        &[AUTH, JSON],
        r#"{"amount_cents":0,"currency":"EUR"}"#,
    )
    .await;
    assert_eq!(bad.status, StatusCode::BAD_REQUEST);
    let missing = send(orders_addr, Method::GET, "/v1/orders/ord_nope", &[AUTH], "").await;
    assert_eq!(missing.status, StatusCode::NOT_FOUND);
    let mut ids = Vec::new();
    for i in 0..10 {
        ids.push(create_order(orders_addr, 1000 + i).await);
    }

    // Refused before charging: an unknown order, the wrong amount.
    let refused = |order: &str, amount: i64, key: &'static str| {
        let body = format!(
            r#"{{"order_id":"{order}","amount_cents":{amount},"currency":"EUR","payment_method_id":"pm_visa"}}"#
        );
        async move {
            let r = send(
                api_addr,
                Method::POST,
                "/v1/payments",
                &[AUTH, JSON, ("idempotency-key", key)],
                Bytes::from(body),
            )
            .await;
            let v: serde_json::Value = serde_json::from_slice(&r.body).expect("problem");
            (r.status, v["type"].as_str().unwrap_or_default().to_owned())
        }
    };
    assert_eq!(
        refused("ord_nope", 100, "k-unknown").await,
        (
            StatusCode::NOT_FOUND,
            "https://idem.example/problems/unknown_order".to_owned()
        )
    );
    assert_eq!(
        refused(&ids[0], 1, "k-mismatch").await,
        (
            StatusCode::UNPROCESSABLE_ENTITY,
            "https://idem.example/problems/amount_mismatch".to_owned()
        )
    );
    let charged: serde_json::Value =
        serde_json::from_slice(&send(provider, Method::GET, "/v1/stats", &[], "").await.body)
            .expect("stats");
    assert_eq!(
        charged["requests"], 0,
        "nothing charged for refused payments"
    );

    // Pay each, three concurrent duplicates per order; order 9's provider
    // call times out after charging.
    let pay = |order: String, i: usize| async move {
        let method = if i == 9 {
            "pm_timeout_after_charge"
        } else {
            "pm_visa"
        };
        let key = format!("pay-{order}");
        let body = format!(
            r#"{{"order_id":"{order}","amount_cents":{},"currency":"EUR","payment_method_id":"{method}"}}"#,
            1000 + i
        );
        send(
            api_addr,
            Method::POST,
            "/v1/payments",
            &[AUTH, JSON, ("idempotency-key", &key)],
            Bytes::from(body),
        )
        .await
        .status
    };
    let mut calls = tokio::task::JoinSet::new();
    for (i, id) in ids.iter().enumerate() {
        for _ in 0..3 {
            calls.spawn(pay(id.clone(), i));
        }
    }
    while let Some(status) = calls.join_next().await {
        let status = status.expect("call");
        assert!(
            [
                StatusCode::CREATED,
                StatusCode::CONFLICT,
                StatusCode::SERVICE_UNAVAILABLE
            ]
            .contains(&status),
            "{status}"
        );
    }
    // The unknown outcome is reconciled once its lease lapses; the client's
    // retry then gets the real answer.
    wait_for("the reconciler to settle order 9's payment", async || {
        api.reconcile().await.expect("reconcile").settled == 1
    })
    .await;
    assert_eq!(pay(ids[9].clone(), 9).await, StatusCode::CREATED);
    for (i, id) in ids.iter().enumerate() {
        assert_eq!(
            pay(id.clone(), i).await,
            StatusCode::CREATED,
            "retry of {id}"
        );
    }

    let (pay_pool, ord_pool) = (api.store().pool().clone(), orders.store().pool().clone());
    wait_for("every order paid", async || {
        scalar(
            &ord_pool,
            "SELECT count(*) FROM orders WHERE state = 'paid'",
        )
        .await
            == 10
    })
    .await;
    let stats: serde_json::Value =
        serde_json::from_slice(&send(provider, Method::GET, "/v1/stats", &[], "").await.body)
            .expect("stats");
    assert_eq!(stats["succeeded"], 10, "one charge per order: {stats}");
    assert_eq!(
        scalar(
            &pay_pool,
            "SELECT count(*) FROM payments WHERE status = 'authorized'"
        )
        .await,
        10
    );
    assert_eq!(
        scalar(
            &ord_pool,
            "SELECT count(*) FROM idem_outbox WHERE message_type = 'OrderPaid'"
        )
        .await,
        10,
        "one OrderPaid per order"
    );
    let shown = send(
        orders_addr,
        Method::GET,
        &format!("/v1/orders/{}", ids[0]),
        &[AUTH],
        "",
    )
    .await;
    let shown: serde_json::Value = serde_json::from_slice(&shown.body).expect("order");
    assert_eq!(shown["state"], "paid");

    // The same payment announced again under a new message id: a no-op.
    // A second payment for a paid order, and one for an unknown order:
    // parked.
    let client = async_nats::connect(&nats).await.expect("nats");
    let js = async_nats::jetstream::new(client);
    let payment_0: String = sqlx::query_scalar("SELECT payment_id FROM orders WHERE id = $1")
        .bind(&ids[0])
        .fetch_one(&ord_pool)
        .await
        .expect("payment of order 0");
    let publish = |id: &'static str, event: PaymentAuthorized| {
        let (js, subject) = (
            js.clone(),
            format!("{}.payment.PaymentAuthorized", bus.prefix),
        );
        async move {
            let mut headers = async_nats::HeaderMap::new();
            headers.insert(async_nats::header::NATS_MESSAGE_ID, id);
            js.publish_with_headers(
                subject,
                headers,
                serde_json::to_vec(&event).expect("json").into(),
            )
            .await
            .expect("publish")
            .await
            .expect("ack");
        }
    };
    publish(
        "again-0",
        PaymentAuthorized {
            payment_id: payment_0.clone(),
            order_id: ids[0].clone(),
            amount_cents: 1000,
            currency: "EUR".into(),
        },
    )
    .await;
    publish(
        "conflict-1",
        PaymentAuthorized {
            payment_id: "pay_someone_else".into(),
            order_id: ids[1].clone(),
            amount_cents: 1001,
            currency: "EUR".into(),
        },
    )
    .await;
    publish(
        "unknown-order",
        PaymentAuthorized {
            payment_id: "pay_orphan".into(),
            order_id: "ord_nope".into(),
            amount_cents: 5,
            currency: "EUR".into(),
        },
    )
    .await;
    wait_for("the re-announced and refused events", async || {
        scalar(&ord_pool, "SELECT count(*) FROM idem_inbox").await == 11
    })
    .await;
    let mut parked = js
        .get_stream(bus.parked_stream())
        .await
        .expect("parked stream");
    wait_for("two parked events", async || {
        parked.info().await.map(|i| i.state.messages).unwrap_or(0) == 2
    })
    .await;
    let mut reasons = Vec::new();
    for seq in 1..=2 {
        let raw = parked.get_raw_message(seq).await.expect("parked");
        reasons.push(
            raw.headers
                .get("Idem-Parked-Reason")
                .map(|v| v.to_string())
                .unwrap_or_default(),
        );
    }
    reasons.sort();
    assert!(
        reasons.iter().any(|r| r.contains("already paid")),
        "{reasons:?}"
    );
    assert!(
        reasons.iter().any(|r| r.contains("does not exist")),
        "{reasons:?}"
    );
    assert_eq!(
        scalar(
            &ord_pool,
            "SELECT count(*) FROM idem_outbox WHERE message_type = 'OrderPaid'"
        )
        .await,
        10,
        "still one OrderPaid per order"
    );
    wait_for("both outboxes delivered", async || {
        scalar(
            &pay_pool,
            "SELECT count(*) FROM idem_outbox WHERE state <> 'published'",
        )
        .await
            == 0
            && scalar(
                &ord_pool,
                "SELECT count(*) FROM idem_outbox WHERE state <> 'published'",
            )
            .await
                == 0
    })
    .await;

    stop.notify_waiters();
    for relay in relays {
        let _ = relay.await;
    }
    let stats = consumer.await.expect("consumer");
    assert_eq!(stats.parked, 2, "{stats:?}");
    let _ = js.delete_stream(&bus.stream).await;
    let _ = js.delete_stream(bus.parked_stream()).await;
    for (pool, schema) in [(&pay_pool, &pay_schema), (&ord_pool, &ord_schema)] {
        let _ = sqlx::query(&format!("DROP SCHEMA \"{schema}\" CASCADE"))
            .execute(pool)
            .await;
    }
}
