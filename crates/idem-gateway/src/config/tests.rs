//! The configuration's parsing and checks, from TOML text to settings.

use std::time::Duration;

use http::{HeaderName, Method, StatusCode};
use idem::{FailMode, InFlight, LeaseExpiry};
use idem_http::{MissingTenant, PathSpelling};

use super::*;

#[test]
fn otlp_endpoints_become_traces_urls() {
    assert_eq!(
        traces_url("http://127.0.0.1:4318").as_deref(),
        Ok("http://127.0.0.1:4318/v1/traces")
    );
    assert_eq!(
        traces_url("https://collector:4318/").as_deref(),
        Ok("https://collector:4318/v1/traces")
    );
    assert_eq!(
        traces_url("http://collector:4318/otlp/v1/traces").as_deref(),
        Ok("http://collector:4318/otlp/v1/traces")
    );
    for bad in [
        "collector:4318",
        "grpc://collector:4317",
        "http://",
        "not a url",
    ] {
        assert!(traces_url(bad).is_err(), "{bad}");
    }
}

#[test]
fn tenant_sources_and_hash_settings() {
    let tenant = |t: &str| {
        from_text(&format!("upstream = \"http://127.0.0.1:1\"\n[tenant]\n{t}")).map(|s| s.tenant)
    };
    assert_eq!(
        tenant("from = \"authorization\"").expect("ok"),
        TenantSource::Authorization
    );
    assert_eq!(
        tenant("from = \"header\"\nname = \"X-Api-Key\"").expect("ok"),
        TenantSource::Header(HeaderName::from_static("x-api-key"))
    );
    assert_eq!(
        tenant("from = \"cookie\"\nname = \"session\"").expect("ok"),
        TenantSource::Cookie("session".into())
    );
    assert_eq!(
        tenant("from = \"trusted_header\"\nname = \"X-User\"\ntrusted_proxies = [\"10.0.0.0/8\", \"192.168.1.7\"]").expect("ok"),
        TenantSource::TrustedHeader {
            name: HeaderName::from_static("x-user"),
            proxies: vec!["10.0.0.0/8".parse().expect("net"), "192.168.1.7/32".parse().expect("net")],
        }
    );
    for (bad, why) in [
        (
            "from = \"trusted_header\"\nname = \"X-User\"",
            "trusted_proxies",
        ),
        (
            "from = \"trusted_header\"\nname = \"X-User\"\ntrusted_proxies = [\"nope\"]",
            "not an address",
        ),
        (
            "from = \"header\"\nname = \"X-Api-Key\"\ntrusted_proxies = [\"10.0.0.0/8\"]",
            "only from",
        ),
        ("from = \"cookie\"\nname = \"a;b\"", "not a cookie name"),
        ("from = \"cookie\"", "needs name"),
        ("from = \"ip\"", "expected"),
    ] {
        let err = tenant(bad).expect_err(bad).to_string();
        assert!(err.contains(why), "{bad}: {err}");
    }
    let route = |r: &str| {
        from_text(&format!(
            "upstream = \"http://127.0.0.1:1\"\n[[route]]\nmethod = \"POST\"\npath = \"/p\"\n{r}"
        ))
    };
    let pass = route("on_missing_tenant = \"pass\"").expect("ok");
    let m = pass.routes.matching(&Method::POST, "/p").expect("route");
    assert_eq!(m.policy.on_missing_tenant, MissingTenant::Pass);
    assert!(route("on_missing_tenant = \"maybe\"").is_err());
    let strict = route("path_spelling = \"refuse\"").expect("ok");
    let m = strict.routes.matching(&Method::POST, "/p").expect("route");
    assert_eq!(m.policy.path_spelling, PathSpelling::Refuse);
    let m = pass.routes.matching(&Method::POST, "/p").expect("route");
    assert_eq!(m.policy.path_spelling, PathSpelling::Normalise);
    assert!(route("path_spelling = \"lenient\"").is_err());
    let lenient = pass
        .routes
        .matching(&Method::POST, "/p.json;x=1")
        .expect("route");
    assert!(lenient.pattern.is_some(), "parameters and suffixes ignored");
    let exact = from_text(
        "upstream = \"http://127.0.0.1:1\"\nignore_path_parameters = false\nignore_path_suffixes = false\n[[route]]\nmethod = \"POST\"\npath = \"/p\"",
    )
    .expect("ok");
    for path in ["/p.json", "/p;x=1"] {
        let m = exact
            .routes
            .matching(&Method::POST, path)
            .expect("defaults");
        assert!(m.pattern.is_none(), "{path} matches no route");
    }
    let until =
        from_text("upstream = \"http://127.0.0.1:1\"\naccept_v1_until = \"2030-01-02T03:04:05Z\"")
            .expect("ok");
    assert_eq!(
        until.accept_v1_until,
        humantime::parse_rfc3339("2030-01-02T03:04:05Z").ok()
    );
    let err = from_text("upstream = \"http://127.0.0.1:1\"\naccept_v1_until = \"tomorrow\"")
        .expect_err("bad");
    assert!(err.to_string().contains("RFC 3339"), "{err}");
    // A secret file: the secret line, comments, an optional deadline.
    let hex = "ab".repeat(32);
    let (_, until) = parse_secret_file(&format!(
        "# made by idem\n{hex}\naccept_v1_until = 2030-01-02T03:04:05Z\n"
    ))
    .expect("ok");
    assert!(until.is_some());
    assert!(parse_secret_file("# nothing\n").is_err());
    assert!(parse_secret_file(&format!("{hex}\n{hex}\n")).is_err());
}

fn from_text(text: &str) -> Result<Settings, ConfigError> {
    let path = Path::new("idem.toml");
    let parsed: FileConfig =
        toml::from_str(text).map_err(|e| ConfigError::new(format!("idem.toml: {e}")))?;
    build(parsed, &Source { file: path, text }, &Overrides::default())
}

const FULL: &str = r#"
upstream = "http://127.0.0.1:3000"
store = "sqlite://idem.db"
[tenant]
from = "header"
name = "X-Tenant-Id"
[defaults]
retention = "24h"
lease = "30s"
require_key = false
on_in_flight = "wait"
in_flight_wait = "5s"
on_store_error = "closed"
max_request_body = "1MiB"
max_stored_response = "1MiB"
upstream_timeout = "30s"
[[route]]
method = "POST"
path = "/v1/payments"
require_key = true
retention = "72h"
mismatch_status = 400
[[route]]
method = "put"
path = "/v1/orders/{id}/capture"
on_store_error = "open"
"#;

#[test]
fn the_documented_example_loads() {
    let s = from_text(FULL).expect("valid");
    assert_eq!(s.upstream, "http://127.0.0.1:3000");
    assert_eq!(s.listen.to_string(), DEFAULT_LISTEN);
    assert_eq!(
        s.tenant,
        TenantSource::Header(HeaderName::from_static("x-tenant-id"))
    );
    let pay = s
        .routes
        .matching(&Method::POST, "/v1/payments")
        .expect("route");
    assert!(pay.policy.require_key);
    assert_eq!(pay.policy.engine.retention, Duration::from_secs(72 * 3600));
    assert_eq!(
        pay.policy.engine.on_in_flight,
        InFlight::Wait(Duration::from_secs(5))
    );
    assert_eq!(pay.policy.mismatch_status, StatusCode::BAD_REQUEST);
    let cap = s
        .routes
        .matching(&Method::PUT, "/v1/orders/1/capture")
        .expect("route");
    assert_eq!(cap.policy.engine.fail_mode, FailMode::Open);
    assert!(!cap.policy.require_key);
    assert_eq!(s.upstream_timeout, Duration::from_secs(30));
}

