//! A prompt's token ids as a vLLM engine computes them, computed without asking it.
//!
//! [`EngineTokenizer::load`] reads a model's Hugging Face files from a folder
//! (`tokenizer.json`, `tokenizer_config.json`, and `chat_template.jinja` when the template is
//! not in the config); [`EngineTokenizer::tokenize`] answers what vLLM 0.32's `POST /tokenize`
//! answers for the same body:
//!
//! - completions `{"prompt": "...", "add_special_tokens"?}`: the prompt's ids, with the
//!   post-processor's special tokens (a BOS) unless `add_special_tokens` is false;
//! - chat `{"messages", "add_generation_prompt"? (true), "continue_final_message"? (false),
//!   "chat_template_kwargs"?, "tools"?}`: the conversation ([`messages`]) rendered by the chat
//!   template ([`template`]) with the tools as vLLM dumps them, the tokenizer's special tokens
//!   and the kwargs, then tokenized without special tokens added.
//!
//! What it does not follow is [`Refusal::Engine`], with a reason: the caller asks the engine
//! (a body with its own `chat_template`, non-text content, a template feature the renderer
//! lacks). What vLLM would refuse too is [`Refusal::Invalid`] (roles a template refuses with
//! `raise_exception`, both `add_generation_prompt` and `continue_final_message`). Long pieces of
//! text are cached between prompts ([`pieces`]), so a shared system prompt is tokenized once.

#![forbid(unsafe_code)]

pub mod fast;
pub mod json;
mod markers;
mod messages;
pub mod pieces;
pub mod reuse;
pub mod template;
pub mod truncation;

use std::path::{Path, PathBuf};

use json::Json;
use minijinja::Value;
use pieces::{CacheStats, Pieces};
use template::{ChatTemplate, RenderError};
use tokenizers::Tokenizer;

/// The cache of long pieces' ids, per tokenizer, when not told otherwise.
pub const DEFAULT_CACHE_BYTES: usize = 64 * 1024 * 1024;

/// Why the ids were not computed here and the engine should be asked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unsupported {
    /// The folder has no chat template (the engine may have been given one).
    NoTemplate,
    /// The template uses what this renderer cannot do (decided at load, or by one request).
    TemplateFeature,
    /// The body carries its own `chat_template`.
    RequestTemplate,
    /// Content other than text (images, audio, files).
    NonText,
    /// A message this crate does not rewrite as vLLM does (`developer`, billing headers).
    Message,
    /// A body field whose effect is not followed here (`add_special_tokens` on a chat body,
    /// kwargs that are `apply_chat_template`'s own parameters).
    Field,
    /// A body past [`MOST_BODY_BYTES`], [`MOST_MESSAGES`] or [`MOST_PARTS`].
    Large,
}

/// How much work [`EngineTokenizer::tokenize_within`] may do before it gives up (None), so
/// that a caller can tokenize a prompt seen before on a thread that must not wait and take a
/// colder one elsewhere.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Within {
    /// Bytes of the prompt the piece cache does not hold.
    pub fresh_bytes: usize,
    /// Of those, what the BPE model must be asked (pieces not in the fast way's word cache),
    /// in words of up to 8 bytes ([`fast::BYTES_PER_NEW_WORD`]); without the fast way, all of
    /// the new text.
    pub new_words: usize,
}

impl Within {
    /// No bound.
    pub const ALL: Self = Self {
        fresh_bytes: usize::MAX,
        new_words: usize::MAX,
    };

    fn bounded(self) -> bool {
        self != Self::ALL
    }
}

use fast::BYTES_PER_NEW_WORD;

/// The largest body tokenized here (the engine is asked for larger ones).
pub const MOST_BODY_BYTES: usize = 1 << 20;
/// The most messages in a chat tokenized here.
pub const MOST_MESSAGES: usize = 4096;
/// The most messages in a chat [`EngineTokenizer::tokenize_within`] renders under a budget.
pub const MOST_MESSAGES_WITHIN: usize = 256;
/// The most content parts in one message tokenized here.
pub const MOST_PARTS: usize = 256;

