//! A bounded record of the latest inference requests, so tests can check what a router sent:
//! trace context, request ids, SageMaker and Switchyard headers, kv_transfer_params.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Mutex;

use http::HeaderMap;
use serde::{Deserialize, Serialize};

/// One inference request as the simulator received it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReceivedRequest {
    /// Request path, e.g. `/v1/chat/completions`.
    pub path: String,
    /// The recorded headers, names lowercase: `traceparent`, `tracestate`, `x-request-id`,
    /// `x-data-parallel-rank`, `x-amzn-sagemaker-*`, `x-switchyard-*` (repeated headers
    /// joined with `", "`).
    pub headers: BTreeMap<String, String>,
    /// `HTTP/1.1` or `HTTP/2.0`.
    pub http_version: String,
    pub body_bytes: usize,
    /// The body's `model` field, if the body parsed and had one.
    pub model: Option<String>,
    pub stream: bool,
    /// Whether the body carried `kv_transfer_params`.
    pub kv_transfer_params: bool,
    /// `kv_transfer_params.do_remote_decode` (a disaggregated prefill request).
    pub do_remote_decode: bool,
    /// `kv_transfer_params.do_remote_prefill` (a disaggregated decode request).
    pub do_remote_prefill: bool,
    /// The body's `kv_transfer_params`, verbatim.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_transfer: Option<serde_json::Value>,
    /// A decode request's hand-off, as this engine judged it: `accepted` (the prefill engine
    /// named issued exactly these blocks for this request: the KV was pulled), or `rejected:
    /// …` (then the engine recomputed the prompt, as vLLM does when a KV load fails).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub handoff: Option<String>,
    /// A prefill instance's LMCache push to its decode partner: `pushed N blocks` or
    /// `push failed: …`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_push: Option<String>,
}

impl ReceivedRequest {
    /// A recorded header by (case-insensitive) name.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .get(&name.to_ascii_lowercase())
            .map(String::as_str)
    }

    /// Copies the headers worth recording from `headers`.
    pub(crate) fn select_headers(headers: &HeaderMap) -> BTreeMap<String, String> {
        let mut selected: BTreeMap<String, String> = BTreeMap::new();
        for (name, value) in headers {
            let name = name.as_str();
            let wanted = matches!(
                name,
                "traceparent" | "tracestate" | "x-request-id" | "x-data-parallel-rank"
            ) || name.starts_with("x-amzn-sagemaker-")
                || name.starts_with("x-switchyard-");
            if !wanted {
                continue;
            }
            let value = String::from_utf8_lossy(value.as_bytes());
            selected
                .entry(name.to_owned())
                .and_modify(|existing| {
                    existing.push_str(", ");
                    existing.push_str(&value);
                })
                .or_insert_with(|| value.into_owned());
        }
        selected
    }
}

/// The latest `capacity` requests, oldest first.
#[derive(Debug)]
pub(crate) struct Recorder {
    capacity: usize,
    requests: Mutex<VecDeque<ReceivedRequest>>,
}

impl Recorder {
    pub(crate) fn new(capacity: usize) -> Self {
        Self {
            capacity,
            requests: Mutex::new(VecDeque::with_capacity(capacity.min(1024))),
        }
    }

    pub(crate) fn record(&self, request: ReceivedRequest) {
        if self.capacity == 0 {
            return;
        }
        let mut requests = self.lock();
        if requests.len() == self.capacity {
            requests.pop_front();
        }
        requests.push_back(request);
    }

    /// Changes the latest record whose `x-request-id` is `request_id`, if it is still kept.
    pub(crate) fn update(&self, request_id: &str, change: impl FnOnce(&mut ReceivedRequest)) {
        let mut requests = self.lock();
        if let Some(record) = requests
            .iter_mut()
            .rev()
            .find(|record| record.header("x-request-id") == Some(request_id))
        {
            change(record);
        }
    }

    pub(crate) fn snapshot(&self) -> Vec<ReceivedRequest> {
        self.lock().iter().cloned().collect()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, VecDeque<ReceivedRequest>> {
        self.requests
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_the_latest_and_selected_headers() {
        let recorder = Recorder::new(2);
        for path in ["/a", "/b", "/c"] {
            recorder.record(ReceivedRequest {
                path: path.into(),
                ..ReceivedRequest::default()
            });
        }
        let paths: Vec<String> = recorder.snapshot().into_iter().map(|r| r.path).collect();
        assert_eq!(paths, ["/b", "/c"]);

        let mut headers = HeaderMap::new();
        headers.insert("traceparent", "00-abc-def-01".parse().unwrap());
        headers.insert("X-Amzn-SageMaker-Session-Id", "s1".parse().unwrap());
        headers.insert("x-switchyard-route", "prefix".parse().unwrap());
        headers.insert("authorization", "secret".parse().unwrap());
        headers.append("x-request-id", "a".parse().unwrap());
        headers.append("x-request-id", "b".parse().unwrap());
        let request = ReceivedRequest {
            headers: ReceivedRequest::select_headers(&headers),
            ..ReceivedRequest::default()
        };
        assert_eq!(request.header("TraceParent"), Some("00-abc-def-01"));
        assert_eq!(request.header("x-amzn-sagemaker-session-id"), Some("s1"));
        assert_eq!(request.header("x-switchyard-route"), Some("prefix"));
        assert_eq!(request.header("x-request-id"), Some("a, b"));
        assert_eq!(request.header("authorization"), None);
    }
}
