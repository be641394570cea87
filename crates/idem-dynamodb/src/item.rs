//! A record as one DynamoDB item: its attribute names, the keys it is
//! found by, how it is read back, and its size as DynamoDB counts it.

use std::collections::HashMap;

use aws_sdk_dynamodb::primitives::Blob;
use aws_sdk_dynamodb::types::AttributeValue;
use idem::{
    Fingerprint, IdempotencyKey, Lease, OwnerToken, Record, RecordState, Scope, StoredResponse,
    Timestamp,
};

use crate::DynamoError;

/// An item as the SDK carries it.
pub(crate) type Item = HashMap<String, AttributeValue>;

/// The partition key: tenant, operation and key, each ended by
/// [`SEP`].
pub(crate) const PK: &str = "pk";
/// The listing index's partition key: one value, [`LIST_PARTITION`], for
/// every record.
pub(crate) const LIST_PK: &str = "list_pk";
/// The listing index's sort key: [`list_sort_key`].
pub(crate) const LIST_SK: &str = "list_sk";
/// The tenant, as text.
pub(crate) const TENANT: &str = "tenant";
/// The operation, as text.
pub(crate) const OPERATION: &str = "operation";
/// The client's key, as text.
pub(crate) const IDEM_KEY: &str = "idem_key";
/// The fingerprint's 32-byte digest.
pub(crate) const FINGERPRINT: &str = "fingerprint";
/// `processing`, `completed` or `failed`.
pub(crate) const STATE: &str = "state";
/// Milliseconds since the epoch, by the store's clock.
pub(crate) const CREATED_AT: &str = "created_at_ms";
/// Milliseconds since the epoch.
pub(crate) const UPDATED_AT: &str = "updated_at_ms";
/// Milliseconds since the epoch: when a final record stops being.
pub(crate) const EXPIRES_AT: &str = "expires_at_ms";
/// Milliseconds since the epoch: the end of the current lease.
pub(crate) const LOCKED_UNTIL: &str = "locked_until_ms";
/// The owner token's 16 bytes.
pub(crate) const OWNER: &str = "owner";
/// The attempt number.
pub(crate) const ATTEMPT: &str = "attempt";
/// The stored answer's status.
pub(crate) const STATUS: &str = "response_status";
/// The stored answer's headers, in `StoredResponse::encode_headers` form.
pub(crate) const HEADERS: &str = "response_headers";
/// The stored answer's body.
pub(crate) const BODY: &str = "response_body";
/// What the operation created, if told.
pub(crate) const RESOURCE_ID: &str = "resource_id";
/// A machine-readable reason.
pub(crate) const ERROR_CODE: &str = "error_code";
/// The table's TTL attribute, in seconds since the epoch, on final records
/// only: DynamoDB deletes an item some time after it passes, so reads
/// never rely on it (they compare [`EXPIRES_AT`] with the clock).
pub(crate) const TTL: &str = "ttl";

/// The one value of [`LIST_PK`].
pub(crate) const LIST_PARTITION: &str = "records";
/// Ends each part of a compound key. Scopes hold no control characters
/// and keys only visible ASCII, so it appears in no part, and it sorts
/// below every character they can hold: compound keys sort as their
/// parts do, one after the other.
const SEP: char = '\u{1}';

/// DynamoDB's limit on one item: 400 KB, attribute names included.
pub(crate) const MAX_ITEM_BYTES: usize = 400 * 1024;
/// The most bytes DynamoDB counts for a number.
const NUMBER_BYTES: usize = 21;

/// The partition key of a record.
pub(crate) fn pk(scope: &Scope, key: &IdempotencyKey) -> String {
    format!(
        "{}{SEP}{}{SEP}{}",
        scope.tenant(),
        scope.operation(),
        key.as_str()
    )
}

/// The listing order `(created_at, tenant, operation, key)` as one string
/// that sorts the same way: the time as 16 zero-padded digits (times
/// before the epoch sort as zero), then the parts.
pub(crate) fn list_sort_key(
    created_at: Timestamp,
    tenant: &str,
    operation: &str,
    key: &str,
) -> String {
    format!(
        "{:016}{SEP}{tenant}{SEP}{operation}{SEP}{key}",
        created_at.as_millis().max(0)
    )
}

/// The string attribute.
pub(crate) fn s(value: impl Into<String>) -> AttributeValue {
    AttributeValue::S(value.into())
}

/// The number attribute.
pub(crate) fn n(value: i64) -> AttributeValue {
    AttributeValue::N(value.to_string())
}

/// The binary attribute.
pub(crate) fn b(value: impl Into<Vec<u8>>) -> AttributeValue {
    AttributeValue::B(Blob::new(value))
}

