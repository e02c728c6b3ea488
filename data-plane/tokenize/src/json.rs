//! JSON as Python reads and writes it: objects keep their keys in the order given (Python's
//! dicts do, and a chat template that prints a tool's schema prints it in that order), and
//! [`dumps`] writes a template value exactly as Python's `json.dumps` does, which is what
//! Hugging Face's `tojson` filter calls.

use std::fmt::Write as _;
use std::sync::Arc;

use minijinja::Value;
use minijinja::value::ValueKind;
use serde::de::{Deserialize, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};

/// A JSON value whose objects keep their key order. Strings are shared, so that a long
/// message's text is copied once, from the body, and reaches the template without another copy.
#[derive(Debug, Clone, PartialEq)]
pub enum Json {
    Null,
    Bool(bool),
    Number(serde_json::Number),
    String(Arc<str>),
    Array(Vec<Json>),
    Object(Vec<(String, Json)>),
}

impl Json {
    pub fn get(&self, key: &str) -> Option<&Json> {
        match self {
            Json::Object(fields) => fields
                .iter()
                .find(|(name, _)| name == key)
                .map(|(_, value)| value),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Json::String(text) => Some(text),
            _ => None,
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match self {
            Json::Bool(value) => Some(*value),
            _ => None,
        }
    }

    /// The value a template sees (maps in key order).
    pub fn to_value(&self) -> Value {
        match self {
            Json::Null => Value::from(()),
            Json::Bool(value) => Value::from(*value),
            Json::Number(number) => {
                if let Some(int) = number.as_i64() {
                    Value::from(int)
                } else if let Some(int) = number.as_u64() {
                    Value::from(int)
                } else {
                    Value::from(number.as_f64().unwrap_or(f64::NAN))
                }
            }
            Json::String(text) => Value::from(Arc::clone(text)),
            Json::Array(items) => Value::from_iter(items.iter().map(Json::to_value)),
            Json::Object(fields) => Value::from_pairs(
                fields
                    .iter()
                    .map(|(name, value)| (name.as_str(), value.to_value())),
            ),
        }
    }
}

impl<'de> Deserialize<'de> for Json {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct JsonVisitor;
        impl<'de> Visitor<'de> for JsonVisitor {
            type Value = Json;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a JSON value")
            }
            fn visit_unit<E>(self) -> Result<Json, E> {
                Ok(Json::Null)
            }
            fn visit_none<E>(self) -> Result<Json, E> {
                Ok(Json::Null)
            }
            fn visit_bool<E>(self, value: bool) -> Result<Json, E> {
                Ok(Json::Bool(value))
            }
            fn visit_i64<E>(self, value: i64) -> Result<Json, E> {
                Ok(Json::Number(value.into()))
            }
            fn visit_u64<E>(self, value: u64) -> Result<Json, E> {
                Ok(Json::Number(value.into()))
            }
            fn visit_f64<E: serde::de::Error>(self, value: f64) -> Result<Json, E> {
                serde_json::Number::from_f64(value)
                    .map(Json::Number)
                    .ok_or_else(|| E::custom("a number that is not finite"))
            }
            fn visit_str<E>(self, value: &str) -> Result<Json, E> {
                Ok(Json::String(value.into()))
            }
            fn visit_string<E>(self, value: String) -> Result<Json, E> {
                Ok(Json::String(value.into()))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Json, A::Error> {
                let mut items = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(1024));
                while let Some(item) = seq.next_element()? {
                    items.push(item);
                }
                Ok(Json::Array(items))
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Json, A::Error> {
                let mut fields: Vec<(String, Json)> = Vec::new();
                // Where each key is, once an object has many (a linear search per key would
                // make a body of many keys quadratic).
                let mut places: Option<std::collections::HashMap<String, usize>> = None;
                while let Some((name, value)) = map.next_entry::<String, Json>()? {
                    if places.is_none() && fields.len() >= 16 {
                        places = Some(
                            fields
                                .iter()
                                .enumerate()
                                .map(|(place, (known, _))| (known.clone(), place))
                                .collect(),
                        );
                    }
                    let known = match &places {
                        Some(places) => places.get(&name).copied(),
                        None => fields.iter().position(|(known, _)| *known == name),
                    };
                    // A repeated key keeps its first place and its last value, as in Python.
                    match known {
                        Some(place) => fields[place].1 = value,
                        None => {
                            if let Some(places) = &mut places {
                                places.insert(name.clone(), fields.len());
                            }
                            fields.push((name, value));
                        }
                    }
                }
                Ok(Json::Object(fields))
            }
        }
        deserializer.deserialize_any(JsonVisitor)
    }
}

