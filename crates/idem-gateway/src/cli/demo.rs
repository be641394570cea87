//! `idem demo`: a toy payments upstream, the gateway in front of it on the
//! embedded store, and a client that retries the way real clients do —
//! concurrent duplicates, a timeout and retry, the same JSON re-serialised,
//! and a key reused with another amount. It prints what happened and fails
//! if any payment was charged twice.

use std::collections::HashMap;
use std::io::{IsTerminal, Write};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode, header};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpListener;
use tokio::task::JoinSet;

use crate::error::GatewayError;

/// Options of `idem demo`.
#[derive(Debug, clap::Args)]
pub struct DemoArgs {
    /// Distinct payments.
    #[arg(long, default_value_t = 40)]
    payments: u32,
    /// Identical requests sent at once for each payment.
    #[arg(long, default_value_t = 6)]
    duplicates: u32,
    /// How long the toy upstream takes to charge, in milliseconds.
    #[arg(long, default_value_t = 150)]
    latency_ms: u64,
    /// Store URL [default: a fresh SQLite file in the temp directory].
    #[arg(long)]
    store: Option<String>,
}

/// The toy payment provider: charges every request it sees, counting
/// charges per forwarded `Idempotency-Key`.
#[derive(Default)]
struct Upstream {
    charges: Mutex<HashMap<String, u32>>,
}

