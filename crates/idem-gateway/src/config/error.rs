//! [`ConfigError`]: what is wrong with the configuration, ready to print.

/// A configuration error, ready to print: the file, the line, the key,
/// the value and why (or the flag or environment variable), never a
/// secret. Where a file or a parser failed underneath, that cause is its
/// [`source`](std::error::Error::source) (and its text is in the message
/// already, so [`error_chain`](crate::error::error_chain) shows it once).
#[derive(Debug)]
pub struct ConfigError {
    message: String,
    source: Option<Box<dyn std::error::Error + Send + Sync + 'static>>,
}

impl ConfigError {
    /// An error whose message says it all.
    pub(crate) fn new(message: impl Into<String>) -> Self {
        Self {
            message: message.into(),
            source: None,
        }
    }

    /// An error with a cause underneath; `message` already carries its text.
    pub(crate) fn caused(
        message: impl Into<String>,
        source: impl std::error::Error + Send + Sync + 'static,
    ) -> Self {
        Self {
            message: message.into(),
            source: Some(Box::new(source)),
        }
    }

    /// The message.
    pub fn message(&self) -> &str {
        &self.message
    }

    /// The same error with its message changed by `f` (the cause kept).
    pub(crate) fn map_message(self, f: impl FnOnce(String) -> String) -> Self {
        Self {
            message: f(self.message),
            source: self.source,
        }
    }
}

impl std::error::Error for ConfigError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source
            .as_deref()
            .map(|e| e as &(dyn std::error::Error + 'static))
    }
}

impl std::fmt::Display for ConfigError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}
