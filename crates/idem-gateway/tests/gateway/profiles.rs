//! Contract profiles against the real gateway binary: each normative
//! statement of the IETF Idempotency-Key draft (draft-07, sections as it
//! numbers them) under `profile = "ietf"`, each switch a route may change after its profile, the stable
//! `code` of problem documents, key formats refused before the store, and
//! the contract published by `idem openapi` and at `contract_path`,
//! checked by a standard OpenAPI validator.

use std::path::Path;

use http::{Method, StatusCode};
use idem_testkit::client::{Answer, send};
use idem_testkit::gateway::{GatewayProcess as Gateway, sqlite_store};
use idem_testkit::upstream::CountingUpstream;

const IDEM: &str = env!("CARGO_BIN_EXE_idem");

const CONFIG: &str = r#"
contract_path = "/.well-known/idempotency"

[defaults]
profile = "ietf"
retention = "36h"

[[route]]
method = "POST"
path = "/v1/payments"
require_key = true
max_stored_response = "1KiB"

[[route]]
method = "POST"
path = "/v1/orders/{id}/ship"
require_key = true
key_format = "uuidv7"

[[route]]
method = "POST"
path = "/v1/stripe"
profile = "stripe"
max_stored_response = "1KiB"

[[route]]
method = "POST"
path = "/v1/both"
replay_header = ["Idempotent-Replayed", "Idempotency-Replayed"]
retention_header = false

[[route]]
method = "POST"
path = "/v1/hold"
on_server_error = "hold"

[[route]]
method = "POST"
path = "/v1/release"
on_server_error = "release"

[[route]]
method = "POST"
path = "/v1/adcp"
key_format = "[A-Za-z0-9_.:-]{16,255}"
"#;

async fn start(dir: &Path, up: &CountingUpstream) -> Gateway {
    Gateway::builder(IDEM, dir)
        .config(CONFIG)
        .upstream(&up.url())
        .store(&sqlite_store(dir))
        .log("error")
        .start()
        .await
}

fn problem(answer: &Answer) -> serde_json::Value {
    assert_eq!(
        answer.header("content-type"),
        Some("application/problem+json"),
        "{answer:?}"
    );
    serde_json::from_slice(&answer.body).expect("problem document")
}

/// §2.1 (the field is an RFC 8941 String, sent once) and §2.6 (first
/// request, retry): a key sent as a structured-field string is the same
/// key as its bare token, the first request is processed normally, and
/// its retry gets the original answer, marked `Idempotency-Replayed` and
/// nothing else, with the key's retention in `Idempotency-TTL` (§2.3: the
/// expiry policy is published).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_gets_the_first_answer_marked_as_the_draft_reads() {
    let dir = tempfile::tempdir().expect("temp dir");
    let up = CountingUpstream::start().await;
    let gw = start(dir.path(), &up).await;
    let first = gw
        .post("/v1/payments", &[("idempotency-key", "\"pay-0001\"")], "{}")
        .await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(first.header("idempotency-ttl"), Some("129600"));
    assert_eq!(first.header("idempotency-replayed"), None);
    let retry = gw
        .post("/v1/payments", &[("idempotency-key", "pay-0001")], "{}")
        .await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert_eq!(retry.body, first.body);
    assert_eq!(retry.header("idempotency-replayed"), Some("true"));
    assert_eq!(retry.header("idempotent-replayed"), None);
    assert_eq!(retry.header("idempotency-ttl"), Some("129600"));
    // The upstream counts keys as forwarded: the first one was quoted.
    assert_eq!(up.executions("\"pay-0001\""), 1);
    assert_eq!(up.executions("pay-0001"), 0);
    // An error is a result too: its retry gets it back, not a second run.
    let failed = [("idempotency-key", "pay-0002"), ("x-status", "422")];
    assert_eq!(gw.post("/v1/payments", &failed, "{}").await.status, 422);
    let again = gw.post("/v1/payments", &failed, "{}").await;
    assert_eq!(again.status, 422);
    assert_eq!(again.header("idempotency-replayed"), Some("true"));
    assert_eq!(up.executions("pay-0002"), 1);
    // A string that never closes is no key; two fields are ambiguous.
    let broken = gw
        .post("/v1/payments", &[("idempotency-key", "\"pay-0003")], "{}")
        .await;
    assert_eq!(broken.status, StatusCode::BAD_REQUEST);
    assert_eq!(problem(&broken)["code"], "idempotency-key-invalid");
    assert_eq!(broken.header("idempotency-ttl"), None);
    let twice = [
        ("idempotency-key", "pay-0004"),
        ("idempotency-key", "pay-0005"),
    ];
    let twice = gw.post("/v1/payments", &twice, "{}").await;
    assert_eq!(twice.status, StatusCode::BAD_REQUEST);
    assert_eq!(problem(&twice)["code"], "idempotency-key-ambiguous");
    assert_eq!(
        up.total(),
        2,
        "only the two keys above reached the upstream"
    );
}

