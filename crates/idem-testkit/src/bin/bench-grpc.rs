//! A load generator for gRPC calls, as `wrk` is for HTTP/1.1 (which has
//! no HTTP/2): CONNS cleartext HTTP/2 connections by prior knowledge,
//! each with one unary call in flight at a time, for SECS seconds. Every
//! call is `POST /bench.Payments/Create` with the benchmark's payment as
//! its one message, `authorization: Bearer bench`, and an
//! `idempotency-key`: fresh on every call (`unique`: `<tag>-<conn>-<n>`),
//! or one of 100 (`replays`: `grpc-replay-N`, which `warm` sends once
//! each). An answer counts when its `grpc-status` (trailers, or headers
//! of a trailers-only answer) is `0`.
//!
//! Usage: `bench-grpc ADDR CONNS SECS unique|replays|warm [TAG]`. Prints
//! `Requests/sec: N` (as wrk does) and `Failed: N`, and exits 1 when a
//! call failed.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderMap, Request};
use http_body_util::{BodyExt, Full};
use hyper_util::rt::{TokioExecutor, TokioIo};

/// The payment bench/ab's other scenarios send, as one gRPC frame.
fn message() -> Bytes {
    let json = br#"{"amount_cents":100,"currency":"EUR","payment_method_id":"pm_card_visa"}"#;
    let mut frame = vec![0u8];
    frame.extend_from_slice(&u32::try_from(json.len()).expect("small").to_be_bytes());
    frame.extend_from_slice(json);
    Bytes::from(frame)
}

fn ok(headers: &HeaderMap, trailers: Option<&HeaderMap>) -> bool {
    trailers
        .and_then(|t| t.get("grpc-status"))
        .or_else(|| headers.get("grpc-status"))
        .is_some_and(|v| v == "0")
}

async fn connect(addr: SocketAddr) -> hyper::client::conn::http2::SendRequest<Full<Bytes>> {
    let stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let _ = stream.set_nodelay(true);
    let (sender, conn) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(stream))
            .await
            .expect("HTTP/2 handshake");
    tokio::spawn(conn);
    sender
}

async fn call(
    h2: &mut hyper::client::conn::http2::SendRequest<Full<Bytes>>,
    addr: SocketAddr,
    key: &str,
    body: Bytes,
) -> bool {
    let req = Request::post(format!("http://{addr}/bench.Payments/Create"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .header("authorization", "Bearer bench")
        .header("idempotency-key", key)
        .body(Full::new(body))
        .expect("request");
    if h2.ready().await.is_err() {
        return false;
    }
    let Ok(resp) = h2.send_request(req).await else {
        return false;
    };
    let (parts, body) = resp.into_parts();
    let Ok(collected) = body.collect().await else {
        return false;
    };
    ok(&parts.headers, collected.trailers())
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let [_, addr, conns, secs, mode, rest @ ..] = args.as_slice() else {
        eprintln!("usage: bench-grpc ADDR CONNS SECS unique|replays|warm [TAG]");
        std::process::exit(2);
    };
    let addr: SocketAddr = addr.parse().expect("ADDR");
    let conns: u64 = conns.parse().expect("CONNS");
    let secs: u64 = secs.parse().expect("SECS");
    let tag = rest.first().cloned().unwrap_or_else(|| "grpc".to_owned());
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async move {
        let body = message();
        if mode == "warm" {
            let mut h2 = connect(addr).await;
            for i in 1..=100 {
                assert!(call(&mut h2, addr, &format!("grpc-replay-{i}"), body.clone()).await);
            }
            return;
        }
        let done = Arc::new(AtomicU64::new(0));
        let failed = Arc::new(AtomicU64::new(0));
        let until = Instant::now() + Duration::from_secs(secs);
        let mut tasks = Vec::new();
        for c in 0..conns {
            let (done, failed, body, tag, mode) = (
                done.clone(),
                failed.clone(),
                body.clone(),
                tag.clone(),
                mode.clone(),
            );
            tasks.push(tokio::spawn(async move {
                let mut h2 = connect(addr).await;
                let mut n: u64 = 0;
                while Instant::now() < until {
                    n += 1;
                    let key = if mode == "unique" {
                        format!("{tag}-{c}-{n}")
                    } else {
                        format!("grpc-replay-{}", (c * 7919 + n) % 100 + 1)
                    };
                    if call(&mut h2, addr, &key, body.clone()).await {
                        done.fetch_add(1, Ordering::Relaxed);
                    } else {
                        failed.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }));
        }
        let started = Instant::now();
        for t in tasks {
            let _ = t.await;
        }
        let elapsed = started.elapsed().as_secs_f64();
        println!(
            "Requests/sec: {:.2}",
            done.load(Ordering::Relaxed) as f64 / elapsed
        );
        let failed = failed.load(Ordering::Relaxed);
        println!("Failed: {failed}");
        // A call that did not end OK is not a request served: the figure
        // would count what the gateway refused.
        if failed > 0 {
            std::process::exit(1);
        }
    });
}
