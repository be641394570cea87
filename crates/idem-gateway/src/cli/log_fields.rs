//! How a text log line writes its fields: each value that a client could
//! have chosen is written so that it cannot pass for another field.
//!
//! A key, a header or a path is a client's text. Written bare, the key
//! `k reason=idempotency_executed tenant=alice` reads as three fields,
//! and one with a line break as two log lines. Here a value is written
//! bare only when it holds nothing but visible characters other than `=`,
//! `"` and `\`; any other value is written quoted and escaped, as Rust
//! writes a string (`"k reason=…"`, `"a\nb"`). Text values (`&str`
//! fields) are always quoted, as the default format does.
//!
//! ```text
//! INFO idem_http::layer: reason="idempotency_executed" key="k reason=forged" status=201
//! ```

use std::fmt::{self, Write as _};

use tracing::field::{Field, Visit};
use tracing_subscriber::field::RecordFields;
use tracing_subscriber::fmt::FormatFields;
use tracing_subscriber::fmt::format::Writer;

/// The text format's fields, quoted where they need it (see the module).
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct QuotedFields;

impl<'writer> FormatFields<'writer> for QuotedFields {
    fn format_fields<R: RecordFields>(&self, writer: Writer<'writer>, fields: R) -> fmt::Result {
        let mut visitor = Fields {
            writer,
            first: true,
            result: Ok(()),
        };
        fields.record(&mut visitor);
        visitor.result
    }
}

struct Fields<'w> {
    writer: Writer<'w>,
    first: bool,
    result: fmt::Result,
}

impl Fields<'_> {
    /// The space before every field but the first.
    fn separator(&mut self) -> &'static str {
        if std::mem::replace(&mut self.first, false) {
            ""
        } else {
            " "
        }
    }

    /// Writes a value that must be looked at first: bare when [`bare`],
    /// quoted otherwise; the message with its control characters escaped.
    fn write(&mut self, field: &Field, value: fmt::Arguments<'_>) {
        if self.result.is_err() {
            return;
        }
        let mut text = String::new();
        if let Err(e) = text.write_fmt(value) {
            self.result = Err(e);
            return;
        }
        let separator = self.separator();
        self.result = if field.name() == "message" {
            write!(self.writer, "{separator}{}", escape_lines(&text))
        } else if bare(&text) {
            write!(self.writer, "{separator}{}={text}", field.name())
        } else {
            write!(self.writer, "{separator}{}={text:?}", field.name())
        };
    }
}

/// Whether `text` can be written without quotes: not empty, and only
/// visible ASCII or non-ASCII letters, without `=`, `"` or `\`.
fn bare(text: &str) -> bool {
    !text.is_empty()
        && text
            .chars()
            .all(|c| !c.is_whitespace() && !c.is_control() && !matches!(c, '=' | '"' | '\\'))
}

/// A message is the gateway's own words, but may quote a value: it keeps
/// its spaces, and never breaks the line.
fn escape_lines(text: &str) -> std::borrow::Cow<'_, str> {
    if text.chars().any(char::is_control) {
        text.chars()
            .map(|c| {
                if c.is_control() {
                    c.escape_default().to_string()
                } else {
                    c.to_string()
                }
            })
            .collect::<String>()
            .into()
    } else {
        text.into()
    }
}

impl Visit for Fields<'_> {
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "message" {
            self.write(field, format_args!("{value}"));
        } else if self.result.is_ok() {
            // Always quoted: written as it is, with no copy to look at.
            let separator = self.separator();
            self.result = write!(self.writer, "{separator}{}={value:?}", field.name());
        }
    }

    fn record_error(&mut self, field: &Field, value: &(dyn std::error::Error + 'static)) {
        self.write(field, format_args!("{value}"));
    }

    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        self.write(field, format_args!("{value:?}"));
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use tracing_subscriber::layer::SubscriberExt;

    use super::*;

    #[derive(Clone, Default)]
    struct Captured(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Captured {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().expect("lock").extend_from_slice(buf);
            Ok(buf.len())
        }

        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    fn line(log: impl FnOnce()) -> String {
        let out = Captured::default();
        let writer = out.clone();
        let subscriber = tracing_subscriber::registry().with(
            tracing_subscriber::fmt::layer()
                .fmt_fields(QuotedFields)
                .with_ansi(false)
                .without_time()
                .with_writer(move || writer.clone()),
        );
        tracing::subscriber::with_default(subscriber, log);
        let bytes = out.0.lock().expect("lock").clone();
        String::from_utf8(bytes).expect("UTF-8")
    }

    /// A key that reads as fields, or as a second line, is one quoted
    /// value; a plain one stays bare, and text fields are quoted.
    #[test]
    fn a_client_s_value_cannot_forge_a_field_or_a_line() {
        let forged = "k reason=idempotency_executed tenant=alice";
        let text = line(|| {
            let key = forged.to_owned();
            tracing::info!(reason = "idempotency_in_progress", %key, status = 201, "seen");
        });
        assert!(
            text.contains(r#"key="k reason=idempotency_executed tenant=alice""#),
            "{text}"
        );
        assert!(
            text.contains(r#"reason="idempotency_in_progress""#),
            "{text}"
        );
        assert!(text.contains("status=201"), "{text}");
        assert_eq!(text.matches("reason=").count(), 2, "{text}");
        let text = line(|| {
            let key = "a\nINFO forged".to_owned();
            tracing::info!(%key, "two lines?");
        });
        assert_eq!(text.lines().count(), 1, "{text}");
        assert!(text.contains(r#"key="a\nINFO forged""#), "{text}");
        let text = line(|| {
            let key = "pay-1";
            tracing::info!(key = %key, empty = %"", "plain");
        });
        assert!(text.contains("key=pay-1 "), "{text}");
        assert!(text.contains(r#"empty="""#), "{text}");
    }
}
