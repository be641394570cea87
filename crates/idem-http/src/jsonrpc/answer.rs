//! A JSON-RPC route's answers: the layer's refusals as error objects,
//! stored answers given the retry's `id`, and what an answer's error says
//! about its call.

use bytes::Bytes;
use http::{HeaderValue, Response, StatusCode, header};
use http_body_util::Full;
use idem::json::Value;

use crate::{Problem, ProblemKind, retry_after_secs};

/// The JSON-RPC error code of each refusal: stable, published once, and
/// outside the range JSON-RPC reserves (−32768 to −32000), as MCP asks of
/// codes that are not its own. `data.code` names the case in words (the
/// problem's `code`).
pub const fn error_code(kind: ProblemKind) -> i64 {
    match kind {
        ProblemKind::KeyMissing => -31001,
        ProblemKind::KeyInvalid | ProblemKind::KeyAmbiguous => -31002,
        ProblemKind::KeyReused => -31003,
        ProblemKind::InProgress => -31004,
        ProblemKind::OutcomeReconciling => -31005,
        ProblemKind::OutcomeHeld => -31006,
        ProblemKind::StoreUnavailable => -31007,
        ProblemKind::JsonRpcBatchRefused => -31008,
        _ => -31000,
    }
}

/// The answer to a call the layer refused: `200` (what a JSON-RPC client
/// reads an error object from) with `{"jsonrpc":"2.0","id":…,"error":
/// {"code", "message", "data": {"code", "detail", "status",
/// "retry_after"}}}`, and `Retry-After` where the problem has one.
pub fn refusal(id: &[u8], problem: &Problem) -> Response<Full<Bytes>> {
    let code = problem.kind().map_or(-31000, error_code);
    let mut data = serde_json::json!({
        "code": problem.slug(),
        "detail": problem.detail(),
        "status": problem.status().as_u16(),
    });
    if let Some(after) = problem.retry_after() {
        data["retry_after"] = serde_json::json!(retry_after_secs(after));
    }
    let error = serde_json::json!({ "code": code, "message": problem.title(), "data": data });
    let id = std::str::from_utf8(id).unwrap_or("null");
    let body = format!("{{\"jsonrpc\":\"2.0\",\"id\":{id},\"error\":{error}}}");
    let mut resp = Response::new(Full::new(Bytes::from(body)));
    *resp.status_mut() = StatusCode::OK;
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    if let Some(after) = problem.retry_after() {
        resp.headers_mut().insert(
            header::RETRY_AFTER,
            HeaderValue::from(retry_after_secs(after)),
        );
    }
    resp
}

fn is_event_stream(content_type: Option<&str>) -> bool {
    content_type.is_some_and(|ct| {
        ct.trim_start()
            .to_ascii_lowercase()
            .starts_with("text/event-stream")
    })
}

/// A stored answer given the retry's `id`: the `id` of each response
/// (an object with `result` or `error`) in a JSON body, or in each
/// `data:` line of an event stream, becomes `id`; every other byte stays
/// as stored. Requests the server made of the client inside a stream
/// keep theirs.
pub fn with_id(body: &Bytes, content_type: Option<&str>, id: &[u8]) -> Bytes {
    if !is_event_stream(content_type) {
        return splice_id(body, id).map_or_else(|| body.clone(), Bytes::from);
    }
    let mut out = Vec::with_capacity(body.len() + 16);
    for line in body.split_inclusive(|b| *b == b'\n') {
        let rewritten = line
            .strip_prefix(b"data:")
            .and_then(|rest| {
                let lead = rest.len() - rest.trim_ascii_start().len();
                let end = rest.trim_ascii_end().len();
                splice_id(&rest[lead..end], id).map(|json| (lead, end, json))
            })
            .map(|(lead, end, json)| {
                let rest = &line[5..];
                let mut l = b"data:".to_vec();
                l.extend_from_slice(&rest[..lead]);
                l.extend_from_slice(&json);
                l.extend_from_slice(&rest[end..]);
                l
            });
        match rewritten {
            Some(l) => out.extend_from_slice(&l),
            None => out.extend_from_slice(line),
        }
    }
    Bytes::from(out)
}

/// `text` with its top-level `id` member's value replaced by `id`, when
/// `text` is a JSON object with an `id` and a `result` or `error`.
fn splice_id(text: &[u8], id: &[u8]) -> Option<Vec<u8>> {
    let members = top_level_members(text)?;
    let is_response = members.iter().any(|(k, _)| k == "result" || k == "error");
    let (_, span) = members.iter().find(|(k, _)| k == "id")?;
    if !is_response {
        return None;
    }
    let mut out = Vec::with_capacity(text.len() + id.len());
    out.extend_from_slice(&text[..span.start]);
    out.extend_from_slice(id);
    out.extend_from_slice(&text[span.end..]);
    Some(out)
}

