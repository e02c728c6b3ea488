//! `switchyard-bench`: Switchyard's load generator and benchmark report.
//!
//! - [`workload`]: deterministic traces (long context, ShareGPT-like chats, RAG, mixed);
//! - [`oracle`]: the best hit rate any placement could reach on a trace;
//! - [`client`] and [`run`]: streaming requests timed on the wall clock, closed or open loop;
//! - [`compare`](mod@compare): every strategy on fresh engines, side by side ([`demo`]), with
//!   PREFIX_AWARE's bounded-load extension and peer routers ([`peer`]) as further columns, and
//!   how often several routers disagree ([`agreement`]);
//! - [`drive`](mod@drive): an existing router; [`overhead`](mod@overhead): the latency the
//!   router adds; [`overload`](mod@overload): the router's memory under a flood of large
//!   requests;
//! - [`fleet`](mod@fleet): the control plane and the sync protocol at fleet scale;
//! - [`dpd`](mod@dpd): disaggregated prefill/decode against colocated engines of the same
//!   count; [`flow`](mod@flow): flow control under a burst, without the cap and with it;
//! - [`report`]: the report of `compare` and of a driven router, its table, its [`svg`] chart
//!   and its JSON; [`output`]: what every benchmark's report shares (where it was measured,
//!   the command line, the JSON file); [`stats`], [`scrape`]: percentiles, `/metrics` pages.
//!
//! Under the benchmarks, inside the crate: the routing strategies (`strategy`), the
//! simulator as the benchmarks run it (`sim`), the trace with its oracle bound (`prepare`),
//! child processes and the workspace's executables (`child`), `/proc` readings (`procfs`),
//! flag defaults (`flags`) and the error of a bad flag ([`UsageError`], exit 64).
//!
//! Latencies are measured on the wall clock. Simulated engines run on a scaled clock
//! (`--time-scale`); reports give wall ms and model ms = wall ms / time scale.

pub mod agreement;
mod child;
pub mod client;
pub mod compare;
pub mod dpd;
pub mod drive;
mod error;
mod flags;
pub mod fleet;
pub mod flow;
pub mod forward;
pub mod oracle;
pub mod output;
pub mod overhead;
pub mod overload;
pub mod peer;
mod prepare;
mod procfs;
pub mod report;
pub mod run;
pub mod scrape;
mod sim;
pub mod stats;
mod strategy;
pub mod workload;

pub use compare::{Arm, CompareSettings, DemoArgs, Preset, compare, demo};
pub use dpd::{DpdArgs, DpdReport, DpdSettings, dpd, dpd_compare};
pub use drive::{DriveArgs, drive};
pub use error::UsageError;
pub use fleet::{FleetArgs, FleetReport, fleet};
pub use flow::{FlowArgs, FlowReport, flow};
pub use overhead::{OverheadArgs, OverheadReport, overhead};
pub use overload::{OverloadArgs, OverloadReport, overload};
pub use peer::Peer;
pub use report::LoadBalanceSetting;
pub use report::{Report, svg};
pub use strategy::Strategy;
pub use workload::{Trace, WorkloadKind, WorkloadSpec};
