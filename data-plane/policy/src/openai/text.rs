//! The prefix text of a request by its API's rule (the module docs of `openai`).

use std::borrow::Cow;

use serde_json::value::RawValue;

use super::{ImageUrl, Item, OpenAiRequest, Part, TextRule};

impl OpenAiRequest<'_> {
    /// The first `max_chars` characters of the prefix text of a chat or completions body
    /// ([`TextRule::Chat`]).
    pub fn prefix_text(&self, max_chars: usize) -> String {
        self.prefix_text_for(TextRule::Chat, max_chars)
    }

    /// The first `max_chars` characters of the prefix text under `rule` (see the module docs).
    pub fn prefix_text_for(&self, rule: TextRule, max_chars: usize) -> String {
        let mut out = PrefixBuilder::new(max_chars);
        let other = &self.other;
        match rule {
            TextRule::Chat => self.chat_text(&mut out),
            TextRule::Responses => {
                if let Some(instructions) = other.instructions.filter(|raw| raw.get() != "null") {
                    value_text(instructions, &mut out);
                    out.push("\n");
                }
                if let Some(input) = other.input {
                    value_text(input, &mut out);
                }
            }
            TextRule::Input => match other.input {
                Some(input) => value_text(input, &mut out),
                None => self.chat_text(&mut out),
            },
            TextRule::Score => two_sides(other.first_side, other.second_side, &mut out),
            TextRule::Rerank => two_sides(other.query, other.second_side, &mut out),
            TextRule::Tokens => {
                if let Some(tokens) = other.tokens {
                    value_text(tokens, &mut out);
                }
            }
        }
        out.text
    }

    /// `messages`, else `prompt`.
    fn chat_text(&self, out: &mut PrefixBuilder) {
        if let Some(messages) = &self.messages {
            for message in messages {
                if out.full() {
                    break;
                }
                if let Some(content) = message.content {
                    content_text(content, out);
                }
                out.push("\n");
            }
        } else if let Some(prompt) = self.prompt {
            prompt_text(prompt, out);
        }
    }
}

/// `first`, `"\n"`, then `second` (each when present) by the value rule.
fn two_sides(first: Option<&RawValue>, second: Option<&RawValue>, out: &mut PrefixBuilder) {
    if let Some(first) = first {
        value_text(first, out);
        out.push("\n");
    }
    if let Some(second) = second {
        value_text(second, out);
    }
}

/// The value rule (module docs): strings as they are, numbers in decimal, objects by their
/// `content` or `text`, arrays element by element.
fn value_text(value: &RawValue, out: &mut PrefixBuilder) {
    if out.full() {
        return;
    }
    let raw = value.get();
    match raw.as_bytes().first() {
        Some(b'"') => {
            if let Ok(text) = serde_json::from_str::<Cow<'_, str>>(raw) {
                out.push(&text);
            }
        }
        Some(b'-' | b'0'..=b'9') => out.push(raw),
        Some(b'{') => {
            if let Ok(item) = serde_json::from_str::<Item<'_>>(raw) {
                match (item.content, &item.text) {
                    (Some(content), _) => content_text(content, out),
                    (None, Some(text)) => out.push(text),
                    (None, None) => {}
                }
            }
        }
        Some(b'[') => {
            if let Ok(elements) = serde_json::from_str::<Vec<&RawValue>>(raw) {
                let numbers = elements.first().is_some_and(|first| {
                    matches!(first.get().as_bytes().first(), Some(b'-' | b'0'..=b'9'))
                });
                let separator = if numbers { " " } else { "\n" };
                for (index, element) in elements.iter().enumerate() {
                    if out.full() {
                        break;
                    }
                    if index > 0 {
                        out.push(separator);
                    }
                    value_text(element, out);
                }
            }
        }
        _ => {}
    }
}

struct PrefixBuilder {
    text: String,
    remaining: usize,
}

impl PrefixBuilder {
    fn new(max_chars: usize) -> Self {
        Self {
            text: String::with_capacity(max_chars.min(1 << 16)),
            remaining: max_chars,
        }
    }

    fn full(&self) -> bool {
        self.remaining == 0
    }

    fn push(&mut self, piece: &str) {
        if self.remaining == 0 {
            return;
        }
        // Fast path: ASCII-only pieces count bytes.
        if piece.len() <= self.remaining && piece.is_ascii() {
            self.text.push_str(piece);
            self.remaining -= piece.len();
            return;
        }
        for c in piece.chars() {
            if self.remaining == 0 {
                return;
            }
            self.text.push(c);
            self.remaining -= 1;
        }
    }
}

/// A JSON string's text; for a list, what `list` makes of its raw JSON; nothing otherwise.
fn string_or_list(
    value: &RawValue,
    out: &mut PrefixBuilder,
    list: impl FnOnce(&str, &mut PrefixBuilder),
) {
    let raw = value.get();
    match raw.as_bytes().first() {
        Some(b'"') => {
            if let Ok(text) = serde_json::from_str::<Cow<'_, str>>(raw) {
                out.push(&text);
            }
        }
        Some(b'[') => list(raw, out),
        _ => {}
    }
}

fn content_text(content: &RawValue, out: &mut PrefixBuilder) {
    string_or_list(content, out, |raw, out| {
        if let Ok(parts) = serde_json::from_str::<Vec<Part<'_>>>(raw) {
            for part in parts {
                match part.kind.as_deref() {
                    Some("text" | "input_text" | "output_text") => {
                        if let Some(text) = &part.text {
                            out.push(text);
                        }
                    }
                    Some("image_url" | "input_image") => {
                        if let Some(url) = part.image_url.as_ref().and_then(ImageUrl::url) {
                            out.push(url);
                        }
                    }
                    _ => {}
                }
            }
        }
    });
}

fn prompt_text(prompt: &RawValue, out: &mut PrefixBuilder) {
    string_or_list(prompt, out, |raw, out| {
        if let Ok(texts) = serde_json::from_str::<Vec<Cow<'_, str>>>(raw) {
            for (index, text) in texts.iter().enumerate() {
                if index > 0 {
                    out.push("\n");
                }
                out.push(text);
            }
        } else if let Ok(tokens) = serde_json::from_str::<Vec<u64>>(raw) {
            let mut buffer = String::with_capacity(20);
            for (index, token) in tokens.iter().enumerate() {
                if out.full() {
                    break;
                }
                if index > 0 {
                    out.push(" ");
                }
                buffer.clear();
                use std::fmt::Write as _;
                let _ = write!(buffer, "{token}");
                out.push(&buffer);
            }
        }
    });
}
