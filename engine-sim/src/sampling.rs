//! What vLLM 0.32 refuses in a request's generation fields, and at which point, so that a
//! router tested against the simulator sees the 400s a real engine would send:
//!
//! - while the body is read (its request model, before the model name is looked up): the
//!   request model's own checks of the raw fields, in the order pydantic runs them (the last
//!   defined first), then each field's type in the model's field order, read as pydantic
//!   reads it (`"0.5"` is a number, `"x"` is not);
//! - once the prompt and the output budget are known (its sampling parameters): the ranges
//!   (`temperature` in [0, 2], `top_p` in (0, 1], `n` at least 1, ...), `min_tokens` within
//!   the budget, `logit_bias` keys that are token ids, and at most 20 logprobs.
//!
//! Each refusal carries vLLM's message and `param`. The checks were taken from vLLM 0.32's
//! request models and `SamplingParams`, and compared with the real engine on this machine
//! (`tests/tests/real_vllm.rs`, the simulator beside it).

use serde::Deserialize;
use serde::de::{IgnoredAny, MapAccess, Visitor};
use serde_json::Value;
use switchyard_tokenize::reuse;

use crate::reply::{ApiError, ApiKind};

/// vLLM's default `--max-logprobs`.
const MAX_LOGPROBS: i64 = 20;
/// vLLM's `VLLM_MAX_N_SEQUENCES` and `VLLM_MAX_STOP_STRINGS` defaults.
const MAX_N: i64 = 16384;
const MAX_STOP_STRINGS: usize = 4;
/// The `response_format` types vLLM's request model knows.
const RESPONSE_FORMATS: [&str; 4] = ["text", "json_object", "json_schema", "structural_tag"];
/// A temperature above 0 and below this is raised to it before the parameters are checked
/// (vLLM's `_MAX_TEMP`), so only 0 is greedy.
const LEAST_TEMPERATURE: f64 = 0.01;

/// The fields read, by name.
const NAMES: [&str; 28] = [
    "n",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_tokens",
    "logprobs",
    "top_logprobs",
    "prompt_logprobs",
    "logit_bias",
    "stop",
    "user",
    "seed",
    "tools",
    "tool_choice",
    "stream",
    "stream_options",
    "prompt",
    "max_tokens",
    "max_completion_tokens",
    "response_format",
    "suffix",
    "echo",
    "continue_final_message",
    "add_generation_prompt",
];

/// How pydantic reads a field's value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Type {
    Number,
    Integer,
    Boolean,
    Text,
    /// A string or at most [`MAX_STOP_STRINGS`] strings.
    Stop,
    /// An object of numbers.
    Bias,
    /// An object whose `type` is one of [`RESPONSE_FORMATS`].
    Format,
    /// One of these strings.
    OneOf(&'static [&'static str]),
    /// A list of [`RESPONSES_INCLUDES`].
    Includes,
    /// The Responses API's `input`: a string or a list of input items.
    Input,
    /// A number in [-2, 2] (the Responses request model's penalties).
    Penalty,
}

/// A field of a request model: its name, the `param` a value of the wrong type is refused
/// with, how it is read, and whether null is taken.
type Field = (&'static str, &'static str, Type, bool);

macro_rules! field {
    ($name:literal, $kind:ident, $nullable:literal) => {
        ($name, concat!("body.", $name), Type::$kind, $nullable)
    };
}

/// The chat request model's fields the simulator checks, in the model's order (pydantic names
/// the first wrong one).
const CHAT_FIELDS: [Field; 23] = [
    field!("frequency_penalty", Number, true),
    field!("logit_bias", Bias, true),
    field!("logprobs", Boolean, true),
    field!("top_logprobs", Integer, true),
    field!("max_tokens", Integer, true),
    field!("max_completion_tokens", Integer, true),
    field!("n", Integer, true),
    field!("presence_penalty", Number, true),
    field!("response_format", Format, true),
    field!("seed", Integer, true),
    field!("stop", Stop, true),
    field!("stream", Boolean, true),
    field!("temperature", Number, true),
    field!("top_p", Number, true),
    field!("user", Text, true),
    field!("top_k", Integer, true),
    field!("min_p", Number, true),
    field!("repetition_penalty", Number, true),
    field!("min_tokens", Integer, false),
    field!("prompt_logprobs", Integer, true),
    field!("echo", Boolean, false),
    field!("add_generation_prompt", Boolean, false),
    field!("continue_final_message", Boolean, false),
];

/// The completions request model's, likewise (it has no `max_completion_tokens` or
/// `top_logprobs`: those are ignored there, as vLLM ignores unknown fields).
const COMPLETION_FIELDS: [Field; 20] = [
    field!("echo", Boolean, true),
    field!("frequency_penalty", Number, true),
    field!("logit_bias", Bias, true),
    field!("logprobs", Integer, true),
    field!("max_tokens", Integer, true),
    field!("n", Integer, false),
    field!("presence_penalty", Number, true),
    field!("seed", Integer, true),
    field!("stop", Stop, true),
    field!("stream", Boolean, true),
    field!("suffix", Text, true),
    field!("temperature", Number, true),
    field!("top_p", Number, true),
    field!("user", Text, true),
    field!("top_k", Integer, true),
    field!("min_p", Number, true),
    field!("repetition_penalty", Number, true),
    field!("min_tokens", Integer, false),
    field!("prompt_logprobs", Integer, true),
    field!("response_format", Format, true),
];

/// The `include` values vLLM's Responses request model knows.
const RESPONSES_INCLUDES: [&str; 6] = [
    "code_interpreter_call.outputs",
    "computer_call_output.output.image_url",
    "file_search_call.results",
    "message.input_image.image_url",
    "message.output_text.logprobs",
    "reasoning.encrypted_content",
];
/// The `param` of a wrong `include` value, by its index (the eighth and later share one).
const RESPONSES_INCLUDE_PARAMS: [&str; 8] = [
    "body.include.0",
    "body.include.1",
    "body.include.2",
    "body.include.3",
    "body.include.4",
    "body.include.5",
    "body.include.6",
    "body.include",
];
/// The roles of a Responses input message.
const INPUT_ROLES: [&str; 4] = ["user", "assistant", "system", "developer"];

