//! Webhook routes behind `idem serve`, fed by each provider's own signing
//! code (`tests/clients/webhook_sender.py`: the `standardwebhooks`,
//! `svix`, `stripe` and `slack_sdk` packages, Octokit's
//! `@octokit/webhooks-methods` under Node, Shopify's documented HMAC):
//! genuine deliveries run once and their duplicates get the stored
//! answer; deliveries signed with the old secret of a rotation are
//! verified; forged, re-encoded, stale and future ones are refused with
//! nothing forwarded or recorded; a delivery the receiver failed is
//! released for the provider's retry; and a storm of duplicates, some at
//! once, applies every id once.

use std::path::Path;

use idem_testkit::client::metric;
use idem_testkit::gateway::GatewayProcess;
use idem_testkit::upstream::CountingUpstream;
use serde_json::{Value, json};

const IDEM: &str = env!("CARGO_BIN_EXE_idem");
const SENDER: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/clients/webhook_sender.py"
);

/// One sender of each kind: (what the plan calls it, its route, its
/// provider, whether it signs a timestamp).
const SENDERS: [(&str, &str, &str, bool); 6] = [
    ("standard", "/hooks/standard", "standard", true),
    ("svix", "/hooks/svix", "standard", true),
    ("stripe", "/hooks/stripe", "stripe", true),
    ("github", "/hooks/github", "github", false),
    ("shopify", "/hooks/shopify", "shopify", false),
    ("slack", "/hooks/slack", "hmac", true),
];

/// A sender's current and previous secret, as its provider writes them.
fn secrets(sender: &str) -> [String; 2] {
    let raw = |n: u8| format!("{sender}-secret-{n}-{}", "k".repeat(24));
    match sender {
        "standard" | "svix" => {
            use base64::Engine as _;
            [1, 2].map(|n| {
                format!(
                    "whsec_{}",
                    base64::engine::general_purpose::STANDARD.encode(raw(n))
                )
            })
        }
        "stripe" => [1, 2].map(|n| format!("whsec_{}", raw(n))),
        _ => [1, 2].map(raw),
    }
}

/// The gateway's config: one webhook route per sender, each with its two
/// secrets in a file of its own (the new one first), Stripe's from the
/// environment.
fn config(dir: &Path) -> String {
    let mut c = String::new();
    for (sender, path, provider, _) in SENDERS {
        c.push_str(&format!(
            "[[route]]\nmethod = \"POST\"\npath = \"{path}\"\n[route.webhook]\nprovider = \"{provider}\"\n"
        ));
        if sender == "stripe" {
            c.push_str("secrets_env = \"TEST_STRIPE_WEBHOOK_SECRETS\"\n");
        } else {
            let file = dir.join(format!("{sender}.secrets"));
            std::fs::write(
                &file,
                format!("# {sender}\n{}\n", secrets(sender).join("\n")),
            )
            .expect("write secrets");
            set_private(&file);
            c.push_str(&format!("secrets_file = \"{}\"\n", file.display()));
        }
        match sender {
            "svix" => c.push_str("sender = \"svix-acme\"\n"),
            "slack" => c.push_str(
                "sender = \"slack\"\nsignature_header = \"X-Slack-Signature\"\nsignature_prefix = \"v0=\"\nsigned = \"v0:{timestamp}:{body}\"\ntimestamp_header = \"X-Slack-Request-Timestamp\"\nid_field = \"/event_id\"\n",
            ),
            _ => {}
        }
        c.push('\n');
    }
    c
}

fn set_private(file: &Path) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(file, std::fs::Permissions::from_mode(0o600)).expect("chmod");
}

async fn gateway(dir: &Path, upstream: &CountingUpstream) -> GatewayProcess {
    let stripe = secrets("stripe").join(" ");
    GatewayProcess::builder(IDEM, dir)
        .config(&config(dir))
        .upstream(&upstream.url())
        .envs(&[("TEST_STRIPE_WEBHOOK_SECRETS", &stripe)])
        .log("info")
        .log_to_file()
        .start()
        .await
}

/// A delivery of `sender` with id `id`: its body carries the id where the
/// provider puts it (Stripe's `id`, Slack's `event_id`), so every id's
/// body is its own.
fn delivery(sender: &str, id: &str) -> Value {
    let body = match sender {
        "stripe" => {
            json!({"id": id, "object": "event", "type": "payment_intent.succeeded", "data": {"object": {"amount": 2000}}})
        }
        "slack" => {
            json!({"event_id": id, "type": "event_callback", "event": {"type": "app_mention"}})
        }
        _ => json!({"delivery": id, "sender": sender, "action": "opened"}),
    };
    let path = SENDERS.iter().find(|s| s.0 == sender).expect("sender").1;
    json!({
        "provider": sender,
        "path": path,
        "secret": secrets(sender)[0],
        "id": id,
        "body": body.to_string(),
    })
}

