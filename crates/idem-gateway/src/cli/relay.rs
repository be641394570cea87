//! `idem relay`: publishes the PostgreSQL outbox to a broker (NATS
//! JetStream or RabbitMQ), with as many relays running at once as wanted; see
//! [`idem_messaging::relay`] for the guarantees.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use axum::http::StatusCode;
use axum::routing::get;
use idem_messaging::{NatsPublisher, Publisher, RabbitPublisher, Relay, RelayOptions};
use idem_postgres::{PgOptions, PgStore};

use crate::server::error_chain;

/// What `idem relay` was asked to do.
#[derive(Debug, Clone, clap::Args)]
pub struct RelayArgs {
    /// The PostgreSQL database holding the outbox (`postgres://…`).
    #[arg(long, env = "IDEM_STORE")]
    pub store: String,
    /// The broker: `nats://host:port` (JetStream) or
    /// `amqp://user:password@host:port/vhost` (RabbitMQ).
    #[arg(long, env = "IDEM_BROKER")]
    pub broker: String,
    /// RabbitMQ: the durable topic exchange published to (declared if
    /// missing); the routing key is the subject.
    #[arg(long, env = "IDEM_EXCHANGE", default_value = "idem")]
    pub exchange: String,
    /// NATS: the JetStream stream that captures the subjects.
    #[arg(long, env = "IDEM_STREAM", default_value = "IDEM")]
    pub stream: String,
    /// Subject prefix: `<prefix>.<aggregate_type>.<message_type>`.
    #[arg(long, env = "IDEM_PREFIX", default_value = "idem")]
    pub prefix: String,
    /// Create the stream (subjects `<prefix>.>`) if it is missing.
    #[arg(long)]
    pub create_stream: bool,
    /// The duplicate window of a stream created with --create-stream.
    #[arg(long, default_value = "2m", value_parser = humantime::parse_duration)]
    pub duplicate_window: Duration,
    /// Partitions aggregates are hashed into; every relay of one outbox
    /// must use the same number.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u16).range(1..=1024))]
    pub partitions: u16,
    /// Message-id prefix (`<source>:<row id>`) of rows written before
    /// schema version 5, which have no event id of their own; default:
    /// the schema. Newer rows are published under their random event id.
    #[arg(long, env = "IDEM_SOURCE")]
    pub source: Option<String>,
    /// Attempts before a row becomes dead.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(i32).range(1..=1000))]
    pub max_attempts: i32,
    /// Admin listener: /healthz, /readyz (database and broker), /metrics.
    #[arg(
        long,
        env = "IDEM_RELAY_ADMIN_LISTEN",
        default_value = "127.0.0.1:9091"
    )]
    pub admin_listen: std::net::SocketAddr,
    /// Bearer token for /readyz and /metrics (required on a non-loopback address).
    #[arg(long, env = "IDEM_ADMIN_TOKEN", hide_env_values = true)]
    pub admin_token: Option<String>,
}

/// The relay's admin routes: `/healthz`, and behind the admin rules
/// `/readyz` (the last round reached the database and the broker) and
/// `/metrics`.
fn admin_router(ready: Arc<AtomicBool>, token: Option<Arc<str>>) -> axum::Router {
    let protected = axum::Router::new()
        .route(
            "/readyz",
            get(move || {
                let ready = ready.load(Ordering::Relaxed);
                async move {
                    if ready {
                        (StatusCode::OK, "ready\n")
                    } else {
                        (
                            StatusCode::SERVICE_UNAVAILABLE,
                            "not ready: the database or the broker is unreachable\n",
                        )
                    }
                }
            }),
        )
        .route("/metrics", get(crate::admin::metrics));
    axum::Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .merge(crate::admin::guarded(protected, token))
}

