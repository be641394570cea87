use http::{HeaderMap, HeaderValue};

use super::*;

const CREATE: &str = "mutation Create($order: String!, $cents: Int!, $idempotencyKey: String) { createPayment(order: $order, cents: $cents, idempotencyKey: $idempotencyKey) { id ...Sums } } fragment Sums on Payment { cents run }";

fn route() -> GraphQl {
    GraphQl::new().with_key_pointers(vec![
        "/variables/idempotencyKey".parse().expect("pointer"),
        "/extensions/idempotencyKey".parse().expect("pointer"),
    ])
}

fn body(query: &str, name: Option<&str>, variables: serde_json::Value) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({
        "query": query, "operationName": name, "variables": variables
    }))
    .expect("json")
}

fn keyed(key: &str) -> HeaderMap {
    let mut h = HeaderMap::new();
    h.insert("idempotency-key", HeaderValue::from_str(key).expect("key"));
    h
}

fn protect(judged: Judged) -> Operation {
    match judged {
        Judged::Protect(op) => op,
        other => panic!("expected Protect, got {other:?}"),
    }
}

fn refused(judged: Judged) -> Problem {
    match judged {
        Judged::Refuse(p) => p,
        other => panic!("expected Refuse, got {other:?}"),
    }
}

#[test]
fn a_mutation_is_protected_by_its_header_key_and_named_operation() {
    let vars = serde_json::json!({"order": "o-1", "cents": 500});
    let op = protect(route().judge(&keyed("k-1"), None, &body(CREATE, None, vars)));
    assert_eq!(op.key.as_str(), "k-1");
    assert_eq!(op.operation, "mutation Create");
}

#[test]
fn queries_and_subscriptions_pass_even_with_a_key() {
    for query in [
        "{ payments }",
        "query Look { payments }",
        "subscription Watch { paid { id } }",
    ] {
        assert_eq!(
            route().judge(
                &keyed("k-1"),
                None,
                &body(query, None, serde_json::json!({}))
            ),
            Judged::Pass,
            "{query}"
        );
    }
}

#[test]
fn whitespace_comments_commas_and_variable_order_are_the_same_request() {
    let a = protect(route().judge(
        &keyed("k"),
        None,
        &body(
            CREATE,
            Some("Create"),
            serde_json::json!({"order": "o", "cents": 1}),
        ),
    ));
    let spaced = format!(
        "# a comment\n\n{}\n",
        CREATE.replace(", ", " ,\n  ").replace('{', "{ # brace\n")
    );
    // Variables reordered in the bytes sent.
    let reordered = format!(
        r#"{{"variables":{{"cents":1,"order":"o"}},"operationName":"Create","query":{}}}"#,
        serde_json::to_string(&spaced).expect("string")
    );
    let b = protect(route().judge(&keyed("k"), None, reordered.as_bytes()));
    assert_eq!(a, b);
}

#[test]
fn the_fingerprint_changes_with_what_the_mutation_means() {
    let fp = |query: &str, vars: serde_json::Value| {
        protect(route().judge(&keyed("k"), None, &body(query, None, vars))).fingerprinted
    };
    let base = fp(CREATE, serde_json::json!({"order": "o", "cents": 1}));
    assert_ne!(
        base,
        fp(CREATE, serde_json::json!({"order": "o", "cents": 2}))
    );
    assert_ne!(
        base,
        fp(
            &CREATE.replace("id ...Sums", "id order ...Sums"),
            serde_json::json!({"order": "o", "cents": 1})
        )
    );
    // A fragment the operation spreads is part of it.
    assert_ne!(
        base,
        fp(
            &CREATE.replace("cents run }", "cents }"),
            serde_json::json!({"order": "o", "cents": 1})
        )
    );
}

#[test]
fn the_selected_operation_decides_and_other_definitions_are_left_out() {
    let doc = format!("query Look($order: String!) {{ payment(order: $order) {{ id }} }} {CREATE}");
    let vars = serde_json::json!({"order": "o", "cents": 1});
    assert_eq!(
        route().judge(&keyed("k"), None, &body(&doc, Some("Look"), vars.clone())),
        Judged::Pass
    );
    let both = protect(route().judge(&keyed("k"), None, &body(&doc, Some("Create"), vars.clone())));
    let alone = protect(route().judge(&keyed("k"), None, &body(CREATE, Some("Create"), vars)));
    assert_eq!(both.fingerprinted, alone.fingerprinted);
    assert_eq!(both.operation, "mutation Create");
}

#[test]
fn a_key_in_a_variable_is_not_part_of_the_fingerprint() {
    let a = protect(route().judge(
        &HeaderMap::new(),
        None,
        &body(
            CREATE,
            None,
            serde_json::json!({"order": "o", "cents": 1, "idempotencyKey": "k-9"}),
        ),
    ));
    assert_eq!(a.key.as_str(), "k-9");
    let b = protect(route().judge(
        &keyed("k-9"),
        None,
        &body(CREATE, None, serde_json::json!({"order": "o", "cents": 1})),
    ));
    assert_eq!(a.fingerprinted, b.fingerprinted);
    let ext = serde_json::json!({"query": CREATE, "variables": {"order": "o", "cents": 1},
        "extensions": {"idempotencyKey": "k-9"}});
    let c = protect(route().judge(
        &HeaderMap::new(),
        None,
        &serde_json::to_vec(&ext).expect("json"),
    ));
    assert_eq!(c, a);
}

