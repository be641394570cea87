//! JSON documents as a fingerprint reads them: each number kept as the
//! exact decimal it spells, and nothing two readers could read apart.
//!
//! A payment service reads `0.1` and `0.10000000000000001` (or a 64-bit
//! id beyond ±2^53) with a Decimal or BigDecimal type, where they are
//! different values; a binary double would make them one. So the reader
//! keeps every number as written ([`Number`]) and compares numbers by
//! exact decimal value: `1`, `1.0`, `1e0` and `10e-1` are one number,
//! and negative zero is zero (Decimal and BigDecimal compare `-0` equal to
//! `0`; RFC 8785 writes both as `0`).
//!
//! A document is refused ([`JsonRefusal::Ambiguous`]) when a member name
//! appears twice in one object (RFC 8259 leaves which one wins open). A
//! number whose scale is beyond ±10^18 ([`MAX_EXPONENT`], far past any
//! decimal type's) has no canonical form ([`JsonRefusal::OutOfRange`]).
//!
//! The reader takes time and memory linear in the document's length: a
//! number is kept as its text, and its exponent is read as a bounded
//! integer, never expanded (`1e999999999999` costs 14 bytes).
//!
//! ```
//! use idem::json::{self, Value};
//!
//! let doc = json::parse(br#"{"id": 18446744073709551617, "amount": 0.10}"#)?;
//! let Value::Object(members) = &doc else { unreachable!() };
//! let Some(Value::Number(id)) = members.get("id") else { unreachable!() };
//! assert_eq!(id.as_str(), "18446744073709551617");
//! assert_eq!(members["amount"], json::parse(b"1e-1")?);
//! # Ok::<(), idem::JsonRefusal>(())
//! ```

use std::collections::BTreeMap;

/// Why a body is not given a canonical JSON form.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum JsonRefusal {
    /// It does not parse as JSON.
    #[error("not JSON")]
    NotJson,
    /// It parses, but two JSON readers may read it as different documents,
    /// so its canonical form cannot stand for what the receiver reads: a
    /// member name twice in one object (RFC 8259 leaves which wins open),
    /// or, in the doubles form of earlier versions, an integer beyond
    /// ±2^53.
    #[error("{0}")]
    Ambiguous(String),
    /// It parses, but a number's scale is beyond ±10^18
    /// ([`MAX_EXPONENT`]), which no decimal type reads: it
    /// has no canonical form, and is fingerprinted by its bytes.
    #[error("{0}")]
    OutOfRange(String),
}

/// The largest scale a number may have: `|e| <= 10^18` in its scientific
/// form `d.ddd × 10^e`.
pub const MAX_EXPONENT: i128 = 1_000_000_000_000_000_000;

/// How deep arrays and objects may nest: as serde_json reads, so a
/// document reads the same here as in earlier versions.
const MAX_DEPTH: usize = 127;

/// A JSON value whose numbers are exact decimals.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Value {
    /// `null`.
    Null,
    /// `true` or `false`.
    Bool(bool),
    /// A number, as written.
    Number(Number),
    /// A string, unescaped.
    String(String),
    /// An array.
    Array(Vec<Value>),
    /// An object; each name appears once.
    Object(Map),
}

/// An object's members, in the order of their names' UTF-8 bytes.
pub type Map = BTreeMap<String, Value>;

/// A JSON number kept as its text: equal to another when their decimal
/// values are.
#[derive(Debug, Clone)]
pub struct Number {
    text: Box<str>,
}

/// A number's exact value: `(-1)^negative × 0.digits × 10^point`, where
/// `digits` (the concatenation of `head` and `tail`) has no leading or
/// trailing zero; no digits is zero, whatever the sign.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Decimal<'a> {
    pub(crate) negative: bool,
    pub(crate) head: &'a [u8],
    pub(crate) tail: &'a [u8],
    pub(crate) point: i128,
}

impl Decimal<'_> {
    pub(crate) fn is_zero(&self) -> bool {
        self.head.is_empty() && self.tail.is_empty()
    }

    pub(crate) fn len(&self) -> usize {
        self.head.len() + self.tail.len()
    }

    fn digits(&self) -> impl Iterator<Item = u8> + '_ {
        self.head.iter().chain(self.tail).copied()
    }
}

