//! W3C Trace Context across the broker, against real PostgreSQL and NATS
//! JetStream: a row enqueued with a `traceparent` is published with the
//! same trace id, the consumer runner handles it inside a span of that
//! trace, and what its handler enqueues carries the trace on.
//!
//! Run with `--features otel` as well: the spans are then OpenTelemetry
//! spans (an in-process tracer provider keeps the finished ones), and the
//! test checks the chain of parents: row → relay publish → handler →
//! the handler's own row.

use crate::common;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use common::{Db, unique};
use idem_messaging::headers::{AGGREGATE_ID, TRACEPARENT, TRACESTATE};
use idem_messaging::trace::TraceContext;
use idem_messaging::{
    Consumer, ConsumerOptions, Handler, HandlerError, JetStreamSource, JetStreamSourceOptions,
    Message, NatsPublisher, Relay, RelayOptions,
};
use idem_postgres::PgOptions;
use idem_postgres::outbox::{Outbox, OutboxMessage};
use idem_postgres::sqlx::{self, Postgres, Transaction};
use tracing::Instrument as _;
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing_subscriber::Layer;
use tracing_subscriber::layer::{Context, SubscriberExt as _};
use tracing_subscriber::registry::LookupSpan;

/// `trace_id` fields of the spans of this test binary: (span name, value).
type Fields = Arc<Mutex<Vec<(String, String)>>>;

/// What the test binary's subscriber saw.
struct Seen {
    fields: Fields,
    #[cfg(feature = "otel")]
    otel: otel::Finished,
}

/// The process's subscriber (installed once; tests tell their spans apart
/// by trace id): a layer that keeps every span's `trace_id` field and,
/// with `otel`, the OpenTelemetry layer over an in-process provider.
fn seen() -> &'static Seen {
    static SEEN: OnceLock<Seen> = OnceLock::new();
    SEEN.get_or_init(|| {
        let fields = Fields::default();
        let registry = tracing_subscriber::registry().with(TraceIds(Arc::clone(&fields)));
        #[cfg(feature = "otel")]
        let (registry, otel) = {
            let (layer, otel) = otel::layer();
            (registry.with(layer), otel)
        };
        tracing::subscriber::set_global_default(registry).expect("subscriber");
        Seen {
            fields,
            #[cfg(feature = "otel")]
            otel,
        }
    })
}

impl Seen {
    /// The names of the spans whose `trace_id` field is `trace_id`.
    fn spans_with_trace_id(&self, trace_id: &str) -> Vec<String> {
        self.fields
            .lock()
            .expect("fields")
            .iter()
            .filter(|(_, v)| v == trace_id)
            .map(|(n, _)| n.clone())
            .collect()
    }
}

/// Keeps the `trace_id` field of every span, made with it or recorded
/// later.
struct TraceIds(Fields);

struct TraceIdVisitor(Option<String>);

impl Visit for TraceIdVisitor {
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "trace_id" {
            self.0 = Some(value.to_owned());
        }
    }

    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() == "trace_id" {
            self.0 = Some(format!("{value:?}"));
        }
    }
}

impl<S> Layer<S> for TraceIds
where
    S: tracing::Subscriber + for<'a> LookupSpan<'a>,
{
    fn on_new_span(&self, attrs: &Attributes<'_>, _: &Id, _: Context<'_, S>) {
        let mut visitor = TraceIdVisitor(None);
        attrs.record(&mut visitor);
        if let Some(value) = visitor.0 {
            let name = attrs.metadata().name().to_owned();
            self.0.lock().expect("fields").push((name, value));
        }
    }

    fn on_record(&self, id: &Id, values: &Record<'_>, ctx: Context<'_, S>) {
        let mut visitor = TraceIdVisitor(None);
        values.record(&mut visitor);
        if let (Some(value), Some(span)) = (visitor.0, ctx.span(id)) {
            let name = span.name().to_owned();
            self.0.lock().expect("fields").push((name, value));
        }
    }
}

#[cfg(feature = "otel")]
mod otel {
    use std::sync::{Arc, Mutex};

    use opentelemetry::trace::TracerProvider as _;
    use opentelemetry_sdk::error::OTelSdkResult;
    use opentelemetry_sdk::trace::{SdkTracerProvider, SpanData, SpanExporter};

    /// The finished OpenTelemetry spans.
    pub(crate) type Finished = Arc<Mutex<Vec<SpanData>>>;

    /// Keeps what it is given.
    #[derive(Debug)]
    struct Keep(Finished);

