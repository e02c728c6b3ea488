//! The prompt's token ids as the engine sees them (chat template included), for KV_AWARE and
//! a disaggregated endpoint's KV_AWARE prefill pool or UNCACHED_TOKENS: read from the body on
//! the CPU side ([`KvInput`]: a token-id prompt as given, else the [`Prompt`] to tokenize, from
//! the fields planning parsed for routing, so an OpenAI body is not parsed again), or why the
//! request has none ([`TokenizeError`]: it is then routed by load). The settle phase gives the
//! body to the router's tokenizer as it is, or sends an engine vLLM's `POST /tokenize` body
//! (`request::tokenize`), made then.
//!
//! The `/tokenize` body: completions `{"model", "prompt"}` and `add_special_tokens` if given (a
//! string prompt; a token-id prompt needs no round trip); chat `{"model", "messages", …}` with
//! the fields that change the templated prompt copied over (`add_generation_prompt`,
//! `continue_final_message`, `add_special_tokens`, `chat_template`, `chat_template_kwargs`,
//! `tools`), and a chat completion's `documents` and `reasoning_effort`, which `/tokenize` does
//! not take, moved into `chat_template_kwargs` as the chat completion passes them to the
//! template. The answer's `tokens` are the ids of the prompt the engine serves. The router's
//! tokenizer reads these fields and no other, so it may read the request's own body instead
//! (but a completions body with `messages`, which it would read as a chat).

use std::time::Duration;

use bytes::Bytes;
use serde_json::value::RawValue;
use switchyard_kv::ChainKey;
use switchyard_policy::openai::{self, OpenAiRequest};
use switchyard_tokenize::truncation::{Cut, Truncation};

use crate::operation::Operation;
use crate::routing::table::VariantRoute;

/// Completions fields that change the ids of the prompt: `add_special_tokens` false leaves the
/// BOS out, for the completion as for vLLM's `/tokenize` of a prompt.
const COMPLETION_FIELDS: &[&str] = &["add_special_tokens"];

/// Chat fields that change the prompt the template renders, copied as they are. A chat
/// completion's `documents` and `reasoning_effort`, which vLLM's `/tokenize` does not take, go
/// into `chat_template_kwargs` ([`served_kwargs`]).
const CHAT_TEMPLATE_FIELDS: &[&str] = &[
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "chat_template",
    "tools",
];

#[derive(Debug, thiserror::Error)]
pub enum TokenizeError {
    #[error("no available instance to ask")]
    NoInstance,
    #[error("every available instance's /tokenize is failing; asking again once its pause ends")]
    BackingOff,
    #[error("the request has nothing to tokenize: {0}")]
    Input(String),
    #[error("POST {url}: {message}")]
    Request { url: String, message: String },
    #[error("POST {url}: no answer within {timeout:?}")]
    Timeout { url: String, timeout: Duration },
    #[error("POST {url}: status {status}")]
    Status { url: String, status: u16 },
    #[error("POST {url}: unreadable answer: {message}")]
    Answer { url: String, message: String },
}

impl TokenizeError {
    /// The `reason` label of `switchyard_router_kv_tokenize_failures_total`.
    pub fn reason(&self) -> &'static str {
        match self {
            TokenizeError::NoInstance => "no_instance",
            TokenizeError::BackingOff => "backoff",
            TokenizeError::Input(_) => "input",
            TokenizeError::Request { .. } => "request",
            TokenizeError::Timeout { .. } => "timeout",
            TokenizeError::Status { .. } => "status",
            TokenizeError::Answer { .. } => "answer",
        }
    }

    /// Whether the instance may be at fault (not only the request): counted towards a pause
    /// ([`crate::routing::cells::TokenizeBackoff`]).
    pub fn instance_at_fault(&self) -> bool {
        match self {
            TokenizeError::Request { .. }
            | TokenizeError::Timeout { .. }
            | TokenizeError::Answer { .. } => true,
            // 408 and 429: the engine is too busy to answer; 5xx: it failed.
            TokenizeError::Status { status, .. } => *status >= 500 || matches!(status, 408 | 429),
            TokenizeError::NoInstance | TokenizeError::BackingOff | TokenizeError::Input(_) => {
                false
            }
        }
    }

    pub const REASONS: [&'static str; 7] = [
        "no_instance",
        "backoff",
        "input",
        "request",
        "timeout",
        "status",
        "answer",
    ];
}

/// Which OpenAI API the request body belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PromptKind {
    Chat,
    Completion,
}