/// The fields `names` of the JSON object `body`, as a [`Json`] object (a repeated one keeps its
/// last value). The values of the other fields are passed over without being decoded, so a
/// value in a field nobody reads (a lone surrogate escape, `1e400`: Python reads both) cannot
/// fail the whole body.
pub fn read_fields(body: &[u8], names: &[&str]) -> serde_json::Result<Json> {
    let mut deserializer = serde_json::Deserializer::from_slice(body);
    let fields = FieldsSeed(names).deserialize(&mut deserializer)?;
    deserializer.end()?;
    Ok(fields)
}

struct FieldsSeed<'n>(&'n [&'n str]);

impl<'de> DeserializeSeed<'de> for FieldsSeed<'_> {
    type Value = Json;
    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Json, D::Error> {
        deserializer.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for FieldsSeed<'_> {
    type Value = Json;
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a JSON object")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Json, A::Error> {
        let mut fields: Vec<(String, Json)> = Vec::new();
        while let Some(name) = map.next_key::<std::borrow::Cow<'de, str>>()? {
            if !self.0.contains(&name.as_ref()) {
                map.next_value::<serde::de::IgnoredAny>()?;
                continue;
            }
            let value = map.next_value::<Json>()?;
            match fields.iter_mut().find(|(known, _)| *known == name) {
                Some((_, kept)) => *kept = value,
                None => fields.push((name.into_owned(), value)),
            }
        }
        Ok(Json::Object(fields))
    }
}

/// `json.dumps`'s options that Hugging Face's `tojson` filter passes on.
#[derive(Debug, Clone, Default)]
pub struct DumpOptions {
    pub ensure_ascii: bool,
    pub indent: Option<String>,
    /// (item separator, key separator); Python's default is `(", ", ": ")`, or `(",", ": ")`
    /// with an indent.
    pub separators: Option<(String, String)>,
    pub sort_keys: bool,
}

/// Why a value cannot be written as JSON (Python raises `TypeError` for these too).
#[derive(Debug, thiserror::Error)]
#[error("{0} is not JSON serializable")]
pub struct NotJson(pub String);

/// `value` as Python's `json.dumps(value, ...)` writes it.
pub fn dumps(value: &Value, options: &DumpOptions) -> Result<String, NotJson> {
    let (item, key) = match &options.separators {
        Some((item, key)) => (item.as_str(), key.as_str()),
        None if options.indent.is_some() => (",", ": "),
        None => (", ", ": "),
    };
    let mut writer = Writer {
        out: String::new(),
        options,
        item,
        key,
    };
    writer.value(value, 0)?;
    Ok(writer.out)
}

struct Writer<'a> {
    out: String,
    options: &'a DumpOptions,
    item: &'a str,
    key: &'a str,
}

