//! A chat template rendered as Hugging Face's `apply_chat_template` renders it: Jinja with
//! `trim_blocks` and `lstrip_blocks`, loop controls, `raise_exception`, `strftime_now`, a
//! `tojson` that is Python's `json.dumps` (no HTML escaping), Python's string and dict methods,
//! and values printed as Python prints them (`True`, `None`, `['a']`). The context is the
//! conversation, `tools`, `add_generation_prompt`, the tokenizer's special tokens and the
//! request's `chat_template_kwargs`; `continue_final_message` cuts the rendered text after the
//! final message as Hugging Face does.

use std::fmt::Write as _;

use minijinja::value::{Kwargs, Rest, ValueKind};
use minijinja::{Environment, Error, ErrorKind, Value};

use crate::json::{DumpOptions, dumps, float_repr};

/// The name the template is stored under.
const NAME: &str = "chat";
/// What marks an error the template raised itself (`raise_exception`).
const RAISED: &str = "raise_exception: ";
/// The most template instructions one rendering may run (a conversation of thousands of
/// messages takes a small share): past it the request is left to the engine, so no template
/// and no body can keep a router thread busy.
const FUEL: u64 = 5_000_000;
/// The widest `tojson` indent (Python allows any; no template needs more).
const MOST_INDENT: usize = 64;
/// Hugging Face's tag for `continue_final_message`.
const CONTINUE_TAG: &str = "CONTINUE_FINAL_MESSAGE_TAG ";

/// How vLLM hands message content to the template (`--chat-template-content-format auto`):
/// `String` joins text parts with newlines; `OpenAi` keeps a list of `{"type": "text", ...}`
/// parts, for templates that loop over a message's content.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ContentFormat {
    String,
    OpenAi,
}

/// A compiled chat template.
pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
    content_format: ContentFormat,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("content_format", &self.content_format)
            .finish_non_exhaustive()
    }
}

/// Why a rendering failed.
#[derive(Debug, thiserror::Error)]
pub enum RenderError {
    /// The template refused the conversation (`raise_exception`), as it does under vLLM.
    #[error("the chat template refused the request: {0}")]
    Raised(String),
    /// Hugging Face refuses this too (`continue_final_message` without the final message).
    #[error("{0}")]
    Invalid(String),
    /// What this renderer could not do (an unknown filter, method or a Python-only feature).
    #[error("the chat template could not be rendered here: {0}")]
    Unsupported(String),
}

impl ChatTemplate {
    /// Compiles `source`; an error names what the renderer cannot parse.
    pub fn new(source: String) -> Result<Self, String> {
        // Hugging Face's assistant-mask extension: `{% generation %}` marks what it renders and
        // changes nothing of the text.
        let source = strip_generation_tags(&source);
        let mut env = Environment::new();
        env.set_fuel(Some(FUEL));
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .keep_trailing_newline(false)
            .build()
            .map_err(|err| describe(&err))?;
        env.set_syntax(syntax);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.set_formatter(python_formatter);
        env.add_filter("tojson", tojson);
        env.add_filter("trim", trim);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_template_owned(NAME, source.clone())
            .map_err(|err| describe(&err))?;
        let content_format = content_format_of(&source);
        Ok(Self {
            env,
            source,
            content_format,
        })
    }

    pub fn content_format(&self) -> ContentFormat {
        self.content_format
    }

    /// Whether the template names a field (Hugging Face checks the one `continue_final_message`
    /// continues).
    pub fn mentions(&self, field: &str) -> bool {
        self.source.contains(field)
    }

    /// The prompt text for `messages` (template values) with `variables` (name, value) pairs:
    /// special tokens first, then the request's kwargs, then the fixed ones, later ones winning.
    pub fn render(
        &self,
        mut messages: Vec<Value>,
        variables: Vec<(String, Value)>,
        continue_final_message: bool,
    ) -> Result<String, RenderError> {
        let final_text = if continue_final_message {
            Some(self.tag_final_message(&mut messages)?)
        } else {
            None
        };
        let mut context: Vec<(String, Value)> = variables;
        context.push(("messages".into(), Value::from(messages)));
        let context = Value::from_pairs(context);
        let template = self
            .env
            .get_template(NAME)
            .map_err(|err| RenderError::Unsupported(describe(&err)))?;
        let rendered = template.render(context).map_err(classify)?;
        match final_text {
            None => Ok(rendered),
            Some(final_text) => cut_at_tag(rendered, &final_text),
        }
    }

