//! Traces over OpenTelemetry (feature `otel`, `[telemetry] otlp_endpoint`):
//! a server span per request, the store operations and the upstream call
//! as its children, the caller's `traceparent` continued and passed on.
//!
//! ```toml
//! [telemetry]
//! otlp_endpoint = "http://127.0.0.1:4318"   # OTLP/HTTP; /v1/traces is added
//! sample_ratio = 0.1                        # new traces kept; a caller's choice is followed
//! trace_keys = false                        # idempotency keys stay out of spans
//! ```
//!
//! The spans are `tracing` spans of the target [`TARGET`], which the log
//! output never shows: without telemetry nothing listens to that target
//! and no span is made (one cached check per call site). With it, the
//! `tracing-opentelemetry` layer turns them into OpenTelemetry spans, and
//! the SDK's batch processor exports them from a thread of its own: a
//! collector that is slow or down costs the request path nothing (spans
//! beyond the SDK's queue of 2,048 are dropped; an export is given up
//! after 5 s).
//!
//! What a span holds: the method, the path pattern (`http.route`), the
//! outcome, the record's state, the statuses; never a header, a body or a
//! credential, and the idempotency key only with `trace_keys = true`.

use http::{HeaderMap, Method};
use idem_http::trace::TARGET;
use tracing::Span;
use tracing::field::Empty;

/// Turns on traces for this process: the layer to add to the subscriber
/// (filtered to [`TARGET`]) and the guard that flushes what is queued when
/// dropped, at exit.
#[cfg(feature = "otel")]
pub use otel::{Telemetry, install};

/// Without the `otel` feature there is nothing to keep running.
#[cfg(not(feature = "otel"))]
#[derive(Debug)]
pub struct Telemetry;

/// Without the `otel` feature, traces cannot be turned on (the config
/// refuses `otlp_endpoint` first).
#[cfg(not(feature = "otel"))]
pub fn install(
    _settings: &crate::config::TelemetrySettings,
) -> Result<(tracing_subscriber::layer::Identity, Telemetry), crate::error::GatewayError> {
    Err(crate::error::GatewayError::Invalid(
        "this idem was built without its `otel` feature".to_owned(),
    ))
}

/// What each request's span needs from `[telemetry]`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RequestTracing {
    /// `trace_keys`: spans carry the idempotency key.
    pub trace_keys: bool,
    /// `sample_ratio`: the share of new traces kept.
    pub sample_ratio: f64,
}

impl RequestTracing {
    /// What `[telemetry]` says of each request (nothing kept without it).
    pub fn new(settings: Option<&crate::config::TelemetrySettings>) -> Self {
        Self {
            trace_keys: settings.is_some_and(|t| t.trace_keys),
            sample_ratio: settings.map_or(0.0, |t| t.sample_ratio),
        }
    }
}

/// The server span of one request (`otel.kind = server`), continuing the
/// trace of the caller's `traceparent`. The layer fills in the route, the
/// outcome, the record's state and, when `trace_keys` declared the field,
/// the key.
///
/// Sampling is decided here, before any span exists: a request the
/// caller's `traceparent` marks unsampled, or a new trace outside
/// `sample_ratio`, gets no span at all (and no child span; the caller's
/// `traceparent` goes upstream unchanged), so the requests not kept cost
/// what they cost without traces.
pub fn request_span(method: &Method, headers: &HeaderMap, traces: RequestTracing) -> Span {
    if !tracing::enabled!(target: TARGET, tracing::Level::INFO) {
        return Span::none();
    }
    #[cfg(feature = "otel")]
    let Some(parent) = otel::sampled(headers, traces.sample_ratio) else {
        return Span::none();
    };
    #[cfg(not(feature = "otel"))]
    let _ = headers;
    let span = if traces.trace_keys {
        tracing::info_span!(target: TARGET, "idem.request", otel.name = %method, otel.kind = "server",
            http.request.method = %method, http.route = Empty, idem.outcome = Empty,
            idem.record_state = Empty, http.response.status_code = Empty, otel.status_code = Empty,
            idem.key = Empty)
    } else {
        tracing::info_span!(target: TARGET, "idem.request", otel.name = %method, otel.kind = "server",
            http.request.method = %method, http.route = Empty, idem.outcome = Empty,
            idem.record_state = Empty, http.response.status_code = Empty, otel.status_code = Empty)
    };
    #[cfg(feature = "otel")]
    otel::set_parent(&span, parent);
    span
}

