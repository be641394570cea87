//! The admin listener: health, readiness, Prometheus metrics, the records
//! API and the live dashboard.
//!
//! | route | what |
//! |---|---|
//! | `GET /healthz` | `ok` while the process serves (never needs the token) |
//! | `GET /readyz` | 200 when the store answers, 503 with the reason otherwise |
//! | `GET /metrics` | Prometheus text format |
//! | `GET /api/v1/records?state=&older_than=&tenant=&limit=&after=` | a page of records, oldest first |
//! | `GET /api/v1/records/{tenant}/{operation}/{key}[?body=true]` | one record |
//! | `POST …/{key}/release` | free a processing record's key |
//! | `POST …/{key}/resolve` | record a final answer for a processing record |
//! | `DELETE …/{key}` | delete a record in any state |
//! | `GET /dashboard/` | the live dashboard (static files; its data calls need the token) |
//!
//! With an admin token configured every route except `/healthz` and the
//! dashboard's static files needs `Authorization: Bearer <token>`; anything
//! else gets a 401 problem that discloses nothing. Path segments are
//! percent-encoded (`POST%20%2Fv1%2Fpayments`). Errors are RFC 9457
//! problems; the actions go through [`idem::operator`], so they are fenced
//! against owners recording at the same moment.

mod auth;
mod dashboard;
mod health;
mod problem;
mod records;
mod state;

pub use auth::guarded;
pub use health::metrics;
pub use state::AdminState;

use dashboard::{asset, redirect};
use health::readyz;
use problem::not_found;
use records::{delete, list, release, resolve, show};

use axum::Router;
use axum::extract::Path;
use axum::http::{HeaderValue, header};
use axum::response::Response;
use axum::routing::get;