    /// Appends Hugging Face's tag to the final message's content (its last text part for a list)
    /// and returns the content's text as it was.
    fn tag_final_message(&self, messages: &mut [Value]) -> Result<String, RenderError> {
        let Some(last) = messages.last_mut() else {
            return Err(RenderError::Invalid(
                "continue_final_message is set but there is no message".into(),
            ));
        };
        let content = last.get_attr("content").unwrap_or_default();
        if content.is_none() || content.is_undefined() {
            return Err(RenderError::Invalid(
                "continue_final_message is set but the final message has no \"content\" to continue!"
                    .into(),
            ));
        }
        if !self.mentions("content") {
            return Err(RenderError::Invalid(
                "continue_final_message is set to \"content\" but this is not an accepted field in the chat_template".into(),
            ));
        }
        let (text, tagged) = match content.kind() {
            ValueKind::String => {
                let text = content.as_str().unwrap_or_default().to_owned();
                let tagged = Value::from(format!("{text}{CONTINUE_TAG}"));
                (text, tagged)
            }
            ValueKind::Seq => {
                let mut parts: Vec<Value> = content.try_iter().into_iter().flatten().collect();
                let Some(position) = parts
                    .iter()
                    .rposition(|part| part.get_attr("text").is_ok_and(|text| !text.is_undefined()))
                else {
                    return Err(RenderError::Invalid(
                        "continue_final_message is set but we could not find any text to continue in the final message!".into(),
                    ));
                };
                let text = parts[position]
                    .get_attr("text")
                    .unwrap_or_default()
                    .to_string();
                parts[position] = replace_field(
                    &parts[position],
                    "text",
                    Value::from(format!("{text}{CONTINUE_TAG}")),
                );
                (text, Value::from(parts))
            }
            _ => return Err(RenderError::Unsupported("final message content".into())),
        };
        *last = replace_field(last, "content", tagged);
        Ok(text)
    }
}

/// `map` with `field` set to `value` (key order kept).
fn replace_field(map: &Value, field: &str, value: Value) -> Value {
    let keys: Vec<Value> = map.try_iter().into_iter().flatten().collect();
    Value::from_pairs(keys.into_iter().map(|key| {
        let item = if key.as_str() == Some(field) {
            value.clone()
        } else {
            map.get_item(&key).unwrap_or_default()
        };
        (key, item)
    }))
}

/// Hugging Face's cut after the final message: at the tag, or, when the template trimmed the
/// tag's trailing space, at the tag with the text before it right-stripped.
fn cut_at_tag(rendered: String, final_text: &str) -> Result<String, RenderError> {
    let tag = CONTINUE_TAG.trim();
    if !rendered.contains(final_text.trim()) || !rendered.contains(tag) {
        return Err(RenderError::Invalid(
            "continue_final_message is set but the final message does not appear in the chat after applying the chat template!".into(),
        ));
    }
    let at = rendered.rfind(tag).unwrap_or(0);
    if rendered[at..].starts_with(CONTINUE_TAG) {
        Ok(rendered[..at].to_owned())
    } else {
        Ok(rendered[..at].trim_end().to_owned())
    }
}

/// `source` with `{% generation %}` … `{% endgeneration %}` as `{% if true %}` … `{% endif %}`
/// (whitespace control kept, so the text is what Jinja2 renders with the extension).
fn strip_generation_tags(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(start) = rest.find("{%") {
        let Some(length) = rest[start..].find("%}") else {
            break;
        };
        let tag = &rest[start..start + length + 2];
        let inner =
            tag[2..tag.len() - 2].trim_matches(|c: char| c == '-' || c == '+' || c.is_whitespace());
        out.push_str(&rest[..start]);
        match inner {
            "generation" => out.push_str(&tag.replacen("generation", "if true", 1)),
            "endgeneration" => out.push_str(&tag.replacen("endgeneration", "endif", 1)),
            _ => out.push_str(tag),
        }
        rest = &rest[start + length + 2..];
    }
    out.push_str(rest);
    out
}

fn classify(err: Error) -> RenderError {
    if let Some(reason) = err.detail().and_then(|detail| detail.strip_prefix(RAISED)) {
        return RenderError::Raised(reason.to_owned());
    }
    let mut source: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(&err);
    while let Some(inner) = source {
        if let Some(inner) = inner.downcast_ref::<Error>()
            && let Some(reason) = inner
                .detail()
                .and_then(|detail| detail.strip_prefix(RAISED))
        {
            return RenderError::Raised(reason.to_owned());
        }
        source = inner.source();
    }
    RenderError::Unsupported(describe(&err))
}

fn describe(err: &Error) -> String {
    match err.line() {
        Some(line) => format!("{} (line {line})", err.kind()),
        None => err.kind().to_string(),
    }
    .to_string()
        + &err
            .detail()
            .map(|detail| format!(": {detail}"))
            .unwrap_or_default()
}

