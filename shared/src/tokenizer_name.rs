//! Tokenizer names in endpoint configs: DisaggregationConfig.Tokenizer (a built-in BPE or a
//! tokenizer file) and KvAwareRoutingConfig.Tokenizer (a model's tokenizer folder).

/// A name that is no tokenizer name (the message says what one is).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct InvalidTokenizerName(String);

/// A tokenizer name: one of the built-in BPEs, or a file name (letters, digits, `.`, `_`,
/// `-`; at most 128 characters; no path).
pub fn validate_tokenizer_name(name: &str) -> Result<(), InvalidTokenizerName> {
    let fine = !name.is_empty()
        && name.len() <= 128
        && !name.starts_with('.')
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'));
    if fine {
        Ok(())
    } else {
        Err(InvalidTokenizerName(format!(
            "{name:?} is not a tokenizer name: cl100k_base, o200k_base, or the name of a \
             tokenizer.json under the routers' --tokenizer-dir (letters, digits, '.', '_', '-')"
        )))
    }
}

/// The name of a model's tokenizer folder (KvAwareRoutingConfig.Tokenizer): a file name as
/// [`validate_tokenizer_name`] allows, but not a built-in BPE (token ids must be the model's
/// own).
pub fn validate_engine_tokenizer_name(name: &str) -> Result<(), InvalidTokenizerName> {
    if matches!(name, "cl100k_base" | "o200k_base") {
        return Err(InvalidTokenizerName(format!(
            "{name:?} is OpenAI's BPE, not a model's own tokenizer: name a folder under the \
             routers' --tokenizer-dir holding the model's tokenizer.json and tokenizer_config.json"
        )));
    }
    validate_tokenizer_name(name).map_err(|_| {
        InvalidTokenizerName(format!(
            "{name:?} is not a tokenizer folder name (letters, digits, '.', '_', '-'; at most \
             128 characters)"
        ))
    })
}