/// The item of a fresh processing record, attempt 1.
pub(crate) fn fresh(
    scope: &Scope,
    key: &IdempotencyKey,
    fingerprint: &Fingerprint,
    owner: OwnerToken,
    now: Timestamp,
    locked_until: Timestamp,
    expires_at: Timestamp,
) -> Item {
    HashMap::from([
        (PK.to_owned(), s(pk(scope, key))),
        (LIST_PK.to_owned(), s(LIST_PARTITION)),
        (
            LIST_SK.to_owned(),
            s(list_sort_key(
                now,
                scope.tenant(),
                scope.operation(),
                key.as_str(),
            )),
        ),
        (TENANT.to_owned(), s(scope.tenant())),
        (OPERATION.to_owned(), s(scope.operation())),
        (IDEM_KEY.to_owned(), s(key.as_str())),
        (FINGERPRINT.to_owned(), b(fingerprint.digest().to_vec())),
        (STATE.to_owned(), s(RecordState::Processing.as_str())),
        (CREATED_AT.to_owned(), n(now.as_millis())),
        (UPDATED_AT.to_owned(), n(now.as_millis())),
        (EXPIRES_AT.to_owned(), n(expires_at.as_millis())),
        (LOCKED_UNTIL.to_owned(), n(locked_until.as_millis())),
        (OWNER.to_owned(), b(owner.to_bytes().to_vec())),
        (ATTEMPT.to_owned(), n(1)),
    ])
}

/// The size DynamoDB counts for an item: each attribute's name and value
/// (strings and binaries by their bytes, numbers at their most).
pub(crate) fn size<'a>(
    attributes: impl IntoIterator<Item = (&'a str, &'a AttributeValue)>,
) -> usize {
    attributes
        .into_iter()
        .map(|(name, value)| name.len() + value_size(value))
        .sum()
}

/// The bytes DynamoDB counts for one value.
fn value_size(value: &AttributeValue) -> usize {
    match value {
        AttributeValue::S(text) => text.len(),
        AttributeValue::B(blob) => blob.as_ref().len(),
        AttributeValue::N(_) => NUMBER_BYTES,
        AttributeValue::Bool(_) | AttributeValue::Null(_) => 1,
        // Not written by this store; counted generously.
        _ => 3 + NUMBER_BYTES,
    }
}

fn corrupt(msg: impl std::fmt::Display) -> DynamoError {
    DynamoError::Corrupt(msg.to_string())
}

fn text<'a>(item: &'a Item, name: &str) -> Result<&'a str, DynamoError> {
    match item.get(name) {
        Some(AttributeValue::S(text)) => Ok(text),
        _ => Err(corrupt(format!("{name} is missing or not a string"))),
    }
}

fn optional_text(item: &Item, name: &str) -> Result<Option<String>, DynamoError> {
    match item.get(name) {
        None | Some(AttributeValue::Null(_)) => Ok(None),
        Some(AttributeValue::S(text)) => Ok(Some(text.clone())),
        Some(_) => Err(corrupt(format!("{name} is not a string"))),
    }
}

fn bytes<'a>(item: &'a Item, name: &str) -> Result<Option<&'a [u8]>, DynamoError> {
    match item.get(name) {
        None | Some(AttributeValue::Null(_)) => Ok(None),
        Some(AttributeValue::B(blob)) => Ok(Some(blob.as_ref())),
        Some(_) => Err(corrupt(format!("{name} is not binary"))),
    }
}

/// A number attribute that must be there.
pub(crate) fn number(item: &Item, name: &str) -> Result<i64, DynamoError> {
    match item.get(name) {
        Some(AttributeValue::N(number)) => number
            .parse()
            .map_err(|_| corrupt(format!("{name} {number:?} is not a whole number"))),
        _ => Err(corrupt(format!("{name} is missing or not a number"))),
    }
}

