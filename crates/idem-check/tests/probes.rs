//! The probes against real endpoints on loopback: an idempotent one (the
//! `idem-http` layer over the in-memory store) passes every probe; the
//! counting upstream without protection fails the right ones, with the
//! evidence; an unreachable target is an error, not a verdict; arguments
//! that cannot work are refused before anything is sent.

use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::Duration;

use axum::Router;
use axum::http::StatusCode;
use axum::routing::post;
use bytes::Bytes;
use clap::Parser;
use http::{HeaderMap, HeaderValue, Method};
use idem_check::{CheckArgs, CheckError, PROBES, Probe, Target, Verdict};
use idem_http::{IdempotencyLayer, RoutePolicy, Routes, TenantSource};
use idem_testkit::upstream::CountingUpstream;

const BODY: &str = r#"{"amount_cents":100,"currency":"EUR","order_id":"o-1"}"#;

/// A payments endpoint made idempotent by the `idem-http` layer: keys
/// required, scoped by credential.
async fn idempotent_api() -> SocketAddr {
    let routes = Routes::default()
        .route(
            Method::POST,
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
            IdempotencyLayer::new(idem::MemoryStore::new())
                .with_routes(routes)
                .with_tenant(TenantSource::Authorization),
        );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        let _ = axum::serve(listener, router).await;
    });
    addr
}

/// Every argument given, as `idem check` builds it.
fn target(url: &str) -> Target {
    let mut headers = HeaderMap::new();
    headers.insert("content-type", HeaderValue::from_static("application/json"));
    headers.insert(
        "authorization",
        HeaderValue::from_static("Bearer merchant-a"),
    );
    Target {
        url: url.parse().expect("url"),
        method: Method::POST,
        body: Bytes::from_static(BODY.as_bytes()),
        headers,
        vary_field: Some("amount_cents".to_owned()),
        second_auth: Some(HeaderValue::from_static("Bearer merchant-b")),
        concurrency: 20,
        key_required: true,
        id_field: "id".to_owned(),
        timeout: Duration::from_secs(10),
        max_requests: 100,
        extra_roots: Vec::new(),
    }
}

