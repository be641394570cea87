//! The store conformance suite: one set of checks every backend must pass.
//!
//! Each check is an `async fn` over an `Arc<S>`; the
//! [`store_conformance!`](crate::store_conformance) macro turns them into
//! `#[tokio::test]`s for one backend. Every check works in its own tenant
//! (random suffix), so several checks — and several test binaries — can
//! share one database or Redis.
//!
//! Times are real: leases of a few hundred milliseconds and sleeps past
//! them, because every backend must use its own clock.

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use bytes::Bytes;
use idem::store::{Cursor, MAX_PAGE};
use idem::{
    Engine, FinalOutcome, Fingerprint, IdempotencyKey, InFlight, Lease, LeaseExpiry, ListFilter,
    ListRecords, OUTCOME_UNKNOWN, OwnerToken, Policy, Purge, RecordState, Reservation,
    ReserveRequest, Run, Scope, Store, StoreError, StoredResponse, Verdict,
};
use tokio::task::JoinSet;

mod engine;
mod lifecycle;
mod listing;
mod records;

pub use engine::*;
pub use lifecycle::*;
pub use listing::*;
pub use records::*;

/// A short lease, so that lapses can be waited for.
pub const SHORT_LEASE: Duration = Duration::from_millis(300);
/// Sleeping this long lets a [`SHORT_LEASE`] lapse on any store clock.
pub const PAST_SHORT_LEASE: Duration = Duration::from_millis(450);
const DAY: Duration = Duration::from_secs(86_400);

/// What a backend's test provides: a store, plus whatever keeps it alive
/// (a temporary directory, a database handle).
pub trait Fixture: Send + Sync + 'static {
    /// The store under test.
    type Store: Store + ListRecords + Purge;
    /// A handle on the store.
    fn store(&self) -> Arc<Self::Store>;
}

/// What a backend's fixture expression may evaluate to: a [`Fixture`], or
/// `Option<Fixture>` where `None` means "server absent, test skipped" (see
/// [`services`](crate::services)).
pub trait IntoFixture {
    /// The fixture.
    type Fixture: Fixture;
    /// The fixture, or `None` to skip.
    fn into_fixture(self) -> Option<Self::Fixture>;
}

impl<F: Fixture> IntoFixture for F {
    type Fixture = F;
    fn into_fixture(self) -> Option<F> {
        Some(self)
    }
}

impl<F: Fixture> IntoFixture for Option<F> {
    type Fixture = F;
    fn into_fixture(self) -> Option<F> {
        self
    }
}

impl<S: Store + ListRecords + Purge> Fixture for Arc<S> {
    type Store = S;
    fn store(&self) -> Arc<S> {
        Arc::clone(self)
    }
}

/// A scope in a tenant of its own.
pub fn unique_scope(check: &str) -> Scope {
    let tenant = format!("{check}-{}", OwnerToken::random());
    Scope::new(&tenant, "POST /v1/things").expect("valid scope")
}

/// A key from text known to be valid.
pub fn key(text: &str) -> IdempotencyKey {
    text.parse().expect("valid key")
}

/// A fingerprint derived from a label.
pub fn fp(label: &str) -> Fingerprint {
    Fingerprint::builder().bytes_body(label.as_bytes()).finish()
}

/// A reservation request with the given lease and policy for lapses.
pub fn request<'a>(
    scope: &'a Scope,
    key: &'a IdempotencyKey,
    fingerprint: Fingerprint,
    lease: Duration,
    on_lease_expiry: LeaseExpiry,
) -> ReserveRequest<'a> {
    ReserveRequest {
        scope,
        key,
        fingerprint,
        owner: OwnerToken::random(),
        lease,
        retention: DAY,
        on_lease_expiry,
    }
}

/// A response with binary body bytes and headers, to check they survive.
pub fn sample_response(status: u16, tag: &str) -> StoredResponse {
    let mut body = tag.as_bytes().to_vec();
    body.extend_from_slice(&[0, 0xff, 0xfe, b'\n']);
    StoredResponse::new(status, body)
        .with_header("content-type", "application/octet-stream")
        .with_header("x-tag", Bytes::copy_from_slice(tag.as_bytes()))
}

fn outcome(verdict: Verdict, tag: &str, retention: Duration) -> FinalOutcome {
    FinalOutcome {
        verdict,
        response: sample_response(
            if verdict == Verdict::Completed {
                201
            } else {
                422
            },
            tag,
        ),
        resource_id: Some(format!("res-{tag}")),
        error_code: (verdict == Verdict::Failed).then(|| "declined".to_owned()),
        retention,
    }
}

async fn acquire<S: Store>(store: &S, req: ReserveRequest<'_>) -> Lease {
    match store.reserve(req).await.expect("reserve") {
        Reservation::Acquired(lease) => lease,
        other => panic!("expected Acquired, got {other:?}"),
    }
}

/// Generates one `#[tokio::test]` per conformance check for a backend.
///
/// `$fixture` is an async expression (evaluated once per test) producing a
/// [`Fixture`], or an `Option` of one where `None` skips the test (a server
/// is absent); give it the form `async { ... }`.
///
/// ```text
/// idem_testkit::store_conformance!(async { std::sync::Arc::new(idem::MemoryStore::new()) });
/// ```
#[macro_export]
macro_rules! store_conformance {
    ($fixture:expr) => {
        $crate::store_conformance!(@tests $fixture;
            reserve_complete_replay,
            failed_is_replayed,
            reservation_race,
            mismatch_in_every_state,
            lease_takeover_and_hold,
            fencing_of_stale_owner,
            release_frees_the_key,
            delete_removes_any_state,
            renew_extends_the_lease,
            outcome_unknown_is_kept,
            expiry_and_batched_purge,
            expired_record_is_replaced,
            list_filters_and_pages,
            list_pages_are_bounded,
            engine_runs_work_once,
            engine_heartbeat_protects_slow_work,
            engine_dropped_guard_keeps_record,
        );
    };
    (@tests $fixture:expr; $($check:ident),* $(,)?) => {
        $(
            #[::tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn $check() {
                let Some(fixture) = $crate::conformance::IntoFixture::into_fixture($fixture.await) else {
                    return;
                };
                let store = $crate::conformance::Fixture::store(&fixture);
                $crate::conformance::$check(store).await;
                drop(fixture);
            }
        )*
    };
}
