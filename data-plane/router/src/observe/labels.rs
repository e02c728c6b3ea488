//! The label values the router's metrics and answers share: why a request went where it went
//! (`x-switchyard-route`, the `route` label) and how an attempt failed (the `kind` label).

use switchyard_policy::rank::Route;

/// What became of a broken stream of a variant with a MigrationLimit: the `outcome` label of
/// `switchyard_router_migrations_total` and `switchyard_router_instance_migrations_total`.
/// `continued`: another instance took it up; `whole`: only its end was lost (it had finished),
/// so it was ended; `limit`: the limit was reached or the request cannot be continued (an
/// error event ends it); `failed`: no instance took the continuation (an error event ends it).
pub const MIGRATION_OUTCOMES: [&str; 4] = ["continued", "whole", "limit", "failed"];

/// Why a request went to an instance: the policy's routes, plus the router's own retries.
/// The `route` label of `switchyard_router_requests_total` and `x-switchyard-route`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RouteLabel {
    Prefix,
    Overflow,
    Random,
    LeastOutstanding,
    Session,
    /// KV_AWARE: the instance holding most of the prompt's KV cache.
    Kv,
    /// A disaggregated endpoint's short prompt, served whole by a decoder.
    Direct,
    /// A long prompt prefilled on one instance and decoded on another.
    Disaggregated,
    /// The prefill failed or timed out: the decoder serves the whole request.
    Fallback,
    /// The instance that stores the response a request is about (Responses API).
    Response,
    /// The previous candidate provably never received the request.
    Retry,
    /// The previous candidate may have received it (`--retry-after-send`).
    RetryAfterSend,
}

impl RouteLabel {
    pub const ALL: [RouteLabel; 12] = [
        RouteLabel::Prefix,
        RouteLabel::Overflow,
        RouteLabel::Random,
        RouteLabel::LeastOutstanding,
        RouteLabel::Session,
        RouteLabel::Kv,
        RouteLabel::Direct,
        RouteLabel::Disaggregated,
        RouteLabel::Fallback,
        RouteLabel::Response,
        RouteLabel::Retry,
        RouteLabel::RetryAfterSend,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            RouteLabel::Prefix => Route::Prefix.as_str(),
            RouteLabel::Overflow => Route::Overflow.as_str(),
            RouteLabel::Random => Route::Random.as_str(),
            RouteLabel::LeastOutstanding => Route::LeastOutstanding.as_str(),
            RouteLabel::Session => Route::Session.as_str(),
            RouteLabel::Kv => Route::Kv.as_str(),
            RouteLabel::Direct => "direct",
            RouteLabel::Disaggregated => "disaggregated",
            RouteLabel::Fallback => "fallback",
            RouteLabel::Response => Route::Response.as_str(),
            RouteLabel::Retry => "retry",
            RouteLabel::RetryAfterSend => "retry-after-send",
        }
    }
}

impl From<Route> for RouteLabel {
    fn from(route: Route) -> Self {
        match route {
            Route::Prefix => RouteLabel::Prefix,
            Route::Overflow => RouteLabel::Overflow,
            Route::Random => RouteLabel::Random,
            Route::LeastOutstanding => RouteLabel::LeastOutstanding,
            Route::Session => RouteLabel::Session,
            Route::Kv => RouteLabel::Kv,
            Route::Response => RouteLabel::Response,
        }
    }
}

/// How a request to an instance failed: the `kind` label of
/// `switchyard_router_upstream_errors_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UpstreamError {
    /// Not reached: connection refused or timed out, stream refused (retried elsewhere).
    Refused,
    /// The connection failed after the request was sent (answered 502, or cut mid-answer).
    Reset,
    /// No response head in time (504).
    Timeout,
    /// The answer stalled after it began.
    StreamIdle,
}

impl UpstreamError {
    pub const ALL: [UpstreamError; 4] = [
        UpstreamError::Refused,
        UpstreamError::Reset,
        UpstreamError::Timeout,
        UpstreamError::StreamIdle,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            UpstreamError::Refused => "refused",
            UpstreamError::Reset => "reset",
            UpstreamError::Timeout => "timeout",
            UpstreamError::StreamIdle => "stream_idle",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn route_labels_and_upstream_error_kinds_are_the_documented_values() {
        // x-switchyard-route and the `route` label (README.md), the `kind` label of
        // switchyard_router_upstream_errors_total (docs/failure-behaviour.md).
        let routes: Vec<&str> = RouteLabel::ALL.iter().map(|label| label.as_str()).collect();
        assert_eq!(
            routes,
            [
                "prefix",
                "overflow",
                "random",
                "least-outstanding",
                "session",
                "kv",
                "direct",
                "disaggregated",
                "fallback",
                "response",
                "retry",
                "retry-after-send"
            ]
        );
        for route in Route::ALL {
            assert_eq!(RouteLabel::from(route).as_str(), route.as_str());
        }
        let kinds: Vec<&str> = UpstreamError::ALL
            .iter()
            .map(|kind| kind.as_str())
            .collect();
        assert_eq!(kinds, ["refused", "reset", "timeout", "stream_idle"]);
    }
}