impl Writer<'_> {
    fn value(&mut self, value: &Value, depth: usize) -> Result<(), NotJson> {
        match value.kind() {
            ValueKind::None => self.out.push_str("null"),
            ValueKind::Bool => self
                .out
                .push_str(if value.is_true() { "true" } else { "false" }),
            ValueKind::Number => self.number(value),
            ValueKind::String => {
                let text = value.as_str().unwrap_or_default();
                write_string(&mut self.out, text, self.options.ensure_ascii);
            }
            ValueKind::Seq | ValueKind::Iterable => {
                let items: Vec<Value> = value
                    .try_iter()
                    .map_err(|_| NotJson(value.kind().to_string()))?
                    .collect();
                self.out.push('[');
                for (position, item) in items.iter().enumerate() {
                    self.separate(position, depth + 1);
                    self.value(item, depth + 1)?;
                }
                self.close(']', items.is_empty(), depth);
            }
            ValueKind::Map => {
                let mut keys: Vec<Value> = value
                    .try_iter()
                    .map_err(|_| NotJson("map".into()))?
                    .collect();
                if self.options.sort_keys {
                    keys.sort();
                }
                self.out.push('{');
                for (position, key) in keys.iter().enumerate() {
                    self.separate(position, depth + 1);
                    let field = value.get_item(key).unwrap_or_default();
                    match key.as_str() {
                        Some(text) => write_string(&mut self.out, text, self.options.ensure_ascii),
                        // Python writes numbers, booleans and None as keys in their JSON form.
                        None => {
                            let mut plain = String::new();
                            std::mem::swap(&mut plain, &mut self.out);
                            self.value(key, depth + 1)?;
                            std::mem::swap(&mut plain, &mut self.out);
                            write_string(&mut self.out, &plain, self.options.ensure_ascii);
                        }
                    }
                    self.out.push_str(self.key);
                    self.value(&field, depth + 1)?;
                }
                self.close('}', keys.is_empty(), depth);
            }
            other => return Err(NotJson(other.to_string())),
        }
        Ok(())
    }

    fn number(&mut self, value: &Value) {
        if value.is_integer() {
            let _ = write!(self.out, "{value}");
        } else if let Ok(float) = f64::try_from(value.clone()) {
            self.out.push_str(&float_repr(float));
        } else {
            let _ = write!(self.out, "{value}");
        }
    }

    fn separate(&mut self, position: usize, depth: usize) {
        if position > 0 {
            self.out.push_str(self.item);
        }
        self.newline(depth);
    }

    fn close(&mut self, bracket: char, empty: bool, depth: usize) {
        if !empty {
            self.newline(depth);
        }
        self.out.push(bracket);
    }

    fn newline(&mut self, depth: usize) {
        if let Some(indent) = &self.options.indent {
            self.out.push('\n');
            for _ in 0..depth {
                self.out.push_str(indent);
            }
        }
    }
}

