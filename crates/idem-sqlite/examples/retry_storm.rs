//! A retry storm against a toy payment service on the embedded store.
//!
//! Every payment is sent many times at once (a client retrying on
//! timeouts), then once more with the same key but a different amount (a
//! client bug). The engine runs each payment's charge exactly once, replays
//! the original answer to every retry, and refuses the altered request.
//! Then the store is closed and reopened — as after a restart — and every
//! payment is retried again: all replayed, none charged twice.
//!
//! Run: `cargo run --release -p idem-sqlite --example retry_storm`
//! Options: `--payments N` (default 200), `--retries N` (default 10),
//! `--db PATH` (default `idem-demo.db`, recreated each run).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idem::{Engine, Fingerprint, IdempotencyKey, InFlight, Policy, Run, Scope, StoredResponse};
use idem_sqlite::SqliteStore;
use tokio::task::JoinSet;

/// A fake payment provider that charges every call it receives and counts
/// the charges per payment, so double charges are visible.
#[derive(Default)]
struct Provider {
    charges: Mutex<HashMap<String, u32>>,
}

impl Provider {
    async fn charge(&self, payment: &str, amount: u64) -> StoredResponse {
        tokio::time::sleep(Duration::from_millis(20)).await; // network + provider latency
        let mut charges = self.charges.lock().unwrap_or_else(|p| p.into_inner());
        let n = charges.entry(payment.to_owned()).or_default();
        *n += 1;
        StoredResponse::new(
            201,
            format!(r#"{{"payment":"{payment}","amount":{amount},"charge":"ch_{payment}_{n}"}}"#),
        )
        .with_header("content-type", "application/json")
    }
}

#[derive(Default, Debug)]
struct Tally {
    executed: u64,
    replayed: u64,
    in_progress: u64,
    mismatched: u64,
}

impl Tally {
    fn count(&mut self, run: &Run) {
        match run {
            Run::Executed(_) => self.executed += 1,
            Run::Replayed(_) => self.replayed += 1,
            Run::InProgress { .. } => self.in_progress += 1,
            Run::Mismatch { .. } => self.mismatched += 1,
            Run::Unprotected(_) => {}
        }
    }
}

fn request_fingerprint(amount: u64) -> Fingerprint {
    Fingerprint::builder()
        .part("method", b"POST")
        .part("route", b"/v1/payments")
        .json_body(format!(r#"{{"amount":{amount},"currency":"EUR"}}"#).as_bytes())
        .finish()
}

/// Sends every payment `sends` times at once, with the amount `amount(p)`.
async fn storm(
    engine: &Engine<SqliteStore>,
    provider: &Arc<Provider>,
    payments: u64,
    sends: u64,
    amount: fn(u64) -> u64,
) -> Result<Tally, Box<dyn std::error::Error>> {
    let scope = Scope::new("demo-merchant", "POST /v1/payments")?;
    let mut tasks = JoinSet::new();
    for p in 0..payments {
        let key: IdempotencyKey = format!("pay-{p}").parse()?;
        for _ in 0..sends {
            let amount = amount(p);
            let (engine, provider, scope, key) = (
                engine.clone(),
                Arc::clone(provider),
                scope.clone(),
                key.clone(),
            );
            tasks.spawn(async move {
                let payment = key.as_str().to_owned();
                engine
                    .run(&scope, &key, request_fingerprint(amount), || async move {
                        provider.charge(&payment, amount).await
                    })
                    .await
            });
        }
    }
    let mut tally = Tally::default();
    while let Some(done) = tasks.join_next().await {
        tally.count(&done??);
    }
    Ok(tally)
}

fn genuine_amount(p: u64) -> u64 {
    100 + p
}

fn altered_amount(_: u64) -> u64 {
    999
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut payments = 200u64;
    let mut retries = 10u64;
    let mut db = String::from("idem-demo.db");
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut value = || args.next().ok_or_else(|| format!("{arg} needs a value"));
        match arg.as_str() {
            "--payments" => payments = value()?.parse().map_err(|e| format!("--payments: {e}"))?,
            "--retries" => retries = value()?.parse().map_err(|e| format!("--retries: {e}"))?,
            "--db" => db = value()?,
            "--help" | "-h" => {
                println!("usage: retry_storm [--payments N] [--retries N] [--db PATH]");
                return Ok(());
            }
            other => return Err(format!("unknown argument {other:?}; try --help").into()),
        }
    }
    if payments == 0 || retries == 0 {
        return Err("--payments and --retries must be at least 1".into());
    }
    for suffix in ["", "-wal", "-shm"] {
        let _ = std::fs::remove_file(format!("{db}{suffix}"));
    }
    // Duplicates wait for the first attempt's answer instead of being told
    // to come back later, so every retry gets the original response.
    let policy = Policy::default().with_on_in_flight(InFlight::Wait(Duration::from_secs(10)));
    let provider = Arc::new(Provider::default());

    println!("idem retry storm on sqlite://{db} (durable commits, group commit)");
    println!(
        "  {payments} payments, each sent {retries} times at once; then each key once more with another amount"
    );
    let engine = Engine::new(SqliteStore::open(&db)?).with_policy(policy.clone());
    let started = Instant::now();
    let first = storm(&engine, &provider, payments, retries, genuine_amount).await?;
    let elapsed = started.elapsed();
    let altered = storm(&engine, &provider, payments, 1, altered_amount).await?;
    let stats = engine.store().commit_stats();
    drop(engine);

    let charges: u64 = provider
        .charges
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .values()
        .map(|&n| u64::from(n))
        .sum();
    let double = provider
        .charges
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .values()
        .filter(|&&n| n > 1)
        .count();
    println!(
        "  requests: {}  executed: {}  replayed: {}  in progress: {}",
        payments * retries,
        first.executed,
        first.replayed,
        first.in_progress,
    );
    println!(
        "  same keys, different amount: {} refused, {} executed",
        altered.mismatched, altered.executed
    );
    println!(
        "  provider charges: {charges}  double charges: {double}  ({:.0} ms, {} store operations in {} commits)",
        elapsed.as_secs_f64() * 1000.0,
        stats.operations,
        stats.commits
    );

    // A restart: close the store, open it again, retry every payment.
    let engine = Engine::new(SqliteStore::open(&db)?).with_policy(policy);
    let after = storm(&engine, &provider, payments, 1, genuine_amount).await?;
    let charges_after: u64 = provider
        .charges
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .values()
        .map(|&n| u64::from(n))
        .sum();
    println!(
        "  after reopening the store: {}/{payments} payments replayed, {} re-executed, provider charges still {charges_after}",
        after.replayed, after.executed
    );
    if double > 0
        || charges != payments
        || charges_after != charges
        || after.replayed != payments
        || altered.mismatched != payments
    {
        return Err("a payment was charged more than once".into());
    }
    println!("  OK: every payment charged exactly once");
    Ok(())
}
