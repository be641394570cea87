//! A fake payment service on loopback that does **not** deduplicate: the
//! upstream idem exists for. Every `POST /v1/payments` charges (one row in
//! its ledger per request, whatever its key), so a duplicate side effect is
//! a second row for one key. It misbehaves like a real one, by a fixed
//! schedule over the requests it receives:
//!
//! * `lost` — every `lost_every`-th request (first requests of a key
//!   only): the charge is made, then the connection is dropped with no
//!   answer ("response lost after success");
//! * `slow` — every `slow_every`-th request: the charge is made and the
//!   answer comes after `slow_for`.
//!
//! Any `POST /v1/…` charges (`/v1/payments`, the Stripe SDK's
//! `/v1/payment_intents`); `GET /v1/stats` answers its [`Tally`] as JSON.
//!
//! `GET /v1/payments/by-key/{key}` is its lookup: `200` with the charge
//! made under that key (for the caller's `Authorization` only), or `404`;
//! `400` unless it carries the same key in `Idempotency-Key` (or
//! `X-Request-Id`), as the payment did.
//! It is what a route's `[route.reconcile]` asks.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use tokio::net::TcpListener;

/// When a [`Ledger`] misbehaves, counted over the requests it receives;
/// `0` turns a fault off.
#[derive(Debug, Clone, Copy, Default)]
pub struct Schedule {
    /// Every n-th request charges, then drops its connection unanswered.
    pub lost_every: u64,
    /// Every n-th request (n ≥ 2; never one `lost_every` picks) charges,
    /// then answers after `slow_for`.
    pub slow_every: u64,
    /// How late a slow answer comes.
    pub slow_for: Duration,
}

#[derive(Debug, Default)]
struct State {
    requests: AtomicU64,
    /// (authorization, key) → charge ids made under it.
    charges: Mutex<HashMap<(String, String), Vec<u64>>>,
    /// key → the header it came in.
    key_headers: Mutex<HashMap<String, &'static str>>,
    lookups: AtomicU64,
    lost: AtomicU64,
    slow: AtomicU64,
}

/// A running fake payment service; it stops with the test's runtime.
#[derive(Debug, Clone)]
pub struct Ledger {
    addr: SocketAddr,
    state: Arc<State>,
}

/// What the ledger saw.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Tally {
    /// Distinct keys charged at least once.
    pub paid: u64,
    /// Charges beyond the first for one key: double charges.
    pub duplicates: u64,
    /// Answers dropped after charging.
    pub lost: u64,
    /// Slow answers.
    pub slow: u64,
    /// Lookups answered.
    pub lookups: u64,
}

impl Ledger {
    /// Starts on `127.0.0.1:0`.
    pub async fn start(schedule: Schedule) -> Self {
        Self::start_on("127.0.0.1:0".parse().expect("address"), schedule).await
    }

    /// Starts on `addr`.
    pub async fn start_on(addr: SocketAddr, schedule: Schedule) -> Self {
        let listener = TcpListener::bind(addr).await.expect("bind loopback");
        let addr = listener.local_addr().expect("local addr");
        let state = Arc::new(State::default());
        let shared = Arc::clone(&state);
        crate::upstream::serve(listener, move || {
            let state = Arc::clone(&shared);
            move |req| handle(req, Arc::clone(&state), schedule)
        });
        Self { addr, state }
    }

    /// `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Charges made under `key` (any caller).
    pub fn charges(&self, key: &str) -> usize {
        lock(&self.state.charges)
            .iter()
            .filter(|((_, k), _)| k == key)
            .map(|(_, ids)| ids.len())
            .sum()
    }

    /// Where it listens.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// What it saw so far.
    pub fn tally(&self) -> Tally {
        self.state.tally()
    }
}

impl State {
    fn tally(&self) -> Tally {
        let charges = lock(&self.charges);
        Tally {
            paid: charges.len() as u64,
            duplicates: charges.values().map(|ids| ids.len() as u64 - 1).sum(),
            lost: self.lost.load(Ordering::SeqCst),
            slow: self.slow.load(Ordering::SeqCst),
            lookups: self.lookups.load(Ordering::SeqCst),
        }
    }
}

