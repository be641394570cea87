//! # payments — idem's reference Payment API and Order service
//!
//! The production pattern idem exists for, built only on idem's public
//! API: a [Payment API](api) that never charges twice (the `idem-http`
//! layer, the PostgreSQL store, the provider called with a stable operation
//! id, payment + outbox event + idempotency record in one transaction, a
//! reconciliation worker for unknown outcomes) in front of a
//! [fake provider](provider) that fails like real ones.

pub mod api;
pub mod provider;

/// Binds `addr` and serves `router` until `stop` completes; returns the
/// bound address and the server task.
pub async fn serve(
    addr: std::net::SocketAddr,
    router: axum::Router,
    stop: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(std::net::SocketAddr, tokio::task::JoinHandle<()>), String> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| format!("cannot listen on {addr}: {e}"))?;
    let bound = listener.local_addr().map_err(|e| e.to_string())?;
    let task = tokio::spawn(async move {
        if let Err(err) = axum::serve(listener, router)
            .with_graceful_shutdown(stop)
            .await
        {
            tracing::error!(%err, "server failed");
        }
    });
    Ok((bound, task))
}
