//! # idem — effectively-once outcomes over at-least-once delivery
//!
//! The core of idem: the types and the engine that make a retried request
//! or a redelivered message run its side effect at most once, and give every
//! duplicate the original answer.
//!
//! * [`IdempotencyKey`] and [`Scope`] identify one logical operation;
//! * [`Fingerprint`] says whether a retry is the same request;
//! * [`Record`] is the stored operation with its state and [`Lease`];
//! * [`Policy`] sets retention, lease, and what happens on lapses and outages;
//! * [`Store`] is the storage contract ([`MemoryStore`] here, SQLite,
//!   PostgreSQL and Redis in their own crates; [`Tiered`] composes two);
//! * [`Engine`] drives it all: [`Engine::begin`] / [`Engine::run`];
//! * [`operator`] holds what operators do to records: release, resolve by
//!   hand, cleanup, census of stuck records;
//! * [`reconcile`] settles held records (outcome unknown) with the system
//!   of record, in the background.
//!
//! This crate does no I/O of its own beyond Tokio timers and tasks.
//!
//! ```
//! use idem::{Engine, Fingerprint, MemoryStore, Run, Scope, StoredResponse};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let engine = Engine::new(MemoryStore::new());
//! let scope = Scope::new("acme", "ship-order")?;
//! let key = "order-17".parse()?;
//! let fp = Fingerprint::builder().part("order", b"17").finish();
//! for _ in 0..3 {
//!     // Three deliveries, one shipment.
//!     engine.run(&scope, &key, fp, || async { StoredResponse::new(200, "shipped") }).await?;
//! }
//! # Ok(())
//! # }
//! ```

mod canonical;
pub mod dyn_store;
pub mod engine;
pub mod fingerprint;
mod hex;
pub mod inbox;
pub mod json;
pub mod key;
pub mod memory;
pub mod metrics;
pub mod operator;
pub mod policy;
pub mod reconcile;
pub mod record;
#[cfg(feature = "seal")]
pub mod seal;
mod secret;
pub mod store;
pub mod tiered;

pub use dyn_store::DynStore;
pub use engine::{
    Begin, Engine, EngineError, Guard, RecordError, Replay, Rerun, RerunReason, Run, V1Address,
};
pub use fingerprint::{
    BodyKind, Fingerprint, FingerprintBuilder, FingerprintParseError, HashSecret, HashSecretError,
    JsonRefusal, canonical_json, canonical_json_doubles, canonical_json_doubles_value,
    canonical_json_strict, canonical_json_value, json_strict,
};
pub use inbox::InboxOutcome;
pub use key::{
    IdempotencyKey, KeyError, MAX_KEY_LEN, MAX_SCOPE_LEN, Scope, ScopeError, ScopeField,
};
pub use memory::MemoryStore;
pub use policy::{
    DEFAULT_RELEASE_STATUSES, FailMode, InFlight, LeaseExpiry, Policy, Resolution, ServerError,
    UNKNOWN_OUTCOME_STATUSES,
};
pub use record::{
    HeaderDecodeError, Lease, OUTCOME_UNKNOWN, OwnerToken, Record, RecordState, StoredResponse,
    Timestamp, UnknownState,
};
pub use store::{
    FinalOutcome, ListFilter, ListRecords, Page, Purge, Reservation, ReserveRequest, Store,
    StoreError, Verdict,
};
pub use tiered::{CacheStore, Tiered};