impl Unsupported {
    /// The metric label.
    pub fn reason(self) -> &'static str {
        match self {
            Unsupported::NoTemplate => "no_template",
            Unsupported::TemplateFeature => "template_feature",
            Unsupported::RequestTemplate => "request_template",
            Unsupported::NonText => "non_text",
            Unsupported::Message => "message",
            Unsupported::Field => "field",
            Unsupported::Large => "large",
        }
    }

    pub const REASONS: [&'static str; 7] = [
        "no_template",
        "template_feature",
        "request_template",
        "non_text",
        "message",
        "field",
        "large",
    ];
}

/// What vLLM would refuse too, with its reason.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Invalid(pub String);

/// Why [`EngineTokenizer::tokenize`] gave no ids.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    #[error("left to the engine: {}", .0.reason())]
    Engine(Unsupported),
    #[error("{0}")]
    Invalid(Invalid),
}

/// Why a tokenizer could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("{path}: {message}")]
    File { path: PathBuf, message: String },
}

/// `chat_template_kwargs` that are `apply_chat_template`'s own parameters rather than template
/// variables (they would change how vLLM tokenizes, not only what it renders).
const CALL_PARAMETERS: &[&str] = &[
    "conversation",
    "tools",
    "padding",
    "truncation",
    "max_length",
    "return_tensors",
    "return_dict",
    "return_assistant_tokens_mask",
    "tokenizer_kwargs",
];

/// The fields of a `/tokenize` body (or a completions or chat body) the tokenizer reads; the
/// others are passed over ([`json::read_fields`]).
const READ_FIELDS: &[&str] = &[
    "messages",
    "prompt",
    "add_special_tokens",
    "add_generation_prompt",
    "continue_final_message",
    "chat_template",
    "chat_template_kwargs",
    "tools",
    "documents",
    "reasoning_effort",
];

/// The values vLLM's chat completion takes for `reasoning_effort`.
pub const REASONING_EFFORTS: &[&str] =
    &["none", "minimal", "low", "medium", "high", "xhigh", "max"];

/// A field of a body read with [`READ_FIELDS`].
fn field<'a>(body: &'a Json, name: &str) -> Option<&'a Json> {
    debug_assert!(
        READ_FIELDS.contains(&name),
        "{name} is not read from bodies"
    );
    body.get(name)
}

/// A boolean field of a body, `default` when absent, read as vLLM's request models read it
/// (pydantic's lax booleans: `true`, `1`, `1.0`, and the strings `"true"`, `"yes"`, `"on"`,
/// `"t"`, `"y"`, `"1"` in any case, and their opposites); anything else, null included, is
/// refused, as vLLM refuses it.
fn flag(body: &Json, name: &str, default: bool) -> Result<bool, Refusal> {
    let Some(value) = field(body, name) else {
        return Ok(default);
    };
    let read = match value {
        Json::Bool(value) => Some(*value),
        Json::Number(number) => reuse::number_bool(number),
        Json::String(text) => reuse::text_bool(text),
        Json::Array(_) | Json::Object(_) | Json::Null => None,
    };
    read.ok_or_else(|| Refusal::Invalid(Invalid(format!("{name} must be a boolean"))))
}

/// Whether Python takes the value for true (`bool(value)`).
fn truthy(value: &Json) -> bool {
    match value {
        Json::Null => false,
        Json::Bool(value) => *value,
        Json::Number(number) => number.as_f64() != Some(0.0),
        Json::String(text) => !text.is_empty(),
        Json::Array(items) => !items.is_empty(),
        Json::Object(fields) => !fields.is_empty(),
    }
}

/// The special-token names Hugging Face passes to every template (`special_tokens_map`).
const SPECIAL_TOKENS: &[&str] = &[
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
];

/// One model's tokenizer and chat template.
pub struct EngineTokenizer {
    tokenizer: Tokenizer,
    template: Result<ChatTemplate, Unsupported>,
    /// Why the template is not used, for the load log (None when it is).
    template_note: Option<String>,
    special_tokens: Vec<(String, Value)>,
    pieces: Option<Pieces>,
    /// The faster way to new text's ids ([`fast`]), when it agrees with the tokenizer.
    fast: Option<fast::FastBpe>,
    /// The post-processor's ids around a prompt, when they are only a prefix (`[bos]`).
    special_prefix: Option<Vec<u32>>,
    /// Completions are left to the engine: the config's `add_bos_token`/`add_eos_token` or
    /// `split_special_tokens` change how transformers tokenizes them.
    completions_unsupported: bool,
    /// The config names a `tool_use` template, which transformers picks when tools are given.
    tool_use_template: bool,
    /// How a truncation without a side cuts an encoded text ([`truncation::Cut`]), special
    /// tokens added (vLLM sets a generating model's side to the left, whatever
    /// `tokenizer_config.json` says).
    cut: truncation::Cut,
}

