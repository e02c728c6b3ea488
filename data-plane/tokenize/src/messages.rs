//! OpenAI chat messages turned into the conversation vLLM hands a chat template (vLLM 0.32's
//! `parse_chat_messages` and `_postprocess_messages`), for text-only conversations:
//!
//! - content: a string, `null` or a list of text parts (`"..."` or `{"type": "text", "text"}`);
//!   with the `String` content format the texts are joined with `\n` (`null` is `""`), with
//!   `OpenAi` they stay a list of `{"type": "text", "text"}` parts (`null` is `[]`);
//! - kept besides `role` and `content`: a string `name` and `task`; an assistant's
//!   `tool_calls` (each call's `arguments` read from its JSON string into an object: `{}` when
//!   empty, unreadable or not an object; an empty list is dropped) and `reasoning` (also as
//!   `reasoning_content`); a tool message's `tool_call_id` (its text parts joined with `\n`
//!   in either format). Other fields are dropped, as vLLM drops them.
//!
//! What this does not follow is [`Unsupported`] (the engine is asked instead): any non-text
//! part (images, audio, files, refusals), a text part with fields besides `type` and `text`,
//! the `developer` role (vLLM rewrites it for templates without it), and a system text
//! starting with Claude Code's billing header (vLLM strips that line).

use std::sync::Arc;

use minijinja::Value;
use minijinja::value::{Enumerator, Object, ObjectRepr};

use crate::json::Json;
use crate::template::ContentFormat;
use crate::{Invalid, Refusal, Unsupported};

