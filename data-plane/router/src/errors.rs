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
    /// The metrics label of this error.
    pub kind: &'static str,
}

impl ApiError {
    pub fn validation(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            sagemaker_code: "ValidationError",
            openai_type: "invalid_request_error",
            openai_code: "invalid_request",
            message: message.into(),
            param: None,
            kind: "bad_request",
        }
    }

    pub fn with_param(mut self, param: &'static str) -> Self {
        self.param = Some(param);
        self
    }

    pub fn unknown_endpoint(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::NOT_FOUND,
            openai_code: "model_not_found",
            kind: "unknown_endpoint",
            ..Self::validation(message)
        }
    }

    pub fn too_large(limit: usize) -> Self {
        Self {
            status: StatusCode::PAYLOAD_TOO_LARGE,
            openai_code: "request_too_large",
            kind: "too_large",
            ..Self::validation(format!("the request body exceeds {limit} bytes"))
        }
    }

    pub fn unavailable(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::SERVICE_UNAVAILABLE,
            sagemaker_code: "ServiceUnavailable",
            openai_type: "service_unavailable",
            openai_code: "service_unavailable",
            message: message.into(),
            param: None,
            kind: "unavailable",
        }
    }

    /// The model container answered with an error (native API: SageMaker's 424 ModelError).
    pub fn model_error(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::FAILED_DEPENDENCY,
            sagemaker_code: "ModelError",
            openai_type: "api_error",
            openai_code: "model_error",
            message: message.into(),
            param: None,
            kind: "model_error",
        }
    }

    pub fn into_response_for(self, api: Api) -> Response {
        let body = match api {
            Api::Native => serde_json::json!({
                "ErrorCode": self.sagemaker_code,
                "Message": self.message,
            }),
            Api::OpenAi => serde_json::json!({
                "error": {
                    "message": self.message,
                    "type": self.openai_type,
                    "param": self.param,
                    "code": self.openai_code,
                }
            }),
        };
        let mut response = (self.status, axum::Json(body)).into_response();
        if api == Api::Native {
            response.headers_mut().insert(
                "x-amzn-errortype",
                HeaderValue::from_static(self.sagemaker_code),
            );
        }
        response
    }
}
