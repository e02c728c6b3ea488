//! The simulator's tokenizer approximation and chat template.
//!
//! A real Llama-3 tokenizer averages about four characters per token on English text. The
//! simulator does not need real token ids, only a count that is close enough and ids that are
//! stable, so that equal text prefixes give equal block hashes. The rule is simple enough for
//! a benchmark to build prompts of an exact token count:
//!
//! - a token is a maximal run of ASCII alphanumerics, capped at 6 characters (a longer run is
//!   split into 6-character pieces), or a single other non-whitespace character (punctuation,
//!   and every non-ASCII character);
//! - a run of ASCII whitespace attaches to the front of the following token (whitespace at the
//!   very end of the text is not a token);
//! - a token's id is the low 32 bits of `xxh3_64` of its bytes, leading whitespace included.
//!
//! So `"the cat sat"` is 3 tokens, and N space-separated words of at most 6 letters are N tokens.

use serde_json::Value;
use xxhash_rust::xxh3::xxh3_64;

/// Splits `text` into tokens by the documented approximation and returns their ids.
///
/// A token is a maximal run of ASCII alphanumerics capped at 6 characters (longer runs are
/// split into 6-character pieces), or a single other non-whitespace character; a run of ASCII
/// whitespace attaches to the front of the following token. Token id = low 32 bits of
/// `xxh3_64` of the token's bytes (including its leading whitespace). Non-ASCII characters are
/// one token each. `"the cat sat"` is 3 tokens.
pub fn tokenize(text: &str) -> Vec<u32> {
    let mut ids = Vec::with_capacity(text.len() / 4 + 1);
    for_each_token(text, |piece| ids.push(token_id(piece)));
    ids
}

/// The number of tokens [`tokenize`] would return, without allocating the ids.
pub fn count_tokens(text: &str) -> usize {
    let mut count = 0;
    for_each_token(text, |_| count += 1);
    count
}

/// The longest run of ASCII alphanumerics that forms one token.
const MAX_WORD_CHARS: usize = 6;

fn token_id(piece: &str) -> u32 {
    // Truncation to the low 32 bits is the documented id.
    xxh3_64(piece.as_bytes()) as u32
}

/// Calls `emit` with each token's text (leading whitespace included), in order.
fn for_each_token(text: &str, mut emit: impl FnMut(&str)) {
    let bytes = text.as_bytes();
    let mut token_start = 0;
    let mut index = 0;
    while index < bytes.len() {
        let byte = bytes[index];
        if byte.is_ascii_whitespace() {
            index += 1;
            continue;
        }
        if byte.is_ascii_alphanumeric() {
            let run_start = index;
            while index < bytes.len()
                && bytes[index].is_ascii_alphanumeric()
                && index - run_start < MAX_WORD_CHARS
            {
                index += 1;
            }
        } else {
            // One character, ASCII punctuation or any non-ASCII scalar value.
            let width = text[index..].chars().next().map_or(1, char::len_utf8);
            index += width;
        }
        emit(&text[token_start..index]);
        token_start = index;
    }
}

/// The chat template the simulator applies before tokenizing a chat request.
///
/// For each message: `"<|" + role + "|>\n" + text + "\n"`, where text is a string `content`, or
/// the concatenation of the `text` fields of the `{"type": "text"}` parts of an array `content`
/// (other parts, a missing or null content count as empty). Then `"<|assistant|>\n"`.
pub fn chat_prompt_text(messages: &[Value]) -> String {
    let mut prompt = String::new();
    for message in messages {
        let role = message.get("role").and_then(Value::as_str).unwrap_or("");
        prompt.push_str("<|");
        prompt.push_str(role);
        prompt.push_str("|>\n");
        match message.get("content") {
            Some(Value::String(text)) => prompt.push_str(text),
            Some(Value::Array(parts)) => {
                for part in parts {
                    if part.get("type").and_then(Value::as_str) == Some("text")
                        && let Some(text) = part.get("text").and_then(Value::as_str)
                    {
                        prompt.push_str(text);
                    }
                }
            }
            _ => {}
        }
        prompt.push('\n');
    }
    prompt.push_str("<|assistant|>\n");
    prompt
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// Checks each text's token count.
    fn assert_counts(cases: &[(&str, usize)]) {
        for (text, tokens) in cases {
            assert_eq!(count_tokens(text), *tokens, "{text:?}");
        }
    }

    #[test]
    fn words_of_up_to_six_letters_are_one_token_each() {
        assert_eq!(tokenize("the cat sat").len(), 3);
        let text = vec!["word"; 1000].join(" ");
        assert_counts(&[
            ("the cat sat", 3),
            ("abcdef ghijkl mnopqr", 3),
            (&text, 1000),
        ]);
    }

    #[test]
    fn long_runs_split_into_six_character_pieces() {
        assert_counts(&[
            ("abcdefg", 2),
            ("abcdefghijkl", 2),
            ("abcdefghijklm", 3),
            ("x1234567890", 2),
        ]);
    }

    #[test]
    fn punctuation_and_non_ascii_are_one_token_per_character() {
        assert_counts(&[
            ("hi, there!", 4),
            ("<|user|>", 5),
            ("héllo", 3),
            ("日本", 2),
            ("a\u{a0}b", 3),
        ]);
    }

    #[test]
    fn whitespace_attaches_to_the_following_token() {
        assert_counts(&[("", 0), ("   ", 0), ("  a  ", 1)]);
        assert_eq!(tokenize(" cat")[0], xxh3_64(b" cat") as u32);
        assert_ne!(tokenize(" cat"), tokenize("cat"));
        assert_eq!(tokenize("the cat")[1], tokenize("a cat")[1]);
        assert_eq!(tokenize("a\n\tb")[1], xxh3_64(b"\n\tb") as u32);
    }

    #[test]
    fn ids_are_stable() {
        assert_eq!(tokenize("hello"), vec![xxh3_64(b"hello") as u32]);
        assert_eq!(tokenize("the cat sat"), tokenize("the cat sat"));
    }

    #[test]
    fn chat_template_renders_roles_and_text_parts() {
        let messages = [
            json!({"role": "system", "content": "be brief"}),
            json!({"role": "user", "content": [
                {"type": "text", "text": "hello "},
                {"type": "image_url", "image_url": {"url": "x"}},
                {"type": "text", "text": "world"}
            ]}),
            json!({"role": "assistant", "content": null}),
        ];
        assert_eq!(
            chat_prompt_text(&messages),
            "<|system|>\nbe brief\n<|user|>\nhello world\n<|assistant|>\n\n<|assistant|>\n"
        );
        // "<|user|>" is 5 tokens, "\nhi" 1, "\n<|assistant|>" 6 ("assistant" is 9 letters: two
        // pieces), and the final "\n" is not a token.
        assert_eq!(
            count_tokens(&chat_prompt_text(&[
                json!({"role": "user", "content": "hi"})
            ])),
            12
        );
    }
}
