//! The admin API's request decoding (record paths, list queries, page
//! cursors, release/resolve bodies, the bearer token) on arbitrary
//! requests, through the real router over an in-memory store: never
//! panics, never answers 500, refuses with problem+json, and every cursor
//! it accepts reads back the same.
#![no_main]

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use http::{Method, Request, StatusCode};
use http_body_util::BodyExt;
use idem_gateway::admin::{AdminState, router};
use idem_gateway::records::{decode_cursor, encode_cursor};
use libfuzzer_sys::fuzz_target;
use tower::ServiceExt;

const TOKEN: &str = "fuzz-token";

struct World {
    rt: tokio::runtime::Runtime,
    app: Router,
}

fn world() -> &'static World {
    static WORLD: OnceLock<World> = OnceLock::new();
    WORLD.get_or_init(|| {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        let store = rt.block_on(async {
            idem_gateway::store::open("memory://", None, Duration::from_secs(1), None, 0)
                .await
                .expect("memory store")
        });
        let app = router(AdminState {
            store,
            token: Some(Arc::from(TOKEN)),
            default_retention: Duration::from_secs(3600),
        });
        World { rt, app }
    })
}

fuzz_target!(|data: &[u8]| {
    let Some((&flags, rest)) = data.split_first() else {
        return;
    };
    let text = String::from_utf8_lossy(rest);
    let (target, body) = text.split_once('\n').unwrap_or((&text, ""));
    if let Some(c) = decode_cursor(target) {
        assert_eq!(decode_cursor(&encode_cursor(&c)), Some(c));
    }
    let method =
        [Method::GET, Method::POST, Method::DELETE, Method::PUT][usize::from(flags & 3)].clone();
    let mut req = Request::builder().method(method).uri(target);
    if flags & 4 != 0 {
        req = req.header("authorization", format!("Bearer {TOKEN}"));
    }
    if flags & 8 != 0 {
        req = req.header("content-type", "application/json");
    }
    // A target that is not a URI is refused before any router sees it.
    let Ok(req) = req.body(Body::from(body.to_owned())) else {
        return;
    };
    let w = world();
    let (status, ctype) = w.rt.block_on(async {
        let resp = w.app.clone().oneshot(req).await.expect("infallible");
        let status = resp.status();
        let ctype = resp
            .headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_owned();
        resp.into_body().collect().await.expect("body");
        (status, ctype)
    });
    assert_ne!(status, StatusCode::INTERNAL_SERVER_ERROR, "{target:?}");
    if status.is_client_error() && status != StatusCode::METHOD_NOT_ALLOWED {
        assert!(ctype.contains("json"), "{status} {target:?}: {ctype:?}");
    }
});
