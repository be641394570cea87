//! The store on a real Redis Cluster (feature `cluster`): the test cluster
//! `scripts/services.sh` starts (three primaries, a replica of each; or
//! `IDEM_TEST_REDIS_CLUSTER_URL`). The conformance suite runs on it from
//! `tests/conformance.rs`; here, records spread over the nodes, listing
//! across them, names with braces, and `?min_replicas=1` waiting for a
//! replica's copy.
//!
//! Run: `cargo test -p idem-redis --features cluster --test cluster` (the
//! workspace's test command turns the feature on: the `idem` binary has
//! it). Without the cluster the test skips loudly (or fails under
//! `IDEM_REQUIRE_SERVICES=1`).

#![cfg(feature = "cluster")]

use crate::common;

use std::sync::Arc;
use std::time::Duration;

use common::Prefixed;
use idem::{ListFilter, ListRecords, OwnerToken, Reservation, Scope, Store};
use idem_redis::{RedisConnection, RedisOptions, RedisStore, redis};
use idem_testkit::conformance as suite;

/// Records of one tenant spread over the primaries, and listing finds
/// them all, braces in names and all.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn records_spread_over_the_nodes_and_list_from_all() {
    let Some(fixture) = Prefixed::cluster().await else {
        return;
    };
    let store = Arc::clone(&fixture.store);
    assert!(matches!(store.connection(), RedisConnection::Cluster(_)));
    let tenant = format!("t{{x}}:{}", OwnerToken::random().as_u128() % 1_000_000);
    let scope = Scope::new(&tenant, "POST /v1/things").expect("scope");
    for i in 0..60 {
        let k: idem::IdempotencyKey = format!("{{k}}:{i}").parse().expect("key");
        let r = store
            .reserve(suite::request(
                &scope,
                &k,
                suite::fp("a"),
                Duration::from_secs(60),
                idem::LeaseExpiry::Retry,
            ))
            .await
            .expect("reserve");
        assert!(matches!(r, Reservation::Acquired(_)));
    }
    let mut per_node = Vec::new();
    for node in fixture.prefix.nodes() {
        let client = redis::Client::open(node).expect("client");
        let mut conn = client
            .get_multiplexed_async_connection()
            .await
            .expect("node connection");
        let names: Vec<String> = redis::cmd("KEYS")
            .arg(format!("{}:*", store.prefix()))
            .query_async(&mut conn)
            .await
            .expect("KEYS");
        per_node.push(names.len());
    }
    assert_eq!(per_node.iter().sum::<usize>(), 60, "{per_node:?}");
    assert!(
        per_node.iter().filter(|n| **n > 0).count() >= 2,
        "keys spread over nodes: {per_node:?}"
    );
    let page = store
        .list(&ListFilter {
            tenant: Some(scope.tenant().to_owned()),
            limit: 100,
            ..ListFilter::default()
        })
        .await
        .expect("list");
    assert_eq!(page.records.len(), 60);
}

/// `?min_replicas=1`: every write waits for a replica's copy (`WAIT`, on
/// the node owning the record's slot), and the suite's core still holds.
/// A cluster whose primaries have no replica cannot give that copy: the
/// write fails as the store being unavailable (its record may stay, as any
/// write whose answer was lost).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn min_replicas_waits_for_a_replica_copy() {
    let Some(url) = idem_testkit::services::redis_cluster() else {
        return;
    };
    let (opts, _prefix) = common::options_for(&format!("{url}?min_replicas=1"));
    assert_eq!(opts.min_replicas(), 1);
    let store = Arc::new(RedisStore::connect_with(opts).await.expect("connect"));
    suite::reserve_complete_replay(Arc::clone(&store)).await;
    suite::fencing_of_stale_owner(Arc::clone(&store)).await;
    suite::engine_runs_work_once(Arc::clone(&store)).await;

    let Some(lonely) = idem_testkit::servers::PrivateRedisCluster::start(3, 0) else {
        return;
    };
    let opts = RedisOptions::from_url(&format!("{}?min_replicas=1", lonely.url()))
        .expect("url")
        .with_replica_wait(Duration::from_millis(200));
    let store = RedisStore::connect_with(opts).await.expect("connect");
    let scope = suite::unique_scope("min-replicas");
    let err = store
        .reserve(suite::request(
            &scope,
            &suite::key("k"),
            suite::fp("a"),
            Duration::from_secs(60),
            idem::LeaseExpiry::Hold,
        ))
        .await
        .expect_err("no replica to copy to");
    assert!(
        err.to_string().contains("replica"),
        "the error names the missing copy: {err}"
    );
}
