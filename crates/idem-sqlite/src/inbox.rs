//! The transactional inbox on SQLite, for consumers whose business data
//! lives in the same file: the message id is recorded in the caller's
//! `rusqlite` transaction, before the business change, and a redelivery
//! of a committed message is a [`InboxOutcome::Duplicate`].
//!
//! The table comes with the store's schema: open the file once with
//! [`SqliteStore`](crate::SqliteStore) (or `idem migrate --store
//! sqlite://…`), or call [`migrate`] on your own connection.
//!
//! ```
//! use idem_sqlite::inbox::{self, InboxOutcome};
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let mut conn = idem_sqlite::rusqlite::Connection::open_in_memory()?;
//! inbox::migrate(&mut conn)?;
//! conn.execute_batch("CREATE TABLE orders (id TEXT PRIMARY KEY, paid INTEGER NOT NULL)")?;
//! conn.execute("INSERT INTO orders VALUES ('o-1', 0)", [])?;
//! for _delivery in 0..2 {
//!     let tx = conn.transaction()?;
//!     if inbox::process(&tx, "orders", "msg-1", Some("o-1"))? == InboxOutcome::Fresh {
//!         tx.execute("UPDATE orders SET paid = paid + 1 WHERE id = 'o-1'", [])?;
//!     }
//!     tx.commit()?;
//! }
//! let paid: i64 = conn.query_row("SELECT paid FROM orders", [], |r| r.get(0))?;
//! assert_eq!(paid, 1);
//! # Ok(())
//! # }
//! ```

use std::time::Duration;

use idem::Timestamp;
use rusqlite::{Connection, Transaction, params};

use crate::SqliteError;

/// Whether a message was seen before.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InboxOutcome {
    /// First delivery: apply the change in this transaction.
    Fresh,
    /// Already processed: change nothing, acknowledge.
    Duplicate,
}

/// Why an id was refused.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum InboxError {
    /// An empty or over-long consumer name or message id.
    #[error("invalid {field}: {reason}")]
    InvalidId {
        /// Which one.
        field: &'static str,
        /// Why.
        reason: &'static str,
    },
    /// SQLite failed (the transaction should be rolled back).
    #[error("inbox: {0}")]
    Sqlite(#[from] rusqlite::Error),
}

/// Longest consumer name or message id accepted.
pub const MAX_ID_LEN: usize = 255;

fn check(field: &'static str, value: &str) -> Result<(), InboxError> {
    if value.is_empty() {
        return Err(InboxError::InvalidId {
            field,
            reason: "must not be empty",
        });
    }
    if value.len() > MAX_ID_LEN {
        return Err(InboxError::InvalidId {
            field,
            reason: "is longer than 255 bytes",
        });
    }
    Ok(())
}

/// Creates (or upgrades) the idem tables in `conn`'s database.
pub fn migrate(conn: &mut Connection) -> Result<(), SqliteError> {
    crate::schema::migrate(conn)
}

/// Records `message_id` for `consumer` in `tx`, or reports a duplicate.
pub fn process(
    tx: &Transaction<'_>,
    consumer: &str,
    message_id: &str,
    aggregate_id: Option<&str>,
) -> Result<InboxOutcome, InboxError> {
    check("consumer", consumer)?;
    check("message_id", message_id)?;
    let inserted = tx
        .prepare_cached(
            "INSERT INTO idem_inbox (consumer, message_id, aggregate_id, processed_at) \
             VALUES (?1, ?2, ?3, ?4) ON CONFLICT (consumer, message_id) DO NOTHING",
        )?
        .execute(params![
            consumer,
            message_id,
            aggregate_id,
            Timestamp::now().as_millis()
        ])?;
    Ok(if inserted == 1 {
        InboxOutcome::Fresh
    } else {
        InboxOutcome::Duplicate
    })
}

/// Deletes at most `batch` rows processed more than `retention` ago.
pub fn purge_older_than(
    conn: &Connection,
    retention: Duration,
    batch: usize,
) -> Result<usize, InboxError> {
    let cutoff = Timestamp::now().minus(retention).as_millis();
    Ok(conn
        .prepare_cached(
            "DELETE FROM idem_inbox WHERE (consumer, message_id) IN \
             (SELECT consumer, message_id FROM idem_inbox WHERE processed_at < ?1 \
              ORDER BY processed_at LIMIT ?2)",
        )?
        .execute(params![cutoff, i64::try_from(batch).unwrap_or(i64::MAX)])?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn db() -> Connection {
        let mut conn = Connection::open_in_memory().expect("open");
        migrate(&mut conn).expect("migrate");
        conn
    }

    #[test]
    fn duplicates_rollbacks_and_ids() {
        let mut conn = db();
        let tx = conn.transaction().expect("tx");
        assert_eq!(
            process(&tx, "c", "m1", None).expect("fresh"),
            InboxOutcome::Fresh
        );
        tx.rollback().expect("rollback");
        let tx = conn.transaction().expect("tx");
        assert_eq!(
            process(&tx, "c", "m1", Some("a")).expect("fresh again"),
            InboxOutcome::Fresh
        );
        tx.commit().expect("commit");
        let tx = conn.transaction().expect("tx");
        assert_eq!(
            process(&tx, "c", "m1", None).expect("dup"),
            InboxOutcome::Duplicate
        );
        assert_eq!(
            process(&tx, "other", "m1", None).expect("other consumer"),
            InboxOutcome::Fresh
        );
        assert!(matches!(
            process(&tx, "", "m", None),
            Err(InboxError::InvalidId {
                field: "consumer",
                ..
            })
        ));
        assert!(matches!(
            process(&tx, "c", &"x".repeat(256), None),
            Err(InboxError::InvalidId {
                field: "message_id",
                ..
            })
        ));
        tx.commit().expect("commit");
        assert_eq!(
            purge_older_than(&conn, Duration::from_secs(60), 10).expect("purge"),
            0
        );
        std::thread::sleep(Duration::from_millis(5));
        assert_eq!(
            purge_older_than(&conn, Duration::ZERO, 1).expect("purge"),
            1
        );
        assert_eq!(
            purge_older_than(&conn, Duration::ZERO, 10).expect("purge"),
            1
        );
    }
}
