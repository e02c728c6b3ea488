//! What vLLM 0.32 refuses in a request's generation fields, and at which point, so that a
//! router tested against the simulator sees the 400s a real engine would send:
//!
//! - while the body is read (its request model, before the model name is looked up): the
//!   request model's own checks (`stream_options` without `stream`, `top_logprobs` without
//!   `logprobs`, an empty `tools`, `tool_choice` without `tools`, an empty completions
//!   prompt), then each field's type, read as pydantic reads it (`"0.5"` is a number, `"x"`
//!   is not);
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

/// The generation fields of a chat or completions body, each as it came (the last of a
/// repeated key, as vLLM reads it; null as null). Read in a pass of its own over the body, so
/// that a repeated key is no error, as it is none for vLLM.
#[derive(Debug, Default)]
pub(crate) struct Generation {
    n: Option<Value>,
    temperature: Option<Value>,
    top_p: Option<Value>,
    top_k: Option<Value>,
    min_p: Option<Value>,
    presence_penalty: Option<Value>,
    frequency_penalty: Option<Value>,
    repetition_penalty: Option<Value>,
    min_tokens: Option<Value>,
    logprobs: Option<Value>,
    top_logprobs: Option<Value>,
    prompt_logprobs: Option<Value>,
    logit_bias: Option<Value>,
    stop: Option<Value>,
    user: Option<Value>,
    seed: Option<Value>,
    tools: Option<Value>,
    tool_choice: Option<Value>,
    stream: Option<Value>,
    stream_options: Option<Value>,
    prompt: Option<Value>,
    max_tokens: Option<Value>,
    max_completion_tokens: Option<Value>,
    response_format: Option<Value>,
    suffix: Option<Value>,
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
                    let Some(slot) = fields.slot(&key) else {
                        map.next_value::<IgnoredAny>()?;
                        continue;
                    };
                    *slot = Some(map.next_value()?);
                }
                Ok(fields)
            }
        }
        deserializer.deserialize_map(Fields)
    }
}

impl Generation {
    fn slot(&mut self, key: &str) -> Option<&mut Option<Value>> {
        Some(match key {
            "n" => &mut self.n,
            "temperature" => &mut self.temperature,
            "top_p" => &mut self.top_p,
            "top_k" => &mut self.top_k,
            "min_p" => &mut self.min_p,
            "presence_penalty" => &mut self.presence_penalty,
            "frequency_penalty" => &mut self.frequency_penalty,
            "repetition_penalty" => &mut self.repetition_penalty,
            "min_tokens" => &mut self.min_tokens,
            "logprobs" => &mut self.logprobs,
            "top_logprobs" => &mut self.top_logprobs,
            "prompt_logprobs" => &mut self.prompt_logprobs,
            "logit_bias" => &mut self.logit_bias,
            "stop" => &mut self.stop,
            "user" => &mut self.user,
            "seed" => &mut self.seed,
            "tools" => &mut self.tools,
            "tool_choice" => &mut self.tool_choice,
            "stream" => &mut self.stream,
            "stream_options" => &mut self.stream_options,
            "prompt" => &mut self.prompt,
            "max_tokens" => &mut self.max_tokens,
            "max_completion_tokens" => &mut self.max_completion_tokens,
            "response_format" => &mut self.response_format,
            "suffix" => &mut self.suffix,
            _ => return None,
        })
    }

    /// The fields of a body already known to be a JSON object.
    pub(crate) fn read(bytes: &[u8]) -> Result<Self, ApiError> {
        serde_json::from_slice(bytes)
            .map_err(|err| ApiError::bad_request(format!("invalid JSON body: {err}")))
    }

    /// What vLLM's request model refuses while it reads the body: its own checks of the raw
    /// fields first, then each field's type.
    pub(crate) fn check_request(&self, kind: ApiKind) -> Result<(), ApiError> {
        if truthy(self.stream_options.as_ref()) && !truthy(self.stream.as_ref()) {
            return Err(refused(
                "Stream options can only be defined when `stream=True`.".to_owned(),
                Some("stream_options"),
                None,
            ));
        }
        self.check_logprob_fields(kind)?;
        match kind {
            ApiKind::Chat => self.check_tools()?,
            ApiKind::Completion => {
                if matches!(&self.prompt, None | Some(Value::Null))
                    || self.prompt.as_ref().and_then(Value::as_str) == Some("")
                {
                    return Err(refused(
                        "Either prompt or prompt_embeds must be provided and non-empty.".to_owned(),
                        Some("prompt"),
                        None,
                    ));
                }
            }
        }
        self.check_types(kind)
    }