fn write_string(out: &mut String, text: &str, ensure_ascii: bool) {
    out.push('"');
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 || (ensure_ascii && (!c.is_ascii() || c == '\u{7f}')) => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// A float as Python's `repr` writes it: the shortest digits that read back the same, in
/// positional form for exponents from -4 to 15 (always with a fraction: `1.0`), else in
/// scientific form with a signed exponent of at least two digits (`1e-05`, `1e+16`).
pub fn float_repr(value: f64) -> String {
    if value.is_nan() {
        return "NaN".into();
    }
    if value.is_infinite() {
        return if value > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    if value == 0.0 {
        return if value.is_sign_negative() {
            "-0.0"
        } else {
            "0.0"
        }
        .into();
    }
    // Rust's `{:e}` gives the shortest round-trip digits: `d.ddde±x`.
    let scientific = format!("{value:e}");
    let (mantissa, exponent) = scientific.split_once('e').unwrap_or((&scientific, "0"));
    let exponent: i32 = exponent.parse().unwrap_or(0);
    let negative = mantissa.starts_with('-');
    let digits: String = mantissa.chars().filter(char::is_ascii_digit).collect();
    let sign = if negative { "-" } else { "" };
    if (-4..16).contains(&exponent) {
        let point = exponent + 1;
        let text = if point <= 0 {
            format!("0.{}{digits}", "0".repeat((-point) as usize))
        } else if point as usize >= digits.len() {
            format!("{digits}{}.0", "0".repeat(point as usize - digits.len()))
        } else {
            format!(
                "{}.{}",
                &digits[..point as usize],
                &digits[point as usize..]
            )
        };
        format!("{sign}{text}")
    } else {
        let fraction = if digits.len() > 1 {
            format!("{}.{}", &digits[..1], &digits[1..])
        } else {
            digits.clone()
        };
        let exponent_sign = if exponent < 0 { '-' } else { '+' };
        format!("{sign}{fraction}e{exponent_sign}{:02}", exponent.abs())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parsed(text: &str) -> Value {
        serde_json::from_str::<Json>(text).unwrap().to_value()
    }

    #[test]
    fn only_the_fields_read_are_decoded() {
        let names = &["prompt", "messages"];
        let read = |body: &str| read_fields(body.as_bytes(), names).map_err(|err| err.to_string());
        // Values Python reads and this parser would refuse, in fields nobody reads.
        let fields = read(r#"{"stop":"\ud800","temperature":1e400,"prompt":"x","n":[{"a":1}]}"#);
        assert_eq!(
            fields,
            Ok(Json::Object(vec![(
                "prompt".into(),
                Json::String("x".into())
            )]))
        );
        // In a field read, the same value fails the body.
        assert!(read(r#"{"prompt":"\ud800"}"#).is_err());
        // A repeated field keeps its first place and last value; escaped names are names.
        let fields = read(r#"{"prompt":"a","m\u0065ssages":null,"prompt":"b"}"#).unwrap();
        assert_eq!(
            fields,
            Json::Object(vec![
                ("prompt".into(), Json::String("b".into())),
                ("messages".into(), Json::Null),
            ])
        );
        assert!(read("[1]").is_err());
        assert!(read(r#"{"prompt":"x"} trailing"#).is_err());
    }

    #[test]
    fn floats_are_written_as_pythons_repr() {
        for (value, repr) in [
            (1.0, "1.0"),
            (0.1, "0.1"),
            (1e-5, "1e-05"),
            (0.0001, "0.0001"),
            (1e16, "1e+16"),
            (1e15, "1000000000000000.0"),
            (123456789.125, "123456789.125"),
            (-2.5e-7, "-2.5e-07"),
            (1.2345678901234568e17, "1.2345678901234568e+17"),
            (-0.0, "-0.0"),
        ] {
            assert_eq!(float_repr(value), repr, "{value:e}");
        }
    }

    #[test]
    fn dumps_keeps_key_order_and_pythons_separators() {
        let value = parsed(r#"{"z":1,"a":[true,null,"é\n"],"m":{},"f":2.0}"#);
        let plain = dumps(&value, &DumpOptions::default()).unwrap();
        assert_eq!(
            plain,
            r#"{"z": 1, "a": [true, null, "é\n"], "m": {}, "f": 2.0}"#
        );
        let options = DumpOptions {
            indent: Some("  ".into()),
            ensure_ascii: true,
            ..DumpOptions::default()
        };
        assert_eq!(
            dumps(&value, &options).unwrap(),
            "{\n  \"z\": 1,\n  \"a\": [\n    true,\n    null,\n    \"\\u00e9\\n\"\n  ],\n  \"m\": {},\n  \"f\": 2.0\n}"
        );
        let sorted = DumpOptions {
            sort_keys: true,
            separators: Some((",".into(), ":".into())),
            ..DumpOptions::default()
        };
        assert_eq!(
            dumps(&parsed(r#"{"b":1,"a":"<&>"}"#), &sorted).unwrap(),
            r#"{"a":"<&>","b":1}"#
        );
        assert_eq!(
            dumps(
                &Value::from("😀"),
                &DumpOptions {
                    ensure_ascii: true,
                    ..DumpOptions::default()
                }
            )
            .unwrap(),
            r#""\ud83d\ude00""#
        );
    }
}