/// The Responses request model's fields the simulator checks, in the model's order.
const RESPONSES_FIELDS: [Field; 24] = [
    field!("background", Boolean, true),
    field!("include", Includes, true),
    field!("input", Input, false),
    field!("instructions", Text, true),
    field!("max_output_tokens", Integer, true),
    field!("max_tool_calls", Integer, true),
    field!("model", Text, true),
    field!("logit_bias", Bias, true),
    field!("parallel_tool_calls", Boolean, true),
    field!("previous_response_id", Text, true),
    (
        "service_tier",
        "body.service_tier",
        Type::OneOf(&["auto", "default", "flex", "scale", "priority"]),
        false,
    ),
    field!("store", Boolean, true),
    field!("stream", Boolean, true),
    field!("temperature", Number, true),
    field!("top_p", Number, true),
    field!("top_k", Integer, true),
    field!("min_p", Number, true),
    (
        "truncation",
        "body.truncation",
        Type::OneOf(&["auto", "disabled"]),
        true,
    ),
    field!("user", Text, true),
    field!("presence_penalty", Penalty, true),
    field!("frequency_penalty", Penalty, true),
    field!("repetition_penalty", Number, true),
    field!("seed", Integer, true),
    field!("stop", Stop, true),
];

/// What vLLM's Responses request model refuses while it reads a body (a JSON object): its own
/// checks of the raw fields (the last defined first: the tool choice, a prompt template, a
/// background response not stored), then each field's type, `input` required.
pub(crate) fn check_responses_request(
    body: &serde_json::Map<String, Value>,
) -> Result<(), ApiError> {
    let given = |name: &str| body.get(name).filter(|value| !value.is_null());
    let tools: Vec<&Value> = match given("tools") {
        Some(Value::Array(tools)) => tools.iter().collect(),
        _ => Vec::new(),
    };
    let choice = body.get("tool_choice");
    let named = choice
        .filter(|choice| {
            matches!(
                choice.get("type").and_then(Value::as_str),
                Some("function" | "custom")
            )
        })
        .map(|choice| choice.get("name").and_then(Value::as_str).unwrap_or(""));
    let not_found = || {
        refused(
            "Tool choice 'function' not found in 'tools' parameter.".to_owned(),
            Some("tool_choice"),
            None,
        )
    };
    if tools.is_empty() {
        if choice.and_then(Value::as_str) == Some("required") {
            return Err(refused(
                "Tool choice 'required' must be specified with 'tools' parameter.".to_owned(),
                Some("tool_choice"),
                None,
            ));
        }
        if named.is_some() {
            return Err(not_found());
        }
    } else if let Some(name) = named {
        let namespaced = tools
            .iter()
            .any(|tool| tool.get("type").and_then(Value::as_str) == Some("namespace"));
        let known = tools
            .iter()
            .any(|tool| tool.get("name").and_then(Value::as_str) == Some(name));
        if name.is_empty() || (!namespaced && !known) {
            return Err(not_found());
        }
    }
    if given("prompt").is_some() {
        return Err(refused(
            "prompt template is not supported".to_owned(),
            Some("prompt"),
            None,
        ));
    }
    // `not data.get("store", True)`: a null `store` is false here.
    if truthy(body.get("background")) && !body.get("store").is_none_or(|store| truthy(Some(store)))
    {
        return Err(refused(
            "background can only be used when `store` is true".to_owned(),
            Some("background"),
            None,
        ));
    }
    // `input` is the third field, and required.
    let (before, from_input) = RESPONSES_FIELDS.split_at(2);
    check_field_types(before, |name| body.get(name))?;
    if !body.contains_key("input") {
        return Err(ApiError::bad_request("input: Field required".to_owned()).param("body.input"));
    }
    check_field_types(from_input, |name| body.get(name))
}

/// An item of a Responses `input` list that vLLM's request model takes: a message in one of
/// [`INPUT_ROLES`] with string or list content, a function call or its output with their
/// fields, or an item of another type (taken as it is here).
fn input_item(item: &Value) -> bool {
    let Some(fields) = item.as_object() else {
        return false;
    };
    let text = |name: &str| fields.get(name).is_some_and(Value::is_string);
    match fields.get("type").and_then(Value::as_str) {
        None | Some("message") => {
            fields
                .get("role")
                .and_then(Value::as_str)
                .is_some_and(|role| INPUT_ROLES.contains(&role))
                && fields
                    .get("content")
                    .is_some_and(|content| content.is_string() || content.is_array())
        }
        Some("function_call_output") => {
            text("call_id")
                && fields
                    .get("output")
                    .is_some_and(|output| output.is_string() || output.is_array())
        }
        Some("function_call") => text("call_id") && text("name") && text("arguments"),
        Some(_) => true,
    }
}

/// The generation fields of a chat or completions body ([`NAMES`]), each as it came (the last
/// of a repeated key, as vLLM reads it; null as null). Read in a pass of its own over the body,
/// so that a repeated key is no error, as it is none for vLLM.
#[derive(Debug, Default)]
pub(crate) struct Generation {
    values: [Option<Value>; NAMES.len()],
}

impl<'de> Deserialize<'de> for Generation {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Fields;
        impl<'de> Visitor<'de> for Fields {
            type Value = Generation;

            fn expecting(&self, formatter: &mut std::fmt::Formatter) -> std::fmt::Result {
                formatter.write_str("a JSON object")
            }

            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Generation, A::Error> {
                let mut fields = Generation::default();
                while let Some(key) = map.next_key::<std::borrow::Cow<'de, str>>()? {
                    match NAMES.iter().position(|name| *name == key) {
                        Some(index) => fields.values[index] = Some(map.next_value()?),
                        None => {
                            map.next_value::<IgnoredAny>()?;
                        }
                    }
                }
                Ok(fields)
            }
        }
        deserializer.deserialize_map(Fields)
    }
}

impl Generation {
    /// The fields of a body already known to be a JSON object.
    pub(crate) fn read(bytes: &[u8]) -> Result<Self, ApiError> {
        serde_json::from_slice(bytes)
            .map_err(|err| ApiError::bad_request(format!("invalid JSON body: {err}")))
    }

