//! Room of a test's own on a shared server: a PostgreSQL schema, a MySQL
//! database, a DynamoDB table and a Redis key prefix that no other test
//! uses, removed when dropped.
//!
//! The tests of a binary run side by side against the same loopback
//! servers, so each keeps to its own schema or prefix. Both clean up in
//! `Drop`, so a test that fails an assertion leaves nothing behind either.
//!
//! ```no_run
//! # async fn t() {
//! let Some(schema) = idem_testkit::isolated::PgSchema::new("relay") else { return };
//! // `schema.url()` is the test server's URL with `schema=<name>`: a store
//! // made from it keeps its tables there, and the schema goes with `schema`.
//! # let _ = schema.url();
//! # }
//! ```

use std::time::Duration;

use idem::OwnerToken;

/// How long a clean-up may take before it gives up (and says so).
const CLEAN_UP_TIMEOUT: Duration = Duration::from_secs(30);

/// A name no other test run uses: `{label}_{random}`, lowercase letters,
/// digits and `_` (a label with anything else is the caller's bug).
fn unique(label: &str) -> String {
    assert!(
        label
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_'),
        "a label is lowercase letters, digits and _: {label:?}"
    );
    format!("{label}_{}", &OwnerToken::random().to_string()[..12])
}

/// Runs `work` on a runtime of its own, on a thread of its own: `Drop`
/// may run inside a test's runtime, where blocking on it would stall.
fn on_own_runtime<F>(work: F) -> Result<(), String>
where
    F: std::future::Future<Output = Result<(), String>> + Send + 'static,
{
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| format!("a runtime for the clean-up: {e}"))?;
        runtime.block_on(async {
            tokio::time::timeout(CLEAN_UP_TIMEOUT, work)
                .await
                .map_err(|_| format!("no answer within {CLEAN_UP_TIMEOUT:?}"))?
        })
    })
    .join()
    .unwrap_or_else(|_| Err("the clean-up panicked".to_owned()))
}

/// A PostgreSQL schema of one test's own on the test server, dropped with
/// everything in it (`CASCADE`) when this is dropped.
///
/// The schema is not made here: a store made from [`PgSchema::url`]
/// migrates into it, or the test makes it ([`PgSchema::name`]).
#[derive(Debug)]
pub struct PgSchema {
    server: String,
    name: String,
}

impl PgSchema {
    /// A fresh schema name on the test server (`idem_test_{label}_…`), or
    /// `None` when there is no server (the test skips, loudly; see
    /// [`crate::services`]).
    pub fn new(label: &str) -> Option<Self> {
        let server = crate::services::postgres()?;
        Some(Self::on(&server, label))
    }

    /// A fresh schema name on `server`, a `postgres://` URL.
    pub fn on(server: &str, label: &str) -> Self {
        Self {
            server: server.to_owned(),
            name: unique(&format!("idem_test_{label}")),
        }
    }

    /// The schema's name (it needs no quoting).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The server's URL, without the schema.
    pub fn server(&self) -> &str {
        &self.server
    }

    /// The server's URL with `schema=<name>` added: what a store or the
    /// gateway is given to keep its tables in the schema.
    pub fn url(&self) -> String {
        let join = if self.server.contains('?') { '&' } else { '?' };
        format!("{}{join}schema={}", self.server, self.name)
    }
}

impl Drop for PgSchema {
    fn drop(&mut self) {
        let (server, name) = (self.server.clone(), self.name.clone());
        let dropped = on_own_runtime(async move {
            use sqlx::Connection as _;
            let mut conn = sqlx::PgConnection::connect(&server)
                .await
                .map_err(|e| e.to_string())?;
            sqlx::query(&format!("DROP SCHEMA IF EXISTS \"{name}\" CASCADE"))
                .execute(&mut conn)
                .await
                .map_err(|e| e.to_string())?;
            conn.close().await.map_err(|e| e.to_string())
        });
        if let Err(err) = dropped {
            eprintln!("dropping the test schema {}: {err}", self.name);
        }
    }
}

/// A MySQL (or MariaDB) database of one test's own on the test server,
/// created here and dropped with everything in it when this is dropped.
///
/// MySQL has no schemas inside a database, and a store's URL names its
/// database, so a test's own room is a database: [`MysqlDatabase::url`]
/// is the test server's URL pointed at it.
#[derive(Debug)]
pub struct MysqlDatabase {
    server: String,
    name: String,
}

impl MysqlDatabase {
    /// A fresh database (`idem_test_{label}_…`) on the test server, or
    /// `None` when there is no server (the test skips, loudly; see
    /// [`crate::services`]). Panics if the server refuses to create it.
    pub fn new(label: &str) -> Option<Self> {
        let server = crate::services::mysql()?;
        Some(Self::on(&server, label))
    }

