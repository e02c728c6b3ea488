//! The integration-test harness: what the tests need of Switchyard itself, on top of the
//! generic test kit (`switchyard-testkit`: etcd, the PKI, processes, HTTP, metrics, waiting),
//! which is re-exported here, so that `use switchyard_tests::*` gives a test both.
//!
//! - admin calls: a bounded client, configs from SageMaker JSON, endpoints, registrations;
//! - control planes in this process (on etcd or an embedded store) and as processes;
//! - routers in this process (following control planes, or from a static file), what they
//!   route to, and their counts back at zero ([`settles`]);
//! - [`Cluster`]: the local cluster of `switchyard up` on a real etcd;
//! - request bodies and prompts; simulated engines as the tests configure them;
//! - [`Relay`] (a freezable TCP relay), [`HealthServer`] (an instance whose health a test
//!   controls), [`SwitchyardUp`] (`switchyard up` as a process).
//!
//! Nothing is mocked: every server is real, on `127.0.0.1:0`, and every wait has a deadline.

mod admin;
mod bodies;
mod cluster;
mod control;
mod engines;
mod health_server;
mod relay;
mod router;
mod up;

pub use admin::{
    RPC_TIMEOUT, admin, config_request, config_request_with_health, create_endpoint,
    create_quiet_endpoint, first_instance_health, listed_instances, register, variant_json,
    wait_leader,
};
pub use bodies::{chat_body, prompt, words};
pub use cluster::Cluster;
pub use control::{
    control_plane, control_process, embedded_control_plane, etcd_control_plane,
    etcd_control_process,
};
pub use engines::{
    fast, instance_ids, kv_sim, place, place_sharing_starts, real_time, sim_tokens, stand_in,
};
pub use health_server::HealthServer;
pub use relay::Relay;
pub use router::{
    chat_url, invocations_url, routed_count, routed_instances, router, router_from_file,
    router_with, settles, wait_for_router_instances,
};
pub use switchyard_testkit::{
    Body, Etcd, EtcdCluster, EtcdMember, HTTP_TIMEOUT, Metrics, Process, RefusingPort, Reply,
    STEP_TIMEOUT, Sample, TestPki, binary, bounded, bounded_for, eventually, frames_text, http_get,
    http_post, http_post_frames, http_request, listens_in_this_process, loopback_any, metric,
    post_streaming, read_body, signal, test_python, wait_matched, workspace_root,
};
pub use up::SwitchyardUp;
