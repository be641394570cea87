//! Tenant identity and "one key, one request", tried as an attacker would,
//! against the real gateway binary on loopback: a caller without
//! credentials can neither read another's answer nor claim its key, an
//! identity header counts only from a trusted proxy, a key cannot move to
//! another resource, no spelling of a path skips its policy, and a shared
//! store without the hash secret its gateways share is refused at start.

use std::path::Path;

use http::StatusCode;
use idem_testkit::client::metric;
use idem_testkit::gateway::{GatewayProcess as Gateway, TEST_CREDENTIAL, sqlite_store};
use idem_testkit::upstream::CountingUpstream;

const IDEM: &str = env!("CARGO_BIN_EXE_idem");

const CONFIG: &str = r#"
[[route]]
method = "POST"
path = "/v1/payments"
require_key = true

[[route]]
method = "POST"
path = "/v1/orders/{id}/capture"
require_key = true

[[route]]
method = "POST"
path = "/v1/public"
on_missing_tenant = "pass"
"#;

async fn start(dir: &Path, config: &str, up: &CountingUpstream) -> Gateway {
    Gateway::builder(IDEM, dir)
        .config(config)
        .upstream(&up.url())
        .store(&sqlite_store(dir))
        .log("error")
        .start()
        .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_without_credentials_gets_no_one_s_answer_and_claims_no_key() {
    let dir = tempfile::tempdir().expect("temp dir");
    let up = CountingUpstream::start().await;
    let gw = start(dir.path(), CONFIG, &up).await;
    let key = ("idempotency-key", "pay-1");
    let owner = gw.post("/v1/payments", &[key], "{}").await;
    assert_eq!(owner.status, StatusCode::CREATED);
    // The owner's key and body, no Authorization: refused, not replayed.
    let anonymous = idem_testkit::client::send(
        gw.addr,
        http::Method::POST,
        "/v1/payments",
        &[key],
        "{}".to_owned(),
    )
    .await;
    assert_eq!(anonymous.status, StatusCode::UNAUTHORIZED);
    assert_eq!(anonymous.problem_type(), "tenant-missing");
    assert_ne!(anonymous.body, owner.body);
    // Claiming a key first with a bad credential fixes nothing: the
    // upstream's 401 is not recorded, and the owner's payment runs.
    let claim = [
        ("idempotency-key", "pay-2"),
        ("authorization", "Bearer forged"),
        ("x-status", "401"),
    ];
    assert_eq!(
        gw.post("/v1/payments", &claim, "{}").await.status,
        StatusCode::UNAUTHORIZED
    );
    let denied = [("idempotency-key", "pay-2"), ("x-status", "401")];
    assert_eq!(
        gw.post("/v1/payments", &denied, "{}").await.status,
        StatusCode::UNAUTHORIZED
    );
    let real = gw
        .post("/v1/payments", &[("idempotency-key", "pay-2")], "{}")
        .await;
    assert_eq!(real.status, StatusCode::CREATED);
    assert!(real.header("idempotent-replayed").is_none());
    assert_eq!(up.executions("pay-1"), 1);
    // A route that passes credential-less requests says they are unprotected.
    let public = idem_testkit::client::send(
        gw.addr,
        http::Method::POST,
        "/v1/public",
        &[("idempotency-key", "pub-1")],
        "{}".to_owned(),
    )
    .await;
    assert_eq!(public.status, StatusCode::CREATED);
    assert_eq!(public.header("idempotency-status"), Some("unprotected"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_cannot_move_to_another_resource_nor_a_path_skip_its_policy() {
    let dir = tempfile::tempdir().expect("temp dir");
    let up = CountingUpstream::start().await;
    let gw = start(dir.path(), CONFIG, &up).await;
    let key = [("idempotency-key", "capture-1")];
    let a = gw.post("/v1/orders/ord_A/capture", &key, "{}").await;
    assert_eq!(a.status, StatusCode::CREATED);
    let b = gw.post("/v1/orders/ord_B/capture", &key, "{}").await;
    assert_eq!(
        b.status,
        StatusCode::UNPROCESSABLE_ENTITY,
        "B is not told A's capture"
    );
    assert_eq!(b.problem_type(), "idempotency-key-reused");
    assert_eq!(up.executions("capture-1"), 1);
    // The upstream runs the request that was judged: B's path with a dot
    // segment that names A is A's capture, sent as A's.
    let dotted = gw
        .post(
            "/v1/orders/ord_B/%2e%2e/ord_A/capture?x=1",
            &[("idempotency-key", "capture-2")],
            "{}",
        )
        .await;
    assert_eq!(dotted.status, StatusCode::CREATED);
    assert!(
        String::from_utf8_lossy(&dotted.body).contains(r#""path":"/v1/orders/ord_A/capture""#),
        "{dotted:?}"
    );
    // Spellings a lenient upstream routes to the same handler too:
    // servlet containers drop `;` parameters and resolve `..;`, Rails
    // drops a format suffix.
    for path in [
        "/v1/payments/",
        "//v1/payments",
        "/v1/x/../payments",
        "/v1/%70ayments",
        "/v1/payments;jsessionid=1",
        "/v1/payments.json",
        "/v1/x/..;/payments",
        "/v1/orders/ord_A/capture.json",
    ] {
        let keyless = gw.post(path, &[], "{}").await;
        assert_eq!(keyless.status, StatusCode::BAD_REQUEST, "{path}");
        assert_eq!(keyless.problem_type(), "idempotency-key-missing", "{path}");
    }
    // Case is ignored unless the config says otherwise (an upstream that
    // ignores it, such as ASP.NET's routing, would run /V1/Payments).
    assert_eq!(
        gw.post("/V1/Payments", &[], "{}").await.status,
        StatusCode::BAD_REQUEST
    );
    let dir2 = tempfile::tempdir().expect("temp dir");
    let exact = start(
        dir2.path(),
        &format!("ignore_path_case = false\n{CONFIG}"),
        &up,
    )
    .await;
    assert_eq!(
        exact.post("/V1/Payments", &[], "{}").await.status,
        StatusCode::CREATED
    );
}

/// A route with `path_spelling = "refuse"` refuses every spelling but its
/// own (a trailing slash aside), keyed or not, and forwards nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_strict_route_refuses_every_other_spelling() {
    let up = CountingUpstream::start().await;
    let strict = CONFIG.replace(
        "path = \"/v1/payments\"\n",
        "path = \"/v1/payments\"\npath_spelling = \"refuse\"\n",
    );
    let dir = tempfile::tempdir().expect("temp dir");
    let gw = start(dir.path(), &strict, &up).await;
    for path in [
        "/v1/payments.json",
        "/v1/payments;v=1",
        "/v1//payments",
        "/v1/%70ayments",
    ] {
        let keyed = gw
            .post(path, &[("idempotency-key", "strict-1")], "{}")
            .await;
        assert_eq!(keyed.status, StatusCode::BAD_REQUEST, "{path}");
        assert_eq!(keyed.problem_type(), "request-path-not-canonical", "{path}");
    }
    assert_eq!(up.total(), 0, "nothing forwarded");
    for path in ["/v1/payments", "/v1/payments/"] {
        let key = [("idempotency-key", path)];
        let ok = gw.post(path, &key, "{}").await;
        assert_eq!(ok.status, StatusCode::CREATED, "{path}");
    }
    assert_eq!(
        metric(gw.admin, "idem_requests_total", "outcome=\"bad_request\"").await,
        4.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_identity_header_counts_only_from_a_trusted_proxy() {
    let up = CountingUpstream::start().await;
    let trusted = |nets: &str| {
        format!(
            "[tenant]\nfrom = \"trusted_header\"\nname = \"X-User\"\ntrusted_proxies = [{nets}]\n{CONFIG}"
        )
    };
    let dir = tempfile::tempdir().expect("temp dir");
    let gw = start(dir.path(), &trusted("\"127.0.0.0/8\""), &up).await;
    let alice = [("idempotency-key", "t-1"), ("x-user", "alice")];
    assert_eq!(
        gw.post("/v1/payments", &alice, "{}").await.status,
        StatusCode::CREATED
    );
    let bob = [("idempotency-key", "t-1"), ("x-user", "bob")];
    let b = gw.post("/v1/payments", &bob, "{}").await;
    assert!(
        b.header("idempotent-replayed").is_none(),
        "bob is another tenant"
    );
    let records = idem_testkit::gateway::listed_keys(IDEM, &sqlite_store(dir.path()), "completed");
    assert_eq!(records.len(), 2, "{records:?}");
    let dir2 = tempfile::tempdir().expect("temp dir");
    let elsewhere = start(dir2.path(), &trusted("\"10.0.0.0/8\""), &up).await;
    let spoofed = elsewhere.post("/v1/payments", &alice, "{}").await;
    assert_eq!(spoofed.status, StatusCode::FORBIDDEN);
    assert_eq!(spoofed.problem_type(), "tenant-untrusted");
    assert_eq!(up.executions("t-1"), 2);
}

#[test]
fn a_shared_store_without_the_hash_secret_is_refused_at_start() {
    for store in ["postgres://127.0.0.1:1/test", "redis://127.0.0.1:1"] {
        let out = std::process::Command::new(IDEM)
            .args([
                "serve",
                "--upstream",
                "http://127.0.0.1:1",
                "--store",
                store,
            ])
            .args(["--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0"])
            .env_remove("IDEM_HASH_SECRET")
            .output()
            .expect("run idem");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{store}: {stderr}");
        assert!(stderr.contains("IDEM_HASH_SECRET"), "{store}: {stderr}");
        assert!(stderr.contains("accept_v1_until"), "{store}: {stderr}");
        let short = std::process::Command::new(IDEM)
            .args([
                "serve",
                "--upstream",
                "http://127.0.0.1:1",
                "--store",
                store,
            ])
            .env("IDEM_HASH_SECRET", "abcd")
            .output()
            .expect("run idem");
        let stderr = String::from_utf8_lossy(&short.stderr);
        assert!(!short.status.success());
        assert!(stderr.contains("at least 32 bytes"), "{stderr}");
        assert!(!stderr.contains("abcd"), "never echoed: {stderr}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_embedded_store_keeps_its_own_secret_beside_its_database() {
    let dir = tempfile::tempdir().expect("temp dir");
    let up = CountingUpstream::start().await;
    let gw = start(dir.path(), CONFIG, &up).await;
    let key = [("idempotency-key", "kept")];
    let first = gw.post("/v1/payments", &key, "{}").await;
    let secret = dir.path().join("idem.db.secret");
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&secret)
            .expect("secret file")
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600, "{mode:o}");
    }
    let text = std::fs::read_to_string(&secret).expect("read");
    assert!(
        !text.contains("accept_v1_until"),
        "a new database holds no earlier records: {text}"
    );
    // Killed and waited for: see `GatewayProcess::kill`.
    gw.kill().await;
    // Restarted: the same secret, so the retry finds its record.
    let again = start(dir.path(), CONFIG, &up).await;
    let retry = again.post("/v1/payments", &key, "{}").await;
    assert_eq!(retry.header("idempotent-replayed"), Some("true"));
    assert_eq!(retry.body, first.body);
    assert_eq!(std::fs::read_to_string(&secret).expect("read"), text);
    // The tenant in the records is keyed: not the credential's SHA-256.
    let unkeyed = idem::fingerprint::unkeyed_tenant(TEST_CREDENTIAL.as_bytes());
    let listed = std::process::Command::new(IDEM)
        .args([
            "records",
            "list",
            "--store",
            &sqlite_store(dir.path()),
            "--json",
        ])
        .output()
        .expect("list");
    let listed = String::from_utf8_lossy(&listed.stdout);
    assert!(listed.contains("\"tenant\""), "{listed}");
    assert!(!listed.contains(&unkeyed), "{listed}");
    assert!(listed.contains("v3:"), "{listed}");
}

/// A `502` or `504` from the upstream proves nothing about the request:
/// a load balancer between the gateway and the app answers them after the
/// app ran. The key is held as an unknown outcome, and the retry charges
/// nothing; a route whose upstream is the app itself may release them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_intermediary_s_502_or_504_holds_the_key_instead_of_running_twice() {
    let up = CountingUpstream::start().await;
    let dir = tempfile::tempdir().expect("temp dir");
    let gw = start(dir.path(), CONFIG, &up).await;
    for status in ["502", "504"] {
        let key = format!("lb-{status}");
        let timed_out = [("idempotency-key", key.as_str()), ("x-status", status)];
        let first = gw.post("/v1/payments", &timed_out, "{}").await;
        assert_eq!(first.status.as_str(), status);
        let retry = gw
            .post("/v1/payments", &[("idempotency-key", key.as_str())], "{}")
            .await;
        assert_eq!(retry.status, StatusCode::CONFLICT, "{status}: {retry:?}");
        assert_eq!(retry.problem_type(), "idempotency-outcome-held");
        assert_eq!(up.executions(&key), 1, "{status}: charged once");
    }
    let released = format!("[defaults]\nrelease_statuses = [502, 504]\n{CONFIG}");
    let dir2 = tempfile::tempdir().expect("temp dir");
    let app = start(dir2.path(), &released, &up).await;
    let key = [("idempotency-key", "app-502"), ("x-status", "502")];
    assert_eq!(
        app.post("/v1/payments", &key, "{}").await.status,
        StatusCode::BAD_GATEWAY
    );
    let retry = app
        .post("/v1/payments", &[("idempotency-key", "app-502")], "{}")
        .await;
    assert_eq!(retry.status, StatusCode::CREATED, "released: {retry:?}");
    assert_eq!(up.executions("app-502"), 2);
}

/// A route looked up by `/v1/payments/by-key/{key}` cannot take the keys
/// `.` and `..`: its lookup would be `/v1/payments/by-key/..`, which an
/// upstream that resolves dot segments answers for another path (the
/// payment run twice, or its record settled with another resource's
/// answer). They are refused before anything runs; elsewhere they are
/// keys like any other.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_cannot_make_the_lookup_name_another_path() {
    let up = CountingUpstream::start().await;
    let dir = tempfile::tempdir().expect("temp dir");
    let config = format!(
        "{CONFIG}\n[[route]]\nmethod = \"POST\"\npath = \"/v1/charges\"\nrequire_key = true\n\
         [route.reconcile]\npath = \"/v1/charges/by-key/{{key}}\"\nstatus = 201\n"
    );
    let gw = start(dir.path(), &config, &up).await;
    for dots in [".", ".."] {
        let refused = gw
            .post("/v1/charges", &[("idempotency-key", dots)], "{}")
            .await;
        assert_eq!(refused.status, StatusCode::BAD_REQUEST, "{dots}");
        assert_eq!(refused.problem_type(), "idempotency-key-invalid", "{dots}");
        assert_eq!(up.executions(dots), 0, "{dots}: nothing ran");
        let elsewhere = gw
            .post("/v1/payments", &[("idempotency-key", dots)], "{}")
            .await;
        assert_eq!(elsewhere.status, StatusCode::CREATED, "{dots}");
    }
    let fine = gw
        .post("/v1/charges", &[("idempotency-key", "...")], "{}")
        .await;
    assert_eq!(fine.status, StatusCode::CREATED);
}

/// From a peer that is not a trusted proxy, the identity header and the
/// client's own `X-Forwarded-For` and `Forwarded` never reach the
/// upstream, on a protected route or not; from a trusted proxy they do.
/// A `Connection` header may not name the key or the credential, which
/// the gateway reads and the next hop would strip.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_untrusted_peer_s_identity_and_forwarded_headers_never_reach_the_upstream() {
    let up = CountingUpstream::start().await;
    let trusted = |nets: &str| {
        format!(
            "[tenant]\nfrom = \"trusted_header\"\nname = \"X-User\"\ntrusted_proxies = [{nets}]\n{CONFIG}"
        )
    };
    let claims = [
        ("x-user", "alice"),
        ("x-forwarded-for", "6.6.6.6"),
        ("forwarded", "for=6.6.6.6"),
    ];
    let dir = tempfile::tempdir().expect("temp dir");
    let elsewhere = start(dir.path(), &trusted("\"10.0.0.0/8\""), &up).await;
    for path in ["/v1/public", "/v1/unrouted"] {
        let answer = elsewhere.post(path, &claims, "{}").await;
        assert_eq!(answer.status, StatusCode::CREATED, "{path}: {answer:?}");
        let seen = up.last_headers().expect("a request");
        assert!(seen.get("x-user").is_none(), "{path}: {seen:?}");
        assert!(seen.get("forwarded").is_none(), "{path}: {seen:?}");
        let chain: Vec<_> = seen.get_all("x-forwarded-for").iter().collect();
        assert_eq!(chain, ["127.0.0.1"], "{path}: only the gateway's own");
    }
    let dir2 = tempfile::tempdir().expect("temp dir");
    let behind = start(dir2.path(), &trusted("\"127.0.0.0/8\""), &up).await;
    let answer = behind.post("/v1/public", &claims, "{}").await;
    assert_eq!(answer.status, StatusCode::CREATED);
    let seen = up.last_headers().expect("a request");
    assert_eq!(seen["x-user"], "alice");
    assert_eq!(seen["forwarded"], "for=6.6.6.6");
    let chain: Vec<_> = seen.get_all("x-forwarded-for").iter().collect();
    assert_eq!(chain, ["6.6.6.6", "127.0.0.1"]);

    let dir3 = tempfile::tempdir().expect("temp dir");
    let gw = start(dir3.path(), CONFIG, &up).await;
    // A protected request: the client's chain is not passed on either.
    let protected = [
        ("idempotency-key", "chain"),
        ("x-forwarded-for", "6.6.6.6"),
        ("forwarded", "for=6.6.6.6"),
    ];
    assert_eq!(
        gw.post("/v1/payments", &protected, "{}").await.status,
        StatusCode::CREATED
    );
    let seen = up.last_headers().expect("a request");
    assert!(seen.get("forwarded").is_none(), "{seen:?}");
    let chain: Vec<_> = seen.get_all("x-forwarded-for").iter().collect();
    assert_eq!(chain, ["127.0.0.1"]);
    for (named, problem) in [
        ("idempotency-key", "idempotency-key-invalid"),
        ("authorization", "tenant-invalid"),
    ] {
        let key = format!("hop-{named}");
        let answer = gw
            .post(
                "/v1/payments",
                &[("idempotency-key", key.as_str()), ("connection", named)],
                "{}",
            )
            .await;
        assert_eq!(
            answer.status,
            StatusCode::BAD_REQUEST,
            "{named}: {answer:?}"
        );
        assert_eq!(answer.problem_type(), problem, "{named}");
        assert_eq!(up.executions(&key), 0, "{named}: nothing forwarded");
    }
}

/// A request from `source` (any 127/8 address is this machine) to the
/// gateway's port on IPv4 loopback, and the first bytes of its answer.
async fn from_ipv4(source: &str, port: u16, request: &str) -> (tokio::net::TcpStream, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let socket = tokio::net::TcpSocket::new_v4().expect("socket");
    socket
        .bind(format!("{source}:0").parse().expect("source"))
        .expect("bind the source address");
    let mut conn = socket
        .connect(std::net::SocketAddr::from(([127, 0, 0, 1], port)))
        .await
        .expect("connect over IPv4");
    conn.write_all(request.as_bytes()).await.expect("write");
    let mut buf = vec![0u8; 4096];
    let n = tokio::time::timeout(std::time::Duration::from_secs(30), conn.read(&mut buf))
        .await
        .expect("an answer")
        .expect("read");
    (conn, String::from_utf8_lossy(&buf[..n]).into_owned())
}

/// On a dual-stack listener (`[::]`) every IPv4 client arrives as
/// `::ffff:a.b.c.d`: the gateway still counts each by its own address
/// (one client's share does not shut out another) and matches it against
/// IPv4 `trusted_proxies`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ipv4_clients_of_a_dual_stack_listener_keep_their_own_address() {
    let up = CountingUpstream::start().await;
    let dir = tempfile::tempdir().expect("temp dir");
    let config = format!(
        "[tenant]\nfrom = \"trusted_header\"\nname = \"X-User\"\ntrusted_proxies = [\"127.0.0.2/32\"]\n{CONFIG}\n[limits]\nmax_in_flight = 8\nmax_in_flight_per_peer = 1\n"
    );
    let gw = Gateway::builder(IDEM, dir.path())
        .config(&config)
        .upstream(&up.url())
        .store(&sqlite_store(dir.path()))
        .listen("[::]:0")
        .log("error")
        .start()
        .await;
    assert!(gw.addr.ip().is_unspecified(), "{}", gw.addr);
    let port = gw.addr.port();
    // One client's request holds its one slot upstream...
    let slow =
        "GET /v1/things HTTP/1.1\r\nhost: x\r\nidempotency-key: held\r\nx-delay-ms: 5000\r\n\r\n";
    let held = tokio::spawn(from_ipv4("127.0.0.3", port, slow));
    up.until_received("held").await;
    // ...and another IPv4 client still gets its own.
    let other =
        "GET /v1/things HTTP/1.1\r\nhost: x\r\nidempotency-key: other\r\nconnection: close\r\n\r\n";
    let (_conn, answer) = from_ipv4("127.0.0.4", port, other).await;
    assert!(answer.starts_with("HTTP/1.1 201"), "{answer}");
    // The proxy at 127.0.0.2 is trusted with its identity header.
    let proxied = "POST /v1/payments HTTP/1.1\r\nhost: x\r\nx-user: alice\r\nidempotency-key: via-proxy\r\ncontent-length: 2\r\nconnection: close\r\n\r\n{}";
    let (_conn, answer) = from_ipv4("127.0.0.2", port, proxied).await;
    assert!(answer.starts_with("HTTP/1.1 201"), "{answer}");
    assert_eq!(up.executions("via-proxy"), 1);
    let (_conn, answer) = held.await.expect("join");
    assert!(answer.starts_with("HTTP/1.1 201"), "{answer}");
    gw.terminate().await;
}
