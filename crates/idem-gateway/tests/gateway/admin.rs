//! The admin listener of the real `idem` binary: token rules, metrics that
//! follow real traffic, the records API and its operator actions, the
//! background cleanup and stuck-record monitor, the `idem records` and
//! `idem cleanup` commands, and what the logs carry (and never carry).

use std::time::Duration;

use http::{Method, StatusCode};
use idem_testkit::client::Answer;
use idem_testkit::gateway::{GatewayProcess as Gateway, sqlite_store};
use idem_testkit::upstream::CountingUpstream;
use idem_testkit::wait::eventually;
use serde_json::Value;

const IDEM: &str = env!("CARGO_BIN_EXE_idem");
const JSON: (&str, &str) = ("content-type", "application/json");
const AUTH: (&str, &str) = ("authorization", "Bearer merchant-1");
const OP: &str = "POST%20%2Fv1%2Fpayments";

const CONFIG: &str = r#"
[defaults]
lease = "1s"
upstream_timeout = "3s"

[[route]]
method = "POST"
path = "/v1/payments"
require_key = true

[cleanup]
interval = "200ms"
batch = 2

[monitor]
interval = "200ms"
stuck_after_leases = 1
"#;

fn json(answer: &Answer) -> Value {
    serde_json::from_slice(&answer.body)
        .unwrap_or_else(|e| panic!("not JSON ({e}): {:?}", answer.body))
}

async fn get(gw: &Gateway, path: &str) -> Answer {
    gw.admin(Method::GET, path, &[], "").await
}

/// The value of one sample line of the Prometheus text, 0 if absent.
fn sample(metrics: &str, series: &str) -> f64 {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .map_or(0.0, |v| v.trim().parse().expect("a number"))
}