impl Upstream {
    fn charges(&self) -> HashMap<String, u32> {
        self.charges
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}

async fn start_upstream(latency: Duration) -> Result<(SocketAddr, Arc<Upstream>), GatewayError> {
    let listener = TcpListener::bind("127.0.0.1:0")
        .await
        .map_err(|e| GatewayError::io("demo upstream", e))?;
    let addr = listener
        .local_addr()
        .map_err(|e| GatewayError::io("demo upstream", e))?;
    let state = Arc::new(Upstream::default());
    let shared = Arc::clone(&state);
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            let state = Arc::clone(&shared);
            tokio::spawn(async move {
                let svc = service_fn(move |req: Request<Incoming>| {
                    charge(req, Arc::clone(&state), latency)
                });
                let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    Ok((addr, state))
}

async fn charge(
    req: Request<Incoming>,
    state: Arc<Upstream>,
    latency: Duration,
) -> Result<Response<Full<Bytes>>, std::convert::Infallible> {
    let key = req
        .headers()
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("none")
        .to_owned();
    let body = req
        .into_body()
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    let amount = serde_json::from_slice::<serde_json::Value>(&body)
        .ok()
        .and_then(|v| v.get("amount_cents").and_then(serde_json::Value::as_u64))
        .unwrap_or(0);
    tokio::time::sleep(latency).await;
    let n = {
        let mut charges = state.charges.lock().unwrap_or_else(|p| p.into_inner());
        let n = charges.entry(key.clone()).or_default();
        *n += 1;
        *n
    };
    let doc = serde_json::json!({ "id": format!("ch_{key}_{n}"), "amount_cents": amount, "status": "succeeded" });
    let mut resp = Response::new(Full::new(Bytes::from(doc.to_string())));
    *resp.status_mut() = StatusCode::CREATED;
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("application/json"),
    );
    Ok(resp)
}

/// What the clients saw, one count per answer (or its absence): the
/// counts other than `sent` add up to `sent`.
#[derive(Debug, Default)]
struct Tally {
    sent: u64,
    /// Final answers made by running the payment now.
    fresh: u64,
    replayed: u64,
    in_progress: u64,
    reused: u64,
    client_timeouts: u64,
    other: u64,
}

impl Tally {
    /// The requests the other counts account for: `sent`, unless one was
    /// counted twice or not at all.
    fn accounted(&self) -> u64 {
        self.fresh
            + self.replayed
            + self.in_progress
            + self.reused
            + self.client_timeouts
            + self.other
    }

    fn add(&mut self, other: &Tally) {
        self.sent += other.sent;
        self.fresh += other.fresh;
        self.replayed += other.replayed;
        self.in_progress += other.in_progress;
        self.reused += other.reused;
        self.client_timeouts += other.client_timeouts;
        self.other += other.other;
    }
}

type HttpClient = Client<HttpConnector, Full<Bytes>>;

struct Payment {
    key: String,
    auth: String,
    amount: u64,
}

impl Payment {
    fn body(&self) -> String {
        format!(
            r#"{{"amount_cents":{},"currency":"EUR","payment_method_id":"pm_card_visa"}}"#,
            self.amount
        )
    }

    /// The same JSON document, re-serialised: other key order and spacing.
    fn body_reordered(&self) -> String {
        format!(
            "{{ \"payment_method_id\": \"pm_card_visa\",\n  \"currency\": \"EUR\",\n  \"amount_cents\": {} }}",
            self.amount
        )
    }
}

/// Sends until the gateway gives a final answer, honouring `409` +
/// `Retry-After` (capped), optionally abandoning the first try after
/// `give_up` (a client timeout). Returns the final status and body.
async fn send_until_final(
    client: &HttpClient,
    gateway: SocketAddr,
    p: &Payment,
    body: &str,
    give_up: Option<Duration>,
    tally: &mut Tally,
    sent: &AtomicU64,
) -> (StatusCode, Bytes) {
    let mut give_up = give_up;
    for _ in 0..200 {
        let req = Request::builder()
            .method(Method::POST)
            .uri(format!("http://{gateway}/v1/payments"))
            .header("idempotency-key", &p.key)
            .header("authorization", &p.auth)
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body.to_owned())))
            .expect("valid demo request");
        tally.sent += 1;
        sent.fetch_add(1, Ordering::Relaxed);
        let call = client.request(req);
        let resp = match give_up.take() {
            Some(limit) => match tokio::time::timeout(limit, call).await {
                Ok(r) => r,
                Err(_) => {
                    tally.client_timeouts += 1;
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            None => call.await,
        };
        let Ok(resp) = resp else {
            tally.other += 1;
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        let status = resp.status();
        let replayed = resp.headers().contains_key("idempotent-replayed");
        let retry_after = resp
            .headers()
            .get(header::RETRY_AFTER)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        let bytes = resp
            .into_body()
            .collect()
            .await
            .map(|b| b.to_bytes())
            .unwrap_or_default();
        match status {
            StatusCode::CONFLICT => {
                tally.in_progress += 1;
                // Real clients wait Retry-After; the demo caps it to stay quick.
                let wait =
                    Duration::from_secs(retry_after.unwrap_or(1)).min(Duration::from_millis(100));
                tokio::time::sleep(wait).await;
            }
            StatusCode::UNPROCESSABLE_ENTITY => {
                tally.reused += 1;
                return (status, bytes);
            }
            _ => {
                if !status.is_success() {
                    tally.other += 1;
                } else if replayed {
                    tally.replayed += 1;
                } else {
                    tally.fresh += 1;
                }
                return (status, bytes);
            }
        }
    }
    (StatusCode::REQUEST_TIMEOUT, Bytes::new())
}

/// The demo gateway's configuration file: the payments route requires a
/// key and answers a concurrent duplicate `409` at once.
const DEMO_CONFIG: &str = r#"
shutdown_grace = "5s"

[defaults]
upstream_timeout = "10s"

[cleanup]
enabled = false

[[route]]
method = "POST"
path = "/v1/payments"
require_key = true
on_in_flight = "reject"
"#;

/// Runs the demo.
pub(super) async fn run(args: DemoArgs) -> Result<(), GatewayError> {
    if args.payments == 0 || args.duplicates == 0 {
        return Err(GatewayError::Invalid(
            "--payments and --duplicates must be at least 1".to_owned(),
        ));
    }
    let (upstream_addr, upstream) = start_upstream(Duration::from_millis(args.latency_ms)).await?;
    let temp_db = std::env::temp_dir().join(format!("idem-demo-{}.db", std::process::id()));
    let store = args
        .store
        .clone()
        .unwrap_or_else(|| crate::store::StoreUrl::embedded(&temp_db));
    // The demo's gateway is configured as a user would: a file (here, its
    // text) and flags; everything else takes the defaults.
    let settings = crate::config::parse(
        std::path::Path::new("(idem demo)"),
        DEMO_CONFIG,
        &crate::config::Overrides {
            upstream: Some(format!("http://{upstream_addr}")),
            store: Some(store.clone()),
            listen: Some("127.0.0.1:0".to_owned()),
            admin_listen: Some("127.0.0.1:0".to_owned()),
            // The demo's records live as long as it runs.
            hash_secret: Some(idem::HashSecret::generate().1),
            ..crate::config::Overrides::default()
        },
    )?;
    let server = crate::serve::bind(&settings).await?;
    let gateway = server
        .local_addr()
        .map_err(|e| GatewayError::io("the gateway's address", e))?;
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let serving = tokio::spawn(server.run(async {
        let _ = stopped.await;
    }));

    println!(
        "idem demo: {} payments by 3 merchants, each sent {} times at once (one client gives up after {} ms and retries), then re-serialised, then with another amount",
        args.payments,
        args.duplicates,
        args.latency_ms / 3
    );
    println!("  toy payments upstream {upstream_addr}, gateway {gateway}, store {store}");
    let sent = Arc::new(AtomicU64::new(0));
    let answered = Arc::new(AtomicU64::new(0));
    let progress = show_progress(
        Arc::clone(&sent),
        Arc::clone(&answered),
        u64::from(args.payments) * u64::from(args.duplicates),
    );
    let client: HttpClient = Client::builder(TokioExecutor::new()).build_http();
    let started = Instant::now();
    let mut storms = JoinSet::new();
    for p in 0..args.payments {
        let payment = Arc::new(Payment {
            key: format!("demo-pay-{p}"),
            auth: format!("Bearer sk_demo_merchant_{}", p % 3),
            amount: 1_000 + u64::from(p),
        });
        for d in 0..args.duplicates {
            let (client, payment) = (client.clone(), Arc::clone(&payment));
            let (sent, answered) = (Arc::clone(&sent), Arc::clone(&answered));
            let give_up = (d == 0).then_some(Duration::from_millis(args.latency_ms / 3));
            storms.spawn(async move {
                let mut tally = Tally::default();
                let (status, body) = send_until_final(
                    &client,
                    gateway,
                    &payment,
                    &payment.body(),
                    give_up,
                    &mut tally,
                    &sent,
                )
                .await;
                answered.fetch_add(1, Ordering::Relaxed);
                (payment, status, body, tally)
            });
        }
    }
    let mut tally = Tally::default();
    let mut answers: HashMap<String, Vec<(StatusCode, Bytes)>> = HashMap::new();
    let mut payments = Vec::new();
    while let Some(done) = storms.join_next().await {
        let (payment, status, body, t) = done.map_err(|source| GatewayError::Task {
            context: "a demo client".to_owned(),
            source,
        })?;
        tally.add(&t);
        let entry = answers.entry(payment.key.clone()).or_default();
        if entry.is_empty() {
            payments.push(payment);
        }
        entry.push((status, body));
    }
    let identical = answers
        .values()
        .all(|a| a.windows(2).all(|w| w[0] == w[1]) && a[0].0 == StatusCode::CREATED);
    // The same JSON re-serialised: a replay, not a new charge and not a 422.
    let mut reordered_ok = 0;
    for p in &payments {
        let (status, body) = send_until_final(
            &client,
            gateway,
            p,
            &p.body_reordered(),
            None,
            &mut tally,
            &sent,
        )
        .await;
        reordered_ok += u32::from(status == StatusCode::CREATED && answers[&p.key][0].1 == body);
    }
    // The same key with another amount: refused.
    let mut refused = 0;
    for p in &payments {
        let altered = Payment {
            amount: p.amount + 1,
            key: p.key.clone(),
            auth: p.auth.clone(),
        };
        let (status, _) = send_until_final(
            &client,
            gateway,
            &altered,
            &altered.body(),
            None,
            &mut tally,
            &sent,
        )
        .await;
        refused += u32::from(status == StatusCode::UNPROCESSABLE_ENTITY);
    }
    let elapsed = started.elapsed();
    if let Some(progress) = progress {
        progress.abort();
        // Clear the progress line.
        print!("\r{:60}\r", "");
    }
    let _ = stop.send(());
    let _ = serving.await;
    if args.store.is_none() {
        for suffix in ["", "-wal", "-shm", ".secret", ".lock"] {
            let _ = std::fs::remove_file(format!("{}{suffix}", temp_db.display()));
        }
    }

    let charges = upstream.charges();
    let executed: u32 = charges.values().sum();
    let double = charges.values().filter(|&&n| n > 1).count();
    print!(
        "{}",
        summary(
            &tally,
            executed,
            double,
            reordered_ok,
            args.payments,
            identical
        )
    );
    println!("  ({:.1} s)", elapsed.as_secs_f64());
    if double > 0
        || tally.accounted() != tally.sent
        || executed != args.payments
        || !identical
        || refused != args.payments
        || reordered_ok != args.payments
    {
        return Err(GatewayError::DemoFailed(format!(
            "{double} double charges, {executed} charges for {} payments, identical answers: {identical}, {refused} refusals, {reordered_ok} replays of re-serialised JSON",
            args.payments
        )));
    }
    println!(
        "  OK: {} payments, {} requests, every payment charged exactly once",
        args.payments, tally.sent
    );
    Ok(())
}

/// The summary table: every request sent, by what its client saw (the
/// indented rows add up to the first), then what the upstream did.
fn summary(
    tally: &Tally,
    executed: u32,
    double: usize,
    reordered_ok: u32,
    payments: u32,
    identical: bool,
) -> String {
    use std::fmt::Write as _;
    let mut out = String::from("\n");
    let mut row = |name: &str, value: String| {
        let _ = writeln!(out, "  {name:<50} {value:>7}");
    };
    row("requests sent to the gateway", tally.sent.to_string());
    row(
        "  answered by running the payment (201)",
        tally.fresh.to_string(),
    );
    row(
        "  replayed: the stored answer, Idempotent-Replayed",
        tally.replayed.to_string(),
    );
    row(
        "  409: still in progress, retried after Retry-After",
        tally.in_progress.to_string(),
    );
    row(
        "  422: key reused with another amount, refused",
        tally.reused.to_string(),
    );
    row(
        "  given up by the client (timeout), then retried",
        tally.client_timeouts.to_string(),
    );
    row("  other errors", tally.other.to_string());
    row("charges made upstream", executed.to_string());
    row(
        "re-serialised JSON answered as a replay",
        format!("{reordered_ok}/{payments}"),
    );
    row(
        "duplicates got byte-identical answers",
        if identical { "yes" } else { "NO" }.to_owned(),
    );
    row("DOUBLE CHARGES", double.to_string());
    out
}

/// On a terminal, one line rewritten in place while the storm runs; none
/// when the output is a file or a pipe.
fn show_progress(
    sent: Arc<AtomicU64>,
    answered: Arc<AtomicU64>,
    clients: u64,
) -> Option<tokio::task::JoinHandle<()>> {
    std::io::stdout().is_terminal().then(|| {
        tokio::spawn(async move {
            let mut every = tokio::time::interval(Duration::from_millis(200));
            loop {
                every.tick().await;
                let done = answered.load(Ordering::Relaxed).min(clients);
                print!(
                    "\r  {} requests sent, {done}/{clients} clients answered …",
                    sent.load(Ordering::Relaxed)
                );
                let _ = std::io::stdout().flush();
            }
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_summary_rows_add_up_to_the_requests_sent() {
        let tally = Tally {
            sent: 21,
            fresh: 3,
            replayed: 10,
            in_progress: 4,
            reused: 2,
            client_timeouts: 1,
            other: 1,
        };
        assert_eq!(tally.accounted(), tally.sent);
        let text = summary(&tally, 4, 0, 4, 4, true);
        // Each count on a row of its own (tests/e2e.rs adds a real run's up).
        for n in ["21", "3", "10", "4", "2", "1", "4/4", "yes"] {
            assert!(
                text.lines().any(|l| l.ends_with(&format!(" {n}"))),
                "{n}: {text}"
            );
        }
        assert!(text.contains("DOUBLE CHARGES"), "{text}");
    }
}