impl std::fmt::Debug for EngineTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineTokenizer")
            .field("template", &self.template.as_ref().map(|_| ()))
            .field("pieces", &self.pieces.is_some())
            .field("fast", &self.fast.is_some())
            .finish_non_exhaustive()
    }
}

impl EngineTokenizer {
    /// Loads `dir/tokenizer.json` (required), `dir/tokenizer_config.json` (special tokens and
    /// `chat_template`) and `dir/chat_template.jinja` (the template, preferred over the
    /// config's, as transformers prefers it). A template the renderer cannot parse is noted and
    /// chat bodies are left to the engine; the piece cache is used only where it gives the same
    /// ids as tokenizing whole texts.
    pub fn load(dir: &Path, cache_bytes: usize) -> Result<Self, LoadError> {
        // Models vLLM does not render with a Hugging Face template (its `mistral` tokenizer
        // mode picks these files up by itself).
        for file in ["tekken.json", "tokenizer.model.v3", "tokenizer.model.v7"] {
            if dir.join(file).exists() {
                return Err(LoadError::File {
                    path: dir.join(file),
                    message: "vLLM renders this model with its own tokenizer mode, not a chat \
                              template: leave it to the engine's /tokenize"
                        .into(),
                });
            }
        }
        let path = dir.join("tokenizer.json");
        let mut tokenizer = Tokenizer::from_file(&path).map_err(|err| LoadError::File {
            path: path.clone(),
            message: err.to_string(),
        })?;
        // transformers turns both off on every call.
        tokenizer
            .with_truncation(None)
            .map_err(|err| LoadError::File {
                path: path.clone(),
                message: err.to_string(),
            })?;
        tokenizer.with_padding(None);
        let config = read_config(&dir.join("tokenizer_config.json"))?;
        let special_map = read_config(&dir.join("special_tokens_map.json"))?;
        let jinja = dir.join("chat_template.jinja");
        let source = match std::fs::read_to_string(&jinja) {
            Ok(source) => Some(source),
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => {
                config.as_ref().and_then(template_in_config)
            }
            Err(err) => {
                return Err(LoadError::File {
                    path: jinja,
                    message: err.to_string(),
                });
            }
        };
        let (template, template_note) = match source {
            None => (
                Err(Unsupported::NoTemplate),
                Some("no chat template in the folder".to_owned()),
            ),
            Some(source) => match ChatTemplate::new(source) {
                Ok(template) => (Ok(template), None),
                Err(reason) => (Err(Unsupported::TemplateFeature), Some(reason)),
            },
        };
        let mut special_tokens = config.as_ref().map(special_tokens_of).unwrap_or_default();
        for (name, value) in special_map
            .as_ref()
            .map(special_tokens_of)
            .unwrap_or_default()
        {
            if !special_tokens.iter().any(|(known, _)| *known == name) {
                special_tokens.push((name, value));
            }
        }
        let flag = |name: &str| {
            config
                .as_ref()
                .and_then(|config| config.get(name)?.as_bool())
        };
        let special_prefix = special_prefix(&tokenizer);
        let adds_bos = special_prefix
            .as_ref()
            .is_some_and(|prefix| !prefix.is_empty());
        let completions_unsupported = flag("add_eos_token") == Some(true)
            || flag("add_bos_token").is_some_and(|bos| bos != adds_bos)
            || flag("split_special_tokens") == Some(true);
        let tool_use_template = config.as_ref().is_some_and(names_tool_use_template)
            || dir.join("additional_chat_templates").exists();
        let fast = std::fs::read(&path)
            .ok()
            .and_then(|bytes| serde_json::from_slice::<serde_json::Value>(&bytes).ok())
            .and_then(|config| fast::FastBpe::new(&config))
            .filter(|fast| fast::agrees(fast, &tokenizer));
        let cut = added_around(&tokenizer, special_prefix.as_deref());
        let mut loaded = Self {
            cut,
            completions_unsupported,
            tool_use_template,
            special_prefix,
            fast,
            pieces: Pieces::new(&tokenizer, cache_bytes),
            tokenizer,
            template,
            template_note,
            special_tokens,
        };
        if !loaded.pieces_agree() {
            loaded.pieces = None;
        }
        // The faster way knows nothing of added tokens: it may only see the pieces between
        // them.
        if loaded.pieces.is_none() {
            loaded.fast = None;
        }
        Ok(loaded)
    }