/// Whether the template loops over a message's content (vLLM's detection looks for a `for`
/// over `message['content']` in the template's syntax tree; this reads the same in its text).
fn content_format_of(source: &str) -> ContentFormat {
    let mut rest = source;
    while let Some(start) = rest.find("{%") {
        rest = &rest[start + 2..];
        let end = rest.find("%}").unwrap_or(rest.len());
        let statement =
            rest[..end].trim_matches(|c: char| c == '-' || c == '+' || c.is_whitespace());
        if let Some(header) = statement.strip_prefix("for ")
            && let Some((_, iterable)) = header.split_once(" in ")
        {
            let iterable: String = iterable.chars().filter(|c| !c.is_whitespace()).collect();
            let iterable = iterable.split('|').next().unwrap_or_default();
            if iterable.ends_with("['content']")
                || iterable.ends_with("[\"content\"]")
                || iterable.ends_with(".content")
            {
                return ContentFormat::OpenAi;
            }
        }
        rest = &rest[end..];
    }
    ContentFormat::String
}

/// minijinja's `trim`, without copying a string that has nothing to trim: chat templates trim
/// every message's content (`message['content'] | trim`), and a long system prompt usually
/// has no space at either end. Anything else is the built-in's answer.
fn trim(
    state: &minijinja::State,
    value: &Value,
    chars: Option<std::borrow::Cow<'_, str>>,
) -> Result<Value, Error> {
    if chars.is_none()
        && value.kind() == ValueKind::String
        && let Some(text) = value.as_str()
        && text.trim().len() == text.len()
    {
        return Ok(value.clone());
    }
    Ok(minijinja::filters::trim(
        minijinja::value::StringInput::new(state, value)?,
        chars,
    ))
}

fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(
        ErrorKind::InvalidOperation,
        format!("{RAISED}{message}"),
    ))
}

/// Hugging Face's `tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)`.
fn tojson(value: &Value, args: Rest<Value>, kwargs: Kwargs) -> Result<Value, Error> {
    let mut options = DumpOptions::default();
    let names = ["ensure_ascii", "indent", "separators", "sort_keys"];
    let mut given: Vec<(&str, Value)> = names.iter().copied().zip(args.iter().cloned()).collect();
    for name in names {
        if let Some(value) = kwargs.get::<Option<Value>>(name)? {
            given.push((name, value));
        }
    }
    kwargs.assert_all_used()?;
    for (name, value) in given {
        match name {
            "ensure_ascii" => options.ensure_ascii = value.is_true(),
            "sort_keys" => options.sort_keys = value.is_true(),
            "indent" => {
                options.indent = match value.kind() {
                    ValueKind::None | ValueKind::Undefined => None,
                    ValueKind::String => Some(value.as_str().unwrap_or_default().to_owned()),
                    ValueKind::Number => {
                        Some(" ".repeat((i64::try_from(value)?.max(0) as usize).min(MOST_INDENT)))
                    }
                    _ => return Err(Error::new(ErrorKind::InvalidOperation, "indent")),
                }
            }
            _ => {
                if value.is_none() || value.is_undefined() {
                    continue;
                }
                let parts: Vec<String> = value.try_iter()?.map(|part| part.to_string()).collect();
                let [item, key] = parts.as_slice() else {
                    return Err(Error::new(ErrorKind::InvalidOperation, "separators"));
                };
                options.separators = Some((item.clone(), key.clone()));
            }
        }
    }
    dumps(value, &options)
        .map(Value::from)
        .map_err(|err| Error::new(ErrorKind::InvalidOperation, err.to_string()))
}

/// Prints values as Python's `str()` does: strings as they are, `True`/`False`/`None`, floats by
/// `repr`, lists and dicts with quoted strings. Undefined prints nothing.
fn python_formatter(
    out: &mut minijinja::Output<'_>,
    state: &mut minijinja::State<'_, '_>,
    value: &Value,
) -> Result<(), Error> {
    match value.kind() {
        ValueKind::String | ValueKind::Undefined | ValueKind::Invalid => {
            minijinja::escape_formatter(out, state, value)
        }
        _ => {
            let mut text = String::new();
            python_str(&mut text, value, true);
            out.write_str(&text).map_err(Error::from)
        }
    }
}