impl Tally {
    /// As JSON: `{"paid":…,"duplicates":…,"lost":…,"slow":…,"lookups":…}`.
    pub fn to_json(&self) -> String {
        format!(
            r#"{{"paid":{},"duplicates":{},"lost":{},"slow":{},"lookups":{}}}"#,
            self.paid, self.duplicates, self.lost, self.slow, self.lookups
        )
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn json(status: StatusCode, body: String) -> Response<Full<Bytes>> {
    let mut resp = Response::new(Full::new(Bytes::from(body)));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    resp
}

fn header(req: &Request<Incoming>, name: &str) -> String {
    req.headers()
        .get(name)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned()
}

/// The key the client sent, under either name the tests use, and that
/// name.
fn client_key(req: &Request<Incoming>) -> (&'static str, String) {
    ["idempotency-key", "x-request-id"]
        .into_iter()
        .map(|name| (name, header(req, name)))
        .find(|(_, key)| !key.is_empty())
        .unwrap_or(("idempotency-key", String::new()))
}

/// The service; an `Err` makes hyper drop the connection unanswered.
async fn handle(
    req: Request<Incoming>,
    state: Arc<State>,
    schedule: Schedule,
) -> Result<Response<Full<Bytes>>, std::io::Error> {
    let auth = header(&req, "authorization");
    if req.method() == Method::GET
        && let Some(encoded) = req.uri().path().strip_prefix("/v1/payments/by-key/")
    {
        state.lookups.fetch_add(1, Ordering::SeqCst);
        let key = percent_decode(encoded);
        // The gateway's lookup carries the key in the header the client
        // sent it in, as the original request did.
        let sent_in = lock(&state.key_headers).get(&key).copied();
        if sent_in.is_some_and(|name| header(&req, name) != key) {
            return Ok(json(
                StatusCode::BAD_REQUEST,
                r#"{"error":"the lookup's key header is not the key in its path"}"#.into(),
            ));
        }
        let found = lock(&state.charges)
            .get(&(auth, key.clone()))
            .and_then(|ids| ids.first().copied());
        return Ok(match found {
            Some(id) => json(
                StatusCode::OK,
                format!(r#"{{"id":"pay_{id}","key":{key:?},"status":"succeeded"}}"#),
            ),
            None => json(
                StatusCode::NOT_FOUND,
                r#"{"error":"no such payment"}"#.into(),
            ),
        });
    }
    if req.method() == Method::GET && req.uri().path() == "/v1/stats" {
        return Ok(json(StatusCode::OK, state.tally().to_json()));
    }
    if req.method() != Method::POST || !req.uri().path().starts_with("/v1/") {
        return Ok(json(
            StatusCode::NOT_FOUND,
            r#"{"error":"no such route"}"#.into(),
        ));
    }
    let (sent_in, key) = client_key(&req);
    lock(&state.key_headers).insert(key.clone(), sent_in);
    let _ = req.into_body().collect().await;
    let n = state.requests.fetch_add(1, Ordering::SeqCst) + 1;
    let first = {
        let mut charges = lock(&state.charges);
        let ids = charges.entry((auth, key.clone())).or_default();
        ids.push(n);
        ids.len() == 1
    };
    let answer = json(
        StatusCode::CREATED,
        format!(
            r#"{{"id":"pay_{n}","object":"payment_intent","key":{key:?},"status":"succeeded"}}"#
        ),
    );
    if first && schedule.lost_every > 0 && n.is_multiple_of(schedule.lost_every) {
        state.lost.fetch_add(1, Ordering::SeqCst);
        return Err(std::io::Error::other("answer lost after charging"));
    }
    if schedule.slow_every > 1 && n % schedule.slow_every == 1 {
        state.slow.fetch_add(1, Ordering::SeqCst);
        tokio::time::sleep(schedule.slow_for).await;
    }
    Ok(answer)
}

/// Decodes `%XX` escapes (keys are visible ASCII).
fn percent_decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%'
            && let Some(v) = text
                .get(i + 1..i + 3)
                .and_then(|h| u8::from_str_radix(h, 16).ok())
        {
            out.push(v);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}
