//! A fast upstream for benchmarks: answers every request at once with a
//! small JSON body (201 for POST, 200 otherwise), HTTP/1.1 keep-alive;
//! on `/rpc`, a JSON-RPC 2.0 result (`200`), as a JSON-RPC service does;
//! on `/graphql`, a GraphQL response with `data` (`200`); to a gRPC call
//! (`application/grpc`, over HTTP/2 by prior knowledge), one message and
//! the trailers `grpc-status: 0` and `payment-id`, as a gRPC server does.
//!
//! Usage: `bench-upstream [ADDR]` (default `127.0.0.1:18081`). Prints
//! `listening on ADDR` once ready.

use std::convert::Infallible;
use std::future::{Ready, ready};

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::combinators::WithTrailers;
use http_body_util::{BodyExt, Either, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;

/// A whole body, or (gRPC) a whole body and its trailers.
type Answer = Either<Full<Bytes>, WithTrailers<Full<Bytes>, Trailers>>;
type Trailers = Ready<Option<Result<HeaderMap, Infallible>>>;

/// The gRPC answer's one message: a frame of the JSON payment.
const GRPC_MESSAGE: &[u8] =
    b"\x00\x00\x00\x00\x36{\"id\":\"pay_1\",\"status\":\"succeeded\",\"amount_cents\":100}";

async fn answer(req: Request<Incoming>) -> Result<Response<Answer>, Infallible> {
    if is_grpc(&req) {
        let _ = req.into_body().collect().await;
        let mut trailers = HeaderMap::new();
        trailers.insert("grpc-status", HeaderValue::from_static("0"));
        trailers.insert("payment-id", HeaderValue::from_static("pay_1"));
        let body =
            Full::new(Bytes::from_static(GRPC_MESSAGE)).with_trailers(ready(Some(Ok(trailers))));
        let resp = Response::builder()
            .header("content-type", "application/grpc")
            .body(Either::Right(body))
            .expect("valid response");
        return Ok(resp);
    }
    let status = if req.method() == Method::POST {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
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
    // Read the body so keep-alive connections stay usable.
    let _ = req.into_body().collect().await;
    let resp = Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .body(Either::Left(Full::new(Bytes::from_static(body))))
        .expect("valid response");
    Ok(resp)
}

/// Whether the request is a gRPC call.
fn is_grpc<B>(req: &Request<B>) -> bool {
    req.headers()
        .get("content-type")
        .is_some_and(|v| v.as_bytes().starts_with(b"application/grpc"))
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
                // HTTP/1.1, or HTTP/2 by prior knowledge (the gateway's
                // gRPC calls), told apart by the connection's preface.
                let _ = auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(stream), service_fn(answer))
                    .await;
            });
        }
    })
}