    /// The sampling fields of a Responses body (a JSON object), as its request model hands
    /// them to `SamplingParams`: `top_logprobs` counts only when `include` asks for the
    /// output's logprobs; the chat-only fields (`n`, `min_tokens`, prompt logprobs) are not
    /// its fields.
    pub(crate) fn of_responses(body: &serde_json::Map<String, Value>) -> Self {
        const TAKEN: [&str; 10] = [
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
            "logit_bias",
            "stop",
            "top_logprobs",
        ];
        let mut fields = Generation::default();
        for (index, name) in NAMES.iter().enumerate() {
            if TAKEN.contains(name) {
                fields.values[index] = body.get(*name).cloned();
            }
        }
        // `stop` only if truthy: an empty string or list is no stop string there.
        if !truthy(body.get("stop"))
            && let Some(index) = NAMES.iter().position(|name| *name == "stop")
        {
            fields.values[index] = None;
        }
        let logprobs = body
            .get("include")
            .and_then(Value::as_array)
            .is_some_and(|items| {
                items
                    .iter()
                    .any(|item| item == "message.output_text.logprobs")
            });
        if let Some(index) = NAMES.iter().position(|name| *name == "logprobs") {
            fields.values[index] = Some(Value::Bool(logprobs));
        }
        fields
    }

    /// The field as it came (null too).
    fn raw(&self, name: &str) -> Option<&Value> {
        let index = NAMES.iter().position(|known| *known == name)?;
        self.values[index].as_ref()
    }

    /// The field unless absent or null.
    fn given(&self, name: &str) -> Option<&Value> {
        self.raw(name).filter(|value| !value.is_null())
    }

    /// What vLLM's request model refuses while it reads the body: its own checks of the raw
    /// fields, in the order pydantic runs them, then each field's type.
    pub(crate) fn check_request(&self, kind: ApiKind) -> Result<(), ApiError> {
        match kind {
            ApiKind::Chat => {
                // On the values as given: a string "false" is true here.
                if truthy(self.raw("continue_final_message"))
                    && truthy(self.raw("add_generation_prompt"))
                {
                    // Raised past the request model's validation (so `/invocations` answers
                    // with it rather than trying a completion).
                    return Err(refused(
                        "Cannot set both `continue_final_message` and `add_generation_prompt` \
                         to True."
                            .to_owned(),
                        None,
                        None,
                    ));
                }
                self.check_tools()?;
                self.check_logprob_fields(kind)?;
                self.check_stream_options()?;
                self.check_response_format()?;
            }
            ApiKind::Completion => {
                let prompt = self.given("prompt");
                if prompt.is_none() || prompt.and_then(Value::as_str) == Some("") {
                    return Err(refused(
                        "Either prompt or prompt_embeds must be provided and non-empty.".to_owned(),
                        Some("prompt"),
                        None,
                    ));
                }
                self.check_stream_options()?;
                self.check_logprob_fields(kind)?;
                self.check_response_format()?;
            }
        }
        self.check_types(kind)
    }

    fn check_stream_options(&self) -> Result<(), ApiError> {
        if truthy(self.raw("stream_options")) && !truthy(self.raw("stream")) {
            return Err(refused(
                "Stream options can only be defined when `stream=True`.".to_owned(),
                Some("stream_options"),
                None,
            ));
        }
        Ok(())
    }

    fn check_response_format(&self) -> Result<(), ApiError> {
        let Some(format) = self.given("response_format") else {
            return Ok(());
        };
        if format.get("type").and_then(Value::as_str) == Some("json_schema")
            && format.get("json_schema").is_none_or(Value::is_null)
        {
            return Err(refused(
                "When response_format type is 'json_schema', the 'json_schema' field must be \
                 provided."
                    .to_owned(),
                Some("response_format"),
                None,
            ));
        }
        Ok(())
    }

    /// The request model's checks of the logprob fields, on the raw values (a boolean is a
    /// number there, as in Python).
    fn check_logprob_fields(&self, kind: ApiKind) -> Result<(), ApiError> {
        let names = match kind {
            ApiKind::Chat => ["prompt_logprobs", "top_logprobs"],
            ApiKind::Completion => ["prompt_logprobs", "logprobs"],
        };
        for name in names {
            if let Some(value) = self.given(name)
                && python_number(value).is_none()
            {
                return Err(refused(
                    format!("`{name}` must be an integer."),
                    Some(name),
                    Some(python_repr(value)),
                ));
            }
        }
        if let Some(prompt_logprobs) = self.given("prompt_logprobs").and_then(python_number) {
            if truthy(self.raw("stream")) && (prompt_logprobs > 0.0 || prompt_logprobs == -1.0) {
                return Err(refused(
                    "`prompt_logprobs` are not available when `stream=True`.".to_owned(),
                    Some("prompt_logprobs"),
                    None,
                ));
            }
            if prompt_logprobs < 0.0 && prompt_logprobs != -1.0 {
                return Err(refused(
                    "`prompt_logprobs` must be a positive value or -1.".to_owned(),
                    Some("prompt_logprobs"),
                    self.given("prompt_logprobs").map(python_repr),
                ));
            }
        }
        let (name, count) = match kind {
            ApiKind::Chat => ("top_logprobs", self.given("top_logprobs")),
            ApiKind::Completion => ("logprobs", self.given("logprobs")),
        };
        if let Some(count) = count.and_then(python_number) {
            if count < 0.0 && count != -1.0 {
                return Err(refused(
                    format!("`{name}` must be a positive value or -1."),
                    Some(name),
                    self.given(name).map(python_repr),
                ));
            }
            if kind == ApiKind::Chat
                && (count == -1.0 || count > 0.0)
                && !truthy(self.raw("logprobs"))
            {
                return Err(refused(
                    "when using `top_logprobs`, `logprobs` must be set to true.".to_owned(),
                    Some("top_logprobs"),
                    None,
                ));
            }
        }
        Ok(())
    }

