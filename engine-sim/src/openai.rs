//! vLLM's OpenAI-compatible wire format: what the simulator reads from a request body and the
//! JSON it answers with. Unknown request fields are ignored, as vLLM does.

use serde::Deserialize;
use serde_json::{Value, json};

use crate::cache::{Lora, block_hashes_under};
use crate::sampling::Generation;
use crate::tokenizer::{chat_prompt_text, tokenize};
use switchyard_tokenize::reuse;
use switchyard_tokenize::truncation::{Cut, Truncation, context_kept};

pub(crate) use crate::reply::{ApiError, ApiKind};

/// The request fields the simulator reads.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub(crate) struct InferenceBody {
    pub model: Option<String>,
    pub messages: Option<Vec<Value>>,
    pub prompt: Option<Value>,
    /// Read as pydantic reads an integer (`"5"` and `5.0` are 5); a value it refuses is
    /// refused with the other generation fields ([`Generation`]), before it is used.
    #[serde(deserialize_with = "lax_integer_field")]
    pub max_tokens: Option<i64>,
    #[serde(deserialize_with = "lax_integer_field")]
    pub max_completion_tokens: Option<i64>,
    /// Read as pydantic reads a boolean (`"true"` and `1` stream); checked with the other
    /// generation fields ([`crate::sampling::Generation`]).
    pub stream: Option<Value>,
    pub stream_options: Option<StreamOptions>,
    pub kv_transfer_params: Option<Value>,
    /// vLLM's chat rendering: continue the final (assistant) message instead of starting a
    /// new one; it needs `add_generation_prompt: false` (vLLM's default is true).
    /// Both read as pydantic reads a boolean (what it refuses, and both true as given, are
    /// refused first, with the generation fields).
    #[serde(deserialize_with = "lax_bool_field")]
    pub continue_final_message: Option<bool>,
    #[serde(deserialize_with = "lax_bool_field")]
    pub add_generation_prompt: Option<bool>,
    /// vLLM's extra sampling arguments; the simulator reads `kv_cache_report_mode`.
    pub vllm_xargs: Option<Value>,
    /// A chat's `reasoning_effort` and `documents`, which vLLM validates and passes to the
    /// chat template (the model's tokenizer renders them, `--tokenizer`).
    pub reasoning_effort: Option<Value>,
    pub documents: Option<Value>,
    /// vLLM's prompt truncation: the engine serves only the ids these keep.
    pub truncate_prompt_tokens: Option<Value>,
    pub truncation_side: Option<Value>,
    /// Read for the truncation only (whether the tokenizer added a BOS to cut around).
    pub add_special_tokens: Option<Value>,
    /// A chat's `echo` (with it, forwarded prompt ids are not reused).
    pub echo: Option<Value>,
    /// `return_token_ids`: the answer carries the prompt's ids and each choice's.
    pub return_token_ids: Option<Value>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub(crate) struct StreamOptions {
    pub include_usage: Option<bool>,
    /// With `include_usage`: every chunk carries the usage so far (vLLM's extension).
    pub continuous_usage_stats: Option<bool>,
}

impl InferenceBody {
    pub(crate) fn stream(&self) -> bool {
        self.stream
            .as_ref()
            .and_then(switchyard_tokenize::reuse::lax_bool)
            .unwrap_or(false)
    }

    pub(crate) fn include_usage(&self) -> bool {
        self.stream_options
            .as_ref()
            .and_then(|options| options.include_usage)
            .unwrap_or(false)
    }

    /// `continuous_usage_stats`, which vLLM honours only with `include_usage`.
    pub(crate) fn continuous_usage(&self) -> bool {
        self.include_usage()
            && self
                .stream_options
                .as_ref()
                .and_then(|options| options.continuous_usage_stats)
                .unwrap_or(false)
    }

    /// A completion whose `echo` asks for the prompt alone (`max_tokens: 0`): vLLM generates
    /// one token and answers the prompt.
    pub(crate) fn echo_alone(&self, kind: ApiKind) -> bool {
        kind == ApiKind::Completion
            && self.max_tokens == Some(0)
            && self.echo.as_ref().and_then(reuse::lax_bool) == Some(true)
    }

    /// A chat's `max_completion_tokens`, else its `max_tokens`; a completion's `max_tokens`
    /// (it has no `max_completion_tokens`); None if not set.
    pub(crate) fn asked_max_tokens(&self, kind: ApiKind) -> Option<i64> {
        match kind {
            ApiKind::Chat => self.max_completion_tokens.or(self.max_tokens),
            ApiKind::Completion => self.max_tokens,
        }
    }

    /// [`InferenceBody::asked_max_tokens`], refused below 1 (1 for a completion's echo alone).
    pub(crate) fn requested_max_tokens(&self, kind: ApiKind) -> Result<Option<u32>, ApiError> {
        if self.echo_alone(kind) {
            return Ok(Some(1));
        }
        let Some(value) = self.asked_max_tokens(kind) else {
            return Ok(None);
        };
        if value < 1 {
            return Err(crate::sampling::refused(
                format!("max_tokens must be at least 1, got {value}."),
                Some("max_tokens"),
                Some(value.to_string()),
            ));
        }
        Ok(Some(u32::try_from(value).unwrap_or(u32::MAX)))
    }

    /// Where this request's output resumes in the simulator's word sequence: 0, or, for a
    /// continuation of the simulator's own earlier output (a chat request continuing a final
    /// assistant message that is its first k words, or a completions prompt that ends with
    /// them), k, so that the text so far plus this answer is the undisturbed answer.
    /// (A chat continuing its final message with a generation prompt was refused before:
    /// [`crate::sampling::Generation::check_request`], [`check_conversation`].)
    pub(crate) fn resume_at(&self, kind: ApiKind) -> u32 {
        match kind {
            ApiKind::Chat => {
                if self.continue_final_message != Some(true) {
                    return 0;
                }
                let last = self.messages.as_deref().and_then(<[Value]>::last);
                let Some(content) = last
                    .filter(|message| message["role"] == "assistant")
                    .and_then(|message| message["content"].as_str())
                else {
                    return 0;
                };
                words_ending(content)
                    .filter(|&(_, start)| start == 0)
                    .map_or(0, |(k, _)| k)
            }
            ApiKind::Completion => match &self.prompt {
                Some(Value::String(prompt)) => words_ending(prompt).map_or(0, |(k, _)| k),
                Some(Value::Array(ids)) => ids_ending(ids),
                _ => 0,
            },
        }
    }