/// The top-level fields of a request body, values unparsed.
type Fields<'a> = std::collections::BTreeMap<String, &'a RawValue>;

fn fields(request: &[u8]) -> Result<Fields<'_>, TokenizeError> {
    serde_json::from_slice(request)
        .map_err(|err| TokenizeError::Input(format!("invalid JSON: {err}")))
}

/// Whether the body has `name`, not null (as a request's parsed fields see it).
fn has(fields: &Fields<'_>, name: &str) -> bool {
    fields
        .get(name)
        .is_some_and(|value| value.get().trim() != "null")
}

/// What the engine keeps of an OpenAI body's prompt of `kind` (`truncate_prompt_tokens`), if
/// not all; an error for what vLLM refuses.
pub fn kept(kind: PromptKind, request: &[u8]) -> Result<Option<Kept>, TokenizeError> {
    let fields = fields(request)?;
    let text_prompt = kind == PromptKind::Chat || token_ids_of(&fields).is_none();
    Kept::of(truncation_fields(&fields, request), kind, text_prompt)
}

/// The truncation fields of `body` read as `fields`; none unless its bytes name
/// `truncate_prompt_tokens` (as [`OpenAiRequest::truncation`] reads them: a side alone changes
/// nothing, and an engine refuses a bad one itself).
fn truncation_fields<'a>(fields: &Fields<'a>, body: &[u8]) -> openai::Truncation<'a> {
    if !openai::names_truncation(body) || present(fields, "truncate_prompt_tokens").is_none() {
        return openai::Truncation::default();
    }
    openai::Truncation {
        truncate_prompt_tokens: present(fields, "truncate_prompt_tokens"),
        truncation_side: present(fields, "truncation_side"),
        add_special_tokens: present(fields, "add_special_tokens"),
    }
}

/// A field's value, unless absent or null.
fn present<'a>(fields: &Fields<'a>, name: &str) -> Option<&'a RawValue> {
    fields.get(name).copied().filter(|_| has(fields, name))
}

/// A completions prompt given as token ids (`[1, 2, 3]`): no need to ask the engine.
fn token_ids_of(fields: &Fields<'_>) -> Option<Vec<u32>> {
    serde_json::from_str(fields.get("prompt")?.get()).ok()
}

/// vLLM's `/tokenize` body for an OpenAI request body.
pub fn tokenize_body(kind: PromptKind, request: &[u8]) -> Result<Bytes, TokenizeError> {
    body_of(kind, &fields(request)?, request.len())
}

fn body_of(
    kind: PromptKind,
    fields: &Fields<'_>,
    size_hint: usize,
) -> Result<Bytes, TokenizeError> {
    let kwargs: Option<Box<RawValue>>;
    let mut out: Vec<(&str, &RawValue)> = Vec::new();
    if let Some(model) = fields.get("model") {
        out.push(("model", model));
    }
    let copied = match kind {
        PromptKind::Completion => {
            let prompt = fields.get("prompt").copied();
            check_prompt(prompt)?;
            out.extend(prompt.map(|prompt| ("prompt", prompt)));
            COMPLETION_FIELDS
        }
        PromptKind::Chat => {
            let messages = fields
                .get("messages")
                .ok_or_else(|| TokenizeError::Input("no messages".into()))?;
            out.push(("messages", messages));
            kwargs = served_kwargs(fields);
            match (&kwargs, fields.get("chat_template_kwargs")) {
                (Some(kwargs), _) => out.push(("chat_template_kwargs", kwargs)),
                (None, Some(given)) => out.push(("chat_template_kwargs", given)),
                (None, None) => {}
            }
            CHAT_TEMPLATE_FIELDS
        }
    };
    for name in copied {
        if let Some(value) = fields.get(*name) {
            out.push((name, value));
        }
    }
    let mut body = Vec::with_capacity(size_hint + 16);
    body.push(b'{');
    for (position, (name, value)) in out.iter().enumerate() {
        if position > 0 {
            body.push(b',');
        }
        // Field names are the constants above: plain ASCII, no escaping needed.
        body.push(b'"');
        body.extend_from_slice(name.as_bytes());
        body.extend_from_slice(b"\":");
        body.extend_from_slice(value.get().as_bytes());
    }
    body.push(b'}');
    Ok(Bytes::from(body))
}

