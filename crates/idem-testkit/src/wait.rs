//! Waiting in tests for a state the product reaches on its own time.

use std::time::{Duration, Instant};

/// How long [`eventually`] waits: far past what any of these states
/// takes, so that a loaded machine is not a failure.
pub const PATIENCE: Duration = Duration::from_secs(30);

/// Polls `check` (every 20 ms) until it holds; panics, naming `what`,
/// when it has not within [`PATIENCE`]. For states a test must wait for
/// rather than sleep a guessed time for: a request reaching the upstream,
/// a gauge refreshed by a background loop.
pub async fn eventually(what: &str, mut check: impl AsyncFnMut() -> bool) {
    let deadline = Instant::now() + PATIENCE;
    while !check().await {
        assert!(Instant::now() < deadline, "{what}: not within {PATIENCE:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