    /// The request's truncation (a 400 naming the field for what vLLM's request model
    /// refuses), what -1 keeps, and vLLM's later refusal of a truncation longer than the
    /// context (answered after the model is checked, as vLLM answers it).
    #[allow(clippy::type_complexity)] // read once, taken apart at once
    fn truncation(
        &self,
        kind: ApiKind,
        max_model_len: u32,
    ) -> Result<Option<(Truncation, u64, Result<(), ApiError>)>, ApiError> {
        let param = |message: &str| {
            if message.starts_with("truncation_side") {
                "truncation_side"
            } else {
                "truncate_prompt_tokens"
            }
        };
        // What the request model refuses names `body.FIELD`; a truncation longer than the
        // context is vLLM's own refusal.
        let invalid = |err: switchyard_tokenize::Invalid| {
            let field = match param(&err.0) {
                "truncation_side" => "body.truncation_side",
                _ => "body.truncate_prompt_tokens",
            };
            ApiError::bad_request(err.0).param(field)
        };
        let Some(truncation) = Truncation::read(
            self.truncate_prompt_tokens.as_ref(),
            self.truncation_side.as_ref(),
        )
        .map_err(invalid)?
        else {
            return Ok(None);
        };
        let fits = truncation.check(max_model_len).map_err(|err| {
            let keep = self
                .truncate_prompt_tokens
                .as_ref()
                .and_then(reuse::lax_integer);
            crate::sampling::refused(
                err.0,
                Some("truncate_prompt_tokens"),
                keep.map(|keep| keep.to_string()),
            )
        });
        // vLLM's `max_completion_tokens or max_tokens` (chat), `max_tokens` (completions, 16
        // when not given; a null one, which vLLM reads as 0, is read as not given here), read
        // with `or 0`.
        let asked = match kind {
            ApiKind::Chat => self.max_completion_tokens.or(self.max_tokens),
            ApiKind::Completion => Some(self.max_tokens.unwrap_or(16)),
        };
        let asked = asked.map(|tokens| u64::from(tokens != 0));
        Ok(Some((truncation, context_kept(max_model_len, asked), fits)))
    }

    /// A disaggregated decode's forwarded prompt ids (vLLM 0.32's decode-side token reuse: a
    /// chat's `kv_transfer_params.prompt_token_ids`, served instead of rendering and
    /// tokenizing `messages`): not used with `echo` or non-text content; refused (400) unless a
    /// non-empty list of non-negative integers within the vocabulary.
    fn reused_prompt_ids(
        &self,
        tokenizer: Option<&switchyard_tokenize::EngineTokenizer>,
    ) -> Result<Option<Vec<u32>>, ApiError> {
        const PARAM: &str = "kv_transfer_params.prompt_token_ids";
        let Some(ids) = self
            .kv_transfer_params
            .as_ref()
            .and_then(|params| params.get("prompt_token_ids"))
            .filter(|ids| !ids.is_null())
        else {
            return Ok(None);
        };
        let echo = lax_flag(self.echo.as_ref(), "body.echo")?;
        if echo
            || self
                .messages
                .as_deref()
                .is_some_and(reuse::non_text_content)
        {
            return Ok(None);
        }
        let malformed = || {
            ApiError::bad_request(
                "`kv_transfer_params['prompt_token_ids']` must be a non-empty list of \
                 non-negative integers."
                    .to_owned(),
            )
            .param(PARAM)
        };
        let ids = ids
            .as_array()
            .filter(|ids| !ids.is_empty())
            .ok_or_else(malformed)?;
        let ids: Vec<u64> = ids
            .iter()
            .map(Value::as_u64)
            .collect::<Option<_>>()
            .ok_or_else(malformed)?;
        let vocabulary = tokenizer.map_or(1 << 32, |tokenizer| tokenizer.vocab_size() as u64);
        if let Some(id) = ids.iter().find(|id| **id >= vocabulary) {
            return Err(
                ApiError::bad_request(format!("Token id {id} is out of vocabulary")).param(PARAM),
            );
        }
        Ok(Some(ids.into_iter().map(|id| id as u32).collect()))
    }

    /// Whether the model's tokenizer adds its special tokens to the prompt: a completions
    /// text prompt unless `add_special_tokens` is false, a chat when it is true (read as vLLM
    /// reads a boolean).
    fn adds_special_tokens(&self, kind: ApiKind) -> bool {
        let given = self.add_special_tokens.as_ref().and_then(reuse::lax_bool);
        match kind {
            ApiKind::Completion => {
                matches!(self.prompt, Some(Value::String(_))) && given != Some(false)
            }
            // A chat's template writes its own; vLLM adds them too only when asked.
            ApiKind::Chat => given == Some(true),
        }
    }

    /// Whether `vllm_xargs.kv_cache_report_mode` is "full": vLLM 0.32 then publishes a
    /// `BlockStored` for the prefix blocks a request reuses from its cache (default
    /// "incremental": only newly cached blocks). vLLM refuses a `vllm_xargs` that is not an
    /// object.
    pub(crate) fn reports_reuse(&self) -> Result<bool, ApiError> {
        match &self.vllm_xargs {
            None | Some(Value::Null) => Ok(false),
            Some(Value::Object(args)) => {
                Ok(args.get("kv_cache_report_mode").and_then(Value::as_str) == Some("full"))
            }
            Some(_) => Err(ApiError::bad_request(
                "vllm_xargs: Input should be a valid dictionary".to_owned(),
            )),
        }
    }

    pub(crate) fn kv_transfer(&self) -> KvTransfer {
        self.kv_transfer_params
            .as_ref()
            .map(KvTransfer::from_value)
            .unwrap_or_default()
    }
}

/// The NixlConnector fields of `kv_transfer_params` the simulator acts on.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct KvTransfer {
    pub do_remote_decode: bool,
    pub do_remote_prefill: bool,
    /// How many blocks `remote_block_ids` names (its first KV-cache group's), if given.
    pub remote_blocks: Option<usize>,
    /// The hand-off a decoder pulls: which engine prefilled which request into which blocks
    /// (one list per KV-cache group, as vLLM sends them; a flat list is kept as it came, for
    /// the decoder to refuse), and where that engine's side channel is.
    pub remote_block_ids: Option<BlockIds>,
    pub remote_engine_id: Option<String>,
    pub remote_request_id: Option<String>,
    pub remote_host: Option<String>,
    pub remote_port: Option<u16>,
}

