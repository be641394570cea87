//! The GraphQL door with a real server and client: a Strawberry payments
//! service behind uvicorn whose `createPayment` writes one ledger line
//! per run (`tests/clients/graphql_server.py`), behind `idem serve` with
//! a `protocol = "graphql"` route; the `gql` client
//! (`tests/clients/graphql_client.py`) creates each payment three times
//! at once, after a dropped answer, written with other whitespace and
//! variables in another order, from a document of two operations, and
//! with a changed amount. Every payment runs once, every replay is the
//! run's answer, queries pass unrecorded, and a changed request is
//! refused in a GraphQL error the client reads.

use idem_testkit::gateway::{listed_records, sqlite_store};
use idem_testkit::peers::python_report;
use serde_json::Value;

const IDEM: &str = env!("CARGO_BIN_EXE_idem");
const SERVER: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/clients/graphql_server.py"
);
const CLIENT: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/clients/graphql_client.py"
);

const CONFIG: &str = r#"
[[route]]
method = "POST"
path = "/graphql"
protocol = "graphql"
key_from = "/variables/idempotencyKey"
"#;

/// The GraphQL server, behind `idem serve` with [`CONFIG`]; `None` (a loud
/// skip) without its Python peers.
async fn behind_idem() -> Option<super::Behind> {
    super::python_service_behind_idem(
        &["strawberry.asgi", "uvicorn", "gql.transport.requests"],
        SERVER,
        CONFIG,
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gql_clients_retries_create_each_payment_once() {
    let Some((python, dir, _server, gw)) = behind_idem().await else {
        return;
    };
    const PAYMENTS: usize = 24;
    let url = format!("http://{}/graphql", gw.addr);
    let report = python_report(&python, CLIENT, &[&url, &PAYMENTS.to_string()]).await;
    let answers = report["answers"].as_object().expect("answers");
    let parsed: usize = answers
        .values()
        .map(|a| a.as_array().map_or(0, Vec::len))
        .sum();
    let keys = PAYMENTS + PAYMENTS.div_ceil(4);
    let lines = super::ledger(dir.path());
    let distinct: std::collections::BTreeSet<&String> = lines.iter().collect();
    eprintln!(
        "gql client: {} calls, {} distinct keys, {parsed} answers parsed by gql, refusals {}, {} answers dropped by the client; ledger: {} side effects",
        report["calls"],
        answers.len(),
        report["refused"],
        report["timeouts"],
        lines.len()
    );
    assert_eq!(answers.len(), keys, "{report}");
    // Every answer a key got is its one run's: the same payment id, five
    // times over (three at once, respelled, from two operations); once
    // for the answer of a dropped one.
    for (key, got) in answers {
        let got = got.as_array().expect("list");
        let least = if key.ends_with("-slow") { 1 } else { 5 };
        assert!(got.len() >= least, "{key}: {got:?}");
        assert!(got.windows(2).all(|w| w[0] == w[1]), "{key}: {got:?}");
    }
    assert_eq!(
        report["refused"]["IDEMPOTENCY_KEY_REUSED"], PAYMENTS,
        "each changed amount refused: {report}"
    );
    assert_eq!(report["queries_passed"], PAYMENTS, "{report}");
    assert_eq!(
        report["batch_with_mutation"],
        serde_json::json!([400, "GRAPHQL_BATCH_REFUSED"])
    );
    // The ledger: one line per key, none twice.
    assert_eq!(lines.len(), keys, "{lines:?}");
    assert_eq!(
        distinct.len(),
        lines.len(),
        "a payment ran twice: {lines:?}"
    );
    assert_eq!(report["ledger_length"], keys);
    // Only mutations were recorded: one record per key, none for the
    // queries sent with the same keys.
    let records = listed_records(IDEM, &sqlite_store(dir.path()), &[]);
    assert_eq!(records.len(), keys, "{records:?}");
    assert!(
        records
            .iter()
            .all(|r| r["operation"] == "POST /graphql mutation Create"),
        "{records:?}"
    );
}

/// What each GraphQL answer does to its key: a request error (no `data`,
/// no error with a `path`: it never ran) releases it, so the corrected
/// request runs; a field error at the root (`data: null`, an error with a
/// `path`: a resolver failed after it began) holds it; `data` is stored
/// and replayed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn graphql_answers_release_hold_or_store_their_keys() {
    let Some((_, dir, _server, gw)) = behind_idem().await else {
        return;
    };
    let ask = async |key: &str, query: &str, variables: Value| {
        let body = serde_json::json!({"query": query, "variables": variables}).to_string();
        let answer = gw
            .post(
                "/graphql",
                &[
                    ("content-type", "application/json"),
                    ("idempotency-key", key),
                ],
                &body,
            )
            .await;
        let json: Value = serde_json::from_slice(&answer.body).expect("a GraphQL answer");
        (answer.status.as_u16(), json)
    };
    // A request error: the field does not exist. Nothing ran; released.
    let wrong =
        "mutation Create($order: String!) { createPayment(order: $order, cents: 1) { nope } }";
    let right =
        "mutation Create($order: String!) { createPayment(order: $order, cents: 1) { id } }";
    let vars = serde_json::json!({"order": "o-release"});
    let (_, first) = ask("k-release", wrong, vars.clone()).await;
    assert!(first["errors"][0].get("path").is_none(), "{first}");
    assert!(first["errors"][0]["message"].is_string(), "{first}");
    let (status, ran) = ask("k-release", right, vars.clone()).await;
    assert_eq!(status, 200, "{ran}");
    let id = ran["data"]["createPayment"]["id"].clone();
    assert!(id.is_string(), "{ran}");
    let (_, again) = ask("k-release", right, vars).await;
    assert_eq!(again["data"]["createPayment"]["id"], id, "replayed");

    // A resolver that fails after its side effect: held, never run again.
    let fail = "mutation Fail { failPayment(order: \"o-held\") { id } }";
    let (_, failed) = ask("k-held", fail, serde_json::json!({})).await;
    assert_eq!(failed["data"], Value::Null, "{failed}");
    assert_eq!(
        failed["errors"][0]["path"],
        serde_json::json!(["failPayment"])
    );
    let (status, held) = ask("k-held", fail, serde_json::json!({})).await;
    assert_eq!(status, 409, "{held}");
    assert_eq!(
        held["errors"][0]["extensions"]["code"], "IDEMPOTENCY_OUTCOME_HELD",
        "{held}"
    );
    let lines = super::ledger(dir.path());
    assert_eq!(
        lines
            .iter()
            .filter(|l| l.as_str() == "o-held failed")
            .count(),
        1,
        "{lines:?}"
    );
    // A query with a key passes, unrecorded.
    let (status, look) = ask("k-look", "{ payments }", serde_json::json!({})).await;
    assert_eq!(status, 200, "{look}");
    let records = listed_records(IDEM, &sqlite_store(dir.path()), &[]);
    let mut states: Vec<(String, String, bool)> = records
        .iter()
        .map(|r| {
            (
                r["key"].as_str().expect("key").to_owned(),
                r["state"].as_str().expect("state").to_owned(),
                r["outcome_unknown"] == true,
            )
        })
        .collect();
    states.sort();
    assert_eq!(
        states,
        [
            ("k-held".to_owned(), "processing".to_owned(), true),
            ("k-release".to_owned(), "completed".to_owned(), false)
        ],
        "{records:?}"
    );
}

/// `idem openapi` states a GraphQL route's key places and its refusals as
/// GraphQL errors, in a document the validator accepts.
#[tokio::test]
async fn the_openapi_document_states_a_graphql_routes_keys() {
    let dir = tempfile::tempdir().expect("temp dir");
    let config = format!("upstream = \"http://127.0.0.1:9\"\n{CONFIG}");
    let Some(doc) = super::profiles::validated_openapi(dir.path(), &config, &[]) else {
        return;
    };
    let op = &doc["paths"]["/graphql"]["post"];
    let gql = &op["x-idempotency"]["graphql"];
    assert_eq!(gql["protects"], "mutation");
    assert_eq!(gql["key_headers"], serde_json::json!(["Idempotency-Key"]));
    assert_eq!(
        gql["key_fields"],
        serde_json::json!(["/variables/idempotencyKey"])
    );
    let reused = &op["responses"]["422"]["content"]["application/json"]["schema"];
    assert_eq!(
        reused["properties"]["errors"]["items"]["properties"]["extensions"]["properties"]["code"]["enum"],
        serde_json::json!(["IDEMPOTENCY_KEY_REUSED"]),
        "{op}"
    );
    let bad = &op["responses"]["400"]["content"]["application/json"]["schema"];
    let codes = bad["properties"]["errors"]["items"]["properties"]["extensions"]["properties"]
        ["code"]["enum"]
        .as_array()
        .expect("codes");
    assert!(
        codes.contains(&serde_json::json!("GRAPHQL_BATCH_REFUSED")),
        "{op}"
    );
}