/// Runs the sender on `deliveries`: one result per delivery.
async fn send(python: &Path, node_dir: &Path, url: &str, deliveries: &[Value]) -> Vec<Value> {
    let plan = json!({"url": url, "node_dir": node_dir, "deliveries": deliveries});
    let mut child = tokio::process::Command::new(python)
        .arg(SENDER)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run the webhook sender");
    let mut stdin = child.stdin.take().expect("stdin");
    tokio::io::AsyncWriteExt::write_all(&mut stdin, plan.to_string().as_bytes())
        .await
        .expect("write the plan");
    drop(stdin);
    let out = child.wait_with_output().await.expect("the sender ends");
    assert!(
        out.status.success(),
        "the sender failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("the sender's results")
}

/// The signers and the sender's Python packages, or a loud skip.
fn signers() -> Option<(std::path::PathBuf, std::path::PathBuf)> {
    let python = idem_testkit::services::python_with(&[
        "requests",
        "standardwebhooks",
        "svix",
        "stripe",
        "slack_sdk",
    ])?;
    let node = idem_testkit::services::node_package("@octokit/webhooks-methods")?;
    Some((python, node))
}

fn with(mut d: Value, key: &str, value: Value) -> Value {
    d[key] = value;
    d
}

/// The keys and states `idem records list --tenant T` lists, sorted.
fn records_of(store: &str, tenant: &str) -> Vec<(String, String)> {
    let mut keys: Vec<(String, String)> =
        idem_testkit::gateway::listed_records(IDEM, store, &["--tenant", tenant])
            .iter()
            .map(|r| {
                let field = |name: &str| r[name].as_str().expect(name).to_owned();
                (field("key"), field("state"))
            })
            .collect();
    keys.sort();
    keys
}

/// A gateway with every sender's route in front of a counting upstream,
/// and the signers to feed it.
struct Running {
    python: std::path::PathBuf,
    node: std::path::PathBuf,
    dir: tempfile::TempDir,
    upstream: CountingUpstream,
    gw: GatewayProcess,
    url: String,
}

impl Running {
    /// `None` (a loud skip) without the signers.
    async fn start() -> Option<Self> {
        let (python, node) = signers()?;
        let dir = tempfile::tempdir().expect("temp dir");
        let upstream = CountingUpstream::start().await;
        let gw = gateway(dir.path(), &upstream).await;
        let url = format!("http://{}", gw.addr);
        Some(Self {
            python,
            node,
            dir,
            upstream,
            gw,
            url,
        })
    }

    async fn send(&self, deliveries: &[Value]) -> Vec<Value> {
        send(&self.python, &self.node, &self.url, deliveries).await
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_providers_signed_deliveries_run_once_and_forgeries_never() {
    let Some(run) = Running::start().await else {
        return;
    };
    let (dir, upstream, gw) = (&run.dir, &run.upstream, &run.gw);
    let mut plan = Vec::new();
    for (sender, _, _, timestamped) in SENDERS {
        let id = |n: &str| format!("{sender}-{n}");
        let genuine = delivery(sender, &id("genuine"));
        let old_secret = secrets(sender)[1].clone();
        plan.push(with(genuine.clone(), "wave", json!(0)));
        plan.push(with(genuine.clone(), "wave", json!(1)));
        plan.push(with(
            with(genuine, "wave", json!(2)),
            "secret",
            json!(old_secret),
        ));
        let wrong = match sender {
            "standard" | "svix" => "whsec_d3Jvbmcgc2VjcmV0IG9mIGFuIGF0dGFja2Vy".to_owned(),
            _ => "wrong secret of an attacker".to_owned(),
        };
        plan.push(with(
            delivery(sender, &id("forged")),
            "secret",
            json!(wrong),
        ));
        plan.push(with(
            delivery(sender, &id("reencoded")),
            "reencode",
            json!(true),
        ));
        if timestamped {
            plan.push(with(
                delivery(sender, &id("stale")),
                "ts_offset",
                json!(-600),
            ));
            plan.push(with(
                delivery(sender, &id("future")),
                "ts_offset",
                json!(600),
            ));
        }
        // The receiver fails the first attempt; the provider's retry runs
        // it, and the one after gets the stored answer.
        let failed = delivery(sender, &id("failed"));
        plan.push(with(
            with(failed.clone(), "headers", json!({"x-status": "500"})),
            "wave",
            json!(0),
        ));
        plan.push(with(failed.clone(), "wave", json!(1)));
        plan.push(with(failed, "wave", json!(2)));
    }
    let results = run.send(&plan).await;
    let mut i = 0;
    for (sender, route, provider, timestamped) in SENDERS {
        let mut next = || {
            let r = results[i].clone();
            i += 1;
            r
        };
        let (first, dup, rotated) = (next(), next(), next());
        assert_eq!(
            (first["status"].as_u64(), first["replayed"].as_bool()),
            (Some(201), Some(false)),
            "{sender}: first {first}"
        );
        assert_eq!(
            (dup["status"].as_u64(), dup["replayed"].as_bool()),
            (Some(201), Some(true)),
            "{sender}: duplicate {dup}"
        );
        assert_eq!(
            (rotated["status"].as_u64(), rotated["replayed"].as_bool()),
            (Some(201), Some(true)),
            "{sender}: old secret {rotated}"
        );
        for what in ["forged", "re-encoded"] {
            let r = next();
            assert_eq!(r["status"], 401, "{sender}: {what} {r}");
            assert_eq!(
                r["code"], "webhook-signature-invalid",
                "{sender}: {what} {r}"
            );
        }
        if timestamped {
            for what in ["stale", "future"] {
                let r = next();
                assert_eq!(r["status"], 401, "{sender}: {what} {r}");
                assert_eq!(
                    r["code"], "webhook-timestamp-refused",
                    "{sender}: {what} {r}"
                );
            }
        }
        let (failed, retried, again) = (next(), next(), next());
        assert_eq!(failed["status"], 500, "{sender}: failed {failed}");
        assert_eq!(
            (retried["status"].as_u64(), retried["replayed"].as_bool()),
            (Some(201), Some(false)),
            "{sender}: the provider's retry runs: {retried}"
        );
        assert_eq!(
            (again["status"].as_u64(), again["replayed"].as_bool()),
            (Some(201), Some(true)),
            "{sender}: {again}"
        );
        let count = |result: &str| {
            let admin = gw.admin;
            let label =
                format!("route=\"POST {route}\",provider=\"{provider}\",result=\"{result}\"");
            async move { metric(admin, "idem_webhook_deliveries_total", &label).await }
        };
        assert_eq!(count("verified").await, 6.0, "{sender}");
        assert_eq!(count("signature_invalid").await, 2.0, "{sender}");
        let stale = if timestamped { 1.0 } else { 0.0 };
        assert_eq!(count("timestamp_stale").await, stale, "{sender}");
        assert_eq!(count("timestamp_future").await, stale, "{sender}");
    }
    assert_eq!(i, results.len());
    // Only the genuine and the failed-then-retried bodies reached the
    // receiver: once each, the failed one twice (its failure applied
    // nothing).
    let applied = upstream.applied();
    assert_eq!(applied.len(), 2 * SENDERS.len(), "{applied:?}");
    assert!(applied.values().all(|n| *n == 1), "{applied:?}");
    assert_eq!(upstream.total(), 3 * SENDERS.len() as u64);
    // The records are listed by sender.
    let store = idem_testkit::gateway::sqlite_store(dir.path());
    assert_eq!(
        records_of(&store, "webhook:stripe"),
        vec![
            ("stripe-failed".to_owned(), "completed".to_owned()),
            ("stripe-genuine".to_owned(), "completed".to_owned())
        ]
    );
    assert_eq!(records_of(&store, "webhook:svix-acme").len(), 2);
    assert_eq!(records_of(&store, "webhook:slack").len(), 2);
    // The log says why each refusal happened, and never holds a secret.
    let log = std::fs::read_to_string(dir.path().join("idem.log")).expect("log");
    assert!(log.contains("webhook_refused"), "{log}");
    assert!(log.contains("timestamp_stale"), "{log}");
    for (sender, ..) in SENDERS {
        for secret in secrets(sender) {
            assert!(!log.contains(&secret), "the log holds a secret of {sender}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delivery_storm_applies_every_id_once() {
    let Some(run) = Running::start().await else {
        return;
    };
    let upstream = &run.upstream;
    const IDS: usize = 50;
    const FORGED: usize = 5;
    let mut plan = Vec::new();
    for (sender, ..) in SENDERS {
        for n in 0..IDS {
            let d = delivery(sender, &format!("{sender}-storm-{n}"));
            // Two copies at once, then two more, one under the old secret.
            plan.push(with(d.clone(), "wave", json!(0)));
            plan.push(with(d.clone(), "wave", json!(0)));
            plan.push(with(d.clone(), "wave", json!(1)));
            let old = secrets(sender)[1].clone();
            plan.push(with(with(d, "wave", json!(2)), "secret", json!(old)));
        }
        for n in 0..FORGED {
            let d = delivery(sender, &format!("{sender}-forged-{n}"));
            let d = with(d, "wave", json!(0));
            plan.push(with(d, "reencode", json!(n % 2 == 0)));
            let last = plan.len() - 1;
            if n % 2 == 1 {
                let wrong = match sender {
                    "standard" | "svix" => "whsec_Zm9yZ2Vk".to_owned(),
                    _ => "forged".to_owned(),
                };
                plan[last]["secret"] = json!(wrong);
            }
        }
    }
    let results = run.send(&plan).await;
    // Every copy that met its first attempt still running (409) is sent
    // again, as its provider would.
    let retries: Vec<Value> = plan
        .iter()
        .zip(&results)
        .filter(|(_, r)| r["status"] == 409)
        .map(|(d, _)| with(d.clone(), "wave", json!(0)))
        .collect();
    let retried = run.send(&retries).await;
    let mut statuses = std::collections::BTreeMap::new();
    for r in results.iter().chain(&retried) {
        *statuses
            .entry(r["status"].as_u64().unwrap_or(0))
            .or_insert(0u64) += 1;
    }
    let forged_refused = results.iter().filter(|r| r["status"] == 401).count();
    let applied = upstream.applied();
    let distinct = SENDERS.len() * IDS;
    let side_effects: u64 = applied.values().sum();
    eprintln!(
        "webhook storm: {} deliveries sent ({} then {} re-sent after a 409), {distinct} distinct ids over {} senders, {side_effects} side effects, {forged_refused} of {} forged refused; statuses {statuses:?}",
        plan.len() + retries.len(),
        plan.len(),
        retries.len(),
        SENDERS.len(),
        SENDERS.len() * FORGED,
    );
    assert_eq!(
        forged_refused,
        SENDERS.len() * FORGED,
        "every forgery refused"
    );
    assert_eq!(applied.len(), distinct, "every id applied");
    assert_eq!(side_effects, distinct as u64, "and each once: {applied:?}");
    assert!(
        retried.iter().all(|r| r["status"] == 201),
        "every re-sent copy got the answer: {retried:?}"
    );
    assert!(
        results
            .iter()
            .all(|r| [201, 401, 409].contains(&r["status"].as_u64().unwrap_or(0))),
        "{statuses:?}"
    );
}

/// `idem openapi` states each webhook route's provider headers and
/// refusals, in a document the OpenAPI validator accepts.
#[tokio::test]
async fn the_openapi_document_states_each_senders_headers_and_refusals() {
    let dir = tempfile::tempdir().expect("temp dir");
    let config = format!("upstream = \"http://127.0.0.1:9\"\n{}", config(dir.path()));
    let stripe = secrets("stripe").join(" ");
    let Some(doc) = super::profiles::validated_openapi(
        dir.path(),
        &config,
        &[("TEST_STRIPE_WEBHOOK_SECRETS", &stripe)],
    ) else {
        return;
    };
    let op = &doc["paths"]["/hooks/github"]["post"];
    let names: Vec<&str> = op["parameters"]
        .as_array()
        .expect("parameters")
        .iter()
        .map(|p| p["name"].as_str().expect("name"))
        .collect();
    assert_eq!(names, ["X-Hub-Signature-256", "X-Github-Delivery"]);
    assert_eq!(
        op["responses"]["401"]["content"]["application/problem+json"]["schema"]["allOf"][1]["properties"]
            ["code"]["enum"],
        json!(["webhook-signature-invalid"])
    );
    let stripe = &doc["paths"]["/hooks/stripe"]["post"];
    assert_eq!(
        stripe["responses"]["401"]["content"]["application/problem+json"]["schema"]["allOf"][1]["properties"]
            ["code"]["enum"],
        json!(["webhook-signature-invalid", "webhook-timestamp-refused"])
    );
    assert_eq!(
        stripe["x-idempotency"]["webhook"],
        json!({"provider": "stripe", "tenant": "webhook:stripe", "headers": ["Stripe-Signature"], "tolerance_seconds": 300})
    );
    assert_eq!(stripe["x-idempotency"]["retention_seconds"], 3 * 86400);
    assert_eq!(stripe["x-idempotency"]["on_server_error"], "release");
}