/// §2.6 (concurrent request: MUST answer a conflict) and §2.7 (409 with a
/// problem description): a retry while the first runs gets `409`, a
/// problem document, and `Retry-After`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_during_the_first_gets_a_conflict_with_a_problem() {
    let dir = tempfile::tempdir().expect("temp dir");
    let up = CountingUpstream::start().await;
    let gw = start(dir.path(), &up).await;
    let slow = [("idempotency-key", "pay-slow-1"), ("x-delay-ms", "3000")];
    let first = {
        let addr = gw.addr;
        tokio::spawn(async move {
            send(
                addr,
                Method::POST,
                "/v1/payments",
                &[
                    ("idempotency-key", "pay-slow-1"),
                    ("x-delay-ms", "3000"),
                    ("authorization", idem_testkit::gateway::TEST_CREDENTIAL),
                ],
                "{}",
            )
            .await
        })
    };
    up.until_received("pay-slow-1").await;
    let during = gw.post("/v1/payments", &slow, "{}").await;
    assert_eq!(during.status, StatusCode::CONFLICT);
    let doc = problem(&during);
    assert_eq!(doc["code"], "idempotency-request-in-progress");
    assert_eq!(doc["status"], 409);
    assert!(during.header("retry-after").is_some(), "{during:?}");
    assert_eq!(first.await.expect("first").status, StatusCode::CREATED);
    assert_eq!(up.executions("pay-slow-1"), 1);
}

/// §2.7: a missing key where the operation requires one is `400` with a
/// link to documentation (the problem's `type`); a key reused with
/// another payload is `422`; and a request not corrected is refused again
/// the same way, while the request the key was made for still replays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_are_400_and_422_until_the_request_is_corrected() {
    let dir = tempfile::tempdir().expect("temp dir");
    let up = CountingUpstream::start().await;
    let gw = start(dir.path(), &up).await;
    for _ in 0..2 {
        let missing = gw.post("/v1/payments", &[], "{}").await;
        assert_eq!(missing.status, StatusCode::BAD_REQUEST);
        let doc = problem(&missing);
        assert_eq!(doc["code"], "idempotency-key-missing");
        assert_eq!(
            doc["type"],
            "https://idem.dev/problems/idempotency-key-missing"
        );
    }
    let key = [
        ("idempotency-key", "pay-reuse-1"),
        ("content-type", "application/json"),
    ];
    assert_eq!(
        gw.post("/v1/payments", &key, r#"{"amount":100}"#)
            .await
            .status,
        StatusCode::CREATED
    );
    for _ in 0..2 {
        let reused = gw.post("/v1/payments", &key, r#"{"amount":200}"#).await;
        assert_eq!(reused.status, StatusCode::UNPROCESSABLE_ENTITY);
        assert_eq!(problem(&reused)["code"], "idempotency-key-reused");
    }
    let original = gw.post("/v1/payments", &key, r#"{"amount":100}"#).await;
    assert_eq!(original.status, StatusCode::CREATED);
    assert_eq!(original.header("idempotency-replayed"), Some("true"));
    assert_eq!(up.executions("pay-reuse-1"), 1);
    assert_eq!(up.total(), 1);
}

/// §5: the key is checked against the route's published format before
/// any lookup: a key of another format is `400 idempotency-key-invalid`
/// naming the rule, nothing is forwarded and nothing recorded (the same
/// key is refused again, never replayed), and a key of the format runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_of_another_format_are_refused_before_the_store() {
    let dir = tempfile::tempdir().expect("temp dir");
    let up = CountingUpstream::start().await;
    let gw = start(dir.path(), &up).await;
    let v4 = "9b2f6c1e-3d4a-4f5b-8c6d-7e8f9a0b1c2d";
    for _ in 0..2 {
        let refused = gw
            .post("/v1/orders/7/ship", &[("idempotency-key", v4)], "{}")
            .await;
        assert_eq!(refused.status, StatusCode::BAD_REQUEST);
        let doc = problem(&refused);
        assert_eq!(doc["code"], "idempotency-key-invalid");
        assert!(
            doc["detail"]
                .as_str()
                .is_some_and(|d| d.contains("version 7 UUIDs")),
            "{doc}"
        );
    }
    let v7 = "0190b3a4-7c1e-7d2a-9f3b-5a6c7d8e9f01";
    let shipped = gw
        .post("/v1/orders/7/ship", &[("idempotency-key", v7)], "{}")
        .await;
    assert_eq!(shipped.status, StatusCode::CREATED);
    let short = gw
        .post("/v1/adcp", &[("idempotency-key", "too-short")], "{}")
        .await;
    assert_eq!(short.status, StatusCode::BAD_REQUEST);
    assert_eq!(problem(&short)["code"], "idempotency-key-invalid");
    let adcp = gw
        .post(
            "/v1/adcp",
            &[("idempotency-key", "agent:run-42.step_7")],
            "{}",
        )
        .await;
    assert_eq!(adcp.status, StatusCode::CREATED);
    assert_eq!(
        up.total(),
        2,
        "only the keys of the format reached the upstream"
    );
    let records = gw
        .admin(Method::GET, "/api/v1/records?limit=100", &[], "")
        .await;
    let page: serde_json::Value = serde_json::from_slice(&records.body).expect("json");
    let keys: Vec<&str> = page["records"]
        .as_array()
        .expect("records")
        .iter()
        .filter_map(|r| r["key"].as_str())
        .collect();
    assert!(!keys.contains(&v4), "{keys:?}");
    assert!(!keys.contains(&"too-short"), "{keys:?}");
}

/// An answer too large to keep: the IETF profile replays its status and
/// headers with an empty body, the Stripe profile a problem document under
/// the original status; both say `Idempotency-Status: not-retained`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_not_kept_replays_as_each_profile_says() {
    let dir = tempfile::tempdir().expect("temp dir");
    let up = CountingUpstream::start().await;
    let gw = start(dir.path(), &up).await;
    let big = [("idempotency-key", "big-0001"), ("x-size", "4096")];
    let first = gw.post("/v1/payments", &big, "{}").await;
    assert_eq!(first.body.len(), 4096);
    let ietf = gw.post("/v1/payments", &big, "{}").await;
    assert_eq!(ietf.status, first.status);
    assert!(ietf.body.is_empty(), "{ietf:?}");
    assert_eq!(ietf.header("idempotency-status"), Some("not-retained"));
    assert_eq!(ietf.header("idempotency-replayed"), Some("true"));
    assert_eq!(ietf.header("content-type"), None);
    let first = gw.post("/v1/stripe", &big, "{}").await;
    assert_eq!(first.body.len(), 4096);
    let stripe = gw.post("/v1/stripe", &big, "{}").await;
    assert_eq!(stripe.status, first.status);
    assert_eq!(
        problem(&stripe)["code"],
        "idempotency-response-not-retained"
    );
    assert_eq!(stripe.header("idempotency-status"), Some("not-retained"));
    assert_eq!(stripe.header("idempotent-replayed"), Some("true"));
    assert_eq!(stripe.header("idempotency-ttl"), None);
    assert_eq!(up.executions("big-0001"), 2, "one run per route");
}