impl KvTransfer {
    fn from_value(value: &Value) -> Self {
        let flag = |name: &str| value.get(name).and_then(Value::as_bool).unwrap_or(false);
        let text = |name: &str| value.get(name).and_then(Value::as_str).map(str::to_owned);
        let ids = |list: &Value| -> Option<Vec<u64>> {
            list.as_array()?.iter().map(Value::as_u64).collect()
        };
        let remote_block_ids =
            value
                .get("remote_block_ids")
                .and_then(Value::as_array)
                .map(|items| {
                    if items.iter().all(Value::is_array) && !items.is_empty() {
                        match items.iter().map(ids).collect::<Option<Vec<_>>>() {
                            Some(groups) => BlockIds::Groups(groups),
                            None => BlockIds::Malformed,
                        }
                    } else {
                        match items.iter().map(Value::as_u64).collect::<Option<Vec<_>>>() {
                            Some(flat) => BlockIds::Flat(flat),
                            None => BlockIds::Malformed,
                        }
                    }
                });
        Self {
            do_remote_decode: flag("do_remote_decode"),
            do_remote_prefill: flag("do_remote_prefill"),
            remote_blocks: remote_block_ids
                .as_ref()
                .and_then(BlockIds::first_group_len),
            remote_block_ids,
            remote_engine_id: text("remote_engine_id"),
            remote_request_id: text("remote_request_id"),
            remote_host: text("remote_host"),
            remote_port: value
                .get("remote_port")
                .and_then(Value::as_u64)
                .and_then(|port| u16::try_from(port).ok()),
        }
    }
}

/// `kv_transfer_params.remote_block_ids` as a decoder reads it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum BlockIds {
    /// One list per KV-cache group (vLLM's `[[0, 1, 2]]`).
    Groups(Vec<Vec<u64>>),
    /// One flat list of ids, which vLLM does not send.
    Flat(Vec<u64>),
    /// Anything else (not ids).
    Malformed,
}

impl BlockIds {
    fn first_group_len(&self) -> Option<usize> {
        match self {
            BlockIds::Groups(groups) => groups.first().map(Vec::len),
            BlockIds::Flat(ids) => Some(ids.len()),
            BlockIds::Malformed => None,
        }
    }
}

/// An integer field as pydantic reads one; None for null and for what it refuses (which
/// [`Generation::check_request`] refuses first).
fn lax_integer_field<'de, D: serde::Deserializer<'de>>(
    deserializer: D,
) -> Result<Option<i64>, D::Error> {
    Ok(reuse::lax_integer(&Value::deserialize(deserializer)?))
}

/// A boolean field as pydantic reads one; None for null and for what it refuses.
fn lax_bool_field<'de, D: serde::Deserializer<'de>>(
    deserializer: D,
) -> Result<Option<bool>, D::Error> {
    Ok(reuse::lax_bool(&Value::deserialize(deserializer)?))
}

/// A parsed request and its tokenized prompt (or why the prompt is unusable).
#[derive(Debug)]
pub(crate) struct ParsedRequest {
    pub body: InferenceBody,
    /// Its generation fields, checked once the output budget is known.
    pub generation: Generation,
    pub kind: ApiKind,
    pub prompt: Result<Prompt, ApiError>,
}

#[derive(Debug)]
pub(crate) struct Prompt {
    pub tokens: Vec<u32>,
    pub block_hashes: Vec<u64>,
    /// The adapter the request's `model` names (its blocks are hashed under it).
    pub lora: Option<Lora>,
}

/// A JSON body, or a 400 whose message is `what` and serde's reason.
pub(crate) fn parse_json<T: serde::de::DeserializeOwned>(
    bytes: &[u8],
    what: &str,
) -> Result<T, ApiError> {
    serde_json::from_slice(bytes).map_err(|err| ApiError::bad_request(format!("{what}: {err}")))
}

/// Parses a body and tokenizes its prompt, its blocks hashed under the adapter `lora_of` finds
/// for its `model`. `kind` None picks chat if the body has `messages` (the SageMaker
/// `/invocations` rule). CPU-bound: run large bodies on a blocking thread.
pub(crate) fn parse_request(
    bytes: &[u8],
    reading: impl Into<Reading>,
    (block_size, max_model_len): (usize, u32),
    tokenizer: Option<&switchyard_tokenize::EngineTokenizer>,
    lora_of: impl FnOnce(Option<&str>) -> Option<Lora>,
) -> Result<ParsedRequest, ApiError> {
    let reading = reading.into();
    let (body, generation, kind) = match reading {
        Reading::Model(kind) => {
            let (body, generation) = read_model(bytes, kind, true)?;
            (body, generation, kind)
        }
        Reading::Tokenize(kind) => {
            let (body, generation) = read_model(bytes, kind, false)?;
            (body, generation, kind)
        }
        Reading::Invocation => read_invocation(bytes, max_model_len)?,
    };
    // A tokenize request has neither a truncation nor forwarded ids (vLLM ignores those
    // fields there).
    let tokenize = matches!(reading, Reading::Tokenize(_));
    let truncation = if tokenize {
        None
    } else {
        body.truncation(kind, max_model_len)?
    };
    // Forwarded ids (a chat's, with its messages) are served as they are: no template, no
    // tokenizer, no truncation; a truncation longer than the context is still refused.
    let reused = match kind {
        ApiKind::Chat if body.messages.is_some() && !tokenize => {
            body.reused_prompt_ids(tokenizer)?
        }
        ApiKind::Chat | ApiKind::Completion => None,
    };
    let lora = lora_of(body.model.as_deref());
    let tokens = match (reused, truncation) {
        (_, Some((_, _, Err(too_long)))) => Err(too_long),
        (Some(ids), _) => Ok(ids),
        (None, truncation) => {
            let tokens = served_tokens(&body, bytes, kind, tokenizer);
            match truncation {
                Some((truncation, context, _)) => tokens.and_then(|tokens| {
                    let cut = match tokenizer {
                        Some(tokenizer) => tokenizer.truncation_cut(body.adds_special_tokens(kind)),
                        None => Cut::LEFT,
                    };
                    let kept = truncation.apply(tokens, cut, Some(context));
                    if kept.is_empty() {
                        // `truncate_prompt_tokens: 0`.
                        return Err(ApiError::bad_request(
                            "The decoder prompt cannot be empty".to_owned(),
                        ));
                    }
                    Ok(kept)
                }),
                None => tokens,
            }
        }
    };
    let prompt = tokens.map(|tokens| Prompt {
        block_hashes: block_hashes_under(lora.as_ref(), &tokens, block_size),
        tokens,
        lora,
    });
    Ok(ParsedRequest {
        body,
        generation,
        kind,
        prompt,
    })
}

