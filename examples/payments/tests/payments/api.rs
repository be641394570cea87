//! The Payment API against real PostgreSQL and the fake provider, over
//! real HTTP: concurrent duplicates charge once; a decline is replayed; bad
//! input charges nothing and leaves no record processing; a timeout after
//! charging is reconciled into the real answer; a provider error before
//! charging frees the key.

use crate::common;

use std::net::SocketAddr;
use std::time::Duration;

use axum::http::{Method, StatusCode};
use idem::{ListFilter, ListRecords, RecordState};
use idem_postgres::sqlx;
use idem_testkit::client::{Answer, send};
use idem_testkit::isolated::PgSchema;
use payments::api::{Api, ApiConfig};
use payments::provider::Provider;

struct World {
    api: Api,
    addr: SocketAddr,
    provider: SocketAddr,
    /// Dropped with the world.
    _schema: PgSchema,
}

impl World {
    async fn new(label: &str) -> Option<Self> {
        let schema = PgSchema::new(&format!("pay_{label}"))?;
        let database = schema.url();
        let provider = common::serve(Provider::default().router()).await;
        let mut config = ApiConfig::new(&database, &format!("http://{provider}"));
        config.provider_timeout = Duration::from_millis(500);
        config.lease = Duration::from_secs(2);
        let api = Api::connect(config).await.expect("api");
        let addr = common::serve(api.router()).await;
        Some(Self {
            api,
            addr,
            provider,
            _schema: schema,
        })
    }

    async fn pay(&self, key: Option<&str>, body: &str) -> Answer {
        let mut headers = vec![
            ("authorization", "Bearer key-tenant-a"),
            ("content-type", "application/json"),
        ];
        if let Some(key) = key {
            headers.push(("idempotency-key", key));
        }
        send(
            self.addr,
            Method::POST,
            "/v1/payments",
            &headers,
            body.to_owned(),
        )
        .await
    }

    async fn provider_stats(&self) -> serde_json::Value {
        let r = send(self.provider, Method::GET, "/v1/stats", &[], "").await;
        serde_json::from_slice(&r.body).expect("stats")
    }

    async fn scalar(&self, sql: &str) -> i64 {
        sqlx::query_scalar(sql)
            .fetch_one(self.api.store().pool())
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"))
    }

    async fn processing(&self) -> Vec<idem::Record> {
        self.api
            .store()
            .list(&ListFilter {
                state: Some(RecordState::Processing),
                older_than: None,
                tenant: None,
                limit: 100,
                after: None,
            })
            .await
            .expect("list")
            .records
    }

    /// Ends the world: the store's connections, then its schema.
    async fn drop(self) {
        self.api.store().close().await;
    }
}

fn body(order: &str, amount: i64, method: &str) -> String {
    format!(
        r#"{{"order_id":"{order}","amount_cents":{amount},"currency":"EUR","payment_method_id":"{method}"}}"#
    )
}

