//! [`DynamoOptions`]: which table, where, with which credentials and how
//! much clock skew, from a `dynamodb://` URL or built in code.

use std::time::Duration;

use idem::store::backend::{QueryOption, QueryOptionError, QueryOptions};

use crate::DynamoError;

/// The options a `dynamodb://` URL may carry.
const OURS: &[&str] = &[
    "region",
    "endpoint",
    "migrate",
    "max_skew_ms",
    "connect_timeout_ms",
    "timeout_ms",
];

/// How the store reaches its table and how it behaves; see
/// [`DynamoOptions::from_url`].
#[derive(Clone)]
pub struct DynamoOptions {
    table: String,
    region: Option<String>,
    endpoint: Option<String>,
    credentials: Option<(String, String, Option<String>)>,
    migrate: bool,
    max_skew: Duration,
    connect_timeout: Duration,
    timeout: Duration,
    display_url: String,
}

impl std::fmt::Debug for DynamoOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DynamoOptions")
            .field("table", &self.table)
            .field("region", &self.region)
            .field("endpoint", &self.endpoint)
            .field(
                "credentials",
                &self.credentials.as_ref().map(|(id, _, _)| (id, "***")),
            )
            .field("migrate", &self.migrate)
            .field("max_skew", &self.max_skew)
            .field("connect_timeout", &self.connect_timeout)
            .field("timeout", &self.timeout)
            .finish()
    }
}

impl DynamoOptions {
    /// Options for `table`, at their defaults: the region from
    /// `AWS_REGION` (or `AWS_DEFAULT_REGION`), AWS's own endpoint for it,
    /// credentials from the environment, `migrate` on, a maximum clock
    /// skew of 1 s, time-outs of 5 s.
    pub fn new(table: impl Into<String>) -> Self {
        let table = table.into();
        Self {
            display_url: format!("dynamodb://{table}"),
            table,
            region: None,
            endpoint: None,
            credentials: None,
            migrate: true,
            max_skew: Duration::from_secs(1),
            connect_timeout: Duration::from_secs(5),
            timeout: Duration::from_secs(5),
        }
    }

    /// Parses `dynamodb://TABLE?region=R&endpoint=URL&…`. Besides
    /// `region` and `endpoint` (an emulator, a VPC endpoint; AWS's
    /// regional one when absent), idem reads `migrate=true|false`,
    /// `max_skew_ms=N` (the most this clock may differ from the
    /// endpoint's), `connect_timeout_ms=N` and `timeout_ms=N` (each
    /// request's time-out).
    ///
    /// Fails with [`DynamoError::Url`] on another scheme, a URL without a
    /// table or with a table name DynamoDB refuses, an option this store
    /// does not know, or a value an option does not take.
    pub fn from_url(url: &str) -> Result<Self, DynamoError> {
        let bad = |reason: String| DynamoError::Url {
            url: idem::store::redact_url(url),
            reason,
        };
        let Some(rest) = url.strip_prefix("dynamodb://") else {
            return Err(bad("must start with dynamodb://".to_owned()));
        };
        let (table, options) = QueryOptions::split(rest);
        let table = table.strip_suffix('/').unwrap_or(table);
        check_table_name(table).map_err(bad)?;
        let mut opts = Self::new(table);
        opts.display_url = idem::store::redact_url(url);
        for option in options {
            opts.set(&option).map_err(|e| bad(e.to_string()))?;
        }
        opts.validate().map_err(bad)?;
        Ok(opts)
    }

    /// Applies one of [`OURS`] from a URL.
    fn set(&mut self, option: &QueryOption<'_>) -> Result<(), QueryOptionError> {
        match option.name() {
            "region" => self.region = Some(non_empty(option)?),
            "endpoint" => {
                let endpoint = non_empty(option)?;
                if !(endpoint.starts_with("http://") || endpoint.starts_with("https://")) {
                    return Err(option.invalid_value("an http:// or https:// URL".to_owned()));
                }
                self.endpoint = Some(endpoint);
            }
            "migrate" => self.migrate = option.flag()?,
            "max_skew_ms" => self.max_skew = option.positive_millis()?,
            "connect_timeout_ms" => self.connect_timeout = option.positive_millis()?,
            "timeout_ms" => self.timeout = option.positive_millis()?,
            _ => return Err(option.unknown(OURS)),
        }
        Ok(())
    }

    /// Whether the settings fit together; the reason when not.
    pub(crate) fn validate(&self) -> Result<(), String> {
        check_table_name(&self.table)?;
        if self.max_skew.is_zero() {
            return Err("max_skew_ms must be at least 1".to_owned());
        }
        Ok(())
    }

    /// The URL the options came from, for messages.
    pub fn display_url(&self) -> &str {
        &self.display_url
    }

    /// The table's name.
    pub fn table(&self) -> &str {
        &self.table
    }

    /// The region named in the URL or set in code, if any; otherwise
    /// connecting reads `AWS_REGION`, then `AWS_DEFAULT_REGION`.
    pub fn region(&self) -> Option<&str> {
        self.region.as_deref()
    }

    /// Sets the region.
    pub fn with_region(mut self, region: impl Into<String>) -> Self {
        self.region = Some(region.into());
        self
    }