impl Number {
    /// The number as it was written.
    pub fn as_str(&self) -> &str {
        &self.text
    }

    /// Whether it was written as an integer: no fraction, no exponent.
    pub fn is_integer_literal(&self) -> bool {
        !self.text.bytes().any(|b| matches!(b, b'.' | b'e' | b'E'))
    }

    /// The nearest double (infinite beyond its range), as a binary reader
    /// reads it.
    pub fn as_f64(&self) -> f64 {
        self.text.parse().unwrap_or(f64::NAN)
    }

    /// The exact value. The text is a valid JSON number whose exponent the
    /// reader checked.
    pub(crate) fn decimal(&self) -> Decimal<'_> {
        decimal(self.text.as_bytes()).expect("a number's exponent is checked when it is read")
    }
}

impl PartialEq for Number {
    fn eq(&self, other: &Self) -> bool {
        let (a, b) = (self.decimal(), other.decimal());
        if a.is_zero() || b.is_zero() {
            return a.is_zero() && b.is_zero();
        }
        a.negative == b.negative && a.point == b.point && a.digits().eq(b.digits())
    }
}

impl Eq for Number {}

/// The exact value of a JSON number literal; `None` when its scale is
/// beyond [`MAX_EXPONENT`]. Linear in the literal's length.
fn decimal(text: &[u8]) -> Option<Decimal<'_>> {
    let (negative, rest) = match text.split_first() {
        Some((b'-', rest)) => (true, rest),
        _ => (false, text),
    };
    let mantissa_end = rest
        .iter()
        .position(|b| matches!(b, b'e' | b'E'))
        .unwrap_or(rest.len());
    let (mantissa, exponent) = rest.split_at(mantissa_end);
    let (int, frac) = match mantissa.iter().position(|&b| b == b'.') {
        Some(dot) => (&mantissa[..dot], &mantissa[dot + 1..]),
        None => (mantissa, &[][..]),
    };
    // Leading zeros come off the integer part and, when it is all zeros,
    // off the fraction; trailing zeros off the fraction and, when it is
    // all zeros, off the integer part.
    let int = trim_start_zeros(int);
    let (head, tail, frac_lead) = if int.is_empty() {
        let digits = trim_start_zeros(frac);
        (&[][..], digits, frac.len() - digits.len())
    } else {
        (int, frac, 0)
    };
    let (head, tail) = if trim_end_zeros(tail).is_empty() {
        (trim_end_zeros(head), &[][..])
    } else {
        (head, trim_end_zeros(tail))
    };
    if head.is_empty() && tail.is_empty() {
        return Some(Decimal {
            negative,
            head,
            tail,
            point: 0,
        });
    }
    // The literal's own exponent: more than 20 significant digits is out
    // of range whatever the rest of the literal (which is shorter than
    // 2^63 bytes, far below 10^20 - 10^18).
    let exponent = exponent.get(1..).unwrap_or_default();
    let (exp_negative, exp_digits) = match exponent.split_first() {
        Some((b'-', rest)) => (true, rest),
        Some((b'+', rest)) => (false, rest),
        _ => (false, exponent),
    };
    let exp_digits = trim_start_zeros(exp_digits);
    if exp_digits.len() > 20 {
        return None;
    }
    let magnitude = exp_digits
        .iter()
        .fold(0i128, |n, d| n * 10 + i128::from(d - b'0'));
    let exp = if exp_negative { -magnitude } else { magnitude };
    // The value is int.frac × 10^exp = 0.digits × 10^point.
    let point = exp + i128::try_from(int.len()).ok()? - i128::try_from(frac_lead).ok()?;
    // Its scientific exponent (one digit before the point) is point - 1.
    if (point - 1).abs() > MAX_EXPONENT {
        return None;
    }
    Some(Decimal {
        negative,
        head,
        tail,
        point,
    })
}

fn trim_start_zeros(digits: &[u8]) -> &[u8] {
    let start = digits
        .iter()
        .position(|&b| b != b'0')
        .unwrap_or(digits.len());
    &digits[start..]
}

fn trim_end_zeros(digits: &[u8]) -> &[u8] {
    let end = digits.iter().rposition(|&b| b != b'0').map_or(0, |i| i + 1);
    &digits[..end]
}

