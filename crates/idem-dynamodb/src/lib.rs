//! # idem-dynamodb — the DynamoDB store
//!
//! A [`Store`](idem::Store) shared by any number of gateways or service instances, in
//! one DynamoDB table, with no server to run:
//!
//! * **atomic reservation**: a `PutItem` conditional on
//!   `attribute_not_exists(pk)` creates the record if absent (of two
//!   racers exactly one writes); the other reads the item (a strongly
//!   consistent read) and idem's rules on it, replacing or taking it over
//!   with writes conditional on the exact owner and attempt read, so two
//!   racers never both win;
//! * **fencing**: every resolution, release, mark and renewal is
//!   conditional on the owner token and the attempt, or changes nothing
//!   and reports [`StoreError::Fenced`](idem::StoreError::Fenced);
//! * **expiry by the table's TTL**: final records carry a `ttl` attribute
//!   (epoch seconds) that DynamoDB deletes some time after it passes;
//!   reads never wait for that and treat a record past its `expires_at`
//!   as absent, and [`Purge::purge_expired`](idem::Purge::purge_expired)
//!   deletes in bounded batches;
//! * **answers too large for an item** (400 KB) are refused as not
//!   retained ([`DynamoError::ItemTooLarge`], a lasting
//!   [`StoreError::Backend`](idem::StoreError::Backend)), never truncated,
//!   and counted
//!   ([`DynamoStore::stats`]);
//! * **listing** through one index sorted by creation time, read in
//!   bounded pages;
//! * **migration**: [`DynamoStore::migrate`] creates the table (on-demand
//!   billing) and turns its TTL on, idempotently.
//!
//! ```no_run
//! use idem::{Engine, Fingerprint, Scope, StoredResponse};
//! use idem_dynamodb::DynamoStore;
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let store =
//!     DynamoStore::connect("dynamodb://idem?region=eu-west-1").await?;
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
//! ## One clock, bounded skew
//!
//! The other stores take every time from one clock, the database's.
//! DynamoDB has none that a condition can read, so this store keeps
//! leases and expiry by each process' own clock ([`Timestamp::now`]), and
//! bounds how far those clocks may drift apart instead:
//!
//! * at connect, the store compares its clock with the `Date` header of
//!   the endpoint's answer and refuses to start
//!   ([`DynamoError::ClockSkew`]) when the answer proves a skew over
//!   `max_skew` (default 1 s); [`DynamoStore::check_clock`] repeats the
//!   check at any time;
//! * two processes within `max_skew` of the endpoint are within
//!   2 × `max_skew` of each other, so **every lease must be longer than
//!   2 × `max_skew`**: a lease of `L` gives its owner at least
//!   `L − 2 × max_skew` before another process may see it lapsed;
//! * expiry compares with the same bounded clock, so a final record may
//!   read as expired up to 2 × `max_skew` early on another process; the
//!   `ttl` attribute is set `max_skew` past `expires_at`, so DynamoDB's own
//!   deletion never comes before it.
//!
//! Credentials come from `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY` and
//! `AWS_SESSION_TOKEN` (or [`DynamoOptions::with_credentials`]); a
//! loopback endpoint (an emulator) takes placeholder ones when none are
//! set.

mod clock;
mod error;
mod item;
mod ops;
mod options;
mod schema;

use std::net::IpAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use aws_sdk_dynamodb::config::retry::RetryConfig;
use aws_sdk_dynamodb::config::timeout::TimeoutConfig;
use aws_sdk_dynamodb::config::{Credentials, Region};
use aws_smithy_http_client::tls::{self, rustls_provider::CryptoMode};
use idem::Timestamp;
use idem::store::Migrated;

/// The SDK, re-exported so users never mismatch versions.
pub use aws_sdk_dynamodb;
pub use error::DynamoError;
pub use options::DynamoOptions;

/// How many times a reservation re-reads a record that changed under it
/// before giving up with [`DynamoError::Contention`]. Each round follows a
/// change someone else made, so this is never reached in practice.
const MAX_ROUNDS: u32 = 32;

/// The DynamoDB [`Store`](idem::Store); see the [crate docs](crate). Cheap to clone:
/// clones share the client and the counters.
#[derive(Debug, Clone)]
pub struct DynamoStore {
    client: aws_sdk_dynamodb::Client,
    table: Arc<str>,
    endpoint: Arc<str>,
    max_skew: Duration,
    counts: Arc<Counts>,
}

/// The store's counters, shared by its clones.
#[derive(Debug, Default)]
struct Counts {
    too_large: AtomicU64,
}

/// What the store refused so far ([`DynamoStore::stats`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct DynamoStats {
    /// Answers not retained because their record would exceed DynamoDB's
    /// item limit (400 KB).
    pub items_too_large: u64,
}

/// What [`DynamoStore::check_clock`] measured.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClockCheck {
    /// The least skew the endpoint's answer proves, in milliseconds:
    /// positive when this clock is behind, zero when it may be right.
    pub skew_ms: i64,
    /// The request's round trip, which bounds how precise the check is.
    pub round_trip: Duration,
}

