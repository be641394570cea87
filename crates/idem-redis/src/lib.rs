//! # idem-redis — the Redis store
//!
//! A [`Store`] in Redis, for a fast, bounded window of deduplication, and
//! the natural fast tier of [`idem::Tiered`] (it implements
//! [`CacheStore`]).
//!
//! * **one Lua script per transition** (`scripts/*.lua`): reserve-or-report,
//!   resolve-if-owner, release-if-owner, mark-unknown-if-owner,
//!   renew-if-owner. Each runs atomically on the server, so reservation is
//!   one create-if-absent and every owner operation is fenced by owner
//!   token and attempt;
//! * **one clock**: the scripts read `TIME` on the server, never a client's
//!   clock;
//! * **cluster-safe keys**: one hash per record at
//!   `<prefix>:{<tenant>:<operation>:<key>}`, the parts percent-encoded so
//!   `{`, `}` and `:` in them stay unambiguous and inside one hash tag;
//! * **Redis Cluster** behind the `cluster` feature
//!   (`redis+cluster://host1:port1,host2:port2`): each record's script runs
//!   on the node owning its slot, so each record's times come from that one
//!   node's clock; listing scans every primary;
//! * **replicated acknowledgements** on request (`?min_replicas=N`,
//!   [`RedisOptions::with_min_replicas`]): each write is followed by `WAIT
//!   N` on the node holding the record, so a failover to a replica that
//!   had it loses nothing acknowledged; without it Redis replicates after
//!   acknowledging, and a primary that dies first takes the write along;
//! * **reconnects** through redis' `ConnectionManager`: a dropped
//!   connection fails the commands in flight with
//!   [`StoreError::Unavailable`] and the next ones go through a new
//!   connection. The store speaks RESP3 unless the URL sets `protocol=`
//!   (or the server predates it), so a connection that closes while idle
//!   is replaced as it closes and no command fails on it;
//! * **a connection per serving thread**: on a thread given to
//!   [`dedicate_current_thread`](idem::store::local::dedicate_current_thread)
//!   (the gateway's serving threads), the store opens a connection of that
//!   thread's own, so a round trip wakes no other thread. Elsewhere every
//!   call shares one connection.
//!
//! ```no_run
//! use idem::{Engine, Fingerprint, Scope, StoredResponse};
//! use idem_redis::RedisStore;
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let store = RedisStore::connect("redis://127.0.0.1:6379").await?;
//! let engine = Engine::new(store);
//! let scope = Scope::new("acme", "POST /v1/payments")?;
//! let key = "pay-17".parse()?;
//! let fp = Fingerprint::builder().json_body(br#"{"amount":100}"#).finish();
//! engine
//!     .run(&scope, &key, fp, || async { StoredResponse::new(201, "paid") })
//!     .await?;
//! # Ok(())
//! # }
//! ```
//!
//! ## Expiry, and what Redis can lose
//!
//! * A **final** record (completed or failed) expires at its retention
//!   (`PEXPIREAT`): Redis deletes it, so [`Purge::purge_expired`] has
//!   nothing left to do and reports 0.
//! * A **processing** record has **no TTL**: it never vanishes while its
//!   lease is live, and one marked outcome-unknown is never removed
//!   automatically. It goes away only by release, or by being resolved and
//!   later expiring. An owner that crashed and is never retried leaves its
//!   record behind: list processing records
//!   ([`ListRecords::list`] with a state filter) to find them.
//! * **Redis-only risks.** Redis answers a write before it reaches the disk
//!   (and replication is asynchronous): a crash or fail-over can lose the
//!   last writes, including a reservation, so a duplicate may run after
//!   one. Under `maxmemory`, an `allkeys-*` eviction policy may evict *any*
//!   record, processing and outcome-unknown ones included; `volatile-*`
//!   policies may evict final records early (a later duplicate then runs
//!   again). Use `maxmemory-policy noeviction` for a Redis-only store, and
//!   put PostgreSQL behind it with [`idem::Tiered`] when a lost record must
//!   never mean a repeated side effect.
//! * [`ListRecords::list`] scans every record key (`SCAN`, filtered by
//!   tenant when given) and sorts on the client: its cost grows with the
//!   number of records, so it is for operators, not for request paths.

mod connection;
mod error;
mod keys;
mod ops;
mod options;
mod record;

use std::fmt;
use std::sync::{Arc, LazyLock};
use std::time::Duration;