/// Runs the relay until SIGINT or SIGTERM.
pub async fn run(args: RelayArgs) -> Result<(), String> {
    let token: Option<Arc<str>> = args
        .admin_token
        .as_deref()
        .filter(|t| !t.is_empty())
        .map(Arc::from);
    if token.is_none() && !args.admin_listen.ip().is_loopback() {
        return Err(format!(
            "--admin-listen {} is not a loopback address: set an admin token (--admin-token or IDEM_ADMIN_TOKEN) first",
            args.admin_listen
        ));
    }
    let admin = tokio::net::TcpListener::bind(args.admin_listen)
        .await
        .map_err(|e| format!("cannot listen on {} (admin): {e}", args.admin_listen))?;
    crate::metrics::install();
    let opts = PgOptions::from_url(&args.store).map_err(|e| error_chain(&e))?;
    let nats = args.broker.starts_with("nats://");
    if !nats && !args.broker.starts_with("amqp://") {
        return Err(format!(
            "--broker {}: use nats://host:port (JetStream) or amqp://user:password@host:port/vhost (RabbitMQ)",
            idem::store::redact_url(&args.broker)
        ));
    }
    if args.prefix.is_empty() || args.prefix.contains(['*', '>', '#', ' ']) {
        return Err(format!(
            "--prefix {:?}: must be a non-empty subject prefix without wildcards or spaces",
            args.prefix
        ));
    }
    let namespace = opts.schema.clone().unwrap_or_else(|| "public".to_owned());
    let lock_options = opts.connect.clone();
    let store = PgStore::connect_with(opts)
        .await
        .map_err(|e| error_chain(&e))?;
    let options = RelayOptions {
        prefix: args.prefix.clone(),
        partitions: args.partitions,
        max_attempts: args.max_attempts,
        source: args.source.clone(),
        ..RelayOptions::default()
    };
    let setup = Setup {
        store,
        lock_options,
        namespace,
        options,
        admin,
        token,
        store_url: args.store.clone(),
    };
    if nats {
        let publisher = NatsPublisher::connect(&args.broker, &args.stream)
            .await
            .map_err(|e| e.to_string())?;
        if args.create_stream {
            publisher
                .create_stream(vec![format!("{}.>", args.prefix)], args.duplicate_window)
                .await
                .map_err(|e| e.to_string())?;
        }
        let target = format!(
            "{} stream {} (subjects {}.>)",
            args.broker, args.stream, args.prefix
        );
        setup.drive(publisher, &target).await
    } else {
        let publisher = RabbitPublisher::connect(&args.broker, &args.exchange)
            .await
            .map_err(|e| e.to_string())?;
        eprintln!(
            "idem relay: note: RabbitMQ does not de-duplicate; a row re-published after a relay crash reaches the queues twice with the same message_id, and consumers drop it with the inbox"
        );
        let target = format!(
            "{} exchange {} (routing keys {}.<aggregate_type>.<message_type>)",
            idem::store::redact_url(&args.broker),
            args.exchange,
            args.prefix
        );
        setup.drive(publisher, &target).await
    }
}

/// Everything a relay needs but its publisher.
struct Setup {
    store: PgStore,
    lock_options: idem_postgres::sqlx::postgres::PgConnectOptions,
    namespace: String,
    options: RelayOptions,
    admin: tokio::net::TcpListener,
    token: Option<Arc<str>>,
    store_url: String,
}

impl Setup {
    /// Serves the admin listener and runs the relay through `publisher`
    /// until SIGINT or SIGTERM.
    async fn drive<P: Publisher>(self, publisher: P, target: &str) -> Result<(), String> {
        let Self {
            store,
            lock_options,
            namespace,
            options,
            admin,
            token,
            store_url,
        } = self;
        let relay = Relay::new(
            store.pool().clone(),
            lock_options,
            &namespace,
            publisher,
            options,
        );
        let store = store_url.as_str();
        let admin_addr = admin.local_addr().map_err(|e| e.to_string())?;
        let router = admin_router(relay.readiness(), token);
        tokio::spawn(async move {
            if let Err(err) = axum::serve(admin, router).await {
                tracing::error!(%err, "relay admin listener failed");
            }
        });
        if let Some(warning) = relay.check_duplicate_window().await {
            eprintln!("idem relay: WARNING: {warning}");
        }
        // Before the ready line: a signal right after it must stop us cleanly.
        let stop = crate::server::shutdown_signal();
        println!(
            "idem relay: publishing the outbox of {} to {target}, admin {admin_addr}",
            idem::store::redact_url(store),
        );
        let stats = relay.run(stop).await;
        println!(
            "idem relay: stopped after publishing {} row(s) ({} already in the stream), {} failed attempt(s), {} dead",
            stats.published, stats.duplicates, stats.failures, stats.dead
        );
        Ok(())
    }
}