    /// A fresh database on `server`, a `mysql://` URL.
    pub fn on(server: &str, label: &str) -> Self {
        let db = Self {
            server: server.to_owned(),
            name: unique(&format!("idem_test_{label}")),
        };
        let statement = format!("CREATE DATABASE `{}`", db.name);
        if let Err(err) = mysql_admin(server, statement) {
            panic!("creating the test database {}: {err}", db.name);
        }
        db
    }

    /// The database's name (it needs no quoting).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The server's URL, as the environment gives it.
    pub fn server(&self) -> &str {
        &self.server
    }

    /// The server's URL with its database replaced by this one, its query
    /// kept: what a store is given to keep its tables there.
    pub fn url(&self) -> String {
        with_database(&self.server, &self.name)
    }
}

/// `url` (`mysql://user@host:port/db?query`) naming `database` instead.
fn with_database(url: &str, database: &str) -> String {
    let (scheme, rest) = url.split_once("://").unwrap_or(("mysql", url));
    let (before_query, query) = rest
        .split_once('?')
        .map_or((rest, None), |(b, q)| (b, Some(q)));
    let authority = before_query.split('/').next().unwrap_or(before_query);
    match query {
        Some(query) => format!("{scheme}://{authority}/{database}?{query}"),
        None => format!("{scheme}://{authority}/{database}"),
    }
}

/// Runs one statement on `server` on a connection of its own.
fn mysql_admin(server: &str, statement: String) -> Result<(), String> {
    let server = server.to_owned();
    on_own_runtime(async move {
        use sqlx::Connection as _;
        let mut conn = sqlx::MySqlConnection::connect(&server)
            .await
            .map_err(|e| e.to_string())?;
        sqlx::query(&statement)
            .execute(&mut conn)
            .await
            .map_err(|e| e.to_string())?;
        conn.close().await.map_err(|e| e.to_string())
    })
}

impl Drop for MysqlDatabase {
    fn drop(&mut self) {
        let statement = format!("DROP DATABASE IF EXISTS `{}`", self.name);
        if let Err(err) = mysql_admin(&self.server, statement) {
            eprintln!("dropping the test database {}: {err}", self.name);
        }
    }
}

/// A DynamoDB table of one test's own on the test server (an emulator),
/// deleted when this is dropped.
///
/// The table is not made here: a store made from [`DynamoTable::url`]
/// creates it (`migrate`). The clean-up is a plain `DeleteTable` request
/// with a placeholder signature, which an emulator accepts; against AWS
/// itself it is refused, and the drop says so.
#[derive(Debug)]
pub struct DynamoTable {
    server: String,
    name: String,
}

impl DynamoTable {
    /// A fresh table name (`idem_test_{label}_…`) on the test server, or
    /// `None` when there is no server (see [`crate::services`]).
    pub fn new(label: &str) -> Option<Self> {
        let server = crate::services::dynamodb()?;
        Some(Self::on(&server, label))
    }

    /// A fresh table name on `server`, a `dynamodb://` URL.
    pub fn on(server: &str, label: &str) -> Self {
        Self {
            server: server.to_owned(),
            name: unique(&format!("idem_test_{label}")),
        }
    }

    /// The table's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The server's URL with its table replaced by this one, its query
    /// (region, endpoint) kept.
    pub fn url(&self) -> String {
        let query = self.server.split_once('?').map_or("", |(_, query)| query);
        if query.is_empty() {
            format!("dynamodb://{}", self.name)
        } else {
            format!("dynamodb://{}?{query}", self.name)
        }
    }
}

/// The `endpoint=` and `region=` of a `dynamodb://` URL.
fn dynamo_endpoint(url: &str) -> Option<(String, String)> {
    let query = url.split_once('?')?.1;
    let option = |name: &str| {
        query
            .split('&')
            .find_map(|pair| pair.strip_prefix(name))
            .map(str::to_owned)
    };
    Some((
        option("endpoint=")?,
        option("region=").unwrap_or_else(|| "us-east-1".to_owned()),
    ))
}