/// A held outcome's `409` carries `Retry-After` under the IETF profile
/// (every `409` does) and none under Stripe's; a `502` is held in both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_outcome_says_when_to_ask_again_only_under_the_ietf_profile() {
    let dir = tempfile::tempdir().expect("temp dir");
    let up = CountingUpstream::start().await;
    let gw = start(dir.path(), &up).await;
    for (path, retry_after) in [("/v1/payments", Some("60")), ("/v1/stripe", None)] {
        let lost = [("idempotency-key", "held-0001"), ("x-status", "502")];
        assert_eq!(gw.post(path, &lost, "{}").await.status, 502);
        let held = gw.post(path, &lost, "{}").await;
        assert_eq!(held.status, StatusCode::CONFLICT, "{path}");
        assert_eq!(problem(&held)["code"], "idempotency-outcome-held");
        assert_eq!(held.header("retry-after"), retry_after, "{path}");
    }
    assert_eq!(
        up.executions("held-0001"),
        2,
        "one run per route, never a second"
    );
}

/// What a `500` does is the route's choice: stored and replayed (the
/// default), held as an unknown outcome, or released so that the retry
/// runs it again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_error_is_stored_held_or_released_as_the_route_says() {
    let dir = tempfile::tempdir().expect("temp dir");
    let up = CountingUpstream::start().await;
    let gw = start(dir.path(), &up).await;
    let cases = [
        (
            "/v1/payments",
            "e-store",
            StatusCode::INTERNAL_SERVER_ERROR,
            1,
        ),
        ("/v1/hold", "e-hold", StatusCode::CONFLICT, 1),
        ("/v1/release", "e-release", StatusCode::CREATED, 2),
    ];
    for (path, key, retry_status, runs) in cases {
        let failing = [("idempotency-key", key), ("x-status", "500")];
        assert_eq!(gw.post(path, &failing, "{}").await.status, 500, "{path}");
        let retry = gw.post(path, &[("idempotency-key", key)], "{}").await;
        assert_eq!(retry.status, retry_status, "{path}: {retry:?}");
        assert_eq!(up.executions(key), runs, "{path}");
    }
}