/// A chat's `chat_template_kwargs` as vLLM's chat completion passes them to the template, when
/// that differs from the kwargs given: a `documents` list and a valid `reasoning_effort`
/// override the kwargs of the same name, and `enable_thinking` is `reasoning_effort != "none"`
/// unless the kwargs name it. None when the request has neither field (not null), or its kwargs
/// are not an object (vLLM refuses such a request).
fn served_kwargs(fields: &Fields<'_>) -> Option<Box<RawValue>> {
    let documents = fields
        .get("documents")
        .copied()
        .filter(|_| has(fields, "documents"));
    let effort = fields
        .get("reasoning_effort")
        .and_then(|raw| serde_json::from_str::<String>(raw.get()).ok())
        .filter(|effort| switchyard_tokenize::REASONING_EFFORTS.contains(&effort.as_str()));
    if documents.is_none() && effort.is_none() {
        return None;
    }
    // The values stay as written (a nested object's keys in their order, numbers as given);
    // a key given twice keeps its last value, as Python reads it.
    let mut kwargs: Fields<'_> = match fields.get("chat_template_kwargs") {
        None => Fields::new(),
        Some(raw) if raw.get().trim() == "null" => Fields::new(),
        Some(raw) => serde_json::from_str(raw.get()).ok()?,
    };
    let literal = |json: &'static str| -> &'static RawValue {
        serde_json::from_str(json).expect("a JSON literal")
    };
    if let Some(documents) = documents {
        kwargs.insert("documents".into(), documents);
    }
    let effort_value;
    if let Some(effort) = effort {
        if !kwargs.contains_key("enable_thinking") {
            let thinking = if effort == "none" { "false" } else { "true" };
            kwargs.insert("enable_thinking".into(), literal(thinking));
        }
        effort_value = serde_json::value::to_raw_value(&effort).ok()?;
        kwargs.insert("reasoning_effort".into(), &effort_value);
    }
    serde_json::value::to_raw_value(&kwargs).ok()
}

/// A request's token ids, known from its body or to be asked for. Made on the CPU side of the
/// request path ([`PromptTokens::of`], [`KvInput::of`] and [`KvInput::of_openai`]), tokenized
/// by the router's tokenizer or fetched from an engine on the async side
/// (`request::tokenize::TokenizeClient::token_ids`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PromptTokens {
    /// A completions prompt given as token ids.
    Known(Vec<u32>),
    /// A prompt to tokenize.
    Ask(Prompt),
}

/// A request's prompt to tokenize: the body as the engine gets it, of which vLLM's `/tokenize`
/// body ([`tokenize_body`]) is made only when an engine is asked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Prompt {
    kind: PromptKind,
    body: Bytes,
    /// The router's tokenizer may read `body` itself: it reads the fields the `/tokenize` body
    /// would carry and no other, and tells a chat from a completion by `messages`, which a
    /// completions body has not (else it is given the `/tokenize` body).
    direct: bool,
    /// What part of the prompt's ids the engine keeps (`truncate_prompt_tokens`).
    kept: Option<Kept>,
}

/// A request's `truncate_prompt_tokens` (with `truncation_side`): the engine serves, caches
/// and announces only the ids it keeps, so the ids routed on are cut the same way
/// ([`switchyard_tokenize::truncation`]). vLLM's `/tokenize` takes neither field, so the cut is
/// made here, on the router's ids and on an engine's alike.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Kept {
    truncation: Truncation,
    /// A completions text prompt tokenized with its special tokens (`add_special_tokens` not
    /// false): a cut without a side keeps them.
    specials_added: bool,
}

impl Kept {
    /// The fields as the body has them; a body vLLM refuses for them has no usable ids (the
    /// engine answers it).
    fn of(
        fields: openai::Truncation<'_>,
        kind: PromptKind,
        text_prompt: bool,
    ) -> Result<Option<Self>, TokenizeError> {
        let value = |raw: Option<&RawValue>| -> Result<Option<serde_json::Value>, TokenizeError> {
            raw.map(|raw| serde_json::from_str(raw.get()))
                .transpose()
                .map_err(|err| TokenizeError::Input(err.to_string()))
        };
        let truncation = Truncation::read(
            value(fields.truncate_prompt_tokens)?.as_ref(),
            value(fields.truncation_side)?.as_ref(),
        )
        .map_err(|err| TokenizeError::Input(err.0))?;
        let Some(truncation) = truncation else {
            return Ok(None);
        };
        // `add_special_tokens` as vLLM reads it: true by default for completions, false for
        // chats (whose templates write their own).
        let given = fields
            .add_special_tokens
            .and_then(|raw| serde_json::from_str::<serde_json::Value>(raw.get()).ok())
            .and_then(|value| switchyard_tokenize::reuse::lax_bool(&value));
        let added = match kind {
            PromptKind::Completion => given != Some(false),
            PromptKind::Chat => given == Some(true),
        };
        Ok(Some(Self {
            truncation,
            specials_added: text_prompt && added,
        }))
    }

