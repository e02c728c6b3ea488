//! Request bodies and prompts.

/// An OpenAI chat body with one user message.
pub fn chat_body(text: &str, max_tokens: u32, stream: bool) -> String {
    serde_json::json!({
        "model": "chat",
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "stream": stream,
    })
    .to_string()
}

/// A prompt of about `chars` characters that starts with `seed`'s own text, so different
/// seeds differ within the first characters.
pub fn prompt(seed: &str, chars: usize) -> String {
    let mut text = format!("{seed}: ");
    let words = [
        "alpha", "bravo", "delta", "echo", "kilo", "lima", "oscar", "tango",
    ];
    let mut index = seed.len();
    while text.len() < chars {
        text.push_str(words[index % words.len()]);
        text.push(' ');
        index += 1;
    }
    text
}

/// `count` distinct words (one simulator token each) starting at `first`: `w{first} …`.
pub fn words(first: usize, count: usize) -> String {
    (first..first + count)
        .map(|index| format!("w{index}"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// One line of an OpenAI server-sent event stream that says something: see [`sse_lines`].
#[derive(Debug)]
pub enum SseLine {
    /// A comment (`: text`, the router's keep-alives and notes), its text trimmed.
    Comment(String),
    /// `data: [DONE]`.
    Done,
    /// A `data:` line's JSON event.
    Event(serde_json::Value),
}

/// The comments, `[DONE]`s and JSON events of an SSE stream's `text`, in order; other lines
/// (`event:`, blank ones) are left out. An event that is not JSON is an error.
pub fn sse_lines(text: &str) -> anyhow::Result<Vec<SseLine>> {
    let mut lines = Vec::new();
    for line in text.lines() {
        if let Some(comment) = line.strip_prefix(':') {
            lines.push(SseLine::Comment(comment.trim().to_owned()));
        } else if line == "data: [DONE]" {
            lines.push(SseLine::Done);
        } else if let Some(data) = line.strip_prefix("data: ") {
            lines.push(SseLine::Event(serde_json::from_str(data)?));
        }
    }
    Ok(lines)
}

/// The text of an OpenAI choice: a chat chunk's delta, a chat answer's message or a
/// completion's text (`""` when it has none).
pub fn choice_text(choice: &serde_json::Value) -> &str {
    choice["delta"]["content"]
        .as_str()
        .or(choice["message"]["content"].as_str())
        .or(choice["text"].as_str())
        .unwrap_or("")
}
