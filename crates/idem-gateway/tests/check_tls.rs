//! `idem check` against an `https://` endpoint: a server whose certificate
//! the system does not trust gets a clear TLS message naming `--ca-file`;
//! with its CA given, every probe runs (and passes: the endpoint is an
//! idempotent API); an unreadable CA file is refused before anything is
//! sent. The certificates are test-only fixtures (tests/fixtures/tls).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use axum::Router;
use axum::http::StatusCode;
use axum::routing::post;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::service::TowerToHyperService;
use idem::MemoryStore;
use idem_http::{IdempotencyLayer, RoutePolicy, Routes, TenantSource};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

const IDEM: &str = env!("CARGO_BIN_EXE_idem");
const BODY: &str = r#"{"amount_cents":100,"currency":"EUR","order_id":"o-1"}"#;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/tls")
        .join(name)
}

/// An idempotent payments endpoint (the `idem-http` layer over memory)
/// served over TLS with the fixture certificate for 127.0.0.1.
async fn https_api() -> SocketAddr {
    let routes = Routes::default()
        .route(
            axum::http::Method::POST,
            "/v1/payments",
            RoutePolicy::default().with_require_key(true),
        )
        .expect("routes");
    let router = Router::new()
        .route(
            "/v1/payments",
            post(|| async {
                (
                    StatusCode::CREATED,
                    format!(
                        r#"{{"id":"pay_{}"}}"#,
                        idem::OwnerToken::random().as_u128() % 1_000_000_000
                    ),
                )
            }),
        )
        .layer(
            IdempotencyLayer::new(MemoryStore::new())
                .with_routes(routes)
                .with_tenant(TenantSource::Authorization),
        );
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(fixture("server.pem"))
        .expect("server.pem")
        .collect::<Result<_, _>>()
        .expect("certificates");
    let key = PrivateKeyDer::from_pem_file(fixture("server.key")).expect("server.key");
    let config = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .expect("versions")
    .with_no_client_auth()
    .with_single_cert(certs, key)
    .expect("server config");
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        loop {
            let Ok((tcp, _)) = listener.accept().await else {
                continue;
            };
            let (acceptor, router) = (acceptor.clone(), router.clone());
            tokio::spawn(async move {
                // A client that refuses the certificate ends the handshake.
                let Ok(tls) = acceptor.accept(tcp).await else {
                    return;
                };
                let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(tls), TowerToHyperService::new(router))
                    .await;
            });
        }
    });
    addr
}

fn check(url: &str, extra: &[&str]) -> (Option<i32>, String, String) {
    let out = std::process::Command::new(IDEM)
        .args(["--log", "warn", "check", "--url", url, "--body", BODY])
        .args(["--header", "authorization: Bearer merchant-a"])
        .args(extra)
        .output()
        .expect("run idem check");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn https_targets_untrusted_then_trusted_with_their_ca() {
    let addr = https_api().await;
    let url = format!("https://{addr}/v1/payments");

    // Untrusted: every request fails the handshake; the report says why
    // and what to do.
    let (code, out, err) = tokio::task::spawn_blocking({
        let url = url.clone();
        move || check(&url, &["--probes", "retry"])
    })
    .await
    .expect("join");
    assert_eq!(code, Some(2), "{out}{err}");
    assert!(
        out.contains("certificate this check does not trust") && out.contains("--ca-file"),
        "{out}"
    );

    // Trusted through --ca-file: every probe runs and passes.
    let ca = fixture("ca.pem").display().to_string();
    let (code, out, err) = tokio::task::spawn_blocking({
        let url = url.clone();
        move || {
            check(
                &url,
                &[
                    "--ca-file",
                    &ca,
                    "--auth2",
                    "Bearer merchant-b",
                    "--vary-field",
                    "amount_cents",
                    "--key-required",
                ],
            )
        }
    })
    .await
    .expect("join");
    assert_eq!(code, Some(0), "{out}{err}");

    // An unreadable CA file is refused before anything is sent.
    let (code, _, err) =
        tokio::task::spawn_blocking(move || check(&url, &["--ca-file", "/nonexistent/ca.pem"]))
            .await
            .expect("join");
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.contains("--ca-file /nonexistent/ca.pem: cannot read it"),
        "{err}"
    );
}
