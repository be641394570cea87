//! The clock check: a `Date` the endpoint sends that proves a skew over
//! `max_skew` refuses the store at connect; one within it is accepted.
//! A loopback server stands for the endpoint, answering every request
//! with the `Date` a test chooses, so no test depends on timing.

use std::time::Duration;

use idem::Timestamp;
use idem_dynamodb::aws_sdk_dynamodb::primitives::{DateTime, DateTimeFormat};
use idem_dynamodb::{DynamoError, DynamoOptions, DynamoStore};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

use crate::common;

/// An idem table as DescribeTable shows it.
const TABLE: &str = r#"{"Table":{"TableName":"idem_clock","TableStatus":"ACTIVE","KeySchema":[{"AttributeName":"pk","KeyType":"HASH"}],"GlobalSecondaryIndexes":[{"IndexName":"idem_list","IndexStatus":"ACTIVE"}]}}"#;

/// A DynamoDB endpoint on loopback whose answers carry `date(now)` as
/// their `Date` header (none when it returns `None`); its URL.
async fn endpoint(date: fn(Timestamp) -> Option<String>) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        while let Ok((mut conn, _)) = listener.accept().await {
            tokio::spawn(async move {
                // The request: headers, then Content-Length bytes.
                let mut seen = Vec::new();
                let mut buf = [0_u8; 4096];
                loop {
                    let Ok(read) = conn.read(&mut buf).await else {
                        return;
                    };
                    if read == 0 {
                        return;
                    }
                    seen.extend_from_slice(&buf[..read]);
                    let text = String::from_utf8_lossy(&seen).to_ascii_lowercase();
                    if let Some(end) = text.find("\r\n\r\n") {
                        let length = text
                            .lines()
                            .find_map(|l| l.strip_prefix("content-length:"))
                            .and_then(|v| v.trim().parse::<usize>().ok())
                            .unwrap_or(0);
                        if seen.len() >= end + 4 + length {
                            break;
                        }
                    }
                }
                let date = date(Timestamp::now())
                    .map(|d| format!("date: {d}\r\n"))
                    .unwrap_or_default();
                let answer = format!(
                    "HTTP/1.1 200 OK\r\n{date}content-type: application/x-amz-json-1.0\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{TABLE}",
                    TABLE.len()
                );
                let _ = conn.write_all(answer.as_bytes()).await;
                let _ = conn.shutdown().await;
            });
        }
    });
    format!("http://{addr}")
}

/// `now` moved by `offset_ms`, as an HTTP date.
fn http_date(now: Timestamp, offset_ms: i64) -> String {
    DateTime::from_millis(now.as_millis() + offset_ms)
        .fmt(DateTimeFormat::HttpDate)
        .expect("a date in range")
}

async fn connect(endpoint: &str, max_skew: Duration) -> Result<DynamoStore, DynamoError> {
    DynamoStore::connect_with(
        DynamoOptions::new("idem_clock")
            .with_region("us-east-1")
            .with_endpoint(endpoint)
            .with_credentials("idem-test", "idem-test", None)
            .with_migrate(false)
            .with_max_skew(max_skew),
    )
    .await
}

#[tokio::test]
async fn a_clock_behind_the_endpoint_is_refused() {
    let url = endpoint(|now| Some(http_date(now, 3_600_000))).await;
    match connect(&url, Duration::from_secs(1)).await {
        Err(DynamoError::ClockSkew {
            skew_ms, max_skew, ..
        }) => {
            assert!(skew_ms > 3_500_000, "{skew_ms}");
            assert_eq!(max_skew, Duration::from_secs(1));
        }
        other => panic!("expected ClockSkew, got {other:?}"),
    }
}

#[tokio::test]
async fn a_clock_ahead_of_the_endpoint_is_refused_with_a_clear_line() {
    let url = endpoint(|now| Some(http_date(now, -10_000))).await;
    let err = connect(&url, Duration::from_secs(2))
        .await
        .expect_err("10 s ahead, 2 s allowed");
    assert!(
        matches!(err, DynamoError::ClockSkew { skew_ms, .. } if skew_ms < -8_000),
        "{err:?}"
    );
    let line = err.to_string();
    assert!(line.contains("ahead of DynamoDB"), "{line}");
    assert!(line.contains("max_skew_ms=2000"), "{line}");
    assert!(line.contains(&url), "{line}");
    assert!(!err.is_transient(), "a clock does not fix itself");
}

#[tokio::test]
async fn a_skew_within_the_bound_is_accepted() {
    // 5 s behind the endpoint, 10 s allowed.
    let url = endpoint(|now| Some(http_date(now, 5_000))).await;
    let store = connect(&url, Duration::from_secs(10))
        .await
        .expect("within the bound");
    let check = store.check_clock().await.expect("still within");
    assert!((1..=5_000).contains(&check.skew_ms), "{check:?}");
    // The endpoint's clock is this one.
    let url = endpoint(|now| Some(http_date(now, 0))).await;
    let store = connect(&url, Duration::from_secs(1)).await.expect("right");
    assert_eq!(store.check_clock().await.expect("check").skew_ms, 0);
}

#[tokio::test]
async fn an_answer_without_a_date_cannot_vouch_for_the_clock() {
    let url = endpoint(|_| None).await;
    match connect(&url, Duration::from_secs(1)).await {
        Err(DynamoError::NoDate { found, .. }) => assert_eq!(found, "none"),
        other => panic!("expected NoDate, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_emulator_on_this_machine_shares_its_clock() {
    let Some(store) = common::shared_store().await else {
        return;
    };
    let check = store.check_clock().await.expect("same machine, same clock");
    assert_eq!(check.skew_ms, 0, "{check:?}");
}
