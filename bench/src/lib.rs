//! `switchyard-bench`: Switchyard's load generator and benchmark report.
//!
//! - [`workload`]: deterministic traces (long context, ShareGPT-like chats, RAG, mixed);
//! - [`oracle`]: the best hit rate any placement could reach on a trace;
//! - [`client`] and [`run`]: streaming requests timed on the wall clock, closed or open loop;
//! - [`compare`]: every strategy on fresh engines, side by side ([`demo`]), with PREFIX_AWARE's
//!   bounded-load extension and peer routers ([`peer`]) as further columns, and how often
//!   several routers disagree ([`agreement`]);
//! - [`drive`]: an existing router; [`overhead`]: the latency the router adds;
//!   [`overload`]: the router's memory under a flood of large requests;
//! - [`fleet`]: the control plane and the sync protocol at fleet scale;
//! - [`dpd`]: disaggregated prefill/decode against colocated engines of the same count;
//! - [`report`], [`svg`], [`stats`], [`scrape`]: numbers, table, JSON, chart.
//!
//! Latencies are measured on the wall clock. Simulated engines run on a scaled clock
//! (`--time-scale`); reports give wall ms and model ms = wall ms / time scale.

pub mod agreement;
pub mod client;
pub mod compare;
pub mod dpd;
pub mod drive;
pub mod fleet;
pub mod forward;
pub mod oracle;
pub mod overhead;
pub mod overload;
pub mod peer;
pub mod report;
pub mod run;
pub mod scrape;
pub mod stats;
pub mod svg;
pub mod workload;

pub use compare::{Arm, CompareSettings, DemoArgs, Preset, Strategy, UsageError, compare, demo};
pub use dpd::{DpdArgs, DpdReport, DpdSettings, dpd, dpd_compare};
pub use drive::{DriveArgs, drive};
pub use fleet::{FleetArgs, FleetReport, fleet};
pub use overhead::{OverheadArgs, OverheadReport, overhead};
pub use overload::{OverloadArgs, OverloadReport, overload};
pub use peer::Peer;
pub use report::LoadBalanceSetting;
pub use report::Report;
pub use workload::{Trace, WorkloadKind, WorkloadSpec};
