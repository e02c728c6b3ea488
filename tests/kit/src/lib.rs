//! `switchyard-testkit`: the test infrastructure of Switchyard's integration tests and
//! benchmarks, with nothing Switchyard-specific in it. Only tests and benchmarks depend on it
//! (`tests/tests/architecture.rs` holds every product crate to that), so no test helper ends
//! up in a binary users run.
//!
//! - [`etcd`]: a real etcd (Debian's `etcd-server`) per test, plain or TLS, and clusters of
//!   members that can be frozen;
//! - [`pki`]: a throwaway CA with server and client certificates;
//! - [`process`]: the workspace's built binaries as real processes (refused when older than
//!   their sources), signals, the test venv's Python;
//! - [`ports`]: loopback addresses, one held to refuse connections, and whether this process
//!   listens on one;
//! - [`wait`]: waiting with a deadline;
//! - [`http`]: HTTP/1 exchanges with a deadline, whole or frame by frame;
//! - [`metrics`]: samples of a Prometheus text page, by their whole name and labels;
//! - [`otlp_sink`]: an OTLP/gRPC trace receiver.
//!
//! Rules the helpers keep, so that tests run in parallel without taking each other's ports or
//! hanging CI: every server binds `127.0.0.1:0` and reports the port it got (etcd cannot, so
//! its start is retried on a conflict); an address meant to refuse connections is held bound
//! by [`RefusingPort`] so nobody else can take it; every wait and every HTTP exchange has a
//! deadline; a binary older than its sources is refused ([`binary`]).

pub mod etcd;
pub mod http;
pub mod metrics;
pub mod otlp_sink;
pub mod pki;
pub mod ports;
pub mod process;
pub mod wait;

pub use etcd::{Etcd, EtcdCluster, EtcdMember};
pub use http::{
    Body, HTTP_TIMEOUT, Reply, frames_text, http_get, http_post, http_post_frames, http_request,
    post_streaming, read_body,
};
pub use metrics::{Metrics, Sample, metric};
pub use pki::TestPki;
pub use ports::{RefusingPort, listens_in_this_process, loopback_any};
pub use process::{Process, binary, signal, test_python, workspace_root};
pub use wait::{STEP_TIMEOUT, bounded, bounded_for, eventually, wait_matched};
