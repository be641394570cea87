//! Group commit on PostgreSQL: concurrent reservations share one
//! statement over arrays and one commit, and so do concurrent resolutions
//! ([`idem::store::group`]). Under load most of a statement's cost is per
//! statement (bind, plan, executor start, a commit and its WAL flush), not
//! per row: a busy store pays one statement for many requests.

use idem::store::group::Failure;
pub(crate) use idem::store::group::{Answer, Batched, Batcher, Counts, GroupCommit, RecordId};

use crate::error::PgError;

/// How a grouped statement's error reads: a deadlock or a serialization
/// failure (the statement rolled back whole) is a conflict; anything else
/// fails the group.
pub(crate) fn classify(err: sqlx::Error) -> Failure {
    match &err {
        sqlx::Error::Database(db) if matches!(db.code().as_deref(), Some("40P01" | "40001")) => {
            Failure::Conflict
        }
        _ => Failure::Store(PgError::from(err).into()),
    }
}