    /// How the engine cuts a prompt this tokenizer encoded when a request's truncation names
    /// no side: on the left (vLLM's side for a generating model), keeping the special tokens
    /// around the text when they were added (`specials_added`: a completions text prompt with
    /// `add_special_tokens`).
    pub fn truncation_cut(&self, specials_added: bool) -> truncation::Cut {
        if specials_added {
            self.cut
        } else {
            truncation::Cut {
                added_before: 0,
                added_after: 0,
                ..self.cut
            }
        }
    }

    /// The ids the tokenizer knows, added tokens included (an id at or above it is out of
    /// its vocabulary).
    pub fn vocab_size(&self) -> usize {
        self.tokenizer.get_vocab_size(true)
    }

    /// The text of `ids`, special tokens kept, as vLLM echoes a prompt given as ids; None if
    /// the tokenizer cannot decode them.
    pub fn decode(&self, ids: &[u32]) -> Option<String> {
        self.tokenizer.decode(ids, false).ok()
    }

    /// Why chat bodies are left to the engine, if they are.
    pub fn template_note(&self) -> Option<&str> {
        self.template_note.as_deref()
    }

    /// Whether long pieces are cached.
    pub fn caches_pieces(&self) -> bool {
        self.pieces.is_some()
    }

    /// Whether new text is tokenized the faster way ([`fast`]).
    pub fn tokenizes_fast(&self) -> bool {
        self.fast.is_some()
    }

    /// `text`'s ids without the post-processor's special tokens, the faster way when there is
    /// one; None when that needs more than `new_words` new words ([`Within::new_words`]),
    /// which is lowered by those used.
    fn plain(
        &self,
        text: &str,
        new_words: &std::cell::Cell<usize>,
    ) -> Result<Option<Vec<u32>>, String> {
        match &self.fast {
            Some(fast) => fast.encode_within(&self.tokenizer, text, new_words),
            None if !fast::spend_new_words(new_words, text) => Ok(None),
            None => pieces::plain(&self.tokenizer, text).map(Some),
        }
    }

    pub fn cache_stats(&self) -> CacheStats {
        self.pieces.as_ref().map(Pieces::stats).unwrap_or_default()
    }

    /// With the faster way ([`fast`]): pieces of new text found in its word cache, and pieces
    /// asked of the BPE model.
    pub fn word_stats(&self) -> Option<(u64, u64)> {
        self.fast.as_ref().map(fast::FastBpe::word_stats)
    }

    /// What vLLM's `POST /tokenize` answers for `body` (a completions or chat body of its
    /// `/tokenize`).
    pub fn tokenize(&self, body: &[u8]) -> Result<Vec<u32>, Refusal> {
        Ok(self.tokenize_within(body, Within::ALL)?.unwrap_or_default())
    }

