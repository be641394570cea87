//! `idem check`: black-box probes that tell whether an HTTP endpoint is
//! really idempotent, each with a verdict and the exchanges that justify it.
//!
//! The checker sends only to the one URL it is given, never follows
//! redirects, mints fresh keys per run (`idem-check-<run>-<probe>…`), and
//! never sends more than `--max-requests` requests in all. Exit code: 0
//! when every selected probe passed, 1 when one failed, 2 when the check
//! could not run (bad arguments, unreachable target).
//!
//! The `idem` binary runs it as a subcommand ([`CheckArgs`] and
//! [`main`]); a test suite can call the probes directly:
//!
//! ```no_run
//! use std::time::Duration;
//!
//! use idem_check::{PROBES, Target, Verdict};
//!
//! # async fn example() -> Result<(), Box<dyn std::error::Error>> {
//! let mut headers = http::HeaderMap::new();
//! headers.insert("content-type", http::HeaderValue::from_static("application/json"));
//! let target = Target {
//!     url: "http://127.0.0.1:8080/v1/payments".parse()?,
//!     method: http::Method::POST,
//!     body: bytes::Bytes::from_static(br#"{"amount_cents":1250,"currency":"EUR"}"#),
//!     headers,
//!     vary_field: Some("amount_cents".to_owned()),
//!     second_auth: None, // the tenants probe is skipped
//!     concurrency: 20,
//!     key_required: true,
//!     id_field: "id".to_owned(),
//!     timeout: Duration::from_secs(10),
//!     max_requests: 100,
//!     extra_roots: Vec::new(),
//! };
//! idem_check::validate(&target, &PROBES, false)?;
//! let outcomes = idem_check::run(target, &PROBES).await;
//! assert!(outcomes.iter().all(|o| o.verdict != Verdict::Fail));
//! assert_eq!(idem_check::exit_code(&outcomes), 0);
//! # Ok(())
//! # }
//! ```

mod client;
mod error;
mod outcome;
mod probe;
pub mod report;

use std::process::ExitCode;
use std::time::Duration;

use bytes::Bytes;
use clap::ValueEnum;
use http::{HeaderMap, HeaderValue, Method, Uri};
use serde_json::Value;

pub use client::load_ca_file;
pub use error::CheckError;
pub use outcome::{Exchange, Outcome, PROBES, Probe, Verdict};
pub use probe::run;

/// What to check, validated.
#[derive(Debug, Clone)]
pub struct Target {
    /// The one URL every request goes to.
    pub url: Uri,
    /// The method (POST by default).
    pub method: Method,
    /// The request body.
    pub body: Bytes,
    /// Extra request headers (content type, credentials).
    pub headers: HeaderMap,
    /// JSON field changed by the reuse probe.
    pub vary_field: Option<String>,
    /// Second credential (the `Authorization` value) for the tenants probe.
    pub second_auth: Option<HeaderValue>,
    /// Copies sent at once by the concurrent probe.
    pub concurrency: u32,
    /// Whether the endpoint is meant to require a key (missing-key probe).
    pub key_required: bool,
    /// JSON field holding the created resource's id (else `Location`).
    pub id_field: String,
    /// Per-request timeout.
    pub timeout: Duration,
    /// The most requests the whole run may send.
    pub max_requests: u32,
    /// Certificate authorities trusted for `https://` besides the system's
    /// (see [`load_ca_file`]).
    pub extra_roots: Vec<rustls::pki_types::CertificateDer<'static>>,
}

