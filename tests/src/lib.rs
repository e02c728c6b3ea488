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
//! - KV_AWARE routing: simulators publishing KV events, the router's KV index waited on, the
//!   choice a routed answer reports;
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
mod kv;
mod relay;
mod router;
mod up;

pub use admin::{
    RPC_TIMEOUT, admin, config_request, config_request_with_health, create_endpoint,
    create_endpoint_from, create_quiet_endpoint, first_instance_health, listed_instances, register,
    switch_endpoint_config, variant_json, wait_first_instance_health, wait_leader,
};
pub use bodies::{SseLine, chat_body, choice_text, prompt, sse_lines, words};
pub use cluster::Cluster;
pub use control::{
    control_plane, control_process, embedded_admin, embedded_control_plane, etcd_admin,
    etcd_control_plane, etcd_control_process, etcd_replica_pair,
};
pub use engines::{
    fast, instance_ids, kv_sim, place, place_sharing_starts, prefix_cache_hits, real_time,
    sim_tokens, stand_in,
};
pub use health_server::HealthServer;
pub use kv::{
    assert_repaired_without_rebuild, kv_instances, kv_sim_replaying_3_batches, kv_sims,
    kv_variant_index, place_after_lost_batches, place_past_the_replay_buffer, routed_choice,
    three_small_kv_sims, wait_kv_index, wait_router_matched,
};
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
