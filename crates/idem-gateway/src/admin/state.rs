//! [`AdminState`]: what every admin handler shares.

use std::sync::Arc;
use std::time::Duration;

use crate::store::GatewayStore;

/// What the admin routes share.
#[derive(Debug, Clone)]
pub struct AdminState {
    /// The gateway's store.
    pub store: GatewayStore,
    /// The bearer token, if one is configured.
    pub token: Option<Arc<str>>,
    /// Retention of records resolved by hand when the request names none.
    pub default_retention: Duration,
}