    /// The endpoint, when not AWS's regional one.
    pub fn endpoint(&self) -> Option<&str> {
        self.endpoint.as_deref()
    }

    /// Sets the endpoint (an emulator, a VPC endpoint).
    pub fn with_endpoint(mut self, endpoint: impl Into<String>) -> Self {
        self.endpoint = Some(endpoint.into());
        self
    }

    /// Uses these credentials instead of the environment's.
    pub fn with_credentials(
        mut self,
        access_key_id: impl Into<String>,
        secret_access_key: impl Into<String>,
        session_token: Option<String>,
    ) -> Self {
        self.credentials = Some((
            access_key_id.into(),
            secret_access_key.into(),
            session_token,
        ));
        self
    }

    /// Credentials set in code, if any.
    pub(crate) fn credentials(&self) -> Option<&(String, String, Option<String>)> {
        self.credentials.as_ref()
    }

    /// Whether connecting creates the table (and turns its TTL on) when
    /// it is missing (default true).
    pub fn migrate(&self) -> bool {
        self.migrate
    }

    /// Sets whether connecting creates the table.
    pub fn with_migrate(mut self, migrate: bool) -> Self {
        self.migrate = migrate;
        self
    }

    /// The most this process' clock may differ from the endpoint's
    /// (default 1 s). Connecting refuses a larger skew
    /// ([`DynamoError::ClockSkew`]); every lease must be longer than twice
    /// this (see the [crate docs](crate#one-clock-bounded-skew)).
    pub fn max_skew(&self) -> Duration {
        self.max_skew
    }

    /// Sets the most clock skew the store accepts.
    pub fn with_max_skew(mut self, skew: Duration) -> Self {
        self.max_skew = skew;
        self
    }

    /// How long connecting waits for a connection (default 5 s).
    pub fn connect_timeout(&self) -> Duration {
        self.connect_timeout
    }

    /// Sets how long connecting waits for a connection.
    pub fn with_connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// How long one request may take, retries included, before it fails
    /// as [`StoreError::Unavailable`](idem::StoreError::Unavailable)
    /// (default 5 s).
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Sets how long one request may take.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }
}

/// A value that is not empty.
fn non_empty(option: &QueryOption<'_>) -> Result<String, QueryOptionError> {
    let value = option.value()?;
    if value.is_empty() {
        return Err(option.invalid_value("not empty".to_owned()));
    }
    Ok(value.to_owned())
}

/// DynamoDB's rule for table names: 3 to 255 of `a-z A-Z 0-9 _ - .`.
fn check_table_name(table: &str) -> Result<(), String> {
    if table.is_empty() {
        return Err("names no table (dynamodb://TABLE?region=…)".to_owned());
    }
    let allowed = |c: char| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.');
    if !(3..=255).contains(&table.len()) || !table.chars().all(allowed) {
        return Err(format!(
            "table name {table:?} is not one DynamoDB takes (3 to 255 of a-z, A-Z, 0-9, _, - and .)"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn url_parsing() {
        let o = DynamoOptions::from_url(
            "dynamodb://idem-records?region=eu-west-1&endpoint=http://127.0.0.1:8000",
        )
        .expect("valid");
        assert_eq!(o.table(), "idem-records");
        assert_eq!(o.region(), Some("eu-west-1"));
        assert_eq!(o.endpoint(), Some("http://127.0.0.1:8000"));
        assert!(o.migrate());
        assert_eq!(o.max_skew(), Duration::from_secs(1), "default");
        let o = DynamoOptions::from_url(
            "dynamodb://t.1_x?migrate=false&max_skew_ms=250&connect_timeout_ms=100&timeout_ms=900",
        )
        .expect("valid");
        assert_eq!(o.region(), None);
        assert_eq!(o.endpoint(), None);
        assert!(!o.migrate());
        assert_eq!(o.max_skew(), Duration::from_millis(250));
        assert_eq!(o.connect_timeout(), Duration::from_millis(100));
        assert_eq!(o.timeout(), Duration::from_millis(900));
        let o = o.with_credentials("AKID", "s3cret", None);
        assert!(!format!("{o:?}").contains("s3cret"), "Debug redacts");
    }

    #[test]
    fn bad_urls_say_what_is_wrong() {
        for (url, needle) in [
            ("mysql://db/idem", "must start with dynamodb://"),
            ("dynamodb://", "names no table"),
            ("dynamodb://?region=x", "names no table"),
            ("dynamodb://ab", "not one DynamoDB takes"),
            ("dynamodb://a b c", "not one DynamoDB takes"),
            ("dynamodb://tbl?region=", "not empty"),
            (
                "dynamodb://tbl?endpoint=localhost:8000",
                "http:// or https://",
            ),
            ("dynamodb://tbl?migrate=maybe", "true or false"),
            ("dynamodb://tbl?max_skew_ms=0", "positive integer"),
            ("dynamodb://tbl?timeout_ms=soon", "positive integer"),
            ("dynamodb://tbl?pool=3", "unknown option"),
            ("dynamodb://tbl?region", "has no value"),
        ] {
            let err = DynamoOptions::from_url(url).expect_err(url).to_string();
            assert!(err.contains(needle), "{url}: {err}");
        }
    }
}
