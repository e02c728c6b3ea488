//! What the flow-control queue orders a request by, read once while planning: its priority
//! (`x-switchyard-priority`, else vLLM's body field `priority`) and its fairness id
//! (`x-switchyard-fairness-id`, else the OpenAI body's `safety_identifier`, else `user`).
//! The headers reach planning only when the router trusts them (`--trust-flow-headers`);
//! otherwise the read phase removed them.

use http::HeaderMap;
use switchyard_policy::openai::OpenAiRequest;

use crate::errors::ApiError;
use crate::headers;

/// Longest fairness id taken from a header, in bytes.
pub const MAX_FAIRNESS_ID_BYTES: usize = 256;

/// A request's place in its variant's queue.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FlowKey {
    /// `x-switchyard-priority` (lower first).
    pub header_priority: Option<i32>,
    /// The body's `priority`, when an integer in range; it still reaches the engine as sent.
    pub body_priority: Option<i32>,
    /// A stable hash of the fairness id (header, else body); None: the one shared id.
    pub fairness: Option<u64>,
}

impl FlowKey {
    /// Reads the key from the (already trusted or stripped) headers and the parsed body. A
    /// priority header that is not an integer, or a fairness id header that is empty or too
    /// long, is refused (400) naming the header.
    pub fn read(headers: &HeaderMap, openai: Option<&OpenAiRequest<'_>>) -> Result<Self, ApiError> {
        let header_priority = match headers.get(&headers::PRIORITY) {
            None => None,
            Some(value) => Some(
                value
                    .to_str()
                    .ok()
                    .and_then(|text| text.trim().parse::<i32>().ok())
                    .ok_or_else(|| {
                        ApiError::validation(format!(
                            "{} must be an integer between {} and {}",
                            headers::PRIORITY,
                            i32::MIN,
                            i32::MAX
                        ))
                    })?,
            ),
        };
        let header_fairness = match headers.get(&headers::FAIRNESS_ID) {
            None => None,
            Some(value) if value.is_empty() || value.len() > MAX_FAIRNESS_ID_BYTES => {
                return Err(ApiError::validation(format!(
                    "{} must be 1-{MAX_FAIRNESS_ID_BYTES} bytes",
                    headers::FAIRNESS_ID
                )));
            }
            Some(value) => Some(fairness_hash(value.as_bytes())),
        };
        let body_fairness = openai
            .and_then(|request| request.end_user.as_deref())
            .map(|id| fairness_hash(id.as_bytes()));
        Ok(Self {
            header_priority,
            body_priority: openai
                .and_then(|request| request.priority)
                .and_then(|priority| i32::try_from(priority).ok()),
            fairness: header_fairness.or(body_fairness),
        })
    }
}

/// A fairness id's hash (ids that collide share a turn, which only makes them less fair to
/// each other).
fn fairness_hash(id: &[u8]) -> u64 {
    switchyard_policy::hash::fairness_key(id)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(pairs: &[(&'static str, &str)], body: &str) -> Result<FlowKey, ApiError> {
        let mut headers = HeaderMap::new();
        for (name, value) in pairs {
            headers.insert(*name, value.parse().unwrap());
        }
        let openai = OpenAiRequest::parse(body.as_bytes()).ok();
        FlowKey::read(&headers, openai.as_ref())
    }

    #[test]
    fn the_header_wins_over_the_body_and_the_body_reads_safety_identifier_then_user() {
        let both = key(
            &[
                ("x-switchyard-priority", "-3"),
                ("x-switchyard-fairness-id", "team-a"),
            ],
            r#"{"priority": 5, "safety_identifier": "u1", "user": "u2"}"#,
        )
        .unwrap();
        assert_eq!(both.header_priority, Some(-3));
        assert_eq!(both.body_priority, Some(5));
        assert_eq!(both.fairness, Some(fairness_hash(b"team-a")));
        let body = key(&[], r#"{"safety_identifier": "u1", "user": "u2"}"#).unwrap();
        assert_eq!(body.fairness, Some(fairness_hash(b"u1")));
        let user = key(&[], r#"{"user": "u2", "priority": 1.5}"#).unwrap();
        assert_eq!(user.fairness, Some(fairness_hash(b"u2")));
        assert_eq!(
            user.body_priority, None,
            "not an integer: the engine judges it"
        );
        assert_eq!(key(&[], "{}").unwrap(), FlowKey::default());
    }

    #[test]
    fn a_bad_priority_or_fairness_header_is_refused_naming_it() {
        let err = key(&[("x-switchyard-priority", "high")], "{}").unwrap_err();
        assert_eq!(err.status, http::StatusCode::BAD_REQUEST);
        assert!(
            err.message.contains("x-switchyard-priority"),
            "{}",
            err.message
        );
        let long = "x".repeat(MAX_FAIRNESS_ID_BYTES + 1);
        let err = key(&[("x-switchyard-fairness-id", &long)], "{}").unwrap_err();
        assert!(
            err.message.contains("x-switchyard-fairness-id"),
            "{}",
            err.message
        );
    }
}
