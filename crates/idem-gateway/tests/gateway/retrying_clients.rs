//! Never twice by default, shown with the retrying clients users put in
//! front of idem: Python `requests` with urllib3's `Retry`, and `reqwest`
//! with `reqwest-retry`. The upstream is a payment service that does not
//! deduplicate ([`Ledger`]): it charges on every request, drops its answer
//! after charging on every 10th, and answers late on every 5th. Through the
//! gateway with its default policy:
//!
//! * with the route's lookup (`[route.reconcile]`), no payment is charged
//!   twice and every lost answer is reconciled into a replay;
//! * without one, no payment is charged twice either: the lost ones are
//!   held, listed for an operator (`idem records list --state held`);
//! * a gateway SIGKILLed mid-request charges once;
//! * a client that rebuilds each attempt (tenacity around its own
//!   function), stamping `sent_at` into the body and keying on
//!   `X-Request-Id`, is charged once and told its answer on a route with
//!   `key_header` and `fingerprint_exclude`; without the exclusion its
//!   honest retries are refused as another request.

use std::path::Path;
use std::time::Duration;

use idem_testkit::client::metric;
use idem_testkit::gateway::{GatewayProcess, listed_keys, sqlite_store};
use idem_testkit::ledger::{Ledger, Schedule};
use idem_testkit::wait::eventually;

const IDEM: &str = env!("CARGO_BIN_EXE_idem");
const PAY_SCRIPT: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/clients/pay_with_requests.py"
);

/// The payments route of docs/HTTP.md, and its lookup when `reconcile`.
fn config(reconcile: bool, extra: &str) -> String {
    let mut c = format!(
        "{extra}\n[[route]]\nmethod = \"POST\"\npath = \"/v1/payments\"\nrequire_key = true\n"
    );
    if reconcile {
        c.push_str("\n[route.reconcile]\npath = \"/v1/payments/by-key/{key}\"\nstatus = 201\n");
    }
    c
}

const FAULTS: Schedule = Schedule {
    lost_every: 10,
    slow_every: 5,
    slow_for: Duration::from_millis(1500),
};

/// `idem serve` in front of `ledger` on the embedded store in `dir`, with
/// [`config`].
async fn gateway(dir: &Path, ledger: &Ledger, reconcile: bool, extra: &str) -> GatewayProcess {
    let store = sqlite_store(dir);
    let config = config(reconcile, extra);
    GatewayProcess::builder(IDEM, dir)
        .config(&config)
        .upstream(&ledger.url())
        .store(&store)
        .start()
        .await
}

/// `idem records list --state held` on `store`: the held keys.
fn held_keys(store: &str) -> Vec<String> {
    listed_keys(IDEM, store, "held")
}

/// Runs the Python client: `payments` payments, urllib3 retrying.
async fn pay_with_requests(python: &Path, url: &str, payments: u32) -> serde_json::Value {
    run_client(python, PAY_SCRIPT, url, payments, &["--total", "10"]).await
}