/// The top-level members of a JSON object: each name (unescaped
/// simply: names with escapes are compared as written) and the byte
/// range of its value. `None` unless `text` is one object.
fn top_level_members(text: &[u8]) -> Option<Vec<(String, std::ops::Range<usize>)>> {
    let mut i = skip_ws(text, 0);
    if text.get(i) != Some(&b'{') {
        return None;
    }
    i = skip_ws(text, i + 1);
    let mut members = Vec::new();
    if text.get(i) == Some(&b'}') {
        return Some(members);
    }
    loop {
        let name_end = skip_string(text, i)?;
        let name = String::from_utf8(text[i + 1..name_end - 1].to_vec()).ok()?;
        i = skip_ws(text, name_end);
        if text.get(i) != Some(&b':') {
            return None;
        }
        let start = skip_ws(text, i + 1);
        let end = skip_value(text, start)?;
        members.push((name, start..end));
        i = skip_ws(text, end);
        match text.get(i) {
            Some(b',') => i = skip_ws(text, i + 1),
            Some(b'}') => {
                return (skip_ws(text, i + 1) == text.len()).then_some(members);
            }
            _ => return None,
        }
    }
}

fn skip_ws(text: &[u8], mut i: usize) -> usize {
    while text.get(i).is_some_and(|b| b" \t\r\n".contains(b)) {
        i += 1;
    }
    i
}

/// The end of the string starting at `i` (after its closing quote).
fn skip_string(text: &[u8], i: usize) -> Option<usize> {
    if text.get(i) != Some(&b'"') {
        return None;
    }
    let mut j = i + 1;
    loop {
        match text.get(j)? {
            b'\\' => j += 2,
            b'"' => return Some(j + 1),
            _ => j += 1,
        }
    }
}

/// The end of the value starting at `i`.
fn skip_value(text: &[u8], i: usize) -> Option<usize> {
    match text.get(i)? {
        b'"' => skip_string(text, i),
        b'{' | b'[' => {
            let mut depth = 0usize;
            let mut j = i;
            loop {
                match text.get(j)? {
                    b'"' => {
                        j = skip_string(text, j)?;
                        continue;
                    }
                    b'{' | b'[' => depth += 1,
                    b'}' | b']' => {
                        depth -= 1;
                        if depth == 0 {
                            return Some(j + 1);
                        }
                    }
                    _ => {}
                }
                j += 1;
            }
        }
        _ => {
            let mut j = i;
            while text.get(j).is_some_and(|b| !b",}] \t\r\n".contains(b)) {
                j += 1;
            }
            (j > i).then_some(j)
        }
    }
}

/// What an answer to a call says about it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorClass {
    /// A result (MCP's tool errors, `isError: true`, are results too), or
    /// not a JSON-RPC answer at all: judged by its HTTP status alone.
    Result,
    /// An error that says the call cannot succeed as sent: parse error,
    /// invalid request, method not found, invalid params (−32700,
    /// −32600, −32601, −32602): a final answer, stored.
    Final,
    /// An internal or server error (−32603, −32000 to −32099, and any
    /// other code): judged as the HTTP `500` it stands for.
    Server,
}

/// What the answer `body` (JSON, or an event stream whose response
/// decides) says about its call.
pub fn classify(body: &[u8], content_type: Option<&str>) -> ErrorClass {
    // Most answers are results: only one whose bytes hold `"error"` is
    // parsed (a member name written with escapes is not looked for).
    if !body.windows(7).any(|w| w == b"\"error\"") {
        return ErrorClass::Result;
    }
    let classify_one = |json: &[u8]| -> Option<ErrorClass> {
        let Ok(Value::Object(m)) = idem::json_strict(json) else {
            return None;
        };
        if m.contains_key("result") {
            return Some(ErrorClass::Result);
        }
        let Some(Value::Object(error)) = m.get("error") else {
            return None;
        };
        let code = match error.get("code") {
            Some(Value::Number(n)) => n.as_str().parse::<i64>().ok(),
            _ => None,
        };
        Some(match code {
            Some(-32700 | -32600 | -32601 | -32602) => ErrorClass::Final,
            _ => ErrorClass::Server,
        })
    };
    if !is_event_stream(content_type) {
        return classify_one(body).unwrap_or(ErrorClass::Result);
    }
    body.split(|b| *b == b'\n')
        .rev()
        .filter_map(|line| line.strip_prefix(b"data:"))
        .find_map(|data| classify_one(data.trim_ascii()))
        .unwrap_or(ErrorClass::Result)
}