#[test]
fn keys_and_fingerprint_fields_are_read_per_route_over_the_defaults() {
    let s = from_text(
        r#"
upstream = "http://127.0.0.1:3000"
[defaults]
key_header = "X-Request-Id"
fingerprint_exclude = ["/sent_at"]
[[route]]
method = "POST"
path = "/v1/payments"
key_header = ["X-Idempotency-Key", "Idempotency-Key"]
key_from = "/order/id"
[[route]]
method = "POST"
path = "/v1/refunds"
fingerprint_include = ["/amount", "/currency"]
"#,
    )
    .expect("valid");
    let p = |t: &str| t.parse::<idem_http::JsonPointer>().expect("pointer");
    let pay = s
        .routes
        .matching(&Method::POST, "/v1/payments")
        .expect("route");
    assert_eq!(
        pay.policy.key_headers,
        [
            HeaderName::from_static("x-idempotency-key"),
            HeaderName::from_static("idempotency-key")
        ]
    );
    assert_eq!(pay.policy.key_from, Some(p("/order/id")));
    assert_eq!(
        pay.policy.fingerprint_body,
        idem_http::BodyFields::Exclude(vec![p("/sent_at")])
    );
    let refunds = s
        .routes
        .matching(&Method::POST, "/v1/refunds")
        .expect("route");
    assert_eq!(
        refunds.policy.key_headers,
        [HeaderName::from_static("x-request-id")]
    );
    assert_eq!(refunds.policy.key_from, None);
    assert_eq!(
        refunds.policy.fingerprint_body,
        idem_http::BodyFields::Include(vec![p("/amount"), p("/currency")])
    );
    // Unrouted POSTs take the defaults.
    let other = s
        .routes
        .matching(&Method::POST, "/v1/other")
        .expect("default");
    assert_eq!(
        other.policy.key_headers,
        [HeaderName::from_static("x-request-id")]
    );
}

#[test]
fn bad_key_sources_and_fingerprint_fields_are_refused_with_their_line() {
    let route = |body: &str| {
        format!(
            "upstream = \"http://127.0.0.1:3000\"\n[[route]]\nmethod = \"POST\"\npath = \"/v1/p\"\n{body}\n"
        )
    };
    for (body, want) in [
        (
            "key_from = \"order/id\"",
            "idem.toml:5: route[0].key_from = \"order/id\": a JSON Pointer starts with '/'",
        ),
        ("key_from = \"\"", "the empty pointer names the whole body"),
        (
            "fingerprint_include = [\"/a\", \"/b~2\"]",
            "idem.toml:5: route[0].fingerprint_include",
        ),
        ("fingerprint_include = []", "covers none of the body"),
        (
            "fingerprint_include = [\"/a\"]\nfingerprint_exclude = [\"/b\"]",
            "idem.toml:6: route[0].fingerprint_exclude = [\"/b\"]: set fingerprint_include or fingerprint_exclude, not both",
        ),
        (
            "key_header = \"Authorization\"",
            "authorization carries a credential",
        ),
        (
            "key_header = [\"X-Ok\", \"Cookie\"]",
            "cookie carries a credential",
        ),
        ("key_header = \"bad header\"", "is not a header name"),
        ("key_header = []", "name a header, or set key_from"),
        ("key_header = 7", "idem.toml"),
    ] {
        let err = from_text(&route(body)).expect_err(body);
        assert!(err.message().contains(want), "{body}: {err}");
    }
    // Nor the header the tenant's credential comes from.
    let err = from_text(&format!(
        "{}[tenant]\nfrom = \"header\"\nname = \"X-Api-Key\"\n",
        route("key_header = \"X-Api-Key\"")
    ))
    .expect_err("tenant header");
    assert!(
        err.message().contains("x-api-key carries a credential"),
        "{err}"
    );
    // No header at all, only the body's field: allowed.
    let s = from_text(&route("key_header = []\nkey_from = \"/id\"")).expect("body only");
    let only = s.routes.matching(&Method::POST, "/v1/p").expect("route");
    assert!(only.policy.key_headers.is_empty());
}

#[cfg(unix)]
#[test]
fn files_holding_secrets_that_others_can_read_are_named() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().expect("dir");
    let path = dir.path().join("keys");
    std::fs::write(&path, "k1:00").expect("write");
    for (mode, want) in [
        (0o600, None),
        (0o640, Some("readable by its group (mode 640)")),
        (
            0o644,
            Some("readable by its group and every local user (mode 644)"),
        ),
        (0o604, Some("readable by every local user (mode 604)")),
    ] {
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).expect("chmod");
        assert_eq!(
            exposed(&path).as_deref(),
            want.map(|w| format!("is {w}")).as_deref()
        );
    }
}

#[test]
fn an_upstream_with_credentials_is_refused() {
    let err =
        from_text("upstream = \"http://user:secret@127.0.0.1:3000\"\n").expect_err("userinfo");
    assert!(
        err.message().contains("carries a user or password"),
        "{err}"
    );
    assert!(
        err.message()
            .starts_with("idem.toml:1: upstream = \"http://user:***@127.0.0.1:3000\""),
        "{err}"
    );
    assert!(
        !err.message().contains("secret"),
        "no password in the message: {err}"
    );
}

#[test]
fn routes_hold_by_default_and_may_name_a_lookup() {
    let s = from_text(
        "upstream = \"http://x:1\"\n[[route]]\nmethod = \"POST\"\npath = \"/v1/orders/{id}/capture\"\n\
         [route.reconcile]\npath = \"/v1/orders/{id}/captures/{key}\"\nstatus = 201\nsettle = \"10s\"\ngive_up = \"2h\"\n\
         [[route]]\nmethod = \"POST\"\npath = \"/v1/refunds\"\non_lease_expiry = \"retry\"\n",
    )
    .expect("valid");
    let capture = s
        .routes
        .matching(&Method::POST, "/v1/orders/7/capture")
        .expect("route");
    assert_eq!(capture.policy.engine.on_lease_expiry, LeaseExpiry::Hold);
    let lookup = capture.policy.lookup.as_ref().expect("lookup");
    assert_eq!(lookup.method(), Method::GET);
    assert_eq!(lookup.status(), Some(StatusCode::CREATED));
    assert_eq!(lookup.schedule().settle, Duration::from_secs(10));
    assert_eq!(lookup.schedule().give_up, Duration::from_secs(7200));
    let refunds = s
        .routes
        .matching(&Method::POST, "/v1/refunds")
        .expect("route");
    assert_eq!(refunds.policy.engine.on_lease_expiry, LeaseExpiry::Retry);
    assert!(refunds.policy.lookup.is_none());
    assert_eq!(
        s.routes.defaults().engine.on_lease_expiry,
        LeaseExpiry::Hold,
        "the default never runs a held attempt again"
    );
}

