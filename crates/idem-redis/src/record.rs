//! A record as a Redis hash: field names and their encoding (see
//! `scripts/prelude.lua` for the list).

use std::collections::HashMap;

use idem::{
    Fingerprint, IdempotencyKey, Lease, OwnerToken, Record, RecordState, Scope, StoreError,
    StoredResponse, Timestamp,
};
use redis::Value;

use crate::RedisError;

fn corrupt(what: impl Into<String>) -> StoreError {
    RedisError::Corrupt(what.into()).into()
}

fn bytes(v: Value) -> Result<Vec<u8>, StoreError> {
    match v {
        Value::BulkString(b) => Ok(b),
        Value::SimpleString(s) => Ok(s.into_bytes()),
        Value::Int(n) => Ok(n.to_string().into_bytes()),
        other => Err(corrupt(format!("unexpected value in a record: {other:?}"))),
    }
}

/// The fields of a record hash, from `HGETALL` (a flat array in RESP2, a
/// map in RESP3).
fn fields(v: Value) -> Result<HashMap<String, Vec<u8>>, StoreError> {
    let pairs: Vec<(Value, Value)> = match v {
        Value::Array(items) => {
            if items.len() % 2 != 0 {
                return Err(corrupt("a record hash has an odd number of items"));
            }
            let mut it = items.into_iter();
            let mut pairs = Vec::new();
            while let (Some(f), Some(v)) = (it.next(), it.next()) {
                pairs.push((f, v));
            }
            pairs
        }
        Value::Map(pairs) => pairs,
        other => return Err(corrupt(format!("a record is not a hash: {other:?}"))),
    };
    pairs
        .into_iter()
        .map(|(f, v)| {
            let f = String::from_utf8(bytes(f)?)
                .map_err(|_| corrupt("a record field name is not UTF-8"))?;
            Ok((f, bytes(v)?))
        })
        .collect()
}

/// Decodes a record from its hash.
pub(crate) fn from_value(v: Value) -> Result<Record, StoreError> {
    let mut f = fields(v)?;
    let mut take = |name: &str| {
        f.remove(name)
            .ok_or_else(|| corrupt(format!("record field {name:?} is missing")))
    };
    let text = |name: &str, raw: Vec<u8>| {
        String::from_utf8(raw).map_err(|_| corrupt(format!("record field {name:?} is not UTF-8")))
    };
    let number = |name: &str, raw: Vec<u8>| -> Result<i64, StoreError> {
        std::str::from_utf8(&raw)
            .ok()
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| corrupt(format!("record field {name:?} is not an integer")))
    };
    let tenant = text("tn", take("tn")?)?;
    let operation = text("op", take("op")?)?;
    let scope = Scope::new(&tenant, &operation).map_err(|e| corrupt(e.to_string()))?;
    let key: IdempotencyKey = text("ky", take("ky")?)?
        .parse()
        .map_err(|e: idem::KeyError| corrupt(e.to_string()))?;
    let fingerprint: [u8; 32] = take("fp")?
        .try_into()
        .map_err(|_| corrupt("fingerprint is not 32 bytes"))?;
    let state: RecordState = text("st", take("st")?)?
        .parse()
        .map_err(|e: idem::UnknownState| corrupt(e.to_string()))?;
    let owner: [u8; 16] = take("ow")?
        .try_into()
        .map_err(|_| corrupt("owner is not 16 bytes"))?;
    let attempt =
        u32::try_from(number("at", take("at")?)?).map_err(|_| corrupt("attempt out of range"))?;
    let ms = |name: &str, raw: Vec<u8>| number(name, raw).map(Timestamp::from_millis);
    let created_at = ms("ca", take("ca")?)?;
    let updated_at = ms("ua", take("ua")?)?;
    let expires_at = ms("ea", take("ea")?)?;
    let locked_until = ms("lu", take("lu")?)?;
    let response = match f.remove("rs") {
        None => None,
        Some(status) => {
            let status = u16::try_from(number("rs", status)?)
                .map_err(|_| corrupt("response status out of range"))?;
            let headers = StoredResponse::decode_headers(&f.remove("rh").unwrap_or_default())
                .map_err(|e| corrupt(e.to_string()))?;
            Some(StoredResponse {
                status,
                headers,
                body: f.remove("rb").unwrap_or_default().into(),
            })
        }
    };
    let resource_id = f.remove("ri").map(|v| text("ri", v)).transpose()?;
    let error_code = f.remove("ec").map(|v| text("ec", v)).transpose()?;
    Ok(Record {
        scope,
        key,
        fingerprint: Fingerprint::from_digest(fingerprint),
        state,
        created_at,
        updated_at,
        expires_at,
        lease: Lease {
            owner: OwnerToken::from_bytes(owner),
            attempt,
            locked_until,
        },
        response,
        resource_id,
        error_code,
    })
}