/// One message of the conversation: the fields kept, in the order vLLM writes them.
#[derive(Debug, Clone, PartialEq)]
pub struct Message(Vec<(&'static str, Json)>);

impl Message {
    /// As JSON (tests).
    #[cfg(test)]
    fn to_json(&self) -> Json {
        Json::Object(
            self.0
                .iter()
                .map(|(name, value)| ((*name).to_owned(), value.clone()))
                .collect(),
        )
    }

    /// The mapping a template sees: one object over the fields, not a map built per message
    /// (a long conversation has many).
    pub fn into_value(self) -> Value {
        Value::from_object(Fields(
            self.0
                .into_iter()
                .map(|(name, value)| (name, value.to_value()))
                .collect(),
        ))
    }
}

/// A message's fields as a template mapping: lookups by name, keys in their order.
#[derive(Debug)]
struct Fields(Vec<(&'static str, Value)>);

impl Object for Fields {
    fn repr(self: &Arc<Self>) -> ObjectRepr {
        ObjectRepr::Map
    }

    fn get_value(self: &Arc<Self>, key: &Value) -> Option<Value> {
        let key = key.as_str()?;
        self.0
            .iter()
            .find(|(name, _)| *name == key)
            .map(|(_, value)| value.clone())
    }

    fn enumerate(self: &Arc<Self>) -> Enumerator {
        Enumerator::Values(self.0.iter().map(|(name, _)| Value::from(*name)).collect())
    }

    fn enumerator_len(self: &Arc<Self>) -> Option<usize> {
        Some(self.0.len())
    }
}

/// The conversation for the template.
pub fn conversation(messages: &Json, format: ContentFormat) -> Result<Vec<Message>, Refusal> {
    let Json::Array(messages) = messages else {
        return Err(Refusal::Invalid(Invalid("messages must be a list".into())));
    };
    messages
        .iter()
        .map(|message| convert(message, format))
        .collect()
}

fn convert(message: &Json, format: ContentFormat) -> Result<Message, Refusal> {
    let Json::Object(_) = message else {
        return Err(Refusal::Invalid(Invalid(
            "a message must be an object".into(),
        )));
    };
    let role = message
        .get("role")
        .and_then(Json::as_str)
        .ok_or_else(|| Refusal::Invalid(Invalid("a message needs a string `role`".into())))?;
    if role == "developer" {
        return Err(Refusal::Engine(Unsupported::Message));
    }
    let texts = texts_of(message.get("content"))?;
    if role == "system"
        && texts
            .iter()
            .any(|text| text.starts_with("x-anthropic-billing-header"))
    {
        return Err(Refusal::Engine(Unsupported::Message));
    }
    let mut out: Vec<(&'static str, Json)> = Vec::with_capacity(2);
    out.push(("role", Json::String(role.into())));
    let content = if role == "tool" || format == ContentFormat::String {
        match texts.as_slice() {
            [text] => Json::String(Arc::clone(text)),
            _ => Json::String(texts.join("\n").into()),
        }
    } else {
        Json::Array(
            texts
                .into_iter()
                .map(|text| {
                    Json::Object(vec![
                        ("type".into(), Json::String("text".into())),
                        ("text".into(), Json::String(text)),
                    ])
                })
                .collect(),
        )
    };
    out.push(("content", content));
    match role {
        "assistant" => {
            if let Some(calls) = message.get("tool_calls")
                && *calls != Json::Null
            {
                let calls = tool_calls(calls)?;
                if !calls.is_empty() {
                    out.push(("tool_calls", Json::Array(calls)));
                }
            }
            if let Some(reasoning) = message.get("reasoning")
                && *reasoning != Json::Null
            {
                out.push(("reasoning", reasoning.clone()));
                out.push(("reasoning_content", reasoning.clone()));
            }
        }
        "tool" => {
            if let Some(id) = message.get("tool_call_id") {
                out.push(("tool_call_id", id.clone()));
            }
        }
        _ => {}
    }
    for field in ["name", "task"] {
        if let Some(value @ Json::String(_)) = message.get(field) {
            out.push((field, value.clone()));
        }
    }
    Ok(Message(out))
}

/// The texts of a message's content (shared, not copied).
fn texts_of(content: Option<&Json>) -> Result<Vec<Arc<str>>, Refusal> {
    match content {
        None | Some(Json::Null) => Ok(Vec::new()),
        Some(Json::String(text)) => Ok(vec![text.clone()]),
        Some(Json::Array(parts)) if parts.len() > crate::MOST_PARTS => {
            Err(Refusal::Engine(Unsupported::Large))
        }
        Some(Json::Array(parts)) => parts.iter().map(text_of_part).collect(),
        Some(_) => Err(Refusal::Invalid(Invalid(
            "a message's content must be a string or a list of parts".into(),
        ))),
    }
}

fn text_of_part(part: &Json) -> Result<Arc<str>, Refusal> {
    match part {
        Json::String(text) => Ok(text.clone()),
        Json::Object(fields) => {
            let only_text = fields
                .iter()
                .all(|(name, _)| name == "type" || name == "text");
            match (part.get("type").and_then(Json::as_str), part.get("text")) {
                (Some("text"), Some(Json::String(text))) if only_text => Ok(text.clone()),
                _ => Err(Refusal::Engine(Unsupported::NonText)),
            }
        }
        _ => Err(Refusal::Engine(Unsupported::NonText)),
    }
}

/// An assistant's tool calls with their `arguments` as objects.
fn tool_calls(calls: &Json) -> Result<Vec<Json>, Refusal> {
    let Json::Array(calls) = calls else {
        return Err(Refusal::Engine(Unsupported::Message));
    };
    calls
        .iter()
        .map(|call| {
            let Json::Object(fields) = call else {
                return Err(Refusal::Invalid(Invalid(
                    "assistant tool_calls entries must be objects.".into(),
                )));
            };
            let kind = call
                .get("type")
                .and_then(Json::as_str)
                .unwrap_or("function");
            let Some(Json::Object(function)) = call.get("function") else {
                return Err(Refusal::Invalid(Invalid(
                    "chat completions only support assistant tool_calls of type 'function'.".into(),
                )));
            };
            if kind != "function" {
                return Err(Refusal::Invalid(Invalid(
                    "chat completions only support assistant tool_calls of type 'function'.".into(),
                )));
            }
            // vLLM's validation writes a call's keys in its schema's order: `id`, `function`,
            // `type`, then any others; in `function`, `arguments`, `name`, then any others.
            let in_function = |name: &str| function.iter().find(|(known, _)| known == name);
            let mut function_out: Vec<(String, Json)> = vec![(
                "arguments".into(),
                in_function("arguments")
                    .map_or(Json::Object(Vec::new()), |(_, value)| arguments(value)),
            )];
            function_out.extend(in_function("name").cloned());
            function_out.extend(
                function
                    .iter()
                    .filter(|(name, _)| name != "arguments" && name != "name")
                    .cloned(),
            );
            let in_call = |name: &str| fields.iter().find(|(known, _)| known == name).cloned();
            let mut out: Vec<(String, Json)> = Vec::new();
            out.extend(in_call("id"));
            out.push(("function".into(), Json::Object(function_out)));
            out.extend(in_call("type"));
            out.extend(
                fields
                    .iter()
                    .filter(|(name, _)| !matches!(name.as_str(), "id" | "function" | "type"))
                    .cloned(),
            );
            Ok(Json::Object(out))
        })
        .collect()
}

/// vLLM's reading of a call's `arguments`: an object as it is; a JSON string holding an object
/// read; anything else (empty, unreadable, not an object) `{}`.
fn arguments(value: &Json) -> Json {
    match value {
        Json::Object(_) => value.clone(),
        Json::String(text) if !text.is_empty() => match serde_json::from_str::<Json>(text) {
            Ok(object @ Json::Object(_)) => object,
            _ => Json::Object(Vec::new()),
        },
        // A non-empty non-string (a list, a number): vLLM keeps only objects.
        _ => Json::Object(Vec::new()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn json(text: &str) -> Json {
        serde_json::from_str(text).unwrap()
    }

    #[test]
    fn text_parts_are_joined_or_kept_by_the_content_format() {
        let messages = json(
            r#"[
            {"role": "user", "content": [{"type": "text", "text": "a"}, "b"], "name": "x", "extra": 1},
            {"role": "assistant", "content": null}
        ]"#,
        );
        let string: Vec<Json> = conversation(&messages, ContentFormat::String)
            .unwrap()
            .iter()
            .map(Message::to_json)
            .collect();
        assert_eq!(
            string[0],
            json(r#"{"role": "user", "content": "a\nb", "name": "x"}"#)
        );
        assert_eq!(string[1], json(r#"{"role": "assistant", "content": ""}"#));
        let openai: Vec<Json> = conversation(&messages, ContentFormat::OpenAi)
            .unwrap()
            .iter()
            .map(Message::to_json)
            .collect();
        assert_eq!(
            openai[0].get("content").unwrap(),
            &json(r#"[{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]"#)
        );
        assert_eq!(openai[1].get("content").unwrap(), &Json::Array(vec![]));
    }

    #[test]
    fn tool_call_arguments_become_objects_as_vllm_reads_them() {
        let messages = json(
            r#"[
            {"role": "assistant", "content": null, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"b\": 1, \"a\": [2]}"}},
                {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "not json"}},
                {"id": "c3", "type": "function", "function": {"name": "h", "arguments": "[1]"}}
            ]},
            {"role": "assistant", "content": "x", "tool_calls": []},
            {"role": "tool", "content": [{"type": "text", "text": "r1"}, {"type": "text", "text": "r2"}], "tool_call_id": "c1"}
        ]"#,
        );
        let out: Vec<Json> = conversation(&messages, ContentFormat::OpenAi)
            .unwrap()
            .iter()
            .map(Message::to_json)
            .collect();
        let calls = out[0].get("tool_calls").unwrap();
        let Json::Array(calls) = calls else { panic!() };
        let arguments = |i: usize| {
            calls[i]
                .get("function")
                .unwrap()
                .get("arguments")
                .unwrap()
                .clone()
        };
        assert_eq!(arguments(0), json(r#"{"b": 1, "a": [2]}"#));
        assert_eq!(arguments(1), Json::Object(vec![]));
        let keys = |value: &Json| match value {
            Json::Object(fields) => fields
                .iter()
                .map(|(name, _)| name.clone())
                .collect::<Vec<_>>(),
            _ => Vec::new(),
        };
        assert_eq!(
            keys(&calls[0]),
            ["id", "function", "type"],
            "vLLM's schema order"
        );
        assert_eq!(
            keys(calls[0].get("function").unwrap()),
            ["arguments", "name"]
        );
        assert_eq!(arguments(2), Json::Object(vec![]));
        assert!(out[1].get("tool_calls").is_none());
        assert_eq!(
            out[2].get("content").unwrap(),
            &Json::String("r1\nr2".into())
        );
        assert_eq!(
            out[2].get("tool_call_id").unwrap(),
            &Json::String("c1".into())
        );
    }

    #[test]
    fn a_message_object_reads_in_a_template_as_the_map_it_stands_for() {
        // Every way a chat template reads a message, rendered once with the message objects
        // and once with plain template maps of the same fields: the same text.
        let source = "{% for m in messages %}{{ m.role }}|{{ m['content'] }}|{{ m.name }}|\
            {{ m.missing is defined }}|{{ 'content' in m }}|{{ 'x' in m }}|{{ m | length }}|\
            {{ m is mapping }}|{{ m.get('name', 'none') }}|{{ m.get('role') }}|\
            {% for k, v in m.items() %}{{ k }}={{ v }},{% endfor %}|{{ m.keys() | list }}|\
            {{ m | tojson }}|{{ m | tojson(indent=2) }}|{{ m | dictsort }}|\
            {{ m == {'role': 'user', 'content': 'a', 'name': 'n'} }}|{{ m == messages[0] }}|\
            {{ m.values() | list }}|{{ m | list | reverse | list }}|{{ dict(m) }}|{{ m ~ '' }}|\
            {{ {m.role: 1}[m.role] }}|{{ [m, m] | unique | list | length }}|\
            {% for k in m %}{{ k }};{% endfor %}|{{ m }}|{{ m.content is string }}|\
            {{ m.tool_calls[0].function.arguments | tojson if m.tool_calls else '' }}|\
            {{ m | first if m else '' }}{% endfor %}\
            {{ messages | selectattr('role', 'equalto', 'tool') | map(attribute='tool_call_id') | list }}\
            {{ messages | map(attribute='role') | list }}{{ messages | reverse | map(attribute='role') | list }}\
            {{ messages | groupby('role') | length }}";
        let template = crate::template::ChatTemplate::new(source.to_owned()).unwrap();
        let messages = json(
            r#"[{"role": "user", "content": "a", "name": "n"},
                {"role": "assistant", "content": null, "reasoning": "r",
                 "tool_calls": [{"id": "c", "type": "function",
                                 "function": {"name": "f", "arguments": "{\"b\": 1, \"a\": [2]}"}}]},
                {"role": "tool", "content": ["x", {"type": "text", "text": "y"}], "tool_call_id": "c"}]"#,
        );
        let converted = conversation(&messages, ContentFormat::String).unwrap();
        // Both ways, and with the final message continued (then it is a plain map, rebuilt
        // with its content tagged, beside the objects).
        for continued in [false, true] {
            let render =
                |values: Vec<Value>| template.render(values, Vec::new(), continued).unwrap();
            let objects = render(converted.iter().cloned().map(Message::into_value).collect());
            let maps = render(converted.iter().map(|m| m.to_json().to_value()).collect());
            assert_eq!(objects, maps, "continue_final_message {continued}");
        }
        let objects = template
            .render(
                converted.iter().cloned().map(Message::into_value).collect(),
                Vec::new(),
                false,
            )
            .unwrap();
        assert!(objects.starts_with(
            "user|a|n|False|True|False|3|True|n|user|role=user,content=a,name=n,|\
             ['role', 'content', 'name']|{\"role\": \"user\", \"content\": \"a\", \"name\": \"n\"}|"
        ));
    }

    #[test]
    fn what_is_not_plain_text_is_left_to_the_engine() {
        for messages in [
            r#"[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:"}}]}]"#,
            r#"[{"role": "user", "content": [{"type": "text", "text": "a", "cache_control": {}}]}]"#,
            r#"[{"role": "developer", "content": "x"}]"#,
            r#"[{"role": "system", "content": "x-anthropic-billing-header: cch=1\nhi"}]"#,
        ] {
            assert!(
                matches!(
                    conversation(&json(messages), ContentFormat::String),
                    Err(Refusal::Engine(_))
                ),
                "{messages}"
            );
        }
        assert!(matches!(
            conversation(&json(r#"[{"content": "x"}]"#), ContentFormat::String),
            Err(Refusal::Invalid(_))
        ));
    }
}
