//! The TLS client of an `https://` upstream, built and checked at start
//! from `upstream_ca_file`, `upstream_client_cert` / `upstream_client_key`
//! and `upstream_http2`:
//!
//! ```toml
//! upstream = "https://payments.internal:8443"
//! upstream_ca_file = "/etc/idem/private-ca.pem"   # beside the system's roots
//! upstream_client_cert = "/etc/idem/gateway.pem"  # mTLS: both or neither
//! upstream_client_key = "/etc/idem/gateway.key"
//! upstream_http2 = "auto"                         # or "never"
//! ```
//!
//! An `http://` upstream speaks HTTP/1.1, and HTTP/2 by prior knowledge
//! to gRPC calls; `upstream_http2 = "prior_knowledge"` sends every request
//! so (an h2c-only server).
//!
//! A file that cannot be read, holds no PEM certificate, or a key that does
//! not match its certificate stops the start with the file's line; so does
//! any of these keys beside a plain `http://` upstream, where it would be
//! silently ignored.

use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use toml::Spanned;

use super::error::ConfigError;
use super::file::{FileConfig, Source};
use super::secrets::read_secret_file;

/// The TLS client configuration for `https://` upstreams (`None` for
/// `http://`), or why the file's TLS keys are refused.
pub(super) fn upstream_tls(
    src: &Source<'_>,
    file: &FileConfig,
    https: bool,
) -> Result<Option<Arc<rustls::ClientConfig>>, ConfigError> {
    let keys = [
        ("upstream_ca_file", &file.upstream_ca_file),
        ("upstream_client_cert", &file.upstream_client_cert),
        ("upstream_client_key", &file.upstream_client_key),
    ];
    if !https {
        return match keys.iter().find_map(|(k, v)| v.as_ref().map(|v| (k, v))) {
            Some((key, v)) => Err(src.error(
                key,
                v,
                "applies to an https:// upstream only, and the upstream is http://",
            )),
            None => Ok(None),
        };
    }
    let http2 = match &file.upstream_http2 {
        None => true,
        Some(v) => match v.get_ref().as_str() {
            "auto" => true,
            "never" => false,
            "prior_knowledge" => {
                return Err(src.error(
                    "upstream_http2",
                    v,
                    "an https:// upstream agrees on HTTP/2 by ALPN: write \"auto\" (the default); prior knowledge is for http:// upstreams",
                ));
            }
            _ => {
                return Err(src.error(
                    "upstream_http2",
                    v,
                    "must be \"auto\" (HTTP/2 when the upstream offers it) or \"never\"",
                ));
            }
        },
    };
    let mut roots = rustls::RootCertStore::empty();
    if let Some(path) = &file.upstream_ca_file {
        for cert in certificates(src, "upstream_ca_file", path)? {
            roots.add(cert).map_err(|e| {
                src.error(
                    "upstream_ca_file",
                    path,
                    format!("a certificate in it cannot be a trust anchor: {e}"),
                )
            })?;
        }
    }
    let system = rustls_native_certs::load_native_certs();
    for cert in system.certs {
        // A system certificate rustls cannot use is skipped, not fatal:
        // the system's store is not ours to judge.
        let _ = roots.add(cert);
    }
    if roots.is_empty() {
        return Err(ConfigError::new(format!(
            "{}: the upstream is https:// but no certificate authority is trusted: the system has none ({} errors reading it), and no upstream_ca_file is set",
            src.file.display(),
            system.errors.len()
        )));
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| ConfigError::new(format!("cannot set up TLS: {e}")))?
        .with_root_certificates(roots);
    let mut config = match (&file.upstream_client_cert, &file.upstream_client_key) {
        (None, None) => builder.with_no_client_auth(),
        (Some(cert), Some(key)) => {
            let chain = certificates(src, "upstream_client_cert", cert)?;
            let text = read_secret_file(src, "upstream_client_key", key, "the client key file")?;
            let private = PrivateKeyDer::from_pem_slice(text.as_bytes()).map_err(|e| {
                src.error(
                    "upstream_client_key",
                    key,
                    format!("not a PEM private key: {e}"),
                )
            })?;
            builder.with_client_auth_cert(chain, private).map_err(|e| {
                src.error(
                    "upstream_client_key",
                    key,
                    format!("cannot be used with upstream_client_cert: {e}"),
                )
            })?
        }
        (Some(v), None) => {
            return Err(src.error(
                "upstream_client_cert",
                v,
                "needs upstream_client_key beside it (mTLS takes both)",
            ));
        }
        (None, Some(v)) => {
            return Err(src.error(
                "upstream_client_key",
                v,
                "needs upstream_client_cert beside it (mTLS takes both)",
            ));
        }
    };
    config.alpn_protocols = if http2 {
        vec![b"h2".to_vec(), b"http/1.1".to_vec()]
    } else {
        vec![b"http/1.1".to_vec()]
    };
    Ok(Some(Arc::new(config)))
}

/// Whether every request to an `http://` upstream goes in HTTP/2 by
/// prior knowledge (`upstream_http2 = "prior_knowledge"`; `"never"`, the
/// default there, sends only gRPC calls so). On an `https://` upstream
/// the key is [`upstream_tls`]'s.
pub(super) fn prior_knowledge(
    src: &Source<'_>,
    file: &FileConfig,
    https: bool,
) -> Result<bool, ConfigError> {
    match &file.upstream_http2 {
        Some(v) if !https => match v.get_ref().as_str() {
            "prior_knowledge" => Ok(true),
            "never" => Ok(false),
            _ => Err(src.error(
                "upstream_http2",
                v,
                "an http:// upstream takes \"prior_knowledge\" (HTTP/2 for every request, an h2c server) or \"never\" (HTTP/1.1, and HTTP/2 for gRPC calls only, the default)",
            )),
        },
        _ => Ok(false),
    }
}

/// The PEM certificates of the file `path` names (config key `key`).
fn certificates(
    src: &Source<'_>,
    key: &str,
    path: &Spanned<String>,
) -> Result<Vec<CertificateDer<'static>>, ConfigError> {
    let certs: Vec<_> = CertificateDer::pem_file_iter(path.get_ref())
        .map_err(|e| src.error(key, path, format!("cannot read it: {e}")))?
        .collect::<Result<_, _>>()
        .map_err(|e| src.error(key, path, format!("not PEM certificates: {e}")))?;
    if certs.is_empty() {
        return Err(src.error(key, path, "holds no PEM certificate"));
    }
    Ok(certs)
}