/// Refuses arguments that cannot work, with a message naming the flag.
/// Probes named explicitly (`explicit`) must be runnable; with `all`, the
/// ones missing their arguments are reported as skipped instead.
///
/// # Errors
///
/// The first problem found, in the order: the URL's scheme, the
/// `--ca-file` certificates, the URL's host, `--vary-field`, the explicit
/// probes' arguments, the request budget.
pub fn validate(target: &Target, probes: &[Probe], explicit: bool) -> Result<(), CheckError> {
    match target.url.scheme_str() {
        Some("http" | "https") => {}
        _ => {
            return Err(CheckError::UnsupportedScheme {
                url: target.url.clone(),
            });
        }
    }
    // The system's roots are loaded once, when the run starts.
    client::extra_roots(&target.extra_roots)?;
    if target.url.authority().is_none() {
        return Err(CheckError::NoHost {
            url: target.url.clone(),
        });
    }
    if let Some(field) = &target.vary_field {
        let json: Value =
            serde_json::from_slice(&target.body).map_err(|source| CheckError::BodyNotJson {
                field: field.clone(),
                source,
            })?;
        if json.get(field).is_none() {
            return Err(CheckError::NoSuchField {
                field: field.clone(),
            });
        }
    }
    let needed: u32 = probes.iter().map(|p| p.budget(target.concurrency)).sum();
    if explicit && probes.contains(&Probe::Reuse) && target.vary_field.is_none() {
        return Err(CheckError::ReuseNeedsVaryField);
    }
    if explicit && probes.contains(&Probe::Tenants) && target.second_auth.is_none() {
        return Err(CheckError::TenantsNeedSecondAuth);
    }
    if needed > target.max_requests {
        return Err(CheckError::OverBudget {
            needed,
            max_requests: target.max_requests,
        });
    }
    Ok(())
}

/// The exit code for these outcomes: 0 all passed (skips allowed), 1 a
/// probe failed, 2 a probe could not be judged.
pub fn exit_code(outcomes: &[Outcome]) -> u8 {
    if outcomes.iter().any(|o| o.verdict == Verdict::Fail) {
        1
    } else if outcomes.iter().any(|o| o.verdict == Verdict::Error) {
        2
    } else {
        0
    }
}

/// Probe any HTTP endpoint from the outside: is it really idempotent?
/// Exit 0 when every selected probe passes, 1 when one fails, 2 when
/// the check cannot run.
#[derive(Debug, clap::Args)]
pub struct CheckArgs {
    /// The endpoint, e.g. http://127.0.0.1:8080/v1/payments (every request goes here, nowhere else).
    #[arg(long)]
    url: String,
    /// HTTP method.
    #[arg(long, default_value = "POST")]
    method: String,
    /// Request body, or @FILE.
    #[arg(long, default_value = "{}")]
    body: String,
    /// Extra header `name: value` (repeatable), e.g. the Authorization of a test account.
    #[arg(long = "header")]
    headers: Vec<String>,
    /// A second credential (an Authorization value) for the tenants probe.
    #[arg(long)]
    auth2: Option<String>,
    /// Top-level JSON field the reuse probe changes, e.g. amount_cents.
    #[arg(long)]
    vary_field: Option<String>,
    /// Copies the concurrent probe sends at once.
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u32).range(2..=1000))]
    concurrency: u32,
    /// Probes to run: all, or a comma-separated list of retry, concurrent, reuse,
    /// equivalent-json, distinct-keys, missing-key, malformed-key, tenants.
    #[arg(long, default_value = "all")]
    probes: String,
    /// The endpoint must refuse requests without a key (missing-key probe).
    #[arg(long)]
    key_required: bool,
    /// JSON field of the answer holding the created resource's id (else the Location header).
    #[arg(long, default_value = "id")]
    id_field: String,
    /// PEM file of certificate authorities to trust for an https:// URL,
    /// besides the system's (a private CA).
    #[arg(long)]
    ca_file: Option<std::path::PathBuf>,
    /// Per-request timeout.
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    timeout: Duration,
    /// The most requests the whole run may send.
    #[arg(long, default_value_t = 100)]
    max_requests: u32,
    /// Report format.
    #[arg(long, value_enum, default_value_t = CheckFormat::Text)]
    format: CheckFormat,
}

