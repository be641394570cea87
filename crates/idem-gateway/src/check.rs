//! `idem check`: black-box probes that tell whether an HTTP endpoint is
//! really idempotent, each with a verdict and the exchanges that justify it.
//!
//! The checker sends only to the one URL it is given, never follows
//! redirects, mints fresh keys per run (`idem-check-<run>-<probe>…`), and
//! never sends more than `--max-requests` requests in all. Exit code: 0
//! when every selected probe passed, 1 when one failed, 2 when the check
//! could not run (bad arguments, unreachable target).

use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Method, Request, Uri, header};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde::Serialize;
use serde_json::Value;

/// Every probe, in the order they run.
pub const PROBES: [Probe; 8] = [
    Probe::Retry,
    Probe::Concurrent,
    Probe::Reuse,
    Probe::EquivalentJson,
    Probe::DistinctKeys,
    Probe::MissingKey,
    Probe::MalformedKey,
    Probe::Tenants,
];

/// One black-box probe.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Probe {
    /// The same request sent again with the same key gets the same answer.
    Retry,
    /// N copies at once: one resource; the others replayed or 409.
    Concurrent,
    /// The key reused with a changed field is refused, not executed.
    Reuse,
    /// The same JSON with reordered keys and other white space is the same request.
    EquivalentJson,
    /// Different keys create different resources.
    DistinctKeys,
    /// A request without a key is refused where keys are required.
    MissingKey,
    /// Malformed and oversized keys are refused with 400.
    MalformedKey,
    /// The same key under two credentials makes two independent requests.
    Tenants,
}

impl Probe {
    /// The probe's name on the command line and in reports.
    pub const fn name(self) -> &'static str {
        match self {
            Self::Retry => "retry",
            Self::Concurrent => "concurrent",
            Self::Reuse => "reuse",
            Self::EquivalentJson => "equivalent-json",
            Self::DistinctKeys => "distinct-keys",
            Self::MissingKey => "missing-key",
            Self::MalformedKey => "malformed-key",
            Self::Tenants => "tenants",
        }
    }

    /// What the probe checks, in one sentence.
    pub const fn summary(self) -> &'static str {
        match self {
            Self::Retry => "a sequential retry with the same key returns the same status and body",
            Self::Concurrent => {
                "concurrent duplicates make exactly one resource; the others are replayed or get 409 with Retry-After"
            }
            Self::Reuse => {
                "the key reused with a changed field is rejected (400/409/422), not executed"
            }
            Self::EquivalentJson => {
                "semantically equal JSON (reordered keys, other white space) is treated as the same request"
            }
            Self::DistinctKeys => "different keys create different resources",
            Self::MissingKey => "a request without a key is rejected where keys are required",
            Self::MalformedKey => "malformed and oversized keys are rejected with 400",
            Self::Tenants => "the same key under different credentials makes independent requests",
        }
    }

    /// Requests the probe sends at most (`concurrency` for the concurrent one).
    pub fn budget(self, concurrency: u32) -> u32 {
        match self {
            Self::Retry | Self::Reuse | Self::EquivalentJson | Self::DistinctKeys => 2,
            Self::Tenants | Self::MalformedKey => 2,
            Self::Concurrent => concurrency,
            Self::MissingKey => 1,
        }
    }

    /// Parses a probe name.
    pub fn parse(name: &str) -> Option<Self> {
        PROBES.into_iter().find(|p| p.name() == name.trim())
    }
}

/// Whether a probe passed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Verdict {
    /// The endpoint behaved idempotently.
    Pass,
    /// It did not; the evidence shows how.
    Fail,
    /// Not applicable with the given arguments (the note says why).
    Skip,
    /// The probe could not be judged (a transport error, rate limiting).
    Error,
}

/// One request and what came back.
#[derive(Debug, Clone, Serialize)]
pub struct Exchange {
    /// What was sent, in one line (method, key, credential label, body digest).
    pub request: String,
    /// Status, or 0 when no response came.
    pub status: u16,
    /// Idempotency-relevant headers of the answer.
    pub headers: Vec<(String, String)>,
    /// The start of the body (or the transport error).
    pub body: String,
    /// Milliseconds until the whole answer was read.
    pub millis: u64,
    #[serde(skip)]
    full_body: Bytes,
    #[serde(skip)]
    header_map: HeaderMap,
}

