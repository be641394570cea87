//! The probes' HTTP client: one [`Sender`] per run that sends only to the
//! target's URL, never follows redirects, counts every request against
//! `--max-requests`, and speaks TLS with the system's roots plus
//! `--ca-file`'s.
//!
//! Nothing here judges an answer: a [`Sender`] turns a [`Variant`] of the
//! base request into an [`Exchange`] (status 0 and the reason when no
//! answer came), and the probes decide what it means.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Instant;

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Request, Uri, header};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject;
use serde_json::Value;

use crate::Target;
use crate::error::CheckError;
use crate::outcome::{Exchange, Probe};

/// Reads the PEM certificates of `path` (`--ca-file`): the authorities of
/// a target whose certificate the system does not trust (a private CA).
///
/// # Errors
///
/// [`CheckError::CaFileUnreadable`], [`CheckError::CaFileNotPem`] or
/// [`CheckError::CaFileEmpty`].
pub fn load_ca_file(path: &std::path::Path) -> Result<Vec<CertificateDer<'static>>, CheckError> {
    let certs: Vec<_> = CertificateDer::pem_file_iter(path)
        .map_err(|source| CheckError::CaFileUnreadable {
            path: path.to_owned(),
            source,
        })?
        .collect::<Result<_, _>>()
        .map_err(|source| CheckError::CaFileNotPem {
            path: path.to_owned(),
            source,
        })?;
    if certs.is_empty() {
        return Err(CheckError::CaFileEmpty {
            path: path.to_owned(),
        });
    }
    Ok(certs)
}

