//! Errors in the shape each API's clients expect: SageMaker-style on the native paths
//! (`{"ErrorCode":"ValidationError","Message":...}` with `x-amzn-ErrorType`), OpenAI-style on
//! the OpenAI paths (`{"error":{"message","type","param","code"}}`).

use axum::response::{IntoResponse, Response};
use http::{HeaderValue, StatusCode};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    Native,
    OpenAi,
}

/// Why the router answered with an error: the `kind` label of
/// `switchyard_router_errors_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// The request is malformed (400).
    BadRequest,
    /// No endpoint or model of that name, or no such path (404).
    UnknownEndpoint,
    /// The body is over the limit (413).
    TooLarge,
    /// The client did not send its body within `--client-body-timeout-seconds` (408).
    ClientTimeout,
    /// No routing state, or no healthy instance (503).
    Unavailable,
    /// Refused by an admission limit: `--max-in-flight`, `--max-buffered-bytes` or
    /// `--max-connections` (503 with `Retry-After`).
    Overloaded,
    /// The instance answered with an error status on a native path (424 ModelError).
    ModelError,
    /// No candidate could be reached (every attempt failed before sending; 503).
    UpstreamFailed,
    /// The connection to the instance failed after the request was sent; not retried, since
    /// the engine may have done the work (502).
    UpstreamReset,
    /// The instance sent no response head within `--upstream-header-timeout-seconds` (504).
    UpstreamTimeout,
    /// A streamed answer stalled for `--stream-idle-timeout-seconds` after it began.
    StreamIdleTimeout,
    /// The client went away before its answer was complete.
    ClientGone,
    /// The client stopped reading its answer for `--stream-idle-timeout-seconds`; its
    /// connection was closed.
    ClientStalled,
    /// A request about a stored response (Responses API) whose instance is not routable now,
    /// or whose id no Switchyard router issued (404 `response_not_found`).
    ResponseNotFound,
}

impl ErrorKind {
    pub const ALL: [ErrorKind; 14] = [
        ErrorKind::BadRequest,
        ErrorKind::UnknownEndpoint,
        ErrorKind::TooLarge,
        ErrorKind::ClientTimeout,
        ErrorKind::Unavailable,
        ErrorKind::Overloaded,
        ErrorKind::ModelError,
        ErrorKind::UpstreamFailed,
        ErrorKind::UpstreamReset,
        ErrorKind::UpstreamTimeout,
        ErrorKind::StreamIdleTimeout,
        ErrorKind::ClientGone,
        ErrorKind::ClientStalled,
        ErrorKind::ResponseNotFound,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            ErrorKind::BadRequest => "bad_request",
            ErrorKind::UnknownEndpoint => "unknown_endpoint",
            ErrorKind::TooLarge => "too_large",
            ErrorKind::ClientTimeout => "client_timeout",
            ErrorKind::Unavailable => "unavailable",
            ErrorKind::Overloaded => "overloaded",
            ErrorKind::ModelError => "model_error",
            ErrorKind::UpstreamFailed => "upstream_failed",
            ErrorKind::UpstreamReset => "upstream_reset",
            ErrorKind::UpstreamTimeout => "upstream_timeout",
            ErrorKind::StreamIdleTimeout => "stream_idle_timeout",
            ErrorKind::ClientGone => "client_gone",
            ErrorKind::ClientStalled => "client_stalled",
            ErrorKind::ResponseNotFound => "response_not_found",
        }
    }

    /// Position in [`ErrorKind::ALL`] (a counter index).
    pub fn index(self) -> usize {
        self as usize
    }
}

#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: StatusCode,
    /// SageMaker error code.
    pub sagemaker_code: &'static str,
    /// OpenAI error type.
    pub openai_type: &'static str,
    /// OpenAI error code (machine-readable).
    pub openai_code: &'static str,
    pub message: String,
    /// Which field was wrong, when one was (OpenAI `param`).
    pub param: Option<&'static str>,
    pub kind: ErrorKind,
    /// `Retry-After`, when the client may simply try again later (boxed: errors travel in
    /// `Result`s on the request path and should stay small).
    pub retry_after: Option<Box<HeaderValue>>,
    /// The instance's own status, for SageMaker's `OriginalStatusCode` (ModelError).
    pub original_status: Option<StatusCode>,
}

impl ApiError {
    fn new(status: StatusCode, kind: ErrorKind, message: String) -> Self {
        Self {
            status,
            sagemaker_code: "ValidationError",
            openai_type: "invalid_request_error",
            openai_code: "invalid_request",
            message,
            param: None,
            kind,
            retry_after: None,
            original_status: None,
        }
    }

