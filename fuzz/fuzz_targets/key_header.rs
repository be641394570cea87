//! The `Idempotency-Key` header parser (bare token or RFC 8941 string)
//! on arbitrary bytes: never panics; what it accepts is a valid key that
//! reads back the same.
#![no_main]

use http::{HeaderMap, HeaderValue};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(value) = HeaderValue::from_bytes(data) else {
        return;
    };
    let mut headers = HeaderMap::new();
    headers.insert(idem_http::IDEMPOTENCY_KEY, value);
    if let Ok(Some(key)) = idem_http::idempotency_key(&headers) {
        let text = key.as_str();
        assert!(!text.is_empty());
        let again: idem::IdempotencyKey = text.parse().expect("an accepted key parses again");
        assert_eq!(again.as_str(), text);
    }
});