#[test]
fn bad_lookups_are_refused_with_the_line() {
    let route = "upstream = \"http://x:1\"\n[[route]]\nmethod = \"POST\"\npath = \"/v1/payments\"\n[route.reconcile]\n";
    for (tail, want) in [
        ("status = 201\n", "route[0].reconcile has no path"),
        (
            "path = \"/v1/payments/{id}/{key}\"\n",
            "idem.toml:6: route[0].reconcile.path = \"/v1/payments/{id}/{key}\": {id} is not a parameter of the route's path \"/v1/payments\"",
        ),
        (
            "path = \"/v1/payments/by-key\"\n",
            "must name the record by {key}",
        ),
        (
            "path = \"/v1/p/{key}\"\nstatus = 404\n",
            "idem.toml:7: route[0].reconcile.status = 404: must be a 2xx status",
        ),
        (
            "path = \"/v1/p/{key}\"\nmethod = \"DELETE\"\n",
            "route[0].reconcile.method = \"DELETE\": expected \"GET\"",
        ),
        (
            "path = \"/v1/p/{key}\"\nsettle = \"0s\"\n",
            "route[0].reconcile.settle = \"0s\": must be greater than zero",
        ),
    ] {
        let err = from_text(&format!("{route}{tail}")).expect_err(tail);
        assert!(err.message().contains(want), "{tail}: {err}");
    }
    let err = from_text("upstream = \"http://x:1\"\n[defaults.reconcile]\npath = \"/v1/{key}\"\n")
        .expect_err("defaults");
    assert!(
        err.message().contains("a lookup belongs to one route"),
        "{err}"
    );
}

#[test]
fn bad_values_name_line_key_value_and_why() {
    let cases = [
        (
            "upstream = \"http://x:1\"\n[defaults]\nlease = \"3x\"\n",
            "idem.toml:3: defaults.lease = \"3x\": not a duration",
        ),
        (
            "upstream = \"http://x:1\"\n[defaults]\nmax_request_body = \"1 parsec\"\n",
            "idem.toml:3: defaults.max_request_body = \"1 parsec\": unknown unit",
        ),
        (
            "upstream = \"http://x:1\"\n[defaults]\non_in_flight = \"queue\"\n",
            "idem.toml:3: defaults.on_in_flight = \"queue\": expected \"reject\" or \"wait\"",
        ),
        (
            "upstream = \"http://x:1\"\n[[route]]\nmethod = \"POST\"\npath = \"v1\"\n",
            "idem.toml:4: route[0].path = \"v1\": invalid path pattern",
        ),
        (
            "upstream = \"http://x:1\"\n[[route]]\nmethod = \"P OST\"\npath = \"/v1\"\n",
            "idem.toml:3: route[0].method = \"P OST\": not an HTTP method",
        ),
        (
            "upstream = \"http://x:1\"\n[[route]]\nmethod = \"PSOT\"\npath = \"/v1\"\n",
            "idem.toml:3: route[0].method = \"PSOT\": not an HTTP method (did you mean \"POST\"?)",
        ),
        (
            "upstream = \"http://x:1\"\n[[route]]\nmethod = \"FROBNICATE\"\npath = \"/v1\"\n",
            "idem.toml:3: route[0].method = \"FROBNICATE\": not an HTTP method",
        ),
        (
            "upstream = \"http://x:1\"\n[[route]]\nmethod = \"POST\"\npath = \"/v1/p\"\n[[route]]\nmethod = \"post\"\npath = \"/v1/p\"\n",
            "idem.toml:7: route[1].path = \"/v1/p\": this route is never chosen: route[0] (line 4, POST \"/v1/p\") comes first",
        ),
        (
            "upstream = \"http://x:1\"\n[[route]]\nmethod = \"POST\"\npath = \"/v1/{id}\"\n[[route]]\nmethod = \"POST\"\npath = \"/v1/refunds\"\n",
            "idem.toml:7: route[1].path = \"/v1/refunds\": this route is never chosen: route[0] (line 4, POST \"/v1/{id}\")",
        ),
        (
            "upstream = \"http://x:1\"\nlisten = \"localhost:99999\"\n",
            "idem.toml:2: listen = \"localhost:99999\": \"localhost:99999\" is not an address like 127.0.0.1:8080 or localhost:8080",
        ),
        (
            "upstream = \"http://x:1\"\n[[route]]\npath = \"/v1\"\n",
            "route[0] has no method",
        ),
        (
            "upstream = \"http://x:1\"\n[defaults]\nmismatch_status = 200\n",
            "idem.toml:3: defaults.mismatch_status = 200: must be a 4xx",
        ),
        (
            "upstream = \"ftp://x\"\n",
            "idem.toml:1: upstream = \"ftp://x\": the upstream must be an http:// or https:// URL",
        ),
        (
            "upstream = \"http://x:1\"\nlisten = \"localhost\"\n",
            "idem.toml:2: listen = \"localhost\": \"localhost\" is not an address",
        ),
        (
            "upstream = \"http://x:1\"\n[tenant]\nfrom = \"jwt\"\n",
            "idem.toml:3: tenant.from = \"jwt\": expected",
        ),
        (
            "upstream = \"http://x:1\"\n[defaults]\nlease = \"0s\"\n",
            "idem.toml:3: defaults.lease = \"0s\": must be greater than zero",
        ),
        (
            "upstream = \"http://x:1\"\n[[route]]\nmethod = \"POST\"\npath = \"/a\"\nupstream_timeout = \"1s\"\n",
            "upstream_timeout is set once",
        ),
        (
            "upstream = \"http://x:1\"\n[cleanup]\nbatch = 0\n",
            "idem.toml:3: cleanup.batch = 0: must be a whole number from 1 to 1000000",
        ),
        (
            "upstream = \"http://x:1\"\n[cleanup]\ninterval = \"soon\"\n",
            "idem.toml:3: cleanup.interval = \"soon\": not a duration",
        ),
        (
            "upstream = \"http://x:1\"\n[monitor]\nstuck_after_leases = -1\n",
            "idem.toml:3: monitor.stuck_after_leases = -1: must be a whole number",
        ),
        (
            "upstream = \"http://x:1\"\n[monitor]\ninterval = \"0s\"\n",
            "idem.toml:3: monitor.interval = \"0s\": must be greater than zero",
        ),
    ];
    for (text, expected) in cases {
        let err = from_text(text).expect_err(text).to_string();
        assert!(
            err.starts_with(expected) || err.contains(expected),
            "{text:?}\n got: {err}\nwant: {expected}"
        );
    }
}

