//! The layer's own pieces: what a stored answer keeps, and how a replay
//! is rebuilt.

use super::replay::replayed;
use super::*;

#[test]
fn stored_headers_drop_hop_by_hop_cookies_and_connection_named() {
    let mut h = HeaderMap::new();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    h.insert(header::CONTENT_LENGTH, HeaderValue::from_static("10"));
    h.insert(
        header::CONNECTION,
        HeaderValue::from_static("keep-alive, x-private"),
    );
    h.insert("x-private", HeaderValue::from_static("secret"));
    h.insert(
        header::TRANSFER_ENCODING,
        HeaderValue::from_static("chunked"),
    );
    h.insert(header::SET_COOKIE, HeaderValue::from_static("session=1"));
    h.insert(header::LOCATION, HeaderValue::from_static("/v1/payments/1"));
    let kept = storable_headers(&h, &[header::SET_COOKIE]);
    let names: Vec<&str> = kept.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["content-type", "location"]);
    // The setting adds to what is never stored: a cookie stays out even
    // when a route lists other headers, and so does a forged marker.
    h.insert(NOT_RETAINED, HeaderValue::from_static("1"));
    h.insert("x-secret", HeaderValue::from_static("s"));
    let kept = storable_headers(&h, &[HeaderName::from_static("x-secret")]);
    let names: Vec<&str> = kept.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["content-type", "location"]);
    assert!(
        storable_headers(&h, &[])
            .iter()
            .all(|(n, _)| n != "set-cookie")
    );
}

#[test]
fn replay_marks_and_restores() {
    let replay = Replay {
        state: idem::RecordState::Completed,
        response: StoredResponse::new(201, "made").with_header("location", "/x/1"),
        resource_id: None,
    };
    let resp: Response<ResponseBody<http_body_util::Empty<Bytes>>> =
        replayed(replay, &Contract::default());
    assert_eq!(resp.status(), 201);
    assert_eq!(resp.headers()["location"], "/x/1");
    assert_eq!(resp.headers()[IDEMPOTENT_REPLAYED], "true");
}

/// A record written by hand (or by a store writer that skipped the
/// gate) cannot frame its replay, hand out a session, or mark itself:
/// every stored header goes through the one gate again on the way out.
#[test]
fn a_replay_carries_no_framing_session_or_marker_headers_whatever_was_stored() {
    let mut stored = StoredResponse::new(201, "made").with_header("location", "/x/1");
    for (name, value) in [
        ("Content-Length", "100"),
        ("transfer-encoding", "chunked"),
        ("connection", "close"),
        ("proxy-connection", "keep-alive"),
        ("set-cookie", "s=alice"),
        ("set-cookie2", "s=alice"),
        ("authentication-info", "nextnonce=1"),
        ("proxy-authentication-info", "nextnonce=1"),
        ("idempotent-replayed", "false"),
        ("idempotency-status", "unprotected"),
        ("idempotency-replayed", "false"),
        ("idempotency-ttl", "1"),
    ] {
        stored = stored.with_header(name, value);
    }
    let replay = Replay {
        state: idem::RecordState::Completed,
        response: stored,
        resource_id: None,
    };
    let resp: Response<ResponseBody<http_body_util::Empty<Bytes>>> =
        replayed(replay, &Contract::default());
    let names: Vec<_> = resp.headers().keys().map(|n| n.as_str()).collect();
    assert_eq!(names, ["location", "idempotent-replayed"], "{names:?}");
    assert_eq!(resp.headers()[IDEMPOTENT_REPLAYED], "true");
}

#[test]
fn tombstone_replays_as_problem_with_original_status() {
    let replay = Replay {
        state: idem::RecordState::Completed,
        response: StoredResponse::new(200, "")
            .with_header("content-type", "text/plain")
            .with_header("x-request-id", "abc")
            .with_header(NOT_RETAINED.as_str(), "1"),
        resource_id: None,
    };
    let resp: Response<ResponseBody<http_body_util::Empty<Bytes>>> =
        replayed(replay, &Contract::default());
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()[header::CONTENT_TYPE], crate::PROBLEM_JSON);
    assert_eq!(resp.headers()["x-request-id"], "abc");
    assert_eq!(resp.headers()[IDEMPOTENCY_STATUS], "not-retained");
    assert!(resp.headers().get(NOT_RETAINED).is_none());
}

/// The IETF profile replays an answer not kept as its status and headers
/// with an empty body, without the headers that describe the absent
/// body, and marks it in both its replay header and `Idempotency-Status`.
#[test]
fn the_ietf_profile_replays_a_tombstone_empty_and_marked() {
    let replay = Replay {
        state: idem::RecordState::Completed,
        response: StoredResponse::new(201, "")
            .with_header("content-type", "application/json")
            .with_header("content-encoding", "gzip")
            .with_header("content-digest", "sha-256=:x:")
            .with_header("location", "/x/1")
            .with_header(NOT_RETAINED.as_str(), "1"),
        resource_id: None,
    };
    let contract = Contract::of(crate::Profile::Ietf);
    let resp: Response<ResponseBody<http_body_util::Empty<Bytes>>> = replayed(replay, &contract);
    assert_eq!(resp.status(), 201);
    let names: Vec<_> = resp.headers().keys().map(|n| n.as_str()).collect();
    assert_eq!(
        names,
        ["location", "idempotency-status", "idempotency-replayed"],
        "{names:?}"
    );
    assert_eq!(resp.headers()[IDEMPOTENCY_STATUS], "not-retained");
    assert!(http_body::Body::is_end_stream(resp.body()));
}

/// A route may send both spellings of the replay marker.
#[test]
fn a_replay_carries_every_marker_the_route_names() {
    let replay = Replay {
        state: idem::RecordState::Completed,
        response: StoredResponse::new(200, "ok"),
        resource_id: None,
    };
    let contract = Contract::default()
        .with_replay_headers(vec![IDEMPOTENT_REPLAYED, crate::IDEMPOTENCY_REPLAYED]);
    let resp: Response<ResponseBody<http_body_util::Empty<Bytes>>> = replayed(replay, &contract);
    assert_eq!(resp.headers()[IDEMPOTENT_REPLAYED], "true");
    assert_eq!(resp.headers()[crate::IDEMPOTENCY_REPLAYED], "true");
}