    /// A chat's `tools` and `tool_choice` as vLLM's request model checks them.
    fn check_tools(&self) -> Result<(), ApiError> {
        let tools = self.given("tools");
        if matches!(tools, Some(Value::Array(tools)) if tools.is_empty()) {
            return Err(refused(
                "`tools` must not be an empty array. Either provide at least one tool or omit \
                 the field entirely."
                    .to_owned(),
                Some("tools"),
                None,
            ));
        }
        let Some(choice) = self.given("tool_choice").filter(|choice| *choice != "none") else {
            return Ok(());
        };
        let Some(tools) = tools else {
            return Err(refused(
                "When using `tool_choice`, `tools` must be set.".to_owned(),
                Some("tool_choice"),
                None,
            ));
        };
        let usage = r#"Correct usage: `{"type": "function", "function": {"name": "my_function"}}`"#;
        match choice {
            Value::String(choice) if choice == "auto" || choice == "required" => Ok(()),
            Value::Object(choice) => {
                let Some(function) = choice.get("function").and_then(Value::as_object) else {
                    let shown = choice
                        .get("function")
                        .map_or("None".to_owned(), python_repr);
                    return Err(refused(
                        format!(
                            "Invalid value for `function`: `{shown}` in `tool_choice`! {usage}"
                        ),
                        Some("tool_choice.function"),
                        None,
                    ));
                };
                let Some(name) = function.get("name") else {
                    return Err(refused(
                        format!("Expected field `name` in `function` in `tool_choice`! {usage}"),
                        Some("tool_choice.function.name"),
                        None,
                    ));
                };
                if name.as_str().is_none_or(str::is_empty) {
                    return Err(refused(
                        format!(
                            "Invalid `name` in `function`: `{}` in `tool_choice`! {usage}",
                            python_repr(name)
                        ),
                        Some("tool_choice.function.name"),
                        None,
                    ));
                }
                let named = tools.as_array().is_some_and(|tools| {
                    tools
                        .iter()
                        .any(|tool| tool.get("function").and_then(|f| f.get("name")) == Some(name))
                });
                if named {
                    Ok(())
                } else {
                    Err(refused(
                        "The tool specified in `tool_choice` does not match any of the \
                         specified `tools`"
                            .to_owned(),
                        Some("tool_choice"),
                        None,
                    ))
                }
            }
            other => Err(refused(
                format!(
                    "Invalid value for `tool_choice`: {}! Only named tools, \"none\", \"auto\" \
                     or \"required\" are supported.",
                    python_repr(other)
                ),
                Some("tool_choice"),
                None,
            )),
        }
    }

    /// Each field's type as pydantic reads it, in the request model's field order: a 400
    /// naming `body.FIELD`.
    fn check_types(&self, kind: ApiKind) -> Result<(), ApiError> {
        let fields: &[Field] = match kind {
            ApiKind::Chat => &CHAT_FIELDS,
            ApiKind::Completion => &COMPLETION_FIELDS,
        };
        check_field_types(fields, |name| self.raw(name))
    }
    /// What a completion's `echo` with `prompt_logprobs` makes of the prefix cache: whether
    /// vLLM skips reading it for this request (it does whenever prompt logprobs are asked for,
    /// and `echo` asks for them: a chat's `top_logprobs`, 0 by default, a completion's
    /// `logprobs` when given).
    pub(crate) fn skips_prefix_cache(&self, kind: ApiKind) -> bool {
        if self.given("prompt_logprobs").is_some() {
            return true;
        }
        let echo = self.given("echo").and_then(reuse::lax_bool) == Some(true);
        match kind {
            ApiKind::Chat => echo,
            ApiKind::Completion => echo && self.given("logprobs").is_some(),
        }
    }

    /// `n`, the choices asked for (1 when not given; the sampling checks keep it in range).
    pub(crate) fn n(&self) -> u32 {
        self.given("n")
            .and_then(reuse::lax_integer)
            .map_or(1, |n| u32::try_from(n.max(1)).unwrap_or(1))
    }

    /// `min_tokens`, at least 0 (what the simulator generates at the least).
    pub(crate) fn min_tokens(&self) -> u32 {
        self.given("min_tokens")
            .and_then(reuse::lax_integer)
            .map_or(0, |min| u32::try_from(min.max(0)).unwrap_or(u32::MAX))
    }

