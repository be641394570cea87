//! `idem check` against the reference Payment API (its own idempotency,
//! no gateway in front): every probe passes.

use crate::common;

use std::time::Duration;

use axum::http::{HeaderMap, HeaderValue, Method};
use bytes::Bytes;
use idem_check::{PROBES, Probe, Target, Verdict};
use payments::api::{Api, ApiConfig};
use payments::provider::Provider;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_idem_check_probe_passes_against_the_payment_api() {
    let Some(schema) = idem_testkit::isolated::PgSchema::new("pay_check") else {
        return;
    };
    let provider = common::serve(Provider::default().router()).await;
    let api = Api::connect(ApiConfig::new(&schema.url(), &format!("http://{provider}")))
        .await
        .expect("api");
    let addr = common::serve(api.router()).await;

    let mut headers = HeaderMap::new();
    headers.insert("content-type", HeaderValue::from_static("application/json"));
    headers.insert(
        "authorization",
        HeaderValue::from_static("Bearer checker-one"),
    );
    let target = Target {
        url: format!("http://{addr}/v1/payments").parse().expect("url"),
        method: Method::POST,
        body: Bytes::from_static(
            br#"{"order_id":"ord_check","amount_cents":1250,"currency":"EUR","payment_method_id":"pm_visa"}"#,
        ),
        headers,
        vary_field: Some("amount_cents".to_owned()),
        second_auth: Some(HeaderValue::from_static("Bearer checker-two")),
        concurrency: 20,
        key_required: true,
        id_field: "id".to_owned(),
        timeout: Duration::from_secs(10),
        max_requests: 100,
        extra_roots: Vec::new(),
    };
    let probes = PROBES.to_vec();
    idem_check::validate(&target, &probes, true).expect("valid arguments");
    let outcomes = idem_check::run(target, &probes).await;
    assert_eq!(outcomes.len(), probes.len());
    for o in &outcomes {
        assert_eq!(o.verdict, Verdict::Pass, "{:?}: {}", o.probe, o.note);
    }
    assert!(outcomes.iter().any(|o| o.probe == Probe::Concurrent));
    api.store().close().await;
}
