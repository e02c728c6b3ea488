//! The routing strategies of SageMaker's RoutingConfig, as the benchmarks name them.

use serde::Serialize;

/// A routing strategy of SageMaker's RoutingConfig.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, clap::ValueEnum, Serialize)]
pub enum Strategy {
    #[value(name = "RANDOM", alias = "random")]
    Random,
    #[value(
        name = "LEAST_OUTSTANDING_REQUESTS",
        alias = "least-outstanding-requests"
    )]
    LeastOutstandingRequests,
    #[value(name = "PREFIX_AWARE", alias = "prefix-aware")]
    PrefixAware,
    /// The engines publish their KV-cache events (vLLM's format) for these runs.
    #[value(name = "KV_AWARE", alias = "kv-aware")]
    KvAware,
}

impl Strategy {
    pub const ALL: [Strategy; 4] = [
        Strategy::Random,
        Strategy::LeastOutstandingRequests,
        Strategy::PrefixAware,
        Strategy::KvAware,
    ];

    /// The `RoutingStrategy` value.
    pub fn as_str(self) -> &'static str {
        match self {
            Strategy::Random => "RANDOM",
            Strategy::LeastOutstandingRequests => "LEAST_OUTSTANDING_REQUESTS",
            Strategy::PrefixAware => "PREFIX_AWARE",
            Strategy::KvAware => "KV_AWARE",
        }
    }
}
