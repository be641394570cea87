//! The W3C Trace Context an outbox row carries, so that a trace reads on
//! across the broker: request → outbox row → relay publish → consumer
//! handler → its own outbox rows…
//!
//! [`Outbox::enqueue`](crate::outbox::Outbox::enqueue) stores the
//! transaction's `traceparent` and `tracestate` among the row's headers
//! (under [`TRACEPARENT`] and [`TRACESTATE`]), which the relay publishes as
//! broker headers on every broker. The context comes from
//! [`OutboxMessage::with_trace_context`](crate::outbox::OutboxMessage::with_trace_context)
//! when given there; otherwise, with the `otel` feature, from the current
//! `tracing` span when an OpenTelemetry layer backs it (see
//! [`TraceContext::current`]).
//!
//! What is stored is checked strictly against the W3C format (version
//! `00`, lowercase hex, no all-zero ids, a `tracestate` of at most 512
//! characters without control characters): a malformed value given
//! explicitly is refused, never stored. What comes back from a broker is
//! read leniently ([`TraceContext::from_headers`]): a malformed
//! `traceparent` there is ignored, as W3C says, not an error.
//!
//! ```
//! use idem_postgres::trace_context::TraceContext;
//! let cx = TraceContext::new("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", None)?;
//! assert_eq!(cx.trace_id(), "4bf92f3577b34da6a3ce929d0e0e4736");
//! assert!(cx.is_sampled());
//! assert!(TraceContext::new("00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01", None).is_err());
//! # Ok::<(), idem_postgres::MessagingError>(())
//! ```
//!
//! With the `otel` feature, the `tracing` spans are read and parented
//! through `tracing-opentelemetry` 0.34 and the `opentelemetry` 0.33 API:
//! an application's OpenTelemetry layer must be of those versions for its
//! spans to be seen.

use crate::MessagingError;

/// The header carrying the W3C `traceparent` (lowercase, as W3C Trace
/// Context and Kafka and NATS users write it).
pub const TRACEPARENT: &str = "traceparent";
/// The header carrying the W3C `tracestate`.
pub const TRACESTATE: &str = "tracestate";

/// The longest `tracestate` kept (W3C: 32 list members, 512 characters
/// is what every implementation must propagate).
pub const MAX_TRACESTATE: usize = 512;

/// A validated W3C trace context: a `traceparent` of version `00` and an
/// optional `tracestate`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct TraceContext {
    traceparent: String,
    tracestate: Option<String>,
}

/// Whether `s` is `len` lowercase hexadecimal digits, not all zero.
fn nonzero_hex(s: &str, len: usize) -> bool {
    s.len() == len && is_lower_hex(s) && s.bytes().any(|b| b != b'0')
}