impl Exchange {
    fn header(&self, name: &str) -> Option<&str> {
        self.header_map.get(name).and_then(|v| v.to_str().ok())
    }

    fn replayed(&self) -> bool {
        self.header("idempotent-replayed") == Some("true")
    }

    fn success(&self) -> bool {
        (200..300).contains(&self.status)
    }
}

/// The result of one probe.
#[derive(Debug, Clone, Serialize)]
pub struct Outcome {
    /// The probe.
    pub probe: Probe,
    /// Pass, fail, skip or error.
    pub verdict: Verdict,
    /// Why, in a sentence.
    pub note: String,
    /// The exchanges that justify the verdict.
    pub evidence: Vec<Exchange>,
    /// Seconds the probe took.
    pub seconds: f64,
}

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

/// Reads the PEM certificates of `path` (`--ca-file`): the authorities of
/// a target whose certificate the system does not trust (a private CA).
pub fn load_ca_file(
    path: &std::path::Path,
) -> Result<Vec<rustls::pki_types::CertificateDer<'static>>, String> {
    use rustls::pki_types::pem::PemObject;
    let certs: Vec<_> = rustls::pki_types::CertificateDer::pem_file_iter(path)
        .map_err(|e| format!("--ca-file {}: cannot read it: {e}", path.display()))?
        .collect::<Result<_, _>>()
        .map_err(|e| format!("--ca-file {}: not PEM certificates: {e}", path.display()))?;
    if certs.is_empty() {
        return Err(format!(
            "--ca-file {}: no certificate in it",
            path.display()
        ));
    }
    Ok(certs)
}

