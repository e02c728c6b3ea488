//! Workloads: deterministic traces of OpenAI chat requests, generated from a seed.
//!
//! A [`Trace`] is a list of sessions; a session is a list of requests sent one after the other
//! (the turns of a conversation; a single request for the single-turn workloads). Texts are
//! made of pseudo-words of 2–6 letters and punctuation, so that the simulator's tokenizer
//! counts them exactly (one token per word or punctuation mark, see
//! `switchyard_engine_sim::tokenizer`); a real tokenizer would count about the same.
//!
//! | workload | what it models |
//! | --- | --- |
//! | `long-context` | `prefixes` shared prefixes (a system message of `prefix_tokens` tokens: a long document, a policy, a code file) and a distinct question per request; each request draws its prefix from a uniform (or Zipf, `zipf > 0`) popularity, independently, so first uses are spread over the run. |
//! | `sharegpt` | ShareGPT-like chats: 2–8 turns, user messages of 16–512 tokens and answers of 32–512 (log-uniform), each turn resending the whole history; one of `prefixes` system prompts of `prefix_tokens` tokens per conversation. |
//! | `rag` | `prefixes` documents of 2,000–6,000 tokens after a shared instruction; many questions per document (Zipf popularity, `zipf`, default 0.9). |
//! | `mixed` | long (`prefix_tokens` ≥ 8,000 shared prefixes, as `long-context`) and short (64–900 tokens, unshared) prompts, `long_fraction` of them long: the load that disaggregated prefill/decode is for. |
//!
//! The answers in a conversation's history are part of the trace (generated here, not taken
//! from the engine), so the trace, and the oracle bound computed from it, do not depend on
//! what the engines answer.

use std::sync::Arc;

use bytes::Bytes;
use serde::Serialize;

use crate::flags::set;

/// Which workload to generate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, clap::ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum WorkloadKind {
    /// Shared prefixes of ~8,000 tokens, a distinct question per request.
    LongContext,
    /// Multi-turn chats of variable length, each turn resending the history.
    Sharegpt,
    /// A pool of documents, many questions per document.
    Rag,
    /// Long (≥ 8,000 tokens) and short (< 1,000 tokens) prompts mixed.
    Mixed,
}

impl WorkloadKind {
    pub fn as_str(self) -> &'static str {
        match self {
            WorkloadKind::LongContext => "long-context",
            WorkloadKind::Sharegpt => "sharegpt",
            WorkloadKind::Rag => "rag",
            WorkloadKind::Mixed => "mixed",
        }
    }
}

impl std::fmt::Display for WorkloadKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Flags that override a workload's defaults (shared by `compare` and driving a router).
#[derive(Debug, Clone, Default, clap::Args)]
pub struct TraceArgs {
    /// Requests in the trace (conversation turns count one each).
    #[arg(long, value_name = "N")]
    pub requests: Option<usize>,
    /// Seed of the trace (and of the open loop's arrivals): same seed, same requests.
    #[arg(long, value_name = "N")]
    pub seed: Option<u64>,
    /// Shared prefixes (long-context, mixed), documents (rag) or system prompts (sharegpt).
    #[arg(long, value_name = "N")]
    pub prefixes: Option<usize>,
    /// Tokens per shared prefix (long-context, mixed) or system prompt (sharegpt).
    #[arg(long, value_name = "TOKENS", conflicts_with = "prefix_chars")]
    pub prefix_tokens: Option<u32>,
    /// long-context, mixed: the size of each shared prefix in characters instead of tokens
    /// (words are added until it is reached, so a prefix may be a few characters longer).
    #[arg(long, value_name = "CHARS")]
    pub prefix_chars: Option<u32>,
    /// Prefix popularity: 0 uniform, s > 0 Zipf with exponent s.
    #[arg(long, value_name = "S")]
    pub zipf: Option<f64>,
    /// Output tokens per request.
    #[arg(long, value_name = "TOKENS")]
    pub max_tokens: Option<u32>,
    /// mixed: fraction of long prompts.
    #[arg(long, value_name = "F")]
    pub long_fraction: Option<f64>,
}