/// The admin router.
pub fn router(state: AdminState) -> Router {
    let records = "/api/v1/records/{tenant}/{operation}/{key}";
    let protected = Router::new()
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .route("/api/v1/records", get(list))
        .route(records, get(show).delete(delete))
        .route(&format!("{records}/release"), axum::routing::post(release))
        .route(&format!("{records}/resolve"), axum::routing::post(resolve))
        .fallback(not_found);
    // Records carry stored answers: never kept by a cache on the way.
    let protected = guarded(protected, state.token.clone()).layer(axum::middleware::map_response(
        |mut resp: Response| async move {
            resp.headers_mut()
                .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
            resp
        },
    ));
    Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/dashboard", get(|| async { redirect("/dashboard/") }))
        .route("/dashboard/", get(|| async { asset("index.html") }))
        .route(
            "/dashboard/{file}",
            get(|file: Result<Path<String>, _>| async move {
                match file {
                    Ok(Path(file)) => asset(&file),
                    // Not even a file name (bad percent-encoding).
                    Err(_) => not_found().await,
                }
            }),
        )
        .merge(protected)
        .with_state(state)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use idem::store::Cursor;

    use super::auth::{from_same_machine, is_loopback_host, same_secret};
    use super::records::list_filter;
    use crate::records::{DEFAULT_PAGE, ResolveRequest, decode_cursor, encode_cursor};
    use idem::fingerprint::to_hex;
    use idem::{RecordState, Timestamp, Verdict};

    #[test]
    fn cursors_round_trip_and_refuse_garbage() {
        let c = Cursor {
            created_at: Timestamp::from_millis(1_700_000_000_123),
            tenant: "t/ü".into(),
            operation: "POST /v1/payments".into(),
            key: "k 1".into(),
        };
        let text = encode_cursor(&c);
        assert!(text.bytes().all(|b| b.is_ascii_hexdigit()));
        assert_eq!(decode_cursor(&text), Some(c));
        for bad in ["", "zz", "abc", &to_hex(b"[1,2]")] {
            assert_eq!(decode_cursor(bad), None, "{bad}");
        }
    }

    #[test]
    fn list_parameters_are_validated_by_name() {
        let q = |pairs: &[(&str, &str)]| {
            list_filter(
                &pairs
                    .iter()
                    .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                    .collect(),
            )
        };
        let f = q(&[
            ("state", "processing"),
            ("older_than", "60s"),
            ("limit", "5"),
        ])
        .expect("valid");
        assert_eq!(f.state, Some(RecordState::Processing));
        assert_eq!(f.older_than, Some(Duration::from_secs(60)));
        assert_eq!(f.limit, 5);
        assert_eq!(q(&[]).expect("valid").limit, DEFAULT_PAGE);
        for (pairs, name) in [
            (vec![("state", "done")], "state:"),
            (vec![("older_than", "soon")], "older_than:"),
            (vec![("limit", "0")], "limit:"),
            (vec![("limit", "5000")], "limit:"),
            (vec![("after", "nope")], "after:"),
            (vec![("tenant", "")], "tenant:"),
            (vec![("colour", "blue")], "colour:"),
        ] {
            let err = q(&pairs).expect_err(name);
            assert!(err.to_string().starts_with(name), "{err}");
        }
    }

    #[test]
    fn resolve_requests_are_validated_by_field() {
        let parse = |text: &str| {
            serde_json::from_str::<ResolveRequest>(text)
                .map_err(|e| e.to_string())
                .and_then(|r| {
                    r.outcome(Duration::from_secs(60))
                        .map_err(|e| e.to_string())
                })
        };
        let ok = parse(r#"{"status":201,"headers":{"content-type":"application/json"},"body":"{}","resource_id":"pay_1"}"#)
            .expect("valid");
        assert_eq!(ok.verdict, Verdict::Completed);
        assert_eq!(ok.retention, Duration::from_secs(60));
        assert_eq!(ok.resource_id.as_deref(), Some("pay_1"));
        assert_eq!(
            parse(r#"{"status":402,"retention":"2h"}"#)
                .expect("valid")
                .verdict,
            Verdict::Failed
        );
        for (text, needle) in [
            (r#"{"status":99}"#, "status:"),
            (r#"{"status":200,"verdict":"maybe"}"#, "verdict:"),
            (r#"{"status":200,"headers":{"bad name":"x"}}"#, "headers:"),
            (r#"{"status":200,"retention":"forever"}"#, "retention:"),
            (r#"{"status":200,"colour":"blue"}"#, "unknown field"),
        ] {
            let err = parse(text).expect_err(text);
            assert!(err.contains(needle), "{text}: {err}");
        }
    }

    /// A `Host` or `Origin` that is not text is refused, not skipped; two
    /// `Host` lines must both be loopback.
    #[test]
    fn a_host_that_is_not_text_is_not_the_same_machine() {
        let headers = |pairs: &[(&str, &[u8])]| {
            let mut h = http::HeaderMap::new();
            for (name, value) in pairs {
                h.append(
                    http::HeaderName::from_bytes(name.as_bytes()).expect("name"),
                    http::HeaderValue::from_bytes(value).expect("value"),
                );
            }
            h
        };
        assert!(from_same_machine(&headers(&[])));
        assert!(from_same_machine(&headers(&[(
            "host",
            &b"127.0.0.1:9090"[..]
        )])));
        assert!(!from_same_machine(&headers(&[(
            "host",
            &b"\xffevil.example"[..]
        )])));
        assert!(!from_same_machine(&headers(&[("host", &b"evil\xff"[..])])));
        assert!(!from_same_machine(&headers(&[
            ("host", &b"localhost"[..]),
            ("host", &b"evil.example"[..])
        ])));
        assert!(!from_same_machine(&headers(&[
            ("host", &b"localhost"[..]),
            ("origin", &b"http://evil\xff"[..])
        ])));
        assert!(from_same_machine(&headers(&[
            ("host", &b"localhost"[..]),
            ("origin", &b"http://localhost:9090"[..])
        ])));
    }

    #[test]
    fn loopback_hosts() {
        for host in [
            "localhost",
            "LOCALHOST:9090",
            "127.0.0.1",
            "127.0.0.1:9090",
            "[::1]:9090",
            "::1",
        ] {
            assert!(is_loopback_host(host), "{host}");
        }
        for host in [
            "evil.example",
            "evil.example:9090",
            "10.0.0.1:9090",
            "localhost.evil.example",
            "",
        ] {
            assert!(!is_loopback_host(host), "{host}");
        }
    }

    #[test]
    fn secrets_compare_whole() {
        assert!(same_secret(b"abc", b"abc"));
        assert!(!same_secret(b"abc", b"abd"));
        assert!(!same_secret(b"ab", b"abc"));
    }
}