/// How a body is read: by one request model (chat or completions), as SageMaker's
/// `/invocations` reads it (one, then the other), or as `/tokenize` reads it (a chat's or a
/// completion's tokenize request, which has none of the generation fields).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Reading {
    Model(ApiKind),
    Invocation,
    Tokenize(ApiKind),
}

/// A path's kind, or none for `/invocations`.
impl From<Option<ApiKind>> for Reading {
    fn from(kind: Option<ApiKind>) -> Self {
        kind.map_or(Reading::Invocation, Reading::Model)
    }
}

/// What a request model (chat or completions) checks while it reads a body; `generation`:
/// its checks of the generation fields too (not a tokenize request's).
fn read_model(
    bytes: &[u8],
    kind: ApiKind,
    generation_checks: bool,
) -> Result<(InferenceBody, Generation), ApiError> {
    // The request model's own checks run before its fields' types (pydantic's before
    // validators).
    let generation = Generation::read(bytes)?;
    if generation_checks {
        generation.check_request(kind)?;
    }
    let body: InferenceBody = match parse_json(bytes, "invalid JSON body") {
        Ok(body) => body,
        // The completions model has no `messages`: whatever it holds is ignored there.
        Err(error) if kind == ApiKind::Completion => {
            let mut value: Value = parse_json(bytes, "invalid JSON body")?;
            let removed = value
                .as_object_mut()
                .and_then(|fields| fields.remove("messages"));
            if removed.is_none() {
                return Err(error);
            }
            serde_json::from_value(value)
                .map_err(|err| ApiError::bad_request(format!("invalid JSON body: {err}")))?
        }
        Err(error) => return Err(error),
    };
    if kind == ApiKind::Chat {
        check_chat_fields(&body)?;
    }
    if generation_checks {
        lax_flag(body.return_token_ids.as_ref(), "body.return_token_ids")?;
        lax_flag(body.echo.as_ref(), "body.echo")?;
    } else if kind == ApiKind::Chat
        && body.continue_final_message == Some(true)
        && body.add_generation_prompt != Some(false)
    {
        // A tokenize request's template rendering refuses both (Hugging Face's message).
        return Err(ApiError::bad_request(
            "continue_final_message and add_generation_prompt are not compatible. Use \
             continue_final_message when you want the model to continue the final message, and \
             add_generation_prompt when you want to add a header that will prompt it to start \
             a new assistant message instead."
                .to_owned(),
        ));
    }
    Ok((body, generation))
}

/// SageMaker's `/invocations` as vLLM 0.32 serves it: the body is tried as a chat request,
/// then as a completions one; the first whose request model takes it is served. A
/// `VLLMValidationError` raised while a model reads it (a completion without a prompt, say)
/// is the answer at once; if neither takes it, vLLM's 400 naming both.
fn read_invocation(
    bytes: &[u8],
    max_model_len: u32,
) -> Result<(InferenceBody, Generation, ApiKind), ApiError> {
    if let Err(err) = serde_json::from_slice::<serde::de::IgnoredAny>(bytes) {
        return Err(ApiError::bad_request(format!("JSON decode error: {err}")));
    }
    // The field checks the request model makes of these (pydantic's): the next model is tried.
    let field_error = |mut error: ApiError| {
        error.raised = false;
        error
    };
    for kind in [ApiKind::Chat, ApiKind::Completion] {
        let read = read_model(bytes, kind, true).and_then(|(body, generation)| {
            if kind == ApiKind::Chat && body.messages.is_none() {
                return Err(ApiError::bad_request("messages: Field required".to_owned())
                    .param("body.messages"));
            }
            body.truncation(kind, max_model_len).map_err(field_error)?;
            body.reports_reuse().map_err(field_error)?;
            Ok((body, generation))
        });
        match read {
            Ok((body, generation)) => return Ok((body, generation, kind)),
            Err(error) if error.raised => return Err(error),
            Err(_) => {}
        }
    }
    Err(ApiError::bad_request(
        "Cannot find suitable handler for request. Expected one of: \
         ['ChatCompletionRequest', 'CompletionRequest']"
            .to_owned(),
    ))
}

/// The prompt's ids: the model's tokenizer (`--tokenizer`) for a chat with messages or a
/// completion's text, else the simulator's own. A chat without messages (null too) is refused
/// as vLLM refuses it; the model's tokenizer would read such a body as a completions one.
fn served_tokens(
    body: &InferenceBody,
    bytes: &[u8],
    kind: ApiKind,
    tokenizer: Option<&switchyard_tokenize::EngineTokenizer>,
) -> Result<Vec<u32>, ApiError> {
    match tokenizer {
        Some(tokenizer)
            if (kind == ApiKind::Chat && body.messages.is_some())
                || (kind == ApiKind::Completion
                    && matches!(body.prompt, Some(Value::String(_)))) =>
        {
            model_tokens(tokenizer, bytes, kind)
        }
        _ => {
            let tokens = prompt_tokens(body, kind)?;
            // Given ids are checked against the model's vocabulary, as vLLM's renderer does.
            let vocabulary = tokenizer.map(|tokenizer| tokenizer.vocab_size() as u64);
            let given_ids = matches!(&body.prompt, Some(Value::Array(items))
                if items.iter().all(|item| !item.is_string()));
            if let Some(vocabulary) = vocabulary.filter(|_| given_ids)
                && let Some(&largest) = tokens.iter().max()
                && u64::from(largest) >= vocabulary
            {
                return Err(ApiError::bad_request(format!(
                    "Token id {largest} is out of vocabulary"
                )));
            }
            Ok(tokens)
        }
    }
}