    /// What vLLM's sampling parameters refuse, once the output budget `max_tokens` (as vLLM
    /// computes it: what was asked within the context, or the context left; it may be 0 or
    /// less here) is known, in vLLM's order; `vocabulary`: the model's vocabulary size (what a
    /// logprobs count of -1 asks for, and the bound of a `logit_bias` id).
    pub(crate) fn check_sampling(
        &self,
        kind: ApiKind,
        max_tokens: i64,
        vocabulary: u64,
    ) -> Result<(), ApiError> {
        let float =
            |name: &str, default: f64| self.given(name).and_then(lax_float).unwrap_or(default);
        let integer = |name: &str, default: i64| {
            self.given(name)
                .and_then(reuse::lax_integer)
                .unwrap_or(default)
        };
        // `logit_bias` is converted before the parameters are checked.
        if let Some(Value::Object(biases)) = self.given("logit_bias") {
            let invalid: Vec<&str> = biases
                .keys()
                .map(String::as_str)
                .filter(|key| reuse::python_int(key).is_none())
                .collect();
            if !invalid.is_empty() {
                let listed = format!(
                    "[{}]",
                    invalid
                        .iter()
                        .map(|key| python_str_repr(key))
                        .collect::<Vec<_>>()
                        .join(", ")
                );
                return Err(refused(
                    format!(
                        "logit_bias contains key(s) that cannot be converted to integer token \
                         IDs: {listed}"
                    ),
                    Some("logit_bias"),
                    Some(listed),
                ));
            }
        }
        let plain = |message: String| Err(refused(message, None, None));
        let n = integer("n", 1);
        if n < 1 {
            return plain(format!("n must be at least 1, got {n}."));
        }
        if n > MAX_N {
            return plain(format!(
                "n must be at most {MAX_N}, got {n}. To increase this limit, set the \
                 VLLM_MAX_N_SEQUENCES environment variable."
            ));
        }
        for name in ["presence_penalty", "frequency_penalty"] {
            let penalty = float(name, 0.0);
            if !(-2.0..=2.0).contains(&penalty) {
                return plain(format!(
                    "{name} must be in [-2, 2], got {}.",
                    python_float(penalty)
                ));
            }
        }
        let repetition = float("repetition_penalty", 1.0);
        if !repetition.is_finite() {
            return plain(format!(
                "repetition_penalty must be a finite number, got {}.",
                python_float(repetition)
            ));
        }
        if repetition <= 0.0 {
            return plain(format!(
                "repetition_penalty must be greater than zero, got {}.",
                python_float(repetition)
            ));
        }
        let mut temperature = float("temperature", 1.0);
        if temperature > 0.0 && temperature < LEAST_TEMPERATURE {
            temperature = LEAST_TEMPERATURE;
        }
        let shown = python_float(temperature);
        let bad_temperature = if !temperature.is_finite() {
            Some(format!("temperature must be a finite number, got {shown}."))
        } else if temperature < 0.0 {
            Some(format!("temperature must be non-negative, got {shown}."))
        } else if temperature > 2.0 {
            Some(format!("temperature must be in [0, 2], got {shown}."))
        } else {
            None
        };
        if let Some(message) = bad_temperature {
            return Err(refused(message, Some("temperature"), Some(shown)));
        }
        let top_p = float("top_p", 1.0);
        if !(top_p > 0.0 && top_p <= 1.0) {
            let shown = python_float(top_p);
            return Err(refused(
                format!("top_p must be in (0, 1], got {shown}."),
                Some("top_p"),
                Some(shown),
            ));
        }
        let top_k = integer("top_k", 0);
        if top_k < -1 {
            return plain(format!(
                "top_k must be 0 (disable), or at least 1, got {top_k}."
            ));
        }
        let min_p = float("min_p", 0.0);
        if !(0.0..=1.0).contains(&min_p) {
            return plain(format!(
                "min_p must be in [0, 1], got {}.",
                python_float(min_p)
            ));
        }
        if max_tokens < 1 {
            return Err(refused(
                format!("max_tokens must be at least 1, got {max_tokens}."),
                Some("max_tokens"),
                Some(max_tokens.to_string()),
            ));
        }
        let min_tokens = integer("min_tokens", 0);
        if min_tokens < 0 {
            return plain(format!(
                "min_tokens must be greater than or equal to 0, got {min_tokens}."
            ));
        }
        if min_tokens > max_tokens {
            return plain(format!(
                "min_tokens must be less than or equal to max_tokens={max_tokens}, got \
                 {min_tokens}."
            ));
        }
        let empty_stop = match self.given("stop") {
            Some(Value::String(stop)) => stop.is_empty(),
            Some(Value::Array(stops)) => stops.iter().any(|stop| stop == ""),
            _ => false,
        };
        if empty_stop {
            return plain("stop cannot contain an empty string.".to_owned());
        }
        if temperature == 0.0 && n > 1 {
            return plain(format!("n must be 1 when using greedy sampling, got {n}."));
        }
        // The sampled logprobs asked for: a chat's `top_logprobs` when `logprobs` is on, a
        // completion's `logprobs`; -1 is the whole vocabulary.
        let sampled = match kind {
            ApiKind::Chat => truthy(self.raw("logprobs"))
                .then(|| integer("top_logprobs", 0))
                .filter(|&count| count != 0),
            ApiKind::Completion => self
                .given("logprobs")
                .and_then(reuse::lax_integer)
                .filter(|&count| count != 0),
        };
        let whole = |count: i64| {
            if count == -1 {
                i64::try_from(vocabulary).unwrap_or(i64::MAX)
            } else {
                count
            }
        };
        if let Some(count) = sampled.map(whole)
            && count > MAX_LOGPROBS
        {
            return Err(refused(
                format!(
                    "Requested sample logprobs of {count}, which is greater than max allowed: \
                     {MAX_LOGPROBS}"
                ),
                Some("logprobs"),
                Some(count.to_string()),
            ));
        }
        if let Some(count) = self
            .given("prompt_logprobs")
            .and_then(reuse::lax_integer)
            .filter(|&count| count != 0)
            .map(whole)
            && count > MAX_LOGPROBS
        {
            return Err(refused(
                format!(
                    "Requested prompt logprobs of {count}, which is greater than max allowed: \
                     {MAX_LOGPROBS}"
                ),
                Some("prompt_logprobs"),
                Some(count.to_string()),
            ));
        }
        // A bias's token id must be in the vocabulary.
        if let Some(Value::Object(biases)) = self.given("logit_bias") {
            let outside: Vec<String> = biases
                .keys()
                .filter_map(|key| reuse::python_int(key))
                .filter(|&id| id < 0 || id >= i128::from(vocabulary))
                .map(|id| id.to_string())
                .collect();
            if !outside.is_empty() {
                let listed = format!("[{}]", outside.join(", "));
                return Err(refused(
                    format!(
                        "token_id(s) {listed} in logit_bias contain out-of-vocab token ids. \
                         Vocabulary size: {vocabulary}"
                    ),
                    Some("logit_bias"),
                    Some(listed),
                ));
            }
        }
        Ok(())
    }

    /// What vLLM's renderer refuses once the model is known: a completion's `suffix` (the
    /// simulated model has no fill-in-the-middle rendering).
    pub(crate) fn check_rendering(&self, kind: ApiKind) -> Result<(), ApiError> {
        if kind == ApiKind::Completion && self.given("suffix").is_some() {
            return Err(ApiError::bad_request(
                "suffix is only supported for models with FIM completion rendering".to_owned(),
            )
            .param("suffix"));
        }
        Ok(())
    }
}

