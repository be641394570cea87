//! The transactional inbox on SQLite, for consumers whose business data
//! lives in the same file: [`Inbox::process`] records the message id in
//! the caller's `rusqlite` transaction, before the business change, and a
//! redelivery of a committed message is a [`InboxOutcome::Duplicate`].
//! When the transaction rolls back, the id goes with it and the redelivery
//! is processed as new. The contract and [`InboxOutcome`] are the core's
//! ([`idem::inbox`]); the PostgreSQL store has the same `Inbox`, with the
//! same arguments in the same order.
//!
//! The table comes with the store's schema: open the file once with
//! [`SqliteStore`](crate::SqliteStore) (or `idem migrate --store
//! sqlite://…`), or call [`migrate`] on your own connection.
//!
//! ```
//! use idem_sqlite::inbox::{self, Inbox, InboxOutcome};
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let mut conn = idem_sqlite::rusqlite::Connection::open_in_memory()?;
//! inbox::migrate(&mut conn)?;
//! conn.execute_batch("CREATE TABLE orders (id TEXT PRIMARY KEY, paid INTEGER NOT NULL)")?;
//! conn.execute("INSERT INTO orders VALUES ('o-1', 0)", [])?;
//! for _delivery in 0..2 {
//!     let mut tx = conn.transaction()?;
//!     match Inbox::process(&mut tx, "orders", "msg-1", Some("o-1"))? {
//!         InboxOutcome::Fresh => {
//!             tx.execute("UPDATE orders SET paid = paid + 1 WHERE id = 'o-1'", [])?;
//!         }
//!         InboxOutcome::Duplicate => {} // already applied: change nothing
//!     }
//!     tx.commit()?; // then acknowledge the message
//! }
//! let paid: i64 = conn.query_row("SELECT paid FROM orders", [], |r| r.get(0))?;
//! assert_eq!(paid, 1);
//! # Ok(())
//! # }
//! ```

use std::time::Duration;

pub use idem::InboxOutcome;
use idem::Timestamp;
pub use idem::inbox::MAX_ID_LEN;
use rusqlite::{Connection, Transaction, params};

use crate::SqliteError;

// The inbox table's statements (the table is in migration 2;
// `processed_at` is milliseconds since the epoch).
const PROCESS: &str = "INSERT INTO idem_inbox (consumer, message_id, aggregate_id, processed_at) \
     VALUES (?1, ?2, ?3, ?4) ON CONFLICT (consumer, message_id) DO NOTHING";
const PURGE: &str = "DELETE FROM idem_inbox WHERE (consumer, message_id) IN \
     (SELECT consumer, message_id FROM idem_inbox WHERE processed_at < ?1 \
      AND (?3 IS NULL OR consumer = ?3) \
      ORDER BY processed_at LIMIT ?2)";

/// The inbox table's operations; see the [module docs](self).
#[derive(Debug, Clone, Copy, Default)]
pub struct Inbox;

