//! `idem check` against real endpoints: the gateway in front of the
//! counting upstream (every probe passes), the same upstream without
//! protection (the right probes fail, with evidence), an `https://`
//! endpoint, and bad input.

use std::path::Path;

use idem_testkit::gateway::GatewayProcess as Gateway;
use idem_testkit::upstream::CountingUpstream;
use serde_json::Value;

const IDEM: &str = env!("CARGO_BIN_EXE_idem");
const BODY: &str = r#"{"amount_cents":100,"currency":"EUR","order_id":"o-1"}"#;
const CONFIG: &str = r#"
[[route]]
method = "POST"
path = "/v1/payments"
require_key = true
"#;

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

fn verdicts(report: &str) -> Vec<(String, String)> {
    let json: Value = serde_json::from_str(report).unwrap_or_else(|e| panic!("{e}: {report}"));
    json["probes"]
        .as_array()
        .expect("probes")
        .iter()
        .map(|p| {
            (
                p["probe"].as_str().expect("name").to_owned(),
                p["verdict"].as_str().expect("verdict").to_owned(),
            )
        })
        .collect()
}

const FULL: [&str; 7] = [
    "--auth2",
    "Bearer merchant-b",
    "--vary-field",
    "amount_cents",
    "--key-required",
    "--format",
    "json",
];

/// Every probe of `idem check` passes against `idem serve` on `store`
/// with `config`; returns the probed URL and the upstream for more.
async fn every_probe_passes(
    dir: &Path,
    store: &str,
    config: &str,
) -> (String, CountingUpstream, Gateway) {
    let up = CountingUpstream::start().await;
    let gw = Gateway::builder(IDEM, dir)
        .config(config)
        .upstream(&up.url())
        .store(store)
        .start()
        .await;
    let url = format!("http://{}/v1/payments", gw.addr);
    let (code, out, err) = check(&url, &FULL);
    assert_eq!(code, Some(0), "{out}\n{err}");
    let verdicts = verdicts(&out);
    assert_eq!(verdicts.len(), 8);
    for (probe, verdict) in &verdicts {
        assert_eq!(verdict, "pass", "{probe}: {out}");
    }
    // Exactly the work the probes asked for reached the upstream: one
    // execution per fresh key (retry, concurrent, reuse, equivalent-json:
    // 1 each; distinct-keys: 2; tenants: 2), nothing for refused requests.
    assert_eq!(up.total(), 8, "{out}");
    (url, up, gw)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_probe_passes_behind_idem_serve() {
    let dir = tempfile::tempdir().expect("temp dir");
    let store = format!(
        "sqlite://{}",
        Path::new(dir.path()).join("idem.db").display()
    );
    let (url, _up, _gw) = every_probe_passes(dir.path(), &store, CONFIG).await;

    // The human report says the same, and the Idempotent-Replayed marker.
    let (code, out, _) = check(&url, &["--probes", "retry,malformed-key"]);
    assert_eq!(code, Some(0), "{out}");
    assert!(out.contains("PASS  retry"), "{out}");
    assert!(out.contains("marked Idempotent-Replayed: true"), "{out}");
    assert!(out.contains("2 passed, 0 failed"), "{out}");
}

/// The same black-box probes on MySQL (MariaDB here), under the IETF
/// profile: the retry probe reads its `Idempotency-Replayed` marker.
/// The same black-box probes on DynamoDB (the moto emulator here).
#[cfg(feature = "dynamodb")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_probe_passes_behind_idem_serve_on_dynamodb() {
    let Some(table) = idem_testkit::isolated::DynamoTable::new("check") else {
        return;
    };
    let dir = tempfile::tempdir().expect("temp dir");
    every_probe_passes(dir.path(), &table.url(), CONFIG).await;
}

