//! [`shutdown_signal`]: how every long-running command (`serve`, `relay`,
//! `cleanup`) learns it should stop.

use std::future::Future;

/// Completes on SIGTERM or SIGINT. The handlers are installed when this
/// is called, not when the future is first polled: call it before saying
/// "ready", or a signal sent right after that line would find the default
/// action (the process killed, with no clean stop). Needs a Tokio runtime.
pub fn shutdown_signal() -> impl Future<Output = ()> + Send + 'static {
    #[cfg(unix)]
    let (mut term, mut int) = {
        use tokio::signal::unix::{SignalKind, signal};
        (
            signal(SignalKind::terminate()).ok(),
            signal(SignalKind::interrupt()).ok(),
        )
    };
    async move {
        #[cfg(unix)]
        {
            let term = async {
                match term.as_mut() {
                    Some(s) => {
                        s.recv().await;
                    }
                    None => std::future::pending::<()>().await,
                }
            };
            let int = async {
                match int.as_mut() {
                    Some(s) => {
                        s.recv().await;
                    }
                    None => std::future::pending::<()>().await,
                }
            };
            tokio::select! {
                () = int => tracing::info!("SIGINT received"),
                () = term => tracing::info!("SIGTERM received"),
            }
        }
        #[cfg(not(unix))]
        {
            let _ = tokio::signal::ctrl_c().await;
            tracing::info!("interrupt received");
        }
    }
}