/// A boolean field read as pydantic reads one (absent or null: false); a 400 naming it
/// (`param`: `body.FIELD`, as pydantic names it) for what pydantic refuses.
pub(crate) fn lax_flag(value: Option<&Value>, param: &'static str) -> Result<bool, ApiError> {
    match value {
        None | Some(Value::Null) => Ok(false),
        Some(value) => reuse::lax_bool(value).ok_or_else(|| {
            let field = param.trim_start_matches("body.");
            ApiError::bad_request(format!("{field}: Input should be a valid boolean")).param(param)
        }),
    }
}

/// What vLLM's chat renderer refuses once the model is known: an empty conversation, and
/// `continue_final_message` with `add_generation_prompt` left to its default (true).
pub(crate) fn check_conversation(body: &InferenceBody, kind: ApiKind) -> Result<(), ApiError> {
    let Some(messages) = body.messages.as_ref().filter(|_| kind == ApiKind::Chat) else {
        return Ok(());
    };
    if messages.is_empty() {
        return Err(ApiError::bad_request(
            "Cannot apply chat template to an empty conversation. Provide at least one message."
                .to_owned(),
        ));
    }
    if body.continue_final_message == Some(true) && body.add_generation_prompt.is_none() {
        return Err(ApiError::bad_request(
            "continue_final_message and add_generation_prompt are not compatible. Use \
             continue_final_message when you want the model to continue the final message, and \
             add_generation_prompt when you want to add a header that will prompt it to start a \
             new assistant message instead."
                .to_owned(),
        ));
    }
    Ok(())
}

/// What vLLM's chat request model refuses in `reasoning_effort` (one of its values, or null)
/// and `documents` (a list of objects with string values, or null).
fn check_chat_fields(body: &InferenceBody) -> Result<(), ApiError> {
    if let Some(messages) = &body.messages {
        // Only an assistant's message may have a null content (its tool calls instead); a
        // message without the key is taken as vLLM takes it.
        let null_content = messages.iter().any(|message| {
            message.get("role").and_then(Value::as_str) != Some("assistant")
                && message.get("content").is_some_and(Value::is_null)
        });
        if null_content {
            return Err(ApiError::bad_request(
                "messages: only an assistant's message may have a null content".to_owned(),
            )
            .param("messages"));
        }
    }
    match &body.reasoning_effort {
        None | Some(Value::Null) => {}
        Some(Value::String(effort))
            if switchyard_tokenize::REASONING_EFFORTS.contains(&effort.as_str()) => {}
        Some(_) => {
            return Err(ApiError::bad_request(format!(
                "reasoning_effort must be one of {}",
                switchyard_tokenize::REASONING_EFFORTS.join(", ")
            ))
            .param("reasoning_effort"));
        }
    }
    let documents_valid = match &body.documents {
        None | Some(Value::Null) => true,
        Some(Value::Array(documents)) => documents.iter().all(|document| {
            document
                .as_object()
                .is_some_and(|fields| fields.values().all(Value::is_string))
        }),
        Some(_) => false,
    };
    if !documents_valid {
        return Err(ApiError::bad_request(
            "documents must be a list of objects with string values".to_owned(),
        )
        .param("documents"));
    }
    Ok(())
}

/// The prompt's ids from the model's own tokenizer (`--tokenizer`), as vLLM computes them; a
/// request its renderer does not follow is refused with a 400 that says so.
fn model_tokens(
    tokenizer: &switchyard_tokenize::EngineTokenizer,
    bytes: &[u8],
    kind: ApiKind,
) -> Result<Vec<u32>, ApiError> {
    use switchyard_tokenize::Refusal;
    let param = if kind == ApiKind::Chat {
        "messages"
    } else {
        "prompt"
    };
    // The tokenizer renders a body with `messages` as a chat; a completion ignores them.
    let stripped = (kind == ApiKind::Completion
        && bytes.windows(10).any(|window| window == b"\"messages\""))
    .then(|| {
        let mut value: Value = serde_json::from_slice(bytes).ok()?;
        value.as_object_mut()?.remove("messages");
        serde_json::to_vec(&value).ok()
    })
    .flatten();
    let bytes = stripped.as_deref().unwrap_or(bytes);
    tokenizer.tokenize(bytes).map_err(|refusal| match refusal {
        Refusal::Invalid(reason) => ApiError::bad_request(reason.to_string()).param(param),
        Refusal::Engine(reason) => ApiError::bad_request(format!(
            "the simulator's tokenizer does not render this request ({})",
            reason.reason()
        ))
        .param(param),
    })
}

fn prompt_tokens(body: &InferenceBody, kind: ApiKind) -> Result<Vec<u32>, ApiError> {
    match kind {
        ApiKind::Chat => {
            let messages = body.messages.as_deref().ok_or_else(|| {
                ApiError::bad_request("messages: field required".to_owned()).param("messages")
            })?;
            Ok(tokenize(&chat_prompt_text(messages)))
        }
        ApiKind::Completion => match &body.prompt {
            Some(Value::String(text)) => Ok(tokenize(text)),
            Some(Value::Array(items)) => completion_array_tokens(items),
            Some(_) => Err(ApiError::bad_request(
                "prompt must be a string, an array of strings or an array of token ids".to_owned(),
            )
            .param("prompt")),
            None => Err(ApiError::bad_request("prompt: field required".to_owned()).param("prompt")),
        },
    }
}

/// An array prompt: strings (concatenated), token ids, or arrays of token ids (concatenated).
fn completion_array_tokens(items: &[Value]) -> Result<Vec<u32>, ApiError> {
    if items.is_empty() {
        return Err(ApiError::bad_request(
            "You must pass at least one prompt".to_owned(),
        ));
    }
    let mut text = String::new();
    let mut ids = Vec::new();
    for item in items {
        match item {
            Value::String(part) => text.push_str(part),
            Value::Number(number) => ids.push(token_id(number)?),
            Value::Array(inner) => {
                if inner.is_empty() {
                    return Err(ApiError::bad_request(
                        "The decoder prompt cannot be empty".to_owned(),
                    ));
                }
                for id in inner {
                    let Value::Number(number) = id else {
                        return Err(invalid_token_id());
                    };
                    ids.push(token_id(number)?);
                }
            }
            _ => return Err(invalid_token_id()),
        }
    }
    if !text.is_empty() && !ids.is_empty() {
        return Err(
            ApiError::bad_request("prompt must not mix strings and token ids".to_owned())
                .param("prompt"),
        );
    }
    if ids.is_empty() {
        Ok(tokenize(&text))
    } else {
        Ok(ids)
    }
}

