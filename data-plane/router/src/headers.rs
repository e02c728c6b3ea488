//! Every header name the router reads from clients or writes on answers (besides HTTP's own).

use http::HeaderName;

// Read from clients (SageMaker's routing headers).
/// PREFIX_AWARE: an id hashed with the prefix (1-64 printable ASCII characters).
pub const PREFIX_AWARE_ID: HeaderName = HeaderName::from_static("x-amzn-sagemaker-prefix-aware-id");
/// The variant to send the request to.
pub const TARGET_VARIANT: HeaderName = HeaderName::from_static("x-amzn-sagemaker-target-variant");
/// A session that sticks to one instance.
pub const SESSION_ID: HeaderName = HeaderName::from_static("x-amzn-sagemaker-session-id");
/// Flow control: the request's priority in the router's queue (an integer, lower first, as
/// vLLM's `priority`); read only with `--trust-flow-headers`, else removed.
pub const PRIORITY: HeaderName = HeaderName::from_static("x-switchyard-priority");
/// Flow control: whose share of the queue the request counts against; read only with
/// `--trust-flow-headers`, else removed.
pub const FAIRNESS_ID: HeaderName = HeaderName::from_static("x-switchyard-fairness-id");
/// vLLM's: the data-parallel rank of the engine that serves the request. The router sets it
/// when the KV index names the rank holding the prompt's prefix; a client's own is removed.
pub const DATA_PARALLEL_RANK: HeaderName = HeaderName::from_static("x-data-parallel-rank");
/// The request's id, on both hops and in every log line (made when the client sent none).
pub const REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

// Written on answers: who answered and why.
/// The variant that answered (SageMaker's).
pub const INVOKED_VARIANT: HeaderName =
    HeaderName::from_static("x-amzn-invoked-production-variant");
/// The instance that answered.
pub const INSTANCE: HeaderName = HeaderName::from_static("x-switchyard-instance");
/// Why that instance (`prefix`, `overflow`, `kv`, `direct`, `disaggregated`, `retry`, …).
pub const ROUTE: HeaderName = HeaderName::from_static("x-switchyard-route");
/// A data-parallel instance: the rank the request was sent to (`X-data-parallel-rank`).
pub const SERVING_RANK: HeaderName = HeaderName::from_static("x-switchyard-data-parallel-rank");
/// KV_AWARE: leading prompt tokens the KV index says the serving instance holds.
pub const CACHED_TOKENS: HeaderName = HeaderName::from_static("x-switchyard-cached-tokens");
/// A disaggregated endpoint's count of the prompt (`N`, or `N+` when counting stopped early).
pub const PROMPT_TOKENS: HeaderName = HeaderName::from_static("x-switchyard-prompt-tokens");
/// The prefill instance of a disaggregated request.
pub const PREFILL_INSTANCE: HeaderName = HeaderName::from_static("x-switchyard-prefill-instance");
/// KV_AWARE prefill: leading prompt tokens the prefill pool's KV index says the prefill
/// instance held.
pub const PREFILL_CACHED_TOKENS: HeaderName =
    HeaderName::from_static("x-switchyard-prefill-cached-tokens");
/// Milliseconds the request waited in the router's flow-control queue (for a disaggregated
/// request, its wait for a prefill instance).
pub const QUEUE_MS: HeaderName = HeaderName::from_static("x-switchyard-queue-ms");
/// Microseconds from the request's arrival to its routing decision (body read, plan, token
/// ids, ranking; the flow-control queue's wait not included), as in
/// `switchyard_router_decision_seconds` (with `--decision-time-header`).
pub const DECISION_US: HeaderName = HeaderName::from_static("x-switchyard-decision-us");
/// A disaggregated request: milliseconds it waited for a decode slot after its prefill.
pub const DECODE_QUEUE_MS: HeaderName = HeaderName::from_static("x-switchyard-decode-queue-ms");

// Written on error answers.
/// SageMaker's error type on native errors (`ValidationError`, `ModelError`, …).
pub const ERROR_TYPE: HeaderName = HeaderName::from_static("x-amzn-errortype");
/// OpenAI's clients: do not retry a request that may have reached an engine.
pub const SHOULD_RETRY: HeaderName = HeaderName::from_static("x-should-retry");
/// SageMaker's streaming invoke: the model's own content type.
pub const MODEL_CONTENT_TYPE: HeaderName = HeaderName::from_static("x-amzn-sagemaker-content-type");
