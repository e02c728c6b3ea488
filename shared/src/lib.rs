//! Switchyard's domain types, shared by every component: typed names, endpoint configs and
//! their production variants, disaggregation settings, endpoints, instances, the state routers
//! follow, their validation (the field named in SageMaker's spelling), the SageMaker JSON
//! reader. No I/O, no runtime, no protobuf (`switchyard-proto` converts).

pub mod disaggregation;
pub mod endpoint;
pub mod error;
pub mod instance;
pub mod names;
pub mod sagemaker;
pub mod sync;
pub mod tokenizer_name;
pub mod variant;

pub use disaggregation::{
    DecodeRoutingStrategy, DisaggregationConfig, KvTransferProtocol, PrefillRoutingStrategy,
    ThresholdBasis,
};
pub use endpoint::*;
pub use error::ValidationError;
pub use instance::*;
pub use names::{EndpointConfigName, EndpointName, InstanceId, InvalidName, VariantName};
pub use sync::InstanceKey;
pub use variant::*;