/// Writes `d` as ECMAScript writes a number with exactly these digits
/// (`Number::prototype.toString`, the form RFC 8785 gives doubles): plain
/// digits from 10^-7 up to 10^21, exponent form outside. A number whose
/// digits are the shortest of its double is thus written as RFC 8785
/// writes that double; one with more digits keeps them all. At most 21
/// bytes more than the digits.
pub(crate) fn write_decimal(d: &Decimal<'_>, out: &mut Vec<u8>) {
    if d.is_zero() {
        out.push(b'0');
        return;
    }
    if d.negative {
        out.push(b'-');
    }
    let k = i128::try_from(d.len()).unwrap_or(i128::MAX);
    let n = d.point;
    if k <= n && n <= 21 {
        out.extend(d.digits());
        out.extend(std::iter::repeat_n(
            b'0',
            usize::try_from(n - k).unwrap_or(0),
        ));
    } else if 0 < n && n <= 21 {
        let n = usize::try_from(n).unwrap_or(0);
        for (i, digit) in d.digits().enumerate() {
            if i == n {
                out.push(b'.');
            }
            out.push(digit);
        }
    } else if -6 < n && n <= 0 {
        out.extend_from_slice(b"0.");
        out.extend(std::iter::repeat_n(b'0', usize::try_from(-n).unwrap_or(0)));
        out.extend(d.digits());
    } else {
        for (i, digit) in d.digits().enumerate() {
            if i == 1 {
                out.push(b'.');
            }
            out.push(digit);
        }
        out.push(b'e');
        out.push(if n - 1 < 0 { b'-' } else { b'+' });
        let exp = u64::try_from((n - 1).unsigned_abs()).unwrap_or(u64::MAX);
        out.extend_from_slice(itoa::Buffer::new().format(exp).as_bytes());
    }
}

/// Reads `body` as one JSON document (RFC 8259), white space around it
/// allowed. Refuses what is not JSON, a member name twice in one object,
/// and a number out of range; see the [module docs](self).
pub fn parse(body: &[u8]) -> Result<Value, JsonRefusal> {
    let text = std::str::from_utf8(body).map_err(|_| JsonRefusal::NotJson)?;
    let mut reader = Reader {
        text,
        bytes: text.as_bytes(),
        at: 0,
    };
    reader.skip_space();
    let value = reader.value(0)?;
    reader.skip_space();
    if reader.at != reader.bytes.len() {
        return Err(JsonRefusal::NotJson);
    }
    Ok(value)
}

struct Reader<'a> {
    text: &'a str,
    bytes: &'a [u8],
    at: usize,
}

