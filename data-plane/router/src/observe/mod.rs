//! What the router tells about itself: Prometheus metrics (`metrics`, with the label values in
//! `labels`) and OpenTelemetry spans of each request (`trace`).

pub(crate) mod labels;
pub(crate) mod metrics;
pub(crate) mod trace;
