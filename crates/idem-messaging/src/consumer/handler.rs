//! The business change one message makes, inside the runner's
//! transaction.

use super::error::HandlerError;
use super::message::Message;
use idem_postgres::sqlx::{Postgres, Transaction};
use std::future::Future;

/// The business change for one message, made inside the runner's
/// transaction (which already holds the message's inbox row). Return
/// `Ok(())` to commit; an error rolls everything back.
pub trait Handler: Send + Sync + 'static {
    /// Applies `msg` using `tx`; do not commit or roll back `tx`.
    fn handle(
        &self,
        tx: &mut Transaction<'static, Postgres>,
        msg: &Message,
    ) -> impl Future<Output = Result<(), HandlerError>> + Send;
}