impl Reader<'_> {
    fn peek(&self) -> Option<u8> {
        self.bytes.get(self.at).copied()
    }

    fn skip_space(&mut self) {
        while matches!(self.peek(), Some(b' ' | b'\t' | b'\n' | b'\r')) {
            self.at += 1;
        }
    }

    fn literal(&mut self, word: &[u8], value: Value) -> Result<Value, JsonRefusal> {
        if self.bytes[self.at..].starts_with(word) {
            self.at += word.len();
            Ok(value)
        } else {
            Err(JsonRefusal::NotJson)
        }
    }

    fn value(&mut self, depth: usize) -> Result<Value, JsonRefusal> {
        match self.peek().ok_or(JsonRefusal::NotJson)? {
            b'n' => self.literal(b"null", Value::Null),
            b't' => self.literal(b"true", Value::Bool(true)),
            b'f' => self.literal(b"false", Value::Bool(false)),
            b'"' => self.string().map(Value::String),
            b'[' => self.array(depth + 1),
            b'{' => self.object(depth + 1),
            b'-' | b'0'..=b'9' => self.number(),
            _ => Err(JsonRefusal::NotJson),
        }
    }

    fn array(&mut self, depth: usize) -> Result<Value, JsonRefusal> {
        if depth > MAX_DEPTH {
            return Err(JsonRefusal::NotJson);
        }
        self.at += 1;
        let mut items = Vec::new();
        self.skip_space();
        if self.peek() == Some(b']') {
            self.at += 1;
            return Ok(Value::Array(items));
        }
        loop {
            self.skip_space();
            items.push(self.value(depth)?);
            self.skip_space();
            match self.peek() {
                Some(b',') => self.at += 1,
                Some(b']') => {
                    self.at += 1;
                    return Ok(Value::Array(items));
                }
                _ => return Err(JsonRefusal::NotJson),
            }
        }
    }

    fn object(&mut self, depth: usize) -> Result<Value, JsonRefusal> {
        if depth > MAX_DEPTH {
            return Err(JsonRefusal::NotJson);
        }
        self.at += 1;
        let mut members = Map::new();
        self.skip_space();
        if self.peek() == Some(b'}') {
            self.at += 1;
            return Ok(Value::Object(members));
        }
        loop {
            self.skip_space();
            if self.peek() != Some(b'"') {
                return Err(JsonRefusal::NotJson);
            }
            let name = self.string()?;
            self.skip_space();
            if self.peek() != Some(b':') {
                return Err(JsonRefusal::NotJson);
            }
            self.at += 1;
            self.skip_space();
            let value = self.value(depth)?;
            if members.contains_key(&name) {
                return Err(JsonRefusal::Ambiguous(format!(
                    "the member name {name:?} appears twice in one object"
                )));
            }
            members.insert(name, value);
            self.skip_space();
            match self.peek() {
                Some(b',') => self.at += 1,
                Some(b'}') => {
                    self.at += 1;
                    return Ok(Value::Object(members));
                }
                _ => return Err(JsonRefusal::NotJson),
            }
        }
    }

    /// `-? (0 | [1-9][0-9]*) (. [0-9]+)? ([eE] [+-]? [0-9]+)?`
    fn number(&mut self) -> Result<Value, JsonRefusal> {
        let start = self.at;
        if self.peek() == Some(b'-') {
            self.at += 1;
        }
        match self.peek() {
            Some(b'0') => self.at += 1,
            Some(b'1'..=b'9') => self.digits(),
            _ => return Err(JsonRefusal::NotJson),
        }
        if self.peek() == Some(b'.') {
            self.at += 1;
            self.required_digits()?;
        }
        if matches!(self.peek(), Some(b'e' | b'E')) {
            self.at += 1;
            if matches!(self.peek(), Some(b'+' | b'-')) {
                self.at += 1;
            }
            self.required_digits()?;
        }
        let text = &self.text[start..self.at];
        if decimal(text.as_bytes()).is_none() {
            return Err(JsonRefusal::OutOfRange(format!(
                "the number {} has a scale beyond ±10^18",
                abbreviated(text)
            )));
        }
        Ok(Value::Number(Number { text: text.into() }))
    }

    fn digits(&mut self) {
        while matches!(self.peek(), Some(b'0'..=b'9')) {
            self.at += 1;
        }
    }

    fn required_digits(&mut self) -> Result<(), JsonRefusal> {
        let start = self.at;
        self.digits();
        if self.at == start {
            return Err(JsonRefusal::NotJson);
        }
        Ok(())
    }

    fn string(&mut self) -> Result<String, JsonRefusal> {
        self.at += 1;
        let mut out = String::new();
        let mut run = self.at;
        loop {
            let b = self.peek().ok_or(JsonRefusal::NotJson)?;
            match b {
                b'"' => {
                    out.push_str(&self.text[run..self.at]);
                    self.at += 1;
                    return Ok(out);
                }
                b'\\' => {
                    out.push_str(&self.text[run..self.at]);
                    self.at += 1;
                    self.escape(&mut out)?;
                    run = self.at;
                }
                0x00..=0x1f => return Err(JsonRefusal::NotJson),
                _ => self.at += 1,
            }
        }
    }

    fn escape(&mut self, out: &mut String) -> Result<(), JsonRefusal> {
        let b = self.peek().ok_or(JsonRefusal::NotJson)?;
        self.at += 1;
        let c = match b {
            b'"' => '"',
            b'\\' => '\\',
            b'/' => '/',
            b'b' => '\u{8}',
            b'f' => '\u{c}',
            b'n' => '\n',
            b'r' => '\r',
            b't' => '\t',
            b'u' => {
                let first = self.hex4()?;
                let code = match first {
                    0xD800..=0xDBFF => {
                        // A high surrogate must be followed by a low one.
                        if !self.bytes[self.at..].starts_with(b"\\u") {
                            return Err(JsonRefusal::NotJson);
                        }
                        self.at += 2;
                        let second = self.hex4()?;
                        if !(0xDC00..=0xDFFF).contains(&second) {
                            return Err(JsonRefusal::NotJson);
                        }
                        0x10000 + ((first - 0xD800) << 10) + (second - 0xDC00)
                    }
                    0xDC00..=0xDFFF => return Err(JsonRefusal::NotJson),
                    other => other,
                };
                char::from_u32(code).ok_or(JsonRefusal::NotJson)?
            }
            _ => return Err(JsonRefusal::NotJson),
        };
        out.push(c);
        Ok(())
    }

    fn hex4(&mut self) -> Result<u32, JsonRefusal> {
        let digits = self
            .bytes
            .get(self.at..self.at + 4)
            .ok_or(JsonRefusal::NotJson)?;
        let mut code = 0;
        for &d in digits {
            code = code * 16 + (d as char).to_digit(16).ok_or(JsonRefusal::NotJson)?;
        }
        self.at += 4;
        Ok(code)
    }
}