#[cfg(feature = "mysql")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_probe_passes_behind_idem_serve_on_mysql() {
    let Some(db) = idem_testkit::isolated::MysqlDatabase::new("check") else {
        return;
    };
    let dir = tempfile::tempdir().expect("temp dir");
    let config = format!("[defaults]\nprofile = \"ietf\"\n{CONFIG}");
    let (url, _up, _gw) = every_probe_passes(dir.path(), &db.url(), &config).await;
    let (code, out, _) = check(&url, &["--probes", "retry"]);
    assert_eq!(code, Some(0), "{out}");
    assert!(out.contains("marked Idempotency-Replayed: true"), "{out}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_naive_api_fails_the_right_probes_with_evidence() {
    let up = CountingUpstream::start().await;
    let url = format!("{}/v1/payments", up.url());
    let (code, out, err) = check(&url, &FULL);
    assert_eq!(code, Some(1), "{out}\n{err}");
    let verdicts = verdicts(&out);
    let of = |name: &str| {
        verdicts
            .iter()
            .find(|(p, _)| p == name)
            .map(|(_, v)| v.as_str())
            .unwrap_or_else(|| panic!("{name} missing"))
    };
    for probe in [
        "retry",
        "concurrent",
        "reuse",
        "equivalent-json",
        "missing-key",
        "malformed-key",
    ] {
        assert_eq!(of(probe), "fail", "{probe}: {out}");
    }
    // Without idempotency, distinct keys and tenants are trivially separate.
    assert_eq!(of("distinct-keys"), "pass");
    assert_eq!(of("tenants"), "pass");
    let report: Value = serde_json::from_str(&out).expect("json");
    let concurrent = report["probes"]
        .as_array()
        .expect("probes")
        .iter()
        .find(|p| p["probe"] == "concurrent")
        .expect("concurrent");
    assert_eq!(concurrent["evidence"].as_array().map(Vec::len), Some(20));
    assert!(
        concurrent["note"]
            .as_str()
            .is_some_and(|n| n.contains("several resources")),
        "{concurrent}"
    );
    // Never more requests than the probes need (20 + 7 × 2 + 1).
    assert!(up.total() <= 35, "{}", up.total());

    // JUnit for CI gates.
    let (code, xml, _) = check(
        &url,
        &["--probes", "retry,distinct-keys", "--format", "junit"],
    );
    assert_eq!(code, Some(1));
    assert!(xml.starts_with("<?xml"), "{xml}");
    assert!(xml.contains("tests=\"2\" failures=\"1\""), "{xml}");
    assert!(
        xml.contains("<testcase classname=\"idem.check\" name=\"retry\""),
        "{xml}"
    );
    assert!(xml.contains("<failure message="), "{xml}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_gets_a_clear_message_and_sends_nothing_it_should_not() {
    let up = CountingUpstream::start().await;
    let url = format!("{}/v1/payments", up.url());
    for (args, needle) in [
        (vec!["--max-requests", "5"], "--max-requests is 5"),
        (vec!["--vary-field", "nope"], "no top-level field \"nope\""),
        (vec!["--probes", "retry,colour"], "unknown probe \"colour\""),
        (vec!["--header", "no colon"], "expected `name: value`"),
        (vec!["--method", "P OST"], "not an HTTP method"),
    ] {
        let (code, _, err) = check(&url, &args);
        assert_eq!(code, Some(2), "{args:?}: {err}");
        assert!(err.contains(needle), "{args:?}: {err}");
    }
    let out = std::process::Command::new(IDEM)
        .args([
            "check",
            "--url",
            &url,
            "--body",
            "plain text",
            "--vary-field",
            "amount",
        ])
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("the body is not JSON"));
    let (code, _, err) = check("ftp://127.0.0.1:1/v1/payments", &[]);
    assert_eq!(code, Some(2));
    assert!(err.contains("expected an http:// or https:// URL"), "{err}");
    assert_eq!(up.total(), 0, "refused runs send nothing");

    // Unreachable: one probe finds out, the rest are not run.
    let (code, out, _) = check("http://127.0.0.1:1/v1/payments", &[]);
    assert_eq!(code, Some(2), "{out}");
    assert!(
        out.contains("cannot reach http://127.0.0.1:1/v1/payments"),
        "{out}"
    );
    // Said once, with what to do; no block per probe.
    assert!(
        out.contains("no probe was run: start the API there"),
        "{out}"
    );
    assert_eq!(out.matches("ERROR").count(), 1, "{out}");

    // A request that does not succeed proves nothing: an error, not a pass.
    let (code, out, _) = check(
        &url,
        &[
            "--header",
            "x-status: 401",
            "--probes",
            "retry,equivalent-json",
        ],
    );
    assert_eq!(code, Some(2), "{out}");
    assert!(out.contains("was answered 401, not a success"), "{out}");
    // Probes named explicitly must be runnable.
    for (probes, needle) in [("reuse", "--vary-field"), ("tenants", "--auth2")] {
        let (code, _, err) = check(&url, &["--probes", probes]);
        assert_eq!(code, Some(2));
        assert!(err.contains(needle), "{err}");
    }

    // Rate limited: reported as such, not as an idempotency failure.
    let (code, out, _) = check(&url, &["--header", "x-status: 429", "--probes", "retry"]);
    assert_eq!(code, Some(2), "{out}");
    assert!(out.contains("rate-limited the check (429"), "{out}");
}

/// `https://` targets: a server whose certificate the system does not
/// trust gets a clear TLS message naming `--ca-file`; with its CA given,
/// every probe runs and passes; an unreadable CA file is refused before
/// anything is sent. The certificates are test-only fixtures
/// (tests/fixtures/tls).
mod tls {
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

    use super::check;

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
        let certs: Vec<CertificateDer<'static>> =
            CertificateDer::pem_file_iter(fixture("server.pem"))
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
}