/// `extra` as a root store (what `--ca-file` adds).
fn extra_roots(
    extra: &[rustls::pki_types::CertificateDer<'static>],
) -> Result<rustls::RootCertStore, String> {
    let mut roots = rustls::RootCertStore::empty();
    for cert in extra {
        roots
            .add(cert.clone())
            .map_err(|e| format!("--ca-file: unusable certificate: {e}"))?;
    }
    Ok(roots)
}

/// The TLS client configuration: the system's roots plus `extra`.
fn tls_config(
    extra: &[rustls::pki_types::CertificateDer<'static>],
) -> Result<rustls::ClientConfig, String> {
    let mut roots = extra_roots(extra)?;
    for cert in rustls_native_certs::load_native_certs().certs {
        // A system certificate rustls cannot use is skipped, not fatal.
        let _ = roots.add(cert);
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    Ok(rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_root_certificates(roots)
        .with_no_client_auth())
}

/// Refuses arguments that cannot work, with a message naming the flag.
/// Probes named explicitly (`explicit`) must be runnable; with `all`, the
/// ones missing their arguments are reported as skipped instead.
pub fn validate(target: &Target, probes: &[Probe], explicit: bool) -> Result<(), String> {
    match target.url.scheme_str() {
        Some("http" | "https") => {}
        _ => {
            return Err(format!(
                "--url {}: expected an http:// or https:// URL",
                target.url
            ));
        }
    }
    // The system's roots are loaded once, when the run starts.
    extra_roots(&target.extra_roots)?;
    if target.url.authority().is_none() {
        return Err(format!("--url {}: the URL has no host", target.url));
    }
    if let Some(field) = &target.vary_field {
        let json: Value = serde_json::from_slice(&target.body).map_err(|e| {
            format!("--vary-field {field}: the body is not JSON ({e}), so no field can be varied")
        })?;
        if json.get(field).is_none() {
            return Err(format!(
                "--vary-field {field}: the body has no top-level field {field:?}"
            ));
        }
    }
    let needed: u32 = probes.iter().map(|p| p.budget(target.concurrency)).sum();
    if explicit && probes.contains(&Probe::Reuse) && target.vary_field.is_none() {
        return Err(
            "--probes reuse needs --vary-field FIELD (a top-level JSON field to change)".to_owned(),
        );
    }
    if explicit && probes.contains(&Probe::Tenants) && target.second_auth.is_none() {
        return Err("--probes tenants needs --auth2 (a second credential)".to_owned());
    }
    if needed > target.max_requests {
        return Err(format!(
            "the selected probes need {needed} requests but --max-requests is {}; raise it or select fewer probes",
            target.max_requests
        ));
    }
    Ok(())
}

/// Sends requests, counting them against the run's budget.
#[derive(Debug, Clone)]
struct Sender {
    client: Client<hyper_rustls::HttpsConnector<HttpConnector>, Full<Bytes>>,
    target: Arc<Target>,
    sent: Arc<AtomicU32>,
    run: String,
}

/// How a probe's request differs from the base one.
#[derive(Debug, Clone, Default)]
struct Variant {
    key: Option<String>,
    body: Option<Bytes>,
    auth: Option<HeaderValue>,
    label: String,
}

impl Sender {
    fn key(&self, probe: Probe, n: u32) -> String {
        format!("idem-check-{}-{}-{n}", self.run, probe.name())
    }

    async fn send(&self, v: Variant) -> Exchange {
        let started = Instant::now();
        let body = v.body.clone().unwrap_or_else(|| self.target.body.clone());
        let request = format!(
            "{} {} key={} {}body={} bytes{}",
            self.target.method,
            self.target.url.path(),
            v.key.as_deref().map_or("(none)".to_owned(), |k| {
                if k.len() > 40 {
                    format!("{}…({} chars)", &k[..20], k.len())
                } else {
                    format!("{k:?}")
                }
            }),
            if v.label.is_empty() {
                String::new()
            } else {
                format!("{} ", v.label)
            },
            body.len(),
            if v.body.is_some() { " (varied)" } else { "" }
        );
        let failed = |why: String| Exchange {
            request: request.clone(),
            status: 0,
            headers: Vec::new(),
            body: why,
            millis: started.elapsed().as_millis() as u64,
            full_body: Bytes::new(),
            header_map: HeaderMap::new(),
        };
        if self.sent.fetch_add(1, Ordering::SeqCst) >= self.target.max_requests {
            return failed(format!(
                "not sent: the run reached --max-requests {}",
                self.target.max_requests
            ));
        }
        let mut req = Request::builder()
            .method(self.target.method.clone())
            .uri(self.target.url.clone());
        if let Some(headers) = req.headers_mut() {
            for (name, value) in &self.target.headers {
                headers.append(name, value.clone());
            }
            if let Some(auth) = v.auth {
                headers.insert(header::AUTHORIZATION, auth);
            }
            if let Some(key) = &v.key {
                match HeaderValue::from_str(key) {
                    Ok(value) => {
                        headers.insert(HeaderName::from_static("idempotency-key"), value);
                    }
                    Err(_) => return failed(format!("key {key:?} cannot be sent as a header")),
                }
            }
        }
        let req = match req.body(Full::new(body)) {
            Ok(r) => r,
            Err(e) => return failed(format!("cannot build the request: {e}")),
        };
        let answer = tokio::time::timeout(self.target.timeout, async {
            let resp = self.client.request(req).await?;
            let (parts, body) = resp.into_parts();
            let body = body.collect().await?.to_bytes();
            Ok::<_, Box<dyn std::error::Error + Send + Sync>>((parts, body))
        })
        .await;
        let (parts, body) = match answer {
            Err(_) => {
                return failed(format!(
                    "no answer within {} ms",
                    self.target.timeout.as_millis()
                ));
            }
            Ok(Err(e)) => return failed(transport_error(&*e, &self.target.url)),
            Ok(Ok(answer)) => answer,
        };
        let headers = [
            "idempotent-replayed",
            "retry-after",
            "location",
            "content-type",
            "idempotency-status",
        ]
        .iter()
        .filter_map(|n| {
            parts
                .headers
                .get(*n)
                .and_then(|v| v.to_str().ok())
                .map(|v| ((*n).to_owned(), v.to_owned()))
        })
        .collect();
        let text = String::from_utf8_lossy(&body);
        Exchange {
            request,
            status: parts.status.as_u16(),
            headers,
            body: text.chars().take(300).collect(),
            millis: started.elapsed().as_millis() as u64,
            full_body: body,
            header_map: parts.headers,
        }
    }

    fn resource(&self, e: &Exchange) -> Option<String> {
        serde_json::from_slice::<Value>(&e.full_body)
            .ok()
            .and_then(|v| match v.get(&self.target.id_field)? {
                Value::String(s) => Some(s.clone()),
                Value::Null => None,
                other => Some(other.to_string()),
            })
            .or_else(|| e.header("location").map(str::to_owned))
    }
}

/// A transport error as one clear line.
fn transport_error(err: &(dyn std::error::Error + 'static), url: &Uri) -> String {
    let chain = crate::server::error_chain(err);
    if chain.contains("certificate") {
        format!(
            "TLS: {url} presented a certificate this check does not trust ({chain}); pass --ca-file with the CA that signed it"
        )
    } else if chain.contains("tls") || chain.contains("TLS") || chain.contains("handshake") {
        format!("TLS: cannot talk TLS with {url} ({chain})")
    } else {
        format!("cannot reach {url}: {chain}")
    }
}

/// Runs the probes in order and returns their outcomes.
pub async fn run(target: Target, probes: &[Probe]) -> Vec<Outcome> {
    let mut connector = HttpConnector::new();
    connector.set_connect_timeout(Some(target.timeout));
    connector.enforce_http(false);
    let tls = match tls_config(&target.extra_roots) {
        Ok(tls) => tls,
        // `validate` refuses this first; a caller that skipped it gets
        // every probe in error with the reason.
        Err(why) => {
            return probes
                .iter()
                .map(|&probe| Outcome {
                    probe,
                    verdict: Verdict::Error,
                    note: why.clone(),
                    evidence: Vec::new(),
                    seconds: 0.0,
                })
                .collect();
        }
    };
    let https = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(tls)
        .https_or_http()
        .enable_http1()
        .wrap_connector(connector);
    let sender = Sender {
        client: Client::builder(TokioExecutor::new()).build(https),
        target: Arc::new(target),
        sent: Arc::new(AtomicU32::new(0)),
        run: format!("{:08x}", idem::OwnerToken::random().as_u128() as u32),
    };
    let mut outcomes = Vec::with_capacity(probes.len());
    for &probe in probes {
        if let Some(why) = unreachable(&outcomes) {
            outcomes.push(Outcome {
                probe,
                verdict: Verdict::Error,
                note: format!("not run: {why}"),
                evidence: Vec::new(),
                seconds: 0.0,
            });
            continue;
        }
        let started = Instant::now();
        let (verdict, note, evidence) = probe_once(&sender, probe).await;
        // Transport failures and rate limiting are not the endpoint's
        // idempotency failing: say so instead of blaming it.
        let (verdict, note) = match evidence.iter().find(|e| e.status == 0 || e.status == 429) {
            Some(e) if e.status == 0 => (Verdict::Error, e.body.clone()),
            Some(e) => (
                Verdict::Error,
                format!(
                    "the target rate-limited the check (429{}); lower --concurrency or run it later",
                    e.header("retry-after")
                        .map(|r| format!(", Retry-After: {r}"))
                        .unwrap_or_default()
                ),
            ),
            None => (verdict, note),
        };
        outcomes.push(Outcome {
            probe,
            verdict,
            note,
            evidence,
            seconds: started.elapsed().as_secs_f64(),
        });
    }
    outcomes
}

/// Why the target is unreachable, if the last probe got no answer at all.
fn unreachable(outcomes: &[Outcome]) -> Option<String> {
    let last = outcomes.last()?;
    (last.verdict == Verdict::Error
        && !last.evidence.is_empty()
        && last.evidence.iter().all(|e| e.status == 0))
    .then(|| last.evidence[0].body.clone())
}

type Judged = (Verdict, String, Vec<Exchange>);

/// A probe judged on answers that are not successes would prove nothing
/// (two identical 401s look idempotent): the request itself must work.
fn failed_baseline(evidence: Vec<Exchange>) -> Judged {
    let first = evidence
        .iter()
        .find(|e| !e.success())
        .map_or(0, |e| e.status);
    (
        Verdict::Error,
        format!(
            "the request was answered {first}, not a success: fix the request (URL, credentials, body) before judging idempotency"
        ),
        evidence,
    )
}

fn same_answer(a: &Exchange, b: &Exchange) -> bool {
    a.status == b.status && a.full_body == b.full_body
}

async fn probe_once(s: &Sender, probe: Probe) -> Judged {
    let keyed = |n: u32| Variant {
        key: Some(s.key(probe, n)),
        ..Variant::default()
    };
    match probe {
        Probe::Retry => {
            let first = s.send(keyed(0)).await;
            if !first.success() {
                return failed_baseline(vec![first]);
            }
            let second = s.send(keyed(0)).await;
            let marker = if second.replayed() {
                "the retry is marked Idempotent-Replayed: true"
            } else {
                "the retry is not marked Idempotent-Replayed"
            };
            let verdict = if same_answer(&first, &second) {
                (Verdict::Pass, format!("same status and body; {marker}"))
            } else if first.status != second.status {
                (
                    Verdict::Fail,
                    format!(
                        "the retry got {} where the first request got {}",
                        second.status, first.status
                    ),
                )
            } else {
                (
                    Verdict::Fail,
                    format!(
                        "same status but a different body: the retry was executed again ({marker})"
                    ),
                )
            };
            (verdict.0, verdict.1, vec![first, second])
        }
        Probe::Concurrent => {
            let key = s.key(probe, 0);
            let mut tasks = tokio::task::JoinSet::new();
            for _ in 0..s.target.concurrency {
                let (s, key) = (s.clone(), key.clone());
                tasks.spawn(async move {
                    s.send(Variant {
                        key: Some(key),
                        ..Variant::default()
                    })
                    .await
                });
            }
            let mut answers = Vec::new();
            while let Some(done) = tasks.join_next().await {
                if let Ok(e) = done {
                    answers.push(e);
                }
            }
            let resources: BTreeSet<String> = answers
                .iter()
                .filter(|e| e.success())
                .filter_map(|e| s.resource(e))
                .collect();
            let successes = answers.iter().filter(|e| e.success()).count();
            let conflicts = answers.iter().filter(|e| e.status == 409).count();
            let bad_conflicts = answers
                .iter()
                .filter(|e| e.status == 409 && e.header("retry-after").is_none())
                .count();
            let others: Vec<u16> = answers
                .iter()
                .filter(|e| !e.success() && e.status != 409)
                .map(|e| e.status)
                .collect();
            let summary = format!(
                "{} copies: {successes} success ({} distinct resource(s)), {conflicts} × 409, others {others:?}",
                answers.len(),
                resources.len()
            );
            let verdict = if successes == 0 && conflicts == 0 {
                answers.sort_by_key(|e| e.millis);
                return failed_baseline(answers);
            } else if successes == 0 {
                (Verdict::Fail, format!("no copy succeeded; {summary}"))
            } else if resources.len() > 1 {
                (
                    Verdict::Fail,
                    format!("duplicates created several resources; {summary}"),
                )
            } else if resources.is_empty()
                && answers
                    .iter()
                    .filter(|e| e.success())
                    .map(|e| &e.full_body)
                    .collect::<BTreeSet<_>>()
                    .len()
                    > 1
            {
                (
                    Verdict::Fail,
                    format!(
                        "successful answers differ and name no resource id (set --id-field); {summary}"
                    ),
                )
            } else if !others.is_empty() {
                (
                    Verdict::Fail,
                    format!("some copies got neither the answer nor 409; {summary}"),
                )
            } else if bad_conflicts > 0 {
                (
                    Verdict::Fail,
                    format!("{bad_conflicts} × 409 without Retry-After; {summary}"),
                )
            } else {
                (Verdict::Pass, format!("exactly one resource; {summary}"))
            };
            answers.sort_by_key(|e| e.millis);
            (verdict.0, verdict.1, answers)
        }
        Probe::Reuse => {
            let Some(field) = &s.target.vary_field else {
                return (
                    Verdict::Skip,
                    "needs --vary-field FIELD (a top-level JSON field to change)".to_owned(),
                    Vec::new(),
                );
            };
            let first = s.send(keyed(0)).await;
            if !first.success() {
                return failed_baseline(vec![first]);
            }
            let varied = vary(&s.target.body, field);
            let second = s
                .send(Variant {
                    body: Some(varied),
                    ..keyed(0)
                })
                .await;
            let verdict = if matches!(second.status, 400 | 409 | 422) {
                (
                    Verdict::Pass,
                    format!("the changed request was refused with {}", second.status),
                )
            } else if same_answer(&first, &second) {
                (Verdict::Fail, "the changed request silently got the first request's answer: a client changing its request would never learn it was not applied".to_owned())
            } else {
                (
                    Verdict::Fail,
                    format!(
                        "the changed request was answered {} and may have been executed",
                        second.status
                    ),
                )
            };
            (verdict.0, verdict.1, vec![first, second])
        }
        Probe::EquivalentJson => {
            let Ok(json) = serde_json::from_slice::<Value>(&s.target.body) else {
                return (Verdict::Skip, "the body is not JSON".to_owned(), Vec::new());
            };
            let first = s.send(keyed(0)).await;
            if !first.success() {
                return failed_baseline(vec![first]);
            }
            let second = s
                .send(Variant {
                    body: Some(reformat(&json)),
                    label: "reordered".into(),
                    ..keyed(0)
                })
                .await;
            let verdict = if same_answer(&first, &second) {
                (
                    Verdict::Pass,
                    "the reordered, re-spaced JSON got the first answer".to_owned(),
                )
            } else if matches!(second.status, 400 | 409 | 422) {
                (
                    Verdict::Fail,
                    format!(
                        "the same JSON written differently was refused with {} as a different request",
                        second.status
                    ),
                )
            } else {
                (
                    Verdict::Fail,
                    format!(
                        "the same JSON written differently got another answer ({} vs {})",
                        second.status, first.status
                    ),
                )
            };
            (verdict.0, verdict.1, vec![first, second])
        }
        Probe::DistinctKeys => {
            let a = s.send(keyed(0)).await;
            if !a.success() {
                return failed_baseline(vec![a]);
            }
            let b = s.send(keyed(1)).await;
            let (ra, rb) = (s.resource(&a), s.resource(&b));
            let verdict = match (&ra, &rb) {
                _ if !a.success() || !b.success() => (
                    Verdict::Fail,
                    format!("not both succeeded ({} and {})", a.status, b.status),
                ),
                (Some(x), Some(y)) if x != y => {
                    (Verdict::Pass, format!("two resources: {x} and {y}"))
                }
                (Some(x), Some(_)) => (
                    Verdict::Fail,
                    format!("both keys got resource {x}: distinct keys were merged"),
                ),
                _ if a.full_body != b.full_body => (
                    Verdict::Pass,
                    "the answers differ (no resource id found)".to_owned(),
                ),
                _ => (
                    Verdict::Fail,
                    "both keys got the identical answer".to_owned(),
                ),
            };
            (verdict.0, verdict.1, vec![a, b])
        }
        Probe::MissingKey => {
            let e = s.send(Variant::default()).await;
            let verdict = match (s.target.key_required, e.status) {
                (true, 400 | 422 | 428) => (Verdict::Pass, format!("refused with {}", e.status)),
                (true, status) => (
                    Verdict::Fail,
                    format!(
                        "a request without a key was answered {status}; with --key-required it must be refused (400)"
                    ),
                ),
                (false, status) if (200..300).contains(&status) => (
                    Verdict::Pass,
                    format!(
                        "keys are optional here: answered {status} (pass --key-required if the endpoint must demand one)"
                    ),
                ),
                (false, status) => (Verdict::Pass, format!("answered {status} without a key")),
            };
            (verdict.0, verdict.1, vec![e])
        }
        Probe::MalformedKey => {
            let bad = s
                .send(Variant {
                    key: Some("bad key with spaces".to_owned()),
                    ..Variant::default()
                })
                .await;
            let long = s
                .send(Variant {
                    key: Some(format!("{}-{}", s.key(probe, 0), "x".repeat(300))),
                    ..Variant::default()
                })
                .await;
            let refused = |e: &Exchange| matches!(e.status, 400 | 422);
            let verdict = match (refused(&bad), refused(&long)) {
                (true, true) => (
                    Verdict::Pass,
                    format!("both refused ({} and {})", bad.status, long.status),
                ),
                (false, _) => (
                    Verdict::Fail,
                    format!(
                        "a key with spaces was answered {}: malformed keys are accepted",
                        bad.status
                    ),
                ),
                (_, false) => (
                    Verdict::Fail,
                    format!(
                        "a {}-character key was answered {}: oversized keys are accepted",
                        300 + s.key(probe, 0).len() + 1,
                        long.status
                    ),
                ),
            };
            (verdict.0, verdict.1, vec![bad, long])
        }
        Probe::Tenants => {
            let Some(second) = s.target.second_auth.clone() else {
                return (
                    Verdict::Skip,
                    "needs --auth2 (a second credential)".to_owned(),
                    Vec::new(),
                );
            };
            let a = s.send(keyed(0)).await;
            if !a.success() {
                return failed_baseline(vec![a]);
            }
            let b = s
                .send(Variant {
                    auth: Some(second),
                    label: "as the second credential".into(),
                    ..keyed(0)
                })
                .await;
            let (ra, rb) = (s.resource(&a), s.resource(&b));
            let verdict = if !a.success() || !b.success() {
                (
                    Verdict::Fail,
                    format!(
                        "not both succeeded ({} and {}): one tenant's key blocked the other's",
                        a.status, b.status
                    ),
                )
            } else if b.replayed() || same_answer(&a, &b) && ra == rb {
                (Verdict::Fail, "the second credential got the first one's answer: keys are not scoped by tenant (a data leak)".to_owned())
            } else {
                (Verdict::Pass, "two independent executions".to_owned())
            };
            (verdict.0, verdict.1, vec![a, b])
        }
    }
}

/// The body with `field` changed to a value that differs from the original.
fn vary(body: &[u8], field: &str) -> Bytes {
    let mut json: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
    if let Some(v) = json.get_mut(field) {
        *v = match v.take() {
            Value::Number(n) => n.as_i64().map_or_else(
                || Value::from(n.as_f64().unwrap_or(0.0) + 1.0),
                |i| Value::from(i.wrapping_add(1)),
            ),
            Value::String(s) => Value::from(format!("{s}-changed")),
            Value::Bool(b) => Value::from(!b),
            _ => Value::from("changed"),
        };
    }
    Bytes::from(json.to_string())
}

/// The same JSON value written differently: object keys in reverse order,
/// with white space.
fn reformat(json: &Value) -> Bytes {
    fn write(v: &Value, out: &mut String) {
        match v {
            Value::Object(map) => {
                out.push_str("{ ");
                let mut first = true;
                for (k, v) in map.iter().rev() {
                    if !first {
                        out.push_str(" ,\n  ");
                    }
                    first = false;
                    out.push_str(&Value::from(k.clone()).to_string());
                    out.push_str(" :  ");
                    write(v, out);
                }
                out.push_str(" }");
            }
            Value::Array(items) => {
                out.push_str("[ ");
                for (i, v) in items.iter().enumerate() {
                    if i > 0 {
                        out.push_str(" , ");
                    }
                    write(v, out);
                }
                out.push_str(" ]");
            }
            other => out.push_str(&other.to_string()),
        }
    }
    let mut out = String::new();
    write(json, &mut out);
    out.push('\n');
    Bytes::from(out)
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

/// The human report.
pub fn text_report(url: &Uri, outcomes: &[Outcome]) -> String {
    let mut out = format!("idem check {url}\n\n");
    for o in outcomes {
        let mark = match o.verdict {
            Verdict::Pass => "PASS",
            Verdict::Fail => "FAIL",
            Verdict::Skip => "SKIP",
            Verdict::Error => "ERROR",
        };
        let _ = writeln!(out, "{mark:<5} {:<16} {}", o.probe.name(), o.note);
        if matches!(o.verdict, Verdict::Fail | Verdict::Error) {
            for e in o.evidence.iter().take(6) {
                let _ = writeln!(out, "      → {}", e.request);
                let headers: Vec<String> =
                    e.headers.iter().map(|(n, v)| format!("{n}: {v}")).collect();
                let _ = writeln!(
                    out,
                    "      ← {} {} {}",
                    e.status,
                    headers.join("; "),
                    one_line(&e.body, 120)
                );
            }
            if o.evidence.len() > 6 {
                let _ = writeln!(
                    out,
                    "      … {} more exchanges (--format json shows all)",
                    o.evidence.len() - 6
                );
            }
        }
    }
    let count = |v: Verdict| outcomes.iter().filter(|o| o.verdict == v).count();
    let _ = writeln!(
        out,
        "\n{} passed, {} failed, {} skipped, {} errors",
        count(Verdict::Pass),
        count(Verdict::Fail),
        count(Verdict::Skip),
        count(Verdict::Error)
    );
    out
}

fn one_line(text: &str, max: usize) -> String {
    let flat: String = text
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    if flat.chars().count() > max {
        format!("{}…", flat.chars().take(max).collect::<String>())
    } else {
        flat
    }
}

/// The JSON report.
pub fn json_report(url: &Uri, outcomes: &[Outcome]) -> String {
    serde_json::json!({
        "url": url.to_string(),
        "passed": exit_code(outcomes) == 0,
        "probes": outcomes,
    })
    .to_string()
}

/// A JUnit XML report (one test case per probe) for CI pipelines.
pub fn junit_report(url: &Uri, outcomes: &[Outcome]) -> String {
    let count = |v: Verdict| outcomes.iter().filter(|o| o.verdict == v).count();
    let total: f64 = outcomes.iter().map(|o| o.seconds).sum();
    let mut out = String::from("<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n");
    let _ = writeln!(
        out,
        "<testsuite name=\"idem check {}\" tests=\"{}\" failures=\"{}\" errors=\"{}\" skipped=\"{}\" time=\"{total:.3}\">",
        xml(&url.to_string()),
        outcomes.len(),
        count(Verdict::Fail),
        count(Verdict::Error),
        count(Verdict::Skip)
    );
    for o in outcomes {
        let _ = write!(
            out,
            "  <testcase classname=\"idem.check\" name=\"{}\" time=\"{:.3}\">",
            o.probe.name(),
            o.seconds
        );
        let evidence: String = o
            .evidence
            .iter()
            .map(|e| {
                format!(
                    "-> {}\n<- {} {}\n",
                    e.request,
                    e.status,
                    one_line(&e.body, 200)
                )
            })
            .collect();
        match o.verdict {
            Verdict::Pass => {}
            Verdict::Skip => {
                let _ = write!(out, "<skipped message=\"{}\"/>", xml(&o.note));
            }
            Verdict::Fail => {
                let _ = write!(
                    out,
                    "<failure message=\"{}\">{}</failure>",
                    xml(&o.note),
                    xml(&evidence)
                );
            }
            Verdict::Error => {
                let _ = write!(
                    out,
                    "<error message=\"{}\">{}</error>",
                    xml(&o.note),
                    xml(&evidence)
                );
            }
        }
        let _ = writeln!(
            out,
            "<system-out>{}</system-out></testcase>",
            xml(o.probe.summary())
        );
    }
    out.push_str("</testsuite>\n");
    out
}

fn xml(text: &str) -> String {
    text.chars()
        .filter(|c| !c.is_control() || *c == '\n' || *c == '\t')
        .fold(String::with_capacity(text.len()), |mut s, c| {
            match c {
                '&' => s.push_str("&amp;"),
                '<' => s.push_str("&lt;"),
                '>' => s.push_str("&gt;"),
                '"' => s.push_str("&quot;"),
                '\'' => s.push_str("&apos;"),
                c => s.push(c),
            }
            s
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reformatted_json_is_the_same_value_written_differently() {
        let json: Value = serde_json::from_str(r#"{"a":1,"b":{"c":[1,2],"d":"x"}}"#).expect("json");
        let text = reformat(&json);
        assert_ne!(text, Bytes::from(json.to_string()));
        let back: Value = serde_json::from_slice(&text).expect("still JSON");
        assert_eq!(back, json);
    }

    #[test]
    fn varied_fields_change() {
        let body = br#"{"amount_cents":100,"currency":"EUR","live":true}"#;
        for field in ["amount_cents", "currency", "live"] {
            let varied: Value = serde_json::from_slice(&vary(body, field)).expect("json");
            let original: Value = serde_json::from_slice(body).expect("json");
            assert_ne!(varied[field], original[field], "{field}");
        }
    }

    #[test]
    fn junit_escapes_and_counts() {
        let outcomes = vec![Outcome {
            probe: Probe::Retry,
            verdict: Verdict::Fail,
            note: "got <201> & \"more\"".into(),
            evidence: Vec::new(),
            seconds: 0.5,
        }];
        let xml = junit_report(&"http://h/x".parse().expect("uri"), &outcomes);
        assert!(xml.contains("failures=\"1\""), "{xml}");
        assert!(
            xml.contains("got &lt;201&gt; &amp; &quot;more&quot;"),
            "{xml}"
        );
        assert_eq!(exit_code(&outcomes), 1);
    }

    #[test]
    fn probe_names_round_trip() {
        for p in PROBES {
            assert_eq!(Probe::parse(p.name()), Some(p));
        }
        assert_eq!(Probe::parse("nope"), None);
    }
}