    impl SpanExporter for Keep {
        fn export(
            &self,
            batch: Vec<SpanData>,
        ) -> impl std::future::Future<Output = OTelSdkResult> + Send {
            self.0.lock().expect("spans").extend(batch);
            std::future::ready(Ok(()))
        }
    }

    /// The OpenTelemetry layer over a provider that exports each span as
    /// it ends (always sampled, unless a parent says otherwise).
    pub(crate) fn layer<S>() -> (impl tracing_subscriber::Layer<S>, Finished)
    where
        S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
    {
        let finished = Finished::default();
        let provider = SdkTracerProvider::builder()
            .with_simple_exporter(Keep(Arc::clone(&finished)))
            .build();
        let layer = tracing_opentelemetry::layer().with_tracer(provider.tracer("idem-test"));
        (layer, finished)
    }
}

/// A trace id and a span id no other test run uses.
fn random_ids() -> (String, String) {
    let bits = idem::OwnerToken::random().as_u128() | 1;
    let span = idem::OwnerToken::random().as_u128() as u64 | 1;
    (format!("{bits:032x}"), format!("{span:016x}"))
}

/// The handler: keeps each message, and enqueues two `order` events per
/// payment: `OrderPaid` plainly (its trace context comes from the
/// handler's span, with `otel`) and `OrderPaidExplicit` with the message's
/// context given explicitly.
#[derive(Clone, Default)]
struct Orders {
    handled: Arc<Mutex<Vec<Message>>>,
}

impl Handler for Orders {
    async fn handle(
        &self,
        tx: &mut Transaction<'static, Postgres>,
        msg: &Message,
    ) -> Result<(), HandlerError> {
        self.handled.lock().expect("handled").push(msg.clone());
        let payment = msg
            .header(AGGREGATE_ID)
            .ok_or_else(|| HandlerError::permanent("no aggregate id"))?;
        let order = format!("for_{payment}");
        let plain = OutboxMessage::new("order", &order, "OrderPaid", "{}")?;
        Outbox::enqueue(tx, &plain).await?;
        let mut explicit = OutboxMessage::new("order", &order, "OrderPaidExplicit", "{}")?;
        if let Some(cx) = msg.trace_context() {
            explicit = explicit.with_trace_context(cx.traceparent(), cx.tracestate())?;
        }
        Outbox::enqueue(tx, &explicit).await?;
        Ok(())
    }
}

/// The trace context stored with each row of `aggregate_type`, by
/// (aggregate id, message type).
async fn stored(db: &Db, aggregate_type: &str) -> BTreeMap<(String, String), Option<TraceContext>> {
    let rows: Vec<(String, String, String)> = sqlx::query_as(
        "SELECT aggregate_id, message_type, headers::text FROM idem_outbox WHERE aggregate_type = $1",
    )
    .bind(aggregate_type)
    .fetch_all(db.store.pool())
    .await
    .expect("rows");
    rows.into_iter()
        .map(|(id, kind, headers)| {
            let headers: BTreeMap<String, String> =
                serde_json::from_str(&headers).expect("headers");
            let cx =
                TraceContext::from_headers(headers.iter().map(|(n, v)| (n.as_str(), v.as_str())));
            ((id, kind), cx)
        })
        .collect()
}