impl TraceArgs {
    /// Applies every flag given to `spec`.
    pub fn apply(&self, spec: &mut WorkloadSpec) {
        set(&mut spec.requests, self.requests);
        set(&mut spec.seed, self.seed);
        set(&mut spec.prefixes, self.prefixes);
        set(&mut spec.prefix_tokens, self.prefix_tokens);
        if self.prefix_chars.is_some() {
            spec.prefix_chars = self.prefix_chars;
        } else if self.prefix_tokens.is_some() {
            spec.prefix_chars = None;
        }
        set(&mut spec.zipf, self.zipf);
        set(&mut spec.max_tokens, self.max_tokens);
        set(&mut spec.long_fraction, self.long_fraction);
    }
}

/// Everything a trace is generated from. Same spec, same trace.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct WorkloadSpec {
    pub kind: WorkloadKind,
    /// Requests in the trace (conversation turns count one each).
    pub requests: usize,
    pub seed: u64,
    /// long-context and mixed: distinct shared prefixes; rag: documents; sharegpt: system prompts.
    pub prefixes: usize,
    /// long-context and mixed: tokens of each shared prefix; sharegpt: of each system prompt
    /// (rag documents are 2,000–6,000 tokens).
    pub prefix_tokens: u32,
    /// long-context and mixed: when set, each shared prefix is this many characters (about)
    /// instead of `prefix_tokens` tokens.
    pub prefix_chars: Option<u32>,
    /// Popularity of the prefixes (documents): 0 is uniform, s > 0 is Zipf with exponent s.
    pub zipf: f64,
    /// Output tokens per request (sharegpt: at most this, the answer's length in the history).
    pub max_tokens: u32,
    /// mixed: the fraction of long requests.
    pub long_fraction: f64,
}

impl WorkloadSpec {
    /// The documented defaults of each workload.
    pub fn defaults(kind: WorkloadKind) -> Self {
        let base = Self {
            kind,
            requests: 1000,
            seed: 1,
            prefixes: 64,
            prefix_tokens: 8000,
            prefix_chars: None,
            zipf: 0.0,
            max_tokens: 64,
            long_fraction: 0.3,
        };
        match kind {
            WorkloadKind::LongContext | WorkloadKind::Mixed => base,
            WorkloadKind::Sharegpt => Self {
                prefixes: 4,
                prefix_tokens: 300,
                max_tokens: 256,
                ..base
            },
            WorkloadKind::Rag => Self {
                zipf: 0.9,
                max_tokens: 128,
                ..base
            },
        }
    }

    /// Checks the values; the message names the flag.
    pub fn validate(&self) -> Result<(), WorkloadError> {
        if self.requests == 0 {
            return Err(WorkloadError::NoRequests);
        }
        if self.prefixes == 0 {
            return Err(WorkloadError::NoPrefixes);
        }
        if self.prefix_tokens == 0 {
            return Err(WorkloadError::NoPrefixTokens);
        }
        if let Some(chars) = self.prefix_chars
            && !(MIN_PREFIX_CHARS..=MAX_PREFIX_CHARS).contains(&chars)
        {
            return Err(WorkloadError::PrefixChars(chars));
        }
        if !(self.zipf.is_finite() && self.zipf >= 0.0) {
            return Err(WorkloadError::Zipf(self.zipf));
        }
        if self.max_tokens == 0 {
            return Err(WorkloadError::NoMaxTokens);
        }
        if !(0.0..=1.0).contains(&self.long_fraction) {
            return Err(WorkloadError::LongFraction(self.long_fraction));
        }
        Ok(())
    }
}

/// A workload value out of its range; the message names the flag.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum WorkloadError {
    #[error("--requests must be at least 1")]
    NoRequests,
    #[error("--prefixes must be at least 1")]
    NoPrefixes,
    #[error("--prefix-tokens must be at least 1")]
    NoPrefixTokens,
    #[error("--prefix-chars must be within {MIN_PREFIX_CHARS}-{MAX_PREFIX_CHARS}, got {0}")]
    PrefixChars(u32),
    #[error("--zipf must be zero or more, got {0}")]
    Zipf(f64),
    #[error("--max-tokens must be at least 1")]
    NoMaxTokens,
    #[error("--long-fraction must be within 0-1, got {0}")]
    LongFraction(f64),
}

/// The range of `--prefix-chars`: room for the "Document N." that starts each prefix, and at
/// most about a million tokens.
pub const MIN_PREFIX_CHARS: u32 = 32;
pub const MAX_PREFIX_CHARS: u32 = 4_000_000;