/// The TLS keys of an `https://` upstream: refused with the line where
/// they cannot work (beside `http://`, a file that is not there or not
/// PEM, half an mTLS pair, an unknown protocol choice); taken where
/// they can, with the protocols offered by ALPN.
#[test]
fn upstream_tls_keys_are_checked_at_start() {
    let dir = tempfile::tempdir().expect("tempdir");
    let not_pem = dir.path().join("not.pem");
    std::fs::write(&not_pem, "hello\n").expect("write");
    let not_pem = not_pem.display();
    let cases = [
        (
            "upstream = \"http://x:1\"\nupstream_ca_file = \"/ca.pem\"\n".to_owned(),
            "idem.toml:2: upstream_ca_file = \"/ca.pem\": applies to an https:// upstream only",
        ),
        (
            "upstream = \"https://x:1\"\nupstream_ca_file = \"/nonexistent/ca.pem\"\n".to_owned(),
            "idem.toml:2: upstream_ca_file = \"/nonexistent/ca.pem\": cannot read it",
        ),
        (
            format!("upstream = \"https://x:1\"\nupstream_ca_file = \"{not_pem}\"\n"),
            "holds no PEM certificate",
        ),
        (
            format!("upstream = \"https://x:1\"\nupstream_client_cert = \"{not_pem}\"\n"),
            "needs upstream_client_key beside it",
        ),
        (
            "upstream = \"https://x:1\"\nupstream_http2 = \"always\"\n".to_owned(),
            "idem.toml:2: upstream_http2 = \"always\": must be \"auto\"",
        ),
        (
            "upstream = \"https://a..b:1\"\n".to_owned(),
            "is not a name a TLS certificate can be checked against",
        ),
        (
            "upstream = \"https://x:1\"\nupstream_http2 = \"prior_knowledge\"\n".to_owned(),
            "agrees on HTTP/2 by ALPN",
        ),
        (
            "upstream = \"http://x:1\"\nupstream_http2 = \"auto\"\n".to_owned(),
            "an http:// upstream takes \"prior_knowledge\"",
        ),
    ];
    for (text, expected) in cases {
        let err = from_text(&text).expect_err(&text).to_string();
        assert!(
            err.contains(expected),
            "{text:?}\n got: {err}\nwant: {expected}"
        );
    }
    let plain = from_text("upstream = \"http://x:1\"\n").expect("http");
    assert!(plain.upstream_tls.is_none());
    assert!(!plain.upstream_prior_knowledge);
    let h2c = from_text("upstream = \"http://x:1\"\nupstream_http2 = \"prior_knowledge\"\n")
        .expect("h2c");
    assert!(h2c.upstream_prior_knowledge);
    let tls = from_text("upstream = \"https://x\"\n").expect("https");
    let alpn = &tls.upstream_tls.expect("a TLS client").alpn_protocols;
    assert_eq!(alpn, &[b"h2".to_vec(), b"http/1.1".to_vec()]);
    let h1 = from_text("upstream = \"https://x\"\nupstream_http2 = \"never\"\n").expect("h1");
    let alpn = &h1.upstream_tls.expect("a TLS client").alpn_protocols;
    assert_eq!(alpn, &[b"http/1.1".to_vec()]);
}

/// `[telemetry]`: off unless an endpoint is named; refused with the
/// line where it cannot work.
#[test]
fn telemetry_is_off_by_default_and_checked_when_on() {
    let off = from_text("upstream = \"http://x:1\"\n").expect("no telemetry");
    assert!(off.telemetry.is_none());
    let on = from_text(
        "upstream = \"http://x:1\"\n[telemetry]\notlp_endpoint = \"http://collector:4318\"\nsample_ratio = 0.1\n",
    )
    .expect("telemetry");
    assert_eq!(
        on.telemetry,
        Some(TelemetrySettings {
            endpoint: "http://collector:4318/v1/traces".to_owned(),
            sample_ratio: 0.1,
            trace_keys: false,
            service_name: "idem".to_owned(),
        })
    );
    let path = from_text(
        "upstream = \"http://x:1\"\n[telemetry]\notlp_endpoint = \"https://c/otlp/traces\"\n",
    )
    .expect("a path is kept");
    assert_eq!(
        path.telemetry.map(|t| t.endpoint),
        Some("https://c/otlp/traces".to_owned())
    );
    for (text, expected) in [
        (
            "[telemetry]\nsample_ratio = 0.5\n",
            "telemetry.sample_ratio is set but telemetry.otlp_endpoint is not",
        ),
        (
            "[telemetry]\notlp_endpoint = \"grpc://c:4317\"\n",
            "idem.toml:3: telemetry.otlp_endpoint = \"grpc://c:4317\": must be an OTLP/HTTP URL",
        ),
        (
            "[telemetry]\notlp_endpoint = \"http://c\"\nsample_ratio = 1.5\n",
            "idem.toml:4: telemetry.sample_ratio = 1.5: must be from 0",
        ),
        (
            "[telemetry]\notlp_endpoint = \"http://c\"\nservice_name = \" \"\n",
            "telemetry.service_name = \" \": must not be empty",
        ),
        (
            "[telemetry]\nendpoint = \"http://c\"\n",
            "unknown field `endpoint`",
        ),
    ] {
        let text = format!("upstream = \"http://x:1\"\n{text}");
        let err = from_text(&text).expect_err(&text).to_string();
        assert!(
            err.contains(expected),
            "{text:?}\n got: {err}\nwant: {expected}"
        );
    }
}

#[test]
fn listen_takes_a_host_name_and_routes_any_case_of_a_registered_method() {
    let s = from_text(
        "upstream = \"http://x:1\"\nlisten = \"localhost:8080\"\n[[route]]\nmethod = \"propfind\"\npath = \"/dav/{f}\"\n[[route]]\nmethod = \"POST\"\npath = \"/v1/refunds\"\n[[route]]\nmethod = \"POST\"\npath = \"/v1/{id}\"\n",
    )
    .expect("valid");
    assert!(s.listen.ip().is_loopback(), "{}", s.listen);
    assert_eq!(s.listen.port(), 8080);
    let m = Method::from_bytes(b"PROPFIND").expect("method");
    assert!(s.routes.matching(&m, "/dav/x").is_some());
    // The specific route first, then the general one: both reachable.
    assert_eq!(
        s.routes
            .matching(&Method::POST, "/v1/refunds")
            .expect("route")
            .index,
        1
    );
    assert_eq!(
        s.routes
            .matching(&Method::POST, "/v1/7")
            .expect("route")
            .index,
        2
    );
}

