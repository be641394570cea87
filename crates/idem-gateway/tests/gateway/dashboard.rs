//! The live dashboard in real headless Chromium (Debian's `chromium` and
//! `chromium-driver`, driven over WebDriver): the page loads with the
//! admin token from the URL fragment, its charts change while real
//! traffic flows through the gateway, and the record inspector finds a
//! record; opened after traffic, it shows the totals since start. With
//! `IDEM_DASHBOARD_SCREENSHOTS=DIR` it also saves a
//! screenshot under load there (how `docs/img/dashboard.png` is made).

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use fantoccini::{Client, ClientBuilder, Locator};
use http::{Method, StatusCode};
use idem_testkit::client::send;
use idem_testkit::gateway::{GatewayProcess as Gateway, sqlite_store};
use idem_testkit::services;
use idem_testkit::upstream::CountingUpstream;
use serde_json::{Value, json};
use tokio::process::{Child, Command};

const IDEM: &str = env!("CARGO_BIN_EXE_idem");
const TOKEN: &str = "dash-token-0123456789abcdef0123456789";
const CONFIG: &str = r#"
[[route]]
method = "POST"
path = "/v1/payments"
require_key = true

[[route]]
method = "POST"
path = "/hooks/github"
[route.webhook]
provider = "github"
secrets_env = "DASHBOARD_TEST_GITHUB_SECRET"

[monitor]
interval = "1s"
"#;

struct Browser {
    client: Client,
    _driver: Child,
}

