//! The transactional inbox's contract, shared by every store that keeps
//! one (`idem_postgres::inbox::Inbox`, `idem_sqlite::inbox::Inbox`).
//!
//! A consumer that receives a message at least once (a broker redelivers
//! until it is acknowledged) makes its effect happen once by recording the
//! message id **in its own transaction, before the business change**:
//!
//! * `Inbox::process(&mut tx, consumer, message_id, aggregate_id)` inserts
//!   `(consumer, message_id)` in `tx` and answers [`InboxOutcome::Fresh`]:
//!   make the change in the same `tx`, commit, then acknowledge the
//!   message.
//! * When the id is already there (committed by an earlier delivery) it
//!   answers [`InboxOutcome::Duplicate`] and **changes nothing**: skip the
//!   change, acknowledge the message.
//! * A transaction that rolls back (or a process that dies before the
//!   commit) takes the id with it, so the redelivery is `Fresh` again: the
//!   id and the change are always there together or not at all.
//! * Two deliveries of one id at the same time serialise on its row: the
//!   second waits for the first transaction, then sees `Duplicate` (or
//!   `Fresh`, if the first rolled back).
//!
//! Ids are per consumer: two consumers of one message each process it
//! once. Consumer names and message ids must be non-empty and at most
//! [`MAX_ID_LEN`] bytes; a store refuses others before it touches the
//! database, so a message without an id is never processed unprotected.
//!
//! ```
//! use idem::InboxOutcome;
//!
//! /// What a consumer does with a delivery, whatever the store.
//! fn apply(outcome: InboxOutcome, change: impl FnOnce()) {
//!     match outcome {
//!         InboxOutcome::Fresh => change(), // in the inbox's transaction
//!         InboxOutcome::Duplicate => {}    // already applied: change nothing
//!     }
//!     // Then commit, and only then acknowledge the message.
//! }
//! # let mut applied = 0;
//! # apply(InboxOutcome::Fresh, || applied += 1);
//! # apply(InboxOutcome::Duplicate, || applied += 1);
//! # assert_eq!(applied, 1);
//! ```

/// Whether a message was seen before by this consumer: the answer of a
/// store's `Inbox::process`. See the [module docs](self) for the contract.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum InboxOutcome {
    /// First delivery (or the first since earlier ones rolled back): the
    /// id is now recorded in the caller's transaction; apply the change in
    /// that same transaction.
    Fresh,
    /// Already processed (an earlier delivery committed its id): nothing
    /// was written; change nothing and acknowledge.
    Duplicate,
}

/// Longest consumer name or message id an inbox accepts, in bytes.
pub const MAX_ID_LEN: usize = 255;