impl Drop for DynamoTable {
    fn drop(&mut self) {
        let Some((endpoint, region)) = dynamo_endpoint(&self.server) else {
            eprintln!(
                "the test table {} is left: {} names no endpoint",
                self.name, self.server
            );
            return;
        };
        let name = self.name.clone();
        let deleted = on_own_runtime(async move {
            use http_body_util::{BodyExt as _, Full};
            use hyper_util::client::legacy::Client;
            use hyper_util::rt::TokioExecutor;
            let client: Client<_, Full<bytes::Bytes>> =
                Client::builder(TokioExecutor::new()).build_http();
            let body = serde_json::json!({ "TableName": name }).to_string();
            let request = http::Request::post(endpoint.as_str())
                .header("content-type", "application/x-amz-json-1.0")
                .header("x-amz-target", "DynamoDB_20120810.DeleteTable")
                .header(
                    "authorization",
                    format!(
                        "AWS4-HMAC-SHA256 Credential=idem-test/20000101/{region}/dynamodb/aws4_request, SignedHeaders=host, Signature=0"
                    ),
                )
                .body(Full::new(bytes::Bytes::from(body)))
                .map_err(|e| e.to_string())?;
            let answer = client.request(request).await.map_err(|e| e.to_string())?;
            let status = answer.status();
            let text = answer
                .into_body()
                .collect()
                .await
                .map_err(|e| e.to_string())?
                .to_bytes();
            let text = String::from_utf8_lossy(&text);
            // A table never created (the test failed before) is no error.
            if status.is_success() || text.contains("ResourceNotFoundException") {
                Ok(())
            } else {
                Err(format!("{status}: {text}"))
            }
        });
        if let Err(err) = deleted {
            eprintln!("deleting the test table {}: {err}", self.name);
        }
    }
}

/// A Redis key prefix of one test's own, every key under which is deleted
/// on every node the URL names when this is dropped (records in flight
/// have no time to live, and would otherwise stay in the shared Redis).
#[derive(Debug)]
pub struct RedisPrefix {
    url: String,
    name: String,
}

impl RedisPrefix {
    /// A fresh prefix (`idemtest_{label}_…`) on the test Redis, or `None`
    /// when there is none (see [`crate::services`]).
    pub fn new(label: &str) -> Option<Self> {
        let url = crate::services::redis()?;
        Some(Self::on(&url, label))
    }

    /// A fresh prefix on `url`: a `redis://` server or a
    /// `redis+cluster://` list of nodes, each of which is cleaned.
    pub fn on(url: &str, label: &str) -> Self {
        Self {
            url: url.to_owned(),
            name: unique(&format!("idemtest_{label}")),
        }
    }

    /// The prefix.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The servers whose keys under the prefix go when it is dropped
    /// ([`redis_nodes`]).
    pub fn nodes(&self) -> Vec<String> {
        redis_nodes(&self.url)
    }

    /// The URL with `prefix=<name>` added: what a store or the gateway is
    /// given to keep its keys under the prefix.
    pub fn url(&self) -> String {
        let join = if self.url.contains('?') { '&' } else { '?' };
        format!("{}{join}prefix={}", self.url, self.name)
    }
}

/// The servers a Redis URL names, each as a `redis://` URL: the one
/// server, or each node of a `redis+cluster://` URL, where the keys of its
/// own slots live.
pub fn redis_nodes(url: &str) -> Vec<String> {
    match url.strip_prefix("redis+cluster://") {
        Some(hosts) => hosts
            .split(['/', '?'])
            .next()
            .unwrap_or(hosts)
            .split(',')
            .map(|h| format!("redis://{h}"))
            .collect(),
        None => vec![url.split('?').next().unwrap_or(url).to_owned()],
    }
}

