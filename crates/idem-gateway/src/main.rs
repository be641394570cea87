//! `idem`: Stripe-style `Idempotency-Key` handling in front of any HTTP API.
//!
//! ```text
//! idem serve --upstream http://127.0.0.1:3000        # the gateway
//! idem demo                                          # a retry storm, end to end
//! ```
//!
//! Thin on purpose: [`idem_gateway::cli`] parses, logs, dispatches and
//! maps errors to exit statuses.

/// mimalloc instead of the system allocator: the request path makes many
/// small short-lived allocations, and with the system allocator glibc's
/// `malloc` and `free` take about a quarter of the gateway's CPU
/// (docs/BENCHMARKS.md#current-figures).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[tokio::main]
async fn main() -> std::process::ExitCode {
    idem_gateway::cli::main().await
}
