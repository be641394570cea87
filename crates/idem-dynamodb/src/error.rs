//! Errors of the DynamoDB store and how they map onto [`StoreError`].

use std::time::Duration;

use aws_sdk_dynamodb::error::{DisplayErrorContext, ProvideErrorMetadata, SdkError};
use idem::StoreError;
use idem::store::BoxError;

/// What went wrong configuring, connecting to, migrating or using the
/// DynamoDB store.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DynamoError {
    /// The store URL or an option is not understood.
    #[error("invalid DynamoDB store URL {url}: {reason}")]
    Url {
        /// The URL given.
        url: String,
        /// What is wrong with it.
        reason: String,
    },
    /// No credentials were found for an endpoint that needs them.
    #[error(
        "no AWS credentials for {endpoint}: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN for temporary ones)"
    )]
    Credentials {
        /// The endpoint that needs them.
        endpoint: String,
    },
    /// The endpoint could not be reached, or refused the first request.
    #[error("cannot reach DynamoDB at {endpoint}: {reason}")]
    Connect {
        /// The endpoint (the regional AWS one when none is named).
        endpoint: String,
        /// A one-line explanation.
        reason: String,
        /// The SDK's error.
        #[source]
        source: BoxError,
    },
    /// This process' clock is further from the endpoint's than the store
    /// allows: leases and expiry would not mean the same to every gateway.
    #[error(
        "this machine's clock is at least {}ms {} DynamoDB's at {endpoint} (its Date header), more than max_skew_ms={}: fix the clock (NTP) or raise max_skew_ms, and keep every lease above twice that",
        .skew_ms.unsigned_abs(), if *.skew_ms > 0 { "behind" } else { "ahead of" }, .max_skew.as_millis()
    )]
    ClockSkew {
        /// The endpoint asked.
        endpoint: String,
        /// The least skew the answer proves, in milliseconds: positive
        /// when this clock is behind the endpoint's.
        skew_ms: i64,
        /// The most the store allows.
        max_skew: Duration,
    },
    /// The endpoint answered without a `Date` header, so the clock cannot
    /// be checked.
    #[error(
        "DynamoDB at {endpoint} sent no usable Date header ({found}), so this machine's clock cannot be checked against it"
    )]
    NoDate {
        /// The endpoint asked.
        endpoint: String,
        /// What was found instead.
        found: String,
    },
    /// The table does not exist (or has no listing index) and the store
    /// was told not to create it.
    #[error(
        "the DynamoDB table {table:?} {what}: create it once with `idem migrate --store URL` (or DynamoStore::migrate, or connect with migrate=true)"
    )]
    NotMigrated {
        /// The table.
        table: String,
        /// What is missing.
        what: &'static str,
    },
    /// The table exists with another key schema.
    #[error("the DynamoDB table {table:?} is not an idem table: {reason}")]
    ForeignTable {
        /// The table.
        table: String,
        /// How it differs.
        reason: String,
    },
    /// Creating the table or turning its TTL on failed.
    #[error("creating the DynamoDB table {table:?} failed: {reason}")]
    Migrate {
        /// The table.
        table: String,
        /// A one-line explanation.
        reason: String,
        /// The SDK's error, if there is one (none for a wait that ran out).
        #[source]
        source: Option<BoxError>,
    },
    /// An answer does not fit in one DynamoDB item (400 KB): it is not
    /// retained, and never truncated.
    #[error(
        "the answer is not retained: its record would be {}, over DynamoDB's item limit of {limit} bytes (a smaller answer, or another store, keeps it)",
        .size.map_or_else(|| "larger".to_owned(), |size| format!("{size} bytes"))
    )]
    ItemTooLarge {
        /// The record's size as the store counts it (attribute names and
        /// values), when it counted it.
        size: Option<usize>,
        /// DynamoDB's limit.
        limit: usize,
    },
    /// An item holds something this build cannot interpret.
    #[error("the DynamoDB table holds an unreadable item: {0}")]
    Corrupt(String),
    /// The reservation kept losing races against concurrent changes of the
    /// same record (each retry follows a change someone else made).
    #[error("reservation gave up after {0} rounds of concurrent changes to the same record")]
    Contention(u32),
    /// Any other error of the SDK or the service.
    #[error("DynamoDB {operation} failed: {message}")]
    Sdk {
        /// The DynamoDB operation.
        operation: &'static str,
        /// The error and its causes, in one line.
        message: String,
        /// Whether trying again later may succeed.
        transient: bool,
        /// The SDK's error.
        #[source]
        source: BoxError,
    },
}

impl DynamoError {
    /// Whether trying again later may succeed: the endpoint is down,
    /// throttling or failing inside, or a reservation lost many races.
    pub fn is_transient(&self) -> bool {
        match self {
            Self::Connect { .. } | Self::Contention(_) => true,
            Self::Sdk { transient, .. } => *transient,
            _ => false,
        }
    }