    /// The request model's checks of the logprob fields, on the raw values (a boolean is a
    /// number there, as in Python).
    fn check_logprob_fields(&self, kind: ApiKind) -> Result<(), ApiError> {
        let names = match kind {
            ApiKind::Chat => ["prompt_logprobs", "top_logprobs"],
            ApiKind::Completion => ["prompt_logprobs", "logprobs"],
        };
        for name in names {
            let value = self.field(name);
            if value.is_some_and(|value| !value.is_null() && python_number(value).is_none()) {
                return Err(refused(
                    format!("`{name}` must be an integer."),
                    Some(name),
                    value.map(python_repr),
                ));
            }
        }
        if let Some(prompt_logprobs) = self.prompt_logprobs.as_ref().and_then(python_number) {
            if truthy(self.stream.as_ref()) && (prompt_logprobs > 0.0 || prompt_logprobs == -1.0) {
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
                    self.prompt_logprobs.as_ref().map(python_repr),
                ));
            }
        }
        match kind {
            ApiKind::Chat => {
                if let Some(top) = self.top_logprobs.as_ref().and_then(python_number) {
                    if top < 0.0 && top != -1.0 {
                        return Err(refused(
                            "`top_logprobs` must be a positive value or -1.".to_owned(),
                            Some("top_logprobs"),
                            self.top_logprobs.as_ref().map(python_repr),
                        ));
                    }
                    if (top == -1.0 || top > 0.0) && !truthy(self.logprobs.as_ref()) {
                        return Err(refused(
                            "when using `top_logprobs`, `logprobs` must be set to true.".to_owned(),
                            Some("top_logprobs"),
                            None,
                        ));
                    }
                }
            }
            ApiKind::Completion => {
                if let Some(logprobs) = self.logprobs.as_ref().and_then(python_number)
                    && logprobs < 0.0
                    && logprobs != -1.0
                {
                    return Err(refused(
                        "`logprobs` must be a positive value or -1.".to_owned(),
                        Some("logprobs"),
                        self.logprobs.as_ref().map(python_repr),
                    ));
                }
            }
        }
        Ok(())
    }

    /// A chat's `tools` and `tool_choice` as vLLM's request model checks them.
    fn check_tools(&self) -> Result<(), ApiError> {
        if matches!(&self.tools, Some(Value::Array(tools)) if tools.is_empty()) {
            return Err(refused(
                "`tools` must not be an empty array. Either provide at least one tool or omit \
                 the field entirely."
                    .to_owned(),
                Some("tools"),
                None,
            ));
        }
        let choice = self.tool_choice.as_ref().filter(|choice| !choice.is_null());
        if choice.is_some_and(|choice| choice != "none")
            && matches!(&self.tools, None | Some(Value::Null))
        {
            return Err(refused(
                "When using `tool_choice`, `tools` must be set.".to_owned(),
                Some("tool_choice"),
                None,
            ));
        }
        Ok(())
    }

    /// Each field's type as pydantic reads it: a 400 naming `body.FIELD`.
    fn check_types(&self, kind: ApiKind) -> Result<(), ApiError> {
        let wrong = |param: &'static str, what: &str| {
            let field = param.trim_start_matches("body.");
            Err(ApiError::bad_request(format!("{field}: Input should be {what}")).param(param))
        };
        for (value, param) in [
            (&self.temperature, "body.temperature"),
            (&self.top_p, "body.top_p"),
            (&self.min_p, "body.min_p"),
            (&self.presence_penalty, "body.presence_penalty"),
            (&self.frequency_penalty, "body.frequency_penalty"),
            (&self.repetition_penalty, "body.repetition_penalty"),
        ] {
            if value
                .as_ref()
                .is_some_and(|v| !v.is_null() && lax_float(v).is_none())
            {
                return wrong(param, "a valid number");
            }
        }
        // A completion's `n` and either's `min_tokens` may not be null.
        let n_nullable = kind == ApiKind::Chat;
        for (value, param, nullable) in [
            (&self.n, "body.n", n_nullable),
            (&self.max_tokens, "body.max_tokens", true),
            (
                &self.max_completion_tokens,
                "body.max_completion_tokens",
                true,
            ),
            (&self.top_k, "body.top_k", true),
            (&self.min_tokens, "body.min_tokens", false),
            (&self.seed, "body.seed", true),
            (&self.top_logprobs, "body.top_logprobs", true),
            (&self.prompt_logprobs, "body.prompt_logprobs", true),
        ] {
            let valid = match value {
                None => true,
                Some(Value::Null) => nullable,
                Some(value) => reuse::lax_integer(value).is_some(),
            };
            if !valid {
                return wrong(param, "a valid integer");
            }
        }
        match kind {
            ApiKind::Chat => {
                if let Some(value) = self.logprobs.as_ref().filter(|v| !v.is_null())
                    && reuse::lax_bool(value).is_none()
                {
                    return wrong("body.logprobs", "a valid boolean");
                }
            }
            ApiKind::Completion => {
                if let Some(value) = self.logprobs.as_ref().filter(|v| !v.is_null())
                    && reuse::lax_integer(value).is_none()
                {
                    return wrong("body.logprobs", "a valid integer");
                }
            }
        }
        if let Some(value) = self.stream.as_ref().filter(|v| !v.is_null())
            && reuse::lax_bool(value).is_none()
        {
            return wrong("body.stream", "a valid boolean");
        }
        let stop_valid = match &self.stop {
            None | Some(Value::Null | Value::String(_)) => true,
            Some(Value::Array(stops)) => {
                stops.len() <= MAX_STOP_STRINGS && stops.iter().all(Value::is_string)
            }
            Some(_) => false,
        };
        if !stop_valid {
            return wrong("body.stop", "a valid string or a list of at most 4 strings");
        }
        let format_valid = match &self.response_format {
            None | Some(Value::Null) => true,
            Some(format) => format
                .get("type")
                .and_then(Value::as_str)
                .is_some_and(|kind| RESPONSE_FORMATS.contains(&kind)),
        };
        if !format_valid {
            return wrong(
                "body.response_format.type",
                "'text', 'json_object', 'json_schema' or 'structural_tag'",
            );
        }
        if !matches!(&self.user, None | Some(Value::Null | Value::String(_))) {
            return wrong("body.user", "a valid string");
        }
        let bias_valid = match &self.logit_bias {
            None | Some(Value::Null) => true,
            Some(Value::Object(biases)) => biases.values().all(|bias| lax_float(bias).is_some()),
            Some(_) => false,
        };
        if !bias_valid {
            return wrong("body.logit_bias", "a valid dictionary of numbers");
        }
        Ok(())
    }

    /// What vLLM's sampling parameters refuse, once the output budget `max_tokens` (at least
    /// one) is known, in vLLM's order; `vocabulary`: the model's vocabulary size (what a
    /// logprobs count of -1 asks for).
    pub(crate) fn check_sampling(
        &self,
        kind: ApiKind,
        max_tokens: u32,
        vocabulary: u64,
    ) -> Result<(), ApiError> {
        let float = |value: &Option<Value>, default: f64| {
            value.as_ref().and_then(lax_float).unwrap_or(default)
        };
        let integer = |value: &Option<Value>, default: i64| {
            value
                .as_ref()
                .and_then(reuse::lax_integer)
                .unwrap_or(default)
        };
        // `logit_bias` is converted before the parameters are checked.
        if let Some(Value::Object(biases)) = &self.logit_bias {
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
        let n = integer(&self.n, 1);
        if n < 1 {
            return plain(format!("n must be at least 1, got {n}."));
        }
        if n > MAX_N {
            return plain(format!(
                "n must be at most {MAX_N}, got {n}. To increase this limit, set the \
                 VLLM_MAX_N_SEQUENCES environment variable."
            ));
        }
        for (value, name) in [
            (&self.presence_penalty, "presence_penalty"),
            (&self.frequency_penalty, "frequency_penalty"),
        ] {
            let penalty = float(value, 0.0);
            if !(-2.0..=2.0).contains(&penalty) {
                return plain(format!("{name} must be in [-2, 2], got {penalty:?}."));
            }
        }
        let repetition = float(&self.repetition_penalty, 1.0);
        if !repetition.is_finite() {
            return plain(format!(
                "repetition_penalty must be a finite number, got {repetition:?}."
            ));
        }
        if repetition <= 0.0 {
            return plain(format!(
                "repetition_penalty must be greater than zero, got {repetition:?}."
            ));
        }
        let temperature = float(&self.temperature, 1.0);
        let bad_temperature = if !temperature.is_finite() {
            Some(format!(
                "temperature must be a finite number, got {temperature:?}."
            ))
        } else if temperature < 0.0 {
            Some(format!(
                "temperature must be non-negative, got {temperature:?}."
            ))
        } else if temperature > 2.0 {
            Some(format!(
                "temperature must be in [0, 2], got {temperature:?}."
            ))
        } else {
            None
        };
        if let Some(message) = bad_temperature {
            return Err(refused(
                message,
                Some("temperature"),
                Some(format!("{temperature:?}")),
            ));
        }
        let top_p = float(&self.top_p, 1.0);
        if !(top_p > 0.0 && top_p <= 1.0) {
            return Err(refused(
                format!("top_p must be in (0, 1], got {top_p:?}."),
                Some("top_p"),
                Some(format!("{top_p:?}")),
            ));
        }
        let top_k = integer(&self.top_k, 0);
        if top_k < -1 {
            return plain(format!(
                "top_k must be 0 (disable), or at least 1, got {top_k}."
            ));
        }
        let min_p = float(&self.min_p, 0.0);
        if !(0.0..=1.0).contains(&min_p) {
            return plain(format!("min_p must be in [0, 1], got {min_p:?}."));
        }
        let min_tokens = integer(&self.min_tokens, 0);
        if min_tokens < 0 {
            return plain(format!(
                "min_tokens must be greater than or equal to 0, got {min_tokens}."
            ));
        }
        if min_tokens > i64::from(max_tokens) {
            return plain(format!(
                "min_tokens must be less than or equal to max_tokens={max_tokens}, got \
                 {min_tokens}."
            ));
        }
        let empty_stop = match &self.stop {
            Some(Value::String(stop)) => stop.is_empty(),
            Some(Value::Array(stops)) => stops.iter().any(|stop| stop == ""),
            _ => false,
        };
        if empty_stop {
            return plain("stop cannot contain an empty string.".to_owned());
        }
        if temperature < 1e-5 && n > 1 {
            return plain(format!("n must be 1 when using greedy sampling, got {n}."));
        }
        // The sampled logprobs asked for: a chat's `top_logprobs` when `logprobs` is on, a
        // completion's `logprobs`; -1 is the whole vocabulary.
        let sampled = match kind {
            ApiKind::Chat => truthy(self.logprobs.as_ref())
                .then(|| integer(&self.top_logprobs, 0))
                .filter(|&count| count != 0),
            ApiKind::Completion => self
                .logprobs
                .as_ref()
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
            .prompt_logprobs
            .as_ref()
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
        Ok(())
    }

    /// What vLLM's renderer refuses once the model is known: a completion's `suffix` (the
    /// simulated model has no fill-in-the-middle rendering).
    pub(crate) fn check_rendering(&self, kind: ApiKind) -> Result<(), ApiError> {
        if kind == ApiKind::Completion && self.suffix.as_ref().is_some_and(|s| !s.is_null()) {
            return Err(ApiError::bad_request(
                "suffix is only supported for models with FIM completion rendering".to_owned(),
            )
            .param("suffix"));
        }
        Ok(())
    }

    fn field(&self, name: &str) -> Option<&Value> {
        match name {
            "prompt_logprobs" => self.prompt_logprobs.as_ref(),
            "top_logprobs" => self.top_logprobs.as_ref(),
            "logprobs" => self.logprobs.as_ref(),
            _ => None,
        }
    }
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
    let error = ApiError::bad_request(message);
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

/// A string as Python's `repr` writes it (single quotes unless it holds one).
fn python_str_repr(text: &str) -> String {
    if text.contains('\'') && !text.contains('"') {
        format!("\"{text}\"")
    } else {
        format!("'{}'", text.replace('\\', "\\\\").replace('\'', "\\'"))
    }
}

/// A number field read as pydantic reads a float: a number, a boolean, or a string that
/// parses as one.
fn lax_float(value: &Value) -> Option<f64> {
    match value {
        Value::Bool(value) => Some(f64::from(u8::from(*value))),
        Value::Number(number) => number.as_f64(),
        Value::String(text) => text.trim().parse().ok(),
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
        assert_eq!(fields.n, Some(json!(1)));
        let fields = Generation::read(br#"{"n": 0, "n": 2, "messages": []}"#).unwrap();
        assert_eq!(fields.n, Some(json!(2)));
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