/// `--format`. No doc comments on the variants: clap would show them as
/// help for each possible value.
#[derive(Debug, Clone, Copy, ValueEnum)]
enum CheckFormat {
    Text,
    Json,
    Junit,
}

/// `idem check`: runs the probes that `args` select against its URL and
/// prints the report to stdout.
///
/// Returns the exit code of [`exit_code`]; an argument the check refuses
/// is printed to stderr as `idem check: <why>` and exits 2 before anything
/// is sent.
pub async fn main(args: CheckArgs) -> ExitCode {
    let (url, target, probes, format) = match parse(args) {
        Ok(parsed) => parsed,
        Err(err) => {
            eprintln!("idem check: {err}");
            return ExitCode::from(2);
        }
    };
    let outcomes = run(target, &probes).await;
    let report = match format {
        CheckFormat::Text => report::text_report(&url, &outcomes),
        CheckFormat::Json => report::json_report(&url, &outcomes),
        CheckFormat::Junit => report::junit_report(&url, &outcomes),
    };
    print!("{report}");
    if !report.ends_with('\n') {
        println!();
    }
    ExitCode::from(exit_code(&outcomes))
}

/// The arguments as a validated target, the probes to run in order, and
/// the report format; the first argument at fault otherwise.
fn parse(args: CheckArgs) -> Result<(Uri, Target, Vec<Probe>, CheckFormat), CheckError> {
    let url: Uri = args.url.parse().map_err(|source| CheckError::NotAUrl {
        url: args.url.clone(),
        source,
    })?;
    let method =
        Method::from_bytes(args.method.to_ascii_uppercase().as_bytes()).map_err(|source| {
            CheckError::NotAMethod {
                method: args.method.clone(),
                source,
            }
        })?;
    let body = match args.body.strip_prefix('@') {
        Some(path) => std::fs::read(path).map_err(|source| CheckError::BodyFileUnreadable {
            path: path.to_owned(),
            source,
        })?,
        None => args.body.clone().into_bytes(),
    };
    let mut headers = HeaderMap::new();
    for h in &args.headers {
        let parsed = h.split_once(':').and_then(|(n, v)| {
            Some((
                http::HeaderName::from_bytes(n.trim().as_bytes()).ok()?,
                HeaderValue::from_str(v.trim()).ok()?,
            ))
        });
        match parsed {
            Some((n, v)) => {
                headers.append(n, v);
            }
            None => return Err(CheckError::NotAHeader { header: h.clone() }),
        }
    }
    if !headers.contains_key(http::header::CONTENT_TYPE)
        && serde_json::from_slice::<Value>(&body).is_ok()
    {
        headers.insert(
            http::header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
    }
    let second_auth = args
        .auth2
        .as_deref()
        .map(HeaderValue::from_str)
        .transpose()
        .map_err(|source| CheckError::SecondAuthNotAHeaderValue { source })?;
    let explicit = args.probes.trim() != "all";
    let probes: Vec<Probe> = if explicit {
        let mut chosen = Vec::new();
        for name in args.probes.split(',') {
            match Probe::parse(name) {
                Some(p) => chosen.push(p),
                None => {
                    return Err(CheckError::UnknownProbe {
                        name: name.to_owned(),
                    });
                }
            }
        }
        chosen.sort();
        chosen.dedup();
        chosen
    } else {
        PROBES.to_vec()
    };
    let extra_roots = match &args.ca_file {
        Some(path) => load_ca_file(path)?,
        None => Vec::new(),
    };
    let target = Target {
        url: url.clone(),
        method,
        body: body.into(),
        headers,
        vary_field: args.vary_field,
        second_auth,
        concurrency: args.concurrency,
        key_required: args.key_required,
        id_field: args.id_field,
        timeout: args.timeout,
        max_requests: args.max_requests,
        extra_roots,
    };
    validate(&target, &probes, explicit)?;
    Ok((url, target, probes, args.format))
}
