//! # payments — idem's reference Payment API and Order service
//!
//! The production pattern idem exists for, built only on idem's public
//! API: a [Payment API](api) that never charges twice (the `idem-http`
//! layer, the PostgreSQL store, the provider called with a stable operation
//! id, payment + outbox event + idempotency record in one transaction, a
//! reconciliation worker for unknown outcomes) in front of a
//! [fake provider](provider) that fails like real ones, and an
//! [Order service](orders) that applies each payment once (outbox → NATS
//! JetStream → consumer runner with the inbox).

pub mod api;
pub mod orders;
pub mod provider;

/// Where the services' events travel: a JetStream stream capturing
/// `<prefix>.>`, and a second one for what the Order service parks.
#[derive(Debug, Clone)]
pub struct Bus {
    /// NATS with JetStream.
    pub nats: String,
    /// The event stream.
    pub stream: String,
    /// Subject prefix (`<prefix>.<aggregate_type>.<message_type>`).
    pub prefix: String,
}

impl Bus {
    /// Stream `PAYMENTS`, prefix `idem`.
    pub fn new(nats: &str) -> Self {
        Self {
            nats: nats.to_owned(),
            stream: "PAYMENTS".to_owned(),
            prefix: "idem".to_owned(),
        }
    }

    /// Where the Order service parks events it refuses.
    pub fn parked_subject(&self) -> String {
        format!("{}_parked.orders", self.prefix)
    }

    /// The stream capturing the parked subject.
    pub fn parked_stream(&self) -> String {
        format!("{}_PARKED", self.stream)
    }

    /// Creates the event stream and the parked-messages stream if missing
    /// (duplicate window 5 minutes).
    pub async fn ensure_streams(&self) -> Result<(), String> {
        for (stream, subject) in [
            (self.stream.clone(), format!("{}.>", self.prefix)),
            (self.parked_stream(), self.parked_subject()),
        ] {
            idem_messaging::NatsPublisher::connect(&self.nats, &stream)
                .await
                .map_err(|e| e.to_string())?
                .create_stream(vec![subject], std::time::Duration::from_secs(300))
                .await
                .map_err(|e| e.to_string())?;
        }
        Ok(())
    }

    /// Runs the Order service's consumer: `PaymentAuthorized` events from
    /// the stream, through the inbox, until `stop`.
    pub async fn run_order_consumer(
        &self,
        orders: &orders::Orders,
        stop: impl std::future::Future<Output = ()> + Send,
    ) -> Result<idem_messaging::ConsumerStats, String> {
        let client = async_nats::connect(&self.nats)
            .await
            .map_err(|e| format!("cannot connect to NATS at {}: {e}", self.nats))?;
        let mut options = idem_messaging::JetStreamSourceOptions::new(
            &self.stream,
            orders::CONSUMER,
            &self.parked_subject(),
        );
        options.filter_subjects = vec![format!("{}.payment.PaymentAuthorized", self.prefix)];
        options.ack_wait = std::time::Duration::from_secs(10);
        let source = idem_messaging::JetStreamSource::bind(client, &options)
            .await
            .map_err(|e| e.to_string())?;
        let consumer = idem_messaging::Consumer::new(
            orders.store().pool().clone(),
            orders::PaymentHandler,
            idem_messaging::ConsumerOptions::new(orders::CONSUMER),
        );
        Ok(consumer.run(source, stop).await)
    }

    /// Runs a relay over the outbox in `database` (its `schema=` names it)
    /// to the stream, until `stop`.
    pub async fn run_relay(
        &self,
        database: &str,
        stop: impl std::future::Future<Output = ()> + Send,
    ) -> Result<idem_messaging::RelayStats, String> {
        let opts = idem_postgres::PgOptions::from_url(database).map_err(|e| e.to_string())?;
        let namespace = opts.schema().unwrap_or("public").to_owned();
        let lock_options = opts.connect_options().clone();
        let store = idem_postgres::PgStore::connect_with(opts)
            .await
            .map_err(|e| e.to_string())?;
        let publisher = idem_messaging::NatsPublisher::connect(&self.nats, &self.stream)
            .await
            .map_err(|e| e.to_string())?;
        let relay = idem_messaging::Relay::new(
            store.pool().clone(),
            lock_options,
            &namespace,
            publisher,
            idem_messaging::RelayOptions {
                prefix: self.prefix.clone(),
                ..idem_messaging::RelayOptions::default()
            },
        );
        Ok(relay.run(stop).await)
    }
}

/// Binds `addr` and serves `router` until `stop` completes; returns the
/// bound address and the server task.
pub async fn serve(
    addr: std::net::SocketAddr,
    router: axum::Router,
    stop: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(std::net::SocketAddr, tokio::task::JoinHandle<()>), String> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| format!("cannot listen on {addr}: {e}"))?;
    let bound = listener.local_addr().map_err(|e| e.to_string())?;
    let task = tokio::spawn(async move {
        if let Err(err) = axum::serve(listener, router)
            .with_graceful_shutdown(stop)
            .await
        {
            tracing::error!(%err, "server failed");
        }
    });
    Ok((bound, task))
}

/// Connects to `database` (idem's tables are created by migration) and
/// creates the service's own table with `ddl`.
pub async fn connect_store(database: &str, ddl: &str) -> Result<idem_postgres::PgStore, String> {
    let opts = idem_postgres::PgOptions::from_url(database).map_err(|e| e.to_string())?;
    let store = idem_postgres::PgStore::connect_with(opts)
        .await
        .map_err(|e| e.to_string())?;
    idem_postgres::sqlx::query(ddl)
        .execute(store.pool())
        .await
        .map_err(|e| format!("cannot create the service's table: {e}"))?;
    Ok(store)
}

/// An RFC 9457 problem body with this example's types.
pub fn problem(
    status: axum::http::StatusCode,
    kind: &str,
    detail: impl Into<String>,
) -> (axum::http::StatusCode, String) {
    let body = serde_json::json!({
        "type": format!("https://idem.example/problems/{kind}"),
        "title": kind.replace('_', " "),
        "status": status.as_u16(),
        "detail": detail.into(),
    });
    (status, body.to_string())
}

/// [`problem`] as an `application/problem+json` response.
pub fn problem_response(
    status: axum::http::StatusCode,
    kind: &str,
    detail: impl Into<String>,
) -> axum::response::Response {
    use axum::response::IntoResponse;
    let (status, body) = problem(status, kind, detail);
    (
        status,
        [(axum::http::header::CONTENT_TYPE, "application/problem+json")],
        body,
    )
        .into_response()
}