impl DynamoStore {
    /// Connects with default options to the table named by a
    /// `dynamodb://TABLE?region=…&endpoint=…` URL, checks the clock and
    /// creates the table if needed.
    pub async fn connect(url: &str) -> Result<Self, DynamoError> {
        Self::connect_with(DynamoOptions::from_url(url)?).await
    }

    /// Connects with explicit options: builds the client, asks the
    /// endpoint for the table (a wrong endpoint, region or credentials
    /// show up here as one clear line), checks this clock against the
    /// answer's `Date`, and creates the table unless `migrate` is false
    /// (then a missing table is [`DynamoError::NotMigrated`]).
    pub async fn connect_with(opts: DynamoOptions) -> Result<Self, DynamoError> {
        let (store, found) = Self::reach(&opts).await?;
        if opts.migrate() {
            store.migrate().await?;
        } else {
            match found {
                schema::Found::Missing => {
                    return Err(DynamoError::NotMigrated {
                        table: opts.table().to_owned(),
                        what: "does not exist",
                    });
                }
                schema::Found::Table(description) => schema::check(opts.table(), &description)?,
            }
        }
        Ok(store)
    }

    /// Connects as [`connect_with`](Self::connect_with) does, whatever
    /// its `migrate`, and brings the table to this build's layout,
    /// saying what that did (`idem migrate`).
    pub async fn connect_and_migrate(opts: DynamoOptions) -> Result<(Self, Migrated), DynamoError> {
        let (store, _) = Self::reach(&opts).await?;
        let migrated = store.migrate().await?;
        Ok((store, migrated))
    }

    /// Builds the client, asks the endpoint for the table and checks
    /// this clock against the answer's `Date`.
    async fn reach(opts: &DynamoOptions) -> Result<(Self, schema::Found), DynamoError> {
        let bad = |reason: String| DynamoError::Url {
            url: opts.display_url().to_owned(),
            reason,
        };
        opts.validate().map_err(bad)?;
        let region = match opts.region() {
            Some(region) => region.to_owned(),
            None => env("AWS_REGION")
                .or_else(|| env("AWS_DEFAULT_REGION"))
                .ok_or_else(|| {
                    bad("names no region (add ?region=…, or set AWS_REGION)".to_owned())
                })?,
        };
        let endpoint = opts.endpoint().map_or_else(
            || format!("https://dynamodb.{region}.amazonaws.com"),
            str::to_owned,
        );
        let credentials = credentials(opts, &endpoint)?;
        let http = aws_smithy_http_client::Builder::new()
            .tls_provider(tls::Provider::Rustls(CryptoMode::Ring))
            .build_https();
        let mut config = aws_sdk_dynamodb::Config::builder()
            .region(Region::new(region))
            .credentials_provider(credentials)
            .http_client(http)
            .timeout_config(
                TimeoutConfig::builder()
                    .connect_timeout(opts.connect_timeout())
                    .operation_timeout(opts.timeout())
                    .build(),
            )
            .retry_config(RetryConfig::standard());
        if let Some(url) = opts.endpoint() {
            config = config.endpoint_url(url);
        }
        let store = Self {
            client: aws_sdk_dynamodb::Client::from_conf(config.build()),
            table: Arc::from(opts.table()),
            endpoint: Arc::from(endpoint),
            max_skew: opts.max_skew(),
            counts: Arc::default(),
        };
        let (found, _) = store.probe().await?;
        Ok((store, found))
    }

    /// Uses a client built elsewhere (with `aws-config`'s credential
    /// chain, say) on `table`, with the default `max_skew` of 1 s.
    /// Applies no migration and checks no clock: call
    /// [`migrate`](Self::migrate) and [`check_clock`](Self::check_clock)
    /// as needed.
    pub fn from_client(client: aws_sdk_dynamodb::Client, table: impl Into<String>) -> Self {
        let endpoint = client.config().region().map_or_else(
            || "the client's endpoint".to_owned(),
            |region| format!("the client's endpoint in {region}"),
        );
        Self {
            client,
            table: Arc::from(table.into()),
            endpoint: Arc::from(endpoint),
            max_skew: DynamoOptions::new("idem").max_skew(),
            counts: Arc::default(),
        }
    }

