//! Every time is the server's clock in UTC: a session whose clock is set
//! to another date (MySQL's `SET timestamp`) and time zone writes that
//! date, whatever the client's clock says; with the clock frozen,
//! listings order records of one creation time by their bytes.

use crate::common;

use std::time::Duration;

use idem::{
    Fingerprint, IdempotencyKey, LeaseExpiry, ListFilter, ListRecords, OwnerToken, Reservation,
    ReserveRequest, Scope, Store, Timestamp,
};
use idem_mysql::MySqlStore;
use idem_mysql::sqlx::mysql::MySqlPoolOptions;

/// A moment decades before any client's clock (946,684,800 s after the
/// Unix epoch), where the frozen sessions' server clock stands.
const FROZEN_S: i64 = 946_684_800;

/// A store whose connections see the server's clock stopped at
/// [`FROZEN_S`], in a time zone five hours east of UTC.
pub(crate) async fn frozen_store(t: &common::Isolated) -> MySqlStore {
    let pool = MySqlPoolOptions::new()
        .max_connections(2)
        .after_connect(|conn, _meta| {
            Box::pin(async move {
                sqlx::query(&format!(
                    "SET SESSION timestamp = {FROZEN_S}, SESSION time_zone = '+05:00'"
                ))
                .execute(conn)
                .await?;
                Ok(())
            })
        })
        .connect_lazy_with(t.opts.connect_options().clone());
    MySqlStore::from_pool(pool)
}

fn request<'a>(scope: &'a Scope, key: &'a IdempotencyKey) -> ReserveRequest<'a> {
    ReserveRequest {
        scope,
        key,
        fingerprint: Fingerprint::builder()
            .part("k", key.as_str().as_bytes())
            .finish(),
        owner: OwnerToken::random(),
        lease: Duration::from_secs(30),
        retention: Duration::from_secs(3600),
        on_lease_expiry: LeaseExpiry::Retry,
    }
}

#[tokio::test]
async fn times_come_from_the_servers_clock_in_utc() {
    let Some(t) = common::Isolated::new("clock").await else {
        return;
    };
    let store = frozen_store(&t).await;
    let scope = Scope::new("acme", "op").expect("scope");
    let key: IdempotencyKey = "k-1".parse().expect("key");
    let frozen = Timestamp::from_millis(FROZEN_S * 1000);
    let Reservation::Acquired(lease) = store.reserve(request(&scope, &key)).await.expect("reserve")
    else {
        panic!("acquired");
    };
    assert_eq!(
        lease.locked_until,
        Timestamp::from_millis(FROZEN_S * 1000 + 30_000),
        "the lease runs from the server's now"
    );
    let record = store.get(&scope, &key).await.expect("get").expect("record");
    assert_eq!(record.created_at, frozen);
    assert_eq!(record.updated_at, frozen);
    assert_eq!(
        record.expires_at,
        Timestamp::from_millis(FROZEN_S * 1000 + 3_600_000)
    );
    let renewed = store
        .renew(&scope, &key, &lease, Duration::from_secs(60))
        .await
        .expect("renew");
    assert_eq!(renewed, Timestamp::from_millis(FROZEN_S * 1000 + 60_000));

    // The same record seen by a session on the real clock: a record of
    // the frozen moment, whose lease lapsed long ago.
    let Reservation::Acquired(taken) = t
        .store
        .reserve(request(&scope, &key))
        .await
        .expect("reserve on the real clock")
    else {
        panic!("a lease of the frozen moment has lapsed on the real clock: taken over");
    };
    assert_eq!(taken.attempt, 2);
    assert!(taken.locked_until > renewed);
}

#[tokio::test]
async fn records_of_one_creation_time_list_in_byte_order() {
    let Some(t) = common::Isolated::new("clock_order").await else {
        return;
    };
    let store = frozen_store(&t).await;
    let scope = Scope::new("acme", "op").expect("scope");
    for key in ["b", "a ", "B", "a", "_"] {
        let key: IdempotencyKey = key.parse().expect("key");
        store.reserve(request(&scope, &key)).await.expect("reserve");
    }
    let mut filter = ListFilter {
        limit: 2,
        ..ListFilter::default()
    };
    let mut keys = Vec::new();
    loop {
        let page = store.list(&filter).await.expect("list");
        keys.extend(page.records.iter().map(|r| r.key.as_str().to_owned()));
        match page.next {
            Some(next) => filter.after = Some(next),
            None => break,
        }
    }
    assert_eq!(keys, ["B", "_", "a", "a ", "b"], "byte order, page by page");
}