fn token_id(number: &serde_json::Number) -> Result<u32, ApiError> {
    number
        .as_u64()
        .and_then(|id| u32::try_from(id).ok())
        .ok_or_else(invalid_token_id)
}

fn invalid_token_id() -> ApiError {
    ApiError::bad_request("prompt token ids must be non-negative integers".to_owned())
        .param("prompt")
}

/// Filler words of at most 6 letters: each is exactly one token for [`tokenize`].
const FILLER: &[&str] = &[
    "lorem", "ipsum", "dolor", "sit", "amet", "tempor", "magna", "aliqua", "veniam", "quis",
    "nostra", "ut", "labore", "dolore", "enim", "minim",
];

/// The text of output token `index` (0-based): a filler word, space-separated after the first.
pub(crate) fn output_token_text(index: u32) -> String {
    let word = FILLER[index as usize % FILLER.len()];
    if index == 0 {
        word.to_owned()
    } else {
        format!(" {word}")
    }
}

/// The text of the first `count` output tokens.
pub(crate) fn output_text(count: u32) -> String {
    (0..count).map(output_token_text).collect()
}

/// The text of the simulator's own ids: its output words (with or without their leading
/// space) as themselves, any other id as `<|ID|>`.
pub(crate) fn detokenize(ids: &[u32]) -> String {
    let words: Vec<(u32, String)> = (0..32)
        .flat_map(|index| {
            let word = output_token_text(index);
            let bare = word.trim_start().to_owned();
            [(tokenize(&word)[0], word), (tokenize(&bare)[0], bare)]
        })
        .collect();
    let mut text = String::new();
    for id in ids {
        match words.iter().find(|(known, _)| known == id) {
            Some((_, word)) => text.push_str(word),
            None => text.push_str(&format!("<|{id}|>")),
        }
    }
    text
}

/// The token id of output token `index` (its text is one token).
pub(crate) fn output_token_id(index: u32) -> u32 {
    crate::tokenizer::tokenize(&output_token_text(index))
        .first()
        .copied()
        .unwrap_or(0)
}

/// The most output tokens k a token-id prompt ends with (an LMCache decode: the prompt plus
/// the prefill's first token), 0 if none.
fn ids_ending(ids: &[Value]) -> u32 {
    let ids: Vec<u64> = ids.iter().filter_map(Value::as_u64).collect();
    let mut found = 0;
    for k in 1..=ids.len().min(4096) {
        let tail = &ids[ids.len() - k..];
        if tail
            .iter()
            .enumerate()
            .all(|(index, &id)| id == u64::from(output_token_id(index as u32)))
        {
            found = k as u32;
        }
    }
    found
}

/// The most output tokens k ≥ 1 whose text `text` ends with, and where in `text` it starts.
fn words_ending(text: &str) -> Option<(u32, usize)> {
    let mut output = String::new();
    let mut found = None;
    for k in 0.. {
        output.push_str(&output_token_text(k));
        if output.len() > text.len() {
            return found;
        }
        if text.ends_with(&output) {
            found = Some((k + 1, text.len() - output.len()));
        }
    }
    found
}

/// Token counts reported in `usage`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Usage {
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
    pub cached_tokens: u32,
}

impl Usage {
    pub(crate) fn to_json(self) -> Value {
        json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": { "cached_tokens": self.cached_tokens },
        })
    }
}

/// The fields every response and chunk of one request shares.
#[derive(Debug, Clone)]
pub(crate) struct ResponseMeta {
    pub id: String,
    pub created: u64,
    pub model: String,
    pub kind: ApiKind,
    /// The output word the answer starts at (`InferenceBody::resume_at`).
    pub resume_at: u32,
    /// The prompt's ids, with `return_token_ids`: the answer then carries them and each
    /// token's id, where vLLM 0.32 puts them (a chat's at the top, on its first chunk when
    /// streamed; a completion's in its choice, on its first chunk). Without it the simulator
    /// leaves those fields out, where vLLM sends them as null.
    pub prompt_token_ids: Option<std::sync::Arc<[u32]>>,
    /// What `echo` puts before the answer, if anything.
    pub echo: Option<Echo>,
    /// A chat answer's role: the assistant's, or with `add_generation_prompt: false` the last
    /// message's (vLLM answers in it).
    pub role: String,
    /// How many choices the answer has (`n`; at least 1): each the same text here, where vLLM
    /// samples each on its own; streamed, a chunk for each in turn.
    pub choices: u32,
}

/// `echo` as vLLM 0.32 answers it: a completion's prompt text before its answer (in its first
/// chunk when streamed, which also carries the prompt's ids), or the prompt alone for
/// `max_tokens: 0` (one token is generated and left out); a chat's last message, when it is
/// the assistant's, before the answer (a chunk of its own after the role chunk).
#[derive(Debug, Clone)]
pub(crate) struct Echo {
    pub text: std::sync::Arc<str>,
    /// A completion with `max_tokens: 0`: the answer is the prompt alone.
    pub alone: bool,
    /// A completion's prompt ids, for its first chunk.
    pub prompt_ids: Option<std::sync::Arc<[u32]>>,
}

impl ResponseMeta {
    /// The text of this answer's first `count` tokens (after what `echo` puts before them).
    pub(crate) fn text(&self, count: u32) -> String {
        let echoed = self.echo.as_ref().map_or("", |echo| &echo.text);
        if self.echo.as_ref().is_some_and(|echo| echo.alone) {
            return echoed.to_owned();
        }
        std::iter::once(echoed.to_owned())
            .chain((self.resume_at..self.resume_at + count).map(output_token_text))
            .collect()
    }

    /// A chat's echo chunk (after the role chunk), if it echoes anything.
    pub(crate) fn echo_chunk(&self) -> Option<Value> {
        let echo = self.echo.as_ref().filter(|_| self.kind == ApiKind::Chat)?;
        if echo.text.is_empty() {
            return None;
        }
        let choice = json!({
            "index": 0,
            "delta": { "content": &*echo.text },
            "logprobs": null,
            "finish_reason": null,
        });
        Some(self.envelope(true, json!([choice])))
    }

    /// The text of this answer's token `index` (0-based).
    pub(crate) fn token_text(&self, index: u32) -> String {
        output_token_text(self.resume_at + index)
    }

