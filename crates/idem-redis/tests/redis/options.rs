//! The options at work on a running store: the replicas each write waits
//! for, how long a command waits for its answer, and how many times a
//! lost connection is retried before a command fails.

use crate::common;

use std::time::Duration;

use idem::{LeaseExpiry, Purge, Reservation, Store, StoreError};
use idem_redis::{RedisOptions, RedisStore, redis};
use idem_testkit::conformance as suite;
use idem_testkit::fault::FaultProxy;
use idem_testkit::services;

/// How many replicas the server at `url` has now.
async fn connected_replicas(url: &str) -> u32 {
    let mut conn = redis::Client::open(url)
        .expect("client")
        .get_multiplexed_async_connection()
        .await
        .expect("connection");
    let info: String = redis::cmd("INFO")
        .arg("replication")
        .query_async(&mut conn)
        .await
        .expect("INFO replication");
    info.lines()
        .find_map(|line| line.trim().strip_prefix("connected_slaves:"))
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no connected_slaves in {info}"))
}

/// `with_min_replicas` is `?min_replicas=`: asked for one replica more
/// than the server has, a write waits for a copy it cannot get and fails
/// as the store being unavailable; lowered to the replicas there are, the
/// same URL's writes are acknowledged.
#[tokio::test]
async fn min_replicas_is_how_many_copies_a_write_waits_for() {
    let Some(url) = services::redis() else {
        return;
    };
    let replicas = connected_replicas(&url).await;
    let scope = suite::unique_scope("redis-min-replicas");
    let asking = services::via(
        &url,
        services::socket_addr(&url),
        &format!("min_replicas={}", replicas + 1),
    );
    assert_eq!(
        RedisOptions::from_url(&asking).expect("url").min_replicas(),
        RedisOptions::from_url(&url)
            .expect("url")
            .with_min_replicas(replicas + 1)
            .min_replicas()
    );
    for (min_replicas, acknowledged) in [(replicas + 1, false), (replicas, true)] {
        let (opts, _prefix) = common::options_for(&asking);
        let opts = opts
            .with_min_replicas(min_replicas)
            .with_replica_wait(Duration::from_millis(100));
        let store = RedisStore::connect_with(opts).await.expect("connect");
        let k = suite::key(&format!("copies-{min_replicas}"));
        let reserved = store
            .reserve(suite::request(
                &scope,
                &k,
                suite::fp("a"),
                Duration::from_secs(60),
                LeaseExpiry::Hold,
            ))
            .await;
        if acknowledged {
            assert!(
                matches!(reserved, Ok(Reservation::Acquired(_))),
                "{min_replicas} of {replicas} replicas: {reserved:?}"
            );
        } else {
            let err = reserved.expect_err("more replicas asked for than there are");
            assert!(matches!(err, StoreError::Unavailable(_)), "{err:?}");
            assert!(err.to_string().contains("replica"), "{err}");
        }
        // The record was written either way (only its copies were missing).
        store.delete(&scope, &k).await.expect("clean up");
    }
}

/// `with_response_timeout`: an answer that takes longer than the time-out
/// (a link adding 400 ms each way) fails the command as the store being
/// unavailable; with a time-out longer than the answer takes, the same
/// link answers it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_command_waits_for_its_answer_as_long_as_the_response_timeout() {
    let Some(url) = services::redis() else {
        return;
    };
    let link = FaultProxy::start(services::socket_addr(&url)).await;
    let through = services::via(&url, link.addr(), "");
    let scope = suite::unique_scope("redis-response-timeout");
    let k = suite::key("slow");
    for (timeout, answered) in [
        (Duration::from_millis(100), false),
        (Duration::from_secs(30), true),
    ] {
        let (opts, _prefix) = common::options_for(&through);
        let opts = opts.with_response_timeout(timeout);
        let store = RedisStore::connect_with(opts).await.expect("connect");
        assert!(store.get(&scope, &k).await.expect("get").is_none());
        link.set_latency(Duration::from_millis(400), Duration::ZERO);
        let slow = store.get(&scope, &k).await;
        link.set_latency(Duration::ZERO, Duration::ZERO);
        if answered {
            assert!(matches!(slow, Ok(None)), "{timeout:?}: {slow:?}");
        } else {
            assert!(
                matches!(slow, Err(StoreError::Unavailable(_))),
                "{timeout:?}: {slow:?}"
            );
        }
    }
}

/// `with_reconnect_retries`: during an outage of half a second, a command
/// waits for the store's reconnection when it may retry (10 times, a
/// second or so apart), and is answered once the server is back; with no
/// retry, the one reconnection attempt fails during the outage, and so
/// does the command. Either way the store serves again afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconnect_retries_carry_a_command_over_a_short_outage() {
    let Some(url) = services::redis() else {
        return;
    };
    let scope = suite::unique_scope("redis-reconnect-retries");
    let k = suite::key("outage");
    for (retries, carried) in [(0, false), (10, true)] {
        let link = FaultProxy::start(services::socket_addr(&url)).await;
        let (opts, _prefix) = common::options_for(&services::via(&url, link.addr(), ""));
        let opts = opts.with_reconnect_retries(retries);
        let store = RedisStore::connect_with(opts).await.expect("connect");
        assert!(store.get(&scope, &k).await.expect("get").is_none());
        link.cut();
        let restore = {
            let link = link.clone();
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(500)).await;
                link.restore();
            })
        };
        // The command on the connection that was cut may fail whatever
        // the retries: it was sent before the loss could be known.
        if let Err(err) = store.get(&scope, &k).await {
            assert!(err.is_transient(), "{err:?}");
        }
        let during = store.get(&scope, &k).await;
        if carried {
            assert!(matches!(during, Ok(None)), "{retries} retries: {during:?}");
        } else {
            assert!(
                matches!(during, Err(StoreError::Unavailable(_))),
                "{retries} retries: {during:?}"
            );
        }
        restore.await.expect("restored");
        let mut failures = 0;
        while let Err(err) = store.get(&scope, &k).await {
            assert!(err.is_transient(), "{err:?}");
            failures += 1;
            assert!(failures < 20, "no reconnection after the outage: {err}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}
