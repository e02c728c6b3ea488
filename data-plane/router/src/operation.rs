//! What a request asks for: the API it came in on and the path it takes on the instance.

use switchyard_policy::openai::TextRule;

use crate::errors::Api;
use crate::routing::table::InstanceRoute;

/// What a request asks for: the API it came in on and the path it takes on the instance.
/// The OpenAI operations are served at vLLM's paths, plain (the body's `model`, or a response
/// id, names the endpoint) and under `/endpoints/{e}/openai/`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Operation {
    Invocations,
    InvocationsStream,
    ChatCompletions,
    Completions,
    /// `POST /v1/responses`.
    Responses,
    /// `GET /v1/responses/{id}`.
    ResponseRetrieve,
    /// `DELETE /v1/responses/{id}` (OpenAI's; vLLM does not serve it).
    ResponseDelete,
    /// `POST /v1/responses/{id}/cancel`.
    ResponseCancel,
    /// `POST /v1/embeddings`.
    Embeddings,
    /// `POST /pooling`.
    Pooling,
    /// `POST /classify`.
    Classify,
    /// `POST /score`.
    Score,
    /// `POST /v1/score`.
    ScoreV1,
    /// `POST /rerank`.
    Rerank,
    /// `POST /v1/rerank`.
    RerankV1,
    /// `POST /v2/rerank`.
    RerankV2,
    /// `POST /tokenize`.
    Tokenize,
    /// `POST /detokenize`.
    Detokenize,
}

impl Operation {
    pub(crate) fn api(self) -> Api {
        match self {
            Operation::Invocations | Operation::InvocationsStream => Api::Native,
            _ => Api::OpenAi,
        }
    }

    /// The HTTP method, here and on the instance.
    pub(crate) fn method(self) -> http::Method {
        match self {
            Operation::ResponseRetrieve => http::Method::GET,
            Operation::ResponseDelete => http::Method::DELETE,
            _ => http::Method::POST,
        }
    }

    /// The instance's URL for this operation, when it is made once per instance (the
    /// busiest paths); the others are made per request from [`Plan::path`].
    pub(crate) fn upstream(self, instance: &InstanceRoute) -> Option<&http::Uri> {
        match self {
            Operation::Invocations | Operation::InvocationsStream => Some(&instance.invocations),
            Operation::ChatCompletions => Some(&instance.chat_completions),
            Operation::Completions => Some(&instance.completions),
            _ => None,
        }
    }

    /// The path on the instance of an operation with a fixed one and no prepared URL.
    pub(crate) fn fixed_path(self) -> Option<&'static str> {
        Some(match self {
            Operation::Responses => "/v1/responses",
            Operation::Embeddings => "/v1/embeddings",
            Operation::Pooling => "/pooling",
            Operation::Classify => "/classify",
            Operation::Score => "/score",
            Operation::ScoreV1 => "/v1/score",
            Operation::Rerank => "/rerank",
            Operation::RerankV1 => "/v1/rerank",
            Operation::RerankV2 => "/v2/rerank",
            Operation::Tokenize => "/tokenize",
            Operation::Detokenize => "/detokenize",
            _ => return None,
        })
    }

    /// Where PREFIX_AWARE takes the prefix text from (`policy::openai`).
    pub(crate) fn text_rule(self) -> TextRule {
        match self {
            Operation::Responses => TextRule::Responses,
            Operation::Embeddings | Operation::Pooling | Operation::Classify => TextRule::Input,
            Operation::Score | Operation::ScoreV1 => TextRule::Score,
            Operation::Rerank | Operation::RerankV1 | Operation::RerankV2 => TextRule::Rerank,
            Operation::Detokenize => TextRule::Tokens,
            _ => TextRule::Chat,
        }
    }

    /// Chat and completions: generation whose prompt a disaggregated endpoint may prefill
    /// elsewhere.
    pub(crate) fn is_generation(self) -> bool {
        matches!(self, Operation::ChatCompletions | Operation::Completions)
    }

    /// Inference work an engine schedules, which waits for a slot under flow control
    /// (MaxInFlightPerInstance); `/tokenize`, `/detokenize` and the requests about a stored
    /// response do not wait.
    pub(crate) fn queues(self) -> bool {
        !matches!(self, Operation::Tokenize | Operation::Detokenize)
            && !self.names_stored_response()
    }

    /// A request about the stored response its path names (`/v1/responses/{id}[/cancel]`).
    pub(crate) fn names_stored_response(self) -> bool {
        matches!(
            self,
            Operation::ResponseRetrieve | Operation::ResponseDelete | Operation::ResponseCancel
        )
    }

    /// Answers carry response ids, which `response_ids::adapt` wraps.
    pub(crate) fn answers_with_response_ids(self) -> bool {
        self == Operation::Responses || self.names_stored_response()
    }
}
