//! The table: its key, its listing index and its TTL attribute, created
//! (and checked) idempotently.

use std::time::Duration;

use aws_sdk_dynamodb::Client;
use aws_sdk_dynamodb::types::{
    AttributeDefinition, BillingMode, GlobalSecondaryIndex, KeySchemaElement, KeyType, Projection,
    ProjectionType, ScalarAttributeType, TableDescription, TableStatus, TimeToLiveSpecification,
    TimeToLiveStatus,
};
use idem::store::Migrated;

use crate::DynamoError;
use crate::error::code;
use crate::item::{LIST_PK, LIST_SK, PK, TTL};

/// The listing index: every record under one partition, sorted by
/// [`LIST_SK`](crate::item::LIST_SK), projecting the whole item so a
/// page is read from the index alone.
pub(crate) const LIST_INDEX: &str = "idem_list";

/// The layout this build writes: the key, the index and the TTL
/// attribute. An item layout change would raise it.
pub(crate) const SCHEMA_VERSION: i64 = 1;

/// How long [`migrate`] waits for a new table to become active.
const ACTIVE_WITHIN: Duration = Duration::from_secs(60);

/// What [`describe`] found.
pub(crate) enum Found {
    /// No such table.
    Missing,
    /// The table, as described.
    Table(Box<TableDescription>),
}

/// The table's description, or that it is missing.
pub(crate) async fn describe(client: &Client, table: &str) -> Result<Found, DynamoError> {
    match client.describe_table().table_name(table).send().await {
        Ok(out) => Ok(match out.table {
            Some(description) => Found::Table(Box::new(description)),
            None => Found::Missing,
        }),
        Err(err) if code(&err) == Some("ResourceNotFoundException") => Ok(Found::Missing),
        Err(err) => Err(DynamoError::sdk("DescribeTable", err)),
    }
}

/// Whether a described table is one of idem's: its partition key and
/// listing index; the reason when not.
pub(crate) fn check(table: &str, description: &TableDescription) -> Result<(), DynamoError> {
    let keys = description.key_schema();
    let partition_only =
        keys.len() == 1 && keys[0].attribute_name() == PK && keys[0].key_type() == &KeyType::Hash;
    if !keys.is_empty() && !partition_only {
        return Err(DynamoError::ForeignTable {
            table: table.to_owned(),
            reason: format!("its key is not the single partition key {PK:?}"),
        });
    }
    let has_index = description
        .global_secondary_indexes()
        .iter()
        .any(|index| index.index_name() == Some(LIST_INDEX));
    if !has_index && !keys.is_empty() {
        return Err(DynamoError::NotMigrated {
            table: table.to_owned(),
            what: "has no listing index",
        });
    }
    Ok(())
}

/// Creates the table if it is missing (on-demand billing, the key and the
/// listing index), waits for it to be active, and turns its TTL on if it
/// is off. Safe to run again and from several processes at once.
pub(crate) async fn migrate(client: &Client, table: &str) -> Result<Migrated, DynamoError> {
    let mut from = SCHEMA_VERSION;
    match describe(client, table).await? {
        Found::Table(description) => check(table, &description)?,
        Found::Missing => {
            from = 0;
            create(client, table).await?;
        }
    }
    wait_active(client, table).await?;
    if !ttl_on(client, table).await? {
        from = from.min(0);
        let spec = TimeToLiveSpecification::builder()
            .enabled(true)
            .attribute_name(TTL)
            .build()
            .map_err(|e| migrate_error(table, "building the TTL request", Some(e.into())))?;
        let turned_on = client
            .update_time_to_live()
            .table_name(table)
            .time_to_live_specification(spec)
            .send()
            .await;
        match turned_on {
            Ok(_) => {}
            // Another process turned it on meanwhile.
            Err(err)
                if code(&err) == Some("ValidationException") && ttl_on(client, table).await? => {}
            Err(err) => {
                return Err(migrate_error(
                    table,
                    "turning TTL on failed",
                    Some(Box::new(err)),
                ));
            }
        }
    }
    Ok(Migrated {
        from,
        to: SCHEMA_VERSION,
    })
}

fn migrate_error(table: &str, reason: &str, source: Option<idem::store::BoxError>) -> DynamoError {
    let reason = match &source {
        Some(source) => format!(
            "{reason}: {}",
            aws_sdk_dynamodb::error::DisplayErrorContext(source.as_ref())
        ),
        None => reason.to_owned(),
    };
    DynamoError::Migrate {
        table: table.to_owned(),
        reason,
        source,
    }
}

async fn create(client: &Client, table: &str) -> Result<(), DynamoError> {
    let built = |e: aws_sdk_dynamodb::error::BuildError| {
        migrate_error(table, "building the CreateTable request", Some(e.into()))
    };
    let attribute = |name: &str| {
        AttributeDefinition::builder()
            .attribute_name(name)
            .attribute_type(ScalarAttributeType::S)
            .build()
    };
    let key = |name: &str, kind: KeyType| {
        KeySchemaElement::builder()
            .attribute_name(name)
            .key_type(kind)
            .build()
    };
    let index = GlobalSecondaryIndex::builder()
        .index_name(LIST_INDEX)
        .key_schema(key(LIST_PK, KeyType::Hash).map_err(built)?)
        .key_schema(key(LIST_SK, KeyType::Range).map_err(built)?)
        .projection(
            Projection::builder()
                .projection_type(ProjectionType::All)
                .build(),
        )
        .build()
        .map_err(built)?;
    let created = client
        .create_table()
        .table_name(table)
        .billing_mode(BillingMode::PayPerRequest)
        .attribute_definitions(attribute(PK).map_err(built)?)
        .attribute_definitions(attribute(LIST_PK).map_err(built)?)
        .attribute_definitions(attribute(LIST_SK).map_err(built)?)
        .key_schema(key(PK, KeyType::Hash).map_err(built)?)
        .global_secondary_indexes(index)
        .send()
        .await;
    match created {
        Ok(_) => Ok(()),
        // Created by another process since we looked.
        Err(err) if code(&err) == Some("ResourceInUseException") => Ok(()),
        Err(err) => Err(migrate_error(
            table,
            "CreateTable failed",
            Some(Box::new(err)),
        )),
    }
}

/// Waits until the table is active (a new table takes seconds on AWS).
async fn wait_active(client: &Client, table: &str) -> Result<(), DynamoError> {
    let deadline = tokio::time::Instant::now() + ACTIVE_WITHIN;
    loop {
        if let Found::Table(description) = describe(client, table).await?
            && description.table_status() == Some(&TableStatus::Active)
        {
            return Ok(());
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(migrate_error(
                table,
                &format!("the table did not become active within {ACTIVE_WITHIN:?}"),
                None,
            ));
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// Whether the table's TTL is on (or turning on) on [`TTL`].
pub(crate) async fn ttl_on(client: &Client, table: &str) -> Result<bool, DynamoError> {
    let described = client
        .describe_time_to_live()
        .table_name(table)
        .send()
        .await
        .map_err(|err| DynamoError::sdk("DescribeTimeToLive", err))?;
    Ok(described.time_to_live_description().is_some_and(|ttl| {
        ttl.attribute_name() == Some(TTL)
            && matches!(
                ttl.time_to_live_status(),
                Some(TimeToLiveStatus::Enabled | TimeToLiveStatus::Enabling)
            )
    }))
}