/// `extra` as a root store (what `--ca-file` adds).
pub(crate) fn extra_roots(
    extra: &[CertificateDer<'static>],
) -> Result<rustls::RootCertStore, CheckError> {
    let mut roots = rustls::RootCertStore::empty();
    for cert in extra {
        roots
            .add(cert.clone())
            .map_err(|source| CheckError::UnusableCertificate { source })?;
    }
    Ok(roots)
}

/// The TLS client configuration: the system's roots plus `extra`.
fn tls_config(extra: &[CertificateDer<'static>]) -> Result<rustls::ClientConfig, CheckError> {
    let mut roots = extra_roots(extra)?;
    for cert in rustls_native_certs::load_native_certs().certs {
        // A system certificate rustls cannot use is skipped, not fatal.
        let _ = roots.add(cert);
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    Ok(rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(CheckError::Tls)?
        .with_root_certificates(roots)
        .with_no_client_auth())
}

/// Sends requests, counting them against the run's budget.
#[derive(Debug, Clone)]
pub(crate) struct Sender {
    client: Client<hyper_rustls::HttpsConnector<HttpConnector>, Full<Bytes>>,
    pub(crate) target: Arc<Target>,
    sent: Arc<AtomicU32>,
    run: String,
}

/// How a probe's request differs from the base one.
#[derive(Debug, Clone, Default)]
pub(crate) struct Variant {
    /// The `Idempotency-Key` to send, if any.
    pub(crate) key: Option<String>,
    /// A body instead of the target's.
    pub(crate) body: Option<Bytes>,
    /// An `Authorization` value instead of the target's.
    pub(crate) auth: Option<HeaderValue>,
    /// How the request is described in the evidence (e.g. "reordered").
    pub(crate) label: String,
}

impl Sender {
    /// A sender for one run against `target`, with a fresh run id.
    ///
    /// Fails only when TLS cannot be configured (an unusable `--ca-file`
    /// certificate, which [`validate`](crate::validate) refuses first).
    pub(crate) fn new(target: Target) -> Result<Self, CheckError> {
        let mut connector = HttpConnector::new();
        connector.set_connect_timeout(Some(target.timeout));
        connector.enforce_http(false);
        let tls = tls_config(&target.extra_roots)?;
        let https = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls)
            .https_or_http()
            .enable_http1()
            .wrap_connector(connector);
        Ok(Self {
            client: Client::builder(TokioExecutor::new()).build(https),
            target: Arc::new(target),
            sent: Arc::new(AtomicU32::new(0)),
            run: format!("{:08x}", uuid::Uuid::new_v4().as_u128() as u32),
        })
    }

    /// The `n`th key of `probe` in this run: fresh per run, so a check
    /// never collides with an earlier one's records.
    pub(crate) fn key(&self, probe: Probe, n: u32) -> String {
        format!("idem-check-{}-{}-{n}", self.run, probe.name())
    }

    /// Sends the base request changed by `v` and reads the whole answer.
    /// Never fails: no answer is an exchange with status 0 and the reason
    /// as its body.
    pub(crate) async fn send(&self, v: Variant) -> Exchange {
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
            "idempotency-replayed",
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

    /// The resource an answer names: the target's id field of its JSON
    /// body, else its `Location` header.
    pub(crate) fn resource(&self, e: &Exchange) -> Option<String> {
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
    let chain = error_chain(err);
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

/// `err` and its causes in one line, `: `-separated; a cause the line
/// already ends with (many errors print their source as `…: cause`) is
/// left out, and a word of a parent's own text does not hide a cause.
fn error_chain(err: &dyn std::error::Error) -> String {
    let mut out = err.to_string();
    let mut cur = err.source();
    while let Some(e) = cur {
        let s = e.to_string();
        let printed = out == s
            || out
                .strip_suffix(s.as_str())
                .is_some_and(|head| head.ends_with(": "));
        if !printed {
            out.push_str(": ");
            out.push_str(&s);
        }
        cur = e.source();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("{text}")]
    struct Layer {
        text: &'static str,
        #[source]
        source: Option<Box<Layer>>,
    }

    fn chain(texts: &[&'static str]) -> Layer {
        texts
            .iter()
            .rev()
            .fold(None, |source, &text| {
                Some(Layer {
                    text,
                    source: source.map(Box::new),
                })
            })
            .expect("at least one layer")
    }

    #[test]
    fn error_chains_join_causes_and_skip_repeats() {
        let err = chain(&[
            "client error (Connect)",
            "tcp connect error",
            "Connection refused",
        ]);
        assert_eq!(
            error_chain(&err),
            "client error (Connect): tcp connect error: Connection refused"
        );
        let err = chain(&["io: Connection refused", "Connection refused"]);
        assert_eq!(error_chain(&err), "io: Connection refused");
        // Spelled inside the parent's own text, not printed by it: kept.
        let err = chain(&["connect (timeout 5s)", "timeout"]);
        assert_eq!(error_chain(&err), "connect (timeout 5s): timeout");
    }

    #[test]
    fn transport_errors_name_tls_trouble_and_the_remedy() {
        let url: Uri = "https://127.0.0.1:1/v1/payments".parse().expect("uri");
        let err = chain(&[
            "client error (Connect)",
            "invalid peer certificate: UnknownIssuer",
        ]);
        assert_eq!(
            transport_error(&err, &url),
            "TLS: https://127.0.0.1:1/v1/payments presented a certificate this check does not trust (client error (Connect): invalid peer certificate: UnknownIssuer); pass --ca-file with the CA that signed it"
        );
        let err = chain(&["client error (Connect)", "Connection refused"]);
        assert_eq!(
            transport_error(&err, &url),
            "cannot reach https://127.0.0.1:1/v1/payments: client error (Connect): Connection refused"
        );
    }

    #[test]
    fn an_empty_or_missing_ca_file_is_refused_with_the_flag_named() {
        let err = load_ca_file("/nonexistent/ca.pem".as_ref()).expect_err("no such file");
        assert!(
            err.to_string()
                .starts_with("--ca-file /nonexistent/ca.pem: cannot read it: "),
            "{err}"
        );
        assert!(std::error::Error::source(&err).is_some());

        let dir = tempfile::tempdir().expect("temp dir");
        let empty = dir.path().join("empty.pem");
        std::fs::write(&empty, "no PEM section here\n").expect("write");
        let err = load_ca_file(&empty).expect_err("no certificate");
        assert!(matches!(err, CheckError::CaFileEmpty { .. }), "{err:?}");
        assert_eq!(
            err.to_string(),
            format!("--ca-file {}: no certificate in it", empty.display())
        );
    }
}
