//! How an idle relay learns of new rows: `LISTEN`, its registration,
//! and the fallback poll.

use super::options::RelayOptions;
use idem_postgres::outbox::Outbox;
use idem_postgres::sqlx::PgPool;
use idem_postgres::sqlx::postgres::PgListener;
use std::time::{Duration, Instant};

/// How an idle relay learns of new rows: a `LISTEN` on `idem_outbox`, with
/// a registration in `idem_outbox_listeners` that makes inserting
/// statements notify while it lasts (see migration 4), and a fallback poll
/// for what a notification can miss (a row whose inserting statement ran
/// just before the registration and committed just after the last read).
/// Without a listener, it polls every `idle_poll`.
pub(super) struct Wake {
    listener: Option<PgListener>,
    id: String,
    registered: Option<Instant>,
    idle_poll: Duration,
    fallback: Duration,
}

impl Wake {
    pub(super) async fn new(pool: &PgPool, options: &RelayOptions) -> Self {
        let listener = if options.listen {
            match Outbox::listener(pool).await {
                Ok(listener) => Some(listener),
                Err(err) => {
                    tracing::warn!(reason = "relay_listen_failed", %err, "cannot LISTEN; polling instead");
                    None
                }
            }
        } else {
            None
        };
        Self {
            listener,
            id: format!("{}", idem::OwnerToken::random()),
            registered: None,
            idle_poll: options.idle_poll,
            fallback: options.notify_fallback,
        }
    }

    /// Work was found: inserts need not notify for this relay any more.
    pub(super) async fn busy(&mut self, pool: &PgPool) {
        if self.registered.take().is_some() {
            let _ = Outbox::unregister_listener(pool, &self.id).await;
        }
    }

    /// Nothing to publish: waits for a notification, the fallback poll or
    /// `stop`; returns whether `stop` completed.
    pub(super) async fn idle(
        &mut self,
        pool: &PgPool,
        stop: &mut std::pin::Pin<&mut impl std::future::Future<Output = ()>>,
    ) -> bool {
        let poll = if self.listener.is_some() {
            self.fallback
        } else {
            self.idle_poll
        };
        if let Some(listener) = self.listener.as_mut() {
            if self.registered.is_none_or(|t| t.elapsed() >= self.fallback) {
                let first = self.registered.is_none();
                let registered =
                    Outbox::register_listener(pool, &self.id, self.fallback.saturating_mul(3))
                        .await;
                if registered.is_ok() {
                    self.registered = Some(Instant::now());
                    if first {
                        // Read once more: a row committed before the
                        // registration sent no notification.
                        return false;
                    }
                }
            }
            if self.registered.is_some() {
                return tokio::select! {
                    biased;
                    () = stop.as_mut() => true,
                    got = listener.recv() => {
                        if let Err(err) = got {
                            tracing::debug!(%err, "LISTEN connection lost; it reconnects");
                            tokio::select! {
                                () = stop.as_mut() => return true,
                                () = tokio::time::sleep(self.idle_poll) => {}
                            }
                        }
                        false
                    }
                    () = tokio::time::sleep(poll) => false,
                };
            }
        }
        tokio::select! {
            () = stop.as_mut() => true,
            () = tokio::time::sleep(self.idle_poll) => false,
        }
    }
}
