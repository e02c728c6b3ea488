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
