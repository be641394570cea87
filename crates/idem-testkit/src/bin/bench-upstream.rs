//! A fast upstream for benchmarks: answers every request at once with a
//! small JSON body (201 for POST, 200 otherwise), HTTP/1.1 keep-alive;
//! on `/rpc`, a JSON-RPC 2.0 result (`200`), as a JSON-RPC service does;
//! on `/graphql`, a GraphQL response with `data` (`200`).
//!
//! Usage: `bench-upstream [ADDR]` (default `127.0.0.1:18081`). Prints
//! `listening on ADDR` once ready.

use std::convert::Infallible;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;

async fn answer(req: Request<Incoming>) -> Result<Response<Full<Bytes>>, Infallible> {
    let status = if req.method() == Method::POST {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    // Read the body so keep-alive connections stay usable.
    let (status, body): (StatusCode, &'static [u8]) = match req.uri().path() {
        "/rpc" => (
            StatusCode::OK,
            br#"{"jsonrpc":"2.0","id":1,"result":{"id":"pay_1","status":"succeeded","amount_cents":100}}"#,
        ),
        "/graphql" => (
            StatusCode::OK,
            br#"{"data":{"createPayment":{"id":"pay_1","status":"succeeded","amountCents":100}}}"#,
        ),
        _ => (
            status,
            br#"{"id":"pay_1","status":"succeeded","amount_cents":100}"#,
        ),
    };
    let _ = req.into_body().collect().await;
    let resp = Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from_static(body)))
        .expect("valid response");
    Ok(resp)
}

fn main() -> std::io::Result<()> {
    let addr = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "127.0.0.1:18081".to_owned());
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async move {
        let listener = tokio::net::TcpListener::bind(&addr).await?;
        println!("listening on {}", listener.local_addr()?);
        loop {
            let (stream, _) = listener.accept().await?;
            let _ = stream.set_nodelay(true);
            tokio::spawn(async move {
                let _ = http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service_fn(answer))
                    .await;
            });
        }
    })
}
