//! Redis-specific behaviour: reconnecting, connection errors, key encoding
//! on a real server, TTLs of records and of fast-tier copies.

use crate::common;

use std::time::Duration;

use idem::{
    CacheStore, FinalOutcome, Fingerprint, LeaseExpiry, ListFilter, ListRecords, OwnerToken,
    Record, RecordState, Reservation, ReserveRequest, Scope, Store, StoreError, StoredResponse,
    Timestamp, Verdict,
};
use idem_redis::redis;
use idem_redis::{RedisError, RedisStore};

fn request<'a>(
    scope: &'a Scope,
    key: &'a idem::IdempotencyKey,
    lease: Duration,
) -> ReserveRequest<'a> {
    ReserveRequest {
        scope,
        key,
        fingerprint: Fingerprint::builder().part("k", b"v").finish(),
        owner: OwnerToken::random(),
        lease,
        retention: Duration::from_secs(3600),
        on_lease_expiry: LeaseExpiry::Retry,
    }
}

fn done(retention: Duration) -> FinalOutcome {
    FinalOutcome {
        verdict: Verdict::Completed,
        response: StoredResponse::new(201, "made"),
        resource_id: Some("r-1".to_owned()),
        error_code: None,
        retention,
    }
}

async fn pttl(store: &RedisStore, name: &str) -> i64 {
    redis::cmd("PTTL")
        .arg(name)
        .query_async(&mut store.connection())
        .await
        .expect("PTTL")
}

fn one_line(err: &RedisError) -> String {
    let text = err.to_string();
    assert!(!text.contains('\n'), "one line: {text}");
    text
}

/// Closes the client `id` on the server, from the connection `other`.
async fn kill_client(other: &mut redis::aio::MultiplexedConnection, id: i64) {
    let killed: i64 = redis::cmd("CLIENT")
        .arg("KILL")
        .arg("ID")
        .arg(id)
        .query_async(other)
        .await
        .expect("CLIENT KILL");
    assert_eq!(killed, 1, "client {id} was there to kill");
}

