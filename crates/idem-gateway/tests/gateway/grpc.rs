//! The gRPC door with real peers: a `grpcio` payments service whose
//! unary calls write one ledger line per run (`tests/clients/grpc_server.py`),
//! behind `idem serve` on cleartext HTTP/2, with a `protocol = "grpc"`
//! route per method; a `grpcio` client (`tests/clients/grpc_client.py`)
//! with a service config that retries `UNAVAILABLE` creates each payment
//! three times at once, after a cancelled call, and with a changed
//! message. Every payment runs once, replays carry the first run's
//! trailing metadata, a declined call is replayed with its status and
//! trailers, a crashed one is held, and a streaming call passes through.

use std::collections::BTreeSet;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use idem_testkit::gateway::{listed_records, sqlite_store};
use idem_testkit::peers::python_report;
use serde_json::Value;

const IDEM: &str = env!("CARGO_BIN_EXE_idem");
const SERVER: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/clients/grpc_server.py");
const CLIENT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/clients/grpc_client.py");

/// The service's unary methods, each a route of its own.
const CONFIG: &str = r#"
[[route]]
method = "POST"
path = "/pay.Payments/{method}"
protocol = "grpc"
"#;

/// The gRPC server, behind `idem serve` with [`CONFIG`]; `None` (a loud
/// skip) without its Python peers.
async fn behind_idem() -> Option<super::Behind> {
    super::python_service_behind_idem(&["grpc"], SERVER, CONFIG).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grpcio_clients_retries_create_each_payment_once() {
    let Some((python, dir, _server, gw)) = behind_idem().await else {
        return;
    };
    const PAYMENTS: usize = 24;
    let target = gw.addr.to_string();
    let report = python_report(&python, CLIENT, &[&target, &PAYMENTS.to_string()]).await;
    let answers = report["answers"].as_object().expect("answers");
    let lines = super::ledger(dir.path());
    let charged: Vec<&String> = lines
        .iter()
        .filter(|l| !l.ends_with(" declined") && !l.ends_with(" crashed"))
        .collect();
    let distinct: BTreeSet<&&String> = charged.iter().collect();
    eprintln!(
        "grpcio client: {} calls, {} distinct keys, refusals {}, {} calls cancelled by the client; ledger: {} charges",
        report["calls"],
        answers.len(),
        report["refused"],
        report["dropped"],
        charged.len(),
    );
    // Each Create key (and each slow and flaky one) has one id, however
    // many answers it got.
    let creates = PAYMENTS + PAYMENTS.div_ceil(4) + PAYMENTS / 4;
    assert_eq!(answers.len(), creates, "{report}");
    for (key, got) in answers {
        let got = got.as_array().expect("list");
        let least = if key.starts_with("grpc-pay-") && !key.ends_with("-slow") {
            3
        } else {
            1
        };
        assert!(got.len() >= least, "{key}: {got:?}");
        assert!(got.windows(2).all(|w| w[0] == w[1]), "{key}: {got:?}");
    }
    assert_eq!(report["trailer_mismatch"], 0, "{report}");
    assert_eq!(
        report["refused"]["FAILED_PRECONDITION"], PAYMENTS,
        "each changed message refused: {report}"
    );
    // One charge per key: the flaky calls' UNAVAILABLE released their
    // keys, and the client's retry policy ran them once.
    assert_eq!(charged.len(), creates, "{lines:?}");
    assert_eq!(distinct.len(), charged.len(), "charged twice: {lines:?}");
    // A declined call is stored: the retry gets the same status, message
    // and trailing metadata, and the decline ran once.
    let declines = report["declines"].as_object().expect("declines");
    assert_eq!(declines.len(), PAYMENTS / 4, "{report}");
    for (key, got) in declines {
        let got = got.as_array().expect("two");
        assert_eq!(got.len(), 2, "{key}");
        assert_eq!(got[0], got[1], "{key}: the replay is the first answer");
        assert_eq!(got[0][0], "INVALID_ARGUMENT", "{key}");
        assert!(
            got[0][2]
                .as_array()
                .expect("trailers")
                .contains(&serde_json::json!(["decline-code", "insufficient_funds"])),
            "{key}: {got:?}"
        );
    }
    assert_eq!(
        lines.iter().filter(|l| l.ends_with(" declined")).count(),
        PAYMENTS / 4
    );
    // A crash after the charge is held: never run again.
    assert_eq!(report["crash"], "UNKNOWN");
    assert_eq!(
        report["crash_retry"],
        serde_json::json!(["ABORTED", "idempotency-outcome-held"])
    );
    assert_eq!(lines.iter().filter(|l| l.ends_with(" crashed")).count(), 1);
    // A server-streaming call passed through whole.
    assert_eq!(report["stream"], 3);
    let records = listed_records(IDEM, &sqlite_store(dir.path()), &[]);
    let held: Vec<&Value> = records
        .iter()
        .filter(|r| r["outcome_unknown"] == true)
        .collect();
    assert_eq!(held.len(), 1, "{held:?}");
    assert_eq!(held[0]["operation"], "POST /pay.Payments/{method}");
}

/// One gRPC frame holding `message`: uncompressed, its length big-endian.
fn frame(message: &[u8]) -> Bytes {
    let mut out = vec![0u8];
    out.extend_from_slice(&u32::try_from(message.len()).expect("small").to_be_bytes());
    out.extend_from_slice(message);
    Bytes::from(out)
}

/// One call by a plain HTTP/2 client: the answer's head, its bytes and
/// its trailers.
async fn wire_call(
    h2: &mut hyper::client::conn::http2::SendRequest<Full<Bytes>>,
    addr: std::net::SocketAddr,
    method: &str,
    key: &str,
    message: &str,
    extra: &[(&str, &str)],
) -> (http::response::Parts, Bytes, http::HeaderMap) {
    let mut req = http::Request::builder()
        .method("POST")
        .uri(format!("http://{addr}/pay.Payments/{method}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .header("authorization", "Bearer grpc-wire")
        .header("idempotency-key", key);
    for (name, value) in extra {
        req = req.header(*name, *value);
    }
    let req = req
        .body(Full::new(frame(message.as_bytes())))
        .expect("request");
    let resp = h2.send_request(req).await.expect("HTTP/2 answer");
    let (parts, body) = resp.into_parts();
    let collected = body.collect().await.expect("body");
    let trailers = collected.trailers().cloned().unwrap_or_default();
    (parts, collected.to_bytes(), trailers)
}

/// A replay, seen on the wire by a plain HTTP/2 client: the same status,
/// headers, message bytes and trailers as the first answer, plus the
/// replay's own marker; refusals are trailers-only answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_is_the_first_answer_byte_for_byte() {
    let Some((_, _dir, _server, gw)) = behind_idem().await else {
        return;
    };
    let mut h2 = idem_testkit::client::h2c(gw.addr).await;
    let addr = gw.addr;
    let mut call = async |method: &str, key: &str, message: &str| {
        wire_call(&mut h2, addr, method, key, message, &[]).await
    };
    let (first, first_body, first_trailers) =
        call("Create", "wire-1", r#"{"order":"w-1","cents":5}"#).await;
    let (again, again_body, again_trailers) =
        call("Create", "wire-1", r#"{"order":"w-1","cents":5}"#).await;
    assert_eq!(first.status, 200);
    assert_eq!(first_trailers["grpc-status"], "0");
    assert!(
        first_trailers.contains_key("payment-id"),
        "{first_trailers:?}"
    );
    assert_eq!(first_body, again_body, "the message bytes");
    assert_eq!(first_trailers, again_trailers, "the trailers");
    assert_eq!(again.headers["idempotent-replayed"], "true");
    let mut marked = again.headers.clone();
    marked.remove("idempotent-replayed");
    marked.remove("date");
    let mut unmarked = first.headers.clone();
    unmarked.remove("date");
    assert_eq!(unmarked, marked, "the headers, the replay's marker aside");
    // The same key with another message: a trailers-only refusal.
    let (reused, reused_body, reused_trailers) =
        call("Create", "wire-1", r#"{"order":"w-1","cents":6}"#).await;
    assert_eq!(reused.status, 200);
    assert_eq!(reused.headers["content-type"], "application/grpc");
    assert_eq!(reused.headers["grpc-status"], "9", "FAILED_PRECONDITION");
    assert_eq!(reused.headers["idem-problem"], "idempotency-key-reused");
    assert!(reused_body.is_empty() && reused_trailers.is_empty());
    // A key that cannot be one: INVALID_ARGUMENT, nothing run.
    let (bad, _, _) = call("Create", "  ", r#"{"order":"w-2","cents":5}"#).await;
    assert_eq!(bad.headers["grpc-status"], "3", "{bad:?}");
}

/// A call whose `grpc-timeout` passes while the server runs it gets
/// `DEADLINE_EXCEEDED`, and its key is held: the retry is refused as
/// held, never run again. A server-streaming method under a route is
/// stored whole, its three messages and trailers replayed as sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deadlines_hold_and_streamed_answers_are_kept_whole() {
    let Some((_, dir, _server, gw)) = behind_idem().await else {
        return;
    };
    let mut h2 = idem_testkit::client::h2c(gw.addr).await;
    let slow = r#"{"order":"w-slow","cents":7,"delay_ms":800}"#;
    let deadline = [("grpc-timeout", "200m")];
    let (late, _, _) = wire_call(&mut h2, gw.addr, "Create", "wire-late", slow, &deadline).await;
    assert_eq!(
        late.headers["grpc-status"], "4",
        "DEADLINE_EXCEEDED: {late:?}"
    );
    let (again, _, _) = wire_call(&mut h2, gw.addr, "Create", "wire-late", slow, &[]).await;
    assert_eq!(again.headers["grpc-status"], "10", "ABORTED: {again:?}");
    assert_eq!(again.headers["idem-problem"], "idempotency-outcome-held");
    // The server ran it once, after the gateway stopped waiting.
    idem_testkit::wait::eventually("the slow call's charge", async || {
        super::ledger(dir.path()).iter().any(|l| l == "w-slow 7")
    })
    .await;
    assert_eq!(
        super::ledger(dir.path())
            .iter()
            .filter(|l| l.as_str() == "w-slow 7")
            .count(),
        1
    );
    let (_, first_body, first_trailers) =
        wire_call(&mut h2, gw.addr, "Watch", "wire-watch", "{}", &[]).await;
    let (replay, replay_body, replay_trailers) =
        wire_call(&mut h2, gw.addr, "Watch", "wire-watch", "{}", &[]).await;
    assert_eq!(first_trailers["grpc-status"], "0");
    assert_eq!(replay.headers["idempotent-replayed"], "true");
    assert_eq!(first_body, replay_body, "three messages, as sent");
    assert_eq!(
        first_body.iter().filter(|b| **b == b'{').count(),
        3,
        "{first_body:?}"
    );
    assert_eq!(first_trailers, replay_trailers);
}

/// `idem openapi` and `idem check` aside, the configuration: a gRPC route
/// takes POST only, and an `https://` upstream agrees on HTTP/2 by ALPN.
#[tokio::test]
async fn a_grpc_route_is_checked_at_start() {
    let dir = tempfile::tempdir().expect("temp dir");
    let config = "upstream = \"http://127.0.0.1:9\"\n[[route]]\nmethod = \"GET\"\npath = \"/pay.Payments/Create\"\nprotocol = \"grpc\"\n";
    let path = dir.path().join("idem.toml");
    std::fs::write(&path, config).expect("write");
    let out = tokio::process::Command::new(IDEM)
        .args(["openapi", "--config"])
        .arg(&path)
        .output()
        .await
        .expect("run idem");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("a gRPC route takes POST"), "{err}");
}

/// JSON messages for tonic's generic client: the payments service's own
/// encoding (it has no protobuf schema).
#[derive(Debug, Clone, Copy, Default)]
struct JsonCodec;

impl tonic::codec::Codec for JsonCodec {
    type Encode = Value;
    type Decode = Value;
    type Encoder = JsonCodec;
    type Decoder = JsonCodec;

    fn encoder(&mut self) -> Self::Encoder {
        *self
    }

    fn decoder(&mut self) -> Self::Decoder {
        *self
    }
}

impl tonic::codec::Encoder for JsonCodec {
    type Item = Value;
    type Error = tonic::Status;

    fn encode(
        &mut self,
        item: Value,
        dst: &mut tonic::codec::EncodeBuf<'_>,
    ) -> Result<(), tonic::Status> {
        use bytes::BufMut as _;
        dst.put_slice(&serde_json::to_vec(&item).expect("json"));
        Ok(())
    }
}

impl tonic::codec::Decoder for JsonCodec {
    type Item = Value;
    type Error = tonic::Status;

    fn decode(
        &mut self,
        src: &mut tonic::codec::DecodeBuf<'_>,
    ) -> Result<Option<Value>, tonic::Status> {
        use bytes::Buf as _;
        let bytes = src.copy_to_bytes(src.remaining());
        serde_json::from_slice(&bytes)
            .map(Some)
            .map_err(|e| tonic::Status::internal(e.to_string()))
    }
}

/// A tonic client (Rust): each payment's three concurrent calls and its
/// retry get one payment and its trailing metadata; a call refused as in
/// flight says when to come back; a changed message gets
/// `FAILED_PRECONDITION`, a declined card its `INVALID_ARGUMENT` again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tonic_clients_calls_run_once() {
    let Some((_, dir, _server, gw)) = behind_idem().await else {
        return;
    };
    let channel = tonic::transport::Channel::from_shared(format!("http://{}", gw.addr))
        .expect("uri")
        .connect()
        .await
        .expect("connect");
    let call = async |method: &'static str,
                      key: String,
                      message: Value|
           -> Result<tonic::Response<Value>, tonic::Status> {
        loop {
            let mut client = tonic::client::Grpc::new(channel.clone());
            client.ready().await.expect("ready");
            let mut req = tonic::Request::new(message.clone());
            req.metadata_mut()
                .insert("idempotency-key", key.parse().expect("key"));
            req.metadata_mut()
                .insert("authorization", "Bearer tonic-1".parse().expect("auth"));
            let path = http::uri::PathAndQuery::from_static(method);
            match client.unary(req, path, JsonCodec).await {
                Err(status)
                    if status.code() == tonic::Code::Aborted
                        && status.metadata().get("idem-problem").map(|v| v.as_bytes())
                            == Some(b"idempotency-request-in-progress") =>
                {
                    let wait: u64 = status
                        .metadata()
                        .get("grpc-retry-pushback-ms")
                        .and_then(|v| v.to_str().ok()?.parse().ok())
                        .unwrap_or(100);
                    tokio::time::sleep(std::time::Duration::from_millis(wait.max(80) / 4)).await;
                }
                answer => return answer,
            }
        }
    };
    const PAYMENTS: usize = 12;
    for n in 0..PAYMENTS {
        let key = format!("tonic-pay-{n}");
        let message = serde_json::json!({"order": format!("tonic-{n}"), "cents": 300 + n});
        let answers = futures_util::future::join_all(
            (0..3).map(|_| call("/pay.Payments/Create", key.clone(), message.clone())),
        )
        .await;
        let ids: Vec<(Value, String)> = answers
            .into_iter()
            .map(|a| {
                let resp = a.expect("a payment");
                let trailer = resp
                    .metadata()
                    .get("payment-id")
                    .expect("trailing metadata");
                let trailer = trailer.to_str().expect("ascii").to_owned();
                (resp.into_inner()["id"].clone(), trailer)
            })
            .collect();
        assert!(ids.windows(2).all(|w| w[0] == w[1]), "{key}: {ids:?}");
        assert_eq!(ids[0].0, ids[0].1.as_str(), "the trailer names the payment");
        let changed = serde_json::json!({"order": format!("tonic-{n}"), "cents": 1});
        let refused = call("/pay.Payments/Create", key.clone(), changed)
            .await
            .expect_err("another message under the key");
        assert_eq!(
            refused.code(),
            tonic::Code::FailedPrecondition,
            "{refused:?}"
        );
    }
    let decline = serde_json::json!({"order": "tonic-decline"});
    let first = call(
        "/pay.Payments/Decline",
        "tonic-decline".into(),
        decline.clone(),
    )
    .await
    .expect_err("declined");
    let again = call("/pay.Payments/Decline", "tonic-decline".into(), decline)
        .await
        .expect_err("declined again");
    assert_eq!(
        (first.code(), first.message()),
        (tonic::Code::InvalidArgument, "card declined")
    );
    assert_eq!(
        (again.code(), again.message()),
        (first.code(), first.message())
    );
    assert_eq!(
        again.metadata().get("decline-code"),
        first.metadata().get("decline-code")
    );
    let lines = super::ledger(dir.path());
    eprintln!(
        "tonic client: {} payments, 3 calls each and a changed one; ledger: {} lines",
        PAYMENTS,
        lines.len()
    );
    assert_eq!(lines.len(), PAYMENTS + 1, "{lines:?}");
}