/// Whether the current span is a kept request's: child spans are made
/// only then.
fn in_kept_request() -> bool {
    tracing::enabled!(target: TARGET, tracing::Level::INFO) && !Span::current().is_none()
}

/// Records the answer on a request's span: its status, and the route's
/// operation as the span's name (`POST /v1/payments`) when the layer
/// matched one (the name is the method alone otherwise).
pub fn record_answer<B>(span: &Span, resp: &http::Response<B>) {
    if span.is_disabled() {
        return;
    }
    let status = resp.status();
    span.record("http.response.status_code", status.as_u16());
    if status.is_server_error() {
        span.record("otel.status_code", "ERROR");
    }
    #[cfg(feature = "otel")]
    if let Some(route) = resp.extensions().get::<idem_http::trace::Route>() {
        otel::rename(span, &route.0);
    }
}

/// The client span of the upstream call (`otel.kind = client`); its
/// context goes upstream in `traceparent` (see [`propagate`]).
pub fn upstream_span(method: &Method) -> Span {
    if !in_kept_request() {
        return Span::none();
    }
    tracing::info_span!(target: TARGET, "idem.upstream", otel.name = %method, otel.kind = "client",
        http.request.method = %method, http.response.status_code = Empty, otel.status_code = Empty)
}

/// Sets `traceparent` (and `tracestate`) in `headers` to `span`'s context,
/// so the upstream's spans are its children; the caller's own values are
/// replaced, as the gateway is a hop of the trace.
pub fn propagate(span: &Span, headers: &mut HeaderMap) {
    #[cfg(feature = "otel")]
    if !span.is_disabled() {
        otel::inject(span, headers);
    }
    #[cfg(not(feature = "otel"))]
    let _ = (span, headers);
}

/// A store operation's span, child of the request's; none outside a
/// request (the background jobs' operations would each start a trace).
pub fn store_span(store: &'static str, op: &'static str) -> Span {
    if !in_kept_request() {
        return Span::none();
    }
    tracing::info_span!(target: TARGET, "idem.store", otel.name = op, otel.kind = "client",
        db.system.name = store, db.operation.name = op, otel.status_code = Empty)
}

#[cfg(feature = "otel")]
mod otel {
    use std::time::Duration;

    use http::{HeaderMap, HeaderName, HeaderValue};
    use opentelemetry::Context;
    use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
    use opentelemetry::trace::TraceContextExt as _;
    use opentelemetry::trace::TracerProvider as _;
    use opentelemetry_otlp::{Protocol, WithExportConfig};
    use opentelemetry_sdk::Resource;
    use opentelemetry_sdk::propagation::TraceContextPropagator;
    use opentelemetry_sdk::trace::{Sampler, SdkTracerProvider};
    use tracing::Span;
    use tracing_opentelemetry::OpenTelemetrySpanExt;
    use tracing_subscriber::Layer;
    use tracing_subscriber::filter::{LevelFilter, Targets};
    use tracing_subscriber::registry::LookupSpan;

    use crate::config::TelemetrySettings;
    use crate::error::GatewayError;
    use idem_http::trace::TARGET;

    /// How long one export may take before it is given up (the batch is
    /// dropped: traces never hold the gateway).
    const EXPORT_TIMEOUT: Duration = Duration::from_secs(5);

    /// Keeps the exporter running; dropped at exit, it flushes what is
    /// queued (within the export time-out).
    #[derive(Debug)]
    pub struct Telemetry {
        provider: SdkTracerProvider,
    }

    impl Drop for Telemetry {
        fn drop(&mut self) {
            if let Err(err) = self.provider.shutdown() {
                tracing::debug!(%err, "traces not all flushed at exit");
            }
        }
    }