    /// An SDK error of `operation`, classified as lasting or transient.
    pub(crate) fn sdk<E>(operation: &'static str, err: SdkError<E, HttpResponse>) -> Self
    where
        E: ProvideErrorMetadata + std::error::Error + Send + Sync + 'static,
    {
        let transient = sdk_is_transient(&err);
        Self::Sdk {
            operation,
            message: DisplayErrorContext(&err).to_string(),
            transient,
            source: Box::new(err),
        }
    }
}

/// The SDK's raw HTTP response type, in its errors.
pub(crate) type HttpResponse = aws_sdk_dynamodb::config::http::HttpResponse;

/// Service error codes that say "not now": throttling and DynamoDB's own
/// failures.
const TRANSIENT_CODES: &[&str] = &[
    "ProvisionedThroughputExceededException",
    "RequestLimitExceeded",
    "ThrottlingException",
    "InternalServerError",
    "ServiceUnavailable",
    "LimitExceededException",
    "TransactionInProgressException",
];

/// Whether an SDK error may go away on its own: no answer (network,
/// time-out), a broken answer, throttling, or a 5xx.
pub(crate) fn sdk_is_transient<E: ProvideErrorMetadata>(err: &SdkError<E, HttpResponse>) -> bool {
    match err {
        SdkError::DispatchFailure(_) | SdkError::TimeoutError(_) | SdkError::ResponseError(_) => {
            true
        }
        SdkError::ServiceError(service) => {
            service.raw().status().is_server_error()
                || service
                    .err()
                    .code()
                    .is_some_and(|code| TRANSIENT_CODES.contains(&code))
        }
        _ => false,
    }
}

/// The service's error code, if DynamoDB answered with one.
pub(crate) fn code<E: ProvideErrorMetadata>(err: &SdkError<E, HttpResponse>) -> Option<&str> {
    match err {
        SdkError::ServiceError(service) => service.err().code(),
        _ => None,
    }
}

/// DynamoDB's answer to a write whose condition did not hold.
pub(crate) fn is_condition_failed<E: ProvideErrorMetadata>(
    err: &SdkError<E, HttpResponse>,
) -> bool {
    code(err) == Some("ConditionalCheckFailedException")
}

/// DynamoDB's refusal of an item over its size limit (a validation error
/// whose message says so), in case the store's own count was too low.
pub(crate) fn is_item_too_large<E: ProvideErrorMetadata>(err: &SdkError<E, HttpResponse>) -> bool {
    match err {
        SdkError::ServiceError(service) => {
            service.err().code() == Some("ValidationException")
                && service
                    .err()
                    .message()
                    .is_some_and(|m| m.contains("Item size") || m.contains("item size"))
        }
        _ => false,
    }
}

impl From<DynamoError> for StoreError {
    fn from(err: DynamoError) -> Self {
        match err {
            DynamoError::Corrupt(_) => StoreError::Corrupt(Box::new(err)),
            err if err.is_transient() => StoreError::Unavailable(Box::new(err)),
            err => StoreError::Backend(Box::new(err)),
        }
    }
}

/// One line saying why the first request failed, in the user's words.
pub(crate) fn connect_reason<E>(err: &SdkError<E, HttpResponse>) -> String
where
    E: ProvideErrorMetadata + std::error::Error + 'static,
{
    match err {
        SdkError::DispatchFailure(failure) if failure.is_io() => format!(
            "no connection (is the endpoint up, and its host and port right?): {}",
            DisplayErrorContext(err)
        ),
        SdkError::DispatchFailure(_) => format!(
            "the request could not be sent: {}",
            DisplayErrorContext(err)
        ),
        SdkError::TimeoutError(_) => {
            "no answer within the connect time-out (is the endpoint up?)".to_owned()
        }
        SdkError::ServiceError(service) => {
            let code = service.err().code().unwrap_or("an error");
            let message = service.err().message().unwrap_or("");
            match code {
                "UnrecognizedClientException"
                | "InvalidSignatureException"
                | "MissingAuthenticationToken"
                | "AccessDeniedException"
                | "ExpiredTokenException" => {
                    format!("authentication failed: {code}: {message}")
                }
                _ => format!("the service refused: {code}: {message}"),
            }
        }
        _ => DisplayErrorContext(err).to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mapping_to_store_errors() {
        let corrupt: StoreError = DynamoError::Corrupt("x".into()).into();
        assert!(matches!(corrupt, StoreError::Corrupt(_)));
        let busy: StoreError = DynamoError::Contention(3).into();
        assert!(matches!(busy, StoreError::Unavailable(_)));
        let big: StoreError = DynamoError::ItemTooLarge {
            size: Some(500_000),
            limit: 409_600,
        }
        .into();
        assert!(matches!(big, StoreError::Backend(_)), "lasting: {big}");
        assert!(big.to_string().contains("not retained"), "{big}");
    }

    #[test]
    fn clock_skew_says_which_way() {
        let behind = DynamoError::ClockSkew {
            endpoint: "http://e".into(),
            skew_ms: 3_000,
            max_skew: Duration::from_secs(1),
        };
        assert!(
            behind.to_string().contains("at least 3000ms behind"),
            "{behind}"
        );
        let ahead = DynamoError::ClockSkew {
            endpoint: "http://e".into(),
            skew_ms: -2_500,
            max_skew: Duration::from_secs(1),
        };
        assert!(
            ahead.to_string().contains("at least 2500ms ahead of"),
            "{ahead}"
        );
        assert!(ahead.to_string().contains("max_skew_ms=1000"), "{ahead}");
    }
}