/// Each field's type as pydantic reads it, in the model's field order (`raw` gives a field as
/// it came): a 400 naming `body.FIELD`.
fn check_field_types<'a>(
    fields: &[Field],
    raw: impl Fn(&str) -> Option<&'a Value>,
) -> Result<(), ApiError> {
    for &(name, param, kind, nullable) in fields {
        let Some(value) = raw(name) else {
            continue;
        };

        let what = match (value, kind) {
            (Value::Null, _) if nullable => continue,
            (Value::Null, _) => "a value, not null",
            (value, Type::Number) if lax_float(value).is_some() => continue,
            (_, Type::Number) => "a valid number",
            (value, Type::Integer) if reuse::lax_integer(value).is_some() => continue,
            (_, Type::Integer) => "a valid integer",
            (value, Type::Boolean) if reuse::lax_bool(value).is_some() => continue,
            (_, Type::Boolean) => "a valid boolean",
            (Value::String(_), Type::Text | Type::Stop) => continue,
            (_, Type::Text) => "a valid string",
            (Value::Array(stops), Type::Stop)
                if stops.len() <= MAX_STOP_STRINGS && stops.iter().all(Value::is_string) =>
            {
                continue;
            }
            (_, Type::Stop) => "a valid string or a list of at most 4 strings",
            (Value::Object(biases), Type::Bias)
                if biases.values().all(|bias| lax_float(bias).is_some()) =>
            {
                continue;
            }
            (_, Type::Bias) => "a valid dictionary of numbers",
            (format, Type::Format)
                if format
                    .get("type")
                    .and_then(Value::as_str)
                    .is_some_and(|kind| RESPONSE_FORMATS.contains(&kind)) =>
            {
                continue;
            }
            (_, Type::Format) => {
                return Err(ApiError::bad_request(
                    "response_format.type: Input should be 'text', 'json_object', \
                         'json_schema' or 'structural_tag'"
                        .to_owned(),
                )
                .param("body.response_format.type"));
            }
            (Value::String(text), Type::OneOf(allowed)) if allowed.contains(&text.as_str()) => {
                continue;
            }
            (_, Type::OneOf(allowed)) => {
                let listed: Vec<String> =
                    allowed.iter().map(|choice| format!("'{choice}'")).collect();
                return Err(ApiError::bad_request(format!(
                    "{name}: Input should be {}",
                    listed.join(" or ")
                ))
                .param(param));
            }
            (Value::Array(items), Type::Includes) => {
                match items.iter().position(|item| {
                    !item
                        .as_str()
                        .is_some_and(|item| RESPONSES_INCLUDES.contains(&item))
                }) {
                    None => continue,
                    Some(index) => {
                        return Err(ApiError::bad_request(format!(
                            "include.{index}: Input should be one of the include values"
                        ))
                        .param(RESPONSES_INCLUDE_PARAMS[index.min(7)]));
                    }
                }
            }
            (_, Type::Includes) => "a valid list",
            (value, Type::Penalty)
                if lax_float(value).is_some_and(|penalty| (-2.0..=2.0).contains(&penalty)) =>
            {
                continue;
            }
            (value, Type::Penalty) if lax_float(value).is_some() => {
                "less than or equal to 2 and greater than or equal to -2"
            }
            (_, Type::Penalty) => "a valid number",
            (Value::String(_), Type::Input) => continue,
            (Value::Array(items), Type::Input) if items.iter().all(input_item) => continue,
            (_, Type::Input) => "a valid string or a list of input items",
        };
        return Err(ApiError::bad_request(format!("{name}: Input should be {what}")).param(param));
    }
    Ok(())
}

/// vLLM's `VLLMValidationError`: its message, then the parameter and the value it names.
pub(crate) fn refused(
    message: String,
    parameter: Option<&'static str>,
    value: Option<String>,
) -> ApiError {
    let extras: Vec<String> = parameter
        .map(|parameter| format!("parameter={parameter}"))
        .into_iter()
        .chain(value.map(|value| format!("value={value}")))
        .collect();
    let message = if extras.is_empty() {
        message
    } else {
        format!("{message} ({})", extras.join(", "))
    };
    let mut error = ApiError::bad_request(message);
    error.raised = true;
    match parameter {
        Some(parameter) => error.param(parameter),
        None => error,
    }
}

/// Python's truthiness of a JSON value (absent and null are false).
fn truthy(value: Option<&Value>) -> bool {
    match value {
        None | Some(Value::Null) => false,
        Some(Value::Bool(value)) => *value,
        Some(Value::Number(number)) => number.as_f64().is_some_and(|value| value != 0.0),
        Some(Value::String(text)) => !text.is_empty(),
        Some(Value::Array(items)) => !items.is_empty(),
        Some(Value::Object(fields)) => !fields.is_empty(),
    }
}

/// A raw value that Python's `isinstance(value, (int, float))` accepts (a boolean too), as a
/// number.
fn python_number(value: &Value) -> Option<f64> {
    match value {
        Value::Bool(value) => Some(f64::from(u8::from(*value))),
        Value::Number(number) => number.as_f64(),
        _ => None,
    }
}

/// A raw value as Python prints it (for the `value=` of an error).
fn python_repr(value: &Value) -> String {
    match value {
        Value::Null => "None".to_owned(),
        Value::Bool(true) => "True".to_owned(),
        Value::Bool(false) => "False".to_owned(),
        Value::String(text) => text.clone(),
        other => other.to_string(),
    }
}

/// A float as Python's `repr` writes it: `-1.0`, `0.5`, `nan`, `inf`, `1e+20`, `1e-07`.
fn python_float(value: f64) -> String {
    if value.is_nan() {
        return "nan".to_owned();
    }
    if value.is_infinite() {
        return if value > 0.0 { "inf" } else { "-inf" }.to_owned();
    }
    let magnitude = value.abs();
    if magnitude != 0.0 && !(1e-4..1e16).contains(&magnitude) {
        // Python's repr switches to exponent notation outside [1e-4, 1e16): a signed,
        // two-digit-at-least exponent.
        let text = format!("{value:e}");
        let (mantissa, exponent) = text.split_once('e').unwrap_or((&text, "0"));
        let (sign, digits) = match exponent.strip_prefix('-') {
            Some(digits) => ('-', digits),
            None => ('+', exponent),
        };
        return format!("{mantissa}e{sign}{digits:0>2}");
    }
    format!("{value:?}")
}

/// A string as Python's `repr` writes it (single quotes unless it holds one).
fn python_str_repr(text: &str) -> String {
    if text.contains('\'') && !text.contains('"') {
        format!("\"{text}\"")
    } else {
        format!("'{}'", text.replace('\\', "\\\\").replace('\'', "\\'"))
    }
}