    /// The layer exporting the spans of [`TARGET`], and its guard.
    pub fn install<S>(
        settings: &TelemetrySettings,
    ) -> Result<(impl Layer<S> + Send + Sync + 'static, Telemetry), GatewayError>
    where
        S: tracing::Subscriber + for<'a> LookupSpan<'a> + Send + Sync,
    {
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_protocol(Protocol::HttpBinary)
            .with_endpoint(&settings.endpoint)
            .with_timeout(EXPORT_TIMEOUT)
            .build()
            .map_err(|e| {
                GatewayError::Invalid(format!(
                    "telemetry.otlp_endpoint {}: cannot set up the exporter: {e}",
                    settings.endpoint
                ))
            })?;
        let provider = SdkTracerProvider::builder()
            .with_batch_exporter(exporter)
            // Sampled in `request_span` already: what reaches the SDK is kept.
            .with_sampler(Sampler::ParentBased(Box::new(Sampler::AlwaysOn)))
            .with_resource(
                Resource::builder()
                    .with_service_name(settings.service_name.clone())
                    .build(),
            )
            .build();
        let tracer = provider.tracer("idem");
        // Spans carry what the gateway puts in them, not where in its code
        // or on which thread they were made.
        let layer = tracing_opentelemetry::layer()
            .with_tracer(tracer)
            .with_location(false)
            .with_threads(false)
            .with_target(false)
            .with_level(false)
            .with_tracked_inactivity(false)
            .with_filter(Targets::new().with_target(TARGET, LevelFilter::INFO));
        Ok((layer, Telemetry { provider }))
    }

    /// The caller's context (empty for a new trace) if this request is to
    /// be traced: the caller's sampled flag when its `traceparent` is
    /// valid, else a draw at `ratio`.
    pub(super) fn sampled(headers: &HeaderMap, ratio: f64) -> Option<Context> {
        let parent = TraceContextPropagator::new().extract(&Headers(headers));
        let remote = parent.span().span_context().clone();
        let keep = if remote.is_valid() {
            remote.is_sampled()
        } else {
            draw() < ratio
        };
        keep.then_some(parent)
    }

    /// Makes `span` a child of `parent` (a new trace's root when empty).
    pub(super) fn set_parent(span: &Span, parent: Context) {
        let _ = span.set_parent(parent);
    }

    /// A uniform draw from [0, 1): xorshift64* per thread, seeded from the
    /// standard library's per-process random keys (no system call per
    /// request).
    fn draw() -> f64 {
        use std::cell::Cell;
        use std::hash::{BuildHasher, Hasher};
        thread_local! {
            static STATE: Cell<u64> = Cell::new(
                std::collections::hash_map::RandomState::new().build_hasher().finish() | 1,
            );
        }
        STATE.with(|state| {
            let mut x = state.get();
            x ^= x >> 12;
            x ^= x << 25;
            x ^= x >> 27;
            state.set(x);
            // The top 53 bits, as a fraction.
            (x.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 11) as f64 / (1u64 << 53) as f64
        })
    }

    /// Names the OpenTelemetry span behind `span` (a started span takes
    /// no `otel.name` from `tracing`).
    pub(super) fn rename(span: &Span, name: &str) {
        span.context().span().update_name(name.to_owned());
    }

    /// Writes `span`'s context into `headers`.
    pub(super) fn inject(span: &Span, headers: &mut HeaderMap) {
        let context = span.context();
        TraceContextPropagator::new().inject_context(&context, &mut HeadersMut(headers));
    }

    struct Headers<'a>(&'a HeaderMap);

    impl Extractor for Headers<'_> {
        fn get(&self, key: &str) -> Option<&str> {
            self.0.get(key).and_then(|v| v.to_str().ok())
        }

        fn keys(&self) -> Vec<&str> {
            self.0.keys().map(HeaderName::as_str).collect()
        }
    }

    struct HeadersMut<'a>(&'a mut HeaderMap);

    impl Injector for HeadersMut<'_> {
        fn set(&mut self, key: &str, value: String) {
            if let (Ok(name), Ok(value)) = (
                HeaderName::from_bytes(key.as_bytes()),
                HeaderValue::from_str(&value),
            ) {
                self.0.insert(name, value);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_messaging_spans_are_exported_with_the_request_spans() {
        // One exporter filter (on `TARGET`) takes the relay's and the
        // consumer runner's spans too.
        assert_eq!(idem_messaging::trace::TARGET, TARGET);
    }
}