    fn object(&self, chunk: bool) -> &'static str {
        match (self.kind, chunk) {
            (ApiKind::Chat, false) => "chat.completion",
            (ApiKind::Chat, true) => "chat.completion.chunk",
            (ApiKind::Completion, _) => "text_completion",
        }
    }

    fn envelope(&self, chunk: bool, choices: Value) -> Value {
        json!({
            "id": self.id,
            "object": self.object(chunk),
            "created": self.created,
            "model": self.model,
            "choices": choices,
        })
    }

    /// `chunk` (one choice, index 0) once for each of the answer's choices, by index.
    pub(crate) fn for_each_choice(&self, chunk: Value) -> Vec<Value> {
        (0..self.choices.max(1))
            .map(|index| {
                let mut chunk = chunk.clone();
                chunk["choices"][0]["index"] = json!(index);
                chunk
            })
            .collect()
    }

    /// `usage` of one choice, for the whole answer: every choice's output tokens.
    pub(crate) fn all_choices(&self, usage: Usage) -> Usage {
        Usage {
            completion_tokens: usage.completion_tokens * self.choices.max(1),
            ..usage
        }
    }

    /// A whole (non-streaming) response.
    pub(crate) fn response(
        &self,
        text: String,
        finish_reason: &str,
        usage: Usage,
        kv_transfer_params: Option<Value>,
    ) -> Value {
        let mut choice = match self.kind {
            ApiKind::Chat => json!({
                "index": 0,
                "message": { "role": self.role, "content": text, "tool_calls": [] },
                "logprobs": null,
                "finish_reason": finish_reason,
                "stop_reason": null,
            }),
            ApiKind::Completion => json!({
                "index": 0,
                "text": text,
                "logprobs": null,
                "finish_reason": finish_reason,
                "stop_reason": null,
            }),
        };
        let mut ids = None;
        if let Some(prompt) = &self.prompt_token_ids {
            let output: Vec<u32> = (self.resume_at..self.resume_at + usage.completion_tokens)
                .map(output_token_id)
                .collect();
            choice["token_ids"] = json!(output);
            match self.kind {
                ApiKind::Chat => ids = Some(json!(&prompt[..])),
                ApiKind::Completion => choice["prompt_token_ids"] = json!(&prompt[..]),
            }
        }
        let choices: Vec<Value> = (0..self.choices.max(1))
            .map(|index| {
                let mut choice = choice.clone();
                choice["index"] = json!(index);
                choice
            })
            .collect();
        let mut response = self.envelope(false, json!(choices));
        if let Some(ids) = ids {
            response["prompt_token_ids"] = ids;
        }
        response["usage"] = self.all_choices(usage).to_json();
        response["kv_transfer_params"] = kv_transfer_params.unwrap_or(Value::Null);
        response
    }

    /// The first chat chunk, announcing the assistant role (vLLM sends it before any text).
    pub(crate) fn role_chunk(&self) -> Value {
        let choice = json!({
            "index": 0,
            "delta": { "role": self.role, "content": "" },
            "logprobs": null,
            "finish_reason": null,
        });
        let mut chunk = self.envelope(true, json!([choice]));
        if let Some(prompt) = &self.prompt_token_ids {
            chunk["prompt_token_ids"] = json!(&prompt[..]);
        }
        chunk
    }

    /// A chunk carrying the text of the answer's token `index` (0-based).
    pub(crate) fn token_chunk(&self, index: u32, finish_reason: Option<&str>) -> Value {
        // A completion's echo comes with its first token (alone for `max_tokens: 0`).
        let echo = self
            .echo
            .as_ref()
            .filter(|_| index == 0 && self.kind == ApiKind::Completion);
        let text = match echo {
            Some(echo) if echo.alone => echo.text.to_string(),
            Some(echo) => format!("{}{}", echo.text, self.token_text(index)),
            None => self.token_text(index),
        };
        let mut choice = match self.kind {
            ApiKind::Chat => json!({
                "index": 0,
                "delta": { "content": text },
                "logprobs": null,
                "finish_reason": finish_reason,
            }),
            ApiKind::Completion => json!({
                "index": 0,
                "text": text,
                "logprobs": null,
                "finish_reason": finish_reason,
            }),
        };
        if let Some(ids) = echo.and_then(|echo| echo.prompt_ids.as_ref())
            && self.prompt_token_ids.is_none()
        {
            choice["prompt_token_ids"] = json!(&ids[..]);
        }
        if let Some(prompt) = &self.prompt_token_ids {
            choice["token_ids"] = json!([output_token_id(self.resume_at + index)]);
            if self.kind == ApiKind::Completion {
                choice["prompt_token_ids"] = if index == 0 {
                    json!(&prompt[..])
                } else {
                    Value::Null
                };
            }
        }
        self.envelope(true, json!([choice]))
    }

    /// The final chunk with `stream_options.include_usage`: no choices, the usage.
    pub(crate) fn usage_chunk(&self, usage: Usage) -> Value {
        let mut chunk = self.envelope(true, json!([]));
        chunk["usage"] = self.all_choices(usage).to_json();
        chunk
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokenizer::count_tokens;
    use http::StatusCode;

    #[test]
    fn output_words_are_one_token_each() {
        for count in [1, 2, 16, 100] {
            assert_eq!(count_tokens(&output_text(count)), count as usize);
        }
        assert_eq!(output_text(3), "lorem ipsum dolor");
    }

    #[test]
    fn parses_chat_completion_and_invocation_bodies() {
        let chat = parse_request(
            br#"{"model":"sim","messages":[{"role":"user","content":"the cat sat"}],"unknown":1}"#,
            Some(ApiKind::Chat),
            (16, 2048),
            None,
            |_| None,
        )
        .unwrap();
        assert_eq!(chat.kind, ApiKind::Chat);
        assert_eq!(chat.prompt.unwrap().tokens.len(), 5 + 3 + 6);

        let completion = parse_request(
            br#"{"prompt":["the cat", " sat"]}"#,
            None,
            (16, 2048),
            None,
            |_| None,
        )
        .unwrap();
        assert_eq!(completion.kind, ApiKind::Completion);
        assert_eq!(completion.prompt.unwrap().tokens.len(), 3);

        let ids =
            parse_request(br#"{"prompt":[1,2,3]}"#, None, (16, 2048), None, |_| None).unwrap();
        assert_eq!(ids.prompt.unwrap().tokens, vec![1, 2, 3]);

        let invocation = parse_request(
            br#"{"messages":[{"role":"user","content":"hi"}]}"#,
            None,
            (16, 2048),
            None,
            |_| None,
        )
        .unwrap();
        assert_eq!(invocation.kind, ApiKind::Chat);

        let missing = parse_request(
            br#"{"model":"sim"}"#,
            Some(ApiKind::Chat),
            (16, 2048),
            None,
            |_| None,
        )
        .unwrap();
        assert_eq!(missing.prompt.unwrap_err().param, Some("messages"));

        let bad = parse_request(b"{not json", None, (16, 2048), None, |_| None).unwrap_err();
        assert_eq!(bad.status, StatusCode::BAD_REQUEST);
        assert_eq!(bad.to_json()["error"]["type"], "BadRequestError");
        assert_eq!(bad.to_json()["error"]["code"], 400);
    }

    #[test]
    fn the_prompt_is_truncated_as_vllm_truncates_it() {
        // Read by its own request model (the body says which), as on the OpenAI paths.
        let tokens = |body: &str, max_model_len: u32| {
            let kind = if body.contains(r#""messages""#) {
                ApiKind::Chat
            } else {
                ApiKind::Completion
            };
            parse_request(
                body.as_bytes(),
                Some(kind),
                (16, max_model_len),
                None,
                |_| None,
            )
            .and_then(|parsed| parsed.prompt.map(|prompt| prompt.tokens))
        };
        let ids = "[1,2,3,4,5,6,7,8,9,10]";
        let served = |fields: &str| tokens(&format!(r#"{{"prompt":{ids}{fields}}}"#), 8);
        assert_eq!(served("").unwrap().len(), 10);
        // No side: the left, as vLLM sets a generating model's tokenizer.
        assert_eq!(
            served(r#","truncate_prompt_tokens":3"#).unwrap(),
            [8, 9, 10]
        );
        assert_eq!(
            served(r#","truncate_prompt_tokens":3,"truncation_side":"right""#).unwrap(),
            [1, 2, 3]
        );
        assert_eq!(
            served(r#","truncate_prompt_tokens":"3","truncation_side":"left""#).unwrap(),
            [8, 9, 10]
        );
        assert_eq!(
            served(r#","truncate_prompt_tokens":null,"truncation_side":"left""#)
                .unwrap()
                .len(),
            10
        );
        // -1: the context (8), less one when output is asked for (a completion's max_tokens
        // is 16 when not given).
        assert_eq!(
            served(r#","truncate_prompt_tokens":-1,"truncation_side":"left""#).unwrap(),
            [4, 5, 6, 7, 8, 9, 10]
        );
        assert_eq!(
            served(r#","truncate_prompt_tokens":-1,"max_tokens":0"#).unwrap(),
            [3, 4, 5, 6, 7, 8, 9, 10]
        );
        let empty = served(r#","truncate_prompt_tokens":0"#).unwrap_err();
        assert_eq!(empty.message, "The decoder prompt cannot be empty");
        assert_eq!(
            served(r#","truncate_prompt_tokens":-1,"max_tokens":2"#).unwrap(),
            [4, 5, 6, 7, 8, 9, 10]
        );
        let chat = r#"{"messages":[{"role":"user","content":"the cat sat on the mat"}],"max_completion_tokens":1,"truncate_prompt_tokens":4,"truncation_side":"left"}"#;
        let whole = tokens(&chat.replace(r#","truncate_prompt_tokens":4"#, ""), 64).unwrap();
        assert_eq!(tokens(chat, 64).unwrap(), whole[whole.len() - 4..]);
        for (fields, param) in [
            // The request model's refusals name `body.FIELD`; a truncation longer than the
            // context is vLLM's own.
            (
                r#","truncate_prompt_tokens":-2"#,
                "body.truncate_prompt_tokens",
            ),
            (
                r#","truncate_prompt_tokens":2.5"#,
                "body.truncate_prompt_tokens",
            ),
            (r#","truncate_prompt_tokens":9"#, "truncate_prompt_tokens"),
            (
                r#","truncate_prompt_tokens":[]"#,
                "body.truncate_prompt_tokens",
            ),
            (r#","truncation_side":"middle""#, "body.truncation_side"),
            (
                r#","truncate_prompt_tokens":2,"truncation_side":1"#,
                "body.truncation_side",
            ),
        ] {
            let err = served(fields).unwrap_err();
            assert_eq!(
                (err.status, err.param),
                (StatusCode::BAD_REQUEST, Some(param)),
                "{fields}: {}",
                err.message
            );
        }
    }

    #[test]
    fn reads_max_tokens_and_kv_transfer_params() {
        let body: InferenceBody = serde_json::from_str(
            r#"{"max_tokens":5,"max_completion_tokens":7,
                "kv_transfer_params":{"do_remote_prefill":true,"remote_block_ids":[[1,2,3]]}}"#,
        )
        .unwrap();
        assert_eq!(body.requested_max_tokens(ApiKind::Chat).unwrap(), Some(7));
        let kv = body.kv_transfer();
        assert!(kv.do_remote_prefill && !kv.do_remote_decode);
        assert_eq!(kv.remote_blocks, Some(3));

        let zero: InferenceBody = serde_json::from_str(r#"{"max_tokens":0}"#).unwrap();
        assert!(zero.requested_max_tokens(ApiKind::Chat).is_err());
    }

    #[test]
    fn reads_the_kv_cache_report_mode_and_refuses_other_xargs_shapes() {
        let mode = |json: &str| {
            serde_json::from_str::<InferenceBody>(json)
                .unwrap()
                .reports_reuse()
        };
        assert!(!mode("{}").unwrap());
        assert!(mode(r#"{"vllm_xargs":{"kv_cache_report_mode":"full"}}"#).unwrap());
        assert!(!mode(r#"{"vllm_xargs":{"kv_cache_report_mode":"incremental","x":1}}"#).unwrap());
        let bad = mode(r#"{"vllm_xargs":"full"}"#).unwrap_err();
        assert_eq!(bad.status, StatusCode::BAD_REQUEST);
        assert!(
            bad.to_json()["error"]["message"]
                .as_str()
                .unwrap()
                .contains("vllm_xargs")
        );
    }

    #[test]
    fn not_found_matches_vllm() {
        let error = ApiError::model_not_found("other").to_json();
        assert_eq!(
            error,
            json!({"error": {
                "message": "The model `other` does not exist.",
                "type": "NotFoundError",
                "param": "model",
                "code": 404
            }})
        );
    }
}