impl Drop for RedisPrefix {
    fn drop(&mut self) {
        let pattern = format!("{}:*", self.name);
        for node in self.nodes() {
            let cleaned = (|| -> redis::RedisResult<()> {
                let client = redis::Client::open(node.as_str())?;
                let mut conn = client.get_connection_with_timeout(CLEAN_UP_TIMEOUT)?;
                let names: Vec<Vec<u8>> = redis::cmd("KEYS").arg(&pattern).query(&mut conn)?;
                for chunk in names.chunks(500) {
                    redis::cmd("DEL").arg(chunk).query::<()>(&mut conn)?;
                }
                Ok(())
            })();
            if let Err(err) = cleaned {
                eprintln!("deleting the test keys {pattern} on {node}: {err}");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_fresh_and_urls_keep_their_query() {
        let a = PgSchema::on("postgres://db/test", "relay");
        let b = PgSchema::on("postgres://db/test?max_connections=4", "relay");
        assert_ne!(a.name(), b.name());
        assert!(a.name().starts_with("idem_test_relay_"), "{}", a.name());
        assert_eq!(a.url(), format!("postgres://db/test?schema={}", a.name()));
        assert_eq!(
            b.url(),
            format!("postgres://db/test?max_connections=4&schema={}", b.name())
        );
        // Nothing was made on the made-up server, and dropping says so
        // rather than failing the test.
        std::mem::forget(a);
        std::mem::forget(b);

        let p = RedisPrefix::on("redis://127.0.0.1:1/0", "tiered");
        assert!(p.name().starts_with("idemtest_tiered_"), "{}", p.name());
        assert_eq!(
            p.url(),
            format!("redis://127.0.0.1:1/0?prefix={}", p.name())
        );
        std::mem::forget(p);
    }

    #[test]
    fn a_mysql_url_is_pointed_at_the_test_database() {
        assert_eq!(
            with_database("mysql://root@127.0.0.1:3306/test", "idem_test_x"),
            "mysql://root@127.0.0.1:3306/idem_test_x"
        );
        assert_eq!(
            with_database("mysql://u:p@db/test?ssl-mode=disabled", "d"),
            "mysql://u:p@db/d?ssl-mode=disabled"
        );
        assert_eq!(with_database("mysql://db", "d"), "mysql://db/d");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_dropped_mysql_database_is_gone_with_its_tables() {
        use sqlx::Connection as _;
        let Some(db) = MysqlDatabase::new("isolated") else {
            return;
        };
        let mut conn = sqlx::MySqlConnection::connect(&db.url())
            .await
            .expect("connect to the test database");
        sqlx::query("CREATE TABLE t (id int)")
            .execute(&mut conn)
            .await
            .expect("create a table in it");
        let name = db.name().to_owned();
        let count = "SELECT COUNT(*) FROM information_schema.schemata WHERE schema_name = ?";
        let before: i64 = sqlx::query_scalar(count)
            .bind(&name)
            .fetch_one(&mut conn)
            .await
            .expect("count");
        conn.close().await.expect("close");
        drop(db);
        let server = crate::services::mysql().expect("the same server");
        let mut conn = sqlx::MySqlConnection::connect(&server)
            .await
            .expect("connect");
        let after: i64 = sqlx::query_scalar(count)
            .bind(&name)
            .fetch_one(&mut conn)
            .await
            .expect("count");
        assert_eq!((before, after), (1, 0), "{name}");
    }

    #[test]
    fn every_node_of_a_cluster_url_is_cleaned() {
        assert_eq!(
            redis_nodes("redis+cluster://127.0.0.1:7000,127.0.0.1:7001?prefix=x"),
            ["redis://127.0.0.1:7000", "redis://127.0.0.1:7001"]
        );
        assert_eq!(
            redis_nodes("redis://127.0.0.1:6379/2?prefix=x"),
            ["redis://127.0.0.1:6379/2"]
        );
    }

    #[test]
    #[should_panic(expected = "a label is lowercase letters")]
    fn a_label_that_needs_quoting_is_refused() {
        let _ = unique("Bad Label");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_dropped_schema_is_gone_with_its_tables() {
        use sqlx::Connection as _;
        let Some(schema) = PgSchema::new("isolated") else {
            return;
        };
        let mut conn = sqlx::PgConnection::connect(schema.server())
            .await
            .expect("connect");
        let name = schema.name().to_owned();
        sqlx::query(&format!("CREATE SCHEMA \"{name}\""))
            .execute(&mut conn)
            .await
            .expect("create the schema");
        sqlx::query(&format!("CREATE TABLE \"{name}\".t (id int)"))
            .execute(&mut conn)
            .await
            .expect("create a table in it");
        let count = "SELECT count(*) FROM pg_namespace WHERE nspname = $1";
        let before: i64 = sqlx::query_scalar(count)
            .bind(&name)
            .fetch_one(&mut conn)
            .await
            .expect("count");
        drop(schema);
        let after: i64 = sqlx::query_scalar(count)
            .bind(&name)
            .fetch_one(&mut conn)
            .await
            .expect("count");
        assert_eq!((before, after), (1, 0), "{name}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_dropped_prefix_takes_its_keys_and_no_others() {
        let Some(prefix) = RedisPrefix::new("isolated") else {
            return;
        };
        let url = crate::services::redis().expect("the same server");
        let client = redis::Client::open(url.as_str()).expect("client");
        let mut conn = client.get_connection().expect("connect");
        let mine = format!("{}:{{t:op:k}}", prefix.name());
        let other = format!("{}x:{{t:op:k}}", prefix.name());
        for key in [&mine, &other] {
            redis::cmd("SET")
                .arg(key)
                .arg("v")
                .query::<()>(&mut conn)
                .expect("SET");
        }
        drop(prefix);
        let exists = |key: &str, conn: &mut redis::Connection| -> i64 {
            redis::cmd("EXISTS").arg(key).query(conn).expect("EXISTS")
        };
        assert_eq!(exists(&mine, &mut conn), 0, "its keys are gone");
        assert_eq!(exists(&other, &mut conn), 1, "a longer prefix is another's");
        redis::cmd("DEL")
            .arg(&other)
            .query::<()>(&mut conn)
            .expect("DEL");
    }
}