impl Browser {
    async fn start(driver: &Path, chromium: &Path) -> Browser {
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let child = Command::new(driver)
            .arg(format!("--port={port}"))
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .expect("start chromedriver");
        let mut caps = serde_json::Map::new();
        caps.insert(
            "goog:chromeOptions".into(),
            json!({
                "binary": chromium,
                "args": ["--headless=new", "--no-sandbox", "--disable-gpu",
                         "--disable-dev-shm-usage", "--window-size=1400,1100"],
            }),
        );
        let url = format!("http://127.0.0.1:{port}");
        for _ in 0..100 {
            let connector = hyper_util::client::legacy::connect::HttpConnector::new();
            if let Ok(client) = ClientBuilder::new(connector)
                .capabilities(caps.clone())
                .connect(&url)
                .await
            {
                return Browser {
                    client,
                    _driver: child,
                };
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!("chromedriver did not accept a session on {url}");
    }

    async fn js(&self, script: &str) -> Value {
        self.client
            .execute(script, Vec::new())
            .await
            .unwrap_or_else(|e| panic!("{script}: {e}"))
    }

    async fn number(&self, script: &str) -> f64 {
        let v = self.js(script).await;
        v.as_f64()
            .or_else(|| v.as_str().and_then(|s| s.parse().ok()))
            .unwrap_or(0.0)
    }

    async fn click(&self, id: &str) {
        self.client
            .find(Locator::Id(id))
            .await
            .unwrap_or_else(|e| panic!("#{id}: {e}"))
            .click()
            .await
            .unwrap_or_else(|e| panic!("click #{id}: {e}"));
    }

    /// Polls `script` (a boolean expression) for up to 20 s.
    async fn until(&self, what: &str, script: &str) {
        for _ in 0..200 {
            if self.js(script).await == Value::Bool(true) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let status = self
            .js("return document.getElementById('status').textContent")
            .await;
        panic!("{what}: not within 20 s (dashboard status: {status})");
    }
}

/// What each dashboard test runs on: the browser's programs, and a
/// gateway on the embedded store behind the admin token.
struct Setup {
    driver: PathBuf,
    chromium: PathBuf,
    gw: Gateway,
    _up: CountingUpstream,
    _dir: tempfile::TempDir,
}

impl Setup {
    /// `None` (the test skips, loudly) without ChromeDriver or Chromium.
    async fn start() -> Option<Self> {
        let driver = services::program("ChromeDriver", "IDEM_TEST_CHROMEDRIVER", "chromedriver")?;
        let chromium = services::program("Chromium", "IDEM_TEST_CHROMIUM", "chromium")?;
        let dir = tempfile::tempdir().expect("temp dir");
        let up = CountingUpstream::start().await;
        let gw = Gateway::builder(IDEM, dir.path())
            .config(CONFIG)
            .upstream(&up.url())
            .store(&sqlite_store(dir.path()))
            .args(&["--admin-token", TOKEN])
            .envs(&[(
                "DASHBOARD_TEST_GITHUB_SECRET",
                "a-github-webhook-secret-of-the-test",
            )])
            .start()
            .await;
        Some(Self {
            driver,
            chromium,
            gw,
            _up: up,
            _dir: dir,
        })
    }

    /// A browser on the dashboard, the token in the address's fragment.
    async fn open(&self) -> Browser {
        let browser = Browser::start(&self.driver, &self.chromium).await;
        browser
            .client
            .goto(&format!(
                "http://{}/dashboard/#token={TOKEN}",
                self.gw.admin
            ))
            .await
            .expect("open the dashboard");
        browser
    }
}

async fn pay(addr: std::net::SocketAddr, key: &str, body: &str, delay_ms: &str) -> StatusCode {
    send(
        addr,
        Method::POST,
        "/v1/payments",
        &[
            ("content-type", "application/json"),
            ("authorization", "Bearer merchant-1"),
            ("idempotency-key", key),
            ("x-delay-ms", delay_ms),
        ],
        body.to_owned(),
    )
    .await
    .status
}

/// Unique-key payments and their replays, until told to stop; with
/// `mixed`, also a reused key now and then (422) and a duplicate sent while
/// its first request still runs (409), so every chart has something to show.
fn traffic(
    addr: std::net::SocketAddr,
    stop: Arc<AtomicBool>,
    mixed: bool,
) -> tokio::task::JoinHandle<u64> {
    tokio::spawn(async move {
        let mut sent = 0u64;
        while !stop.load(Ordering::Relaxed) {
            let key = format!("dash-{sent}");
            for _ in 0..2 {
                assert_eq!(
                    pay(addr, &key, r#"{"amount":100}"#, "0").await,
                    StatusCode::CREATED
                );
            }
            if mixed && sent.is_multiple_of(25) {
                let reused = pay(addr, &key, r#"{"amount":999}"#, "0").await;
                assert_eq!(reused, StatusCode::UNPROCESSABLE_ENTITY);
                let slow = format!("slow-{sent}");
                let first = tokio::spawn({
                    let slow = slow.clone();
                    async move { pay(addr, &slow, "{}", "300").await }
                });
                tokio::time::sleep(Duration::from_millis(100)).await;
                assert_eq!(pay(addr, &slow, "{}", "300").await, StatusCode::CONFLICT);
                assert_eq!(first.await.expect("first"), StatusCode::CREATED);
            }
            sent += 1;
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        sent
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dashboard_loads_updates_under_traffic_and_inspects_records() {
    let Some(setup) = Setup::start().await else {
        return;
    };
    let gw = &setup.gw;
    let browser = setup.open().await;

    // Loads, polls with the token (and drops it from the address bar).
    browser
        .until(
            "two successful polls",
            "return Number(document.body.dataset.polls) >= 2",
        )
        .await;
    let location = browser.js("return location.href").await;
    assert!(!location.to_string().contains(TOKEN), "{location}");
    let version = browser
        .js("return document.getElementById('tile-version').textContent")
        .await;
    assert_eq!(version, env!("CARGO_PKG_VERSION"));
    // Re-runs and reconciliations show zeros, not dashes, before any.
    let reruns = browser
        .js("return document.getElementById('tile-reruns').textContent")
        .await;
    assert_eq!(reruns, "0");
    let reconciled = browser
        .js("return document.getElementById('tile-reconciled').textContent")
        .await;
    assert_eq!(reconciled, "0 / 0");

    // The charts move while traffic flows.
    let chart = "return document.getElementById('chart-requests').toDataURL()";
    let before = browser.js(chart).await;
    let screenshots = std::env::var_os("IDEM_DASHBOARD_SCREENSHOTS");
    let stop = Arc::new(AtomicBool::new(false));
    let load = traffic(gw.addr, Arc::clone(&stop), screenshots.is_some());
    browser
        .until(
            "the dashboard to count the traffic",
            "return Number(document.body.dataset.totalRequests) >= 40",
        )
        .await;
    browser
        .until(
            "requests per second above zero",
            "return parseFloat(document.getElementById('tile-rps').textContent) > 0",
        )
        .await;
    let counted = browser
        .number("return document.body.dataset.totalRequests")
        .await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let later = browser
        .number("return document.body.dataset.totalRequests")
        .await;
    assert!(
        later > counted,
        "the totals follow the traffic: {counted} then {later}"
    );
    assert_ne!(
        browser.js(chart).await,
        before,
        "the requests chart was redrawn"
    );
    browser
        .until(
            "a replay rate near one half",
            "const t = parseFloat(document.getElementById('tile-replay').textContent); return t > 20 && t <= 60",
        )
        .await;
    if let Some(dir) = screenshots {
        // A minute of mixed traffic first, so the charts have a history.
        tokio::time::sleep(Duration::from_secs(60)).await;
        let png = browser.client.screenshot().await.expect("screenshot");
        let path = PathBuf::from(dir).join("dashboard.png");
        std::fs::write(&path, png).expect("write the screenshot");
        eprintln!("dashboard screenshot written to {}", path.display());
    }
    stop.store(true, Ordering::Relaxed);
    let sent = load.await.expect("traffic");
    assert!(sent >= 20);
    // Seconds after the traffic stopped, the latest sample is zero, but
    // the legend gives the rate over the chart's window, as the chart does.
    tokio::time::sleep(Duration::from_secs(4)).await;
    let legend = "document.querySelector('.legend[data-for=\"chart-requests\"]')";
    browser
        .until(
            "the legend to show the window's rate",
            &format!(
                "const l = {legend}; const s = l && l.querySelector('span[data-series=\"executed\"]'); \
                 return Boolean(s && parseFloat(s.textContent.split(' ').pop()) > 0 && l.querySelector('.window'))"
            ),
        )
        .await;
    let window = browser
        .js(&format!(
            "return {legend}.querySelector('.window').textContent"
        ))
        .await;
    assert!(
        window
            .as_str()
            .is_some_and(|w| w.starts_with("over the last ")),
        "{window}"
    );

    // The inspector finds a record the traffic left.
    let listed = send(
        gw.admin,
        Method::GET,
        "/api/v1/records?state=completed&limit=1",
        &[("authorization", &format!("Bearer {TOKEN}"))],
        "",
    )
    .await;
    let listed: Value = serde_json::from_slice(&listed.body).expect("JSON");
    let record = &listed["records"][0];
    for (field, value) in [
        ("inspect-tenant", &record["tenant"]),
        ("inspect-operation", &record["operation"]),
        ("inspect-key", &record["key"]),
    ] {
        let input = browser
            .client
            .find(Locator::Id(field))
            .await
            .expect("inspector input");
        input.clear().await.expect("clear");
        input
            .send_keys(value.as_str().expect("text"))
            .await
            .expect("type");
    }
    browser.click("inspect-go").await;
    let key = record["key"].as_str().expect("key");
    browser
        .until(
            "the inspector to show the record",
            &format!(
                "const t = document.getElementById('inspect-result').textContent; return t.includes('completed') && t.includes('{key}')"
            ),
        )
        .await;
    // An unknown key says so.
    let input = browser
        .client
        .find(Locator::Id("inspect-key"))
        .await
        .expect("key input");
    input.clear().await.expect("clear");
    input.send_keys("no-such-key").await.expect("type");
    browser.click("inspect-go").await;
    browser
        .until(
            "the inspector to report a missing record",
            "return document.getElementById('inspect-result').textContent.includes('no such record')",
        )
        .await;
    browser.client.close().await.expect("close the session");
}

/// Traffic before the dashboard is opened shows in its totals since start,
/// exactly as the gateway's own counters hold them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dashboard_opened_after_traffic_shows_the_totals_since_start() {
    let Some(setup) = Setup::start().await else {
        return;
    };
    let gw = &setup.gw;
    // Three payments, each sent twice, and one key reused for another body.
    for n in 0..3 {
        let key = format!("before-{n}");
        for _ in 0..2 {
            assert_eq!(
                pay(gw.addr, &key, r#"{"amount":1}"#, "0").await,
                StatusCode::CREATED
            );
        }
    }
    let reused = pay(gw.addr, "before-0", r#"{"amount":2}"#, "0").await;
    assert_eq!(reused, StatusCode::UNPROCESSABLE_ENTITY);
    // Two forged GitHub deliveries.
    for signature in ["sha256=00ff", "sha256=abcd"] {
        let headers = [
            ("x-github-delivery", "d-1"),
            ("content-type", "application/json"),
            ("x-hub-signature-256", signature),
        ];
        let answer = send(gw.addr, Method::POST, "/hooks/github", &headers, "{}").await;
        assert_eq!(answer.status, StatusCode::UNAUTHORIZED);
    }

    let browser = setup.open().await;
    browser
        .until(
            "a successful poll",
            "return Number(document.body.dataset.polls) >= 1",
        )
        .await;
    let tile = |id: &str| format!("return document.getElementById('{id}').textContent");
    for (id, want) in [
        ("total-requests", "9"),
        ("total-executed", "3"),
        ("total-replayed", "3"),
        ("total-conflicts", "1"),
        ("total-held", "0"),
    ] {
        assert_eq!(browser.js(&tile(id)).await, want, "#{id}");
    }
    // The webhook table: one row for GitHub, both refused.
    let row = browser
        .js("const r = document.querySelector('#webhook-list tr[data-provider=\"github\"]'); return r ? [...r.cells].map((c) => c.textContent) : null")
        .await;
    assert_eq!(
        row,
        json!([
            "github",
            "POST /hooks/github",
            "0",
            "2",
            "signature_invalid"
        ]),
        "the webhook deliveries table"
    );
    // The per-second tiles saw none of it: it happened before the first poll.
    let rps = browser.js(&tile("tile-rps")).await;
    assert!(rps == "–" || rps == "0", "requests per second: {rps}");
    browser.client.close().await.expect("close the session");
}