fn python_str(out: &mut String, value: &Value, top: bool) {
    match value.kind() {
        ValueKind::None | ValueKind::Undefined => out.push_str("None"),
        ValueKind::Bool => out.push_str(if value.is_true() { "True" } else { "False" }),
        ValueKind::String if top => out.push_str(value.as_str().unwrap_or_default()),
        ValueKind::String => python_repr_str(out, value.as_str().unwrap_or_default()),
        ValueKind::Number => match f64::try_from(value.clone()) {
            Ok(float) if !value.is_integer() => out.push_str(&float_repr(float)),
            _ => {
                let _ = write!(out, "{value}");
            }
        },
        ValueKind::Seq | ValueKind::Iterable => {
            out.push('[');
            for (position, item) in value.try_iter().into_iter().flatten().enumerate() {
                if position > 0 {
                    out.push_str(", ");
                }
                python_str(out, &item, false);
            }
            out.push(']');
        }
        ValueKind::Map => {
            out.push('{');
            for (position, key) in value.try_iter().into_iter().flatten().enumerate() {
                if position > 0 {
                    out.push_str(", ");
                }
                python_str(out, &key, false);
                out.push_str(": ");
                python_str(out, &value.get_item(&key).unwrap_or_default(), false);
            }
            out.push('}');
        }
        _ => {
            let _ = write!(out, "{value}");
        }
    }
}