async fn metrics(gw: &Gateway) -> String {
    let answer = get(gw, "/metrics").await;
    assert_eq!(answer.status, StatusCode::OK);
    String::from_utf8(answer.body.to_vec()).expect("utf-8")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_routes_need_the_token_and_disclose_nothing() {
    let dir = tempfile::tempdir().expect("temp dir");
    let up = CountingUpstream::start().await;
    let gw = Gateway::builder(IDEM, dir.path())
        .config(CONFIG)
        .upstream(&up.url())
        .store(&sqlite_store(dir.path()))
        .args(&["--admin-token", "s3cret-admin-0123456789abcdef0123"])
        .start()
        .await;
    let paid = gw
        .post(
            "/v1/payments",
            &[JSON, AUTH, ("idempotency-key", "k1")],
            "{}",
        )
        .await;
    assert_eq!(paid.status, StatusCode::CREATED);

    assert_eq!(get(&gw, "/healthz").await.status, StatusCode::OK);
    // The dashboard's static files hold no data; its data calls need the token.
    let page = get(&gw, "/dashboard/").await;
    assert_eq!(page.status, StatusCode::OK);
    assert!(String::from_utf8_lossy(&page.body).contains("chart-requests"));
    let csp = page.header("content-security-policy").unwrap_or_default();
    assert!(
        csp.contains("frame-ancestors 'none'"),
        "never framed: {csp}"
    );
    assert_eq!(get(&gw, "/dashboard/app.js").await.status, StatusCode::OK);
    assert_eq!(
        get(&gw, "/dashboard").await.status,
        StatusCode::PERMANENT_REDIRECT
    );

    let record = format!("/api/v1/records/t/{OP}/k1");
    for path in [
        "/readyz",
        "/metrics",
        "/api/v1/records",
        &record,
        "/no/such/route",
    ] {
        for auth in [
            None,
            Some("Bearer wrong"),
            Some("s3cret-admin-0123456789abcdef0123"),
        ] {
            let headers: Vec<(&str, &str)> =
                auth.map(|a| ("authorization", a)).into_iter().collect();
            let answer = gw.admin(Method::GET, path, &headers, "").await;
            assert_eq!(
                answer.status,
                StatusCode::UNAUTHORIZED,
                "{path} with {auth:?}"
            );
            assert_eq!(answer.problem_type(), "admin-unauthorized");
            let body = String::from_utf8_lossy(&answer.body);
            assert!(!body.contains("idem_") && !body.contains("k1"), "{body}");
        }
    }
    let refused = gw
        .admin(Method::DELETE, "/api/v1/records?state=completed", &[], "")
        .await;
    assert_eq!(refused.status, StatusCode::UNAUTHORIZED);

    let bearer = [("authorization", "Bearer s3cret-admin-0123456789abcdef0123")];
    assert_eq!(
        gw.admin(Method::GET, "/readyz", &bearer, "").await.status,
        StatusCode::OK
    );
    let list = gw.admin(Method::GET, "/api/v1/records", &bearer, "").await;
    assert_eq!(list.status, StatusCode::OK);
    assert_eq!(json(&list)["records"].as_array().map(Vec::len), Some(1));
    // Stored answers are never kept by a cache on the way.
    assert_eq!(list.header("cache-control"), Some("no-store"));
    let one = gw.admin(Method::GET, &record, &bearer, "").await;
    assert_eq!(one.header("cache-control"), Some("no-store"));
    let unknown = gw.admin(Method::GET, "/no/such/route", &bearer, "").await;
    assert_eq!(unknown.status, StatusCode::NOT_FOUND);
    assert_eq!(unknown.problem_type(), "not-found");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_and_records_follow_real_traffic() {
    let dir = tempfile::tempdir().expect("temp dir");
    let up = CountingUpstream::start().await;
    let gw = Gateway::builder(IDEM, dir.path())
        .config(CONFIG)
        .upstream(&up.url())
        .store(&sqlite_store(dir.path()))
        .start()
        .await;
    let key = |k: &'static str| ("idempotency-key", k);
    let first = gw
        .post("/v1/payments", &[JSON, AUTH, key("k1")], r#"{"amount":1}"#)
        .await;
    let replay = gw
        .post("/v1/payments", &[JSON, AUTH, key("k1")], r#"{"amount":1}"#)
        .await;
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    let reused = gw
        .post("/v1/payments", &[JSON, AUTH, key("k1")], r#"{"amount":2}"#)
        .await;
    assert_eq!(reused.status, StatusCode::UNPROCESSABLE_ENTITY);
    let declined = gw
        .post(
            "/v1/payments",
            &[JSON, AUTH, key("k2"), ("x-status", "402")],
            "{}",
        )
        .await;
    assert_eq!(declined.status, StatusCode::PAYMENT_REQUIRED);
    let missing = gw.post("/v1/payments", &[JSON, AUTH], "{}").await;
    assert_eq!(missing.status, StatusCode::BAD_REQUEST);

    let text = metrics(&gw).await;
    let requests = |outcome: &str| {
        sample(
            &text,
            &format!("idem_requests_total{{route=\"POST /v1/payments\",outcome=\"{outcome}\"}}"),
        )
    };
    assert_eq!(requests("executed"), 2.0, "{text}");
    assert_eq!(requests("replayed"), 1.0);
    assert_eq!(requests("mismatch"), 1.0);
    assert_eq!(requests("missing_key"), 1.0);
    assert!(
        text.contains("idem_store_op_seconds_bucket{store=\"sqlite\",op=\"reserve\""),
        "{text}"
    );
    assert!(text.contains(
        "idem_request_duration_seconds_bucket{route=\"POST /v1/payments\",outcome=\"executed\""
    ));
    assert!(text.contains("idem_build_info{version=\""));
    assert!(
        !text.contains("k1") && !text.contains("merchant"),
        "no keys or tenants as labels"
    );

    // Listing, filters and paging.
    let completed = json(&get(&gw, "/api/v1/records?state=completed").await);
    let records = completed["records"].as_array().expect("records");
    assert_eq!(records.len(), 1);
    assert_eq!(records[0]["key"], "k1");
    assert_eq!(records[0]["response"]["status"], 201);
    assert!(
        records[0]["response"].get("body").is_none(),
        "no body unless asked"
    );
    let tenant = records[0]["tenant"].as_str().expect("tenant").to_owned();
    assert!(!text.contains(&tenant), "no tenants as labels");
    let failed = json(&get(&gw, "/api/v1/records?state=failed").await);
    assert_eq!(failed["records"][0]["key"], "k2");
    let page1 = json(&get(&gw, "/api/v1/records?limit=1").await);
    let next = page1["next"].as_str().expect("a next page");
    let page2 = json(&get(&gw, &format!("/api/v1/records?limit=1&after={next}")).await);
    assert_ne!(page1["records"][0]["key"], page2["records"][0]["key"]);
    assert!(page2["next"].is_null());

    // One record, with and without its body.
    let path = format!("/api/v1/records/{tenant}/{OP}/k1");
    let shown = json(&get(&gw, &path).await);
    assert_eq!(
        (shown["state"].as_str(), shown["attempt"].as_u64()),
        (Some("completed"), Some(1))
    );
    let with_body = json(&get(&gw, &format!("{path}?body=true")).await);
    assert_eq!(
        with_body["response"]["body"].as_str().map(str::as_bytes),
        Some(first.body.as_ref())
    );

    // Bad input: named parameters, unknown records, wrong states.
    for (bad, name) in [
        ("/api/v1/records?state=done", "state:"),
        ("/api/v1/records?older_than=soon", "older_than:"),
        ("/api/v1/records?limit=0", "limit:"),
        ("/api/v1/records?after=zz", "after:"),
        ("/api/v1/records?colour=blue", "colour:"),
        (&format!("{path}?body=maybe"), "body:"),
        (&format!("/api/v1/records/{tenant}/{OP}/bad%0Akey"), "key:"),
        // Not UTF-8 once decoded (found by the admin_api fuzz target:
        // axum's own plain-text refusal, not problem+json).
        (&format!("/api/v1/records/{tenant}/{OP}/%ff"), "path:"),
    ] {
        let answer = get(&gw, bad).await;
        assert_eq!(answer.status, StatusCode::BAD_REQUEST, "{bad}");
        assert_eq!(answer.problem_type(), "invalid-parameter");
        assert!(
            json(&answer)["detail"]
                .as_str()
                .is_some_and(|d| d.starts_with(name)),
            "{bad}"
        );
    }
    let nothing = get(&gw, &format!("/api/v1/records/{tenant}/{OP}/nope")).await;
    assert_eq!(nothing.status, StatusCode::NOT_FOUND);
    assert_eq!(nothing.problem_type(), "record-not-found");
    let release = gw
        .admin(Method::POST, &format!("{path}/release"), &[], "")
        .await;
    assert_eq!(release.status, StatusCode::CONFLICT);
    assert_eq!(release.problem_type(), "record-state-conflict");

    // Without a token only same-machine requests are served: no DNS
    // rebinding (foreign Host), no cross-site action (foreign Origin).
    let rebound = gw
        .admin(Method::GET, &path, &[("host", "evil.example:9090")], "")
        .await;
    assert_eq!(rebound.status, StatusCode::FORBIDDEN);
    assert_eq!(rebound.problem_type(), "admin-forbidden");
    let cross_site = gw
        .admin(
            Method::DELETE,
            &path,
            &[("origin", "https://evil.example")],
            "",
        )
        .await;
    assert_eq!(cross_site.status, StatusCode::FORBIDDEN);
    assert_eq!(
        get(&gw, &path).await.status,
        StatusCode::OK,
        "nothing deleted"
    );
    let same_site = gw
        .admin(
            Method::GET,
            &path,
            &[("origin", "http://127.0.0.1:9090")],
            "",
        )
        .await;
    assert_eq!(same_site.status, StatusCode::OK);

    // Delete: the key runs again.
    assert_eq!(
        gw.admin(Method::DELETE, &path, &[], "").await.status,
        StatusCode::NO_CONTENT
    );
    assert_eq!(get(&gw, &path).await.status, StatusCode::NOT_FOUND);
    assert_eq!(
        gw.admin(Method::DELETE, &path, &[], "").await.status,
        StatusCode::NOT_FOUND
    );
    let again = gw
        .post("/v1/payments", &[JSON, AUTH, key("k1")], r#"{"amount":1}"#)
        .await;
    assert_eq!(again.status, StatusCode::CREATED);
    assert_eq!(again.header("idempotent-replayed"), None);
    assert_eq!(up.executions("k1"), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operators_release_and_resolve_processing_records() {
    let dir = tempfile::tempdir().expect("temp dir");
    let up = CountingUpstream::start().await;
    let gw = Gateway::builder(IDEM, dir.path())
        .config(CONFIG)
        .upstream(&up.url())
        .store(&sqlite_store(dir.path()))
        .start()
        .await;

    // A timeout after sending: outcome unknown, the record stays processing.
    let timed_out = gw
        .post(
            "/v1/payments",
            &[
                JSON,
                AUTH,
                ("idempotency-key", "lost"),
                ("x-delay-ms", "4000"),
            ],
            "{}",
        )
        .await;
    assert_eq!(timed_out.status, StatusCode::GATEWAY_TIMEOUT);
    let listed = json(&get(&gw, "/api/v1/records?state=processing").await);
    let record = &listed["records"][0];
    assert_eq!(record["key"], "lost");
    assert_eq!(record["outcome_unknown"], true);
    let tenant = record["tenant"].as_str().expect("tenant").to_owned();
    let path = format!("/api/v1/records/{tenant}/{OP}/lost");

    // The stuck-record monitor sees it once its lease lapsed.
    eventually("idem_stuck_records = 1", async || {
        sample(&metrics(&gw).await, "idem_stuck_records") == 1.0
    })
    .await;

    // Reconcile by hand: the provider says it was charged.
    let answer = r#"{"status":201,"headers":{"content-type":"application/json"},"body":"{\"id\":\"pay_lost\"}","resource_id":"pay_lost"}"#;
    let bad = gw
        .admin(
            Method::POST,
            &format!("{path}/resolve"),
            &[JSON],
            r#"{"status":99}"#,
        )
        .await;
    assert_eq!(bad.status, StatusCode::BAD_REQUEST);
    // Framing, connection, cookie and authentication headers are never
    // stored, from an operator either: a stored `Content-Length` made the
    // replay's body run into the next pipelined answer.
    for name in [
        "content-length",
        "Transfer-Encoding",
        "connection",
        "set-cookie",
        "set-cookie2",
        "authentication-info",
        "idempotent-replayed",
    ] {
        let framed = gw
            .admin(
                Method::POST,
                &format!("{path}/resolve"),
                &[JSON],
                &format!(r#"{{"status":201,"headers":{{"{name}":"100"}},"body":"x"}}"#),
            )
            .await;
        assert_eq!(framed.status, StatusCode::BAD_REQUEST, "{name}");
        assert!(
            String::from_utf8_lossy(&framed.body).contains("never stored"),
            "{name}: {:?}",
            framed.body
        );
    }
    let not_json = gw
        .admin(Method::POST, &format!("{path}/resolve"), &[], answer)
        .await;
    assert_eq!(not_json.status, StatusCode::BAD_REQUEST);
    let resolved = gw
        .admin(Method::POST, &format!("{path}/resolve"), &[JSON], answer)
        .await;
    assert_eq!(resolved.status, StatusCode::OK, "{:?}", resolved.body);
    let resolved = json(&resolved);
    assert_eq!(
        (resolved["state"].as_str(), resolved["resource_id"].as_str()),
        (Some("completed"), Some("pay_lost"))
    );
    // The client's retry gets the reconciled answer; nothing runs twice.
    let retry = gw
        .post(
            "/v1/payments",
            &[JSON, AUTH, ("idempotency-key", "lost")],
            "{}",
        )
        .await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert_eq!(retry.header("idempotent-replayed"), Some("true"));
    assert_eq!(&retry.body[..], br#"{"id":"pay_lost"}"#);
    assert_eq!(up.executions("lost"), 1);
    let twice = gw
        .admin(Method::POST, &format!("{path}/resolve"), &[JSON], answer)
        .await;
    assert_eq!(twice.status, StatusCode::CONFLICT);
    eventually("idem_stuck_records = 0", async || {
        sample(&metrics(&gw).await, "idem_stuck_records") == 0.0
    })
    .await;

    // Resolving a record whose owner is still running waits for its lease;
    // releasing frees the key at once and fences the owner out.
    let slow = {
        let (addr, url) = (gw.addr, "/v1/payments");
        tokio::spawn(async move {
            idem_testkit::client::send(
                addr,
                Method::POST,
                url,
                &[
                    JSON,
                    AUTH,
                    ("idempotency-key", "slow"),
                    ("x-delay-ms", "2500"),
                ],
                "{}",
            )
            .await
        })
    };
    let slow_path = format!("/api/v1/records/{tenant}/{OP}/slow");
    eventually("the slow request is processing", async || {
        get(&gw, &slow_path).await.status == StatusCode::OK
    })
    .await;
    let early = gw
        .admin(
            Method::POST,
            &format!("{slow_path}/resolve"),
            &[JSON],
            answer,
        )
        .await;
    assert_eq!(early.status, StatusCode::CONFLICT);
    assert!(early.header("retry-after").is_some());
    // A release aimed at another attempt than the one running is refused.
    let stale = gw
        .admin(
            Method::POST,
            &format!("{slow_path}/release?attempt=2"),
            &[],
            "",
        )
        .await;
    assert_eq!(stale.status, StatusCode::CONFLICT);
    let bad = gw
        .admin(
            Method::POST,
            &format!("{slow_path}/release?attempt=zero"),
            &[],
            "",
        )
        .await;
    assert_eq!(bad.status, StatusCode::BAD_REQUEST);
    let released = gw
        .admin(
            Method::POST,
            &format!("{slow_path}/release?attempt=1"),
            &[],
            "",
        )
        .await;
    assert_eq!(released.status, StatusCode::OK);
    assert_eq!(json(&released)["released"], true);
    let _ = slow.await.expect("slow request");
    assert_eq!(
        get(&gw, &slow_path).await.status,
        StatusCode::NOT_FOUND,
        "the fenced owner did not record into the released key"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_cleans_up_expired_records_in_the_background() {
    let dir = tempfile::tempdir().expect("temp dir");
    let up = CountingUpstream::start().await;
    let config = format!(
        "{CONFIG}\n[[route]]\nmethod = \"POST\"\npath = \"/v1/brief\"\nretention = \"1s\"\n"
    );
    let gw = Gateway::builder(IDEM, dir.path())
        .config(&config)
        .upstream(&up.url())
        .store(&sqlite_store(dir.path()))
        .start()
        .await;
    for i in 0..5 {
        let key = format!("brief-{i}");
        let answer = gw
            .post("/v1/brief", &[JSON, AUTH, ("idempotency-key", &key)], "{}")
            .await;
        assert_eq!(answer.status, StatusCode::CREATED);
    }
    eventually("five expired records deleted", async || {
        sample(&metrics(&gw).await, "idem_cleanup_deleted_total") >= 5.0
    })
    .await;
    let left = json(&get(&gw, "/api/v1/records").await);
    assert_eq!(left["records"].as_array().map(Vec::len), Some(0), "{left}");
}

/// The command line acts on the store directly, like the API.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_and_cleanup_commands() {
    let dir = tempfile::tempdir().expect("temp dir");
    let up = CountingUpstream::start().await;
    let store = sqlite_store(dir.path());
    let config = CONFIG.replace("[cleanup]\n", "[cleanup]\nenabled = false\n");
    let gw = Gateway::builder(IDEM, dir.path())
        .config(&config)
        .upstream(&up.url())
        .store(&store)
        .start()
        .await;
    let timed_out = gw
        .post(
            "/v1/payments",
            &[
                JSON,
                AUTH,
                ("idempotency-key", "cli-1"),
                ("x-delay-ms", "4000"),
            ],
            "{}",
        )
        .await;
    assert_eq!(timed_out.status, StatusCode::GATEWAY_TIMEOUT);
    assert!(gw.terminate().await.success());

    let idem = |args: &[&str]| {
        let out = std::process::Command::new(IDEM)
            .args(args)
            .args(["--store", &store])
            .output()
            .expect("run idem");
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (code, out, _) = idem(&["records", "list", "--state", "processing"]);
    assert_eq!(code, Some(0));
    assert!(
        out.contains("cli-1") && out.contains("outcome unknown"),
        "{out}"
    );
    // A row's ID column, pasted into a shell after `records show`, names
    // its record: whole, not cut short, quoted where the shell needs it.
    let row = out.lines().find(|l| l.contains("cli-1")).expect("row");
    let pasted = row.split_once("outcome unknown").expect("note").1.trim();
    let shown = std::process::Command::new("sh")
        .arg("-c")
        .arg(format!("\"$0\" records show --store \"$1\" {pasted}"))
        .args([IDEM, store.as_str()])
        .output()
        .expect("run sh");
    assert!(shown.status.success(), "{pasted}: {shown:?}");
    let shown: Value = serde_json::from_slice(&shown.stdout).expect("JSON");
    assert_eq!(shown["key"], "cli-1");
    // `show` changes nothing, so it takes no fence.
    let (code, _, err) = idem(&["records", "show", "t", "POST /x", "k", "--attempt", "1"]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("unexpected argument '--attempt'"), "{err}");
    let (_, out, _) = idem(&["records", "list", "--json"]);
    let listed: Value = serde_json::from_str(&out).expect("JSON");
    let tenant = listed["records"][0]["tenant"]
        .as_str()
        .expect("tenant")
        .to_owned();
    let id = [tenant.as_str(), "POST /v1/payments", "cli-1"];

    let (code, _, err) = idem(&[&["records", "show"][..], &[id[0], id[1], "nope"]].concat());
    assert_eq!(code, Some(1));
    assert!(err.contains("no such record"), "{err}");
    let (code, _, err) = idem(
        &[
            &["records", "resolve"][..],
            &id,
            &["--status", "201", "--header", "no colon"],
        ]
        .concat(),
    );
    assert_eq!(code, Some(1));
    assert!(err.contains("--header"), "{err}");
    let (code, _, err) = idem(
        &[
            &["records", "resolve"][..],
            &id,
            &["--status", "201", "--header", "Content-Length: 100"],
        ]
        .concat(),
    );
    assert_eq!(code, Some(1));
    assert!(err.contains("never stored"), "{err}");
    tokio::time::sleep(Duration::from_millis(1100)).await; // the lease lapses
    let (code, out, err) = idem(
        &[
            &["records", "resolve"][..],
            &id,
            &[
                "--status",
                "201",
                "--body",
                "{\"id\":\"pay_cli\"}",
                "--retention",
                "5s",
            ],
        ]
        .concat(),
    );
    assert_eq!(code, Some(0), "{err}");
    assert!(out.contains("resolved"), "{out}");
    let (_, out, _) = idem(&[&["records", "show"][..], &id, &["--body"]].concat());
    let shown: Value = serde_json::from_str(&out).expect("JSON");
    assert_eq!(shown["state"], "completed");
    assert_eq!(shown["response"]["body"], "{\"id\":\"pay_cli\"}");
    let (code, _, err) = idem(&[&["records", "release"][..], &id].concat());
    assert_eq!(code, Some(1));
    assert!(err.contains("not processing"), "{err}");

    tokio::time::sleep(Duration::from_millis(5100)).await; // the answer expires
    let (code, out, _) = idem(&["cleanup", "--batch", "1"]);
    assert_eq!(code, Some(0));
    assert!(
        out.starts_with("idem cleanup: deleted 1 expired record(s)"),
        "{out}"
    );
    let (_, out, _) = idem(&["cleanup"]);
    assert!(
        out.starts_with("idem cleanup: deleted 0 expired record(s)"),
        "{out}"
    );
    let (code, _, err) = idem(&[&["records", "purge"][..], &id].concat());
    assert_eq!(code, Some(1), "already gone");
    assert!(err.contains("no such record"), "{err}");
}

/// One JSON event per decision, with its reason code, tenant, operation
/// and key — and never the Authorization value or the request body.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decision_logs_are_structured_and_keep_secrets_out() {
    let dir = tempfile::tempdir().expect("temp dir");
    let up = CountingUpstream::start().await;
    let gw = Gateway::builder(IDEM, dir.path())
        .config(CONFIG)
        .upstream(&up.url())
        .store(&sqlite_store(dir.path()))
        .log("info")
        .args(&["--log-format", "json"])
        .log_to_file()
        .start()
        .await;
    let secret_auth = ("authorization", "Bearer sk_live_TOPSECRET");
    let body = r#"{"card":"4242-SECRET-CARD"}"#;
    for _ in 0..2 {
        gw.post(
            "/v1/payments",
            &[JSON, secret_auth, ("idempotency-key", "log-1")],
            body,
        )
        .await;
    }
    gw.post(
        "/v1/payments",
        &[JSON, secret_auth, ("idempotency-key", "log-1")],
        "{}",
    )
    .await;
    assert!(gw.terminate().await.success());
    let log = std::fs::read_to_string(dir.path().join("idem.log")).expect("log");
    assert!(
        !log.contains("TOPSECRET") && !log.contains("SECRET-CARD"),
        "{log}"
    );
    let events: Vec<Value> = log
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect();
    let reasons: Vec<&str> = events
        .iter()
        .filter_map(|e| e["fields"]["reason"].as_str())
        .collect();
    for reason in [
        "idempotency_executed",
        "idempotency_replay",
        "idempotency_mismatch",
    ] {
        assert!(reasons.contains(&reason), "{reason} in {reasons:?}");
    }
    let replay = events
        .iter()
        .find(|e| e["fields"]["reason"] == "idempotency_replay")
        .expect("replay event");
    assert_eq!(replay["fields"]["key"], "log-1");
    assert_eq!(replay["fields"]["operation"], "POST /v1/payments");
    assert_eq!(replay["fields"]["state"], "completed");
    assert_eq!(
        replay["fields"]["tenant"].as_str().map(str::len),
        Some(64),
        "a hash, not the credential"
    );
}

/// `idem cleanup` stopped by SIGINT, then killed with SIGKILL, mid-way:
/// every record it removed was expired, no processing record is touched,
/// and the next run finishes the job.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn interrupted_cleanup_loses_nothing_and_resumes() {
    use idem::{
        FinalOutcome, Fingerprint, LeaseExpiry, OwnerToken, Reservation, ReserveRequest, Scope,
        Store, StoredResponse, Verdict,
    };
    const EXPIRED: usize = 6_000;
    let dir = tempfile::tempdir().expect("temp dir");
    let url = sqlite_store(dir.path());
    {
        let store = std::sync::Arc::new(
            idem_sqlite::SqliteStore::open_url(&format!("{url}?synchronous=normal")).expect("open"),
        );
        let scope = Scope::new("t", "POST /v1/payments").expect("scope");
        let mut tasks = tokio::task::JoinSet::new();
        for i in 0..EXPIRED + 1 {
            let (store, scope) = (store.clone(), scope.clone());
            tasks.spawn(async move {
                let key = format!("k{i}").parse().expect("key");
                let lease = match store
                    .reserve(ReserveRequest {
                        scope: &scope,
                        key: &key,
                        fingerprint: Fingerprint::builder()
                            .part("i", i.to_string().as_bytes())
                            .finish(),
                        owner: OwnerToken::random(),
                        lease: Duration::from_secs(3600),
                        retention: Duration::from_secs(3600),
                        on_lease_expiry: LeaseExpiry::Retry,
                    })
                    .await
                    .expect("reserve")
                {
                    Reservation::Acquired(lease) => lease,
                    other => panic!("{other:?}"),
                };
                // The last one stays processing: cleanup must never touch it.
                if i < EXPIRED {
                    let done = FinalOutcome {
                        verdict: Verdict::Completed,
                        response: StoredResponse::new(201, "ok"),
                        resource_id: None,
                        error_code: None,
                        retention: Duration::ZERO,
                    };
                    store
                        .resolve(&scope, &key, &lease, &done)
                        .await
                        .expect("resolve");
                }
            });
        }
        while let Some(done) = tasks.join_next().await {
            done.expect("task");
        }
    }
    let count = |args: &[&str]| {
        let out = std::process::Command::new(IDEM)
            .args([
                "records", "list", "--json", "--limit", "100000", "--store", &url,
            ])
            .args(args)
            .output()
            .expect("list");
        let page: Value = serde_json::from_slice(&out.stdout).expect("JSON");
        page["records"].as_array().map_or(0, Vec::len)
    };
    // Expired records do not list; the processing one does.
    assert_eq!(count(&[]), 1);

    // One record per batch: thousands of commits, long enough to interrupt.
    let run = || {
        std::process::Command::new(IDEM)
            .args(["cleanup", "--batch", "1", "--store", &url])
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("cleanup")
    };
    let signal = |child: &std::process::Child, sig: &str| {
        std::process::Command::new("kill")
            .args([sig, &child.id().to_string()])
            .status()
            .expect("kill");
    };
    // Rows in the file, expired or not (read-only, beside the cleaner).
    let db = dir.path().join("idem.db");
    let rows = || -> i64 {
        let conn = idem_sqlite::rusqlite::Connection::open_with_flags(
            &db,
            idem_sqlite::rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY,
        )
        .expect("open read-only");
        conn.busy_timeout(Duration::from_secs(5))
            .expect("busy timeout");
        conn.query_row("SELECT count(*) FROM idem_records", [], |r| r.get(0))
            .expect("count")
    };
    let total = rows();
    // Interrupt each run once it has visibly started deleting.
    let started_deleting = async |below: i64| {
        for _ in 0..200 {
            if rows() < below {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        panic!("cleanup did not start deleting within 4 s");
    };
    let child = run();
    started_deleting(total).await;
    signal(&child, "-INT");
    let out = child.wait_with_output().expect("wait");
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(130), "interrupted: {text}");
    assert!(text.contains("interrupted after"), "{text}");

    let left = rows();
    let child = run();
    started_deleting(left).await;
    signal(&child, "-KILL");
    let _ = child.wait_with_output();

    let out = std::process::Command::new(IDEM)
        .args(["cleanup", "--batch", "500", "--store", &url])
        .output()
        .expect("cleanup");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    let deleted: usize = text
        .strip_prefix("idem cleanup: deleted ")
        .and_then(|t| t.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{text}"));
    assert!(
        deleted < EXPIRED,
        "the interrupted runs had deleted some: {text}"
    );
    // Nothing expired is left, and the processing record is still there.
    let store = idem_sqlite::SqliteStore::open_url(&url).expect("open");
    assert_eq!(
        idem::Purge::purge_expired(&store, 100_000)
            .await
            .expect("purge"),
        0
    );
    let processing = format!("k{EXPIRED}").parse().expect("key");
    let scope = Scope::new("t", "POST /v1/payments").expect("scope");
    let kept = store.get(&scope, &processing).await.expect("get");
    assert_eq!(kept.map(|r| r.state), Some(idem::RecordState::Processing));
}