/// A long number's first and last characters, for a message.
fn abbreviated(text: &str) -> String {
    if text.len() <= 40 {
        return text.to_owned();
    }
    format!("{}…{}", &text[..20], &text[text.len() - 20..])
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The reader accepts exactly what serde_json accepts (as earlier
    /// versions read bodies), numbers in range aside.
    #[test]
    fn reads_what_serde_json_reads() {
        let nested = |depth: usize| format!("{}{}", "[".repeat(depth), "]".repeat(depth));
        let mut cases: Vec<String> = [
            "null",
            " true ",
            "false",
            "0",
            "-0",
            "-0.0e+0",
            "01",
            "1.",
            ".5",
            "-",
            "1e",
            "1e+",
            "+1",
            "[1,]",
            "[,1]",
            "{\"a\":1,}",
            "{\"a\" 1}",
            "{1:1}",
            "\"\\u00e9\\ud83d\\ude00\"",
            "\"\\ud83d\"",
            "\"\\ude00\"",
            "\"\\ud83dx\"",
            "\"\\x\"",
            "\"a\u{1}\"",
            "\"a\u{7f}\"",
            "\"\\/\"",
            "[1 2]",
            "nul",
            "truex",
            "[] []",
            "\u{feff}1",
            "{\"a\":[{}]}",
            "\"",
            "[\"\\u12\"]",
            "1 ",
            "\t\r\n1",
            "1\u{a0}",
        ]
        .iter()
        .map(|s| (*s).to_owned())
        .collect();
        cases.extend((125..130).map(nested));
        for text in cases {
            let ours = parse(text.as_bytes()).is_ok();
            let theirs = serde_json::from_str::<serde_json::Value>(&text).is_ok();
            assert_eq!(ours, theirs, "{text:?}");
        }
        assert_eq!(parse(b"\xff"), Err(JsonRefusal::NotJson));
    }

    #[test]
    fn strings_are_unescaped() {
        assert_eq!(
            parse(br#""a\"\\\/\b\f\n\r\t\u00e9\ud83d\ude00z""#),
            Ok(Value::String("a\"\\/\u{8}\u{c}\n\r\té😀z".to_owned()))
        );
    }

    #[test]
    fn a_scale_beyond_the_bound_is_out_of_range_and_zero_never_is() {
        for text in [
            "1e1000000000000000001",
            "1e-999999999999999999999",
            "[0.5e1000000000000000002]",
        ] {
            assert!(
                matches!(parse(text.as_bytes()), Err(JsonRefusal::OutOfRange(_))),
                "{text}"
            );
        }
        for text in [
            "1e1000000000000000000",
            "0.5e1000000000000000001",
            "0e99999999999999999999999",
            "1e-999999999999999999",
        ] {
            assert!(parse(text.as_bytes()).is_ok(), "{text}");
        }
    }

    #[test]
    fn numbers_equal_by_value() {
        let n = |t: &str| match parse(t.as_bytes()) {
            Ok(Value::Number(n)) => n,
            other => panic!("{t}: {other:?}"),
        };
        assert_eq!(n("1.50"), n("15e-1"));
        assert_eq!(n("-0"), n("0.0"));
        assert_ne!(n("1"), n("-1"));
        assert_ne!(n("0.1"), n("0.10000000000000001"));
        assert!(n("12").is_integer_literal());
        assert!(!n("12.0").is_integer_literal() && !n("1e1").is_integer_literal());
    }
}