/// A number field read as pydantic reads a float: a number, a boolean, or a string that
/// parses as one (with `_` between digits, as Python's `float` reads it).
fn lax_float(value: &Value) -> Option<f64> {
    match value {
        Value::Bool(value) => Some(f64::from(u8::from(*value))),
        Value::Number(number) => number.as_f64(),
        Value::String(text) => {
            let text = text.trim();
            if text.contains('_') {
                let bytes = text.as_bytes();
                let between_digits = bytes.iter().enumerate().all(|(index, &byte)| {
                    byte != b'_'
                        || (index > 0
                            && index + 1 < bytes.len()
                            && bytes[index - 1].is_ascii_digit()
                            && bytes[index + 1].is_ascii_digit())
                });
                if !between_digits {
                    return None;
                }
                return text.replace('_', "").parse().ok();
            }
            text.parse().ok()
        }
        Value::Null | Value::Array(_) | Value::Object(_) => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn generation(body: Value) -> Generation {
        Generation::read(body.to_string().as_bytes()).unwrap()
    }

    fn sampling(body: Value) -> Result<(), ApiError> {
        generation(body).check_sampling(ApiKind::Chat, 3, 49152)
    }

    #[test]
    fn a_repeated_key_keeps_its_last_value() {
        let fields = generation(json!({"n": 1}));
        assert_eq!(fields.raw("n"), Some(&json!(1)));
        let fields = Generation::read(br#"{"n": 0, "n": 2, "messages": []}"#).unwrap();
        assert_eq!(fields.raw("n"), Some(&json!(2)));
    }

    #[test]
    fn ranges_are_refused_with_vllms_messages() {
        let cases = [
            (json!({"n": 0}), "n must be at least 1, got 0.", None),
            (
                json!({"temperature": -1}),
                "temperature must be non-negative, got -1.0. (parameter=temperature, value=-1.0)",
                Some("temperature"),
            ),
            (
                json!({"temperature": 3}),
                "temperature must be in [0, 2], got 3.0. (parameter=temperature, value=3.0)",
                Some("temperature"),
            ),
            (
                json!({"top_p": 0}),
                "top_p must be in (0, 1], got 0.0. (parameter=top_p, value=0.0)",
                Some("top_p"),
            ),
            (
                json!({"top_k": -2}),
                "top_k must be 0 (disable), or at least 1, got -2.",
                None,
            ),
            (
                json!({"min_p": 2}),
                "min_p must be in [0, 1], got 2.0.",
                None,
            ),
            (
                json!({"presence_penalty": 3}),
                "presence_penalty must be in [-2, 2], got 3.0.",
                None,
            ),
            (
                json!({"repetition_penalty": 0}),
                "repetition_penalty must be greater than zero, got 0.0.",
                None,
            ),
            (
                json!({"min_tokens": 5}),
                "min_tokens must be less than or equal to max_tokens=3, got 5.",
                None,
            ),
            (
                json!({"logprobs": true, "top_logprobs": -1}),
                "Requested sample logprobs of 49152, which is greater than max allowed: 20 \
                 (parameter=logprobs, value=49152)",
                Some("logprobs"),
            ),
            (
                json!({"logit_bias": {"x": 1}}),
                "logit_bias contains key(s) that cannot be converted to integer token IDs: \
                 ['x'] (parameter=logit_bias, value=['x'])",
                Some("logit_bias"),
            ),
            (
                json!({"temperature": 0, "n": 2}),
                "n must be 1 when using greedy sampling, got 2.",
                None,
            ),
        ];
        for (body, message, param) in cases {
            let error = sampling(body.clone()).unwrap_err();
            assert_eq!(
                (error.message.as_str(), error.param),
                (message, param),
                "{body}"
            );
        }
        for body in [
            json!({"n": 2, "temperature": "0.5", "top_p": 1, "top_k": -1, "min_tokens": 3}),
            json!({"logprobs": true, "top_logprobs": 20, "logit_bias": {"5": 1, " 7 ": -1}}),
            json!({"top_logprobs": 30}),
            json!({"presence_penalty": -2, "frequency_penalty": 2, "min_p": 1}),
        ] {
            assert_eq!(sampling(body.clone()), Ok(()), "{body}");
        }
        let completion =
            |body: Value| generation(body).check_sampling(ApiKind::Completion, 3, 49152);
        assert_eq!(completion(json!({"logprobs": 20})), Ok(()));
        assert_eq!(
            completion(json!({"logprobs": 30})).unwrap_err().param,
            Some("logprobs")
        );
        assert_eq!(
            completion(json!({"prompt_logprobs": -1}))
                .unwrap_err()
                .param,
            Some("prompt_logprobs")
        );
    }

    #[test]
    fn what_vllm_adjusts_or_ignores_is_taken() {
        // A temperature below 0.01 is raised to it: not greedy, so n may be 2.
        assert_eq!(sampling(json!({"temperature": 1e-6, "n": 2})), Ok(()));
        assert!(sampling(json!({"temperature": 0, "n": 2})).is_err());
        // A completion has no `max_completion_tokens` or `top_logprobs`: not read.
        let completion = |body: Value| generation(body).check_request(ApiKind::Completion);
        assert_eq!(
            completion(json!({"prompt": "a", "max_completion_tokens": "x", "top_logprobs": "x"})),
            Ok(())
        );
        // Python's float reads `_` between digits.
        assert_eq!(lax_float(&json!("0.2_5")), Some(0.25));
        assert_eq!(lax_float(&json!("0._25")), None);
        assert_eq!(lax_float(&json!("1__0")), None);
    }

    #[test]
    fn numbers_are_written_as_python_writes_them() {
        for (value, written) in [
            (-1.0, "-1.0"),
            (0.5, "0.5"),
            (f64::NAN, "nan"),
            (f64::NEG_INFINITY, "-inf"),
            (1e20, "1e+20"),
            (-1e-7, "-1e-07"),
            (1.5e-5, "1.5e-05"),
            (12345.0, "12345.0"),
        ] {
            assert_eq!(python_float(value), written);
        }
    }

    #[test]
    fn tools_and_formats_are_checked_as_vllm_checks_them() {
        let chat = |body: Value| generation(body).check_request(ApiKind::Chat);
        let tools = json!([{"type": "function", "function": {"name": "f", "parameters": {}}}]);
        let with_choice =
            |choice: Value| chat(json!({"tools": tools.clone(), "tool_choice": choice}));
        assert_eq!(with_choice(json!("auto")), Ok(()));
        assert_eq!(
            with_choice(json!({"type": "function", "function": {"name": "f"}})),
            Ok(())
        );
        for (choice, param) in [
            (json!("bogus"), "tool_choice"),
            (
                json!({"type": "function", "function": {"name": "g"}}),
                "tool_choice",
            ),
            (json!({"type": "function"}), "tool_choice.function"),
            (
                json!({"type": "function", "function": {}}),
                "tool_choice.function.name",
            ),
            (
                json!({"type": "function", "function": {"name": ""}}),
                "tool_choice.function.name",
            ),
        ] {
            assert_eq!(
                with_choice(choice.clone()).unwrap_err().param,
                Some(param),
                "{choice}"
            );
        }
        let error = chat(json!({"response_format": {"type": "json_schema"}})).unwrap_err();
        assert_eq!(error.param, Some("response_format"));
        assert_eq!(
            chat(json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}})),
            Ok(())
        );
        // Out of the vocabulary, a bias's id is refused once the parameters are known.
        let error = sampling(json!({"logit_bias": {"-5": 1, "49152": 2, "7": 1}})).unwrap_err();
        assert_eq!(
            error.message,
            "token_id(s) [-5, 49152] in logit_bias contain out-of-vocab token ids. Vocabulary \
             size: 49152 (parameter=logit_bias, value=[-5, 49152])"
        );
    }

    #[test]
    fn pydantic_runs_the_request_models_checks_last_defined_first() {
        let chat = |body: Value| generation(body).check_request(ApiKind::Chat);
        let all = json!({"tools": [], "top_logprobs": 3, "stream_options": {"include_usage": true},
                         "continue_final_message": "false", "add_generation_prompt": true});
        // Both flags as given (a non-empty string is true), then tools, logprobs, options.
        assert_eq!(chat(all.clone()).unwrap_err().param, None);
        let mut body = all;
        body["continue_final_message"] = json!(false);
        assert_eq!(chat(body.clone()).unwrap_err().param, Some("tools"));
        body["tools"] = Value::Null;
        assert_eq!(chat(body.clone()).unwrap_err().param, Some("top_logprobs"));
        body["top_logprobs"] = json!(0);
        assert_eq!(chat(body).unwrap_err().param, Some("stream_options"));
        let completion = |body: Value| generation(body).check_request(ApiKind::Completion);
        let all = json!({"prompt": "", "stream_options": {"include_usage": true}, "logprobs": -2});
        assert_eq!(completion(all.clone()).unwrap_err().param, Some("prompt"));
        let mut body = all;
        body["prompt"] = json!("a");
        assert_eq!(
            completion(body.clone()).unwrap_err().param,
            Some("stream_options")
        );
        body["stream"] = json!(true);
        assert_eq!(completion(body).unwrap_err().param, Some("logprobs"));
        // Types in the model's field order: `n` comes before `temperature`.
        let error = chat(json!({"temperature": "x", "n": "x"})).unwrap_err();
        assert_eq!(error.param, Some("body.n"));
        // Within the sampling parameters, a temperature before a budget below 1.
        let error = generation(json!({"temperature": -1}))
            .check_sampling(ApiKind::Chat, 0, 49152)
            .unwrap_err();
        assert_eq!(error.param, Some("temperature"));
    }

    #[test]
    fn the_request_models_checks_come_first() {
        let chat = |body: Value| generation(body).check_request(ApiKind::Chat);
        let completion = |body: Value| generation(body).check_request(ApiKind::Completion);
        let param = |result: Result<(), ApiError>| result.unwrap_err().param;
        assert_eq!(
            param(chat(json!({"stream_options": {"include_usage": true}}))),
            Some("stream_options")
        );
        // Python truthiness: an empty object is no options, a string "false" is a stream.
        assert_eq!(chat(json!({"stream_options": {}})), Ok(()));
        assert_eq!(
            chat(json!({"stream": "false", "stream_options": {"include_usage": true}})),
            Ok(())
        );
        assert_eq!(
            param(chat(json!({"top_logprobs": 3}))),
            Some("top_logprobs")
        );
        assert_eq!(chat(json!({"top_logprobs": 0})), Ok(()));
        assert_eq!(
            param(chat(json!({"top_logprobs": "3"}))),
            Some("top_logprobs")
        );
        assert_eq!(param(chat(json!({"tools": []}))), Some("tools"));
        assert_eq!(
            param(chat(json!({"tool_choice": "auto"}))),
            Some("tool_choice")
        );
        assert_eq!(chat(json!({"tool_choice": "none"})), Ok(()));
        assert_eq!(param(completion(json!({"prompt": ""}))), Some("prompt"));
        assert_eq!(param(completion(json!({}))), Some("prompt"));
        assert_eq!(
            param(completion(json!({"prompt": "a", "logprobs": -2}))),
            Some("logprobs")
        );
        for (body, field) in [
            (json!({"temperature": "x"}), "body.temperature"),
            (json!({"stop": 5}), "body.stop"),
            (json!({"stop": ["a", 1]}), "body.stop"),
            (json!({"user": 5}), "body.user"),
            (json!({"n": 1.5}), "body.n"),
            (json!({"min_tokens": null}), "body.min_tokens"),
            (json!({"stream": "maybe"}), "body.stream"),
            (json!({"logprobs": "maybe"}), "body.logprobs"),
            (json!({"logit_bias": {"5": "x"}}), "body.logit_bias"),
        ] {
            assert_eq!(param(chat(body.clone())), Some(field), "{body}");
        }
        for body in [
            json!({"stream": "true", "stream_options": {"include_usage": true}}),
            json!({"stream": 1, "n": null, "temperature": null, "stop": "x", "user": "u"}),
            json!({"seed": -1, "top_k": "5"}),
        ] {
            assert_eq!(chat(body.clone()), Ok(()), "{body}");
        }
        assert_eq!(
            param(completion(json!({"prompt": "a", "n": null}))),
            Some("body.n")
        );
    }
}