#[test]
fn log_filters_are_levels_or_target_equals_level() {
    for good in [
        "info",
        "WARN",
        "warn,idem_http=debug",
        "idem=trace, hyper=off",
        "info,",
    ] {
        assert!(log_filter(good).is_ok(), "{good}");
    }
    for (bad, want) in [
        ("inf0", "\"inf0\" is not a level (did you mean \"info\"?)"),
        (
            "idem_http",
            "\"idem_http\" is not a level: write one of off, error, warn, info, debug, trace, or TARGET=LEVEL",
        ),
        (
            "info,idem=verbose",
            "\"idem=verbose\": \"verbose\" is not a level; write idem=LEVEL",
        ),
        (
            "warn,idem=debgu",
            "\"debgu\" is not a level (did you mean \"debug\"?)",
        ),
    ] {
        let err = log_filter(bad).expect_err(bad);
        assert!(err.to_string().contains(want), "{bad}: {err}");
    }
    // What tracing then does with them: spaces and empty directives do
    // not change the meaning; the NATS client is quiet unless named,
    // and never louder than the rest.
    use tracing::Level;
    let enables = |filter: &str, target: &str, level: Level| {
        log_filter(filter)
            .expect(filter)
            .would_enable(target, &level)
    };
    assert!(enables("idem_http=debug, warn", "hyper", Level::WARN));
    assert!(!enables("idem_http=debug, warn", "hyper", Level::INFO));
    assert!(enables("idem_http=debug, warn", "idem_http", Level::DEBUG));
    assert!(enables("info,", "idem", Level::INFO));
    assert!(!enables("info", "async_nats", Level::INFO));
    assert!(enables("info", "async_nats", Level::WARN));
    assert!(!enables("off", "async_nats", Level::WARN));
    assert!(!enables("error", "async_nats", Level::WARN));
    assert!(enables("info,async_nats=info", "async_nats", Level::INFO));
    assert!(!enables(
        "info,my_async_nats_shim=debug",
        "async_nats",
        Level::INFO
    ));
    for (word, hint) in [("PSOT", true), ("PURGE", false), ("PROPFNID", true)] {
        let said = super::values::did_you_mean(word, ["POST", "MERGE", "PROPFIND"]);
        assert_eq!(!said.is_empty(), hint, "{word}: {said}");
    }
}

#[test]
fn unknown_keys_are_refused_with_their_line() {
    let err = from_text("upstream = \"http://x:1\"\n[defaults]\nretension = \"1h\"\n")
        .expect_err("typo")
        .to_string();
    assert!(err.contains("line 3") && err.contains("retension"), "{err}");
    let err = from_text("upstream = \"http://x:1\"\ncolour = 1\n")
        .expect_err("unknown")
        .to_string();
    assert!(err.contains("colour"), "{err}");
}

#[test]
fn upstream_is_required_and_flags_win() {
    let err = from_text("").expect_err("no upstream").to_string();
    assert!(
        err.contains("--upstream") && err.contains("IDEM_UPSTREAM"),
        "{err}"
    );
    let parsed: FileConfig =
        toml::from_str("upstream = \"http://a:1\"\nlisten = \"127.0.0.1:1\"").expect("toml");
    let o = Overrides {
        upstream: Some("http://b:2".into()),
        listen: Some("127.0.0.1:2".into()),
        ..Overrides::default()
    };
    let s = build(
        parsed,
        &Source {
            file: Path::new("f"),
            text: "",
        },
        &o,
    )
    .expect("valid");
    assert_eq!(
        (s.upstream.to_string().as_str(), s.listen.port()),
        ("http://b:2/", 2)
    );
    let err = build(
        FileConfig::default(),
        &Source {
            file: Path::new("f"),
            text: "",
        },
        &Overrides {
            upstream: Some("nope".into()),
            ..Overrides::default()
        },
    )
    .expect_err("bad flag")
    .to_string();
    assert!(err.starts_with("--upstream / IDEM_UPSTREAM:"), "{err}");
}

#[test]
fn exposed_admin_needs_a_token() {
    let err = from_text("upstream = \"http://x:1\"\nadmin_listen = \"0.0.0.0:9090\"\n")
        .expect_err("no token")
        .to_string();
    assert!(err.contains("admin token"), "{err}");
    assert!(from_text("upstream = \"http://x:1\"\nadmin_listen = \"0.0.0.0:9090\"\nadmin_token = \"s3cret-0123456789abcdef0123456789ab\"\n").is_ok());
    // A guessable token is refused, wherever it comes from, unquoted.
    let short =
        from_text("upstream = \"http://x:1\"\nadmin_token = \"s3cret\"\n").expect_err("short");
    assert!(short.to_string().contains("at least 32"), "{short}");
    assert!(!short.to_string().contains("s3cret"), "{short}");
    let dir = tempfile::tempdir().expect("dir");
    let token_file = dir.path().join("admin-token");
    std::fs::write(&token_file, "t0ken-from-a-file-0123456789abcdef\n").expect("write");
    let from_file = from_text(&format!(
        "upstream = \"http://x:1\"\nadmin_token_file = {:?}\n",
        token_file.display().to_string()
    ))
    .expect("file");
    assert_eq!(
        from_file.admin_token.as_deref(),
        Some("t0ken-from-a-file-0123456789abcdef")
    );
    let both = from_text(&format!(
        "upstream = \"http://x:1\"\nadmin_token = \"x\"\nadmin_token_file = {:?}\n",
        token_file.display().to_string()
    ));
    assert!(both.expect_err("both").to_string().contains("not both"));
}

#[test]
fn background_jobs_default_on_and_follow_the_longest_lease() {
    let s = from_text("upstream = \"http://x:1\"\n").expect("valid");
    assert_eq!(
        s.cleanup,
        Some(CleanupSettings {
            interval: Duration::from_secs(60),
            batch: 1000
        })
    );
    assert_eq!(s.monitor, MonitorSettings::default());
    let s = from_text(
        "upstream = \"http://x:1\"\n[cleanup]\nenabled = false\n[monitor]\nstuck_after_leases = 2\n[[route]]\nmethod = \"POST\"\npath = \"/slow\"\nlease = \"2m\"\n",
    )
    .expect("valid");
    assert_eq!(s.cleanup, None);
    assert_eq!(s.monitor.stuck_after, Duration::from_secs(240));
}

#[test]
fn the_record_cache_defaults_on_and_can_be_sized_or_turned_off() {
    let s = from_text("upstream = \"http://x:1\"\n").expect("valid");
    assert_eq!(s.cache, Some(CacheSettings::default()));
    let s = from_text("upstream = \"http://x:1\"\n[cache]\nsize = \"4MiB\"\nmax_age = \"5s\"\n")
        .expect("valid");
    assert_eq!(
        s.cache,
        Some(CacheSettings {
            size: 4 << 20,
            max_age: Duration::from_secs(5)
        })
    );
    let s = from_text("upstream = \"http://x:1\"\n[cache]\nsize = \"0\"\n").expect("valid");
    assert_eq!(s.cache, None);
    for (text, needle) in [
        (
            "[cache]\nsize = \"lots\"\n",
            "idem.toml:3: cache.size = \"lots\"",
        ),
        (
            "[cache]\nmax_age = \"0s\"\n",
            "idem.toml:3: cache.max_age = \"0s\": must be greater than zero",
        ),
        ("[cache]\nttl = \"1s\"\n", "unknown field `ttl`"),
    ] {
        let err = from_text(&format!("upstream = \"http://x:1\"\n{text}")).expect_err(text);
        assert!(err.message().contains(needle), "{text}: {}", err.message());
    }
}

