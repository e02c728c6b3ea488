//! The key layout, relative to the store's namespace (etcd: `--etcd-prefix`, default
//! `/switchyard/v1/`). Values are JSON in the SageMaker-shaped form of `switchyard_shared`.
//!
//! | key | value | lease |
//! | --- | --- | --- |
//! | `state/endpoint-configs/{name}` | `EndpointConfig` | none |
//! | `state/endpoints/{name}` | `Endpoint` | none |
//! | `state/instances/{endpoint}/{id}` | `Instance` | the instance's, when registered with a TTL |
//! | `sagemaker/endpoint-configs/{name}` | the SageMaker API's fields of that config that Switchyard does not use, given back by its DescribeEndpointConfig | none |
//! | `state/cluster-id` | random id made by the first control plane on this store | none |
//! | `leader` | replica id of the leader | the leader's |
//! | `load/{replica}` | in-flight counts of the routers connected to that replica | the replica's |
//!
//! Everything routers need lives under `state/`, so one watch with one revision sequence
//! covers it. The cluster id is there too, so a listing gives the id and the revision together:
//! routers order states by (cluster id, revision) and never go back within one cluster.

pub const STATE: &str = "state/";
pub const CONFIGS: &str = "state/endpoint-configs/";
pub const ENDPOINTS: &str = "state/endpoints/";
pub const INSTANCES: &str = "state/instances/";
pub const SAGEMAKER_CONFIGS: &str = "sagemaker/endpoint-configs/";
pub const CLUSTER_ID: &str = "state/cluster-id";
pub const LEADER: &str = "leader";
pub const LOAD: &str = "load/";

pub fn config(name: &str) -> String {
    format!("{CONFIGS}{name}")
}

pub fn sagemaker_config(name: &str) -> String {
    format!("{SAGEMAKER_CONFIGS}{name}")
}

pub fn endpoint(name: &str) -> String {
    format!("{ENDPOINTS}{name}")
}

pub fn instances_of(endpoint: &str) -> String {
    format!("{INSTANCES}{endpoint}/")
}

pub fn instance(endpoint: &str, id: &str) -> String {
    format!("{INSTANCES}{endpoint}/{id}")
}

pub fn load(replica: &str) -> String {
    format!("{LOAD}{replica}")
}
