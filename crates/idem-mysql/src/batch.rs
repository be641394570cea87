//! Group commit on MySQL: concurrent reservations share one transaction
//! and one commit, and so do concurrent resolutions
//! ([`idem::store::group`]). With InnoDB's default durability
//! (`innodb_flush_log_at_trx_commit = 1`) every commit waits for a redo
//! log flush: a busy store pays one for many requests.

use idem::store::group::Failure;
pub(crate) use idem::store::group::{Answer, Batched, Batcher, Counts, GroupCommit, RecordId};

use crate::error::{self, MySqlError};

/// How a grouped transaction's error reads: a deadlock or a lock wait
/// time-out (InnoDB rolled the transaction, or its statement, which the
/// batch then rolls back, back) is a conflict; anything else fails the
/// group.
pub(crate) fn classify(err: sqlx::Error) -> Failure {
    if matches!(
        error::error_number(&err),
        Some(error::DEADLOCK | error::LOCK_WAIT_TIMEOUT)
    ) {
        Failure::Conflict
    } else {
        Failure::Store(MySqlError::from(err).into())
    }
}