#[test]
fn limits_default_sane_and_refuse_nonsense() {
    let s = from_text("upstream = \"http://x:1\"\n").expect("valid");
    assert_eq!(s.limits, LimitsSettings::default());
    assert_eq!(s.workers, default_workers());
    assert!(s.workers >= 1);
    let s = from_text("upstream = \"http://x:1\"\nworkers = 3\n").expect("valid");
    assert_eq!(s.workers, 3);
    let s = from_text("upstream = \"http://x:1\"\nworkers = 0\n").expect("valid");
    assert_eq!(s.workers, 0);
    let s = from_text(
        "upstream = \"http://x:1\"\n[limits]\nmax_connections = 100\nmax_in_flight = 8\nqueue_wait = \"0s\"\nheader_read_timeout = \"2s\"\nbody_read_timeout = \"3s\"\nbody_total_timeout = \"0s\"\nmax_headers = 20\nmax_header_bytes = \"16KiB\"\n",
    )
    .expect("valid");
    assert_eq!(
        s.limits,
        LimitsSettings {
            max_connections: 100,
            max_in_flight: 8,
            max_connections_per_peer: 50,
            max_in_flight_per_peer: 4,
            max_bodies: 16,
            max_bodies_per_peer: 4,
            queue_wait: Duration::ZERO,
            header_read_timeout: Duration::from_secs(2),
            body_read_timeout: Duration::from_secs(3),
            body_total_timeout: Duration::ZERO,
            idle_timeout: Duration::from_secs(30),
            max_headers: 20,
            max_header_bytes: 16 << 10,
        }
    );
    for (text, needle) in [
        (
            "[limits]\nmax_in_flight = 0\n",
            "idem.toml:3: limits.max_in_flight = 0: must be a whole number from 1 to 1000000",
        ),
        (
            "[limits]\nmax_connections = -5\n",
            "idem.toml:3: limits.max_connections = -5",
        ),
        (
            "[limits]\nheader_read_timeout = \"-1s\"\n",
            "limits.header_read_timeout = \"-1s\"",
        ),
        (
            "[limits]\nbody_read_timeout = \"soon\"\n",
            "limits.body_read_timeout = \"soon\"",
        ),
        (
            "[limits]\nmax_header_bytes = \"1KiB\"\n",
            "limits.max_header_bytes = \"1KiB\": must be from 8KiB to 16MiB",
        ),
        ("[limits]\nmax_body = 5\n", "unknown field `max_body`"),
        (
            "workers = -1\n",
            "idem.toml:2: workers = -1: must be a whole number from 0 (serve on the shared runtime) to 1024",
        ),
        ("workers = \"many\"\n", "line 2, column 11"),
    ] {
        let err = from_text(&format!("upstream = \"http://x:1\"\n{text}")).expect_err(text);
        assert!(err.message().contains(needle), "{text}: {}", err.message());
    }
}

#[test]
fn sizes() {
    assert_eq!(parse_size("1MiB"), Ok(1 << 20));
    assert_eq!(parse_size("64 KiB"), Ok(64 << 10));
    assert_eq!(parse_size("10MB"), Ok(10_000_000));
    assert_eq!(parse_size("512"), Ok(512));
    assert!(parse_size("MiB").is_err());
    assert!(parse_size("1.5MiB").is_err());
    assert!(parse_size("99999999999999GiB").is_err());
}

/// A route takes its profile, then changes one switch; `[defaults]`'
/// profile is what routes inherit.
#[test]
fn profiles_and_their_switches() {
    let s = from_text(
        r#"
upstream = "http://127.0.0.1:1"
[defaults]
profile = "ietf"
[[route]]
method = "POST"
path = "/a"
[[route]]
method = "POST"
path = "/b"
profile = "stripe"
not_retained = "empty"
on_server_error = "hold"
key_format = "ulid"
key_min_length = 26
[[route]]
method = "POST"
path = "/c"
replay_header = ["Idempotent-Replayed", "Idempotency-Replayed"]
held_retry_after = "none"
retention_header = false
"#,
    )
    .expect("valid");
    let policy = |path: &str| {
        s.routes
            .matching(&Method::POST, path)
            .expect("route")
            .policy
            .clone()
    };
    let a = policy("/a");
    assert_eq!(
        a.contract,
        idem_http::Contract::of(idem_http::Profile::Ietf)
    );
    let b = policy("/b");
    assert_eq!(b.contract.not_retained, idem_http::NotRetained::Empty);
    assert_eq!(
        b.contract.replay_headers,
        vec![idem_http::IDEMPOTENT_REPLAYED]
    );
    assert_eq!(b.contract.held_retry_after, None);
    assert_eq!(b.contract.key_format, Some(idem_http::KeyFormat::Ulid));
    assert_eq!(b.contract.key_min_length, 26);
    assert_eq!(b.engine.on_server_error, idem::ServerError::Hold);
    let c = policy("/c");
    assert_eq!(c.contract.replay_headers.len(), 2);
    assert_eq!(c.contract.held_retry_after, None);
    assert!(!c.contract.retention_header);
    assert_eq!(a.engine.on_server_error, idem::ServerError::Store);
}

#[test]
fn bad_contract_keys_are_refused_with_their_line() {
    let route = |body: &str| {
        format!(
            "upstream = \"http://127.0.0.1:1\"\n[[route]]\nmethod = \"POST\"\npath = \"/a\"\n{body}\n"
        )
    };
    for (body, why) in [
        ("profile = \"IETF\"", "expected \"stripe\" or \"ietf\""),
        ("replay_header = \"X-Replayed\"", "not a replay marker"),
        ("replay_header = []", "a replay is always marked"),
        (
            "not_retained = \"drop\"",
            "expected \"problem\" or \"empty\"",
        ),
        ("held_retry_after = \"0s\"", "greater than zero"),
        (
            "on_server_error = \"retry\"",
            "expected \"store\", \"hold\" or \"release\"",
        ),
        ("key_format = \"(\"", "regular expression"),
        ("key_min_length = 0", "must be 1 to 255"),
        ("key_min_length = 256", "must be 1 to 255"),
    ] {
        let err = from_text(&route(body)).expect_err(body).to_string();
        assert!(err.contains(why), "{body}: {err}");
        assert!(err.contains("idem.toml:5"), "{body}: {err}");
    }
}

#[test]
fn the_contract_path_is_a_plain_path_no_route_takes() {
    let with = |path: &str, routes: &str| {
        from_text(&format!(
            "upstream = \"http://127.0.0.1:1\"\ncontract_path = \"{path}\"\n{routes}"
        ))
    };
    assert_eq!(
        with("/.well-known/idempotency", "")
            .expect("valid")
            .contract_path
            .as_deref(),
        Some("/.well-known/idempotency")
    );
    assert_eq!(
        from_text("upstream = \"http://127.0.0.1:1\"")
            .expect("valid")
            .contract_path,
        None
    );
    for bad in ["well-known", "/a/../b", "/a?x=1", "/a//b"] {
        let err = with(bad, "").expect_err(bad).to_string();
        assert!(err.contains("normal form"), "{bad}: {err}");
    }
    let taken = with(
        "/v1/contract",
        "[[route]]\nmethod = \"GET\"\npath = \"/v1/{any}\"",
    )
    .expect_err("a route protects it")
    .to_string();
    assert!(
        taken.contains("GET /v1/{any} protects this path"),
        "{taken}"
    );
}