    /// The ids the engine keeps of `ids`, its tokenizer cutting as `cut` says when the request
    /// names no side (-1, the model's context, is not known here: nothing is cut for it).
    pub fn apply(&self, ids: Vec<u32>, cut: Cut) -> Vec<u32> {
        self.truncation.apply(ids, cut, None)
    }

    pub fn specials_added(&self) -> bool {
        self.specials_added
    }

    /// Whether the cut depends on the special tokens the engine's tokenizer added around the
    /// text (no side named, and some added): without the router's copy of the tokenizer it is
    /// not known which of an engine's ids those are.
    pub fn needs_tokenizer(&self) -> bool {
        self.truncation.side.is_none() && self.specials_added
    }
}

impl Prompt {
    /// The body, when the router's tokenizer may read it as it is (else it reads the
    /// `/tokenize` body).
    pub fn direct_body(&self) -> Option<Bytes> {
        self.direct.then(|| self.body.clone())
    }

    /// What part of its ids the engine keeps, if not all.
    pub fn kept(&self) -> Option<Kept> {
        self.kept
    }

    /// The size of the request's body.
    pub fn body_len(&self) -> usize {
        self.body.len()
    }

    /// vLLM's `/tokenize` body for the request ([`tokenize_body`]).
    pub fn tokenize_body(&self) -> Result<Bytes, TokenizeError> {
        tokenize_body(self.kind, &self.body)
    }
}

impl PromptTokens {
    /// Ids given in the body, cut as the engine cuts them (on the left unless the request
    /// says right).
    fn known(ids: Vec<u32>, kept: Option<Kept>) -> Self {
        Self::Known(match kept {
            Some(kept) => kept.apply(ids, Cut::LEFT),
            None => ids,
        })
    }

    /// For an OpenAI body of `kind`.
    pub fn of(kind: PromptKind, request: &[u8]) -> Result<Self, TokenizeError> {
        Self::of_fields(kind, &fields(request)?, Bytes::copy_from_slice(request))
    }

    fn of_fields(
        kind: PromptKind,
        fields: &Fields<'_>,
        body: Bytes,
    ) -> Result<Self, TokenizeError> {
        let truncation = truncation_fields(fields, &body);
        match kind {
            PromptKind::Completion => {
                if let Some(ids) = token_ids_of(fields) {
                    let kept = Kept::of(truncation, kind, false)?;
                    return Ok(Self::known(ids, kept));
                }
                check_prompt(fields.get("prompt").copied())?;
            }
            PromptKind::Chat if !has(fields, "messages") => {
                return Err(TokenizeError::Input("no messages".into()));
            }
            PromptKind::Chat => {}
        }
        let direct = kind == PromptKind::Chat || !has(fields, "messages");
        let kept = Kept::of(truncation, kind, true)?;
        Ok(Self::Ask(Prompt {
            kind,
            body,
            direct,
            kept,
        }))
    }

    /// For a native (`/invocations`) body: a JSON object with `messages` is read as a chat
    /// request, else one with `prompt` as a completions request (the rule the simulator's
    /// `/invocations` follows); anything else has no prompt to tokenize.
    pub fn of_native(request: &[u8]) -> Result<Self, TokenizeError> {
        Self::of_native_fields(&fields(request)?, Bytes::copy_from_slice(request))
    }

    fn of_native_fields(fields: &Fields<'_>, body: Bytes) -> Result<Self, TokenizeError> {
        let kind = if has(fields, "messages") {
            PromptKind::Chat
        } else if has(fields, "prompt") {
            PromptKind::Completion
        } else {
            return Err(TokenizeError::Input(
                "the body has neither `messages` nor `prompt`".into(),
            ));
        };
        Self::of_fields(kind, fields, body)
    }
}

/// A completions `prompt` the `/tokenize` body can carry: a string.
fn check_prompt(prompt: Option<&RawValue>) -> Result<(), TokenizeError> {
    match prompt {
        Some(prompt) if prompt.get().trim_start().starts_with('"') => Ok(()),
        _ => Err(TokenizeError::Input("prompt is not a string".into())),
    }
}

/// The body's `cache_salt` (vLLM's request field: a salted request reuses only blocks cached
/// under the same salt). Anything but a non-empty string is none (an engine refuses a
/// malformed one itself; vLLM ignores an empty one).
fn cache_salt_of(fields: &Fields<'_>) -> Option<String> {
    serde_json::from_str::<String>(fields.get("cache_salt")?.get())
        .ok()
        .filter(|salt| !salt.is_empty())
}