use idem::store::backend::QueryOptions;
use idem::{
    CacheStore, FinalOutcome, IdempotencyKey, Lease, LeaseExpiry, ListFilter, ListRecords, Page,
    Purge, Record, RecordState, Reservation, ReserveRequest, Scope, Store, StoreError, Timestamp,
};
use redis::aio::ConnectionManagerConfig;
use redis::{Script, Value};

use ops::*;

pub use connection::RedisConnection;
pub use error::RedisError;
pub use options::RedisOptions;
/// The driver, re-exported so users never mismatch versions.
pub use redis;

/// Longest lease or retention stored (100 years); longer ones are capped.
const MAX_DURATION_MS: i64 = 100 * 365 * 86_400 * 1_000;

/// Keys fetched per pipelined round trip while listing.
const LIST_CHUNK: usize = 512;

macro_rules! script {
    ($file:literal) => {
        LazyLock::new(|| {
            Script::new(concat!(
                include_str!("../scripts/prelude.lua"),
                include_str!(concat!("../scripts/", $file))
            ))
        })
    };
}

static RESERVE: LazyLock<Script> = script!("reserve.lua");
static RESOLVE: LazyLock<Script> = script!("resolve.lua");
static RELEASE: LazyLock<Script> = script!("release.lua");
static MARK_UNKNOWN: LazyLock<Script> = script!("mark_unknown.lua");
static RENEW: LazyLock<Script> = script!("renew.lua");
static GET: LazyLock<Script> = script!("get.lua");
static PUT: LazyLock<Script> = script!("put.lua");

/// The Redis [`Store`]; see the [crate docs](crate). Cheap to clone:
/// clones share the connection.
#[derive(Clone)]
pub struct RedisStore {
    conn: RedisConnection,
    /// Opens connections of a thread's own (single server only).
    own: Option<Arc<connection::PerThreadConnections>>,
    prefix: Arc<str>,
    url: Arc<str>,
    /// `WAIT` after each write: replicas, and the longest wait in ms.
    min_replicas: u32,
    replica_wait_ms: i64,
}

impl fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisStore")
            .field("url", &self.url)
            .field("prefix", &self.prefix)
            .finish_non_exhaustive()
    }
}

impl RedisStore {
    /// Connects with default options to the server named by a URL.
    pub async fn connect(url: &str) -> Result<Self, RedisError> {
        Self::connect_with(RedisOptions::from_url(url)?).await
    }

    /// Connects with explicit options; fails at once, with one line, when
    /// the server cannot be reached or refuses the credentials.
    pub async fn connect_with(opts: RedisOptions) -> Result<Self, RedisError> {
        let shown = idem::store::redact_url(opts.url());
        if !keys::valid_prefix(opts.prefix()) {
            return Err(RedisError::Url {
                url: shown,
                reason: options::invalid_prefix(opts.prefix()),
            });
        }
        if !opts.cluster_nodes().is_empty() {
            return Self::connect_cluster(opts, shown).await;
        }
        let bad_url = |e: redis::RedisError| RedisError::Url {
            url: shown.clone(),
            reason: e.to_string(),
        };
        let mut info =
            redis::IntoConnectionInfo::into_connection_info(opts.url()).map_err(bad_url)?;
        // RESP3 unless the URL chose: on it the driver learns of a
        // connection that closes while idle and replaces it at once,
        // instead of failing the next command on it.
        let chosen = QueryOptions::split(opts.url())
            .1
            .any(|option| option.name() == "protocol");
        if !chosen {
            info.redis.protocol = redis::ProtocolVersion::RESP3;
        }
        let mut client = redis::Client::open(info.clone()).map_err(bad_url)?;
        // A first, direct connection and PING, so a wrong address or
        // password fails now, clearly, instead of after the retries.
        if let Err(err) = probe(&client, &opts).await {
            // A server from before RESP3 (Redis 5) refuses `HELLO`.
            if chosen || err.kind() != redis::ErrorKind::ResponseError {
                return Err(RedisError::connect(opts.url(), err));
            }
            tracing::warn!(%err, "the Redis server does not speak RESP3; a connection that closes while idle fails the next command on it");
            info.redis.protocol = redis::ProtocolVersion::RESP2;
            client = redis::Client::open(info).map_err(bad_url)?;
            probe(&client, &opts)
                .await
                .map_err(|e| RedisError::connect(opts.url(), e))?;
        }
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(opts.connect_timeout())
            .set_response_timeout(opts.response_timeout())
            .set_number_of_retries(opts.reconnect_retries())
            .set_max_delay(1_000);
        let conn = client
            .get_connection_manager_with_config(config.clone())
            .await
            .map_err(|e| RedisError::connect(opts.url(), e))?;
        let mut store = Self::with_connection(RedisConnection::Single(conn), &opts, shown);
        store.own = Some(Arc::new(connection::PerThreadConnections::new(
            client, config,
        )));
        Ok(store)
    }

