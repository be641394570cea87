//! One row published: its subject, headers and trace context.

use crate::headers;
use crate::publisher::{Outgoing, PublishError, Published, Publisher};
use crate::trace::{TARGET, TraceContext};
use bytes::Bytes;
use idem_postgres::outbox::PendingRow;
use std::collections::BTreeMap;
use tracing::Instrument as _;
use tracing::field::Empty;

/// Publishes `out` (made from `row`): through a span when the row carries a
/// trace context (see the [module docs](super#traces)), plainly otherwise.
pub(super) async fn publish<P: Publisher>(
    publisher: &P,
    mut out: Outgoing,
    row: &PendingRow,
) -> Result<Published, PublishError> {
    let Some(parent) =
        TraceContext::from_headers(out.headers.iter().map(|(n, v)| (n.as_str(), v.as_str())))
    else {
        return publisher.publish(&out).await;
    };
    let span = tracing::info_span!(target: TARGET, "idem.publish",
        otel.name = %format_args!("publish {}", out.subject), otel.kind = "producer",
        messaging.operation.type = "send", messaging.destination.name = %out.subject,
        messaging.message.id = %out.id, idem.outbox.id = row.id, idem.sequence = row.sequence,
        trace_id = %parent.trace_id(), otel.status_code = Empty, error.type = Empty);
    if span.is_disabled() {
        return publisher.publish(&out).await;
    }
    parent.set_as_parent_of(&span);
    // The consumer continues from this publish, when it is a span of the
    // trace (OpenTelemetry); else from the row's own context.
    if let Some(own) = TraceContext::of_span(&span) {
        set_trace_headers(&mut out.headers, &own);
    }
    let result = publisher.publish(&out).instrument(span.clone()).await;
    if let Err(err) = &result {
        span.record("otel.status_code", "ERROR");
        span.record(
            "error.type",
            if err.is_broker_down() {
                "broker_down"
            } else {
                "refused"
            },
        );
    }
    result
}

/// Replaces the trace context headers in `headers` with `cx`.
pub(super) fn set_trace_headers(headers: &mut Vec<(String, String)>, cx: &TraceContext) {
    headers.retain(|(n, _)| {
        !n.eq_ignore_ascii_case(headers::TRACEPARENT)
            && !n.eq_ignore_ascii_case(headers::TRACESTATE)
    });
    headers.push((headers::TRACEPARENT.to_owned(), cx.traceparent().to_owned()));
    if let Some(state) = cx.tracestate() {
        headers.push((headers::TRACESTATE.to_owned(), state.to_owned()));
    }
}

pub(super) fn outgoing(prefix: &str, source: &str, row: &PendingRow) -> Outgoing {
    let mut list: Vec<(String, String)> =
        serde_json::from_str::<BTreeMap<String, String>>(&row.headers)
            .unwrap_or_default()
            .into_iter()
            .collect();
    list.push((
        headers::AGGREGATE_TYPE.to_owned(),
        row.aggregate_type.clone(),
    ));
    list.push((headers::AGGREGATE_ID.to_owned(), row.aggregate_id.clone()));
    list.push((headers::SEQUENCE.to_owned(), row.sequence.to_string()));
    Outgoing {
        subject: format!("{prefix}.{}.{}", row.aggregate_type, row.message_type),
        // The event id, never reused by a restored or recreated database;
        // rows older than it keep the id they may have been published under.
        id: row
            .event_id
            .clone()
            .unwrap_or_else(|| format!("{source}:{}", row.id)),
        payload: Bytes::from(row.payload.clone()),
        headers: list,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn subjects_and_headers() {
        let mut row = PendingRow {
            id: 42,
            event_id: None,
            aggregate_type: "payment".into(),
            aggregate_id: "pay_1".into(),
            sequence: 3,
            message_type: "PaymentAuthorized".into(),
            payload: "{}".into(),
            headers: r#"{"trace-id":"t"}"#.into(),
            attempts: 0,
        };
        let out = outgoing("idem", "billing", &row);
        assert_eq!(out.subject, "idem.payment.PaymentAuthorized");
        assert_eq!(
            out.id, "billing:42",
            "a row from before event ids keeps its old id"
        );
        row.event_id = Some("6f1c0e1e-2b6a-4c55-9d1e-1f0c2b3a4d5e".into());
        let out = outgoing("idem", "billing", &row);
        assert_eq!(
            out.id, "6f1c0e1e-2b6a-4c55-9d1e-1f0c2b3a4d5e",
            "the event id, not the row number"
        );
        assert!(out.headers.contains(&("Idem-Sequence".into(), "3".into())));
        assert!(out.headers.contains(&("trace-id".into(), "t".into())));
    }

    #[test]
    fn the_row_trace_context_goes_out_and_can_be_replaced() {
        let row = PendingRow {
            id: 7,
            event_id: Some("e7".into()),
            aggregate_type: "payment".into(),
            aggregate_id: "pay_1".into(),
            sequence: 1,
            message_type: "PaymentAuthorized".into(),
            payload: "{}".into(),
            headers: r#"{"traceparent":"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01","tracestate":"rojo=1"}"#.into(),
            attempts: 0,
        };
        let mut out = outgoing("idem", "billing", &row);
        let header = |out: &Outgoing, name: &str| {
            out.headers
                .iter()
                .filter(|(n, _)| n == name)
                .map(|(_, v)| v.clone())
                .collect::<Vec<_>>()
        };
        assert_eq!(
            header(&out, "traceparent"),
            ["00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"]
        );
        let publish = TraceContext::new(
            "00-4bf92f3577b34da6a3ce929d0e0e4736-b7ad6b7169203331-01",
            None,
        )
        .expect("valid");
        set_trace_headers(&mut out.headers, &publish);
        assert_eq!(
            header(&out, "traceparent"),
            ["00-4bf92f3577b34da6a3ce929d0e0e4736-b7ad6b7169203331-01"],
            "one traceparent: the publish span's"
        );
        assert!(header(&out, "tracestate").is_empty());
        assert_eq!(header(&out, "Idem-Sequence"), ["1"]);
    }
}
