//! Tenants, operations and keys are compared byte by byte: no case
//! folding, no trailing-space padding (the byte order of listings is in
//! `clock.rs`, where a frozen server clock makes creation times equal).

use crate::common;

use std::time::Duration;

use idem::{
    Fingerprint, IdempotencyKey, LeaseExpiry, ListFilter, ListRecords, OwnerToken, Reservation,
    ReserveRequest, Scope, Store,
};

async fn reserve(store: &idem_mysql::MySqlStore, scope: &Scope, key: &str) -> Reservation {
    let key: IdempotencyKey = key.parse().expect("key");
    store
        .reserve(ReserveRequest {
            scope,
            key: &key,
            fingerprint: Fingerprint::builder()
                .part("n", key.as_str().as_bytes())
                .finish(),
            owner: OwnerToken::random(),
            lease: Duration::from_secs(30),
            retention: Duration::from_secs(3600),
            on_lease_expiry: LeaseExpiry::Retry,
        })
        .await
        .expect("reserve")
}

#[tokio::test]
async fn keys_differing_in_case_or_trailing_spaces_are_different_records() {
    let Some(t) = common::Isolated::new("keys").await else {
        return;
    };
    let store = &t.store;
    let scope = Scope::new("acme", "op").expect("scope");
    for key in ["key", "Key", "KEY", "key "] {
        assert!(
            matches!(reserve(store, &scope, key).await, Reservation::Acquired(_)),
            "{key:?} is a key of its own"
        );
    }
    for (tenant, operation) in [("Acme", "op"), ("acme", "OP"), ("acme ", "op")] {
        let scope = Scope::new(tenant, operation).expect("scope");
        assert!(
            matches!(
                reserve(store, &scope, "key").await,
                Reservation::Acquired(_)
            ),
            "{tenant:?}/{operation:?} is a scope of its own"
        );
    }
    // Each reads back as itself.
    let key: IdempotencyKey = "Key".parse().expect("key");
    let record = store.get(&scope, &key).await.expect("get").expect("record");
    assert_eq!(record.key.as_str(), "Key");

    let page = store
        .list(&ListFilter {
            limit: 100,
            ..ListFilter::default()
        })
        .await
        .expect("list");
    assert_eq!(page.records.len(), 7, "every one is a record of its own");
}
