//! Bytes as hex and back: tenants, fingerprints, secrets and the admin
//! API's binary values are all written so.

/// Bytes as lowercase hex, two digits each: the tenant hash, the
/// fingerprint's text form, the admin API's binary bodies. A table lookup
/// per nibble; `format!("{b:02x}")` per byte was about 1 % of the gateway's
/// CPU on replays (the tenant hash runs on every protected request).
pub fn to_hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut out = vec![0; bytes.len() * 2];
    for (pair, &b) in out.chunks_exact_mut(2).zip(bytes) {
        pair[0] = DIGITS[usize::from(b >> 4)];
        pair[1] = DIGITS[usize::from(b & 0x0f)];
    }
    String::from_utf8(out).expect("hex digits are ASCII")
}

/// The bytes written by [`to_hex`] (digits in either case); `None` for an
/// odd number of digits or anything that is not a hex digit.
pub fn from_hex(text: &str) -> Option<Vec<u8>> {
    let text = text.as_bytes();
    if !text.len().is_multiple_of(2) {
        return None;
    }
    let nibble = |c: u8| (c as char).to_digit(16).map(|d| d as u8);
    text.chunks_exact(2)
        .map(|pair| Some(nibble(pair[0])? << 4 | nibble(pair[1])?))
        .collect()
}

/// 32 bytes written as exactly 64 hex digits (either case).
pub(crate) fn hex32(text: &str) -> Option<[u8; 32]> {
    from_hex(text)?.try_into().ok()
}