fn verdict(outcomes: &[idem_check::Outcome], probe: Probe) -> Verdict {
    outcomes
        .iter()
        .find(|o| o.probe == probe)
        .map(|o| o.verdict)
        .unwrap_or_else(|| panic!("{probe:?} missing"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_probe_passes_against_an_idempotent_endpoint() {
    let addr = idempotent_api().await;
    let url = format!("http://{addr}/v1/payments");
    let target = target(&url);
    idem_check::validate(&target, &PROBES, true).expect("valid arguments");
    let outcomes = idem_check::run(target, &PROBES).await;
    let probes: Vec<Probe> = outcomes.iter().map(|o| o.probe).collect();
    assert_eq!(probes, PROBES, "every probe, in order");
    for o in &outcomes {
        assert_eq!(o.verdict, Verdict::Pass, "{:?}: {}", o.probe, o.note);
    }
    assert_eq!(idem_check::exit_code(&outcomes), 0);
    let retry = &outcomes[0];
    assert!(
        retry
            .note
            .contains("the retry is marked Idempotent-Replayed: true"),
        "{}",
        retry.note
    );

    let report = idem_check::report::json_report(&url.parse().expect("url"), &outcomes);
    let json: serde_json::Value = serde_json::from_str(&report).expect("json report");
    assert_eq!(json["passed"], true, "{report}");
    assert_eq!(json["url"], url.as_str());
    assert_eq!(json["probes"][1]["probe"], "concurrent", "{report}");
    let text = idem_check::report::text_report(&url.parse().expect("url"), &outcomes);
    assert!(
        text.ends_with("\n8 passed, 0 failed, 0 skipped, 0 errors\n"),
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unprotected_upstream_fails_the_right_probes_with_evidence() {
    let up = CountingUpstream::start().await;
    let url = format!("{}/v1/payments", up.url());
    let outcomes = idem_check::run(target(&url), &PROBES).await;
    for probe in [
        Probe::Retry,
        Probe::Concurrent,
        Probe::Reuse,
        Probe::EquivalentJson,
        Probe::MissingKey,
        Probe::MalformedKey,
    ] {
        assert_eq!(verdict(&outcomes, probe), Verdict::Fail, "{probe:?}");
    }
    // Without idempotency, distinct keys and tenants are trivially separate.
    assert_eq!(verdict(&outcomes, Probe::DistinctKeys), Verdict::Pass);
    assert_eq!(verdict(&outcomes, Probe::Tenants), Verdict::Pass);
    assert_eq!(idem_check::exit_code(&outcomes), 1);
    let concurrent = &outcomes[1];
    assert_eq!(concurrent.evidence.len(), 20);
    assert!(
        concurrent.note.contains("several resources"),
        "{}",
        concurrent.note
    );
    // Exactly the requests the probes need (20 + 6 × 2 + 1): every key
    // and every request without one reached the upstream once.
    assert_eq!(up.total(), 33);

    let text = idem_check::report::text_report(&url.parse().expect("url"), &outcomes);
    assert!(
        text.contains("      … 14 more exchanges (--format json shows all)"),
        "{text}"
    );
    let xml = idem_check::report::junit_report(&url.parse().expect("url"), &outcomes);
    assert!(
        xml.contains("tests=\"8\" failures=\"6\" errors=\"0\" skipped=\"0\""),
        "{xml}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_run_never_sends_more_than_max_requests() {
    let up = CountingUpstream::start().await;
    let url = format!("{}/v1/payments", up.url());
    let target = Target {
        max_requests: 3,
        ..target(&url)
    };
    let probes = [Probe::Retry, Probe::DistinctKeys];
    assert!(matches!(
        idem_check::validate(&target, &probes, true),
        Err(CheckError::OverBudget {
            needed: 4,
            max_requests: 3
        })
    ));
    // A caller that skips validation is still held to the limit.
    let outcomes = idem_check::run(target, &probes).await;
    assert_eq!(up.total(), 3);
    assert_eq!(outcomes[1].verdict, Verdict::Error);
    assert_eq!(
        outcomes[1].note,
        "not sent: the run reached --max-requests 3"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_target_is_an_error_not_a_verdict() {
    let outcomes = idem_check::run(target("http://127.0.0.1:1/v1/payments"), &PROBES).await;
    assert_eq!(outcomes.len(), PROBES.len());
    assert!(
        outcomes[0]
            .note
            .starts_with("cannot reach http://127.0.0.1:1/v1/payments: "),
        "{}",
        outcomes[0].note
    );
    // No other probe is even sent.
    for o in &outcomes[1..] {
        assert!(
            o.note.starts_with("not run: cannot reach"),
            "{:?}: {}",
            o.probe,
            o.note
        );
        assert!(o.evidence.is_empty());
    }
    for o in &outcomes {
        assert_eq!(o.verdict, Verdict::Error, "{:?}: {}", o.probe, o.note);
        assert!(o.note.contains("cannot reach"), "{}", o.note);
    }
    assert_eq!(idem_check::exit_code(&outcomes), 2);
}

#[test]
fn validate_refuses_what_cannot_work_naming_the_flag() {
    let url = "http://127.0.0.1:1/v1/payments";
    let refused = |target: Target, probes: &[Probe]| {
        idem_check::validate(&target, probes, true)
            .expect_err("refused")
            .to_string()
    };
    assert_eq!(
        refused(target("ftp://127.0.0.1:1/v1/payments"), &PROBES),
        "--url ftp://127.0.0.1:1/v1/payments: expected an http:// or https:// URL"
    );
    assert_eq!(
        refused(
            Target {
                vary_field: Some("nope".to_owned()),
                ..target(url)
            },
            &PROBES
        ),
        "--vary-field nope: the body has no top-level field \"nope\""
    );
    let plain = Target {
        body: Bytes::from_static(b"plain text"),
        ..target(url)
    };
    let err = idem_check::validate(&plain, &PROBES, true).expect_err("not JSON");
    assert!(matches!(err, CheckError::BodyNotJson { .. }), "{err:?}");
    assert!(std::error::Error::source(&err).is_some());
    assert_eq!(
        refused(
            Target {
                vary_field: None,
                ..target(url)
            },
            &[Probe::Reuse]
        ),
        "--probes reuse needs --vary-field FIELD (a top-level JSON field to change)"
    );
    assert_eq!(
        refused(
            Target {
                second_auth: None,
                ..target(url)
            },
            &[Probe::Tenants]
        ),
        "--probes tenants needs --auth2 (a second credential)"
    );
    // With `all`, probes missing their arguments are skipped, not refused.
    let partial = Target {
        vary_field: None,
        second_auth: None,
        ..target(url)
    };
    idem_check::validate(&partial, &PROBES, false).expect("skips, not refusals");
}

/// `idem check` as the gateway's command line parses it.
#[derive(Debug, Parser)]
#[command(name = "idem-check")]
struct Cli {
    #[command(flatten)]
    check: CheckArgs,
}

async fn main_with(args: &[&str]) -> ExitCode {
    let cli = Cli::try_parse_from(std::iter::once("idem-check").chain(args.iter().copied()))
        .expect("arguments parse");
    idem_check::main(cli.check).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn main_exits_0_1_or_2() {
    let addr = idempotent_api().await;
    let good = format!("http://{addr}/v1/payments");
    let up = CountingUpstream::start().await;
    let naive = format!("{}/v1/payments", up.url());
    let auth = ["--header", "authorization: Bearer merchant-a"];

    let ok = main_with(&[&["--url", &good, "--body", BODY], &auth[..]].concat()).await;
    assert_eq!(ok, ExitCode::SUCCESS);
    let failed = main_with(
        &[
            &["--url", &naive, "--body", BODY, "--probes", "retry"],
            &auth[..],
        ]
        .concat(),
    )
    .await;
    assert_eq!(failed, ExitCode::FAILURE);
    let before = up.total();
    for bad in [
        &["--url", &naive, "--probes", "retry,colour"][..],
        &["--url", &naive, "--header", "no colon"],
        &["--url", &naive, "--method", "P OST"],
        &["--url", &naive, "--max-requests", "5"],
        &["--url", &naive, "--ca-file", "/nonexistent/ca.pem"],
        &["--url", "ftp://127.0.0.1:1/v1/payments"],
    ] {
        assert_eq!(main_with(bad).await, ExitCode::from(2), "{bad:?}");
    }
    assert_eq!(up.total(), before, "refused runs send nothing");
}

#[test]
fn the_command_line_keeps_its_flags_and_defaults() {
    let cli = Cli::try_parse_from(["idem-check"]);
    assert!(cli.is_err(), "--url is required");
    let err = Cli::try_parse_from(["idem-check", "--url", "http://h/x", "--concurrency", "1"])
        .expect_err("below the range");
    assert!(err.to_string().contains("--concurrency"), "{err}");
    let help = {
        use clap::CommandFactory;
        Cli::command().render_long_help().to_string()
    };
    for needle in [
        "--url <URL>",
        "--method <METHOD>",
        "[default: POST]",
        "--body <BODY>",
        "[default: {}]",
        "--header <HEADERS>",
        "--auth2 <AUTH2>",
        "--vary-field <VARY_FIELD>",
        "--concurrency <CONCURRENCY>",
        "[default: 20]",
        "--probes <PROBES>",
        "[default: all]",
        "--key-required",
        "--id-field <ID_FIELD>",
        "--ca-file <CA_FILE>",
        "--timeout <TIMEOUT>",
        "[default: 10s]",
        "--max-requests <MAX_REQUESTS>",
        "[default: 100]",
        "--format <FORMAT>",
        "[possible values: text, json, junit]",
    ] {
        assert!(help.contains(needle), "{needle}: {help}");
    }
}