/// A text with its JSON-escaped form (without quotes), both shared.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Text {
    raw: Arc<str>,
    json: Arc<str>,
}

impl Text {
    pub fn new(raw: String) -> Self {
        let quoted = serde_json::to_string(&raw).unwrap_or_else(|_| "\"\"".to_owned());
        let json = quoted[1..quoted.len() - 1].to_owned();
        Self {
            raw: raw.into(),
            json: json.into(),
        }
    }

    pub fn as_str(&self) -> &str {
        &self.raw
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    System,
    User,
    Assistant,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::System => "system",
            Role::User => "user",
            Role::Assistant => "assistant",
        }
    }
}

/// A chat message whose content is the concatenation of `parts` (sent as one string).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    pub role: Role,
    pub parts: Vec<Text>,
}

impl Message {
    fn new(role: Role, parts: Vec<Text>) -> Self {
        Self { role, parts }
    }

    /// The content as one string.
    pub fn content(&self) -> String {
        self.parts.iter().map(Text::as_str).collect()
    }
}

/// Long (≥ 8,000 tokens with the default prefix) or short prompt, for reporting per class.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum RequestClass {
    Long,
    Short,
}

/// One request of a trace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceRequest {
    pub messages: Vec<Message>,
    pub max_tokens: u32,
    pub class: RequestClass,
    /// The shared prefix (document, system prompt) it uses, if any.
    pub group: Option<u32>,
}

impl TraceRequest {
    /// The OpenAI chat body, streaming with usage, `model` set to `model`.
    pub fn body(&self, model: &str) -> Bytes {
        let content_len: usize = self
            .messages
            .iter()
            .flat_map(|message| &message.parts)
            .map(|part| part.json.len())
            .sum();
        let mut body = String::with_capacity(content_len + 64 * self.messages.len() + 160);
        body.push_str("{\"model\":");
        body.push_str(&serde_json::to_string(model).unwrap_or_else(|_| "\"\"".into()));
        body.push_str(",\"messages\":[");
        for (index, message) in self.messages.iter().enumerate() {
            if index > 0 {
                body.push(',');
            }
            body.push_str("{\"role\":\"");
            body.push_str(message.role.as_str());
            body.push_str("\",\"content\":\"");
            for part in &message.parts {
                body.push_str(&part.json);
            }
            body.push_str("\"}");
        }
        body.push_str("],\"max_tokens\":");
        body.push_str(&self.max_tokens.to_string());
        // `ignore_eos` makes a real vLLM generate exactly max_tokens, as the simulator does.
        body.push_str(
            ",\"ignore_eos\":true,\"stream\":true,\"stream_options\":{\"include_usage\":true}}",
        );
        Bytes::from(body)
    }

    /// The `/tokenize` body of the request's prompt (its messages), for the oracle bound with
    /// a real tokenizer.
    pub fn tokenize_body(&self) -> Vec<u8> {
        serde_json::json!({ "messages": self.messages_json() })
            .to_string()
            .into_bytes()
    }

    /// The prompt as the simulator sees it (its chat template), for the oracle bound.
    pub fn prompt_text(&self) -> String {
        switchyard_engine_sim::chat_prompt_text(&self.messages_json())
    }

    /// The messages as OpenAI chat JSON (`role` and `content`).
    fn messages_json(&self) -> Vec<serde_json::Value> {
        self.messages
            .iter()
            .map(|message| {
                serde_json::json!({"role": message.role.as_str(), "content": message.content()})
            })
            .collect()
    }
}

/// Requests sent one after the other (the turns of one conversation).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Session {
    pub requests: Vec<TraceRequest>,
}

/// A whole workload, generated once, sent to every strategy unchanged.
#[derive(Debug, Clone, PartialEq)]
pub struct Trace {
    pub spec: WorkloadSpec,
    pub sessions: Vec<Session>,
}

impl Trace {
    /// Generates the trace of `spec` (deterministic: same spec, same trace).
    pub fn generate(spec: &WorkloadSpec) -> Result<Self, WorkloadError> {
        spec.validate()?;
        let mut generator = Generator::new(spec.seed);
        let sessions = match spec.kind {
            WorkloadKind::LongContext => generator.long_context(spec),
            WorkloadKind::Sharegpt => generator.sharegpt(spec),
            WorkloadKind::Rag => generator.rag(spec),
            WorkloadKind::Mixed => generator.mixed(spec),
        };
        Ok(Self {
            spec: spec.clone(),
            sessions,
        })
    }

