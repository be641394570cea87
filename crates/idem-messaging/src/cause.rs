//! The crate's errors read as one line (`what failed: why`) and keep the
//! error behind them as their source.

use idem::store::BoxError;

/// A message and the error behind it: shows as `message: source`, and the
/// source stays the error's [`source`](std::error::Error::source).
/// [`PublishError`](crate::PublishError), [`HandlerError`](crate::HandlerError)
/// and [`SettleError`](crate::SettleError) wrap it (transparently) so that
/// their text reads as one line while the cause keeps its type.
#[derive(Debug, thiserror::Error)]
#[error("{message}: {source}")]
pub(crate) struct Caused {
    message: String,
    #[source]
    source: BoxError,
}

/// `message` caused by `source`, boxed.
pub(crate) fn caused(message: impl Into<String>, source: impl Into<BoxError>) -> BoxError {
    Box::new(Caused {
        message: message.into(),
        source: source.into(),
    })
}