/// The hash fields of a record, for a copy put by a fast tier.
pub(crate) fn to_fields(r: &Record) -> Vec<(&'static str, Vec<u8>)> {
    let num = |n: i64| n.to_string().into_bytes();
    let mut out = vec![
        ("tn", r.scope.tenant().as_bytes().to_vec()),
        ("op", r.scope.operation().as_bytes().to_vec()),
        ("ky", r.key.as_str().as_bytes().to_vec()),
        ("fp", r.fingerprint.digest().to_vec()),
        ("st", r.state.as_str().as_bytes().to_vec()),
        ("ca", num(r.created_at.as_millis())),
        ("ua", num(r.updated_at.as_millis())),
        ("ea", num(r.expires_at.as_millis())),
        ("lu", num(r.lease.locked_until.as_millis())),
        ("ow", r.lease.owner.to_bytes().to_vec()),
        ("at", num(i64::from(r.lease.attempt))),
    ];
    if let Some(resp) = &r.response {
        out.push(("rs", num(i64::from(resp.status))));
        out.push(("rh", resp.encode_headers()));
        out.push(("rb", resp.body.to_vec()));
    }
    if let Some(ri) = &r.resource_id {
        out.push(("ri", ri.as_bytes().to_vec()));
    }
    if let Some(ec) = &r.error_code {
        out.push(("ec", ec.as_bytes().to_vec()));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Record {
        Record {
            scope: Scope::new("a:b{c}", "POST /x").expect("scope"),
            key: "k{1}".parse().expect("key"),
            fingerprint: Fingerprint::builder().part("x", b"y").finish(),
            state: RecordState::Completed,
            created_at: Timestamp::from_millis(1_700_000_000_000),
            updated_at: Timestamp::from_millis(1_700_000_000_005),
            expires_at: Timestamp::from_millis(1_700_086_400_005),
            lease: Lease {
                owner: OwnerToken::random(),
                attempt: 3,
                locked_until: Timestamp::from_millis(1_700_000_030_000),
            },
            response: Some(StoredResponse::new(201, vec![0u8, 255, 10]).with_header("x-a", "b")),
            resource_id: Some("res".to_owned()),
            error_code: None,
        }
    }

    #[test]
    fn fields_round_trip() {
        let r = sample();
        let flat: Vec<Value> = to_fields(&r)
            .into_iter()
            .flat_map(|(f, v)| {
                [
                    Value::BulkString(f.as_bytes().to_vec()),
                    Value::BulkString(v),
                ]
            })
            .collect();
        assert_eq!(from_value(Value::Array(flat)).expect("decode"), r);
    }

    #[test]
    fn damaged_hashes_are_corrupt_not_panics() {
        let mut fields = to_fields(&sample());
        fields.retain(|(f, _)| *f != "fp");
        let flat: Vec<Value> = fields
            .into_iter()
            .flat_map(|(f, v)| {
                [
                    Value::BulkString(f.as_bytes().to_vec()),
                    Value::BulkString(v),
                ]
            })
            .collect();
        assert!(matches!(
            from_value(Value::Array(flat)),
            Err(StoreError::Corrupt(_))
        ));
        assert!(matches!(
            from_value(Value::Array(vec![Value::Nil])),
            Err(StoreError::Corrupt(_))
        ));
        assert!(matches!(
            from_value(Value::Int(3)),
            Err(StoreError::Corrupt(_))
        ));
    }
}
