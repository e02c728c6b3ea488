//! Edits of a request body that keep every other byte: a new `model` or
//! `previous_response_id` spliced in where the old one sat, a field removed.

use std::ops::Range;

use serde_json::value::RawValue;

use super::{OpenAiRequest, span_in};

impl OpenAiRequest<'_> {
    /// The body with `model` set to `name` (added when absent); everything else byte for byte.
    pub fn with_model(&self, name: &str) -> Vec<u8> {
        self.rewrite(Some(name), None)
    }

    /// The body with `model` set to `model` (added when absent) and the value of
    /// `previous_response_id` (when present) replaced by `previous_response_id`; everything
    /// else byte for byte.
    pub fn rewrite(&self, model: Option<&str>, previous_response_id: Option<&str>) -> Vec<u8> {
        let quote = |text: &str| serde_json::to_string(text).unwrap_or_else(|_| "\"\"".into());
        // (where, replacement), in body order: spans never overlap.
        let mut edits: Vec<(Range<usize>, Vec<u8>)> = Vec::with_capacity(2);
        if let Some(name) = model {
            match &self.model_span {
                Some(span) => edits.push((span.clone(), quote(name).into_bytes())),
                None => {
                    // Insert right after the opening brace.
                    let brace = self.body.iter().position(|byte| *byte == b'{').unwrap_or(0);
                    let empty = self.body[brace + 1..]
                        .iter()
                        .all(|byte| byte.is_ascii_whitespace() || *byte == b'}');
                    let mut inserted = b"\"model\":".to_vec();
                    inserted.extend_from_slice(quote(name).as_bytes());
                    if !empty {
                        inserted.push(b',');
                    }
                    edits.push((brace + 1..brace + 1, inserted));
                }
            }
        }
        if let (Some(id), Some(span)) = (previous_response_id, &self.previous_response_id_span) {
            edits.push((span.clone(), quote(id).into_bytes()));
        }
        edits.sort_by_key(|(span, _)| span.start);
        let added: usize = edits.iter().map(|(_, bytes)| bytes.len()).sum();
        let mut out = Vec::with_capacity(self.body.len() + added);
        let mut at = 0;
        for (span, replacement) in edits {
            out.extend_from_slice(&self.body[at..span.start]);
            out.extend_from_slice(&replacement);
            at = span.end;
        }
        out.extend_from_slice(&self.body[at..]);
        out
    }
}

/// Reads the top-level members of a JSON object body: each key (escapes decoded) and where
/// its value sits in the body.
struct MembersVisitor<'a>(&'a [u8]);

impl<'de> serde::de::Visitor<'de> for MembersVisitor<'de> {
    type Value = Vec<(String, Range<usize>)>;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut members = Vec::new();
        while let Some((key, value)) = map.next_entry::<String, &'de RawValue>()? {
            members.push((key, span_in(self.0, value)));
        }
        Ok(members)
    }
}

/// `body` (a JSON object) without any top-level member named `field`, however its key is
/// written (escaped, or repeated: every copy goes); every other byte kept but for the
/// separators between members. `None` when there is no such member or the body is not a
/// JSON object.
pub fn without_field(body: &[u8], field: &str) -> Option<Vec<u8>> {
    let brace = body.iter().position(|byte| !byte.is_ascii_whitespace())?;
    if body[brace] != b'{' {
        return None;
    }
    let mut deserializer = serde_json::Deserializer::from_slice(body);
    let members =
        serde::Deserializer::deserialize_map(&mut deserializer, MembersVisitor(body)).ok()?;
    deserializer.end().ok()?;
    if members.iter().all(|(key, _)| key != field) {
        return None;
    }
    // A member's text runs from the end of the one before (or the brace) to the end of its
    // value; the separating comma and the whitespace around it are dropped.
    let mut out = Vec::with_capacity(body.len());
    out.extend_from_slice(&body[..=brace]);
    let mut start = brace + 1;
    let mut first = true;
    for (key, value) in &members {
        let text = &body[start..value.end];
        start = value.end;
        if key == field {
            continue;
        }
        let text = match text.iter().position(|byte| !byte.is_ascii_whitespace()) {
            Some(at) if text[at] == b',' => &text[at + 1..],
            _ => text,
        };
        if !first {
            out.push(b',');
        }
        out.extend_from_slice(text);
        first = false;
    }
    out.extend_from_slice(&body[start..]);
    Some(out)
}
