//! What every API of the simulator answers with: which OpenAI API a request is for, and an
//! error as vLLM sends it.

use axum::Json;
use axum::response::{IntoResponse, Response};
use http::StatusCode;
use serde_json::{Value, json};

/// Chat completions or (text) completions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ApiKind {
    Chat,
    Completion,
}

/// An OpenAI-style error as vLLM sends it: `{"error": {"message", "type", "param", "code"}}`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub error_type: &'static str,
    pub param: Option<&'static str>,
    /// Raised as vLLM's `VLLMValidationError`, which passes through a request model's
    /// validation (unlike pydantic's own errors): it ends `/invocations`' search for a
    /// request type that fits.
    pub raised: bool,
}

impl ApiError {
    pub(crate) fn bad_request(message: String) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            message,
            error_type: "BadRequestError",
            param: None,
            raised: false,
        }
    }

    pub(crate) fn model_not_found(model: &str) -> Self {
        Self {
            status: StatusCode::NOT_FOUND,
            message: format!("The model `{model}` does not exist."),
            error_type: "NotFoundError",
            param: Some("model"),
            raised: false,
        }
    }

    pub(crate) fn not_found(message: String) -> Self {
        Self {
            status: StatusCode::NOT_FOUND,
            message,
            error_type: "NotFoundError",
            param: None,
            raised: false,
        }
    }

    pub(crate) fn internal(message: String) -> Self {
        Self {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message,
            error_type: "InternalServerError",
            param: None,
            raised: false,
        }
    }

    pub(crate) fn unavailable(message: String) -> Self {
        Self {
            status: StatusCode::SERVICE_UNAVAILABLE,
            message,
            error_type: "ServiceUnavailableError",
            param: None,
            raised: false,
        }
    }

    pub(crate) fn param(mut self, param: &'static str) -> Self {
        self.param = Some(param);
        self
    }

    pub(crate) fn to_json(&self) -> Value {
        json!({
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.status.as_u16(),
            }
        })
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, Json(self.to_json())).into_response()
    }
}

/// So that `?` answers a handler's `Result<_, Response>` with the error.
impl From<ApiError> for Response {
    fn from(error: ApiError) -> Self {
        error.into_response()
    }
}
