//! `https://` upstreams, against a real TLS server on loopback with
//! certificates made for this run (rcgen): a private CA given by
//! `upstream_ca_file`, HTTP/1.1 and HTTP/2 by ALPN, SNI from the URL's
//! host, connection reuse, and the failure rules of plain HTTP (502 before
//! sending, 504 and a held record after). A certificate that cannot be
//! verified (wrong name, expired, unknown CA) and an upstream that demands
//! a client certificate the gateway lacks get `502 upstream-tls`, a log
//! line naming the reason, and a released key: nothing reached the
//! upstream.

use std::path::Path;
use std::sync::Arc;

use idem_testkit::client::Answer;
use idem_testkit::gateway::GatewayProcess;
use idem_testkit::upstream::CountingUpstream;
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

const IDEM: &str = env!("CARGO_BIN_EXE_idem");

const ROUTE: &str = r#"
[[route]]
method = "POST"
path = "/v1/payments"
require_key = true

[defaults]
upstream_timeout = "1s"
"#;

/// A certificate authority made for one test, and what it signs.
struct Pki {
    issuer: Issuer<'static, KeyPair>,
    ca_pem: String,
}

/// A certificate and its key, as PEM.
struct Issued {
    cert: String,
    key: String,
}

impl Pki {
    fn new(name: &str) -> Self {
        let key = KeyPair::generate().expect("CA key");
        let mut params = CertificateParams::default();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(DnType::CommonName, format!("idem test CA {name}"));
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let cert = params.self_signed(&key).expect("CA certificate");
        Self {
            ca_pem: cert.pem(),
            issuer: Issuer::new(params, key),
        }
    }

    /// A server certificate for `names`, valid now unless `expired`.
    fn server(&self, names: &[&str], expired: bool) -> Issued {
        let mut params =
            CertificateParams::new(names.iter().map(|n| (*n).to_owned()).collect::<Vec<_>>())
                .expect("names");
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        if expired {
            params.not_before = rcgen::date_time_ymd(2020, 1, 1);
            params.not_after = rcgen::date_time_ymd(2021, 1, 1);
        }
        self.sign(params)
    }

    /// A client certificate (for mTLS).
    fn client(&self) -> Issued {
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("params");
        params
            .distinguished_name
            .push(DnType::CommonName, "idem gateway");
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        self.sign(params)
    }

    fn sign(&self, params: CertificateParams) -> Issued {
        let key = KeyPair::generate().expect("key");
        let cert = params.signed_by(&key, &self.issuer).expect("signed");
        Issued {
            cert: cert.pem(),
            key: key.serialize_pem(),
        }
    }

    fn roots(&self) -> rustls::RootCertStore {
        let mut roots = rustls::RootCertStore::empty();
        roots
            .add(CertificateDer::from_pem_slice(self.ca_pem.as_bytes()).expect("CA PEM"))
            .expect("CA as a root");
        roots
    }
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// The server side: `issued` as its certificate; with `clients`, every
/// client must present a certificate that CA signed.
fn server_config(issued: &Issued, clients: Option<&Pki>) -> rustls::ServerConfig {
    let chain = vec![CertificateDer::from_pem_slice(issued.cert.as_bytes()).expect("cert PEM")];
    let key = PrivateKeyDer::from_pem_slice(issued.key.as_bytes()).expect("key PEM");
    let builder = rustls::ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .expect("versions");
    let builder = match clients {
        None => builder.with_no_client_auth(),
        Some(ca) => builder.with_client_cert_verifier(
            rustls::server::WebPkiClientVerifier::builder_with_provider(
                Arc::new(ca.roots()),
                provider(),
            )
            .build()
            .expect("client verifier"),
        ),
    };
    builder.with_single_cert(chain, key).expect("server config")
}

/// Writes `text` to `dir/name` (owner-only, as a key should be) and
/// returns its path for the config.
fn file(dir: &Path, name: &str, text: &str) -> String {
    let path = dir.join(name);
    std::fs::write(&path, text).expect("write");
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).expect("chmod");
    }
    path.display().to_string()
}

/// A gateway in front of `upstream` (an `https://` URL) with `tls` (config
/// lines) before the route.
async fn gateway(dir: &Path, upstream: &str, tls: &str) -> GatewayProcess {
    GatewayProcess::builder(IDEM, dir)
        .config(&format!("{tls}\n{ROUTE}"))
        .upstream(upstream)
        .log_to_file()
        .start()
        .await
}

