//! Traces over OpenTelemetry, against a real OTLP/HTTP receiver (testkit's
//! `OtlpReceiver`, decoding what the gateway's exporter sends with the
//! protocol definitions): the server span continues the caller's
//! `traceparent`, the store operations and the upstream call are its
//! children, the upstream gets the gateway's span as its parent, a replay
//! has no upstream span, keys stay out unless `trace_keys`, credentials
//! always; sampling follows the caller's choice; a collector that is down
//! costs no request.

use std::path::Path;
use std::time::Duration;

use idem_testkit::client::Answer;
use idem_testkit::gateway::GatewayProcess;
use idem_testkit::otlp::{CLIENT, OtlpReceiver, ReceivedSpan, SERVER};
use idem_testkit::upstream::CountingUpstream;
use tempfile::TempDir;

const IDEM: &str = env!("CARGO_BIN_EXE_idem");

const ROUTES: &str = r#"
[[route]]
method = "POST"
path = "/v1/payments"
require_key = true
"#;

const TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const PARENT: &str = "00f067aa0ba902b7";

/// A receiver, an upstream, and a gateway exporting to the receiver with
/// `extra` lines under `[telemetry]`.
async fn traced(extra: &str) -> (OtlpReceiver, CountingUpstream, TempDir, GatewayProcess) {
    let receiver = OtlpReceiver::start().await;
    let upstream = CountingUpstream::start().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let telemetry = format!("otlp_endpoint = \"{}\"\n{extra}", receiver.url());
    let gw = gateway(dir.path(), &upstream.url(), &telemetry).await;
    (receiver, upstream, dir, gw)
}

async fn gateway(dir: &Path, upstream: &str, telemetry: &str) -> GatewayProcess {
    GatewayProcess::builder(IDEM, dir)
        .config(&format!("[telemetry]\n{telemetry}\n{ROUTES}"))
        .upstream(upstream)
        .start()
        .await
}

async fn pay(gw: &GatewayProcess, key: &str, traceparent: Option<&str>) -> Answer {
    let mut headers = vec![
        ("idempotency-key", key),
        ("content-type", "application/json"),
        ("authorization", "Bearer sk_secret_credential"),
    ];
    if let Some(tp) = traceparent {
        headers.push(("traceparent", tp));
    }
    gw.post("/v1/payments", &headers, r#"{"amount":100}"#).await
}

fn in_trace<'a>(spans: &'a [ReceivedSpan], trace: &str) -> Vec<&'a ReceivedSpan> {
    spans.iter().filter(|s| s.trace_id == trace).collect()
}

