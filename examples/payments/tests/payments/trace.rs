//! One payment's events carry the W3C trace context of the request that
//! caused them, end to end, on NATS JetStream and on Kafka: the
//! `traceparent` a client sends with its payment is on the
//! `PaymentAuthorized` outbox row, on that event as it sits on the broker,
//! on the `OrderPaid` row the Order service enqueues when it handles it,
//! and on that event on the broker: one trace id throughout. Also when the
//! payment is settled by the reconciler after the provider timed out. A
//! malformed `traceparent` is ignored, never refused: the payment goes
//! through and its events carry no trace context.

use crate::common;

use std::net::SocketAddr;

use axum::http::{Method, StatusCode};
use idem_messaging::trace::TraceContext;
use idem_postgres::sqlx;
use idem_testkit::client::send;

use common::{On, create_order, scalar, wait_for};

const AUTH: (&str, &str) = ("authorization", "Bearer shop-1");
const JSON: (&str, &str) = ("content-type", "application/json");

/// The trace of the payment paid at once.
const TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
/// The trace of the payment whose provider call times out.
const TRACE_RECONCILED: &str = "0af7651916cd43dd8448eb211c80319c";

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_payments_events_carry_its_requests_trace_id_on_nats() {
    trace_follows_the_payment(On::Nats).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_payments_events_carry_its_requests_trace_id_on_kafka() {
    trace_follows_the_payment(On::Kafka).await;
}

/// Pays `order` with `method`, sending `extra` headers; the status.
async fn pay(
    api: SocketAddr,
    order: &str,
    amount: i64,
    method: &str,
    extra: &[(&str, &str)],
) -> StatusCode {
    let key = format!("pay-{order}");
    let mut headers = vec![AUTH, JSON, ("idempotency-key", key.as_str())];
    headers.extend_from_slice(extra);
    let body = format!(
        r#"{{"order_id":"{order}","amount_cents":{amount},"currency":"EUR","payment_method_id":"{method}"}}"#
    );
    send(api, Method::POST, "/v1/payments", &headers, body)
        .await
        .status
}

/// The trace id of a `traceparent`, if it is a valid one.
fn trace_id(traceparent: Option<&str>) -> Option<String> {
    let traceparent = traceparent?;
    TraceContext::from_headers([("traceparent", traceparent)]).map(|cx| cx.trace_id().to_owned())
}

/// An event as it sits on the broker.
#[derive(Debug)]
struct OnBroker {
    aggregate_id: String,
    message_type: String,
    traceparent: Option<String>,
    tracestate: Option<String>,
}

/// Every event of the world's bus, read back with a plain client.
async fn events_on_broker(world: &common::World) -> Vec<OnBroker> {
    let bus = &world.bus;
    let mut events = Vec::new();
    match bus.kind().expect("broker") {
        payments::Broker::Nats => {
            let client = async_nats::connect(&bus.broker).await.expect("nats");
            let js = async_nats::jetstream::new(client);
            let mut stream = js.get_stream(&bus.stream).await.expect("stream");
            let last = stream
                .info()
                .await
                .expect("stream info")
                .state
                .last_sequence;
            for seq in 1..=last {
                let raw = stream.get_raw_message(seq).await.expect("message");
                let header = |name: &str| raw.headers.get(name).map(|v| v.to_string());
                events.push(OnBroker {
                    aggregate_id: header("Idem-Aggregate-Id").expect("aggregate id"),
                    message_type: raw
                        .subject
                        .rsplit_once('.')
                        .map(|(_, kind)| kind.to_owned())
                        .expect("<prefix>.<aggregate_type>.<message_type>"),
                    traceparent: header("traceparent"),
                    tracestate: header("tracestate"),
                });
            }
        }
        payments::Broker::Kafka => {
            for aggregate_type in [
                payments::api::AGGREGATE_TYPE,
                payments::orders::AGGREGATE_TYPE,
            ] {
                let topic = bus.topic(aggregate_type);
                for record in idem_testkit::kafka::read_all(&bus.broker, &topic).await {
                    events.push(OnBroker {
                        aggregate_id: record.key.clone(),
                        message_type: record.header("Idem-Message-Type").expect("message type"),
                        traceparent: record.header("traceparent"),
                        tracestate: record.header("tracestate"),
                    });
                }
            }
        }
    }
    events
}

async fn trace_follows_the_payment(on: On) {
    let Some(world) = common::world_on(&format!("trace_{}", on.name()), on).await else {
        return;
    };
    let running = world.run().await;
    let (api_addr, orders_addr) = (running.api_addr, running.orders_addr);
    let (pay_pool, ord_pool) = (
        running.api.store().pool().clone(),
        running.orders.store().pool().clone(),
    );

    let traced = create_order(orders_addr, 500).await;
    let malformed = create_order(orders_addr, 501).await;
    let reconciled = create_order(orders_addr, 502).await;
    let traceparent = format!("00-{TRACE}-00f067aa0ba902b7-01");
    assert_eq!(
        pay(
            api_addr,
            &traced,
            500,
            "pm_visa",
            &[("traceparent", &traceparent), ("tracestate", "shop=1")],
        )
        .await,
        StatusCode::CREATED
    );
    // Malformed (upper-case hex): ignored, not refused.
    let bad = format!("00-{}-00f067aa0ba902b7-01", TRACE.to_uppercase());
    assert_eq!(
        pay(
            api_addr,
            &malformed,
            501,
            "pm_visa",
            &[("traceparent", &bad)]
        )
        .await,
        StatusCode::CREATED
    );
    // The provider charges but does not answer in time: the reconciler
    // settles it later, with the request's trace kept with the attempt.
    let traceparent_reconciled = format!("00-{TRACE_RECONCILED}-b7ad6b7169203331-01");
    assert_eq!(
        pay(
            api_addr,
            &reconciled,
            502,
            "pm_timeout_after_charge",
            &[("traceparent", &traceparent_reconciled)],
        )
        .await,
        StatusCode::SERVICE_UNAVAILABLE
    );
    wait_for(
        "the reconciler to settle the timed-out payment",
        async || running.api.reconcile().await.expect("reconcile").settled == 1,
    )
    .await;
    wait_for("every order paid and every event published", async || {
        scalar(
            &ord_pool,
            "SELECT count(*) FROM orders WHERE state = 'paid'",
        )
        .await
            == 3
            && scalar(
                &ord_pool,
                "SELECT count(*) FROM idem_outbox WHERE state = 'published'",
            )
            .await
                == 3
            && scalar(
                &pay_pool,
                "SELECT count(*) FROM idem_outbox WHERE state = 'published'",
            )
            .await
                == 3
    })
    .await;

    // What each order's events must carry: its request's trace id, or
    // nothing.
    let expected = [
        (&traced, Some(TRACE)),
        (&malformed, None),
        (&reconciled, Some(TRACE_RECONCILED)),
    ];
    let on_broker = events_on_broker(&world).await;
    for (order, trace) in expected {
        let trace = trace.map(str::to_owned);
        let payment: String = sqlx::query_scalar("SELECT payment_id FROM orders WHERE id = $1")
            .bind(order)
            .fetch_one(&ord_pool)
            .await
            .expect("the order's payment");
        for (pool, aggregate_id, message_type) in [
            (&pay_pool, &payment, "PaymentAuthorized"),
            (&ord_pool, order, "OrderPaid"),
        ] {
            // The outbox row.
            let (traceparent, tracestate): (Option<String>, Option<String>) = sqlx::query_as(
                "SELECT headers->>'traceparent', headers->>'tracestate' FROM idem_outbox \
                 WHERE aggregate_id = $1 AND message_type = $2",
            )
            .bind(aggregate_id)
            .bind(message_type)
            .fetch_one(pool)
            .await
            .expect("the outbox row");
            assert_eq!(
                trace_id(traceparent.as_deref()),
                trace,
                "{message_type} row of {aggregate_id}"
            );
            if trace.is_none() {
                assert_eq!(traceparent, None, "{message_type} row of {aggregate_id}");
            }
            if order == &traced {
                assert_eq!(tracestate.as_deref(), Some("shop=1"), "tracestate kept");
            }
            // The event on the broker (exactly once there: nothing here
            // re-publishes).
            let events: Vec<&OnBroker> = on_broker
                .iter()
                .filter(|e| &e.aggregate_id == aggregate_id && e.message_type == message_type)
                .collect();
            assert_eq!(
                events.len(),
                1,
                "{message_type} of {aggregate_id}: {events:?}"
            );
            assert_eq!(
                trace_id(events[0].traceparent.as_deref()),
                trace,
                "{message_type} of {aggregate_id} on the broker: {:?}",
                events[0]
            );
            if trace.is_none() {
                assert_eq!(events[0].traceparent, None, "{:?}", events[0]);
            }
            if order == &traced {
                assert_eq!(events[0].tracestate.as_deref(), Some("shop=1"));
            }
        }
    }

    let stats = running.stop().await;
    assert_eq!((stats.applied, stats.parked), (3, 0), "{stats:?}");
    world.clean_up().await;
}
