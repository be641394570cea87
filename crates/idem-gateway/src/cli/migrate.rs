//! `idem migrate`: brings a store's schema to this build's version.

use idem::store::redact_url as redact;
use idem_postgres::PgStore;

use super::records::StoreArg;
use crate::error::GatewayError;
use crate::store::StoreUrl;

/// `idem migrate` arguments.
#[derive(Debug, clap::Args)]
pub(super) struct MigrateArgs {
    #[command(flatten)]
    store: StoreArg,
}

/// Migrates and prints what it did; an error (unreachable, refused, newer
/// schema) is one line for a non-zero exit.
pub(super) async fn run(args: MigrateArgs) -> Result<(), GatewayError> {
    let url = &args.store.store;
    let done = match StoreUrl::parse(url)? {
        StoreUrl::Sqlite(u) => {
            // Opening migrates; a file that is not there yet is created.
            let store = StoreUrl::open_embedded(&u).await?;
            format!("{u}: {}", store.migrated())
        }
        StoreUrl::Postgres(o) | StoreUrl::Tiered(_, o) => {
            let store = PgStore::connect_with((*o).with_migrate(false)).await?;
            let migrated = store.migrate().await?;
            store.close().await;
            format!("{}: {migrated}", redact(url))
        }
        #[cfg(feature = "mysql")]
        StoreUrl::MySql(o) => {
            let store = idem_mysql::MySqlStore::connect_with((*o).with_migrate(false)).await?;
            let migrated = store.migrate().await?;
            store.close().await;
            format!("{}: {migrated}", redact(url))
        }
        #[cfg(feature = "dynamodb")]
        StoreUrl::Dynamo(o) => {
            let (_, migrated) = idem_dynamodb::DynamoStore::connect_and_migrate(*o).await?;
            format!("{}: {migrated}", redact(url))
        }
        StoreUrl::Redis(_) => format!("{}: Redis keeps no schema; nothing to migrate", redact(url)),
        StoreUrl::Memory => "memory://: nothing to migrate".to_owned(),
    };
    println!("idem: {done}");
    Ok(())
}