    /// [`Self::tokenize`], or None when it would take more work than `within` allows: more
    /// than `within.fresh_bytes` of the rendered prompt is text the piece cache does not hold
    /// (the whole prompt without a cache), or more than `within.new_words` of that text's
    /// pieces are not in the word cache. A warm prompt costs its parse, render and lookups,
    /// tens of microseconds for a long one; new text of known words a few microseconds per
    /// 100 bytes; new words about a microsecond or more each.
    pub fn tokenize_within(
        &self,
        body: &[u8],
        within: Within,
    ) -> Result<Option<Vec<u32>>, Refusal> {
        if body.len() > MOST_BODY_BYTES {
            return Err(Refusal::Engine(Unsupported::Large));
        }
        let body = json::read_fields(body, READ_FIELDS)
            .map_err(|err| Refusal::Invalid(Invalid(format!("invalid JSON: {err}"))))?;
        // A null `messages` is none: vLLM reads such a body as a completions one.
        if let Some(messages) = field(&body, "messages").filter(|messages| **messages != Json::Null)
        {
            // A long conversation's render is work enough whatever is cached.
            let many =
                matches!(messages, Json::Array(messages) if messages.len() > MOST_MESSAGES_WITHIN);
            if many && within.bounded() {
                return Ok(None);
            }
            let rendered = self.chat(&body)?;
            return self.encode_within(&rendered, within);
        }
        let (prompt, special) = self.completion(&body)?;
        match special {
            Special::None => self.encode_within(prompt, within),
            Special::Prefix(prefix) => Ok(self
                .encode_within(prompt, within)?
                .map(|ids| prefix.iter().copied().chain(ids).collect())),
            Special::PostProcessor
                if prompt.len() > within.fresh_bytes
                    || prompt.len().div_ceil(BYTES_PER_NEW_WORD) > within.new_words =>
            {
                Ok(None)
            }
            Special::PostProcessor => self
                .tokenizer
                .encode_fast(prompt, true)
                .map(|encoding| Some(encoding.get_ids().to_vec()))
                .map_err(|err| Refusal::Invalid(Invalid(err.to_string()))),
        }
    }