/// What a request's chain of block hashes is keyed by besides its token ids: the LoRA adapter
/// its `model` names (one of the variant's LoraAdapters) and its `cache_salt`.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct RequestChain {
    pub lora_name: Option<String>,
    pub cache_salt: Option<String>,
}

impl RequestChain {
    fn of(fields: &Fields<'_>, variant: &VariantRoute) -> Self {
        let model = fields
            .get("model")
            .and_then(|model| serde_json::from_str::<String>(model.get()).ok());
        Self {
            lora_name: variant.adapter(model.as_deref()).map(str::to_owned),
            cache_salt: cache_salt_of(fields),
        }
    }

    pub fn key(&self) -> ChainKey<'_> {
        ChainKey {
            lora_name: self.lora_name.as_deref(),
            cache_salt: self.cache_salt.as_deref(),
        }
    }
}

/// A KV_AWARE request's way to its token ids, read from the body on the CPU side.
#[derive(Debug)]
pub enum KvInput {
    /// Token ids given, or the prompt to tokenize.
    Tokens(PromptTokens),
    /// The body has no prompt to tokenize: the request is routed by load.
    Unusable(TokenizeError),
}

impl KvInput {
    /// How a request on `operation` gets its token ids: OpenAI bodies by their API; a native
    /// body as a chat request if it is a JSON object with `messages`, as a completions request
    /// if it has `prompt`, else not at all (routed by load). With what its chain is keyed by on
    /// `variant` (one parse of `body`, the body the engine gets, for both).
    pub fn of(operation: Operation, body: &Bytes, variant: &VariantRoute) -> (Self, RequestChain) {
        let kind = match Self::kind(operation) {
            Ok(kind) => kind,
            Err(err) => return (KvInput::Unusable(err), RequestChain::default()),
        };
        let fields = match fields(body) {
            Ok(fields) => fields,
            Err(err) => return (KvInput::Unusable(err), RequestChain::default()),
        };
        let tokens = match kind {
            Some(kind) => PromptTokens::of_fields(kind, &fields, body.clone()),
            None => PromptTokens::of_native_fields(&fields, body.clone()),
        };
        (Self::from(tokens), RequestChain::of(&fields, variant))
    }

    /// [`KvInput::of`] for an OpenAI body planning has read already (`request`; `body`, the
    /// body the engine gets, which differs from it in `model` at most): the body is not
    /// parsed again.
    pub fn of_openai(
        operation: Operation,
        request: &OpenAiRequest<'_>,
        body: &Bytes,
        variant: &VariantRoute,
    ) -> (Self, RequestChain) {
        let kind = match Self::kind(operation) {
            Ok(kind) => kind,
            Err(err) => return (Self::Unusable(err), RequestChain::default()),
        };
        // The adapter the engine's body names (planning may have rewritten `model`).
        let asked = request.model.as_deref();
        let model = super::engine_body::rewritten_model(asked, variant).or(asked);
        let chain = RequestChain {
            lora_name: variant.adapter(model).map(str::to_owned),
            cache_salt: request.cache_salt.as_deref().map(str::to_owned),
        };
        let kind = match kind {
            Some(kind) => kind,
            // A native body read as OpenAI's: by the native rule.
            None if request.has_messages() => PromptKind::Chat,
            None if request.prompt().is_some() => PromptKind::Completion,
            None => {
                let err = "the body has neither `messages` nor `prompt`";
                return (Self::Unusable(TokenizeError::Input(err.into())), chain);
            }
        };
        let truncation = request.truncation();
        let kept = |text_prompt| Kept::of(truncation, kind, text_prompt);
        let tokens = match kind {
            PromptKind::Completion => {
                let prompt = request.prompt();
                match prompt.and_then(|prompt| serde_json::from_str(prompt.get()).ok()) {
                    Some(ids) => kept(false).map(|kept| PromptTokens::known(ids, kept)),
                    None => check_prompt(prompt).and_then(|()| {
                        Ok(PromptTokens::Ask(Prompt {
                            kind,
                            body: body.clone(),
                            direct: !request.has_messages(),
                            kept: kept(true)?,
                        }))
                    }),
                }
            }
            PromptKind::Chat if !request.has_messages() => {
                Err(TokenizeError::Input("no messages".into()))
            }
            PromptKind::Chat => kept(true).map(|kept| {
                PromptTokens::Ask(Prompt {
                    kind,
                    body: body.clone(),
                    direct: true,
                    kept,
                })
            }),
        };
        (Self::from(tokens), chain)
    }