    pub fn request_count(&self) -> usize {
        self.sessions
            .iter()
            .map(|session| session.requests.len())
            .sum()
    }

    /// Every request, session by session.
    pub fn requests(&self) -> impl Iterator<Item = &TraceRequest> {
        self.sessions.iter().flat_map(|session| &session.requests)
    }

    /// The order in which `concurrency` closed-loop clients would send the requests if every
    /// request took the same time: each client takes the next session when its own is done,
    /// and the clients take turns. Single-turn traces are simply in trace order. The oracle's
    /// capacity bound assumes this order.
    pub fn nominal_order(&self, concurrency: usize) -> Vec<&TraceRequest> {
        let concurrency = concurrency.max(1);
        let mut order = Vec::with_capacity(self.request_count());
        let mut next_session = 0;
        let mut slots: Vec<Option<(usize, usize)>> = vec![None; concurrency];
        loop {
            let mut active = false;
            for slot in &mut slots {
                if slot.is_none() && next_session < self.sessions.len() {
                    *slot = Some((next_session, 0));
                    next_session += 1;
                }
                let Some((session, turn)) = *slot else {
                    continue;
                };
                active = true;
                order.push(&self.sessions[session].requests[turn]);
                *slot = (turn + 1 < self.sessions[session].requests.len())
                    .then_some((session, turn + 1));
            }
            if !active {
                break;
            }
        }
        order
    }

    /// Prompt tokens of the whole trace by the simulator's tokenizer and chat template.
    pub fn prompt_tokens(&self) -> u64 {
        self.requests()
            .map(|request| switchyard_engine_sim::count_tokens(&request.prompt_text()) as u64)
            .sum()
    }
}

/// The seeded text and popularity generator.
struct Generator {
    rng: fastrand::Rng,
    vocabulary: Vec<String>,
}

const VOCABULARY_WORDS: usize = 4096;

impl Generator {
    fn new(seed: u64) -> Self {
        let mut rng = fastrand::Rng::with_seed(seed);
        let vocabulary = (0..VOCABULARY_WORDS)
            .map(|_| {
                let len = rng.usize(2..=6);
                (0..len).map(|_| rng.lowercase()).collect()
            })
            .collect();
        Self { rng, vocabulary }
    }

    /// Words before the next punctuation mark.
    fn sentence_length(&mut self) -> u32 {
        self.rng.u32(8..=24)
    }

    /// Appends a random vocabulary word to `text`, after a space unless `text` is empty.
    fn push_word(&mut self, text: &mut String) {
        if !text.is_empty() {
            text.push(' ');
        }
        let word = self.rng.usize(..self.vocabulary.len());
        text.push_str(&self.vocabulary[word]);
    }

    /// Exactly `tokens` tokens of prose by the simulator's tokenizer: words of 2–6 letters
    /// (one token each, with their leading space) and punctuation (one token each).
    fn prose(&mut self, tokens: u32) -> String {
        let mut text = String::with_capacity(tokens as usize * 6);
        let mut sentence_left = self.sentence_length();
        for emitted in 0..tokens {
            let last = emitted + 1 == tokens;
            if sentence_left == 0 || last {
                let mark = if last {
                    '.'
                } else {
                    self.rng.choice(['.', ',', ';']).unwrap_or('.')
                };
                text.push(mark);
                sentence_left = self.sentence_length();
                continue;
            }
            self.push_word(&mut text);
            sentence_left -= 1;
        }
        text
    }

    /// Prose as [`Generator::prose`] writes it, of `chars` characters or a few more (the
    /// word that reaches the size and the final ".").
    fn prose_chars(&mut self, chars: usize) -> String {
        let mut text = String::with_capacity(chars + 8);
        let mut sentence_left = self.sentence_length();
        while text.len() + 1 < chars {
            if sentence_left == 0 {
                text.push(self.rng.choice(['.', ',', ';']).unwrap_or('.'));
                sentence_left = self.sentence_length();
                continue;
            }
            self.push_word(&mut text);
            sentence_left -= 1;
        }
        text.push('.');
        text
    }