    /// Asks the endpoint for the table once, without retries, and checks
    /// this clock against the answer's `Date`: the first request, whose
    /// failure explains what is wrong with the endpoint.
    async fn probe(&self) -> Result<(schema::Found, ClockCheck), DynamoError> {
        let probe = clock::DateProbe::default();
        let sent = Timestamp::now();
        let started = std::time::Instant::now();
        let answer = self
            .client
            .describe_table()
            .table_name(&*self.table)
            .customize()
            .interceptor(probe.clone())
            .config_override(
                aws_sdk_dynamodb::Config::builder().retry_config(RetryConfig::disabled()),
            )
            .send()
            .await;
        let received = Timestamp::now();
        let round_trip = started.elapsed();
        let found = match answer {
            Ok(out) => match out.table {
                Some(description) => schema::Found::Table(Box::new(description)),
                None => schema::Found::Missing,
            },
            Err(err) if error::code(&err) == Some("ResourceNotFoundException") => {
                schema::Found::Missing
            }
            Err(err) => {
                return Err(DynamoError::Connect {
                    endpoint: self.endpoint.to_string(),
                    reason: error::connect_reason(&err),
                    source: Box::new(err),
                });
            }
        };
        let date = probe.date();
        let Some(date_at) = date.as_deref().and_then(clock::parse_http_date) else {
            return Err(DynamoError::NoDate {
                endpoint: self.endpoint.to_string(),
                found: date.map_or_else(|| "none".to_owned(), |d| format!("{d:?}")),
            });
        };
        let skew_ms = clock::proven_skew_ms(date_at, sent, received);
        let max = i64::try_from(self.max_skew.as_millis()).unwrap_or(i64::MAX);
        if skew_ms.unsigned_abs() > max.unsigned_abs() {
            return Err(DynamoError::ClockSkew {
                endpoint: self.endpoint.to_string(),
                skew_ms,
                max_skew: self.max_skew,
            });
        }
        Ok((
            found,
            ClockCheck {
                skew_ms,
                round_trip,
            },
        ))
    }

    /// Checks this process' clock against the endpoint's again (the store
    /// does at connect): fails with [`DynamoError::ClockSkew`] when the
    /// skew proven exceeds `max_skew`. A gateway may run it periodically,
    /// since a clock can drift or be stepped after the start.
    pub async fn check_clock(&self) -> Result<ClockCheck, DynamoError> {
        self.probe().await.map(|(_, check)| check)
    }

    /// Creates the table (on-demand billing, its key and listing index)
    /// if it is missing and turns its TTL on if it is off. Safe to run
    /// again and from several processes at once; fails with
    /// [`DynamoError::ForeignTable`] on a table of the same name with
    /// another key.
    pub async fn migrate(&self) -> Result<Migrated, DynamoError> {
        schema::migrate(&self.client, &self.table).await
    }

    /// The layout version this build writes.
    pub const fn schema_version() -> i64 {
        schema::SCHEMA_VERSION
    }

    /// The SDK client, for the caller's own requests.
    pub fn client(&self) -> &aws_sdk_dynamodb::Client {
        &self.client
    }

    /// The table's name.
    pub fn table(&self) -> &str {
        &self.table
    }

    /// The most clock skew this store accepts; every lease must be
    /// longer than twice this.
    pub fn max_skew(&self) -> Duration {
        self.max_skew
    }

    /// What the store refused since it (and its clones) started.
    pub fn stats(&self) -> DynamoStats {
        DynamoStats {
            items_too_large: self.counts.too_large.load(Ordering::Relaxed),
        }
    }

    /// Counts an answer refused for its size.
    fn count_too_large(&self) {
        self.counts.too_large.fetch_add(1, Ordering::Relaxed);
    }
}

/// A non-empty environment variable.
fn env(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

/// The credentials set in code, else the environment's, else placeholder
/// ones for a loopback endpoint (an emulator checks no signature).
fn credentials(opts: &DynamoOptions, endpoint: &str) -> Result<Credentials, DynamoError> {
    const PROVIDER: &str = "idem-dynamodb";
    if let Some((id, secret, token)) = opts.credentials() {
        return Ok(Credentials::new(id, secret, token.clone(), None, PROVIDER));
    }
    if let (Some(id), Some(secret)) = (env("AWS_ACCESS_KEY_ID"), env("AWS_SECRET_ACCESS_KEY")) {
        return Ok(Credentials::new(
            id,
            secret,
            env("AWS_SESSION_TOKEN"),
            None,
            PROVIDER,
        ));
    }
    if is_loopback(endpoint) {
        return Ok(Credentials::new(
            "idem-local",
            "idem-local",
            None,
            None,
            PROVIDER,
        ));
    }
    Err(DynamoError::Credentials {
        endpoint: endpoint.to_owned(),
    })
}

/// Whether an `http(s)://host[:port]/…` URL names this machine.
fn is_loopback(url: &str) -> bool {
    let Some((_, rest)) = url.split_once("://") else {
        return false;
    };
    let authority = rest.split(['/', '?']).next().unwrap_or(rest);
    let host = match authority.strip_prefix('[') {
        Some(v6) => v6.split(']').next().unwrap_or(v6),
        None => authority
            .rsplit_once(':')
            .map_or(authority, |(host, _)| host),
    };
    host.eq_ignore_ascii_case("localhost")
        || host.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

/// `d` in whole milliseconds, saturating.
fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_endpoints() {
        assert!(is_loopback("http://127.0.0.1:8000"));
        assert!(is_loopback("http://localhost:8000/"));
        assert!(is_loopback("http://[::1]:8000"));
        assert!(!is_loopback("https://dynamodb.eu-west-1.amazonaws.com"));
        assert!(!is_loopback("http://10.0.0.5:8000"));
        assert!(!is_loopback("nonsense"));
    }
}
