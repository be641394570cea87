//! A message as the handler sees it, whatever the broker.

use super::error::HandlerError;
use crate::headers;
use crate::trace::TraceContext;
use bytes::Bytes;

/// A message as the handler sees it, whatever the broker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    /// The message id (NATS `Nats-Msg-Id`, AMQP `message_id`); for events
    /// from the relay, the row's random event id (`<source>:<row id>` for
    /// rows written before event ids). Empty when the message had none.
    pub id: String,
    /// The subject (NATS) or original routing key (RabbitMQ).
    pub subject: String,
    /// The headers, in the order they came.
    pub headers: Vec<(String, String)>,
    /// The body.
    pub payload: Bytes,
    /// How many times the broker has delivered it, this time included (1 on
    /// the first delivery).
    pub deliveries: u32,
}

impl Message {
    /// The first header called `name` (ASCII case-insensitive).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    /// The payload parsed as JSON; a payload that is not (or not of this
    /// shape) is a [`HandlerError::Permanent`]: it will never parse.
    pub fn json<T: serde::de::DeserializeOwned>(&self) -> Result<T, HandlerError> {
        serde_json::from_slice(&self.payload)
            .map_err(|e| HandlerError::permanent_with("payload is not the expected JSON", e))
    }

    /// The W3C trace context in the message's `traceparent` and
    /// `tracestate` headers; `None` without a valid `traceparent` (a
    /// malformed one is ignored, as W3C says).
    pub fn trace_context(&self) -> Option<TraceContext> {
        TraceContext::from_headers(self.headers.iter().map(|(n, v)| (n.as_str(), v.as_str())))
    }

    /// The relay's ordering headers: aggregate type, aggregate id and its
    /// sequence number. `Ok(None)` when the message has none of them; an
    /// error when they are incomplete or the sequence is not a number.
    pub fn aggregate(&self) -> Result<Option<(&str, &str, i64)>, HandlerError> {
        let kind = self.header(headers::AGGREGATE_TYPE);
        let id = self.header(headers::AGGREGATE_ID);
        let sequence = self.header(headers::SEQUENCE);
        match (kind, id, sequence) {
            (None, None, None) => Ok(None),
            (Some(kind), Some(id), Some(sequence)) => {
                let sequence = sequence.parse::<i64>().map_err(|_| {
                    HandlerError::permanent(format!(
                        "header {}: {sequence:?} is not a number",
                        headers::SEQUENCE
                    ))
                })?;
                Ok(Some((kind, id, sequence)))
            }
            _ => Err(HandlerError::permanent(format!(
                "incomplete ordering headers: {}, {} and {} go together",
                headers::AGGREGATE_TYPE,
                headers::AGGREGATE_ID,
                headers::SEQUENCE
            ))),
        }
    }
}