fn json(r: &Answer) -> serde_json::Value {
    serde_json::from_slice(&r.body)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&r.body)))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_duplicates_charge_once_and_retries_get_the_original() {
    let Some(w) = World::new("dup").await else {
        return;
    };
    let w = std::sync::Arc::new(w);
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..20 {
        let w = std::sync::Arc::clone(&w);
        tasks.spawn(async move {
            w.pay(Some("order-1-pay"), &body("o-1", 1250, "pm_slow"))
                .await
        });
    }
    let mut statuses = Vec::new();
    while let Some(r) = tasks.join_next().await {
        statuses.push(r.expect("task").status);
    }
    assert!(
        statuses
            .iter()
            .all(|s| *s == StatusCode::CREATED || *s == StatusCode::CONFLICT),
        "{statuses:?}"
    );
    assert!(statuses.contains(&StatusCode::CREATED));
    let first = w
        .pay(Some("order-1-pay"), &body("o-1", 1250, "pm_slow"))
        .await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(
        first
            .headers
            .get("idempotent-replayed")
            .and_then(|v| v.to_str().ok()),
        Some("true")
    );
    let payment = json(&first);
    assert_eq!(payment["status"], "authorized");
    assert_eq!(payment["amount_cents"], 1250);
    let stats = w.provider_stats().await;
    assert_eq!(stats["operations"], 1, "{stats}");
    assert_eq!(
        stats["requests"], 1,
        "one provider call for 21 requests: {stats}"
    );
    assert_eq!(w.scalar("SELECT count(*) FROM payments").await, 1);
    assert_eq!(
        w.scalar("SELECT count(*) FROM idem_outbox WHERE message_type = 'PaymentAuthorized'")
            .await,
        1,
        "one event, committed with the payment"
    );
    // The key reused for another payment is refused, not charged.
    let other = w
        .pay(Some("order-1-pay"), &body("o-1", 9999, "pm_slow"))
        .await;
    assert_eq!(other.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(w.provider_stats().await["requests"], 1);
    let w = std::sync::Arc::into_inner(w).expect("last");
    w.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decline_is_recorded_once_and_replayed() {
    let Some(w) = World::new("decline").await else {
        return;
    };
    let first = w
        .pay(Some("k-decline"), &body("o-2", 500, "pm_card_declined"))
        .await;
    assert_eq!(first.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(
        json(&first)["type"],
        "https://idem.example/problems/payment_declined"
    );
    let again = w
        .pay(Some("k-decline"), &body("o-2", 500, "pm_card_declined"))
        .await;
    assert_eq!(again.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(again.body, first.body);
    assert_eq!(w.provider_stats().await["requests"], 1);
    assert_eq!(
        w.scalar("SELECT count(*) FROM payments WHERE status = 'declined'")
            .await,
        1
    );
    assert_eq!(
        w.scalar("SELECT count(*) FROM idem_outbox").await,
        0,
        "no event for a decline"
    );
    w.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_charges_nothing_and_leaves_nothing_processing() {
    let Some(w) = World::new("bad").await else {
        return;
    };
    let cases = [
        (body("o-3", 0, "pm_visa"), "amount_cents must be positive"),
        (body("o-3", -5, "pm_visa"), "amount_cents must be positive"),
        (
            r#"{"order_id":"o-3","amount_cents":100,"currency":"eur","payment_method_id":"pm_visa"}"#
                .to_owned(),
            "currency must be a three-letter",
        ),
        (
            r#"{"amount_cents":100,"currency":"EUR","payment_method_id":"pm_visa"}"#.to_owned(),
            "order_id is required",
        ),
        (
            r#"{"order_id":"o-3","amount_cents":"ten","currency":"EUR","payment_method_id":"pm_visa"}"#
                .to_owned(),
            "not a payment request",
        ),
        ("{not json".to_owned(), "not a payment request"),
    ];
    for (i, (payload, why)) in cases.iter().enumerate() {
        let r = w.pay(Some(&format!("bad-{i}")), payload).await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST, "{payload}");
        assert_eq!(
            r.headers.get("content-type").and_then(|v| v.to_str().ok()),
            Some("application/problem+json")
        );
        let detail = json(&r)["detail"].as_str().unwrap_or_default().to_owned();
        assert!(detail.contains(why), "{payload}: {detail}");
    }
    // Without a key, or without an API key.
    let r = w.pay(None, &body("o-3", 100, "pm_visa")).await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    let r = send(
        w.addr,
        Method::POST,
        "/v1/payments",
        &[
            ("idempotency-key", "k-anon"),
            ("content-type", "application/json"),
        ],
        body("o-3", 100, "pm_visa"),
    )
    .await;
    assert_eq!(r.status, StatusCode::UNAUTHORIZED);
    assert_eq!(w.provider_stats().await["requests"], 0, "nothing charged");
    assert!(w.processing().await.is_empty(), "no record left processing");
    assert_eq!(w.scalar("SELECT count(*) FROM payments").await, 0);
    w.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timeout_after_charging_is_reconciled_into_the_real_answer() {
    let Some(w) = World::new("timeout").await else {
        return;
    };
    let payload = body("o-4", 4200, "pm_timeout_after_charge");
    let first = w.pay(Some("k-timeout"), &payload).await;
    assert_eq!(first.status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(first.headers.contains_key("retry-after"));
    assert_eq!(
        json(&first)["type"],
        "https://idem.example/problems/provider_outcome_unknown"
    );
    let stuck = w.processing().await;
    assert_eq!(stuck.len(), 1);
    assert!(stuck[0].is_outcome_unknown(), "{:?}", stuck[0]);
    // A retry while the lease lives is told to wait; nothing is charged.
    let during = w.pay(Some("k-timeout"), &payload).await;
    assert_eq!(during.status, StatusCode::CONFLICT);
    assert_eq!(w.provider_stats().await["operations"], 1);

    // The reconciler leaves a live lease alone, then finishes the record
    // from the provider's answer once it lapsed.
    let early = w.api.reconcile().await.expect("reconcile");
    assert_eq!((early.settled, early.left), (0, 1), "{early:?}");
    tokio::time::sleep(Duration::from_millis(2200)).await;
    let pass = w.api.reconcile().await.expect("reconcile");
    assert_eq!(pass.settled, 1, "{pass:?}");
    assert!(w.processing().await.is_empty());

    let after = w.pay(Some("k-timeout"), &payload).await;
    assert_eq!(after.status, StatusCode::CREATED);
    assert_eq!(json(&after)["status"], "authorized");
    let stats = w.provider_stats().await;
    assert_eq!(stats["succeeded"], 1, "charged once: {stats}");
    assert_eq!(
        w.scalar("SELECT count(*) FROM idem_outbox WHERE message_type = 'PaymentAuthorized'")
            .await,
        1
    );
    w.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_provider_error_before_charging_frees_the_key() {
    let Some(w) = World::new("error").await else {
        return;
    };
    let r = w
        .pay(Some("k-error"), &body("o-5", 100, "pm_error_before_charge"))
        .await;
    assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(r.headers.contains_key("retry-after"));
    assert!(w.processing().await.is_empty(), "the key is free again");
    assert_eq!(w.provider_stats().await["operations"], 0, "nothing charged");
    // The key is not stuck: the same request runs again (and fails the
    // same way, still charging nothing).
    let r = w
        .pay(Some("k-error"), &body("o-5", 100, "pm_error_before_charge"))
        .await;
    assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE);
    w.drop().await;
}
