//! Judging calls, the fingerprint's view of a call, refusals as error
//! objects, replays given the retry's id, and what an answer's error
//! means for its record.

use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, HeaderValue};

use super::*;

fn mcp() -> JsonRpc {
    JsonRpc::new(vec![
        MethodRule::new(TOOLS_CALL)
            .with_tools(Tools::Deny(vec!["search".to_owned()]))
            .with_require_key(true),
        MethodRule::new("payments.create")
            .with_key_pointers(vec!["/params/idempotency_key".parse().expect("pointer")]),
    ])
}

fn judge(body: &str) -> Judged {
    mcp().judge(&HeaderMap::new(), body.as_bytes())
}

fn protect(body: &str) -> Call {
    match judge(body) {
        Judged::Protect(call) => call,
        other => panic!("{body}: {other:?}"),
    }
}

#[test]
fn a_tool_call_is_keyed_by_its_meta_and_named_by_its_tool() {
    let call = protect(
        r#"{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"charge","arguments":{"cents":500},"_meta":{"idempotencyKey":"k-1","progressToken":3}}}"#,
    );
    assert_eq!(call.key.as_str(), "k-1");
    assert_eq!(call.operation, "tools/call charge");
    assert_eq!(call.id, Bytes::from_static(b"7"));
    // A retry: another id, another progress token, another session, the
    // arguments' members in another order: the same call.
    let retry = protect(
        r#"{"params":{"arguments":{"cents":500},"_meta":{"progressToken":"p-9","idempotencyKey":"k-1"},"name":"charge"},"method":"tools/call","id":"retry-2","jsonrpc":"2.0"}"#,
    );
    assert_eq!(retry.fingerprinted, call.fingerprinted);
    assert_eq!(retry.id, Bytes::from_static(b"\"retry-2\""));
    // Other arguments: another call.
    let other = protect(
        r#"{"jsonrpc":"2.0","id":8,"method":"tools/call","params":{"name":"charge","arguments":{"cents":501},"_meta":{"idempotencyKey":"k-1"}}}"#,
    );
    assert_ne!(other.fingerprinted, call.fingerprinted);
}

#[test]
fn the_key_may_be_a_header_or_a_field_of_the_call_which_the_fingerprint_leaves_out() {
    let body = r#"{"jsonrpc":"2.0","id":1,"method":"payments.create","params":{"amount":5,"idempotency_key":"pay-1"}}"#;
    let call = protect(body);
    assert_eq!(call.key.as_str(), "pay-1");
    let moved = r#"{"jsonrpc":"2.0","id":2,"method":"payments.create","params":{"amount":5}}"#;
    let mut headers = HeaderMap::new();
    headers.insert("idempotency-key", HeaderValue::from_static("pay-1"));
    match mcp().judge(&headers, moved.as_bytes()) {
        Judged::Protect(c) => {
            assert_eq!(c.key.as_str(), "pay-1");
            assert_eq!(
                c.fingerprinted, call.fingerprinted,
                "the key's field is not the call's meaning"
            );
        }
        other => panic!("{other:?}"),
    }
    // Not required here: without a key the call passes unprotected.
    assert_eq!(judge(moved), Judged::Pass);
}