    pub fn validation(message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::BAD_REQUEST,
            ErrorKind::BadRequest,
            message.into(),
        )
    }

    pub fn with_param(mut self, param: &'static str) -> Self {
        self.param = Some(param);
        self
    }

    pub fn unknown_endpoint(message: impl Into<String>) -> Self {
        Self {
            openai_code: "model_not_found",
            ..Self::new(
                StatusCode::NOT_FOUND,
                ErrorKind::UnknownEndpoint,
                message.into(),
            )
        }
    }

    /// A path the router does not serve (OpenAI answers `Invalid URL (METHOD /path)`).
    pub fn unknown_path(method: &http::Method, path: &str) -> Self {
        Self {
            openai_code: "unknown_url",
            ..Self::new(
                StatusCode::NOT_FOUND,
                ErrorKind::UnknownEndpoint,
                format!(
                    "Invalid URL ({method} {path}): no such path on this router (see the \
                     Switchyard README for the paths it serves)"
                ),
            )
        }
    }

    /// A path the router serves, with a method it does not serve there (405).
    pub fn method_not_allowed(method: &http::Method, path: &str) -> Self {
        Self {
            openai_code: "method_not_allowed",
            ..Self::new(
                StatusCode::METHOD_NOT_ALLOWED,
                ErrorKind::BadRequest,
                format!("Method not allowed: {path} does not take {method}"),
            )
        }
    }

    /// A stored response the router cannot reach: its instance is gone, or its id was not
    /// issued by a Switchyard router (404, OpenAI's `response_not_found`).
    pub fn response_not_found(message: impl Into<String>, param: &'static str) -> Self {
        Self {
            openai_code: "response_not_found",
            param: Some(param),
            ..Self::new(
                StatusCode::NOT_FOUND,
                ErrorKind::ResponseNotFound,
                message.into(),
            )
        }
    }

    pub fn too_large(limit: usize) -> Self {
        Self {
            openai_code: "request_too_large",
            ..Self::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                ErrorKind::TooLarge,
                format!("the request body exceeds {limit} bytes"),
            )
        }
    }

    pub fn client_timeout(message: impl Into<String>) -> Self {
        Self {
            openai_type: "timeout",
            openai_code: "client_body_timeout",
            ..Self::new(
                StatusCode::REQUEST_TIMEOUT,
                ErrorKind::ClientTimeout,
                message.into(),
            )
        }
    }

    pub fn unavailable(message: impl Into<String>) -> Self {
        Self {
            sagemaker_code: "ServiceUnavailable",
            openai_type: "service_unavailable",
            openai_code: "service_unavailable",
            ..Self::new(
                StatusCode::SERVICE_UNAVAILABLE,
                ErrorKind::Unavailable,
                message.into(),
            )
        }
    }

    /// Refused by an admission limit: 503 with `Retry-After: 1`.
    pub fn overloaded(message: impl Into<String>) -> Self {
        Self {
            kind: ErrorKind::Overloaded,
            openai_code: "overloaded",
            retry_after: Some(Box::new(HeaderValue::from_static("1"))),
            ..Self::unavailable(message)
        }
    }

    /// No candidate could be reached: nothing was sent anywhere, so a retry is safe.
    pub fn upstream_failed(message: impl Into<String>) -> Self {
        Self {
            kind: ErrorKind::UpstreamFailed,
            openai_code: "upstream_unreachable",
            retry_after: Some(Box::new(HeaderValue::from_static("1"))),
            ..Self::unavailable(message)
        }
    }

    /// The instance's connection failed after the request was written to it.
    pub fn upstream_reset(message: impl Into<String>) -> Self {
        Self {
            sagemaker_code: "ModelError",
            openai_type: "api_error",
            openai_code: "upstream_reset",
            ..Self::new(
                StatusCode::BAD_GATEWAY,
                ErrorKind::UpstreamReset,
                message.into(),
            )
        }
    }

    /// No response head from the instance in time.
    pub fn upstream_timeout(message: impl Into<String>) -> Self {
        Self {
            sagemaker_code: "ModelError",
            openai_type: "timeout",
            openai_code: "upstream_timeout",
            ..Self::new(
                StatusCode::GATEWAY_TIMEOUT,
                ErrorKind::UpstreamTimeout,
                message.into(),
            )
        }
    }

    /// The model container answered with an error (native API: SageMaker's 424 ModelError,
    /// with the container's status as `OriginalStatusCode`).
    pub fn model_error(original: StatusCode, message: impl Into<String>) -> Self {
        Self {
            sagemaker_code: "ModelError",
            openai_type: "api_error",
            openai_code: "model_error",
            original_status: Some(original),
            ..Self::new(
                StatusCode::FAILED_DEPENDENCY,
                ErrorKind::ModelError,
                message.into(),
            )
        }
    }

    pub fn into_response_for(self, api: Api) -> Response {
        // The request may have reached the engine: the client must not resend it. SageMaker's
        // own answer to a container that failed or timed out is 424 ModelError with
        // OriginalStatusCode 0, which boto3 does not retry (it retries 500/502/503/504);
        // OpenAI's Python client retries 502/504 unless told `x-should-retry: false`.
        let maybe_delivered = matches!(
            self.kind,
            ErrorKind::UpstreamReset | ErrorKind::UpstreamTimeout
        );
        let status = match api {
            Api::Native if maybe_delivered => StatusCode::FAILED_DEPENDENCY,
            _ => self.status,
        };
        let original_status = match api {
            Api::Native if maybe_delivered => Some(0),
            _ => self.original_status.map(|status| status.as_u16()),
        };
        let body = match api {
            Api::Native => match original_status {
                Some(original) => serde_json::json!({
                    "ErrorCode": self.sagemaker_code,
                    "Message": self.message,
                    "OriginalStatusCode": original,
                }),
                None => serde_json::json!({
                    "ErrorCode": self.sagemaker_code,
                    "Message": self.message,
                }),
            },
            Api::OpenAi => serde_json::json!({
                "error": {
                    "message": self.message,
                    "type": self.openai_type,
                    "param": self.param,
                    "code": self.openai_code,
                }
            }),
        };
        let mut response = (status, axum::Json(body)).into_response();
        let headers = response.headers_mut();
        if api == Api::OpenAi && maybe_delivered {
            headers.insert(
                crate::headers::SHOULD_RETRY,
                HeaderValue::from_static("false"),
            );
        }
        if api == Api::Native {
            headers.insert(
                crate::headers::ERROR_TYPE,
                HeaderValue::from_static(self.sagemaker_code),
            );
        }
        if let Some(seconds) = self.retry_after {
            headers.insert(http::header::RETRY_AFTER, *seconds);
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_index_their_labels() {
        for (index, kind) in ErrorKind::ALL.iter().enumerate() {
            assert_eq!(kind.index(), index, "{kind:?}");
        }
        let labels: std::collections::HashSet<&str> =
            ErrorKind::ALL.iter().map(|kind| kind.as_str()).collect();
        assert_eq!(labels.len(), ErrorKind::ALL.len());
    }

    #[test]
    fn an_answer_that_may_have_reached_the_engine_tells_clients_not_to_resend() {
        for error in [
            ApiError::upstream_reset("reset"),
            ApiError::upstream_timeout("timeout"),
        ] {
            let openai = error.clone().into_response_for(Api::OpenAi);
            assert!(openai.status().is_server_error());
            assert_eq!(openai.headers()["x-should-retry"], "false");
            let native = error.into_response_for(Api::Native);
            assert_eq!(native.status(), StatusCode::FAILED_DEPENDENCY);
            assert_eq!(native.headers()["x-amzn-errortype"], "ModelError");
        }
        let refused = ApiError::upstream_failed("nothing sent").into_response_for(Api::OpenAi);
        assert!(refused.headers().get("x-should-retry").is_none());
    }

    #[tokio::test]
    async fn overload_carries_retry_after_in_both_shapes() {
        for api in [Api::Native, Api::OpenAi] {
            let response = ApiError::overloaded("busy").into_response_for(api);
            assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
            assert_eq!(response.headers()[http::header::RETRY_AFTER], "1");
        }
    }

    #[tokio::test]
    async fn model_errors_keep_the_original_status() {
        use http_body_util::BodyExt;
        let response = ApiError::model_error(StatusCode::TOO_MANY_REQUESTS, "slow down")
            .into_response_for(Api::Native);
        assert_eq!(response.status(), StatusCode::FAILED_DEPENDENCY);
        let body = response.into_body().collect().await.unwrap().to_bytes();
        let json: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(json["ErrorCode"], "ModelError");
        assert_eq!(json["OriginalStatusCode"], 429);
    }
}
