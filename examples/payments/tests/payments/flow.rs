//! The whole pattern end to end, in-process, against real PostgreSQL and
//! NATS JetStream: orders created, paid through the Payment API by a client
//! firing duplicates (one payment's provider call times out after charging
//! and is reconciled), `PaymentAuthorized` relayed from the Payment API's
//! outbox to JetStream and applied by the Order service's runner once per
//! order, `OrderPaid` in the Order service's outbox. Then the same payment
//! re-announced under a new message id changes nothing, and a conflicting
//! payment or one for an unknown order is parked. On Kafka, where one topic
//! holds every payment event, the Order service skips the types it does
//! not handle and parks a record without one.

use crate::common;

use axum::http::{Method, StatusCode};
use bytes::Bytes;
use idem_postgres::sqlx;
use idem_testkit::client::send;
use payments::api::PaymentAuthorized;

use common::{On, create_order, scalar, wait_for};

const AUTH: (&str, &str) = ("authorization", "Bearer shop-1");
const JSON: (&str, &str) = ("content-type", "application/json");

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn orders_are_paid_once_each_end_to_end() {
    let Some(world) = common::world("e2e").await else {
        return;
    };
    let bus = &world.bus;
    let running = world.run().await;
    let (provider, orders_addr, api_addr) =
        (running.provider, running.orders_addr, running.api_addr);
    let (api, orders) = (&running.api, &running.orders);

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
    let client = async_nats::connect(&bus.broker).await.expect("nats");
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

    let stats = running.stop().await;
    assert_eq!(stats.parked, 2, "{stats:?}");
    world.clean_up().await;
}

/// On Kafka one topic holds every payment event, told apart by its
/// `Idem-Message-Type` header: the Order service applies
/// `PaymentAuthorized`, acknowledges any other type without a change (its
/// inbox row and the payment's ordering guard move on, so the payment's
/// next event is not held back as a gap), and parks a record whose type
/// it cannot tell.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn kafka_other_payment_events_are_skipped_and_untyped_ones_parked() {
    let Some(world) = common::world_on("skip", On::Kafka).await else {
        return;
    };
    let running = world.run().await;
    let ord_pool = running.orders.store().pool().clone();
    let order = create_order(running.orders_addr, 700).await;
    let topic = world.bus.topic(payments::api::AGGREGATE_TYPE);
    let producer = idem_testkit::kafka::producer(&world.bus.broker);
    let event = |payment: &str| {
        serde_json::to_string(&PaymentAuthorized {
            payment_id: payment.to_owned(),
            order_id: order.clone(),
            amount_cents: 700,
            currency: "EUR".to_owned(),
        })
        .expect("json")
    };
    let relayed = |id: &'static str, kind: &'static str, sequence: &'static str| {
        [
            ("Idem-Message-Id", id),
            ("Idem-Message-Type", kind),
            ("Idem-Aggregate-Type", "payment"),
            ("Idem-Aggregate-Id", "pay_k1"),
            ("Idem-Sequence", sequence),
        ]
    };
    let order_state = async || -> (String, Option<String>) {
        sqlx::query_as("SELECT state, payment_id FROM orders WHERE id = $1")
            .bind(&order)
            .fetch_one(&ord_pool)
            .await
            .expect("order")
    };

    // The payment's first event is of another type, though shaped like a
    // PaymentAuthorized: acknowledged, nothing applied.
    idem_testkit::kafka::send(
        &producer,
        &topic,
        "pay_k1",
        &relayed("k1-attempted", "PaymentAttempted", "1"),
        &event("pay_k1"),
    )
    .await;
    wait_for("the other event's inbox row", async || {
        scalar(&ord_pool, "SELECT count(*) FROM idem_inbox").await == 1
    })
    .await;
    assert_eq!(order_state().await, ("payment_pending".to_owned(), None));
    assert_eq!(
        scalar(&ord_pool, "SELECT count(*) FROM idem_outbox").await,
        0,
        "no OrderPaid for another event type"
    );

    // Its second, PaymentAuthorized: applied, not held back as a gap.
    idem_testkit::kafka::send(
        &producer,
        &topic,
        "pay_k1",
        &relayed("k1-authorized", "PaymentAuthorized", "2"),
        &event("pay_k1"),
    )
    .await;
    wait_for("the order paid", async || order_state().await.0 == "paid").await;
    assert_eq!(
        order_state().await,
        ("paid".to_owned(), Some("pay_k1".to_owned()))
    );

    // A record that says no type: parked, with the reason.
    idem_testkit::kafka::send(
        &producer,
        &topic,
        "pay_k2",
        &[("Idem-Message-Id", "k2-untyped")],
        &event("pay_k2"),
    )
    .await;
    let parked_topic = world.bus.parked_topic();
    let mut parked = Vec::new();
    wait_for("the untyped record parked", async || {
        parked = idem_testkit::kafka::read_all(&world.bus.broker, &parked_topic).await;
        !parked.is_empty()
    })
    .await;
    assert_eq!(parked.len(), 1, "{parked:?}");
    assert_eq!(
        parked[0].header("Idem-Message-Id").as_deref(),
        Some("k2-untyped")
    );
    let reason = parked[0].header("Idem-Parked-Reason").unwrap_or_default();
    assert!(reason.contains("has no type"), "{reason}");

    let stats = running.stop().await;
    assert_eq!(
        (stats.applied, stats.parked, stats.retried),
        (2, 1, 0),
        "{stats:?}"
    );
    assert_eq!(
        scalar(
            &ord_pool,
            "SELECT count(*) FROM idem_outbox WHERE message_type = 'OrderPaid'"
        )
        .await,
        1
    );
    world.clean_up().await;
}