#[test]
fn what_passes_and_what_is_refused() {
    for body in [
        r#"{"jsonrpc":"2.0","id":1,"method":"tools/list"}"#,
        r#"{"jsonrpc":"2.0","id":1,"method":"initialize","params":{}}"#,
        r#"{"jsonrpc":"2.0","method":"notifications/initialized"}"#,
        r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"search","arguments":{}}}"#,
        r#"{"jsonrpc":"2.0","id":1,"result":{}}"#,
        r#"not json"#,
        r#"[{"jsonrpc":"2.0","id":1,"method":"tools/list"},{"jsonrpc":"2.0","method":"notifications/x"}]"#,
    ] {
        assert_eq!(judge(body), Judged::Pass, "{body}");
    }
    assert_eq!(
        judge(r#"{"jsonrpc":"2.0","method":"notifications/cancelled","params":{"requestId":3}}"#),
        Judged::Absorb
    );
    let refused = |body: &str| match judge(body) {
        Judged::Refuse { id, problem } => (id, problem.kind()),
        other => panic!("{body}: {other:?}"),
    };
    assert_eq!(
        refused(
            r#"{"jsonrpc":"2.0","id":"a","method":"tools/call","params":{"name":"charge","arguments":{}}}"#
        ),
        (Bytes::from_static(b"\"a\""), Some(ProblemKind::KeyMissing))
    );
    assert_eq!(
        refused(
            r#"{"jsonrpc":"2.0","id":3,"method":"tools/call","params":{"name":"charge","_meta":{"idempotencyKey":{"no":1}}}}"#
        ),
        (Bytes::from_static(b"3"), Some(ProblemKind::KeyInvalid))
    );
    assert_eq!(
        refused(r#"{"jsonrpc":"2.0","id":3,"method":"tools/call","params":{"name":"charge","_meta":{"idempotencyKey":"a b"}}}"#).1,
        Some(ProblemKind::KeyInvalid)
    );
    assert_eq!(
        refused(
            r#"[{"jsonrpc":"2.0","id":1,"method":"tools/list"},{"jsonrpc":"2.0","id":2,"method":"tools/call","params":{"name":"charge","_meta":{"idempotencyKey":"k"}}}]"#
        ),
        (
            Bytes::from_static(b"null"),
            Some(ProblemKind::JsonRpcBatchRefused)
        )
    );
}

#[test]
fn refusals_are_error_objects_with_stable_codes() {
    let problem = Problem::new(ProblemKind::InProgress, "still running")
        .with_retry_after(Duration::from_millis(300));
    let resp = refusal(b"\"r-1\"", &problem);
    assert_eq!(resp.status(), http::StatusCode::OK);
    assert_eq!(resp.headers()["retry-after"], "1");
    let body = crate::full_body(resp.into_body());
    let v: serde_json::Value = serde_json::from_slice(&body).expect("json");
    assert_eq!(v["jsonrpc"], "2.0");
    assert_eq!(v["id"], "r-1");
    assert_eq!(v["error"]["code"], -31004);
    assert_eq!(
        v["error"]["data"]["code"],
        "idempotency-request-in-progress"
    );
    assert_eq!(v["error"]["data"]["status"], 409);
    assert_eq!(v["error"]["data"]["retry_after"], 1);
    let codes: Vec<i64> = ProblemKind::ALL.iter().map(|k| error_code(*k)).collect();
    assert!(
        codes.iter().all(|c| !(-32768..=-32000).contains(c)),
        "{codes:?}"
    );
}

#[test]
fn replays_take_the_retrys_id_and_keep_every_other_byte() {
    let stored = Bytes::from_static(
        br#"{"jsonrpc":"2.0","id":7,"result":{"content":[{"type":"text","text":"id: 7 {\"id\":7}"}],"isError":false}}"#,
    );
    let replayed = with_id(&stored, Some("application/json"), b"\"retry-2\"");
    assert_eq!(
        replayed,
        Bytes::from_static(
            br#"{"jsonrpc":"2.0","id":"retry-2","result":{"content":[{"type":"text","text":"id: 7 {\"id\":7}"}],"isError":false}}"#
        )
    );
    let stream = Bytes::from_static(
        b"event: message\ndata: {\"jsonrpc\":\"2.0\",\"method\":\"notifications/progress\",\"params\":{\"progress\":1}}\n\nevent: message\ndata: {\"jsonrpc\":\"2.0\",\"id\":9,\"method\":\"sampling/createMessage\"}\n\nevent: message\ndata: {\"jsonrpc\":\"2.0\",\"id\":7,\"result\":{}}\r\n\r\n",
    );
    let replayed = with_id(&stream, Some("text/event-stream"), b"12");
    assert_eq!(
        replayed,
        Bytes::from_static(
            b"event: message\ndata: {\"jsonrpc\":\"2.0\",\"method\":\"notifications/progress\",\"params\":{\"progress\":1}}\n\nevent: message\ndata: {\"jsonrpc\":\"2.0\",\"id\":9,\"method\":\"sampling/createMessage\"}\n\nevent: message\ndata: {\"jsonrpc\":\"2.0\",\"id\":12,\"result\":{}}\r\n\r\n"
        )
    );
    // Not a JSON-RPC answer: left as stored.
    let plain = Bytes::from_static(b"{\"id\":7}");
    assert_eq!(with_id(&plain, None, b"1"), plain);
    assert_eq!(with_id(&Bytes::from_static(b"oops"), None, b"1"), "oops");
}

#[test]
fn an_answers_error_object_says_how_it_is_recorded() {
    let json = Some("application/json");
    assert_eq!(
        classify(
            br#"{"jsonrpc":"2.0","id":1,"result":{"isError":true}}"#,
            json
        ),
        ErrorClass::Result
    );
    for code in [-32700, -32600, -32601, -32602] {
        let body = format!(r#"{{"jsonrpc":"2.0","id":1,"error":{{"code":{code},"message":"x"}}}}"#);
        assert_eq!(classify(body.as_bytes(), json), ErrorClass::Final, "{code}");
    }
    for code in [-32603, -32000, -32099, 17] {
        let body = format!(r#"{{"jsonrpc":"2.0","id":1,"error":{{"code":{code},"message":"x"}}}}"#);
        assert_eq!(
            classify(body.as_bytes(), json),
            ErrorClass::Server,
            "{code}"
        );
    }
    assert_eq!(classify(b"<html>", Some("text/html")), ErrorClass::Result);
    let stream = b"data: {\"jsonrpc\":\"2.0\",\"method\":\"notifications/progress\"}\n\ndata: {\"jsonrpc\":\"2.0\",\"id\":1,\"error\":{\"code\":-32603,\"message\":\"x\"}}\n\n";
    assert_eq!(
        classify(stream, Some("text/event-stream")),
        ErrorClass::Server
    );
}