/// A TLS upstream with a good certificate for `localhost` from a new CA,
/// and a gateway in front of it trusting that CA, with `upstream_http2`.
async fn trusted_pair(http2: &str) -> (Pki, CountingUpstream, tempfile::TempDir, GatewayProcess) {
    let pki = Pki::new(http2);
    let upstream =
        CountingUpstream::start_tls(server_config(&pki.server(&["localhost"], false), None)).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let ca = file(dir.path(), "ca.pem", &pki.ca_pem);
    let url = format!("https://localhost:{}", upstream.addr().port());
    // One serving thread: each keeps upstream connections of its own, and
    // the tests count them.
    let tls = format!("workers = 1\nupstream_ca_file = \"{ca}\"\nupstream_http2 = \"{http2}\"");
    let gw = gateway(dir.path(), &url, &tls).await;
    (pki, upstream, dir, gw)
}

async fn pay(gw: &GatewayProcess, key: &str, extra: &[(&str, &str)]) -> Answer {
    let mut headers = vec![
        ("idempotency-key", key),
        ("content-type", "application/json"),
    ];
    headers.extend_from_slice(extra);
    gw.post("/v1/payments", &headers, r#"{"amount":100}"#).await
}

fn log(dir: &Path) -> String {
    std::fs::read_to_string(dir.join("idem.log")).expect("gateway log")
}

/// A private CA, HTTP/1.1 and HTTP/2: the idempotency contract holds on
/// both, SNI carries the URL's host, and sequential requests share one
/// connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn https_upstream_on_http1_and_http2_with_a_private_ca() {
    for (http2, version) in [
        ("never", http::Version::HTTP_11),
        ("auto", http::Version::HTTP_2),
    ] {
        let (_pki, upstream, _dir, gw) = trusted_pair(http2).await;

        let first = pay(&gw, "tls-1", &[]).await;
        assert_eq!(first.status, 201, "{http2}: {:?}", first.body);
        let again = pay(&gw, "tls-1", &[]).await;
        assert_eq!(again.status, 201, "{http2}");
        assert_eq!(again.header("idempotent-replayed"), Some("true"), "{http2}");
        assert_eq!(
            again.body, first.body,
            "{http2}: the replay is the original"
        );
        assert_eq!(upstream.executions("tls-1"), 1, "{http2}");
        assert_eq!(upstream.last_version(), Some(version), "{http2}");

        for i in 0..20 {
            let a = pay(&gw, &format!("tls-seq-{i}"), &[]).await;
            assert_eq!(a.status, 201, "{http2}");
        }
        assert_eq!(upstream.total(), 21, "{http2}");
        assert_eq!(
            upstream.connections(),
            1,
            "{http2}: sequential requests reuse one TLS connection"
        );
        // Concurrent requests: HTTP/2 multiplexes them on its one
        // connection; HTTP/1.1 opens more, each used once at a time.
        let keys: Vec<String> = (0..16).map(|i| format!("tls-par-{i}")).collect();
        let answers = futures_util::future::join_all(keys.iter().map(|k| pay(&gw, k, &[]))).await;
        assert!(answers.iter().all(|a| a.status == 201), "{http2}");
        if version == http::Version::HTTP_2 {
            assert_eq!(upstream.connections(), 1, "one HTTP/2 connection");
        }
        assert!(
            upstream
                .server_names()
                .iter()
                .all(|n| n.as_deref() == Some("localhost")),
            "{http2}: SNI is the URL's host: {:?}",
            upstream.server_names()
        );
        assert_eq!(upstream.handshakes_failed(), 0, "{http2}");
        gw.terminate().await;
    }
}

/// Certificates the gateway cannot verify: each request gets `502
/// upstream-tls`, nothing reaches the upstream, the key is released (the
/// retry gets the same answer, not a conflict), and the log names why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unverifiable_certificates_are_refused_as_upstream_tls() {
    let pki = Pki::new("trusted");
    let stranger = Pki::new("unknown");
    let cases = [
        (
            "wrong host name",
            pki.server(&["elsewhere.example"], false),
            "not valid for name \"localhost\"",
        ),
        (
            "expired",
            pki.server(&["localhost"], true),
            "certificate expired",
        ),
        (
            "unknown CA",
            stranger.server(&["localhost"], false),
            "UnknownIssuer",
        ),
    ];
    for (case, issued, reason) in cases {
        let upstream = CountingUpstream::start_tls(server_config(&issued, None)).await;
        let dir = tempfile::tempdir().expect("tempdir");
        let ca = file(dir.path(), "ca.pem", &pki.ca_pem);
        let url = format!("https://localhost:{}", upstream.addr().port());
        let gw = gateway(dir.path(), &url, &format!("upstream_ca_file = \"{ca}\"")).await;
        for attempt in 0..2 {
            let a = pay(&gw, "untrusted", &[]).await;
            assert_eq!(a.status, 502, "{case}, attempt {attempt}: {:?}", a.body);
            assert_eq!(a.problem_type(), "upstream-tls", "{case}");
        }
        assert_eq!(upstream.total(), 0, "{case}: nothing was sent");
        assert!(upstream.handshakes_failed() >= 2, "{case}");
        gw.terminate().await;
        let log = log(dir.path());
        let line = log
            .lines()
            .find(|l| l.contains("upstream_tls"))
            .unwrap_or_else(|| panic!("{case}: no upstream_tls line in {log}"));
        // Text logs write a value with quotes in it quoted and escaped.
        let written = format!("{reason:?}");
        assert!(
            line.contains(&written[1..written.len() - 1]),
            "{case}: the line names {reason}: {line}"
        );
    }
}