    /// The API of `operation`'s bodies (None: a native body, told by its fields).
    fn kind(operation: Operation) -> Result<Option<PromptKind>, TokenizeError> {
        match operation {
            Operation::ChatCompletions => Ok(Some(PromptKind::Chat)),
            Operation::Completions => Ok(Some(PromptKind::Completion)),
            Operation::Invocations | Operation::InvocationsStream => Ok(None),
            _ => Err(TokenizeError::Input(format!(
                "{operation:?} requests are routed by load under KV_AWARE"
            ))),
        }
    }
}

impl From<Result<PromptTokens, TokenizeError>> for KvInput {
    fn from(tokens: Result<PromptTokens, TokenizeError>) -> Self {
        match tokens {
            Ok(tokens) => Self::Tokens(tokens),
            Err(err) => Self::Unusable(err),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_adapter_and_cache_salt_come_with_the_tokens_from_one_parse() {
        let variant = VariantRoute::bare("v", Some("m"), &["sql-lora"]);
        let of = |operation, body: &[u8]| {
            KvInput::of(operation, &Bytes::copy_from_slice(body), &variant)
        };
        let (input, chain) = of(
            Operation::Completions,
            br#"{"model":"m","prompt":[1,2],"cache_salt":"tenant-a"}"#,
        );
        assert!(matches!(input, KvInput::Tokens(PromptTokens::Known(ids)) if ids == [1, 2]));
        assert_eq!(chain.cache_salt.as_deref(), Some("tenant-a"));
        assert_eq!(chain.lora_name, None);
        for body in [
            &br#"{"prompt":"x"}"#[..],
            br#"{"prompt":"x","cache_salt":""}"#,
            br#"{"prompt":"x","cache_salt":7}"#,
            br#"{"model":"other","prompt":"x"}"#,
        ] {
            assert_eq!(of(Operation::Completions, body).1, RequestChain::default());
        }
        let (input, chain) = of(Operation::Invocations, br#"{"cache_salt":"s"}"#);
        assert!(matches!(input, KvInput::Unusable(_)));
        assert_eq!(chain.cache_salt.as_deref(), Some("s"));
        let (_, chain) = of(
            Operation::ChatCompletions,
            br#"{"model":"sql-lora","messages":[{"role":"user","content":"x"}]}"#,
        );
        assert_eq!(chain.lora_name.as_deref(), Some("sql-lora"));
    }

    #[test]
    fn a_truncated_prompt_is_routed_on_the_ids_the_engine_keeps() {
        let variant = VariantRoute::bare("v", Some("m"), &[]);
        let input = |operation, body: &str| {
            KvInput::of(
                operation,
                &Bytes::copy_from_slice(body.as_bytes()),
                &variant,
            )
            .0
        };
        let ids = |body: &str| match input(Operation::Completions, body) {
            KvInput::Tokens(PromptTokens::Known(ids)) => ids,
            other => panic!("{body}: {other:?}"),
        };
        // Given ids are cut at once: on the left unless the request says right.
        assert_eq!(
            ids(r#"{"prompt":[1,2,3,4,5],"truncate_prompt_tokens":2}"#),
            [4, 5]
        );
        assert_eq!(
            ids(r#"{"prompt":[1,2,3,4,5],"truncate_prompt_tokens":2,"truncation_side":"right"}"#),
            [1, 2]
        );
        assert_eq!(
            ids(r#"{"prompt":[1,2,3],"truncate_prompt_tokens":-1}"#),
            [1, 2, 3]
        );
        // A prompt to tokenize carries the cut to the settle phase.
        let kept = |operation, body: &str| match input(operation, body) {
            KvInput::Tokens(PromptTokens::Ask(prompt)) => prompt.kept(),
            other => panic!("{body}: {other:?}"),
        };
        let text = kept(
            Operation::Completions,
            r#"{"prompt":"a b c","truncate_prompt_tokens":2}"#,
        )
        .unwrap();
        assert!(text.specials_added());
        assert!(
            text.needs_tokenizer(),
            "which id is a BOS the engine keeps is the tokenizer's"
        );
        let bos = Cut {
            added_before: 1,
            ..Cut::LEFT
        };
        assert_eq!(text.apply(vec![0, 7, 8, 9], bos), [0, 9]);
        assert_eq!(text.apply(vec![0, 7, 8, 9], Cut::LEFT), [8, 9]);
        for body in [
            r#"{"prompt":"a","truncate_prompt_tokens":2,"add_special_tokens":false}"#,
            r#"{"prompt":"a","truncate_prompt_tokens":2,"add_special_tokens":"no"}"#,
        ] {
            assert!(!kept(Operation::Completions, body).unwrap().specials_added());
        }
        let chat = r#"{"messages":[{"role":"user","content":"x"}],"truncate_prompt_tokens":3,"truncation_side":"left"}"#;
        let chat = kept(Operation::ChatCompletions, chat).unwrap();
        assert!(!chat.specials_added());
        assert!(
            !chat.needs_tokenizer(),
            "a side named: any copy of the ids cuts alike"
        );
        // A chat asking for the tokenizer's special tokens has them added (vLLM adds them).
        let asked = r#"{"messages":[{"role":"user","content":"x"}],"truncate_prompt_tokens":3,"add_special_tokens":true}"#;
        let asked = kept(Operation::ChatCompletions, asked).unwrap();
        assert!(asked.specials_added() && asked.needs_tokenizer());
        assert_eq!(chat.apply(vec![1, 2, 3, 4], bos), [2, 3, 4]);
        assert_eq!(kept(Operation::ChatCompletions, r#"{"messages":[]}"#), None);
        // What vLLM refuses is routed by load (the engine answers it).
        for body in [
            r#"{"prompt":"a","truncate_prompt_tokens":-2}"#,
            r#"{"prompt":"a","truncate_prompt_tokens":1.5}"#,
            r#"{"prompt":[1],"truncate_prompt_tokens":1,"truncation_side":"middle"}"#,
        ] {
            assert!(
                matches!(input(Operation::Completions, body), KvInput::Unusable(_)),
                "{body}"
            );
        }
    }

    #[test]
    fn a_body_read_for_routing_gives_what_a_second_parse_would() {
        let variant = VariantRoute::bare("v", Some("m"), &["sql-lora"]);
        let chat = r#""messages":[{"role":"user","content":"x"}]"#;
        let bodies = [
            r#"{"model":"m","prompt":"hi","max_tokens":2}"#.to_owned(),
            r#"{"model":"sql-lora","prompt":[1,2],"cache_salt":"a"}"#.to_owned(),
            r#"{"prompt":["a","b"]}"#.to_owned(),
            r#"{"prompt":null}"#.to_owned(),
            r#"{"prompt":"hi","add_special_tokens":false,"cache_salt":""}"#.to_owned(),
            format!(r#"{{"prompt":"hi",{chat}}}"#),
            format!(r#"{{"model":"sql-lora",{chat},"cache_salt":"b","tools":[]}}"#),
            format!(r#"{{{chat},"add_generation_prompt":false,"chat_template_kwargs":{{"x":1}}}}"#),
            r#"{"model":"m"}"#.to_owned(),
            r#"{"messages":null,"prompt":"p"}"#.to_owned(),
            r#"{"prompt":[1,2,3,4],"truncate_prompt_tokens":2,"truncation_side":"left"}"#
                .to_owned(),
            r#"{"prompt":[1,2,3,4],"truncate_prompt_tokens":"3"}"#.to_owned(),
            r#"{"prompt":"p","truncate_prompt_tokens":2,"add_special_tokens":false}"#.to_owned(),
            r#"{"prompt":"p","truncate_prompt_tokens":-3}"#.to_owned(),
            r#"{"prompt":"p","truncation_side":"up"}"#.to_owned(),
            format!(r#"{{{chat},"truncate_prompt_tokens":5,"truncation_side":"right"}}"#),
            format!(r#"{{{chat},"truncate_prompt_tokens":null,"truncation_side":null}}"#),
            r#"{"prompt":[1,2,3,4],"truncate\u005fprompt_tokens":2}"#.to_owned(),
        ];
        let operations = [
            Operation::Completions,
            Operation::ChatCompletions,
            Operation::Invocations,
            Operation::Embeddings,
        ];
        // What settling gets from a prompt: the ids, or what the router's tokenizer reads and
        // what an engine is sent.
        let seen = |input: &KvInput| match input {
            KvInput::Tokens(PromptTokens::Known(ids)) => format!("ids {ids:?}"),
            KvInput::Tokens(PromptTokens::Ask(prompt)) => format!(
                "read {:?}, sent {:?}, kept {:?}",
                prompt.direct_body(),
                prompt.tokenize_body().ok(),
                prompt.kept()
            ),
            KvInput::Unusable(err) => format!("unusable: {err}"),
        };
        for body in &bodies {
            let bytes = Bytes::from(body.clone());
            let request = OpenAiRequest::parse(body.as_bytes()).unwrap();
            for operation in operations {
                let (parsed, parsed_chain) = KvInput::of(operation, &bytes, &variant);
                let (read, read_chain) = KvInput::of_openai(operation, &request, &bytes, &variant);
                assert_eq!(seen(&read), seen(&parsed), "{operation:?} {body}");
                assert_eq!(read_chain, parsed_chain, "{operation:?} {body}");
            }
        }
        // The engine's body names another model than the client's: the chain follows the
        // engine's (a ModelName that is also one of the variant's adapters).
        let renamed = VariantRoute::bare("v", Some("sql-lora"), &["sql-lora"]);
        let client = r#"{"model":"other","prompt":"x","cache_salt":null}"#;
        let request = OpenAiRequest::parse(client.as_bytes()).unwrap();
        let engine = super::super::engine_body::for_engine(
            Bytes::from(client),
            Some(&request),
            &renamed,
            None,
            false,
        );
        assert_ne!(engine, client);
        let (parsed, parsed_chain) = KvInput::of(Operation::Completions, &engine, &renamed);
        let (read, read_chain) =
            KvInput::of_openai(Operation::Completions, &request, &engine, &renamed);
        assert_eq!(seen(&read), seen(&parsed));
        assert_eq!(read_chain, parsed_chain);
        assert_eq!(read_chain.lora_name.as_deref(), Some("sql-lora"));
        // The tokenizer reads a chat's body itself, and a completion's unless it has messages.
        let ask = |operation, body: &str| match KvInput::of(
            operation,
            &Bytes::from(body.to_owned()),
            &variant,
        )
        .0
        {
            KvInput::Tokens(PromptTokens::Ask(prompt)) => prompt,
            other => panic!("{other:?}"),
        };
        let completion = ask(Operation::Completions, &bodies[5]);
        assert_eq!(completion.direct_body(), None);
        assert_eq!(completion.tokenize_body().unwrap(), r#"{"prompt":"hi"}"#);
        let chat = ask(Operation::ChatCompletions, &bodies[6]);
        assert_eq!(chat.direct_body().unwrap(), bodies[6]);
    }

    #[test]
    fn bodies_carry_the_prompt_or_the_messages_and_template_fields() {
        let body = tokenize_body(
            PromptKind::Completion,
            br#"{"model":"m","prompt":"hi there","max_tokens":3,"stream":true}"#,
        )
        .unwrap();
        assert_eq!(body, r#"{"model":"m","prompt":"hi there"}"#);
        // Without its BOS the engine caches other ids, so the router must count without it too.
        let body = tokenize_body(
            PromptKind::Completion,
            br#"{"model":"m","prompt":"hi","add_special_tokens":false,"temperature":0}"#,
        )
        .unwrap();
        assert_eq!(
            body,
            r#"{"model":"m","prompt":"hi","add_special_tokens":false}"#
        );
        let body = tokenize_body(
            PromptKind::Chat,
            br#"{"model":"m","messages":[{"role":"user","content":"x"}],"temperature":0,
            "chat_template_kwargs":{"enable_thinking":false},"add_generation_prompt":true}"#,
        )
        .unwrap();
        let value: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(value["messages"][0]["content"], "x");
        assert_eq!(value["chat_template_kwargs"]["enable_thinking"], false);
        assert_eq!(value["add_generation_prompt"], true);
        assert!(value.get("temperature").is_none());
        assert!(tokenize_body(PromptKind::Chat, br#"{"prompt":"x"}"#).is_err());
        assert!(tokenize_body(PromptKind::Completion, br#"{"prompt":[1,2]}"#).is_err());
        let of = |body: &[u8]| PromptTokens::of(PromptKind::Completion, body).unwrap();
        assert_eq!(of(br#"{"prompt":[1,2]}"#), PromptTokens::Known(vec![1, 2]));
        assert!(matches!(of(br#"{"prompt":"x"}"#), PromptTokens::Ask(_)));
    }

    #[test]
    fn only_failures_on_the_instances_side_count_toward_a_pause() {
        // Only failures on the instance's side pause it; a 4xx is the request's fault.
        let status = |status| TokenizeError::Status {
            url: String::new(),
            status,
        };
        assert!(status(500).instance_at_fault() && status(503).instance_at_fault());
        assert!(status(429).instance_at_fault() && status(408).instance_at_fault());
        assert!(!status(404).instance_at_fault() && !status(400).instance_at_fault());
        assert!(!TokenizeError::Input(String::new()).instance_at_fault());
    }
}
