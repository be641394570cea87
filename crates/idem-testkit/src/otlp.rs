//! An OTLP/HTTP trace receiver on loopback: what a collector would get
//! from an exporter, decoded with the OpenTelemetry protocol definitions
//! (`POST /v1/traces`, `application/x-protobuf`), kept for a test to read.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use opentelemetry_proto::tonic::common::v1::{AnyValue, KeyValue};
use prost::Message;
use tokio::net::TcpListener;

/// One span as the receiver got it.
#[derive(Debug, Clone, PartialEq)]
pub struct ReceivedSpan {
    /// The span's name.
    pub name: String,
    /// The trace id, 32 hex digits.
    pub trace_id: String,
    /// The span id, 16 hex digits.
    pub span_id: String,
    /// The parent's span id (empty for a root span).
    pub parent_span_id: String,
    /// `SPAN_KIND_*` as the protocol numbers it (2 server, 3 client).
    pub kind: i32,
    /// Attributes, their values as text.
    pub attributes: BTreeMap<String, String>,
    /// The resource's `service.name`.
    pub service: String,
    /// `STATUS_CODE_*` as the protocol numbers it (2: error).
    pub status: i32,
}

impl ReceivedSpan {
    /// An attribute's value, as text.
    pub fn attr(&self, name: &str) -> Option<&str> {
        self.attributes.get(name).map(String::as_str)
    }
}

/// The protocol's number for a server span.
pub const SERVER: i32 = 2;
/// The protocol's number for a client span.
pub const CLIENT: i32 = 3;

/// A running receiver; it stops when the test's runtime ends.
#[derive(Debug, Clone)]
pub struct OtlpReceiver {
    addr: SocketAddr,
    spans: Arc<Mutex<Vec<ReceivedSpan>>>,
    requests: Arc<Mutex<Vec<String>>>,
}

impl OtlpReceiver {
    /// Starts on `127.0.0.1:0`.
    pub async fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind loopback");
        let addr = listener.local_addr().expect("local addr");
        let receiver = Self {
            addr,
            spans: Arc::default(),
            requests: Arc::default(),
        };
        let shared = receiver.clone();
        crate::upstream::serve(listener, move || {
            let shared = shared.clone();
            move |req| {
                let shared = shared.clone();
                async move { shared.export(req).await }
            }
        });
        receiver
    }

    /// `http://127.0.0.1:PORT` (the exporter adds `/v1/traces`).
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Every span received so far.
    pub fn spans(&self) -> Vec<ReceivedSpan> {
        self.spans.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// The method, path and content type of every export request.
    pub fn requests(&self) -> Vec<String> {
        self.requests
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Waits until at least `n` spans have arrived (panics after `within`).
    pub async fn wait_for(&self, n: usize, within: Duration) -> Vec<ReceivedSpan> {
        let started = Instant::now();
        loop {
            let spans = self.spans();
            if spans.len() >= n {
                return spans;
            }
            assert!(
                started.elapsed() < within,
                "{} spans within {within:?}, wanted {n}: {spans:#?}",
                spans.len()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    async fn export(&self, req: Request<Incoming>) -> Result<Response<Full<Bytes>>, Infallible> {
        let (parts, body) = req.into_parts();
        let kind = parts
            .headers
            .get(http::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_owned();
        self.requests
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(format!("{} {} {kind}", parts.method, parts.uri.path()));
        let body = body
            .collect()
            .await
            .map(|b| b.to_bytes())
            .unwrap_or_default();
        let Ok(export) = ExportTraceServiceRequest::decode(body) else {
            return Ok(answer(StatusCode::BAD_REQUEST));
        };
        let mut spans = self.spans.lock().unwrap_or_else(|p| p.into_inner());
        for resource in export.resource_spans {
            let service = resource
                .resource
                .as_ref()
                .and_then(|r| find(&r.attributes, "service.name"))
                .unwrap_or_default();
            for scope in resource.scope_spans {
                for span in scope.spans {
                    spans.push(ReceivedSpan {
                        name: span.name,
                        trace_id: hex(&span.trace_id),
                        span_id: hex(&span.span_id),
                        parent_span_id: hex(&span.parent_span_id),
                        kind: span.kind,
                        attributes: span
                            .attributes
                            .iter()
                            .map(|kv| (kv.key.clone(), text(kv.value.as_ref())))
                            .collect(),
                        service: service.clone(),
                        status: span.status.map_or(0, |s| s.code),
                    });
                }
            }
        }
        Ok(answer(StatusCode::OK))
    }
}

fn answer(status: StatusCode) -> Response<Full<Bytes>> {
    let mut resp = Response::new(Full::new(Bytes::new()));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/x-protobuf"),
    );
    resp
}

fn find(attributes: &[KeyValue], key: &str) -> Option<String> {
    attributes
        .iter()
        .find(|kv| kv.key == key)
        .map(|kv| text(kv.value.as_ref()))
}

fn text(value: Option<&AnyValue>) -> String {
    match value.and_then(|v| v.value.as_ref()) {
        Some(Value::StringValue(s)) => s.clone(),
        Some(Value::IntValue(i)) => i.to_string(),
        Some(Value::BoolValue(b)) => b.to_string(),
        Some(Value::DoubleValue(d)) => d.to_string(),
        Some(other) => format!("{other:?}"),
        None => String::new(),
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