    /// A question: `tokens` tokens ending with "?", numbered so that no two are equal.
    fn question(&mut self, number: usize, tokens: u32) -> String {
        // "Question N:" is 4 tokens ("Questi", "on", " N", ":"); the prose's final "." becomes
        // the "?".
        let body = self.prose(tokens.saturating_sub(4).max(2));
        let body = body.strip_suffix('.').unwrap_or(&body);
        format!("Question {number}: {body}?")
    }

    /// A log-uniform integer in `low..=high`.
    fn log_uniform(&mut self, low: u32, high: u32) -> u32 {
        let (low_ln, high_ln) = (f64::from(low).ln(), f64::from(high).ln());
        let value = (low_ln + (high_ln - low_ln) * self.rng.f64()).exp().round() as u32;
        value.clamp(low, high)
    }

    fn long_prefixes(&mut self, spec: &WorkloadSpec) -> Vec<Text> {
        (0..spec.prefixes)
            .map(|index| {
                // "Document N." starts each prefix: different prefixes differ at once.
                let head = format!("Document {index}. ");
                let body = match spec.prefix_chars {
                    Some(chars) => self.prose_chars((chars as usize).saturating_sub(head.len())),
                    None => self.prose(spec.prefix_tokens.saturating_sub(4).max(1)),
                };
                Text::new(head + &body)
            })
            .collect()
    }

    fn long_request(
        &mut self,
        spec: &WorkloadSpec,
        prefixes: &[Text],
        popularity: &Popularity,
        number: usize,
    ) -> TraceRequest {
        let prefix = popularity.draw(&mut self.rng);
        let tokens = self.rng.u32(16..=48);
        let question = Text::new(self.question(number, tokens));
        TraceRequest {
            messages: vec![
                Message::new(Role::System, vec![prefixes[prefix].clone()]),
                Message::new(Role::User, vec![question]),
            ],
            max_tokens: spec.max_tokens,
            class: RequestClass::Long,
            group: Some(prefix as u32),
        }
    }

    fn long_context(&mut self, spec: &WorkloadSpec) -> Vec<Session> {
        let prefixes = self.long_prefixes(spec);
        let popularity = Popularity::new(spec.prefixes, spec.zipf);
        (0..spec.requests)
            .map(|number| Session {
                requests: vec![self.long_request(spec, &prefixes, &popularity, number)],
            })
            .collect()
    }

    fn sharegpt(&mut self, spec: &WorkloadSpec) -> Vec<Session> {
        let systems: Vec<Text> = (0..spec.prefixes)
            .map(|index| {
                let body = self.prose(spec.prefix_tokens.saturating_sub(4).max(1));
                Text::new(format!("Assistant {index}. {body}"))
            })
            .collect();
        let popularity = Popularity::new(spec.prefixes, spec.zipf);
        let mut sessions = Vec::new();
        let mut left = spec.requests;
        let mut number = 0;
        while left > 0 {
            let turns = self.rng.usize(2..=8).min(left);
            left -= turns;
            let system = popularity.draw(&mut self.rng);
            let mut history = vec![Message::new(Role::System, vec![systems[system].clone()])];
            let mut requests = Vec::with_capacity(turns);
            for _ in 0..turns {
                let user_tokens = self.log_uniform(16, 512);
                let user = Text::new(format!("Chat {number}. {}", self.prose(user_tokens)));
                number += 1;
                history.push(Message::new(Role::User, vec![user]));
                let answer_tokens = self.log_uniform(32, 512).min(spec.max_tokens);
                requests.push(TraceRequest {
                    messages: history.clone(),
                    max_tokens: answer_tokens,
                    class: RequestClass::Short,
                    group: Some(system as u32),
                });
                let answer = Text::new(self.prose(answer_tokens));
                history.push(Message::new(Role::Assistant, vec![answer]));
            }
            sessions.push(Session { requests });
        }
        sessions
    }

    fn rag(&mut self, spec: &WorkloadSpec) -> Vec<Session> {
        let instruction = Text::new(format!(
            "Answer the question from the document only. {}",
            self.prose(140)
        ));
        let documents: Vec<Text> = (0..spec.prefixes)
            .map(|index| {
                let tokens = self.rng.u32(2000..=6000);
                Text::new(format!("Document {index}.\n{}\n\n", self.prose(tokens)))
            })
            .collect();
        let popularity = Popularity::new(spec.prefixes, spec.zipf);
        (0..spec.requests)
            .map(|number| {
                let document = popularity.draw(&mut self.rng);
                let tokens = self.rng.u32(12..=40);
                let question = Text::new(self.question(number, tokens));
                Session {
                    requests: vec![TraceRequest {
                        messages: vec![
                            Message::new(Role::System, vec![instruction.clone()]),
                            Message::new(Role::User, vec![documents[document].clone(), question]),
                        ],
                        max_tokens: spec.max_tokens,
                        class: RequestClass::Long,
                        group: Some(document as u32),
                    }],
                }
            })
            .collect()
    }

