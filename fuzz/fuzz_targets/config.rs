//! The gateway's config file parser and validator on arbitrary text: never
//! panics; a refusal is a message; an accepted config keeps its limits in
//! range and answers route lookups.
#![no_main]

use std::path::Path;

use http::Method;
use idem_gateway::config::{Overrides, parse};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    // Reading the file this names is I/O, not parsing: a fuzzer that
    // found "/dev/zero" would hang on it.
    if text.contains("encryption_keys_file") {
        return;
    }
    match parse(Path::new("fuzz.toml"), text, &Overrides::default()) {
        Err(e) => assert!(!e.message().trim().is_empty(), "an empty error"),
        Ok(settings) => {
            let l = &settings.limits;
            assert!(l.max_connections >= 1 && l.max_in_flight >= 1);
            assert!(l.max_headers >= 1 && l.max_header_bytes >= 1);
            for method in [Method::POST, Method::GET, Method::PATCH, Method::DELETE] {
                for path in ["/", "/v1/payments", "/v1/orders/7/capture", "//x/%2F/", ""] {
                    let _ = settings.routes.matching(&method, path);
                }
            }
        }
    }
});