    #[cfg(feature = "cluster")]
    async fn connect_cluster(opts: RedisOptions, shown: String) -> Result<Self, RedisError> {
        let client = redis::cluster::ClusterClient::builder(opts.cluster_nodes().to_vec())
            .connection_timeout(opts.connect_timeout())
            .response_timeout(opts.response_timeout())
            .retries(u32::try_from(opts.reconnect_retries()).unwrap_or(u32::MAX))
            .build()
            .map_err(|e| RedisError::Url {
                url: shown.clone(),
                reason: e.to_string(),
            })?;
        let mut conn = client
            .get_async_connection()
            .await
            .map_err(|e| RedisError::connect(opts.url(), e))?;
        redis::cmd("PING")
            .query_async::<()>(&mut conn)
            .await
            .map_err(|e| RedisError::connect(opts.url(), e))?;
        Ok(Self::with_connection(
            RedisConnection::Cluster(conn),
            &opts,
            shown,
        ))
    }

    #[cfg(not(feature = "cluster"))]
    async fn connect_cluster(_opts: RedisOptions, shown: String) -> Result<Self, RedisError> {
        Err(RedisError::Url {
            url: shown,
            reason: "cluster nodes need idem-redis built with its `cluster` feature".to_owned(),
        })
    }

    fn with_connection(conn: RedisConnection, opts: &RedisOptions, shown: String) -> Self {
        Self {
            conn,
            own: None,
            prefix: opts.prefix().into(),
            url: shown.into(),
            min_replicas: opts.min_replicas(),
            replica_wait_ms: millis(opts.replica_wait()).max(1),
        }
    }

    /// The store's connection (shared, reconnecting), for commands of your
    /// own.
    pub fn connection(&self) -> RedisConnection {
        self.conn.clone()
    }

    /// The connection for one operation: this thread's own on a thread
    /// given to [`idem::store::local::dedicate_current_thread`], once open;
    /// else the shared one. A write and the `WAIT` after it go on the same
    /// one.
    fn conn(&self) -> RedisConnection {
        self.own
            .as_ref()
            .and_then(|own| own.get())
            .map_or_else(|| self.conn.clone(), RedisConnection::Single)
    }

    /// Every record key matching `pattern`, on every primary of a cluster.
    async fn scan(&self, pattern: &str) -> Result<Vec<Vec<u8>>, StoreError> {
        let scan = |cursor: u64| {
            let mut cmd = redis::cmd("SCAN");
            cmd.arg(cursor)
                .arg("MATCH")
                .arg(pattern)
                .arg("COUNT")
                .arg(1_000);
            cmd
        };
        let mut names: Vec<Vec<u8>> = Vec::new();
        match &self.conn {
            RedisConnection::Single(_) => {
                let mut conn = self.conn.clone();
                let mut cursor = 0;
                loop {
                    let (next, batch): (u64, Vec<Vec<u8>>) = scan(cursor)
                        .query_async(&mut conn)
                        .await
                        .map_err(error::to_store)?;
                    names.extend(batch);
                    if next == 0 {
                        break;
                    }
                    cursor = next;
                }
            }
            #[cfg(feature = "cluster")]
            RedisConnection::Cluster(conn) => {
                use redis::cluster_routing::{RoutingInfo, SingleNodeRoutingInfo};
                let mut conn = conn.clone();
                let nodes: String = redis::cmd("CLUSTER")
                    .arg("NODES")
                    .query_async(&mut conn)
                    .await
                    .map_err(error::to_store)?;
                for (host, port) in connection::primaries(&nodes) {
                    let mut cursor = 0;
                    loop {
                        let routing = RoutingInfo::SingleNode(SingleNodeRoutingInfo::ByAddress {
                            host: host.clone(),
                            port,
                        });
                        let answer = conn
                            .route_command(&scan(cursor), routing)
                            .await
                            .map_err(error::to_store)?;
                        let (next, batch): (u64, Vec<Vec<u8>>) =
                            redis::from_owned_redis_value(answer).map_err(error::to_store)?;
                        names.extend(batch);
                        if next == 0 {
                            break;
                        }
                        cursor = next;
                    }
                }
            }
        }
        // SCAN may return a key more than once.
        names.sort_unstable();
        names.dedup();
        Ok(names)
    }