    /// A completions body's prompt, and the special tokens it is tokenized with.
    fn completion<'a>(&'a self, body: &'a Json) -> Result<(&'a str, Special<'a>), Refusal> {
        if self.completions_unsupported {
            return Err(Refusal::Engine(Unsupported::Field));
        }
        let Some(prompt) = field(body, "prompt").and_then(Json::as_str) else {
            return Err(Refusal::Engine(Unsupported::Field));
        };
        let add_special = flag(body, "add_special_tokens", true)?;
        let special = match &self.special_prefix {
            _ if !add_special => Special::None,
            Some(prefix) => Special::Prefix(prefix),
            None => Special::PostProcessor,
        };
        Ok((prompt, special))
    }

    /// A chat body's conversation rendered by the chat template.
    fn chat(&self, body: &Json) -> Result<String, Refusal> {
        let template = self
            .template
            .as_ref()
            .map_err(|reason| Refusal::Engine(*reason))?;
        let present = |name: &str| field(body, name).is_some_and(|value| *value != Json::Null);
        if self.tool_use_template && present("tools") {
            return Err(Refusal::Engine(Unsupported::Field));
        }
        match field(body, "messages") {
            Some(Json::Array(messages)) if messages.is_empty() => {
                return Err(Refusal::Engine(Unsupported::Message));
            }
            Some(Json::Array(messages)) if messages.len() > MOST_MESSAGES => {
                return Err(Refusal::Engine(Unsupported::Large));
            }
            _ => {}
        }
        if present("chat_template") {
            return Err(Refusal::Engine(Unsupported::RequestTemplate));
        }
        if flag(body, "add_special_tokens", false)? {
            return Err(Refusal::Engine(Unsupported::Field));
        }
        // Two fields of vLLM's chat completion reach the template as variables (its
        // `/tokenize` has neither: the router moves them into the kwargs of the `/tokenize`
        // body it sends): `documents`, and `reasoning_effort`, with `enable_thinking` set by
        // it unless the kwargs name that. Both override the kwargs of the same name.
        let documents = match field(body, "documents") {
            None | Some(Json::Null) => None,
            Some(documents) => Some(documents_as_vllm_reads(documents)?),
        };
        let reasoning_effort = match field(body, "reasoning_effort") {
            None | Some(Json::Null) => None,
            Some(Json::String(effort)) if REASONING_EFFORTS.contains(&&**effort) => Some(effort),
            Some(_) => {
                return Err(Refusal::Invalid(Invalid(format!(
                    "reasoning_effort must be one of {}",
                    REASONING_EFFORTS.join(", ")
                ))));
            }
        };
        // vLLM's models test the two as given, before reading them as booleans: `"false"` is
        // a non-empty string there, so true.
        let given = |name| field(body, name).is_some_and(truthy);
        let both_given = given("add_generation_prompt") && given("continue_final_message");
        let add_generation_prompt = flag(body, "add_generation_prompt", true)?;
        let continue_final_message = flag(body, "continue_final_message", false)?;
        if both_given || add_generation_prompt && continue_final_message {
            return Err(Refusal::Invalid(Invalid(
                "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
                    .into(),
            )));
        }
        let mut variables = self.special_tokens.clone();
        let (mut kwargs_documents, mut kwargs_enable_thinking) = (false, false);
        match field(body, "chat_template_kwargs") {
            None | Some(Json::Null) => {}
            Some(Json::Object(kwargs)) => {
                kwargs_enable_thinking = kwargs.iter().any(|(name, _)| name == "enable_thinking");
                for (name, value) in kwargs {
                    // vLLM's renderer merges the kwargs over its defaults (never empty) and
                    // drops these values; its own fields set the two flags.
                    if *value == Json::Null
                        || value.as_str() == Some("auto")
                        || name == "add_generation_prompt"
                        || name == "continue_final_message"
                    {
                        continue;
                    }
                    if name == "chat_template" || name == "tokenize" {
                        return Err(Refusal::Invalid(Invalid(format!(
                            "Found unexpected chat template kwargs from request: {{'{name}'}}"
                        ))));
                    }
                    if CALL_PARAMETERS.contains(&name.as_str()) {
                        return Err(Refusal::Engine(Unsupported::Field));
                    }
                    if name == "documents" {
                        kwargs_documents_as_hf_reads(value)?;
                        kwargs_documents = true;
                    }
                    variables.push((name.clone(), value.to_value()));
                }
            }
            Some(_) => {
                return Err(Refusal::Invalid(Invalid(
                    "chat_template_kwargs must be an object".into(),
                )));
            }
        }
        let tools = match field(body, "tools") {
            None | Some(Json::Null) => Value::from(()),
            Some(tools) => tools_as_vllm_dumps(tools)?.to_value(),
        };
        variables.push(("tools".into(), tools));
        // Later variables win over earlier ones of the same name (the kwargs).
        match documents {
            Some(documents) => variables.push(("documents".into(), documents.to_value())),
            None if kwargs_documents => {}
            None => variables.push(("documents".into(), Value::from(()))),
        }
        if let Some(effort) = reasoning_effort {
            variables.push(("reasoning_effort".into(), Value::from(&**effort)));
            if !kwargs_enable_thinking {
                variables.push(("enable_thinking".into(), Value::from(&**effort != "none")));
            }
        }
        variables.push((
            "add_generation_prompt".into(),
            Value::from(add_generation_prompt),
        ));
        let messages = field(body, "messages").unwrap_or(&Json::Null);
        let conversation = messages::conversation(messages, template.content_format())?;
        template
            .render(
                conversation
                    .into_iter()
                    .map(messages::Message::into_value)
                    .collect(),
                variables,
                continue_final_message,
            )
            .map_err(|err| match err {
                RenderError::Raised(reason) | RenderError::Invalid(reason) => {
                    Refusal::Invalid(Invalid(reason))
                }
                RenderError::Unsupported(_) => Refusal::Engine(Unsupported::TemplateFeature),
            })
    }

    /// `text`'s ids without special tokens added, through the piece cache when it holds.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, Refusal> {
        Ok(self.encode_within(text, Within::ALL)?.unwrap_or_default())
    }

    /// [`Self::encode`], or None when that takes more work than `within` allows (see
    /// [`Self::tokenize_within`]).
    pub fn encode_within(&self, text: &str, within: Within) -> Result<Option<Vec<u32>>, Refusal> {
        let invalid = |err| Refusal::Invalid(Invalid(err));
        let new_words = std::cell::Cell::new(within.new_words);
        match &self.pieces {
            Some(pieces) => pieces
                .encode_within(
                    &|piece| self.plain(piece, &new_words),
                    text,
                    within.bounded().then_some(within.fresh_bytes),
                )
                .map_err(invalid),
            None if text.len() > within.fresh_bytes => Ok(None),
            None => self.plain(text, &new_words).map_err(invalid),
        }
    }

    /// Whether cutting at markers gives the tokenizer's own ids on sample texts (spaces,
    /// newlines and words on both sides of every marker, and long pieces cached on the way).
    fn pieces_agree(&self) -> bool {
        let Some(pieces) = &self.pieces else {
            return true;
        };
        // The cut is the same for every marker: a few of them (the lowest ids, the template's
        // usual ones) stand for all.
        let mut added: Vec<(u32, String)> = self
            .tokenizer
            .get_added_tokens_decoder()
            .into_iter()
            .filter(|(_, token)| !token.normalized)
            .map(|(id, token)| (id, token.content))
            .collect();
        added.sort();
        let markers: Vec<String> = added
            .into_iter()
            .take(4)
            .map(|(_, content)| content)
            .collect();
        let filler = "The quick brown fox, naïve café 123 — jumps.\n\n  ".repeat(6);
        markers.iter().all(|marker| {
            [
                format!("{marker}user\n{filler}{marker}\n"),
                format!(" {marker} x{marker}{marker}  y\n{marker}"),
                format!("{filler}{marker}{filler} end"),
            ]
            .iter()
            .all(|text| {
                let whole = pieces::plain(&self.tokenizer, text);
                whole.is_ok()
                    && pieces
                        .encode(
                            &|piece| self.plain(piece, &std::cell::Cell::new(usize::MAX)),
                            text,
                        )
                        .ok()
                        == whole.ok()
            })
        })
    }
}