/// An upstream that demands a client certificate: without one the gateway
/// sends nothing on the connection (under TLS 1.3 the upstream's refusal
/// would come after a request was written, often lost in a reset), answers
/// `502 upstream-tls` and releases the key; with `upstream_client_cert` /
/// `upstream_client_key` it pays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutual_tls_with_and_without_the_client_certificate() {
    let pki = Pki::new("mtls");
    let upstream = CountingUpstream::start_tls(server_config(
        &pki.server(&["localhost"], false),
        Some(&pki),
    ))
    .await;
    let url = format!("https://localhost:{}", upstream.addr().port());

    let dir = tempfile::tempdir().expect("tempdir");
    let ca = file(dir.path(), "ca.pem", &pki.ca_pem);
    let gw = gateway(dir.path(), &url, &format!("upstream_ca_file = \"{ca}\"")).await;
    for attempt in 0..2 {
        let a = pay(&gw, "mtls-1", &[]).await;
        assert_eq!(a.status, 502, "attempt {attempt}: {:?}", a.body);
        assert_eq!(a.problem_type(), "upstream-tls");
    }
    assert_eq!(upstream.total(), 0);
    gw.terminate().await;
    let log = log(dir.path());
    assert!(
        log.lines()
            .any(|l| l.contains("upstream_tls") && l.contains("asks for a client certificate")),
        "{log}"
    );

    let dir = tempfile::tempdir().expect("tempdir");
    let client = pki.client();
    let ca = file(dir.path(), "ca.pem", &pki.ca_pem);
    let cert = file(dir.path(), "client.pem", &client.cert);
    let key = file(dir.path(), "client.key", &client.key);
    let gw = gateway(
        dir.path(),
        &url,
        &format!(
            "upstream_ca_file = \"{ca}\"\nupstream_client_cert = \"{cert}\"\nupstream_client_key = \"{key}\""
        ),
    )
    .await;
    let a = pay(&gw, "mtls-1", &[]).await;
    assert_eq!(a.status, 201, "{:?}", a.body);
    assert_eq!(upstream.executions("mtls-1"), 1);
    gw.terminate().await;
}

/// The failure rules of plain HTTP hold on TLS, on both protocols: no
/// answer within `upstream_timeout` after sending is `504` and a held
/// record (the retry is not run again); an upstream that is not listening
/// is `502 upstream-unreachable` with the key released.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn timeouts_and_unreachable_upstreams_follow_the_plain_http_rules() {
    for http2 in ["never", "auto"] {
        let (pki, upstream, _dir, gw) = trusted_pair(http2).await;

        let slow = pay(&gw, "slow-1", &[("x-delay-ms", "3000")]).await;
        assert_eq!(slow.status, 504, "{http2}: {:?}", slow.body);
        let retry = pay(&gw, "slow-1", &[("x-delay-ms", "3000")]).await;
        assert_eq!(retry.status, 409, "{http2}: held, not run again");
        assert_eq!(upstream.executions("slow-1"), 1, "{http2}");
        // The connection (or HTTP/2 stream) given up on does not poison
        // the next request.
        let next = pay(&gw, "after-slow", &[]).await;
        assert_eq!(next.status, 201, "{http2}: {:?}", next.body);
        gw.terminate().await;

        // Nothing listens on the port any more.
        let closed = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = closed.local_addr().expect("addr").port();
        drop(closed);
        let dir = tempfile::tempdir().expect("tempdir");
        let ca = file(dir.path(), "ca.pem", &pki.ca_pem);
        let tls = format!("upstream_ca_file = \"{ca}\"\nupstream_http2 = \"{http2}\"");
        let gw = gateway(dir.path(), &format!("https://localhost:{port}"), &tls).await;
        for attempt in 0..2 {
            let a = pay(&gw, "nowhere", &[]).await;
            assert_eq!(a.status, 502, "{http2}, attempt {attempt}: {:?}", a.body);
            assert_eq!(a.problem_type(), "upstream-unreachable", "{http2}");
        }
        gw.terminate().await;
    }
}