#[test]
fn webhook_routes_take_their_sender_secrets_and_policy() {
    let dir = tempfile::tempdir().expect("dir");
    let secrets = dir.path().join("stripe.secrets");
    std::fs::write(
        &secrets,
        "# new, then old\nwhsec_new_secret_of_32_bytes_long\nwhsec_old_secret_of_32_bytes_long\n",
    )
    .expect("write");
    let route = |webhook: &str, extra: &str| {
        format!(
            "upstream = \"http://127.0.0.1:1\"\n[defaults]\nretention = \"1h\"\n[[route]]\nmethod = \"POST\"\npath = \"/hooks\"\n{extra}\n[route.webhook]\n{webhook}\n"
        )
    };
    let file = format!("secrets_file = {:?}", secrets.display().to_string());
    let s = from_text(&route(&format!("provider = \"stripe\"\n{file}"), "")).expect("ok");
    let m = s.routes.matching(&Method::POST, "/hooks").expect("route");
    let hook = m.policy.webhook.as_ref().expect("a webhook route");
    assert_eq!(hook.secrets().len(), 2);
    assert_eq!(hook.tenant(), "webhook:stripe");
    assert_eq!(hook.tolerance(), Duration::from_secs(300));
    // The provider's retry window, over [defaults]; a receiver's 5xx frees
    // the delivery for the provider's retry, a 502 stays held.
    assert_eq!(m.policy.engine.retention, Duration::from_secs(3 * 86400));
    assert_eq!(
        m.policy.engine.resolution_for(500),
        idem::Resolution::Release
    );
    assert_eq!(
        m.policy.engine.resolution_for(502),
        idem::Resolution::Unknown
    );
    assert!(m.policy.key_headers.is_empty() && m.policy.require_key);
    // The route's own keys win.
    let s = from_text(&route(
        &format!("provider = \"github\"\n{file}\nsender = \"gh-org\""),
        "retention = \"10d\"\non_server_error = \"hold\"",
    ))
    .expect("ok");
    let m = s.routes.matching(&Method::POST, "/hooks").expect("route");
    assert_eq!(m.policy.engine.retention, Duration::from_secs(10 * 86400));
    assert_eq!(
        m.policy.engine.resolution_for(500),
        idem::Resolution::Unknown
    );
    assert_eq!(
        m.policy.webhook.as_ref().expect("hook").tenant(),
        "webhook:gh-org"
    );
    // A generic sender, described key by key.
    let slack = format!(
        "provider = \"hmac\"\n{file}\nsignature_header = \"X-Slack-Signature\"\nsignature_prefix = \"v0=\"\nsigned = \"v0:{{timestamp}}:{{body}}\"\ntimestamp_header = \"X-Slack-Request-Timestamp\"\nid_field = \"/event_id\"\ntolerance = \"2m\""
    );
    let s = from_text(&route(&slack, "")).expect("ok");
    let m = s.routes.matching(&Method::POST, "/hooks").expect("route");
    let hook = m.policy.webhook.as_ref().expect("hook");
    assert!(hook.scheme().has_timestamp());
    assert_eq!(hook.tolerance(), Duration::from_secs(120));
}

#[test]
fn webhook_routes_refuse_what_cannot_be_right() {
    let dir = tempfile::tempdir().expect("dir");
    let secrets = dir.path().join("s.secrets");
    std::fs::write(&secrets, "a-secret-of-more-than-16-bytes\n").expect("write");
    let empty = dir.path().join("empty.secrets");
    std::fs::write(&empty, "# nothing yet\n").expect("write");
    let file = format!("secrets_file = {:?}", secrets.display().to_string());
    let cases = [
        (
            "method = \"GET\"",
            format!("provider = \"github\"\n{file}"),
            "takes POST",
        ),
        (
            "method = \"POST\"\nkey_header = \"X-Id\"",
            format!("provider = \"github\"\n{file}"),
            "remove key_header",
        ),
        (
            "method = \"POST\"\nrequire_key = false",
            format!("provider = \"github\"\n{file}"),
            "remove require_key",
        ),
        ("method = \"POST\"", file.clone(), "has no provider"),
        (
            "method = \"POST\"",
            format!("provider = \"svix\"\n{file}"),
            "expected \"standard\"",
        ),
        (
            "method = \"POST\"",
            "provider = \"github\"".to_owned(),
            "needs its signing secrets",
        ),
        (
            "method = \"POST\"",
            format!(
                "provider = \"github\"\nsecrets_file = {:?}",
                empty.display().to_string()
            ),
            "holds no secret",
        ),
        (
            "method = \"POST\"",
            format!("provider = \"github\"\n{file}\nsecrets_env = \"X\""),
            "not both",
        ),
        (
            "method = \"POST\"",
            "provider = \"github\"\nsecrets_env = \"IDEM_TEST_UNSET_WEBHOOK_SECRETS\"".to_owned(),
            "is not set",
        ),
        (
            "method = \"POST\"",
            format!("provider = \"standard\"\n{file}"),
            "does not decode",
        ),
        (
            "method = \"POST\"",
            format!("provider = \"github\"\n{file}\nsignature_header = \"X-Sig\""),
            "only provider = \"hmac\"",
        ),
        (
            "method = \"POST\"",
            format!("provider = \"github\"\n{file}\ntolerance = \"1m\""),
            "no signed timestamp",
        ),
        (
            "method = \"POST\"",
            format!("provider = \"github\"\n{file}\nsender = \"a b\""),
            "letters, digits",
        ),
        (
            "method = \"POST\"",
            format!("provider = \"hmac\"\n{file}\nid_header = \"X-Id\""),
            "needs signature_header",
        ),
        (
            "method = \"POST\"",
            format!("provider = \"hmac\"\n{file}\nsignature_header = \"X-Sig\""),
            "needs id_header",
        ),
        (
            "method = \"POST\"",
            format!(
                "provider = \"hmac\"\n{file}\nsignature_header = \"X-Sig\"\nid_field = \"/id\"\nsigned = \"{{id}}.{{body}}\""
            ),
            "only when the id is in a header",
        ),
        (
            "method = \"POST\"",
            format!(
                "provider = \"hmac\"\n{file}\nsignature_header = \"X-Sig\"\nid_header = \"X-Id\"\ntimestamp_header = \"X-Ts\""
            ),
            "not signed",
        ),
        (
            "method = \"POST\"",
            format!(
                "provider = \"hmac\"\n{file}\nsignature_header = \"X-Sig\"\nid_header = \"X-Id\"\nsignature_encoding = \"base32\""
            ),
            "expected \"hex\"",
        ),
    ];
    for (route, webhook, why) in cases {
        let text = format!(
            "upstream = \"http://127.0.0.1:1\"\n[[route]]\n{route}\npath = \"/hooks\"\n[route.webhook]\n{webhook}\n"
        );
        let err = from_text(&text).expect_err(&text).to_string();
        assert!(err.contains(why), "{text}\n→ {err}");
        assert!(
            !err.contains("a-secret-of"),
            "an error quotes a secret: {err}"
        );
    }
    let text = format!(
        "upstream = \"http://127.0.0.1:1\"\n[defaults.webhook]\nprovider = \"github\"\n{file}\n"
    );
    let err = from_text(&text).expect_err("defaults").to_string();
    assert!(err.contains("belongs to one route"), "{err}");
}

