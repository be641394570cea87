//! What the payments tests share: databases in schemas of their own, a
//! bus of their own on NATS or Kafka, the services in-process on
//! ephemeral loopback ports, orders.

#![allow(dead_code, unreachable_pub)]

use std::net::SocketAddr;
use std::time::Duration;

use axum::http::{Method, StatusCode};
use idem_messaging::{ConsumerStats, RelayStats};
use idem_postgres::sqlx;
use idem_testkit::client::send;
use idem_testkit::isolated::PgSchema;
use idem_testkit::servers::{PrivateKafka, PrivateNats};
use payments::api::{Api, ApiConfig};
use payments::orders::Orders;
use payments::provider::Provider;
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// Serves `router` on an ephemeral loopback port for the rest of the test.
pub async fn serve(router: axum::Router) -> SocketAddr {
    let (addr, _) = payments::serve(
        "127.0.0.1:0".parse().expect("addr"),
        router,
        std::future::pending(),
    )
    .await
    .expect("serve");
    addr
}

/// Creates an order of `amount_cents` EUR; returns its id.
pub async fn create_order(orders: SocketAddr, amount_cents: i64) -> String {
    let r = send(
        orders,
        Method::POST,
        "/v1/orders",
        &[
            ("authorization", "Bearer shop-1"),
            ("content-type", "application/json"),
        ],
        format!(r#"{{"amount_cents":{amount_cents},"currency":"EUR"}}"#),
    )
    .await;
    assert_eq!(r.status, StatusCode::CREATED);
    let order: serde_json::Value = serde_json::from_slice(&r.body).expect("order");
    order["id"].as_str().expect("id").to_owned()
}

/// One number from `sql`.
pub async fn scalar(pool: &sqlx::PgPool, sql: &str) -> i64 {
    sqlx::query_scalar(sql)
        .fetch_one(pool)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"))
}

/// Waits (up to a minute) until `done` says so.
pub async fn wait_for(what: &str, mut done: impl AsyncFnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while !done().await {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The broker a test's [`World`] runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum On {
    /// The loopback NATS with JetStream (streams of the test's own).
    Nats,
    /// A NATS server of the test's own ([`PrivateNats`]), running as long
    /// as the world; the test may restart it.
    PrivateNats,
    /// The loopback Kafka-protocol broker (topics and group of the
    /// test's own).
    Kafka,
    /// A Kafka-protocol broker of the test's own ([`PrivateKafka`]),
    /// running as long as the world.
    PrivateKafka,
}

impl On {
    /// For labels and messages.
    pub fn name(self) -> &'static str {
        match self {
            Self::Nats | Self::PrivateNats => "nats",
            Self::Kafka | Self::PrivateKafka => "kafka",
        }
    }
}

/// A broker of a world's own.
pub enum Private {
    /// See [`PrivateNats`].
    Nats(PrivateNats),
    /// See [`PrivateKafka`].
    Kafka(PrivateKafka),
}

/// One run's world: the Payment API's and the Order service's databases
/// (schemas of their own) and a bus (stream, topics, prefix and consumer
/// group of its own, streams or topics created).
pub struct World {
    pub pg: String,
    pub pay_schema: String,
    pub ord_schema: String,
    pub pay_db: String,
    pub ord_db: String,
    pub bus: payments::Bus,
    /// The world's own broker ([`On::PrivateNats`], [`On::PrivateKafka`]);
    /// dropping it stops the broker.
    pub private: Option<Private>,
    /// The two schemas, dropped with the world.
    schemas: [PgSchema; 2],
}

/// A [`World`] on NATS named after `label`, or `None` (skip) without
/// PostgreSQL and NATS.
pub async fn world(label: &str) -> Option<World> {
    world_on(label, On::Nats).await
}

/// A [`World`] on `on` named after `label`, or `None` (skip) without
/// PostgreSQL or the broker. Kafka consumers get the tests' 6 s session
/// timeout (a Tansu group join takes about half of it).
pub async fn world_on(label: &str, on: On) -> Option<World> {
    let pg = idem_testkit::services::postgres()?;
    let (broker, private) = match on {
        On::Nats => (idem_testkit::services::nats()?, None),
        On::PrivateNats => {
            let nats = PrivateNats::start()?;
            (nats.url(), Some(Private::Nats(nats)))
        }
        On::Kafka => (idem_testkit::services::kafka()?, None),
        On::PrivateKafka => {
            let kafka = PrivateKafka::start()?;
            (kafka.url(), Some(Private::Kafka(kafka)))
        }
    };
    let tag = idem::OwnerToken::random().to_string()[..8].to_owned();
    let schemas = [
        PgSchema::on(&pg, &format!("pay_{label}")),
        PgSchema::on(&pg, &format!("ord_{label}")),
    ];
    let (pay_schema, ord_schema) = (schemas[0].name().to_owned(), schemas[1].name().to_owned());
    let (pay_db, ord_db) = (schemas[0].url(), schemas[1].url());
    let mut bus = payments::Bus::new(&broker);
    bus.stream = format!("{label}_{tag}").to_uppercase();
    bus.prefix = format!("{label}{tag}");
    if bus.kind() == Ok(payments::Broker::Kafka) {
        bus.session_timeout = idem_testkit::kafka::SESSION_TIMEOUT;
    }
    bus.ensure_destinations().await.expect("streams or topics");
    Some(World {
        pg,
        pay_schema,
        ord_schema,
        pay_db,
        ord_db,
        bus,
        private,
        schemas,
    })
}

impl World {
    /// `sql` with `SCHEMA.` naming the Payment API's schema.
    pub fn in_payments(&self, sql: &str) -> String {
        sql.replace("SCHEMA.", &format!("\"{}\".", self.pay_schema))
    }

    /// `sql` with `SCHEMA.` naming the Order service's schema.
    pub fn in_orders(&self, sql: &str) -> String {
        sql.replace("SCHEMA.", &format!("\"{}\".", self.ord_schema))
    }

    /// Runs the services in-process until [`Running::stop`]: the
    /// provider, the Order service (HTTP and consumer), the Payment API
    /// (provider timeout 500 ms, lease 2 s, refusing payments the Order
    /// service would) and a relay for each outbox.
    pub async fn run(&self) -> Running {
        let (stop, stopped) = watch::channel(false);
        let until_stopped = || {
            let mut stopped = stopped.clone();
            async move {
                let _ = stopped.wait_for(|s| *s).await;
            }
        };
        let provider = serve(Provider::default().router()).await;
        let orders = Orders::connect(&self.ord_db).await.expect("orders");
        let orders_addr = serve(orders.router()).await;
        let mut config = ApiConfig::new(&self.pay_db, &format!("http://{provider}"));
        config.orders = Some(format!("http://{orders_addr}"));
        config.provider_timeout = Duration::from_millis(500);
        config.lease = Duration::from_secs(2);
        let api = Api::connect(config).await.expect("api");
        let api_addr = serve(api.router()).await;
        let relays: Vec<_> = [self.pay_db.clone(), self.ord_db.clone()]
            .map(|db| {
                let (bus, stop) = (self.bus.clone(), until_stopped());
                tokio::spawn(async move { bus.run_relay(&db, stop).await.expect("relay") })
            })
            .into();
        let consumer = {
            let (bus, orders, stop) = (self.bus.clone(), orders.clone(), until_stopped());
            tokio::spawn(async move {
                bus.run_order_consumer(&orders, stop)
                    .await
                    .expect("consumer")
            })
        };
        Running {
            provider,
            orders_addr,
            api_addr,
            orders,
            api,
            stop,
            relays,
            consumer,
        }
    }

    /// Deletes the world's streams on NATS; its schemas go when it is
    /// dropped. (Kafka topics stay: a private broker goes with the world,
    /// and the shared one keeps them in memory under the world's own
    /// prefix.)
    pub async fn clean_up(&self) {
        if self.bus.kind() == Ok(payments::Broker::Nats)
            && let Ok(client) = async_nats::connect(&self.bus.broker).await
        {
            let js = async_nats::jetstream::new(client);
            let _ = js.delete_stream(&self.bus.stream).await;
            let _ = js.delete_stream(self.bus.parked_stream()).await;
        }
    }
}

/// The services of [`World::run`].
pub struct Running {
    /// The fake provider.
    pub provider: SocketAddr,
    /// The Order service's HTTP.
    pub orders_addr: SocketAddr,
    /// The Payment API.
    pub api_addr: SocketAddr,
    /// The Order service (its database: `orders.store().pool()`).
    pub orders: Orders,
    /// The Payment API (its database: `api.store().pool()`).
    pub api: Api,
    stop: watch::Sender<bool>,
    relays: Vec<JoinHandle<RelayStats>>,
    consumer: JoinHandle<ConsumerStats>,
}

impl Running {
    /// Stops the relays and the consumer (each finishes what it has in
    /// hand); returns what the consumer did.
    pub async fn stop(self) -> ConsumerStats {
        let _ = self.stop.send(true);
        for relay in self.relays {
            let _ = relay.await;
        }
        self.consumer.await.expect("consumer")
    }
}
