//! Switchyard's common crate: the domain types every component shares (names, endpoint
//! configs, endpoints, instances), their validation, the SageMaker JSON reader, the protobuf
//! conversions, and small process helpers (logging, exit codes, Prometheus text).

pub mod disaggregation;
pub mod metrics;
pub mod model;
pub mod names;
pub mod otlp;
pub mod pb;
pub mod process;
pub mod sagemaker;
pub mod sync;
pub mod telemetry;

pub use disaggregation::{
    DecodeRoutingStrategy, DisaggregationConfig, KvTransferProtocol, PrefillRoutingStrategy,
    ThresholdBasis,
};
pub use model::*;
pub use names::{EndpointConfigName, EndpointName, InstanceId, InvalidName, VariantName};
pub use sync::InstanceKey;