#[test]
fn json_rpc_routes_name_the_calls_they_protect() {
    let text = r#"
upstream = "http://127.0.0.1:1"
[[route]]
method = "POST"
path = "/mcp"
protocol = "jsonrpc"
[[route.call]]
method = "tools/call"
tools_except = ["search"]
key_field = ["/params/_meta/idempotencyKey", "/params/arguments/idempotency_key"]
require_key = true
[[route.call]]
method = "message/send"
key_header = "Idempotency-Key"
"#;
    let s = from_text(text).expect("ok");
    let m = s.routes.matching(&Method::POST, "/mcp").expect("route");
    let rpc = m.policy.jsonrpc.as_ref().expect("a JSON-RPC route");
    assert_eq!(rpc.rules().len(), 2);
    assert_eq!(rpc.rules()[0].key_pointers.len(), 2);
    assert!(rpc.rules()[0].require_key && !rpc.rules()[1].require_key);
    assert!(m.policy.key_headers.is_empty());
    // An internal error does not prove the tool did not run: held.
    assert_eq!(
        m.policy.engine.resolution_for(500),
        idem::Resolution::Unknown
    );
    assert!(
        m.policy
            .unstored_headers
            .contains(&HeaderName::from_static("mcp-session-id"))
    );
    let route = |route: &str, calls: &str| {
        format!("upstream = \"http://127.0.0.1:1\"\n[[route]]\npath = \"/rpc\"\n{route}\n{calls}")
    };
    let call = "[[route.call]]\nmethod = \"tools/call\"";
    for (text, why) in [
        (
            route("method = \"POST\"\nprotocol = \"soap\"", call),
            "expected \"http\"",
        ),
        (
            route("method = \"PUT\"\nprotocol = \"jsonrpc\"", call),
            "takes POST",
        ),
        (
            route("method = \"POST\"\nprotocol = \"jsonrpc\"", ""),
            "name at least one",
        ),
        (
            route("method = \"POST\"", call),
            "write protocol = \"jsonrpc\"",
        ),
        (
            route(
                "method = \"POST\"\nprotocol = \"jsonrpc\"\nkey_header = \"X-Id\"",
                call,
            ),
            "remove key_header",
        ),
        (
            route(
                "method = \"POST\"\nprotocol = \"jsonrpc\"",
                "[[route.call]]\nrequire_key = true",
            ),
            "has no method",
        ),
        (
            route(
                "method = \"POST\"\nprotocol = \"jsonrpc\"",
                "[[route.call]]\nmethod = \"x\"\ntools = [\"a\"]",
            ),
            "only method = \"tools/call\"",
        ),
        (
            route(
                "method = \"POST\"\nprotocol = \"jsonrpc\"",
                &format!("{call}\ntools = [\"a\"]\ntools_except = [\"b\"]"),
            ),
            "not both",
        ),
        (
            route(
                "method = \"POST\"\nprotocol = \"jsonrpc\"",
                &format!("{call}\nkey_header = \"Authorization\""),
            ),
            "carries a credential",
        ),
        (
            route(
                "method = \"POST\"\nprotocol = \"jsonrpc\"",
                &format!("{call}\nkey_field = \"params\""),
            ),
            "starts with '/'",
        ),
        (
            route(
                "method = \"POST\"\nprotocol = \"jsonrpc\"",
                &format!("{call}\nkey_header = []\nkey_field = []"),
            ),
            "name a header or a field",
        ),
    ] {
        let err = from_text(&text).expect_err(&text).to_string();
        assert!(err.contains(why), "{text}\n→ {err}");
    }
}

#[test]
fn graphql_routes_read_their_keys_where_the_route_says() {
    let text = r#"
upstream = "http://127.0.0.1:1"
[[route]]
method = "POST"
path = "/graphql"
protocol = "graphql"
key_from = "/variables/idempotencyKey"
require_key = true
"#;
    let s = from_text(text).expect("ok");
    let m = s.routes.matching(&Method::POST, "/graphql").expect("route");
    let gql = m.policy.graphql.as_ref().expect("a GraphQL route");
    assert_eq!(
        gql.key_headers,
        [HeaderName::from_static("idempotency-key")]
    );
    assert_eq!(gql.key_pointers.len(), 1);
    assert!(gql.require_key);
    // The route itself reads no key: its requests are judged in the body.
    assert!(m.policy.key_headers.is_empty() && m.policy.key_from.is_none());
    assert!(!m.policy.require_key);
    // An error after execution began does not prove nothing ran: held.
    assert_eq!(
        m.policy.engine.resolution_for(500),
        idem::Resolution::Unknown
    );
    let route = |keys: &str| {
        format!("upstream = \"http://127.0.0.1:1\"\n[[route]]\npath = \"/graphql\"\n{keys}")
    };
    for (text, why) in [
        (
            route("method = \"GET\"\nprotocol = \"graphql\""),
            "takes POST",
        ),
        (
            route(
                "method = \"POST\"\nprotocol = \"graphql\"\nfingerprint_include = [\"/variables\"]",
            ),
            "remove fingerprint_include",
        ),
        (
            route("method = \"POST\"\nprotocol = \"graphql\"\nkey_from = \"variables\""),
            "starts with '/'",
        ),
        (
            route(
                "method = \"POST\"\nprotocol = \"graphql\"\nkey_header = \"Authorization\"\n[tenant]\nfrom = \"header\"\nname = \"authorization\"",
            ),
            "carries a credential",
        ),
        (
            route("method = \"POST\"\nprotocol = \"graphql\"\n[[route.call]]\nmethod = \"x\""),
            "write protocol = \"jsonrpc\"",
        ),
    ] {
        let err = from_text(&text).expect_err(&text).to_string();
        assert!(err.contains(why), "{text}\n→ {err}");
    }
}

#[test]
fn grpc_routes_take_post_and_hold_what_does_not_prove_nothing_ran() {
    let text = "upstream = \"http://127.0.0.1:1\"\n[[route]]\nmethod = \"POST\"\npath = \"/pay.Payments/{method}\"\nprotocol = \"grpc\"\n";
    let s = from_text(text).expect("ok");
    let m = s
        .routes
        .matching(&Method::POST, "/pay.Payments/Create")
        .expect("route");
    // UNKNOWN and INTERNAL count as 500: held; UNAVAILABLE as 503: released.
    assert_eq!(
        m.policy.engine.resolution_for(500),
        idem::Resolution::Unknown
    );
    assert_eq!(
        m.policy.engine.resolution_for(503),
        idem::Resolution::Release
    );
    assert_eq!(
        m.policy.key_headers,
        [HeaderName::from_static("idempotency-key")]
    );
    for (route, why) in [
        (
            "method = \"GET\"\nprotocol = \"grpc\"",
            "a gRPC route takes POST",
        ),
        (
            "method = \"POST\"\nprotocol = \"grpc\"\nkey_from = \"/id\"",
            "remove key_from",
        ),
    ] {
        let text =
            format!("upstream = \"http://127.0.0.1:1\"\n[[route]]\npath = \"/p.S/M\"\n{route}\n");
        let err = from_text(&text).expect_err(&text).to_string();
        assert!(err.contains(why), "{text}\n→ {err}");
    }
}