/// A route may send both spellings of the replay marker, and turn the
/// retention header off after its profile turned it on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_route_changes_one_switch_of_its_profile() {
    let dir = tempfile::tempdir().expect("temp dir");
    let up = CountingUpstream::start().await;
    let gw = start(dir.path(), &up).await;
    let key = [("idempotency-key", "both-0001")];
    let first = gw.post("/v1/both", &key, "{}").await;
    assert_eq!(first.header("idempotency-ttl"), None);
    let retry = gw.post("/v1/both", &key, "{}").await;
    assert_eq!(retry.header("idempotent-replayed"), Some("true"));
    assert_eq!(retry.header("idempotency-replayed"), Some("true"));
    assert_eq!(retry.header("idempotency-ttl"), None);
}

/// `idem openapi` on `config` with `env` set, checked by the OpenAPI
/// validator; `None` (a loud skip) without it.
pub(super) fn validated_openapi(
    dir: &Path,
    config: &str,
    env: &[(&str, &str)],
) -> Option<serde_json::Value> {
    let python = idem_testkit::services::python_with(&["openapi_spec_validator"])?;
    let file = dir.join("idem.toml");
    std::fs::write(&file, config).expect("write config");
    let out = std::process::Command::new(IDEM)
        .arg("openapi")
        .arg("--config")
        .arg(&file)
        .env_remove("IDEM_UPSTREAM")
        .envs(env.iter().copied())
        .output()
        .expect("run idem openapi");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let document = dir.join("openapi.json");
    std::fs::write(&document, &out.stdout).expect("write document");
    let valid = std::process::Command::new(&python)
        .args(["-m", "openapi_spec_validator"])
        .arg(&document)
        .output()
        .expect("run openapi-spec-validator");
    assert!(
        valid.status.success(),
        "{}{}",
        String::from_utf8_lossy(&valid.stdout),
        String::from_utf8_lossy(&valid.stderr)
    );
    Some(serde_json::from_slice(&out.stdout).expect("json"))
}

/// `idem openapi` prints a document a standard OpenAPI 3.1 validator
/// accepts, and the serving listener publishes the same document at
/// `contract_path`, unauthenticated, never forwarding the request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_contract_is_published_as_valid_openapi() {
    let dir = tempfile::tempdir().expect("temp dir");
    let Some(printed) = validated_openapi(dir.path(), CONFIG, &[]) else {
        return;
    };
    let ship = &printed["paths"]["/v1/orders/{id}/ship"]["post"];
    assert_eq!(ship["x-idempotency"]["key"]["format"], "uuidv7");
    assert_eq!(ship["x-idempotency"]["retention_seconds"], 129_600);
    assert_eq!(ship["parameters"][1]["required"], true);

    let up = CountingUpstream::start().await;
    let gw = start(dir.path(), &up).await;
    let served = send(gw.addr, Method::GET, "/.well-known/idempotency", &[], "").await;
    assert_eq!(served.status, StatusCode::OK);
    assert_eq!(
        served.header("content-type"),
        Some("application/openapi+json")
    );
    let served: serde_json::Value = serde_json::from_slice(&served.body).expect("json");
    assert_eq!(served, printed);
    let post = send(gw.addr, Method::POST, "/.well-known/idempotency", &[], "").await;
    assert_eq!(post.status, StatusCode::METHOD_NOT_ALLOWED);
    assert_eq!(up.total(), 0, "the document never reaches the upstream");
}

/// The README's `idem.toml`, as a newcomer copies it, gives a valid
/// document whose one route requires its key.
#[test]
fn the_readme_config_gives_a_valid_document() {
    let readme = include_str!("../../../../README.md");
    let start = readme
        .find("```toml\nupstream =")
        .expect("the README's idem.toml")
        + "```toml\n".len();
    let end = start + readme[start..].find("```").expect("its end");
    let dir = tempfile::tempdir().expect("temp dir");
    let Some(doc) = validated_openapi(dir.path(), &readme[start..end], &[]) else {
        return;
    };
    let payments = &doc["paths"]["/v1/payments"]["post"];
    assert_eq!(payments["parameters"][0]["name"], "Idempotency-Key");
    assert_eq!(payments["parameters"][0]["required"], true);
    assert_eq!(payments["x-idempotency"]["retention_seconds"], 86_400);
}
