//! Why a check cannot run: bad arguments, an unusable CA file, a target
//! that [`validate`](crate::validate) refuses.
//!
//! Every message names the flag at fault, because it is printed as is
//! (`idem check: <message>`, exit code 2). Where the cause is an error of
//! its own (an unreadable file, a JSON parse error) it stays reachable
//! through [`std::error::Error::source`].
//!
//! ```
//! use idem_check::CheckError;
//!
//! let err = idem_check::load_ca_file("/nonexistent/ca.pem".as_ref()).unwrap_err();
//! assert!(matches!(err, CheckError::CaFileUnreadable { .. }));
//! assert!(err.to_string().starts_with("--ca-file /nonexistent/ca.pem: cannot read it: "));
//! ```

use std::path::PathBuf;

use http::Uri;

use crate::outcome::PROBES;

/// Why a check cannot run; its `Display` is the line the user sees.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CheckError {
    /// `--url` is not a URL at all.
    #[error("--url {url}: not a URL ({source})")]
    NotAUrl {
        /// The argument as given.
        url: String,
        /// Why it does not parse.
        #[source]
        source: http::uri::InvalidUri,
    },
    /// `--url` is a URL of another scheme than `http` or `https`.
    #[error("--url {url}: expected an http:// or https:// URL")]
    UnsupportedScheme {
        /// The URL.
        url: Uri,
    },
    /// `--url` names no host.
    #[error("--url {url}: the URL has no host")]
    NoHost {
        /// The URL.
        url: Uri,
    },
    /// `--method` is not an HTTP method.
    #[error("--method {method}: not an HTTP method")]
    NotAMethod {
        /// The argument as given.
        method: String,
        /// Why it is not a method.
        #[source]
        source: http::method::InvalidMethod,
    },
    /// `--body @FILE` names a file that cannot be read.
    #[error("--body @{path}: cannot read it: {source}")]
    BodyFileUnreadable {
        /// The file, as given after the `@`.
        path: String,
        /// The read error.
        #[source]
        source: std::io::Error,
    },
    /// A `--header` is not `name: value` (or not a valid name or value).
    #[error("--header {header:?}: expected `name: value`")]
    NotAHeader {
        /// The argument as given.
        header: String,
    },
    /// `--auth2` cannot be sent as a header value.
    #[error("--auth2: not a valid header value")]
    SecondAuthNotAHeaderValue {
        /// Why it is not a header value.
        #[source]
        source: http::header::InvalidHeaderValue,
    },
    /// `--probes` names a probe that does not exist.
    #[error("--probes: unknown probe {name:?}; known: all, {}", known_probes())]
    UnknownProbe {
        /// The name as given.
        name: String,
    },
    /// `--ca-file` cannot be read.
    #[error("--ca-file {}: cannot read it: {source}", path.display())]
    CaFileUnreadable {
        /// The file.
        path: PathBuf,
        /// The read error.
        #[source]
        source: rustls::pki_types::pem::Error,
    },
    /// `--ca-file` holds something that is not PEM certificates.
    #[error("--ca-file {}: not PEM certificates: {source}", path.display())]
    CaFileNotPem {
        /// The file.
        path: PathBuf,
        /// The PEM parse error.
        #[source]
        source: rustls::pki_types::pem::Error,
    },
    /// `--ca-file` holds no certificate.
    #[error("--ca-file {}: no certificate in it", path.display())]
    CaFileEmpty {
        /// The file.
        path: PathBuf,
    },
    /// A certificate of `--ca-file` cannot be used as a trust anchor.
    #[error("--ca-file: unusable certificate: {source}")]
    UnusableCertificate {
        /// Why rustls refused it.
        #[source]
        source: rustls::Error,
    },
    /// The TLS client cannot be configured.
    #[error(transparent)]
    Tls(rustls::Error),
    /// `--vary-field` is given but the body is not JSON.
    #[error("--vary-field {field}: the body is not JSON ({source}), so no field can be varied")]
    BodyNotJson {
        /// The field.
        field: String,
        /// Why the body does not parse.
        #[source]
        source: serde_json::Error,
    },
    /// `--vary-field` names a field the body does not have.
    #[error("--vary-field {field}: the body has no top-level field {field:?}")]
    NoSuchField {
        /// The field.
        field: String,
    },
    /// The reuse probe was asked for without `--vary-field`.
    #[error("--probes reuse needs --vary-field FIELD (a top-level JSON field to change)")]
    ReuseNeedsVaryField,
    /// The tenants probe was asked for without `--auth2`.
    #[error("--probes tenants needs --auth2 (a second credential)")]
    TenantsNeedSecondAuth,
    /// The selected probes need more requests than `--max-requests` allows.
    #[error(
        "the selected probes need {needed} requests but --max-requests is {max_requests}; raise it or select fewer probes"
    )]
    OverBudget {
        /// Requests the selected probes may send.
        needed: u32,
        /// The run's limit.
        max_requests: u32,
    },
}

/// The probes' names, comma-separated, in the order they run.
fn known_probes() -> String {
    let names: Vec<&str> = PROBES.iter().map(|p| p.name()).collect();
    names.join(", ")
}