/// The special tokens a completions prompt is tokenized with.
enum Special<'a> {
    None,
    /// The post-processor's ids are only these, before the prompt.
    Prefix(&'a [u32]),
    /// Another post-processor: the prompt is tokenized whole with it.
    PostProcessor,
}

/// A chat completion's `documents` as vLLM's request model reads them: a list of objects whose
/// values are strings (`list[dict[str, str]]`), else the request is invalid.
fn documents_as_vllm_reads(documents: &Json) -> Result<&Json, Refusal> {
    documents_of(documents, |value| matches!(value, Json::String(_)))
        .ok_or_else(|| invalid("documents must be a list of objects with string values"))
}

/// `documents` in `chat_template_kwargs`, which vLLM hands to Hugging Face's
/// `apply_chat_template`: it refuses anything but a list of objects.
fn kwargs_documents_as_hf_reads(documents: &Json) -> Result<&Json, Refusal> {
    documents_of(documents, |_| true)
        .ok_or_else(|| invalid("Documents should be a list of dicts with 'title' and 'text' keys!"))
}

/// `documents` if it is a list of objects whose values all pass `value`.
fn documents_of(documents: &Json, value: impl Fn(&Json) -> bool) -> Option<&Json> {
    let Json::Array(list) = documents else {
        return None;
    };
    list.iter()
        .all(|document| match document {
            Json::Object(fields) => fields.iter().all(|(_, field)| value(field)),
            _ => false,
        })
        .then_some(documents)
}

fn invalid(reason: &str) -> Refusal {
    Refusal::Invalid(Invalid(reason.into()))
}