/// `idem outbox …`: the operator path for outbox rows.
#[derive(Debug, Clone, clap::Subcommand)]
pub enum OutboxCommand {
    /// List rows, oldest first.
    List {
        /// The PostgreSQL database holding the outbox.
        #[arg(long, env = "IDEM_STORE")]
        store: String,
        /// Only rows in this state: pending, published or dead.
        #[arg(long)]
        state: Option<String>,
        /// At most this many rows.
        #[arg(long, default_value_t = 100)]
        limit: i64,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Put dead rows back in line (pending, attempts reset).
    Replay {
        /// The PostgreSQL database holding the outbox.
        #[arg(long, env = "IDEM_STORE")]
        store: String,
        /// Row ids.
        #[arg(required = true)]
        ids: Vec<i64>,
    },
    /// Delete dead rows for good (their events are never delivered;
    /// version-checking consumers see a gap).
    Discard {
        /// The PostgreSQL database holding the outbox.
        #[arg(long, env = "IDEM_STORE")]
        store: String,
        /// Row ids.
        #[arg(required = true)]
        ids: Vec<i64>,
    },
}

/// Runs an `idem outbox` command (never migrates the schema).
pub async fn outbox(command: OutboxCommand) -> Result<(), String> {
    use idem_postgres::outbox::Outbox;
    let connect = |url: &str| {
        let url = url.to_owned();
        async move {
            let opts = PgOptions::from_url(&url)
                .map_err(|e| error_chain(&e))?
                .with_migrate(false);
            PgStore::connect_with(opts)
                .await
                .map_err(|e| error_chain(&e))
        }
    };
    let report = |verb: &str, asked: &[i64], done: &[i64]| {
        let skipped: Vec<i64> = asked
            .iter()
            .filter(|id| !done.contains(id))
            .copied()
            .collect();
        println!("idem outbox: {verb} {} dead row(s): {done:?}", done.len());
        if skipped.is_empty() {
            Ok(())
        } else {
            Err(format!("not dead (or absent), left alone: {skipped:?}"))
        }
    };
    match command {
        OutboxCommand::List {
            store,
            state,
            limit,
            json,
        } => {
            let store = connect(&store).await?;
            let rows = Outbox::list(store.pool(), state.as_deref(), limit)
                .await
                .map_err(|e| e.to_string())?;
            if json {
                println!(
                    "{}",
                    serde_json::to_string_pretty(&rows).map_err(|e| e.to_string())?
                );
                return Ok(());
            }
            println!(
                "{:>10}  {:<9} {:>8}  {:<14} {:<20} {:>6}  {:<20} LAST ERROR",
                "ID", "STATE", "ATTEMPTS", "TYPE", "AGGREGATE", "SEQ", "MESSAGE"
            );
            for r in &rows {
                println!(
                    "{:>10}  {:<9} {:>8}  {:<14} {:<20} {:>6}  {:<20} {}",
                    r.id,
                    r.state,
                    r.attempts,
                    r.aggregate_type,
                    r.aggregate_id,
                    r.sequence,
                    r.message_type,
                    r.last_error.as_deref().unwrap_or("")
                );
            }
            println!("{} row(s)", rows.len());
            Ok(())
        }
        OutboxCommand::Replay { store, ids } => {
            let store = connect(&store).await?;
            let done = Outbox::replay_dead(store.pool(), &ids)
                .await
                .map_err(|e| e.to_string())?;
            report("replayed", &ids, &done)
        }
        OutboxCommand::Discard { store, ids } => {
            let store = connect(&store).await?;
            let done = Outbox::discard_dead(store.pool(), &ids)
                .await
                .map_err(|e| e.to_string())?;
            report("discarded", &ids, &done)
        }
    }
}