/// Python's `repr` of a string: single quotes unless the text holds one and no double quote.
fn python_repr_str(out: &mut String, text: &str) {
    let quote = if text.contains('\'') && !text.contains('"') {
        '"'
    } else {
        '\''
    };
    out.push(quote);
    for c in text.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if (c as u32) < 0x20 || c as u32 == 0x7f => {
                let _ = write!(out, "\\x{:02x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push(quote);
}

/// Hugging Face's `strftime_now(format)`: the current time (UTC here) in C's `strftime` form.
fn strftime_now(format: String) -> Result<Value, Error> {
    let seconds = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|elapsed| elapsed.as_secs() as i64)
        .unwrap_or(0);
    strftime(&format, seconds)
        .map(Value::from)
        .ok_or_else(|| Error::new(ErrorKind::InvalidOperation, "unsupported strftime format"))
}

/// `format` for the UTC time `seconds` after the epoch; None for a directive not written here.
pub(crate) fn strftime(format: &str, seconds: i64) -> Option<String> {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = [
        "Monday",
        "Tuesday",
        "Wednesday",
        "Thursday",
        "Friday",
        "Saturday",
        "Sunday",
    ];
    let days = seconds.div_euclid(86_400);
    let of_day = seconds.rem_euclid(86_400);
    let (year, month, day) = switchyard_process::clock::civil_from_days(days);
    // 1970-01-01 was a Thursday (index 3 from Monday).
    let weekday = (days + 3).rem_euclid(7) as usize;
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next()? {
            'Y' => write!(out, "{year}").ok()?,
            'y' => write!(out, "{:02}", year.rem_euclid(100)).ok()?,
            'm' => write!(out, "{month:02}").ok()?,
            'd' => write!(out, "{day:02}").ok()?,
            '-' => match chars.next()? {
                'd' => write!(out, "{day}").ok()?,
                'm' => write!(out, "{month}").ok()?,
                _ => return None,
            },
            'B' => out.push_str(MONTHS[month as usize - 1]),
            'b' => out.push_str(&MONTHS[month as usize - 1][..3]),
            'A' => out.push_str(DAYS[weekday]),
            'a' => out.push_str(&DAYS[weekday][..3]),
            'H' => write!(out, "{:02}", of_day / 3600).ok()?,
            'M' => write!(out, "{:02}", of_day / 60 % 60).ok()?,
            'S' => write!(out, "{:02}", of_day % 60).ok()?,
            '%' => out.push('%'),
            _ => return None,
        }
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render(
        source: &str,
        messages: &str,
        extra: &[(&str, Value)],
    ) -> Result<String, RenderError> {
        let template = ChatTemplate::new(source.to_owned()).unwrap();
        let messages: crate::json::Json = serde_json::from_str(messages).unwrap();
        let crate::json::Json::Array(messages) = messages else {
            panic!()
        };
        let variables = extra
            .iter()
            .map(|(name, value)| (name.to_string(), value.clone()))
            .collect();
        template.render(
            messages.iter().map(|m| m.to_value()).collect(),
            variables,
            false,
        )
    }

    #[test]
    fn trim_answers_as_the_built_in_does() {
        let source = "{% for m in messages %}[{{ m.content | trim }}|{{ m.content | trim('x ') }}|\
                      {{ (m.content | trim) is string }}|{{ (m.content | trim) | length }}|\
                      {{ m.content | trim + '.' }}]{% endfor %}[{{ missing | trim }}]\
                      [{{ 5 | trim }}][{{ '<b> ' | safe | trim }}][{{ ('<b>' | safe | trim) is safe }}]";
        let messages = r#"[{"role":"u","content":"  a b \n"},{"role":"u","content":"ab"},
            {"role":"u","content":""},{"role":"u","content":"\u00a0x\u2003"},
            {"role":"u","content":"xx a xx"},{"role":"u","content":7},{"role":"u","content":null}]"#;
        let ours = render(source, messages, &[]).unwrap();
        let mut env = Environment::new();
        env.set_formatter(python_formatter);
        env.add_template("t", source).unwrap();
        let json: crate::json::Json = serde_json::from_str(messages).unwrap();
        let built_in = env
            .get_template("t")
            .unwrap()
            .render(minijinja::context! { messages => json.to_value() })
            .unwrap();
        assert_eq!(ours, built_in);
        assert!(
            ours.starts_with("[a b|a b \n|True|3|a b.][ab|ab|True|2|ab.]"),
            "{ours}"
        );
    }

    #[test]
    fn blocks_are_trimmed_and_values_print_as_python_prints_them() {
        let source = "{% for m in messages %}\n  {% if m.role == 'user' %}\n[{{ m.content }}|{{ m.flag }}|{{ m.n }}|{{ m.list }}]\n  {% endif %}\n{% endfor %}{{ add_generation_prompt }}";
        let out = render(
            source,
            r#"[{"role":"user","content":"hi","flag":true,"n":2.0,"list":["a",null]}]"#,
            &[("add_generation_prompt", Value::from(false))],
        )
        .unwrap();
        assert_eq!(out, "[hi|True|2.0|['a', None]]\nFalse");
    }

    #[test]
    fn tojson_is_pythons_json_dumps_and_raise_exception_is_the_templates_refusal() {
        let out = render(
            "{{ messages[0] | tojson }}|{{ messages[0].content | tojson(indent=2) }}",
            r#"[{"role":"user","content":["<b>&"]}]"#,
            &[],
        )
        .unwrap();
        assert_eq!(
            out,
            "{\"role\": \"user\", \"content\": [\"<b>&\"]}|[\n  \"<b>&\"\n]"
        );
        let refused = render(
            "{% if messages[0].role != 'system' %}{{ raise_exception('Conversation roles must alternate') }}{% endif %}",
            r#"[{"role":"user","content":"x"}]"#,
            &[],
        );
        assert!(
            matches!(refused, Err(RenderError::Raised(reason)) if reason == "Conversation roles must alternate")
        );
        let unknown = render("{{ messages | no_such_filter }}", r#"[]"#, &[]);
        assert!(
            matches!(unknown, Err(RenderError::Unsupported(_))),
            "{unknown:?}"
        );
        assert_eq!(
            render("{{ 'a b'.split() }}{{ ' x '.strip() }}", r#"[]"#, &[]).unwrap(),
            "['a', 'b']x"
        );
    }

    #[test]
    fn content_loops_select_the_openai_format() {
        let openai = "{% for message in messages %}{% for part in message['content'] %}{{ part.text }}{% endfor %}{% endfor %}";
        assert_eq!(
            ChatTemplate::new(openai.into()).unwrap().content_format(),
            ContentFormat::OpenAi
        );
        let dotted = "{%- for c in message.content -%}{%- endfor -%}";
        assert_eq!(content_format_of(dotted), ContentFormat::OpenAi);
        assert_eq!(
            content_format_of("{% for message in messages %}{{ message['content'] }}{% endfor %}"),
            ContentFormat::String
        );
    }

    #[test]
    fn generation_tags_render_their_text_and_runaway_templates_run_out_of_fuel() {
        let source = "{% for m in messages %}{%- generation -%}\n[{{ m.content }}]\n{%- endgeneration %}{% endfor %}";
        assert_eq!(
            render(source, r#"[{"content":"a"},{"content":"b"}]"#, &[]).unwrap(),
            "[a][b]"
        );
        let spin =
            "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}";
        assert!(matches!(
            render(spin, "[]", &[]),
            Err(RenderError::Unsupported(_))
        ));
    }

    #[test]
    fn strftime_writes_the_dates_templates_ask_for() {
        // 2024-07-26 12:34:56 UTC, a Friday.
        let at = 1_721_997_296;
        assert_eq!(strftime("%d %b %Y", at).unwrap(), "26 Jul 2024");
        assert_eq!(
            strftime("%A %B %-d, %H:%M:%S %%", at).unwrap(),
            "Friday July 26, 12:34:56 %"
        );
        assert_eq!(strftime("%Q", at), None);
    }
}
