//! The agent door with the official MCP Python SDK on both sides: an MCP
//! server over Streamable HTTP whose `charge` tool writes one ledger line
//! per run (`tests/clients/mcp_server.py`), behind `idem serve` with a
//! `protocol = "jsonrpc"` route; an agent (`tests/clients/mcp_agent.py`)
//! calls it with one key per payment three times at once, after a
//! dropped answer, on a fresh session, and with changed arguments, in
//! the SDK's session mode (answers as event streams) and its sessionless
//! mode (answers as JSON). Every payment is charged once, the
//! SDK parses every replay, and a changed call is refused.

use idem_testkit::gateway::GatewayProcess;
use idem_testkit::peers::{python_report, python_service};

const IDEM: &str = env!("CARGO_BIN_EXE_idem");
const SERVER: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/clients/mcp_server.py");
const AGENT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/clients/mcp_agent.py");

const CONFIG: &str = r#"
[[route]]
method = "POST"
path = "/mcp"
protocol = "jsonrpc"

[[route.call]]
method = "tools/call"
tools = ["charge"]
require_key = true
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_mcp_agents_retries_charge_each_payment_once() {
    let Some(python) = idem_testkit::services::python_with(&["mcp"]) else {
        return;
    };
    let dir = tempfile::tempdir().expect("temp dir");
    let (_server, server) = python_service(&python, SERVER, dir.path(), "mcp.log").await;
    let gw = GatewayProcess::builder(IDEM, dir.path())
        .config(CONFIG)
        .upstream(&format!("http://{server}"))
        .start()
        .await;
    const PAYMENTS: usize = 20;
    let mut keys = 0;
    for mode in ["legacy", "auto"] {
        let url = format!("http://{}/mcp", gw.addr);
        let report = python_report(&python, AGENT, &[&url, &PAYMENTS.to_string(), mode]).await;
        let answers = report["answers"].as_object().expect("answers");
        let parsed: usize = answers
            .values()
            .map(|a| a.as_array().map_or(0, Vec::len))
            .sum();
        eprintln!(
            "MCP agent ({mode}): {} calls, {} distinct keys, {parsed} answers parsed by the SDK, refusals {}, {} answers dropped by the agent",
            report["calls"],
            answers.len(),
            report["refused"],
            report["timeouts"]
        );
        // Every answer a key got is the one run's answer.
        for (key, got) in answers {
            let got = got.as_array().expect("list");
            assert!(got.windows(2).all(|w| w[0] == w[1]), "{key}: {got:?}");
        }
        assert_eq!(answers.len(), PAYMENTS + PAYMENTS.div_ceil(4), "{report}");
        assert_eq!(
            report["refused"]["-31003"], PAYMENTS,
            "each changed call refused: {report}"
        );
        keys += answers.len();
    }
    // The ledger: one line per key, none twice.
    let ledger = std::fs::read_to_string(dir.path().join("ledger")).expect("ledger");
    let lines: Vec<&str> = ledger.lines().collect();
    let distinct: std::collections::BTreeSet<&str> = lines.iter().copied().collect();
    eprintln!("ledger: {} charges for {keys} keys", lines.len());
    assert_eq!(lines.len(), keys, "{ledger}");
    assert_eq!(
        distinct.len(),
        lines.len(),
        "a payment charged twice: {ledger}"
    );
}

const RPC_SERVER: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/clients/jsonrpc_server.py"
);
const RPC_CLIENT: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/clients/jsonrpc_client.py"
);

/// A plain JSON-RPC 2.0 service and client (`jsonrpcserver`,
/// `jsonrpcclient`): each payment retried with new call ids, twice at
/// once, is charged once and every answer carries its own call's id; a
/// batch holding a payment is refused whole, a batch of reads and a
/// notification pass through as JSON-RPC has them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plain_json_rpc_clients_retries_charge_each_payment_once() {
    let Some(python) =
        idem_testkit::services::python_with(&["jsonrpcserver", "jsonrpcclient", "requests"])
    else {
        return;
    };
    let dir = tempfile::tempdir().expect("temp dir");
    let (_server, addr) = python_service(&python, RPC_SERVER, dir.path(), "rpc.log").await;
    let config = r#"
[[route]]
method = "POST"
path = "/rpc"
protocol = "jsonrpc"

[[route.call]]
method = "payments.create"
key_field = "/params/idempotency_key"
require_key = true
"#;
    let gw = GatewayProcess::builder(IDEM, dir.path())
        .config(config)
        .upstream(&format!("http://{addr}"))
        .start()
        .await;
    const PAYMENTS: usize = 20;
    let url = format!("http://{}/rpc", gw.addr);
    let report = python_report(&python, RPC_CLIENT, &[&url, &PAYMENTS.to_string()]).await;
    eprintln!("JSON-RPC client: {report}");
    let answers = report["answers"].as_object().expect("answers");
    assert_eq!(answers.len(), PAYMENTS);
    for (key, got) in answers {
        let got = got.as_array().expect("list");
        assert_eq!(got.len(), 3, "{key}");
        assert!(got.windows(2).all(|w| w[0] == w[1]), "{key}: {got:?}");
    }
    assert_eq!(
        report["ids_matched"], true,
        "every answer carries its call's id"
    );
    assert_eq!(report["refused"]["-31003"], PAYMENTS);
    assert_eq!(report["batch_with_payment"], -31008);
    assert_eq!(report["batch_of_reads"], serde_json::json!([PAYMENTS]));
    assert_eq!(report["notification"], serde_json::json!([204, ""]));
    let ledger = std::fs::read_to_string(dir.path().join("ledger")).expect("ledger");
    assert_eq!(ledger.lines().count(), PAYMENTS, "{ledger}");
}

/// `idem openapi` states a JSON-RPC route's methods, where their keys
/// are and its error codes, in a document the validator accepts.
#[tokio::test]
async fn the_openapi_document_states_a_json_rpc_routes_methods() {
    let dir = tempfile::tempdir().expect("temp dir");
    let config = format!("upstream = \"http://127.0.0.1:9\"\n{CONFIG}");
    let Some(doc) = super::profiles::validated_openapi(dir.path(), &config, &[]) else {
        return;
    };
    let op = &doc["paths"]["/mcp"]["post"];
    let rpc = &op["x-idempotency"]["jsonrpc"];
    assert_eq!(
        rpc["methods"],
        serde_json::json!([{
            "method": "tools/call",
            "tools": {"only": ["charge"]},
            "key_headers": ["Idempotency-Key"],
            "key_fields": ["/params/_meta/idempotencyKey"],
            "require_key": true,
        }])
    );
    assert_eq!(rpc["error_codes"]["idempotency-key-reused"], -31003);
    assert!(op["responses"].get("409").is_none(), "{op}");
}