#[test]
fn a_mutation_without_a_key_passes_unless_one_is_required() {
    let req = body(CREATE, None, serde_json::json!({"order": "o", "cents": 1}));
    assert_eq!(route().judge(&HeaderMap::new(), None, &req), Judged::Pass);
    let p = refused(
        route()
            .with_require_key(true)
            .judge(&HeaderMap::new(), None, &req),
    );
    assert_eq!(p.kind(), Some(ProblemKind::KeyMissing));
    assert!(p.detail().contains("/variables/idempotencyKey"), "{p:?}");
    // A query never needs one.
    let look = body("{ payments }", None, serde_json::json!({}));
    assert_eq!(
        route()
            .with_require_key(true)
            .judge(&HeaderMap::new(), None, &look),
        Judged::Pass
    );
    // A key of the wrong type is refused, not ignored.
    let bad = body(
        CREATE,
        None,
        serde_json::json!({"idempotencyKey": {"a": 1}}),
    );
    assert_eq!(
        refused(route().judge(&HeaderMap::new(), None, &bad)).kind(),
        Some(ProblemKind::KeyInvalid)
    );
}

#[test]
fn what_cannot_be_judged_is_refused() {
    let cases: Vec<(Vec<u8>, &str)> = vec![
        (b"query=mutation".to_vec(), "JSON request"),
        (b"[]".to_vec(), "empty batch"),
        (b"\"x\"".to_vec(), "JSON object"),
        (br#"{"query": 7}"#.to_vec(), "query is a string"),
        (
            br#"{"query": "{ a }", "variables": [1]}"#.to_vec(),
            "variables is an object",
        ),
        (
            br#"{"query": "{ a }", "operationName": 1}"#.to_vec(),
            "operationName is a string",
        ),
        (br#"{"variables": {}}"#.to_vec(), "no query"),
        (
            body("mutation { a ", None, serde_json::json!({})),
            "does not parse",
        ),
        (
            body(
                "mutation A { a } mutation B { b }",
                None,
                serde_json::json!({}),
            ),
            "several operations",
        ),
        (
            body(CREATE, Some("Other"), serde_json::json!({})),
            "no operation named",
        ),
        (
            body("type Payment { id: ID }", None, serde_json::json!({})),
            "defines types",
        ),
        (
            br#"{"query": "{ a }", "extensions": {"persistedQuery": {"sha256Hash": "zz"}}}"#
                .to_vec(),
            "64 hex",
        ),
    ];
    for (req, why) in cases {
        let p = refused(route().judge(&keyed("k"), None, &req));
        assert_eq!(
            p.kind(),
            Some(ProblemKind::GraphQlRequestInvalid),
            "{why}: {p:?}"
        );
        assert!(p.detail().contains(why), "{why}: {}", p.detail());
    }
    let twice = br#"{"query": "{ a }", "query": "mutation { b }"}"#;
    assert_eq!(
        refused(route().judge(&keyed("k"), None, twice)).kind(),
        Some(ProblemKind::BodyAmbiguous)
    );
}

#[test]
fn a_document_too_deep_or_too_long_is_refused() {
    let deep = format!("mutation {{ {}x{} }}", "a { ".repeat(300), " }".repeat(300));
    let p = refused(route().judge(&keyed("k"), None, &body(&deep, None, serde_json::json!({}))));
    assert_eq!(p.kind(), Some(ProblemKind::GraphQlRequestInvalid), "{p:?}");
    let long = format!("mutation {{ {} }}", "a ".repeat(60_000));
    let p = refused(route().judge(&keyed("k"), None, &body(&long, None, serde_json::json!({}))));
    assert_eq!(p.kind(), Some(ProblemKind::GraphQlRequestInvalid), "{p:?}");
}

#[test]
fn a_batch_holding_a_mutation_is_refused_and_one_of_queries_passes() {
    let m = serde_json::json!({"query": CREATE, "variables": {"order": "o", "cents": 1}});
    let q = serde_json::json!({"query": "{ payments }"});
    let batch = serde_json::to_vec(&serde_json::json!([q, m])).expect("json");
    assert_eq!(
        refused(route().judge(&keyed("k"), None, &batch)).kind(),
        Some(ProblemKind::GraphQlBatchRefused)
    );
    let reads = serde_json::to_vec(&serde_json::json!([q, q])).expect("json");
    assert_eq!(route().judge(&keyed("k"), None, &reads), Judged::Pass);
}

#[test]
fn a_persisted_query_is_judged_by_its_hash_with_or_without_its_document() {
    let hash = hex::encode(Sha256::digest(CREATE));
    let ext = serde_json::json!({"persistedQuery": {"version": 1, "sha256Hash": hash}});
    let vars = serde_json::json!({"order": "o", "cents": 1});
    let hash_only =
        serde_json::json!({"operationName": "Create", "variables": vars, "extensions": ext});
    let with_doc = serde_json::json!({"operationName": "Create", "variables": vars, "extensions": ext, "query": CREATE});
    let a = protect(route().judge(
        &keyed("k"),
        None,
        &serde_json::to_vec(&hash_only).expect("json"),
    ));
    let b = protect(route().judge(
        &keyed("k"),
        None,
        &serde_json::to_vec(&with_doc).expect("json"),
    ));
    assert_eq!(a, b);
    assert_eq!(a.operation, "persisted Create");
    // Its document shows a query: it passes.
    let look_hash = hex::encode(Sha256::digest("{ payments }"));
    let look = serde_json::json!({"query": "{ payments }",
        "extensions": {"persistedQuery": {"version": 1, "sha256Hash": look_hash}}});
    assert_eq!(
        route().judge(&keyed("k"), None, &serde_json::to_vec(&look).expect("json")),
        Judged::Pass
    );
    // Without its document and without a key, it passes; a route that
    // requires keys refuses it, since its type cannot be judged.
    let bytes = serde_json::to_vec(&hash_only).expect("json");
    assert_eq!(route().judge(&HeaderMap::new(), None, &bytes), Judged::Pass);
    let p = refused(
        route()
            .with_require_key(true)
            .judge(&HeaderMap::new(), None, &bytes),
    );
    assert_eq!(p.kind(), Some(ProblemKind::KeyMissing));
    // A document the hash does not name is judged by the document.
    let lying = serde_json::json!({"operationName": "Create", "variables": vars,
        "extensions": {"persistedQuery": {"version": 1, "sha256Hash": look_hash}}, "query": CREATE});
    let c = protect(route().judge(
        &keyed("k"),
        None,
        &serde_json::to_vec(&lying).expect("json"),
    ));
    assert_eq!(c.operation, "mutation Create");
    assert_ne!(c.fingerprinted, a.fingerprinted);
}

#[test]
fn a_bare_document_is_judged_as_one() {
    let op = protect(route().judge(
        &keyed("k"),
        Some("application/graphql; charset=utf-8"),
        b"mutation { createPayment(order: \"o\", cents: 1) { id } }",
    ));
    assert_eq!(op.operation, "mutation");
    assert_eq!(
        route().judge(&keyed("k"), Some("application/graphql"), b"{ payments }"),
        Judged::Pass
    );
}

#[test]
fn answers_say_whether_the_mutation_ran() {
    assert_eq!(
        classify(br#"{"data":{"createPayment":{"id":"1"}}}"#),
        Outcome::Ran
    );
    assert_eq!(
        classify(br#"{"errors":[{"message":"partial","path":["a"]}],"data":{"a":null,"b":1}}"#),
        Outcome::Ran
    );
    assert_eq!(
        classify(br#"{"errors":[{"message":"Cannot query field"}]}"#),
        Outcome::NotRun
    );
    assert_eq!(
        classify(br#"{"errors":[{"message":"PersistedQueryNotFound"}]}"#),
        Outcome::NotRun
    );
    // As some servers write a request error: `data: null`, no path.
    assert_eq!(
        classify(br#"{"data":null,"errors":[{"message":"Cannot query field","locations":[{"line":1,"column":7}]}]}"#),
        Outcome::NotRun
    );
    assert_eq!(
        classify(br#"{"errors":[{"message":"boom","path":["createPayment"]}],"data":null}"#),
        Outcome::Failed
    );
    assert_eq!(classify(b"not json, \"errors\""), Outcome::Ran);
    assert_eq!(classify(br#"{"errors":[],"data":null}"#), Outcome::Ran);
}

#[test]
fn a_refusal_is_a_graphql_error_in_the_problems_status() {
    let p = Problem::new(ProblemKind::InProgress, "still running")
        .with_retry_after(std::time::Duration::from_secs(2));
    let resp = refusal(
        &p,
        Some("application/graphql-response+json, application/json;q=0.9"),
    );
    assert_eq!(resp.status().as_u16(), 409);
    assert_eq!(
        resp.headers()[http::header::CONTENT_TYPE],
        "application/graphql-response+json"
    );
    assert_eq!(resp.headers()[http::header::RETRY_AFTER], "2");
    let body: serde_json::Value =
        serde_json::from_slice(&crate::full_body(resp.into_body())).expect("json");
    let error = &body["errors"][0];
    assert_eq!(
        error["extensions"]["code"],
        "IDEMPOTENCY_REQUEST_IN_PROGRESS"
    );
    assert_eq!(error["extensions"]["retry_after"], 2);
    assert_eq!(error["extensions"]["status"], 409);
    assert!(body.get("data").is_none(), "nothing ran: no data member");
    let plain = refusal(&Problem::new(ProblemKind::KeyReused, "x"), None);
    assert_eq!(
        plain.headers()[http::header::CONTENT_TYPE],
        "application/json"
    );
    assert_eq!(plain.status().as_u16(), 422);
}
