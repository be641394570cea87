//! Shared test helpers: a database schema of the test's own.

#![allow(dead_code, unreachable_pub)]

use std::error::Error;

use idem_postgres::sqlx::{self, PgPool};
use idem_postgres::{PgOptions, PgStore};
use idem_testkit::isolated::PgSchema;

/// A database schema of the test's own, with the idem tables and an
/// `orders` table; dropped with this when it made the schema.
pub struct Db {
    pub store: PgStore,
    pub schema: String,
    pub url: String,
    /// Dropped last, after the store's connections: the schema, when
    /// [`Db::new`] made it (a child process that opens it leaves it).
    guard: Option<PgSchema>,
}

impl Db {
    pub async fn new(label: &str) -> Option<Self> {
        let guard = PgSchema::new(label)?;
        let mut db = Self::open(&guard.url(), guard.name().to_owned())
            .await
            .expect("database");
        db.guard = Some(guard);
        Some(db)
    }

    pub async fn open(url: &str, schema: String) -> Result<Self, Box<dyn Error + Send + Sync>> {
        let opts = PgOptions::from_url(url)?;
        let store = PgStore::connect_with(opts).await?;
        sqlx::query(
            "CREATE TABLE IF NOT EXISTS orders (id text PRIMARY KEY, paid_count int NOT NULL DEFAULT 0, \
             applied text[] NOT NULL DEFAULT '{}')",
        )
        .execute(store.pool())
        .await?;
        sqlx::query(
            "CREATE TABLE IF NOT EXISTS payments_applied (payment_id text PRIMARY KEY, order_id text NOT NULL)",
        )
        .execute(store.pool())
        .await?;
        Ok(Self {
            store,
            schema,
            url: url.to_owned(),
            guard: None,
        })
    }

    pub fn pool(&self) -> PgPool {
        self.store.pool().clone()
    }

    pub async fn scalar(&self, sql: &str) -> i64 {
        sqlx::query_scalar(sql)
            .fetch_one(self.store.pool())
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"))
    }

    pub async fn applied(&self, order: &str) -> Vec<String> {
        sqlx::query_scalar("SELECT applied FROM orders WHERE id = $1")
            .bind(order)
            .fetch_one(self.store.pool())
            .await
            .expect("applied")
    }

    /// Closes the store's connections; the schema goes with `self`.
    pub async fn drop(self) {
        self.store.close().await;
    }
}

/// A name no other test run uses.
pub fn unique(label: &str) -> String {
    format!("t{label}{}", &idem::OwnerToken::random().to_string()[..8])
}

/// Creates a JetStream stream on the shared NATS server, trying again on
/// a refusal. nats-server 2.9 can refuse with error 10049 ("error creating
/// store for stream") while another test deletes the account's last
/// stream: its log then says the account's `streams` directory is gone.
/// A second try, a moment later, finds the directory made again.
pub async fn create_stream<F, Fut, E>(mut create: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<(), E>>,
    E: std::fmt::Display,
{
    const TRIES: u32 = 5;
    for attempt in 1..=TRIES {
        match create().await {
            Ok(()) => return,
            Err(err) if attempt < TRIES => {
                eprintln!("creating the stream failed (try {attempt} of {TRIES}): {err}");
                tokio::time::sleep(std::time::Duration::from_millis(200)).await;
            }
            Err(err) => panic!("creating the stream failed {TRIES} times: {err}"),
        }
    }
}