/// Runs one of the Python clients in `tests/clients`, with a read time-out
/// of 1 s: its report.
async fn run_client(
    python: &Path,
    script: &str,
    url: &str,
    payments: u32,
    args: &[&str],
) -> serde_json::Value {
    let out = tokio::process::Command::new(python)
        .args([script, url, &payments.to_string(), "--read-timeout", "1"])
        .args(args)
        .output()
        .await
        .expect("run the Python client");
    assert!(
        out.status.success(),
        "the client failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("the client's report")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn python_requests_through_the_default_gateway_never_charge_twice() {
    let Some(python) = idem_testkit::services::python_with(&["requests", "urllib3"]) else {
        return;
    };
    for reconcile in [true, false] {
        let dir = tempfile::tempdir().expect("temp dir");
        let store = sqlite_store(dir.path());
        let ledger = Ledger::start(FAULTS).await;
        let gw = gateway(dir.path(), &ledger, reconcile, "").await;
        let report = pay_with_requests(&python, &format!("http://{}", gw.addr), 200).await;
        let tally = ledger.tally();
        eprintln!("reconcile = {reconcile}: client {report:#}\nledger {tally:?}");
        assert_eq!(tally.paid, 200, "every payment charged");
        assert_eq!(tally.duplicates, 0, "no payment charged twice");
        assert!(
            tally.lost >= 15 && tally.slow >= 30,
            "the faults happened: {tally:?}"
        );
        let reconciled = metric(gw.admin, "idem_reconciled_total", "result=\"completed\"").await;
        let reruns = metric(gw.admin, "idem_reruns_total", "reason=\"lease_lapsed\"").await;
        assert_eq!(reruns, 0.0, "nothing ran twice");
        let status = &report["status"];
        if reconcile {
            assert_eq!(status["201"], 200, "every client got its answer: {status}");
            assert_eq!(
                reconciled, tally.lost as f64,
                "every lost answer reconciled"
            );
            assert!(report["replayed"].as_u64() >= Some(tally.lost));
            assert!(held_keys(&store).is_empty());
        } else {
            // The lost ones are held for an operator: their clients end on
            // 409 (urllib3 gives up), and the records are listed.
            assert_eq!(reconciled, 0.0);
            assert_eq!(status["409"], tally.lost, "{status}");
            assert_eq!(status["201"], 200 - tally.lost, "{status}");
            let mut held = held_keys(&store);
            let mut lost: Vec<String> = report["keys"]
                .as_object()
                .expect("keys")
                .iter()
                .filter(|(_, code)| **code == 409)
                .map(|(k, _)| k.clone())
                .collect();
            held.sort();
            lost.sort();
            assert_eq!(held, lost, "the held records are exactly the lost answers");
        }
    }
}

const TENACITY_SCRIPT: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/clients/pay_with_tenacity.py"
);

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_client_that_restamps_each_retry_is_charged_once_where_the_route_leaves_the_stamp_out() {
    let Some(python) = idem_testkit::services::python_with(&["requests", "tenacity"]) else {
        return;
    };
    const PAYMENTS: u32 = 60;
    for exclude in [true, false] {
        let dir = tempfile::tempdir().expect("temp dir");
        let ledger = Ledger::start(FAULTS).await;
        let mut route = String::from("key_header = \"X-Request-Id\"\n");
        if exclude {
            route.push_str("fingerprint_exclude = [\"/sent_at\"]\n");
        }
        let config = format!(
            "[[route]]\nmethod = \"POST\"\npath = \"/v1/payments\"\nrequire_key = true\n{route}\n[route.reconcile]\npath = \"/v1/payments/by-key/{{key}}\"\nstatus = 201\n"
        );
        let gw = GatewayProcess::builder(IDEM, dir.path())
            .config(&config)
            .upstream(&ledger.url())
            .store(&sqlite_store(dir.path()))
            .start()
            .await;
        let url = format!("http://{}", gw.addr);
        let report = run_client(
            &python,
            TENACITY_SCRIPT,
            &url,
            PAYMENTS,
            &["--attempts", "10"],
        )
        .await;
        let tally = ledger.tally();
        eprintln!("fingerprint_exclude = {exclude}: client {report:#}\nledger {tally:?}");
        let status = &report["status"];
        assert_eq!(
            tally.paid,
            u64::from(PAYMENTS),
            "every payment charged, keyed by X-Request-Id"
        );
        assert_eq!(tally.duplicates, 0, "no payment charged twice");
        assert!(
            report["attempts"].as_u64() > Some(u64::from(PAYMENTS)),
            "the faults made the client retry"
        );
        if exclude {
            assert_eq!(
                status["201"],
                u64::from(PAYMENTS),
                "every client got its answer: {status}"
            );
        } else {
            // The stamp is part of the request: a retry after the first
            // attempt completed is another request under the same key.
            assert!(
                status["422"].as_u64() > Some(0),
                "honest retries refused: {status}"
            );
        }
    }
}

/// reqwest-retry's default strategy treats 409 as final; a client of an
/// idempotent API retries it (and reads Retry-After), as here.
struct RetryConflicts;