/// Reads an item back into a record.
pub(crate) fn record(item: &Item) -> Result<Record, DynamoError> {
    let scope = Scope::new(text(item, TENANT)?, text(item, OPERATION)?).map_err(corrupt)?;
    let key: IdempotencyKey = text(item, IDEM_KEY)?.parse().map_err(corrupt)?;
    let fingerprint: [u8; 32] = bytes(item, FINGERPRINT)?
        .unwrap_or_default()
        .try_into()
        .map_err(|_| corrupt("fingerprint is not 32 bytes"))?;
    let state: RecordState = text(item, STATE)?.parse().map_err(corrupt)?;
    let owner: [u8; 16] = bytes(item, OWNER)?
        .unwrap_or_default()
        .try_into()
        .map_err(|_| corrupt("owner is not 16 bytes"))?;
    let attempt = u32::try_from(number(item, ATTEMPT)?)
        .ok()
        .filter(|a| *a > 0)
        .ok_or_else(|| corrupt("attempt is not a positive number"))?;
    let response = match item.get(STATUS) {
        None | Some(AttributeValue::Null(_)) => None,
        Some(_) => {
            let status = number(item, STATUS)?;
            let status = u16::try_from(status)
                .map_err(|_| corrupt(format!("response status {status} out of range")))?;
            let headers = StoredResponse::decode_headers(bytes(item, HEADERS)?.unwrap_or_default())
                .map_err(corrupt)?;
            let body = bytes(item, BODY)?.unwrap_or_default().to_vec();
            Some(StoredResponse {
                status,
                headers,
                body: body.into(),
            })
        }
    };
    let millis = |name| number(item, name).map(Timestamp::from_millis);
    Ok(Record {
        scope,
        key,
        fingerprint: Fingerprint::from_digest(fingerprint),
        state,
        created_at: millis(CREATED_AT)?,
        updated_at: millis(UPDATED_AT)?,
        expires_at: millis(EXPIRES_AT)?,
        lease: Lease {
            owner: OwnerToken::from_bytes(owner),
            attempt,
            locked_until: millis(LOCKED_UNTIL)?,
        },
        response,
        resource_id: optional_text(item, RESOURCE_ID)?,
        error_code: optional_text(item, ERROR_CODE)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scope(tenant: &str, operation: &str) -> Scope {
        Scope::new(tenant, operation).expect("valid")
    }

    #[test]
    fn an_item_reads_back_as_its_record() {
        let (sc, key) = (scope("acme", "POST /v1/x"), "k-1".parse().expect("key"));
        let fp = Fingerprint::builder().bytes_body(b"a").finish();
        let owner = OwnerToken::random();
        let now = Timestamp::from_millis(1_700_000_000_123);
        let item = fresh(
            &sc,
            &key,
            &fp,
            owner,
            now,
            now.plus(std::time::Duration::from_secs(30)),
            now.plus(std::time::Duration::from_secs(60)),
        );
        let rec = record(&item).expect("reads back");
        assert_eq!(rec.scope, sc);
        assert_eq!(rec.key, key);
        assert_eq!(rec.fingerprint, fp);
        assert_eq!(rec.state, RecordState::Processing);
        assert_eq!(rec.created_at, now);
        assert_eq!(rec.lease.owner, owner);
        assert_eq!(rec.lease.attempt, 1);
        assert_eq!(rec.response, None);
    }

    #[test]
    fn compound_keys_sort_as_their_parts() {
        let t = Timestamp::from_millis;
        let keys = [
            list_sort_key(t(5), "a", "op", "k"),
            list_sort_key(t(5), "a", "op", "kk"),
            list_sort_key(t(5), "a", "op2", "a"),
            list_sort_key(t(5), "ab", "a", "a"),
            list_sort_key(t(40), "a", "a", "a"),
            list_sort_key(t(1_700_000_000_000), "a", "a", "a"),
        ];
        let mut sorted = keys.clone();
        sorted.sort();
        assert_eq!(sorted, keys);
        assert_ne!(
            pk(&scope("a", "b c"), &"d".parse().expect("key")),
            pk(&scope("a b", "c"), &"d".parse().expect("key"))
        );
    }

    #[test]
    fn sizes_count_names_and_values() {
        let item = HashMap::from([
            ("ab".to_owned(), s("xyz")),
            ("c".to_owned(), b(vec![0; 10])),
            ("n".to_owned(), n(7)),
        ]);
        assert_eq!(
            size(item.iter().map(|(k, v)| (k.as_str(), v))),
            2 + 3 + 1 + 10 + 1 + NUMBER_BYTES
        );
    }

    #[test]
    fn unreadable_items_are_corrupt() {
        let mut item = fresh(
            &scope("a", "b"),
            &"k".parse().expect("key"),
            &Fingerprint::builder().bytes_body(b"a").finish(),
            OwnerToken::random(),
            Timestamp::from_millis(1),
            Timestamp::from_millis(2),
            Timestamp::from_millis(3),
        );
        item.insert(STATE.to_owned(), s("sideways"));
        assert!(matches!(record(&item), Err(DynamoError::Corrupt(_))));
        item.insert(STATE.to_owned(), s("processing"));
        item.insert(ATTEMPT.to_owned(), n(0));
        assert!(matches!(record(&item), Err(DynamoError::Corrupt(_))));
    }
}