    fn mixed(&mut self, spec: &WorkloadSpec) -> Vec<Session> {
        let prefixes = self.long_prefixes(spec);
        let popularity = Popularity::new(spec.prefixes, spec.zipf);
        (0..spec.requests)
            .map(|number| {
                let request = if self.rng.f64() < spec.long_fraction {
                    self.long_request(spec, &prefixes, &popularity, number)
                } else {
                    let tokens = self.log_uniform(64, 900);
                    let text = Text::new(format!("Note {number}. {}", self.prose(tokens)));
                    TraceRequest {
                        messages: vec![Message::new(Role::User, vec![text])],
                        max_tokens: spec.max_tokens,
                        class: RequestClass::Short,
                        group: None,
                    }
                };
                Session {
                    requests: vec![request],
                }
            })
            .collect()
    }
}

/// Uniform or Zipf popularity over `n` items (item k has weight 1 / (k + 1)^s).
struct Popularity {
    cumulative: Vec<f64>,
}

impl Popularity {
    fn new(items: usize, exponent: f64) -> Self {
        let mut total = 0.0;
        let cumulative = (0..items.max(1))
            .map(|k| {
                total += if exponent == 0.0 {
                    1.0
                } else {
                    1.0 / ((k + 1) as f64).powf(exponent)
                };
                total
            })
            .collect();
        Self { cumulative }
    }