/// The tools as vLLM 0.32 hands them to the template (`ChatCompletionToolsParam.model_dump()`):
/// `{"type": "function", "function": {"name", "description", "parameters"[, "strict"]
/// [, "defer_loading"]}[, "defer_loading"]}`, absent optional fields as `None`, other fields
/// dropped.
fn tools_as_vllm_dumps(tools: &Json) -> Result<Json, Refusal> {
    let invalid = |message: &str| Refusal::Invalid(Invalid(message.into()));
    let Json::Array(tools) = tools else {
        return Err(invalid("tools must be a list"));
    };
    let dumped = tools
        .iter()
        .map(|tool| {
            if tool
                .get("type")
                .is_some_and(|kind| kind.as_str() != Some("function"))
            {
                return Err(invalid("a tool's type must be \"function\""));
            }
            let function = tool
                .get("function")
                .filter(|function| matches!(function, Json::Object(_)))
                .ok_or_else(|| invalid("a tool needs a `function` object"))?;
            let name = function
                .get("name")
                .filter(|name| name.as_str().is_some())
                .ok_or_else(|| invalid("a tool's function needs a string `name`"))?;
            let field = |name: &str| function.get(name).cloned().unwrap_or(Json::Null);
            let mut out = vec![
                ("name".to_owned(), name.clone()),
                ("description".to_owned(), field("description")),
                ("parameters".to_owned(), field("parameters")),
            ];
            let tool_defer = tool.get("defer_loading").cloned().unwrap_or(Json::Null);
            for optional in ["strict", "defer_loading"] {
                let mut value = field(optional);
                if optional == "defer_loading" && value == Json::Null {
                    value = tool_defer.clone();
                }
                if value != Json::Null {
                    out.push((optional.to_owned(), value));
                }
            }
            let mut dumped = vec![
                ("type".to_owned(), Json::String("function".into())),
                ("function".to_owned(), Json::Object(out)),
            ];
            if tool_defer != Json::Null {
                dumped.push(("defer_loading".to_owned(), tool_defer));
            }
            Ok(Json::Object(dumped))
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Json::Array(dumped))
}

fn read_config(path: &Path) -> Result<Option<Json>, LoadError> {
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(err) => {
            return Err(LoadError::File {
                path: path.to_owned(),
                message: err.to_string(),
            });
        }
    };
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|err| LoadError::File {
            path: path.to_owned(),
            message: err.to_string(),
        })
}

/// Whether the config names a `tool_use` template.
fn names_tool_use_template(config: &Json) -> bool {
    match config.get("chat_template") {
        Some(Json::Array(named)) => named
            .iter()
            .any(|entry| entry.get("name").and_then(Json::as_str) == Some("tool_use")),
        _ => false,
    }
}

/// The config's `chat_template`: a string, or the `default` of a list of named templates (the
/// `tool_use` one is not chosen here: such a config is left to its default).
fn template_in_config(config: &Json) -> Option<String> {
    match config.get("chat_template")? {
        Json::String(source) => Some(source.to_string()),
        Json::Array(named) => named.iter().find_map(|entry| {
            (entry.get("name")?.as_str()? == "default")
                .then(|| entry.get("template")?.as_str().map(str::to_owned))
                .flatten()
        }),
        _ => None,
    }
}

/// The special tokens Hugging Face passes to templates, from the config (a string, or an
/// added-token object's `content`).
fn special_tokens_of(config: &Json) -> Vec<(String, Value)> {
    SPECIAL_TOKENS
        .iter()
        .filter_map(|name| {
            let text = match config.get(name)? {
                Json::String(text) => text.to_string(),
                object @ Json::Object(_) => object.get("content")?.as_str()?.to_owned(),
                _ => return None,
            };
            Some(((*name).to_owned(), Value::from(text)))
        })
        .collect()
}

/// The ids the post-processor puts around a prompt, when it only puts them in front.
/// How many ids the post-processor adds before and after a text (0 and 0 when it adds none,
/// or adds them otherwise than around the text's own ids).
fn added_around(tokenizer: &Tokenizer, prefix: Option<&[u32]>) -> truncation::Cut {
    let none = truncation::Cut::LEFT;
    if let Some(prefix) = prefix {
        return truncation::Cut {
            added_before: prefix.len(),
            ..none
        };
    }
    let with = |add: bool| {
        tokenizer
            .encode_fast("Hello world, a sample.", add)
            .ok()
            .map(|encoding| encoding.get_ids().to_vec())
    };
    let (Some(plain), Some(full)) = (with(false), with(true)) else {
        return none;
    };
    (0..=full.len().saturating_sub(plain.len()))
        .find(|&before| full[before..].starts_with(&plain))
        .map_or(none, |before| truncation::Cut {
            added_before: before,
            added_after: full.len() - before - plain.len(),
            ..none
        })
}

fn special_prefix(tokenizer: &Tokenizer) -> Option<Vec<u32>> {
    let with = |text: &str, add: bool| {
        tokenizer
            .encode_fast(text, add)
            .ok()
            .map(|encoding| encoding.get_ids().to_vec())
    };
    let prefix = with("", true)?;
    let sample = "Hello world, a sample.";
    let plain = with(sample, false)?;
    let full = with(sample, true)?;
    (full.len() == prefix.len() + plain.len()
        && full.starts_with(&prefix)
        && full.ends_with(&plain))
    .then_some(prefix)
}
