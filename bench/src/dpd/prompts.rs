//! The prompts: single user messages of words that are one token for the router's tokenizer
//! and for the simulator's, long ones topped up to the router's count.

use switchyard_policy::openai::OpenAiRequest;
use switchyard_router::parts::{TokenCounter, count_prompt};

use super::args::{DpdSettings, Load};
use super::report::PromptCounts;
use crate::workload::{
    Message, RequestClass, Role, Session, Text, Trace, TraceRequest, WorkloadKind, WorkloadSpec,
};

/// Common English words: each, with a leading space, is one cl100k_base token (checked at
/// start; words that are not are dropped) and one token of the simulator (≤ 6 letters).
const WORDS: &[&str] = &[
    "the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "was", "with", "be", "by",
    "on", "not", "he", "this", "are", "or", "his", "from", "at", "which", "but", "have", "an",
    "had", "they", "you", "were", "their", "one", "all", "we", "can", "her", "has", "there",
    "been", "if", "more", "when", "will", "would", "who", "so", "no", "she", "other", "its", "may",
    "these", "what", "them", "than", "some", "him", "time", "into", "only", "do", "could", "new",
    "about", "two", "first", "then", "also", "after", "any", "like", "well", "our", "between",
    "used", "many", "over", "such", "where", "most", "very", "state", "years", "those", "must",
    "while", "people", "could", "great", "world", "water", "house", "light", "small", "large",
    "place", "point", "order", "number", "group", "system", "line", "part", "day", "way", "work",
    "life", "hand", "home", "city", "road", "river", "field", "table", "green", "blue", "red",
    "black", "white", "long", "short", "high", "low", "early", "late", "open", "close", "read",
    "write", "data", "model", "token", "cache", "route", "serve", "power", "music", "paper",
    "market", "stone", "tree", "bird", "sound", "color", "story",
];

/// The vocabulary: [`WORDS`] that are one token for both tokenizers.
pub fn vocabulary(tokenizer: &TokenCounter) -> Vec<String> {
    let mut words: Vec<String> = WORDS
        .iter()
        .filter(|word| {
            let spaced = format!(" {word}");
            tokenizer.count(&spaced) == 1 && switchyard_engine_sim::count_tokens(&spaced) == 1
        })
        .map(|word| (*word).to_owned())
        .collect();
    words.sort();
    words.dedup();
    words
}

/// `words` words after `header`, drawn from the vocabulary.
fn text(rng: &mut fastrand::Rng, vocabulary: &[String], header: &str, words: usize) -> String {
    let mut text = String::with_capacity(header.len() + words * 6);
    text.push_str(header);
    for _ in 0..words {
        text.push(' ');
        text.push_str(&vocabulary[rng.usize(..vocabulary.len())]);
    }
    text
}

fn request(content: String, output_tokens: u32, class: RequestClass) -> TraceRequest {
    TraceRequest {
        messages: vec![Message {
            role: Role::User,
            parts: vec![Text::new(content)],
        }],
        max_tokens: output_tokens,
        class,
        group: None,
    }
}

/// The router's full count of a request's prompt (no early stop).
fn router_count(request: &TraceRequest, tokenizer: &TokenCounter) -> anyhow::Result<usize> {
    let body = request.body("bench");
    let parsed = OpenAiRequest::parse(&body).map_err(|err| anyhow::anyhow!("{err:?}"))?;
    Ok(count_prompt(&parsed, tokenizer, usize::MAX).tokens)
}

/// The trace of load number `index`: every prompt distinct from its first block on (the
/// header names the load and the request), long prompts of `long_tokens` as the router counts
/// them, short ones of 64–900.
pub fn trace(
    settings: &DpdSettings,
    index: usize,
    load: &Load,
    tokenizer: &TokenCounter,
    vocabulary: &[String],
    counts: &mut Option<PromptCounts>,
) -> anyhow::Result<Trace> {
    let mut rng = fastrand::Rng::with_seed(settings.seed ^ (index as u64).wrapping_mul(0x9e37));
    let mut sessions = Vec::with_capacity(load.requests);
    for number in 0..load.requests {
        let header = format!("Load {index} request {number}.");
        let long = load.long_fraction >= 1.0 || rng.f64() < load.long_fraction;
        let request = if long {
            // Each vocabulary word is one router token; the header and the chat overhead are
            // counted, then topped up until the count is reached.
            let base = router_count(&request(header.clone(), 1, RequestClass::Long), tokenizer)?;
            let mut words = (settings.long_tokens as usize).saturating_sub(base);
            loop {
                let candidate = request(
                    text(&mut rng, vocabulary, &header, words),
                    settings.output_tokens,
                    RequestClass::Long,
                );
                let counted = router_count(&candidate, tokenizer)?;
                if counted >= settings.long_tokens as usize || words > 200_000 {
                    let engine = switchyard_engine_sim::count_tokens(&candidate.prompt_text());
                    let entry = counts.get_or_insert(PromptCounts {
                        long_router_min: counted,
                        long_engine_min: engine,
                        short_router_max: None,
                    });
                    entry.long_router_min = entry.long_router_min.min(counted);
                    entry.long_engine_min = entry.long_engine_min.min(engine);
                    break candidate;
                }
                words += settings.long_tokens as usize - counted;
            }
        } else {
            let words = rng.usize(64..=900);
            let candidate = request(
                text(&mut rng, vocabulary, &header, words),
                settings.output_tokens,
                RequestClass::Short,
            );
            let counted = router_count(&candidate, tokenizer)?;
            if let Some(entry) = counts.as_mut() {
                entry.short_router_max = Some(entry.short_router_max.unwrap_or(0).max(counted));
            }
            candidate
        };
        sessions.push(Session {
            requests: vec![request],
        });
    }
    let mut spec = WorkloadSpec::defaults(WorkloadKind::Mixed);
    spec.requests = load.requests;
    spec.seed = settings.seed;
    spec.max_tokens = settings.output_tokens;
    spec.long_fraction = load.long_fraction;
    spec.prefixes = 0;
    Ok(Trace { spec, sessions })
}

#[cfg(test)]
mod tests {
    use switchyard_router::parts::TokenCounters;

    use super::*;

    #[test]
    fn the_vocabulary_is_one_token_for_both_tokenizers() {
        let tokenizers = TokenCounters::new(None);
        let tokenizer = tokenizers.get("cl100k_base");
        let words = vocabulary(&tokenizer);
        assert!(words.len() >= 64, "{}", words.len());
        let mut rng = fastrand::Rng::with_seed(1);
        let text = text(&mut rng, &words, "Load 0 request 0.", 500);
        let header = tokenizer.count("Load 0 request 0.");
        assert_eq!(tokenizer.count(&text), header + 500);
    }
}