impl reqwest_retry::RetryableStrategy for RetryConflicts {
    fn handle(
        &self,
        res: &Result<reqwest::Response, reqwest_middleware::Error>,
    ) -> Option<reqwest_retry::Retryable> {
        match res {
            Ok(r) if r.status() == reqwest::StatusCode::CONFLICT => {
                Some(reqwest_retry::Retryable::Transient)
            }
            Ok(r) => reqwest_retry::default_on_request_success(r),
            Err(err) => reqwest_retry::default_on_request_failure(err),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn reqwest_retry_through_the_default_gateway_never_charges_twice() {
    use reqwest_retry::RetryTransientMiddleware;
    use reqwest_retry::policies::ExponentialBackoff;

    let dir = tempfile::tempdir().expect("temp dir");
    let ledger = Ledger::start(FAULTS).await;
    let gw = gateway(dir.path(), &ledger, true, "").await;
    let policy = ExponentialBackoff::builder()
        .retry_bounds(Duration::from_millis(200), Duration::from_secs(2))
        .build_with_max_retries(12);
    let client = reqwest_middleware::ClientBuilder::new(
        reqwest::Client::builder()
            .timeout(Duration::from_secs(1))
            .build()
            .expect("client"),
    )
    .with(RetryTransientMiddleware::new_with_policy_and_strategy(
        policy,
        RetryConflicts,
    ))
    .build();
    let url = format!("http://{}/v1/payments", gw.addr);
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..100 {
        let (client, url) = (client.clone(), url.clone());
        tasks.spawn(async move {
            let key = format!("reqwest-{i}");
            let resp = client
                .post(&url)
                .header("idempotency-key", &key)
                .header("authorization", "Bearer sk_test_reqwest")
                .header("content-type", "application/json")
                .body(format!(r#"{{"amount_cents":{i}}}"#))
                .send()
                .await;
            (key, resp.map(|r| r.status()))
        });
    }
    let mut created = 0;
    while let Some(done) = tasks.join_next().await {
        let (key, status) = done.expect("client task");
        match status {
            Ok(s) if s == reqwest::StatusCode::CREATED => created += 1,
            other => panic!("{key}: {other:?}"),
        }
    }
    let tally = ledger.tally();
    assert_eq!(created, 100);
    assert_eq!((tally.paid, tally.duplicates), (100, 0), "{tally:?}");
    assert!(tally.lost > 0);
    let reconciled = metric(gw.admin, "idem_reconciled_total", "result=\"completed\"").await;
    assert_eq!(reconciled, tally.lost as f64);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_gateway_sigkilled_mid_request_charges_once_by_default() {
    // Every request answers after 1.5 s; the gateway dies once the
    // upstream has charged, before it answers.
    let faults = Schedule {
        lost_every: 0,
        slow_every: 1_000_000,
        slow_for: Duration::from_millis(1500),
    };
    for reconcile in [true, false] {
        let dir = tempfile::tempdir().expect("temp dir");
        let store = sqlite_store(dir.path());
        let ledger = Ledger::start(faults).await;
        // A short lease so the test waits 2 s for it to lapse, not 30.
        let start = || gateway(dir.path(), &ledger, reconcile, "[defaults]\nlease = \"2s\"");
        let gw = start().await;
        let pay = |addr: std::net::SocketAddr| async move {
            idem_testkit::client::try_send(
                addr,
                http::Method::POST,
                "/v1/payments",
                &[
                    ("idempotency-key", "killed-1"),
                    ("authorization", "Bearer sk_test_kill"),
                    ("content-type", "application/json"),
                ],
                r#"{"amount_cents":500}"#,
            )
            .await
        };
        let in_flight = tokio::spawn(pay(gw.addr));
        eventually("the upstream charging", async || {
            ledger.charges("killed-1") > 0
        })
        .await;
        gw.signal("KILL");
        assert!(
            in_flight.await.expect("task").is_err(),
            "the client lost its answer"
        );
        drop(gw);
        tokio::time::sleep(Duration::from_millis(1500)).await;
        assert_eq!(
            ledger.charges("killed-1"),
            1,
            "the upstream charged meanwhile"
        );

        let gw = start().await;
        let mut last = None;
        for _ in 0..100 {
            let answer = pay(gw.addr).await.expect("answer");
            let settled = answer.status != http::StatusCode::CONFLICT
                || answer.problem_type().ends_with("idempotency-outcome-held");
            last = Some(answer);
            if settled {
                break;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        let last = last.expect("an answer");
        assert_eq!(
            ledger.charges("killed-1"),
            1,
            "charged once (reconcile = {reconcile})"
        );
        if reconcile {
            assert_eq!(last.status, http::StatusCode::CREATED);
            assert_eq!(last.header("idempotent-replayed"), Some("true"));
            assert!(String::from_utf8_lossy(&last.body).contains("pay_1"));
        } else {
            assert_eq!(last.status, http::StatusCode::CONFLICT);
            assert!(last.problem_type().ends_with("idempotency-outcome-held"));
            assert!(last.header("retry-after").is_none());
            assert_eq!(held_keys(&store), ["killed-1"]);
        }
    }
}