/// Waits (at most 30 s) until `done` holds.
async fn wait_for<F, Fut>(what: &str, done: F)
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while !done().await {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{what}: not in 30 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trace_goes_from_a_row_through_the_broker_to_the_handler_rows() {
    let seen = seen();
    let prefix = unique("trace");
    let (Some(db), Some(nats)) = (Db::new("trace").await, idem_testkit::services::nats()) else {
        return;
    };
    let stream = prefix.to_uppercase();
    let publisher = NatsPublisher::connect(&nats, &stream).await.expect("NATS");
    let _ = publisher.jetstream().delete_stream(&stream).await;
    common::create_stream(|| {
        publisher.create_stream(vec![format!("{prefix}.>")], Duration::from_secs(120))
    })
    .await;

    // A payment enqueued in a traced request (explicit context), and one
    // without a trace.
    let (trace_id, row_span) = random_ids();
    let traceparent = format!("00-{trace_id}-{row_span}-01");
    let tracestate = "rojo=00f067aa0ba902b7";
    let mut tx = db.store.pool().begin().await.expect("begin");
    let traced = OutboxMessage::new("payment", "pay_1", "PaymentAuthorized", "{}")
        .and_then(|m| m.with_trace_context(&traceparent, Some(tracestate)))
        .expect("message");
    Outbox::enqueue(&mut tx, &traced).await.expect("enqueue");
    let untraced =
        OutboxMessage::new("payment", "pay_2", "PaymentAuthorized", "{}").expect("message");
    Outbox::enqueue(&mut tx, &untraced).await.expect("enqueue");
    tx.commit().await.expect("commit");
    let payments = stored(&db, "payment").await;
    assert_eq!(
        payments[&("pay_1".to_owned(), "PaymentAuthorized".to_owned())]
            .as_ref()
            .map(|cx| (cx.traceparent(), cx.tracestate())),
        Some((traceparent.as_str(), Some(tracestate))),
        "the row keeps the context it was given"
    );
    assert_eq!(
        payments[&("pay_2".to_owned(), "PaymentAuthorized".to_owned())],
        None
    );

    // The relay publishes both.
    let options = PgOptions::from_url(&db.url).expect("url");
    let relay = Relay::new(
        db.pool(),
        options.connect_options().clone(),
        &db.schema,
        publisher,
        RelayOptions {
            prefix: prefix.clone(),
            ..RelayOptions::default()
        },
    );
    let stop = Arc::new(tokio::sync::Notify::new());
    let relaying = tokio::spawn({
        let stop = Arc::clone(&stop);
        relay.run(async move { stop.notified().await })
    });
    let pool = db.pool();
    wait_for("both rows published", || {
        let pool = pool.clone();
        async move { count(&pool, "SELECT count(*) FROM idem_outbox WHERE aggregate_type = 'payment' AND state = 'published'").await == 2 }
    })
    .await;
    stop.notify_one();
    let stats = relaying.await.expect("relay");
    assert_eq!(stats.published, 2, "{stats:?}");

    // The runner handles both; its handler enqueues the order events.
    let client = async_nats::connect(&nats).await.expect("NATS");
    let source = JetStreamSource::bind(
        client,
        &JetStreamSourceOptions::new(&stream, "orders", &format!("{prefix}_parked.orders")),
    )
    .await
    .expect("bind");
    let handler = Orders::default();
    let consumer = Consumer::new(db.pool(), handler.clone(), ConsumerOptions::new("orders"));
    let stop = Arc::new(tokio::sync::Notify::new());
    let consuming = tokio::spawn({
        let stop = Arc::clone(&stop);
        async move {
            consumer
                .run(source, async move { stop.notified().await })
                .await
        }
    });
    wait_for("both messages handled", || {
        let pool = pool.clone();
        async move {
            count(
                &pool,
                "SELECT count(*) FROM idem_outbox WHERE aggregate_type = 'order'",
            )
            .await
                == 4
        }
    })
    .await;
    stop.notify_one();
    let stats = consuming.await.expect("consumer");
    assert_eq!(stats.applied, 2, "{stats:?}");

    // On the broker: the traced payment carries its trace, the other none.
    let handled = handler.handled.lock().expect("handled").clone();
    let message = |payment: &str| {
        handled
            .iter()
            .find(|m| m.header(AGGREGATE_ID) == Some(payment))
            .cloned()
            .expect("handled")
    };
    let published = message("pay_1").trace_context().expect("a traceparent");
    assert_eq!(
        published.trace_id(),
        trace_id,
        "the same trace on the broker"
    );
    assert_eq!(published.tracestate(), Some(tracestate));
    let untraced = message("pay_2");
    assert!(
        untraced.header(TRACEPARENT).is_none() && untraced.header(TRACESTATE).is_none(),
        "{:?}",
        untraced.headers
    );

    // The handler's rows: given explicitly, the message's context; taken
    // from the handler's span (otel), the same trace, the span's own id.
    let orders = stored(&db, "order").await;
    let order =
        |payment: &str, kind: &str| orders[&(format!("for_{payment}"), kind.to_owned())].clone();
    let explicit = order("pay_1", "OrderPaidExplicit").expect("the message's context");
    assert_eq!(explicit, published);

    // Both spans name the trace, with or without OpenTelemetry.
    let names = seen.spans_with_trace_id(&trace_id);
    assert!(
        names.iter().any(|n| n == "idem.publish") && names.iter().any(|n| n == "idem.consume"),
        "{names:?}"
    );

    #[cfg(not(feature = "otel"))]
    {
        // Without OpenTelemetry the relay sends the row's context as it
        // is, and a handler's enqueue has no span context to take.
        assert_eq!(published.traceparent(), traceparent);
        assert_eq!(order("pay_1", "OrderPaid"), None);
        assert_eq!(order("pay_2", "OrderPaid"), None);
        assert_eq!(order("pay_2", "OrderPaidExplicit"), None);
    }
    #[cfg(feature = "otel")]
    {
        use opentelemetry::trace::SpanKind;

        // The message carries the relay's publish span, not the row's.
        assert_ne!(published.span_id(), row_span);
        let handler_row = order("pay_1", "OrderPaid").expect("the handler's span context");
        assert_eq!(
            handler_row.trace_id(),
            trace_id,
            "the same trace, one hop on"
        );
        assert_ne!(handler_row.span_id(), row_span);
        assert_ne!(handler_row.span_id(), published.span_id());
        // An untraced message starts a trace of its own in the handler.
        let own = order("pay_2", "OrderPaid").expect("the handler's own trace");
        assert_ne!(own.trace_id(), trace_id);
        // With no context to give, the explicit path falls back on it too.
        assert_eq!(order("pay_2", "OrderPaidExplicit"), Some(own));

        let finished = seen.otel.lock().expect("spans").clone();
        let in_trace: Vec<_> = finished
            .iter()
            .filter(|s| s.span_context.trace_id().to_string() == trace_id)
            .collect();
        let publish = in_trace
            .iter()
            .find(|s| s.span_kind == SpanKind::Producer)
            .expect("the publish span");
        let consume = in_trace
            .iter()
            .find(|s| s.span_kind == SpanKind::Consumer)
            .expect("the handler's span");
        assert_eq!(
            publish.name,
            format!("publish {prefix}.payment.PaymentAuthorized")
        );
        assert_eq!(
            publish.parent_span_id.to_string(),
            row_span,
            "the publish is the row's child"
        );
        assert!(publish.parent_span_is_remote);
        assert_eq!(
            publish.span_context.span_id().to_string(),
            published.span_id()
        );
        assert_eq!(
            consume.parent_span_id,
            publish.span_context.span_id(),
            "the handler is the publish's child"
        );
        assert_eq!(
            consume.span_context.span_id().to_string(),
            handler_row.span_id()
        );
        assert!(
            consume
                .attributes
                .iter()
                .any(|kv| kv.key.as_str() == "idem.outcome" && kv.value.as_str() == "applied"),
            "{:?}",
            consume.attributes
        );
    }
    db.drop().await;
}

/// Enqueue in the application's own span: with `otel`, the row takes that
/// span's context; an explicit context wins over it. Without `otel`, only
/// the explicit one is stored.
#[tokio::test]
async fn enqueue_takes_the_current_span_unless_given_a_context() {
    let _ = seen();
    let Some(db) = Db::new("trace_enqueue").await else {
        return;
    };
    let (trace_id, span_id) = random_ids();
    let given = format!("00-{trace_id}-{span_id}-01");
    let span = tracing::info_span!("checkout");
    async {
        let mut tx = db.store.pool().begin().await.expect("begin");
        let plain = OutboxMessage::new("payment", "pay_1", "PaymentAuthorized", "{}").expect("ok");
        Outbox::enqueue(&mut tx, &plain).await.expect("enqueue");
        let explicit = OutboxMessage::new("payment", "pay_1", "PaymentCaptured", "{}")
            .and_then(|m| m.with_trace_context(&given, None))
            .expect("ok");
        Outbox::enqueue(&mut tx, &explicit).await.expect("enqueue");
        // A malformed context is refused before it reaches the table.
        let refused = OutboxMessage::new("payment", "pay_1", "PaymentRefunded", "{}")
            .expect("ok")
            .with_trace_context(&given.to_uppercase(), None);
        assert!(refused.is_err());
        tx.commit().await.expect("commit");
    }
    .instrument(span.clone())
    .await;
    let rows = stored(&db, "payment").await;
    let row = |kind: &str| rows[&("pay_1".to_owned(), kind.to_owned())].clone();
    assert_eq!(
        row("PaymentCaptured").map(|cx| cx.traceparent().to_owned()),
        Some(given),
        "the explicit context wins"
    );
    assert_eq!(rows.len(), 2);
    #[cfg(feature = "otel")]
    {
        let own = TraceContext::of_span(&span).expect("an OpenTelemetry span");
        assert_eq!(row("PaymentAuthorized"), Some(own));
    }
    #[cfg(not(feature = "otel"))]
    assert_eq!(row("PaymentAuthorized"), None);
    db.drop().await;
}

/// The single number `sql` selects.
async fn count(pool: &sqlx::PgPool, sql: &str) -> i64 {
    sqlx::query_scalar(sql)
        .fetch_one(pool)
        .await
        .expect("count")
}