    /// The hashes at `names` (empty ones for keys gone since).
    async fn fetch(&self, names: &[Vec<u8>]) -> Result<Vec<Value>, StoreError> {
        let mut conn = self.conn.clone();
        let mut answers = Vec::with_capacity(names.len());
        match &self.conn {
            RedisConnection::Single(_) => {
                for chunk in names.chunks(LIST_CHUNK) {
                    let mut pipe = redis::pipe();
                    for name in chunk {
                        pipe.cmd("HGETALL").arg(name);
                    }
                    let batch: Vec<Value> =
                        pipe.query_async(&mut conn).await.map_err(error::to_store)?;
                    answers.extend(batch);
                }
            }
            // Keys of one pipeline may live on different nodes: one
            // command each, routed by slot.
            #[cfg(feature = "cluster")]
            RedisConnection::Cluster(_) => {
                for name in names {
                    answers.push(
                        redis::cmd("HGETALL")
                            .arg(name)
                            .query_async(&mut conn)
                            .await
                            .map_err(error::to_store)?,
                    );
                }
            }
        }
        Ok(answers)
    }

    /// The key prefix.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    fn key(&self, scope: &Scope, key: &IdempotencyKey) -> String {
        keys::record_key(&self.prefix, scope, key)
    }

    /// The server's clock.
    async fn now(&self) -> Result<Timestamp, StoreError> {
        let (secs, micros): (i64, i64) = redis::cmd("TIME")
            .query_async(&mut self.conn.clone())
            .await
            .map_err(error::to_store)?;
        Ok(Timestamp::from_millis(
            secs.saturating_mul(1_000).saturating_add(micros / 1_000),
        ))
    }

    /// Runs a fenced script on the record `name` answering 1 (done) or 0
    /// (not the owner); done, waits for its replicas.
    async fn fenced(
        &self,
        name: &str,
        invocation: &redis::ScriptInvocation<'_>,
    ) -> Result<(), StoreError> {
        let mut conn = self.conn();
        let done: i64 = invocation
            .invoke_async(&mut conn)
            .await
            .map_err(error::to_store)?;
        if done == 1 {
            self.replicated(&mut conn, name).await
        } else {
            Err(StoreError::Fenced)
        }
    }

    /// With `min_replicas`, waits until that many replicas of the node
    /// holding the record `name` have what this connection wrote so far
    /// (`WAIT`, sent to that node); fewer within the wait is the store
    /// being unavailable: the write may be lost in a failover.
    #[cfg_attr(
        not(feature = "cluster"),
        expect(unused_variables, reason = "the name routes WAIT in a cluster only")
    )]
    async fn replicated(&self, conn: &mut RedisConnection, name: &str) -> Result<(), StoreError> {
        if self.min_replicas == 0 {
            return Ok(());
        }
        let mut wait = redis::cmd("WAIT");
        wait.arg(self.min_replicas).arg(self.replica_wait_ms);
        let copies: i64 = match conn {
            RedisConnection::Single(conn) => wait.query_async(conn).await,
            #[cfg(feature = "cluster")]
            RedisConnection::Cluster(conn) => {
                use redis::cluster_routing::{Route, RoutingInfo, SingleNodeRoutingInfo, SlotAddr};
                let node = RoutingInfo::SingleNode(SingleNodeRoutingInfo::SpecificNode(
                    Route::new(keys::slot(name), SlotAddr::Master),
                ));
                conn.route_command(&wait, node)
                    .await
                    .and_then(|v| redis::from_redis_value(&v))
            }
        }
        .map_err(error::to_store)?;
        if copies < i64::from(self.min_replicas) {
            return Err(StoreError::unavailable(format!(
                "the write reached {copies} replica(s) within {} ms; min_replicas is {}",
                self.replica_wait_ms, self.min_replicas
            )));
        }
        Ok(())
    }
}

/// Connects once, directly, and sends `PING`.
async fn probe(client: &redis::Client, opts: &RedisOptions) -> redis::RedisResult<()> {
    let mut probe = client
        .get_multiplexed_async_connection_with_config(
            &redis::AsyncConnectionConfig::new()
                .set_connection_timeout(opts.connect_timeout())
                .set_response_timeout(opts.response_timeout()),
        )
        .await?;
    redis::cmd("PING").query_async::<()>(&mut probe).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn optional_texts() {
        assert_eq!(flagged(None), "0");
        assert_eq!(flagged(Some("")), "1");
        assert_eq!(flagged(Some("x")), "1x");
    }
}
