//! `idem outbox`: inspect the outbox; replay or discard dead rows.

use idem_postgres::outbox::Outbox;
use idem_postgres::{PgOptions, PgStore};

use crate::error::GatewayError;

/// `idem outbox …`: the operator path for outbox rows.
#[derive(Debug, Clone, clap::Subcommand)]
pub(super) enum OutboxCommand {
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
pub(super) async fn run(command: OutboxCommand) -> Result<(), GatewayError> {
    let connect = |url: &str| {
        let url = url.to_owned();
        async move {
            let opts = PgOptions::from_url(&url)?.with_migrate(false);
            Ok::<_, GatewayError>(PgStore::connect_with(opts).await?)
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
            Err(GatewayError::Invalid(format!(
                "not dead (or absent), left alone: {skipped:?}"
            )))
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
            let rows = Outbox::list(store.pool(), state.as_deref(), limit).await?;
            if json {
                println!(
                    "{}",
                    serde_json::to_string_pretty(&rows)
                        .map_err(|e| GatewayError::io("cannot print the rows as JSON", e.into()))?
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
            let done = Outbox::replay_dead(store.pool(), &ids).await?;
            report("replayed", &ids, &done)
        }
        OutboxCommand::Discard { store, ids } => {
            let store = connect(&store).await?;
            let done = Outbox::discard_dead(store.pool(), &ids).await?;
            report("discarded", &ids, &done)
        }
    }
}