impl Inbox {
    /// Records `message_id` for `consumer` in `tx`, or reports that it was
    /// processed before. Empty or over-long ids are refused
    /// ([`SqliteError::InvalidMessage`]): a message without an id can never
    /// be processed unprotected.
    pub fn process(
        tx: &mut Transaction<'_>,
        consumer: &str,
        message_id: &str,
        aggregate_id: Option<&str>,
    ) -> Result<InboxOutcome, SqliteError> {
        check_id("consumer", consumer)?;
        check_id("message_id", message_id)?;
        let inserted = tx.prepare_cached(PROCESS)?.execute(params![
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

    /// Deletes at most `batch` inbox rows processed more than `retention`
    /// ago, of every consumer (call it in a loop until it returns less than
    /// `batch`). Keep the retention longer than the broker can redeliver a
    /// message, or an old redelivery would be processed again.
    pub fn purge_older_than(
        conn: &Connection,
        retention: Duration,
        batch: usize,
    ) -> Result<u64, SqliteError> {
        purge(conn, None, retention, batch)
    }

    /// [`purge_older_than`](Self::purge_older_than) for one consumer's rows
    /// only (consumers sharing a database may keep their ids for different
    /// times).
    pub fn purge_consumer_older_than(
        conn: &Connection,
        consumer: &str,
        retention: Duration,
        batch: usize,
    ) -> Result<u64, SqliteError> {
        check_id("consumer", consumer)?;
        purge(conn, Some(consumer), retention, batch)
    }
}

/// Creates (or upgrades) the idem tables in `conn`'s database, and says
/// what it did.
pub fn migrate(conn: &mut Connection) -> Result<idem::store::Migrated, SqliteError> {
    crate::schema::migrate(conn)
}

fn purge(
    conn: &Connection,
    consumer: Option<&str>,
    retention: Duration,
    batch: usize,
) -> Result<u64, SqliteError> {
    let cutoff = Timestamp::now().minus(retention).as_millis();
    let deleted = conn.prepare_cached(PURGE)?.execute(params![
        cutoff,
        i64::try_from(batch).unwrap_or(i64::MAX),
        consumer
    ])?;
    Ok(u64::try_from(deleted).unwrap_or(u64::MAX))
}

/// Refuses an empty or over-long identifier.
fn check_id(field: &'static str, value: &str) -> Result<(), SqliteError> {
    if value.is_empty() {
        return Err(SqliteError::invalid(field, "must not be empty"));
    }
    if value.len() > MAX_ID_LEN {
        return Err(SqliteError::invalid(
            field,
            format!("is {} bytes; at most {MAX_ID_LEN}", value.len()),
        ));
    }
    Ok(())
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
        let mut tx = conn.transaction().expect("tx");
        assert_eq!(
            Inbox::process(&mut tx, "c", "m1", None).expect("fresh"),
            InboxOutcome::Fresh
        );
        tx.rollback().expect("rollback");
        let mut tx = conn.transaction().expect("tx");
        assert_eq!(
            Inbox::process(&mut tx, "c", "m1", Some("a")).expect("fresh again"),
            InboxOutcome::Fresh
        );
        tx.commit().expect("commit");
        let mut tx = conn.transaction().expect("tx");
        assert_eq!(
            Inbox::process(&mut tx, "c", "m1", None).expect("dup"),
            InboxOutcome::Duplicate
        );
        assert_eq!(
            Inbox::process(&mut tx, "other", "m1", None).expect("other consumer"),
            InboxOutcome::Fresh
        );
        assert!(matches!(
            Inbox::process(&mut tx, "", "m", None),
            Err(SqliteError::InvalidMessage {
                field: "consumer",
                ..
            })
        ));
        assert!(matches!(
            Inbox::process(&mut tx, "c", &"x".repeat(256), None),
            Err(SqliteError::InvalidMessage {
                field: "message_id",
                ..
            })
        ));
        tx.commit().expect("commit");
        assert_eq!(
            Inbox::purge_older_than(&conn, Duration::from_secs(60), 10).expect("purge"),
            0
        );
        std::thread::sleep(Duration::from_millis(5));
        assert_eq!(
            Inbox::purge_older_than(&conn, Duration::ZERO, 1).expect("purge"),
            1
        );
        assert_eq!(
            Inbox::purge_older_than(&conn, Duration::ZERO, 10).expect("purge"),
            1
        );
    }

    #[test]
    fn one_consumers_rows_are_purged_alone() {
        let mut conn = db();
        let mut tx = conn.transaction().expect("tx");
        for (consumer, id) in [("billing", "m1"), ("billing", "m2"), ("orders", "m1")] {
            Inbox::process(&mut tx, consumer, id, None).expect("process");
        }
        tx.commit().expect("commit");
        std::thread::sleep(Duration::from_millis(5));
        assert!(matches!(
            Inbox::purge_consumer_older_than(&conn, "", Duration::ZERO, 10),
            Err(SqliteError::InvalidMessage {
                field: "consumer",
                ..
            })
        ));
        assert_eq!(
            Inbox::purge_consumer_older_than(&conn, "billing", Duration::ZERO, 10).expect("purge"),
            2
        );
        let left: Vec<String> = conn
            .prepare("SELECT consumer FROM idem_inbox")
            .expect("prepare")
            .query_map([], |r| r.get(0))
            .expect("query")
            .collect::<Result<_, _>>()
            .expect("rows");
        assert_eq!(left, ["orders"]);
    }
}