/// A payment and its replay, each in a trace of its own, read back from
/// the receiver after the gateway flushed them at exit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_s_trace_continues_the_caller_s_and_reaches_the_upstream() {
    let (receiver, upstream, _dir, gw) = traced("service_name = \"payments-gw\"").await;

    let first = pay(&gw, "otel-1", Some(&format!("00-{TRACE}-{PARENT}-01"))).await;
    assert_eq!(first.status, 201, "{:?}", first.body);
    let sent = upstream.last_headers().expect("forwarded");
    let upstream_parent = sent
        .get("traceparent")
        .and_then(|v| v.to_str().ok())
        .expect("traceparent forwarded")
        .to_owned();
    let replay_trace = "0af7651916cd43dd8448eb211c80319c";
    let replay = pay(
        &gw,
        "otel-1",
        Some(&format!("00-{replay_trace}-b7ad6b7169203331-01")),
    )
    .await;
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    gw.terminate().await;
    let spans = receiver.wait_for(1, Duration::from_secs(10)).await;

    let ours = in_trace(&spans, TRACE);
    let server = ours
        .iter()
        .find(|s| s.kind == SERVER)
        .unwrap_or_else(|| panic!("a server span in the caller's trace: {spans:#?}"));
    assert_eq!(server.name, "POST /v1/payments", "{server:#?}");
    assert_eq!(server.parent_span_id, PARENT, "continues the caller's span");
    assert_eq!(server.service, "payments-gw");
    assert_eq!(server.attr("http.route"), Some("POST /v1/payments"));
    assert_eq!(server.attr("idem.outcome"), Some("executed"));
    assert_eq!(server.attr("idem.record_state"), Some("completed"));
    assert_eq!(server.attr("http.response.status_code"), Some("201"));
    assert_eq!(server.attr("idem.key"), None, "keys stay out by default");
    for noise in ["code.file.path", "thread.name", "busy_ns", "target"] {
        assert_eq!(server.attr(noise), None, "{noise}: {server:#?}");
    }
    let children: Vec<&&ReceivedSpan> = ours
        .iter()
        .filter(|s| s.parent_span_id == server.span_id)
        .collect();
    let client = children
        .iter()
        .find(|s| s.name == "POST" && s.kind == CLIENT)
        .unwrap_or_else(|| panic!("an upstream span under the server span: {ours:#?}"));
    assert_eq!(client.attr("http.response.status_code"), Some("201"));
    assert_eq!(
        upstream_parent,
        format!("00-{TRACE}-{}-01", client.span_id),
        "the upstream's parent is the gateway's upstream span"
    );
    for op in ["reserve", "resolve"] {
        assert!(
            children
                .iter()
                .any(|s| s.name == op && s.attr("db.operation.name") == Some(op)),
            "a {op} store span under the server span: {ours:#?}"
        );
    }

    let theirs = in_trace(&spans, replay_trace);
    let replayed = theirs
        .iter()
        .find(|s| s.kind == SERVER)
        .unwrap_or_else(|| panic!("the replay's server span: {spans:#?}"));
    assert_eq!(replayed.attr("idem.outcome"), Some("replayed"));
    assert_eq!(replayed.attr("idem.record_state"), Some("completed"));
    assert!(
        theirs.iter().all(|s| s.kind != CLIENT || s.name != "POST"),
        "a replay calls no upstream, and its trace says none: {theirs:#?}"
    );
    for span in &spans {
        for (k, v) in &span.attributes {
            assert!(
                !v.contains("sk_secret_credential") && !v.contains("amount"),
                "no credential or body in {k}={v}"
            );
        }
    }
    assert!(
        receiver
            .requests()
            .iter()
            .all(|r| r == "POST /v1/traces application/x-protobuf"),
        "{:?}",
        receiver.requests()
    );
}

/// `trace_keys = true` puts the key on the server span; `sample_ratio =
/// 0` keeps no new trace, but a caller's sampled `traceparent` is
/// followed, and an unsampled one passes through untouched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_on_request_and_sampling_follows_the_caller() {
    let (receiver, upstream, _dir, gw) = traced("sample_ratio = 0.0\ntrace_keys = true").await;
    for i in 0..5 {
        assert_eq!(pay(&gw, &format!("unsampled-{i}"), None).await.status, 201);
    }
    // A caller that does not sample: no span, and its traceparent goes
    // upstream as it came.
    let unsampled = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00";
    assert_eq!(
        pay(&gw, "caller-unsampled", Some(unsampled)).await.status,
        201
    );
    let forwarded = upstream.last_headers().expect("forwarded");
    assert_eq!(
        forwarded.get("traceparent").and_then(|v| v.to_str().ok()),
        Some(unsampled)
    );
    let sampled = pay(&gw, "sampled-1", Some(&format!("00-{TRACE}-{PARENT}-01"))).await;
    assert_eq!(sampled.status, 201);
    gw.terminate().await;
    let spans = receiver.wait_for(1, Duration::from_secs(10)).await;
    assert!(
        spans.iter().all(|s| s.trace_id == TRACE),
        "only the caller's sampled trace: {spans:#?}"
    );
    let server = spans
        .iter()
        .find(|s| s.kind == SERVER)
        .expect("server span");
    assert_eq!(server.attr("idem.key"), Some("sampled-1"));
}

/// A collector that is not there: every request is answered as without
/// telemetry, and the gateway exits cleanly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_collector_that_is_down_costs_no_request() {
    let closed = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = closed.local_addr().expect("addr").port();
    drop(closed);
    let upstream = CountingUpstream::start().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let gw = gateway(
        dir.path(),
        &upstream.url(),
        &format!("otlp_endpoint = \"http://127.0.0.1:{port}\""),
    )
    .await;
    for i in 0..20 {
        let key = format!("nowhere-{}", i % 10);
        let a = pay(&gw, &key, None).await;
        assert_eq!(a.status, 201, "{:?}", a.body);
    }
    assert_eq!(upstream.total(), 10, "10 keys, each run once");
    let status = gw.terminate().await;
    assert!(status.success(), "{status:?}");
}
