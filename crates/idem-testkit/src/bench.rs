//! The shared harness of the store benchmarks (`benches/reserve.rs` of each
//! store crate): operations on fresh keys spread over N concurrent callers.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use idem::{
    Engine, Fingerprint, IdempotencyKey, LeaseExpiry, OwnerToken, Reservation, ReserveRequest, Run,
    Scope, Store, StoredResponse,
};

/// The caller counts every store benchmark reports.
pub const CALLERS: [u64; 3] = [1, 16, 256];

/// One benchmark operation.
pub type Op = Pin<Box<dyn Future<Output = ()> + Send>>;

static NEXT_KEY: AtomicU64 = AtomicU64::new(0);

/// A key never used before, in this run or an earlier one (durable stores
/// keep the keys of earlier runs).
pub fn fresh_key() -> IdempotencyKey {
    static RUN: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    let run = RUN.get_or_init(|| OwnerToken::random().to_string());
    format!("bench-{run}-{}", NEXT_KEY.fetch_add(1, Ordering::Relaxed))
        .parse()
        .expect("valid key")
}

/// Runs `iters` operations spread over `callers` concurrent tasks and
/// returns the wall time (criterion's `iter_custom`).
pub async fn spread<F>(iters: u64, callers: u64, op: F) -> Duration
where
    F: Fn() -> Op + Clone + Send + 'static,
{
    let start = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for c in 0..callers {
        let n = iters / callers + u64::from(c < iters % callers);
        let op = op.clone();
        tasks.spawn(async move {
            for _ in 0..n {
                op().await;
            }
        });
    }
    while let Some(done) = tasks.join_next().await {
        done.expect("bench task");
    }
    start.elapsed()
}

fn fingerprint() -> Fingerprint {
    Fingerprint::builder()
        .json_body(br#"{"amount":100}"#)
        .finish()
}

/// One reservation of a fresh key (must be acquired).
pub fn reserve_op<S: Store>(
    store: Arc<S>,
    scope: Scope,
) -> impl Fn() -> Op + Clone + Send + 'static {
    let fp = fingerprint();
    move || {
        let (store, scope) = (Arc::clone(&store), scope.clone());
        Box::pin(async move {
            let key = fresh_key();
            let r = store
                .reserve(ReserveRequest {
                    scope: &scope,
                    key: &key,
                    fingerprint: fp,
                    owner: OwnerToken::random(),
                    lease: Duration::from_secs(30),
                    retention: Duration::from_secs(86_400),
                    on_lease_expiry: LeaseExpiry::Retry,
                })
                .await
                .expect("reserve");
            assert!(matches!(r, Reservation::Acquired(_)));
        })
    }
}

/// The whole cycle through the engine on a fresh key: reserve, trivial
/// work, record the answer.
pub fn run_op<S: Store>(
    engine: Engine<S>,
    scope: Scope,
) -> impl Fn() -> Op + Clone + Send + 'static {
    let fp = fingerprint();
    move || {
        let (engine, scope) = (engine.clone(), scope.clone());
        Box::pin(async move {
            let key = fresh_key();
            let run = engine
                .run(&scope, &key, fp, || async {
                    StoredResponse::new(201, "ok")
                })
                .await
                .expect("run");
            assert!(matches!(run, Run::Executed(_)));
        })
    }
}