    fn draw(&self, rng: &mut fastrand::Rng) -> usize {
        let total = self.cumulative.last().copied().unwrap_or(1.0);
        let target = rng.f64() * total;
        self.cumulative
            .partition_point(|&edge| edge <= target)
            .min(self.cumulative.len() - 1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use switchyard_engine_sim::count_tokens;

    fn spec(kind: WorkloadKind) -> WorkloadSpec {
        WorkloadSpec {
            requests: 40,
            prefixes: 5,
            prefix_tokens: 300,
            ..WorkloadSpec::defaults(kind)
        }
    }

    #[test]
    fn same_seed_same_trace_other_seed_other_trace() {
        for kind in [
            WorkloadKind::LongContext,
            WorkloadKind::Sharegpt,
            WorkloadKind::Rag,
            WorkloadKind::Mixed,
        ] {
            let first = Trace::generate(&spec(kind)).unwrap();
            let second = Trace::generate(&spec(kind)).unwrap();
            assert_eq!(first, second, "{kind}");
            let bodies = |trace: &Trace| -> Vec<Bytes> {
                trace.requests().map(|request| request.body("e")).collect()
            };
            assert_eq!(bodies(&first), bodies(&second), "{kind}");
            let other = Trace::generate(&WorkloadSpec {
                seed: 2,
                ..spec(kind)
            })
            .unwrap();
            assert_ne!(bodies(&first), bodies(&other), "{kind}");
            assert_eq!(first.request_count(), 40, "{kind}");
        }
    }

    #[test]
    fn prose_has_the_exact_token_count() {
        let mut generator = Generator::new(7);
        for tokens in [1, 2, 15, 16, 17, 100, 8000] {
            assert_eq!(count_tokens(&generator.prose(tokens)), tokens as usize);
        }
        let question = generator.question(12, 30);
        assert_eq!(count_tokens(&question), 30, "{question}");
    }

    #[test]
    fn long_context_requests_share_their_prefix_and_nothing_else() {
        let trace = Trace::generate(&spec(WorkloadKind::LongContext)).unwrap();
        let requests: Vec<&TraceRequest> = trace.requests().collect();
        let same: Vec<&&TraceRequest> = requests
            .iter()
            .filter(|request| request.group == requests[0].group)
            .collect();
        assert!(same.len() >= 2);
        assert_eq!(same[0].messages[0], same[1].messages[0]);
        assert_ne!(same[0].messages[1], same[1].messages[1]);
        let prefix_tokens = count_tokens(same[0].messages[0].parts[0].as_str());
        assert_eq!(prefix_tokens, 300);
        // Every prefix is used at least once with 40 draws over 5 (uniform, seeded).
        let mut groups: Vec<u32> = requests.iter().filter_map(|r| r.group).collect();
        groups.sort_unstable();
        groups.dedup();
        assert_eq!(groups.len(), 5);
    }

    #[test]
    fn prefixes_given_in_characters_have_that_size() {
        let trace = Trace::generate(&WorkloadSpec {
            prefix_chars: Some(32_000),
            ..spec(WorkloadKind::LongContext)
        })
        .unwrap();
        for request in trace.requests() {
            let prefix = request.messages[0].content();
            // At most one word (6 letters and its space) and the final "." past the size.
            assert!(
                (32_000..=32_008).contains(&prefix.len()),
                "{}",
                prefix.len()
            );
            assert!(prefix.starts_with("Document ") && prefix.ends_with('.'));
        }
        let too_small = WorkloadSpec {
            prefix_chars: Some(MIN_PREFIX_CHARS - 1),
            ..spec(WorkloadKind::LongContext)
        };
        assert_eq!(
            too_small.validate(),
            Err(WorkloadError::PrefixChars(MIN_PREFIX_CHARS - 1))
        );
    }

    #[test]
    fn sharegpt_turns_resend_the_history() {
        let trace = Trace::generate(&spec(WorkloadKind::Sharegpt)).unwrap();
        let session = trace
            .sessions
            .iter()
            .find(|session| session.requests.len() >= 2)
            .unwrap();
        let (first, second) = (&session.requests[0], &session.requests[1]);
        assert_eq!(first.messages[..], second.messages[..first.messages.len()]);
        assert_eq!(second.messages.len(), first.messages.len() + 2);
        assert_eq!(second.messages[first.messages.len()].role, Role::Assistant);
        // The earlier prompt's text is a prefix of the later one's, up to the template's end.
        let earlier = first.prompt_text();
        let later = second.prompt_text();
        let shared = earlier.trim_end_matches("<|assistant|>\n");
        assert!(later.starts_with(shared));
        assert!(
            trace
                .sessions
                .iter()
                .all(|s| (1..=8).contains(&s.requests.len()))
        );
    }

    #[test]
    fn mixed_has_long_and_short_prompts() {
        let trace = Trace::generate(&WorkloadSpec {
            requests: 200,
            prefix_tokens: 8000,
            ..spec(WorkloadKind::Mixed)
        })
        .unwrap();
        let long = trace
            .requests()
            .filter(|request| request.class == RequestClass::Long)
            .count();
        assert!((30..=100).contains(&long), "{long} long of 200");
        for request in trace.requests() {
            let tokens = count_tokens(&request.prompt_text());
            match request.class {
                RequestClass::Long => assert!(tokens >= 8000, "{tokens}"),
                RequestClass::Short => assert!(tokens < 1000, "{tokens}"),
            }
        }
    }

    #[test]
    fn bodies_are_valid_openai_chat_json() {
        let trace = Trace::generate(&spec(WorkloadKind::Rag)).unwrap();
        let request = trace.requests().next().unwrap();
        let body: serde_json::Value = serde_json::from_slice(&request.body("chat")).unwrap();
        assert_eq!(body["model"], "chat");
        assert_eq!(body["stream"], true);
        assert_eq!(
            body["messages"][1]["content"],
            request.messages[1].content()
        );
        assert_eq!(
            switchyard_engine_sim::chat_prompt_text(body["messages"].as_array().unwrap()),
            request.prompt_text()
        );
    }

    #[test]
    fn zipf_prefers_the_first_items() {
        let popularity = Popularity::new(10, 1.0);
        let mut rng = fastrand::Rng::with_seed(3);
        let mut counts = [0usize; 10];
        for _ in 0..10_000 {
            counts[popularity.draw(&mut rng)] += 1;
        }
        assert!(counts[0] > counts[1] && counts[1] > counts[9]);
        let uniform = Popularity::new(4, 0.0);
        let mut counts = [0usize; 4];
        for _ in 0..4000 {
            counts[uniform.draw(&mut rng)] += 1;
        }
        assert!(counts.iter().all(|&count| (850..=1150).contains(&count)));
    }
}