fn is_lower_hex(s: &str) -> bool {
    s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

fn check_traceparent(value: &str) -> Result<(), String> {
    const SHAPE: &str = "expected 00-<32 lowercase hex trace id>-<16 lowercase hex span id>-<2 lowercase hex flags>";
    if value.len() != 55 {
        return Err(format!(
            "is {} characters long, not 55; {SHAPE}",
            value.len()
        ));
    }
    let parts: Vec<&str> = value.split('-').collect();
    let [version, trace_id, span_id, flags] = parts.as_slice() else {
        return Err(format!("{value:?}: {SHAPE}"));
    };
    if *version != "00" {
        return Err(format!(
            "{value:?}: version {version:?} is not supported (only 00)"
        ));
    }
    if !nonzero_hex(trace_id, 32) {
        return Err(format!(
            "{value:?}: the trace id must be 32 lowercase hex digits, not all zero"
        ));
    }
    if !nonzero_hex(span_id, 16) {
        return Err(format!(
            "{value:?}: the parent span id must be 16 lowercase hex digits, not all zero"
        ));
    }
    if flags.len() != 2 || !is_lower_hex(flags) {
        return Err(format!(
            "{value:?}: the flags must be 2 lowercase hex digits"
        ));
    }
    Ok(())
}

fn check_tracestate(value: &str) -> Result<(), String> {
    let chars = value.chars().count();
    if chars > MAX_TRACESTATE {
        return Err(format!(
            "is {chars} characters long; at most {MAX_TRACESTATE} are kept"
        ));
    }
    if value.chars().any(char::is_control) {
        return Err("contains control characters".to_owned());
    }
    Ok(())
}

impl TraceContext {
    /// A context from a `traceparent` and an optional `tracestate`,
    /// checked strictly: version `00`, a trace id of 32 lowercase hex
    /// digits and a span id of 16, neither all zero, flags of 2 lowercase
    /// hex digits; a `tracestate` of at most [`MAX_TRACESTATE`] characters
    /// without control characters (an empty one is no `tracestate`).
    /// Anything else is [`MessagingError::InvalidMessage`] (field
    /// `traceparent` or `tracestate`).
    pub fn new(traceparent: &str, tracestate: Option<&str>) -> Result<Self, MessagingError> {
        check_traceparent(traceparent).map_err(|why| MessagingError::invalid(TRACEPARENT, why))?;
        let tracestate = tracestate.filter(|s| !s.is_empty());
        if let Some(state) = tracestate {
            check_tracestate(state).map_err(|why| MessagingError::invalid(TRACESTATE, why))?;
        }
        Ok(Self {
            traceparent: traceparent.to_owned(),
            tracestate: tracestate.map(str::to_owned),
        })
    }

    /// The context in a message's headers (names matched ASCII
    /// case-insensitively), read as W3C says a receiver should: `None`
    /// without a valid `traceparent`; a `tracestate` that does not pass
    /// is dropped, the `traceparent` kept.
    pub fn from_headers<'a>(headers: impl IntoIterator<Item = (&'a str, &'a str)>) -> Option<Self> {
        let (mut parent, mut state) = (None, None);
        for (name, value) in headers {
            if parent.is_none() && name.eq_ignore_ascii_case(TRACEPARENT) {
                parent = Some(value);
            } else if state.is_none() && name.eq_ignore_ascii_case(TRACESTATE) {
                state = Some(value);
            }
        }
        let parent = parent?;
        check_traceparent(parent).ok()?;
        Some(Self {
            traceparent: parent.to_owned(),
            tracestate: state
                .filter(|s| !s.is_empty() && check_tracestate(s).is_ok())
                .map(str::to_owned),
        })
    }

    /// The `traceparent` header's value.
    pub fn traceparent(&self) -> &str {
        &self.traceparent
    }

    /// The `tracestate` header's value, if any.
    pub fn tracestate(&self) -> Option<&str> {
        self.tracestate.as_deref()
    }

    /// The trace id (32 lowercase hex digits), shared by every span of the
    /// trace.
    pub fn trace_id(&self) -> &str {
        &self.traceparent[3..35]
    }

    /// The id of the span this context was taken in (16 lowercase hex
    /// digits): the parent of the spans that continue it.
    pub fn span_id(&self) -> &str {
        &self.traceparent[36..52]
    }

    /// Whether the trace is sampled (flag `01`): whoever started it chose
    /// to keep it.
    pub fn is_sampled(&self) -> bool {
        u8::from_str_radix(&self.traceparent[53..55], 16).is_ok_and(|flags| flags & 1 == 1)
    }

    /// The context of the current `tracing` span, if an OpenTelemetry
    /// layer backs it, or else OpenTelemetry's current context (what an
    /// entered span activates): what
    /// [`Outbox::enqueue`](crate::outbox::Outbox::enqueue) stores when no
    /// context was given explicitly. Always `None` without the `otel`
    /// feature.
    pub fn current() -> Option<Self> {
        #[cfg(feature = "otel")]
        {
            Self::of_span(&tracing::Span::current())
                .or_else(|| Self::from_otel(&opentelemetry::Context::current()))
        }
        #[cfg(not(feature = "otel"))]
        {
            None
        }
    }

    /// The context of `span` (its own span id), if an OpenTelemetry layer
    /// backs it; `None` for a disabled span, and always without the `otel`
    /// feature.
    pub fn of_span(span: &tracing::Span) -> Option<Self> {
        #[cfg(feature = "otel")]
        {
            use tracing_opentelemetry::OpenTelemetrySpanExt as _;
            if span.is_disabled() {
                return None;
            }
            Self::from_otel(&span.context())
        }
        #[cfg(not(feature = "otel"))]
        {
            let _ = span;
            None
        }
    }

    /// Makes `span` a child of this context (a span from another process,
    /// continued here). Call it before the span is first entered. Nothing
    /// happens without the `otel` feature, or when no OpenTelemetry layer
    /// backs `span`.
    pub fn set_as_parent_of(&self, span: &tracing::Span) {
        #[cfg(feature = "otel")]
        {
            use tracing_opentelemetry::OpenTelemetrySpanExt as _;
            if !span.is_disabled() {
                // Refused only once the span has started: the caller's
                // contract is to call before.
                let _ = span.set_parent(self.to_otel_context());
            }
        }
        #[cfg(not(feature = "otel"))]
        let _ = span;
    }

    /// The context of `cx`'s span, if it has a valid one.
    #[cfg(feature = "otel")]
    fn from_otel(cx: &opentelemetry::Context) -> Option<Self> {
        use opentelemetry::trace::TraceContextExt as _;
        let span = cx.span();
        let sc = span.span_context();
        if !sc.is_valid() {
            return None;
        }
        let state = sc.trace_state().header();
        Some(Self {
            traceparent: format!(
                "00-{}-{}-{:02x}",
                sc.trace_id(),
                sc.span_id(),
                sc.trace_flags().to_u8()
            ),
            tracestate: (!state.is_empty() && check_tracestate(&state).is_ok()).then_some(state),
        })
    }

    /// This context as OpenTelemetry's: a remote parent span context (a
    /// `tracestate` OpenTelemetry does not accept is left out of it).
    #[cfg(feature = "otel")]
    pub fn to_otel_context(&self) -> opentelemetry::Context {
        use std::str::FromStr as _;

        use opentelemetry::trace::{
            SpanContext, SpanId, TraceContextExt as _, TraceFlags, TraceId, TraceState,
        };
        let flags = u8::from_str_radix(&self.traceparent[53..55], 16).unwrap_or(0);
        let state = self
            .tracestate
            .as_deref()
            .and_then(|s| TraceState::from_str(s).ok())
            .unwrap_or_default();
        let parent = SpanContext::new(
            TraceId::from_hex(self.trace_id()).unwrap_or(TraceId::INVALID),
            SpanId::from_hex(self.span_id()).unwrap_or(SpanId::INVALID),
            TraceFlags::new(flags),
            true,
            state,
        );
        opentelemetry::Context::new().with_remote_span_context(parent)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    fn refused(traceparent: &str, tracestate: Option<&str>) -> &'static str {
        match TraceContext::new(traceparent, tracestate) {
            Err(MessagingError::InvalidMessage { field, .. }) => field,
            other => panic!("{traceparent:?} / {tracestate:?}: {other:?}"),
        }
    }

    #[test]
    fn a_good_context_is_taken_apart() {
        let cx = TraceContext::new(GOOD, Some("congo=t61rcWkgMzE,rojo=00f067aa0ba902b7"))
            .expect("valid");
        assert_eq!(cx.traceparent(), GOOD);
        assert_eq!(
            cx.tracestate(),
            Some("congo=t61rcWkgMzE,rojo=00f067aa0ba902b7")
        );
        assert_eq!(cx.trace_id(), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(cx.span_id(), "00f067aa0ba902b7");
        assert!(cx.is_sampled());
        let unsampled = TraceContext::new(&GOOD.replace("-01", "-00"), Some("")).expect("valid");
        assert!(!unsampled.is_sampled());
        assert_eq!(unsampled.tracestate(), None, "an empty tracestate is none");
        // Flags other than `sampled` are kept as they are.
        let other = TraceContext::new(&GOOD.replace("-01", "-fe"), None).expect("valid");
        assert!(!other.is_sampled());
        assert!(
            TraceContext::new(GOOD, Some(&"a".repeat(MAX_TRACESTATE))).is_ok(),
            "512 characters are kept"
        );
    }

    #[test]
    fn every_malformed_traceparent_is_refused() {
        for bad in [
            "",
            "00",
            // Other versions, including the invalid ff.
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            // Upper case.
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00F067AA0BA902B7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0A",
            "0A-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            // All-zero ids.
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            // Not hex.
            "00-4bf92f3577b34da6a3ce929d0e0e473g-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902bz-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0x",
            // Wrong lengths and separators (55 characters each).
            "00-4bf92f3577b34da6a3ce929d0e0e47360-0f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736_00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-1-",
            // Too short, too long (a version 00 has no more fields).
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-1",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-ab",
            // Spaces and control characters.
            " 00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0\n",
        ] {
            assert_eq!(refused(bad, None), TRACEPARENT, "{bad:?}");
            assert!(
                TraceContext::from_headers([(TRACEPARENT, bad)]).is_none(),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn a_malformed_tracestate_is_refused() {
        assert_eq!(
            refused(GOOD, Some(&"a".repeat(MAX_TRACESTATE + 1))),
            TRACESTATE
        );
        assert_eq!(refused(GOOD, Some("rojo=1\r\nx: y")), TRACESTATE);
        assert_eq!(refused(GOOD, Some("rojo=\u{7f}")), TRACESTATE);
        assert_eq!(refused(GOOD, Some("rojo=\u{85}")), TRACESTATE);
    }

    #[test]
    fn headers_are_read_leniently() {
        let cx = TraceContext::from_headers([
            ("Idem-Sequence", "1"),
            ("TraceParent", GOOD),
            ("TRACESTATE", "rojo=1"),
        ])
        .expect("found");
        assert_eq!(cx.traceparent(), GOOD);
        assert_eq!(cx.tracestate(), Some("rojo=1"));
        // A bad tracestate is dropped, the traceparent kept.
        let cx =
            TraceContext::from_headers([(TRACEPARENT, GOOD), (TRACESTATE, "a\nb")]).expect("found");
        assert_eq!(cx.tracestate(), None);
        assert!(TraceContext::from_headers([(TRACESTATE, "rojo=1")]).is_none());
    }

    #[cfg(feature = "otel")]
    #[test]
    fn contexts_go_through_opentelemetry_unchanged() {
        let cx = TraceContext::new(GOOD, Some("rojo=00f067aa0ba902b7")).expect("valid");
        let back = TraceContext::from_otel(&cx.to_otel_context()).expect("valid span context");
        assert_eq!(back, cx);
        assert_eq!(TraceContext::of_span(&tracing::Span::none()), None);
    }

    /// `set_as_parent_of`: a span set as this context's child before it
    /// starts continues the remote trace (its trace id, this context's span
    /// as its parent); a span left alone starts a trace of its own.
    #[cfg(feature = "otel")]
    #[test]
    fn a_span_set_as_a_child_continues_the_remote_trace() {
        use std::sync::{Arc, Mutex};

        use opentelemetry::trace::TracerProvider as _;
        use opentelemetry_sdk::error::OTelSdkResult;
        use opentelemetry_sdk::trace::{SdkTracerProvider, SpanData, SpanExporter};
        use tracing_subscriber::layer::SubscriberExt as _;

        /// Keeps the spans it is given.
        #[derive(Debug)]
        struct Keep(Arc<Mutex<Vec<SpanData>>>);

        impl SpanExporter for Keep {
            fn export(
                &self,
                batch: Vec<SpanData>,
            ) -> impl std::future::Future<Output = OTelSdkResult> + Send {
                self.0.lock().expect("spans").extend(batch);
                std::future::ready(Ok(()))
            }
        }

        let finished = Arc::new(Mutex::new(Vec::new()));
        let provider = SdkTracerProvider::builder()
            .with_simple_exporter(Keep(Arc::clone(&finished)))
            .build();
        let subscriber = tracing_subscriber::registry()
            .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("idem-test")));
        let cx = TraceContext::new(GOOD, Some("rojo=00f067aa0ba902b7")).expect("valid");
        tracing::subscriber::with_default(subscriber, || {
            let child = tracing::info_span!("continued");
            cx.set_as_parent_of(&child);
            let seen = TraceContext::of_span(&child).expect("an OpenTelemetry span");
            assert_eq!(seen.trace_id(), cx.trace_id());
            assert_ne!(seen.span_id(), cx.span_id(), "a span of its own");
            child.in_scope(|| {});
            drop(child);
            let alone = tracing::info_span!("alone");
            alone.in_scope(|| {});
        });
        let finished = finished.lock().expect("spans");
        let span = |name: &str| {
            finished
                .iter()
                .find(|s| s.name == name)
                .unwrap_or_else(|| panic!("{name} exported: {finished:?}"))
        };
        let continued = span("continued");
        assert_eq!(continued.span_context.trace_id().to_string(), cx.trace_id());
        assert_eq!(continued.parent_span_id.to_string(), cx.span_id());
        let alone = span("alone");
        assert_ne!(alone.span_context.trace_id().to_string(), cx.trace_id());
        assert_ne!(alone.parent_span_id.to_string(), cx.span_id());
    }
}