#[tokio::test]
async fn the_next_operation_after_a_killed_connection_succeeds() {
    let Some(f) = common::Prefixed::new().await else {
        return;
    };
    let store = &f.redis;
    let scope = Scope::new("acme", "op").expect("scope");
    let id: i64 = redis::cmd("CLIENT")
        .arg("ID")
        .query_async(&mut store.connection())
        .await
        .expect("CLIENT ID");
    // Kill exactly this store's connection, from another one.
    let client = redis::Client::open(f.url.as_str()).expect("client");
    let mut other = client
        .get_multiplexed_async_connection()
        .await
        .expect("second connection");
    kill_client(&mut other, id).await;

    let k: idem::IdempotencyKey = "after-kill".parse().expect("key");
    let mut failures = 0;
    let lease = loop {
        match store
            .reserve(request(&scope, &k, Duration::from_secs(60)))
            .await
        {
            Ok(Reservation::Acquired(lease)) => break lease,
            Ok(other) => panic!("expected Acquired, got {other:?}"),
            Err(err) => {
                assert!(
                    err.is_transient(),
                    "a dropped connection is transient: {err}"
                );
                failures += 1;
                assert!(failures < 20, "no reconnection: {err}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    };
    assert_eq!(lease.attempt, 1);
    let new_id: i64 = redis::cmd("CLIENT")
        .arg("ID")
        .query_async(&mut store.connection())
        .await
        .expect("CLIENT ID");
    assert_ne!(new_id, id, "a new connection serves the store");
    store
        .resolve(&scope, &k, &lease, &done(Duration::from_secs(60)))
        .await
        .expect("resolve after reconnecting");
}

/// A database no other test of this binary uses: every connection on it is
/// this test's store's.
const IDLE_RESET_DB: u8 = 11;

/// The ids of the clients on database `db`, from `CLIENT LIST`.
async fn clients_on(other: &mut redis::aio::MultiplexedConnection, db: u8) -> Vec<i64> {
    let list: String = redis::cmd("CLIENT")
        .arg("LIST")
        .arg("TYPE")
        .arg("normal")
        .query_async(other)
        .await
        .expect("CLIENT LIST");
    list.lines()
        .filter(|line| line.split(' ').any(|f| f == format!("db={db}")))
        .filter_map(|line| line.split(' ').find_map(|f| f.strip_prefix("id=")))
        .map(|id| id.parse().expect("client id"))
        .collect()
}

/// On a dedicated thread a store opens a connection of the thread's own
/// beside the shared one. Connections reset while nothing is in flight (a
/// Redis restart, a proxy or firewall closing idle links) are noticed as
/// they close and replaced, so the next operation does not fail on them:
/// the shared one and the thread's own alike.
#[tokio::test]
async fn connections_reset_while_idle_are_replaced_before_the_next_operation() {
    let Some(url) = common::redis_url_with_db(IDLE_RESET_DB) else {
        return;
    };
    // This test's thread runs its one runtime to the end, as a serving
    // thread does: the store opens a connection of this thread's own.
    idem::store::local::dedicate_current_thread();
    let (opts, _prefix) = common::options_for(&url);
    let store = RedisStore::connect_with(opts).await.expect("connect");
    let scope = Scope::new("acme", "op").expect("scope");
    let other_url = common::redis_url_with_db(0).expect("url");
    let mut other = redis::Client::open(other_url.as_str())
        .expect("client")
        .get_multiplexed_async_connection()
        .await
        .expect("second connection");
    for round in 0..3 {
        // Some operations first, so every connection the store would use
        // on this thread is open.
        for i in 0..3 {
            let k: idem::IdempotencyKey = format!("warm-{round}-{i}").parse().expect("key");
            let Reservation::Acquired(lease) = store
                .reserve(request(&scope, &k, Duration::from_secs(60)))
                .await
                .expect("reserve")
            else {
                panic!("a fresh key is acquired");
            };
            store
                .resolve(&scope, &k, &lease, &done(Duration::from_secs(60)))
                .await
                .expect("resolve");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let ids = clients_on(&mut other, IDLE_RESET_DB).await;
        assert_eq!(
            ids.len(),
            2,
            "round {round}: the shared connection and this thread's own: {ids:?}"
        );
        for id in &ids {
            kill_client(&mut other, *id).await;
        }
        // Idle for a moment: time to notice the reset, as a quiet
        // production link would have.
        tokio::time::sleep(Duration::from_millis(300)).await;
        let k: idem::IdempotencyKey = format!("after-{round}").parse().expect("key");
        let reserved = store
            .reserve(request(&scope, &k, Duration::from_secs(60)))
            .await;
        let Ok(Reservation::Acquired(lease)) = reserved else {
            panic!(
                "round {round}: the first operation after {} connection(s) were reset while idle: {reserved:?}",
                ids.len()
            );
        };
        store
            .resolve(&scope, &k, &lease, &done(Duration::from_secs(60)))
            .await
            .expect("resolve");
        let replaced = clients_on(&mut other, IDLE_RESET_DB).await;
        assert!(
            replaced.iter().all(|id| !ids.contains(id)),
            "round {round}: the old connections are gone"
        );
    }
}

/// A server from before RESP3 (Redis 5) on loopback: it refuses `HELLO`
/// as an unknown command, answers `PING` with `PONG` and anything else
/// with `OK`. Returns its address.
async fn resp2_only_server() -> std::net::SocketAddr {
    use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        while let Ok((socket, _)) = listener.accept().await {
            tokio::spawn(async move {
                let (read, mut write) = socket.into_split();
                let mut read = BufReader::new(read);
                let mut line = String::new();
                // One command: `*N` then N bulk strings `$len` + data.
                loop {
                    line.clear();
                    if read.read_line(&mut line).await.unwrap_or(0) == 0 {
                        return;
                    }
                    let Some(n) = line.trim_end().strip_prefix('*') else {
                        return;
                    };
                    let mut name = Vec::new();
                    for i in 0..n.parse::<usize>().unwrap_or(0) {
                        line.clear();
                        let _ = read.read_line(&mut line).await;
                        let len: usize = line.trim_end()[1..].parse().unwrap_or(0);
                        let mut data = vec![0; len + 2];
                        if read.read_exact(&mut data).await.is_err() {
                            return;
                        }
                        if i == 0 {
                            data.truncate(len);
                            name = data.to_ascii_uppercase();
                        }
                    }
                    let answer: &[u8] = match name.as_slice() {
                        b"HELLO" => b"-ERR unknown command 'HELLO'\r\n",
                        b"PING" => b"+PONG\r\n",
                        _ => b"+OK\r\n",
                    };
                    if write.write_all(answer).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    addr
}

/// A server that refuses `HELLO` is used on RESP2 (where a connection
/// reset while idle fails the next command); a URL that asks for RESP3
/// there is refused with one clear line.
#[tokio::test]
async fn a_server_without_resp3_is_used_on_resp2_unless_the_url_asks_for_it() {
    let addr = resp2_only_server().await;
    let store = RedisStore::connect(&format!("redis://{addr}"))
        .await
        .expect("connects on RESP2");
    let pong: String = redis::cmd("PING")
        .query_async(&mut store.connection())
        .await
        .expect("PING");
    assert_eq!(pong, "PONG");
    let Err(err) = RedisStore::connect(&format!("redis://{addr}/?protocol=resp3")).await else {
        panic!("RESP3 was asked for and the server refuses it");
    };
    let text = one_line(&err);
    assert!(text.contains("HELLO"), "{text}");
}

#[tokio::test]
async fn connection_errors_are_one_clear_line() {
    let err = RedisStore::connect("postgres://u:s3cret@127.0.0.1/db")
        .await
        .expect_err("wrong scheme");
    let text = one_line(&err);
    assert!(text.contains("must start with redis://"), "{text}");
    assert!(!text.contains("s3cret"), "{text}");

    let err = RedisStore::connect("redis://:s3cret@127.0.0.1:1/0")
        .await
        .expect_err("nothing listens on port 1");
    let text = one_line(&err);
    assert!(text.contains("connection refused"), "{text}");
    assert!(text.contains("redis://:***@127.0.0.1:1/0"), "{text}");
    assert!(StoreError::from(err).is_transient());

    let Some(url) = idem_testkit::services::redis() else {
        return;
    };
    let authority = url
        .split_once("://")
        .map(|(_, r)| r.split(['/', '?']).next().unwrap_or(r))
        .expect("authority");
    let host = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
    let err = RedisStore::connect(&format!("redis://idem-no-such-user:s3cret@{host}"))
        .await
        .expect_err("no such user");
    let text = one_line(&err);
    assert!(text.contains("authentication failed"), "{text}");
    assert!(!text.contains("s3cret"), "{text}");
}

#[tokio::test]
async fn braces_and_colons_in_names_stay_apart() {
    let Some(f) = common::Prefixed::new().await else {
        return;
    };
    let store = &f.redis;
    let unique = OwnerToken::random().to_string();
    // Names that would collide or break the hash tag if kept verbatim.
    let tenant_a = format!("t{{{unique}}}:x");
    let tenant_b = format!("t{{{unique}}}");
    let a = Scope::new(&tenant_a, "a:b").expect("scope");
    let b = Scope::new(&tenant_b, "x:a:b").expect("scope");
    let k: idem::IdempotencyKey = "{k}:*?[]".parse().expect("key");
    let Reservation::Acquired(lease) = store
        .reserve(request(&a, &k, Duration::from_secs(60)))
        .await
        .expect("reserve")
    else {
        panic!("acquired");
    };
    assert!(matches!(
        store
            .reserve(request(&b, &k, Duration::from_secs(60)))
            .await
            .expect("reserve"),
        Reservation::Acquired(_)
    ));
    store
        .resolve(&a, &k, &lease, &done(Duration::from_secs(60)))
        .await
        .expect("resolve");
    let rec = store.get(&a, &k).await.expect("get").expect("exists");
    assert_eq!(rec.scope, a);
    assert_eq!(rec.key, k);
    assert_eq!(rec.state, RecordState::Completed);
    assert_eq!(
        store.get(&b, &k).await.expect("get").map(|r| r.state),
        Some(RecordState::Processing)
    );
    // Listing one tenant never shows the other, though one name is a
    // prefix of the other.
    for (tenant, state) in [
        (&tenant_a, RecordState::Completed),
        (&tenant_b, RecordState::Processing),
    ] {
        let page = store
            .list(&ListFilter {
                tenant: Some(tenant.clone()),
                limit: 10,
                ..ListFilter::default()
            })
            .await
            .expect("list");
        assert_eq!(page.records.len(), 1, "{tenant}");
        assert_eq!(page.records[0].state, state);
    }
    // Exactly two keys, each with one hash tag.
    let names: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{}:*", store.prefix()))
        .query_async(&mut store.connection())
        .await
        .expect("KEYS");
    assert_eq!(names.len(), 2, "{names:?}");
    for name in names {
        assert_eq!(name.matches('{').count(), 1, "{name}");
        assert!(name.ends_with('}'), "{name}");
    }
}

#[tokio::test]
async fn only_final_records_expire() {
    let Some(f) = common::Prefixed::new().await else {
        return;
    };
    let store = &f.redis;
    let scope = Scope::new("acme", "op").expect("scope");
    let name = |k: &str| format!("{}:{{acme:op:{k}}}", store.prefix());
    let (p, u, c): (
        idem::IdempotencyKey,
        idem::IdempotencyKey,
        idem::IdempotencyKey,
    ) = (
        "processing".parse().expect("key"),
        "unknown".parse().expect("key"),
        "completed".parse().expect("key"),
    );
    for k in [&p, &u, &c] {
        let Reservation::Acquired(lease) = store
            .reserve(request(&scope, k, Duration::from_millis(50)))
            .await
            .expect("reserve")
        else {
            panic!("acquired");
        };
        if k == &u {
            store
                .mark_unknown(&scope, k, &lease, "timeout")
                .await
                .expect("mark");
        }
        if k == &c {
            store
                .resolve(&scope, k, &lease, &done(Duration::from_secs(60)))
                .await
                .expect("resolve");
        }
    }
    assert_eq!(pttl(store, &name("processing")).await, -1, "no TTL");
    assert_eq!(pttl(store, &name("unknown")).await, -1, "no TTL");
    let ttl = pttl(store, &name("completed")).await;
    assert!((55_000..=60_000).contains(&ttl), "retention as TTL: {ttl}");
    tokio::time::sleep(Duration::from_millis(100)).await;
    // Lapsed leases: still there.
    assert!(store.get(&scope, &p).await.expect("get").is_some());
    assert!(
        store
            .get(&scope, &u)
            .await
            .expect("get")
            .is_some_and(|r| r.is_outcome_unknown())
    );
}

#[tokio::test]
async fn cached_copies_live_until_their_lease_or_expiry() {
    let Some(f) = common::Prefixed::new().await else {
        return;
    };
    let store = &f.redis;
    let scope = Scope::new("acme", "op").expect("scope");
    let now = Timestamp::now();
    let copy = |key: &str, state: RecordState, until: Timestamp| Record {
        scope: scope.clone(),
        key: key.parse().expect("key"),
        fingerprint: Fingerprint::builder().part("k", b"v").finish(),
        state,
        created_at: now,
        updated_at: now,
        expires_at: until,
        lease: idem::Lease {
            owner: OwnerToken::random(),
            attempt: 1,
            locked_until: until,
        },
        response: state
            .is_final()
            .then(|| StoredResponse::new(200, "ok").with_header("x", "y")),
        resource_id: None,
        error_code: None,
    };
    let live = copy(
        "live",
        RecordState::Processing,
        now.plus(Duration::from_millis(300)),
    );
    store.put(live.clone()).await.expect("put");
    assert_eq!(
        store.get(&scope, &live.key).await.expect("get"),
        Some(live.clone())
    );
    // Renewing the copy's lease keeps the copy alive with it.
    let until = store
        .renew(&scope, &live.key, &live.lease, Duration::from_secs(5))
        .await
        .expect("renew");
    assert!(until > live.lease.locked_until);

    let short = copy(
        "short",
        RecordState::Processing,
        now.plus(Duration::from_millis(300)),
    );
    store.put(short.clone()).await.expect("put");
    let stale = copy(
        "stale",
        RecordState::Completed,
        now.minus(Duration::from_secs(1)),
    );
    store.put(stale.clone()).await.expect("put");
    assert_eq!(store.get(&scope, &stale.key).await.expect("get"), None);
    let fin = copy(
        "final",
        RecordState::Completed,
        now.plus(Duration::from_secs(60)),
    );
    store.put(fin.clone()).await.expect("put");

    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(store.get(&scope, &short.key).await.expect("get"), None);
    assert!(store.get(&scope, &live.key).await.expect("get").is_some());
    assert_eq!(
        store.get(&scope, &fin.key).await.expect("get"),
        Some(fin.clone())
    );
    store.evict(&scope, &fin.key).await.expect("evict");
    assert_eq!(store.get(&scope, &fin.key).await.expect("get"), None);
}
